/* What the CPU offers: AVX-512 VNNI, which the step needs, and AMX int8 tiles.
   Included by kernels.c: the step is one translation unit. */

/* Scalar helpers (no instruction-set requirement). */
int llmopt_native_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

/* Whether this process may run AMX int8 tiles: the CPU has them and the kernel grants the
   tile state (Linux 5.16 and later; asking again is harmless). A model's knobs.amx may be
   1 only where this returned 1. */
int llmopt_native_amx_available(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    const unsigned tile = 1u << 24, int8 = 1u << 25;
    return (edx & tile) && (edx & int8)
        && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
}

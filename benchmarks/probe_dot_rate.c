/* The int8 dot-product ceiling of this core (#14): VPDPBUSD issued as fast as
   the core takes it, and the native step's 4-bit slice body (runtime/native/kernels.c's
   tile8_q4: unpack four vectors of nibbles into eight code vectors, then 64 dots of
   broadcast activation codes) on data in L1. Each chain variant runs `reps` passes of 12
   dots, the slice body reps / 4 passes of 64; prints "name G-dots-per-second" each.

   zmm            12 independent zmm VPDPBUSD chains (64 multiply-adds a dot)
   ymm            the same on ymm (32 multiply-adds a dot)
   zmm-broadcast  zmm chains, each dot's signed operand a 4-byte broadcast from memory
   slice-body     tile8_q4's slice: 4 loads, 4 shifts, 8 ANDs, 64 broadcasts and dots */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int data[1024] __attribute__((aligned(64)));

#define TWELVE(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#define DOT_ZMM(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define DOT_YMM(i) "vpdpbusd %%ymm30, %%ymm31, %%ymm" #i "\n\t"
#define DOT_BCST(i) "vpdpbusd 4*" #i "(%[p])%{1to16%}, %%zmm31, %%zmm" #i "\n\t"
#define CHAINS(body, reps) do { \
        long n = (reps); \
        __asm__ volatile("1:\n\t" TWELVE(body) "dec %[n]\n\tjnz 1b" \
                         : [n] "+r"(n) : [p] "r"(data) : "memory", "cc"); \
    } while (0)

#define UNPACK(j, lo, hi) \
    "vmovdqu64 64*" #j "(%[codes]), %%zmm" #lo "\n\t" \
    "vpsrlw $4, %%zmm" #lo ", %%zmm" #hi "\n\t" \
    "vpandd %%zmm27, %%zmm" #lo ", %%zmm" #lo "\n\t" \
    "vpandd %%zmm27, %%zmm" #hi ", %%zmm" #hi "\n\t"

static void slice_body(long reps) {
    const char *codes = (const char *)data;
    const int *act = data + 256;
    __asm__ volatile(
        "mov $0x0F0F0F0F, %%eax\n\t"  /* the nibble mask, as tile8_q4's low4 */
        "vpbroadcastd %%eax, %%zmm27\n"
        "1:\n\t"
        UNPACK(0, 8, 9) UNPACK(1, 10, 11) UNPACK(2, 12, 13) UNPACK(3, 14, 15)
        ".irp m,8,9,10,11,12,13,14,15\n\t"
        ".irp i,0,1,2,3,4,5,6,7\n\t"
        "vpbroadcastd 32*(\\m-8)+4*\\i(%[act]), %%zmm24\n\t"
        "vpdpbusd %%zmm24, %%zmm\\m, %%zmm\\i\n\t"
        ".endr\n\t"
        ".endr\n\t"
        "dec %[n]\n\tjnz 1b"
        : [n] "+r"(reps) : [codes] "r"(codes), [act] "r"(act) : "eax", "memory", "cc");
}

int main(int argc, char **argv) {
    const long reps = argc > 1 ? atol(argv[1]) : 8000000;
    double t = now();
    CHAINS(DOT_ZMM, reps);
    printf("zmm %.4f\n", 12.0 * reps / (now() - t) / 1e9);
    t = now();
    CHAINS(DOT_YMM, reps);
    printf("ymm %.4f\n", 12.0 * reps / (now() - t) / 1e9);
    t = now();
    CHAINS(DOT_BCST, reps);
    printf("zmm-broadcast %.4f\n", 12.0 * reps / (now() - t) / 1e9);
    t = now();
    slice_body(reps / 4);
    printf("slice-body %.4f\n", 64.0 * (reps / 4) / (now() - t) / 1e9);
    return 0;
}

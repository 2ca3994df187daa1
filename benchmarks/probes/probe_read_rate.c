/* The read bandwidth a loop like the native step's weight stream draws (runtime/native/
   gemm_vnni.c): 64-byte loads, every line prefetched into L1 PREFETCH_SLICES slices of 256
   bytes ahead and into L2 STREAM_PREFETCH_SLICES ahead, as a batch-1 step does, the range
   split between threads. numpy's reductions (one dependent stream, no prefetching)
   understate it on some machines. For benchmarks/_bandwidth_bound.py.

   probe_read_rate MIB THREADS REPEATS   prints "run0 GB/s run1 GB/s ..." over MIB MiB of ones
   probe_read_rate check                 checks that a read ORs every word of its range (a
                                         bit in any chunk, each thread's first and last,
                                         shows) at 1, 2 and 3 threads; prints "check ok"

   Prints the one word "unsupported" where the CPU lacks AVX-512. Build: -O2 -fopenmp. */
#define _POSIX_C_SOURCE 200112L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define PREFETCH_SLICES 16         /* runtime/native/native.h's */
#define STREAM_PREFETCH_SLICES 32

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

/* The OR of every 8-byte word of data [bytes] (a multiple of 256), so no load can be
   dropped. */
static uint64_t read_all(const uint8_t *data, int64_t bytes, int threads) {
    uint64_t result = 0;
    (void)threads;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: result)
    {
#ifdef _OPENMP
        const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        const int64_t id = 0, count = 1;
#endif
        const int64_t chunks = bytes / 256, lo = chunks * id / count;
        const int64_t hi = chunks * (id + 1) / count;
        __m512i seen[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(),
                           _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (const uint8_t *at = data + lo * 256; at < data + hi * 256; at += 256)
            for (int line = 0; line < 4; line++) {
                _mm_prefetch((const char *)at + PREFETCH_SLICES * 256 + 64 * line, _MM_HINT_T0);
                _mm_prefetch((const char *)at + STREAM_PREFETCH_SLICES * 256 + 64 * line,
                             _MM_HINT_T1);
                seen[line] = _mm512_or_si512(seen[line], _mm512_loadu_si512(at + 64 * line));
            }
        __m512i all = _mm512_or_si512(_mm512_or_si512(seen[0], seen[1]),
                                      _mm512_or_si512(seen[2], seen[3]));
        result |= (uint64_t)_mm512_reduce_or_epi64(all);
    }
    return result;
}
#pragma GCC pop_options

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A bit set at each of a few places of 7 chunks (not a multiple of the thread count)
   shows, in its byte of a 64-bit word, at every thread count. */
static int check(void) {
    enum { CHUNKS = 7 };
    static uint8_t data[CHUNKS * 256] __attribute__((aligned(64)));
    const int places[] = {0, 255, 256, 3 * 256 + 100, CHUNKS * 256 - 1};
    for (int threads = 1; threads <= 3; threads++)
        for (int i = 0; i < 5; i++) {
            const int at = places[i];
            memset(data, 0, sizeof data);
            data[at] = (uint8_t)(1u << (at % 8));
            const uint64_t expected = (uint64_t)1 << (at % 8 + 8 * (at % 8));
            if (read_all(data, sizeof data, threads) != expected) {
                printf("check failed at byte %d, %d threads\n", at, threads);
                return 1;
            }
        }
    printf("check ok\n");
    return 0;
}

int main(int argc, char **argv) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f")) {
        printf("unsupported\n");
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "check") == 0) return check();
    if (argc != 4) {
        fprintf(stderr, "usage: %s MIB THREADS REPEATS | check\n", argv[0]);
        return 2;
    }
    const int64_t bytes = (int64_t)atoi(argv[1]) << 20;
    const int threads = atoi(argv[2]), repeats = atoi(argv[3]);
    uint8_t *data = aligned_alloc(64, (size_t)bytes);
    if (!data) return 1;
    memset(data, 1, (size_t)bytes);  /* written once, so every page is resident */
    for (int r = 0; r < repeats; r++) {
        const double started = now();
        const uint64_t seen = read_all(data, bytes, threads);
        const double seconds = now() - started;
        if (seen != 0x0101010101010101ull) return 1;  /* the OR of every word of ones */
        printf("run%d %.3f ", r, (double)bytes / seconds / 1e9);
    }
    printf("\n");
    free(data);
    return 0;
}

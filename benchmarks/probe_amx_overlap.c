/* Does an AMX tile multiply overlap with AVX-512 float work on this core? (probe_amx_overlap.py
   builds and runs this; it prints one line per variant: name, ns per block tile.)

A block tile is what the native step's AMX path (runtime/native/kernels.c: amx_tile) does per
block of 32 activation columns: sixteen activation rows times sixteen weight columns, 8,192
multiply-adds, then the float sum the block's scales need (amx_add_block). Each variant runs
the part it names over SmolLM2's 18 blocks of K = 576, many times, with the data in L1, and
reports the time per block tile:

  tiles         tile zero, load A (16 x 32 bytes), load B (8 x 64), TDPBSSD, store C (1 KiB)
  tiles-nostore the same without the store
  dots          TDPBSSD alone, four sum tiles in turn
  sums          the float sum alone, from memory: per row load, convert, scale product, FMA
  tiles+sums    both, as amx_tile interleaves them (each pair's sums read a pair later)
  dots+sums     TDPBSSD and the float sum, no tile loads or stores
  tiles+fp      the tiles and the float sum's arithmetic on registers (no loads)
If the units overlapped, tiles+sums would cost about the larger of tiles and sums; where it
costs their sum, the step's AMX projections are bound by that sum. */
#define _GNU_SOURCE 1
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BLOCKS 18
#define STRIDE (BLOCKS * 32)

static int8_t act[16 * STRIDE] __attribute__((aligned(64)));
static int8_t codes[BLOCKS * 512] __attribute__((aligned(64)));
static int32_t sums[2][2][256] __attribute__((aligned(64)));
static int32_t stored[BLOCKS][256] __attribute__((aligned(64)));
static float row_scales[BLOCKS * 16], act_scales[BLOCKS * 16], out[256];

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3 sums, 4-5 activation codes (16 rows of 32), 6-7 weight codes (8 rows of 64). */
static void configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = tile < 6 ? 16 : 8;
        config.bytes_per_row[tile] = tile == 4 || tile == 5 ? 32 : 64;
    }
    _tile_loadconfig(&config);
}

/* Pair p's two blocks into sum tiles 0, 1 (even p) or 2, 3, as amx_tile multiplies them. */
#define MULTIPLY(c0, c1, p, store) do { \
        _tile_zero(c0); _tile_loadd(4, act + (p) * 64, STRIDE); \
        _tile_loadd(6, codes + (p) * 1024, 64); _tile_dpbssd(c0, 4, 6); \
        _tile_zero(c1); _tile_loadd(5, act + (p) * 64 + 32, STRIDE); \
        _tile_loadd(7, codes + (p) * 1024 + 512, 64); _tile_dpbssd(c1, 5, 7); \
        if (store) { \
            _tile_stored(c0, sums[(p) % 2][0], 64); \
            _tile_stored(c1, sums[(p) % 2][1], 64); \
        } \
    } while (0)

/* Block b's float sum from `from`, as amx_add_block computes it. */
#define SUM_BLOCK(b, from) do { \
        const __m512 scales = _mm512_loadu_ps(row_scales + (b) * 16); \
        for (int i = 0; i < 16; i++) \
            acc[i] = _mm512_fmadd_ps( \
                _mm512_cvtepi32_ps(_mm512_load_si512((from) + 16 * i)), \
                _mm512_mul_ps(scales, _mm512_set1_ps(act_scales[(b) * 16 + i])), acc[i]); \
    } while (0)

/* The same arithmetic on registers alone. */
#define FP_BLOCK() do { \
        for (int i = 0; i < 16; i++) { \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(acc[i])), \
                                     _mm512_mul_ps(x, y), acc[i]); \
            __asm__ volatile("" : "+v"(acc[i])); \
        } \
    } while (0)

#define VARIANT(name, body) \
    static __attribute__((noinline)) void name(long reps) { \
        __m512 acc[16]; \
        const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f); \
        (void)x; (void)y; \
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps(); \
        for (long r = 0; r < reps; r++) \
            for (int p = 0; p < BLOCKS / 2; p++) { body; } \
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(out + i * 16, acc[i]); \
    }

VARIANT(tiles, if (p % 2) MULTIPLY(2, 3, p, 1); else MULTIPLY(0, 1, p, 1))
VARIANT(tiles_nostore, if (p % 2) MULTIPLY(2, 3, p, 0); else MULTIPLY(0, 1, p, 0))
VARIANT(dots, _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7); _tile_dpbssd(2, 4, 6);
        _tile_dpbssd(3, 5, 7))
VARIANT(float_sums, SUM_BLOCK(2 * p, stored[2 * p]); SUM_BLOCK(2 * p + 1, stored[2 * p + 1]))
VARIANT(tiles_sums, if (p % 2) MULTIPLY(2, 3, p, 1); else MULTIPLY(0, 1, p, 1);
        SUM_BLOCK(2 * p, sums[(p + 1) % 2][0]); SUM_BLOCK(2 * p + 1, sums[(p + 1) % 2][1]))
VARIANT(dots_sums, if (p % 2) { _tile_dpbssd(2, 4, 6); _tile_dpbssd(3, 5, 7); }
        else { _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7); }
        SUM_BLOCK(2 * p, stored[2 * p]); SUM_BLOCK(2 * p + 1, stored[2 * p + 1]))
VARIANT(tiles_fp, if (p % 2) MULTIPLY(2, 3, p, 1); else MULTIPLY(0, 1, p, 1); FP_BLOCK();
        FP_BLOCK())

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    const long reps = argc > 1 ? atol(argv[1]) : 20000;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        puts("no-amx");
        return 0;
    }
    configure();
    unsigned seed = 1;
    for (size_t i = 0; i < sizeof act; i++)
        act[i] = (int8_t)((seed = seed * 1103515245 + 12345) >> 16);
    for (size_t i = 0; i < sizeof codes; i++)
        codes[i] = (int8_t)((seed = seed * 1103515245 + 12345) >> 16);
    for (int i = 0; i < BLOCKS * 16; i++) {
        row_scales[i] = 1e-3f * (float)(1 + i % 7);
        act_scales[i] = 1e-2f * (float)(1 + i % 5);
    }
    for (int b = 0; b < BLOCKS; b++)
        for (int i = 0; i < 256; i++) stored[b][i] = (int32_t)((b * 256 + i) % 1000) - 500;
    /* dots reads tiles 4-7 as loaded here */
    _tile_loadd(4, act, STRIDE); _tile_loadd(5, act + 32, STRIDE);
    _tile_loadd(6, codes, 64); _tile_loadd(7, codes + 512, 64);
    static const struct {
        const char *name;
        void (*run)(long);
        int dots_per_block;
    } variants[] = {
        {"tiles", tiles, 1}, {"tiles-nostore", tiles_nostore, 1}, {"dots", dots, 2},
        {"sums", float_sums, 1}, {"tiles+sums", tiles_sums, 1}, {"dots+sums", dots_sums, 1},
        {"tiles+fp", tiles_fp, 1}};
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        variants[v].run(reps / 10);  /* warm up */
        const double start = seconds();
        variants[v].run(reps);
        const double elapsed = seconds() - start;
        /* dots runs two TDPBSSD per block: per block tile is per TDPBSSD there */
        printf("%s %.3f\n", variants[v].name,
               1e9 * elapsed / ((double)reps * BLOCKS * variants[v].dots_per_block));
    }
    _tile_release();
    return 0;
}

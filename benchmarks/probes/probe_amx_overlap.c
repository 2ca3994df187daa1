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
costs their sum, the step's AMX projections are bound by that sum.

The wide- variants time a block of 128 columns as amx_tile_wide runs it at sixteen rows (a
batch-16 decode step), per block tile (16 x 16 x 128: 32,768 multiply-adds), over 64 row
groups' weights (4-bit codes, four blocks each, 256 KiB: from L2, as a step streams them):

  wide-tiles    tile zero, two multiplies of 64 columns (load A, load B, TDPBSSD) into one
                tile of sums, its store
  wide-unpack   the block's four slices of 4-bit codes unpacked to signed bytes (two GF2P8
                affine maps a vector) into a ring, with amx_unpack_slice's prefetches
  wide-sums     the block's float sum (as sums above)
  wide-all      all three, as amx_tile_wide interleaves them at sixteen rows */
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

#define GROUPS 64
#define WIDE_K 512
#define WIDE_STEPS (WIDE_K / 128)

static uint8_t packed[GROUPS * WIDE_K * 8] __attribute__((aligned(64)));  /* 16 rows x K/2 */
static int8_t ring[2][2048] __attribute__((aligned(64)));

/* Tiles 0-3 sums, 4-5 activation codes (16 rows of 64), 6-7 weight codes (16 rows of 64). */
static void configure_wide(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = 16;
        config.bytes_per_row[tile] = 64;
    }
    _tile_loadconfig(&config);
}

/* Group g's step st: four slices of 256 bytes of 4-bit codes into ring r (amx_unpack_slice). */
#define UNPACK(g, st, r) do { \
        const uint8_t *at = packed + ((size_t)(g) * WIDE_STEPS + (st)) * 1024; \
        for (int line = 0; line < 1024; line += 64) \
            _mm_prefetch((const char *)at + 4096 + line, _MM_HINT_T0); \
        for (int j = 0; j < 16; j++) { \
            const __m512i bytes = _mm512_loadu_si512(at + 64 * j); \
            _mm512_store_si512(ring[r] + 128 * j, _mm512_gf2p8affine_epi64_epi8( \
                bytes, _mm512_set1_epi64(0x0102040808080808), 0xF8)); \
            _mm512_store_si512(ring[r] + 128 * j + 64, _mm512_gf2p8affine_epi64_epi8( \
                bytes, _mm512_set1_epi64(0x1020408080808080), 0xF8)); \
        } \
    } while (0)

/* Step st's two multiplies of 64 columns into sum tile c (a constant: tiles are named in the
   instruction). */
#define MULTIPLY_INTO(c, st) do { \
        const int8_t *vectors = ring[(st) % 2]; \
        _tile_zero(c); \
        _tile_loadd(4, act + (st) * 128, STRIDE); _tile_loadd(6, vectors, 64); \
        _tile_dpbssd(c, 4, 6); \
        _tile_loadd(5, act + (st) * 128 + 64, STRIDE); _tile_loadd(7, vectors + 1024, 64); \
        _tile_dpbssd(c, 5, 7); \
    } while (0)

/* ... into sum tile 0 (even st) or 2. */
#define WIDE_MULTIPLY(st) do { \
        if ((st) % 2) MULTIPLY_INTO(2, st); else MULTIPLY_INTO(0, st); \
    } while (0)

/* Step st's sums stored (to sums[st % 2][0]). */
#define WIDE_STORE(st) do { \
        if ((st) % 2) _tile_stored(2, sums[1][0], 64); else _tile_stored(0, sums[0][0], 64); \
    } while (0)

#define WIDE_VARIANT(name, body) \
    static __attribute__((noinline)) void name(long reps) { \
        __m512 acc[16]; \
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps(); \
        for (long r = 0; r < reps; r++) \
            for (int g = 0; g < GROUPS; g++) \
                for (int st = 0; st < WIDE_STEPS; st++) { body; } \
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(out + i * 16, acc[i]); \
    }

WIDE_VARIANT(wide_tiles, WIDE_MULTIPLY(st); WIDE_STORE(st))
WIDE_VARIANT(wide_unpack, UNPACK(g, st, st % 2))
WIDE_VARIANT(wide_sums, SUM_BLOCK(st, stored[st]))
/* amx_tile_wide's order: step st + 1 unpacked and multiplied before step st's sums are
   stored and summed */
WIDE_VARIANT(wide_all,
             if (st == 0) { UNPACK(g, 0, 0); WIDE_MULTIPLY(0); }
             if (st + 1 < WIDE_STEPS) { UNPACK(g, st + 1, (st + 1) % 2); WIDE_MULTIPLY(st + 1); }
             WIDE_STORE(st);
             SUM_BLOCK(st, sums[st % 2][0]))

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
    for (size_t i = 0; i < sizeof packed; i++)
        packed[i] = (uint8_t)((seed = seed * 1103515245 + 12345) >> 16);
    configure_wide();
    static const struct {
        const char *name;
        void (*run)(long);
    } wide[] = {{"wide-tiles", wide_tiles}, {"wide-unpack", wide_unpack},
                {"wide-sums", wide_sums}, {"wide-all", wide_all}};
    const long wide_reps = reps / 16 > 0 ? reps / 16 : 1;  /* ~the same time per variant */
    for (size_t v = 0; v < sizeof wide / sizeof wide[0]; v++) {
        wide[v].run(wide_reps / 10 + 1);  /* warm up */
        const double start = seconds();
        wide[v].run(wide_reps);
        printf("%s %.3f\n", wide[v].name,
               1e9 * (seconds() - start) / ((double)wide_reps * GROUPS * WIDE_STEPS));
    }
    _tile_release();
    return 0;
}

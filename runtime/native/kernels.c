/* llmopt's native decoder step for lanes artifacts (see runtime/native/__init__.py).

One call runs a whole step over the packed query tokens of every sequence: embedding,
each layer (RMS norm, int4/int8 block-quantized projections on int8 activations, rotary,
keys and values written into the sequence's lane where they lie, attention over the
lane), the final norm and the LM head rows asked for. A lane holds float32 keys and values,
or int8/int4 codes with static per-channel scales (the KV-cache pass's layouts that
GroupQueryAttention reads in place), optionally of keys rotated per head. It computes what
the artifact's ONNX graph computes with ONNX Runtime's MatMulNBits at accuracy level 4
(activations quantized to int8 per block of the weights' with scale absmax / 127, rounded
half to even).

Weights: a projection w [N, K] is int codes in quantization blocks of 32, 64 or 128
along K (the last one may be shorter, a multiple of 32) with a float scale per block and an
optional integer zero point (else 2^(bits-1)): w = (code - zero) * scale. Activations are
quantized in the same blocks. The codes are repacked at load (runtime/native/weights.py),
32 columns (a slice) at a time, for one 512-bit VNNI dot per four columns of sixteen rows:
int32 lane i of a dot holds row i's four products with four activation bytes broadcast to
every lane. A slice of sixteen rows is 8 such vectors (8-bit codes), or 4 whose low and
high nibbles are those 8 (4-bit codes). A block's integer dot is the exact sum of its
slices' dots; its float scales apply once per block. Activation rows are quantized into
tiles of eight (QActivations); a full tile times symmetric 4-bit weights runs as one loop
of inline assembly (tile8_q4), every other shape through the same operations written with
intrinsics (gemm_tile).

A sequence's consecutive tokens in one step (a prefill chunk, a token and its drafts)
attend together, up to RUN_TOKENS at a time, reading each lane row once for all of them
(attend_run). A draft tree's tokens take consecutive rows but their depth's position, and
each sees only its ancestors among the step's rows (softmax_shown). On int8 lanes attention
runs in integers: int16 codes of the queries and of the attention weights against the
lanes' codes, exact int32 sums (query_codes, weight_codes).

Every token's result is computed by the same operations in the same order whatever else
the step holds (a block's integer dot is exact; the float sum runs over blocks in order;
a run's token adds exact zeros for the rows past its own), so batching, chunked prefill
and speculation change no output.
*/
#define _GNU_SOURCE 1  /* syscall(), for the AMX tile permission */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {  /* a projection, sixteen rows interleaved (see above); B: block count */
    const uint8_t *codes;   /* [ceil(N/16)][K/32][bits * 64] */
    const float *scales;    /* [ceil(N/16)][B][16] */
    const uint8_t *zeros;   /* [ceil(N/16)][B][16], or NULL: 2^(bits-1) */
    const float *offsets;   /* [ceil(N/16)][B][16] fractional zero points (GGUF Q4_1) as
                               scale * (2^(bits-1) - zero), times the block's float input sum;
                               or NULL (blocks of 32 only) */
    int32_t n, k, bits;
    int32_t block;          /* columns per quantization block: 32, 64 or 128 */
    const uint16_t *half_scales;  /* the scales as float16 where every one is exactly one
                                     (GGUF's are), else NULL: a lone row streams these */
    const float *bias;      /* [N] added to every output row (Qwen2's q/k/v), or NULL */
} QMatrix;

typedef struct {  /* embedding rows: MatMulNBits' layout, row after row */
    const uint8_t *codes;   /* [N][K * bits / 8], 4-bit: element 2j low nibble of byte j */
    const float *scales;    /* [N][B] */
    const uint8_t *zeros;   /* [N][B], or NULL */
    const float *offsets;   /* unused: QMatrix's layout */
    int32_t n, k, bits, block;
} QRows;

/* Quantization blocks of a K-wide row (the last may be shorter). */
static inline int block_count(int k, int block) { return (k + block - 1) / block; }

/* How many slices of 32 columns w's block b holds (the last block may hold fewer); they
   start at slice b * block / 32. */
static inline int block_slices(const QMatrix *w, int b) {
    const int per_block = w->block / 32, left = w->k / 32 - b * per_block;
    return left < per_block ? left : per_block;
}

typedef struct {  /* how one layer's lanes hold keys and values */
    int32_t bits;               /* 32: float32; 16: float16 (queries and the attention output
                                   rounded to float16 too, as the graph's node has them); 8:
                                   int8 codes; 4: int4 codes + 8, two a byte, element 2j in
                                   the low nibble of byte j */
    const float *key_scale;     /* [kv_heads * head_dim] static per-channel scales of codes */
    const float *value_scale;
    const float *rotation;      /* [head_dim][head_dim]: queries and keys times it after
                                   rotary (the lane stores rotated keys), or NULL */
    int32_t hadamard;           /* 1: rotation is the normalized Sylvester Hadamard matrix
                                   (the kv_cache pass's), applied by the fast transform */
} KVLayout;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_position;
    int32_t num_threads;
    float eps, attn_scale;
    const float *rope_cos, *rope_sin;      /* [max_position][head_dim / 2] */
    const float *embed;                    /* [vocab][hidden], or NULL: rows of embed_codes */
    QRows embed_codes;
    const float *const *attn_norm, *const *mlp_norm;
    const float *final_norm;
    const QMatrix *qkv, *o, *gate_up, *down;
    QMatrix head;
    const KVLayout *kv;                    /* [layers] */
    const float *const *q_norm, *const *k_norm;  /* [layers] [head_dim]: an RMS norm of each
                                                  query and key head before rotary (Qwen3),
                                                  or NULL (a layer's entry too) */
} Model;

/* Scalar helpers (no instruction-set requirement). */
int llmopt_native_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

/* Where a step's time goes, phase by phase (benchmarks/native_step_profile.py): off unless
   asked for, and then a clock read either side of each phase, on the thread that calls
   llmopt_forward (a phase's parallel regions end before it does). Phases, in a layer's
   order: */
enum {
    PHASE_EMBED,          /* embedding rows and the first norm */
    PHASE_QKV,            /* quantize the norm's output, the fused q/k/v projection */
    PHASE_KV_WRITE,       /* rotary (and the rotation), keys and values into their lanes */
    PHASE_ATTEND,         /* every run of query tokens against its lane (attend_run) */
    PHASE_O,              /* the output projection */
    PHASE_NORMS,          /* residual adds and RMS norms */
    PHASE_GATE_UP,        /* the fused gate/up projection */
    PHASE_SILU,           /* SiLU(gate) * up */
    PHASE_DOWN,           /* the down projection */
    PHASE_HEAD,           /* the final norm and the LM head */
    PHASES
};
static const char *const phase_names[PHASES] = {
    "embed", "qkv", "kv_write", "attend", "o", "norms", "gate_up", "silu", "down", "head"};
static int profile_on = 0;
static double phase_seconds[PHASES];

static inline double profile_clock(void) {
    if (!profile_on) return 0.;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Adds the time since `since` (a profile_clock reading) to `phase`; returns the clock. */
static inline double profile_phase(int phase, double since) {
    if (!profile_on) return 0.;
    const double now = profile_clock();
    phase_seconds[phase] += now - since;
    return now;
}

/* Turns the phase profile on (on > 0, its sums reset to zero) or off (0); returns whether
   it was on. */
int llmopt_native_profile(int on) {
    const int was = profile_on;
    if (on > 0) memset(phase_seconds, 0, sizeof phase_seconds);
    profile_on = on > 0;
    return was;
}

/* The phases' names, NULL past the last. */
const char *llmopt_native_profile_name(int phase) {
    return phase >= 0 && phase < PHASES ? phase_names[phase] : NULL;
}

/* Seconds spent in `phase` since the profile was turned on. */
double llmopt_native_profile_seconds(int phase) {
    return phase >= 0 && phase < PHASES ? phase_seconds[phase] : 0.;
}

static int amx_enabled = 0;

/* Turns the AMX path on (want > 0) where the CPU has it and the kernel grants the tile
   state (Linux 5.16 and later), or off (want 0); returns whether it is on (want < 0: only
   that). */
int llmopt_native_amx(int want) {
    unsigned eax, ebx, ecx, edx;
    if (want < 0) return amx_enabled;
    amx_enabled = 0;
    if (!want || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return 0;
    const unsigned tile = 1u << 24, int8 = 1u << 25;
    if ((edx & tile) && (edx & int8)
        && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0)
        amx_enabled = 1;
    return amx_enabled;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#include <immintrin.h>

#define PREFETCH_SLICES 16  /* how far ahead of the weight stream to prefetch (slices of 32
                               columns), every 64-byte line of it, into L1: prefetching every
                               other line and leaving its pair to the adjacent-line
                               prefetcher made a batch-1 step of 4 tokens cost 1.5x where it
                               now costs 1.1x (the pair's demand misses stalled the dots;
                               measured with benchmarks/native_kernels_ab.py, session 17,
                               Intel Xeon, where 8 to 32 slices ahead timed the same) */
#define STREAM_PREFETCH_SLICES 32  /* fewer rows (a batch-1 decode step, bound by the weight
                               stream) also prefetch this far ahead into L2: on the 2-core
                               AMD EPYC (Zen 4) a batch-1 step took 0.72-0.89x the time
                               (GPTQ g128 artifact), where the L1 prefetch alone held the
                               stream to ~15 GB/s, and 0.79-0.93x on the Q4_1 artifact
                               (blocks of 32 with fractional zero points). Into L2 alone:
                               0.64-0.80x and 0.97-1.16x; tiles of 8 rows into L2 instead of
                               L1: 1.04x (session 27) */
#define TOKEN_TILE 8        /* activation rows that share each unpacked weight slice */
#define PARALLEL_ROWS 16    /* rows from which per-row work (quantizing, norms, rotary, SiLU)
                               is split between threads: below, a parallel region costs more
                               than it saves (2 threads, session 19: from 16 rows rather
                               than 64, a batch-16 step took 0.945x and 0.966x, a batch 4 x 8
                               step 0.894x and 0.966x, in two A/Bs of 31 rounds) */
#define RUN_TOKENS 8        /* a lane's consecutive query tokens that attend together */
#define LAYER_ROWS 128      /* a step's rows a layer runs at a time per thread (all of
                               them, up to this): a chunk's projections, attention and MLP
                               keep their activations in L2, where a 512-row prefill step
                               streamed each phase's output through memory (SiLU's 9 MB a
                               layer). A prefill step of 4 x 128 took 0.82-0.84x the time in
                               slow memory phases, 0.96-0.97x in fast ones, at 1 thread;
                               0.98x at 2 (256 rows; 128 there: 1.00-1.05x). Session 24. */
#define SPLIT_ROWS 16       /* rows per thread from which a layer's rows are split between
                               threads rather than each phase's work (layer_split): two
                               tiles a thread already beat splitting every projection by
                               columns (2 threads, AMD Zen 4, session 29: steps of 32-48
                               rows 0.76-0.85x from 64 in a slow phase of the machine,
                               0.97x in a fast one; from 8, a batch of 16 reads the same
                               as split by columns, cores near or apart: 8.14 / 8.14 ms,
                               10.52 / 10.54 ms over 900 rounds, session 30) */
#define ROW_CHUNK 64        /* activation rows a pass over the weights serves (their codes
                               stay in cache while it runs; a matrix's weights stay in L2/L3
                               between passes) */

/* int8 activations of T rows of width K, quantized per block of w's (B blocks), in tiles
   of TOKEN_TILE rows: row t is row t % TOKEN_TILE of tile t / TOKEN_TILE, and a tile's rows
   lie side by side per slice or block (the dot kernel broadcasts each row's four codes at
   fixed offsets from one pointer). */
typedef struct {
    int32_t *codes;      /* [tiles][K/32][8][TOKEN_TILE]: four codes per int32, per slice */
    float *scales;       /* [tiles][B][TOKEN_TILE] the block's absmax / 127 */
    int32_t *zero_term;  /* [tiles][B][TOKEN_TILE] the block's sum of codes, negated and
                            times the weights' implicit zero point 2^(bits-1) (times -1 with
                            explicit zero points) */
    float *inputs;       /* [tiles][B][TOKEN_TILE] the block's sum of the float inputs
                            (filled for offsets) */
    int8_t *rows;        /* [T rounded up to AMX_ROWS][K] the same codes row after row, for
                            AMX tiles, or NULL. Where set, the product runs on tiles, which
                            read rows, scales and inputs alone: codes and zero_term stay
                            unfilled */
} QActivations;

/* Where row t's entry b lies in a tiled array of `count` entries per row (slices, blocks). */
static inline int64_t tile_at(int64_t t, int count, int b) {
    return ((t / TOKEN_TILE) * count + b) * TOKEN_TILE + t % TOKEN_TILE;
}

/* A row's block of `slices` slices from `first`: its scale (absmax / 127) into
   q->scales[at] and, for offsets, its float input sum into q->inputs[at]; returns the
   scale's inverse (0 for a zero block) broadcast. */
static inline __m512 activation_scale(const float *row, int first, int slices, int64_t at,
                                 const QMatrix *w, QActivations *q) {
    __m512 amax_v = _mm512_setzero_ps(), input_v = _mm512_setzero_ps();
    for (int s = first; s < first + slices; s++) {
        const float *xs = row + s * 32;
        __m512 lo = _mm512_loadu_ps(xs), hi = _mm512_loadu_ps(xs + 16);
        amax_v = _mm512_max_ps(amax_v, _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        if (w->offsets) input_v = _mm512_add_ps(input_v, _mm512_add_ps(lo, hi));
    }
    const float scale = _mm512_reduce_max_ps(amax_v) / 127.f;
    q->scales[at] = scale;
    if (w->offsets) q->inputs[at] = _mm512_reduce_add_ps(input_v);
    return _mm512_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
}

/* A block's zero term from the sums of its codes (see QActivations). */
static inline int32_t block_zero_term(__m512i sums, const QMatrix *w) {
    const int32_t total = _mm512_reduce_add_epi32(sums);
    return w->zeros ? -total : -(total << (w->bits - 1));
}

/* Row t's block b of x quantized as w's kernels read it (see QActivations). */
static inline void quantize_block(const float *x, int64_t t, int b, const QMatrix *w,
                                  QActivations *q) {
    const int k = w->k, row_slices = k / 32;
    const int first = b * (w->block / 32), slices = block_slices(w, b);
    const int64_t at = tile_at(t, block_count(k, w->block), b);
    const __m512 inv = activation_scale(x + t * k, first, slices, at, w, q);
    __m512i sum = _mm512_setzero_si512();
    for (int s = first; s < first + slices; s++) {
        const float *xs = x + t * k + s * 32;
        /* cvtps rounds half to even (MXCSR's default), as lrintf */
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs), inv));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + 16), inv));
        if (q->rows) {  /* AMX tiles read the rows alone: no tiled codes, no zero term */
            int8_t *row = q->rows + t * k + s * 32;
            _mm_storeu_si128((__m128i *)row, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(row + 16), _mm512_cvtsepi32_epi8(qhi));
            continue;
        }
        int32_t quads[8];
        _mm_storeu_si128((__m128i *)quads, _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(quads + 4), _mm512_cvtsepi32_epi8(qhi));
        const int64_t slice_at = tile_at(t, row_slices, s);
        int32_t *codes = q->codes + (slice_at - t % TOKEN_TILE) * 8 + t % TOKEN_TILE;
        for (int m = 0; m < 8; m++) codes[m * TOKEN_TILE] = quads[m];
        sum = _mm512_add_epi32(sum, _mm512_add_epi32(qlo, qhi));
    }
    if (!q->rows) q->zero_term[at] = block_zero_term(sum, w);
}

/* Rows `at` .. `at` + 7 (a whole tile) of column block b of x quantized as quantize_block
   quantizes each of them, the same codes, scales and zero terms: per slice, the eight rows'
   quads transposed in registers into the tile's [quad][row] layout, eight vector stores
   where row by row a slice takes 64 scalar ones (the stores were most of a batch-16 step's
   quantizing). Not for AMX rows. */
static void quantize_tile_block(const float *x, int64_t at, int b, const QMatrix *w,
                                QActivations *q) {
    const int k = w->k, row_slices = k / 32, blocks = block_count(k, w->block);
    const int first = b * (w->block / 32), slices = block_slices(w, b);
    __m512 inverse[TOKEN_TILE];
    __m512i sums[TOKEN_TILE];
    const int64_t block_at = tile_at(at, blocks, b);  /* row `at`'s entry: the tile's first */
    for (int r = 0; r < TOKEN_TILE; r++) {
        inverse[r] = activation_scale(x + (at + r) * k, first, slices, block_at + r, w, q);
        sums[r] = _mm512_setzero_si512();
    }
    for (int s = first; s < first + slices; s++) {
        __m256i quads[TOKEN_TILE];  /* row r's eight quads of the slice */
        for (int r = 0; r < TOKEN_TILE; r++) {
            const float *xs = x + (at + r) * k + s * 32;
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs),
                                                                 inverse[r]));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + 16),
                                                                 inverse[r]));
            quads[r] = _mm256_set_m128i(_mm512_cvtsepi32_epi8(qhi), _mm512_cvtsepi32_epi8(qlo));
            sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(qlo, qhi));
        }
        /* 8 x 8 int32 transpose: quad m of rows 0 .. 7 into one vector */
        __m256i pairs[TOKEN_TILE], fours[TOKEN_TILE];
        for (int r = 0; r < TOKEN_TILE; r += 2) {
            pairs[r] = _mm256_unpacklo_epi32(quads[r], quads[r + 1]);
            pairs[r + 1] = _mm256_unpackhi_epi32(quads[r], quads[r + 1]);
        }
        for (int r = 0; r < TOKEN_TILE; r += 4)
            for (int h = 0; h < 2; h++) {
                fours[r + h] = _mm256_unpacklo_epi64(pairs[r + h], pairs[r + 2 + h]);
                fours[r + 2 + h] = _mm256_unpackhi_epi64(pairs[r + h], pairs[r + 2 + h]);
            }
        /* fours[i] holds quads (i, i + 4) of rows 0-3 and 4-7: i = 0 m 0/4, 1 m 2/6,
           2 m 1/5, 3 m 3/7 for rows 0-3 (fours 0-3) and rows 4-7 (fours 4-7) */
        int32_t *codes = q->codes + tile_at(at, row_slices, s) * 8;
        static const int order[4] = {0, 2, 1, 3};  /* quad m (of 0 .. 3) in fours[order[m]] */
        for (int m = 0; m < 4; m++) {
            const __m256i low = fours[order[m]], high = fours[4 + order[m]];
            _mm256_storeu_si256((__m256i *)(codes + m * TOKEN_TILE),
                                _mm256_permute2x128_si256(low, high, 0x20));
            _mm256_storeu_si256((__m256i *)(codes + (m + 4) * TOKEN_TILE),
                                _mm256_permute2x128_si256(low, high, 0x31));
        }
    }
    for (int r = 0; r < TOKEN_TILE; r++)
        q->zero_term[block_at + r] = block_zero_term(sums[r], w);
}

/* The tiles of rows quantized a whole tile at a time (quantize_tile_block): none for AMX
   rows, which are quantized row by row. */
static inline int64_t whole_tiles(int t_rows, const QActivations *q) {
    return q->rows ? 0 : t_rows / TOKEN_TILE;
}

/* quantize_rows' items: each whole tile's blocks (quantize_tile_block), then each row of a
   last part tile and, for AMX, every row (quantize_block). */
static inline int64_t quantize_items(int t_rows, const QMatrix *w, const QActivations *q) {
    const int64_t tiles = whole_tiles(t_rows, q);
    return tiles * block_count(w->k, w->block) + t_rows - tiles * TOKEN_TILE;
}

/* quantize_rows' item i. */
static inline void quantize_item(const float *x, int t_rows, const QMatrix *w, int64_t i,
                                 QActivations *q) {
    const int blocks = block_count(w->k, w->block);
    const int64_t tiles = whole_tiles(t_rows, q);
    if (i < tiles * blocks) {
        quantize_tile_block(x, i / blocks * TOKEN_TILE, (int)(i % blocks), w, q);
        return;
    }
    const int64_t t = tiles * TOKEN_TILE + i - tiles * blocks;
    for (int b = 0; b < blocks; b++) quantize_block(x, t, b, w, q);
}

/* x [T][K] quantized as w's kernels read it (see QActivations): whole tiles block by block
   (quantize_tile_block), the rows of a last part tile (and every row for AMX) one by one,
   the items split between threads. */
static void quantize_rows(const float *x, int t_rows, const QMatrix *w, int threads,
                          QActivations *q) {
    const int64_t items = quantize_items(t_rows, w, q);
    (void)threads;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < items; i++) quantize_item(x, t_rows, w, i, q);
}

/* Column blocks b_lo .. b_hi - 1 of every row of x quantized as quantize_rows quantizes
   them (a block's codes depend on that block's inputs alone). */
static void quantize_blocks(const float *x, int t_rows, const QMatrix *w, int b_lo, int b_hi,
                            QActivations *q) {
    const int64_t tiles = whole_tiles(t_rows, q);
    for (int64_t tile = 0; tile < tiles; tile++)  /* a tile's rows stay in cache */
        for (int b = b_lo; b < b_hi; b++) quantize_tile_block(x, tile * TOKEN_TILE, b, w, q);
    for (int64_t t = tiles * TOKEN_TILE; t < t_rows; t++)
        for (int b = b_lo; b < b_hi; b++) quantize_block(x, t, b, w, q);
}

/* The common full tile as one loop of assembly: TOKEN_TILE (8) activation rows times a row
   group of symmetric 4-bit weights (no zero points, no offsets) over `blocks` blocks of
   `slices` slices each but the last, of `last` (blocks > 0), into `out` what gemm_tile
   computes, operation for operation, with every value in a named register. (GCC, given
   gemm_tile's intrinsics, moves sums between registers and spills addresses; this loop
   issues ~1.45 dots a cycle where that one issues ~1.2.) The shorter last block of a K like
   576 in blocks of 128 ran as a second call that reloaded the sums the first had just
   stored, and waited on those loads (~3 % of this loop's samples at 1 thread, ~10 % at 2,
   Zen 4; presumably the 512-bit loads wait for the stores to reach the cache, and at 2
   threads for the other core to give the lines up): in one loop, a batch-16 step 0.95x.
   Registers: zmm0-7 each row's integer dot of the block, zmm8-15 the block's eight code
   vectors, zmm16-23 each row's float sum, zmm25 the block's row scales, zmm26 a row's
   scale product; each dot reads its row's four activation codes as a broadcast operand
   (dot_broadcast). Per slice the pointers advance by: codes 256 bytes, activation codes
   8 x 8 int32; per block: row scales 16 floats, zero terms and activation scales 8 each
   (the tiled layouts above). out: 8 rows of 16 floats, `stride` floats apart (the tile's
   outputs in y itself where its row group is whole: no buffer to zero and copy, 8-row
   tiles 0.98x the time). */
static void tile8_q4(const uint8_t *codes, const float *row_scales, const int32_t *act,
                     const int32_t *zero_term, const float *act_scales, int64_t blocks,
                     int64_t slices, int64_t last, float *out, int64_t stride) {
    int64_t left;
    /* row i at out + i * stride: rows 4 .. 7 from a second base, each at base + 0, 1, 2 or 3
       strides (x86 addresses scale an index by 1, 2, 4 or 8, never 3) */
    const int64_t bytes = 4 * stride, bytes3 = 3 * bytes;
    float *const out4 = out + 4 * stride;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
#define UNPACK(j, lo, hi) \
    "vmovdqu64 64*" #j "(%[codes]), %%zmm" #lo "\n\t" \
    "vpsrlw $4, %%zmm" #lo ", %%zmm" #hi "\n\t" \
    "vpandd %[low4], %%zmm" #lo ", %%zmm" #lo "\n\t" \
    "vpandd %[low4], %%zmm" #hi ", %%zmm" #hi "\n\t"
#define STORE(at, f) "vmovups %%zmm" #f ", " at "\n\t"
#define STORE_ROWS /* row i's sums (zmm16 + i) to out + i * stride */ \
    STORE("(%[out])", 16) STORE("(%[out],%[bytes])", 17) STORE("(%[out],%[bytes],2)", 18) \
    STORE("(%[out],%[bytes3])", 19) STORE("(%[out4])", 20) STORE("(%[out4],%[bytes])", 21) \
    STORE("(%[out4],%[bytes],2)", 22) STORE("(%[out4],%[bytes3])", 23)
#define SUM(i, f) \
    "vcvtdq2ps %%zmm" #i ", %%zmm" #i "\n\t" \
    "vmulps 4*" #i "(%[act_scales])%{1to16%}, %%zmm25, %%zmm26\n\t" \
    "vfmadd231ps %%zmm26, %%zmm" #i ", %%zmm" #f "\n\t"
    __asm__ volatile(
        ".irp f,16,17,18,19,20,21,22,23\n\t"
        "vpxord %%zmm\\f, %%zmm\\f, %%zmm\\f\n\t"
        ".endr\n"
        "1:\n\t"
        /* each row's dot starts from its zero term */
        ".irp i,0,1,2,3,4,5,6,7\n\t"
        "vpbroadcastd 4*\\i(%[zero_term]), %%zmm\\i\n\t"
        ".endr\n\t"
        "mov %[slices], %[left]\n\t"
        "cmp $1, %[blocks]\n\t"  /* the last block: `last` slices */
        "jne 2f\n\t"
        "mov %[last], %[left]\n"
        "2:\n\t"
        "prefetcht0 %c[ahead](%[codes])\n\t"
        "prefetcht0 %c[ahead]+64(%[codes])\n\t"
        "prefetcht0 %c[ahead]+128(%[codes])\n\t"
        "prefetcht0 %c[ahead]+192(%[codes])\n\t"
        UNPACK(0, 8, 9) UNPACK(1, 10, 11) UNPACK(2, 12, 13) UNPACK(3, 14, 15)
        /* code vector m (zmm8+m) times row i's four activation codes m, for every m, i */
        ".irp m,8,9,10,11,12,13,14,15\n\t"
        ".irp i,0,1,2,3,4,5,6,7\n\t"
        "vpdpbusd 32*(\\m-8)+4*\\i(%[act])%{1to16%}, %%zmm\\m, %%zmm\\i\n\t"
        ".endr\n\t"
        ".endr\n\t"
        "add $256, %[codes]\n\t"
        "add $256, %[act]\n\t"
        "dec %[left]\n\t"
        "jnz 2b\n\t"
        "vmovups (%[row_scales]), %%zmm25\n\t"
        SUM(0, 16) SUM(1, 17) SUM(2, 18) SUM(3, 19)
        SUM(4, 20) SUM(5, 21) SUM(6, 22) SUM(7, 23)
        "add $64, %[row_scales]\n\t"
        "add $32, %[zero_term]\n\t"
        "add $32, %[act_scales]\n\t"
        "dec %[blocks]\n\t"
        "jnz 1b\n\t"
        STORE_ROWS
        : [codes] "+r"(codes), [row_scales] "+r"(row_scales), [act] "+r"(act),
          [zero_term] "+r"(zero_term), [act_scales] "+r"(act_scales), [blocks] "+r"(blocks),
          [left] "=&r"(left)
        : [out] "r"(out), [out4] "r"(out4), [bytes] "r"(bytes), [bytes3] "r"(bytes3),
          [last] "m"(last), [slices] "r"(slices), [low4] "v"(low4),
          [ahead] "i"(PREFETCH_SLICES * 256)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18",
          "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm25", "xmm26", "memory",
          "cc");
#undef UNPACK
#undef STORE
#undef STORE_ROWS
#undef SUM
}

/* acc + codes . (*four, broadcast to every lane): one VPDPBUSD that reads the four
   activation codes as its broadcast memory operand, where GCC writes _mm512_set1_epi32 of
   a load as a VPBROADCASTD of its own before each dot. One instruction a dot fewer (here
   and in tile8_q4): a batch-16 step 0.94-0.99x the time at 1 and at 2 threads, a 4 x 128
   prefill 0.99-1.01x at 1 and 0.96-0.98x at 2, a batch-1 step 0.98-1.02x; the Q4_1
   artifact's batch 16 0.92x and prefill 0.93x at 1 thread (native_kernels_ab, 9-15 rounds,
   AMD Zen 4, session 31). */
static inline __attribute__((always_inline)) __m512i dot_broadcast(__m512i acc, __m512i codes,
                                                                   const int32_t *four) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*four));
    return acc;
}

/* One slice's weight lines prefetched into L1 PREFETCH_SLICES ahead and, in a step bound
   by the weight stream (`stream`: fewer than 8 rows), into L2 STREAM_PREFETCH_SLICES
   ahead (see both). */
static inline __attribute__((always_inline)) void prefetch_slice(const uint8_t *at,
                                                                 const int slice_bytes,
                                                                 const int stream) {
    for (int line = 0; line < slice_bytes; line += 64) {
        _mm_prefetch((const char *)at + PREFETCH_SLICES * slice_bytes + line, _MM_HINT_T0);
        if (stream)
            _mm_prefetch((const char *)at + STREAM_PREFETCH_SLICES * slice_bytes + line,
                         _MM_HINT_T1);
    }
}

/* Block b's sixteen row scales, from the float16 copy where `halves` (float16 to float32
   is exact: the same numbers). */
static inline __attribute__((always_inline)) __m512 block_scales(const float *scales,
                                                                 const uint16_t *half, int b,
                                                                 const int halves) {
    return halves ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + b * 16)))
                  : _mm512_loadu_ps(scales + b * 16);
}

/* Where gemm_tile's operands start: row group g's weights, tile t0's activations. */
typedef struct {
    const uint8_t *group, *zeros;
    const float *scales, *offsets, *act_scales, *inputs;
    const int32_t *act, *zero_term;
    const uint16_t *half_scales;  /* where the tile reads them (halves) */
} TileOperands;

/* gemm_tile for a lone activation row (a batch-1 step, or a step's last tile of one row):
   the same operations in a loop of its own that walks its pointers, each block's integer
   dot grown as two chains, the even code vectors' and the odd ones', added at the block's
   end (integer sums: the same dot in any order). gemm_tile's loop, one chain of eight
   dependent dots a slice, held the weight stream near 20 GB/s; this one draws ~24 (a
   batch-1 step 0.95x the time; its loop alone 0.97x, the second chain the rest: session
   28, AMD Zen 4, 1 thread). */
static inline __attribute__((always_inline)) void lone_row(
        const QMatrix *w, TileOperands o, const int bits, const int has_zeros, const int halves,
        __mmask16 rows, float *out) {
    const int slice_bytes = bits * 64, per_block = w->block / 32;
    const int blocks = block_count(w->k, w->block);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int64_t bt = (int64_t)b * TOKEN_TILE;
        __m512i even = has_zeros
            ? _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                  (const __m128i *)(o.zeros + b * 16))), _mm512_set1_epi32(o.zero_term[bt]))
            : _mm512_set1_epi32(o.zero_term[bt]);
        __m512i odd = _mm512_setzero_si512();
        const uint8_t *at = o.group + (int64_t)b * per_block * slice_bytes;
        const int32_t *slice_act = o.act + (int64_t)b * per_block * 8 * TOKEN_TILE;
        const int block_end = block_slices(w, b);
        for (int s = 0; s < block_end; s++, at += slice_bytes, slice_act += 8 * TOKEN_TILE) {
            prefetch_slice(at, slice_bytes, 1);
            for (int j = 0; j < 4; j++) {  /* code vectors 2j and 2j + 1 */
                __m512i first_codes, second_codes;
                if (bits == 8) {
                    first_codes = _mm512_loadu_si512(at + 128 * j);
                    second_codes = _mm512_loadu_si512(at + 128 * j + 64);
                } else {
                    const __m512i packed = _mm512_loadu_si512(at + 64 * j);
                    first_codes = _mm512_and_si512(packed, low4);
                    second_codes = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
                }
                even = dot_broadcast(even, first_codes, slice_act + 2 * j * TOKEN_TILE);
                odd = dot_broadcast(odd, second_codes, slice_act + (2 * j + 1) * TOKEN_TILE);
            }
        }
        const __m512i dot = _mm512_add_epi32(even, odd);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(
            block_scales(o.scales, o.half_scales, b, halves),
            _mm512_set1_ps(o.act_scales[bt])), acc);
        if (o.offsets)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(o.offsets + b * 16),
                                  _mm512_set1_ps(o.inputs[bt]), acc);
    }
    _mm512_mask_storeu_ps(out, rows, acc);
}

/* Tile `tile` (rows t0 .., `tile` of them) times row group g: 16 outputs per row. Each
   block's integer dots start from the zero point's term and run as one chain per row over
   the block's slices, the rows interleaved so that `tile` chains are in flight (a lone row:
   lone_row). `bits`, `zeros` and `halves` (scales read from w's float16 copy) are constants
   in each instance. */
static inline __attribute__((always_inline)) void gemm_tile(
        const QMatrix *w, const QActivations *a, int t0, const int tile, const int bits,
        const int has_zeros, const int halves, float *y, int64_t g) {
    const int slices = w->k / 32, slice_bytes = bits * 64, per_block = w->block / 32;
    const int blocks = block_count(w->k, w->block);
    const uint8_t *group = w->codes + g * slices * slice_bytes;
    const float *scales = w->scales + g * blocks * 16;
    const uint8_t *zeros = has_zeros ? w->zeros + g * blocks * 16 : NULL;
    const float *offsets = w->offsets ? w->offsets + g * blocks * 16 : NULL;
    const __mmask16 rows = (__mmask16)((1u << (w->n - 16 * g < 16 ? w->n - 16 * g : 16)) - 1);
    const int64_t first = tile_at(t0, blocks, 0);
    const int32_t *act = a->codes + tile_at(t0, slices, 0) * 8;
    const int32_t *zero_term = a->zero_term + first;
    const float *act_scales = a->scales + first, *inputs = a->inputs + first;
    const uint16_t *half = halves ? w->half_scales + g * blocks * 16 : NULL;
    if (tile == 1) {
        lone_row(w, (TileOperands){group, zeros, scales, offsets, act_scales, inputs, act,
                                   zero_term, half}, bits, has_zeros, halves, rows,
                 y + (int64_t)t0 * w->n + 16 * g);
        return;
    }
    if (tile == TOKEN_TILE && bits == 4 && !has_zeros && !offsets && blocks > 0) {
        /* a whole row group's sums go straight to y, the last group's short one's through
           a buffer */
        float sums[TOKEN_TILE][16];
        const int whole = rows == 0xFFFF;
        float *out = whole ? y + (int64_t)t0 * w->n + 16 * g : &sums[0][0];
        const int64_t stride = whole ? w->n : 16;
        tile8_q4(group, scales, act, zero_term, act_scales, blocks, per_block,
                 block_slices(w, blocks - 1), out, stride);
        for (int i = 0; i < tile && !whole; i++)
            _mm512_mask_storeu_ps(y + (int64_t)(t0 + i) * w->n + 16 * g, rows,
                                  _mm512_loadu_ps(sums[i]));
        return;
    }
    __m512 acc[TOKEN_TILE];
    for (int i = 0; i < tile; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int64_t bt = (int64_t)b * TOKEN_TILE;
        __m512i dot[TOKEN_TILE];
        if (has_zeros) {
            const __m512i row_zeros =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + b * 16)));
            for (int i = 0; i < tile; i++)
                dot[i] = _mm512_mullo_epi32(row_zeros, _mm512_set1_epi32(zero_term[bt + i]));
        } else {
            for (int i = 0; i < tile; i++) dot[i] = _mm512_set1_epi32(zero_term[bt + i]);
        }
        for (int s = b * per_block; s < b * per_block + block_slices(w, b); s++) {
            const uint8_t *at = group + (int64_t)s * slice_bytes;
            prefetch_slice(at, slice_bytes, tile < TOKEN_TILE);
            __m512i codes[8];
            if (bits == 8) {
                for (int m = 0; m < 8; m++) codes[m] = _mm512_loadu_si512(at + 64 * m);
            } else {
                const __m512i low4 = _mm512_set1_epi8(0x0F);
                for (int j = 0; j < 4; j++) {
                    __m512i packed = _mm512_loadu_si512(at + 64 * j);
                    codes[2 * j] = _mm512_and_si512(packed, low4);
                    codes[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
                }
            }
            const int32_t *slice_act = act + (int64_t)s * 8 * TOKEN_TILE;
            for (int m = 0; m < 8; m++)
                for (int i = 0; i < tile; i++)
                    dot[i] = dot_broadcast(dot[i], codes[m], slice_act + m * TOKEN_TILE + i);
        }
        const __m512 row_scales = block_scales(scales, half, b, halves);
        for (int i = 0; i < tile; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(
                row_scales, _mm512_set1_ps(act_scales[bt + i])), acc[i]);
            if (offsets)
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(offsets + b * 16),
                                         _mm512_set1_ps(inputs[bt + i]), acc[i]);
        }
    }
    for (int i = 0; i < tile; i++)
        _mm512_mask_storeu_ps(y + (int64_t)(t0 + i) * w->n + 16 * g, rows, acc[i]);
}

#define TILE_CASES(bits, zeros) \
    switch (t1 - t0 < TOKEN_TILE ? t1 - t0 : TOKEN_TILE) { \
    case 1: gemm_tile(w, a, t0, 1, bits, zeros, halves, y, g); break; \
    case 2: gemm_tile(w, a, t0, 2, bits, zeros, halves, y, g); break; \
    case 3: gemm_tile(w, a, t0, 3, bits, zeros, halves, y, g); break; \
    case 4: gemm_tile(w, a, t0, 4, bits, zeros, halves, y, g); break; \
    case 5: gemm_tile(w, a, t0, 5, bits, zeros, halves, y, g); break; \
    case 6: gemm_tile(w, a, t0, 6, bits, zeros, halves, y, g); break; \
    case 7: gemm_tile(w, a, t0, 7, bits, zeros, halves, y, g); break; \
    default: gemm_tile(w, a, t0, 8, bits, zeros, 0, y, g); break; \
    }

/* y[t][16g .. 16g+15] for row groups lo..hi-1 and every activation row t, ROW_CHUNK rows
   at a time; `halves`: from the float16 scales (a step of fewer than 8 rows, bound by the
   weight stream: half their bytes). */
static inline __attribute__((always_inline)) void gemm_groups_as(
        const QMatrix *w, const QActivations *a, int t_rows, float *y, int64_t lo, int64_t hi,
        const int halves) {
    for (int c0 = 0; c0 < t_rows; c0 += ROW_CHUNK) {
        const int t1 = t_rows - c0 < ROW_CHUNK ? t_rows : c0 + ROW_CHUNK;
        for (int64_t g = lo; g < hi; g++)
            for (int t0 = c0; t0 < t1; t0 += TOKEN_TILE) {
                if (w->bits == 4 && !w->zeros) TILE_CASES(4, 0)
                else if (w->bits == 4) TILE_CASES(4, 1)
                else if (!w->zeros) TILE_CASES(8, 0)
                else TILE_CASES(8, 1)
            }
    }
}

static void gemm_groups(const QMatrix *w, const QActivations *a, int t_rows, float *y,
                        int64_t lo, int64_t hi) {
    if (w->half_scales && t_rows < TOKEN_TILE) gemm_groups_as(w, a, t_rows, y, lo, hi, 1);
    else gemm_groups_as(w, a, t_rows, y, lo, hi, 0);
}

/* AMX: where the CPU has int8 tile multiplies (Intel's AMX-INT8), a tile of up to sixteen
   activation rows times a row group runs one block at a time. In blocks of 32 (amx_tile)
   a block is one TDPBSSD: the tile A is the rows' 32 codes of the block
   (QActivations.rows), the tile B the block's eight code vectors, which weights.py's layout
   already makes the operand's four-bytes-per-lane form, as signed bytes code - zero point.
   Wider blocks (amx_tile_wide) take one TDPBSSD per 64 columns, A 64 codes a row and B two
   slices' sixteen vectors, all summed in one tile. The integer dot of each row and block is
   exact either way, and the float sum over blocks is gemm_tile's, operation for operation,
   so the result is bit for bit the VNNI path's and a step may take either path for any of
   its matrices. The tile's sums pass through memory (AMX has no move to vector registers)
   and each block still needs gemm_tile's three float operations per row, which bound the
   gain in blocks of 32: a 4 x 128 prefill step takes 0.77x its VNNI time, a batch-16 decode
   step 0.89x (benchmarks/native_kernels_ab.py, --old amx-off). Blocks of 128 need a quarter
   of those operations and half the multiplies. */
#define AMX_ROWS 16       /* activation rows of one tile (A's and C's rows) */
#define AMX_MIN_ROWS 16   /* fewer rows take the VNNI path: a projection on tiles costs
                             1.3-1.5x VNNI at 8 rows, 0.84-1.0x at 16, 0.74-0.91x at 64
                             (SmolLM2's shapes, 1 thread: benchmarks/amx_projections.py) */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,gfni,amx-tile,amx-int8")

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: sums (C, 16 rows of 16 int32), 4-5: activation codes (A, 16 rows of 32 codes,
   or 64 when `wide`), 6-7: code vectors (B, 8 rows of 64 bytes, or 16): see amx_tile and
   amx_tile_wide. */
static void amx_configure(int wide) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = tile < 6 || wide ? AMX_ROWS : 8;
        config.bytes_per_row[tile] = (tile == 4 || tile == 5) && !wide ? 32 : 64;
    }
    /* GCC does not see LDTILECFG read its operand: inlined, the stores above would be
       dropped as dead and the tiles left unconfigured (SIGILL at the first tile load) */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* Slice s of group g's code vectors as signed bytes code - zero point (512 bytes): the
   product then needs no zero-point term (it is the same integer). Prefetches the weight
   stream ahead. */
static inline __attribute__((always_inline)) void amx_unpack_slice(
        const QMatrix *w, int64_t g, int s, int8_t *out) {
    const int slices = w->k / 32, slice_bytes = w->bits * 64;
    const uint8_t *at = w->codes + (g * slices + s) * slice_bytes;
    const char *ahead = (const char *)(at + PREFETCH_SLICES * slice_bytes);
    for (int line = 0; line < slice_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    if (w->bits == 8) {  /* no zero points here (amx_takes): code - 128 */
        for (int m = 0; m < 8; m++)
            _mm512_store_si512(out + 64 * m, _mm512_xor_si512(_mm512_loadu_si512(at + 64 * m),
                                                              _mm512_set1_epi8((char)0x80)));
    } else if (w->zeros) {  /* row i's zero point in each byte of lane i */
        const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_mullo_epi32(
            _mm512_set1_epi32(0x01010101), _mm512_cvtepu8_epi32(_mm_loadu_si128(
                (const __m128i *)(w->zeros + (g * block_count(w->k, w->block)
                                              + s / (w->block / 32)) * 16))));
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512(at + 64 * j);
            _mm512_store_si512(out + 128 * j, _mm512_sub_epi8(_mm512_and_si512(packed, low4), zero));
            _mm512_store_si512(out + 128 * j + 64, _mm512_sub_epi8(
                _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), zero));
        }
    } else {
        /* code - 8 of a nibble is the nibble with bit 3 flipped, sign-extended: an affine map
           of bits over GF(2), one instruction per nibble */
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512(at + 64 * j);
            _mm512_store_si512(out + 128 * j, _mm512_gf2p8affine_epi64_epi8(
                packed, _mm512_set1_epi64(0x0102040808080808), 0xF8));
            _mm512_store_si512(out + 128 * j + 64, _mm512_gf2p8affine_epi64_epi8(
                packed, _mm512_set1_epi64(0x1020408080808080), 0xF8));
        }
    }
}

/* acc[i] += block b's dots of rows t0 + i (sums: the tile's C) as gemm_tile adds them.
   act_scales, inputs: the block's entries of rows t0 .. t0 + 7 and, 8 * blocks further, of
   t0 + 8 .. t0 + 15 (QActivations' tiles of eight). */
static inline __attribute__((always_inline)) void amx_add_block(
        const float *row_scales, const float *offsets, const float *act_scales,
        const float *inputs, int64_t next_tile, const int rows, const int32_t *sums,
        __m512 *acc) {
    const __m512 scales = _mm512_loadu_ps(row_scales);
    for (int i = 0; i < rows; i++) {
        const int64_t at = i < TOKEN_TILE ? i : next_tile + i - TOKEN_TILE;
        __m512i dot = _mm512_load_si512(sums + 16 * i);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                 _mm512_mul_ps(scales, _mm512_set1_ps(act_scales[at])), acc[i]);
        if (offsets)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(offsets), _mm512_set1_ps(inputs[at]),
                                     acc[i]);
    }
}

/* Blocks of 32: rows t0 .. t0 + rows - 1 times row group g (signed code vectors `vectors`,
   or NULL: each pair unpacked as it comes, for a group that one tile of rows reads once).
   Blocks go in pairs, software-pipelined: while one pair's sums are read (from tiles 0, 1
   or 2, 3), the next pair multiplies into the other two; tiles 4, 5 hold a pair's
   activation codes, 6, 7 its code vectors. */
static inline __attribute__((always_inline)) void amx_tile(
        const QMatrix *w, const QActivations *a, int t0, const int rows, const int has_offsets,
        int64_t g, const int8_t *vectors, float *y) {
    const int blocks = w->k / 32, pairs = blocks / 2;
    const int64_t stride = w->k, next_tile = (int64_t)blocks * TOKEN_TILE;
    const int8_t *act = a->rows + (int64_t)t0 * stride;
    const float *row_scales = w->scales + g * blocks * 16;
    const float *offsets = has_offsets ? w->offsets + g * blocks * 16 : NULL;
    const float *act_scales = a->scales + tile_at(t0, blocks, 0);
    const float *inputs = a->inputs + tile_at(t0, blocks, 0);
    int32_t sums[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    int8_t ring[2][1024] __attribute__((aligned(64)));  /* a pair's code vectors, unpacked */
    __m512 acc[AMX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
#define MULTIPLY(c0, c1, b) do { \
        const int8_t *pair = vectors ? vectors + (b) * 512 : ring[(b) / 2 % 2]; \
        if (!vectors) { \
            amx_unpack_slice(w, g, (b), ring[(b) / 2 % 2]); \
            amx_unpack_slice(w, g, (b) + 1, ring[(b) / 2 % 2] + 512); \
        } \
        _tile_zero(c0); \
        _tile_loadd(4, act + (b) * 32, stride); \
        _tile_loadd(6, pair, 64); \
        _tile_dpbssd(c0, 4, 6); \
        _tile_zero(c1); \
        _tile_loadd(5, act + (b) * 32 + 32, stride); \
        _tile_loadd(7, pair + 512, 64); \
        _tile_dpbssd(c1, 5, 7); \
    } while (0)
#define ADD_BLOCK(b, set) \
    amx_add_block(row_scales + (b) * 16, has_offsets ? offsets + (b) * 16 : NULL, \
                  act_scales + (b) * TOKEN_TILE, inputs + (b) * TOKEN_TILE, next_tile, rows, \
                  sums[set], acc)
    if (pairs > 0) MULTIPLY(0, 1, 0);
    for (int p = 0; p < pairs; p++) {
        const int b = 2 * p;
        if (p % 2 == 0) {
            if (p + 1 < pairs) MULTIPLY(2, 3, b + 2);
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
        } else {
            if (p + 1 < pairs) MULTIPLY(0, 1, b + 2);
            _tile_stored(2, sums[0], 64);
            _tile_stored(3, sums[1], 64);
        }
        ADD_BLOCK(b, 0);
        ADD_BLOCK(b + 1, 1);
    }
    if (blocks % 2) {
        const int b = blocks - 1;
        if (!vectors) amx_unpack_slice(w, g, b, ring[0]);
        _tile_zero(0);
        _tile_loadd(4, act + b * 32, stride);
        _tile_loadd(6, vectors ? vectors + b * 512 : ring[0], 64);
        _tile_dpbssd(0, 4, 6);
        _tile_stored(0, sums[0], 64);
        ADD_BLOCK(b, 0);
    }
#undef MULTIPLY
#undef ADD_BLOCK
    const __mmask16 outputs = (__mmask16)((1u << (w->n - 16 * g < 16 ? w->n - 16 * g : 16)) - 1);
    for (int i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(y + (int64_t)(t0 + i) * w->n + 16 * g, outputs, acc[i]);
}

/* amx_tile for blocks of 64 or 128 (K a multiple of 64): rows t0 .. t0 + rows - 1 times
   row group g, 128 columns a step: two multiplies of 64 columns (one at the end of a
   shorter K). A step is one block of 128, whose two multiplies add into one tile of sums
   (integers: exact), or two blocks of 64, each into its own tile. (Two tiles for a block
   of 128, added in vectors, cost a tile store and sixteen adds more per block: its
   projections took 0.71-0.92x the time with one, at 16 and 512 rows; session 22.)
   Software-pipelined as amx_tile: while one step's sums are read (from tiles 0, 1 or
   2, 3), the next step multiplies into the other two; tiles 4, 6 and 5, 7 hold each
   multiply's activation codes and code vectors. */
static inline __attribute__((always_inline)) void amx_tile_wide(
        const QMatrix *w, const QActivations *a, int t0, const int rows, int64_t g,
        const int8_t *vectors, float *y) {
    const int slices = w->k / 32, steps = (slices + 3) / 4, wide_blocks = w->block == 128;
    const int blocks = block_count(w->k, w->block);
    const int64_t stride = w->k, next_tile = (int64_t)blocks * TOKEN_TILE;
    const int8_t *act = a->rows + (int64_t)t0 * stride;
    const float *row_scales = w->scales + g * blocks * 16;
    const float *act_scales = a->scales + tile_at(t0, blocks, 0);
    int32_t sums[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    int8_t ring[2][4 * 512] __attribute__((aligned(64)));  /* a step's code vectors */
    __m512 acc[AMX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
#define MULTIPLY(c0, c1, st) do { \
        const int first = 4 * (st), count = slices - first < 4 ? slices - first : 4; \
        const int8_t *step = vectors ? vectors + (int64_t)first * 512 : ring[(st) % 2]; \
        if (!vectors) \
            for (int s = 0; s < count; s++) \
                amx_unpack_slice(w, g, first + s, ring[(st) % 2] + s * 512); \
        _tile_zero(c0); \
        _tile_loadd(4, act + first * 32, stride); \
        _tile_loadd(6, step, 64); \
        _tile_dpbssd(c0, 4, 6); \
        if (count > 2) { \
            if (!wide_blocks) _tile_zero(c1); \
            _tile_loadd(5, act + first * 32 + 64, stride); \
            _tile_loadd(7, step + 1024, 64); \
            if (wide_blocks) _tile_dpbssd(c0, 5, 7); else _tile_dpbssd(c1, 5, 7); \
        } \
    } while (0)
    if (steps > 0) MULTIPLY(0, 1, 0);
    for (int st = 0; st < steps; st++) {
        const int second = 4 * st + 2 < slices;  /* the step's second multiply ran */
        if (st % 2 == 0) {
            if (st + 1 < steps) MULTIPLY(2, 3, st + 1);
            _tile_stored(0, sums[0], 64);
            if (second && !wide_blocks) _tile_stored(1, sums[1], 64);
        } else {
            if (st + 1 < steps) MULTIPLY(0, 1, st + 1);
            _tile_stored(2, sums[0], 64);
            if (second && !wide_blocks) _tile_stored(3, sums[1], 64);
        }
        if (wide_blocks) {
            amx_add_block(row_scales + st * 16, NULL, act_scales + st * TOKEN_TILE, NULL,
                          next_tile, rows, sums[0], acc);
        } else {
            for (int half = 0; half <= second; half++) {
                const int b = 2 * st + half;
                amx_add_block(row_scales + b * 16, NULL, act_scales + b * TOKEN_TILE, NULL,
                              next_tile, rows, sums[half], acc);
            }
        }
    }
#undef MULTIPLY
    const __mmask16 outputs = (__mmask16)((1u << (w->n - 16 * g < 16 ? w->n - 16 * g : 16)) - 1);
    for (int i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(y + (int64_t)(t0 + i) * w->n + 16 * g, outputs, acc[i]);
}

/* gemm_groups on AMX tiles: per row chunk and group, the group's code vectors unpacked once
   for all its tiles of rows (as they come where there is one tile). */
static int gemm_groups_amx(const QMatrix *w, const QActivations *a, int t_rows, float *y,
                           int64_t lo, int64_t hi) {
    const int slices = w->k / 32, wide = w->block > 32;
    int8_t *unpacked = t_rows > AMX_ROWS ? aligned_alloc(64, (size_t)slices * 512) : NULL;
    if (t_rows > AMX_ROWS && !unpacked) return -1;
    amx_configure(wide);
    for (int c0 = 0; c0 < t_rows; c0 += ROW_CHUNK) {
        const int t1 = t_rows - c0 < ROW_CHUNK ? t_rows : c0 + ROW_CHUNK;
        for (int64_t g = lo; g < hi; g++) {
            if (unpacked)
                for (int s = 0; s < slices; s++) amx_unpack_slice(w, g, s, unpacked + s * 512);
            for (int t0 = c0; t0 < t1; t0 += AMX_ROWS) {
                const int rows = t1 - t0 < AMX_ROWS ? t1 - t0 : AMX_ROWS;
                if (wide && rows == AMX_ROWS)
                    amx_tile_wide(w, a, t0, AMX_ROWS, g, unpacked, y);
                else if (wide)
                    amx_tile_wide(w, a, t0, rows, g, unpacked, y);
                else if (rows == AMX_ROWS && !w->offsets)
                    amx_tile(w, a, t0, AMX_ROWS, 0, g, unpacked, y);
                else
                    amx_tile(w, a, t0, rows, w->offsets != NULL, g, unpacked, y);
            }
        }
    }
    _tile_release();
    free(unpacked);
    return 0;
}
#pragma GCC pop_options

/* Whether w times t_rows activation rows runs on AMX tiles (QActivations.rows): not 8-bit
   codes with zero points, whose code - zero does not fit a signed byte, nor wide blocks
   with a last one of 32 columns (a tile multiply takes 64). */
static int amx_min_rows = AMX_MIN_ROWS;

static inline int amx_takes(const QMatrix *w, int t_rows) {
    return amx_enabled && t_rows >= amx_min_rows && !(w->bits == 8 && w->zeros)
        && (w->block == 32 || w->k % 64 == 0);
}

/* From how many activation rows a projection takes AMX tiles (rows > 0; the default is
   AMX_MIN_ROWS): for benchmarks/amx_projections.py, which times every row count on both
   paths. Returns the previous value. */
int llmopt_native_amx_min_rows(int rows) {
    const int previous = amx_min_rows;
    if (rows > 0) amx_min_rows = rows;
    return previous;
}

/* The calling thread's share [*lo, *hi) of `items`, split evenly over a parallel region's
   threads (all of them outside one). */
static inline void thread_share(int64_t items, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
    const int64_t id = 0, count = 1;
#endif
    *lo = items * id / count;
    *hi = items * (id + 1) / count;
}

/* y[t][16 lo .. 16 hi - 1] += w's bias, for every row t (the graph's Add after the
   projection: the same float sums). */
static void add_bias(const QMatrix *w, int t_rows, float *y, int64_t lo, int64_t hi) {
    const int64_t end = 16 * hi < w->n ? 16 * hi : w->n;
    for (int t = 0; t < t_rows; t++)
        for (int64_t c = 16 * lo; c < end; c += 16) {
            const __mmask16 m = end - c >= 16 ? 0xFFFF : (__mmask16)((1u << (end - c)) - 1);
            float *at = y + (int64_t)t * w->n + c;
            _mm512_mask_storeu_ps(at, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, at),
                                                       _mm512_maskz_loadu_ps(m, w->bias + c)));
        }
}

/* Row groups lo .. hi - 1 of w times the activations into y, with w's bias: one thread's
   share of a projection (`amx`: on AMX tiles, a->rows filled). */
static int gemm_share(const QMatrix *w, const QActivations *a, int t_rows, float *y,
                      int64_t lo, int64_t hi, int amx) {
    int status = 0;
    if (lo >= hi) return 0;
    if (amx) status = gemm_groups_amx(w, a, t_rows, y, lo, hi);
    else gemm_groups(w, a, t_rows, y, lo, hi);
    if (w->bias) add_bias(w, t_rows, y, lo, hi);
    return status;
}

/* y [T][N] = a times w's transpose (plus its bias), the row groups split between threads.
   Returns 0, or -1 when memory runs out. */
static int gemm(const QMatrix *w, const QActivations *a, int t_rows, float *y, int threads) {
    const int amx = a->rows != NULL && amx_takes(w, t_rows);
    int status = 0;
    (void)threads;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: status)
    {
        int64_t lo, hi;
        thread_share((w->n + 15) / 16, &lo, &hi);
        status |= gemm_share(w, a, t_rows, y, lo, hi, amx);
    }
    return status;
}

/* Reads `bytes` of `data` (a multiple of 256) as gemm reads a weight stream: 64-byte loads,
   every line prefetched into L1 and, further ahead, into L2, as a batch-1 step does, the range
   split between threads.
   Returns the OR of every word, so no load can be dropped. For
   benchmarks/_bandwidth_bound.py: the read bandwidth a loop like gemm's draws, which numpy's
   reductions (one dependent stream, no prefetching) understate on some machines (session
   18's Xeon, 1 thread, 84 MiB: this loop 27 GB/s, numpy's sum 14, a batch-1 step 14-16). */
uint64_t llmopt_native_read(const uint8_t *data, int64_t bytes, int threads) {
    uint64_t result = 0;
    (void)threads;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: result)
    {
        int64_t lo, hi;
        thread_share(bytes / 256, &lo, &hi);
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

static inline __m512 exp512(__m512 x) {  /* e^x, Cephes' polynomial, ~1 ulp */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37626f)), _mm512_set1_ps(-88.37626f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* Widths here are multiples of 16 (the plan checks): no scalar tails. */
static void rms_norm(const float *x, const float *weight, float eps, int width, float *out) {
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < width; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        sum = _mm512_fmadd_ps(v, v, sum);
    }
    __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(sum) / width + eps));
    for (int i = 0; i < width; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv),
                                                _mm512_loadu_ps(weight + i)));
}

static void silu_times(const float *gate, const float *up, int width, float *out) {
    for (int i = 0; i < width; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 sigmoid = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(
            _mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid),
                                                _mm512_loadu_ps(up + i)));
    }
}

static void rotary(float *x, int heads, int dim, const float *cos, const float *sin) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

/* Heads h0 .. h0 + n - 1 of x [..][dim] times r [dim][dim], columns j0 .. j0 + 16 * strips - 1,
   into out [n][dim]: n * strips sums grow side by side, each head's element broadcast once
   per row of r and each row's strips loaded once for the n heads. */
static inline __attribute__((always_inline)) void rotate_block(
        const float *x, int dim, const float *r, const int n, int j0, const int strips,
        float *out) {
    __m512 acc[6][4];
    for (int h = 0; h < n; h++)
        for (int j = 0; j < strips; j++) acc[h][j] = _mm512_setzero_ps();
    for (int i = 0; i < dim; i++) {
        __m512 row[4];
        for (int j = 0; j < strips; j++)
            row[j] = _mm512_loadu_ps(r + (int64_t)i * dim + j0 + 16 * j);
        for (int h = 0; h < n; h++) {
            const __m512 element = _mm512_set1_ps(x[h * dim + i]);
            for (int j = 0; j < strips; j++)
                acc[h][j] = _mm512_fmadd_ps(element, row[j], acc[h][j]);
        }
    }
    for (int h = 0; h < n; h++)
        for (int j = 0; j < strips; j++)
            _mm512_storeu_ps(out + h * dim + j0 + 16 * j, acc[h][j]);
}

/* Each head of x [heads][dim] times r [dim][dim], in place, six heads and 64 columns at a
   time (24 sums in registers: the loop is bound by its multiply-adds, not its loads). */
static void rotate_heads(float *x, int heads, int dim, const float *r) {
    float rotated[6 * 256];
    for (int h0 = 0; h0 < heads; h0 += 6) {
        const int n = heads - h0 < 6 ? heads - h0 : 6;
        float *v = x + (int64_t)h0 * dim;
        for (int j0 = 0; j0 < dim; j0 += 64) {
            const int strips = dim - j0 < 64 ? (dim - j0) / 16 : 4;
            if (n == 6 && strips == 4)
                rotate_block(v, dim, r, 6, j0, 4, rotated);
            else
                rotate_block(v, dim, r, n, j0, strips, rotated);
        }
        memcpy(v, rotated, sizeof(float) * n * dim);
    }
}

/* Lanes j and j + h of v (h = 1, 2, 4, 8: `swapped` is v with them exchanged, `upper` the
   lanes j + h) as their sum and difference, v_j + v_j+h and v_j - v_j+h. */
static inline __m512 butterfly(__m512 v, __m512 swapped, __mmask16 upper) {
    return _mm512_mask_sub_ps(_mm512_add_ps(v, swapped), upper, swapped, v);
}

/* Each head of x [heads][dim] times the normalized Sylvester Hadamard matrix, in place (dim a
   power of two, 16 to 256; norm its entry 1/sqrt(dim)): log2(dim) stages of sums and
   differences of elements h apart (the fast Walsh-Hadamard transform), then one multiply by
   norm. dim log2(dim) additions where the matrix takes dim^2 multiply-adds (64: 6 stages
   of 4 vectors against 256 multiply-adds of a vector); exact in real arithmetic, it rounds
   differently from rotate_heads' sums in order (fewer roundings: log2(dim) per element). */
static void hadamard_heads(float *x, int heads, int dim, float norm) {
    const int vectors = dim / 16;
    for (int head = 0; head < heads; head++) {
        float *row = x + (int64_t)head * dim;
        __m512 v[16];
        for (int k = 0; k < vectors; k++) v[k] = _mm512_loadu_ps(row + 16 * k);
        for (int h = 1; h < vectors; h *= 2)  /* elements 16h apart: whole vectors */
            for (int k = 0; k < vectors; k++)
                if (!(k & h)) {
                    const __m512 a = v[k], b = v[k + h];
                    v[k] = _mm512_add_ps(a, b);
                    v[k + h] = _mm512_sub_ps(a, b);
                }
        for (int k = 0; k < vectors; k++) {
            __m512 u = v[k];
            u = butterfly(u, _mm512_shuffle_f32x4(u, u, 0x4E), 0xFF00);  /* 8 apart */
            u = butterfly(u, _mm512_shuffle_f32x4(u, u, 0xB1), 0xF0F0);  /* 4 */
            u = butterfly(u, _mm512_permute_ps(u, 0x4E), 0xCCCC);        /* 2 */
            u = butterfly(u, _mm512_permute_ps(u, 0xB1), 0xAAAA);        /* 1 */
            _mm512_storeu_ps(row + 16 * k, _mm512_mul_ps(u, _mm512_set1_ps(norm)));
        }
    }
}

/* A lane row's bytes: dim float32s or float16s, or dim codes of `bits`. */
static inline int64_t row_bytes(int bits, int dim) { return (int64_t)dim * bits / 8; }

/* x [dim] as a lane row of `bits`: codes round(x / scale) clipped to the code range, as the
   graph's Div, Round (half to even) and Clip compute them. */
static void store_row(const float *x, const float *scale, int bits, int dim, uint8_t *row) {
    if (bits == 32) {
        memcpy(row, x, sizeof(float) * dim);
        return;
    }
    if (bits == 16) {  /* round to nearest even, as the graph's Cast */
        for (int d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(row + 2 * d), _mm512_cvtps_ph(
                _mm512_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
    const __m512 top = _mm512_set1_ps(bits == 8 ? 127.f : 7.f);
    const __m512 bottom = _mm512_set1_ps(bits == 8 ? -127.f : -8.f);
    for (int d = 0; d < dim; d += 16) {
        __m512 c = _mm512_roundscale_ps(
            _mm512_div_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(scale + d)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i code = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(c, bottom), top));
        if (bits == 8) {
            _mm_storeu_si128((__m128i *)(row + d), _mm512_cvtepi32_epi8(code));
            continue;
        }
        int32_t biased[16];
        _mm512_storeu_si512(biased, _mm512_add_epi32(code, _mm512_set1_epi32(8)));
        for (int i = 0; i < 8; i++)
            row[d / 2 + i] = (uint8_t)(biased[2 * i] | biased[2 * i + 1] << 4);
    }
}

/* Elements d .. d+15 of a lane row of `bits`, as float32 (codes without their scale). */
static inline __m512 row_strip(const uint8_t *row, int bits, int d) {
    if (bits == 32) return _mm512_loadu_ps((const float *)row + d);
    if (bits == 16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * d)));
    if (bits == 8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
    /* eight bytes -> sixteen nibbles, low first: byte b in a 16-bit lane becomes the bytes
       (b & 15, b >> 4) */
    __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + d / 2)));
    __m128i nibbles = _mm_and_si128(_mm_or_si128(bytes, _mm_slli_epi16(bytes, 4)),
                                    _mm_set1_epi16(0x0F0F));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles),
                                               _mm512_set1_epi32(8)));
}

/* The eight sums of eight vectors' lanes, each by one fixed tree: lane j plus lane j + 8,
   then neighbours (0 + 1, 2 + 3, ...), then those pairs' pairs, then the two halves. The
   vectors travel two to a register, so each step is one add per two or four vectors (24
   operations for eight sums, where one vector at a time, 256-bit hadds, took 38). `integer`:
   the lanes hold int32s (added exactly, so in any order). */
static inline __m512 add_lanes(__m512 a, __m512 b, const int integer) {
    return integer ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a),
                                                          _mm512_castps_si512(b)))
                   : _mm512_add_ps(a, b);
}

static inline __attribute__((always_inline)) __m256 sum_lanes8_as(const __m512 v[8],
                                                                  const int integer) {
    __m512 halves[4], pairs[2];
    for (int i = 0; i < 4; i++)  /* [v_2i's lanes j + (j + 8), v_2i+1's] */
        halves[i] = add_lanes(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE), integer);
    for (int i = 0; i < 2; i++)  /* per 128 bits: neighbours of halves[2i], of halves[2i+1] */
        pairs[i] = add_lanes(_mm512_shuffle_ps(halves[2 * i], halves[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(halves[2 * i], halves[2 * i + 1], 0xDD), integer);
    const __m512 quads = add_lanes(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                   _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD), integer);
    /* 128-bit lane 0 holds the first quads of v0, v2, v4, v6, lane 1 their second, lanes
       2 and 3 the same of v1, v3, v5, v7 */
    const __m512 sums = add_lanes(quads, _mm512_shuffle_f32x4(quads, quads, 0xB1), integer);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), sums));
}

static inline __m256 sum_lanes8(const __m512 v[8]) { return sum_lanes8_as(v, 0); }

/* The next attend_run's key and value rows, prefetched into L2 a few lines at a time while
   this run computes: a run's own rows would come from memory as its loops reach them, and a
   batch-16 step's runs read ~24 KB each, one after another. (Loading a run's rows once
   more before its loops, to keep many misses in flight, took a batch-16 step at context
   192 to 0.91x on session 23's Xeon; on the AMD EPYC (Zen 4) of sessions 27-30, where the
   rows are in L2 already, that extra pass over them cost attention 1.18x: removed,
   session 30.) */
typedef struct {
    const char *keys, *values;
    int64_t bytes, at;  /* the rows' size; how far the prefetches got */
} Ahead;

/* Lines of each of the rows to prefetch per iteration, for all of them in `iterations`. */
static inline int ahead_share(const Ahead *ahead, int iterations) {
    return (int)((ahead->bytes / 64 + iterations - 1) / iterations);
}

static inline void ahead_lines(Ahead *ahead, int lines) {
    for (int i = 0; i < lines && ahead->at < ahead->bytes; i++, ahead->at += 64) {
        _mm_prefetch(ahead->keys + ahead->at, _MM_HINT_T1);
        _mm_prefetch(ahead->values + ahead->at, _MM_HINT_T1);
    }
}

/* scores[h][j] = scale * q_h . keys[j] for the group's heads, a block of eight keys at a
   time, decoded to float32 once for every head (float32 keys are read where they lie; the
   last block zero-padded to eight). */
static inline __attribute__((always_inline)) void group_scores_as(
        const float *q, int group, const uint8_t *keys, const int bits, int len, const int dim,
        float scale, float *scores, Ahead *ahead) {
    float decoded[8 * 256] __attribute__((aligned(64)));
    const int64_t stride = row_bytes(bits, dim);
    const int lines = ahead_share(ahead, (len + 7) / 8);
    for (int j0 = 0; j0 < len; j0 += 8) {
        const int rows = len - j0 < 8 ? len - j0 : 8;
        ahead_lines(ahead, lines);
        const float *block = (const float *)(keys + j0 * stride);
        if (bits != 32 || rows < 8) {
            for (int u = 0; u < 8; u++)
                for (int d = 0; d < dim; d += 16)
                    _mm512_store_ps(decoded + u * dim + d,
                                    u < rows ? row_strip(keys + (j0 + u) * stride, bits, d)
                                             : _mm512_setzero_ps());
            block = decoded;
        }
        const __mmask8 shown = (__mmask8)((1u << rows) - 1);
        for (int h = 0; h < group; h++) {
            __m512 dots[8];
            for (int u = 0; u < 8; u++) {
                dots[u] = _mm512_setzero_ps();
                for (int d = 0; d < dim; d += 16)
                    dots[u] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dim + d),
                                              _mm512_loadu_ps(block + u * dim + d), dots[u]);
            }
            _mm256_mask_storeu_ps(scores + (int64_t)h * len + j0, shown,
                                  _mm256_mul_ps(sum_lanes8(dots), _mm256_set1_ps(scale)));
        }
    }
}

static void group_scores(const float *q, int group, const uint8_t *keys, int bits, int len,
                         int dim, float scale, float *scores, Ahead *ahead) {
    if (dim != 64) {
        group_scores_as(q, group, keys, bits, len, dim, scale, scores, ahead);
        return;
    }
    switch (bits) {  /* the common head size: one body per row format */
    case 32: group_scores_as(q, group, keys, 32, len, 64, scale, scores, ahead); return;
    case 16: group_scores_as(q, group, keys, 16, len, 64, scale, scores, ahead); return;
    case 8: group_scores_as(q, group, keys, 8, len, 64, scale, scores, ahead); return;
    default: group_scores_as(q, group, keys, 4, len, 64, scale, scores, ahead); return;
    }
}

/* out [group][strips * 16] = p [group][len] @ values [len][strips * 16]: each value row read
   once for the group; with `group` and `strips` constants (below), the sums stay in registers. */
static inline __attribute__((always_inline)) void weigh_values_as(
        const float *p, int len, const uint8_t *values, const int bits, const int group,
        const int strips, float *out) {
    __m512 acc[8 * 16];  /* [head][strip]: group * strips <= 128 (the plan checks) */
    for (int i = 0; i < group * strips; i++) acc[i] = _mm512_setzero_ps();
    const int64_t stride = row_bytes(bits, strips * 16);
    for (int j = 0; j < len; j++) {
        const uint8_t *v = values + j * stride;
        for (int d = 0; d < strips; d++) {
            __m512 vd = row_strip(v, bits, 16 * d);
            for (int h = 0; h < group; h++)
                acc[h * strips + d] = _mm512_fmadd_ps(_mm512_set1_ps(p[(int64_t)h * len + j]),
                                                      vd, acc[h * strips + d]);
        }
    }
    for (int i = 0; i < group * strips; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

static inline __attribute__((always_inline)) void weigh_values_bits(
        const float *p, int len, const uint8_t *values, const int bits, int group, int strips,
        float *out) {
    if (strips == 4) {  /* head_dim 64, the common case: one body per group size */
        switch (group) {
        case 1: weigh_values_as(p, len, values, bits, 1, 4, out); return;
        case 2: weigh_values_as(p, len, values, bits, 2, 4, out); return;
        case 3: weigh_values_as(p, len, values, bits, 3, 4, out); return;
        case 4: weigh_values_as(p, len, values, bits, 4, 4, out); return;
        case 5: weigh_values_as(p, len, values, bits, 5, 4, out); return;
        case 6: weigh_values_as(p, len, values, bits, 6, 4, out); return;
        }
    }
    weigh_values_as(p, len, values, bits, group, strips, out);
}

static void weigh_values(const float *p, int len, const uint8_t *values, int bits, int group,
                         int strips, float *out) {
    switch (bits) {  /* one body per row format */
    case 32: weigh_values_bits(p, len, values, 32, group, strips, out); return;
    case 16: weigh_values_bits(p, len, values, 16, group, strips, out); return;
    case 8: weigh_values_bits(p, len, values, 8, group, strips, out); return;
    default: weigh_values_bits(p, len, values, 4, group, strips, out); return;
    }
}

/* Attention on int8 lanes, in integers. A query row (its key scales applied) becomes int16
   codes round(x / s) with s its absmax / 32767, and a head's attention weights int16 codes
   of their own scale (weight_codes): a query's dot products with int8 keys and the
   weighted sum of int8 value rows are then exact int32 sums (VPDPWSSD: two int16 products
   a lane), in any order, where float arithmetic converts every key and value element and
   adds in one fixed order. Rounding to 15 bits of each row's largest element sits far
   below the lanes' own int8 rounding: WikiText-2 perplexity of SmolLM2's int8-KV artifacts
   moved by less than its window-to-window noise (benchmarks/README, session 25). Rows are
   widened 32 elements at a time, a last 16 padded with zeros (head sizes are multiples of
   16). */

static inline int padded_dim(int dim) { return (dim + 31) / 32 * 32; }

/* x [dim] as int16 codes [padded_dim(dim)], zeros past dim; returns their scale s (0 for a
   zero row). */
static float query_codes(const float *x, int dim, int16_t *codes) {
    __m512 peak = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 16)
        peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    const float top = _mm512_reduce_max_ps(peak);
    const __m512 inverse = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    for (int d = 0; d < padded_dim(dim); d += 16)
        _mm256_storeu_si256((__m256i *)(codes + d), d < dim
            ? _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + d),
                                                                     inverse)))
            : _mm256_setzero_si256());
    return top / 32767.f;
}

/* Elements d .. d + 31 of an int8 row as int16 (where d + 16 == dim: its last 16, then
   zeros). */
static inline __m512i widen32(const uint8_t *row, int d, int dim) {
    if (d + 32 <= dim)
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + d)));
    return _mm512_zextsi256_si512(
        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + d))));
}

/* scores[h][j] = scales[h] * (q_h . keys[j]) for int8 keys and int16 query codes (rows
   padded_dim apart): a block of eight keys widened once for every head. */
static inline __attribute__((always_inline)) void group_scores_int8_as(
        const int16_t *q, const float *scales, int group, const uint8_t *keys, int len,
        const int dim, float *scores, Ahead *ahead) {
    const int width = padded_dim(dim);
    int16_t widened[8 * 256] __attribute__((aligned(64)));
    const int lines = ahead_share(ahead, (len + 7) / 8);
    for (int j0 = 0; j0 < len; j0 += 8) {
        const int rows = len - j0 < 8 ? len - j0 : 8;
        ahead_lines(ahead, lines);
        for (int u = 0; u < 8; u++)
            for (int d = 0; d < width; d += 32)
                _mm512_store_si512(widened + u * width + d,
                                   u < rows ? widen32(keys + (int64_t)(j0 + u) * dim, d, dim)
                                            : _mm512_setzero_si512());
        const __mmask8 shown = (__mmask8)((1u << rows) - 1);
        for (int h = 0; h < group; h++) {
            __m512 dots[8];
            for (int u = 0; u < 8; u++) {
                __m512i dot = _mm512_setzero_si512();
                for (int d = 0; d < width; d += 32)
                    dot = _mm512_dpwssd_epi32(dot, _mm512_loadu_si512(q + h * width + d),
                                              _mm512_load_si512(widened + u * width + d));
                dots[u] = _mm512_castsi512_ps(dot);
            }
            _mm256_mask_storeu_ps(scores + (int64_t)h * len + j0, shown, _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_castps_si256(sum_lanes8_as(dots, 1))),
                _mm256_set1_ps(scales[h])));
        }
    }
}

static void group_scores_int8(const int16_t *q, const float *scales, int group,
                              const uint8_t *keys, int len, int dim, float *scores,
                              Ahead *ahead) {
    if (dim == 64)  /* the common head size, as a constant */
        group_scores_int8_as(q, scales, group, keys, len, 64, scores, ahead);
    else
        group_scores_int8_as(q, scales, group, keys, len, dim, scores, ahead);
}

static inline __mmask16 rows_before(int c, int len) {  /* rows c .. c + 15 below len */
    return len - c >= 16 ? 0xFFFF : (__mmask16)((1u << (len - c)) - 1);
}

/* Which of rows c .. c + 15 of 0 .. len - 1 a tree mask shows (softmax_shown's bits:
   bit j of mask, row len - 1 - j; rows 64 or more back always show), as a lane mask. */
static inline __mmask16 rows_shown(int c, int len, uint64_t mask) {
    __mmask16 shown = rows_before(c, len);
    if (!~mask || len - 1 - c >= 64 + 15) return shown;
    for (int k = 0; k < 16 && c + k < len; k++) {
        const int back = len - 1 - (c + k);
        if (back < 64 && !(mask >> back & 1)) shown &= (__mmask16)~(1u << k);
    }
    return shown;
}

/* A head's scores [width] (of rows 0 .. len - 1; mask: a tree's, as softmax_shown's, or
   all ones) as its softmax weights in int16 codes, in place (code j in the bytes of the
   row's first half): e_j = exp(s_j - max) over the rows shown, code_j = round(32767 e_j f),
   zero for every other row up to width (and one more zero code past an odd width), f = 1
   unless the e_j sum past 508, then 508 / their sum: a sum of the codes' products with int8
   values stays below 2^31 (508 * 32767 * 127, plus the roundings), and the largest weight
   (e = 1) keeps 15 bits. Returns 1 / the codes' sum, the weighted sum's scale: the codes
   are the weights, normalized exactly. A tree's token gets the codes of its chain's
   (shown rows' codes do not depend on hidden rows' scores). */
static float weight_codes(float *scores, int len, int width, uint64_t mask) {
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < len; c += 16)
        peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                        rows_shown(c, len, mask), scores + c));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    const __m512 one = _mm512_set1_ps(32767.f);
    int16_t *codes = (int16_t *)scores;
    __m512 total = _mm512_setzero_ps();
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < len; c += 16) {  /* codes c.. overwrite scores[c / 2 ..], read already */
        const __mmask16 shown = rows_shown(c, len, mask);
        const __m512 e = _mm512_maskz_mov_ps(
            shown, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(shown, scores + c), top)));
        const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(e, one));
        total = _mm512_add_ps(total, e);
        sum = _mm512_add_epi32(sum, code);
        _mm256_mask_storeu_epi16(codes + c, rows_before(c, len), _mm512_cvtepi32_epi16(code));
    }
    int64_t codes_sum = _mm512_reduce_add_epi32(sum);
    const float e_sum = _mm512_reduce_add_ps(total);
    if (e_sum > 508.f) {  /* a long, flat row: the codes scaled down to fit */
        const __m512 f = _mm512_set1_ps(508.f / e_sum);
        sum = _mm512_setzero_si512();
        for (int c = 0; c < len; c += 16) {
            const __mmask16 rows = rows_before(c, len);
            const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(
                _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(rows, codes + c))), f));
            sum = _mm512_add_epi32(sum, code);
            _mm256_mask_storeu_epi16(codes + c, rows, _mm512_cvtepi32_epi16(code));
        }
        codes_sum = _mm512_reduce_add_epi32(sum);
    }
    memset(codes + len, 0, sizeof(int16_t) * (width - len + (width % 2)));
    return 1.f / (float)codes_sum;
}

/* out [group][dim] = scales[h] * (weights_h . values) for int8 value rows and int16 weight
   codes (weight_codes; rows `stride` codes apart, each with a zero code past an odd len):
   value rows two at a time, interleaved element by element into the int16 pairs one
   VPDPWSSD lane multiplies by the two weights. */
static inline __attribute__((always_inline)) void weigh_values_int8_as(
        const int16_t *weights, int64_t stride, const float *scales, int len,
        const uint8_t *values, const int group, const int dim, float *out) {
    const int vectors = dim / 16;  /* sums per head: one vector per 16 elements */
    __m512i acc[24];  /* group * vectors <= 24 (attend_run's heads at a time) */
    for (int i = 0; i < group * vectors; i++) acc[i] = _mm512_setzero_si512();
    for (int j = 0; j < len; j += 2) {
        const uint8_t *first = values + (int64_t)j * dim, *second = first + dim;
        const int both = j + 1 < len;
        for (int d = 0; d < dim; d += 32) {
            __m512i low, high = _mm512_setzero_si512();
            if (d + 32 <= dim) {  /* low: elements d + 0..7, d + 16..23; high: the rest */
                const __m256i a = _mm256_loadu_si256((const __m256i *)(first + d));
                const __m256i b = both ? _mm256_loadu_si256((const __m256i *)(second + d))
                                       : _mm256_setzero_si256();
                low = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
                high = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
            } else {  /* the last 16 elements, in order */
                const __m128i a = _mm_loadu_si128((const __m128i *)(first + d));
                const __m128i b = both ? _mm_loadu_si128((const __m128i *)(second + d))
                                       : _mm_setzero_si128();
                low = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b))),
                    _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)), 1);
            }
            for (int h = 0; h < group; h++) {
                int32_t pair;  /* the weights of rows j and j + 1 */
                memcpy(&pair, weights + h * stride + j, sizeof pair);
                const __m512i w = _mm512_set1_epi32(pair);
                __m512i *sums = acc + h * vectors + d / 16;
                sums[0] = _mm512_dpwssd_epi32(sums[0], w, low);
                if (d + 32 <= dim) sums[1] = _mm512_dpwssd_epi32(sums[1], w, high);
            }
        }
    }
    for (int h = 0; h < group; h++) {
        const __m512 scale = _mm512_set1_ps(scales[h]);
        for (int d = 0; d < dim; d += 32) {
            const __m512i *sums = acc + h * vectors + d / 16;
            float *to = out + (int64_t)h * dim + d;
            const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[0]), scale);
            if (d + 32 > dim) {
                _mm512_storeu_ps(to, low);
                continue;
            }
            const __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[1]), scale);
            _mm256_storeu_ps(to, _mm512_castps512_ps256(low));
            _mm256_storeu_ps(to + 16, _mm512_extractf32x8_ps(low, 1));
            _mm256_storeu_ps(to + 8, _mm512_castps512_ps256(high));
            _mm256_storeu_ps(to + 24, _mm512_extractf32x8_ps(high, 1));
        }
    }
}

static void weigh_values_int8(const int16_t *weights, int64_t stride, const float *scales,
                              int len, const uint8_t *values, int group, int dim, float *out) {
    if (dim == 64) {  /* the common head size: one body per group size */
        switch (group) {
        case 1: weigh_values_int8_as(weights, stride, scales, len, values, 1, 64, out); return;
        case 2: weigh_values_int8_as(weights, stride, scales, len, values, 2, 64, out); return;
        case 3: weigh_values_int8_as(weights, stride, scales, len, values, 3, 64, out); return;
        case 4: weigh_values_int8_as(weights, stride, scales, len, values, 4, 64, out); return;
        case 5: weigh_values_int8_as(weights, stride, scales, len, values, 5, 64, out); return;
        case 6: weigh_values_int8_as(weights, stride, scales, len, values, 6, 64, out); return;
        }
    }
    weigh_values_int8_as(weights, stride, scales, len, values, group, dim, out);
}

/* out[h][d] = x[h][d] * scale[d] for the group's heads (out may be x). */
static void scale_channels(const float *x, int group, int dim, const float *scale,
                           float *out) {
    for (int h = 0; h < group; h++)
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(out + h * dim + d, _mm512_mul_ps(_mm512_loadu_ps(x + h * dim + d),
                                                              _mm512_loadu_ps(scale + d)));
}

/* x [n] rounded to float16 and back (to nearest even), in place: n a multiple of 16. */
static void round_to_half(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_cvtph_ps(_mm512_cvtps_ph(
            _mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

/* row[0 .. len) = softmax(row[0 .. len)) in place, and row[len .. width) = 0. */
static void softmax_row(float *row, int len, int width) {
    __m512 peak = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int j = 0; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + j));
    }
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    for (int j = 0; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), top);
        __m512 e = _mm512_maskz_mov_ps(m, exp512(x));
        total = _mm512_add_ps(total, e);
        _mm512_mask_storeu_ps(row + j, m, e);
    }
    __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int j = 0; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        _mm512_mask_storeu_ps(row + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), inv));
    }
    memset(row + len, 0, sizeof(float) * (width - len));
}

/* softmax_row over the rows 0 .. len - 1 a tree mask shows (bit j of mask: row len - 1 - j;
   rows 64 or more back always show), computed on them packed side by side, as the same
   token in a chain sees them: the same numbers in the same order, so the same result bit
   for bit. Hidden rows get exact zeros. packed: len floats of scratch. */
static void softmax_shown(float *row, int len, int width, uint64_t mask, float *packed) {
    int n = 0;
    for (int c = 0; c < len; c++)
        if (len - 1 - c >= 64 || (mask >> (len - 1 - c) & 1)) packed[n++] = row[c];
    softmax_row(packed, n, n);
    n = 0;
    for (int c = 0; c < len; c++)
        row[c] = len - 1 - c >= 64 || (mask >> (len - 1 - c) & 1) ? packed[n++] : 0.f;
    memset(row + len, 0, sizeof(float) * (width - len));
}

/* A run's scales of one kind (RunCodes), rounded up to whole cache lines: the threads'
   sets lie side by side in Scratch.code_scales. */
static inline int64_t run_scales(int heads) {
    return ((int64_t)RUN_TOKENS * heads + 15) / 16 * 16;
}

/* What a run on int8 lanes computes in integers: its queries as int16 codes with their
   scales (query_codes), and the scales of its attention weights' codes (weight_codes). */
typedef struct {
    int16_t *codes;        /* [RUN_TOKENS * heads][padded_dim(head_dim)] */
    float *scales;         /* [RUN_TOKENS * heads], times the attention scale */
    float *weight_scales;  /* [RUN_TOKENS * heads] */
} RunCodes;

/* A run of n query tokens of one lane at consecutive positions (a prefill chunk, or a
   token and its drafts), the heads of one query group each: token i (queries q + i *
   q_stride, [group][dim]) attends to the lane's rows 0 .. first_len + i - 1 (rows of the
   layer's format, codes scaled per channel by kv's scales + scale_at) and writes
   softmax(scale * q . keys) @ values to out + i * out_stride. The run reads each key and
   value row once for all its tokens (from memory, then from cache), where token by token
   it would read them n times; every token's arithmetic is what it would be alone (a
   key's dot product does not depend on the others, its softmax covers its own rows, and
   the weighted sum adds exact zeros for rows past them), so a step computes the same
   whatever else it holds. A key's scale multiplies the queries instead, a value's the
   weighted sum. masks (NULL: none) hide rows of a draft tree's other branches: bit j of
   masks[i] clear hides row first_len - 1 + i - j from token i (softmax_shown), so a
   tree's token computes what it would in a chain of its branch. ahead: the next run's
   rows, prefetched as the scores are computed.
   scores: [n * group + 1][first_len + n - 1]; rows: [n * group][dim]. */
static void attend_run(const float *q, int64_t q_stride, int n, int group,
                       const uint8_t *keys, const uint8_t *values, const KVLayout *kv,
                       int64_t scale_at, int first_len, int dim, float scale,
                       const uint64_t *masks, float *scores, float *rows,
                       RunCodes *codes, float *out, int64_t out_stride, Ahead *ahead) {
    const int heads = n * group, longest = first_len + n - 1, strips = dim / 16;
    const int quantized = kv->bits == 8 || kv->bits == 4, half = kv->bits == 16;
    const int integer = kv->bits == 8;
    for (int i = 0; i < n; i++) {  /* the run's queries side by side */
        float *to = rows + (int64_t)i * group * dim;
        if (quantized)
            scale_channels(q + i * q_stride, group, dim, kv->key_scale + scale_at, to);
        else
            memcpy(to, q + i * q_stride, sizeof(float) * group * dim);
        if (half) round_to_half(to, (int64_t)group * dim);
    }
    if (integer) {
        for (int h = 0; h < heads; h++)
            codes->scales[h] = scale * query_codes(rows + (int64_t)h * dim, dim,
                                                   codes->codes + (int64_t)h * padded_dim(dim));
        group_scores_int8(codes->codes, codes->scales, heads, keys, longest, dim, scores,
                          ahead);
    } else {
        group_scores(rows, heads, keys, kv->bits, longest, dim, scale, scores, ahead);
    }
    for (int h = 0; h < heads && !integer; h++) {  /* int8 lanes: weight_codes, below */
        const int i = h / group;
        if (masks && ~masks[i])
            softmax_shown(scores + (int64_t)h * longest, first_len + i, longest, masks[i],
                          scores + (int64_t)heads * longest);
        else
            softmax_row(scores + (int64_t)h * longest, first_len + i, longest);
    }
    /* the weighted sums, a few heads at a time so that their sums stay in registers */
    const int at_once = strips <= 24 ? 24 / strips : 1;
    if (integer) {
        for (int h = 0; h < heads; h++)
            codes->weight_scales[h] = weight_codes(scores + (int64_t)h * longest,
                                                   first_len + h / group, longest,
                                                   masks ? masks[h / group] : ~0ull);
        for (int h = 0; h < heads; h += at_once)
            weigh_values_int8((const int16_t *)(scores + (int64_t)h * longest), 2 * longest,
                              codes->weight_scales + h, longest, values,
                              heads - h < at_once ? heads - h : at_once, dim,
                              rows + (int64_t)h * dim);
    } else {
        for (int h = 0; h < heads; h += at_once)
            weigh_values(scores + (int64_t)h * longest, longest, values, kv->bits,
                         heads - h < at_once ? heads - h : at_once, strips,
                         rows + (int64_t)h * dim);
    }
    if (quantized) scale_channels(rows, heads, dim, kv->value_scale + scale_at, rows);
    if (half) round_to_half(rows, (int64_t)heads * dim);
    for (int i = 0; i < n; i++)
        memcpy(out + i * out_stride, rows + (int64_t)i * group * dim, sizeof(float) * group * dim);
}

/* The step's runs (attend_run): starts[r] is run r's first token, starts[runs] = t_rows. */
static int query_runs(int t_rows, const int32_t *lanes, const int32_t *rows,
                      int32_t *starts) {
    int runs = 0;
    for (int t = 0; t < t_rows; t++)
        if (t == 0 || lanes[t] != lanes[t - 1] || rows[t] != rows[t - 1] + 1
                || t - starts[runs - 1] == RUN_TOKENS)
            starts[runs++] = t;
    starts[runs] = t_rows;
    return runs;
}

static void embed_row(const Model *m, int64_t token, float *out) {
    if (m->embed) {
        memcpy(out, m->embed + token * m->hidden, sizeof(float) * m->hidden);
        return;
    }
    const QRows *w = &m->embed_codes;
    const int blocks = block_count(w->k, w->block);
    for (int e = 0; e < w->k; e++) {
        int code;
        if (w->bits == 8) {
            code = w->codes[token * w->k + e];
        } else {
            uint8_t byte = w->codes[token * (w->k / 2) + e / 2];
            code = e & 1 ? byte >> 4 : byte & 15;
        }
        const int64_t at = token * blocks + e / w->block;
        int zero = w->zeros ? w->zeros[at] : 1 << (w->bits - 1);
        out[e] = (float)(code - zero) * w->scales[at];
    }
}

typedef struct {
    float *x, *h;           /* [T][hidden] the residual stream, the normed input (the head's
                               rows at the end) */
    float *qkv, *attn, *proj, *gate_up, *act;  /* one chunk's rows' (chunk_rows) */
    float *scores;          /* [threads][RUN_TOKENS * group + 1][longest] attention scores
                               (and a row to pack a tree token's shown ones) */
    int64_t scores_stride;  /* one thread's share */
    float *rows;            /* [threads][RUN_TOKENS * heads][head_dim] a run's queries, sums */
    int16_t *query_codes;   /* [threads][RUN_TOKENS * heads][padded_dim(head_dim)] and */
    float *code_scales;     /* [threads][2][run_scales(heads)]: a run's RunCodes */
    int32_t *runs;          /* [T + 1] where each run of query tokens starts (query_runs) */
    QActivations q;
    int8_t *amx_rows;       /* QActivations.rows for the matrices that take AMX tiles */
} Scratch;

/* Memory that starts on a cache line: a vector store into an output row then touches
   one line, not two. */
static void *lines_alloc(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static int layer_rows = LAYER_ROWS;

/* The rows of a step a layer runs at a time. */
static inline int chunk_rows(const Model *m) {
    return layer_rows * (m->num_threads > 1 ? m->num_threads : 1);
}

/* Sets how many rows per thread a layer runs at a time (rows > 0; LAYER_ROWS by default),
   for the test that cuts steps into small chunks: every output stays the same, bit for
   bit. Returns the previous value. */
int llmopt_native_layer_rows(int rows) {
    const int previous = layer_rows;
    if (rows > 0) layer_rows = rows;
    return previous;
}

/* The widest activation a projection quantizes (its K). */
static inline int scratch_width(const Model *m) {
    const int width = m->hidden > m->intermediate ? m->hidden : m->intermediate;
    return m->heads * m->head_dim > width ? m->heads * m->head_dim : width;
}

/* Scratch for a step of t_rows rows (and as many logit rows at most), run in chunks of
   chunk_rows. */
static int scratch_alloc(const Model *m, int t_rows, int longest, Scratch *s) {
    const int width = scratch_width(m), attn_width = m->heads * m->head_dim;
    int qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    s->x = lines_alloc(sizeof(float) * t_rows * m->hidden);
    s->h = lines_alloc(sizeof(float) * t_rows * m->hidden);
    const int64_t t = t_rows < chunk_rows(m) ? t_rows : chunk_rows(m);
    s->qkv = lines_alloc(sizeof(float) * t * qkv_width);
    s->attn = lines_alloc(sizeof(float) * t * attn_width);
    s->proj = lines_alloc(sizeof(float) * t * m->hidden);
    s->gate_up = lines_alloc(sizeof(float) * t * 2 * m->intermediate);
    s->act = lines_alloc(sizeof(float) * t * m->intermediate);
    const int64_t padded = (t + TOKEN_TILE - 1) / TOKEN_TILE * TOKEN_TILE;
    s->q.codes = lines_alloc(padded * width);
    s->q.scales = lines_alloc(sizeof(float) * padded * (width / 32));
    s->q.zero_term = lines_alloc(sizeof(int32_t) * padded * (width / 32));
    s->q.inputs = lines_alloc(sizeof(float) * padded * (width / 32));
    s->q.rows = NULL;
    /* only where a matrix may take tiles (amx_takes): elsewhere a step allocates nothing */
    s->amx_rows = amx_enabled ? lines_alloc((t + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * width)
                              : NULL;
    s->scores_stride = ((int64_t)RUN_TOKENS * (m->heads / m->kv_heads) + 1) * longest;
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    s->scores = lines_alloc(sizeof(float) * s->scores_stride * threads);
    s->rows = lines_alloc(sizeof(float) * RUN_TOKENS * attn_width * threads);
    s->runs = lines_alloc(sizeof(int32_t) * (t + threads));  /* a run list per thread */
    s->query_codes = lines_alloc(sizeof(int16_t) * RUN_TOKENS * m->heads
                                 * padded_dim(m->head_dim) * threads);
    s->code_scales = lines_alloc(sizeof(float) * 2 * run_scales(m->heads) * threads);
    return s->x && s->h && s->qkv && s->attn && s->proj && s->gate_up && s->act && s->q.codes
        && s->q.inputs && s->q.scales && s->q.zero_term && s->scores && s->rows && s->runs
        && s->query_codes && s->code_scales && (s->amx_rows || !amx_enabled);
}

static void scratch_free(Scratch *s) {
    free(s->x); free(s->h); free(s->qkv); free(s->attn); free(s->proj); free(s->gate_up);
    free(s->act); free(s->q.codes); free(s->q.scales); free(s->q.zero_term); free(s->q.inputs);
    free(s->scores); free(s->rows); free(s->runs); free(s->amx_rows); free(s->query_codes);
    free(s->code_scales);
}

/* Thread id's share of the scratch one attend_run uses: its scores, query rows and codes. */
typedef struct {
    float *scores, *rows;
    RunCodes codes;
} RunScratch;

static RunScratch run_scratch(const Model *m, const Scratch *s, int id) {
    const int64_t heads = m->heads;
    float *scales = s->code_scales + 2 * id * run_scales(m->heads);
    return (RunScratch){s->scores + id * s->scores_stride,
                        s->rows + id * RUN_TOKENS * heads * m->head_dim,
                        {s->query_codes + id * RUN_TOKENS * heads * padded_dim(m->head_dim),
                         scales, scales + run_scales(m->heads)}};
}

static int linear(const Model *m, const QMatrix *w, const float *x, int t_rows, Scratch *s,
                  float *y) {
    s->q.rows = amx_takes(w, t_rows) ? s->amx_rows : NULL;
    quantize_rows(x, t_rows, w, m->num_threads, &s->q);
    return gemm(w, &s->q, t_rows, y, m->num_threads);
}

/* Where lane `lane`'s rows of query group g start in a layer's pool (bytes). */
static inline int64_t lane_start(int lane, int g, int kv_heads, int lane_tokens,
                                 int64_t stride) {
    return ((int64_t)lane * kv_heads + g) * lane_tokens * stride;
}

/* One layer's KV write: the heads' norms where the layer has them (q_norm, k_norm: NULL
   for none), rotary at each token's position (and the layer's rotation), then the step's
   keys and values into their lanes' rows in the layer's format. */
static void write_kv(const Model *m, const KVLayout *kv, const float *q_norm,
                     const float *k_norm, int t_rows, const int32_t *lanes,
                     const int32_t *positions, const int32_t *lane_rows, uint8_t *key_pool,
                     uint8_t *value_pool, int lane_tokens, Scratch *s) {
    const int dim = m->head_dim, heads = m->heads, kv_heads = m->kv_heads, half = dim / 2;
    const int qkv_width = (heads + 2 * kv_heads) * dim;
    const int64_t stride = row_bytes(kv->bits, dim);
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int t = 0; t < t_rows; t++) {
        float *q = s->qkv + (int64_t)t * qkv_width, *k = q + heads * dim, *v = k + kv_heads * dim;
        const float *cos = m->rope_cos + (int64_t)positions[t] * half;
        const float *sin = m->rope_sin + (int64_t)positions[t] * half;
        for (int h = 0; q_norm && h < heads + kv_heads; h++)  /* keys follow the queries */
            rms_norm(q + h * dim, h < heads ? q_norm : k_norm, m->eps, dim, q + h * dim);
        rotary(q, heads, dim, cos, sin);
        rotary(k, kv_heads, dim, cos, sin);
        if (kv->hadamard)  /* the keys follow the queries in the row: one pass for both */
            hadamard_heads(q, heads + kv_heads, dim, kv->rotation[0]);
        else if (kv->rotation)
            rotate_heads(q, heads + kv_heads, dim, kv->rotation);
        for (int g = 0; g < kv_heads; g++) {
            const int64_t at = lane_start(lanes[t], g, kv_heads, lane_tokens, stride)
                               + lane_rows[t] * stride;
            const int64_t channel = (int64_t)g * dim;
            store_row(k + channel, kv->key_scale ? kv->key_scale + channel : NULL, kv->bits,
                      dim, key_pool + at);
            store_row(v + channel, kv->value_scale ? kv->value_scale + channel : NULL,
                      kv->bits, dim, value_pool + at);
        }
    }
}

/* Attention's item i (attend below): run i / kv_heads of the step's runs (its first token
   *t, its length *n) against query group *g = i % kv_heads. */
static inline void run_item(const int32_t *runs, int kv_heads, int i, int *t, int *n,
                            int *g) {
    *t = runs[i / kv_heads];
    *n = runs[i / kv_heads + 1] - *t;
    *g = i % kv_heads;
}

/* One layer's attention after write_kv: every query token attends to its lane's rows 0 ..
   its own but those its tree mask hides, a lane's consecutive rows together (attend_run).
   Each thread takes a range of items in order, so item i + 1's rows are the ones to
   prefetch during item i. */
static void attend(const Model *m, const KVLayout *kv, int t_rows, const int32_t *lanes,
                   const int32_t *lane_rows, const uint64_t *masks, const uint8_t *key_pool,
                   const uint8_t *value_pool, int lane_tokens, Scratch *s) {
    const int dim = m->head_dim, heads = m->heads, kv_heads = m->kv_heads;
    const int qkv_width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t stride = row_bytes(kv->bits, dim);
    const int items = query_runs(t_rows, lanes, lane_rows, s->runs) * kv_heads;
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int i = 0; i < items; i++) {
        int t, n, g;
        run_item(s->runs, kv_heads, i, &t, &n, &g);
        Ahead ahead = {0};
        if (i + 1 < items) {
            int next_t, next_n, next_g;
            run_item(s->runs, kv_heads, i + 1, &next_t, &next_n, &next_g);
            const int64_t at = lane_start(lanes[next_t], next_g, kv_heads, lane_tokens, stride);
            ahead = (Ahead){(const char *)key_pool + at, (const char *)value_pool + at,
                            (lane_rows[next_t] + next_n) * stride, 0};
        }
#ifdef _OPENMP
        int id = omp_get_thread_num();
#else
        int id = 0;
#endif
        RunScratch run = run_scratch(m, s, id);
        const int64_t lane = lane_start(lanes[t], g, kv_heads, lane_tokens, stride);
        attend_run(s->qkv + (int64_t)t * qkv_width + g * group * dim, qkv_width, n, group,
                   key_pool + lane, value_pool + lane, kv, (int64_t)g * dim, lane_rows[t] + 1,
                   dim, m->attn_scale, masks ? masks + t : NULL,
                   run.scores, run.rows, &run.codes,
                   s->attn + (int64_t)t * heads * dim + g * group * dim, (int64_t)heads * dim,
                   &ahead);
    }
}

static void add_norm(float *x, const float *delta, const float *weight, const Model *m,
                     int t_rows, float *h) {
    #pragma omp parallel for num_threads(m->num_threads) \
        if (m->num_threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int t = 0; t < t_rows; t++) {
        float *row = x + (int64_t)t * m->hidden;
        const float *d = delta + (int64_t)t * m->hidden;
        for (int i = 0; i < m->hidden; i++) row[i] += d[i];
        if (weight) rms_norm(row, weight, m->eps, m->hidden, h + (int64_t)t * m->hidden);
    }
}

/* y [T][N] = x [T][K] times w's transpose, x quantized as every step quantizes it. */
int llmopt_linear(const QMatrix *w, const float *x, int32_t t_rows, float *y, int32_t threads) {
    const int64_t padded = ((int64_t)t_rows + TOKEN_TILE - 1) / TOKEN_TILE * TOKEN_TILE;
    const int64_t blocks = padded * (w->k / 32);
    const int64_t amx_padded = ((int64_t)t_rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    QActivations q = {lines_alloc(padded * w->k), lines_alloc(sizeof(float) * blocks),
                      lines_alloc(sizeof(int32_t) * blocks), lines_alloc(sizeof(float) * blocks),
                      amx_takes(w, t_rows) ? lines_alloc(amx_padded * w->k) : NULL};
    int ok = q.codes && q.scales && q.zero_term && q.inputs && (q.rows || !amx_takes(w, t_rows));
    if (ok) {
        quantize_rows(x, t_rows, w, threads, &q);
        ok = gemm(w, &q, t_rows, y, threads) == 0;
    }
    free(q.codes); free(q.scales); free(q.zero_term); free(q.inputs); free(q.rows);
    return ok ? 0 : -1;
}

/* One run of attention (attend_run) on the caller's rows, for tests against an exact
   reference: n query tokens of `group` heads (q [n][group][dim], rotated already) at
   positions first_len - 1 .. first_len + n - 2 of one lane whose first first_len + n - 1
   rows `keys` and `values` hold, in kv's format (its scales: this group's channels); masks
   as llmopt_forward's (NULL: none). out [n][group][dim]. Returns 0, or -1 when memory runs
   out. */
int llmopt_attention(const KVLayout *kv, const float *q, int32_t n, int32_t group,
                     const uint8_t *keys, const uint8_t *values, int32_t first_len,
                     int32_t dim, float scale, const uint64_t *masks, float *out) {
    const int longest = first_len + n - 1, heads = n * group;
    float *scores = lines_alloc(sizeof(float) * (heads + 1) * longest);
    float *rows = lines_alloc(sizeof(float) * heads * dim);
    RunCodes codes = {lines_alloc(sizeof(int16_t) * heads * padded_dim(dim)),
                      lines_alloc(sizeof(float) * heads), lines_alloc(sizeof(float) * heads)};
    const int ok = scores && rows && codes.codes && codes.scales && codes.weight_scales;
    Ahead ahead = {0};
    if (ok)
        attend_run(q, (int64_t)group * dim, n, group, keys, values, kv, 0, first_len, dim,
                   scale, masks, scores, rows, &codes, out, (int64_t)group * dim, &ahead);
    free(scores); free(rows); free(codes.codes); free(codes.scales); free(codes.weight_scales);
    return ok ? 0 : -1;
}

/* A step's tokens as llmopt_forward has them (see there), and the layers' KV pools. */
typedef struct {
    const int32_t *lanes, *positions, *lane_rows;
    const uint64_t *masks;
    uint8_t *const *key_pools, *const *value_pools;
    int32_t lane_tokens;
} StepTokens;

/* Adds the time since *clock to `phase` (no clock: a thread that keeps no profile). */
static inline void mark(double *clock, int phase) {
    if (clock) *clock = profile_phase(phase, *clock);
}

/* Layer l's first part over the step's rows c .. c + rows - 1 (their residual stream and
   normed input at row c of s->x and s->h, everything else in the chunk's scratch): the
   q/k/v projection and the KV write. */
static int layer_qkv(const Model *m, int l, const StepTokens *step, int c, int rows,
                     Scratch *s, double *clock) {
    const int status = linear(m, &m->qkv[l], s->h + (int64_t)c * m->hidden, rows, s, s->qkv);
    mark(clock, PHASE_QKV);
    write_kv(m, &m->kv[l], m->q_norm ? m->q_norm[l] : NULL, m->k_norm ? m->k_norm[l] : NULL,
             rows, step->lanes + c, step->positions + c, step->lane_rows + c,
             step->key_pools[l], step->value_pools[l], step->lane_tokens, s);
    mark(clock, PHASE_KV_WRITE);
    return status;
}

/* The MLP over `rows` rows of h (normed), into s->proj, in one parallel region: each thread
   quantizes its share of h, then after a barrier takes a range of the intermediate's
   columns from end to end (gate's row groups lo .. hi - 1 and up's matching ones, whole
   blocks of down's input), their SiLU for every row and those blocks of down's input
   quantized; after a barrier, its share of down's row groups. Each thread's SiLU reads only
   the gate and up columns it wrote (SiLU split by rows read half of them from the other
   core's cache), and the MLP meets twice instead of opening five regions. */
static int mlp(const Model *m, const QMatrix *gate_up, const QMatrix *down, const float *h,
               int rows, Scratch *s, double *clock) {
    const int inter = m->intermediate;
    const int64_t pairs = inter / 16;           /* gate's row groups; up's follow */
    const int64_t unit = down->block / 16;      /* pairs a block of down's input spans */
    QActivations in = s->q, mid = s->q;         /* the same buffers, one after the other */
    in.rows = amx_takes(gate_up, rows) ? s->amx_rows : NULL;
    mid.rows = amx_takes(down, rows) ? s->amx_rows : NULL;
    const int64_t items = quantize_items(rows, gate_up, &in);
    int status = 0;
    #pragma omp parallel num_threads(m->num_threads) if (m->num_threads > 1) \
        reduction(|: status)
    {
#ifdef _OPENMP
        double *own_clock = omp_get_thread_num() == 0 ? clock : NULL;
#else
        double *own_clock = clock;
#endif
        int64_t lo, hi;
        thread_share(items, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) quantize_item(h, rows, gate_up, i, &in);
        #pragma omp barrier
        thread_share((pairs + unit - 1) / unit, &lo, &hi);
        lo = lo * unit < pairs ? lo * unit : pairs;
        hi = hi * unit < pairs ? hi * unit : pairs;
        status |= gemm_share(gate_up, &in, rows, s->gate_up, lo, hi, in.rows != NULL);
        status |= gemm_share(gate_up, &in, rows, s->gate_up, pairs + lo, pairs + hi,
                             in.rows != NULL);
        mark(own_clock, PHASE_GATE_UP);
        for (int t = 0; t < rows && lo < hi; t++) {
            const float *gate = s->gate_up + (int64_t)t * 2 * inter + 16 * lo;
            silu_times(gate, gate + inter, (int)(16 * (hi - lo)),
                       s->act + (int64_t)t * inter + 16 * lo);
        }
        mark(own_clock, PHASE_SILU);
        #pragma omp barrier  /* every thread's gate/up done with `in` before `mid` reuses it */
        quantize_blocks(s->act, rows, down, (int)(16 * lo / down->block),
                        (int)((16 * hi + down->block - 1) / down->block), &mid);
        #pragma omp barrier
        thread_share((down->n + 15) / 16, &lo, &hi);
        status |= gemm_share(down, &mid, rows, s->proj, lo, hi, mid.rows != NULL);
        mark(own_clock, PHASE_DOWN);
    }
    return status;
}

/* The rest of layer l over the same rows, once the rows before c and every row of the chunk
   have written this layer's keys and values: attention reads what it would with every row
   at once (a run of query tokens cut at c computes the same per token: attend_run), then
   o, the MLP and both residual adds. */
static int layer_rest(const Model *m, int l, const StepTokens *step, int c, int rows,
                      Scratch *s, double *clock) {
    const int hidden = m->hidden;
    float *x = s->x + (int64_t)c * hidden, *h = s->h + (int64_t)c * hidden;
    attend(m, &m->kv[l], rows, step->lanes + c, step->lane_rows + c,
           step->masks ? step->masks + c : NULL, step->key_pools[l], step->value_pools[l],
           step->lane_tokens, s);
    mark(clock, PHASE_ATTEND);
    int status = linear(m, &m->o[l], s->attn, rows, s, s->proj);
    mark(clock, PHASE_O);
    add_norm(x, s->proj, m->mlp_norm[l], m, rows, h);
    mark(clock, PHASE_NORMS);
    status |= mlp(m, &m->gate_up[l], &m->down[l], h, rows, s, clock);
    add_norm(x, s->proj, l + 1 < m->layers ? m->attn_norm[l + 1] : NULL, m, rows, h);
    mark(clock, PHASE_NORMS);
    return status;
}

/* Thread `id`'s part of the chunk's scratch for its rows lo .. of the chunk (lo a multiple
   of TOKEN_TILE, and of AMX_ROWS where AMX tiles run): its rows of the chunk-wide arrays
   and its own share of the per-thread ones, seen from its first row as a one-thread step
   sees them. (Every thread but the last has whole tiles of rows, so each one's layout of
   its rows ends where the next one's starts, and the last one's where a one-thread layout
   of all the rows would.) */
static Scratch thread_scratch(const Model *m, const Scratch *s, int id, int lo) {
    const int attn_width = m->heads * m->head_dim, width = scratch_width(m);
    Scratch v = *s;
    v.qkv += (int64_t)lo * (m->heads + 2 * m->kv_heads) * m->head_dim;
    v.attn += (int64_t)lo * attn_width;
    v.proj += (int64_t)lo * m->hidden;
    v.gate_up += (int64_t)lo * 2 * m->intermediate;
    v.act += (int64_t)lo * m->intermediate;
    /* activation codes are laid out per matrix (QActivations): a thread's own layout of
       its rows starts where its rows would in the widest one */
    v.q.codes += (int64_t)lo * width / 4;
    v.q.scales += (int64_t)lo * (width / 32);
    v.q.zero_term += (int64_t)lo * (width / 32);
    v.q.inputs += (int64_t)lo * (width / 32);
    if (v.amx_rows) v.amx_rows += (int64_t)lo * width;
    const RunScratch run = run_scratch(m, s, id);  /* the view's thread 0 */
    v.scores = run.scores;
    v.rows = run.rows;
    v.query_codes = run.codes.codes;
    v.code_scales = run.codes.scales;
    v.runs += lo + id;
    return v;
}

/* Rows a thread takes when a layer's `rows` are split between `count` threads: whole tiles
   (AMX tiles' 16 rows where they run: thread_scratch), the last thread the rest. */
static inline int split_share(int rows, int count) {
    const int align = amx_enabled ? AMX_ROWS : TOKEN_TILE;
    return ((rows + count - 1) / count + align - 1) / align * align;
}

/* Layer l over rows c .. c + rows - 1 split between threads by rows: each thread runs the
   whole layer on its own rows as a one-thread step would, meeting the others only once,
   after the KV write (attention may read keys that another thread's rows wrote). Split
   phase by phase instead (every projection by columns, every per-row phase by rows), each
   phase reads what the other core wrote in the last: in prefill, about half of every
   phase's input came from the other core's cache. (The phase profile follows thread 0: its
   waits for the others land in attend and in the next layer's qkv.) whole 0: the q/k/v
   projection and the KV write alone (layer_qkv's part). */
static int layer_split(const Model *m, int l, const StepTokens *step, int c, int rows,
                       Scratch *s, double *clock, int whole) {
    const int threads = m->num_threads;
    Model one = *m;
    one.num_threads = 1;
    int status = 0;
    (void)threads;
    #pragma omp parallel num_threads(threads) reduction(|: status)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        const int id = 0, count = 1;
#endif
        const int per = split_share(rows, count);
        const int lo = id * per < rows ? id * per : rows;
        const int hi = lo + per < rows ? lo + per : rows;
        Scratch own = thread_scratch(m, s, id, lo);
        double *own_clock = id == 0 ? clock : NULL;
        if (lo < hi) status |= layer_qkv(&one, l, step, c + lo, hi - lo, &own, own_clock);
        if (whole) {
            #pragma omp barrier
            if (lo < hi) status |= layer_rest(&one, l, step, c + lo, hi - lo, &own, own_clock);
        }
    }
    return status;
}

static int split_rows = SPLIT_ROWS;

/* Sets from how many rows per thread a layer's rows are split between threads (rows > 0;
   SPLIT_ROWS by default), for the test that splits small steps: every output stays the
   same, bit for bit. Returns the previous value. */
int llmopt_native_split_rows(int rows) {
    const int previous = split_rows;
    if (rows > 0) split_rows = rows;
    return previous;
}

/* Whether a layer's `rows` are split between threads by rows (layer_split): split_rows a
   thread or more, and shares even enough. */
static inline int splits(const Model *m, int rows) {
    if (m->num_threads <= 1 || rows < m->num_threads * split_rows) return 0;
    /* the last thread's share short by at most a sixteenth of the rows: the others wait
       for the largest share (2 threads against splitting every phase: 48 rows, 24 + 24,
       0.97x; 40 rows, 24 + 16, 1.11x; 72, 40 + 32, 1.08x) */
    return (split_share(rows, m->num_threads) * m->num_threads - rows) * 16 <= rows;
}

/* Layer l over the step's rows c .. c + rows - 1: by rows between threads where `splits`,
   else every phase split between the threads. */
static int layer_chunk(const Model *m, int l, const StepTokens *step, int c, int rows,
                       Scratch *s, double *clock) {
    if (splits(m, rows)) return layer_split(m, l, step, c, rows, s, clock, 1);
    const int status = layer_qkv(m, l, step, c, rows, s, clock);  /* (| orders no calls) */
    return status | layer_rest(m, l, step, c, rows, s, clock);
}

/* The rows of a step whose logits it returns, and where the last layer leaves them. */
typedef struct {
    uint8_t *wanted;       /* [T] 1: the step returns row t's logits */
    int32_t *moved;        /* [T] row t's place in s->x after the last layer */
    int32_t *lanes, *lane_rows;  /* [T] the kept rows' (compacted; StepTokens') */
    uint64_t *masks;       /* [T], or NULL where the step has none */
} KeptRows;

/* The last layer over rows c .. c + rows - 1 where only some rows' logits are wanted (a
   prefill returns its last token's): every row writes its keys and values, and only the
   wanted rows, moved to the chunk's first rows (their q/k/v and residual rows, and their
   lanes, rows and masks in `kept`), go on through attention, o and the MLP. Nothing reads
   the others' outputs past this layer, and each kept row computes what it would among
   all of them (attend_run: a token's attention does not depend on the run it is in): the
   same logits, bit for bit, for about 1 / layers less work in a long prefill. */
static int last_layer_chunk(const Model *m, int l, const StepTokens *step, int c, int rows,
                            Scratch *s, double *clock, KeptRows *kept) {
    int status = splits(m, rows) ? layer_split(m, l, step, c, rows, s, clock, 0)
                                 : layer_qkv(m, l, step, c, rows, s, clock);
    const int64_t qkv_width = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim;
    const int hidden = m->hidden;
    int n = 0;
    for (int i = 0; i < rows; i++) {
        const int t = c + i, to = c + n;
        if (!kept->wanted[t]) continue;
        if (n != i) {  /* rows move down only: a row's new place holds nothing still needed */
            memcpy(s->qkv + n * qkv_width, s->qkv + i * qkv_width, sizeof(float) * qkv_width);
            memcpy(s->x + (int64_t)to * hidden, s->x + (int64_t)t * hidden,
                   sizeof(float) * hidden);
        }
        kept->lanes[to] = step->lanes[t];
        kept->lane_rows[to] = step->lane_rows[t];
        if (kept->masks) kept->masks[to] = step->masks[t];
        kept->moved[t] = to;
        n++;
    }
    if (n == 0) return status;
    StepTokens compact = *step;
    compact.lanes = kept->lanes;
    compact.lane_rows = kept->lane_rows;
    compact.masks = kept->masks;
    return status | layer_rest(m, l, &compact, c, n, s, clock);
}

static void kept_free(KeptRows *kept) {
    free(kept->wanted); free(kept->moved); free(kept->lanes); free(kept->lane_rows);
    free(kept->masks);
}

/* KeptRows for a step of t_rows rows returning logit_rows' logits; 0 when memory runs out. */
static int kept_alloc(int t_rows, int n_logits, const int32_t *logit_rows, int masks,
                      KeptRows *kept) {
    kept->wanted = calloc(t_rows, 1);
    kept->moved = malloc(sizeof(int32_t) * t_rows);
    kept->lanes = malloc(sizeof(int32_t) * t_rows);
    kept->lane_rows = malloc(sizeof(int32_t) * t_rows);
    kept->masks = masks ? malloc(sizeof(uint64_t) * t_rows) : NULL;
    if (!kept->wanted || !kept->moved || !kept->lanes || !kept->lane_rows
            || (masks && !kept->masks))
        return 0;
    for (int r = 0; r < n_logits; r++) kept->wanted[logit_rows[r]] = 1;
    return 1;
}

/* One step. Token t (of T, packed) has id tokens[t] and position positions[t], sits in
   lane lanes[t] at row lane_rows[t] (its position but in a draft tree, whose siblings
   share positions), where its key and value are written in every layer; masks[t] (masks
   NULL: none) hides a tree's other branches from it (attend_run). Logit row r is the
   head's output for token logit_rows[r]. Each layer runs over the rows chunk_rows at a
   time, in order. Returns 0, or -1 when memory runs out. */
int llmopt_forward(const Model *m, int32_t t_rows, const int64_t *tokens,
                   const int32_t *lanes, const int32_t *positions, const int32_t *lane_rows,
                   const uint64_t *masks, uint8_t *const *key_pools,
                   uint8_t *const *value_pools, int32_t lane_tokens, int32_t n_logits,
                   const int32_t *logit_rows, float *logits) {
    Scratch s;
    int longest = 1;
    for (int t = 0; t < t_rows; t++) if (lane_rows[t] + 1 > longest) longest = lane_rows[t] + 1;
    if (!scratch_alloc(m, t_rows > n_logits ? t_rows : n_logits, longest, &s)) {
        scratch_free(&s);
        return -1;
    }
    const StepTokens step = {lanes, positions, lane_rows, masks, key_pools, value_pools,
                             lane_tokens};
    const int hidden = m->hidden;
    double clock = profile_clock();
    #pragma omp parallel for num_threads(m->num_threads) \
        if (m->num_threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int t = 0; t < t_rows; t++) {
        embed_row(m, tokens[t], s.x + (int64_t)t * hidden);
        rms_norm(s.x + (int64_t)t * hidden, m->attn_norm[0], m->eps, hidden,
                 s.h + (int64_t)t * hidden);
    }
    clock = profile_phase(PHASE_EMBED, clock);
    const int chunk = chunk_rows(m);
    KeptRows kept = {0};
    const int trim = n_logits < t_rows;  /* some rows' logits unwanted: last_layer_chunk */
    /* status: an AMX tile's unpacking buffer, or kept's arrays, may fail to allocate */
    int status = trim && !kept_alloc(t_rows, n_logits, logit_rows, masks != NULL, &kept);
    for (int l = 0; l < m->layers && !status; l++)
        for (int c = 0; c < t_rows && !status; c += chunk) {
            const int rows = t_rows - c < chunk ? t_rows - c : chunk;
            status |= trim && l == m->layers - 1
                ? last_layer_chunk(m, l, &step, c, rows, &s, &clock, &kept)
                : layer_chunk(m, l, &step, c, rows, &s, &clock);
        }
    for (int r = 0; r < n_logits && !status; r++)
        rms_norm(s.x + (int64_t)(trim ? kept.moved[logit_rows[r]] : logit_rows[r]) * hidden,
                 m->final_norm, m->eps, hidden, s.h + (int64_t)r * hidden);
    for (int r = 0; r < n_logits && !status; r += chunk)
        status = linear(m, &m->head, s.h + (int64_t)r * hidden,
                        n_logits - r < chunk ? n_logits - r : chunk, &s,
                        logits + (int64_t)r * m->head.n);
    profile_phase(PHASE_HEAD, clock);
    scratch_free(&s);
    kept_free(&kept);
    return status ? -1 : 0;
}
#pragma GCC pop_options

/* A CPython module with no functions: it exists so that the import system finds this
   shared library wherever the package is installed; ctypes calls the functions above. */
static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT, "_kernels", "llmopt's native decoder step (called through ctypes)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }

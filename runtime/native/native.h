/* The types every part of the step shares (kernels.c includes it first; runtime/native/
   library.py mirrors the structs in ctypes, tests/runtime/native checks their layouts). */
#ifndef LLMOPT_NATIVE_H
#define LLMOPT_NATIVE_H

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
    const uint8_t *lut;     /* [16] a code book's 4-bit code -> unsigned 8-bit value (zero
                               points 128), or NULL: codes are values (see nf4.c) */
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
    int32_t window;             /* a sliding window: a query at position p sees the keys at
                                   positions above p - window; 0: every key */
} KVLayout;

/* A model's settings: where a step may run on AMX tiles, how it cuts its rows, whether it
   profiles. Every output is the same, bit for bit, whatever they are: they move speed only.
   llmopt_native_knobs gives the defaults; each model holds its own (library.py's Knobs). */
typedef struct {
    int32_t amx;            /* 1: projections of amx_min_rows rows or more run on AMX tiles
                               (only where llmopt_native_amx_available said so) */
    int32_t amx_min_rows;   /* AMX_MIN_ROWS by default */
    int32_t layer_rows;     /* rows per thread a layer runs at a time: LAYER_ROWS */
    int32_t split_rows;     /* rows per thread from which a layer's rows are split between
                               threads: SPLIT_ROWS */
    double *phase_seconds;  /* [PHASES] the phase profile's sums (profile.c), or NULL: off */
} Knobs;

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
    Knobs knobs;  /* last: a build that predates it reads the fields before it alike */
} Model;

/* The step's tile sizes. Each trades cache reuse against parallel overhead; the reasons
   stay here, the timings behind them in benchmarks/README.md (native_kernels_ab.py). */
#define PREFETCH_SLICES 16  /* how far ahead of the weight stream to prefetch (slices of 32
                               columns), every 64-byte line of it, into L1: prefetching every
                               other line and leaving its pair to the adjacent-line
                               prefetcher stalled the dots on the pair's demand misses */
#define STREAM_PREFETCH_SLICES 32  /* fewer rows (a batch-1 decode step, bound by the weight
                               stream) also prefetch this far ahead into L2: the L1 prefetch
                               alone does not keep enough lines in flight to draw the
                               stream's bandwidth */
#define TOKEN_TILE 8        /* activation rows that share each unpacked weight slice */
#define PARALLEL_ROWS 16    /* rows from which per-row work (quantizing, norms, rotary, SiLU)
                               is split between threads: below, a parallel region costs more
                               than it saves */
#define RUN_TOKENS 8        /* a lane's consecutive query tokens that attend together */
#define LAYER_ROWS 128      /* a step's rows a layer runs at a time per thread (all of
                               them, up to this; the default of Knobs.layer_rows): a chunk's
                               projections, attention and MLP keep their activations in L2,
                               where a long prefill step streamed each phase's output
                               through memory */
#define SPLIT_ROWS 16       /* rows per thread from which a layer's rows are split between
                               threads rather than each phase's work (layer_split; the
                               default of Knobs.split_rows): two tiles a thread already beat
                               splitting every projection by columns */
#define ROW_CHUNK 64        /* activation rows a pass over the weights serves (their codes
                               stay in cache while it runs; a matrix's weights stay in L2/L3
                               between passes) */

#endif

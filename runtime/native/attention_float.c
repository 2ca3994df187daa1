/* A group's scores and weighted sums over lane rows decoded to float.
   Included by kernels.c: the step is one translation unit. */

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
   batch-16 step's runs read ~24 KB each, one after another. (No extra pass loads a run's
   rows before its loops: where they are in L2 already, that pass only costs.) */
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

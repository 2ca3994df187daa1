/* Softmax, and a run of a lane's query tokens attending together.
   Included by kernels.c: the step is one translation unit. */

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

/* row[first .. len) = softmax(row[first .. len)) in place, and every other row up to width
   0. The vectors start at `first`: a token whose window starts there computes what it
   would with its rows starting at 0, bit for bit. */
static void softmax_row(float *row, int first, int len, int width) {
    __m512 peak = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int j = first; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + j));
    }
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    for (int j = first; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), top);
        __m512 e = _mm512_maskz_mov_ps(m, exp512(x));
        total = _mm512_add_ps(total, e);
        _mm512_mask_storeu_ps(row + j, m, e);
    }
    __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int j = first; j < len; j += 16) {
        __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        _mm512_mask_storeu_ps(row + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), inv));
    }
    memset(row, 0, sizeof(float) * first);
    memset(row + len, 0, sizeof(float) * (width - len));
}

/* softmax_row over the rows first .. len - 1 a tree mask shows (bit j of mask: row len - 1
   - j; rows 64 or more back always show), computed on them packed side by side, as the
   same token in a chain sees them: the same numbers in the same order, so the same result
   bit for bit. Hidden rows get exact zeros. packed: len floats of scratch. */
static void softmax_shown(float *row, int first, int len, int width, uint64_t mask,
                          float *packed) {
    int n = 0;
    for (int c = first; c < len; c++)
        if (len - 1 - c >= 64 || (mask >> (len - 1 - c) & 1)) packed[n++] = row[c];
    softmax_row(packed, 0, n, n);
    n = 0;
    for (int c = 0; c < len; c++)
        row[c] = c >= first && (len - 1 - c >= 64 || (mask >> (len - 1 - c) & 1))
                 ? packed[n++] : 0.f;
    memset(row + len, 0, sizeof(float) * (width - len));
}

/* H2O's accumulated attention: sums[j] += the weights of token i's `group` heads on row j
   (their sum, heads in order), for the run's tokens in order, each over its own rows 0 ..
   first_len + i - 1. The weights are softmax_row's floats, or (weight_scales non-NULL)
   weight_codes' int16 codes times their scales. */
static void add_weights(const float *scores, const float *weight_scales, int n, int group,
                        int first_len, int longest, float *sums) {
    for (int i = 0; i < n; i++) {
        const int len = first_len + i;
        for (int j = 0; j < len; j += 16) {
            const __mmask16 m = rows_before(j, len);
            __m512 total = _mm512_setzero_ps();
            for (int h = i * group; h < (i + 1) * group; h++) {
                const float *row = scores + (int64_t)h * longest;
                total = _mm512_add_ps(total, weight_scales
                    ? _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                          _mm256_maskz_loadu_epi16(m, (const int16_t *)row + j))),
                                    _mm512_set1_ps(weight_scales[h]))
                    : _mm512_maskz_loadu_ps(m, row + j));
            }
            _mm512_mask_storeu_ps(sums + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, sums + j),
                                                             total));
        }
    }
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

/* Where token i of a run sees its window from (rows of the lane; 0: every row), for a
   token at cache position p: the keys at positions above p - window, as the graph's mask
   (q - k < window). A chain's rows are its positions; a tree's token (position below its
   row) sees its context's rows by position, its ancestors lying inside the window (the
   executor checks trees are shallower than it). positions NULL: token i at first_len - 1
   + i. Returns the smallest. */
static int window_starts(const KVLayout *kv, const int32_t *positions, int n, int first_len,
                         int *starts) {
    int least = first_len + n;
    for (int i = 0; i < n; i++) {
        const int p = positions ? positions[i] : first_len - 1 + i;
        starts[i] = kv->window > 0 && p >= kv->window ? p - kv->window + 1 : 0;
        if (starts[i] < least) least = starts[i];
    }
    return least;
}

/* A run of n query tokens of one lane at consecutive rows (a prefill chunk, or a token
   and its drafts), the heads of one query group each: token i (queries q + i * q_stride,
   [group][dim]) attends to the lane's rows start_i .. first_len + i - 1 (its window:
   window_starts, at `positions`; rows of the layer's format, codes scaled per channel by
   kv's scales + scale_at) and writes softmax(scale * q . keys) @ values to out + i *
   out_stride. The run reads each key and value row once for all its tokens, from the
   first token's window on (from memory, then from cache), where token by token it would
   read them n times; every token's arithmetic is what it would be alone (a key's dot
   product does not depend on the others, its softmax covers its own rows, from the same
   row in the same vectors, and the weighted sum adds exact zeros for rows outside them),
   so a step computes the same whatever else it holds. A key's scale multiplies the
   queries instead, a value's the weighted sum. masks (NULL: none) hide rows of a draft
   tree's other branches: bit j of masks[i] clear hides row first_len - 1 + i - j from
   token i (softmax_shown), so a tree's token computes what it would in a chain of its
   branch. ahead: the next run's rows, prefetched as the scores are computed. sums (NULL:
   none): the lane's accumulated attention of this query group, which the run's weights
   add to (add_weights). scores: [n * group + 1][first_len + n - 1]; rows: [n * group][dim]. */
static void attend_run(const float *q, int64_t q_stride, int n, int group,
                       const uint8_t *keys, const uint8_t *values, const KVLayout *kv,
                       int64_t scale_at, int first_len, const int32_t *positions, int dim,
                       float scale, const uint64_t *masks, float *scores, float *rows,
                       RunCodes *codes, float *out, int64_t out_stride, Ahead *ahead,
                       float *sums) {
    int starts[n];
    const int base = window_starts(kv, positions, n, first_len, starts);
    const int64_t skipped = base * row_bytes(kv->bits, dim);
    keys += skipped, values += skipped, first_len -= base;  /* rows from the window on */
    if (sums) sums += base;
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
        const int i = h / group, first = starts[i] - base;
        if (masks && ~masks[i])
            softmax_shown(scores + (int64_t)h * longest, first, first_len + i, longest,
                          masks[i], scores + (int64_t)heads * longest);
        else
            softmax_row(scores + (int64_t)h * longest, first, first_len + i, longest);
    }
    /* the weighted sums, a few heads at a time so that their sums stay in registers */
    const int at_once = strips <= 24 ? 24 / strips : 1;
    if (integer) {
        for (int h = 0; h < heads; h++)
            codes->weight_scales[h] = weight_codes(scores + (int64_t)h * longest,
                                                   starts[h / group] - base,
                                                   first_len + h / group, longest,
                                                   masks ? masks[h / group] : ~0ull);
        if (sums) add_weights(scores, codes->weight_scales, n, group, first_len, longest, sums);
        for (int h = 0; h < heads; h += at_once)
            weigh_values_int8((const int16_t *)(scores + (int64_t)h * longest), 2 * longest,
                              codes->weight_scales + h, longest, values,
                              heads - h < at_once ? heads - h : at_once, dim,
                              rows + (int64_t)h * dim);
    } else {
        if (sums) add_weights(scores, NULL, n, group, first_len, longest, sums);
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

/* The same in integers on int8 lanes.
   Included by kernels.c: the step is one translation unit. */

/* Attention on int8 lanes, in integers. A query row (its key scales applied) becomes int16
   codes round(x / s) with s its absmax / 32767, and a head's attention weights int16 codes
   of their own scale (weight_codes): a query's dot products with int8 keys and the
   weighted sum of int8 value rows are then exact int32 sums (VPDPWSSD: two int16 products
   a lane), in any order, where float arithmetic converts every key and value element and
   adds in one fixed order. Rounding to 15 bits of each row's largest element sits far
   below the lanes' own int8 rounding (benchmarks/kv_cache_quality.py). Rows are
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

/* A head's scores [width] (of rows first .. len - 1; mask: a tree's, as softmax_shown's,
   or all ones) as its softmax weights in int16 codes, in place (code j in the bytes of the
   row's first half): e_j = exp(s_j - max) over the rows shown, code_j = round(32767 e_j f),
   zero for every other row up to width (and one more zero code past an odd width), f = 1
   unless the e_j sum past 508, then 508 / their sum: a sum of the codes' products with int8
   values stays below 2^31 (508 * 32767 * 127, plus the roundings), and the largest weight
   (e = 1) keeps 15 bits. Returns 1 / the codes' sum, the weighted sum's scale: the codes
   are the weights, normalized exactly. A tree's token gets the codes of its chain's
   (shown rows' codes do not depend on hidden rows' scores). */
static float weight_codes(float *scores, int first, int len, int width, uint64_t mask) {
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int c = first; c < len; c += 16)  /* from `first`: as with the rows from 0 there */
        peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                        rows_shown(c, len, mask), scores + c));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    const __m512 one = _mm512_set1_ps(32767.f);
    int16_t *codes = (int16_t *)scores;
    __m512 total = _mm512_setzero_ps();
    __m512i sum = _mm512_setzero_si512();
    for (int c = first; c < len; c += 16) {  /* codes c.. overwrite scores[c / 2 ..], read */
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
        for (int c = first; c < len; c += 16) {
            const __mmask16 rows = rows_before(c, len);
            const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(
                _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(rows, codes + c))), f));
            sum = _mm512_add_epi32(sum, code);
            _mm256_mask_storeu_epi16(codes + c, rows, _mm512_cvtepi32_epi16(code));
        }
        codes_sum = _mm512_reduce_add_epi32(sum);
    }
    memset(codes, 0, sizeof(int16_t) * first);  /* scores before `first`, unread */
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

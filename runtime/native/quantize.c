/* Activations quantized to int8 in the weights' blocks, in tiles of rows.
   Included by kernels.c: the step is one translation unit. */

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

/* Rotary embedding and the KV rotation (a matrix, or the fast Hadamard transform).
   Included by kernels.c: the step is one translation unit. */

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

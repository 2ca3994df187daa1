/* Lane rows in their format: float32, float16, int8/int4 codes.
   Included by kernels.c: the step is one translation unit. */

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

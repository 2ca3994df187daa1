/* Code-book 4-bit weights (bitsandbytes' NF4 and FP4): w = codebook[code] * absmax.
   Included by kernels.c before gemm_vnni.c, whose 4-bit kernels call these.

   The loader (runtime/native/codebook.py) rounds the code book to 8 bits, value
   round(127 * codebook[c]) + 128 for code c, keeps zero points of 128 and scales of
   absmax / 127: a 4-bit code becomes an unsigned 8-bit code by one byte shuffle (a table of
   16 values, the same in each 128-bit lane), and the VNNI dots and zero terms run as for
   integer codes with zero points. The code book's rounding moves a weight by at most
   absmax / 254, a small share of NF4's own steps. */

/* w's 16-byte table in each 128-bit lane of a vector (any value when `lookup` is 0). */
static inline __attribute__((always_inline)) __m512i lut_vector(const QMatrix *w,
                                                                const int lookup) {
    return lookup ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w->lut))
                  : _mm512_setzero_si512();
}

/* Each byte's 4-bit code (0..15) replaced by its table value, where `lookup`. */
static inline __attribute__((always_inline)) __m512i looked_up(__m512i codes, __m512i lut,
                                                               const int lookup) {
    return lookup ? _mm512_shuffle_epi8(lut, codes) : codes;
}

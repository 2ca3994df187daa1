/* E^x, RMS norm, SiLU.
   Included by kernels.c: the step is one translation unit. */

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

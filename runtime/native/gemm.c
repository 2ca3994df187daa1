/* A projection: its row groups split between threads, on VNNI or AMX.
   Included by kernels.c: the step is one translation unit. */

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

/* y [T][N] = a times w's transpose (plus its bias), the row groups split between threads,
   on AMX tiles where the caller quantized a->rows for them (amx_takes). Returns 0, or -1
   when memory runs out. */
static int gemm(const QMatrix *w, const QActivations *a, int t_rows, float *y, int threads) {
    const int amx = a->rows != NULL;
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

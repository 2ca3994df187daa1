/* llmopt's native decoder step for lanes artifacts (see runtime/native/__init__.py).

One call runs a whole step over the packed query tokens of every sequence: embedding,
each layer (RMS norm, int4/int8 block-quantized projections on int8 activations, rotary,
keys and values written into the sequence's lane where they lie, attention over the
lane), the final norm and the LM head rows asked for. It computes what the artifact's
ONNX graph computes with ONNX Runtime's MatMulNBits at accuracy level 4 (activations
quantized to int8 per block of 32 with scale absmax / 127, rounded half to even).

Weights: a projection w [N, K] is int codes in blocks of 32 along K with a float scale
per block and an optional integer zero point (else 2^(bits-1)): w = (code - zero) * scale.
4-bit codes keep MatMulNBits' packing (byte j of a block holds elements 2j and 2j+1 in
its low and high nibble). 8-bit codes are reordered at load to the order a 4-bit chunk
unpacks to, so both widths meet the same activation layout.

Activations are quantized in chunks of 64 (two blocks) reordered the same way: the even
elements of both blocks, then the odd ones. One 512-bit VNNI dot then multiplies a chunk
of weight codes (unsigned) by a chunk of activations (signed); int32 lane i sums the
four products of block (i >> 2) & 1.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const uint8_t *codes;  /* bits 4: [N][K/2]; bits 8: [N][K] in chunk order */
    const float *scales;   /* [N][K/32] */
    const uint8_t *zeros;  /* [N][K/32], or NULL: 2^(bits-1) */
    int32_t n, k, bits;
} QMatrix;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_position;
    int32_t num_threads;
    float eps, attn_scale;
    const float *rope_cos, *rope_sin;      /* [max_position][head_dim / 2] */
    const float *embed;                    /* [vocab][hidden], or NULL: rows of embed_codes */
    QMatrix embed_codes;
    const float *const *attn_norm, *const *mlp_norm;
    const float *final_norm;
    const QMatrix *qkv, *o, *gate_up, *down;
    QMatrix head;
} Model;

/* Scalar helpers (no instruction-set requirement). */
int llmopt_native_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

/* Element of a 64-chunk that position j (0..63) of the reordered chunk holds. */
static inline int chunk_element(int j) {
    int low = j & 31;
    return 32 * (low >> 4) + 2 * (low & 15) + (j >> 5);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
#include <immintrin.h>

#define PREFETCH_ROWS 16

typedef struct {  /* int8 activations of T rows of width K */
    int8_t *codes;  /* [T][K] chunk order */
    float *scales;  /* [T][K/64][16] the block scale of each lane */
    int32_t *sums;  /* [T][K/64][16] each lane's sum of its four codes */
} QActivations;

static inline __m512i block_lanes_idx(void);
static inline __m512 scale_lanes(const float *p);

/* One 64-chunk: per-block scales absmax / 127, codes rounded half to even (MXCSR's
   default, as lrintf), written in chunk order with each lane's sum and scale. */
static void quantize_chunk(const float *x, int8_t *out, float *lane_scales, int32_t *sums) {
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    __m512 v[4];
    float scale[2];
    for (int b = 0; b < 2; b++) {
        v[2 * b] = _mm512_loadu_ps(x + 32 * b);
        v[2 * b + 1] = _mm512_loadu_ps(x + 32 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[2 * b]),
                                                        _mm512_abs_ps(v[2 * b + 1])));
        scale[b] = amax / 127.f;
        __m512 inv = _mm512_set1_ps(scale[b] != 0.f ? 1.f / scale[b] : 0.f);
        v[2 * b] = _mm512_mul_ps(v[2 * b], inv);
        v[2 * b + 1] = _mm512_mul_ps(v[2 * b + 1], inv);
    }
    for (int b = 0; b < 2; b++) {
        __m512i lo = _mm512_cvtps_epi32(v[2 * b]), hi = _mm512_cvtps_epi32(v[2 * b + 1]);
        _mm_storeu_si128((__m128i *)(out + 16 * b),
                         _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(lo, evens, hi)));
        _mm_storeu_si128((__m128i *)(out + 32 + 16 * b),
                         _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(lo, odds, hi)));
    }
    _mm512_storeu_si512(sums, _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1),
                                                  _mm512_loadu_si512(out)));
    _mm512_storeu_ps(lane_scales, scale_lanes(scale));
}

static void quantize_rows(const float *x, int t_rows, int k, QActivations *q) {
    int chunks = k / 64;
    for (int t = 0; t < t_rows; t++)
        for (int c = 0; c < chunks; c++) {
            int64_t at = (int64_t)t * chunks + c;
            quantize_chunk(x + (int64_t)t * k + c * 64, q->codes + at * 64, q->scales + at * 16,
                           q->sums + at * 16);
        }
}

static inline __m512i block_lanes_idx(void) {
    return _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
}

static inline __m512 scale_lanes(const float *p) {  /* two block scales -> 16 lanes */
    __m128 v = _mm_castpd_ps(_mm_load_sd((const double *)p));
    return _mm512_permutexvar_ps(block_lanes_idx(), _mm512_castps128_ps512(v));
}

static inline __m512i zero_lanes(const uint8_t *p) {  /* two zero points -> 16 lanes */
    __m128i v = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(p[0] | (p[1] << 8)));
    return _mm512_permutexvar_epi32(block_lanes_idx(), _mm512_castsi128_si512(v));
}

static inline __m512i chunk_codes(const QMatrix *w, int64_t row, int c) {
    if (w->bits == 8)
        return _mm512_loadu_si512(w->codes + row * w->k + c * 64);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i p = _mm256_loadu_si256((const __m256i *)(w->codes + row * (w->k / 2) + c * 32));
    __m256i lo = _mm256_and_si256(p, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline void prefetch_row(const QMatrix *w, int64_t row) {
    if (row >= w->n) return;
    int64_t bytes = w->bits == 8 ? w->k : w->k / 2;
    const char *p = (const char *)(w->codes + row * bytes);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

/* The lanes' dot of one weight chunk with one activation chunk, zero point removed. */
static inline __m512i chunk_dot(const QMatrix *w, int64_t row, int c, __m512i codes,
                                __m512i act, __m512i sums) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, act);
    if (w->zeros)
        return _mm512_sub_epi32(dot, _mm512_mullo_epi32(
            zero_lanes(w->zeros + row * (w->k / 32) + 2 * c), sums));
    return _mm512_sub_epi32(dot, _mm512_slli_epi32(sums, w->bits - 1));
}

/* y[t][row] for rows lo..hi-1 of w and every activation row. */
static void gemm_rows(const QMatrix *w, const QActivations *a, int t_rows, float *y,
                      int64_t lo, int64_t hi) {
    int chunks = w->k / 64, blocks = w->k / 32;
    if (t_rows == 1) {  /* decode: four weight rows at a time, the stream prefetched */
        int64_t n = lo;
        for (; n + 4 <= hi; n += 4) {
            for (int r = 0; r < 4; r++) prefetch_row(w, n + PREFETCH_ROWS + r);
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                             _mm512_setzero_ps()};
            for (int c = 0; c < chunks; c++) {
                __m512i act = _mm512_loadu_si512(a->codes + c * 64);
                __m512i sums = _mm512_loadu_si512(a->sums + c * 16);
                __m512 act_scale = _mm512_loadu_ps(a->scales + c * 16);
                for (int r = 0; r < 4; r++) {
                    __m512i dot = chunk_dot(w, n + r, c, chunk_codes(w, n + r, c), act, sums);
                    __m512 s = _mm512_mul_ps(scale_lanes(w->scales + (n + r) * blocks + 2 * c),
                                             act_scale);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
                }
            }
            for (int r = 0; r < 4; r++) y[n + r] = _mm512_reduce_add_ps(acc[r]);
        }
        for (; n < hi; n++) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                __m512i dot = chunk_dot(w, n, c, chunk_codes(w, n, c),
                                        _mm512_loadu_si512(a->codes + c * 64),
                                        _mm512_loadu_si512(a->sums + c * 16));
                __m512 s = _mm512_mul_ps(scale_lanes(w->scales + n * blocks + 2 * c),
                                         _mm512_loadu_ps(a->scales + c * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
            }
            y[n] = _mm512_reduce_add_ps(acc);
        }
        return;
    }
    /* several rows: each weight row's chunks unpacked once, then met by every row */
    __m512i *codes = aligned_alloc(64, sizeof(__m512i) * chunks);
    __m512 *scales = aligned_alloc(64, sizeof(__m512) * chunks);
    for (int64_t n = lo; n < hi; n++) {
        prefetch_row(w, n + 4);
        for (int c = 0; c < chunks; c++) {
            codes[c] = chunk_codes(w, n, c);
            scales[c] = scale_lanes(w->scales + n * blocks + 2 * c);
        }
        for (int t = 0; t < t_rows; t++) {  /* the decode loop's order: batch-invariant */
            const int64_t base = (int64_t)t * chunks;
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                __m512i dot = chunk_dot(w, n, c, codes[c],
                                        _mm512_loadu_si512(a->codes + (base + c) * 64),
                                        _mm512_loadu_si512(a->sums + (base + c) * 16));
                __m512 s = _mm512_mul_ps(scales[c], _mm512_loadu_ps(a->scales + (base + c) * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
            }
            y[(int64_t)t * w->n + n] = _mm512_reduce_add_ps(acc);
        }
    }
    free(codes);
    free(scales);
}

static void gemm(const QMatrix *w, const QActivations *a, int t_rows, float *y, int threads) {
#ifndef _OPENMP
    threads = 1;
#endif
    if (threads <= 1) {
        gemm_rows(w, a, t_rows, y, 0, w->n);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel num_threads(threads)
    {
        int id = omp_get_thread_num(), count = omp_get_num_threads();
        int64_t per = ((w->n + count - 1) / count + 3) & ~(int64_t)3;
        int64_t lo = id * per, hi = lo + per < w->n ? lo + per : w->n;
        if (lo < hi) gemm_rows(w, a, t_rows, y, lo, hi);
    }
#endif
}

static void rms_norm(const float *x, const float *weight, float eps, int width, float *out) {
    double sum = 0;  /* accumulated in double: the order ONNX Runtime uses is not ours */
    for (int i = 0; i < width; i++) sum += (double)x[i] * x[i];
    float inv = 1.f / sqrtf((float)(sum / width) + eps);
    for (int i = 0; i < width; i++) out[i] = x[i] * inv * weight[i];
}

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

static inline float dot_f32(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[dim] = softmax(scale * q . keys[0..len)) @ values, keys/values [len][dim]. */
static void attend(const float *q, const float *keys, const float *values, int len, int dim,
                   float scale, float *scores, float *out) {
    float peak = -INFINITY;
    for (int j = 0; j < len; j++) {
        scores[j] = scale * dot_f32(q, keys + (int64_t)j * dim, dim);
        if (scores[j] > peak) peak = scores[j];
    }
    float total = 0.f;
    for (int j = 0; j < len; j++) total += (scores[j] = expf(scores[j] - peak));
    memset(out, 0, sizeof(float) * dim);
    float inv = 1.f / total;
    for (int j = 0; j < len; j++) {
        const float p = scores[j] * inv, *v = values + (int64_t)j * dim;
        for (int d = 0; d < dim; d++) out[d] += p * v[d];
    }
}

static void embed_row(const Model *m, int64_t token, float *out) {
    if (m->embed) {
        memcpy(out, m->embed + token * m->hidden, sizeof(float) * m->hidden);
        return;
    }
    const QMatrix *w = &m->embed_codes;
    int blocks = w->k / 32;
    for (int e = 0; e < w->k; e++) {
        int code;
        if (w->bits == 8) {  /* position of element e within its chunk order */
            int within = e & 63, j = ((within & 31) >> 1) + 16 * (within >> 5) + 32 * (within & 1);
            code = w->codes[token * w->k + (e & ~63) + j];
        } else {
            uint8_t byte = w->codes[token * (w->k / 2) + e / 2];
            code = e & 1 ? byte >> 4 : byte & 15;
        }
        int zero = w->zeros ? w->zeros[token * blocks + e / 32] : 1 << (w->bits - 1);
        out[e] = (float)(code - zero) * w->scales[token * blocks + e / 32];
    }
}

typedef struct {
    float *x, *h, *qkv, *attn, *proj, *gate_up, *act;
    QActivations q;
} Scratch;

static int scratch_alloc(const Model *m, int t_rows, Scratch *s) {
    int width = m->hidden > m->intermediate ? m->hidden : m->intermediate;
    int attn_width = m->heads * m->head_dim;
    if (attn_width > width) width = attn_width;
    int qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    int64_t t = t_rows;
    s->x = malloc(sizeof(float) * t * m->hidden);
    s->h = malloc(sizeof(float) * t * width);
    s->qkv = malloc(sizeof(float) * t * qkv_width);
    s->attn = malloc(sizeof(float) * t * attn_width);
    s->proj = malloc(sizeof(float) * t * m->hidden);
    s->gate_up = malloc(sizeof(float) * t * 2 * m->intermediate);
    s->act = malloc(sizeof(float) * t * m->intermediate);
    s->q.codes = malloc(t * width);
    s->q.scales = malloc(sizeof(float) * t * (width / 64) * 16);
    s->q.sums = malloc(sizeof(int32_t) * t * (width / 64) * 16);
    return s->x && s->h && s->qkv && s->attn && s->proj && s->gate_up && s->act && s->q.codes && s->q.scales && s->q.sums;
}

static void scratch_free(Scratch *s) {
    free(s->x); free(s->h); free(s->qkv); free(s->attn); free(s->proj); free(s->gate_up);
    free(s->act); free(s->q.codes); free(s->q.scales); free(s->q.sums);
}

static void linear(const Model *m, const QMatrix *w, const float *x, int t_rows, Scratch *s,
                   float *y) {
    quantize_rows(x, t_rows, w->k, &s->q);
    gemm(w, &s->q, t_rows, y, m->num_threads);
}

/* One layer's attention: rotary, the step's keys and values into their lanes, then every
   query token attends to its lane's positions 0 .. its own. */
static void attention(const Model *m, int t_rows, const int32_t *lanes,
                      const int32_t *positions, float *key_pool, float *value_pool,
                      int lane_tokens, Scratch *s) {
    const int dim = m->head_dim, heads = m->heads, kv_heads = m->kv_heads, half = dim / 2;
    const int qkv_width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    for (int t = 0; t < t_rows; t++) {
        float *q = s->qkv + (int64_t)t * qkv_width, *k = q + heads * dim, *v = k + kv_heads * dim;
        const float *cos = m->rope_cos + (int64_t)positions[t] * half;
        const float *sin = m->rope_sin + (int64_t)positions[t] * half;
        rotary(q, heads, dim, cos, sin);
        rotary(k, kv_heads, dim, cos, sin);
        for (int g = 0; g < kv_heads; g++) {
            int64_t at = (((int64_t)lanes[t] * kv_heads + g) * lane_tokens + positions[t]) * dim;
            memcpy(key_pool + at, k + g * dim, sizeof(float) * dim);
            memcpy(value_pool + at, v + g * dim, sizeof(float) * dim);
        }
    }
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) collapse(2) schedule(static) if (threads > 1)
    for (int t = 0; t < t_rows; t++) {
        for (int h = 0; h < heads; h++) {
            const float *q = s->qkv + (int64_t)t * qkv_width + h * dim;
            int64_t lane = (((int64_t)lanes[t] * kv_heads + h / group) * lane_tokens) * dim;
            float local[4096], *scores = local;  /* the scores of one query over its lane */
            if (positions[t] >= 4096) scores = malloc(sizeof(float) * (positions[t] + 1));
            attend(q, key_pool + lane, value_pool + lane, positions[t] + 1, dim, m->attn_scale,
                   scores, s->attn + (int64_t)t * heads * dim + h * dim);
            if (scores != local) free(scores);
        }
    }
}

static void add_norm(float *x, const float *delta, const float *weight, const Model *m,
                     int t_rows, float *h) {
    for (int t = 0; t < t_rows; t++) {
        float *row = x + (int64_t)t * m->hidden;
        const float *d = delta + (int64_t)t * m->hidden;
        for (int i = 0; i < m->hidden; i++) row[i] += d[i];
        if (weight) rms_norm(row, weight, m->eps, m->hidden, h + (int64_t)t * m->hidden);
    }
}

/* y [T][N] = x [T][K] times w's transpose, x quantized as every step quantizes it. */
int llmopt_linear(const QMatrix *w, const float *x, int32_t t_rows, float *y, int32_t threads) {
    int64_t lanes = (int64_t)t_rows * (w->k / 64) * 16;
    QActivations q = {malloc((int64_t)t_rows * w->k), malloc(sizeof(float) * lanes),
                      malloc(sizeof(int32_t) * lanes)};
    int ok = q.codes && q.scales && q.sums;
    if (ok) {
        quantize_rows(x, t_rows, w->k, &q);
        gemm(w, &q, t_rows, y, threads);
    }
    free(q.codes); free(q.scales); free(q.sums);
    return ok ? 0 : -1;
}

/* One step. Token t (of T, packed) has id tokens[t], sits in lane lanes[t] at position
   positions[t]; its key and value are written there in every layer. Logit row r is the
   head's output for token logit_rows[r]. Returns 0, or -1 when memory runs out. */
int llmopt_forward(const Model *m, int32_t t_rows, const int64_t *tokens,
                   const int32_t *lanes, const int32_t *positions, float *const *key_pools,
                   float *const *value_pools, int32_t lane_tokens, int32_t n_logits,
                   const int32_t *logit_rows, float *logits) {
    Scratch s;
    if (!scratch_alloc(m, t_rows > n_logits ? t_rows : n_logits, &s)) {
        scratch_free(&s);
        return -1;
    }
    const int hidden = m->hidden, inter = m->intermediate;
    for (int t = 0; t < t_rows; t++) {
        embed_row(m, tokens[t], s.x + (int64_t)t * hidden);
        rms_norm(s.x + (int64_t)t * hidden, m->attn_norm[0], m->eps, hidden,
                 s.h + (int64_t)t * hidden);
    }
    for (int l = 0; l < m->layers; l++) {
        linear(m, &m->qkv[l], s.h, t_rows, &s, s.qkv);
        attention(m, t_rows, lanes, positions, key_pools[l], value_pools[l], lane_tokens, &s);
        linear(m, &m->o[l], s.attn, t_rows, &s, s.proj);
        add_norm(s.x, s.proj, m->mlp_norm[l], m, t_rows, s.h);
        linear(m, &m->gate_up[l], s.h, t_rows, &s, s.gate_up);
        for (int t = 0; t < t_rows; t++) {
            const float *gate = s.gate_up + (int64_t)t * 2 * inter, *up = gate + inter;
            float *act = s.act + (int64_t)t * inter;
            for (int i = 0; i < inter; i++) act[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
        }
        linear(m, &m->down[l], s.act, t_rows, &s, s.proj);
        add_norm(s.x, s.proj, l + 1 < m->layers ? m->attn_norm[l + 1] : NULL, m, t_rows, s.h);
    }
    for (int r = 0; r < n_logits; r++)
        rms_norm(s.x + (int64_t)logit_rows[r] * hidden, m->final_norm, m->eps, hidden,
                 s.h + (int64_t)r * hidden);
    if (n_logits > 0) linear(m, &m->head, s.h, n_logits, &s, logits);
    scratch_free(&s);
    return 0;
}
#pragma GCC pop_options

/* A CPython module with no functions: it exists so that the import system finds this
   shared library wherever the package is installed; ctypes calls the functions above. */
static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT, "_kernels", "llmopt's native decoder step (called through ctypes)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }

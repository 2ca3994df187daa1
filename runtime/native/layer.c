/* A layer over a chunk of a step's rows, and its split between threads.
   Included by kernels.c: the step is one translation unit. */

static int linear(const Model *m, const QMatrix *w, const float *x, int t_rows, Scratch *s,
                  float *y) {
    s->q.rows = amx_takes(&m->knobs, w, t_rows) ? s->amx_rows : NULL;
    quantize_rows(x, t_rows, w, m->num_threads, &s->q);
    return gemm(w, &s->q, t_rows, y, m->num_threads);
}

/* Where lane `lane`'s rows of query group g start in a layer's pool (bytes). */
static inline int64_t lane_start(int lane, int g, int kv_heads, int lane_tokens,
                                 int64_t stride) {
    return ((int64_t)lane * kv_heads + g) * lane_tokens * stride;
}

/* One layer's KV write: the heads' norms where the layer has them (q_norm, k_norm: NULL
   for none), rotary at each token's position (and the layer's rotation), then the step's
   keys and values into their lanes' rows in the layer's format. */
static void write_kv(const Model *m, const KVLayout *kv, const float *q_norm,
                     const float *k_norm, int t_rows, const int32_t *lanes,
                     const int32_t *positions, const int32_t *lane_rows, uint8_t *key_pool,
                     uint8_t *value_pool, int lane_tokens, Scratch *s) {
    const int dim = m->head_dim, heads = m->heads, kv_heads = m->kv_heads, half = dim / 2;
    const int qkv_width = (heads + 2 * kv_heads) * dim;
    const int64_t stride = row_bytes(kv->bits, dim);
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int t = 0; t < t_rows; t++) {
        float *q = s->qkv + (int64_t)t * qkv_width, *k = q + heads * dim, *v = k + kv_heads * dim;
        const float *cos = m->rope_cos + (int64_t)positions[t] * half;
        const float *sin = m->rope_sin + (int64_t)positions[t] * half;
        for (int h = 0; q_norm && h < heads + kv_heads; h++)  /* keys follow the queries */
            rms_norm(q + h * dim, h < heads ? q_norm : k_norm, m->eps, dim, q + h * dim);
        rotary(q, heads, dim, cos, sin);
        rotary(k, kv_heads, dim, cos, sin);
        if (kv->hadamard)  /* the keys follow the queries in the row: one pass for both */
            hadamard_heads(q, heads + kv_heads, dim, kv->rotation[0]);
        else if (kv->rotation)
            rotate_heads(q, heads + kv_heads, dim, kv->rotation);
        for (int g = 0; g < kv_heads; g++) {
            const int64_t at = lane_start(lanes[t], g, kv_heads, lane_tokens, stride)
                               + lane_rows[t] * stride;
            const int64_t channel = (int64_t)g * dim;
            store_row(k + channel, kv->key_scale ? kv->key_scale + channel : NULL, kv->bits,
                      dim, key_pool + at);
            store_row(v + channel, kv->value_scale ? kv->value_scale + channel : NULL,
                      kv->bits, dim, value_pool + at);
        }
    }
}

/* Attention's item i (attend below): run i / kv_heads of the step's runs (its first token
   *t, its length *n) against query group *g = i % kv_heads. */
static inline void run_item(const int32_t *runs, int kv_heads, int i, int *t, int *n,
                            int *g) {
    *t = runs[i / kv_heads];
    *n = runs[i / kv_heads + 1] - *t;
    *g = i % kv_heads;
}

/* Where a run at position `position` starts reading its lane (attend_run's window). */
static inline int64_t window_offset(const KVLayout *kv, int position, int64_t stride) {
    return kv->window > 0 && position >= kv->window
           ? (int64_t)(position - kv->window + 1) * stride : 0;
}

/* One layer's attention after write_kv: every query token attends to its lane's rows in
   its window up to its own but those its tree mask hides, a lane's consecutive rows
   together (attend_run). Each thread takes a range of items in order, so item i + 1's rows
   are the ones to prefetch during item i. */
static void attend(const Model *m, const KVLayout *kv, int t_rows, const int32_t *lanes,
                   const int32_t *positions, const int32_t *lane_rows, const uint64_t *masks,
                   const uint8_t *key_pool, const uint8_t *value_pool, int lane_tokens,
                   Scratch *s) {
    const int dim = m->head_dim, heads = m->heads, kv_heads = m->kv_heads;
    const int qkv_width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t stride = row_bytes(kv->bits, dim);
    const int items = query_runs(t_rows, lanes, lane_rows, s->runs) * kv_heads;
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int i = 0; i < items; i++) {
        int t, n, g;
        run_item(s->runs, kv_heads, i, &t, &n, &g);
        Ahead ahead = {0};
        if (i + 1 < items) {
            int next_t, next_n, next_g;
            run_item(s->runs, kv_heads, i + 1, &next_t, &next_n, &next_g);
            const int64_t from = window_offset(kv, positions[next_t], stride);
            const int64_t at = lane_start(lanes[next_t], next_g, kv_heads, lane_tokens, stride)
                               + from;
            ahead = (Ahead){(const char *)key_pool + at, (const char *)value_pool + at,
                            (lane_rows[next_t] + next_n) * stride - from, 0};
        }
#ifdef _OPENMP
        int id = omp_get_thread_num();
#else
        int id = 0;
#endif
        RunScratch run = run_scratch(m, s, id);
        const int64_t lane = lane_start(lanes[t], g, kv_heads, lane_tokens, stride);
        attend_run(s->qkv + (int64_t)t * qkv_width + g * group * dim, qkv_width, n, group,
                   key_pool + lane, value_pool + lane, kv, (int64_t)g * dim, lane_rows[t] + 1,
                   positions + t, dim, m->attn_scale, masks ? masks + t : NULL,
                   run.scores, run.rows, &run.codes,
                   s->attn + (int64_t)t * heads * dim + g * group * dim, (int64_t)heads * dim,
                   &ahead, NULL);
    }
}

/* attend, adding each token's attention weights to its lane's accumulated attention (sums:
   the layer's [lanes][kv_heads][lane_tokens], H2O). An item is a query group against a
   lane's consecutive runs, all taken by one thread in token order: no two threads add to
   one row, and each row's sum runs in the same order whatever the threads. */
static void attend_scored(const Model *m, const KVLayout *kv, int t_rows, const int32_t *lanes,
                          const int32_t *positions, const int32_t *lane_rows,
                          const uint64_t *masks,
                          const uint8_t *key_pool, const uint8_t *value_pool, int lane_tokens,
                          float *sums, Scratch *s) {
    const int dim = m->head_dim, heads = m->heads, kv_heads = m->kv_heads;
    const int qkv_width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t stride = row_bytes(kv->bits, dim);
    const int runs = query_runs(t_rows, lanes, lane_rows, s->runs);
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int i = 0; i < runs * kv_heads; i++) {
        const int first = i / kv_heads, g = i % kv_heads;
        if (first > 0 && lanes[s->runs[first]] == lanes[s->runs[first - 1]]) continue;
#ifdef _OPENMP
        RunScratch run = run_scratch(m, s, omp_get_thread_num());
#else
        RunScratch run = run_scratch(m, s, 0);
#endif
        const int lane = lanes[s->runs[first]];
        const int64_t at = lane_start(lane, g, kv_heads, lane_tokens, stride);
        float *lane_sums = sums + ((int64_t)lane * kv_heads + g) * lane_tokens;
        for (int r = first; r < runs && lanes[s->runs[r]] == lane; r++) {
            const int t = s->runs[r], n = s->runs[r + 1] - t;
            Ahead ahead = {0};
            attend_run(s->qkv + (int64_t)t * qkv_width + g * group * dim, qkv_width, n, group,
                       key_pool + at, value_pool + at, kv, (int64_t)g * dim, lane_rows[t] + 1,
                       positions + t, dim, m->attn_scale, masks ? masks + t : NULL, run.scores, run.rows,
                       &run.codes, s->attn + (int64_t)t * heads * dim + g * group * dim,
                       (int64_t)heads * dim, &ahead, lane_sums);
        }
    }
}

static void add_norm(float *x, const float *delta, const float *weight, const Model *m,
                     int t_rows, float *h) {
    #pragma omp parallel for num_threads(m->num_threads) \
        if (m->num_threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int t = 0; t < t_rows; t++) {
        float *row = x + (int64_t)t * m->hidden;
        const float *d = delta + (int64_t)t * m->hidden;
        for (int i = 0; i < m->hidden; i++) row[i] += d[i];
        if (weight) rms_norm(row, weight, m->eps, m->hidden, h + (int64_t)t * m->hidden);
    }
}

/* y [T][N] = x [T][K] times w's transpose, x quantized as every step quantizes it, on AMX
   tiles where `knobs` (a model's settings: llmopt_native_knobs) would take them. */
int llmopt_linear(const QMatrix *w, const float *x, int32_t t_rows, float *y, int32_t threads,
                  const Knobs *knobs) {
    const int64_t padded = ((int64_t)t_rows + TOKEN_TILE - 1) / TOKEN_TILE * TOKEN_TILE;
    const int64_t blocks = padded * (w->k / 32);
    const int64_t amx_padded = ((int64_t)t_rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    QActivations q = {lines_alloc(padded * w->k), lines_alloc(sizeof(float) * blocks),
                      lines_alloc(sizeof(int32_t) * blocks), lines_alloc(sizeof(float) * blocks),
                      amx_takes(knobs, w, t_rows) ? lines_alloc(amx_padded * w->k) : NULL};
    int ok = q.codes && q.scales && q.zero_term && q.inputs && (q.rows || !amx_takes(knobs, w, t_rows));
    if (ok) {
        quantize_rows(x, t_rows, w, threads, &q);
        ok = gemm(w, &q, t_rows, y, threads) == 0;
    }
    free(q.codes); free(q.scales); free(q.zero_term); free(q.inputs); free(q.rows);
    return ok ? 0 : -1;
}

/* One run of attention (attend_run) on the caller's rows, for tests against an exact
   reference: n query tokens of `group` heads (q [n][group][dim], rotated already) at
   positions first_len - 1 .. first_len + n - 2 of one lane whose first first_len + n - 1
   rows `keys` and `values` hold, in kv's format (its scales: this group's channels); masks
   as llmopt_forward's (NULL: none); kv's window hides the rows before it. out [n][group]
   [dim]; sums (NULL: none) [first_len + n - 1] has the run's attention weights added
   (attend_run). Returns 0, or -1 when memory runs out. */
int llmopt_attention_scored(const KVLayout *kv, const float *q, int32_t n, int32_t group,
                            const uint8_t *keys, const uint8_t *values, int32_t first_len,
                            int32_t dim, float scale, const uint64_t *masks, float *out,
                            float *sums) {
    const int longest = first_len + n - 1, heads = n * group;
    float *scores = lines_alloc(sizeof(float) * (heads + 1) * longest);
    float *rows = lines_alloc(sizeof(float) * heads * dim);
    RunCodes codes = {lines_alloc(sizeof(int16_t) * heads * padded_dim(dim)),
                      lines_alloc(sizeof(float) * heads), lines_alloc(sizeof(float) * heads)};
    const int ok = scores && rows && codes.codes && codes.scales && codes.weight_scales;
    Ahead ahead = {0};
    if (ok)
        attend_run(q, (int64_t)group * dim, n, group, keys, values, kv, 0, first_len, NULL,
                   dim, scale, masks, scores, rows, &codes, out, (int64_t)group * dim, &ahead, sums);
    free(scores); free(rows); free(codes.codes); free(codes.scales); free(codes.weight_scales);
    return ok ? 0 : -1;
}

int llmopt_attention(const KVLayout *kv, const float *q, int32_t n, int32_t group,
                     const uint8_t *keys, const uint8_t *values, int32_t first_len,
                     int32_t dim, float scale, const uint64_t *masks, float *out) {
    return llmopt_attention_scored(kv, q, n, group, keys, values, first_len, dim, scale, masks,
                                   out, NULL);
}

/* A step's tokens as llmopt_forward has them (see there), the layers' KV pools, and their
   accumulated attention (sums: [layers] of [lanes][kv_heads][lane_tokens], or NULL). */
typedef struct {
    const int32_t *lanes, *positions, *lane_rows;
    const uint64_t *masks;
    uint8_t *const *key_pools, *const *value_pools;
    int32_t lane_tokens;
    float *const *sums;
} StepTokens;

/* Adds the time since *clock to `phase` (no clock: a thread that keeps no profile). */
static inline void mark(const Model *m, double *clock, int phase) {
    if (clock) *clock = profile_phase(m->knobs.phase_seconds, phase, *clock);
}

/* Layer l's first part over the step's rows c .. c + rows - 1 (their residual stream and
   normed input at row c of s->x and s->h, everything else in the chunk's scratch): the
   q/k/v projection and the KV write. */
static int layer_qkv(const Model *m, int l, const StepTokens *step, int c, int rows,
                     Scratch *s, double *clock) {
    const int status = linear(m, &m->qkv[l], s->h + (int64_t)c * m->hidden, rows, s, s->qkv);
    mark(m, clock, PHASE_QKV);
    write_kv(m, &m->kv[l], m->q_norm ? m->q_norm[l] : NULL, m->k_norm ? m->k_norm[l] : NULL,
             rows, step->lanes + c, step->positions + c, step->lane_rows + c,
             step->key_pools[l], step->value_pools[l], step->lane_tokens, s);
    mark(m, clock, PHASE_KV_WRITE);
    return status;
}

/* The MLP over `rows` rows of h (normed), into s->proj, in one parallel region: each thread
   quantizes its share of h, then after a barrier takes a range of the intermediate's
   columns from end to end (gate's row groups lo .. hi - 1 and up's matching ones, whole
   blocks of down's input), their SiLU for every row and those blocks of down's input
   quantized; after a barrier, its share of down's row groups. Each thread's SiLU reads only
   the gate and up columns it wrote (SiLU split by rows read half of them from the other
   core's cache), and the MLP meets twice instead of opening five regions. */
static int mlp(const Model *m, const QMatrix *gate_up, const QMatrix *down, const float *h,
               int rows, Scratch *s, double *clock) {
    const int inter = m->intermediate;
    const int64_t pairs = inter / 16;           /* gate's row groups; up's follow */
    const int64_t unit = down->block / 16;      /* pairs a block of down's input spans */
    QActivations in = s->q, mid = s->q;         /* the same buffers, one after the other */
    in.rows = amx_takes(&m->knobs, gate_up, rows) ? s->amx_rows : NULL;
    mid.rows = amx_takes(&m->knobs, down, rows) ? s->amx_rows : NULL;
    const int64_t items = quantize_items(rows, gate_up, &in);
    int status = 0;
    #pragma omp parallel num_threads(m->num_threads) if (m->num_threads > 1) \
        reduction(|: status)
    {
#ifdef _OPENMP
        double *own_clock = omp_get_thread_num() == 0 ? clock : NULL;
#else
        double *own_clock = clock;
#endif
        int64_t lo, hi;
        thread_share(items, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) quantize_item(h, rows, gate_up, i, &in);
        #pragma omp barrier
        thread_share((pairs + unit - 1) / unit, &lo, &hi);
        lo = lo * unit < pairs ? lo * unit : pairs;
        hi = hi * unit < pairs ? hi * unit : pairs;
        status |= gemm_share(gate_up, &in, rows, s->gate_up, lo, hi, in.rows != NULL);
        status |= gemm_share(gate_up, &in, rows, s->gate_up, pairs + lo, pairs + hi,
                             in.rows != NULL);
        mark(m, own_clock, PHASE_GATE_UP);
        for (int t = 0; t < rows && lo < hi; t++) {
            const float *gate = s->gate_up + (int64_t)t * 2 * inter + 16 * lo;
            silu_times(gate, gate + inter, (int)(16 * (hi - lo)),
                       s->act + (int64_t)t * inter + 16 * lo);
        }
        mark(m, own_clock, PHASE_SILU);
        #pragma omp barrier  /* every thread's gate/up done with `in` before `mid` reuses it */
        quantize_blocks(s->act, rows, down, (int)(16 * lo / down->block),
                        (int)((16 * hi + down->block - 1) / down->block), &mid);
        #pragma omp barrier
        thread_share((down->n + 15) / 16, &lo, &hi);
        status |= gemm_share(down, &mid, rows, s->proj, lo, hi, mid.rows != NULL);
        mark(m, own_clock, PHASE_DOWN);
    }
    return status;
}

/* The rest of layer l over the same rows, once the rows before c and every row of the chunk
   have written this layer's keys and values: attention reads what it would with every row
   at once (a run of query tokens cut at c computes the same per token: attend_run), then
   o, the MLP and both residual adds. */
static int layer_rest(const Model *m, int l, const StepTokens *step, int c, int rows,
                      Scratch *s, double *clock) {
    const int hidden = m->hidden;
    float *x = s->x + (int64_t)c * hidden, *h = s->h + (int64_t)c * hidden;
    if (step->sums)
        attend_scored(m, &m->kv[l], rows, step->lanes + c, step->positions + c,
                      step->lane_rows + c,
                      step->masks ? step->masks + c : NULL, step->key_pools[l],
                      step->value_pools[l], step->lane_tokens, step->sums[l], s);
    else
        attend(m, &m->kv[l], rows, step->lanes + c, step->positions + c, step->lane_rows + c,
               step->masks ? step->masks + c : NULL, step->key_pools[l], step->value_pools[l],
               step->lane_tokens, s);
    mark(m, clock, PHASE_ATTEND);
    int status = linear(m, &m->o[l], s->attn, rows, s, s->proj);
    mark(m, clock, PHASE_O);
    add_norm(x, s->proj, m->mlp_norm[l], m, rows, h);
    mark(m, clock, PHASE_NORMS);
    status |= mlp(m, &m->gate_up[l], &m->down[l], h, rows, s, clock);
    add_norm(x, s->proj, l + 1 < m->layers ? m->attn_norm[l + 1] : NULL, m, rows, h);
    mark(m, clock, PHASE_NORMS);
    return status;
}

/* Thread `id`'s part of the chunk's scratch for its rows lo .. of the chunk (lo a multiple
   of TOKEN_TILE, and of AMX_ROWS where AMX tiles run): its rows of the chunk-wide arrays
   and its own share of the per-thread ones, seen from its first row as a one-thread step
   sees them. (Every thread but the last has whole tiles of rows, so each one's layout of
   its rows ends where the next one's starts, and the last one's where a one-thread layout
   of all the rows would.) */
static Scratch thread_scratch(const Model *m, const Scratch *s, int id, int lo) {
    const int attn_width = m->heads * m->head_dim, width = scratch_width(m);
    Scratch v = *s;
    v.qkv += (int64_t)lo * (m->heads + 2 * m->kv_heads) * m->head_dim;
    v.attn += (int64_t)lo * attn_width;
    v.proj += (int64_t)lo * m->hidden;
    v.gate_up += (int64_t)lo * 2 * m->intermediate;
    v.act += (int64_t)lo * m->intermediate;
    /* activation codes are laid out per matrix (QActivations): a thread's own layout of
       its rows starts where its rows would in the widest one */
    v.q.codes += (int64_t)lo * width / 4;
    v.q.scales += (int64_t)lo * (width / 32);
    v.q.zero_term += (int64_t)lo * (width / 32);
    v.q.inputs += (int64_t)lo * (width / 32);
    if (v.amx_rows) v.amx_rows += (int64_t)lo * width;
    const RunScratch run = run_scratch(m, s, id);  /* the view's thread 0 */
    v.scores = run.scores;
    v.rows = run.rows;
    v.query_codes = run.codes.codes;
    v.code_scales = run.codes.scales;
    v.runs += lo + id;
    return v;
}

/* Rows a thread takes when a layer's `rows` are split between `count` threads: whole tiles
   (AMX tiles' 16 rows where they run: thread_scratch), the last thread the rest. */
static inline int split_share(const Model *m, int rows, int count) {
    const int align = m->knobs.amx ? AMX_ROWS : TOKEN_TILE;
    return ((rows + count - 1) / count + align - 1) / align * align;
}

/* Layer l over rows c .. c + rows - 1 split between threads by rows: each thread runs the
   whole layer on its own rows as a one-thread step would, meeting the others only once,
   after the KV write (attention may read keys that another thread's rows wrote). Split
   phase by phase instead (every projection by columns, every per-row phase by rows), each
   phase reads what the other core wrote in the last: in prefill, about half of every
   phase's input came from the other core's cache. (The phase profile follows thread 0: its
   waits for the others land in attend and in the next layer's qkv.) whole 0: the q/k/v
   projection and the KV write alone (layer_qkv's part). */
static int layer_split(const Model *m, int l, const StepTokens *step, int c, int rows,
                       Scratch *s, double *clock, int whole) {
    const int threads = m->num_threads;
    Model one = *m;
    one.num_threads = 1;
    int status = 0;
    (void)threads;
    #pragma omp parallel num_threads(threads) reduction(|: status)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        const int id = 0, count = 1;
#endif
        const int per = split_share(m, rows, count);
        const int lo = id * per < rows ? id * per : rows;
        const int hi = lo + per < rows ? lo + per : rows;
        Scratch own = thread_scratch(m, s, id, lo);
        double *own_clock = id == 0 ? clock : NULL;
        if (lo < hi) status |= layer_qkv(&one, l, step, c + lo, hi - lo, &own, own_clock);
        if (whole) {
            #pragma omp barrier
            if (lo < hi) status |= layer_rest(&one, l, step, c + lo, hi - lo, &own, own_clock);
        }
    }
    return status;
}

/* Whether a layer's `rows` are split between threads by rows (layer_split): knobs.split_rows
   a thread or more, and shares even enough. */
static inline int splits(const Model *m, int rows) {
    if (m->num_threads <= 1 || rows < m->num_threads * m->knobs.split_rows) return 0;
    /* the last thread's share short by at most a sixteenth of the rows: the others wait
       for the largest share, and uneven shares lose to splitting every phase */
    return (split_share(m, rows, m->num_threads) * m->num_threads - rows) * 16 <= rows;
}

/* Layer l over the step's rows c .. c + rows - 1: by rows between threads where `splits`
   (never with accumulated attention: a lane's rows would be split between threads), else
   every phase split between the threads. */
static int layer_chunk(const Model *m, int l, const StepTokens *step, int c, int rows,
                       Scratch *s, double *clock) {
    if (!step->sums && splits(m, rows)) return layer_split(m, l, step, c, rows, s, clock, 1);
    const int status = layer_qkv(m, l, step, c, rows, s, clock);  /* (| orders no calls) */
    return status | layer_rest(m, l, step, c, rows, s, clock);
}

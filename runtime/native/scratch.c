/* A step's working memory and each thread's share of it.
   Included by kernels.c: the step is one translation unit. */

typedef struct {
    float *x, *h;           /* [T][hidden] the residual stream, the normed input (the head's
                               rows at the end) */
    float *qkv, *attn, *proj, *gate_up, *act;  /* one chunk's rows' (chunk_rows) */
    float *scores;          /* [threads][RUN_TOKENS * group + 1][longest] attention scores
                               (and a row to pack a tree token's shown ones) */
    int64_t scores_stride;  /* one thread's share */
    float *rows;            /* [threads][RUN_TOKENS * heads][head_dim] a run's queries, sums */
    int16_t *query_codes;   /* [threads][RUN_TOKENS * heads][padded_dim(head_dim)] and */
    float *code_scales;     /* [threads][2][run_scales(heads)]: a run's RunCodes */
    int32_t *runs;          /* [T + 1] where each run of query tokens starts (query_runs) */
    QActivations q;
    int8_t *amx_rows;       /* QActivations.rows for the matrices that take AMX tiles */
} Scratch;

/* Memory that starts on a cache line: a vector store into an output row then touches
   one line, not two. */
static void *lines_alloc(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* The rows of a step a layer runs at a time. */
static inline int chunk_rows(const Model *m) {
    return m->knobs.layer_rows * (m->num_threads > 1 ? m->num_threads : 1);
}

/* The widest activation a projection quantizes (its K). */
static inline int scratch_width(const Model *m) {
    const int width = m->hidden > m->intermediate ? m->hidden : m->intermediate;
    return m->heads * m->head_dim > width ? m->heads * m->head_dim : width;
}

/* Scratch for a step of t_rows rows (and as many logit rows at most), run in chunks of
   chunk_rows. */
static int scratch_alloc(const Model *m, int t_rows, int longest, Scratch *s) {
    const int width = scratch_width(m), attn_width = m->heads * m->head_dim;
    int qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    s->x = lines_alloc(sizeof(float) * t_rows * m->hidden);
    s->h = lines_alloc(sizeof(float) * t_rows * m->hidden);
    const int64_t t = t_rows < chunk_rows(m) ? t_rows : chunk_rows(m);
    s->qkv = lines_alloc(sizeof(float) * t * qkv_width);
    s->attn = lines_alloc(sizeof(float) * t * attn_width);
    s->proj = lines_alloc(sizeof(float) * t * m->hidden);
    s->gate_up = lines_alloc(sizeof(float) * t * 2 * m->intermediate);
    s->act = lines_alloc(sizeof(float) * t * m->intermediate);
    const int64_t padded = (t + TOKEN_TILE - 1) / TOKEN_TILE * TOKEN_TILE;
    s->q.codes = lines_alloc(padded * width);
    s->q.scales = lines_alloc(sizeof(float) * padded * (width / 32));
    s->q.zero_term = lines_alloc(sizeof(int32_t) * padded * (width / 32));
    s->q.inputs = lines_alloc(sizeof(float) * padded * (width / 32));
    s->q.rows = NULL;
    /* only where a matrix may take tiles (amx_takes): elsewhere a step allocates nothing */
    s->amx_rows = m->knobs.amx ? lines_alloc((t + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * width)
                              : NULL;
    s->scores_stride = ((int64_t)RUN_TOKENS * (m->heads / m->kv_heads) + 1) * longest;
    int threads = m->num_threads > 1 ? m->num_threads : 1;
    s->scores = lines_alloc(sizeof(float) * s->scores_stride * threads);
    s->rows = lines_alloc(sizeof(float) * RUN_TOKENS * attn_width * threads);
    s->runs = lines_alloc(sizeof(int32_t) * (t + threads));  /* a run list per thread */
    s->query_codes = lines_alloc(sizeof(int16_t) * RUN_TOKENS * m->heads
                                 * padded_dim(m->head_dim) * threads);
    s->code_scales = lines_alloc(sizeof(float) * 2 * run_scales(m->heads) * threads);
    return s->x && s->h && s->qkv && s->attn && s->proj && s->gate_up && s->act && s->q.codes
        && s->q.inputs && s->q.scales && s->q.zero_term && s->scores && s->rows && s->runs
        && s->query_codes && s->code_scales && (s->amx_rows || !m->knobs.amx);
}

static void scratch_free(Scratch *s) {
    free(s->x); free(s->h); free(s->qkv); free(s->attn); free(s->proj); free(s->gate_up);
    free(s->act); free(s->q.codes); free(s->q.scales); free(s->q.zero_term); free(s->q.inputs);
    free(s->scores); free(s->rows); free(s->runs); free(s->amx_rows); free(s->query_codes);
    free(s->code_scales);
}

/* Thread id's share of the scratch one attend_run uses: its scores, query rows and codes. */
typedef struct {
    float *scores, *rows;
    RunCodes codes;
} RunScratch;

static RunScratch run_scratch(const Model *m, const Scratch *s, int id) {
    const int64_t heads = m->heads;
    float *scales = s->code_scales + 2 * id * run_scales(m->heads);
    return (RunScratch){s->scores + id * s->scores_stride,
                        s->rows + id * RUN_TOKENS * heads * m->head_dim,
                        {s->query_codes + id * RUN_TOKENS * heads * padded_dim(m->head_dim),
                         scales, scales + run_scales(m->heads)}};
}

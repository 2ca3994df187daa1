/* A whole step: embedding, the layers chunk by chunk, the LM head.
   Included by kernels.c: the step is one translation unit. */

static void embed_row(const Model *m, int64_t token, float *out) {
    if (m->embed) {
        memcpy(out, m->embed + token * m->hidden, sizeof(float) * m->hidden);
        return;
    }
    const QRows *w = &m->embed_codes;
    const int blocks = block_count(w->k, w->block);
    for (int e = 0; e < w->k; e++) {
        int code;
        if (w->bits == 8) {
            code = w->codes[token * w->k + e];
        } else {
            uint8_t byte = w->codes[token * (w->k / 2) + e / 2];
            code = e & 1 ? byte >> 4 : byte & 15;
        }
        const int64_t at = token * blocks + e / w->block;
        int zero = w->zeros ? w->zeros[at] : 1 << (w->bits - 1);
        out[e] = (float)(code - zero) * w->scales[at];
    }
}

/* The rows of a step whose logits it returns, and where the last layer leaves them. */
typedef struct {
    uint8_t *wanted;       /* [T] 1: the step returns row t's logits */
    int32_t *moved;        /* [T] row t's place in s->x after the last layer */
    int32_t *lanes, *lane_rows, *positions;  /* [T] the kept rows' (compacted; StepTokens') */
    uint64_t *masks;       /* [T], or NULL where the step has none */
} KeptRows;

/* The last layer over rows c .. c + rows - 1 where only some rows' logits are wanted (a
   prefill returns its last token's): every row writes its keys and values, and only the
   wanted rows, moved to the chunk's first rows (their q/k/v and residual rows, and their
   lanes, rows and masks in `kept`), go on through attention, o and the MLP. Nothing reads
   the others' outputs past this layer, and each kept row computes what it would among
   all of them (attend_run: a token's attention does not depend on the run it is in): the
   same logits, bit for bit, for about 1 / layers less work in a long prefill. */
static int last_layer_chunk(const Model *m, int l, const StepTokens *step, int c, int rows,
                            Scratch *s, double *clock, KeptRows *kept) {
    int status = splits(m, rows) ? layer_split(m, l, step, c, rows, s, clock, 0)
                                 : layer_qkv(m, l, step, c, rows, s, clock);
    const int64_t qkv_width = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim;
    const int hidden = m->hidden;
    int n = 0;
    for (int i = 0; i < rows; i++) {
        const int t = c + i, to = c + n;
        if (!kept->wanted[t]) continue;
        if (n != i) {  /* rows move down only: a row's new place holds nothing still needed */
            memcpy(s->qkv + n * qkv_width, s->qkv + i * qkv_width, sizeof(float) * qkv_width);
            memcpy(s->x + (int64_t)to * hidden, s->x + (int64_t)t * hidden,
                   sizeof(float) * hidden);
        }
        kept->lanes[to] = step->lanes[t];
        kept->lane_rows[to] = step->lane_rows[t];
        kept->positions[to] = step->positions[t];
        if (kept->masks) kept->masks[to] = step->masks[t];
        kept->moved[t] = to;
        n++;
    }
    if (n == 0) return status;
    StepTokens compact = *step;
    compact.lanes = kept->lanes;
    compact.lane_rows = kept->lane_rows;
    compact.positions = kept->positions;
    compact.masks = kept->masks;
    return status | layer_rest(m, l, &compact, c, n, s, clock);
}

static void kept_free(KeptRows *kept) {
    free(kept->wanted); free(kept->moved); free(kept->lanes); free(kept->lane_rows);
    free(kept->positions); free(kept->masks);
}

/* KeptRows for a step of t_rows rows returning logit_rows' logits; 0 when memory runs out. */
static int kept_alloc(int t_rows, int n_logits, const int32_t *logit_rows, int masks,
                      KeptRows *kept) {
    kept->wanted = calloc(t_rows, 1);
    kept->moved = malloc(sizeof(int32_t) * t_rows);
    kept->lanes = malloc(sizeof(int32_t) * t_rows);
    kept->lane_rows = malloc(sizeof(int32_t) * t_rows);
    kept->positions = malloc(sizeof(int32_t) * t_rows);
    kept->masks = masks ? malloc(sizeof(uint64_t) * t_rows) : NULL;
    if (!kept->wanted || !kept->moved || !kept->lanes || !kept->lane_rows || !kept->positions
            || (masks && !kept->masks))
        return 0;
    for (int r = 0; r < n_logits; r++) kept->wanted[logit_rows[r]] = 1;
    return 1;
}

/* One step. Token t (of T, packed) has id tokens[t] and position positions[t], sits in
   lane lanes[t] at row lane_rows[t] (its position but in a draft tree, whose siblings
   share positions), where its key and value are written in every layer; masks[t] (masks
   NULL: none) hides a tree's other branches from it (attend_run). Logit row r is the
   head's output for token logit_rows[r]. Each layer runs over the rows chunk_rows at a
   time, in order. sums (NULL: none): each layer's accumulated attention, [lanes][kv_heads]
   [lane_tokens], which every token's attention weights add to (summed over the query
   group's heads; H2O); then every row runs every layer. Returns 0, or -1 when memory runs
   out. */
static int forward_scored(const Model *m, int32_t t_rows, const int64_t *tokens,
                          const int32_t *lanes, const int32_t *positions,
                          const int32_t *lane_rows, const uint64_t *masks,
                          uint8_t *const *key_pools, uint8_t *const *value_pools,
                          int32_t lane_tokens, int32_t n_logits, const int32_t *logit_rows,
                          float *logits, float *const *sums) {
    Scratch s;
    int longest = 1;
    for (int t = 0; t < t_rows; t++) if (lane_rows[t] + 1 > longest) longest = lane_rows[t] + 1;
    if (!scratch_alloc(m, t_rows > n_logits ? t_rows : n_logits, longest, &s)) {
        scratch_free(&s);
        return -1;
    }
    const StepTokens step = {lanes, positions, lane_rows, masks, key_pools, value_pools,
                             lane_tokens, sums};
    const int hidden = m->hidden;
    double clock = profile_clock(m->knobs.phase_seconds);
    #pragma omp parallel for num_threads(m->num_threads) \
        if (m->num_threads > 1 && t_rows >= PARALLEL_ROWS)
    for (int t = 0; t < t_rows; t++) {
        embed_row(m, tokens[t], s.x + (int64_t)t * hidden);
        rms_norm(s.x + (int64_t)t * hidden, m->attn_norm[0], m->eps, hidden,
                 s.h + (int64_t)t * hidden);
    }
    clock = profile_phase(m->knobs.phase_seconds, PHASE_EMBED, clock);
    const int chunk = chunk_rows(m);
    KeptRows kept = {0};
    /* some rows' logits unwanted: last_layer_chunk (not where every row's attention adds up) */
    const int trim = n_logits < t_rows && !sums;
    /* status: an AMX tile's unpacking buffer, or kept's arrays, may fail to allocate */
    int status = trim && !kept_alloc(t_rows, n_logits, logit_rows, masks != NULL, &kept);
    for (int l = 0; l < m->layers && !status; l++)
        for (int c = 0; c < t_rows && !status; c += chunk) {
            const int rows = t_rows - c < chunk ? t_rows - c : chunk;
            status |= trim && l == m->layers - 1
                ? last_layer_chunk(m, l, &step, c, rows, &s, &clock, &kept)
                : layer_chunk(m, l, &step, c, rows, &s, &clock);
        }
    for (int r = 0; r < n_logits && !status; r++)
        rms_norm(s.x + (int64_t)(trim ? kept.moved[logit_rows[r]] : logit_rows[r]) * hidden,
                 m->final_norm, m->eps, hidden, s.h + (int64_t)r * hidden);
    for (int r = 0; r < n_logits && !status; r += chunk)
        status = linear(m, &m->head, s.h + (int64_t)r * hidden,
                        n_logits - r < chunk ? n_logits - r : chunk, &s,
                        logits + (int64_t)r * m->head.n);
    profile_phase(m->knobs.phase_seconds, PHASE_HEAD, clock);
    scratch_free(&s);
    kept_free(&kept);
    return status ? -1 : 0;
}

/* MXCSR's flush-to-zero and denormals-are-zero bits. A peaked softmax sends the weights of
   most keys below FLT_MIN, and x86 computes on such subnormals through microcode assists,
   tens of times slower than on normal floats; flushed, they are the zeros they stand for. */
#define FLUSH_SUBNORMALS 0x8040u

int llmopt_forward_scored(const Model *m, int32_t t_rows, const int64_t *tokens,
                          const int32_t *lanes, const int32_t *positions,
                          const int32_t *lane_rows, const uint64_t *masks,
                          uint8_t *const *key_pools, uint8_t *const *value_pools,
                          int32_t lane_tokens, int32_t n_logits, const int32_t *logit_rows,
                          float *logits, float *const *sums) {
    /* flushed on every thread of the step's team (theirs stay so), the caller's restored */
    const unsigned int caller = _mm_getcsr();
    #pragma omp parallel num_threads(m->num_threads) if (m->num_threads > 1)
    _mm_setcsr(_mm_getcsr() | FLUSH_SUBNORMALS);
    const int status = forward_scored(m, t_rows, tokens, lanes, positions, lane_rows, masks,
                                      key_pools, value_pools, lane_tokens, n_logits,
                                      logit_rows, logits, sums);
    _mm_setcsr(caller);
    return status;
}

int llmopt_forward(const Model *m, int32_t t_rows, const int64_t *tokens,
                   const int32_t *lanes, const int32_t *positions, const int32_t *lane_rows,
                   const uint64_t *masks, uint8_t *const *key_pools,
                   uint8_t *const *value_pools, int32_t lane_tokens, int32_t n_logits,
                   const int32_t *logit_rows, float *logits) {
    return llmopt_forward_scored(m, t_rows, tokens, lanes, positions, lane_rows, masks,
                                 key_pools, value_pools, lane_tokens, n_logits, logit_rows,
                                 logits, NULL);
}

/* A model's default settings (Knobs): AMX off (the caller turns it on where
   llmopt_native_amx_available), no profile. */
void llmopt_native_knobs(Knobs *knobs) {
    *knobs = (Knobs){0, AMX_MIN_ROWS, LAYER_ROWS, SPLIT_ROWS, NULL};
}

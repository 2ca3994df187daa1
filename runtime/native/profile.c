/* The phase profile, a clock read either side of each phase.
   Included by kernels.c: the step is one translation unit. */

/* Where a step's time goes, phase by phase (benchmarks/native_step_profile.py): off unless
   a model's knobs.phase_seconds points at its sums, and then a clock read either side of
   each phase, on the thread that calls
   llmopt_forward (a phase's parallel regions end before it does). Phases, in a layer's
   order: */
enum {
    PHASE_EMBED,          /* embedding rows and the first norm */
    PHASE_QKV,            /* quantize the norm's output, the fused q/k/v projection */
    PHASE_KV_WRITE,       /* rotary (and the rotation), keys and values into their lanes */
    PHASE_ATTEND,         /* every run of query tokens against its lane (attend_run) */
    PHASE_O,              /* the output projection */
    PHASE_NORMS,          /* residual adds and RMS norms */
    PHASE_GATE_UP,        /* the fused gate/up projection */
    PHASE_SILU,           /* SiLU(gate) * up */
    PHASE_DOWN,           /* the down projection */
    PHASE_HEAD,           /* the final norm and the LM head */
    PHASES
};
static const char *const phase_names[PHASES] = {
    "embed", "qkv", "kv_write", "attend", "o", "norms", "gate_up", "silu", "down", "head"};

/* A clock reading where the profile is on (`seconds`: its sums), else 0. */
static inline double profile_clock(const double *seconds) {
    if (!seconds) return 0.;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Adds the time since `since` (a profile_clock reading) to `phase`'s sum; returns the clock. */
static inline double profile_phase(double *seconds, int phase, double since) {
    if (!seconds) return 0.;
    const double now = profile_clock(seconds);
    seconds[phase] += now - since;
    return now;
}

/* The phases' names, NULL past the last. */
const char *llmopt_native_profile_name(int phase) {
    return phase >= 0 && phase < PHASES ? phase_names[phase] : NULL;
}

/* The structs' layouts, for the test that checks library.py's ctypes mirrors against them.
   Included by kernels.c: the step is one translation unit. */

#include <stddef.h>

typedef struct {
    const char *type, *field;  /* field NULL: the struct's own size */
    int64_t offset, size;
} FieldLayout;

#define STRUCT(T) {#T, NULL, 0, sizeof(T)}
#define FIELD(T, f) {#T, #f, offsetof(T, f), sizeof(((T *)0)->f)}
static const FieldLayout layouts[] = {
    STRUCT(QMatrix), FIELD(QMatrix, codes), FIELD(QMatrix, scales), FIELD(QMatrix, zeros),
    FIELD(QMatrix, offsets), FIELD(QMatrix, n), FIELD(QMatrix, k), FIELD(QMatrix, bits),
    FIELD(QMatrix, block), FIELD(QMatrix, half_scales), FIELD(QMatrix, bias), FIELD(QMatrix, lut),
    STRUCT(QRows), FIELD(QRows, codes), FIELD(QRows, scales), FIELD(QRows, zeros),
    FIELD(QRows, offsets), FIELD(QRows, n), FIELD(QRows, k), FIELD(QRows, bits),
    FIELD(QRows, block),
    STRUCT(KVLayout), FIELD(KVLayout, bits), FIELD(KVLayout, key_scale),
    FIELD(KVLayout, value_scale), FIELD(KVLayout, rotation), FIELD(KVLayout, hadamard),
    FIELD(KVLayout, window),
    STRUCT(Knobs), FIELD(Knobs, amx), FIELD(Knobs, amx_min_rows), FIELD(Knobs, layer_rows),
    FIELD(Knobs, split_rows), FIELD(Knobs, phase_seconds),
    STRUCT(Model), FIELD(Model, layers), FIELD(Model, hidden), FIELD(Model, heads),
    FIELD(Model, kv_heads), FIELD(Model, head_dim), FIELD(Model, intermediate),
    FIELD(Model, vocab), FIELD(Model, max_position), FIELD(Model, num_threads),
    FIELD(Model, eps), FIELD(Model, attn_scale), FIELD(Model, rope_cos), FIELD(Model, rope_sin),
    FIELD(Model, embed), FIELD(Model, embed_codes), FIELD(Model, attn_norm),
    FIELD(Model, mlp_norm), FIELD(Model, final_norm), FIELD(Model, qkv), FIELD(Model, o),
    FIELD(Model, gate_up), FIELD(Model, down), FIELD(Model, head), FIELD(Model, kv),
    FIELD(Model, q_norm), FIELD(Model, k_norm), FIELD(Model, knobs),
};
#undef STRUCT
#undef FIELD

/* Entry i of the table (0 past its end): the struct's name, the field's (NULL: the struct's
   size), its offset and size in bytes. */
int llmopt_native_layout(int i, const char **type, const char **field, int64_t *offset,
                         int64_t *size) {
    if (i < 0 || i >= (int)(sizeof layouts / sizeof layouts[0])) return 0;
    *type = layouts[i].type;
    *field = layouts[i].field;
    *offset = layouts[i].offset;
    *size = layouts[i].size;
    return 1;
}

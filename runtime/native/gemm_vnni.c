/* A projection's row groups times tiles of activation rows, VNNI dots.
   Included by kernels.c: the step is one translation unit. */

/* tile8_q4's pieces of assembly. UNPACK: code vectors lo and hi (registers) from packed
   line j. STORE_ROWS: row i's sums (zmm16 + i) to out + i * stride. SUM: row i's block dot
   (zmm i) as a float, times its scale product, added to its sum (zmm f). PREFETCH: the
   slice PREFETCH_SLICES ahead of the codes into L1. CLOBBERS: every register it writes. */
#define UNPACK(j, lo, hi) \
    "vmovdqu64 64*" #j "(%[codes]), %%zmm" #lo "\n\t" \
    "vpsrlw $4, %%zmm" #lo ", %%zmm" #hi "\n\t" \
    "vpandd %[low4], %%zmm" #lo ", %%zmm" #lo "\n\t" \
    "vpandd %[low4], %%zmm" #hi ", %%zmm" #hi "\n\t"
#define STORE(at, f) "vmovups %%zmm" #f ", " at "\n\t"
#define STORE_ROWS \
    STORE("(%[out])", 16) STORE("(%[out],%[bytes])", 17) STORE("(%[out],%[bytes],2)", 18) \
    STORE("(%[out],%[bytes3])", 19) STORE("(%[out4])", 20) STORE("(%[out4],%[bytes])", 21) \
    STORE("(%[out4],%[bytes],2)", 22) STORE("(%[out4],%[bytes3])", 23)
#define SUM(i, f) \
    "vcvtdq2ps %%zmm" #i ", %%zmm" #i "\n\t" \
    "vmulps 4*" #i "(%[act_scales])%{1to16%}, %%zmm25, %%zmm26\n\t" \
    "vfmadd231ps %%zmm26, %%zmm" #i ", %%zmm" #f "\n\t"
#define PREFETCH \
    "prefetcht0 %c[ahead](%[codes])\n\t" \
    "prefetcht0 %c[ahead]+64(%[codes])\n\t" \
    "prefetcht0 %c[ahead]+128(%[codes])\n\t" \
    "prefetcht0 %c[ahead]+192(%[codes])\n\t"
#define CLOBBERS \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
    "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", \
    "xmm21", "xmm22", "xmm23", "xmm25", "xmm26", "memory", "cc"

/* The common full tile as one loop of assembly: TOKEN_TILE (8) activation rows times a row
   group of symmetric 4-bit weights (no zero points, no offsets) over `blocks` blocks of
   `slices` slices each but the last, of `last` (blocks > 0), into `out` what gemm_tile
   computes, operation for operation, with every value in a named register. (GCC, given
   gemm_tile's intrinsics, moves sums between registers and spills addresses, and issues
   fewer dots a cycle.) The shorter last block of a K like 576 in blocks of 128 runs in the
   same loop: as a second call it reloaded the sums the first had just stored, and waited
   on those loads.
   Registers: zmm0-7 each row's integer dot of the block, zmm8-15 the block's eight code
   vectors, zmm16-23 each row's float sum, zmm25 the block's row scales, zmm26 a row's
   scale product; each dot reads its row's four activation codes as a broadcast operand
   (dot_broadcast). Per slice the pointers advance by: codes 256 bytes, activation codes
   8 x 8 int32; per block: row scales 16 floats, zero terms and activation scales 8 each
   (the tiled layouts above). out: 8 rows of 16 floats, `stride` floats apart (the tile's
   outputs in y itself where its row group is whole: no buffer to zero and copy). */
static void tile8_q4(const uint8_t *codes, const float *row_scales, const int32_t *act,
                     const int32_t *zero_term, const float *act_scales, int64_t blocks,
                     int64_t slices, int64_t last, float *out, int64_t stride) {
    int64_t left;
    /* row i at out + i * stride: rows 4 .. 7 from a second base, each at base + 0, 1, 2 or 3
       strides (x86 addresses scale an index by 1, 2, 4 or 8, never 3) */
    const int64_t bytes = 4 * stride, bytes3 = 3 * bytes;
    float *const out4 = out + 4 * stride;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __asm__ volatile(
        ".irp f,16,17,18,19,20,21,22,23\n\t"
        "vpxord %%zmm\\f, %%zmm\\f, %%zmm\\f\n\t"
        ".endr\n"
        "1:\n\t"
        /* each row's dot starts from its zero term */
        ".irp i,0,1,2,3,4,5,6,7\n\t"
        "vpbroadcastd 4*\\i(%[zero_term]), %%zmm\\i\n\t"
        ".endr\n\t"
        "mov %[slices], %[left]\n\t"
        "cmp $1, %[blocks]\n\t"  /* the last block: `last` slices */
        "jne 2f\n\t"
        "mov %[last], %[left]\n"
        "2:\n\t"
        PREFETCH
        UNPACK(0, 8, 9) UNPACK(1, 10, 11) UNPACK(2, 12, 13) UNPACK(3, 14, 15)
        /* code vector m (zmm8+m) times row i's four activation codes m, for every m, i */
        ".irp m,8,9,10,11,12,13,14,15\n\t"
        ".irp i,0,1,2,3,4,5,6,7\n\t"
        "vpdpbusd 32*(\\m-8)+4*\\i(%[act])%{1to16%}, %%zmm\\m, %%zmm\\i\n\t"
        ".endr\n\t"
        ".endr\n\t"
        "add $256, %[codes]\n\t"
        "add $256, %[act]\n\t"
        "dec %[left]\n\t"
        "jnz 2b\n\t"
        "vmovups (%[row_scales]), %%zmm25\n\t"
        SUM(0, 16) SUM(1, 17) SUM(2, 18) SUM(3, 19)
        SUM(4, 20) SUM(5, 21) SUM(6, 22) SUM(7, 23)
        "add $64, %[row_scales]\n\t"
        "add $32, %[zero_term]\n\t"
        "add $32, %[act_scales]\n\t"
        "dec %[blocks]\n\t"
        "jnz 1b\n\t"
        STORE_ROWS
        : [codes] "+r"(codes), [row_scales] "+r"(row_scales), [act] "+r"(act),
          [zero_term] "+r"(zero_term), [act_scales] "+r"(act_scales), [blocks] "+r"(blocks),
          [left] "=&r"(left)
        : [out] "r"(out), [out4] "r"(out4), [bytes] "r"(bytes), [bytes3] "r"(bytes3),
          [last] "m"(last), [slices] "r"(slices), [low4] "v"(low4),
          [ahead] "i"(PREFETCH_SLICES * 256)
        : CLOBBERS);
}
#undef UNPACK
#undef STORE
#undef STORE_ROWS
#undef SUM
#undef PREFETCH
#undef CLOBBERS

/* acc + codes . (*four, broadcast to every lane): one VPDPBUSD that reads the four
   activation codes as its broadcast memory operand, where GCC writes _mm512_set1_epi32 of
   a load as a VPBROADCASTD of its own before each dot. One instruction a dot fewer (here
   and in tile8_q4), which the dot-bound steps (batch 16, prefill) feel. */
static inline __attribute__((always_inline)) __m512i dot_broadcast(__m512i acc, __m512i codes,
                                                                   const int32_t *four) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*four));
    return acc;
}

/* One slice's weight lines prefetched into L1 PREFETCH_SLICES ahead and, in a step bound
   by the weight stream (`stream`: fewer than 8 rows), into L2 STREAM_PREFETCH_SLICES
   ahead (see both). */
static inline __attribute__((always_inline)) void prefetch_slice(const uint8_t *at,
                                                                 const int slice_bytes,
                                                                 const int stream) {
    for (int line = 0; line < slice_bytes; line += 64) {
        _mm_prefetch((const char *)at + PREFETCH_SLICES * slice_bytes + line, _MM_HINT_T0);
        if (stream)
            _mm_prefetch((const char *)at + STREAM_PREFETCH_SLICES * slice_bytes + line,
                         _MM_HINT_T1);
    }
}

/* Block b's sixteen row scales, from the float16 copy where `halves` (float16 to float32
   is exact: the same numbers). */
static inline __attribute__((always_inline)) __m512 block_scales(const float *scales,
                                                                 const uint16_t *half, int b,
                                                                 const int halves) {
    return halves ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + b * 16)))
                  : _mm512_loadu_ps(scales + b * 16);
}

/* Where gemm_tile's operands start: row group g's weights, tile t0's activations. */
typedef struct {
    const uint8_t *group, *zeros;
    const float *scales, *offsets, *act_scales, *inputs;
    const int32_t *act, *zero_term;
    const uint16_t *half_scales;  /* where the tile reads them (halves) */
} TileOperands;

/* gemm_tile for a lone activation row (a batch-1 step, or a step's last tile of one row):
   the same operations in a loop of its own that walks its pointers, each block's integer
   dot grown as two chains, the even code vectors' and the odd ones', added at the block's
   end (integer sums: the same dot in any order). gemm_tile's loop, one chain of eight
   dependent dots a slice, holds the weight stream below what two chains draw. */
static inline __attribute__((always_inline)) void lone_row(
        const QMatrix *w, TileOperands o, const int bits, const int has_zeros, const int halves,
        const int lookup, __mmask16 rows, float *out) {
    const int slice_bytes = bits * 64, per_block = w->block / 32;
    const int blocks = block_count(w->k, w->block);
    const __m512i low4 = _mm512_set1_epi8(0x0F), lut = lut_vector(w, lookup);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int64_t bt = (int64_t)b * TOKEN_TILE;
        __m512i even = has_zeros
            ? _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                  (const __m128i *)(o.zeros + b * 16))), _mm512_set1_epi32(o.zero_term[bt]))
            : _mm512_set1_epi32(o.zero_term[bt]);
        __m512i odd = _mm512_setzero_si512();
        const uint8_t *at = o.group + (int64_t)b * per_block * slice_bytes;
        const int32_t *slice_act = o.act + (int64_t)b * per_block * 8 * TOKEN_TILE;
        const int block_end = block_slices(w, b);
        for (int s = 0; s < block_end; s++, at += slice_bytes, slice_act += 8 * TOKEN_TILE) {
            prefetch_slice(at, slice_bytes, 1);
            for (int j = 0; j < 4; j++) {  /* code vectors 2j and 2j + 1 */
                __m512i first_codes, second_codes;
                if (bits == 8) {
                    first_codes = _mm512_loadu_si512(at + 128 * j);
                    second_codes = _mm512_loadu_si512(at + 128 * j + 64);
                } else {
                    const __m512i packed = _mm512_loadu_si512(at + 64 * j);
                    first_codes = looked_up(_mm512_and_si512(packed, low4), lut, lookup);
                    second_codes = looked_up(
                        _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), lut, lookup);
                }
                even = dot_broadcast(even, first_codes, slice_act + 2 * j * TOKEN_TILE);
                odd = dot_broadcast(odd, second_codes, slice_act + (2 * j + 1) * TOKEN_TILE);
            }
        }
        const __m512i dot = _mm512_add_epi32(even, odd);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(
            block_scales(o.scales, o.half_scales, b, halves),
            _mm512_set1_ps(o.act_scales[bt])), acc);
        if (o.offsets)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(o.offsets + b * 16),
                                  _mm512_set1_ps(o.inputs[bt]), acc);
    }
    _mm512_mask_storeu_ps(out, rows, acc);
}

/* Row group g's lanes of y: all sixteen but in a short last group. */
static inline __attribute__((always_inline)) __mmask16 group_lanes(const QMatrix *w,
                                                                    int64_t g) {
    return (__mmask16)((1u << (w->n - 16 * g < 16 ? w->n - 16 * g : 16)) - 1);
}

/* acc[i] to row t0 + i of y, row group g's lanes. */
static inline __attribute__((always_inline)) void store_tile_rows(
        const QMatrix *w, int t0, const int rows, int64_t g, __mmask16 lanes, const __m512 *acc,
        float *y) {
    for (int i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(y + (int64_t)(t0 + i) * w->n + 16 * g, lanes, acc[i]);
}

/* gemm_tile's full tile of 4-bit symmetric codes through tile8_q4: a whole row group's sums
   go straight to y, the last group's short one's through a buffer. */
static inline __attribute__((always_inline)) void tile8_into(
        const QMatrix *w, TileOperands o, int t0, int blocks, __mmask16 rows, float *y,
        int64_t g) {
    float sums[TOKEN_TILE][16];
    const int whole = rows == 0xFFFF;
    float *out = whole ? y + (int64_t)t0 * w->n + 16 * g : &sums[0][0];
    const int64_t stride = whole ? w->n : 16;
    tile8_q4(o.group, o.scales, o.act, o.zero_term, o.act_scales, blocks, w->block / 32,
             block_slices(w, blocks - 1), out, stride);
    for (int i = 0; i < TOKEN_TILE && !whole; i++)
        _mm512_mask_storeu_ps(y + (int64_t)(t0 + i) * w->n + 16 * g, rows,
                              _mm512_loadu_ps(sums[i]));
}

/* Block b's integer dots of rows 0 .. tile - 1 start from the zero point's term (times each
   output row's zero point where the codes have them). */
static inline __attribute__((always_inline)) void start_dots(
        __m512i *dot, const TileOperands *o, int b, const int tile, const int has_zeros) {
    const int64_t bt = (int64_t)b * TOKEN_TILE;
    if (has_zeros) {
        const __m512i row_zeros =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o->zeros + b * 16)));
        for (int i = 0; i < tile; i++)
            dot[i] = _mm512_mullo_epi32(row_zeros, _mm512_set1_epi32(o->zero_term[bt + i]));
    } else {
        for (int i = 0; i < tile; i++) dot[i] = _mm512_set1_epi32(o->zero_term[bt + i]);
    }
}

/* The slice at `at` as eight code vectors of bytes (4-bit codes unpacked, looked up in a
   code book's table). */
static inline __attribute__((always_inline)) void slice_codes(
        const QMatrix *w, const uint8_t *at, const int bits, const int lookup, __m512i *codes) {
    if (bits == 8) {
        for (int m = 0; m < 8; m++) codes[m] = _mm512_loadu_si512(at + 64 * m);
    } else {
        const __m512i low4 = _mm512_set1_epi8(0x0F), lut = lut_vector(w, lookup);
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512(at + 64 * j);
            codes[2 * j] = looked_up(_mm512_and_si512(packed, low4), lut, lookup);
            codes[2 * j + 1] = looked_up(
                _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), lut, lookup);
        }
    }
}

/* Tile `tile` (rows t0 .., `tile` of them) times row group g: 16 outputs per row. Each
   block's integer dots start from the zero point's term and run as one chain per row over
   the block's slices, the rows interleaved so that `tile` chains are in flight (a lone row:
   lone_row). `bits`, `zeros` and `halves` (scales read from w's float16 copy) are constants
   in each instance. */
static inline __attribute__((always_inline)) void gemm_tile(
        const QMatrix *w, const QActivations *a, int t0, const int tile, const int bits,
        const int has_zeros, const int halves, const int lookup, float *y, int64_t g) {
    const int slices = w->k / 32, slice_bytes = bits * 64, per_block = w->block / 32;
    const int blocks = block_count(w->k, w->block);
    const int64_t first = tile_at(t0, blocks, 0);
    const TileOperands o = {
        w->codes + g * slices * slice_bytes, has_zeros ? w->zeros + g * blocks * 16 : NULL,
        w->scales + g * blocks * 16, w->offsets ? w->offsets + g * blocks * 16 : NULL,
        a->scales + first, a->inputs + first, a->codes + tile_at(t0, slices, 0) * 8,
        a->zero_term + first, halves ? w->half_scales + g * blocks * 16 : NULL};
    const __mmask16 rows = group_lanes(w, g);
    if (tile == 1) {
        lone_row(w, o, bits, has_zeros, halves, lookup, rows, y + (int64_t)t0 * w->n + 16 * g);
        return;
    }
    if (tile == TOKEN_TILE && bits == 4 && !has_zeros && !o.offsets && blocks > 0) {
        tile8_into(w, o, t0, blocks, rows, y, g);
        return;
    }
    __m512 acc[TOKEN_TILE];
    for (int i = 0; i < tile; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int64_t bt = (int64_t)b * TOKEN_TILE;
        __m512i dot[TOKEN_TILE];
        start_dots(dot, &o, b, tile, has_zeros);
        for (int s = b * per_block; s < b * per_block + block_slices(w, b); s++) {
            const uint8_t *at = o.group + (int64_t)s * slice_bytes;
            prefetch_slice(at, slice_bytes, tile < TOKEN_TILE);
            __m512i codes[8];
            slice_codes(w, at, bits, lookup, codes);
            const int32_t *slice_act = o.act + (int64_t)s * 8 * TOKEN_TILE;
            for (int m = 0; m < 8; m++)
                for (int i = 0; i < tile; i++)
                    dot[i] = dot_broadcast(dot[i], codes[m], slice_act + m * TOKEN_TILE + i);
        }
        const __m512 row_scales = block_scales(o.scales, o.half_scales, b, halves);
        for (int i = 0; i < tile; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(
                row_scales, _mm512_set1_ps(o.act_scales[bt + i])), acc[i]);
            if (o.offsets)
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(o.offsets + b * 16),
                                         _mm512_set1_ps(o.inputs[bt + i]), acc[i]);
        }
    }
    store_tile_rows(w, t0, tile, g, rows, acc, y);
}

#define TILE_CASES(bits, zeros, lookup) \
    switch (t1 - t0 < TOKEN_TILE ? t1 - t0 : TOKEN_TILE) { \
    case 1: gemm_tile(w, a, t0, 1, bits, zeros, halves, lookup, y, g); break; \
    case 2: gemm_tile(w, a, t0, 2, bits, zeros, halves, lookup, y, g); break; \
    case 3: gemm_tile(w, a, t0, 3, bits, zeros, halves, lookup, y, g); break; \
    case 4: gemm_tile(w, a, t0, 4, bits, zeros, halves, lookup, y, g); break; \
    case 5: gemm_tile(w, a, t0, 5, bits, zeros, halves, lookup, y, g); break; \
    case 6: gemm_tile(w, a, t0, 6, bits, zeros, halves, lookup, y, g); break; \
    case 7: gemm_tile(w, a, t0, 7, bits, zeros, halves, lookup, y, g); break; \
    default: gemm_tile(w, a, t0, 8, bits, zeros, 0, lookup, y, g); break; \
    }

/* y[t][16g .. 16g+15] for row groups lo..hi-1 and every activation row t, ROW_CHUNK rows
   at a time; `halves`: from the float16 scales (a step of fewer than 8 rows, bound by the
   weight stream: half their bytes). */
static inline __attribute__((always_inline)) void gemm_groups_as(
        const QMatrix *w, const QActivations *a, int t_rows, float *y, int64_t lo, int64_t hi,
        const int halves) {
    for (int c0 = 0; c0 < t_rows; c0 += ROW_CHUNK) {
        const int t1 = t_rows - c0 < ROW_CHUNK ? t_rows : c0 + ROW_CHUNK;
        for (int64_t g = lo; g < hi; g++)
            for (int t0 = c0; t0 < t1; t0 += TOKEN_TILE) {
                if (w->lut) TILE_CASES(4, 1, 1)
                else if (w->bits == 4 && !w->zeros) TILE_CASES(4, 0, 0)
                else if (w->bits == 4) TILE_CASES(4, 1, 0)
                else if (!w->zeros) TILE_CASES(8, 0, 0)
                else TILE_CASES(8, 1, 0)
            }
    }
}

static void gemm_groups(const QMatrix *w, const QActivations *a, int t_rows, float *y,
                        int64_t lo, int64_t hi) {
    if (w->half_scales && t_rows < TOKEN_TILE) gemm_groups_as(w, a, t_rows, y, lo, hi, 1);
    else gemm_groups_as(w, a, t_rows, y, lo, hi, 0);
}

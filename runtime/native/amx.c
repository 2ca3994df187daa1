/* The same product on AMX int8 tiles, bit for bit.
   Included by kernels.c: the step is one translation unit. */

/* AMX: where the CPU has int8 tile multiplies (Intel's AMX-INT8), a tile of up to sixteen
   activation rows times a row group runs one block at a time. In blocks of 32 (amx_tile)
   a block is one TDPBSSD: the tile A is the rows' 32 codes of the block
   (QActivations.rows), the tile B the block's eight code vectors, which weights.py's layout
   already makes the operand's four-bytes-per-lane form, as signed bytes code - zero point.
   Wider blocks (amx_tile_wide) take one TDPBSSD per 64 columns, A 64 codes a row and B two
   slices' sixteen vectors, all summed in one tile. The integer dot of each row and block is
   exact either way, and the float sum over blocks is gemm_tile's, operation for operation,
   so the result is bit for bit the VNNI path's and a step may take either path for any of
   its matrices. The tile's sums pass through memory (AMX has no move to vector registers)
   and each block still needs gemm_tile's three float operations per row, which bound the
   gain in blocks of 32 (benchmarks/native_kernels_ab.py --old amx-off times it). Blocks of
   128 need a quarter of those operations and half the multiplies. */
#define AMX_ROWS 16       /* activation rows of one tile (A's and C's rows) */
#define AMX_MIN_ROWS 16   /* fewer rows take the VNNI path (the default of
                             Knobs.amx_min_rows): below a whole tile, a projection on tiles
                             costs more than VNNI (benchmarks/amx_projections.py) */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,gfni,amx-tile,amx-int8")

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: sums (C, 16 rows of 16 int32), 4-5: activation codes (A, 16 rows of 32 codes,
   or 64 when `wide`), 6-7: code vectors (B, 8 rows of 64 bytes, or 16): see amx_tile and
   amx_tile_wide. */
static void amx_configure(int wide) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) {
        config.rows[tile] = tile < 6 || wide ? AMX_ROWS : 8;
        config.bytes_per_row[tile] = (tile == 4 || tile == 5) && !wide ? 32 : 64;
    }
    /* GCC does not see LDTILECFG read its operand: inlined, the stores above would be
       dropped as dead and the tiles left unconfigured (SIGILL at the first tile load) */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* Slice s of group g's code vectors as signed bytes code - zero point (512 bytes): the
   product then needs no zero-point term (it is the same integer). Prefetches the weight
   stream ahead. */
static inline __attribute__((always_inline)) void amx_unpack_slice(
        const QMatrix *w, int64_t g, int s, int8_t *out) {
    const int slices = w->k / 32, slice_bytes = w->bits * 64;
    const uint8_t *at = w->codes + (g * slices + s) * slice_bytes;
    const char *ahead = (const char *)(at + PREFETCH_SLICES * slice_bytes);
    for (int line = 0; line < slice_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    if (w->bits == 8) {  /* no zero points here (amx_takes): code - 128 */
        for (int m = 0; m < 8; m++)
            _mm512_store_si512(out + 64 * m, _mm512_xor_si512(_mm512_loadu_si512(at + 64 * m),
                                                              _mm512_set1_epi8((char)0x80)));
    } else if (w->zeros) {  /* row i's zero point in each byte of lane i */
        const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_mullo_epi32(
            _mm512_set1_epi32(0x01010101), _mm512_cvtepu8_epi32(_mm_loadu_si128(
                (const __m128i *)(w->zeros + (g * block_count(w->k, w->block)
                                              + s / (w->block / 32)) * 16))));
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512(at + 64 * j);
            _mm512_store_si512(out + 128 * j, _mm512_sub_epi8(_mm512_and_si512(packed, low4), zero));
            _mm512_store_si512(out + 128 * j + 64, _mm512_sub_epi8(
                _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), zero));
        }
    } else {
        /* code - 8 of a nibble is the nibble with bit 3 flipped, sign-extended: an affine map
           of bits over GF(2), one instruction per nibble */
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512(at + 64 * j);
            _mm512_store_si512(out + 128 * j, _mm512_gf2p8affine_epi64_epi8(
                packed, _mm512_set1_epi64(0x0102040808080808), 0xF8));
            _mm512_store_si512(out + 128 * j + 64, _mm512_gf2p8affine_epi64_epi8(
                packed, _mm512_set1_epi64(0x1020408080808080), 0xF8));
        }
    }
}

/* acc[i] += block b's dots of rows t0 + i (sums: the tile's C) as gemm_tile adds them.
   act_scales, inputs: the block's entries of rows t0 .. t0 + 7 and, 8 * blocks further, of
   t0 + 8 .. t0 + 15 (QActivations' tiles of eight). */
static inline __attribute__((always_inline)) void amx_add_block(
        const float *row_scales, const float *offsets, const float *act_scales,
        const float *inputs, int64_t next_tile, const int rows, const int32_t *sums,
        __m512 *acc) {
    const __m512 scales = _mm512_loadu_ps(row_scales);
    for (int i = 0; i < rows; i++) {
        const int64_t at = i < TOKEN_TILE ? i : next_tile + i - TOKEN_TILE;
        __m512i dot = _mm512_load_si512(sums + 16 * i);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                 _mm512_mul_ps(scales, _mm512_set1_ps(act_scales[at])), acc[i]);
        if (offsets)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(offsets), _mm512_set1_ps(inputs[at]),
                                     acc[i]);
    }
}

/* Block b of rows `act` (`stride` bytes apart) alone, its dots to `sums` through tile 0: the
   last of an odd count in amx_tile. Its code vectors from `vectors`, or unpacked to `ring`. */
static inline __attribute__((always_inline)) void amx_lone_block(
        const QMatrix *w, int64_t g, int b, const int8_t *act, int64_t stride,
        const int8_t *vectors, int8_t *ring, int32_t *sums) {
    if (!vectors) amx_unpack_slice(w, g, b, ring);
    _tile_zero(0);
    _tile_loadd(4, act + b * 32, stride);
    _tile_loadd(6, vectors ? vectors + b * 512 : ring, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_stored(0, sums, 64);
}

/* Blocks of 32: rows t0 .. t0 + rows - 1 times row group g (signed code vectors `vectors`,
   or NULL: each pair unpacked as it comes, for a group that one tile of rows reads once).
   Blocks go in pairs, software-pipelined: while one pair's sums are read (from tiles 0, 1
   or 2, 3), the next pair multiplies into the other two; tiles 4, 5 hold a pair's
   activation codes, 6, 7 its code vectors. */
static inline __attribute__((always_inline)) void amx_tile(
        const QMatrix *w, const QActivations *a, int t0, const int rows, const int has_offsets,
        int64_t g, const int8_t *vectors, float *y) {
    const int blocks = w->k / 32, pairs = blocks / 2;
    const int64_t stride = w->k, next_tile = (int64_t)blocks * TOKEN_TILE;
    const int8_t *act = a->rows + (int64_t)t0 * stride;
    const float *row_scales = w->scales + g * blocks * 16;
    const float *offsets = has_offsets ? w->offsets + g * blocks * 16 : NULL;
    const float *act_scales = a->scales + tile_at(t0, blocks, 0);
    const float *inputs = a->inputs + tile_at(t0, blocks, 0);
    int32_t sums[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    int8_t ring[2][1024] __attribute__((aligned(64)));  /* a pair's code vectors, unpacked */
    __m512 acc[AMX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
#define MULTIPLY(c0, c1, b) do { \
        const int8_t *pair = vectors ? vectors + (b) * 512 : ring[(b) / 2 % 2]; \
        if (!vectors) { \
            amx_unpack_slice(w, g, (b), ring[(b) / 2 % 2]); \
            amx_unpack_slice(w, g, (b) + 1, ring[(b) / 2 % 2] + 512); \
        } \
        _tile_zero(c0); \
        _tile_loadd(4, act + (b) * 32, stride); \
        _tile_loadd(6, pair, 64); \
        _tile_dpbssd(c0, 4, 6); \
        _tile_zero(c1); \
        _tile_loadd(5, act + (b) * 32 + 32, stride); \
        _tile_loadd(7, pair + 512, 64); \
        _tile_dpbssd(c1, 5, 7); \
    } while (0)
#define ADD_BLOCK(b, set) \
    amx_add_block(row_scales + (b) * 16, has_offsets ? offsets + (b) * 16 : NULL, \
                  act_scales + (b) * TOKEN_TILE, inputs + (b) * TOKEN_TILE, next_tile, rows, \
                  sums[set], acc)
    if (pairs > 0) MULTIPLY(0, 1, 0);
    for (int p = 0; p < pairs; p++) {
        const int b = 2 * p;
        if (p % 2 == 0) {
            if (p + 1 < pairs) MULTIPLY(2, 3, b + 2);
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
        } else {
            if (p + 1 < pairs) MULTIPLY(0, 1, b + 2);
            _tile_stored(2, sums[0], 64);
            _tile_stored(3, sums[1], 64);
        }
        ADD_BLOCK(b, 0);
        ADD_BLOCK(b + 1, 1);
    }
    if (blocks % 2) {
        amx_lone_block(w, g, blocks - 1, act, stride, vectors, ring[0], sums[0]);
        ADD_BLOCK(blocks - 1, 0);
    }
#undef MULTIPLY
#undef ADD_BLOCK
    store_tile_rows(w, t0, rows, g, group_lanes(w, g), acc, y);
}

/* amx_tile for blocks of 64 or 128 (K a multiple of 64): rows t0 .. t0 + rows - 1 times
   row group g, 128 columns a step: two multiplies of 64 columns (one at the end of a
   shorter K). A step is one block of 128, whose two multiplies add into one tile of sums
   (integers: exact), or two blocks of 64, each into its own tile. (Two tiles for a block
   of 128, added in vectors, would cost a tile store and sixteen adds more per block.)
   Software-pipelined as amx_tile: while one step's sums are read (from tiles 0, 1 or
   2, 3), the next step multiplies into the other two; tiles 4, 6 and 5, 7 hold each
   multiply's activation codes and code vectors. */
static inline __attribute__((always_inline)) void amx_tile_wide(
        const QMatrix *w, const QActivations *a, int t0, const int rows, int64_t g,
        const int8_t *vectors, float *y) {
    const int slices = w->k / 32, steps = (slices + 3) / 4, wide_blocks = w->block == 128;
    const int blocks = block_count(w->k, w->block);
    const int64_t stride = w->k, next_tile = (int64_t)blocks * TOKEN_TILE;
    const int8_t *act = a->rows + (int64_t)t0 * stride;
    const float *row_scales = w->scales + g * blocks * 16;
    const float *act_scales = a->scales + tile_at(t0, blocks, 0);
    int32_t sums[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    int8_t ring[2][4 * 512] __attribute__((aligned(64)));  /* a step's code vectors */
    __m512 acc[AMX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
#define MULTIPLY(c0, c1, st) do { \
        const int first = 4 * (st), count = slices - first < 4 ? slices - first : 4; \
        const int8_t *step = vectors ? vectors + (int64_t)first * 512 : ring[(st) % 2]; \
        if (!vectors) \
            for (int s = 0; s < count; s++) \
                amx_unpack_slice(w, g, first + s, ring[(st) % 2] + s * 512); \
        _tile_zero(c0); \
        _tile_loadd(4, act + first * 32, stride); \
        _tile_loadd(6, step, 64); \
        _tile_dpbssd(c0, 4, 6); \
        if (count > 2) { \
            if (!wide_blocks) _tile_zero(c1); \
            _tile_loadd(5, act + first * 32 + 64, stride); \
            _tile_loadd(7, step + 1024, 64); \
            if (wide_blocks) _tile_dpbssd(c0, 5, 7); else _tile_dpbssd(c1, 5, 7); \
        } \
    } while (0)
    if (steps > 0) MULTIPLY(0, 1, 0);
    for (int st = 0; st < steps; st++) {
        const int second = 4 * st + 2 < slices;  /* the step's second multiply ran */
        if (st % 2 == 0) {
            if (st + 1 < steps) MULTIPLY(2, 3, st + 1);
            _tile_stored(0, sums[0], 64);
            if (second && !wide_blocks) _tile_stored(1, sums[1], 64);
        } else {
            if (st + 1 < steps) MULTIPLY(0, 1, st + 1);
            _tile_stored(2, sums[0], 64);
            if (second && !wide_blocks) _tile_stored(3, sums[1], 64);
        }
        if (wide_blocks) {
            amx_add_block(row_scales + st * 16, NULL, act_scales + st * TOKEN_TILE, NULL,
                          next_tile, rows, sums[0], acc);
        } else {
            for (int half = 0; half <= second; half++) {
                const int b = 2 * st + half;
                amx_add_block(row_scales + b * 16, NULL, act_scales + b * TOKEN_TILE, NULL,
                              next_tile, rows, sums[half], acc);
            }
        }
    }
#undef MULTIPLY
    store_tile_rows(w, t0, rows, g, group_lanes(w, g), acc, y);
}

/* gemm_groups on AMX tiles: per row chunk and group, the group's code vectors unpacked once
   for all its tiles of rows (as they come where there is one tile). */
static int gemm_groups_amx(const QMatrix *w, const QActivations *a, int t_rows, float *y,
                           int64_t lo, int64_t hi) {
    const int slices = w->k / 32, wide = w->block > 32;
    int8_t *unpacked = t_rows > AMX_ROWS ? aligned_alloc(64, (size_t)slices * 512) : NULL;
    if (t_rows > AMX_ROWS && !unpacked) return -1;
    amx_configure(wide);
    for (int c0 = 0; c0 < t_rows; c0 += ROW_CHUNK) {
        const int t1 = t_rows - c0 < ROW_CHUNK ? t_rows : c0 + ROW_CHUNK;
        for (int64_t g = lo; g < hi; g++) {
            if (unpacked)
                for (int s = 0; s < slices; s++) amx_unpack_slice(w, g, s, unpacked + s * 512);
            for (int t0 = c0; t0 < t1; t0 += AMX_ROWS) {
                const int rows = t1 - t0 < AMX_ROWS ? t1 - t0 : AMX_ROWS;
                if (wide && rows == AMX_ROWS)
                    amx_tile_wide(w, a, t0, AMX_ROWS, g, unpacked, y);
                else if (wide)
                    amx_tile_wide(w, a, t0, rows, g, unpacked, y);
                else if (rows == AMX_ROWS && !w->offsets)
                    amx_tile(w, a, t0, AMX_ROWS, 0, g, unpacked, y);
                else
                    amx_tile(w, a, t0, rows, w->offsets != NULL, g, unpacked, y);
            }
        }
    }
    _tile_release();
    free(unpacked);
    return 0;
}
#pragma GCC pop_options

/* Whether w times t_rows activation rows runs on AMX tiles (QActivations.rows): not 8-bit
   codes with zero points, whose code - zero does not fit a signed byte, nor wide blocks
   with a last one of 32 columns (a tile multiply takes 64). */
static inline int amx_takes(const Knobs *knobs, const QMatrix *w, int t_rows) {
    return knobs->amx && t_rows >= knobs->amx_min_rows && !(w->bits == 8 && w->zeros) && !w->lut
        && (w->block == 32 || w->k % 64 == 0);
}

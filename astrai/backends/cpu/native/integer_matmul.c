/* Integer matmul (W4A8, W8A8) of many rows (a prompt) by an int4 or int8 weight: y = x W^T
 * (+ bias) for W in GGUF's Q4_0, Q4_1 or (with VNNI) Q8_0 blocks (dequant_matmul.c's
 * ASTRAI_Q4 / ASTRAI_Q41 / ASTRAI_Q8 layout, or Q4_0 or Q8_0 with eight rows interleaved:
 * ASTRAI_Q4X8, ASTRAI_Q8X8) and x fp32 [rows][n_in].
 *
 * Widening the nibbles to floats for an fp32 GEMM (as dense_rows.c does for bf16 and
 * int8) leaves the prompt's matmuls at the speed of fp32 multiply-adds: 8 per instruction. Multiplying the nibbles by
 * int8 activations with maddubs makes 32 per instruction, so here x is first rounded to Q8_0
 * blocks, exactly as the int4 matmuls of a decode step (and QuantizedLinear's forward) round
 * it, and each block's dot product is summed in integers.
 *
 * What keeps the integer work from drowning in conversions is the layout. Each thread takes
 * eight weight rows at a time and unpacks their nibbles into bytes, interleaved four inputs
 * at a time: 32 bytes hold inputs 4k..4k+3 of the eight rows. One maddubs against those four
 * inputs of x (broadcast) then gives, in its eight 32-bit lanes after the pair sums, partial
 * dot products of the eight rows: the eight outputs land in the eight lanes, so a block ends
 * in one conversion and two multiply-adds for eight outputs, and no horizontal sums remain.
 * The eight groups of four of a block add in 16 bits (at most 8 x 2 x 15 x 127 = 30,480, no
 * overflow) before being widened once; with AVX512-VNNI one vpdpbusd adds each four's products
 * straight into the 32-bit lanes instead, the same integers in half the instructions.
 *
 * Per block b of a row of x (d_x its fp16-rounded step, s its sum of int8 values) and a weight
 * row (d its step; Q4_0 values u - 8, Q4_1 values u d + m), the block adds
 *     Q4_0:  d d_x (sum u q) - 8 d (d_x s)      Q4_1:  d d_x (sum u q) + m (d_x s)
 * the same numbers as the float matmul of the rounded x and the dequantized weight, summed in
 * another order. A block of x holding an infinity or a NaN has a NaN step, so its outputs are
 * NaN, as the reference's are. The unpacked rows (8 x padded n_in bytes a group, and their
 * steps) stay in the thread's cache while every row of x passes over them: for a prompt two
 * groups at a time, three rows of x a pass, so that each broadcast of x feeds two maddubs;
 * for a few rows (a decode batch) one group, four rows a pass. With AVX-512 and VNNI the two
 * groups share a 512-bit register, six rows of x a pass, one vpdpbusd for sixteen weight rows:
 * a core with 512-bit datapaths (Zen 5) does twice the products per instruction.
 * Without AVX2, or built with ASTRAI_PORTABLE, plain C loops compute the same sums.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if (defined(__AVX2__) && defined(__FMA__)) && !defined(ASTRAI_PORTABLE)
#define ROWS_AVX2 1
#include <immintrin.h>
#else
#define ROWS_AVX2 0
#endif
#if ROWS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ROWS_VNNI 1
#else
#define ROWS_VNNI 0
#endif
#if ROWS_VNNI && defined(__AVX512F__) && defined(__AVX512BW__)
#define ROWS_ZMM 1  /* a pair of groups in one 512-bit register: sixteen rows' sums per vpdpbusd */
#else
#define ROWS_ZMM 0
#endif

enum { Q_BLOCK = 32, GROUP = 8, ROW_TILE = 4, ZMM_TILE = 6, PAIR_MIN_ROWS = 24, TYPE_Q8 = 2, TYPE_Q4 = 3, TYPE_Q41 = 4,
       TYPE_Q4X8 = 5, TYPE_Q8X8 = 6 };

static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* dequant_matmul.c's rounding of x to Q8_0 blocks and its fp16 conversion */
void astrai_quantize_rows_q8(const float *x, int64_t x_stride, int64_t rows, int64_t n_in, int8_t *values,
                             float *steps, float *sums);
float astrai_half_value(uint16_t h);

static inline float half_value(uint16_t h)
{
#if defined(__F16C__) && !defined(ASTRAI_PORTABLE)
    return _cvtsh_ss(h);
#else
    return astrai_half_value(h);
#endif
}

/* Eight weight rows from `first` (rows past n_out are zero) unpacked for the products:
 * `bytes` [blocks][8 fours][8 rows][4], `steps` [blocks][8] (d) and `extras` [blocks][8]
 * (what d_x s multiplies: -8 d for Q4_0, m for Q4_1, -128 d for Q8_0, whose signed values
 * are stored as w + 128 to be the unsigned operand). With AVX2 each block of the eight rows
 * is eight registers of bytes in element order, transposed as an 8 x 8 matrix of fours. */
static void unpack_group(const uint8_t *w, int64_t ld, const uint16_t *scales, int64_t scale_ld, int type,
                         int64_t first, int64_t n_out, int64_t blocks, uint8_t *bytes, float *steps, float *extras)
{
    if (type == TYPE_Q8X8 || type == TYPE_Q4X8) {  /* already four inputs of the eight rows per 32 bytes */
        const uint8_t *group = w + first * ld;
        const uint16_t *group_scales = scales + first * scale_ld;  /* block by block, the eight rows' */
        for (int64_t i = 0; i < blocks * GROUP; ++i) {
            steps[i] = half_value(group_scales[i]);
            extras[i] = (type == TYPE_Q8X8 ? -128.0f : -8.0f) * steps[i];
        }
        if (type == TYPE_Q8X8) {  /* stored as w + 128: copied into the aligned buffer as they are */
            memcpy(bytes, group, (size_t)(blocks * GROUP * Q_BLOCK));
            return;
        }
        for (int64_t b = 0; b < blocks; ++b) {  /* Q4_0: only the nibbles to split */
            const uint8_t *in = group + b * GROUP * Q_BLOCK / 2;
            uint8_t *out = bytes + b * GROUP * Q_BLOCK;
            for (int k = 0; k < 4; ++k)
                for (int i = 0; i < 32; ++i) {
                    out[32 * k + i] = in[32 * k + i] & 0x0f;
                    out[32 * (k + 4) + i] = in[32 * k + i] >> 4;
                }
        }
        return;
    }
    const int live = n_out - first < GROUP ? (int)(n_out - first) : GROUP;
    for (int c = 0; c < GROUP; ++c) {
        const uint16_t *row = scales + (first + c) * scale_ld;
        for (int64_t b = 0; b < blocks; ++b) {
            const float d = c < live ? half_value(row[b]) : 0.0f;
            steps[b * GROUP + c] = d;
            extras[b * GROUP + c] = c >= live ? 0.0f : type == TYPE_Q41 ? half_value(row[blocks + b])
                                                      : type == TYPE_Q8 ? -128.0f * d : -8.0f * d;
        }
    }
    for (int64_t b = 0; b < blocks; ++b) {
        uint8_t *out = bytes + b * GROUP * Q_BLOCK;
#if ROWS_AVX2
        __m256i r[GROUP];
        for (int c = 0; c < GROUP; ++c) {
            if (c >= live) { r[c] = _mm256_setzero_si256(); continue; }
            if (type == TYPE_Q8) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + (first + c) * ld + b * Q_BLOCK));
                r[c] = _mm256_xor_si256(raw, _mm256_set1_epi8((char)0x80));
                continue;
            }
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + (first + c) * ld + b * (Q_BLOCK / 2)));
            const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
            r[c] = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
        }
        __m256i t[GROUP], u[GROUP];
        for (int c = 0; c < GROUP; c += 2) {
            t[c] = _mm256_unpacklo_epi32(r[c], r[c + 1]);
            t[c + 1] = _mm256_unpackhi_epi32(r[c], r[c + 1]);
        }
        for (int c = 0; c < GROUP; c += 4) {
            u[c] = _mm256_unpacklo_epi64(t[c], t[c + 2]);
            u[c + 1] = _mm256_unpackhi_epi64(t[c], t[c + 2]);
            u[c + 2] = _mm256_unpacklo_epi64(t[c + 1], t[c + 3]);
            u[c + 3] = _mm256_unpackhi_epi64(t[c + 1], t[c + 3]);
        }
        for (int k = 0; k < 4; ++k) {
            _mm256_store_si256((__m256i *)out + k, _mm256_permute2x128_si256(u[k], u[k + 4], 0x20));
            _mm256_store_si256((__m256i *)out + k + 4, _mm256_permute2x128_si256(u[k], u[k + 4], 0x31));
        }
#else
        for (int c = 0; c < GROUP; ++c) {
            if (type == TYPE_Q8) {
                const uint8_t *block = w + (first + c) * ld + b * Q_BLOCK;
                for (int k = 0; k < Q_BLOCK; ++k) out[(k / 4) * GROUP * 4 + 4 * c + k % 4] = c < live ? block[k] ^ 0x80 : 0;
                continue;
            }
            const uint8_t *block = w + (first + c) * ld + b * (Q_BLOCK / 2);
            for (int k = 0; k < Q_BLOCK / 2; ++k) {
                const int low = k, high = k + Q_BLOCK / 2;
                out[(low / 4) * GROUP * 4 + 4 * c + low % 4] = c < live ? block[k] & 0x0f : 0;
                out[(high / 4) * GROUP * 4 + 4 * c + high % 4] = c < live ? block[k] >> 4 : 0;
            }
        }
#endif
    }
}

#if ROWS_AVX2
/* out[r][g] = rows r < count of the quantized x against unpacked group g < pair (`pair` and
 * `count` literals at each call: the compiler keeps the sums of each copy in registers). */
static inline __attribute__((always_inline)) void group_tile(const uint8_t *bytes, const float *steps,
                                                             const float *extras, int64_t group_stride,
                                                             const int8_t *xq, const float *xd, const float *xs,
                                                             int64_t blocks, int pair, int count,
                                                             __m256 out[ROW_TILE][2])
{
#if !ROWS_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[ROW_TILE][2];
    for (int r = 0; r < count; ++r)
        for (int g = 0; g < pair; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i *w = (const __m256i *)(bytes + b * GROUP * Q_BLOCK);
        __m256i pairs[ROW_TILE][2];
        for (int r = 0; r < count; ++r)
            for (int g = 0; g < pair; ++g) pairs[r][g] = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int k = 0; k < GROUP; ++k) {
            __m256i u[2];
            for (int g = 0; g < pair; ++g) u[g] = _mm256_load_si256(w + g * group_stride / 32 + k);
            for (int r = 0; r < count; ++r) {
                int32_t four;
                memcpy(&four, xq + r * blocks * Q_BLOCK + b * Q_BLOCK + 4 * k, sizeof four);
                const __m256i x = _mm256_set1_epi32(four);
                for (int g = 0; g < pair; ++g)
#if ROWS_VNNI
                    pairs[r][g] = _mm256_dpbusd_epi32(pairs[r][g], u[g], x);  /* the fours straight into 32 bits */
#else
                    pairs[r][g] = _mm256_add_epi16(pairs[r][g], _mm256_maddubs_epi16(u[g], x));
#endif
            }
        }
        for (int r = 0; r < count; ++r) {
            const __m256 step = _mm256_set1_ps(xd[r * blocks + b]), sum = _mm256_set1_ps(xs[r * blocks + b]);
            for (int g = 0; g < pair; ++g) {
                const float *gs = steps + g * group_stride / Q_BLOCK, *ge = extras + g * group_stride / Q_BLOCK;
#if ROWS_VNNI
                const __m256 sums = _mm256_cvtepi32_ps(pairs[r][g]);
#else
                const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r][g], ones));
#endif
                acc[r][g] = _mm256_fmadd_ps(_mm256_load_ps(gs + b * GROUP), _mm256_mul_ps(sums, step),
                                            _mm256_fmadd_ps(_mm256_load_ps(ge + b * GROUP), sum, acc[r][g]));
            }
        }
    }
    for (int r = 0; r < count; ++r)
        for (int g = 0; g < pair; ++g) out[r][g] = acc[r][g];
}
#endif

#if ROWS_ZMM
/* group_tile for a pair of groups, the two in the halves of one 512-bit register: each
 * broadcast four of x meets sixteen weight rows in one vpdpbusd, and the 32 registers hold
 * the sums of ZMM_TILE rows. Lane for lane the same integers and the same float operations in
 * the same order as group_tile's, so the outputs are its own bit for bit. out[r] holds group
 * 0's eight outputs, then group 1's. */
static inline __attribute__((always_inline)) void pair_tile(const uint8_t *bytes, const float *steps,
                                                            const float *extras, int64_t group_stride,
                                                            const int8_t *xq, const float *xd, const float *xs,
                                                            int64_t blocks, int count, __m512 out[ZMM_TILE])
{
    const float *steps1 = steps + group_stride / Q_BLOCK, *extras1 = extras + group_stride / Q_BLOCK;
    __m512 acc[ZMM_TILE];
    for (int r = 0; r < count; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i *w0 = (const __m256i *)(bytes + b * GROUP * Q_BLOCK);
        const __m256i *w1 = (const __m256i *)(bytes + group_stride + b * GROUP * Q_BLOCK);
        __m512i sums[ZMM_TILE];
        for (int r = 0; r < count; ++r) sums[r] = _mm512_setzero_si512();
        #pragma GCC unroll 2
        for (int k = 0; k < GROUP; ++k) {
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256(w0 + k)),
                                                 _mm256_load_si256(w1 + k), 1);
            for (int r = 0; r < count; ++r) {
                int32_t four;
                memcpy(&four, xq + r * blocks * Q_BLOCK + b * Q_BLOCK + 4 * k, sizeof four);
                sums[r] = _mm512_dpbusd_epi32(sums[r], u, _mm512_set1_epi32(four));
            }
        }
        const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(steps + b * GROUP)),
                                            _mm256_load_ps(steps1 + b * GROUP), 1);
        const __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(extras + b * GROUP)),
                                            _mm256_load_ps(extras1 + b * GROUP), 1);
        for (int r = 0; r < count; ++r)
            acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(xd[r * blocks + b])),
                                     _mm512_fmadd_ps(e, _mm512_set1_ps(xs[r * blocks + b]), acc[r]));
    }
    for (int r = 0; r < count; ++r) out[r] = acc[r];
}
#endif

/* y[r][first..first + 8 pair) (those below n_out) for every row r of the quantized x: `pair`
 * (1 or 2) groups unpacked `group_stride` bytes apart (their steps and extras group_stride / 32
 * floats apart). */
static void group_rows(const uint8_t *bytes, const float *steps, const float *extras, int64_t group_stride, int pair,
                       const int8_t *xq, const float *xd, const float *xs, int64_t rows, int64_t blocks,
                       const float *bias, float *y, int64_t y_stride, int64_t first, int64_t n_out)
{
    /* rows a pass: the sums fill the registers */
    const int tile = pair == 2 ? (ROWS_ZMM ? ZMM_TILE : ROW_TILE - 1) : ROW_TILE;
    float lanes[ZMM_TILE][2][GROUP] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int count = rows - r0 < tile ? (int)(rows - r0) : tile;
        const int8_t *q = xq + r0 * blocks * Q_BLOCK;
        const float *d = xd + r0 * blocks, *s = xs + r0 * blocks;
#if ROWS_ZMM
        if (pair == 2) {
            __m512 wide[ZMM_TILE];
            if (count == ZMM_TILE)
                pair_tile(bytes, steps, extras, group_stride, q, d, s, blocks, ZMM_TILE, wide);
            else
                pair_tile(bytes, steps, extras, group_stride, q, d, s, blocks, count, wide);
            for (int r = 0; r < count; ++r) _mm512_store_ps(lanes[r][0], wide[r]);
        } else
#endif
#if ROWS_AVX2
        {
        __m256 out[ROW_TILE][2];
        if (pair == 2 && count == ROW_TILE - 1)
            group_tile(bytes, steps, extras, group_stride, q, d, s, blocks, 2, ROW_TILE - 1, out);
        else if (pair == 1 && count == ROW_TILE)
            group_tile(bytes, steps, extras, group_stride, q, d, s, blocks, 1, ROW_TILE, out);
        else
            group_tile(bytes, steps, extras, group_stride, q, d, s, blocks, pair, count, out);
        for (int r = 0; r < count; ++r)
            for (int g = 0; g < pair; ++g) _mm256_store_ps(lanes[r][g], out[r][g]);
        }
#else
        for (int r = 0; r < count; ++r)
            for (int g = 0; g < pair; ++g)
                for (int c = 0; c < GROUP; ++c) {
                    const uint8_t *gb = bytes + g * group_stride;
                    const float *gs = steps + g * group_stride / Q_BLOCK, *ge = extras + g * group_stride / Q_BLOCK;
                    float total = 0.0f;
                    for (int64_t b = 0; b < blocks; ++b) {
                        const uint8_t *u = gb + b * GROUP * Q_BLOCK + 4 * c;
                        const int8_t *x = q + r * blocks * Q_BLOCK + b * Q_BLOCK;
                        int32_t dot = 0;
                        for (int k = 0; k < Q_BLOCK; ++k) dot += u[(k / 4) * GROUP * 4 + k % 4] * x[k];
                        total += gs[b * GROUP + c] * ((float)dot * d[r * blocks + b]) + ge[b * GROUP + c] * s[r * blocks + b];
                    }
                    lanes[r][g][c] = total;
                }
#endif
        for (int r = 0; r < count; ++r)
            for (int g = 0; g < pair; ++g)
                for (int c = 0; c < GROUP && first + g * GROUP + c < n_out; ++c) {
                    const int64_t j = first + g * GROUP + c;
                    y[(r0 + r) * y_stride + j] = lanes[r][g][c] + (bias ? bias[j] : 0.0f);
                }
    }
}

/* y [rows][y_stride] = x [rows][x_stride] W^T (+ bias) for an int4 or int8 weight W [n_out][n_in]
 * (type 3: Q4_0, 4: Q4_1, 2: Q8_0, 5 and 6: Q4_0 and Q8_0 interleaved, whose n_out is a multiple
 * of 8; `ld` bytes and `scale_ld` fp16 values between two rows), shared among `threads`.
 * Q8_0 (either layout) only with VNNI: its unsigned w + 128 against int8 x would
 * overflow maddubs' 16-bit pair sums. Returns 0, -1 for another type (or Q8_0 without VNNI),
 * -2 when memory ran out. */
int64_t astrai_integer_matmul(const float *x, int64_t rows, int64_t x_stride, const uint8_t *weight, int64_t ld,
                              const uint16_t *scales, int64_t scale_ld, int type, const float *bias, float *y,
                              int64_t y_stride, int64_t n_in, int64_t n_out, int threads)
{
    if (type != TYPE_Q4 && type != TYPE_Q41 && type != TYPE_Q4X8
        && !((type == TYPE_Q8 || type == TYPE_Q8X8) && ROWS_VNNI)) return -1;
    if ((type == TYPE_Q4X8 || type == TYPE_Q8X8) && n_out % GROUP) return -1;
    if (rows <= 0 || n_out <= 0) return 0;
    const int64_t blocks = (n_in + Q_BLOCK - 1) / Q_BLOCK;
    int8_t *xq = aligned((size_t)(rows * blocks * Q_BLOCK));
    float *xd = malloc(sizeof(float) * (size_t)(rows * blocks + 1)), *xs = malloc(sizeof(float) * (size_t)(rows * blocks + 1));
    int failed = xq == NULL || xd == NULL || xs == NULL;
    if (!failed) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            astrai_quantize_rows_q8(x + r * x_stride, x_stride, 1, n_in, xq + r * blocks * Q_BLOCK, xd + r * blocks,
                                    xs + r * blocks);
        const int64_t groups = (n_out + GROUP - 1) / GROUP, stride = blocks * GROUP * Q_BLOCK;
        /* a prompt takes two groups at a time (each row of x, once loaded, meets sixteen weight
         * rows); a few rows take one, four rows a pass, which leaves fewer rows over */
        const int per = rows > PAIR_MIN_ROWS ? 2 : 1;
        #pragma omp parallel num_threads(threads)
        {
            uint8_t *bytes = aligned((size_t)(2 * stride));
            float *steps = aligned(sizeof(float) * (size_t)(2 * blocks * GROUP));
            float *extras = aligned(sizeof(float) * (size_t)(2 * blocks * GROUP));
            if (bytes == NULL || steps == NULL || extras == NULL) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < (groups + per - 1) / per; ++p) {
                if (bytes == NULL || steps == NULL || extras == NULL) continue;
                const int pair = groups - per * p < per ? 1 : per;
                for (int g = 0; g < pair; ++g)
                    unpack_group(weight, ld, scales, scale_ld, type, (per * p + g) * GROUP, n_out, blocks,
                                 bytes + g * stride, steps + g * blocks * GROUP, extras + g * blocks * GROUP);
                group_rows(bytes, steps, extras, stride, pair, xq, xd, xs, rows, blocks, bias, y, y_stride,
                           per * p * GROUP, n_out);
            }
            free(bytes), free(steps), free(extras);
        }
    }
    free(xq), free(xd), free(xs);
    return failed ? -2 : 0;
}

/* Weight-only dequantizing matmul of a few rows by a weight stored in a smaller type
 * (bf16; W8A8 for int8, W4A8 for int4): y[r] = x[r] W^T (+ bias) for
 * r < rows (1 to ASTRAI_MAX_DEQUANT_ROWS), x fp32, W [out][in] in one of
 *
 *   ASTRAI_BF16  bfloat16, `ld` elements between rows;
 *   ASTRAI_Q8    blocks of 32 int8 along the input with one fp16 scale each (GGUF's Q8_0):
 *                w[o][i] = q[o][i] * scale[o][i / 32], `ld` bytes between rows;
 *   ASTRAI_Q4    blocks of 32 4-bit values in 16 bytes (GGUF's Q4_0): byte j of block b holds
 *                element 32 b + j in its low nibble and 32 b + 16 + j in its high one,
 *                w[o][i] = (nibble - 8) * scale[o][i / 32], `ld` bytes between rows;
 *   ASTRAI_Q41   the same nibbles with a step d and a minimum m per block (GGUF's Q4_1):
 *                w[o][i] = nibble * d[o][i / 32] + m[o][i / 32], the row's d's then its m's
 *                in its scales;
 *   ASTRAI_Q4X8  Q4_0 with eight rows interleaved (llama.cpp's Q4_0x8 repack; interleaved.py
 *                lays it out): for each group of eight rows, in `8 ld` bytes (ld = 16 x blocks),
 *                block b's 128 bytes hold in their k-th 32 (k < 4) bytes 4k..4k+3 of each
 *                row's block in turn, and the group's scales, `8 scale_ld` values from the
 *                group's first, lie block by block, eight rows each;
 *   ASTRAI_Q8X8  Q8_0 interleaved the same way, each byte stored as w + 128 (w ^ 0x80) so that it
 *                is vpdpbusd's unsigned operand: block b's 256 bytes of a group hold in their
 *                k-th 32 (k < 8) bytes 4k..4k+3 of each row's block in turn (ld = 32 x blocks);
 *   ASTRAI_F32   fp32, `ld` elements between rows (one row goes to row_matmul.c's kernel;
 *                several, a speculative step's drafted tokens, are summed here, each in the
 *                order that kernel adds: f32_dot.h);
 *
 * (astrai/model/quantized.py's layout; the scales are `scale_ld` fp16 values apart per row).
 * The weight is the decode step's whole cost, so it is read once for all rows. bf16 multiplies
 * the activations rounded to bf16 (W16A16, as llama.cpp's BF16 matmuls and bf16_matmul.c's
 * prompt rows do), each thread rounding x for itself: every product of two bf16 values is exact
 * in fp32, so the result is F.linear over the rounded x and the weight but for the order of the
 * additions (with AVX512-BF16, vdpbf16ps adds two products to each of sixteen lanes, and
 * flushes subnormal values to zero); a last partial block reads only its first n_in % 32 elements.
 *
 * int8 and int4 multiply in integers, as llama.cpp does: widening every weight to a float
 * costs more than reading it, so a float sum would be bound by arithmetic, not memory (and
 * each more row of a speculative step would cost a full float multiply-add per weight). Each
 * row of x is first quantized in blocks of 32 as quantized.py's `quantize_activations` does
 * (Q8_0: d = max|x| * (1/127) in fp32, q = x / d rounded to even, the fp16-rounded d kept),
 * each block's dot product is then a sum of int8 x int8 or int4 x int8 products in integers,
 * and each block adds d_w d_x times it. The result is F.linear over the quantized activations
 * and the dequantized weight (what QuantizedLinear's forward computes) but for the order of
 * the float additions; blocks are whole, the padding past n_in being 0 on both sides.
 * The int4 vector loop multiplies the stored nibbles u = w + 8 as they are, unsigned, and takes
 * 8 q off the integer sums (sum (u - 8) q = sum u q - 8 sum q, the second sum made once per
 * call with the activations, in the same eight lanes): no per-block sign juggling, and the
 * weight scales are widened and multiplied eight blocks at a time. It takes two blocks per
 * 32-byte load of nibbles (one mask gives both blocks' low halves, a shift and a mask their
 * high halves), the activations rearranged once per call to match (pair_blocks), which halves
 * the unpacking and the integer work per weight; every row count runs this same loop, so a
 * row's sums do not depend on how many rows share the call. Q4_1 blocks take the same centred
 * sums with the minimum moved to the block's middle (m + 8 d), which keeps every float term
 * the size of the result instead of two large ones that cancel. int8 weights are signed:
 * their magnitudes multiply the activations carrying the weights' signs.
 *
 * As row_matmul.c, each thread takes a contiguous stretch of the outputs, so each reads one
 * stream (two: values and scales) front to back, prefetched non-temporally ahead; with one row
 * of x (bf16: one or two), the vector paths read it as two to four streams side by side
 * (weight_streams, team_x8), one stream leaving a core short of the memory's pace. With AVX2
 * and FMA (x86-64 builds for a CPU that has them), blocks are multiplied (bf16: widened to
 * fp32) in registers by intrinsics, and with AVX512-VNNI each four int8 products are summed
 * by one vpdpbusd (the same integers as maddubs gives); otherwise, or built with
 * ASTRAI_PORTABLE, the same sums run as plain C loops, one row of x at a time in a function of
 * its own whose float additions keep their source order. Every path gives a row of x the
 * same numbers whatever rows share the call, which greedy speculative decoding relies on.
 * fp16 scales are converted by F16C where the CPU has it, else by their bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "f32_dot.h"

#if (defined(__AVX2__) && defined(__FMA__)) && !defined(ASTRAI_PORTABLE)
#define DEQUANT_AVX2 1
#include <immintrin.h>
#else
#define DEQUANT_AVX2 0
#endif
#if DEQUANT_AVX2 && defined(__AVX512F__)
#define DEQUANT_AVX512 1
#else
#define DEQUANT_AVX512 0
#endif
#if DEQUANT_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DEQUANT_VNNI 1  /* vpdpbusd on 256-bit registers: four u8 x s8 products summed into each int32 lane */
#else
#define DEQUANT_VNNI 0
#endif
#if DEQUANT_AVX512 && defined(__AVX512BF16__)
#define BF16_PRODUCTS 1  /* vdpbf16ps: two bf16 x bf16 products added to each fp32 lane */
#else
#define BF16_PRODUCTS 0
#endif

enum { ASTRAI_F32 = 0, ASTRAI_BF16 = 1, ASTRAI_Q8 = 2, ASTRAI_Q4 = 3, ASTRAI_Q41 = 4, ASTRAI_Q4X8 = 5,
       ASTRAI_Q8X8 = 6 };
enum { ASTRAI_MAX_DEQUANT_ROWS = 8, BLOCK = 32, AHEAD_BYTES = 1024, MAX_TEAM = 256, MAX_STREAMS = 4 };

static inline float half_to_float(uint16_t h)
{
#if defined(__F16C__) && !defined(ASTRAI_PORTABLE)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  /* inf, NaN */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {  /* subnormal: mantissa * 2^-24 exactly */
        union { uint32_t i; float f; } unit = { .i = 0x33800000u };
        float value = (float)mantissa * unit.f;
        return sign ? -value : value;
    } else {
        bits = sign;
    }
    union { uint32_t i; float f; } out = { .i = bits };
    return out.f;
#endif
}

/* fp16 nearest to f, ties to even (F16C's rounding), infinities and NaN kept. */
static inline uint16_t float_to_half(float f)
{
#if defined(__F16C__) && !defined(ASTRAI_PORTABLE)
    return _cvtss_sh(f, 0);
#else
    union { float f; uint32_t i; } in = { .f = f };
    const uint16_t sign = (uint16_t)((in.i >> 16) & 0x8000u);
    const uint32_t a = in.i & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;          /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;         /* 65520 and above round to infinity */
    if (a < 0x38800000u) {                               /* below 2^-14: a subnormal, in units of 2^-24 */
        union { uint32_t i; float f; } magnitude = { .i = a };
        return sign | (uint16_t)rintf(magnitude.f * 16777216.0f);
    }
    return sign | (uint16_t)((a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13);
#endif
}

static inline float bf16_to_float(uint16_t b)
{
    union { uint32_t i; float f; } out = { .i = (uint32_t)b << 16 };
    return out.f;
}

/* v rounded to the nearest bf16, ties to even, as torch's .bfloat16() rounds (a NaN stays a NaN) */
static inline float bf16_rounded(float v)
{
    union { uint32_t i; float f; } in = { .f = v };
    if ((in.i & 0x7fffffffu) > 0x7f800000u) return v;
    in.i = (in.i + 0x7fffu + ((in.i >> 16) & 1u)) & 0xffff0000u;
    return in.f;
}

/* Rows of x rounded to bf16 into the calling thread's own buffer (grown as needed, kept for
 * the thread's next call), n_in elements apart: with vdpbf16ps (BF16_PRODUCTS) as bf16 bits
 * for dot_bf16 to multiply as they are, else as floats; NULL when memory ran out. The AVX2
 * loop of dot_bf16 widens sixteen bf16 weights by two unpacks, which give inputs 0-3 and
 * 8-11 in one register and 4-7 and 12-15 in the other: there each whole sixteen of a row's
 * floats is stored in that order (BF16_QUARTERS), once per call rather than per weight row. */
#define BF16_QUARTERS (DEQUANT_AVX2 && !BF16_PRODUCTS)
#if BF16_PRODUCTS
typedef uint16_t bf16_row_t;
void astrai_bf16_round_row(const float *in, int64_t n, uint16_t *out);  /* bf16_matmul.c */
#else
typedef float bf16_row_t;
#endif

static const bf16_row_t *bf16_rounded_rows(const float *x, int64_t rows, int64_t x_stride, int64_t n_in)
{
    static __thread bf16_row_t *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (rows * n_in > capacity) {
        bf16_row_t *grown = realloc(buffer, sizeof(bf16_row_t) * (size_t)(rows * n_in));
        if (grown == NULL) return NULL;
        buffer = grown, capacity = rows * n_in;
    }
    for (int64_t r = 0; r < rows; ++r) {
#if BF16_PRODUCTS
        astrai_bf16_round_row(x + r * x_stride, n_in, buffer + r * n_in);
#else
        const float *in = x + r * x_stride;
        bf16_row_t *out = buffer + r * n_in;
        #pragma omp simd
        for (int64_t i = 0; i < n_in; ++i) out[i] = bf16_rounded(in[i]);
#if BF16_QUARTERS
        for (int64_t i = 0; i + 16 <= n_in; i += 16) {  /* 0-3, 8-11, 4-7, 12-15 */
            const __m128 second = _mm_loadu_ps(out + i + 4);
            _mm_storeu_ps(out + i + 4, _mm_loadu_ps(out + i + 8));
            _mm_storeu_ps(out + i + 8, second);
        }
#endif
#endif
    }
    return buffer;
}

static inline void prefetch_ahead(const uint8_t *p, const uint8_t *end)
{
    if (p + AHEAD_BYTES < end) __builtin_prefetch(p + AHEAD_BYTES, 0, 0);
}


#if DEQUANT_AVX2
static inline float horizontal_sum(__m256 a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* An int4 block's 32 nibbles (0..15) as bytes in element order: the 16 low ones, then the
 * 16 high ones. */
static inline __m256i nibbles(const uint8_t *block)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)block);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* The 32 products of unsigned bytes `u` (nibbles, int8 magnitudes, or ones) with 32 int8
 * values, summed in fours into 8 int32 lanes: one vpdpbusd with VNNI, else maddubs (even
 * 128 * 127 * 2 stays inside its 16-bit pair sums) and a madd of the pairs; the same integers
 * either way. */
static inline __m256i fours(__m256i u, __m256i x)
{
#if DEQUANT_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

static inline __m256i block_fours(__m256i u, const int8_t *xq)
{
    return fours(u, _mm256_loadu_si256((const __m256i *)xq));
}

/* A Q4_0 block's 32 integer products (`u`: the stored nibbles, w + 8) with 32 int8 values,
 * summed in fours into 8 int32 lanes, less the block's `offsets` (8 times the same fours of
 * x), as floats: sum (u - 8) x = sum u x - 8 sum x, lane by lane, exactly. */
static inline __m256 q4_block_products(__m256i u, const int8_t *xq, const int32_t *offsets)
{
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(block_fours(u, xq), _mm256_loadu_si256((const __m256i *)offsets)));
}

/* Two int4 blocks' integer sums, as block_fours gives one's: `lo` and `hi` hold the low and
 * the high nibbles of blocks b and b + 1, `xq` the two blocks' activations as pair_blocks lays
 * them out; block b's sums come out in lanes 0-3, block b + 1's in lanes 4-7. */
static inline __m256i pair_fours(__m256i lo, __m256i hi, const int8_t *xq)
{
    const __m256i low = block_fours(lo, xq);
#if DEQUANT_VNNI
    return _mm256_dpbusd_epi32(low, hi, _mm256_loadu_si256((const __m256i *)(xq + BLOCK)));
#else
    return _mm256_add_epi32(low, block_fours(hi, xq + BLOCK));
#endif
}

/* q4_block_products for a pair of blocks, `offsets` the pair's 8 q sums in the same lanes. */
static inline __m256 q4_pair_products(__m256i lo, __m256i hi, const int8_t *xq, const int32_t *offsets)
{
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(pair_fours(lo, hi, xq), _mm256_loadu_si256((const __m256i *)offsets)));
}

/* A Q8_0 block's 32 signed products with 32 int8 values, summed in fours into 8 int32 lanes, as
 * floats: |w| against x with w's sign moved onto it (sign_epi8, which also zeroes x where w is 0),
 * so that the unsigned operand fits maddubs and vpdpbusd (a pair of |w| x |x| is at most
 * 2 x 128 x 127, inside maddubs' 16 bits). */
static inline __m256 q8_block_products(__m256i w, const int8_t *xq)
{
    const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), w);
    return _mm256_cvtepi32_ps(fours(_mm256_abs_epi8(w), x));
}

/* Eight consecutive fp16 scales as floats. */
static inline __m256 scales8(const uint16_t *h)
{
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    float f[8];
    for (int k = 0; k < 8; ++k) f[k] = half_to_float(h[k]);
    return _mm256_loadu_ps(f);
#endif
}

#endif


/* Float sums that must not depend on the rows sharing a call are each made in a function of
 * their own, never inlined, with the additions in source order (reassociation off there
 * alone, so integer loops still vectorize): under -fassociative-math an inlined loop over
 * several rows may be vectorized or reordered differently for each row count, and a row of
 * a speculative step's verify would then differ from the same row decoded alone. */
#if defined(__clang__)
#define IN_SOURCE_ORDER __attribute__((noinline))
#define SOURCE_ORDER_PRAGMA _Pragma("clang fp reassociate(off)")
#else
#define IN_SOURCE_ORDER __attribute__((noinline, optimize("no-associative-math")))
#define SOURCE_ORDER_PRAGMA
#endif

#if !DEQUANT_AVX2
/* The plain-C loops, one row of x at a time, each in source order (above). */

/* One row's int8 blocks against one quantized row of x. */
static IN_SOURCE_ORDER float row_q8(const int8_t *w, const uint16_t *scales, const int8_t *xq, const float *xd,
                                    int64_t blocks)
{
    SOURCE_ORDER_PRAGMA
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        int32_t t = 0;
        for (int k = 0; k < BLOCK; ++k) t += w[b * BLOCK + k] * xq[b * BLOCK + k];
        sum += half_to_float(scales[b]) * xd[b] * (float)t;
    }
    return sum;
}

/* One row's int4 blocks (Q4_1 with `mins`, else Q4_0) against one quantized row of x. */
static IN_SOURCE_ORDER float row_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *mins, const int8_t *xq,
                                    const float *xd, const float *xs, int64_t blocks)
{
    SOURCE_ORDER_PRAGMA
    const int centre = mins ? 0 : 8;  /* Q4_1's nibbles are its values as they are */
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = w + b * (BLOCK / 2);
        const int8_t *xb = xq + b * BLOCK;
        int32_t t = 0;
        for (int k = 0; k < BLOCK / 2; ++k)
            t += ((block[k] & 0x0f) - centre) * xb[k] + ((block[k] >> 4) - centre) * xb[k + BLOCK / 2];
        const float d = half_to_float(scales[b]);
        sum += mins ? d * xd[b] * (float)t + half_to_float(mins[b]) * xs[b] : d * xd[b] * (float)t;
    }
    return sum;
}

/* One bf16 weight row against one row of x rounded to bf16 (as floats). */
static IN_SOURCE_ORDER float row_bf16(const uint16_t *w, const float *x, int64_t n_in)
{
    SOURCE_ORDER_PRAGMA
    float sum = 0.0f;
    for (int64_t i = 0; i < n_in; ++i) sum += bf16_to_float(w[i]) * x[i];
    return sum;
}

#endif

/* dot_q4's three accumulators' lanes summed, in a function of its own (see IN_SOURCE_ORDER):
 * inlined under -fassociative-math, (a + b) + c may be regrouped for some row counts (eight
 * rows of x under a Zen 1's tuning), moving that row's sum by an ulp. */
#if DEQUANT_AVX2
static IN_SOURCE_ORDER float sum_of_three(__m256 a, __m256 b, __m256 c)
{
    SOURCE_ORDER_PRAGMA
    return horizontal_sum(_mm256_add_ps(_mm256_add_ps(a, b), c));
}
#endif

/* out[s * rows + r] = int8 weight row s (`gap` rows after the first, for s < streams) against
 * the quantized rows of x (values, scales) for r < rows: per block an integer sum of products,
 * times d_w d_x, as dot_q4 (below) does for int4. Every block is whole (the weight's padding
 * values and the activations' are 0). Weight rows read side by side keep more cache lines in
 * flight; each pair of rows sums alone, so the numbers do not depend on the streams. */
static inline __attribute__((always_inline)) void dot_q8(const uint8_t *first_row, const uint16_t *first_scales,
                                                         int64_t gap, int64_t scale_gap, int streams,
                                                         const int8_t *xq, const float *xd, int rows, int64_t blocks,
                                                         float *out, const uint8_t *end)
{
#if DEQUANT_AVX2
    __m256 even[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS], odd[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS];
    float factor[ASTRAI_MAX_DEQUANT_ROWS][8] __attribute__((aligned(32)));
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) even[s][r] = odd[s][r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8)
        for (int s = 0; s < streams; ++s) {
            const uint8_t *w = first_row + s * gap;
            const uint16_t *scales = first_scales + s * scale_gap;
            for (int line = 0; line < 4; ++line) prefetch_ahead(w + b * BLOCK + 64 * line, end);  /* eight blocks */
            const __m256 d = scales8(scales + b);
            for (int r = 0; r < rows; ++r)
                _mm256_store_ps(factor[r], _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * blocks + b)));
            for (int k = 0; k < 8; k += 2) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + (b + k) * BLOCK));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + (b + k + 1) * BLOCK));
                for (int r = 0; r < rows; ++r) {
                    const int64_t at = r * blocks + b + k;
                    even[s][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&factor[r][k]),
                                                 q8_block_products(w0, xq + at * BLOCK), even[s][r]);
                    odd[s][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&factor[r][k + 1]),
                                                q8_block_products(w1, xq + (at + 1) * BLOCK), odd[s][r]);
                }
            }
        }
    for (; b < blocks; ++b)
        for (int s = 0; s < streams; ++s) {
            const float d = half_to_float(first_scales[s * scale_gap + b]);
            const __m256i wb = _mm256_loadu_si256((const __m256i *)(first_row + s * gap + b * BLOCK));
            for (int r = 0; r < rows; ++r) {
                const int64_t at = r * blocks + b;
                even[s][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[at]), q8_block_products(wb, xq + at * BLOCK),
                                             even[s][r]);
            }
        }
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) out[s * rows + r] = horizontal_sum(_mm256_add_ps(even[s][r], odd[s][r]));
#else
    (void)end;
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r)
            out[s * rows + r] = row_q8((const int8_t *)first_row + s * gap, first_scales + s * scale_gap,
                                       xq + r * blocks * BLOCK, xd + r * blocks, blocks);
#endif
}

/* One Q8_0 block of n values: returns its fp16-rounded d (NaN when the block holds an
 * infinity or a NaN) and sets *inverse to 1 / d in fp32 (0 for d = 0), as quantized.py's
 * `quantize_activations` computes them. */
static inline float block_step(const float *xb, int64_t n, float *inverse)
{
    float largest = 0.0f;
    int finite = 1;
    for (int64_t k = 0; k < n; ++k) {
        const float magnitude = fabsf(xb[k]);
        finite &= magnitude <= 3.4028235e38f;  /* false for inf and NaN */
        largest = magnitude > largest ? magnitude : largest;
    }
    float d = largest * (1.0f / 127.0f);
    /* d as rounded, from here on: otherwise -freciprocal-math may fold 1 / (largest / 127)
     * into 127 / largest, rounded otherwise, and a value near a tie rounds to the other side */
    __asm__("" : "+m"(d));
    *inverse = d != 0.0f ? 1.0f / d : 0.0f;
    return finite ? half_to_float(float_to_half(d)) : NAN;
}

#if DEQUANT_AVX2
/* quantize_activations for one whole block in registers: the same step, the same products
 * rounded the same way (cvtps rounds to nearest even, as rintf does), and the sums of fours
 * taken against ones. */
static inline void quantize_block(const float *xb, int8_t *q, float *step, int32_t *offsets, float *sum)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), top = _mm256_set1_ps(3.4028235e38f);
    __m256 v[4], largest = _mm256_setzero_ps();
    int finite = 1;
    for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        const __m256 a = _mm256_and_ps(v[k], magnitude);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, top, _CMP_LE_OQ)) == 0xff;  /* false for inf and NaN */
        largest = _mm256_max_ps(largest, a);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    float d = _mm_cvtss_f32(m) * (1.0f / 127.0f);
    __asm__("" : "+m"(d));  /* as in block_step */
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f, kept = finite ? half_to_float(float_to_half(d)) : NAN;
    *step = *sum = kept;
    if (kept != kept) {
        memset(q, 0, BLOCK);
        if (offsets) memset(offsets, 0, 8 * sizeof(int32_t));
        return;
    }
    const __m256 scale = _mm256_set1_ps(inverse);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], scale));
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    const __m256i sums = fours(_mm256_set1_epi8(1), bytes);
    if (offsets) _mm256_storeu_si256((__m256i *)offsets, _mm256_slli_epi32(sums, 3));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = kept * (float)_mm_cvtsi128_si32(t);
}
#endif

/* Rows of x quantized for the int4 matmul: `values` [rows][blocks * 32] int8 (zero past
 * n_in), `scales` [rows][blocks] the fp16-rounded d of each block as a float. A block holding
 * an infinity or a NaN gets NaN for its d, so that its products are NaN as the
 * reference's are. `offsets` [rows][blocks][8] (unless NULL): 8 times the sum of each block's values
 * 4k..4k+3 in lane k, which q4_block_products takes off. `sums` [rows][blocks]: each block's
 * d times the sum of its values (what a Q4_1 block's minimum multiplies). */
static void quantize_activations(const float *x, int64_t x_stride, int64_t rows, int64_t n_in, int8_t *values,
                                 float *scales, int32_t *offsets, float *sums)
{
    const int64_t blocks = (n_in + BLOCK - 1) / BLOCK;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float *xb = x + r * x_stride + b * BLOCK;
            int8_t *q = values + (r * blocks + b) * BLOCK;
            const int64_t n = n_in - b * BLOCK < BLOCK ? n_in - b * BLOCK : BLOCK;
#if DEQUANT_AVX2
            if (n == BLOCK) {
                quantize_block(xb, q, scales + r * blocks + b, offsets ? offsets + (r * blocks + b) * 8 : NULL,
                               sums + r * blocks + b);
                continue;
            }
#endif
            float inverse;
            const float kept = block_step(xb, n, &inverse);
            memset(q, 0, BLOCK);
            scales[r * blocks + b] = kept;
            sums[r * blocks + b] = kept;
            if (kept != kept) {  /* NaN: the block's products are NaN; its values stay 0 */
                if (offsets) memset(offsets + (r * blocks + b) * 8, 0, 8 * sizeof(int32_t));
                continue;
            }
            for (int64_t k = 0; k < n; ++k) q[k] = (int8_t)rintf(xb[k] * inverse);
            int32_t total = 0;
            for (int lane = 0; lane < 8; ++lane) {
                const int32_t four = q[4 * lane] + q[4 * lane + 1] + q[4 * lane + 2] + q[4 * lane + 3];
                if (offsets) offsets[(r * blocks + b) * 8 + lane] = 8 * four;
                total += four;
            }
            sums[r * blocks + b] = kept * (float)total;
        }
}

#if DEQUANT_AVX2
/* Rows quantized for the int4 matmul, rearranged for dot_q4's pairs of blocks: in each pair
 * (b, b + 1), b even, the values become b's first 16, b + 1's first 16, b's last 16, b + 1's
 * last 16 (the order in which a 32-byte load of the two blocks' nibbles holds its low and
 * then its high nibbles), and the pair's first 8 offsets the sums of those fours, lane by
 * lane (block b's in lanes 0-3). An odd last block keeps its layout. */
static void pair_blocks(int8_t *values, int32_t *offsets, int64_t rows, int64_t blocks)
{
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b + 1 < blocks; b += 2) {
            int8_t *q = values + (r * blocks + b) * BLOCK;
            const __m128i first_high = _mm_loadu_si128((const __m128i *)(q + 16));
            _mm_storeu_si128((__m128i *)(q + 16), _mm_loadu_si128((const __m128i *)(q + 32)));
            _mm_storeu_si128((__m128i *)(q + 32), first_high);
            int32_t *o = offsets + (r * blocks + b) * 8;
            const __m128i first = _mm_add_epi32(_mm_loadu_si128((const __m128i *)o),
                                                _mm_loadu_si128((const __m128i *)(o + 4)));
            const __m128i second = _mm_add_epi32(_mm_loadu_si128((const __m128i *)(o + 8)),
                                                 _mm_loadu_si128((const __m128i *)(o + 12)));
            _mm_storeu_si128((__m128i *)o, first);
            _mm_storeu_si128((__m128i *)(o + 4), second);
        }
}
#endif

/* out[s * rows + r] = int4 weight row s (`gap` bytes after the first, its scales `scale_gap`
 * values after, for s < streams) against the quantized rows of x (values, scales) for
 * r < rows: per block an integer sum of products times d_w d_x, and for Q4_1 (`mins`, else
 * NULL) the block's minimum m_w times d_x times the sum of its values (`xs`). Every block is
 * whole here (Q4_0's padding nibbles are 8, the activations' padding 0). Weight rows read side
 * by side keep more cache lines in flight; each pair of rows sums alone. */
static inline __attribute__((always_inline)) void dot_q4(const uint8_t *first_row, const uint16_t *first_scales,
                                                         const uint16_t *first_mins, int64_t gap, int64_t scale_gap,
                                                         int streams, const int8_t *xq, const float *xd,
                                                         const int32_t *xo, const float *xs, int rows, int64_t blocks,
                                                         float *out, const uint8_t *end)
{
#if DEQUANT_AVX2
    int64_t b = 0;
    /* two blocks at a time, against activations laid out by pair_blocks: one 32-byte load
     * gives both blocks' nibbles, the low ones (elements 0-15 of each) in one register and the
     * high ones in another; their sums of fours hold block b in lanes 0-3 and block b + 1 in
     * lanes 4-7, which take each block's factor d_w d_x. The sums are of u - 8 for Q4_1 too,
     * its minimum moved to the block's middle (m + 8 d): every float term is then the size of
     * the result, where u's sums and m's (m near -8 d) would be eight times larger and cancel.
     * The middles' terms of eight blocks gather in the lanes of `low`. */
    __m256 acc0[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS], acc1[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS],
        low[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS];
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) acc0[s][r] = acc1[s][r] = low[s][r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (; b + 8 <= blocks; b += 8)
        for (int s = 0; s < streams; ++s) {
            const uint8_t *w = first_row + s * gap;
            const uint16_t *scales = first_scales + s * scale_gap, *mins = first_mins ? first_mins + s * scale_gap : NULL;
            prefetch_ahead(w + b * (BLOCK / 2), end);  /* eight blocks: two cache lines */
            prefetch_ahead(w + b * (BLOCK / 2) + 64, end);
            const __m256 d = scales8(scales + b);
            __m256 factor[ASTRAI_MAX_DEQUANT_ROWS];
            for (int r = 0; r < rows; ++r) factor[r] = _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * blocks + b));
            if (mins) {
                const __m256 middle = _mm256_fmadd_ps(d, _mm256_set1_ps(8.0f), scales8(mins + b));
                for (int r = 0; r < rows; ++r)
                    low[s][r] = _mm256_fmadd_ps(middle, _mm256_loadu_ps(xs + r * blocks + b), low[s][r]);
            }
            for (int k = 0; k < 8; k += 2) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + (b + k) * (BLOCK / 2)));
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                const __m256i pick = _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1);
                for (int r = 0; r < rows; ++r) {
                    const int64_t at = r * blocks + b + k;
                    const __m256 products = q4_pair_products(lo, hi, xq + at * BLOCK, xo + at * 8);
                    const __m256 f = _mm256_permutevar8x32_ps(factor[r], pick);
                    if (k & 2) acc1[s][r] = _mm256_fmadd_ps(f, products, acc1[s][r]);
                    else acc0[s][r] = _mm256_fmadd_ps(f, products, acc0[s][r]);
                }
            }
        }
    for (; b + 2 <= blocks; b += 2)
        for (int s = 0; s < streams; ++s) {
            const uint8_t *w = first_row + s * gap;
            const uint16_t *scales = first_scales + s * scale_gap, *mins = first_mins ? first_mins + s * scale_gap : NULL;
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + b * (BLOCK / 2)));
            const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            const float d0 = half_to_float(scales[b]), d1 = half_to_float(scales[b + 1]);
            for (int r = 0; r < rows; ++r) {
                const int64_t at = r * blocks + b;
                const float f0 = d0 * xd[at], f1 = d1 * xd[at + 1];
                const __m256 f = _mm256_setr_ps(f0, f0, f0, f0, f1, f1, f1, f1);
                acc0[s][r] = _mm256_fmadd_ps(f, q4_pair_products(lo, hi, xq + at * BLOCK, xo + at * 8), acc0[s][r]);
                if (mins)  /* in low's lanes, as the eights' middles: scalar sums here were reordered per level */
                    low[s][r] = _mm256_fmadd_ps(_mm256_setr_ps(fmaf(8.0f, d0, half_to_float(mins[b])),
                                                               fmaf(8.0f, d1, half_to_float(mins[b + 1])), 0, 0, 0, 0, 0, 0),
                                                _mm256_setr_ps(xs[at], xs[at + 1], 0, 0, 0, 0, 0, 0), low[s][r]);
            }
        }
    if (b < blocks)  /* an odd last block keeps its own layout */
        for (int s = 0; s < streams; ++s) {
            const uint16_t *mins = first_mins ? first_mins + s * scale_gap : NULL;
            const float d = half_to_float(first_scales[s * scale_gap + b]);
            const __m256i u = nibbles(first_row + s * gap + b * (BLOCK / 2));
            for (int r = 0; r < rows; ++r) {
                const int64_t at = r * blocks + b;
                acc1[s][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[at]), q4_block_products(u, xq + at * BLOCK, xo + at * 8),
                                             acc1[s][r]);
                if (mins)
                    low[s][r] = _mm256_fmadd_ps(_mm256_setr_ps(fmaf(8.0f, d, half_to_float(mins[b])), 0, 0, 0, 0, 0, 0, 0),
                                                _mm256_setr_ps(xs[at], 0, 0, 0, 0, 0, 0, 0), low[s][r]);
            }
        }
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r)
            out[s * rows + r] = sum_of_three(acc0[s][r], acc1[s][r], low[s][r]);
#else
    (void)xo, (void)end;
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r)
            out[s * rows + r] = row_q4(first_row + s * gap, first_scales + s * scale_gap,
                                       first_mins ? first_mins + s * scale_gap : NULL, xq + r * blocks * BLOCK,
                                       xd + r * blocks, xs + r * blocks, blocks);
#endif
}

#if !DEQUANT_AVX2
/* One row of x against the eight rows of an ASTRAI_Q4X8 or ASTRAI_Q8X8 group, out[i] for row i. */
static IN_SOURCE_ORDER void row_x8(int type, const uint8_t *w, const uint16_t *scales, const int8_t *xq,
                                   const float *xd, int64_t blocks, float *out)
{
    SOURCE_ORDER_PRAGMA
    const int64_t block_bytes = type == ASTRAI_Q8X8 ? 256 : 128;
    float sum[8] = {0.0f};
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = w + b * block_bytes;
        const int8_t *xb = xq + b * BLOCK;
        for (int i = 0; i < 8; ++i) {
            int32_t t = 0;
            for (int k = 0; k < 8; ++k)  /* inputs 4k..4k+3 (Q4_0: load k % 4's low, then high nibbles) */
                for (int j = 0; j < 4; ++j) {
                    int v;
                    if (type == ASTRAI_Q8X8) {
                        v = (int8_t)(block[32 * k + 4 * i + j] ^ 0x80);
                    } else {
                        const uint8_t byte = block[32 * (k & 3) + 4 * i + j];
                        v = (k < 4 ? byte & 0x0f : byte >> 4) - 8;
                    }
                    t += v * xb[4 * k + j];
                }
            sum[i] += half_to_float(scales[8 * b + i]) * xd[b] * (float)t;
        }
    }
    for (int i = 0; i < 8; ++i) out[i] = sum[i];
}
#endif

/* out[r * 8 + i] = row i of an ASTRAI_Q4X8 or ASTRAI_Q8X8 group (`w`, `scales` its first bytes
 * and scales) against quantized row r of x, for r < rows. Each 32-byte load holds four inputs
 * of all eight rows, so a vpdpbusd against those four inputs of x, broadcast, adds eight rows'
 * products at once, one per lane: a block ends in one conversion and one multiply-add for
 * eight outputs, with no horizontal sums, and the scales come as one 16-byte load. The
 * unsigned operand is Q4_0's nibbles (w + 8) or Q8_0's stored bytes (w + 128); `xe`
 * [rows][blocks] holds 8 or 128 times each block's sum of x's values, which that takes off
 * again. Without VNNI, maddubs and a madd give the same integers: Q4_0's eight pair sums of at
 * most 2 x 15 x 127 each stay inside 16 bits; Q8_0's w + 128 would overflow them, so |w|
 * multiplies x carrying w's sign instead. A row of x has its own sums, so its numbers do not
 * depend on the rows beside it. With `streams` 2, a second group `group_gap` bytes (its
 * scales `scale_gap` values) further on is read block for block beside the first, into
 * out[8 * (rows + r) + i]: one stream leaves a core short of the memory's pace. */
#if DEQUANT_AVX2
/* Four int8 values in every 32-bit lane. One 4-byte copy each: the compiler makes it a broadcast
 * load, where an array of eight copied at once became a 64-bit load, a shift and a move. */
static inline __m256i broadcast_four(const int8_t *p)
{
    int32_t four;
    memcpy(&four, p, sizeof four);
    return _mm256_set1_epi32(four);
}
#endif

static inline __attribute__((always_inline)) void dot_x8(int type, const uint8_t *first_group,
                                                         const uint16_t *first_scales, int64_t group_gap,
                                                         int64_t scale_gap, int streams, const int8_t *xq,
                                                         const float *xd, const int32_t *xe, int rows, int64_t blocks,
                                                         float *out, const uint8_t *end)
{
#if DEQUANT_AVX2
    const int64_t block_bytes = type == ASTRAI_Q8X8 ? 256 : 128;
    __m256 sums[2][ASTRAI_MAX_DEQUANT_ROWS];
    for (int g = 0; g < streams; ++g)
        for (int r = 0; r < rows; ++r) sums[g][r] = _mm256_setzero_ps();
    for (int64_t step = 0; step < blocks * streams; ++step) {  /* the groups' block b side by side */
        const int64_t b = step / streams;
        const int g = (int)(step % streams);
        const uint8_t *block = first_group + g * group_gap + b * block_bytes;
        const uint16_t *scales = first_scales + g * scale_gap;
        __m256 *acc = sums[g];
        for (int64_t line = 0; line < block_bytes; line += 64) prefetch_ahead(block + line, end);
        if ((b & 3) == 0) __builtin_prefetch(scales + 8 * b + 256, 0, 0);
        const __m256 d = scales8(scales + 8 * b);
        __m256i u[8];  /* u[k]: inputs 4k..4k+3 of the eight rows, unsigned */
        if (type == ASTRAI_Q8X8) {
            for (int k = 0; k < 8; ++k) u[k] = _mm256_loadu_si256((const __m256i *)(block + 32 * k));
        } else {
            const __m256i low4 = _mm256_set1_epi8(0x0f);
            for (int k = 0; k < 4; ++k) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * k));
                u[k] = _mm256_and_si256(raw, low4);
                u[k + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
        }
#if !DEQUANT_VNNI
        __m256i magnitude[8];
        if (type == ASTRAI_Q8X8)
            for (int k = 0; k < 8; ++k) {
                u[k] = _mm256_xor_si256(u[k], _mm256_set1_epi8((char)0x80));  /* w itself */
                magnitude[k] = _mm256_abs_epi8(u[k]);
            }
#endif
        for (int r = 0; r < rows; ++r) {
            const int64_t at = r * blocks + b;
            /* x's inputs 4k..4k+3, broadcast straight from memory (a load, no move from a
             * general register) */
#define FOUR(k) broadcast_four(xq + at * BLOCK + 4 * (k))
#if DEQUANT_VNNI
            /* two chains of four: a chain of eight would wait on vpdpbusd's latency */
            __m256i s = _mm256_set1_epi32(-xe[at]), t = _mm256_setzero_si256();
            for (int k = 0; k < 8; k += 2) {
                s = _mm256_dpbusd_epi32(s, u[k], FOUR(k));
                t = _mm256_dpbusd_epi32(t, u[k + 1], FOUR(k + 1));
            }
            s = _mm256_add_epi32(s, t);
#else
            __m256i s;
            if (type == ASTRAI_Q8X8) {
                s = _mm256_setzero_si256();
                for (int k = 0; k < 8; ++k) {
                    const __m256i x = _mm256_sign_epi8(FOUR(k), u[k]);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[k], x),
                                                              _mm256_set1_epi16(1)));
                }
            } else {
                __m256i pairs = _mm256_setzero_si256();
                for (int k = 0; k < 8; ++k)
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[k], FOUR(k)));
                s = _mm256_sub_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)), _mm256_set1_epi32(xe[at]));
            }
#endif
#undef FOUR
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xd[at])), acc[r]);
        }
    }
    for (int g = 0; g < streams; ++g)
        for (int r = 0; r < rows; ++r) _mm256_storeu_ps(out + 8 * (g * rows + r), sums[g][r]);
#else
    (void)xe, (void)end;
    for (int g = 0; g < streams; ++g)
        for (int r = 0; r < rows; ++r)
            row_x8(type, first_group + g * group_gap, first_scales + g * scale_gap, xq + r * blocks * BLOCK,
                   xd + r * blocks, blocks, out + 8 * (g * rows + r));
#endif
}

static inline int beats(float value, float top) { return value > top || (value != value && top == top); }

/* With `best`, the argmax of each row r of y over a thread's outputs [first, last), in their
 * order (a stretch may be written out of order), into best[r * MAX_TEAM + t] and
 * top[r * MAX_TEAM + t] for astrai_team_argmax. */
static void stretch_argmax(const float *y, int64_t y_stride, int64_t rows, int64_t first, int64_t last,
                           int64_t *best, float *top, int t)
{
    if (!best)
        return;
    for (int64_t r = 0; r < rows; ++r) {
        int64_t mine = -1;
        float highest = 0.0f;
        for (int64_t j = first; j < last; ++j) {
            const float v = y[r * y_stride + j];
            if (mine < 0 || beats(v, highest)) mine = j, highest = v;
        }
        best[r * MAX_TEAM + t] = mine, top[r * MAX_TEAM + t] = highest;
    }
}

/* This thread's groups of an ASTRAI_Q4X8 or ASTRAI_Q8X8 weight (astrai_team_dequant_matmul's
 * part for it): the threads split the outputs in whole groups of eight. */
static void team_x8(int type, const float *x, int64_t rows, int64_t x_stride, const uint8_t *w,
                    const uint16_t *scales, const float *bias, float *y, int64_t y_stride, int64_t n_in,
                    int64_t n_out, int64_t ld, int64_t scale_ld, int64_t *best, float *top)
{
    const int t = omp_get_thread_num();
    const int64_t size = omp_get_num_threads(), groups = n_out / 8, per = (groups + size - 1) / size;
    const int64_t first = t * per, last = first + per < groups ? first + per : groups;
    const int64_t blocks = first < last ? (n_in + BLOCK - 1) / BLOCK : 0;
    const uint8_t *end = w + last * 8 * ld;
    int8_t xq[rows * blocks * BLOCK + 1] __attribute__((aligned(32)));
    float xd[rows * blocks + 1], xs[rows * blocks + 1], out[ASTRAI_MAX_DEQUANT_ROWS * 8];
    int32_t xo[rows * blocks * 8 + 1], xe[rows * blocks + 1];
    if (blocks) quantize_activations(x, x_stride, rows, n_in, xq, xd, xo, xs);
    for (int64_t i = 0; i < rows * blocks; ++i) {
        int32_t e = 0;
        for (int lane = 0; lane < 8; ++lane) e += xo[8 * i + lane];
        xe[i] = type == ASTRAI_Q8X8 ? 16 * e : e;  /* the lanes hold 8 times x's sums */
    }
    /* one row of x reads the first two parts of the thread's groups side by side */
    const int64_t part = rows == 1 ? (last - first) / 2 : 0, paired_end = first + part;
    for (int64_t g = first; g < last; g = g + 1 == paired_end ? first + 2 * part : g + 1) {
        const uint8_t *wg = w + g * 8 * ld;
        const uint16_t *sg = scales + g * 8 * scale_ld;
        const int paired = g < paired_end;
        /* a literal type and row count per case: each copy keeps its rows' sums in registers */
        switch (paired ? 0 : rows + ASTRAI_MAX_DEQUANT_ROWS * (type == ASTRAI_Q8X8)) {
        case 0:
            if (type == ASTRAI_Q8X8)
                dot_x8(ASTRAI_Q8X8, wg, sg, part * 8 * ld, part * 8 * scale_ld, 2, xq, xd, xe, 1, blocks, out, end);
            else
                dot_x8(ASTRAI_Q4X8, wg, sg, part * 8 * ld, part * 8 * scale_ld, 2, xq, xd, xe, 1, blocks, out, end);
            break;
#define ROWS_CASE(n) \
        case n: dot_x8(ASTRAI_Q4X8, wg, sg, 0, 0, 1, xq, xd, xe, n, blocks, out, end); break; \
        case n + ASTRAI_MAX_DEQUANT_ROWS: dot_x8(ASTRAI_Q8X8, wg, sg, 0, 0, 1, xq, xd, xe, n, blocks, out, end); break;
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
        }
        for (int k = 0; k < 1 + paired; ++k)
            for (int i = 0; i < 8; ++i) {
                const int64_t j = 8 * (g + k * part) + i;
                const float b = bias ? bias[j] : 0.0f;
                for (int64_t r = 0; r < rows; ++r) y[r * y_stride + j] = out[8 * (k * rows + r) + i] + b;
            }
    }
    stretch_argmax(y, y_stride, rows, 8 * first, 8 * last, best, top, t);
}

#if BF16_QUARTERS
/* sum plus the products of the last n elements, in order (a row's tail past its sixteens) */
static IN_SOURCE_ORDER float bf16_tail(const uint16_t *w, const float *x, int64_t n, float sum)
{
    SOURCE_ORDER_PRAGMA
    for (int64_t i = 0; i < n; ++i) sum += bf16_to_float(w[i]) * x[i];
    return sum;
}

/* `streams` bf16 weight rows, `gap` elements apart, against the rows of x rounded to bf16 (as
 * floats, each sixteen in BF16_QUARTERS order), into out[s * rows + r]. Each (weight row, row
 * of x) pair adds into two chains, one per unpack of the widened sixteen, then its tail in
 * order: the same numbers however many streams and rows share the loop (how many streams:
 * weight_streams). */
static inline __attribute__((always_inline)) void dot_bf16_streams(const uint16_t *w, int64_t gap, int streams,
                                                                   const float *x, int64_t x_stride, int rows,
                                                                   int64_t n_in, float *out, const uint8_t *end)
{
    __m256 lo[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS], hi[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS];
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) lo[s][r] = hi[s][r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n_in; i += 16)
        for (int s = 0; s < streams; ++s) {
            if (!(i & 31)) prefetch_ahead((const uint8_t *)(w + s * gap + i), end);
            /* inputs 0-3 and 8-11, then 4-7 and 12-15, as x's sixteens are stored */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + s * gap + i));
            const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
            const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
            for (int r = 0; r < rows; ++r) {
                lo[s][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * x_stride + i), lo[s][r]);
                hi[s][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * x_stride + i + 8), hi[s][r]);
            }
        }
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r)
            out[s * rows + r] = bf16_tail(w + s * gap + i, x + r * x_stride + i, n_in - i,
                                          horizontal_sum(_mm256_add_ps(lo[s][r], hi[s][r])));
}

#endif

/* The bf16 weight row's products with the rows of x, rounded to bf16 (bf16_rounded_rows:
 * `rounded` holds bf16 bits with vdpbf16ps, else floats, rows x_stride elements apart), for
 * `streams` weight rows `gap` elements apart: out[s * rows + r]. */
static inline __attribute__((always_inline)) void dot_bf16(const uint16_t *w, int64_t gap, int streams,
                                                           const bf16_row_t *rounded, int64_t x_stride, int rows,
                                                           int64_t n_in, float *out, const uint8_t *end)
{
#if BF16_PRODUCTS
    __m512 acc[MAX_STREAMS][ASTRAI_MAX_DEQUANT_ROWS];
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) acc[s][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n_in; i += 32) {
        const __mmask32 live = n_in - i >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (n_in - i)) - 1u);
        for (int s = 0; s < streams; ++s) {
            prefetch_ahead((const uint8_t *)(w + s * gap + i), end);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, w + s * gap + i);
            for (int r = 0; r < rows; ++r)
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], wv,
                                             (__m512bh)_mm512_maskz_loadu_epi16(live, rounded + r * x_stride + i));
        }
    }
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) out[s * rows + r] = _mm512_reduce_add_ps(acc[s][r]);
#elif BF16_QUARTERS
    dot_bf16_streams(w, gap, streams, rounded, x_stride, rows, n_in, out, end);
#else
    (void)end;
    for (int s = 0; s < streams; ++s)
        for (int r = 0; r < rows; ++r) out[s * rows + r] = row_bf16(w + s * gap, rounded + r * x_stride, n_in);
#endif
}

/* How many weight rows a call of `rows` rows of x reads side by side (dot_q8, dot_q4, dot_bf16): one
 * weight row at a time keeps too few cache lines in flight for a core to reach the memory's
 * pace. Four bf16 rows widened by AVX2 for one row of x (on the 1B shape's weights 1.0 of a
 * bare read against 0.86 for one), two for two. Two bf16 rows multiplied by vdpbf16ps for one
 * or two rows of x: on a Zen 5 EPYC four read the 1B shape's weights at 0.69-0.71 of a bare
 * read and SmolLM2's at 0.38-0.55, two at 0.92-0.97 and 0.60-0.80. Two int8 or int4 rows
 * (model layout) for one. */
static inline int weight_streams(int type, int64_t rows)
{
    if (type == ASTRAI_BF16 && BF16_PRODUCTS) return rows <= 2 ? 2 : 1;
    if (type == ASTRAI_BF16 && DEQUANT_AVX2) return rows == 1 ? 4 : rows == 2 ? 2 : 1;
    if ((type == ASTRAI_Q8 || type == ASTRAI_Q4 || type == ASTRAI_Q41) && DEQUANT_AVX2) return rows == 1 ? 2 : 1;
    return 1;
}

/* The fp32 weight row's products with several rows of x (one row takes row_matmul.c's kernel):
 * a speculative step's verification of drafted tokens. The row is read from memory once, for
 * the first row of x, and from L1 for the others; each sum is f32_dot.h's, in the order the
 * one-row kernel adds, so a verified token's logits are those its plain decode step gives. */
static inline __attribute__((always_inline)) void dot_f32(const float *w, const float *x, int64_t x_stride, int rows,
                                                          int64_t n_in, float *out, const uint8_t *end)
{
    for (int64_t i = 0; i < n_in; i += 32) prefetch_ahead((const uint8_t *)(w + i), end);
    f32_dots(w, 0, 1, 0, 1, x, x_stride, rows, n_in, out, 0);
}


/* row_matmul.c: the fp32 weights' one-row GEMV and the team's argmax */
void astrai_team_row_matmul(const float *x, const float *w, const float *bias, float *y, int64_t n_in,
                            int64_t n_out, int64_t ld, int64_t *best, float *top);
int64_t astrai_team_argmax(const int64_t *best, const float *top, int team);

/* One weight row's products with every row of x (int4: of its quantized form xq, xd). `rows`
 * is a literal at each call below, so the compiler makes a copy of the loops for one row with
 * its sums in registers. */
static inline __attribute__((always_inline)) void dequant_dot(int type, const uint8_t *w, int64_t j, int64_t ld, const uint16_t *scales,
                             int64_t scale_ld, const float *x, int64_t x_stride, int rows, int64_t n_in, float *out,
                             const uint8_t *end, const int8_t *xq, const float *xd, const int32_t *xo,
                             const float *xs, const bf16_row_t *xr, int streams, int64_t gap)
{
    switch (type) {
    case ASTRAI_Q8:
        dot_q8(w + j * ld, scales + j * scale_ld, gap * ld, gap * scale_ld, streams, xq, xd, rows,
               (n_in + BLOCK - 1) / BLOCK, out, end);
        break;
    case ASTRAI_Q4:
        dot_q4(w + j * ld, scales + j * scale_ld, NULL, gap * ld, gap * scale_ld, streams, xq, xd, xo, xs, rows,
               (n_in + BLOCK - 1) / BLOCK, out, end);
        break;
    case ASTRAI_Q41:
        dot_q4(w + j * ld, scales + j * scale_ld, scales + j * scale_ld + (n_in + BLOCK - 1) / BLOCK, gap * ld,
               gap * scale_ld, streams, xq, xd, xo, xs, rows, (n_in + BLOCK - 1) / BLOCK, out, end);
        break;
    case ASTRAI_F32:
        dot_f32((const float *)w + j * ld, x, x_stride, rows, n_in, out, end);
        break;
    default:
        dot_bf16((const uint16_t *)w + j * ld, gap * ld, streams, xr, n_in, rows, n_in, out, end);
        break;
    }
}

static int64_t row_bytes(int type, int64_t ld) { return type == ASTRAI_F32 ? 4 * ld : type == ASTRAI_BF16 ? 2 * ld : ld; }

/* This thread's stretch of the matmul, for every thread of the team running it: the dequantizing
 * counterpart of row_matmul.c's astrai_team_row_matmul, which it hands one row of an fp32
 * weight (ASTRAI_F32), so that decode_step.c calls one function for every weight type. With
 * `best`, each thread notes its stretch's argmax of each row r in best[r * MAX_TEAM + t] /
 * top[r * MAX_TEAM + t] for astrai_team_argmax (an fp32 weight: one row only), so a verify
 * step's acceptance reads no logits again. No barrier. */
void astrai_team_dequant_matmul(const float *x, int64_t rows, int64_t x_stride, const void *weight,
                                const uint16_t *scales, int type, const float *bias, float *y, int64_t y_stride,
                                int64_t n_in, int64_t n_out, int64_t ld, int64_t scale_ld, int64_t *best, float *top)
{
    if (type == ASTRAI_F32 && rows == 1) {
        astrai_team_row_matmul(x, (const float *)weight, bias, y, n_in, n_out, ld, best, top);
        return;
    }
    if (type == ASTRAI_Q4X8 || type == ASTRAI_Q8X8) {
        team_x8(type, x, rows, x_stride, (const uint8_t *)weight, scales, bias, y, y_stride, n_in, n_out, ld,
                scale_ld, best, top);
        return;
    }
    const int t = omp_get_thread_num();
    const int64_t size = omp_get_num_threads(), per = (n_out + size - 1) / size;
    const int64_t first = t * per, last = first + per < n_out ? first + per : n_out;
    const uint8_t *w = (const uint8_t *)weight;
    const uint8_t *end = first < last ? w + (last - 1) * row_bytes(type, ld) + row_bytes(type, ld) : w;
    float out[ASTRAI_MAX_DEQUANT_ROWS];
    /* int8 and int4 quantize x, bf16 rounds it (below): each thread for itself (a few
     * microseconds), so no barrier is needed */
    const int64_t blocks = (type == ASTRAI_Q8 || type == ASTRAI_Q4 || type == ASTRAI_Q41) && first < last
                               ? (n_in + BLOCK - 1) / BLOCK : 0;
    int8_t xq[rows * blocks * BLOCK + 1] __attribute__((aligned(32)));
    float xd[rows * blocks + 1], xs[rows * blocks + 1];
    int32_t xo[rows * blocks * 8 + 1] __attribute__((aligned(32)));
    if (blocks) quantize_activations(x, x_stride, rows, n_in, xq, xd, type != ASTRAI_Q8 ? xo : NULL, xs);
#if DEQUANT_AVX2
    if (blocks && type != ASTRAI_Q8) pair_blocks(xq, xo, rows, blocks);
#endif
    const bf16_row_t *xr = NULL;
    if (type == ASTRAI_BF16 && first < last) {
        xr = bf16_rounded_rows(x, rows, x_stride, n_in);
        if (xr == NULL) {  /* no memory for a few rows: NaN outputs rather than other numbers */
            for (int64_t j = first; j < last; ++j)
                for (int64_t r = 0; r < rows; ++r) y[r * y_stride + j] = NAN;
            if (best)
                for (int64_t r = 0; r < rows; ++r) best[r * MAX_TEAM + t] = first, top[r * MAX_TEAM + t] = NAN;
            return;
        }
    }
    /* the first `streams` parts of the stretch side by side (weight_streams), then the rest */
    const int streams = weight_streams(type, rows);
    const int64_t part = streams > 1 ? (last - first) / streams : 0, side_by_side_end = first + part;
    for (int64_t j = first; j < last; j = j + 1 == side_by_side_end ? first + streams * part : j + 1) {
        const int side = j < side_by_side_end ? streams : 1;
        /* a literal row count (and stream count) per case: each copy keeps its sums in registers */
        switch (side == 1 ? rows : 16 * side + rows) {
#define DOT(n, s) dequant_dot(type, w, j, ld, scales, scale_ld, x, x_stride, n, n_in, out, end, xq, xd, xo, xs, xr, s, part)
        case 16 * 4 + 1: DOT(1, 4); break;
        case 16 * 2 + 1: DOT(1, 2); break;
        case 16 * 2 + 2: DOT(2, 2); break;
#define ROWS_CASE(n) case n: DOT(n, 1); break;
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
        default: DOT(ASTRAI_MAX_DEQUANT_ROWS, 1);
#undef ROWS_CASE
#undef DOT
        }
        for (int k = 0; k < side; ++k) {
            const int64_t o = j + k * part;
            const float b = bias ? bias[o] : 0.0f;
            for (int64_t r = 0; r < rows; ++r) y[r * y_stride + o] = out[k * rows + r] + b;
        }
    }
    stretch_argmax(y, y_stride, rows, first, last, best, top, t);
}

/* y [rows][y_stride] = x [rows][x_stride] W^T (+ bias), shared among `threads`; with
 * `want_argmax` (one row), returns torch.argmax of y's row, else -1. */
int64_t astrai_dequant_matmul(const float *x, int64_t rows, int64_t x_stride, const void *weight,
                              const uint16_t *scales, int type, const float *bias, float *y, int64_t y_stride,
                              int64_t n_in, int64_t n_out, int64_t ld, int64_t scale_ld, int threads, int want_argmax)
{
    if (threads > MAX_TEAM) threads = MAX_TEAM;
    if (rows < 1 || rows > ASTRAI_MAX_DEQUANT_ROWS) return -2;
    int64_t best[MAX_TEAM];
    float top[MAX_TEAM];
    int team = 1;
    #pragma omp parallel num_threads(threads)
    {
        astrai_team_dequant_matmul(x, rows, x_stride, weight, scales, type, bias, y, y_stride, n_in, n_out, ld,
                                   scale_ld, want_argmax && rows == 1 ? best : 0, top);
        if (omp_get_thread_num() == 0) team = omp_get_num_threads();
    }
    return want_argmax && rows == 1 ? astrai_team_argmax(best, top, team) : -1;
}

/* out = x rounded to Q8_0 blocks along its rows of n_in, as floats: quantized.py's
 * `quantize_activations` in one pass (d = max|x| * (1/127), q = x / d rounded to even, q
 * times the fp16-rounded d; a block holding a NaN or an infinity becomes NaN, as there). For
 * a prompt's int4 matmuls, whose activations torch would round in several passes. */
void astrai_round_activations(const float *x, int64_t rows, int64_t n_in, float *out, int threads)
{
    const int64_t blocks = (n_in + BLOCK - 1) / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows * blocks; ++i) {
        const int64_t r = i / blocks, first = (i % blocks) * BLOCK;
        const int64_t n = n_in - first < BLOCK ? n_in - first : BLOCK;
        const float *xb = x + r * n_in + first;
        float *ob = out + r * n_in + first;
        float inverse;
        const float kept = block_step(xb, n, &inverse);
        for (int64_t k = 0; k < n; ++k) ob[k] = rintf(xb[k] * inverse) * kept;
    }
}

/* Rows of x rounded to Q8_0 blocks as above, without the offsets: integer_matmul.c's input. */
void astrai_quantize_rows_q8(const float *x, int64_t x_stride, int64_t rows, int64_t n_in, int8_t *values,
                             float *steps, float *sums)
{
    quantize_activations(x, x_stride, rows, n_in, values, steps, NULL, sums);
}

/* An fp16 value as a float, for the other native files. */
float astrai_half_value(uint16_t h) { return half_to_float(h); }

/* The intrinsics this build's loops use, as bits (kernels.py's FEATURE_*): 1 AVX2 and FMA,
 * 2 AVX-512's sixteen-lane loops, 4 VNNI's integer sums, 8 bf16_matmul.c's vdpbf16ps (its
 * condition); 0 for plain C loops. */
int astrai_kernel_features(void) { return DEQUANT_AVX2 | DEQUANT_AVX512 << 1 | DEQUANT_VNNI << 2 | BF16_PRODUCTS << 3; }

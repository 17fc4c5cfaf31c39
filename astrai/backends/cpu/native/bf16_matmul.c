/* bf16 matmul (W16A16) of many rows (a prompt) by a bf16 weight on a CPU with AVX512-BF16:
 * y = x W^T (+ bias) for x fp32 [rows][n_in] and W bf16 [n_out][n_in], `ld` elements between
 * two rows of W.
 *
 * x is first rounded to bf16 (ties to even, as torch's .bfloat16() rounds it, by
 * vcvtne2ps2bf16); each product of two bf16 values is then exact in fp32, and vdpbf16ps
 * adds two of them to each of sixteen fp32 lanes per instruction, twice an fp32 FMA's
 * multiply-adds. The result is F.linear over the rounded x and the weight but for the order
 * of the additions (and both instructions' flushing of subnormal values to zero).
 *
 * The layout follows integer_matmul.c's. Each thread takes sixteen weight rows at a time (two
 * such groups for a prompt) and interleaves them: 64 bytes hold inputs 2k and 2k + 1 of the
 * sixteen rows, so one vdpbf16ps against that pair of x (broadcast) adds partial dot products
 * of the sixteen rows to the sixteen lanes, and the outputs need no horizontal sums. The
 * interleaved rows (64 x n_in bytes a pair of groups) stay in the thread's cache while every
 * row of x passes over them, twelve rows a pass: 24 accumulators, two weight registers and a
 * broadcast. Built without AVX512-BF16 (or with ASTRAI_PORTABLE) the function declines, and the
 * caller widens the weight for an fp32 GEMM over the rounded x instead (dense_rows.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(ASTRAI_PORTABLE)
#define BF16_NATIVE 1
#include <immintrin.h>
#else
#define BF16_NATIVE 0
#endif

#if BF16_NATIVE
enum { LANES = 16, TILE = 12 };

/* out[0 .. n) = in[0 .. n) rounded to bf16, to nearest with ties to even, 32 at a time by
 * vcvtne2ps2bf16 (which, as vdpbf16ps, takes subnormal values as zero; a NaN stays a NaN);
 * dequant_matmul.c rounds its few rows with it too */
void astrai_bf16_round_row(const float *in, int64_t n, uint16_t *out)
{
    for (int64_t i = 0; i < n; i += 32) {
        const int64_t left = n - i;
        const __mmask16 low = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
        const __mmask16 high = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, in + i + 16), _mm512_maskz_loadu_ps(low, in + i));
        _mm512_mask_storeu_epi16(out + i, left >= 32 ? ~(__mmask32)0 : (__mmask32)((1ull << left) - 1u), (__m512i)both);
    }
}

static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }


/* Sixteen weight rows from `first` (rows past n_out are zero) interleaved in pairs of inputs:
 * `pairs` [n_pairs][16] of (input 2k) | (input 2k + 1) << 16. */
static void interleave_group(const uint16_t *w, int64_t ld, int64_t first, int64_t n_out, int64_t n_in,
                             int64_t n_pairs, uint32_t *pairs)
{
    for (int c = 0; c < LANES; ++c) {
        const int live = first + c < n_out;
        const uint16_t *row = w + (first + c) * ld;
        for (int64_t k = 0; k < n_pairs; ++k) {
            const uint32_t low = live ? row[2 * k] : 0;
            const uint32_t high = live && 2 * k + 1 < n_in ? row[2 * k + 1] : 0;
            pairs[k * LANES + c] = low | high << 16;
        }
    }
}

/* acc[r][g] += row r < count of x (its bf16 pairs, n_pairs apart) times group g < groups */
static inline __attribute__((always_inline)) void group_tile(const uint32_t *weights, int64_t group_stride,
                                                             const uint32_t *x, int64_t n_pairs, int groups,
                                                             int count, __m512 acc[TILE][2])
{
    for (int r = 0; r < count; ++r)
        for (int g = 0; g < groups; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n_pairs; ++k) {
        __m512bh w[2];
        for (int g = 0; g < groups; ++g)
            w[g] = (__m512bh)_mm512_load_si512((const void *)(weights + g * group_stride + k * LANES));
        for (int r = 0; r < count; ++r) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)x[r * n_pairs + k]);
            for (int g = 0; g < groups; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], w[g], pair);
        }
    }
}

/* y[r][first .. first + 16 groups) (those below n_out) for every row r of x */
static void group_rows(const uint32_t *weights, int64_t group_stride, int groups, const uint32_t *x, int64_t rows,
                       int64_t n_pairs, const float *bias, float *y, int64_t y_stride, int64_t first, int64_t n_out)
{
    float lanes[LANES] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        const int count = rows - r0 < TILE ? (int)(rows - r0) : TILE;
        __m512 acc[TILE][2];
        if (groups == 2 && count == TILE)
            group_tile(weights, group_stride, x + r0 * n_pairs, n_pairs, 2, TILE, acc);
        else
            group_tile(weights, group_stride, x + r0 * n_pairs, n_pairs, groups, count, acc);
        for (int r = 0; r < count; ++r)
            for (int g = 0; g < groups; ++g) {
                const int64_t start = first + g * LANES;
                float *out = y + (r0 + r) * y_stride + start;
                __m512 sums = acc[r][g];
                if (start + LANES <= n_out) {
                    if (bias) sums = _mm512_add_ps(sums, _mm512_loadu_ps(bias + start));
                    _mm512_storeu_ps(out, sums);
                    continue;
                }
                _mm512_store_ps(lanes, sums);
                for (int c = 0; start + c < n_out; ++c) out[c] = lanes[c] + (bias ? bias[start + c] : 0.0f);
            }
    }
}
#endif

/* y [rows][y_stride] = x [rows][x_stride] W^T (+ bias) for the bf16 weight W [n_out][n_in]
 * (`ld` elements between rows), shared among `threads`. Returns 0, -1 when this build has no
 * AVX512-BF16, -2 when memory ran out. */
int64_t astrai_bf16_matmul(const float *x, int64_t rows, int64_t x_stride, const uint16_t *weight, int64_t ld,
                           const float *bias, float *y, int64_t y_stride, int64_t n_in, int64_t n_out, int threads)
{
#if BF16_NATIVE
    if (rows <= 0 || n_out <= 0) return 0;
    const int64_t n_pairs = (n_in + 1) / 2;
    uint32_t *xb = aligned(sizeof(uint32_t) * (size_t)(rows * n_pairs + 1));
    int failed = xb == NULL;
    if (!failed) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < rows; ++r) {  /* each row as bf16 pairs, an odd row's last one padded with 0 */
            uint16_t *out = (uint16_t *)(xb + r * n_pairs);
            out[2 * n_pairs - 1] = 0;
            astrai_bf16_round_row(x + r * x_stride, n_in, out);
        }
        const int64_t groups = (n_out + LANES - 1) / LANES, stride = n_pairs * LANES;
        #pragma omp parallel num_threads(threads)
        {
            uint32_t *weights = aligned(sizeof(uint32_t) * (size_t)(2 * stride));
            if (weights == NULL) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < (groups + 1) / 2; ++p) {
                if (weights == NULL) continue;
                const int pair = groups - 2 * p < 2 ? 1 : 2;
                for (int g = 0; g < pair; ++g)
                    interleave_group(weight, ld, (2 * p + g) * LANES, n_out, n_in, n_pairs, weights + g * stride);
                group_rows(weights, stride, pair, xb, rows, n_pairs, bias, y, y_stride, 2 * p * LANES, n_out);
            }
            free(weights);
        }
    }
    free(xb);
    return failed ? -2 : 0;
#else
    (void)x, (void)rows, (void)x_stride, (void)weight, (void)ld, (void)bias, (void)y, (void)y_stride, (void)n_in,
        (void)n_out, (void)threads;
    return -1;
#endif
}

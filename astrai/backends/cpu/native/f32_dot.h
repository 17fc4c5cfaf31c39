/* The dot product of two fp32 rows in one fixed order of additions, shared by the one-row GEMV
 * (row_matmul.c) and the several-row matmul over fp32 weights (dequant_matmul.c): a row of x
 * then gets the same sum bit for bit from either, and greedy speculative decoding, which
 * decodes with the first and verifies drafted tokens with the second, gives the tokens plain
 * decoding gives.
 *
 * The order: 32 partial sums p[k] += w[i + k] x[i + k] over the whole 32-float chunks (each a
 * fused multiply-add where the build has FMA), folded in halves (p[k] += p[k + 16], then
 * p[k + 8], p[k + 4], p[k + 2], p[k + 1]), then the last n % 32 products added one by one.
 * AVX-512 and AVX2 builds write it in intrinsics (two or four accumulators, which also keeps
 * the loop off one chain of dependent adds), the plain-C build in loops; all of it is compiled
 * with reassociation off, which the build's fast-math flags would otherwise allow. */
#ifndef ASTRAI_F32_DOT_H
#define ASTRAI_F32_DOT_H

#include <stdint.h>

#if (defined(__AVX2__) && defined(__FMA__)) && !defined(ASTRAI_PORTABLE)
#include <immintrin.h>
#define F32_DOT_AVX2 1
#else
#define F32_DOT_AVX2 0
#endif
#if F32_DOT_AVX2 && defined(__AVX512F__)
#define F32_DOT_AVX512 1
#else
#define F32_DOT_AVX512 0
#endif

#if defined(__clang__)
#define F32_DOT_IN_ORDER __attribute__((noinline))
#define F32_DOT_FOLD_ATTRIBUTES __attribute__((always_inline))
#define F32_DOT_ORDER_PRAGMA _Pragma("clang fp reassociate(off)")
#else
#define F32_DOT_IN_ORDER __attribute__((noinline, optimize("no-associative-math")))
#define F32_DOT_FOLD_ATTRIBUTES __attribute__((always_inline, optimize("no-associative-math")))
#define F32_DOT_ORDER_PRAGMA
#endif

#if F32_DOT_AVX2
/* p[0] + ... in halves, from eight partial sums (p[k] already holds p[k] + p[k + 8] + ...) */
static inline F32_DOT_FOLD_ATTRIBUTES float f32_dot_fold8(__m256 a)
{
    F32_DOT_ORDER_PRAGMA
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  /* p[k] += p[k + 4] */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         /* p[k] += p[k + 2] */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));                                     /* p[0] += p[1] */
    return _mm_cvtss_f32(s);
}
#endif

/* out[j * out_stride + r] = (row j of w) · (row r of x) for j < count and r < rows, each in the
 * order above: `ld` floats between rows of w, `x_stride` between rows of x. With `streams` 2,
 * rows j and j + gap of w are read side by side for j < count (out also at j + gap): one
 * weight row at a time keeps too few cache lines in flight for a core to reach the memory's
 * pace. One function for every caller, compiled with reassociation off, so that no caller's
 * loop reorders a sum, and each pair of rows sums alone, so streams do not change the sums. */
static F32_DOT_IN_ORDER void f32_dots(const float *w, int64_t ld, int64_t count, int64_t gap, int streams,
                                      const float *x, int64_t x_stride, int rows, int64_t n, float *out,
                                      int64_t out_stride)
{
    F32_DOT_ORDER_PRAGMA
    if (streams < 1 || streams > 2) streams = 1;
    for (int64_t j = 0; j < count; ++j)
        for (int r = 0; r < rows; ++r) {
            const float *xr = x + r * x_stride;
            int64_t i = 0;
            float s[2] = {0.0f, 0.0f};
#if F32_DOT_AVX512
            __m512 low[2], high[2];
            for (int t = 0; t < streams; ++t) low[t] = high[t] = _mm512_setzero_ps();
            for (; i + 32 <= n; i += 32)
                for (int t = 0; t < streams; ++t) {
                    const float *wj = w + (j + t * gap) * ld;
                    low[t] = _mm512_fmadd_ps(_mm512_loadu_ps(wj + i), _mm512_loadu_ps(xr + i), low[t]);
                    high[t] = _mm512_fmadd_ps(_mm512_loadu_ps(wj + i + 16), _mm512_loadu_ps(xr + i + 16), high[t]);
                }
            for (int t = 0; i && t < streams; ++t) {
                const __m512 half = _mm512_add_ps(low[t], high[t]);                  /* p[k] += p[k + 16] */
                s[t] = f32_dot_fold8(_mm256_add_ps(_mm512_castps512_ps256(half),     /* p[k] += p[k + 8] */
                                                   _mm512_extractf32x8_ps(half, 1)));
            }
#elif F32_DOT_AVX2
            __m256 a[2][4];
            for (int t = 0; t < streams; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm256_setzero_ps();
            for (; i + 32 <= n; i += 32)
                for (int t = 0; t < streams; ++t) {
                    const float *wj = w + (j + t * gap) * ld;
                    for (int k = 0; k < 4; ++k)
                        a[t][k] = _mm256_fmadd_ps(_mm256_loadu_ps(wj + i + 8 * k), _mm256_loadu_ps(xr + i + 8 * k), a[t][k]);
                }
            for (int t = 0; i && t < streams; ++t)  /* p[k] += p[k + 16], then p[k] += p[k + 8] */
                s[t] = f32_dot_fold8(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][2]), _mm256_add_ps(a[t][1], a[t][3])));
#else
            for (int t = 0; t < streams; ++t) {
                const float *wj = w + (j + t * gap) * ld;
                float p[32] = {0.0f};
                for (; i + 32 <= n; i += 32)
                    for (int k = 0; k < 32; ++k) p[k] += wj[i + k] * xr[i + k];
                for (int width = 16; width >= 1; width /= 2)
                    for (int k = 0; k < width; ++k) p[k] += p[k + width];
                s[t] = p[0];
                if (t + 1 < streams) i = 0;
            }
#endif
            const int64_t tail = i;
            for (int t = 0; t < streams; ++t) {
                const float *wj = w + (j + t * gap) * ld;
                for (i = tail; i < n; ++i) s[t] += wj[i] * xr[i];
                out[(j + t * gap) * out_stride + r] = s[t];
            }
        }
}

#endif

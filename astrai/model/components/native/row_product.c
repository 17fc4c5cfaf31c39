/* One-row product y = x W^T (+ bias) for a column-major weight: the decode step of a
 * single request, where the whole step is the time it takes to stream the weights.
 *
 * The weight is stored as wt [in][out] (row stride ld). Each thread takes a contiguous
 * stretch of the inner dimension, which is one contiguous stretch of memory read front
 * to back, and sums x[i] * wt[i, :] eight rows at a time into a partial of all outputs;
 * thread 0's partial is y itself, the others' live in `scratch` [threads - 1][out], and
 * they are added (with the bias) at the end. Splitting the outputs instead would give
 * each thread one short stretch per input row, which streamed 10-20% slower here.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

void astrai_row_product_f32(
    const float *x, const float *wt, const float *bias, float *y, float *scratch,
    int64_t n_in, int64_t n_out, int64_t ld, int threads)
{
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = (n_in + nt - 1) / nt;
        const int64_t lo = t * per < n_in ? t * per : n_in;
        const int64_t hi = lo + per < n_in ? lo + per : n_in;
        float *acc = t == 0 ? y : scratch + (int64_t)(t - 1) * n_out;
        memset(acc, 0, sizeof(float) * (size_t)n_out);
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8) {
            const float *xi = x + i, *r = wt + i * ld;
            #pragma omp simd
            for (int64_t j = 0; j < n_out; ++j)
                acc[j] += xi[0] * r[j] + xi[1] * r[ld + j] + xi[2] * r[2 * ld + j] + xi[3] * r[3 * ld + j]
                        + xi[4] * r[4 * ld + j] + xi[5] * r[5 * ld + j] + xi[6] * r[6 * ld + j] + xi[7] * r[7 * ld + j];
        }
        for (; i < hi; ++i) {
            const float xi = x[i];
            const float *r = wt + i * ld;
            #pragma omp simd
            for (int64_t j = 0; j < n_out; ++j) acc[j] += xi * r[j];
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n_out; ++j) {
            float s = y[j];
            for (int u = 1; u < nt; ++u) s += scratch[(int64_t)(u - 1) * n_out + j];
            y[j] = bias ? s + bias[j] : s;
        }
    }
}

/* Decode attention over the engine's decode buffers: one query token per row.
 *
 * For each (row, K/V head) pair the R query heads of the group score every key of
 * the row's own context (positions below lens[row], nothing past it is read), take a
 * softmax, and sum the values. K and V are read once each, straight from the
 * heads-first buffers [rows, heads, capacity, width] through their strides.
 * Pairs are shared among the OpenMP threads of PyTorch's own runtime (the library is
 * linked against the libgomp that torch loaded), dynamically, since rows differ in
 * length. Each thread's scores live in its slice of `workspace` [threads][group * max_len],
 * allocated by the caller, so nothing here can fail to allocate.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

void astrai_decode_attention_f32(
    const float *q, const float *k, const float *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    float scale, int64_t max_len, int threads)
{
    #pragma omp parallel num_threads(threads)
    {
        float *scores = workspace + (int64_t)omp_get_thread_num() * group * max_len;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t pair = 0; pair < rows * heads; ++pair) {
            const int64_t row = pair / heads, head = pair % heads, len = lens[row];
            const float *keys = k + row * k_row_stride + head * k_head_stride;
            const float *values = v + row * v_row_stride + head * v_head_stride;
            const float *query = q + pair * group * width;
            float *result = out + pair * group * v_width;
            for (int64_t pos = 0; pos < len; ++pos) {
                const float *key = keys + pos * k_pos_stride;
                for (int64_t g = 0; g < group; ++g) {
                    const float *qg = query + g * width;
                    float dot = 0.0f;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t i = 0; i < width; ++i) dot += qg[i] * key[i];
                    scores[g * len + pos] = dot * scale;
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                float *s = scores + g * len;
                float top = s[0];
                for (int64_t pos = 1; pos < len; ++pos) top = s[pos] > top ? s[pos] : top;
                float total = 0.0f;
                #pragma omp simd reduction(+:total)
                for (int64_t pos = 0; pos < len; ++pos) {
                    s[pos] = expf(s[pos] - top);
                    total += s[pos];
                }
                const float norm = 1.0f / total;
                float *o = result + g * v_width;
                for (int64_t i = 0; i < v_width; ++i) o[i] = 0.0f;
                for (int64_t pos = 0; pos < len; ++pos) {
                    const float p = s[pos] * norm;
                    const float *value = values + pos * v_pos_stride;
                    #pragma omp simd
                    for (int64_t i = 0; i < v_width; ++i) o[i] += p * value[i];
                }
            }
        }
    }
}

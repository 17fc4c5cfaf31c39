/* Decode attention over the engine's decode buffers: one query token per row.
 *
 * For each (row, K/V head) pair the R query heads of the group score every key of
 * the row's own context (positions below lens[row], nothing past it is read), take a
 * softmax, and sum the values. K and V are read once each, straight from the
 * heads-first buffers [rows, heads, capacity, width] through their strides: each key
 * is scored by all R heads while it is loaded (two keys at a time, two independent
 * sums), and each value is added into all R heads' sums while it is loaded.
 * Pairs are shared among the OpenMP threads of PyTorch's own runtime (the library is
 * linked against the libgomp that torch loaded), dynamically, since rows differ in
 * length. Each thread's scores live in its slice of `workspace` [threads][group * max_len],
 * allocated by the caller, so nothing here can fail to allocate.
 *
 * The common head shapes (width 64 with 1, 2 or 4 heads per group, width 128 with 1 or
 * 2) get copies compiled with those sizes fixed, whose per-head sums stay in registers
 * and run faster than the general loop. Other shapes run the same code with the sizes as
 * variables.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* one (row, K/V head) pair; W, VW, G are compile-time constants in the specialised copies */
static inline __attribute__((always_inline)) void attend_pair(
    const float *restrict query, const float *restrict keys, const float *restrict values,
    float *restrict result, float *restrict scores, int64_t len, int64_t kps, int64_t vps,
    float scale, const int64_t G, const int64_t W, const int64_t VW)
{
    float qs[G * W];
    for (int64_t i = 0; i < G * W; ++i) qs[i] = query[i] * scale;
    float top[G];
    for (int64_t g = 0; g < G; ++g) top[g] = -INFINITY;
    int64_t pos = 0;
    for (; pos + 2 <= len; pos += 2) {
        const float *restrict k0 = keys + pos * kps, *restrict k1 = k0 + kps;
        for (int64_t g = 0; g < G; ++g) {
            float d0 = 0.0f, d1 = 0.0f;
            #pragma omp simd reduction(+:d0, d1)
            for (int64_t i = 0; i < W; ++i) { d0 += qs[g * W + i] * k0[i]; d1 += qs[g * W + i] * k1[i]; }
            scores[g * len + pos] = d0; scores[g * len + pos + 1] = d1;
            float m = d0 > d1 ? d0 : d1;
            top[g] = m > top[g] ? m : top[g];
        }
    }
    for (; pos < len; ++pos) {
        const float *restrict k0 = keys + pos * kps;
        for (int64_t g = 0; g < G; ++g) {
            float d0 = 0.0f;
            #pragma omp simd reduction(+:d0)
            for (int64_t i = 0; i < W; ++i) d0 += qs[g * W + i] * k0[i];
            scores[g * len + pos] = d0;
            top[g] = d0 > top[g] ? d0 : top[g];
        }
    }
    float norm[G];
    for (int64_t g = 0; g < G; ++g) {
        float *restrict s = scores + g * len;
        const float t = top[g];
        float total = 0.0f;
        #pragma omp simd reduction(+:total)
        for (int64_t p = 0; p < len; ++p) { s[p] = expf(s[p] - t); total += s[p]; }
        norm[g] = 1.0f / total;
    }
    float acc[G * VW];
    for (int64_t i = 0; i < G * VW; ++i) acc[i] = 0.0f;
    for (int64_t p = 0; p < len; ++p) {
        const float *restrict value = values + p * vps;
        for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * len + p];
            #pragma omp simd
            for (int64_t i = 0; i < VW; ++i) acc[g * VW + i] += w * value[i];
        }
    }
    for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < VW; ++i) result[g * VW + i] = acc[g * VW + i] * norm[g];
}

#define PAIR_LOOP(G, W, VW) \
    _Pragma("omp for schedule(dynamic, 1) nowait") \
    for (int64_t pair = 0; pair < rows * heads; ++pair) { \
        const int64_t row = pair / heads, head = pair % heads; \
        attend_pair(q + pair * group * width, k + row * k_row_stride + head * k_head_stride, \
                    v + row * v_row_stride + head * v_head_stride, out + pair * group * v_width, scores, \
                    lens[row], k_pos_stride, v_pos_stride, scale, G, W, VW); \
    }

/* The pairs shared among the threads of the team running it (all of them on one thread
 * outside a parallel region), each thread's scores in its slice of `workspace`. No barrier:
 * the end of astrai_decode_attention_f32's region is one, and decode_step.c, which runs a
 * whole step inside one parallel region, puts its own after it. */
void astrai_decode_attention_team(
    const float *q, const float *k, const float *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    float scale, int64_t max_len)
{
    float *scores = workspace + (int64_t)omp_get_thread_num() * group * max_len;
    if (width == 64 && v_width == 64 && group == 1) { PAIR_LOOP(1, 64, 64) }
    else if (width == 64 && v_width == 64 && group == 2) { PAIR_LOOP(2, 64, 64) }
    else if (width == 64 && v_width == 64 && group == 4) { PAIR_LOOP(4, 64, 64) }
    else if (width == 128 && v_width == 128 && group == 1) { PAIR_LOOP(1, 128, 128) }
    else if (width == 128 && v_width == 128 && group == 2) { PAIR_LOOP(2, 128, 128) }
    else { PAIR_LOOP(group, width, v_width) }
}

void astrai_decode_attention_f32(
    const float *q, const float *k, const float *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    float scale, int64_t max_len, int threads)
{
    #pragma omp parallel num_threads(threads)
    astrai_decode_attention_team(q, k, v, out, lens, workspace, rows, heads, group, width, v_width, k_row_stride,
                                 k_head_stride, k_pos_stride, v_row_stride, v_head_stride, v_pos_stride, scale,
                                 max_len);
}

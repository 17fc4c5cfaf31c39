/* Decode attention over the engine's decode buffers: one query token per row.
 *
 * For each (row, K/V head) pair the R query heads of the group score every key of
 * the row's own context (positions below lens[row], nothing past it is read), take a
 * softmax, and sum the values. K and V are read once each, straight from the
 * heads-first buffers [rows, heads, capacity, width] through their strides: each key
 * is scored by all R heads while it is loaded (two keys at a time, two independent
 * sums), and each value is added into all R heads' sums while it is loaded.
 *
 * The cache may hold K/V in fp32, bf16 or fp16 (`kv_kind`): 16-bit values are widened to
 * fp32 as they are loaded (bf16 by a shift; fp16 by the compiler's _Float16 conversion,
 * F16C's vcvtph2ps where the CPU has it), so a long context costs half the bytes to read.
 *
 * Work is shared among the OpenMP threads of PyTorch's own runtime (the library is linked
 * against the libgomp that torch loaded). With at least as many rows as threads, each
 * thread takes whole pairs, dynamically, since rows differ in length. With fewer rows than
 * threads (a single request's decode), whole pairs would leave threads idle or unevenly
 * loaded (SmolLM2's 3 K/V heads on 2 threads: one thread does two thirds), so the context
 * is split instead (flash-decoding): thread t takes the t-th stretch of positions of every
 * pair and keeps that stretch's maximum score, sum of exponentials and unnormalised output;
 * the last thread to finish a pair (an atomic count per pair, no barrier) rescales the
 * stretches to their common maximum and adds them up.
 *
 * `workspace` (astrai_decode_attention_workspace_floats of them, zeroed once by the caller)
 * holds the per-pair counts, each thread's scores [group * max_len] and the stretches'
 * partial results; nothing here can fail to allocate. The counts are reset by the thread
 * that combines, so the workspace stays ready for the next call.
 *
 * The common head shapes (width 64 with 1, 2, 3 or 4 heads per group, width 128 with 1 or
 * 2) get copies compiled with those sizes fixed, whose per-head sums stay in registers
 * and run faster than the general loop. Other shapes run the same code with the sizes as
 * variables.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "exp_lanes.h"
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
enum { SPLIT_MAX_TEAM = 256 };  /* threads at most when the context is split: the counts' room per head */

#if defined(__FLT16_MAX__)
typedef _Float16 half_t;
#define HAS_HALF 1
#else  /* a compiler without _Float16: the fp16 kind is not offered (astrai_kv_kinds) */
typedef uint16_t half_t;
#define HAS_HALF 0
#endif

/* The K/V kinds this build reads and writes, one bit per kind. */
int astrai_kv_kinds(void) { return 1 << KV_F32 | 1 << KV_BF16 | HAS_HALF << KV_F16; }

/* element i of a K or V vector of kind KIND, as fp32 */
static inline __attribute__((always_inline)) float kv_at(const void *restrict base, int64_t i, const int KIND)
{
    if (KIND == KV_BF16) {
        union { uint32_t u; float f; } x = { .u = (uint32_t)((const uint16_t *)base)[i] << 16 };
        return x.f;
    }
    if (KIND == KV_F16) return (float)((const half_t *)base)[i];
    return ((const float *)base)[i];
}

/* n fp16 values widened to fp32 into dst (eight at a time with F16C: the compiler does not
 * vectorise _Float16's conversion inside the dot products' reductions) */
static inline __attribute__((always_inline)) void widen_half(const void *restrict src, float *restrict dst, int64_t n)
{
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))));
#endif
    for (; i < n; ++i) dst[i] = (float)((const half_t *)src)[i];
}

/* A K or V vector as the loops read it: fp16 widened into `buffer` first (the loops then read
 * fp32), fp32 and bf16 in place. */
static inline __attribute__((always_inline)) const void *readable(const void *row, float *buffer, int64_t n,
                                                                 const int KIND)
{
    if (KIND == KV_F16) { widen_half(row, buffer, n); return buffer; }
    return row;
}

static inline __attribute__((always_inline)) const void *kv_row(const void *base, int64_t index, const int KIND)
{
    return (const char *)base + index * (KIND == KV_F32 ? 4 : 2);
}

/* Positions [begin, end) of one (row, K/V head) pair: for each of the G heads, the largest
 * score `top`, the sum of exp(score - top) `total` and the unnormalised output `acc` [G][VW].
 * G, W, VW and KIND are compile-time constants in the specialised copies. */
static inline __attribute__((always_inline)) void attend_span(
    const float *restrict query, const void *restrict keys, const void *restrict values, float *restrict scores,
    int64_t begin, int64_t end, int64_t kps, int64_t vps, float scale,
    float *restrict top, float *restrict total, float *restrict acc,
    const int64_t G, const int64_t W, const int64_t VW, const int KIND)
{
    const int64_t n = end - begin;
    const int READ = KIND == KV_F16 ? KV_F32 : KIND;  /* the kind the loops read after `readable` */
    float qs[G * W], wide0[W], wide1[W > VW ? W : VW];
    for (int64_t i = 0; i < G * W; ++i) qs[i] = query[i] * scale;
    for (int64_t g = 0; g < G; ++g) { top[g] = -INFINITY; total[g] = 0.0f; }
    for (int64_t i = 0; i < G * VW; ++i) acc[i] = 0.0f;
    if (n <= 0) return;
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
        const void *restrict k0 = readable(kv_row(keys, (begin + j) * kps, KIND), wide0, W, KIND);
        const void *restrict k1 = readable(kv_row(keys, (begin + j + 1) * kps, KIND), wide1, W, KIND);
        for (int64_t g = 0; g < G; ++g) {
            float d0 = 0.0f, d1 = 0.0f;
            #pragma omp simd reduction(+:d0, d1)
            for (int64_t i = 0; i < W; ++i) {
                d0 += qs[g * W + i] * kv_at(k0, i, READ);
                d1 += qs[g * W + i] * kv_at(k1, i, READ);
            }
            scores[g * n + j] = d0; scores[g * n + j + 1] = d1;
            float m = d0 > d1 ? d0 : d1;
            top[g] = m > top[g] ? m : top[g];
        }
    }
    for (; j < n; ++j) {
        const void *restrict k0 = readable(kv_row(keys, (begin + j) * kps, KIND), wide0, W, KIND);
        for (int64_t g = 0; g < G; ++g) {
            float d0 = 0.0f;
            #pragma omp simd reduction(+:d0)
            for (int64_t i = 0; i < W; ++i) d0 += qs[g * W + i] * kv_at(k0, i, READ);
            scores[g * n + j] = d0;
            top[g] = d0 > top[g] ? d0 : top[g];
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float *restrict s = scores + g * n;
        const float t = top[g];
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t p = 0; p < n; ++p) { s[p] = exp_lanes(s[p] - t); sum += s[p]; }
        total[g] = sum;
    }
    for (int64_t p = 0; p < n; ++p) {
        const void *restrict value = readable(kv_row(values, (begin + p) * vps, KIND), wide1, VW, KIND);
        for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * n + p];
            #pragma omp simd
            for (int64_t i = 0; i < VW; ++i) acc[g * VW + i] += w * kv_at(value, i, READ);
        }
    }
}

/* one whole pair on this thread */
static inline __attribute__((always_inline)) void attend_pair(
    const float *restrict query, const void *restrict keys, const void *restrict values, float *restrict result,
    float *restrict scores, int64_t len, int64_t kps, int64_t vps, float scale,
    const int64_t G, const int64_t W, const int64_t VW, const int KIND)
{
    float top[G], total[G], acc[G * VW];
    attend_span(query, keys, values, scores, 0, len, kps, vps, scale, top, total, acc, G, W, VW, KIND);
    for (int64_t g = 0; g < G; ++g) {
        const float norm = 1.0f / total[g];
        for (int64_t i = 0; i < VW; ++i) result[g * VW + i] = acc[g * VW + i] * norm;
    }
}

/* The `team` stretches of one pair (each [top G][total G][acc G*VW]) rescaled to their common
 * maximum and summed: the softmax-weighted sum over the whole context. */
static void combine_stretches(const float *parts, int team, float *result, int64_t G, int64_t VW)
{
    const int64_t part = 2 * G + G * VW;
    for (int64_t g = 0; g < G; ++g) {
        float top = -INFINITY;
        for (int t = 0; t < team; ++t) top = parts[t * part + g] > top ? parts[t * part + g] : top;
        float total = 0.0f;
        for (int64_t i = 0; i < VW; ++i) result[g * VW + i] = 0.0f;
        for (int t = 0; t < team; ++t) {
            const float *stretch = parts + t * part;
            if (stretch[G + g] == 0.0f) continue;  /* an empty stretch (a context shorter than the team) */
            const float weight = expf(stretch[g] - top);
            total += weight * stretch[G + g];
            for (int64_t i = 0; i < VW; ++i) result[g * VW + i] += weight * stretch[2 * G + g * VW + i];
        }
        const float norm = 1.0f / total;
        for (int64_t i = 0; i < VW; ++i) result[g * VW + i] *= norm;
    }
}

#define PAIR_LOOP(G, W, VW, KIND) \
    _Pragma("omp for schedule(dynamic, 1) nowait") \
    for (int64_t pair = 0; pair < rows * heads; ++pair) { \
        const int64_t row = pair / heads, head = pair % heads; \
        attend_pair(q + pair * group * width, kv_row(k, row * k_row_stride + head * k_head_stride, KIND), \
                    kv_row(v, row * v_row_stride + head * v_head_stride, KIND), out + pair * group * v_width, \
                    scores, lens[row], k_pos_stride, v_pos_stride, scale, G, W, VW, KIND); \
    }

#define SPLIT_LOOP(G, W, VW, KIND) \
    for (int64_t pair = 0; pair < rows * heads; ++pair) { \
        const int64_t row = pair / heads, head = pair % heads, len = lens[row]; \
        float *mine = partials + (pair * team + thread) * (2 * G + G * VW); \
        attend_span(q + pair * group * width, kv_row(k, row * k_row_stride + head * k_head_stride, KIND), \
                    kv_row(v, row * v_row_stride + head * v_head_stride, KIND), scores, \
                    len * thread / team, len * (thread + 1) / team, k_pos_stride, v_pos_stride, scale, \
                    mine, mine + G, mine + 2 * G, G, W, VW, KIND); \
        if (__atomic_add_fetch(&counts[pair], 1, __ATOMIC_ACQ_REL) == team) { \
            __atomic_store_n(&counts[pair], 0, __ATOMIC_RELAXED); \
            combine_stretches(partials + pair * team * (2 * G + G * VW), team, out + pair * group * v_width, G, VW); \
        } \
    }

#define SHAPES(LOOP, KIND) \
    if (width == 64 && v_width == 64 && group == 1) { LOOP(1, 64, 64, KIND) } \
    else if (width == 64 && v_width == 64 && group == 2) { LOOP(2, 64, 64, KIND) } \
    else if (width == 64 && v_width == 64 && group == 3) { LOOP(3, 64, 64, KIND) } \
    else if (width == 64 && v_width == 64 && group == 4) { LOOP(4, 64, 64, KIND) } \
    else if (width == 128 && v_width == 128 && group == 1) { LOOP(1, 128, 128, KIND) } \
    else if (width == 128 && v_width == 128 && group == 2) { LOOP(2, 128, 128, KIND) } \
    else { LOOP(group, width, v_width, KIND) }

/* The floats `workspace` must hold for up to `threads` threads (see the top of the file). */
int64_t astrai_decode_attention_workspace_floats(int64_t heads, int64_t group, int64_t v_width, int64_t max_len,
                                                 int64_t threads)
{
    const int64_t split_pairs = (threads - 1) * heads;  /* fewer rows than threads */
    return heads * SPLIT_MAX_TEAM + threads * group * max_len + split_pairs * threads * (2 * group + group * v_width);
}

/* The work of the team running it (all of it on one thread outside a parallel region). No
 * barrier at the end: the end of astrai_decode_attention_f32's region is one, and
 * decode_step.c, which runs a whole step inside one parallel region, puts its own after it. */
void astrai_decode_attention_team(
    const float *q, const void *k, const void *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    float scale, int64_t max_len, int kv_kind)
{
    const int team = omp_get_num_threads(), thread = omp_get_thread_num();
    int32_t *counts = (int32_t *)workspace;
    float *scores = workspace + heads * SPLIT_MAX_TEAM + (int64_t)thread * group * max_len;
    float *partials = workspace + heads * SPLIT_MAX_TEAM + (int64_t)team * group * max_len;
    if (rows < team && team <= SPLIT_MAX_TEAM) {
        if (kv_kind == KV_BF16) { SHAPES(SPLIT_LOOP, KV_BF16) }
        else if (kv_kind == KV_F16) { SHAPES(SPLIT_LOOP, KV_F16) }
        else { SHAPES(SPLIT_LOOP, KV_F32) }
    } else {
        if (kv_kind == KV_BF16) { SHAPES(PAIR_LOOP, KV_BF16) }
        else if (kv_kind == KV_F16) { SHAPES(PAIR_LOOP, KV_F16) }
        else { SHAPES(PAIR_LOOP, KV_F32) }
    }
}

void astrai_decode_attention_f32(
    const float *q, const void *k, const void *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    float scale, int64_t max_len, int kv_kind, int threads)
{
    #pragma omp parallel num_threads(threads)
    astrai_decode_attention_team(q, k, v, out, lens, workspace, rows, heads, group, width, v_width, k_row_stride,
                                 k_head_stride, k_pos_stride, v_row_stride, v_head_stride, v_pos_stride, scale,
                                 max_len, kv_kind);
}

/* x rounded to the cache's kind: bf16 to nearest even (as torch's .to(torch.bfloat16)), fp16 by
 * the compiler's conversion (F16C's vcvtps2ph where the CPU has it) */
void astrai_store_kv(void *dst, const float *src, int64_t n, int kv_kind)
{
    if (kv_kind == KV_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; ++i) {
            union { float f; uint32_t u; } x = { .f = src[i] };
            d[i] = (x.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((x.u >> 16) | 0x40)  /* NaN stays NaN */
                                                      : (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
        }
    } else if (kv_kind == KV_F16) {
        half_t *d = (half_t *)dst;
        for (int64_t i = 0; i < n; ++i) d[i] = (half_t)src[i];
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

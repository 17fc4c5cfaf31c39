/* Decode attention: one query token per row, over that row's cached context.
 *
 * Each row's query heads score every key of the row's own context (positions below
 * lens[row], nothing past it is read), take a softmax, and sum the values. A row's
 * positions lie either densely (the decode buffers [rows, heads, capacity, width], read
 * through their strides) or in the page store ([slots, heads, width], slot = page *
 * page_size + offset), through the row's page list (`pages`): nothing is copied or gathered
 * either way. All K/V heads of a row are read together, since a page holds every head of its
 * positions side by side; each key is scored by its group's query heads while it is loaded
 * (two keys at a time, two independent sums), and each value is added into their sums while
 * it is loaded. Pages may lie anywhere in the store, so the hardware prefetchers' streams
 * break at each page; software prefetch reads a fixed distance ahead across page boundaries.
 *
 * The cache may hold K/V in fp32, bf16 or fp16 (`kv_kind`): 16-bit values are widened to
 * fp32 as they are loaded (bf16 by a shift; fp16 by the compiler's _Float16 conversion,
 * F16C's vcvtph2ps where the CPU has it), so a long context costs half the bytes to read.
 *
 * Work is shared among the OpenMP threads of PyTorch's own runtime (the library is linked
 * against the libgomp that torch loaded) by splitting every row's context (flash-decoding):
 * thread t takes the t-th stretch of each row's positions, so threads stay evenly loaded
 * whatever the rows' count and lengths, and keeps that stretch's maximum score, sum of
 * exponentials and unnormalised output per head; the last thread to finish a row (an atomic
 * count per row, no barrier) rescales the stretches to their common maximum and adds them up.
 *
 * `workspace` (astrai_decode_attention_workspace_floats of them, the counts zeroed once by
 * the caller) holds the per-row counts, each thread's scores and the stretches' partial
 * results; nothing here can fail to allocate. The counts are reset by the thread that
 * combines, so the workspace stays ready for the next call.
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
#if (defined(__F16C__) && defined(__AVX__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

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

/* Where position `pos` of a context lies, in K/V vectors from `base` (positions `stride`
 * elements apart): the context's own position when `pages` is NULL (a dense row), else its
 * slot in the page store, on page pages[pos / page_size]. `*run` receives how many positions
 * from `pos` on (at most `left`) follow it contiguously: the rest of its page. */
static inline __attribute__((always_inline)) const void *kv_position(
    const void *base, const int64_t *pages, int64_t page_size, int64_t pos, int64_t left, int64_t stride,
    int64_t *run, const int KIND)
{
    if (!pages) { *run = left; return kv_row(base, pos * stride, KIND); }
    const int64_t page = pos / page_size, offset = pos - page * page_size;
    *run = page_size - offset < left ? page_size - offset : left;
    return kv_row(base, (pages[page] * page_size + offset) * stride, KIND);
}

/* Software prefetch for a paged context: the hardware prefetchers follow a stream, and a
 * context whose pages lie anywhere in the store is a new stream every page (16 positions by
 * default), so each position read asks for the one PREFETCH_BYTES further on to be loaded,
 * looking past the end of the current run into the next one. */
#define PREFETCH_BYTES 2048
struct run_ahead { const char *next; int64_t next_run, step, bytes, distance; };

static inline __attribute__((always_inline)) struct run_ahead look_ahead(
    const void *base, const int64_t *pages, int64_t page_size, int64_t pos, int64_t left, int64_t stride,
    const int KIND)
{
    struct run_ahead a = { 0, 0, stride * (KIND == KV_F32 ? 4 : 2), 0, 0 };
    a.bytes = a.step;
    a.distance = (PREFETCH_BYTES + a.step - 1) / a.step;
    if (pages && left > 0) a.next = kv_position(base, pages, page_size, pos, left, stride, &a.next_run, KIND);
    return a;
}

/* prefetch position r + distance of a run of `run` positions from `here` */
static inline __attribute__((always_inline)) void prefetch_ahead(const struct run_ahead *a, const void *here,
                                                                 int64_t r, int64_t run)
{
    const int64_t at = r + a->distance;
    const char *p = at < run ? (const char *)here + at * a->step
                  : at - run < a->next_run ? a->next + (at - run) * a->step : 0;
    if (p)
        for (int64_t b = 0; b < a->bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Each of `heads` rows of `n` scores (`scores` [heads][n]) turned into exp(score - top[row]),
 * and their sums into total[row]. */
static inline __attribute__((always_inline)) void exponentiate(float *restrict scores, int64_t heads, int64_t n,
                                                               const float *restrict top, float *restrict total)
{
    for (int64_t g = 0; g < heads; ++g) {
        float *restrict s = scores + g * n;
        const float t = top[g];
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t p = 0; p < n; ++p) { s[p] = exp_lanes(s[p] - t); sum += s[p]; }
        total[g] = sum;
    }
}

/* The vector instructions attend_span_w64 is written in: sixteen lanes of AVX-512 or eight of
 * AVX2. Each gives a load of a K/V vector's lanes widened to fp32 (bf16 by a shift, fp16 by
 * vcvtph2ps) and a sum of a block's dot products: v[l]'s lanes summed into lane l of the result
 * for all LANES vectors at once, in about three shuffles and adds per vector against some eight
 * for a vector summed alone. Every lane's sum takes the same tree of additions, so a dot
 * product's value does not depend on its lane or on the vectors beside it. */
#if defined(__AVX512F__) && !defined(ASTRAI_PORTABLE)
#define SPAN_VECTORS 1
#define LANES 16
typedef __m512 lanes_t;
#define lanes_zero _mm512_setzero_ps
#define lanes_load _mm512_loadu_ps
#define lanes_store _mm512_storeu_ps
#define lanes_mul _mm512_mul_ps
#define lanes_fmadd _mm512_fmadd_ps
#define lanes_set1 _mm512_set1_ps
static inline __attribute__((always_inline)) lanes_t load_kv(const void *row, int64_t i, const int KIND)
{
    if (KIND == KV_F32) return _mm512_loadu_ps((const float *)row + i);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    if (KIND == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    return _mm512_cvtph_ps(half);
}

static inline __attribute__((always_inline)) lanes_t sum_lanes(const lanes_t v[LANES])
{
    __m512 u[8], w[4];
    for (int k = 0; k < 8; ++k)  /* per 128 bits: a0+a2, b0+b2, a1+a3, b1+b3 */
        u[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k)  /* per 128 bits: a, b, c, d (a quarter of each) */
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(ASTRAI_PORTABLE)
#define SPAN_VECTORS 1
#define LANES 8
typedef __m256 lanes_t;
#define lanes_zero _mm256_setzero_ps
#define lanes_load _mm256_loadu_ps
#define lanes_store _mm256_storeu_ps
#define lanes_mul _mm256_mul_ps
#define lanes_fmadd _mm256_fmadd_ps
#define lanes_set1 _mm256_set1_ps
static inline __attribute__((always_inline)) lanes_t load_kv(const void *row, int64_t i, const int KIND)
{
    if (KIND == KV_F32) return _mm256_loadu_ps((const float *)row + i);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (KIND == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    return _mm256_cvtph_ps(half);
}

static inline __attribute__((always_inline)) lanes_t sum_lanes(const lanes_t v[LANES])
{
    __m256 u[4], w[2];
    for (int k = 0; k < 4; ++k)
        u[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; ++k)
        w[k] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
}
#else
#define SPAN_VECTORS 0
#endif

#if SPAN_VECTORS
/* attend_span for 64-wide heads and up to four query heads per K/V head. One K/V head at a
 * time: its keys LANES / 4 positions at a time, each scored by the group's queries (at most
 * LANES dot products, summed together by sum_lanes); then its values, each added into the
 * group's sums, which stay in registers over the whole span (in passes over a part of the
 * width where the registers are too few for all of it). Each score is a function of its
 * query and key alone and each output sums its positions in order, so a row's result is the
 * same whichever rows are computed beside it. */
static inline __attribute__((always_inline)) void attend_span_w64(
    const float *restrict qs, const void *restrict keys, const void *restrict values, float *restrict scores,
    int64_t begin, int64_t n, int64_t kps, int64_t khs, int64_t vps, int64_t vhs,
    const int64_t *restrict pages, int64_t page_size, float *restrict top, float *restrict total,
    float *restrict acc, const int64_t HK, const int64_t G, const int KIND)
{
    enum { STEP = LANES / 4, CHUNKS = 64 / LANES };  /* positions a block scores; vectors in a row */
    for (int64_t h = 0; h < HK; ++h) {
        const float *restrict qh = qs + h * G * 64;
        for (int64_t g = 0; g < G; ++g) top[h * G + g] = -INFINITY;
        for (int64_t j = 0, run; j < n; j += run) {
            const void *run_keys = kv_position(keys, pages, page_size, begin + j, n - j, kps, &run, KIND);
            const struct run_ahead ahead = look_ahead(keys, pages, page_size, begin + j + run, n - j - run, kps, KIND);
            for (int64_t r = 0; r < run; r += STEP) {
                const int64_t count = run - r < STEP ? run - r : STEP;
                lanes_t v[LANES];  /* v[STEP * g + i]: query g against position r + i */
                for (int i = 0; i < LANES; ++i) v[i] = lanes_zero();
                for (int64_t i = 0; i < count; ++i) {
                    if (pages && h == 0) prefetch_ahead(&ahead, run_keys, r + i, run);
                    const void *key = kv_row(run_keys, (r + i) * kps + h * khs, KIND);
                    lanes_t k[CHUNKS];
                    for (int c = 0; c < CHUNKS; ++c) k[c] = load_kv(key, c * LANES, KIND);
                    for (int64_t g = 0; g < G; ++g) {
                        const float *q = qh + g * 64;
                        lanes_t d = lanes_mul(lanes_load(q), k[0]);
                        for (int c = 1; c < CHUNKS; ++c) d = lanes_fmadd(lanes_load(q + c * LANES), k[c], d);
                        v[STEP * g + i] = d;
                    }
                }
                float block[LANES] __attribute__((aligned(64)));
                lanes_store(block, sum_lanes(v));
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t i = 0; i < count; ++i) {
                        const float score = block[STEP * g + i];
                        scores[(h * G + g) * n + j + r + i] = score;
                        top[h * G + g] = score > top[h * G + g] ? score : top[h * G + g];
                    }
            }
        }
    }
    exponentiate(scores, HK * G, n, top, total);
    const int64_t part = LANES == 16 || G <= 3 ? 4 * LANES : 2 * LANES;  /* floats of the width a pass sums */
    for (int64_t h = 0; h < HK; ++h)
        for (int64_t from = 0; from < 64; from += part) {
            lanes_t a[4][4];
            for (int64_t g = 0; g < G; ++g)
                for (int c = 0; c < part / LANES; ++c) a[g][c] = lanes_zero();
            for (int64_t j = 0, run; j < n; j += run) {
                const void *run_values = kv_position(values, pages, page_size, begin + j, n - j, vps, &run, KIND);
                const struct run_ahead ahead = look_ahead(values, pages, page_size, begin + j + run, n - j - run,
                                                          vps, KIND);
                for (int64_t r = 0; r < run; ++r) {
                    if (pages && h == 0 && from == 0) prefetch_ahead(&ahead, run_values, r, run);
                    const void *value = kv_row(run_values, r * vps + h * vhs, KIND);
                    lanes_t x[4];
                    for (int c = 0; c < part / LANES; ++c) x[c] = load_kv(value, from + c * LANES, KIND);
                    for (int64_t g = 0; g < G; ++g) {
                        const lanes_t w = lanes_set1(scores[(h * G + g) * n + j + r]);
                        for (int c = 0; c < part / LANES; ++c) a[g][c] = lanes_fmadd(w, x[c], a[g][c]);
                    }
                }
            }
            for (int64_t g = 0; g < G; ++g)
                for (int c = 0; c < part / LANES; ++c) lanes_store(acc + (h * G + g) * 64 + from + c * LANES, a[g][c]);
        }
}
#endif

/* Positions [begin, end) of one row, all its HK K/V heads at once (a page holds every head of
 * its positions side by side, so the row's pages are read through once): for each of the HK * G
 * query heads, the largest score `top`, the sum of exp(score - top) `total` and the
 * unnormalised output `acc` [HK * G][VW]. Position p's K/V for head h lie at p's place
 * (kv_position) + h * khs / vhs. G, W, VW and KIND are compile-time constants in the
 * specialised copies. */
static inline __attribute__((always_inline)) void attend_span(
    const float *restrict query, const void *restrict keys, const void *restrict values, float *restrict scores,
    int64_t begin, int64_t end, int64_t kps, int64_t khs, int64_t vps, int64_t vhs,
    const int64_t *restrict pages, int64_t page_size, float scale,
    float *restrict top, float *restrict total, float *restrict acc,
    const int64_t HK, const int64_t G, const int64_t W, const int64_t VW, const int KIND)
{
    const int64_t n = end - begin, HG = HK * G;
    const int READ = KIND == KV_F16 ? KV_F32 : KIND;  /* the kind the loops read after `readable` */
    float qs[HG * W], wide0[W], wide1[W > VW ? W : VW];
    for (int64_t i = 0; i < HG * W; ++i) qs[i] = query[i] * scale;
#if SPAN_VECTORS
    if (W == 64 && VW == 64 && G <= 4 && n > 0) {  /* it sets every top, total and output itself */
        attend_span_w64(qs, keys, values, scores, begin, n, kps, khs, vps, vhs, pages, page_size, top, total, acc, HK,
                        G, KIND);
        return;
    }
#endif
    for (int64_t g = 0; g < HG; ++g) { top[g] = -INFINITY; total[g] = 0.0f; }
    for (int64_t i = 0; i < HG * VW; ++i) acc[i] = 0.0f;
    if (n <= 0) return;
    for (int64_t j = 0, run; j < n; j += run) {
        const void *run_keys = kv_position(keys, pages, page_size, begin + j, n - j, kps, &run, KIND);
        const struct run_ahead ahead = look_ahead(keys, pages, page_size, begin + j + run, n - j - run, kps, KIND);
        int64_t r = 0;
        for (; r + 2 <= run; r += 2) {
            if (pages) { prefetch_ahead(&ahead, run_keys, r, run); prefetch_ahead(&ahead, run_keys, r + 1, run); }
            for (int64_t h = 0; h < HK; ++h) {
                const void *restrict k0 = readable(kv_row(run_keys, r * kps + h * khs, KIND), wide0, W, KIND);
                const void *restrict k1 = readable(kv_row(run_keys, (r + 1) * kps + h * khs, KIND), wide1, W, KIND);
                const float *restrict qh = qs + h * G * W;
                for (int64_t g = 0; g < G; ++g) {
                    float d0 = 0.0f, d1 = 0.0f;
                    #pragma omp simd reduction(+:d0, d1)
                    for (int64_t i = 0; i < W; ++i) {
                        d0 += qh[g * W + i] * kv_at(k0, i, READ);
                        d1 += qh[g * W + i] * kv_at(k1, i, READ);
                    }
                    float *restrict s = scores + (h * G + g) * n + j + r;
                    s[0] = d0; s[1] = d1;
                    const float m = d0 > d1 ? d0 : d1;
                    top[h * G + g] = m > top[h * G + g] ? m : top[h * G + g];
                }
            }
        }
        for (; r < run; ++r) {
            if (pages) prefetch_ahead(&ahead, run_keys, r, run);
            for (int64_t h = 0; h < HK; ++h) {
                const void *restrict k0 = readable(kv_row(run_keys, r * kps + h * khs, KIND), wide0, W, KIND);
                const float *restrict qh = qs + h * G * W;
                for (int64_t g = 0; g < G; ++g) {
                    float d0 = 0.0f;
                    #pragma omp simd reduction(+:d0)
                    for (int64_t i = 0; i < W; ++i) d0 += qh[g * W + i] * kv_at(k0, i, READ);
                    scores[(h * G + g) * n + j + r] = d0;
                    top[h * G + g] = d0 > top[h * G + g] ? d0 : top[h * G + g];
                }
            }
        }
    }
    exponentiate(scores, HG, n, top, total);
    for (int64_t j = 0, run; j < n; j += run) {
        const void *run_values = kv_position(values, pages, page_size, begin + j, n - j, vps, &run, KIND);
        const struct run_ahead ahead = look_ahead(values, pages, page_size, begin + j + run, n - j - run, vps, KIND);
        for (int64_t r = 0; r < run; ++r) {
            if (pages) prefetch_ahead(&ahead, run_values, r, run);
            for (int64_t h = 0; h < HK; ++h) {
                const void *restrict value = readable(kv_row(run_values, r * vps + h * vhs, KIND), wide1, VW, KIND);
                for (int64_t g = 0; g < G; ++g) {
                    const float w = scores[(h * G + g) * n + j + r];
                    float *restrict a = acc + (h * G + g) * VW;
                    #pragma omp simd
                    for (int64_t i = 0; i < VW; ++i) a[i] += w * kv_at(value, i, READ);
                }
            }
        }
    }
}

/* The `team` stretches of one row (each [top HG][total HG][acc HG * VW]) rescaled to their
 * common maximum and summed: the softmax-weighted sum over the whole context. */
static void combine_stretches(const float *parts, int team, float *result, int64_t HG, int64_t VW)
{
    const int64_t part = 2 * HG + HG * VW;
    for (int64_t g = 0; g < HG; ++g) {
        float top = -INFINITY;
        for (int t = 0; t < team; ++t) top = parts[t * part + g] > top ? parts[t * part + g] : top;
        float total = 0.0f;
        for (int64_t i = 0; i < VW; ++i) result[g * VW + i] = 0.0f;
        for (int t = 0; t < team; ++t) {
            const float *stretch = parts + t * part;
            if (stretch[HG + g] == 0.0f) continue;  /* an empty stretch (a context shorter than the team) */
            const float weight = expf(stretch[g] - top);
            total += weight * stretch[HG + g];
            for (int64_t i = 0; i < VW; ++i) result[g * VW + i] += weight * stretch[2 * HG + g * VW + i];
        }
        const float norm = 1.0f / total;
        for (int64_t i = 0; i < VW; ++i) result[g * VW + i] *= norm;
    }
}

/* Every thread takes its stretch of every row; the last to finish a row (an atomic count per
 * row) combines the stretches. */
#define ROW_LOOP(G, W, VW, KIND) \
    for (int64_t row = 0; row < rows; ++row) { \
        const int64_t len = lens[row], part = heads * (2 * G + G * VW); \
        float *mine = partials + (row * team + thread) * part; \
        attend_span(q + row * heads * group * width, kv_row(k, row * k_row_stride, KIND), \
                    kv_row(v, row * v_row_stride, KIND), scores, len * thread / team, len * (thread + 1) / team, \
                    k_pos_stride, k_head_stride, v_pos_stride, v_head_stride, \
                    pages ? pages + row * pages_stride : NULL, page_size, scale, \
                    mine, mine + heads * G, mine + 2 * heads * G, heads, G, W, VW, KIND); \
        if (__atomic_add_fetch(&counts[row], 1, __ATOMIC_ACQ_REL) == team) { \
            __atomic_store_n(&counts[row], 0, __ATOMIC_RELAXED); \
            combine_stretches(partials + row * team * part, team, out + row * heads * group * v_width, heads * G, VW); \
        } \
    }

#define SHAPES(KIND) \
    if (width == 64 && v_width == 64 && group == 1) { ROW_LOOP(1, 64, 64, KIND) } \
    else if (width == 64 && v_width == 64 && group == 2) { ROW_LOOP(2, 64, 64, KIND) } \
    else if (width == 64 && v_width == 64 && group == 3) { ROW_LOOP(3, 64, 64, KIND) } \
    else if (width == 64 && v_width == 64 && group == 4) { ROW_LOOP(4, 64, 64, KIND) } \
    else if (width == 128 && v_width == 128 && group == 1) { ROW_LOOP(1, 128, 128, KIND) } \
    else if (width == 128 && v_width == 128 && group == 2) { ROW_LOOP(2, 128, 128, KIND) } \
    else { ROW_LOOP(group, width, v_width, KIND) }

/* The floats `workspace` must hold for up to `rows` rows, `max_len` positions and `threads`
 * threads: a count per row, each thread's scores, and every row's stretches. */
int64_t astrai_decode_attention_workspace_floats(int64_t rows, int64_t heads, int64_t group, int64_t v_width,
                                                 int64_t max_len, int64_t threads)
{
    const int64_t hg = heads * group;
    return rows + threads * hg * max_len + rows * threads * (2 * hg + hg * v_width);
}

/* The work of the team running it (all of it on one thread outside a parallel region). No
 * barrier at the end: the end of astrai_decode_attention_f32's region is one, and
 * decode_step.c, which runs a whole step inside one parallel region, puts its own after it.
 * `workspace` was made for `workspace_rows` >= rows rows (its layout depends on that count,
 * so calls with fewer rows leave the counts of the others untouched); its first
 * `workspace_rows` values (the counts) must be zero, and every call leaves them so. */
void astrai_decode_attention_team(
    const float *q, const void *k, const void *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    const int64_t *pages, int64_t pages_stride, int64_t page_size,
    float scale, int64_t max_len, int64_t workspace_rows, int kv_kind)
{
    const int team = omp_get_num_threads(), thread = omp_get_thread_num();
    int32_t *counts = (int32_t *)workspace;
    float *scores = workspace + workspace_rows + (int64_t)thread * heads * group * max_len;
    float *partials = workspace + workspace_rows + (int64_t)team * heads * group * max_len;
    if (kv_kind == KV_BF16) { SHAPES(KV_BF16) }
    else if (kv_kind == KV_F16) { SHAPES(KV_F16) }
    else { SHAPES(KV_F32) }
}

void astrai_decode_attention_f32(
    const float *q, const void *k, const void *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    const int64_t *pages, int64_t pages_stride, int64_t page_size,
    float scale, int64_t max_len, int64_t workspace_rows, int kv_kind, int threads)
{
    #pragma omp parallel num_threads(threads)
    astrai_decode_attention_team(q, k, v, out, lens, workspace, rows, heads, group, width, v_width, k_row_stride,
                                 k_head_stride, k_pos_stride, v_row_stride, v_head_stride, v_pos_stride, pages,
                                 pages_stride, page_size, scale, max_len, workspace_rows, kv_kind);
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

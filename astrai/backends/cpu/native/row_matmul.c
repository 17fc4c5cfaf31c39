/* One-row matmul (GEMV) y = x W^T (+ bias) for a row-major weight W [out][ld] (nn.Linear's own
 * layout, ld >= in): the decode step of a single request, where the whole step is the
 * time it takes to stream the weights.
 *
 * Each thread takes a contiguous stretch of the outputs and reads its two halves side by
 * side, a row of each at a time, each a dot product of one weight row with x in its L1
 * cache: two sequential streams the hardware prefetcher follows on its own. One stream
 * keeps too few cache lines in flight for a core to reach the memory's pace (over the 1B
 * shape's fp32 weights on an AMD EPYC, 51-49 GB/s for one against 58-59 for two, a bare read
 * 67). There is no software prefetch: measured on x86 CPUs a prefetch instruction every 32
 * floats read the weights more slowly than none. Each dot product is f32_dot.h's, in the
 * order the several-row matmul (dequant_matmul.c) sums too.
 */
#include <stdint.h>
#include <omp.h>

#include "f32_dot.h"

#if (defined(__AVX2__) && defined(__FMA__)) && !defined(ASTRAI_PORTABLE)
#define ROWS_AVX2 1
#include <immintrin.h>
#else
#define ROWS_AVX2 0
#endif

enum {
    ROWS_AHEAD = 256, /* floats of W the few-rows matmul prefetches ahead: with several rows of x per
                         weight row the loop reads W more slowly, and there a prefetch measured faster */
    MAX_TEAM = 256, /* threads at most (the argmax keeps one answer per thread on the stack) */
};

/* Whether `value` at a later index takes the place of `top` as torch.argmax's answer: a NaN
 * beats any number (the first NaN wins), otherwise only a strictly larger value (the first
 * maximum wins). */
static inline int beats(float value, float top) { return value > top || (value != value && top == top); }

/* This thread's stretch of y = x W^T (+ bias), for every thread of the team running it (one
 * thread outside a parallel region does all of it). With `best`, each thread also notes its
 * stretch's argmax in best[t] / top[t] (-1 for an empty stretch) for `astrai_team_argmax`.
 * No barrier: the caller puts one before y is read. Exported for decode_step.c, which runs
 * a whole step inside one parallel region. */
void astrai_team_row_matmul(const float *x, const float *w, const float *bias, float *y, int64_t n_in,
                            int64_t n_out, int64_t ld, int64_t *best, float *top)
{
    const int t = omp_get_thread_num();
    const int64_t size = omp_get_num_threads(), per = (n_out + size - 1) / size;
    const int64_t first = t * per, last = first + per < n_out ? first + per : n_out;
    int64_t mine = -1;
    float highest = 0.0f;
    if (first < last) {  /* the stretch's two halves side by side, then an odd last row */
        const int64_t half = (last - first) / 2;
        f32_dots(w + first * ld, ld, half, half, 2, x, 0, 1, n_in, y + first, 1);
        if ((last - first) % 2) f32_dots(w + (last - 1) * ld, ld, 1, 0, 1, x, 0, 1, n_in, y + last - 1, 1);
    }
    for (int64_t j = first; j < last; ++j) {
        if (bias) y[j] += bias[j];
        if (best && (mine < 0 || beats(y[j], highest))) { mine = j; highest = y[j]; }
    }
    if (best) { best[t] = mine; top[t] = highest; }
}

/* The answer of the team's `team` stretches: threads hold increasing stretches, so an
 * earlier one wins a tie. */
int64_t astrai_team_argmax(const int64_t *best, const float *top, int team)
{
    int64_t answer = -1;
    float highest = 0.0f;
    for (int t = 0; t < team; ++t)
        if (best[t] >= 0 && (answer < 0 || beats(top[t], highest))) { answer = best[t]; highest = top[t]; }
    return answer;
}

static int64_t gemv(const float *x, const float *w, const float *bias, float *y, int64_t n_in, int64_t n_out,
                    int64_t ld, int threads, int want_argmax)
{
    if (threads > MAX_TEAM) threads = MAX_TEAM;
    int64_t best[MAX_TEAM];
    float top[MAX_TEAM];
    int team = 1;
    #pragma omp parallel num_threads(threads)
    {
        astrai_team_row_matmul(x, w, bias, y, n_in, n_out, ld, want_argmax ? best : 0, top);
        if (omp_get_thread_num() == 0) team = omp_get_num_threads();
    }
    return want_argmax ? astrai_team_argmax(best, top, team) : -1;
}

void astrai_row_matmul_f32(
    const float *x, const float *w, const float *bias, float *y, int64_t n_in, int64_t n_out, int64_t ld,
    int threads)
{
    gemv(x, w, bias, y, n_in, n_out, ld, threads, 0);
}

/* The same GEMV, returning the index torch.argmax would give of y: for a greedy decode
 * step's head, where each thread notes its stretch's maximum as it writes it, which costs
 * nothing beside the GEMV, where torch's argmax would read the logits once more. */
int64_t astrai_row_matmul_argmax_f32(
    const float *x, const float *w, float *y, int64_t n_in, int64_t n_out, int64_t ld, int threads)
{
    return gemv(x, w, 0, y, n_in, n_out, ld, threads, 1);
}

/* A few rows: y[r] = x[r] W^T (+ bias) for r < rows, x [rows][n_in] and y [rows][n_out]
 * contiguous: a decode step of continuous batching, where oneDNN's matmul over its packed
 * copy reads the weight more slowly than one stream does. Here each thread again walks its
 * stretch of W front to back, one output row at a time; the row is read from memory once,
 * by the first group of (up to) four rows of x, and stays in L1 for the groups after it. */
#if ROWS_AVX2
static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sums[r] = W_row . x[r] for r < n_r (1 to 4; a literal at each call, so each count gets its
 * own copy with its sums in registers): two sets of sums, each taking every other eight
 * inputs, so that no sum waits on the multiply-add before it. */
static inline __attribute__((always_inline)) void tile_dot(const float *w, const float *x, int64_t n_in, int n_r,
                                                         float *sums)
{
    int64_t i = 0;
#if ROWS_AVX2
    __m256 even[4], odd[4];
    for (int r = 0; r < n_r; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (; i + 16 <= n_in; i += 16) {
        __builtin_prefetch(w + i + ROWS_AHEAD, 0, 0);
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int r = 0; r < n_r; ++r) {
            even[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * n_in + i), even[r]);
            odd[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * n_in + i + 8), odd[r]);
        }
    }
    for (int r = 0; r < n_r; ++r) sums[r] = hsum8(_mm256_add_ps(even[r], odd[r]));
#else
    f32_dots(w, 0, 1, 0, 1, x, n_in, n_r, n_in, sums, 0);
    i = n_in;
#endif
    for (; i < n_in; ++i)
        for (int r = 0; r < n_r; ++r) sums[r] += w[i] * x[r * n_in + i];
}

static inline __attribute__((always_inline)) void tile(const float *w, const float *x, int64_t n_in, int n_r,
                                                     float *sums)
{
    switch (n_r) {  /* literal counts: the compiler keeps each one's sums in registers */
    case 1: tile_dot(w, x, n_in, 1, sums); break;
    case 2: tile_dot(w, x, n_in, 2, sums); break;
    case 3: tile_dot(w, x, n_in, 3, sums); break;
    default: tile_dot(w, x, n_in, 4, sums); break;
    }
}

static inline void put(float *y, int64_t n_out, int64_t r, int64_t j, float sum, const float *bias)
{
    y[r * n_out + j] = bias ? sum + bias[j] : sum;
}

void astrai_rows_matmul_f32(const float *x, int64_t rows, const float *w, const float *bias, float *y,
                            int64_t n_in, int64_t n_out, int64_t ld, int threads)
{
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        const int64_t size = omp_get_num_threads(), per = (n_out + size - 1) / size;
        const int64_t first = t * per, last = first + per < n_out ? first + per : n_out;
        for (int64_t j = first; j < last; ++j)
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                float sums[4];
                const int n_r = rows - r0 < 4 ? (int)(rows - r0) : 4;
                tile(w + j * ld, x + r0 * n_in, n_in, n_r, sums);
                for (int r = 0; r < n_r; ++r) put(y, n_out, r0 + r, j, sums[r], bias);
            }
    }
}

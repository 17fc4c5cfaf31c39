/* One-row product y = x W^T (+ bias) for a row-major weight W [out][ld] (nn.Linear's own
 * layout, ld >= in): the decode step of a single request, where the whole step is the
 * time it takes to stream the weights.
 *
 * Each thread takes a contiguous stretch of the outputs and computes them one at a time,
 * each a dot product of one weight row with x: every thread reads one stream of memory
 * front to back, with x in its L1 cache and nothing stored until a row is done. Timed
 * standalone in C over the ~125M model's weight set on the 2-vCPU AMD VM (2 MiB pages,
 * alternating) at the VM's faster bandwidth level, this read 50-61 GB/s, up to level with
 * a plain sum (60-61), where the earlier column-major kernel - each thread a stretch of
 * the inputs, eight weight rows at a time added into a partial of all outputs - read 46.
 * At the slower level both read as fast as the sum (in the engine's process 33.4 against
 * 33.7 GB/s, the sum 33.8). Two or four rows at a time (more streams) read less.
 */
#include <stdint.h>
#include <omp.h>

enum {
    LANES = 32,   /* independent partial sums per row: one chain of adds would wait on each add's latency */
    AHEAD = 512,  /* floats (2 KiB) ahead of the read a thread asks the L2 cache for */
    MAX_TEAM = 256, /* threads at most (the argmax keeps one answer per thread on the stack) */
};

/* x · row over n_in floats; `end` is where the thread's stretch of rows ends, past which
 * nothing is prefetched. Software prefetch along the thread's stretch (its rows follow each
 * other in memory): the hardware prefetcher alone left the stream at 50 GB/s where a sum read
 * 60 at the VM's faster level; asking 2 KiB ahead read 55-60 (standalone, 125M weight set) and
 * changed nothing at the slower level (35.3 against 34.5, the sum 35.3).
 *
 * The prefetch is non-temporal (prefetchnta): a weight is read once a step, and a step
 * streams far more than the last-level cache holds, so keeping the lines there only evicts
 * what is worth keeping - the Python and torch state the engine runs between steps, the
 * K/V, the activations. On the 2-vCPU AMD EPYC VM (32 MiB L3, a victim cache that every
 * line leaving L2 is otherwise written into), the ~125M model's engine decode, alternating
 * with the temporal hint in one process: end to end 0.935 against 0.853 of the copy bound
 * at the faster bandwidth level (the C step 6.26 against 6.59 ms, the rest from the Python
 * between steps finding its data in cache), 1.073 against 1.037 at the slower. Asking 4 or
 * 8 KiB ahead read the same (0.932, 0.931), 1 KiB less (0.907). The `tiny` and `small`
 * presets (21 and 166 MB of weights) decoded as fast either way. */
static inline float row_dot(const float *row, const float *x, int64_t n_in, const float *end)
{
    float partial[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= n_in; i += LANES) {
        const float *ahead = row + i + AHEAD;
        if (ahead < end) {
            __builtin_prefetch(ahead, 0, 0);
            __builtin_prefetch(ahead + 16, 0, 0);
        }
        #pragma omp simd
        for (int k = 0; k < LANES; ++k) partial[k] += row[i + k] * x[i + k];
    }
    float s = 0.0f;
    for (int k = 0; k < LANES; ++k) s += partial[k];
    for (; i < n_in; ++i) s += row[i] * x[i];
    return s;
}

/* Whether `value` at a later index takes the place of `top` as torch.argmax's answer: a NaN
 * beats any number (the first NaN wins), otherwise only a strictly larger value (the first
 * maximum wins). */
static inline int beats(float value, float top) { return value > top || (value != value && top == top); }

/* This thread's stretch of y = x W^T (+ bias), for every thread of the team running it (one
 * thread outside a parallel region does all of it). With `best`, each thread also notes its
 * stretch's argmax in best[t] / top[t] (-1 for an empty stretch) for `astrai_team_argmax`.
 * No barrier: the caller puts one before y is read. Exported for decode_step.c, which runs
 * a whole step inside one parallel region. */
void astrai_team_row_product(const float *x, const float *w, const float *bias, float *y, int64_t n_in,
                             int64_t n_out, int64_t ld, int64_t *best, float *top)
{
    const int t = omp_get_thread_num();
    const int64_t size = omp_get_num_threads(), per = (n_out + size - 1) / size;
    const int64_t first = t * per, last = first + per < n_out ? first + per : n_out;
    const float *end = first < last ? w + (last - 1) * ld + n_in : w;
    int64_t mine = -1;
    float highest = 0.0f;
    for (int64_t j = first; j < last; ++j) {
        const float s = row_dot(w + j * ld, x, n_in, end);
        y[j] = bias ? s + bias[j] : s;
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

static int64_t products(const float *x, const float *w, const float *bias, float *y, int64_t n_in, int64_t n_out,
                        int64_t ld, int threads, int want_argmax)
{
    if (threads > MAX_TEAM) threads = MAX_TEAM;
    int64_t best[MAX_TEAM];
    float top[MAX_TEAM];
    int team = 1;
    #pragma omp parallel num_threads(threads)
    {
        astrai_team_row_product(x, w, bias, y, n_in, n_out, ld, want_argmax ? best : 0, top);
        if (omp_get_thread_num() == 0) team = omp_get_num_threads();
    }
    return want_argmax ? astrai_team_argmax(best, top, team) : -1;
}

void astrai_row_product_f32(
    const float *x, const float *w, const float *bias, float *y, int64_t n_in, int64_t n_out, int64_t ld,
    int threads)
{
    products(x, w, bias, y, n_in, n_out, ld, threads, 0);
}

/* The same product, returning the index torch.argmax would give of y: for a greedy decode
 * step's head, where each thread notes its stretch's maximum as it writes it, which costs
 * nothing beside the product, against some 100 µs for torch's argmax over 32,000 logits
 * and the Python around it. */
int64_t astrai_row_product_argmax_f32(
    const float *x, const float *w, float *y, int64_t n_in, int64_t n_out, int64_t ld, int threads)
{
    return products(x, w, 0, y, n_in, n_out, ld, threads, 1);
}

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
};

void astrai_row_product_f32(
    const float *x, const float *w, const float *bias, float *y, int64_t n_in, int64_t n_out, int64_t ld,
    int threads)
{
    #pragma omp parallel num_threads(threads)
    {
        int64_t team = omp_get_num_threads(), per = (n_out + team - 1) / team;
        int64_t first = omp_get_thread_num() * per, last = first + per < n_out ? first + per : n_out;
        /* Software prefetch along the thread's stretch (its rows follow each other in memory):
         * the hardware prefetcher alone left the stream at 50 GB/s where a sum read 60 at the
         * VM's faster level; asking 2 KiB ahead read 55-60 (standalone, 125M weight set) and
         * changed nothing at the slower level (35.3 against 34.5, the sum 35.3). */
        const float *end = first < last ? w + (last - 1) * ld + n_in : w;
        for (int64_t j = first; j < last; ++j) {
            const float *row = w + j * ld;
            float partial[LANES] = {0.0f};
            int64_t i = 0;
            for (; i + LANES <= n_in; i += LANES) {
                const float *ahead = row + i + AHEAD;
                if (ahead < end) {
                    __builtin_prefetch(ahead, 0, 2);
                    __builtin_prefetch(ahead + 16, 0, 2);
                }
                #pragma omp simd
                for (int k = 0; k < LANES; ++k) partial[k] += row[i + k] * x[i + k];
            }
            float s = 0.0f;
            for (int k = 0; k < LANES; ++k) s += partial[k];
            for (; i < n_in; ++i) s += row[i] * x[i];
            y[j] = bias ? s + bias[j] : s;
        }
    }
}

/* The softmax, loss and logit gradient of one chunk of the fused cross-entropy
 * (astrai/model/components/linear_cross_entropy.py), in one kernel instead of a chain of
 * PyTorch ops each streaming the chunk's [vocab x rows] logits through memory (widening the
 * bf16 logits, the max, the exponentials, the sum, the target's correction, the scaled cast
 * into the gradient): on a small model's step those passes cost about a sixth of the time.
 *
 * The logits lie transposed, as the fused loss computes them: row v of `logits` holds
 * vocabulary entry v for each of `rows` tokens (columns), `ld` elements between rows, in
 * fp32 or bf16. For each column c, with t its target, e its label smoothing and s its scale
 * (the token's weight in the mean, 0 for an ignored one):
 *
 *   m = max_v l[v],  z = sum_v e^(l[v] - m),  lse = m + log z,
 *   loss[c]    = (1 - e) (lse - l[t]) + e (lse - mean_v l[v]),
 *   grad[v][c] = s (e^(l[v] - m) / z - (1 - e) [v = t] - e / vocab)
 *
 * `grad` (`grad_ld` elements between rows, fp32 or bf16 rounded to nearest even as torch's
 * cast rounds) may be the logits themselves (fp32, the same ld), or NULL for the loss alone.
 *
 * Each thread takes whole blocks of COLS columns: three passes down the vocabulary (the max
 * and the logits' sum; the exponentials' sum; the gradient) over a block small enough to stay
 * in the core's L2 cache after the first. Every column's sums run down the vocabulary in
 * order, whatever the thread count, so a run's numbers do not depend on it. The loops are
 * plain C that the compiler vectorises across the block's columns at the build's level. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "exp_lanes.h"

enum { COLS = 32 };

static inline float bf16_value(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* nearest bf16, ties to even; a NaN stays a (quiet) NaN */
static inline uint16_t bf16_nearest(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)rounded;
}

static inline float logit_at(const void *logits, int bf16, int64_t i)
{
    return bf16 ? bf16_value(((const uint16_t *)logits)[i]) : ((const float *)logits)[i];
}

/* One block of `width` (<= COLS) columns starting at column c0; inlined with width = COLS for
 * whole blocks, so the column loops have a fixed trip count. */
static inline __attribute__((always_inline)) void softmax_block(
    const void *logits, int logits_bf16, int64_t ld, int64_t vocab, int64_t c0, int width,
    const int64_t *targets, const float *scale, float smoothing, float *loss,
    void *grad, int grad_bf16, int64_t grad_ld)
{
    float m[COLS], z[COLS], total[COLS], factor[COLS], flat[COLS], target_logit[COLS];
    for (int c = 0; c < width; ++c) {
        m[c] = -INFINITY;
        z[c] = 0.0f;
        total[c] = 0.0f;
        target_logit[c] = logit_at(logits, logits_bf16, targets[c0 + c] * ld + c0 + c);
    }
    if (logits_bf16) {
        for (int64_t v = 0; v < vocab; ++v) {
            const uint16_t *row = (const uint16_t *)logits + v * ld + c0;
            for (int c = 0; c < width; ++c) {
                const float l = bf16_value(row[c]);
                m[c] = l > m[c] ? l : m[c];
                total[c] += l;
            }
        }
        for (int64_t v = 0; v < vocab; ++v) {
            const uint16_t *row = (const uint16_t *)logits + v * ld + c0;
            for (int c = 0; c < width; ++c) z[c] += exp_lanes(bf16_value(row[c]) - m[c]);
        }
    } else {
        for (int64_t v = 0; v < vocab; ++v) {
            const float *row = (const float *)logits + v * ld + c0;
            for (int c = 0; c < width; ++c) {
                m[c] = row[c] > m[c] ? row[c] : m[c];
                total[c] += row[c];
            }
        }
        for (int64_t v = 0; v < vocab; ++v) {
            const float *row = (const float *)logits + v * ld + c0;
            for (int c = 0; c < width; ++c) z[c] += exp_lanes(row[c] - m[c]);
        }
    }
    for (int c = 0; c < width; ++c) {
        const float lse = m[c] + logf(z[c]);
        loss[c0 + c] = (1.0f - smoothing) * (lse - target_logit[c]) + smoothing * (lse - total[c] / (float)vocab);
        factor[c] = scale[c0 + c] / z[c];
        flat[c] = smoothing / (float)vocab * scale[c0 + c];
    }
    if (!grad)
        return;
    for (int64_t v = 0; v < vocab; ++v) {
        float g[COLS];
        if (logits_bf16) {
            const uint16_t *row = (const uint16_t *)logits + v * ld + c0;
            for (int c = 0; c < width; ++c) g[c] = exp_lanes(bf16_value(row[c]) - m[c]) * factor[c] - flat[c];
        } else {
            const float *row = (const float *)logits + v * ld + c0;
            for (int c = 0; c < width; ++c) g[c] = exp_lanes(row[c] - m[c]) * factor[c] - flat[c];
        }
        if (grad_bf16) {
            uint16_t *out = (uint16_t *)grad + v * grad_ld + c0;
            for (int c = 0; c < width; ++c) out[c] = bf16_nearest(g[c]);
        } else {
            float *out = (float *)grad + v * grad_ld + c0;
            for (int c = 0; c < width; ++c) out[c] = g[c];
        }
    }
    /* the target's entry, from the logit read before the gradient may have overwritten it */
    for (int c = 0; c < width; ++c) {
        const float g = exp_lanes(target_logit[c] - m[c]) * factor[c] - flat[c] - (1.0f - smoothing) * scale[c0 + c];
        const int64_t at = targets[c0 + c] * grad_ld + c0 + c;
        if (grad_bf16)
            ((uint16_t *)grad)[at] = bf16_nearest(g);
        else
            ((float *)grad)[at] = g;
    }
}

void astrai_softmax_gradient(const void *logits, int logits_bf16, int64_t ld, int64_t vocab, int64_t rows,
                             const int64_t *targets, const float *scale, float smoothing, float *loss,
                             void *grad, int grad_bf16, int64_t grad_ld, int threads)
{
    const int64_t blocks = (rows + COLS - 1) / COLS;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t c0 = b * COLS;
        if (rows - c0 >= COLS)
            softmax_block(logits, logits_bf16, ld, vocab, c0, COLS, targets, scale, smoothing, loss, grad, grad_bf16,
                          grad_ld);
        else
            softmax_block(logits, logits_bf16, ld, vocab, c0, (int)(rows - c0), targets, scale, smoothing, loss, grad,
                          grad_bf16, grad_ld);
    }
}

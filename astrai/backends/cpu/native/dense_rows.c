/* Rows of a bf16 or int8 weight widened to fp32, for a prefill's blocked GEMM.
 *
 * A prompt of many rows is multiplied by a BLAS (or oneDNN) GEMM over fp32 weights; a
 * weight stored smaller is widened for it a slab of output rows at a time into a buffer the
 * caller reuses, so the fp32 copy stays in cache and never costs a page fault. One pass, the
 * rows shared among `threads` OpenMP threads. With AVX2 a block is widened in registers
 * (integers to floats, times the block's scale, eight at a time); elsewhere plain C loops
 * compute the same products (the same values on every target: each is one exact
 * conversion and one float multiplication). int4 weights have their own matmul in
 * integers (integer_matmul.c).
 *
 * Kinds, as native/dequant_matmul.c numbers them (astrai/model/quantized.py's layout):
 *   1  bf16 [out, >= in]
 *   2  int8 [out, padded in] with one fp16 scale per 32 inputs (GGUF's Q8_0)
 * `data_ld` and `scale_ld` are the distance between two rows (elements of data, fp16 values).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && !defined(ASTRAI_PORTABLE)
#define DENSE_AVX2 1
#include <immintrin.h>
#else
#define DENSE_AVX2 0
#endif

#define DENSE_BF16 1
#define DENSE_Q8 2
#define DENSE_BLOCK 32

static float fp16_value(uint16_t h)
{
    /* fp16 bits to float by rebiasing the exponent; subnormals scaled exactly */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    float value;
    if (exponent == 0) {
        value = (float)mantissa * (1.0f / 16777216.0f); /* mantissa * 2^-24 */
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    memcpy(&value, &bits, sizeof value);
    return value;
}

static void widen_bf16(const uint16_t *row, int64_t n_in, float *out)
{
    for (int64_t i = 0; i < n_in; i++) {
        const uint32_t bits = (uint32_t)row[i] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        out[i] = value;
    }
}

#if DENSE_AVX2
/* 16 signed bytes times d, as floats, into out[0..15] */
static inline void store_scaled16(__m128i bytes, __m256 d, float *out)
{
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), d));
}
#endif

static void widen_q8(const int8_t *row, const uint16_t *scales, int64_t n_in, float *out)
{
    const int64_t full = n_in / DENSE_BLOCK;
    for (int64_t b = 0; b < full; b++) {
        const float d = fp16_value(scales[b]);
        const int8_t *q = row + b * DENSE_BLOCK;
        float *o = out + b * DENSE_BLOCK;
#if DENSE_AVX2
        const __m256 scale = _mm256_set1_ps(d);
        store_scaled16(_mm_loadu_si128((const __m128i *)q), scale, o);
        store_scaled16(_mm_loadu_si128((const __m128i *)(q + 16)), scale, o + 16);
#else
        for (int j = 0; j < DENSE_BLOCK; j++)
            o[j] = (float)q[j] * d;
#endif
    }
    if (full * DENSE_BLOCK < n_in) {
        const float d = fp16_value(scales[full]);
        for (int64_t i = full * DENSE_BLOCK; i < n_in; i++)
            out[i] = (float)row[i] * d;
    }
}

/* Rows first .. first + rows - 1 of the weight, widened to fp32 into `out` (rows `out_ld`
 * floats apart). Returns 0, or -1 for an unknown kind. */
int64_t astrai_dense_rows(const void *data, int64_t data_ld, const uint16_t *scales, int64_t scale_ld, int kind,
                          int64_t n_in, int64_t first, int64_t rows, float *out, int64_t out_ld, int threads)
{
    if (kind != DENSE_BF16 && kind != DENSE_Q8)
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = first + r;
        float *dst = out + r * out_ld;
        if (kind == DENSE_BF16)
            widen_bf16((const uint16_t *)data + o * data_ld, n_in, dst);
        else
            widen_q8((const int8_t *)data + o * data_ld, scales + o * scale_ld, n_in, dst);
    }
    return 0;
}

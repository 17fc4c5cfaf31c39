/* A whole single-request decode step of a plain GQA + SwiGLU model in one call.
 *
 * For one row, each layer's norms, rotary embedding, K/V writes, SiLU and residual
 * additions are a few hundred floats of arithmetic, but through PyTorch each is an
 * operator call of a few microseconds plus Python around it: some 60 calls a layer,
 * 4-5 ms of a ~125M model's 20 ms step on the AMD VM, while the weights stream in the
 * rest. Here that arithmetic is plain loops between the same one-row products and
 * decode attention the unfused step calls (row_product.c, decode_attention.c), so the
 * step's time is theirs. Python (astrai/inference/fused_decode.py) checks that the
 * model is of this shape and passes a table of pointers per layer.
 *
 * Per layer, `layers` holds 14 int64 values:
 *   0 input norm weight   1 joint q/k/v weight [q + 2 kv rows][ld] (q, k, v rows)  2 its ld
 *   3 o weight [dim][ld]  4 its ld   5 post-attention norm weight
 *   6 joint gate/up weight [2 ffn][ld]   7 its ld   8 down weight [dim][ld]    9 its ld
 *  10 this layer's K page store [slots][kv_heads][head_dim]   11 the same for V
 *  12 the decode buffer's K for this row [kv_heads][capacity][head_dim]  13 the same for V
 * so the table changes only when the decode buffers are replaced; the token's place in the
 * page store comes per step as `k_offset`/`v_offset` (floats from a layer's start).
 * Every weight is row-major, nn.Linear's [out][in], each row `ld` floats apart.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void astrai_row_product_f32(const float *x, const float *w, const float *bias, float *y, int64_t n_in,
                            int64_t n_out, int64_t ld, int threads);
void astrai_decode_attention_f32(
    const float *q, const float *k, const float *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    float scale, int64_t max_len, int threads);

static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps)
{
    float total = 0.0f;
    #pragma omp simd reduction(+:total)
    for (int64_t i = 0; i < n; ++i) total += x[i] * x[i];
    const float rstd = 1.0f / sqrtf(total / (float)n + eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * rstd * weight[i];
}

/* x·cos + [x2, x1]·sin per head, in place; the sign of the half rotation is folded into
 * sin's first half, as rotary_tables (layers.py) makes it */
static void rotate(float *x, int64_t heads, int64_t width, const float *cos, const float *sin)
{
    const int64_t half = width / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float *v = x + h * width;
        for (int64_t i = 0; i < half; ++i) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

static inline const float *f32(int64_t address) { return (const float *)(intptr_t)address; }

void astrai_decode_step_f32(
    const float *embedding, int64_t embedding_row_stride, int64_t embedding_col_stride, int64_t token,
    const int64_t *layers, int64_t n_layers, int64_t dim, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t ffn, const float *cos, const float *sin, int64_t pos, int64_t capacity, float eps, float scale,
    int64_t k_offset, int64_t v_offset, const float *final_norm, const float *head, int64_t head_ld,
    int64_t vocab, float *logits, float *work, float *attention_workspace, int threads)
{
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    float *x = work, *h = x + dim, *qkv = h + dim, *attended = qkv + q_width + 2 * kv_width;
    float *out = attended + q_width, *gate_up = out + dim;
    const int64_t len = pos + 1;
    for (int64_t i = 0; i < dim; ++i) x[i] = embedding[token * embedding_row_stride + i * embedding_col_stride];
    for (int64_t l = 0; l < n_layers; ++l) {
        const int64_t *p = layers + 14 * l;
        rms_norm(x, f32(p[0]), h, dim, eps);
        astrai_row_product_f32(h, f32(p[1]), 0, qkv, dim, q_width + 2 * kv_width, p[2], threads);
        float *q = qkv, *k = qkv + q_width, *v = k + kv_width;
        rotate(q, heads, head_dim, cos, sin);
        rotate(k, kv_heads, head_dim, cos, sin);
        memcpy((float *)(intptr_t)p[10] + k_offset, k, sizeof(float) * (size_t)kv_width);
        memcpy((float *)(intptr_t)p[11] + v_offset, v, sizeof(float) * (size_t)kv_width);
        float *k_buffer = (float *)(intptr_t)p[12], *v_buffer = (float *)(intptr_t)p[13];
        for (int64_t g = 0; g < kv_heads; ++g) {
            memcpy(k_buffer + (g * capacity + pos) * head_dim, k + g * head_dim, sizeof(float) * (size_t)head_dim);
            memcpy(v_buffer + (g * capacity + pos) * head_dim, v + g * head_dim, sizeof(float) * (size_t)head_dim);
        }
        astrai_decode_attention_f32(q, k_buffer, v_buffer, attended, &len, attention_workspace, 1, kv_heads,
                                    heads / kv_heads, head_dim, head_dim, 0, capacity * head_dim, head_dim,
                                    0, capacity * head_dim, head_dim, scale, len, threads);
        astrai_row_product_f32(attended, f32(p[3]), 0, out, q_width, dim, p[4], threads);
        for (int64_t i = 0; i < dim; ++i) x[i] += out[i];
        rms_norm(x, f32(p[5]), h, dim, eps);
        astrai_row_product_f32(h, f32(p[6]), 0, gate_up, dim, 2 * ffn, p[7], threads);
        for (int64_t j = 0; j < ffn; ++j) {
            const float g = gate_up[j];
            gate_up[j] = g / (1.0f + expf(-g)) * gate_up[ffn + j];
        }
        astrai_row_product_f32(gate_up, f32(p[8]), 0, out, ffn, dim, p[9], threads);
        for (int64_t i = 0; i < dim; ++i) x[i] += out[i];
    }
    rms_norm(x, final_norm, h, dim, eps);
    astrai_row_product_f32(h, head, 0, logits, dim, vocab, head_ld, threads);
}

/* A whole single-request decode step of a GQA + SwiGLU model in one call.
 *
 * For one row, each layer's norms, rotary embedding, K/V writes, SiLU and residual
 * additions are a few hundred floats of arithmetic, but through PyTorch each is an
 * operator call of a few microseconds plus Python around it: some 60 calls a layer.
 * Here that arithmetic is plain loops between the same one-row GEMVs and decode
 * attention the unfused step calls (row_matmul.c, decode_attention.c), so the step's
 * time is theirs. Python (astrai/backends/cpu/fused_decode.py) checks that the model is
 * of this shape and fills a `struct astrai_decode_plan` once: the weights, the decode
 * buffers, rotary tables and scratch memory, all that stays fixed from step to step, so
 * that a step's call passes only the token, its position and where its K/V go (a ctypes
 * call's cost grows with its arguments).
 *
 * A call runs in one OpenMP parallel region, however many steps it takes: the matmuls and
 * attention are shared out among the team inside it, the arithmetic between them runs on
 * thread 0 between barriers, so no region is opened and closed per matmul.
 *
 * Those barriers (some ten a layer) are the team's own, not OpenMP's. libgomp's barrier spins
 * up to GOMP_SPINCOUNT pauses (300,000 by default: milliseconds) before it sleeps, which suits
 * a machine whose cores are all the team's; when another process competes for a core, the
 * thread it displaced arrives a time slice late while the others spin on their cores, and a
 * decode step of a few milliseconds takes several times that. team_barrier spins for about
 * SPIN_NS, then yields the core a few times, then sleeps on a futex until the last thread
 * arrives and wakes it: on an idle machine a wait ends inside the spin, as with libgomp.
 *
 * Per layer, `layers` holds COLUMNS int64 values:
 *   0 input norm weight   1 post-attention norm weight
 *   2 joint q/k/v bias [q + 2 kv] or 0   3 QK-norm's q weight [head_dim] or 0   4 its k weight or 0
 *   5 this layer's K page store [slots][kv_heads][head_dim]   6 the same for V
 *   7 the decode buffer's K for this row [kv_heads][capacity][head_dim]   8 the same for V
 *   (columns 5-8 hold elements of the plan's kv_kind: fp32, or bf16/fp16 rounded as they are written)
 *   9-13 the joint q/k/v weight [q + 2 kv rows] (q, k, v rows)   14-18 o [dim rows]
 *  19-23 the joint gate/up weight [2 ffn rows]   24-28 down [dim rows]
 * where each weight is five values: its data, the elements between its rows, its fp16 scales
 * (quantized types) or 0, the scales between rows, and its type (dequant_matmul.c's: fp32,
 * bf16, int8 or int4 blocks), so one table serves a model of any of those weights, mixed.
 * The table changes only when the decode buffers are replaced; the token's place in the page
 * store comes per step as `k_offset`/`v_offset` (floats from a layer's start).
 * The step returns the index of the logits' maximum (as torch.argmax gives it), which the
 * head's GEMV finds as it writes them: a greedy request needs no other pass.
 * Every weight is row-major, nn.Linear's [out][in].
 */
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "exp_lanes.h"

enum { COLUMNS = 29, WEIGHT_VALUES = 5, QKV = 9, O = 14, GATE_UP = 19, DOWN = 24 };

/* Filled by astrai/backends/cpu/kernels.py (a ctypes Structure of the same fields). */
struct astrai_decode_plan {
    const float *embedding;
    int64_t embedding_row_stride, embedding_col_stride;
    const int64_t *layers;        /* [n_layers][COLUMNS], as above */
    int64_t n_layers, dim, heads, kv_heads, head_dim, ffn;
    const float *cos, *sin;       /* rotary_tables' rows [capacity][head_dim] */
    int64_t capacity;             /* positions the decode buffers (and the rotary rows) hold */
    float eps, scale;
    const float *final_norm;
    int64_t head[WEIGHT_VALUES];  /* the output weight [vocab rows], as a layer's weights */
    int64_t vocab;
    float *work;                  /* astrai_step_work_floats(plan, 1) floats */
    float *attention_workspace;   /* astrai_decode_attention_workspace_floats(ASTRAI_MAX_VERIFY_ROWS, kv_heads,
                                     heads / kv_heads, head_dim, capacity, threads) floats, counts zeroed */
    int64_t threads;
    int64_t kv_kind;              /* the K/V stores' and buffers' element: decode_attention.c's KV_F32/BF16/F16 */
};

enum { MAX_TEAM = 256 };  /* threads at most: one argmax slot each, on the stack */
enum { ASTRAI_MAX_VERIFY_ROWS = 8 };  /* tokens of one verify step at most (dequant_matmul.c's row limit) */

/* dequant_matmul.c, row_matmul.c and decode_attention.c: the work of one thread of a team, no
 * parallel region of their own */
void astrai_team_dequant_matmul(const float *x, int64_t rows, int64_t x_stride, const void *weight,
                                const uint16_t *scales, int type, const float *bias, float *y, int64_t y_stride,
                                int64_t n_in, int64_t n_out, int64_t ld, int64_t scale_ld, int64_t *best, float *top);
int64_t astrai_team_argmax(const int64_t *best, const float *top, int team);
void astrai_decode_attention_team(
    const float *q, const void *k, const void *v, float *out, const int64_t *lens, float *workspace,
    int64_t rows, int64_t heads, int64_t group, int64_t width, int64_t v_width,
    int64_t k_row_stride, int64_t k_head_stride, int64_t k_pos_stride,
    int64_t v_row_stride, int64_t v_head_stride, int64_t v_pos_stride,
    const int64_t *pages, int64_t pages_stride, int64_t page_size,
    float scale, int64_t max_len, int64_t workspace_rows, int kv_kind);
void astrai_store_kv(void *dst, const float *src, int64_t n, int kv_kind);

enum { SPIN_NS = 50000, YIELDS = 4 };  /* a wait spins about 50 us, yields 4 times, then sleeps */

/* A barrier of the threads of one team. `generation` counts completed barriers; a thread
 * arriving waits until it moves on. Sleepers announce themselves before sleeping and the last
 * arriver wakes them only when there are any; both sides' seq_cst accesses (sleepers, then
 * generation; generation, then sleepers) make sure that a sleeper either sees the new
 * generation or is seen and woken. */
struct team_barrier {
    atomic_int arrived, generation, sleepers;
};

static void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t nanoseconds_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static void team_barrier(struct team_barrier *b, int team)
{
    const int generation = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == team - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
        if (atomic_load(&b->sleepers))
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    const int64_t until = nanoseconds_now() + SPIN_NS;
    for (int i = 1;; ++i) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != generation) return;
        relax();
        if (i % 64 == 0 && nanoseconds_now() >= until) break;
    }
    for (int i = 0; i < YIELDS; ++i) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != generation) return;
        sched_yield();
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == generation)
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, generation, NULL, NULL, 0);
    atomic_fetch_sub(&b->sleepers, 1);
}

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

/* This thread's share of y = x W^T (+ bias) for `rows` rows (x and y `x_stride` / `y_stride`
 * floats apart), W given by its five table values. */
static inline void matmul(const int64_t *w, const float *x, int64_t rows, int64_t x_stride, const float *bias,
                          float *y, int64_t y_stride, int64_t n_in, int64_t n_out, int64_t *best, float *top)
{
    astrai_team_dequant_matmul(x, rows, x_stride, (const void *)(intptr_t)w[0], (const uint16_t *)(intptr_t)w[2],
                               (int)w[4], bias, y, y_stride, n_in, n_out, w[1], w[3], best, top);
}

/* The scratch floats one token of a step needs (team_step's layout; `plan->work` holds one token's). */
static int64_t row_floats(const struct astrai_decode_plan *plan)
{
    return 3 * plan->dim + 3 * plan->heads * plan->head_dim + 2 * plan->kv_heads * plan->head_dim + 2 * plan->ffn;
}

/* One step of `n` consecutive tokens of one row (positions pos .. pos + n - 1), run by every
 * thread of the team: the matmuls of all n rows read each weight once and are shared out;
 * the few hundred floats of arithmetic a row has between them (norms, rotation, K/V writes,
 * SiLU, residuals) run on thread r % team for row r, the others waiting at the barrier, so
 * a verify step's rows share that work and a row's numbers do not depend on which thread
 * computed them. Token r attends to positions up to pos + r, so the n tokens see each other
 * causally, as a prefill chunk would. `work` holds row_floats(plan) floats per token.
 * With `best`, each thread's stretch of the head leaves token r's argmax in best/top[r * MAX_TEAM + t]. */
static void team_step(const struct astrai_decode_plan *plan, const int64_t *tokens, int64_t n, int64_t pos,
                      const int64_t *k_offsets, const int64_t *v_offsets, float *work, float *logits,
                      int64_t *best, float *top, struct team_barrier *barrier)
{
    const int team = omp_get_num_threads();
    const int64_t dim = plan->dim, heads = plan->heads, kv_heads = plan->kv_heads, head_dim = plan->head_dim;
    const int64_t ffn = plan->ffn, capacity = plan->capacity;
    const float eps = plan->eps;
    const int me = omp_get_thread_num();
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    /* per token: x, h, out [dim]; qkv [qkv_width]; q, attended [q_width]; gate_up [2 ffn] */
    float *x = work, *h = x + n * dim, *out = h + n * dim, *qkv = out + n * dim, *q = qkv + n * qkv_width;
    float *attended = q + n * q_width, *gate_up = attended + n * q_width;
    int64_t lens[ASTRAI_MAX_VERIFY_ROWS];
    for (int64_t r = 0; r < n; ++r) lens[r] = pos + r + 1;
    for (int64_t r = me; r < n; r += team) {
        const float *embedding = plan->embedding + tokens[r] * plan->embedding_row_stride;
        for (int64_t i = 0; i < dim; ++i) x[r * dim + i] = embedding[i * plan->embedding_col_stride];
        rms_norm(x + r * dim, f32(plan->layers[0]), h + r * dim, dim, eps);
    }
    team_barrier(barrier, team);
    for (int64_t l = 0; l < plan->n_layers; ++l) {
        const int64_t *p = plan->layers + COLUMNS * l;
        matmul(p + QKV, h, n, dim, f32(p[2]), qkv, qkv_width, dim, qkv_width, 0, 0);
        team_barrier(barrier, team);
        char *k_buffer = (char *)(intptr_t)p[7], *v_buffer = (char *)(intptr_t)p[8];
        const int kv_kind = (int)plan->kv_kind;
        const int64_t kv_size = kv_kind ? 2 : 4;  /* bytes per K/V element */
        for (int64_t r = me; r < n; r += team) {
            float *qr = q + r * q_width, *k = qkv + r * qkv_width + q_width, *v = k + kv_width;
            const float *cos = plan->cos + (pos + r) * head_dim, *sin = plan->sin + (pos + r) * head_dim;
            memcpy(qr, qkv + r * qkv_width, sizeof(float) * (size_t)q_width);
            if (p[3]) {  /* QK-norm: each head's q and k normalised before the rotation */
                for (int64_t g = 0; g < heads; ++g)
                    rms_norm(qr + g * head_dim, f32(p[3]), qr + g * head_dim, head_dim, eps);
                for (int64_t g = 0; g < kv_heads; ++g)
                    rms_norm(k + g * head_dim, f32(p[4]), k + g * head_dim, head_dim, eps);
            }
            rotate(qr, heads, head_dim, cos, sin);
            rotate(k, kv_heads, head_dim, cos, sin);
            astrai_store_kv((char *)(intptr_t)p[5] + k_offsets[r] * kv_size, k, kv_width, kv_kind);
            astrai_store_kv((char *)(intptr_t)p[6] + v_offsets[r] * kv_size, v, kv_width, kv_kind);
            for (int64_t g = 0; g < kv_heads; ++g) {
                const int64_t at = (g * capacity + pos + r) * head_dim * kv_size;
                astrai_store_kv(k_buffer + at, k + g * head_dim, head_dim, kv_kind);
                astrai_store_kv(v_buffer + at, v + g * head_dim, head_dim, kv_kind);
            }
        }
        team_barrier(barrier, team);
        /* every token reads the same buffers (row stride 0), each up to its own position */
        astrai_decode_attention_team(q, k_buffer, v_buffer, attended, lens, plan->attention_workspace, n, kv_heads,
                                     heads / kv_heads, head_dim, head_dim, 0, capacity * head_dim, head_dim,
                                     0, capacity * head_dim, head_dim, 0, 0, 0, plan->scale, capacity,
                                     ASTRAI_MAX_VERIFY_ROWS, kv_kind);
        team_barrier(barrier, team);
        matmul(p + O, attended, n, q_width, 0, out, dim, q_width, dim, 0, 0);
        team_barrier(barrier, team);
        for (int64_t r = me; r < n; r += team) {
            for (int64_t i = 0; i < dim; ++i) x[r * dim + i] += out[r * dim + i];
            rms_norm(x + r * dim, f32(p[1]), h + r * dim, dim, eps);
        }
        team_barrier(barrier, team);
        matmul(p + GATE_UP, h, n, dim, 0, gate_up, 2 * ffn, dim, 2 * ffn, 0, 0);
        team_barrier(barrier, team);
        for (int64_t r = me; r < n; r += team) {
            float *gu = gate_up + r * 2 * ffn;
            #pragma omp simd
            for (int64_t j = 0; j < ffn; ++j) {
                const float g = gu[j];
                gu[j] = g / (1.0f + exp_lanes(-g)) * gu[ffn + j];
            }
        }
        team_barrier(barrier, team);
        matmul(p + DOWN, gate_up, n, 2 * ffn, 0, out, dim, ffn, dim, 0, 0);
        team_barrier(barrier, team);
        /* the residual, and the next layer's input norm (or the final one) */
        for (int64_t r = me; r < n; r += team) {
            for (int64_t i = 0; i < dim; ++i) x[r * dim + i] += out[r * dim + i];
            rms_norm(x + r * dim, l + 1 < plan->n_layers ? f32(p[COLUMNS]) : plan->final_norm, h + r * dim, dim,
                     eps);
        }
        team_barrier(barrier, team);
    }
    matmul(plan->head, h, n, dim, 0, logits, plan->vocab, dim, plan->vocab, best, top);
    team_barrier(barrier, team);
}

static double seconds_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Up to `n_steps` steps in one parallel region (see astrai_decode_steps_f32); returns how many ran. */
static int64_t run_steps(const struct astrai_decode_plan *plan, int64_t token, int64_t pos, const int64_t *k_offsets,
                         const int64_t *v_offsets, int64_t n_steps, const int64_t *stop_ids, int64_t n_stop,
                         int64_t embedding_rows, double max_seconds, int64_t *tokens, float *logits)
{
    const double start = seconds_now();
    int64_t best[MAX_TEAM];
    float top[MAX_TEAM];
    int64_t done = 0;
    int stop = 0;
    struct team_barrier barrier = {0, 0, 0};
    const int threads = plan->threads < MAX_TEAM ? (int)plan->threads : MAX_TEAM;
    #pragma omp parallel num_threads(threads)
    while (!stop) {
        team_step(plan, &token, 1, pos + done, k_offsets + done, v_offsets + done, plan->work, logits, best, top,
                  &barrier);
        if (omp_get_thread_num() == 0) {
            token = astrai_team_argmax(best, top, omp_get_num_threads());
            tokens[done++] = token;
            stop = done >= n_steps || token < 0 || token >= embedding_rows || seconds_now() - start >= max_seconds;
            for (int64_t i = 0; i < n_stop && !stop; ++i) stop = token == stop_ids[i];
        }
        team_barrier(&barrier, omp_get_num_threads());  /* every thread sees the new token and `stop` */
    }
    return done;
}

int64_t astrai_decode_step_f32(const struct astrai_decode_plan *plan, int64_t token, int64_t pos,
                               int64_t k_offset, int64_t v_offset, float *logits)
{
    int64_t answer;
    run_steps(plan, token, pos, &k_offset, &v_offset, 1, 0, 0, INT64_MAX, INFINITY, &answer, logits);
    return answer;
}

/* Up to `n_steps` greedy decode steps of one row in one call: each step's argmax is the next
 * step's token. A lone greedy request otherwise returns to Python after every step, where
 * the engine's checks and bookkeeping (the weight table's `ready`, the cache target, the
 * token's acceptance) cost a few percent of a small model's step, mostly cache misses
 * after the weights streamed through.
 *
 * Step i takes position pos + i and writes its K/V at k_offsets[i] / v_offsets[i] in each
 * layer's page store (and into the decode buffers, whose capacity the caller made room
 * in); tokens[i] is its argmax. The loop ends early, after recording it, at a token in
 * `stop_ids`, or at one the embedding has no row for (`embedding_rows`), which the caller's
 * own step then reports; and after the step that brings the run's time to `max_seconds`
 * (INFINITY: no limit), so that a streamed token never waits long behind its run. Returns
 * how many steps ran; `logits` holds the last one's. */
int64_t astrai_decode_steps_f32(const struct astrai_decode_plan *plan, int64_t token, int64_t pos,
                                const int64_t *k_offsets, const int64_t *v_offsets, int64_t n_steps,
                                const int64_t *stop_ids, int64_t n_stop, int64_t embedding_rows,
                                double max_seconds, int64_t *tokens, float *logits)
{
    return n_steps > 0 ? run_steps(plan, token, pos, k_offsets, v_offsets, n_steps, stop_ids, n_stop, embedding_rows,
                                   max_seconds, tokens, logits) : 0;
}

/* One step of `n` (1 to ASTRAI_MAX_VERIFY_ROWS) consecutive tokens of one row at positions
 * pos .. pos + n - 1, as a speculative decoder's verification runs it: the last accepted token
 * followed by the drafted ones. Every weight is read once for all n tokens, so on a CPU, where
 * a decode step's time is its weights' reading, checking several drafted tokens costs little
 * more than one decode step. Token i's K/V go to k_offsets[i] / v_offsets[i] in each layer's
 * page store and to position pos + i of the decode buffers; `logits` [n][vocab] receives every
 * token's logits; `work` holds n * row_floats(plan) floats. Returns n, or -1 for an n out of
 * range. */
int64_t astrai_verify_step_f32(const struct astrai_decode_plan *plan, const int64_t *tokens, int64_t n, int64_t pos,
                               const int64_t *k_offsets, const int64_t *v_offsets, float *work, float *logits)
{
    if (n < 1 || n > ASTRAI_MAX_VERIFY_ROWS) return -1;
    struct team_barrier barrier = {0, 0, 0};
    const int threads = plan->threads < MAX_TEAM ? (int)plan->threads : MAX_TEAM;
    #pragma omp parallel num_threads(threads)
    team_step(plan, tokens, n, pos, k_offsets, v_offsets, work, logits, 0, 0, &barrier);
    return n;
}

/* Floats of scratch memory a step of `n` tokens needs (`plan->work` is made for n = 1). */
int64_t astrai_step_work_floats(const struct astrai_decode_plan *plan, int64_t n)
{
    return n * row_floats(plan);
}

/* A draft head (astrai/model/draft_head.py) as the C step reads it: its norms' scales, its five
 * linears by their table values (as a layer's weights), the target's embedding and the target
 * ids of the head's output rows. Filled by kernels.py (HeadPlan). */
struct astrai_head_plan {
    const float *embedding;
    int64_t embedding_row_stride, embedding_col_stride, embedding_rows;
    int64_t dim, hidden_dim, draft_vocab;
    float eps;
    const float *hidden_norm, *embed_norm, *mlp_norm, *out_norm;
    int64_t fuse[WEIGHT_VALUES], gate[WEIGHT_VALUES], up[WEIGHT_VALUES], down[WEIGHT_VALUES], out[WEIGHT_VALUES];
    const int64_t *draft_ids;
    float *work;  /* astrai_head_work_floats(plan) floats */
    int64_t threads;
};

/* Scratch floats of a head step: the fused input [2 dim], x and its norm [dim each], gate and
 * up [hidden_dim each], the output's scores [draft_vocab]. */
int64_t astrai_head_work_floats(const struct astrai_head_plan *plan)
{
    return 4 * plan->dim + 2 * plan->hidden_dim + plan->draft_vocab;
}

/* `k` greedy drafts of the head in one call: from the target's final hidden state `hidden`
 * [dim] and the token it chose, each step predicts the next hidden state (the norms of both
 * inputs side by side through `fuse`, then a SwiGLU with its residual) and scores the draft
 * vocabulary on its norm; the best row's target id is the draft and the next step's token.
 * A draft costs the head's weights' reading once, with the Python of the torch ops gone: a
 * dozen operator calls a draft token, most of a draft's time at the head's size. Writes
 * tokens[0 .. k-1] and returns k, or the drafts made before one fell outside the
 * embedding (-1 ends them). */
int64_t astrai_draft_head_steps(const struct astrai_head_plan *plan, const float *hidden, int64_t token, int64_t k,
                                int64_t *tokens)
{
    const int64_t dim = plan->dim, hid = plan->hidden_dim;
    float *joined = plan->work, *x = joined + 2 * dim, *normed = x + dim, *gate = normed + dim, *up = gate + hid;
    float *scores = up + hid;
    memcpy(x, hidden, sizeof(float) * (size_t)dim);
    int64_t best[MAX_TEAM], done = 0;
    float top[MAX_TEAM];
    int stop = 0;
    struct team_barrier barrier = {0, 0, 0};
    const int threads = plan->threads < MAX_TEAM ? (int)plan->threads : MAX_TEAM;
    if (k < 1 || token < 0 || token >= plan->embedding_rows) return 0;
    #pragma omp parallel num_threads(threads)
    while (!stop) {
        const int team = omp_get_num_threads(), lead = omp_get_thread_num() == 0;
        if (lead) {
            const float *embedding = plan->embedding + token * plan->embedding_row_stride;
            rms_norm(x, plan->hidden_norm, joined, dim, plan->eps);
            for (int64_t i = 0; i < dim; ++i) normed[i] = embedding[i * plan->embedding_col_stride];
            rms_norm(normed, plan->embed_norm, joined + dim, dim, plan->eps);
        }
        team_barrier(&barrier, team);
        matmul(plan->fuse, joined, 1, 2 * dim, 0, x, dim, 2 * dim, dim, 0, 0);
        team_barrier(&barrier, team);
        if (lead) rms_norm(x, plan->mlp_norm, normed, dim, plan->eps);
        team_barrier(&barrier, team);
        matmul(plan->gate, normed, 1, dim, 0, gate, hid, dim, hid, 0, 0);
        matmul(plan->up, normed, 1, dim, 0, up, hid, dim, hid, 0, 0);
        team_barrier(&barrier, team);
        if (lead) {
            #pragma omp simd
            for (int64_t j = 0; j < hid; ++j) gate[j] = gate[j] / (1.0f + exp_lanes(-gate[j])) * up[j];
        }
        team_barrier(&barrier, team);
        matmul(plan->down, gate, 1, hid, 0, normed, dim, hid, dim, 0, 0);
        team_barrier(&barrier, team);
        if (lead) {
            for (int64_t i = 0; i < dim; ++i) x[i] += normed[i];
            rms_norm(x, plan->out_norm, normed, dim, plan->eps);
        }
        team_barrier(&barrier, team);
        matmul(plan->out, normed, 1, dim, 0, scores, plan->draft_vocab, dim, plan->draft_vocab, best, top);
        team_barrier(&barrier, team);
        if (lead) {
            const int64_t row = astrai_team_argmax(best, top, team);
            token = row >= 0 && row < plan->draft_vocab ? plan->draft_ids[row] : -1;
            if (token < 0 || token >= plan->embedding_rows) {
                stop = 1;
            } else {
                tokens[done++] = token;
                stop = done >= k;
            }
        }
        team_barrier(&barrier, team);
    }
    return done;
}

/* A greedy row's speculative decoding, many verify steps in one call, drafting with a draft
 * head or by prompt lookup. Filled by kernels.py (SpeculativeRun); `length` and `kept` are the
 * row's draft length and kept fraction (speculative.py's RowRecord), which the steps update as
 * SpeculationControl.record does. */
struct astrai_speculative_run {
    int64_t token, pos, steps;            /* the row's last token (no K/V yet), its position, tokens the run may give */
    const int64_t *k_offsets, *v_offsets; /* [steps]: where positions pos .. pos + steps - 1 go in the page store */
    const float *hidden;                  /* [dim]: the final hidden state whose logits chose `token`, or NULL */
    const int64_t *stop_ids;
    int64_t n_stop, embedding_rows;
    double max_seconds;
    int64_t max_draft;                    /* k: drafts a step at most */
    double decay, min_kept;
    int64_t length;                       /* in and out */
    double kept;                          /* in and out */
    int64_t *tokens, *drafted, *kept_drafts;  /* [steps] each: the tokens given; drafts made and kept per verify step */
    int64_t verify_steps;                 /* out */
    float *hidden_out;                    /* [dim]: the final hidden state whose logits chose the last token, or NULL */
    float *work, *logits;                 /* astrai_step_work_floats(plan, ASTRAI_MAX_VERIFY_ROWS), [that many][vocab] */
};

/* A run's drafter: up to `want` drafts after `token` into `out` (how many it wrote), given
 * the run so far (`given` tokens in run->tokens; `hidden` whether run->hidden_out holds the
 * state that chose `token`). */
typedef int64_t (*run_drafter)(void *drafter, const struct astrai_speculative_run *run, int64_t given, int hidden,
                               int64_t token, int64_t want, int64_t *out);

/* Verify steps of one greedy row, each drafting with `draft` (the first, without `hidden`, may
 * draft only with a drafter that needs no state) and keeping the drafts while they equal the
 * target's argmax and the argmax after them, as the engine's verify step does
 * (speculative.py's accept_greedy): the tokens are exactly those of greedy decoding. The
 * drafting and the acceptance run here, between the steps, so the Python of the engine's loop
 * (planning, the drafting call, acceptance, the task's bookkeeping: about half a millisecond a
 * step, a sixth of an int8 SmolLM2 step on a fast machine) comes once a run, as a lone greedy
 * request's plain steps have it (astrai_decode_steps_f32). Every argmax is the head matmul's own.
 *
 * The run ends once it has given `steps` tokens, at a token in `stop_ids` or one the embedding
 * has no row for (it is the last), after the step that brings it to `max_seconds`, or after a
 * step that takes the kept fraction below `min_kept` (the engine then pauses the row's drafts).
 * A step drafts at most `steps` - given - 1 tokens, so every position it writes has its offsets.
 * Returns the tokens given; `verify_steps`, `drafted` and `kept_drafts` say how. */
static int64_t speculative_steps(const struct astrai_decode_plan *plan, struct astrai_speculative_run *run,
                                 run_drafter draft, void *drafter)
{
    const double start = seconds_now();
    const int64_t dim = plan->dim, k = run->max_draft < ASTRAI_MAX_VERIFY_ROWS - 1 ? run->max_draft
                                                                                 : ASTRAI_MAX_VERIFY_ROWS - 1;
    int64_t best[ASTRAI_MAX_VERIFY_ROWS * MAX_TEAM];
    float top[ASTRAI_MAX_VERIFY_ROWS * MAX_TEAM];
    int64_t token = run->token, pos = run->pos, given = 0, steps = 0;
    int hidden = run->hidden != NULL, stop = 0;
    if (hidden && run->hidden_out) memcpy(run->hidden_out, run->hidden, sizeof(float) * (size_t)dim);
    const int threads = plan->threads < MAX_TEAM ? (int)plan->threads : MAX_TEAM;
    while (!stop && given < run->steps) {
        int64_t rows[ASTRAI_MAX_VERIFY_ROWS];
        int64_t want = run->length < k ? run->length : k;
        if (want > run->steps - given - 1) want = run->steps - given - 1;
        rows[0] = token;
        const int64_t drafted = want > 0 ? draft(drafter, run, given, hidden, token, want, rows + 1) : 0;
        const int64_t n = 1 + drafted;
        struct team_barrier barrier = {0, 0, 0};
        int team = 1;
        #pragma omp parallel num_threads(threads)
        {
            team_step(plan, rows, n, pos, run->k_offsets + given, run->v_offsets + given, run->work, run->logits, best,
                      top, &barrier);
            if (omp_get_thread_num() == 0) team = omp_get_num_threads();
        }
        int64_t kept = 0, choice;
        for (;;) {
            choice = astrai_team_argmax(best + kept * MAX_TEAM, top + kept * MAX_TEAM, team);
            if (kept < drafted && choice == rows[1 + kept]) ++kept;
            else break;
        }
        if (run->hidden_out)  /* team_step's h, row kept */
            memcpy(run->hidden_out, run->work + (n + kept) * dim, sizeof(float) * (size_t)dim);
        hidden = 1;
        run->drafted[steps] = drafted;
        run->kept_drafts[steps++] = kept;
        if (drafted > 0) {  /* SpeculationControl.record's rule */
            run->length = kept == drafted ? (2 * drafted < run->max_draft ? 2 * drafted : run->max_draft) : kept + 1;
            const double weight = pow(run->decay, (double)drafted / (double)run->max_draft);
            run->kept = weight * run->kept + (1.0 - weight) * (double)kept / (double)drafted;
            stop = run->kept < run->min_kept;
        }
        for (int64_t i = 0; i <= kept; ++i) {
            const int64_t t = i < kept ? rows[1 + i] : choice;
            run->tokens[given++] = t;
            int ends = t < 0 || t >= run->embedding_rows;
            for (int64_t s = 0; s < run->n_stop && !ends; ++s) ends = t == run->stop_ids[s];
            if (ends) {
                stop = 1;
                break;
            }
        }
        token = choice;
        pos += kept + 1;
        if (seconds_now() - start >= run->max_seconds) stop = 1;
    }
    run->verify_steps = steps;
    return given;
}

static int64_t head_drafts(void *drafter, const struct astrai_speculative_run *run, int64_t given, int hidden,
                           int64_t token, int64_t want, int64_t *out)
{
    (void)given;
    return hidden ? astrai_draft_head_steps((const struct astrai_head_plan *)drafter, run->hidden_out, token, want, out)
                  : 0;
}

/* Verify steps of one greedy row drafting with a draft head (speculative_steps): each step's
 * drafts come from the hidden state the step before left (the first's from `hidden`; without
 * it the first step drafts nothing). `hidden_out` [dim] receives the state that chose the last
 * token. */
int64_t astrai_head_speculative_steps(const struct astrai_decode_plan *plan, const struct astrai_head_plan *head,
                                      struct astrai_speculative_run *run)
{
    return run->hidden_out ? speculative_steps(plan, run, head_drafts, (void *)head) : 0;
}

/* A row's tokens for prompt lookup in a run (kernels.py's PromptLookupRun): the row's context
 * (its last token last) in a buffer with room for the run's tokens, which the drafts append
 * as they find them given. */
struct astrai_prompt_lookup {
    int64_t *context;
    int64_t length, synced;  /* tokens in `context`; of the run's given tokens, how many are appended */
    int64_t min_n, max_n;
};

/* speculative.py's NgramIndex.lookup over the `len` tokens of `c`: the `want` tokens that
 * followed the latest earlier occurrence of the last n tokens (longest n first, from `max_n`
 * down to `min_n`), repeating them when that occurrence is closer to the end than `want`;
 * returns how many it wrote: `want`, or 0 when none occurs. */
int64_t astrai_ngram_drafts(const int64_t *c, int64_t len, int64_t min_n, int64_t max_n, int64_t want, int64_t *out)
{
    for (int64_t n = max_n < len - 1 ? max_n : len - 1; n >= min_n && n >= 1; --n)
        for (int64_t end = len - 1; end >= n; --end) {  /* an occurrence [end - n, end) with a token after it */
            if (memcmp(c + end - n, c + len - n, sizeof(int64_t) * (size_t)n) != 0) continue;
            const int64_t period = len - end;
            for (int64_t i = 0; i < want; ++i) out[i] = c[end + i % period];
            return want;
        }
    return 0;
}

static int64_t lookup_drafts(void *drafter, const struct astrai_speculative_run *run, int64_t given, int hidden,
                             int64_t token, int64_t want, int64_t *out)
{
    struct astrai_prompt_lookup *lookup = drafter;
    (void)hidden, (void)token;
    while (lookup->synced < given) lookup->context[lookup->length++] = run->tokens[lookup->synced++];
    return astrai_ngram_drafts(lookup->context, lookup->length, lookup->min_n, lookup->max_n, want, out);
}

/* Verify steps of one greedy row drafting by prompt lookup (speculative_steps). */
int64_t astrai_lookup_speculative_steps(const struct astrai_decode_plan *plan, struct astrai_prompt_lookup *lookup,
                                        struct astrai_speculative_run *run)
{
    if (lookup->min_n < 1 || lookup->max_n < lookup->min_n || lookup->length < 1) return 0;
    return speculative_steps(plan, run, lookup_drafts, lookup);
}

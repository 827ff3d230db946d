/* A decoder layer in two calls instead of about twenty-five torch ops: called through ctypes by
 * backends/cpu/layer.py and stack.py, compiled into the same library as attention.c and linear.c,
 * whose exported kernels it chains.
 *
 * Why: for a small model (SmolLM2: 30 layers, hidden 576) a decode step is mostly fixed cost per op:
 * module calls, argument checks, tensor allocation, dispatch, as much per layer as reading the
 * layer's weights (the profile is in docs/PERFORMANCE-HISTORY.md). Attention stays a call of its own between the two halves
 * (models/attention.py, which owns the paged-cache rules); everything before and after it is one
 * call each:
 *
 *   tandem_attention_in:  x = RMSNorm(h); qkv = x W_qkv^T (+ b); q/k norm, RoPE, K and V to the cache
 *   tandem_mlp_block:     h += attn W_o^T (+ b); x = RMSNorm(h); g, u = x W_gu^T (+ b);
 *                         h += (silu(g) * u) W_down^T (+ b)
 *
 * and, for a decode-only step, every layer in one call (tandem_decode_layers: the two halves with
 * decode attention between them, layer after layer), so the step's host work is one call, not 90.
 *
 * Rounding: every intermediate is rounded to bf16 where the torch path rounds it (each linear's
 * output, each residual sum, silu's output and the product with u), so the layer computes what the
 * module path computes, up to the order of fp32 sums and silu's exp (about 1 ulp in fp32).
 * Intermediates live in a buffer of the calling thread that grows to the largest step and stays.
 *
 * LoRA: the *_lora entry points take the layer's adapter slots (lora.h: qkv, o, gate/up, down) and
 * each row's slot, and add each adapted row's delta (lora.c) to a projection's rounded output, where
 * the per-op path adds it (models/transformer.py): a row of slot -1 is untouched, so its bits are the
 * plain entry points' (which are these with no slots), whatever its neighbours' adapters.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exp.h"
#include "lora.h"
#include "scratch.h"
#include "weight.h"

enum { BF16 = 1 };
#define PARALLEL_MIN_ELEMENTS 16384

int tandem_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t size, float eps,
                    int dtype);
int tandem_decode_attention(const void *q, const void *kv_cache, const int32_t *block_tables,
                            const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks, float scale, int dtype);
int tandem_qkv_rope_cache(const void *qkv, const void *cos, const void *sin, const void *q_norm,
                          const void *k_norm, const int64_t *slots, void *kv_cache, void *q_out, void *k_out,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, float eps, int dtype);

static __thread ThreadBuffer buffer;

static uint16_t *scratch(size_t elements) { return buffer_of_at_least(&buffer, elements * sizeof(uint16_t)); }

/* Whether the slots lora[first, last) refuse the step (tandem_lora_check), are not bf16, or do not
 * take k inputs and give n outputs: checked before anything is written. */
static int lora_refuses(const TandemLoraWeight *const *lora, const int64_t *slots, int64_t m, int64_t k, int64_t n,
                        int first, int last) {
    for (int i = first; i < last; i++)
        if (tandem_lora_check(lora[i], slots, m) != 0 || lora[i]->dtype != BF16 || lora[i]->k != k ||
            lora[i]->n != n)
            return 1;
    return 0;
}

/* silu(g) = g * sigmoid(g), with exp of a non-positive argument only (no overflow); the polynomial
 * exp, so that swiglu's loop vectorises (libm's expf is one scalar call per value). */
static inline __attribute__((always_inline)) float silu(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/* h = round(h + d), elementwise over n bf16 values (torch's bf16 add: fp32 sum, one rounding). */
static void add_into(uint16_t *restrict h, const uint16_t *restrict d, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(d[i]));
}

/* act [m, inter] = round(round(silu(g)) * u) from gu [m, 2 * inter] = [g | u] per row. */
static void swiglu(uint16_t *restrict act, const uint16_t *restrict gu, int64_t m, int64_t inter) {
#pragma omp parallel for schedule(static) if (m * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *g = gu + r * 2 * inter, *u = g + inter;
        uint16_t *a = act + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float s = bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(g[i]))));
            a[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

/* h [m, hidden] -> q_out [m, num_heads, head_dim] (and k_out, v_out [m, num_kv_heads, head_dim] when
 * not NULL), this step's keys and values written to kv_cache [2, num_slots, num_kv_heads, head_dim] at
 * slots. w_qkv describes a [(num_heads + 2 * num_kv_heads) * head_dim, hidden] weight (weight.h: bf16 or
 * quantized); b_qkv, q_norm, k_norm may be NULL. lora: the layer's LORAS_PER_LAYER slots and lora_slots
 * [m] each row's (-1: none), or NULL: no adapters (tandem_attention_in).
 * Returns 0, or -1 (a slot out of range, a bad size, no scratch memory), -2 (a LoRA slot out of range
 * or slots that do not fit the layer: nothing written). All bf16 and contiguous. */
int tandem_attention_in_lora(const uint16_t *h, const uint16_t *norm, float eps, const TandemWeight *w_qkv,
                             const uint16_t *b_qkv, const uint16_t *q_norm, const uint16_t *k_norm, float qk_eps,
                             const uint16_t *cos, const uint16_t *sin, const int64_t *slots, uint16_t *kv_cache,
                             int64_t num_slots, uint16_t *q_out, uint16_t *k_out, uint16_t *v_out, int64_t m,
                             int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             const TandemLoraWeight *const *lora, const int64_t *lora_slots) {
    if (m < 0 || hidden < 1 || num_heads < 1 || num_kv_heads < 1 || head_dim < 2) return -1;
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
    if (lora != NULL && lora_refuses(lora, lora_slots, m, hidden, width, LORA_QKV, LORA_O)) return -2;
    uint16_t *x = scratch((size_t)(m * (hidden + width)));
    if (x == NULL && m > 0) return -1;
    uint16_t *qkv = x + m * hidden;
    if (tandem_rms_norm(h, norm, x, m, hidden, eps, BF16) != 0) return -1;
    if (tandem_linear(x, w_qkv, b_qkv, qkv, m, width, hidden, BF16) != 0) return -1;
    if (lora != NULL && tandem_lora_delta(lora[LORA_QKV], x, qkv, lora_slots, m) != 0) return -1;
    if (tandem_qkv_rope_cache(qkv, cos, sin, q_norm, k_norm, slots, kv_cache, q_out, k_out, m, num_heads,
                              num_kv_heads, head_dim, num_slots, qk_eps, BF16) != 0)
        return -1;
    if (v_out != NULL) {
        const int64_t kv_width = num_kv_heads * head_dim, v_at = (num_heads + num_kv_heads) * head_dim;
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < kv_width; i++) v_out[r * kv_width + i] = qkv[r * width + v_at + i];
    }
    return 0;
}

int tandem_attention_in(const uint16_t *h, const uint16_t *norm, float eps, const TandemWeight *w_qkv,
                        const uint16_t *b_qkv, const uint16_t *q_norm, const uint16_t *k_norm, float qk_eps,
                        const uint16_t *cos, const uint16_t *sin, const int64_t *slots, uint16_t *kv_cache,
                        int64_t num_slots, uint16_t *q_out, uint16_t *k_out, uint16_t *v_out, int64_t m,
                        int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    return tandem_attention_in_lora(h, norm, eps, w_qkv, b_qkv, q_norm, k_norm, qk_eps, cos, sin, slots, kv_cache,
                                    num_slots, q_out, k_out, v_out, m, hidden, num_heads, num_kv_heads, head_dim,
                                    NULL, NULL);
}

/* h [m, hidden] in place: h += attn W_o^T (+ b_o); then h += down(silu(g) * u) of RMSNorm(h) (see the top).
 * attn [m, attn_width]; weights (weight.h descriptors) w_o [hidden, attn_width]; w_gu [2 * inter, hidden]
 * (gate rows, then up rows); w_down [hidden, inter]; biases may be NULL. lora and lora_slots as
 * tandem_attention_in_lora's (NULL: tandem_mlp_block). Returns 0, or -1 (a bad size, no scratch
 * memory), -2 (tandem_attention_in_lora's: nothing written). */
int tandem_mlp_block_lora(uint16_t *h, const uint16_t *attn, const TandemWeight *w_o, const uint16_t *b_o,
                          const uint16_t *norm, float eps, const TandemWeight *w_gu, const uint16_t *b_gu,
                          const TandemWeight *w_down, const uint16_t *b_down, int64_t m, int64_t hidden,
                          int64_t attn_width, int64_t inter, const TandemLoraWeight *const *lora,
                          const int64_t *lora_slots) {
    if (m < 0 || hidden < 1 || attn_width < 1 || inter < 1) return -1;
    if (m == 0) return 0;
    if (lora != NULL && (lora_refuses(lora, lora_slots, m, attn_width, hidden, LORA_O, LORA_GATE_UP) ||
                         lora_refuses(lora, lora_slots, m, hidden, 2 * inter, LORA_GATE_UP, LORA_DOWN) ||
                         lora_refuses(lora, lora_slots, m, inter, hidden, LORA_DOWN, LORAS_PER_LAYER)))
        return -2;
    uint16_t *d = scratch((size_t)(m * (2 * hidden + 3 * inter)));
    if (d == NULL) return -1;
    uint16_t *x = d + m * hidden, *gu = x + m * hidden, *act = gu + m * 2 * inter;
    if (tandem_linear(attn, w_o, b_o, d, m, hidden, attn_width, BF16) != 0) return -1;
    if (lora != NULL && tandem_lora_delta(lora[LORA_O], attn, d, lora_slots, m) != 0) return -1;
    add_into(h, d, m * hidden);
    if (tandem_rms_norm(h, norm, x, m, hidden, eps, BF16) != 0) return -1;
    if (tandem_linear(x, w_gu, b_gu, gu, m, 2 * inter, hidden, BF16) != 0) return -1;
    if (lora != NULL && tandem_lora_delta(lora[LORA_GATE_UP], x, gu, lora_slots, m) != 0) return -1;
    swiglu(act, gu, m, inter);
    if (tandem_linear(act, w_down, b_down, d, m, hidden, inter, BF16) != 0) return -1;
    if (lora != NULL && tandem_lora_delta(lora[LORA_DOWN], act, d, lora_slots, m) != 0) return -1;
    add_into(h, d, m * hidden);
    return 0;
}

int tandem_mlp_block(uint16_t *h, const uint16_t *attn, const TandemWeight *w_o, const uint16_t *b_o,
                     const uint16_t *norm, float eps, const TandemWeight *w_gu, const uint16_t *b_gu,
                     const TandemWeight *w_down, const uint16_t *b_down, int64_t m, int64_t hidden, int64_t attn_width,
                     int64_t inter) {
    return tandem_mlp_block_lora(h, attn, w_o, b_o, norm, eps, w_gu, b_gu, w_down, b_down, m, hidden, attn_width,
                                 inter, NULL, NULL);
}

/* Pointers per layer in tandem_decode_layers' `weights`, in this order (bias and q/k norms may be NULL;
 * the projections W_QKV, W_O, W_GATE_UP and W_DOWN are weight.h descriptors, the rest bf16 vectors). */
enum {
    W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_Q_NORM, W_K_NORM, W_O, W_O_BIAS, W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS,
    W_DOWN, W_DOWN_BIAS, WEIGHTS_PER_LAYER
};

/* Every layer of a decode-only step: for each layer, tandem_attention_in, tandem_decode_attention
 * (one query per row, each row its own sequence) and tandem_mlp_block, exactly as the per-layer calls
 * run them (the same kernels in the same order: the same bits). h [m, hidden] is updated in place.
 * weights: [num_layers][WEIGHTS_PER_LAYER]; kv_caches: [num_layers] caches of [2, num_blocks,
 * block_size, num_kv_heads, head_dim]; q and attn: scratch [m, num_heads * head_dim].
 * lora: [num_layers][LORAS_PER_LAYER] adapter slots and lora_slots [m], or NULL (tandem_decode_layers).
 * Returns 0; 1 when a slot is outside the cache, 2 when a length or block id is, 3 without scratch
 * memory (what the layers before wrote to the cache stays: the caller fails the step), 4 when a LoRA
 * slot is outside the table or the slots do not fit the layers (checked first: nothing written). */
int tandem_decode_layers_lora(uint16_t *h, const void *const *weights, void *const *kv_caches, int64_t num_layers,
                              float eps, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                              const int32_t *block_tables, const int32_t *seq_lens, int64_t max_blocks,
                              int64_t num_blocks, int64_t block_size, float scale, uint16_t *q, uint16_t *attn,
                              int64_t m, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t inter, const TandemLoraWeight *const *lora, const int64_t *lora_slots) {
    if (num_layers < 0 || m < 0 || num_blocks < 0 || block_size < 1) return 2;
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim, attn_width = num_heads * head_dim;
    for (int64_t l = 0; lora != NULL && l < num_layers; l++) { /* before any layer writes the cache */
        const TandemLoraWeight *const *ll = lora + l * LORAS_PER_LAYER;
        if (lora_refuses(ll, lora_slots, m, hidden, width, LORA_QKV, LORA_O) ||
            lora_refuses(ll, lora_slots, m, attn_width, hidden, LORA_O, LORA_GATE_UP) ||
            lora_refuses(ll, lora_slots, m, hidden, 2 * inter, LORA_GATE_UP, LORA_DOWN) ||
            lora_refuses(ll, lora_slots, m, inter, hidden, LORA_DOWN, LORAS_PER_LAYER))
            return 4;
    }
    for (int64_t l = 0; l < num_layers; l++) {
        const void *const *w = weights + l * WEIGHTS_PER_LAYER;
        const TandemLoraWeight *const *ll = lora == NULL ? NULL : lora + l * LORAS_PER_LAYER;
        if (tandem_attention_in_lora(h, w[W_INPUT_NORM], eps, w[W_QKV], w[W_QKV_BIAS], w[W_Q_NORM], w[W_K_NORM],
                                     eps, cos, sin, slots, kv_caches[l], num_blocks * block_size, q, NULL, NULL, m,
                                     hidden, num_heads, num_kv_heads, head_dim, ll, lora_slots) != 0)
            return 1;
        const int attended = tandem_decode_attention(q, kv_caches[l], block_tables, seq_lens, attn, m, num_heads,
                                                     num_kv_heads, head_dim, num_blocks, block_size, max_blocks,
                                                     scale, BF16);
        if (attended != 0) return attended == -2 ? 3 : 2;
        if (tandem_mlp_block_lora(h, attn, w[W_O], w[W_O_BIAS], w[W_POST_NORM], eps, w[W_GATE_UP],
                                  w[W_GATE_UP_BIAS], w[W_DOWN], w[W_DOWN_BIAS], m, hidden, attn_width, inter, ll,
                                  lora_slots) != 0)
            return 3;
    }
    return 0;
}

int tandem_decode_layers(uint16_t *h, const void *const *weights, void *const *kv_caches, int64_t num_layers,
                         float eps, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                         const int32_t *block_tables, const int32_t *seq_lens, int64_t max_blocks,
                         int64_t num_blocks, int64_t block_size, float scale, uint16_t *q, uint16_t *attn,
                         int64_t m, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t inter) {
    return tandem_decode_layers_lora(h, weights, kv_caches, num_layers, eps, cos, sin, slots, block_tables, seq_lens,
                                     max_blocks, num_blocks, block_size, scale, q, attn, m, hidden, num_heads,
                                     num_kv_heads, head_dim, inter, NULL, NULL);
}

/* LoRA deltas, each row its own adapter (Punica / S-LoRA), added into a projection's output in place.
 *
 * For row t with slot s = slots[t] >= 0 (-1: the base model, untouched), and each part p of the
 * projection (q/k/v of a fused qkv, gate/up, or the one part) with rank r = ranks[s][p] > 0:
 *
 *     u[j] = sum_i x[t][i] * a[s][p * max_rank + j][i]                 j < r
 *     y[t][o] = round(y[t][o] + scales[s] * sum_j u[j] * bt[s][j][o])   o in part p's columns
 *
 * models/lora.py has the layout and the reference in torch.
 *
 * NOTE: the order. Each u[j] is LANES running sums over i (lane l takes i = l, l + LANES, ...),
 * added lane 0 first, then the tail in order; each output's sum over j runs j = 0, 1, ... So every
 * row's bits depend on its own inputs and slot only: not on how many rows share the call, which
 * adapters they use, or the number of threads (threads split whole (row, j) and (row, column block)
 * units). Weights and activations are float32 or bf16 (the model's dtype); every sum is float32,
 * rounded once into y.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
#define COLUMNS 256 /* output columns per unit of the second pass (its sums stay in registers' reach) */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

#define INLINE static inline __attribute__((always_inline))

INLINE float value_at(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* LANES consecutive values of p from i on, as float32 (bf16: the top halves of the floats). */
INLINE vf lanes_at(const void *p, int64_t i, int is_bf16) {
    vf v;
    if (is_bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const vu bits = __builtin_convertvector(h, vu) << 16;
        memcpy(&v, &bits, sizeof v);
    } else {
        memcpy(&v, (const float *)p + i, sizeof v);
    }
    return v;
}

/* sum_i x[i] * w[i] over k values: x float32, w in the weights' dtype; the order of the NOTE. */
INLINE float dot(const float *x, const void *w, int64_t k, int is_bf16) {
    vf acc = {0};
    const int64_t whole = k - k % LANES;
    for (int64_t i = 0; i < whole; i += LANES) {
        vf xv;
        memcpy(&xv, x + i, sizeof xv);
        acc += xv * lanes_at(w, i, is_bf16);
    }
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += acc[l];
    for (int64_t i = whole; i < k; i++) sum += x[i] * value_at(w, i, is_bf16);
    return sum;
}

/* d[o - from] += u * b[o] for o in [from, to): each element's own product and sum, as in scalar code. */
INLINE void axpy(float *d, float u, const void *b, int64_t from, int64_t to, int is_bf16) {
    int64_t o = from;
    for (; o + LANES <= to; o += LANES) {
        vf dv;
        memcpy(&dv, d + (o - from), sizeof dv);
        dv += u * lanes_at(b, o, is_bf16);
        memcpy(d + (o - from), &dv, sizeof dv);
    }
    for (; o < to; o++) d[o - from] += u * value_at(b, o, is_bf16);
}

/* Row t's columns [from, to) of part p (rank r): y += scale * sum_j u[j] * bt[j][o], j in order. */
INLINE void add_part(void *y, const float *u, const void *bt_slot, float scale, int64_t t, int64_t n, int64_t r,
                     int64_t from, int64_t to, int is_bf16) {
    float d[COLUMNS];
    for (int64_t o = from; o < to; o++) d[o - from] = 0.0f;
    const size_t element = is_bf16 ? 2 : 4;
    for (int64_t j = 0; j < r; j++) axpy(d, u[j], (const char *)bt_slot + (size_t)(j * n) * element, from, to, is_bf16);
    for (int64_t o = from; o < to; o++) {
        const int64_t at = t * n + o;
        if (is_bf16) {
            uint16_t *out = (uint16_t *)y;
            out[at] = f32_to_bf16(bf16_to_f32(out[at]) + scale * d[o - from]);
        } else {
            float *out = (float *)y;
            out[at] = out[at] + scale * d[o - from];
        }
    }
}

/* y[t] [n], x [m, k], a [num_slots, num_parts * max_rank, k], bt [num_slots, max_rank, n] in `dtype`
 * (0 float32, 1 bf16); slots [m]; ranks [num_slots, num_parts]; scales [num_slots]; part_ends
 * [num_parts], the last n. 0; -1 bad sizes; -2 a slot or rank out of range; -3 no memory. */
int tandem_lora_delta(const void *x, void *y, const int64_t *slots, const void *a, const void *bt,
                      const int64_t *ranks, const float *scales, const int64_t *part_ends, int64_t m, int64_t n,
                      int64_t k, int64_t num_slots, int64_t num_parts, int64_t max_rank, int dtype) {
    if (m < 0 || n < 1 || k < 1 || num_slots < 1 || num_parts < 1 || max_rank < 1 || (dtype != 0 && dtype != 1) ||
        part_ends[num_parts - 1] != n)
        return -1;
    for (int64_t p = 0; p < num_parts; p++)
        if (part_ends[p] < (p ? part_ends[p - 1] : 0)) return -1;
    for (int64_t t = 0; t < m; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
    for (int64_t i = 0; i < num_slots * num_parts; i++)
        if (ranks[i] < 0 || ranks[i] > max_rank) return -2;
    const int is_bf16 = dtype == 1;
    const int64_t width = num_parts * max_rank; /* u's per row */
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * width + 1));
    if (xf == NULL) return -3;
    float *u = xf + m * k;

    /* Pass 1: each adapted row's x as float32, and its u. A unit is (row, one of its u). */
#pragma omp parallel for schedule(static) if (m * k > 4096)
    for (int64_t t = 0; t < m; t++)
        if (slots[t] >= 0)
            for (int64_t i = 0; i < k; i++) xf[t * k + i] = value_at(x, t * k + i, is_bf16);
#pragma omp parallel for schedule(static) if (m * width * k > 65536)
    for (int64_t unit = 0; unit < m * width; unit++) {
        const int64_t t = unit / width, row = unit % width, s = slots[t];
        if (s < 0 || row % max_rank >= ranks[s * num_parts + row / max_rank]) continue;
        const size_t element = is_bf16 ? 2 : 4;
        const char *w = (const char *)a + ((size_t)s * (size_t)width + (size_t)row) * (size_t)k * element;
        u[unit] = is_bf16 ? dot(xf + t * k, w, k, 1) : dot(xf + t * k, w, k, 0);
    }

    /* Pass 2: a unit is (row, block of COLUMNS output columns); each column sums over j in order. */
    const int64_t blocks = (n + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for schedule(static) if (m * blocks > 1)
    for (int64_t unit = 0; unit < m * blocks; unit++) {
        const int64_t t = unit / blocks, s = slots[t];
        if (s < 0) continue;
        const int64_t lo = (unit % blocks) * COLUMNS, hi = lo + COLUMNS < n ? lo + COLUMNS : n;
        const size_t element = is_bf16 ? 2 : 4;
        const char *bt_slot = (const char *)bt + (size_t)(s * max_rank * n) * element;
        for (int64_t p = 0, start = 0; p < num_parts; start = part_ends[p], p++) {
            const int64_t from = lo > start ? lo : start, to = hi < part_ends[p] ? hi : part_ends[p];
            const int64_t r = ranks[s * num_parts + p];
            if (from >= to || r == 0) continue;
            const float *ut = u + t * width + p * max_rank;
            if (is_bf16)
                add_part(y, ut, bt_slot, scales[s], t, n, r, from, to, 1);
            else
                add_part(y, ut, bt_slot, scales[s], t, n, r, from, to, 0);
        }
    }
    free(xf);
    return 0;
}

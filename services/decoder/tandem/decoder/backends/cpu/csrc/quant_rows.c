/* Rows of a quantized table as values: the token embedding of a model whose table is quantized
 * (models/quantized.py's QuantizedEmbedding, `--quantization`), called through ctypes
 * (kernels.py: Kernels.quantized_rows).
 *
 * Why: QuantizedTensor.rows gathers a row's group, its lanes and its scales with about twenty torch
 * ops, 79-88 us for one token and 250 for 32 (Zen 4, 2 threads; 7 and 50 here): a one-sequence
 * decode step with 4-bit weights went 2% faster (6.47 -> 6.33 ms with int8 activations, 6.78 ->
 * 6.65 without). A row here is its blocks' codes read in place.
 *
 * Values: each weight as GGUF computes it in fp32 and QuantizedTensor.rows does, d q + m (Q4_1),
 * d (q - 8) (Q4_0), d q (Q8_0): d q is exact in fp32 (an 11-bit significand by at most 8 bits), so
 * each value is rounded once, at + m, then once more to the output's dtype (bf16: nearest even, as
 * torch's .to(bfloat16)). No contraction is possible (-std=c11: -ffp-contract=off), and an fma would
 * round the same anyway. The same bits as the torch path (test_quant_rows.py).
 *
 * Storage: weight.h / linear_quant.c's. Output c of group g, block b, pair p: lanes 2 c and 2 c + 1 of
 * the pair (inputs 2 p and 2 p + 1); 4-bit lane L is byte L's low nibble below 16, byte L - 16's high
 * nibble from 16; 8-bit lane L is int8 byte L; the scale (and offset) at [g][b][c].
 */
#include <stdint.h>

#include "bf16.h"
#include "elements.h"
#include "weight.h"

#define QB TANDEM_QUANT_BLOCK /* inputs per block: 32 */
#define QP (QB / 2)           /* pairs per block: 16 */
#define QG 16                 /* outputs per group */
#define PARALLEL_MIN_ELEMENTS 65536 /* a prefill's rows split over the team; a decode step's stay here */

/* Row `id` of w into out + row * k, in dtype (1 = bf16, 0 = float32). */
static void quant_row(const TandemWeight *w, int64_t id, void *out, int64_t row, int dtype) {
    const int64_t k = w->k, nb = k / QB, g = id / QG, c = id % QG;
    const int four_bit = w->format == TANDEM_WEIGHT_Q4;
    const int64_t pair_bytes = four_bit ? QG : 2 * QG;
    const uint8_t *codes = w->data;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t at = (g * nb + b) * QG + c;
        const float d = fp16_to_f32(w->scales[at]);
        const float m = w->mins != NULL ? fp16_to_f32(w->mins[at]) : 0.0f;
        const uint8_t *pairs = codes + (g * nb + b) * QP * pair_bytes;
        for (int64_t p = 0; p < QP; p++)
            for (int t = 0; t < 2; t++) {
                const int lane = 2 * (int)c + t;
                float v;
                if (four_bit) {
                    const uint8_t byte = pairs[p * pair_bytes + (lane < QG ? lane : lane - QG)];
                    const float q = (float)(lane < QG ? byte & 15 : byte >> 4);
                    v = w->mins != NULL ? q * d + m : (q - 8.0f) * d;
                } else {
                    v = (float)(int8_t)pairs[p * pair_bytes + lane] * d;
                }
                const int64_t i = row * k + b * QB + 2 * p + t;
                if (dtype == 1) ((uint16_t *)out)[i] = f32_to_bf16(v);
                else ((float *)out)[i] = v;
            }
    }
}

/* out [num_ids, k] = rows ids [num_ids] of the quantized table w [n, k] (weight.h: Q4 or Q8), in
 * dtype 1 (bf16) or 0 (float32). Returns 0, or -1 for another format, a bad size or dtype, or an id
 * outside [0, n) (checked first: nothing written then). */
int tandem_quantized_rows(const TandemWeight *w, const int64_t *ids, int64_t num_ids, void *out, int dtype) {
    if ((w->format != TANDEM_WEIGHT_Q4 && w->format != TANDEM_WEIGHT_Q8) || w->scales == NULL || w->n < 1 ||
        w->k < QB || w->k % QB != 0 || num_ids < 0 || (dtype != 0 && dtype != 1))
        return -1;
    for (int64_t r = 0; r < num_ids; r++)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
#pragma omp parallel for schedule(static) if (num_ids * w->k >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < num_ids; r++) quant_row(w, ids[r], out, r, dtype);
    return 0;
}

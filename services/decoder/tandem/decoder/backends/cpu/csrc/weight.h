/* What a linear layer's weight is, for the kernels that take any kind (tandem_linear in linear_quant.c,
 * the fused layers and the decode stack in layer.c): one descriptor, built and kept alive by the Python
 * side (backends/cpu/kernels.py, KernelWeight), passed by pointer.
 *
 * Formats:
 *   TANDEM_WEIGHT_BF16         data: bf16 [n, k] as stored, or tandem_pack_bf16's copy on builds whose
 *                              tandem_weight_layout() is not 0 (what tandem_linear_bf16 takes).
 *   TANDEM_WEIGHT_Q4           w[f][i] = d * q + m, q in 0..15, d and m fp16 per 32 inputs (GGUF's Q4_0
 *                              and Q4_1; Q4_0's d * (q - 8) is m = -8 d).
 *   TANDEM_WEIGHT_Q8           w[f][i] = d * q, q in -128..127, d fp16 per 32 inputs (GGUF's Q8_0).
 *   TANDEM_WEIGHT_F32          data: float32 [n, k] as stored (what tandem_linear_f32 takes).
 * Quantized weights are in linear_quant.c's packed layout (written by models/quantized.py).
 */
#ifndef TANDEM_NATIVE_WEIGHT_H
#define TANDEM_NATIVE_WEIGHT_H

#include <stdint.h>

enum { TANDEM_WEIGHT_BF16 = 1, TANDEM_WEIGHT_Q4 = 2, TANDEM_WEIGHT_Q8 = 3, TANDEM_WEIGHT_F32 = 4 };

#define TANDEM_QUANT_BLOCK 32 /* inputs per scale (and offset) */

typedef struct {
    int64_t format;         /* TANDEM_WEIGHT_* */
    int64_t n, k;           /* output and input features */
    const void *data;       /* the values or codes */
    const uint16_t *scales; /* quantized: fp16 d, tandem_pack_quant's layout; else NULL */
    const uint16_t *mins;   /* Q4: fp16 m, the same layout; else NULL */
    int64_t dense_rows;     /* quantized, bf16 inputs: from this many rows on, each weight as its bf16
                               rounding (linear_quant.c); 0: never */
    int64_t tile_rows;      /* bf16, packed: from this many rows on, AMX tiles (linear_tiles.c) instead of
                               VDPBF16PS; 0: never. 1 or more than any step without prompt rows, so a
                               decode or verify row's sums keep one order (kernel_choice.py sets it).
                               Quantized with activations 8: from this many rows on, AMX-INT8 tiles
                               (linear_int8.c), the same bits as VPDPBUSD, so any row count will do */
    int64_t activations;    /* quantized: 8 = each row's inputs rounded to int8 per block of 32, every call
                               (linear_int8.c, --quantized-activations int8; dense_rows unused); 0 = in the
                               call's dtype */
} TandemWeight;

/* out [m, n] = x [m, k] @ w^T (+ bias [n]); x, bias and out bf16 (dtype 1) or, for quantized and float32
 * weights, float32 (dtype 0). 0, or -1 for a bad size, a format this build cannot run, or no scratch memory. */
int tandem_linear(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                  int64_t k, int dtype);

/* tandem_linear of a float32 weight (linear_f32.c): x, w, bias and out float32. 0, or -1 for a bad size. */
int tandem_linear_f32(const float *x, const float *w, const float *bias, float *out, int64_t m, int64_t n,
                      int64_t k);

/* tandem_linear of a quantized weight with int8 activations (linear_int8.c); the same contract. */
int tandem_linear_int8(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                       int64_t k, int dtype);

#endif

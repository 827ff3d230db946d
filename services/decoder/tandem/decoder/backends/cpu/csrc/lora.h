/* One projection's LoRA slots as the kernels read them (lora.c; layer.c's fused layers and decode
 * stack): a descriptor built once per projection by the Python side (backends/cpu/lora.py, which keeps
 * the tensors alive; they never move: a slot is rewritten in place), passed by pointer.
 *
 * Layout (models/lora.py): a [num_slots, num_parts * max_rank, k] (part p's A rows from p * max_rank),
 * bt [num_slots, max_rank, n] (part p's columns hold its B^T), both float32 (dtype 0) or bf16 (1);
 * ranks [num_slots, num_parts] (0: the slot leaves the part alone); scales [num_slots]; part_ends
 * [num_parts], each part's last column + 1 (the last is n).
 */
#ifndef TANDEM_NATIVE_LORA_H
#define TANDEM_NATIVE_LORA_H

#include <stdint.h>

typedef struct {
    const void *a;
    const void *bt;
    const int64_t *ranks;
    const float *scales;
    const int64_t *part_ends;
    int64_t num_slots, num_parts, max_rank;
    int64_t n, k; /* output and input features */
    int64_t dtype;
} TandemLoraWeight;

/* The projections of one layer in a `const TandemLoraWeight *const *` array, in this order. */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORAS_PER_LAYER };

/* 0 when the descriptor is well formed and every slots[t] (t < m) is -1 or one of its slots; -1 bad
 * sizes; -2 a slot or a rank out of range. What tandem_lora_delta checks first. */
int tandem_lora_check(const TandemLoraWeight *w, const int64_t *slots, int64_t m);

/* y [m, n] += each row's delta (lora.c's NOTE), x [m, k], both in w's dtype; slots [m], -1 = none.
 * 0; -1 bad sizes; -2 a slot or rank out of range (nothing written); -3 no scratch memory. */
int tandem_lora_delta(const TandemLoraWeight *w, const void *x, void *y, const int64_t *slots, int64_t m);

#endif

/* The kernels' limits, in one place: each kernel checks its arguments against these, and the library
 * exports them (limits.c) so that the Python side reads them from the build it loaded instead of
 * copying them (backends/cpu/limits.py, whose fits() every caller asks).
 *
 * The first four size scratch on the stack; the tiled attention's head_dim step is the width its
 * value tiles are written for; the prefill context is a measured crossover, not a size. */
#ifndef TANDEM_NATIVE_LIMITS_H
#define TANDEM_NATIVE_LIMITS_H

#define TANDEM_MAX_HEAD_DIM 256   /* dimensions of one attention head (attention and RoPE scratch) */
#define TANDEM_MAX_GROUP 16       /* query heads per KV head */
#define TANDEM_MAX_BLOCK_SIZE 64  /* positions per KV-cache block (attention.c's scores of a block) */
#define TANDEM_MAX_ROW 16384      /* longest row an RMSNorm takes (hidden size) */
/* attention_tiles.c takes bf16 caches whose head_dim is a multiple of this (4 vectors of 16 a tile). */
#define TANDEM_TILED_HEAD_DIM 64
/* Longest context for which a step with prefill attends through attention.c's row kernel, one query
 * row per token: past it torch's SDPA, which tiles the causal triangle, was faster (measured on
 * SmolLM2's shapes, docs/PERFORMANCE.md). The tiled kernel has no such limit. */
#define TANDEM_PREFILL_MAX_CONTEXT 640

#endif

/* CPU kernels the executor calls through ctypes (backends/cpu/kernels.py loads the build for this CPU):
 * decode attention here, and RMSNorm and the q/k norm + RoPE + KV write further down.
 *
 * Why C: a decode step's attention in torch is a gather of every sequence's KV blocks into a
 * contiguous copy, two small batched matmuls, a mask and a softmax, per layer: at batch 32 the
 * gather alone is a fifth of a step (docs/PERFORMANCE-HISTORY.md), because it writes the whole
 * context once more before reading it again. Here each (sequence, KV head) reads its keys and values straight
 * from the paged cache, once, with an online softmax, so the context is read and never copied.
 *
 * Threads: `#pragma omp` here binds to the libgomp torch already loaded (same soname), so this runs
 * on the calling thread's OpenMP team, the one torch's own ops use; never a second team.
 *
 * Numerics: dot products, softmax and the weighted sum of values all in fp32 (the torch path rounds
 * scores and probabilities to the model dtype between its matmuls), one rounding at the output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "limits.h"
#include "runs.h"

/* The digest build.py passes in (sources, headers, flags): kernels.py loads a library only when it
 * matches the sources beside it. */
#ifndef TANDEM_BUILD_ID
#define TANDEM_BUILD_ID "unversioned"
#endif
const char *tandem_build_id(void) { return TANDEM_BUILD_ID; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

/* What each kernel checks itself: its scalar arguments (counts, sizes, limits.h's limits of the
 * on-stack scratch) and every index it follows (KV slots, block ids, sequence lengths). What it
 * cannot check is how long a buffer is: kernels.py's wrappers check every tensor's device, dtype,
 * shape and contiguity before the call. */

/* Below this many elements an elementwise kernel stays on the calling thread: waking the team costs more. */
#define PARALLEL_MIN_ELEMENTS 16384

/* Rows [n, head_dim] of one KV head inside a paged block -> contiguous fp32 [n, head_dim]. */
static inline __attribute__((always_inline)) void load_rows(float *restrict dst, const char *restrict src,
                                                            int64_t n, int64_t head_dim, int64_t row_stride,
                                                            int dtype) {
    for (int64_t t = 0; t < n; t++) {
        float *restrict d = dst + t * head_dim;
        if (dtype == DTYPE_BFLOAT16) {
            const uint16_t *restrict s = (const uint16_t *)src + t * row_stride;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) d[i] = bf16_to_f32(s[i]);
        } else {
            const float *restrict s = (const float *)src + t * row_stride;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) d[i] = s[i];
        }
    }
}

#if HAVE_AVX2
/* scores[g][t0 + j] = q[g] . rows[t0 + j] for GS (1-3) query heads and 4 keys: a 3 x 4 tile of 8-lane
 * accumulators in registers, each key vector loaded once for its GS FMAs, then the four lanes' sums of
 * each head reduced together by horizontal adds. (Dot product by dot product, each score was one
 * dependent chain of FMAs and a horizontal sum of its own.) Every score's sum runs in one order, so a
 * row's result does not depend on the rows beside it in the step (speculative decoding needs that). */
static inline __attribute__((always_inline)) void score_tile(float scores[][TANDEM_MAX_BLOCK_SIZE],
                                                             const float *restrict q, const float *restrict rows,
                                                             int64_t g0, int64_t t0, const int64_t head_dim,
                                                             const int GS) {
    __m256 acc[3][4];
    for (int g = 0; g < GS; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
    const float *k = rows + t0 * head_dim;
    for (int64_t i = 0; i < head_dim; i += 8) {
        __m256 kv[4];
        for (int j = 0; j < 4; j++) kv[j] = _mm256_loadu_ps(k + j * head_dim + i);
        for (int g = 0; g < GS; g++) {
            const __m256 qv = _mm256_loadu_ps(q + (g0 + g) * head_dim + i);
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qv, kv[j], acc[g][j]);
        }
    }
    for (int g = 0; g < GS; g++) {
        /* [a0 a1 a2 a3] -> one vector of their four sums: pairs, then pairs of pairs, then the halves. */
        const __m256 h01 = _mm256_hadd_ps(acc[g][0], acc[g][1]), h23 = _mm256_hadd_ps(acc[g][2], acc[g][3]);
        const __m256 h = _mm256_hadd_ps(h01, h23);
        _mm_storeu_ps(&scores[g0 + g][t0], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}
#endif

/* scores[g][t] = q[g] . rows[t] for every query head of the group and the block's n keys. rows holds
 * at least n rounded up to 4 (the rows past n are zeros, their scores unused). */
static inline __attribute__((always_inline)) void block_scores(float scores[][TANDEM_MAX_BLOCK_SIZE],
                                                               const float *restrict q, const float *restrict rows,
                                                               int64_t n, int64_t group, const int64_t head_dim) {
#if HAVE_AVX2
    if (head_dim % 8 == 0) {
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            int64_t g0 = 0;
            for (; g0 + 3 <= group; g0 += 3) score_tile(scores, q, rows, g0, t0, head_dim, 3);
            if (group - g0 == 2) score_tile(scores, q, rows, g0, t0, head_dim, 2);
            else if (group - g0 == 1) score_tile(scores, q, rows, g0, t0, head_dim, 1);
        }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < n; t++) {
            const float *restrict qg = q + g * head_dim, *restrict k = rows + t * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < head_dim; i++) dot += qg[i] * k[i];
            scores[g][t] = dot;
        }
}

/* o[i] += sum_t p[t] * rows[t][i] over the block's n values. With AVX2, 64 dimensions at a time in 8
 * registers for the whole block (the plain loop kept its accumulators on the stack: a store and a
 * load around every FMA); either way each o[i] adds its terms in t order. */
static inline __attribute__((always_inline)) void block_values(float *restrict o, const float *restrict p,
                                                               const float *restrict rows, int64_t n,
                                                               const int64_t head_dim) {
#if HAVE_AVX2
    if (head_dim % 64 == 0) {
        for (int64_t i0 = 0; i0 < head_dim; i0 += 64) {
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(o + i0 + 8 * c);
            for (int64_t t = 0; t < n; t++) {
                const __m256 pt = _mm256_set1_ps(p[t]);
                const float *restrict v = rows + t * head_dim + i0;
                for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * c), acc[c]);
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + i0 + 8 * c, acc[c]);
        }
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const float pt = p[t];
        const float *restrict v = rows + t * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; i++) o[i] += pt * v[i];
    }
}

/* Softmax of one query head's scores for a block of n keys, online: the running maximum and sum
 * updated, the output accumulated so far rescaled, scores[0, n) replaced by their exps. */
static inline __attribute__((always_inline)) void softmax_block(float *restrict scores, int64_t n,
                                                                float *restrict running_max,
                                                                float *restrict running_sum, float *restrict o,
                                                                const int64_t head_dim) {
    float block_max = -INFINITY;
    for (int64_t t = 0; t < n; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
    /* Online softmax: rescale what was accumulated when the maximum grows. */
    const float new_max = block_max > *running_max ? block_max : *running_max;
    const float correction = *running_max == -INFINITY ? 0.0f : exp_nonpositive(*running_max - new_max);
    *running_max = new_max;
#if HAVE_AVX2
    /* 8 exps at a time, over n rounded up to 8 (the scores array has room, zeros past n: see attend);
     * the lanes past n are neither summed nor used. A NaN score stays NaN, as in the scalar exp. */
    const __m256 max8 = _mm256_set1_ps(new_max);
    for (int64_t t = 0; t < n; t += 8)
        _mm256_storeu_ps(scores + t, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), max8)));
#else
    for (int64_t t = 0; t < n; t++) scores[t] = exp_nonpositive(scores[t] - new_max);
#endif
    float sum = 0.0f; /* in t order, one row's sum the same whatever else the step holds */
    for (int64_t t = 0; t < n; t++) sum += scores[t];
    *running_sum = *running_sum * correction + sum;
#pragma omp simd
    for (int64_t i = 0; i < head_dim; i++) o[i] *= correction;
}

/* Query rows of one sequence attended together: at most this many (a verification step's k + 1), and
 * at most MAX_QUERY_HEADS query heads of them for one KV head (the scratch on the stack). */
#define MAX_ROWS 8
#define MAX_QUERY_HEADS 32

/* Query rows r = 0..R-1 of one sequence, row r at context length first_len + r (a decode step's row,
 * or a verification step's consecutive positions), their query heads that share KV head `kv_head`.
 * q: [R, group, head_dim] fp32, already scaled; out: [R, group, head_dim] fp32.
 *
 * The rows share the sequence's keys and values: each block is read and widened once for all of
 * them (row by row, a 4-row verification step re-read every key four times). Each row still sees the blocks
 * it would see alone, with its own n in its last one, and every sum runs in the same order as for a
 * row alone, so a row's bits do not depend on the rows beside it. Always inlined into attend_one's
 * cases, so common head sizes get loops of known length (kept in vector registers). */
static inline __attribute__((always_inline)) void attend(
    float *restrict out, const float *restrict q, int64_t num_rows, const char *restrict kv_cache,
    const int32_t *restrict block_table, int64_t first_len, int64_t kv_head, int64_t group, int64_t num_blocks,
    int64_t block_size, int64_t num_kv_heads, const int64_t head_dim, int dtype) {
    const int64_t elem = dtype == DTYPE_BFLOAT16 ? 2 : 4;
    const int64_t row_stride = num_kv_heads * head_dim;           /* elements between positions */
    const int64_t block_elems = block_size * row_stride;          /* elements per block per K or V */
    const int64_t values_offset = num_blocks * block_elems;       /* V follows all of K */
    const int64_t heads = num_rows * group;                       /* row r's head g is r * group + g */
    const int64_t seq_len = first_len + num_rows - 1;             /* the last row's context */
    float rows[TANDEM_MAX_BLOCK_SIZE * TANDEM_MAX_HEAD_DIM];
    float scores[MAX_QUERY_HEADS][TANDEM_MAX_BLOCK_SIZE];
    float running_max[MAX_QUERY_HEADS], running_sum[MAX_QUERY_HEADS];
    for (int64_t h = 0; h < heads; h++) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
        for (int64_t i = 0; i < head_dim; i++) out[h * head_dim + i] = 0.0f;
    }
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t block = block_table[start / block_size];
        const char *keys = kv_cache + (block * block_elems + kv_head * head_dim) * elem;
        /* The next block's keys and values are fetched while this one computes: a block's rows for one
         * head are 16 strided pieces that the hardware prefetcher did not follow, and the loads of
         * them were half of this kernel's time. Into L2 (prefetcht1; attention_tiles.c says why):
         * 32 sequences at 160 positions 17.5 -> 11.7 ms over 30 layers (AVX2 build, Zen 4). */
        if (start + block_size < seq_len) {
            const int64_t next = block_table[start / block_size + 1];
            const int64_t left = seq_len - start - block_size, next_n = left < block_size ? left : block_size;
            const char *next_keys = kv_cache + (next * block_elems + kv_head * head_dim) * elem;
            const char *next_values = next_keys + values_offset * elem;
            for (int64_t t = 0; t < next_n; t++)
                for (int64_t b = 0; b < head_dim * elem; b += 64) {
                    __builtin_prefetch(next_keys + t * row_stride * elem + b, 0, 2);
                    __builtin_prefetch(next_values + t * row_stride * elem + b, 0, 2);
                }
        }
        load_rows(rows, keys, n, head_dim, row_stride, dtype);
        for (int64_t i = n * head_dim; i < ((n + 3) & ~(int64_t)3) * head_dim; i++) rows[i] = 0.0f;
        block_scores(scores, q, rows, n, heads, head_dim);
        for (int64_t h = 0; h < heads; h++) /* up to the 8-lane exps' reach: written, never used */
            for (int64_t t = (n + 3) & ~(int64_t)3; t < ((n + 7) & ~(int64_t)7); t++) scores[h][t] = 0.0f;
        for (int64_t r = 0; r < num_rows; r++) {
            const int64_t left = first_len + r - start, n_r = left < block_size ? left : block_size;
            for (int64_t g = r * group; g < (r + 1) * group && n_r > 0; g++)
                softmax_block(scores[g], n_r, &running_max[g], &running_sum[g], out + g * head_dim, head_dim);
        }
        const char *values = kv_cache + (values_offset + block * block_elems + kv_head * head_dim) * elem;
        load_rows(rows, values, n, head_dim, row_stride, dtype);
        for (int64_t r = 0; r < num_rows; r++) {
            const int64_t left = first_len + r - start, n_r = left < block_size ? left : block_size;
            for (int64_t g = r * group; g < (r + 1) * group && n_r > 0; g++)
                block_values(out + g * head_dim, scores[g], rows, n_r, head_dim);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;
        float *restrict o = out + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; i++) o[i] *= inv;
    }
}

static void attend_one(float *out, const float *q, int64_t num_rows, const char *kv_cache,
                       const int32_t *block_table, int64_t first_len, int64_t kv_head, int64_t group,
                       int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int dtype) {
#define ATTEND(HEAD_DIM, DTYPE)                                                                               \
    attend(out, q, num_rows, kv_cache, block_table, first_len, kv_head, group, num_blocks, block_size,        \
           num_kv_heads, HEAD_DIM, DTYPE)
    if (dtype == DTYPE_BFLOAT16 && head_dim == 64) ATTEND(64, DTYPE_BFLOAT16);
    else if (dtype == DTYPE_BFLOAT16 && head_dim == 128) ATTEND(128, DTYPE_BFLOAT16);
    else ATTEND(head_dim, dtype);
#undef ATTEND
}

int tandem_attention_tiles(const uint16_t *q, const uint16_t *kv_cache, const int32_t *block_tables,
                           const int32_t *seq_lens, uint16_t *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t max_blocks, float scale);

/* Decode attention over a paged KV cache: one query per row, each row a sequence's position.
 *
 * q:            [num_seqs, num_heads, head_dim] (query head h uses KV head h / (num_heads / num_kv_heads))
 * kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim], 0 = keys, 1 = values
 * block_tables: int32 [num_seqs, max_blocks]
 * seq_lens:     int32 [num_seqs], context length of each row including its own token
 * out:          [num_seqs, num_heads * head_dim], same dtype as q and the cache
 * All contiguous. Returns 0; -1 when a length or block id is out of range, -2 without scratch memory
 * (nothing is written then).
 */
int tandem_decode_attention(const void *q, const void *kv_cache, const int32_t *block_tables,
                            const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks, float scale, int dtype) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads < num_kv_heads || head_dim < 1 || block_size < 1 ||
        num_blocks < 0 || max_blocks < 0)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > TANDEM_MAX_HEAD_DIM || group > TANDEM_MAX_GROUP || block_size > TANDEM_MAX_BLOCK_SIZE ||
        group * num_kv_heads != num_heads || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16))
        return -1;
    /* The tables come from the engine's block manager, but a wrong id here would read outside the
     * cache: check every entry that will be used before any thread starts. */
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s];
        if (len < 0 || len > max_blocks * block_size) return -1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return -1;
        }
    }
    if (num_seqs == 0) return 0;
    if (dtype == DTYPE_BFLOAT16) { /* AVX512-BF16 builds: the tiled kernel (attention_tiles.c) */
        const int tiled = tandem_attention_tiles(q, kv_cache, block_tables, seq_lens, out, num_seqs, num_heads,
                                                 num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale);
        if (tiled != 1) return tiled;
    }
    /* At most MAX_ROWS rows a run, and MAX_QUERY_HEADS query heads of them (the scratch on the stack). */
    const int64_t max_rows = MAX_QUERY_HEADS / group < MAX_ROWS ? MAX_QUERY_HEADS / group : MAX_ROWS;
    const int32_t *runs = tandem_find_runs(block_tables, seq_lens, num_seqs, max_blocks, block_size, max_rows);
    if (runs == NULL) return -2;
    const char *cache = (const char *)kv_cache;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        /* Rows fastest: the items of rows inside a run have nothing to do. */
        const int64_t s = item % num_seqs, kv_head = item / num_seqs, num_rows = runs[s];
        if (num_rows == 0) continue;
        float q_scaled[MAX_QUERY_HEADS * TANDEM_MAX_HEAD_DIM], result[MAX_QUERY_HEADS * TANDEM_MAX_HEAD_DIM];
        const int64_t count = group * head_dim;
        for (int64_t r = 0; r < num_rows; r++) {
            const int64_t first = ((s + r) * num_heads + kv_head * group) * head_dim; /* the row's group */
            float *dst = q_scaled + r * count;
            if (dtype == DTYPE_BFLOAT16) {
                const uint16_t *src = (const uint16_t *)q + first;
                for (int64_t i = 0; i < count; i++) dst[i] = bf16_to_f32(src[i]) * scale;
            } else {
                const float *src = (const float *)q + first;
                for (int64_t i = 0; i < count; i++) dst[i] = src[i] * scale;
            }
        }
        attend_one(result, q_scaled, num_rows, cache, block_tables + s * max_blocks, seq_lens[s], kv_head, group,
                   num_blocks, block_size, num_kv_heads, head_dim, dtype);
        for (int64_t r = 0; r < num_rows; r++) {
            const int64_t first = ((s + r) * num_heads + kv_head * group) * head_dim;
            if (dtype == DTYPE_BFLOAT16) {
                uint16_t *dst = (uint16_t *)out + first;
                for (int64_t i = 0; i < count; i++) dst[i] = f32_to_bf16(result[r * count + i]);
            } else {
                memcpy((float *)out + first, result + r * count, (size_t)count * sizeof(float));
            }
        }
    }
    return 0;
}

/* -- Elementwise kernels of the decoder layer ---------------------------------------------------------
 * Each replaces a chain of small torch ops (about nine for an RMSNorm) whose fixed cost dominates at
 * decode batch sizes. They round to the model dtype wherever the torch path does, in the same order,
 * so results equal the torch path's except where a fp32 sum is added up in another order.
 */

/* Rounds a fp32 value to the model dtype and back (identity for fp32). */
static inline __attribute__((always_inline)) float round_to(float x, int dtype) {
    return dtype == DTYPE_BFLOAT16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

static inline __attribute__((always_inline)) float load_at(const void *base, int64_t i, int dtype) {
    return dtype == DTYPE_BFLOAT16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store_at(void *base, int64_t i, float x, int dtype) {
    if (dtype == DTYPE_BFLOAT16) ((uint16_t *)base)[i] = f32_to_bf16(x);
    else ((float *)base)[i] = x;
}

/* The Hugging Face RMSNorm on one row of src (from element src_at): fp32 statistics, x * rsqrt(mean(x^2)
 * + eps) rounded to the dtype, then times the weight, rounded again. Writes fp32 values already rounded. */
static inline __attribute__((always_inline)) void rms_norm_row(float *result, const void *src, int64_t src_at, const void *weight, int64_t size,
                                float eps, int dtype) {
    float squares = 0.0f;
    for (int64_t i = 0; i < size; i++) result[i] = load_at(src, src_at + i, dtype);
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < size; i++) squares += result[i] * result[i];
    const float inv_rms = 1.0f / sqrtf(squares / (float)size + eps);
    for (int64_t i = 0; i < size; i++)
        result[i] = round_to(load_at(weight, i, dtype) * round_to(result[i] * inv_rms, dtype), dtype);
}

/* RMSNorm of x [rows, size] into out [rows, size], weight [size]; all contiguous, one dtype. */
static inline __attribute__((always_inline)) void rms_norm_to(void *out, int64_t r, const void *x,
                                                              const void *weight, int64_t size, float eps,
                                                              const int dtype) {
    float row[TANDEM_MAX_ROW];
    rms_norm_row(row, x, r * size, weight, size, eps, dtype);
#pragma omp simd
    for (int64_t i = 0; i < size; i++) store_at(out, r * size + i, row[i], dtype);
}

int tandem_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t size, float eps,
                    int dtype) {
    if (rows < 0 || size < 1 || size > TANDEM_MAX_ROW || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16)) return -1;
#pragma omp parallel for schedule(static) if (rows * size >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == DTYPE_BFLOAT16) rms_norm_to(out, r, x, weight, size, eps, DTYPE_BFLOAT16);
        else rms_norm_to(out, r, x, weight, size, eps, DTYPE_FLOAT32);
    }
    return 0;
}

/* x * cos + rotate_half(x) * sin for one head, each product and the sum rounded as in torch. */
static inline __attribute__((always_inline)) void rotate_head(float *head, const void *cos, const void *sin, int64_t at, int64_t head_dim,
                               int dtype) {
    const int64_t half = head_dim / 2;
    float rotated[TANDEM_MAX_HEAD_DIM];
    for (int64_t i = 0; i < half; i++) {
        rotated[i] = -head[half + i];
        rotated[half + i] = head[i];
    }
    for (int64_t i = 0; i < head_dim; i++) {
        const float a = round_to(head[i] * load_at(cos, at + i, dtype), dtype);
        const float b = round_to(rotated[i] * load_at(sin, at + i, dtype), dtype);
        head[i] = round_to(a + b, dtype);
    }
}

/* One query or key head from qkv (from element `at`): RMSNorm when `norm` is not NULL, then RoPE. */
static inline __attribute__((always_inline)) void norm_rope_head(float *head, const void *qkv, int64_t at,
                                                                 const void *norm, const void *cos, const void *sin,
                                                                 int64_t angle_at, int64_t head_dim, float eps,
                                                                 const int dtype) {
    if (norm != NULL) {
        rms_norm_row(head, qkv, at, norm, head_dim, eps, dtype);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < head_dim; i++) head[i] = load_at(qkv, at + i, dtype);
    }
    rotate_head(head, cos, sin, angle_at, head_dim, dtype);
}

/* After the QKV projection: per-head RMSNorm of queries and keys (Qwen3; skipped when the weights
 * are NULL), RoPE on both, keys and values written to their KV-cache slots, queries (and, when
 * k_out is not NULL, keys) returned.
 *
 * qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; cos, sin: [num_tokens, head_dim];
 * q_norm, k_norm: [head_dim] or NULL; kv_cache: [2, num_slots, num_kv_heads, head_dim];
 * slots: int64 [num_tokens]; q_out: [num_tokens, num_heads, head_dim]; k_out: [num_tokens,
 * num_kv_heads, head_dim] or NULL. Returns -1 (having written nothing) when a slot is out of range.
 */
static inline __attribute__((always_inline)) void qkv_rope_cache_token(
    int64_t t, const void *qkv, const void *cos, const void *sin, const void *q_norm, const void *k_norm,
    const int64_t *slots, void *kv_cache, void *q_out, void *k_out, int64_t num_heads, int64_t num_kv_heads,
    const int64_t head_dim, int64_t num_slots, float eps, const int dtype) {
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t kv_width = num_kv_heads * head_dim;
    char *values = (char *)kv_cache + num_slots * kv_width * (dtype == DTYPE_BFLOAT16 ? 2 : 4);
    const int64_t slot = slots[t];
    float head[TANDEM_MAX_HEAD_DIM];
    for (int64_t h = 0; h < num_heads; h++) {
        norm_rope_head(head, qkv, t * width + h * head_dim, q_norm, cos, sin, t * head_dim, head_dim, eps, dtype);
#pragma omp simd
        for (int64_t i = 0; i < head_dim; i++) store_at(q_out, (t * num_heads + h) * head_dim + i, head[i], dtype);
    }
    for (int64_t k = 0; k < num_kv_heads; k++) {
        norm_rope_head(head, qkv, t * width + (num_heads + k) * head_dim, k_norm, cos, sin, t * head_dim,
                       head_dim, eps, dtype);
#pragma omp simd
        for (int64_t i = 0; i < head_dim; i++) store_at(kv_cache, slot * kv_width + k * head_dim + i, head[i], dtype);
        if (k_out != NULL) {
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) store_at(k_out, (t * num_kv_heads + k) * head_dim + i, head[i], dtype);
        }
    }
    for (int64_t k = 0; k < num_kv_heads; k++) {
        const int64_t from = t * width + (num_heads + num_kv_heads + k) * head_dim;
        for (int64_t i = 0; i < head_dim; i++)
            store_at(values, slot * kv_width + k * head_dim + i, load_at(qkv, from + i, dtype), dtype);
    }
}

int tandem_qkv_rope_cache(const void *qkv, const void *cos, const void *sin, const void *q_norm,
                          const void *k_norm, const int64_t *slots, void *kv_cache, void *q_out, void *k_out,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, float eps, int dtype) {
    if (num_tokens < 0 || num_heads < 0 || num_kv_heads < 0 || head_dim < 2 || head_dim > TANDEM_MAX_HEAD_DIM ||
        head_dim % 2 || num_slots < 0)
        return -1;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16) return -1;
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
#define TOKEN(HEAD_DIM, DTYPE)                                                                                \
    qkv_rope_cache_token(t, qkv, cos, sin, q_norm, k_norm, slots, kv_cache, q_out, k_out, num_heads,         \
                         num_kv_heads, HEAD_DIM, num_slots, eps, DTYPE)
#pragma omp parallel for schedule(static) if (num_tokens * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        if (dtype == DTYPE_BFLOAT16 && head_dim == 64) TOKEN(64, DTYPE_BFLOAT16);
        else if (dtype == DTYPE_BFLOAT16 && head_dim == 128) TOKEN(128, DTYPE_BFLOAT16);
        else if (dtype == DTYPE_BFLOAT16) TOKEN(head_dim, DTYPE_BFLOAT16);
        else TOKEN(head_dim, DTYPE_FLOAT32);
    }
#undef TOKEN
    return 0;
}

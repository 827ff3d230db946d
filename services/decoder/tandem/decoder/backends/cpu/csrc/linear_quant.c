/* Linear layers over quantized weights (GGUF's Q4_0, Q4_1 and Q8_0 as stored, and what a re-quantized
 * type becomes), and tandem_linear, the one entry that takes any weight (weight.h).
 *
 * Why: a decode step of one sequence reads every weight once and does little else, so its time is the
 * weights' bytes over memory bandwidth. bf16 is 2 bytes a weight; Q4_1 is 0.625 (4 bits, and an fp16
 * scale and offset per 32 inputs), Q8_0 1.0625. SmolLM2 at one sequence: 203 tok/s against 142 with
 * bf16 weights (1.43x, Zen 5, bench/harness.py's quantized workload); at 8 sequences 1.16x, at 32
 * 0.85x (the per-block scaling costs more than the bytes save once the step computes more than it
 * reads).
 *
 * Arithmetic: for output f and a block b of 32 inputs, sum_i x_i w_i is, exactly in real numbers,
 *   Q4_1  d (sum_i x_i q_i) + m (sum_i x_i)      Q4_0  d (sum_i x_i (q_i - 8))      Q8_0  d (sum_i x_i q_i)
 * On AVX512-BF16 builds the inner sum is VDPBF16PS over x (bf16) and the 4-bit codes widened in
 * registers to 128 + q, which is exact in bf16 and made by OR-ing q under 128's exponent (one shuffle
 * a pair, no table), each product exact in fp32; the block's correction takes the 128 back:
 *   Q4_1  d B + (m - 128 d) S_b        Q4_0  d B - 136 d S_b        (B = sum_i x_i (128 + q_i))
 * with the block sum S_b = sum_i x_i computed once per row and shared by every output; 8-bit codes
 * are widened as they are. The weights are never rounded: this is closer to the file's values than
 * its bf16 import, which rounds each d q + m to bf16 (so the two give close, not equal, logits).
 * Other builds (and float32 inputs) run the sums above in portable C that the compiler vectorizes
 * over 16 outputs.
 *
 * The widening was a 16-entry table lookup (VPERMW) after three shuffles; one shuffle and a shift
 * instead made one sequence's 4-bit linears 9-13 % faster (Zen 5, 30 layers of SmolLM2's shapes,
 * A/B in one process), the same at 8 and 32 rows. Software prefetch of the codes 2, 4 or 8 blocks
 * ahead into L1 measured within the machine's noise (+-5 %); into L2 it pays (tile_bf16).
 *
 * 5-8 rows run one tile of all the rows x 3 groups, widening as it reads (tile_wide), and 9-16 rows
 * that tile in passes of 8 rows (part_bf16 says why). Past 16 rows each set of six groups is widened
 * once into a thread's scratch (64-byte aligned), and tiles of 4 rows x 6 groups run over it: their 24
 * block sums in registers, the running sums in L1, updated once a block (a 4 x 3 tile with both in
 * registers was 10 % slower at 128 rows, and the same at 32 on Zen 4); the next set's codes are
 * prefetched while the tiles run, so memory and arithmetic overlap. At 32 rows (Zen 4, sampled) the
 * dot products take 64 % of this path's time, as long as the bf16 kernel's whole step; the blocks'
 * scaling 20 % (precomputing d and the offset per set, or running groups 3-5 half a block behind
 * 0-2 to spread it, gained nothing), the widening 8 %.
 *
 * Prefill: at 128 rows the exact sums above cost 1.28x the bf16 kernel (two multiply-adds a block and
 * the widening). A weight whose descriptor sets dense_rows (the executor: one more than any step
 * without prompt rows can hold) runs calls of that many rows on as bf16: each set of six groups
 * dequantized to bf16(d q + m), GGUF's fp32 value rounded once, which is exactly what the
 * checkpoint's bf16 import holds, into the packed bf16 kernel's layout, and that kernel's tiles
 * over it (1.06x its time at 128 rows, 1.04x at 512). Decode and verify steps never reach dense_rows,
 * so their rows keep the exact sums in one order; a prefill's rows are the dense model's, bit for
 * bit. For one sequence that path took 7.2 against the bf16 kernel's 6.3 ms a step (the dequantizing
 * does not pay for itself at one row), which is why decode keeps the exact sums.
 *
 * Storage (models/quantized.py writes it; nb = k / 32 blocks, outputs in groups of 16, padded with
 * zeros): per group, per block, per pair of inputs p, the group's 32 codes in lane order L = 2 c + t
 * (output c, input 2 p + t):
 *   4-bit  16 bytes: byte j holds lane j in its low nibble and lane j + 16 in its high one
 *   8-bit  32 int8, lane by lane
 *   scales (and 4-bit offsets)  [group][block][output] fp16
 * Widened, a pair's 32 lanes are the 16 dwords of (q[c][2p], q[c][2p + 1]) that VDPBF16PS multiplies.
 *
 * NOTE: below dense_rows, every output's sum runs in one order whatever the number of rows or the
 * tile: for each block in order, its 16 pairs in order into a block sum that starts at 0, then
 * acc = fma(blk, d, acc), then (4-bit) acc = fma(offset, S_b, acc); then the bias, then one rounding.
 * Speculative decoding's exactness rests on it (test_linear_quant.py checks rows against rows alone).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "elements.h"
#include "scratch.h"
#include "team.h"
#include "weight.h"


#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_QUANT_BF16 1
#else
#define HAVE_QUANT_BF16 0
#endif

#define QB TANDEM_QUANT_BLOCK /* inputs per block: 32 */
#define QP (QB / 2)           /* pairs per block: 16 */
#define QG 16                 /* outputs per group */
#define FORMAT_Q4_0 (-TANDEM_WEIGHT_Q4) /* the kernels' name for 4-bit codes without offsets: d (q - 8) */
#define PREFETCH_AHEAD 1024 /* bytes of a group's codes a tile prefetches ahead (tile_bf16) */

int tandem_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                       int64_t n, int64_t k);
void tandem_packed_group_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                              int64_t n, int64_t k, int64_t col);
int tandem_weight_layout(void);
int tandem_linear_tiles_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int64_t m,
                             int64_t n, int64_t k);

/* Per-thread scratch: the calling thread's rows' block sums S [m][nb]; each thread's row widened to
 * fp32 (the portable kernel). */
static __thread ThreadBuffer block_sums, widened_row;

/* Code of lane L (output L / 2, input 2 p + L % 2) of pair p at `pair` (its bytes), as an integer:
 * Q4_0's q - 8, Q4_1's q, Q8_0's q. */
static inline int code_at(const TandemWeight *w, const uint8_t *pair, int lane) {
    if (w->format == TANDEM_WEIGHT_Q8) return ((const int8_t *)pair)[lane];
    const int q = lane < 16 ? pair[lane] & 15 : pair[lane - 16] >> 4;
    return w->mins == NULL ? q - 8 : q;
}

/* s [nb] = the sums of row r's blocks of 32 inputs, each in input order from 0, whatever the other
 * rows. A horizontal sum a block (x[i] + x[i + 16], then a tree) made 8-32-row steps 4-7 % faster
 * but changed the sums' bits, which flipped the default model's near-tie answer to "What is the
 * capital of France?" in bf16 ("L'Etoile" for "The capital of France is Paris."); the blocks side
 * by side, or gathered 16 at a time, in this order measured as this loop (Zen 4). */
static void block_sums_of_row(const void *x, float *s, int64_t r, int64_t k, int64_t nb, int dtype) {
    for (int64_t b = 0; b < nb; b++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < QB; i++) sum += input(x, r * k + b * QB + i, dtype);
        s[b] = sum;
    }
}

/* The portable kernel: one row (fp32 xf [k], its block sums s [nb]) against groups [g0, g1). */
static void row_portable(const float *restrict xf, const float *restrict s, const TandemWeight *w, const void *bias,
                         void *out, int64_t row, int64_t n, int64_t nb, int64_t g0, int64_t g1, int dtype) {
    const uint8_t *codes = w->data;
    const int64_t pair_bytes = w->format == TANDEM_WEIGHT_Q4 ? QG : 2 * QG;
    for (int64_t g = g0; g < g1; g++) {
        float acc[QG] = {0};
        for (int64_t b = 0; b < nb; b++) {
            float blk[QG] = {0};
            for (int64_t p = 0; p < QP; p++) {
                const uint8_t *pair = codes + ((g * nb + b) * QP + p) * pair_bytes;
                const float x0 = xf[b * QB + 2 * p], x1 = xf[b * QB + 2 * p + 1];
                for (int j = 0; j < QG; j++)
                    blk[j] = blk[j] + (x0 * (float)code_at(w, pair, 2 * j) + x1 * (float)code_at(w, pair, 2 * j + 1));
            }
            const int64_t at = (g * nb + b) * QG;
            for (int j = 0; j < QG; j++) {
                acc[j] = fmaf(blk[j], fp16_to_f32(w->scales[at + j]), acc[j]);
                if (w->mins != NULL) acc[j] = fmaf(fp16_to_f32(w->mins[at + j]), s[b], acc[j]);
            }
        }
        for (int j = 0; j < QG && g * QG + j < n; j++) store(out, row * n + g * QG + j, acc[j], bias, g * QG + j, dtype);
    }
}

#if HAVE_QUANT_BF16

/* Per-thread scratch for widened codes (many_rows_bf16, dense_part), 64-byte aligned: the tiles'
 * vector loads from it would otherwise each span two cache lines (realloc aligns to 16). */
static __thread ThreadBuffer widened;

static __m512i *widened_vectors(int64_t count) {
    char *raw = buffer_of_at_least(&widened, (size_t)count * sizeof(__m512i) + 64);
    return raw == NULL ? NULL : (__m512i *)(raw + (64 - (uintptr_t)raw % 64) % 64);
}

/* One pair of 16 outputs' codes as 16 dwords of two bf16 values (the pair's first input low); for
 * FORMAT_Q4_0 each code q as q - 8. */
static inline __attribute__((always_inline)) __m512i codes_bf16(const uint8_t *c, const int FORMAT) {
    if (FORMAT != TANDEM_WEIGHT_Q8) {
        /* The 16 bytes in both halves, bytes -> words (one shuffle), the high half shifted down a
         * nibble, then each word 0..15 to the bf16 of 128 + q by OR-ing it under 128's exponent (128
         * to 255 are bf16's integers with unit steps): the block's correction takes the 128 back. */
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c)));
        const __m512i q = _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1));
        return _mm512_ternarylogic_epi32(q, _mm512_set1_epi16(15), _mm512_set1_epi16(0x4300), 0xEA); /* a & b | c */
    }
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* The scales of a block of 16 outputs (at: its index into w->scales) for sums of 128 + q (codes_bf16):
 * d, and the offset that takes the 128 back: d blk + (m - 128 d) S_b for Q4_1, Q4_0's d (q - 8) as
 * d blk - 136 d S_b; Q8_0's codes are as stored (off unused). */
static inline __attribute__((always_inline)) void block_scales(const TandemWeight *w, int64_t at, const int FORMAT,
                                                               __m512 *d, __m512 *off) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at)));
    if (FORMAT == TANDEM_WEIGHT_Q4)
        *off = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), *d,
                                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at))));
    else if (FORMAT == FORMAT_Q4_0)
        *off = _mm512_mul_ps(_mm512_set1_ps(-136.0f), *d);
    else
        *off = _mm512_setzero_ps();
}

/* acc after a block whose sums are blk (s_b: the row's sum of x over the block): acc + d blk, then
 * (4-bit) + off s_b. The one order every tile keeps (the NOTE at the top). */
static inline __attribute__((always_inline)) __m512 add_block(__m512 acc, __m512 blk, __m512 d, __m512 off,
                                                             float s_b, const int FORMAT) {
    acc = _mm512_fmadd_ps(blk, d, acc);
    return FORMAT != TANDEM_WEIGHT_Q8 ? _mm512_fmadd_ps(off, _mm512_set1_ps(s_b), acc) : acc;
}

/* Block b's part of the codes, scales and offsets of the NB groups after those from g (the tile after
 * this one), into L2: a tile of nb blocks fetches the whole next tile (tile_bf16 says why). */
static inline __attribute__((always_inline)) void prefetch_next_tile(const TandemWeight *w, int64_t nb, int64_t g,
                                                                     int64_t b, const int NB, const int FORMAT) {
    const int64_t pair_bytes = FORMAT != TANDEM_WEIGHT_Q8 ? QG : 2 * QG;
    const int64_t code_lines = NB * nb * QP * pair_bytes / 64, scale_lines = (NB * nb * QG * 2 + 63) / 64;
    const int64_t code_share = (code_lines + nb - 1) / nb, scale_share = (scale_lines + nb - 1) / nb;
    const char *next_codes = (const char *)((const uint8_t *)w->data + (g + NB) * nb * QP * pair_bytes);
    const char *next_scales = (const char *)(w->scales + (g + NB) * nb * QG);
    const char *next_mins = FORMAT == TANDEM_WEIGHT_Q4 ? (const char *)(w->mins + (g + NB) * nb * QG) : NULL;
    for (int64_t l = b * code_share; l < (b + 1) * code_share && l < code_lines; l++)
        _mm_prefetch(next_codes + 64 * l, _MM_HINT_T1);
    for (int64_t l = b * scale_share; l < (b + 1) * scale_share && l < scale_lines; l++) {
        _mm_prefetch(next_scales + 64 * l, _MM_HINT_T1);
        if (next_mins != NULL) _mm_prefetch(next_mins + 64 * l, _MM_HINT_T1);
    }
}

/* Rows [0, MR) of x (bf16, row stride k; block sums s, row stride nb) against NB groups from g. The
 * codes come from w, widened here, or (pre not NULL) already widened by widen_groups for these NB
 * groups: the same values, so the same bits. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, const float *s, const TandemWeight *w,
                                                            const __m512i *pre, const uint16_t *bias, uint16_t *out,
                                                            int64_t n, int64_t k, int64_t nb, int64_t g, const int MR,
                                                            const int NB, const int FORMAT, int prefetch_next) {
    const uint8_t *codes = w->data;
    const int64_t pair_bytes = FORMAT != TANDEM_WEIGHT_Q8 ? QG : 2 * QG;
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 blk[4][6];
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++) blk[i][j] = _mm512_setzero_ps();
        /* Codes read from memory (steps of 1-4 rows), prefetched into L2 (into L1, as tried before,
         * it measured within noise). A tile's NB groups are six streams of 4.6 KB (SmolLM2), which
         * the hardware prefetcher hardly ramps up on, and eighteen with the scales and offsets. With
         * a tile after this one in the thread's share, each block prefetches its part of that tile's
         * codes, scales and offsets (one contiguous range each), so the next tile starts in L2;
         * else each group's codes PREFETCH_AHEAD bytes on. SmolLM2's 4-bit linears (Zen 4, each
         * A/B interleaved in one process): no prefetch -> the streams, one row 6.3-6.8 -> 6.0-6.3 ms,
         * three rows 7.8 -> 7.4; the streams -> the next tile's ranges, one row 6.8-7.0 -> 6.1-6.2,
         * two rows 7.3 -> 6.2-6.3, four rows 6.1-6.9 -> 5.1-5.7. */
        if (prefetch_next) {
            prefetch_next_tile(w, nb, g, b, NB, FORMAT);
        } else if (pre == NULL) {
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++)
                for (int64_t l = 0; l < QP * pair_bytes; l += 64)
                    _mm_prefetch((const char *)(codes + ((g + j) * nb + b) * QP * pair_bytes) + PREFETCH_AHEAD + l,
                                 _MM_HINT_T1);
        }
        for (int64_t p = 0; p < QP; p++) {
            __m512i wv[6];
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++)
                wv[j] = pre != NULL ? _mm512_loadu_si512(pre + (b * QP + p) * NB + j)
                                    : codes_bf16(codes + (((g + j) * nb + b) * QP + p) * pair_bytes, FORMAT);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                uint32_t pr;
                memcpy(&pr, x + i * k + b * QB + 2 * p, sizeof pr);
                const __m512i xp = _mm512_set1_epi32((int)pr);
#pragma GCC unroll 6
                for (int j = 0; j < NB; j++) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)xp, (__m512bh)wv[j]);
            }
        }
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) {
            __m512 d, off;
            block_scales(w, ((g + j) * nb + b) * QG, FORMAT, &d, &off);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) acc[i][j] = add_block(acc[i][j], blk[i][j], d, off, s[i * nb + b], FORMAT);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) {
            const int64_t c = (g + j) * QG;
            if (c < n)
                store16_bias_bf16(out + i * n + c, acc[i][j], bias != NULL ? bias + c : NULL,
                                  n - c >= QG ? QG : (int)(n - c));
        }
}

/* Rows [0, MR) against groups [g0, g1): NB groups at a time, then what is left one by one. */
static inline __attribute__((always_inline)) void rows_bf16(const uint16_t *x, const float *s, const TandemWeight *w,
                                                            const uint16_t *bias, uint16_t *out, int64_t n, int64_t k,
                                                            int64_t nb, int64_t g0, int64_t g1, const int MR,
                                                            const int NB, const int FORMAT) {
    int64_t g = g0;
    for (; g + NB <= g1; g += NB) tile_bf16(x, s, w, NULL, bias, out, n, k, nb, g, MR, NB, FORMAT, g + 2 * NB <= g1);
    for (; g < g1; g++) tile_bf16(x, s, w, NULL, bias, out, n, k, nb, g, MR, 1, FORMAT, 0);
}

/* Tiles that keep their running sums in memory (tile_wide, tile_pre_bf16): accf holds rows [0, MR) x
 * NB groups, RS vectors a row, as does blk (the block sums, in registers once inlined). */
static inline __attribute__((always_inline)) void zero_running_sums(float *accf, const int MR, const int RS) {
#pragma GCC unroll 24
    for (int i = 0; i < MR * RS; i++) _mm512_store_ps(accf + i * QG, _mm512_setzero_ps()); /* not a loop of floats: rep stos */
}

/* The running sums after block b (add_block's order), then a barrier that keeps them in memory. */
static inline __attribute__((always_inline)) void add_blocks(float *accf, const __m512 *blk, const float *s,
                                                            const TandemWeight *w, int64_t nb, int64_t g, int64_t b,
                                                            const int MR, const int NB, const int RS, const int FORMAT) {
#pragma GCC unroll 6
    for (int j = 0; j < NB; j++) {
        __m512 d, off;
        block_scales(w, ((g + j) * nb + b) * QG, FORMAT, &d, &off);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            float *a = accf + (i * RS + j) * QG;
            _mm512_store_ps(a, add_block(_mm512_load_ps(a), blk[i * RS + j], d, off, s[i * nb + b], FORMAT));
        }
    }
    __asm__ volatile("" ::: "memory"); /* keep acc in memory: the registers hold the block sums */
}

/* out = the running sums (+ bias), rounded once; the outputs past n not written. */
static inline __attribute__((always_inline)) void store_running_sums(uint16_t *out, const float *accf,
                                                                     const uint16_t *bias, int64_t n, int64_t g,
                                                                     const int MR, const int NB, const int RS) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) {
            const int64_t c = (g + j) * QG;
            if (c < n)
                store16_bias_bf16(out + i * n + c, _mm512_load_ps(accf + (i * RS + j) * QG),
                                  bias != NULL ? bias + c : NULL, n - c >= QG ? QG : (int)(n - c));
        }
}

/* Rows [0, MR) (5-8) against NB groups (3, or 1 for what is left) from g: each pair's codes widened
 * once as read and multiplied by all MR rows, the MR x NB block sums in registers (24 of AVX-512's 32
 * at 8 x 3), the running sums in memory (L1), updated once a block as tile_pre_bf16's; the next
 * tile's codes prefetched as tile_bf16's. The same operations in the same order, so the same bits. */
static inline __attribute__((always_inline)) void tile_wide(const uint16_t *x, const float *s, const TandemWeight *w,
                                                            const uint16_t *bias, uint16_t *out, int64_t n, int64_t k,
                                                            int64_t nb, int64_t g, const int MR, const int NB,
                                                            const int FORMAT, int prefetch_next) {
    const uint8_t *codes = w->data;
    const int64_t pair_bytes = FORMAT != TANDEM_WEIGHT_Q8 ? QG : 2 * QG;
    __m512 acc[8][3];
    float *accf = (float *)acc;
    zero_running_sums(accf, MR, 3);
    for (int64_t b = 0; b < nb; b++) {
        __m512 blk[8][3];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 3
            for (int j = 0; j < NB; j++) blk[i][j] = _mm512_setzero_ps();
        if (prefetch_next) prefetch_next_tile(w, nb, g, b, NB, FORMAT);
        for (int64_t p = 0; p < QP; p++) {
            __m512i wv[3];
#pragma GCC unroll 3
            for (int j = 0; j < NB; j++) wv[j] = codes_bf16(codes + (((g + j) * nb + b) * QP + p) * pair_bytes, FORMAT);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                uint32_t pr;
                memcpy(&pr, x + i * k + b * QB + 2 * p, sizeof pr);
                const __m512i xp = _mm512_set1_epi32((int)pr);
#pragma GCC unroll 3
                for (int j = 0; j < NB; j++) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)xp, (__m512bh)wv[j]);
            }
        }
        add_blocks(accf, (const __m512 *)blk, s, w, nb, g, b, MR, NB, 3, FORMAT);
    }
    store_running_sums(out, accf, bias, n, g, MR, NB, 3);
}

/* Rows [0, MR) (5-8) against groups [g0, g1): three groups at a time, then what is left one by one. */
static inline __attribute__((always_inline)) void rows_wide(const uint16_t *x, const float *s, const TandemWeight *w,
                                                            const uint16_t *bias, uint16_t *out, int64_t n, int64_t k,
                                                            int64_t nb, int64_t g0, int64_t g1, const int MR,
                                                            const int FORMAT) {
    int64_t g = g0;
    for (; g + 3 <= g1; g += 3) tile_wide(x, s, w, bias, out, n, k, nb, g, MR, 3, FORMAT, g + 6 <= g1);
    for (; g < g1; g++) tile_wide(x, s, w, bias, out, n, k, nb, g, MR, 1, FORMAT, 0);
}

/* pre [nb][16 pairs][NB] = the NB groups from g widened to bf16 pairs, as tile_bf16 widens them. */
static inline __attribute__((always_inline)) void widen_groups(__m512i *pre, const TandemWeight *w, int64_t nb,
                                                               int64_t g, const int NB, const int FORMAT) {
    const uint8_t *codes = w->data;
    const int64_t pair_bytes = FORMAT != TANDEM_WEIGHT_Q8 ? QG : 2 * QG;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t p = 0; p < QP; p++)
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++)
                _mm512_storeu_si512(pre + (b * QP + p) * NB + j,
                                   codes_bf16(codes + (((g + j) * nb + b) * QP + p) * pair_bytes, FORMAT));
}

/* Rows [0, MR) of x against NB groups over codes widened once (pre, as widen_groups leaves them):
 * the block sums of all MR x NB outputs in registers (24 at 4 x 6, as the bf16 kernel's tile), the
 * running sums in `acc` (memory, L1), updated once a block. The same operations in the same order as
 * tile_bf16, so the same bits. */
static inline __attribute__((always_inline)) void tile_pre_bf16(const uint16_t *x, const float *s,
                                                                const TandemWeight *w, const __m512i *pre,
                                                                const uint16_t *bias, uint16_t *out, int64_t n,
                                                                int64_t k, int64_t nb, int64_t g, const char *pf,
                                                                int64_t pf_lines, const int MR, const int NB,
                                                                const int FORMAT) {
    __m512 acc[4][6];
    float *accf = (float *)acc;
    zero_running_sums(accf, MR, 6);
    for (int64_t b = 0; b < nb; b++) {
        __m512 blk[4][6];
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++) blk[i][j] = _mm512_setzero_ps();
        const __m512i *wp = pre + b * QP * NB;
        const uint16_t *xb = x + b * QB;
        for (int64_t l = 0; l < pf_lines; l++) _mm_prefetch(pf + (b * pf_lines + l) * 64, _MM_HINT_T1);
        for (int64_t p = 0; p < QP; p++, wp += NB) {
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                uint32_t pr;
                memcpy(&pr, xb + i * k + 2 * p, sizeof pr);
                const __m512i xp = _mm512_set1_epi32((int)pr);
#pragma GCC unroll 6
                for (int j = 0; j < NB; j++)
                    blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)xp, (__m512bh)_mm512_loadu_si512(wp + j));
            }
        }
        add_blocks(accf, (const __m512 *)blk, s, w, nb, g, b, MR, NB, 6, FORMAT);
    }
    store_running_sums(out, accf, bias, n, g, MR, NB, 6);
}

/* Past 16 rows: each set of NB groups widened once into pre (k / 2 x NB vectors), then every tile of
 * 4 rows over it; tiles of 4 rows that widened the codes themselves ran at 0.4-0.6x the bf16
 * kernel's speed at 32 rows, the widening repeated once a tile. */
static inline __attribute__((always_inline)) void many_rows_bf16(const uint16_t *x, const float *s,
                                                                 const TandemWeight *w, __m512i *pre,
                                                                 const uint16_t *bias, uint16_t *out, int64_t m,
                                                                 int64_t n, int64_t k, int64_t nb, int64_t g,
                                                                 int64_t next, const int NB, const int FORMAT) {
    widen_groups(pre, w, nb, g, NB, FORMAT);
    /* While the tiles run, the next set's codes (groups [g + NB, next)) come in from memory. */
    const int64_t group_bytes = nb * QP * (FORMAT != TANDEM_WEIGHT_Q8 ? QG : 2 * QG);
    const char *pf = (const char *)w->data + (g + NB) * group_bytes;
    const int64_t tiles = (m + 3) / 4, lines = (next - g - NB) * group_bytes / 64;
    const int64_t per = lines > 0 ? (lines + tiles * nb - 1) / (tiles * nb) : 0;
    int64_t r = 0, t = 0;
    for (; r + 4 <= m; r += 4, t++)
        tile_pre_bf16(x + r * k, s + r * nb, w, pre, bias, out + r * n, n, k, nb, g, pf + t * nb * per * 64, per, 4, NB, FORMAT);
    const char *pt = pf + t * nb * per * 64;
    switch (m - r) {
    case 1: tile_pre_bf16(x + r * k, s + r * nb, w, pre, bias, out + r * n, n, k, nb, g, pt, per, 1, NB, FORMAT); break;
    case 2: tile_pre_bf16(x + r * k, s + r * nb, w, pre, bias, out + r * n, n, k, nb, g, pt, per, 2, NB, FORMAT); break;
    case 3: tile_pre_bf16(x + r * k, s + r * nb, w, pre, bias, out + r * n, n, k, nb, g, pt, per, 3, NB, FORMAT); break;
    default: break;
    }
}

/* One thread's groups [g0, g1) against all m rows (block sums s), a format's tiles: one row with six
 * groups (six independent sums keep the loads in flight), up to 4 rows with three, 5-8 rows all in
 * one tile of three groups, 9-16 in passes of 8, more rows over codes widened once (pre: this
 * thread's scratch of k / 2 x 6 vectors). */
static void part_bf16(const uint16_t *x, const float *s, const TandemWeight *w, __m512i *pre, const uint16_t *bias,
                      uint16_t *out, int64_t m, int64_t n, int64_t k, int64_t nb, int64_t g0, int64_t g1,
                      const int FORMAT) {
    /* 5-8 rows: one tile of all the rows widens each code once and reads it from memory once; two
     * passes of the 1-4-row tiles (the second from L2) widened everything twice, and the scratch
     * costs a store and a load a widened pair, which pays over three or more 4-row tiles. 9-16 rows:
     * passes of 8 (the codes widened twice) beat the scratch's 4-row tiles; from 17 the two are
     * even. SmolLM2's 4-bit linears against the two passes and the scratch (Zen 4, one process,
     * interleaved, two runs): 5 rows 9.3-9.6 -> 7.6-8.0 ms, 6 9.5-10.4 -> 8.3-8.4, 7 10.5-11.4 ->
     * 9.3-9.9, 8 11.2-11.5 -> 10.7-11.7, 12 15.9 -> 14.3, 16 18.9 -> 17.3; 24 and 32 rows within
     * noise. The same operations in the same order: the same bits. */
    if (m > 8 && m <= 16) {
        for (int64_t r = 0; r < m; r += 8)
            part_bf16(x + r * k, s + r * nb, w, NULL, bias, out + r * n, m - r < 8 ? m - r : 8, n, k, nb, g0, g1,
                      FORMAT);
        return;
    }
    switch (m) {
    case 5: rows_wide(x, s, w, bias, out, n, k, nb, g0, g1, 5, FORMAT); return;
    case 6: rows_wide(x, s, w, bias, out, n, k, nb, g0, g1, 6, FORMAT); return;
    case 7: rows_wide(x, s, w, bias, out, n, k, nb, g0, g1, 7, FORMAT); return;
    case 8: rows_wide(x, s, w, bias, out, n, k, nb, g0, g1, 8, FORMAT); return;
    default: break;
    }
    if (m > 16) {
        int64_t g = g0;
        for (; g + 6 <= g1; g += 6)
            many_rows_bf16(x, s, w, pre, bias, out, m, n, k, nb, g, g + 12 <= g1 ? g + 12 : g1, 6, FORMAT);
        for (; g < g1; g++) many_rows_bf16(x, s, w, pre, bias, out, m, n, k, nb, g, g + 1, 1, FORMAT);
        return;
    }
    switch (m) {
    case 1: rows_bf16(x, s, w, bias, out, n, k, nb, g0, g1, 1, 6, FORMAT); break;
    case 2: rows_bf16(x, s, w, bias, out, n, k, nb, g0, g1, 2, 3, FORMAT); break;
    case 3: rows_bf16(x, s, w, bias, out, n, k, nb, g0, g1, 3, 3, FORMAT); break;
    case 4: rows_bf16(x, s, w, bias, out, n, k, nb, g0, g1, 4, 3, FORMAT); break;
    default: break;
    }
}

/* The dense path: each weight as bf16(d q + m), GGUF's value rounded once (what the checkpoint's bf16
 * import holds), for six groups (96 outputs: the packed bf16 kernel's group) at a time, written in
 * that kernel's layout and run by it. pre [k / 2][6] vectors; groups past `groups` are zeros. */
static inline __attribute__((always_inline)) void dequantize_set(__m512i *pre, const TandemWeight *w, int64_t nb,
                                                                 int64_t g, int64_t groups, const int FORMAT) {
    const uint8_t *codes = w->data;
    const int64_t pair_bytes = FORMAT != TANDEM_WEIGHT_Q8 ? QG : 2 * QG;
    /* Lane L of a pair's 32 is output L / 2: the 16 scales spread over the two halves. */
    const __m512i lo_outputs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_outputs = _mm512_add_epi32(lo_outputs, _mm512_set1_epi32(8));
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < 6; j++) {
            __m512i *to = pre + b * QP * 6 + j;
            if (g + j >= groups) {
                for (int64_t p = 0; p < QP; p++) _mm512_storeu_si512(to + p * 6, _mm512_setzero_si512());
                continue;
            }
            const int64_t at = ((g + j) * nb + b) * QG;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at)));
            const __m512 m = FORMAT == TANDEM_WEIGHT_Q4
                                 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at)))
                                 : _mm512_mul_ps(_mm512_set1_ps(-8.0f), d); /* Q4_0; unused by Q8_0 */
            const __m512 d_lo = _mm512_permutexvar_ps(lo_outputs, d), d_hi = _mm512_permutexvar_ps(hi_outputs, d);
            const __m512 m_lo = _mm512_permutexvar_ps(lo_outputs, m), m_hi = _mm512_permutexvar_ps(hi_outputs, m);
            const uint8_t *c = codes + ((g + j) * nb + b) * QP * pair_bytes;
            for (int64_t p = 0; p < QP; p++, c += pair_bytes) {
                __m512i qlo, qhi; /* lanes 0-15 and 16-31 of the pair as int32 */
                if (FORMAT != TANDEM_WEIGHT_Q8) { /* byte j: lane j low, lane j + 16 high */
                    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
                    qlo = _mm512_and_si512(v, _mm512_set1_epi32(15));
                    qhi = _mm512_srli_epi32(v, 4);
                } else {
                    qlo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c));
                    qhi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)));
                }
                /* d q is exact in fp32 (11 by at most 8 significant bits), + m rounds once, as GGUF's
                 * fp32 does (Q4_0's m = -8 d makes d (q - 8), also exact); then to bf16, nearest even, as
                 * the import's .to(bfloat16). */
                const __m512 lo = _mm512_cvtepi32_ps(qlo), hi = _mm512_cvtepi32_ps(qhi);
                const __m512 vlo = FORMAT != TANDEM_WEIGHT_Q8 ? _mm512_fmadd_ps(lo, d_lo, m_lo) : _mm512_mul_ps(lo, d_lo);
                const __m512 vhi = FORMAT != TANDEM_WEIGHT_Q8 ? _mm512_fmadd_ps(hi, d_hi, m_hi) : _mm512_mul_ps(hi, d_hi);
                _mm512_storeu_si512(to + p * 6, (__m512i)_mm512_cvtne2ps_pbh(vhi, vlo));
            }
        }
}

/* One thread's sets of six groups [set0, set1) against all m rows, dense (above). */
static void dense_part(const uint16_t *x, const TandemWeight *w, __m512i *pre, const uint16_t *bias, uint16_t *out,
                       int64_t m, int64_t n, int64_t k, int64_t nb, int64_t groups, int64_t set0, int64_t set1) {
    for (int64_t set = set0; set < set1; set++) {
        const int64_t g = set * 6;
        if (w->format == TANDEM_WEIGHT_Q8)
            dequantize_set(pre, w, nb, g, groups, TANDEM_WEIGHT_Q8);
        else if (w->mins != NULL)
            dequantize_set(pre, w, nb, g, groups, TANDEM_WEIGHT_Q4);
        else
            dequantize_set(pre, w, nb, g, groups, FORMAT_Q4_0);
        tandem_packed_group_rows(x, (const uint16_t *)pre, bias, out, m, n, k, g * QG);
    }
}

#endif

/* The quantized linear: block sums first (one order per row), then the groups split over the threads. */
static int linear_quant(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                        int64_t k, int dtype) {
    if (k % QB != 0 || w->scales == NULL) return -1;
    if (m == 0 || n == 0) return 0;
    if (w->activations == 8) return tandem_linear_int8(x, w, bias, out, m, n, k, dtype); /* every row */
    const int64_t nb = k / QB, groups = (n + QG - 1) / QG;
#if HAVE_QUANT_BF16
    if (dtype == 1 && w->dense_rows > 0 && m >= w->dense_rows && tandem_weight_layout() == 6 * QG) {
        const int64_t sets = (groups + 5) / 6;
        int failed = 0;
#pragma omp parallel reduction(| : failed)
        {
            int64_t s0, s1;
            team_share(sets, &s0, &s1);
            __m512i *pre = s0 < s1 ? widened_vectors(k / 2 * 6) : NULL;
            if (s0 < s1 && pre == NULL)
                failed = 1;
            else if (s0 < s1)
                dense_part(x, w, pre, bias, out, m, n, k, nb, groups, s0, s1);
        }
        return failed ? -1 : 0;
    }
#endif
    float *s = buffer_of_at_least(&block_sums, (size_t)(m * nb) * sizeof(float)); /* shared by the team below */
    if (s == NULL) return -1;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) block_sums_of_row(x, s + r * nb, r, k, nb, dtype);
        /* (the loop's barrier: every row's sums are in before any output uses them) */
        int64_t g0, g1;
        team_share(groups, &g0, &g1);
#if HAVE_QUANT_BF16
        if (dtype == 1 && g0 < g1) {
            __m512i *pre = m > 16 ? widened_vectors(k / 2 * 6) : NULL;
            if (m > 16 && pre == NULL)
                failed = 1;
            else if (w->format == TANDEM_WEIGHT_Q8)
                part_bf16(x, s, w, pre, bias, out, m, n, k, nb, g0, g1, TANDEM_WEIGHT_Q8);
            else if (w->mins != NULL)
                part_bf16(x, s, w, pre, bias, out, m, n, k, nb, g0, g1, TANDEM_WEIGHT_Q4);
            else
                part_bf16(x, s, w, pre, bias, out, m, n, k, nb, g0, g1, FORMAT_Q4_0);
        } else
#endif
            if (g0 < g1) {
            float *xf = buffer_of_at_least(&widened_row, (size_t)k * sizeof(float));
            if (xf == NULL) {
                failed = 1;
            } else {
                for (int64_t r = 0; r < m; r++) {
                    for (int64_t i = 0; i < k; i++) xf[i] = input(x, r * k + i, dtype);
                    row_portable(xf, s + r * nb, w, bias, out, r, n, nb, g0, g1, dtype);
                }
            }
        }
    }
    return failed ? -1 : 0;
}

int tandem_linear(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                  int64_t k, int dtype) {
    if (w == NULL || m < 0 || n < 0 || k < 1 || w->n != n || w->k != k || (dtype != 0 && dtype != 1)) return -1;
    if (w->format == TANDEM_WEIGHT_BF16) {
        if (dtype != 1) return -1;
        if (w->tile_rows > 0 && m >= w->tile_rows) return tandem_linear_tiles_bf16(x, w->data, bias, out, m, n, k);
        return tandem_linear_bf16(x, w->data, bias, out, m, n, k);
    }
    if (w->format == TANDEM_WEIGHT_F32)
        return dtype == 0 ? tandem_linear_f32(x, w->data, bias, out, m, n, k) : -1;
    if (w->format == TANDEM_WEIGHT_Q4 || w->format == TANDEM_WEIGHT_Q8) return linear_quant(x, w, bias, out, m, n, k, dtype);
    return -1;
}

/* Quantized weights (weight.h's Q4 and Q8: GGUF's Q4_0, Q4_1, Q8_0) against activations rounded to
 * int8 (--quantized-activations int8, opt in, lossy): each row's inputs in blocks of 32, as llama.cpp's
 * Q8_1 does them, and each block's products as integer dot products (VPDPBUSD, AVX512-VNNI).
 *
 * Why: with activations in bf16 a 32-row step of 4-bit weights does all of the bf16 kernel's products
 * (VDPBF16PS, 32 an instruction) plus two multiply-adds a block and the codes' widening, so it cannot
 * beat bf16 weights once the step computes more than it reads (linear_quant.c). VPDPBUSD does 64
 * products an instruction, exactly, in int32.
 *
 * Activations, per row r and block b of 32 inputs (quantize_row): d = max |x| / 127, q = x / d rounded
 * to the nearest integer (ties to even; |q| <= 127), the block's code sum Q = sum q. So x is d q up to
 * d / 2 an input: that is the mode's loss. Chosen over one scale per row by measurement
 * (docs/PERFORMANCE.md): a row's few large inputs would set every block's step.
 *
 * Arithmetic: for output f and block b, with x ~ d_x q_x, sum_i x_i w_i is
 *   Q8_0  d_w d_x (sum q_x q)        Q4_0  d_w d_x (sum q_x q - 8 Q)        Q4_1  d_w d_x (sum q_x q) + m d_x Q
 * the sums in brackets exact integers (|.| < 2^20: exact in fp32 too). VPDPBUSD multiplies unsigned by
 * signed bytes: 4-bit codes are unsigned as stored, 8-bit ones are taken as q + 128 (one XOR) and the
 * block takes back 128 Q. Q4_1's m d_x Q is the product of the offset with the block's rounded inputs,
 * not with their exact sum: the errors of d q_x and of m then cancel as they do in the product with
 * the weight's own value d q + m (with the exact sum, the error is d times a sum of q ~ 7.5, not of the
 * weight's centred value).
 *
 * Weights are read in linear_quant.c's storage (models/quantized.py; no second copy): a pair p of a
 * group's block is its 16 outputs x inputs 2p, 2p + 1. VPDPBUSD sums four bytes a dword, so two pairs
 * become a "quad" (quad_u8): dword c = output c's inputs 4j .. 4j + 3, one word permute (VPERMW) of
 * the two pairs, then for 4-bit codes the high 16 outputs' nibbles shifted down; a row's inputs
 * 4j .. 4j + 3 are then one broadcast dword of its codes.
 *
 * NOTE: every output's sum runs in one order whatever the rows, the tile or the build: for each block
 * in order, acc = fma(float(I), d_w * d_x, acc) (I the exact integer above), then for Q4_1
 * acc = fma(m, d_x * Q, acc); then the bias, then one rounding. The integer sums are exact, so the
 * tiles may group their products as they like. The portable path (builds without VNNI) runs the same
 * operations, so every build gives the same bits (test_linear_int8.py checks rows against rows alone
 * and the builds against each other).
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if HAVE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include "tiles.h"
#define HAVE_INT8_TILES 1
#else
#define HAVE_INT8_TILES 0
#endif

int tandem_tiles_available(void); /* linear_tiles.c: whether the kernel granted this process the tile state */

#define QB TANDEM_QUANT_BLOCK /* inputs per block: 32 */
#define QP (QB / 2)           /* pairs per block: 16 */
#define QQ (QB / 4)           /* quads per block: 8 */
#define QG 16                 /* outputs per group */
#define FORMAT_Q4_0 (-TANDEM_WEIGHT_Q4) /* 4-bit codes without offsets: d (q - 8) */
/* Past 4 rows, each thread's groups run in sets of SET, TILE_ROWS rows a tile: the block sums and the
 * running sums of 4 x 3 outputs in 24 registers. Against 3 x 4, 2 x 4 and 2 x 6 (SmolLM2's step, one
 * thread, interleaved): 8 rows 12.1 against 13.2, 12.2 and 16.1 ms, 32 rows 33.2 against 33.6,
 * 33.9 and 37.4. */
#define SET 3
#define TILE_ROWS 4
/* Each thread rounds all the rows itself (tandem_linear_int8) up to ALONE_ROWS rows, or when the call
 * has at least ALONE_GROUPS groups a thread. */
#define ALONE_ROWS 8
#define ALONE_GROUPS 16

/* A call's activations as the kernels read them (quantize_row), rows one after another. */
typedef struct {
    const int8_t *q; /* [m][k] codes */
    const float *d;  /* [m][nb] scales */
    const int32_t *c; /* [m][nb] what the block's integer sum takes back: off * Q (off: 8, 128 or 0) */
    const float *s;  /* [m][nb] d * Q: the block's rounded inputs' sum (Q4_1's offset term) */
} Activations;

static __thread ThreadBuffer activation_buffer; /* each thread's rounded rows (or the caller's, shared) */

/* Row r of x [m][k] quantized per block into a's arrays; off: what the format's integer sum takes back
 * per unit of Q. The same operations on every build (the vector path's are exact or correctly rounded
 * one by one as these are), so the same codes. */
static void quantize_row(const void *x, int64_t r, int64_t k, int dtype, int32_t off, int8_t *q, float *d,
                         int32_t *c, float *s) {
    const int64_t nb = k / QB;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t at = r * k + b * QB;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 v0, v1;
        if (dtype == 1) {
            const uint16_t *xb = (const uint16_t *)x + at;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xb)), 16));
            v1 = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16))), 16));
        } else {
            v0 = _mm512_loadu_ps((const float *)x + at);
            v1 = _mm512_loadu_ps((const float *)x + at + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float db = amax / 127.0f, inverse = db > 0.0f ? 1.0f / db : 0.0f;
        /* x / d to the nearest integer, ties to even (the default rounding mode, as nearbyintf) */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)(q + at), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + at + 16), _mm512_cvtsepi32_epi8(q1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) {
            const float a = fabsf(input(x, at + i, dtype));
            amax = a > amax ? a : amax;
        }
        const float db = amax / 127.0f, inverse = db > 0.0f ? 1.0f / db : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QB; i++) {
            float v = nearbyintf(input(x, at + i, dtype) * inverse);
            v = v > 127.0f ? 127.0f : (v < -128.0f ? -128.0f : v); /* never reached: |x| <= max |x| */
            q[at + i] = (int8_t)v;
            sum += (int32_t)v;
        }
#endif
        d[r * nb + b] = db;
        c[r * nb + b] = off * sum;
        s[r * nb + b] = db * (float)sum;
    }
}

#if !HAVE_VNNI

/* The portable kernel: row r against groups [g0, g1); 8-bit codes signed, 4-bit ones as stored (so
 * Q4_0 takes back 8 Q). */
static void row_portable(const Activations *a, const TandemWeight *w, const void *bias, void *out, int64_t r,
                         int64_t n, int64_t k, int64_t g0, int64_t g1, int dtype) {
    const int64_t nb = k / QB;
    const uint8_t *codes = w->data;
    const int is_q8 = w->format == TANDEM_WEIGHT_Q8;
    const int64_t pair_bytes = is_q8 ? 2 * QG : QG;
    const int8_t *qx = a->q + r * k;
    for (int64_t g = g0; g < g1; g++) {
        float acc[QG] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot[QG] = {0};
            for (int64_t p = 0; p < QP; p++) {
                const uint8_t *pair = codes + ((g * nb + b) * QP + p) * pair_bytes;
                const int32_t x0 = qx[b * QB + 2 * p], x1 = qx[b * QB + 2 * p + 1];
                for (int j = 0; j < QG; j++) {
                    int32_t c0, c1; /* lanes 2 j and 2 j + 1 */
                    if (is_q8) {
                        c0 = ((const int8_t *)pair)[2 * j];
                        c1 = ((const int8_t *)pair)[2 * j + 1];
                    } else if (j < 8) {
                        c0 = pair[2 * j] & 15;
                        c1 = pair[2 * j + 1] & 15;
                    } else {
                        c0 = pair[2 * j - 16] >> 4;
                        c1 = pair[2 * j - 15] >> 4;
                    }
                    dot[j] += x0 * c0 + x1 * c1;
                }
            }
            const float db = a->d[r * nb + b];
            for (int j = 0; j < QG; j++) {
                const int64_t at = (g * nb + b) * QG + j;
                acc[j] = fmaf((float)(dot[j] - a->c[r * nb + b]), fp16_to_f32(w->scales[at]) * db, acc[j]);
                if (w->mins != NULL) acc[j] = fmaf(fp16_to_f32(w->mins[at]), a->s[r * nb + b], acc[j]);
            }
        }
        for (int j = 0; j < QG && g * QG + j < n; j++) store(out, r * n + g * QG + j, acc[j], bias, g * QG + j, dtype);
    }
}

#else

static __thread ThreadBuffer quad_buffer; /* each thread's set of groups as quads, 64-byte aligned */

static __m512i *quad_scratch(int64_t count) {
    char *raw = buffer_of_at_least(&quad_buffer, (size_t)count * sizeof(__m512i) + 64);
    return raw == NULL ? NULL : (__m512i *)(raw + (64 - (uintptr_t)raw % 64) % 64);
}

/* Quad j of a group's block (pairs 2j and 2j + 1, at `pairs`) as 16 dwords of unsigned bytes, dword c
 * output c's codes for inputs 4j .. 4j + 3: 4-bit as stored (0..15), 8-bit as q + 128. */
static inline __attribute__((always_inline)) __m512i quad_u8(const uint8_t *pairs, const int FORMAT) {
    if (FORMAT != TANDEM_WEIGHT_Q8) {
        /* words 0-7 pair 2j, 8-15 pair 2j + 1 (both halves); word c of a pair is outputs c (low
         * nibbles) and c + 8 (high) at its two inputs: dword c takes word c % 8 of each pair */
        const __m512i idx = _mm512_set_epi16(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0,
                                             15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)pairs));
        const __m512i u = _mm512_permutexvar_epi16(idx, v);
        const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        return _mm512_and_si512(_mm512_srlv_epi16(u, shift), _mm512_set1_epi8(15));
    }
    /* words 0-15 pair 2j, 16-31 pair 2j + 1; word c is output c at the pair's two inputs */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i u = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(pairs));
    return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
}

/* The integer sum's offset per unit of Q for the VNNI kernels: 8-bit codes read as q + 128, Q4_0's
 * codes as q (the weight is d (q - 8)), Q4_1's as q. */
static inline int32_t vnni_offset(const TandemWeight *w) {
    return w->format == TANDEM_WEIGHT_Q8 ? 128 : (w->mins == NULL ? 8 : 0);
}

/* What a tile fetches into L2 while it runs (the codes, scales and offsets of the groups after it, one
 * contiguous range each), a block at a time: part p of `parts` of every range. Without it a set's
 * codes came from memory only when made into quads, and waiting for them took about a sixth of a
 * 32-row step (perf, the loads' first users). */
typedef struct {
    const char *at[3];
    int64_t lines[3]; /* 64-byte lines of each range (0: none) */
    int64_t share[3]; /* lines a part */
    int64_t part0; /* this tile's first part (its block 0) */
} Prefetch;

static inline __attribute__((always_inline)) void prefetch_part(const Prefetch *pf, int64_t part) {
    for (int r = 0; r < 3; r++) {
        const int64_t share = pf->share[r];
        for (int64_t l = part * share; l < (part + 1) * share && l < pf->lines[r]; l++)
            _mm_prefetch(pf->at[r] + 64 * l, _MM_HINT_T1);
    }
}

/* The groups [g, g1) of w's codes, scales and offsets, split in `parts` parts from part0. */
static inline Prefetch prefetch_groups(const TandemWeight *w, int64_t nb, int64_t g, int64_t g1, int64_t part0,
                                       int64_t parts, const int FORMAT) {
    const int64_t pair_bytes = FORMAT == TANDEM_WEIGHT_Q8 ? 2 * QG : QG, count = g1 > g ? g1 - g : 0;
    const int64_t scale_lines = (count * nb * QG * 2 + 63) / 64;
    const int64_t code_lines = count * nb * QP * pair_bytes / 64, min_lines = FORMAT == TANDEM_WEIGHT_Q4 ? scale_lines : 0;
    Prefetch pf = {{(const char *)w->data + g * nb * QP * pair_bytes, (const char *)(w->scales + g * nb * QG),
                    FORMAT == TANDEM_WEIGHT_Q4 ? (const char *)(w->mins + g * nb * QG) : NULL},
                   {code_lines, scale_lines, min_lines},
                   {(code_lines + parts - 1) / parts, (scale_lines + parts - 1) / parts, (min_lines + parts - 1) / parts},
                   part0};
    return pf;
}

static inline __attribute__((always_inline)) void store16(void *out, __m512 acc, const void *bias, int64_t n,
                                                         int64_t c, int dtype) {
    const int valid = n - c >= QG ? QG : (int)(n - c);
    if (dtype == 1) {
        store16_bias_bf16((uint16_t *)out + c, acc, bias != NULL ? (const uint16_t *)bias + c : NULL, valid);
        return;
    }
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
    if (bias != NULL) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, (const float *)bias + c));
    _mm512_mask_storeu_ps((float *)out + c, mask, acc);
}

/* Rows [r, r + MR) against NB groups from g: every block's quads from `pre` ([nb][8][NB], this set's,
 * left by the set's first tile) or, pre NULL, made here from the codes, and then kept in `keep` (not
 * NULL: the first tile of a set that has more); the MR x NB block sums and running sums in registers;
 * block b fetches part pf->part0 + b of what pf names. */
static inline __attribute__((always_inline)) void tile(const Activations *a, const TandemWeight *w,
                                                       const __m512i *pre, __m512i *keep, const void *bias, void *out,
                                                       int64_t r, int64_t n, int64_t k, int64_t nb, int64_t g,
                                                       const Prefetch *pf, const int MR, const int NB, const int FORMAT,
                                                       int dtype) {
    const uint8_t *codes = w->data;
    const int64_t pair_bytes = FORMAT == TANDEM_WEIGHT_Q8 ? 2 * QG : QG;
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[4][6];
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++) dot[i][j] = _mm512_setzero_si512();
        const int8_t *xb = a->q + r * k + b * QB;
        prefetch_part(pf, pf->part0 + b);
#pragma GCC unroll 8
        for (int qd = 0; qd < QQ; qd++) {
            __m512i wq[6];
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++) {
                if (pre != NULL) {
                    wq[j] = _mm512_load_si512(pre + (b * QQ + qd) * NB + j);
                } else {
                    wq[j] = quad_u8(codes + (((g + j) * nb + b) * QP + 2 * qd) * pair_bytes, FORMAT);
                    if (keep != NULL) _mm512_store_si512(keep + (b * QQ + qd) * NB + j, wq[j]);
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                int32_t x4;
                memcpy(&x4, xb + i * k + 4 * qd, sizeof x4);
                const __m512i xv = _mm512_set1_epi32(x4);
#pragma GCC unroll 6
                for (int j = 0; j < NB; j++) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], wq[j], xv);
            }
        }
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) {
            const int64_t at = ((g + j) * nb + b) * QG;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at)));
            const __m512 mw = FORMAT == TANDEM_WEIGHT_Q4
                                  ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at)))
                                  : _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                const int64_t rb = (r + i) * nb + b;
                __m512i sum = dot[i][j];
                if (FORMAT != TANDEM_WEIGHT_Q4) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(a->c[rb]));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[rb]));
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i][j]);
                if (FORMAT == TANDEM_WEIGHT_Q4) acc[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[rb]), acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++)
            if ((g + j) * QG < n) store16((char *)out + (r + i) * n * (dtype == 1 ? 2 : 4), acc[i][j], bias, n, (g + j) * QG, dtype);
}

/* Rows [0, m) against NB groups from g in tiles of 4 rows, then the rest: the first tile makes the
 * set's quads from the codes and keeps them in `pre` (this thread's, k / 4 x NB vectors) for the
 * others (a pass of its own before the tiles cost 6 % of a 32-row step more); meanwhile the groups
 * [g + NB, next) come into L2 (the next set's). */
static inline __attribute__((always_inline)) void rows_of_set(const Activations *a, const TandemWeight *w,
                                                              __m512i *pre, const void *bias, void *out, int64_t m,
                                                              int64_t n, int64_t k, int64_t nb, int64_t g,
                                                              int64_t next, const int NB, const int FORMAT, int dtype) {
    Prefetch pf = prefetch_groups(w, nb, g + NB, next, 0, (m + TILE_ROWS - 1) / TILE_ROWS * nb, FORMAT);
    const __m512i *from = NULL; /* the first tile's quads, once it has made them */
    int64_t r = 0;
    for (; r + TILE_ROWS <= m; r += TILE_ROWS, pf.part0 += nb, from = pre)
        tile(a, w, from, r + TILE_ROWS < m ? pre : NULL, bias, out, r, n, k, nb, g, &pf, TILE_ROWS, NB, FORMAT, dtype);
    switch (m - r) {
    case 1: tile(a, w, from, NULL, bias, out, r, n, k, nb, g, &pf, 1, NB, FORMAT, dtype); break;
    case 2: tile(a, w, from, NULL, bias, out, r, n, k, nb, g, &pf, 2, NB, FORMAT, dtype); break;
    case 3: tile(a, w, from, NULL, bias, out, r, n, k, nb, g, &pf, 3, NB, FORMAT, dtype); break;
    default: break;
    }
}

/* One thread's groups [g0, g1) against all m rows: one row streams the codes in tiles of six groups;
 * more rows make each set of three groups' quads once (pre: k / 4 x 3 vectors) and run every row over
 * them. */
static void part_vnni(const Activations *a, const TandemWeight *w, __m512i *pre, const void *bias, void *out,
                      int64_t m, int64_t n, int64_t k, int64_t g0, int64_t g1, const int FORMAT, int dtype) {
    const int64_t nb = k / QB;
    int64_t g = g0;
    if (m == 1) { /* each tile fetches the next one's groups */
        for (; g + 6 <= g1; g += 6) {
            const Prefetch pf = prefetch_groups(w, nb, g + 6, g + 12 <= g1 ? g + 12 : g1, 0, nb, FORMAT);
            tile(a, w, NULL, NULL, bias, out, 0, n, k, nb, g, &pf, 1, 6, FORMAT, dtype);
        }
        for (; g < g1; g++) {
            const Prefetch pf = prefetch_groups(w, nb, g + 1, g + 1 < g1 ? g + 2 : g1, 0, nb, FORMAT);
            tile(a, w, NULL, NULL, bias, out, 0, n, k, nb, g, &pf, 1, 1, FORMAT, dtype);
        }
        return;
    }
    for (; g + SET <= g1; g += SET)
        rows_of_set(a, w, pre, bias, out, m, n, k, nb, g, g + 2 * SET <= g1 ? g + 2 * SET : g1, SET, FORMAT, dtype);
    for (; g < g1; g++) rows_of_set(a, w, pre, bias, out, m, n, k, nb, g, g + 1 < g1 ? g + 2 : g1, 1, FORMAT, dtype);
}

#if HAVE_INT8_TILES

/* AMX-INT8 (the amx build, for the weights whose descriptor's tile_rows the call reaches): one tile
 * product does a 16-row x 16-output x 32-input block's integer sums, where VPDPBUSD does one row's 16
 * outputs x 4 inputs. Each block still needs its own scaling (per row and output), so a block's C
 * tile is stored and scaled by tile()'s fp32 operations in tile()'s order: the same integers, so the
 * same bits as the vector kernel for every row (integer sums are exact in any grouping). The weights
 * go in signed where their values are (TDPBSSD: Q8_0's q, Q4_0's q - 8), so the block's integer is
 * the weight's own product with nothing to take back; Q4_1's codes go in unsigned as stored
 * (TDPBSUD) and its offsets are added apart, as tile() does.
 *
 * Tiles (palette 1): 0 and 1 C (16 rows x 16 int32: block b + 1's product runs on the tile unit
 * while block b is scaled), 2 and 3 A (16 rows x 32 codes), 4 and 5 B (8 quads x 16 outputs, each
 * quad a 64-byte row, dword c output c's 4 inputs: quad_u8's vectors as they lie). Only whole tiles
 * of 16 rows run here; a call's last m % 16 rows run tile() (the same bits), so no row is padded and
 * nothing is re-blocked by the row count. */

#define TILE_M 16 /* rows a tile */

static TileConfig int8_tile_config(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 2; t++) {
        cfg.rows[t] = TILE_M, cfg.colsb[t] = QG * 4;     /* C: 16 rows x 16 int32 */
        cfg.rows[2 + t] = TILE_M, cfg.colsb[2 + t] = QB; /* A: 16 rows x 32 codes */
        cfg.rows[4 + t] = QQ, cfg.colsb[4 + t] = QG * 4; /* B: 8 quads x 16 outputs */
    }
    return cfg;
}

/* Quad j of a group's block as the tile product reads it: signed values for Q8_0 (q) and Q4_0 (q - 8),
 * Q4_1's unsigned codes as stored. */
static inline __attribute__((always_inline)) __m512i quad_tile(const uint8_t *pairs, const int FORMAT) {
    const __m512i u = quad_u8(pairs, FORMAT);
    if (FORMAT == TANDEM_WEIGHT_Q8) return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
    if (FORMAT == FORMAT_Q4_0) return _mm512_sub_epi8(u, _mm512_set1_epi8(8));
    return u;
}

/* Block b's scaling, C's 16 rows x 16 outputs at `sums`, into the rows' running sums: tile()'s
 * operations, row by row (the integers need nothing taken back: see quad_tile). */
static inline __attribute__((always_inline)) void scale_block(const Activations *a, const TandemWeight *w,
                                                              const int32_t *sums, __m512 acc[TILE_M], int64_t r,
                                                              int64_t nb, int64_t g, int64_t b, const int FORMAT) {
    const int64_t at = (g * nb + b) * QG;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at)));
    const __m512 mw = FORMAT == TANDEM_WEIGHT_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at)))
                                                 : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < TILE_M; i++) {
        const int64_t rb = (r + i) * nb + b;
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[rb]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + i * QG)), scale, acc[i]);
        if (FORMAT == TANDEM_WEIGHT_Q4) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[rb]), acc[i]);
    }
}

/* Block b's products of rows [r, r + 16) and one group's quads (`quads`: [nb][8], 64 bytes each) into
 * C tile `C`, A tile `A`, B tile `B` (immediates: one call site per tile triple). */
#define BLOCK_PRODUCT(C, A, B, b)                                                                                   \
    do {                                                                                                            \
        _tile_loadd(A, a->q + r * k + (b) * QB, k);                                                                 \
        _tile_loadd(B, quads + (b) * QQ, 64);                                                                       \
        _tile_zero(C);                                                                                              \
        if (FORMAT == TANDEM_WEIGHT_Q4)                                                                             \
            _tile_dpbsud(C, A, B);                                                                                  \
        else                                                                                                        \
            _tile_dpbssd(C, A, B);                                                                                  \
    } while (0)

/* One group's outputs for the 16 rows [r, r + 16): block b + 1's product runs on the tile unit while
 * block b is scaled; the running sums stay in 16 registers. */
static inline __attribute__((always_inline)) void group_rows(const Activations *a, const TandemWeight *w,
                                                             const __m512i *quads, const void *bias, void *out,
                                                             int64_t r, int64_t n, int64_t k, int64_t nb, int64_t g,
                                                             const Prefetch *pf, const int FORMAT, int dtype) {
    int32_t sums[TILE_M * QG] __attribute__((aligned(64)));
    __m512 acc[TILE_M];
#pragma GCC unroll 16
    for (int i = 0; i < TILE_M; i++) acc[i] = _mm512_setzero_ps();
    BLOCK_PRODUCT(0, 2, 4, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        prefetch_part(pf, pf->part0 + b);
        if (b + 1 < nb) BLOCK_PRODUCT(1, 3, 5, b + 1);
        _tile_stored(0, sums, QG * 4);
        scale_block(a, w, sums, acc, r, nb, g, b, FORMAT);
        if (b + 1 >= nb) break;
        prefetch_part(pf, pf->part0 + b + 1);
        if (b + 2 < nb) BLOCK_PRODUCT(0, 2, 4, b + 2);
        _tile_stored(1, sums, QG * 4);
        scale_block(a, w, sums, acc, r, nb, g, b + 1, FORMAT);
    }
    if (g * QG >= n) return;
#pragma GCC unroll 16
    for (int i = 0; i < TILE_M; i++) /* a constant index: the sums never leave their registers */
        store16((char *)out + (r + i) * n * (dtype == 1 ? 2 : 4), acc[i], bias, n, g * QG, dtype);
}

/* One thread's groups [g0, g1) against all m rows: each group's quads made once into `quads`
 * ([nb][8]), every whole tile of 16 rows over them while the next group's codes come into L2, then
 * the last m % 16 rows on tile() (the same bits). */
static void part_tiles(const Activations *a, const TandemWeight *w, __m512i *quads, const void *bias, void *out,
                       int64_t m, int64_t n, int64_t k, int64_t g0, int64_t g1, const int FORMAT, int dtype) {
    const int64_t nb = k / QB, pair_bytes = FORMAT == TANDEM_WEIGHT_Q8 ? 2 * QG : QG;
    const int64_t row_tiles = m / TILE_M;
    const Prefetch none = {{NULL, NULL, NULL}, {0, 0, 0}, {0, 0, 0}, 0};
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t b = 0; b < nb; b++)
            for (int qd = 0; qd < QQ; qd++)
                _mm512_store_si512(quads + b * QQ + qd,
                                   quad_tile((const uint8_t *)w->data + ((g * nb + b) * QP + 2 * qd) * pair_bytes,
                                             FORMAT));
        TILE_MEMORY_BARRIER(); /* the quads are stored before a tile load reads them */
        Prefetch pf = prefetch_groups(w, nb, g + 1, g + 1 < g1 ? g + 2 : g1, 0, row_tiles * nb, FORMAT);
        for (int64_t t = 0; t < row_tiles; t++, pf.part0 += nb)
            group_rows(a, w, quads, bias, out, t * TILE_M, n, k, nb, g, &pf, FORMAT, dtype);
        for (int64_t r = row_tiles * TILE_M; r < m; r += TILE_ROWS) {
            switch (m - r < TILE_ROWS ? m - r : TILE_ROWS) {
            case 1: tile(a, w, NULL, NULL, bias, out, r, n, k, nb, g, &none, 1, 1, FORMAT, dtype); break;
            case 2: tile(a, w, NULL, NULL, bias, out, r, n, k, nb, g, &none, 2, 1, FORMAT, dtype); break;
            case 3: tile(a, w, NULL, NULL, bias, out, r, n, k, nb, g, &none, 3, 1, FORMAT, dtype); break;
            default: tile(a, w, NULL, NULL, bias, out, r, n, k, nb, g, &none, 4, 1, FORMAT, dtype); break;
            }
        }
    }
}

#undef BLOCK_PRODUCT

#endif /* HAVE_INT8_TILES */

#endif

/* Room for m rows of k inputs as `Activations` in `buffer` (grown as needed): the codes, then the
 * scales, takebacks and sums, each 64-byte aligned. Nothing (q NULL) without memory. */
static Activations activations_room(ThreadBuffer *buffer, int64_t m, int64_t k) {
    const int64_t nb = k / QB;
    const size_t code_bytes = ((size_t)(m * k) + 63) / 64 * 64, block_bytes = ((size_t)(m * nb) * 4 + 63) / 64 * 64;
    char *raw = buffer_of_at_least(buffer, code_bytes + 3 * block_bytes + 64);
    if (raw == NULL) return (Activations){NULL, NULL, NULL, NULL};
    char *base = raw + (64 - (uintptr_t)raw % 64) % 64;
    return (Activations){(const int8_t *)base, (const float *)(base + code_bytes),
                         (const int32_t *)(base + code_bytes + block_bytes),
                         (const float *)(base + code_bytes + 2 * block_bytes)};
}

static void quantize_rows(const void *x, int64_t r0, int64_t r1, int64_t k, int dtype, int32_t off,
                          const Activations *a) {
    for (int64_t r = r0; r < r1; r++)
        quantize_row(x, r, k, dtype, off, (int8_t *)a->q, (float *)a->d, (int32_t *)a->c, (float *)a->s);
}

/* The calling thread's groups [g0, g1) of every row, on the vector kernels: 0, or 1 without scratch. */
static int products(const Activations *a, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                    int64_t k, int64_t g0, int64_t g1, int dtype) {
#if HAVE_VNNI
    __m512i *pre = m > TILE_ROWS ? quad_scratch(k / 4 * SET) : NULL;
    if (m > TILE_ROWS && pre == NULL) return 1;
    if (w->format == TANDEM_WEIGHT_Q8)
        part_vnni(a, w, pre, bias, out, m, n, k, g0, g1, TANDEM_WEIGHT_Q8, dtype);
    else if (w->mins != NULL)
        part_vnni(a, w, pre, bias, out, m, n, k, g0, g1, TANDEM_WEIGHT_Q4, dtype);
    else
        part_vnni(a, w, pre, bias, out, m, n, k, g0, g1, FORMAT_Q4_0, dtype);
#else
    for (int64_t r = 0; r < m; r++) row_portable(a, w, bias, out, r, n, k, g0, g1, dtype);
#endif
    return 0;
}

#if HAVE_INT8_TILES
/* products() on AMX-INT8 tiles (m >= 16): the same bits. */
static int products_tiles(const Activations *a, const TandemWeight *w, const void *bias, void *out, int64_t m,
                          int64_t n, int64_t k, int64_t g0, int64_t g1, int dtype) {
    __m512i *quads = quad_scratch(k / 4);
    if (quads == NULL) return 1;
    const TileConfig cfg = int8_tile_config();
    TILE_MEMORY_BARRIER(); /* the configuration's 64 bytes are stored before LDTILECFG reads them */
    _tile_loadconfig(&cfg); /* per thread: the configuration is thread state */
    if (w->format == TANDEM_WEIGHT_Q8)
        part_tiles(a, w, quads, bias, out, m, n, k, g0, g1, TANDEM_WEIGHT_Q8, dtype);
    else if (w->mins != NULL)
        part_tiles(a, w, quads, bias, out, m, n, k, g0, g1, TANDEM_WEIGHT_Q4, dtype);
    else
        part_tiles(a, w, quads, bias, out, m, n, k, g0, g1, FORMAT_Q4_0, dtype);
    _tile_release();
    return 0;
}
#endif

int tandem_linear_int8(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                       int64_t k, int dtype) {
    if (k < 1 || k % QB != 0 || w->scales == NULL || (w->format != TANDEM_WEIGHT_Q4 && w->format != TANDEM_WEIGHT_Q8))
        return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t groups = (n + QG - 1) / QG;
#if HAVE_VNNI
    const int32_t off = vnni_offset(w);
#else
    const int32_t off = w->format == TANDEM_WEIGHT_Q4 && w->mins == NULL ? 8 : 0; /* row_portable's codes */
#endif
    /* Every thread rounds all the rows into its own buffer (a row of 1,536 inputs: about 50 vector
     * operations) up to ALONE_ROWS rows, and whenever each thread has ALONE_GROUPS groups or more, so
     * that rounding every row costs it little against its products; otherwise the rows are split over
     * the team, into the calling thread's buffer, and the threads wait for each other once. At 2
     * threads the split saved no CPU time (each thread writes lines the other holds, then reads the
     * other's rows from its cache: half of 32 rows of 576 inputs took it as long as all of them) and
     * cost a wait, on a loaded VM often for a descheduled partner (docs/PERFORMANCE.md, issue 48).
     * With many threads the split keeps the rounding from growing with the team. The same operations
     * either way: the same codes. */
    const int alone = m <= ALONE_ROWS || groups >= (int64_t)ALONE_GROUPS * team_size();
#if HAVE_INT8_TILES
    /* AMX-INT8 from the descriptor's tile_rows on (the measured choice's; the same bits either way),
     * for calls with a whole tile of rows */
    const int tiles = w->tile_rows > 0 && m >= w->tile_rows && m >= TILE_M && tandem_tiles_available();
#endif
    const Activations shared = alone ? (Activations){NULL, NULL, NULL, NULL} : activations_room(&activation_buffer, m, k);
    if (!alone && shared.q == NULL) return -1;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        Activations a = shared;
        if (alone) {
            a = activations_room(&activation_buffer, m, k); /* this thread's */
            if (a.q != NULL) quantize_rows(x, 0, m, k, dtype, off, &a);
        } else {
            int64_t r0, r1;
            team_share(m, &r0, &r1);
            quantize_rows(x, r0, r1, k, dtype, off, &a);
#pragma omp barrier
        }
        int64_t g0, g1;
        team_share(groups, &g0, &g1);
        if (a.q == NULL)
            failed = 1;
        else if (g0 < g1)
#if HAVE_INT8_TILES
            failed = tiles ? products_tiles(&a, w, bias, out, m, n, k, g0, g1, dtype)
                           : products(&a, w, bias, out, m, n, k, g0, g1, dtype);
#else
            failed = products(&a, w, bias, out, m, n, k, g0, g1, dtype);
#endif
    }
    return failed ? -1 : 0;
}

/* Linear layers over quantized weights (GGUF's Q4_0, Q4_1 and Q8_0 as stored, and what a re-quantized
 * type becomes), and tandem_linear, the one entry that takes any weight (weight.h).
 *
 * Why: a decode step of one sequence reads every weight once and does little else, so its time is the
 * weights' bytes over memory bandwidth. bf16 is 2 bytes a weight; Q4_1 is 0.625 (4 bits, and an fp16
 * scale and offset per 32 inputs), Q8_0 1.0625. The codes are widened in registers, never to memory
 * (SmolLM2 at one sequence: 208 tok/s against 131 for bf16 weights, Zen 5).
 *
 * Values: each weight is computed in fp32 exactly as GGUF's own dequantization computes it (Q4_0:
 * d (q - 8); Q4_1: d q + m, a product then a sum; Q8_0: d q), then, for bf16 inputs, rounded to bf16
 * (VCVTNE2PS2BF16, round to nearest even): the very values of the bf16 checkpoint imported from the
 * same file. On AVX512-BF16 builds the sums are then the packed bf16 kernel's, in its order
 * (linear_packed.c): a quantized linear gives the bits the imported bf16 linear gives, so serving the
 * file quantized changes no token (test_linear_quant.py). Float32 inputs multiply the fp32 values.
 *
 *   up to 4 rows   tiles widen each pair of 16 outputs' codes as they go (the step reads the codes once)
 *   more rows      96 outputs at a time widened once into the packed kernel's layout in L2, then its
 *                  tiles over every row (widening per tile of 4 rows cost 25-45 % at 32 rows)
 *
 * Storage (models/quantized.py writes it): outputs in groups of 16, padded with zeros; per group, per
 * block of 32 inputs, per pair of inputs p, the group's 32 codes in lane order L = 2 c + t (output c,
 * input 2 p + t):
 *   4-bit  16 bytes: byte j holds lane j in its low nibble and lane j + 16 in its high one
 *   8-bit  32 int8, lane by lane
 *   scales (and 4-bit offsets)  [group][block][output c] fp16
 * so that a pair's low and high nibbles are the two halves VCVTNE2PS2BF16 packs into 16 dwords of
 * (w[c][2p], w[c][2p + 1]), the pairs VDPBF16PS multiplies.
 *
 * NOTE: every output's sum runs in one order whatever the number of rows or the tile: pair 0 to the
 * last, in one accumulator, then the bias, then one rounding (the packed kernel's order). Speculative
 * decoding's exactness rests on it (test_linear_quant.py checks rows against rows alone).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "weight.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_QUANT_BF16 1
#else
#define HAVE_QUANT_BF16 0
#endif

#define QB TANDEM_QUANT_BLOCK /* inputs per block: 32 */
#define QP (QB / 2)           /* pairs per block: 16 */
#define QG 16                 /* outputs per group */
#define PACKED_GROUPS 6       /* quantized groups in one of the packed kernel's groups of 96 outputs */

int tandem_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                       int64_t n, int64_t k);

static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2^-24, exact in fp32 */
        float f = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Lane L of pair p of block b of group g: output 16 g + L / 2, input 32 b + 2 p + L % 2. */
static inline float weight_value(const TandemWeight *w, int64_t nb, int64_t g, int64_t b, int64_t p, int lane) {
    const int64_t pair = ((g * nb + b) * QP + p), at = (g * nb + b) * QG + lane / 2;
    const float d = fp16_to_f32(w->scales[at]);
    if (w->format == TANDEM_WEIGHT_Q8) return d * (float)((const int8_t *)w->data)[pair * 2 * QG + lane];
    const uint8_t byte = ((const uint8_t *)w->data)[pair * QG + lane % 16];
    const int q = lane < 16 ? byte & 15 : byte >> 4;
    if (w->mins == NULL) return d * (float)(q - 8);
    return d * (float)q + fp16_to_f32(w->mins[at]);
}

/* The portable kernel (other builds; float32 inputs everywhere): row r against groups [g0, g1), each
 * output the sum of x_i w_i over i in order, in fp32. */
static void row_portable(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t r, int64_t n,
                         int64_t k, int64_t g0, int64_t g1, int dtype) {
    const int64_t nb = k / QB;
    for (int64_t g = g0; g < g1; g++) {
        float acc[QG] = {0};
        for (int64_t b = 0; b < nb; b++)
            for (int64_t p = 0; p < QP; p++)
                for (int t = 0; t < 2; t++) {
                    const int64_t i = r * k + b * QB + 2 * p + t;
                    const float xi = dtype == 1 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
                    for (int c = 0; c < QG; c++) acc[c] = acc[c] + xi * weight_value(w, nb, g, b, p, 2 * c + t);
                }
        for (int c = 0; c < QG && g * QG + c < n; c++) {
            const int64_t f = g * QG + c;
            float v = acc[c];
            if (dtype == 1) {
                if (bias != NULL) v += bf16_to_f32(((const uint16_t *)bias)[f]);
                ((uint16_t *)out)[r * n + f] = f32_to_bf16(v);
            } else {
                if (bias != NULL) v += ((const float *)bias)[f];
                ((float *)out)[r * n + f] = v;
            }
        }
    }
}

#if HAVE_QUANT_BF16

void tandem_packed_group_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                              int64_t n, int64_t k, int64_t col);

/* A block's scales (and offsets) of one group, each repeated for its output's two lanes: [0] lanes
 * 0-15 (outputs 0-7), [1] lanes 16-31 (outputs 8-15). */
typedef struct {
    __m512 d[2], m[2];
} BlockScales;

static inline __attribute__((always_inline)) BlockScales block_scales(const TandemWeight *w, int64_t at,
                                                                      const int FORMAT, const int OFFSET) {
    static const int32_t low[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
    const __m512i lo = _mm512_loadu_si512(low), hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    BlockScales s;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at)));
    s.d[0] = _mm512_permutexvar_ps(lo, d);
    s.d[1] = _mm512_permutexvar_ps(hi, d);
    if (FORMAT == TANDEM_WEIGHT_Q4 && OFFSET) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at)));
        s.m[0] = _mm512_permutexvar_ps(lo, m);
        s.m[1] = _mm512_permutexvar_ps(hi, m);
    } else {
        s.m[0] = s.m[1] = _mm512_setzero_ps();
    }
    return s;
}

/* One pair of a group's 16 outputs: 16 dwords of (w[c][2p], w[c][2p + 1]) in bf16, each weight
 * computed as weight_value computes it and rounded to nearest even. */
static inline __attribute__((always_inline)) __m512i widen(const uint8_t *codes, const BlockScales *s,
                                                           const int FORMAT, const int OFFSET) {
    __m512 a, b;
    if (FORMAT == TANDEM_WEIGHT_Q4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
        __m512i qa = _mm512_and_si512(v, _mm512_set1_epi32(15)), qb = _mm512_srli_epi32(v, 4);
        if (!OFFSET) { /* Q4_0: d (q - 8) */
            qa = _mm512_sub_epi32(qa, _mm512_set1_epi32(8));
            qb = _mm512_sub_epi32(qb, _mm512_set1_epi32(8));
        }
        a = _mm512_mul_ps(_mm512_cvtepi32_ps(qa), s->d[0]);
        b = _mm512_mul_ps(_mm512_cvtepi32_ps(qb), s->d[1]);
        if (OFFSET) { /* Q4_1: the product, then the offset: two roundings, as GGUF computes it */
            a = _mm512_add_ps(a, s->m[0]);
            b = _mm512_add_ps(b, s->m[1]);
        }
    } else {
        a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))), s->d[0]);
        b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)))),
                          s->d[1]);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}

/* Rows [0, MR) (x row stride k) against NB groups from g, widening as they go: the packed kernel's
 * tile, its weights computed instead of loaded. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, const TandemWeight *w,
                                                            const uint16_t *bias, uint16_t *out, int64_t n, int64_t k,
                                                            int64_t g, const int MR, const int NB, const int FORMAT,
                                                            const int OFFSET) {
    const int64_t nb = k / QB, pair_bytes = FORMAT == TANDEM_WEIGHT_Q4 ? QG : 2 * QG;
    const uint8_t *codes = w->data;
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        BlockScales s[6];
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) s[j] = block_scales(w, ((g + j) * nb + b) * QG, FORMAT, OFFSET);
        for (int64_t p = 0; p < QP; p++) {
            __m512i wv[6];
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++)
                wv[j] = widen(codes + (((g + j) * nb + b) * QP + p) * pair_bytes, &s[j], FORMAT, OFFSET);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                uint32_t pr;
                memcpy(&pr, x + i * k + b * QB + 2 * p, sizeof pr);
                const __m512i xp = _mm512_set1_epi32((int)pr);
#pragma GCC unroll 6
                for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xp, (__m512bh)wv[j]);
            }
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

/* Rows [0, MR) against groups [g0, g1): NB groups at a time, then one by one. */
static inline __attribute__((always_inline)) void few_rows(const uint16_t *x, const TandemWeight *w,
                                                           const uint16_t *bias, uint16_t *out, int64_t n, int64_t k,
                                                           int64_t g0, int64_t g1, const int MR, const int NB,
                                                           const int FORMAT, const int OFFSET) {
    int64_t g = g0;
    for (; g + NB <= g1; g += NB) tile_bf16(x, w, bias, out, n, k, g, MR, NB, FORMAT, OFFSET);
    for (; g < g1; g++) tile_bf16(x, w, bias, out, n, k, g, MR, 1, FORMAT, OFFSET);
}

/* packed = quantized groups [g, g + 6) (those below `groups`; zeros for the rest) in the packed
 * kernel's layout: for each pair p, 96 dwords of (w[c][2p], w[c][2p + 1]). */
static inline __attribute__((always_inline)) void widen_packed(uint16_t *packed, const TandemWeight *w, int64_t k,
                                                               int64_t g, int64_t groups, const int FORMAT,
                                                               const int OFFSET) {
    const int64_t nb = k / QB, pair_bytes = FORMAT == TANDEM_WEIGHT_Q4 ? QG : 2 * QG;
    const uint8_t *codes = w->data;
    for (int j = 0; j < PACKED_GROUPS; j++) {
        if (g + j >= groups) {
            for (int64_t p = 0; p < k / 2; p++)
                _mm512_storeu_si512(packed + (p * PACKED_GROUPS + j) * 2 * QG, _mm512_setzero_si512());
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const BlockScales s = block_scales(w, ((g + j) * nb + b) * QG, FORMAT, OFFSET);
            for (int64_t p = 0; p < QP; p++)
                _mm512_storeu_si512(packed + ((b * QP + p) * PACKED_GROUPS + j) * 2 * QG,
                                    widen(codes + (((g + j) * nb + b) * QP + p) * pair_bytes, &s, FORMAT, OFFSET));
        }
    }
}

/* One thread's share: up to 4 rows over groups [g0, g1) widening as they go; more rows over the
 * packed groups of 96 outputs [s0, s1), each widened once into `packed`. */
static void part_bf16(const uint16_t *x, const TandemWeight *w, const uint16_t *bias, uint16_t *out, int64_t m,
                      int64_t n, int64_t k, int64_t g0, int64_t g1, uint16_t *packed, const int FORMAT,
                      const int OFFSET) {
    if (m > 4) {
        const int64_t groups = (n + QG - 1) / QG;
        for (int64_t s = g0; s < g1; s += PACKED_GROUPS) {
            widen_packed(packed, w, k, s, groups, FORMAT, OFFSET);
            tandem_packed_group_rows(x, packed, bias, out, m, n, k, s * QG);
        }
        return;
    }
    switch (m) {
    case 1: few_rows(x, w, bias, out, n, k, g0, g1, 1, 6, FORMAT, OFFSET); break;
    case 2: few_rows(x, w, bias, out, n, k, g0, g1, 2, 3, FORMAT, OFFSET); break;
    case 3: few_rows(x, w, bias, out, n, k, g0, g1, 3, 3, FORMAT, OFFSET); break;
    case 4: few_rows(x, w, bias, out, n, k, g0, g1, 4, 3, FORMAT, OFFSET); break;
    default: break;
    }
}

/* Per-thread scratch for one packed group (k / 2 pairs x 96 dwords), 64-byte aligned; grows, kept. */
static __thread uint16_t *packed_scratch = NULL;
static __thread size_t packed_scratch_bytes = 0;

static uint16_t *packed_for(size_t bytes) {
    if (bytes > packed_scratch_bytes) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, bytes) != 0) return NULL;
        free(packed_scratch);
        packed_scratch = grown;
        packed_scratch_bytes = bytes;
    }
    return packed_scratch;
}

#endif

/* The quantized linear: output groups split over the threads (in whole packed groups past 4 rows). */
static int linear_quant(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                        int64_t k, int dtype) {
    if (k % QB != 0 || w->scales == NULL) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t groups = (n + QG - 1) / QG;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        int threads = 1, me = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
#if HAVE_QUANT_BF16
        if (dtype == 1) {
            const int64_t unit = m > 4 ? PACKED_GROUPS : 1, units = (groups + unit - 1) / unit;
            const int64_t g0 = unit * (units * me / threads), g1_units = unit * (units * (me + 1) / threads);
            const int64_t g1 = g1_units < groups ? g1_units : groups;
            uint16_t *packed = m > 4 ? packed_for((size_t)(k / 2 * PACKED_GROUPS * QG * 2 * 2)) : NULL;
            if (m > 4 && packed == NULL) {
                failed = 1;
            } else if (g0 < g1) {
                const uint16_t *xb = x, *bb = bias;
                uint16_t *ob = out;
                if (w->format == TANDEM_WEIGHT_Q8)
                    part_bf16(xb, w, bb, ob, m, n, k, g0, g1, packed, TANDEM_WEIGHT_Q8, 0);
                else if (w->mins != NULL)
                    part_bf16(xb, w, bb, ob, m, n, k, g0, g1, packed, TANDEM_WEIGHT_Q4, 1);
                else
                    part_bf16(xb, w, bb, ob, m, n, k, g0, g1, packed, TANDEM_WEIGHT_Q4, 0);
            }
        } else
#endif
        {
            const int64_t g0 = groups * me / threads, g1 = groups * (me + 1) / threads;
            for (int64_t r = 0; r < m && g0 < g1; r++) row_portable(x, w, bias, out, r, n, k, g0, g1, dtype);
        }
    }
    return failed ? -1 : 0;
}

int tandem_linear(const void *x, const TandemWeight *w, const void *bias, void *out, int64_t m, int64_t n,
                  int64_t k, int dtype) {
    if (w == NULL || m < 0 || n < 0 || k < 1 || w->n != n || w->k != k || (dtype != 0 && dtype != 1)) return -1;
    if (w->format == TANDEM_WEIGHT_BF16)
        return dtype == 1 ? tandem_linear_bf16(x, w->data, bias, out, m, n, k) : -1;
    if (w->format == TANDEM_WEIGHT_Q4 || w->format == TANDEM_WEIGHT_Q8) return linear_quant(x, w, bias, out, m, n, k, dtype);
    return -1;
}

/* bf16 linear layers on CPUs with AVX512-BF16 (Zen 4 and 5, Cooper Lake, Sapphire Rapids and later):
 * the weights repacked once, at bind time, for the VDPBF16PS dot-product instruction. Called by
 * linear.c's tandem_linear_bf16 on the builds that have the instruction (the avx512bf16 level), so
 * layer.c's fused layers and decode stack use it as they use the AVX2 kernel elsewhere.
 *
 * Why: the AVX2 kernel widens every bf16 weight to fp32 and does 8 multiply-adds an instruction;
 * VDPBF16PS multiplies bf16 pairs directly, 32 multiply-adds an instruction, with fp32 accumulation.
 * A decode step still streams the weights at memory speed; a prefill runs about 4x more arithmetic a
 * cycle. oneDNN has a bf16 path on these CPUs too, but its sums are ordered by the row count (below).
 *
 * Packed layout: the [n, k] weight as groups of 96 output features (6 vectors of 16); within a
 * group, for each pair of input features p, 96 dwords (one per feature) each holding w[f][2p] (low
 * half) and w[f][2p + 1] (high half): packed[((g * kp + p) * 96 + c) * 2 + t] = w[96 g + c][2 p + t],
 * zero past n or k (kp = ceil(k / 2)). Six 64-byte loads, one after another in memory, give a group's
 * 96 features at one pair, and a broadcast of x's pair (x[2p], x[2p + 1]) multiplies all of them:
 * each output feature is one lane of one accumulator, so nothing is reduced across lanes, no input is
 * widened, and a tile reads its weights as one sequential stream.
 *
 * NOTE: every output's sum runs in one order whatever the number of rows or the tile: its lane of one
 * accumulator, pair 0 first, pair kp - 1 last, then the bias, then one rounding to bf16. A row's result
 * does not depend on the rows beside it, which speculative decoding's exactness and the prefix
 * cache's sameness rest on (test_linear.py checks rows against rows alone). A faster tile must keep
 * that order: more accumulators means more features or more rows at once, never a split k.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "team.h"


#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_PACKED_BF16 1
#else
#define HAVE_PACKED_BF16 0
#endif

#define LANES 16            /* output features per vector */
#define NB 6                /* vectors per group */
#define GROUP (NB * LANES)  /* output features per group: 96 */
#define PREFETCH_AHEAD 1536 /* bytes ahead a streaming tile prefetches (group_rows) */

/* Whether this build's tandem_linear_bf16 takes packed weights: GROUP, the group width, or 0 (the
 * [n, k] layout as stored). The Python side packs each weight once with tandem_pack_bf16 when not 0. */
int tandem_weight_layout(void) { return HAVE_PACKED_BF16 ? GROUP : 0; }

/* Elements of the packed copy of an [n, k] weight (the padding included). */
int64_t tandem_packed_elements(int64_t n, int64_t k) {
    if (n < 1 || k < 1) return -1;
    return (n + GROUP - 1) / GROUP * GROUP * ((k + 1) / 2 * 2);
}

/* packed = the [n, k] weight w in the layout above; the same on every build (tests pack anywhere). */
int tandem_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    if (n < 1 || k < 1) return -1;
    const int64_t groups = (n + GROUP - 1) / GROUP, kp = (k + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t p = 0; p < kp; p++)
            for (int c = 0; c < GROUP; c++)
                for (int t = 0; t < 2; t++) {
                    const int64_t f = g * GROUP + c, i = 2 * p + t;
                    packed[((g * kp + p) * GROUP + c) * 2 + t] = f < n && i < k ? w[f * k + i] : 0;
                }
    return 0;
}

#if HAVE_PACKED_BF16

/* Tiles: MR rows (1-4) x one group, MR * 6 accumulators of AVX-512's 32 registers, 6 more for the
 * weights and one for the broadcast pair. At 4 rows a pair costs 6 weight loads and 4 broadcasts for
 * 24 dot products: the arithmetic, not the loads, sets the pace. At one row (a decode step of one
 * sequence) six independent sums keep enough loads in flight to stream the weights. */

/* x's pair p of one row as a dword, broadcast: (x[2p], x[2p + 1]). */
static inline __attribute__((always_inline)) __m512i pair(const uint16_t *x, int64_t p) {
    uint32_t v;
    memcpy(&v, x + 2 * p, sizeof v);
    return _mm512_set1_epi32((int)v);
}

/* out[i, col + c] for rows i < MR (row strides k for x, n for out) and the group at `wp` (c < 96, the
 * features past n not stored). With STREAM, the tile prefetches its own weights PREFETCH_AHEAD bytes
 * on; else the lines [pf, pf + 64 pf_lines), pf_per of them a pair (group_rows says why). */
static inline __attribute__((always_inline)) void tile(const uint16_t *restrict x, const uint16_t *restrict wp,
                                                       int64_t k, const uint16_t *bias, uint16_t *out,
                                                       int64_t col, int64_t n, const int MR, const int STREAM,
                                                       const char *pf, int64_t pf_lines, int64_t pf_per) {
    __m512 acc[4][NB];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t whole = k / 2; /* pairs with both elements in x */
    const uint16_t *w = wp;
    for (int64_t p = 0; p < whole; p++, w += 2 * GROUP) {
        __m512i wv[NB];
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_si512(w + j * 2 * LANES);
        if (STREAM)
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++) _mm_prefetch((const char *)w + PREFETCH_AHEAD + j * 64, _MM_HINT_T1);
        else if (p * pf_per < pf_lines)
            for (int64_t j = 0; j < pf_per; j++) _mm_prefetch(pf + (p * pf_per + j) * 64, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m512i xp = pair(x + i * k, p);
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xp, (__m512bh)wv[j]);
        }
    }
    if (k % 2 != 0) { /* the last element of an odd k, paired with the packed zero */
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m512i xp = _mm512_set1_epi32((int)x[i * k + k - 1]);
#pragma GCC unroll 6
            for (int j = 0; j < NB; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xp,
                                             (__m512bh)_mm512_loadu_si512(w + j * 2 * LANES));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 6
        for (int j = 0; j < NB; j++) {
            const int64_t c = col + j * LANES;
            if (c < n)
                store16_bias_bf16(out + i * n + c, acc[i][j], bias != NULL ? bias + c : NULL,
                                  n - c >= LANES ? LANES : (int)(n - c));
        }
}

/* Every row of x against one packed group w (features col to col + 95, those below n), four rows at
 * a time, prefetching the group at `next` (NULL: none) into L2.
 *
 * Prefetches go into L2 (prefetcht1): into L1 they held the fill buffers the tiles' own loads need,
 * and were slower than none. A step of 1-3 rows (one tile per group) streams the weights: its tile
 * prefetches what it reads PREFETCH_AHEAD bytes on (the next group follows in memory, in the packing
 * and in the arena): a one-row step of SmolLM2's linears 8.0 against 9.6 ms. From 8 rows the group
 * is read from memory by the first 4-row tile and from L2 by the others, and that first tile waited
 * on memory: now every tile fetches its share of the next group, at most 2 lines a pair, so the
 * whole group is in L2 when its turn comes: 12 rows 13.9 -> 10.8 ms, 16 rows 15.7 -> 13.1, 32 rows
 * 25.3 -> 22.1, 64 rows 43.9 -> 42.7. With one 4-row tile (4-7 rows) either prefetch cost 4-40 %.
 * (Zen 4, one process, interleaved.) */
static void group_rows(const uint16_t *x, const uint16_t *w, const char *next, const uint16_t *bias, uint16_t *out,
                       int64_t m, int64_t n, int64_t k, int64_t col) {
    switch (m) {
    case 1: tile(x, w, k, bias, out, col, n, 1, 1, NULL, 0, 0); return;
    case 2: tile(x, w, k, bias, out, col, n, 2, 1, NULL, 0, 0); return;
    case 3: tile(x, w, k, bias, out, col, n, 3, 1, NULL, 0, 0); return;
    default: break;
    }
    const int64_t whole = m - m % 4, tiles = whole / 4, pairs = k / 2 > 0 ? k / 2 : 1;
    const int64_t lines = next != NULL && tiles >= 2 ? (k + 1) / 2 * 2 * GROUP * 2 / 64 : 0; /* the next group's */
    const int64_t share = (lines + tiles - 1) / tiles, per_pair = (share + pairs - 1) / pairs;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * share, count = lines - first < share ? lines - first : share;
        tile(x + 4 * t * k, w, k, bias, out + 4 * t * n, col, n, 4, 0, next + 64 * first, count > 0 ? count : 0,
             per_pair < 2 ? per_pair : 2);
    }
    const uint16_t *xs = x + whole * k;
    uint16_t *o = out + whole * n;
    switch (m - whole) {
    case 1: tile(xs, w, k, bias, o, col, n, 1, 0, NULL, 0, 0); break;
    case 2: tile(xs, w, k, bias, o, col, n, 2, 0, NULL, 0, 0); break;
    case 3: tile(xs, w, k, bias, o, col, n, 3, 0, NULL, 0, 0); break;
    default: break;
    }
}

/* Every row of x against one packed group w: linear_quant.c's, over a group it dequantized (in its
 * scratch, already in cache: nothing to prefetch). */
void tandem_packed_group_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                              int64_t n, int64_t k, int64_t col) {
    group_rows(x, w, NULL, bias, out, m, n, k, col);
}

/* One thread's groups [g_begin, g_end) against all m rows: group by group (its weights, 110-300 KB,
 * read from memory once and kept in L2), every row over each group. */
static void thread_part(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int64_t m,
                        int64_t n, int64_t k, int64_t g_begin, int64_t g_end) {
    const int64_t group_elements = (k + 1) / 2 * 2 * GROUP;
    for (int64_t g = g_begin; g < g_end; g++) {
        const uint16_t *group = wp + g * group_elements;
        group_rows(x, group, g + 1 < g_end ? (const char *)(group + group_elements) : NULL, bias, out, m, n, k,
                   g * GROUP);
    }
}

/* out [m, n] bf16 = x [m, k] bf16 @ w [n, k]^T (+ bias [n]), w packed by tandem_pack_bf16. */
int tandem_linear_packed_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                              int64_t m, int64_t n, int64_t k) {
    if (m < 0 || n < 0 || k < 1) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t groups = (n + GROUP - 1) / GROUP;
#pragma omp parallel
    {
        int64_t g_begin, g_end;
        team_share(groups, &g_begin, &g_end);
        if (g_begin < g_end) thread_part(x, wp, bias, out, m, n, k, g_begin, g_end);
    }
    return 0;
}

#else

int tandem_linear_packed_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                              int64_t m, int64_t n, int64_t k) {
    (void)x, (void)wp, (void)bias, (void)out, (void)m, (void)n, (void)k;
    return -1; /* not this build: tandem_weight_layout() says 0 and tandem_linear_bf16 takes [n, k] */
}

#endif

/* float32 linear layers: out[m, n] = x[m, k] . w[n, k] (+ bias[n]), all float32, w as nn.Linear stores it.
 *
 * Why: torch's float32 linear (MKL's SGEMM) blocks a row's sums by the call's row count, so a row among
 * 1, 2, 3 or 5 rows gets other last bits than alone, and a speculative verification (1 + n rows) or a
 * batched decode row differs from a plain one-row step. This kernel keeps one order per output, and on
 * SmolLM2's shapes it is faster than MKL (a step's linears 2.5x at one row, 1.7x at 32, Zen 4, 2 threads)
 * and within 7 % of it on a 512-row prefill chunk (docs/PERFORMANCE.md), so it serves every call.
 *
 * NOTE: every output's sum runs in one order whatever the number of rows or the tile that computes it:
 * VL lanes (16 on AVX-512 builds, 8 elsewhere), lane l summing x[i] w[i] for i = l, l + VL, ... with
 * one FMA each, over the whole chunks of k in order; then the lanes added in a fixed tree (sum_lanes);
 * then the elements past the last whole chunk, one by one; then the bias. A row's result therefore does
 * not depend on the rows beside it, and speculative decoding's verification gives each row the bits a
 * one-row step would (tests/backends/cpu/test_linear_f32.py checks rows against rows alone). Builds of
 * different levels may differ from each other in the last bit (their lane counts differ).
 *
 * Layout of the work, as linear.c's: threads split the output features in whole blocks of NB weight
 * rows; each walks its features block by block and, for each, every group of MR input rows in tiles of
 * NR weight rows (the block stays in L2 while the rows go over it). The micro-kernel keeps MR x NR
 * accumulators in registers (dot-product form: the weight is read as stored, never repacked).
 */
#include <stddef.h>
#include <stdint.h>

#include "team.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
/* The 4 x NR tile's NR: 4 x 6 accumulators, 6 weight vectors and an input one of AVX-512's 32. */
#define NR4 6
static inline __attribute__((always_inline)) float sum_lanes(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define NR4 3 /* 4 x 3 accumulators of AVX2's 16 registers */
static inline __attribute__((always_inline)) float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
/* Portable: 8 lanes as plain floats (the compiler vectorizes them), a multiply and an add each (two
 * roundings: a target without FMA would call libm's software fmaf), added in AVX2's tree. */
#define VL 8
typedef struct {
    float l[8];
} vec;
static inline __attribute__((always_inline)) vec VZERO(void) {
    vec v = {{0}};
    return v;
}
static inline __attribute__((always_inline)) vec VLOAD(const float *p) {
    vec v;
    for (int i = 0; i < 8; i++) v.l[i] = p[i];
    return v;
}
static inline __attribute__((always_inline)) vec VFMA(vec a, vec b, vec c) {
    for (int i = 0; i < 8; i++) c.l[i] += a.l[i] * b.l[i];
    return c;
}
#define NR4 3
static inline __attribute__((always_inline)) float sum_lanes(vec v) {
    float s[4];
    for (int i = 0; i < 4; i++) s[i] = v.l[i] + v.l[i + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}
#endif

#define MAX_MR 4
#define MAX_NR 8
/* Weight rows per pass over the input rows: a multiple of every tile's NR (3, 4, 6, 8), and small
 * enough (24 x 1536 floats: 144 KiB) to stay in L2 while every input row goes over it. */
#define NB 24
/* Input rows per pass over the weights: their floats within this many bytes (in L2). */
#define BLOCK_BYTES (192 * 1024)
#define MIN_BLOCK 64

/* out[i][j] = x[i, :] . w[j, :] (+ bias[j]) for MR rows of x (row stride k) and NR rows of w (row
 * stride k), in the NOTE's order. MR and NR are constants at every call site, so the loops unroll and
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(float *out, int64_t ldo, const float *restrict x,
                                                       const float *restrict w, const float *bias, int64_t k,
                                                       const int MR, const int NR) {
    vec acc[MAX_MR][MAX_NR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) acc[i][j] = VZERO();
    const int64_t whole = k - k % VL;
    /* The next tile's weights (the NR rows after these, contiguous) prefetched into L2 while this one
     * computes, as linear.c's tiles do: NR * VL floats a chunk covers them by the tile's end. A
     * prefetch past the end of w never faults. SmolLM2's float32 linears on one thread (Zen 4, the
     * avx512 build): a step's 121 calls at 1 row 34.9 -> 29.0 ms, 5 rows 51.8 -> 39.7, 32 rows
     * 245 -> 210 (best of 15, interleaved, a loaded machine); prefetching into L1 gained nothing. */
    const char *next_tile = (const char *)(w + NR * k);
    for (int64_t at = 0; at < whole; at += VL) {
        vec wv[MAX_NR];
#pragma GCC unroll 8
        for (int j = 0; j < (NR * VL * 4 + 63) / 64; j++) __builtin_prefetch(next_tile + at * NR * 4 + j * 64, 0, 2);
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) wv[j] = VLOAD(w + j * k + at);
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const vec xv = VLOAD(x + i * k + at);
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = sum_lanes(acc[i][j]);
            for (int64_t at = whole; at < k; at++) s += x[i * k + at] * w[j * k + at];
            out[i * ldo + j] = bias != NULL ? s + bias[j] : s;
        }
}

/* Rows [0, MR) of x against weight rows [n0, n1), NR at a time, the last few one at a time. */
#define ROWS(MR, NR)                                                                                          \
    do {                                                                                                      \
        int64_t n = n0;                                                                                       \
        for (; n + (NR) <= n1; n += (NR))                                                                     \
            tile(o + n, n_out, xs, w + n * k, bias != NULL ? bias + n : NULL, k, MR, NR);                     \
        for (; n < n1; n++) tile(o + n, n_out, xs, w + n * k, bias != NULL ? bias + n : NULL, k, MR, 1);      \
    } while (0)

/* One thread's weight rows [n_begin, n_end) against `rows` input rows at x: each block of NB weight
 * rows read from memory once, every input row multiplied with it while it is in cache. */
static void block_rows(const float *x, int64_t rows, const float *w, const float *bias, float *out,
                       int64_t n_out, int64_t k, int64_t n_begin, int64_t n_end) {
    const int64_t whole = rows - rows % MAX_MR;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += NB) {
        const int64_t n1 = n0 + NB <= n_end ? n0 + NB : n_end;
        for (int64_t m = 0; m < whole; m += MAX_MR) {
            const float *xs = x + m * k;
            float *o = out + m * n_out;
            ROWS(4, NR4);
        }
        /* The last 1-3 rows (all of them in a decode step of 1-3 sequences): more weight rows per tile. */
        const float *xs = x + whole * k;
        float *o = out + whole * n_out;
        switch (rows - whole) {
        case 1: ROWS(1, 8); break;
        case 2: ROWS(2, 6); break;
        case 3: ROWS(3, 4); break;
        default: break;
        }
    }
}

/* out [m, n] float32 = x [m, k] @ w [n, k]^T (+ bias [n], or NULL), all float32 and contiguous.
 * Returns 0, or -1 for a bad size (nothing written then). */
int tandem_linear_f32(const float *x, const float *w, const float *bias, float *out, int64_t m, int64_t n,
                      int64_t k) {
    if (m < 0 || n < 0 || k < 1) return -1;
    if (m == 0 || n == 0) return 0;
    int64_t block = BLOCK_BYTES / (k * (int64_t)sizeof(float));
    /* At least MIN_BLOCK rows a pass: at k >= 8192 the bytes alone gave 4 rows, and every 4 rows read
     * the whole weight from memory again (2048x8192 at 512 rows: 445 ms, MKL 207; 234 ms at 64 rows).
     * A row's sum order is the tile's, whatever the block: the same bits. */
    block = block < MIN_BLOCK ? MIN_BLOCK : block - block % MAX_MR;
#pragma omp parallel
    {
        /* Output features split evenly, in whole blocks of NB (whole tiles of every NR); only the last
         * thread's share can reach past n. */
        int64_t first, last;
        team_share((n + NB - 1) / NB, &first, &last);
        const int64_t n_begin = NB * first;
        const int64_t n_end = NB * last < n ? NB * last : n;
        for (int64_t m0 = 0; m0 < m && n_begin < n_end; m0 += block) {
            const int64_t rows = m - m0 < block ? m - m0 : block;
            block_rows(x + m0 * k, rows, w, bias, out + m0 * n, n, k, n_begin, n_end);
        }
    }
    return 0;
}

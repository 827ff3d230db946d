/* bf16 linear layers on CPUs where oneDNN has no bf16 path (AVX2 without AVX-512): called through
 * ctypes by backends/cpu/linear.py, compiled into the same library as attention.c.
 *
 * Why: on such a CPU torch's bf16 matmul falls back to a reference loop (0.3 GFLOP/s for a 1024^3
 * product here, against 17 in fp32 under the same load), and every linear layer, LM head included,
 * goes through it. This kernel reads each bf16 weight once per block of rows, widens it to fp32 in
 * registers (a shift: bf16 is the top half of a float) and accumulates in fp32 with FMAs, so a decode
 * step streams the weights at memory speed and a prefill runs at the FMA units' speed.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), rounded once to bf16, as torch's bf16 linear does
 * (fp32 accumulation, one rounding); the order of the fp32 sums differs, so results may differ in the
 * last bf16 bit. w is the nn.Linear layout [out_features, in_features], used as stored.
 *
 * Layout of the work: threads split the output features; each thread walks its features in blocks of
 * NB weight rows, and for each block every group of MR input rows in tiles of NR weight rows (the
 * block's weights are read from memory once and stay in cache while the rows go over them), the
 * next tile's weights prefetched while one computes. Inputs are widened to fp32 once per block of
 * rows that fits in L2, into a per-thread buffer. The micro-kernel keeps MR x NR accumulators of 8
 * lanes each in registers and reduces the lanes at the end (dot-product form: no repacked weights).
 *
 * NOTE: every output's sums run in one order whatever the number of rows or the tile that computes
 * it (8 lanes over the chunks, then the same lane reduction), so a row's result does not depend on
 * the rows beside it. Speculative decoding relies on that: a verification step of k + 1 rows gives
 * each row the bits a one-row step would, so greedy tokens are the same with and without it. A
 * faster tile must keep that order (services/decoder/tests/backends/cpu/test_linear.py checks rows against rows alone).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* Rows of x widened to fp32 at a time: their fp32 copy stays within this many bytes (in L2). */
#define BLOCK_BYTES (192 * 1024)
#define MAX_MR 4
/* Rows of the largest tile (6 x 2): the sums arrays' size. */
#define MAX_TILE_ROWS 6

/* Per-thread scratch for widened rows; grows to the largest block seen, kept for the next call. */
static __thread ThreadBuffer scratch;

static float *scratch_for(size_t floats) { return buffer_of_at_least(&scratch, floats * sizeof(float)); }

#if HAVE_AVX2
static inline __attribute__((always_inline)) float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Weights are read 16 at a time as 8 32-bit lanes, each holding an even element (low half) and the
 * next odd one (high half): a shift left by 16 makes the even ones floats, a shift right then left
 * the odd ones. The widened inputs are stored in the matching order (widen_rows), so no lane is
 * ever shuffled. */
#define CHUNK 16

/* sums[i][j] = x[i, :] . w[j, :] for MR rows of widened x (row stride ldx) and NR rows of w (bf16, row
 * stride k). MR and NR are constants at every call site, so the loops unroll and the accumulators stay
 * in registers (MR * NR <= 12 of AVX2's 16). */
static inline __attribute__((always_inline)) void tile(float sums[MAX_TILE_ROWS][8], const float *restrict x,
                                                       int64_t ldx, const uint16_t *restrict w, int64_t k,
                                                       const int MR, const int NR) {
    int64_t at = 0;
#if HAVE_AVX2
    __m256 acc[MAX_MR][8];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    /* Prefetch the next tile's weights (the NR rows after these, contiguous) while this one computes:
     * NR / 2 cache lines per chunk covers them by the tile's end. Without it a core leaves the memory
     * idle between its demand misses; a block of 4-8 rows, which computes longer per weight, then hides
     * the whole read (docs/PERFORMANCE-HISTORY.md has the measurements). A prefetch past the
     * end of w is harmless: it never faults. Into L2 (prefetcht1), as attention_tiles.c's: into L1 the
     * prefetches held the fill buffers the tile's own loads need (this build on a Zen 4: a one-row
     * step of SmolLM2's linears 15.0-15.6 -> 12.2-13.8 ms, two rows 16.1-16.3 -> 13.5-14.1, more rows
     * within noise; not measured on an AVX2-only CPU). */
    const char *next_tile = (const char *)(w + NR * k);
    for (; at + CHUNK <= k; at += CHUNK) {
        __m256 wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < (NR + 1) / 2; j++) _mm_prefetch(next_tile + at * NR * 2 + j * 64, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++)
            wv[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(w + j * k + at)), 16));
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + at);
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
        /* The odd elements: each lane's high half, its low half cleared by two shifts rather than a
         * mask, which would hold a register the 4 x 3 tile needs. */
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++)
            wv[j] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(w + j * k + at)), 16), 16));
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + at + 8);
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) sums[i][j] = sum_lanes(acc[i][j]);
#else
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) sums[i][j] = 0.0f;
#endif
    for (; at < k; at++) /* the tail past a multiple of CHUNK, and everything without AVX2 */
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) sums[i][j] += x[i * ldx + at] * bf16_to_f32(w[j * k + at]);
}

#if HAVE_AVX2 && defined(__x86_64__)
#define HAVE_TILE_4X3_ASM 1
/* What both written-out tiles share: their 12 accumulators (ymm0-11) zeroed before the loop and
 * stored to acc after it, every vector register clobbered, and the lane sums and k-tail after. */
#define ZERO_ACC12                                                                                            \
    "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"                                                                       \
    "vmovaps %%ymm0, %%ymm1\n\tvmovaps %%ymm0, %%ymm2\n\tvmovaps %%ymm0, %%ymm3\n\t"                         \
    "vmovaps %%ymm0, %%ymm4\n\tvmovaps %%ymm0, %%ymm5\n\tvmovaps %%ymm0, %%ymm6\n\t"                         \
    "vmovaps %%ymm0, %%ymm7\n\tvmovaps %%ymm0, %%ymm8\n\tvmovaps %%ymm0, %%ymm9\n\t"                         \
    "vmovaps %%ymm0, %%ymm10\n\tvmovaps %%ymm0, %%ymm11\n\t"
#define STORE_ACC12                                                                                           \
    "vmovups %%ymm0, (%[acc])\n\tvmovups %%ymm1, 32(%[acc])\n\tvmovups %%ymm2, 64(%[acc])\n\t"               \
    "vmovups %%ymm3, 96(%[acc])\n\tvmovups %%ymm4, 128(%[acc])\n\tvmovups %%ymm5, 160(%[acc])\n\t"           \
    "vmovups %%ymm6, 192(%[acc])\n\tvmovups %%ymm7, 224(%[acc])\n\tvmovups %%ymm8, 256(%[acc])\n\t"          \
    "vmovups %%ymm9, 288(%[acc])\n\tvmovups %%ymm10, 320(%[acc])\n\tvmovups %%ymm11, 352(%[acc])\n\t"
#define ALL_YMM_CLOBBERED                                                                                     \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
        "xmm13", "xmm14", "xmm15", "cc", "memory"

/* sums[i][j] from an MR x NR tile's accumulators acc[NR * i + j] (unset, and the sums zero, when k
 * has no whole CHUNK), then the elements past the last whole CHUNK, as tile() adds them. */
static inline __attribute__((always_inline)) void finish_tile(float sums[MAX_TILE_ROWS][8], float acc[12][8],
                                                              const float *const rows[], const uint16_t *w,
                                                              int64_t k, const int MR, const int NR) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) sums[i][j] = k >= CHUNK ? sum_lanes(_mm256_loadu_ps(acc[NR * i + j])) : 0.0f;
    for (int64_t at = k - k % CHUNK; at < k; at++)
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) sums[i][j] += rows[i][at] * bf16_to_f32(w[j * k + at]);
}

/* Pieces of tile_4x3's loop: three weight rows widened into ymm12-14 (even elements, then odd
 * ones), and one input row's vector in ymm15 against them into three accumulators. */
#define WIDEN_EVEN(REG, W) "vmovdqu (%[" W "],%[at],2), %%" REG "\n\tvpslld $16, %%" REG ", %%" REG "\n\t"
#define WIDEN_ODD(REG, W)                                                                                     \
    "vmovdqu (%[" W "],%[at],2), %%" REG "\n\tvpsrld $16, %%" REG ", %%" REG "\n\tvpslld $16, %%" REG         \
    ", %%" REG "\n\t"
#define ROW_FMAS(OFFSET, X, A0, A1, A2)                                                                       \
    "vmovups " OFFSET "(%[" X "],%[at],4), %%ymm15\n\t"                                                       \
    "vfmadd231ps %%ymm12, %%ymm15, %%" A0 "\n\t"                                                              \
    "vfmadd231ps %%ymm13, %%ymm15, %%" A1 "\n\t"                                                              \
    "vfmadd231ps %%ymm14, %%ymm15, %%" A2 "\n\t"

/* The 4 x 3 tile (verification steps of 4-9 rows, prefill) written out: 12 accumulators in
 * ymm0-11, 3 widened weight vectors and one input vector, all 16 registers, each input vector
 * loaded once for its 3 FMAs. Compiled from tile(), GCC folds an input load into every FMA (30
 * loads for 24 FMAs a chunk, against 14 here) and spills. The same sums in the same order as tile(),
 * so the same bits. */
static inline __attribute__((always_inline)) void tile_4x3(float sums[MAX_TILE_ROWS][8], const float *restrict x,
                                                           int64_t ldx, const uint16_t *restrict w, int64_t k) {
    float acc[12][8]; /* ymm0-11 stored by the loop, then summed lane by lane as in tile() */
    const int64_t chunks = k / CHUNK;
    if (chunks > 0) {
        const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
        const uint16_t *w0 = w, *w1 = w + k, *w2 = w + 2 * k;
        const char *next_tile = (const char *)(w + 3 * k); /* prefetched as tile() does: 96 bytes a chunk */
        int64_t at = 0, left = chunks;
        __asm__ volatile(
            ZERO_ACC12
            "1:\n\t"
            "prefetcht1 (%[pf])\n\t"
            "prefetcht1 64(%[pf])\n\t"
            WIDEN_EVEN("ymm12", "w0") WIDEN_EVEN("ymm13", "w1") WIDEN_EVEN("ymm14", "w2")
            ROW_FMAS("", "x0", "ymm0", "ymm1", "ymm2")
            ROW_FMAS("", "x1", "ymm3", "ymm4", "ymm5")
            ROW_FMAS("", "x2", "ymm6", "ymm7", "ymm8")
            ROW_FMAS("", "x3", "ymm9", "ymm10", "ymm11")
            WIDEN_ODD("ymm12", "w0") WIDEN_ODD("ymm13", "w1") WIDEN_ODD("ymm14", "w2")
            ROW_FMAS("32", "x0", "ymm0", "ymm1", "ymm2")
            ROW_FMAS("32", "x1", "ymm3", "ymm4", "ymm5")
            ROW_FMAS("32", "x2", "ymm6", "ymm7", "ymm8")
            ROW_FMAS("32", "x3", "ymm9", "ymm10", "ymm11")
            "add $96, %[pf]\n\t"
            "add $16, %[at]\n\t"
            "dec %[left]\n\t"
            "jnz 1b\n\t"
            STORE_ACC12
            : [at] "+r"(at), [left] "+r"(left), [pf] "+r"(next_tile)
            : [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [w0] "r"(w0), [w1] "r"(w1), [w2] "r"(w2),
              [acc] "r"(acc)
            : ALL_YMM_CLOBBERED);
    }
    const float *const rows[4] = {x, x + ldx, x + 2 * ldx, x + 3 * ldx};
    finish_tile(sums, acc, rows, w, k, 4, 3);
}

/* The 6 x 2 tile (steps of 5 or 6 rows: a verification step of k = 4 or 5, or 5-6 sequences): all
 * the rows in one pass over the weights, where 4 x 3 tiles and a 1-2 row tile read them twice, the
 * second time compute-bound. 12
 * accumulators in ymm0-11, two widened weight vectors in ymm12-13, an input vector in ymm14, and in
 * ymm15 the mask that keeps each lane's odd element (one AND instead of tile_4x3's two shifts: this
 * tile has a register to spare). The same sums in the same order as tile(), so the same bits. Prefill
 * keeps 4 x 3, which is as fast there. */
#define EVEN2(REG, W) "vmovdqu (%[" W "],%[at],2), %%" REG "\n\tvpslld $16, %%" REG ", %%" REG "\n\t"
#define ODD2(REG, W) "vpand (%[" W "],%[at],2), %%ymm15, %%" REG "\n\t"
#define ROW_FMAS2(OFFSET, X, A0, A1)                                                                          \
    "vmovups " OFFSET "(%[" X "],%[at],4), %%ymm14\n\t"                                                       \
    "vfmadd231ps %%ymm12, %%ymm14, %%" A0 "\n\t"                                                              \
    "vfmadd231ps %%ymm13, %%ymm14, %%" A1 "\n\t"
/* rows[i] is input row i (fp32, widened); a 5-row tile passes its last row twice. */
static inline __attribute__((always_inline)) void tile_6x2(float sums[MAX_TILE_ROWS][8], const float *const rows[6],
                                                           const uint16_t *restrict w, int64_t k) {
    float acc[12][8]; /* ymm0-11 stored by the loop, then summed lane by lane as in tile() */
    const int64_t chunks = k / CHUNK;
    if (chunks > 0) {
        const float *x0 = rows[0], *x1 = rows[1], *x2 = rows[2], *x3 = rows[3], *x4 = rows[4], *x5 = rows[5];
        const uint16_t *w0 = w, *w1 = w + k;
        const char *next_tile = (const char *)(w + 2 * k); /* 64 bytes a chunk: the next two rows */
        int64_t at = 0, left = chunks;
        __asm__ volatile(
            ZERO_ACC12
            "vpcmpeqd %%ymm15, %%ymm15, %%ymm15\n\tvpslld $16, %%ymm15, %%ymm15\n\t"
            "1:\n\t"
            "prefetcht1 (%[pf])\n\t"
            EVEN2("ymm12", "w0") EVEN2("ymm13", "w1")
            ROW_FMAS2("", "x0", "ymm0", "ymm1")
            ROW_FMAS2("", "x1", "ymm2", "ymm3")
            ROW_FMAS2("", "x2", "ymm4", "ymm5")
            ROW_FMAS2("", "x3", "ymm6", "ymm7")
            ROW_FMAS2("", "x4", "ymm8", "ymm9")
            ROW_FMAS2("", "x5", "ymm10", "ymm11")
            ODD2("ymm12", "w0") ODD2("ymm13", "w1")
            ROW_FMAS2("32", "x0", "ymm0", "ymm1")
            ROW_FMAS2("32", "x1", "ymm2", "ymm3")
            ROW_FMAS2("32", "x2", "ymm4", "ymm5")
            ROW_FMAS2("32", "x3", "ymm6", "ymm7")
            ROW_FMAS2("32", "x4", "ymm8", "ymm9")
            ROW_FMAS2("32", "x5", "ymm10", "ymm11")
            "add $64, %[pf]\n\t"
            "add $16, %[at]\n\t"
            "dec %[left]\n\t"
            "jnz 1b\n\t"
            STORE_ACC12
            : [at] "+r"(at), [left] "+r"(left), [pf] "+r"(next_tile)
            : [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [x4] "r"(x4), [x5] "r"(x5), [w0] "r"(w0),
              [w1] "r"(w1), [acc] "r"(acc)
            : ALL_YMM_CLOBBERED);
    }
    finish_tile(sums, acc, rows, w, k, 6, 2);
}
#undef EVEN2
#undef ODD2
#undef ROW_FMAS2
#undef WIDEN_EVEN
#undef WIDEN_ODD
#undef ROW_FMAS
#undef ZERO_ACC12
#undef STORE_ACC12
#undef ALL_YMM_CLOBBERED
#else
#define HAVE_TILE_4X3_ASM 0
/* Without the assembly the 4 x 3 tile is the generic one: ROWS below names tile_4x3 on every build,
 * so it must exist on every build (an implicit declaration is an error from GCC 14 and Clang 16). */
static inline __attribute__((always_inline)) void tile_4x3(float sums[MAX_TILE_ROWS][8], const float *restrict x,
                                                           int64_t ldx, const uint16_t *restrict w, int64_t k) {
    tile(sums, x, ldx, w, k, 4, 3);
}
#endif

/* rows x [rows, k] bf16 -> fp32, each whole CHUNK of a row stored evens first, then odds (see tile). */
static void widen_rows(float *restrict xf, const uint16_t *restrict x, int64_t rows, int64_t k) {
    const int64_t whole = HAVE_AVX2 ? k - k % CHUNK : 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = x + r * k;
        float *dst = xf + r * k;
        for (int64_t at = 0; at < whole; at += CHUNK)
            for (int t = 0; t < CHUNK / 2; t++) {
                dst[at + t] = bf16_to_f32(src[at + 2 * t]);
                dst[at + CHUNK / 2 + t] = bf16_to_f32(src[at + 2 * t + 1]);
            }
        for (int64_t at = whole; at < k; at++) dst[at] = bf16_to_f32(src[at]);
    }
}

static inline __attribute__((always_inline)) void store_tile(uint16_t *out, int64_t ldo, int64_t n0,
                                                             float sums[MAX_TILE_ROWS][8], const uint16_t *bias,
                                                             const int MR, const int NR) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            const float b = bias != NULL ? bf16_to_f32(bias[n0 + j]) : 0.0f;
            out[i * ldo + n0 + j] = f32_to_bf16(sums[i][j] + b);
        }
}

/* Rows [0, MR) of the widened block against weight rows [n0, n1), NR rows at a time. */
#define ROWS(MR, NR)                                                                                          \
    do {                                                                                                      \
        int64_t n = n0;                                                                                       \
        for (; n + (NR) <= n1; n += (NR)) {                                                                   \
            if (HAVE_TILE_4X3_ASM && (MR) == 4 && (NR) == 3)                                                  \
                tile_4x3(sums, xs, k, w + n * k, k);                                                          \
            else                                                                                              \
                tile(sums, xs, k, w + n * k, k, MR, NR);                                                      \
            store_tile(o, n_out, n, sums, bias, MR, NR);                                                      \
        }                                                                                                     \
        for (; n < n1; n++) {                                                                                 \
            tile(sums, xs, k, w + n * k, k, MR, 1);                                                           \
            store_tile(o, n_out, n, sums, bias, MR, 1);                                                       \
        }                                                                                                     \
    } while (0)

/* Weight rows per pass over the input rows: a multiple of every tile's NR (3, 4, 6, 8), and small
 * enough to stay in L2 while every block of input rows goes over it. */
#define NB 24

#if HAVE_TILE_4X3_ASM
/* block_rows for 5 or 6 rows: 6 x 2 tiles over the thread's weight rows, an odd last one by tile(). */
static void six_rows(const float *xf, int64_t rows, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                     int64_t n_out, int64_t k, int64_t n_begin, int64_t n_end) {
    float sums[MAX_TILE_ROWS][8];
    const float *x[6] = {xf, xf + k, xf + 2 * k, xf + 3 * k, xf + 4 * k, xf + (rows - 1) * k};
    int64_t n = n_begin;
    for (; n + 2 <= n_end; n += 2) {
        tile_6x2(sums, x, w + n * k, k);
        store_tile(out, n_out, n, sums, bias, (int)rows, 2);
    }
    if (n < n_end) {
        tile(sums, xf, k, w + n * k, k, 4, 1);
        store_tile(out, n_out, n, sums, bias, 4, 1);
        for (int64_t i = 4; i < rows; i++) {
            tile(sums, xf + i * k, k, w + n * k, k, 1, 1);
            store_tile(out + i * n_out, n_out, n, sums, bias, 1, 1);
        }
    }
}
#endif

/* One thread's weight rows [n_begin, n_end) against `rows` widened rows (fp32 [rows, k]) at xf.
 *
 * Weight rows outer, input rows inner: each block of NB weight rows is read from memory once, and
 * every input row, the last 1-3 included, is multiplied with it while it is in cache. (A separate
 * pass for the last rows would stream the weights a second time: a verification step of 5 or 9
 * rows then cost nearly two single-row steps.) */
static void block_rows(const float *xf, int64_t rows, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                       int64_t n_out, int64_t k, int64_t n_begin, int64_t n_end) {
    float sums[MAX_TILE_ROWS][8];
#if HAVE_TILE_4X3_ASM
    if (rows == 5 || rows == 6) {
        six_rows(xf, rows, w, bias, out, n_out, k, n_begin, n_end);
        return;
    }
#endif
    const int64_t whole = rows - rows % MAX_MR;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += NB) {
        const int64_t n1 = n0 + NB <= n_end ? n0 + NB : n_end;
        for (int64_t m = 0; m < whole; m += MAX_MR) {
            const float *xs = xf + m * k;
            uint16_t *o = out + m * n_out;
            ROWS(4, 3);
        }
        /* The last 1-3 rows (all of them in a decode step of 1-3 sequences): more weight rows per tile. */
        const float *xs = xf + whole * k;
        uint16_t *o = out + whole * n_out;
        switch (rows - whole) {
        case 1: ROWS(1, 8); break;
        case 2: ROWS(2, 6); break;
        case 3: ROWS(3, 4); break;
        default: break;
        }
    }
}

int tandem_weight_layout(void);
int tandem_linear_packed_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out,
                              int64_t m, int64_t n, int64_t k);

/* out [m, n] bf16 = x [m, k] bf16 @ w [n, k]^T bf16 (+ bias [n] bf16, or NULL). All contiguous. On a
 * build with AVX512-BF16 (tandem_weight_layout() != 0) w is the packed copy and linear_packed.c does
 * the work. Returns 0, or -1 for a bad size or when scratch memory cannot be had (nothing written then). */
int tandem_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t m,
                       int64_t n, int64_t k) {
    if (tandem_weight_layout() != 0) return tandem_linear_packed_bf16(x, w, bias, out, m, n, k);
    if (m < 0 || n < 0 || k < 1) return -1;
    if (m == 0 || n == 0) return 0;
    int64_t block = BLOCK_BYTES / (k * (int64_t)sizeof(float));
    block = block < MAX_MR ? MAX_MR : block - block % MAX_MR;
    if (block > m) block = m;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *xf = scratch_for((size_t)(block * k));
        if (xf == NULL) {
            failed = 1;
        } else {
            int threads = 1, me = 0;
#ifdef _OPENMP
            threads = omp_get_num_threads();
            me = omp_get_thread_num();
#endif
            /* Output features split evenly, in whole blocks of NB (whole tiles of every NR). */
            const int64_t chunks = (n + NB - 1) / NB;
            const int64_t n_begin = NB * (chunks * me / threads);
            const int64_t n_end = me + 1 == threads ? n : NB * (chunks * (me + 1) / threads);
            for (int64_t m0 = 0; m0 < m && n_begin < n_end; m0 += block) {
                const int64_t rows = m - m0 < block ? m - m0 : block;
                widen_rows(xf, x + m0 * k, rows, k);
                block_rows(xf, rows, w, bias, out + m0 * n, n, k, n_begin, n_end);
            }
        }
    }
    return failed ? -1 : 0;
}

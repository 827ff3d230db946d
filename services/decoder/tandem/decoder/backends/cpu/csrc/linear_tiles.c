/* bf16 linear layers on AMX tiles (Sapphire Rapids and later Xeons): TDPBF16PS over the packed weights
 * of linear_packed.c, for the weights whose descriptor asks for it (weight.h's tile_rows, set by the
 * measured kernel choice, backends/cpu/kernel_choice.py). Compiled into every library; the tile code
 * only into the amx level's (`-mamx-tile -mamx-bf16` on top of the avx512bf16 flags).
 *
 * Why: on those CPUs VDPBF16PS (linear_packed.c) tops out near 230 GFLOP/s on 2 cores, where one
 * TDPBF16PS does 16 x 16 x 32 bf16 products: oneDNN's AMX linear ran 1.0-2.8 TFLOP/s from 32 rows
 * there, 5-12x the VDPBF16PS kernel (issue 48's table).
 *
 * Tiles (palette 1: 8 tiles of up to 16 rows x 64 bytes): 0-2 hold C, 16 rows x 16 features of fp32
 * each; 3 is A, 16 rows of x x 32 inputs (16 pairs); 4 is B, 16 pairs x 16 features, which is the
 * packed layout as it lies: a group's pair p is 96 dwords (w[f][2p], w[f][2p + 1]), so 16 features of
 * 16 consecutive pairs are 16 rows of 64 bytes, 384 bytes apart. No second copy of the weights. When
 * the input pairs are not a multiple of 16, tiles 5 (A) and 6 (B) are configured for the last kt
 * pairs, so no tile reads past a group (the packed copy has no padding in k beyond one pair).
 *
 * Rows: x is copied once per call into a scratch of whole 16-row tiles, each row zero-padded to whole
 * tiles of 32 inputs, so a short last row tile is padded with zeros (never re-tiled by the row count)
 * and an odd k's last pair reads a zero, as the packed weight holds.
 *
 * NOTE: every output's sum runs in one order whatever the number of rows or threads: C starts at
 * zero, the K steps of 16 pairs in order (their 32 products summed in the order the instruction
 * fixes, whatever the tile's other rows hold), the last partial step last; then the bias, then one
 * rounding to bf16. Threads split whole groups of 96 features. A row's bits do not depend on its
 * neighbours (test_linear_tiles.py checks rows against rows alone, on a CPU that has the tiles).
 *
 * Permission: Linux hands out the tile state only to a process that asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process); each thread loads the tile
 * configuration before its first tile instruction (LDTILECFG, per thread) and releases it after.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"
#include "team.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tiles.h"
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif

int tandem_tiles_available(void);
int tandem_linear_tiles_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int64_t m,
                             int64_t n, int64_t k);

#if HAVE_TILES

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define GROUP 96       /* linear_packed.c's group: features per packed group */
#define TILE_M 16      /* rows of x per A tile */
#define TILE_PAIRS 16  /* input pairs per K step (32 bf16: one A tile row) */
#define TILE_N 16      /* features per C and B tile */
#define C_TILES 3      /* C tiles a pass: half a group */

/* 0 not asked yet, 1 granted, -1 refused; asked from Python at load (one thread). */
static int tiles_state;

/* Whether this process may use the tiles: asks the kernel once. */
int tandem_tiles_available(void) {
    if (tiles_state == 0) tiles_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return tiles_state == 1;
}

/* The calling thread's copy of x, whole row tiles by whole K steps (grows to the largest call). */
static __thread ThreadBuffer padded_rows;

static TileConfig tile_config(int64_t kt) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < C_TILES; t++) {
        cfg.rows[t] = TILE_M;
        cfg.colsb[t] = TILE_N * 4;
    }
    cfg.rows[3] = TILE_M, cfg.colsb[3] = TILE_PAIRS * 4; /* A: 16 rows x 32 bf16 */
    cfg.rows[4] = TILE_PAIRS, cfg.colsb[4] = TILE_N * 4; /* B: 16 pairs x 16 features' pairs */
    if (kt > 0) {
        cfg.rows[5] = TILE_M, cfg.colsb[5] = (uint16_t)(kt * 4); /* A of the last kt pairs */
        cfg.rows[6] = (uint8_t)kt, cfg.colsb[6] = TILE_N * 4;    /* B of the last kt pairs */
    }
    return cfg;
}

/* C tile t (fp32 16 x 16, features col..col + 15) of `rows` valid rows, plus the bias, to out. */
static inline __attribute__((always_inline)) void store_c(float c[TILE_M * TILE_N], uint16_t *out, int64_t rows,
                                                          int64_t n, int64_t col, const uint16_t *bias) {
    if (col >= n) return;
    const int valid = n - col >= TILE_N ? TILE_N : (int)(n - col);
    for (int64_t r = 0; r < rows; r++)
        store16_bias_bf16(out + r * n + col, _mm512_loadu_ps(c + r * TILE_N), bias != NULL ? bias + col : NULL, valid);
}

/* One group (features col..col + 95, packed at wp with kp pairs) against one tile of 16 padded rows
 * at xs (row stride ldx elements), `rows` of them real: two passes of three C tiles. */
static void group_tile(const uint16_t *xs, int64_t ldx, int64_t rows, const uint16_t *wp, int64_t kp,
                       const uint16_t *bias, uint16_t *out, int64_t n, int64_t col) {
    const int64_t whole = kp - kp % TILE_PAIRS;
    const int64_t b_stride = GROUP * 4; /* bytes from one pair's row of the group to the next */
    float c[TILE_M * TILE_N] __attribute__((aligned(64)));
    for (int half = 0; half < 2; half++) {
        const uint16_t *wb = wp + (int64_t)half * C_TILES * TILE_N * 2; /* this pass's first feature, pair 0 */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t p = 0; p < whole; p += TILE_PAIRS) {
            const uint16_t *b = wb + p * GROUP * 2;
            _tile_loadd(3, xs + 2 * p, ldx * 2);
            _tile_loadd(4, b, b_stride);
            _tile_dpbf16ps(0, 3, 4);
            _tile_loadd(4, b + TILE_N * 2, b_stride);
            _tile_dpbf16ps(1, 3, 4);
            _tile_loadd(4, b + 2 * TILE_N * 2, b_stride);
            _tile_dpbf16ps(2, 3, 4);
        }
        if (whole < kp) { /* the last kt pairs: tiles 5 and 6 are configured for them */
            const uint16_t *b = wb + whole * GROUP * 2;
            _tile_loadd(5, xs + 2 * whole, ldx * 2);
            _tile_loadd(6, b, b_stride);
            _tile_dpbf16ps(0, 5, 6);
            _tile_loadd(6, b + TILE_N * 2, b_stride);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(6, b + 2 * TILE_N * 2, b_stride);
            _tile_dpbf16ps(2, 5, 6);
        }
        const int64_t first = col + (int64_t)half * C_TILES * TILE_N;
        _tile_stored(0, c, TILE_N * 4);
        store_c(c, out, rows, n, first, bias);
        _tile_stored(1, c, TILE_N * 4);
        store_c(c, out, rows, n, first + TILE_N, bias);
        _tile_stored(2, c, TILE_N * 4);
        store_c(c, out, rows, n, first + 2 * TILE_N, bias);
    }
}

/* out [m, n] bf16 = x [m, k] bf16 @ w [n, k]^T (+ bias [n]), w packed by tandem_pack_bf16. 0, or -1
 * when the tiles are not this process's (tandem_tiles_available() not called, or refused), for a bad
 * size, or without scratch memory. */
int tandem_linear_tiles_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int64_t m,
                             int64_t n, int64_t k) {
    if (tiles_state != 1 || m < 0 || n < 0 || k < 1) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t kp = (k + 1) / 2, groups = (n + GROUP - 1) / GROUP;
    const int64_t ldx = (kp + TILE_PAIRS - 1) / TILE_PAIRS * TILE_PAIRS * 2; /* elements per padded row */
    const int64_t row_tiles = (m + TILE_M - 1) / TILE_M;
    uint16_t *xs = buffer_of_at_least(&padded_rows, (size_t)(row_tiles * TILE_M * ldx) * sizeof(uint16_t));
    if (xs == NULL) return -1;
    for (int64_t r = 0; r < row_tiles * TILE_M; r++) {
        uint16_t *row = xs + r * ldx;
        const int64_t copied = r < m ? k : 0;
        if (copied > 0) memcpy(row, x + r * k, (size_t)k * sizeof(uint16_t));
        memset(row + copied, 0, (size_t)(ldx - copied) * sizeof(uint16_t));
    }
    const TileConfig cfg = tile_config(kp % TILE_PAIRS);
    const int64_t group_elements = kp * 2 * GROUP;
#pragma omp parallel
    {
        int64_t g_begin, g_end;
        team_share(groups, &g_begin, &g_end);
        if (g_begin < g_end) {
            TILE_MEMORY_BARRIER(); /* the configuration and the rows copied above, stored first */
            _tile_loadconfig(&cfg); /* per thread: the configuration is thread state */
            /* Group outer: its 110-300 KB stay in L2 while every row tile goes over them. */
            for (int64_t g = g_begin; g < g_end; g++)
                for (int64_t t = 0; t < row_tiles; t++) {
                    const int64_t rows = m - t * TILE_M < TILE_M ? m - t * TILE_M : TILE_M;
                    group_tile(xs + t * TILE_M * ldx, ldx, rows, wp + g * group_elements, kp, bias,
                               out + t * TILE_M * n, n, g * GROUP);
                }
            _tile_release();
        }
    }
    return 0;
}

#else

int tandem_tiles_available(void) { return 0; }

int tandem_linear_tiles_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, int64_t m,
                             int64_t n, int64_t k) {
    (void)x, (void)wp, (void)bias, (void)out, (void)m, (void)n, (void)k;
    return -1; /* not the amx build: the Python side never asks (Kernels.tiles is False) */
}

#endif

/* AMX tiles in plain C, for testing csrc/linear_tiles.c and linear_int8.c's tiles on a CPU without
 * them (test_linear_tiles.py and test_linear_int8.py build the avx512bf16 level with
 * `-include tile_emulation.h`).
 *
 * Each thread has its 8 tile registers and its configuration, as the hardware keeps them; every
 * instruction checks what the hardware would fault on (an unconfigured tile, a load past the
 * configured shape, a product whose shapes do not agree: A's colsb / 4 == B's rows, C's rows ==
 * A's rows, C's colsb == B's colsb), so a wrong tiling aborts here instead of on a Xeon. TDPBF16PS
 * adds, for each K pair in order, the even product then the odd one into fp32 (the SDM's pseudocode);
 * real hardware fixes its own order, the same for every row, which is all the kernel relies on.
 * TDPBSUD and TDPBSSD add, for each output dword, the four products of A's signed bytes with B's
 * unsigned (TDPBSUD) or signed (TDPBSSD) ones into int32 (exact: any order gives the same sum). The
 * configuration is checked as LDTILECFG checks it (palette 1, start_row 0, reserved bytes zero, a
 * tile's rows and colsb both zero or both not), and a product's three tiles must be distinct (the
 * assembler refuses the instruction otherwise).
 *
 * The kernel's source is left as it ships: this header claims the AMX macros its guard asks for and
 * answers its permission request (syscall) with success, after the system headers that declare them.
 */
#ifndef TANDEM_TILE_EMULATION_H
#define TANDEM_TILE_EMULATION_H

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define __AMX_TILE__ 1
#define __AMX_BF16__ 1
#define __AMX_INT8__ 1
#define syscall(...) 0L

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbsud
#undef _tile_dpbssd

typedef struct {
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
    int configured;
} EmulatedTiles;

static __thread EmulatedTiles emulated_tiles;

/* Tile products run (TDPBF16PS, TDPBSUD, TDPBSSD), over every thread (tests read it to see which calls tiled). */
__attribute__((weak)) long tandem_emulated_tile_products;

static inline void emulated_fault(const char *what, int tile) {
    fprintf(stderr, "tile emulation: %s (tile %d)\n", what, tile);
    abort();
}

static inline void emulated_loadconfig(const void *config) {
    const uint8_t *c = config;
    if (c[0] != 1) emulated_fault("palette is not 1", -1);
    if (c[1] != 0) emulated_fault("start_row is not 0", -1);
    for (int i = 2; i < 64; i++)
        if ((i < 16 || (i >= 32 && i < 48) || i >= 56) && c[i] != 0) emulated_fault("a reserved byte is not 0", i);
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, sizeof colsb);
        emulated_tiles.rows[t] = c[48 + t];
        emulated_tiles.colsb[t] = colsb;
        if (colsb > 64 || emulated_tiles.rows[t] > 16 || colsb % 4) emulated_fault("shape past palette 1", t);
        if ((colsb == 0) != (emulated_tiles.rows[t] == 0)) emulated_fault("rows and colsb: one of them 0", t);
    }
    memset(emulated_tiles.data, 0, sizeof emulated_tiles.data);
    emulated_tiles.configured = 1;
}

static inline void emulated_release(void) { memset(&emulated_tiles, 0, sizeof emulated_tiles); }

static inline void emulated_check(int t) {
    if (!emulated_tiles.configured || t < 0 || t > 7 || emulated_tiles.rows[t] == 0) emulated_fault("unconfigured", t);
}

static inline void emulated_loadd(int t, const void *base, long stride) {
    emulated_check(t);
    memset(emulated_tiles.data[t], 0, sizeof emulated_tiles.data[t]);
    for (int r = 0; r < emulated_tiles.rows[t]; r++)
        memcpy(emulated_tiles.data[t][r], (const uint8_t *)base + r * stride, emulated_tiles.colsb[t]);
}

static inline void emulated_stored(int t, void *base, long stride) {
    emulated_check(t);
    for (int r = 0; r < emulated_tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emulated_tiles.data[t][r], emulated_tiles.colsb[t]);
}

static inline void emulated_zero(int t) {
    emulated_check(t);
    memset(emulated_tiles.data[t], 0, sizeof emulated_tiles.data[t]);
}

static inline float emulated_bf16(const uint8_t *at) {
    uint16_t h;
    memcpy(&h, at, sizeof h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The shapes a tile product needs (the hardware's #UD otherwise): A's dwords are B's rows, C has A's
 * rows and B's width. */
static inline void emulated_check_product(int c, int a, int b, const char *name) {
    emulated_check(c), emulated_check(a), emulated_check(b);
    if (c == a || c == b || a == b) emulated_fault("a product's tiles are not distinct", c);
    if (emulated_tiles.colsb[a] / 4 != emulated_tiles.rows[b] || emulated_tiles.rows[c] != emulated_tiles.rows[a] ||
        emulated_tiles.colsb[c] != emulated_tiles.colsb[b])
        emulated_fault(name, c);
}

static inline void emulated_dpbf16ps(int c, int a, int b) {
    emulated_check_product(c, a, b, "TDPBF16PS shapes disagree");
    const int pairs = emulated_tiles.colsb[a] / 4, columns = emulated_tiles.colsb[c] / 4;
    __atomic_fetch_add(&tandem_emulated_tile_products, 1, __ATOMIC_RELAXED);
    for (int m = 0; m < emulated_tiles.rows[c]; m++) {
        float acc[16];
        memcpy(acc, emulated_tiles.data[c][m], sizeof acc);
        for (int k = 0; k < pairs; k++)
            for (int n = 0; n < columns; n++) {
                acc[n] += emulated_bf16(&emulated_tiles.data[a][m][4 * k]) * emulated_bf16(&emulated_tiles.data[b][k][4 * n]);
                acc[n] += emulated_bf16(&emulated_tiles.data[a][m][4 * k + 2]) *
                          emulated_bf16(&emulated_tiles.data[b][k][4 * n + 2]);
            }
        memcpy(emulated_tiles.data[c][m], acc, sizeof acc);
    }
}

/* TDPBSUD (B unsigned) and TDPBSSD (B signed). */
static inline void emulated_dpbsxd(int c, int a, int b, int b_signed) {
    emulated_check_product(c, a, b, "TDPBSUD / TDPBSSD shapes disagree");
    const int quads = emulated_tiles.colsb[a] / 4, columns = emulated_tiles.colsb[c] / 4;
    __atomic_fetch_add(&tandem_emulated_tile_products, 1, __ATOMIC_RELAXED);
    for (int m = 0; m < emulated_tiles.rows[c]; m++) {
        int32_t acc[16];
        memcpy(acc, emulated_tiles.data[c][m], sizeof acc);
        for (int k = 0; k < quads; k++)
            for (int n = 0; n < columns; n++)
                for (int i = 0; i < 4; i++)
                    acc[n] += (int32_t)(int8_t)emulated_tiles.data[a][m][4 * k + i] *
                              (b_signed ? (int32_t)(int8_t)emulated_tiles.data[b][k][4 * n + i]
                                        : (int32_t)emulated_tiles.data[b][k][4 * n + i]);
        memcpy(emulated_tiles.data[c][m], acc, sizeof acc);
    }
}

#define _tile_loadconfig(config) emulated_loadconfig(config)
#define _tile_release() emulated_release()
#define _tile_loadd(t, base, stride) emulated_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emulated_stored(t, base, stride)
#define _tile_zero(t) emulated_zero(t)
#define _tile_dpbf16ps(c, a, b) emulated_dpbf16ps(c, a, b)
#define _tile_dpbsud(c, a, b) emulated_dpbsxd(c, a, b, 0)
#define _tile_dpbssd(c, a, b) emulated_dpbsxd(c, a, b, 1)

#endif

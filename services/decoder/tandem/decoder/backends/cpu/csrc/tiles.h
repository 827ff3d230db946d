/* What the AMX tile kernels share (linear_tiles.c: bf16; linear_int8.c: int8 activations): LDTILECFG's
 * 64 bytes and the compiler barrier their intrinsics need. Included only where the tile code is
 * compiled (the amx level's `-mamx-tile`). */
#ifndef TANDEM_NATIVE_TILES_H
#define TANDEM_NATIVE_TILES_H

#include <stdint.h>

/* LDTILECFG's 64 bytes (palette 1: 8 tiles of up to 16 rows x 64 bytes); everything not set must be 0. */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* GCC's tile intrinsics are asm statements that name no memory: without this, stores only a tile
 * instruction reads (a configuration's bytes, rows or quads laid out for a tile load) could be moved
 * past it. */
#define TILE_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

#endif

/* LoRA deltas, each row its own adapter (Punica / S-LoRA), added into a projection's output in place:
 * called by layer.c's fused layers and decode stack after each projection, and through ctypes by
 * backends/cpu/lora.py on the per-op path. The slots' layout is lora.h's.
 *
 * For row t with slot s = slots[t] >= 0 (-1: the base model, untouched), and each part p of the
 * projection (q/k/v of a fused qkv, gate/up, or the one part) with rank r = ranks[s][p] > 0:
 *
 *     u[j] = sum_i x[t][i] * a[s][p * max_rank + j][i]                 j < r
 *     y[t][o] = round(y[t][o] + scales[s] * sum_j u[j] * bt[s][j][o])   o in part p's columns
 *
 * models/lora.py has the reference in torch.
 *
 * NOTE: the order, fixed per build. Each u[j] is LANES running sums over i (lane l takes i = l,
 * l + LANES, ...), added lane 0 first, then the tail in order; each output's sum over j runs j = 0,
 * 1, ...; on builds with FMA each product is fused into its sum (written out: -std=c11 contracts
 * nothing), elsewhere multiplied, then added. On AVX512-BF16 builds a bf16 u[j] is instead 16 running
 * sums of VDPBF16PS's pairwise products (lane l takes the pairs i = 2l, 2l + 1 of every 32 inputs; a
 * tail of fewer than 32 is padded with zeros), reduced by _mm512_reduce_add_ps's fixed tree.
 * Weights and activations are float32 or bf16 (the model's dtype); u and the sums over j are float32,
 * y is rounded once.
 *
 * NOTE: grouping (Punica's SGMV). The adapted rows are sorted by slot (stably) and each slot's rows
 * run together: a tile of up to TILE_ROWS (pass 1) or EXPAND_ROWS (pass 2) of them shares every load
 * of A and B^T, so a slot's weights are read once a call whatever its number of rows (a prefill's
 * 1,024 rows, or two decode rows per adapter), not once a row. A tile does for each of its rows
 * exactly what a tile of that row alone does (its own accumulators, the operations above in the
 * order above), so a row's bits depend on its own inputs and slot only: not on how many rows share
 * the call, which adapters they use, how they are grouped, or the number of threads (threads split
 * whole units: a slot's run of rows by A rows in pass 1, by column blocks in pass 2).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "lora.h"
#include "scratch.h"
#include "team.h"

#if defined(__AVX512F__)
#define LANES 16
#define TILE_ROWS 4   /* rows a pass-1 tile: 16 accumulators of 32 registers */
#define EXPAND_ROWS 6 /* rows a pass-2 tile: 24 accumulators */
#elif defined(__AVX2__)
#define LANES 8
#define TILE_ROWS 2 /* 8 accumulators of 16 registers */
#define EXPAND_ROWS 2
#else
#define LANES 4
#define TILE_ROWS 2
#define EXPAND_ROWS 2
#endif
#define TILE_A 4            /* A rows a pass-1 tile */
#define TILE_VECS 4         /* column vectors a pass-2 tile */
#define CHUNK 16            /* a unit's rows (of one slot) */
#define UNIT_A 8            /* a pass-1 unit's A rows (of one part) */
#define COLUMNS 256         /* a pass-2 unit's output columns */
#define PARALLEL_MIN 65536  /* multiply-adds below which a call runs on the calling thread */
#define PREFETCH_ROWS 8     /* rows a slot (on average) up to which a call prefetches its weights */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_DPBF16 1
#define DP_LANES 32 /* bf16 inputs a VDPBF16PS takes */
#else
#define HAVE_DPBF16 0
#endif

static __thread ThreadBuffer buffer;

/* Every lane v. */
#if LANES == 16
INLINE vf splat(float v) { return (vf)_mm512_set1_ps(v); }
#elif LANES == 8
INLINE vf splat(float v) { return (vf)_mm256_set1_ps(v); }
#else
INLINE vf splat(float v) { return (vf){v, v, v, v}; }
#endif

/* c + a * b: fused where the build has FMA (the NOTE's order either way). */
#if defined(__FMA__) && LANES == 16
INLINE vf madd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__FMA__) && LANES == 8
INLINE vf madd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
INLINE vf madd(vf a, vf b, vf c) { return c + a * b; }
#endif
#if defined(__FMA__)
INLINE float madd1(float a, float b, float c) { return fmaf(a, b, c); }
#else
INLINE float madd1(float a, float b, float c) { return c + a * b; }
#endif

INLINE float value_at(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* LANES consecutive values of p from i on, as float32 (bf16: the top halves of the floats). */
INLINE vf lanes_at(const void *p, int64_t i, int is_bf16) {
    vf v;
    if (is_bf16) {
#if LANES == 16
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        v = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif LANES == 8
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        v = (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
        vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const vu bits = __builtin_convertvector(h, vu) << 16;
        memcpy(&v, &bits, sizeof v);
#endif
    } else {
        memcpy(&v, (const float *)p + i, sizeof v);
    }
    return v;
}

INLINE void store_value(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* store_value on LANES values: bf16.h's f32_to_bf16 lane by lane (the same bits). */
INLINE void store_lanes(void *p, int64_t i, vf v, int is_bf16) {
    if (!is_bf16) {
        memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    vu bits;
    memcpy(&bits, &v, sizeof bits);
    const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    const vu out = (nan & ((bits >> 16) | 0x40u)) | (~nan & rounded);
    const vh h = __builtin_convertvector(out, vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* Pass 1 on a tile: u[r * width + j] for rows rows[r] (r < MR) of x (row stride k) and A rows j < nj
 * of w (row stride k), each sum in the NOTE's order. */
INLINE void shrink_tile(const void *x, const int64_t *rows, const void *w, int64_t k, int nj, float *u, int64_t width,
                        const int MR, const int is_bf16) {
    const size_t row_bytes = (size_t)k * (is_bf16 ? 2 : 4);
    const char *a[TILE_A];
    for (int j = 0; j < TILE_A; j++) a[j] = (const char *)w + (size_t)(j < nj ? j : 0) * row_bytes;
    vf acc[TILE_ROWS][TILE_A];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_A; j++) acc[r][j] = (vf){0};
    const int64_t whole = k - k % LANES;
    for (int64_t i = 0; i < whole; i += LANES) {
        vf wv[TILE_A];
#pragma GCC unroll 4
        for (int j = 0; j < TILE_A; j++) wv[j] = lanes_at(a[j], i, is_bf16);
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            const vf xv = lanes_at(x, rows[r] * k + i, is_bf16);
#pragma GCC unroll 4
            for (int j = 0; j < TILE_A; j++) acc[r][j] = madd(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nj; j++) {
            float sum = 0.0f;
            for (int l = 0; l < LANES; l++) sum += acc[r][j][l];
            for (int64_t i = whole; i < k; i++)
                sum = madd1(value_at(x, rows[r] * k + i, is_bf16), value_at(a[j], i, is_bf16), sum);
            u[r * width + j] = sum;
        }
}

#if HAVE_DPBF16
/* shrink_tile for bf16 x on VDPBF16PS: the NOTE's AVX512-BF16 order. */
INLINE void shrink_tile_dp(const uint16_t *x, const int64_t *rows, const uint16_t *w, int64_t k, int nj, float *u,
                           int64_t width, const int MR) {
    const uint16_t *a[TILE_A];
    for (int j = 0; j < TILE_A; j++) a[j] = w + (j < nj ? j : 0) * k;
    __m512 acc[TILE_ROWS][TILE_A];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_A; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t whole = k - k % DP_LANES;
    for (int64_t i = 0; i < whole; i += DP_LANES) {
        __m512i wv[TILE_A];
#pragma GCC unroll 4
        for (int j = 0; j < TILE_A; j++) wv[j] = _mm512_loadu_si512(a[j] + i);
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            const __m512i xv = _mm512_loadu_si512(x + rows[r] * k + i);
#pragma GCC unroll 4
            for (int j = 0; j < TILE_A; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    if (whole < k) { /* the tail, zeros past k */
        const __mmask32 mask = (__mmask32)((1u << (k - whole)) - 1u);
        __m512i wv[TILE_A];
#pragma GCC unroll 4
        for (int j = 0; j < TILE_A; j++) wv[j] = _mm512_maskz_loadu_epi16(mask, a[j] + whole);
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + rows[r] * k + whole);
#pragma GCC unroll 4
            for (int j = 0; j < TILE_A; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nj; j++) u[r * width + j] = _mm512_reduce_add_ps(acc[r][j]);
}
#endif

/* Pass 2 on a tile: rows r < MR (y rows rows[r]; their part's u at u + r * width) and the NV * LANES
 * columns from c: y = round(y + scale * sum_j u[j] * bt[j][column]), j < rank, in order. */
INLINE void expand_tile(void *y, const int64_t *rows, const float *u, int64_t width, const void *bt, int64_t n,
                        int64_t rank, int64_t c, float scale, const int MR, const int NV, const int is_bf16) {
    const size_t row_bytes = (size_t)n * (is_bf16 ? 2 : 4);
    vf d[EXPAND_ROWS][TILE_VECS];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) d[r][v] = (vf){0};
    for (int64_t j = 0; j < rank; j++) {
        const char *b = (const char *)bt + (size_t)j * row_bytes;
        vf bv[TILE_VECS];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) bv[v] = lanes_at(b, c + v * LANES, is_bf16);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const vf uj = splat(u[r * width + j]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) d[r][v] = madd(uj, bv[v], d[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            const int64_t at = rows[r] * n + c + v * LANES;
            store_lanes(y, at, lanes_at(y, at, is_bf16) + scale * d[r][v], is_bf16);
        }
}

/* expand_tile's sums for one column c and `count` rows, in scalar code (the same operations). */
INLINE void expand_column(void *y, const int64_t *rows, int64_t count, const float *u, int64_t width, const void *bt,
                          int64_t n, int64_t rank, int64_t c, float scale, const int is_bf16) {
    for (int64_t r = 0; r < count; r++) {
        float d = 0.0f;
        for (int64_t j = 0; j < rank; j++) d = madd1(u[r * width + j], value_at(bt, j * n + c, is_bf16), d);
        const int64_t at = rows[r] * n + c;
        store_value(y, at, value_at(y, at, is_bf16) + scale * d, is_bf16);
    }
}

/* A run of rows of one slot: positions [first, first + count) of the grouped order. */
typedef struct {
    int64_t slot, first, count;
} Chunk;

/* shrink_tile on VDPBF16PS (`dp`: bf16 on an AVX512-BF16 build) or not, MR rows. */
#if HAVE_DPBF16
#define SHRINK(MR)                                                                                                   \
    (dp ? shrink_tile_dp((const uint16_t *)x, order + at, (const uint16_t *)a, k, nj, out, width, MR)                \
        : shrink_tile(x, order + at, a, k, nj, out, width, MR, is_bf16))
#else
#define SHRINK(MR) shrink_tile(x, order + at, a, k, nj, out, width, MR, is_bf16)
#endif

/* Pass 1 of one unit: the chunk's rows against A rows [j0, j1) of one part (tiles of TILE_ROWS x TILE_A).
 * x: the call's rows, read in the grouped order. */
INLINE void shrink_unit(const TandemLoraWeight *w, const Chunk *ch, const void *x, const int64_t *order, float *u,
                        int64_t width, int64_t j0, int64_t j1, const int is_bf16, const int dp) {
    const int64_t k = w->k;
    const size_t element = is_bf16 ? 2 : 4;
    (void)dp;
    for (int64_t j = j0; j < j1; j += TILE_A) {
        const int nj = j1 - j < TILE_A ? (int)(j1 - j) : TILE_A;
        const char *a = (const char *)w->a + ((size_t)ch->slot * (size_t)width + (size_t)j) * (size_t)k * element;
        for (int64_t r = 0; r < ch->count; r += TILE_ROWS) {
            const int64_t at = ch->first + r;
            float *out = u + at * width + j;
            switch (ch->count - r < TILE_ROWS ? ch->count - r : TILE_ROWS) {
            case 1: SHRINK(1); break;
#if TILE_ROWS == 4
            case 2: SHRINK(2); break;
            case 3: SHRINK(3); break;
#endif
            default: SHRINK(TILE_ROWS); break;
            }
        }
    }
}

/* Pass 2 of one unit: the chunk's rows, output columns [lo, hi), every part that has some of them. */
INLINE void expand_unit(const TandemLoraWeight *w, const Chunk *ch, const int64_t *order, const float *u, void *y,
                        int64_t width, int64_t lo, int64_t hi, const int is_bf16) {
    const int64_t n = w->n, s = ch->slot;
    const size_t element = is_bf16 ? 2 : 4;
    const char *bt = (const char *)w->bt + (size_t)(s * w->max_rank * n) * element;
    const float scale = w->scales[s];
    for (int64_t p = 0, start = 0; p < w->num_parts; start = w->part_ends[p], p++) {
        const int64_t from = lo > start ? lo : start, to = hi < w->part_ends[p] ? hi : w->part_ends[p];
        const int64_t rank = w->ranks[s * w->num_parts + p];
        if (from >= to || rank == 0) continue;
        for (int64_t r = 0; r < ch->count; r += EXPAND_ROWS) {
            const int64_t at = ch->first + r, rows = ch->count - r < EXPAND_ROWS ? ch->count - r : EXPAND_ROWS;
            const int64_t *ys = order + at;
            const float *ut = u + at * width + p * w->max_rank;
            int64_t c = from;
#define EXPAND(MR) expand_tile(y, ys, ut, width, bt, n, rank, c, scale, MR, TILE_VECS, is_bf16)
            for (; c + TILE_VECS * LANES <= to; c += TILE_VECS * LANES) switch (rows) {
                case 1: EXPAND(1); break;
#if EXPAND_ROWS == 6
                case 2: EXPAND(2); break;
                case 3: EXPAND(3); break;
                case 4: EXPAND(4); break;
                case 5: EXPAND(5); break;
#endif
                default: EXPAND(EXPAND_ROWS); break;
                }
#undef EXPAND
            for (; c + LANES <= to; c += LANES)
                for (int64_t i = 0; i < rows; i++) expand_tile(y, ys + i, ut + i * width, width, bt, n, rank, c, scale, 1, 1, is_bf16);
            for (; c < to; c++) expand_column(y, ys, rows, ut, width, bt, n, rank, c, scale, is_bf16);
        }
    }
}

int tandem_lora_check(const TandemLoraWeight *w, const int64_t *slots, int64_t m) {
    if (w == NULL || m < 0 || w->n < 1 || w->k < 1 || w->num_slots < 1 || w->num_parts < 1 || w->max_rank < 1 ||
        (w->dtype != 0 && w->dtype != 1) || w->part_ends[w->num_parts - 1] != w->n)
        return -1;
    for (int64_t p = 0; p < w->num_parts; p++)
        if (w->part_ends[p] < (p ? w->part_ends[p - 1] : 0)) return -1;
    for (int64_t t = 0; t < m; t++)
        if (slots[t] < -1 || slots[t] >= w->num_slots) return -2;
    for (int64_t i = 0; i < w->num_slots * w->num_parts; i++)
        if (w->ranks[i] < 0 || w->ranks[i] > w->max_rank) return -2;
    return 0;
}

/* Asks for the lines of [p, p + bytes) in L2 (prefetcht1). */
INLINE void prefetch(const void *p, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)p + at, 0, 2);
}

/* Pass 1's unit `unit`: its chunk, A rows [*j0, *j1) (empty past the part's rank). */
INLINE const Chunk *shrink_unit_at(const TandemLoraWeight *w, const Chunk *chunks, int64_t unit, int64_t a_units,
                                   int64_t *j0, int64_t *j1) {
    const Chunk *ch = chunks + unit / (w->num_parts * a_units);
    const int64_t p = unit / a_units % w->num_parts, rank = w->ranks[ch->slot * w->num_parts + p];
    const int64_t first = unit % a_units * UNIT_A, last = first + UNIT_A < rank ? first + UNIT_A : rank;
    *j0 = p * w->max_rank + first;
    *j1 = p * w->max_rank + (last > first ? last : first);
    return ch;
}

/* Asks for pass 1's unit's A rows. */
INLINE void prefetch_shrink_unit(const TandemLoraWeight *w, const Chunk *chunks, int64_t unit, int64_t a_units,
                                 size_t element) {
    int64_t j0, j1;
    const Chunk *ch = shrink_unit_at(w, chunks, unit, a_units, &j0, &j1);
    const size_t row = (size_t)w->k * element;
    prefetch((const char *)w->a + ((size_t)(ch->slot * w->num_parts * w->max_rank + j0)) * row, (size_t)(j1 - j0) * row);
}

/* Asks for pass 2's unit's B^T columns [lo, hi), the rows any part of the slot uses. */
INLINE void prefetch_expand_unit(const TandemLoraWeight *w, const Chunk *ch, int64_t lo, int64_t hi, size_t element) {
    int64_t rank = 0;
    for (int64_t p = 0; p < w->num_parts; p++)
        if (w->ranks[ch->slot * w->num_parts + p] > rank) rank = w->ranks[ch->slot * w->num_parts + p];
    const char *bt = (const char *)w->bt + (size_t)(ch->slot * w->max_rank * w->n + lo) * element;
    for (int64_t j = 0; j < rank; j++) prefetch(bt + (size_t)(j * w->n) * element, (size_t)(hi - lo) * element);
}

/* Both passes over the grouped rows (see the NOTEs), on the calling thread's team.
 *
 * A call of few rows a slot (a decode step's) reads each adapter's weights from memory once and does
 * little with them, so the reads set its pace: each thread first asks for all of its units' weights
 * (into L2, pass 2's then pass 1's), and for each pass-1 unit's again while it runs the one before
 * (a request dropped by a full queue). SmolLM2's deltas at 8 rows on 4 adapters, a step's 39 MB from
 * memory: 5.1 -> 3.9 ms a step; at 32 rows 7.5 -> 6.1 (one thread, Zen 4, loaded machine). A
 * prefill's calls reuse each weight over many rows from cache and ask for nothing. */
INLINE void run(const TandemLoraWeight *w, const void *x, void *y, const int64_t *order, const Chunk *chunks,
                int64_t num_chunks, int64_t adapted, float *u, int64_t work, const int is_bf16) {
    const int64_t width = w->num_parts * w->max_rank, a_units = (w->max_rank + UNIT_A - 1) / UNIT_A;
    const int64_t blocks = (w->n + COLUMNS - 1) / COLUMNS;
    const int dp = HAVE_DPBF16 && is_bf16;
    const size_t element = is_bf16 ? 2 : 4;
    const int ahead = adapted <= num_chunks * PREFETCH_ROWS;
#pragma omp parallel if (work >= PARALLEL_MIN)
    {
        int64_t begin, end;
        team_share(num_chunks * blocks, &begin, &end);
        for (int64_t unit = begin; ahead && unit < end; unit++) {
            const int64_t lo = unit % blocks * COLUMNS, hi = lo + COLUMNS < w->n ? lo + COLUMNS : w->n;
            prefetch_expand_unit(w, chunks + unit / blocks, lo, hi, element);
        }
        team_share(num_chunks * w->num_parts * a_units, &begin, &end);
        for (int64_t unit = begin; ahead && unit < end; unit++) prefetch_shrink_unit(w, chunks, unit, a_units, element);
        team_share(num_chunks * w->num_parts * a_units, &begin, &end);
        for (int64_t unit = begin; unit < end; unit++) {
            int64_t j0, j1;
            const Chunk *ch = shrink_unit_at(w, chunks, unit, a_units, &j0, &j1);
            if (ahead && unit + 1 < end) prefetch_shrink_unit(w, chunks, unit + 1, a_units, element);
            if (j0 < j1) shrink_unit(w, ch, x, order, u, width, j0, j1, is_bf16, dp);
        }
#pragma omp barrier
        team_share(num_chunks * blocks, &begin, &end);
        for (int64_t unit = begin; unit < end; unit++) {
            const int64_t lo = unit % blocks * COLUMNS, hi = lo + COLUMNS < w->n ? lo + COLUMNS : w->n;
            expand_unit(w, chunks + unit / blocks, order, u, y, width, lo, hi, is_bf16);
        }
    }
}

int tandem_lora_delta(const TandemLoraWeight *w, const void *x, void *y, const int64_t *slots, int64_t m) {
    const int checked = tandem_lora_check(w, slots, m);
    if (checked != 0) return checked;
    const int64_t num_slots = w->num_slots, width = w->num_parts * w->max_rank, k = w->k;
    int64_t adapted = 0;
    for (int64_t t = 0; t < m; t++) adapted += slots[t] >= 0;
    if (adapted == 0) return 0;
    /* Scratch: starts [num_slots + 1], order [adapted], chunks, then u [adapted, width]. */
    const int64_t max_chunks = adapted / CHUNK + num_slots;
    const size_t ints = (size_t)(num_slots + 1 + adapted + 3 * max_chunks);
    int64_t *starts = buffer_of_at_least(&buffer, sizeof(int64_t) * ints + sizeof(float) * (size_t)(adapted * width));
    if (starts == NULL) return -3;
    int64_t *order = starts + num_slots + 1;
    Chunk *chunks = (Chunk *)(order + adapted);
    float *u = (float *)(starts + ints);
    /* Counting sort by slot, rows in order within a slot. */
    memset(starts, 0, sizeof(int64_t) * (size_t)(num_slots + 1));
    for (int64_t t = 0; t < m; t++)
        if (slots[t] >= 0) starts[slots[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) starts[s + 1] += starts[s];
    int64_t num_chunks = 0;
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t first = starts[s]; first < starts[s + 1]; first += CHUNK) {
            const int64_t count = starts[s + 1] - first < CHUNK ? starts[s + 1] - first : CHUNK;
            chunks[num_chunks++] = (Chunk){s, first, count};
        }
    for (int64_t t = 0; t < m; t++)
        if (slots[t] >= 0) order[starts[slots[t]]++] = t; /* starts[s] ends as the next slot's start */
    const int64_t work = adapted * (width * k + w->max_rank * w->n);
    if (w->dtype == 1)
        run(w, x, y, order, chunks, num_chunks, adapted, u, work, 1);
    else
        run(w, x, y, order, chunks, num_chunks, adapted, u, work, 0);
    return 0;
}

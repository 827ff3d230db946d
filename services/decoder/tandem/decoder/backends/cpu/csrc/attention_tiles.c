/* Paged attention in tiles for AVX512-BF16 builds: every bf16 attention step (decode, verification
 * and prefill, any context length) when head_dim is a multiple of 64. Called by attention.c's
 * tandem_decode_attention, whose checks (lengths, block ids) have passed by then.
 *
 * Why: attention.c's kernel attends row by row in fp32, 8 lanes at a time. That is right for decode,
 * but a prefill of n tokens costs about n^2 / 2 dot products per head, and past ~640 positions
 * torch's SDPA was faster; at 4,095 tokens attention was 4.1 of a 5.3 s prefill. Here keys and values
 * come in tiles of 16 positions, both products are VDPBF16PS dot products (32 bf16 multiply-adds an
 * instruction), and the softmax runs 16 lanes at a time:
 *
 *   scores[h][t] = scale * q_h . k_t          16 keys a vector: K transposed into pairs of dimensions
 *   online softmax per query head             fp32: running maximum and sum, the output rescaled
 *   o_h += sum_t p_h[t] v_t                   p rounded to bf16, V interleaved into pairs of positions
 *
 * Numerics: products of bf16 values are exact in fp32 and every sum is fp32; the probabilities are
 * rounded to bf16 for the second product (as flash attention does on GPUs), about 2^-9 relative,
 * below the output's own bf16 rounding. One rounding at the output.
 *
 * NOTE: a row's sums run in one order whatever rows share its step: tiles start at position 0 and
 * go up in 16s, each row's own length masks its last tile (masked probabilities are exactly 0), and
 * every loop over heads or rows leaves a head's own chain of sums alone. So a prefilled position gets
 * the bits a decode step gives it, a verification step's rows the bits single steps give them, and a
 * suffix after a prefix-cache hit the bits the whole prompt gives it (up to the sign of a zero).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "limits.h"
#include "runs.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif

/* Whether this build has the tiled kernel (bf16 caches, head_dim a multiple of TANDEM_TILED_HEAD_DIM,
 * at most TANDEM_MAX_HEAD_DIM: limits.h). */
int tandem_attention_tiles_available(void) { return HAVE_TILES; }

#if HAVE_TILES

#define TILE 16         /* positions per tile: one vector of scores */
#define RUN_ROWS 16     /* rows of one sequence attended together (a prefill's, a verification's) */
#define MAX_HEADS (RUN_ROWS * TANDEM_MAX_GROUP)
#define QK_HEADS 8      /* query heads per score tile: 8 chains of dot products against one key vector */
#define PV_HEADS 6      /* query heads per output tile: 6 x 4 accumulators of 16 dimensions */
#define MAX_TOGETHER 8  /* KV heads of one sequence attended together (a decode step's) */

/* Per-thread scratch, grown once to its largest size and kept. */
typedef struct {
    float o[MAX_HEADS * TANDEM_MAX_HEAD_DIM];      /* running outputs [heads][head_dim] */
    float s[MAX_HEADS * TILE];                     /* this tile's scores [heads][16] */
    float m[MAX_HEADS], l[MAX_HEADS];              /* running maximum and sum per head */
    float corr[MAX_HEADS];                         /* this tile's rescaling per head */
    uint16_t p[MAX_HEADS * TILE];                  /* this tile's probabilities in bf16 [heads][16] */
    uint32_t kt[TANDEM_MAX_HEAD_DIM / 2 * TILE];   /* keys transposed: [pair of dimensions][position] */
    uint32_t vp[TILE / 2 * TANDEM_MAX_HEAD_DIM];   /* values: [pair of positions][dimension] */
} Scratch;

static __thread Scratch *scratch = NULL;

/* out[c] = column c of the 16 x 16 dword matrix rows[0..16) (a transpose in registers: 64 shuffles). */
static inline __attribute__((always_inline)) void transpose16(__m512i out[16], const __m512i rows[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3] */
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + k]: column 4 L + k of rows g .. g + 3 in lane L */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int k = 0; k < 4; k++) { /* gather lane L of u[k], u[4 + k], u[8 + k], u[12 + k] */
        const __m512i x = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), y = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xee);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        const __m512i y2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xee);
        out[k] = _mm512_shuffle_i32x4(x, x2, 0x88);
        out[4 + k] = _mm512_shuffle_i32x4(x, x2, 0xdd);
        out[8 + k] = _mm512_shuffle_i32x4(y, y2, 0x88);
        out[12 + k] = _mm512_shuffle_i32x4(y, y2, 0xdd);
    }
}

/* One tile's keys transposed (kt[p][t] = the dword of key t's dimensions 2p, 2p + 1) and its values
 * interleaved by pairs of positions (vp[i][d] = v[2i][d] | v[2i + 1][d] << 16), zero past n. */
static void load_tile(Scratch *w, const uint16_t *const keys[TILE], const uint16_t *const values[TILE], int64_t n,
                      int64_t head_dim) {
    for (int64_t d = 0; d < head_dim; d += 32) { /* 16 pairs of dimensions at a time */
        __m512i rows[TILE], columns[TILE];
        for (int64_t t = 0; t < TILE; t++) rows[t] = t < n ? _mm512_loadu_si512(keys[t] + d) : _mm512_setzero_si512();
        transpose16(columns, rows);
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(w->kt + (d / 2 + p) * TILE, columns[p]);
    }
    /* Values: positions 2i and 2i + 1 interleaved 16 dimensions at a time. */
    static const uint16_t interleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i low = _mm512_loadu_si512(interleave);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < TILE / 2; i++) {
        const int64_t a = 2 * i, b = 2 * i + 1;
        for (int64_t d = 0; d < head_dim; d += 32) {
            const __m512i va = a < n ? _mm512_loadu_si512(values[a] + d) : _mm512_setzero_si512();
            const __m512i vb = b < n ? _mm512_loadu_si512(values[b] + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(w->vp + i * head_dim + d, _mm512_permutex2var_epi16(va, low, vb));
            _mm512_storeu_si512(w->vp + i * head_dim + d + 16, _mm512_permutex2var_epi16(va, high, vb));
        }
    }
}

/* scores s[h][0..16) = scale * q_h . k_t for NH query heads from h0 (q_at[h]: head h's query). */
static inline __attribute__((always_inline)) void score_tile(Scratch *w, const uint16_t *const q_at[], int64_t h0,
                                                             int64_t pairs, float scale, const int NH) {
    __m512 acc[QK_HEADS];
#pragma GCC unroll 8
    for (int j = 0; j < NH; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i k = _mm512_loadu_si512(w->kt + p * TILE);
#pragma GCC unroll 8
        for (int j = 0; j < NH; j++) {
            uint32_t qp;
            memcpy(&qp, q_at[h0 + j] + 2 * p, sizeof qp);
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32((int)qp), (__m512bh)k);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NH; j++) _mm512_storeu_ps(w->s + (h0 + j) * TILE, _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
}

/* o_h = o_h * corr_h + sum_t p_h[t] v_t for NH heads from h0, dimensions [d0, d0 + 64). */
static inline __attribute__((always_inline)) void value_tile(Scratch *w, int64_t h0, int64_t d0, int64_t head_dim,
                                                             const int NH) {
    __m512 acc[PV_HEADS][4];
#pragma GCC unroll 6
    for (int j = 0; j < NH; j++) {
        const __m512 c = _mm512_set1_ps(w->corr[h0 + j]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            acc[j][v] = _mm512_mul_ps(_mm512_loadu_ps(w->o + (h0 + j) * head_dim + d0 + 16 * v), c);
    }
    for (int64_t i = 0; i < TILE / 2; i++) {
        __m512i vv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) vv[v] = _mm512_loadu_si512(w->vp + i * head_dim + d0 + 16 * v);
#pragma GCC unroll 6
        for (int j = 0; j < NH; j++) {
            uint32_t pp;
            memcpy(&pp, w->p + (h0 + j) * TILE + 2 * i, sizeof pp);
            const __m512i b = _mm512_set1_epi32((int)pp);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], (__m512bh)b, (__m512bh)vv[v]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < NH; j++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(w->o + (h0 + j) * head_dim + d0 + 16 * v, acc[j][v]);
}

/* Head h's softmax step over this tile's first n scores: running maximum and sum, its rescaling of
 * what came before (corr), and its probabilities in bf16 (exactly 0 past n). */
static inline void softmax_tile(Scratch *w, int64_t h, int64_t n) {
    const __mmask16 mask = n >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const __m512 s = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(w->s + h * TILE));
    const float tile_max = _mm512_reduce_max_ps(s);
    const float old = w->m[h], new_max = tile_max > old ? tile_max : old;
    const float corr = old == -INFINITY ? 0.0f : exp_nonpositive(old - new_max);
    const __m512 p = _mm512_maskz_mov_ps(mask, exp16_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
    w->l[h] = w->l[h] * corr + _mm512_reduce_add_ps(p);
    w->m[h] = new_max;
    w->corr[h] = corr;
    _mm256_storeu_si256((__m256i *)(w->p + h * TILE), (__m256i)_mm512_cvtneps_pbh(p));
}

/* One run being attended: rows first .. first + num_rows - 1 of one sequence (row r at context length
 * first_len + r), the query heads of KV head kv_head, its state in a Scratch of its own. */
typedef struct {
    const uint16_t *q_at[MAX_HEADS]; /* each head's query */
    const uint16_t *cache;
    const int32_t *table;
    int64_t first, num_rows, first_len, kv_head, heads, group;
} Run;

/* Shapes shared by every run of a call. */
typedef struct {
    int64_t num_heads, head_dim, block_size, row_stride, block_elems, values_offset;
    float scale;
} Shape;

static void run_begin(Scratch *w, Run *run, const uint16_t *q, const Shape *x) {
    run->heads = run->num_rows * run->group;
    for (int64_t h = 0; h < run->heads; h++) {
        run->q_at[h] = q + ((run->first + h / run->group) * x->num_heads + run->kv_head * run->group +
                            h % run->group) * x->head_dim;
        w->m[h] = -INFINITY;
        w->l[h] = 0.0f;
    }
    memset(w->o, 0, (size_t)(run->heads * x->head_dim) * sizeof(float));
}

/* Position t0's tile (t0 a multiple of 16, below the last row's length) into the run's state. */
static void run_tile(Scratch *w, const Run *run, int64_t t0, const Shape *x) {
    const int64_t group = run->group, heads = run->heads, head_dim = x->head_dim, pairs = head_dim / 2;
    const int64_t last_len = run->first_len + run->num_rows - 1, block_size = x->block_size;
    const int64_t n = last_len - t0 < TILE ? last_len - t0 : TILE;
    const uint16_t *keys[TILE], *values[TILE];
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = t0 + t;
        keys[t] = run->cache + (int64_t)run->table[pos / block_size] * x->block_elems +
                  pos % block_size * x->row_stride + run->kv_head * head_dim;
        values[t] = keys[t] + x->values_offset;
    }
    /* The next tile's rows fetched while this one computes: 16 strided pieces of a block per head,
     * which the hardware prefetcher does not follow (as attention.c found). Into L2, not L1 (locality
     * 2, prefetcht1): 64 lines a head and tile into L1 held its fill buffers, and this tile's own
     * loads waited behind them. 30 layers of 32 sequences at 160 positions 14.8 -> 8.5 ms, one
     * sequence at 1,000 4.6 -> 2.5 (Zen 4, the same bits). */
    const int64_t next_n = last_len - t0 - TILE < TILE ? last_len - t0 - TILE : TILE;
    for (int64_t t = 0; t < next_n; t++) {
        const int64_t pos = t0 + TILE + t;
        const char *key = (const char *)(run->cache + (int64_t)run->table[pos / block_size] * x->block_elems +
                                         pos % block_size * x->row_stride + run->kv_head * head_dim);
        for (int64_t b = 0; b < head_dim * 2; b += 64) {
            __builtin_prefetch(key + b, 0, 2);
            __builtin_prefetch(key + x->values_offset * 2 + b, 0, 2);
        }
    }
    load_tile(w, keys, values, n, head_dim);
    /* Rows whose context ends before this tile have nothing here: the first row that has. */
    int64_t r0 = t0 - run->first_len + 1;
    if (r0 < 0) r0 = 0;
    const uint16_t *const *q_at = run->q_at;
    int64_t h = r0 * group;
    for (; h + QK_HEADS <= heads; h += QK_HEADS) score_tile(w, q_at, h, pairs, x->scale, QK_HEADS);
    switch (heads - h) {
    case 1: score_tile(w, q_at, h, pairs, x->scale, 1); break;
    case 2: score_tile(w, q_at, h, pairs, x->scale, 2); break;
    case 3: score_tile(w, q_at, h, pairs, x->scale, 3); break;
    case 4: score_tile(w, q_at, h, pairs, x->scale, 4); break;
    case 5: score_tile(w, q_at, h, pairs, x->scale, 5); break;
    case 6: score_tile(w, q_at, h, pairs, x->scale, 6); break;
    case 7: score_tile(w, q_at, h, pairs, x->scale, 7); break;
    default: break;
    }
    for (int64_t r = r0; r < run->num_rows; r++) {
        const int64_t n_r = run->first_len + r - t0 < TILE ? run->first_len + r - t0 : TILE;
        for (int64_t g = 0; g < group; g++) softmax_tile(w, r * group + g, n_r);
    }
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        int64_t j = r0 * group;
        for (; j + PV_HEADS <= heads; j += PV_HEADS) value_tile(w, j, d0, head_dim, PV_HEADS);
        switch (heads - j) {
        case 1: value_tile(w, j, d0, head_dim, 1); break;
        case 2: value_tile(w, j, d0, head_dim, 2); break;
        case 3: value_tile(w, j, d0, head_dim, 3); break;
        case 4: value_tile(w, j, d0, head_dim, 4); break;
        case 5: value_tile(w, j, d0, head_dim, 5); break;
        default: break;
        }
    }
}

/* The run's outputs, each head's sum over its sum of probabilities, into out. */
static void run_end(const Scratch *w, const Run *run, uint16_t *out, const Shape *x) {
    for (int64_t h = 0; h < run->heads; h++) {
        const __m512 inv = _mm512_set1_ps(w->l[h] > 0.0f ? 1.0f / w->l[h] : 0.0f);
        uint16_t *dst = out + ((run->first + h / run->group) * x->num_heads + run->kv_head * run->group +
                               h % run->group) * x->head_dim;
        for (int64_t d = 0; d < x->head_dim; d += 16)
            store16_bf16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + h * x->head_dim + d), inv), 16);
    }
}

/* Runs runs[0 .. count) of one sequence (its KV heads, or one), tile by tile, each tile of every run
 * before the next tile: a sequence's KV heads together read each position's row of the cache, where
 * one head at a time reads 2 of its 6 lines (SmolLM2), on a pass of its own. */
static void attend_runs(Scratch *w, Run *runs, int64_t count, const uint16_t *q, uint16_t *out, const Shape *x) {
    const int64_t last_len = runs[0].first_len + runs[0].num_rows - 1;
    for (int64_t i = 0; i < count; i++) run_begin(w + i, runs + i, q, x);
    for (int64_t t0 = 0; t0 < last_len; t0 += TILE)
        for (int64_t i = 0; i < count; i++) run_tile(w + i, runs + i, t0, x);
    for (int64_t i = 0; i < count; i++) run_end(w + i, runs + i, out, x);
}

/* This thread's scratch, one Scratch per KV head attended together; NULL without memory. */
static __thread int64_t scratch_count = 0;
static Scratch *scratch_for(int64_t count) {
    if (count > scratch_count) {
        Scratch *grown = NULL;
        if (posix_memalign((void **)&grown, 64, (size_t)count * sizeof(Scratch)) != 0) return NULL;
        free(scratch);
        scratch = grown;
        scratch_count = count;
    }
    return scratch;
}

/* tandem_decode_attention's contract, bf16 only, its checks already passed. 0, 1 when this build or
 * these shapes are not the tiled kernel's (the caller goes on), -2 without scratch memory. */
int tandem_attention_tiles(const uint16_t *q, const uint16_t *kv_cache, const int32_t *block_tables,
                           const int32_t *seq_lens, uint16_t *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t max_blocks, float scale) {
    if (head_dim % TANDEM_TILED_HEAD_DIM != 0 || head_dim > TANDEM_MAX_HEAD_DIM ||
        num_heads / num_kv_heads > TANDEM_MAX_GROUP)
        return 1;
    const int32_t *run = tandem_find_runs(block_tables, seq_lens, num_seqs, max_blocks, block_size, RUN_ROWS);
    if (run == NULL) return -2;
    const int64_t row_stride = num_kv_heads * head_dim;
    const Shape shape = {num_heads, head_dim, block_size, row_stride, block_size * row_stride,
                         num_blocks * block_size * row_stride, scale};
    /* A sequence's KV heads are attended together (one item) when its run is one row, a decode
     * step's, and there are enough such sequences to keep every thread busy: 30 layers of 32
     * sequences at 160 positions took 15.5 against 17.7 ms (SmolLM2, Zen 4, the same bits). A
     * prefill's runs, and a few sequences' (one long context over its 3 heads), keep an item per head. */
    int64_t single = 0;
    for (int64_t s = 0; s < num_seqs; s++) single += run[s] == 1;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const int together = num_kv_heads > 1 && num_kv_heads <= MAX_TOGETHER && single >= 4 * threads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t s = item % num_seqs, kv_head = item / num_seqs, rows = run[s];
        if (rows == 0 || (together && rows == 1 && kv_head > 0)) continue; /* kv_head 0's item has them */
        const int64_t count = together && rows == 1 ? num_kv_heads : 1;
        Scratch *w = scratch_for(count);
        if (w == NULL) {
            failed = 1;
            continue;
        }
        Run runs[MAX_TOGETHER];
        for (int64_t i = 0; i < count; i++)
            runs[i] = (Run){.cache = kv_cache, .table = block_tables + s * max_blocks, .first = s, .num_rows = rows,
                            .first_len = seq_lens[s], .kv_head = kv_head + i, .group = num_heads / num_kv_heads};
        attend_runs(w, runs, count, q, out, &shape);
    }
    return failed ? -2 : 0;
}

#else

int tandem_attention_tiles(const uint16_t *q, const uint16_t *kv_cache, const int32_t *block_tables,
                           const int32_t *seq_lens, uint16_t *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t max_blocks, float scale) {
    (void)q, (void)kv_cache, (void)block_tables, (void)seq_lens, (void)out, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)num_blocks, (void)block_size, (void)max_blocks, (void)scale;
    return 1; /* not this build: attention.c's kernel does the work */
}

#endif

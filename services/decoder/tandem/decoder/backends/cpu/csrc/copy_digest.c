/* The decoder's copy of a shared-memory segment fused with the GHASH of its AES-256-GMAC digest
 * (tandem.common.torch_part.shared_memory.keyed_digest), in one pass over the segment.
 *
 * Why: the copy and the digest were two passes (numpy's copy, then OpenSSL's GMAC over the copy);
 * here each 64-byte piece of the segment is loaded once, stored into the destination and fed to
 * GHASH from the same register, so the digest covers exactly the bytes copied: a writer changing the
 * segment mid-read cannot make the copy differ from what was digested.
 *
 * No AES here: the caller passes H = E_K(0^128) and E_K(J0) (J0 = nonce || 0x00000001), computed
 * with OpenSSL. The tag is GHASH_H(data zero-padded to 16 bytes, then the length block
 * [8 * num_bytes as 64-bit big-endian || 64-bit 0]) XOR E_K(J0): GMAC with the data as associated
 * data and nothing encrypted.
 *
 * Arithmetic: GF(2^128) in GCM's bit-reflected convention, on byte-reversed blocks with the
 * shift-by-one reduction of Intel's carry-less multiplication white paper (Gueron and Kounavis).
 * The 256-bit products of many blocks (each with its own power of H) are XORed before one
 * reduction: shift and reduction are linear, so the sum reduces once per group, which keeps the
 * reduction's latency off most blocks. Groups: 32 blocks (512 bytes, 8 zmm registers of 4 blocks)
 * with VPCLMULQDQ, 8 blocks with PCLMULQDQ alone. Each block takes three carry-less multiplies
 * (Karatsuba), not four: 9.2 against 7.0 GB/s for the PCLMULQDQ form on Zen 4; the VPCLMULQDQ form
 * runs at 19 GB/s either way there (its copy included; OpenSSL's GMAC alone: 22).
 *
 * The functions carry their ISA as target attributes, so every x86-64 build level has them; the
 * caller dispatches on the CPU's flags (and the entry point checks them again: never SIGILL).
 */
#include <stdint.h>
#include <string.h>

#define TANDEM_GHASH_BLOCK 16

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET_NARROW __attribute__((target("pclmul,ssse3,sse4.1")))
#define TARGET_WIDE __attribute__((target("pclmul,ssse3,sse4.1,avx2,avx512f,avx512bw,vpclmulqdq")))
#define NARROW_GROUP 8 /* blocks per reduction, PCLMULQDQ */
#define WIDE_REGS 8    /* zmm registers of 4 blocks per reduction, VPCLMULQDQ */
#define WIDE_GROUP (4 * WIDE_REGS)

TARGET_NARROW static inline __m128i byte_reversed(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* lo, mid, hi += the unreduced product a * b (mid: the two cross terms, not yet split). */
TARGET_NARROW static inline void multiply_add(__m128i a, __m128i b, __m128i *lo, __m128i *mid, __m128i *hi) {
    *lo = _mm_xor_si128(*lo, _mm_clmulepi64_si128(a, b, 0x00));
    *hi = _mm_xor_si128(*hi, _mm_clmulepi64_si128(a, b, 0x11));
    *mid = _mm_xor_si128(*mid, _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10)));
}

/* The same by Karatsuba, three multiplies instead of four: b_folded holds b's two halves XORed in
 * its low half, and mid collects (a_lo ^ a_hi)(b_lo ^ b_hi), which becomes the cross terms once the
 * group's lo and hi are XORed into it (`karatsuba_reduce`). */
TARGET_NARROW static inline void karatsuba_add(
    __m128i a, __m128i b, __m128i b_folded, __m128i *lo, __m128i *mid, __m128i *hi) {
    *lo = _mm_xor_si128(*lo, _mm_clmulepi64_si128(a, b, 0x00));
    *hi = _mm_xor_si128(*hi, _mm_clmulepi64_si128(a, b, 0x11));
    __m128i a_folded = _mm_xor_si128(a, _mm_shuffle_epi32(a, 0x4E));
    *mid = _mm_xor_si128(*mid, _mm_clmulepi64_si128(a_folded, b_folded, 0x00));
}

TARGET_NARROW static inline __m128i folded_halves(__m128i b) {
    return _mm_xor_si128(b, _mm_shuffle_epi32(b, 0x4E));
}

/* The 256-bit sum of products (lo, mid, hi) reduced to one field element. */
TARGET_NARROW static inline __m128i reduce(__m128i lo, __m128i mid, __m128i hi) {
    __m128i t3 = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
    __m128i t6 = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
    /* The product of two reflected values is the reflected product shifted right by one: shift the
     * 256 bits left by one. */
    __m128i t7 = _mm_srli_epi32(t3, 31);
    __m128i t8 = _mm_srli_epi32(t6, 31);
    t3 = _mm_slli_epi32(t3, 1);
    t6 = _mm_slli_epi32(t6, 1);
    __m128i t9 = _mm_srli_si128(t7, 12);
    t8 = _mm_slli_si128(t8, 4);
    t7 = _mm_slli_si128(t7, 4);
    t3 = _mm_or_si128(t3, t7);
    t6 = _mm_or_si128(t6, t8);
    t6 = _mm_or_si128(t6, t9);
    /* Modulo x^128 + x^7 + x^2 + x + 1, reflected. */
    t7 = _mm_slli_epi32(t3, 31);
    t8 = _mm_slli_epi32(t3, 30);
    t9 = _mm_slli_epi32(t3, 25);
    t7 = _mm_xor_si128(_mm_xor_si128(t7, t8), t9);
    t8 = _mm_srli_si128(t7, 4);
    t7 = _mm_slli_si128(t7, 12);
    t3 = _mm_xor_si128(t3, t7);
    __m128i t2 = _mm_srli_epi32(t3, 1);
    __m128i t4 = _mm_srli_epi32(t3, 2);
    __m128i t5 = _mm_srli_epi32(t3, 7);
    t2 = _mm_xor_si128(_mm_xor_si128(t2, t4), _mm_xor_si128(t5, t8));
    t3 = _mm_xor_si128(t3, t2);
    return _mm_xor_si128(t6, t3);
}

TARGET_NARROW static inline __m128i multiply(__m128i a, __m128i b) {
    __m128i lo = _mm_setzero_si128(), mid = _mm_setzero_si128(), hi = _mm_setzero_si128();
    multiply_add(a, b, &lo, &mid, &hi);
    return reduce(lo, mid, hi);
}

/* powers[i] = H^(count - i), i < count: a group's first block takes the highest power. */
TARGET_NARROW static void descending_powers(__m128i h, __m128i *powers, int count) {
    __m128i power = h;
    for (int i = count - 1; i >= 0; i--) {
        powers[i] = power;
        power = multiply(power, h);
    }
}

/* One block at a time: the tail after the groups, and the final partial and length blocks. */
TARGET_NARROW static __m128i copy_blocks(
    __m128i acc, __m128i h, uint8_t *restrict dst, const uint8_t *restrict src, int64_t num_blocks) {
    for (int64_t b = 0; b < num_blocks; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(src + b * TANDEM_GHASH_BLOCK));
        _mm_storeu_si128((__m128i *)(dst + b * TANDEM_GHASH_BLOCK), raw);
        acc = multiply(_mm_xor_si128(acc, byte_reversed(raw)), h);
    }
    return acc;
}

/* The partial block (if any) and the length block, then the tag: shared by both widths. */
TARGET_NARROW static void finish(
    __m128i acc, __m128i h, uint8_t *restrict dst, const uint8_t *restrict src, int64_t num_bytes,
    const uint8_t *mask, uint8_t *tag) {
    int64_t rest = num_bytes % TANDEM_GHASH_BLOCK;
    if (rest) {
        /* Read once into a zeroed block: the copy and the digest take these same bytes. */
        uint8_t block[TANDEM_GHASH_BLOCK] = {0};
        int64_t start = num_bytes - rest;
        memcpy(block, src + start, (size_t)rest);
        memcpy(dst + start, block, (size_t)rest);
        acc = multiply(_mm_xor_si128(acc, byte_reversed(_mm_loadu_si128((const __m128i *)block))), h);
    }
    uint8_t lengths[TANDEM_GHASH_BLOCK] = {0};
    uint64_t bits = (uint64_t)num_bytes * 8;
    for (int i = 0; i < 8; i++) lengths[i] = (uint8_t)(bits >> (56 - 8 * i));
    acc = multiply(_mm_xor_si128(acc, byte_reversed(_mm_loadu_si128((const __m128i *)lengths))), h);
    __m128i out = _mm_xor_si128(byte_reversed(acc), _mm_loadu_si128((const __m128i *)mask));
    _mm_storeu_si128((__m128i *)tag, out);
}

TARGET_NARROW static void copy_ghash_narrow(
    uint8_t *restrict dst, const uint8_t *restrict src, int64_t num_bytes, const uint8_t *hash_key,
    const uint8_t *mask, uint8_t *tag) {
    __m128i h = byte_reversed(_mm_loadu_si128((const __m128i *)hash_key));
    __m128i powers[NARROW_GROUP], powers_folded[NARROW_GROUP];
    descending_powers(h, powers, NARROW_GROUP);
    for (int i = 0; i < NARROW_GROUP; i++) powers_folded[i] = folded_halves(powers[i]);
    __m128i acc = _mm_setzero_si128();
    int64_t num_blocks = num_bytes / TANDEM_GHASH_BLOCK, b = 0;
    for (; b + NARROW_GROUP <= num_blocks; b += NARROW_GROUP) {
        __m128i lo = _mm_setzero_si128(), mid = _mm_setzero_si128(), hi = _mm_setzero_si128();
        for (int i = 0; i < NARROW_GROUP; i++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(src + (b + i) * TANDEM_GHASH_BLOCK));
            _mm_storeu_si128((__m128i *)(dst + (b + i) * TANDEM_GHASH_BLOCK), raw);
            __m128i block = byte_reversed(raw);
            if (i == 0) block = _mm_xor_si128(block, acc);
            karatsuba_add(block, powers[i], powers_folded[i], &lo, &mid, &hi);
        }
        acc = reduce(lo, _mm_xor_si128(mid, _mm_xor_si128(lo, hi)), hi);
    }
    acc = copy_blocks(acc, h, dst + b * TANDEM_GHASH_BLOCK, src + b * TANDEM_GHASH_BLOCK, num_blocks - b);
    finish(acc, h, dst, src, num_bytes, mask, tag);
}

TARGET_WIDE static inline __m128i folded(__m512i x) {
    return _mm_xor_si128(
        _mm_xor_si128(_mm512_extracti32x4_epi32(x, 0), _mm512_extracti32x4_epi32(x, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(x, 2), _mm512_extracti32x4_epi32(x, 3)));
}

TARGET_WIDE static void copy_ghash_wide(
    uint8_t *restrict dst, const uint8_t *restrict src, int64_t num_bytes, const uint8_t *hash_key,
    const uint8_t *mask, uint8_t *tag) {
    __m128i h = byte_reversed(_mm_loadu_si128((const __m128i *)hash_key));
    __m128i powers[WIDE_GROUP];
    descending_powers(h, powers, WIDE_GROUP);
    __m512i wide_powers[WIDE_REGS], wide_folded[WIDE_REGS]; /* lane j of register r: H^(WIDE_GROUP - 4r - j) */
    for (int r = 0; r < WIDE_REGS; r++) {
        wide_powers[r] = _mm512_loadu_si512((const void *)&powers[4 * r]);
        wide_folded[r] = _mm512_xor_si512(wide_powers[r], _mm512_shuffle_epi32(wide_powers[r], (_MM_PERM_ENUM)0x4E));
    }
    const __m512i reverse = _mm512_broadcast_i32x4(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m128i acc = _mm_setzero_si128();
    int64_t num_blocks = num_bytes / TANDEM_GHASH_BLOCK, b = 0;
    for (; b + WIDE_GROUP <= num_blocks; b += WIDE_GROUP) {
        __m512i lo = _mm512_setzero_si512(), mid = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int r = 0; r < WIDE_REGS; r++) {
            /* One 64-byte piece: loaded once, stored, and hashed from the same register. */
            __m512i raw = _mm512_loadu_si512((const void *)(src + (b + 4 * r) * TANDEM_GHASH_BLOCK));
            _mm512_storeu_si512((void *)(dst + (b + 4 * r) * TANDEM_GHASH_BLOCK), raw);
            __m512i block = _mm512_shuffle_epi8(raw, reverse);
            if (r == 0) block = _mm512_xor_si512(block, _mm512_inserti32x4(_mm512_setzero_si512(), acc, 0));
            __m512i p = wide_powers[r];
            __m512i block_folded = _mm512_xor_si512(block, _mm512_shuffle_epi32(block, (_MM_PERM_ENUM)0x4E));
            lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(block, p, 0x00));
            hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(block, p, 0x11));
            mid = _mm512_xor_si512(mid, _mm512_clmulepi64_epi128(block_folded, wide_folded[r], 0x00));
        }
        __m128i lo_sum = folded(lo), hi_sum = folded(hi);
        acc = reduce(lo_sum, _mm_xor_si128(folded(mid), _mm_xor_si128(lo_sum, hi_sum)), hi_sum);
    }
    acc = copy_blocks(acc, h, dst + b * TANDEM_GHASH_BLOCK, src + b * TANDEM_GHASH_BLOCK, num_blocks - b);
    finish(acc, h, dst, src, num_bytes, mask, tag);
}

/* Copies src[0, num_bytes) to dst (not overlapping) and writes the GMAC tag of those bytes to tag[16],
 * given hash_key[16] = E_K(0^128) and mask[16] = E_K(J0). wide: the VPCLMULQDQ form. Returns 0; -1 for
 * a negative length; -2 where this CPU lacks the instructions asked for (nothing is touched then). */
int tandem_copy_ghash(
    void *dst, const void *src, int64_t num_bytes, const uint8_t *hash_key, const uint8_t *mask,
    uint8_t *tag, int wide) {
    if (num_bytes < 0) return -1;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("pclmul") || !__builtin_cpu_supports("ssse3") || !__builtin_cpu_supports("sse4.1"))
        return -2;
    if (wide) {
        if (!__builtin_cpu_supports("vpclmulqdq") || !__builtin_cpu_supports("avx512f") ||
            !__builtin_cpu_supports("avx512bw"))
            return -2;
        copy_ghash_wide((uint8_t *)dst, (const uint8_t *)src, num_bytes, hash_key, mask, tag);
    } else {
        copy_ghash_narrow((uint8_t *)dst, (const uint8_t *)src, num_bytes, hash_key, mask, tag);
    }
    return 0;
}

#else

int tandem_copy_ghash(
    void *dst, const void *src, int64_t num_bytes, const uint8_t *hash_key, const uint8_t *mask,
    uint8_t *tag, int wide) {
    (void)dst, (void)src, (void)num_bytes, (void)hash_key, (void)mask, (void)tag, (void)wide;
    return -2; /* no carry-less multiply here: the caller keeps the copy and OpenSSL's digest */
}

#endif

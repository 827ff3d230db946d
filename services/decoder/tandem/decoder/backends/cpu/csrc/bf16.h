/* bf16 <-> fp32 for the C kernels (attention.c, linear.c, layer.c): bf16 is the top
 * half of a float. */
#ifndef TANDEM_NATIVE_BF16_H
#define TANDEM_NATIVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does; NaN stays a quiet NaN. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* f32_to_bf16 on 16 lanes, the first `valid` stored to out: the same bits, lane by lane. */
static inline __attribute__((always_inline)) void store16_bf16(uint16_t *out, __m512 s, int valid) {
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
    const __m512i bits = _mm512_castps_si512(s);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

/* store16_bf16 of 16 fp32 sums plus 16 bf16 biases (bias NULL: none), a linear's last step. */
static inline __attribute__((always_inline)) void store16_bias_bf16(uint16_t *out, __m512 s, const uint16_t *bias,
                                                                    int valid) {
    if (bias != NULL) {
        const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
        const __m512i b = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16);
        s = _mm512_add_ps(s, _mm512_castsi512_ps(b));
    }
    store16_bf16(out, s, valid);
}
#endif

#endif

/* exp of a non-positive argument for the C kernels (softmax in attention.c, silu in layer.c):
 * written out so that a loop of them vectorises, where libm's expf is one scalar call per element. */
#ifndef TANDEM_NATIVE_EXP_H
#define TANDEM_NATIVE_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0: 2^k * p(r) with |r| <= ln2/2 and a degree-6 polynomial, about 1 ulp; 0 < result <= 1
 * (arguments below -87 give exp(-87), about 1.6e-38, instead of a denormal). */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_nonpositive on 8 lanes: the same steps, each product-and-add one FMA; NaN in, NaN out. For the
 * softmax of decode attention, whose scalar loop (16 exps a block per query head) was a fifth of the
 * kernel's time. */
static inline __attribute__((always_inline)) __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x); /* this operand order keeps a NaN x a NaN */
    const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
/* exp_nonpositive on 16 lanes (the tiled attention's softmax, attention_tiles.c): exp8_nonpositive's
 * steps in AVX-512. */
static inline __attribute__((always_inline)) __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* this operand order keeps a NaN x a NaN */
    const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#endif

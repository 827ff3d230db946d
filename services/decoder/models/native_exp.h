/* exp of a non-positive argument for the C kernels (softmax in native_kernels.c, silu in
 * layer_kernels.c): written out so that a loop of them vectorises, where libm's expf is one scalar
 * call per element (silu over a 4-row step's 6,144 gate values cost 75 us a layer that way). */
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

#endif

/* Single elements the quantized linears (linear_quant.c, linear_int8.c) read and write outside their
 * vector paths: an fp16 scale or offset as fp32, and a row's input or output in the call's dtype
 * (tandem_linear's: 1 = bf16, 0 = float32). */
#ifndef TANDEM_NATIVE_ELEMENTS_H
#define TANDEM_NATIVE_ELEMENTS_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Exact: every fp16 value, subnormals, infinities and NaNs included, is an fp32 value. */
static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2^-24, exact in fp32 */
        float f = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x[i] as fp32. */
static inline float input(const void *x, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* out[i] = v + bias[f] (bias NULL: none), rounded once to the dtype. */
static inline void store(void *out, int64_t i, float v, const void *bias, int64_t f, int dtype) {
    if (dtype == 1) {
        if (bias != NULL) v += bf16_to_f32(((const uint16_t *)bias)[f]);
        ((uint16_t *)out)[i] = f32_to_bf16(v);
    } else {
        if (bias != NULL) v += ((const float *)bias)[f];
        ((float *)out)[i] = v;
    }
}

#endif

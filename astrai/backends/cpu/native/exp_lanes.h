/* Shared by the kernels that include it (decode_step.c, decode_attention.c). */
#ifndef ASTRAI_EXP_LANES_H
#define ASTRAI_EXP_LANES_H

#include <math.h>
#include <stdint.h>

/* e^x in a form the compiler vectorises: libm's expf is a call per element (glibc declares its
 * vector expf only under -ffinite-math-only, which the NaN checks here cannot have). The
 * decode step's SiLU takes a layer's feed-forward width of them, and decode attention one per
 * head and position of the context: without it they are most of what a step spends outside
 * its matmuls, and most of a long context's attention. The usual reduction: x = k ln2 + r with
 * |r| <= ln2 / 2 (ln2 split in two so k ln2 is exact), e^r by a degree-6 polynomial
 * (Cephes' coefficients; within 1 ulp of expf over -87..88), times 2^k built in the
 * exponent bits. Inputs are clamped to where 2^k is a normal float; a NaN passes the
 * clamps (comparisons with it are false) and stays NaN. */
static inline float exp_lanes(float x)
{
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float k = rintf(x * 1.44269504088896341f);
    const float r = fmaf(k, 2.12194440e-4f, fmaf(k, -0.693359375f, x));  /* fused: no reassociation */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)k + 127) << 23 };
    return p * scale.f;
}

#endif

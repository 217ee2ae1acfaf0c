/* convert.h: portable scalar conversions between storage dtypes and the
 * compute type.  Vectorised versions live in simd.h per ISA. */
#ifndef FA_CONVERT_H
#define FA_CONVERT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "fastattn.h"

static inline float fa_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal half: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
}

/* Round to nearest even, overflow to inf, NaN kept NaN. */
static inline uint16_t fa_f32_to_f16(float f)
{
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520 */
    if (ax < 0x38800000u) { /* result is subnormal half or zero */
        if (ax < 0x33000000u) return (uint16_t)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14 + (113 - e) - 1 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((ax >> 13) - ((127 - 15) << 10));
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

static inline float fa_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f;
}

static inline uint16_t fa_f32_to_bf16(float f)
{
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* fp8 e5m2 is the upper byte of a float16 (same exponent bias, infinities
 * and NaNs): exact. */
static inline float fa_e5m2_to_f32(uint8_t b) { return fa_f16_to_f32((uint16_t)(b << 8)); }

/* fp8 e4m3fn (bias 7, no infinities, 0x7f / 0xff NaN) to float, exactly:
 * its sign, exponent and mantissa placed as a float16's (bits 14..7), which
 * scales the value by 2^-8 (exponent bias 15 against 7, subnormals alike),
 * then times 2^8.  The vector loads (simd.h) do the same in registers. */
static inline float fa_e4m3_to_f32(uint8_t b)
{
    if ((b & 0x7f) == 0x7f) return NAN;
    return fa_f16_to_f32((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.0f;
}

/* The largest |x| over n rows of d elements of dtype dt (row r at base + r *
 * ld bytes), +inf when one is inf or NaN.  On the magnitude bits as unsigned
 * integers, whose order is that of the magnitudes of finite floats and which
 * put inf and NaN above them all: an integer max, which the compiler
 * vectorises (a float max with NaN checks it does not). */
#define FA_ABSMAX_ROWS(UT, MASK, INF)                                                  \
    UT mx = 0;                                                                         \
    for (int64_t r = 0; r < n; r++) {                                                  \
        const UT *u = (const UT *)((const char *)base + r * ld);                        \
        for (int64_t e = 0; e < d; e++) { const UT a = u[e] & (MASK); mx = a > mx ? a : mx; } \
    }                                                                                  \
    if (mx >= (INF)) return INFINITY;
static inline double fa_absmax(const void *base, int dt, int64_t n, int64_t d, int64_t ld)
{
    switch (dt) {
    case FA_F32: {
        FA_ABSMAX_ROWS(uint32_t, 0x7fffffffu, 0x7f800000u)
        float f; memcpy(&f, &mx, 4); return f;
    }
    case FA_F64: {
        FA_ABSMAX_ROWS(uint64_t, 0x7fffffffffffffffull, 0x7ff0000000000000ull)
        double f; memcpy(&f, &mx, 8); return f;
    }
    case FA_F16: {
        FA_ABSMAX_ROWS(uint16_t, 0x7fffu, 0x7c00u)
        return fa_f16_to_f32(mx);
    }
    default: {
        FA_ABSMAX_ROWS(uint16_t, 0x7fffu, 0x7f80u)
        return fa_bf16_to_f32(mx);
    }
    }
}
#undef FA_ABSMAX_ROWS

static inline double fa_load_elem(const void *base, int dt, int64_t idx)
{
    switch (dt) {
    case FA_F32: return ((const float *)base)[idx];
    case FA_F64: return ((const double *)base)[idx];
    case FA_F16: return fa_f16_to_f32(((const uint16_t *)base)[idx]);
    case FA_I8: return ((const int8_t *)base)[idx];
    case FA_E4M3: return fa_e4m3_to_f32(((const uint8_t *)base)[idx]);
    case FA_E5M2: return fa_e5m2_to_f32(((const uint8_t *)base)[idx]);
    default: return fa_bf16_to_f32(((const uint16_t *)base)[idx]);
    }
}

static inline void fa_store_elem(void *base, int dt, int64_t idx, double x)
{
    switch (dt) {
    case FA_F32: ((float *)base)[idx] = (float)x; break;
    case FA_F64: ((double *)base)[idx] = x; break;
    case FA_F16: ((uint16_t *)base)[idx] = fa_f32_to_f16((float)x); break;
    default: ((uint16_t *)base)[idx] = fa_f32_to_bf16((float)x); break;
    }
}

static inline int fa_dtype_8(int dt) { return dt == FA_I8 || dt == FA_E4M3 || dt == FA_E5M2; } /* 8-bit K/V */
static inline size_t fa_dtype_size(int dt) { return dt == FA_F64 ? 8 : dt == FA_F32 ? 4 : fa_dtype_8(dt) ? 1 : 2; }
static inline int fa_dtype_16(int dt) { return dt == FA_F16 || dt == FA_BF16; } /* 16-bit storage */

#endif

/* simd.h: the small vector vocabulary each kernel is written in.  Exactly one
 * of FA_TARGET_AVX512, FA_TARGET_AVX2, FA_TARGET_NEON, FA_TARGET_SVE or none
 * (portable, REAL = float or double)
 * is defined by the including compile unit, which is built with matching
 * compiler flags.  Every ISA-specific instruction of fastattn lives here. */
#ifndef FA_SIMD_H
#define FA_SIMD_H

#include <math.h>
#include <stdint.h>
#include "convert.h"

#define FA_INLINE static inline __attribute__((always_inline))

/* The vector ISAs' fa_cvt_row hands 8-bit rows to this (defined once, below
 * the ISA sections, over their vf_load_* hooks). */
FA_INLINE void fa_cvt_row8(float *dst, const uint8_t *src, int dt, int64_t n);

/* 2^f on f in [-0.5, 0.5]: Taylor series of degree 7 (truncation < 6e-9). */
#define FA_EXP2_C1 0.6931471805599453f
#define FA_EXP2_C2 0.2402265069591007f
#define FA_EXP2_C3 0.05550410866482158f
#define FA_EXP2_C4 0.009618129107628477f
#define FA_EXP2_C5 0.0013333558146428443f
#define FA_EXP2_C6 0.00015403530393381606f
#define FA_EXP2_C7 1.525273380405984e-05f

/* 2^f on f in [-0.5, 0.5] for the kernels' softmax (vf_exp2_neg): degree 5,
 * constant term exactly 1 (so a score equal to the row's reference has
 * weight exactly 1), the other coefficients fitted for minimax relative
 * error (iteratively reweighted least squares on 40001 Chebyshev points,
 * float64, then rounded to float).  Evaluated by float32 Horner it is within 2.3 ulp of 2^f on
 * every float of the interval (1.3e-7 relative; the degree-7 Taylor series
 * of vf_exp2 is within 1.2 ulp); two FMAs fewer per vector.  PyTorch's CPU
 * flash kernel uses a 20-ulp exp. */
#define FA_EXP2N_C1 0.6931470036506653f
#define FA_EXP2N_C2 0.24022242426872253f
#define FA_EXP2N_C3 0.05550733581185341f
#define FA_EXP2N_C4 0.009671512991189957f
#define FA_EXP2N_C5 0.001326472731307149f

#if defined(FA_TARGET_AVX512) || defined(FA_TARGET_AVX2)
#include <immintrin.h>
#endif
#if defined(FA_TARGET_AVX512) && defined(FA_EMULATE_AVX512)
#include "avx512_emu.h" /* test-only build: AVX-512 lanes from AVX2 pairs */
#endif

#if defined(FA_TARGET_AVX512)
/* ------------------------------------------------------------ AVX-512F */
typedef float REAL;
typedef __m512 vf;
#define VW 16
#define vf_load(p) _mm512_loadu_ps(p)
/* VW 16-bit values at p (const uint16_t *) widened to float. */
#define vf_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define vf_load_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* VW 8-bit values at p (const int8_t * / const uint8_t *) widened to float.
 * e5m2 is a float16's upper byte: each byte moved to the top of a 16-bit
 * lane, then VCVTPH2PS.  e4m3fn, exactly (fa_e4m3_to_f32's rule): each byte
 * sign-extended to 16 bits and shifted left by 7 puts its exponent and
 * mantissa in a float16's bits 13..7 and its sign in bits 15 and 14; clearing
 * bit 14 leaves the float16 of the value times 2^-8 (subnormals alike:
 * VCVTPH2PS ignores DAZ).  NaN bytes (exponent and mantissa all ones: bits
 * 13..7 set) are OR-ed to all ones, a float16 NaN.  Then times 2^8.  Six
 * integer operations per 16 (AVX-512) or 8 (AVX2) values, three of them for
 * NaN, besides the load, the conversion and the product. */
#define vf_load_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define vf_load_e5m2(p) _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p))), 8))
FA_INLINE __m512 vf_load_e4m3(const uint8_t *p)
{
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xbf80));
    const __m256i em = _mm256_and_si256(h, _mm256_set1_epi16(0x3f80));
    const __m256i nan = _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x3f80));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(h, nan)), _mm512_set1_ps(256.0f));
}
#define vf_store(p, x) _mm512_storeu_ps((p), (x))
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_zero() _mm512_setzero_ps()
#define vf_fma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define vf_mul(a, b) _mm512_mul_ps((a), (b))
#define vf_add(a, b) _mm512_add_ps((a), (b))
#define vf_sub(a, b) _mm512_sub_ps((a), (b))
#define vf_max(a, b) _mm512_max_ps((a), (b))
FA_INLINE float vf_hsum(vf x) { return _mm512_reduce_add_ps(x); }
FA_INLINE float vf_hmax(vf x) { return _mm512_reduce_max_ps(x); }
#define vf_min(a, b) _mm512_min_ps((a), (b))
#define vf_round(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* p * 2^n for integral n in [-150, 128], as two factors in the normal range
 * so that a denormal result is rounded once. */
FA_INLINE vf vf_ldexp2(vf p, vf n)
{
    __m512i ni = _mm512_cvtps_epi32(n);
    __m512i n1 = _mm512_srai_epi32(ni, 1);
    __m512i n2 = _mm512_sub_epi32(ni, n1);
    vf s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
    vf s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
    return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}
/* The float whose bits are those of t shifted left by 23. */
#define vf_shl23(t) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23))
/* p * 2^n for integral n (vscalefps: one operation; results below 2^-126
 * flush to zero under FTZ). */
#define vf_scalef(p, n) _mm512_scalef_ps((p), (n))
#define FA_HAVE_SCALEF 1
/* Lane masks OR-ed over vectors: vm_or_ge(m, x, lim) adds the lanes where
 * x >= lim or either is NaN (unordered; -inf >= -inf), vm_any tests for any. */
typedef __mmask16 vm;
#define vm_none() ((vm)0)
#define vm_or_ge(m, x, lim) ((vm)((m) | _mm512_cmp_ps_mask((x), (lim), _CMP_NLT_UQ)))
#define vm_any(m) ((m) != 0)



#elif defined(FA_TARGET_AVX2)
/* ------------------------------------------------------ AVX2 + FMA + F16C */
typedef float REAL;
typedef __m256 vf;
#define VW 8
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define vf_load_bf16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
/* VW 8-bit values widened to float (see the AVX-512 section). */
#define vf_load_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define vf_load_e5m2(p) _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(p))))
FA_INLINE __m256 vf_load_e4m3(const uint8_t *p)
{
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                    _mm_set1_epi16((short)0xbf80));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3f80)), _mm_set1_epi16(0x3f80));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(h, nan)), _mm256_set1_ps(256.0f));
}
/* 16 fp8 values as two vectors (the first 8 in *a): e4m3's integer operations
 * once on 16 lanes of 16 bits (vf_load_e4m3 runs them on 8), e5m2's one load. */
#define FA_HAVE_LOAD2 1
FA_INLINE void vf_load2_e4m3(const uint8_t *p, __m256 *a, __m256 *b)
{
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xbf80));
    const __m256i x = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)),
                                                            _mm256_set1_epi16(0x3f80)));
    const __m256 k = _mm256_set1_ps(256.0f);
    *a = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(x)), k);
    *b = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(x, 1)), k);
}
FA_INLINE void vf_load2_e5m2(const uint8_t *p, __m256 *a, __m256 *b)
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    *a = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, x));
    *b = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, x));
}
#define vf_store(p, x) _mm256_storeu_ps((p), (x))
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_zero() _mm256_setzero_ps()
#define vf_fma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define vf_mul(a, b) _mm256_mul_ps((a), (b))
#define vf_add(a, b) _mm256_add_ps((a), (b))
#define vf_sub(a, b) _mm256_sub_ps((a), (b))
#define vf_max(a, b) _mm256_max_ps((a), (b))
FA_INLINE float vf_hsum(vf x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
FA_INLINE float vf_hmax(vf x)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define vf_min(a, b) _mm256_min_ps((a), (b))
#define vf_round(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* p * 2^n for integral n in [-150, 128], as two factors in the normal range
 * so that a denormal result is rounded once. */
FA_INLINE vf vf_ldexp2(vf p, vf n)
{
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    vf s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
/* The float whose bits are those of t shifted left by 23. */
#define vf_shl23(t) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23))
/* Lane masks (see the AVX-512 section). */
typedef __m256 vm;
#define vm_none() _mm256_setzero_ps()
#define vm_or_ge(m, x, lim) _mm256_or_ps((m), _mm256_cmp_ps((x), (lim), _CMP_NLT_UQ))
#define vm_any(m) (_mm256_movemask_ps(m) != 0)



#elif defined(FA_TARGET_NEON)
/* ------------------------------------------------- AArch64 Advanced SIMD */
/* Every AArch64 CPU has these 128-bit float32 vectors, with FMA and the
 * float16 conversions (FCVTL): the unit needs no compiler flag.  32 vector
 * registers, 4 floats each.  x86's max/min semantics are kept exactly (the
 * kernels rely on them around NaN: the SECOND operand when either is NaN),
 * so FMAX/FMIN (NaN from either) are not used for vf_max/vf_min. */
#include <arm_neon.h>
#include <string.h>
typedef float REAL;
typedef float32x4_t vf;
#define VW 4
#define vf_load(p) vld1q_f32(p)
#define vf_load_f16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p))))
#define vf_load_bf16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(p)), 16))
/* Four bytes at p as the low lanes of a 64-bit vector (any alignment). */
FA_INLINE uint8x8_t fa_neon_load4(const void *p)
{
    uint32_t u;
    memcpy(&u, p, 4);
    return vreinterpret_u8_u32(vdup_n_u32(u));
}
/* 8-bit values widened to float (the rules of the AVX-512 section: e5m2 a
 * float16's upper byte; e4m3fn through float16 times 2^8, NaN kept). */
#define vf_load_i8(p) vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(fa_neon_load4(p))))))
#define vf_load_e5m2(p) vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(vshll_n_u8(fa_neon_load4(p), 8))))
FA_INLINE float32x4_t vf_load_e4m3(const uint8_t *p)
{
    const int16x4_t w = vget_low_s16(vmovl_s8(vreinterpret_s8_u8(fa_neon_load4(p))));
    const uint16x4_t h = vand_u16(vreinterpret_u16_s16(vshl_n_s16(w, 7)), vdup_n_u16(0xbf80));
    const uint16x4_t nan = vceq_u16(vand_u16(h, vdup_n_u16(0x3f80)), vdup_n_u16(0x3f80));
    return vmulq_n_f32(vcvt_f32_f16(vreinterpret_f16_u16(vorr_u16(h, nan))), 256.0f);
}
#define vf_store(p, x) vst1q_f32((p), (x))
#define vf_set1(x) vdupq_n_f32(x)
#define vf_zero() vdupq_n_f32(0.0f)
#define vf_fma(a, b, c) vfmaq_f32((c), (a), (b))
#define vf_mul(a, b) vmulq_f32((a), (b))
#define vf_add(a, b) vaddq_f32((a), (b))
#define vf_sub(a, b) vsubq_f32((a), (b))
FA_INLINE vf fa_neon_max(vf a, vf b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
FA_INLINE vf fa_neon_min(vf a, vf b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
#define vf_max(a, b) fa_neon_max((a), (b))
#define vf_min(a, b) fa_neon_min((a), (b))
FA_INLINE float vf_hsum(vf x) { return vaddvq_f32(x); }
FA_INLINE float vf_hmax(vf x) { return vmaxvq_f32(x); }
#define vf_round(x) vrndnq_f32(x)
/* p * 2^n for integral n in [-150, 128] (see the AVX-512 section). */
FA_INLINE vf vf_ldexp2(vf p, vf n)
{
    const int32x4_t ni = vcvtnq_s32_f32(n), n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    const vf s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    const vf s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, s1), s2);
}
#define vf_shl23(t) vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_f32(t), 23))
/* Lane masks (see the AVX-512 section): all ones where x >= lim or unordered. */
typedef uint32x4_t vm;
#define vm_none() vdupq_n_u32(0)
#define vm_or_ge(m, x, lim) vorrq_u32((m), vmvnq_u32(vcltq_f32((x), (lim))))
#define vm_any(m) (vmaxvq_u32(m) != 0)

#elif defined(FA_TARGET_SVE)
/* ------------------------------------------- AArch64 SVE, fixed length */
/* Built with -msve-vector-bits=N (N = 256 or 512: setup.py's sve256 and
 * sve512 units), so that a vector is a sized type the kernels' register
 * blocks can hold in arrays, as they hold the x86 vectors; dispatch.c runs
 * a unit only on a CPU whose vector length is its N (prctl's SVE length).
 * All lanes are active (svptrue): tails are the kernels' own, as on x86.
 * 16- and 8-bit values are loaded widened into 32-bit containers
 * (LD1H/LD1B), whose low halves FCVT reads as float16 (the same bit
 * rules as the NEON and AVX-512 sections). */
#include <arm_sve.h>
#include <string.h>
#if !defined(__ARM_FEATURE_SVE_BITS) || __ARM_FEATURE_SVE_BITS == 0
#error "an SVE unit is built with -msve-vector-bits=N"
#endif
typedef float REAL;
typedef svfloat32_t vf __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
typedef svbool_t vm __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
#define VW (__ARM_FEATURE_SVE_BITS / 32)
#define FA_SVE_ALL svptrue_b32()
#define vf_load(p) svld1_f32(FA_SVE_ALL, (p))
#define fa_sve_f16(u) svcvt_f32_f16_x(FA_SVE_ALL, svreinterpret_f16_u32(u))
#define vf_load_f16(p) fa_sve_f16(svld1uh_u32(FA_SVE_ALL, (const uint16_t *)(p)))
#define vf_load_bf16(p) svreinterpret_f32_u32(svlsl_n_u32_x(FA_SVE_ALL, svld1uh_u32(FA_SVE_ALL, (const uint16_t *)(p)), 16))
#define vf_load_i8(p) svcvt_f32_s32_x(FA_SVE_ALL, svld1sb_s32(FA_SVE_ALL, (const int8_t *)(p)))
#define vf_load_e5m2(p) fa_sve_f16(svlsl_n_u32_x(FA_SVE_ALL, svld1ub_u32(FA_SVE_ALL, (const uint8_t *)(p)), 8))
FA_INLINE vf vf_load_e4m3(const uint8_t *p)
{
    const svuint32_t w = svreinterpret_u32_s32(svld1sb_s32(FA_SVE_ALL, (const int8_t *)p));
    const svuint32_t h = svand_n_u32_x(FA_SVE_ALL, svlsl_n_u32_x(FA_SVE_ALL, w, 7), 0xbf80u);
    const svbool_t nan = svcmpeq_n_u32(FA_SVE_ALL, svand_n_u32_x(FA_SVE_ALL, h, 0x3f80u), 0x3f80u);
    return svmul_n_f32_x(FA_SVE_ALL, fa_sve_f16(svorr_n_u32_m(nan, h, 0xffffu)), 256.0f);
}
#define vf_store(p, x) svst1_f32(FA_SVE_ALL, (p), (x))
#define vf_set1(x) svdup_n_f32(x)
#define vf_zero() svdup_n_f32(0.0f)
/* Functions, not macros, where a result meets another vf in a conditional
 * expression: the intrinsics return the sizeless type, which ?: does not mix
 * with the fixed-length vf. */
FA_INLINE vf vf_fma(vf a, vf b, vf c) { return svmla_f32_x(FA_SVE_ALL, c, a, b); }
FA_INLINE vf vf_mul(vf a, vf b) { return svmul_f32_x(FA_SVE_ALL, a, b); }
FA_INLINE vf vf_add(vf a, vf b) { return svadd_f32_x(FA_SVE_ALL, a, b); }
FA_INLINE vf vf_sub(vf a, vf b) { return svsub_f32_x(FA_SVE_ALL, a, b); }
/* x86's max/min (the SECOND operand when either is NaN; see the NEON section) */
#define vf_max(a, b) fa_sve_max((a), (b))
#define vf_min(a, b) fa_sve_min((a), (b))
FA_INLINE vf fa_sve_max(vf a, vf b) { return svsel_f32(svcmpgt_f32(FA_SVE_ALL, a, b), a, b); }
FA_INLINE vf fa_sve_min(vf a, vf b) { return svsel_f32(svcmplt_f32(FA_SVE_ALL, a, b), a, b); }
FA_INLINE float vf_hsum(vf x) { return svaddv_f32(FA_SVE_ALL, x); }
FA_INLINE float vf_hmax(vf x) { return svmaxv_f32(FA_SVE_ALL, x); }
#define vf_round(x) svrintn_f32_x(FA_SVE_ALL, (x))
/* p * 2^n for integral n in [-150, 128] (see the AVX-512 section). */
FA_INLINE vf vf_ldexp2(vf p, vf n)
{
    const svint32_t ni = svcvt_s32_f32_x(FA_SVE_ALL, n), n1 = svasr_n_s32_x(FA_SVE_ALL, ni, 1);
    const svint32_t n2 = svsub_s32_x(FA_SVE_ALL, ni, n1);
    const vf s1 = svreinterpret_f32_s32(svlsl_n_s32_x(FA_SVE_ALL, svadd_n_s32_x(FA_SVE_ALL, n1, 127), 23));
    const vf s2 = svreinterpret_f32_s32(svlsl_n_s32_x(FA_SVE_ALL, svadd_n_s32_x(FA_SVE_ALL, n2, 127), 23));
    return svmul_f32_x(FA_SVE_ALL, svmul_f32_x(FA_SVE_ALL, p, s1), s2);
}
#define vf_shl23(t) svreinterpret_f32_u32(svlsl_n_u32_x(FA_SVE_ALL, svreinterpret_u32_f32(t), 23))
/* Lane masks (see the AVX-512 section): lanes where x >= lim or unordered. */
#define vm_none() svpfalse_b()
#define vm_or_ge(m, x, lim) svorr_b_z(FA_SVE_ALL, (m), svnot_b_z(FA_SVE_ALL, svcmplt_f32(FA_SVE_ALL, (x), (lim))))
#define vm_any(m) svptest_any(FA_SVE_ALL, (m))

#else
/* ---------------------------------------------------- portable C, width 1 */
#ifndef REAL
#define REAL float
#endif
typedef REAL vf;
#define VW 1
#define vf_load(p) (*(p))
#define vf_load_f16(p) ((REAL)fa_f16_to_f32(*(p)))
#define vf_load_bf16(p) ((REAL)fa_bf16_to_f32(*(p)))
#define vf_load_i8(p) ((REAL)*(const int8_t *)(p))
#define vf_load_e4m3(p) ((REAL)fa_e4m3_to_f32(*(const uint8_t *)(p)))
#define vf_load_e5m2(p) ((REAL)fa_e5m2_to_f32(*(const uint8_t *)(p)))
#define vf_store(p, x) (*(p) = (x))
#define vf_set1(x) ((REAL)(x))
#define vf_zero() ((REAL)0)
#define vf_fma(a, b, c) ((a) * (b) + (c))
#define vf_mul(a, b) ((a) * (b))
#define vf_add(a, b) ((a) + (b))
#define vf_sub(a, b) ((a) - (b))
#define vf_max(a, b) ((a) > (b) ? (a) : (b))
#define vf_hsum(x) (x)
#define vf_hmax(x) (x)
#define vf_exp2(x) ((REAL)(sizeof(REAL) == 4 ? (double)exp2f((float)(x)) : exp2((double)(x))))
#define vf_exp2_neg(x) vf_exp2(x)
typedef int vm; /* lane masks (see the AVX-512 section) */
#define vm_none() 0
#define vm_or_ge(m, x, lim) ((m) | !((x) < (lim)))
#define vm_any(m) ((m) != 0)

FA_INLINE void fa_cvt_row(REAL *dst, const void *src, int dt, int64_t n)
{
    for (int64_t j = 0; j < n; j++) dst[j] = (REAL)fa_load_elem(src, dt, j);
}
#endif

#if defined(FA_TARGET_AVX512) || defined(FA_TARGET_AVX2) || defined(FA_TARGET_NEON) || defined(FA_TARGET_SVE)
/* dst[0:n] = src[0:n] (dtype dt) converted to float over the sections'
 * hooks; n is a multiple of VW or a tail. */
FA_INLINE void fa_cvt_row(float *dst, const void *src, int dt, int64_t n)
{
    int64_t j = 0;
    if (dt == FA_F32) { memcpy(dst, src, (size_t)n * 4); return; }
    if (fa_dtype_8(dt)) { fa_cvt_row8(dst, (const uint8_t *)src, dt, n); return; }
    const uint16_t *s = (const uint16_t *)src;
    if (dt == FA_F16) {
        for (; j + VW <= n; j += VW) vf_store(dst + j, vf_load_f16(s + j));
        for (; j < n; j++) dst[j] = fa_f16_to_f32(s[j]);
    } else {
        for (; j + VW <= n; j += VW) vf_store(dst + j, vf_load_bf16(s + j));
        for (; j < n; j++) dst[j] = fa_bf16_to_f32(s[j]);
    }
}
#endif

#if defined(FA_TARGET_AVX512) || defined(FA_TARGET_AVX2) || defined(FA_TARGET_NEON) || defined(FA_TARGET_SVE)
/* dst[0:n] = the 8-bit row src[0:n] (dtype dt: FA_I8, FA_E4M3, FA_E5M2) as float. */
FA_INLINE void fa_cvt_row8(float *dst, const uint8_t *src, int dt, int64_t n)
{
    int64_t j = 0;
    if (dt == FA_I8) for (; j + VW <= n; j += VW) vf_store(dst + j, vf_load_i8(src + j));
    else if (dt == FA_E4M3) for (; j + VW <= n; j += VW) vf_store(dst + j, vf_load_e4m3(src + j));
    else for (; j + VW <= n; j += VW) vf_store(dst + j, vf_load_e5m2(src + j));
    for (; j < n; j++) dst[j] = (float)fa_load_elem(src, dt, j);
}

/* The exp2 of both vector paths, written once over the hooks above. */
FA_INLINE vf fa_exp2_poly(vf f) /* 2^f for f in [-0.5, 0.5] (Horner) */
{
    vf p = vf_set1(FA_EXP2_C7);
    p = vf_fma(p, f, vf_set1(FA_EXP2_C6));
    p = vf_fma(p, f, vf_set1(FA_EXP2_C5));
    p = vf_fma(p, f, vf_set1(FA_EXP2_C4));
    p = vf_fma(p, f, vf_set1(FA_EXP2_C3));
    p = vf_fma(p, f, vf_set1(FA_EXP2_C2));
    p = vf_fma(p, f, vf_set1(FA_EXP2_C1));
    return vf_fma(p, f, vf_set1(1.0f));
}

/* 2^x for any x: NaN propagates, <= -150 gives 0, >= 128 gives inf.  max/min
 * return their SECOND operand when one is NaN: x is kept second. */
FA_INLINE vf vf_exp2(vf x)
{
    vf xc = vf_min(vf_set1(128.0f), vf_max(vf_set1(-150.0f), x));
    vf n = vf_round(xc);
    return vf_ldexp2(fa_exp2_poly(vf_sub(xc, n)), n);
}

FA_INLINE vf fa_exp2_poly5(vf f) /* 2^f for f in [-0.5, 0.5] within 2.3 ulp (Horner) */
{
    vf p = vf_set1(FA_EXP2N_C5);
    p = vf_fma(p, f, vf_set1(FA_EXP2N_C4));
    p = vf_fma(p, f, vf_set1(FA_EXP2N_C3));
    p = vf_fma(p, f, vf_set1(FA_EXP2N_C2));
    p = vf_fma(p, f, vf_set1(FA_EXP2N_C1));
    return vf_fma(p, f, vf_set1(1.0f));
}

/* 2^x for x <= 127 or NaN (the softmax: x <= 0, or FA_SM_SLACK = 8 on the
 * fused tiles), inside the kernels (denormals flushed to zero, MXCSR
 * FTZ/DAZ, set by the drivers).  x is clamped at -127 (max keeps NaN, its
 * second operand), n = round(x), 2^(x - n) by fa_exp2_poly5, then scaled by
 * 2^n: AVX-512 with vscalefps (round, subtract, scale: 3 operations);
 * AVX2 adds 1.5*2^23 + 127, which rounds to nearest and leaves n + 127 in
 * the low mantissa bits, and one shift moves them into the exponent field
 * (5 operations).  Below -126 the result is 0 on both (FTZ; the shift form's
 * zero exponent field); NaN propagates.  Per vector of scores the softmax
 * spends 9 (AVX-512) or 11 (AVX2) operations here, 13 with the degree-7
 * polynomial and the shift form before. */
FA_INLINE vf vf_exp2_neg(vf x)
{
    vf xc = vf_max(vf_set1(-127.0f), x);
#if defined(FA_HAVE_SCALEF)
    vf n = vf_round(xc);
    return vf_scalef(fa_exp2_poly5(vf_sub(xc, n)), n);
#else
    const vf magic = vf_set1(12583039.0f); /* 1.5 * 2^23 + 127 */
    vf t = vf_add(xc, magic);
    return vf_mul(fa_exp2_poly5(vf_sub(xc, vf_sub(t, magic))), vf_shl23(t));
#endif
}

#endif

#if defined(FA_TARGET_AVX512) || defined(FA_TARGET_AVX2)
/* dst[t * ldd + r] = src[r * lds + t] for r, t < 8: one 8 x 8 float transpose
 * in 256-bit registers (both vector units have AVX2), used to pack K panels
 * (rows of keys -> columns of a panel) without a scalar loop. */
#define FA_HAVE_PACK8 1
FA_INLINE void fa_pack8x8_m256(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6,
                               __m256 r7, float *dst, int64_t ldd)
{
    /* pairs of rows interleaved, then quads: u_c holds columns c (low half) and c + 4 (high half) */
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

FA_INLINE void fa_pack8x8(const float *src, int64_t lds, float *dst, int64_t ldd)
{
    fa_pack8x8_m256(_mm256_loadu_ps(src), _mm256_loadu_ps(src + lds), _mm256_loadu_ps(src + 2 * lds),
                    _mm256_loadu_ps(src + 3 * lds), _mm256_loadu_ps(src + 4 * lds), _mm256_loadu_ps(src + 5 * lds),
                    _mm256_loadu_ps(src + 6 * lds), _mm256_loadu_ps(src + 7 * lds), dst, ldd);
}

/* The same transpose from eight rows that need not be evenly spaced, each
 * element multiplied by s on the way: dst[t * ldd + r] = src[r][off + t] * s. */
FA_INLINE void fa_pack8x8_rows_scaled(const float *const *src, int64_t off, float *dst, int64_t ldd, float s)
{
    const __m256 sv = _mm256_set1_ps(s);
    __m256 r[8];
    for (int u = 0; u < 8; u++) r[u] = _mm256_mul_ps(_mm256_loadu_ps(src[u] + off), sv);
    fa_pack8x8_m256(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], dst, ldd);
}
#endif

#endif

/* avx512_emu.h: TEST-ONLY stand-ins for the AVX-512F intrinsics that simd.h
 * uses, built from pairs of AVX2 registers.  With FASTATTN_EMULATE_AVX512=1
 * (setup.py) kernel_f32_avx512.c is compiled with AVX2 flags and this header, so
 * the width-16 instantiation of kernel_impl.h (tails, padding, decode blocks)
 * runs and is tested on machines without AVX-512.  Lane semantics match the
 * real instructions (IEEE ops, NaN rules of max/min, rounding); horizontal
 * reductions may associate differently, which only moves the last bit. */
#ifndef FA_AVX512_EMU_H
#define FA_AVX512_EMU_H
#include <immintrin.h>

typedef struct { __m256 lo, hi; } fa_emu_ps;
typedef struct { __m256i lo, hi; } fa_emu_si;
#define __m512 fa_emu_ps
#define __m512i fa_emu_si

#define FA_EMU_PS1(name, op) \
    static inline fa_emu_ps name(fa_emu_ps a) { fa_emu_ps r = { op(a.lo), op(a.hi) }; return r; }
#define FA_EMU_PS2(name, op) \
    static inline fa_emu_ps name(fa_emu_ps a, fa_emu_ps b) \
    { fa_emu_ps r = { op(a.lo, b.lo), op(a.hi, b.hi) }; return r; }
#define FA_EMU_SI2(name, op) \
    static inline fa_emu_si name(fa_emu_si a, fa_emu_si b) \
    { fa_emu_si r = { op(a.lo, b.lo), op(a.hi, b.hi) }; return r; }

FA_EMU_PS2(fa_emu_add_ps, _mm256_add_ps)
FA_EMU_PS2(fa_emu_sub_ps, _mm256_sub_ps)
FA_EMU_PS2(fa_emu_mul_ps, _mm256_mul_ps)
FA_EMU_PS2(fa_emu_max_ps, _mm256_max_ps)
FA_EMU_PS2(fa_emu_min_ps, _mm256_min_ps)
FA_EMU_SI2(fa_emu_add_epi32, _mm256_add_epi32)
FA_EMU_SI2(fa_emu_sub_epi32, _mm256_sub_epi32)

static inline fa_emu_ps fa_emu_loadu_ps(const float *p) { fa_emu_ps r = { _mm256_loadu_ps(p), _mm256_loadu_ps(p + 8) }; return r; }
static inline void fa_emu_storeu_ps(float *p, fa_emu_ps x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
static inline fa_emu_ps fa_emu_set1_ps(float x) { fa_emu_ps r = { _mm256_set1_ps(x), _mm256_set1_ps(x) }; return r; }
static inline fa_emu_ps fa_emu_setzero_ps(void) { return fa_emu_set1_ps(0.0f); }
static inline fa_emu_si fa_emu_set1_epi32(int x) { fa_emu_si r = { _mm256_set1_epi32(x), _mm256_set1_epi32(x) }; return r; }
static inline fa_emu_ps fa_emu_fmadd_ps(fa_emu_ps a, fa_emu_ps b, fa_emu_ps c)
{
    fa_emu_ps r = { _mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi) };
    return r;
}
static inline float fa_emu_hsum8(__m256 x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float fa_emu_reduce_add_ps(fa_emu_ps x) { return fa_emu_hsum8(_mm256_add_ps(x.lo, x.hi)); }
static inline float fa_emu_reduce_max_ps(fa_emu_ps x)
{
    __m256 m = _mm256_max_ps(x.lo, x.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define fa_emu_roundscale_ps(x, imm) \
    ((fa_emu_ps){ _mm256_round_ps((x).lo, (imm)), _mm256_round_ps((x).hi, (imm)) })
/* vscalefps over the domain the kernels use it on (vf_exp2_neg: n integral
 * in [-127, FA_SM_SLACK], FTZ set): p times 2^n built in the exponent field,
 * n = -127 giving 0 as the hardware's flushed result. */
static inline fa_emu_ps fa_emu_scalef_ps(fa_emu_ps p, fa_emu_ps n)
{
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.lo), bias), 23));
    __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.hi), bias), 23));
    fa_emu_ps r = { _mm256_mul_ps(p.lo, lo), _mm256_mul_ps(p.hi, hi) };
    return r;
}
static inline fa_emu_si fa_emu_cvtps_epi32(fa_emu_ps x) { fa_emu_si r = { _mm256_cvtps_epi32(x.lo), _mm256_cvtps_epi32(x.hi) }; return r; }
#define fa_emu_srai_epi32(x, k) ((fa_emu_si){ _mm256_srai_epi32((x).lo, (k)), _mm256_srai_epi32((x).hi, (k)) })
#define fa_emu_slli_epi32(x, k) ((fa_emu_si){ _mm256_slli_epi32((x).lo, (k)), _mm256_slli_epi32((x).hi, (k)) })
static inline fa_emu_ps fa_emu_castsi512_ps(fa_emu_si x) { fa_emu_ps r = { _mm256_castsi256_ps(x.lo), _mm256_castsi256_ps(x.hi) }; return r; }
static inline fa_emu_si fa_emu_castps_si512(fa_emu_ps x) { fa_emu_si r = { _mm256_castps_si256(x.lo), _mm256_castps_si256(x.hi) }; return r; }
static inline fa_emu_ps fa_emu_cvtph_ps(__m256i h)
{
    fa_emu_ps r = { _mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)) };
    return r;
}
static inline fa_emu_si fa_emu_cvtepu16_epi32(__m256i h)
{
    fa_emu_si r = { _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)) };
    return r;
}

/* vcmpps into a mask register, for the one predicate simd.h uses
 * (_CMP_NLT_UQ: greater or equal, or unordered). */
static inline __mmask16 fa_emu_cmp_nlt_uq_mask(fa_emu_ps a, fa_emu_ps b)
{
    return (__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_NLT_UQ)) |
                       (_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_NLT_UQ)) << 8));
}
#define _mm512_cmp_ps_mask(a, b, imm) fa_emu_cmp_nlt_uq_mask((a), (b))

#define _mm512_add_ps fa_emu_add_ps
#define _mm512_sub_ps fa_emu_sub_ps
#define _mm512_mul_ps fa_emu_mul_ps
#define _mm512_max_ps fa_emu_max_ps
#define _mm512_min_ps fa_emu_min_ps
#define _mm512_add_epi32 fa_emu_add_epi32
#define _mm512_sub_epi32 fa_emu_sub_epi32
#define _mm512_loadu_ps fa_emu_loadu_ps
#define _mm512_storeu_ps fa_emu_storeu_ps
#define _mm512_set1_ps fa_emu_set1_ps
#define _mm512_setzero_ps fa_emu_setzero_ps
#define _mm512_set1_epi32 fa_emu_set1_epi32
#define _mm512_fmadd_ps fa_emu_fmadd_ps
#define _mm512_reduce_add_ps fa_emu_reduce_add_ps
#define _mm512_reduce_max_ps fa_emu_reduce_max_ps
#define _mm512_roundscale_ps fa_emu_roundscale_ps
#define _mm512_scalef_ps fa_emu_scalef_ps
#define _mm512_cvtps_epi32 fa_emu_cvtps_epi32
#define _mm512_srai_epi32 fa_emu_srai_epi32
#define _mm512_slli_epi32 fa_emu_slli_epi32
#define _mm512_castsi512_ps fa_emu_castsi512_ps
#define _mm512_castps_si512 fa_emu_castps_si512
#define _mm512_cvtph_ps fa_emu_cvtph_ps
#define _mm512_cvtepu16_epi32 fa_emu_cvtepu16_epi32
static inline fa_emu_si fa_emu_cvtepi8_epi32(__m128i b)
{
    fa_emu_si r = { _mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)) };
    return r;
}
static inline fa_emu_ps fa_emu_cvtepi32_ps(fa_emu_si x) { fa_emu_ps r = { _mm256_cvtepi32_ps(x.lo), _mm256_cvtepi32_ps(x.hi) }; return r; }
#define _mm512_cvtepi8_epi32 fa_emu_cvtepi8_epi32
#define _mm512_cvtepi32_ps fa_emu_cvtepi32_ps
#endif

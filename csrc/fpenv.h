/* fpenv.h: the floating-point mode of a call, written once for attention.c
 * and family.c.  Every thread that runs a part of a call computes in
 * round-to-nearest with denormals flushed to zero and restores its own mode
 * afterwards.  x86: MXCSR (RC = nearest, FTZ, DAZ).  Arm64: FPCR (RMode =
 * nearest, FZ: single and double denormal inputs and results are zero; FZ16
 * left as it is, so the float16 and fp8 conversions keep their subnormals, as
 * x86's VCVTPH2PS ignores DAZ).  Elsewhere: the rounding mode only. */
#ifndef FA_FPENV_H
#define FA_FPENV_H

#include <fenv.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#define FA_FPCR_RMODE (3ull << 22)
#define FA_FPCR_FZ (1ull << 24)

/* Sets the call's mode; *csr and *round receive what exit needs. */
static inline void fa_fpmode_enter(unsigned int *csr, int *round)
{
#if defined(__x86_64__) || defined(_M_X64)
    *csr = _mm_getcsr();
    _mm_setcsr((*csr & ~0x6000u) | 0x8040u);
    *round = 0;
#elif defined(__aarch64__) && defined(__GNUC__)
    unsigned long long fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    *csr = (unsigned int)fpcr; /* FPCR's defined bits are its low 32 */
    const unsigned long long want = (fpcr & ~FA_FPCR_RMODE) | FA_FPCR_FZ;
    if (want != fpcr) __asm__ volatile("msr fpcr, %0" : : "r"(want));
    *round = 0;
#else
    *csr = 0;
    *round = fegetround();
    if (*round != FE_TONEAREST) fesetround(FE_TONEAREST);
#endif
}

static inline void fa_fpmode_exit(unsigned int csr, int round)
{
#if defined(__x86_64__) || defined(_M_X64)
    (void)round;
    _mm_setcsr(csr);
#elif defined(__aarch64__) && defined(__GNUC__)
    (void)round;
    unsigned long long now, old = csr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(now));
    if (now != old) __asm__ volatile("msr fpcr, %0" : : "r"(old));
#else
    (void)csr;
    if (round != FE_TONEAREST) fesetround(round);
#endif
}

#endif

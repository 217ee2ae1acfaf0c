/* dispatch.c: detect the CPU once (cpuid + xgetbv, so the OS must also save
 * the registers) and pick the kernel of the chosen ISA. */
#include "kernel.h"

#if defined(FA_HAVE_X86)
#include <cpuid.h>

static unsigned long long fa_xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

typedef struct { int avx2, avx512, f16c, avx512bf16; } fa_cpu;

static fa_cpu fa_detect(void)
{
    fa_cpu r = {0, 0, 0, 0};
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return r;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return r;
    unsigned long long xcr0 = fa_xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return r; /* XMM and YMM state */
    r.f16c = f16c;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return r;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1;
    r.avx2 = avx2 && fma && f16c;
    r.avx512 = r.avx2 && avx512f && (xcr0 & 0xe6) == 0xe6; /* + opmask, ZMM state */
    if (r.avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) r.avx512bf16 = (a >> 5) & 1;
    return r;
}

static fa_cpu fa_cpu_cached(void)
{
    static int done = 0;
    static fa_cpu cpu;
    if (!done) { cpu = fa_detect(); done = 1; } /* idempotent: a race writes the same value */
    return cpu;
}
#endif

int fa_cpu_has(int isa)
{
    if (isa == FA_ISA_SCALAR) return 1;
#if defined(FA_HAVE_X86)
    fa_cpu c = fa_cpu_cached();
    if (isa == FA_ISA_AVX2) return c.avx2;
#if defined(FA_EMULATE_AVX512)
    if (isa == FA_ISA_AVX512) return c.avx2; /* test-only build: emulated on AVX2 */
#else
    if (isa == FA_ISA_AVX512) return c.avx512;
#endif
#endif
    return 0;
}

int fa_cpu_has_f16c(void)
{
#if defined(FA_HAVE_X86)
    return fa_cpu_cached().f16c;
#else
    return 0;
#endif
}

int fa_cpu_has_avx512bf16(void)
{
#if defined(FA_HAVE_X86)
    return fa_cpu_cached().avx512bf16;
#else
    return 0;
#endif
}

int fa_isa_best(void)
{
    if (fa_cpu_has(FA_ISA_AVX512)) return FA_ISA_AVX512;
    if (fa_cpu_has(FA_ISA_AVX2)) return FA_ISA_AVX2;
    return FA_ISA_SCALAR;
}

static int fa_isa_current = -1;

int fa_isa_get(void)
{
    if (fa_isa_current < 0) fa_isa_current = fa_isa_best();
    return fa_isa_current;
}

int fa_isa_set(int isa)
{
    if (isa < FA_ISA_SCALAR || isa > FA_ISA_AVX512 || !fa_cpu_has(isa)) return -1;
    fa_isa_current = isa;
    return 0;
}

const char *fa_isa_name(int isa)
{
    switch (isa) {
    case FA_ISA_AVX512: return "avx512";
    case FA_ISA_AVX2: return "avx2";
    default: return "scalar";
    }
}

const fa_kernel *fa_select_kernel(const fa_params *p)
{
    if (p->q_dtype == FA_F64) return &fa_kernel_f64_scalar;
#if defined(FA_HAVE_X86)
    switch (fa_isa_get()) {
    case FA_ISA_AVX512: return &fa_kernel_f32_avx512;
    case FA_ISA_AVX2: return &fa_kernel_f32_avx2;
    default: break;
    }
#endif
    return &fa_kernel_f32_scalar;
}

int fa_exp2_isa(int isa, const float *x, float *y, int64_t n)
{
    if (!fa_cpu_has(isa)) return -1;
#if defined(FA_HAVE_X86)
    if (isa == FA_ISA_AVX512) { fa_exp2_avx512(x, y, n); return 0; }
    if (isa == FA_ISA_AVX2) { fa_exp2_avx2(x, y, n); return 0; }
#endif
    fa_exp2_scalar(x, y, n);
    return 0;
}

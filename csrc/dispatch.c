/* dispatch.c: detect the CPU once (cpuid + xgetbv, so the OS must also save
 * the registers) and pick the kernel of the chosen ISA. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE 1 /* syscall() under -std=c11 */
#endif
#include "kernel.h"

#if defined(FA_HAVE_X86)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#define FA_CPU_ONCE 1
#endif

static unsigned long long fa_xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

typedef struct { int avx2, avx512, f16c, avx512bf16, amx, avx512bw; } fa_cpu;

/* Linux keeps the AMX tile data (8 KiB of state) off until a process asks:
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process (it
 * covers every thread).  Refused (old kernel, seccomp) or another OS: no AMX. */
static int fa_amx_permission(void)
{
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

static fa_cpu fa_detect(void)
{
    fa_cpu r = {0, 0, 0, 0, 0};
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
    const int avx512bw = (b >> 30) & 1;
    /* AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24), with XTILECFG and XTILEDATA
     * (XCR0 bits 17 and 18) enabled by the OS; the kernel's softmax needs
     * AVX-512 BW and BF16 too (every AMX CPU has them). */
    const int amx_cpu = ((d >> 22) & 1) && ((d >> 24) & 1) && ((xcr0 >> 17) & 3) == 3;
    if (r.avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) r.avx512bf16 = (a >> 5) & 1;
    r.amx = amx_cpu && r.avx512 && avx512bw && r.avx512bf16 && fa_amx_permission();
    r.avx512bw = r.avx512 && avx512bw;
    return r;
}

static fa_cpu fa_cpu_value;
#if defined(FA_CPU_ONCE)
static pthread_once_t fa_cpu_once = PTHREAD_ONCE_INIT;
static void fa_cpu_init(void) { fa_cpu_value = fa_detect(); }
#endif

/* Detected once per process, published safely to every thread. */
static fa_cpu fa_cpu_cached(void)
{
#if defined(FA_CPU_ONCE)
    pthread_once(&fa_cpu_once, fa_cpu_init);
#else
    static int done = 0;
    if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) {
        fa_cpu_value = fa_detect(); /* idempotent: a race writes the same value */
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    }
#endif
    return fa_cpu_value;
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
#if defined(FA_HAVE_AVX512BF16) && defined(FA_EMULATE_AVX512BF16)
    if (isa == FA_ISA_AVX512BF16) return c.avx2; /* test-only build: VDPBF16PS emulated in C */
#elif defined(FA_HAVE_AVX512BF16)
    /* the kernel's softmax and packing use AVX-512 BW next to BF16 (every
     * AVX512-BF16 CPU has it) */
    if (isa == FA_ISA_AVX512BF16) return c.avx512bf16 && c.avx512bw;
#endif
#if defined(FA_HAVE_AMX) && defined(FA_EMULATE_AMX)
    if (isa == FA_ISA_AMX) return c.avx2; /* test-only build: tiles emulated in C */
#elif defined(FA_HAVE_AMX)
    if (isa == FA_ISA_AMX) return c.amx;
#endif
#endif
    return 0;
}

int fa_cpu_has_amx(void)
{
#if defined(FA_HAVE_X86)
    return fa_cpu_cached().amx;
#else
    return 0;
#endif
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
    if (fa_cpu_has(FA_ISA_AMX)) return FA_ISA_AMX;
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
    if (isa < FA_ISA_SCALAR || isa > FA_ISA_AVX512BF16 || !fa_cpu_has(isa)) return -1;
    fa_isa_current = isa;
    return 0;
}

const char *fa_isa_name(int isa)
{
    switch (isa) {
    case FA_ISA_AMX: return "amx";
    case FA_ISA_AVX512BF16: return "avx512bf16";
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
    case FA_ISA_AMX:
#if defined(FA_HAVE_AMX)
        if (((p->q_dtype == FA_BF16 && p->k_dtype == FA_BF16 && p->v_dtype == FA_BF16) ||
             (p->q_dtype == FA_F32 && p->k_dtype == FA_F32 && p->v_dtype == FA_F32 &&
              (p->precision == FA_PRECISION_HIGH || p->precision == FA_PRECISION_MEDIUM))) &&
            p->L * (p->Hq / p->Hk) >= FA_AMX_MIN_ROWS)
            return &fa_kernel_bf16_amx;
#endif
        return &fa_kernel_f32_avx512;
    case FA_ISA_AVX512BF16:
#if defined(FA_HAVE_AVX512BF16)
        /* bf16 inputs, and float32 ones at "medium" (rounded to bf16); "high"
         * (bf16x3, three products) would not beat the float32 kernel here. */
        if (((p->q_dtype == FA_BF16 && p->k_dtype == FA_BF16 && p->v_dtype == FA_BF16) ||
             (p->q_dtype == FA_F32 && p->k_dtype == FA_F32 && p->v_dtype == FA_F32 &&
              p->precision == FA_PRECISION_MEDIUM)) &&
            p->L * (p->Hq / p->Hk) >= FA_AMX_MIN_ROWS)
            return &fa_kernel_bf16_avx512bf16;
#endif
        return &fa_kernel_f32_avx512;
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
    if (isa == FA_ISA_AVX512 || isa == FA_ISA_AMX || isa == FA_ISA_AVX512BF16) { fa_exp2_avx512(x, y, n); return 0; }
    if (isa == FA_ISA_AVX2) { fa_exp2_avx2(x, y, n); return 0; }
#endif
    fa_exp2_scalar(x, y, n);
    return 0;
}

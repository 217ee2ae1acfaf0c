/* dispatch.c: detect the CPU once (x86: cpuid + xgetbv, so the OS must also
 * save the registers; Arm64: the auxiliary vector's HWCAP) and pick the
 * kernel of the chosen ISA. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE 1 /* syscall() under -std=c11 */
#endif
#include <stdatomic.h>
#include "kernel.h"

#if defined(FA_HAVE_X86)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#define FA_AMX_ONCE 1
#endif

static unsigned long long fa_xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

/* The feature bits of fa_detect; FA_CPU_KNOWN marks a detected value, so
 * that 0 means "not detected yet". */
#define FA_CPU_AVX2 (1u << 0)
#define FA_CPU_AVX512 (1u << 1)
#define FA_CPU_F16C (1u << 2)
#define FA_CPU_AVX512BF16 (1u << 3)
#define FA_CPU_AMX (1u << 4)
#define FA_CPU_AVX512BW (1u << 5) /* with DQ: the bf16 kernels' softmax needs both */
#define FA_CPU_AMXFP16 (1u << 6)  /* AMX-FP16 (TDPFP16PS) on top of FA_CPU_AMX */
#define FA_CPU_KNOWN (1u << 31)

/* Linux keeps the AMX tile data (8 KiB of state) off until a process asks:
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process (it
 * covers every thread).  Refused (old kernel, seccomp) or another OS: no AMX. */
static int fa_amx_request(void)
{
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* The request is made once per process (pthread_once publishes its answer to
 * every thread); without pthreads (Windows) there is nothing to request. */
#if defined(FA_AMX_ONCE)
static int fa_amx_granted;
static pthread_once_t fa_amx_once = PTHREAD_ONCE_INIT;
static void fa_amx_init(void) { fa_amx_granted = fa_amx_request(); }
static int fa_amx_permission(void)
{
    pthread_once(&fa_amx_once, fa_amx_init);
    return fa_amx_granted;
}
#else
static int fa_amx_permission(void) { return fa_amx_request(); }
#endif

static unsigned fa_detect(void)
{
    unsigned r = 0;
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return r;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return r;
    unsigned long long xcr0 = fa_xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return r; /* XMM and YMM state */
    if (f16c) r |= FA_CPU_F16C;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return r;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1;
    if (avx2 && fma && f16c) r |= FA_CPU_AVX2;
    if ((r & FA_CPU_AVX2) && avx512f && (xcr0 & 0xe6) == 0xe6) r |= FA_CPU_AVX512; /* + opmask, ZMM state */
    const int avx512bw = ((b >> 30) & 1) && ((b >> 17) & 1); /* BW and DQ */
    /* AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24), with XTILECFG and XTILEDATA
     * (XCR0 bits 17 and 18) enabled by the OS; the kernel's softmax needs
     * AVX-512 BW, DQ and BF16 too (every AMX CPU has them). */
    const int amx_cpu = ((d >> 22) & 1) && ((d >> 24) & 1) && ((xcr0 >> 17) & 3) == 3;
    /* Leaf 7 subleaf 1, EAX: AVX512-BF16 (bit 5), AMX-FP16 (bit 21). */
    unsigned a1 = 0, b1, c1, d1;
    if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) a1 = 0;
    if ((r & FA_CPU_AVX512) && ((a1 >> 5) & 1)) r |= FA_CPU_AVX512BF16;
    const int amx_fp16 = (a1 >> 21) & 1;
    if (amx_cpu && (r & FA_CPU_AVX512) && avx512bw && (r & FA_CPU_AVX512BF16) && fa_amx_permission()) {
        r |= FA_CPU_AMX;
        if (amx_fp16) r |= FA_CPU_AMXFP16;
    }
    if ((r & FA_CPU_AVX512) && avx512bw) r |= FA_CPU_AVX512BW;
    return r;
}

/* Detected once per process and cached in one atomic word, so that a reader
 * sees either 0 (then detects itself) or the whole value, never a partial
 * write.  Racing first callers compute the same bits and store the same
 * value (cpuid does not change, and the AMX request is made once). */
static atomic_uint fa_cpu_bits;

static unsigned fa_cpu(void)
{
    unsigned v = atomic_load_explicit(&fa_cpu_bits, memory_order_acquire);
    if (!v) {
        v = fa_detect() | FA_CPU_KNOWN;
        atomic_store_explicit(&fa_cpu_bits, v, memory_order_release);
    }
    return v;
}
#endif

#if defined(FA_HAVE_ARM64)
/* Advanced SIMD (ASIMD, "NEON"): HWCAP_ASIMD in the auxiliary vector on
 * Linux; part of every AArch64 CPU elsewhere (macOS, where every Arm CPU
 * has it, and Windows).  SVE: HWCAP_SVE, and the vector length the kernel
 * gives this thread (prctl PR_SVE_GET_VL, bytes in its low 16 bits), read
 * once per process: a process that changes its length with PR_SVE_SET_VL
 * after its first call must not use the sve path (its kernel would read
 * vectors of the wrong length). */
#if defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1 << 22)
#endif
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#endif
static int fa_arm_asimd(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0; }
static int fa_arm_sve_bits(void)
{
    if (!(getauxval(AT_HWCAP) & HWCAP_SVE)) return 0;
    const int vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
    return vl < 0 ? 0 : (vl & 0xffff) * 8;
}
#else
static int fa_arm_asimd(void) { return 1; }
static int fa_arm_sve_bits(void) { return 0; }
#endif
static atomic_int fa_sve_len = -1;
#endif

int fa_sve_bits(void)
{
#if defined(FA_HAVE_ARM64)
    int v = atomic_load_explicit(&fa_sve_len, memory_order_relaxed);
    if (v < 0) {
        v = fa_arm_sve_bits();
        atomic_store_explicit(&fa_sve_len, v, memory_order_relaxed);
    }
    return v;
#else
    return 0;
#endif
}

int fa_cpu_has(int isa)
{
    if (isa == FA_ISA_SCALAR) return 1;
#if defined(FA_HAVE_ARM64)
    if (isa == FA_ISA_NEON) return fa_arm_asimd();
#if defined(FA_HAVE_SVE)
    /* the lengths with a unit; at 128 bits SVE adds nothing NEON lacks here */
    if (isa == FA_ISA_SVE) return fa_sve_bits() == 256 || fa_sve_bits() == 512;
#endif
#endif
#if defined(FA_HAVE_X86)
    const unsigned c = fa_cpu();
    const int avx2 = (c & FA_CPU_AVX2) != 0;
    if (isa == FA_ISA_AVX2) return avx2;
#if defined(FA_EMULATE_AVX512)
    if (isa == FA_ISA_AVX512) return avx2; /* test-only build: emulated on AVX2 */
#else
    if (isa == FA_ISA_AVX512) return (c & FA_CPU_AVX512) != 0;
#endif
#if defined(FA_HAVE_AVX512BF16) && defined(FA_EMULATE_AVX512BF16)
    if (isa == FA_ISA_AVX512BF16) return avx2; /* test-only build: VDPBF16PS emulated in C */
#elif defined(FA_HAVE_AVX512BF16)
    /* the kernel's softmax and packing use AVX-512 BW and DQ next to BF16
     * (every AVX512-BF16 CPU has them) */
    if (isa == FA_ISA_AVX512BF16) return (c & FA_CPU_AVX512BF16) && (c & FA_CPU_AVX512BW);
#endif
#if defined(FA_HAVE_AMX) && defined(FA_EMULATE_AMX)
    if (isa == FA_ISA_AMX) return avx2; /* test-only build: tiles emulated in C */
#elif defined(FA_HAVE_AMX)
    if (isa == FA_ISA_AMX) return (c & FA_CPU_AMX) != 0;
#endif
#endif
    return 0;
}

int fa_cpu_has_amx(void)
{
#if defined(FA_HAVE_X86)
    return (fa_cpu() & FA_CPU_AMX) != 0;
#else
    return 0;
#endif
}

/* float16 inputs on the tiles (kernel_f16_amx.c): AMX usable and AMX-FP16 on
 * the CPU; in the test-only emulated build, wherever the amx path is (the
 * instruction is emulated with the rest). */
int fa_amx_fp16_usable(void)
{
#if defined(FA_HAVE_AMX_FP16) && defined(FA_EMULATE_AMX)
    return fa_cpu_has(FA_ISA_AMX);
#elif defined(FA_HAVE_AMX_FP16)
    return fa_cpu_has_amx_fp16(); /* fa_detect sets AMX-FP16 only with AMX usable */
#else
    return 0;
#endif
}

int fa_cpu_has_amx_fp16(void)
{
#if defined(FA_HAVE_X86)
    return (fa_cpu() & FA_CPU_AMXFP16) != 0;
#else
    return 0;
#endif
}

int fa_cpu_has_f16c(void)
{
#if defined(FA_HAVE_X86)
    return (fa_cpu() & FA_CPU_F16C) != 0;
#else
    return 0;
#endif
}

int fa_cpu_has_avx512bf16(void)
{
#if defined(FA_HAVE_X86)
    return (fa_cpu() & FA_CPU_AVX512BF16) != 0;
#else
    return 0;
#endif
}

/* The default path: AMX where the CPU and OS grant it, else VDPBF16PS where the
 * CPU has AVX512-BF16 (bf16 products for bfloat16 inputs and "medium"; on Zen 4
 * 1.9-2.3x the float32 kernel at one thread, docs/performance.md), else the
 * float32 kernels.  Every path computes float32 "highest" the same way (the
 * AVX-512 kernel), so the order only changes 16-bit prefill and "medium". */
int fa_isa_best(void)
{
    if (fa_cpu_has(FA_ISA_AMX)) return FA_ISA_AMX;
    if (fa_cpu_has(FA_ISA_AVX512BF16)) return FA_ISA_AVX512BF16;
    if (fa_cpu_has(FA_ISA_AVX512)) return FA_ISA_AVX512;
    if (fa_cpu_has(FA_ISA_AVX2)) return FA_ISA_AVX2;
    if (fa_cpu_has(FA_ISA_SVE)) return FA_ISA_SVE;
    if (fa_cpu_has(FA_ISA_NEON)) return FA_ISA_NEON;
    return FA_ISA_SCALAR;
}

/* The ISA that calls use: -1 until the first fa_isa_get or fa_isa_set.  An
 * atomic int, since set_isa may run while other threads start calls; a call
 * reads it once (fa_select_kernel, or the backward driver), so it runs
 * whole on one ISA. */
static atomic_int fa_isa_current = -1;

int fa_isa_get(void)
{
    int isa = atomic_load_explicit(&fa_isa_current, memory_order_relaxed);
    if (isa < 0) {
        /* First use: the best ISA, unless an fa_isa_set got in first (then
         * the exchange fails and leaves its choice in isa). */
        int expected = -1, best = fa_isa_best();
        isa = atomic_compare_exchange_strong_explicit(&fa_isa_current, &expected, best, memory_order_relaxed,
                                                      memory_order_relaxed) ? best : expected;
    }
    return isa;
}

int fa_isa_set(int isa)
{
    if (isa < FA_ISA_SCALAR || isa > FA_ISA_SVE || !fa_cpu_has(isa)) return -1;
    atomic_store_explicit(&fa_isa_current, isa, memory_order_relaxed);
    return 0;
}

/* Paged K/V (block_table) takes every kernel: the vector kernels' tiles end
 * at page boundaries (kernel_impl.h, tile_len), the matrix-unit kernels
 * gather a tile's rows through the table before packing them
 * (kernel_bf16_amx.c, amx_rows).  Dropout takes the vector kernel, whose
 * prefill path applies it (kernel_impl.h, dropout_tile): a dropout call is
 * computed as "highest". */
const fa_kernel *fa_select_kernel(const fa_params *p)
{
    if (p->q_dtype == FA_F64) return &fa_kernel_f64_scalar;
#if defined(FA_HAVE_X86)
    const int isa = fa_isa_get();
    switch (p->dropout_p > 0.0 && (isa == FA_ISA_AMX || isa == FA_ISA_AVX512BF16) ? FA_ISA_AVX512 : isa) {
    case FA_ISA_AMX:
#if defined(FA_HAVE_AMX)
        if (((p->q_dtype == FA_BF16 && p->k_dtype == FA_BF16 && p->v_dtype == FA_BF16) ||
             (p->q_dtype == FA_F32 && p->k_dtype == FA_F32 && p->v_dtype == FA_F32 &&
              (p->precision == FA_PRECISION_HIGH || p->precision == FA_PRECISION_MEDIUM))) &&
            p->L * (p->Hq / p->Hk) >= FA_AMX_MIN_ROWS)
            return &fa_kernel_bf16_amx;
#endif
#if defined(FA_HAVE_AMX_FP16)
        /* float16 on AMX-FP16 only: never rounded to bf16 behind the caller's back */
        if (p->q_dtype == FA_F16 && p->k_dtype == FA_F16 && p->v_dtype == FA_F16 &&
            p->L * (p->Hq / p->Hk) >= FA_AMX_MIN_ROWS && fa_amx_fp16_usable())
            return &fa_kernel_f16_amx;
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
#if defined(FA_HAVE_ARM64)
    switch (fa_isa_get()) { /* read once, as above: the call runs whole on one path */
#if defined(FA_HAVE_SVE)
    case FA_ISA_SVE: return fa_sve_bits() == 256 ? &fa_kernel_f32_sve256 : &fa_kernel_f32_sve512;
#endif
    case FA_ISA_NEON: return &fa_kernel_f32_neon;
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
#if defined(FA_HAVE_ARM64)
#if defined(FA_HAVE_SVE)
    if (isa == FA_ISA_SVE) {
        if (fa_sve_bits() == 256) fa_exp2_sve256(x, y, n);
        else fa_exp2_sve512(x, y, n);
        return 0;
    }
#endif
    if (isa == FA_ISA_NEON) { fa_exp2_neon(x, y, n); return 0; }
#endif
    fa_exp2_scalar(x, y, n);
    return 0;
}

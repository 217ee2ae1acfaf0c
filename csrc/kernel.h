/* kernel.h: internal contract between the driver (attention.c) and the
 * per-ISA kernels (kernel_*.c, all generated from kernel_impl.h). */
#ifndef FA_KERNEL_H
#define FA_KERNEL_H

#include "fastattn.h"

/* One unit of work: query positions [i0, i0+ni) of every query head served by
 * key/value head hk of batch b (GQA heads are stacked as rows g*ni + ii), over
 * keys [j0, j1).  A split task writes compute-dtype results into part_o
 * (rows x Dv, contiguous) and part_lse (rows) instead of the output. */
typedef struct fa_task {
    int64_t b, hk, i0, ni, j0, j1;
    void *part_o, *part_lse;
    int64_t rows;        /* the call's row block (tiles.c); the scratch was sized for it */
} fa_task;

typedef struct fa_kernel {
    /* Scratch of one thread for tasks of at most max(rows, G) stacked rows. */
    size_t (*scratch_bytes)(const fa_params *p, int64_t rows);
    void (*run)(const fa_params *p, const fa_task *t, void *scratch);
    int64_t block_rows;  /* stacked rows (heads x positions) per task when the L2 size is unknown */
    int64_t block_rows_short; /* rows per task for short calls (tiles.c), and the least derived */
    int64_t block_keys;  /* keys per tile; split points are multiples of it */
    int64_t rows_max;    /* the most rows the derived block may take (tiles.c) */
    int64_t row_multiple; /* the derived block is a multiple of this (the register or tile block) */
    /* Bytes of one stacked row's working set per key tile (tiles.c's rule). */
    int64_t (*row_bytes)(int64_t D, int64_t Dv);
    /* The row block of causal and windowed calls (tiles.c): FA_BAND_PLAIN, the
     * rule of every call (the AMX kernel, which skips masked tiles per 32-row
     * group, measured best at its plain blocks); FA_BAND_L2, the L2 rule at
     * every L, at most L / 2 (kernel_impl.h, whose register blocks skip the
     * masked keys of a diagonal tile: block_keys). */
    int band_rule;
    /* Calls with L < FA_LONG_L (not causal or windowed): 1, the L2 rule while
     * the call keeps at least FA_MIN_TASKS tasks (kernel_impl.h); 0, the
     * short block (the AMX kernel: bf16 B4 H8 L512 ran 0.995 / 1.05 at 256 /
     * 512 rows against its 128, not adopted). */
    int short_l2;
    /* run for calls with dropout (fa_params.dropout_p > 0); NULL where the
     * kernel has none (the AMX kernels: fa_select_kernel never picks them then). */
    void (*run_dropout)(const fa_params *p, const fa_task *t, void *scratch);
    /* The decode tasks of n <= FA_HEADS_MAX consecutive kv heads of one sequence
     * and key range, t[0], t[stride], ..., run together (kernel_impl.h: paged
     * single-row decode reads each page's rows of all n heads in turn), each
     * with its own part of the scratch, part bytes (scratch_bytes, rounded up
     * to 64) apart; the results are each task's own (the tile kernels: the
     * vector kernel's, for units of decode rows).  NULL: none (the driver
     * runs every task alone). */
    void (*run_heads)(const fa_params *p, const fa_task *t, int64_t n, int64_t stride, void *scratch, size_t part);
} fa_kernel;

/* The most kv heads per run_heads unit: a 16-token page's rows of 8 heads are
 * 16 KiB of int8 K (bfloat16: 32 KiB), read in one run; 8 is the only size
 * measured (attention.c). */
#define FA_HEADS_MAX 8

enum { FA_BAND_PLAIN = 0, FA_BAND_L2 = 1 };

/* The first bytes of every thread's scratch: what a kernel keeps from one of
 * the thread's tasks to the next within a call (kernel_impl.h: the (batch, kv
 * head, key range) whose K its head buffer holds packed, and up to which key).
 * The driver zeroes it before the thread's first task of each call; a kernel
 * that keeps nothing leaves it alone (its scratch_bytes counts it). */
typedef struct fa_scratch_state {
    int64_t valid, b, hk, j0, j1, upto;
} fa_scratch_state;

extern const fa_kernel fa_kernel_f32_scalar, fa_kernel_f64_scalar;
#if defined(__x86_64__) || defined(_M_X64)
#define FA_HAVE_X86 1
extern const fa_kernel fa_kernel_f32_avx2, fa_kernel_f32_avx512;
void fa_exp2_avx2(const float *x, float *y, int64_t n);
void fa_exp2_avx512(const float *x, float *y, int64_t n);
#if defined(FA_HAVE_AMX)
/* bfloat16 q, k, v with at least FA_AMX_MIN_ROWS stacked rows (GQA heads x
 * query positions) per key/value head run on the AMX tiles (kernel_bf16_amx.c). */
#define FA_AMX_MIN_ROWS 32
extern const fa_kernel fa_kernel_bf16_amx;
#endif
#if defined(FA_HAVE_AMX_FP16)
/* float16 q, k, v with as many rows on AMX-FP16 tiles (kernel_f16_amx.c). */
extern const fa_kernel fa_kernel_f16_amx;
#endif
#if defined(FA_HAVE_AVX512BF16)
/* The same calls on VDPBF16PS where the ISA is avx512bf16 (kernel_bf16_avx512bf16.c). */
#ifndef FA_AMX_MIN_ROWS
#define FA_AMX_MIN_ROWS 32
#endif
extern const fa_kernel fa_kernel_bf16_avx512bf16;
#endif
#endif
#if defined(__aarch64__)
#define FA_HAVE_ARM64 1
extern const fa_kernel fa_kernel_f32_neon;
void fa_exp2_neon(const float *x, float *y, int64_t n);
#if defined(FA_HAVE_SVE)
/* Fixed-length SVE units (setup.py builds them where the compiler has
 * -msve-vector-bits), each run only at its own vector length. */
extern const fa_kernel fa_kernel_f32_sve256, fa_kernel_f32_sve512;
void fa_exp2_sve256(const float *x, float *y, int64_t n);
void fa_exp2_sve512(const float *x, float *y, int64_t n);
#endif
#endif
void fa_exp2_scalar(const float *x, float *y, int64_t n);

const fa_kernel *fa_select_kernel(const fa_params *p); /* dispatch.c */

/* Threads and floating-point environment shared by the drivers (attention.c).
 * fa_team_size: the team for a call that asks for `requested` threads, after
 * the bound (1024), fork safety (1 in a fork() child of a process that ran a
 * team) and a check that the OS will start that many threads; 0 when it will
 * not (report FA_ETHREADS).  fa_fpenv_enter/exit: every thread that runs a part
 * of a call computes in round-to-nearest with FTZ/DAZ and restores its mode. */
typedef struct fa_fpenv { unsigned int csr; int round; } fa_fpenv;
int fa_team_size(int requested);
void fa_fpenv_enter(fa_fpenv *e);
void fa_fpenv_exit(const fa_fpenv *e);

/* Internal consistency checks, compiled in debug and sanitizer builds only
 * (-DFA_DEBUG_SCRATCH, set by tools/sanitize.sh): a failed check aborts with a
 * message, which the sanitizer run reports as a failure. */
#if defined(FA_DEBUG_SCRATCH)
#include <stdio.h>
#include <stdlib.h>
#define FA_DEBUG_CHECK(cond, msg) \
    do { if (!(cond)) { fprintf(stderr, "fastattn: internal check failed at %s:%d: %s\n", \
                                __FILE__, __LINE__, msg); abort(); } } while (0)
#else
#define FA_DEBUG_CHECK(cond, msg) ((void)0)
#endif

#endif

/* tiles.h: cache sizes and the forward kernels' row block (tiles.c). */
#ifndef FA_TILES_H
#define FA_TILES_H

#include "kernel.h"

/* Share of the core's L2 that a task's stacked rows may fill (tiles.c). */
#define FA_L2_SHARE 0.28
/* The most stacked rows per task any choice (derived or FASTATTN_TILES) gives. */
#define FA_ROWS_MAX 4096
/* Query length from which tasks take the long-sequence row block. */
#define FA_LONG_L 1024
/* Shorter calls take the L2 block only while it leaves them at least this many
 * tasks (B * Hq * L stacked rows / rows per task), so that the dynamic schedule
 * still balances threads: 32 tasks give 16 threads two each. */
#define FA_MIN_TASKS 32

/* Rows per task of kernel k for the call p: the FASTATTN_TILES override, else
 * the L2 rule (for causal or windowed calls of most kernels: at every L, at
 * most L / 2). */
int64_t fa_rows_per_task(const fa_kernel *k, const fa_params *p);

#endif

/* kernel_run.h: one task of the fused kernel (kernel.h), included twice by
 * kernel_impl.h: as run() (FA_RUN_DROP 0) and as run_dropout() (FA_RUN_DROP
 * 1: a dropout task takes path_prefill, whose tiles dropout_tile masks,
 * whatever its rows).  Two copies of the text rather than one always-inline
 * body with a flag: run() then compiles to the instructions it had before
 * dropout existed (objdump-compared), and the decode paths inlined in it
 * moved by up to 10% with GCC's code layout before (see FA_PATH). */
/* One task (kernel.h): derive the task's constants and load Q (task_init),
 * run the one path that fits its rows and K/V layout over its keys,
 * normalise and write. */
FA_PATH void FA_NAME(FA_RUN_NAME)(const fa_params *p, const fa_task *t, void *scratch)
{
    fa_ctx c;
    fa_ws w;
    const int path = FA_NAME(task_init)(p, t, scratch, FA_RUN_DROP, &c, &w);
    if (path == FA_PATH_ROW1) FA_NAME(path_row1)(&c, &w, 1);
    else if (path == FA_PATH_ROWS) FA_NAME(path_rows)(&c, &w);
    else FA_NAME(path_prefill)(&c, &w);

    FA_NAME(write_out)(&c, &w);
}


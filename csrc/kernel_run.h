/* kernel_run.h: one task of the fused kernel (kernel.h), included twice by
 * kernel_impl.h: as run() (FA_RUN_DROP 0) and as run_dropout() (FA_RUN_DROP
 * 1: a dropout task takes path_prefill, whose tiles dropout_tile masks,
 * whatever its rows).  Two copies of the text rather than one always-inline
 * body with a flag: run() then compiles to the instructions it had before
 * dropout existed (objdump-compared), and the decode paths inlined in it
 * moved by up to 10% with GCC's code layout before (see FA_PATH). */
/* One task (kernel.h): derive the task's constants, load Q, run the one path
 * that fits its rows and K/V layout over its keys, normalise and write. */
FA_PATH void FA_NAME(FA_RUN_NAME)(const fa_params *p, const fa_task *t, void *scratch)
{
    fa_ctx c;
    fa_ws w;
    FA_NAME(carve)(p, t->rows, scratch, &w);
    c.p = p;
    c.t = t;
    c.G = p->Hq / p->Hk;
    c.D = p->D;
    c.Dv = p->Dv;
    c.b = t->b;
    c.Dp = fa_rup(c.D, VW);
    c.Dvp = fa_rup(c.Dv, VW);
    c.bi = fa_batch_info(p, c.b);
    c.delta = c.bi.Sb - c.bi.Lb;
    c.ni = fa_min64(t->ni, c.bi.Lb - t->i0);
    if (c.ni < 0) c.ni = 0;
    c.R = c.G * c.ni;
    /* Every buffer of the scratch holds cap_rows rows (attention.c checks the
     * whole scratch with a guard zone in debug builds). */
    FA_DEBUG_CHECK(c.G * t->ni <= FA_NAME(cap_rows)(p, t->rows), "task stacks more rows than its scratch holds");
    c.use_log2 = p->softcap == 0.0;
    c.ksz = (int64_t)fa_dtype_size(p->k_dtype);
    c.vsz = (int64_t)fa_dtype_size(p->v_dtype);
    /* Paged: tile_stream finds each tile's rows (and per-token scales) through
     * the block table; k_sb is then a page stride, not a batch one. */
    c.page = p->block_table ? p->page_size : 0;
    c.page_shift = -1;
    if (c.page > 0 && (c.page & (c.page - 1)) == 0)
        for (c.page_shift = 0; ((int64_t)1 << c.page_shift) < c.page; c.page_shift++) {}
    c.bt = p->block_table ? p->block_table + c.b * p->bt_sb : NULL;
    c.kbase = (const char *)p->k + (c.page ? 0 : (c.b * p->k_sb + t->hk * p->k_sh + c.bi.koff * p->k_sl) * c.ksz);
    c.vbase = (const char *)p->v + (c.page ? 0 : (c.b * p->v_sb + t->hk * p->v_sh + c.bi.koff * p->v_sl) * c.vsz);
    const int kdirect = p->k_dtype == FA_SELF_DT && c.D % VW == 0;
    c.vdirect = p->v_dtype == FA_SELF_DT && c.Dv % VW == 0;
    /* The decode paths widen 16- and 8-bit K/V rows as they load them. */
    const int wide16 = sizeof(REAL) == 4;
    c.kfuse = c.D % VW == 0 && (kdirect || (wide16 && (fa_dtype_16(p->k_dtype) || fa_dtype_8(p->k_dtype))));
    c.vfuse = c.Dv % VW == 0 && (c.vdirect || (wide16 && (fa_dtype_16(p->v_dtype) || fa_dtype_8(p->v_dtype))));
    /* 8-bit scales (fa_ctx): a per-token one at key 0 of this (batch, kv
     * head), else a per-channel (or per-head) one. */
    c.kts = c.vts = c.kcs = c.vcs = NULL;
    c.kts_sl = c.vts_sl = c.kcs_sd = c.vcs_sd = 0;
    if (p->k_scale) {
        if (p->ks_sl) { /* per token (paged: with the pages, tile_stream) */
            c.kts = p->k_scale + (c.page ? 0 : c.b * p->ks_sb + t->hk * p->ks_sh + c.bi.koff * p->ks_sl);
            c.kts_sl = p->ks_sl;
        } else { c.kcs = p->k_scale + c.b * p->ks_sb + t->hk * p->ks_sh; c.kcs_sd = p->ks_sd; }
    }
    if (p->v_scale) {
        if (p->vs_sl) {
            c.vts = p->v_scale + (c.page ? 0 : c.b * p->vs_sb + t->hk * p->vs_sh + c.bi.koff * p->vs_sl);
            c.vts_sl = p->vs_sl;
        } else { c.vcs = p->v_scale + c.b * p->vs_sb + t->hk * p->vs_sh; c.vcs_sd = p->vs_sd; }
    }

    /* Key range any row may see, and the range every row sees (visible ranges
     * grow with the row: the first row has the smallest lo, the last the
     * largest hi, mask.h). */
    c.jlo = c.jhi = c.flo = c.fhi = 0;
    if (c.R > 0) {
        int64_t lo0, hi0, lo1, hi1;
        fa_row_range(p, t->i0 + c.delta, c.bi.Sb, &lo0, &hi0);
        fa_row_range(p, t->i0 + c.ni - 1 + c.delta, c.bi.Sb, &lo1, &hi1);
        c.jlo = fa_max64(lo0, t->j0);
        c.jhi = fa_min64(hi1, fa_min64(t->j1, c.bi.Sb));
        c.flo = lo1;
        c.fhi = hi0;
    }
    c.elem_always = p->mask_kind != FA_MASK_NONE || p->alibi || !c.use_log2 || p->bmask;
    c.mask_only = p->mask_kind != FA_MASK_NONE && !p->alibi && c.use_log2 && !p->bmask;
    /* Q.K^T's loop order (qk_packed): panel by panel when the packed K tile
     * would not stay in L1 beside a block's queries and scores (over 3/4 of
     * L1d; 32 KiB where cpuid does not tell). */
    {
        int64_t l1d, l2, l3;
        fa_cache_sizes(&l1d, &l2, &l3);
        if (l1d <= 0) l1d = 32768;
        c.panel_outer = (int64_t)(FA_BLK_BN * sizeof(REAL)) * c.Dp * 4 > 3 * l1d;
        /* The call's K and V come from DRAM where they are over half the L3
         * (an unknown L3: assumed so): then path_rows has P.V prefetch the
         * next tile's K (pv_rows; where they stayed in L3 between calls that
         * prefetch cost 3-8%). */
        const int64_t kv_bytes = p->B * p->Hk * p->S * (p->D * c.ksz + p->Dv * c.vsz);
        c.kv_dram = l3 <= 0 || kv_bytes > l3 / 2;
    }

    /* The path, chosen once per task.  A single row read in place takes
     * path_row1 when its output row fits pv_row1's registers (its long tile
     * fits the S scratch: cap_rows keeps at least FA_ROW_TN / FA_BLK_BN rows);
     * other tasks of at most FA_BLK_RD rows take path_rows; the rest, and
     * every task with dropout (applied to the probability tiles of
     * path_prefill only: dropout is for training, whose calls are prefill
     * shapes), path_prefill. */
    const int64_t nvo = c.Dvp / VW;
    const int rows = c.R <= FA_BLK_RD && !FA_RUN_DROP;
    const int row1 = c.R == 1 && rows && c.kfuse && c.vfuse && (nvo == 4 || nvo == 8 || nvo == 12 || nvo == 16);
    FA_NAME(load_q)(&c, &w, !rows); /* path_prefill's Q is packed by register block */
    /* The head K buffer (head_keys), when this task's keys fit it: a fresh
     * (batch, kv head, key range) starts it empty. */
    c.kh = NULL;
    if (!rows && w.Kh && c.jhi - c.jlo <= w.kh_keys) {
        fa_scratch_state *hs = w.st;
        if (!(hs->valid && hs->b == c.b && hs->hk == t->hk && hs->j0 == c.jlo && hs->j1 == c.jhi)) {
            hs->valid = 1; hs->b = c.b; hs->hk = t->hk; hs->j0 = c.jlo; hs->j1 = c.jhi; hs->upto = c.jlo;
        }
        c.kh = w.Kh;
    }
    if (row1) FA_NAME(path_row1)(&c, &w);
    else if (rows) FA_NAME(path_rows)(&c, &w);
    else FA_NAME(path_prefill)(&c, &w);

    FA_NAME(write_out)(&c, &w);
}


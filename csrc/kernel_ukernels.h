/* kernel_ukernels.h: the micro-kernels of kernel_impl.h (included there, once
 * per dtype and ISA, after its blocking constants, FA_NAME, fa_stream and
 * FA_PREFETCH_ROW): the register-blocked prefill products (qk_ukernel,
 * pv_ukernel over packed K panels and V blocks), the decode-row products that
 * read K and V in place (qk_rows, pv_rows, pv_row1), and one dispatch function
 * per micro-kernel that turns the run-time row count, vector count and storage
 * dtype into compile-time constants (the *_n and *_dt functions), so that each
 * specialisation is its own unrolled code.  Nothing here is sized by the
 * sequence length. */
/* S[i][0:nv*VW] = sum_d Qp[d][i] * Kp[d][0:nv*VW] for mr rows (register
 * blocked).  Both operands are packed d-major: Qp holds the block's mr query
 * rows as columns (load_q), Kp a panel of nv*VW keys (nv <= FA_BLK_NV), so
 * every broadcast is at an immediate offset from one pointer.  (With the rows
 * a stride apart, the 12-row AVX-512 block needed 11 index registers, and
 * the spills that followed small changes elsewhere in the task cost 5%.) */
FA_INLINE void FA_NAME(qk_ukernel)(int mr, int nv, const REAL *Qp, const REAL *Kp, int64_t D, REAL *S,
                                   int64_t lds)
{
    vf acc[FA_BLK_MR][FA_BLK_NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        vf kv[FA_BLK_NV];
        for (int v = 0; v < nv; v++) kv[v] = vf_load(Kp + d * nv * VW + v * VW);
        for (int i = 0; i < mr; i++) {
            vf a = vf_set1(Qp[d * mr + i]);
            for (int v = 0; v < nv; v++) acc[i][v] = vf_fma(a, kv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) vf_store(S + i * lds + v * VW, acc[i][v]);
}

/* O[i][0:nv*VW] += sum_j P[i][j] * V[j][0:nv*VW] for mr rows, nj keys. */
FA_INLINE void FA_NAME(pv_ukernel)(int mr, int nv, const REAL *P, int64_t ldp, int64_t nj,
                                   const REAL *V, int64_t ldv, REAL *O, int64_t ldo)
{
    vf acc[FA_BLK_MR][FA_BLK_NVO];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = vf_load(O + i * ldo + v * VW);
    for (int64_t j = 0; j < nj; j++) {
        vf vv[FA_BLK_NVO];
        for (int v = 0; v < nv; v++) vv[v] = vf_load(V + j * ldv + v * VW);
        for (int i = 0; i < mr; i++) {
            vf a = vf_set1(P[i * ldp + j]);
            for (int v = 0; v < nv; v++) acc[i][v] = vf_fma(a, vv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) vf_store(O + i * ldo + v * VW, acc[i][v]);
}

/* VW values of storage dtype dt (a constant after inlining) at element idx. */
FA_INLINE vf FA_NAME(ld)(const void *base, int dt, int64_t idx)
{
    if (dt == FA_F16) return vf_load_f16((const uint16_t *)base + idx);
    if (dt == FA_BF16) return vf_load_bf16((const uint16_t *)base + idx);
    if (dt == FA_I8) return vf_load_i8((const int8_t *)base + idx);
    if (dt == FA_E4M3) return vf_load_e4m3((const uint8_t *)base + idx);
    if (dt == FA_E5M2) return vf_load_e5m2((const uint8_t *)base + idx);
    return vf_load((const REAL *)base + idx);
}

/* 2*VW consecutive values of dtype dt at element idx as two vectors (*a the
 * first VW): where simd.h has a paired load (FA_HAVE_LOAD2: AVX2's fp8, whose
 * bit operations then run once on twice the lanes), that; else ld() twice. */
FA_INLINE void FA_NAME(ld2)(const void *base, int dt, int64_t idx, vf *a, vf *b)
{
#if defined(FA_HAVE_LOAD2)
    if (dt == FA_E4M3) { vf_load2_e4m3((const uint8_t *)base + idx, a, b); return; }
    if (dt == FA_E5M2) { vf_load2_e5m2((const uint8_t *)base + idx, a, b); return; }
#endif
    *a = FA_NAME(ld)(base, dt, idx);
    *b = FA_NAME(ld)(base, dt, idx + VW);
}

/* Few rows (decode): S[r][jj] = Q[r] . K[jj] straight from the key rows
 * (element stride ldk, storage dtype kdt widened on load), which need no
 * packing; Dp is a multiple of VW and Q rows are zero-padded.  kb keys at a
 * time, each dot product in two accumulators (even / odd vectors of d), keep
 * nr x kb x 2 = 8 FMA chains in flight with only kb row pointers live (8 keys
 * x 1 accumulator spilled pointers to the stack: measured 5-13% slower on
 * DRAM-bound decode).  One horizontal sum per dot product.
 * Load order: a float32 K is read key after key, each row in address order
 * (the hardware prefetchers then keep up without software prefetch: a C loop
 * reading K that way ran at 97% of a plain sum over the same arrays, with the
 * kb rows interleaved by d at 75-85%; fastattn B1 H32 S8192 D128 decode +7-15%
 * on 2 threads, Zen 3).  16-bit rows (half as long, widened on load) keep the
 * d-major order and the software prefetch, which measured no worse there. */
FA_INLINE void FA_NAME(qk_rows)(int nr, int kdt, const REAL *Q, int64_t Dp, const void *K, int64_t ldk,
                                int64_t nj, REAL *S, int64_t lds, const char *vpf, int64_t vpf_ld,
                                int64_t vpf_row, const fa_stream *st)
{
    const int kb = nr == 1 ? 4 : nr == 2 ? 2 : 1; /* nr * kb * 2 <= 8 chains */
    const int half = fa_dtype_16(kdt) || fa_dtype_8(kdt); /* 16- and 8-bit rows: see above */
    const int64_t kbytes = (int64_t)fa_dtype_size(kdt), krow = Dp * kbytes;
    /* The two-accumulator part of d; 5-8 rows keep one accumulator per row
     * (already nr chains; two would spill them). */
    const int64_t Dp2 = nr > 4 ? 0 : Dp / (2 * VW) * (2 * VW);
    int64_t j = 0;
    for (; j + kb <= nj; j += kb) {
        /* Software prefetch (decode streams from DRAM): a 16-bit K's rows
         * FA_PF_KEYS keys ahead (float32 rows are read in address order, below,
         * and measured 0-6% faster without), and the V rows of these keys for
         * the P.V pass, which reads them in column blocks. */
        for (int u = 0; u < kb; u++) {
            const int64_t t = j + u + FA_PF_KEYS;
            if (st) { /* one stream: this tile's K rows, then its V rows (16-bit only) */
                const int pf = half || st->paged; /* paged float32 rows: no hardware stream to follow */
                if (pf && t < st->nj) FA_PREFETCH_ROW(st->k + t * st->kld, st->krow, 3);
                else if (pf && t - st->nj < st->nj) FA_PREFETCH_ROW(st->v + (t - st->nj) * st->vld, st->vrow, 3);
            } else if (half) {
                FA_PREFETCH_ROW((const char *)K + t * ldk * kbytes, krow, 3);
            }
            if (vpf) FA_PREFETCH_ROW(vpf + (j + u) * vpf_ld, vpf_row, 2);
        }
        vf acc0[FA_BLK_RD][4], acc1[FA_BLK_RD][4];
        for (int r = 0; r < nr; r++)
            for (int u = 0; u < kb; u++) acc0[r][u] = acc1[r][u] = vf_zero();
        const char *kr = (const char *)K + j * ldk * kbytes;
        if (!half && kb == 1) /* one key: its row in address order */
            for (int64_t d = 0; d < Dp2; d += 2 * VW) {
                vf k0, k1;
                FA_NAME(ld2)(kr, kdt, d, &k0, &k1);
                for (int r = 0; r < nr; r++) {
                    acc0[r][0] = vf_fma(vf_load(Q + r * Dp + d), k0, acc0[r][0]);
                    acc1[r][0] = vf_fma(vf_load(Q + r * Dp + d + VW), k1, acc1[r][0]);
                }
            }
        else if (!half) /* key after key, each row in address order */
            for (int u = 0; u < kb; u++) {
                const void *ku = kr + u * ldk * kbytes;
                /* Not unrolled: the kb keys' rows unrolled into one block
                 * let GCC's scheduler interleave their loads where it saw
                 * fit (B1 H32 S8192 D128 decode 0.86-0.90x in a build where
                 * it did); as a loop per key they issue key after key.  One
                 * key (above) has nothing to interleave and keeps the
                 * unrolled form (as a loop: H32/8 decode 0.94x on avx2). */
#pragma GCC unroll 1
                for (int64_t d = 0; d < Dp2; d += 2 * VW) {
                    vf k0, k1;
                    FA_NAME(ld2)(ku, kdt, d, &k0, &k1);
                    for (int r = 0; r < nr; r++) {
                        acc0[r][u] = vf_fma(vf_load(Q + r * Dp + d), k0, acc0[r][u]);
                        acc1[r][u] = vf_fma(vf_load(Q + r * Dp + d + VW), k1, acc1[r][u]);
                    }
                }
            }
        else for (int64_t d = 0; d < Dp2; d += 2 * VW) {
            vf q0[FA_BLK_RD], q1[FA_BLK_RD];
            for (int r = 0; r < nr; r++) {
                q0[r] = vf_load(Q + r * Dp + d);
                q1[r] = vf_load(Q + r * Dp + d + VW);
            }
            for (int u = 0; u < kb; u++) {
                const void *ku = kr + u * ldk * kbytes;
                vf k0, k1;
                FA_NAME(ld2)(ku, kdt, d, &k0, &k1);
                for (int r = 0; r < nr; r++) {
                    acc0[r][u] = vf_fma(q0[r], k0, acc0[r][u]);
                    acc1[r][u] = vf_fma(q1[r], k1, acc1[r][u]);
                }
            }
        }
        for (int64_t d = Dp2; d < Dp; d += VW) /* the d past the pairs (all of it for 5-8 rows) */
            for (int u = 0; u < kb; u++) {
                vf kv = FA_NAME(ld)(kr + u * ldk * kbytes, kdt, d);
                for (int r = 0; r < nr; r++) acc0[r][u] = vf_fma(vf_load(Q + r * Dp + d), kv, acc0[r][u]);
            }
        for (int r = 0; r < nr; r++)
            for (int u = 0; u < kb; u++)
                S[r * lds + j + u] = vf_hsum(Dp2 ? vf_add(acc0[r][u], acc1[r][u]) : acc0[r][u]);
    }
    for (; j < nj; j++) {
        vf acc[FA_BLK_RD];
        for (int r = 0; r < nr; r++) acc[r] = vf_zero();
        for (int64_t d = 0; d < Dp; d += VW) {
            vf kv = FA_NAME(ld)(K, kdt, j * ldk + d);
            for (int r = 0; r < nr; r++) acc[r] = vf_fma(vf_load(Q + r * Dp + d), kv, acc[r]);
        }
        for (int r = 0; r < nr; r++) S[r * lds + j] = vf_hsum(acc[r]);
    }
}

/* O[r][c0:c0+nv*VW] += sum_j P[r][j] V[j][c0:...] for nr <= FA_BLK_RD rows with the
 * output block held in registers over all nj keys (V: dtype vdt, stride ldv). */
FA_INLINE void FA_NAME(pv_rows_blk)(int nr, int nv, int vdt, const REAL *P, int64_t ldp, int64_t nj,
                                    const void *V, int64_t c0, int64_t ldv, REAL *O, int64_t Dvp)
{
    vf acc[FA_BLK_RD][8];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = vf_load(O + r * Dvp + c0 + v * VW);
    for (int64_t j = 0; j < nj; j++) {
        vf pr[FA_BLK_RD];
        for (int r = 0; r < nr; r++) pr[r] = vf_set1(P[r * ldp + j]);
        int v = 0;
        for (; v + 2 <= nv; v += 2) { /* pairs: ld2 */
            vf v0, v1;
            FA_NAME(ld2)(V, vdt, j * ldv + c0 + v * VW, &v0, &v1);
            for (int r = 0; r < nr; r++) {
                acc[r][v] = vf_fma(pr[r], v0, acc[r][v]);
                acc[r][v + 1] = vf_fma(pr[r], v1, acc[r][v + 1]);
            }
        }
        for (; v < nv; v++) {
            vf vv = FA_NAME(ld)(V, vdt, j * ldv + c0 + v * VW);
            for (int r = 0; r < nr; r++) acc[r][v] = vf_fma(pr[r], vv, acc[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) vf_store(O + r * Dvp + c0 + v * VW, acc[r][v]);
}

/* One row: O[0:nv*VW] += sum_j P[j] V[j] with the whole output row in registers
 * (nv <= 16), so that V is read row after row, in address order; a 16-bit V
 * continues the tile's prefetch stream (its V rows, then the next tile's K
 * rows; see qk_rows for why float32 has none). */
FA_INLINE void FA_NAME(pv_row1)(int nv, int vdt, const REAL *P, int64_t nj, const void *V, int64_t ldv,
                                REAL *O, const fa_stream *st)
{
    vf acc[16];
    for (int v = 0; v < nv; v++) acc[v] = vf_load(O + v * VW);
    for (int64_t j = 0; j < nj; j++) {
        const int64_t t = j + FA_PF_KEYS;
        if (fa_dtype_16(vdt) || fa_dtype_8(vdt) || st->paged) {
            if (t < nj) FA_PREFETCH_ROW(st->v + t * st->vld, st->vrow, 3);
            else if (t - nj < st->nkn) FA_PREFETCH_ROW(st->kn + (t - nj) * st->kld, st->krow, 3);
        }
        vf pj = vf_set1(P[j]);
        for (int v = 0; v < nv; v += 2) { /* nv is even (4, 8, 12 or 16) */
            vf v0, v1;
            FA_NAME(ld2)(V, vdt, j * ldv + v * VW, &v0, &v1);
            acc[v] = vf_fma(pj, v0, acc[v]);
            acc[v + 1] = vf_fma(pj, v1, acc[v + 1]);
        }
    }
    for (int v = 0; v < nv; v++) vf_store(O + v * VW, acc[v]);
}

/* Few rows (decode): O[r] += sum_j P[r][j] V[j], column blocks of cb vectors,
 * keys in chunks of 32 so that a chunk of V stays in L1 across the blocks.
 * nx (or NULL: path_rows passes it where the call's K and V stream from DRAM,
 * fa_ctx.kv_dram): the next tile, whose K rows are prefetched towards L2 here,
 * spread over the column blocks.  This tile's V came in during its Q.K^T
 * (qk_rows' vpf) and P.V reads only caches; without this the DRAM idled for
 * the whole P.V pass and the next Q.K^T waited on its K rows (the hottest
 * load of an 8-row profile).  Same operations: the same bits.  Measured on
 * Zen 4, builds alternated in one process (tools/ab_builds.py), 2 threads,
 * float32 unless noted, avx2 / avx512 kernel: B1 H64/8 S8192 D128 1.12-1.29 /
 * 1.13, H32/8 1.20 / 0.98-1.13, B8 H32/8 S2048 1.28 / 1.11, H32/8 float16
 * 1.20 / 1.00.  (The float32 K rows prefetched in qk_rows instead, 16 keys
 * ahead into L1, as 16-bit ones are: 0.73 on avx2 H64/8.) */
FA_INLINE void FA_NAME(pv_rows)(int nr, int vdt, const REAL *P, int64_t ldp, int64_t nj,
                                const void *V, int64_t ldv, REAL *O, int64_t Dvp, const fa_stream *nx)
{
    const int cb = nr == 1 ? 8 : nr == 2 ? 4 : nr <= 4 ? 2 : 1; /* nr x cb <= 8 accumulators */
    const int64_t vsz = (int64_t)fa_dtype_size(vdt);
    const int64_t nblk = Dvp / (cb * VW);
    for (int64_t j0 = 0; j0 < nj; j0 += 32) {
        const int64_t nc = fa_min64(32, nj - j0);
        const void *Vj = (const char *)V + j0 * ldv * vsz;
        int64_t c0 = 0;
        for (int64_t ib = 0; c0 + cb * VW <= Dvp; c0 += cb * VW, ib++) {
            if (nx)
                for (int64_t t = j0 + nc * ib / nblk, te = fa_min64(j0 + nc * (ib + 1) / nblk, nx->nj); t < te; t++)
                    FA_PREFETCH_ROW(nx->k + t * nx->kld, nx->krow, 2);
            FA_NAME(pv_rows_blk)(nr, cb, vdt, P + j0, ldp, nc, Vj, c0, ldv, O, Dvp);
        }
        for (; c0 < Dvp; c0 += VW)
            FA_NAME(pv_rows_blk)(nr, 1, vdt, P + j0, ldp, nc, Vj, c0, ldv, O, Dvp);
    }
}

/* ---- Constant-n dispatch: one function per micro-kernel ----
 * Each switches a runtime row count (and storage dtype) to calls whose
 * arguments are compile-time constants, so that every case inlines its own
 * fully unrolled copy of the micro-kernel (accumulators in registers, ld()
 * without a branch per load).  They are always_inline themselves: the
 * constant-argument copies then sit in the caller (the path), as they did when
 * these switches were macros expanded in run(), and the caller's other
 * constants (a NULL stream, a known tile width) fold into them too. */

/* A row count clamped to the register block (cases past it are unreachable:
 * the callers pass at most FA_BLK_RD / FA_BLK_MR rows; the clamp keeps those
 * cases' array bounds valid where FA_BLK_RD or FA_BLK_MR is small). */
#define FA_RD(n) ((n) <= FA_BLK_RD ? (n) : FA_BLK_RD)
#define FA_MR(n) ((n) <= FA_BLK_MR ? (n) : FA_BLK_MR)

/* qk_rows for nr (a constant) rows, the K storage dtype kdt made constant:
 * float16, bfloat16, the 8-bit ones, else this kernel's own (FA_SELF_DT). */
FA_INLINE void FA_NAME(qk_rows_dt)(int nr, int kdt, const REAL *Q, int64_t Dp, const void *K,
                                   int64_t ldk, int64_t nj, REAL *S, int64_t lds, const char *vpf, int64_t vpf_ld,
                                   int64_t vpf_row, const fa_stream *st)
{
    if (kdt == FA_F16) FA_NAME(qk_rows)(nr, FA_F16, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else if (kdt == FA_BF16) FA_NAME(qk_rows)(nr, FA_BF16, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else if (kdt == FA_I8) FA_NAME(qk_rows)(nr, FA_I8, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else if (kdt == FA_E4M3) FA_NAME(qk_rows)(nr, FA_E4M3, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else if (kdt == FA_E5M2) FA_NAME(qk_rows)(nr, FA_E5M2, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else FA_NAME(qk_rows)(nr, FA_SELF_DT, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
}

/* qk_rows for R = 1..FA_BLK_RD rows (R > FA_BLK_RD does not take it). */
FA_INLINE void FA_NAME(qk_rows_n)(int64_t R, int kdt, const REAL *Q, int64_t Dp, const void *K,
                                  int64_t ldk, int64_t nj, REAL *S, int64_t lds, const char *vpf, int64_t vpf_ld,
                                  int64_t vpf_row, const fa_stream *st)
{
    switch (R) {
    case 1: FA_NAME(qk_rows_dt)(1, kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    case 2: FA_NAME(qk_rows_dt)(2, kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    case 3: FA_NAME(qk_rows_dt)(3, kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    case 4: FA_NAME(qk_rows_dt)(4, kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    case 5: FA_NAME(qk_rows_dt)(FA_RD(5), kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    case 6: FA_NAME(qk_rows_dt)(FA_RD(6), kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    case 7: FA_NAME(qk_rows_dt)(FA_RD(7), kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    default: FA_NAME(qk_rows_dt)(FA_BLK_RD, kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st); break;
    }
}

/* qk_rows_n with the usual padded head sizes (64, 128) as constants: each dot
 * product's loop over d then unrolls and its accumulators stay in registers
 * (with Dp a variable they went through the stack once per key).  Same
 * operations in the same order: the same bits.  Measured (Zen 3, the builds
 * alternated in one process): B1 H32 S8192 D128 decode, float32, +5% on 2
 * threads, +7% on 1. */
FA_INLINE void FA_NAME(qk_rows_nd)(int64_t R, int kdt, const REAL *Q, int64_t Dp, const void *K,
                                   int64_t ldk, int64_t nj, REAL *S, int64_t lds, const char *vpf, int64_t vpf_ld,
                                   int64_t vpf_row, const fa_stream *st)
{
    if (Dp == 128) FA_NAME(qk_rows_n)(R, kdt, Q, 128, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else if (Dp == 64) FA_NAME(qk_rows_n)(R, kdt, Q, 64, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
    else FA_NAME(qk_rows_n)(R, kdt, Q, Dp, K, ldk, nj, S, lds, vpf, vpf_ld, vpf_row, st);
}

/* pv_rows for nr (a constant) rows, the V storage dtype vdt made constant. */
FA_INLINE void FA_NAME(pv_rows_dt)(int nr, int vdt, const REAL *P, int64_t ldp, int64_t nj,
                                   const void *V, int64_t ldv, REAL *O, int64_t Dvp, const fa_stream *nx)
{
    if (vdt == FA_F16) FA_NAME(pv_rows)(nr, FA_F16, P, ldp, nj, V, ldv, O, Dvp, nx);
    else if (vdt == FA_BF16) FA_NAME(pv_rows)(nr, FA_BF16, P, ldp, nj, V, ldv, O, Dvp, nx);
    else if (vdt == FA_I8) FA_NAME(pv_rows)(nr, FA_I8, P, ldp, nj, V, ldv, O, Dvp, nx);
    else if (vdt == FA_E4M3) FA_NAME(pv_rows)(nr, FA_E4M3, P, ldp, nj, V, ldv, O, Dvp, nx);
    else if (vdt == FA_E5M2) FA_NAME(pv_rows)(nr, FA_E5M2, P, ldp, nj, V, ldv, O, Dvp, nx);
    else FA_NAME(pv_rows)(nr, FA_SELF_DT, P, ldp, nj, V, ldv, O, Dvp, nx);
}

/* pv_rows for R = 1..FA_BLK_RD rows. */
FA_INLINE void FA_NAME(pv_rows_n)(int64_t R, int vdt, const REAL *P, int64_t ldp, int64_t nj,
                                  const void *V, int64_t ldv, REAL *O, int64_t Dvp, const fa_stream *nx)
{
    switch (R) {
    case 1: FA_NAME(pv_rows_dt)(1, vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    case 2: FA_NAME(pv_rows_dt)(2, vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    case 3: FA_NAME(pv_rows_dt)(3, vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    case 4: FA_NAME(pv_rows_dt)(4, vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    case 5: FA_NAME(pv_rows_dt)(FA_RD(5), vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    case 6: FA_NAME(pv_rows_dt)(FA_RD(6), vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    case 7: FA_NAME(pv_rows_dt)(FA_RD(7), vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    default: FA_NAME(pv_rows_dt)(FA_BLK_RD, vdt, P, ldp, nj, V, ldv, O, Dvp, nx); break;
    }
}

/* pv_row1 for nv (a constant) vectors, the V storage dtype vdt made constant. */
FA_INLINE void FA_NAME(pv_row1_dt)(int nv, int vdt, const REAL *P, int64_t nj, const void *V,
                                   int64_t ldv, REAL *O, const fa_stream *st)
{
    if (vdt == FA_F16) FA_NAME(pv_row1)(nv, FA_F16, P, nj, V, ldv, O, st);
    else if (vdt == FA_BF16) FA_NAME(pv_row1)(nv, FA_BF16, P, nj, V, ldv, O, st);
    else if (vdt == FA_I8) FA_NAME(pv_row1)(nv, FA_I8, P, nj, V, ldv, O, st);
    else if (vdt == FA_E4M3) FA_NAME(pv_row1)(nv, FA_E4M3, P, nj, V, ldv, O, st);
    else if (vdt == FA_E5M2) FA_NAME(pv_row1)(nv, FA_E5M2, P, nj, V, ldv, O, st);
    else FA_NAME(pv_row1)(nv, FA_SELF_DT, P, nj, V, ldv, O, st);
}

/* pv_row1 for an output row of nvo = 4, 8, 12 or 16 vectors (path_row1 takes no other). */
FA_INLINE void FA_NAME(pv_row1_n)(int64_t nvo, int vdt, const REAL *P, int64_t nj, const void *V,
                                  int64_t ldv, REAL *O, const fa_stream *st)
{
    switch (nvo) {
    case 4: FA_NAME(pv_row1_dt)(4, vdt, P, nj, V, ldv, O, st); break;
    case 8: FA_NAME(pv_row1_dt)(8, vdt, P, nj, V, ldv, O, st); break;
    case 12: FA_NAME(pv_row1_dt)(12, vdt, P, nj, V, ldv, O, st); break;
    default: FA_NAME(pv_row1_dt)(16, vdt, P, nj, V, ldv, O, st); break;
    }
}

/* A vector count clamped to the panel width (as FA_RD / FA_MR). */
#define FA_NV(n) ((n) <= FA_BLK_NV ? (n) : FA_BLK_NV)

/* qk_ukernel for mr (a constant) rows and a panel of nv = 1..FA_BLK_NV vectors
 * (the full panels take FA_BLK_NV; a tile's last, narrower panel fewer). */
FA_INLINE void FA_NAME(qk_ukernel_nv)(int mr, int nv, const REAL *Qp, const REAL *Kp, int64_t D, REAL *S,
                                      int64_t lds)
{
    switch (nv) {
    case 1: FA_NAME(qk_ukernel)(mr, 1, Qp, Kp, D, S, lds); break;
    case 2: FA_NAME(qk_ukernel)(mr, FA_NV(2), Qp, Kp, D, S, lds); break;
    case 3: FA_NAME(qk_ukernel)(mr, FA_NV(3), Qp, Kp, D, S, lds); break;
    default: FA_NAME(qk_ukernel)(mr, FA_BLK_NV, Qp, Kp, D, S, lds); break;
    }
}

/* qk_ukernel for mr = 1..FA_BLK_MR rows (mr a constant per case), nv vectors. */
FA_INLINE void FA_NAME(qk_ukernel_n)(int mr, int nv, const REAL *Qp, const REAL *Kp, int64_t D, REAL *S,
                                     int64_t lds)
{
    switch (mr) {
    case 1: FA_NAME(qk_ukernel_nv)(1, nv, Qp, Kp, D, S, lds); break;
    case 2: FA_NAME(qk_ukernel_nv)(2, nv, Qp, Kp, D, S, lds); break;
    case 3: FA_NAME(qk_ukernel_nv)(3, nv, Qp, Kp, D, S, lds); break;
    case 4: FA_NAME(qk_ukernel_nv)(4, nv, Qp, Kp, D, S, lds); break;
    case 5: FA_NAME(qk_ukernel_nv)(FA_MR(5), nv, Qp, Kp, D, S, lds); break;
    case 6: FA_NAME(qk_ukernel_nv)(FA_MR(6), nv, Qp, Kp, D, S, lds); break;
    case 7: FA_NAME(qk_ukernel_nv)(FA_MR(7), nv, Qp, Kp, D, S, lds); break;
    case 8: FA_NAME(qk_ukernel_nv)(FA_MR(8), nv, Qp, Kp, D, S, lds); break;
    case 9: FA_NAME(qk_ukernel_nv)(FA_MR(9), nv, Qp, Kp, D, S, lds); break;
    case 10: FA_NAME(qk_ukernel_nv)(FA_MR(10), nv, Qp, Kp, D, S, lds); break;
    case 11: FA_NAME(qk_ukernel_nv)(FA_MR(11), nv, Qp, Kp, D, S, lds); break;
    default: FA_NAME(qk_ukernel_nv)(FA_BLK_MR, nv, Qp, Kp, D, S, lds); break;
    }
}

/* pv_ukernel for mr = 1..FA_BLK_MR rows and nv (a constant: FA_BLK_NVO or 1) vectors. */
FA_INLINE void FA_NAME(pv_ukernel_n)(int mr, int nv, const REAL *P, int64_t ldp, int64_t nj, const REAL *V,
                                     int64_t ldv, REAL *O, int64_t ldo)
{
    switch (mr) {
    case 1: FA_NAME(pv_ukernel)(1, nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 2: FA_NAME(pv_ukernel)(2, nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 3: FA_NAME(pv_ukernel)(3, nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 4: FA_NAME(pv_ukernel)(4, nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 5: FA_NAME(pv_ukernel)(FA_MR(5), nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 6: FA_NAME(pv_ukernel)(FA_MR(6), nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 7: FA_NAME(pv_ukernel)(FA_MR(7), nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 8: FA_NAME(pv_ukernel)(FA_MR(8), nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 9: FA_NAME(pv_ukernel)(FA_MR(9), nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 10: FA_NAME(pv_ukernel)(FA_MR(10), nv, P, ldp, nj, V, ldv, O, ldo); break;
    case 11: FA_NAME(pv_ukernel)(FA_MR(11), nv, P, ldp, nj, V, ldv, O, ldo); break;
    default: FA_NAME(pv_ukernel)(FA_BLK_MR, nv, P, ldp, nj, V, ldv, O, ldo); break;
    }
}

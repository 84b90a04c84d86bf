/*
 * ops/kda/intra.c -- N4: the intra-chunk matrices (kda.md §11.4(b), backward §11.6 B3 last line,
 * §11.6 B4).
 *
 * Per chunk (rows i, j < L) and value head:
 *   Araw[i,j] = sum_d q_i k_j exp(G_i - G_j)  (j <= i)      Aqk = s Araw
 *   P[i,j]    = sum_d k_i k_j exp(G_i - G_j)  (j <  i)      Lkk = Diag(beta) P
 *   Tm        = (I + Lkk)^{-1}   by forward substitution (unit lower triangular)
 * Backward from dAqk, dTm:  dLkk = -stril(Tm^T dTm Tm^T), then Rq, Cq, Rk, Ck of kda.md §11.6 B4
 * into dq, dk, dbeta, dG. Stability (kda.md §11.7): exponents G_i - G_j are only formed for j <= i,
 * where they are
 * <= 0 (G falls within a chunk), so nothing above 1 is ever exponentiated. P is recomputed in
 * backward on the fly from the same exponentials (it costs nothing extra), so the node keeps
 * q, k, beta, G and Tm under either policy. Shapes: q, k [B,T,H,K]; beta [B,T,HV];
 * G [B,T,HV,K]; Aqk, Tm [B,T,HV,BT]. CUDA: q, k, beta each f32 or bf16 (bf16 q and k are read
 * as stored; in the composite they may be factored, kda.h); G f32; Aqk, Tm f32.
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/intra.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

dg_status RF(dg__kda_intra_fwd)(const kda_dims *d, RT scale, const RT *q, const RT *k,
                                const RT *beta, const RT *G, RT *Aqk, RT *Tm) {
    const int H = d->H, HV = d->HV, K = d->K, BT = d->BT, grp = HV / H;
    const int64_t NC = d->chunk_off[d->N];
    /* Lkk of one chunk, [L,L], per thread */
    RT *Lks = (RT *)DG_MALLOC(sizeof(RT) * (size_t)BT * BT * (size_t)kda_max_threads());
    if (!Lks)
        return dg__err(DG_ERR_NOMEM, "kda_intra_fwd: no memory");
    /* work item: one (chunk, value head); it writes only its own rows of Aqk and Tm */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * HV > 1))
    for (int64_t w = 0; w < NC * HV; w++) {
        kda_chunk ch = kda_chunk_idx(d, w / HV);
        const int hv = (int)(w % HV);
        RT *Lk = Lks + (size_t)BT * BT * (size_t)kda_thread_id();
        const int hq = hv / grp;
        for (int i = 0; i < ch.L; i++) {
            const int64_t ti = ch.t0 + i;
            const RT *qi = q + (ti * H + hq) * K, *ki = k + (ti * H + hq) * K;
            const RT *Gi = G + (ti * HV + hv) * K;
            RT *arow = Aqk + (ti * HV + hv) * BT;
            memset(arow, 0, sizeof(RT) * (size_t)BT);
            for (int j = 0; j <= i; j++) {
                const int64_t tj = ch.t0 + j;
                const RT *kj = k + (tj * H + hq) * K, *Gj = G + (tj * HV + hv) * K;
                RT a = 0, p = 0;
                for (int e = 0; e < K; e++) {
                    RT x = kj[e] * REXP(Gi[e] - Gj[e]);
                    a += qi[e] * x;
                    p += ki[e] * x;
                }
                arow[j] = scale * a;
                if (j < i)
                    Lk[i * BT + j] = beta[ti * HV + hv] * p;
            }
        }
        /* T[i,j] = -sum_{m=j}^{i-1} Lkk[i,m] T[m,j]  (j < i), T[i,i] = 1 */
        for (int i = 0; i < ch.L; i++) {
            RT *trow = Tm + ((ch.t0 + i) * HV + hv) * BT;
            memset(trow, 0, sizeof(RT) * (size_t)BT);
            trow[i] = 1;
            for (int j = 0; j < i; j++) {
                RT s = 0;
                for (int m = j; m < i; m++)
                    s += Lk[i * BT + m] * Tm[((ch.t0 + m) * HV + hv) * BT + j];
                trow[j] = -s;
            }
        }
    }
    DG_FREE(Lks);
    return DG_OK;
}

dg_status RF(dg__kda_intra_bwd)(const kda_dims *d, RT scale, const RT *q, const RT *k,
                                const RT *beta, const RT *G, const RT *Tm, const RT *dAqk,
                                const RT *dTm, RT *dq, RT *dk, RT *dbeta, RT *dG) {
    const int H = d->H, HV = d->HV, K = d->K, BT = d->BT, grp = HV / H;
    const int64_t TT = d->B * d->T;
    memset(dq, 0, sizeof(RT) * (size_t)(TT * H * K));
    memset(dk, 0, sizeof(RT) * (size_t)(TT * H * K));
    memset(dbeta, 0, sizeof(RT) * (size_t)(TT * HV));
    memset(dG, 0, sizeof(RT) * (size_t)(TT * HV * K));
    const int64_t NC = d->chunk_off[d->N];
    /* X1 = dTm Tm^T and dL = dLkk of one chunk, both [L,L], per thread */
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * 2 * (size_t)BT * BT * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kda_intra_bwd: no memory");
#define TM(i, j) Tm[((ch.t0 + (i)) * HV + hv) * BT + (j)]
    /* work item: one (chunk, q/k head); the value heads of its group run in order inside, so
     * dq and dk of a GVA group accumulate in the same order as a serial loop */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t w = 0; w < NC * H; w++) {
        kda_chunk ch = kda_chunk_idx(d, w / H);
        const int L = ch.L, hq = (int)(w % H);
        RT *X1 = scr + 2 * (size_t)BT * BT * (size_t)kda_thread_id();
        RT *dL = X1 + BT * BT;
        for (int hv = hq * grp; hv < (hq + 1) * grp; hv++) {
            /* dLkk = -stril(Tm^T dTm Tm^T); only the strictly lower part of dTm matters (the
             * diagonal and upper part of Tm are constants) */
            memset(dL, 0, sizeof(RT) * (size_t)BT * BT);
            if (dTm) {
                for (int m = 0; m < L; m++) {
                    const RT *dtr = dTm + ((ch.t0 + m) * HV + hv) * BT;
                    for (int j = 0; j < m; j++) {
                        RT s = 0;
                        for (int a = 0; a <= j; a++) /* a < m and Tm[j,a] = 0 for a > j */
                            s += dtr[a] * TM(j, a);
                        X1[m * BT + j] = s;
                    }
                }
                for (int i = 0; i < L; i++)
                    for (int j = 0; j < i; j++) {
                        RT s = 0;
                        for (int m = i; m < L; m++) /* Tm[m,i] = 0 for m < i; X1[m,j]: j < m */
                            s += TM(m, i) * X1[m * BT + j];
                        dL[i * BT + j] = -s;
                    }
            }
            for (int i = 0; i < L; i++) {
                const int64_t ti = ch.t0 + i;
                const RT *qi = q + (ti * H + hq) * K, *ki = k + (ti * H + hq) * K;
                const RT *Gi = G + (ti * HV + hv) * K;
                const RT bi = beta[ti * HV + hv];
                RT *dqi = dq + (ti * H + hq) * K, *dki = dk + (ti * H + hq) * K;
                RT *dGi = dG + (ti * HV + hv) * K;
                RT db = 0;
                for (int j = 0; j <= i; j++) {
                    const int64_t tj = ch.t0 + j;
                    const RT *kj = k + (tj * H + hq) * K, *Gj = G + (tj * HV + hv) * K;
                    RT *dkj = dk + (tj * H + hq) * K, *dGj = dG + (tj * HV + hv) * K;
                    const RT dA = dAqk ? scale * dAqk[(ti * HV + hv) * BT + j] : (RT)0;
                    const RT dP = j < i ? bi * dL[i * BT + j] : (RT)0;
                    RT p = 0;
                    for (int e = 0; e < K; e++) {
                        const RT x = REXP(Gi[e] - Gj[e]);
                        const RT kjx = kj[e] * x;
                        const RT rq = dA * kjx, rk = dP * kjx;             /* row side, into i */
                        const RT cq = dA * qi[e] * x, ck = dP * ki[e] * x; /* column, into j */
                        dqi[e] += rq;
                        dki[e] += rk;
                        dkj[e] += cq + ck;
                        dGi[e] += qi[e] * rq + ki[e] * rk;
                        dGj[e] -= kj[e] * (cq + ck);
                        p += ki[e] * kjx;
                    }
                    if (j < i)
                        db += dL[i * BT + j] * p;
                }
                dbeta[ti * HV + hv] = db;
            }
        }
    }
#undef TM
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_intra"

/* The node's inputs; n->saved holds them in the same order, then the output Tm and the row
 * scales rq, rk of a factored q, k (NULL where there are none; kda.h). */
enum { IN_Q, IN_K, IN_BETA, IN_G, SAVED_TM, SAVED_RQ, SAVED_RK };

static dg_status intra_backward(dg_ctx *ctx, dg_node *n) {
    const kda_cfg *c = &((const kda_np *)n->params)->cfg;
    const dg_tensor *gA = dg__node_grad_out(n, 0), *gT = dg__node_grad_out(n, 1);
    if (!gA && !gT)
        return DG_OK;
    dg_tensor *q = n->saved[IN_Q], *k = n->saved[IN_K], *beta = n->saved[IN_BETA];
    dg_tensor *G = n->saved[IN_G], *Tm = n->saved[SAVED_TM];
    /* converted copies (NULL where the tensor already has the compute dtype), the gradients */
    dg_tensor *tq = NULL, *tk = NULL, *tbeta = NULL, *tG = NULL, *tTm = NULL, *tgA = NULL;
    dg_tensor *tgT = NULL, *dq = NULL, *dk = NULL, *dbeta = NULL, *dG = NULL;
    kda_intra_bwd_io io = {0};
    dg_status st =
        dg__kda_qk_ptrs(ctx, c, q, k, n->saved[SAVED_RQ], n->saved[SAVED_RK], &tq, &tk, &io.qk);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, beta, c->dt, &tbeta, &io.beta);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, G, c->dt, &tG, &io.G);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, Tm, c->dt, &tTm, &io.Tm);
    if (st == DG_OK && gA)
        st = dg__kda_ptr(ctx, gA, c->dt, &tgA, &io.dAqk);
    if (st == DG_OK && gT)
        st = dg__kda_ptr(ctx, gT, c->dt, &tgT, &io.dTm);
    /* on CUDA dq, dk, dG are added into gradients the tape already holds (the wy node's) */
    const kda_acc_targets at = dg__kda_grad_targets(n, c, IN_Q, IN_K, IN_G);
    io.acc = at.acc;
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, q, at.dq, &dq, &io.dq);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, k, at.dk, &dk, &io.dk);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, beta, NULL, &dbeta, &io.dbeta);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, G, at.dG, &dG, &io.dG);
    if (st == DG_OK)
        st = kda_run_intra_bwd(ctx, c, &io);
    dg_tensor *grads[4] = {dq, dk, dbeta, dG}; /* IN_Q, IN_K, IN_BETA, IN_G (NULL: added) */
    for (int i = 0; i < 4 && st == DG_OK; i++)
        if (grads[i] && dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, grads[i]);
    dg_tensor *owned[11] = {tq, tk, tbeta, tG, tTm, tgA, tgT, dq, dk, dbeta, dG};
    for (int i = 0; i < 11; i++)
        dg_tensor_free(&owned[i]);
    return st;
}

dg_status dg__kda_intra_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *rq, dg_tensor *rk,
                          dg_tensor *beta, dg_tensor *G, const dg_kda_opts *opts, kda_dev *share,
                          const kda_prep *prep, dg_tensor **Aqk, dg_tensor **Tm) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "Aqk", Aqk));
    DG_TRY(dg__check_ptr(OP, "Tm", Tm));
    *Aqk = *Tm = NULL;
    DG_TRY(dg__kda_check_first(OP, "q", q, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(OP, "beta", beta, ctx, 3, "B,T,HV"));
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    const int64_t HV = beta->shape[2];
    int64_t sq[4] = {B, T, H, K}, sb[3] = {B, T, HV}, sg[4] = {B, T, HV, K};
    kda_cfg cfg;
    DG_TRY(dg__kda_cfg_init(OP, ctx, opts, B, T, (int)H, (int)HV, (int)K, 1, q->dtype, &cfg));
    int64_t sa[4] = {B, T, HV, cfg.d.BT};
    dg_tensor *in[4] = {q, k, beta, G};                          /* IN_Q, IN_K, IN_BETA, IN_G */
    dg_tensor *tq = NULL, *tk = NULL, *tbeta = NULL, *tG = NULL; /* converted copies */
    kda_intra_fwd_io io = {0};
    dg_status st = dg__kda_check(OP, "k", k, ctx, cfg.m_in, 4, sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "beta", beta, ctx, cfg.m_in, 3, sb, "B,T,HV");
    if (st == DG_OK)
        st = dg__kda_check(OP, "G", G, ctx, cfg.m_f, 4, sg, "B,T,HV,K");
    if (st == DG_OK)
        st = dg__kda_cfg_dev(OP, ctx, &cfg, share);
    if (st == DG_OK)
        st = dg__kda_qk_ptrs(ctx, &cfg, q, k, rq, rk, &tq, &tk, &io.qk);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, beta, cfg.dt, &tbeta, &io.beta);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, G, cfg.dt, &tG, &io.G);
    if (st == DG_OK)
        st = dg__kda_new(ctx, &cfg, 4, sa, Aqk);
    if (st == DG_OK)
        st = dg__kda_new(ctx, &cfg, 4, sa, Tm);
#ifdef DG_HAVE_CUDA
    kda_intra_prep kp; /* the forward prep (kda.h): G, rq, rk are this kernel's outputs */
    if (st == DG_OK && prep && (!rq || !rk || !cfg.cuda))
        st = dg__err(DG_ERR_STATE, OP ": the forward prep needs a factored q, k on CUDA");
    if (st == DG_OK && prep) {
        kp = (kda_intra_prep){dg_tensor_data(prep->g),
                              prep->A_log ? dg_tensor_data(prep->A_log) : NULL,
                              prep->dt_bias ? dg_tensor_data(prep->dt_bias) : NULL,
                              cfg.gate,
                              (float)cfg.lb,
                              (float)KDA_L2_EPS,
                              dg_tensor_data(G),
                              dg_tensor_data(rq),
                              dg_tensor_data(rk)};
        io.prep = &kp;
    }
#else
    if (st == DG_OK && prep)
        st = dg__err(DG_ERR_STATE, OP ": the forward prep is CUDA-only");
#endif
    if (st == DG_OK) {
        io.Aqk = dg_tensor_data(*Aqk);
        io.Tm = dg_tensor_data(*Tm);
        st = kda_run_intra_fwd(ctx, &cfg, &io);
    }
    if (st == DG_OK && dg__needs_grad(4, in)) {
        dg_node *n;
        st = dg__node_new("kda_intra", DG_POLICY_RECOMPUTE, intra_backward, ctx, &n);
        if (st == DG_OK) {
            for (int i = 0; i < 4 && st == DG_OK; i++)
                dg__node_input(n, in[i]);
            if (st == DG_OK)
                st = dg__node_output(n, *Aqk);
            if (st == DG_OK)
                st = dg__node_output(n, *Tm);
            for (int i = 0; i < 4 && st == DG_OK; i++)
                dg__node_save(n, in[i]);
            if (st == DG_OK) {
                dg__node_save(n, *Tm); /* SAVED_TM */
                dg__node_save(n, rq);  /* SAVED_RQ, SAVED_RK (NULL: none) */
                dg__node_save(n, rk);
            }
            if (st == DG_OK && !dg__kda_np_new(n, &cfg, NULL))
                st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
            if (st == DG_OK)
                st = dg__node_commit(n);
            else
                dg__node_abort(n);
        }
    }
    dg_tensor_free(&tq);
    dg_tensor_free(&tk);
    dg_tensor_free(&tbeta);
    dg_tensor_free(&tG);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK) {
        dg_tensor_free(Aqk);
        dg_tensor_free(Tm);
    }
    return st;
}

dg_status dg_kda_intra(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *beta, dg_tensor *G,
                       const dg_kda_opts *opts, dg_tensor **Aqk, dg_tensor **Tm) {
    return dg__kda_intra_x(ctx, q, k, NULL, NULL, beta, G, opts, NULL, NULL, Aqk, Tm);
}
#endif

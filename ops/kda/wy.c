/*
 * ops/kda/wy.c -- N5: the UT/WY transform (kda.md §11.4(c); backward §11.6 B3 WY part, §2 N5).
 *
 * Per chunk (rows i < L) and value head, with gamma_i = exp(G_i), lambda = G_{L-1}:
 *   X = Diag(beta) (K . Gamma)    W = Tm X          U = Tm Diag(beta) Vc
 *   KG_i = k_i exp(lambda - G_i)  QG_i = q_i gamma_i (unscaled)
 * Backward: dX = Tm^T dW, dVb = Tm^T dU, dv = beta dVb, dbeta, dk, dG from X and KG/QG, and
 * dTm = dU (beta V)^T + dW X^T (lower triangle incl. the diagonal: Tm is read only there).
 * Every exponent (G_i, lambda - G_i) is <= 0. The node keeps its inputs only: whether W, U, KG,
 * QG themselves are kept for the later nodes is the "kda_wy" policy, applied by dg_kda_chunk
 * through the recompute group (kda_group.c). Shapes: q, k [B,T,H,K]; v [B,T,HV,V]; beta
 * [B,T,HV]; G [B,T,HV,K]; Tm [B,T,HV,BT]; W, KG, QG [B,T,HV,K]; U [B,T,HV,V].
 * CUDA: q, k, v, beta each f32 or bf16; G, Tm f32; the outputs in the storage dtype of the
 * intermediates (kda_cfg.mid: bf16 on the tensor-core path where the sizes allow, else f32),
 * their gradients f32; a bf16 v is read as stored and its gradient written in bf16 (no f32 dv).
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/wy.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

dg_status RF(dg__kda_wy_fwd)(const kda_dims *d, const RT *q, const RT *k, const RT *v,
                             const RT *beta, const RT *G, const RT *Tm, RT *W, RT *U, RT *KG,
                             RT *QG) {
    const int H = d->H, HV = d->HV, K = d->K, V = d->V, BT = d->BT, grp = HV / H;
    const int64_t NC = d->chunk_off[d->N];
    /* gamma = exp(G) of one chunk [L,K] per thread: formed once per row instead of per (i, j) */
    RT *gams = (RT *)DG_MALLOC(sizeof(RT) * (size_t)BT * K * (size_t)kda_max_threads());
    if (!gams)
        return dg__err(DG_ERR_NOMEM, "kda_wy_fwd: no memory");
    /* work item: one (chunk, value head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * HV > 1))
    for (int64_t w = 0; w < NC * HV; w++) {
        kda_chunk ch = kda_chunk_idx(d, w / HV);
        const int hv = (int)(w % HV), hq = hv / grp;
        const RT *lam = G + ((ch.t0 + ch.L - 1) * HV + hv) * K;
        RT *gam = gams + (size_t)BT * K * (size_t)kda_thread_id();
        for (int j = 0; j < ch.L && W; j++)
            for (int e = 0; e < K; e++)
                gam[j * K + e] = REXP(G[((ch.t0 + j) * HV + hv) * K + e]);
        for (int i = 0; i < ch.L; i++) {
            const int64_t ti = ch.t0 + i;
            const RT *Gi = G + (ti * HV + hv) * K;
            const RT *ki = k + (ti * H + hq) * K, *qi = q + (ti * H + hq) * K;
            const RT *trow = Tm + (ti * HV + hv) * BT;
            if (KG)
                for (int e = 0; e < K; e++)
                    KG[(ti * HV + hv) * K + e] = ki[e] * REXP(lam[e] - Gi[e]);
            if (QG)
                for (int e = 0; e < K; e++)
                    QG[(ti * HV + hv) * K + e] = qi[e] * REXP(Gi[e]);
            if (W) {
                RT *wr = W + (ti * HV + hv) * K;
                memset(wr, 0, sizeof(RT) * (size_t)K);
                for (int j = 0; j <= i; j++) {
                    const int64_t tj = ch.t0 + j;
                    const RT *kj = k + (tj * H + hq) * K, *gj = gam + j * K;
                    const RT f = trow[j] * beta[tj * HV + hv];
                    for (int e = 0; e < K; e++)
                        wr[e] += f * kj[e] * gj[e];
                }
            }
            if (U) {
                RT *ur = U + (ti * HV + hv) * V;
                memset(ur, 0, sizeof(RT) * (size_t)V);
                for (int j = 0; j <= i; j++) {
                    const int64_t tj = ch.t0 + j;
                    const RT *vj = v + (tj * HV + hv) * V;
                    const RT f = trow[j] * beta[tj * HV + hv];
                    for (int e = 0; e < V; e++)
                        ur[e] += f * vj[e];
                }
            }
        }
    }
    DG_FREE(gams);
    return DG_OK;
}

dg_status RF(dg__kda_wy_bwd)(const kda_dims *d, const RT *q, const RT *k, const RT *v,
                             const RT *beta, const RT *G, const RT *Tm, const RT *dW, const RT *dU,
                             const RT *dKG, const RT *dQG, RT *dq, RT *dk, RT *dv, RT *dbeta,
                             RT *dG, RT *dTm) {
    const int H = d->H, HV = d->HV, K = d->K, V = d->V, BT = d->BT, grp = HV / H;
    const int64_t TT = d->B * d->T;
    memset(dq, 0, sizeof(RT) * (size_t)(TT * H * K));
    memset(dk, 0, sizeof(RT) * (size_t)(TT * H * K));
    memset(dv, 0, sizeof(RT) * (size_t)(TT * HV * V));
    memset(dbeta, 0, sizeof(RT) * (size_t)(TT * HV));
    memset(dG, 0, sizeof(RT) * (size_t)(TT * HV * K));
    memset(dTm, 0, sizeof(RT) * (size_t)(TT * HV * BT));
    const int64_t NC = d->chunk_off[d->N];
    /* per chunk and thread: X [L,K], gamma [L,K], dX [L,K], dVb [L,V] */
    const size_t per = (size_t)BT * (3 * (size_t)K + (size_t)V);
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kda_wy_bwd: no memory");
    /* work item: one (chunk, q/k head); the value heads of its group run in order inside, so
     * dq and dk of a GVA group accumulate in the same order as a serial loop */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t w = 0; w < NC * H; w++) {
        kda_chunk ch = kda_chunk_idx(d, w / H);
        const int L = ch.L, hq = (int)(w % H);
        RT *X = scr + per * (size_t)kda_thread_id();
        RT *gam = X + BT * K, *dX = gam + BT * K, *dVb = dX + BT * K;
        for (int hv = hq * grp; hv < (hq + 1) * grp; hv++) {
            const int64_t tl = ch.t0 + L - 1;
            const RT *lam = G + (tl * HV + hv) * K;
            RT *dGl = dG + (tl * HV + hv) * K;
            memset(dX, 0, sizeof(RT) * (size_t)(BT * K + BT * V));
            for (int i = 0; i < L; i++) {
                const int64_t ti = ch.t0 + i;
                const RT *Gi = G + (ti * HV + hv) * K, *ki = k + (ti * H + hq) * K;
                const RT *qi = q + (ti * H + hq) * K;
                RT *dqi = dq + (ti * H + hq) * K, *dki = dk + (ti * H + hq) * K;
                RT *dGi = dG + (ti * HV + hv) * K;
                const RT bi = beta[ti * HV + hv];
                for (int e = 0; e < K; e++) {
                    gam[i * K + e] = REXP(Gi[e]);
                    X[i * K + e] = bi * ki[e] * gam[i * K + e];
                }
                if (dQG) /* QG = q gamma */
                    for (int e = 0; e < K; e++) {
                        RT t = dQG[(ti * HV + hv) * K + e] * gam[i * K + e];
                        dqi[e] += t;
                        dGi[e] += qi[e] * t;
                    }
                if (dKG) /* KG = k exp(lambda - G_i): -G_i for row i, +lambda for row L-1 */
                    for (int e = 0; e < K; e++) {
                        RT a = dKG[(ti * HV + hv) * K + e] * REXP(lam[e] - Gi[e]);
                        dki[e] += a;
                        dGi[e] -= ki[e] * a;
                        dGl[e] += ki[e] * a;
                    }
                /* dX_j += Tm[i,j] dW_i, dVb_j += Tm[i,j] dU_i; dTm[i,j] for j <= i */
                const RT *trow = Tm + (ti * HV + hv) * BT;
                RT *dtrow = dTm + (ti * HV + hv) * BT;
                for (int j = 0; j <= i; j++) {
                    const int64_t tj = ch.t0 + j;
                    RT s = 0;
                    if (dW) {
                        const RT *dwi = dW + (ti * HV + hv) * K;
                        for (int e = 0; e < K; e++)
                            dX[j * K + e] += trow[j] * dwi[e];
                    }
                    if (dU) {
                        const RT *dui = dU + (ti * HV + hv) * V, *vj = v + (tj * HV + hv) * V;
                        const RT bj = beta[tj * HV + hv];
                        RT su = 0;
                        for (int e = 0; e < V; e++) {
                            dVb[j * V + e] += trow[j] * dui[e];
                            su += dui[e] * vj[e];
                        }
                        s += su * bj;
                    }
                    dtrow[j] = s; /* the dW X^T part is added below, once X_j is known */
                }
            }
            for (int i = 0; i < L && dW; i++) {
                const RT *dwi = dW + ((ch.t0 + i) * HV + hv) * K;
                RT *dtrow = dTm + ((ch.t0 + i) * HV + hv) * BT;
                for (int j = 0; j <= i; j++) {
                    RT s = 0;
                    for (int e = 0; e < K; e++)
                        s += dwi[e] * X[j * K + e];
                    dtrow[j] += s;
                }
            }
            for (int i = 0; i < L; i++) {
                const int64_t ti = ch.t0 + i;
                const RT *ki = k + (ti * H + hq) * K, *vi = v + (ti * HV + hv) * V;
                RT *dki = dk + (ti * H + hq) * K, *dGi = dG + (ti * HV + hv) * K;
                const RT bi = beta[ti * HV + hv];
                RT db = 0;
                for (int e = 0; e < V; e++) {
                    dv[(ti * HV + hv) * V + e] = bi * dVb[i * V + e];
                    db += dVb[i * V + e] * vi[e];
                }
                for (int e = 0; e < K; e++) {
                    const RT dx = dX[i * K + e];
                    db += dx * ki[e] * gam[i * K + e];
                    dki[e] += bi * gam[i * K + e] * dx;
                    dGi[e] += X[i * K + e] * dx;
                }
                dbeta[ti * HV + hv] = db;
            }
        }
    }
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_wy"

/* The node's inputs, also its saved tensors in the same order, then the row scales rq, rk of a
 * factored q, k (NULL where there are none; kda.h). */
enum { IN_Q, IN_K, IN_V, IN_BETA, IN_G, IN_TM, SAVED_RQ, SAVED_RK };

static dg_status wy_backward(dg_ctx *ctx, dg_node *n) {
    const kda_cfg *c = &((const kda_np *)n->params)->cfg;
    const dg_tensor *gW = dg__node_grad_out(n, 0), *gU = dg__node_grad_out(n, 1);
    const dg_tensor *gKG = dg__node_grad_out(n, 2), *gQG = dg__node_grad_out(n, 3);
    if (!gW && !gU && !gKG && !gQG)
        return DG_OK;
    dg_tensor *q = n->saved[IN_Q], *k = n->saved[IN_K], *v = n->saved[IN_V];
    dg_tensor *beta = n->saved[IN_BETA], *G = n->saved[IN_G], *Tm = n->saved[IN_TM];
    /* converted copies (NULL where the tensor already has the compute dtype), the gradients */
    dg_tensor *tq = NULL, *tk = NULL, *tv = NULL, *tbeta = NULL, *tG = NULL, *tTm = NULL;
    dg_tensor *tgW = NULL, *tgU = NULL, *tgKG = NULL, *tgQG = NULL;
    dg_tensor *dq = NULL, *dk = NULL, *dv = NULL, *dbeta = NULL, *dG = NULL, *dTm = NULL;
    kda_wy_bwd_io io = {0};
    dg_status st =
        dg__kda_qk_ptrs(ctx, c, q, k, n->saved[SAVED_RQ], n->saved[SAVED_RK], &tq, &tk, &io.qk);
    if (st == DG_OK)
        st = dg__kda_in_ptr(ctx, v, c->dt, &tv, &io.v, &io.leaf_bf16);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, beta, c->dt, &tbeta, &io.beta);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, G, c->dt, &tG, &io.G);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, Tm, c->dt, &tTm, &io.Tm);
    if (st == DG_OK && gW)
        st = dg__kda_ptr(ctx, gW, c->dt, &tgW, &io.dW);
    if (st == DG_OK && gU)
        st = dg__kda_ptr(ctx, gU, c->dt, &tgU, &io.dU);
    if (st == DG_OK && gKG)
        st = dg__kda_ptr(ctx, gKG, c->dt, &tgKG, &io.dKG);
    if (st == DG_OK && gQG)
        st = dg__kda_ptr(ctx, gQG, c->dt, &tgQG, &io.dQG);
    /* on CUDA dq, dk, dG are added into gradients the tape already holds (G's from the state
     * node) */
    const kda_acc_targets at = dg__kda_grad_targets(n, c, IN_Q, IN_K, IN_G);
    io.acc = at.acc;
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, q, at.dq, &dq, &io.dq);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, k, at.dk, &dk, &io.dk);
    if (st == DG_OK && io.leaf_bf16) { /* the bf16 leaf's gradient, written as stored */
        st = dg_tensor_new(ctx, DG_BF16, v->ndim, v->shape, &dv);
        io.dv = dv ? dg_tensor_data(dv) : NULL;
    } else if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, v, NULL, &dv, &io.dv);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, beta, NULL, &dbeta, &io.dbeta);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, G, at.dG, &dG, &io.dG);
    if (st == DG_OK)
        st = dg__kda_grad_buffer(ctx, c, Tm, NULL, &dTm, &io.dTm);
    if (st == DG_OK)
        st = kda_run_wy_bwd(ctx, c, &io);
    dg_tensor *grads[6] = {dq, dk, dv, dbeta, dG, dTm}; /* IN_Q .. IN_TM (NULL: added) */
    for (int i = 0; i < 6 && st == DG_OK; i++)
        if (grads[i] && dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, grads[i]);
    dg_tensor *owned[16] = {tq,   tk,   tv, tbeta, tG, tTm,   tgW, tgU,
                            tgKG, tgQG, dq, dk,    dv, dbeta, dG,  dTm};
    for (int i = 0; i < 16; i++)
        dg_tensor_free(&owned[i]);
    return st;
}

dg_status dg__kda_wy_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *rq, dg_tensor *rk,
                       dg_tensor *v, dg_tensor *beta, dg_tensor *G, dg_tensor *Tm,
                       const dg_kda_opts *opts, kda_dev *share, dg_tensor **W, dg_tensor **U,
                       dg_tensor **KG, dg_tensor **QG) {
    dg_tensor **outs[4] = {W, U, KG, QG};
    static const char *onames[4] = {"W", "U", "KG", "QG"};
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    for (int i = 0; i < 4; i++) {
        DG_TRY(dg__check_ptr(OP, onames[i], outs[i]));
        *outs[i] = NULL;
    }
    DG_TRY(dg__kda_check_first(OP, "q", q, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(OP, "v", v, ctx, 4, "B,T,HV,V"));
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    const int64_t HV = v->shape[2], V = v->shape[3];
    kda_cfg cfg;
    DG_TRY(dg__kda_cfg_init(OP, ctx, opts, B, T, (int)H, (int)HV, (int)K, (int)V, q->dtype, &cfg));
    int64_t sq[4] = {B, T, H, K}, sv[4] = {B, T, HV, V}, sb[3] = {B, T, HV};
    int64_t sg[4] = {B, T, HV, K}, st_[4] = {B, T, HV, cfg.d.BT};
    dg_tensor *in[6] = {q, k, v, beta, G, Tm}; /* IN_Q .. IN_TM */
    /* converted copies (NULL where the tensor already has the compute dtype) */
    dg_tensor *tq = NULL, *tk = NULL, *tv = NULL, *tbeta = NULL, *tG = NULL, *tTm = NULL;
    kda_wy_fwd_io io = {0};
    dg_status st = dg__kda_check(OP, "k", k, ctx, cfg.m_in, 4, sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "v", v, ctx, cfg.m_in, 4, sv, "B,T,HV,V");
    if (st == DG_OK)
        st = dg__kda_check(OP, "beta", beta, ctx, cfg.m_in, 3, sb, "B,T,HV");
    if (st == DG_OK)
        st = dg__kda_check(OP, "G", G, ctx, cfg.m_f, 4, sg, "B,T,HV,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "Tm", Tm, ctx, cfg.m_f, 4, st_, "B,T,HV,BT");
    if (st == DG_OK)
        st = dg__kda_cfg_dev(OP, ctx, &cfg, share);
    if (st == DG_OK)
        st = dg__kda_qk_ptrs(ctx, &cfg, q, k, rq, rk, &tq, &tk, &io.qk);
    if (st == DG_OK)
        st = dg__kda_in_ptr(ctx, v, cfg.dt, &tv, &io.v, &io.leaf_bf16);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, beta, cfg.dt, &tbeta, &io.beta);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, G, cfg.dt, &tG, &io.G);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, Tm, cfg.dt, &tTm, &io.Tm);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, &cfg, 4, sg, W);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, &cfg, 4, sv, U);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, &cfg, 4, sg, KG);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, &cfg, 4, sg, QG);
    if (st == DG_OK) {
        io.W = dg_tensor_data(*W);
        io.U = dg_tensor_data(*U);
        io.KG = dg_tensor_data(*KG);
        io.QG = dg_tensor_data(*QG);
        st = kda_run_wy_fwd(ctx, &cfg, &io);
    }
    if (st == DG_OK && dg__needs_grad(6, in)) {
        dg_node *n;
        st = dg__node_new("kda_wy", DG_POLICY_RECOMPUTE, wy_backward, ctx, &n);
        if (st == DG_OK) {
            for (int i = 0; i < 6 && st == DG_OK; i++)
                dg__node_input(n, in[i]);
            for (int i = 0; i < 4 && st == DG_OK; i++)
                st = kda_output_mid(n, &cfg, *outs[i]);
            for (int i = 0; i < 6 && st == DG_OK; i++)
                dg__node_save(n, in[i]);
            if (st == DG_OK) {
                dg__node_save(n, rq); /* SAVED_RQ, SAVED_RK (NULL: none) */
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
    dg_tensor *owned[6] = {tq, tk, tv, tbeta, tG, tTm};
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&owned[i]);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK)
        for (int i = 0; i < 4; i++)
            dg_tensor_free(outs[i]);
    return st;
}

dg_status dg_kda_wy(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *beta,
                    dg_tensor *G, dg_tensor *Tm, const dg_kda_opts *opts, dg_tensor **W,
                    dg_tensor **U, dg_tensor **KG, dg_tensor **QG) {
    return dg__kda_wy_x(ctx, q, k, NULL, NULL, v, beta, G, Tm, opts, NULL, W, U, KG, QG);
}
#endif

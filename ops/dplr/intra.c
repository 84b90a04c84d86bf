/*
 * ops/dplr/intra.c -- dg_dplr_intra: the four intra-chunk matrices and the WY solve (dplr.md D3;
 * backward dplr.md D4 steps 5-7) as one tape node.
 *
 * Per chunk (rows i, j < L) and head, with Gi / Ge the inclusive / exclusive chunk cumsums:
 *   Aqk[i,j] = s sum_d q_i k_j exp(Gi_i - Gi_j)   (j <= i)
 *   Aqb[i,j] = s sum_d q_i b_j exp(Gi_i - Gi_j)   (j <= i)
 *   Aak[i,j] =   sum_d a_i k_j exp(Ge_i - Gi_j)   (j <  i)
 *   Aab[i,j] =   sum_d a_i b_j exp(Ge_i - Gi_j)   (j <  i)
 *   Tab = (I - Aab)^{-1}: T[i,i] = 1, T[i,j] = sum_{m=j}^{i-1} Aab[i,m] T[m,j] (row recursion)
 * Backward from dAqk, dAqb, dAak, dTab: dAab = +stril(Tab^T dTab Tab^T) (plus: Tab inverts
 * I - Aab), then the pairwise sums of every matrix into dq, dk, da, db; each operand is gated by
 * exactly one cumsum (q: +Gi, a: +Ge, k and b: -Gi), so dGi = q dq - k dk - b db and dGe = a da
 * (this node's contributions). Stability (D3): exponents are only formed for the pairs that are
 * read, where they are <= 0, so nothing above 1 is ever exponentiated. Aab is rebuilt in
 * backward from the same exponentials; the node keeps q, k, a, b, Gi, Ge and Tab under either
 * policy. Shapes: q, k, a, b, Gi, Ge [B,T,H,K]; Aqk, Aqb, Aak, Tab [B,T,H,BT] (token row t holds
 * row t - chunk start of its chunk's matrix). CPU: f64, or f32 computed in f32. CUDA
 * (kernels/dplr/intra.cu): q, k, a, b f32 or bf16 (one dtype, read as stored); Gi, Ge and the
 * four matrices f32.
 */
#ifndef DG_REF_TMPL
#include "dplr.h"
#define DG_REF_TMPL "dplr/intra.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

dg_status RF(dg__dplr_intra_fwd)(const kda_dims *d, RT scale, const RT *q, const RT *k, const RT *a,
                                 const RT *b, const RT *Gi, const RT *Ge, RT *Aqk, RT *Aqb, RT *Aak,
                                 RT *Tab) {
    const int H = d->H, K = d->K, BT = d->BT;
    const int64_t NC = d->chunk_off[d->N];
    /* Aab of one chunk, [BT,BT], per thread */
    RT *Abs = (RT *)DG_MALLOC(sizeof(RT) * (size_t)BT * BT * (size_t)kda_max_threads());
    if (!Abs)
        return dg__err(DG_ERR_NOMEM, "dplr_intra_fwd: no memory");
    /* work item: one (chunk, head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t w = 0; w < NC * H; w++) {
        const kda_chunk ch = kda_chunk_idx(d, w / H);
        const int h = (int)(w % H);
        RT *Ab = Abs + (size_t)BT * BT * (size_t)kda_thread_id();
        for (int i = 0; i < ch.L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *qi = q + ri * K, *ai = a + ri * K, *gii = Gi + ri * K, *gei = Ge + ri * K;
            RT *r_qk = Aqk + ri * BT, *r_qb = Aqb + ri * BT, *r_ak = Aak + ri * BT;
            memset(r_qk, 0, sizeof(RT) * (size_t)BT);
            memset(r_qb, 0, sizeof(RT) * (size_t)BT);
            memset(r_ak, 0, sizeof(RT) * (size_t)BT);
            for (int j = 0; j <= i; j++) {
                const int64_t rj = (ch.t0 + j) * H + h;
                const RT *kj = k + rj * K, *bj = b + rj * K, *gij = Gi + rj * K;
                RT sqk = 0, sqb = 0, sak = 0, sab = 0;
                for (int e = 0; e < K; e++) {
                    const RT x = qi[e] * REXP(gii[e] - gij[e]);
                    sqk += x * kj[e];
                    sqb += x * bj[e];
                }
                if (j < i)
                    for (int e = 0; e < K; e++) {
                        const RT x = ai[e] * REXP(gei[e] - gij[e]);
                        sak += x * kj[e];
                        sab += x * bj[e];
                    }
                r_qk[j] = scale * sqk;
                r_qb[j] = scale * sqb;
                r_ak[j] = sak;
                Ab[i * BT + j] = sab;
            }
        }
        for (int i = 0; i < ch.L; i++) {
            RT *trow = Tab + ((ch.t0 + i) * H + h) * BT;
            memset(trow, 0, sizeof(RT) * (size_t)BT);
            trow[i] = 1;
            for (int j = 0; j < i; j++) {
                RT s = 0;
                for (int m = j; m < i; m++)
                    s += Ab[i * BT + m] * Tab[((ch.t0 + m) * H + h) * BT + j];
                trow[j] = s;
            }
        }
    }
    DG_FREE(Abs);
    return DG_OK;
}

dg_status RF(dg__dplr_intra_bwd)(const kda_dims *d, RT scale, const RT *q, const RT *k, const RT *a,
                                 const RT *b, const RT *Gi, const RT *Ge, const RT *Tab,
                                 const RT *dAqk, const RT *dAqb, const RT *dAak, const RT *dTab,
                                 RT *dq, RT *dk, RT *da, RT *db, RT *dGi, RT *dGe) {
    const int H = d->H, K = d->K, BT = d->BT;
    const size_t nk = (size_t)(d->B * d->T) * (size_t)H * (size_t)K;
    RT *outs[6] = {dq, dk, da, db, dGi, dGe};
    for (int i = 0; i < 6; i++)
        memset(outs[i], 0, sizeof(RT) * nk);
    const int64_t NC = d->chunk_off[d->N];
    /* X1 = dTab Tab^T and dA = dAab of one chunk, both [BT,BT], per thread */
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * 2 * (size_t)BT * BT * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "dplr_intra_bwd: no memory");
#define TAB(i, j) Tab[((ch.t0 + (i)) * H + h) * BT + (j)]
    /* work item: one (chunk, head): the column sums stay inside the chunk */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t w = 0; w < NC * H; w++) {
        const kda_chunk ch = kda_chunk_idx(d, w / H);
        const int L = ch.L, h = (int)(w % H);
        RT *X1 = scr + 2 * (size_t)BT * BT * (size_t)kda_thread_id();
        RT *dA = X1 + BT * BT;
        /* dAab = stril(Tab^T S Tab^T) with S = stril(dTab): the diagonal and upper part of Tab
         * are constants. X1[m,j] = sum_{c<=j} S[m,c] Tab[j,c] is needed for j < m only. */
        memset(dA, 0, sizeof(RT) * (size_t)BT * BT);
        if (dTab) {
            for (int m = 0; m < L; m++) {
                const RT *dtr = dTab + ((ch.t0 + m) * H + h) * BT;
                for (int j = 0; j < m; j++) {
                    RT s = 0;
                    for (int c = 0; c <= j; c++)
                        s += dtr[c] * TAB(j, c);
                    X1[m * BT + j] = s;
                }
            }
            for (int i = 0; i < L; i++)
                for (int j = 0; j < i; j++) {
                    RT s = 0;
                    for (int m = i; m < L; m++)
                        s += TAB(m, i) * X1[m * BT + j];
                    dA[i * BT + j] = s;
                }
        }
        for (int i = 0; i < L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *qi = q + ri * K, *ai = a + ri * K, *gii = Gi + ri * K, *gei = Ge + ri * K;
            RT *dqi = dq + ri * K, *dai = da + ri * K;
            for (int j = 0; j <= i; j++) {
                const int64_t rj = (ch.t0 + j) * H + h;
                const RT *kj = k + rj * K, *bj = b + rj * K, *gij = Gi + rj * K;
                RT *dkj = dk + rj * K, *dbj = db + rj * K;
                const RT g1 = dAqk ? scale * dAqk[ri * BT + j] : (RT)0;
                const RT g2 = dAqb ? scale * dAqb[ri * BT + j] : (RT)0;
                if (g1 != 0 || g2 != 0)
                    for (int e = 0; e < K; e++) {
                        const RT x = REXP(gii[e] - gij[e]);
                        dqi[e] += (g1 * kj[e] + g2 * bj[e]) * x;
                        dkj[e] += g1 * qi[e] * x;
                        dbj[e] += g2 * qi[e] * x;
                    }
                if (j == i)
                    continue;
                const RT g3 = dAak ? dAak[ri * BT + j] : (RT)0, g4 = dA[i * BT + j];
                if (g3 != 0 || g4 != 0)
                    for (int e = 0; e < K; e++) {
                        const RT x = REXP(gei[e] - gij[e]);
                        dai[e] += (g3 * kj[e] + g4 * bj[e]) * x;
                        dkj[e] += g3 * ai[e] * x;
                        dbj[e] += g4 * ai[e] * x;
                    }
            }
        }
        for (int i = 0; i < L; i++) {
            const int64_t o = ((ch.t0 + i) * H + h) * K;
            for (int e = 0; e < K; e++) {
                dGi[o + e] = q[o + e] * dq[o + e] - k[o + e] * dk[o + e] - b[o + e] * db[o + e];
                dGe[o + e] = a[o + e] * da[o + e];
            }
        }
    }
#undef TAB
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_dplr_intra"

enum { NIN = 6, NOUT = 4 }; /* inputs q, k, a, b, Gi, Ge; outputs Aqk, Aqb, Aak, Tab */

static dg_status intra_backward(dg_ctx *ctx, dg_node *n) {
    const kda_cfg *c = &((const kda_np *)n->params)->cfg;
    const dg_tensor *go[NOUT];
    int any = 0;
    for (int i = 0; i < NOUT; i++)
        any |= (go[i] = dg__node_grad_out(n, i)) != NULL;
    if (!any)
        return DG_OK;
    /* saved: q, k, a, b (the leaves), Gi, Ge, Tab; then the output grads */
    const int bf16 = dplr_bf16(c, n->saved[0]);
    dg_tensor *tmp[NIN + 1 + NOUT] = {0}, *gr[NIN] = {0};
    const void *p[NIN + 1 + NOUT] = {0};
    dg_status st = DG_OK;
    for (int i = 0; i < NIN + 1 && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, n->saved[i], i < 4 ? dplr_leaf_dt(c, bf16) : c->dt, &tmp[i], &p[i]);
    for (int i = 0; i < NOUT && st == DG_OK; i++)
        if (go[i])
            st = dg__kda_ptr(ctx, go[i], c->dt, &tmp[NIN + 1 + i], &p[NIN + 1 + i]);
    for (int i = 0; i < NIN && st == DG_OK; i++) /* in the compute dtype (accumulated as such) */
        st = kda_new_as(ctx, c, n->saved[i], &gr[i]);
    if (st == DG_OK)
        st = dplr_run_intra_bwd(ctx, c, bf16, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8],
                                p[9], p[10], dg_tensor_data(gr[0]), dg_tensor_data(gr[1]),
                                dg_tensor_data(gr[2]), dg_tensor_data(gr[3]), dg_tensor_data(gr[4]),
                                dg_tensor_data(gr[5]));
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, gr[i]);
    for (int i = 0; i < NIN + 1 + NOUT; i++)
        dg_tensor_free(&tmp[i]);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&gr[i]);
    return st;
}

dg_status dg__dplr_intra_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *a, dg_tensor *b,
                           dg_tensor *Gi, dg_tensor *Ge, const dg_dplr_opts *opts, kda_dev *share,
                           dg_tensor **Aqk, dg_tensor **Aqb, dg_tensor **Aak, dg_tensor **Tab) {
    dg_tensor **outs[NOUT] = {Aqk, Aqb, Aak, Tab};
    static const char *onames[NOUT] = {"Aqk", "Aqb", "Aak", "Tab"};
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    for (int i = 0; i < NOUT; i++) {
        DG_TRY(dg__check_ptr(OP, onames[i], outs[i]));
        *outs[i] = NULL;
    }
    DG_TRY(dg__kda_check_first(OP, "q", q, ctx, 4, "B,T,H,K"));
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    kda_cfg cfg;
    DG_TRY(dg__dplr_cfg_init(OP, ctx, opts, B, T, (int)H, (int)K, 1, q->dtype, &cfg));
    const int64_t sq[4] = {B, T, H, K}, sa[4] = {B, T, H, cfg.d.BT};
    dg_tensor *in[NIN] = {q, k, a, b, Gi, Ge}, *tmp[NIN] = {0};
    static const char *inames[NIN] = {"q", "k", "a", "b", "Gi", "Ge"};
    const int bf16 = dplr_bf16(&cfg, q);
    const void *p[NIN] = {0};
    dg_status st = DG_OK;
    /* q, k, a, b: the leaves (q's dtype); Gi, Ge: the compute dtype */
    for (int i = 1; i < NIN && st == DG_OK; i++)
        st = dg__kda_check(OP, inames[i], in[i], ctx, i < 4 ? dplr_leaf_mask(&cfg, q) : cfg.m_f, 4,
                           sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__dplr_cfg_dev(OP, ctx, &cfg, share);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, in[i], i < 4 ? dplr_leaf_dt(&cfg, bf16) : cfg.dt, &tmp[i], &p[i]);
    for (int i = 0; i < NOUT && st == DG_OK; i++)
        st = dg__kda_new(ctx, &cfg, 4, sa, outs[i]);
    if (st == DG_OK)
        st = dplr_run_intra_fwd(ctx, &cfg, bf16, p[0], p[1], p[2], p[3], p[4], p[5],
                                dg_tensor_data(*Aqk), dg_tensor_data(*Aqb), dg_tensor_data(*Aak),
                                dg_tensor_data(*Tab));
    if (st == DG_OK && dg__needs_grad(NIN, in)) {
        dg_node *n = NULL;
        st = dg__node_new("dplr_intra", DG_POLICY_RECOMPUTE, intra_backward, ctx, &n);
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        for (int i = 0; i < NOUT && st == DG_OK; i++)
            st = dg__node_output(n, *outs[i]);
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_save(n, in[i]);
        if (st == DG_OK)
            dg__node_save(n, *Tab);
        if (st == DG_OK && !dg__kda_np_new(n, &cfg, NULL))
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&tmp[i]);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK)
        for (int i = 0; i < NOUT; i++)
            dg_tensor_free(outs[i]);
    return st;
}

dg_status dg_dplr_intra(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *a, dg_tensor *b,
                        dg_tensor *Gi, dg_tensor *Ge, const dg_dplr_opts *opts, dg_tensor **Aqk,
                        dg_tensor **Aqb, dg_tensor **Aak, dg_tensor **Tab) {
    return dg__dplr_intra_x(ctx, q, k, a, b, Gi, Ge, opts, NULL, Aqk, Aqb, Aak, Tab);
}
#endif

/*
 * ops/dplr/wy.c -- dg_dplr_wy: the WY representation and the gated operands (dplr.md D3; backward
 * dplr.md D4 steps 4-5) as one tape node.
 *
 * Per chunk (rows i < L) and head, lam = Gi_{L-1} (the chunk's total log decay):
 *   ag_i = a_i exp(Ge_i)     X = Aak v (Aak read for j < i)     w = Tab ag,  u = Tab X
 *   qg_i = s q_i exp(Gi_i)   kg_i = k_i exp(lam - Gi_i)         bg_i = b_i exp(lam - Gi_i)
 * (Tab read for j <= i; the scale s is folded into qg.) Backward from dw, du, dqg, dkg, dbg:
 *   dag = Tab^T dw    dX = Tab^T du    dTab[i,j] = dw_i . ag_j + du_i . X_j   (j <= i)
 *   dAak[i,j] = dX_i . v_j (j < i)     dv = Aak^T dX     da = dag exp(Ge),  dGe = a da
 *   dq = s dqg exp(Gi), dGi += q dq;   dk = dkg exp(lam - Gi), dGi -= k dk,
 *   dGi_{L-1} += sum_i k_i dk_i        (the same for b: lam is Gi at the last row)
 * Every exponent (Gi_i, Ge_i, lam - Gi_i) is <= 0. The node keeps its inputs only: whether w, u,
 * qg, kg, bg themselves are kept for the later nodes is the "dplr_wy" policy, applied by
 * dg_dplr_chunk through the recompute group (dplr_group.c). Shapes: q, k, a, b, Gi, Ge, w, qg, kg,
 * bg [B,T,H,K]; v, u [B,T,H,V]; Aak, Tab [B,T,H,BT]. CPU: f64, or f32 computed in f32. CUDA
 * (kernels/dplr/wy.cu): q, k, v, a, b f32 or bf16 (one dtype, read as stored); Gi, Ge, Aak, Tab
 * and the outputs f32.
 */
#ifndef DG_REF_TMPL
#include "dplr.h"
#define DG_REF_TMPL "dplr/wy.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

dg_status RF(dg__dplr_wy_fwd)(const kda_dims *d, RT scale, const RT *q, const RT *k, const RT *v,
                              const RT *a, const RT *b, const RT *Gi, const RT *Ge, const RT *Aak,
                              const RT *Tab, RT *w, RT *u, RT *qg, RT *kg, RT *bg) {
    const int H = d->H, K = d->K, V = d->V, BT = d->BT;
    const int64_t NC = d->chunk_off[d->N];
    /* per thread: ag [BT,K], X [BT,V] */
    const size_t per = (size_t)BT * ((size_t)K + (size_t)V);
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "dplr_wy_fwd: no memory");
    /* work item: one (chunk, head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t it = 0; it < NC * H; it++) {
        const kda_chunk ch = kda_chunk_idx(d, it / H);
        const int h = (int)(it % H), L = ch.L;
        RT *ag = scr + per * (size_t)kda_thread_id(), *X = ag + BT * K;
        const RT *lam = Gi + ((ch.t0 + L - 1) * H + h) * K;
        for (int i = 0; i < L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *gii = Gi + ri * K;
            for (int e = 0; e < K; e++) {
                const RT fl = REXP(lam[e] - gii[e]);
                if (qg)
                    qg[ri * K + e] = scale * q[ri * K + e] * REXP(gii[e]);
                if (kg)
                    kg[ri * K + e] = k[ri * K + e] * fl;
                if (bg)
                    bg[ri * K + e] = b[ri * K + e] * fl;
                ag[i * K + e] = a[ri * K + e] * REXP(Ge[ri * K + e]);
            }
            RT *xi = X + i * V;
            memset(xi, 0, sizeof(RT) * (size_t)V);
            for (int j = 0; j < i && u; j++) {
                const RT c = Aak[ri * BT + j], *vj = v + ((ch.t0 + j) * H + h) * V;
                for (int e = 0; e < V; e++)
                    xi[e] += c * vj[e];
            }
        }
        for (int i = 0; i < L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *trow = Tab + ri * BT;
            if (w) {
                RT *wr = w + ri * K;
                memset(wr, 0, sizeof(RT) * (size_t)K);
                for (int j = 0; j <= i; j++)
                    for (int e = 0; e < K; e++)
                        wr[e] += trow[j] * ag[j * K + e];
            }
            if (u) {
                RT *ur = u + ri * V;
                memset(ur, 0, sizeof(RT) * (size_t)V);
                for (int j = 0; j <= i; j++)
                    for (int e = 0; e < V; e++)
                        ur[e] += trow[j] * X[j * V + e];
            }
        }
    }
    DG_FREE(scr);
    return DG_OK;
}

dg_status RF(dg__dplr_wy_bwd)(const kda_dims *d, RT scale, const RT *q, const RT *k, const RT *v,
                              const RT *a, const RT *b, const RT *Gi, const RT *Ge, const RT *Aak,
                              const RT *Tab, const RT *dw, const RT *du, const RT *dqg,
                              const RT *dkg, const RT *dbg, RT *dq, RT *dk, RT *dv, RT *da, RT *db,
                              RT *dGi, RT *dGe, RT *dAak, RT *dTab) {
    const int H = d->H, K = d->K, V = d->V, BT = d->BT;
    const size_t rows = (size_t)(d->B * d->T) * (size_t)H;
    RT *zk[6] = {dq, dk, da, db, dGi, dGe};
    for (int i = 0; i < 6; i++)
        memset(zk[i], 0, sizeof(RT) * rows * (size_t)K);
    memset(dv, 0, sizeof(RT) * rows * (size_t)V);
    memset(dAak, 0, sizeof(RT) * rows * (size_t)BT);
    memset(dTab, 0, sizeof(RT) * rows * (size_t)BT);
    const int64_t NC = d->chunk_off[d->N];
    /* per thread: ag [BT,K], dag [BT,K], X [BT,V], dX [BT,V] */
    const size_t per = 2 * (size_t)BT * ((size_t)K + (size_t)V);
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "dplr_wy_bwd: no memory");
    /* work item: one (chunk, head); every write stays inside the chunk */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t it = 0; it < NC * H; it++) {
        const kda_chunk ch = kda_chunk_idx(d, it / H);
        const int h = (int)(it % H), L = ch.L;
        RT *ag = scr + per * (size_t)kda_thread_id(), *dag = ag + BT * K;
        RT *X = dag + BT * K, *dX = X + BT * V;
        const int64_t rl = (ch.t0 + L - 1) * H + h;
        const RT *lam = Gi + rl * K;
        memset(dag, 0, sizeof(RT) * (size_t)BT * K);
        memset(dX, 0, sizeof(RT) * (size_t)BT * V);
        /* rebuild ag and X; dag_j = sum_{i>=j} Tab[i,j] dw_i, dX_j = sum_{i>=j} Tab[i,j] du_i */
        for (int i = 0; i < L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            for (int e = 0; e < K; e++)
                ag[i * K + e] = a[ri * K + e] * REXP(Ge[ri * K + e]);
            RT *xi = X + i * V;
            memset(xi, 0, sizeof(RT) * (size_t)V);
            for (int j = 0; j < i; j++) {
                const RT c = Aak[ri * BT + j], *vj = v + ((ch.t0 + j) * H + h) * V;
                for (int e = 0; e < V; e++)
                    xi[e] += c * vj[e];
            }
        }
        for (int i = 0; i < L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *trow = Tab + ri * BT;
            RT *dtrow = dTab + ri * BT;
            for (int j = 0; j <= i; j++) {
                RT s = 0;
                if (dw) {
                    const RT *dwi = dw + ri * K;
                    for (int e = 0; e < K; e++) {
                        dag[j * K + e] += trow[j] * dwi[e];
                        s += dwi[e] * ag[j * K + e];
                    }
                }
                if (du) {
                    const RT *dui = du + ri * V;
                    for (int e = 0; e < V; e++) {
                        dX[j * V + e] += trow[j] * dui[e];
                        s += dui[e] * X[j * V + e];
                    }
                }
                dtrow[j] = s;
            }
        }
        /* X = Aak v: dAak[i,j] = dX_i . v_j, dv_j += Aak[i,j] dX_i (j < i) */
        for (int i = 0; i < L && du; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *dxi = dX + i * V;
            for (int j = 0; j < i; j++) {
                const int64_t rj = (ch.t0 + j) * H + h;
                const RT *vj = v + rj * V, c = Aak[ri * BT + j];
                RT *dvj = dv + rj * V, s = 0;
                for (int e = 0; e < V; e++) {
                    s += dxi[e] * vj[e];
                    dvj[e] += c * dxi[e];
                }
                dAak[ri * BT + j] = s;
            }
        }
        RT *dgl = dGi + rl * K;
        for (int i = 0; i < L; i++) {
            const int64_t ri = (ch.t0 + i) * H + h;
            const RT *gii = Gi + ri * K;
            for (int e = 0; e < K; e++) {
                const int64_t x = ri * K + e;
                const RT fl = REXP(lam[e] - gii[e]);
                const RT dai = dag[i * K + e] * REXP(Ge[x]);
                const RT dqi = dqg ? scale * dqg[x] * REXP(gii[e]) : (RT)0;
                const RT dki = dkg ? dkg[x] * fl : (RT)0, dbi = dbg ? dbg[x] * fl : (RT)0;
                const RT side = k[x] * dki + b[x] * dbi; /* -Gi_i here, +lam at the last row */
                da[x] = dai;
                dGe[x] = a[x] * dai;
                dq[x] = dqi;
                dk[x] = dki;
                db[x] = dbi;
                dGi[x] += q[x] * dqi - side;
                dgl[e] += side;
            }
        }
    }
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_dplr_wy"

enum { NIN = 9, NOUT = 5 }; /* q, k, v, a, b, Gi, Ge, Aak, Tab -> w, u, qg, kg, bg */

/* inputs 0..4 (q, k, v, a, b) are the leaves */
static int is_leaf(int i) { return i < 5; }

static dg_status wy_backward(dg_ctx *ctx, dg_node *n) {
    const kda_cfg *c = &((const kda_np *)n->params)->cfg;
    const dg_tensor *go[NOUT];
    int any = 0;
    for (int i = 0; i < NOUT; i++)
        any |= (go[i] = dg__node_grad_out(n, i)) != NULL;
    if (!any)
        return DG_OK;
    const int bf16 = dplr_bf16(c, n->saved[0]);
    dg_tensor *tmp[NIN + NOUT] = {0}, *gr[NIN] = {0};
    const void *p[NIN + NOUT] = {0};
    dg_status st = DG_OK;
    for (int i = 0; i < NIN && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, n->saved[i], is_leaf(i) ? dplr_leaf_dt(c, bf16) : c->dt, &tmp[i],
                         &p[i]);
    for (int i = 0; i < NOUT && st == DG_OK; i++)
        if (go[i])
            st = dg__kda_ptr(ctx, go[i], c->dt, &tmp[NIN + i], &p[NIN + i]);
    for (int i = 0; i < NIN && st == DG_OK; i++) /* in the compute dtype (accumulated as such) */
        st = kda_new_as(ctx, c, n->saved[i], &gr[i]);
    void *g[NIN];
    for (int i = 0; i < NIN; i++)
        g[i] = gr[i] ? dg_tensor_data(gr[i]) : NULL;
    if (st == DG_OK) /* gradient order: dq, dk, dv, da, db, dGi, dGe, dAak, dTab */
        st = dplr_run_wy_bwd(ctx, c, bf16, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8],
                             p[9], p[10], p[11], p[12], p[13], g[0], g[1], g[2], g[3], g[4], g[5],
                             g[6], g[7], g[8]);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, gr[i]);
    for (int i = 0; i < NIN + NOUT; i++)
        dg_tensor_free(&tmp[i]);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&gr[i]);
    return st;
}

dg_status dg__dplr_wy_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                        dg_tensor *b, dg_tensor *Gi, dg_tensor *Ge, dg_tensor *Aak, dg_tensor *Tab,
                        const dg_dplr_opts *opts, kda_dev *share, dg_tensor **w, dg_tensor **u,
                        dg_tensor **qg, dg_tensor **kg, dg_tensor **bg) {
    dg_tensor **outs[NOUT] = {w, u, qg, kg, bg};
    static const char *onames[NOUT] = {"w", "u", "qg", "kg", "bg"};
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    for (int i = 0; i < NOUT; i++) {
        DG_TRY(dg__check_ptr(OP, onames[i], outs[i]));
        *outs[i] = NULL;
    }
    DG_TRY(dg__kda_check_first(OP, "q", q, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(OP, "v", v, ctx, 4, "B,T,H,V"));
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    const int64_t V = v->shape[3];
    kda_cfg cfg;
    DG_TRY(dg__dplr_cfg_init(OP, ctx, opts, B, T, (int)H, (int)K, (int)V, q->dtype, &cfg));
    const int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, sa[4] = {B, T, H, cfg.d.BT};
    dg_tensor *in[NIN] = {q, k, v, a, b, Gi, Ge, Aak, Tab}, *tmp[NIN] = {0};
    static const char *inames[NIN] = {"q", "k", "v", "a", "b", "Gi", "Ge", "Aak", "Tab"};
    const int bf16 = dplr_bf16(&cfg, q);
    const void *p[NIN] = {0};
    dg_status st = DG_OK;
    for (int i = 1; i < NIN && st == DG_OK; i++) {
        const int64_t *s = i == 2 ? sv : i >= 7 ? sa : sk;
        const char *names = i == 2 ? "B,T,H,V" : i >= 7 ? "B,T,H,BT" : "B,T,H,K";
        st = dg__kda_check(OP, inames[i], in[i], ctx,
                           is_leaf(i) ? dplr_leaf_mask(&cfg, q) : cfg.m_f, 4, s, names);
    }
    if (st == DG_OK)
        st = dg__dplr_cfg_dev(OP, ctx, &cfg, share);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        st =
            dg__kda_ptr(ctx, in[i], is_leaf(i) ? dplr_leaf_dt(&cfg, bf16) : cfg.dt, &tmp[i], &p[i]);
    for (int i = 0; i < NOUT && st == DG_OK; i++)
        st = dg__kda_new(ctx, &cfg, 4, i == 1 ? sv : sk, outs[i]);
    if (st == DG_OK)
        st = dplr_run_wy_fwd(ctx, &cfg, bf16, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8],
                             dg_tensor_data(*w), dg_tensor_data(*u), dg_tensor_data(*qg),
                             dg_tensor_data(*kg), dg_tensor_data(*bg));
    if (st == DG_OK && dg__needs_grad(NIN, in)) {
        dg_node *n = NULL;
        st = dg__node_new("dplr_wy", DG_POLICY_RECOMPUTE, wy_backward, ctx, &n);
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        for (int i = 0; i < NOUT && st == DG_OK; i++)
            st = dg__node_output(n, *outs[i]);
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_save(n, in[i]);
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

dg_status dg_dplr_wy(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                     dg_tensor *b, dg_tensor *Gi, dg_tensor *Ge, dg_tensor *Aak, dg_tensor *Tab,
                     const dg_dplr_opts *opts, dg_tensor **w, dg_tensor **u, dg_tensor **qg,
                     dg_tensor **kg, dg_tensor **bg) {
    return dg__dplr_wy_x(ctx, q, k, v, a, b, Gi, Ge, Aak, Tab, opts, NULL, w, u, qg, kg, bg);
}
#endif

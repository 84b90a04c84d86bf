/*
 * ops/dplr/output.c -- dg_dplr_output: the output (dplr.md D3; backward D4 step 1) as one tape
 * node.
 *
 *   o_c = qg_c h_c + Aqk_c v_c + Aqb_c v2_c     (inter-chunk through the state + causal intra)
 * qg carries the scale (wy.c), Aqk and Aqb too (intra.c), so no scale appears here.
 * Backward: dqg = dO h^T, dh_c = qg^T dO, dAqk = tril(dO v^T), dAqb = tril(dO v2^T) (j <= i),
 * dv = Aqk^T dO, dv2 = Aqb^T dO. Aqk, Aqb are read only for j <= i, so their other entries get a
 * zero gradient. The node reads qg, h and v2 through the recompute group (dplr_group.c): inside
 * dg_dplr_chunk they are rebuilt in backward under the default policies; used alone, the node
 * keeps its inputs.
 * Shapes: qg [B,T,H,K]; h [B,NT,H,K,V]; Aqk, Aqb [B,T,H,BT]; v, v2, o [B,T,H,V]. CPU: f64, or f32
 * computed in f32. CUDA (kernels/dplr/output.cu): v f32 or bf16 (read as stored), o in v's dtype
 * (written so by the kernel, as is o's gradient read), everything else f32.
 */
#ifndef DG_REF_TMPL
#include "dplr.h"
#define DG_REF_TMPL "dplr/output.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

void RF(dg__dplr_output_fwd)(const kda_dims *d, const RT *qg, const RT *h, const RT *Aqk,
                             const RT *Aqb, const RT *v, const RT *v2, RT *o) {
    const int H = d->H, K = d->K, V = d->V, BT = d->BT;
    const int64_t KV = (int64_t)K * V, NC = d->chunk_off[d->N];
    /* work item: one (chunk, head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t it = 0; it < NC * H; it++) {
        const kda_chunk ch = kda_chunk_idx(d, it / H);
        const int hh = (int)(it % H);
        const RT *hc = h + (ch.idx * H + hh) * KV;
        for (int i = 0; i < ch.L; i++) {
            const int64_t ri = (ch.t0 + i) * H + hh;
            const RT *qgi = qg + ri * K, *r1 = Aqk + ri * BT, *r2 = Aqb + ri * BT;
            RT *oi = o + ri * V;
            memset(oi, 0, sizeof(RT) * (size_t)V);
            for (int x = 0; x < K; x++)
                for (int y = 0; y < V; y++)
                    oi[y] += qgi[x] * hc[x * V + y];
            for (int j = 0; j <= i; j++) {
                const int64_t rj = (ch.t0 + j) * H + hh;
                const RT *vj = v + rj * V, *v2j = v2 + rj * V;
                for (int y = 0; y < V; y++)
                    oi[y] += r1[j] * vj[y] + r2[j] * v2j[y];
            }
        }
    }
}

void RF(dg__dplr_output_bwd)(const kda_dims *d, const RT *qg, const RT *h, const RT *Aqk,
                             const RT *Aqb, const RT *v, const RT *v2, const RT *dO, RT *dqg,
                             RT *dh, RT *dAqk, RT *dAqb, RT *dv, RT *dv2) {
    const int H = d->H, K = d->K, V = d->V, BT = d->BT;
    const int64_t KV = (int64_t)K * V, NC = d->chunk_off[d->N], rows = d->B * d->T * H;
    /* rows of empty sequences are never visited: clear every output first */
    memset(dqg, 0, sizeof(RT) * (size_t)(rows * K));
    memset(dAqk, 0, sizeof(RT) * (size_t)(rows * BT));
    memset(dAqb, 0, sizeof(RT) * (size_t)(rows * BT));
    memset(dv, 0, sizeof(RT) * (size_t)(rows * V));
    memset(dv2, 0, sizeof(RT) * (size_t)(rows * V));
    memset(dh, 0, sizeof(RT) * (size_t)(NC * H * KV));
    /* work item: one (chunk, head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * H > 1))
    for (int64_t it = 0; it < NC * H; it++) {
        const kda_chunk ch = kda_chunk_idx(d, it / H);
        const int hh = (int)(it % H);
        const RT *hc = h + (ch.idx * H + hh) * KV;
        RT *dhc = dh + (ch.idx * H + hh) * KV;
        for (int i = 0; i < ch.L; i++) {
            const int64_t ri = (ch.t0 + i) * H + hh;
            const RT *qgi = qg + ri * K, *doi = dO + ri * V;
            const RT *r1 = Aqk + ri * BT, *r2 = Aqb + ri * BT;
            for (int x = 0; x < K; x++) {
                RT s = 0;
                for (int y = 0; y < V; y++) {
                    s += doi[y] * hc[x * V + y];
                    dhc[x * V + y] += qgi[x] * doi[y];
                }
                dqg[ri * K + x] = s;
            }
            for (int j = 0; j <= i; j++) {
                const int64_t rj = (ch.t0 + j) * H + hh;
                const RT *vj = v + rj * V, *v2j = v2 + rj * V;
                RT *dvj = dv + rj * V, *dv2j = dv2 + rj * V;
                RT s1 = 0, s2 = 0;
                for (int y = 0; y < V; y++) {
                    s1 += doi[y] * vj[y];
                    s2 += doi[y] * v2j[y];
                    dvj[y] += r1[j] * doi[y];
                    dv2j[y] += r2[j] * doi[y];
                }
                dAqk[ri * BT + j] = s1;
                dAqb[ri * BT + j] = s2;
            }
        }
    }
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_dplr_output"

enum { NIN = 6 }; /* qg, h, Aqk, Aqb, v, v2 */

static dg_status output_backward_body(dg_ctx *ctx, dg_node *n) {
    const dplr_np *np = (const dplr_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *gO = dg__node_grad_out(n, 0);
    if (!gO)
        return DG_OK;
    /* qg, h, v2 from the recompute group; saved: Aqk, Aqb, v (the leaf) */
    static const int slots[3] = {DPLR_QG, DPLR_H, DPLR_V2};
    const int bf16 = dplr_bf16(c, n->saved[2]);
    const dg_dtype lt = dplr_leaf_dt(c, bf16);
    dg_tensor *rt[3], *tmp[7] = {0}, *gr[NIN] = {0};
    const void *p[7] = {0};
    dg_status st = DG_OK;
    for (int i = 0; i < 3 && st == DG_OK; i++)
        st = dg__group_get(np->grp, ctx, DPLR_M_OUTPUT, slots[i], &rt[i]);
    for (int i = 0; i < 3 && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, rt[i], c->dt, &tmp[i], &p[i]);
    for (int i = 0; i < 3 && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, n->saved[i], i == 2 ? lt : c->dt, &tmp[3 + i], &p[3 + i]);
    if (st == DG_OK) /* o's gradient, in o's dtype (v's) */
        st = dg__kda_ptr(ctx, gO, lt, &tmp[6], &p[6]);
    /* inputs in node order: qg, h, Aqk, Aqb, v, v2; gradients in the compute dtype */
    dg_tensor *like[NIN] = {rt[0], rt[1], n->saved[0], n->saved[1], n->saved[2], rt[2]};
    for (int i = 0; i < NIN && st == DG_OK; i++)
        st = kda_new_as(ctx, c, like[i], &gr[i]);
    if (st == DG_OK)
        st = dplr_run_output_bwd(ctx, c, bf16, p[0], p[1], p[3], p[4], p[5], p[2], p[6],
                                 dg_tensor_data(gr[0]), dg_tensor_data(gr[1]),
                                 dg_tensor_data(gr[2]), dg_tensor_data(gr[3]),
                                 dg_tensor_data(gr[4]), dg_tensor_data(gr[5]));
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, gr[i]);
    for (int i = 0; i < 7; i++)
        dg_tensor_free(&tmp[i]);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&gr[i]);
    return st;
}

static dg_status output_backward(dg_ctx *ctx, dg_node *n) {
    dg_status st = output_backward_body(ctx, n);
    dg__group_done(((const dplr_np *)n->params)->grp, DPLR_M_OUTPUT);
    return st;
}

dg_status dg__dplr_output_x(dg_ctx *ctx, dg_tensor *qg, dg_tensor *h, dg_tensor *Aqk,
                            dg_tensor *Aqb, dg_tensor *v, dg_tensor *v2, const dg_dplr_opts *opts,
                            dg__group *grp, dg_tensor **o) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "o", o));
    *o = NULL;
    DG_TRY(dg__kda_check_first(OP, "qg", qg, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(OP, "v", v, ctx, 4, "B,T,H,V"));
    const int64_t B = qg->shape[0], T = qg->shape[1], H = qg->shape[2], K = qg->shape[3];
    const int64_t V = v->shape[3];
    kda_cfg cfg;
    DG_TRY(dg__dplr_cfg_init(OP, ctx, opts, B, T, (int)H, (int)K, (int)V, qg->dtype, &cfg));
    const int64_t NC = kda_cfg_nc(&cfg);
    const int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, sa[4] = {B, T, H, cfg.d.BT};
    const int64_t sh[5] = {B, NC / B, H, K, V};
    dg_tensor *in[NIN] = {qg, h, Aqk, Aqb, v, v2}, *tmp[NIN] = {0};
    const int bf16 = dplr_bf16(&cfg, v);
    const dg_dtype lt = dplr_leaf_dt(&cfg, bf16);
    const void *p[NIN] = {0};
    dg__group *own = NULL;
    /* v is the leaf (f32 or bf16 on CUDA); the rest have the compute dtype */
    dg_status st = dg__kda_check(OP, "qg", qg, ctx, cfg.m_f, 4, sk, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "h", h, ctx, cfg.m_f, 5, sh, "B,NT,H,K,V");
    if (st == DG_OK)
        st = dg__kda_check(OP, "Aqk", Aqk, ctx, cfg.m_f, 4, sa, "B,T,H,BT");
    if (st == DG_OK)
        st = dg__kda_check(OP, "Aqb", Aqb, ctx, cfg.m_f, 4, sa, "B,T,H,BT");
    if (st == DG_OK)
        st = dg__kda_check(OP, "v", v, ctx, dplr_leaf_mask(&cfg, v), 4, sv, "B,T,H,V");
    if (st == DG_OK)
        st = dg__kda_check(OP, "v2", v2, ctx, cfg.m_f, 4, sv, "B,T,H,V");
    if (st == DG_OK)
        st = dg__dplr_cfg_dev(OP, ctx, &cfg, grp ? dg__dplr_group_dev(grp) : NULL);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, in[i], i == 4 ? lt : cfg.dt, &tmp[i], &p[i]);
    if (st == DG_OK) /* o in v's dtype */
        st = dg_tensor_new(ctx, lt, 4, sv, o);
    if (st == DG_OK)
        st = dplr_run_output_fwd(ctx, &cfg, bf16, p[0], p[1], p[2], p[3], p[4], p[5],
                                 dg_tensor_data(*o));
    if (st == DG_OK && dg__needs_grad(NIN, in)) {
        dg_node *n = NULL;
        st = dg__node_new("dplr_output", DG_POLICY_RECOMPUTE, output_backward, ctx, &n);
        if (st == DG_OK && !grp) { /* used alone: qg, h, v2 are this node's own inputs */
            st = dg__dplr_group_new(&cfg, &own);
            if (st == DG_OK) {
                dg__group_keep(own, DPLR_QG, qg);
                dg__group_keep(own, DPLR_H, h);
                dg__group_keep(own, DPLR_V2, v2);
                grp = own;
            }
        }
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        if (st == DG_OK)
            st = dg__node_output(n, *o);
        if (st == DG_OK)
            dg__node_save(n, Aqk);
        if (st == DG_OK)
            dg__node_save(n, Aqb);
        if (st == DG_OK)
            dg__node_save(n, v);
        if (st == DG_OK)
            dg__group_join(grp, DPLR_M_OUTPUT, n);
        dplr_np *np = st == DG_OK ? dg__dplr_np_new(n, &cfg, grp) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    dg__group_release(&own);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&tmp[i]);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK)
        dg_tensor_free(o);
    return st;
}

dg_status dg_dplr_output(dg_ctx *ctx, dg_tensor *qg, dg_tensor *h, dg_tensor *Aqk, dg_tensor *Aqb,
                         dg_tensor *v, dg_tensor *v2, const dg_dplr_opts *opts, dg_tensor **o) {
    return dg__dplr_output_x(ctx, qg, h, Aqk, Aqb, v, v2, opts, NULL, o);
}
#endif

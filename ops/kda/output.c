/*
 * ops/kda/output.c -- N7: the output (kda.md §11.4(e); backward §11.6 B1 and §2 N7).
 *
 *   O_c = s QG_c h_c + Aqk_c E_c          (inter-chunk through the state + causal intra-chunk)
 * Backward: dQG = s dO h^T, dh_c = s QG^T dO, dAqk = tril(dO E^T) (j <= i), dE = Aqk^T dO.
 * Aqk is read only for j <= i, so its other entries get a zero gradient. The node reads QG, h and
 * E through the recompute group (kda_group.c has the table): inside dg_kda_chunk they are rebuilt
 * in backward under the default policies; used alone, the node keeps its inputs.
 * Shapes: QG [B,T,HV,K]; h [B,NT,HV,K,V]; Aqk [B,T,HV,BT]; E, O [B,T,HV,V].
 * CUDA: QG, h, E f32 or bf16 (read in the intermediates' storage dtype, kda_cfg.mid), Aqk f32;
 * dh stored like h; O written as bf16 when that is the dtype asked for, else computed in f32
 * and converted.
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/output.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

void RF(dg__kda_output_fwd)(const kda_dims *d, RT scale, const RT *QG, const RT *h, const RT *Aqk,
                            const RT *E, RT *O) {
    const int HV = d->HV, K = d->K, V = d->V, BT = d->BT;
    const int64_t KV = (int64_t)K * V, NC = d->chunk_off[d->N];
    /* work item: one (chunk, value head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * HV > 1))
    for (int64_t w = 0; w < NC * HV; w++) {
        kda_chunk ch = kda_chunk_idx(d, w / HV);
        const int hv = (int)(w % HV);
        const RT *hc = h + (ch.idx * HV + hv) * KV;
        for (int i = 0; i < ch.L; i++) {
            const int64_t ti = ch.t0 + i;
            const RT *qgi = QG + (ti * HV + hv) * K, *arow = Aqk + (ti * HV + hv) * BT;
            RT *oi = O + (ti * HV + hv) * V;
            for (int b = 0; b < V; b++) {
                RT s = 0;
                for (int a = 0; a < K; a++)
                    s += qgi[a] * hc[a * V + b];
                oi[b] = scale * s;
            }
            for (int j = 0; j <= i; j++) {
                const RT *ej = E + ((ch.t0 + j) * HV + hv) * V;
                for (int b = 0; b < V; b++)
                    oi[b] += arow[j] * ej[b];
            }
        }
    }
}

void RF(dg__kda_output_bwd)(const kda_dims *d, RT scale, const RT *QG, const RT *h, const RT *Aqk,
                            const RT *E, const RT *dO, RT *dQG, RT *dh, RT *dAqk, RT *dE) {
    const int HV = d->HV, K = d->K, V = d->V, BT = d->BT;
    const int64_t KV = (int64_t)K * V, NC = d->chunk_off[d->N];
    /* work item: one (chunk, value head); it writes only its own rows */
    KDA_OMP(parallel for schedule(dynamic, 1) if (NC * HV > 1))
    for (int64_t w = 0; w < NC * HV; w++) {
        kda_chunk ch = kda_chunk_idx(d, w / HV);
        const int hv = (int)(w % HV);
        const RT *hc = h + (ch.idx * HV + hv) * KV;
        RT *dhc = dh + (ch.idx * HV + hv) * KV;
        memset(dhc, 0, sizeof(RT) * (size_t)KV);
        for (int i = 0; i < ch.L; i++) {
            const int64_t ti = ch.t0 + i;
            const RT *qgi = QG + (ti * HV + hv) * K, *doi = dO + (ti * HV + hv) * V;
            RT *dqgi = dQG + (ti * HV + hv) * K, *darow = dAqk + (ti * HV + hv) * BT;
            RT *dei = dE + (ti * HV + hv) * V;
            for (int a = 0; a < K; a++) {
                RT s = 0;
                for (int b = 0; b < V; b++) {
                    s += doi[b] * hc[a * V + b];
                    dhc[a * V + b] += scale * qgi[a] * doi[b];
                }
                dqgi[a] = scale * s;
            }
            memset(darow, 0, sizeof(RT) * (size_t)BT);
            for (int j = 0; j <= i; j++) {
                const RT *ej = E + ((ch.t0 + j) * HV + hv) * V;
                RT s = 0;
                for (int b = 0; b < V; b++)
                    s += doi[b] * ej[b];
                darow[j] = s;
            }
            /* dE_i = sum_{r >= i} Aqk[r, i] dO_r */
            memset(dei, 0, sizeof(RT) * (size_t)V);
            for (int r = i; r < ch.L; r++) {
                const int64_t tr = ch.t0 + r;
                const RT a = Aqk[(tr * HV + hv) * BT + i], *dor = dO + (tr * HV + hv) * V;
                for (int b = 0; b < V; b++)
                    dei[b] += a * dor[b];
            }
        }
    }
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_output"

/* The node's inputs; QG, h, E reach backward through the recompute group, n->saved holds Aqk. */
enum { IN_QG, IN_H, IN_AQK, IN_E };
enum { SAVED_AQK };

static dg_status output_backward_body(dg_ctx *ctx, dg_node *n) {
    const kda_np *np = (const kda_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *gO = dg__node_grad_out(n, 0);
    if (!gO)
        return DG_OK;
    dg_tensor *QG = NULL, *h = NULL, *E = NULL; /* from the recompute group */
    dg_tensor *Aqk = n->saved[SAVED_AQK];
    /* converted copies (NULL where the tensor already has the compute dtype), the gradients */
    dg_tensor *tQG = NULL, *th = NULL, *tE = NULL, *tAqk = NULL, *tgO = NULL;
    dg_tensor *dQG = NULL, *dh = NULL, *dAqk = NULL, *dE = NULL;
    kda_output_bwd_io io = {0};
    dg_status st = dg__group_get(np->grp, ctx, KDA_M_OUTPUT, KDA_QG, &QG);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, KDA_M_OUTPUT, KDA_H, &h);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, KDA_M_OUTPUT, KDA_E, &E);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, QG, c->mid, &tQG, &io.QG);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, h, c->mid, &th, &io.h);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, E, c->mid, &tE, &io.E);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, Aqk, c->dt, &tAqk, &io.Aqk);
    if (st == DG_OK) /* o may be bf16 (the composite's output dtype): read as stored on CUDA */
        st = dg__kda_in_ptr(ctx, gO, c->dt, &tgO, &io.dO, &io.leaf_bf16);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, QG, &dQG);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, c, h->ndim, h->shape, &dh); /* stored like h */
    if (st == DG_OK)
        st = kda_new_as(ctx, c, Aqk, &dAqk);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, E, &dE);
    if (st == DG_OK) {
        io.dQG = dg_tensor_data(dQG);
        io.dh = dg_tensor_data(dh);
        io.dAqk = dg_tensor_data(dAqk);
        io.dE = dg_tensor_data(dE);
        st = kda_run_output_bwd(ctx, c, &io);
    }
    dg_tensor *grads[4] = {dQG, dh, dAqk, dE}; /* IN_QG .. IN_E */
    for (int i = 0; i < 4 && st == DG_OK; i++)
        if (dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, grads[i]);
    dg_tensor *owned[9] = {tQG, th, tE, tAqk, tgO, dQG, dh, dAqk, dE};
    for (int i = 0; i < 9; i++)
        dg_tensor_free(&owned[i]);
    return st;
}

static dg_status output_backward(dg_ctx *ctx, dg_node *n) {
    dg_status st = output_backward_body(ctx, n);
    dg__group_done(((const kda_np *)n->params)->grp, KDA_M_OUTPUT);
    return st;
}

dg_status dg__kda_output_x(dg_ctx *ctx, dg_tensor *QG, dg_tensor *h, dg_tensor *Aqk, dg_tensor *E,
                           const dg_kda_opts *opts, dg__group *grp, dg_dtype out_dt,
                           dg_tensor **o) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "o", o));
    *o = NULL;
    DG_TRY(dg__kda_check_first(OP, "QG", QG, ctx, 4, "B,T,HV,K"));
    DG_TRY(dg__kda_check_first(OP, "E", E, ctx, 4, "B,T,HV,V"));
    const int64_t B = QG->shape[0], T = QG->shape[1], HV = QG->shape[2], K = QG->shape[3];
    const int64_t V = E->shape[3];
    kda_cfg cfg;
    DG_TRY(
        dg__kda_cfg_init(OP, ctx, opts, B, T, (int)HV, (int)HV, (int)K, (int)V, QG->dtype, &cfg));
    const int64_t NC = kda_cfg_nc(&cfg);
    int64_t sk[4] = {B, T, HV, K}, sv[4] = {B, T, HV, V}, sa[4] = {B, T, HV, cfg.d.BT};
    int64_t sh[5] = {B, NC / B, HV, K, V};
    dg_tensor *in[4] = {QG, h, Aqk, E}, *oc = NULL; /* in: IN_QG .. IN_E */
    /* converted copies (NULL where the tensor already has the compute dtype) */
    dg_tensor *tQG = NULL, *th = NULL, *tAqk = NULL, *tE = NULL;
    kda_output_fwd_io io = {0};
    dg__group *own = NULL;
    dg_status st = dg__kda_check(OP, "QG", QG, ctx, cfg.m_in, 4, sk, "B,T,HV,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "E", E, ctx, cfg.m_in, 4, sv, "B,T,HV,V");
    if (st == DG_OK)
        st = dg__kda_check(OP, "h", h, ctx, cfg.m_in, 5, sh, "B,NT,HV,K,V");
    if (st == DG_OK)
        st = dg__kda_check(OP, "Aqk", Aqk, ctx, cfg.m_f, 4, sa, "B,T,HV,BT");
    if (st == DG_OK)
        st = dg__kda_cfg_dev(OP, ctx, &cfg, grp ? dg__kda_group_dev(grp) : NULL);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, QG, cfg.mid, &tQG, &io.QG);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, h, cfg.mid, &th, &io.h);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, Aqk, cfg.dt, &tAqk, &io.Aqk);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, E, cfg.mid, &tE, &io.E);
    /* o in the compute dtype (oc, then converted), or written as bf16 by the kernels on CUDA */
    const dg_dtype odt = out_dt == DG_NDTYPES ? cfg.dt : out_dt;
    io.leaf_bf16 = cfg.cuda && odt == DG_BF16;
    if (st == DG_OK)
        st = io.leaf_bf16 ? dg_tensor_new(ctx, DG_BF16, 4, sv, &oc)
                          : dg__kda_new(ctx, &cfg, 4, sv, &oc);
    if (st == DG_OK) {
        io.O = dg_tensor_data(oc);
        st = kda_run_output_fwd(ctx, &cfg, &io);
    }
    if (st == DG_OK)
        st = dg__kda_as_dtype(ctx, oc, odt, o);
    if (st == DG_OK && dg__needs_grad(4, in)) {
        dg_node *n = NULL;
        st = dg__node_new("kda_output", DG_POLICY_RECOMPUTE, output_backward, ctx, &n);
        if (st == DG_OK && !grp) { /* used alone: QG, h, E are this node's own inputs */
            st = dg__kda_group_new(&cfg, &own);
            if (st == DG_OK) {
                dg__group_keep(own, KDA_QG, QG);
                dg__group_keep(own, KDA_H, h);
                dg__group_keep(own, KDA_E, E);
                grp = own;
            }
        }
        for (int i = 0; i < 4 && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        if (st == DG_OK)
            st = dg__node_output(n, *o);
        if (st == DG_OK)
            dg__node_save(n, Aqk); /* SAVED_AQK */
        if (st == DG_OK)
            dg__group_join(grp, KDA_M_OUTPUT, n);
        kda_np *np = st == DG_OK ? dg__kda_np_new(n, &cfg, grp) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    dg__group_release(&own);
    dg_tensor *owned[4] = {tQG, th, tAqk, tE};
    for (int i = 0; i < 4; i++)
        dg_tensor_free(&owned[i]);
    dg_tensor_free(&oc);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK)
        dg_tensor_free(o);
    return st;
}

dg_status dg_kda_output(dg_ctx *ctx, dg_tensor *QG, dg_tensor *h, dg_tensor *Aqk, dg_tensor *E,
                        const dg_kda_opts *opts, dg_tensor **o) {
    return dg__kda_output_x(ctx, QG, h, Aqk, E, opts, NULL, DG_NDTYPES, o);
}
#endif

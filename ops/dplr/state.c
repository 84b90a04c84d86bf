/*
 * ops/dplr/state.c -- dg_dplr_state: the inter-chunk state pass (dplr.md D3; backward D4 steps 2-4)
 * as one tape node.
 *
 * Sequential over the chunks of each sequence (the serial part of the algorithm), per head:
 *   h_0 = h0 (or 0);  for c: store h_c;  v2_c = w_c h_c + u_c          ("v_new", plus sign)
 *                            h_{c+1} = Diag(exp(lam_c)) h_c + kg_c^T v_c + bg_c^T v2_c
 *   ht = h_NT;  lam_c = Gi at the chunk's last row.
 * Backward, c = NT-1 .. 0, with dH = dL/dh_{c+1} (starts at dht):
 *   dv2_c = dv2_c^out + bg_c dH     dkg_c = v_c dH^T     dbg_c = v2_c dH^T     dv_c = kg_c dH
 *   du_c = dv2_c     dw_c = dv2_c h_c^T     dlam_c = exp(lam_c) . rowsum(h_c . dH)
 *   dH <- Diag(exp(lam_c)) dH + w_c^T dv2_c + dh_c^out;     dh0 = dH at the end
 * Policy "dplr_state" (default RECOMPUTE): under CACHE the node keeps h and v2; under RECOMPUTE it
 * keeps what rebuilds them (w, u, kg, bg, v, Gi, h0, or inside dg_dplr_chunk the composite's
 * inputs) and reruns this pass in backward (dplr.md D4: FLA recomputes unless disable_recompute).
 * Shapes: w, kg, bg, Gi [B,T,H,K]; u, v, v2 [B,T,H,V]; h [B,NT,H,K,V] (varlen: [1,NC,H,K,V]);
 * h0, ht [N,H,K,V]. CPU: f64, or f32 computed in f32. CUDA (kernels/dplr/state.cu): v f32 or bf16
 * (read as stored), everything else f32.
 */
#ifndef DG_REF_TMPL
#include "dplr.h"
#define DG_REF_TMPL "dplr/state.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

dg_status RF(dg__dplr_state_fwd)(const kda_dims *d, const RT *w, const RT *u, const RT *kg,
                                 const RT *bg, const RT *v, const RT *Gi, const RT *h0, RT *h,
                                 RT *v2, RT *ht) {
    const int H = d->H, K = d->K, V = d->V;
    const int64_t KV = (int64_t)K * V;
    /* running state [K,V] per thread */
    RT *Ss = (RT *)DG_MALLOC(sizeof(RT) * (size_t)KV * (size_t)kda_max_threads());
    if (!Ss)
        return dg__err(DG_ERR_NOMEM, "dplr_state_fwd: no memory");
    /* work item: one (sequence, head), sequential over its chunks */
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * H > 1))
    for (int it = 0; it < d->N * H; it++) {
        const int n = it / H, hh = it % H;
        RT *S = Ss + (size_t)KV * (size_t)kda_thread_id();
        if (h0)
            memcpy(S, h0 + ((int64_t)n * H + hh) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(S, 0, sizeof(RT) * (size_t)KV);
        for (int64_t c = 0; c < kda_nchunks(d, n); c++) {
            const kda_chunk ch = kda_chunk_at(d, n, c);
            memcpy(h + (ch.idx * H + hh) * KV, S, sizeof(RT) * (size_t)KV);
            for (int i = 0; i < ch.L; i++) { /* v2_i = u_i + S^T w_i */
                const int64_t ri = (ch.t0 + i) * H + hh;
                const RT *wi = w + ri * K;
                RT *vi2 = v2 + ri * V;
                memcpy(vi2, u + ri * V, sizeof(RT) * (size_t)V);
                for (int x = 0; x < K; x++)
                    for (int y = 0; y < V; y++)
                        vi2[y] += wi[x] * S[x * V + y];
            }
            const RT *lam = Gi + ((ch.t0 + ch.L - 1) * H + hh) * K;
            for (int x = 0; x < K; x++) {
                const RT dec = REXP(lam[x]);
                for (int y = 0; y < V; y++)
                    S[x * V + y] *= dec;
            }
            for (int i = 0; i < ch.L; i++) {
                const int64_t ri = (ch.t0 + i) * H + hh;
                const RT *kgi = kg + ri * K, *bgi = bg + ri * K, *vi = v + ri * V;
                const RT *vi2 = v2 + ri * V;
                for (int x = 0; x < K; x++)
                    for (int y = 0; y < V; y++)
                        S[x * V + y] += kgi[x] * vi[y] + bgi[x] * vi2[y];
            }
        }
        if (ht)
            memcpy(ht + ((int64_t)n * H + hh) * KV, S, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(Ss);
    return DG_OK;
}

dg_status RF(dg__dplr_state_bwd)(const kda_dims *d, const RT *w, const RT *kg, const RT *bg,
                                 const RT *v, const RT *Gi, const RT *h, const RT *v2, const RT *dh,
                                 const RT *dv2, const RT *dht, RT *dw, RT *du, RT *dkg, RT *dbg,
                                 RT *dv, RT *dGi, RT *dh0) {
    const int H = d->H, K = d->K, V = d->V, BT = d->BT;
    const int64_t KV = (int64_t)K * V, rows = d->B * d->T * H;
    /* rows of empty sequences are never visited: clear every output first */
    memset(dw, 0, sizeof(RT) * (size_t)(rows * K));
    memset(dkg, 0, sizeof(RT) * (size_t)(rows * K));
    memset(dbg, 0, sizeof(RT) * (size_t)(rows * K));
    memset(dGi, 0, sizeof(RT) * (size_t)(rows * K));
    memset(du, 0, sizeof(RT) * (size_t)(rows * V));
    memset(dv, 0, sizeof(RT) * (size_t)(rows * V));
    /* per thread: dH [K,V] running gradient of the state; dvc [BT,V] total dv2 of one chunk */
    const size_t per = (size_t)(KV + (int64_t)BT * V);
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "dplr_state_bwd: no memory");
    /* work item: one (sequence, head), sequential over its chunks in reverse */
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * H > 1))
    for (int it = 0; it < d->N * H; it++) {
        const int n = it / H, hh = it % H;
        RT *dH = scr + per * (size_t)kda_thread_id(), *dvc = dH + KV;
        if (dht)
            memcpy(dH, dht + ((int64_t)n * H + hh) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(dH, 0, sizeof(RT) * (size_t)KV);
        for (int64_t c = kda_nchunks(d, n) - 1; c >= 0; c--) {
            const kda_chunk ch = kda_chunk_at(d, n, c);
            const RT *hc = h + (ch.idx * H + hh) * KV;
            const int64_t rl = (ch.t0 + ch.L - 1) * H + hh;
            const RT *lam = Gi + rl * K;
            for (int i = 0; i < ch.L; i++) {
                const int64_t ri = (ch.t0 + i) * H + hh;
                const RT *kgi = kg + ri * K, *bgi = bg + ri * K;
                const RT *vi = v + ri * V, *vi2 = v2 + ri * V;
                RT *de = dvc + i * V, *dvi = dv + ri * V;
                for (int y = 0; y < V; y++)
                    de[y] = dv2 ? dv2[ri * V + y] : (RT)0;
                for (int x = 0; x < K; x++) {
                    RT sk = 0, sb = 0;
                    for (int y = 0; y < V; y++) {
                        const RT g = dH[x * V + y];
                        de[y] += bgi[x] * g;
                        dvi[y] += kgi[x] * g;
                        sk += vi[y] * g;
                        sb += vi2[y] * g;
                    }
                    dkg[ri * K + x] = sk;
                    dbg[ri * K + x] = sb;
                }
                memcpy(du + ri * V, de, sizeof(RT) * (size_t)V);
                for (int x = 0; x < K; x++) {
                    RT s = 0;
                    for (int y = 0; y < V; y++)
                        s += de[y] * hc[x * V + y];
                    dw[ri * K + x] = s;
                }
            }
            for (int x = 0; x < K; x++) {
                const RT dec = REXP(lam[x]);
                RT s = 0;
                for (int y = 0; y < V; y++)
                    s += hc[x * V + y] * dH[x * V + y];
                dGi[rl * K + x] = dec * s;
                for (int y = 0; y < V; y++)
                    dH[x * V + y] *= dec;
            }
            for (int i = 0; i < ch.L; i++) {
                const RT *wi = w + ((ch.t0 + i) * H + hh) * K, *de = dvc + i * V;
                for (int x = 0; x < K; x++)
                    for (int y = 0; y < V; y++)
                        dH[x * V + y] += wi[x] * de[y];
            }
            if (dh) {
                const RT *dhc = dh + (ch.idx * H + hh) * KV;
                for (int64_t e = 0; e < KV; e++)
                    dH[e] += dhc[e];
            }
        }
        if (dh0)
            memcpy(dh0 + ((int64_t)n * H + hh) * KV, dH, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_dplr_state"
#define HAS_HT 1

enum { NIN = 7 }; /* w, u, kg, bg, v, Gi, h0 */

static dg_status state_backward_body(dg_ctx *ctx, dg_node *n) {
    const dplr_np *np = (const dplr_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *go[3] = {dg__node_grad_out(n, 0), dg__node_grad_out(n, 1),
                              (np->flags & HAS_HT) ? dg__node_grad_out(n, 2) : NULL};
    if (!go[0] && !go[1] && !go[2])
        return DG_OK;
    /* from the recompute group: w, kg, bg, h, v2; saved: v (the leaf), Gi (then h0) */
    static const int slots[5] = {DPLR_W, DPLR_KG, DPLR_BG, DPLR_H, DPLR_V2};
    const int bf16 = dplr_bf16(c, n->saved[0]);
    dg_tensor *rt[5], *tmp[10] = {0}, *gr[NIN] = {0};
    const void *p[10] = {0};
    dg_status st = DG_OK;
    for (int i = 0; i < 5 && st == DG_OK; i++)
        st = dg__group_get(np->grp, ctx, DPLR_M_STATE, slots[i], &rt[i]);
    for (int i = 0; i < 5 && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, rt[i], c->dt, &tmp[i], &p[i]);
    for (int i = 0; i < 2 && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, n->saved[i], i == 0 ? dplr_leaf_dt(c, bf16) : c->dt, &tmp[5 + i],
                         &p[5 + i]);
    for (int i = 0; i < 3 && st == DG_OK; i++)
        if (go[i])
            st = dg__kda_ptr(ctx, go[i], c->dt, &tmp[7 + i], &p[7 + i]);
    const int64_t sk[4] = {c->d.B, c->d.T, c->d.H, c->d.K},
                  sv[4] = {c->d.B, c->d.T, c->d.H, c->d.V};
    const int64_t s0[4] = {c->d.N, c->d.H, c->d.K, c->d.V};
    /* gradients of w, u, kg, bg, v, Gi (h0 below), shaped like them, in the compute dtype */
    for (int i = 0; i < 6 && st == DG_OK; i++)
        st = dg__kda_new(ctx, c, 4, i == 1 || i == 4 ? sv : sk, &gr[i]);
    if (st == DG_OK && n->saved[2] && dg__node_wants_grad(n, 6))
        st = dg__kda_new(ctx, c, 4, s0, &gr[6]);
    if (st == DG_OK)
        st = dplr_run_state_bwd(ctx, c, bf16, p[0], p[1], p[2], p[5], p[6], p[3], p[4], p[7], p[8],
                                p[9], dg_tensor_data(gr[0]), dg_tensor_data(gr[1]),
                                dg_tensor_data(gr[2]), dg_tensor_data(gr[3]), dg_tensor_data(gr[4]),
                                dg_tensor_data(gr[5]), gr[6] ? dg_tensor_data(gr[6]) : NULL);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (gr[i] && dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, gr[i]);
    for (int i = 0; i < 10; i++)
        dg_tensor_free(&tmp[i]);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&gr[i]);
    return st;
}

static dg_status state_backward(dg_ctx *ctx, dg_node *n) {
    dg_status st = state_backward_body(ctx, n);
    dg__group_done(((const dplr_np *)n->params)->grp, DPLR_M_STATE);
    return st;
}

dg_status dg__dplr_state_x(dg_ctx *ctx, dg_tensor *w, dg_tensor *u, dg_tensor *kg, dg_tensor *bg,
                           dg_tensor *v, dg_tensor *Gi, dg_tensor *h0, const dg_dplr_opts *opts,
                           dg__group *grp, dg_tensor **h, dg_tensor **v2, dg_tensor **ht) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "h", h));
    DG_TRY(dg__check_ptr(OP, "v2", v2));
    *h = *v2 = NULL;
    if (ht)
        *ht = NULL;
    DG_TRY(dg__kda_check_first(OP, "w", w, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(OP, "u", u, ctx, 4, "B,T,H,V"));
    DG_TRY(dg__kda_check_first(OP, "v", v, ctx, 4, "B,T,H,V")); /* the leaf's dtype rule */
    const int64_t B = w->shape[0], T = w->shape[1], H = w->shape[2], K = w->shape[3];
    const int64_t V = u->shape[3];
    kda_cfg cfg;
    DG_TRY(dg__dplr_cfg_init(OP, ctx, opts, B, T, (int)H, (int)K, (int)V, w->dtype, &cfg));
    const int64_t NC = kda_cfg_nc(&cfg);
    const int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, s0[4] = {cfg.d.N, H, K, V};
    const int64_t sh[5] = {B, NC / B, H, K, V};
    dg_tensor *in[NIN] = {w, u, kg, bg, v, Gi, h0}, *tmp[NIN] = {0};
    static const char *inames[NIN] = {"w", "u", "kg", "bg", "v", "Gi", "h0"};
    const int bf16 = dplr_bf16(&cfg, v);
    const void *p[NIN] = {0};
    dg__group *own = NULL;
    dg_status st = DG_OK;
    /* v is the leaf (f32 or bf16 on CUDA); the rest have the compute dtype */
    for (int i = 0; i < NIN - 1 && st == DG_OK; i++) {
        const int isv = i == 1 || i == 4;
        st = dg__kda_check(OP, inames[i], in[i], ctx, i == 4 ? dplr_leaf_mask(&cfg, v) : cfg.m_f, 4,
                           isv ? sv : sk, isv ? "B,T,H,V" : "B,T,H,K");
    }
    if (st == DG_OK && h0)
        st = dg__kda_check(OP, "h0", h0, ctx, cfg.m_f, 4, s0, "N,H,K,V");
    if (st == DG_OK)
        st = dg__dplr_cfg_dev(OP, ctx, &cfg, grp ? dg__dplr_group_dev(grp) : NULL);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (in[i])
            st =
                dg__kda_ptr(ctx, in[i], i == 4 ? dplr_leaf_dt(&cfg, bf16) : cfg.dt, &tmp[i], &p[i]);
    if (st == DG_OK)
        st = dg__kda_new(ctx, &cfg, 5, sh, h);
    if (st == DG_OK)
        st = dg__kda_new(ctx, &cfg, 4, sv, v2);
    if (st == DG_OK && ht)
        st = dg__kda_new(ctx, &cfg, 4, s0, ht);
    if (st == DG_OK)
        st = dplr_run_state_fwd(ctx, &cfg, bf16, p[0], p[1], p[2], p[3], p[4], p[5], p[6],
                                dg_tensor_data(*h), dg_tensor_data(*v2),
                                ht ? dg_tensor_data(*ht) : NULL);
    if (st == DG_OK && dg__needs_grad(NIN, in)) {
        dg_node *n = NULL;
        st = dg__node_new("dplr_state", DG_POLICY_RECOMPUTE, state_backward, ctx, &n);
        if (st == DG_OK && !grp) { /* used alone: w, u, kg, bg are this node's own inputs */
            st = dg__dplr_group_new(&cfg, &own);
            if (st == DG_OK) {
                dg__group_set_input(own, DPLR_IN_V, v);
                dg__group_set_input(own, DPLR_IN_GI, Gi);
                dg__group_set_input(own, DPLR_IN_H0, h0);
                dg__group_keep(own, DPLR_W, w);
                dg__group_keep(own, DPLR_U, u);
                dg__group_keep(own, DPLR_KG, kg);
                dg__group_keep(own, DPLR_BG, bg);
                grp = own;
            }
        }
        if (st == DG_OK) { /* kept under CACHE of "dplr_state" */
            dg__group_offer(grp, DPLR_H, *h);
            dg__group_offer(grp, DPLR_V2, *v2);
        }
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        if (st == DG_OK)
            st = dg__node_output(n, *h);
        if (st == DG_OK)
            st = dg__node_output(n, *v2);
        if (st == DG_OK && ht)
            st = dg__node_output(n, *ht);
        if (st == DG_OK)
            dg__node_save(n, v);
        if (st == DG_OK)
            dg__node_save(n, Gi);
        if (st == DG_OK)
            dg__node_save(n, h0);
        if (st == DG_OK)
            dg__group_join(grp, DPLR_M_STATE, n);
        dplr_np *np = st == DG_OK ? dg__dplr_np_new(n, &cfg, grp) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (np)
            np->flags = ht ? HAS_HT : 0;
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    dg__group_release(&own);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&tmp[i]);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK) {
        dg_tensor_free(h);
        dg_tensor_free(v2);
        if (ht)
            dg_tensor_free(ht);
    }
    return st;
}

dg_status dg_dplr_state(dg_ctx *ctx, dg_tensor *w, dg_tensor *u, dg_tensor *kg, dg_tensor *bg,
                        dg_tensor *v, dg_tensor *Gi, dg_tensor *h0, const dg_dplr_opts *opts,
                        dg_tensor **h, dg_tensor **v2, dg_tensor **ht) {
    return dg__dplr_state_x(ctx, w, u, kg, bg, v, Gi, h0, opts, NULL, h, v2, ht);
}
#endif

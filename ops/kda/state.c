/*
 * ops/kda/state.c -- N6: the inter-chunk state pass (kda.md §11.4(d); backward §11.6 B2, §2 N6).
 *
 * Sequential over the chunks of each sequence (the serial part of the algorithm):
 *   h_0 = h0 (or 0);  for c: store h_c;  E_c = U_c - W_c h_c;
 *                            h_{c+1} = Diag(exp(lambda_c)) h_c + KG_c^T E_c;   ht = h_NT
 * Backward, c = NT-1 .. 0, with dH = dL/dh_{c+1} (starts at dht):
 *   dE_c = dE_c^out + KG_c dH        dKG_c = E_c dH^T         dU_c = dE_c    dW_c = -dE_c h_c^T
 *   dlambda_c = exp(lambda_c) . rowsum(h_c . dH)              (into dG at the chunk's last row)
 *   dH <- Diag(exp(lambda_c)) dH - W_c^T dE_c + dh_c^out;     dh0 = dH at the end
 * Only E (the KDA path) is not gated here: the exp(lambda - G) factor lives in KG (kda.md §11.4(d)
 * note). Policy "kda_state" (default CACHE): under CACHE the node keeps h and E; under
 * RECOMPUTE they are rebuilt in backward by rerunning this pass (kda.md §3). W, KG, h, E reach
 * backward through the recompute group (kda_group.c has the table). Shapes: W, KG, G [B,T,HV,K]; U,
 * E [B,T,HV,V]; h [B,NT,HV,K,V]; h0, ht [N,HV,K,V]. CUDA: W, U, KG f32 or bf16 (read in the
 * intermediates' storage dtype, kda_cfg.mid: bf16 on the tensor-core path where the sizes allow);
 * h, E and h's gradient in that dtype, E's gradient f32; G, h0, ht f32.
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/state.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

dg_status RF(dg__kda_state_fwd)(const kda_dims *d, const RT *W, const RT *U, const RT *KG,
                                const RT *G, const RT *h0, RT *h, RT *E, RT *ht) {
    const int HV = d->HV, K = d->K, V = d->V;
    const int64_t KV = (int64_t)K * V;
    /* running state [K,V] per thread */
    RT *Ss = (RT *)DG_MALLOC(sizeof(RT) * (size_t)KV * (size_t)kda_max_threads());
    if (!Ss)
        return dg__err(DG_ERR_NOMEM, "kda_state_fwd: no memory");
    /* work item: one (sequence, value head), sequential over its chunks */
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * HV > 1))
    for (int w = 0; w < d->N * HV; w++) {
        const int n = w / HV, hv = w % HV;
        RT *S = Ss + (size_t)KV * (size_t)kda_thread_id();
        if (h0)
            memcpy(S, h0 + ((int64_t)n * HV + hv) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(S, 0, sizeof(RT) * (size_t)KV);
        for (int64_t c = 0; c < kda_nchunks(d, n); c++) {
            kda_chunk ch = kda_chunk_at(d, n, c);
            memcpy(h + (ch.idx * HV + hv) * KV, S, sizeof(RT) * (size_t)KV);
            for (int i = 0; i < ch.L; i++) {
                const int64_t ti = ch.t0 + i;
                const RT *wi = W + (ti * HV + hv) * K;
                RT *ei = E + (ti * HV + hv) * V;
                memcpy(ei, U + (ti * HV + hv) * V, sizeof(RT) * (size_t)V);
                for (int a = 0; a < K; a++)
                    for (int b = 0; b < V; b++)
                        ei[b] -= wi[a] * S[a * V + b];
            }
            const RT *lam = G + ((ch.t0 + ch.L - 1) * HV + hv) * K;
            for (int a = 0; a < K; a++) {
                const RT dec = REXP(lam[a]);
                for (int b = 0; b < V; b++)
                    S[a * V + b] *= dec;
            }
            for (int i = 0; i < ch.L; i++) {
                const int64_t ti = ch.t0 + i;
                const RT *kgi = KG + (ti * HV + hv) * K, *ei = E + (ti * HV + hv) * V;
                for (int a = 0; a < K; a++)
                    for (int b = 0; b < V; b++)
                        S[a * V + b] += kgi[a] * ei[b];
            }
        }
        if (ht)
            memcpy(ht + ((int64_t)n * HV + hv) * KV, S, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(Ss);
    return DG_OK;
}

dg_status RF(dg__kda_state_bwd)(const kda_dims *d, const RT *W, const RT *KG, const RT *G,
                                const RT *h, const RT *E, const RT *dh, const RT *dE, const RT *dht,
                                RT *dW, RT *dU, RT *dKG, RT *dG, RT *dh0) {
    const int HV = d->HV, K = d->K, V = d->V, BT = d->BT;
    const int64_t KV = (int64_t)K * V, TT = d->B * d->T;
    memset(dG, 0, sizeof(RT) * (size_t)(TT * HV * K));
    /* per thread: dH [K,V] running gradient of the state; dEc [L,V] total dE of one chunk */
    const size_t per = (size_t)(KV + (int64_t)BT * V);
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kda_state_bwd: no memory");
    /* work item: one (sequence, value head), sequential over its chunks in reverse */
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * HV > 1))
    for (int w = 0; w < d->N * HV; w++) {
        const int n = w / HV, hv = w % HV;
        RT *dH = scr + per * (size_t)kda_thread_id(), *dEc = dH + KV;
        if (dht)
            memcpy(dH, dht + ((int64_t)n * HV + hv) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(dH, 0, sizeof(RT) * (size_t)KV);
        for (int64_t c = kda_nchunks(d, n) - 1; c >= 0; c--) {
            kda_chunk ch = kda_chunk_at(d, n, c);
            const RT *hc = h + (ch.idx * HV + hv) * KV;
            const int64_t tl = ch.t0 + ch.L - 1;
            const RT *lam = G + (tl * HV + hv) * K;
            RT *dlam = dG + (tl * HV + hv) * K;
            for (int i = 0; i < ch.L; i++) {
                const int64_t ti = ch.t0 + i;
                const RT *kgi = KG + (ti * HV + hv) * K, *ei = E + (ti * HV + hv) * V;
                RT *de = dEc + i * V;
                for (int b = 0; b < V; b++)
                    de[b] = dE ? dE[(ti * HV + hv) * V + b] : (RT)0;
                for (int a = 0; a < K; a++) {
                    RT s = 0;
                    for (int b = 0; b < V; b++) {
                        de[b] += kgi[a] * dH[a * V + b];
                        s += ei[b] * dH[a * V + b];
                    }
                    dKG[(ti * HV + hv) * K + a] = s;
                }
                memcpy(dU + (ti * HV + hv) * V, de, sizeof(RT) * (size_t)V);
                for (int a = 0; a < K; a++) {
                    RT s = 0;
                    for (int b = 0; b < V; b++)
                        s += de[b] * hc[a * V + b];
                    dW[(ti * HV + hv) * K + a] = -s;
                }
            }
            for (int a = 0; a < K; a++) {
                const RT dec = REXP(lam[a]);
                RT s = 0;
                for (int b = 0; b < V; b++)
                    s += hc[a * V + b] * dH[a * V + b];
                dlam[a] += dec * s;
                for (int b = 0; b < V; b++)
                    dH[a * V + b] *= dec;
            }
            for (int i = 0; i < ch.L; i++) {
                const RT *wi = W + ((ch.t0 + i) * HV + hv) * K, *de = dEc + i * V;
                for (int a = 0; a < K; a++)
                    for (int b = 0; b < V; b++)
                        dH[a * V + b] -= wi[a] * de[b];
            }
            if (dh) {
                const RT *dhc = dh + (ch.idx * HV + hv) * KV;
                for (int64_t e = 0; e < KV; e++)
                    dH[e] += dhc[e];
            }
        }
        if (dh0)
            memcpy(dh0 + ((int64_t)n * HV + hv) * KV, dH, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_state"
#define HAS_HT 1

/* The node's inputs (h0 may be NULL); W, KG, h, E reach backward through the recompute group,
 * n->saved holds G, then h0. */
enum { IN_W, IN_U, IN_KG, IN_G, IN_H0 };
enum { SAVED_G, SAVED_H0 };

/* dW, dKG, dG: the gradients shaped [B,T,HV,K] (on failure the caller frees what was made). */
static dg_status new_key_grads(dg_ctx *ctx, const kda_cfg *c, dg_tensor **dW, dg_tensor **dKG,
                               dg_tensor **dG) {
    const int64_t sk[4] = {c->d.B, c->d.T, c->d.HV, c->d.K};
    DG_TRY(dg__kda_new(ctx, c, 4, sk, dW));
    DG_TRY(dg__kda_new(ctx, c, 4, sk, dKG));
    return dg__kda_new(ctx, c, 4, sk, dG);
}

static dg_status state_backward_body(dg_ctx *ctx, dg_node *n) {
    const kda_np *np = (const kda_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *gh = dg__node_grad_out(n, 0), *gE = dg__node_grad_out(n, 1);
    const dg_tensor *ght = (np->flags & HAS_HT) ? dg__node_grad_out(n, 2) : NULL;
    if (!gh && !gE && !ght)
        return DG_OK;
    dg_tensor *W = NULL, *KG = NULL, *h = NULL, *E = NULL; /* from the recompute group */
    /* converted copies (NULL where the tensor already has the compute dtype), the gradients */
    dg_tensor *tW = NULL, *tKG = NULL, *th = NULL, *tE = NULL, *tG = NULL, *tgh = NULL;
    dg_tensor *tgE = NULL, *tght = NULL;
    dg_tensor *dW = NULL, *dU = NULL, *dKG = NULL, *dG = NULL, *dh0 = NULL;
    kda_state_bwd_io io = {0};
    dg_status st = dg__group_get(np->grp, ctx, KDA_M_STATE, KDA_W, &W);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, KDA_M_STATE, KDA_KG, &KG);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, KDA_M_STATE, KDA_H, &h);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, KDA_M_STATE, KDA_E, &E);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, W, c->mid, &tW, &io.W);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, KG, c->mid, &tKG, &io.KG);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, h, c->mid, &th, &io.h);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, E, c->mid, &tE, &io.E);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, n->saved[SAVED_G], c->dt, &tG, &io.G);
    if (st == DG_OK && gh)
        st = dg__kda_ptr(ctx, gh, c->mid, &tgh, &io.dh);
    if (st == DG_OK && gE)
        st = dg__kda_ptr(ctx, gE, c->dt, &tgE, &io.dE);
    if (st == DG_OK && ght)
        st = dg__kda_ptr(ctx, ght, c->dt, &tght, &io.dht);
    /* gradients of the inputs, shaped like them */
    int64_t sv[4] = {c->d.B, c->d.T, c->d.HV, c->d.V}, s0[4] = {c->d.N, c->d.HV, c->d.K, c->d.V};
    if (st == DG_OK)
        st = dg__kda_new(ctx, c, 4, sv, &dU);
    if (st == DG_OK && n->saved[SAVED_H0] && dg__node_wants_grad(n, IN_H0))
        st = dg__kda_new(ctx, c, 4, s0, &dh0);
#ifdef DG_HAVE_CUDA
    if (st == DG_OK && c->cuda) {
        /* In two halves: the serial pass reads dh and dE (the largest arrays here) for the last
         * time, so they are released before dW, dKG and dG exist; dHn, the state gradient at
         * each chunk's start, carries the pass to the chunk-parallel half. */
        const int64_t NC = kda_cfg_nc(c);
        const int64_t sh[5] = {c->d.B, NC / c->d.B, c->d.HV, c->d.K, c->d.V};
        dg_tensor *dHs = NULL;
        st = dg__kda_new_mid(ctx, c, 5, sh, &dHs);
        if (st == DG_OK)
            st = dg__kda_state_bwd_seq_cuda(ctx, &c->cd, io.W, io.KG, io.G, io.dh, io.dE, io.dht,
                                            dg_tensor_data(dU), dg_tensor_data(dHs),
                                            dh0 ? dg_tensor_data(dh0) : NULL);
        dg_tensor_free(&tgh);
        dg_tensor_free(&tgE);
        dg_tensor_free(&tght);
        for (int i = 0; i < 3; i++) /* h, E, ht */
            dg__node_drop_grad_out(n, i);
        if (st == DG_OK)
            st = new_key_grads(ctx, c, &dW, &dKG, &dG);
        if (st == DG_OK)
            st = dg__kda_state_bwd_rows_cuda(ctx, &c->cd, io.G, io.h, io.E, dg_tensor_data(dHs),
                                             dg_tensor_data(dU), dg_tensor_data(dW),
                                             dg_tensor_data(dKG), dg_tensor_data(dG));
        dg_tensor_free(&dHs);
    } else
#endif
    {
        if (st == DG_OK)
            st = new_key_grads(ctx, c, &dW, &dKG, &dG);
        if (st == DG_OK) {
            io.dW = dg_tensor_data(dW);
            io.dU = dg_tensor_data(dU);
            io.dKG = dg_tensor_data(dKG);
            io.dG = dg_tensor_data(dG);
            io.dh0 = dh0 ? dg_tensor_data(dh0) : NULL;
            st = kda_run_state_bwd(ctx, c, &io);
        }
    }
    dg_tensor *grads[5] = {dW, dU, dKG, dG, dh0}; /* IN_W .. IN_H0 */
    for (int i = 0; i < 5 && st == DG_OK; i++)
        if (grads[i] && dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, grads[i]);
    dg_tensor *owned[13] = {tW, tKG, th, tE, tG, tgh, tgE, tght, dW, dU, dKG, dG, dh0};
    for (int i = 0; i < 13; i++)
        dg_tensor_free(&owned[i]);
    return st;
}

static dg_status state_backward(dg_ctx *ctx, dg_node *n) {
    dg_status st = state_backward_body(ctx, n);
    dg__group_done(((const kda_np *)n->params)->grp, KDA_M_STATE);
    return st;
}

dg_status dg__kda_state_x(dg_ctx *ctx, dg_tensor *W, dg_tensor *U, dg_tensor *KG, dg_tensor *G,
                          dg_tensor *h0, const dg_kda_opts *opts, dg__group *grp, dg_tensor **h,
                          dg_tensor **E, dg_tensor **ht) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "h", h));
    DG_TRY(dg__check_ptr(OP, "E", E));
    *h = *E = NULL;
    if (ht)
        *ht = NULL;
    DG_TRY(dg__kda_check_first(OP, "W", W, ctx, 4, "B,T,HV,K"));
    DG_TRY(dg__kda_check_first(OP, "U", U, ctx, 4, "B,T,HV,V"));
    const int64_t B = W->shape[0], T = W->shape[1], HV = W->shape[2], K = W->shape[3];
    const int64_t V = U->shape[3];
    kda_cfg cfg;
    DG_TRY(dg__kda_cfg_init(OP, ctx, opts, B, T, (int)HV, (int)HV, (int)K, (int)V, W->dtype, &cfg));
    const int64_t NC = kda_cfg_nc(&cfg);
    int64_t sk[4] = {B, T, HV, K}, sv[4] = {B, T, HV, V}, s0[4] = {cfg.d.N, HV, K, V};
    int64_t sh[5] = {B, NC / B, HV, K, V};
    dg_tensor *in[5] = {W, U, KG, G, h0}; /* IN_W .. IN_H0 */
    /* converted copies (NULL where the tensor already has the compute dtype) */
    dg_tensor *tW = NULL, *tU = NULL, *tKG = NULL, *tG = NULL, *th0 = NULL;
    kda_state_fwd_io io = {0};
    dg__group *own = NULL;
    dg_status st = dg__kda_check(OP, "W", W, ctx, cfg.m_in, 4, sk, "B,T,HV,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "U", U, ctx, cfg.m_in, 4, sv, "B,T,HV,V");
    if (st == DG_OK)
        st = dg__kda_check(OP, "KG", KG, ctx, cfg.m_in, 4, sk, "B,T,HV,K");
    if (st == DG_OK)
        st = dg__kda_check(OP, "G", G, ctx, cfg.m_f, 4, sk, "B,T,HV,K");
    if (st == DG_OK && h0)
        st = dg__kda_check(OP, "h0", h0, ctx, cfg.m_f, 4, s0, "N,HV,K,V");
    if (st == DG_OK)
        st = dg__kda_cfg_dev(OP, ctx, &cfg, grp ? dg__kda_group_dev(grp) : NULL);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, W, cfg.mid, &tW, &io.W);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, U, cfg.mid, &tU, &io.U);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, KG, cfg.mid, &tKG, &io.KG);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, G, cfg.dt, &tG, &io.G);
    if (st == DG_OK && h0)
        st = dg__kda_ptr(ctx, h0, cfg.dt, &th0, &io.h0);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, &cfg, 5, sh, h);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, &cfg, 4, sv, E);
    if (st == DG_OK && ht)
        st = dg__kda_new(ctx, &cfg, 4, s0, ht);
    if (st == DG_OK) {
        io.h = dg_tensor_data(*h);
        io.E = dg_tensor_data(*E);
        io.ht = ht ? dg_tensor_data(*ht) : NULL;
        st = kda_run_state_fwd(ctx, &cfg, &io);
    }
    if (st == DG_OK && dg__needs_grad(5, in)) {
        dg_node *n = NULL;
        st = dg__node_new("kda_state", DG_POLICY_CACHE, state_backward, ctx, &n);
        if (st == DG_OK && !grp) { /* used alone: W, U, KG are this node's own inputs */
            st = dg__kda_group_new(&cfg, &own);
            if (st == DG_OK) {
                dg__group_set_input(own, KDA_IN_G, G);
                dg__group_set_input(own, KDA_IN_H0, h0);
                dg__group_keep(own, KDA_W, W);
                dg__group_keep(own, KDA_U, U);
                dg__group_keep(own, KDA_KG, KG);
                grp = own;
            }
        }
        if (st == DG_OK) { /* kept under CACHE of "kda_state" */
            dg__group_offer(grp, KDA_H, *h);
            dg__group_offer(grp, KDA_E, *E);
        }
        for (int i = 0; i < 5 && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        if (st == DG_OK)
            st = dg__node_output(n, *h); /* its gradient stored like h (kda_cuda.h: mid) */
        if (st == DG_OK)
            st = kda_output_mid(n, &cfg, *E);
        if (st == DG_OK && ht)
            st = dg__node_output(n, *ht);
        if (st == DG_OK)
            dg__node_save(n, G); /* SAVED_G */
        if (st == DG_OK)
            dg__node_save(n, h0); /* SAVED_H0 */
        if (st == DG_OK)
            dg__group_join(grp, KDA_M_STATE, n);
        kda_np *np = st == DG_OK ? dg__kda_np_new(n, &cfg, grp) : NULL;
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
    dg_tensor *owned[5] = {tW, tU, tKG, tG, th0};
    for (int i = 0; i < 5; i++)
        dg_tensor_free(&owned[i]);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK) {
        dg_tensor_free(h);
        dg_tensor_free(E);
        if (ht)
            dg_tensor_free(ht);
    }
    return st;
}

dg_status dg_kda_state(dg_ctx *ctx, dg_tensor *W, dg_tensor *U, dg_tensor *KG, dg_tensor *G,
                       dg_tensor *h0, const dg_kda_opts *opts, dg_tensor **h, dg_tensor **E,
                       dg_tensor **ht) {
    return dg__kda_state_x(ctx, W, U, KG, G, h0, opts, NULL, h, E, ht);
}
#endif

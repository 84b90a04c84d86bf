/*
 * ops/dplr/recurrent.c -- dg_dplr_recurrent: the token-by-token DPLR recurrence (dplr.md D1) as ONE
 * tape node with its own backward through time; the ground truth dg_dplr_chunk must equal.
 *
 *   p = S^T a_t  (reads the undecayed S_{t-1});  S = Diag(exp(gk_t)) S + b_t p^T + k_t v_t^T;
 *   o_t = s S^T q_t
 * Backward, t = T-1 .. 0, with dS = dL/dS_t (starts at dht):
 *   dS += s q_t do_t^T, dq_t = s S_t do_t;  dk_t = dS v_t, dv_t = dS^T k_t
 *   db_t = dS p, dp = dS^T b_t;  da_t = S_{t-1} dp
 *   dgk_t = exp(gk_t) . rowsum(S_{t-1} . dS);  dS <- Diag(exp(gk_t)) dS + a_t dp^T
 * States are recomputed from checkpoints stored every DPLR_REC_SEG tokens. The node keeps its
 * inputs only (both policies). CPU: f64, or f32 computed in f32. CUDA (kernels/dplr/recurrent.cu):
 * q, k, v, a, b, gk f32 or bf16 (one dtype, read as stored), o in that dtype; h0, ht f32.
 */
#ifndef DG_REF_TMPL
#include "dplr.h"
#define DG_REF_TMPL "dplr/recurrent.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

/* One token of dplr.md D1 on S [K,V] in place (p: [V] scratch); writes o_t when o is not NULL. */
static void RF(dplr_step)(const kda_dims *d, RT scale, int64_t t, int h, const RT *q, const RT *k,
                          const RT *v, const RT *a, const RT *b, const RT *gk, RT *S, RT *p,
                          RT *o) {
    const int H = d->H, K = d->K, V = d->V;
    const int64_t r = (t * H + h) * K;
    const RT *vt = v + (t * H + h) * V;
    for (int j = 0; j < V; j++)
        p[j] = 0;
    for (int i = 0; i < K; i++)
        for (int j = 0; j < V; j++)
            p[j] += a[r + i] * S[i * V + j];
    for (int i = 0; i < K; i++) {
        const RT dec = REXP(gk[r + i]), bi = b[r + i], ki = k[r + i];
        for (int j = 0; j < V; j++)
            S[i * V + j] = dec * S[i * V + j] + bi * p[j] + ki * vt[j];
    }
    if (o) {
        RT *ot = o + (t * H + h) * V;
        for (int j = 0; j < V; j++) {
            RT s_ = 0;
            for (int i = 0; i < K; i++)
                s_ += q[r + i] * S[i * V + j];
            ot[j] = scale * s_;
        }
    }
}

dg_status RF(dg__dplr_recurrent_fwd)(const kda_dims *d, RT scale, const RT *q, const RT *k,
                                     const RT *v, const RT *a, const RT *b, const RT *gk,
                                     const RT *h0, RT *o, RT *ht) {
    const int H = d->H;
    const int64_t KV = (int64_t)d->K * d->V, per = KV + d->V;
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * (size_t)per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "dplr_recurrent_fwd: no memory");
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * H > 1))
    for (int w = 0; w < d->N * H; w++) {
        const int n = w / H, h = w % H;
        RT *S = scr + per * kda_thread_id(), *p = S + KV;
        if (h0)
            memcpy(S, h0 + ((int64_t)n * H + h) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(S, 0, sizeof(RT) * (size_t)KV);
        for (int64_t t = d->cu[n]; t < d->cu[n + 1]; t++)
            RF(dplr_step)(d, scale, t, h, q, k, v, a, b, gk, S, p, o);
        if (ht)
            memcpy(ht + ((int64_t)n * H + h) * KV, S, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(scr);
    return DG_OK;
}

dg_status RF(dg__dplr_recurrent_bwd)(const kda_dims *d, RT scale, const RT *q, const RT *k,
                                     const RT *v, const RT *a, const RT *b, const RT *gk,
                                     const RT *h0, const RT *dO, const RT *dht, RT *dq, RT *dk,
                                     RT *dv, RT *da, RT *db, RT *dgk, RT *dh0) {
    const int H = d->H, K = d->K, V = d->V, SEG = DPLR_REC_SEG;
    const int64_t KV = (int64_t)K * V;
    int64_t maxlen = 0;
    for (int n = 0; n < d->N; n++)
        if (d->cu[n + 1] - d->cu[n] > maxlen)
            maxlen = d->cu[n + 1] - d->cu[n];
    const int64_t nseg_max = (maxlen + SEG - 1) / SEG;
    /* per thread: ckpt [nseg,K,V] | buf [SEG+1,K,V] states of one segment | dS [K,V] | p, dp [V] */
    const int64_t per = (nseg_max + SEG + 2) * KV + 2 * V;
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * (size_t)per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "dplr_recurrent_bwd: no memory");
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * H > 1))
    for (int w = 0; w < d->N * H; w++) {
        const int n = w / H, h = w % H;
        RT *ckpt = scr + per * kda_thread_id();
        RT *buf = ckpt + nseg_max * KV, *dS = buf + (SEG + 1) * KV, *p = dS + KV, *dp = p + V;
        const int64_t t0 = d->cu[n], t1 = d->cu[n + 1];
        RT *S = buf;
        if (h0)
            memcpy(S, h0 + ((int64_t)n * H + h) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(S, 0, sizeof(RT) * (size_t)KV);
        for (int64_t t = t0; t < t1; t++) {
            if ((t - t0) % SEG == 0)
                memcpy(ckpt + (t - t0) / SEG * KV, S, sizeof(RT) * (size_t)KV);
            RF(dplr_step)(d, scale, t, h, q, k, v, a, b, gk, S, p, NULL);
        }
        if (dht)
            memcpy(dS, dht + ((int64_t)n * H + h) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(dS, 0, sizeof(RT) * (size_t)KV);
        for (int64_t s = (t1 - t0 + SEG - 1) / SEG - 1; s >= 0; s--) {
            const int64_t ts = t0 + s * SEG, te = ts + SEG < t1 ? ts + SEG : t1;
            memcpy(buf, ckpt + s * KV, sizeof(RT) * (size_t)KV);
            for (int64_t t = ts; t < te; t++) {
                memcpy(buf + (t - ts + 1) * KV, buf + (t - ts) * KV, sizeof(RT) * (size_t)KV);
                RF(dplr_step)(d, scale, t, h, q, k, v, a, b, gk, buf + (t - ts + 1) * KV, p, NULL);
            }
            for (int64_t t = te - 1; t >= ts; t--) {
                const RT *Sp = buf + (t - ts) * KV, *St = buf + (t - ts + 1) * KV;
                const int64_t r = (t * H + h) * K, rv = (t * H + h) * V;
                const RT *vt = v + rv;
                if (dO) { /* o_t = s S_t^T q_t */
                    const RT *dot = dO + rv;
                    for (int i = 0; i < K; i++) {
                        RT s_ = 0;
                        for (int j = 0; j < V; j++) {
                            s_ += St[i * V + j] * dot[j];
                            dS[i * V + j] += scale * q[r + i] * dot[j];
                        }
                        dq[r + i] = scale * s_;
                    }
                } else {
                    for (int i = 0; i < K; i++)
                        dq[r + i] = 0;
                }
                /* p = S_{t-1}^T a_t (recomputed), dv = dS^T k, dp = dS^T b */
                for (int j = 0; j < V; j++) {
                    RT sp = 0, sv = 0, sb = 0;
                    for (int i = 0; i < K; i++) {
                        sp += a[r + i] * Sp[i * V + j];
                        sv += dS[i * V + j] * k[r + i];
                        sb += dS[i * V + j] * b[r + i];
                    }
                    p[j] = sp;
                    dv[rv + j] = sv;
                    dp[j] = sb;
                }
                for (int i = 0; i < K; i++) {
                    RT sk = 0, sb = 0, sa = 0, sg = 0;
                    const RT dec = REXP(gk[r + i]);
                    for (int j = 0; j < V; j++) {
                        const RT g_ = dS[i * V + j];
                        sk += g_ * vt[j];
                        sb += g_ * p[j];
                        sa += Sp[i * V + j] * dp[j];
                        sg += Sp[i * V + j] * g_;
                    }
                    dk[r + i] = sk;
                    db[r + i] = sb;
                    da[r + i] = sa;
                    dgk[r + i] = dec * sg;
                }
                for (int i = 0; i < K; i++) { /* dS_{t-1} = D dS + a dp^T */
                    const RT dec = REXP(gk[r + i]), ai = a[r + i];
                    for (int j = 0; j < V; j++)
                        dS[i * V + j] = dec * dS[i * V + j] + ai * dp[j];
                }
            }
        }
        if (dh0)
            memcpy(dh0 + ((int64_t)n * H + h) * KV, dS, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_dplr_recurrent"

enum { IH0 = 6, NIN = 7 }; /* q, k, v, a, b, gk, h0 */

static dg_status rec_backward(dg_ctx *ctx, dg_node *n) {
    const kda_np *np = (const kda_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *gO = dg__node_grad_out(n, 0);
    const dg_tensor *gH = np->flags ? dg__node_grad_out(n, 1) : NULL;
    if (!gO && !gH)
        return DG_OK;
    const int bf16 = dplr_bf16(c, n->saved[0]);
    const dg_dtype lt = dplr_leaf_dt(c, bf16);
    dg_tensor *tmp[NIN + 2] = {0}, *gr[NIN] = {0};
    const void *p[NIN + 2] = {0};
    dg_status st = DG_OK;
    for (int i = 0; i < NIN && st == DG_OK; i++) /* the leaves q .. gk, then h0 */
        if (n->saved[i])
            st = dg__kda_ptr(ctx, n->saved[i], i < IH0 ? lt : c->dt, &tmp[i], &p[i]);
    if (st == DG_OK && gO) /* o's gradient in o's dtype (the leaves') */
        st = dg__kda_ptr(ctx, gO, lt, &tmp[NIN], &p[NIN]);
    if (st == DG_OK && gH)
        st = dg__kda_ptr(ctx, gH, c->dt, &tmp[NIN + 1], &p[NIN + 1]);
    for (int i = 0; i < NIN && st == DG_OK; i++) /* in the compute dtype (accumulated as such) */
        if (n->saved[i])
            st = kda_new_as(ctx, c, n->saved[i], &gr[i]);
    if (st == DG_OK)
        st = dplr_run_recurrent_bwd(ctx, c, bf16, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[NIN],
                                    p[NIN + 1], dg_tensor_data(gr[0]), dg_tensor_data(gr[1]),
                                    dg_tensor_data(gr[2]), dg_tensor_data(gr[3]),
                                    dg_tensor_data(gr[4]), dg_tensor_data(gr[5]),
                                    gr[6] ? dg_tensor_data(gr[6]) : NULL);
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (gr[i] && dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, gr[i]);
    for (int i = 0; i < NIN + 2; i++)
        dg_tensor_free(&tmp[i]);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&gr[i]);
    return st;
}

dg_status dg_dplr_recurrent(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                            dg_tensor *b, dg_tensor *gk, dg_tensor *h0, const dg_dplr_opts *opts,
                            dg_tensor **o, dg_tensor **ht) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "o", o));
    *o = NULL;
    if (ht)
        *ht = NULL;
    if (opts && opts->output_final_state && !ht)
        return dg__err(DG_ERR_ARG, OP ": opts->output_final_state is set but ht is NULL");
    kda_cfg cfg;
    DG_TRY(dg__dplr_check_inputs(OP, ctx, q, k, v, a, b, gk, h0, opts, &cfg));
    const int want_ht = opts && opts->output_final_state;
    const int bf16 = dplr_bf16(&cfg, q);
    const dg_dtype lt = dplr_leaf_dt(&cfg, bf16);
    dg_tensor *in[NIN] = {q, k, v, a, b, gk, h0}, *tmp[NIN] = {0};
    const void *p[NIN] = {0};
    dg_status st = DG_OK;
    for (int i = 0; i < NIN && st == DG_OK; i++)
        if (in[i])
            st = dg__kda_ptr(ctx, in[i], i < IH0 ? lt : cfg.dt, &tmp[i], &p[i]);
    int64_t so[4] = {cfg.d.B, cfg.d.T, cfg.d.H, cfg.d.V};
    int64_t s0[4] = {cfg.d.N, cfg.d.H, cfg.d.K, cfg.d.V};
    if (st == DG_OK) /* o in the leaves' dtype */
        st = dg_tensor_new(ctx, lt, 4, so, o);
    if (st == DG_OK && want_ht)
        st = dg__kda_new(ctx, &cfg, 4, s0, ht);
    if (st == DG_OK)
        st = dplr_run_recurrent_fwd(ctx, &cfg, bf16, p[0], p[1], p[2], p[3], p[4], p[5], p[6],
                                    dg_tensor_data(*o), want_ht ? dg_tensor_data(*ht) : NULL);
    if (st == DG_OK && dg__needs_grad(NIN, in)) {
        dg_node *n = NULL;
        st = dg__node_new("dplr_recurrent", DG_POLICY_RECOMPUTE, rec_backward, ctx, &n);
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        if (st == DG_OK)
            st = dg__node_output(n, *o);
        if (st == DG_OK && want_ht)
            st = dg__node_output(n, *ht);
        for (int i = 0; i < NIN && st == DG_OK; i++)
            dg__node_save(n, in[i]);
        kda_np *np = st == DG_OK ? dg__kda_np_new(n, &cfg, NULL) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (np)
            np->flags = want_ht;
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&tmp[i]);
    return dg__kda_finish(&cfg, st, o, ht);
}
#endif

/*
 * ops/kda/recurrent.c -- dg_kda_recurrent: the token-by-token recurrence (kda.md §11.1) as ONE tape
 * node with its own backward through time. It is the ground truth dg_kda_chunk must equal.
 *
 *   S' = Diag(exp(g_t)) S;  p = S'^T k_t;  e = beta_t (v_t - p);  S = S' + k_t e^T;
 *   o_t = s S^T q_t
 * Backward, t = T-1 .. 0, with dS = dL/dS_t (starts at dht):
 *   dS += s q_t do_t^T, dq_t = s S_t do_t;  de = dS^T k_t, dk_t = dS e
 *   dbeta_t = de . (v_t - p), dv_t = beta_t de, dp = -beta_t de
 *   dS' = dS + k_t dp^T, dk_t += S' dp;  dg_t = rowsum(S' . dS');  dS <- Diag(exp(g_t)) dS'
 * States S_t are recomputed from checkpoints stored every KDA_REC_SEG tokens (memory
 * O(T/SEG + SEG) states per head instead of O(T)). The in-op transforms (l2norm of q, k, beta
 * sigmoid, gate) are applied inside the same node with the raw functions of the stage files.
 * The node keeps its inputs only (both policies): everything else is recomputed in backward.
 * CUDA: q, k, v, g, beta f32 or bf16 (one dtype), A_log, dt_bias, h0 f32; computed in f32; o in
 * q's dtype, ht f32.
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/recurrent.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

/* One token of kda.md §11.1 on S [K,V] in place; writes o_t when o is not NULL. */
static void RF(rec_step)(const kda_dims *d, RT scale, int64_t t, int hv, const RT *q, const RT *k,
                         const RT *v, const RT *g, const RT *beta, RT *S, RT *o) {
    const int H = d->H, HV = d->HV, K = d->K, V = d->V, hq = hv / (HV / H);
    const RT *qt = q + (t * H + hq) * K, *kt = k + (t * H + hq) * K;
    const RT *vt = v + (t * HV + hv) * V, *gt = g + (t * HV + hv) * K;
    const RT bt = beta[t * HV + hv];
    for (int a = 0; a < K; a++) {
        const RT dec = REXP(gt[a]);
        for (int b = 0; b < V; b++)
            S[a * V + b] *= dec;
    }
    for (int b = 0; b < V; b++) { /* column b of S' gives e_b, then gets its rank-1 update */
        RT p = 0;
        for (int a = 0; a < K; a++)
            p += S[a * V + b] * kt[a];
        const RT e = bt * (vt[b] - p);
        for (int a = 0; a < K; a++)
            S[a * V + b] += kt[a] * e;
    }
    if (o)
        for (int b = 0; b < V; b++) {
            RT s = 0;
            for (int a = 0; a < K; a++)
                s += S[a * V + b] * qt[a];
            o[(t * HV + hv) * V + b] = scale * s;
        }
}

dg_status RF(dg__kda_recurrent_fwd)(const kda_dims *d, RT scale, const RT *q, const RT *k,
                                    const RT *v, const RT *g, const RT *beta, const RT *h0, RT *o,
                                    RT *ht) {
    const int HV = d->HV;
    const int64_t KV = (int64_t)d->K * d->V;
    RT *Ss = (RT *)DG_MALLOC(sizeof(RT) * (size_t)KV * (size_t)kda_max_threads());
    if (!Ss)
        return dg__err(DG_ERR_NOMEM, "kda_recurrent_fwd: no memory");
    /* work item: one (sequence, value head) with its own state S [K,V] */
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * HV > 1))
    for (int w = 0; w < d->N * HV; w++) {
        const int n = w / HV, hv = w % HV;
        RT *S = Ss + (size_t)KV * (size_t)kda_thread_id();
        if (h0)
            memcpy(S, h0 + ((int64_t)n * HV + hv) * KV, sizeof(RT) * (size_t)KV);
        else
            memset(S, 0, sizeof(RT) * (size_t)KV);
        for (int64_t t = d->cu[n]; t < d->cu[n + 1]; t++)
            RF(rec_step)(d, scale, t, hv, q, k, v, g, beta, S, o);
        if (ht)
            memcpy(ht + ((int64_t)n * HV + hv) * KV, S, sizeof(RT) * (size_t)KV);
    }
    DG_FREE(Ss);
    return DG_OK;
}

dg_status RF(dg__kda_recurrent_bwd)(const kda_dims *d, RT scale, const RT *q, const RT *k,
                                    const RT *v, const RT *g, const RT *beta, const RT *h0,
                                    const RT *dO, const RT *dht, RT *dq, RT *dk, RT *dv, RT *dg,
                                    RT *dbeta, RT *dh0) {
    const int H = d->H, HV = d->HV, K = d->K, V = d->V, grp = HV / H, SEG = KDA_REC_SEG;
    const int64_t KV = (int64_t)K * V, TT = d->B * d->T;
    int64_t maxlen = 0;
    for (int n = 0; n < d->N; n++)
        if (d->cu[n + 1] - d->cu[n] > maxlen)
            maxlen = d->cu[n + 1] - d->cu[n];
    const int64_t nseg_max = (maxlen + SEG - 1) / SEG;
    /* per thread: ckpt [nseg,K,V] | buf [SEG+1,K,V] states of one segment | dS, Sp [K,V] |
     * e, p, de [V] */
    const size_t per = (size_t)((nseg_max + SEG + 3) * KV + 3 * V);
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kda_recurrent_bwd: no memory");
    memset(dq, 0, sizeof(RT) * (size_t)(TT * H * K));
    memset(dk, 0, sizeof(RT) * (size_t)(TT * H * K));
    /* work item: one (sequence, q/k head); the value heads of its group run in order inside, so
     * dq and dk of a GVA group accumulate in the same order as a serial loop */
    KDA_OMP(parallel for schedule(dynamic, 1) if (d->N * H > 1))
    for (int w = 0; w < d->N * H; w++) {
        const int n = w / H, hq = w % H;
        RT *ckpt = scr + per * (size_t)kda_thread_id();
        RT *buf = ckpt + nseg_max * KV, *dS = buf + (SEG + 1) * KV, *Sp = dS + KV;
        RT *e = Sp + KV, *p = e + V, *de = p + V;
        for (int hv = hq * grp; hv < (hq + 1) * grp; hv++) {
            const int64_t t0 = d->cu[n], t1 = d->cu[n + 1];
            RT *S = buf;
            if (h0)
                memcpy(S, h0 + ((int64_t)n * HV + hv) * KV, sizeof(RT) * (size_t)KV);
            else
                memset(S, 0, sizeof(RT) * (size_t)KV);
            for (int64_t t = t0; t < t1; t++) {
                if ((t - t0) % SEG == 0)
                    memcpy(ckpt + (t - t0) / SEG * KV, S, sizeof(RT) * (size_t)KV);
                RF(rec_step)(d, scale, t, hv, q, k, v, g, beta, S, NULL);
            }
            if (dht)
                memcpy(dS, dht + ((int64_t)n * HV + hv) * KV, sizeof(RT) * (size_t)KV);
            else
                memset(dS, 0, sizeof(RT) * (size_t)KV);
            for (int64_t s = (t1 - t0 + SEG - 1) / SEG - 1; s >= 0; s--) {
                const int64_t ts = t0 + s * SEG, te = ts + SEG < t1 ? ts + SEG : t1;
                memcpy(buf, ckpt + s * KV, sizeof(RT) * (size_t)KV);
                for (int64_t t = ts; t < te; t++) {
                    memcpy(buf + (t - ts + 1) * KV, buf + (t - ts) * KV, sizeof(RT) * (size_t)KV);
                    RF(rec_step)(d, scale, t, hv, q, k, v, g, beta, buf + (t - ts + 1) * KV, NULL);
                }
                for (int64_t t = te - 1; t >= ts; t--) {
                    const RT *Sprev = buf + (t - ts) * KV, *St = buf + (t - ts + 1) * KV;
                    const RT *qt = q + (t * H + hq) * K, *kt = k + (t * H + hq) * K;
                    const RT *vt = v + (t * HV + hv) * V, *gt = g + (t * HV + hv) * K;
                    const RT bt = beta[t * HV + hv];
                    RT *dqt = dq + (t * H + hq) * K, *dkt = dk + (t * H + hq) * K;
                    for (int a = 0; a < K; a++) {
                        const RT dec = REXP(gt[a]);
                        for (int b = 0; b < V; b++)
                            Sp[a * V + b] = dec * Sprev[a * V + b];
                    }
                    for (int b = 0; b < V; b++) {
                        RT s_ = 0;
                        for (int a = 0; a < K; a++)
                            s_ += Sp[a * V + b] * kt[a];
                        p[b] = s_;
                        e[b] = bt * (vt[b] - s_);
                    }
                    if (dO) { /* o_t = s S_t^T q_t */
                        const RT *dot = dO + (t * HV + hv) * V;
                        for (int a = 0; a < K; a++) {
                            RT s_ = 0;
                            for (int b = 0; b < V; b++) {
                                s_ += St[a * V + b] * dot[b];
                                dS[a * V + b] += scale * qt[a] * dot[b];
                            }
                            dqt[a] += scale * s_;
                        }
                    }
                    /* S_t = S' + k e^T */
                    for (int b = 0; b < V; b++) {
                        RT s_ = 0;
                        for (int a = 0; a < K; a++)
                            s_ += dS[a * V + b] * kt[a];
                        de[b] = s_;
                    }
                    RT db = 0;
                    for (int a = 0; a < K; a++) {
                        RT s_ = 0;
                        for (int b = 0; b < V; b++)
                            s_ += dS[a * V + b] * e[b];
                        dkt[a] += s_;
                    }
                    /* e = beta (v - S'^T k): de -> dbeta, dv, and dp = -beta de into S' and k */
                    for (int b = 0; b < V; b++) {
                        db += de[b] * (vt[b] - p[b]);
                        dv[(t * HV + hv) * V + b] = bt * de[b];
                        de[b] = -bt * de[b]; /* now dp */
                    }
                    dbeta[t * HV + hv] = db;
                    RT *dgt = dg + (t * HV + hv) * K;
                    for (int a = 0; a < K; a++) {
                        RT sk = 0, sg = 0;
                        const RT dec = REXP(gt[a]);
                        for (int b = 0; b < V; b++) {
                            sk += Sp[a * V + b] * de[b];
                            const RT dsp = dS[a * V + b] + kt[a] * de[b];
                            sg += Sp[a * V + b] * dsp;
                            dS[a * V + b] = dec * dsp; /* S' = Diag(exp(g)) S_{t-1} */
                        }
                        dkt[a] += sk;
                        dgt[a] = sg;
                    }
                }
            }
            if (dh0)
                memcpy(dh0 + ((int64_t)n * HV + hv) * KV, dS, sizeof(RT) * (size_t)KV);
        }
    }
    DG_FREE(scr);
    return DG_OK;
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_recurrent"
#define F_L2 1
#define F_SIG 2
#define F_HT 4

/* The node's inputs, also its saved tensors in the same order (A_log, dt_bias, h0 may be NULL). */
enum { IN_Q, IN_K, IN_V, IN_G, IN_BETA, IN_A_LOG, IN_DT_BIAS, IN_H0, N_IN };

/* The inputs as tensors, and as pointers in the compute dtype (NULL for a missing input). */
typedef struct rec_tensors {
    dg_tensor *q, *k, *v, *g, *beta, *A_log, *dt_bias, *h0;
} rec_tensors;
typedef struct rec_ptrs {
    const void *q, *k, *v, *g, *beta, *A_log, *dt_bias, *h0;
} rec_ptrs;

/* p->X: t->X in the compute dtype, for every input present; tmp gets the converted copies (free
 * them with rec_free, also on error). */
static dg_status rec_ptrs_of(dg_ctx *ctx, dg_dtype dt, const rec_tensors *t, rec_tensors *tmp,
                             rec_ptrs *p) {
    memset(tmp, 0, sizeof *tmp);
    memset(p, 0, sizeof *p);
    dg_status st = DG_OK;
    if (st == DG_OK && t->q)
        st = dg__kda_ptr(ctx, t->q, dt, &tmp->q, &p->q);
    if (st == DG_OK && t->k)
        st = dg__kda_ptr(ctx, t->k, dt, &tmp->k, &p->k);
    if (st == DG_OK && t->v)
        st = dg__kda_ptr(ctx, t->v, dt, &tmp->v, &p->v);
    if (st == DG_OK && t->g)
        st = dg__kda_ptr(ctx, t->g, dt, &tmp->g, &p->g);
    if (st == DG_OK && t->beta)
        st = dg__kda_ptr(ctx, t->beta, dt, &tmp->beta, &p->beta);
    if (st == DG_OK && t->A_log)
        st = dg__kda_ptr(ctx, t->A_log, dt, &tmp->A_log, &p->A_log);
    if (st == DG_OK && t->dt_bias)
        st = dg__kda_ptr(ctx, t->dt_bias, dt, &tmp->dt_bias, &p->dt_bias);
    if (st == DG_OK && t->h0)
        st = dg__kda_ptr(ctx, t->h0, dt, &tmp->h0, &p->h0);
    return st;
}

static void rec_free(rec_tensors *t) {
    dg_tensor **all[N_IN] = {&t->q, &t->k, &t->v, &t->g, &t->beta, &t->A_log, &t->dt_bias, &t->h0};
    for (int i = 0; i < N_IN; i++)
        dg_tensor_free(all[i]);
}

/* The transformed inputs of the recurrence: normalised q, k (+ 1/norms), beta, log decay g, all
 * in the compute dtype, in one scratch tensor on the context's device. */
typedef struct rec_tx {
    dg_tensor *buf;
    const void *q, *k, *beta, *g;
    void *qn, *kn, *rq, *rk, *bt, *gl;
} rec_tx;

/* p: the inputs in the compute dtype. */
static dg_status tx_build(dg_ctx *ctx, const kda_cfg *c, int flags, const rec_ptrs *p, rec_tx *x) {
    const kda_dims *d = &c->d;
    const int64_t TT = d->B * d->T, nq = TT * d->H * d->K, nb = TT * d->HV, ng = nb * d->K;
    const size_t es = dg_dtype_size(c->dt);
    memset(x, 0, sizeof *x);
    int64_t total[1] = {2 * nq + 2 * TT * d->H + nb + ng};
    DG_TRY(dg_tensor_new(ctx, c->dt, 1, total, &x->buf));
    char *m = (char *)dg_tensor_data(x->buf);
    x->qn = m;
    x->kn = m + es * (size_t)nq;
    x->rq = m + es * (size_t)(2 * nq);
    x->rk = m + es * (size_t)(2 * nq + TT * d->H);
    x->bt = m + es * (size_t)(2 * nq + 2 * TT * d->H);
    x->gl = m + es * (size_t)(2 * nq + 2 * TT * d->H + nb);
    x->q = p->q;
    x->k = p->k;
    dg_status st = DG_OK;
    if (flags & F_L2) {
        st = dg__l2norm_run_fwd(ctx, c->cuda, c->dt, TT * d->H, d->K, KDA_L2_EPS, 0, p->q, x->qn,
                                x->rq);
        if (st == DG_OK)
            st = dg__l2norm_run_fwd(ctx, c->cuda, c->dt, TT * d->H, d->K, KDA_L2_EPS, 0, p->k,
                                    x->kn, x->rk);
        x->q = x->qn;
        x->k = x->kn;
    }
    x->beta = p->beta;
    if (st == DG_OK && (flags & F_SIG)) {
        st = kda_run_beta_fwd(ctx, c->cuda, c->dt, nb, c->beta_c, 0, p->beta, x->bt);
        x->beta = x->bt;
    }
    if (st == DG_OK) {
        kda_gate_fwd_io gate = {.x = p->g, .A_log = p->A_log, .dt_bias = p->dt_bias, .G = x->gl};
        st = kda_run_gate_fwd(ctx, c, 0, &gate);
    }
    x->g = x->gl;
    if (st != DG_OK)
        dg_tensor_free(&x->buf);
    return st;
}

static dg_status rec_backward(dg_ctx *ctx, dg_node *n) {
    const kda_np *np = (const kda_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const kda_dims *d = &c->d;
    const dg_tensor *gO = dg__node_grad_out(n, 0);
    const dg_tensor *gH = (np->flags & F_HT) ? dg__node_grad_out(n, 1) : NULL;
    if (!gO && !gH)
        return DG_OK;
    const rec_tensors in = {.q = n->saved[IN_Q],
                            .k = n->saved[IN_K],
                            .v = n->saved[IN_V],
                            .g = n->saved[IN_G],
                            .beta = n->saved[IN_BETA],
                            .A_log = n->saved[IN_A_LOG],
                            .dt_bias = n->saved[IN_DT_BIAS],
                            .h0 = n->saved[IN_H0]};
    /* tmp: converted copies of the inputs; gr: gradients of the inputs; dq_n, dk_n, dg_l,
     * dbeta_t: the gradients of the transformed q, k, g and beta (before the in-op transforms'
     * own backward) */
    rec_tensors tmp = {0}, gr = {0};
    rec_ptrs p = {0};
    dg_tensor *tgO = NULL, *tgH = NULL, *dq_n = NULL, *dk_n = NULL, *dg_l = NULL, *dbeta_t = NULL;
    kda_recurrent_bwd_io io = {0};
    rec_tx x = {0};
    dg_status st = rec_ptrs_of(ctx, c->dt, &in, &tmp, &p);
    if (st == DG_OK && gO)
        st = dg__kda_ptr(ctx, gO, c->dt, &tgO, &io.dO);
    if (st == DG_OK && gH)
        st = dg__kda_ptr(ctx, gH, c->dt, &tgH, &io.dht);
    if (st == DG_OK)
        st = tx_build(ctx, c, np->flags, &p, &x);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.q, &gr.q);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.k, &gr.k);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.v, &gr.v);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.g, &gr.g);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.beta, &gr.beta);
    if (st == DG_OK && in.A_log)
        st = kda_new_as(ctx, c, in.A_log, &gr.A_log);
    if (st == DG_OK && in.dt_bias)
        st = kda_new_as(ctx, c, in.dt_bias, &gr.dt_bias);
    if (st == DG_OK && in.h0)
        st = kda_new_as(ctx, c, in.h0, &gr.h0);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.q, &dq_n);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.k, &dk_n);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.g, &dg_l);
    if (st == DG_OK)
        st = kda_new_as(ctx, c, in.beta, &dbeta_t);
    if (st == DG_OK) {
        io.q = x.q;
        io.k = x.k;
        io.v = p.v;
        io.g = x.g;
        io.beta = x.beta;
        io.h0 = p.h0;
        io.dq = dg_tensor_data(dq_n);
        io.dk = dg_tensor_data(dk_n);
        io.dv = dg_tensor_data(gr.v);
        io.dg = dg_tensor_data(dg_l);
        io.dbeta = dg_tensor_data(dbeta_t);
        io.dh0 = gr.h0 ? dg_tensor_data(gr.h0) : NULL;
        st = kda_run_recurrent_bwd(ctx, c, &io);
    }
    const int64_t TT = d->B * d->T, rows = TT * d->H;
    /* dq, dk, dbeta: through the transform, or the raw gradient itself */
    if (st == DG_OK && (np->flags & F_L2)) {
        st = dg__l2norm_run_bwd(ctx, c->cuda, c->dt, rows, d->K, x.q, x.rq, dg_tensor_data(dq_n), 0,
                                dg_tensor_data(gr.q));
        if (st == DG_OK)
            st = dg__l2norm_run_bwd(ctx, c->cuda, c->dt, rows, d->K, x.k, x.rk,
                                    dg_tensor_data(dk_n), 0, dg_tensor_data(gr.k));
    } else if (st == DG_OK) {
        dg_tensor_free(&gr.q);
        gr.q = dg_tensor_retain(dq_n);
        dg_tensor_free(&gr.k);
        gr.k = dg_tensor_retain(dk_n);
    }
    if (st == DG_OK && (np->flags & F_SIG)) {
        st = kda_run_beta_bwd(ctx, c->cuda, c->dt, TT * d->HV, c->beta_c, 0, p.beta,
                              dg_tensor_data(dbeta_t), dg_tensor_data(gr.beta));
    } else if (st == DG_OK) {
        dg_tensor_free(&gr.beta);
        gr.beta = dg_tensor_retain(dbeta_t);
    }
    if (st == DG_OK) {
        kda_gate_bwd_io gate = {.x = p.g,
                                .A_log = p.A_log,
                                .dt_bias = p.dt_bias,
                                .dG = dg_tensor_data(dg_l),
                                .dx = dg_tensor_data(gr.g),
                                .dA_log = gr.A_log ? dg_tensor_data(gr.A_log) : NULL,
                                .ddt_bias = gr.dt_bias ? dg_tensor_data(gr.dt_bias) : NULL};
        st = kda_run_gate_bwd(ctx, c, 0, &gate);
    }
    dg_tensor *grads[N_IN] = {gr.q,    gr.k,     gr.v,       gr.g,
                              gr.beta, gr.A_log, gr.dt_bias, gr.h0}; /* IN_Q .. IN_H0 */
    for (int i = 0; i < N_IN && st == DG_OK; i++)
        if (grads[i] && dg__node_wants_grad(n, i))
            st = dg__node_accum(ctx, n, i, grads[i]);
    dg_tensor_free(&x.buf);
    rec_free(&tmp);
    dg_tensor_free(&tgO);
    dg_tensor_free(&tgH);
    rec_free(&gr);
    dg_tensor_free(&dq_n);
    dg_tensor_free(&dk_n);
    dg_tensor_free(&dg_l);
    dg_tensor_free(&dbeta_t);
    return st;
}

dg_status dg_kda_recurrent(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *g,
                           dg_tensor *beta, dg_tensor *A_log, dg_tensor *dt_bias, dg_tensor *h0,
                           const dg_kda_opts *opts, dg_tensor **o, dg_tensor **ht) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "o", o));
    *o = NULL;
    if (ht)
        *ht = NULL;
    if (opts && opts->output_final_state && !ht)
        return dg__err(DG_ERR_ARG, OP ": opts->output_final_state is set but ht is NULL");
    kda_cfg cfg;
    DG_TRY(dg__kda_check_inputs(OP, ctx, q, k, v, g, beta, A_log, dt_bias, h0, opts, &cfg));
    const int want_ht = opts && opts->output_final_state;
    const int flags = (opts && opts->l2norm_qk ? F_L2 : 0) |
                      (opts && opts->beta_sigmoid ? F_SIG : 0) | (want_ht ? F_HT : 0);
    dg_tensor *in[N_IN] = {q, k, v, g, beta, A_log, dt_bias, h0}, *oc = NULL; /* IN_Q .. IN_H0 */
    const rec_tensors inputs = {q, k, v, g, beta, A_log, dt_bias, h0};
    rec_tensors tmp; /* converted copies */
    rec_ptrs p;
    kda_recurrent_fwd_io io = {0};
    rec_tx x = {0};
    dg_status st = rec_ptrs_of(ctx, cfg.dt, &inputs, &tmp, &p);
    if (st == DG_OK)
        st = tx_build(ctx, &cfg, flags, &p, &x);
    int64_t so[4] = {cfg.d.B, cfg.d.T, cfg.d.HV, cfg.d.V};
    int64_t s0[4] = {cfg.d.N, cfg.d.HV, cfg.d.K, cfg.d.V};
    if (st == DG_OK) /* oc: o in the compute dtype; *o gets q's dtype */
        st = dg__kda_new(ctx, &cfg, 4, so, &oc);
    if (st == DG_OK && want_ht)
        st = dg__kda_new(ctx, &cfg, 4, s0, ht);
    if (st == DG_OK) {
        io.q = x.q;
        io.k = x.k;
        io.v = p.v;
        io.g = x.g;
        io.beta = x.beta;
        io.h0 = p.h0;
        io.o = dg_tensor_data(oc);
        io.ht = want_ht ? dg_tensor_data(*ht) : NULL;
        st = kda_run_recurrent_fwd(ctx, &cfg, &io);
    }
    if (st == DG_OK)
        st = dg__kda_as_dtype(ctx, oc, q->dtype, o);
    if (st == DG_OK && dg__needs_grad(N_IN, in)) {
        dg_node *n = NULL;
        st = dg__node_new("kda_recurrent", DG_POLICY_RECOMPUTE, rec_backward, ctx, &n);
        for (int i = 0; i < N_IN && st == DG_OK; i++)
            dg__node_input(n, in[i]);
        if (st == DG_OK)
            st = dg__node_output(n, *o);
        if (st == DG_OK && want_ht)
            st = dg__node_output(n, *ht);
        for (int i = 0; i < N_IN && st == DG_OK; i++)
            dg__node_save(n, in[i]);
        kda_np *np = st == DG_OK ? dg__kda_np_new(n, &cfg, NULL) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (np)
            np->flags = flags;
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    dg_tensor_free(&x.buf);
    dg_tensor_free(&oc);
    rec_free(&tmp);
    return dg__kda_finish(&cfg, st, o, ht);
}
#endif

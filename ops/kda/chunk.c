/*
 * ops/kda/chunk.c -- dg_kda_chunk: the chunked KDA forward as a chain of stage nodes (kda.md §2).
 *
 *   q, k --N1 l2norm--> q, k          b --N2 beta--> beta          g --N3 gate_cumsum--> G
 *   (q, k, beta, G) --N4 intra--> Aqk, Tm
 *   (q, k, v, beta, G, Tm) --N5 wy--> W, U, KG, QG
 *   (W, U, KG, G, h0) --N6 state--> h, E, ht
 *   (QG, h, Aqk, E) --N7 output--> o
 * The tape gets one node per stage (N1 twice: q and k), and backward runs them in reverse. The
 * state and output nodes read W, U, KG, QG, h, E through one recompute group (its table, what
 * is kept and what is rebuilt under each policy, is at the top of kda_group.c): under the
 * default policies ("kda_wy" RECOMPUTE, "kda_state" CACHE) h and E are kept and W, KG, QG are
 * rebuilt once from Tm by the output node's backward (kda.md §3).
 * CUDA: the stages run their kernels (kernels/kda/) on one upload of the chunk tables. Where the
 * forward prep applies (bf16 q, k, g; kda.h, dg__kda_prep_fits) the intra kernel computes the
 * norms' rq, rk and the gate's G on behalf of those nodes, which are still recorded as above. q, k,
 * v, g, beta may be bf16: the kernels read them as stored (l2norm, beta, gate; v in the WY node; q,
 * k in the intra and WY nodes); beta, G, Aqk and Tm are f32, W, U, KG, QG, h, E bf16 on the
 * tensor-core path (docs/kda.md section 6), where the normalised q, k are factored (the rows
 * as stored and their reciprocal norms, kda.h), else f32; o has q's dtype and ht is f32.
 */
#include "kda.h"

#ifdef DG_HAVE_CUDA
/* an f32, contiguous CUDA tensor or none */
static int prep_param_ok(const dg_tensor *t) {
    return !t || (t->dtype == DG_F32 && dg_tensor_is_contiguous(t) && dg__is_cuda(t));
}
#endif

int dg__kda_prep_fits(const kda_dev *dev, const dg_kda_opts *opts, const dg_tensor *q,
                      const dg_tensor *k, const dg_tensor *g, const dg_tensor *A_log,
                      const dg_tensor *dt_bias) {
#ifdef DG_HAVE_CUDA
    return opts && opts->l2norm_qk && dg__kda_l2norm_factors(dev, q, k) && g &&
           g->dtype == DG_BF16 && dg__is_cuda(g) && dg_tensor_is_contiguous(g) &&
           prep_param_ok(A_log) && prep_param_ok(dt_bias) &&
           dg__kda_intra_prep_fits(&dev->d, dg_tensor_data(q), dg_tensor_data(k),
                                   dg_tensor_data(g));
#else
    (void)dev;
    (void)opts;
    (void)q;
    (void)k;
    (void)g;
    (void)A_log;
    (void)dt_bias;
    return 0;
#endif
}

dg_status dg__kda_local_stages(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *g,
                               dg_tensor *beta, dg_tensor *A_log, dg_tensor *dt_bias,
                               const dg_kda_opts *opts, kda_dev *dev, kda_local *l) {
    memset(l, 0, sizeof *l);
    dg_status st = DG_OK;
    /* the forward prep (kda.h): the intra kernel fills rq, rk and G for the N1 and N3 nodes */
    const int fused = dg__kda_prep_fits(dev, opts, q, k, g, A_log, dt_bias);
    const kda_prep prep = {g, A_log, dt_bias};
    if (opts && opts->l2norm_qk && dg__kda_l2norm_factors(dev, q, k)) { /* kda.h */
        st = dg__kda_l2norm_factored(ctx, q, fused, &l->qn, &l->rq);
        if (st == DG_OK)
            st = dg__kda_l2norm_factored(ctx, k, fused, &l->kn, &l->rk);
    } else if (opts && opts->l2norm_qk) {
        st = dg__kda_l2norm_x(ctx, q, 1, &l->qn);
        if (st == DG_OK)
            st = dg__kda_l2norm_x(ctx, k, 1, &l->kn);
    } else {
        l->qn = dg_tensor_retain(q);
        l->kn = dg_tensor_retain(k);
    }
    if (st == DG_OK) {
        if (opts && opts->beta_sigmoid)
            st = dg__kda_beta_x(ctx, beta, opts->allow_neg_eigval, 1, &l->bt);
        else
            l->bt = dg_tensor_retain(beta);
    }
    if (st == DG_OK)
        st = dg__kda_gate_x(ctx, g, A_log, dt_bias, opts, dev, fused, &l->G);
    if (st == DG_OK)
        st = dg__kda_intra_x(ctx, l->qn, l->kn, l->rq, l->rk, l->bt, l->G, opts, dev,
                             fused ? &prep : NULL, &l->Aqk, &l->Tm);
    if (st == DG_OK)
        st = dg__kda_wy_x(ctx, l->qn, l->kn, l->rq, l->rk, v, l->bt, l->G, l->Tm, opts, dev, &l->W,
                          &l->U, &l->KG, &l->QG);
    if (st != DG_OK)
        dg__kda_local_free(l);
    return st;
}

dg_status dg__kda_local_group(const kda_cfg *cfg, const kda_local *l, dg_tensor *v, dg_tensor *h0,
                              dg__group **grp) {
    DG_TRY(dg__kda_group_new(cfg, grp));
    dg_tensor *in[KDA_NINPUTS] = {l->qn, l->kn, v,     l->bt, l->G,
                                  l->Tm, h0,    l->rq, l->rk}; /* KDA_IN_Q .. */
    for (int i = 0; i < KDA_NINPUTS; i++)
        dg__group_set_input(*grp, i, in[i]);
    dg_tensor *made[4] = {l->W, l->U, l->KG, l->QG}; /* KDA_W .. KDA_QG */
    for (int i = 0; i < 4; i++)
        dg__group_offer(*grp, KDA_W + i, made[i]);
    return DG_OK;
}

void dg__kda_local_free(kda_local *l) {
    dg_tensor **t[12] = {&l->qn,  &l->kn, &l->rq, &l->rk, &l->bt, &l->G,
                         &l->Aqk, &l->Tm, &l->W,  &l->U,  &l->KG, &l->QG};
    for (int i = 0; i < 12; i++)
        dg_tensor_free(t[i]);
}

#define OP "dg_kda_chunk"

dg_status dg_kda_chunk(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *g,
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

    kda_local l;
    dg_tensor *h = NULL, *E = NULL;
    dg__group *grp = NULL;
    dg_status st = dg__kda_local_stages(ctx, q, k, v, g, beta, A_log, dt_bias, opts, cfg.dev, &l);
    if (st == DG_OK)
        st = dg__kda_local_group(&cfg, &l, v, h0, &grp);
    if (st == DG_OK)
        st = dg__kda_state_x(ctx, l.W, l.U, l.KG, l.G, h0, opts, grp, &h, &E, want_ht ? ht : NULL);
    if (st == DG_OK)
        st = dg__kda_output_x(ctx, l.QG, h, l.Aqk, E, opts, grp, q->dtype, o);

    dg__group_release(&grp);
    dg__kda_local_free(&l);
    dg_tensor_free(&h);
    dg_tensor_free(&E);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK && ht)
        dg_tensor_free(ht);
    return st;
}

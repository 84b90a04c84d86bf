/*
 * ops/kda/chunk.c -- dg_kda_chunk: the chunked KDA forward as a chain of stage nodes (spec §10).
 *
 *   q, k --N1 l2norm--> q, k          b --N2 beta--> beta          g --N3 gate_cumsum--> G
 *   (q, k, beta, G) --N4 intra--> Aqk, Tm
 *   (q, k, v, beta, G, Tm) --N5 wy--> W, U, KG, QG
 *   (W, U, KG, G, h0) --N6 state--> h, E, ht
 *   (QG, h, Aqk, E) --N7 output--> o
 * The tape gets one node per stage (N1 twice: q and k), and backward runs them in reverse. The
 * wy/state/output nodes share a recompute context (kda_rc.c): under the default policies
 * ("kda_wy", "kda_state": RECOMPUTE) W, U, KG, QG, h and E are not kept after the forward; the
 * output node's backward rebuilds them once from Tm and h0, as FLA's backward does (§6.7).
 * CUDA: the stages run their kernels (kernels/kda/) on one upload of the chunk tables. q, k, v,
 * g, beta may be bf16: each stage converts what it reads to f32; the normalised q, k, beta and
 * every intermediate are f32 tensors (storing them in bf16 is a later optimisation), o is
 * converted back to q's dtype and ht is f32.
 */
#include "kda.h"

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
    DG_TRY(kda_check_inputs(OP, ctx, q, k, v, g, beta, A_log, dt_bias, h0, opts, &cfg));
    const int want_ht = opts && opts->output_final_state;

    dg_tensor *qn = NULL, *kn = NULL, *bt = NULL, *G = NULL, *Aqk = NULL, *Tm = NULL;
    dg_tensor *W = NULL, *U = NULL, *KG = NULL, *QG = NULL, *h = NULL, *E = NULL;
    kda_rc *rc = NULL;
    dg_status st = DG_OK;
    if (opts && opts->l2norm_qk) {
        st = kda_l2norm_x(ctx, q, 1, &qn);
        if (st == DG_OK)
            st = kda_l2norm_x(ctx, k, 1, &kn);
    } else {
        qn = dg_tensor_retain(q);
        kn = dg_tensor_retain(k);
    }
    if (st == DG_OK) {
        if (opts && opts->beta_sigmoid)
            st = kda_beta_x(ctx, beta, opts->allow_neg_eigval, 1, &bt);
        else
            bt = dg_tensor_retain(beta);
    }
    if (st == DG_OK)
        st = kda_gate_x(ctx, g, A_log, dt_bias, opts, cfg.dev, &G);
    if (st == DG_OK)
        st = kda_intra_x(ctx, qn, kn, bt, G, opts, cfg.dev, &Aqk, &Tm);
    if (st == DG_OK)
        st = kda_wy_x(ctx, qn, kn, v, bt, G, Tm, opts, cfg.dev, &W, &U, &KG, &QG);
    if (st == DG_OK)
        st = kda_rc_new(&cfg, &rc);
    if (st == DG_OK) {
        kda_rc_set_inputs(rc, qn, kn, v, bt, G, Tm, h0);
        if (dg_policy_resolve("kda_wy", DG_POLICY_RECOMPUTE) == DG_POLICY_CACHE) {
            kda_rc_cache(rc, KDA_W, W);
            kda_rc_cache(rc, KDA_U, U);
            kda_rc_cache(rc, KDA_KG, KG);
            kda_rc_cache(rc, KDA_QG, QG);
        }
        st = kda_state_rc(ctx, W, U, KG, G, h0, opts, rc, &h, &E, want_ht ? ht : NULL);
    }
    if (st == DG_OK)
        st = kda_output_rc(ctx, QG, h, Aqk, E, opts, rc, q->dtype, o);

    kda_rc_release(&rc);
    dg_tensor *locals[12] = {qn, kn, bt, G, Aqk, Tm, W, U, KG, QG, h, E};
    for (int i = 0; i < 12; i++)
        dg_tensor_free(&locals[i]);
    kda_cfg_free(&cfg);
    if (st != DG_OK && ht)
        dg_tensor_free(ht);
    return st;
}

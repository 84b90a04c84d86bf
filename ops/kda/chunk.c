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
    DG_TRY(kda_check_inputs(OP, q, k, v, g, beta, A_log, dt_bias, h0, opts, &cfg));
    const int want_ht = opts && opts->output_final_state;

    dg_tensor *qn = NULL, *kn = NULL, *bt = NULL, *G = NULL, *Aqk = NULL, *Tm = NULL;
    dg_tensor *W = NULL, *U = NULL, *KG = NULL, *QG = NULL, *h = NULL, *E = NULL;
    kda_rc *rc = NULL;
    dg_status st = DG_OK;
    if (opts && opts->l2norm_qk) {
        st = dg_kda_l2norm(ctx, q, &qn);
        if (st == DG_OK)
            st = dg_kda_l2norm(ctx, k, &kn);
    } else {
        qn = dg_tensor_retain(q);
        kn = dg_tensor_retain(k);
    }
    if (st == DG_OK) {
        if (opts && opts->beta_sigmoid)
            st = dg_kda_beta(ctx, beta, opts->allow_neg_eigval, &bt);
        else
            bt = dg_tensor_retain(beta);
    }
    if (st == DG_OK)
        st = dg_kda_gate_cumsum(ctx, g, A_log, dt_bias, opts, &G);
    if (st == DG_OK)
        st = dg_kda_intra(ctx, qn, kn, bt, G, opts, &Aqk, &Tm);
    if (st == DG_OK)
        st = dg_kda_wy(ctx, qn, kn, v, bt, G, Tm, opts, &W, &U, &KG, &QG);
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
        st = kda_output_rc(ctx, QG, h, Aqk, E, opts, rc, o);

    kda_rc_release(&rc);
    dg_tensor *locals[12] = {qn, kn, bt, G, Aqk, Tm, W, U, KG, QG, h, E};
    for (int i = 0; i < 12; i++)
        dg_tensor_free(&locals[i]);
    kda_cfg_free(&cfg);
    if (st != DG_OK && ht)
        dg_tensor_free(ht);
    return st;
}

/*
 * ops/dplr/chunk.c -- dg_dplr_chunk: the chunked DPLR forward as a chain of stage nodes
 * (dplr.md D3, FLA's kernel sequence cumsum -> intra -> wy -> h -> o):
 *
 *   gk --gate_cumsum--> Gi, Ge
 *   (q, k, a, b, Gi, Ge) --intra--> Aqk, Aqb, Aak, Tab
 *   (q, k, v, a, b, Gi, Ge, Aak, Tab) --wy--> w, u, qg, kg, bg
 *   (w, u, kg, bg, v, Gi, h0) --state--> h, v2, ht
 *   (qg, h, Aqk, Aqb, v, v2) --output--> o
 * The tape gets one node per stage and backward runs them in reverse. The state and output nodes
 * read w, u, qg, kg, bg, h, v2 through one recompute group (its table is at the top of
 * dplr_group.c): under the default policies ("dplr_wy", "dplr_state": RECOMPUTE) they are not
 * kept after the forward; the output node's backward rebuilds them once from Tab, Aak and h0
 * (dplr.md D4). Under CACHE they are kept. The gradients are the same either way (the
 * recomputation repeats the forward's arithmetic).
 * CPU: f64, or f32 computed in f32. CUDA: the stages run their kernels (kernels/dplr/) on one
 * upload of the chunk tables; q, k, v, a, b, gk may be f32 or bf16 (one dtype, read as stored by
 * the kernels), every intermediate is f32, o has q's dtype, h0 and ht are f32.
 */
#include "dplr.h"

dg_status dg__dplr_local_stages(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                                dg_tensor *b, dg_tensor *gk, const dg_dplr_opts *opts,
                                kda_dev *share, dplr_local *l) {
    memset(l, 0, sizeof *l);
    dg_status st = dg__dplr_gate_cumsum_x(ctx, gk, opts, share, &l->Gi, &l->Ge);
    if (st == DG_OK)
        st = dg__dplr_intra_x(ctx, q, k, a, b, l->Gi, l->Ge, opts, share, &l->Aqk, &l->Aqb, &l->Aak,
                              &l->Tab);
    if (st == DG_OK)
        st = dg__dplr_wy_x(ctx, q, k, v, a, b, l->Gi, l->Ge, l->Aak, l->Tab, opts, share, &l->w,
                           &l->u, &l->qg, &l->kg, &l->bg);
    if (st != DG_OK)
        dg__dplr_local_free(l);
    return st;
}

dg_status dg__dplr_local_group(const kda_cfg *cfg, dg_tensor *q, dg_tensor *k, dg_tensor *v,
                               dg_tensor *a, dg_tensor *b, const dplr_local *l, dg_tensor *h0,
                               dg__group **grp) {
    DG_TRY(dg__dplr_group_new(cfg, grp));
    dg_tensor *in[DPLR_NINPUTS] = {q, k, v, a, b, l->Gi, l->Ge, l->Aak, l->Tab, h0};
    for (int i = 0; i < DPLR_NINPUTS; i++)
        dg__group_set_input(*grp, i, in[i]);
    dg_tensor *made[5] = {l->w, l->u, l->qg, l->kg, l->bg}; /* DPLR_W .. DPLR_BG */
    for (int i = 0; i < 5; i++)
        dg__group_offer(*grp, DPLR_W + i, made[i]);
    return DG_OK;
}

void dg__dplr_local_free(dplr_local *l) {
    dg_tensor **t[11] = {&l->Gi, &l->Ge, &l->Aqk, &l->Aqb, &l->Aak, &l->Tab,
                         &l->w,  &l->u,  &l->qg,  &l->kg,  &l->bg};
    for (int i = 0; i < 11; i++)
        dg_tensor_free(t[i]);
}

#define OP "dg_dplr_chunk"

dg_status dg_dplr_chunk(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
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

    dplr_local l;
    dg_tensor *h = NULL, *v2 = NULL;
    dg__group *grp = NULL;
    dg_status st = dg__dplr_local_stages(ctx, q, k, v, a, b, gk, opts, cfg.dev, &l);
    if (st == DG_OK)
        st = dg__dplr_local_group(&cfg, q, k, v, a, b, &l, h0, &grp);
    if (st == DG_OK)
        st = dg__dplr_state_x(ctx, l.w, l.u, l.kg, l.bg, v, l.Gi, h0, opts, grp, &h, &v2,
                              want_ht ? ht : NULL);
    if (st == DG_OK)
        st = dg__dplr_output_x(ctx, l.qg, h, l.Aqk, l.Aqb, v, v2, opts, grp, o);

    dg__group_release(&grp);
    dg__dplr_local_free(&l);
    dg_tensor_free(&h);
    dg_tensor_free(&v2);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK && ht)
        dg_tensor_free(ht);
    return st;
}

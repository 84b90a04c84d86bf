/*
 * ops/dplr/dplr_common.c -- option resolution and argument checks shared by the DPLR entry
 * points, and the params block of a DPLR tape node. The sequence/chunk tables are KDA's
 * (dg__kda_cfg_init, dg__kda_cfg_dev), with DPLR's default chunk size 16.
 */
#include "dplr.h"

dg_status dg__dplr_cfg_init(const char *op, dg_ctx *ctx, const dg_dplr_opts *opts, int64_t B,
                            int64_t T, int H, int K, int V, dg_dtype dt, kda_cfg *cfg) {
    static const dg_dplr_opts defaults;
    memset(cfg, 0, sizeof *cfg);
    if (!opts)
        opts = &defaults;
    const int BT = opts->chunk_size ? opts->chunk_size : 64;
    if (BT != 16 && BT != 32 && BT != 64)
        return dg__err(DG_ERR_ARG,
                       "%s: opts->chunk_size must be 16, 32 or 64 (0 selects 64), got %d", op,
                       opts->chunk_size);
    if (ctx->device.kind == DG_DEV_CUDA && K > 256)
        return dg__err(DG_ERR_UNSUPPORTED, "%s: the CUDA DPLR kernels need K <= 256, got K=%d", op,
                       K);
    dg_kda_opts ko;
    memset(&ko, 0, sizeof ko);
    ko.chunk_size = BT;
    ko.gate = DG_GATE_NONE;
    ko.scale = opts->scale;
    ko.output_final_state = opts->output_final_state;
    ko.cu_seqlens = opts->cu_seqlens;
    ko.n_seqs = opts->n_seqs;
    DG_TRY(dg__kda_cfg_init(op, ctx, &ko, B, T, H, H, K, V, dt, cfg));
    cfg->tc = 0; /* one mode: f32 FFMA */
    return DG_OK;
}

dg_status dg__dplr_cfg_dev(const char *op, dg_ctx *ctx, kda_cfg *cfg, kda_dev *share) {
    cfg->tc = 0;
    DG_TRY(dg__kda_cfg_dev(op, ctx, cfg, share));
    cfg->cd.tc = 0;
    cfg->cd.mid = 0;
    cfg->mid = cfg->dt;
    return DG_OK;
}

dg_status dg__dplr_check_inputs(const char *op, dg_ctx *ctx, dg_tensor *q, dg_tensor *k,
                                dg_tensor *v, dg_tensor *a, dg_tensor *b, dg_tensor *gk,
                                dg_tensor *h0, const dg_dplr_opts *opts, kda_cfg *cfg) {
    memset(cfg, 0, sizeof *cfg);
    DG_TRY(dg__kda_check_first(op, "q", q, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(op, "v", v, ctx, 4, "B,T,H,V"));
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    const int64_t V = v->shape[3];
    DG_TRY(dg__dplr_cfg_init(op, ctx, opts, B, T, (int)H, (int)K, (int)V, q->dtype, cfg));
    const unsigned m = dplr_leaf_mask(cfg, q);
    int64_t sq[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, s0[4] = {cfg->d.N, H, K, V};
    dg_status st = dg__kda_check(op, "k", k, ctx, m, 4, sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(op, "v", v, ctx, m, 4, sv, "B,T,H,V");
    if (st == DG_OK)
        st = dg__kda_check(op, "a", a, ctx, m, 4, sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(op, "b", b, ctx, m, 4, sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(op, "gk", gk, ctx, m, 4, sq, "B,T,H,K");
    if (st == DG_OK && h0)
        st = dg__kda_check(op, "h0", h0, ctx, cfg->m_f, 4, s0, "N,H,K,V");
    if (st == DG_OK)
        st = dg__dplr_cfg_dev(op, ctx, cfg, NULL);
    if (st != DG_OK)
        dg__kda_cfg_free(cfg);
    return st;
}

static void np_free(void *params) {
    dplr_np *np = (dplr_np *)params;
    dg__group_release(&np->grp);
    dg__kda_dev_release(&np->cfg.dev);
}

dplr_np *dg__dplr_np_new(dg_node *n, const kda_cfg *cfg, dg__group *grp) {
    const size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    dplr_np *np = (dplr_np *)dg__node_params(n, sizeof(dplr_np) + ntab * sizeof(int64_t));
    if (!np)
        return NULL;
    dg__kda_cfg_copy(&np->cfg, cfg, np->tab);
    np->grp = dg__group_retain(grp);
    n->params_free = np_free;
    return np;
}

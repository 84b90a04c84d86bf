/*
 * ops/dplr/gate_cumsum.c -- dg_dplr_gate_cumsum: the chunk-local cumulative log decays of
 * dplr.md D3 as one tape node. Per chunk, per head and key channel:
 *   Gi_i = sum_{r<=i} gk_r (inclusive),  Ge_i = Gi_i - gk_i = sum_{r<i} gk_r (exclusive)
 * Backward (linear): dgk_i = sum_{r>=i} dGi_r + sum_{r>i} dGe_r within the chunk. The node keeps
 * a reference to gk (for the floor below) under either policy. CPU: f64, or f32 computed in f32.
 * CUDA (kernels/dplr/gate.cu): gk f32 or bf16, read as stored; Gi, Ge f32; dgk in gk's dtype.
 *
 * Decay of (nearly) zero: gk is floored at DPLR_G_FLOOR (-128) before the cumsum, as KDA's gate
 * does (ops/kda/gate_cumsum.c). A step with gk = -inf wipes the decayed part of the state in the
 * recurrence; in the chunked form the differences Gi_i - Gi_j after that step would be
 * -inf - (-inf) = NaN. exp(-128) ~ 2.6e-56 is far below f64 resolution relative to the state (0 in
 * f32), so the floored chunked form equals the recurrence; the gradient through a floored gk is
 * 0, which is what the recurrence gives there (exp(gk) = 0).
 */
#ifndef DG_REF_TMPL
#include "dplr.h"
#define DG_REF_TMPL "dplr/gate_cumsum.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
#ifndef DPLR_G_FLOOR
#define DPLR_G_FLOOR (-128)
#endif

void RF(dg__dplr_cumsum_fwd)(const kda_dims *d, const RT *gk, RT *Gi, RT *Ge) {
    const int64_t HK = (int64_t)d->H * d->K, NC = d->chunk_off[d->N];
    KDA_OMP(parallel for schedule(static) if (NC > 1))
    for (int64_t c = 0; c < NC; c++) {
        const kda_chunk ch = kda_chunk_idx(d, c);
        for (int64_t j = 0; j < HK; j++) {
            RT acc = 0;
            for (int i = 0; i < ch.L; i++) {
                const int64_t x = (ch.t0 + i) * HK + j;
                Ge[x] = acc;
                acc += gk[x] < (RT)DPLR_G_FLOOR ? (RT)DPLR_G_FLOOR : gk[x]; /* NaN stays NaN */
                Gi[x] = acc;
            }
        }
    }
}

void RF(dg__dplr_cumsum_bwd)(const kda_dims *d, const RT *gk, const RT *dGi, const RT *dGe,
                             RT *dgk) {
    const int64_t HK = (int64_t)d->H * d->K, NC = d->chunk_off[d->N];
    KDA_OMP(parallel for schedule(static) if (NC > 1))
    for (int64_t c = 0; c < NC; c++) {
        const kda_chunk ch = kda_chunk_idx(d, c);
        for (int64_t j = 0; j < HK; j++) {
            RT acc = 0; /* sum_{r>=i} dGi_r + sum_{r>i} dGe_r */
            for (int i = ch.L - 1; i >= 0; i--) {
                const int64_t x = (ch.t0 + i) * HK + j;
                acc += dGi ? dGi[x] : 0;
                dgk[x] = gk[x] < (RT)DPLR_G_FLOOR ? (RT)0 : acc;
                acc += dGe ? dGe[x] : 0;
            }
        }
    }
}
#else

#define OP "dg_dplr_gate_cumsum"

static dg_status cumsum_backward(dg_ctx *ctx, dg_node *n) {
    const kda_np *np = (const kda_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *gI = dg__node_grad_out(n, 0), *gE = dg__node_grad_out(n, 1);
    if ((!gI && !gE) || !dg__node_wants_grad(n, 0))
        return DG_OK;
    const dg_tensor *gk = n->saved[0];
    const int bf16 = dplr_bf16(c, gk);
    dg_tensor *tmp[3] = {0}, *dgk = NULL;
    const void *p[3] = {0};
    dg_status st = dg__kda_ptr(ctx, gk, dplr_leaf_dt(c, bf16), &tmp[2], &p[2]);
    if (st == DG_OK && gI)
        st = dg__kda_ptr(ctx, gI, c->dt, &tmp[0], &p[0]);
    if (st == DG_OK && gE)
        st = dg__kda_ptr(ctx, gE, c->dt, &tmp[1], &p[1]);
    int64_t s[4] = {c->d.B, c->d.T, c->d.H, c->d.K};
    if (st == DG_OK) /* in gk's dtype */
        st = dg_tensor_new(ctx, dplr_leaf_dt(c, bf16), 4, s, &dgk);
    if (st == DG_OK)
        st = dplr_run_cumsum_bwd(ctx, c, bf16, p[2], p[0], p[1], dg_tensor_data(dgk));
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, dgk);
    for (int i = 0; i < 3; i++)
        dg_tensor_free(&tmp[i]);
    dg_tensor_free(&dgk);
    return st;
}

dg_status dg__dplr_gate_cumsum_x(dg_ctx *ctx, dg_tensor *gk, const dg_dplr_opts *opts,
                                 kda_dev *share, dg_tensor **Gi, dg_tensor **Ge) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "Gi", Gi));
    DG_TRY(dg__check_ptr(OP, "Ge", Ge));
    *Gi = *Ge = NULL;
    DG_TRY(dg__kda_check_first(OP, "gk", gk, ctx, 4, "B,T,H,K"));
    kda_cfg cfg;
    DG_TRY(dg__dplr_cfg_init(OP, ctx, opts, gk->shape[0], gk->shape[1], (int)gk->shape[2],
                             (int)gk->shape[3], 1, gk->dtype, &cfg));
    const int bf16 = dplr_bf16(&cfg, gk);
    dg_tensor *tmp = NULL;
    const void *p = NULL;
    dg_status st = dg__dplr_cfg_dev(OP, ctx, &cfg, share);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, gk, dplr_leaf_dt(&cfg, bf16), &tmp, &p);
    if (st == DG_OK) /* Gi, Ge: the compute dtype whatever gk's */
        st = dg__kda_new(ctx, &cfg, 4, gk->shape, Gi);
    if (st == DG_OK)
        st = dg__kda_new(ctx, &cfg, 4, gk->shape, Ge);
    if (st == DG_OK)
        st = dplr_run_cumsum_fwd(ctx, &cfg, bf16, p, dg_tensor_data(*Gi), dg_tensor_data(*Ge));
    if (st == DG_OK && dg__needs_grad(1, &gk)) {
        dg_node *n = NULL;
        st = dg__node_new("dplr_gate_cumsum", DG_POLICY_CACHE, cumsum_backward, ctx, &n);
        if (st == DG_OK)
            dg__node_input(n, gk);
        if (st == DG_OK)
            st = dg__node_output(n, *Gi);
        if (st == DG_OK)
            st = dg__node_output(n, *Ge);
        if (st == DG_OK)
            dg__node_save(n, gk);
        if (st == DG_OK && !dg__kda_np_new(n, &cfg, NULL))
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }
    dg_tensor_free(&tmp);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK) {
        dg_tensor_free(Gi);
        dg_tensor_free(Ge);
    }
    return st;
}

dg_status dg_dplr_gate_cumsum(dg_ctx *ctx, dg_tensor *gk, const dg_dplr_opts *opts, dg_tensor **Gi,
                              dg_tensor **Ge) {
    return dg__dplr_gate_cumsum_x(ctx, gk, opts, NULL, Gi, Ge);
}
#endif

/*
 * ops/dplr/dplr.h -- internal declarations shared by the DPLR stage files: the raw-array
 * reference functions (f64 and f32), their dispatch to the CUDA twins (kernels/dplr/dplr_cuda.h)
 * or the reference by dtype (dplr_run_*), the argument checks of the public entry points and the
 * recompute group.
 *
 * The equations: docs/dplr.md D1-D5 (the D numbers below refer to it). DPLR reuses KDA's sizes and
 * sequence/chunk tables (kda_dims, kda_cfg with HV = H: DPLR has no GVA) and KDA's helpers for
 * pointers and node params (ops/kda/kda.h).
 *
 * Layouts of the raw arrays (contiguous, row-major; token = flat index b*T + t, TT = B*T):
 *   q, k, a, b, gk          [TT, H, K]
 *   v, o                    [TT, H, V]
 *   h0, ht                  [N, H, K, V]
 * Gradient outputs of the raw backward functions are OVERWRITTEN (never accumulated into).
 */
#ifndef DG_OPS_DPLR_H
#define DG_OPS_DPLR_H

#include "../../kernels/dplr/dplr_cuda.h"
#include "../kda/kda.h"

#define DPLR_DECLARE_RAW(RT, SFX)                                                                  \
    /* D1 token by token: p = S^T a_t; S = Diag(exp(gk_t)) S + b_t p^T + k_t v_t^T;                \
     * o_t = s S^T q_t. h0 NULL means zero; ht optional. */                                        \
    dg_status dg__dplr_recurrent_fwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,  \
                                           const RT *v, const RT *a, const RT *b, const RT *gk,    \
                                           const RT *h0, RT *o, RT *ht);                           \
    /* Backward through time (states recomputed from checkpoints every DPLR_REC_SEG tokens).       \
     * dO, dht optional (zero); dh0 optional. */                                                   \
    dg_status dg__dplr_recurrent_bwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,  \
                                           const RT *v, const RT *a, const RT *b, const RT *gk,    \
                                           const RT *h0, const RT *dO, const RT *dht, RT *dq,      \
                                           RT *dk, RT *dv, RT *da, RT *db, RT *dgk, RT *dh0);      \
    /* D3: chunk-local inclusive (Gi) and exclusive (Ge) cumsums of gk, all [TT,H,K]; gk floored   \
     * at -128 (a decay of exp(-128) ~ 0, see gate_cumsum.c). */                                   \
    void dg__dplr_cumsum_fwd_##SFX(const kda_dims *d, const RT *gk, RT *Gi, RT *Ge);               \
    /* dgk_i = sum_{r>=i} dGi_r + sum_{r>i} dGe_r per chunk (0 where gk is below the floor);       \
     * dGi, dGe optional (zero). */                                                                \
    void dg__dplr_cumsum_bwd_##SFX(const kda_dims *d, const RT *gk, const RT *dGi, const RT *dGe,  \
                                   RT *dgk);                                                       \
    /* D3 intra: Aqk, Aqb (s-scaled, j <= i), Aak (j < i) and Tab = (I - Aab)^{-1}, all            \
     * [TT,H,BT]; entries outside the read triangle are written as zero (Tab: 1 on the             \
     * diagonal). Exponents Gi_i - Gi_j (j <= i) and Ge_i - Gi_j (j < i) are never positive. */    \
    dg_status dg__dplr_intra_fwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,      \
                                       const RT *a, const RT *b, const RT *Gi, const RT *Ge,       \
                                       RT *Aqk, RT *Aqb, RT *Aak, RT *Tab);                        \
    /* D4 steps 5-7 from dAqk, dAqb, dAak, dTab (each optional; only the triangles the forward     \
     * writes are read, dTab strictly below the diagonal): dq, dk, da, db, dGi, dGe [TT,H,K]. */   \
    dg_status dg__dplr_intra_bwd_##SFX(                                                            \
        const kda_dims *d, RT scale, const RT *q, const RT *k, const RT *a, const RT *b,           \
        const RT *Gi, const RT *Ge, const RT *Tab, const RT *dAqk, const RT *dAqb, const RT *dAak, \
        const RT *dTab, RT *dq, RT *dk, RT *da, RT *db, RT *dGi, RT *dGe);                         \
    /* D3 WY: w = Tab ag, u = Tab Aak v with ag = a exp(Ge); qg = s q exp(Gi),                     \
     * kg = k exp(lam - Gi), bg = b exp(lam - Gi), lam = Gi at the chunk's last row. Any           \
     * output may be NULL (skipped). */                                                            \
    dg_status dg__dplr_wy_fwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,         \
                                    const RT *v, const RT *a, const RT *b, const RT *Gi,           \
                                    const RT *Ge, const RT *Aak, const RT *Tab, RT *w, RT *u,      \
                                    RT *qg, RT *kg, RT *bg);                                       \
    /* Backward of dplr_wy_fwd; dw, du, dqg, dkg, dbg each optional. dAak, dTab [TT,H,BT]. */      \
    dg_status dg__dplr_wy_bwd_##SFX(                                                               \
        const kda_dims *d, RT scale, const RT *q, const RT *k, const RT *v, const RT *a,           \
        const RT *b, const RT *Gi, const RT *Ge, const RT *Aak, const RT *Tab, const RT *dw,       \
        const RT *du, const RT *dqg, const RT *dkg, const RT *dbg, RT *dq, RT *dk, RT *dv, RT *da, \
        RT *db, RT *dGi, RT *dGe, RT *dAak, RT *dTab);                                             \
    /* D3 state pass, sequential over the chunks of each sequence: h [NC,H,K,V] at chunk starts,   \
     * v2 = w h + u, h <- Diag(exp(lam)) h + kg^T v + bg^T v2. h0 NULL = zero; ht optional. */     \
    dg_status dg__dplr_state_fwd_##SFX(const kda_dims *d, const RT *w, const RT *u, const RT *kg,  \
                                       const RT *bg, const RT *v, const RT *Gi, const RT *h0,      \
                                       RT *h, RT *v2, RT *ht);                                     \
    /* D4 steps 2-4, the reverse pass. Upstream dh [NC,H,K,V], dv2, dht each optional; dh0         \
     * optional. dGi is non-zero only at the last row of each chunk (the gradient of lam). */      \
    dg_status dg__dplr_state_bwd_##SFX(const kda_dims *d, const RT *w, const RT *kg, const RT *bg, \
                                       const RT *v, const RT *Gi, const RT *h, const RT *v2,       \
                                       const RT *dh, const RT *dv2, const RT *dht, RT *dw, RT *du, \
                                       RT *dkg, RT *dbg, RT *dv, RT *dGi, RT *dh0);                \
    /* D3 output: o = qg h + Aqk v + Aqb v2 (Aqk, Aqb read for j <= i). */                         \
    void dg__dplr_output_fwd_##SFX(const kda_dims *d, const RT *qg, const RT *h, const RT *Aqk,    \
                                   const RT *Aqb, const RT *v, const RT *v2, RT *o);               \
    /* D4 step 1: dqg = dO h^T, dh = qg^T dO, dAqk = tril(dO v^T), dAqb = tril(dO v2^T),           \
     * dv = Aqk^T dO, dv2 = Aqb^T dO. */                                                           \
    void dg__dplr_output_bwd_##SFX(const kda_dims *d, const RT *qg, const RT *h, const RT *Aqk,    \
                                   const RT *Aqb, const RT *v, const RT *v2, const RT *dO,         \
                                   RT *dqg, RT *dh, RT *dAqk, RT *dAqb, RT *dv, RT *dv2);

DPLR_DECLARE_RAW(double, f64)
DPLR_DECLARE_RAW(float, f32)

#define DPLR_REC_SEG 64 /* recurrent backward: tokens between stored state checkpoints */

/* ---- devices ---------------------------------------------------------------------------------
 * On CUDA every stage computes in f32 (kernels/dplr/dplr_cuda.h). The leaf activations q, k, v,
 * a, b, gk (and o, o's gradient) may be f32 or bf16: the kernels read a bf16 leaf as it is stored
 * (no converted copy), o is written in the leaves' dtype and gk's gradient in gk's; every
 * intermediate (Gi, Ge, Aqk, Aqb, Aak, Tab, w, u, qg, kg, bg, h, v2), h0, ht and the other
 * gradients are f32 (the tape adds an f32 gradient into a bf16 leaf's slot in bf16). The stages
 * of one dg_dplr_chunk call share one upload of the chunk tables (kda_dev). */

/* A leaf activation t on CUDA that the kernels read as bf16 (any other dtype: the compute
 * dtype). */
static inline int dplr_bf16(const kda_cfg *c, const dg_tensor *t) {
    return c->cuda && t && t->dtype == DG_BF16;
}
/* The dtype the kernels read the leaf activations of a call in. */
static inline dg_dtype dplr_leaf_dt(const kda_cfg *c, int bf16) { return bf16 ? DG_BF16 : c->dt; }
/* Dtypes accepted for the leaf activations of a stage whose first one is `first` (checked with
 * dg__kda_check_first): that one's dtype on CUDA, the compute dtype on the CPU (where every
 * input of a stage has one dtype). */
static inline unsigned dplr_leaf_mask(const kda_cfg *c, const dg_tensor *first) {
    return c->cuda ? DG_MASK(first->dtype) : c->m_f;
}

/* ---- dispatch: dplr_run_<fn> calls the CUDA twin dg__dplr_<fn>_cuda(ctx, &c->cd, ...) when the
 * cfg is on CUDA (builds without CUDA never get there: dg__no_cuda), else <fn>_f64 or <fn>_f32
 * by c->dt with &c->d (and c->scale where the function takes a scale). Arrays are passed as
 * void pointers: the leaf activations in dplr_leaf_dt(c, bf16), everything else in the compute
 * dtype. bf16 is 0 on the CPU. Every dplr_run_<fn> returns a dg_status (DG_OK after a CPU
 * function that returns void). */
#ifdef DG_HAVE_CUDA
#define DPLR_CUDA(c, call)                                                                         \
    do {                                                                                           \
        if ((c)->cuda)                                                                             \
            return call;                                                                           \
    } while (0)
#else
#define DPLR_CUDA(c, call) ((void)0)
#endif

static inline dg_status dplr_run_recurrent_fwd(dg_ctx *ctx, const kda_cfg *c, int bf16,
                                               const void *q, const void *k, const void *v,
                                               const void *a, const void *b, const void *gk,
                                               const void *h0, void *o, void *ht) {
    DPLR_CUDA(c, dg__dplr_recurrent_fwd_cuda(ctx, &c->cd, (float)c->scale, bf16, q, k, v, a, b, gk,
                                             h0, o, ht));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_recurrent_fwd_f64(&c->d, c->scale, q, k, v, a, b, gk, h0, o, ht);
    return dg__dplr_recurrent_fwd_f32(&c->d, (float)c->scale, q, k, v, a, b, gk, h0, o, ht);
}
static inline dg_status dplr_run_recurrent_bwd(dg_ctx *ctx, const kda_cfg *c, int bf16,
                                               const void *q, const void *k, const void *v,
                                               const void *a, const void *b, const void *gk,
                                               const void *h0, const void *dO, const void *dht,
                                               void *dq, void *dk, void *dv, void *da, void *db,
                                               void *dgk, void *dh0) {
    DPLR_CUDA(c, dg__dplr_recurrent_bwd_cuda(ctx, &c->cd, (float)c->scale, bf16, q, k, v, a, b, gk,
                                             h0, dO, dht, dq, dk, dv, da, db, dgk, dh0));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_recurrent_bwd_f64(&c->d, c->scale, q, k, v, a, b, gk, h0, dO, dht, dq, dk,
                                          dv, da, db, dgk, dh0);
    return dg__dplr_recurrent_bwd_f32(&c->d, (float)c->scale, q, k, v, a, b, gk, h0, dO, dht, dq,
                                      dk, dv, da, db, dgk, dh0);
}
static inline dg_status dplr_run_cumsum_fwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *gk,
                                            void *Gi, void *Ge) {
    DPLR_CUDA(c, dg__dplr_cumsum_fwd_cuda(ctx, &c->cd, bf16, gk, Gi, Ge));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        dg__dplr_cumsum_fwd_f64(&c->d, gk, Gi, Ge);
    else
        dg__dplr_cumsum_fwd_f32(&c->d, gk, Gi, Ge);
    return DG_OK;
}
/* dgk has gk's dtype (the leaf dtype). */
static inline dg_status dplr_run_cumsum_bwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *gk,
                                            const void *dGi, const void *dGe, void *dgk) {
    DPLR_CUDA(c, dg__dplr_cumsum_bwd_cuda(ctx, &c->cd, bf16, gk, dGi, dGe, dgk));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        dg__dplr_cumsum_bwd_f64(&c->d, gk, dGi, dGe, dgk);
    else
        dg__dplr_cumsum_bwd_f32(&c->d, gk, dGi, dGe, dgk);
    return DG_OK;
}
static inline dg_status dplr_run_intra_fwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *q,
                                           const void *k, const void *a, const void *b,
                                           const void *Gi, const void *Ge, void *Aqk, void *Aqb,
                                           void *Aak, void *Tab) {
    DPLR_CUDA(c, dg__dplr_intra_fwd_cuda(ctx, &c->cd, (float)c->scale, bf16, q, k, a, b, Gi, Ge,
                                         Aqk, Aqb, Aak, Tab));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_intra_fwd_f64(&c->d, c->scale, q, k, a, b, Gi, Ge, Aqk, Aqb, Aak, Tab);
    return dg__dplr_intra_fwd_f32(&c->d, (float)c->scale, q, k, a, b, Gi, Ge, Aqk, Aqb, Aak, Tab);
}
static inline dg_status dplr_run_intra_bwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *q,
                                           const void *k, const void *a, const void *b,
                                           const void *Gi, const void *Ge, const void *Tab,
                                           const void *dAqk, const void *dAqb, const void *dAak,
                                           const void *dTab, void *dq, void *dk, void *da, void *db,
                                           void *dGi, void *dGe) {
    DPLR_CUDA(c, dg__dplr_intra_bwd_cuda(ctx, &c->cd, (float)c->scale, bf16, q, k, a, b, Gi, Ge,
                                         Tab, dAqk, dAqb, dAak, dTab, dq, dk, da, db, dGi, dGe));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_intra_bwd_f64(&c->d, c->scale, q, k, a, b, Gi, Ge, Tab, dAqk, dAqb, dAak,
                                      dTab, dq, dk, da, db, dGi, dGe);
    return dg__dplr_intra_bwd_f32(&c->d, (float)c->scale, q, k, a, b, Gi, Ge, Tab, dAqk, dAqb, dAak,
                                  dTab, dq, dk, da, db, dGi, dGe);
}
static inline dg_status dplr_run_wy_fwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *q,
                                        const void *k, const void *v, const void *a, const void *b,
                                        const void *Gi, const void *Ge, const void *Aak,
                                        const void *Tab, void *w, void *u, void *qg, void *kg,
                                        void *bg) {
    DPLR_CUDA(c, dg__dplr_wy_fwd_cuda(ctx, &c->cd, (float)c->scale, bf16, q, k, v, a, b, Gi, Ge,
                                      Aak, Tab, w, u, qg, kg, bg));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_wy_fwd_f64(&c->d, c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, w, u, qg, kg,
                                   bg);
    return dg__dplr_wy_fwd_f32(&c->d, (float)c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, w, u, qg,
                               kg, bg);
}
static inline dg_status dplr_run_wy_bwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *q,
                                        const void *k, const void *v, const void *a, const void *b,
                                        const void *Gi, const void *Ge, const void *Aak,
                                        const void *Tab, const void *dw, const void *du,
                                        const void *dqg, const void *dkg, const void *dbg, void *dq,
                                        void *dk, void *dv, void *da, void *db, void *dGi,
                                        void *dGe, void *dAak, void *dTab) {
    DPLR_CUDA(c, dg__dplr_wy_bwd_cuda(ctx, &c->cd, (float)c->scale, bf16, q, k, v, a, b, Gi, Ge,
                                      Aak, Tab, dw, du, dqg, dkg, dbg, dq, dk, dv, da, db, dGi, dGe,
                                      dAak, dTab));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_wy_bwd_f64(&c->d, c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, dw, du, dqg,
                                   dkg, dbg, dq, dk, dv, da, db, dGi, dGe, dAak, dTab);
    return dg__dplr_wy_bwd_f32(&c->d, (float)c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, dw, du, dqg,
                               dkg, dbg, dq, dk, dv, da, db, dGi, dGe, dAak, dTab);
}
/* v in the leaf dtype. */
static inline dg_status dplr_run_state_fwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *w,
                                           const void *u, const void *kg, const void *bg,
                                           const void *v, const void *Gi, const void *h0, void *h,
                                           void *v2, void *ht) {
    DPLR_CUDA(c, dg__dplr_state_fwd_cuda(ctx, &c->cd, bf16, w, u, kg, bg, v, Gi, h0, h, v2, ht));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_state_fwd_f64(&c->d, w, u, kg, bg, v, Gi, h0, h, v2, ht);
    return dg__dplr_state_fwd_f32(&c->d, w, u, kg, bg, v, Gi, h0, h, v2, ht);
}
static inline dg_status dplr_run_state_bwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *w,
                                           const void *kg, const void *bg, const void *v,
                                           const void *Gi, const void *h, const void *v2,
                                           const void *dh, const void *dv2, const void *dht,
                                           void *dw, void *du, void *dkg, void *dbg, void *dv,
                                           void *dGi, void *dh0) {
    DPLR_CUDA(c, dg__dplr_state_bwd_cuda(ctx, &c->cd, bf16, w, kg, bg, v, Gi, h, v2, dh, dv2, dht,
                                         dw, du, dkg, dbg, dv, dGi, dh0));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        return dg__dplr_state_bwd_f64(&c->d, w, kg, bg, v, Gi, h, v2, dh, dv2, dht, dw, du, dkg,
                                      dbg, dv, dGi, dh0);
    return dg__dplr_state_bwd_f32(&c->d, w, kg, bg, v, Gi, h, v2, dh, dv2, dht, dw, du, dkg, dbg,
                                  dv, dGi, dh0);
}
/* v, o and dO in the leaf dtype. */
static inline dg_status dplr_run_output_fwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *qg,
                                            const void *h, const void *Aqk, const void *Aqb,
                                            const void *v, const void *v2, void *o) {
    DPLR_CUDA(c, dg__dplr_output_fwd_cuda(ctx, &c->cd, bf16, qg, h, Aqk, Aqb, v, v2, o));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        dg__dplr_output_fwd_f64(&c->d, qg, h, Aqk, Aqb, v, v2, o);
    else
        dg__dplr_output_fwd_f32(&c->d, qg, h, Aqk, Aqb, v, v2, o);
    return DG_OK;
}
static inline dg_status dplr_run_output_bwd(dg_ctx *ctx, const kda_cfg *c, int bf16, const void *qg,
                                            const void *h, const void *Aqk, const void *Aqb,
                                            const void *v, const void *v2, const void *dO,
                                            void *dqg, void *dh, void *dAqk, void *dAqb, void *dv,
                                            void *dv2) {
    DPLR_CUDA(c, dg__dplr_output_bwd_cuda(ctx, &c->cd, bf16, qg, h, Aqk, Aqb, v, v2, dO, dqg, dh,
                                          dAqk, dAqb, dv, dv2));
    (void)ctx;
    (void)bf16;
    if (c->dt == DG_F64)
        dg__dplr_output_bwd_f64(&c->d, qg, h, Aqk, Aqb, v, v2, dO, dqg, dh, dAqk, dAqb, dv, dv2);
    else
        dg__dplr_output_bwd_f32(&c->d, qg, h, Aqk, Aqb, v, v2, dO, dqg, dh, dAqk, dAqb, dv, dv2);
    return DG_OK;
}

/* The arguments of dg_dplr_chunk / dg_dplr_recurrent: q fixes B, T, H, K and the dtype (CPU: f64
 * or f32; CUDA: f32 or bf16), v fixes V; k, a, b, gk must be [B,T,H,K], v [B,T,H,V], all of q's
 * dtype; h0 (optional) [N,H,K,V] of the compute dtype (q's on the CPU, f32 on CUDA). Fills cfg
 * and, on CUDA, uploads the chunk tables (free with dg__kda_cfg_free). */
dg_status dg__dplr_check_inputs(const char *op, dg_ctx *ctx, dg_tensor *q, dg_tensor *k,
                                dg_tensor *v, dg_tensor *a, dg_tensor *b, dg_tensor *gk,
                                dg_tensor *h0, const dg_dplr_opts *opts, kda_cfg *cfg);
/* Options only (chunk size, scale, cu_seqlens), for the stage entry points: B, T, H, K, V from
 * the caller; dt is the dtype of the stage's first input. */
dg_status dg__dplr_cfg_init(const char *op, dg_ctx *ctx, const dg_dplr_opts *opts, int64_t B,
                            int64_t T, int H, int K, int V, dg_dtype dt, kda_cfg *cfg);
/* CUDA only (a no-op on the CPU): the device chunk tables, shared with `share` when it is not
 * NULL (the stages of one dg_dplr_chunk call), else uploaded; the DPLR kernels have one mode
 * (f32 FFMA, f32 intermediates), so tc and mid stay 0. */
dg_status dg__dplr_cfg_dev(const char *op, dg_ctx *ctx, kda_cfg *cfg, kda_dev *share);

/* ---- the recompute group and node parameters ----------------------------------------------
 * The state and output nodes of one dg_dplr_chunk call read w, u, qg, kg, bg, h, v2 through one
 * recompute group (dplr_group.c: the table of what is kept and what is rebuilt), and so does the
 * link node of dg_dplr_chunk_cp (member DPLR_M_LINK, ops/dplr/kcp.c); used alone, dg_dplr_state
 * and dg_dplr_output make their own with their inputs kept. */
enum { DPLR_M_STATE, DPLR_M_LINK, DPLR_M_OUTPUT, DPLR_NMEMBERS };
enum {
    DPLR_IN_Q,
    DPLR_IN_K,
    DPLR_IN_V,
    DPLR_IN_A,
    DPLR_IN_B,
    DPLR_IN_GI,
    DPLR_IN_GE,
    DPLR_IN_AAK,
    DPLR_IN_TAB,
    DPLR_IN_H0,
    DPLR_NINPUTS
};
enum { DPLR_W, DPLR_U, DPLR_QG, DPLR_KG, DPLR_BG, DPLR_H, DPLR_V2, DPLR_NDERIVED };

/* A group for an op call with cfg (tables copied, device tables shared). */
dg_status dg__dplr_group_new(const kda_cfg *cfg, dg__group **out);
/* The device tables of the group's cfg (NULL on the CPU). */
kda_dev *dg__dplr_group_dev(const dg__group *g);

/* Params block of the DPLR state and output nodes: the cfg (tables copied behind it, device
 * tables retained), an optional recompute group and a few node-specific flags. */
typedef struct dplr_np {
    kda_cfg cfg;
    dg__group *grp;
    int flags;
    int64_t tab[]; /* cfg.tab points here */
} dplr_np;
/* Allocate the params of n from cfg (tables copied); a non-NULL grp is retained and released
 * with the node. */
dplr_np *dg__dplr_np_new(dg_node *n, const kda_cfg *cfg, dg__group *grp);

/* ---- internal entry points used by the composite (the public ones pass share = grp = NULL):
 * share is the composite's device chunk tables, grp its recompute group ---- */
dg_status dg__dplr_gate_cumsum_x(dg_ctx *ctx, dg_tensor *gk, const dg_dplr_opts *opts,
                                 kda_dev *share, dg_tensor **Gi, dg_tensor **Ge);
dg_status dg__dplr_intra_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *a, dg_tensor *b,
                           dg_tensor *Gi, dg_tensor *Ge, const dg_dplr_opts *opts, kda_dev *share,
                           dg_tensor **Aqk, dg_tensor **Aqb, dg_tensor **Aak, dg_tensor **Tab);
dg_status dg__dplr_wy_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                        dg_tensor *b, dg_tensor *Gi, dg_tensor *Ge, dg_tensor *Aak, dg_tensor *Tab,
                        const dg_dplr_opts *opts, kda_dev *share, dg_tensor **w, dg_tensor **u,
                        dg_tensor **qg, dg_tensor **kg, dg_tensor **bg);
dg_status dg__dplr_state_x(dg_ctx *ctx, dg_tensor *w, dg_tensor *u, dg_tensor *kg, dg_tensor *bg,
                           dg_tensor *v, dg_tensor *Gi, dg_tensor *h0, const dg_dplr_opts *opts,
                           dg__group *grp, dg_tensor **h, dg_tensor **v2, dg_tensor **ht);
/* The local part of the chunked composite (ops/dplr/chunk.c), shared by dg_dplr_chunk and the
 * context-parallel dg_dplr_chunk_cp: the gate_cumsum, intra and wy stage nodes (on the device chunk
 * tables `share`, NULL: their own), their outputs
 * each an owned reference (dg__dplr_local_free releases them; on error nothing is held). */
typedef struct dplr_local {
    dg_tensor *Gi, *Ge, *Aqk, *Aqb, *Aak, *Tab, *w, *u, *qg, *kg, *bg;
} dplr_local;
dg_status dg__dplr_local_stages(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                                dg_tensor *b, dg_tensor *gk, const dg_dplr_opts *opts,
                                kda_dev *share, dplr_local *l);
/* The recompute group of the state/output (and CP link) nodes over l, from initial state h0:
 * its inputs, and w, u, qg, kg, bg offered to it (kept when the policy of "dplr_wy" is CACHE). */
dg_status dg__dplr_local_group(const kda_cfg *cfg, dg_tensor *q, dg_tensor *k, dg_tensor *v,
                               dg_tensor *a, dg_tensor *b, const dplr_local *l, dg_tensor *h0,
                               dg__group **grp);
void dg__dplr_local_free(dplr_local *l);
dg_status dg__dplr_output_x(dg_ctx *ctx, dg_tensor *qg, dg_tensor *h, dg_tensor *Aqk,
                            dg_tensor *Aqb, dg_tensor *v, dg_tensor *v2, const dg_dplr_opts *opts,
                            dg__group *grp, dg_tensor **o);

#endif /* DG_OPS_DPLR_H */

/*
 * ops/dplr/dplr.h -- internal declarations shared by the DPLR stage files: the raw-array
 * reference functions (f64 and f32), their dispatch by dtype (dplr_run_*), the argument checks
 * of the public entry points and the recompute group.
 *
 * Spec: shared/spec/DPLR.md (section numbers below refer to it). DPLR reuses KDA's sizes and
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

#include "../kda/kda.h"

#define DPLR_DECLARE_RAW(KT, SFX)                                                                  \
    /* §2 token by token: p = S^T a_t; S = Diag(exp(gk_t)) S + b_t p^T + k_t v_t^T;               \
     * o_t = s S^T q_t. h0 NULL means zero; ht optional. */                                        \
    dg_status dg__dplr_recurrent_fwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,      \
                                       const KT *v, const KT *a, const KT *b, const KT *gk,        \
                                       const KT *h0, KT *o, KT *ht);                               \
    /* Backward through time (states recomputed from checkpoints every DPLR_REC_SEG tokens).       \
     * dO, dht optional (zero); dh0 optional. */                                                   \
    dg_status dg__dplr_recurrent_bwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,      \
                                       const KT *v, const KT *a, const KT *b, const KT *gk,        \
                                       const KT *h0, const KT *dO, const KT *dht, KT *dq, KT *dk,  \
                                       KT *dv, KT *da, KT *db, KT *dgk, KT *dh0);                  \
    /* §4: chunk-local inclusive (Gi) and exclusive (Ge) cumsums of gk, all [TT,H,K]; gk floored  \
     * at -128 (a decay of exp(-128) ~ 0, see gate_cumsum.c). */                                   \
    void dg__dplr_cumsum_fwd_##SFX(const kda_dims *d, const KT *gk, KT *Gi, KT *Ge);                   \
    /* dgk_i = sum_{r>=i} dGi_r + sum_{r>i} dGe_r per chunk (0 where gk is below the floor);       \
     * dGi, dGe optional (zero). */                                                                \
    void dg__dplr_cumsum_bwd_##SFX(const kda_dims *d, const KT *gk, const KT *dGi, const KT *dGe,      \
                               KT *dgk);                                                           \
    /* §4 intra: Aqk, Aqb (s-scaled, j <= i), Aak (j < i) and Tab = (I - Aab)^{-1}, all           \
     * [TT,H,BT]; entries outside the read triangle are written as zero (Tab: 1 on the             \
     * diagonal). Exponents Gi_i - Gi_j (j <= i) and Ge_i - Gi_j (j < i) are never positive. */    \
    dg_status dg__dplr_intra_fwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,          \
                                   const KT *a, const KT *b, const KT *Gi, const KT *Ge, KT *Aqk,  \
                                   KT *Aqb, KT *Aak, KT *Tab);                                     \
    /* §5 steps 5-7 from dAqk, dAqb, dAak, dTab (each optional; only the triangles the forward    \
     * writes are read, dTab strictly below the diagonal): dq, dk, da, db, dGi, dGe [TT,H,K]. */   \
    dg_status dg__dplr_intra_bwd_##SFX(                                                                \
        const kda_dims *d, KT scale, const KT *q, const KT *k, const KT *a, const KT *b,           \
        const KT *Gi, const KT *Ge, const KT *Tab, const KT *dAqk, const KT *dAqb, const KT *dAak, \
        const KT *dTab, KT *dq, KT *dk, KT *da, KT *db, KT *dGi, KT *dGe);                         \
    /* §4 WY: w = Tab ag, u = Tab Aak v with ag = a exp(Ge); qg = s q exp(Gi),                    \
     * kg = k exp(lam - Gi), bg = b exp(lam - Gi), lam = Gi at the chunk's last row. Any           \
     * output may be NULL (skipped). */                                                            \
    dg_status dg__dplr_wy_fwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,             \
                                const KT *v, const KT *a, const KT *b, const KT *Gi, const KT *Ge, \
                                const KT *Aak, const KT *Tab, KT *w, KT *u, KT *qg, KT *kg,        \
                                KT *bg);                                                           \
    /* Backward of dplr_wy_fwd; dw, du, dqg, dkg, dbg each optional. dAak, dTab [TT,H,BT]. */      \
    dg_status dg__dplr_wy_bwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,             \
                                const KT *v, const KT *a, const KT *b, const KT *Gi, const KT *Ge, \
                                const KT *Aak, const KT *Tab, const KT *dw, const KT *du,          \
                                const KT *dqg, const KT *dkg, const KT *dbg, KT *dq, KT *dk,       \
                                KT *dv, KT *da, KT *db, KT *dGi, KT *dGe, KT *dAak, KT *dTab);     \
    /* §4 state pass, sequential over the chunks of each sequence: h [NC,H,K,V] at chunk starts,  \
     * v2 = w h + u, h <- Diag(exp(lam)) h + kg^T v + bg^T v2. h0 NULL = zero; ht optional. */     \
    dg_status dg__dplr_state_fwd_##SFX(const kda_dims *d, const KT *w, const KT *u, const KT *kg,      \
                                   const KT *bg, const KT *v, const KT *Gi, const KT *h0, KT *h,   \
                                   KT *v2, KT *ht);                                                \
    /* §5 steps 2-4, the reverse pass. Upstream dh [NC,H,K,V], dv2, dht each optional; dh0        \
     * optional. dGi is non-zero only at the last row of each chunk (the gradient of lam). */      \
    dg_status dg__dplr_state_bwd_##SFX(const kda_dims *d, const KT *w, const KT *kg, const KT *bg,     \
                                   const KT *v, const KT *Gi, const KT *h, const KT *v2,           \
                                   const KT *dh, const KT *dv2, const KT *dht, KT *dw, KT *du,     \
                                   KT *dkg, KT *dbg, KT *dv, KT *dGi, KT *dh0);                    \
    /* §4 output: o = qg h + Aqk v + Aqb v2 (Aqk, Aqb read for j <= i). */                        \
    void dg__dplr_output_fwd_##SFX(const kda_dims *d, const KT *qg, const KT *h, const KT *Aqk,        \
                               const KT *Aqb, const KT *v, const KT *v2, KT *o);                   \
    /* §5 step 1: dqg = dO h^T, dh = qg^T dO, dAqk = tril(dO v^T), dAqb = tril(dO v2^T),          \
     * dv = Aqk^T dO, dv2 = Aqb^T dO. */                                                           \
    void dg__dplr_output_bwd_##SFX(const kda_dims *d, const KT *qg, const KT *h, const KT *Aqk,        \
                               const KT *Aqb, const KT *v, const KT *v2, const KT *dO, KT *dqg,    \
                               KT *dh, KT *dAqk, KT *dAqb, KT *dv, KT *dv2);

DPLR_DECLARE_RAW(double, f64)
DPLR_DECLARE_RAW(float, f32)

#define DPLR_REC_SEG 64 /* recurrent backward: tokens between stored state checkpoints */

/* ---- dispatch: dplr_run_<fn> calls <fn>_f64 or <fn>_f32 by c->dt with &c->d (and c->scale
 * where the function takes a scale), arrays of the compute dtype passed as void pointers. It
 * returns a dg_status: DG_OK after a function that returns void. DPLR runs on the CPU only. */
static inline dg_status dplr_run_recurrent_fwd(const kda_cfg *c, const void *q, const void *k,
                                               const void *v, const void *a, const void *b,
                                               const void *gk, const void *h0, void *o, void *ht) {
    if (c->dt == DG_F64)
        return dg__dplr_recurrent_fwd_f64(&c->d, c->scale, q, k, v, a, b, gk, h0, o, ht);
    return dg__dplr_recurrent_fwd_f32(&c->d, (float)c->scale, q, k, v, a, b, gk, h0, o, ht);
}
static inline dg_status dplr_run_recurrent_bwd(const kda_cfg *c, const void *q, const void *k,
                                               const void *v, const void *a, const void *b,
                                               const void *gk, const void *h0, const void *dO,
                                               const void *dht, void *dq, void *dk, void *dv,
                                               void *da, void *db, void *dgk, void *dh0) {
    if (c->dt == DG_F64)
        return dg__dplr_recurrent_bwd_f64(&c->d, c->scale, q, k, v, a, b, gk, h0, dO, dht, dq, dk,
                                          dv, da, db, dgk, dh0);
    return dg__dplr_recurrent_bwd_f32(&c->d, (float)c->scale, q, k, v, a, b, gk, h0, dO, dht, dq,
                                      dk, dv, da, db, dgk, dh0);
}
static inline dg_status dplr_run_cumsum_fwd(const kda_cfg *c, const void *gk, void *Gi, void *Ge) {
    if (c->dt == DG_F64)
        dg__dplr_cumsum_fwd_f64(&c->d, gk, Gi, Ge);
    else
        dg__dplr_cumsum_fwd_f32(&c->d, gk, Gi, Ge);
    return DG_OK;
}
static inline dg_status dplr_run_cumsum_bwd(const kda_cfg *c, const void *gk, const void *dGi,
                                            const void *dGe, void *dgk) {
    if (c->dt == DG_F64)
        dg__dplr_cumsum_bwd_f64(&c->d, gk, dGi, dGe, dgk);
    else
        dg__dplr_cumsum_bwd_f32(&c->d, gk, dGi, dGe, dgk);
    return DG_OK;
}
static inline dg_status dplr_run_intra_fwd(const kda_cfg *c, const void *q, const void *k,
                                           const void *a, const void *b, const void *Gi,
                                           const void *Ge, void *Aqk, void *Aqb, void *Aak,
                                           void *Tab) {
    if (c->dt == DG_F64)
        return dg__dplr_intra_fwd_f64(&c->d, c->scale, q, k, a, b, Gi, Ge, Aqk, Aqb, Aak, Tab);
    return dg__dplr_intra_fwd_f32(&c->d, (float)c->scale, q, k, a, b, Gi, Ge, Aqk, Aqb, Aak, Tab);
}
static inline dg_status dplr_run_intra_bwd(const kda_cfg *c, const void *q, const void *k,
                                           const void *a, const void *b, const void *Gi,
                                           const void *Ge, const void *Tab, const void *dAqk,
                                           const void *dAqb, const void *dAak, const void *dTab,
                                           void *dq, void *dk, void *da, void *db, void *dGi,
                                           void *dGe) {
    if (c->dt == DG_F64)
        return dg__dplr_intra_bwd_f64(&c->d, c->scale, q, k, a, b, Gi, Ge, Tab, dAqk, dAqb, dAak,
                                      dTab, dq, dk, da, db, dGi, dGe);
    return dg__dplr_intra_bwd_f32(&c->d, (float)c->scale, q, k, a, b, Gi, Ge, Tab, dAqk, dAqb, dAak,
                                  dTab, dq, dk, da, db, dGi, dGe);
}
static inline dg_status dplr_run_wy_fwd(const kda_cfg *c, const void *q, const void *k,
                                        const void *v, const void *a, const void *b, const void *Gi,
                                        const void *Ge, const void *Aak, const void *Tab, void *w,
                                        void *u, void *qg, void *kg, void *bg) {
    if (c->dt == DG_F64)
        return dg__dplr_wy_fwd_f64(&c->d, c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, w, u, qg, kg,
                                   bg);
    return dg__dplr_wy_fwd_f32(&c->d, (float)c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, w, u, qg,
                               kg, bg);
}
static inline dg_status dplr_run_wy_bwd(const kda_cfg *c, const void *q, const void *k,
                                        const void *v, const void *a, const void *b, const void *Gi,
                                        const void *Ge, const void *Aak, const void *Tab,
                                        const void *dw, const void *du, const void *dqg,
                                        const void *dkg, const void *dbg, void *dq, void *dk,
                                        void *dv, void *da, void *db, void *dGi, void *dGe,
                                        void *dAak, void *dTab) {
    if (c->dt == DG_F64)
        return dg__dplr_wy_bwd_f64(&c->d, c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, dw, du, dqg,
                                   dkg, dbg, dq, dk, dv, da, db, dGi, dGe, dAak, dTab);
    return dg__dplr_wy_bwd_f32(&c->d, (float)c->scale, q, k, v, a, b, Gi, Ge, Aak, Tab, dw, du, dqg,
                               dkg, dbg, dq, dk, dv, da, db, dGi, dGe, dAak, dTab);
}
static inline dg_status dplr_run_state_fwd(const kda_cfg *c, const void *w, const void *u,
                                           const void *kg, const void *bg, const void *v,
                                           const void *Gi, const void *h0, void *h, void *v2,
                                           void *ht) {
    if (c->dt == DG_F64)
        return dg__dplr_state_fwd_f64(&c->d, w, u, kg, bg, v, Gi, h0, h, v2, ht);
    return dg__dplr_state_fwd_f32(&c->d, w, u, kg, bg, v, Gi, h0, h, v2, ht);
}
static inline dg_status dplr_run_state_bwd(const kda_cfg *c, const void *w, const void *kg,
                                           const void *bg, const void *v, const void *Gi,
                                           const void *h, const void *v2, const void *dh,
                                           const void *dv2, const void *dht, void *dw, void *du,
                                           void *dkg, void *dbg, void *dv, void *dGi, void *dh0) {
    if (c->dt == DG_F64)
        return dg__dplr_state_bwd_f64(&c->d, w, kg, bg, v, Gi, h, v2, dh, dv2, dht, dw, du, dkg,
                                      dbg, dv, dGi, dh0);
    return dg__dplr_state_bwd_f32(&c->d, w, kg, bg, v, Gi, h, v2, dh, dv2, dht, dw, du, dkg, dbg,
                                  dv, dGi, dh0);
}
static inline dg_status dplr_run_output_fwd(const kda_cfg *c, const void *qg, const void *h,
                                            const void *Aqk, const void *Aqb, const void *v,
                                            const void *v2, void *o) {
    if (c->dt == DG_F64)
        dg__dplr_output_fwd_f64(&c->d, qg, h, Aqk, Aqb, v, v2, o);
    else
        dg__dplr_output_fwd_f32(&c->d, qg, h, Aqk, Aqb, v, v2, o);
    return DG_OK;
}
static inline dg_status dplr_run_output_bwd(const kda_cfg *c, const void *qg, const void *h,
                                            const void *Aqk, const void *Aqb, const void *v,
                                            const void *v2, const void *dO, void *dqg, void *dh,
                                            void *dAqk, void *dAqb, void *dv, void *dv2) {
    if (c->dt == DG_F64)
        dg__dplr_output_bwd_f64(&c->d, qg, h, Aqk, Aqb, v, v2, dO, dqg, dh, dAqk, dAqb, dv, dv2);
    else
        dg__dplr_output_bwd_f32(&c->d, qg, h, Aqk, Aqb, v, v2, dO, dqg, dh, dAqk, dAqb, dv, dv2);
    return DG_OK;
}

/* The arguments of dg_dplr_chunk / dg_dplr_recurrent: q fixes B, T, H, K and the dtype (f64 or
 * f32), v fixes V; k, a, b, gk must be [B,T,H,K], v [B,T,H,V], h0 (optional) [N,H,K,V], all of
 * q's dtype on the CPU. On a CUDA context: DG_ERR_UNSUPPORTED. Fills cfg (free with
 * dg__kda_cfg_free). */
dg_status dg__dplr_check_inputs(const char *op, dg_ctx *ctx, dg_tensor *q, dg_tensor *k,
                                dg_tensor *v, dg_tensor *a, dg_tensor *b, dg_tensor *gk,
                                dg_tensor *h0, const dg_dplr_opts *opts, kda_cfg *cfg);
/* Options only (chunk size, scale, cu_seqlens), for the stage entry points: B, T, H, K, V from
 * the caller. */
dg_status dg__dplr_cfg_init(const char *op, dg_ctx *ctx, const dg_dplr_opts *opts, int64_t B,
                            int64_t T, int H, int K, int V, dg_dtype dt, kda_cfg *cfg);

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

/* A group for an op call with cfg (tables copied). */
dg_status dg__dplr_group_new(const kda_cfg *cfg, dg__group **out);

/* Params block of the DPLR nodes: the cfg (tables copied behind it), an optional recompute
 * group and a few node-specific flags. */
typedef struct dplr_np {
    kda_cfg cfg;
    dg__group *grp;
    int flags;
    int64_t tab[]; /* cfg.tab points here */
} dplr_np;
/* Allocate the params of n from cfg (tables copied); a non-NULL grp is retained and released
 * with the node. */
dplr_np *dg__dplr_np_new(dg_node *n, const kda_cfg *cfg, dg__group *grp);

/* ---- internal entry points used by the composite (the public ones pass grp = NULL) ---- */
dg_status dg__dplr_state_x(dg_ctx *ctx, dg_tensor *w, dg_tensor *u, dg_tensor *kg, dg_tensor *bg,
                           dg_tensor *v, dg_tensor *Gi, dg_tensor *h0, const dg_dplr_opts *opts,
                           dg__group *grp, dg_tensor **h, dg_tensor **v2, dg_tensor **ht);
/* The local part of the chunked composite (ops/dplr/chunk.c), shared by dg_dplr_chunk and the
 * context-parallel dg_dplr_chunk_cp: the gate_cumsum, intra and wy stage nodes, their outputs
 * each an owned reference (dg__dplr_local_free releases them; on error nothing is held). */
typedef struct dplr_local {
    dg_tensor *Gi, *Ge, *Aqk, *Aqb, *Aak, *Tab, *w, *u, *qg, *kg, *bg;
} dplr_local;
dg_status dg__dplr_local_stages(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v,
                                dg_tensor *a, dg_tensor *b, dg_tensor *gk,
                                const dg_dplr_opts *opts, dplr_local *l);
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

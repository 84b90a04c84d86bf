/*
 * ops/dplr/dplr.h -- internal declarations shared by the DPLR stage files: the raw-array
 * reference functions (f64 and f32) and the argument checks of the public entry points.
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
    dg_status dplr_recurrent_fwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,      \
                                       const KT *v, const KT *a, const KT *b, const KT *gk,        \
                                       const KT *h0, KT *o, KT *ht);                               \
    /* Backward through time (states recomputed from checkpoints every DPLR_REC_SEG tokens).       \
     * dO, dht optional (zero); dh0 optional. */                                                   \
    dg_status dplr_recurrent_bwd_##SFX(const kda_dims *d, KT scale, const KT *q, const KT *k,      \
                                       const KT *v, const KT *a, const KT *b, const KT *gk,        \
                                       const KT *h0, const KT *dO, const KT *dht, KT *dq, KT *dk,  \
                                       KT *dv, KT *da, KT *db, KT *dgk, KT *dh0);                  \
    /* §4: chunk-local inclusive (Gi) and exclusive (Ge) cumsums of gk, all [TT,H,K]; gk floored  \
     * at -128 (a decay of exp(-128) ~ 0, see gate_cumsum.c). */                                   \
    void dplr_cumsum_fwd_##SFX(const kda_dims *d, const KT *gk, KT *Gi, KT *Ge);                   \
    /* dgk_i = sum_{r>=i} dGi_r + sum_{r>i} dGe_r per chunk (0 where gk is below the floor);       \
     * dGi, dGe optional (zero). */                                                                \
    void dplr_cumsum_bwd_##SFX(const kda_dims *d, const KT *gk, const KT *dGi, const KT *dGe,      \
                               KT *dgk);

DPLR_DECLARE_RAW(double, f64)
DPLR_DECLARE_RAW(float, f32)

#define DPLR_REC_SEG 64 /* recurrent backward: tokens between stored state checkpoints */

/* The arguments of dg_dplr_chunk / dg_dplr_recurrent: q fixes B, T, H, K and the dtype (f64 or
 * f32), v fixes V; k, a, b, gk must be [B,T,H,K], v [B,T,H,V], h0 (optional) [N,H,K,V], all of
 * q's dtype on the CPU. On a CUDA context: DG_ERR_UNSUPPORTED. Fills cfg (free with
 * kda_cfg_free). */
dg_status dplr_check_inputs(const char *op, dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v,
                            dg_tensor *a, dg_tensor *b, dg_tensor *gk, dg_tensor *h0,
                            const dg_dplr_opts *opts, kda_cfg *cfg);
/* Options only (chunk size, scale, cu_seqlens), for the stage entry points: B, T, H, K, V from
 * the caller. */
dg_status dplr_cfg_init(const char *op, dg_ctx *ctx, const dg_dplr_opts *opts, int64_t B, int64_t T,
                        int H, int K, int V, dg_dtype dt, kda_cfg *cfg);

#endif /* DG_OPS_DPLR_H */

/*
 * kernels/dplr/dplr_cuda.h -- CUDA twins of the raw DPLR stage functions in ops/dplr/dplr.h.
 *
 * Same math, same layouts, same argument order as the CPU reference functions (the layout table
 * at the top of ops/dplr/dplr.h), with these differences:
 *   - every array is a DEVICE pointer; every product of a call with f32 leaves is plain f32
 *     FFMA with f32 accumulation; a call with bf16 leaves runs the WY, state and output products
 *     on TF32 tensor cores where the sizes allow (K, V % 8 == 0 and aligned arrays; the state
 *     stage also K % 16 == 0: see wy.cu, state.cu, output.cu), the gate and intra kernels in
 *     FFMA; kda_cuda_dims.tc is
 *     ignored and kda_cuda_dims.mid must be 0;
 *   - the leaf activations q, k, v, a, b, gk and the output-side o / dO are f32, or bf16 when
 *     the flag bf16 is set (declared void here): the kernels read them as stored, with no
 *     converted copy, and write o in the same dtype; the cumsum backward writes dgk in gk's
 *     dtype. Every other array -- Gi, Ge, Aqk, Aqb, Aak, Tab, w, u, qg, kg, bg, h, v2, h0, ht,
 *     dht and every other gradient -- is f32;
 *   - the sequence/chunk tables live on the device in a kda_cuda_dims (KDA's, built by
 *     dg__kda_cuda_dims_new with HV = H: DPLR has one value head per head);
 *   - each function takes the dg_ctx whose stream it runs on and returns a dg_status (launch and
 *     runtime errors are checked; nothing is synchronised, no host copy is made: the calls can be
 *     captured in a CUDA graph).
 * Gradient outputs are OVERWRITTEN, like the CPU versions. Optional arguments are the CPU
 * versions' (NULL input = zero, NULL output = skipped); the others must not be NULL.
 *
 * Layout reminder (TT = B*T flat tokens; NC = chunks over all sequences):
 *   q, k, a, b, gk, Gi, Ge, w, qg, kg, bg [TT,H,K]; v, u, v2, o [TT,H,V];
 *   Aqk, Aqb, Aak, Tab [TT,H,BT] (token row t holds row t - chunk_t0 of its chunk's matrix);
 *   h [NC,H,K,V] (state at chunk start); h0, ht [N,H,K,V].
 *
 * One file per stage in kernels/dplr/ (as ops/dplr/ has one node file per stage): gate.cu (the
 * chunk cumsums), intra.cu, wy.cu, state.cu, output.cu, recurrent.cu; common.cuh holds what they
 * share on top of kernels/kda/common.cuh.
 */
#ifndef DG_DPLR_CUDA_H
#define DG_DPLR_CUDA_H

#include "../kda/kda_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the chunk-local cumsums (gate.cu) ---- */
dg_status dg__dplr_cumsum_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16, const void *gk,
                                   float *Gi, float *Ge);
/* dGi, dGe optional; dgk in gk's dtype. */
dg_status dg__dplr_cumsum_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16, const void *gk,
                                   const float *dGi, const float *dGe, void *dgk);

/* ---- intra (intra.cu): Aqk, Aqb, Aak, Tab; backward from dAqk, dAqb, dAak, dTab (each
 * optional) ---- */
dg_status dg__dplr_intra_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, int bf16,
                                  const void *q, const void *k, const void *a, const void *b,
                                  const float *Gi, const float *Ge, float *Aqk, float *Aqb,
                                  float *Aak, float *Tab);
dg_status dg__dplr_intra_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, int bf16,
                                  const void *q, const void *k, const void *a, const void *b,
                                  const float *Gi, const float *Ge, const float *Tab,
                                  const float *dAqk, const float *dAqb, const float *dAak,
                                  const float *dTab, float *dq, float *dk, float *da, float *db,
                                  float *dGi, float *dGe);

/* ---- WY (wy.cu): w, u, qg, kg, bg (each optional); backward from dw, du, dqg, dkg, dbg (each
 * optional) ---- */
dg_status dg__dplr_wy_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, int bf16,
                               const void *q, const void *k, const void *v, const void *a,
                               const void *b, const float *Gi, const float *Ge, const float *Aak,
                               const float *Tab, float *w, float *u, float *qg, float *kg,
                               float *bg);
dg_status dg__dplr_wy_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, int bf16,
                               const void *q, const void *k, const void *v, const void *a,
                               const void *b, const float *Gi, const float *Ge, const float *Aak,
                               const float *Tab, const float *dw, const float *du, const float *dqg,
                               const float *dkg, const float *dbg, float *dq, float *dk, float *dv,
                               float *da, float *db, float *dGi, float *dGe, float *dAak,
                               float *dTab);

/* ---- the state pass (state.cu): h, v2 (required), ht optional, h0 optional; backward from dh,
 * dv2, dht (each optional), dh0 optional. v has the leaf dtype. ---- */
dg_status dg__dplr_state_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16, const float *w,
                                  const float *u, const float *kg, const float *bg, const void *v,
                                  const float *Gi, const float *h0, float *h, float *v2, float *ht);
dg_status dg__dplr_state_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16, const float *w,
                                  const float *kg, const float *bg, const void *v, const float *Gi,
                                  const float *h, const float *v2, const float *dh,
                                  const float *dv2, const float *dht, float *dw, float *du,
                                  float *dkg, float *dbg, float *dv, float *dGi, float *dh0);

/* The KCP summaries of sequence seq alone (ops/dplr/kcp.c), nothing stored per chunk. Forward
 * (bwd = 0): Sh [H,K,V] = the state after seq's chunks from S0 (its [H,K,V] initial state, NULL:
 * zero) with the input terms u, v; SM [H,K,K] = the chunks' transition M (from the identity, no
 * input terms). Backward (bwd = 1): Sh = the gradient of seq's initial state from S0 (the
 * gradient of its final state, NULL: zero) with dh and dv2 per chunk (each optional); SM = M^T.
 * u and v are read forward only. */
dg_status dg__dplr_state_summary_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int seq, int bwd,
                                      int bf16, const float *w, const float *u, const float *kg,
                                      const float *bg, const void *v, const float *Gi,
                                      const float *dh, const float *dv2, const float *S0, float *Sh,
                                      float *SM);

/* ---- the output (output.cu): o and dO in the leaf dtype (that of v) ---- */
dg_status dg__dplr_output_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16, const float *qg,
                                   const float *h, const float *Aqk, const float *Aqb,
                                   const void *v, const float *v2, void *o);
dg_status dg__dplr_output_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16, const float *qg,
                                   const float *h, const float *Aqk, const float *Aqb,
                                   const void *v, const float *v2, const void *dO, float *dqg,
                                   float *dh, float *dAqk, float *dAqb, float *dv, float *dv2);

/* ---- the token recurrence (recurrent.cu): o in the leaf dtype, h0 / ht / dht / dh0 f32 (h0,
 * ht, dO, dht, dh0 optional) ---- */
dg_status dg__dplr_recurrent_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, int bf16,
                                      const void *q, const void *k, const void *v, const void *a,
                                      const void *b, const void *gk, const float *h0, void *o,
                                      float *ht);
dg_status dg__dplr_recurrent_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, int bf16,
                                      const void *q, const void *k, const void *v, const void *a,
                                      const void *b, const void *gk, const float *h0,
                                      const void *dO, const float *dht, float *dq, float *dk,
                                      float *dv, float *da, float *db, float *dgk, float *dh0);

#ifdef __cplusplus
}
#endif
#endif /* DG_DPLR_CUDA_H */

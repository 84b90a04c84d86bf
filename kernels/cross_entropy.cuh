/*
 * kernels/cross_entropy.cuh -- CUDA launchers of dg_cross_entropy (ops/cross_entropy.c).
 * C-compatible.
 *
 * logits: [N, V] contiguous, f32 or bf16; targets: [N] i32/i64. Per-row values are f32.
 */
#ifndef DG_KERNELS_CROSS_ENTROPY_CUH
#define DG_KERNELS_CROSS_ENTROPY_CUH

#include "../tensor/tensor.h"
#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* loss[0] = mean over rows with targets != ignore_index of (lse_i - logits[i, t_i]), 0 if there
 * are none; count[0] = that number of rows; stats: [N,2] row statistics (m_i = max_j logits[i,j],
 * log sum_j exp(logits[i,j] - m_i)), or NULL. A target outside [0, V) that is not ignore_index
 * gives its row a zero loss and is recorded in the context's bad-input record (the first row;
 * `site` describes the call). No host sync: the caller reads the record now or later. */
dg_status dg__cross_entropy_fwd_cuda(dg_ctx *ctx, dg_dtype ldt, const void *logits, int64_t N,
                                     int64_t V, dg_dtype tdt, const void *targets,
                                     int64_t ignore_index, float *loss, int64_t *count,
                                     float *stats, const dg_deverr_site *site);

/* dlogits[i,j] = (softmax_ij - [j == t_i]) * dloss[0] / count[0], zero rows where t_i is
 * ignore_index and everywhere when count[0] == 0. stats: the forward's row statistics, or NULL
 * to recompute them (same kernel code, same bits). dloss, count: device pointers (no host sync). */
dg_status dg__cross_entropy_bwd_cuda(dg_ctx *ctx, dg_dtype ldt, const void *logits, int64_t N,
                                     int64_t V, dg_dtype tdt, const void *targets,
                                     int64_t ignore_index, const float *stats, const int64_t *count,
                                     const float *dloss, void *dlogits);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_CROSS_ENTROPY_CUH */

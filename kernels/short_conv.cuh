/*
 * kernels/short_conv.cuh -- C-callable launchers for dg_short_conv (kernels/short_conv.cu).
 *
 * x, y, dy, dx: contiguous device buffers [B*T, C] of `dt` (f32 or bf16); w [C, W] (1 <= W <= 8);
 * bias [C] or NULL. cu: NULL (each batch row of T tokens is one sequence) or a device int64 array
 * [n_seqs + 1] of sequence offsets with B == 1. Positions before a sequence's start read as zero:
 *     z[r, c] = sum_{i<W} w[c, i] x[r - W + 1 + i, c] + bias[c],   y = act(z),  act NONE or SILU
 */
#ifndef DG_KERNELS_SHORT_CONV_CUH
#define DG_KERNELS_SHORT_CONV_CUH

#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_SHORT_CONV_MAX_W 8

dg_status dg__short_conv_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T, int64_t C, int W,
                                  const void *x, const void *w, const void *bias, dg_act act,
                                  const int64_t *cu, int n_seqs, void *y);

/* dx, dw, dbias: NULL to skip. dw and dbias are reduced over B*T deterministically (per-chunk
 * partial sums, then a fixed-order sum); z is recomputed from x, w, bias. */
dg_status dg__short_conv_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T, int64_t C, int W,
                                  const void *x, const void *w, const void *bias, dg_act act,
                                  const int64_t *cu, int n_seqs, const void *dy, void *dx, void *dw,
                                  void *dbias);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_SHORT_CONV_CUH */

/*
 * kernels/embedding.cuh -- CUDA launchers of dg_embedding (ops/embedding.c). C-compatible.
 *
 * weight: [V, d] contiguous, f32 or bf16; ids: n contiguous i32/i64; out / dy: [n, d] in the
 * weight's dtype.
 */
#ifndef DG_KERNELS_EMBEDDING_CUH
#define DG_KERNELS_EMBEDDING_CUH

#include "../tensor/tensor.h"
#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i,:] = weight[ids[i],:]. Ids outside [0, V) give a zero row and are recorded in the
 * context's bad-input record (the first position; `site` describes the call for the message).
 * No host sync: the caller reads the record (dg_ctx_check_errors) now or later. */
dg_status dg__embedding_fwd_cuda(dg_ctx *ctx, dg_dtype wdt, const void *weight, int64_t V,
                                 int64_t d, dg_dtype idt, const void *ids, int64_t n, void *out,
                                 const dg_deverr_site *site);

/* dweight[v,:] = sum over positions i with ids[i] == v, in increasing i, of dy[i,:] (overwrites
 * dweight; rows no id hits become zero). Deterministic: the positions are radix-sorted by id
 * (a stable sort), then one block per vocabulary row sums its run in position order with f32
 * accumulation. An id outside [0, V) (recorded by the forward) adds to no row. */
dg_status dg__embedding_bwd_cuda(dg_ctx *ctx, dg_dtype wdt, void *dweight, int64_t V, int64_t d,
                                 dg_dtype idt, const void *ids, int64_t n, const void *dy);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_EMBEDDING_CUH */

/*
 * kernels/cuda_api.h -- the C-callable face of the CUDA side: device memory (a caching allocator
 * per context), copies, and the tensor-level kernels (fill, strided copy with dtype conversion,
 * axpy, counter-based random fills). Only compiled and called when DG_HAVE_CUDA is defined.
 * Every function returns a dg_status; CUDA errors name the failing call, file and line.
 */
#ifndef DG_CUDA_API_H
#define DG_CUDA_API_H

#include "../tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

int dg__cuda_device_count(void);
dg_status dg__cuda_ctx_init(dg_ctx *ctx); /* stream, cuBLAS handle, allocator */
void dg__cuda_ctx_destroy(dg_ctx *ctx);
dg_status dg__cuda_sync(dg_ctx *ctx);
dg_status dg__cuda_malloc(dg_ctx *ctx, size_t bytes, void **ptr);
void dg__cuda_free(dg_ctx *ctx, void *ptr, size_t bytes);
void dg__cuda_empty_cache(dg_ctx *ctx);

/* A device copy of `bytes` read-only bytes at host, owned by the context until it ends: a later call
 * with the same bytes gets the same copy with no upload and no host sync (what keeps a repeated
 * call, e.g. a training step, free of host syncs and capturable in a CUDA graph after its first
 * run). The first call per content uploads synchronously. *dev = NULL (and DG_OK) when the
 * context's table space is full: the caller then makes a copy of its own. Never write to *dev. */
dg_status dg__cuda_table(dg_ctx *ctx, const void *host, size_t bytes, const void **dev);

typedef enum { DG_COPY_H2D, DG_COPY_D2H, DG_COPY_D2D } dg_copy_kind;
/* Synchronous with respect to the host for H2D/D2H. */
dg_status dg__cuda_memcpy(dg_ctx *ctx, void *dst, const void *src, size_t bytes, dg_copy_kind k);

/* A strided n-d layout passed by value to kernels. */
typedef struct dg_layout {
    int ndim;
    int64_t shape[DG_MAX_DIMS];
    int64_t stride[DG_MAX_DIMS];
} dg_layout;

/* dst (layout dl, dtype ddt) = convert(src laid out as sl, dtype sdt); numel elements visited in
 * logical row-major order. Layouts must have the same shape. */
dg_status dg__cuda_copy_strided(dg_ctx *ctx, void *dst, dg_dtype ddt, dg_layout dl, const void *src,
                                dg_dtype sdt, dg_layout sl, int64_t numel);
dg_status dg__cuda_fill(dg_ctx *ctx, void *dst, dg_dtype dt, int64_t n, double value);
/* dst += alpha * src; both contiguous with n elements; dtypes may differ (math in f32/f64). */
dg_status dg__cuda_axpy(dg_ctx *ctx, void *dst, dg_dtype ddt, double alpha, const void *src,
                        dg_dtype sdt, int64_t n);
/* kind 0 uniform(a,b), 1 normal(mean=a, std=b); element i uses counter i (see tensor/rand.c). */
dg_status dg__cuda_rand(dg_ctx *ctx, void *dst, dg_dtype dt, int64_t n, uint64_t seed, int kind,
                        double a, double b);

#ifdef __cplusplus
}
#endif
#endif /* DG_CUDA_API_H */

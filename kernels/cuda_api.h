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
/* Refused (DG_ERR_STATE, nothing queued) while the context captures a graph. */
dg_status dg__cuda_sync(dg_ctx *ctx);
/* While the context captures a graph (dg__cuda_capturing): served from the cache only; a miss is
 * DG_ERR_STATE and fails the capture (dg_graph_end then reports it). */
dg_status dg__cuda_malloc(dg_ctx *ctx, size_t bytes, void **ptr);
/* A block freed during a capture, or handed out during one, is kept for that graph until
 * dg_graph_free (see the memory rule in include/deltagrad.h and docs/runtime.md). */
void dg__cuda_free(dg_ctx *ctx, void *ptr, size_t bytes);
/* Does nothing while the context captures a graph. */
void dg__cuda_empty_cache(dg_ctx *ctx);

/* ---- CUDA graphs (the public face is dg_graph_* in include/deltagrad.h, tensor/graph.c) ----
 * One capture at a time per context, on its stream, in CUDA's global capture mode. */
int dg__cuda_capturing(const dg_ctx *ctx);
dg_status dg__cuda_graph_begin(dg_ctx *ctx);
dg_status dg__cuda_graph_end(dg_ctx *ctx, dg_graph **out);
dg_status dg__cuda_graph_launch(dg_ctx *ctx, const dg_graph *g);
void dg__cuda_graph_free(dg_graph *g);

/* A device copy of `bytes` read-only bytes at host, owned by the context until it ends: a later
 * call with the same bytes gets the same copy with no upload and no host sync (what keeps a
 * repeated call, e.g. a training step, free of host syncs and capturable in a CUDA graph after its
 * first run). The first call per content uploads synchronously. *dev = NULL (and DG_OK) when the
 * context's table space is full: the caller then makes a copy of its own. Never write to *dev.
 * While the context captures a graph a table it does not hold yet cannot be uploaded: that is
 * DG_ERR_STATE (naming the cause) and fails the capture. */
dg_status dg__cuda_table(dg_ctx *ctx, const void *host, size_t bytes, const void **dev);

/* ---- staged uploads (dg_stage, tensor/stage.c) ----
 * Page-locked host memory (portable: usable with every device), events, and an asynchronous
 * copy from page-locked memory. The copy is refused (DG_ERR_STATE, nothing queued) while the
 * context captures a graph; the others do not look at the capture state (dg_stage does). */
dg_status dg__cuda_host_alloc(dg_ctx *ctx, size_t bytes, void **host);
void dg__cuda_host_free(void *host);
/* An event without timing on ctx's device; *ev is a cudaEvent_t. */
dg_status dg__cuda_event_new(dg_ctx *ctx, void **ev);
void dg__cuda_event_free(void *ev);
/* Record ev on ctx's stream (after the work queued so far). */
dg_status dg__cuda_event_record(dg_ctx *ctx, void *ev);
/* Wait on the host until the work before the event's last record is done (at once if it was
 * never recorded). */
dg_status dg__cuda_event_wait(void *ev);
/* Queue a copy of `bytes` from page-locked host memory to device memory on ctx's stream. */
dg_status dg__cuda_memcpy_h2d_async(dg_ctx *ctx, void *dst, const void *host, size_t bytes);

typedef enum { DG_COPY_H2D, DG_COPY_D2H, DG_COPY_D2D } dg_copy_kind;
/* Synchronous with respect to the host for H2D/D2H; those two are refused (DG_ERR_STATE,
 * nothing queued) while the context captures a graph. */
dg_status dg__cuda_memcpy(dg_ctx *ctx, void *dst, const void *src, size_t bytes, dg_copy_kind k);

/* ---- bad inputs found by kernels (dg_ctx_check_errors) ----
 * Each CUDA context owns one dg_deverr in device memory. A kernel that finds a bad index (a token
 * id outside [0, V), a target outside [0, V)) atomicMin's its flat position into `pending`; the
 * launcher then queues dg__deverr_commit, which moves a pending position into the record (the
 * first bad launch since the last check wins; later ones only count) and resets `pending`. All
 * on the stream, no host sync: the host reads the record with dg__deverr_read. */
typedef enum { DG_DEVERR_EMBEDDING_ID = 1, DG_DEVERR_CE_TARGET = 2 } dg_deverr_kind;

/* What the host knows of a launch, enough to name a bad index in an error message: the indexed
 * tensor `idx` (ids / targets: its shape) and the tensor `ref` it indexes (weight [V,d] /
 * logits [N,V]: shape and dtype). Passed to the commit kernel by value. */
typedef struct dg_deverr_site {
    int32_t kind; /* dg_deverr_kind */
    int32_t idx_ndim;
    int64_t idx_shape[DG_MAX_DIMS];
    int32_t ref_dtype; /* dg_dtype */
    int32_t ref_ndim;
    int64_t ref_shape[2];
    int64_t ignore; /* cross-entropy's ignore_index */
} dg_deverr_site;

typedef struct dg_deverr {
    unsigned long long pending; /* first bad position of the launch in flight; ULLONG_MAX: none */
    long long count;            /* launches that found a bad index since the last read */
    long long pos, value;       /* the first such launch's first bad position and its value */
    dg_deverr_site site;        /* ... and the launch */
} dg_deverr;

/* The context's record (a device pointer). */
dg_deverr *dg__deverr(dg_ctx *ctx);
/* Queue the move of `pending` into the record; idx (dtype idt, i32 or i64) is the launch's index
 * tensor, read at the pending position for the message. No sync. */
dg_status dg__deverr_commit(dg_ctx *ctx, const dg_deverr_site *site, dg_dtype idt, const void *idx);
/* Copy the record to the host (one D2H: a sync) and clear it. Refused (DG_ERR_STATE) while the
 * context captures a graph. */
dg_status dg__deverr_read(dg_ctx *ctx, dg_deverr *out);

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

/*
 * tensor/tensor.h -- library-internal view of tensors, storage and contexts, plus the error and
 * argument-check helpers every op uses. Not installed; ops/, autograd/, dist/ and train/ include
 * it.
 */
#ifndef DG_TENSOR_INTERNAL_H
#define DG_TENSOR_INTERNAL_H

#include "deltagrad.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef DG_MALLOC
#define DG_MALLOC(n) malloc(n)
#define DG_CALLOC(n, s) calloc((n), (s))
#define DG_REALLOC(p, n) realloc((p), (n))
#define DG_FREE(p) free(p)
#endif

/* Device or host bytes shared by a tensor and its views. */
typedef struct dg_storage {
    int refcount;
    void *data;
    size_t bytes;
    dg_device device;
    dg_ctx *ctx; /* the context whose allocator owns `data` (not owned) */
} dg_storage;

/* Where a tensor's gradient accumulates. Shared by the tensor and the tape nodes that read or
 * write its gradient, so a user may free an activation while the tape still routes its gradient. */
typedef struct dg_gslot {
    int refcount;
    dg_tensor *grad; /* NULL until something accumulates */
    int ndim;
    int64_t shape[DG_MAX_DIMS];
    dg_dtype dtype;
    dg_ctx *ctx;
    int is_leaf; /* created by the user (requires_grad), not by an op */
    int retain;  /* keep the gradient after backward even if not a leaf */
    /* > 0: a bf16 leaf summing in f32 until tape node wide - 1 has run (autograd/tape.c) */
    int wide;
} dg_gslot;
/* Drop one reference to *sp (NULL allowed) and set *sp = NULL; the last one frees the slot and
 * its gradient. The slot is created by the tape (autograd/tape.c); the tensor layer only lets go
 * of it, so tensor/ never depends on autograd/. */
void dg__slot_release(dg_gslot **sp);

struct dg_tensor {
    int refcount;
    int ndim;
    int64_t shape[DG_MAX_DIMS];
    int64_t stride[DG_MAX_DIMS]; /* elements */
    int64_t offset;              /* elements from storage->data */
    dg_dtype dtype;
    dg_device device;
    dg_storage *storage;
    dg_gslot *slot; /* non-NULL iff the tensor requires grad */
    char name[32];
};

struct dg_cuda_alloc; /* kernels/cuda_runtime.cu */

struct dg_ctx {
    dg_device device;
    void *stream; /* cudaStream_t */
    void *cublas; /* cublasHandle_t */
    struct dg_cuda_alloc *alloc;
    dg_mem_stats stats;
    void *deverr;     /* dg_deverr in device memory (CUDA; kernels/cuda_api.h) */
    int defer_checks; /* dg_ctx_defer_checks */
};

/* ---- errors ---- */
/* Record a formatted reason for this thread and return `s`. */
dg_status dg__err(dg_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#define DG_TRY(expr)                                                                               \
    do {                                                                                           \
        dg_status dg__s = (expr);                                                                  \
        if (dg__s != DG_OK)                                                                        \
            return dg__s;                                                                          \
    } while (0)

/* Programmer errors inside the library (broken invariants, not bad user input). */
#define DG_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "deltagrad: assertion failed: %s (%s:%d)\n", #cond, __FILE__,          \
                    __LINE__);                                                                     \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* ---- argument checks: each returns DG_OK or an error naming op and argument ---- */
dg_status dg__check_ptr(const char *op, const char *arg, const void *p);
/* ndim must equal `ndim`; shape[i] must equal want[i] unless want[i] < 0 (any). */
dg_status dg__check_shape(const char *op, const char *arg, const dg_tensor *t, int ndim,
                          const int64_t *want);
/* dtype must be one of the bits set in `mask` (1u << DG_F64 | ...). */
dg_status dg__check_dtype(const char *op, const char *arg, const dg_tensor *t, unsigned mask);
dg_status dg__check_same_dtype(const char *op, const char *arg, const dg_tensor *t,
                               const dg_tensor *ref);
/* t must live on ctx's device. */
dg_status dg__check_device(const char *op, const char *arg, const dg_tensor *t, const dg_ctx *ctx);
/* A float tensor an op runs: device first, then dtype: f64/f32 on the CPU, f32/bf16 on CUDA. */
dg_status dg__check_float(const char *op, const char *arg, const dg_tensor *t, const dg_ctx *ctx);
#define DG_MASK(dt) (1u << (dt))
#define DG_FLOATS (DG_MASK(DG_F64) | DG_MASK(DG_F32) | DG_MASK(DG_BF16))
#define DG_INTS (DG_MASK(DG_I32) | DG_MASK(DG_I64))

/* ---- construction helpers ---- */
/* New contiguous tensor like `t` (shape, dtype) in ctx. */
dg_status dg__new_like(dg_ctx *ctx, const dg_tensor *t, dg_tensor **out);
dg_status dg__zeros_like(dg_ctx *ctx, const dg_tensor *t, dg_tensor **out);
/* Contiguous version of t without recording on the tape (new ref to t if already contiguous). */
dg_status dg__contig(dg_ctx *ctx, dg_tensor *t, dg_tensor **out);
/* dst += alpha * src (same shape, dst contiguous). Not recorded. */
dg_status dg__axpy(dg_ctx *ctx, dg_tensor *dst, double alpha, const dg_tensor *src);
int64_t dg__numel(int ndim, const int64_t *shape);
/* 1 when the product of the nonzero extents of shape (all >= 0) stays at or below
 * INT64_MAX / 16, so that every contiguous stride and byte count fits in int64_t, also for a
 * shape with a zero extent (whose other extents still make its strides); else 0. */
int dg__shape_fits(int ndim, const int64_t *shape);
void dg__contig_strides(int ndim, const int64_t *shape, int64_t *stride);
int dg__same_shape(const dg_tensor *a, const dg_tensor *b);
/* Typed pointer to the first element. */
static inline double *dg__f64(const dg_tensor *t) { return (double *)dg_tensor_data(t); }
static inline float *dg__f32(const dg_tensor *t) { return (float *)dg_tensor_data(t); }
static inline int dg__is_cuda(const dg_tensor *t) { return t->device.kind == DG_DEV_CUDA; }
/* t's data as dtype dt, contiguous, for a kernel: t's own data when it already is, else a
 * converted copy in *tmp (NULL when none; the caller frees it). With bf16_ok, a contiguous bf16 t
 * on CUDA is given as it is stored instead, for a kernel that reads bf16 itself (*is_bf16 = 1;
 * is_bf16 may be NULL when bf16_ok is 0). */
dg_status dg__data_as(dg_ctx *ctx, const dg_tensor *t, dg_dtype dt, int bf16_ok, dg_tensor **tmp,
                      const void **ptr, int *is_bf16);

/* ---- bf16 on the host (round to nearest even; NaN stays NaN) ---- */
static inline uint16_t dg__f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float dg__bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Read element `i` (an offset in elements from the data pointer) of a host buffer as double. */
double dg__load_f64(const void *base, dg_dtype dt, int64_t i);
void dg__store_f64(void *base, dg_dtype dt, int64_t i, double v);

/* The errors of a bad index, shared by the ops (which check on the spot) and
 * dg_ctx_check_errors (which rebuilds ids/weight/logits from what the kernel recorded: only
 * ndim, shape, dtype and device are read). */
dg_status dg__embedding_bad_id(const dg_tensor *ids, const dg_tensor *weight, int64_t pos,
                               int64_t id);
dg_status dg__cross_entropy_bad_target(const dg_tensor *logits, int64_t row, int64_t target,
                                       int64_t ignore);

/* DG_ERR_STATE naming `op` when ctx is capturing a CUDA graph: `what` (e.g. "a copy to host
 * memory") would make the host wait for the device. DG_OK otherwise (and on the CPU). */
dg_status dg__no_capture(const char *op, const dg_ctx *ctx, const char *what);

/* Message when CUDA tensors reach a build without CUDA. */
dg_status dg__no_cuda(const char *op);

#ifdef __cplusplus
}
#endif
#endif /* DG_TENSOR_INTERNAL_H */

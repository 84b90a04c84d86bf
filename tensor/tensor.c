/*
 * tensor/tensor.c -- contexts, reference-counted storage, tensor objects, host transfers, fills
 * and the untracked copy/axpy helpers. Views and differentiable copies live in ops/views.c.
 */
#include "tensor.h"
#include "rand.h"

#ifdef DG_HAVE_CUDA
#include "../kernels/cuda_api.h"
#endif

#include <math.h>

/* ---- build facts ---- */

int dg_have_cuda(void) {
#ifdef DG_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int dg_have_nccl(void) {
#ifdef DG_HAVE_NCCL
    return 1;
#else
    return 0;
#endif
}

int dg_cuda_device_count(void) {
#ifdef DG_HAVE_CUDA
    return dg__cuda_device_count();
#else
    return 0;
#endif
}

/* ---- contexts ---- */

dg_status dg_ctx_new(dg_device dev, dg_ctx **out) {
    DG_TRY(dg__check_ptr("dg_ctx_new", "out", out));
    *out = NULL;
    dg_ctx *c = DG_CALLOC(1, sizeof *c);
    if (!c)
        return dg__err(DG_ERR_NOMEM, "dg_ctx_new: out of host memory");
    c->device = dev;
    if (dev.kind == DG_DEV_CUDA) {
#ifdef DG_HAVE_CUDA
        int n = dg__cuda_device_count();
        if (dev.index < 0 || dev.index >= n) {
            DG_FREE(c);
            return dg__err(DG_ERR_DEVICE, "dg_ctx_new: device %s requested but %d CUDA device%s",
                           dg_device_str(dev), n, n == 1 ? " is present" : "s are present");
        }
        dg_status s = dg__cuda_ctx_init(c);
        if (s != DG_OK) {
            DG_FREE(c);
            return s;
        }
#else
        DG_FREE(c);
        return dg__no_cuda("dg_ctx_new");
#endif
    } else if (dev.kind != DG_DEV_CPU) {
        DG_FREE(c);
        return dg__err(DG_ERR_ARG, "dg_ctx_new: unknown device kind %d", (int)dev.kind);
    }
    *out = c;
    return DG_OK;
}

void dg_ctx_free(dg_ctx **ctx) {
    if (!ctx || !*ctx)
        return;
#ifdef DG_HAVE_CUDA
    if ((*ctx)->device.kind == DG_DEV_CUDA)
        dg__cuda_ctx_destroy(*ctx);
#endif
    DG_FREE(*ctx);
    *ctx = NULL;
}

dg_device dg_ctx_device(const dg_ctx *ctx) { return ctx->device; }

dg_status dg_ctx_sync(dg_ctx *ctx) {
#ifdef DG_HAVE_CUDA
    if (ctx && ctx->device.kind == DG_DEV_CUDA) {
        DG_TRY(dg__no_capture("dg_ctx_sync", ctx, "a sync"));
        return dg__cuda_sync(ctx);
    }
#else
    (void)ctx;
#endif
    return DG_OK;
}

void dg_ctx_defer_checks(dg_ctx *ctx, int on) {
    if (ctx)
        ctx->defer_checks = on != 0;
}

#ifdef DG_HAVE_CUDA
/* A host stand-in for a tensor the record describes: what the error messages read of it. */
static dg_tensor described(dg_device dev, dg_dtype dt, int ndim, const int64_t *shape) {
    dg_tensor t;
    memset(&t, 0, sizeof t);
    t.ndim = ndim > 0 && ndim <= DG_MAX_DIMS ? ndim : 0;
    memcpy(t.shape, shape, (size_t)t.ndim * sizeof *shape);
    t.dtype = dt;
    t.device = dev;
    return t;
}
#endif

dg_status dg_ctx_check_errors(dg_ctx *ctx) {
    DG_TRY(dg__check_ptr("dg_ctx_check_errors", "ctx", ctx));
    if (ctx->device.kind != DG_DEV_CUDA)
        return DG_OK; /* CPU ops checked on the spot */
#ifdef DG_HAVE_CUDA
    DG_TRY(dg__no_capture("dg_ctx_check_errors", ctx,
                          "reading the bad-input record (also done at once by an embedding or "
                          "cross-entropy unless dg_ctx_defer_checks is on: turn it on before "
                          "capturing them)"));
    dg_deverr e;
    DG_TRY(dg__deverr_read(ctx, &e));
    if (e.count == 0)
        return DG_OK;
    const dg_deverr_site *st = &e.site;
    dg_tensor idx = described(ctx->device, DG_I64, st->idx_ndim, st->idx_shape);
    dg_tensor ref = described(ctx->device, (dg_dtype)st->ref_dtype, st->ref_ndim, st->ref_shape);
    dg_status s = st->kind == DG_DEVERR_EMBEDDING_ID
                      ? dg__embedding_bad_id(&idx, &ref, e.pos, e.value)
                      : dg__cross_entropy_bad_target(&ref, e.pos, e.value, st->ignore);
    if (e.count > 1) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", dg_last_error());
        s = dg__err(s, "%s [the first of %lld calls with bad input since the last check]", msg,
                    e.count);
    }
    return s;
#else
    return dg__no_cuda("dg_ctx_check_errors");
#endif
}

dg_mem_stats dg_ctx_mem_stats(const dg_ctx *ctx) { return ctx->stats; }
void dg_ctx_reset_peak(dg_ctx *ctx) { ctx->stats.peak_in_use = ctx->stats.in_use; }
void dg_ctx_empty_cache(dg_ctx *ctx) {
#ifdef DG_HAVE_CUDA
    if (ctx && ctx->device.kind == DG_DEV_CUDA)
        dg__cuda_empty_cache(ctx);
#else
    (void)ctx;
#endif
}

/* ---- storage ---- */

static dg_status storage_new(dg_ctx *ctx, size_t bytes, dg_storage **out) {
    dg_storage *s = DG_CALLOC(1, sizeof *s);
    if (!s)
        return dg__err(DG_ERR_NOMEM, "out of host memory allocating a tensor header");
    s->refcount = 1;
    s->bytes = bytes;
    s->device = ctx->device;
    s->ctx = ctx;
    size_t alloc = bytes ? bytes : 1;
    if (ctx->device.kind == DG_DEV_CPU) {
        /* 64-byte alignment for vector loads; size rounded up as aligned_alloc requires */
        s->data = aligned_alloc(64, (alloc + 63) & ~(size_t)63);
        if (!s->data) {
            DG_FREE(s);
            return dg__err(DG_ERR_NOMEM, "out of host memory allocating %zu bytes", bytes);
        }
    } else {
#ifdef DG_HAVE_CUDA
        dg_status st = dg__cuda_malloc(ctx, alloc, &s->data);
        if (st != DG_OK) {
            DG_FREE(s);
            return st;
        }
#else
        DG_FREE(s);
        return dg__no_cuda("dg_tensor_new");
#endif
    }
    *out = s;
    return DG_OK;
}

static void storage_release(dg_storage *s) {
    if (!s || --s->refcount > 0)
        return;
    if (s->device.kind == DG_DEV_CPU)
        free(s->data);
#ifdef DG_HAVE_CUDA
    else
        dg__cuda_free(s->ctx, s->data, s->bytes ? s->bytes : 1);
#endif
    DG_FREE(s);
}

/* ---- tensors ---- */

int64_t dg__numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

int dg__shape_fits(int ndim, const int64_t *shape) {
    int64_t m = 1;
    for (int i = 0; i < ndim; i++) {
        if (!shape[i])
            continue;
        if (m > INT64_MAX / 16 / shape[i])
            return 0;
        m *= shape[i];
    }
    return 1;
}

void dg__contig_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i];
    }
}

static dg_status check_new_args(const char *op, dg_ctx *ctx, dg_dtype dtype, int ndim,
                                const int64_t *shape, dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    if ((unsigned)dtype >= DG_NDTYPES)
        return dg__err(DG_ERR_DTYPE, "%s: unknown dtype %d", op, (int)dtype);
    if (ndim < 1 || ndim > DG_MAX_DIMS)
        return dg__err(DG_ERR_SHAPE, "%s: ndim must be 1..%d, got %d", op, DG_MAX_DIMS, ndim);
    DG_TRY(dg__check_ptr(op, "shape", shape));
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)
            return dg__err(DG_ERR_SHAPE, "%s: shape[%d] = %lld is negative", op, i,
                           (long long)shape[i]);
    if (!dg__shape_fits(ndim, shape)) /* also with a zero extent: the strides must fit */
        return dg__err(DG_ERR_SHAPE, "%s: shape is too large", op);
    return DG_OK;
}

dg_status dg_tensor_new(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                        dg_tensor **out) {
    DG_TRY(check_new_args("dg_tensor_new", ctx, dtype, ndim, shape, out));
    dg_tensor *t = DG_CALLOC(1, sizeof *t);
    if (!t)
        return dg__err(DG_ERR_NOMEM, "dg_tensor_new: out of host memory");
    t->refcount = 1;
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    dg__contig_strides(ndim, shape, t->stride);
    t->dtype = dtype;
    t->device = ctx->device;
    size_t bytes = (size_t)dg__numel(ndim, shape) * dg_dtype_size(dtype);
    dg_status s = storage_new(ctx, bytes, &t->storage);
    if (s != DG_OK) {
        DG_FREE(t);
        if (s != DG_ERR_NOMEM)
            return s;
        /* name the allocation: which tensor, how big, where */
        char dims[DG_MAX_DIMS * 22 + 4] = "[";
        for (int i = 0; i < ndim; i++)
            snprintf(dims + strlen(dims), sizeof dims - strlen(dims), "%s%lld", i ? "," : "",
                     (long long)shape[i]);
        snprintf(dims + strlen(dims), sizeof dims - strlen(dims), "]");
        return dg__err(s, "out of memory for a %s %s tensor (%zu bytes) on %s: %s",
                       dg_dtype_name(dtype), dims, bytes, dg_device_str(ctx->device),
                       dg_last_error());
    }
    *out = t;
    return DG_OK;
}

dg_status dg_tensor_zeros(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                          dg_tensor **out) {
    DG_TRY(dg_tensor_new(ctx, dtype, ndim, shape, out));
    dg_status s = dg_tensor_fill_(*out, 0.0);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg_tensor_from_host(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                              const void *data, dg_tensor **out) {
    DG_TRY(dg__check_ptr("dg_tensor_from_host", "data", data));
    DG_TRY(dg__no_capture("dg_tensor_from_host", ctx, "a copy from host memory"));
    DG_TRY(dg_tensor_new(ctx, dtype, ndim, shape, out));
    dg_tensor *t = *out;
    size_t bytes = dg_tensor_nbytes(t);
    if (t->device.kind == DG_DEV_CPU) {
        memcpy(t->storage->data, data, bytes);
        return DG_OK;
    }
#ifdef DG_HAVE_CUDA
    dg_status s = dg__cuda_memcpy(ctx, t->storage->data, data, bytes, DG_COPY_H2D);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
#else
    return DG_ERR_UNSUPPORTED;
#endif
}

dg_status dg_tensor_from_f64(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                             const double *data, dg_tensor **out) {
    DG_TRY(dg__check_ptr("dg_tensor_from_f64", "data", data));
    DG_TRY(check_new_args("dg_tensor_from_f64", ctx, dtype, ndim, shape, out));
    int64_t n = dg__numel(ndim, shape);
    void *host = DG_MALLOC((size_t)(n ? n : 1) * dg_dtype_size(dtype));
    if (!host)
        return dg__err(DG_ERR_NOMEM, "dg_tensor_from_f64: out of host memory");
    for (int64_t i = 0; i < n; i++)
        dg__store_f64(host, dtype, i, data[i]);
    dg_status s = dg_tensor_from_host(ctx, dtype, ndim, shape, host, out);
    DG_FREE(host);
    return s;
}

dg_tensor *dg_tensor_retain(dg_tensor *t) {
    if (t)
        t->refcount++;
    return t;
}

void dg_tensor_free(dg_tensor **tp) {
    if (!tp || !*tp)
        return;
    dg_tensor *t = *tp;
    *tp = NULL;
    if (--t->refcount > 0)
        return;
    /* The tape may still route gradients through the slot after the tensor is gone. */
    dg__slot_release(&t->slot);
    storage_release(t->storage);
    DG_FREE(t);
}

void dg__slot_release(dg_gslot **sp) {
    dg_gslot *s = *sp;
    *sp = NULL;
    if (s && --s->refcount == 0) {
        dg_tensor_free(&s->grad);
        DG_FREE(s);
    }
}

int dg_tensor_ndim(const dg_tensor *t) { return t->ndim; }
const int64_t *dg_tensor_shape(const dg_tensor *t) { return t->shape; }
const int64_t *dg_tensor_strides(const dg_tensor *t) { return t->stride; }
int64_t dg_tensor_dim(const dg_tensor *t, int axis) {
    if (axis < 0)
        axis += t->ndim;
    return (axis >= 0 && axis < t->ndim) ? t->shape[axis] : -1;
}
int64_t dg_tensor_numel(const dg_tensor *t) { return dg__numel(t->ndim, t->shape); }
size_t dg_tensor_nbytes(const dg_tensor *t) {
    return (size_t)dg_tensor_numel(t) * dg_dtype_size(t->dtype);
}
dg_dtype dg_tensor_dtype(const dg_tensor *t) { return t->dtype; }
dg_device dg_tensor_device(const dg_tensor *t) { return t->device; }
dg_ctx *dg_tensor_ctx(const dg_tensor *t) { return t->storage->ctx; }
void *dg_tensor_data(const dg_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)dg_dtype_size(t->dtype);
}
void dg_tensor_set_name(dg_tensor *t, const char *name) {
    snprintf(t->name, sizeof t->name, "%s", name ? name : "");
}
const char *dg_tensor_name(const dg_tensor *t) { return t->name; }

int dg_tensor_is_contiguous(const dg_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s)
            return 0;
        s *= t->shape[i];
    }
    return 1;
}

int dg__same_shape(const dg_tensor *a, const dg_tensor *b) {
    if (a->ndim != b->ndim)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return 0;
    return 1;
}

/* ---- element access on host buffers ---- */

double dg__load_f64(const void *base, dg_dtype dt, int64_t i) {
    switch (dt) {
    case DG_F64:
        return ((const double *)base)[i];
    case DG_F32:
        return ((const float *)base)[i];
    case DG_BF16:
        return dg__bf16_to_f32(((const uint16_t *)base)[i]);
    case DG_I32:
        return ((const int32_t *)base)[i];
    case DG_I64:
        return (double)((const int64_t *)base)[i];
    default:
        return NAN;
    }
}

/* Float to integer: toward zero, saturating at the type's range, NaN to 0 -- a plain C cast of
 * a NaN or out-of-range value is undefined behaviour. */
static int64_t sat_i64(double v) {
    if (v != v)
        return 0;
    if (v >= 9223372036854775808.0) /* 2^63 */
        return INT64_MAX;
    if (v < -9223372036854775808.0)
        return INT64_MIN;
    return (int64_t)v;
}

static int32_t sat_i32(double v) {
    if (v != v)
        return 0;
    if (v >= 2147483648.0)
        return INT32_MAX;
    if (v <= -2147483649.0)
        return INT32_MIN;
    return (int32_t)v;
}

void dg__store_f64(void *base, dg_dtype dt, int64_t i, double v) {
    switch (dt) {
    case DG_F64:
        ((double *)base)[i] = v;
        break;
    case DG_F32:
        ((float *)base)[i] = (float)v;
        break;
    case DG_BF16:
        ((uint16_t *)base)[i] = dg__f32_to_bf16((float)v);
        break;
    case DG_I32:
        ((int32_t *)base)[i] = sat_i32(v);
        break;
    case DG_I64:
        ((int64_t *)base)[i] = sat_i64(v);
        break;
    default:
        break;
    }
}

/* Offset (elements) of the logical row-major index `i` in a strided layout. */
static int64_t strided_offset(int ndim, const int64_t *shape, const int64_t *stride, int64_t i) {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        int64_t c = i % shape[d];
        i /= shape[d];
        off += c * stride[d];
    }
    return off;
}

/* Host strided copy with dtype conversion; dst may be a strided view of the same shape. */
static void host_copy(dg_tensor *dstt, void *dst, dg_dtype ddt, const dg_tensor *src) {
    int64_t n = dg_tensor_numel(src);
    const void *base = dg_tensor_data(src);
    int scontig = dg_tensor_is_contiguous(src);
    int dcontig = !dstt || dg_tensor_is_contiguous(dstt);
    if (scontig && dcontig && ddt == src->dtype) {
        memcpy(dst, base, (size_t)n * dg_dtype_size(ddt));
        return;
    }
    int ints = (ddt == DG_I64 || ddt == DG_I32) && (src->dtype == DG_I64 || src->dtype == DG_I32);
    for (int64_t i = 0; i < n; i++) {
        int64_t off = scontig ? i : strided_offset(src->ndim, src->shape, src->stride, i);
        int64_t doff = dcontig ? i : strided_offset(dstt->ndim, dstt->shape, dstt->stride, i);
        if (ints) { /* keep 64-bit ids exact */
            int64_t v =
                src->dtype == DG_I64 ? ((const int64_t *)base)[off] : ((const int32_t *)base)[off];
            if (ddt == DG_I64)
                ((int64_t *)dst)[doff] = v;
            else
                ((int32_t *)dst)[doff] = (int32_t)v;
        } else {
            dg__store_f64(dst, ddt, doff, dg__load_f64(base, src->dtype, off));
        }
    }
}

#ifdef DG_HAVE_CUDA
static dg_layout layout_of(const dg_tensor *t) {
    dg_layout l;
    memset(&l, 0, sizeof l);
    l.ndim = t->ndim;
    memcpy(l.shape, t->shape, sizeof l.shape);
    memcpy(l.stride, t->stride, sizeof l.stride);
    return l;
}
#endif

dg_status dg_tensor_to_host(const dg_tensor *t, void *dst, size_t bytes) {
    DG_TRY(dg__check_ptr("dg_tensor_to_host", "t", t));
    DG_TRY(dg__check_ptr("dg_tensor_to_host", "dst", dst));
    if (bytes < dg_tensor_nbytes(t))
        return dg__err(DG_ERR_ARG, "dg_tensor_to_host: buffer of %zu bytes is smaller than %s",
                       bytes, dg_tensor_desc(t));
    if (t->device.kind == DG_DEV_CPU) {
        host_copy(NULL, dst, t->dtype, t);
        return DG_OK;
    }
#ifdef DG_HAVE_CUDA
    dg_ctx *ctx = t->storage->ctx;
    DG_TRY(dg__no_capture("dg_tensor_to_host", ctx, "a copy to host memory"));
    if (dg_tensor_is_contiguous(t))
        return dg__cuda_memcpy(ctx, dst, dg_tensor_data(t), dg_tensor_nbytes(t), DG_COPY_D2H);
    dg_tensor *c = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)t, &c));
    dg_status s = dg__cuda_memcpy(ctx, dst, dg_tensor_data(c), dg_tensor_nbytes(c), DG_COPY_D2H);
    dg_tensor_free(&c);
    return s;
#else
    return dg__no_cuda("dg_tensor_to_host");
#endif
}

dg_status dg_tensor_to_f64(const dg_tensor *t, double **out) {
    DG_TRY(dg__check_ptr("dg_tensor_to_f64", "t", t));
    DG_TRY(dg__check_ptr("dg_tensor_to_f64", "out", out));
    int64_t n = dg_tensor_numel(t);
    size_t bytes = dg_tensor_nbytes(t);
    void *raw = DG_MALLOC(bytes ? bytes : 1);
    double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
    if (!raw || !d) {
        DG_FREE(raw);
        free(d);
        return dg__err(DG_ERR_NOMEM, "dg_tensor_to_f64: out of host memory");
    }
    dg_status s = dg_tensor_to_host(t, raw, bytes);
    if (s == DG_OK)
        for (int64_t i = 0; i < n; i++)
            d[i] = dg__load_f64(raw, t->dtype, i);
    DG_FREE(raw);
    if (s != DG_OK) {
        free(d);
        return s;
    }
    *out = d;
    return DG_OK;
}

dg_status dg_tensor_item(const dg_tensor *t, double *out) {
    DG_TRY(dg__check_ptr("dg_tensor_item", "t", t));
    DG_TRY(dg__check_ptr("dg_tensor_item", "out", out));
    if (dg_tensor_numel(t) != 1)
        return dg__err(DG_ERR_SHAPE, "dg_tensor_item: tensor must have one element, got %s",
                       dg_tensor_desc(t));
    double *d;
    DG_TRY(dg_tensor_to_f64(t, &d));
    *out = d[0];
    free(d);
    return DG_OK;
}

/* ---- copies ---- */

dg_status dg_tensor_copy_(dg_tensor *dst, const dg_tensor *src) {
    const char *op = "dg_tensor_copy_";
    DG_TRY(dg__check_ptr(op, "dst", dst));
    DG_TRY(dg__check_ptr(op, "src", src));
    if (!dg__same_shape(dst, src))
        return dg__err(DG_ERR_SHAPE, "%s: dst %s and src %s differ in shape", op,
                       dg_tensor_desc(dst), dg_tensor_desc(src));
    if (dst->device.kind == DG_DEV_CPU && src->device.kind == DG_DEV_CPU) {
        host_copy(dst, dg_tensor_data(dst), dst->dtype, src);
        return DG_OK;
    }
#ifdef DG_HAVE_CUDA
    if (dst->device.kind == DG_DEV_CUDA && src->device.kind == DG_DEV_CUDA &&
        dst->device.index == src->device.index) {
        /* Work on another context's stream must finish before this stream reads its output. */
        if (src->storage->ctx != dst->storage->ctx)
            DG_TRY(dg_ctx_sync(src->storage->ctx));
        if (dst->dtype == src->dtype && dg_tensor_is_contiguous(dst) &&
            dg_tensor_is_contiguous(src))
            return dg__cuda_memcpy(dst->storage->ctx, dg_tensor_data(dst), dg_tensor_data(src),
                                   dg_tensor_nbytes(src), DG_COPY_D2D);
        return dg__cuda_copy_strided(dst->storage->ctx, dg_tensor_data(dst), dst->dtype,
                                     layout_of(dst), dg_tensor_data(src), src->dtype,
                                     layout_of(src), dg_tensor_numel(src));
    }
    /* Across devices: one memcpy when the dtypes match (and, host to device, the source is
     * contiguous); else stage through a host buffer in the source dtype and convert there. */
    for (int side = 0; side < 2; side++) {
        const dg_tensor *t = side ? dst : src;
        if (t->device.kind == DG_DEV_CUDA)
            DG_TRY(dg__no_capture(op, t->storage->ctx, "a copy between host and device memory"));
    }
    if (!dg_tensor_is_contiguous(dst))
        return dg__err(DG_ERR_ARG, "%s: a copy across devices needs a contiguous dst", op);
    size_t sb = dg_tensor_nbytes(src);
    if (dst->dtype == src->dtype && dst->device.kind == DG_DEV_CPU)
        return dg_tensor_to_host(src, dg_tensor_data(dst), sb);
    if (dst->dtype == src->dtype && src->device.kind == DG_DEV_CPU && dg_tensor_is_contiguous(src))
        return dg__cuda_memcpy(dst->storage->ctx, dg_tensor_data(dst), dg_tensor_data(src), sb,
                               DG_COPY_H2D);
    void *host = DG_MALLOC(sb ? sb : 1);
    if (!host)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    dg_status s = dg_tensor_to_host(src, host, sb);
    if (s == DG_OK) {
        if (dst->device.kind == DG_DEV_CPU) {
            for (int64_t i = 0; i < dg_tensor_numel(src); i++)
                dg__store_f64(dg_tensor_data(dst), dst->dtype, i,
                              dg__load_f64(host, src->dtype, i));
        } else if (dst->dtype == src->dtype) {
            s = dg__cuda_memcpy(dst->storage->ctx, dg_tensor_data(dst), host, sb, DG_COPY_H2D);
        } else {
            size_t db = dg_tensor_nbytes(dst);
            void *conv = DG_MALLOC(db ? db : 1);
            if (!conv) {
                s = dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
            } else {
                for (int64_t i = 0; i < dg_tensor_numel(src); i++)
                    dg__store_f64(conv, dst->dtype, i, dg__load_f64(host, src->dtype, i));
                s = dg__cuda_memcpy(dst->storage->ctx, dg_tensor_data(dst), conv, db, DG_COPY_H2D);
                DG_FREE(conv);
            }
        }
    }
    DG_FREE(host);
    return s;
#else
    return dg__no_cuda(op);
#endif
}

dg_status dg__data_as(dg_ctx *ctx, const dg_tensor *t, dg_dtype dt, int bf16_ok, dg_tensor **tmp,
                      const void **ptr, int *is_bf16) {
    *tmp = NULL;
    const int raw = bf16_ok && dg__is_cuda(t) && t->dtype == DG_BF16 && dg_tensor_is_contiguous(t);
    if (is_bf16)
        *is_bf16 = raw;
    if (raw || (t->dtype == dt && dg_tensor_is_contiguous(t))) {
        *ptr = dg_tensor_data(t);
        return DG_OK;
    }
    DG_TRY(dg_tensor_new(ctx, dt, t->ndim, t->shape, tmp));
    dg_status s = dg_tensor_copy_(*tmp, t);
    if (s != DG_OK) {
        dg_tensor_free(tmp);
        return s;
    }
    *ptr = dg_tensor_data(*tmp);
    return DG_OK;
}

dg_status dg__new_like(dg_ctx *ctx, const dg_tensor *t, dg_tensor **out) {
    return dg_tensor_new(ctx, t->dtype, t->ndim, t->shape, out);
}

dg_status dg__zeros_like(dg_ctx *ctx, const dg_tensor *t, dg_tensor **out) {
    return dg_tensor_zeros(ctx, t->dtype, t->ndim, t->shape, out);
}

dg_status dg__contig(dg_ctx *ctx, dg_tensor *t, dg_tensor **out) {
    if (dg_tensor_is_contiguous(t)) {
        *out = dg_tensor_retain(t);
        return DG_OK;
    }
    DG_TRY(dg__new_like(ctx, t, out));
    dg_status s = dg_tensor_copy_(*out, t);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg__axpy(dg_ctx *ctx, dg_tensor *dst, double alpha, const dg_tensor *src) {
    if (!dg__same_shape(dst, src))
        return dg__err(DG_ERR_SHAPE, "axpy: dst %s and src %s differ in shape", dg_tensor_desc(dst),
                       dg_tensor_desc(src));
    if (!dg_device_eq(dst->device, src->device))
        return dg__err(DG_ERR_DEVICE, "axpy: dst %s and src %s are on different devices",
                       dg_tensor_desc(dst), dg_tensor_desc(src));
    DG_ASSERT(dg_tensor_is_contiguous(dst));
    dg_tensor *s = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)src, &s));
    int64_t n = dg_tensor_numel(dst);
    dg_status st = DG_OK;
    if (dst->device.kind == DG_DEV_CPU) {
        void *d = dg_tensor_data(dst);
        const void *x = dg_tensor_data(s);
        if (dst->dtype == DG_F64 && s->dtype == DG_F64) {
            double *dd = d;
            const double *xx = x;
            for (int64_t i = 0; i < n; i++)
                dd[i] += alpha * xx[i];
        } else if (dst->dtype == DG_F32 && s->dtype == DG_F32) {
            float *dd = d;
            const float *xx = x;
            float a = (float)alpha;
            for (int64_t i = 0; i < n; i++)
                dd[i] += a * xx[i];
        } else {
            for (int64_t i = 0; i < n; i++)
                dg__store_f64(d, dst->dtype, i,
                              dg__load_f64(d, dst->dtype, i) +
                                  alpha * dg__load_f64(x, s->dtype, i));
        }
    } else {
#ifdef DG_HAVE_CUDA
        st = dg__cuda_axpy(ctx, dg_tensor_data(dst), dst->dtype, alpha, dg_tensor_data(s), s->dtype,
                           n);
#else
        st = dg__no_cuda("axpy");
#endif
    }
    dg_tensor_free(&s);
    return st;
}

/* ---- fills ---- */

static dg_status fill_impl(dg_tensor *t, int kind, uint64_t seed, double a, double b,
                           const char *op) {
    DG_TRY(dg__check_ptr(op, "t", t));
    if (!dg_tensor_is_contiguous(t))
        return dg__err(DG_ERR_ARG, "%s: tensor must be contiguous, got a strided view", op);
    int64_t n = dg_tensor_numel(t);
    if (t->device.kind == DG_DEV_CPU) {
        void *d = dg_tensor_data(t);
        for (int64_t i = 0; i < n; i++) {
            double v = kind == 2   ? a
                       : kind == 0 ? a + (b - a) * dg__u01(seed, (uint64_t)i)
                                   : a + b * dg__normal(seed, (uint64_t)i);
            dg__store_f64(d, t->dtype, i, v);
        }
        return DG_OK;
    }
#ifdef DG_HAVE_CUDA
    if (kind == 2)
        return dg__cuda_fill(t->storage->ctx, dg_tensor_data(t), t->dtype, n, a);
    return dg__cuda_rand(t->storage->ctx, dg_tensor_data(t), t->dtype, n, seed, kind, a, b);
#else
    return dg__no_cuda(op);
#endif
}

dg_status dg_tensor_fill_(dg_tensor *t, double value) {
    return fill_impl(t, 2, 0, value, 0, "dg_tensor_fill_");
}
dg_status dg_tensor_rand_uniform(dg_tensor *t, uint64_t seed, double lo, double hi) {
    return fill_impl(t, 0, seed, lo, hi, "dg_tensor_rand_uniform");
}
dg_status dg_tensor_rand_normal(dg_tensor *t, uint64_t seed, double mean, double std) {
    return fill_impl(t, 1, seed, mean, std, "dg_tensor_rand_normal");
}
double dg_rand_u01(uint64_t seed, uint64_t counter) { return dg__u01(seed, counter); }

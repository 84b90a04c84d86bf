/*
 * ops/views.c -- reshape, slice, transpose (views sharing storage) and contiguous, to_dtype,
 * to_device (copies); all differentiable.
 *
 *   reshape   y = x viewed as `shape`            dx = dy viewed as x's shape
 *   slice     y = x[..., start:end, ...]         dx = zeros with dy written into the slice
 *   transpose y = x with two axes swapped        dx = dy with the same axes swapped back
 *   copies    y = x (new layout/dtype/device)    dx = dy converted back
 */
#include "../autograd/tape.h"

/* A tensor header sharing t's storage with a new shape/stride/offset. */
static dg_status view_new(dg_tensor *t, int ndim, const int64_t *shape, const int64_t *stride,
                          int64_t offset, dg_tensor **out) {
    dg_tensor *v = DG_CALLOC(1, sizeof *v);
    if (!v)
        return dg__err(DG_ERR_NOMEM, "out of host memory creating a view");
    v->refcount = 1;
    v->ndim = ndim;
    memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
    memcpy(v->stride, stride, (size_t)ndim * sizeof *stride);
    v->offset = offset;
    v->dtype = t->dtype;
    v->device = t->device;
    v->storage = t->storage;
    t->storage->refcount++;
    *out = v;
    return DG_OK;
}

typedef struct {
    int ndim;
    int64_t shape[DG_MAX_DIMS];
    int axis0, axis1;
    int64_t start;
    dg_dtype dtype;
    dg_ctx *src_ctx;
} view_params;

static dg_status record(const char *op, dg_backward_fn bw, dg_ctx *ctx, dg_tensor *x, dg_tensor *y,
                        const view_params *p) {
    if (!dg__needs_grad(1, &x))
        return DG_OK;
    dg_node *n;
    DG_TRY(dg__node_new(op, DG_POLICY_CACHE, bw, ctx, &n));
    dg__node_input(n, x);
    dg__node_output(n, y);
    view_params *np = dg__node_params(n, sizeof *np);
    if (!np) {
        dg__node_abort(n);
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    }
    *np = *p;
    np->ndim = x->ndim;
    memcpy(np->shape, x->shape, sizeof np->shape);
    np->dtype = x->dtype;
    return dg__node_commit(n);
}

/* ---- reshape ---- */

static dg_status reshape_backward(dg_ctx *ctx, dg_node *n) {
    const view_params *p = n->params;
    dg_tensor *gy = (dg_tensor *)dg__node_grad_out(n, 0), *gc = NULL, *gx = NULL;
    DG_TRY(dg__contig(ctx, gy, &gc));
    dg_status s = dg_reshape(gc, p->ndim, p->shape, &gx);
    if (s == DG_OK)
        s = dg__node_accum(ctx, n, 0, gx);
    dg_tensor_free(&gx);
    dg_tensor_free(&gc);
    return s;
}

dg_status dg_reshape(dg_tensor *t, int ndim, const int64_t *shape, dg_tensor **out) {
    const char *op = "dg_reshape";
    DG_TRY(dg__check_ptr(op, "t", t));
    DG_TRY(dg__check_ptr(op, "shape", shape));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    if (ndim < 1 || ndim > DG_MAX_DIMS)
        return dg__err(DG_ERR_SHAPE, "%s: ndim must be 1..%d, got %d", op, DG_MAX_DIMS, ndim);
    if (!dg_tensor_is_contiguous(t))
        return dg__err(DG_ERR_ARG, "%s: input %s is a strided view; call dg_contiguous first", op,
                       dg_tensor_desc(t));
    int64_t s[DG_MAX_DIMS], known = 1;
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (s[i] == -1) {
            if (infer >= 0)
                return dg__err(DG_ERR_SHAPE, "%s: only one dimension may be -1", op);
            infer = i;
            s[i] = 1; /* until it is inferred */
        } else if (s[i] < 0) {
            return dg__err(DG_ERR_SHAPE, "%s: shape[%d] = %lld is negative", op, i,
                           (long long)s[i]);
        }
    }
    /* the given extents' product (and the new strides) must fit, also with a zero extent */
    if (!dg__shape_fits(ndim, s))
        return dg__err(DG_ERR_SHAPE, "%s: the new shape is too large", op);
    for (int i = 0; i < ndim; i++)
        if (i != infer)
            known *= s[i];
    int64_t n = dg_tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || n % known)
            return dg__err(DG_ERR_SHAPE, "%s: cannot infer the -1 dimension for %s", op,
                           dg_tensor_desc(t));
        s[infer] = n / known; /* the extents are then all nonzero, their product n */
        known *= s[infer];
    }
    if (known != n)
        return dg__err(DG_ERR_SHAPE, "%s: %s has %lld elements, the new shape has %lld", op,
                       dg_tensor_desc(t), (long long)n, (long long)known);
    int64_t st[DG_MAX_DIMS];
    dg__contig_strides(ndim, s, st);
    DG_TRY(view_new(t, ndim, s, st, t->offset, out));
    view_params p = {0};
    dg_status rs = record("reshape", reshape_backward, t->storage->ctx, t, *out, &p);
    if (rs != DG_OK)
        dg_tensor_free(out);
    return rs;
}

/* ---- slice ---- */

static dg_status slice_backward(dg_ctx *ctx, dg_node *n) {
    const view_params *p = n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    dg_tensor *gx = NULL, *win = NULL;
    DG_TRY(dg_tensor_zeros(ctx, gy->dtype, p->ndim, p->shape, &gx));
    dg_status s = dg_slice(gx, p->axis0, p->start, p->start + gy->shape[p->axis0], &win);
    if (s == DG_OK)
        s = dg_tensor_copy_(win, gy);
    dg_tensor_free(&win);
    if (s == DG_OK)
        s = dg__node_accum(ctx, n, 0, gx);
    dg_tensor_free(&gx);
    return s;
}

dg_status dg_slice(dg_tensor *t, int axis, int64_t start, int64_t end, dg_tensor **out) {
    const char *op = "dg_slice";
    DG_TRY(dg__check_ptr(op, "t", t));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    if (axis < 0)
        axis += t->ndim;
    if (axis < 0 || axis >= t->ndim)
        return dg__err(DG_ERR_ARG, "%s: axis out of range for %s", op, dg_tensor_desc(t));
    if (start < 0 || end > t->shape[axis] || start > end)
        return dg__err(DG_ERR_ARG, "%s: range [%lld, %lld) is outside axis %d of %s", op,
                       (long long)start, (long long)end, axis, dg_tensor_desc(t));
    int64_t s[DG_MAX_DIMS];
    memcpy(s, t->shape, sizeof s);
    s[axis] = end - start;
    DG_TRY(view_new(t, t->ndim, s, t->stride, t->offset + start * t->stride[axis], out));
    view_params p = {0};
    p.axis0 = axis;
    p.start = start;
    dg_status rs = record("slice", slice_backward, t->storage->ctx, t, *out, &p);
    if (rs != DG_OK)
        dg_tensor_free(out);
    return rs;
}

/* ---- transpose ---- */

static dg_status transpose_backward(dg_ctx *ctx, dg_node *n) {
    const view_params *p = n->params;
    dg_tensor *gy = (dg_tensor *)dg__node_grad_out(n, 0), *gt = NULL;
    DG_TRY(dg_transpose(gy, p->axis0, p->axis1, &gt));
    dg_status s = dg__node_accum(ctx, n, 0, gt);
    dg_tensor_free(&gt);
    return s;
}

dg_status dg_transpose(dg_tensor *t, int axis0, int axis1, dg_tensor **out) {
    const char *op = "dg_transpose";
    DG_TRY(dg__check_ptr(op, "t", t));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    if (axis0 < 0)
        axis0 += t->ndim;
    if (axis1 < 0)
        axis1 += t->ndim;
    if (axis0 < 0 || axis0 >= t->ndim || axis1 < 0 || axis1 >= t->ndim)
        return dg__err(DG_ERR_ARG, "%s: axes out of range for %s", op, dg_tensor_desc(t));
    int64_t s[DG_MAX_DIMS], st[DG_MAX_DIMS];
    memcpy(s, t->shape, sizeof s);
    memcpy(st, t->stride, sizeof st);
    s[axis0] = t->shape[axis1];
    s[axis1] = t->shape[axis0];
    st[axis0] = t->stride[axis1];
    st[axis1] = t->stride[axis0];
    DG_TRY(view_new(t, t->ndim, s, st, t->offset, out));
    view_params p = {0};
    p.axis0 = axis0;
    p.axis1 = axis1;
    dg_status rs = record("transpose", transpose_backward, t->storage->ctx, t, *out, &p);
    if (rs != DG_OK)
        dg_tensor_free(out);
    return rs;
}

/* ---- copies ---- */

static dg_status copy_backward(dg_ctx *ctx, dg_node *n) {
    const view_params *p = n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    dg_ctx *dst = p->src_ctx ? p->src_ctx : ctx;
    dg_tensor *gx = NULL;
    DG_TRY(dg_tensor_new(dst, p->dtype, p->ndim, p->shape, &gx));
    dg_status s = dg_tensor_copy_(gx, gy);
    if (s == DG_OK)
        s = dg__node_accum(dst, n, 0, gx);
    dg_tensor_free(&gx);
    return s;
}

static dg_status copy_op(const char *op, dg_ctx *ctx, dg_tensor *t, dg_dtype dtype,
                         dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "t", t));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg_tensor_new(ctx, dtype, t->ndim, t->shape, out));
    dg_status s = dg_tensor_copy_(*out, t);
    view_params p = {0};
    p.src_ctx = t->storage->ctx;
    if (s == DG_OK)
        s = record(op, copy_backward, ctx, t, *out, &p);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg_contiguous(dg_ctx *ctx, dg_tensor *t, dg_tensor **out) {
    DG_TRY(dg__check_ptr("dg_contiguous", "t", t));
    DG_TRY(dg__check_ptr("dg_contiguous", "out", out));
    if (dg_tensor_is_contiguous(t)) {
        *out = dg_tensor_retain(t);
        return DG_OK;
    }
    DG_TRY(dg__check_device("dg_contiguous", "t", t, ctx));
    return copy_op("contiguous", ctx, t, t->dtype, out);
}

dg_status dg_to_dtype(dg_ctx *ctx, dg_tensor *t, dg_dtype dtype, dg_tensor **out) {
    DG_TRY(dg__check_ptr("dg_to_dtype", "t", t));
    DG_TRY(dg__check_device("dg_to_dtype", "t", t, ctx));
    if ((unsigned)dtype >= DG_NDTYPES)
        return dg__err(DG_ERR_DTYPE, "dg_to_dtype: unknown dtype %d", (int)dtype);
    if (dg_tensor_requires_grad(t) && !dg_dtype_is_float(dtype))
        return dg__err(DG_ERR_DTYPE, "dg_to_dtype: cannot differentiate through a cast to %s",
                       dg_dtype_name(dtype));
    return copy_op("to_dtype", ctx, t, dtype, out);
}

dg_status dg_to_device(dg_ctx *dst_ctx, dg_tensor *t, dg_tensor **out) {
    DG_TRY(dg__check_ptr("dg_to_device", "dst_ctx", dst_ctx));
    DG_TRY(dg__check_ptr("dg_to_device", "t", t));
    return copy_op("to_device", dst_ctx, t, t->dtype, out);
}

/*
 * ops/elementwise.c -- add, sub and mul with NumPy broadcasting, and scale.
 *
 *   y = a + b      da = S_a(dy)          db = S_b(dy)
 *   y = a - b      da = S_a(dy)          db = -S_b(dy)
 *   y = a * b      da = S_a(dy * b)      db = S_b(dy * a)
 *   y = a * s      da = s * dy           (s a host double)
 *
 * Shapes: a and b are right-aligned; each dim of y is the larger of the two, and each input's dim
 * must equal it or be 1 (a missing leading dim counts as 1): a [2,1,4], b [3,1] -> y [2,3,4].
 * S_x(g) sums g over the dims along which x was broadcast, giving x's shape back.
 * Saved for backward: mul keeps a and b (each only if the other input wants a gradient); add, sub
 * and scale keep nothing. There are no intermediates, so CACHE and RECOMPUTE coincide.
 *
 * This file is also the worked example of an op in deltagrad (autograd/tape.h points here). Read it
 * top to bottom: argument checks that name the op, the argument and what was expected; a CPU
 * reference for f64 and f32 written once; dispatch to the CUDA kernels (kernels/elementwise.cu);
 * the forward that records a tape node; the backward that reads the node back.
 */
#include "../autograd/tape.h"
#include "../kernels/elementwise.cuh"
#include "elementwise.h"

/* The public op name for error messages, and the op kind that names tape nodes and policies. */
static const char *const k_op_name[] = {"dg_add", "dg_sub", "dg_mul"};
static const char *const k_node_kind[] = {"add", "sub", "mul"};

/* ---- checks ------------------------------------------------------------------------------- */

dg_status dg__check_float_dtype(const char *op, const char *arg, const dg_tensor *t) {
    DG_TRY(dg__check_dtype(op, arg, t, DG_FLOATS));
    if (!dg__is_cuda(t) && t->dtype == DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "%s: '%s' is bf16, which only the CUDA kernels compute; use f32 or f64 on "
                       "the CPU, got %s",
                       op, arg, dg_tensor_desc(t));
    if (dg__is_cuda(t) && t->dtype == DG_F64)
        return dg__err(DG_ERR_DTYPE,
                       "%s: '%s' is f64, which the CUDA kernels do not compute; use f32 or bf16 on "
                       "CUDA, got %s",
                       op, arg, dg_tensor_desc(t));
    return DG_OK;
}

/* Everything a binary op checks before touching data. Leaves *out NULL on any failure. */
static dg_status check_binary(const char *op, dg_ctx *ctx, const dg_tensor *a, const dg_tensor *b,
                              dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "a", a));
    DG_TRY(dg__check_ptr(op, "b", b));
    DG_TRY(dg__check_device(op, "a", a, ctx));
    DG_TRY(dg__check_device(op, "b", b, ctx));
    DG_TRY(dg__check_float_dtype(op, "a", a));
    return dg__check_same_dtype(op, "b", b, a);
}

/* ---- broadcasting ------------------------------------------------------------------------- */

/* y's shape under NumPy broadcasting, or DG_ERR_SHAPE naming the dim that clashes. */
static dg_status broadcast_shape(const char *op, const dg_tensor *a, const dg_tensor *b, int *ndim,
                                 int64_t *shape) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int d = 0; d < nd; d++) {
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim); /* < 0: a missing leading dim */
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char as[96], bs[96];
            snprintf(as, sizeof as, "%s", dg_tensor_desc(a));
            snprintf(bs, sizeof bs, "%s", dg_tensor_desc(b));
            return dg__err(DG_ERR_SHAPE,
                           "%s: a %s and b %s do not broadcast: dim %d (from the right) is %lld "
                           "vs %lld; each must match or be 1",
                           op, as, bs, nd - d, (long long)sa, (long long)sb);
        }
        shape[d] = sa == 1 ? sb : sa;
    }
    *ndim = nd;
    return DG_OK;
}

/* t's element strides aligned to y's dims: 0 along the dims t is broadcast along (where t has
 * size 1 or no dim at all), so the same logical index of y reads the right element of t. */
static dg_layout broadcast_layout(const dg_tensor *t, int ndim, const int64_t *shape) {
    dg_layout l;
    memset(&l, 0, sizeof l);
    l.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        int dt = d - (ndim - t->ndim);
        l.shape[d] = shape[d];
        l.stride[d] = (dt >= 0 && t->shape[dt] != 1) ? t->stride[dt] : 0;
    }
    return l;
}

/* Merge neighbouring dims that both inputs (and the contiguous y) walk as one, and drop size-1
 * dims, so loops are as long as they can be: [B,T,d] + [d] becomes [B*T,d] with strides (d,1)
 * and (0,1); two contiguous tensors of the same shape become one flat dim with strides 1 and 1. */
static void collapse(dg_layout *la, dg_layout *lb) {
    int k = 0;
    for (int d = 0; d < la->ndim; d++) {
        int64_t n = la->shape[d];
        if (n == 1)
            continue;
        if (k > 0 && la->stride[k - 1] == n * la->stride[d] &&
            lb->stride[k - 1] == n * lb->stride[d]) {
            la->shape[k - 1] *= n;
            lb->shape[k - 1] *= n;
            la->stride[k - 1] = la->stride[d];
            lb->stride[k - 1] = lb->stride[d];
            continue;
        }
        la->shape[k] = lb->shape[k] = n;
        la->stride[k] = la->stride[d];
        lb->stride[k] = lb->stride[d];
        k++;
    }
    if (k == 0) { /* every dim was 1 */
        la->shape[0] = lb->shape[0] = 1;
        la->stride[0] = lb->stride[0] = 0;
        k = 1;
    }
    la->ndim = lb->ndim = k;
}

/* ---- reference (CPU) ---------------------------------------------------------------------- */

/* The CPU walks y in tiles: a stretch of up to TILE elements along the last (collapsed) dim. Tiles
 * are independent, so OpenMP can share out both many short rows and one long row. */
#define TILE 4096

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t tile_count(const dg_layout *l) {
    int64_t last = l->shape[l->ndim - 1];
    return dg__numel(l->ndim - 1, l->shape) * ceil_div(last, TILE);
}

/* Where tile t starts in a, b and y, and how long it is. */
static void tile_start(const dg_layout *la, const dg_layout *lb, int64_t t, int64_t *oa,
                       int64_t *ob, int64_t *oy, int64_t *len) {
    int last = la->ndim - 1;
    int64_t per_row = ceil_div(la->shape[last], TILE);
    int64_t row = t / per_row, j0 = (t % per_row) * TILE;
    *len = la->shape[last] - j0 < TILE ? la->shape[last] - j0 : TILE;
    *oy = row * la->shape[last] + j0;
    *oa = j0 * la->stride[last];
    *ob = j0 * lb->stride[last];
    for (int d = last - 1; d >= 0; d--) { /* row -> coordinates of the outer dims */
        int64_t c = row % la->shape[d];
        row /= la->shape[d];
        *oa += c * la->stride[d];
        *ob += c * lb->stride[d];
    }
}

/* One tile of y = a (op) b, for T = double and float; f32 stays f32. sa, sb: strides along the
 * last dim (1 when contiguous, 0 when broadcast). */
#define DEFINE_BINARY_TILE(T)                                                                      \
    static void binary_tile_##T(dg_binary_kind kind, const T *a, int64_t sa, const T *b,           \
                                int64_t sb, T *y, int64_t len) {                                   \
        switch (kind) {                                                                            \
        case DG_BINARY_ADD:                                                                        \
            for (int64_t j = 0; j < len; j++)                                                      \
                y[j] = a[j * sa] + b[j * sb];                                                      \
            break;                                                                                 \
        case DG_BINARY_SUB:                                                                        \
            for (int64_t j = 0; j < len; j++)                                                      \
                y[j] = a[j * sa] - b[j * sb];                                                      \
            break;                                                                                 \
        case DG_BINARY_MUL:                                                                        \
            for (int64_t j = 0; j < len; j++)                                                      \
                y[j] = a[j * sa] * b[j * sb];                                                      \
            break;                                                                                 \
        }                                                                                          \
    }
DEFINE_BINARY_TILE(double)
DEFINE_BINARY_TILE(float)

static void binary_cpu(dg_binary_kind kind, dg_dtype dt, const void *a, dg_layout la, const void *b,
                       dg_layout lb, void *y) {
    int64_t ntiles = tile_count(&la);
    int64_t sa = la.stride[la.ndim - 1], sb = lb.stride[lb.ndim - 1];
#ifdef _OPENMP
#pragma omp parallel for if (ntiles > 16)
#endif
    for (int64_t t = 0; t < ntiles; t++) {
        int64_t oa, ob, oy, len;
        tile_start(&la, &lb, t, &oa, &ob, &oy, &len);
        if (dt == DG_F64)
            binary_tile_double(kind, (const double *)a + oa, sa, (const double *)b + ob, sb,
                               (double *)y + oy, len);
        else
            binary_tile_float(kind, (const float *)a + oa, sa, (const float *)b + ob, sb,
                              (float *)y + oy, len);
    }
}

static void scale_cpu(dg_dtype dt, const void *x, double s, void *y, int64_t n) {
    if (dt == DG_F64) {
        const double *xd = x;
        double *yd = y;
#ifdef _OPENMP
#pragma omp parallel for if (n > 65536)
#endif
        for (int64_t i = 0; i < n; i++)
            yd[i] = s * xd[i];
    } else {
        const float *xf = x;
        float *yf = y, sf = (float)s;
#ifdef _OPENMP
#pragma omp parallel for if (n > 65536)
#endif
        for (int64_t i = 0; i < n; i++)
            yf[i] = sf * xf[i];
    }
}

/* ---- compute: checked tensors in, new tensor out; not recorded ---------------------------- */
/* Forward and backward share these: the backward of mul is itself a broadcasting mul. */

static dg_status binary_compute(dg_ctx *ctx, dg_binary_kind kind, const dg_tensor *a,
                                const dg_tensor *b, dg_tensor **out) {
    int ndim = 0;
    int64_t shape[DG_MAX_DIMS];
    DG_TRY(broadcast_shape(k_op_name[kind], a, b, &ndim, shape));
    DG_TRY(dg_tensor_new(ctx, a->dtype, ndim, shape, out));
    int64_t n = dg__numel(ndim, shape);
    if (n == 0)
        return DG_OK;
    /* Strided inputs are read in place: their strides go into the layouts. */
    dg_layout la = broadcast_layout(a, ndim, shape), lb = broadcast_layout(b, ndim, shape);
    collapse(&la, &lb);
    dg_status s = DG_OK;
    if (dg__is_cuda(a)) {
#ifdef DG_HAVE_CUDA
        s = dg__binary_fwd_cuda(ctx, kind, a->dtype, dg_tensor_data(*out), dg_tensor_data(a), la,
                                dg_tensor_data(b), lb, n);
#else
        s = dg__no_cuda(k_op_name[kind]);
#endif
    } else {
        binary_cpu(kind, a->dtype, dg_tensor_data(a), la, dg_tensor_data(b), lb,
                   dg_tensor_data(*out));
    }
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

static dg_status scale_compute(dg_ctx *ctx, const dg_tensor *a, double s, dg_tensor **out) {
    dg_tensor *x = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)a, &x));
    dg_status st = dg__new_like(ctx, x, out);
    int64_t n = dg_tensor_numel(x);
    if (st == DG_OK && n > 0) {
        if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
            st = dg__scale_fwd_cuda(ctx, x->dtype, dg_tensor_data(*out), dg_tensor_data(x), s, n);
#else
            st = dg__no_cuda("dg_scale");
#endif
        } else {
            scale_cpu(x->dtype, dg_tensor_data(x), s, dg_tensor_data(*out), n);
        }
    }
    if (st != DG_OK)
        dg_tensor_free(out);
    dg_tensor_free(&x);
    return st;
}

/* ---- forward ------------------------------------------------------------------------------ */

/* What a node keeps besides its saved tensors: plain data, copied into the node. */
typedef struct {
    dg_binary_kind kind;
    int ndim[2]; /* the inputs' shapes, for summing gradients back to them */
    int64_t shape[2][DG_MAX_DIMS];
    double s; /* dg_scale's factor */
} ew_params;

static dg_status binary_backward(dg_ctx *ctx, dg_node *n);
static dg_status scale_backward(dg_ctx *ctx, dg_node *n);

/* Record y = op(a, b) on the tape when any input requires grad (b is NULL for scale).
 * save0, save1: what backward reads, as n->saved[0] and [1] (NULL is kept as an empty entry). */
static dg_status record(const char *kind, dg_backward_fn bw, dg_ctx *ctx, dg_tensor *a,
                        dg_tensor *b, dg_tensor *y, dg_tensor *save0, dg_tensor *save1,
                        const ew_params *params) {
    if (!dg__needs_grad(2, (dg_tensor *[]){a, b}))
        return DG_OK; /* grad mode off, or nothing here requires grad: no node */
    dg_node *n;
    DG_TRY(dg__node_new(kind, DG_POLICY_CACHE, bw, ctx, &n));
    ew_params *p = dg__node_params(n, sizeof *p);
    if (!p) {
        dg__node_abort(n);
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory recording the tape node", kind);
    }
    *p = *params;
    dg__node_input(n, a); /* gradient destinations, in order: backward addresses them as 0, 1 */
    if (b)
        dg__node_input(n, b);
    dg_status s = dg__node_output(n, y); /* y now requires grad */
    if (s != DG_OK) {
        dg__node_abort(n);
        return s;
    }
    dg__node_save(n, save0);
    dg__node_save(n, save1);
    return dg__node_commit(n); /* on failure the node is destroyed for us */
}

static dg_status binary_op(dg_binary_kind kind, dg_ctx *ctx, dg_tensor *a, dg_tensor *b,
                           dg_tensor **out) {
    DG_TRY(check_binary(k_op_name[kind], ctx, a, b, out));
    DG_TRY(binary_compute(ctx, kind, a, b, out));

    ew_params p = {.kind = kind, .ndim = {a->ndim, b->ndim}};
    memcpy(p.shape[0], a->shape, sizeof p.shape[0]);
    memcpy(p.shape[1], b->shape, sizeof p.shape[1]);
    /* add and sub need only the shapes. mul's da needs b and its db needs a: save each one only
     * if the other input will want its gradient, so x * w with a frozen x keeps only x. */
    dg_tensor *save0 = NULL, *save1 = NULL;
    if (kind == DG_BINARY_MUL) {
        save0 = dg_tensor_requires_grad(b) ? a : NULL;
        save1 = dg_tensor_requires_grad(a) ? b : NULL;
    }
    dg_status s = record(k_node_kind[kind], binary_backward, ctx, a, b, *out, save0, save1, &p);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg_add(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out) {
    return binary_op(DG_BINARY_ADD, ctx, a, b, out);
}

dg_status dg_sub(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out) {
    return binary_op(DG_BINARY_SUB, ctx, a, b, out);
}

dg_status dg_mul(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out) {
    return binary_op(DG_BINARY_MUL, ctx, a, b, out);
}

dg_status dg_scale(dg_ctx *ctx, dg_tensor *a, double s, dg_tensor **out) {
    const char *op = "dg_scale";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "a", a));
    DG_TRY(dg__check_device(op, "a", a, ctx));
    DG_TRY(dg__check_float_dtype(op, "a", a));
    DG_TRY(scale_compute(ctx, a, s, out));
    ew_params p = {.s = s};
    dg_status st = record("scale", scale_backward, ctx, a, NULL, *out, NULL, NULL, &p);
    if (st != DG_OK)
        dg_tensor_free(out);
    return st;
}

/* ---- backward ----------------------------------------------------------------------------- */
/* Runs with grad mode off. dy is y's gradient (contiguous, y's dtype); what is accumulated into
 * an input must have that input's shape, which S_x (dg__sum_to_shape) restores. */

static dg_status binary_backward(dg_ctx *ctx, dg_node *n) {
    const ew_params *p = n->params;
    const dg_tensor *dy = dg__node_grad_out(n, 0);
    dg_status s = DG_OK;
    for (int i = 0; i < 2 && s == DG_OK; i++) {
        if (!dg__node_wants_grad(n, i))
            continue;
        /* mul: d(a*b)/da = b and d(a*b)/db = a, broadcast like the forward */
        dg_tensor *t = NULL, *g = NULL;
        if (p->kind == DG_BINARY_MUL)
            s = binary_compute(ctx, DG_BINARY_MUL, dy, n->saved[1 - i], &t);
        double sign = (p->kind == DG_BINARY_SUB && i == 1) ? -1.0 : 1.0;
        if (s == DG_OK)
            s = dg__sum_to_shape(ctx, t ? t : dy, p->ndim[i], p->shape[i], sign, &g);
        if (s == DG_OK)
            s = dg__node_accum(ctx, n, i, g);
        dg_tensor_free(&g);
        dg_tensor_free(&t);
    }
    return s;
}

static dg_status scale_backward(dg_ctx *ctx, dg_node *n) {
    const ew_params *p = n->params;
    dg_tensor *g = NULL;
    DG_TRY(scale_compute(ctx, dg__node_grad_out(n, 0), p->s, &g));
    dg_status s = dg__node_accum(ctx, n, 0, g);
    dg_tensor_free(&g);
    return s;
}

/*
 * ops/matmul.c -- dg_matmul and dg_linear: one GEMM per product, forward and backward.
 *
 *   matmul  C = A B      A [M,K] or [Bt,M,K];  B [K,N], or [Bt,K,N] when A is 3-D
 *           dA = dC B^T,  dB = A^T dC
 *           With a 3-D A and a 2-D B the batch folds into rows: A is [Bt*M, K] and
 *           dB = sum_b A_b^T dC_b = A_rows^T dC_rows is a single GEMM.
 *   linear  y = x W^T    x [..., in] (leading dims fold into R rows), W [out, in] -> [..., out]
 *           dx = dy W,  dW = dy^T x
 *
 * Every product is a dg_gemm_desc (kernels/matmul.cuh): transposes are flags, so backward never
 * materialises W^T or A^T, and a transposed view (dg_transpose of the last two dims) is read in
 * place as a column-major operand. Other strided views are copied to contiguous memory first.
 * CPU: ops/gemm.c (f64, f32). CUDA: cuBLAS (f64, f32 without TF32, bf16 with f32 accumulation).
 */
#include "../autograd/tape.h"
#include "gemm.h"
#include "linear.h"

/* A matrix operand: the tensor that is read (a contiguous copy when the view is unusable) and
 * how: op(X)(i,j) = trans ? X[j*ld + i] : X[i*ld + j], batch item b at + b*bstride. */
typedef struct {
    dg_tensor *keep;
    int trans;
    int64_t ld, bstride;
} mat_op;

/* Can the last two dims of t be read as a row-major (trans 0) or column-major (trans 1)
 * matrix? A 1-D tensor is one row. */
static int mat_layout(const dg_tensor *t, int *trans, int64_t *ld) {
    int nd = t->ndim;
    int64_t R = nd >= 2 ? t->shape[nd - 2] : 1, C = t->shape[nd - 1];
    int64_t sR = nd >= 2 ? t->stride[nd - 2] : 0, sC = t->stride[nd - 1];
    if ((C <= 1 || sC == 1) && (R <= 1 || sR >= C)) {
        *trans = 0;
        *ld = R <= 1 ? (C > 1 ? C : 1) : sR;
        return *ld >= 1;
    }
    if ((R <= 1 || sR == 1) && (C <= 1 || sC >= R)) {
        *trans = 1;
        *ld = C <= 1 ? (R > 1 ? R : 1) : sC;
        return *ld >= 1;
    }
    return 0;
}

/* t's leading dims fold into rows of a row-major [rows, C] matrix with leading dimension ld? */
static int rows_layout(const dg_tensor *t, int64_t *ld) {
    int nd = t->ndim;
    int64_t C = t->shape[nd - 1];
    if (nd < 2 || (C > 1 && t->stride[nd - 1] != 1))
        return 0;
    int64_t R = t->shape[nd - 2];
    int64_t l = R > 1 ? t->stride[nd - 2] : C;
    if (l < C || l < 1)
        return 0;
    int64_t expect = l * R;
    for (int d = nd - 3; d >= 0; d--) {
        if (t->shape[d] != 1 && t->stride[d] != expect)
            return 0;
        expect *= t->shape[d];
    }
    *ld = l;
    return 1;
}

/* The operand for t (its last two dims, batch on dim 0 of a 3-D t), or, with `rows`, for t with
 * every leading dim folded into rows. `transpose` asks for op(X) = X^T. */
static dg_status mat_of(dg_ctx *ctx, dg_tensor *t, int transpose, int rows, mat_op *m) {
    memset(m, 0, sizeof *m);
    int ok;
    if (rows && t->ndim > 2) {
        ok = rows_layout(t, &m->ld);
        m->trans = 0;
    } else {
        ok = mat_layout(t, &m->trans, &m->ld);
        if (ok && t->ndim == 3 && t->shape[0] > 1)
            m->bstride = t->stride[0];
    }
    if (ok) {
        m->keep = dg_tensor_retain(t);
    } else {
        DG_TRY(dg__contig(ctx, t, &m->keep));
        int64_t C = t->shape[t->ndim - 1];
        m->trans = 0;
        m->ld = C > 1 ? C : 1;
        if (!rows && t->ndim == 3)
            m->bstride = t->shape[1] * t->shape[2];
    }
    m->trans ^= transpose;
    return DG_OK;
}

/* c (contiguous, [batch, m, n] elements) = op(a) op(b) + beta c (beta 0 or 1). Frees the
 * operands. */
static dg_status run_gemm_acc(dg_ctx *ctx, int64_t batch, int64_t m, int64_t n, int64_t k,
                              mat_op *a, mat_op *b, dg_tensor *c, double beta) {
    dg_status s = DG_OK;
    dg_gemm_desc g = {a->trans, b->trans, m,          n,          k,     batch, a->ld,
                      b->ld,    n,        a->bstride, b->bstride, m * n, 1.0,   beta};
    const void *pa = dg_tensor_data(a->keep), *pb = dg_tensor_data(b->keep);
    void *pc = dg_tensor_data(c);
    if (c->device.kind == DG_DEV_CPU) {
        if (c->dtype == DG_F64)
            s = dg__gemm_f64(&g, pa, pb, pc);
        else if (c->dtype == DG_F32)
            s = dg__gemm_f32(&g, pa, pb, pc);
        else
            s = dg__err(DG_ERR_DTYPE, "matmul: no CPU GEMM for %s", dg_dtype_name(c->dtype));
    } else {
#ifdef DG_HAVE_CUDA
        s = dg__matmul_cuda(ctx, c->dtype, &g, pa, pb, pc);
#else
        s = dg__no_cuda("matmul");
#endif
    }
    dg_tensor_free(&a->keep);
    dg_tensor_free(&b->keep);
    return s;
}

static dg_status run_gemm(dg_ctx *ctx, int64_t batch, int64_t m, int64_t n, int64_t k, mat_op *a,
                          mat_op *b, dg_tensor *c) {
    return run_gemm_acc(ctx, batch, m, n, k, a, b, c, 0.0);
}

/* Shared input checks: float dtypes that agree, on ctx's device, bf16 only on CUDA. */
static dg_status check_pair(const char *op, dg_ctx *ctx, const char *an, dg_tensor *a,
                            const char *bn, dg_tensor *b) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, an, a));
    DG_TRY(dg__check_ptr(op, bn, b));
    DG_TRY(dg__check_dtype(op, an, a, DG_FLOATS));
    DG_TRY(dg__check_same_dtype(op, bn, b, a));
    DG_TRY(dg__check_device(op, an, a, ctx));
    DG_TRY(dg__check_device(op, bn, b, ctx));
    if (a->device.kind == DG_DEV_CPU && a->dtype == DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "%s: bf16 is a CUDA dtype; on the CPU use f32 or f64 (got '%s' %s)", op, an,
                       dg_tensor_desc(a));
#ifndef DG_HAVE_CUDA
    if (a->device.kind == DG_DEV_CUDA)
        return dg__no_cuda(op);
#endif
    return DG_OK;
}

/* A new output of `shape` (zero-filled when the inner dimension is empty: no GEMM writes it). */
static dg_status new_out(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, int64_t k,
                         dg_tensor **out) {
    return k == 0 ? dg_tensor_zeros(ctx, dt, ndim, shape, out)
                  : dg_tensor_new(ctx, dt, ndim, shape, out);
}

// ---- matmul

enum { MM_2D, MM_BATCHED, MM_BCAST };

typedef struct {
    int mode;
    int64_t bt, m, n, k;
} mm_params;

static dg_status matmul_backward(dg_ctx *ctx, dg_node *nd) {
    const mm_params *p = nd->params;
    dg_tensor *gy = (dg_tensor *)dg__node_grad_out(nd, 0);
    dg_tensor *a = nd->saved[0], *b = nd->saved[1]; /* either may be NULL (not needed) */
    int64_t batch = p->mode == MM_BATCHED ? p->bt : 1;
    int64_t ashape[3] = {p->bt, p->m, p->k}, bshape[3] = {p->bt, p->k, p->n};
    int a_nd = p->mode == MM_2D ? 2 : 3, b_nd = p->mode == MM_BATCHED ? 3 : 2;
    int64_t rows = p->mode == MM_BCAST ? p->bt * p->m : p->m;
    int flat = p->mode == MM_BCAST;
    dg_status s = DG_OK;
    if (dg__node_wants_grad(nd, 0)) { /* dA = dC B^T */
        dg_tensor *ga = NULL;
        mat_op mg, mb;
        DG_TRY(new_out(ctx, gy->dtype, a_nd, ashape + 3 - a_nd, p->n, &ga));
        s = mat_of(ctx, gy, 0, flat, &mg);
        if (s == DG_OK) {
            s = mat_of(ctx, b, 1, 0, &mb);
            if (s == DG_OK)
                s = run_gemm(ctx, batch, rows, p->k, p->n, &mg, &mb, ga);
            else
                dg_tensor_free(&mg.keep);
        }
        if (s == DG_OK)
            s = dg__node_accum(ctx, nd, 0, ga);
        dg_tensor_free(&ga);
        DG_TRY(s);
    }
    if (dg__node_wants_grad(nd, 1)) { /* dB = A^T dC */
        dg_tensor *gb = NULL;
        mat_op ma, mg;
        DG_TRY(new_out(ctx, gy->dtype, b_nd, bshape + 3 - b_nd, rows, &gb));
        s = mat_of(ctx, a, 1, flat, &ma);
        if (s == DG_OK) {
            s = mat_of(ctx, gy, 0, flat, &mg);
            if (s == DG_OK)
                s = run_gemm(ctx, batch, p->k, p->n, rows, &ma, &mg, gb);
            else
                dg_tensor_free(&ma.keep);
        }
        if (s == DG_OK)
            s = dg__node_accum(ctx, nd, 1, gb);
        dg_tensor_free(&gb);
    }
    return s;
}

dg_status dg_matmul(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out) {
    const char *op = "dg_matmul";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(check_pair(op, ctx, "a", a, "b", b));
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3 || (a->ndim == 2 && b->ndim == 3))
        return dg__err(DG_ERR_SHAPE,
                       "%s: expected a [M,K] @ b [K,N], or a [Bt,M,K] @ b [Bt,K,N] or [K,N]; got "
                       "a %s and b %s",
                       op, dg_tensor_desc(a), dg_tensor_desc(b));
    mm_params p = {0};
    p.m = a->shape[a->ndim - 2];
    p.k = a->shape[a->ndim - 1];
    p.n = b->shape[b->ndim - 1];
    p.bt = a->ndim == 3 ? a->shape[0] : 1;
    if (b->shape[b->ndim - 2] != p.k)
        return dg__err(DG_ERR_SHAPE,
                       "%s: inner dimensions differ: a %s has K = %lld but b %s has K = %lld", op,
                       dg_tensor_desc(a), (long long)p.k, dg_tensor_desc(b),
                       (long long)b->shape[b->ndim - 2]);
    if (a->ndim == 3 && b->ndim == 3 && b->shape[0] != p.bt)
        return dg__err(DG_ERR_SHAPE, "%s: batch sizes differ: a %s, b %s", op, dg_tensor_desc(a),
                       dg_tensor_desc(b));
    p.mode = a->ndim == 2 ? MM_2D : b->ndim == 3 ? MM_BATCHED : MM_BCAST;

    int64_t shape[3] = {p.bt, p.m, p.n};
    int ond = a->ndim;
    dg_tensor *c = NULL;
    DG_TRY(new_out(ctx, a->dtype, ond, ond == 3 ? shape : shape + 1, p.k, &c));
    mat_op ma, mb;
    dg_status s = mat_of(ctx, a, 0, p.mode == MM_BCAST, &ma);
    if (s == DG_OK) {
        s = mat_of(ctx, b, 0, 0, &mb);
        if (s == DG_OK)
            s = run_gemm(ctx, p.mode == MM_BATCHED ? p.bt : 1,
                         p.mode == MM_BCAST ? p.bt * p.m : p.m, p.n, p.k, &ma, &mb, c);
        else
            dg_tensor_free(&ma.keep);
    }
    if (s == DG_OK && dg__needs_grad(2, (dg_tensor *[]){a, b})) {
        dg_node *nd;
        s = dg__node_new("matmul", DG_POLICY_CACHE, matmul_backward, ctx, &nd);
        if (s == DG_OK) {
            dg__node_input(nd, a);
            dg__node_input(nd, b);
            dg__node_output(nd, c);
            /* dA needs B and dB needs A: keep only what a wanted gradient reads */
            dg__node_save(nd, dg_tensor_requires_grad(b) ? a : NULL);
            dg__node_save(nd, dg_tensor_requires_grad(a) ? b : NULL);
            s = dg__node_commit_params(nd, &p, sizeof(mm_params));
        }
    }
    if (s != DG_OK) {
        dg_tensor_free(&c);
        return s;
    }
    *out = c;
    return DG_OK;
}

// ---- linear

dg_status dg__linear_y(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor **y) {
    *y = NULL;
    const int64_t out = w->shape[0], in = w->shape[1];
    const int64_t rows = dg__numel(x->ndim - 1, x->shape);
    int64_t shape[DG_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = out;
    dg_tensor *c = NULL;
    DG_TRY(new_out(ctx, x->dtype, x->ndim, shape, in, &c));
    mat_op mx, mw;
    dg_status s = mat_of(ctx, x, 0, 1, &mx);
    if (s == DG_OK) {
        s = mat_of(ctx, w, 1, 0, &mw);
        if (s == DG_OK)
            s = run_gemm(ctx, 1, rows, out, in, &mx, &mw, c);
        else
            dg_tensor_free(&mx.keep);
    }
    if (s != DG_OK)
        dg_tensor_free(&c);
    *y = c;
    return s;
}

dg_status dg__linear_grads(dg_ctx *ctx, dg_tensor *gy, dg_tensor *x, dg_tensor *w,
                           dg_tensor *gx_acc, dg_tensor **gx, dg_tensor **gw) {
    const int64_t out = w->shape[0], in = w->shape[1];
    const int64_t rows = dg__numel(gy->ndim - 1, gy->shape);
    dg_status s = DG_OK;
    if (gx || gx_acc) { /* dx = dy W: gy's shape with the last dim `in` */
        dg_tensor *dst = gx_acc;
        if (gx) {
            *gx = NULL;
            int64_t shape[DG_MAX_DIMS];
            memcpy(shape, gy->shape, sizeof shape);
            shape[gy->ndim - 1] = in;
            DG_TRY(new_out(ctx, w->dtype, gy->ndim, shape, out, gx));
            dst = *gx;
        }
        mat_op mg, mw;
        s = mat_of(ctx, gy, 0, 1, &mg);
        if (s == DG_OK) {
            s = mat_of(ctx, w, 0, 0, &mw);
            if (s == DG_OK)
                s = run_gemm_acc(ctx, 1, rows, in, out, &mg, &mw, dst, gx ? 0.0 : 1.0);
            else
                dg_tensor_free(&mg.keep);
        }
        if (s != DG_OK) {
            if (gx)
                dg_tensor_free(gx);
            return s;
        }
    }
    if (gw) { /* dW = dy^T x */
        *gw = NULL;
        mat_op mg, mx;
        s = new_out(ctx, w->dtype, 2, w->shape, rows, gw);
        if (s == DG_OK) {
            s = mat_of(ctx, gy, 1, 1, &mg);
            if (s == DG_OK) {
                s = mat_of(ctx, x, 0, 1, &mx);
                if (s == DG_OK)
                    s = run_gemm(ctx, 1, out, in, rows, &mg, &mx, *gw);
                else
                    dg_tensor_free(&mg.keep);
            }
        }
        if (s != DG_OK) {
            dg_tensor_free(gw);
            if (gx)
                dg_tensor_free(gx);
        }
    }
    return s;
}

static dg_status linear_backward(dg_ctx *ctx, dg_node *nd) {
    dg_tensor *gy = (dg_tensor *)dg__node_grad_out(nd, 0);
    dg_tensor *x = nd->saved[0], *w = nd->saved[1]; /* x is NULL when w needs no gradient */
    const int want_x = dg__node_wants_grad(nd, 0), want_w = dg__node_wants_grad(nd, 1);
    /* dx adds to the gradient x already has inside the GEMM where the slot allows it (no
     * separate add, no temporary): x feeds several linears in a row (q, k, v, gate projections) */
    dg_tensor *acc =
        want_x && gy->shape[gy->ndim - 1] > 0 ? dg__node_grad_inplace(nd, 0, w->dtype) : NULL;
    dg_tensor *gx = NULL, *gw = NULL;
    dg_status s =
        dg__linear_grads(ctx, gy, x, w, acc, want_x && !acc ? &gx : NULL, want_w ? &gw : NULL);
    if (s == DG_OK && gx)
        s = dg__node_accum(ctx, nd, 0, gx);
    if (s == DG_OK && gw)
        s = dg__node_accum(ctx, nd, 1, gw);
    dg_tensor_free(&gx);
    dg_tensor_free(&gw);
    return s;
}

dg_status dg__linear_check(const char *op, dg_ctx *ctx, const char *xname, dg_tensor *x,
                           dg_tensor *w) {
    DG_TRY(check_pair(op, ctx, xname, x, "w", w));
    if (w->ndim != 2)
        return dg__err(DG_ERR_SHAPE, "%s: 'w' must be [out, in], got %s", op, dg_tensor_desc(w));
    if (x->shape[x->ndim - 1] != w->shape[1])
        return dg__err(DG_ERR_SHAPE,
                       "%s: '%s' %s has %lld features in its last dim but w %s expects in = %lld",
                       op, xname, dg_tensor_desc(x), (long long)x->shape[x->ndim - 1],
                       dg_tensor_desc(w), (long long)w->shape[1]);
    return DG_OK;
}

dg_status dg_linear(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor **out) {
    const char *op = "dg_linear";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__linear_check(op, ctx, "x", x, w));
    dg_tensor *y = NULL;
    dg_status s = dg__linear_y(ctx, x, w, &y);
    if (s == DG_OK && dg__needs_grad(2, (dg_tensor *[]){x, w})) {
        dg_node *nd;
        s = dg__node_new("linear", DG_POLICY_CACHE, linear_backward, ctx, &nd);
        if (s == DG_OK) {
            dg__node_input(nd, x);
            dg__node_input(nd, w);
            dg__node_output(nd, y);
            dg__node_save(nd, dg_tensor_requires_grad(w) ? x : NULL);
            dg__node_save(nd, w); /* dx reads w; dW reads w's shape and dtype */
            s = dg__node_commit(nd);
        }
    }
    if (s != DG_OK) {
        dg_tensor_free(&y);
        return s;
    }
    *out = y;
    return DG_OK;
}

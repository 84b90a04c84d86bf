/*
 * ops/short_conv_cp.c -- dg_short_conv over a context-parallel split (distributed.md K7), and the
 * halo exchange it shares with dg_token_shift_cp (ops/token_shift.c): dg__cp_halo_cat, run by
 * dg__cp_halo_run after the shared checks dg__cp_check.
 *
 * Rank r's first output rows need the last W-1 conv inputs of rank r-1 when its local sequence 0
 * started there. One tape node ("short_conv_cp_halo") builds xe = [halo | x] ([1, W-1+T_r, C]):
 * every rank sends its last W-1 rows to r+1 and receives r-1's; only the last
 * min(W-1, pre_tokens) halo rows belong to local sequence 0, the others are zeroed (a sequence
 * that starts on this rank sees zeros before it, as in dg_short_conv). The ordinary dg_short_conv
 * then runs on xe with local sequence 0 extended by the W-1 halo rows, and the first W-1 output
 * rows are dropped. Backward of the halo node: the gradient of the valid halo rows goes back to
 * r-1, which adds it to the gradient of its last W-1 rows (masked rows send zeros, so nothing
 * leaks into an unrelated sequence). Gradients of w and bias are this rank's share: sum them over
 * the ranks (as data parallelism does). Rows are moved with tensor copies, so the node works
 * wherever the communicator can carry x.
 */
#include "../autograd/tape.h"
#include "../dist/dist.h"

#define OP "dg_short_conv_cp"

typedef struct {
    dg_comm *comm;
    int rank, world;
    int64_t h;     /* halo rows */
    int64_t valid; /* halo rows that belong to local sequence 0 (the last `valid` of h) */
} halo_params;

/* A view of rows [b, e) along axis 1, without recording. */
static dg_status rows(dg_tensor *t, int64_t b, int64_t e, dg_tensor **out) {
    dg_no_grad_begin();
    dg_status st = dg_slice(t, 1, b, e, out);
    dg_no_grad_end();
    return st;
}

static dg_status copy_rows(dg_tensor *dst, int64_t db, const dg_tensor *src, int64_t sb,
                           int64_t n) {
    dg_tensor *d = NULL, *s = NULL;
    dg_status st = rows(dst, db, db + n, &d);
    if (st == DG_OK)
        st = rows((dg_tensor *)src, sb, sb + n, &s);
    if (st == DG_OK)
        st = dg_tensor_copy_(d, s);
    dg_tensor_free(&d);
    dg_tensor_free(&s);
    return st;
}

/* Exchange: send rows [T-h, T) of `x` to `dst`, receive `h` rows from `src` into a new tensor
 * (zeros when src < 0). */
static dg_status exchange(dg_ctx *ctx, dg_comm *comm, dg_tensor *x, int64_t h, int dst, int src,
                          dg_tensor **recv) {
    const int64_t T = x->shape[1], C = x->shape[2];
    dg_tensor *send = NULL;
    dg_status st = dg_tensor_zeros(ctx, x->dtype, 3, (int64_t[]){1, h, C}, recv);
    if (st == DG_OK && dst >= 0) {
        st = dg_tensor_new(ctx, x->dtype, 3, (int64_t[]){1, h, C}, &send);
        if (st == DG_OK)
            st = copy_rows(send, 0, x, T - h, h);
    }
    if (st == DG_OK)
        st = dg_comm_shift(comm, send, dst, src >= 0 ? *recv : NULL, src);
    dg_tensor_free(&send);
    if (st != DG_OK)
        dg_tensor_free(recv);
    return st;
}

static dg_status halo_backward(dg_ctx *ctx, dg_node *n) {
    const halo_params *p = (const halo_params *)n->params;
    const dg_tensor *gxe = dg__node_grad_out(n, 0);
    const int64_t h = p->h, T = gxe->shape[1] - h, C = gxe->shape[2];
    dg_tensor *gx = NULL, *ghalo = NULL, *back = NULL, *tail = NULL;
    /* the gradient of this rank's valid halo rows goes to r-1; r+1's comes back to us */
    dg_status st = dg_tensor_zeros(ctx, gxe->dtype, 3, (int64_t[]){1, h, C}, &ghalo);
    if (st == DG_OK && p->valid > 0)
        st = copy_rows(ghalo, h - p->valid, gxe, h - p->valid, p->valid);
    if (st == DG_OK)
        st = dg_tensor_zeros(ctx, gxe->dtype, 3, (int64_t[]){1, h, C}, &back);
    if (st == DG_OK)
        st = dg_comm_shift(p->comm, p->rank > 0 ? ghalo : NULL, p->rank > 0 ? p->rank - 1 : -1,
                           p->rank + 1 < p->world ? back : NULL,
                           p->rank + 1 < p->world ? p->rank + 1 : -1);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, gxe->dtype, 3, (int64_t[]){1, T, C}, &gx);
    if (st == DG_OK)
        st = copy_rows(gx, 0, gxe, h, T);
    if (st == DG_OK && p->rank + 1 < p->world) {
        st = rows(gx, T - h, T, &tail);
        if (st == DG_OK)
            st = dg__axpy(ctx, tail, 1.0, back);
    }
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, gx);
    dg_tensor_free(&gx);
    dg_tensor_free(&ghalo);
    dg_tensor_free(&back);
    dg_tensor_free(&tail);
    return st;
}

dg_status dg__cp_halo_cat(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                          int64_t h, const char *kind, dg_tensor **xe) {
    const int64_t T = x->shape[1], C = x->shape[2];
    const int64_t valid = plan->pre_tokens < h ? plan->pre_tokens : h;
    dg_tensor *halo = NULL;
    dg_status st = exchange(ctx, comm, x, h, plan->rank + 1 < plan->world ? plan->rank + 1 : -1,
                            plan->rank > 0 ? plan->rank - 1 : -1, &halo);
    if (st == DG_OK)
        st = dg_tensor_zeros(ctx, x->dtype, 3, (int64_t[]){1, h + T, C}, xe);
    if (st == DG_OK && valid > 0)
        st = copy_rows(*xe, h - valid, halo, h - valid, valid);
    if (st == DG_OK)
        st = copy_rows(*xe, h, x, 0, T);
    dg_tensor_free(&halo);
    if (st == DG_OK && dg__needs_grad(1, &x)) {
        dg_node *n = NULL;
        st = dg__node_new(kind, DG_POLICY_CACHE, halo_backward, ctx, &n);
        if (st == DG_OK)
            dg__node_input(n, x);
        if (st == DG_OK)
            st = dg__node_output(n, *xe);
        halo_params hp = {comm, plan->rank, plan->world, h, valid};
        if (st == DG_OK)
            st = dg__node_commit_params(n, &hp, sizeof hp);
        else if (n)
            dg__node_abort(n);
    }
    if (st != DG_OK)
        dg_tensor_free(xe);
    return st;
}

dg_status dg__cp_check(const char *op, dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan,
                       const dg_tensor *x, dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "comm", comm));
    DG_TRY(dg__check_ptr(op, "plan", plan));
    DG_TRY(dg__check_ptr(op, "x", x));
    if (plan->world != dg_comm_size(comm) || plan->rank != dg_comm_rank(comm))
        return dg__err(DG_ERR_ARG, "%s: plan is for rank %d of %d but comm is rank %d of %d", op,
                       plan->rank, plan->world, dg_comm_rank(comm), dg_comm_size(comm));
    const int64_t T = plan->end - plan->begin;
    if (x->ndim != 3 || x->shape[0] != 1 || x->shape[1] != T)
        return dg__err(DG_ERR_SHAPE, "%s: x must be [1, %lld, C] (this rank's tokens), got %s", op,
                       (long long)T, dg_tensor_desc(x));
    return DG_OK;
}

dg_status dg__cp_halo_run(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                          int64_t h, const char *op, const char *kind, dg__cp_local_fn f, void *arg,
                          dg_tensor **out) {
    const int64_t T = plan->end - plan->begin;
    int64_t *cu = (int64_t *)DG_MALLOC(sizeof(int64_t) * ((size_t)plan->n_local + 1));
    if (!cu)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    cu[0] = 0;
    for (int i = 1; i <= plan->n_local; i++)
        cu[i] = plan->cu_local[i] + h;
    dg_tensor *xe = NULL, *ye = NULL, *ys = NULL;
    dg_status st = dg__cp_halo_cat(ctx, comm, plan, x, h, kind, &xe);
    if (st == DG_OK)
        st = f(ctx, xe, cu, plan->n_local, arg, &ye);
    if (st == DG_OK)
        st = dg_slice(ye, 1, h, h + T, &ys);
    if (st == DG_OK)
        st = dg_contiguous(ctx, ys, out);
    DG_FREE(cu);
    dg_tensor_free(&xe);
    dg_tensor_free(&ye);
    dg_tensor_free(&ys);
    return st;
}

typedef struct {
    dg_tensor *w, *bias;
    dg_act act;
} sc_cp_arg;

static dg_status sc_local(dg_ctx *ctx, dg_tensor *xe, const int64_t *cu, int n_seqs, void *arg,
                          dg_tensor **ye) {
    const sc_cp_arg *a = (const sc_cp_arg *)arg;
    return dg_short_conv(ctx, xe, a->w, a->bias, a->act, cu, n_seqs, ye);
}

dg_status dg_short_conv_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                           dg_tensor *w, dg_tensor *bias, dg_act act, dg_tensor **out) {
    DG_TRY(dg__cp_check(OP, ctx, comm, plan, x, out));
    DG_TRY(dg__check_ptr(OP, "w", w));
    if (w->ndim != 2 || w->shape[1] < 1 || w->shape[1] > 8)
        return dg__err(DG_ERR_SHAPE, OP ": w must be [C, W] with 1 <= W <= 8, got %s",
                       dg_tensor_desc(w));
    const int W = (int)w->shape[1];
    /* the same answer on every rank: no one is left waiting */
    for (int r = 0; r < plan->world; r++)
        if (plan->bounds[r + 1] - plan->bounds[r] < W - 1)
            return dg__err(DG_ERR_ARG,
                           OP ": every rank must hold at least W-1 = %d tokens, rank %d holds %lld",
                           W - 1, r, (long long)(plan->bounds[r + 1] - plan->bounds[r]));
    if (W == 1)
        return dg_short_conv(ctx, x, w, bias, act, plan->cu_local, plan->n_local, out);
    sc_cp_arg a = {w, bias, act};
    return dg__cp_halo_run(ctx, comm, plan, x, W - 1, OP, "short_conv_cp_halo", sc_local, &a, out);
}

/*
 * ops/kda/beta.c -- N2: beta from its raw input (kda.md §11.3, FLA use_beta_sigmoid_in_kernel).
 *
 *   beta = c sigmoid(b),   c = 2 with allow_neg_eigval (eigenvalue 1 - beta in (-1, 1)) else 1
 *   db = dbeta c s (1 - s)
 * b, beta: any shape (KDA: [B,T,HV]). The node keeps b only: sigmoid is cheaper to recompute than
 * to store, so CACHE and RECOMPUTE keep the same. CUDA: b f32 or bf16, computed in f32, beta in
 * b's dtype (the composite keeps it in f32).
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/beta.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

void RF(dg__kda_beta_fwd)(int64_t n, RT c, const RT *b, RT *beta) {
    KDA_OMP(parallel for schedule(static) if (n > 65536))
    for (int64_t i = 0; i < n; i++)
        beta[i] = c * RF(kda_sigmoid)(b[i]);
}

void RF(dg__kda_beta_bwd)(int64_t n, RT c, const RT *b, const RT *dbeta, RT *db) {
    KDA_OMP(parallel for schedule(static) if (n > 65536))
    for (int64_t i = 0; i < n; i++) {
        RT s = RF(kda_sigmoid)(b[i]);
        db[i] = dbeta[i] * c * s * ((RT)1 - s);
    }
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_beta"

typedef struct beta_params {
    dg_dtype dt; /* compute dtype (f32 on CUDA) */
    int cuda;
    double c;
} beta_params;

static dg_status beta_backward(dg_ctx *ctx, dg_node *n) {
    const beta_params *p = (const beta_params *)n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    dg_tensor *tg = NULL, *tb = NULL, *db = NULL, *b = n->saved[0];
    const void *pg = NULL, *pb = NULL;
    int bbf16 = 0;
    dg_status st = dg__kda_ptr(ctx, gy, p->dt, &tg, &pg);
    if (st == DG_OK)
        st = dg__kda_in_ptr(ctx, b, p->dt, &tb, &pb, &bbf16);
    if (st == DG_OK) /* in b's dtype where the kernel writes bf16 */
        st = dg_tensor_new(ctx, bbf16 ? DG_BF16 : p->dt, b->ndim, b->shape, &db);
    if (st == DG_OK)
        st = kda_run_beta_bwd(ctx, p->cuda, p->dt, dg_tensor_numel(db), p->c, bbf16, pb, pg,
                              dg_tensor_data(db));
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, db);
    dg_tensor_free(&tg);
    dg_tensor_free(&tb);
    dg_tensor_free(&db);
    return st;
}

dg_status dg__kda_beta_x(dg_ctx *ctx, dg_tensor *b, int allow_neg_eigval, int keep_f32,
                         dg_tensor **beta) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "beta", beta));
    *beta = NULL;
    DG_TRY(dg__check_ptr(OP, "b", b));
    DG_TRY(dg__kda_check_first(OP, "b", b, ctx, b->ndim, "B,T,HV"));
    beta_params bp = {b->dtype, dg__is_cuda(b), allow_neg_eigval ? 2.0 : 1.0};
#ifndef DG_HAVE_CUDA
    if (bp.cuda)
        return dg__no_cuda(OP);
#endif
    if (bp.cuda)
        bp.dt = DG_F32;
    dg_tensor *tb = NULL, *bc = NULL; /* bc: beta in the compute dtype */
    const void *pb = NULL;
    int bbf16 = 0;
    dg_status st = dg__kda_in_ptr(ctx, b, bp.dt, &tb, &pb, &bbf16);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, bp.dt, b->ndim, b->shape, &bc);
    if (st == DG_OK)
        st = kda_run_beta_fwd(ctx, bp.cuda, bp.dt, dg_tensor_numel(b), bp.c, bbf16, pb,
                              dg_tensor_data(bc));
    if (st == DG_OK)
        st = dg__kda_as_dtype(ctx, bc, keep_f32 ? bp.dt : b->dtype, beta);
    if (st == DG_OK && dg__needs_grad(1, &b)) {
        dg_node *n;
        st = dg__node_new("kda_beta", DG_POLICY_RECOMPUTE, beta_backward, ctx, &n);
        if (st == DG_OK) {
            dg__node_input(n, b);
            if (st == DG_OK)
                st = dg__node_output(n, *beta);
            if (st == DG_OK)
                dg__node_save(n, b);
            beta_params *pp = st == DG_OK ? (beta_params *)dg__node_params(n, sizeof *pp) : NULL;
            if (st == DG_OK && !pp)
                st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
            if (st == DG_OK) {
                *pp = bp;
                st = dg__node_commit(n);
            } else {
                dg__node_abort(n);
            }
        }
    }
    dg_tensor_free(&tb);
    dg_tensor_free(&bc);
    if (st != DG_OK)
        dg_tensor_free(beta);
    return st;
}

dg_status dg_kda_beta(dg_ctx *ctx, dg_tensor *b, int allow_neg_eigval, dg_tensor **beta) {
    return dg__kda_beta_x(ctx, b, allow_neg_eigval, 0, beta);
}
#endif

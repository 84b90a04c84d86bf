/*
 * ops/kda/beta.c -- N2: beta from its raw input (spec §4, FLA use_beta_sigmoid_in_kernel).
 *
 *   beta = c sigmoid(b),   c = 2 with allow_neg_eigval (eigenvalue 1 - beta in (-1, 1)) else 1
 *   db = dbeta c s (1 - s)
 * b, beta: any shape (KDA: [B,T,HV]). The node keeps b only: sigmoid is cheaper to recompute than
 * to store, so CACHE and RECOMPUTE keep the same.
 */
#ifndef KDA_TMPL
#include "kda.h"
#define KDA_TMPL "beta.c"
#include "kda_tmpl.h"
#endif

#ifdef KT
/* ---- reference ------------------------------------------------------------------------------ */

void KF(kda_beta_fwd)(int64_t n, KT c, const KT *b, KT *beta) {
    for (int64_t i = 0; i < n; i++)
        beta[i] = c * KF(kda_sigmoid)(b[i]);
}

void KF(kda_beta_bwd)(int64_t n, KT c, const KT *b, const KT *dbeta, KT *db) {
    for (int64_t i = 0; i < n; i++) {
        KT s = KF(kda_sigmoid)(b[i]);
        db[i] = dbeta[i] * c * s * ((KT)1 - s);
    }
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_beta"

typedef struct beta_params {
    dg_dtype dt;
    double c;
} beta_params;

static dg_status beta_backward(dg_ctx *ctx, dg_node *n) {
    const beta_params *p = (const beta_params *)n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    dg_tensor *tg = NULL, *tb = NULL, *db = NULL;
    const void *pg = NULL, *pb = NULL;
    dg_status st = kda_host(ctx, gy, p->dt, &tg, &pg);
    if (st == DG_OK)
        st = kda_host(ctx, n->saved[0], p->dt, &tb, &pb);
    if (st == DG_OK)
        st = dg__new_like(ctx, n->saved[0], &db);
    if (st == DG_OK) {
        KDA_CALL(p->dt, kda_beta_bwd, dg_tensor_numel(db), p->c, pb, pg, dg_tensor_data(db));
        st = dg__node_accum(ctx, n, 0, db);
    }
    dg_tensor_free(&tg);
    dg_tensor_free(&tb);
    dg_tensor_free(&db);
    return st;
}

dg_status dg_kda_beta(dg_ctx *ctx, dg_tensor *b, int allow_neg_eigval, dg_tensor **beta) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "beta", beta));
    *beta = NULL;
    DG_TRY(dg__check_ptr(OP, "b", b));
    DG_TRY(kda_check_first(OP, "b", b, b->ndim, "B,T,HV"));
    beta_params bp = {b->dtype, allow_neg_eigval ? 2.0 : 1.0};
    dg_tensor *tb = NULL;
    const void *pb = NULL;
    dg_status st = kda_host(ctx, b, bp.dt, &tb, &pb);
    if (st == DG_OK)
        st = dg__new_like(ctx, b, beta);
    if (st == DG_OK)
        KDA_CALL(bp.dt, kda_beta_fwd, dg_tensor_numel(b), bp.c, pb, dg_tensor_data(*beta));
    if (st == DG_OK && dg__needs_grad(1, &b)) {
        dg_node *n;
        st = dg__node_new("kda_beta", DG_POLICY_RECOMPUTE, beta_backward, ctx, &n);
        if (st == DG_OK) {
            st = dg__node_input(n, b);
            if (st == DG_OK)
                st = dg__node_output(n, *beta);
            if (st == DG_OK)
                st = dg__node_save(n, b);
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
    if (st != DG_OK)
        dg_tensor_free(beta);
    return st;
}
#endif

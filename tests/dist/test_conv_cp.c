/*
 * tests/dist/test_conv_cp.c -- the halo-exchange ops on 2 and 4 ranks against one rank:
 * dg_short_conv_cp against dg_short_conv (y and dx on the rank's slice, dw and dbias summed over
 * the ranks) and dg_token_shift_cp against dg_token_shift (y and dx); f64 1e-10, f32 1e-5,
 * norm-relative. Cases: one sequence, varlen packs with sequences that start 1 or 2 tokens
 * before a rank boundary (fewer than W-1 halo rows are valid) or start or end right at one,
 * uneven splits, ranks holding a single token (token shift), W = 2 and 4, with and without bias
 * and SiLU. gpu mode: the f32 cases on CUDA (device 0 shared by every rank) against the one-rank
 * op on CUDA.
 */
#include "../kda_testutil.h"
#include "dist_util.h"

#include <string.h>

typedef struct ccase {
    const char *name;
    int64_t T, C;
    int W;
    const int64_t *cu;
    int nseq;
    int uneven, bias;
    dg_act act;
    int shift; /* dg_token_shift(_cp) instead of the conv (W, bias, act unused) */
} ccase;

/* uneven: 1: growing slices; 2: one token on every rank but the last */
static void split_tokens(int world, int64_t T, int uneven, int64_t *out) {
    int64_t used = 0;
    for (int r = 0; r < world - 1; r++) {
        out[r] = uneven == 2 ? 1 : uneven ? T * (2 * r + 1) / ((int64_t)world * world) : T / world;
        used += out[r];
    }
    out[world - 1] = T - used;
}

typedef struct cres {
    double *y, *dx, *dw, *db;
} cres;

static void run(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const ccase *c, dg_dtype dt,
                const double *x, const double *w, const double *bias, const double *dy, cres *r) {
    const int64_t b = plan ? plan->begin : 0, e = plan ? plan->end : c->T;
    dg_tensor *tx = kt_tensor(ctx, dt, 3, (int64_t[]){1, e - b, c->C}, x + b * c->C, 1);
    dg_tensor *tw = c->shift ? NULL : kt_tensor(ctx, dt, 2, (int64_t[]){c->C, c->W}, w, 1);
    dg_tensor *tb = c->bias ? kt_tensor(ctx, dt, 1, (int64_t[]){c->C}, bias, 1) : NULL;
    dg_tensor *y = NULL;
    dg_tape_reset();
    if (plan && c->shift)
        DG_TEST_TRY(dg_token_shift_cp(ctx, comm, plan, tx, &y));
    else if (c->shift)
        DG_TEST_TRY(dg_token_shift(ctx, tx, c->cu, c->nseq, &y));
    else if (plan)
        DG_TEST_TRY(dg_short_conv_cp(ctx, comm, plan, tx, tw, tb, c->act, &y));
    else
        DG_TEST_TRY(dg_short_conv(ctx, tx, tw, tb, c->act, c->cu, c->nseq, &y));
    dg_tensor *g = kt_tensor(ctx, dt, 3, (int64_t[]){1, e - b, c->C}, dy + b * c->C, 0);
    DG_TEST_TRY(dg_tape_backward_with(ctx, y, g));
    if (plan && tw) {
        DG_TEST_TRY(dg_comm_all_reduce(comm, (dg_tensor *)dg_tensor_grad(tw)));
        if (tb)
            DG_TEST_TRY(dg_comm_all_reduce(comm, (dg_tensor *)dg_tensor_grad(tb)));
    }
    r->y = kt_host(y, dg_tensor_numel(y));
    r->dx = kt_host(dg_tensor_grad(tx), dg_tensor_numel(tx));
    r->dw = tw ? kt_host(dg_tensor_grad(tw), dg_tensor_numel(tw)) : NULL;
    r->db = tb ? kt_host(dg_tensor_grad(tb), c->C) : NULL;
    dg_tape_reset();
    dg_tensor_free(&tx);
    dg_tensor_free(&tw);
    dg_tensor_free(&tb);
    dg_tensor_free(&y);
    dg_tensor_free(&g);
}

static void run_case(dg_ctx *ctx, dg_comm *comm, const ccase *c, dg_dtype dt, double tol) {
    const int W = dg_comm_size(comm), R = dg_comm_rank(comm);
    const int64_t n = c->T * c->C;
    double *x = kt_randn(n, 11, 1.0), *w = kt_randn(c->C * (c->W > 0 ? c->W : 1), 12, 0.5);
    double *bias = kt_randn(c->C, 13, 0.5), *dy = kt_randn(n, 14, 1.0);
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)W);
    split_tokens(W, c->T, c->uneven, tok);
    dg_cp_plan *plan = NULL;
    DG_TEST_TRY(dg_cp_plan_new(W, R, c->T, c->cu, c->nseq, tok, &plan));
    cres want, got;
    run(ctx, comm, NULL, c, dt, x, w, bias, dy, &want);
    run(ctx, comm, plan, c, dt, x, w, bias, dy, &got);
    const int64_t b = plan->begin, e = plan->end;
    char name[160];
    snprintf(name, sizeof name, "%s %s%s [%lld,%lld) pre_tokens %lld: y", dg_dtype_name(dt),
             c->shift ? "token shift " : "", c->name, (long long)b, (long long)e,
             (long long)plan->pre_tokens);
    dg_check_rel(name, got.y, want.y + b * c->C, (e - b) * c->C, tol);
    snprintf(name, sizeof name, "%s %s: dx", dg_dtype_name(dt), c->name);
    dg_check_rel(name, got.dx, want.dx + b * c->C, (e - b) * c->C, tol);
    if (!c->shift) {
        snprintf(name, sizeof name, "%s %s: dw (summed)", dg_dtype_name(dt), c->name);
        dg_check_rel(name, got.dw, want.dw, c->C * c->W, tol);
    }
    if (c->bias && !c->shift) {
        snprintf(name, sizeof name, "%s %s: dbias (summed)", dg_dtype_name(dt), c->name);
        dg_check_rel(name, got.db, want.db, c->C, tol);
    }
    cres *rs[2] = {&want, &got};
    for (int i = 0; i < 2; i++) {
        free(rs[i]->y);
        free(rs[i]->dx);
        free(rs[i]->dw);
        free(rs[i]->db);
    }
    dg_cp_plan_free(&plan);
    free(tok);
    free(x);
    free(w);
    free(bias);
    free(dy);
}

static void test_errors(dg_ctx *ctx, dg_comm *comm) {
    const int W = dg_comm_size(comm), R = dg_comm_rank(comm);
    /* every rank holds 2 tokens: too few for W = 4 */
    dg_cp_plan *plan = NULL;
    DG_TEST_TRY(dg_cp_plan_new(W, R, 2 * W, NULL, 0, NULL, &plan));
    double xs[2 * 3] = {0}, ws[3 * 4] = {0};
    dg_tensor *x = kt_tensor(ctx, DG_F64, 3, (int64_t[]){1, 2, 3}, xs, 0);
    dg_tensor *w = kt_tensor(ctx, DG_F64, 2, (int64_t[]){3, 4}, ws, 0), *y = NULL;
    dg_check_err(dg_short_conv_cp(ctx, comm, plan, x, w, NULL, DG_ACT_NONE, &y), DG_ERR_ARG,
                 "at least W-1", "ranks with fewer than W-1 tokens");
    dg_tensor *xb = kt_tensor(ctx, DG_F64, 3, (int64_t[]){1, 1, 3}, xs, 0);
    dg_check_err(dg_short_conv_cp(ctx, comm, plan, xb, w, NULL, DG_ACT_NONE, &y), DG_ERR_SHAPE,
                 "this rank's tokens", "x of the wrong length");
    dg_check_err(dg_token_shift_cp(ctx, comm, plan, xb, &y), DG_ERR_SHAPE, "this rank's tokens",
                 "token shift: x of the wrong length");
    dg_check_err(dg_token_shift_cp(ctx, comm, NULL, x, &y), DG_ERR_ARG, "plan",
                 "token shift: plan NULL");
    dg_tensor_free(&x);
    dg_tensor_free(&xb);
    dg_tensor_free(&w);
    dg_cp_plan_free(&plan);
}

/* 4 ranks of 15 tokens: boundaries 15, 30, 45; sequences start 1 before (14, 29, 44) */
static const int64_t cu_near[] = {0, 14, 29, 31, 44, 60};
static const int64_t cu_ends[] = {0, 15, 30, 33, 60}; /* ends exactly at boundaries */
/* 9 tokens, every rank but the last holding one: sequences start on ranks 1 and 2 (np 4) */
static const int64_t cu_tiny[] = {0, 1, 2, 9};

static const ccase cases[] = {
    /* name           T    C  W  cu       nseq uneven bias act shift */
    {"one seq", 64, 6, 4, NULL, 0, 0, 1, DG_ACT_SILU, 0},
    {"one seq W=2", 64, 5, 2, NULL, 0, 1, 0, DG_ACT_NONE, 0},
    {"starts near a boundary", 60, 4, 4, cu_near, 5, 0, 1, DG_ACT_SILU, 0},
    {"ends at boundaries", 60, 4, 4, cu_ends, 4, 0, 0, DG_ACT_SILU, 0},
    {"uneven", 160, 3, 4, cu_near, 5, 1, 1, DG_ACT_NONE, 0},
    /* token shift: one halo row (W, bias, act unused) */
    {"one seq", 64, 6, 0, NULL, 0, 0, 0, DG_ACT_NONE, 1},
    {"starts near a boundary", 60, 4, 0, cu_near, 5, 0, 0, DG_ACT_NONE, 1},
    {"starts and ends at boundaries", 60, 4, 0, cu_ends, 4, 0, 0, DG_ACT_NONE, 1},
    {"uneven", 160, 3, 0, cu_near, 5, 1, 0, DG_ACT_NONE, 1},
    {"one token per rank", 9, 5, 0, NULL, 0, 2, 0, DG_ACT_NONE, 1},
    {"one token per rank, varlen", 9, 3, 0, cu_tiny, 3, 2, 0, DG_ACT_NONE, 1},
};

int main(int argc, char **argv) {
    dg_comm *comm = dt_init(argc, argv, "conv_cp");
    dg_ctx *ctx = dt_ctx(&comm);
    const int gpu = dg_test_gpu_mode();
    if (!gpu)
        test_errors(ctx, comm);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ccase c = cases[i];
        if (c.cu == cu_near && c.T == 160) { /* the same pack stretched to 160 tokens */
            static int64_t cu_big[6];
            for (int j = 0; j < 6; j++)
                cu_big[j] = cu_near[j] * 160 / 60;
            c.cu = cu_big;
        }
        if (!gpu) /* CUDA: f32 and bf16 only */
            run_case(ctx, comm, &c, DG_F64, 1e-10);
        run_case(ctx, comm, &c, DG_F32, 1e-5);
    }
    dg_ctx_free(&ctx);
    return dt_finish(&comm, "conv_cp");
}

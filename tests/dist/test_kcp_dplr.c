/*
 * tests/dist/test_kcp_dplr.c -- dg_dplr_chunk_cp (KCP for DPLR) on 2 and 4 ranks against
 * dg_dplr_chunk on one.
 *
 * Every rank builds the same global inputs (RWKV-7's stable form, as tests/test_dplr.c: a = -kh,
 * b = alpha kh with kh unit-norm, alpha in (0.1, 0.9), three gate ranges), runs the unsplit op
 * itself (the reference), then its slice through the CP op; o, ht and every gradient must equal
 * the reference (norm-relative: f64 1e-10, f32 1e-5). Per-token tensors (o, dq, dk, dv, da, db,
 * dgk) are compared on the rank's slice; ht (zero rows for sequences ending elsewhere) and dh0
 * (each rank's share) are summed over the ranks first. Cases: one sequence cut at and off chunk
 * boundaries, an uneven split (a rank holding only the middle of a sequence), varlen packs whose
 * sequences start, end or span rank boundaries, ranks holding the tail of one sequence and the
 * head of the next, many short sequences, with and without h0, chunk sizes 16/32/64, both tape
 * policies. Also argument errors. gpu mode: the f32 cases on CUDA against the unsplit op on
 * CUDA.
 */
#include "../kda_testutil.h"
#include "dist_util.h"

#include "autograd/tape.h"

#include <math.h>
#include <string.h>

enum { IQ, IK, IV, IA, IB, IG, IH0, NIN };
static const char *grad_name[NIN] = {"dq", "dk", "dv", "da", "db", "dgk", "dh0"};
static const int per_token[NIN] = {1, 1, 1, 1, 1, 1, 0};

typedef struct dcase {
    const char *name;
    int64_t T; /* total tokens */
    int H, K, V, BT;
    const int64_t *cu; /* NULL: one sequence */
    int nseq;
    int h0;
    int uneven; /* split by uneven_tokens() instead of evenly */
    int gate;   /* gk: 0 uniform [-0.5, -0.01]; 1 logsigmoid(2 randn); 2 -e^{-1/2} sigmoid(randn) */
} dcase;

/* Ranks get 1, 3, 5, ... parts of the tokens (the last takes the rest): early ranks are short,
 * so a sequence can cover a rank completely. */
static void uneven_tokens(int world, int64_t T, int64_t *out) {
    int64_t parts = (int64_t)world * world, used = 0;
    for (int r = 0; r < world - 1; r++) {
        out[r] = T * (2 * r + 1) / parts;
        if (out[r] < 1)
            out[r] = 1;
        used += out[r];
    }
    out[world - 1] = T - used;
}

typedef struct ddata {
    int64_t shape[NIN][4];
    int64_t row[NIN]; /* values per token (per-token inputs) */
    double *x[NIN];
    double *dO, *dht;
    int64_t no, nht;
} ddata;

/* kt_randn / kt_rand with the size checked (keeps the compiler's range analysis quiet). */
static int64_t sz(int64_t n) {
    if (n < 1 || n > ((int64_t)1 << 40)) {
        fprintf(stderr, "FATAL: bad size %lld\n", (long long)n);
        exit(1);
    }
    return n;
}

static void make_data(const dcase *c, uint64_t seed, ddata *d) {
    memset(d, 0, sizeof *d);
    const int64_t T = c->T, N = c->cu ? c->nseq : 1;
    const int64_t sk[4] = {1, T, c->H, c->K}, sv[4] = {1, T, c->H, c->V};
    const int64_t s0[4] = {N, c->H, c->K, c->V};
    for (int i = 0; i < NIN; i++) {
        memcpy(d->shape[i], i == IH0 ? s0 : i == IV ? sv : sk, sizeof sk);
        d->row[i] = kt_numel(4, d->shape[i]) / T;
    }
    const int64_t nk = sz(kt_numel(4, sk)), rows = nk / c->K;
    d->x[IQ] = kt_randn(nk, seed + 1, 1.0);
    d->x[IK] = kt_randn(nk, seed + 2, 1.0 / sqrt((double)c->K));
    d->x[IV] = kt_randn(sz(kt_numel(4, sv)), seed + 3, 1.0);
    double *kh = kt_randn(nk, seed + 4, 1.0), *al = kt_rand(nk, seed + 5, 0.1, 0.9);
    kt_rownorm(kh, rows, c->K);
    d->x[IA] = kt_alloc(nk);
    d->x[IB] = kt_alloc(nk);
    for (int64_t i = 0; i < nk; i++) {
        d->x[IA][i] = -kh[i];
        d->x[IB][i] = al[i] * kh[i];
    }
    free(kh);
    free(al);
    if (c->gate == 0) {
        d->x[IG] = kt_rand(nk, seed + 6, -0.5, -0.01);
    } else {
        d->x[IG] = kt_randn(nk, seed + 6, 1.0);
        for (int64_t i = 0; i < nk; i++) {
            const double x = d->x[IG][i];
            d->x[IG][i] = c->gate == 1 ? -log1p(exp(-2 * x)) : -exp(-0.5) / (1 + exp(-x));
        }
    }
    if (c->h0)
        d->x[IH0] = kt_randn(sz(kt_numel(4, s0)), seed + 7, 0.5);
    d->no = kt_numel(4, sv);
    d->nht = kt_numel(4, s0);
    d->dO = kt_randn(sz(d->no), seed + 8, 1.0);
    d->dht = kt_randn(sz(d->nht), seed + 9, 1.0);
}

static void free_data(ddata *d) {
    for (int i = 0; i < NIN; i++)
        free(d->x[i]);
    free(d->dO);
    free(d->dht);
}

typedef struct dres {
    double *o, *ht, *grad[NIN];
} dres;

static void free_res(dres *r) {
    free(r->o);
    free(r->ht);
    for (int i = 0; i < NIN; i++)
        free(r->grad[i]);
    memset(r, 0, sizeof *r);
}

static dg_dplr_opts opts_of(const dcase *c) {
    dg_dplr_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = c->BT;
    o.scale = 0.4;
    o.output_final_state = 1;
    return o;
}

/* The slice [b, e) of token rows of input i (per-token inputs) or the whole input. */
static dg_tensor *slice_tensor(dg_ctx *ctx, dg_dtype dt, const ddata *d, int i, int64_t b,
                               int64_t e) {
    if (!d->x[i])
        return NULL;
    if (!per_token[i])
        return kt_tensor(ctx, dt, 4, d->shape[i], d->x[i], 1);
    int64_t sh[4];
    memcpy(sh, d->shape[i], sizeof sh);
    sh[1] = e - b;
    return kt_tensor(ctx, dt, 4, sh, d->x[i] + b * d->row[i], 1);
}

/* The unsplit reference (plan == NULL) or this rank's CP run. Results are this rank's view:
 * slices for per-token tensors, and for ht and dh0 the sum over the ranks. */
static void run(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const dcase *c, const ddata *d,
                dg_dtype dt, dres *r) {
    memset(r, 0, sizeof *r);
    const int64_t b = plan ? plan->begin : 0, e = plan ? plan->end : c->T;
    dg_tensor *t[NIN];
    for (int i = 0; i < NIN; i++)
        t[i] = slice_tensor(ctx, dt, d, i, b, e);
    dg_dplr_opts op = opts_of(c);
    dg_tensor *o = NULL, *ht = NULL;
    dg_tape_reset();
    if (plan) {
        DG_TEST_TRY(dg_dplr_chunk_cp(ctx, comm, plan, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG],
                                     t[IH0], &op, &o, &ht));
    } else {
        op.cu_seqlens = c->cu;
        op.n_seqs = c->nseq;
        DG_TEST_TRY(
            dg_dplr_chunk(ctx, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], t[IH0], &op, &o, &ht));
    }
    const int64_t ov = (int64_t)c->H * c->V;
    dg_tensor *dO = kt_tensor(ctx, dt, 4, dg_tensor_shape(o), d->dO + b * ov, 0);
    dg_tensor *dht = kt_tensor(ctx, dt, 4, dg_tensor_shape(ht), d->dht, 0);
    dg_tensor *outs[2] = {o, ht};
    const dg_tensor *seeds[2] = {dO, dht};
    DG_TEST_TRY(dg__tape_backward_multi(ctx, 2, outs, seeds));
    if (plan) { /* sum the shared results over the ranks */
        DG_TEST_TRY(dg_comm_all_reduce(comm, ht));
        for (int i = 0; i < NIN; i++)
            if (t[i] && !per_token[i])
                DG_TEST_TRY(dg_comm_all_reduce(comm, (dg_tensor *)dg_tensor_grad(t[i])));
    }
    r->o = kt_host(o, dg_tensor_numel(o));
    r->ht = kt_host(ht, dg_tensor_numel(ht));
    for (int i = 0; i < NIN; i++)
        if (t[i]) {
            const dg_tensor *gi = dg_tensor_grad(t[i]);
            if (plan)
                dg_check(gi != NULL, "%s: %s has a gradient", c->name, grad_name[i]);
            r->grad[i] = kt_host(gi, dg_tensor_numel(t[i]));
        }
    dg_tape_reset();
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    dg_tensor_free(&o);
    dg_tensor_free(&ht);
    dg_tensor_free(&dO);
    dg_tensor_free(&dht);
}

/* Largest error per dtype over the run, printed at the end (rank 0's and the others' logs). */
static double g_max_err[2];

static double rel_err(const double *got, const double *want, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num = fmax(num, fabs(got[i] - want[i]));
        den = fmax(den, fabs(want[i]));
    }
    return num / (den > 1e-12 ? den : 1e-12);
}

static void check(const char *name, dg_dtype dt, const double *got, const double *want, int64_t n,
                  double tol) {
    double *m = &g_max_err[dt == DG_F32];
    *m = fmax(*m, rel_err(got, want, n));
    dg_check_rel(name, got, want, n, tol);
}

static void run_case(dg_ctx *ctx, dg_comm *comm, const dcase *c, dg_dtype dt, double tol) {
    const int W = dg_comm_size(comm), R = dg_comm_rank(comm);
    ddata d;
    make_data(c, 3000 + (uint64_t)c->T, &d);
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)W);
    if (c->uneven)
        uneven_tokens(W, c->T, tok);
    dg_cp_plan *plan = NULL;
    DG_TEST_TRY(dg_cp_plan_new(W, R, c->T, c->cu, c->nseq, c->uneven ? tok : NULL, &plan));
    dres want, got;
    run(ctx, comm, NULL, c, &d, dt, &want);
    run(ctx, comm, plan, c, &d, dt, &got);
    const int64_t b = plan->begin, e = plan->end, ov = (int64_t)c->H * c->V;
    char name[192];
    snprintf(name, sizeof name, "%s %s [%lld,%lld) %d local, pre %d post %d: o", dg_dtype_name(dt),
             c->name, (long long)b, (long long)e, plan->n_local, plan->pre_ranks, plan->post_ranks);
    check(name, dt, got.o, want.o + b * ov, (e - b) * ov, tol);
    snprintf(name, sizeof name, "%s %s: ht (summed)", dg_dtype_name(dt), c->name);
    check(name, dt, got.ht, want.ht, d.nht, tol);
    for (int i = 0; i < NIN; i++) {
        if (!d.x[i])
            continue;
        snprintf(name, sizeof name, "%s %s: %s%s", dg_dtype_name(dt), c->name, grad_name[i],
                 per_token[i] ? "" : " (summed)");
        if (per_token[i])
            check(name, dt, got.grad[i], want.grad[i] + b * d.row[i], (e - b) * d.row[i], tol);
        else
            check(name, dt, got.grad[i], want.grad[i], kt_numel(4, d.shape[i]), tol);
    }
    free_res(&want);
    free_res(&got);
    dg_cp_plan_free(&plan);
    free(tok);
    free_data(&d);
}

static void test_errors(dg_ctx *ctx, dg_comm *comm) {
    const int W = dg_comm_size(comm), R = dg_comm_rank(comm);
    static const int64_t cu2[] = {0, 20, 64};
    const dcase c = {"err", 64, 1, 4, 4, 16, cu2, 2, 1, 0, 0};
    ddata d;
    make_data(&c, 5, &d);
    dg_cp_plan *plan = NULL, *other = NULL;
    DG_TEST_TRY(dg_cp_plan_new(W, R, c.T, c.cu, c.nseq, NULL, &plan));
    DG_TEST_TRY(dg_cp_plan_new(W + 1, R, c.T, c.cu, c.nseq, NULL, &other));
    dg_tensor *t[NIN];
    for (int i = 0; i < NIN; i++)
        t[i] = slice_tensor(ctx, DG_F64, &d, i, plan->begin, plan->end);
    dg_tensor *full = slice_tensor(ctx, DG_F64, &d, IQ, 0, c.T);
    dg_tensor *kf32 = slice_tensor(ctx, DG_F32, &d, IK, plan->begin, plan->end);
    const int64_t sloc[4] = {plan->n_local, c.H, c.K, c.V + 1};
    dg_tensor *h0bad = NULL;
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sloc, &h0bad));
    dg_dplr_opts op = opts_of(&c);
    dg_tensor *o = NULL, *ht = NULL;
    dg_check_err(dg_dplr_chunk_cp(ctx, NULL, plan, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], NULL,
                                  &op, &o, &ht),
                 DG_ERR_ARG, "comm", "no communicator");
    dg_check_err(dg_dplr_chunk_cp(ctx, comm, other, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], NULL,
                                  &op, &o, &ht),
                 DG_ERR_ARG, "plan is for rank", "plan of another world size");
    dg_check_err(dg_dplr_chunk_cp(ctx, comm, plan, full, t[IK], t[IV], t[IA], t[IB], t[IG], NULL,
                                  &op, &o, &ht),
                 DG_ERR_SHAPE, "this rank's", "q with the global T");
    dg_check_err(dg_dplr_chunk_cp(ctx, comm, plan, t[IQ], kf32, t[IV], t[IA], t[IB], t[IG], NULL,
                                  &op, &o, &ht),
                 DG_ERR_DTYPE, "k", "k of another dtype");
    dg_check_err(dg_dplr_chunk_cp(ctx, comm, plan, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], h0bad,
                                  &op, &o, &ht),
                 DG_ERR_SHAPE, "n_seqs,H,K,V", "h0 not [n_seqs,H,K,V]");
    dg_check_err(dg_dplr_chunk_cp(ctx, comm, plan, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], NULL,
                                  &op, &o, NULL),
                 DG_ERR_ARG, "ht is NULL", "output_final_state without ht");
    op.cu_seqlens = c.cu;
    op.n_seqs = c.nseq;
    dg_check_err(dg_dplr_chunk_cp(ctx, comm, plan, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], NULL,
                                  &op, &o, &ht),
                 DG_ERR_ARG, "cu_seqlens must be NULL", "cu_seqlens in opts");
    dg_tape_reset();
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    dg_tensor_free(&full);
    dg_tensor_free(&kf32);
    dg_tensor_free(&h0bad);
    dg_cp_plan_free(&plan);
    dg_cp_plan_free(&other);
    free_data(&d);
}

static const int64_t cu_var[] = {0, 30, 31, 64, 130, 170, 203}; /* at and off BT=16 boundaries */
/* 4 ranks of 50: ranks 1 and 2 each hold the tail of one sequence and the head of the next */
static const int64_t cu_th[] = {0, 40, 90, 140, 200};
static const int64_t cu_many[] = {0, 3, 9, 10, 12, 40, 41, 47, 80}; /* short ones */

static const dcase cases[] = {
    /* name                   T    H  K  V  BT  cu       nseq h0 uneven gate */
    {"one seq aligned", 128, 2, 8, 8, 16, NULL, 0, 1, 0, 0},
    {"one seq unaligned", 101, 2, 8, 6, 16, NULL, 0, 1, 0, 2},
    {"one seq uneven", 150, 1, 8, 8, 16, NULL, 0, 1, 1, 1},
    {"varlen", 203, 2, 8, 8, 16, cu_var, 6, 1, 0, 0},
    {"varlen uneven no h0", 203, 1, 8, 8, 16, cu_var, 6, 0, 1, 2},
    {"tail and head", 200, 2, 8, 4, 16, cu_th, 4, 1, 0, 1},
    {"short seqs", 80, 1, 4, 8, 16, cu_many, 8, 1, 1, 0},
    {"BT=32 no h0", 160, 1, 8, 8, 32, NULL, 0, 0, 0, 2},
    {"BT=64 varlen", 203, 1, 16, 8, 64, cu_var, 6, 1, 1, 1},
};

int main(int argc, char **argv) {
    dg_comm *comm = dt_init(argc, argv, "kcp_dplr");
    dg_ctx *ctx = dt_ctx(&comm);
    const int gpu = dg_test_gpu_mode();
    if (!gpu)
        test_errors(ctx, comm);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        if (!gpu) /* CUDA computes in f32 only */
            run_case(ctx, comm, &cases[i], DG_F64, 1e-10);
        run_case(ctx, comm, &cases[i], DG_F32, 1e-5);
    }
    /* the tape policies: w, u, qg, kg, bg, h, v2 cached instead of recomputed, and everything
     * recomputed (the link node reads w and bg through the shared recompute group) */
    const dg_policy pol[2] = {DG_POLICY_CACHE, DG_POLICY_RECOMPUTE};
    for (int i = 0; i < 2; i++) {
        dg_policy saved = dg_policy_get_global();
        dg_policy_set_global(pol[i]);
        dcase c = cases[4]; /* varlen uneven */
        c.h0 = 1;
        c.name = i == 0 ? "varlen uneven, policy CACHE" : "varlen uneven, policy RECOMPUTE";
        run_case(ctx, comm, &c, gpu ? DG_F32 : DG_F64, gpu ? 1e-5 : 1e-10);
        dg_policy_set_global(saved);
    }
    printf("largest error over the cases: f64 %.3e, f32 %.3e\n", g_max_err[0], g_max_err[1]);
    dg_ctx_free(&ctx);
    return dt_finish(&comm, "kcp_dplr");
}

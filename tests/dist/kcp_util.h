/*
 * tests/dist/kcp_util.h -- the comparison every KCP test makes (test_kcp.c for KDA,
 * test_kcp_dplr.c for DPLR): every rank builds the same global inputs, runs the unsplit op itself
 * (the reference), then its slice through the CP op, and o, ht and every gradient must equal the
 * reference (norm-relative). Per-token tensors (o and the gradients of per-token inputs) are
 * compared on the rank's slice; ht (zero rows for sequences ending elsewhere) and the gradients
 * of shared inputs (each rank's share) are summed over the ranks first.
 *
 * A test describes its op by a kcp_spec (its inputs' names, which are per token, and a call that
 * runs the unsplit or the CP op on tensors made from a kcp_data) and fills a kcp_data with the
 * global inputs; kcp_run_case does the rest.
 */
#ifndef DG_TEST_KCP_UTIL_H
#define DG_TEST_KCP_UTIL_H

#include "../kda_testutil.h"
#include "dist_util.h"

#include "autograd/tape.h"

#include <math.h>
#include <string.h>

#define KCP_MAX_IN 8

/* Ranks get 1, 3, 5, ... parts of the tokens (the last takes the rest): early ranks are short,
 * so a sequence can cover a rank completely. */
static inline void kcp_uneven_tokens(int world, int64_t T, int64_t *out) {
    int64_t parts = (int64_t)world * world, used = 0;
    for (int r = 0; r < world - 1; r++) {
        out[r] = T * (2 * r + 1) / parts;
        if (out[r] < 1)
            out[r] = 1;
        used += out[r];
    }
    out[world - 1] = T - used;
}

/* kt_randn / kt_rand with the size checked (keeps the compiler's range analysis quiet). */
static inline int64_t kcp_sz(int64_t n) {
    if (n < 1 || n > ((int64_t)1 << 40)) {
        fprintf(stderr, "FATAL: bad size %lld\n", (long long)n);
        exit(1);
    }
    return n;
}

/* The global inputs: T tokens; x[i] (NULL: the input is absent) of shape[i] (ndim[i] dims,
 * tokens on axis 1 for per-token inputs, row[i] values per token), the seeds dO ([1,T,.,.], ov
 * values per token) and dht (nht values). */
typedef struct kcp_data {
    int64_t T;
    int ndim[KCP_MAX_IN];
    int64_t shape[KCP_MAX_IN][4];
    int64_t row[KCP_MAX_IN];
    double *x[KCP_MAX_IN];
    double *dO, *dht;
    int64_t ov, nht;
} kcp_data;

/* How a case is split: its name, T tokens, sequences cu / nseq (cu NULL: one), split evenly or
 * by kcp_uneven_tokens(). */
typedef struct kcp_split {
    const char *name;
    int64_t T;
    const int64_t *cu;
    int nseq;
    int uneven;
} kcp_split;

typedef struct kcp_spec {
    int n;                        /* inputs */
    const char *const *grad_name; /* [n]: "dq", ... */
    const int *per_token;         /* [n] */
    int f32_from;                 /* bf16 runs keep inputs i >= f32_from and dht in f32 */
    /* Run the op on t[0..n) (NULL where absent) with the case `c`: the unsplit op when plan is
     * NULL, else this rank's CP op. *o, *ht: new references. */
    void (*call)(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const void *c,
                 dg_tensor *const *t, dg_tensor **o, dg_tensor **ht);
    /* The case's global inputs from `seed`, and its split. */
    void (*make)(const void *c, uint64_t seed, kcp_data *d);
    kcp_split (*split)(const void *c);
    uint64_t seed; /* a case's inputs come from seed + T */
} kcp_spec;

typedef struct kcp_res {
    double *o, *ht, *grad[KCP_MAX_IN];
} kcp_res;

static inline void kcp_free_data(kcp_data *d) {
    for (int i = 0; i < KCP_MAX_IN; i++)
        free(d->x[i]);
    free(d->dO);
    free(d->dht);
    memset(d, 0, sizeof *d);
}

static inline void kcp_free_res(kcp_res *r) {
    free(r->o);
    free(r->ht);
    for (int i = 0; i < KCP_MAX_IN; i++)
        free(r->grad[i]);
    memset(r, 0, sizeof *r);
}

/* Input i as a tensor requiring grad: the token rows [b, e) of a per-token input, or all of a
 * shared one (NULL when absent). */
static inline dg_tensor *kcp_slice(dg_ctx *ctx, dg_dtype dt, const kcp_spec *s, const kcp_data *d,
                                   int i, int64_t b, int64_t e) {
    if (!d->x[i])
        return NULL;
    if (!s->per_token[i])
        return kt_tensor(ctx, dt, d->ndim[i], d->shape[i], d->x[i], 1);
    int64_t sh[4];
    memcpy(sh, d->shape[i], sizeof sh);
    sh[1] = e - b;
    return kt_tensor(ctx, dt, d->ndim[i], sh, d->x[i] + b * d->row[i], 1);
}

/* The unsplit reference (plan == NULL) or this rank's CP run. Results are this rank's view:
 * slices for per-token tensors, and for ht and the shared gradients the sum over the ranks. */
static inline void kcp_run(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const kcp_spec *s,
                           const void *c, const char *name, const kcp_data *d, dg_dtype dt,
                           kcp_res *r) {
    memset(r, 0, sizeof *r);
    const int64_t b = plan ? plan->begin : 0, e = plan ? plan->end : d->T;
    dg_tensor *t[KCP_MAX_IN] = {NULL};
    for (int i = 0; i < s->n; i++)
        t[i] = kcp_slice(ctx, dt == DG_BF16 && i >= s->f32_from ? DG_F32 : dt, s, d, i, b, e);
    dg_tensor *o = NULL, *ht = NULL;
    dg_tape_reset();
    s->call(ctx, comm, plan, c, t, &o, &ht);
    dg_tensor *dO = kt_tensor(ctx, dt, 4, dg_tensor_shape(o), d->dO + b * d->ov, 0);
    dg_tensor *dht = kt_tensor(ctx, dt == DG_BF16 ? DG_F32 : dt, 4, dg_tensor_shape(ht), d->dht, 0);
    dg_tensor *outs[2] = {o, ht};
    const dg_tensor *seeds[2] = {dO, dht};
    DG_TEST_TRY(dg__tape_backward_multi(ctx, 2, outs, seeds));
    if (plan) { /* sum the shared results over the ranks */
        DG_TEST_TRY(dg_comm_all_reduce(comm, ht));
        for (int i = 0; i < s->n; i++)
            if (t[i] && !s->per_token[i])
                DG_TEST_TRY(dg_comm_all_reduce(comm, (dg_tensor *)dg_tensor_grad(t[i])));
    }
    r->o = kt_host(o, dg_tensor_numel(o));
    r->ht = kt_host(ht, dg_tensor_numel(ht));
    for (int i = 0; i < s->n; i++)
        if (t[i]) {
            const dg_tensor *gi = dg_tensor_grad(t[i]);
            if (plan)
                dg_check(gi != NULL, "%s: %s has a gradient", name, s->grad_name[i]);
            r->grad[i] = kt_host(gi, dg_tensor_numel(t[i]));
        }
    dg_tape_reset();
    for (int i = 0; i < s->n; i++)
        dg_tensor_free(&t[i]);
    dg_tensor_free(&o);
    dg_tensor_free(&ht);
    dg_tensor_free(&dO);
    dg_tensor_free(&dht);
}

/* Largest error per dtype (f64, f32, bf16) over the suite's comparisons. */
static double kcp_max_err[3];

static inline void kcp_check(const char *name, dg_dtype dt, const double *got, const double *want,
                             int64_t n, double tol) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num = fmax(num, fabs(got[i] - want[i]));
        den = fmax(den, fabs(want[i]));
    }
    double *m = &kcp_max_err[dt == DG_F64 ? 0 : dt == DG_F32 ? 1 : 2];
    *m = fmax(*m, num / (den > 1e-12 ? den : 1e-12));
    dg_check_rel(name, got, want, n, tol);
}

/* The case `c` (T tokens, sequences cu / nseq or one, split evenly or by kcp_uneven_tokens) in
 * dtype dt: the reference and the CP run on this rank, compared within tol. */
static inline void kcp_run_case(dg_ctx *ctx, dg_comm *comm, const kcp_spec *s, const void *c,
                                const char *name, int64_t T, const int64_t *cu, int nseq,
                                int uneven, const kcp_data *d, dg_dtype dt, double tol) {
    const int W = dg_comm_size(comm), R = dg_comm_rank(comm);
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)W);
    if (uneven)
        kcp_uneven_tokens(W, T, tok);
    dg_cp_plan *plan = NULL;
    DG_TEST_TRY(dg_cp_plan_new(W, R, T, cu, nseq, uneven ? tok : NULL, &plan));
    kcp_res want, got;
    kcp_run(ctx, comm, NULL, s, c, name, d, dt, &want);
    kcp_run(ctx, comm, plan, s, c, name, d, dt, &got);
    const int64_t b = plan->begin, e = plan->end;
    char msg[192];
    snprintf(msg, sizeof msg, "%s %s [%lld,%lld) %d local, pre %d post %d: o", dg_dtype_name(dt),
             name, (long long)b, (long long)e, plan->n_local, plan->pre_ranks, plan->post_ranks);
    kcp_check(msg, dt, got.o, want.o + b * d->ov, (e - b) * d->ov, tol);
    snprintf(msg, sizeof msg, "%s %s: ht (summed)", dg_dtype_name(dt), name);
    kcp_check(msg, dt, got.ht, want.ht, d->nht, tol);
    for (int i = 0; i < s->n; i++) {
        if (!d->x[i])
            continue;
        snprintf(msg, sizeof msg, "%s %s: %s%s", dg_dtype_name(dt), name, s->grad_name[i],
                 s->per_token[i] ? "" : " (summed)");
        if (s->per_token[i])
            kcp_check(msg, dt, got.grad[i], want.grad[i] + b * d->row[i], (e - b) * d->row[i], tol);
        else
            kcp_check(msg, dt, got.grad[i], want.grad[i], kt_numel(d->ndim[i], d->shape[i]), tol);
    }
    kcp_free_res(&want);
    kcp_free_res(&got);
    dg_cp_plan_free(&plan);
    free(tok);
}

/* The case `c` in dtype dt (name: its split's when NULL): its inputs made, then kcp_run_case. */
static inline void kcp_case(dg_ctx *ctx, dg_comm *comm, const kcp_spec *s, const void *c,
                            const char *name, dg_dtype dt, double tol) {
    const kcp_split sp = s->split(c);
    kcp_data d;
    s->make(c, s->seed + (uint64_t)sp.T, &d);
    kcp_run_case(ctx, comm, s, c, name ? name : sp.name, sp.T, sp.cu, sp.nseq, sp.uneven, &d, dt,
                 tol);
    kcp_free_data(&d);
}

/* n cases at `cases` (stride bytes apart): f64 within 1e-10 (not in gpu mode: CUDA computes in
 * f32 only) and f32 within 1e-5. */
static inline void kcp_cases(dg_ctx *ctx, dg_comm *comm, const kcp_spec *s, const void *cases,
                             size_t stride, size_t n, int gpu) {
    for (size_t i = 0; i < n; i++) {
        const void *c = (const char *)cases + i * stride;
        if (!gpu)
            kcp_case(ctx, comm, s, c, NULL, DG_F64, 1e-10);
        kcp_case(ctx, comm, s, c, NULL, DG_F32, 1e-5);
    }
}

/* The varlen uneven case `c` under both tape policies (cached intermediates, and everything
 * recomputed): f64 within 1e-10, in gpu mode f32 within 1e-5. */
static inline void kcp_policies(dg_ctx *ctx, dg_comm *comm, const kcp_spec *s, const void *c,
                                int gpu) {
    const dg_policy pol[2] = {DG_POLICY_CACHE, DG_POLICY_RECOMPUTE};
    const char *const name[2] = {"varlen uneven, policy CACHE", "varlen uneven, policy RECOMPUTE"};
    for (int i = 0; i < 2; i++) {
        dg_policy saved = dg_policy_get_global();
        dg_policy_set_global(pol[i]);
        kcp_case(ctx, comm, s, c, name[i], gpu ? DG_F32 : DG_F64, gpu ? 1e-5 : 1e-10);
        dg_policy_set_global(saved);
    }
}

/* The argument-error tests' fixture: the case's inputs (seed 5), this rank's plan, one for a
 * world of another size, the inputs as f64 slices of this rank and q with the global T. */
typedef struct kcp_err {
    kcp_data d;
    dg_cp_plan *plan, *other;
    dg_tensor *t[KCP_MAX_IN], *full;
} kcp_err;

static inline void kcp_err_begin(dg_ctx *ctx, dg_comm *comm, const kcp_spec *s, const void *c,
                                 kcp_err *e) {
    const int W = dg_comm_size(comm), R = dg_comm_rank(comm);
    const kcp_split sp = s->split(c);
    memset(e, 0, sizeof *e);
    s->make(c, 5, &e->d);
    DG_TEST_TRY(dg_cp_plan_new(W, R, sp.T, sp.cu, sp.nseq, NULL, &e->plan));
    DG_TEST_TRY(dg_cp_plan_new(W + 1, R, sp.T, sp.cu, sp.nseq, NULL, &e->other));
    for (int i = 0; i < s->n; i++)
        e->t[i] = kcp_slice(ctx, DG_F64, s, &e->d, i, e->plan->begin, e->plan->end);
    e->full = kcp_slice(ctx, DG_F64, s, &e->d, 0, 0, sp.T);
}

static inline void kcp_err_end(kcp_err *e) {
    dg_tape_reset();
    for (int i = 0; i < KCP_MAX_IN; i++)
        dg_tensor_free(&e->t[i]);
    dg_tensor_free(&e->full);
    dg_cp_plan_free(&e->plan);
    dg_cp_plan_free(&e->other);
    kcp_free_data(&e->d);
}

/* The largest errors, printed at the end of the suite (rank 0's output and the others' logs). */
static inline void kcp_print_max_err(void) {
    printf("largest error over the cases: f64 %.3e, f32 %.3e", kcp_max_err[0], kcp_max_err[1]);
    if (kcp_max_err[2] > 0)
        printf(", bf16 %.3e", kcp_max_err[2]);
    printf("\n");
}

#endif

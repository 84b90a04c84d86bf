/*
 * tests/kda_testutil.h -- helpers shared by the KDA and DPLR tests: deterministic host data and
 * tensors.
 * Everything is static inline so each test includes only what it uses.
 */
#ifndef DG_KDA_TESTUTIL_H
#define DG_KDA_TESTUTIL_H

#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Uniform in [lo, hi) and standard normal (Box-Muller), counter based. */
static inline double kt_uniform(uint64_t seed, uint64_t i, double lo, double hi) {
    return lo + (hi - lo) * dg_rand_u01(seed, i);
}
static inline double kt_normal(uint64_t seed, uint64_t i) {
    double u1 = dg_rand_u01(seed, 2 * i), u2 = dg_rand_u01(seed, 2 * i + 1);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static inline double *kt_alloc(int64_t n) {
    double *p = (double *)calloc((size_t)(n ? n : 1), sizeof(double));
    if (!p) {
        fprintf(stderr, "FATAL: out of host memory\n");
        exit(1);
    }
    return p;
}

static inline int64_t kt_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

/* Host array of n normal values times `scale`. */
static inline double *kt_randn(int64_t n, uint64_t seed, double scale) {
    double *p = kt_alloc(n);
    for (int64_t i = 0; i < n; i++)
        p[i] = scale * kt_normal(seed, (uint64_t)i);
    return p;
}
static inline double *kt_rand(int64_t n, uint64_t seed, double lo, double hi) {
    double *p = kt_alloc(n);
    for (int64_t i = 0; i < n; i++)
        p[i] = kt_uniform(seed, (uint64_t)i, lo, hi);
    return p;
}
/* Normalise rows of K in place (keys with norm 1 keep the recurrence a contraction, kda.md §11.3).
 */
static inline void kt_rownorm(double *x, int64_t rows, int K) {
    for (int64_t r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < K; c++)
            s += x[r * K + c] * x[r * K + c];
        s = 1.0 / sqrt(s);
        for (int c = 0; c < K; c++)
            x[r * K + c] *= s;
    }
}

/* DPLR's a, b and gk for `rows` rows of K in RWKV-7's stable form (dplr.md D1): a = -kh, b = alpha
 * kh with kh unit-norm rows (stream seed) and alpha uniform in (0.1, 0.9) (seed + 1), so every
 * transition D + b a^T is a contraction; gk (seed + 2) per `gate`: 0 uniform in [-0.5, -0.01],
 * 1 logsigmoid(2 x) of normal x (mostly in [-4, 0], with a tail of strong decays), 2 RWKV-7's
 * safe gate -e^{-1/2} sigmoid(x) (in (-0.61, 0)). */
static inline void kt_dplr_abg(int64_t rows, int K, uint64_t seed, int gate, double **a, double **b,
                               double **gk) {
    const int64_t n = rows * K;
    double *kh = kt_randn(n, seed, 1.0), *al = kt_rand(n, seed + 1, 0.1, 0.9);
    kt_rownorm(kh, rows, K);
    *a = kt_alloc(n);
    *b = kt_alloc(n);
    for (int64_t i = 0; i < n; i++) {
        (*a)[i] = -kh[i];
        (*b)[i] = al[i] * kh[i];
    }
    free(kh);
    free(al);
    if (gate == 0) {
        *gk = kt_rand(n, seed + 2, -0.5, -0.01);
        return;
    }
    *gk = kt_randn(n, seed + 2, 1.0);
    for (int64_t i = 0; i < n; i++) {
        const double x = (*gk)[i];
        (*gk)[i] = gate == 1 ? -log1p(exp(-2 * x)) : -exp(-0.5) / (1 + exp(-x));
    }
}

/* Tensor of `dt` from host doubles (NULL data -> NULL tensor), optionally requiring grad. */
static inline dg_tensor *kt_tensor(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape,
                                   const double *data, int grad) {
    if (!data)
        return NULL;
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, ndim, shape, data, &t));
    if (grad)
        dg_tensor_set_requires_grad(t, 1);
    return t;
}

/* Host copy of a tensor's values (zeros of n when t is NULL). */
static inline double *kt_host(const dg_tensor *t, int64_t n) {
    if (!t)
        return kt_alloc(n);
    double *p = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(t, &p));
    return p;
}

/* ---- ops with the outputs o and ht (the chunked and recurrent forms), run through the tape ----
 */

#define KT_MAXIN 8

/* The host inputs of one run (x[i] NULL: input i absent) and the seeds of its backward. */
typedef struct kt_data {
    int nin;
    int ndim[KT_MAXIN];
    int64_t shape[KT_MAXIN][4];
    double *x[KT_MAXIN];
    double *dO, *dht;
    int64_t no, nht;
} kt_data;

/* What a run produced: o, ht and the gradient of every input given; the tape after the forward. */
typedef struct kt_res {
    double *o, *ht, *grad[KT_MAXIN];
    size_t tape_bytes;
    int nodes;
} kt_res;

static inline void kt_data_free(kt_data *d) {
    for (int i = 0; i < KT_MAXIN; i++)
        free(d->x[i]);
    free(d->dO);
    free(d->dht);
}

static inline void kt_res_free(kt_res *r) {
    free(r->o);
    free(r->ht);
    for (int i = 0; i < KT_MAXIN; i++)
        free(r->grad[i]);
    memset(r, 0, sizeof *r);
}

/* The forward of the op on t[0..nin) (NULL: absent) into *o and *ht. */
typedef dg_status (*kt_op_fn)(dg_ctx *ctx, dg_tensor *const *t, const void *user, dg_tensor **o,
                              dg_tensor **ht);

/* Forward in dtype dt (every input requiring grad), backward seeded with dO and dht. */
static inline void kt_run(dg_ctx *ctx, kt_op_fn op, const void *user, const kt_data *d, dg_dtype dt,
                          kt_res *r) {
    memset(r, 0, sizeof *r);
    dg_tensor *t[KT_MAXIN] = {0};
    for (int i = 0; i < d->nin; i++)
        t[i] = kt_tensor(ctx, dt, d->ndim[i], d->shape[i], d->x[i], 1);
    dg_tensor *o = NULL, *ht = NULL;
    dg_tape_reset();
    DG_TEST_TRY(op(ctx, t, user, &o, &ht));
    r->tape_bytes = dg_tape_bytes();
    r->nodes = dg_tape_num_nodes();
    dg_tensor *dO = kt_tensor(ctx, dt, 4, dg_tensor_shape(o), d->dO, 0);
    dg_tensor *dht = kt_tensor(ctx, dt, 4, dg_tensor_shape(ht), d->dht, 0);
    dg_tensor *outs[2] = {o, ht};
    const dg_tensor *seeds[2] = {dO, dht};
    DG_TEST_TRY(dg_tape_backward_multi(ctx, 2, outs, seeds));
    r->o = kt_host(o, d->no);
    r->ht = kt_host(ht, d->nht);
    for (int i = 0; i < d->nin; i++)
        if (t[i])
            r->grad[i] = kt_host(dg_tensor_grad(t[i]), dg_tensor_numel(t[i]));
    dg_tape_reset();
    for (int i = 0; i < d->nin; i++)
        dg_tensor_free(&t[i]);
    dg_tensor_free(&o);
    dg_tensor_free(&ht);
    dg_tensor_free(&dO);
    dg_tensor_free(&dht);
}

/* got vs want, norm-relative within tol: o, ht and the gradient of every input given, named
 * "<what> <cname> <o|ht|grad_name[i]>". Input atol_in (-1: none) is compared in absolute terms
 * within atol when atol > 0. */
static inline void kt_compare(const char *what, const char *cname, const char *const *grad_name,
                              const kt_data *d, const kt_res *got, const kt_res *want, double tol,
                              int atol_in, double atol) {
    char name[160];
    snprintf(name, sizeof name, "%s %s o", what, cname);
    dg_check_rel(name, got->o, want->o, d->no, tol);
    snprintf(name, sizeof name, "%s %s ht", what, cname);
    dg_check_rel(name, got->ht, want->ht, d->nht, tol);
    for (int i = 0; i < d->nin; i++) {
        if (!d->x[i])
            continue;
        snprintf(name, sizeof name, "%s %s %s", what, cname, grad_name[i]);
        const int64_t n = kt_numel(d->ndim[i], d->shape[i]);
        if (i == atol_in && atol > 0)
            dg_check_close(name, got->grad[i], want->grad[i], n, atol, 0);
        else
            dg_check_rel(name, got->grad[i], want->grad[i], n, tol);
    }
}

static inline int kt_all_finite(const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

#endif

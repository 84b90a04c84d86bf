/*
 * tests/test_norm.c -- dg_l2norm, dg_rmsnorm, dg_gated_rmsnorm, dg_add_rmsnorm.
 *
 * cpu: f64 gradchecks (with and without weight, every gate activation, strided inputs), forward
 *      values against a direct loop, f32 vs f64, CACHE vs RECOMPUTE, bad arguments.
 *      dg_add_rmsnorm: f64 gradcheck with both outputs in the loss; equality with dg_add followed
 *      by dg_rmsnorm (outputs and gradients, with both outputs, only y or only the sum in the
 *      loss, and x passed as both inputs); f32 vs f64; CACHE vs RECOMPUTE; bad arguments.
 * gpu: CUDA (f32, bf16) vs the CPU on the same values, forward and every gradient, on the warp
 *      paths (D <= 256 in registers, D <= 1024) and the block path (D > 1024), odd sizes, strided
 * input, bitwise determinism of dw, CACHE vs RECOMPUTE, device/dtype errors. dg_add_rmsnorm: the
 * same against the CPU for D = 1, 7, 33, 896, 1000 (warp path), 1500 and 13000 (block path, the dw
 * share in shared and in global memory), several rows per block, run twice and RECOMPUTE == CACHE
 * bitwise, and the fused kernels against dg_add + dg_rmsnorm.
 */
#include "tests/harness.h"

#include <string.h>

typedef enum { OP_L2, OP_RMS, OP_GATED } norm_op;

typedef struct {
    norm_op op;
    dg_act act;
    double eps;
    int transpose; /* gradcheck: x is [D, R] and is transposed to [R, D] before the op */
} norm_cfg;

static const char *op_name(const norm_cfg *c) {
    static const char *acts[] = {"none", "silu", "sigmoid"};
    static char buf[64];
    if (c->op == OP_L2)
        return "l2norm";
    if (c->op == OP_RMS)
        return "rmsnorm";
    snprintf(buf, sizeof buf, "gated_rmsnorm(%s)", acts[c->act]);
    return buf;
}

static dg_status call_norm(dg_ctx *ctx, const norm_cfg *c, dg_tensor *x, dg_tensor *w, dg_tensor *g,
                           dg_tensor **y) {
    if (c->op == OP_L2)
        return dg_l2norm(ctx, x, c->eps, y);
    if (c->op == OP_RMS)
        return dg_rmsnorm(ctx, x, w, c->eps, y);
    return dg_gated_rmsnorm(ctx, x, w, g, c->eps, c->act, y);
}

/* in: x, w (or NULL), gate (or NULL) */
static dg_status norm_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                         void *user) {
    (void)n_in;
    (void)n_out;
    const norm_cfg *c = user;
    dg_tensor *x = in[0], *xt = NULL;
    if (c->transpose) {
        dg_status s = dg_transpose(x, 0, 1, &xt);
        if (s != DG_OK)
            return s;
        x = xt;
    }
    dg_status s = call_norm(ctx, c, x, in[1], in[2], &out[0]);
    dg_tensor_free(&xt);
    return s;
}

static double act_ref(dg_act a, double g) {
    double s = 1.0 / (1.0 + exp(-g));
    return a == DG_ACT_SILU ? g * s : a == DG_ACT_SIGMOID ? s : g;
}

/* The forward written out directly, in f64. */
static void ref_norm(const norm_cfg *c, int64_t rows, int64_t D, const double *x, const double *w,
                     const double *g, double *y) {
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t j = 0; j < D; j++)
            ss += x[r * D + j] * x[r * D + j];
        if (c->op != OP_L2)
            ss /= (double)D;
        double rs = 1.0 / sqrt(ss + c->eps);
        for (int64_t j = 0; j < D; j++) {
            double v = x[r * D + j] * rs;
            if (w)
                v *= w[j];
            if (g)
                v *= act_ref(c->act, g[r * D + j]);
            y[r * D + j] = v;
        }
    }
}

/* A copy of t on ctx's device in dtype dt (NULL stays NULL). Not recorded: t needs no grad. */
static dg_tensor *conv(dg_ctx *ctx, dg_tensor *t, dg_dtype dt) {
    if (!t)
        return NULL;
    dg_tensor *a = NULL, *b = NULL;
    DG_TEST_TRY(dg_to_device(ctx, t, &a));
    DG_TEST_TRY(dg_to_dtype(ctx, a, dt, &b));
    dg_tensor_free(&a);
    return b;
}

typedef struct {
    dg_tensor *x, *w, *g, *dy;
} norm_set;

/* f64 CPU inputs for cfg: x [rows, D] (or [lead, rows/lead, D]), w [D], gate, dy. */
static norm_set make_set(dg_ctx *cpu, const norm_cfg *c, int ndim, const int64_t *shape, int with_w,
                         uint64_t seed) {
    norm_set s = {0};
    int64_t D = shape[ndim - 1];
    s.x = dg_test_randn(cpu, DG_F64, ndim, shape, seed);
    if (with_w && c->op != OP_L2)
        s.w = dg_test_rand(cpu, DG_F64, 1, &D, seed + 1, 0.5, 1.5);
    if (c->op == OP_GATED)
        s.g = dg_test_randn(cpu, DG_F64, ndim, shape, seed + 2);
    s.dy = dg_test_randn(cpu, DG_F64, ndim, shape, seed + 3);
    return s;
}

static norm_set conv_set(dg_ctx *ctx, const norm_set *s, dg_dtype dt) {
    norm_set o = {conv(ctx, s->x, dt), conv(ctx, s->w, dt), conv(ctx, s->g, dt),
                  conv(ctx, s->dy, dt)};
    return o;
}

static void free_set(norm_set *s) {
    dg_tensor_free(&s->x);
    dg_tensor_free(&s->w);
    dg_tensor_free(&s->g);
    dg_tensor_free(&s->dy);
}

static void set_grad(norm_set *s) {
    dg_tensor_set_requires_grad(s->x, 1);
    dg_tensor_set_requires_grad(s->w, 1);
    dg_tensor_set_requires_grad(s->g, 1);
}

/* Forward + backward of cfg on set s; *y receives the output. */
static void run_set(dg_ctx *ctx, const norm_cfg *c, norm_set *s, dg_tensor **y) {
    DG_TEST_TRY(call_norm(ctx, c, s->x, s->w, s->g, y));
    DG_TEST_TRY(dg_tape_backward_with(ctx, *y, s->dy));
    dg_tape_reset();
}

/* Output and every gradient of `got` against `want`, norm-relative. */
static void compare_sets(const char *label, const norm_set *got, dg_tensor *ygot,
                         const norm_set *want, dg_tensor *ywant, double tol) {
    char name[160];
    snprintf(name, sizeof name, "%s y", label);
    dg_check_tensor_rel(name, ygot, ywant, tol);
    snprintf(name, sizeof name, "%s dx", label);
    dg_check_tensor_rel(name, dg_tensor_grad(got->x), dg_tensor_grad(want->x), tol);
    if (want->w) {
        snprintf(name, sizeof name, "%s dw", label);
        dg_check_tensor_rel(name, dg_tensor_grad(got->w), dg_tensor_grad(want->w), tol);
    }
    if (want->g) {
        snprintf(name, sizeof name, "%s dgate", label);
        dg_check_tensor_rel(name, dg_tensor_grad(got->g), dg_tensor_grad(want->g), tol);
    }
}

static const norm_cfg g_cfgs[] = {
    {OP_L2, DG_ACT_NONE, 1e-6, 0},       {OP_RMS, DG_ACT_NONE, 1e-5, 0},
    {OP_GATED, DG_ACT_NONE, 1e-5, 0},    {OP_GATED, DG_ACT_SILU, 1e-5, 0},
    {OP_GATED, DG_ACT_SIGMOID, 1e-5, 0},
};
#define N_CFGS (int)(sizeof g_cfgs / sizeof *g_cfgs)

// ---- cpu

static void test_gradcheck(dg_ctx *cpu) {
    for (int k = 0; k < N_CFGS; k++) {
        for (int with_w = 0; with_w <= 1; with_w++) {
            if (g_cfgs[k].op == OP_L2 && with_w)
                continue;
            for (int tr = 0; tr <= 1; tr++) {
                norm_cfg c = g_cfgs[k];
                c.transpose = tr;
                /* plain: x [3,4,7]; transposed: x [7,5] viewed as [5,7] */
                int64_t s3[3] = {3, 4, 7}, s2[2] = {7, 5};
                norm_set s = tr ? make_set(cpu, &c, 2, s2, 0, 100 + k)
                                : make_set(cpu, &c, 3, s3, with_w, 100 + k);
                if (tr && c.op != OP_L2) { /* w [7] and gate [5,7] match the transposed view */
                    int64_t D = 7, gs[2] = {5, 7};
                    if (with_w)
                        s.w = dg_test_rand(cpu, DG_F64, 1, &D, 200 + k, 0.5, 1.5);
                    if (s.g) {
                        dg_tensor_free(&s.g);
                        s.g = dg_test_randn(cpu, DG_F64, 2, gs, 300 + k);
                    }
                }
                set_grad(&s);
                dg_tensor *in[3] = {s.x, s.w, s.g};
                dg_gradcheck_report rep;
                char what[128];
                snprintf(what, sizeof what, "gradcheck %s%s%s", op_name(&c), with_w ? " +w" : "",
                         tr ? " strided x" : "");
                if (dg_check_ok(dg_gradcheck(cpu, norm_fn, &c, in, 3, 1, 1e-6, 7 + k, &rep), what))
                    dg_check(rep.max_rel_err < 1e-6, "%s: rel err x %.2e w %.2e gate %.2e (< 1e-6)",
                             what, rep.rel_err[0], rep.rel_err[1], rep.rel_err[2]);
                free_set(&s);
            }
        }
    }
}

static void test_values(dg_ctx *cpu) {
    for (int k = 0; k < N_CFGS; k++) {
        norm_cfg c = g_cfgs[k];
        int64_t shape[3] = {2, 9, 13};
        norm_set s = make_set(cpu, &c, 3, shape, 1, 40 + k);
        dg_tensor *y = NULL;
        DG_TEST_TRY(call_norm(cpu, &c, s.x, s.w, s.g, &y));
        double *x, *w = NULL, *g = NULL, *yv, *ref = malloc(18 * 13 * sizeof(double));
        DG_TEST_TRY(dg_tensor_to_f64(s.x, &x));
        if (s.w)
            DG_TEST_TRY(dg_tensor_to_f64(s.w, &w));
        if (s.g)
            DG_TEST_TRY(dg_tensor_to_f64(s.g, &g));
        DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
        ref_norm(&c, 18, 13, x, w, g, ref);
        char name[96];
        snprintf(name, sizeof name, "%s f64 forward == direct loop", op_name(&c));
        /* same formula in the same precision: only summation rounding differs */
        dg_check_close(name, yv, ref, 18 * 13, 1e-14, 1e-12);
        free(x);
        free(w);
        free(g);
        free(yv);
        free(ref);
        dg_tensor_free(&y);
        free_set(&s);
    }
    /* gated with act NONE and gate == 1 is plain rmsnorm */
    int64_t shape[2] = {5, 8};
    norm_cfg rc = {OP_RMS, DG_ACT_NONE, 1e-5, 0};
    norm_set s = make_set(cpu, &rc, 2, shape, 1, 77);
    dg_tensor *ones = NULL, *y1 = NULL, *y2 = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 2, shape, &ones));
    DG_TEST_TRY(dg_tensor_fill_(ones, 1.0));
    DG_TEST_TRY(dg_rmsnorm(cpu, s.x, s.w, 1e-5, &y1));
    DG_TEST_TRY(dg_gated_rmsnorm(cpu, s.x, s.w, ones, 1e-5, DG_ACT_NONE, &y2));
    dg_check_tensor_close("gated(act none, gate 1) == rmsnorm", y2, y1, 0, 0);
    dg_tensor_free(&ones);
    dg_tensor_free(&y1);
    dg_tensor_free(&y2);
    free_set(&s);
}

static void test_f32_vs_f64(dg_ctx *cpu) {
    for (int k = 0; k < N_CFGS; k++) {
        norm_cfg c = g_cfgs[k];
        int64_t shape[2] = {37, 100};
        norm_set s64 = make_set(cpu, &c, 2, shape, 1, 500 + k);
        norm_set s32 = conv_set(cpu, &s64, DG_F32);
        set_grad(&s64);
        set_grad(&s32);
        dg_tensor *y64 = NULL, *y32 = NULL;
        run_set(cpu, &c, &s64, &y64);
        run_set(cpu, &c, &s32, &y32);
        char label[96];
        snprintf(label, sizeof label, "%s cpu f32 vs f64", op_name(&c));
        /* f32 rounding (6e-8) grows with sums of up to 100 (x^2, g.x) or 37 (dw) terms */
        compare_sets(label, &s32, y32, &s64, y64, 1e-5);
        dg_tensor_free(&y64);
        dg_tensor_free(&y32);
        free_set(&s64);
        free_set(&s32);
    }
}

static void test_policy(dg_ctx *cpu) {
    const char *kinds[] = {"l2norm", "rmsnorm", "gated_rmsnorm"};
    for (int k = 0; k < 3; k++) {
        norm_cfg c = {(norm_op)k, DG_ACT_SILU, 1e-5, 0};
        int64_t shape[2] = {6, 10};
        norm_set a = make_set(cpu, &c, 2, shape, 1, 900 + k);
        norm_set b = conv_set(cpu, &a, DG_F64);
        set_grad(&a);
        set_grad(&b);
        dg_tensor *ya = NULL, *yb = NULL;
        dg_policy_reset();
        DG_TEST_TRY(call_norm(cpu, &c, a.x, a.w, a.g, &ya));
        size_t cache_bytes = dg_tape_bytes();
        DG_TEST_TRY(dg_tape_backward_with(cpu, ya, a.dy));
        dg_tape_reset();
        dg_policy_set(kinds[k], DG_POLICY_RECOMPUTE);
        DG_TEST_TRY(call_norm(cpu, &c, b.x, b.w, b.g, &yb));
        size_t rec_bytes = dg_tape_bytes();
        DG_TEST_TRY(dg_tape_backward_with(cpu, yb, b.dy));
        dg_tape_reset();
        dg_policy_reset();
        dg_check(rec_bytes + 6 * sizeof(double) == cache_bytes,
                 "%s: RECOMPUTE keeps %zu bytes, CACHE %zu (+ rstd [6] f64)", kinds[k], rec_bytes,
                 cache_bytes);
        char label[96];
        snprintf(label, sizeof label, "%s RECOMPUTE == CACHE (bitwise)", kinds[k]);
        compare_sets(label, &b, yb, &a, ya, 0);
        dg_tensor_free(&ya);
        dg_tensor_free(&yb);
        free_set(&a);
        free_set(&b);
    }
    /* no_grad records nothing */
    int64_t shape[2] = {3, 4};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, shape, 5), *y = NULL;
    dg_tensor_set_requires_grad(x, 1);
    dg_no_grad_begin();
    DG_TEST_TRY(dg_rmsnorm(cpu, x, NULL, 1e-5, &y));
    dg_no_grad_end();
    dg_check(dg_tape_num_nodes() == 0 && !dg_tensor_requires_grad(y),
             "rmsnorm under no_grad records nothing");
    dg_tensor_free(&y);
    dg_tensor_free(&x);
}

static void test_errors(dg_ctx *cpu) {
    int64_t shape[2] = {4, 9}, D = 9, D1 = 10, s3[2] = {4, 8};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, shape, 1);
    dg_tensor *x32 = dg_test_randn(cpu, DG_F32, 2, shape, 1);
    dg_tensor *w = dg_test_randn(cpu, DG_F64, 1, &D, 2);
    dg_tensor *w_bad = dg_test_randn(cpu, DG_F64, 1, &D1, 2);
    dg_tensor *w32 = dg_test_randn(cpu, DG_F32, 1, &D, 2);
    dg_tensor *g = dg_test_randn(cpu, DG_F64, 2, shape, 3);
    dg_tensor *g_bad = dg_test_randn(cpu, DG_F64, 2, s3, 3);
    dg_tensor *xb = NULL, *xi = NULL, *y = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, x, DG_BF16, &xb));
    DG_TEST_TRY(dg_to_dtype(cpu, x, DG_I32, &xi));

    dg_check_err(dg_l2norm(cpu, NULL, 1e-6, &y), DG_ERR_ARG, "'x' is NULL", "l2norm x NULL");
    dg_check_err(dg_l2norm(cpu, x, 1e-6, NULL), DG_ERR_ARG, "'out' is NULL", "l2norm out NULL");
    dg_check_err(dg_l2norm(NULL, x, 1e-6, &y), DG_ERR_ARG, "'ctx' is NULL", "l2norm ctx NULL");
    dg_check_err(dg_l2norm(cpu, x, -1.0, &y), DG_ERR_ARG, "eps", "l2norm negative eps");
    dg_check_err(dg_l2norm(cpu, x, NAN, &y), DG_ERR_ARG, "eps", "l2norm NaN eps");
    dg_check_err(dg_l2norm(cpu, xb, 1e-6, &y), DG_ERR_DTYPE, "bf16 is a CUDA dtype",
                 "l2norm bf16 on the CPU");
    dg_check_err(dg_l2norm(cpu, xi, 1e-6, &y), DG_ERR_DTYPE, "dtype", "l2norm i32 input");
    dg_check_err(dg_rmsnorm(cpu, x, w_bad, 1e-5, &y), DG_ERR_SHAPE, "'w' must have shape [9]",
                 "rmsnorm w [10] for D = 9");
    dg_check_err(dg_rmsnorm(cpu, x, w32, 1e-5, &y), DG_ERR_DTYPE, "'w' must have dtype f64",
                 "rmsnorm f32 w with f64 x");
    dg_check_err(dg_rmsnorm(cpu, xb, NULL, 1e-5, &y), DG_ERR_DTYPE, "bf16 is a CUDA dtype",
                 "rmsnorm bf16 on the CPU");
    dg_check_err(dg_rmsnorm(cpu, x32, w, 1e-5, &y), DG_ERR_DTYPE, "'w' must have dtype f32",
                 "rmsnorm f64 w with f32 x");
    dg_check_err(dg_rmsnorm(cpu, x, w, -1e-5, &y), DG_ERR_ARG, "eps", "rmsnorm negative eps");
    dg_check_err(dg_gated_rmsnorm(cpu, x, w, NULL, 1e-5, DG_ACT_SILU, &y), DG_ERR_ARG,
                 "'gate' is NULL", "gated gate NULL");
    dg_check_err(dg_gated_rmsnorm(cpu, x, w, g_bad, 1e-5, DG_ACT_SILU, &y), DG_ERR_SHAPE,
                 "'gate' must have shape [4,9]", "gated gate [4,8] for x [4,9]");
    dg_check_err(dg_gated_rmsnorm(cpu, x32, NULL, x, 1e-5, DG_ACT_SILU, &y), DG_ERR_DTYPE,
                 "'gate' must have dtype f32", "gated f64 gate with f32 x");
    dg_check_err(dg_gated_rmsnorm(cpu, x, w, g, 1e-5, (dg_act)7, &y), DG_ERR_ARG, "act",
                 "gated unknown act");
    dg_check_err(dg_gated_rmsnorm(cpu, x, w_bad, g, 1e-5, DG_ACT_SILU, &y), DG_ERR_SHAPE, "'w'",
                 "gated w shape");
    dg_check(y == NULL, "failed calls leave the output NULL");
    dg_check(dg_tape_num_nodes() == 0, "failed calls record nothing");
    dg_tensor *all[] = {x, x32, w, w_bad, w32, g, g_bad, xb, xi};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

// ---- dg_add_rmsnorm

#define ARN_EPS 1e-5

typedef struct {
    dg_tensor *x, *r, *w, *ds, *dy; /* inputs, and the gradients seeded into sum and y */
} arn_set;

/* f64 CPU values: x, r, ds, dy normal with `shape`, w uniform in [0.5, 1.5) (or NULL). */
static arn_set arn_make(dg_ctx *cpu, int ndim, const int64_t *shape, int with_w, uint64_t seed) {
    arn_set s = {0};
    int64_t D = shape[ndim - 1];
    s.x = dg_test_randn(cpu, DG_F64, ndim, shape, seed);
    s.r = dg_test_randn(cpu, DG_F64, ndim, shape, seed + 1);
    if (with_w)
        s.w = dg_test_rand(cpu, DG_F64, 1, &D, seed + 2, 0.5, 1.5);
    s.ds = dg_test_randn(cpu, DG_F64, ndim, shape, seed + 3);
    s.dy = dg_test_randn(cpu, DG_F64, ndim, shape, seed + 4);
    return s;
}

static arn_set arn_conv(dg_ctx *ctx, const arn_set *s, dg_dtype dt) {
    arn_set o = {conv(ctx, s->x, dt), conv(ctx, s->r, dt), conv(ctx, s->w, dt),
                 conv(ctx, s->ds, dt), conv(ctx, s->dy, dt)};
    return o;
}

static void arn_free(arn_set *s) {
    dg_tensor_free(&s->x);
    dg_tensor_free(&s->r);
    dg_tensor_free(&s->w);
    dg_tensor_free(&s->ds);
    dg_tensor_free(&s->dy);
}

static void arn_grad(arn_set *s) {
    dg_tensor_set_requires_grad(s->x, 1);
    dg_tensor_set_requires_grad(s->r, 1);
    dg_tensor_set_requires_grad(s->w, 1);
}

enum { ARN_DS = 1, ARN_DY = 2 }; /* which outputs the backward is seeded from */

/* dg_add_rmsnorm (unfused = 0) or dg_add then dg_rmsnorm (1) on s, then one backward seeded with
 * s->ds into the sum and s->dy into y as `seed` says. x_twice: x is passed as r as well (s->r is
 * then unused and must get no gradient). */
static void arn_run(dg_ctx *ctx, int unfused, arn_set *s, int seed, int x_twice, dg_tensor **sum,
                    dg_tensor **y) {
    dg_tensor *r = x_twice ? s->x : s->r;
    if (unfused) {
        DG_TEST_TRY(dg_add(ctx, s->x, r, sum));
        DG_TEST_TRY(dg_rmsnorm(ctx, *sum, s->w, ARN_EPS, y));
    } else {
        DG_TEST_TRY(dg_add_rmsnorm(ctx, s->x, r, s->w, ARN_EPS, sum, y));
    }
    dg_tensor *outs[2] = {*sum, *y};
    const dg_tensor *grads[2] = {seed & ARN_DS ? s->ds : NULL, seed & ARN_DY ? s->dy : NULL};
    DG_TEST_TRY(dg_tape_backward_multi(ctx, 2, outs, grads));
    dg_tape_reset();
}

/* One gradient against another; NULL (no gradient) must match NULL. */
static void arn_check_grad(const char *label, const char *what, const dg_tensor *got,
                           const dg_tensor *want, double tol) {
    char name[192];
    snprintf(name, sizeof name, "%s %s", label, what);
    if (!got || !want)
        dg_check(!got && !want, "%s: %s gradient on both sides (got %s, want %s)", name,
                 want ? "a" : "no", got ? "one" : "none", want ? "one" : "none");
    else
        dg_check_tensor_rel(name, got, want, tol);
}

/* Both outputs and the gradients of x, r and w, norm-relative. */
static void arn_compare(const char *label, const arn_set *got, dg_tensor *gsum, dg_tensor *gy,
                        const arn_set *want, dg_tensor *wsum, dg_tensor *wy, double tol) {
    char name[192];
    snprintf(name, sizeof name, "%s sum", label);
    dg_check_tensor_rel(name, gsum, wsum, tol);
    snprintf(name, sizeof name, "%s y", label);
    dg_check_tensor_rel(name, gy, wy, tol);
    arn_check_grad(label, "dx", dg_tensor_grad(got->x), dg_tensor_grad(want->x), tol);
    arn_check_grad(label, "dr", dg_tensor_grad(got->r), dg_tensor_grad(want->r), tol);
    if (want->w)
        arn_check_grad(label, "dw", dg_tensor_grad(got->w), dg_tensor_grad(want->w), tol);
}

typedef struct {
    int transpose; /* x and r are [D, R] and are transposed to [R, D] before the op */
    double eps;
} arn_cfg;

/* in: x, r, w (or NULL); out: sum, y */
static dg_status arn_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                        void *user) {
    (void)n_in;
    (void)n_out;
    const arn_cfg *c = user;
    dg_tensor *x = in[0], *r = in[1], *xt = NULL, *rt = NULL;
    dg_status s = DG_OK;
    if (c->transpose) {
        s = dg_transpose(x, 0, 1, &xt);
        if (s == DG_OK)
            s = dg_transpose(r, 0, 1, &rt);
        x = xt, r = rt;
    }
    if (s == DG_OK)
        s = dg_add_rmsnorm(ctx, x, r, in[2], c->eps, &out[0], &out[1]);
    dg_tensor_free(&xt);
    dg_tensor_free(&rt);
    return s;
}

static void test_add_gradcheck(dg_ctx *cpu) {
    for (int with_w = 0; with_w <= 1; with_w++) {
        for (int tr = 0; tr <= 1; tr++) {
            arn_cfg c = {tr, ARN_EPS};
            /* plain: x, r [3,4,7]; transposed: [7,5] viewed as [5,7] */
            int64_t s3[3] = {3, 4, 7}, s2[2] = {7, 5}, D = 7;
            arn_set s = tr ? arn_make(cpu, 2, s2, 0, 600 + with_w)
                           : arn_make(cpu, 3, s3, with_w, 610 + with_w);
            if (tr && with_w)
                s.w = dg_test_rand(cpu, DG_F64, 1, &D, 620, 0.5, 1.5);
            arn_grad(&s);
            dg_tensor *in[3] = {s.x, s.r, s.w};
            dg_gradcheck_report rep;
            char what[128];
            snprintf(what, sizeof what, "gradcheck add_rmsnorm (sum and y)%s%s",
                     with_w ? " +w" : "", tr ? " strided x, r" : "");
            if (dg_check_ok(
                    dg_gradcheck(cpu, arn_fn, &c, in, 3, 2, 1e-6, 70 + 2 * with_w + tr, &rep),
                    what))
                dg_check(rep.max_rel_err < 1e-6, "%s: rel err x %.2e r %.2e w %.2e (< 1e-6)", what,
                         rep.rel_err[0], rep.rel_err[1], rep.rel_err[2]);
            arn_free(&s);
        }
    }
}

/* The fused op against dg_add + dg_rmsnorm on the CPU. The two compute the same expressions, but
 * the tolerance allows the last bit (f64 2e-16, f32 6e-8 relative) to differ should a compiler
 * contract the fused one's final add differently: 1e-15 (f64) and 1e-6 (f32), norm-relative. */
static void test_add_vs_unfused(dg_ctx *cpu) {
    const int seeds[] = {ARN_DS | ARN_DY, ARN_DY, ARN_DS};
    const char *seed_names[] = {"sum and y in the loss", "only y in the loss",
                                "only the sum in the loss"};
    for (int dti = 0; dti < 2; dti++) {
        dg_dtype dt = dti ? DG_F32 : DG_F64;
        double tol = dti ? 1e-6 : 1e-15;
        for (int k = 0; k < 4; k++) {
            int x_twice = k == 3, seed = x_twice ? ARN_DS | ARN_DY : seeds[k];
            int64_t shape[3] = {2, 9, 13};
            arn_set h = arn_make(cpu, 3, shape, 1, 700 + 10 * k);
            arn_set a = arn_conv(cpu, &h, dt), b = arn_conv(cpu, &h, dt);
            arn_grad(&a);
            arn_grad(&b);
            dg_tensor *sa = NULL, *ya = NULL, *sb = NULL, *yb = NULL;
            arn_run(cpu, 0, &a, seed, x_twice, &sa, &ya);
            arn_run(cpu, 1, &b, seed, x_twice, &sb, &yb);
            char label[160];
            snprintf(label, sizeof label, "add_rmsnorm %s == add + rmsnorm, %s", dg_dtype_name(dt),
                     x_twice ? "x passed as x and r" : seed_names[k]);
            arn_compare(label, &a, sa, ya, &b, sb, yb, tol);
            dg_tensor *all[] = {sa, ya, sb, yb};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                dg_tensor_free(&all[i]);
            arn_free(&h);
            arn_free(&a);
            arn_free(&b);
        }
    }
}

static void test_add_f32_vs_f64(dg_ctx *cpu) {
    int64_t shape[2] = {37, 100};
    arn_set s64 = arn_make(cpu, 2, shape, 1, 800);
    arn_set s32 = arn_conv(cpu, &s64, DG_F32);
    arn_grad(&s64);
    arn_grad(&s32);
    dg_tensor *sum64 = NULL, *y64 = NULL, *sum32 = NULL, *y32 = NULL;
    arn_run(cpu, 0, &s64, ARN_DS | ARN_DY, 0, &sum64, &y64);
    arn_run(cpu, 0, &s32, ARN_DS | ARN_DY, 0, &sum32, &y32);
    /* as for rmsnorm: f32 rounding (6e-8) grows with sums of 100 (s^2, g.s) or 37 (dw) terms */
    arn_compare("add_rmsnorm cpu f32 vs f64", &s32, sum32, y32, &s64, sum64, y64, 1e-5);
    dg_tensor *all[] = {sum64, y64, sum32, y32};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    arn_free(&s64);
    arn_free(&s32);
}

static void test_add_policy(dg_ctx *cpu) {
    int64_t shape[2] = {6, 10};
    arn_set h = arn_make(cpu, 2, shape, 1, 850);
    arn_set a = arn_conv(cpu, &h, DG_F64), b = arn_conv(cpu, &h, DG_F64);
    arn_grad(&a);
    arn_grad(&b);
    dg_tensor *sa = NULL, *ya = NULL, *sb = NULL, *yb = NULL;
    dg_policy_reset();
    DG_TEST_TRY(dg_add_rmsnorm(cpu, a.x, a.r, a.w, ARN_EPS, &sa, &ya));
    size_t cache_bytes = dg_tape_bytes();
    dg_check(dg_tape_num_nodes() == 1, "add_rmsnorm records one tape node (%d)",
             dg_tape_num_nodes());
    dg_tensor *outs_a[2] = {sa, ya}, *outs_b[2] = {NULL, NULL};
    const dg_tensor *grads_a[2] = {a.ds, a.dy}, *grads_b[2] = {b.ds, b.dy};
    DG_TEST_TRY(dg_tape_backward_multi(cpu, 2, outs_a, grads_a));
    dg_tape_reset();
    dg_policy_set("add_rmsnorm", DG_POLICY_RECOMPUTE);
    DG_TEST_TRY(dg_add_rmsnorm(cpu, b.x, b.r, b.w, ARN_EPS, &sb, &yb));
    size_t rec_bytes = dg_tape_bytes();
    outs_b[0] = sb, outs_b[1] = yb;
    DG_TEST_TRY(dg_tape_backward_multi(cpu, 2, outs_b, grads_b));
    dg_tape_reset();
    dg_policy_reset();
    dg_check(rec_bytes + 6 * sizeof(double) == cache_bytes,
             "add_rmsnorm: RECOMPUTE keeps %zu bytes, CACHE %zu (+ rstd [6] f64)", rec_bytes,
             cache_bytes);
    arn_compare("add_rmsnorm RECOMPUTE == CACHE (bitwise)", &b, sb, yb, &a, sa, ya, 0);
    dg_tensor *all[] = {sa, ya, sb, yb};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    arn_free(&h);
    arn_free(&a);
    arn_free(&b);

    /* no_grad records nothing */
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, shape, 5), *s = NULL, *y = NULL;
    dg_tensor_set_requires_grad(x, 1);
    dg_no_grad_begin();
    DG_TEST_TRY(dg_add_rmsnorm(cpu, x, x, NULL, ARN_EPS, &s, &y));
    dg_no_grad_end();
    dg_check(dg_tape_num_nodes() == 0 && !dg_tensor_requires_grad(s) && !dg_tensor_requires_grad(y),
             "add_rmsnorm under no_grad records nothing");
    dg_tensor_free(&s);
    dg_tensor_free(&y);
    dg_tensor_free(&x);
}

static void test_add_errors(dg_ctx *cpu) {
    int64_t shape[2] = {4, 9}, D = 9, D1 = 10, s48[2] = {4, 8}, s3[3] = {1, 4, 9};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, shape, 1);
    dg_tensor *r = dg_test_randn(cpu, DG_F64, 2, shape, 2);
    dg_tensor *r48 = dg_test_randn(cpu, DG_F64, 2, s48, 2);
    dg_tensor *r3 = dg_test_randn(cpu, DG_F64, 3, s3, 2);
    dg_tensor *r32 = dg_test_randn(cpu, DG_F32, 2, shape, 2);
    dg_tensor *x32 = dg_test_randn(cpu, DG_F32, 2, shape, 1);
    dg_tensor *w = dg_test_randn(cpu, DG_F64, 1, &D, 3);
    dg_tensor *w_bad = dg_test_randn(cpu, DG_F64, 1, &D1, 3);
    dg_tensor *w32 = dg_test_randn(cpu, DG_F32, 1, &D, 3);
    dg_tensor *xb = NULL, *xi = NULL, *s = NULL, *y = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, x, DG_BF16, &xb));
    DG_TEST_TRY(dg_to_dtype(cpu, x, DG_I32, &xi));
    dg_tensor_set_requires_grad(x, 1);

    dg_check_err(dg_add_rmsnorm(cpu, x, r48, w, 1e-5, &s, &y), DG_ERR_SHAPE,
                 "'r' must have shape [4,9]", "add_rmsnorm r [4,8] for x [4,9]");
    dg_check_err(dg_add_rmsnorm(cpu, x, r3, w, 1e-5, &s, &y), DG_ERR_SHAPE,
                 "'r' must have shape [4,9]", "add_rmsnorm r [1,4,9] for x [4,9] (no broadcast)");
    dg_check_err(dg_add_rmsnorm(cpu, x, r32, w, 1e-5, &s, &y), DG_ERR_DTYPE,
                 "'r' must have dtype f64 like 'x'", "add_rmsnorm f32 r with f64 x");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w_bad, 1e-5, &s, &y), DG_ERR_SHAPE,
                 "'w' must have shape [9]", "add_rmsnorm w [10] for D = 9");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w32, 1e-5, &s, &y), DG_ERR_DTYPE,
                 "'w' must have dtype f64 like 'x'", "add_rmsnorm f32 w with f64 x");
    dg_check_err(dg_add_rmsnorm(cpu, x32, r32, w, 1e-5, &s, &y), DG_ERR_DTYPE,
                 "'w' must have dtype f32 like 'x'", "add_rmsnorm f64 w with f32 x");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, 0.0, &s, &y), DG_ERR_ARG,
                 "eps must be finite and > 0", "add_rmsnorm eps 0");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, -1e-5, &s, &y), DG_ERR_ARG, "eps",
                 "add_rmsnorm negative eps");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, NAN, &s, &y), DG_ERR_ARG, "eps",
                 "add_rmsnorm NaN eps");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, INFINITY, &s, &y), DG_ERR_ARG, "eps",
                 "add_rmsnorm infinite eps");
    dg_check_err(dg_add_rmsnorm(cpu, xb, xb, NULL, 1e-5, &s, &y), DG_ERR_DTYPE,
                 "bf16 is a CUDA dtype", "add_rmsnorm bf16 on the CPU");
    dg_check_err(dg_add_rmsnorm(cpu, xi, xi, NULL, 1e-5, &s, &y), DG_ERR_DTYPE, "dtype",
                 "add_rmsnorm i32 input");
    dg_check_err(dg_add_rmsnorm(cpu, NULL, r, w, 1e-5, &s, &y), DG_ERR_ARG, "'x' is NULL",
                 "add_rmsnorm x NULL");
    dg_check_err(dg_add_rmsnorm(cpu, x, NULL, w, 1e-5, &s, &y), DG_ERR_ARG, "'r' is NULL",
                 "add_rmsnorm r NULL");
    dg_check_err(dg_add_rmsnorm(NULL, x, r, w, 1e-5, &s, &y), DG_ERR_ARG, "'ctx' is NULL",
                 "add_rmsnorm ctx NULL");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, 1e-5, NULL, &y), DG_ERR_ARG, "'sum' is NULL",
                 "add_rmsnorm sum NULL");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, 1e-5, &s, NULL), DG_ERR_ARG, "'y' is NULL",
                 "add_rmsnorm y NULL");
    dg_check_err(dg_add_rmsnorm(cpu, x, r, w, 1e-5, &s, &s), DG_ERR_ARG, "different variables",
                 "add_rmsnorm sum and y the same variable");
    dg_check(s == NULL && y == NULL, "failed add_rmsnorm calls leave both outputs NULL");
    dg_check(dg_tape_num_nodes() == 0, "failed add_rmsnorm calls record nothing");
    dg_tensor *all[] = {x, r, r48, r3, r32, x32, w, w_bad, w32, xb, xi};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

// ---- gpu

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    /* warp path with the row in registers (D <= 256), warp path (D <= 1024), block path
     * (D > 1024), many rows (several dw chunks), 3-d x; l2norm's 16-byte forward with 1, 2 and 4
     * rows per warp (D = 100 f32; 256 bf16; 64: 16 and 8 lanes per row, 77 rows: a warp with
     * rows past the end) */
    const int64_t shapes[][3] = {{37, 100, 0}, {300, 1500, 0}, {1000, 33, 0}, {3, 37, 129},
                                 {50, 600, 0}, {20, 256, 0},   {77, 64, 0}};
    const int ndims[] = {2, 2, 2, 3, 2, 2, 2};
    for (int si = 0; si < 7; si++) {
        for (int k = 0; k < N_CFGS; k++) {
            for (int dti = 0; dti < 2; dti++) {
                dg_dtype dt = dti ? DG_BF16 : DG_F32;
                norm_cfg c = g_cfgs[k];
                norm_set h = make_set(cpu, &c, ndims[si], shapes[si], 1, 1000 + 10 * si + k);
                norm_set dev = conv_set(gpu, &h, dt);
                norm_set ref = conv_set(cpu, &dev, DG_F64); /* the device's rounded values */
                set_grad(&dev);
                set_grad(&ref);
                dg_tensor *yd = NULL, *yr = NULL;
                run_set(gpu, &c, &dev, &yd);
                run_set(cpu, &c, &ref, &yr);
                char label[128];
                snprintf(label, sizeof label, "%s cuda %s vs cpu [%lld..%lld]", op_name(&c),
                         dg_dtype_name(dt), (long long)shapes[si][0],
                         (long long)shapes[si][ndims[si] - 1]);
                /* f32: f32 sums over <= 1500 terms; bf16: outputs rounded to 8 bits (4e-3) */
                compare_sets(label, &dev, yd, &ref, yr, dt == DG_F32 ? 1e-5 : 1e-2);
                dg_tensor_free(&yd);
                dg_tensor_free(&yr);
                free_set(&h);
                free_set(&dev);
                free_set(&ref);
            }
        }
    }

    /* determinism and CACHE vs RECOMPUTE on the device: bitwise equal gradients */
    for (int k = 0; k < N_CFGS; k++) {
        norm_cfg c = g_cfgs[k];
        int64_t shape[2] = {777, 1100};
        norm_set h = make_set(cpu, &c, 2, shape, 1, 3000 + k);
        norm_set a = conv_set(gpu, &h, DG_F32), b = conv_set(gpu, &h, DG_F32);
        set_grad(&a);
        set_grad(&b);
        dg_tensor *ya = NULL, *yb = NULL;
        run_set(gpu, &c, &a, &ya);
        run_set(gpu, &c, &b, &yb);
        char label[128];
        snprintf(label, sizeof label, "%s cuda run twice (bitwise)", op_name(&c));
        compare_sets(label, &b, yb, &a, ya, 0);
        dg_tensor_free(&yb);
        dg_tensor_zero_grad(b.x);
        dg_tensor_zero_grad(b.w);
        dg_tensor_zero_grad(b.g);
        const char *kind = c.op == OP_L2 ? "l2norm" : c.op == OP_RMS ? "rmsnorm" : "gated_rmsnorm";
        dg_policy_set(kind, DG_POLICY_RECOMPUTE);
        run_set(gpu, &c, &b, &yb);
        dg_policy_reset();
        snprintf(label, sizeof label, "%s cuda RECOMPUTE == CACHE (bitwise)", op_name(&c));
        compare_sets(label, &b, yb, &a, ya, 0);
        dg_tensor_free(&ya);
        dg_tensor_free(&yb);
        free_set(&h);
        free_set(&a);
        free_set(&b);
    }

    /* strided input on the device */
    {
        int64_t shape[2] = {65, 47}, D = 65;
        dg_tensor *xh = dg_test_randn(cpu, DG_F64, 2, shape, 71);
        dg_tensor *wh = dg_test_rand(cpu, DG_F64, 1, &D, 72, 0.5, 1.5);
        dg_tensor *xg = conv(gpu, xh, DG_F32), *wg = conv(gpu, wh, DG_F32);
        dg_tensor *xgt = NULL, *xht = NULL, *yg = NULL, *yh = NULL;
        DG_TEST_TRY(dg_transpose(xg, 0, 1, &xgt));
        DG_TEST_TRY(dg_transpose(xh, 0, 1, &xht));
        DG_TEST_TRY(dg_rmsnorm(gpu, xgt, wg, 1e-5, &yg));
        DG_TEST_TRY(dg_rmsnorm(cpu, xht, wh, 1e-5, &yh));
        dg_check_tensor_rel("rmsnorm cuda f32 strided x vs cpu", yg, yh, 1e-5);
        dg_tensor *all[] = {xh, wh, xg, wg, xgt, xht, yg, yh};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }

    /* device and dtype errors */
    {
        int64_t shape[2] = {4, 9}, D = 9;
        dg_tensor *xh = dg_test_randn(cpu, DG_F32, 2, shape, 1);
        dg_tensor *wh = dg_test_randn(cpu, DG_F32, 1, &D, 2);
        dg_tensor *xg = conv(gpu, xh, DG_F32), *xg64 = conv(gpu, xh, DG_F64), *y = NULL;
        dg_check_err(dg_rmsnorm(gpu, xg, wh, 1e-5, &y), DG_ERR_DEVICE, "'w' must be on cuda",
                     "rmsnorm cuda x with cpu w");
        dg_check_err(dg_l2norm(cpu, xg, 1e-6, &y), DG_ERR_DEVICE, "'x' must be on cpu",
                     "l2norm cuda x in a cpu context");
        dg_check_err(dg_l2norm(gpu, xg64, 1e-6, &y), DG_ERR_DTYPE, "CUDA kernels run f32 or bf16",
                     "l2norm f64 on cuda");
        dg_check_err(dg_gated_rmsnorm(gpu, xg, NULL, xh, 1e-5, DG_ACT_SILU, &y), DG_ERR_DEVICE,
                     "'gate' must be on cuda", "gated cuda x with cpu gate");
        dg_tensor *all[] = {xh, wh, xg, xg64};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }
    dg_ctx_free(&gpu);
}

static void test_add_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    /* Warp path: D = 1, 7, 33, 896, 1000; block path: 1500 (dw share in shared memory) and 13000
     * (in global memory). Rows: few, and enough for several rows per block with dw (the grid
     * is capped at 768 blocks: 20000 rows on the warp path, 2500 and 1100 on the block path). */
    const int64_t shapes[][3] = {{5, 1, 0},      {37, 7, 0},      {20000, 33, 0},   {3, 41, 896},
                                 {300, 1000, 0}, {2500, 1500, 0}, {1100, 13000, 0}, {1, 1000, 0}};
    const int ndims[] = {2, 2, 2, 3, 2, 2, 2, 2};
    const int n_shapes = (int)(sizeof ndims / sizeof *ndims);
    for (int si = 0; si < n_shapes; si++) {
        int64_t D = shapes[si][ndims[si] - 1];
        for (int dti = 0; dti < 2; dti++) {
            dg_dtype dt = dti ? DG_BF16 : DG_F32;
            arn_set h = arn_make(cpu, ndims[si], shapes[si], 1, 4000 + 10 * si);
            arn_set dev = arn_conv(gpu, &h, dt);
            arn_set ref = arn_conv(cpu, &dev, DG_F64); /* the device's rounded values */
            arn_grad(&dev);
            arn_grad(&ref);
            dg_tensor *sd = NULL, *yd = NULL, *sr = NULL, *yr = NULL;
            arn_run(gpu, 0, &dev, ARN_DS | ARN_DY, 0, &sd, &yd);
            arn_run(cpu, 0, &ref, ARN_DS | ARN_DY, 0, &sr, &yr);
            char label[128];
            snprintf(label, sizeof label, "add_rmsnorm cuda %s vs cpu [%lld rows, D %lld]",
                     dg_dtype_name(dt), (long long)(dg_tensor_numel(h.x) / D), (long long)D);
            /* f32: f32 sums over <= 13000 terms (dw: 20000 rows); bf16: sum and outputs rounded
             * to 8 bits (4e-3), and y is computed from the rounded sum */
            arn_compare(label, &dev, sd, yd, &ref, sr, yr, dt == DG_F32 ? 1e-5 : 1e-2);
            dg_tensor *all[] = {sd, yd, sr, yr};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                dg_tensor_free(&all[i]);
            arn_free(&h);
            arn_free(&dev);
            arn_free(&ref);
        }
    }

    /* one output in the loss, and no weight */
    for (int k = 0; k < 3; k++) {
        int seed = k == 0 ? ARN_DY : k == 1 ? ARN_DS : ARN_DS | ARN_DY;
        int64_t shape[2] = {77, 130};
        arn_set h = arn_make(cpu, 2, shape, k != 2, 4500 + k);
        arn_set dev = arn_conv(gpu, &h, DG_F32), ref = arn_conv(cpu, &dev, DG_F64);
        arn_grad(&dev);
        arn_grad(&ref);
        dg_tensor *sd = NULL, *yd = NULL, *sr = NULL, *yr = NULL;
        arn_run(gpu, 0, &dev, seed, 0, &sd, &yd);
        arn_run(cpu, 0, &ref, seed, 0, &sr, &yr);
        const char *what[] = {"only y in the loss", "only the sum in the loss", "no weight"};
        char label[128];
        snprintf(label, sizeof label, "add_rmsnorm cuda f32 vs cpu, %s", what[k]);
        arn_compare(label, &dev, sd, yd, &ref, sr, yr, 1e-5);
        dg_tensor *all[] = {sd, yd, sr, yr};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
        arn_free(&h);
        arn_free(&dev);
        arn_free(&ref);
    }

    /* determinism and CACHE vs RECOMPUTE (bitwise) on the three backward layouts (dw share per
     * warp, per block in shared memory, per block in global memory), with several rows per block;
     * the fused kernels against dg_add + dg_rmsnorm on the device */
    const int64_t dshapes[][2] = {{9000, 896}, {2500, 1500}, {1500, 13000}};
    for (int si = 0; si < 3; si++) {
        for (int dti = 0; dti < 2; dti++) {
            dg_dtype dt = dti ? DG_BF16 : DG_F32;
            arn_set h = arn_make(cpu, 2, dshapes[si], 1, 5000 + si);
            arn_set a = arn_conv(gpu, &h, dt), b = arn_conv(gpu, &h, dt), u = arn_conv(gpu, &h, dt);
            arn_grad(&a);
            arn_grad(&b);
            arn_grad(&u);
            dg_tensor *sa = NULL, *ya = NULL, *sb = NULL, *yb = NULL, *su = NULL, *yu = NULL;
            arn_run(gpu, 0, &a, ARN_DS | ARN_DY, 0, &sa, &ya);
            arn_run(gpu, 0, &b, ARN_DS | ARN_DY, 0, &sb, &yb);
            char label[128];
            snprintf(label, sizeof label, "add_rmsnorm cuda %s D %lld run twice (bitwise)",
                     dg_dtype_name(dt), (long long)dshapes[si][1]);
            arn_compare(label, &b, sb, yb, &a, sa, ya, 0);
            dg_tensor_free(&sb);
            dg_tensor_free(&yb);
            dg_tensor_zero_grad(b.x);
            dg_tensor_zero_grad(b.r);
            dg_tensor_zero_grad(b.w);
            dg_policy_set("add_rmsnorm", DG_POLICY_RECOMPUTE);
            arn_run(gpu, 0, &b, ARN_DS | ARN_DY, 0, &sb, &yb);
            dg_policy_reset();
            snprintf(label, sizeof label, "add_rmsnorm cuda %s D %lld RECOMPUTE == CACHE (bitwise)",
                     dg_dtype_name(dt), (long long)dshapes[si][1]);
            arn_compare(label, &b, sb, yb, &a, sa, ya, 0);
            arn_run(gpu, 1, &u, ARN_DS | ARN_DY, 0, &su, &yu);
            snprintf(label, sizeof label, "add_rmsnorm cuda %s D %lld == add + rmsnorm",
                     dg_dtype_name(dt), (long long)dshapes[si][1]);
            /* the sum and the statistics are the same; the gradients differ in rounding: the
             * unfused path rounds dx to the dtype before adding the sum's gradient (bf16: 4e-3),
             * and dw is summed over rows in another order (f32) */
            arn_compare(label, &a, sa, ya, &u, su, yu, dt == DG_F32 ? 1e-5 : 1e-2);
            dg_tensor *all[] = {sa, ya, sb, yb, su, yu};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                dg_tensor_free(&all[i]);
            arn_free(&h);
            arn_free(&a);
            arn_free(&b);
            arn_free(&u);
        }
    }

    /* device and dtype errors */
    {
        int64_t shape[2] = {4, 9};
        dg_tensor *xh = dg_test_randn(cpu, DG_F32, 2, shape, 1);
        dg_tensor *xg = conv(gpu, xh, DG_F32), *xg64 = conv(gpu, xh, DG_F64);
        dg_tensor *xgb = conv(gpu, xh, DG_BF16), *s = NULL, *y = NULL;
        dg_check_err(dg_add_rmsnorm(gpu, xg, xh, NULL, 1e-5, &s, &y), DG_ERR_DEVICE,
                     "'r' must be on cuda", "add_rmsnorm cuda x with cpu r");
        dg_check_err(dg_add_rmsnorm(gpu, xg64, xg64, NULL, 1e-5, &s, &y), DG_ERR_DTYPE,
                     "CUDA kernels run f32 or bf16", "add_rmsnorm f64 on cuda");
        dg_check_err(dg_add_rmsnorm(gpu, xg, xgb, NULL, 1e-5, &s, &y), DG_ERR_DTYPE,
                     "'r' must have dtype f32 like 'x'", "add_rmsnorm f32 x with bf16 r");
        dg_check_err(dg_add_rmsnorm(cpu, xg, xg, NULL, 1e-5, &s, &y), DG_ERR_DEVICE,
                     "'x' must be on cpu", "add_rmsnorm cuda x in a cpu context");
        dg_tensor *all[] = {xh, xg, xg64, xgb};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_f32_vs_f64(cpu);
    test_policy(cpu);
    test_errors(cpu);
    test_add_gradcheck(cpu);
    test_add_vs_unfused(cpu);
    test_add_f32_vs_f64(cpu);
    test_add_policy(cpu);
    test_add_errors(cpu);
}

static void gpu_cases(dg_ctx *cpu) {
    test_gpu(cpu);
    test_add_gpu(cpu);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "norm", cpu_cases, gpu_cases); }

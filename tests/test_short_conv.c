/*
 * tests/test_short_conv.c -- dg_short_conv: causal depthwise conv along T with optional bias,
 * SiLU and varlen sequences.
 *
 * cpu: f64 gradchecks of x, w, bias (W = 1, 3, 4, 8, both activations, strided x, varlen with
 *      three odd-length sequences), values against a direct per-sequence loop, sequence isolation
 *      (changing one sequence leaves the others bit-identical; gradients do not cross), varlen ==
 *      each sequence alone == batch mode, cu_seqlens copied into the node, f32 vs f64, bad args.
 * gpu: CUDA (f32, bf16) vs the CPU on the same values for y, dx, dw, dbias (batch and varlen,
 *      odd sizes, many rows, an empty sequence, sequences shorter than W and boundaries at the
 *      kernels' tile edges, x not aligned for paired loads), bitwise determinism, isolation,
 *      device errors.
 */
#include "tests/harness.h"

#include <string.h>

typedef struct {
    dg_act act;
    const int64_t *cu;
    int n_seqs;
    int transpose; /* x is [B, C, T] and is transposed to [B, T, C] before the op */
} sc_cfg;

static dg_status conv_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                         void *user) {
    (void)n_in;
    (void)n_out;
    const sc_cfg *c = user;
    dg_tensor *x = NULL, *xt = NULL;
    dg_status s = dg_test_along_t(in[0], c->transpose, &xt, &x);
    if (s == DG_OK)
        s = dg_short_conv(ctx, x, in[1], in[2], c->act, c->cu, c->n_seqs, &out[0]);
    dg_tensor_free(&xt);
    return s;
}

/* The forward written out per sequence, in f64. */
static void ref_conv(int64_t B, int64_t T, int64_t C, int W, const double *x, const double *w,
                     const double *bias, dg_act act, const int64_t *cu, int n_seqs, double *y) {
    int64_t nseg = cu ? n_seqs : B;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t st = cu ? cu[s] : s * T, len = cu ? cu[s + 1] - cu[s] : T;
        for (int64_t t = 0; t < len; t++)
            for (int64_t c = 0; c < C; c++) {
                double z = 0;
                for (int i = 0; i < W; i++) {
                    int64_t tt = t - W + 1 + i; /* position inside the sequence */
                    if (tt >= 0)
                        z += w[c * W + i] * x[(st + tt) * C + c];
                }
                if (bias)
                    z += bias[c];
                y[(st + t) * C + c] = act == DG_ACT_SILU ? z / (1.0 + exp(-z)) : z;
            }
    }
}

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
    dg_tensor *x, *w, *b, *dy;
} sc_set;

static sc_set make_set(dg_ctx *cpu, int64_t B, int64_t T, int64_t C, int64_t W, int with_bias,
                       uint64_t seed) {
    int64_t xs[3] = {B, T, C}, ws[2] = {C, W};
    sc_set s = {0};
    s.x = dg_test_randn(cpu, DG_F64, 3, xs, seed);
    s.w = dg_test_rand(cpu, DG_F64, 2, ws, seed + 1, -1, 1);
    if (with_bias)
        s.b = dg_test_rand(cpu, DG_F64, 1, &C, seed + 2, -0.5, 0.5);
    s.dy = dg_test_randn(cpu, DG_F64, 3, xs, seed + 3);
    return s;
}

static sc_set conv_set(dg_ctx *ctx, const sc_set *s, dg_dtype dt) {
    sc_set o = {conv(ctx, s->x, dt), conv(ctx, s->w, dt), conv(ctx, s->b, dt),
                conv(ctx, s->dy, dt)};
    return o;
}

static void free_set(sc_set *s) {
    dg_tensor_free(&s->x);
    dg_tensor_free(&s->w);
    dg_tensor_free(&s->b);
    dg_tensor_free(&s->dy);
}

/* Forward + backward with all three inputs tracked. */
static void run_set(dg_ctx *ctx, const sc_cfg *c, sc_set *s, dg_tensor **y) {
    dg_tensor_set_requires_grad(s->x, 1);
    dg_tensor_set_requires_grad(s->w, 1);
    dg_tensor_set_requires_grad(s->b, 1);
    DG_TEST_TRY(dg_short_conv(ctx, s->x, s->w, s->b, c->act, c->cu, c->n_seqs, y));
    DG_TEST_TRY(dg_tape_backward_with(ctx, *y, s->dy));
    dg_tape_reset();
}

static void compare_sets(const char *label, const sc_set *got, dg_tensor *ygot, const sc_set *want,
                         dg_tensor *ywant, double tol) {
    char name[160];
    snprintf(name, sizeof name, "%s y", label);
    dg_check_tensor_rel(name, ygot, ywant, tol);
    snprintf(name, sizeof name, "%s dx", label);
    dg_check_tensor_rel(name, dg_tensor_grad(got->x), dg_tensor_grad(want->x), tol);
    snprintf(name, sizeof name, "%s dw", label);
    dg_check_tensor_rel(name, dg_tensor_grad(got->w), dg_tensor_grad(want->w), tol);
    if (want->b) {
        snprintf(name, sizeof name, "%s dbias", label);
        dg_check_tensor_rel(name, dg_tensor_grad(got->b), dg_tensor_grad(want->b), tol);
    }
}

/* Three sequences of odd lengths 5, 7, 3 packed into T = 15. */
static const int64_t g_cu3[4] = {0, 5, 12, 15};

// ---- cpu

static void test_gradcheck(dg_ctx *cpu) {
    struct {
        int64_t B, T, C, W;
        dg_act act;
        int bias, transpose, varlen;
    } cases[] = {
        {2, 9, 5, 4, DG_ACT_SILU, 1, 0, 0},  {2, 9, 5, 4, DG_ACT_NONE, 1, 0, 0},
        {2, 7, 3, 1, DG_ACT_SILU, 1, 0, 0},  {1, 11, 3, 8, DG_ACT_SILU, 1, 0, 0},
        {3, 6, 4, 3, DG_ACT_NONE, 0, 0, 0},  {2, 8, 5, 4, DG_ACT_SILU, 1, 1, 0},
        {1, 15, 3, 4, DG_ACT_SILU, 1, 0, 1}, {1, 15, 2, 8, DG_ACT_NONE, 1, 0, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        sc_cfg c = {cases[k].act, cases[k].varlen ? g_cu3 : NULL, cases[k].varlen ? 3 : 0,
                    cases[k].transpose};
        sc_set s =
            make_set(cpu, cases[k].B, cases[k].T, cases[k].C, cases[k].W, cases[k].bias, 60 + k);
        if (c.transpose) { /* x stored [B, C, T] */
            int64_t xs[3] = {cases[k].B, cases[k].C, cases[k].T};
            dg_tensor_free(&s.x);
            s.x = dg_test_randn(cpu, DG_F64, 3, xs, 90 + k);
        }
        dg_tensor_set_requires_grad(s.x, 1);
        dg_tensor_set_requires_grad(s.w, 1);
        dg_tensor_set_requires_grad(s.b, 1);
        dg_tensor *in[3] = {s.x, s.w, s.b};
        dg_gradcheck_report rep;
        char what[128];
        snprintf(what, sizeof what, "gradcheck short_conv B%lld T%lld C%lld W%lld %s%s%s%s",
                 (long long)cases[k].B, (long long)cases[k].T, (long long)cases[k].C,
                 (long long)cases[k].W, c.act == DG_ACT_SILU ? "silu" : "none",
                 cases[k].bias ? " +bias" : "", c.transpose ? " strided" : "",
                 c.cu ? " varlen 5/7/3" : "");
        if (dg_check_ok(dg_gradcheck(cpu, conv_fn, &c, in, 3, 1, 1e-6, 5 + k, &rep), what))
            dg_check(rep.max_rel_err < 1e-6, "%s: rel err x %.2e w %.2e bias %.2e (< 1e-6)", what,
                     rep.rel_err[0], rep.rel_err[1], rep.rel_err[2]);
        free_set(&s);
    }
}

static void test_values(dg_ctx *cpu) {
    struct {
        int64_t B, T, C, W;
        const int64_t *cu;
        int n;
    } cases[] = {{3, 10, 6, 4, NULL, 0}, {1, 15, 6, 4, g_cu3, 3}, {1, 15, 4, 8, g_cu3, 3}};
    for (int k = 0; k < 3; k++) {
        for (int a = 0; a < 2; a++) {
            dg_act act = a ? DG_ACT_SILU : DG_ACT_NONE;
            sc_set s = make_set(cpu, cases[k].B, cases[k].T, cases[k].C, cases[k].W, 1, 10 + k);
            dg_tensor *y = NULL;
            DG_TEST_TRY(dg_short_conv(cpu, s.x, s.w, s.b, act, cases[k].cu, cases[k].n, &y));
            int64_t n = dg_tensor_numel(y);
            double *x, *w, *b, *yv, *ref = malloc((size_t)n * sizeof(double));
            DG_TEST_TRY(dg_tensor_to_f64(s.x, &x));
            DG_TEST_TRY(dg_tensor_to_f64(s.w, &w));
            DG_TEST_TRY(dg_tensor_to_f64(s.b, &b));
            DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
            ref_conv(cases[k].B, cases[k].T, cases[k].C, (int)cases[k].W, x, w, b, act, cases[k].cu,
                     cases[k].n, ref);
            char name[96];
            snprintf(name, sizeof name, "short_conv f64 == per-sequence loop (W%lld %s%s)",
                     (long long)cases[k].W, a ? "silu" : "none", cases[k].cu ? " varlen" : "");
            /* same sums in the same order, only exp may differ in the last ulp */
            dg_check_close(name, yv, ref, n, 1e-15, 1e-13);
            free(x);
            free(w);
            free(b);
            free(yv);
            free(ref);
            dg_tensor_free(&y);
            free_set(&s);
        }
    }
}

/* Changing x in one sequence leaves y of the others bit-identical; the gradient of one
 * sequence's output reaches only that sequence's x. Runs on ctx in dtype dt. */
static void test_isolation(dg_ctx *cpu, dg_ctx *ctx, dg_dtype dt) {
    const int64_t T = 15, C = 6;
    sc_set h = make_set(cpu, 1, T, C, 4, 1, 123);
    sc_set s = conv_set(ctx, &h, dt);
    sc_cfg c = {DG_ACT_SILU, g_cu3, 3, 0};
    double *xv;
    DG_TEST_TRY(dg_tensor_to_f64(h.x, &xv));
    for (int seq = 0; seq < 3; seq++) {
        double *x2 = malloc((size_t)(T * C) * sizeof(double));
        memcpy(x2, xv, (size_t)(T * C) * sizeof(double));
        for (int64_t r = g_cu3[seq]; r < g_cu3[seq + 1]; r++)
            for (int64_t cc = 0; cc < C; cc++)
                x2[r * C + cc] += 1.0 + 0.25 * (double)cc;
        int64_t xs[3] = {1, T, C};
        dg_tensor *xm = NULL, *y0 = NULL, *y1 = NULL;
        DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, 3, xs, x2, &xm));
        DG_TEST_TRY(dg_short_conv(ctx, s.x, s.w, s.b, c.act, c.cu, c.n_seqs, &y0));
        DG_TEST_TRY(dg_short_conv(ctx, xm, s.w, s.b, c.act, c.cu, c.n_seqs, &y1));
        double *a, *b;
        DG_TEST_TRY(dg_tensor_to_f64(y0, &a));
        DG_TEST_TRY(dg_tensor_to_f64(y1, &b));
        int same_outside = 1, changed_inside = 0;
        for (int64_t r = 0; r < T; r++)
            for (int64_t cc = 0; cc < C; cc++) {
                int inside = r >= g_cu3[seq] && r < g_cu3[seq + 1];
                int eq = memcmp(&a[r * C + cc], &b[r * C + cc], sizeof(double)) == 0;
                if (inside)
                    changed_inside |= !eq;
                else
                    same_outside &= eq;
            }
        dg_check(same_outside && changed_inside,
                 "short_conv %s %s: changing sequence %d changes it and leaves the others "
                 "bit-identical",
                 dg_device_str(dg_ctx_device(ctx)), dg_dtype_name(dt), seq);
        free(a);
        free(b);
        free(x2);
        dg_tensor_free(&xm);
        dg_tensor_free(&y0);
        dg_tensor_free(&y1);

        /* gradient of sum(y[seq]) w.r.t. x is zero outside seq */
        double *dyv = calloc((size_t)(T * C), sizeof(double));
        for (int64_t r = g_cu3[seq]; r < g_cu3[seq + 1]; r++)
            for (int64_t cc = 0; cc < C; cc++)
                dyv[r * C + cc] = 1.0;
        dg_tensor *dy = NULL, *y = NULL;
        DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, 3, xs, dyv, &dy));
        dg_tensor_set_requires_grad(s.x, 1);
        DG_TEST_TRY(dg_short_conv(ctx, s.x, s.w, s.b, c.act, c.cu, c.n_seqs, &y));
        DG_TEST_TRY(dg_tape_backward_with(ctx, y, dy));
        dg_tape_reset();
        double *gx;
        DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(s.x), &gx));
        int zero_outside = 1, nonzero_inside = 0;
        for (int64_t r = 0; r < T; r++)
            for (int64_t cc = 0; cc < C; cc++) {
                int inside = r >= g_cu3[seq] && r < g_cu3[seq + 1];
                if (inside)
                    nonzero_inside |= gx[r * C + cc] != 0.0;
                else
                    zero_outside &= gx[r * C + cc] == 0.0;
            }
        dg_check(zero_outside && nonzero_inside,
                 "short_conv %s %s: d sum(y[seq %d]) / dx is exactly zero outside the sequence",
                 dg_device_str(dg_ctx_device(ctx)), dg_dtype_name(dt), seq);
        free(gx);
        free(dyv);
        dg_tensor_zero_grad(s.x);
        dg_tensor_set_requires_grad(s.x, 0);
        dg_tensor_free(&dy);
        dg_tensor_free(&y);
    }
    free(xv);
    free_set(&h);
    free_set(&s);
}

/* varlen == each sequence alone; batch mode == varlen with cu = {0, T, 2T, ...}. */
static void test_varlen_equivalence(dg_ctx *cpu) {
    const int64_t T = 15, C = 5;
    sc_set s = make_set(cpu, 1, T, C, 4, 1, 321);
    dg_tensor *y = NULL;
    DG_TEST_TRY(dg_short_conv(cpu, s.x, s.w, s.b, DG_ACT_SILU, g_cu3, 3, &y));
    double *yv;
    DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
    int ok = 1;
    for (int seq = 0; seq < 3; seq++) {
        dg_tensor *xs = NULL, *ys = NULL;
        DG_TEST_TRY(dg_slice(s.x, 1, g_cu3[seq], g_cu3[seq + 1], &xs));
        DG_TEST_TRY(dg_short_conv(cpu, xs, s.w, s.b, DG_ACT_SILU, NULL, 0, &ys));
        double *ysv;
        DG_TEST_TRY(dg_tensor_to_f64(ys, &ysv));
        ok &= memcmp(ysv, yv + g_cu3[seq] * C,
                     (size_t)((g_cu3[seq + 1] - g_cu3[seq]) * C) * sizeof(double)) == 0;
        free(ysv);
        dg_tensor_free(&xs);
        dg_tensor_free(&ys);
    }
    dg_check(ok, "short_conv varlen 5/7/3 == each sequence run alone (bitwise)");
    free(yv);
    dg_tensor_free(&y);
    free_set(&s);

    /* batch [3, 7, C] == varlen [1, 21, C] with cu {0, 7, 14, 21}, values and gradients */
    sc_set b = make_set(cpu, 3, 7, C, 4, 1, 654);
    sc_set v = conv_set(cpu, &b, DG_F64);
    int64_t flat[3] = {1, 21, C};
    dg_tensor *vx = NULL, *vdy = NULL;
    DG_TEST_TRY(dg_reshape(v.x, 3, flat, &vx));
    DG_TEST_TRY(dg_reshape(v.dy, 3, flat, &vdy));
    dg_tensor_free(&v.x);
    dg_tensor_free(&v.dy);
    v.x = vx;
    v.dy = vdy;
    static const int64_t cu_b[4] = {0, 7, 14, 21};
    sc_cfg cb = {DG_ACT_SILU, NULL, 0, 0}, cv = {DG_ACT_SILU, cu_b, 3, 0};
    dg_tensor *yb = NULL, *yvv = NULL;
    run_set(cpu, &cb, &b, &yb);
    run_set(cpu, &cv, &v, &yvv);
    compare_sets("short_conv batch == varlen {0,7,14,21} (bitwise)", &v, yvv, &b, yb, 0);
    dg_tensor_free(&yb);
    dg_tensor_free(&yvv);
    free_set(&b);
    free_set(&v);
}

/* The caller's cu_seqlens may die right after the forward. */
static void test_cu_copied(dg_ctx *cpu, dg_ctx *ctx, dg_dtype dt) {
    sc_set h = make_set(cpu, 1, 15, 7, 4, 1, 777);
    sc_set a = conv_set(ctx, &h, dt), b = conv_set(ctx, &h, dt);
    sc_cfg c = {DG_ACT_SILU, g_cu3, 3, 0};
    dg_tensor *ya = NULL, *yb = NULL;
    run_set(ctx, &c, &a, &ya);
    int64_t *cu = malloc(4 * sizeof(int64_t));
    memcpy(cu, g_cu3, 4 * sizeof(int64_t));
    dg_tensor_set_requires_grad(b.x, 1);
    dg_tensor_set_requires_grad(b.w, 1);
    dg_tensor_set_requires_grad(b.b, 1);
    DG_TEST_TRY(dg_short_conv(ctx, b.x, b.w, b.b, DG_ACT_SILU, cu, 3, &yb));
    for (int i = 0; i < 4; i++)
        cu[i] = -12345; /* scribble, then free: backward must not look here */
    free(cu);
    DG_TEST_TRY(dg_tape_backward_with(ctx, yb, b.dy));
    dg_tape_reset();
    char label[96];
    snprintf(label, sizeof label, "short_conv %s %s cu_seqlens freed before backward",
             dg_device_str(dg_ctx_device(ctx)), dg_dtype_name(dt));
    compare_sets(label, &b, yb, &a, ya, 0);
    dg_tensor_free(&ya);
    dg_tensor_free(&yb);
    free_set(&h);
    free_set(&a);
    free_set(&b);
}

static void test_f32_vs_f64(dg_ctx *cpu) {
    static const int64_t cu[4] = {0, 13, 14, 37};
    for (int varlen = 0; varlen <= 1; varlen++) {
        sc_set s64 = make_set(cpu, varlen ? 1 : 3, 37, 20, 4, 1, 888 + varlen);
        sc_set s32 = conv_set(cpu, &s64, DG_F32);
        sc_cfg c = {DG_ACT_SILU, varlen ? cu : NULL, varlen ? 3 : 0, 0};
        dg_tensor *y64 = NULL, *y32 = NULL;
        run_set(cpu, &c, &s64, &y64);
        run_set(cpu, &c, &s32, &y32);
        /* f32 rounding (6e-8) over W = 4 taps, and dw sums over up to 111 rows */
        compare_sets(varlen ? "short_conv cpu f32 vs f64 varlen" : "short_conv cpu f32 vs f64",
                     &s32, y32, &s64, y64, 1e-5);
        dg_tensor_free(&y64);
        dg_tensor_free(&y32);
        free_set(&s64);
        free_set(&s32);
    }
}

static void test_errors(dg_ctx *cpu) {
    int64_t xs[3] = {2, 9, 5}, x1s[3] = {1, 9, 5}, x2s[2] = {9, 5};
    int64_t w9s[2] = {5, 9}, w0s[2] = {5, 0}, wcs[2] = {6, 4}, ws[2] = {5, 4}, w1s[1] = {5};
    int64_t C = 5, C1 = 6;
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 3, xs, 1);
    dg_tensor *x1 = dg_test_randn(cpu, DG_F64, 3, x1s, 1);
    dg_tensor *x2 = dg_test_randn(cpu, DG_F64, 2, x2s, 1);
    dg_tensor *w = dg_test_randn(cpu, DG_F64, 2, ws, 2);
    dg_tensor *w9 = dg_test_randn(cpu, DG_F64, 2, w9s, 2);
    dg_tensor *w0 = NULL, *y = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 2, w0s, &w0));
    dg_tensor *wc = dg_test_randn(cpu, DG_F64, 2, wcs, 2);
    dg_tensor *w1 = dg_test_randn(cpu, DG_F64, 1, w1s, 2);
    dg_tensor *w32 = dg_test_randn(cpu, DG_F32, 2, ws, 2);
    dg_tensor *b = dg_test_randn(cpu, DG_F64, 1, &C, 3);
    dg_tensor *b6 = dg_test_randn(cpu, DG_F64, 1, &C1, 3);
    dg_tensor *xb = conv(cpu, x, DG_BF16);
    const int64_t cu_ok[3] = {0, 4, 9}, cu_start[3] = {1, 4, 9}, cu_end[3] = {0, 4, 8};
    const int64_t cu_dec[4] = {0, 6, 4, 9};

    dg_check_err(dg_short_conv(cpu, x, w9, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_SHAPE,
                 "W must be 1..8", "short_conv W = 9");
    dg_check_err(dg_short_conv(cpu, x, w0, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_SHAPE,
                 "W must be 1..8", "short_conv W = 0");
    dg_check_err(dg_short_conv(cpu, x, wc, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_SHAPE,
                 "'w' must have shape [5,*]", "short_conv w [6,4] for C = 5");
    dg_check_err(dg_short_conv(cpu, x, w1, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_SHAPE,
                 "'w' must have shape [5,*]", "short_conv w 1-d");
    dg_check_err(dg_short_conv(cpu, x, w, b6, DG_ACT_SILU, NULL, 0, &y), DG_ERR_SHAPE,
                 "'bias' must have shape [5]", "short_conv bias [6] for C = 5");
    dg_check_err(dg_short_conv(cpu, x2, w, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_SHAPE,
                 "'x' must have shape [*,*,*]", "short_conv 2-d x");
    dg_check_err(dg_short_conv(cpu, x, w32, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_DTYPE,
                 "'w' must have dtype f64", "short_conv f32 w with f64 x");
    dg_check_err(dg_short_conv(cpu, xb, w, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_DTYPE,
                 "bf16 is a CUDA dtype", "short_conv bf16 on the CPU");
    dg_check_err(dg_short_conv(cpu, x, w, b, DG_ACT_SIGMOID, NULL, 0, &y), DG_ERR_ARG,
                 "act must be DG_ACT_NONE or DG_ACT_SILU", "short_conv sigmoid act");
    dg_check_err(dg_short_conv(cpu, x, w, b, (dg_act)9, NULL, 0, &y), DG_ERR_ARG, "act",
                 "short_conv unknown act");
    dg_check_err(dg_short_conv(cpu, x, w, b, DG_ACT_SILU, cu_ok, 2, &y), DG_ERR_ARG, "B == 1",
                 "short_conv cu_seqlens with B = 2");
    dg_check_err(dg_short_conv(cpu, x1, w, b, DG_ACT_SILU, cu_start, 2, &y), DG_ERR_ARG,
                 "cu_seqlens[0] must be 0", "short_conv cu_seqlens[0] = 1");
    dg_check_err(dg_short_conv(cpu, x1, w, b, DG_ACT_SILU, cu_end, 2, &y), DG_ERR_ARG,
                 "cu_seqlens[2] must equal T = 9", "short_conv cu_seqlens ends at 8, T = 9");
    dg_check_err(dg_short_conv(cpu, x1, w, b, DG_ACT_SILU, cu_dec, 3, &y), DG_ERR_ARG,
                 "non-decreasing", "short_conv decreasing cu_seqlens");
    dg_check_err(dg_short_conv(cpu, x1, w, b, DG_ACT_SILU, cu_ok, 0, &y), DG_ERR_ARG, "n_seqs",
                 "short_conv cu_seqlens with n_seqs = 0");
    dg_check_err(dg_short_conv(cpu, NULL, w, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_ARG,
                 "'x' is NULL", "short_conv x NULL");
    dg_check_err(dg_short_conv(cpu, x, NULL, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_ARG,
                 "'w' is NULL", "short_conv w NULL");
    dg_check_err(dg_short_conv(cpu, x, w, b, DG_ACT_SILU, NULL, 0, NULL), DG_ERR_ARG,
                 "'out' is NULL", "short_conv out NULL");
    dg_check_err(dg_short_conv(NULL, x, w, b, DG_ACT_SILU, NULL, 0, &y), DG_ERR_ARG,
                 "'ctx' is NULL", "short_conv ctx NULL");
    dg_check(y == NULL, "failed calls leave the output NULL");
    /* a valid varlen call with an empty sequence in the middle works */
    const int64_t cu_empty[4] = {0, 4, 4, 9};
    dg_check_ok(dg_short_conv(cpu, x1, w, b, DG_ACT_SILU, cu_empty, 3, &y),
                "short_conv varlen with an empty sequence");
    dg_tensor_free(&y);
    dg_tensor *all[] = {x, x1, x2, w, w9, w0, wc, w1, w32, b, b6, xb};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

// ---- gpu

/* Even C, but x starts one element past an allocation (a view of a flat buffer): the kernels
 * must fall back from paired loads to scalar ones. */
static void test_gpu_unaligned(dg_ctx *cpu, dg_ctx *gpu) {
    const int64_t B = 2, T = 70, C = 66, n = B * T * C, n1 = n + 1;
    for (int dti = 0; dti < 2; dti++) {
        dg_dtype dt = dti ? DG_BF16 : DG_F32;
        sc_set h = make_set(cpu, B, T, C, 4, 1, 5150 + dti);
        sc_set d = conv_set(gpu, &h, dt);
        sc_set r = conv_set(cpu, &d, DG_F64);
        double *xv, *flat = calloc((size_t)n1, sizeof(double));
        DG_TEST_TRY(dg_tensor_to_f64(r.x, &xv));
        memcpy(flat + 1, xv, (size_t)n * sizeof(double));
        dg_tensor *fd = NULL, *sl = NULL, *xd = NULL, *yd = NULL, *yr = NULL;
        DG_TEST_TRY(dg_tensor_from_f64(gpu, dt, 1, &n1, flat, &fd));
        dg_tensor_set_requires_grad(fd, 1);
        DG_TEST_TRY(dg_slice(fd, 0, 1, n1, &sl));
        DG_TEST_TRY(dg_reshape(sl, 3, (int64_t[]){B, T, C}, &xd));
        dg_tensor_set_requires_grad(d.w, 1);
        dg_tensor_set_requires_grad(d.b, 1);
        DG_TEST_TRY(dg_short_conv(gpu, xd, d.w, d.b, DG_ACT_SILU, NULL, 0, &yd));
        DG_TEST_TRY(dg_tape_backward_with(gpu, yd, d.dy));
        dg_tape_reset();
        sc_cfg c = {DG_ACT_SILU, NULL, 0, 0};
        run_set(cpu, &c, &r, &yr);
        char name[128];
        double tol = dt == DG_F32 ? 1e-5 : 1e-2;
        snprintf(name, sizeof name, "short_conv cuda %s x off by one element: y",
                 dg_dtype_name(dt));
        dg_check_tensor_rel(name, yd, yr, tol);
        double *gx, *gref;
        DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(fd), &gx));
        DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(r.x), &gref));
        snprintf(name, sizeof name, "short_conv cuda %s x off by one element: dx",
                 dg_dtype_name(dt));
        dg_check_rel(name, gx + 1, gref, n, tol);
        snprintf(name, sizeof name, "short_conv cuda %s x off by one element: dw",
                 dg_dtype_name(dt));
        dg_check_tensor_rel(name, dg_tensor_grad(d.w), dg_tensor_grad(r.w), tol);
        snprintf(name, sizeof name, "short_conv cuda %s x off by one element: dbias",
                 dg_dtype_name(dt));
        dg_check_tensor_rel(name, dg_tensor_grad(d.b), dg_tensor_grad(r.b), tol);
        free(gx);
        free(gref);
        free(xv);
        free(flat);
        dg_tensor *all[] = {fd, sl, xd, yd, yr};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
        free_set(&h);
        free_set(&d);
        free_set(&r);
    }
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    static const int64_t cu_small[4] = {0, 5, 12, 15}, cu_big[4] = {0, 333, 334, 1001},
                         cu_empty[4] = {0, 100, 100, 1001};
    /* sequences of 1..3 rows (shorter than W = 8) and boundaries on both sides of the kernels'
     * 64-row tile edges */
    static const int64_t cu_tiny[10] = {0, 1, 3, 6, 63, 64, 66, 127, 129, 200};
    struct {
        int64_t B, T, C, W;
        dg_act act;
        int bias;
        const int64_t *cu;
        int n_seqs;
    } cases[] = {
        {3, 37, 70, 4, DG_ACT_SILU, 1, NULL, 0},
        {2, 50, 33, 1, DG_ACT_NONE, 0, NULL, 0},
        {1, 1000, 129, 8, DG_ACT_SILU, 1, NULL, 0},
        {1, 15, 6, 4, DG_ACT_SILU, 1, cu_small, 3},
        {1, 1001, 65, 4, DG_ACT_SILU, 1, cu_big, 3},
        {1, 1001, 31, 3, DG_ACT_NONE, 1, cu_empty, 3},
        {4, 300, 257, 2, DG_ACT_SILU, 1, NULL, 0},
        /* T < W, fewer rows than one tile, exactly one channel tile */
        {5, 3, 64, 8, DG_ACT_SILU, 1, NULL, 0},
        /* W = 8 over tiny sequences and tile edges; even C (paired loads) and odd C */
        {1, 200, 130, 8, DG_ACT_SILU, 1, cu_tiny, 9},
        {1, 200, 67, 8, DG_ACT_NONE, 0, cu_tiny, 9},
        /* batch sequences straddling tiles, odd C, W = 8 */
        {7, 45, 99, 8, DG_ACT_SILU, 1, NULL, 0},
        /* enough rows that a block of the backward walks several tiles; the last tile partial */
        {4, 9999, 40, 4, DG_ACT_SILU, 1, NULL, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        for (int dti = 0; dti < 2; dti++) {
            dg_dtype dt = dti ? DG_BF16 : DG_F32;
            sc_set h = make_set(cpu, cases[k].B, cases[k].T, cases[k].C, cases[k].W, cases[k].bias,
                                2000 + k);
            sc_set d = conv_set(gpu, &h, dt);
            sc_set r = conv_set(cpu, &d, DG_F64); /* the device's rounded values */
            sc_cfg c = {cases[k].act, cases[k].cu, cases[k].n_seqs, 0};
            dg_tensor *yd = NULL, *yr = NULL;
            run_set(gpu, &c, &d, &yd);
            run_set(cpu, &c, &r, &yr);
            char label[128];
            snprintf(label, sizeof label, "short_conv cuda %s vs cpu B%lld T%lld C%lld W%lld%s",
                     dg_dtype_name(dt), (long long)cases[k].B, (long long)cases[k].T,
                     (long long)cases[k].C, (long long)cases[k].W, c.cu ? " varlen" : "");
            /* f32: dw/dbias sum up to 40000 rows in f32; bf16: outputs rounded to 8 bits */
            compare_sets(label, &d, yd, &r, yr, dt == DG_F32 ? 1e-5 : 1e-2);
            dg_tensor_free(&yd);
            dg_tensor_free(&yr);
            free_set(&h);
            free_set(&d);
            free_set(&r);
        }
    }

    /* bitwise determinism of the reductions */
    {
        sc_set h = make_set(cpu, 2, 2000, 96, 4, 1, 4242);
        sc_set a = conv_set(gpu, &h, DG_F32), b = conv_set(gpu, &h, DG_F32);
        sc_cfg c = {DG_ACT_SILU, NULL, 0, 0};
        dg_tensor *ya = NULL, *yb = NULL;
        run_set(gpu, &c, &a, &ya);
        run_set(gpu, &c, &b, &yb);
        compare_sets("short_conv cuda run twice (bitwise)", &b, yb, &a, ya, 0);
        dg_tensor_free(&ya);
        dg_tensor_free(&yb);
        free_set(&h);
        free_set(&a);
        free_set(&b);
    }

    test_isolation(cpu, gpu, DG_F32);
    test_isolation(cpu, gpu, DG_BF16);
    test_cu_copied(cpu, gpu, DG_F32);
    test_gpu_unaligned(cpu, gpu);

    /* strided x on the device */
    {
        int64_t xs[3] = {2, 19, 41}, ws[2] = {19, 4};
        dg_tensor *xh = dg_test_randn(cpu, DG_F64, 3, xs, 91);
        dg_tensor *wh = dg_test_randn(cpu, DG_F64, 2, ws, 92);
        dg_tensor *xd = conv(gpu, xh, DG_F32), *wd = conv(gpu, wh, DG_F32);
        dg_tensor *xdt = NULL, *xht = NULL, *yd = NULL, *yh = NULL;
        DG_TEST_TRY(dg_transpose(xd, 1, 2, &xdt));
        DG_TEST_TRY(dg_transpose(xh, 1, 2, &xht));
        DG_TEST_TRY(dg_short_conv(gpu, xdt, wd, NULL, DG_ACT_SILU, NULL, 0, &yd));
        DG_TEST_TRY(dg_short_conv(cpu, xht, wh, NULL, DG_ACT_SILU, NULL, 0, &yh));
        dg_check_tensor_rel("short_conv cuda f32 strided x vs cpu", yd, yh, 1e-5);
        dg_tensor *all[] = {xh, wh, xd, wd, xdt, xht, yd, yh};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }

    /* device and dtype errors */
    {
        int64_t xs[3] = {1, 9, 5}, ws[2] = {5, 4}, C = 5;
        dg_tensor *xh = dg_test_randn(cpu, DG_F32, 3, xs, 1);
        dg_tensor *wh = dg_test_randn(cpu, DG_F32, 2, ws, 2);
        dg_tensor *bh = dg_test_randn(cpu, DG_F32, 1, &C, 3);
        dg_tensor *xd = conv(gpu, xh, DG_F32), *wd = conv(gpu, wh, DG_F32);
        dg_tensor *xd64 = conv(gpu, xh, DG_F64), *wd64 = conv(gpu, wh, DG_F64), *y = NULL;
        dg_check_err(dg_short_conv(gpu, xd, wh, NULL, DG_ACT_SILU, NULL, 0, &y), DG_ERR_DEVICE,
                     "'w' must be on cuda", "short_conv cuda x with cpu w");
        dg_check_err(dg_short_conv(gpu, xd, wd, bh, DG_ACT_SILU, NULL, 0, &y), DG_ERR_DEVICE,
                     "'bias' must be on cuda", "short_conv cuda x with cpu bias");
        dg_check_err(dg_short_conv(cpu, xd, wd, NULL, DG_ACT_SILU, NULL, 0, &y), DG_ERR_DEVICE,
                     "'x' must be on cpu", "short_conv cuda x in a cpu context");
        dg_check_err(dg_short_conv(gpu, xd64, wd64, NULL, DG_ACT_SILU, NULL, 0, &y), DG_ERR_DTYPE,
                     "CUDA kernels run f32 or bf16", "short_conv f64 on cuda");
        dg_tensor *all[] = {xh, wh, bh, xd, wd, xd64, wd64};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_isolation(cpu, cpu, DG_F64);
    test_isolation(cpu, cpu, DG_F32);
    test_varlen_equivalence(cpu);
    test_cu_copied(cpu, cpu, DG_F64);
    test_f32_vs_f64(cpu);
    test_errors(cpu);
}

int main(int argc, char **argv) {
    return dg_test_main(argc, argv, "short_conv", cpu_cases, test_gpu);
}

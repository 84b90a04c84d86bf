/*
 * tests/test_elementwise.c -- dg_add, dg_sub, dg_mul (NumPy broadcasting) and dg_scale.
 *
 * cpu: f64 gradcheck over broadcasting patterns that need 0 to 3 summation passes in backward,
 *      strided inputs and x*x; values against hand-computed broadcasts; what a node saves; f32 vs
 *      f64; error messages for bad arguments.
 * gpu: CUDA (f32, bf16) vs a CPU f64 reference computed from the same input values, forward and
 *      backward, on odd sizes that exercise every path of the summation kernels; device and dtype
 *      errors; repeatability.
 */
#include "tensor/tensor.h"
#include "tests/harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef dg_status (*binop)(dg_ctx *, dg_tensor *, dg_tensor *, dg_tensor **);

static const struct {
    const char *name;
    binop f;
} k_ops[3] = {{"add", dg_add}, {"sub", dg_sub}, {"mul", dg_mul}};

typedef struct {
    int na, nb;
    int64_t a[5], b[5];
} shape_pair;

/* Broadcasting patterns: same shape, trailing/leading broadcast on either side, both sides
 * broadcast, and 5-d cases whose gradients need two and three summation passes. */
static const shape_pair k_pairs[] = {
    {2, 2, {5, 7}, {5, 7}},
    {3, 2, {2, 3, 4}, {3, 1}},
    {1, 3, {4}, {2, 1, 4}},
    {3, 3, {1, 3, 1}, {2, 1, 5}},
    {4, 3, {2, 3, 4, 5}, {3, 1, 5}},
    {5, 5, {2, 1, 3, 1, 2}, {1, 4, 1, 5, 1}},
    {1, 1, {3}, {1}},
    {2, 1, {1, 1}, {6}},
};
#define NPAIRS ((int)(sizeof k_pairs / sizeof *k_pairs))

static const char *shape_str(int nd, const int64_t *s) {
    static char buf[4][64];
    static int next;
    char *b = buf[next++ & 3];
    int k = snprintf(b, 64, "[");
    for (int i = 0; i < nd; i++)
        k += snprintf(b + k, (size_t)(64 - k), "%s%lld", i ? "," : "", (long long)s[i]);
    snprintf(b + k, (size_t)(64 - k), "]");
    return b;
}

/* ---- gradcheck ---- */

static dg_status binop_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                          void *user) {
    (void)n_in;
    (void)n_out;
    return k_ops[*(const int *)user].f(ctx, in[0], in[1], &out[0]); /* user: index into k_ops */
}

static dg_status scale_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                          void *user) {
    (void)n_in;
    (void)n_out;
    (void)user;
    return dg_scale(ctx, in[0], -2.5, &out[0]);
}

/* y = transpose(a) * b: a strided input read in place. a [4,3] -> [3,4]; b [4] */
static dg_status strided_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                            void *user) {
    (void)n_in;
    (void)n_out;
    (void)user;
    dg_tensor *t = NULL, *u = NULL;
    dg_status s = dg_transpose(in[0], 0, 1, &t);
    if (s == DG_OK)
        s = dg_mul(ctx, t, in[1], &u);
    if (s == DG_OK)
        s = dg_sub(ctx, u, t, &out[0]); /* t used twice: its gradient accumulates */
    dg_tensor_free(&t);
    dg_tensor_free(&u);
    return s;
}

/* y = x * x + x */
static dg_status square_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                           void *user) {
    (void)n_in;
    (void)n_out;
    (void)user;
    dg_tensor *sq = NULL;
    dg_status s = dg_mul(ctx, in[0], in[0], &sq);
    if (s == DG_OK)
        s = dg_add(ctx, sq, in[0], &out[0]);
    dg_tensor_free(&sq);
    return s;
}

static void test_gradcheck(dg_ctx *cpu) {
    for (int k = 0; k < 3; k++)
        for (int p = 0; p < NPAIRS; p++) {
            dg_tensor *in[2];
            in[0] = dg_test_rand(cpu, DG_F64, k_pairs[p].na, k_pairs[p].a, 100 + p, -2, 2);
            in[1] = dg_test_rand(cpu, DG_F64, k_pairs[p].nb, k_pairs[p].b, 200 + p, 0.5, 2);
            dg_tensor_set_requires_grad(in[0], 1);
            dg_tensor_set_requires_grad(in[1], 1);
            dg_gradcheck_report rep;
            dg_status s = dg_gradcheck(cpu, binop_fn, &k, in, 2, 1, 1e-6, 7, &rep);
            /* central differences in f64 with eps 1e-6: truncation O(eps^2) and rounding
             * O(1e-16/eps) keep the error far below 1e-6 for these smooth maps */
            dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck %s %s %s: rel err %.2e",
                     k_ops[k].name, shape_str(k_pairs[p].na, k_pairs[p].a),
                     shape_str(k_pairs[p].nb, k_pairs[p].b), rep.max_rel_err);
            dg_tensor_free(&in[0]);
            dg_tensor_free(&in[1]);
        }

    /* only one input requiring grad: the other gets none, the node saves less */
    int64_t sa[2] = {3, 4}, sb[1] = {4};
    dg_tensor *in[2] = {dg_test_rand(cpu, DG_F64, 2, sa, 1, -1, 1),
                        dg_test_rand(cpu, DG_F64, 1, sb, 2, -1, 1)};
    dg_tensor_set_requires_grad(in[1], 1);
    dg_gradcheck_report rep;
    int mul = 2;
    dg_status s = dg_gradcheck(cpu, binop_fn, &mul, in, 2, 1, 1e-6, 3, &rep);
    dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck mul, only b requires grad: %.2e",
             rep.max_rel_err);
    dg_tensor_free(&in[0]);
    dg_tensor_free(&in[1]);

    int64_t st[2] = {4, 3};
    in[0] = dg_test_rand(cpu, DG_F64, 2, st, 11, -2, 2);
    in[1] = dg_test_rand(cpu, DG_F64, 1, sb, 12, -2, 2);
    dg_tensor_set_requires_grad(in[0], 1);
    dg_tensor_set_requires_grad(in[1], 1);
    s = dg_gradcheck(cpu, strided_fn, NULL, in, 2, 1, 1e-6, 5, &rep);
    dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck transpose(a)*b - transpose(a): %.2e",
             rep.max_rel_err);
    s = dg_gradcheck(cpu, square_fn, NULL, in, 1, 1, 1e-6, 5, &rep);
    dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck x*x + x (same tensor twice): %.2e",
             rep.max_rel_err);
    s = dg_gradcheck(cpu, scale_fn, NULL, in, 1, 1, 1e-6, 5, &rep);
    dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck scale by -2.5: %.2e",
             rep.max_rel_err);
    dg_tensor_free(&in[0]);
    dg_tensor_free(&in[1]);
}

/* ---- values ---- */

static void test_values(dg_ctx *cpu) {
    /* a [2,1,3] (op) b [4,1] -> y [2,4,3], y[i,j,k] = a[i,0,k] (op) b[j,0] */
    int64_t sa[3] = {2, 1, 3}, sb[2] = {4, 1};
    dg_tensor *a = dg_test_rand(cpu, DG_F64, 3, sa, 1, -3, 3);
    dg_tensor *b = dg_test_rand(cpu, DG_F64, 2, sb, 2, -3, 3);
    double *av, *bv;
    DG_TEST_TRY(dg_tensor_to_f64(a, &av));
    DG_TEST_TRY(dg_tensor_to_f64(b, &bv));
    for (int k = 0; k < 3; k++) {
        dg_tensor *y = NULL;
        DG_TEST_TRY(k_ops[k].f(cpu, a, b, &y));
        double *yv, want[24];
        DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < 3; c++) {
                    double x = av[i * 3 + c], z = bv[j];
                    want[(i * 4 + j) * 3 + c] = k == 0 ? x + z : k == 1 ? x - z : x * z;
                }
        const int64_t *ys = dg_tensor_shape(y);
        dg_check(dg_tensor_ndim(y) == 3 && ys[0] == 2 && ys[1] == 4 && ys[2] == 3,
                 "%s: [2,1,3] with [4,1] gives %s", k_ops[k].name, dg_tensor_desc(y));
        char name[64];
        snprintf(name, sizeof name, "%s broadcast values (exact in f64)", k_ops[k].name);
        dg_check_close(name, yv, want, 24, 0, 0);
        free(yv);
        dg_tensor_free(&y);
    }

    /* scale; and a zero-size broadcast gives an empty output and zero gradients */
    dg_tensor *y = NULL;
    DG_TEST_TRY(dg_scale(cpu, a, 0.5, &y));
    double *yv, want[6];
    DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
    for (int i = 0; i < 6; i++)
        want[i] = 0.5 * av[i];
    dg_check_close("scale by 0.5 (exact)", yv, want, 6, 0, 0);
    free(yv);
    dg_tensor_free(&y);

    int64_t se[2] = {0, 3}, s3[1] = {3};
    dg_tensor *e = NULL, *w = dg_test_rand(cpu, DG_F64, 1, s3, 3, 1, 2);
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 2, se, &e));
    dg_tensor_set_requires_grad(w, 1);
    DG_TEST_TRY(dg_mul(cpu, e, w, &y));
    dg_check(dg_tensor_numel(y) == 0 && dg_tensor_shape(y)[1] == 3, "empty broadcast: %s",
             dg_tensor_desc(y));
    dg_tensor *gy = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 2, se, &gy));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y, gy));
    double *gw;
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(w), &gw));
    dg_check(gw[0] == 0 && gw[1] == 0 && gw[2] == 0, "gradient through an empty broadcast is 0");
    free(gw);
    dg_tape_reset();
    dg_tensor_free(&gy);
    dg_tensor_free(&y);
    dg_tensor_free(&e);
    dg_tensor_free(&w);
    free(av);
    free(bv);
    dg_tensor_free(&a);
    dg_tensor_free(&b);
}

/* ---- what the tape keeps ---- */

static void test_tape(dg_ctx *cpu) {
    int64_t sx[2] = {8, 16}, sw[1] = {16};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, sx, 1), *w = dg_test_randn(cpu, DG_F64, 1, sw, 2);
    dg_tensor *y = NULL;
    dg_tape_reset();
    dg_tensor_set_requires_grad(w, 1);
    DG_TEST_TRY(dg_add(cpu, x, w, &y));
    dg_check(dg_tape_num_nodes() == 1 && dg_tape_bytes() == 0,
             "add records one node and saves nothing (%zu bytes)", dg_tape_bytes());
    dg_tensor_free(&y);
    dg_tape_reset();
    DG_TEST_TRY(dg_mul(cpu, x, w, &y));
    dg_check(dg_tape_bytes() == dg_tensor_nbytes(x),
             "mul with only w requiring grad saves only x (%zu bytes, x is %zu)", dg_tape_bytes(),
             dg_tensor_nbytes(x));
    dg_tensor_free(&y);
    dg_tape_reset();
    dg_tensor_set_requires_grad(w, 0);
    DG_TEST_TRY(dg_mul(cpu, x, w, &y));
    dg_check(dg_tape_num_nodes() == 0 && !dg_tensor_requires_grad(y),
             "no input requires grad: nothing recorded");
    dg_tensor_free(&y);
    dg_tensor_free(&x);
    dg_tensor_free(&w);
}

/* x rounded to bf16 (the library's host conversion, round to nearest even). */
static double rne_bf16(double x) { return dg__bf16_to_f32(dg__f32_to_bf16((float)x)); }

/* A bf16 leaf read by three casts: the backward sums the three f32 contributions in f32 and rounds
 * to bf16 once at its end (rounding after each contribution would differ: checked below); a
 * second backward adds to the bf16 gradient that now exists, rounding per contribution. */
static void test_bf16_leaf(dg_ctx *cpu) {
    enum { N = 64 };
    const int64_t s[1] = {N};
    double xv[N], g[3][N], want[N], want2[N];
    int differs = 0;
    for (int i = 0; i < N; i++) {
        xv[i] = 1.0 + i / 64.0;
        for (int c = 0; c < 3; c++) /* bf16 values in [1, 2): 8-bit mantissas, sums exact in f32 */
            g[c][i] = 1.0 + (double)((i * 37 + c * 53 + 11) % 128) / 128.0;
        want[i] = rne_bf16(g[0][i] + g[1][i] + g[2][i]);
        const int ord[3][3] = {{0, 1, 2}, {1, 2, 0}, {2, 0, 1}};
        for (int o = 0; o < 3;
             o++) /* every order the three could be added in, rounding each time */
            differs +=
                rne_bf16(rne_bf16(g[ord[o][0]][i] + g[ord[o][1]][i]) + g[ord[o][2]][i]) != want[i];
    }
    dg_check(differs > 0, "the bf16-leaf case separates one rounding from per-contribution ones");
    dg_tensor *x = NULL, *y[3] = {0}, *gt[3] = {0};
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_BF16, 1, s, xv, &x));
    for (int c = 0; c < 3; c++)
        DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F32, 1, s, g[c], &gt[c]));
    dg_tape_reset();
    dg_tensor_set_requires_grad(x, 1);
    for (int round = 0; round < 2; round++) {
        for (int c = 0; c < 3; c++)
            DG_TEST_TRY(dg_to_dtype(cpu, x, DG_F32, &y[c]));
        DG_TEST_TRY(dg_tape_backward_multi(cpu, 3, y, (const dg_tensor *const *)gt));
        const dg_tensor *gx = dg_tensor_grad(x);
        double *got = NULL;
        dg_check(gx && dg_tensor_dtype(gx) == DG_BF16, "round %d: the leaf's gradient is bf16",
                 round);
        if (!gx || !dg_check_ok(dg_tensor_to_f64(gx, &got), "reading the leaf's gradient"))
            break;
        if (round == 0) {
            dg_check_close("bf16 leaf, one rounding", got, want, N, 0.0, 0.0);
        } else {
            int bad = 0;
            for (int i = 0; i < N; i++) { /* within 3 roundings of the exact sum: 3 x 2^-8 rel */
                want2[i] = want[i] + g[0][i] + g[1][i] + g[2][i];
                bad += fabs(got[i] - want2[i]) > 3.0 * fabs(want2[i]) / 256.0;
            }
            dg_check(bad == 0, "a second backward adds to the bf16 gradient (%d off)", bad);
        }
        free(got);
        for (int c = 0; c < 3; c++)
            dg_tensor_free(&y[c]);
        dg_tape_reset();
    }
    for (int c = 0; c < 3; c++)
        dg_tensor_free(&gt[c]);
    dg_tensor_free(&x);
}

/* Seeding an intermediate that a later op reads: backward adds the later op's gradient to the
 * seed's slot, never to the caller's seed tensor (which it held only one reference to). */
static void test_seed_untouched(dg_ctx *cpu) {
    enum { N = 8 };
    const int64_t s[1] = {N};
    double ones[N], twos[N];
    for (int i = 0; i < N; i++) {
        ones[i] = 1.0;
        twos[i] = 2.0;
    }
    dg_tensor *x = NULL, *h = NULL, *o = NULL, *gh = NULL, *go = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 1, s, ones, &x));
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 1, s, ones, &gh));
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 1, s, twos, &go));
    dg_tape_reset();
    dg_tensor_set_requires_grad(x, 1);
    DG_TEST_TRY(dg_scale(cpu, x, 2.0, &h));
    DG_TEST_TRY(dg_scale(cpu, h, 3.0, &o));
    dg_tensor *outs[2] = {h, o};
    const dg_tensor *gs[2] = {gh, go};
    DG_TEST_TRY(dg_tape_backward_multi(cpu, 2, outs, gs));
    double *ghv = NULL, *gxv = NULL, want[N];
    DG_TEST_TRY(dg_tensor_to_f64(gh, &ghv));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &gxv));
    for (int i = 0; i < N; i++)
        want[i] = 2.0 * (1.0 + 3.0 * 2.0); /* dx = 2 (gh + 3 go) */
    dg_check_close("seed gradient left as the caller gave it", ghv, ones, N, 0.0, 0.0);
    dg_check_close("dx with both seeds", gxv, want, N, 0.0, 0.0);
    free(ghv);
    free(gxv);
    /* one tensor seeding the same output twice: both seeds count, the seed stays as it was */
    dg_tensor_zero_grad(x);
    dg_tensor *twice[2] = {o, o};
    const dg_tensor *gg[2] = {go, go};
    DG_TEST_TRY(dg_tape_backward_multi(cpu, 2, twice, gg));
    DG_TEST_TRY(dg_tensor_to_f64(go, &ghv));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &gxv));
    for (int i = 0; i < N; i++)
        want[i] = 2.0 * 3.0 * (2.0 + 2.0);
    dg_check_close("a seed given twice left as the caller gave it", ghv, twos, N, 0.0, 0.0);
    dg_check_close("dx with the seed counted twice", gxv, want, N, 0.0, 0.0);
    free(ghv);
    free(gxv);
    dg_tape_reset();
    dg_tensor_free(&o);
    dg_tensor_free(&h);
    dg_tensor_free(&gh);
    dg_tensor_free(&go);
    dg_tensor_free(&x);
}

/* ---- f32 vs f64 ---- */

/* Forward + backward with gradient seed gy; copies y, ga, gb to host doubles. */
static void run_fb(dg_ctx *ctx, binop f, dg_tensor *a, dg_tensor *b, dg_tensor *gy, double **y,
                   double **ga, double **gb) {
    dg_tensor *out = NULL;
    dg_tape_reset();
    dg_tensor_zero_grad(a);
    dg_tensor_zero_grad(b);
    DG_TEST_TRY(f(ctx, a, b, &out));
    DG_TEST_TRY(dg_tape_backward_with(ctx, out, gy));
    DG_TEST_TRY(dg_tensor_to_f64(out, y));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(a), ga));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(b), gb));
    dg_tape_reset();
    dg_tensor_free(&out);
}

static dg_tensor *copy_as(dg_ctx *ctx, dg_dtype dt, const dg_tensor *t) {
    dg_tensor *c = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, dt, dg_tensor_ndim(t), dg_tensor_shape(t), &c));
    DG_TEST_TRY(dg_tensor_copy_(c, t));
    return c;
}

static void test_f32(dg_ctx *cpu) {
    int64_t sa[3] = {3, 37, 129}, sb[2] = {37, 1};
    for (int k = 0; k < 3; k++) {
        dg_tensor *a64 = dg_test_randn(cpu, DG_F64, 3, sa, 5),
                  *b64 = dg_test_randn(cpu, DG_F64, 2, sb, 6);
        dg_tensor *gy64 = dg_test_randn(cpu, DG_F64, 3, sa, 7);
        dg_tensor *a32 = copy_as(cpu, DG_F32, a64), *b32 = copy_as(cpu, DG_F32, b64);
        dg_tensor *gy32 = copy_as(cpu, DG_F32, gy64);
        /* the f64 run starts from the f32-rounded values so only the arithmetic differs */
        dg_tensor_free(&a64);
        dg_tensor_free(&b64);
        dg_tensor_free(&gy64);
        a64 = copy_as(cpu, DG_F64, a32);
        b64 = copy_as(cpu, DG_F64, b32);
        gy64 = copy_as(cpu, DG_F64, gy32);
        dg_tensor *all[] = {a64, b64, a32, b32};
        for (int i = 0; i < 4; i++)
            dg_tensor_set_requires_grad(all[i], 1);
        double *y[2], *ga[2], *gb[2];
        run_fb(cpu, k_ops[k].f, a64, b64, gy64, &y[0], &ga[0], &gb[0]);
        run_fb(cpu, k_ops[k].f, a32, b32, gy32, &y[1], &ga[1], &gb[1]);
        char name[80];
        /* one f32 rounding per element: 2^-24 relative */
        snprintf(name, sizeof name, "f32 vs f64 %s y", k_ops[k].name);
        dg_check_close(name, y[1], y[0], dg_tensor_numel(a32), 1e-7, 1e-6);
        snprintf(name, sizeof name, "f32 vs f64 %s da", k_ops[k].name);
        dg_check_close(name, ga[1], ga[0], dg_tensor_numel(a32), 1e-7, 1e-6);
        /* db sums 3*129 products: error ~ (block + n/block) * 2^-24 of the norm */
        snprintf(name, sizeof name, "f32 vs f64 %s db (sum over 387)", k_ops[k].name);
        dg_check_rel(name, gb[1], gb[0], dg_tensor_numel(b32), 1e-5);
        for (int i = 0; i < 2; i++) {
            free(y[i]);
            free(ga[i]);
            free(gb[i]);
        }
        for (int i = 0; i < 4; i++)
            dg_tensor_free(&all[i]);
        dg_tensor_free(&gy64);
        dg_tensor_free(&gy32);
    }
}

/* ---- errors ---- */

static void test_errors(dg_ctx *cpu) {
    int64_t s23[2] = {2, 3}, s4[1] = {4};
    dg_tensor *a = dg_test_rand(cpu, DG_F64, 2, s23, 1, 0, 1);
    dg_tensor *b = dg_test_rand(cpu, DG_F64, 1, s4, 2, 0, 1);
    dg_tensor *c = dg_test_rand(cpu, DG_F32, 2, s23, 3, 0, 1);
    dg_tensor *h = NULL, *ii = NULL, *y = (dg_tensor *)1;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_BF16, 2, s23, &h));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I32, 2, s23, &ii));

    dg_check_err(dg_add(cpu, a, b, &y), DG_ERR_SHAPE, "do not broadcast: dim 1", "[2,3] + [4]");
    dg_check(y == NULL, "failed call leaves out NULL");
    dg_check_err(dg_mul(cpu, a, c, &y), DG_ERR_DTYPE, "'b' must have dtype f64",
                 "f64 * f32 is a dtype error");
    dg_check_err(dg_sub(cpu, NULL, a, &y), DG_ERR_ARG, "dg_sub: argument 'a' is NULL", "NULL a");
    dg_check_err(dg_add(cpu, a, NULL, &y), DG_ERR_ARG, "argument 'b' is NULL", "NULL b");
    dg_check_err(dg_add(cpu, a, a, NULL), DG_ERR_ARG, "argument 'out' is NULL", "NULL out");
    dg_check_err(dg_add(NULL, a, a, &y), DG_ERR_ARG, "argument 'ctx' is NULL", "NULL ctx");
    dg_check_err(dg_mul(cpu, h, h, &y), DG_ERR_DTYPE, "only the CUDA kernels", "bf16 on the CPU");
    dg_check_err(dg_add(cpu, ii, ii, &y), DG_ERR_DTYPE, "must have dtype f64/f32/bf16",
                 "i32 inputs");
    dg_check_err(dg_scale(cpu, ii, 2.0, &y), DG_ERR_DTYPE, "dg_scale: 'a' must have dtype",
                 "scale of i32");
    dg_check_err(dg_scale(cpu, NULL, 2.0, &y), DG_ERR_ARG, "'a' is NULL", "scale of NULL");
    int64_t s6[6] = {1, 1, 1, 1, 1, 1};
    dg_check_err(dg_tensor_new(cpu, DG_F64, 6, s6, &y), DG_ERR_SHAPE, "ndim",
                 "more than DG_MAX_DIMS dims cannot even be made");
    dg_tensor *all[] = {a, b, c, h, ii};
    for (int i = 0; i < 5; i++)
        dg_tensor_free(&all[i]);
}

/* ---- gpu ---- */

/* f32: normal values. bf16: uniform in [0.5, 1.5). The bf16 backward of mul rounds each product
 * dy * b to 8 bits before summing; with random signs a long sum can cancel to far below its usual
 * size, and the norm-relative error would then measure the cancellation, not the kernels. */
static dg_tensor *gpu_rand(dg_ctx *gpu, dg_dtype dt, int nd, const int64_t *s, uint64_t seed) {
    if (dt == DG_BF16)
        return dg_test_rand(gpu, dt, nd, s, seed, 0.5, 1.5);
    return dg_test_randn(gpu, dt, nd, s, seed);
}

/* CUDA (dt) against the CPU in f64 from the very same input values (bf16 inputs converted
 * exactly), forward and both gradients. */
static void gpu_case(dg_ctx *cpu, dg_ctx *gpu, dg_dtype dt, int k, const shape_pair *p) {
    dg_tensor *ag = gpu_rand(gpu, dt, p->na, p->a, 31), *bg = gpu_rand(gpu, dt, p->nb, p->b, 32);
    dg_tensor *ac = copy_as(cpu, DG_F64, ag), *bc = copy_as(cpu, DG_F64, bg);
    dg_tensor_set_requires_grad(ag, 1);
    dg_tensor_set_requires_grad(bg, 1);
    dg_tensor_set_requires_grad(ac, 1);
    dg_tensor_set_requires_grad(bc, 1);
    dg_tensor *probe = NULL;
    dg_no_grad_begin();
    DG_TEST_TRY(k_ops[k].f(cpu, ac, bc, &probe)); /* just y's shape, for the gradient seed */
    dg_no_grad_end();
    dg_tensor *gyg = gpu_rand(gpu, dt, dg_tensor_ndim(probe), dg_tensor_shape(probe), 33);
    dg_tensor *gyc = copy_as(cpu, DG_F64, gyg);
    double *y[2], *ga[2], *gb[2];
    run_fb(gpu, k_ops[k].f, ag, bg, gyg, &y[0], &ga[0], &gb[0]);
    run_fb(cpu, k_ops[k].f, ac, bc, gyc, &y[1], &ga[1], &gb[1]);
    /* f32: a handful of roundings and f32 sums; bf16: outputs stored with 8 bits (2^-9) */
    double tol = dt == DG_F32 ? 1e-5 : 1e-2;
    char name[120];
    snprintf(name, sizeof name, "cuda %s %s %s %s: y", dg_dtype_name(dt), k_ops[k].name,
             shape_str(p->na, p->a), shape_str(p->nb, p->b));
    dg_check_rel(name, y[0], y[1], dg_tensor_numel(probe), tol);
    snprintf(name, sizeof name, "cuda %s %s: da %s", dg_dtype_name(dt), k_ops[k].name,
             shape_str(p->na, p->a));
    dg_check_rel(name, ga[0], ga[1], dg_tensor_numel(ac), tol);
    snprintf(name, sizeof name, "cuda %s %s: db %s", dg_dtype_name(dt), k_ops[k].name,
             shape_str(p->nb, p->b));
    dg_check_rel(name, gb[0], gb[1], dg_tensor_numel(bc), tol);
    for (int i = 0; i < 2; i++) {
        free(y[i]);
        free(ga[i]);
        free(gb[i]);
    }
    dg_tensor *all[] = {ag, bg, ac, bc, probe, gyg, gyc};
    for (int i = 0; i < 7; i++)
        dg_tensor_free(&all[i]);
}

/* Shapes not multiples of any block size; the big ones send the gradient sums down the two-pass
 * paths (few long rows, few wide columns) of kernels/reduce.cu. */
static const shape_pair k_gpu_pairs[] = {
    {3, 1, {3, 37, 129}, {129}},
    {3, 2, {3, 37, 129}, {37, 1}},
    {2, 2, {1001, 7}, {1001, 7}},
    {4, 3, {2, 3, 4, 5}, {3, 1, 5}},
    {5, 5, {2, 1, 3, 1, 2}, {1, 4, 1, 5, 1}},
    {3, 1, {64, 300, 97}, {97}},
    {3, 3, {64, 300, 97}, {64, 1, 97}},
    {2, 2, {7, 20011}, {7, 1}},
    {1, 1, {100003}, {1}},
};

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    for (int dt = DG_F32; dt <= DG_BF16; dt++)
        for (int k = 0; k < 3; k++)
            for (size_t p = 0; p < sizeof k_gpu_pairs / sizeof *k_gpu_pairs; p++)
                gpu_case(cpu, gpu, (dg_dtype)dt, k, &k_gpu_pairs[p]);

    /* strided input on the device, and scale */
    int64_t st[2] = {129, 33}, sb[1] = {129};
    for (int dt = DG_F32; dt <= DG_BF16; dt++) {
        dg_tensor *xg = dg_test_randn(gpu, (dg_dtype)dt, 2, st, 41);
        dg_tensor *bg = dg_test_randn(gpu, (dg_dtype)dt, 1, sb, 42);
        dg_tensor *xc = copy_as(cpu, DG_F64, xg), *bc = copy_as(cpu, DG_F64, bg);
        dg_tensor *tg = NULL, *tc = NULL, *yg = NULL, *yc = NULL, *zg = NULL, *zc = NULL;
        DG_TEST_TRY(dg_transpose(xg, 0, 1, &tg));
        DG_TEST_TRY(dg_transpose(xc, 0, 1, &tc));
        DG_TEST_TRY(dg_mul(gpu, tg, bg, &yg));
        DG_TEST_TRY(dg_mul(cpu, tc, bc, &yc));
        double tol = dt == DG_F32 ? 1e-5 : 1e-2; /* as above */
        char name[64];
        snprintf(name, sizeof name, "cuda %s transpose([129,33]) * [129]",
                 dg_dtype_name((dg_dtype)dt));
        dg_check_tensor_rel(name, yg, yc, tol);
        DG_TEST_TRY(dg_scale(gpu, tg, -0.37, &zg));
        DG_TEST_TRY(dg_scale(cpu, tc, -0.37, &zc));
        snprintf(name, sizeof name, "cuda %s scale of a strided view", dg_dtype_name((dg_dtype)dt));
        dg_check_tensor_rel(name, zg, zc, tol);
        dg_tensor *all[] = {xg, bg, xc, bc, tg, tc, yg, yc, zg, zc};
        for (int i = 0; i < 10; i++)
            dg_tensor_free(&all[i]);
    }

    /* the gradient sums repeat bit for bit */
    int64_t sa[3] = {64, 300, 97}, s1[1] = {97};
    dg_tensor *a = dg_test_randn(gpu, DG_F32, 3, sa, 1), *b = dg_test_randn(gpu, DG_F32, 1, s1, 2);
    dg_tensor *gy = dg_test_randn(gpu, DG_F32, 3, sa, 3);
    dg_tensor_set_requires_grad(b, 1);
    double *r[2][3];
    for (int i = 0; i < 2; i++) {
        dg_tensor_set_requires_grad(a, 1);
        run_fb(gpu, dg_mul, a, b, gy, &r[i][0], &r[i][1], &r[i][2]);
    }
    dg_check(memcmp(r[0][2], r[1][2], 97 * sizeof(double)) == 0,
             "cuda broadcast gradient is bitwise repeatable");
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            free(r[i][j]);

    /* device and dtype errors */
    int64_t s3[1] = {3};
    dg_tensor *hc = dg_test_rand(cpu, DG_F32, 1, s3, 1, 0, 1), *hg = NULL, *y = NULL;
    dg_tensor *d64 = NULL;
    DG_TEST_TRY(dg_to_device(gpu, hc, &hg));
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F64, 1, s3, &d64));
    dg_check_err(dg_add(gpu, hg, hc, &y), DG_ERR_DEVICE, "'b' must be on cuda:0",
                 "cuda + cpu tensor");
    dg_check_err(dg_mul(cpu, hg, hg, &y), DG_ERR_DEVICE, "'a' must be on cpu",
                 "cuda tensor, cpu ctx");
    dg_check_err(dg_add(gpu, d64, d64, &y), DG_ERR_DTYPE, "f64, which the CUDA kernels do not",
                 "f64 on CUDA");
    dg_tensor *all[] = {a, b, gy, hc, hg, d64};
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&all[i]);
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_tape(cpu);
    test_bf16_leaf(cpu);
    test_seed_untouched(cpu);
    test_f32(cpu);
    test_errors(cpu);
}

int main(int argc, char **argv) {
    return dg_test_main(argc, argv, "elementwise", cpu_cases, test_gpu);
}

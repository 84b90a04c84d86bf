/*
 * tests/test_token_shift.c -- dg_token_shift: y[t] = x[t-1] - x[t] along T, x before a sequence
 * start = 0, with varlen sequences.
 *
 * cpu: f64 gradchecks (batch, varlen with odd lengths and an empty sequence, strided x); values
 *      and gradients against a direct per-sequence loop (bitwise: one subtraction per element);
 *      equal bit for bit to dg_short_conv with taps [1, -1] (the form the CUDA path runs);
 *      sequence isolation; f32 against f64; argument errors.
 * gpu: CUDA f32 and bf16 against the CPU on the same values, y and dx, batch and varlen.
 */
#include "tests/harness.h"

#include <string.h>

typedef struct {
    const int64_t *cu;
    int n_seqs;
    int transpose; /* x is [B, C, T] and is transposed to [B, T, C] before the op */
} ts_cfg;

static dg_status shift_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                          void *user) {
    (void)n_in;
    (void)n_out;
    const ts_cfg *c = user;
    dg_tensor *x = NULL, *xt = NULL;
    dg_status s = dg_test_along_t(in[0], c->transpose, &xt, &x);
    if (s == DG_OK)
        s = dg_token_shift(ctx, x, c->cu, c->n_seqs, &out[0]);
    dg_tensor_free(&xt);
    return s;
}

/* Odd lengths 5, 7, 3 in T = 15; and 4, 0, 5 (an empty sequence) in T = 9. */
static const int64_t g_cu3[4] = {0, 5, 12, 15};
static const int64_t g_cue[4] = {0, 4, 4, 9};

/* The op written out per sequence: y (bwd = 0) or dx from dy (bwd = 1), in double. */
static void ref_shift(int bwd, int64_t B, int64_t T, int64_t C, const int64_t *cu, int n_seqs,
                      const double *x, double *y) {
    int64_t nseg = cu ? n_seqs : B;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t st = cu ? cu[s] : s * T, len = cu ? cu[s + 1] - cu[s] : T;
        for (int64_t t = 0; t < len; t++)
            for (int64_t c = 0; c < C; c++) {
                int64_t nb = bwd ? t + 1 : t - 1; /* the neighbour inside the sequence */
                double v = nb >= 0 && nb < len ? x[(st + nb) * C + c] : 0.0;
                y[(st + t) * C + c] = v - x[(st + t) * C + c];
            }
    }
}

static void test_gradcheck(dg_ctx *cpu) {
    struct {
        int64_t B, T, C;
        const int64_t *cu;
        int n, transpose;
    } cases[] = {
        {2, 9, 5, NULL, 0, 0},  {3, 1, 2, NULL, 0, 0}, {1, 15, 3, g_cu3, 3, 0},
        {1, 9, 2, g_cue, 3, 0}, {2, 8, 4, NULL, 0, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        ts_cfg c = {cases[k].cu, cases[k].n, cases[k].transpose};
        int64_t xs[3] = {cases[k].B, c.transpose ? cases[k].C : cases[k].T,
                         c.transpose ? cases[k].T : cases[k].C};
        dg_tensor *x = dg_test_randn(cpu, DG_F64, 3, xs, 40 + k);
        dg_tensor_set_requires_grad(x, 1);
        dg_gradcheck_report rep;
        char what[128];
        snprintf(what, sizeof what, "gradcheck token_shift B%lld T%lld C%lld%s%s",
                 (long long)cases[k].B, (long long)cases[k].T, (long long)cases[k].C,
                 c.transpose ? " strided" : "",
                 c.cu == g_cu3 ? " varlen 5/7/3"
                 : c.cu        ? " varlen 4/0/5"
                               : "");
        if (dg_check_ok(dg_gradcheck(cpu, shift_fn, &c, &x, 1, 1, 1e-6, 7 + k, &rep), what))
            dg_check(rep.max_rel_err < 1e-6, "%s: rel err %.2e (< 1e-6)", what, rep.rel_err[0]);
        dg_tensor_free(&x);
    }
}

/* y and dx on ctx in dtype dt, from host doubles x, dy ([B,T,C]). */
static void run_shift(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T, int64_t C, const int64_t *cu,
                      int n, const double *x, const double *dy, double **y, double **dx) {
    int64_t xs[3] = {B, T, C};
    dg_tensor *tx = NULL, *tdy = NULL, *ty = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, 3, xs, x, &tx));
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, 3, xs, dy, &tdy));
    dg_tensor_set_requires_grad(tx, 1);
    DG_TEST_TRY(dg_token_shift(ctx, tx, cu, n, &ty));
    DG_TEST_TRY(dg_tape_backward_with(ctx, ty, tdy));
    dg_tape_reset();
    DG_TEST_TRY(dg_tensor_to_f64(ty, y));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(tx), dx));
    dg_tensor_free(&tx);
    dg_tensor_free(&tdy);
    dg_tensor_free(&ty);
}

static double *randn_host(int64_t n, uint64_t seed) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    dg_tensor *t = dg_test_randn(cpu, DG_F64, 1, &n, seed);
    double *v;
    DG_TEST_TRY(dg_tensor_to_f64(t, &v));
    dg_tensor_free(&t);
    dg_ctx_free(&cpu);
    return v;
}

/* Values and gradients against the per-sequence loop, bitwise (f64; f32 inputs are rounded to
 * f32 first, and one f32 subtraction of two f32 values equals the f64 one rounded to f32). */
static void test_values(dg_ctx *cpu) {
    struct {
        int64_t B, T, C;
        const int64_t *cu;
        int n;
    } cases[] = {{3, 10, 6, NULL, 0}, {1, 15, 6, g_cu3, 3}, {1, 9, 4, g_cue, 3}};
    for (int k = 0; k < 3; k++) {
        const int64_t n = cases[k].B * cases[k].T * cases[k].C;
        double *x = randn_host(n, 10 + k), *dy = randn_host(n, 20 + k);
        for (int f = 0; f < 2; f++) {
            const dg_dtype dt = f ? DG_F32 : DG_F64;
            if (f) /* the f32 inputs, exactly */
                for (int64_t i = 0; i < n; i++)
                    x[i] = (float)x[i], dy[i] = (float)dy[i];
            double *y, *dx, *ry = malloc((size_t)n * sizeof(double));
            double *rdx = malloc((size_t)n * sizeof(double));
            run_shift(cpu, dt, cases[k].B, cases[k].T, cases[k].C, cases[k].cu, cases[k].n, x, dy,
                      &y, &dx);
            ref_shift(0, cases[k].B, cases[k].T, cases[k].C, cases[k].cu, cases[k].n, x, ry);
            ref_shift(1, cases[k].B, cases[k].T, cases[k].C, cases[k].cu, cases[k].n, dy, rdx);
            for (int64_t i = 0; f && i < n; i++)
                ry[i] = (float)ry[i], rdx[i] = (float)rdx[i];
            char name[96];
            snprintf(name, sizeof name, "token_shift %s y == per-sequence loop (bitwise%s)",
                     dg_dtype_name(dt), cases[k].cu ? ", varlen" : "");
            dg_check_close(name, y, ry, n, 0, 0);
            snprintf(name, sizeof name, "token_shift %s dx == per-sequence loop (bitwise%s)",
                     dg_dtype_name(dt), cases[k].cu ? ", varlen" : "");
            dg_check_close(name, dx, rdx, n, 0, 0);
            free(y);
            free(dx);
            free(ry);
            free(rdx);
        }
        free(x);
        free(dy);
    }
}

/* dg_short_conv with taps [1, -1] and no bias is the same op: bit for bit on the CPU. */
static void test_as_conv(dg_ctx *cpu) {
    const int64_t T = 15, C = 5;
    int64_t xs[3] = {1, T, C}, ws[2] = {C, 2};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 3, xs, 77),
              *dy = dg_test_randn(cpu, DG_F64, 3, xs, 78);
    double wv[2 * 5];
    for (int c = 0; c < C; c++)
        wv[2 * c] = 1, wv[2 * c + 1] = -1;
    dg_tensor *w = NULL, *y1 = NULL, *y2 = NULL, *g1 = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 2, ws, wv, &w));
    dg_tensor_set_requires_grad(x, 1);
    DG_TEST_TRY(dg_token_shift(cpu, x, g_cu3, 3, &y1));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y1, dy));
    dg_tape_reset();
    DG_TEST_TRY(dg_contiguous(cpu, (dg_tensor *)dg_tensor_grad(x), &g1));
    dg_tensor_zero_grad(x);
    DG_TEST_TRY(dg_short_conv(cpu, x, w, NULL, DG_ACT_NONE, g_cu3, 3, &y2));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y2, dy));
    dg_tape_reset();
    dg_check_tensor_close("token_shift y == short_conv with taps [1, -1] (bitwise)", y1, y2, 0, 0);
    dg_check_tensor_close("token_shift dx == short_conv's dx with taps [1, -1] (bitwise)", g1,
                          dg_tensor_grad(x), 0, 0);
    dg_tensor *all[6] = {x, dy, w, y1, y2, g1};
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&all[i]);
}

/* Changing one sequence's x changes only its y; d sum(y[seq]) / dx is zero outside seq. */
static void test_isolation(dg_ctx *cpu) {
    const int64_t T = 15, C = 3, n = T * C;
    double *x = randn_host(n, 5);
    for (int seq = 0; seq < 3; seq++) {
        double *x2 = malloc((size_t)n * sizeof(double)), *dy = calloc((size_t)n, sizeof(double));
        memcpy(x2, x, (size_t)n * sizeof(double));
        for (int64_t i = g_cu3[seq] * C; i < g_cu3[seq + 1] * C; i++)
            x2[i] += 1.5, dy[i] = 1.0;
        double *ya, *yb, *ga, *gb;
        run_shift(cpu, DG_F64, 1, T, C, g_cu3, 3, x, dy, &ya, &ga);
        run_shift(cpu, DG_F64, 1, T, C, g_cu3, 3, x2, dy, &yb, &gb);
        int same_out = 1, changed_in = 0, zero_out = 1, nonzero_in = 0;
        for (int64_t i = 0; i < n; i++) {
            const int in = i >= g_cu3[seq] * C && i < g_cu3[seq + 1] * C;
            if (in)
                changed_in |= ya[i] != yb[i], nonzero_in |= ga[i] != 0.0;
            else
                same_out &= ya[i] == yb[i], zero_out &= ga[i] == 0.0;
        }
        dg_check(same_out && changed_in && zero_out && nonzero_in,
                 "token_shift: sequence %d of 5/7/3 is isolated in y and in dx", seq);
        free(ya);
        free(yb);
        free(ga);
        free(gb);
        free(x2);
        free(dy);
    }
    free(x);
}

static void test_f32_vs_f64(dg_ctx *cpu) {
    const int64_t B = 2, T = 33, C = 7, n = B * T * C;
    double *x = randn_host(n, 91), *dy = randn_host(n, 92);
    double *y64, *d64, *y32, *d32;
    run_shift(cpu, DG_F64, B, T, C, NULL, 0, x, dy, &y64, &d64);
    run_shift(cpu, DG_F32, B, T, C, NULL, 0, x, dy, &y32, &d32);
    /* inputs and the result each rounded to f32 once: a few units of 2^-24 */
    dg_check_rel("token_shift f32 y vs f64", y32, y64, n, 1e-6);
    dg_check_rel("token_shift f32 dx vs f64", d32, d64, n, 1e-6);
    free(x), free(dy), free(y64), free(d64), free(y32), free(d32);
}

static void test_errors(dg_ctx *cpu) {
    dg_tensor *y = NULL;
    dg_tensor *x2 = dg_test_randn(cpu, DG_F64, 2, (int64_t[]){4, 3}, 1);
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 3, (int64_t[]){2, 5, 3}, 2);
    dg_tensor *x1 = dg_test_randn(cpu, DG_F64, 3, (int64_t[]){1, 5, 3}, 3);
    const int64_t cu_bad0[3] = {1, 3, 5}, cu_dec[3] = {0, 4, 3}, cu_short[3] = {0, 2, 4};
    dg_check_err(dg_token_shift(cpu, x2, NULL, 0, &y), DG_ERR_SHAPE, "'x'", "2-D x");
    dg_check_err(dg_token_shift(cpu, x, g_cu3, 3, &y), DG_ERR_ARG, "B == 1", "cu_seqlens, B = 2");
    dg_check_err(dg_token_shift(cpu, x1, cu_bad0, 2, &y), DG_ERR_ARG, "cu_seqlens[0]",
                 "cu_seqlens[0] != 0");
    dg_check_err(dg_token_shift(cpu, x1, cu_dec, 2, &y), DG_ERR_ARG, "non-decreasing",
                 "decreasing cu_seqlens");
    dg_check_err(dg_token_shift(cpu, x1, cu_short, 2, &y), DG_ERR_ARG, "must equal T",
                 "cu_seqlens not ending at T");
    dg_check_err(dg_token_shift(cpu, x1, cu_short, 0, &y), DG_ERR_ARG, "n_seqs", "n_seqs = 0");
    dg_check_err(dg_token_shift(cpu, NULL, NULL, 0, &y), DG_ERR_ARG, "x", "x NULL");
    dg_check_err(dg_token_shift(cpu, x, NULL, 0, NULL), DG_ERR_ARG, "out", "out NULL");
    dg_tensor_free(&x2);
    dg_tensor_free(&x);
    dg_tensor_free(&x1);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    struct {
        int64_t B, T, C;
        const int64_t *cu;
        int n;
    } cases[] = {{3, 70, 9, NULL, 0}, {1, 15, 6, g_cu3, 3}, {1, 9, 4, g_cue, 3}};
    for (int k = 0; k < 3; k++) {
        const int64_t n = cases[k].B * cases[k].T * cases[k].C;
        double *x = randn_host(n, 30 + k), *dy = randn_host(n, 40 + k);
        for (int f = 0; f < 2; f++) {
            const dg_dtype dt = f ? DG_BF16 : DG_F32;
            double *yc, *dc, *yg, *dg;
            if (f) { /* the CPU reference sees the bf16 values, computed in f32 */
                int64_t s1 = n;
                dg_tensor *a = NULL, *b = NULL;
                DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_BF16, 1, &s1, x, &a));
                DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_BF16, 1, &s1, dy, &b));
                free(x), free(dy);
                DG_TEST_TRY(dg_tensor_to_f64(a, &x));
                DG_TEST_TRY(dg_tensor_to_f64(b, &dy));
                dg_tensor_free(&a), dg_tensor_free(&b);
            }
            run_shift(cpu, DG_F32, cases[k].B, cases[k].T, cases[k].C, cases[k].cu, cases[k].n, x,
                      dy, &yc, &dc);
            run_shift(gpu, dt, cases[k].B, cases[k].T, cases[k].C, cases[k].cu, cases[k].n, x, dy,
                      &yg, &dg);
            /* f32: the kernels' f32 sum of the two terms is the CPU's subtraction (1e-6 leaves
             * room for a fused multiply-add order); bf16: the result is rounded to bf16 (2^-8) */
            const double tol = f ? 8e-3 : 1e-6;
            char name[96];
            snprintf(name, sizeof name, "token_shift cuda %s y vs cpu%s", dg_dtype_name(dt),
                     cases[k].cu ? " (varlen)" : "");
            dg_check_rel(name, yg, yc, n, tol);
            snprintf(name, sizeof name, "token_shift cuda %s dx vs cpu%s", dg_dtype_name(dt),
                     cases[k].cu ? " (varlen)" : "");
            dg_check_rel(name, dg, dc, n, tol);
            free(yc), free(dc), free(yg), free(dg);
        }
        free(x);
        free(dy);
    }
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_as_conv(cpu);
    test_isolation(cpu);
    test_f32_vs_f64(cpu);
    test_errors(cpu);
}

int main(int argc, char **argv) {
    return dg_test_main(argc, argv, "token_shift", cpu_cases, test_gpu);
}

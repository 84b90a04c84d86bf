/*
 * tests/test_cross_entropy.c -- dg_cross_entropy.
 *
 * cpu: loss against a direct f64 formula, f64 gradcheck (ignored rows, i32/i64 targets, an
 *      ignore_index that is also a valid class, CACHE and RECOMPUTE), every row ignored (loss 0,
 *      zero gradient), f32 against f64, logits of +-1e4 in f32 (finite, accurate), bad inputs.
 * gpu: loss and dlogits against the CPU f64 reference for f32 (rel < 1e-5) and bf16 (< 1e-2),
 *      vocabularies that are not multiples of the block, both policies, bitwise-repeatable loss,
 *      large logits, all rows ignored, out-of-range targets.
 */
#include "tests/harness.h"

#include <string.h>

#define IGN (-100)

typedef struct {
    dg_tensor *targets;
    int64_t ignore;
} ce_args;

static dg_status ce_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                       void *user) {
    (void)n_in;
    (void)n_out;
    const ce_args *a = user;
    return dg_cross_entropy(ctx, in[0], a->targets, a->ignore, &out[0]);
}

/* Targets in [0, V) with every `every`-th row set to `ignore` (every = 0: none). */
static dg_tensor *make_targets(dg_ctx *ctx, dg_dtype dt, int64_t N, int64_t V, uint64_t seed,
                               int every, int64_t ignore) {
    int64_t *v = malloc((size_t)(N ? N : 1) * sizeof *v);
    int32_t *v32 = malloc((size_t)(N ? N : 1) * sizeof *v32);
    for (int64_t i = 0; i < N; i++) {
        v[i] = (int64_t)(dg_rand_u01(seed, (uint64_t)i) * (double)V);
        if (every && i % every == (every > 1 ? 1 : 0)) /* every = 1: all rows */
            v[i] = ignore;
        v32[i] = (int32_t)v[i];
    }
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_host(ctx, dt, 1, &N, dt == DG_I32 ? (void *)v32 : (void *)v, &t));
    free(v);
    free(v32);
    return t;
}

/* The direct formula in f64: mean over counted rows of log sum exp(x) - x[t]. */
static double ref_loss(const double *x, const double *t, int64_t N, int64_t V, int64_t ignore) {
    double sum = 0;
    int64_t c = 0;
    for (int64_t i = 0; i < N; i++) {
        if ((int64_t)t[i] == ignore)
            continue;
        double m = x[i * V];
        for (int64_t j = 1; j < V; j++)
            m = x[i * V + j] > m ? x[i * V + j] : m;
        double s = 0;
        for (int64_t j = 0; j < V; j++)
            s += exp(x[i * V + j] - m);
        sum += m + log(s) - x[i * V + (int64_t)t[i]];
        c++;
    }
    return c ? sum / (double)c : 0.0;
}

static void check_loss_value(dg_ctx *cpu, dg_dtype tdt, int every, int64_t ignore) {
    int64_t s[2] = {13, 21};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, s, 3),
              *t = make_targets(cpu, tdt, 13, 21, 4, every, ignore);
    dg_tensor *loss = NULL;
    DG_TEST_TRY(dg_cross_entropy(cpu, x, t, ignore, &loss));
    double *xv, *tv, got;
    DG_TEST_TRY(dg_tensor_to_f64(x, &xv));
    DG_TEST_TRY(dg_tensor_to_f64(t, &tv));
    DG_TEST_TRY(dg_tensor_item(loss, &got));
    double want = ref_loss(xv, tv, 13, 21, ignore);
    dg_check(fabs(got - want) <= 1e-13 * fabs(want) && dg_tensor_dtype(loss) == DG_F64 &&
                 dg_tensor_numel(loss) == 1,
             "loss == direct formula (%s targets, ignore %lld): %.15g vs %.15g", dg_dtype_name(tdt),
             (long long)ignore, got, want);
    free(xv);
    free(tv);
    dg_tensor_free(&x);
    dg_tensor_free(&t);
    dg_tensor_free(&loss);
}

static void test_gradcheck(dg_ctx *cpu) {
    static const struct {
        dg_dtype tdt;
        int every;
        int64_t ignore;
        dg_policy pol;
        const char *what;
    } cfg[] = {
        {DG_I64, 3, IGN, DG_POLICY_CACHE, "i64, every 3rd row ignored, cache"},
        {DG_I32, 4, IGN, DG_POLICY_RECOMPUTE, "i32, every 4th row ignored, recompute"},
        {DG_I64, 0, 3, DG_POLICY_CACHE, "ignore_index 3 (a valid class)"},
    };
    for (int k = 0; k < 3; k++) {
        dg_policy_set("cross_entropy", cfg[k].pol);
        int64_t s[2] = {7, 9};
        dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, s, 10 + k);
        ce_args a = {make_targets(cpu, cfg[k].tdt, 7, 9, 20 + k, cfg[k].every, cfg[k].ignore),
                     cfg[k].ignore};
        dg_tensor_set_requires_grad(x, 1);
        dg_gradcheck_report rep;
        char name[128];
        snprintf(name, sizeof name, "gradcheck cross_entropy (%s)", cfg[k].what);
        if (dg_check_ok(dg_gradcheck(cpu, ce_fn, &a, &x, 1, 1, 1e-6, 5, &rep), name))
            dg_check(rep.max_rel_err < 1e-6, "%s: rel err %.2e < 1e-6", name, rep.max_rel_err);
        dg_tensor_free(&x);
        dg_tensor_free(&a.targets);
    }
    dg_policy_reset();

    /* CACHE keeps the row statistics ([N,2] f64), RECOMPUTE does not: N * 16 bytes less. */
    int64_t s[2] = {64, 10};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, s, 1),
              *t = make_targets(cpu, DG_I64, 64, 10, 2, 0, IGN);
    dg_tensor *l1 = NULL, *l2 = NULL;
    dg_tensor_set_requires_grad(x, 1);
    dg_tape_reset();
    DG_TEST_TRY(dg_cross_entropy(cpu, x, t, IGN, &l1));
    size_t cache_bytes = dg_tape_bytes();
    dg_tape_reset();
    dg_policy_set("cross_entropy", DG_POLICY_RECOMPUTE);
    DG_TEST_TRY(dg_cross_entropy(cpu, x, t, IGN, &l2));
    size_t rec_bytes = dg_tape_bytes();
    dg_policy_reset();
    dg_tape_reset();
    dg_check(cache_bytes == rec_bytes + 64 * 16, "tape: cache %zu bytes = recompute %zu + 1024",
             cache_bytes, rec_bytes);
    dg_tensor_free(&l1);
    dg_tensor_free(&l2);
    dg_tensor_free(&x);
    dg_tensor_free(&t);
}

static void test_all_ignored(dg_ctx *ctx, dg_dtype dt) {
    int64_t s[2] = {5, 300};
    dg_tensor *x = dg_test_randn(ctx, dt, 2, s, 1), *loss = NULL;
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    dg_tensor *tc = make_targets(cpu, DG_I64, 5, 300, 2, 1, IGN), *t = NULL; /* every row */
    DG_TEST_TRY(dg_to_device(ctx, tc, &t));
    dg_tensor_set_requires_grad(x, 1);
    DG_TEST_TRY(dg_cross_entropy(ctx, x, t, IGN, &loss));
    double l;
    DG_TEST_TRY(dg_tensor_item(loss, &l));
    DG_TEST_TRY(dg_tape_backward(ctx, loss));
    double *g;
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &g));
    int zeros = 1;
    for (int i = 0; i < 5 * 300; i++)
        zeros &= g[i] == 0.0;
    dg_check(l == 0.0 && zeros, "%s %s: every row ignored -> loss %g, gradient all zero",
             dg_device_str(dg_ctx_device(ctx)), dg_dtype_name(dt), l);
    free(g);
    dg_tape_reset();
    dg_tensor_free(&x);
    dg_tensor_free(&loss);
    dg_tensor_free(&tc);
    dg_tensor_free(&t);
    dg_ctx_free(&cpu);
}

/* Loss and dlogits for logits (host f64 values rounded to dt) on ctx, as host doubles. */
static void run_ce(dg_ctx *ctx, dg_dtype dt, const double *xh, int64_t N, int64_t V,
                   dg_tensor *targets_cpu, int64_t ignore, double *loss, double **grad) {
    int64_t s[2] = {N, V};
    dg_tensor *x = NULL, *t = NULL, *l = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, 2, s, xh, &x));
    DG_TEST_TRY(dg_to_device(ctx, targets_cpu, &t));
    dg_tensor_set_requires_grad(x, 1);
    DG_TEST_TRY(dg_cross_entropy(ctx, x, t, ignore, &l));
    DG_TEST_TRY(dg_tensor_item(l, loss));
    DG_TEST_TRY(dg_tape_backward(ctx, l));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), grad));
    dg_tape_reset();
    dg_tensor_free(&x);
    dg_tensor_free(&t);
    dg_tensor_free(&l);
}

/* Logits drawn in `dt` with scale `scale`, compared on dev/dt against CPU f64 on the same values.
 */
static void compare(dg_ctx *cpu, dg_ctx *dev, dg_dtype dt, int64_t N, int64_t V, double scale,
                    dg_dtype tdt, int every, double tol, uint64_t seed) {
    int64_t s[2] = {N, V};
    dg_tensor *xr = dg_test_rand(cpu, dt, 2, s, seed, -scale, scale);
    double *xh;
    DG_TEST_TRY(dg_tensor_to_f64(xr, &xh));
    dg_tensor *t = make_targets(cpu, tdt, N, V, seed + 1, every, IGN);
    double lw, lg, *gw, *gg;
    run_ce(cpu, DG_F64, xh, N, V, t, IGN, &lw, &gw);
    run_ce(dev, dt, xh, N, V, t, IGN, &lg, &gg);
    char name[128];
    snprintf(name, sizeof name, "%s %s N=%lld V=%lld |x|<=%g: loss",
             dg_device_str(dg_ctx_device(dev)), dg_dtype_name(dt), (long long)N, (long long)V,
             scale);
    dg_check_rel(name, &lg, &lw, 1, tol);
    snprintf(name, sizeof name, "%s %s N=%lld V=%lld |x|<=%g: dlogits",
             dg_device_str(dg_ctx_device(dev)), dg_dtype_name(dt), (long long)N, (long long)V,
             scale);
    dg_check_rel(name, gg, gw, N * V, tol);
    free(xh);
    free(gw);
    free(gg);
    dg_tensor_free(&xr);
    dg_tensor_free(&t);
}

static void test_errors(dg_ctx *cpu) {
    int64_t s[2] = {4, 9};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 2, s, 1), *loss = NULL, *t = NULL;
    int64_t tv[4] = {1, 2, 9, 0};
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I64, 1, (int64_t[]){4}, tv, &t));
    dg_check_err(dg_cross_entropy(cpu, x, t, IGN, &loss), DG_ERR_ARG,
                 "targets[2] = 9 is outside [0, 9)", "target == Vocab");
    dg_tensor_free(&t);
    int32_t tn[4] = {1, -1, 3, 0};
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I32, 1, (int64_t[]){4}, tn, &t));
    dg_check_err(dg_cross_entropy(cpu, x, t, IGN, &loss), DG_ERR_ARG,
                 "targets[1] = -1 is outside [0, 9) and is not ignore_index (-100)",
                 "negative target that is not ignore_index");
    dg_check_ok(dg_cross_entropy(cpu, x, t, -1, &loss), "the same target with ignore_index -1");
    dg_tensor_free(&loss);
    dg_tensor_free(&t);
    t = make_targets(cpu, DG_I64, 5, 9, 1, 0, IGN);
    dg_check_err(dg_cross_entropy(cpu, x, t, IGN, &loss), DG_ERR_SHAPE,
                 "'targets' must have shape [4], got [5]", "targets of the wrong length");
    dg_tensor_free(&t);
    dg_tensor *tf = dg_test_randn(cpu, DG_F32, 1, (int64_t[]){4}, 1);
    dg_check_err(dg_cross_entropy(cpu, x, tf, IGN, &loss), DG_ERR_DTYPE,
                 "'targets' must have dtype i32/i64", "float targets");
    t = make_targets(cpu, DG_I64, 4, 9, 1, 0, IGN);
    dg_tensor *x3 = dg_test_randn(cpu, DG_F64, 3, (int64_t[]){2, 2, 9}, 1), *xb = NULL;
    dg_check_err(dg_cross_entropy(cpu, x3, t, IGN, &loss), DG_ERR_SHAPE,
                 "'logits' must have shape [*,*]", "3-D logits");
    dg_check_err(dg_cross_entropy(cpu, t, t, IGN, &loss), DG_ERR_SHAPE, "'logits'",
                 "1-D int logits");
    DG_TEST_TRY(dg_to_dtype(cpu, x, DG_BF16, &xb));
    dg_check_err(dg_cross_entropy(cpu, xb, t, IGN, &loss), DG_ERR_DTYPE, "bf16 is a CUDA dtype",
                 "bf16 logits on CPU");
    dg_check_err(dg_cross_entropy(cpu, x, NULL, IGN, &loss), DG_ERR_ARG, "'targets' is NULL",
                 "NULL targets");
    dg_check_err(dg_cross_entropy(cpu, x, t, IGN, NULL), DG_ERR_ARG, "'out' is NULL", "NULL out");
    dg_check(loss == NULL, "failed calls leave the output NULL");
    dg_tensor_free(&t);
    dg_tensor_free(&tf);
    dg_tensor_free(&x3);
    dg_tensor_free(&xb);
    dg_tensor_free(&x);
}

static void test_cpu(dg_ctx *cpu) {
    check_loss_value(cpu, DG_I64, 3, IGN);
    check_loss_value(cpu, DG_I32, 0, 5);
    test_gradcheck(cpu);
    test_all_ignored(cpu, DG_F64);
    test_all_ignored(cpu, DG_F32);
    /* f32 exp/log carry ~1e-7 relative error per term; sums over V <= 1000 in f32 */
    compare(cpu, cpu, DG_F32, 37, 1000, 3.0, DG_I64, 5, 1e-5, 100);
    /* logits of magnitude 1e4 in f32: a naive exp overflows; the shifted form stays finite and
     * matches f64 on the same f32 values (the loss ~1e4 carries f32's 6e-8 relative rounding) */
    compare(cpu, cpu, DG_F32, 16, 50, 1e4, DG_I32, 0, 1e-5, 200);
    test_errors(cpu);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    for (int pol = 0; pol < 2; pol++) {
        dg_policy_set("cross_entropy", pol ? DG_POLICY_RECOMPUTE : DG_POLICY_CACHE);
        /* f32: per-row f32 online softmax (exp/log ~1e-7 each), f64 mean */
        compare(cpu, gpu, DG_F32, 37, 1000, 3.0, DG_I64, 5, 1e-5, 300 + pol);
        compare(cpu, gpu, DG_F32, 8, 50257, 5.0, DG_I32, 3, 1e-5, 310 + pol);
        compare(cpu, gpu, DG_F32, 300, 33, 2.0, DG_I64, 0, 1e-5, 320 + pol);
        /* bf16 logits (exact in the f64 reference), f32 math, bf16 dlogits: <= 2^-9 relative */
        compare(cpu, gpu, DG_BF16, 37, 1000, 3.0, DG_I64, 5, 1e-2, 330 + pol);
        compare(cpu, gpu, DG_BF16, 8, 50257, 5.0, DG_I32, 0, 1e-2, 340 + pol);
    }
    dg_policy_reset();
    compare(cpu, gpu, DG_F32, 16, 513, 1e4, DG_I64, 0, 1e-5, 400); /* large logits: finite */
    test_all_ignored(gpu, DG_F32);
    test_all_ignored(gpu, DG_BF16);

    /* The loss is bitwise repeatable (fixed reduction trees, no float atomics). */
    int64_t s[2] = {777, 4099};
    dg_tensor *x = dg_test_randn(gpu, DG_F32, 2, s, 5),
              *tc = make_targets(cpu, DG_I64, 777, 4099, 6, 7, IGN);
    dg_tensor *t = NULL, *l1 = NULL, *l2 = NULL;
    DG_TEST_TRY(dg_to_device(gpu, tc, &t));
    DG_TEST_TRY(dg_cross_entropy(gpu, x, t, IGN, &l1));
    DG_TEST_TRY(dg_cross_entropy(gpu, x, t, IGN, &l2));
    double v1, v2;
    DG_TEST_TRY(dg_tensor_item(l1, &v1));
    DG_TEST_TRY(dg_tensor_item(l2, &v2));
    dg_check(v1 == v2 && isfinite(v1), "cuda loss bitwise repeatable: %.9g == %.9g", v1, v2);
    dg_tensor_free(&l1);
    dg_tensor_free(&l2);
    dg_tensor_free(&t);
    dg_tensor_free(&tc);

    /* An out-of-range target is found on the device and reported with its row. */
    int64_t s2[2] = {4, 9};
    dg_tensor *x2 = dg_test_randn(gpu, DG_F32, 2, s2, 1);
    int32_t tv[4] = {1, 2, 3, 12};
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I32, 1, (int64_t[]){4}, tv, &t));
    dg_check_err(dg_cross_entropy(gpu, x2, t, IGN, &l1), DG_ERR_ARG,
                 "targets[3] = 12 is outside [0, 9)", "cuda: target out of range");
    dg_tensor_free(&t);
    dg_tensor_free(&x2);
    dg_tensor_free(&x);
    dg_ctx_free(&gpu);
}

int main(int argc, char **argv) {
    return dg_test_main(argc, argv, "cross_entropy", test_cpu, test_gpu);
}

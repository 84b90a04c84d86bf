/*
 * tests/test_embedding.c -- dg_embedding.
 *
 * cpu: gathered rows equal the table's rows (i32/i64 ids, 1-D to 3-D, strided ids), f64
 *      gradcheck with repeated ids, f32 against f64, out-of-range ids and other bad inputs;
 *      with dg_ctx_defer_checks on, bad ids and targets still fail at the call.
 * gpu: gather equals the CPU exactly (f32, bf16); the scatter-add backward against the CPU f64
 *      reference, bitwise identical across runs (no float atomics), also with skewed ids (90% one
 *      id: runs of hundreds of segments), odd widths and a vocabulary of one or 70001 rows;
 *      unused rows exactly 0; out-of-range ids reported.
 *      Deferred checks (the bad-input record): bad ids / targets do not fail the call, give a
 *      zero row and no gradient, and dg_ctx_check_errors reports the first with the eager
 *      message (and how many calls had bad input), then nothing; eager checks again after.
 */
#include "tests/harness.h"

#include <string.h>

/* Host ids in [lo, hi) from a counter-based stream, as an i32 or i64 tensor. */
static dg_tensor *make_ids(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                           int64_t lo, int64_t hi) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    int64_t *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    int32_t *v32 = malloc((size_t)(n ? n : 1) * sizeof *v32);
    for (int64_t i = 0; i < n; i++) {
        v[i] = lo + (int64_t)(dg_rand_u01(seed, (uint64_t)i) * (double)(hi - lo));
        v32[i] = (int32_t)v[i];
    }
    dg_tensor *t = NULL;
    DG_TEST_TRY(
        dg_tensor_from_host(ctx, dt, ndim, shape, dt == DG_I32 ? (void *)v32 : (void *)v, &t));
    free(v);
    free(v32);
    return t;
}

static dg_status emb_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                        void *user) {
    (void)n_in;
    (void)n_out;
    return dg_embedding(ctx, in[0], (dg_tensor *)user, &out[0]);
}

/* y[s, :] == W[ids[s], :] exactly. */
static int gather_ok(const dg_tensor *w, const dg_tensor *ids, const dg_tensor *y) {
    double *wv, *iv, *yv;
    DG_TEST_TRY(dg_tensor_to_f64(w, &wv));
    DG_TEST_TRY(dg_tensor_to_f64(ids, &iv));
    DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
    int64_t d = dg_tensor_dim(w, 1), n = dg_tensor_numel(ids);
    int ok = dg_tensor_numel(y) == n * d && dg_tensor_ndim(y) == dg_tensor_ndim(ids) + 1;
    for (int64_t i = 0; ok && i < n; i++)
        for (int64_t c = 0; c < d; c++)
            ok &= yv[i * d + c] == wv[(int64_t)iv[i] * d + c];
    free(wv);
    free(iv);
    free(yv);
    return ok;
}

static void test_cpu(dg_ctx *cpu) {
    int64_t ws[2] = {11, 7};
    static const struct {
        int ndim;
        int64_t shape[3];
        dg_dtype dt;
    } shapes[] = {{1, {9}, DG_I64}, {2, {3, 4}, DG_I32}, {3, {2, 3, 2}, DG_I64}};
    for (int k = 0; k < 3; k++) {
        dg_tensor *w = dg_test_randn(cpu, DG_F64, 2, ws, 10 + k);
        dg_tensor *ids = make_ids(cpu, shapes[k].dt, shapes[k].ndim, shapes[k].shape, 20 + k, 0, 5);
        dg_tensor *y = NULL;
        DG_TEST_TRY(dg_embedding(cpu, w, ids, &y));
        dg_check(gather_ok(w, ids, y), "gather %d-D %s ids: y[s,:] == W[ids[s],:]", shapes[k].ndim,
                 dg_dtype_name(shapes[k].dt));
        dg_tensor_free(&y);
        /* ids drawn from [0, 5) of 11 rows: repeats, and rows with no token (zero gradient) */
        dg_tensor_set_requires_grad(w, 1);
        dg_gradcheck_report rep;
        if (dg_check_ok(dg_gradcheck(cpu, emb_fn, ids, &w, 1, 1, 1e-6, 5, &rep),
                        "gradcheck embedding"))
            dg_check(rep.max_rel_err < 1e-6, "gradcheck embedding %d-D ids: rel err %.2e < 1e-6",
                     shapes[k].ndim, rep.max_rel_err);
        dg_tensor_free(&w);
        dg_tensor_free(&ids);
    }

    /* Strided ids (a transposed view) behave like their contiguous copy. */
    int64_t is[2] = {4, 3};
    dg_tensor *w = dg_test_randn(cpu, DG_F64, 2, ws, 1);
    dg_tensor *ids = make_ids(cpu, DG_I64, 2, is, 2, 0, 11), *idt = NULL, *y = NULL;
    DG_TEST_TRY(dg_transpose(ids, 0, 1, &idt));
    DG_TEST_TRY(dg_embedding(cpu, w, idt, &y));
    dg_check(gather_ok(w, idt, y) && dg_tensor_dim(y, 0) == 3, "gather with transposed ids");
    dg_tensor_free(&y);

    /* f32 against f64: the gather copies rows, so it differs only by the table's f32 rounding
     * (<= 2^-24 relative); the gradient sums the same f32 numbers in the same order, in f32 vs
     * f64: a few ulps of f32 */
    dg_tensor *w32 = NULL, *y32 = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, w, DG_F32, &w32));
    dg_tensor_set_requires_grad(w, 1);
    dg_tensor_set_requires_grad(w32, 1);
    int64_t big[2] = {6, 50};
    dg_tensor *ids2 = make_ids(cpu, DG_I32, 2, big, 3, 0, 11);
    DG_TEST_TRY(dg_embedding(cpu, w, ids2, &y));
    DG_TEST_TRY(dg_embedding(cpu, w32, ids2, &y32));
    dg_check_tensor_close("f32 gather == f64 gather", y32, y, 0, 1e-7);
    dg_tensor *gy = dg_test_randn(cpu, DG_F32, 3, (int64_t[]){6, 50, 7}, 4), *gy64 = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, gy, DG_F64, &gy64));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y, gy64));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y32, gy));
    dg_check_tensor_rel("f32 dW vs f64 dW (300 tokens, 11 rows)", dg_tensor_grad(w32),
                        dg_tensor_grad(w), 1e-6);
    dg_tape_reset();
    dg_tensor_free(&y);
    dg_tensor_free(&y32);
    dg_tensor_free(&gy);
    dg_tensor_free(&gy64);
    dg_tensor_free(&ids2);
    dg_tensor_free(&w32);

    /* Bad inputs. */
    int64_t v3[3] = {0, 4, 11};
    dg_tensor *bad = NULL;
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I64, 1, (int64_t[]){3}, v3, &bad));
    dg_check_err(dg_embedding(cpu, w, bad, &y), DG_ERR_ARG, "ids[2] = 11 is outside [0, 11)",
                 "id == Vocab");
    dg_tensor_free(&bad);
    int32_t m2[4] = {1, 2, 3, -1};
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I32, 2, (int64_t[]){2, 2}, m2, &bad));
    dg_check_err(dg_embedding(cpu, w, bad, &y), DG_ERR_ARG, "ids[1,1] = -1", "negative id");
    dg_tensor_free(&bad);
    dg_tensor *fl = dg_test_randn(cpu, DG_F32, 1, (int64_t[]){3}, 1);
    dg_check_err(dg_embedding(cpu, w, fl, &y), DG_ERR_DTYPE, "'ids' must have dtype i32/i64",
                 "float ids");
    dg_check_err(dg_embedding(cpu, fl, idt, &y), DG_ERR_SHAPE, "'weight' must have shape [*,*]",
                 "1-D weight");
    dg_check_err(dg_embedding(cpu, w, NULL, &y), DG_ERR_ARG, "'ids' is NULL", "NULL ids");
    dg_check_err(dg_embedding(cpu, idt, idt, &y), DG_ERR_DTYPE, "'weight' must have dtype",
                 "int weight");
    dg_tensor *wb = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, w, DG_BF16, &wb));
    dg_check_err(dg_embedding(cpu, wb, idt, &y), DG_ERR_DTYPE, "bf16 is a CUDA dtype",
                 "bf16 weight on CPU");
    dg_tensor *i5 = make_ids(cpu, DG_I64, 5, (int64_t[]){1, 1, 1, 1, 2}, 1, 0, 3);
    dg_check_err(dg_embedding(cpu, w, i5, &y), DG_ERR_SHAPE, "at most 5", "5-D ids");
    dg_check(y == NULL, "failed calls leave the output NULL");
    dg_tape_reset();
    dg_tensor_free(&i5);
    dg_tensor_free(&wb);
    dg_tensor_free(&fl);
    dg_tensor_free(&idt);
    dg_tensor_free(&ids);
    dg_tensor_free(&w);
}

/* dW of `w` for ids / gy on w's device, as host doubles. */
static double *grad_of(dg_ctx *ctx, dg_tensor *w, dg_tensor *ids, dg_tensor *gy) {
    dg_tensor *y = NULL;
    dg_tensor_zero_grad(w);
    DG_TEST_TRY(dg_embedding(ctx, w, ids, &y));
    DG_TEST_TRY(dg_tape_backward_with(ctx, y, gy));
    double *g;
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(w), &g));
    dg_tape_reset();
    dg_tensor_free(&y);
    return g;
}

static void test_deferred_gpu(dg_ctx *cpu, dg_ctx *gpu);

/* n ids, 90% of them `hot`, the others uniform in [0, V), as an i32 or i64 tensor on ctx. */
static dg_tensor *make_skewed_ids(dg_ctx *ctx, dg_dtype dt, int64_t n, int64_t V, int64_t hot,
                                  uint64_t seed) {
    int64_t *v = malloc((size_t)n * sizeof *v);
    int32_t *v32 = malloc((size_t)n * sizeof *v32);
    for (int64_t i = 0; i < n; i++) {
        v[i] = dg_rand_u01(seed, (uint64_t)i) < 0.9
                   ? hot
                   : (int64_t)(dg_rand_u01(seed + 1, (uint64_t)i) * (double)V);
        v32[i] = (int32_t)v[i];
    }
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_host(ctx, dt, 1, (int64_t[]){n},
                                    dt == DG_I32 ? (void *)v32 : (void *)v, &t));
    free(v);
    free(v32);
    return t;
}

/* The same values as an f64 CPU reference (*h64) and on the device in h's dtype (*dev). */
static void on_both(dg_ctx *cpu, dg_ctx *gpu, dg_tensor *h, dg_tensor **h64, dg_tensor **dev) {
    *h64 = *dev = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, h, DG_F64, h64));
    DG_TEST_TRY(dg_to_device(gpu, h, dev));
}

/* Skewed ids (one id holds ~18000 of 20000 positions: hundreds of 32-position segments, combined
 * by the second kernel), V not a multiple of anything, widths with and without vector access.
 * Tolerances: f32 dy is summed in f32 per segment of 32 positions, then the segment sums in two
 * more f32 levels (16 strided chains, then their 16 sums); the error is that of an f32 sum of the
 * run, a few 2^-24 times the partial sums' magnitudes (random signs: about 1e-7 of max |dW| here),
 * so 1e-5 leaves a wide margin. bf16 adds one rounding of the output, <= 2^-9 of |dW| <= 2^-9
 * max |dW| (4e-3 leaves 2x for the f32 part). */
static void test_gpu_skewed(dg_ctx *cpu, dg_ctx *gpu) {
    static const struct {
        int64_t V, d, n, hot;
        dg_dtype it;
    } cfg[] = {
        {257, 37, 20000, 200, DG_I32},     /* odd width: scalar access */
        {1003, 512, 20000, 5, DG_I64},     /* 16-byte access, many rows never used */
        {1, 64, 20000, 0, DG_I64},         /* a single row: every position in one run */
        {70001, 40, 20000, 69999, DG_I32}, /* more ids than one block of threads */
    };
    for (size_t k = 0; k < sizeof cfg / sizeof *cfg; k++) {
        for (int wd = DG_F32; wd <= DG_BF16; wd++) {
            dg_dtype dt = (dg_dtype)wd;
            int64_t ws[2] = {cfg[k].V, cfg[k].d}, ys[2] = {cfg[k].n, cfg[k].d};
            dg_tensor *wh = dg_test_randn(cpu, dt, 2, ws, 60 + k),
                      *gh = dg_test_randn(cpu, dt, 2, ys, 70 + k);
            dg_tensor *w64, *g64, *wg, *gg, *ig = NULL;
            on_both(cpu, gpu, wh, &w64, &wg);
            on_both(cpu, gpu, gh, &g64, &gg);
            dg_tensor *ic = make_skewed_ids(cpu, cfg[k].it, cfg[k].n, cfg[k].V, cfg[k].hot, 80 + k);
            DG_TEST_TRY(dg_to_device(gpu, ic, &ig));
            dg_tensor_set_requires_grad(w64, 1);
            dg_tensor_set_requires_grad(wg, 1);
            double *want = grad_of(cpu, w64, ic, g64);
            double *got = grad_of(gpu, wg, ig, gg);
            double *again = grad_of(gpu, wg, ig, gg);
            int64_t nw = cfg[k].V * cfg[k].d;
            char name[128];
            snprintf(name, sizeof name, "cuda %s dW skewed V=%lld d=%lld %s vs cpu f64",
                     dg_dtype_name(dt), (long long)cfg[k].V, (long long)cfg[k].d,
                     dg_dtype_name(cfg[k].it));
            dg_check_rel(name, got, want, nw, dt == DG_F32 ? 1e-5 : 4e-3);
            /* rows without a position are exactly 0, as in the reference */
            int zeros_ok = 1;
            for (int64_t i = 0; i < nw; i++)
                if (want[i] == 0.0)
                    zeros_ok &= got[i] == 0.0;
            dg_check(zeros_ok, "cuda %s dW skewed V=%lld: unused rows are 0", dg_dtype_name(dt),
                     (long long)cfg[k].V);
            dg_check(memcmp(got, again, (size_t)nw * sizeof *got) == 0,
                     "cuda %s dW skewed V=%lld d=%lld bitwise identical across two runs",
                     dg_dtype_name(dt), (long long)cfg[k].V, (long long)cfg[k].d);
            free(want);
            free(got);
            free(again);
            dg_tensor *all[] = {wh, gh, w64, g64, wg, gg, ig, ic};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                dg_tensor_free(&all[i]);
        }
    }
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    static const struct {
        int64_t V, d, b, t, hi;
    } cfg[] = {
        {1000, 129, 4, 37, 50},   /* many repeats, odd width */
        {5003, 64, 8, 512, 5003}, /* 4096 tokens over the whole table */
        {7, 300, 3, 33, 7},       /* tiny vocab: long runs per id */
    };
    for (int k = 0; k < 3; k++) {
        for (int wd = DG_F32; wd <= DG_BF16; wd++) {
            dg_dtype dt = (dg_dtype)wd;
            dg_dtype it = k == 1 ? DG_I32 : DG_I64;
            int64_t ws[2] = {cfg[k].V, cfg[k].d}, is[2] = {cfg[k].b, cfg[k].t};
            int64_t ys[3] = {cfg[k].b, cfg[k].t, cfg[k].d};
            /* the same values on both devices: data rounded to dt, reference in f64 */
            dg_tensor *wh = dg_test_randn(cpu, dt, 2, ws, 30 + k),
                      *gh = dg_test_randn(cpu, dt, 3, ys, 40 + k);
            dg_tensor *w64, *g64, *wg, *gg, *ig = NULL;
            on_both(cpu, gpu, wh, &w64, &wg);
            on_both(cpu, gpu, gh, &g64, &gg);
            dg_tensor *ic = make_ids(cpu, it, 2, is, 50 + k, 0, cfg[k].hi);
            DG_TEST_TRY(dg_to_device(gpu, ic, &ig));
            dg_tensor *yc = NULL, *yg = NULL;
            DG_TEST_TRY(dg_embedding(cpu, w64, ic, &yc));
            DG_TEST_TRY(dg_embedding(gpu, wg, ig, &yg));
            char name[128];
            snprintf(name, sizeof name, "cuda %s gather V=%lld d=%lld n=%lld == cpu (exact)",
                     dg_dtype_name(dt), (long long)cfg[k].V, (long long)cfg[k].d,
                     (long long)(cfg[k].b * cfg[k].t));
            dg_check_tensor_close(name, yg, yc, 0, 0);
            dg_tensor_set_requires_grad(w64, 1);
            dg_tensor_set_requires_grad(wg, 1);
            double *want = grad_of(cpu, w64, ic, g64);
            double *got = grad_of(gpu, wg, ig, gg);
            double *again = grad_of(gpu, wg, ig, gg);
            snprintf(name, sizeof name, "cuda %s dW V=%lld d=%lld vs cpu f64", dg_dtype_name(dt),
                     (long long)cfg[k].V, (long long)cfg[k].d);
            /* f32 sums of up to ~n/V terms in a fixed order; bf16 adds one output rounding */
            dg_check_rel(name, got, want, cfg[k].V * cfg[k].d, dt == DG_F32 ? 1e-5 : 1e-2);
            dg_check(memcmp(got, again, (size_t)(cfg[k].V * cfg[k].d) * sizeof *got) == 0,
                     "cuda %s dW bitwise identical across two runs", dg_dtype_name(dt));
            free(want);
            free(got);
            free(again);
            dg_tensor *all[] = {wh, gh, w64, g64, wg, gg, ig, ic, yc, yg};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                dg_tensor_free(&all[i]);
        }
    }
    /* An out-of-range id is reported with its position; the context stays usable. */
    int64_t ws[2] = {10, 33};
    dg_tensor *w = dg_test_randn(gpu, DG_F32, 2, ws, 1), *ids = NULL, *y = NULL;
    int64_t v[6] = {1, 2, 3, 4, 10, 5};
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I64, 2, (int64_t[]){2, 3}, v, &ids));
    dg_check_err(dg_embedding(gpu, w, ids, &y), DG_ERR_ARG, "ids[1,1] = 10 is outside [0, 10)",
                 "cuda: id == Vocab");
    dg_tensor_free(&ids);
    int32_t v32[3] = {0, 9, 3};
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I32, 1, (int64_t[]){3}, v32, &ids));
    dg_check_ok(dg_embedding(gpu, w, ids, &y), "cuda: a valid call after the failed one");
    dg_tensor_free(&y);
    dg_tensor *ic = NULL;
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I32, 1, (int64_t[]){3}, v32, &ic));
    dg_check_err(dg_embedding(gpu, w, ic, &y), DG_ERR_DEVICE, "'ids' must be on cuda:0",
                 "cuda weight, cpu ids");
    dg_tensor_free(&ic);
    dg_tensor_free(&y);
    dg_tensor_free(&ids);
    dg_tensor_free(&w);
    test_gpu_skewed(cpu, gpu);
    test_deferred_gpu(cpu, gpu);
    dg_ctx_free(&gpu);
}

/* Deferred checks on the CPU: the ops still fail at once; the check has nothing to report. */
static void test_deferred_cpu(dg_ctx *cpu) {
    dg_ctx_defer_checks(cpu, 1);
    int64_t ws[2] = {10, 4};
    dg_tensor *w = dg_test_randn(cpu, DG_F32, 2, ws, 1), *ids = NULL, *y = NULL, *lg = NULL;
    int64_t v[3] = {1, 10, 2};
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I64, 1, (int64_t[]){3}, v, &ids));
    dg_check_err(dg_embedding(cpu, w, ids, &y), DG_ERR_ARG, "ids[1] = 10 is outside [0, 10)",
                 "cpu, deferred checks: a bad id still fails at the call");
    lg = dg_test_randn(cpu, DG_F32, 2, (int64_t[]){3, 10}, 2);
    dg_check_err(dg_cross_entropy(cpu, lg, ids, -100, &y), DG_ERR_ARG,
                 "targets[1] = 10 is outside [0, 10)",
                 "cpu, deferred checks: a bad target still fails at the call");
    dg_check_ok(dg_ctx_check_errors(cpu), "cpu: dg_ctx_check_errors has nothing to report");
    dg_check_err(dg_ctx_check_errors(NULL), DG_ERR_ARG, "'ctx' is NULL", "check of a NULL ctx");
    dg_ctx_defer_checks(cpu, 0);
    dg_tensor_free(&lg);
    dg_tensor_free(&ids);
    dg_tensor_free(&w);
}

/* Deferred checks on CUDA: bad ids and targets are recorded, not read back; the calls succeed
 * with defined outputs (a zero row, no gradient for the bad id) and dg_ctx_check_errors reports
 * the first one, with the eager message, then nothing. */
static void test_deferred_gpu(dg_ctx *cpu, dg_ctx *gpu) {
    int64_t ws[2] = {10, 33}, ys[3] = {2, 3, 33};
    dg_tensor *wh = dg_test_randn(cpu, DG_F32, 2, ws, 3);
    dg_tensor *gh = dg_test_randn(cpu, DG_F32, 3, ys, 4);
    dg_tensor *w = NULL, *gy = NULL, *ids = NULL, *y = NULL;
    DG_TEST_TRY(dg_to_device(gpu, wh, &w));
    DG_TEST_TRY(dg_to_device(gpu, gh, &gy));
    int64_t v[6] = {1, 2, 3, 4, 10, 5};
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I64, 2, (int64_t[]){2, 3}, v, &ids));

    dg_ctx_defer_checks(gpu, 1);
    dg_check_ok(dg_embedding(gpu, w, ids, &y), "cuda, deferred: a bad id does not fail the call");
    double *hy = NULL, *hw = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(y, &hy));
    DG_TEST_TRY(dg_tensor_to_f64(wh, &hw));
    int rows_ok = 1;
    for (int i = 0; i < 6; i++)
        for (int c = 0; c < 33; c++)
            rows_ok &= hy[i * 33 + c] == (i == 4 ? 0.0 : hw[v[i] * 33 + c]);
    dg_check(rows_ok, "cuda, deferred: valid ids gather their rows, the bad id a zero row");

    /* dW: the bad position adds to no row; the reference moves it to id 0 with a zero dy */
    dg_tensor_set_requires_grad(w, 1);
    double *got = grad_of(gpu, w, ids, gy);
    double *hg = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(gh, &hg));
    for (int c = 0; c < 33; c++)
        hg[4 * 33 + c] = 0.0;
    int64_t vr[6] = {1, 2, 3, 4, 0, 5};
    dg_tensor *wr = NULL, *gr = NULL, *ir = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, wh, DG_F64, &wr));
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 3, ys, hg, &gr));
    DG_TEST_TRY(dg_tensor_from_host(cpu, DG_I64, 2, (int64_t[]){2, 3}, vr, &ir));
    dg_tensor_set_requires_grad(wr, 1);
    double *want = grad_of(cpu, wr, ir, gr);
    dg_check_rel("cuda, deferred: dW with a bad id == cpu without it", got, want, 10 * 33, 1e-6);

    /* a bad target too: 3 calls recorded (two gathers, one loss); the first is reported */
    int64_t tv[3] = {0, 7, 2};
    dg_tensor *lh = dg_test_randn(cpu, DG_F32, 2, (int64_t[]){3, 5}, 5), *lg = NULL, *tg = NULL;
    dg_tensor *loss = NULL;
    DG_TEST_TRY(dg_to_device(gpu, lh, &lg));
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I64, 1, (int64_t[]){3}, tv, &tg));
    dg_check_ok(dg_cross_entropy(gpu, lg, tg, -100, &loss),
                "cuda, deferred: a bad target does not fail the call");
    dg_check_err(dg_ctx_check_errors(gpu), DG_ERR_ARG,
                 "dg_embedding: ids[1,1] = 10 is outside [0, 10) (weight [10,33] f32 cuda:0) "
                 "[the first of 3 calls with bad input since the last check]",
                 "cuda, deferred: the check reports the first bad id, its op, position and value");
    dg_check_ok(dg_ctx_check_errors(gpu), "cuda, deferred: the check cleared the record");
    dg_tensor_free(&loss);
    dg_check_ok(dg_cross_entropy(gpu, lg, tg, -100, &loss), "cuda, deferred: bad target again");
    dg_check_err(dg_ctx_check_errors(gpu), DG_ERR_ARG,
                 "dg_cross_entropy: targets[1] = 7 is outside [0, 5) and is not ignore_index "
                 "(-100); logits [3,5] f32 cuda:0",
                 "cuda, deferred: a bad target alone, with the eager message");
    dg_tensor_free(&loss);
    dg_tensor_free(&y);
    int32_t v32[3] = {0, -1, 12};
    dg_tensor *i32 = NULL;
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I32, 1, (int64_t[]){3}, v32, &i32));
    dg_check_ok(dg_embedding(gpu, w, i32, &y), "cuda, deferred: i32 ids, two bad");
    dg_check_err(dg_ctx_check_errors(gpu), DG_ERR_ARG, "ids[1] = -1 is outside [0, 10)",
                 "cuda, deferred: the lowest bad position of a call is reported");
    dg_tensor_free(&y);

    /* back to eager: the call itself fails again */
    dg_ctx_defer_checks(gpu, 0);
    dg_check_err(dg_embedding(gpu, w, i32, &y), DG_ERR_ARG, "ids[1] = -1 is outside [0, 10)",
                 "cuda, eager again: the call fails");
    dg_check_ok(dg_ctx_check_errors(gpu), "cuda: an eager failure leaves nothing to report");
    dg_tape_reset();
    free(hy);
    free(hw);
    free(hg);
    free(got);
    free(want);
    dg_tensor *all[] = {wh, gh, w, gy, ids, y, wr, gr, ir, lh, lg, tg, i32};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

static void cpu_cases(dg_ctx *cpu) {
    test_cpu(cpu);
    test_deferred_cpu(cpu);
}

int main(int argc, char **argv) {
    return dg_test_main(argc, argv, "embedding", cpu_cases, test_gpu);
}

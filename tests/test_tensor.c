/*
 * tests/test_tensor.c -- the core: tensor creation, views, copies, dtype conversion, random fills
 * (same numbers on CPU and GPU), the tape (backward through views, gradient accumulation, no_grad,
 * reset, byte counts), policies, gradcheck itself, and error messages for bad arguments.
 * Staged uploads (dg_stage), on the CPU and on CUDA: every upload lands, in order, while the
 * host refills the two buffers ahead of a busy device; misuse and calls during a graph capture
 * are refused.
 */
#include "tests/harness.h"
#ifdef DG_HAVE_CUDA
#include "kernels/cuda_api.h"
#endif

#include <string.h>

typedef struct {
    int axis0, axis1;
} tr_args;

/* y = transpose(slice(reshape(x)))  and  z = to_dtype(y, f64) (a copy) */
static dg_status views_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                          void *user) {
    (void)n_in;
    (void)n_out;
    (void)user;
    dg_tensor *r = NULL, *s = NULL, *t = NULL;
    int64_t shape[3] = {2, 3, 4};
    dg_status st0 = dg_reshape(in[0], 3, shape, &r);
    if (st0 != DG_OK)
        return st0;
    dg_status st = dg_slice(r, 2, 1, 3, &s);
    if (st == DG_OK)
        st = dg_transpose(s, 0, 2, &t);
    if (st == DG_OK)
        st = dg_contiguous(ctx, t, &out[0]);
    dg_tensor_free(&r);
    dg_tensor_free(&s);
    dg_tensor_free(&t);
    return st;
}

static void test_views_and_tape(dg_ctx *cpu) {
    int64_t shape[1] = {24};
    dg_tensor *x = dg_test_randn(cpu, DG_F64, 1, shape, 7);
    dg_tensor_set_requires_grad(x, 1);
    dg_gradcheck_report rep;
    dg_check_ok(dg_gradcheck(cpu, views_fn, NULL, &x, 1, 1, 1e-6, 11, &rep), "gradcheck views");
    dg_check(rep.max_rel_err < 1e-8, "views gradcheck rel err %.3e < 1e-8 (linear maps: exact)",
             rep.max_rel_err);

    /* Values: transpose(slice) reads the right elements. */
    dg_tensor *y = NULL;
    DG_TEST_TRY(views_fn(cpu, &x, 1, &y, 1, NULL));
    double *xv, *yv;
    DG_TEST_TRY(dg_tensor_to_f64(x, &xv));
    DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
    /* y[a,b,c] = r[c,b,a+1] = x[c*12 + b*4 + a + 1], y shape [2,3,2] */
    int ok = 1;
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 2; c++)
                ok &= yv[a * 6 + b * 2 + c] == xv[c * 12 + b * 4 + a + 1];
    dg_check(ok && dg_tensor_shape(y)[0] == 2 && dg_tensor_shape(y)[2] == 2,
             "slice/transpose view values");
    free(xv);
    free(yv);
    dg_tensor_free(&y);

    /* Gradient accumulates across two uses; tape reset frees nodes; no_grad records nothing. */
    dg_tape_reset();
    dg_tensor *y2 = NULL, *g = NULL;
    DG_TEST_TRY(views_fn(cpu, &x, 1, &y, 1, NULL));
    DG_TEST_TRY(views_fn(cpu, &x, 1, &y2, 1, NULL));
    dg_check(dg_tape_num_nodes() == 8, "tape holds 8 nodes after two 4-op calls (%d)",
             dg_tape_num_nodes());
    int64_t ys[3] = {2, 3, 2};
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 3, ys, &g));
    DG_TEST_TRY(dg_tensor_fill_(g, 1.0));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y, g));
    DG_TEST_TRY(dg_tape_backward_with(cpu, y2, g));
    double *gx;
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &gx));
    int cnt2 = 0, cnt0 = 0;
    for (int i = 0; i < 24; i++) {
        cnt2 += gx[i] == 2.0;
        cnt0 += gx[i] == 0.0;
    }
    dg_check(cnt2 == 12 && cnt0 == 12, "grad accumulates over two backwards (12 twos, 12 zeros)");
    free(gx);
    dg_tape_reset();
    dg_check(dg_tape_num_nodes() == 0 && dg_tape_bytes() == 0, "tape reset empties the tape");
    dg_tensor_free(&y);
    dg_tensor_free(&y2);
    dg_no_grad_begin();
    DG_TEST_TRY(views_fn(cpu, &x, 1, &y, 1, NULL));
    dg_no_grad_end();
    dg_check(dg_tape_num_nodes() == 0 && !dg_tensor_requires_grad(y), "no_grad records nothing");
    dg_check_err(dg_tape_backward(cpu, y), DG_ERR_SHAPE, "one element", "backward on non-scalar");
    dg_tensor_free(&y);
    dg_tensor_free(&g);
    dg_tensor_free(&x);
}

/* The header's version macros, the library's version and build facts agree. */
static void test_version(void) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", DG_VERSION_MAJOR, DG_VERSION_MINOR, DG_VERSION_PATCH);
    dg_check(!strcmp(DG_VERSION, want), "DG_VERSION \"%s\" is MAJOR.MINOR.PATCH \"%s\"", DG_VERSION,
             want);
    dg_check(!strcmp(dg_version(), DG_VERSION), "dg_version() \"%s\" == DG_VERSION", dg_version());
    dg_check(dg_version_number() == DG_VERSION_NUMBER &&
                 DG_VERSION_NUMBER ==
                     DG_VERSION_MAJOR * 10000 + DG_VERSION_MINOR * 100 + DG_VERSION_PATCH,
             "dg_version_number() %d == DG_VERSION_NUMBER", dg_version_number());
    /* the commit: "unknown", or 12 hex digits with an optional "-dirty" */
    const char *c = dg_build_commit();
    size_t hex = strspn(c, "0123456789abcdef");
    dg_check(!strcmp(c, "unknown") || (hex == 12 && (c[hex] == '\0' || !strcmp(c + hex, "-dirty"))),
             "dg_build_commit() \"%s\" is a short hash or \"unknown\"", c);
    const char *archs = dg_build_cuda_archs();
    dg_check(dg_have_cuda() ? archs[0] != '\0' && strcmp(archs, "none") != 0
                            : !strcmp(archs, "none"),
             "dg_build_cuda_archs() \"%s\" matches dg_have_cuda() %d", archs, dg_have_cuda());
}

static void test_policy(void) {
    dg_policy_reset();
    dg_check(dg_policy_resolve("kda_state", DG_POLICY_RECOMPUTE) == DG_POLICY_RECOMPUTE,
             "op default applies");
    dg_policy_set("kda_state", DG_POLICY_CACHE);
    dg_check(dg_policy_resolve("kda_state", DG_POLICY_RECOMPUTE) == DG_POLICY_CACHE,
             "per-op setting overrides the default");
    dg_policy_set_global(DG_POLICY_RECOMPUTE);
    dg_check(dg_policy_resolve("kda_state", DG_POLICY_CACHE) == DG_POLICY_RECOMPUTE,
             "global override wins");
    dg_policy_reset();
    dg_check(dg_policy_resolve("x", DG_POLICY_DEFAULT) == DG_POLICY_CACHE, "fallback is cache");
}

static void test_dtypes_and_errors(dg_ctx *cpu) {
    int64_t shape[2] = {3, 5};
    dg_tensor *a = dg_test_rand(cpu, DG_F64, 2, shape, 3, -2, 2), *b = NULL, *c = NULL;
    DG_TEST_TRY(dg_to_dtype(cpu, a, DG_BF16, &b));
    DG_TEST_TRY(dg_to_dtype(cpu, b, DG_F32, &c));
    /* bf16 keeps 8 significant bits: round-to-nearest error <= half an ulp <= 2^-8 relative */
    dg_check_tensor_close("f64 -> bf16 -> f32 round trip", c, a, 0, 1.0 / 256);
    dg_tensor_free(&b);
    dg_tensor_free(&c);

    /* The same seed gives the same numbers in every dtype (up to rounding). */
    dg_tensor *d = dg_test_rand(cpu, DG_F32, 2, shape, 3, -2, 2);
    dg_check_tensor_close("rand f32 == rand f64 (rounded)", d, a, 0, 1e-7);
    dg_tensor_free(&d);

    int64_t bad[2] = {3, -1};
    dg_check_err(dg_tensor_new(cpu, DG_F32, 2, bad, &b), DG_ERR_SHAPE, "negative",
                 "negative dimension");
    dg_check_err(dg_tensor_new(cpu, DG_F32, 6, shape, &b), DG_ERR_SHAPE, "ndim", "too many dims");
    int64_t rs[2] = {4, 4};
    dg_check_err(dg_reshape(a, 2, rs, &b), DG_ERR_SHAPE, "15 elements", "reshape wrong count");
    dg_check_err(dg_slice(a, 1, 2, 9, &b), DG_ERR_ARG, "outside", "slice out of range");
    dg_check_err(dg_tensor_item(a, &(double){0}), DG_ERR_SHAPE, "one element", "item of 15");
    /* a zero extent makes no elements, but the other extents still make the strides: a shape
     * whose nonzero extents overflow them is refused (the .npy fuzzer found it) */
    const int64_t huge[3] = {0, (int64_t)1 << 40, (int64_t)1 << 40};
    dg_check_err(dg_tensor_new(cpu, DG_F32, 3, huge, &b), DG_ERR_SHAPE, "too large",
                 "zero extent beside extents whose product overflows");
    dg_tensor *e = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F32, 2, (int64_t[]){0, 3}, &e));
    dg_check_err(dg_reshape(e, 3, huge, &b), DG_ERR_SHAPE, "too large",
                 "reshape of an empty tensor to overflowing extents");
    dg_check_err(dg_reshape(e, 3, (int64_t[]){-1, (int64_t)1 << 40, (int64_t)1 << 40}, &b),
                 DG_ERR_SHAPE, "too large", "reshape with -1 beside overflowing extents");
    DG_TEST_TRY(dg_reshape(e, 3, (int64_t[]){0, 1 << 20, 7}, &b)); /* large but fits */
    dg_check(dg_tensor_numel(b) == 0 && dg_tensor_shape(b)[1] == 1 << 20, "empty reshape kept");
    dg_tensor_free(&b);
    dg_tensor_free(&e);
    dg_check(b == NULL, "failed calls leave the output NULL");
    dg_tensor_free(&a);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    int64_t shape[3] = {7, 33, 65};
    for (int dt = DG_F64; dt <= DG_BF16; dt++) {
        dg_tensor *hc = dg_test_rand(cpu, (dg_dtype)dt, 3, shape, 99, -3, 3);
        dg_tensor *hg = dg_test_rand(gpu, (dg_dtype)dt, 3, shape, 99, -3, 3);
        char name[64];
        snprintf(name, sizeof name, "rand uniform %s: cuda == cpu", dg_dtype_name((dg_dtype)dt));
        dg_check_tensor_close(name, hg, hc, 0, 0);
        dg_tensor_free(&hc);
        dg_tensor_free(&hg);
        hc = dg_test_randn(cpu, (dg_dtype)dt, 3, shape, 5);
        hg = dg_test_randn(gpu, (dg_dtype)dt, 3, shape, 5);
        snprintf(name, sizeof name, "rand normal %s: cuda ~ cpu", dg_dtype_name((dg_dtype)dt));
        /* log/cos may differ by an ulp between libm and CUDA's libdevice */
        dg_check_tensor_close(name, hg, hc, 1e-12, dt == DG_F64 ? 1e-14 : 1e-6);
        dg_tensor_free(&hc);
        dg_tensor_free(&hg);
    }
    /* strided copy + dtype conversion + views + backward on the device */
    dg_tensor *xc = dg_test_randn(cpu, DG_F32, 3, shape, 8), *xg = NULL, *tg = NULL, *tc = NULL;
    DG_TEST_TRY(dg_to_device(gpu, xc, &xg));
    DG_TEST_TRY(dg_transpose(xg, 0, 2, &tg));
    DG_TEST_TRY(dg_transpose(xc, 0, 2, &tc));
    dg_tensor *cg = NULL, *cc = NULL, *bg = NULL;
    DG_TEST_TRY(dg_contiguous(gpu, tg, &cg));
    DG_TEST_TRY(dg_contiguous(cpu, tc, &cc));
    dg_check_tensor_close("cuda transpose+contiguous == cpu", cg, cc, 0, 0);
    DG_TEST_TRY(dg_to_dtype(gpu, cg, DG_BF16, &bg));
    dg_check_tensor_close("cuda f32 -> bf16", bg, cc, 0, 1.0 / 256);
    dg_tensor_set_requires_grad(xg, 1);
    dg_tensor *sg = NULL, *og = NULL;
    DG_TEST_TRY(dg_slice(xg, 1, 3, 10, &sg));
    DG_TEST_TRY(dg_contiguous(gpu, sg, &og));
    dg_tensor *ones = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F32, 3, dg_tensor_shape(og), &ones));
    DG_TEST_TRY(dg_tensor_fill_(ones, 1.0));
    DG_TEST_TRY(dg_tape_backward_with(gpu, og, ones));
    double *gx;
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(xg), &gx));
    int ok = 1;
    for (int i = 0; i < 7; i++)
        for (int j = 0; j < 33; j++)
            for (int k = 0; k < 65; k++)
                ok &= gx[(i * 33 + j) * 65 + k] == ((j >= 3 && j < 10) ? 1.0 : 0.0);
    dg_check(ok, "cuda slice backward scatters into the right rows");
    free(gx);
    dg_tape_reset();
    dg_mem_stats ms = dg_ctx_mem_stats(gpu);
    dg_check(ms.in_use > 0 && ms.peak_in_use >= ms.in_use, "allocator stats: in use %zu, peak %zu",
             ms.in_use, ms.peak_in_use);
    dg_tensor *all[] = {xc, xg, tg, tc, cg, cc, bg, sg, og, ones};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    ms = dg_ctx_mem_stats(gpu);
    dg_check(ms.in_use == 0 && ms.cached > 0, "all freed: in use %zu, cached %zu", ms.in_use,
             ms.cached);
#ifdef DG_HAVE_CUDA
    /* read-only tables: one device copy per content, kept by the context */
    int64_t ta[37], tb[37], back[37];
    for (int i = 0; i < 37; i++)
        ta[i] = tb[i] = 1000003 * (int64_t)i - 17;
    const void *da = NULL, *db = NULL, *dc = NULL;
    DG_TEST_TRY(dg__cuda_table(gpu, ta, sizeof ta, &da));
    DG_TEST_TRY(dg__cuda_table(gpu, tb, sizeof tb, &db));
    tb[36]++;
    DG_TEST_TRY(dg__cuda_table(gpu, tb, sizeof tb, &dc));
    dg_check(da && da == db && dc && dc != da,
             "tables: equal bytes share one device copy, different bytes get another");
    DG_TEST_TRY(dg__cuda_memcpy(gpu, back, dc, sizeof back, DG_COPY_D2H));
    dg_check(memcmp(back, tb, sizeof tb) == 0, "tables: the device copy holds the bytes");
    dg_check(dg_ctx_mem_stats(gpu).in_use == 0, "tables are not counted as tensors in use");
#endif
    dg_ctx_free(&gpu);
}

/* ---- staged uploads ------------------------------------------------------------------------- */

/* Round r's values: 1000 r + i. */
static void stage_fill(int32_t *buf, int n, int r) {
    for (int i = 0; i < n; i++)
        buf[i] = 1000 * r + i;
}

static void test_stage(dg_ctx *ctx) {
    const char *dev = dg_device_str(dg_ctx_device(ctx));
    enum { N = 4096, ROUNDS = 8 };
    dg_stage *s = NULL;
    DG_TEST_TRY(dg_stage_new(ctx, N * sizeof(int32_t), &s));
    dg_tensor *dst = NULL, *all = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, DG_I32, 1, (int64_t[]){N}, &dst));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_I32, 2, (int64_t[]){ROUNDS, N}, &all));
    /* keep the device busy first, so that the host refills the buffers ahead of it */
    const int cuda = dg_ctx_device(ctx).kind == DG_DEV_CUDA;
    dg_tensor *a = dg_test_randn(ctx, DG_F32, 2, (int64_t[]){1024, 1024}, 3), *p = NULL;
    for (int i = 0; cuda && i < 4; i++) {
        dg_tensor *q = NULL;
        DG_TEST_TRY(dg_matmul(ctx, p ? p : a, a, &q));
        dg_tensor_free(&p);
        p = q;
    }
    void *prev[2] = {NULL, NULL};
    int alternate = 1;
    for (int r = 0; r < ROUNDS; r++) {
        void *buf = NULL, *again = NULL;
        DG_TEST_TRY(dg_stage_next(s, &buf));
        DG_TEST_TRY(dg_stage_next(s, &again)); /* no upload between: the same buffer */
        alternate &=
            buf == again && (r < 2 || buf == prev[r % 2]) && (r < 1 || buf != prev[1 - r % 2]);
        prev[r % 2] = buf;
        stage_fill(buf, N, r);
        DG_TEST_TRY(dg_stage_upload(s, dst));
        dg_tensor *row = NULL, *row2 = NULL;
        DG_TEST_TRY(dg_slice(all, 0, r, r + 1, &row));
        DG_TEST_TRY(dg_reshape(row, 1, (int64_t[]){N}, &row2));
        DG_TEST_TRY(dg_tensor_copy_(row2, dst)); /* queued after the upload */
        dg_tensor_free(&row);
        dg_tensor_free(&row2);
    }
    dg_check(alternate, "%s: dg_stage_next hands out the two buffers in turn", dev);
    int32_t *h = malloc(sizeof(int32_t) * N * ROUNDS), *want = malloc(sizeof(int32_t) * N);
    DG_TEST_TRY(dg_tensor_to_host(all, h, sizeof(int32_t) * N * ROUNDS));
    int ok = 1;
    for (int r = 0; r < ROUNDS; r++) {
        stage_fill(want, N, r);
        ok &= memcmp(h + (size_t)r * N, want, sizeof(int32_t) * N) == 0;
    }
    dg_check(ok, "%s: %d staged uploads through 2 buffers each landed intact, in order", dev,
             ROUNDS);
    free(h);
    free(want);
    /* misuse */
    dg_check_err(dg_stage_upload(s, dst), DG_ERR_STATE, "call dg_stage_next",
                 "dg_stage_upload without dg_stage_next");
    void *buf = NULL;
    DG_TEST_TRY(dg_stage_next(s, &buf));
    dg_tensor *big = NULL, *tr = NULL, *m = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, DG_I32, 1, (int64_t[]){N + 1}, &big));
    dg_check_err(dg_stage_upload(s, big), DG_ERR_ARG, "more than the stage's buffers",
                 "an upload larger than the buffers");
    DG_TEST_TRY(dg_tensor_new(ctx, DG_I32, 2, (int64_t[]){16, 16}, &m));
    DG_TEST_TRY(dg_transpose(m, 0, 1, &tr));
    dg_check_err(dg_stage_upload(s, tr), DG_ERR_ARG, "must be contiguous",
                 "an upload into a strided view");
    if (cuda) {
        dg_ctx *cpu = NULL;
        dg_tensor *hd = NULL;
        DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
        DG_TEST_TRY(dg_tensor_new(cpu, DG_I32, 1, (int64_t[]){N}, &hd));
        dg_check_err(dg_stage_upload(s, hd), DG_ERR_DEVICE, "dg_stage_upload",
                     "an upload into a tensor of another device");
        dg_tensor_free(&hd);
        dg_ctx_free(&cpu);
        /* during a capture: refused, nothing queued, the capture still ends well */
        DG_TEST_TRY(dg_graph_begin(ctx));
        dg_status su = dg_stage_upload(s, dst);
        void *b2 = NULL;
        dg_status sn = dg_stage_next(s, &b2);
        dg_stage *s2 = NULL;
        dg_status sw = dg_stage_new(ctx, 64, &s2);
        dg_status sf = dg_tensor_fill_(dst, 7.0);
        dg_graph *g = NULL;
        dg_status se = dg_graph_end(ctx, &g);
        dg_check_err(su, DG_ERR_STATE, "capturing", "dg_stage_upload during a capture");
        dg_check_err(sn, DG_ERR_STATE, "capturing", "dg_stage_next during a capture");
        dg_check_err(sw, DG_ERR_STATE, "capturing", "dg_stage_new during a capture");
        dg_check(s2 == NULL, "a refused dg_stage_new leaves no stage");
        dg_check_ok(sf, "a fill during the capture");
        dg_check_ok(se, "the capture ends well after the refused uploads");
        if (g) {
            DG_TEST_TRY(dg_graph_launch(ctx, g));
            int32_t back[4];
            dg_tensor *head = NULL;
            DG_TEST_TRY(dg_slice(dst, 0, 0, 4, &head));
            DG_TEST_TRY(dg_tensor_to_host(head, back, sizeof back));
            dg_check(back[0] == 7 && back[3] == 7, "the replayed fill wrote dst, no upload did");
            dg_tensor_free(&head);
        }
        dg_graph_free(&g);
    }
    dg_tensor *all_t[] = {dst, all, a, p, big, tr, m};
    for (size_t i = 0; i < sizeof all_t / sizeof *all_t; i++)
        dg_tensor_free(&all_t[i]);
    dg_stage_free(&s);
    dg_check(s == NULL, "%s: dg_stage_free clears the pointer", dev);
    dg_stage_free(&s); /* NULL: nothing */
    dg_check_err(dg_stage_next(NULL, &buf), DG_ERR_ARG, "'s'", "dg_stage_next(NULL)");
}

static void cpu_cases(dg_ctx *cpu) {
    test_stage(cpu);
    test_views_and_tape(cpu);
    test_policy();
    test_version();
    test_dtypes_and_errors(cpu);
    dg_check_err(dg_ctx_new(dg_cuda(0), &(dg_ctx *){NULL}),
                 dg_have_cuda() ? DG_ERR_DEVICE : DG_ERR_UNSUPPORTED, NULL,
                 "CUDA context without a device");
}

static void gpu_cases(dg_ctx *cpu) {
    test_gpu(cpu);
    dg_ctx *cuda = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &cuda));
    test_stage(cuda);
    dg_ctx_free(&cuda);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "tensor", cpu_cases, gpu_cases); }

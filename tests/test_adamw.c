/*
 * tests/test_adamw.c -- dg_adamw_step and dg_global_norm.
 *
 * cpu: several AdamW steps (fresh random gradients each step, with and without decay) against
 *      the formula written out in f64, for f64 and f32 params; a NULL gradient changes nothing;
 *      bad arguments. global_norm against a direct f64 sum (NULL entries, strided views, a
 *      tensor past the 64Ki chunk), the same bits for any thread count.
 *      dg_adamw (the multi-tensor optimizer) against the per-parameter loop it is defined as,
 *      bitwise, with and without clipping; its {norm, coef} against dg_global_norm and the clip
 *      formula; bad arguments.
 * gpu: the same AdamW steps on CUDA with f32 and bf16 gradients (rel < 1e-5 against the f64
 *      formula on the same numbers), global_norm against the CPU, bitwise repeatable. dg_adamw's
 *      one-launch update against the CPU reference on random non-zero parameters, moments and
 *      gradients (sizes across the chunk boundary, an empty parameter, a missing gradient, a
 *      strided and a bf16 gradient, decay on and off, clipping active and not): p, m, v within
 *      1e-5, the device norm within 1e-12 of the CPU's, the device coefficient equal to the clip
 *      formula of the device norm, and the norm bitwise repeatable.
 */
#include "tests/harness.h"

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static const dg_adamw_hparams g_hp = {3e-2, 0.9, 0.95, 1e-8, 0.1};

/* The update as written in the header, in f64. */
static void ref_step(double *p, const double *g, double *m, double *v, int64_t n, int64_t step,
                     const dg_adamw_hparams *hp, int decay) {
    for (int64_t i = 0; i < n; i++) {
        if (decay)
            p[i] -= hp->lr * hp->weight_decay * p[i];
        m[i] = hp->beta1 * m[i] + (1 - hp->beta1) * g[i];
        v[i] = hp->beta2 * v[i] + (1 - hp->beta2) * g[i] * g[i];
        double mhat = m[i] / (1 - pow(hp->beta1, (double)step));
        double vhat = v[i] / (1 - pow(hp->beta2, (double)step));
        p[i] -= hp->lr * mhat / (sqrt(vhat) + hp->eps);
    }
}

static double *host_of(const dg_tensor *t) {
    double *h;
    DG_TEST_TRY(dg_tensor_to_f64(t, &h));
    return h;
}

/* `steps` AdamW steps on ctx (param dtype pdt, grad dtype gdt) vs the f64 formula on the same
 * numbers (the gradients are drawn in gdt, so both sides see identical values). */
static void adamw_vs_formula(dg_ctx *ctx, dg_dtype pdt, dg_dtype gdt, int64_t n, int decay,
                             int steps, double tol) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    dg_dtype sdt = pdt; /* m, v follow the params */
    dg_tensor *p = dg_test_randn(ctx, pdt, 1, &n, 1), *m = NULL, *v = NULL;
    DG_TEST_TRY(dg_tensor_zeros(ctx, sdt, 1, &n, &m));
    DG_TEST_TRY(dg_tensor_zeros(ctx, sdt, 1, &n, &v));
    double *rp = host_of(p), *rm = calloc((size_t)n, sizeof *rm),
           *rv = calloc((size_t)n, sizeof *rv);
    for (int step = 1; step <= steps; step++) {
        dg_tensor *gc = dg_test_randn(cpu, gdt, 1, &n, 100 + (uint64_t)step), *g = NULL;
        double *rg = host_of(gc);
        for (int64_t i = 0; i < n; i += 97)
            rg[i] = 0; /* exact zeros: the update is driven by m only */
        dg_tensor_free(&gc);
        DG_TEST_TRY(dg_tensor_from_f64(cpu, gdt, 1, &n, rg, &gc));
        DG_TEST_TRY(dg_to_device(ctx, gc, &g));
        DG_TEST_TRY(dg_adamw_step(ctx, p, g, m, v, step, &g_hp, decay));
        ref_step(rp, rg, rm, rv, n, step, &g_hp, decay);
        free(rg);
        dg_tensor_free(&g);
        dg_tensor_free(&gc);
    }
    char name[128];
    double *hp = host_of(p), *hm = host_of(m), *hv = host_of(v);
    const char *dev = dg_device_str(dg_ctx_device(ctx));
    snprintf(name, sizeof name, "%s adamw %s params, %s grads, %s, %d steps: p", dev,
             dg_dtype_name(pdt), dg_dtype_name(gdt), decay ? "decay" : "no decay", steps);
    dg_check_rel(name, hp, rp, n, tol);
    snprintf(name, sizeof name, "%s adamw %s/%s: m", dev, dg_dtype_name(pdt), dg_dtype_name(gdt));
    dg_check_rel(name, hm, rm, n, tol);
    snprintf(name, sizeof name, "%s adamw %s/%s: v", dev, dg_dtype_name(pdt), dg_dtype_name(gdt));
    dg_check_rel(name, hv, rv, n, tol);
    free(hp);
    free(hm);
    free(hv);
    free(rp);
    free(rm);
    free(rv);
    dg_tensor_free(&p);
    dg_tensor_free(&m);
    dg_tensor_free(&v);
    dg_ctx_free(&cpu);
}

static void test_adamw_cpu(dg_ctx *cpu) {
    /* f64: the same operations as the formula, up to pow() vs the op's bias-correction order */
    adamw_vs_formula(cpu, DG_F64, DG_F64, 1001, 1, 5, 1e-13);
    adamw_vs_formula(cpu, DG_F64, DG_F64, 1001, 0, 5, 1e-13);
    /* f32 math: each step moves p by ~lr with ~1e-7 relative error; 5 steps stay < 1e-6 of |p| */
    adamw_vs_formula(cpu, DG_F32, DG_F32, 1001, 1, 5, 1e-6);

    /* decay = 0 really skips the decay: with zero lr nothing moves, with decay it shrinks. */
    int64_t n = 10;
    dg_tensor *p = dg_test_randn(cpu, DG_F64, 1, &n, 1), *g = dg_test_randn(cpu, DG_F64, 1, &n, 2);
    dg_tensor *m = NULL, *v = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 1, &n, &m));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 1, &n, &v));
    double *before = host_of(p);
    DG_TEST_TRY(dg_adamw_step(cpu, p, NULL, m, v, 1, &g_hp, 1));
    double *after = host_of(p);
    dg_check(memcmp(before, after, (size_t)n * sizeof *before) == 0,
             "NULL gradient leaves the param unchanged");
    free(after);

    /* bad arguments */
    dg_adamw_hparams bad = g_hp;
    dg_check_err(dg_adamw_step(cpu, p, g, m, v, 0, &g_hp, 1), DG_ERR_ARG, "step counts from 1",
                 "step 0");
    bad.beta1 = 1.0;
    dg_check_err(dg_adamw_step(cpu, p, g, m, v, 1, &bad, 1), DG_ERR_ARG, "beta1 1", "beta1 = 1");
    dg_check_err(dg_adamw_step(cpu, p, g, m, v, 1, NULL, 1), DG_ERR_ARG, "'hp' is NULL",
                 "NULL hparams");
    int64_t n2 = 11;
    dg_tensor *m2 = NULL, *m32 = NULL, *g32 = NULL, *pm = NULL, *pt = NULL, *gb = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 1, &n2, &m2));
    dg_check_err(dg_adamw_step(cpu, p, g, m2, v, 1, &g_hp, 1), DG_ERR_SHAPE,
                 "'m' must have shape [10]", "m of another shape");
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F32, 1, &n, &m32));
    dg_check_err(dg_adamw_step(cpu, p, g, m32, v, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'m' must be f64 for f64 params", "f32 state for f64 params");
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F32, 1, &n, &g32));
    dg_check_err(dg_adamw_step(cpu, p, g32, m, v, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'grad' must have dtype f64", "f32 grad for f64 params");
    DG_TEST_TRY(dg_to_dtype(cpu, g32, DG_BF16, &gb));
    dg_check_err(dg_adamw_step(cpu, p, gb, m, v, 1, &g_hp, 1), DG_ERR_DTYPE, "'grad'",
                 "bf16 grad on CPU");
    int64_t s2[2] = {2, 5};
    dg_tensor *p2 = dg_test_randn(cpu, DG_F64, 2, s2, 3);
    DG_TEST_TRY(dg_transpose(p2, 0, 1, &pt));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 2, dg_tensor_shape(pt), &pm));
    dg_check_err(dg_adamw_step(cpu, pt, pm, pm, pm, 1, &g_hp, 1), DG_ERR_ARG, "must be contiguous",
                 "strided param");
    dg_tensor *pi = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I64, 1, &n, &pi));
    dg_check_err(dg_adamw_step(cpu, pi, g, m, v, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'param' must have dtype f64/f32", "int param");
    dg_tensor *all[] = {p, g, m, v, m2, m32, g32, pm, pt, gb, p2, pi};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    free(before);
}

/* sqrt(sum of squares) of the non-NULL tensors, directly in f64 (long double accumulation). */
static double ref_norm(const dg_tensor *const *ts, int n) {
    long double s = 0;
    for (int i = 0; i < n; i++) {
        if (!ts[i])
            continue;
        double *h = host_of(ts[i]);
        for (int64_t j = 0; j < dg_tensor_numel(ts[i]); j++)
            s += (long double)h[j] * h[j];
        free(h);
    }
    return sqrt((double)s);
}

static void test_global_norm_cpu(dg_ctx *cpu) {
    int64_t s1[2] = {300, 700}, s2[1] = {17}, s3[2] = {6, 9};
    dg_tensor *a = dg_test_randn(cpu, DG_F32, 2, s1, 1), *b = dg_test_randn(cpu, DG_F64, 1, s2, 2);
    dg_tensor *c = dg_test_randn(cpu, DG_F64, 2, s3, 3), *ct = NULL;
    DG_TEST_TRY(dg_transpose(c, 0, 1, &ct));
    const dg_tensor *ts[4] = {a, NULL, b, ct};
    double got = 0, want = ref_norm(ts, 4);
    DG_TEST_TRY(dg_global_norm(cpu, ts, 4, &got));
    /* 210k squares summed in f64 in chunks vs one long-double sum: ~1e-15 relative */
    dg_check(fabs(got - want) <= 1e-12 * want,
             "global_norm (f32 210k elements, NULL, f64, strided view): %.15g vs %.15g", got, want);
#ifdef _OPENMP
    int nt = omp_get_max_threads();
    double g1 = 0, g2 = 0;
    omp_set_num_threads(1);
    DG_TEST_TRY(dg_global_norm(cpu, ts, 4, &g1));
    omp_set_num_threads(nt > 1 ? nt : 3);
    DG_TEST_TRY(dg_global_norm(cpu, ts, 4, &g2));
    omp_set_num_threads(nt);
    dg_check(g1 == g2, "global_norm: 1 thread == many threads, bitwise (%.17g)", g1);
#endif
    double z = -1;
    DG_TEST_TRY(dg_global_norm(cpu, NULL, 0, &z));
    dg_check(z == 0, "global_norm of an empty list is 0");
    dg_tensor *ii = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I32, 1, s2, &ii));
    const dg_tensor *bad[2] = {a, ii};
    dg_check_err(dg_global_norm(cpu, bad, 2, &z), DG_ERR_DTYPE, "'ts[1]' must have dtype",
                 "int tensor in the list");
    dg_check_err(dg_global_norm(cpu, ts, -1, &z), DG_ERR_ARG, "negative", "negative n");
    dg_check_err(dg_global_norm(cpu, ts, 4, NULL), DG_ERR_ARG, "'out' is NULL", "NULL out");
    dg_tensor_free(&ii);
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    dg_tensor_free(&c);
    dg_tensor_free(&ct);
}

/* ---- dg_adamw: the multi-tensor optimizer ---- */

#define MT_N 7
/* Parameter sizes: across the 4096-element chunk, one element, empty, 2-d. */
static const int64_t mt_len[MT_N] = {4096, 10007, 1, 0, 300, 4097, 33};
static const int mt_decay[MT_N] = {1, 0, 1, 1, 0, 1, 1};

typedef struct mt_set {
    dg_tensor *p[MT_N], *m[MT_N], *v[MT_N];
} mt_set;

/* Random non-zero params and moments (v > 0) in ctx, the same numbers for the same seed. */
static void mt_make(dg_ctx *ctx, dg_dtype dt, uint64_t seed, mt_set *s) {
    for (int i = 0; i < MT_N; i++) {
        int64_t sh[2] = {mt_len[i], 1}; /* param 4 is 2-d: [300, 1] */
        int nd = i == 4 ? 2 : 1;
        s->p[i] = dg_test_randn(ctx, dt, nd, sh, seed + 10 * (uint64_t)i);
        s->m[i] = dg_test_rand(ctx, dt, nd, sh, seed + 10 * (uint64_t)i + 1, -0.1, 0.1);
        s->v[i] = dg_test_rand(ctx, dt, nd, sh, seed + 10 * (uint64_t)i + 2, 0.001, 0.01);
    }
}

static void mt_copy(dg_ctx *ctx, const mt_set *src, mt_set *dst) {
    for (int i = 0; i < MT_N; i++) {
        DG_TEST_TRY(dg_to_device(ctx, src->p[i], &dst->p[i]));
        DG_TEST_TRY(dg_to_device(ctx, src->m[i], &dst->m[i]));
        DG_TEST_TRY(dg_to_device(ctx, src->v[i], &dst->v[i]));
    }
}

static void mt_free(mt_set *s) {
    for (int i = 0; i < MT_N; i++) {
        dg_tensor_free(&s->p[i]);
        dg_tensor_free(&s->m[i]);
        dg_tensor_free(&s->v[i]);
    }
}

/* The gradients of one step in ctx, drawn in f32 on the host so both devices see the same
 * numbers; `scale` sets their size (and so whether clipping acts). grads[2] is missing; grads[4]
 * is a strided view: the second column of a [300, 2] tensor. */
static void mt_grads(dg_ctx *ctx, uint64_t seed, double scale, dg_tensor *g[MT_N],
                     dg_tensor *keep[MT_N]) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    for (int i = 0; i < MT_N; i++) {
        g[i] = keep[i] = NULL;
        if (i == 2)
            continue; /* no gradient: param, m, v must not move */
        int64_t sh[2] = {mt_len[i], 2};
        dg_tensor *h =
            dg_test_rand(cpu, DG_F32, i == 4 ? 2 : 1, sh, seed + (uint64_t)i, -scale, scale);
        if (i == 4) {
            dg_tensor *d = NULL;
            DG_TEST_TRY(dg_to_device(ctx, h, &d));
            DG_TEST_TRY(dg_slice(d, 1, 1, 2, &g[i]));
            keep[i] = d;
        } else {
            DG_TEST_TRY(dg_to_device(ctx, h, &g[i]));
        }
        dg_tensor_free(&h);
    }
    dg_ctx_free(&cpu);
}

static void mt_grads_free(dg_tensor *g[MT_N], dg_tensor *keep[MT_N]) {
    for (int i = 0; i < MT_N; i++) {
        dg_tensor_free(&g[i]);
        dg_tensor_free(&keep[i]);
    }
}

static double clip_coef(double norm, double clip) {
    return clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
}

/* CPU: dg_adamw equals the loop dg_global_norm, dg_scale, dg_adamw_step bit for bit. */
static void test_adamw_multi_cpu(dg_ctx *cpu) {
    const dg_dtype dts[2] = {DG_F64, DG_F32};
    for (int di = 0; di < 2; di++) {
        mt_set a, b;
        mt_make(cpu, dts[di], 7, &a);
        mt_make(cpu, dts[di], 7, &b);
        const double clip = 1.0;
        dg_adamw *opt = NULL;
        DG_TEST_TRY(dg_adamw_new(cpu, MT_N, a.p, a.m, a.v, mt_decay, &g_hp, clip, &opt));
        int same = 1, stats_ok = 1;
        for (int step = 1; step <= 4; step++) {
            /* steps 1, 3: gradients small enough not to clip; 2, 4: clipped */
            double scale = step % 2 ? 1e-3 : 1.0, lr = 1e-2 * step;
            dg_tensor *g[MT_N], *keep[MT_N], *gc[MT_N];
            mt_grads(cpu, 100 + (uint64_t)step, scale, g, keep);
            for (int i = 0; i < MT_N; i++) /* the reference gets the same numbers in dts[di] */
                gc[i] = NULL;
            for (int i = 0; i < MT_N; i++)
                if (g[i])
                    DG_TEST_TRY(dg_to_dtype(cpu, g[i], dts[di], &gc[i]));
            DG_TEST_TRY(dg_adamw_set_step(opt, step, lr));
            DG_TEST_TRY(dg_adamw_update(opt, (const dg_tensor *const *)gc));
            double norm = 0;
            DG_TEST_TRY(dg_global_norm(cpu, (const dg_tensor *const *)gc, MT_N, &norm));
            double coef = clip_coef(norm, clip);
            dg_adamw_hparams hp = g_hp;
            hp.lr = lr;
            for (int i = 0; i < MT_N; i++) {
                dg_tensor *sg = NULL;
                if (gc[i] && coef < 1.0)
                    DG_TEST_TRY(dg_scale(cpu, gc[i], coef, &sg));
                DG_TEST_TRY(dg_adamw_step(cpu, b.p[i], sg ? sg : gc[i], b.m[i], b.v[i], step, &hp,
                                          mt_decay[i]));
                dg_tensor_free(&sg);
            }
            double *st = host_of(dg_adamw_stats(opt));
            stats_ok &= st[0] == norm && st[1] == coef && (step % 2 ? coef == 1.0 : coef < 1.0);
            free(st);
            for (int i = 0; i < MT_N; i++)
                dg_tensor_free(&gc[i]);
            mt_grads_free(g, keep);
        }
        for (int i = 0; i < MT_N; i++) {
            const dg_tensor *x[3] = {a.p[i], a.m[i], a.v[i]}, *y[3] = {b.p[i], b.m[i], b.v[i]};
            for (int k = 0; k < 3; k++) {
                double *hx = host_of(x[k]), *hy = host_of(y[k]);
                if (memcmp(hx, hy, (size_t)mt_len[i] * sizeof *hx) != 0)
                    same = 0;
                free(hx);
                free(hy);
            }
        }
        dg_check(same,
                 "cpu dg_adamw (%s, 7 params, 4 steps, clip on and off) == the "
                 "per-parameter loop, bitwise",
                 dg_dtype_name(dts[di]));
        dg_check(stats_ok, "cpu dg_adamw stats: norm == dg_global_norm, coef == the clip formula");
        dg_adamw_free(&opt);
        mt_free(&a);
        mt_free(&b);
    }

    /* a missing gradient leaves its parameter alone even with decay on */
    mt_set a;
    mt_make(cpu, DG_F32, 9, &a);
    double *before = host_of(a.p[2]);
    dg_adamw *opt = NULL;
    DG_TEST_TRY(dg_adamw_new(cpu, MT_N, a.p, a.m, a.v, NULL, &g_hp, 0.0, &opt));
    dg_tensor *g[MT_N], *keep[MT_N];
    mt_grads(cpu, 5, 1.0, g, keep);
    dg_check_err(dg_adamw_update(opt, (const dg_tensor *const *)g), DG_ERR_STATE,
                 "dg_adamw_set_step", "update before any step was set");
    DG_TEST_TRY(dg_adamw_set_step(opt, 1, 1e-2));
    DG_TEST_TRY(dg_adamw_update(opt, (const dg_tensor *const *)g));
    double *after = host_of(a.p[2]), *st = host_of(dg_adamw_stats(opt));
    dg_check(before[0] == after[0], "cpu dg_adamw: no gradient, no change (decay on)");
    dg_check(st[1] == 1.0, "cpu dg_adamw: clip 0 never scales (coef %g)", st[1]);
    free(before);
    free(after);
    free(st);

    /* bad arguments */
    dg_adamw *bad = NULL;
    dg_check_err(dg_adamw_new(cpu, MT_N, a.p, a.m, a.v, NULL, &g_hp, -1.0, &bad), DG_ERR_ARG,
                 "clip must be >= 0", "negative clip");
    dg_tensor *ms[MT_N];
    memcpy(ms, a.m, sizeof ms);
    ms[1] = a.m[0];
    dg_check_err(dg_adamw_new(cpu, MT_N, a.p, ms, a.v, NULL, &g_hp, 1.0, &bad), DG_ERR_SHAPE,
                 "'m[1]' must have shape [10007]", "moment of another shape");
    dg_check_err(dg_adamw_set_step(opt, 0, 1e-2), DG_ERR_ARG, "step counts from 1", "step 0");
    dg_tensor *g0 = g[0];
    g[0] = g[1];
    dg_check_err(dg_adamw_update(opt, (const dg_tensor *const *)g), DG_ERR_SHAPE,
                 "'grads[0]' must have shape [4096]", "gradient of another shape");
    g[0] = g0;
    dg_check(bad == NULL, "failed dg_adamw_new leaves *out NULL");
    mt_grads_free(g, keep);
    dg_adamw_free(&opt);
    mt_free(&a);
}

/* CUDA: the one-launch update against the CPU reference on the same numbers. */
static void test_adamw_multi_gpu(dg_ctx *cpu, dg_ctx *gpu) {
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        mt_set c, d;
        mt_make(cpu, DG_F32, 21, &c);
        mt_copy(gpu, &c, &d); /* the same numbers on both devices */
        const double clip = 1.0;
        dg_adamw *oc = NULL, *od = NULL;
        DG_TEST_TRY(dg_adamw_new(cpu, MT_N, c.p, c.m, c.v, mt_decay, &g_hp, clip, &oc));
        DG_TEST_TRY(dg_adamw_new(gpu, MT_N, d.p, d.m, d.v, mt_decay, &g_hp, clip, &od));
        int norm_ok = 1, coef_ok = 1, rep_ok = 1, clipped = 0, unclipped = 0;
        for (int step = 1; step <= 4; step++) {
            double scale = step % 2 ? 1e-3 : 1.0, lr = 1e-2 * step;
            dg_tensor *gd[MT_N], *kd[MT_N], *gh[MT_N];
            mt_grads(gpu, 200 + (uint64_t)step, scale, gd, kd);
            for (int i = 0; i < MT_N; i++) {
                gh[i] = NULL;
                if (!gd[i])
                    continue;
                if (bf16 && i == 1) { /* a bf16 gradient; the CPU gets its exact f32 values */
                    dg_tensor *b = NULL;
                    DG_TEST_TRY(dg_to_dtype(gpu, gd[i], DG_BF16, &b));
                    dg_tensor_free(&gd[i]);
                    gd[i] = b;
                }
                dg_tensor *t = NULL;
                DG_TEST_TRY(dg_to_device(cpu, gd[i], &t));
                DG_TEST_TRY(dg_to_dtype(cpu, t, DG_F32, &gh[i]));
                dg_tensor_free(&t);
            }
            DG_TEST_TRY(dg_adamw_set_step(oc, step, lr));
            DG_TEST_TRY(dg_adamw_set_step(od, step, lr));
            DG_TEST_TRY(dg_adamw_update(oc, (const dg_tensor *const *)gh));
            DG_TEST_TRY(dg_adamw_update(od, (const dg_tensor *const *)gd));
            double *sc = host_of(dg_adamw_stats(oc)), *sd = host_of(dg_adamw_stats(od));
            norm_ok &= fabs(sd[0] - sc[0]) <= 1e-12 * sc[0];
            coef_ok &= sd[1] == clip_coef(sd[0], clip);
            clipped += sd[1] < 1.0;
            unclipped += sd[1] == 1.0;
            /* the norm again, on the same gradients: the same bits (the update is not repeated:
             * a second optimizer over throwaway copies takes it) */
            if (step == 4) {
                mt_set e, ec;
                mt_make(cpu, DG_F32, 21, &ec);
                mt_copy(gpu, &ec, &e);
                mt_free(&ec);
                dg_adamw *oe = NULL;
                DG_TEST_TRY(dg_adamw_new(gpu, MT_N, e.p, e.m, e.v, mt_decay, &g_hp, clip, &oe));
                DG_TEST_TRY(dg_adamw_set_step(oe, step, lr));
                DG_TEST_TRY(dg_adamw_update(oe, (const dg_tensor *const *)gd));
                double *se = host_of(dg_adamw_stats(oe));
                rep_ok &= se[0] == sd[0] && se[1] == sd[1];
                free(se);
                dg_adamw_free(&oe);
                mt_free(&e);
            }
            free(sc);
            free(sd);
            for (int i = 0; i < MT_N; i++)
                dg_tensor_free(&gh[i]);
            mt_grads_free(gd, kd);
        }
        const char *gname = bf16 ? "f32 + one bf16 grad" : "f32 grads";
        dg_check(norm_ok, "cuda dg_adamw (%s): norm within 1e-12 of the CPU's", gname);
        dg_check(coef_ok, "cuda dg_adamw (%s): coef == clip / (norm + 1e-6) of the device norm",
                 gname);
        dg_check(clipped == 2 && unclipped == 2,
                 "cuda dg_adamw (%s): 2 steps clipped, 2 not (%d, %d)", gname, clipped, unclipped);
        dg_check(rep_ok, "cuda dg_adamw (%s): norm and coef bitwise repeatable", gname);
        for (int i = 0; i < MT_N; i++) {
            if (mt_len[i] == 0)
                continue;
            char name[96];
            snprintf(name, sizeof name, "cuda dg_adamw (%s) vs cpu, param %d (%lld): p", gname, i,
                     (long long)mt_len[i]);
            dg_check_tensor_rel(name, d.p[i], c.p[i], 1e-5);
            snprintf(name, sizeof name, "cuda dg_adamw (%s) vs cpu, param %d: m", gname, i);
            dg_check_tensor_rel(name, d.m[i], c.m[i], 1e-5);
            snprintf(name, sizeof name, "cuda dg_adamw (%s) vs cpu, param %d: v", gname, i);
            dg_check_tensor_rel(name, d.v[i], c.v[i], 1e-5);
        }
        dg_adamw_free(&oc);
        dg_adamw_free(&od);
        mt_free(&c);
        mt_free(&d);
    }
    /* CUDA params must be f32 */
    mt_set b;
    mt_make(gpu, DG_F32, 3, &b);
    dg_tensor *pb = NULL, *ps[MT_N];
    memcpy(ps, b.p, sizeof ps);
    DG_TEST_TRY(dg_to_dtype(gpu, b.p[0], DG_BF16, &pb));
    ps[0] = pb;
    dg_adamw *bad = NULL;
    dg_check_err(dg_adamw_new(gpu, MT_N, ps, b.m, b.v, NULL, &g_hp, 1.0, &bad), DG_ERR_DTYPE,
                 "'params[0]' must have dtype f32", "cuda dg_adamw with a bf16 param");
    dg_tensor_free(&pb);
    mt_free(&b);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    /* f32 math on the device (nvcc may fuse multiply-adds): < 1e-6 of |p| after 5 steps, as on
     * the CPU; the gradients, bf16 or f32, are the same numbers on both sides */
    adamw_vs_formula(gpu, DG_F32, DG_F32, 100003, 1, 5, 1e-5);
    adamw_vs_formula(gpu, DG_F32, DG_BF16, 100003, 1, 5, 1e-5);
    adamw_vs_formula(gpu, DG_F32, DG_F32, 4099, 0, 3, 1e-5);

    int64_t s1[1] = {3000017}, s2[2] = {33, 65}, s3[1] = {5};
    dg_tensor *a = dg_test_randn(gpu, DG_F32, 1, s1, 1), *b = dg_test_randn(gpu, DG_BF16, 2, s2, 2);
    dg_tensor *c = dg_test_randn(gpu, DG_F32, 1, s3, 3), *bt = NULL;
    DG_TEST_TRY(dg_transpose(b, 0, 1, &bt));
    const dg_tensor *ts[4] = {a, NULL, bt, c};
    double got = 0, again = 0, want = ref_norm(ts, 4);
    DG_TEST_TRY(dg_global_norm(gpu, ts, 4, &got));
    DG_TEST_TRY(dg_global_norm(gpu, ts, 4, &again));
    /* f64 sums of f32/bf16 squares in a different order than the long-double reference */
    dg_check(fabs(got - want) <= 1e-12 * want,
             "cuda global_norm (3M f32, bf16 view, NULL): "
             "%.15g vs %.15g",
             got, want);
    dg_check(got == again, "cuda global_norm bitwise repeatable");
    dg_tensor *h = NULL;
    DG_TEST_TRY(dg_to_device(cpu, a, &h));
    const dg_tensor *mixed[2] = {a, h};
    dg_check_err(dg_global_norm(gpu, mixed, 2, &got), DG_ERR_DEVICE, "'ts[1]' must be on cuda:0",
                 "cpu tensor in a cuda norm");
    /* a strided param is refused, a bf16 param too (CUDA params are f32) */
    int64_t n = 8;
    dg_tensor *pb = dg_test_randn(gpu, DG_BF16, 1, &n, 1), *m = NULL;
    DG_TEST_TRY(dg_tensor_zeros(gpu, DG_F32, 1, &n, &m));
    dg_check_err(dg_adamw_step(gpu, pb, pb, m, m, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'param' must have dtype f32", "cuda bf16 params");
    dg_tensor *all[] = {a, b, c, bt, h, pb, m};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    test_adamw_multi_gpu(cpu, gpu);
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_adamw_cpu(cpu);
    test_global_norm_cpu(cpu);
    test_adamw_multi_cpu(cpu);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "adamw", cpu_cases, test_gpu); }

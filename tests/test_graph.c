/*
 * tests/test_graph.c -- CUDA graph capture (dg_graph_*, include/deltagrad.h).
 *
 * The main case: one chunked KDA forward + backward (dg_kda_chunk with default options and h0,
 * seeded with a random upstream gradient; B = 2, T = 100 (not a multiple of the chunk), H = HV =
 * 2, K = V = 64; bf16 and f32 inputs) is run once eagerly, captured, then replayed twice, each
 * time after new random values are copied (device to device, outside the graph) into the
 * tensors the capture read. After each replay, o and the gradients of q, k, v, g, beta and h0
 * must equal an eager run on the same new values bit for bit: the KDA kernels reduce without
 * float atomics (kernels/kda/common.cuh), so a launch sequence is a pure function of its inputs,
 * and a replay repeats the eager launches (same kernels, grids and addresses' alignment).
 * Then the memory rule: a block the graph owns (the output, freed) is not handed to a tensor
 * made after the capture, a replay leaves that tensor alone, and dg_graph_free releases the
 * graph's blocks.
 * Errors: an allocation that misses the cache and a KDA call whose chunk tables were never
 * uploaded fail the capture with DG_ERR_STATE naming the cause, dg_graph_end discards it and the
 * context works eagerly afterwards; host reads, syncs and uploads during a capture are refused
 * without failing it; nothing captured runs before a launch; a second begin, an end without
 * begin and a launch during a capture are refused. The deferred bad-input record
 * (dg_ctx_defer_checks) reports a bad id met by a replay.
 * cpu mode: every call on a CPU context is DG_ERR_UNSUPPORTED. gpu mode: all of the above
 * (skipped without a device).
 */
#include "harness.h"

#include <string.h>

/* ---- cpu: refused --------------------------------------------------------------------------- */

static void test_cpu_refused(void) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    dg_check_err(dg_graph_begin(cpu), DG_ERR_UNSUPPORTED, "need a CUDA context",
                 "dg_graph_begin on a CPU context");
    dg_graph *g = (dg_graph *)&g; /* must be cleared */
    dg_check_err(dg_graph_end(cpu, &g), DG_ERR_UNSUPPORTED, "need a CUDA context",
                 "dg_graph_end on a CPU context");
    dg_check(g == NULL, "dg_graph_end clears *out on failure");
    dg_check_err(dg_graph_launch(cpu, NULL), DG_ERR_UNSUPPORTED, "need a CUDA context",
                 "dg_graph_launch on a CPU context");
    dg_check(!dg_graph_capturing(cpu), "a CPU context never captures");
    dg_graph_free(&g); /* NULL: nothing */
    dg_ctx_free(&cpu);
}

#ifdef DG_HAVE_CUDA

/* ---- helpers -------------------------------------------------------------------------------- */

static void *host_bytes(const dg_tensor *t, size_t *n) {
    *n = dg_tensor_nbytes(t);
    void *h = malloc(*n ? *n : 1);
    if (!h) {
        fprintf(stderr, "FATAL: out of host memory\n");
        exit(1);
    }
    DG_TEST_TRY(dg_tensor_to_host(t, h, *n));
    return h;
}

/* got == want bit for bit; on a mismatch the largest difference is printed. */
static void same_bits(const char *what, const dg_tensor *got, const dg_tensor *want) {
    if (!got || !want) {
        dg_check(0, "%s: missing tensor (replay %p, eager %p)", what, (const void *)got,
                 (const void *)want);
        return;
    }
    size_t ng, nw;
    void *hg = host_bytes(got, &ng), *hw = host_bytes(want, &nw);
    int eq = ng == nw && dg_tensor_dtype(got) == dg_tensor_dtype(want) && memcmp(hg, hw, nw) == 0;
    if (!eq && ng == nw) {
        double *g = NULL, *w = NULL, worst = 0;
        DG_TEST_TRY(dg_tensor_to_f64(got, &g));
        DG_TEST_TRY(dg_tensor_to_f64(want, &w));
        for (int64_t i = 0; i < dg_tensor_numel(want); i++)
            worst = fabs(g[i] - w[i]) > worst ? fabs(g[i] - w[i]) : worst;
        printf("         max |replay - eager| = %.3e\n", worst);
        free(g);
        free(w);
    }
    dg_check(eq, "%s: replay == eager bit for bit (%zu bytes)", what, nw);
    free(hg);
    free(hw);
}

/* Largest |x| (NaN if any element is not finite). */
static double max_abs(const dg_tensor *t) {
    double *h = NULL, m = 0;
    DG_TEST_TRY(dg_tensor_to_f64(t, &h));
    for (int64_t i = 0; i < dg_tensor_numel(t); i++) {
        if (!isfinite(h[i])) {
            m = NAN;
            break;
        }
        m = fabs(h[i]) > m ? fabs(h[i]) : m;
    }
    free(h);
    return m;
}

/* ---- the KDA step --------------------------------------------------------------------------- */

enum { IN_Q, IN_K, IN_V, IN_G, IN_BETA, IN_H0, NIN };
static const char *in_names[NIN] = {"q", "k", "v", "g", "beta", "h0"};

/* One set of KDA inputs (every one requires grad) and the upstream gradient of o. */
typedef struct kda_in {
    dg_tensor *t[NIN];
    dg_tensor *dout;
} kda_in;

#define KB 2
#define KT 100
#define KH 2
#define KK 64
#define KV 64

/* New leaves filled with the values of `seed`: q, k small enough for a stable delta rule
 * (|k|^2 ~ 0.85), g a per-step log decay in [-0.5, -0.01], beta in [0.1, 0.9], h0 f32. */
static kda_in make_inputs(dg_ctx *ctx, dg_dtype dt, uint64_t seed) {
    const int64_t sq[4] = {KB, KT, KH, KK}, sv[4] = {KB, KT, KH, KV}, sb[3] = {KB, KT, KH};
    const int64_t s0[4] = {KB, KH, KK, KV};
    kda_in in;
    in.t[IN_Q] = dg_test_rand(ctx, dt, 4, sq, seed + 1, -0.2, 0.2);
    in.t[IN_K] = dg_test_rand(ctx, dt, 4, sq, seed + 2, -0.2, 0.2);
    in.t[IN_V] = dg_test_rand(ctx, dt, 4, sv, seed + 3, -1.0, 1.0);
    in.t[IN_G] = dg_test_rand(ctx, dt, 4, sq, seed + 4, -0.5, -0.01);
    in.t[IN_BETA] = dg_test_rand(ctx, dt, 3, sb, seed + 5, 0.1, 0.9);
    in.t[IN_H0] = dg_test_rand(ctx, DG_F32, 4, s0, seed + 6, -0.5, 0.5);
    for (int i = 0; i < NIN; i++)
        dg_tensor_set_requires_grad(in.t[i], 1);
    in.dout = dg_test_rand(ctx, dt, 4, sv, seed + 7, -1.0, 1.0);
    return in;
}

static void free_inputs(kda_in *in) {
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&in->t[i]);
    dg_tensor_free(&in->dout);
}

/* The whole step: fresh gradients, forward, backward, an empty tape. */
static dg_status kda_step(dg_ctx *ctx, kda_in *in, dg_tensor **o) {
    for (int i = 0; i < NIN; i++)
        dg_tensor_zero_grad(in->t[i]);
    dg_kda_opts opts;
    memset(&opts, 0, sizeof opts); /* defaults: chunk 64, gate NONE, no in-op l2norm */
    dg_tensor **t = in->t;
    dg_status st = dg_kda_chunk(ctx, t[IN_Q], t[IN_K], t[IN_V], t[IN_G], t[IN_BETA], NULL, NULL,
                                t[IN_H0], &opts, o, NULL);
    if (st == DG_OK)
        st = dg_tape_backward_with(ctx, *o, in->dout);
    dg_tape_reset();
    return st;
}

static void test_kda_replay(dg_ctx *ctx, dg_dtype dt) {
    const char *dn = dg_dtype_name(dt);
    char what[128];
    kda_in x = make_inputs(ctx, dt, 100);
    /* warm-up: uploads the chunk tables and fills the cache; then release what it returned */
    dg_tensor *o = NULL;
    DG_TEST_TRY(kda_step(ctx, &x, &o));
    dg_tensor_free(&o);
    for (int i = 0; i < NIN; i++)
        dg_tensor_zero_grad(x.t[i]);
    DG_TEST_TRY(dg_ctx_sync(ctx));

    const size_t reserved0 = dg_ctx_mem_stats(ctx).reserved;
    dg_graph *g = NULL;
    DG_TEST_TRY(dg_graph_begin(ctx));
    dg_check(dg_graph_capturing(ctx), "%s: the context is capturing after dg_graph_begin", dn);
    dg_status st = kda_step(ctx, &x, &o);
    dg_status se = dg_graph_end(ctx, &g);
    snprintf(what, sizeof what, "%s: capture KDA forward + backward", dn);
    dg_check_ok(st, what);
    snprintf(what, sizeof what, "%s: dg_graph_end", dn);
    if (!dg_check_ok(se, what) || st != DG_OK) {
        dg_tensor_free(&o);
        dg_graph_free(&g);
        free_inputs(&x);
        return;
    }
    dg_check(dg_ctx_mem_stats(ctx).reserved == reserved0,
             "%s: the capture allocated no device memory (reserved %zu -> %zu)", dn, reserved0,
             dg_ctx_mem_stats(ctx).reserved);

    double *o_prev = NULL;
    for (int round = 1; round <= 2; round++) {
        kda_in n = make_inputs(ctx, dt, 1000 * (uint64_t)round);
        for (int i = 0; i < NIN; i++)
            DG_TEST_TRY(dg_tensor_copy_(x.t[i], n.t[i]));
        DG_TEST_TRY(dg_tensor_copy_(x.dout, n.dout));
        DG_TEST_TRY(dg_graph_launch(ctx, g));
        dg_tensor *o_ref = NULL;
        DG_TEST_TRY(kda_step(ctx, &n, &o_ref));

        snprintf(what, sizeof what, "%s round %d: o", dn, round);
        same_bits(what, o, o_ref);
        for (int i = 0; i < NIN; i++) {
            snprintf(what, sizeof what, "%s round %d: d%s", dn, round, in_names[i]);
            same_bits(what, dg_tensor_grad(x.t[i]), dg_tensor_grad(n.t[i]));
            if (round == 1 && dg_tensor_grad(x.t[i])) {
                double m = max_abs(dg_tensor_grad(x.t[i]));
                dg_check(isfinite(m) && m > 0, "%s: d%s is finite and non-zero (max %.3e)", dn,
                         in_names[i], m);
            }
        }
        if (round == 1) {
            double m = max_abs(o);
            dg_check(isfinite(m) && m > 0, "%s: o is finite and non-zero (max %.3e)", dn, m);
        }
        double *oh = NULL;
        DG_TEST_TRY(dg_tensor_to_f64(o, &oh));
        if (o_prev) {
            int differs = 0;
            for (int64_t i = 0; i < dg_tensor_numel(o) && !differs; i++)
                differs = oh[i] != o_prev[i];
            dg_check(differs, "%s: the second replay computed from the new values (o changed)", dn);
        }
        free(o_prev);
        o_prev = oh;
        dg_tensor_free(&o_ref);
        free_inputs(&n);
    }
    free(o_prev);

    /* the memory rule: o's block stays the graph's after o is freed */
    const void *o_ptr = dg_tensor_data(o);
    const size_t o_bytes = dg_tensor_nbytes(o);
    const size_t kept0 = dg_ctx_mem_stats(ctx).graph;
    dg_tensor_free(&o);
    dg_check(dg_ctx_mem_stats(ctx).graph >= kept0 + o_bytes,
             "%s: a freed output of the capture is kept for the graph (kept %zu -> %zu bytes)", dn,
             kept0, dg_ctx_mem_stats(ctx).graph);
    const int64_t sv[4] = {KB, KT, KH, KV};
    dg_tensor *z = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, dt, 4, sv, &z));
    dg_check(dg_tensor_data(z) != o_ptr,
             "%s: a tensor made after the capture does not get the graph's block", dn);
    DG_TEST_TRY(dg_tensor_fill_(z, 7.0));
    DG_TEST_TRY(dg_graph_launch(ctx, g));
    double *zh = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(z, &zh));
    int intact = 1;
    for (int64_t i = 0; i < dg_tensor_numel(z); i++)
        intact &= zh[i] == 7.0;
    free(zh);
    dg_check(intact, "%s: a replay leaves a tensor made after the capture alone", dn);
    dg_tensor_free(&z);

    dg_graph_free(&g);
    dg_check(g == NULL && dg_ctx_mem_stats(ctx).graph == 0,
             "%s: dg_graph_free returns the graph's blocks to the cache (kept %zu bytes)", dn,
             dg_ctx_mem_stats(ctx).graph);
    /* gradients made by the capture: ordinary blocks now, back to the cache when freed */
    size_t grad_bytes = 0;
    for (int i = 0; i < NIN; i++)
        grad_bytes += dg_tensor_grad(x.t[i]) ? dg_tensor_nbytes(dg_tensor_grad(x.t[i])) : 0;
    const size_t cached0 = dg_ctx_mem_stats(ctx).cached;
    for (int i = 0; i < NIN; i++)
        dg_tensor_zero_grad(x.t[i]);
    dg_check(dg_ctx_mem_stats(ctx).graph == 0 &&
                 dg_ctx_mem_stats(ctx).cached >= cached0 + grad_bytes,
             "%s: the capture's gradients (%zu bytes) go to the cache when freed after "
             "dg_graph_free (cached %zu -> %zu)",
             dn, grad_bytes, cached0, dg_ctx_mem_stats(ctx).cached);
    free_inputs(&x);
}

/* ---- errors --------------------------------------------------------------------------------- */

static int all_equal(const dg_tensor *t, double v) {
    double *h = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(t, &h));
    int ok = 1;
    for (int64_t i = 0; i < dg_tensor_numel(t); i++)
        ok &= h[i] == v;
    free(h);
    return ok;
}

static void test_errors(void) {
    dg_ctx *ctx = NULL; /* a fresh context: an empty cache and no tables */
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &ctx));
    dg_graph *g = NULL;
    dg_check_err(dg_graph_end(ctx, &g), DG_ERR_STATE, "is not capturing",
                 "dg_graph_end without dg_graph_begin");

    const int64_t s8[1] = {8};
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, DG_F32, 1, s8, &t));
    DG_TEST_TRY(dg_tensor_fill_(t, 1.0));
    DG_TEST_TRY(dg_ctx_sync(ctx));

    /* refused calls leave the capture intact; captured work runs at launch only */
    DG_TEST_TRY(dg_graph_begin(ctx));
    dg_check_err(dg_graph_begin(ctx), DG_ERR_STATE, "already capturing", "a second dg_graph_begin");
    float h[8];
    dg_check_err(dg_tensor_to_host(t, h, sizeof h), DG_ERR_STATE, "capturing a CUDA graph",
                 "dg_tensor_to_host during a capture");
    double *hd = NULL;
    dg_check_err(dg_tensor_to_f64(t, &hd), DG_ERR_STATE, "capturing a CUDA graph",
                 "dg_tensor_to_f64 during a capture");
    free(hd);
    dg_check_err(dg_ctx_sync(ctx), DG_ERR_STATE, "capturing a CUDA graph",
                 "dg_ctx_sync during a capture");
    dg_check_err(dg_ctx_check_errors(ctx), DG_ERR_STATE, "dg_ctx_defer_checks",
                 "dg_ctx_check_errors during a capture");
    dg_tensor *up = NULL;
    const float hv[8] = {0};
    dg_check_err(dg_tensor_from_host(ctx, DG_F32, 1, s8, hv, &up), DG_ERR_STATE,
                 "a copy from host memory", "dg_tensor_from_host during a capture");
    DG_TEST_TRY(dg_tensor_fill_(t, 3.0));
    dg_check_ok(dg_graph_end(ctx, &g), "dg_graph_end after refused calls (capture not failed)");
    dg_check(!dg_graph_capturing(ctx), "not capturing after dg_graph_end");
    dg_check(all_equal(t, 1.0), "a captured fill did not run before a launch");
    if (g) {
        DG_TEST_TRY(dg_graph_launch(ctx, g));
        dg_check(all_equal(t, 3.0), "the launch ran the captured fill");
        /* a launch while capturing is refused */
        DG_TEST_TRY(dg_graph_begin(ctx));
        dg_check_err(dg_graph_launch(ctx, g), DG_ERR_STATE, "is capturing a graph",
                     "dg_graph_launch during a capture");
        dg_graph *g2 = NULL;
        dg_check_ok(dg_graph_end(ctx, &g2), "an empty capture");
        dg_graph_free(&g2);
    }
    dg_graph_free(&g);

    /* an allocation the cache cannot serve fails the capture; the context goes on */
    const int64_t big[1] = {1310721}; /* 5 MiB + 4 bytes: a size class nothing here used */
    dg_tensor *b = NULL;
    const size_t reserved0 = dg_ctx_mem_stats(ctx).reserved;
    DG_TEST_TRY(dg_graph_begin(ctx));
    dg_check_err(dg_tensor_new(ctx, DG_F32, 1, big, &b), DG_ERR_STATE,
                 "during graph capture missed the cache: run the step once eagerly first",
                 "an allocation that misses the cache during a capture");
    DG_TEST_TRY(dg_tensor_fill_(t, 5.0)); /* recorded into the failed capture, never run */
    dg_check_err(dg_graph_end(ctx, &g), DG_ERR_STATE, "missed the cache",
                 "dg_graph_end reports the failed capture");
    dg_check(g == NULL && !dg_graph_capturing(ctx), "a failed capture leaves no graph");
    dg_check(dg_ctx_mem_stats(ctx).reserved == reserved0,
             "no cudaMalloc during the capture (reserved %zu -> %zu)", reserved0,
             dg_ctx_mem_stats(ctx).reserved);
    dg_check_ok(dg_tensor_new(ctx, DG_F32, 1, big, &b), "the same allocation eagerly afterwards");
    if (b) {
        DG_TEST_TRY(dg_tensor_fill_(b, 2.0));
        dg_check(all_equal(b, 2.0), "the context computes eagerly after a failed capture");
    }
    dg_check(all_equal(t, 3.0), "the discarded capture's fill never ran");
    dg_tensor_free(&b);

    /* a KDA call whose chunk tables the context never uploaded cannot be captured */
    const int64_t sq[4] = {1, 40, 1, 16}, sb[3] = {1, 40, 1};
    dg_tensor *q = dg_test_rand(ctx, DG_F32, 4, sq, 1, -0.2, 0.2);
    dg_tensor *k = dg_test_rand(ctx, DG_F32, 4, sq, 2, -0.2, 0.2);
    dg_tensor *v = dg_test_rand(ctx, DG_F32, 4, sq, 3, -1, 1);
    dg_tensor *gg = dg_test_rand(ctx, DG_F32, 4, sq, 4, -0.5, -0.01);
    dg_tensor *beta = dg_test_rand(ctx, DG_F32, 3, sb, 5, 0.1, 0.9);
    dg_tensor *o = NULL;
    DG_TEST_TRY(dg_graph_begin(ctx));
    dg_check_err(dg_kda_chunk(ctx, q, k, v, gg, beta, NULL, NULL, NULL, NULL, &o, NULL),
                 DG_ERR_STATE, "cannot be uploaded during graph capture",
                 "a KDA call with tables never uploaded, during a capture");
    dg_check_err(dg_graph_end(ctx, &g), DG_ERR_STATE, "run the step once eagerly first",
                 "dg_graph_end reports the missing tables");
    dg_check_ok(dg_kda_chunk(ctx, q, k, v, gg, beta, NULL, NULL, NULL, NULL, &o, NULL),
                "the same KDA call eagerly afterwards");
    if (o)
        dg_check(isfinite(max_abs(o)), "its output is finite");
    dg_tensor *ts[] = {q, k, v, gg, beta, o, t};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        dg_tensor_free(&ts[i]);
    dg_ctx_free(&ctx);
}

/* ---- the deferred bad-input record ---------------------------------------------------------- */

static void test_deferred_record(void) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &ctx));
    const int64_t sw[2] = {10, 4}, si[1] = {3};
    const int32_t good[3] = {1, 2, 3}, bad[3] = {1, 12, 3};
    dg_tensor *w = dg_test_rand(ctx, DG_F32, 2, sw, 9, -1, 1);
    dg_tensor *ids = NULL, *ids_good = NULL, *ids_bad = NULL, *y = NULL;
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 1, si, good, &ids));
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 1, si, good, &ids_good));
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 1, si, bad, &ids_bad));

    /* checks on the spot need a sync: refused during a capture, which goes on */
    DG_TEST_TRY(dg_embedding(ctx, w, ids, &y));
    dg_tensor_free(&y);
    dg_graph *g = NULL;
    DG_TEST_TRY(dg_graph_begin(ctx));
    dg_check_err(dg_embedding(ctx, w, ids, &y), DG_ERR_STATE, "dg_ctx_defer_checks",
                 "an embedding that checks its ids at once, during a capture");
    dg_check_ok(dg_graph_end(ctx, &g), "dg_graph_end after the refused check");
    dg_graph_free(&g);

    /* deferred: a replay that meets a bad id records it; dg_ctx_check_errors reports it */
    dg_ctx_defer_checks(ctx, 1);
    DG_TEST_TRY(dg_embedding(ctx, w, ids, &y));
    dg_tensor_free(&y);
    DG_TEST_TRY(dg_ctx_check_errors(ctx));
    DG_TEST_TRY(dg_graph_begin(ctx));
    dg_status st = dg_embedding(ctx, w, ids, &y);
    dg_check_ok(st, "a deferred-check embedding during a capture");
    if (!dg_check_ok(dg_graph_end(ctx, &g), "dg_graph_end of the embedding") || st != DG_OK) {
        dg_tensor_free(&y);
        dg_graph_free(&g);
    } else {
        DG_TEST_TRY(dg_tensor_copy_(ids, ids_bad));
        DG_TEST_TRY(dg_graph_launch(ctx, g));
        dg_check_err(dg_ctx_check_errors(ctx), DG_ERR_ARG, "= 12 is outside [0, 10)",
                     "dg_ctx_check_errors after a replay with a bad id");
        DG_TEST_TRY(dg_tensor_copy_(ids, ids_good));
        DG_TEST_TRY(dg_graph_launch(ctx, g));
        dg_check_ok(dg_ctx_check_errors(ctx), "dg_ctx_check_errors after a replay with good ids");
        double *yh = NULL, *wh = NULL;
        DG_TEST_TRY(dg_tensor_to_f64(y, &yh));
        DG_TEST_TRY(dg_tensor_to_f64(w, &wh));
        int ok = 1;
        for (int r = 0; r < 3; r++)
            for (int c = 0; c < 4; c++)
                ok &= yh[r * 4 + c] == wh[good[r] * 4 + c];
        dg_check(ok, "the replayed embedding gathered rows 1, 2, 3");
        free(yh);
        free(wh);
        dg_tensor_free(&y);
        dg_graph_free(&g);
    }
    dg_tensor *ts[] = {w, ids, ids_good, ids_bad};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        dg_tensor_free(&ts[i]);
    dg_ctx_free(&ctx);
}

#endif /* DG_HAVE_CUDA */

static void gpu_cases(dg_ctx *cpu) {
#ifdef DG_HAVE_CUDA
    test_cpu_refused();
    test_errors();
    test_deferred_record();
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &ctx));
    test_kda_replay(ctx, DG_BF16);
    test_kda_replay(ctx, DG_F32);
    dg_ctx_free(&ctx);
#endif
}

static void cpu_cases(dg_ctx *cpu) { test_cpu_refused(); }

int main(int argc, char **argv) { return dg_test_main(argc, argv, "graph", cpu_cases, gpu_cases); }

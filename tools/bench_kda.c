/*
 * tools/bench_kda.c -- `deltagrad bench kda`: chunked KDA forward and forward+backward times on a
 * GPU at the reference shapes, peak device memory under CACHE and RECOMPUTE, and each time's ratio
 * to the compute and memory floors.
 *
 * Floors (METHOD: the larger of the two bounds no implementation beats by much):
 *   compute floor = FLOP (kda.md §11.9 dense-tile counts) / measured bf16 GEMM rate (dg_matmul);
 *   memory floor  = bytes that must move (inputs read once, outputs written once) / measured
 *                   device copy bandwidth.
 * Both peaks are measured in the same run, so the ratios compare like with like.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (bench_util.h) */
#include "deltagrad.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/args.h"
#include "tools/cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(expr)                                                                                \
    do {                                                                                           \
        dg_status s__ = (expr);                                                                    \
        if (s__ != DG_OK) {                                                                        \
            fprintf(stderr, "bench kda: %s failed: %s\n", #expr, dg_last_error());                 \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

typedef struct {
    int B, T, H, K;
} shape_t;

typedef struct {
    double fwd_ms, fb_ms, fb_cache_ms; /* fwd+bwd: default policy, everything cached */
    size_t peak_cache, peak_recompute;
} result_t;

/* g: the reference's benchmark gate (log sigmoid of a standard normal, values in (-inf, 0), mean
 * about -0.8: strong decay), or uniform in [-0.2, -0.001] (mild decay). */
typedef enum { GATE_REF = 0, GATE_UNIFORM } gate_mode;

static int fill_gate(dg_ctx *ctx, dg_tensor *g, gate_mode gm) {
    if (gm == GATE_UNIFORM) {
        CHECK(dg_tensor_rand_uniform(g, 14, -0.2, -0.001));
        return 0;
    }
    dg_tensor *x = NULL, *s = NULL, *l = NULL;
    CHECK(dg_tensor_new(ctx, DG_F32, dg_tensor_ndim(g), dg_tensor_shape(g), &x));
    CHECK(dg_tensor_rand_normal(x, 14, 0, 1));
    dg_no_grad_begin();
    dg_status st = dg_sigmoid(ctx, x, &s);
    if (st == DG_OK)
        st = dg_log(ctx, s, &l);
    if (st == DG_OK)
        st = dg_tensor_copy_(g, l);
    dg_no_grad_end();
    dg_tensor_free(&x);
    dg_tensor_free(&s);
    dg_tensor_free(&l);
    CHECK(st);
    return 0;
}

static int run_shape(dg_ctx *ctx, shape_t s, int reps, dg_dtype dt, gate_mode gm, dg_kda_tc tc,
                     int profile, result_t *r) {
    int64_t sq[4] = {s.B, s.T, s.H, s.K}, sb[3] = {s.B, s.T, s.H};
    dg_tensor *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *dO = NULL;
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &q));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &k));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &v));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &g));
    CHECK(dg_tensor_new(ctx, dt, 3, sb, &beta));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &dO));
    CHECK(dg_tensor_rand_normal(q, 11, 0, 1));
    CHECK(dg_tensor_rand_normal(k, 12, 0, 1));
    CHECK(dg_tensor_rand_normal(v, 13, 0, 1));
    if (fill_gate(ctx, g, gm) != 0)
        return -1;
    CHECK(dg_tensor_rand_uniform(beta, 15, 0.05, 0.95));
    CHECK(dg_tensor_rand_normal(dO, 16, 0, 1));
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = 64;
    o.l2norm_qk = 1;
    o.tensor_cores = tc;
    double t[64];
    dg_tensor *out = NULL;

    /* forward only */
    dg_no_grad_begin();
    for (int i = -2; i < reps; i++) {
        CHECK(dg_ctx_sync(ctx));
        double t0 = dg_bench_now_s();
        CHECK(dg_kda_chunk(ctx, q, k, v, g, beta, NULL, NULL, NULL, &o, &out, NULL));
        CHECK(dg_ctx_sync(ctx));
        if (i >= 0)
            t[i] = dg_bench_now_s() - t0;
        dg_tensor_free(&out);
    }
    dg_no_grad_end();
    r->fwd_ms = 1e3 * dg_bench_median(t, reps);

    /* forward + backward under both policies, reps runs each (the default policy last) */
    dg_tensor *leaves[5] = {q, k, v, g, beta};
    for (int i = 0; i < 5; i++)
        dg_tensor_set_requires_grad(leaves[i], 1);
    for (int pol = 0; pol < 2; pol++) {
        dg_policy_set_global(pol == 0 ? DG_POLICY_CACHE : DG_POLICY_DEFAULT);
        int n = reps;
        for (int i = -2; i < n; i++) {
            for (int j = 0; j < 5; j++)
                dg_tensor_zero_grad(leaves[j]);
            CHECK(dg_ctx_sync(ctx));
            dg_ctx_reset_peak(ctx);
            double t0 = dg_bench_now_s();
            CHECK(dg_kda_chunk(ctx, q, k, v, g, beta, NULL, NULL, NULL, &o, &out, NULL));
            CHECK(dg_tape_backward_with(ctx, out, dO));
            CHECK(dg_ctx_sync(ctx));
            if (i >= 0)
                t[i] = dg_bench_now_s() - t0;
            size_t peak = dg_ctx_mem_stats(ctx).peak_in_use;
            if (pol == 0)
                r->peak_cache = peak;
            else
                r->peak_recompute = peak;
            dg_tape_reset();
            dg_tensor_free(&out);
        }
        if (pol == 1)
            r->fb_ms = 1e3 * dg_bench_median(t, reps);
        else
            r->fb_cache_ms = 1e3 * dg_bench_median(t, reps);
    }
    dg_policy_set_global(DG_POLICY_DEFAULT);
    if (profile) {
        /* one more fwd+bwd with the tape timing every node (it synchronises at each boundary) */
        for (int j = 0; j < 5; j++)
            dg_tensor_zero_grad(leaves[j]);
        dg_profile_reset();
        dg_profile_enable(1);
        dg_ctx_reset_peak(ctx); /* the profile names the node that reaches this run's peak */
        dg_profile_mark(ctx);
        CHECK(dg_kda_chunk(ctx, q, k, v, g, beta, NULL, NULL, NULL, &o, &out, NULL));
        CHECK(dg_tape_backward_with(ctx, out, dO));
        CHECK(dg_ctx_sync(ctx));
        dg_profile_enable(0);
        dg_tape_reset();
        dg_tensor_free(&out);
        printf("per-stage time of one fwd+bwd (default policy, synchronised at every node):\n");
        dg_profile_dump(stdout);
    }
    for (int j = 0; j < 5; j++)
        dg_tensor_zero_grad(leaves[j]);
    dg_tensor *all[] = {q, k, v, g, beta, dO};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    return 0;
}

static void kda_help(FILE *f) {
    fprintf(
        f,
        "usage: deltagrad bench kda [--reps N (1..64)] [--dtype bf16|f32] [--g-dist ref|uniform]\n"
        "                          [--shape B,T,H,K]... [--tc default|off|3xtf32] [--profile]\n\n"
        "Times chunked KDA (chunk 64, in-op L2 norm) forward and forward+backward on\n"
        "CUDA device 0 at the reference shapes (B,T,H,K=V), median of N runs, with peak\n"
        "device memory under CACHE and RECOMPUTE and the ratio of each time to its\n"
        "compute and memory floors (peaks measured in the same run).\n\n"
        "  --g-dist ref      g = log(sigmoid(randn)), the reference's benchmark gate (default)\n"
        "  --g-dist uniform  g uniform in [-0.2, -0.001]\n"
        "  --shape         time only this shape (repeat for several; at most 8)\n"
        "  --tc            tensor cores for bf16: TF32 (default), off (f32 FMA), 3xtf32\n"
        "  --profile       also print the time of every tape node of one fwd+bwd\n");
}

int dg_bench_kda(int argc, char **argv) {
    int reps = 10, profile = 0, nsel = 0;
    dg_dtype dt = DG_BF16;
    gate_mode gm = GATE_REF;
    dg_kda_tc tc = DG_KDA_TC_DEFAULT;
    shape_t sel[8];
    static const dg_cli_flag flags[] = {
        {"--reps", "1..64"},    {"--dtype", "bf16 or f32"},         {"--g-dist", "ref or uniform"},
        {"--shape", "B,T,H,K"}, {"--tc", "default, off or 3xtf32"}, {"--profile", NULL},
    };
    dg_cli cli;
    dg_cli_init(&cli, "bench kda", kda_help, flags, DG_CLI_N(flags), argc, argv);
    const char *f, *v;
    int pr;
    while ((pr = dg_cli_next(&cli, &f, &v)) == DG_CLI_FLAG) {
        if (!strcmp(f, "--reps")) {
            if (dg_arg_int("--reps", v, 1, 64, &reps) != DG_OK) {
                return dg_cli_bad_arg(&cli);
            }
        } else if (!strcmp(f, "--dtype")) {
            if (dg_dtype_parse(v, &dt) != DG_OK || (dt != DG_BF16 && dt != DG_F32)) {
                return dg_cli_bad(&cli, "--dtype", "must be bf16 or f32, got '%s'", v);
            }
        } else if (!strcmp(f, "--g-dist")) {
            const char *gv = v;
            if (!strcmp(gv, "ref"))
                gm = GATE_REF;
            else if (!strcmp(gv, "uniform"))
                gm = GATE_UNIFORM;
            else {
                return dg_cli_bad(&cli, "--g-dist", "must be ref or uniform, got '%s'", gv);
            }
        } else if (!strcmp(f, "--shape")) {
            /* B,T,H,K: four comma-separated integers, each through the strict parser */
            char buf[96];
            int dim[4], nv = 0;
            snprintf(buf, sizeof buf, "%s", v);
            for (char *tok = strtok(buf, ","); tok && nv < 5; tok = strtok(NULL, ","), nv++) {
                static const char *names[4] = {"--shape B", "--shape T", "--shape H", "--shape K"};
                static const int hi[4] = {1 << 16, 1 << 24, 1 << 12, 256};
                if (nv < 4 && dg_arg_int(names[nv], tok, 1, hi[nv], &dim[nv]) != DG_OK) {
                    return dg_cli_bad_arg(&cli);
                }
            }
            if (nv != 4 || nsel == 8) {
                return dg_cli_bad(&cli, "--shape",
                                  "takes B,T,H,K (four integers; at most 8 shapes), got '%s'", v);
            }
            sel[nsel++] = (shape_t){dim[0], dim[1], dim[2], dim[3]};
        } else if (!strcmp(f, "--tc")) {
            const char *tv = v;
            if (!strcmp(tv, "default"))
                tc = DG_KDA_TC_DEFAULT;
            else if (!strcmp(tv, "off"))
                tc = DG_KDA_TC_OFF;
            else if (!strcmp(tv, "3xtf32"))
                tc = DG_KDA_TC_3XTF32;
            else {
                return dg_cli_bad(&cli, "--tc", "must be default, off or 3xtf32, got '%s'", tv);
            }
        } else if (!strcmp(f, "--profile")) {
            profile = 1;
        }
    }
    if (pr != DG_CLI_END)
        return pr;
    if (dg_cuda_device_count() < 1) {
        fprintf(stderr, "bench kda: needs a CUDA device (this build: CUDA %s, devices: %d)\n",
                dg_have_cuda() ? "yes" : "no", dg_cuda_device_count());
        return 2;
    }
    dg_ctx *ctx = NULL;
    if (dg_ctx_new(dg_cuda(0), &ctx) != DG_OK) {
        fprintf(stderr, "bench kda: %s\n", dg_last_error());
        return 1;
    }
    double flops = dg_bench_gemm_rate(ctx, 8192, 10);
    double bw = flops > 0 ? dg_bench_copy_rate(ctx, (int64_t)1 << 30, 10) : -1;
    if (flops <= 0 || bw <= 0) {
        fprintf(stderr, "bench kda: measuring the device peaks failed: %s\n", dg_last_error());
        dg_ctx_free(&ctx);
        return 1;
    }
    printf("measured peaks: bf16 GEMM 8192^3 %.1f TFLOP/s, device copy %.0f GB/s\n", flops / 1e12,
           bw / 1e9);
    static const shape_t ref_shapes[] = {{1, 8192, 96, 128}, {2, 16384, 16, 128},
                                         {4, 2048, 16, 128}, {4, 4096, 64, 128},
                                         {8, 1024, 8, 64},   {8, 2048, 32, 256}};
    const shape_t *shapes = nsel ? sel : ref_shapes;
    size_t nshapes = nsel ? (size_t)nsel : sizeof ref_shapes / sizeof *ref_shapes;
    printf("gate: %s\n",
           gm == GATE_REF ? "log(sigmoid(randn)) (the reference's)" : "uniform [-0.2, -0.001]");
    printf("\n%-20s %9s %9s %8s %8s %9s %9s %10s %10s %10s\n", "B,T,H,K=V", "fwd ms", "fwd+bwd",
           "fwd/cf", "fwd/mf", "f+b/cf", "f+b/mf", "peak recomp", "f+b cache", "peak cache");
    int rc = 0;
    for (size_t i = 0; i < nshapes; i++) {
        shape_t s = shapes[i];
        result_t r;
        memset(&r, 0, sizeof r);
        char name[64];
        snprintf(name, sizeof name, "%d,%d,%d,%d", s.B, s.T, s.H, s.K);
        if (run_shape(ctx, s, reps, dt, gm, tc, profile, &r) != 0) {
            printf("%-20s failed: %s\n", name, dg_last_error());
            rc = 1;
            dg_tape_reset();
            dg_ctx_empty_cache(ctx);
            continue;
        }
        double C = 64, K = s.K, V = s.K, tok = (double)s.B * s.T * s.H;
        double f_fwd = tok * (6 * K * V + 6 * C * K + 4 * C * V + C * C / 2);
        double f_bwd = tok * (12 * K * V + 12 * C * K + 8 * C * V + 4 * C * C) +
                       tok * (4 * K * V + 2 * C * K + 2 * C * V);
        double es = dg_dtype_size(dt);
        /* fwd: q k v g beta read, o written (all in the activation dtype). bwd adds dO read and
         * dq dk dv dg dbeta written. */
        double b_fwd = tok * (4 * K + 1) * es + tok * V * es;
        double b_bwd = b_fwd + tok * V * es + tok * (4 * K + 1) * es;
        double cf_f = f_fwd / flops * 1e3, mf_f = b_fwd / bw * 1e3;
        double cf_b = (f_fwd + f_bwd) / flops * 1e3, mf_b = b_bwd / bw * 1e3;
        printf("%-20s %9.3f %9.3f %8.1f %8.1f %9.1f %9.1f %9.2f G %10.3f %8.2f G\n", name, r.fwd_ms,
               r.fb_ms, r.fwd_ms / cf_f, r.fwd_ms / mf_f, r.fb_ms / cf_b, r.fb_ms / mf_b,
               r.peak_recompute / 1073741824.0, r.fb_cache_ms, r.peak_cache / 1073741824.0);
        dg_ctx_empty_cache(ctx);
    }
    printf(
        "\ncf = compute floor (kda.md §11.9 FLOP / GEMM rate), mf = memory floor (bytes\n"
        "that must move / measured copy bandwidth); the ratios say how far each time is from\n"
        "the bound. fwd+bwd and peak recomp: the default policy; f+b cache and peak cache: every\n"
        "node caching (dg_policy_set_global(DG_POLICY_CACHE)). Peak = device memory high-water\n"
        "mark of one fwd+bwd (inputs included).\n");
    dg_ctx_free(&ctx);
    return rc;
}

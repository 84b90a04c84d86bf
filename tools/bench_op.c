/* tools/bench_op.c -- see bench_op.h. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (bench_util.h) */
#include "tools/bench_op.h"

#include "tools/args.h"
#include "tools/bench_util.h"

#include <stdio.h>
#include <string.h>

#define CHECK(expr) DG_BENCH_TRY(who, expr)

int dg_bench_open(const char *who, dg_ctx **ctx, double *flops, double *bw) {
    *ctx = NULL;
    if (dg_cuda_device_count() < 1) {
        fprintf(stderr, "%s: needs a CUDA device (this build: CUDA %s, devices: %d)\n", who,
                dg_have_cuda() ? "yes" : "no", dg_cuda_device_count());
        return 2;
    }
    if (dg_ctx_new(dg_cuda(0), ctx) != DG_OK) {
        fprintf(stderr, "%s: %s\n", who, dg_last_error());
        return 1;
    }
    *flops = dg_bench_gemm_rate(*ctx, 8192, 10);
    *bw = *flops > 0 ? dg_bench_copy_rate(*ctx, (int64_t)1 << 30, 10) : -1;
    if (*flops <= 0 || *bw <= 0) {
        fprintf(stderr, "%s: measuring the device peaks failed: %s\n", who, dg_last_error());
        dg_ctx_free(ctx);
        return 1;
    }
    printf("measured peaks: bf16 GEMM 8192^3 %.1f TFLOP/s, device copy %.0f GB/s\n", *flops / 1e12,
           *bw / 1e9);
    return 0;
}

static void zero_grads(dg_tensor *const *leaves, int n) {
    for (int j = 0; j < n; j++)
        dg_tensor_zero_grad(leaves[j]);
}

int dg_bench_time_op(dg_ctx *ctx, const char *who, dg_bench_fwd_fn fwd, const void *user,
                     dg_tensor *const *leaves, int nleaves, const dg_tensor *dO, int reps,
                     int profile, dg_bench_result *r) {
    double t[64];
    dg_tensor *out = NULL;
    if (reps > 64)
        reps = 64;

    /* forward only */
    dg_no_grad_begin();
    for (int i = -2; i < reps; i++) {
        CHECK(dg_ctx_sync(ctx));
        double t0 = dg_bench_now_s();
        CHECK(fwd(ctx, user, &out));
        CHECK(dg_ctx_sync(ctx));
        if (i >= 0)
            t[i] = dg_bench_now_s() - t0;
        dg_tensor_free(&out);
    }
    dg_no_grad_end();
    r->fwd_ms = 1e3 * dg_bench_median(t, reps);

    /* forward + backward under both policies, reps runs each (the default policy last) */
    for (int i = 0; i < nleaves; i++)
        dg_tensor_set_requires_grad(leaves[i], 1);
    for (int pol = 0; pol < 2; pol++) {
        dg_policy_set_global(pol == 0 ? DG_POLICY_CACHE : DG_POLICY_DEFAULT);
        for (int i = -2; i < reps; i++) {
            zero_grads(leaves, nleaves);
            CHECK(dg_ctx_sync(ctx));
            dg_ctx_reset_peak(ctx);
            double t0 = dg_bench_now_s();
            CHECK(fwd(ctx, user, &out));
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
        zero_grads(leaves, nleaves);
        dg_profile_reset();
        dg_profile_enable(1);
        dg_ctx_reset_peak(ctx); /* the profile names the node that reaches this run's peak */
        dg_profile_mark(ctx);
        CHECK(fwd(ctx, user, &out));
        CHECK(dg_tape_backward_with(ctx, out, dO));
        CHECK(dg_ctx_sync(ctx));
        dg_profile_enable(0);
        dg_tape_reset();
        dg_tensor_free(&out);
        printf("per-stage time of one fwd+bwd (default policy, synchronised at every node):\n");
        dg_profile_dump(stdout);
    }
    zero_grads(leaves, nleaves);
    return 0;
}

int dg_bench_shapes(dg_ctx *ctx, const dg_bench_shape *sel, int nsel, dg_bench_shape_fn run,
                    const void *user, double flops, double bw) {
    static const dg_bench_shape ref_shapes[] = {{1, 8192, 96, 128}, {2, 16384, 16, 128},
                                                {4, 2048, 16, 128}, {4, 4096, 64, 128},
                                                {8, 1024, 8, 64},   {8, 2048, 32, 256}};
    const dg_bench_shape *shapes = nsel ? sel : ref_shapes;
    const size_t nshapes = nsel ? (size_t)nsel : sizeof ref_shapes / sizeof *ref_shapes;
    printf("\n%-20s %9s %9s %8s %8s %9s %9s %10s %10s %10s\n", "B,T,H,K=V", "fwd ms", "fwd+bwd",
           "fwd/cf", "fwd/mf", "f+b/cf", "f+b/mf", "peak recomp", "f+b cache", "peak cache");
    int rc = 0;
    for (size_t i = 0; i < nshapes; i++) {
        const dg_bench_shape s = shapes[i];
        dg_bench_result r;
        dg_bench_work w;
        memset(&r, 0, sizeof r);
        memset(&w, 0, sizeof w);
        char name[64];
        snprintf(name, sizeof name, "%d,%d,%d,%d", s.B, s.T, s.H, s.K);
        if (run(ctx, s, user, &r, &w) != 0) {
            printf("%-20s failed: %s\n", name, dg_last_error());
            rc = 1;
            dg_tape_reset();
            dg_ctx_empty_cache(ctx);
            continue;
        }
        /* the floors in ms: compute (FLOP / GEMM rate) and memory (bytes / copy bandwidth) */
        const double cf_f = w.flop_fwd / flops * 1e3, mf_f = w.bytes_fwd / bw * 1e3;
        const double cf_b = w.flop_fb / flops * 1e3, mf_b = w.bytes_fb / bw * 1e3;
        printf("%-20s %9.3f %9.3f %8.1f %8.1f %9.1f %9.1f %9.3f G %10.3f %8.3f G\n", name, r.fwd_ms,
               r.fb_ms, r.fwd_ms / cf_f, r.fwd_ms / mf_f, r.fb_ms / cf_b, r.fb_ms / mf_b,
               r.peak_recompute / 1073741824.0, r.fb_cache_ms, r.peak_cache / 1073741824.0);
        dg_ctx_empty_cache(ctx);
    }
    return rc;
}

int dg_bench_opt(const dg_cli *cli, const char *f, const char *v, dg_bench_opts *o) {
    if (!strcmp(f, "--reps"))
        return dg_arg_int("--reps", v, 1, 64, &o->reps) != DG_OK ? dg_cli_bad_arg(cli) : 0;
    if (!strcmp(f, "--dtype")) {
        if (dg_dtype_parse(v, &o->dt) != DG_OK || (o->dt != DG_BF16 && o->dt != DG_F32))
            return dg_cli_bad(cli, "--dtype", "must be bf16 or f32, got '%s'", v);
        return 0;
    }
    if (!strcmp(f, "--profile")) {
        o->profile = 1;
        return 0;
    }
    if (strcmp(f, "--shape"))
        return -1;
    /* B,T,H,K: four comma-separated integers, each through the strict parser */
    char buf[96];
    int dim[4], nv = 0;
    snprintf(buf, sizeof buf, "%s", v);
    for (char *tok = strtok(buf, ","); tok && nv < 5; tok = strtok(NULL, ","), nv++) {
        static const char *names[4] = {"--shape B", "--shape T", "--shape H", "--shape K"};
        static const int hi[4] = {1 << 16, 1 << 24, 1 << 12, 256};
        if (nv < 4 && dg_arg_int(names[nv], tok, 1, hi[nv], &dim[nv]) != DG_OK)
            return dg_cli_bad_arg(cli);
    }
    if (nv != 4 || o->nsel == 8)
        return dg_cli_bad(cli, "--shape",
                          "takes B,T,H,K (four integers; at most 8 shapes), got '%s'", v);
    o->sel[o->nsel++] = (dg_bench_shape){dim[0], dim[1], dim[2], dim[3]};
    return 0;
}

/* words[i] into *w->out, or 2 after naming the words ("a, b or c"). */
static int word_flag(const dg_cli *cli, const dg_bench_word *w, const char *v) {
    char list[256] = "";
    for (int i = 0; i < w->n; i++) {
        if (!strcmp(v, w->words[i])) {
            *w->out = i;
            return 0;
        }
        size_t l = strlen(list);
        snprintf(list + l, sizeof list - l, "%s%s",
                 i == 0          ? ""
                 : i == w->n - 1 ? " or "
                                 : ", ",
                 w->words[i]);
    }
    return dg_cli_bad(cli, w->flag, "must be %s, got '%s'", list, v);
}

int dg_bench_parse(const char *who, void (*help)(FILE *f), const dg_cli_flag *flags, int nflags,
                   int argc, char **argv, dg_bench_opts *o, const dg_bench_word *words, int nwords,
                   int *chunk) {
    static const int chunks[3] = {16, 32, 64};
    dg_cli cli;
    dg_cli_init(&cli, who, help, flags, nflags, argc, argv);
    const char *f, *v;
    int pr;
    while ((pr = dg_cli_next(&cli, &f, &v)) == DG_CLI_FLAG) {
        int rc = dg_bench_opt(&cli, f, v, o);
        if (rc < 0 && chunk && !strcmp(f, "--chunk-size"))
            rc = dg_arg_choice("--chunk-size", v, chunks, 3, chunk) != DG_OK ? dg_cli_bad_arg(&cli)
                                                                             : 0;
        for (int i = 0; rc < 0 && i < nwords; i++)
            if (!strcmp(f, words[i].flag))
                rc = word_flag(&cli, &words[i], v);
        if (rc > 0)
            return rc;
    }
    return pr;
}

int dg_bench_main(const char *who, const char *header, const dg_bench_opts *o,
                  dg_bench_shape_fn run, const void *user, const char *notes) {
    dg_ctx *ctx = NULL;
    double flops = 0, bw = 0;
    int rc = dg_bench_open(who, &ctx, &flops, &bw);
    if (rc != 0)
        return rc;
    fputs(header, stdout);
    rc = dg_bench_shapes(ctx, o->sel, o->nsel, run, user, flops, bw);
    fputs(notes, stdout);
    dg_ctx_free(&ctx);
    return rc;
}

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
#include "tools/bench_op.h"
#include "tools/commands.h"
#include "tools/args.h"
#include "tools/cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(expr) DG_BENCH_TRY("bench kda", expr)

typedef dg_bench_shape shape_t;

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

/* What one run of the bench keeps fixed (the options). */
typedef struct {
    int reps, profile;
    dg_dtype dt;
    gate_mode gm;
    dg_kda_tc tc;
} kda_bench;

/* The timed op's inputs and options. */
typedef struct {
    dg_tensor *q, *k, *v, *g, *beta;
    dg_kda_opts o;
} kda_call;

static dg_status kda_fwd(dg_ctx *ctx, const void *user, dg_tensor **out) {
    const kda_call *c = user;
    return dg_kda_chunk(ctx, c->q, c->k, c->v, c->g, c->beta, NULL, NULL, NULL, &c->o, out, NULL);
}

static int run_shape(dg_ctx *ctx, shape_t s, const void *user, dg_bench_result *r,
                     dg_bench_work *w) {
    const kda_bench *kb = user;
    const dg_dtype dt = kb->dt;
    int64_t sq[4] = {s.B, s.T, s.H, s.K}, sb[3] = {s.B, s.T, s.H};
    kda_call c;
    memset(&c, 0, sizeof c);
    dg_tensor *dO = NULL;
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &c.q));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &c.k));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &c.v));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &c.g));
    CHECK(dg_tensor_new(ctx, dt, 3, sb, &c.beta));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &dO));
    CHECK(dg_tensor_rand_normal(c.q, 11, 0, 1));
    CHECK(dg_tensor_rand_normal(c.k, 12, 0, 1));
    CHECK(dg_tensor_rand_normal(c.v, 13, 0, 1));
    if (fill_gate(ctx, c.g, kb->gm) != 0)
        return -1;
    CHECK(dg_tensor_rand_uniform(c.beta, 15, 0.05, 0.95));
    CHECK(dg_tensor_rand_normal(dO, 16, 0, 1));
    c.o.chunk_size = 64;
    c.o.l2norm_qk = 1;
    c.o.tensor_cores = kb->tc;
    dg_tensor *leaves[5] = {c.q, c.k, c.v, c.g, c.beta};
    const int st =
        dg_bench_time_op(ctx, "bench kda", kda_fwd, &c, leaves, 5, dO, kb->reps, kb->profile, r);
    for (int i = 0; i < 5; i++)
        dg_tensor_free(&leaves[i]);
    dg_tensor_free(&dO);
    if (st != 0)
        return -1;
    const double C = 64, K = s.K, V = s.K, tok = (double)s.B * s.T * s.H;
    const double f_fwd = tok * (6 * K * V + 6 * C * K + 4 * C * V + C * C / 2);
    const double f_bwd = tok * (12 * K * V + 12 * C * K + 8 * C * V + 4 * C * C) +
                         tok * (4 * K * V + 2 * C * K + 2 * C * V);
    const double es = dg_dtype_size(dt);
    /* fwd: q k v g beta read, o written (all in the activation dtype). bwd adds dO read and
     * dq dk dv dg dbeta written. */
    w->flop_fwd = f_fwd;
    w->flop_fb = f_fwd + f_bwd;
    w->bytes_fwd = tok * (4 * K + 1) * es + tok * V * es;
    w->bytes_fb = w->bytes_fwd + tok * V * es + tok * (4 * K + 1) * es;
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
    dg_bench_opts bo = DG_BENCH_OPTS_INIT;
    static const dg_cli_flag flags[] = {
        {"--reps", "1..64"},    {"--dtype", "bf16 or f32"},         {"--g-dist", "ref or uniform"},
        {"--shape", "B,T,H,K"}, {"--tc", "default, off or 3xtf32"}, {"--profile", NULL},
    };
    static const char *const gates[] = {"ref", "uniform"};
    static const char *const tcs[] = {"default", "off", "3xtf32"};
    int gi = GATE_REF, ti = DG_KDA_TC_DEFAULT;
    const dg_bench_word words[] = {{"--g-dist", gates, 2, &gi}, {"--tc", tcs, 3, &ti}};
    int pr = dg_bench_parse("bench kda", kda_help, flags, DG_CLI_N(flags), argc, argv, &bo, words,
                            DG_CLI_N(words), NULL);
    if (pr != DG_CLI_END)
        return pr;
    const gate_mode gm = (gate_mode)gi; /* the words are in the enums' order */
    const dg_kda_tc tc = (dg_kda_tc)ti;
    const kda_bench kb = {bo.reps, bo.profile, bo.dt, gm, tc};
    return dg_bench_main(
        "bench kda",
        gm == GATE_REF ? "gate: log(sigmoid(randn)) (the reference's)\n"
                       : "gate: uniform [-0.2, -0.001]\n",
        &bo, run_shape, &kb,
        "\ncf = compute floor (kda.md §11.9 FLOP / GEMM rate), mf = memory floor (bytes\n"
        "that must move / measured copy bandwidth); the ratios say how far each time is from\n"
        "the bound. fwd+bwd and peak recomp: the default policy; f+b cache and peak cache: every\n"
        "node caching (dg_policy_set_global(DG_POLICY_CACHE)). Peak = device memory high-water\n"
        "mark of one fwd+bwd (inputs included).\n");
}

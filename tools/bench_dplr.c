/*
 * tools/bench_dplr.c -- `deltagrad bench dplr`: chunked DPLR (dg_dplr_chunk) forward and
 * forward+backward times on a GPU at the shapes `bench kda` uses, peak device memory under CACHE
 * and RECOMPUTE, and each time's ratio to the compute and memory floors.
 *
 * Floors (as bench kda's: the larger of the two bounds no implementation beats by much):
 *   compute floor = FLOP / measured bf16 GEMM rate (dg_matmul), with the forward's dense count of
 *                   dplr.md D3 (8KV + 10CK + 6CV + 2.3C^2 per token and head) and the backward
 *                   counted as twice the forward plus the recomputed WY and state passes (each
 *                   product has two gradient products of its size);
 *   memory floor  = bytes that must move (inputs read once, outputs written once) / measured
 *                   device copy bandwidth.
 * Inputs: RWKV-7's stable form (a = -kh, b = alpha kh, kh unit-norm rows, alpha in (0.1, 0.9)),
 * gk = -e^{-1/2} sigmoid(randn) (RWKV-7's gate) or log(sigmoid(randn)) (the gate bench kda uses).
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

#define CHECK(expr) DG_BENCH_TRY("bench dplr", expr)

typedef dg_bench_shape shape_t;

typedef enum { GATE_RWKV7 = 0, GATE_REF } gate_mode;

/* The leaves q, k, v, a, b, gk [B,T,H,K] (K = V) in dtype dt, made without recording. */
static int make_inputs(dg_ctx *ctx, shape_t s, dg_dtype dt, gate_mode gm, dg_tensor **x) {
    int64_t sq[4] = {s.B, s.T, s.H, s.K};
    dg_tensor *kh0 = NULL, *kh = NULL, *al = NULL, *z = NULL, *sg = NULL;
    for (int i = 0; i < 6; i++)
        x[i] = NULL;
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &x[0]));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &x[1]));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &x[2]));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &kh0));
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &al));
    CHECK(dg_tensor_new(ctx, DG_F32, 4, sq, &z));
    CHECK(dg_tensor_rand_normal(x[0], 11, 0, 1));
    CHECK(dg_tensor_rand_normal(x[1], 12, 0, 1.0 / sqrt((double)s.K)));
    CHECK(dg_tensor_rand_normal(x[2], 13, 0, 1));
    CHECK(dg_tensor_rand_normal(kh0, 14, 0, 1));
    CHECK(dg_tensor_rand_uniform(al, 15, 0.1, 0.9));
    CHECK(dg_tensor_rand_normal(z, 16, 0, 1));
    dg_no_grad_begin();
    dg_status st = dg_kda_l2norm(ctx, kh0, &kh);
    if (st == DG_OK)
        st = dg_scale(ctx, kh, -1.0, &x[3]); /* a = -kh */
    if (st == DG_OK)
        st = dg_mul(ctx, al, kh, &x[4]); /* b = alpha kh */
    if (st == DG_OK)
        st = dg_sigmoid(ctx, z, &sg);
    dg_tensor *g = NULL;
    if (st == DG_OK)
        st = gm == GATE_RWKV7 ? dg_scale(ctx, sg, -exp(-0.5), &g) : dg_log(ctx, sg, &g);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, dt, 4, sq, &x[5]);
    if (st == DG_OK)
        st = dg_tensor_copy_(x[5], g);
    dg_no_grad_end();
    dg_tensor *tmp[6] = {kh0, kh, al, z, sg, g};
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&tmp[i]);
    CHECK(st);
    return 0;
}

/* What one run of the bench keeps fixed (the options). */
typedef struct {
    int reps, profile, chunk;
    dg_dtype dt;
    gate_mode gm;
} dplr_bench;

/* The timed op's inputs (q, k, v, a, b, gk) and options. */
typedef struct {
    dg_tensor *x[6];
    dg_dplr_opts o;
} dplr_call;

static dg_status dplr_fwd(dg_ctx *ctx, const void *user, dg_tensor **out) {
    dg_tensor *const *x = ((const dplr_call *)user)->x;
    return dg_dplr_chunk(ctx, x[0], x[1], x[2], x[3], x[4], x[5], NULL,
                         &((const dplr_call *)user)->o, out, NULL);
}

static int run_shape(dg_ctx *ctx, shape_t s, const void *user, dg_bench_result *r,
                     dg_bench_work *w) {
    const dplr_bench *db = user;
    const dg_dtype dt = db->dt;
    int64_t sq[4] = {s.B, s.T, s.H, s.K};
    dplr_call c;
    memset(&c, 0, sizeof c);
    dg_tensor *dO = NULL;
    if (make_inputs(ctx, s, dt, db->gm, c.x) != 0) {
        for (int i = 0; i < 6; i++)
            dg_tensor_free(&c.x[i]);
        return -1;
    }
    CHECK(dg_tensor_new(ctx, dt, 4, sq, &dO));
    CHECK(dg_tensor_rand_normal(dO, 17, 0, 1));
    c.o.chunk_size = db->chunk;
    const int st =
        dg_bench_time_op(ctx, "bench dplr", dplr_fwd, &c, c.x, 6, dO, db->reps, db->profile, r);
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&c.x[i]);
    dg_tensor_free(&dO);
    if (st != 0)
        return -1;
    const double C = db->chunk, K = s.K, V = s.K, tok = (double)s.B * s.T * s.H;
    const double f_fwd = tok * (8 * K * V + 10 * C * K + 6 * C * V + 2.3 * C * C);
    /* backward: twice the forward, plus the WY (2CK + 2CV + 2C^2) and state (6KV) passes
     * the default policy recomputes */
    const double f_bwd = 2 * f_fwd + tok * (6 * K * V + 2 * C * K + 2 * C * V + 2 * C * C);
    const double es = dg_dtype_size(dt);
    /* fwd: q k a b gk (K each) and v read, o written; bwd adds dO read and the six
     * gradients written */
    w->flop_fwd = f_fwd;
    w->flop_fb = f_fwd + f_bwd;
    w->bytes_fwd = tok * (5 * K + V) * es + tok * V * es;
    w->bytes_fb = w->bytes_fwd + tok * V * es + tok * (5 * K + V) * es;
    return 0;
}

static void dplr_help(FILE *f) {
    fprintf(f, "usage: deltagrad bench dplr [--reps N (1..64)] [--dtype bf16|f32] "
               "[--g-dist rwkv7|ref]\n"
               "                           [--chunk-size 16|32|64] [--shape B,T,H,K]... "
               "[--profile]\n\n"
               "Times chunked DPLR (dg_dplr_chunk, chunk 64 by default, RWKV-7's stable\n"
               "form a = -kh, b = alpha kh) forward and forward+backward on CUDA device 0 at\n"
               "the shapes of bench kda (B,T,H,K=V), median of N runs, with peak device\n"
               "memory under CACHE and RECOMPUTE and the ratio of each time to its compute\n"
               "and memory floors (peaks measured in the same run). A bf16 call runs the WY,\n"
               "state and output stages on TF32 tensor cores and the intra stage in f32 FFMA;\n"
               "an f32 call is FFMA throughout.\n\n"
               "  --g-dist rwkv7    gk = -e^{-1/2} sigmoid(randn), RWKV-7's gate (default)\n"
               "  --g-dist ref      gk = log(sigmoid(randn)), the gate bench kda uses\n"
               "  --shape         time only this shape (repeat for several; at most 8)\n"
               "  --profile       also print the time of every tape node of one fwd+bwd\n");
}

int dg_bench_dplr(int argc, char **argv) {
    dg_bench_opts bo = DG_BENCH_OPTS_INIT;
    int chunk = 64;
    static const dg_cli_flag flags[] = {
        {"--reps", "1..64"},          {"--chunk-size", "16, 32 or 64"}, {"--dtype", "bf16 or f32"},
        {"--g-dist", "rwkv7 or ref"}, {"--shape", "B,T,H,K"},           {"--profile", NULL},
    };
    static const char *const gates[] = {"rwkv7", "ref"};
    int gi = GATE_RWKV7;
    const dg_bench_word words[] = {{"--g-dist", gates, 2, &gi}};
    int pr = dg_bench_parse("bench dplr", dplr_help, flags, DG_CLI_N(flags), argc, argv, &bo, words,
                            DG_CLI_N(words), &chunk);
    if (pr != DG_CLI_END)
        return pr;
    const gate_mode gm = (gate_mode)gi; /* the words are in the enum's order */
    char header[128];
    snprintf(header, sizeof header, "gate: %s; chunk %d; dtype %s\n",
             gm == GATE_RWKV7 ? "-e^{-1/2} sigmoid(randn) (RWKV-7's)" : "log(sigmoid(randn))",
             chunk, dg_dtype_name(bo.dt));
    const dplr_bench db = {bo.reps, bo.profile, chunk, bo.dt, gm};
    return dg_bench_main(
        "bench dplr", header, &bo, run_shape, &db,
        "\ncf = compute floor (dplr.md D3 FLOP, backward 2x forward plus the recomputed\n"
        "passes, / measured bf16 GEMM rate), mf = memory floor (bytes that must move /\n"
        "measured copy bandwidth); the ratios say how far each time is from the bound (most\n"
        "intra products are f32 FFMA, so cf is not reachable yet). fwd+bwd and peak recomp: the\n"
        "default policy; f+b cache and peak cache: every node caching\n"
        "(dg_policy_set_global(DG_POLICY_CACHE)). Peak = device memory high-water mark of one\n"
        "fwd+bwd (inputs included).\n");
}

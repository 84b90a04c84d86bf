/*
 * tools/bench_cp.c -- `deltagrad bench cp`: chunked KDA forward+backward of one long sequence on
 * one rank against the same sequence split over every rank of the job (KCP, dg_kda_chunk_cp),
 * with the bytes each rank sends and the share of its time spent inside communicator calls.
 *
 *   mpirun -np N deltagrad bench cp [--T 8192] [--H 2] [--K 64] [--V 64] ...
 *
 * The one-rank time is measured on rank 0 alone (the other ranks wait at a barrier, sleeping)
 * with all of the cores' threads, the split time on every rank with cores / N threads each, so
 * both runs use the same cores. A time is the median over --reps of the slowest rank's
 * iteration. "comm" counts the seconds inside dg_comm_* calls, waiting for slower ranks
 * included: it is the price of the split, not only of the wire. --device cuda puts every rank
 * on a GPU (local rank modulo the devices) and picks the communicator with dg_comm_init_launch:
 * NCCL when every rank has a GPU of its own, else MPI with host staging (ranks sharing a GPU).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (bench_util.h), sysconf */
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
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static void set_threads(int n) {
#ifdef _OPENMP
    omp_set_dynamic(0);
    omp_set_num_threads(n > 0 ? n : 1);
#else
    (void)n;
#endif
}

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        dg_status s__ = (expr);                                                                    \
        if (s__ != DG_OK) {                                                                        \
            fprintf(stderr, "bench cp: rank %d: %s failed: %s\n", rank, #expr, dg_last_error());   \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

#define RET(expr)                                                                                  \
    do {                                                                                           \
        dg_status r__ = (expr);                                                                    \
        if (r__ != DG_OK)                                                                          \
            return r__;                                                                            \
    } while (0)

typedef struct bshape {
    int64_t T;
    int H, K, V, BT, reps, warmup;
    dg_dtype dt;
} bshape;

/* Inputs of the token range [b, e) of the sequence (the same numbers on every rank). */
typedef struct binputs {
    dg_tensor *q, *k, *v, *g, *beta, *A, *dt, *dO;
} binputs;

static void inputs_free(binputs *in) {
    dg_tensor **t = &in->q;
    for (int i = 0; i < 8; i++)
        dg_tensor_free(&t[i]);
}

/* Token rows [b, e) of a [1,T,...] random tensor: generated whole, then sliced (cheap next to the
 * benchmark, and identical on every rank). */
static dg_status make_slice(dg_ctx *ctx, dg_dtype dt, int64_t T, int64_t row, int64_t b, int64_t e,
                            uint64_t seed, double scale, int grad, dg_tensor **out) {
    dg_tensor *full = NULL;
    dg_ctx *host = NULL;
    int64_t shf[3] = {1, T, row}, shs[3] = {1, e - b, row};
    dg_status st = dg_ctx_new(dg_cpu(), &host); /* generated on the host, uploaded to ctx */
    if (st == DG_OK)
        st = dg_tensor_new(host, dt, 3, shf, &full);
    if (st == DG_OK)
        st = dg_tensor_rand_normal(full, seed, 0.0, scale);
    if (st == DG_OK)
        st = dg_tensor_from_host(
            ctx, dt, 3, shs,
            (const char *)dg_tensor_data(full) + (size_t)(b * row) * dg_dtype_size(dt), out);
    dg_tensor_free(&full);
    dg_ctx_free(&host);
    if (st == DG_OK && grad)
        dg_tensor_set_requires_grad(*out, 1);
    return st;
}

static dg_status make_inputs(dg_ctx *ctx, const bshape *s, int64_t b, int64_t e, binputs *in) {
    memset(in, 0, sizeof *in);
    const int64_t HK = (int64_t)s->H * s->K, HV = (int64_t)s->H * s->V;
    RET(make_slice(ctx, s->dt, s->T, HK, b, e, 1, 1.0, 1, &in->q));
    RET(make_slice(ctx, s->dt, s->T, HK, b, e, 2, 1.0, 1, &in->k));
    RET(make_slice(ctx, s->dt, s->T, HV, b, e, 3, 1.0, 1, &in->v));
    RET(make_slice(ctx, s->dt, s->T, HK, b, e, 4, 1.0, 1, &in->g));
    RET(make_slice(ctx, s->dt, s->T, s->H, b, e, 5, 1.0, 1, &in->beta));
    RET(make_slice(ctx, s->dt, s->T, HV, b, e, 6, 1.0, 0, &in->dO));
    const dg_dtype pdt = s->dt == DG_BF16 ? DG_F32 : s->dt; /* A_log, dt_bias: f32 on CUDA */
    RET(dg_tensor_zeros(ctx, pdt, 1, (int64_t[]){s->H}, &in->A));
    RET(dg_tensor_zeros(ctx, pdt, 1, (int64_t[]){HK}, &in->dt));
    dg_tensor_set_requires_grad(in->A, 1);
    dg_tensor_set_requires_grad(in->dt, 1);
    /* views as [1, T_r, H, K] etc. */
    dg_tensor **t[6] = {&in->q, &in->k, &in->v, &in->g, &in->beta, &in->dO};
    for (int i = 0; i < 6; i++) {
        int64_t last = i == 2 || i == 5 ? s->V : i == 4 ? 0 : s->K;
        int64_t sh[4] = {1, e - b, s->H, last};
        dg_tensor *r = NULL;
        dg_no_grad_begin();
        dg_status st = dg_reshape(*t[i], last ? 4 : 3, sh, &r);
        dg_no_grad_end();
        RET(st);
        if (i != 5)
            dg_tensor_set_requires_grad(r, 1);
        dg_tensor_free(t[i]);
        *t[i] = r;
    }
    return DG_OK;
}

/* One forward + backward; plan NULL: the unsplit op. */
static dg_status fwd_bwd(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const bshape *s,
                         binputs *in) {
    dg_kda_opts op;
    memset(&op, 0, sizeof op);
    op.chunk_size = s->BT;
    op.gate = DG_GATE_KDA;
    op.l2norm_qk = 1;
    op.beta_sigmoid = 1;
    dg_tensor *o = NULL;
    dg_status st = plan ? dg_kda_chunk_cp(ctx, comm, plan, in->q, in->k, in->v, in->g, in->beta,
                                          in->A, in->dt, NULL, &op, &o, NULL)
                        : dg_kda_chunk(ctx, in->q, in->k, in->v, in->g, in->beta, in->A, in->dt,
                                       NULL, &op, &o, NULL);
    if (st == DG_OK)
        st = dg_tape_backward_with(ctx, o, in->dO);
    if (st == DG_OK)
        st = dg_ctx_sync(ctx);
    dg_tape_reset();
    dg_tensor_free(&o);
    dg_tensor **t = &in->q;
    for (int i = 0; i < 8; i++)
        if (t[i] && dg_tensor_grad(t[i]))
            dg_tensor_zero_grad(t[i]);
    return st;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: mpirun -np N deltagrad bench cp [options]\n"
            "\n"
            "Chunked KDA forward+backward of one sequence of --T tokens on one rank, then split\n"
            "over the N ranks of the job (KCP); prints both times, the bytes each rank sends per\n"
            "iteration and the share of time inside communicator calls.\n"
            "\n"
            "  --T N          tokens (default 8192)\n"
            "  --H H          heads, q/k and value (default 2)\n"
            "  --K K --V V    head dims (default 64, 64)\n"
            "  --chunk-size N 16, 32 or 64 (default 64)\n"
            "  --dtype D      f32 or f64 on the CPU, f32 or bf16 on CUDA (default f32)\n"
            "  --device D     cpu (default) or cuda: every rank on cuda:(local rank %% devices);\n"
            "                 over NCCL when every rank has a GPU of its own (mpirun or\n"
            "                 torchrun), else over MPI (host-staged: ranks may share a GPU)\n"
            "  --reps R       timed iterations, 1..100 (default 5), after --warmup W, 0..100\n"
            "                 (default 1)\n"
            "  --cores C      cores to share among the ranks, 1..4096 (default: all online)\n"
            "  --profile      then one more split fwd+bwd with every tape node timed, each\n"
            "                 rank's table printed in rank order (the device is synchronised at\n"
            "                 every node, and the wait for other ranks shows in the node that\n"
            "                 communicates)\n");
}

int dg_bench_cp(int argc, char **argv) {
    bshape s = {8192, 2, 64, 64, 64, 5, 1, DG_F32};
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int cuda = 0, profile = 0;
    static const dg_cli_flag flags[] = {
        {"--T", "an integer"},
        {"--H", "an integer"},
        {"--K", "an integer"},
        {"--V", "an integer"},
        {"--chunk-size", "16, 32 or 64"},
        {"--reps", "an integer"},
        {"--warmup", "an integer"},
        {"--cores", "an integer"},
        {"--device", "cpu or cuda"},
        {"--dtype", "f32, f64 or bf16"},
        {"--profile", NULL},
    };
    {
        dg_cli cli;
        dg_cli_init(&cli, "bench cp", usage, flags, DG_CLI_N(flags), argc, argv);
        const char *a = NULL, *v = NULL;
        int pr;
        while ((pr = dg_cli_next(&cli, &a, &v)) == DG_CLI_FLAG) {
            if (!strcmp(a, "--profile")) {
                profile = 1;
                continue;
            }
            /* numbers through the one strict parser (tools/args.c): the error names flag and range
             */
            static const int chunks[3] = {16, 32, 64};
            int64_t T = 0, nc = 0;
            dg_status ps = DG_OK;
            if (!strcmp(a, "--T")) {
                ps = dg_arg_i64(a, v, 1, (int64_t)1 << 30, &T);
                s.T = T;
            } else if (!strcmp(a, "--H"))
                ps = dg_arg_int(a, v, 1, 4096, &s.H);
            else if (!strcmp(a, "--K"))
                ps = dg_arg_int(a, v, 1, 1024, &s.K);
            else if (!strcmp(a, "--V"))
                ps = dg_arg_int(a, v, 1, 1024, &s.V);
            else if (!strcmp(a, "--chunk-size"))
                ps = dg_arg_choice(a, v, chunks, 3, &s.BT);
            else if (!strcmp(a, "--reps"))
                ps = dg_arg_int(a, v, 1, 100, &s.reps);
            else if (!strcmp(a, "--warmup"))
                ps = dg_arg_int(a, v, 0, 100, &s.warmup);
            else if (!strcmp(a, "--cores")) {
                ps = dg_arg_i64(a, v, 1, 4096, &nc);
                cores = (long)nc;
            } else if (!strcmp(a, "--device")) {
                if (strcmp(v, "cpu") && strcmp(v, "cuda")) {
                    return dg_cli_bad(&cli, "--device", "must be cpu or cuda, got '%s'", v);
                }
                cuda = !strcmp(v, "cuda");
            } else if (!strcmp(a, "--dtype")) {
                if (dg_dtype_parse(v, &s.dt) != DG_OK ||
                    (s.dt != DG_F32 && s.dt != DG_F64 && s.dt != DG_BF16)) {
                    return dg_cli_bad(&cli, "--dtype", "must be f32, f64 or bf16, got '%s'", v);
                }
            }
            if (ps != DG_OK)
                return dg_cli_bad_arg(&cli);
        }
        if (pr != DG_CLI_END)
            return pr;
    }
    if (s.reps > 100)
        s.reps = 100;
    if (cores < 1)
        cores = 1;
    if (cuda && dg_cuda_device_count() < 1) {
        fprintf(stderr, "bench cp: --device cuda: no CUDA device\n");
        return 2;
    }
    if ((cuda && s.dt == DG_F64) || (!cuda && s.dt == DG_BF16)) {
        fprintf(stderr, "bench cp: --dtype %s is not available on the %s\n", dg_dtype_name(s.dt),
                cuda ? "GPU (f32 or bf16)" : "CPU (f64 or f32)");
        return 2;
    }
    dg_ctx *ctx = NULL;
    dg_comm *comm = NULL;
    int rank = 0, world = 1, rc = 1;
    if (cuda) { /* the local rank picks the device */
        if (dg_ctx_new(dg_launch_device(dg_cuda(0), 0), &ctx) != DG_OK) {
            fprintf(stderr, "bench cp: %s\n", dg_last_error());
            return 1;
        }
    }
    dg_status cs0 = dg_comm_init_launch(ctx, DG_COMM_PICK_AUTO, 0.0, &comm);
    if (cs0 != DG_OK) {
        fprintf(stderr, "bench cp: %s\n", dg_last_error());
        dg_ctx_free(&ctx);
        return 1;
    }
    rank = dg_comm_rank(comm);
    world = dg_comm_size(comm);
    dg_cp_plan *plan = NULL;
    binputs full, part;
    memset(&full, 0, sizeof full);
    memset(&part, 0, sizeof part);
    double t1[100], tn[100], cs[100];
    dg_tensor *gath = NULL, *mine = NULL;
    if (!ctx)
        TRY(dg_ctx_new(dg_cpu(), &ctx));
    TRY(dg_cp_plan_new(world, rank, s.T, NULL, 0, NULL, &plan));

    /* one rank, all cores */
    if (rank == 0) {
        set_threads((int)cores);
        TRY(make_inputs(ctx, &s, 0, s.T, &full));
        for (int i = -s.warmup; i < s.reps; i++) {
            double t0 = dg_bench_now_s();
            TRY(fwd_bwd(ctx, NULL, NULL, &s, &full));
            if (i >= 0)
                t1[i] = dg_bench_now_s() - t0;
        }
        inputs_free(&full);
    }
    TRY(dg_comm_barrier(comm));

    /* every rank, cores / N threads each */
    set_threads(cores > world ? (int)(cores / world) : 1);
    TRY(make_inputs(ctx, &s, plan->begin, plan->end, &part));
    TRY(dg_tensor_new(ctx, DG_F64, 2, (int64_t[]){world, 3}, &gath));
    int64_t bytes = 0;
    for (int i = -s.warmup; i < s.reps; i++) {
        TRY(dg_comm_barrier(comm));
        dg_comm_reset_stats(comm);
        double t0 = dg_bench_now_s();
        TRY(fwd_bwd(ctx, comm, plan, &s, &part));
        double el = dg_bench_now_s() - t0;
        dg_comm_stats st;
        dg_comm_get_stats(comm, &st);
        double m[3] = {el, st.seconds, (double)st.bytes_sent}, *g = NULL;
        dg_tensor_free(&mine); /* on ctx's device: the NCCL backend takes CUDA tensors only */
        TRY(dg_tensor_from_f64(ctx, DG_F64, 1, (int64_t[]){3}, m, &mine));
        TRY(dg_comm_all_gather(comm, mine, gath));
        TRY(dg_tensor_to_f64(gath, &g));
        double worst = 0, share = 0;
        for (int r = 0; r < world; r++) {
            if (g[3 * r] > worst)
                worst = g[3 * r];
            share += g[3 * r + 1] / g[3 * r] / world;
        }
        free(g);
        if (i >= 0) {
            tn[i] = worst;
            cs[i] = share;
        }
        bytes = (int64_t)m[2];
    }
    if (rank == 0) {
        double a = dg_bench_median(t1, s.reps), b = dg_bench_median(tn, s.reps),
               c = dg_bench_median(cs, s.reps);
        char where[96];
        if (cuda)
            snprintf(where, sizeof where, "CUDA, %s backend",
                     dg_comm_kind(comm) == DG_COMM_NCCL ? "NCCL" : "MPI (host-staged)");
        else
            snprintf(where, sizeof where, "CPU (%ld cores)", cores);
        printf("bench cp: chunked KDA fwd+bwd, one sequence of T=%lld tokens, heads %d, K=%d "
               "V=%d, chunk %d, %s, %s\n",
               (long long)s.T, s.H, s.K, s.V, s.BT, dg_dtype_name(s.dt), where);
        printf("  %-10s %-12s %-12s %-9s %-22s %s\n", "ranks", "tokens/rank", "fwd+bwd ms",
               "speedup", "bytes sent/rank/iter", "time in comm (mean over ranks)");
        printf("  %-10d %-12lld %-12.1f %-9s %-22s %s\n", 1, (long long)s.T, 1e3 * a, "1.00", "0",
               "-");
        printf("  %-10d %-12lld %-12.1f %-9.2f %-22lld %.1f%%\n", world,
               (long long)(plan->end - plan->begin), 1e3 * b, a / b, (long long)bytes, 100.0 * c);
#ifdef _OPENMP
        if (!cuda)
            printf("  (threads: %ld on one rank, %ld per rank split)\n", cores,
                   cores > world ? cores / world : 1);
#else
        if (!cuda)
            printf("  (threads: 1 on every rank, a build without OpenMP)\n");
#endif
        printf("  (medians of %d iterations; KCP sends two all_gathers of HV*K*(K+V) values per "
               "rank and iteration)\n",
               s.reps);
    }
    if (profile) {
        dg_profile_reset();
        dg_profile_enable(1);
        TRY(dg_comm_barrier(comm));
        dg_profile_mark(ctx);
        TRY(fwd_bwd(ctx, comm, plan, &s, &part));
        dg_profile_enable(0);
        for (int r = 0; r < world; r++) { /* in rank order */
            TRY(dg_comm_barrier(comm));
            if (r == rank) {
                printf("rank %d: per-node time of one split fwd+bwd (tokens [%lld, %lld)):\n", rank,
                       (long long)plan->begin, (long long)plan->end);
                dg_profile_dump(stdout);
                fflush(stdout);
            }
        }
        TRY(dg_comm_barrier(comm));
    }
    rc = 0;
fail:
    inputs_free(&full);
    inputs_free(&part);
    dg_tensor_free(&gath);
    dg_tensor_free(&mine);
    dg_cp_plan_free(&plan);
    dg_ctx_free(&ctx);
    if (rc && world > 1)
        dg_comm_abort(comm, rc);
    dg_comm_free(&comm);
    dg_comm_finalize();
    return rc;
}

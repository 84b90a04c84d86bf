/*
 * tools/cmd_bench.c -- `deltagrad bench core` (GEMM throughput, memory bandwidth) and the
 * dispatch to `deltagrad bench kda` (tools/bench_kda.c) and `deltagrad bench dplr`
 * (tools/bench_dplr.c).
 *
 * On a GPU: bf16 and f32 GEMMs through dg_matmul at a few square sizes, timed with CUDA events
 * around each call, and large copies / an axpy through the library's own kernels. Each result is
 * the median of --reps timed runs after --warmup untimed ones, and is printed as a fraction of a
 * peak: for bandwidth the best measured large copy, for GEMMs the best measured GEMM of the same
 * dtype and the datasheet number (--peak-tflops, --peak-tflops-f32). On the CPU: the CPU GEMM's
 * GFLOP/s only.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "deltagrad.h"
#include "tensor/tensor.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/args.h"
#include "tools/cli.h"

#ifdef DG_HAVE_CUDA
#include "kernels/bench_util.cuh"
#include "kernels/cuda_api.h"
#endif

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_SIZES 8
#define BENCH_MAX_DIM 65536 /* GEMM sides: 65536^2 f32 is 16 GiB already */

typedef struct {
    dg_device dev;
    int64_t sizes[MAX_SIZES];
    int n_sizes;
    int64_t m, n, k; /* an extra GEMM shape, 0 = none */
    int reps, warmup;
    double peak_bf16, peak_f32;
    double copy_mib;
} bench_opts;

static void usage(FILE *f) {
    fprintf(f,
            "usage: deltagrad bench core [options]\n"
            "       deltagrad bench kda [options]      (see deltagrad bench kda --help)\n"
            "       deltagrad bench dplr [options]     (see deltagrad bench dplr --help)\n"
            "       mpirun -np N deltagrad bench cp [options]   (see deltagrad bench cp --help)\n"
            "\n"
            "bench core: GEMM throughput through dg_matmul and memory bandwidth through the\n"
            "library's copy kernels; medians of --reps runs after --warmup untimed runs.\n"
            "\n"
            "  --device D          cpu, cuda or cuda:N (default: cuda if a device is present)\n"
            "  --sizes A,B,...     square GEMM sizes, each in [1, 65536] (default 4096,8192 on a "
            "GPU; 256,512,1024\n"
            "                      on the CPU)\n"
            "  --m M --n N --k K   also time one [M,K] @ [K,N] GEMM\n"
            "  --reps R            timed repetitions, 1..100000 (default 20)\n"
            "  --warmup W          untimed runs before timing, 0..100000 (default 3)\n"
            "  --peak-tflops T     datasheet dense bf16 TFLOP/s (default 989, H100 SXM)\n"
            "  --peak-tflops-f32 T datasheet f32 (non-tensor-core) TFLOP/s (default 67, H100 SXM)\n"
            "  --copy-mib S        size of the bandwidth test buffers in MiB (default 1024)\n"
            "  -h, --help          this text\n");
}

/* Strict values through tools/args.c; the error (naming the flag and range) is printed here. */
static int parse_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (dg_arg_i64(flag, s, lo, hi, out) == DG_OK)
        return 1;
    fprintf(stderr, "deltagrad bench core: %s\n(deltagrad bench core --help lists the flags)\n",
            dg_last_error());
    return 0;
}

static int parse_f64(const char *flag, const char *s, double *out) {
    if (dg_arg_f64(flag, s, 0.0, INFINITY, DG_ARG_LO_OPEN, out) == DG_OK)
        return 1;
    fprintf(stderr, "deltagrad bench core: %s\n(deltagrad bench core --help lists the flags)\n",
            dg_last_error());
    return 0;
}

static int parse_sizes(const char *s, bench_opts *o) {
    o->n_sizes = 0;
    char buf[256];
    if (strlen(s) >= sizeof buf || !*s || s[strlen(s) - 1] == ',' || s[0] == ',' || strstr(s, ",,"))
        return 0;
    snprintf(buf, sizeof buf, "%s", s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (o->n_sizes == MAX_SIZES ||
            !parse_i64("--sizes", tok, 1, BENCH_MAX_DIM, &o->sizes[o->n_sizes]))
            return 0;
        o->n_sizes++;
    }
    return o->n_sizes > 0;
}

/* Returns 0 on success, else the exit code (0 after --help / --version is signalled by *done). */
static int parse_args(int argc, char **argv, bench_opts *o, int *done) {
    static const dg_cli_flag flags[] = {
        {"--device", "cpu, cuda or cuda:N"},
        {"--sizes", "N,N,..."},
        {"--m", "an integer"},
        {"--n", "an integer"},
        {"--k", "an integer"},
        {"--reps", "an integer"},
        {"--warmup", "an integer"},
        {"--peak-tflops", "a number"},
        {"--peak-tflops-f32", "a number"},
        {"--copy-mib", "a number"},
    };
    *done = 0;
    int have_dev = 0;
    dg_cli cli;
    dg_cli_init(&cli, "bench core", usage, flags, DG_CLI_N(flags), argc, argv);
    const char *a, *v;
    int pr;
    while ((pr = dg_cli_next(&cli, &a, &v)) == DG_CLI_FLAG) {
        int64_t iv = 0;
        int ok = 1;
        if (!strcmp(a, "--device")) {
            ok = dg_device_parse(v, &o->dev) == DG_OK;
            have_dev = 1;
        } else if (!strcmp(a, "--sizes")) {
            ok = parse_sizes(v, o);
        } else if (!strcmp(a, "--m")) {
            ok = parse_i64(a, v, 1, BENCH_MAX_DIM, &o->m);
        } else if (!strcmp(a, "--n")) {
            ok = parse_i64(a, v, 1, BENCH_MAX_DIM, &o->n);
        } else if (!strcmp(a, "--k")) {
            ok = parse_i64(a, v, 1, BENCH_MAX_DIM, &o->k);
        } else if (!strcmp(a, "--reps")) {
            ok = parse_i64(a, v, 1, 100000, &iv);
            o->reps = (int)iv;
        } else if (!strcmp(a, "--warmup")) {
            ok = parse_i64(a, v, 0, 100000, &iv);
            o->warmup = (int)iv;
        } else if (!strcmp(a, "--peak-tflops")) {
            ok = parse_f64(a, v, &o->peak_bf16);
        } else if (!strcmp(a, "--peak-tflops-f32")) {
            ok = parse_f64(a, v, &o->peak_f32);
        } else if (!strcmp(a, "--copy-mib")) {
            ok = parse_f64(a, v, &o->copy_mib);
        }
        if (!ok) {
            if (!strcmp(a, "--device") || !strcmp(a, "--sizes"))
                return dg_cli_bad(
                    &cli, a, "expected %s, got '%s'",
                    !strcmp(a, "--device") ? "cpu, cuda or cuda:N" : "comma-separated integers", v);
            return 2;
        }
    }
    if (pr != DG_CLI_END) {
        *done = pr == 0;
        return pr;
    }
    if ((o->m || o->n || o->k) && !(o->m && o->n && o->k)) {
        fprintf(stderr, "bench core: --m, --n and --k go together\n");
        return 2;
    }
    if (!have_dev)
        o->dev = dg_cuda_device_count() > 0 ? dg_cuda(0) : dg_cpu();
    if (o->n_sizes == 0) {
        static const int64_t gpu_sizes[] = {4096, 8192}, cpu_sizes[] = {256, 512, 1024};
        int cuda = o->dev.kind == DG_DEV_CUDA;
        o->n_sizes = cuda ? 2 : 3;
        memcpy(o->sizes, cuda ? gpu_sizes : cpu_sizes, (size_t)o->n_sizes * sizeof(int64_t));
    }
    return 0;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

#define BENCH_TRY(expr)                                                                            \
    do {                                                                                           \
        dg_status bt_s = (expr);                                                                   \
        if (bt_s != DG_OK) {                                                                       \
            fprintf(stderr, "bench core: %s: %s\n", dg_status_str(bt_s), dg_last_error());         \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* A timed operation: `run` does one repetition on ctx (queued work, for CUDA). */
typedef struct {
    dg_ctx *ctx;
    dg_tensor *a, *b;
    int kind; /* 0 matmul, 1 copy_ (b <- a), 2 axpy (b += 0.5 a), 3 raw device memcpy */
} bench_op;

static dg_status run_once(bench_op *op) {
    switch (op->kind) {
    case 0: {
        dg_tensor *c = NULL;
        dg_status s = dg_matmul(op->ctx, op->a, op->b, &c);
        dg_tensor_free(&c); /* back to the caching allocator: no cudaMalloc in the timed loop */
        return s;
    }
    case 1:
        return dg_tensor_copy_(op->b, op->a);
    case 2:
        return dg__axpy(op->ctx, op->b, 0.5, op->a);
    default:
#ifdef DG_HAVE_CUDA
        return dg__cuda_memcpy(op->ctx, dg_tensor_data(op->b), dg_tensor_data(op->a),
                               dg_tensor_nbytes(op->a), DG_COPY_D2D);
#else
        return dg__no_cuda("bench memcpy");
#endif
    }
}

/* Median milliseconds of one repetition. */
static dg_status time_op(bench_op *op, const bench_opts *o, double *ms) {
    double *t = malloc((size_t)o->reps * sizeof *t);
    if (!t)
        return dg__err(DG_ERR_NOMEM, "bench: out of host memory");
    dg_status s = DG_OK;
    for (int i = 0; i < o->warmup && s == DG_OK; i++)
        s = run_once(op);
    if (s == DG_OK)
        s = dg_ctx_sync(op->ctx);
#ifdef DG_HAVE_CUDA
    dg_cuda_timer *tm = NULL;
    if (s == DG_OK && op->ctx->device.kind == DG_DEV_CUDA)
        s = dg__cuda_timer_new(op->ctx, &tm);
#endif
    for (int i = 0; i < o->reps && s == DG_OK; i++) {
#ifdef DG_HAVE_CUDA
        if (tm) {
            s = dg__cuda_timer_start(tm);
            if (s == DG_OK)
                s = run_once(op);
            if (s == DG_OK)
                s = dg__cuda_timer_stop(tm, &t[i]);
            continue;
        }
#endif
        double t0 = now_ms();
        s = run_once(op);
        t[i] = now_ms() - t0;
    }
#ifdef DG_HAVE_CUDA
    dg__cuda_timer_free(&tm);
#endif
    if (s == DG_OK)
        *ms = dg_bench_median(t, o->reps);
    free(t);
    return s;
}

typedef struct {
    char what[64];
    dg_dtype dt;
    double ms, rate; /* TFLOP/s (GEMM) or GB/s (bandwidth) */
} row;

static dg_status gemm_row(dg_ctx *ctx, dg_dtype dt, int64_t M, int64_t N, int64_t K,
                          const bench_opts *o, row *r) {
    dg_tensor *a = NULL, *b = NULL;
    dg_status s = dg_tensor_new(ctx, dt, 2, (int64_t[]){M, K}, &a);
    if (s == DG_OK)
        s = dg_tensor_new(ctx, dt, 2, (int64_t[]){K, N}, &b);
    if (s == DG_OK)
        s = dg_tensor_rand_normal(a, 1, 0.0, 1.0);
    if (s == DG_OK)
        s = dg_tensor_rand_normal(b, 2, 0.0, 1.0);
    bench_op op = {ctx, a, b, 0};
    if (s == DG_OK)
        s = time_op(&op, o, &r->ms);
    if (s == DG_OK) {
        snprintf(r->what, sizeof r->what, "gemm %lldx%lldx%lld", (long long)M, (long long)N,
                 (long long)K);
        r->dt = dt;
        r->rate = 2.0 * (double)M * (double)N * (double)K / (r->ms * 1e-3) / 1e12;
    }
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    return s;
}

static int bench_cpu(const bench_opts *o) {
    dg_ctx *ctx = NULL;
    int rc = 1;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    printf("deltagrad bench core on the CPU (%d OpenMP thread%s): CPU GEMM only; GPU peaks need "
           "--device cuda\n",
           threads, threads == 1 ? "" : "s");
    printf("%d timed runs after %d warmup, median\n\n", o->reps, o->warmup);
    printf("%-26s %-5s %10s %10s\n", "op", "dtype", "ms", "GFLOP/s");
    BENCH_TRY(dg_ctx_new(dg_cpu(), &ctx));
    for (int d = 0; d < 2; d++) {
        dg_dtype dt = d ? DG_F64 : DG_F32;
        for (int i = 0; i <= o->n_sizes; i++) {
            int64_t M, N, K;
            if (i < o->n_sizes)
                M = N = K = o->sizes[i];
            else if (o->m)
                M = o->m, N = o->n, K = o->k;
            else
                continue;
            row r;
            BENCH_TRY(gemm_row(ctx, dt, M, N, K, o, &r));
            printf("%-26s %-5s %10.3f %10.2f\n", r.what, dg_dtype_name(dt), r.ms, r.rate * 1e3);
        }
    }
    rc = 0;
fail:
    dg_ctx_free(&ctx);
    return rc;
}

#ifdef DG_HAVE_CUDA
static int bench_cuda(const bench_opts *o) {
    dg_ctx *ctx = NULL;
    dg_tensor *src = NULL, *dst = NULL;
    int rc = 1;
    row rows[2 * (MAX_SIZES + 1)];
    int nr = 0;
    BENCH_TRY(dg_ctx_new(o->dev, &ctx));
    dg_cuda_device_info info;
    int mode = -1;
    BENCH_TRY(dg__cuda_device_info(o->dev.index, &info));
    BENCH_TRY(dg__cuda_cublas_math_mode(ctx, &mode));
    printf("deltagrad bench core on %s: %s (sm_%d%d, %d SMs, %.1f GiB, L2 %d MiB)\n",
           dg_device_str(o->dev), info.name, info.cc_major, info.cc_minor, info.sm_count,
           info.mem_gib, info.l2_mib);
    printf("cuBLAS math mode %d%s; %d timed runs after %d warmup, median; CUDA event timing\n\n",
           mode, mode == 0 ? " (default: f32 GEMMs are true f32, no TF32)" : "", o->reps,
           o->warmup);

    /* GEMMs */
    for (int d = 0; d < 2; d++) {
        dg_dtype dt = d ? DG_F32 : DG_BF16;
        for (int i = 0; i <= o->n_sizes; i++) {
            int64_t M, N, K;
            if (i < o->n_sizes)
                M = N = K = o->sizes[i];
            else if (o->m)
                M = o->m, N = o->n, K = o->k;
            else
                continue;
            BENCH_TRY(gemm_row(ctx, dt, M, N, K, o, &rows[nr]));
            nr++;
            dg_ctx_empty_cache(ctx); /* do not let big GEMM buffers crowd the next size */
        }
    }
    double best[2] = {0, 0};
    for (int i = 0; i < nr; i++) {
        int f = rows[i].dt == DG_F32;
        if (rows[i].rate > best[f])
            best[f] = rows[i].rate;
    }
    printf("%-26s %-5s %10s %10s %12s %12s\n", "op", "dtype", "ms", "TFLOP/s", "of best",
           "of datasheet");
    for (int i = 0; i < nr; i++) {
        int f = rows[i].dt == DG_F32;
        double sheet = f ? o->peak_f32 : o->peak_bf16;
        printf("%-26s %-5s %10.3f %10.1f %11.1f%% %11.1f%%\n", rows[i].what,
               dg_dtype_name(rows[i].dt), rows[i].ms, rows[i].rate, 100 * rows[i].rate / best[f],
               100 * rows[i].rate / sheet);
    }
    printf("(datasheet: bf16 %.0f TFLOP/s dense, f32 %.0f TFLOP/s; --peak-tflops, "
           "--peak-tflops-f32)\n\n",
           o->peak_bf16, o->peak_f32);

    /* Bandwidth: f32 buffers of --copy-mib MiB. */
    int64_t n = (int64_t)(o->copy_mib * 1024 * 1024 / 4);
    if (n < 1)
        n = 1;
    BENCH_TRY(dg_tensor_new(ctx, DG_F32, 1, &n, &src));
    BENCH_TRY(dg_tensor_new(ctx, DG_F32, 1, &n, &dst));
    BENCH_TRY(dg_tensor_fill_(src, 1.0));
    BENCH_TRY(dg_tensor_fill_(dst, 0.0));
    static const struct {
        const char *what;
        int kind;
        double traffic; /* bytes moved per byte of buffer */
    } bw[] = {{"copy (cudaMemcpy D2D)", 3, 2},
              {"copy (dg_tensor_copy_)", 1, 2},
              {"axpy (dst += a*src)", 2, 3}};
    row brow[3];
    double peak = 0;
    double bytes = (double)n * 4;
    for (int i = 0; i < 3; i++) {
        bench_op op = {ctx, src, dst, bw[i].kind};
        BENCH_TRY(time_op(&op, o, &brow[i].ms));
        brow[i].rate = bw[i].traffic * bytes / (brow[i].ms * 1e-3) / 1e9;
        if (bw[i].kind != 2 && brow[i].rate > peak) /* the peak is the best large copy */
            peak = brow[i].rate;
    }
    printf("%-26s %-5s %10s %10s %12s   (%.0f MiB buffers, read + write bytes)\n", "op", "dtype",
           "ms", "GB/s", "of peak", bytes / (1024 * 1024));
    for (int i = 0; i < 3; i++)
        printf("%-26s %-5s %10.3f %10.1f %11.1f%%\n", bw[i].what, "f32", brow[i].ms, brow[i].rate,
               100 * brow[i].rate / peak);
    printf("(peak bandwidth = best measured copy: %.1f GB/s)\n", peak);
    rc = 0;
fail:
    dg_tensor_free(&src);
    dg_tensor_free(&dst);
    dg_ctx_free(&ctx);
    return rc;
}
#endif

static int bench_core(int argc, char **argv) {
    bench_opts o;
    memset(&o, 0, sizeof o);
    o.reps = 20;
    o.warmup = 3;
    o.peak_bf16 = 989;
    o.peak_f32 = 67;
    o.copy_mib = 1024;
    int done = 0, rc = parse_args(argc, argv, &o, &done);
    if (rc || done)
        return rc;
    if (o.dev.kind == DG_DEV_CPU)
        return bench_cpu(&o);
#ifdef DG_HAVE_CUDA
    if (o.dev.index >= dg_cuda_device_count()) {
        fprintf(stderr, "bench core: %s requested but %d CUDA device(s) are present\n",
                dg_device_str(o.dev), dg_cuda_device_count());
        return 1;
    }
    return bench_cuda(&o);
#else
    fprintf(stderr, "bench core: this build has no CUDA; use --device cpu\n");
    return 1;
#endif
}

int dg_cmd_bench(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (argv[1][0] == '-') { /* --help, --version; any other flag comes after the benchmark */
        int r = dg_cli_lead_flag("bench", usage, argc, argv);
        return r == DG_CLI_END ? 0 : r;
    }
    if (!strcmp(argv[1], "core"))
        return bench_core(argc - 1, argv + 1);
    if (!strcmp(argv[1], "kda"))
        return dg_bench_kda(argc - 1, argv + 1);
    if (!strcmp(argv[1], "dplr"))
        return dg_bench_dplr(argc - 1, argv + 1);
    if (!strcmp(argv[1], "cp"))
        return dg_bench_cp(argc - 1, argv + 1);
    fprintf(stderr, "deltagrad bench: unknown benchmark '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

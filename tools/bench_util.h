/* tools/bench_util.h -- the timing helpers the bench subcommands share: a monotonic clock in
 * seconds, the median of a set of timings (sorts v in place), and the two device peaks the
 * kernel benches (bench kda, bench dplr) measure their floors against. */
#ifndef DG_TOOLS_BENCH_UTIL_H
#define DG_TOOLS_BENCH_UTIL_H

#include "deltagrad.h"

#include <stdlib.h>
#include <time.h>

#if !defined(_POSIX_C_SOURCE) || _POSIX_C_SOURCE < 199309L
#error "define _POSIX_C_SOURCE 200809L before the first #include (clock_gettime)"
#endif

static inline double dg_bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int dg_bench_cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static inline double dg_bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, dg_bench_cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* FLOP/s of a large bf16 GEMM (n x n x n through dg_matmul, median of reps <= 64 runs after 3
 * untimed ones); -1 on an error (dg_last_error() says which). */
static inline double dg_bench_gemm_rate(dg_ctx *ctx, int64_t n, int reps) {
    int64_t sh[2] = {n, n};
    dg_tensor *a = NULL, *b = NULL, *c = NULL;
    double t[64];
    dg_status st = dg_tensor_new(ctx, DG_BF16, 2, sh, &a);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_BF16, 2, sh, &b);
    if (st == DG_OK)
        st = dg_tensor_rand_normal(a, 1, 0, 1);
    if (st == DG_OK)
        st = dg_tensor_rand_normal(b, 2, 0, 1);
    for (int i = -3; i < reps && st == DG_OK; i++) {
        st = dg_ctx_sync(ctx);
        const double t0 = dg_bench_now_s();
        if (st == DG_OK)
            st = dg_matmul(ctx, a, b, &c);
        if (st == DG_OK)
            st = dg_ctx_sync(ctx);
        if (i >= 0)
            t[i] = dg_bench_now_s() - t0;
        dg_tensor_free(&c);
    }
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    return st == DG_OK ? 2.0 * (double)n * n * n / dg_bench_median(t, reps) : -1;
}

/* Bytes/s of a device-to-device copy of `bytes` (read + write counted, median of reps <= 64 runs
 * after 3 untimed ones); -1 on an error. */
static inline double dg_bench_copy_rate(dg_ctx *ctx, int64_t bytes, int reps) {
    int64_t sh[1] = {bytes / 4};
    dg_tensor *a = NULL, *b = NULL;
    double t[64];
    dg_status st = dg_tensor_new(ctx, DG_F32, 1, sh, &a);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 1, sh, &b);
    if (st == DG_OK)
        st = dg_tensor_rand_uniform(a, 3, -1, 1);
    for (int i = -3; i < reps && st == DG_OK; i++) {
        st = dg_ctx_sync(ctx);
        const double t0 = dg_bench_now_s();
        if (st == DG_OK)
            st = dg_tensor_copy_(b, a);
        if (st == DG_OK)
            st = dg_ctx_sync(ctx);
        if (i >= 0)
            t[i] = dg_bench_now_s() - t0;
    }
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    return st == DG_OK ? 2.0 * (double)sh[0] * 4 / dg_bench_median(t, reps) : -1;
}

#endif

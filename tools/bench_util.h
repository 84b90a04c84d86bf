/* tools/bench_util.h -- the timing helpers the bench subcommands share: a monotonic clock in
 * seconds and the median of a set of timings (sorts v in place). */
#ifndef DG_TOOLS_BENCH_UTIL_H
#define DG_TOOLS_BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

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

#endif

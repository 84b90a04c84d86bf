/*
 * tests/dist/test_comm.c -- the MPI communicator: all_gather, all_reduce (f64, f32, bf16), shift
 * in both directions around a ring, barrier, split into sub-groups, statistics, and argument
 * errors. Every expected value is computed from the rank numbers, not hard-coded. gpu mode: the
 * same on CUDA tensors (the MPI backend stages them through host memory).
 */
#include "dist_util.h"

#include <string.h>

static double val(int rank, int64_t i) { return 1000.0 * rank + 0.5 * (double)i - 3.0; }

static dg_tensor *ranked(dg_ctx *cpu, dg_dtype dt, int rank, int64_t n) {
    double *h = (double *)malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        h[i] = val(rank, i);
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, dt, 1, (int64_t[]){n}, h, &t));
    free(h);
    return t;
}

/* Rank r's values as dtype dt holds them (bf16 rounds). */
static double *stored(dg_ctx *cpu, dg_dtype dt, int rank, int64_t n) {
    dg_tensor *t = ranked(cpu, dt, rank, n);
    double *h = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(t, &h));
    dg_tensor_free(&t);
    return h;
}

static void check_all_gather(dg_comm *c, dg_ctx *cpu, dg_dtype dt) {
    const int R = dg_comm_rank(c), S = dg_comm_size(c);
    const int64_t n = 37;
    dg_tensor *x = ranked(cpu, dt, R, n), *out = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, dt, 2, (int64_t[]){S, n}, &out));
    dg_check_ok(dg_comm_all_gather(c, x, out), "all_gather");
    double *got = NULL, *want = (double *)malloc(sizeof(double) * (size_t)(S * n));
    DG_TEST_TRY(dg_tensor_to_f64(out, &got));
    for (int r = 0; r < S; r++) {
        double *hr = stored(cpu, dt, r, n);
        memcpy(want + r * n, hr, sizeof(double) * (size_t)n);
        free(hr);
    }
    char name[64];
    snprintf(name, sizeof name, "all_gather %s", dg_dtype_name(dt));
    dg_check_close(name, got, want, S * n, 0, 0);
    free(got);
    free(want);
    dg_tensor_free(&x);
    dg_tensor_free(&out);
}

static void check_all_reduce(dg_comm *c, dg_ctx *cpu, dg_dtype dt) {
    const int R = dg_comm_rank(c), S = dg_comm_size(c);
    const int64_t n = 1000;
    dg_tensor *x = ranked(cpu, dt, R, n);
    dg_check_ok(dg_comm_all_reduce(c, x), "all_reduce");
    double *got = NULL, *want = (double *)malloc(sizeof(double) * (size_t)n);
    DG_TEST_TRY(dg_tensor_to_f64(x, &got));
    for (int64_t i = 0; i < n; i++)
        want[i] = 0;
    for (int r = 0; r < S; r++) { /* the inputs as the dtype holds them */
        double *hr = stored(cpu, dt, r, n);
        for (int64_t i = 0; i < n; i++)
            want[i] += hr[i];
        free(hr);
    }
    char name[64];
    snprintf(name, sizeof name, "all_reduce %s", dg_dtype_name(dt));
    /* f64/f32: small integers and halves, exact; bf16: the sum is rounded to 8 bits once */
    dg_check_close(name, got, want, n, 0, dt == DG_BF16 ? 1.0 / 128 : 0);
    free(got);
    free(want);
    dg_tensor_free(&x);
}

/* Ring shift right (send to r+1, receive from r-1; the ends send/receive nothing) and left. */
static void check_shift(dg_comm *c, dg_ctx *cpu) {
    const int R = dg_comm_rank(c), S = dg_comm_size(c);
    const int64_t n = 5;
    for (int dir = 1; dir >= -1; dir -= 2) {
        int dst = R + dir, src = R - dir;
        if (dst < 0 || dst >= S)
            dst = -1;
        if (src < 0 || src >= S)
            src = -1;
        dg_tensor *x = ranked(cpu, DG_F32, R, n), *y = NULL;
        DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F32, 1, (int64_t[]){n}, &y));
        dg_check_ok(dg_comm_shift(c, dst >= 0 ? x : NULL, dst, src >= 0 ? y : NULL, src),
                    dir > 0 ? "shift to r+1" : "shift to r-1");
        double *got = NULL, want[5];
        DG_TEST_TRY(dg_tensor_to_f64(y, &got));
        for (int64_t i = 0; i < n; i++)
            want[i] = src >= 0 ? val(src, i) : 0.0;
        dg_check_close(dir > 0 ? "received from r-1" : "received from r+1", got, want, n, 0, 0);
        free(got);
        dg_tensor_free(&x);
        dg_tensor_free(&y);
    }
}

/* Split into even and odd ranks; the sum of the ranks within each group. */
static void check_split(dg_comm *c, dg_ctx *cpu) {
    const int R = dg_comm_rank(c), S = dg_comm_size(c);
    dg_comm *sub = NULL;
    if (!dg_check_ok(dg_comm_split(c, R % 2, R, &sub), "split by parity"))
        return;
    int want_size = (S + (R % 2 == 0)) / 2, want_rank = R / 2;
    dg_check(dg_comm_size(sub) == want_size && dg_comm_rank(sub) == want_rank,
             "split: rank %d of %d (want %d of %d)", dg_comm_rank(sub), dg_comm_size(sub),
             want_rank, want_size);
    double v = R, want = 0;
    for (int r = R % 2; r < S; r += 2)
        want += r;
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 1, (int64_t[]){1}, &v, &t));
    dg_check_ok(dg_comm_all_reduce(sub, t), "all_reduce in the sub-group");
    double got = 0;
    DG_TEST_TRY(dg_tensor_item(t, &got));
    dg_check(got == want, "sub-group sum %g (want %g)", got, want);
    dg_tensor_free(&t);
    dg_comm_free(&sub);
}

static void check_errors(dg_comm *c, dg_ctx *cpu) {
    const int S = dg_comm_size(c);
    dg_tensor *x = ranked(cpu, DG_F64, 0, 4), *bad = NULL, *f = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 2, (int64_t[]){S + 1, 4}, &bad));
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F32, 2, (int64_t[]){S, 4}, &f));
    dg_check_err(dg_comm_all_gather(c, x, bad), DG_ERR_SHAPE, "out must be", "all_gather shape");
    dg_check_err(dg_comm_all_gather(c, x, f), DG_ERR_DTYPE, "dtype", "all_gather dtype");
    dg_check_err(dg_comm_shift(c, x, S, NULL, -1), DG_ERR_ARG, "dst", "shift to a bad rank");
    dg_check_err(dg_comm_shift(c, x, dg_comm_rank(c), NULL, -1), DG_ERR_ARG, "dst",
                 "shift to itself");
    dg_check_err(dg_comm_all_gather(NULL, x, bad), DG_ERR_ARG, "comm", "NULL comm");
    dg_tensor_free(&x);
    dg_tensor_free(&bad);
    dg_tensor_free(&f);
}

static void check_stats(dg_comm *c, dg_ctx *cpu) {
    const int S = dg_comm_size(c);
    dg_comm_reset_stats(c);
    dg_tensor *x = ranked(cpu, DG_F32, 0, 64), *out = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F32, 2, (int64_t[]){S, 64}, &out));
    DG_TEST_TRY(dg_comm_all_gather(c, x, out));
    DG_TEST_TRY(dg_comm_barrier(c));
    dg_comm_stats s;
    dg_comm_get_stats(c, &s);
    dg_check(s.calls == 2 && s.bytes_sent == (int64_t)(S - 1) * 64 * 4 && s.seconds >= 0,
             "stats: %lld calls, %lld bytes (want 2, %lld)", (long long)s.calls,
             (long long)s.bytes_sent, (long long)(S - 1) * 256);
    dg_tensor_free(&x);
    dg_tensor_free(&out);
}

int main(int argc, char **argv) {
    dg_comm *c = dt_init(argc, argv, "comm");
    dg_ctx *cpu = dt_ctx(&c); /* gpu mode: CUDA tensors (MPI stages them through host buffers) */
    dg_check(dg_comm_kind(c) == (dt_nccl() ? DG_COMM_NCCL : DG_COMM_MPI) && dg_comm_size(c) >= 1 &&
                 dg_comm_rank(c) >= 0 && dg_comm_rank(c) < dg_comm_size(c),
             "rank %d of %d", dg_comm_rank(c), dg_comm_size(c));
    check_all_gather(c, cpu, DG_F64);
    check_all_gather(c, cpu, DG_BF16);
    check_all_reduce(c, cpu, DG_F64);
    check_all_reduce(c, cpu, DG_F32);
    check_all_reduce(c, cpu, DG_BF16);
    check_shift(c, cpu);
    check_split(c, cpu);
    check_errors(c, cpu);
    check_stats(c, cpu);
    dg_check_ok(dg_comm_barrier(c), "barrier");
    dg_ctx_free(&cpu);
    return dt_finish(&c, "comm");
}

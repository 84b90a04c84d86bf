/*
 * tests/dist/dist_util.h -- what every dist test shares: start the MPI communicator (or report
 * skipped without MPI), send the check lines of ranks other than 0 to a per-rank log file, and
 * agree on one exit code over all ranks.
 */
#ifndef DG_TEST_DIST_UTIL_H
#define DG_TEST_DIST_UTIL_H

#include "../harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The world communicator (timeout from DG_COMM_TIMEOUT, default 60 s here), or exit 77 when the
 * build has no MPI. Ranks > 0 write their check lines to <suite>.rank<r>.log. */
static inline dg_comm *dt_init(int argc, char **argv, const char *suite) {
    if (!dg_have_mpi()) {
        dg_test_init(argc, argv, suite);
        exit(dg_test_skip("this build has no MPI"));
    }
    dg_comm *c = NULL;
    const char *e = getenv("DG_COMM_TIMEOUT");
    dg_status st = dg_comm_init_mpi(e && *e ? 0.0 : 60.0, &c);
    if (st != DG_OK) {
        fprintf(stderr, "FATAL: dg_comm_init_mpi: %s\n", dg_last_error());
        exit(1);
    }
    if (dg_comm_rank(c) > 0) {
        char path[256];
        snprintf(path, sizeof path, "%s.rank%d.log", suite, dg_comm_rank(c));
        if (!freopen(path, "w", stdout))
            fprintf(stderr, "warning: cannot write %s\n", path);
    }
    dg_test_init(argc, argv, suite);
    printf("ranks: %d\n", dg_comm_size(c));
    return c;
}

/* The context the suite runs in: the CPU, or in gpu mode CUDA device 0 (every rank shares it:
 * the MPI communicator stages CUDA tensors through host memory). With DG_TEST_COMM=nccl in gpu
 * mode, each rank takes a GPU of its own (local rank) and *c becomes an NCCL communicator over
 * the same ranks (bootstrapped over MPI); skipped with fewer GPUs than ranks or without NCCL.
 * Without a device every rank ends the job as skipped. */
/* gpu mode with DG_TEST_COMM=nccl: the suite runs over the NCCL backend */
static inline int dt_nccl(void) {
    const char *want = getenv("DG_TEST_COMM");
    return dg_test_gpu_mode() && want && !strcmp(want, "nccl");
}

static inline dg_ctx *dt_ctx(dg_comm **c) {
    dg_ctx *ctx = NULL;
    const int nccl = dt_nccl();
    const char *skip = NULL;
    if (dg_test_gpu_mode() && dg_cuda_device_count() < 1)
        skip = "no CUDA device";
    else if (nccl && !dg_have_nccl())
        skip = "DG_TEST_COMM=nccl: this build has no NCCL";
    else if (nccl && dg_cuda_device_count() < dg_comm_size(*c))
        skip = "DG_TEST_COMM=nccl: fewer GPUs than ranks (NCCL needs one GPU per rank)";
    if (skip) {
        dg_comm_free(c);
        dg_comm_finalize();
        exit(dg_test_skip(skip));
    }
    dg_device dev = !dg_test_gpu_mode() ? dg_cpu() : nccl ? dg_cuda(dg_comm_rank(*c)) : dg_cuda(0);
    if (dg_ctx_new(dev, &ctx) != DG_OK) {
        fprintf(stderr, "FATAL: dg_ctx_new: %s\n", dg_last_error());
        exit(1);
    }
    if (nccl) {
        dg_comm *n = NULL;
        if (dg_comm_init_launch(ctx, DG_COMM_PICK_NCCL, dg_comm_timeout(*c), &n) != DG_OK) {
            fprintf(stderr, "FATAL: dg_comm_init_launch (NCCL): %s\n", dg_last_error());
            exit(1);
        }
        dg_comm_free(c);
        *c = n;
        printf("communicator: NCCL, rank %d on %s\n", dg_comm_rank(n),
               dg_device_str(dg_ctx_device(ctx)));
    }
    return ctx;
}

/* Exit code agreed by every rank: 0 only if all ranks passed. */
static inline int dt_finish(dg_comm **c, const char *suite) {
    int rc = dg_test_finish();
    dg_ctx *cpu = NULL;
    dg_tensor *t = NULL;
    double fails = rc != 0;
    if (dg_ctx_new(dg_cpu(), &cpu) == DG_OK &&
        dg_tensor_from_f64(cpu, DG_F64, 1, (int64_t[]){1}, &fails, &t) == DG_OK &&
        dg_comm_all_reduce(*c, t) == DG_OK) {
        fails = ((double *)dg_tensor_data(t))[0];
        if (dg_comm_rank(*c) == 0 && fails > 0)
            printf("%s: %.0f of %d ranks failed (ranks > 0 logged to %s.rank<r>.log)\n", suite,
                   fails, dg_comm_size(*c), suite);
    } else {
        fprintf(stderr, "dt_finish: could not agree on the result: %s\n", dg_last_error());
        fails = 1;
    }
    dg_tensor_free(&t);
    dg_ctx_free(&cpu);
    dg_comm_free(c);
    dg_comm_finalize();
    return fails > 0 ? 1 : 0;
}

#endif

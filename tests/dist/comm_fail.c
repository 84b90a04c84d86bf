/*
 * tests/dist/comm_fail.c -- a job with one bad rank, run by tests/scripts/dist_fail.sh:
 *   comm_fail hang TIMEOUT : the last rank sleeps far longer than TIMEOUT instead of joining an
 *                            all_gather; the others must fail with DG_ERR_COMM within TIMEOUT,
 *                            print the message and end the job (dg_comm_abort).
 *   comm_fail die TIMEOUT  : the last rank exits at once (status 3) before the all_gather; the
 *                            job must end (mpirun, or the others' timeout), never hang.
 * Exit status: nonzero when the job was ended as intended (the script checks the message and
 * the time); 0 only if the bad rank was somehow waited for, which the script reports as failure.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, sleep */
#include "deltagrad.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "hang") && strcmp(argv[1], "die"))) {
        fprintf(stderr, "usage: comm_fail hang|die TIMEOUT_SECONDS\n");
        return 2;
    }
    double timeout = atof(argv[2]);
    dg_comm *c = NULL;
    if (dg_comm_init_mpi(timeout, &c) != DG_OK) {
        fprintf(stderr, "comm_fail: %s\n", dg_last_error());
        return 77;
    }
    const int R = dg_comm_rank(c), S = dg_comm_size(c);
    dg_ctx *cpu = NULL;
    dg_tensor *x = NULL, *out = NULL;
    if (dg_ctx_new(dg_cpu(), &cpu) != DG_OK ||
        dg_tensor_zeros(cpu, DG_F32, 1, (int64_t[]){8}, &x) ||
        dg_tensor_new(cpu, DG_F32, 2, (int64_t[]){S, 8}, &out)) {
        fprintf(stderr, "comm_fail: %s\n", dg_last_error());
        return 1;
    }
    /* one good collective first: the job is up */
    if (dg_comm_all_gather(c, x, out) != DG_OK) {
        fprintf(stderr, "comm_fail: rank %d: first all_gather: %s\n", R, dg_last_error());
        return 1;
    }
    if (R == S - 1) {
        if (!strcmp(argv[1], "die")) {
            fprintf(stderr, "comm_fail: rank %d exits now\n", R);
            _exit(3);
        }
        fprintf(stderr, "comm_fail: rank %d hangs\n", R);
        sleep((unsigned)(20 * timeout + 60));
        return 0;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    dg_status st = dg_comm_all_gather(c, x, out);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double el = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (st == DG_OK) {
        fprintf(stderr, "comm_fail: rank %d: all_gather succeeded without the bad rank\n", R);
        return 0;
    }
    fprintf(stderr, "comm_fail: rank %d: %s after %.2f s: %s\n", R, dg_status_str(st), el,
            dg_last_error());
    dg_comm_abort(c, 4);
}

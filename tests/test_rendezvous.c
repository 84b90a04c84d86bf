/*
 * tests/test_rendezvous.c -- the TCP bootstrap of the NCCL communicator (dg__tcp_bcast), which
 * needs no GPU: rank 0 and forked peers on 127.0.0.1 exchange a payload; a peer without rank 0
 * and a rank 0 without its peers fail with DG_ERR_COMM within the timeout instead of hanging.
 * (gpu mode has nothing to run: skipped.)
 */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include "dist/dist.h"

#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* A port that was free a moment ago (bind to port 0, read it back). */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void payload(unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 37u + 11u);
}

/* Rank 0 here, size-1 forked peers: every peer must receive the payload. */
static void test_broadcast(int size) {
    const int port = free_port();
    enum { N = 128 }; /* sizeof(ncclUniqueId) */
    pid_t kids[8];
    for (int r = 1; r < size; r++) {
        kids[r] = fork();
        if (kids[r] == 0) {
            unsigned char got[N], want[N];
            memset(got, 0, N);
            payload(want, N);
            dg_status st = dg__tcp_bcast(r, size, "127.0.0.1", port, 10.0, got, N);
            _exit(st == DG_OK && memcmp(got, want, N) == 0 ? 0 : 3);
        }
    }
    unsigned char buf[N];
    payload(buf, N);
    dg_status st = dg__tcp_bcast(0, size, "127.0.0.1", port, 10.0, buf, N);
    dg_check_ok(st, "rank 0 sends the id");
    int ok = 1;
    for (int r = 1; r < size; r++) {
        int ws = 0;
        waitpid(kids[r], &ws, 0);
        ok = ok && WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
    }
    dg_check(ok, "%d peers on port %d received the %d bytes intact", size - 1, port, N);
}

static void test_timeouts(void) {
    unsigned char buf[16] = {0};
    double t0 = now_s();
    dg_status st = dg__tcp_bcast(1, 2, "127.0.0.1", free_port(), 1.0, buf, sizeof buf);
    double el = now_s() - t0;
    dg_check_err(st, DG_ERR_COMM, "could not reach rank 0", "a peer without rank 0");
    dg_check(el < 5.0, "  ...gave up after %.2f s (timeout 1 s)", el);
    t0 = now_s();
    st = dg__tcp_bcast(0, 3, "127.0.0.1", free_port(), 1.0, buf, sizeof buf);
    el = now_s() - t0;
    dg_check_err(st, DG_ERR_COMM, "only 1 of 3 ranks connected", "rank 0 without its peers");
    dg_check(el < 5.0, "  ...gave up after %.2f s (timeout 1 s)", el);
}

static void cpu_cases(dg_ctx *cpu) {
    /* the TCP bootstrap touches no tensors */
    test_broadcast(2);
    test_broadcast(4);
    test_timeouts();
}

/* cpu mode only: the TCP bootstrap needs no GPU */
int main(int argc, char **argv) { return dg_test_main(argc, argv, "rendezvous", cpu_cases, NULL); }

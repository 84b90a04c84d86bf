/*
 * dist/rendezvous.c -- a one-shot TCP broadcast for bootstrapping (the NCCL id, torchrun style):
 * rank 0 listens on a port and sends the same bytes to each of the other ranks as they connect;
 * the others connect to addr:port, retrying until the timeout, and read them. Every wait is
 * bounded by the timeout: a missing rank 0 or a missing peer gives DG_ERR_COMM, never a hang.
 */
#define _POSIX_C_SOURCE 200809L /* getaddrinfo, MSG_NOSIGNAL */
#include "dist.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

static dg_status write_all(int fd, const void *p, size_t n) {
    const char *c = (const char *)p;
    while (n > 0) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w <= 0)
            return dg__err(DG_ERR_COMM, "dg__tcp_bcast: send failed: %s", strerror(errno));
        c += w;
        n -= (size_t)w;
    }
    return DG_OK;
}

static dg_status read_all(int fd, void *p, size_t n, double deadline) {
    char *c = (char *)p;
    while (n > 0) {
        struct pollfd pf = {fd, POLLIN, 0};
        int ms = (int)((deadline - dg__comm_now()) * 1000);
        if (ms <= 0 || poll(&pf, 1, ms) <= 0)
            return dg__err(DG_ERR_COMM, "dg__tcp_bcast: rank 0 sent nothing within the timeout");
        ssize_t r = recv(fd, c, n, 0);
        if (r <= 0)
            return dg__err(DG_ERR_COMM, "dg__tcp_bcast: connection closed by rank 0");
        c += r;
        n -= (size_t)r;
    }
    return DG_OK;
}

dg_status dg__tcp_bcast(int rank, int size, const char *addr, int port, double timeout, void *buf,
                        size_t n) {
    const double deadline = dg__comm_now() + timeout;
    char ports[16];
    snprintf(ports, sizeof ports, "%d", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = rank == 0 ? AI_PASSIVE : 0;
    int gr = getaddrinfo(rank == 0 ? NULL : addr, ports, &hints, &ai);
    if (gr != 0)
        return dg__err(DG_ERR_COMM, "dg__tcp_bcast: address %s port %d: %s", addr, port,
                       gai_strerror(gr));
    dg_status st = DG_OK;
    if (rank == 0) {
        int ls = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), one = 1;
        if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            bind(ls, ai->ai_addr, ai->ai_addrlen) != 0 || listen(ls, size) != 0)
            st = dg__err(DG_ERR_COMM, "dg__tcp_bcast: rank 0 cannot listen on port %d: %s", port,
                         strerror(errno));
        for (int got = 1; got < size && st == DG_OK; got++) {
            struct pollfd pf = {ls, POLLIN, 0};
            int ms = (int)((deadline - dg__comm_now()) * 1000);
            if (ms <= 0 || poll(&pf, 1, ms) <= 0) {
                st = dg__err(DG_ERR_COMM,
                             "dg__tcp_bcast: rank 0: only %d of %d ranks connected within %.1f s",
                             got, size, timeout);
                break;
            }
            int fd = accept(ls, NULL, NULL);
            if (fd < 0) { /* the peer gave up; wait for the next one */
                got--;
                continue;
            }
            st = write_all(fd, buf, n);
            close(fd);
        }
        if (ls >= 0)
            close(ls);
    } else {
        int fd = -1;
        while (fd < 0 && st == DG_OK) {
            fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
            if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
                if (fd >= 0)
                    close(fd);
                fd = -1;
                if (dg__comm_now() > deadline)
                    st = dg__err(
                        DG_ERR_COMM,
                        "dg__tcp_bcast: rank %d could not reach rank 0 at %s:%d within %.1f s",
                        rank, addr, port, timeout);
                else
                    dg__comm_backoff(1000); /* 1 ms between attempts */
            }
        }
        if (st == DG_OK)
            st = read_all(fd, buf, n, deadline);
        if (fd >= 0)
            close(fd);
    }
    freeaddrinfo(ai);
    return st;
}

/*
 * dist/dist.h -- library-internal side of the communicators: the backend table every backend
 * fills in, the helpers the backends share (clock, timeout message), and the halo exchange of the
 * context-parallel token-local ops (dg__cp_halo_cat).
 *
 * dist/comm.c holds the public dg_comm_* functions: argument checks, host staging of CUDA tensors
 * for the MPI backend, statistics. A backend moves raw bytes (or raw f32/f64 arrays for the
 * reduction) that live where the backend wants them: host memory for MPI, device memory for NCCL.
 * Every backend call must come back within c->timeout seconds; on a timeout it marks the
 * communicator broken and returns DG_ERR_COMM.
 */
#ifndef DG_DIST_H
#define DG_DIST_H

#include "../tensor/tensor.h"

typedef struct dg__comm_ops {
    /* recv[size * bytes] = every rank's send[bytes] in rank order */
    dg_status (*all_gather)(dg_comm *c, const void *send, void *recv, size_t bytes);
    /* in-place sum of n elements of dtype dt (DG_F64 or DG_F32) */
    dg_status (*all_reduce)(dg_comm *c, void *buf, int64_t n, dg_dtype dt);
    /* send sbytes to dst, receive rbytes from src (either rank may be -1) */
    dg_status (*shift)(dg_comm *c, const void *send, size_t sbytes, int dst, void *recv,
                       size_t rbytes, int src);
    dg_status (*barrier)(dg_comm *c);
    dg_status (*split)(dg_comm *c, int color, int key, dg_comm **out);
    void (*destroy)(dg_comm *c);
    void (*abort)(dg_comm *c, int code);
} dg__comm_ops;

struct dg_comm {
    const dg__comm_ops *ops;
    dg_comm_backend kind;
    int rank, size;
    double timeout; /* seconds any one call may take */
    int broken;     /* a call failed or timed out: every further call fails at once */
    int on_device;  /* the backend's buffers are device memory (NCCL) */
    dg_ctx *ctx;    /* NCCL: the device context; MPI: NULL */
    dg_ctx *host;   /* host context for staging (made on first use) */
    dg_comm_stats stats;
    void *impl;
};

/* A zeroed communicator with the given table (DG_ERR_NOMEM when out of memory). */
dg_status dg__comm_alloc(const dg__comm_ops *ops, dg_comm_backend kind, double timeout,
                         dg_comm **out);
/* Monotonic seconds. */
double dg__comm_now(void);
/* Sleep a little while polling: grows from 20 us to 1 ms with the number of polls so far. */
void dg__comm_backoff(int64_t polls);
/* Mark c broken and return DG_ERR_COMM with the standard timeout message for call `op`. */
dg_status dg__comm_timeout(dg_comm *c, const char *op);
/* Bootstrap broadcast over TCP (dist/rendezvous.c): rank 0 listens on `port` (all interfaces)
 * and sends buf[0..n) to each of the size-1 other ranks; they connect to addr:port (retrying) and
 * receive into buf. DG_ERR_COMM when a peer or rank 0 does not show up within timeout s. */
dg_status dg__tcp_bcast(int rank, int size, const char *addr, int port, double timeout, void *buf,
                        size_t n);
/* An integer environment variable in [0, 2^30]: 1 and *v set; 0 when unset or empty; -1 when it
 * is not such an integer (dist/launch.c). */
int dg__env_int(const char *name, int *v);
/* The default timeout when the caller passes <= 0 (DG_COMM_TIMEOUT overrides it). */
double dg__comm_default_timeout(double asked);

/* The halo exchange of the context-parallel token-local ops (ops/short_conv_cp.c; used by
 * dg_short_conv_cp with h = W-1 and dg_token_shift_cp with h = 1): xe = [halo | x]
 * ([1, h+T_r, C], x [1, T_r, C] this rank's slice). Every rank sends its last h rows to rank r+1;
 * of the h rows received from r-1 only the last min(h, plan->pre_tokens) belong to local
 * sequence 0 and are kept, the others are zero (as before a sequence start). When x requires
 * grad, records a node of kind `kind` (a static string) whose backward sends the gradient of the
 * kept halo rows back to r-1, where it is added to the gradient of its last h rows. Every rank
 * must hold at least h tokens (the caller checks). Collective: every rank calls it, and every
 * rank runs its backward. */
dg_status dg__cp_halo_cat(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                          int64_t h, const char *kind, dg_tensor **xe);

/* The checks a context-parallel token-local op `op` starts with: ctx and out given (*out set to
 * NULL), comm, plan and x given, plan made for comm's rank and size, x [1, T_r, C] with T_r this
 * rank's tokens. */
dg_status dg__cp_check(const char *op, dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan,
                       const dg_tensor *x, dg_tensor **out);
/* A token-local op on this rank's local sequences (cu [n_seqs+1]): ye = op(xe). */
typedef dg_status (*dg__cp_local_fn)(dg_ctx *ctx, dg_tensor *xe, const int64_t *cu, int n_seqs,
                                     void *arg, dg_tensor **ye);
/* The op f over the split: f runs on xe = [halo | x] (dg__cp_halo_cat with h rows and node kind
 * `kind`) with local sequence 0 extended by the h halo rows, and *out is the last T_r rows of its
 * output (contiguous). Collective, as dg__cp_halo_cat. */
dg_status dg__cp_halo_run(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                          int64_t h, const char *op, const char *kind, dg__cp_local_fn f, void *arg,
                          dg_tensor **out);

#endif /* DG_DIST_H */

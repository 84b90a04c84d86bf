/*
 * dist/nccl.c -- the NCCL backend of dg_comm: CUDA tensors, one process per GPU.
 *
 * Bootstrap (dg_comm_init_nccl):
 *   - torchrun style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Rank 0 makes the
 *     ncclUniqueId, listens on MASTER_PORT and hands the id to every other rank over TCP; the
 *     others connect (retrying until the timeout): dg__tcp_bcast, dist/rendezvous.c. The
 *     caller picks the GPU (ctx's device; with torchrun, cuda:$LOCAL_RANK).
 *   - mpirun: without those variables, when built with MPI, the id travels over MPI.
 * The communicator is non-blocking (ncclConfig_t.blocking = 0) so that no call can hang: every
 * operation is enqueued on ctx's stream, then the stream and ncclCommGetAsyncError are polled
 * until the work is done, NCCL reports an error, or the timeout passes (then ncclCommAbort).
 * Calls are therefore synchronous with the host, and they wait for the device first: the tensors
 * may come from kernels queued on another context's stream (the training loop's own context, say),
 * and that work must be finished before NCCL reads them. Built without NCCL: DG_ERR_UNSUPPORTED.
 */
#include "dist.h"

#ifndef DG_HAVE_NCCL
dg_status dg_comm_init_nccl(dg_ctx *ctx, double timeout_s, dg_comm **out) {
    (void)ctx;
    (void)timeout_s;
    if (out)
        *out = NULL;
    return dg__err(DG_ERR_UNSUPPORTED, "dg_comm_init_nccl: this build has no NCCL (install NCCL "
                                       "and configure a CUDA build with -DDG_NCCL=ON)");
}
#else
#include <cuda_runtime_api.h>
/* nccl.h declares some functions with an empty parameter list */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

typedef struct nccl_impl {
    ncclComm_t comm;
    cudaStream_t stream;
    int device;
    float *one;  /* a device float for the barrier */
    dg_ctx *own; /* the communicator's own context on the caller's device (its stream) */
} nccl_impl;

static nccl_impl *impl(dg_comm *c) { return (nccl_impl *)c->impl; }

static dg_status nccl_fail(dg_comm *c, const char *op, ncclResult_t r) {
    if (c) {
        c->broken = 1;
        if (impl(c) && impl(c)->comm)
            ncclCommAbort(impl(c)->comm);
        if (impl(c))
            impl(c)->comm = NULL;
    }
    return dg__err(DG_ERR_NCCL, "%s: rank %d of %d: NCCL failed: %s (%s)", op, c ? c->rank : -1,
                   c ? c->size : -1, ncclGetErrorString(r), ncclGetLastError(NULL));
}

/* Wait until the communicator has no operation in progress (non-blocking init / enqueue). */
static dg_status nccl_settle(dg_comm *c, const char *op, ncclComm_t comm, ncclResult_t r,
                             double t0) {
    for (int64_t polls = 0; r == ncclInProgress; polls++) {
        if (dg__comm_now() - t0 > c->timeout) {
            ncclCommAbort(comm);
            if (impl(c))
                impl(c)->comm = NULL;
            return dg__comm_timeout(c, op);
        }
        dg__comm_backoff(polls);
        ncclCommGetAsyncError(comm, &r);
    }
    if (r != ncclSuccess)
        return nccl_fail(c, op, r);
    return DG_OK;
}

/* After an enqueue: poll the stream until done, an NCCL error, or the timeout. */
static dg_status nccl_wait(dg_comm *c, const char *op, ncclResult_t r) {
    nccl_impl *m = impl(c);
    double t0 = dg__comm_now();
    DG_TRY(nccl_settle(c, op, m->comm, r, t0));
    for (int64_t polls = 0;; polls++) {
        cudaError_t e = cudaStreamQuery(m->stream);
        if (e == cudaSuccess)
            return DG_OK;
        if (e != cudaErrorNotReady) {
            c->broken = 1;
            return dg__err(DG_ERR_CUDA, "%s: rank %d: CUDA error while waiting: %s", op, c->rank,
                           cudaGetErrorString(e));
        }
        ncclResult_t ae = ncclSuccess;
        ncclCommGetAsyncError(m->comm, &ae);
        if (ae != ncclSuccess && ae != ncclInProgress)
            return nccl_fail(c, op, ae);
        if (dg__comm_now() - t0 > c->timeout) {
            ncclCommAbort(m->comm);
            m->comm = NULL;
            return dg__comm_timeout(c, op);
        }
        dg__comm_backoff(polls);
    }
}

/* Before an enqueue: everything already queued on this device (any stream) is finished. */
static dg_status nccl_ready(dg_comm *c, const char *op) {
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess)
        return DG_OK;
    c->broken = 1;
    return dg__err(DG_ERR_CUDA, "%s: rank %d: CUDA error before the call: %s", op, c->rank,
                   cudaGetErrorString(e));
}

static dg_status nccl_all_gather(dg_comm *c, const void *send, void *recv, size_t bytes) {
    DG_TRY(nccl_ready(c, "dg_comm_all_gather"));
    ncclResult_t r = ncclAllGather(send, recv, bytes, ncclChar, impl(c)->comm, impl(c)->stream);
    return nccl_wait(c, "dg_comm_all_gather", r);
}

static dg_status nccl_all_reduce(dg_comm *c, void *buf, int64_t n, dg_dtype dt) {
    DG_TRY(nccl_ready(c, "dg_comm_all_reduce"));
    ncclResult_t r = ncclAllReduce(buf, buf, (size_t)n, dt == DG_F64 ? ncclDouble : ncclFloat,
                                   ncclSum, impl(c)->comm, impl(c)->stream);
    return nccl_wait(c, "dg_comm_all_reduce", r);
}

static dg_status nccl_shift(dg_comm *c, const void *send, size_t sbytes, int dst, void *recv,
                            size_t rbytes, int src) {
    nccl_impl *m = impl(c);
    DG_TRY(nccl_ready(c, "dg_comm_shift"));
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess && dst >= 0)
        r = ncclSend(send, sbytes, ncclChar, dst, m->comm, m->stream);
    if ((r == ncclSuccess || r == ncclInProgress) && src >= 0)
        r = ncclRecv(recv, rbytes, ncclChar, src, m->comm, m->stream);
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess)
        r = e;
    return nccl_wait(c, "dg_comm_shift", r);
}

static dg_status nccl_barrier(dg_comm *c) {
    nccl_impl *m = impl(c);
    DG_TRY(nccl_ready(c, "dg_comm_barrier"));
    ncclResult_t r = ncclAllReduce(m->one, m->one, 1, ncclFloat, ncclSum, m->comm, m->stream);
    return nccl_wait(c, "dg_comm_barrier", r);
}

static void nccl_destroy(dg_comm *c) {
    nccl_impl *m = impl(c);
    if (!m)
        return;
    if (m->comm) {
        if (c->broken)
            ncclCommAbort(m->comm);
        else
            ncclCommDestroy(m->comm);
    }
    if (m->one)
        cudaFree(m->one);
    dg_ctx_free(&m->own);
    DG_FREE(m);
    c->impl = NULL;
}

static void nccl_abort(dg_comm *c, int code) {
    (void)code;
    if (impl(c) && impl(c)->comm) {
        ncclCommAbort(impl(c)->comm);
        impl(c)->comm = NULL;
    }
}

static dg_status nccl_split(dg_comm *c, int color, int key, dg_comm **out);

static const dg__comm_ops g_nccl_ops = {nccl_all_gather, nccl_all_reduce, nccl_shift, nccl_barrier,
                                        nccl_split,      nccl_destroy,    nccl_abort};

/* A communicator object around an initialised NCCL comm. It makes its own context on ctx's
 * device, so it does not depend on the caller's context staying alive. */
static dg_status nccl_wrap(dg_ctx *ctx, ncclComm_t nc, int rank, int size, double timeout,
                           dg_comm **out) {
    dg_comm *c = NULL;
    DG_TRY(dg__comm_alloc(&g_nccl_ops, DG_COMM_NCCL, timeout, &c));
    nccl_impl *m = (nccl_impl *)DG_CALLOC(1, sizeof *m);
    if (!m) {
        DG_FREE(c);
        ncclCommAbort(nc);
        return dg__err(DG_ERR_NOMEM, "dg_comm_init_nccl: out of host memory");
    }
    m->comm = nc;
    c->impl = m;
    c->rank = rank;
    c->size = size;
    c->on_device = 1;
    dg_status st = dg_ctx_new(dg_ctx_device(ctx), &m->own);
    if (st != DG_OK) {
        dg_comm_free(&c);
        return st;
    }
    m->stream = (cudaStream_t)m->own->stream;
    m->device = dg_ctx_device(ctx).index;
    c->ctx = m->own;
    cudaError_t e = cudaMalloc((void **)&m->one, sizeof(float));
    if (e == cudaSuccess)
        e = cudaMemset(m->one, 0, sizeof(float));
    if (e != cudaSuccess) {
        dg_comm_free(&c);
        return dg__err(DG_ERR_CUDA, "dg_comm_init_nccl: cudaMalloc: %s", cudaGetErrorString(e));
    }
    *out = c;
    return DG_OK;
}

/* A new NCCL communicator from an id and a rank, created non-blocking and waited for with the
 * timeout. */
static dg_status nccl_init_rank(dg_comm *probe, const char *op, const ncclUniqueId *id, int rank,
                                int size, ncclComm_t *out) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t nc = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&nc, size, *id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(probe, op, r);
    if (r == ncclInProgress)
        ncclCommGetAsyncError(nc, &r);
    DG_TRY(nccl_settle(probe, op, nc, r, dg__comm_now()));
    *out = nc;
    return DG_OK;
}

/* Split without ncclCommSplit: every rank's (color, key) over the parent, then each group's first
 * rank makes an NCCL id and a second all_gather hands it to the group; the new communicators are
 * created like the world one (non-blocking, with the timeout). The parent's calls stage the small
 * host arrays through the device. */
#define ID_WORDS ((int64_t)((sizeof(ncclUniqueId) + 3) / 4))
static dg_status nccl_split(dg_comm *c, int color, int key, dg_comm **out) {
    const int P = c->size;
    dg_tensor *mine = NULL, *all = NULL;
    if (!c->host)
        DG_TRY(dg_ctx_new(dg_cpu(), &c->host));
    const int64_t w = 2 + ID_WORDS;
    dg_status st = dg_tensor_zeros(c->host, DG_I32, 1, (int64_t[]){w}, &mine);
    if (st == DG_OK)
        st = dg_tensor_new(c->host, DG_I32, 2, (int64_t[]){P, w}, &all);
    int32_t *me = st == DG_OK ? (int32_t *)dg_tensor_data(mine) : NULL;
    const int32_t *a = st == DG_OK ? (const int32_t *)dg_tensor_data(all) : NULL;
    if (st == DG_OK) {
        me[0] = color;
        me[1] = key;
        st = dg_comm_all_gather(c, mine, all);
    }
    /* my rank in the group: ranks of my colour ordered by (key, parent rank) */
    int rank = 0, size = 0, leader = -1;
    for (int p = 0; st == DG_OK && p < P; p++) {
        if (a[p * w] != color)
            continue;
        const int before = a[p * w + 1] < key || (a[p * w + 1] == key && p < c->rank);
        rank += before;
        size++;
        if (leader < 0 || a[p * w + 1] < a[leader * w + 1])
            leader = p;
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (st == DG_OK && leader == c->rank && ncclGetUniqueId(&id) != ncclSuccess)
        st = dg__err(DG_ERR_NCCL, "dg_comm_split: ncclGetUniqueId failed");
    if (st == DG_OK) {
        memcpy(me + 2, &id, sizeof id);
        st = dg_comm_all_gather(c, mine, all);
    }
    if (st == DG_OK)
        memcpy(&id, a + leader * w + 2, sizeof id);
    dg_tensor_free(&mine);
    dg_tensor_free(&all);
    DG_TRY(st);
    dg_comm probe; /* messages name the new rank and size */
    memset(&probe, 0, sizeof probe);
    probe.rank = rank;
    probe.size = size;
    probe.timeout = c->timeout;
    ncclComm_t nc = NULL;
    DG_TRY(nccl_init_rank(&probe, "dg_comm_split", &id, rank, size, &nc));
    return nccl_wrap(c->ctx, nc, rank, size, c->timeout, out);
}

/* ---- bootstrap ---- */

#define OPI "dg_comm_init_nccl"

dg_status dg_comm_init_nccl(dg_ctx *ctx, double timeout_s, dg_comm **out) {
    DG_TRY(dg__check_ptr(OPI, "ctx", ctx));
    DG_TRY(dg__check_ptr(OPI, "out", out));
    *out = NULL;
    if (dg_ctx_device(ctx).kind != DG_DEV_CUDA)
        return dg__err(DG_ERR_DEVICE,
                       OPI ": ctx must be a CUDA context (one GPU per process), "
                           "got %s",
                       dg_device_str(dg_ctx_device(ctx)));
    const double timeout = dg__comm_default_timeout(timeout_s);
    int rank = 0, size = 0, port = 0, have_env = 0;
    const char *addr = getenv("MASTER_ADDR");
    int er = dg__env_int("RANK", &rank), ew = dg__env_int("WORLD_SIZE", &size),
        ep = dg__env_int("MASTER_PORT", &port);
    if (er < 0 || ew < 0 || ep < 0)
        return dg__err(DG_ERR_ARG, OPI ": RANK, WORLD_SIZE and MASTER_PORT must be integers");
    have_env = er > 0 && ew > 0;
    ncclUniqueId id;
    dg_comm *mpi = NULL;
    if (have_env) {
        if (!addr || !*addr || ep <= 0)
            return dg__err(DG_ERR_ARG, OPI ": RANK and WORLD_SIZE are set, so MASTER_ADDR and "
                                           "MASTER_PORT must be too (torchrun style)");
        if (size < 1 || rank >= size)
            return dg__err(DG_ERR_ARG,
                           OPI ": need 0 <= RANK < WORLD_SIZE, got RANK=%d "
                               "WORLD_SIZE=%d",
                           rank, size);
        if (rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
            return dg__err(DG_ERR_NCCL, OPI ": ncclGetUniqueId failed");
        if (size > 1)
            DG_TRY(dg__tcp_bcast(rank, size, addr, port, timeout, &id, sizeof id));
    } else if (dg_have_mpi()) {
        DG_TRY(dg_comm_init_mpi(timeout, &mpi));
        rank = dg_comm_rank(mpi);
        size = dg_comm_size(mpi);
        char *all = (char *)DG_MALLOC(sizeof id * (size_t)size);
        dg_status st = all ? DG_OK : dg__err(DG_ERR_NOMEM, OPI ": out of host memory");
        if (st == DG_OK && rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
            st = dg__err(DG_ERR_NCCL, OPI ": ncclGetUniqueId failed");
        if (st == DG_OK) /* rank 0's id reaches everyone */
            st = mpi->ops->all_gather(mpi, &id, all, sizeof id);
        if (st == DG_OK)
            memcpy(&id, all, sizeof id);
        DG_FREE(all);
        dg_comm_free(&mpi);
        DG_TRY(st);
    } else {
        return dg__err(DG_ERR_ARG, OPI ": set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                                       "(torchrun style), or build with MPI and launch with "
                                       "mpirun");
    }
    cudaError_t ce = cudaSetDevice(dg_ctx_device(ctx).index);
    if (ce != cudaSuccess)
        return dg__err(DG_ERR_CUDA, OPI ": cudaSetDevice(%d): %s", dg_ctx_device(ctx).index,
                       cudaGetErrorString(ce));
    dg_comm probe; /* for the messages while there is no communicator yet */
    memset(&probe, 0, sizeof probe);
    probe.rank = rank;
    probe.size = size;
    probe.timeout = timeout;
    ncclComm_t nc = NULL;
    DG_TRY(nccl_init_rank(&probe, OPI, &id, rank, size, &nc));
    return nccl_wrap(ctx, nc, rank, size, timeout, out);
}
#endif

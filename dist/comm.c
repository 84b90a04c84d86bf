/*
 * dist/comm.c -- the public communicator calls (dg_comm_*): argument checks, host staging,
 * statistics; the backends (dist/mpi.c, dist/nccl.c) only move bytes.
 *
 * Staging: each backend works on one side of the bus. The MPI backend works on host memory: a
 * CUDA tensor handed to it is copied into a host tensor, communicated, and copied back, so two
 * processes that share one GPU can run the CUDA path (NCCL refuses two ranks on one device). The
 * NCCL backend works on device memory: a host tensor handed to it goes through a device copy on
 * the communicator's context the same way (small host-side buffers such as KCP's merged
 * summaries and the tests' agreement flags need no second communicator).
 * Statistics count what this rank contributes to the wire: all_gather (size-1) x its piece (every
 * other rank receives it), all_reduce 2 (size-1)/size x the buffer (a ring), shift the bytes sent.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep, clock_gettime, getaddrinfo */
#include "dist.h"

#include <time.h>

#define DG_DEFAULT_TIMEOUT 300.0

double dg__comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void dg__comm_backoff(int64_t polls) {
    long ns = polls < 50 ? 20000L : polls < 500 ? 200000L : 1000000L;
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

dg_status dg__comm_timeout(dg_comm *c, const char *op) {
    c->broken = 1;
    return dg__err(DG_ERR_COMM,
                   "%s: rank %d of %d: the peers did not complete the call within the timeout of "
                   "%.1f s (a peer died, hangs, or is not making the same call); this "
                   "communicator is unusable now: end the job",
                   op, c->rank, c->size, c->timeout);
}

double dg__comm_default_timeout(double asked) {
    if (asked > 0)
        return asked;
    const char *e = getenv("DG_COMM_TIMEOUT");
    if (e && *e) {
        double v = atof(e);
        if (v > 0)
            return v;
    }
    return DG_DEFAULT_TIMEOUT;
}

dg_status dg__comm_alloc(const dg__comm_ops *ops, dg_comm_backend kind, double timeout,
                         dg_comm **out) {
    dg_comm *c = (dg_comm *)DG_CALLOC(1, sizeof *c);
    if (!c)
        return dg__err(DG_ERR_NOMEM, "dg_comm: out of host memory");
    c->ops = ops;
    c->kind = kind;
    c->timeout = dg__comm_default_timeout(timeout);
    *out = c;
    return DG_OK;
}

int dg_comm_rank(const dg_comm *c) { return c ? c->rank : 0; }
int dg_comm_size(const dg_comm *c) { return c ? c->size : 1; }
dg_comm_backend dg_comm_kind(const dg_comm *c) { return c ? c->kind : DG_COMM_MPI; }
double dg_comm_timeout(const dg_comm *c) { return c ? c->timeout : 0.0; }

void dg_comm_get_stats(const dg_comm *c, dg_comm_stats *out) {
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (c)
        *out = c->stats;
}

void dg_comm_reset_stats(dg_comm *c) {
    if (c)
        memset(&c->stats, 0, sizeof c->stats);
}

void dg_comm_free(dg_comm **c) {
    if (!c || !*c)
        return;
    if ((*c)->ops && (*c)->ops->destroy)
        (*c)->ops->destroy(*c);
    if ((*c)->host)
        dg_ctx_free(&(*c)->host);
    DG_FREE(*c);
    *c = NULL;
}

void dg_comm_abort(dg_comm *c, int code) {
    if (c && c->ops && c->ops->abort)
        c->ops->abort(c, code);
    exit(code);
}

static dg_status comm_ready(const char *op, dg_comm *c) {
    DG_TRY(dg__check_ptr(op, "comm", c));
    if (c->broken)
        return dg__err(DG_ERR_COMM,
                       "%s: rank %d: the communicator is unusable after an earlier failure", op,
                       c->rank);
    return DG_OK;
}

static dg_status comm_tensor(const char *op, const char *arg, const dg_comm *c,
                             const dg_tensor *t) {
    DG_TRY(dg__check_ptr(op, arg, t));
    if (!dg_tensor_is_contiguous(t))
        return dg__err(DG_ERR_ARG, "%s: %s must be contiguous, got a strided view %s", op, arg,
                       dg_tensor_desc(t));
    if (c->on_device && dg__is_cuda(t) && !dg_device_eq(t->device, dg_ctx_device(c->ctx)))
        return dg__err(DG_ERR_DEVICE, "%s: %s is on %s, but this NCCL communicator runs on %s", op,
                       arg, dg_device_str(t->device), dg_device_str(dg_ctx_device(c->ctx)));
    return DG_OK;
}

static size_t tbytes(const dg_tensor *t) {
    return (size_t)dg_tensor_numel(t) * dg_dtype_size(t->dtype);
}

/* Where the backend reads/writes t: t's own data, or a copy on the backend's side of the bus (a
 * host copy of a CUDA tensor for MPI, a device copy of a host tensor for NCCL). */
typedef struct {
    dg_tensor *host; /* the staging copy, or NULL */
    void *ptr;
} staged;

static dg_status stage_in(dg_comm *c, const dg_tensor *t, int copy, staged *s) {
    s->host = NULL;
    s->ptr = dg_tensor_data(t);
    if (c->on_device == dg__is_cuda(t))
        return DG_OK;
    dg_ctx *side = c->on_device ? c->ctx : c->host;
    if (!side) {
        DG_TRY(dg_ctx_new(dg_cpu(), &c->host));
        side = c->host;
    }
    DG_TRY(dg_tensor_new(side, t->dtype, t->ndim, t->shape, &s->host));
    if (copy) {
        dg_status st = dg_tensor_copy_(s->host, t);
        if (st != DG_OK) {
            dg_tensor_free(&s->host);
            return st;
        }
    }
    s->ptr = dg_tensor_data(s->host);
    return DG_OK;
}

static dg_status stage_out(dg_tensor *t, staged *s, dg_status st) {
    if (s->host && st == DG_OK)
        st = dg_tensor_copy_(t, s->host);
    dg_tensor_free(&s->host);
    return st;
}

/* DG_COMM_TRACE=1: one line per call on stderr with the time spent staging in, in the backend,
 * and staging out (to find where a slow collective spends its time). */
static void trace(const dg_comm *c, const char *op, size_t bytes, double t0, double t1, double t2) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("DG_COMM_TRACE");
        on = e && *e && strcmp(e, "0") != 0;
    }
    if (on)
        fprintf(stderr,
                "%s: rank %d: %zu bytes: stage in %.3f ms, backend %.3f ms, stage out %.3f ms\n",
                op, c->rank, bytes, 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (dg__comm_now() - t2));
}

static void account(dg_comm *c, double t0, double bytes) {
    c->stats.seconds += dg__comm_now() - t0;
    c->stats.bytes_sent += (int64_t)bytes;
    c->stats.calls++;
}

#define OPG "dg_comm_all_gather"
dg_status dg_comm_all_gather(dg_comm *c, const dg_tensor *x, dg_tensor *out) {
    DG_TRY(comm_ready(OPG, c));
    DG_TRY(comm_tensor(OPG, "x", c, x));
    DG_TRY(comm_tensor(OPG, "out", c, out));
    if (out->dtype != x->dtype || !dg_device_eq(out->device, x->device))
        return dg__err(DG_ERR_DTYPE, OPG ": out %s must have x's dtype and device (x is %s)",
                       dg_tensor_desc(out), dg_tensor_desc(x));
    int ok = out->ndim == x->ndim + 1 && out->shape[0] == c->size;
    for (int i = 0; ok && i < x->ndim; i++)
        ok = out->shape[i + 1] == x->shape[i];
    if (!ok)
        return dg__err(DG_ERR_SHAPE, "%s: out must be [%d, x's shape] with x %s, got %s", OPG,
                       c->size, dg_tensor_desc(x), dg_tensor_desc(out));
    double t0 = dg__comm_now();
    staged sx, so;
    DG_TRY(stage_in(c, x, 1, &sx));
    dg_status st = stage_in(c, out, 0, &so);
    const double t1 = dg__comm_now();
    if (st == DG_OK)
        st = c->ops->all_gather(c, sx.ptr, so.ptr, tbytes(x));
    const double t2 = dg__comm_now();
    st = stage_out(out, &so, st);
    dg_tensor_free(&sx.host);
    trace(c, OPG, tbytes(x), t0, t1, t2);
    account(c, t0, (double)tbytes(x) * (c->size - 1));
    return st;
}

#define OPR "dg_comm_all_reduce"
dg_status dg_comm_all_reduce(dg_comm *c, dg_tensor *x) {
    DG_TRY(comm_ready(OPR, c));
    DG_TRY(comm_tensor(OPR, "x", c, x));
    if (x->dtype != DG_F64 && x->dtype != DG_F32 && x->dtype != DG_BF16)
        return dg__err(DG_ERR_DTYPE, OPR ": x must be f64, f32 or bf16, got %s", dg_tensor_desc(x));
    if (c->size == 1)
        return DG_OK;
    double t0 = dg__comm_now();
    dg_status st = DG_OK;
    if (x->dtype == DG_BF16) { /* summed in f32: on the device for NCCL, else on the host */
        dg_tensor *f = NULL;
        dg_ctx *ctx = c->on_device ? c->ctx : NULL;
        if (!ctx) {
            if (!c->host)
                DG_TRY(dg_ctx_new(dg_cpu(), &c->host));
            ctx = c->host;
        }
        DG_TRY(dg_tensor_new(ctx, DG_F32, x->ndim, x->shape, &f));
        st = dg_tensor_copy_(f, x);
        if (st == DG_OK)
            st = dg_comm_all_reduce(c, f);
        if (st == DG_OK)
            st = dg_tensor_copy_(x, f);
        dg_tensor_free(&f);
        return st;
    }
    staged sx;
    DG_TRY(stage_in(c, x, 1, &sx));
    st = c->ops->all_reduce(c, sx.ptr, dg_tensor_numel(x), x->dtype);
    st = stage_out(x, &sx, st);
    account(c, t0, 2.0 * (c->size - 1) / c->size * (double)tbytes(x));
    return st;
}

#define OPS "dg_comm_shift"
dg_status dg_comm_shift(dg_comm *c, const dg_tensor *send, int dst, dg_tensor *recv, int src) {
    DG_TRY(comm_ready(OPS, c));
    if (dst < -1 || dst >= c->size || dst == c->rank)
        return dg__err(DG_ERR_ARG, OPS ": dst must be -1 or another rank in [0, %d), got %d",
                       c->size, dst);
    if (src < -1 || src >= c->size || src == c->rank)
        return dg__err(DG_ERR_ARG, OPS ": src must be -1 or another rank in [0, %d), got %d",
                       c->size, src);
    if (dst >= 0)
        DG_TRY(comm_tensor(OPS, "send", c, send));
    if (src >= 0)
        DG_TRY(comm_tensor(OPS, "recv", c, recv));
    double t0 = dg__comm_now();
    staged ss = {NULL, NULL}, sr = {NULL, NULL};
    dg_status st = DG_OK;
    if (dst >= 0)
        st = stage_in(c, send, 1, &ss);
    if (st == DG_OK && src >= 0)
        st = stage_in(c, recv, 0, &sr);
    if (st == DG_OK)
        st = c->ops->shift(c, ss.ptr, dst >= 0 ? tbytes(send) : 0, dst, sr.ptr,
                           src >= 0 ? tbytes(recv) : 0, src);
    if (src >= 0)
        st = stage_out(recv, &sr, st);
    dg_tensor_free(&ss.host);
    account(c, t0, dst >= 0 ? (double)tbytes(send) : 0.0);
    return st;
}

dg_status dg_comm_barrier(dg_comm *c) {
    DG_TRY(comm_ready("dg_comm_barrier", c));
    double t0 = dg__comm_now();
    dg_status st = c->ops->barrier(c);
    account(c, t0, 0.0);
    return st;
}

dg_status dg_comm_split(dg_comm *c, int color, int key, dg_comm **out) {
    DG_TRY(dg__check_ptr("dg_comm_split", "out", out));
    *out = NULL;
    DG_TRY(comm_ready("dg_comm_split", c));
    if (color < 0)
        return dg__err(DG_ERR_ARG, "dg_comm_split: color must be >= 0, got %d", color);
    return c->ops->split(c, color, key, out);
}

/*
 * dist/mpi.c -- the MPI backend of dg_comm (Open MPI or any MPI-3 library), for host buffers.
 *
 * Every operation is posted non-blocking (MPI_Iallgather, MPI_Iallreduce, MPI_Isend/MPI_Irecv,
 * MPI_Ibarrier) and then polled with MPI_Testall and a short sleep until it completes or the
 * communicator's timeout passes: a peer that hangs gives DG_ERR_COMM instead of a silent hang, and
 * waiting ranks do not spin on cores the others need. Errors are returned (MPI_ERRORS_RETURN),
 * never fatal inside the library. A peer that dies makes mpirun end the job; the ranks left
 * waiting are stopped by it or by their own timeout, whichever comes first.
 * Built without MPI every entry point returns DG_ERR_UNSUPPORTED.
 */
#include "dist.h"

#ifdef DG_HAVE_MPI
#include <mpi.h>

static int g_we_initialised;

typedef struct {
    MPI_Comm comm;
} mpi_impl;

static MPI_Comm mcomm(dg_comm *c) { return ((mpi_impl *)c->impl)->comm; }

static dg_status mpi_fail(dg_comm *c, const char *op, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof msg, "error %d", rc);
    c->broken = 1;
    return dg__err(DG_ERR_COMM, "%s: rank %d of %d: MPI failed: %s", op, c->rank, c->size, msg);
}

/* Poll n requests to completion or timeout. */
static dg_status mpi_wait(dg_comm *c, const char *op, int n, MPI_Request *req) {
    double t0 = dg__comm_now();
    for (int64_t polls = 0;; polls++) {
        int flag = 0;
        int rc = MPI_Testall(n, req, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_fail(c, op, rc);
        if (flag)
            return DG_OK;
        if (dg__comm_now() - t0 > c->timeout)
            return dg__comm_timeout(c, op);
        dg__comm_backoff(polls);
    }
}

static dg_status mpi_all_gather(dg_comm *c, const void *send, void *recv, size_t bytes) {
    if (bytes > (size_t)INT32_MAX)
        return dg__err(DG_ERR_ARG, "dg_comm_all_gather: %zu bytes per rank is over MPI's limit",
                       bytes);
    MPI_Request r;
    int rc = MPI_Iallgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, mcomm(c), &r);
    if (rc != MPI_SUCCESS)
        return mpi_fail(c, "dg_comm_all_gather", rc);
    return mpi_wait(c, "dg_comm_all_gather", 1, &r);
}

static dg_status mpi_all_reduce(dg_comm *c, void *buf, int64_t n, dg_dtype dt) {
    MPI_Datatype t = dt == DG_F64 ? MPI_DOUBLE : MPI_FLOAT;
    size_t es = dg_dtype_size(dt);
    char *p = (char *)buf;
    /* in pieces of at most 2^30 elements (MPI counts are int) */
    for (int64_t off = 0; off < n;) {
        int cnt = (int)(n - off < (1 << 30) ? n - off : (1 << 30));
        MPI_Request r;
        int rc = MPI_Iallreduce(MPI_IN_PLACE, p + (size_t)off * es, cnt, t, MPI_SUM, mcomm(c), &r);
        if (rc != MPI_SUCCESS)
            return mpi_fail(c, "dg_comm_all_reduce", rc);
        DG_TRY(mpi_wait(c, "dg_comm_all_reduce", 1, &r));
        off += cnt;
    }
    return DG_OK;
}

#define SHIFT_TAG 7301
static dg_status mpi_shift(dg_comm *c, const void *send, size_t sbytes, int dst, void *recv,
                           size_t rbytes, int src) {
    if (sbytes > (size_t)INT32_MAX || rbytes > (size_t)INT32_MAX)
        return dg__err(DG_ERR_ARG, "dg_comm_shift: message over MPI's 2 GiB limit");
    MPI_Request r[2];
    int n = 0, rc = MPI_SUCCESS;
    if (src >= 0)
        rc = MPI_Irecv(recv, (int)rbytes, MPI_BYTE, src, SHIFT_TAG, mcomm(c), &r[n++]);
    if (rc == MPI_SUCCESS && dst >= 0)
        rc = MPI_Isend(send, (int)sbytes, MPI_BYTE, dst, SHIFT_TAG, mcomm(c), &r[n++]);
    if (rc != MPI_SUCCESS)
        return mpi_fail(c, "dg_comm_shift", rc);
    if (n == 0)
        return DG_OK;
    return mpi_wait(c, "dg_comm_shift", n, r);
}

static dg_status mpi_barrier(dg_comm *c) {
    MPI_Request r;
    int rc = MPI_Ibarrier(mcomm(c), &r);
    if (rc != MPI_SUCCESS)
        return mpi_fail(c, "dg_comm_barrier", rc);
    return mpi_wait(c, "dg_comm_barrier", 1, &r);
}

static void mpi_destroy(dg_comm *c) {
    mpi_impl *m = (mpi_impl *)c->impl;
    if (!m)
        return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && m->comm != MPI_COMM_NULL && !c->broken)
        MPI_Comm_free(&m->comm);
    DG_FREE(m);
    c->impl = NULL;
}

static void mpi_abort(dg_comm *c, int code) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin)
        MPI_Abort(c && c->impl ? mcomm(c) : MPI_COMM_WORLD, code);
}

static dg_status mpi_split(dg_comm *c, int color, int key, dg_comm **out);

static const dg__comm_ops g_mpi_ops = {mpi_all_gather, mpi_all_reduce, mpi_shift, mpi_barrier,
                                       mpi_split,      mpi_destroy,    mpi_abort};

/* Wrap an MPI communicator (ownership passes to the result). */
static dg_status mpi_wrap(MPI_Comm mc, double timeout, dg_comm **out) {
    dg_comm *c = NULL;
    dg_status st = dg__comm_alloc(&g_mpi_ops, DG_COMM_MPI, timeout, &c);
    mpi_impl *m = st == DG_OK ? (mpi_impl *)DG_CALLOC(1, sizeof *m) : NULL;
    if (st == DG_OK && !m)
        st = dg__err(DG_ERR_NOMEM, "dg_comm_init_mpi: out of host memory");
    if (st != DG_OK) {
        DG_FREE(c);
        MPI_Comm_free(&mc);
        return st;
    }
    m->comm = mc;
    c->impl = m;
    MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(mc, &c->rank);
    MPI_Comm_size(mc, &c->size);
    *out = c;
    return DG_OK;
}

static dg_status mpi_split(dg_comm *c, int color, int key, dg_comm **out) {
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(mcomm(c), color, key, &nc);
    if (rc != MPI_SUCCESS)
        return mpi_fail(c, "dg_comm_split", rc);
    return mpi_wrap(nc, c->timeout, out);
}

dg_status dg_comm_init_mpi(double timeout_s, dg_comm **out) {
    DG_TRY(dg__check_ptr("dg_comm_init_mpi", "out", out));
    *out = NULL;
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (fin)
        return dg__err(DG_ERR_STATE, "dg_comm_init_mpi: MPI was already finalized");
    if (!init) {
        int provided = 0;
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
            return dg__err(DG_ERR_COMM, "dg_comm_init_mpi: MPI_Init_thread failed");
        g_we_initialised = 1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm dup = MPI_COMM_NULL;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    if (rc != MPI_SUCCESS)
        return dg__err(DG_ERR_COMM, "dg_comm_init_mpi: MPI_Comm_dup failed (%d)", rc);
    return mpi_wrap(dup, timeout_s, out);
}

void dg_comm_finalize(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (g_we_initialised && init && !fin)
        MPI_Finalize();
}

int dg_have_mpi(void) { return 1; }

#else /* !DG_HAVE_MPI */

dg_status dg_comm_init_mpi(double timeout_s, dg_comm **out) {
    (void)timeout_s;
    if (out)
        *out = NULL;
    return dg__err(DG_ERR_UNSUPPORTED,
                   "dg_comm_init_mpi: this build has no MPI (install Open MPI, e.g. "
                   "openmpi-bin libopenmpi-dev, and configure with -DDG_MPI=ON)");
}

void dg_comm_finalize(void) {}

int dg_have_mpi(void) { return 0; }

#endif

/*
 * dist/launch.c -- how this process was started, and the communicator that launch calls for.
 *
 * Launchers describe the job in environment variables: torchrun sets RANK, WORLD_SIZE,
 * LOCAL_RANK and LOCAL_WORLD_SIZE (plus MASTER_ADDR/MASTER_PORT for the bootstrap); Open MPI's
 * mpirun sets OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; other MPI launchers set PMI_*
 * or PMIX_RANK. The tools read this once to pick each rank's GPU (local rank modulo the devices)
 * and the backend: NCCL when every local rank has a GPU of its own, else MPI (which stages CUDA
 * tensors through host memory, so several ranks may share one GPU).
 */
#include "dist.h"

int dg__env_int(const char *name, int *v) {
    const char *e = getenv(name);
    if (!e || !*e)
        return 0;
    char *end = NULL;
    long x = strtol(e, &end, 10);
    if (*end || x < 0 || x > 1 << 30)
        return -1;
    *v = (int)x;
    return 1;
}

dg_launch dg_launch_info(void) {
    dg_launch l;
    memset(&l, 0, sizeof l);
    l.world = 1;
    l.local_world = 1;
    int r = 0, w = 0;
    if (dg__env_int("RANK", &r) > 0 && dg__env_int("WORLD_SIZE", &w) > 0 && w > 0) {
        l.by_torchrun = 1;
        l.rank = r;
        l.world = w;
        int lr = 0, lw = 0;
        l.local_rank = dg__env_int("LOCAL_RANK", &lr) > 0 ? lr : r;
        l.local_world = dg__env_int("LOCAL_WORLD_SIZE", &lw) > 0 && lw > 0 ? lw : w;
        return l;
    }
    if (dg__env_int("OMPI_COMM_WORLD_SIZE", &w) > 0 && w > 0) {
        l.by_mpirun = 1;
        l.world = w;
        int lr = 0, lw = 0;
        if (dg__env_int("OMPI_COMM_WORLD_RANK", &r) > 0)
            l.rank = r;
        l.local_rank = dg__env_int("OMPI_COMM_WORLD_LOCAL_RANK", &lr) > 0 ? lr : l.rank;
        l.local_world = dg__env_int("OMPI_COMM_WORLD_LOCAL_SIZE", &lw) > 0 && lw > 0 ? lw : w;
        return l;
    }
    if (getenv("PMI_SIZE") || getenv("PMIX_RANK")) { /* MPICH and PMIx launchers */
        l.by_mpirun = 1;
        if (dg__env_int("PMI_SIZE", &w) > 0 && w > 0)
            l.world = w;
        if (dg__env_int("PMI_RANK", &r) > 0 || dg__env_int("PMIX_RANK", &r) > 0)
            l.rank = r;
        int lr = 0, lw = 0;
        l.local_rank = dg__env_int("MPI_LOCALRANKID", &lr) > 0 ? lr : l.rank;
        l.local_world = dg__env_int("MPI_LOCALNRANKS", &lw) > 0 && lw > 0 ? lw : l.world;
    }
    return l;
}

dg_device dg_launch_device(dg_device asked, int explicit_index) {
    if (asked.kind != DG_DEV_CUDA || explicit_index)
        return asked;
    const int n = dg_cuda_device_count();
    if (n < 1)
        return asked;
    const dg_launch l = dg_launch_info();
    return dg_cuda(l.local_rank % n);
}

#define OPL "dg_comm_init_launch"
dg_status dg_comm_init_launch(dg_ctx *ctx, dg_comm_pick pick, double timeout_s, dg_comm **out) {
    DG_TRY(dg__check_ptr(OPL, "out", out));
    *out = NULL;
    if (pick != DG_COMM_PICK_AUTO && pick != DG_COMM_PICK_MPI && pick != DG_COMM_PICK_NCCL)
        return dg__err(DG_ERR_ARG, OPL ": pick must be DG_COMM_PICK_AUTO, _MPI or _NCCL, got %d",
                       (int)pick);
    const dg_launch l = dg_launch_info();
    const int cuda = ctx && dg_ctx_device(ctx).kind == DG_DEV_CUDA;
    const int own_gpu = cuda && l.local_world <= dg_cuda_device_count();
    int nccl = pick == DG_COMM_PICK_NCCL;
    if (pick == DG_COMM_PICK_AUTO)
        nccl = cuda && dg_have_nccl() && l.world > 1 && (own_gpu || !dg_have_mpi());
    if (nccl) {
        if (!cuda)
            return dg__err(DG_ERR_DEVICE, OPL ": the NCCL backend needs a CUDA context, got %s",
                           ctx ? dg_device_str(dg_ctx_device(ctx)) : "none");
        if (!own_gpu)
            return dg__err(DG_ERR_ARG,
                           OPL ": %d ranks on this machine but only %d GPU%s; NCCL needs one GPU "
                               "per rank (the MPI backend lets ranks share a GPU: launch with "
                               "mpirun)",
                           l.local_world, dg_cuda_device_count(),
                           dg_cuda_device_count() == 1 ? "" : "s");
        return dg_comm_init_nccl(ctx, timeout_s, out);
    }
    if (l.by_torchrun && l.world > 1 && !l.by_mpirun)
        return dg__err(DG_ERR_ARG,
                       OPL ": started by torchrun (WORLD_SIZE=%d) but %s; launch CPU runs and "
                           "ranks that share a GPU with mpirun",
                       l.world,
                       !cuda             ? "the MPI backend serves CPU tensors"
                       : !dg_have_nccl() ? "this build has no NCCL"
                                         : "the MPI backend was asked for");
    return dg_comm_init_mpi(timeout_s, out);
}

/*
 * dist/nccl.c -- the NCCL backend of dg_comm: CUDA tensors, one process per GPU.
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
#endif

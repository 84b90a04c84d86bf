/*
 * tensor/graph.c -- the public face of CUDA graph capture (dg_graph_*, include/deltagrad.h): the
 * argument checks and the refusal on CPU contexts and builds without CUDA. The capture state,
 * the allocator's rules during a capture and the graphs' memory live in kernels/runtime.cu.
 */
#include "tensor.h"

#ifdef DG_HAVE_CUDA
#include "../kernels/cuda_api.h"
#endif

/* A CUDA context (not NULL), else the error of `op`. */
static dg_status graph_ctx(const char *op, const dg_ctx *ctx) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    if (ctx->device.kind != DG_DEV_CUDA)
        return dg__err(DG_ERR_UNSUPPORTED,
                       "%s: CUDA graphs need a CUDA context, got %s (a CPU context runs every call "
                       "at once: there is nothing to capture)",
                       op, dg_device_str(ctx->device));
#ifdef DG_HAVE_CUDA
    return DG_OK;
#else
    return dg__no_cuda(op);
#endif
}

dg_status dg_graph_begin(dg_ctx *ctx) {
    DG_TRY(graph_ctx("dg_graph_begin", ctx));
#ifdef DG_HAVE_CUDA
    return dg__cuda_graph_begin(ctx);
#else
    return DG_ERR_UNSUPPORTED;
#endif
}

dg_status dg_graph_end(dg_ctx *ctx, dg_graph **out) {
    DG_TRY(dg__check_ptr("dg_graph_end", "out", out));
    *out = NULL;
    DG_TRY(graph_ctx("dg_graph_end", ctx));
#ifdef DG_HAVE_CUDA
    return dg__cuda_graph_end(ctx, out);
#else
    return DG_ERR_UNSUPPORTED;
#endif
}

dg_status dg_graph_launch(dg_ctx *ctx, const dg_graph *g) {
    DG_TRY(graph_ctx("dg_graph_launch", ctx));
    DG_TRY(dg__check_ptr("dg_graph_launch", "g", g));
#ifdef DG_HAVE_CUDA
    return dg__cuda_graph_launch(ctx, g);
#else
    return DG_ERR_UNSUPPORTED;
#endif
}

void dg_graph_free(dg_graph **g) {
    if (!g || !*g)
        return;
#ifdef DG_HAVE_CUDA
    dg__cuda_graph_free(*g);
#endif
    *g = NULL;
}

int dg_graph_capturing(const dg_ctx *ctx) {
#ifdef DG_HAVE_CUDA
    return dg__cuda_capturing(ctx);
#else
    (void)ctx;
    return 0;
#endif
}

dg_status dg__no_capture(const char *op, const dg_ctx *ctx, const char *what) {
    if (!dg_graph_capturing(ctx))
        return DG_OK;
    return dg__err(DG_ERR_STATE,
                   "%s: %s is capturing a CUDA graph (between dg_graph_begin and dg_graph_end): "
                   "%s makes the host wait for the device, which a capture cannot hold; do it "
                   "before dg_graph_begin, or after dg_graph_end / dg_graph_launch",
                   op, dg_device_str(ctx->device), what);
}

/*
 * tensor/stage.c -- staged uploads (dg_stage, include/deltagrad.h): two host buffers used in
 * turn, each with the event recorded after the last copy out of it. On CUDA the buffers are
 * page-locked (kernels/runtime.cu), so cudaMemcpyAsync from them returns at once and the copy
 * runs in stream order; before a buffer is handed out again the host waits for its event, which
 * is the only wait. On the CPU the buffers are plain memory and an upload is a memcpy.
 */
#include "tensor.h"

#ifdef DG_HAVE_CUDA
#include "../kernels/cuda_api.h"
#endif

struct dg_stage {
    dg_ctx *ctx;
    size_t bytes;
    void *buf[2];
    void *ev[2]; /* CUDA: the event after the last copy out of buf[i] (NULL on the CPU) */
    int cur;     /* the buffer handed out by dg_stage_next and not uploaded yet, or -1 */
    int last;    /* the buffer of the last upload (the next one is the other) */
};

static int on_cuda(const dg_stage *s) { return s->ctx->device.kind == DG_DEV_CUDA; }

void dg_stage_free(dg_stage **sp) {
    if (!sp || !*sp)
        return;
    dg_stage *s = *sp;
    for (int i = 0; i < 2; i++) {
#ifdef DG_HAVE_CUDA
        if (on_cuda(s)) {
            /* a copy may still read the buffer: wait for it (errors: nothing left to do) */
            if (s->ev[i] && dg__cuda_event_wait(s->ev[i]) != DG_OK)
                dg_clear_error();
            dg__cuda_event_free(s->ev[i]);
            dg__cuda_host_free(s->buf[i]);
            continue;
        }
#endif
        DG_FREE(s->buf[i]);
    }
    DG_FREE(s);
    *sp = NULL;
}

dg_status dg_stage_new(dg_ctx *ctx, size_t bytes, dg_stage **out) {
    const char *op = "dg_stage_new";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__no_capture(op, ctx, "allocating page-locked host memory"));
    dg_stage *s = DG_CALLOC(1, sizeof *s);
    if (!s)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    s->ctx = ctx;
    s->bytes = bytes;
    s->cur = -1;
    s->last = 1; /* the first dg_stage_next hands out buf[0] */
    dg_status st = DG_OK;
    for (int i = 0; i < 2 && st == DG_OK; i++) {
        if (ctx->device.kind == DG_DEV_CUDA) {
#ifdef DG_HAVE_CUDA
            st = dg__cuda_host_alloc(ctx, bytes, &s->buf[i]);
            if (st == DG_OK)
                st = dg__cuda_event_new(ctx, &s->ev[i]);
#else
            st = dg__no_cuda(op);
#endif
        } else {
            s->buf[i] = DG_MALLOC(bytes ? bytes : 1);
            if (!s->buf[i])
                st = dg__err(DG_ERR_NOMEM, "%s: no host memory for 2 x %zu bytes", op, bytes);
        }
    }
    if (st != DG_OK) {
        dg_stage_free(&s);
        return st;
    }
    *out = s;
    return DG_OK;
}

dg_status dg_stage_next(dg_stage *s, void **buf) {
    const char *op = "dg_stage_next";
    DG_TRY(dg__check_ptr(op, "buf", buf));
    *buf = NULL;
    DG_TRY(dg__check_ptr(op, "s", s));
    DG_TRY(dg__no_capture(op, s->ctx, "waiting for the copy out of the buffer"));
    if (s->cur < 0) {
        const int i = 1 - s->last;
#ifdef DG_HAVE_CUDA
        if (on_cuda(s))
            DG_TRY(dg__cuda_event_wait(s->ev[i]));
#endif
        s->cur = i;
    }
    *buf = s->buf[s->cur];
    return DG_OK;
}

dg_status dg_stage_upload(dg_stage *s, dg_tensor *dst) {
    const char *op = "dg_stage_upload";
    DG_TRY(dg__check_ptr(op, "s", s));
    DG_TRY(dg__check_ptr(op, "dst", dst));
    DG_TRY(dg__check_device(op, "dst", dst, s->ctx));
    if (!dg_tensor_is_contiguous(dst))
        return dg__err(DG_ERR_ARG, "%s: dst %s must be contiguous", op, dg_tensor_desc(dst));
    const size_t n = dg_tensor_nbytes(dst);
    if (n > s->bytes)
        return dg__err(DG_ERR_ARG,
                       "%s: dst %s holds %zu bytes, more than the stage's buffers (%zu bytes)", op,
                       dg_tensor_desc(dst), n, s->bytes);
    DG_TRY(dg__no_capture(op, s->ctx,
                          "an upload from a host buffer (a replay would read the "
                          "buffer at launch time)"));
    if (s->cur < 0)
        return dg__err(DG_ERR_STATE,
                       "%s: no buffer to upload: call dg_stage_next and fill the buffer it "
                       "returns first",
                       op);
    const int i = s->cur;
    if (!on_cuda(s)) {
        if (n)
            memcpy(dg_tensor_data(dst), s->buf[i], n);
    } else {
#ifdef DG_HAVE_CUDA
        DG_TRY(dg__cuda_memcpy_h2d_async(s->ctx, dg_tensor_data(dst), s->buf[i], n));
        DG_TRY(dg__cuda_event_record(s->ctx, s->ev[i]));
#else
        return dg__no_cuda(op);
#endif
    }
    s->last = i;
    s->cur = -1;
    return DG_OK;
}

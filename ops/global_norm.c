/*
 * ops/global_norm.c -- dg_global_norm: sqrt(sum over tensors of sum of squares), e.g. the
 * gradient norm for clipping. Not recorded on the tape.
 *
 * Deterministic: each tensor's sum of squares is taken in f64 with a reduction order that
 * depends only on its size (CPU: fixed 64Ki-element chunks summed in chunk order; CUDA:
 * kernels/global_norm.cu), the per-tensor sums are added on the host in f64 in list order. On
 * CUDA the per-tensor sums land in one device array read back with a single sync. NULL entries
 * (parameters without a gradient) count as zero. Any float dtype; a NaN or inf comes through.
 */
#include "../tensor/tensor.h"

#include <math.h>

#ifdef DG_HAVE_CUDA
#include "../kernels/global_norm.cuh"
#endif

#define CHUNK ((int64_t)1 << 16)

static double sumsq_cpu(const dg_tensor *t) {
    const int64_t n = dg_tensor_numel(t), nch = (n + CHUNK - 1) / CHUNK;
    const void *x = dg_tensor_data(t);
    if (nch <= 1) {
        double s = 0;
        for (int64_t i = 0; i < n; i++) {
            double e = dg__load_f64(x, t->dtype, i);
            s += e * e;
        }
        return s;
    }
    double *part = DG_MALLOC((size_t)nch * sizeof *part);
    if (!part) { /* no room for partials: one serial pass, still deterministic */
        double s = 0;
        for (int64_t i = 0; i < n; i++) {
            double e = dg__load_f64(x, t->dtype, i);
            s += e * e;
        }
        return s;
    }
#ifdef _OPENMP
#pragma omp parallel for
#endif
    for (int64_t c = 0; c < nch; c++) {
        int64_t e0 = c * CHUNK, e1 = e0 + CHUNK < n ? e0 + CHUNK : n;
        double s = 0;
        for (int64_t i = e0; i < e1; i++) {
            double e = dg__load_f64(x, t->dtype, i);
            s += e * e;
        }
        part[c] = s;
    }
    double s = 0;
    for (int64_t c = 0; c < nch; c++)
        s += part[c];
    DG_FREE(part);
    return s;
}

dg_status dg_global_norm(dg_ctx *ctx, const dg_tensor *const *ts, int n, double *out) {
    const char *op = "dg_global_norm";
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = 0;
    if (n < 0)
        return dg__err(DG_ERR_ARG, "%s: n = %d is negative", op, n);
    if (n > 0)
        DG_TRY(dg__check_ptr(op, "ts", ts));
    for (int i = 0; i < n; i++) {
        if (!ts[i])
            continue;
        char arg[32];
        snprintf(arg, sizeof arg, "ts[%d]", i);
        DG_TRY(dg__check_dtype(op, arg, ts[i], DG_FLOATS));
        DG_TRY(dg__check_device(op, arg, ts[i], ctx));
    }
    const int cuda = ctx->device.kind == DG_DEV_CUDA;
    double total = 0;
    if (!cuda) {
        for (int i = 0; i < n; i++) {
            if (!ts[i])
                continue;
            dg_tensor *c = NULL;
            DG_TRY(dg__contig(ctx, (dg_tensor *)ts[i], &c));
            total += sumsq_cpu(c);
            dg_tensor_free(&c);
        }
        *out = sqrt(total);
        return DG_OK;
    }
#ifdef DG_HAVE_CUDA
    if (n == 0)
        return DG_OK;
    /* scratch: DG_SUMSQ_MAX_BLOCKS partials, then one sum per tensor */
    int64_t len = DG_SUMSQ_MAX_BLOCKS + n;
    dg_tensor *scratch = NULL;
    DG_TRY(dg_tensor_zeros(ctx, DG_F64, 1, &len, &scratch));
    double *part = dg__f64(scratch), *sums = part + DG_SUMSQ_MAX_BLOCKS;
    dg_status s = DG_OK;
    for (int i = 0; i < n && s == DG_OK; i++) {
        if (!ts[i] || dg_tensor_numel(ts[i]) == 0)
            continue;
        dg_tensor *c = NULL;
        s = dg__contig(ctx, (dg_tensor *)ts[i], &c);
        if (s == DG_OK)
            s = dg__sumsq_cuda(ctx, c->dtype, dg_tensor_data(c), dg_tensor_numel(c), part,
                               sums + i);
        dg_tensor_free(&c);
    }
    double *host = NULL;
    if (s == DG_OK)
        s = dg_tensor_to_f64(scratch, &host);
    if (s == DG_OK) {
        for (int i = 0; i < n; i++)
            total += host[DG_SUMSQ_MAX_BLOCKS + i];
        *out = sqrt(total);
    }
    free(host);
    dg_tensor_free(&scratch);
    return s;
#else
    return dg__no_cuda(op);
#endif
}

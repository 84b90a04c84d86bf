/*
 * ops/embedding.c -- dg_embedding: rows of a table picked by integer ids.
 *
 *   y[s, :] = W[ids[s], :]               W [Vocab, d], ids i32/i64 of any shape S -> y [S..., d]
 *   dW[v, :] = sum_{s : ids[s] = v} dy[s, :]     (no gradient for ids)
 *
 * Ids outside [0, Vocab) are an error (DG_ERR_ARG naming the first bad position and its value);
 * on CUDA the gather kernel records them in the context's bad-input record (a zero row each) and
 * the op reads it back (one sync per call), or, with dg_ctx_defer_checks, leaves it for
 * dg_ctx_check_errors. The backward gives such ids no gradient.
 * Backward is deterministic on both devices: each row of dW sums its tokens in position order
 * (CPU: a serial pass over tokens per column block; CUDA: kernels/embedding.cu sorts positions
 * by id with a stable radix sort, then one block per row sums its run in order).
 */
#ifndef DG_REF_TMPL
#include "../autograd/tape.h"

#ifdef DG_HAVE_CUDA
#include "../kernels/cuda_api.h"
#include "../kernels/embedding.cuh"
#endif

static int64_t id_at(const void *ids, dg_dtype dt, int64_t i) {
    return dt == DG_I32 ? (int64_t)((const int32_t *)ids)[i] : ((const int64_t *)ids)[i];
}

/* "[1,3]": the multi-index of flat position i in shape. */
static void index_str(char *buf, size_t n, int ndim, const int64_t *shape, int64_t i) {
    int64_t c[DG_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        c[d] = shape[d] ? i % shape[d] : 0;
        i = shape[d] ? i / shape[d] : 0;
    }
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", d ? "," : "", (long long)c[d]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
}

dg_status dg__embedding_bad_id(const dg_tensor *ids, const dg_tensor *w, int64_t pos, int64_t id) {
    char where[96];
    index_str(where, sizeof where, ids->ndim, ids->shape, pos);
    return dg__err(DG_ERR_ARG, "dg_embedding: ids%s = %lld is outside [0, %lld) (weight %s)", where,
                   (long long)id, (long long)w->shape[0], dg_tensor_desc(w));
}

#ifdef _OPENMP
#define EMB_PARALLEL_FOR _Pragma("omp parallel for if (n * d > (1 << 16))")
#else
#define EMB_PARALLEL_FOR
#endif

/* y[i,:] = w[ids[i],:] (rows of `esize`-byte elements) */
static void emb_fwd(const void *w, size_t esize, int64_t d, const void *ids, dg_dtype idt,
                    int64_t n, void *y) {
    const size_t row = (size_t)d * esize;
    EMB_PARALLEL_FOR
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)y + (size_t)i * row, (const char *)w + (size_t)id_at(ids, idt, i) * row,
               row);
}

#define DG_REF_TMPL "embedding.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference

/* dw = 0, then dw[ids[i],:] += dy[i,:]: column blocks in parallel, tokens in order within one. */
static void RF(emb_bwd)(RT *dw, int64_t V, int64_t d, const void *ids, dg_dtype idt, int64_t n,
                        const RT *dy) {
    memset(dw, 0, (size_t)(V * d) * sizeof(RT));
    int64_t nblk = (d + 63) / 64;
    EMB_PARALLEL_FOR
    for (int64_t b = 0; b < nblk; b++) {
        int64_t c0 = b * 64, c1 = c0 + 64 < d ? c0 + 64 : d;
        for (int64_t i = 0; i < n; i++) {
            RT *row = dw + id_at(ids, idt, i) * d;
            const RT *g = dy + i * d;
            for (int64_t c = c0; c < c1; c++)
                row[c] += g[c];
        }
    }
}

#else

// ---- backward

typedef struct {
    int64_t V, d;
} emb_params;

static dg_status embedding_backward(dg_ctx *ctx, dg_node *nd) {
    const emb_params *p = nd->params;
    dg_tensor *ids = nd->saved[0], *gy = NULL, *gw = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)dg__node_grad_out(nd, 0), &gy));
    int64_t shape[2] = {p->V, p->d}, n = dg_tensor_numel(ids);
    dg_status s = dg_tensor_new(ctx, gy->dtype, 2, shape, &gw);
    if (s == DG_OK) {
        if (gw->device.kind == DG_DEV_CPU) {
            if (gw->dtype == DG_F64)
                emb_bwd_f64(dg__f64(gw), p->V, p->d, dg_tensor_data(ids), ids->dtype, n,
                            dg__f64(gy));
            else
                emb_bwd_f32(dg__f32(gw), p->V, p->d, dg_tensor_data(ids), ids->dtype, n,
                            dg__f32(gy));
        } else {
#ifdef DG_HAVE_CUDA
            s = dg__embedding_bwd_cuda(ctx, gw->dtype, dg_tensor_data(gw), p->V, p->d, ids->dtype,
                                       dg_tensor_data(ids), n, dg_tensor_data(gy));
#else
            s = dg__no_cuda("dg_embedding backward");
#endif
        }
    }
    if (s == DG_OK)
        s = dg__node_accum(ctx, nd, 0, gw);
    dg_tensor_free(&gw);
    dg_tensor_free(&gy);
    return s;
}

// ---- forward

dg_status dg_embedding(dg_ctx *ctx, dg_tensor *weight, dg_tensor *ids, dg_tensor **out) {
    const char *op = "dg_embedding";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_shape(op, "weight", weight, 2, (int64_t[]){-1, -1}));
    DG_TRY(dg__check_dtype(op, "weight", weight, DG_FLOATS));
    DG_TRY(dg__check_ptr(op, "ids", ids));
    DG_TRY(dg__check_dtype(op, "ids", ids, DG_INTS));
    DG_TRY(dg__check_device(op, "weight", weight, ctx));
    DG_TRY(dg__check_device(op, "ids", ids, ctx));
    int cuda = weight->device.kind == DG_DEV_CUDA;
    if (!cuda && weight->dtype == DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "%s: bf16 is a CUDA dtype; on the CPU use f32 or f64 (weight %s)", op,
                       dg_tensor_desc(weight));
    if (cuda && weight->dtype == DG_F64)
        return dg__err(DG_ERR_DTYPE, "%s: CUDA kernels take f32 or bf16 weights, got %s", op,
                       dg_tensor_desc(weight));
#ifndef DG_HAVE_CUDA
    if (cuda)
        return dg__no_cuda(op);
#endif
    if (ids->ndim >= DG_MAX_DIMS)
        return dg__err(DG_ERR_SHAPE,
                       "%s: ids %s has %d dims; the output adds one and at most %d are allowed", op,
                       dg_tensor_desc(ids), ids->ndim, DG_MAX_DIMS);
    const int64_t V = weight->shape[0], d = weight->shape[1], n = dg_tensor_numel(ids);
    int64_t shape[DG_MAX_DIMS];
    memcpy(shape, ids->shape, (size_t)ids->ndim * sizeof *shape);
    shape[ids->ndim] = d;

    dg_tensor *ic = NULL, *wc = NULL, *y = NULL;
    DG_TRY(dg__contig(ctx, ids, &ic));
    dg_status s = dg__contig(ctx, weight, &wc);
    if (s == DG_OK)
        s = dg_tensor_new(ctx, weight->dtype, ids->ndim + 1, shape, &y);
    if (s == DG_OK && !cuda) {
        const void *iv = dg_tensor_data(ic);
        for (int64_t i = 0; i < n && s == DG_OK; i++) {
            int64_t id = id_at(iv, ic->dtype, i);
            if (id < 0 || id >= V)
                s = dg__embedding_bad_id(ids, weight, i, id);
        }
        if (s == DG_OK)
            emb_fwd(dg_tensor_data(wc), dg_dtype_size(wc->dtype), d, iv, ic->dtype, n,
                    dg_tensor_data(y));
    } else if (s == DG_OK) {
#ifdef DG_HAVE_CUDA
        dg_deverr_site site;
        memset(&site, 0, sizeof site);
        site.kind = DG_DEVERR_EMBEDDING_ID;
        site.idx_ndim = ids->ndim;
        memcpy(site.idx_shape, ids->shape, (size_t)ids->ndim * sizeof *ids->shape);
        site.ref_dtype = (int32_t)weight->dtype;
        site.ref_ndim = 2;
        site.ref_shape[0] = V;
        site.ref_shape[1] = d;
        s = dg__embedding_fwd_cuda(ctx, weight->dtype, dg_tensor_data(wc), V, d, ic->dtype,
                                   dg_tensor_data(ic), n, dg_tensor_data(y), &site);
        if (s == DG_OK && !ctx->defer_checks)
            s = dg_ctx_check_errors(ctx);
#endif
    }
    dg_tensor_free(&wc);
    if (s == DG_OK && dg__needs_grad(1, &weight)) {
        dg_node *nd;
        s = dg__node_new("embedding", DG_POLICY_CACHE, embedding_backward, ctx, &nd);
        if (s == DG_OK) {
            dg__node_input(nd, weight);
            dg__node_output(nd, y);
            dg__node_save(nd, ic); /* the contiguous ids */
            s = dg__node_commit_params(nd, &(emb_params){.V = V, .d = d}, sizeof(emb_params));
        }
    }
    dg_tensor_free(&ic);
    if (s != DG_OK) {
        dg_tensor_free(&y);
        return s;
    }
    *out = y;
    return DG_OK;
}
#endif

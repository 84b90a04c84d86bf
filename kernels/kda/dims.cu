/*
 * kernels/kda/dims.cu -- the device copy of the KDA sequence/chunk tables (kda.md §11.8) that every
 * chunked stage reads. Entry points (kda_cuda.h): dg__kda_cuda_dims_new, dg__kda_cuda_dims_free.
 *
 * One device allocation holds, in this order (int64 first so every array stays aligned):
 *   cu [N+1], chunk_off [N+1], chunk_t0 [NC]   (int64)
 *   chunk_len [NC], chunk_seq [NC]             (int32)
 * Chunks are numbered sequence by sequence (chunk_off[n] + c), the same numbering as the rows of
 * h in the CPU reference, so the parallel kernels use blockIdx.x as the global chunk index.
 */
#include "common.cuh"

#include <string.h>

extern "C" dg_status dg__kda_cuda_dims_new(dg_ctx *ctx, int64_t TT, int H, int HV, int K, int V,
                                           int BT, int N, const int64_t *cu_host,
                                           const int64_t *chunk_off_host, kda_cuda_dims *out) {
    static const char *op = "dg__kda_cuda_dims_new";
    if (!out)
        return dg__err(DG_ERR_ARG, "%s: out is NULL", op);
    memset(out, 0, sizeof *out);
    if (!ctx || !cu_host || !chunk_off_host)
        return dg__err(DG_ERR_ARG, "%s: ctx, cu_host and chunk_off_host must not be NULL", op);
    if (BT != 16 && BT != 32 && BT != 64)
        return dg__err(DG_ERR_ARG, "%s: BT must be 16, 32 or 64, got %d", op, BT);
    if (N < 1 || TT < 1 || H < 1 || HV < 1 || HV % H != 0)
        return dg__err(DG_ERR_SHAPE,
                       "%s: need N, TT, H, HV >= 1 and HV %% H == 0, got N=%d "
                       "TT=%lld H=%d HV=%d",
                       op, N, (long long)TT, H, HV);
    /* the recurrent kernel keeps K/32 state rows per lane in registers (at most 8) */
    if (K < 1 || K > 256 || V < 1)
        return dg__err(DG_ERR_SHAPE,
                       "%s: the CUDA KDA kernels need 1 <= K <= 256 and V >= 1, "
                       "got K=%d V=%d",
                       op, K, V);
    if (cu_host[0] != 0 || cu_host[N] != TT || chunk_off_host[0] != 0)
        return dg__err(DG_ERR_ARG,
                       "%s: cu must run from 0 to TT=%lld and chunk_off start at 0 "
                       "(got cu[0]=%lld cu[N]=%lld chunk_off[0]=%lld)",
                       op, (long long)TT, (long long)cu_host[0], (long long)cu_host[N],
                       (long long)chunk_off_host[0]);
    for (int n = 0; n < N; n++) {
        int64_t len = cu_host[n + 1] - cu_host[n];
        if (len < 0 || chunk_off_host[n + 1] - chunk_off_host[n] != (len + BT - 1) / BT)
            return dg__err(DG_ERR_ARG,
                           "%s: sequence %d has %lld tokens but chunk_off gives it "
                           "%lld chunks of %d",
                           op, n, (long long)len,
                           (long long)(chunk_off_host[n + 1] - chunk_off_host[n]), BT);
    }
    const int64_t NC = chunk_off_host[N];
    const size_t n64 = 2 * ((size_t)N + 1) + (size_t)NC, n32 = 2 * (size_t)NC;
    const size_t bytes = n64 * sizeof(int64_t) + n32 * sizeof(int32_t);
    char *host = (char *)DG_MALLOC(bytes);
    if (!host)
        return dg__err(DG_ERR_NOMEM, "%s: no host memory for the chunk tables (%zu bytes)", op,
                       bytes);
    int64_t *cu = (int64_t *)host, *off = cu + N + 1, *t0 = off + N + 1;
    int32_t *len = (int32_t *)(t0 + NC), *seq = len + NC;
    memcpy(cu, cu_host, sizeof(int64_t) * ((size_t)N + 1));
    memcpy(off, chunk_off_host, sizeof(int64_t) * ((size_t)N + 1));
    for (int n = 0; n < N; n++)
        for (int64_t c = chunk_off_host[n]; c < chunk_off_host[n + 1]; c++) {
            t0[c] = cu_host[n] + (c - chunk_off_host[n]) * BT;
            int64_t left = cu_host[n + 1] - t0[c];
            len[c] = (int32_t)(left < BT ? left : BT);
            seq[c] = n;
        }
    /* the context's copy when it has (or can keep) one: no upload, no sync after the first call
     * with these sequences; else a copy owned by out (buf_bytes > 0) */
    const void *shared = NULL;
    void *dev = NULL;
    size_t own = 0;
    dg_status st = dg__cuda_table(ctx, host, bytes, &shared);
    if (st == DG_OK && shared) {
        dev = (void *)shared;
    } else if (st == DG_OK) {
        st = dg__cuda_malloc(ctx, bytes, &dev);
        if (st == DG_OK) {
            own = bytes;
            st = dg__cuda_memcpy(ctx, dev, host, bytes, DG_COPY_H2D);
        }
    }
    DG_FREE(host);
    if (st != DG_OK) {
        if (own)
            dg__cuda_free(ctx, dev, own);
        return st;
    }
    out->TT = TT;
    out->H = H;
    out->HV = HV;
    out->K = K;
    out->V = V;
    out->BT = BT;
    out->N = N;
    out->NC = NC;
    const int64_t *dcu = (const int64_t *)dev;
    out->cu = dcu;
    out->chunk_off = dcu + N + 1;
    out->chunk_t0 = dcu + 2 * (N + 1);
    out->chunk_len = (const int32_t *)(out->chunk_t0 + NC);
    out->chunk_seq = out->chunk_len + NC;
    out->buf = dev;
    out->buf_bytes = own;
    return DG_OK;
}

extern "C" void dg__kda_cuda_dims_free(dg_ctx *ctx, kda_cuda_dims *d) {
    if (!d)
        return;
    if (ctx && d->buf && d->buf_bytes)
        dg__cuda_free(ctx, d->buf, d->buf_bytes);
    memset(d, 0, sizeof *d);
}

extern "C" int dg__kda_mid_fits(const kda_cuda_dims *d) {
    return d && d->tc == 1 && d->K % 16 == 0 && d->K <= 256 && d->V % 16 == 0;
}

extern "C" int dg__kda_qk_fits(const kda_cuda_dims *d, const void *q, const void *k) {
    return d && d->tc == 1 && d->K % 16 == 0 && aligned16(q) && aligned16(k);
}

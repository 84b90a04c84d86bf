/*
 * kernels/embedding.cu -- embedding gather (forward) and its deterministic scatter-add (backward).
 *
 * Backward without atomics on floats: a token's gradient row must be added into the row of its id,
 * and many tokens share an id. We sort the pairs (id, position) by id with CUB's stable radix
 * sort, so each id's positions form one run in increasing position order; one block per
 * vocabulary row finds its run by binary search and sums dy over it in that fixed order. The
 * result is bitwise reproducible, and matches the CPU reference's summation order.
 */
#include "common.cuh"
#include "embedding.cuh"

#include <cub/device/device_radix_sort.cuh>
#include <limits.h>

// ---- CUDA kernels

template <typename T, typename I>
__global__ void embedding_fwd_kernel(const T *weight, int64_t V, int64_t d, const I *ids, int64_t n,
                                     T *out, unsigned long long *bad) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        int64_t id = (int64_t)ids[i];
        T *o = out + i * d;
        if (id < 0 || id >= V) {
            if (threadIdx.x == 0)
                atomicMin(bad, (unsigned long long)i);
            for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
                dg_st(o, c, 0.0f);
            continue;
        }
        const T *w = weight + id * d;
        for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
            o[c] = w[c];
    }
}

/* An id outside [0, V) (recorded by the forward; possible with deferred checks) gets key V: it
 * sorts after every row and no row's run includes it. */
template <typename I>
__global__ void embedding_keys_kernel(const I *ids, int64_t n, int64_t V, unsigned int *keys,
                                      int *pos) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t id = (int64_t)ids[i];
        keys[i] = (unsigned int)(id >= 0 && id < V ? id : V);
        pos[i] = (int)i;
    }
}

/* First index in sorted keys[0, n) whose key is >= v. */
__device__ __forceinline__ int64_t lower_bound(const unsigned int *keys, int64_t n,
                                               unsigned int v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) >> 1;
        if (keys[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

template <typename T>
__global__ void embedding_bwd_kernel(const unsigned int *keys, const int *pos, int64_t n,
                                     const T *dy, int64_t V, int64_t d, T *dweight) {
    __shared__ int64_t run[2];
    for (int64_t v = blockIdx.x; v < V; v += gridDim.x) {
        if (threadIdx.x == 0) {
            run[0] = lower_bound(keys, n, (unsigned int)v);
            run[1] = lower_bound(keys, n, (unsigned int)v + 1u);
        }
        __syncthreads();
        int64_t start = run[0], end = run[1];
        for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
            float acc = 0.0f;
            for (int64_t p = start; p < end; p++)
                acc += dg_ld(dy, (int64_t)pos[p] * d + c);
            dg_st(dweight, v * d + c, acc);
        }
        __syncthreads(); /* run[] is rewritten for the next row */
    }
}

// ---- kernel launchers

template <typename T, typename I>
static dg_status launch_fwd(dg_ctx *ctx, const void *w, int64_t V, int64_t d, const void *ids,
                            int64_t n, void *out, unsigned long long *bad) {
    int threads = d >= 256 ? 256 : d >= 128 ? 128 : 64;
    embedding_fwd_kernel<T, I><<<dg__blocks(n, 1), threads, 0, dg__stream(ctx)>>>(
        (const T *)w, V, d, (const I *)ids, n, (T *)out, bad);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__embedding_fwd_cuda(dg_ctx *ctx, dg_dtype wdt, const void *weight,
                                            int64_t V, int64_t d, dg_dtype idt, const void *ids,
                                            int64_t n, void *out, const dg_deverr_site *site) {
    if (n <= 0 || d <= 0)
        return DG_OK;
    if (wdt != DG_F32 && wdt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "embedding (cuda): weight dtype %s, expected f32 or bf16",
                       dg_dtype_name(wdt));
    unsigned long long *bad = &dg__deverr(ctx)->pending;
    dg_status s;
    if (wdt == DG_F32 && idt == DG_I32)
        s = launch_fwd<float, int32_t>(ctx, weight, V, d, ids, n, out, bad);
    else if (wdt == DG_F32)
        s = launch_fwd<float, int64_t>(ctx, weight, V, d, ids, n, out, bad);
    else if (idt == DG_I32)
        s = launch_fwd<__nv_bfloat16, int32_t>(ctx, weight, V, d, ids, n, out, bad);
    else
        s = launch_fwd<__nv_bfloat16, int64_t>(ctx, weight, V, d, ids, n, out, bad);
    DG_TRY(s);
    return dg__deverr_commit(ctx, site, idt, ids);
}

/* Scratch for the sort: CUB's temp storage, then keys and positions in and out (256-B aligned). */
typedef struct {
    void *tmp;
    size_t tmp_bytes;
    unsigned int *keys_in, *keys;
    int *pos_in, *pos;
} sort_bufs;

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

static dg_status bwd_run(dg_ctx *ctx, dg_dtype wdt, void *dweight, int64_t V, int64_t d,
                         dg_dtype idt, const void *ids, int64_t n, const void *dy, int end_bit,
                         const sort_bufs *sb) {
    cudaStream_t st = dg__stream(ctx);
    if (idt == DG_I32)
        embedding_keys_kernel<int32_t><<<dg__blocks(n, 256), 256, 0, st>>>(
            (const int32_t *)ids, n, V, sb->keys_in, sb->pos_in);
    else
        embedding_keys_kernel<int64_t><<<dg__blocks(n, 256), 256, 0, st>>>(
            (const int64_t *)ids, n, V, sb->keys_in, sb->pos_in);
    DG_CHECK_LAUNCH();
    size_t tb = sb->tmp_bytes;
    DG_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(sb->tmp, tb, sb->keys_in, sb->keys, sb->pos_in,
                                                  sb->pos, (int)n, 0, end_bit, st));
    int threads = d >= 256 ? 256 : d >= 128 ? 128 : 64;
    unsigned blocks = dg__blocks(V, 1);
    if (wdt == DG_F32)
        embedding_bwd_kernel<float><<<blocks, threads, 0, st>>>(
            sb->keys, sb->pos, n, (const float *)dy, V, d, (float *)dweight);
    else
        embedding_bwd_kernel<__nv_bfloat16><<<blocks, threads, 0, st>>>(
            sb->keys, sb->pos, n, (const __nv_bfloat16 *)dy, V, d, (__nv_bfloat16 *)dweight);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__embedding_bwd_cuda(dg_ctx *ctx, dg_dtype wdt, void *dweight, int64_t V,
                                            int64_t d, dg_dtype idt, const void *ids, int64_t n,
                                            const void *dy) {
    if (V <= 0 || d <= 0)
        return DG_OK;
    if (wdt != DG_F32 && wdt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "embedding (cuda): weight dtype %s, expected f32 or bf16",
                       dg_dtype_name(wdt));
    if (n > INT_MAX || V >= (int64_t)UINT_MAX)
        return dg__err(DG_ERR_ARG,
                       "embedding (cuda): backward supports up to 2^31-1 ids and 2^32-2 rows, "
                       "got %lld ids and %lld rows",
                       (long long)n, (long long)V);
    if (n == 0) {
        DG_CHECK_CUDA(
            cudaMemsetAsync(dweight, 0, (size_t)(V * d) * dg_dtype_size(wdt), dg__stream(ctx)));
        return DG_OK;
    }
    int end_bit = 1; /* sort only the bits a key can have (keys are at most V) */
    while (end_bit < 32 && ((uint64_t)1 << end_bit) <= (uint64_t)V)
        end_bit++;
    sort_bufs sb;
    memset(&sb, 0, sizeof sb);
    DG_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
        NULL, sb.tmp_bytes, (const unsigned int *)NULL, (unsigned int *)NULL, (const int *)NULL,
        (int *)NULL, (int)n, 0, end_bit, dg__stream(ctx)));
    size_t arr = align256((size_t)n * 4), head = align256(sb.tmp_bytes);
    size_t total = head + 4 * arr;
    void *buf = NULL;
    DG_TRY(dg__cuda_malloc(ctx, total, &buf));
    char *b = (char *)buf;
    sb.tmp = b;
    sb.keys_in = (unsigned int *)(b + head);
    sb.keys = (unsigned int *)(b + head + arr);
    sb.pos_in = (int *)(b + head + 2 * arr);
    sb.pos = (int *)(b + head + 3 * arr);
    dg_status s = bwd_run(ctx, wdt, dweight, V, d, idt, ids, n, dy, end_bit, &sb);
    dg__cuda_free(ctx, buf, total);
    return s;
}

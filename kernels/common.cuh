/*
 * kernels/common.cuh -- what every .cu file shares: the checked-call macros, grid arithmetic, and
 * the bf16/f32 load/store helpers that let one kernel template serve both activation dtypes.
 */
#ifndef DG_KERNELS_COMMON_CUH
#define DG_KERNELS_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>

#include "cuda_api.h"

#define DG_CHECK_CUDA(expr)                                                                        \
    do {                                                                                           \
        cudaError_t dg__e = (expr);                                                                \
        if (dg__e != cudaSuccess)                                                                  \
            return dg__err(DG_ERR_CUDA, "%s failed: %s (%s, %s:%d)", #expr,                        \
                           cudaGetErrorString(dg__e), __func__, __FILE__, __LINE__);               \
    } while (0)

#define DG_CHECK_CUBLAS(expr)                                                                      \
    do {                                                                                           \
        cublasStatus_t dg__e = (expr);                                                             \
        if (dg__e != CUBLAS_STATUS_SUCCESS)                                                        \
            return dg__err(DG_ERR_CUBLAS, "%s failed: %s (%s, %s:%d)", #expr,                      \
                           cublasGetStatusString(dg__e), __func__, __FILE__, __LINE__);            \
    } while (0)

/* After every launch: a bad configuration shows up here, not at the next sync. */
#define DG_CHECK_LAUNCH() DG_CHECK_CUDA(cudaGetLastError())

#define DG_CEIL_DIV(a, b) (((a) + (b)-1) / (b))

static inline cudaStream_t dg__stream(const dg_ctx *ctx) { return (cudaStream_t)ctx->stream; }
static inline cublasHandle_t dg__cublas(const dg_ctx *ctx) { return (cublasHandle_t)ctx->cublas; }

/* Load/store any float dtype as float (f64 is narrowed: CUDA ops run f32/bf16). */
__device__ __forceinline__ float dg_ld(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float dg_ld(const __nv_bfloat16 *p, int64_t i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void dg_st(float *p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void dg_st(__nv_bfloat16 *p, int64_t i, float v) {
    p[i] = __float2bfloat16(v);
}

/* Raise kernel `func`'s dynamic shared-memory limit to `bytes` when that is above the 48 KB
 * default. The attribute is per device, so the call is made once per (kernel, device, size) and
 * remembered (per translation unit). */
static inline dg_status dg__smem_opt_in(const void *func, size_t bytes) {
    if (bytes <= 48 * 1024)
        return DG_OK;
    int dev = 0;
    DG_CHECK_CUDA(cudaGetDevice(&dev));
    static const void *seen_f[64];
    static int seen_dev[64];
    static size_t seen_bytes[64];
    static int n_seen = 0;
    for (int i = 0; i < n_seen; i++)
        if (seen_f[i] == func && seen_dev[i] == dev && seen_bytes[i] >= bytes)
            return DG_OK;
    DG_CHECK_CUDA(
        cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    if (n_seen < 64) {
        seen_f[n_seen] = func;
        seen_dev[n_seen] = dev;
        seen_bytes[n_seen++] = bytes;
    }
    return DG_OK;
}

/* Blocks for a 1-d grid over n elements, capped so the grid stays within limits. */
static inline unsigned dg__blocks(int64_t n, int threads) {
    int64_t b = DG_CEIL_DIV(n, (int64_t)threads);
    if (b < 1)
        b = 1;
    if (b > 65535LL * 16)
        b = 65535LL * 16;
    return (unsigned)b;
}

/* V consecutive elements of T moved as one aligned access (V sizeof(T) <= 16 bytes). */
template <typename T, int V> struct alignas(sizeof(T) * V) dg_pack { T v[V]; };

// ---- strided layouts (dg_layout, cuda_api.h)

/* Offset of logical element i in layout l. The loop runs over the compile-time maximum with a
 * guard, so shape and stride stay in registers (a run-time index would copy the layout to local
 * memory). Idx is uint32_t when every size fits (dg__layouts_fit_u32), which keeps the div/mod
 * cheap. */
template <typename Idx>
__device__ __forceinline__ int64_t dg_layout_off(const dg_layout &l, Idx i) {
    int64_t off = 0;
#pragma unroll
    for (int d = DG_MAX_DIMS - 1; d >= 0; d--) {
        if (d < l.ndim) {
            Idx s = (Idx)l.shape[d];
            Idx c = i % s;
            i /= s;
            off += (int64_t)c * l.stride[d];
        }
    }
    return off;
}

/* Can every offset of l and the element count n be held in a uint32_t? */
static inline bool dg__layout_fits_u32(const dg_layout &l, int64_t n) {
    int64_t span = 1;
    for (int d = 0; d < l.ndim; d++)
        span += (l.shape[d] - 1) * (l.stride[d] < 0 ? -l.stride[d] : l.stride[d]);
    return span < (int64_t)UINT32_MAX && n < (int64_t)UINT32_MAX;
}

/* The fewest dims that visit the same elements in the same order, for `nl` layouts of one logical
 * shape together: size-1 dims are dropped, and dims d, d+1 merge where every layout steps over d
 * as one run of d+1 (stride[d] == stride[d+1] shape[d+1]). A bias [C] broadcast over a
 * contiguous [B,T,C] becomes [B T, C] with strides (0, 1): one div/mod per element. */
static inline void dg__layouts_coalesce(dg_layout *l, int nl) {
    int nd = 0;
    for (int d = 0; d < l[0].ndim; d++) {
        if (l[0].shape[d] == 1)
            continue;
        bool merge = nd > 0;
        for (int k = 0; merge && k < nl; k++)
            merge = l[k].stride[nd - 1] == l[k].stride[d] * l[k].shape[d];
        for (int k = 0; k < nl; k++) {
            if (merge) {
                l[k].shape[nd - 1] *= l[k].shape[d];
                l[k].stride[nd - 1] = l[k].stride[d];
            } else {
                l[k].shape[nd] = l[k].shape[d];
                l[k].stride[nd] = l[k].stride[d];
            }
        }
        if (!merge)
            nd++;
    }
    for (int k = 0; k < nl; k++) {
        if (nd == 0) { /* one element */
            l[k].shape[0] = 1;
            l[k].stride[0] = 1;
        }
        l[k].ndim = nd ? nd : 1;
    }
}

/* out[j] = sum_k p[k, j] over the nrows rows of a row-major [nrows, D] f32 array, in a fixed
 * order: block (32, LANES) takes 32 columns; lane y sums rows y, y + LANES, ... in order, then
 * lane 0 adds the LANES sums in order. Grid: ceil(D / 32) blocks. No atomics. */
template <typename T, int LANES>
__global__ void dg_colsum_kernel(int64_t nrows, int D, const float *p, T *out) {
    __shared__ float red[LANES][32 + 1];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (j < D)
        for (int64_t k = threadIdx.y; k < nrows; k += LANES)
            s += p[k * D + j];
    red[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < D) {
        float t = 0.f;
        for (int y = 0; y < LANES; y++)
            t += red[y][threadIdx.x];
        dg_st(out, j, t);
    }
}

#endif /* DG_KERNELS_COMMON_CUH */

/*
 * kernels/dplr/common.cuh -- what the DPLR kernel files (the .cu files of kernels/dplr/) share on
 * top of kernels/kda/common.cuh, whose op-independent parts they use as they are: the chunk-size
 * dispatch KDA_DISPATCH_BT, kdab::Dims / make_dims / check_dims, the context scratch
 * (kdab::Scratch), the shared-memory opt-in, the deterministic warp sum, the 16 x 16-thread
 * chunk-square product kda_tile_abt and its lower-triangle store, the f32 / bf16 element access
 * kda_ld / kda_st, and kda_sum_parts (the fixed-order sum of per-tile partial results).
 * C++ only (the C sources in ops/ include dplr_cuda.h).
 *
 * Here: the leaf-dtype dispatch (DPLR_DISPATCH_TI), the launchers' argument checks
 * (dplr_check_dims), when a bf16 call takes the tensor-core kernels (dplr_mma_fits), the tile
 * loaders of the chunk kernels and the cross-warp column sum of the
 * recurrence backward.
 *
 * Thread layout of the chunk kernels (256 threads = 8 warps, as KDA's): lane = one column of a
 * 32-wide tile of the key or value dim, warp w = a set of rows of the chunk; the chunk-square
 * products use KDA's 16 x 16 layout (thread (ty, tx) owns rows ty + 16a, columns tx + 16b).
 * No float atomics anywhere: every sum runs in a fixed order, so every result is bitwise
 * reproducible.
 */
#ifndef DG_DPLR_COMMON_CUH
#define DG_DPLR_COMMON_CUH

#include "../kda/common.cuh"
#include "dplr_cuda.h"

#include <initializer_list>
#include <type_traits>

#define DPLR_G_FLOOR_F (-128.f) /* per-step log decay floor before the cumsum (as the CPU's) */

/* Run the statements with the type TI_ bound to the storage of the leaf activations (bf16 when
 * the flag is set, else f32). */
#define DPLR_DISPATCH_TI(bf16, ...)                                                                \
    do {                                                                                           \
        if (bf16) {                                                                                \
            typedef kda_bf16 TI_;                                                                  \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            typedef float TI_;                                                                     \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

/* The checks every DPLR launcher makes first: a context and device tables, the chunk size and
 * sizes (kdab::check_dims), one value head per head, f32 intermediates. */
static inline dg_status dplr_check_dims(const char *fn, dg_ctx *ctx, const kda_cuda_dims *d) {
    if (!ctx || !d || !d->buf)
        return dg__err(DG_ERR_ARG, "%s: ctx and a dims built by dg__kda_cuda_dims_new are required",
                       fn);
    if (d->mid)
        return dg__err(DG_ERR_UNSUPPORTED,
                       "%s: the DPLR kernels keep every intermediate in f32 (dims.mid must be 0)",
                       fn);
    DG_TRY(kdab::check_dims(fn, d));
    if (d->HV != d->H)
        return dg__err(DG_ERR_SHAPE,
                       "%s: DPLR has one value head per head (HV == H), got H=%d HV=%d", fn, d->H,
                       d->HV);
    if (d->K > 256)
        return dg__err(DG_ERR_UNSUPPORTED, "%s: K=%d > 256 is not supported", fn, d->K);
    return DG_OK;
}

/* Whether a bf16 call's stage runs on its tensor-core kernels (the mma kernels of wy.cu,
 * state.cu and output.cu, on kernels/kda/mma.cuh): K, V % 8 == 0 and every array of ps 16-byte
 * aligned (NULL counts as aligned). */
static inline bool dplr_mma_fits(const kda_cuda_dims *d, std::initializer_list<const void *> ps) {
    for (const void *p : ps)
        if (!aligned16(p))
            return false;
    return d->K % 8 == 0 && d->V % 8 == 0;
}

namespace dplr {

using kdab::CT;
using kdab::NTH;
using kdab::NW;

/* Rows [0, BT) x columns [c0, c0 + 32) of a [TT, H, E] array of T (f32 or bf16) from token t0 on,
 * into the shared tile dst with row stride LD: an f32 dst gets the values widened, a dst of T's
 * own type gets them as stored; zero outside the L valid rows, outside E, and everywhere when
 * src is NULL. Block-wide (NTH threads). */
template <int BT, int LD, class D, class T>
__device__ __forceinline__ void load_rows(D *dst, const T *__restrict__ src, int64_t t0, int L,
                                          int H, int h, int E, int c0) {
    static_assert(std::is_same<D, float>::value || std::is_same<D, T>::value,
                  "load_rows: dst is f32 or of the source's type");
    for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
        const int r = idx / CT, c = idx % CT;
        const bool ok = src && r < L && c0 + c < E;
        if constexpr (std::is_same<D, T>::value)
            dst[r * LD + c] = ok ? *(src + ((t0 + r) * H + h) * (int64_t)E + c0 + c) : T(0.f);
        else
            dst[r * LD + c] = ok ? kda_ld(src + ((t0 + r) * H + h) * (int64_t)E + c0 + c) : 0.f;
    }
}

/* Which part of a chunk-square matrix a kernel reads. */
enum Tri { LOWER = 0 /* j <= i */, STRICT = 1 /* j < i */ };

/* The chunk-square matrix [TT, H, BT] rows [0, BT) of the chunk starting at t0 into the f32
 * shared [BT][LD] dst, times mul, zero outside the triangle tri and the L valid rows, and
 * everywhere when src is NULL. Block-wide. */
template <int BT, int LD>
__device__ __forceinline__ void load_square(float *dst, const float *__restrict__ src, int64_t t0,
                                            int L, int H, int h, Tri tri, float mul = 1.f) {
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int i = idx / BT, j = idx % BT;
        const bool ok = src && i < L && (tri == LOWER ? j <= i : j < i);
        dst[i * LD + j] = ok ? mul * src[((t0 + i) * H + h) * BT + j] : 0.f;
    }
}

/* A [32][32] tile of one state matrix S [K][V] (rows x0.., columns y0..) into the f32 shared
 * dst with row stride LD, zero outside K and V. Block-wide. */
template <int LD>
__device__ __forceinline__ void load_state_tile(float *dst, const float *__restrict__ S, int K,
                                                int V, int x0, int y0) {
    for (int idx = threadIdx.x; idx < CT * CT; idx += NTH) {
        const int x = idx / CT, y = idx % CT;
        const bool ok = x0 + x < K && y0 + y < V;
        dst[x * LD + y] = ok ? S[(int64_t)(x0 + x) * V + y0 + y] : 0.f;
    }
}

/* Sum of `part` over the NW warps for this lane's column (the warps hold different state rows);
 * every thread gets the same value, summed in warp order. Double-buffered on rc, so consecutive
 * calls need one barrier each. Every thread of the block must call it. */
__device__ __forceinline__ float rows_sum(float part, float (*red)[NW][CT], int &rc, int w,
                                          int lane) {
    float(*buf)[CT] = red[rc & 1];
    rc++;
    buf[w][lane] = part;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ww++)
        s += buf[ww][lane];
    return s;
}

} // namespace dplr

#endif /* DG_DPLR_COMMON_CUH */

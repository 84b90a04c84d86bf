/*
 * kernels/kda/common.cuh -- what every KDA kernel file (the .cu files of kernels/kda/) shares;
 * C++ only (the C sources in ops/ include kda_cuda.h instead). The tensor-core helpers are in
 * mma.cuh.
 *   - launch sizes: KDA_THREADS (the forward chunk kernels), kdab::NTH / NW / CT (the tiled
 *     backward kernels), KDA_VT / KDA_KT (the FFMA state and output forward tiles);
 *   - the chunk-size dispatch KDA_DISPATCH_BT and the argument checks of the launchers
 *     (kda_check_dims: forward, kdab::check_dims: backward);
 *   - device math written once, exactly like the CPU reference (ops/kda/kda.h): the overflow-free
 *     sigmoid and softplus, the per-step log decay floor, a deterministic warp sum;
 *   - the dims as kernel arguments (kdab::Dims), a scratch buffer from the context's caching
 *     allocator, the shared-memory opt-in, the 16 x 16-thread chunk-square tile product;
 *   - kda_sum_parts (common.cu), the deterministic reduction the backward stages end with, and
 *     dg__kda_rows_stateT (state.cu), the one product two stages share.
 *
 * Thread layout shared by the tiled backward kernels (NTH = 256 threads = 8 warps): lane = one
 * column of a 32-wide column tile (key dim e or value dim v), warp w = the rows w, w + 8, w + 16,
 * ... of the chunk. Reductions are never done with float atomics: partial results go to scratch
 * buffers and are summed in a fixed order (kda_sum_parts), so every result is bitwise
 * reproducible.
 */
#ifndef DG_KDA_COMMON_CUH
#define DG_KDA_COMMON_CUH

#include <stdint.h>

#include <cuda_bf16.h>
#include <type_traits>

#include "../common.cuh"
#include "kda_cuda.h"

#define KDA_THREADS 256        /* every forward chunk kernel: 8 warps */
#define KDA_G_FLOOR_F (-128.f) /* per-step log decay floor before the cumsum (as the CPU's) */
#define KDA_VT 32 /* FFMA state / output forward: value columns per block (one per lane) */
#define KDA_KT 32 /* FFMA state / output forward: key-dim tile */

/* Same formulas and branches as kda_sigmoid_f32 / kda_softplus_f32 (ops/kda/kda.h). */
__device__ __forceinline__ float kda_dsigmoid(float x) {
    if (x >= 0.f)
        return 1.f / (1.f + expf(-x));
    float e = expf(x);
    return e / (1.f + e);
}

__device__ __forceinline__ float kda_dsoftplus(float x) {
    return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x));
}

/* N3's g for element e = hv * K + c of one token row (kda.md §11.2): xv = x there, a =
 * exp(A_log[hv]) (1 without A_log). The gate kernels (gate.cu) and the intra forward's prep
 * (intra.cu) evaluate it alike, so both give the same bits. */
__device__ __forceinline__ float kda_gate_value(dg_gate_kind kind, float lb, float xv, float a,
                                                const float *dt_bias, int e) {
    if (kind == DG_GATE_NONE)
        return xv;
    const float z = xv + (dt_bias ? dt_bias[e] : 0.f);
    if (kind == DG_GATE_KDA)
        return -a * kda_dsoftplus(z);
    return lb * kda_dsigmoid(a * z);
}
/* The same g on the tensor-core path (the intra forward's prep), with the hardware exponential
 * and logarithm as the tensor-core kernels use them; bias = dt_bias at the element (0 without). */
__device__ __forceinline__ float kda_gate_value_tc(dg_gate_kind kind, float lb, float xv, float a,
                                                   float bias) {
    if (kind == DG_GATE_NONE)
        return xv;
    const float z = xv + bias;
    if (kind == DG_GATE_KDA) /* softplus(z) = max(z, 0) + log(1 + exp(-|z|)) */
        return -a * (fmaxf(z, 0.f) + __logf(1.f + __expf(-fabsf(z))));
    /* sigmoid(a z) = 1 / (1 + exp(-a z)), the exponent capped so that the quotient stays in
     * __fdividef's range (sigmoid(-80) = 1.8e-35: 0 in the sums anyway) */
    return lb * __fdividef(1.f, 1.f + __expf(fminf(-a * z, 80.f)));
}

/* Run the statements (variadic: they may contain commas) with the compile-time constant BT_
 * bound to d->BT (16, 32 or 64). */
#define KDA_DISPATCH_BT(BTv, ...)                                                                  \
    do {                                                                                           \
        switch (BTv) {                                                                             \
        case 16: {                                                                                 \
            constexpr int BT_ = 16;                                                                \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case 32: {                                                                                 \
            constexpr int BT_ = 32;                                                                \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case 64: {                                                                                 \
            constexpr int BT_ = 64;                                                                \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        default:                                                                                   \
            return dg__err(DG_ERR_ARG, "%s: chunk size BT=%d is not 16, 32 or 64", __func__,       \
                           (int)(BTv));                                                            \
        }                                                                                          \
    } while (0)

/* Element access for the arrays whose storage is f32 or bf16 (kda_cuda_dims.mid: W, U, KG, QG,
 * h, E): loads widen to f32 (exact), stores round to the nearest bf16. kda_ld2 / kda_ld4 and
 * kda_st2 / kda_st4 load and store two / four consecutive elements with one access. */
typedef __nv_bfloat16 kda_bf16;
__device__ __forceinline__ float kda_ld(const float *p) { return *p; }
__device__ __forceinline__ float kda_ld(const kda_bf16 *p) { return __bfloat162float(*p); }
/* (kda_ld2, kda_ld4: 8- / 16-byte aligned for f32, 4- / 8-byte for bf16) */
__device__ __forceinline__ float2 kda_ld2(const float *p) {
    return *reinterpret_cast<const float2 *>(p);
}
__device__ __forceinline__ float2 kda_ld2(const kda_bf16 *p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
__device__ __forceinline__ float4 kda_ld4(const float *p) {
    return *reinterpret_cast<const float4 *>(p);
}
__device__ __forceinline__ float4 kda_ld4(const kda_bf16 *p) {
    const uint2 u = *reinterpret_cast<const uint2 *>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
/* Four consecutive elements of T (f32 or bf16) held as loaded, widened only by get(): a load
 * whose widening follows at once makes the widening wait for it where it is issued, so kernels
 * that load a tile's rows ahead of use keep them raw. */
template <class T> struct kda_raw4 {
    using type = typename std::conditional<sizeof(T) == 2, uint2, float4>::type;
    type u;
    __device__ __forceinline__ void load(const T *p) { u = *reinterpret_cast<const type *>(p); }
    __device__ __forceinline__ float4 get() const {
        return kda_ld4(reinterpret_cast<const T *>(&u));
    }
};
/* N (1 or 2) consecutive elements at p into x, and back: one 4- or 8-byte access (f32), 2- or
 * 4-byte (bf16). */
template <int N, class T> __device__ __forceinline__ void kda_ldn(float (&x)[N], const T *p) {
    if constexpr (N == 2) {
        const float2 a = kda_ld2(p);
        x[0] = a.x;
        x[1] = a.y;
    } else {
        x[0] = kda_ld(p);
    }
}
/* One 16-byte piece (16-byte aligned) widened to f32: 4 f32 or 8 bf16 elements into v. */
__device__ __forceinline__ void kda_ld16(const float *p, float (&v)[4]) {
    const float4 u = *reinterpret_cast<const float4 *>(p);
    v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
}
__device__ __forceinline__ void kda_ld16(const kda_bf16 *p, float (&v)[8]) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 f = __bfloat1622float2(b[e]);
        v[2 * e] = f.x, v[2 * e + 1] = f.y;
    }
}
__device__ __forceinline__ void kda_st(float *p, float x) { *p = x; }
__device__ __forceinline__ void kda_st(kda_bf16 *p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void kda_st2(float *p, float a, float b) {
    *reinterpret_cast<float2 *>(p) = make_float2(a, b);
}
__device__ __forceinline__ void kda_st2(kda_bf16 *p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(a, b);
}
/* Four consecutive elements with one access (16-byte aligned for f32, 8-byte for bf16). */
__device__ __forceinline__ void kda_st4(float *p, float4 x) { *reinterpret_cast<float4 *>(p) = x; }
__device__ __forceinline__ void kda_st4(kda_bf16 *p, float4 x) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned *>(&lo);
    u.y = *reinterpret_cast<const unsigned *>(&hi);
    *reinterpret_cast<uint2 *>(p) = u;
}
template <int N, class T> __device__ __forceinline__ void kda_stn(T *p, const float (&x)[N]) {
    if constexpr (N == 2)
        kda_st2(p, x[0], x[1]);
    else
        kda_st(p, x[0]);
}

/* q or k as the intra and WY kernels read it (kda_cuda_dims.qk_bf16, rq, rk): f32 or bf16 rows
 * [TT,H,K], each multiplied by r[row] (row = token * H + head) when r is given. at returns
 * element i of row `row` (the kernels that read them in bulk take p and r directly). */
struct QkIn {
    const void *p;
    const float *r;
    bool bf16;
    __device__ __forceinline__ float at(int64_t i, int64_t row) const {
        const float x = bf16 ? kda_ld(static_cast<const kda_bf16 *>(p) + i)
                             : kda_ld(static_cast<const float *>(p) + i);
        return r ? x * r[row] : x;
    }
};
static inline QkIn qk_in(const void *p, const float *r, int bf16) {
    QkIn q;
    q.p = p;
    q.r = r;
    q.bf16 = bf16 != 0;
    return q;
}

/* Run the statements with the type M_ bound to the storage of the mid tensors (d->mid: bf16,
 * else f32). */
#define KDA_DISPATCH_MID(mid, ...)                                                                 \
    do {                                                                                           \
        if (mid) {                                                                                 \
            typedef kda_bf16 M_;                                                                   \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            typedef float M_;                                                                      \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

/* A launcher that reaches a kernel without a bf16 variant while d->mid is set refuses: the ops
 * layer sets mid only where every reader and writer has one (dg__kda_mid_fits). */
static inline dg_status kda_mid_refused(const char *fn, const kda_cuda_dims *d) {
    return dg__err(DG_ERR_UNSUPPORTED,
                   "%s: bf16 intermediates (mid = 1) need tc == 1, K %% 16 == 0, K <= 256, "
                   "V %% 16 == 0 and 16-byte aligned arrays; got tc=%d K=%d V=%d",
                   fn, d->tc, d->K, d->V);
}

/* Arguments every forward launcher checks first (mid = 1 only where dg__kda_mid_fits). */
static inline dg_status kda_check_dims(const char *fn, dg_ctx *ctx, const kda_cuda_dims *d) {
    if (!ctx || !d || !d->buf)
        return dg__err(DG_ERR_ARG, "%s: ctx and a dims built by dg__kda_cuda_dims_new are required",
                       fn);
    if (d->mid && !dg__kda_mid_fits(d))
        return kda_mid_refused(fn, d);
    return DG_OK;
}

/* 16-byte alignment, as cp.async and the float4 / float2 accesses need. */
static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Kernels that split a chunk's work into nz column tiles launch grid.x = NC * nz with a chunk's
 * tiles as neighbours, so the operands the tiles share are still in L2 when the next tile reads
 * them (with the tiles on grid.z, every tile of every chunk would run before the next tile of the
 * first). This block's chunk and tile. */
struct ChunkTile {
    int64_t c;
    int z;
};
__device__ __forceinline__ ChunkTile chunk_tile(int nz) {
    return ChunkTile{(int64_t)(blockIdx.x / (unsigned)nz), (int)(blockIdx.x % (unsigned)nz)};
}

namespace kdab {

constexpr int NTH = 256; /* threads per block of the tiled kernels */
constexpr int NW = 8;    /* warps per block */
constexpr int CT = 32;   /* column tile (one warp's lanes) */

/* kda_cuda_dims without the ownership fields, passed by value to kernels. */
struct Dims {
    int64_t TT, NC;
    int H, HV, K, V, BT, N, G; /* G: value heads per q/k head */
    const int64_t *cu, *chunk_off, *chunk_t0;
    const int32_t *chunk_len, *chunk_seq;
};

static inline Dims make_dims(const kda_cuda_dims *d) {
    Dims r;
    r.TT = d->TT;
    r.NC = d->NC;
    r.H = d->H;
    r.HV = d->HV;
    r.K = d->K;
    r.V = d->V;
    r.BT = d->BT;
    r.N = d->N;
    r.G = d->HV / d->H;
    r.cu = d->cu;
    r.chunk_off = d->chunk_off;
    r.chunk_t0 = d->chunk_t0;
    r.chunk_len = d->chunk_len;
    r.chunk_seq = d->chunk_seq;
    return r;
}

/* Checks shared by every backward stage launcher. */
static inline dg_status check_dims(const char *fn, const kda_cuda_dims *d) {
    if (!d)
        return dg__err(DG_ERR_ARG, "%s: dims is NULL", fn);
    if (d->BT != 16 && d->BT != 32 && d->BT != 64)
        return dg__err(DG_ERR_ARG, "%s: chunk size BT must be 16, 32 or 64, got %d", fn, d->BT);
    if (d->H < 1 || d->HV < 1 || d->HV % d->H != 0 || d->K < 1 || d->V < 1 || d->N < 0 ||
        d->TT < 0 || d->NC < 0)
        return dg__err(DG_ERR_SHAPE, "%s: bad dims H=%d HV=%d K=%d V=%d N=%d TT=%lld NC=%lld", fn,
                       d->H, d->HV, d->K, d->V, d->N, (long long)d->TT, (long long)d->NC);
    if (d->mid && !dg__kda_mid_fits(d))
        return kda_mid_refused(fn, d);
    return DG_OK;
}

/* Butterfly sum over the 32 lanes: every lane gets the same, run-to-run identical value. */
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* A scratch buffer from the context's caching allocator, returned when it goes out of scope.
 * Returning it before the kernels that use it have run is safe: every kernel of a context runs
 * on its one stream, so a later reuse of the block is ordered after them. */
struct Scratch {
    dg_ctx *ctx;
    void *p = nullptr;
    size_t bytes = 0;
    explicit Scratch(dg_ctx *c) : ctx(c) {}
    Scratch(const Scratch &) = delete;
    Scratch &operator=(const Scratch &) = delete;
    ~Scratch() {
        if (p)
            dg__cuda_free(ctx, p, bytes);
    }
    dg_status alloc(size_t n_floats) {
        bytes = (n_floats ? n_floats : 1) * sizeof(float);
        return dg__cuda_malloc(ctx, bytes, &p);
    }
    float *f() const { return (float *)p; }
};

/* Raise a kernel's dynamic shared-memory limit when it needs more than the default 48 KB (once
 * per kernel, device and size: dg__smem_opt_in). */
template <class Kern> static inline dg_status smem_opt_in(Kern k, size_t bytes) {
    return dg__smem_opt_in((const void *)k, bytes);
}

/* The 16 x 16-thread "A B^T" micro-kernel of the chunk-square gradients (dAqk, dTm): thread
 * (tx, ty) adds sum_c sA[ty + 16a][c] * sB[tx + 16b][c] over one CT-wide tile to acc[a][b]. */
template <int BT>
__device__ __forceinline__ void kda_tile_abt(float (&acc)[BT / 16][BT / 16],
                                             const float (*sA)[CT + 1], const float (*sB)[CT + 1],
                                             int tx, int ty) {
    constexpr int RB = BT / 16;
#pragma unroll 8
    for (int cc = 0; cc < CT; cc++) {
        float ar[RB], br[RB];
#pragma unroll
        for (int a = 0; a < RB; a++)
            ar[a] = sA[ty + 16 * a][cc];
#pragma unroll
        for (int b = 0; b < RB; b++)
            br[b] = sB[tx + 16 * b][cc];
#pragma unroll
        for (int a = 0; a < RB; a++)
#pragma unroll
            for (int b = 0; b < RB; b++)
                acc[a][b] += ar[a] * br[b];
    }
}

/* Store acc's lower triangle (j <= i; zeros above) into rows [t0, t0 + L) of a [TT,HV,BT]
 * chunk-square matrix. */
template <int BT>
__device__ __forceinline__ void kda_store_lower(const float (&acc)[BT / 16][BT / 16], float *out,
                                                int64_t t0, int L, int hv, int HV, int tx, int ty) {
#pragma unroll
    for (int a = 0; a < BT / 16; a++) {
        const int i = ty + 16 * a;
        if (i >= L)
            continue;
#pragma unroll
        for (int b = 0; b < BT / 16; b++) {
            const int j = tx + 16 * b;
            out[((t0 + i) * HV + hv) * BT + j] = j <= i ? acc[a][b] : 0.f;
        }
    }
}

} // namespace kdab

/* out[(r*Hout + h)*E + e] = sum_{p < P} sum_{g < G} in[p*pstride + ((r*Hout + h)*G + g)*E + e]
 * for rows r < rows, in this fixed order (kernels/kda/common.cu); acc != 0 adds the sum to out
 * instead. With P = 1 it is the GVA reduction of a per-value-head buffer [rows, Hout*G, E] onto
 * Hout heads; with G = 1 the sum of P partial buffers. */
dg_status kda_sum_parts(dg_ctx *ctx, float *out, const float *in, int64_t rows, int Hout, int G,
                        int E, int P, int64_t pstride, int acc);

/* A bf16 leaf (kda_cuda_dims.leaf_bf16) for a kernel that reads f32 only: kda_widen copies
 * in[0, n) to f32 in scr (allocated here) and points *out at it. */
dg_status kda_widen(dg_ctx *ctx, const kda_bf16 *in, int64_t n, kdab::Scratch &scr,
                    const float **out);
/* q and k of d (kda_cuda_dims.qk_bf16, rq, rk) for a kernel that reads plain f32 rows: with
 * neither flag set *qf, *kf are q, k themselves; else the normalised rows are formed into f32
 * scratch (qs, ks, allocated here), the same products the kernels form in registers. */
dg_status kda_qk_widen(dg_ctx *ctx, const kda_cuda_dims *d, const void *q, const void *k,
                       kdab::Scratch &qs, kdab::Scratch &ks, const float **qf, const float **kf);
/* Whether d asks for q, k to be read other than as plain f32 rows. */
static inline bool kda_qk_special(const kda_cuda_dims *d) { return d->qk_bf16 || d->rq || d->rk; }
/* The other direction, for a bf16 leaf a kernel writes in f32 only: out[0, n) = in rounded to
 * the nearest bf16. */
dg_status kda_narrow(dg_ctx *ctx, const float *in, int64_t n, kda_bf16 *out);

/* I [heads, K, K] = one identity matrix per head (the KCP transition summaries start from it). */
dg_status kda_identity(dg_ctx *ctx, float *I, int heads, int K);

/* The serial pass of state.cu's tensor-core kernel (state_mma_kernel, mma.sync TF32 on f32
 * operands) with both products added, for DPLR's state passes (kernels/dplr/state.cu): per
 * sequence and head, from S = S0 (NULL: zero), chunks in order (bwd false) or in reverse (bwd):
 *     Sst_c = S;   X = X0 + A1 S -> Xo;   S = exp(lambda_c) S + Sup_c + A2^T X;   Sfin = S
 * (A1, A2, G [TT,HV,K]; X0, Xo [TT,HV,V]; Sup, Sst [NC,HV,K,V]; S0, Sfin [N,HV,K,V]; X0, Sup,
 * Sst, Sfin optional). Forward: A1 = w, X0 = u, A2 = bg, Sup = kg^T v per chunk, Sst = h,
 * Xo = v2; backward: A1 = bg, X0 = dv2, A2 = w, S0 = dht, Sup = dh, Sst = dHn, Xo = du,
 * Sfin = dh0. kda_state_plus_fits says whether the sizes and alignments allow it (K % 16 == 0,
 * K <= 256, V even, 16-byte aligned arrays); d's tc and mid are not read. */
int kda_state_plus_fits(const kda_cuda_dims *d, const float *A1, const float *X0, const float *A2,
                        const float *G, const float *S0, const float *Sup, const float *Sst,
                        const float *Xo, const float *Sfin);
dg_status kda_state_plus(dg_ctx *ctx, const kda_cuda_dims *d, bool bwd, const float *A1,
                         const float *X0, const float *A2, const float *G, const float *S0,
                         const float *Sup, float *Sst, float *Xo, float *Sfin);

/* The chunk-parallel products of DPLR's tensor-core state backward (kernels/dplr/state.cu) on
 * state.cu's TF32 kernels (rows_stateT_mma_kernel, state_dg_tc_kernel): dkg = v dHn^T (v bf16),
 * dbg = v2 dHn^T, dw = du h^T, and dG at each chunk's last row = exp(lambda) rowsum(h . dHn)
 * (its other rows 0); v, v2, du [TT,HV,V], h, dHn [NC,HV,K,V], outputs [TT,HV,K], all required.
 * kda_state_rows_plus_fits: V % 8 == 0, K % 4 == 0, 16-byte aligned arrays. */
int kda_state_rows_plus_fits(const kda_cuda_dims *d, const void *v, const float *v2,
                             const float *du, const float *h, const float *dHn, const float *dkg,
                             const float *dbg, const float *dw, const float *dG);
dg_status kda_state_rows_plus(dg_ctx *ctx, const kda_cuda_dims *d, const kda_bf16 *v,
                              const float *v2, const float *du, const float *h, const float *dHn,
                              const float *G, float *dkg, float *dbg, float *dw, float *dG);

/* The output backward's mma kernels (output.cu's out_dhq_mma_kernel, out_dade_mma_kernel) for
 * DPLR's output backward (kernels/dplr/output.cu), whose operands mix types: dO bf16 (a bf16
 * leaf's gradient, read as stored), QG and h f32, E f32 or bf16 (e_bf16). What is asked for
 * (every output optional, all f32):
 *     dQG = s dO h_c^T,  dh_c = s QG^T dO,  dAqk = tril(dO E^T),  dE = Aqk^T dO
 * on the products, k orders and layouts of dg__kda_output_bwd_cuda's mma path (TF32, or bf16
 * m16n8k16 where both operands are bf16; f32 accumulation). kda_output_bwd_bf16do_fits: K and V
 * % 8 == 0, 16-byte aligned arrays (NULL allowed); d's tc and mid are not read. */
int kda_output_bwd_bf16do_fits(const kda_cuda_dims *d, const float *QG, const float *h,
                               const float *Aqk, const void *E, const kda_bf16 *dO,
                               const float *dQG, const float *dh, const float *dAqk,
                               const float *dE);
dg_status kda_output_bwd_bf16do(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *QG,
                                const float *h, const float *Aqk, const void *E, int e_bf16,
                                const kda_bf16 *dO, float *dQG, float *dh, float *dAqk, float *dE);

/* C = s A S_c^T chunk by chunk (state.cu's rows_stateT product, on the kernels of d->tc): for
 * the rows i < L of every chunk c, C[i][e] = s sum_v A[i][v] S_c[e][v]; A [TT,HV,V], S
 * [NC,HV,K,V], C [TT,HV,K], all f32. The output backward's dQG = s dO h^T where it runs on f32
 * operands outside its mma kernels (output.cu). Needs NC > 0 and d checked by kdab::check_dims. */
dg_status dg__kda_rows_stateT(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *A,
                              const float *S, float *C);

#endif /* DG_KDA_COMMON_CUH */

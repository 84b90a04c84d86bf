/*
 * kernels/kda/kda_state_mma.cu -- the serial inter-chunk state pass on tensor cores, forward and
 * backward (spec §5.3 and §6.2), for the tensor-core path (kda_cuda_dims.tc == 1).
 *
 * Both passes have one shape (as in kda_tc_fwd.cu's state_tc_kernel, which this replaces where
 * the sizes allow; see state_mma_fits):
 *   forward,  chunks in order:    store S = h_c;   X = U  - W  S  -> E;
 *                                 S = exp(lambda) S + KG^T X
 *   backward, chunks in reverse:  store S = dHn_c; X = dE + KG S -> dE_tot;
 *                                 S = exp(lambda) S + dh_c - W^T X
 * i.e. X = X0 + sgnA A1 S and S = exp(lambda) S + Sup_c + sgnB A2^T X with (A1, A2, sgnA, sgnB)
 * = (W, KG, -, +) forward and (KG, W, +, -) backward; lambda_c = G of the chunk's last token.
 *
 * Work split: one block of 8 warps per (sequence, value head, VT value columns), VT = 16, 32 or
 * 64 picked by the launcher from the number of waves the grid needs. What makes it fast compared
 * with the staged kernel:
 *   - the running state S [K][VT] lives in registers as mma accumulators (warp w owns the 16-row
 *     tiles w and w + 8 of S, all VT / 8 8-column tiles), so the update S += A2^T X accumulates in
 *     place; S goes through shared memory once per chunk only as the B operand of A1 S;
 *   - the next chunk's A1 tile (and lambda) is fetched with cp.async while the current chunk's
 *     update runs, and its A2 tile while the next A1 S runs (single buffers, two commit groups);
 *   - mma.sync m16n8k8 TF32 with f32 accumulators, fragments read straight from padded shared
 *     memory (row pads chosen so that both the row-major A1 reads and the transposed A2 reads are
 *     free of bank conflicts).
 * Needs K % 16 == 0, K <= 256, V even and 16-byte aligned arrays (state_mma_fits); other sizes
 * keep the staged kernel. The same kernel computes the KCP summaries of one sequence
 * (kda_state_summary_cuda, at the end of this file).
 */
#include "kda_fwd_util.cuh"
#include <stdint.h>
#include "kda_mma.cuh"
#include "kda_tc.cuh"

// ---- device helpers

namespace {

constexpr int SM_THREADS = 256;

/* Rows [0, BT) x columns [0, K) of a [TT, HV, K] array starting at token t0, into shared memory
 * with leading dimension LD (floats); rows >= L are zero-filled. Block-wide, 16 bytes per op. */
template <int BT>
__device__ __forceinline__ void tile_async(float *dst, int LD, const float *__restrict__ src,
                                           int64_t t0, int L, int HV, int hv, int K) {
    const int q = K / 4; /* 16-byte pieces per row */
    for (int idx = threadIdx.x; idx < BT * q; idx += SM_THREADS) {
        const int r = idx / q, c = 4 * (idx % q);
        const bool ok = r < L;
        const float *g = ok ? src + ((t0 + r) * HV + hv) * (int64_t)K + c : src;
        kdamma::cp_async16(dst + r * LD + c, g, ok);
    }
}

} // namespace

// ---- CUDA kernel

/* MT: 16-row tiles of S per warp (K <= 128: 1, K <= 256: 2). VT: value columns per block (16, 32
 * or 64; the launcher picks it from the grid size). Dynamic shared memory (floats):
 *   A1s [BT][K + 4], A2s [BT][K + 8], Ss [max(K, BT)][VT + 8] (also Xs), Gs [K]. */
template <int BT, int MT, int VT, bool BWD>
__global__ void __launch_bounds__(SM_THREADS, MT == 1 ? 2 : 1) /* K <= 128: two blocks per SM */
    state_mma_kernel(const int64_t *__restrict__ chunk_off, const int64_t *__restrict__ chunk_t0,
                     const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                     const float *__restrict__ A1, const float *__restrict__ X0,
                     const float *__restrict__ A2, const float *__restrict__ G,
                     const float *__restrict__ S0, const float *__restrict__ Sup,
                     float *__restrict__ Sst, float *__restrict__ Xo, float *__restrict__ Sfin) {
    constexpr int LDS = VT + 8, LDX = VT + 8; /* % 32 in {8, 24}: conflict-free b-reads */
    constexpr int NJ = VT / 8;                /* 8-column tiles of S per warp */
    constexpr int NXT = VT / 16;              /* 8-column tiles of X per warp */
    extern __shared__ __align__(16) float sm_smem[];
    const int LD1 = K + 4, LD2 = K + 8;
    float *A1s = sm_smem;
    float *A2s = A1s + BT * LD1;
    float *Ss = A2s + BT * LD2;
    float *Xs = Ss; /* X lives where S was staged (after a barrier; max(K, BT) rows) */
    float *Gs = Ss + (K > BT ? K : BT) * LDS;

    const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VT;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nv = min(VT, V - v0);
    const int64_t rv = (int64_t)HV * V, KV = (int64_t)K * V;
    const int mtiles = K / 16;

    /* S: rows 16 (w + 8 m) + g (+ 8), columns 8 j + 2 t (+ 1). */
    float S[MT][NJ][4];
    {
        const float *s0 = S0 ? S0 + ((int64_t)n * HV + hv) * KV + v0 : nullptr;
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = 16 * (w + 8 * m) + g + 8 * (e >> 1), c = 8 * j + 2 * t + (e & 1);
                    S[m][j][e] = (s0 && w + 8 * m < mtiles && c < nv) ? s0[(int64_t)r * V + c] : 0.f;
                }
    }

    /* S -> dst (row r at dst + r * ld; global: only the nv valid columns) */
    auto store_S = [&](float *dst, int64_t ld, bool global) {
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if (w + 8 * m >= mtiles)
                continue;
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++) {
                    const int r = 16 * (w + 8 * m) + g + 8 * hlf, c = 8 * j + 2 * t;
                    if (!global || c < nv)
                        *reinterpret_cast<float2 *>(dst + r * ld + c) =
                            make_float2(S[m][j][2 * hlf], S[m][j][2 * hlf + 1]);
                }
        }
    };

    const int64_t c_beg = chunk_off[n], c_end = chunk_off[n + 1], nch = c_end - c_beg;
    auto chunk_of = [&](int64_t it) { return BWD ? c_end - 1 - it : c_beg + it; };

    /* prologue: A1 + lambda of the first chunk (group 1), A2 (group 2) */
    if (nch > 0) {
        const int64_t ch = chunk_of(0), t0 = chunk_t0[ch];
        const int L = chunk_len[ch];
        tile_async<BT>(A1s, LD1, A1, t0, L, HV, hv, K);
        for (int idx = threadIdx.x; idx < K / 4; idx += SM_THREADS)
            kdamma::cp_async16(Gs + 4 * idx, G + ((t0 + L - 1) * HV + hv) * (int64_t)K + 4 * idx, true);
        kdamma::cp_async_commit();
        tile_async<BT>(A2s, LD2, A2, t0, L, HV, hv, K);
        kdamma::cp_async_commit();
    }

    for (int64_t it = 0; it < nch; it++) {
        const int64_t ch = chunk_of(it), t0 = chunk_t0[ch];
        const int L = chunk_len[ch];

        /* S (the state at this chunk's start) -> Ss for the A1 S product, and -> Sst */
        store_S(Ss, LDS, false);
        if (Sst)
            store_S(Sst + (ch * HV + hv) * KV + v0, V, true);

        /* X0 for this warp's X tiles: rows 16 (w / 2) + g (+ 8), columns 8 (NXT (w % 2) + jj) + 2t */
        const int xm = w >> 1;
        const bool xwarp = xm < BT / 16;
        float X[NXT][4];
#pragma unroll
        for (int jj = 0; jj < NXT; jj++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = 16 * xm + g + 8 * (e >> 1), c = 8 * (NXT * (w & 1) + jj) + 2 * t + (e & 1);
                X[jj][e] = (X0 && xwarp && r < L && c < nv) ? X0[(t0 + r) * rv + hv * V + v0 + c]
                                                            : 0.f;
            }

        kdamma::cp_async_wait<1>(); /* A1 and lambda of this chunk */
        __syncthreads();    /* ... visible to all; Ss complete */

        /* X = X0 + sgnA A1 S */
        float acc[NXT][4] = {};
        if (xwarp) {
            const float *a_row0 = A1s + (16 * xm + g) * LD1 + t, *a_row1 = a_row0 + 8 * LD1;
            for (int k0 = 0; k0 < K; k0 += 8) {
                const unsigned a[4] = {kdamma::tf32(a_row0[k0]), kdamma::tf32(a_row1[k0]),
                                       kdamma::tf32(a_row0[k0 + 4]), kdamma::tf32(a_row1[k0 + 4])};
#pragma unroll
                for (int jj = 0; jj < NXT; jj++) {
                    const int c = 8 * (NXT * (w & 1) + jj) + g;
                    kdamma::mma_tf32(acc[jj], a, kdamma::tf32(Ss[(k0 + t) * LDS + c]),
                                     kdamma::tf32(Ss[(k0 + t + 4) * LDS + c]));
                }
            }
        }
        __syncthreads(); /* every read of Ss is done: Xs reuses its space */
        if (xwarp) {
            float *xo = Xo ? Xo + t0 * rv + hv * V + v0 : nullptr;
#pragma unroll
            for (int jj = 0; jj < NXT; jj++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++) {
                    const int r = 16 * xm + g + 8 * hlf, c = 8 * (NXT * (w & 1) + jj) + 2 * t;
                    float2 val;
                    val.x = BWD ? X[jj][2 * hlf] + acc[jj][2 * hlf]
                                : X[jj][2 * hlf] - acc[jj][2 * hlf];
                    val.y = BWD ? X[jj][2 * hlf + 1] + acc[jj][2 * hlf + 1]
                                : X[jj][2 * hlf + 1] - acc[jj][2 * hlf + 1];
                    if (r >= L)
                        val = make_float2(0.f, 0.f);
                    *reinterpret_cast<float2 *>(Xs + r * LDX + c) = val;
                    if (xo && r < L && c < nv)
                        *reinterpret_cast<float2 *>(xo + r * rv + c) = val;
                }
        }
        /* exp(lambda) for this thread's rows of S, read before the buffer is refilled */
        float el[MT][2];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int hlf = 0; hlf < 2; hlf++) {
                const int r = 16 * (w + 8 * m) + g + 8 * hlf;
                el[m][hlf] = (w + 8 * m < mtiles) ? __expf(Gs[r]) : 0.f;
            }
        __syncthreads(); /* Xs complete; A1s, Gs and Ss free */

        /* prefetch the next chunk's A1 and lambda */
        if (it + 1 < nch) {
            const int64_t cn = chunk_of(it + 1), tn = chunk_t0[cn];
            const int Ln = chunk_len[cn];
            tile_async<BT>(A1s, LD1, A1, tn, Ln, HV, hv, K);
            for (int idx = threadIdx.x; idx < K / 4; idx += SM_THREADS)
                kdamma::cp_async16(Gs + 4 * idx, G + ((tn + Ln - 1) * HV + hv) * (int64_t)K + 4 * idx,
                           true);
        }
        kdamma::cp_async_commit();

        /* S = exp(lambda) S + Sup_c */
        const float *sup = Sup ? Sup + (ch * HV + hv) * KV + v0 : nullptr;
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++) {
                    const int r = 16 * (w + 8 * m) + g + 8 * hlf, c = 8 * j + 2 * t;
                    float2 add = make_float2(0.f, 0.f);
                    if (sup && w + 8 * m < mtiles && c < nv)
                        add = *reinterpret_cast<const float2 *>(sup + (int64_t)r * V + c);
                    S[m][j][2 * hlf] = el[m][hlf] * S[m][j][2 * hlf] + add.x;
                    S[m][j][2 * hlf + 1] = el[m][hlf] * S[m][j][2 * hlf + 1] + add.y;
                }

        kdamma::cp_async_wait<1>(); /* A2 of this chunk */
        __syncthreads();

        /* S += sgnB A2^T X: A(m = key row, k = token i) = A2s[i][m] */
        const int ksteps = (L + 7) / 8;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if (w + 8 * m >= mtiles)
                continue;
            const int m0 = 16 * (w + 8 * m);
            for (int ks = 0; ks < ksteps; ks++) {
                const int i0 = 8 * ks;
                const float *p0 = A2s + (i0 + t) * LD2 + m0 + g, *p1 = p0 + 4 * LD2;
                unsigned a[4];
                if (BWD) {
                    a[0] = kdamma::tf32(-p0[0]);
                    a[1] = kdamma::tf32(-p0[8]);
                    a[2] = kdamma::tf32(-p1[0]);
                    a[3] = kdamma::tf32(-p1[8]);
                } else {
                    a[0] = kdamma::tf32(p0[0]);
                    a[1] = kdamma::tf32(p0[8]);
                    a[2] = kdamma::tf32(p1[0]);
                    a[3] = kdamma::tf32(p1[8]);
                }
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const int c = 8 * j + g;
                    kdamma::mma_tf32(S[m][j], a, kdamma::tf32(Xs[(i0 + t) * LDX + c]),
                             kdamma::tf32(Xs[(i0 + t + 4) * LDX + c]));
                }
            }
        }
        __syncthreads(); /* A2s and Xs free */

        /* prefetch the next chunk's A2 */
        if (it + 1 < nch) {
            const int64_t cn = chunk_of(it + 1);
            tile_async<BT>(A2s, LD2, A2, chunk_t0[cn], chunk_len[cn], HV, hv, K);
        }
        kdamma::cp_async_commit();
    }
    kdamma::cp_async_wait<0>();

    if (Sfin)
        store_S(Sfin + ((int64_t)n * HV + hv) * KV + v0, V, true);
}

// ---- kernel launchers

/* The sizes and alignments the kernel needs (else the caller keeps the staged kernel). */
static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

int kda_state_mma_fits(const kda_cuda_dims *d, const float *A1, const float *X0,
                                  const float *A2, const float *G, const float *S0,
                                  const float *Sup, const float *Sst, const float *Xo,
                                  const float *Sfin) {
    if (d->tc != 1 || d->K % 16 != 0 || d->K > 256 || d->V % 2 != 0)
        return 0;
    const void *ps[] = {A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin};
    for (const void *p : ps)
        if (p && !aligned16(p))
            return 0;
    return 1;
}

template <int BT, int MT, int VT, bool BWD>
static size_t state_mma_smem(int K) {
    return sizeof(float) * ((size_t)BT * (K + 4) + (size_t)BT * (K + 8) +
                            (size_t)(K > BT ? K : BT) * (VT + 8) + K);
}

/* Shared memory of one variant, with the dynamic limit raised (once per device and size) when it
 * needs more than the default 48 KB. */
template <int BT, int MT, int VT, bool BWD>
static dg_status state_mma_prepare(int K, size_t *smem) {
    *smem = state_mma_smem<BT, MT, VT, BWD>(K);
    return dg__smem_opt_in((const void *)state_mma_kernel<BT, MT, VT, BWD>, *smem);
}

/* Waves of resident blocks the grid of a variant needs on device dev (sms multiprocessors);
 * the occupancy query runs once per K and device. */
template <int BT, int MT, int VT, bool BWD>
static dg_status state_mma_waves(const kda_cuda_dims *d, int dev, int sms, int64_t *waves) {
    static int cached_K = -1, cached_dev = -1, cached_per_sm = 0;
    if (cached_K != d->K || cached_dev != dev) {
        size_t smem;
        DG_TRY((state_mma_prepare<BT, MT, VT, BWD>(d->K, &smem)));
        DG_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &cached_per_sm, state_mma_kernel<BT, MT, VT, BWD>, SM_THREADS, smem));
        cached_K = d->K;
        cached_dev = dev;
    }
    const int64_t blocks = (int64_t)d->N * d->HV * DG_CEIL_DIV(d->V, VT);
    *waves = cached_per_sm > 0 ? DG_CEIL_DIV(blocks, (int64_t)cached_per_sm * sms) : INT64_MAX;
    return DG_OK;
}

template <int BT, int MT, int VT, bool BWD>
static dg_status state_mma_launch_vt(dg_ctx *ctx, const kda_cuda_dims *d, const float *A1,
                                     const float *X0, const float *A2, const float *G,
                                     const float *S0, const float *Sup, float *Sst, float *Xo,
                                     float *Sfin) {
    size_t smem;
    DG_TRY((state_mma_prepare<BT, MT, VT, BWD>(d->K, &smem)));
    dim3 grid((unsigned)d->N, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, VT));
    state_mma_kernel<BT, MT, VT, BWD><<<grid, SM_THREADS, smem, dg__stream(ctx)>>>(
        d->chunk_off, d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, A1, X0, A2, G, S0, Sup, Sst,
        Xo, Sfin);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

template <int BT, int MT, bool BWD>
static dg_status state_mma_launch_t(dg_ctx *ctx, const kda_cuda_dims *d, const float *A1,
                                    const float *X0, const float *A2, const float *G,
                                    const float *S0, const float *Sup, float *Sst, float *Xo,
                                    float *Sfin) {
    /* Fewest waves first (each block walks every chunk of its sequence, so a second wave doubles
     * the time); among equal waves 32 columns, then 64, then 16 (measured on an H200: with one
     * wave either way, 16-column tiles lose ~2% to the doubled W/KG traffic; 64-column tiles pay
     * when they save a wave: -3% to -6% fwd+bwd at (4,4096,64,128) and (8,2048,32,256)). */
    int dev = 0, sms = 0;
    DG_CHECK_CUDA(cudaGetDevice(&dev));
    DG_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int64_t w16 = INT64_MAX, w32 = INT64_MAX, w64 = INT64_MAX;
    DG_TRY((state_mma_waves<BT, MT, 16, BWD>(d, dev, sms, &w16)));
    DG_TRY((state_mma_waves<BT, MT, 32, BWD>(d, dev, sms, &w32)));
    DG_TRY((state_mma_waves<BT, MT, 64, BWD>(d, dev, sms, &w64)));
    if (w64 < w32 && w64 <= w16)
        return state_mma_launch_vt<BT, MT, 64, BWD>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin);
    if (w16 < w32 && w16 < w64)
        return state_mma_launch_vt<BT, MT, 16, BWD>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin);
    return state_mma_launch_vt<BT, MT, 32, BWD>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin);
}

dg_status kda_state_mma(dg_ctx *ctx, const kda_cuda_dims *d, int bwd, const float *A1,
                                   const float *X0, const float *A2, const float *G,
                                   const float *S0, const float *Sup, float *Sst, float *Xo,
                                   float *Sfin) {
    if (!kda_state_mma_fits(d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin))
        return dg__err(DG_ERR_ARG, "%s: sizes or alignment not supported (K=%d V=%d tc=%d)",
                       __func__, d->K, d->V, d->tc);
    const bool two = d->K > 128;
    KDA_DISPATCH_BT(d->BT, {
        if (bwd)
            return two ? state_mma_launch_t<BT_, 2, true>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin)
                       : state_mma_launch_t<BT_, 1, true>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin);
        return two ? state_mma_launch_t<BT_, 2, false>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin)
                   : state_mma_launch_t<BT_, 1, false>(ctx, d, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin);
    });
    return DG_OK;
}

// ---- KCP summaries (ops/kda/kcp.c)

__global__ void identity_kernel(float *I, int HV, int K) {
    const int64_t n = (int64_t)HV * K * K;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i % ((int64_t)K * K);
        I[i] = r / K == r % K ? 1.f : 0.f;
    }
}

extern "C" int kda_state_summary_fits(const kda_cuda_dims *d) {
    return d->tc == 1 && d->K % 16 == 0 && d->K <= 256 && d->V % 2 == 0;
}

extern "C" dg_status kda_state_summary_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int seq, int bwd,
                                            const float *A1, const float *X0, const float *A2,
                                            const float *G, const float *Sup, const float *S0,
                                            float *Sh, float *SM) {
    if (!ctx || !d || !d->buf || seq < 0 || seq >= d->N || !A1 || !A2 || !G || !Sh || !SM)
        return dg__err(DG_ERR_ARG, "%s: dims, seq in [0, N), A1, A2, G, Sh and SM are required",
                       __func__);
    if (!kda_state_summary_fits(d))
        return dg__err(DG_ERR_UNSUPPORTED, "%s: needs the TF32 path with K %% 16 == 0, K <= 256 "
                       "and V even (tc=%d K=%d V=%d)", __func__, d->tc, d->K, d->V);
    kda_cuda_dims one = *d; /* the sequence alone: block 0 walks chunks chunk_off[seq].. */
    one.N = 1;
    one.chunk_off = d->chunk_off + seq;
    DG_TRY(kda_state_mma(ctx, &one, bwd, A1, X0, A2, G, S0, Sup, nullptr, nullptr, Sh));
    /* the transition: the same pass over K columns from the identity, with no input term */
    const size_t ib = sizeof(float) * (size_t)d->HV * d->K * d->K;
    void *I = nullptr;
    DG_TRY(dg__cuda_malloc(ctx, ib, &I));
    identity_kernel<<<dg__blocks((int64_t)d->HV * d->K * d->K, 256), 256, 0, dg__stream(ctx)>>>(
        (float *)I, d->HV, d->K);
    dg_status st = cudaGetLastError() == cudaSuccess
                       ? DG_OK
                       : dg__err(DG_ERR_CUDA, "%s: identity_kernel launch failed", __func__);
    one.V = d->K;
    if (st == DG_OK)
        st = kda_state_mma(ctx, &one, bwd, A1, nullptr, A2, G, (const float *)I, nullptr, nullptr,
                           nullptr, SM);
    dg__cuda_free(ctx, I, ib);
    return st;
}

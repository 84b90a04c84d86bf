/*
 * kernels/kda/kda_mma.cuh -- the mma.sync building blocks of the KDA tensor-core kernels:
 * cp.async copies into shared memory, TF32 rounding, the m16n8k8 TF32 product, and one
 * chunk-local product C = s A B^T used by several backward stages. C++ only.
 *
 * Fragment layouts of mma.sync.m16n8k8 (PTX ISA), g = lane / 4, t = lane % 4:
 *   A (16 x 8, row):  a0 (g, t)   a1 (g + 8, t)   a2 (g, t + 4)   a3 (g + 8, t + 4)
 *   B (8 x 8, col):   b0 (k = t, n = g)           b1 (k = t + 4, n = g)
 *   C/D (16 x 8):     d0 (g, 2t)  d1 (g, 2t + 1)  d2 (g + 8, 2t)  d3 (g + 8, 2t + 1)
 * Operands that are "k-contiguous" in shared memory (row r, k at r * LD + k) are read without
 * bank conflicts when LD % 32 == 4: the 32 lanes then hit banks 4g + t, all distinct.
 */
#ifndef DG_KDA_MMA_CUH
#define DG_KDA_MMA_CUH

#include "../common.cuh"
#include "kda_cuda.h"

namespace kdamma {

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool pred) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = pred ? 16 : 0; /* 0: fill the 16 bytes with zeros, read nothing */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

/* d += a b on TF32 operands with f32 accumulators. */
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Rows [0, R) x columns [c0, c0 + C) of a row-major array with row stride rs (floats) into
 * shared memory with leading dimension LD; rows >= rows_ok and 4-column pieces at or past cols
 * are zero-filled. Block-wide over NT threads, 16 bytes per copy; src, rs and c0 must keep
 * every piece 16-byte aligned. */
template <int R, int C, int LD, int NT>
__device__ __forceinline__ void tile_async(float *dst, const float *__restrict__ src, int64_t rs,
                                           int rows_ok, int c0, int cols) {
    constexpr int Q = C / 4;
    for (int idx = threadIdx.x; idx < R * Q; idx += NT) {
        const int r = idx / Q, c = 4 * (idx % Q);
        const bool ok = r < rows_ok && c0 + c < cols;
        cp_async16(dst + r * LD + c, ok ? src + r * rs + c0 + c : src, ok);
    }
}

constexpr int AB_N = 64;  /* output columns per block */
constexpr int AB_KS = 32; /* k-step staged per pipeline stage */
constexpr int AB_LD = AB_KS + 4;
constexpr int AB_THREADS = 256;

/* One block: C[i][n] = s sum_k A[i][k] B[n][k] for rows i < L of a chunk (BT rows), columns
 * n < nn of a 64-column tile, k < nk. A rows have stride rsA, B rows stride rsB, C rows stride
 * rsC; all k-contiguous. Two shared-memory stages (cp.async), 8 warps: warp w owns m-tile
 * w / WN and NTW 8-column tiles. Needs nk % 4 == 0 and 16-byte aligned rows. */
template <int BT>
__device__ __forceinline__ void gemm_abt_tile(const float *__restrict__ A, int64_t rsA,
                                              const float *__restrict__ B, int64_t rsB,
                                              float *__restrict__ C, int64_t rsC, int L, int nn,
                                              int nk, float s, float *sm) {
    constexpr int WN = 8 / (BT / 16);  /* warps across the columns */
    constexpr int NTW = AB_N / 8 / WN; /* 8-column tiles per warp */
    /* stage b: A at sm + b * BT * AB_LD, B after both A stages (pointer arithmetic, not an
     * array of pointers, which a run-time index would put in local memory) */
    auto As = [&](int b) { return sm + b * BT * AB_LD; };
    auto Bs = [&](int b) { return sm + 2 * BT * AB_LD + b * AB_N * AB_LD; };
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / WN), n0 = 8 * NTW * (w % WN);
    float acc[NTW][4] = {};
    const int nst = (nk + AB_KS - 1) / AB_KS;
    tile_async<BT, AB_KS, AB_LD, AB_THREADS>(As(0), A, rsA, L, 0, nk);
    tile_async<AB_N, AB_KS, AB_LD, AB_THREADS>(Bs(0), B, rsB, nn, 0, nk);
    cp_async_commit();
    for (int st = 0; st < nst; st++) {
        const int b = st & 1;
        if (st + 1 < nst) {
            tile_async<BT, AB_KS, AB_LD, AB_THREADS>(As(b ^ 1), A, rsA, L, (st + 1) * AB_KS, nk);
            tile_async<AB_N, AB_KS, AB_LD, AB_THREADS>(Bs(b ^ 1), B, rsB, nn, (st + 1) * AB_KS,
                                                        nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const float *a0 = As(b) + (m0 + g) * AB_LD + t, *a1 = a0 + 8 * AB_LD;
#pragma unroll
        for (int k0 = 0; k0 < AB_KS; k0 += 8) {
            const unsigned a[4] = {tf32(a0[k0]), tf32(a1[k0]), tf32(a0[k0 + 4]),
                                   tf32(a1[k0 + 4])};
#pragma unroll
            for (int j = 0; j < NTW; j++) {
                const float *bp = Bs(b) + (n0 + 8 * j + g) * AB_LD + k0 + t;
                mma_tf32(acc[j], a, tf32(bp[0]), tf32(bp[4]));
            }
        }
        __syncthreads(); /* stage b is refilled next */
    }
#pragma unroll
    for (int j = 0; j < NTW; j++)
#pragma unroll
        for (int hlf = 0; hlf < 2; hlf++) {
            const int r = m0 + g + 8 * hlf, c = n0 + 8 * j + 2 * t;
            if (r < L && c < nn) {
                float *cp = C + r * rsC + c;
                if (c + 1 < nn) {
                    *reinterpret_cast<float2 *>(cp) =
                        make_float2(s * acc[j][2 * hlf], s * acc[j][2 * hlf + 1]);
                } else {
                    cp[0] = s * acc[j][2 * hlf];
                }
            }
        }
}

/* Shared memory of gemm_abt_tile, in floats. */
template <int BT> constexpr int gemm_abt_smem() { return 2 * (BT + AB_N) * AB_LD; }


constexpr int AB_LDB = AB_N + 8; /* row-major [k][n] stage: LD % 32 == 8 keeps b-reads conflict-free */

/* acc += A B for one block's BT x 64 tile, where A is k-contiguous (row i: A + i * rsA, k < nk,
 * rows >= rows_a zero) and B is n-contiguous (row k: B + k * rsB, columns n < nn, rows >= rows_b
 * zero). The k-range [0, nk) goes through shared memory in stages of 32 (two cp.async stages).
 * acc is warp w's part of the tile as in gemm_abt_tile (m-tile w / WN, NTW 8-column tiles). Needs
 * nk, rsA, rsB % 4 == 0 and 16-byte aligned A, B. Ends with a __syncthreads (sm reusable). */
template <int BT, int NTW>
__device__ __forceinline__ void gemm_ab_acc(float (&acc)[NTW][4], const float *__restrict__ A,
                                            int64_t rsA, int rows_a, const float *__restrict__ B,
                                            int64_t rsB, int rows_b, int nn, int nk, float *sm) {
    constexpr int WN = 8 / (BT / 16);
    static_assert(NTW == AB_N / 8 / WN, "NTW must match the warp layout");
    auto As = [&](int b) { return sm + b * BT * AB_LD; };
    auto Bs = [&](int b) { return sm + 2 * BT * AB_LD + b * AB_KS * AB_LDB; };
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / WN), n0 = 8 * NTW * (w % WN);
    const int nst = (nk + AB_KS - 1) / AB_KS;
    auto load = [&](int st, int b) {
        const int k0 = st * AB_KS;
        tile_async<BT, AB_KS, AB_LD, AB_THREADS>(As(b), A, rsA, rows_a, k0, nk);
        /* B rows k0.. : row r of the stage is B row k0 + r, valid below min(rows_b, nk) */
        const int rok = min(rows_b, nk) - k0;
        tile_async<AB_KS, AB_N, AB_LDB, AB_THREADS>(Bs(b), B + (int64_t)k0 * rsB, rsB, rok, 0,
                                                     nn);
    };
    load(0, 0);
    cp_async_commit();
    for (int st = 0; st < nst; st++) {
        const int b = st & 1;
        if (st + 1 < nst)
            load(st + 1, b ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const float *a0 = As(b) + (m0 + g) * AB_LD + t, *a1 = a0 + 8 * AB_LD;
#pragma unroll
        for (int k0 = 0; k0 < AB_KS; k0 += 8) {
            const unsigned a[4] = {tf32(a0[k0]), tf32(a1[k0]), tf32(a0[k0 + 4]),
                                   tf32(a1[k0 + 4])};
            const float *bp = Bs(b) + (k0 + t) * AB_LDB + n0 + g;
#pragma unroll
            for (int j = 0; j < NTW; j++)
                mma_tf32(acc[j], a, tf32(bp[8 * j]), tf32(bp[8 * j + 4 * AB_LDB]));
        }
        __syncthreads();
    }
}

/* Shared memory of gemm_ab_acc, in floats. */
template <int BT> constexpr int gemm_ab_smem() { return 2 * (BT * AB_LD + AB_KS * AB_LDB); }

/* Store a BT x 64 tile held as in gemm_abt_tile: C[r][c] = s acc for r < L, c < nn. */
template <int BT, int NTW>
__device__ __forceinline__ void store_acc(const float (&acc)[NTW][4], float *__restrict__ C,
                                          int64_t rsC, int L, int nn, float s) {
    constexpr int WN = 8 / (BT / 16);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / WN), n0 = 8 * NTW * (w % WN);
#pragma unroll
    for (int j = 0; j < NTW; j++)
#pragma unroll
        for (int hlf = 0; hlf < 2; hlf++) {
            const int r = m0 + g + 8 * hlf, c = n0 + 8 * j + 2 * t;
            if (r < L && c < nn) {
                float *cp = C + r * rsC + c;
                if (c + 1 < nn)
                    *reinterpret_cast<float2 *>(cp) =
                        make_float2(s * acc[j][2 * hlf], s * acc[j][2 * hlf + 1]);
                else
                    cp[0] = s * acc[j][2 * hlf];
            }
        }
}

} // namespace kdamma

#endif /* DG_KDA_MMA_CUH */

/*
 * kernels/kda/kda_tc.cuh -- the tensor-core (WMMA) building blocks of the KDA kernels' tc path
 * (kda_cuda_dims.tc != 0, see kda_cuda.h) and the launchers of the tc kernels. C++ only.
 *
 * Fragments: m16n16k8 with precision::tf32 operands and f32 accumulators (sm_80 and later; the
 * build targets sm_90). Operands are staged as f32 in shared memory and rounded to TF32 when a
 * fragment is loaded (P = 1), or split into hi + lo TF32 halves with three products
 * lo*hi + hi*lo + hi*hi (P = 2, "3xTF32", close to f32 accuracy). Accumulators stay f32.
 *
 * Shared-memory tiles are row-major f32 with a leading dimension of (columns + TC_PAD), TC_PAD =
 * 8: every leading dimension is then a multiple of 8 floats (32 bytes), so every 16x8 / 8x16
 * sub-tile that starts at a row and a column that are multiples of 8 is 256-bit aligned as
 * load_matrix_sync / store_matrix_sync require (ldm a multiple of 4 floats is what they need),
 * and rows do not start on the same bank (a leading dimension that is a multiple of 32 would
 * make the 8 rows of a fragment load hit one bank). Tiles are zero-padded: rows past a chunk's
 * L tokens and columns past K or V are loaded as zeros, so padded k-steps add exact zeros and
 * padded output rows/columns are never stored.
 * A transposed operand is the same row-major tile read as col_major (A^T(m,k) = A(k,m)).
 */
#ifndef DG_KDA_TC_CUH
#define DG_KDA_TC_CUH

#include <mma.h>
#include <type_traits>

#include "../common.cuh"
#include "kda_cuda.h"

namespace kdatc {

using namespace nvcuda;

constexpr int TC_THREADS = 256; /* 8 warps per block */
constexpr int TC_PAD = 8;

typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> Acc;
template <class Lay>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, Lay>;
template <class Lay>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, Lay>;
typedef wmma::row_major RM;
typedef wmma::col_major CM;

/* Round a loaded fragment to TF32 (P = 1), or split it into hi (kept in f) and lo (P = 2). */
template <class Frag> __device__ __forceinline__ void to_tf32(Frag &f) {
#pragma unroll
    for (int t = 0; t < f.num_elements; t++)
        f.x[t] = wmma::__float_to_tf32(f.x[t]);
}
template <class Frag> __device__ __forceinline__ void split_tf32(Frag &hi, Frag &lo) {
#pragma unroll
    for (int t = 0; t < hi.num_elements; t++) {
        const float x = hi.x[t], h = wmma::__float_to_tf32(x);
        hi.x[t] = h;
        lo.x[t] = wmma::__float_to_tf32(x - h);
    }
}

/* c += A B for one k-step from f32 fragments (rounded / split here; a and b are copies). */
template <int P, class LA, class LB>
__device__ __forceinline__ void mma_frag(Acc &c, FragA<LA> a, FragB<LB> b) {
    if (P == 1) {
        to_tf32(a);
        to_tf32(b);
        wmma::mma_sync(c, a, b, c);
    } else {
        FragA<LA> al;
        FragB<LB> bl;
        split_tf32(a, al);
        split_tf32(b, bl);
        wmma::mma_sync(c, al, b, c);
        wmma::mma_sync(c, a, bl, c);
        wmma::mma_sync(c, a, b, c);
    }
}

/* c += (NEG ? -1 : 1) * A B over nk8 k-steps of 8: A is 16 x 8*nk8 at a (leading dim lda,
 * layout LA), B is 8*nk8 x 16 at b (ldb, LB). Row-major A(m,k) = a[m*lda + k], col-major
 * A(m,k) = a[m + k*lda]; B likewise with (k,n). One warp, all lanes (nk8 warp-uniform). */
template <int P, bool NEG, class LA, class LB>
__device__ __forceinline__ void mma_k(Acc &c, const float *a, unsigned lda, const float *b,
                                      unsigned ldb, int nk8) {
    const bool arow = std::is_same<LA, RM>::value, brow = std::is_same<LB, RM>::value;
    for (int s = 0; s < nk8; s++) {
        FragA<LA> ah;
        FragB<LB> bh;
        wmma::load_matrix_sync(ah, a + (arow ? 8 * s : 8 * s * lda), lda);
        wmma::load_matrix_sync(bh, b + (brow ? 8 * s * ldb : 8 * s), ldb);
        if (NEG) {
#pragma unroll
            for (int t = 0; t < ah.num_elements; t++)
                ah.x[t] = -ah.x[t];
        }
        mma_frag<P>(c, ah, bh);
    }
}

/* dst[r*LD + c] = src[r*rs + c] for r < rows, c < cols, else 0, over the whole R x C tile
 * (columns C..LD-1 are not touched). Block-wide; consecutive threads take consecutive columns. */
template <int R, int C, int LD>
__device__ __forceinline__ void load_tile(float *dst, const float *__restrict__ src, int64_t rs,
                                          int rows, int cols) {
    for (int idx = threadIdx.x; idx < R * C; idx += TC_THREADS) {
        const int r = idx / C, c = idx % C;
        dst[r * LD + c] = (r < rows && c < cols) ? src[r * rs + c] : 0.f;
    }
}

/* dst[r*rs + c] = src[r*LD + c] for r < rows, c < cols (rows <= R, cols <= C). Block-wide. */
template <int R, int C, int LD>
__device__ __forceinline__ void store_tile(float *__restrict__ dst, int64_t rs, const float *src,
                                           int rows, int cols) {
    for (int idx = threadIdx.x; idx < R * C; idx += TC_THREADS) {
        const int r = idx / C, c = idx % C;
        if (r < rows && c < cols)
            dst[r * rs + c] = src[r * LD + c];
    }
}

} // namespace kdatc

/* Run the statements with P_ bound to 1 (TF32) or 2 (3xTF32) from d->tc. */
#define KDA_DISPATCH_P(tc, ...)                                                                    \
    do {                                                                                           \
        if ((tc) >= 2) {                                                                           \
            constexpr int P_ = 2;                                                                  \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            constexpr int P_ = 1;                                                                  \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

/* The tc launchers (kda_tc_fwd.cu, kda_tc_bwd.cu); the public launchers in kda_cuda.h call them
 * when d->tc != 0, after their own argument checks, with the same arguments. */
dg_status kda_intra_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *q,
                           const float *k, const float *beta, const float *G, float *Aqk,
                           float *Tm);
dg_status kda_output_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *QG,
                            const float *h, const float *Aqk, const float *E, float *O);
dg_status kda_state_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *W, const float *U,
                           const float *KG, const float *G, const float *h0, float *h, float *E,
                           float *ht);
dg_status kda_wy_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *q, const float *k,
                        const float *v, const float *beta, const float *G, const float *Tm,
                        float *W, float *U, float *KG, float *QG);
/* The serial kernel of the state backward (kda_bwd_state.cu's state_seq): dE_tot, the dHn_c
 * scratch [NC,HV,K,V] and dh0, each optional. */
dg_status kda_state_seq_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *W, const float *KG,
                               const float *G, const float *dh, const float *dE, const float *dht,
                               float *dEtot, float *dHs, float *dh0);
/* The serial state pass on mma.sync TF32 with the state in registers (kda_state_mma.cu), forward
 * (bwd = 0: A1 = W, X0 = U, A2 = KG, S0 = h0, Sst = h, Xo = E, Sfin = ht) or backward (bwd = 1:
 * A1 = KG, X0 = dE, A2 = W, S0 = dht, Sup = dh, Sst = dHn, Xo = dE_tot, Sfin = dh0). _fits says
 * whether the sizes and alignments allow it (tc == 1, K % 16 == 0, K <= 256, V even). */
int kda_state_mma_fits(const kda_cuda_dims *d, const float *A1, const float *X0, const float *A2,
                       const float *G, const float *S0, const float *Sup, const float *Sst,
                       const float *Xo, const float *Sfin);
dg_status kda_state_mma(dg_ctx *ctx, const kda_cuda_dims *d, int bwd, const float *A1,
                        const float *X0, const float *A2, const float *G, const float *S0,
                        const float *Sup, float *Sst, float *Xo, float *Sfin);
dg_status kda_state_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *W, const float *KG,
                           const float *G, const float *h, const float *E, const float *dh,
                           const float *dE, const float *dht, float *dW, float *dU, float *dKG,
                           float *dG, float *dh0);
dg_status kda_output_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *QG,
                            const float *h, const float *Aqk, const float *E, const float *dO,
                            float *dQG, float *dh, float *dAqk, float *dE);

#endif /* DG_KDA_TC_CUH */

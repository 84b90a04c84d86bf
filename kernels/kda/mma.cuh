/*
 * kernels/kda/mma.cuh -- the tensor-core building blocks of the KDA kernels' tc path
 * (kda_cuda_dims.tc != 0, see kda_cuda.h); C++ only. namespace kdamma: mma.sync m16n8k8 TF32
 * with cp.async staging: the cp.async and TF32 wrappers, the 3xTF32 product, and the chunk-local
 * tile product (A or A^T times B or B^T into a BT x 64 register tile: mma_stage on staged
 * operands, gemm_acc with its own two-stage cp.async pipeline, store_acc / store_acc_rows);
 * operands that are both bf16 go through m16n8k16 bf16 products with ldmatrix fragments instead
 * (exact products either way, half the instructions). KDA_DISPATCH_P binds the TF32 / 3xTF32
 * choice of d->tc at compile time.
 *
 * mma.sync (kdamma). Fragment layouts of mma.sync.m16n8k8 (PTX ISA), g = lane / 4, t = lane % 4:
 *   A (16 x 8, row):  a0 (g, t)   a1 (g + 8, t)   a2 (g, t + 4)   a3 (g + 8, t + 4)
 *   B (8 x 8, col):   b0 (k = t, n = g)           b1 (k = t + 4, n = g)
 *   C/D (16 x 8):     d0 (g, 2t)  d1 (g, 2t + 1)  d2 (g + 8, 2t)  d3 (g + 8, 2t + 1)
 * Operands that are "k-contiguous" in shared memory (row r, k at r * LD + k) are read without
 * bank conflicts when LD % 32 == 4: the 32 lanes then hit banks 4g + t, all distinct.
 */
#ifndef DG_KDA_MMA_CUH
#define DG_KDA_MMA_CUH

#include <type_traits>

#include "common.cuh"

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

/* x rounded to TF32 (nearest, ties away from zero, as cvt.rna.tf32.f32 rounds) in two integer
 * operations: half a TF32 unit added to the magnitude's bits, the 13 low bits cleared (cvt.rna
 * is emulated in four on sm_90). Infinities stay infinite; a NaN whose payload lies only in the
 * 13 low bits would become an infinity (no kernel input is such a NaN: arithmetic NaNs carry
 * the high payload bit). */
__device__ __forceinline__ unsigned tf32(float x) {
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

/* A bf16 value is a TF32 value (8 of TF32's 10 mantissa bits): widened, it needs no rounding. */
__device__ __forceinline__ unsigned tf32(kda_bf16 x) {
    return __float_as_uint(__bfloat162float(x));
}

/* d += a b on bf16 operands (m16n8k16) with f32 accumulators. Fragments (g = lane / 4,
 * t = lane % 4; each register holds two bf16, the lower k first): a0 (g, 2t..2t+1), a1 (g + 8,
 * 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..); b0 (k = 2t..2t+1, n = g), b1 (k = 2t + 8.., n =
 * g); d as in mma_tf32. */
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ldmatrix: 8 x 8 tiles of 16-bit elements from shared memory, one row address (16-byte
 * aligned) per lane: lanes 8i .. 8i + 7 give the rows of tile i, and r[i] receives tile i. Lane
 * l gets elements (l / 4, 2 (l % 4) ..+1) of each tile, or with .trans those of its transpose
 * ((2 (l % 4) ..+1, l / 4)). x4: four tiles; x2: two (lanes 0..15 give the addresses). */
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x2(unsigned (&r)[2], const void *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(s)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x2_t(unsigned (&r)[2], const void *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(s)
                 : "memory");
}

/* e^x as ex2.approx of x log2(e) (what __expf computes), with results below 2^-126 flushed to
 * zero instead of kept subnormal: two instructions instead of five. For exponential factors
 * whose subnormal values are far below anything they are added to. */
__device__ __forceinline__ float exp_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x * 1.44269504f));
    return y;
}

/* x = hi + lo, both TF32 (the 3xTF32 split): hi carries 11 bits of x, lo the next 11. */
__device__ __forceinline__ void tf32_split(float x, unsigned &hi, unsigned &lo) {
    hi = tf32(x);
    lo = tf32(x - __uint_as_float(hi));
}

/* d += a b on TF32 operands with f32 accumulators. */
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* d += a b to about f32 accuracy from split operands: lo*hi + hi*lo + hi*hi (lo*lo, ~2^-22
 * relative, dropped), the small products first. */
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const unsigned (&ah)[4],
                                           const unsigned (&al)[4], unsigned bh0, unsigned bh1,
                                           unsigned bl0, unsigned bl1) {
    mma_tf32(d, al, bh0, bh1);
    mma_tf32(d, ah, bl0, bl1);
    mma_tf32(d, ah, bh0, bh1);
}

/* Rows [0, R) x columns [c0, c0 + C) of a row-major array of T (f32 or bf16) with row stride
 * rs (elements) into shared memory of T with leading dimension LD; rows >= rows_ok and 16-byte
 * pieces (4 f32 or 8 bf16 columns) at or past cols are zero-filled. Block-wide over NT threads,
 * 16 bytes per copy; src, rs and c0 must keep every piece 16-byte aligned. */
template <int R, int C, int LD, int NT, class T>
__device__ __forceinline__ void tile_async(T *dst, const T *__restrict__ src, int64_t rs,
                                           int rows_ok, int c0, int cols) {
    constexpr int PE = 16 / sizeof(T), Q = C / PE;
    for (int idx = threadIdx.x; idx < R * Q; idx += NT) {
        const int r = idx / Q, c = PE * (idx % Q);
        const bool ok = r < rows_ok && c0 + c < cols;
        cp_async16(dst + r * LD + c, ok ? src + r * rs + c0 + c : src, ok);
    }
}

/* 8 bf16 values (one 16-byte load) widened and multiplied by s into two float4s at d */
__device__ __forceinline__ void bf16x8_store(float *d, uint4 u, float s) {
    const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&u);
    const float2 f0 = __bfloat1622float2(p[0]), f1 = __bfloat1622float2(p[1]);
    const float2 f2 = __bfloat1622float2(p[2]), f3 = __bfloat1622float2(p[3]);
    float4 *d4 = reinterpret_cast<float4 *>(d);
    d4[0] = make_float4(f0.x * s, f0.y * s, f1.x * s, f1.y * s);
    d4[1] = make_float4(f2.x * s, f2.y * s, f3.x * s, f3.y * s);
}
/* tile_async's tile into f32 shared memory from bf16 (the op's own bf16 leaves), in two halves so
 * that the loads of several tiles can be in flight together: load() issues every 16-byte load of
 * the thread (8 values, and their row scale rsc[r * rss] if rsc is given: q, k under
 * kda_cuda_dims.rq, rk), store() widens them to f32, times the scale, into the tile (rows >=
 * rows_ok and pieces at or past cols zero). Plain loads: the tile is complete when the caller's
 * next __syncthreads has passed. Needs src, rs and c0 to keep every piece 16-byte aligned and
 * cols % 8 == 0. */
template <int R, int C, int NT> struct TileInBf16 {
    static_assert(C % 8 == 0, "16-byte pieces");
    static constexpr int Q = C / 8, IT = (R * Q + NT - 1) / NT;
    uint4 u[IT];
    float s[IT];
    __device__ __forceinline__ void load(const kda_bf16 *__restrict__ src, int64_t rs, int rows_ok,
                                         int c0, int cols, const float *__restrict__ rsc,
                                         int64_t rss) {
#pragma unroll
        for (int it = 0; it < IT; it++) {
            const int idx = threadIdx.x + it * NT, r = idx / Q, c = 8 * (idx % Q);
            u[it] = make_uint4(0u, 0u, 0u, 0u);
            s[it] = 1.f;
            if (idx < R * Q && r < rows_ok && c0 + c < cols) {
                u[it] = __ldg(reinterpret_cast<const uint4 *>(src + r * rs + c0 + c));
                if (rsc)
                    s[it] = __ldg(rsc + r * rss);
            }
        }
    }
    template <int LD> __device__ __forceinline__ void store(float *dst) const {
        static_assert(LD % 4 == 0, "16-byte pieces");
#pragma unroll
        for (int it = 0; it < IT; it++) {
            const int idx = threadIdx.x + it * NT, r = idx / Q, c = 8 * (idx % Q);
            if (idx < R * Q)
                bf16x8_store(dst + r * LD + c, u[it], s[it]);
        }
    }
};

constexpr int AB_N = 64;         /* output columns per block */
constexpr int AB_KS = 32;        /* k-step staged per pipeline stage */
constexpr int AB_LDB = AB_N + 8; /* n-contiguous stage [32][64]: LD % 32 == 8, no conflicts */
constexpr int AB_THREADS = 256;
/* Leading dimension of a k-contiguous stage of T: f32 36 (the 32 lanes of a fragment read hit
 * banks 4g + t); bf16 40 (20 words: lanes t, t + 1 share a word, the 16 words hit distinct
 * banks, and rows stay 16-byte aligned for cp.async). The n- / m-contiguous stages keep BT + 8
 * and AB_N + 8 elements for both types (bf16: the words of t = 0..3 are 4, 20 or 36 words
 * apart, so a fragment read again hits 16 distinct banks). */
template <class T> constexpr int ab_ld() { return sizeof(T) == 4 ? AB_KS + 4 : AB_KS + 8; }

/* Warp layout of a block's BT x 64 output tile: 8 warps, warp w owns the 16-row m-tile w / WN
 * and NTW 8-column tiles from column n0. */
template <int BT> struct AbTile {
    static constexpr int WN = 8 / (BT / 16);  /* warps across the columns */
    static constexpr int NTW = AB_N / 8 / WN; /* 8-column tiles per warp */
};

/* acc += op(A) op(B) over KS k-values staged in shared memory (layouts as in gemm_acc: As with
 * leading dimension lda, Bs with ldb), for warp w's part of the BT x 64 tile. kbase: the k index
 * of the stage's first column, for the TRI mask. TF32 m16n8k8, or bf16 m16n8k16 when TA and TB
 * are both bf16 (TRI = 0 only). */
template <int BT, bool AK, bool BK, int TRI, int KS, class TA, class TB>
__device__ __forceinline__ void mma_stage(float (&acc)[AbTile<BT>::NTW][4], const TA *As, int lda,
                                          const TB *Bs, int ldb, int kbase) {
    constexpr int WN = AbTile<BT>::WN, NTW = AbTile<BT>::NTW;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / WN), n0 = 8 * NTW * (w % WN);
    if constexpr (std::is_same<TA, kda_bf16>::value && std::is_same<TB, kda_bf16>::value) {
        /* both operands bf16: m16n8k16 bf16 products (exact, like TF32 on the widened values,
         * half the instructions), fragments by ldmatrix (.trans where the stage holds the
         * operand's k along rows) */
        static_assert(KS % 16 == 0, "bf16 k-steps of 16");
        static_assert(TRI == 0, "no triangular bf16 x bf16 product is used (none tested)");
        const int l7 = lane & 7, l3 = (lane >> 3) & 1, l4 = lane >> 4;
#pragma unroll
        for (int k0 = 0; k0 < KS; k0 += 16) {
            unsigned a[4]; /* a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, ..) */
            if (AK)
                ldsm_x4(a, As + (m0 + l7 + 8 * l3) * lda + k0 + 8 * l4);
            else
                ldsm_x4_t(a, As + (k0 + l7 + 8 * l4) * lda + m0 + 8 * l3);
#pragma unroll
            for (int j = 0; j < NTW; j += 2) {
                if (j + 1 < NTW) { /* n-tiles j and j + 1: b0, b1 of each */
                    unsigned b[4];
                    if (BK)
                        ldsm_x4(b, Bs + (n0 + 8 * j + l7 + 8 * l4) * ldb + k0 + 8 * l3);
                    else
                        ldsm_x4_t(b, Bs + (k0 + l7 + 8 * l3) * ldb + n0 + 8 * j + 8 * l4);
                    mma_bf16(acc[j], a, b[0], b[1]);
                    mma_bf16(acc[j + 1], a, b[2], b[3]);
                } else { /* a last single n-tile (lanes 0..15 give the addresses) */
                    unsigned b[2];
                    if (BK)
                        ldsm_x2(b, Bs + (n0 + 8 * j + l7) * ldb + k0 + 8 * l3);
                    else
                        ldsm_x2_t(b, Bs + (k0 + l7 + 8 * l3) * ldb + n0 + 8 * j);
                    mma_bf16(acc[j], a, b[0], b[1]);
                }
            }
        }
    } else {
#pragma unroll
        for (int k0 = 0; k0 < KS; k0 += 8) {
            /* TRI == 1: the k-steps past the warp's last row are masked to zero for all its rows
             * and skipped (warp-uniform; adding zeros would leave the sums as they are). (The
             * same skip of the leading steps for TRI == 2 slowed the WY column kernel by 6%.) */
            if (TRI == 1 && kbase + k0 > m0 + 15)
                break;
            unsigned a[4];
            if (AK) { /* a0 (m = g, k = t) at row m, column k */
                const TA *ap = As + (m0 + g) * lda + k0 + t;
                a[0] = tf32(ap[0]);
                a[1] = tf32(ap[8 * lda]);
                a[2] = tf32(ap[4]);
                a[3] = tf32(ap[8 * lda + 4]);
            } else { /* at row k, column m */
                const TA *ap = As + (k0 + t) * lda + m0 + g;
                a[0] = tf32(ap[0]);
                a[1] = tf32(ap[8]);
                a[2] = tf32(ap[4 * lda]);
                a[3] = tf32(ap[4 * lda + 8]);
            }
            if (TRI) { /* a0 (m0 + g, kk), a1 (+8, kk), a2 (m0 + g, kk + 4), a3 (+8, kk + 4) */
                const int mm = m0 + g, kk = kbase + k0 + t;
                auto keep = [](int m, int k) { return TRI == 1 ? k <= m : k >= m; };
                a[0] = keep(mm, kk) ? a[0] : 0u;
                a[1] = keep(mm + 8, kk) ? a[1] : 0u;
                a[2] = keep(mm, kk + 4) ? a[2] : 0u;
                a[3] = keep(mm + 8, kk + 4) ? a[3] : 0u;
            }
#pragma unroll
            for (int j = 0; j < NTW; j++) {
                if (BK) { /* b0 (k = t, n = g) at row n, column k */
                    const TB *bp = Bs + (n0 + 8 * j + g) * ldb + k0 + t;
                    mma_tf32(acc[j], a, tf32(bp[0]), tf32(bp[4]));
                } else { /* at row k, column n */
                    const TB *bp = Bs + (k0 + t) * ldb + n0 + 8 * j + g;
                    mma_tf32(acc[j], a, tf32(bp[0]), tf32(bp[4 * ldb]));
                }
            }
        }
    }
}

/* The two-stage cp.async pipeline of gemm_acc and its kin: load(st, b) issues the cp.async copies
 * of stage st into buffer b (0 or 1), use(st, b) reads that buffer once every thread's copies
 * have landed; stage st + 1 is in flight while stage st is used. Ends with a __syncthreads
 * (both buffers reusable). */
template <class Load, class Use>
__device__ __forceinline__ void pipeline2(int nst, const Load &load, const Use &use) {
    load(0, 0);
    cp_async_commit();
    for (int st = 0; st < nst; st++) {
        const int b = st & 1;
        if (st + 1 < nst)
            load(st + 1, b ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        use(st, b);
        __syncthreads(); /* stage b is refilled next */
    }
}

/* acc += op(A) op(B) for one block's BT x 64 output tile, k over [0, nk) in shared-memory stages
 * of 32 (two cp.async stages). Layouts (all strides in floats):
 *   AK:  A is k-contiguous: row m at A + m * rsA, rows >= rows_a zero;
 *   !AK: A is m-contiguous (A^T stored): row k at A + k * rsA, k rows >= min(rows_b, nk) zero,
 *        columns (m) >= rows_a zero;
 *   BK:  B is k-contiguous (B^T stored): row n at B + n * rsB, rows >= rows_b zero;
 *   !BK: B is n-contiguous: row k at B + k * rsB, k rows >= min(rows_b, nk) zero, columns >= nn
 *        zero.
 * TRI masks A to a triangle as it is read (the stored values elsewhere are ignored): 0 none,
 * 1 keeps A(m, k) for k <= m, 2 for k >= m (m, k counted from the tile's first row / column).
 * Needs nk, rsA, rsB, rows_a (when !AK), nn (when !BK) % 4 == 0 (% 8 where that operand is
 * bf16: tile_async zero-fills whole 16-byte pieces only) and 16-byte aligned A, B; a !AK A
 * takes its k-row bound from rows_b, which is B's k-row count only when !BK (so !AK needs !BK).
 * Every fragment read is free of bank conflicts (f32: k-contiguous stages have LD % 32 == 4, the
 * others LD % 32 == 8; bf16, read by ldmatrix: the 8 rows of a matrix, 80, 144, 80 or 48 bytes
 * apart, start on disjoint groups of four banks). Ends with a __syncthreads (sm reusable). */
template <int BT, bool AK, bool BK, int TRI = 0, class TA = float, class TB = float>
__device__ __forceinline__ void gemm_acc(float (&acc)[AbTile<BT>::NTW][4], const TA *__restrict__ A,
                                         int64_t rsA, int rows_a, const TB *__restrict__ B,
                                         int64_t rsB, int rows_b, int nn, int nk, float *sm) {
    static_assert(AK || !BK, "an m-contiguous A bounds its k rows by rows_b: B must be !BK");
    constexpr int LDA = AK ? ab_ld<TA>() : BT + 8, LDB = BK ? ab_ld<TB>() : AB_LDB;
    constexpr int ASTAGE = AK ? BT * LDA : AB_KS * LDA;   /* elements of TA */
    constexpr int BSTAGE = BK ? AB_N * LDB : AB_KS * LDB; /* elements of TB */
    /* stage b: A at sm + b * ASTAGE, B after both A stages (pointer arithmetic, not an array of
     * pointers, which a run-time index would put in local memory) */
    TA *const sa = reinterpret_cast<TA *>(sm);
    TB *const sb = reinterpret_cast<TB *>(sa + 2 * ASTAGE);
    auto As = [&](int b) { return sa + b * ASTAGE; };
    auto Bs = [&](int b) { return sb + b * BSTAGE; };
    const int nst = (nk + AB_KS - 1) / AB_KS;
    auto load = [&](int st, int b) {
        const int k0 = st * AB_KS;
        if (AK)
            tile_async<BT, AB_KS, LDA, AB_THREADS>(As(b), A, rsA, rows_a, k0, nk);
        else
            tile_async<AB_KS, BT, LDA, AB_THREADS>(As(b), A + (int64_t)k0 * rsA, rsA,
                                                   min(rows_b, nk) - k0, 0, rows_a);
        if (BK)
            tile_async<AB_N, AB_KS, LDB, AB_THREADS>(Bs(b), B, rsB, rows_b, k0, nk);
        else /* stage row r is B row k0 + r, valid below min(rows_b, nk) */
            tile_async<AB_KS, AB_N, LDB, AB_THREADS>(Bs(b), B + (int64_t)k0 * rsB, rsB,
                                                     min(rows_b, nk) - k0, 0, nn);
    };
    pipeline2(nst, load, [&](int st, int b) {
        mma_stage<BT, AK, BK, TRI, AB_KS>(acc, As(b), LDA, Bs(b), LDB, st * AB_KS);
    });
}

/* Shared memory of gemm_acc with operands of TA and TB, in floats (rounded up). */
template <int BT, bool AK, bool BK, class TA = float, class TB = float> constexpr int gemm_smem() {
    return (2 * (int)sizeof(TA) * (AK ? BT * ab_ld<TA>() : AB_KS * (BT + 8)) +
            2 * (int)sizeof(TB) * (BK ? AB_N * ab_ld<TB>() : AB_KS * AB_LDB) + 3) /
           4;
}

/* Store a BT x 64 tile held as gemm_acc leaves it: C[r][c] = s acc for r < L, c < nn (rows of C
 * at stride rsC; C of f32 or bf16, pairs stored together, so C and rsC even). LOWER: zero above
 * the diagonal (c > r). */
template <int BT, bool LOWER = false, class TC = float>
__device__ __forceinline__ void store_acc(const float (&acc)[AbTile<BT>::NTW][4],
                                          TC *__restrict__ C, int64_t rsC, int L, int nn, float s) {
    constexpr int WN = AbTile<BT>::WN, NTW = AbTile<BT>::NTW;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / WN), n0 = 8 * NTW * (w % WN);
#pragma unroll
    for (int j = 0; j < NTW; j++)
#pragma unroll
        for (int hlf = 0; hlf < 2; hlf++) {
            const int r = m0 + g + 8 * hlf, c = n0 + 8 * j + 2 * t;
            if (r < L && c < nn) {
                TC *cp = C + r * rsC + c;
                const float v0 = LOWER && c > r ? 0.f : s * acc[j][2 * hlf];
                const float v1 = LOWER && c + 1 > r ? 0.f : s * acc[j][2 * hlf + 1];
                if (c + 1 < nn)
                    kda_st2(cp, v0, v1);
                else
                    kda_st(cp, v0);
            }
        }
}

/* store_acc for a bf16 C, through shared memory: the scaled tile is staged in sm (BT rows of
 * AB_N + 8 bf16: the fragment writes hit banks 4g + t) and written as 16-byte row pieces, so the
 * stores fill whole sectors (fragment-wise bf16 stores write 4-byte pieces eight rows apart,
 * which measured 12-22% slower on the output backward's dh, 6-8% on the WY and output forward).
 * Needs nn % 8 == 0, rsC % 8 == 0, a 16-byte aligned C and sm free (gemm_acc ends with a barrier);
 * every thread must call it. */
template <int BT>
__device__ __forceinline__ void store_acc_rows(const float (&acc)[AbTile<BT>::NTW][4],
                                               kda_bf16 *__restrict__ C, int64_t rsC, int L, int nn,
                                               float s, kda_bf16 *sm) {
    constexpr int WN = AbTile<BT>::WN, NTW = AbTile<BT>::NTW, LD = AB_N + 8, PR = AB_N / 8;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / WN), n0 = 8 * NTW * (w % WN);
#pragma unroll
    for (int j = 0; j < NTW; j++)
#pragma unroll
        for (int hlf = 0; hlf < 2; hlf++)
            kda_st2(sm + (m0 + g + 8 * hlf) * LD + n0 + 8 * j + 2 * t, s * acc[j][2 * hlf],
                    s * acc[j][2 * hlf + 1]);
    __syncthreads();
    for (int idx = threadIdx.x; idx < BT * PR; idx += AB_THREADS) {
        const int r = idx / PR, c = 8 * (idx % PR);
        if (r < L && c < nn)
            *reinterpret_cast<uint4 *>(C + r * rsC + c) =
                *reinterpret_cast<const uint4 *>(sm + r * LD + c);
    }
}

} // namespace kdamma

#endif /* DG_KDA_MMA_CUH */

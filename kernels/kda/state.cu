/*
 * kernels/kda/state.cu -- N6, the inter-chunk state pass (kda.md §11.4(d) forward; §11.6 B2, §2 N6
 * backward) and the KCP summaries built on it (ops/kda/kcp.c); CPU twins: dg__kda_state_fwd_f32 /
 * dg__kda_state_bwd_f32 in ops/kda/state.c.
 *
 * Forward, per sequence and value head, for each chunk c in order (lambda_c = G of the chunk's
 * last token): h_c stored (the state at chunk START), E_c = U_c - W_c h_c,
 * h_{c+1} = Diag(exp(lambda_c)) h_c + KG_c^T E_c;  ht = h_NT.
 * Backward, chunks c = NT-1 .. 0, dH = dht (grad of the final state):
 *   dHn_c   = dH                                   (grad of h_{c+1}, the state at chunk end)
 *   dE_tot  = dE_c + KG_c dHn_c          -> dU = dE_tot
 *   dH      = exp(lambda_c) dHn_c - W_c^T dE_tot + dh_c      (grad of h_c, the chunk start)
 *   dKG = E dHn^T,  dW = -dE_tot h_c^T,  dG[L-1] = exp(lambda) rowsum(h_c . dHn)  (other rows 0)
 * dh0 = dH after chunk 0. Layouts: W, KG, G [TT,HV,K]; U, E [TT,HV,V]; h [NC,HV,K,V] (row
 * chunk_off[n] + c); h0, ht [N,HV,K,V].
 *
 * The serial passes of both directions have one shape:
 *   forward,  chunks in order:    store S = h_c;   X = U  - W  S  -> E;
 *                                 S = exp(lambda) S + KG^T X
 *   backward, chunks in reverse:  store S = dHn_c; X = dE + KG S -> dE_tot;
 *                                 S = exp(lambda) S + dh_c - W^T X
 * i.e. X = X0 + sgnA A1 S and S = exp(lambda) S + Sup_c + sgnB A2^T X with (A1, A2, sgnA, sgnB)
 * = (W, KG, -, +) forward and (KG, W, +, -) backward, so the tensor-core kernel of that pass
 * (state_mma_kernel) serves both, with BWD a template parameter.
 * The backward's three products that sum over V (dKG, dW, the lambda term) run after the serial
 * pass, chunk-parallel (rows_stateT), from the dHn_c it stores into a scratch [NC,HV,K,V]: no
 * value tile ever needs another tile's partial sums (no atomics, no cross-tile reduction) and
 * the serial kernel does 4 K V FLOP per token instead of 8, at the cost of a scratch the size
 * of h.
 *
 * Variants (the tc mode of kda_cuda_dims, kda_cuda.h):
 *   f32 FFMA (tc == 0, and whatever the mma kernels do not take: tc == 2, the 3xTF32 mode, which
 *   this stage serves in f32; other sizes or alignments; bf16 intermediates there are refused):
 *     forward  kda_state_fwd_kernel: block per (sequence, hv, 32 value columns), the state in
 *              shared memory, W / KG tiles streamed through registers;
 *     backward state_seq_kernel (the serial pass: dE_tot and the dH update, block per
 *              (sequence, hv, 32-wide value tile), dH [K][32] in shared memory: K x 32 +
 *              2 x BT x 32 floats, 32 KB at K = 128, BT = 64; 48 KB at K = 256), then
 *              rows_stateT_kernel (dKG, dW and dG in one kernel, block per (chunk, hv, 32-wide
 *              key tile) holding all of V).
 *   tc == 1 and K % 16 == 0, K <= 256, V even, 16-byte aligned arrays (state_mma_fits):
 *     the serial pass of both directions is state_mma_kernel (mma.sync TF32, state in
 *     registers, next chunk's tiles fetched with cp.async; see its comment);
 *     With tc != 0 the backward's chunk-parallel part is state_rows_mma_kernel (dKG, dW and dG
 *     in one pass over V) when all three are asked for, tc == 1 and the sizes and alignments
 *     allow; else rows_stateT_mma_kernel (tc == 1 where the sizes allow, else rows_stateT_kernel)
 *     one product at a time, and dG in state_dg_tc_kernel.
 * The product C = s A S_c^T of rows_stateT (the FFMA and tensor-core kernels) also gives the
 * output backward's FFMA path its dQG = s dO h^T (dg__kda_rows_stateT, declared in common.cuh;
 * the tensor-core path forms dQG with dh in output.cu's out_dhq_mma_kernel).
 * KCP summaries (dg__kda_state_summary_cuda): the same serial pass on state_mma_kernel, over one
 * sequence, from S0 with the input and from the identity without it.
 * Entry points (kda_cuda.h): dg__kda_state_fwd_cuda, dg__kda_state_bwd_cuda,
 * dg__kda_state_summary_fits, dg__kda_state_summary_cuda; for output.cu: dg__kda_rows_stateT.
 */
#include "common.cuh"
#include "mma.cuh"

using namespace kdab;

// ---- device helpers

/* Tile [BT][32] of a [TT,HV,K] array (rows = tokens t0.., columns kt0..), zero outside the L
 * valid rows and K: thread tid holds rows tid/32 + 8p, column tid%32 (coalesced 128-byte rows). */
template <int BT>
__device__ __forceinline__ void kda_tile_load(float (&pf)[BT / 8], const float *__restrict__ src,
                                              int64_t t0, int L, int HV, int hv, int K, int kt0,
                                              int tid) {
    const int col = tid & 31;
#pragma unroll
    for (int p = 0; p < BT / 8; p++) {
        const int row = (tid >> 5) + 8 * p;
        pf[p] = (row < L && kt0 + col < K) ? src[((t0 + row) * HV + hv) * K + kt0 + col] : 0.f;
    }
}

template <int BT>
__device__ __forceinline__ void kda_tile_store(const float (&pf)[BT / 8], float *Ts, int tid) {
#pragma unroll
    for (int p = 0; p < BT / 8; p++)
        Ts[((tid >> 5) + 8 * p) * KDA_KT + (tid & 31)] = pf[p];
}

namespace {

constexpr int SM_THREADS = 256;

/* x rounded to TF32 (the value kdamma::tf32 gives), as a float. */
__device__ __forceinline__ float tf32r(float x) { return __uint_as_float(kdamma::tf32(x)); }

/* A staged S or X element of state_mma_kernel's TF32 path as an operand: stored rounded already
 * (the bf16 overload only keeps the kernel's other path compiling). */
__device__ __forceinline__ unsigned staged_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ unsigned staged_bits(kda_bf16 x) { return kdamma::tf32(x); }

/* This thread's walk over the 16-byte pieces of a [BT][K] tile of T (q = K / (16 / sizeof(T))
 * pieces per row, thread tid takes pieces tid, tid + 256, ...): its first piece (r0, c0) and the
 * step (dr, dc), worked out once per kernel so that the per-chunk loads divide nothing. */
struct TileWalk {
    int r0, c0, dr, dc, q;
};
template <class T> __device__ __forceinline__ TileWalk tile_walk(int K) {
    const int q = K / (16 / (int)sizeof(T));
    return TileWalk{(int)threadIdx.x / q, (int)threadIdx.x % q, SM_THREADS / q, SM_THREADS % q, q};
}

/* Rows [0, BT) x columns [0, K) of two [TT, HV, K] arrays of T (f32 or bf16) starting at token
 * t0 (the same pieces of both: A1 and A2 of state_mma_kernel), into shared memory of T with
 * leading dimensions LD1, LD2 (elements); rows >= L are zero-filled. Block-wide, 16 bytes per
 * op, pieces in the order of tw (tile_walk). Where the block's threads cover whole rows (K a
 * power of two: tw.dc == 0) a thread's column is fixed and its pointers only advance. */
template <int BT, class T>
__device__ __forceinline__ void tiles_async(T *d1, int LD1, const T *__restrict__ s1, T *d2,
                                            int LD2, const T *__restrict__ s2, int64_t t0, int L,
                                            int HV, int hv, int K, const TileWalk &tw) {
    constexpr int PE = 16 / sizeof(T);
    const int64_t rs = (int64_t)HV * K;
    if (tw.dc == 0) {
        const int64_t step = tw.dr * rs;
        int64_t off = ((t0 + tw.r0) * HV + hv) * (int64_t)K + PE * tw.c0;
        int o1 = tw.r0 * LD1 + PE * tw.c0, o2 = tw.r0 * LD2 + PE * tw.c0;
#pragma unroll 4
        for (int r = tw.r0; r < BT; r += tw.dr, off += step, o1 += tw.dr * LD1, o2 += tw.dr * LD2) {
            const bool ok = r < L;
            kdamma::cp_async16(d1 + o1, ok ? s1 + off : s1, ok);
            kdamma::cp_async16(d2 + o2, ok ? s2 + off : s2, ok);
        }
        return;
    }
    const int64_t base = (t0 * HV + hv) * (int64_t)K;
    for (int r = tw.r0, c = tw.c0; r < BT;) {
        const bool ok = r < L;
        const int64_t off = base + r * rs + PE * c;
        kdamma::cp_async16(d1 + r * LD1 + PE * c, ok ? s1 + off : s1, ok);
        kdamma::cp_async16(d2 + r * LD2 + PE * c, ok ? s2 + off : s2, ok);
        r += tw.dr;
        c += tw.dc;
        if (c >= tw.q) {
            c -= tw.q;
            r++;
        }
    }
}

/* Where chunk it of a block's walk starts (t0) and how many tokens it has (L; 0 past the end). */
struct ChunkAt {
    int64_t t0;
    int L;
};

/* Leading dimensions of the A1 / A2 tiles of state_mma_kernel, in elements of T: f32 K + 4 and
 * K + 8 (conflict-free fragment reads, see the kernel); bf16 K + 8 for both (rows 16-byte
 * aligned; lanes t, t + 1 read one word, the 16 words of a read hit distinct banks). */
template <class T> __host__ __device__ constexpr int state_ld1(int K) {
    return sizeof(T) == 4 ? K + 4 : K + 8;
}

/* Operand buffers of state_mma_kernel: two for bf16 (the next chunk's W, KG and lambda load
 * during the whole of the current chunk's step; two blocks per SM still fit at K = 128), one for
 * f32 (two would leave one block per SM). */
template <class T> __host__ __device__ constexpr int state_nbuf() { return sizeof(T) == 2 ? 2 : 1; }

} // namespace

// ---- forward kernels (state_mma_kernel also runs the backward's serial pass)

/* One block of 256 threads per (sequence, value head, 32-column tile of V): blockIdx = (n, hv,
 * vtile). The running state h [KP][32] (KP = K rounded up to 32) lives in shared memory; warp w,
 * lane l own column l. Per chunk:
 *   phase A  E = U - W h:       warp w computes rows w*BT/8.. of E (W rows read as broadcast
 *                               float4s from a [BT][32] tile, h rows as one float per lane);
 *   phase B  h = exp(lam) h + KG^T E:  warp w updates key rows kt0 + 4w..4w+3 of each tile.
 * The W/KG tiles stream through one buffer; the next tile (the next chunk's first W tile after
 * the last KG tile) is loaded into registers while the current one is used. */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_state_fwd_kernel(const int64_t *__restrict__ chunk_off,
                         const int64_t *__restrict__ chunk_t0,
                         const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                         const float *__restrict__ W, const float *__restrict__ U,
                         const float *__restrict__ KG, const float *__restrict__ G,
                         const float *__restrict__ h0, float *__restrict__ h, float *__restrict__ E,
                         float *__restrict__ ht) {
    constexpr int VT = KDA_VT, KT = KDA_KT, RW = BT / 8;
    extern __shared__ __align__(16) float kda_state_smem[];
    const int nk = (K + KT - 1) / KT, KP = nk * KT;
    float *hs = kda_state_smem; /* [KP][VT] */
    float *Es = hs + KP * VT;   /* [BT][VT] */
    float *Ts = Es + BT * VT;   /* [BT][KT] */
    float *lam = Ts + BT * KT;  /* [KP] */

    const int n = blockIdx.x, hv = blockIdx.y;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int col = blockIdx.z * VT + lane;
    const bool colok = col < V;

    for (int kk = w; kk < KP; kk += 8)
        hs[kk * VT + lane] =
            (h0 && kk < K && colok) ? h0[(((int64_t)n * HV + hv) * K + kk) * V + col] : 0.f;
    __syncthreads();

    const int64_t c_beg = chunk_off[n], c_end = chunk_off[n + 1];
    float pf[BT / 8];
    if (c_beg < c_end)
        kda_tile_load<BT>(pf, W, chunk_t0[c_beg], chunk_len[c_beg], HV, hv, K, 0, tid);

    for (int64_t ch = c_beg; ch < c_end; ch++) {
        const int64_t t0 = chunk_t0[ch];
        const int L = chunk_len[ch];
        if (colok)
            for (int kk = w; kk < K; kk += 8)
                h[((ch * HV + hv) * K + kk) * V + col] = hs[kk * VT + lane];
        for (int kk = tid; kk < KP; kk += KDA_THREADS)
            lam[kk] = kk < K ? G[((t0 + L - 1) * HV + hv) * K + kk] : 0.f;
        float u[RW], acc[RW];
#pragma unroll
        for (int a = 0; a < RW; a++) {
            const int i = w * RW + a;
            u[a] = (i < L && colok) ? U[((t0 + i) * HV + hv) * V + col] : 0.f;
            acc[a] = 0.f;
        }

        /* phase A: acc = W h */
        for (int s = 0; s < nk; s++) {
            kda_tile_store<BT>(pf, Ts, tid);
            __syncthreads();
            if (s + 1 < nk)
                kda_tile_load<BT>(pf, W, t0, L, HV, hv, K, (s + 1) * KT, tid);
            else
                kda_tile_load<BT>(pf, KG, t0, L, HV, hv, K, 0, tid);
            const float *hk = hs + s * KT * VT + lane;
#pragma unroll
            for (int kk = 0; kk < KT; kk += 4) {
                const float x0 = hk[(kk + 0) * VT], x1 = hk[(kk + 1) * VT];
                const float x2 = hk[(kk + 2) * VT], x3 = hk[(kk + 3) * VT];
#pragma unroll
                for (int a = 0; a < RW; a++) {
                    const float4 wv =
                        *reinterpret_cast<const float4 *>(Ts + (w * RW + a) * KT + kk);
                    acc[a] += wv.x * x0;
                    acc[a] += wv.y * x1;
                    acc[a] += wv.z * x2;
                    acc[a] += wv.w * x3;
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < RW; a++) {
            const int i = w * RW + a;
            const float e = u[a] - acc[a];
            Es[i * VT + lane] = i < L ? e : 0.f;
            if (i < L && colok)
                E[((t0 + i) * HV + hv) * V + col] = e;
        }

        /* phase B: h = exp(lam) h + KG^T E (rows of KG and E beyond L are zero) */
        for (int s = 0; s < nk; s++) {
            kda_tile_store<BT>(pf, Ts, tid);
            __syncthreads();
            if (s + 1 < nk)
                kda_tile_load<BT>(pf, KG, t0, L, HV, hv, K, (s + 1) * KT, tid);
            else if (ch + 1 < c_end)
                kda_tile_load<BT>(pf, W, chunk_t0[ch + 1], chunk_len[ch + 1], HV, hv, K, 0, tid);
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; i++) {
                const float4 kg = *reinterpret_cast<const float4 *>(Ts + i * KT + 4 * w);
                const float ev = Es[i * VT + lane];
                s0 += kg.x * ev;
                s1 += kg.y * ev;
                s2 += kg.z * ev;
                s3 += kg.w * ev;
            }
            const int kb = s * KT + 4 * w;
            float *hr = hs + kb * VT + lane;
            hr[0 * VT] = expf(lam[kb + 0]) * hr[0 * VT] + s0;
            hr[1 * VT] = expf(lam[kb + 1]) * hr[1 * VT] + s1;
            hr[2 * VT] = expf(lam[kb + 2]) * hr[2 * VT] + s2;
            hr[3 * VT] = expf(lam[kb + 3]) * hr[3 * VT] + s3;
            __syncthreads();
        }
    }

    if (ht && colok)
        for (int kk = w; kk < K; kk += 8)
            ht[(((int64_t)n * HV + hv) * K + kk) * V + col] = hs[kk * VT + lane];
}

/* The serial pass on mma.sync TF32 with the state in registers (tc == 1), forward and backward,
 * where the sizes allow (state_mma_fits). Work split: one block of 8
 * warps per (sequence, value head, VT value columns), VT = 16, 32 or 64 picked by the launcher
 * from the number of waves the grid needs. What makes it fast compared with a shared-memory state:
 *   - the running state S [K][VT] lives in registers as mma accumulators (warp w owns the 16-row
 *     tiles w and w + 8 of S, all VT / 8 8-column tiles), so the update S += A2^T X accumulates in
 *     place; S goes through shared memory once per chunk only as the B operand of A1 S;
 *   - the operands of the chunks ahead (A1, A2 tiles and lambda) are fetched with cp.async into
 *     a ring of NB buffers (state_nbuf: two for bf16, so chunk c + 1 loads during the whole of
 *     chunk c's step; one for f32), one commit group per chunk; with two buffers X is staged in
 *     its own space, so a step has three barriers;
 *   - per-step bookkeeping kept small (the serial pass was issue-bound: ncu counted ~1400
 *     instructions per warp and chunk step, 5% of them MMAs): the chunk tables are read one step
 *     ahead of use, a thread's 16-byte pieces of a tile keep their column where K is a power of
 *     two (pointers only advance), h (and the forward's E) leave from their bf16 staging buffers
 *     as 16-byte row pieces, and the backward's Sup tile is loaded before the barrier that
 *     precedes its use;
 *   - f32 operands (TA = f32): mma.sync m16n8k8 TF32 with f32 accumulators, fragments read
 *     straight from padded shared memory (row pads chosen so that both the row-major A1 reads and
 *     the transposed A2 reads are free of bank conflicts); the staged S and X are TF32-rounded;
 *   - bf16 operands (TA = bf16, kda_cuda_dims.mid): mma.sync m16n8k16 bf16 with f32
 *     accumulators, every fragment loaded by ldmatrix (.trans for the token-major A2 and the
 *     k-major S and X); the staged S and X are rounded to bf16 (the state itself stays f32 in
 *     registers). Half the MMAs of the TF32 form and a quarter of the fragment loads. Rows of
 *     A1s, A2s (K + 8) and Ss, Xs (VT + 8 elements) keep every ldmatrix phase free of bank
 *     conflicts.
 * Needs K % 16 == 0, K <= 256, V even and 16-byte aligned arrays (state_mma_fits); other sizes
 * take the FFMA kernels. The same kernel computes the KCP summaries of one sequence
 * (dg__kda_state_summary_cuda).
 * PLUS (DPLR's passes, kda_state_plus; f32 operands only): both products added, X = X0 + A1 S and
 * S = exp(lambda) S + Sup_c + A2^T X, in either direction.
 * MT: 16-row tiles of S per warp (K <= 128: 1, K <= 256: 2). VT: value columns per block (16, 32
 * or 64; the launcher picks it from the grid size). TA: the storage of A1 and A2 (W, KG: f32 or
 * bf16, kda_cuda_dims.mid); the forward's X0, Sst, Xo (U, h, E) have it too, and so do the
 * backward's Sup and Sst (dh and dHn, stored like h); its X0, Xo (dE, dE_tot) are f32. Dynamic
 * shared memory (state_mma_smem): NB x A1s [BT][state_ld1], NB x A2s [BT][K + 8] of TA, then Ss
 * [K][VT + 8] and Xs [BT][VT + 8] of TA (one buffer: Xs reuses Ss, max(K, BT) rows), NB x f32 Gs
 * [K]. */
template <int BT, int MT, int VT, bool BWD, class TA, bool PLUS>
__global__ void __launch_bounds__(SM_THREADS, MT == 1 ? 2 : 1) /* K <= 128: two blocks per SM */
    state_mma_kernel(const int64_t *__restrict__ chunk_off, const int64_t *__restrict__ chunk_t0,
                     const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                     const TA *__restrict__ A1,
                     const typename std::conditional<BWD, float, TA>::type *__restrict__ X0,
                     const TA *__restrict__ A2, const float *__restrict__ G,
                     const float *__restrict__ S0, const TA *__restrict__ Sup, TA *__restrict__ Sst,
                     typename std::conditional<BWD, float, TA>::type *__restrict__ Xo,
                     float *__restrict__ Sfin) {
    constexpr int LDS = VT + 8, LDX = VT + 8; /* f32: % 32 in {8, 24}: conflict-free b-reads */
    constexpr int NJ = VT / 8;                /* 8-column tiles of S per warp */
    constexpr int NXT = VT / 16;              /* 8-column tiles of X per warp */
    constexpr bool B16 = sizeof(TA) == 2;     /* bf16 operands: m16n8k16 from ldmatrix */
    typedef typename std::conditional<BWD, float, TA>::type TX;
    typedef TA TS; /* the staged S and X: TF32-rounded f32, or bf16 */
    extern __shared__ __align__(16) float sm_smem[];
    constexpr int NB = state_nbuf<TA>(); /* operand buffers: chunk it + NB - 1 loads during it */
    constexpr bool XOWN = NB > 1;        /* Xs has its own space (else it reuses Ss's) */
    const int LD1 = state_ld1<TA>(K), LD2 = K + 8;
    TA *const A1b = reinterpret_cast<TA *>(sm_smem);
    TA *const A2b = A1b + NB * BT * LD1;
    TS *const Ss = A2b + NB * BT * LD2;
    TS *const Xs = XOWN ? Ss + K * LDS : Ss; /* reused: max(K, BT) rows of Ss, after a barrier */
    float *const Gb = reinterpret_cast<float *>(Xs + (XOWN ? BT : (K > BT ? K : BT)) * LDS);
    /* ldmatrix addressing: lane l gives row l % 8 of 8 x 8 tile l / 8 */
    const int mat = (int)(threadIdx.x & 31) >> 3, mr = (int)threadIdx.x & 7;

    const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VT;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nv = min(VT, V - v0);
    const int64_t rv = (int64_t)HV * V, KV = (int64_t)K * V;
    const int mtiles = K / 16;
    const TileWalk tw = tile_walk<TA>(K);

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
                    S[m][j][e] =
                        (s0 && w + 8 * m < mtiles && c < nv) ? s0[(int64_t)r * V + c] : 0.f;
                }
    }

    /* S -> dst (row r at dst + r * ld; global: only the nv valid columns, as they are; shared:
     * rounded to TF32 once here, so the fragment reads of the A1 S product need no conversion) */
    auto store_S = [&](auto *dst, int64_t ld, bool global) {
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if (w + 8 * m >= mtiles)
                continue;
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++) {
                    const int r = 16 * (w + 8 * m) + g + 8 * hlf, c = 8 * j + 2 * t;
                    if (global && c < nv)
                        kda_st2(dst + r * ld + c, S[m][j][2 * hlf], S[m][j][2 * hlf + 1]);
                    else if (!global && B16)
                        kda_st2(dst + r * ld + c, S[m][j][2 * hlf], S[m][j][2 * hlf + 1]);
                    else if (!global)
                        kda_st2(dst + r * ld + c, tf32r(S[m][j][2 * hlf]),
                                tf32r(S[m][j][2 * hlf + 1]));
                }
        }
    };

    const int64_t c_beg = chunk_off[n], c_end = chunk_off[n + 1], nch = c_end - c_beg;
    auto chunk_of = [&](int64_t it) { return BWD ? c_end - 1 - it : c_beg + it; };
    /* the chunk tables are read one step ahead of use (chunk it + NB at the start of step it),
     * so no step waits on them */
    auto chunk_at = [&](int64_t it) {
        ChunkAt a{0, 0};
        if (it < nch) {
            const int64_t ch = chunk_of(it);
            a.t0 = chunk_t0[ch];
            a.L = chunk_len[ch];
        }
        return a;
    };

    /* A1, A2 and lambda of chunk it (at ca) into buffer it % NB, as one commit group (empty past
     * the last chunk, so that group counting stays uniform) */
    auto fetch = [&](int64_t it, ChunkAt ca) {
        if (it < nch) {
            const int b = (int)(it % NB);
            tiles_async<BT>(A1b + b * BT * LD1, LD1, A1, A2b + b * BT * LD2, LD2, A2, ca.t0, ca.L,
                            HV, hv, K, tw);
            const float *gl = G + ((ca.t0 + ca.L - 1) * HV + hv) * (int64_t)K;
            for (int idx = threadIdx.x; idx < K / 4; idx += SM_THREADS)
                kdamma::cp_async16(Gb + b * K + 4 * idx, gl + 4 * idx, true);
        }
        kdamma::cp_async_commit();
    };
    /* The forward with bf16 operands stages X0 (U) of chunk it in Xs by cp.async: each thread
     * later reads its X0 elements from Xs and writes its X elements to the same places, so the two
     * need no barrier between them. Its own commit group, issued before the operands of chunk
     * it + 1 (group order: ..., X0 of it, operands of it + 1). Thread tid copies the 16-byte
     * pieces of column 8 (tid % (VT / 8)), rows tid / (VT / 8) + k SM_THREADS / (VT / 8). */
    constexpr int PR = VT / 8, RS = SM_THREADS / PR; /* pieces per row, rows per pass */
    const int pc = 8 * ((int)threadIdx.x % PR), pr = (int)threadIdx.x / PR;
    const bool xasync = !BWD && B16 && X0 && V % 8 == 0;
    auto fetch_x0 = [&](int64_t it, ChunkAt ca) {
        if (it < nch) {
            const bool col = pc < nv;
            const TX *src = X0 + (ca.t0 + pr) * rv + hv * V + v0 + pc;
            for (int r = pr; r < BT; r += RS, src += RS * rv) {
                const bool ok = col && r < ca.L;
                kdamma::cp_async16(Xs + r * LDX + pc, ok ? src : X0, ok);
            }
        }
        kdamma::cp_async_commit();
    };
    /* Sst (h, dHn) from Ss and the forward's E from Xs as 16-byte row pieces, where the block's
     * tile is full and the storage is bf16: Ss and Xs hold exactly the bf16 values a fragment-wise
     * store would write (the backward's Xo, dE_tot, is f32) */
    const bool scoal = B16 && nv == VT && V % 8 == 0, xcoal = scoal && !BWD;
    /* a raw 16-byte copy of rows [0, rows) (row r at src + r (VT + 8) and dst + r ld): used only
     * where dst has the staged type TS */
    auto copy_out = [&](TS *dst, const TS *src, int rows, int64_t ld) {
        dst += pr * ld + pc;
        src += pr * LDX + pc;
        for (int r = pr; r < rows; r += RS, dst += RS * ld, src += RS * LDX)
            *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
    };

    ChunkAt ca = chunk_at(0), ca1 = NB > 1 ? chunk_at(1) : ChunkAt{0, 0};
    if (xasync) /* X0 of chunk 0 joins its operands' group */
        fetch_x0(0, ca);
    fetch(0, ca);
    if (NB > 1)
        fetch(1, ca1);

    /* X tiles of this warp: rows 16 (w / 2) + g (+ 8), columns 8 (NXT (w % 2) + jj) + 2t (+ 1) */
    const int xm = w >> 1;
    const bool xwarp = xm < BT / 16;
    const int xr = 16 * xm + g, xc = 8 * NXT * (w & 1) + 2 * t;

    for (int64_t it = 0; it < nch; it++) {
        const int64_t ch = chunk_of(it), t0 = ca.t0;
        const int L = ca.L, b = (int)(it % NB);
        const ChunkAt cn = chunk_at(it + NB); /* used by this step's fetch, at its end */
        const TA *const A1s = A1b + b * BT * LD1, *const A2s = A2b + b * BT * LD2;
        const float *const Gs = Gb + b * K;

        /* S (the state at this chunk's start) -> Ss for the A1 S product, and -> Sst */
        store_S(Ss, LDS, false);
        if (Sst && !scoal)
            store_S(Sst + (ch * HV + hv) * KV + v0, V, true);

        /* X0 of this warp's X tiles (from global here; from Xs below where it was staged) */
        float X[NXT][4] = {};
        if (!xasync && X0 && xwarp) {
            const TX *x0 = X0 + (t0 + xr) * rv + hv * V + v0 + xc; /* rows xr, xr + 8 */
#pragma unroll
            for (int hlf = 0; hlf < 2; hlf++, x0 += 8 * rv)
#pragma unroll
                for (int jj = 0; jj < NXT; jj++)
                    if (xr + 8 * hlf < L && xc + 8 * jj < nv) {
                        const float2 x = kda_ld2(x0 + 8 * jj);
                        X[jj][2 * hlf] = x.x;
                        X[jj][2 * hlf + 1] = x.y;
                    }
        }

        kdamma::cp_async_wait<NB - 1>(); /* this chunk's operands (and X0) */
        __syncthreads();                 /* ... visible to all; Ss complete */

        /* X = X0 + sgnA A1 S */
        float acc[NXT][4] = {};
        if (B16 && xwarp) { /* A1 row-major (ldmatrix), S k-major (ldmatrix.trans) */
            const TA *pa = A1s + (16 * xm + mr + 8 * (mat & 1)) * LD1 + 8 * (mat >> 1);
            const TS *pb = Ss + (mr + 8 * (mat & 1)) * LDS + 8 * NXT * (w & 1) + 8 * (mat >> 1);
            for (int k0 = 0; k0 < K; k0 += 16) {
                unsigned a[4];
                kdamma::ldsm_x4(a, pa + k0);
                if (NXT == 1) {
                    unsigned b[2];
                    kdamma::ldsm_x2_t(b, pb + k0 * LDS);
                    kdamma::mma_bf16(acc[0], a, b[0], b[1]);
                }
#pragma unroll
                for (int jp = 0; jp < NXT / 2; jp++) {
                    unsigned b[4];
                    kdamma::ldsm_x4_t(b, pb + k0 * LDS + 16 * jp);
                    kdamma::mma_bf16(acc[2 * jp], a, b[0], b[1]);
                    kdamma::mma_bf16(acc[2 * jp + 1], a, b[2], b[3]);
                }
            }
        } else if (xwarp) {
            const TA *a_row0 = A1s + (16 * xm + g) * LD1 + t, *a_row1 = a_row0 + 8 * LD1;
            for (int k0 = 0; k0 < K; k0 += 8) {
                const unsigned a[4] = {kdamma::tf32(a_row0[k0]), kdamma::tf32(a_row1[k0]),
                                       kdamma::tf32(a_row0[k0 + 4]), kdamma::tf32(a_row1[k0 + 4])};
#pragma unroll
                for (int jj = 0; jj < NXT; jj++) {
                    const int c = 8 * (NXT * (w & 1) + jj) + g;
                    kdamma::mma_tf32(acc[jj], a, staged_bits(Ss[(k0 + t) * LDS + c]),
                                     staged_bits(Ss[(k0 + t + 4) * LDS + c]));
                }
            }
        }
        if (!XOWN)
            __syncthreads();   /* every read of Ss is done: Xs reuses its space */
        if (xasync && xwarp) { /* read after the product: fewer registers live across it */
#pragma unroll
            for (int jj = 0; jj < NXT; jj++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++) {
                    const float2 x = kda_ld2(Xs + (xr + 8 * hlf) * LDX + xc + 8 * jj);
                    X[jj][2 * hlf] = x.x;
                    X[jj][2 * hlf + 1] = x.y;
                }
        }
        if (xwarp) {
            /* X (rows past L zero) -> Xs, rounded to the operand type (TF32 or bf16) for A2^T X;
             * Xo gets it as is */
#pragma unroll
            for (int jj = 0; jj < NXT; jj++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float x = BWD || PLUS ? X[jj][e] + acc[jj][e] : X[jj][e] - acc[jj][e];
                    X[jj][e] = xr + 8 * (e >> 1) < L ? x : 0.f;
                }
#pragma unroll
            for (int jj = 0; jj < NXT; jj++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++) {
                    TS *xs = Xs + (xr + 8 * hlf) * LDX + xc + 8 * jj;
                    if (B16)
                        kda_st2(xs, X[jj][2 * hlf], X[jj][2 * hlf + 1]);
                    else
                        kda_st2(xs, tf32r(X[jj][2 * hlf]), tf32r(X[jj][2 * hlf + 1]));
                }
            if (Xo && !xcoal) {
                TX *xo = Xo + (t0 + xr) * rv + hv * V + v0 + xc; /* rows xr, xr + 8 */
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++, xo += 8 * rv)
#pragma unroll
                    for (int jj = 0; jj < NXT; jj++)
                        if (xr + 8 * hlf < L && xc + 8 * jj < nv)
                            kda_st2(xo + 8 * jj, X[jj][2 * hlf], X[jj][2 * hlf + 1]);
            }
        }
        /* Sup_c for this thread's elements of S (rows 16 (w + 8 m) + g (+ 8), columns 8 j + 2 t),
         * loaded before the barrier below (so that the update after it does not wait for them)
         * where registers allow (MT == 1) and it measured faster: f32, and bf16 at VT < 64. With
         * bf16 at VT = 64 the early loads cost more than they hid (ncu, H100, (1,8192,96,128):
         * 1120-1170 us in two forms against 998 us loaded after it); at VT = 32 loading late
         * spills. */
        constexpr bool SUP_EARLY = MT == 1 && (!B16 || VT < 64);
        float2 sp[MT][NJ][2];
        auto load_sup = [&]() {
            const TA *sup = Sup + (ch * HV + hv) * KV + v0 + (16 * w + g) * (int64_t)V + 2 * t;
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int hlf = 0; hlf < 2; hlf++)
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        const bool ok = w + 8 * m < mtiles && 8 * j + 2 * t < nv;
                        sp[m][j][hlf] = ok ? kda_ld2(sup + (128 * m + 8 * hlf) * (int64_t)V + 8 * j)
                                           : make_float2(0.f, 0.f);
                    }
        };
        if ((BWD || PLUS) && Sup && SUP_EARLY)
            load_sup();
        /* exp(lambda) for this thread's rows of S, read before the buffer is refilled */
        float el[MT][2];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int hlf = 0; hlf < 2; hlf++) {
                const int r = 16 * (w + 8 * m) + g + 8 * hlf;
                el[m][hlf] = (w + 8 * m < mtiles) ? kdamma::exp_ftz(Gs[r]) : 0.f;
            }
        __syncthreads(); /* Xs complete */
        if (Sst && scoal)
            copy_out(Sst + (ch * HV + hv) * KV + v0, Ss, K, V);
        if (Xo && xcoal)
            copy_out(reinterpret_cast<TS *>(Xo) + t0 * rv + hv * V + v0, Xs, L, rv);

        /* S = exp(lambda) S + Sup_c */
        if ((BWD || PLUS) && Sup) { /* (KDA's forward passes none) */
            if (!SUP_EARLY)
                load_sup();
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int hlf = 0; hlf < 2; hlf++) {
                        S[m][j][2 * hlf] = el[m][hlf] * S[m][j][2 * hlf] + sp[m][j][hlf].x;
                        S[m][j][2 * hlf + 1] = el[m][hlf] * S[m][j][2 * hlf + 1] + sp[m][j][hlf].y;
                    }
        } else {
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        S[m][j][e] *= el[m][e >> 1];
        }

        /* S += sgnB A2^T X: A(m = key row, k = token i) = A2s[i][m] */
        const int ksteps = B16 ? 0 : (L + 7) / 8;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if (!B16 || w + 8 * m >= mtiles)
                continue;
            /* both operands token-major: ldmatrix.trans; rows past L are zero in A2s and Xs */
            const TA *pa = A2s + (mr + 8 * (mat >> 1)) * LD2 + 16 * (w + 8 * m) + 8 * (mat & 1);
            const TS *pb = Xs + (mr + 8 * (mat & 1)) * LDX + 8 * (mat >> 1);
            for (int i0 = 0; i0 < L; i0 += 16) {
                unsigned a[4];
                kdamma::ldsm_x4_t(a, pa + i0 * LD2);
                if (BWD && !PLUS) { /* the sign bits of both halves: exact */
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        a[e] ^= 0x80008000u;
                }
#pragma unroll
                for (int jp = 0; jp < NJ / 2; jp++) {
                    unsigned b[4];
                    kdamma::ldsm_x4_t(b, pb + i0 * LDX + 16 * jp);
                    kdamma::mma_bf16(S[m][2 * jp], a, b[0], b[1]);
                    kdamma::mma_bf16(S[m][2 * jp + 1], a, b[2], b[3]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if (B16 || w + 8 * m >= mtiles)
                continue;
            const int m0 = 16 * (w + 8 * m);
            for (int ks = 0; ks < ksteps; ks++) {
                const int i0 = 8 * ks;
                const TA *p0 = A2s + (i0 + t) * LD2 + m0 + g, *p1 = p0 + 4 * LD2;
                unsigned a[4];
                if (BWD && !PLUS) { /* the sign bit: -x is exact in either storage */
                    a[0] = kdamma::tf32(p0[0]) ^ 0x80000000u;
                    a[1] = kdamma::tf32(p0[8]) ^ 0x80000000u;
                    a[2] = kdamma::tf32(p1[0]) ^ 0x80000000u;
                    a[3] = kdamma::tf32(p1[8]) ^ 0x80000000u;
                } else {
                    a[0] = kdamma::tf32(p0[0]);
                    a[1] = kdamma::tf32(p0[8]);
                    a[2] = kdamma::tf32(p1[0]);
                    a[3] = kdamma::tf32(p1[8]);
                }
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const int c = 8 * j + g;
                    kdamma::mma_tf32(S[m][j], a, staged_bits(Xs[(i0 + t) * LDX + c]),
                                     staged_bits(Xs[(i0 + t + 4) * LDX + c]));
                }
            }
        }
        __syncthreads(); /* buffer b, Ss and Xs free */
        if (xasync)
            fetch_x0(it + 1, NB > 1 ? ca1 : cn);
        fetch(it + NB, cn);
        if (NB > 1) {
            ca = ca1;
            ca1 = cn;
        } else {
            ca = cn;
        }
    }
    kdamma::cp_async_wait<0>();

    if (Sfin)
        store_S(Sfin + ((int64_t)n * HV + hv) * KV + v0, V, true);
}

// ---- backward kernels

/* The serial pass of the backward (f32): grid (N, HV, ceil(V/32)); thread (lane = value column,
 * warp w) owns the dH rows w, w+8, ...; KG and W come in 32-column slices. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    state_seq_kernel(Dims d, const float *W, const float *KG, const float *G, const float *dh,
                     const float *dE, const float *dht, float *dEtot, float *dHs, float *dh0) {
    constexpr int RPT = BT / NW;
    extern __shared__ float sm[];
    float *sdH = sm; /* [K][CT] */
    float(*sE)[CT] = (float(*)[CT])(sm + (size_t)d.K * CT);
    float(*sX)[CT] = sE + BT;
    const int n = blockIdx.x, hv = blockIdx.y;
    const int HV = d.HV, K = d.K, V = d.V;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int v = blockIdx.z * CT + lane;
    const bool vok = v < V;
    const int64_t sb = ((int64_t)n * HV + hv) * K * V;
    for (int a = w; a < K; a += NW)
        sdH[a * CT + lane] = (dht && vok) ? dht[sb + (int64_t)a * V + v] : 0.f;
    const int64_t cb = d.chunk_off[n], ce = d.chunk_off[n + 1];
    for (int64_t c = ce - 1; c >= cb; c--) {
        const int64_t t0 = d.chunk_t0[c];
        const int L = d.chunk_len[c];
        const int64_t hb = (c * HV + hv) * K * V;
        if (dHs && vok) /* own rows: written by this thread in the previous update */
            for (int a = w; a < K; a += NW)
                dHs[hb + (int64_t)a * V + v] = sdH[a * CT + lane];
        /* dE_tot[i][v] = dE[i][v] + sum_a KG[i][a] dH[a][v], rows i = w + 8p */
        float acc[RPT];
#pragma unroll
        for (int p = 0; p < RPT; p++) {
            const int i = w + NW * p;
            acc[p] = (dE && i < L && vok) ? dE[((t0 + i) * HV + hv) * V + v] : 0.f;
        }
        for (int a0 = 0; a0 < K; a0 += CT) {
            __syncthreads(); /* sX free; the last dH update is visible */
            for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
                const int row = idx / CT, col = idx % CT, a = a0 + col;
                sX[row][col] = (row < L && a < K) ? KG[((t0 + row) * HV + hv) * K + a] : 0.f;
            }
            __syncthreads();
            const int na = min(CT, K - a0);
            for (int col = 0; col < na; col++) {
                const float hval = sdH[(a0 + col) * CT + lane];
#pragma unroll
                for (int p = 0; p < RPT; p++)
                    acc[p] += sX[w + NW * p][col] * hval;
            }
        }
#pragma unroll
        for (int p = 0; p < RPT; p++) {
            const int i = w + NW * p;
            sE[i][lane] = i < L ? acc[p] : 0.f;
            if (dEtot && i < L && vok)
                dEtot[((t0 + i) * HV + hv) * V + v] = acc[p];
        }
        /* dH[a][v] = exp(lambda_a) dH[a][v] - sum_i W[i][a] dE_tot[i][v] + dh_c[a][v] */
        const float *lam = G + ((t0 + L - 1) * HV + hv) * K;
        for (int a0 = 0; a0 < K; a0 += CT) {
            __syncthreads(); /* sE complete; sX free */
            for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
                const int row = idx / CT, col = idx % CT, a = a0 + col;
                sX[row][col] = (row < L && a < K) ? W[((t0 + row) * HV + hv) * K + a] : 0.f;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < CT / NW; r++) {
                const int aa = w + NW * r, a = a0 + aa; /* a = w mod 8: this thread's rows */
                if (a >= K)
                    continue;
                float s = 0.f;
                for (int i = 0; i < L; i++)
                    s += sX[i][aa] * sE[i][lane];
                const float up = (dh && vok) ? dh[hb + (int64_t)a * V + v] : 0.f;
                sdH[a * CT + lane] = expf(lam[a]) * sdH[a * CT + lane] - s + up;
            }
        }
    }
    if (dh0 && vok)
        for (int a = w; a < K; a += NW)
            dh0[sb + (int64_t)a * V + v] = sdH[a * CT + lane];
}

/* grid (NC, HV, ceil(K/32)): lane = key dim e, warp w = rows w, w+8, ... For rows i < L:
 *   out1[i][e] = a1 sum_v A1[i][v] S1_c[e][v],   out2[i][e] = a2 sum_v A2[i][v] S2_c[e][v],
 *   dG[i][e] = i == L-1 ? exp(lambda_e) sum_v S2_c[e][v] S1_c[e][v] : 0.
 * A*: [TT,HV,V]; S*: [NC,HV,K,V]. A NULL A or S counts as zero. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    rows_stateT_kernel(Dims d, const float *A1, const float *S1, float a1, float *out1,
                       const float *A2, const float *S2, float a2, float *out2, const float *G,
                       float *dG) {
    constexpr int RPT = BT / NW;
    __shared__ float sA1[BT][CT], sA2[BT][CT];
    __shared__ float sS1[CT][CT + 1], sS2[CT][CT + 1];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, e0 = blockIdx.z * CT;
    const int HV = d.HV, K = d.K, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = e0 + lane;
    const int64_t sb = (c * HV + hv) * K * V;
    float acc1[RPT], acc2[RPT], accl = 0.f;
#pragma unroll
    for (int p = 0; p < RPT; p++)
        acc1[p] = acc2[p] = 0.f;
    for (int v0 = 0; v0 < V; v0 += CT) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
            const int row = idx / CT, col = idx % CT;
            const bool ok = row < L && v0 + col < V;
            const int64_t ia = ((t0 + row) * HV + hv) * V + v0 + col;
            sA1[row][col] = (A1 && ok) ? A1[ia] : 0.f;
            sA2[row][col] = (A2 && ok) ? A2[ia] : 0.f;
        }
        for (int idx = threadIdx.x; idx < CT * CT; idx += NTH) {
            const int r = idx / CT, col = idx % CT;
            const bool ok = e0 + r < K && v0 + col < V;
            const int64_t is = sb + (int64_t)(e0 + r) * V + v0 + col;
            sS1[r][col] = (S1 && ok) ? S1[is] : 0.f;
            sS2[r][col] = (S2 && ok) ? S2[is] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int cc = 0; cc < CT; cc++) {
            const float s1 = sS1[lane][cc], s2 = sS2[lane][cc];
#pragma unroll
            for (int p = 0; p < RPT; p++) {
                acc1[p] += sA1[w + NW * p][cc] * s1;
                acc2[p] += sA2[w + NW * p][cc] * s2;
            }
            accl += s2 * s1;
        }
    }
    if (e >= K)
        return;
    const float lt = dG ? expf(G[((t0 + L - 1) * HV + hv) * K + e]) * accl : 0.f;
#pragma unroll
    for (int p = 0; p < RPT; p++) {
        const int i = w + NW * p;
        if (i >= L)
            continue;
        const int64_t idx = ((t0 + i) * HV + hv) * K + e;
        if (out1)
            out1[idx] = a1 * acc1[p];
        if (out2)
            out2[idx] = a2 * acc2[p];
        if (dG)
            dG[idx] = i == L - 1 ? lt : 0.f;
    }
}

/* The same product on mma.sync with a cp.async pipeline (mma.cuh): grid (chunk x K / 64, hv)
 * (chunk_tile), dQG[i][e0 + e] = s sum_v dO[i][v] h_c[e0 + e][v], with dO of TA and h of TS
 * (f32 or bf16). TF32 (P = 1) only; needs V % 4 == 0 (% 8 with a bf16 operand), K even and
 * 16-byte aligned arrays (rows_stateT_tc_launch checks). Four blocks per SM (64 registers; ncu,
 * H100, (1,8192,96,128), f32 dO: 567 -> 542 us). */
template <int BT, class TA, class TS>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 4)
    rows_stateT_mma_kernel(const int64_t *__restrict__ chunk_t0,
                           const int32_t *__restrict__ chunk_len, int HV, int K, int V, float scale,
                           const TA *__restrict__ dO, const TS *__restrict__ h,
                           float *__restrict__ dQG) {
    __shared__ __align__(16) float sm[kdamma::gemm_smem<BT, true, true, TA, TS>()];
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(K, kdamma::AB_N)); /* the tiles share dO */
    const int64_t ch = ct.c;
    const int hv = blockIdx.y, e0 = ct.z * kdamma::AB_N;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch], ne = min(kdamma::AB_N, K - e0);
    float acc[kdamma::AbTile<BT>::NTW][4] = {};
    kdamma::gemm_acc<BT, true, true>(acc, dO + (t0 * HV + hv) * V, (int64_t)HV * V, L,
                                     h + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V, V, ne,
                                     ne, V, sm);
    kdamma::store_acc<BT>(acc, dQG + (t0 * HV + hv) * K + e0, (int64_t)HV * K, L, ne, scale);
}

/* The chunk-parallel part of the tensor-core backward in one pass over V, grid (chunk x ceil(K /
 * 64), hv) (chunk_tile): for the 64 keys e0.. of the block and the rows i < L of the chunk,
 *   dKG[i][e] = sum_v E[i][v] dHn_c[e][v],   dW[i][e] = -sum_v dE_tot[i][v] h_c[e][v],
 *   dG[L-1][e] = exp(lambda_e) sum_v h_c[e][v] dHn_c[e][v], dG[i][e] = 0 for i < L - 1.
 * E, dHn, h of M (f32 or bf16), dE_tot f32. The four operands' 32-value slices come in with a
 * two-stage cp.async pipeline; both products run on mma_stage exactly as rows_stateT_mma_kernel
 * runs each of them (the same bits), and dG's sums are taken from the staged dHn and h slices, so
 * h and dHn are read once instead of twice (thread: key tid / 4, values 8 (tid % 4).. of each
 * slice; the pipeline is gemm_acc's, kdamma::pipeline2). Needs V % 8 == 0 (bf16; % 4 for f32), K
 * even and 16-byte aligned E, dHn, dE_tot, h, dKG, dW (state_rows_tc checks). Dynamic shared
 * memory: two stages of E, dE_tot [BT][ab_ld] and dHn, h [64][ab_ld] (48 KB for bf16 at BT = 64, 72
 * KB for f32). */
template <int BT, class M>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 3)
    state_rows_mma_kernel(const int64_t *__restrict__ chunk_t0,
                          const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                          const float *__restrict__ G, const M *__restrict__ E,
                          const M *__restrict__ dHs, const float *__restrict__ dEt,
                          const M *__restrict__ h, float *__restrict__ dKG, float *__restrict__ dW,
                          float *__restrict__ dG) {
    using namespace kdamma;
    constexpr int LA1 = ab_ld<M>(), LA2 = ab_ld<float>(), LB = ab_ld<M>();
    constexpr int SA1 = BT * LA1, SA2 = BT * LA2, SB = AB_N * LB; /* elements per stage */
    extern __shared__ __align__(16) float rows_smem[];
    float *const a2s = rows_smem; /* dE_tot, then E, dHn, h (stage b at + b * S..) */
    M *const a1s = reinterpret_cast<M *>(a2s + 2 * SA2);
    M *const b1s = a1s + 2 * SA1;
    M *const b2s = b1s + 2 * SB;
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(K, AB_N)); /* the tiles share E, dE_tot */
    const int64_t ch = ct.c;
    const int hv = blockIdx.y, e0 = ct.z * AB_N;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch], ne = min(AB_N, K - e0);
    const int64_t rs = (int64_t)HV * V, sb = (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V;
    const M *const Ea = E + (t0 * HV + hv) * V, *const S1 = dHs + sb, *const S2 = h + sb;
    const float *const Da = dEt + (t0 * HV + hv) * V;
    auto load = [&](int st, int b) {
        const int k0 = st * AB_KS;
        tile_async<BT, AB_KS, LA1, AB_THREADS>(a1s + b * SA1, Ea, rs, L, k0, V);
        tile_async<BT, AB_KS, LA2, AB_THREADS>(a2s + b * SA2, Da, rs, L, k0, V);
        tile_async<AB_N, AB_KS, LB, AB_THREADS>(b1s + b * SB, S1, V, ne, k0, V);
        tile_async<AB_N, AB_KS, LB, AB_THREADS>(b2s + b * SB, S2, V, ne, k0, V);
    };
    static_assert(AB_THREADS == 4 * AB_N && AB_KS == 32, "dG: four threads per key, 8 values each");
    const int ke = threadIdx.x >> 2, kq = threadIdx.x & 3;
    float acc1[AbTile<BT>::NTW][4] = {}, acc2[AbTile<BT>::NTW][4] = {}, gs = 0.f;
    pipeline2(DG_CEIL_DIV(V, AB_KS), load, [&](int, int b) {
        mma_stage<BT, true, true, 0, AB_KS>(acc1, a1s + b * SA1, LA1, b1s + b * SB, LB, 0);
        mma_stage<BT, true, true, 0, AB_KS>(acc2, a2s + b * SA2, LA2, b2s + b * SB, LB, 0);
        /* 16-byte reads of the two slices (values past V are zero in both) */
        constexpr int PE = 16 / sizeof(M);
        const M *p1 = b1s + b * SB + ke * LB + 8 * kq, *p2 = b2s + b * SB + ke * LB + 8 * kq;
#pragma unroll
        for (int pc = 0; pc < 8; pc += PE) {
            float x1[PE], x2[PE];
            kda_ld16(p1 + pc, x1);
            kda_ld16(p2 + pc, x2);
#pragma unroll
            for (int u = 0; u < PE; u++)
                gs += x2[u] * x1[u];
        }
    });
    gs += __shfl_xor_sync(0xffffffffu, gs, 1);
    gs += __shfl_xor_sync(0xffffffffu, gs, 2);
    const int64_t rk = (int64_t)HV * K, o = (t0 * HV + hv) * K + e0;
    store_acc<BT>(acc1, dKG + o, rk, L, ne, 1.f);
    store_acc<BT>(acc2, dW + o, rk, L, ne, -1.f);
    for (int idx = threadIdx.x; idx < (L - 1) * ne; idx += AB_THREADS)
        dG[o + (idx / ne) * rk + idx % ne] = 0.f;
    if (kq == 0 && ke < ne) {
        const int64_t rl = o + (int64_t)(L - 1) * rk + ke;
        dG[rl] = expf(G[rl]) * gs;
    }
}

/* grid (chunk, hv): dG rows of the chunk: row L-1 = exp(lambda_e) sum_v h_c[e][v] dHn_c[e][v]
 * (0 when h is NULL; h and dHn of M, f32 or bf16), every other row 0. Warp w: keys e = w, w + 8,
 * ...; lanes over v (vec: four consecutive v per lane and 16-byte zero stores, where V and K are
 * multiples of 4 and the arrays 16-byte aligned; the sum's order then differs, not its terms). */
template <class M>
__global__ void __launch_bounds__(SM_THREADS)
    state_dg_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                       int HV, int K, int V, bool vec, const float *__restrict__ G,
                       const M *__restrict__ h, const M *__restrict__ dHs, float *__restrict__ dG) {
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (vec) {
        const int K4 = K / 4;
        for (int idx = threadIdx.x; idx < (L - 1) * K4; idx += SM_THREADS)
            *reinterpret_cast<float4 *>(dG + ((t0 + idx / K4) * HV + hv) * K + 4 * (idx % K4)) =
                make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
        for (int idx = threadIdx.x; idx < (L - 1) * K; idx += SM_THREADS)
            dG[((t0 + idx / K) * HV + hv) * K + idx % K] = 0.f;
    }
    const int64_t sb = (ch * HV + hv) * (int64_t)K * V, rl = ((t0 + L - 1) * HV + hv) * K;
    for (int e = w; e < K; e += 8) {
        float s = 0.f;
        const M *hr = h ? h + sb + (int64_t)e * V : nullptr, *dr = dHs + sb + (int64_t)e * V;
        if (h && vec) {
            for (int v = 4 * lane; v < V; v += 128) {
                const float4 a = kda_ld4(hr + v), b = kda_ld4(dr + v);
                s += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        } else if (h) {
            for (int v = lane; v < V; v += 32)
                s += kda_ld(hr + v) * kda_ld(dr + v);
        }
        s = kdab::warp_sum(s);
        if (lane == 0)
            dG[rl + e] = h ? expf(G[rl + e]) * s : 0.f;
    }
}

// ---- launchers: forward

/* The sizes and alignments the kernel needs (else the caller takes the FFMA kernels). */
static int state_mma_fits(const kda_cuda_dims *d, const void *A1, const void *X0, const void *A2,
                          const float *G, const float *S0, const void *Sup, const void *Sst,
                          const void *Xo, const float *Sfin) {
    if (d->tc != 1 || d->K % 16 != 0 || d->K > 256 || d->V % 2 != 0)
        return 0;
    const void *ps[] = {A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin};
    for (const void *p : ps)
        if (p && !aligned16(p))
            return 0;
    return 1;
}

template <int BT, class TA> static size_t state_mma_smem(int K, int VT) {
    constexpr int NB = state_nbuf<TA>();
    const size_t s_rows = NB > 1 ? (size_t)K + BT : (size_t)(K > BT ? K : BT); /* Ss (+ Xs) */
    return sizeof(TA) * (NB * (size_t)BT * (state_ld1<TA>(K) + K + 8) + s_rows * (VT + 8)) +
           sizeof(float) * NB * K;
}

/* Shared memory of one variant, with the dynamic limit raised (once per device and size) when it
 * needs more than the default 48 KB. */
template <int BT, int MT, int VT, bool BWD, class TA, bool PLUS>
static dg_status state_mma_prepare(int K, size_t *smem) {
    *smem = state_mma_smem<BT, TA>(K, VT);
    return dg__smem_opt_in((const void *)state_mma_kernel<BT, MT, VT, BWD, TA, PLUS>, *smem);
}

/* Waves of resident blocks the grid of a variant needs on device dev (sms multiprocessors);
 * the occupancy query runs once per K and device. */
template <int BT, int MT, int VT, bool BWD, class TA, bool PLUS>
static dg_status state_mma_waves(const kda_cuda_dims *d, int dev, int sms, int64_t *waves) {
    static int cached_K = -1, cached_dev = -1, cached_per_sm = 0;
    if (cached_K != d->K || cached_dev != dev) {
        size_t smem;
        DG_TRY((state_mma_prepare<BT, MT, VT, BWD, TA, PLUS>(d->K, &smem)));
        DG_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &cached_per_sm, state_mma_kernel<BT, MT, VT, BWD, TA, PLUS>, SM_THREADS, smem));
        cached_K = d->K;
        cached_dev = dev;
    }
    const int64_t blocks = (int64_t)d->N * d->HV * DG_CEIL_DIV(d->V, VT);
    *waves = cached_per_sm > 0 ? DG_CEIL_DIV(blocks, (int64_t)cached_per_sm * sms) : INT64_MAX;
    return DG_OK;
}

/* The operand pack of one serial pass (see state_mma): A1, A2, Sst of TA; X0, Xo of TX (the
 * forward: TA; the backward: f32). PLUS: both products added (DPLR's signs, see
 * kda_state_plus), else KDA's signs. */
template <class TA, class TX, bool PLUS = false> struct StateOps {
    const TA *A1;
    const TX *X0;
    const TA *A2;
    const float *G, *S0;
    const TA *Sup;
    TA *Sst;
    TX *Xo;
    float *Sfin;
};

template <int BT, int MT, int VT, bool BWD, class TA, class TX, bool PLUS>
static dg_status state_mma_launch_vt(dg_ctx *ctx, const kda_cuda_dims *d,
                                     const StateOps<TA, TX, PLUS> &o) {
    size_t smem;
    DG_TRY((state_mma_prepare<BT, MT, VT, BWD, TA, PLUS>(d->K, &smem)));
    dim3 grid((unsigned)d->N, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, VT));
    state_mma_kernel<BT, MT, VT, BWD, TA, PLUS><<<grid, SM_THREADS, smem, dg__stream(ctx)>>>(
        d->chunk_off, d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, o.A1, o.X0, o.A2, o.G, o.S0,
        o.Sup, o.Sst, o.Xo, o.Sfin);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

template <int BT, int MT, bool BWD, class TA, class TX, bool PLUS>
static dg_status state_mma_launch_t(dg_ctx *ctx, const kda_cuda_dims *d,
                                    const StateOps<TA, TX, PLUS> &o) {
    /* Fewest waves first (each block walks every chunk of its sequence, so a second wave doubles
     * the time); among equal waves 32 columns, then 64, then 16 (measured on an H200: with one
     * wave either way, 16-column tiles lose ~2% to the doubled W/KG traffic; 64-column tiles pay
     * when they save a wave: -3% to -6% fwd+bwd at (4,4096,64,128) and (8,2048,32,256)). */
    int dev = 0, sms = 0;
    DG_CHECK_CUDA(cudaGetDevice(&dev));
    DG_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int64_t w16 = INT64_MAX, w32 = INT64_MAX, w64 = INT64_MAX;
    DG_TRY((state_mma_waves<BT, MT, 16, BWD, TA, PLUS>(d, dev, sms, &w16)));
    DG_TRY((state_mma_waves<BT, MT, 32, BWD, TA, PLUS>(d, dev, sms, &w32)));
    DG_TRY((state_mma_waves<BT, MT, 64, BWD, TA, PLUS>(d, dev, sms, &w64)));
    if (w64 < w32 && w64 <= w16)
        return state_mma_launch_vt<BT, MT, 64, BWD>(ctx, d, o);
    if (w16 < w32 && w16 < w64)
        return state_mma_launch_vt<BT, MT, 16, BWD>(ctx, d, o);
    return state_mma_launch_vt<BT, MT, 32, BWD>(ctx, d, o);
}

/* The serial pass on state_mma_kernel, forward (BWD false: A1 = W, X0 = U, A2 = KG, S0 = h0,
 * Sst = h, Xo = E, Sfin = ht; TX = TA) or backward (BWD true: A1 = KG, X0 = dE, A2 = W, S0 = dht,
 * Sup = dh and Sst = dHn (of TA, like h), Xo = dE_tot, Sfin = dh0; TX = float). Sup is read by
 * the backward only, and by the PLUS forward (kda_state_plus: X = X0 + A1 S,
 * S = exp(lambda) S + Sup_c + A2^T X, DPLR's signs). */
template <bool BWD, class TA, class TX, bool PLUS>
static dg_status state_mma(dg_ctx *ctx, const kda_cuda_dims *d, const StateOps<TA, TX, PLUS> &o) {
    static_assert(std::is_same<TX, typename std::conditional<BWD, float, TA>::type>::value,
                  "the forward's X0, Xo share A1's storage; the backward's are f32");
    if (!state_mma_fits(d, o.A1, o.X0, o.A2, o.G, o.S0, o.Sup, o.Sst, o.Xo, o.Sfin))
        return dg__err(DG_ERR_ARG, "%s: sizes or alignment not supported (K=%d V=%d tc=%d)",
                       __func__, d->K, d->V, d->tc);
    const bool two = d->K > 128;
    KDA_DISPATCH_BT(d->BT, {
        return two ? state_mma_launch_t<BT_, 2, BWD>(ctx, d, o)
                   : state_mma_launch_t<BT_, 1, BWD>(ctx, d, o);
    });
    return DG_OK;
}

int kda_state_plus_fits(const kda_cuda_dims *d, const float *A1, const float *X0, const float *A2,
                        const float *G, const float *S0, const float *Sup, const float *Sst,
                        const float *Xo, const float *Sfin) {
    kda_cuda_dims t = *d;
    t.tc = 1;
    return state_mma_fits(&t, A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin);
}

dg_status kda_state_plus(dg_ctx *ctx, const kda_cuda_dims *d, bool bwd, const float *A1,
                         const float *X0, const float *A2, const float *G, const float *S0,
                         const float *Sup, float *Sst, float *Xo, float *Sfin) {
    kda_cuda_dims t = *d;
    t.tc = 1;
    t.mid = 0;
    const StateOps<float, float, true> o{A1, X0, A2, G, S0, Sup, Sst, Xo, Sfin};
    return bwd ? state_mma<true>(ctx, &t, o) : state_mma<false>(ctx, &t, o);
}

extern "C" dg_status dg__kda_state_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *Wv,
                                            const void *Uv, const void *KGv, const float *G,
                                            const float *h0, void *hv, void *Ev, float *ht) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!Wv || !Uv || !KGv || !G || !hv || !Ev)
        return dg__err(DG_ERR_ARG, "%s: W, U, KG, G, h and E are required (h0, ht optional)",
                       __func__);
    typedef kda_bf16 B16;
    if (state_mma_fits(d, Wv, Uv, KGv, G, h0, nullptr, hv, Ev, ht))
        return d->mid
                   ? state_mma<false>(ctx, d,
                                      StateOps<B16, B16>{(const B16 *)Wv, (const B16 *)Uv,
                                                         (const B16 *)KGv, G, h0, nullptr,
                                                         (B16 *)hv, (B16 *)Ev, ht})
                   : state_mma<false>(ctx, d,
                                      StateOps<float, float>{(const float *)Wv, (const float *)Uv,
                                                             (const float *)KGv, G, h0, nullptr,
                                                             (float *)hv, (float *)Ev, ht});
    if (d->mid) /* bf16 intermediates have only the mma kernel */
        return kda_mid_refused(__func__, d);
    /* f32 FFMA: tc == 0, and the sizes, alignments or the 3xTF32 mode state_mma_kernel does not
     * take */
    const float *W = (const float *)Wv, *U = (const float *)Uv, *KG = (const float *)KGv;
    float *h = (float *)hv, *E = (float *)Ev;
    const int KP = DG_CEIL_DIV(d->K, KDA_KT) * KDA_KT;
    dim3 grid((unsigned)d->N, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, KDA_VT));
    KDA_DISPATCH_BT(d->BT, {
        const size_t smem =
            sizeof(float) * ((size_t)KP * KDA_VT + 2 * (size_t)BT_ * KDA_VT + (size_t)KP);
        if (smem > 48 * 1024)
            DG_CHECK_CUDA(cudaFuncSetAttribute(
                kda_state_fwd_kernel<BT_>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kda_state_fwd_kernel<BT_><<<grid, KDA_THREADS, smem, dg__stream(ctx)>>>(
            d->chunk_off, d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, W, U, KG, G, h0, h, E, ht);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

// ---- launchers: backward

/* The serial pass of the FFMA backward (state_seq_kernel). */
template <int BT>
static dg_status state_seq_bwd_ffma(dg_ctx *ctx, const kda_cuda_dims *dd, const float *W,
                                    const float *KG, const float *G, const float *dh,
                                    const float *dE, const float *dht, float *dEtot, float *dHs,
                                    float *dh0) {
    const Dims d = make_dims(dd);
    const size_t smem = sizeof(float) * ((size_t)d.K * CT + 2 * BT * CT);
    DG_TRY(smem_opt_in(state_seq_kernel<BT>, smem));
    if (d.N > 0) {
        state_seq_kernel<BT><<<dim3(d.N, d.HV, DG_CEIL_DIV(d.V, CT)), NTH, smem, dg__stream(ctx)>>>(
            d, W, KG, G, dh, dE, dht, dEtot, dHs, dh0);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

/* C = s A S_c^T for the output backward's dQG = s dO h^T (rows_stateT's first product alone);
 * the caller has checked d (BT 16, 32 or 64) and that NC > 0. */
template <int BT>
static dg_status rows_stateT_bt(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const float *A,
                                const float *S, float *C) {
    const Dims d = make_dims(dd);
    rows_stateT_kernel<BT>
        <<<dim3((unsigned)d.NC, d.HV, DG_CEIL_DIV(d.K, CT)), NTH, 0, dg__stream(ctx)>>>(
            d, A, S, scale, C, nullptr, nullptr, 0.f, nullptr, nullptr, nullptr);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

/* The serial pass of the tensor-core backward (state_seq_kernel's part): dE_tot, the dHn_c
 * scratch [NC,HV,K,V] (of M, like h: bf16 on the mid path) and dh0, each optional. */
template <class M>
static dg_status state_seq_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const M *W, const M *KG,
                                  const float *G, const M *dh, const float *dE, const float *dht,
                                  float *dEtot, M *dHs, float *dh0) {
    if (state_mma_fits(d, KG, dE, W, G, dht, dh, dHs, dEtot, dh0))
        return state_mma<true>(ctx, d, StateOps<M, float>{KG, dE, W, G, dht, dh, dHs, dEtot, dh0});
    if constexpr (sizeof(M) == 2) { /* bf16 intermediates have only the mma kernel */
        return kda_mid_refused(__func__, d);
    } else { /* f32 FFMA: the sizes, alignments or the 3xTF32 mode it does not take */
        KDA_DISPATCH_BT(d->BT, {
            return state_seq_bwd_ffma<BT_>(ctx, d, W, KG, G, dh, dE, dht, dEtot, dHs, dh0);
        });
        return DG_OK;
    }
}

/* C = s A h^T chunk by chunk (see rows_stateT_mma_kernel), A of TA and h of TS (f32 or bf16):
 * on mma.sync when the mode is TF32 and the sizes allow it, else (f32 operands only) on the FFMA
 * rows_stateT_kernel. */
template <class TA, class TS>
static dg_status rows_stateT_tc_launch(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                       const TA *A, const TS *Hm, float *C) {
    const bool bf = sizeof(TA) == 2 || sizeof(TS) == 2;
    const bool mma = d->tc == 1 && d->V % (bf ? 8 : 4) == 0 && d->K % 2 == 0 && aligned16(A) &&
                     aligned16(Hm) && aligned16(C);
    if (bf && !mma)
        return kda_mid_refused(__func__, d);
    KDA_DISPATCH_BT(d->BT, {
        if (!mma)
            return rows_stateT_bt<BT_>(ctx, d, scale, (const float *)A, (const float *)Hm, C);
        const unsigned nkt = (unsigned)DG_CEIL_DIV(d->K, kdamma::AB_N);
        rows_stateT_mma_kernel<BT_, TA, TS>
            <<<dim3((unsigned)d->NC * nkt, (unsigned)d->HV), kdamma::AB_THREADS, 0,
               dg__stream(ctx)>>>(d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, A, Hm, C);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

/* The chunk-parallel part of the tensor-core backward, from the serial pass's dE_tot and dHn_c
 * (of M): dKG = E dHn^T, dW = -dE_tot h^T, dG at each chunk's last row (each optional). With all
 * three asked for (the node's backward) and the sizes allowing it, one pass
 * (state_rows_mma_kernel); else a kernel each. */
template <class M>
static dg_status state_rows_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *G, const M *h,
                               const M *E, const M *dHs, const float *dEtot, float *dW, float *dKG,
                               float *dG) {
    cudaStream_t s = dg__stream(ctx);
    const bool b16 = sizeof(M) == 2;
    if (dKG && E && dW && h && dG && d->tc == 1 && d->V % (b16 ? 8 : 4) == 0 && d->K % 2 == 0 &&
        aligned16(E) && aligned16(dHs) && aligned16(dEtot) && aligned16(h) && aligned16(dKG) &&
        aligned16(dW)) { /* all three in one pass */
        KDA_DISPATCH_BT(d->BT, {
            using namespace kdamma;
            const size_t smem = 2 * (sizeof(float) * BT_ * ab_ld<float>() +
                                     sizeof(M) * (BT_ * ab_ld<M>() + 2 * AB_N * ab_ld<M>()));
            DG_TRY(smem_opt_in(state_rows_mma_kernel<BT_, M>, smem));
            const unsigned nkt = (unsigned)DG_CEIL_DIV(d->K, AB_N);
            state_rows_mma_kernel<BT_, M>
                <<<dim3((unsigned)d->NC * nkt, (unsigned)d->HV), AB_THREADS, smem, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, G, E, dHs, dEtot, h, dKG, dW, dG);
            DG_CHECK_LAUNCH();
        });
        return DG_OK;
    }
    const size_t tk = sizeof(float) * (size_t)d->TT * d->HV * d->K;
    if (dKG && !E)
        DG_CHECK_CUDA(cudaMemsetAsync(dKG, 0, tk, s));
    if (dW && !h)
        DG_CHECK_CUDA(cudaMemsetAsync(dW, 0, tk, s));
    if (dKG && E)
        DG_TRY(rows_stateT_tc_launch(ctx, d, 1.f, E, dHs, dKG));
    if (dW && h)
        DG_TRY(rows_stateT_tc_launch(ctx, d, -1.f, dEtot, h, dW));
    if (dG) {
        const bool vec = d->K % 4 == 0 && d->V % 4 == 0 && aligned16(dG) && (!h || aligned16(h)) &&
                         aligned16(dHs);
        state_dg_tc_kernel<M><<<dim3((unsigned)d->NC, (unsigned)d->HV), SM_THREADS, 0, s>>>(
            d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, vec, G, h, dHs, dG);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

int kda_state_rows_plus_fits(const kda_cuda_dims *d, const void *v, const float *v2,
                             const float *du, const float *h, const float *dHn, const float *dkg,
                             const float *dbg, const float *dw, const float *dG) {
    if (d->V % 8 != 0 || d->K % 4 != 0)
        return 0;
    const void *ps[] = {v, v2, du, h, dHn, dkg, dbg, dw, dG};
    for (const void *p : ps)
        if (!p || !aligned16(p))
            return 0;
    return 1;
}

dg_status kda_state_rows_plus(dg_ctx *ctx, const kda_cuda_dims *d, const kda_bf16 *v,
                              const float *v2, const float *du, const float *h, const float *dHn,
                              const float *G, float *dkg, float *dbg, float *dw, float *dG) {
    if (!kda_state_rows_plus_fits(d, v, v2, du, h, dHn, dkg, dbg, dw, dG) || !G)
        return dg__err(DG_ERR_ARG, "%s: sizes or alignment not supported (K=%d V=%d)", __func__,
                       d->K, d->V);
    if (d->NC == 0)
        return DG_OK;
    kda_cuda_dims t = *d;
    t.tc = 1;
    t.mid = 0;
    DG_TRY(rows_stateT_tc_launch(ctx, &t, 1.f, v, dHn, dkg));
    DG_TRY(rows_stateT_tc_launch(ctx, &t, 1.f, v2, dHn, dbg));
    DG_TRY(rows_stateT_tc_launch(ctx, &t, 1.f, du, h, dw));
    state_dg_tc_kernel<float>
        <<<dim3((unsigned)t.NC, (unsigned)t.HV), SM_THREADS, 0, dg__stream(ctx)>>>(
            t.chunk_t0, t.chunk_len, t.HV, t.K, t.V, true, G, h, dHn, dG);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__kda_state_bwd_seq_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *W,
                                                const void *KG, const float *G, const void *dh,
                                                const float *dE, const float *dht, float *dEtot,
                                                void *dHs, float *dh0) {
    DG_TRY(check_dims("dg__kda_state_bwd_seq_cuda", d));
    if (d->mid)
        return d->tc ? state_seq_bwd_tc(ctx, d, (const kda_bf16 *)W, (const kda_bf16 *)KG, G,
                                        (const kda_bf16 *)dh, dE, dht, dEtot, (kda_bf16 *)dHs, dh0)
                     : kda_mid_refused(__func__, d);
    if (d->tc)
        return state_seq_bwd_tc(ctx, d, (const float *)W, (const float *)KG, G, (const float *)dh,
                                dE, dht, dEtot, (float *)dHs, dh0);
    KDA_DISPATCH_BT(d->BT, {
        return state_seq_bwd_ffma<BT_>(ctx, d, (const float *)W, (const float *)KG, G,
                                       (const float *)dh, dE, dht, dEtot, (float *)dHs, dh0);
    });
    return DG_OK;
}

extern "C" dg_status dg__kda_state_bwd_rows_cuda(dg_ctx *ctx, const kda_cuda_dims *d,
                                                 const float *G, const void *h, const void *E,
                                                 const void *dHs, const float *dEtot, float *dW,
                                                 float *dKG, float *dG) {
    DG_TRY(check_dims("dg__kda_state_bwd_rows_cuda", d));
    if (d->NC == 0 || !(dW || dKG || dG))
        return DG_OK;
    if (!dHs || (dW && !dEtot))
        return dg__err(DG_ERR_ARG, "%s: dHn (and dE_tot for dW) are required", __func__);
    if (d->mid)
        return d->tc ? state_rows_tc(ctx, d, G, (const kda_bf16 *)h, (const kda_bf16 *)E,
                                     (const kda_bf16 *)dHs, dEtot, dW, dKG, dG)
                     : kda_mid_refused(__func__, d);
    if (d->tc)
        return state_rows_tc(ctx, d, G, (const float *)h, (const float *)E, (const float *)dHs,
                             dEtot, dW, dKG, dG);
    const Dims dd = make_dims(d);
    KDA_DISPATCH_BT(d->BT, {
        rows_stateT_kernel<BT_>
            <<<dim3((unsigned)dd.NC, dd.HV, DG_CEIL_DIV(dd.K, CT)), NTH, 0, dg__stream(ctx)>>>(
                dd, (const float *)E, (const float *)dHs, 1.f, dKG, dEtot, (const float *)h, -1.f,
                dW, G, dG);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

extern "C" dg_status dg__kda_state_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *W,
                                            const void *KG, const float *G, const void *h,
                                            const void *E, const void *dh, const float *dE,
                                            const float *dht, float *dW, float *dU, float *dKG,
                                            float *dG, float *dh0) {
    DG_TRY(check_dims("dg__kda_state_bwd_cuda", d));
    if (d->mid && !d->tc)
        return kda_mid_refused(__func__, d);
    const bool par = d->NC > 0 && (dW || dKG || dG);
    const bool need_et = dW && !dU; /* dW needs dE_tot even when dU is not wanted */
    const size_t nh = (size_t)d->NC * d->HV * d->K * d->V, ne = (size_t)d->TT * d->HV * d->V;
    const size_t es = d->mid ? sizeof(kda_bf16) : sizeof(float);
    Scratch sh(ctx), se(ctx); /* dHn_c (NULL: the serial pass stores nothing), dE_tot */
    if (par)
        DG_TRY(sh.alloc((nh * es + sizeof(float) - 1) / sizeof(float)));
    if (need_et)
        DG_TRY(se.alloc(ne));
    float *dEtot = dU ? dU : need_et ? se.f() : nullptr;
    DG_TRY(dg__kda_state_bwd_seq_cuda(ctx, d, W, KG, G, dh, dE, dht, dEtot, sh.p, dh0));
    return par ? dg__kda_state_bwd_rows_cuda(ctx, d, G, h, E, sh.p, dEtot, dW, dKG, dG) : DG_OK;
}

dg_status dg__kda_rows_stateT(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *A,
                              const float *S, float *C) {
    if (d->tc)
        return rows_stateT_tc_launch(ctx, d, scale, A, S, C);
    switch (d->BT) {
    case 16:
        return rows_stateT_bt<16>(ctx, d, scale, A, S, C);
    case 32:
        return rows_stateT_bt<32>(ctx, d, scale, A, S, C);
    default:
        return rows_stateT_bt<64>(ctx, d, scale, A, S, C);
    }
}

// ---- launchers: KCP summaries

extern "C" int dg__kda_state_summary_fits(const kda_cuda_dims *d) {
    return d->tc == 1 && d->K % 16 == 0 && d->K <= 256 && d->V % 2 == 0;
}

/* One summary pass pair (see dg__kda_state_summary_cuda) with A1, A2 of TA and X0 of TX. */
template <bool BWD, class TA, class TX>
static dg_status state_summary(dg_ctx *ctx, const kda_cuda_dims *d, int seq, const TA *A1,
                               const TX *X0, const TA *A2, const float *G, const TA *Sup,
                               const float *S0, float *Sh, float *SM) {
    kda_cuda_dims one = *d; /* the sequence alone: block 0 walks chunks chunk_off[seq].. */
    one.N = 1;
    one.chunk_off = d->chunk_off + seq;
    DG_TRY(
        state_mma<BWD>(ctx, &one, StateOps<TA, TX>{A1, X0, A2, G, S0, Sup, nullptr, nullptr, Sh}));
    /* the transition: the same pass over K columns from the identity, with no input term */
    Scratch I(ctx);
    DG_TRY(I.alloc((size_t)d->HV * d->K * d->K));
    DG_TRY(kda_identity(ctx, I.f(), d->HV, d->K));
    one.V = d->K;
    return state_mma<BWD>(
        ctx, &one, StateOps<TA, TX>{A1, nullptr, A2, G, I.f(), nullptr, nullptr, nullptr, SM});
}

extern "C" dg_status dg__kda_state_summary_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int seq,
                                                int bwd, const void *A1, const void *X0,
                                                const void *A2, const float *G, const void *Sup,
                                                const float *S0, float *Sh, float *SM) {
    if (!ctx || !d || !d->buf || seq < 0 || seq >= d->N || !A1 || !A2 || !G || !Sh || !SM)
        return dg__err(DG_ERR_ARG, "%s: dims, seq in [0, N), A1, A2, G, Sh and SM are required",
                       __func__);
    if (!dg__kda_state_summary_fits(d))
        return dg__err(DG_ERR_UNSUPPORTED,
                       "%s: needs the TF32 path with K %% 16 == 0, K <= 256 "
                       "and V even (tc=%d K=%d V=%d)",
                       __func__, d->tc, d->K, d->V);
    typedef kda_bf16 B16;
    if (d->mid)
        return bwd ? state_summary<true>(ctx, d, seq, (const B16 *)A1, (const float *)X0,
                                         (const B16 *)A2, G, (const B16 *)Sup, S0, Sh, SM)
                   : state_summary<false>(ctx, d, seq, (const B16 *)A1, (const B16 *)X0,
                                          (const B16 *)A2, G, (const B16 *)Sup, S0, Sh, SM);
    return bwd ? state_summary<true>(ctx, d, seq, (const float *)A1, (const float *)X0,
                                     (const float *)A2, G, (const float *)Sup, S0, Sh, SM)
               : state_summary<false>(ctx, d, seq, (const float *)A1, (const float *)X0,
                                      (const float *)A2, G, (const float *)Sup, S0, Sh, SM);
}

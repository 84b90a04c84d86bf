/*
 * kernels/kda/kda_cuda.h -- CUDA twins of the raw KDA stage functions in ops/kda/kda.h.
 *
 * Same math, same layouts, same argument order as the CPU reference functions (see the layout
 * table at the top of ops/kda/kda.h), with three differences:
 *   - every array is a DEVICE pointer, f32 unless stated: f32 arithmetic throughout; bf16 only
 *     where a flag says so (the raw inputs of l2norm, beta and the gate, and the intermediates
 *     W, U, KG, QG, h, E under kda_cuda_dims.mid, both below); the ops layer converts any other
 *     bf16 input to f32 before calling and converts outputs back;
 *   - the sequence/chunk tables live on the device in a kda_cuda_dims (built once per call);
 *   - each function takes the dg_ctx whose stream it runs on and returns a dg_status (launch and
 *     runtime errors are checked; nothing is synchronised unless stated).
 * Tensor cores (kda_cuda_dims.tc): 0 (what dg__kda_cuda_dims_new sets) keeps every product in plain
 * f32 FFMA, which is what the f32 tests pin to the CPU f32 reference within 1e-5. 1 lets the
 * stage matmuls of the kernels listed below run on tensor cores with f32 accumulators: TF32
 * products (operands rounded to TF32, 10 stored mantissa bits: <= 2^-11 relative per operand),
 * or bf16 m16n8k16 where both operands are stored in bf16 (exact products); 2 uses the 3xTF32
 * split instead (x = hi + lo, hi*hi + hi*lo + lo*hi: close to f32 accuracy at three times the
 * tensor-core work). Rule (ops/kda/kda_common.c): the ops layer
 * sets tc = 1 only for an entry point whose activation inputs (q, k, v, g, beta, or a stage's
 * first activation input) are bf16 -- their 8-bit mantissa already limits such a call to ~1e-2
 * -- and the stages of one dg_kda_chunk call (and their tape nodes) inherit the composite's tc
 * through the shared tables. dg_kda_opts.tensor_cores chooses the mode of those bf16 calls:
 * DG_KDA_TC_OFF turns the tensor-core path off (the f32 FFMA kernels run), DG_KDA_TC_3XTF32
 * selects 3xTF32, DG_KDA_TC_DEFAULT (0) TF32. Kernels with a tensor-core variant (each in the
 * file of its stage, next to its FFMA kernels): dg__kda_output_fwd_cuda, dg__kda_state_fwd_cuda,
 * dg__kda_wy_fwd_cuda (W and U), dg__kda_intra_fwd_cuda (mma.sync: the off-diagonal 16x16 blocks
 * of Aqk and Lkk factorised around the first row of the row block (kda.md §11.7, 2), TF32 or
 * 3xTF32 by tc; the diagonal blocks 3xTF32 around their middle rows, or exact FFMA where the
 * gates are too steep; the solve's block merges 3xTF32), dg__kda_output_bwd_cuda,
 * dg__kda_state_bwd_cuda, dg__kda_intra_bwd_cuda (tc = 1 and 2: mma.sync 3xTF32, as the sums of its
 * gradients feed dA_log's long sums, where TF32 rounding showed); every other function ignores tc.
 * With tc == 1 and sizes that allow it (K, V multiples of 16 / 4, 16-byte aligned arrays), the
 * state pass (forward and backward), the WY and output kernels run as mma.sync with cp.async
 * staging (state.cu, wy.cu, output.cu, mma.cuh); otherwise, and with tc == 2, those stages run
 * their f32 FFMA kernels (at least as accurate as 3xTF32; bf16 intermediates, which need the
 * mma.sync kernels, are refused there). The tensor-core kernels use the hardware exponential
 * (kdamma::exp_ftz) where the FFMA kernels use expf.
 * Storage of the intermediates W, U, KG, QG, h and E (kda_cuda_dims.mid): 0 (what
 * dg__kda_cuda_dims_new sets) f32, 1 bf16 -- those six arrays are then bf16 (declared void here),
 * written rounded to nearest and widened exactly when read, while every product still
 * accumulates in f32 and every other array (G, Aqk, Tm, h0, ht, the gradients other than dh)
 * stays f32. The gradient of h (dh: written by the output backward, read by the state backward
 * and the backward KCP summary) and the state backward's dHn scratch are stored like h. Half the
 * bytes of the memory-bound state, output and WY kernels, and of the saved tensors. mid = 1
 * needs the mma.sync path of every stage that reads or writes them: tc == 1, K % 16 == 0, K <=
 * 256, V % 16 == 0 and 16-byte aligned arrays (dg__kda_mid_fits); the launchers refuse it
 * otherwise. The ops layer sets it exactly then (kda_common.c).
 * Gradient outputs are OVERWRITTEN (never accumulated), exactly like the CPU versions; NULL means
 * "zero" for optional inputs and "skip" for optional outputs, also like the CPU versions.
 *
 * Layout reminder (TT = B*T flat tokens; NC = chunks over all sequences):
 *   q, k [TT,H,K]; v, U, E, O [TT,HV,V]; g, G, W, KG, QG [TT,HV,K]; beta [TT,HV];
 *   Aqk, Tm [TT,HV,BT] (token row t holds row t - chunk_t0 of its chunk's matrix);
 *   h [NC,HV,K,V] (state at chunk start); h0, ht [N,HV,K,V]; A_log [HV]; dt_bias [HV*K].
 *
 * One file per stage in kernels/kda/ (as ops/kda/ has one node file per stage), holding the
 * stage's forward, backward and every variant: beta.cu, gate.cu, intra.cu, wy.cu, state.cu (with
 * the KCP summaries), output.cu, recurrent.cu; dims.cu builds the tables. N1 is the shared L2
 * norm, kernels/l2norm.cu.
 * Shared: common.cuh / common.cu (dims helpers, dispatch, device math, kda_sum_parts) and mma.cuh
 * (the tensor-core helpers). The declarations below follow the same order.
 */
#ifndef DG_KDA_CUDA_H
#define DG_KDA_CUDA_H

#include "deltagrad.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kda_cuda_dims {
    int64_t TT;               /* flat tokens */
    int H, HV, K, V, BT;      /* heads, value heads, key dim, value dim, chunk size */
    int N;                    /* sequences */
    int64_t NC;               /* chunks over all sequences */
    const int64_t *cu;        /* device [N+1]: sequence n = flat tokens [cu[n], cu[n+1]) */
    const int64_t *chunk_off; /* device [N+1]: first chunk of sequence n; chunk_off[N] = NC */
    const int64_t *chunk_t0;  /* device [NC]: first flat token of each chunk */
    const int32_t *chunk_len; /* device [NC]: tokens in each chunk (the last one may be short) */
    const int32_t *chunk_seq; /* device [NC]: the sequence each chunk belongs to */
    int tc;                   /* 0: f32 FFMA; 1: TF32 tensor cores; 2: 3xTF32 (see above) */
    int mid;                  /* storage of W, U, KG, QG, h, E: 0 f32, 1 bf16 (see above) */
    int leaf_bf16; /* the op's own arrays v and dv (wy), o (output forward) and dO (output
                      backward) are bf16, read / written as stored: 1; f32: 0 */
    /* How the intra and WY functions read q and k (set per call, like leaf_bf16; 0 / NULL
     * from dg__kda_cuda_dims_new): qk_bf16 = 1: q and k are bf16, read as stored; rq, rk
     * [TT,H] (each optional): every row of q (k) is multiplied by its entry as it is read.
     * The in-op L2 norm hands over its raw input x with r = 1 / ||x||, so the normalised rows
     * q = x r are formed in registers, bit for bit the product the norm's own y = x r holds,
     * and never stored (see "factored q, k" in ops/kda/kda.h). The mma.sync kernels of both
     * stages read them so (tc == 1, K % 16 == 0, 16-byte aligned q, k: dg__kda_qk_fits); any
     * other kernel gets f32 rows its launcher forms in scratch (kda_qk_widen). The gradients
     * dq, dk stay those of the normalised rows. */
    int qk_bf16;
    const float *rq, *rk;
    void *buf;        /* device allocation holding the tables */
    size_t buf_bytes; /* > 0: buf is owned by these dims; 0: by the context (tables) */
} kda_cuda_dims;

/* ---- the chunk tables (dims.cu) ---- */
/* Whether the bf16 storage of the intermediates (mid = 1) applies to d's sizes and mode. */
int dg__kda_mid_fits(const kda_cuda_dims *d);
/* Whether q, k may be read as bf16 and / or through row scales (qk_bf16, rq, rk above): tc == 1,
 * K % 16 == 0 and 16-byte aligned q and k. */
int dg__kda_qk_fits(const kda_cuda_dims *d, const void *q, const void *k);
/* Upload the tables: cu_host, chunk_off_host are host arrays [N+1] as in kda_dims. out->tc = 0
 * (the caller may set it afterwards). */
dg_status dg__kda_cuda_dims_new(dg_ctx *ctx, int64_t TT, int H, int HV, int K, int V, int BT, int N,
                                const int64_t *cu_host, const int64_t *chunk_off_host,
                                kda_cuda_dims *out);
void dg__kda_cuda_dims_free(dg_ctx *ctx, kda_cuda_dims *d);

/* The first stages read the user's activation as it is stored: the raw input x (q or k, beta's
 * b, the gate's g) is f32, or bf16 when the flag xbf16 / bbf16 is set -- no converted copy --
 * and the gradient of that input (dx, db) is written in the same dtype, straight into what the
 * tape accumulates for it. Every other array of these functions is f32. */

/* ---- N1 l2norm: the shared op, kernels/l2norm.cuh (dg__l2norm_fwd_cuda, dg__l2norm_bwd_cuda) */

/* ---- N2 beta (beta.cu) ---- */
dg_status dg__kda_beta_fwd_cuda(dg_ctx *ctx, int64_t n, float c, int bbf16, const void *b,
                                float *beta);
dg_status dg__kda_beta_bwd_cuda(dg_ctx *ctx, int64_t n, float c, int bbf16, const void *b,
                                const float *dbeta, void *db);

/* ---- N3 gate and chunk-local cumsum (gate.cu) ---- */
dg_status dg__kda_gate_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, dg_gate_kind kind, float lb,
                                int cumsum, int xbf16, const void *x, const float *A_log,
                                const float *dt_bias, float *G);
dg_status dg__kda_gate_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, dg_gate_kind kind, float lb,
                                int cumsum, int xbf16, const void *x, const float *A_log,
                                const float *dt_bias, const float *dG, void *dx, float *dA_log,
                                float *ddt_bias);

/* acc of dg__kda_intra_bwd_cuda and dg__kda_wy_bwd_cuda (no CPU twin: a CUDA-only saving): the
 * flagged gradients are ADDED to what their arrays hold instead of overwriting them, so a tape node
 * can accumulate into a gradient slot in place of a separate f32 axpy. 0 keeps the rule above. */
enum { KDA_ACC_DQ = 1, KDA_ACC_DK = 2, KDA_ACC_DG = 4 };

/* ---- N4 intra (intra.cu) ---- */
/* q, k: f32, or as d->qk_bf16, rq, rk say (intra and WY alike) */
dg_status dg__kda_intra_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                                 const void *k, const float *beta, const float *G, float *Aqk,
                                 float *Tm);
/* The same forward with the prep of its inputs in the kernel, on behalf of the nodes that own
 * them (ops/kda/chunk.c): the chunk-local cumsum G of the gate of the bf16 gate input g (N3; the
 * gate with the hardware exponential, the cumsum in segments of 8 rows: f32 accuracy, not the
 * bits of dg__kda_gate_fwd_cuda) and the reciprocal norms rq, rk of the bf16 q, k rows (N1,
 * 1 / sqrt(sum x^2 + eps), summed in another order than dg__l2norm_fwd_cuda), which it then uses
 * as d->rq, d->rk. Only where dg__kda_intra_prep_fits (the factored bf16 tensor-core
 * path, d->tc == 1, 16-byte aligned g) and G, Aqk, Tm are 16-byte aligned; else DG_ERR_STATE. */
typedef struct kda_intra_prep {
    const void *g;                /* [TT,HV,K] bf16 */
    const float *A_log, *dt_bias; /* [HV], [HV*K] or NULL */
    dg_gate_kind kind;
    float lb, eps;  /* the resolved lower bound; the norm's eps */
    float *G;       /* out [TT,HV,K] */
    float *rq, *rk; /* out [TT,H] */
} kda_intra_prep;
int dg__kda_intra_prep_fits(const kda_cuda_dims *d, const void *q, const void *k, const void *g);
dg_status dg__kda_intra_prep_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                      const void *q, const void *k, const float *beta,
                                      const kda_intra_prep *p, float *Aqk, float *Tm);
dg_status dg__kda_intra_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                                 const void *k, const float *beta, const float *G, const float *Tm,
                                 const float *dAqk, const float *dTm, float *dq, float *dk,
                                 float *dbeta, float *dG, unsigned acc);

/* ---- N5 wy (wy.cu): v (forward, backward) and dv (backward) are bf16 when d->leaf_bf16 is
 * set, else f32 ---- */
dg_status dg__kda_wy_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *q, const void *k,
                              const void *v, const float *beta, const float *G, const float *Tm,
                              void *W, void *U, void *KG, void *QG);
dg_status dg__kda_wy_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *q, const void *k,
                              const void *v, const float *beta, const float *G, const float *Tm,
                              const float *dW, const float *dU, const float *dKG, const float *dQG,
                              float *dq, float *dk, void *dv, float *dbeta, float *dG, float *dTm,
                              unsigned acc);

/* ---- N6 state, and the KCP summaries built on its pass (state.cu) ---- */
dg_status dg__kda_state_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *W, const void *U,
                                 const void *KG, const float *G, const float *h0, void *h, void *E,
                                 float *ht);
dg_status dg__kda_state_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *W, const void *KG,
                                 const float *G, const void *h, const void *E, const void *dh,
                                 const float *dE, const float *dht, float *dW, float *dU,
                                 float *dKG, float *dG, float *dh0);
/* The same backward in its two halves, so that a caller can release dh and dE between them (the
 * tape node does: they are the largest arrays the serial pass reads). seq: the serial pass, dE_tot
 * (= dU) [TT,HV,V], the state gradient at each chunk's start dHn [NC,HV,K,V] stored like h (bf16
 * when d->mid) and dh0, each optional; rows: from dE_tot and dHn, dW = -dE_tot h^T, dKG = E dHn^T
 * and dG, each optional (dHn required, dE_tot too for dW). dg__kda_state_bwd_cuda runs both on
 * scratch of its own. */
dg_status dg__kda_state_bwd_seq_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *W,
                                     const void *KG, const float *G, const void *dh,
                                     const float *dE, const float *dht, float *dEtot, void *dHs,
                                     float *dh0);
dg_status dg__kda_state_bwd_rows_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const float *G,
                                      const void *h, const void *E, const void *dHs,
                                      const float *dEtot, float *dW, float *dKG, float *dG);
/* KCP summaries of sequence `seq` alone (ops/kda/kcp.c), as two state passes on the tensor-core
 * path: Sh [HV,K,V] = the pass from S0 (NULL: zero) with input X0 (and Sup, backward) and SM
 * [HV,K,K] = the same pass over K columns from the identity with no input, i.e. the product of
 * the chunk transitions (forward: A1 = W, X0 = U, A2 = KG; backward, bwd = 1: A1 = KG, X0 = dE,
 * A2 = W, Sup = dh, and SM is the transposed product). DG_ERR_UNSUPPORTED unless
 * dg__kda_state_summary_fits (tc == 1, K % 16 == 0, K <= 256, V even). A1, A2, the forward's
 * X0 (= U) and the backward's Sup (= dh) have the mid storage of d; the backward's X0 (dE) is
 * f32. */
int dg__kda_state_summary_fits(const kda_cuda_dims *d);
dg_status dg__kda_state_summary_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int seq, int bwd,
                                     const void *A1, const void *X0, const void *A2, const float *G,
                                     const void *Sup, const float *S0, float *Sh, float *SM);

/* ---- N7 output (output.cu): O (forward) and dO (backward) are bf16 when d->leaf_bf16 is set,
 * else f32 ---- */
dg_status dg__kda_output_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *QG,
                                  const void *h, const float *Aqk, const void *E, void *O);
dg_status dg__kda_output_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *QG,
                                  const void *h, const float *Aqk, const void *E, const void *dO,
                                  float *dQG, void *dh, float *dAqk, float *dE);

/* ---- the token recurrence (recurrent.cu) ---- */
dg_status dg__kda_recurrent_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                     const float *q, const float *k, const float *v, const float *g,
                                     const float *beta, const float *h0, float *o, float *ht);
dg_status dg__kda_recurrent_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                     const float *q, const float *k, const float *v, const float *g,
                                     const float *beta, const float *h0, const float *dO,
                                     const float *dht, float *dq, float *dk, float *dv, float *dg,
                                     float *dbeta, float *dh0);

#ifdef __cplusplus
}
#endif
#endif /* DG_KDA_CUDA_H */

/*
 * ops/kda/kda.h -- internal declarations shared by the KDA stage files (and by the CUDA twins of
 * the raw kernels): the raw-array reference functions of every stage, forward and backward, their
 * dispatch to the CUDA twin or the f64/f32 reference (kda_run_*), the option/shape validation
 * shared by the public entry points, and the recompute group of the composite.
 *
 * The equations: docs/kda.md §11 (the § numbers below refer to docs/kda.md). Letters: B, T, H, HV,
 * K, V, BT, N, NC (total chunks over all sequences), G = HV / H (value heads per q/k head).
 *
 * Layouts of the raw arrays (contiguous, row-major; "token" = flat index b*T + t, TT = B*T):
 *   q, k                 [TT, H, K]     value head hv reads q/k head hv / G
 *   v, U, E, O           [TT, HV, V]
 *   g, G, W, KG, QG      [TT, HV, K]    G = chunk-local inclusive cumsum of the log decay
 *   beta                 [TT, HV]
 *   Aqk, Tm              [TT, HV, BT]   token row t holds row (t - chunk start) of its chunk's
 *                                       matrix; only columns j <= row (j < row for Lkk) are read
 *   h                    [NC, HV, K, V] state at the START of each chunk; row chunk_off[n] + c
 *   h0, ht               [N, HV, K, V]
 *   A_log [HV], dt_bias  [HV * K]
 * Gradient outputs of the raw backward functions are OVERWRITTEN (zeroed first, never accumulated
 * into); dq and dk have H heads and are summed over the G value heads of a group.
 *
 * Every raw function exists twice, suffix _f64 (double) and _f32 (float, f32 arithmetic). The
 * bodies are written once per stage file with the type RT and name macro RF (see ../ref_tmpl.h).
 */
#ifndef DG_OPS_KDA_H
#define DG_OPS_KDA_H

#include <math.h>

#include "../../autograd/group.h"
#include "../../autograd/tape.h"
#include "../../kernels/kda/kda_cuda.h"
#include "../../tensor/tensor.h"
#include "../l2norm.h"

/* Sizes and the sequence/chunk tables. cu and chunk_off are host arrays. */
typedef struct kda_dims {
    int64_t B, T;             /* tensor rows and tokens per row; TT = B * T */
    int H, HV, K, V;          /* q/k heads, value heads, key dim, value dim */
    int BT;                   /* chunk size */
    int N;                    /* sequences: B, or n_seqs with cu_seqlens (then B = 1) */
    const int64_t *cu;        /* [N+1] sequence n = tokens [cu[n], cu[n+1]) of the flat axis */
    const int64_t *chunk_off; /* [N+1] first chunk of sequence n; chunk_off[N] = NC */
} kda_dims;

/* One chunk: tokens [t0, t0 + L) of the flat axis, global chunk index idx (row of h). */
typedef struct kda_chunk {
    int64_t t0;
    int L;
    int64_t idx;
} kda_chunk;

static inline int64_t kda_nchunks(const kda_dims *d, int n) {
    return d->chunk_off[n + 1] - d->chunk_off[n];
}
static inline kda_chunk kda_chunk_at(const kda_dims *d, int n, int64_t c) {
    kda_chunk ch;
    ch.t0 = d->cu[n] + c * d->BT;
    int64_t left = d->cu[n + 1] - ch.t0;
    ch.L = (int)(left < d->BT ? left : d->BT);
    ch.idx = d->chunk_off[n] + c;
    return ch;
}

/* The chunk with global index idx (0 <= idx < NC): parallel loops run over idx. */
static inline kda_chunk kda_chunk_idx(const kda_dims *d, int64_t idx) {
    int lo = 0, hi = d->N - 1; /* the last sequence whose first chunk is <= idx (skips empties) */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (d->chunk_off[mid] <= idx)
            lo = mid;
        else
            hi = mid - 1;
    }
    return kda_chunk_at(d, lo, idx - d->chunk_off[lo]);
}

/* OpenMP in the raw functions: `KDA_OMP(parallel for ...)` over independent work items, each
 * writing its own rows in the same order as the serial loops, so results are bit-identical for
 * any thread count. Per-thread scratch is indexed by kda_thread_id() < kda_max_threads(). */
#ifdef _OPENMP
#include <omp.h>
#define KDA_PRAGMA(x) _Pragma(#x)
#define KDA_OMP(clauses) KDA_PRAGMA(omp clauses)
static inline int kda_max_threads(void) { return omp_get_max_threads(); }
static inline int kda_thread_id(void) { return omp_get_thread_num(); }
#else
#define KDA_OMP(clauses)
static inline int kda_max_threads(void) { return 1; }
static inline int kda_thread_id(void) { return 0; }
#endif

/* ---- raw reference functions (declared for f64 and f32) ------------------------------------
 * A NULL optional input means zero (h0, upstream gradients); a NULL optional output is skipped.
 * Functions that need scratch return DG_ERR_NOMEM when it cannot be allocated. */
#define KDA_DECLARE_RAW(RT, SFX)                                                                   \
    /* N1 (§11.3) is the shared L2 norm: dg__l2norm_fwd/bwd (ops/l2norm.h), eps KDA_L2_EPS. */    \
    /* N2 (§11.3): beta = c sigmoid(b), n elements. */                                            \
    void dg__kda_beta_fwd_##SFX(int64_t n, RT c, const RT *b, RT *beta);                           \
    void dg__kda_beta_bwd_##SFX(int64_t n, RT c, const RT *b, const RT *dbeta, RT *db);            \
    /* N3 (§11.2, §11.4(a)): G = gate(x), then (cumsum != 0) the chunk-local inclusive cumsum.   \
     * x, G: [TT,HV,K]. A_log: [HV] (NULL: a = 1, LOWERBOUND only); dt_bias: [HV*K] or NULL. */    \
    void dg__kda_gate_fwd_##SFX(const kda_dims *d, dg_gate_kind kind, RT lb, int cumsum,           \
                                const RT *x, const RT *A_log, const RT *dt_bias, RT *G);           \
    /* dG -> (reverse chunk cumsum) -> gate backward. dx: [TT,HV,K]; dA_log [HV], ddt_bias         \
     * [HV*K] optional (reduced over tokens). */                                                   \
    void dg__kda_gate_bwd_##SFX(const kda_dims *d, dg_gate_kind kind, RT lb, int cumsum,           \
                                const RT *x, const RT *A_log, const RT *dt_bias, const RT *dG,     \
                                RT *dx, RT *dA_log, RT *ddt_bias);                                 \
    /* N4 (§11.4(b)): Aqk = s Araw (j <= i), Tm = (I + Diag(beta) P)^{-1}; both [TT,HV,BT]. */    \
    dg_status dg__kda_intra_fwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,       \
                                      const RT *beta, const RT *G, RT *Aqk, RT *Tm);               \
    /* (§11.6 B3 last line, §11.6 B4) from dAqk, dTm (either NULL): dq, dk [TT,H,K], dbeta       \
     * [TT,HV], dG [TT,HV,K]. */                                                                   \
    dg_status dg__kda_intra_bwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,       \
                                      const RT *beta, const RT *G, const RT *Tm, const RT *dAqk,   \
                                      const RT *dTm, RT *dq, RT *dk, RT *dbeta, RT *dG);           \
    /* N5 (§11.4(c)): W = Tm X, U = Tm Diag(beta) V, KG = K exp(lambda - G), QG = Q exp(G). */    \
    dg_status dg__kda_wy_fwd_##SFX(const kda_dims *d, const RT *q, const RT *k, const RT *v,       \
                                   const RT *beta, const RT *G, const RT *Tm, RT *W, RT *U,        \
                                   RT *KG, RT *QG);                                                \
    /* (§11.6 B3 WY part, §2 N5) upstream dW, dU, dKG, dQG each optional. */                     \
    dg_status dg__kda_wy_bwd_##SFX(const kda_dims *d, const RT *q, const RT *k, const RT *v,       \
                                   const RT *beta, const RT *G, const RT *Tm, const RT *dW,        \
                                   const RT *dU, const RT *dKG, const RT *dQG, RT *dq, RT *dk,     \
                                   RT *dv, RT *dbeta, RT *dG, RT *dTm);                            \
    /* N6 (§11.4(d)): sequential over chunks; h [NC,HV,K,V] at chunk starts, E = U - W h, ht. */  \
    dg_status dg__kda_state_fwd_##SFX(const kda_dims *d, const RT *W, const RT *U, const RT *KG,   \
                                      const RT *G, const RT *h0, RT *h, RT *E, RT *ht);            \
    /* (§11.6 B2, §2 N6) upstream dh [NC,HV,K,V], dE, dht each optional. dh0 optional. */        \
    dg_status dg__kda_state_bwd_##SFX(const kda_dims *d, const RT *W, const RT *KG, const RT *G,   \
                                      const RT *h, const RT *E, const RT *dh, const RT *dE,        \
                                      const RT *dht, RT *dW, RT *dU, RT *dKG, RT *dG, RT *dh0);    \
    /* N7 (§11.4(e)): O = s QG h + Aqk E (j <= i). */                                             \
    void dg__kda_output_fwd_##SFX(const kda_dims *d, RT scale, const RT *QG, const RT *h,          \
                                  const RT *Aqk, const RT *E, RT *O);                              \
    /* (§11.6 B1, §2 N7) dQG = s dO h^T, dh = s QG^T dO, dAqk = tril(dO E^T), dE = Aqk^T dO. */  \
    void dg__kda_output_bwd_##SFX(const kda_dims *d, RT scale, const RT *QG, const RT *h,          \
                                  const RT *Aqk, const RT *E, const RT *dO, RT *dQG, RT *dh,       \
                                  RT *dAqk, RT *dE);                                               \
    /* §11.1 token by token; q, k normalised, g = log decay [TT,HV,K], beta [TT,HV]. ht optional. \
     */                                                                                            \
    dg_status dg__kda_recurrent_fwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,   \
                                          const RT *v, const RT *g, const RT *beta, const RT *h0,  \
                                          RT *o, RT *ht);                                          \
    /* Backward through time (states recomputed from checkpoints every KDA_REC_SEG tokens).        \
     * dO, dht optional; dh0 optional. */                                                          \
    dg_status dg__kda_recurrent_bwd_##SFX(const kda_dims *d, RT scale, const RT *q, const RT *k,   \
                                          const RT *v, const RT *g, const RT *beta, const RT *h0,  \
                                          const RT *dO, const RT *dht, RT *dq, RT *dk, RT *dv,     \
                                          RT *dg, RT *dbeta, RT *dh0);

KDA_DECLARE_RAW(double, f64)
KDA_DECLARE_RAW(float, f32)

#define KDA_L2_EPS 1e-6

/* Overflow-free sigmoid and softplus in both precisions. */
static inline double kda_sigmoid_f64(double x) {
    if (x >= 0)
        return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}
static inline float kda_sigmoid_f32(float x) {
    if (x >= 0)
        return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}
static inline double kda_softplus_f64(double x) {
    return x > 0 ? x + log1p(exp(-x)) : log1p(exp(x));
}
static inline float kda_softplus_f32(float x) {
    return x > 0 ? x + log1pf(expf(-x)) : log1pf(expf(x));
}
#define KDA_REC_SEG 64 /* recurrent backward: tokens between stored state checkpoints */

/* ---- devices ----------------------------------------------------------------------------
 * On CUDA every stage computes in f32 (kernels/kda/kda_cuda.h): activation inputs (q, k, v, g,
 * beta, and o's gradient) may be f32 or bf16; the kernels of the tensor-core path read bf16 ones
 * as stored (docs/kda.md section 6 lists which), elsewhere they are converted to f32 copies
 * first; A_log, dt_bias, h0, ht and G, Aqk, Tm are f32, W, U, KG, QG, h, E f32 or bf16
 * (kda_cfg.mid). The device copy of the chunk tables is refcounted so that the stages of one
 * dg_kda_chunk call and their tape nodes share a single upload. */
typedef struct kda_dev {
    int refcount;
    dg_ctx *ctx; /* the allocator that owns d.buf */
    kda_cuda_dims d;
} kda_dev;
kda_dev *dg__kda_dev_retain(kda_dev *dv);
void dg__kda_dev_release(kda_dev **dv);

/* ---- options, validation, node parameters (kda_common.c) ----------------------------------- */

/* Resolved options plus the dims. Owns its tables (dg__kda_cfg_free). */
typedef struct kda_cfg {
    kda_dims d;
    dg_dtype dt;  /* compute dtype: DG_F64 or DG_F32 on the CPU, DG_F32 on CUDA */
    double scale; /* resolved (> 0) */
    dg_gate_kind gate;
    double lb;     /* resolved lower bound */
    double beta_c; /* 1 or 2 */
    int64_t *tab;  /* [2(N+1)]: cu then chunk_off (owned, or inside a node's params) */
    int cuda;      /* the context (and every tensor) is on a CUDA device */
    unsigned m_in; /* dtypes accepted for activation inputs (CPU: the first input's dtype only) */
    unsigned m_f;  /* dtypes accepted for intermediates and A_log, dt_bias, h0: DG_MASK(dt) */
    kda_dev *dev;  /* CUDA: the device tables (a reference), set by dg__kda_cfg_dev */
    kda_cuda_dims cd; /* CUDA: dev->d with this stage's sizes (tables borrowed from dev) */
    int tc;       /* CUDA: tensor-core mode asked for by this entry point (kda_tc_of; 0 for f32) */
    dg_dtype mid; /* storage of W, U, KG, QG, h, E: DG_BF16 where cd.mid is set (CUDA, tc == 1
                   * and dg__kda_mid_fits), else dt. Their gradients stay in dt. */
} kda_cfg;

/* kda_cuda_dims.tc of an entry point whose activation inputs are bf16 on CUDA, from
 * dg_kda_opts.tensor_cores (the modes are described in kernels/kda/kda_cuda.h): DEFAULT -> 1
 * (TF32), OFF -> 0 (the f32 FFMA kernels), 3XTF32 -> 2. */
static inline int kda_tc_of(dg_kda_tc opt) {
    return opt == DG_KDA_TC_OFF ? 0 : opt == DG_KDA_TC_3XTF32 ? 2 : 1;
}

/* Validate opts and build tables for tensors of B rows of T tokens. `op` names the caller in
 * messages. H, HV, K, V are taken as given (the caller checked them against the tensors). dt_in
 * is the dtype of the first activation input; ctx fixes the device. */
dg_status dg__kda_cfg_init(const char *op, dg_ctx *ctx, const dg_kda_opts *opts, int64_t B,
                           int64_t T, int H, int HV, int K, int V, dg_dtype dt_in, kda_cfg *cfg);
/* CUDA only (a no-op on the CPU): the device tables, shared with `share` when it is not NULL
 * (same sequences and chunk size), else uploaded. Built without CUDA: dg__no_cuda. */
dg_status dg__kda_cfg_dev(const char *op, dg_ctx *ctx, kda_cfg *cfg, kda_dev *share);
void dg__kda_cfg_free(kda_cfg *cfg);
/* *dst = *src with the tables copied into tab (2 (N+1) values, e.g. behind a node's params) and
 * the device tables retained (dst->cd borrows them): a copy that dg__kda_dev_release(&dst->dev)
 * lets go of. */
void dg__kda_cfg_copy(kda_cfg *dst, const kda_cfg *src, int64_t *tab);
/* The end of an entry point: frees cfg and, when st is an error, the outputs *o and (ht given)
 * *ht. Returns st. */
dg_status dg__kda_finish(kda_cfg *cfg, dg_status st, dg_tensor **o, dg_tensor **ht);
/* Total number of chunks NC. */
static inline int64_t kda_cfg_nc(const kda_cfg *c) { return c->tab[2 * (c->d.N + 1) - 1]; }

/* t must be non-NULL, on ctx's device (DG_ERR_DEVICE), of a dtype in `mask` and have `ndim`
 * dims equal to `shape`; `names` spells the dims ("B,T,HV,V"). */
dg_status dg__kda_check(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx,
                        unsigned mask, int ndim, const int64_t *shape, const char *names);
/* The first activation input of an op (it fixes the dtype on the CPU): non-NULL, on ctx's device,
 * f64 or f32 on the CPU, f32 or bf16 on CUDA, `ndim` dims. */
dg_status dg__kda_check_first(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx,
                              int ndim, const char *names);

/* The arguments of dg_kda_chunk / dg_kda_recurrent: q fixes B, T, H, K and the dtype, v fixes HV
 * and V; every other tensor must match (A_log/dt_bias per opts->gate; h0 optional). q, k, v, g,
 * beta share one dtype; A_log, dt_bias, h0 have the compute dtype (f32 on CUDA). Also builds
 * the device tables on CUDA. */
dg_status dg__kda_check_inputs(const char *op, dg_ctx *ctx, dg_tensor *q, dg_tensor *k,
                               dg_tensor *v, dg_tensor *g, dg_tensor *beta, dg_tensor *A_log,
                               dg_tensor *dt_bias, dg_tensor *h0, const dg_kda_opts *opts,
                               kda_cfg *cfg);

/* Contiguous pointer (host or device, where t lives) to t's values in dtype dt: t's own data, or
 * a converted copy held in *tmp, made in ctx (free with dg_tensor_free; NULL when no copy was
 * needed). Not recorded on the tape. */
dg_status dg__kda_ptr(dg_ctx *ctx, const dg_tensor *t, dg_dtype dt, dg_tensor **tmp,
                      const void **ptr);
/* The raw activation input t of l2norm, beta or the gate as their kernels read it: a contiguous
 * bf16 tensor on CUDA as it is (*bf16 = 1; the kernels take bf16 directly), else in dtype dt as
 * dg__kda_ptr gives it (*bf16 = 0). The gradient of such an input is written in its dtype. */
dg_status dg__kda_in_ptr(dg_ctx *ctx, const dg_tensor *t, dg_dtype dt, dg_tensor **tmp,
                         const void **ptr, int *bf16);
/* New contiguous tensor (uninitialised) of cfg's compute dtype in ctx. */
dg_status dg__kda_new(dg_ctx *ctx, const kda_cfg *c, int ndim, const int64_t *shape,
                      dg_tensor **out);
/* The same in cfg's storage dtype of W, U, KG, QG, h, E (c->mid). */
dg_status dg__kda_new_mid(dg_ctx *ctx, const kda_cfg *c, int ndim, const int64_t *shape,
                          dg_tensor **out);
/* Record t (made by dg__kda_new_mid) as output of n, its gradient kept in the compute dtype. */
static inline dg_status kda_output_mid(dg_node *n, const kda_cfg *c, dg_tensor *t) {
    return dg__node_output_as(n, t, c->dt);
}
/* The same shaped like t (gradients are computed in the compute dtype; dg__node_accum converts
 * them to the input's dtype). */
static inline dg_status kda_new_as(dg_ctx *ctx, const kda_cfg *c, const dg_tensor *t,
                                   dg_tensor **out) {
    return dg__kda_new(ctx, c, t->ndim, t->shape, out);
}
/* The gradients of a backward's q, k and G inputs (input indices iq, ik, iG) that the tape
 * already holds and the CUDA kernels may add to in place (dg__node_grad_inplace), with the
 * matching KDA_ACC_* bits in acc; NULL where the node needs a fresh buffer (and always on the
 * CPU, whose references only overwrite). */
typedef struct kda_acc_targets {
    dg_tensor *dq, *dk, *dG;
    unsigned acc;
} kda_acc_targets;
kda_acc_targets dg__kda_grad_targets(dg_node *n, const kda_cfg *c, int iq, int ik, int iG);
/* *out = a fresh gradient buffer shaped like t, unless `into` (a tape gradient to add to) is
 * given: then *out stays NULL and *ptr points into `into`. */
dg_status dg__kda_grad_buffer(dg_ctx *ctx, const kda_cfg *c, const dg_tensor *t, dg_tensor *into,
                              dg_tensor **out, void **ptr);

/* *out = a new tensor of dtype dt holding src's values (src itself, retained, when it already
 * has that dtype). Not recorded. */
dg_status dg__kda_as_dtype(dg_ctx *ctx, dg_tensor *src, dg_dtype dt, dg_tensor **out);
/* *out = a new tensor on ctx of dtype dt holding src's values (always a copy; NULL on failure).
 * Not recorded. */
dg_status dg__kda_copy_new(dg_ctx *ctx, const dg_tensor *src, dg_dtype dt, dg_tensor **out);

/* ---- dispatch: one raw function on the cfg's device -----------------------------------------
 * kda_run_X calls the CUDA twin kda_X_cuda(ctx, &c->cd, ...) when the cfg is on CUDA (builds
 * without CUDA never get there: dg__no_cuda), else the reference kda_X_f64 or kda_X_f32, by
 * c->dt, with &c->d. Arrays are in the compute dtype (f32 on CUDA) -- W, U, KG, QG, h, E in
 * c->mid, which is bf16 where kda_cuda_dims.mid is set -- passed as void pointers;
 * scale, lb and beta's c are converted to the function's float type. Every kda_run_X returns a
 * dg_status, DG_OK after a CPU function that returns void. The struct kda_X_io names the arrays
 * of one call; the declarations above say which may be NULL. */

/* beta has no dims: it takes the device (`cuda`) and the compute dtype `dt`. On CUDA its raw
 * input b and its gradient db may be bf16 instead (bbf16: the kernels read and write that dtype
 * directly, kda_cuda.h); the CPU needs dt (bbf16 = 0). The gate's io has the same flag, and so
 * has N1, the shared L2 norm (dg__l2norm_run_fwd / _bwd, ops/l2norm.h). */
static inline dg_status kda_run_beta_fwd(dg_ctx *ctx, int cuda, dg_dtype dt, int64_t n, double c,
                                         int bbf16, const void *b, void *beta) {
#ifdef DG_HAVE_CUDA
    if (cuda)
        return dg__kda_beta_fwd_cuda(ctx, n, (float)c, bbf16, b, beta);
#endif
    (void)bbf16;
    if (dt == DG_F64)
        dg__kda_beta_fwd_f64(n, c, b, beta);
    else
        dg__kda_beta_fwd_f32(n, (float)c, b, beta);
    return DG_OK;
}
static inline dg_status kda_run_beta_bwd(dg_ctx *ctx, int cuda, dg_dtype dt, int64_t n, double c,
                                         int bbf16, const void *b, const void *dbeta, void *db) {
#ifdef DG_HAVE_CUDA
    if (cuda)
        return dg__kda_beta_bwd_cuda(ctx, n, (float)c, bbf16, b, dbeta, db);
#endif
    (void)bbf16;
    if (dt == DG_F64)
        dg__kda_beta_bwd_f64(n, c, b, dbeta, db);
    else
        dg__kda_beta_bwd_f32(n, (float)c, b, dbeta, db);
    return DG_OK;
}

/* N3 with c->gate and c->lb; cumsum as in kda_gate_fwd. */
typedef struct kda_gate_fwd_io {
    const void *x, *A_log, *dt_bias;
    void *G;
    int xbf16; /* CUDA: x is bf16 */
} kda_gate_fwd_io;
static inline dg_status kda_run_gate_fwd(dg_ctx *ctx, const kda_cfg *c, int cumsum,
                                         const kda_gate_fwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda)
        return dg__kda_gate_fwd_cuda(ctx, &c->cd, c->gate, (float)c->lb, cumsum, a->xbf16, a->x,
                                     a->A_log, a->dt_bias, a->G);
#endif
    if (c->dt == DG_F64)
        dg__kda_gate_fwd_f64(&c->d, c->gate, c->lb, cumsum, a->x, a->A_log, a->dt_bias, a->G);
    else
        dg__kda_gate_fwd_f32(&c->d, c->gate, (float)c->lb, cumsum, a->x, a->A_log, a->dt_bias,
                             a->G);
    return DG_OK;
}
typedef struct kda_gate_bwd_io {
    const void *x, *A_log, *dt_bias, *dG;
    void *dx, *dA_log, *ddt_bias;
    int xbf16; /* CUDA: x and dx are bf16 */
} kda_gate_bwd_io;
static inline dg_status kda_run_gate_bwd(dg_ctx *ctx, const kda_cfg *c, int cumsum,
                                         const kda_gate_bwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda)
        return dg__kda_gate_bwd_cuda(ctx, &c->cd, c->gate, (float)c->lb, cumsum, a->xbf16, a->x,
                                     a->A_log, a->dt_bias, a->dG, a->dx, a->dA_log, a->ddt_bias);
#endif
    if (c->dt == DG_F64)
        dg__kda_gate_bwd_f64(&c->d, c->gate, c->lb, cumsum, a->x, a->A_log, a->dt_bias, a->dG,
                             a->dx, a->dA_log, a->ddt_bias);
    else
        dg__kda_gate_bwd_f32(&c->d, c->gate, (float)c->lb, cumsum, a->x, a->A_log, a->dt_bias,
                             a->dG, a->dx, a->dA_log, a->ddt_bias);
    return DG_OK;
}

/* q and k of the intra and WY stages as their kernels read them (dg__kda_qk_ptrs): q, k in the
 * compute dtype, or on CUDA bf16 as stored (bf16 = 1), and the row scales rq, rk [TT,H] of a
 * factored q, k (NULL: none; see "factored q, k" below). The CPU takes neither. */
typedef struct kda_qk_in {
    const void *q, *k;
    const float *rq, *rk;
    int bf16;
} kda_qk_in;
#ifdef DG_HAVE_CUDA
/* c->cd with the per-call fields of qk (kda_cuda_dims.qk_bf16, rq, rk). */
static inline kda_cuda_dims kda_qk_cd(const kda_cfg *c, const kda_qk_in *qk) {
    kda_cuda_dims cd = c->cd;
    cd.qk_bf16 = qk->bf16;
    cd.rq = qk->rq;
    cd.rk = qk->rk;
    return cd;
}
#endif
static inline dg_status kda_qk_cpu(const char *fn, const kda_qk_in *qk) {
    if (qk->bf16 || qk->rq || qk->rk)
        return dg__err(DG_ERR_STATE, "%s: bf16 or factored q, k are CUDA-only", fn);
    return DG_OK;
}

/* N4 with scale c->scale; prep (CUDA only, the forward prep below): G, qk.rq, qk.rk are filled by
 * the kernel instead of read. */
typedef struct kda_intra_fwd_io {
    kda_qk_in qk;
    const void *beta, *G;
    void *Aqk, *Tm;
#ifdef DG_HAVE_CUDA
    const kda_intra_prep *prep;
#endif
} kda_intra_fwd_io;
static inline dg_status kda_run_intra_fwd(dg_ctx *ctx, const kda_cfg *c,
                                          const kda_intra_fwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda) {
        const kda_cuda_dims cd = kda_qk_cd(c, &a->qk);
        if (a->prep)
            return dg__kda_intra_prep_fwd_cuda(ctx, &cd, (float)c->scale, a->qk.q, a->qk.k, a->beta,
                                               a->prep, a->Aqk, a->Tm);
        return dg__kda_intra_fwd_cuda(ctx, &cd, (float)c->scale, a->qk.q, a->qk.k, a->beta, a->G,
                                      a->Aqk, a->Tm);
    }
#endif
    DG_TRY(kda_qk_cpu("kda intra forward", &a->qk));
    if (c->dt == DG_F64)
        return dg__kda_intra_fwd_f64(&c->d, c->scale, a->qk.q, a->qk.k, a->beta, a->G, a->Aqk,
                                     a->Tm);
    return dg__kda_intra_fwd_f32(&c->d, (float)c->scale, a->qk.q, a->qk.k, a->beta, a->G, a->Aqk,
                                 a->Tm);
}
/* acc (CUDA only, KDA_ACC_* of kernels/kda/kda_cuda.h): dq, dk, dG flagged there are added to
 * what their arrays hold (a gradient slot written in place); the CPU references only overwrite,
 * so a CPU call with acc != 0 is refused. Same for kda_wy_bwd_io. */
typedef struct kda_intra_bwd_io {
    kda_qk_in qk;
    const void *beta, *G, *Tm, *dAqk, *dTm;
    void *dq, *dk, *dbeta, *dG;
    unsigned acc;
} kda_intra_bwd_io;
static inline dg_status kda_run_intra_bwd(dg_ctx *ctx, const kda_cfg *c,
                                          const kda_intra_bwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda) {
        const kda_cuda_dims cd = kda_qk_cd(c, &a->qk);
        return dg__kda_intra_bwd_cuda(ctx, &cd, (float)c->scale, a->qk.q, a->qk.k, a->beta, a->G,
                                      a->Tm, a->dAqk, a->dTm, a->dq, a->dk, a->dbeta, a->dG,
                                      a->acc);
    }
#endif
    if (a->acc)
        return dg__err(DG_ERR_STATE, "kda intra backward: accumulating outputs is CUDA-only");
    DG_TRY(kda_qk_cpu("kda intra backward", &a->qk));
    if (c->dt == DG_F64)
        return dg__kda_intra_bwd_f64(&c->d, c->scale, a->qk.q, a->qk.k, a->beta, a->G, a->Tm,
                                     a->dAqk, a->dTm, a->dq, a->dk, a->dbeta, a->dG);
    return dg__kda_intra_bwd_f32(&c->d, (float)c->scale, a->qk.q, a->qk.k, a->beta, a->G, a->Tm,
                                 a->dAqk, a->dTm, a->dq, a->dk, a->dbeta, a->dG);
}

/* N5. */
typedef struct kda_wy_fwd_io {
    kda_qk_in qk;
    const void *v, *beta, *G, *Tm;
    void *W, *U, *KG, *QG;
    int leaf_bf16; /* v is the op's bf16 input as stored (CUDA only; dg__kda_in_ptr) */
} kda_wy_fwd_io;
static inline dg_status kda_run_wy_fwd(dg_ctx *ctx, const kda_cfg *c, const kda_wy_fwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda) {
        kda_cuda_dims cd = kda_qk_cd(c, &a->qk);
        cd.leaf_bf16 = a->leaf_bf16;
        return dg__kda_wy_fwd_cuda(ctx, &cd, a->qk.q, a->qk.k, a->v, a->beta, a->G, a->Tm, a->W,
                                   a->U, a->KG, a->QG);
    }
#endif
    DG_TRY(kda_qk_cpu("kda wy forward", &a->qk));
    if (c->dt == DG_F64)
        return dg__kda_wy_fwd_f64(&c->d, a->qk.q, a->qk.k, a->v, a->beta, a->G, a->Tm, a->W, a->U,
                                  a->KG, a->QG);
    return dg__kda_wy_fwd_f32(&c->d, a->qk.q, a->qk.k, a->v, a->beta, a->G, a->Tm, a->W, a->U,
                              a->KG, a->QG);
}
typedef struct kda_wy_bwd_io {
    kda_qk_in qk;
    const void *v, *beta, *G, *Tm, *dW, *dU, *dKG, *dQG;
    void *dq, *dk, *dv, *dbeta, *dG, *dTm;
    unsigned acc;
    int leaf_bf16; /* v is the op's bf16 input as stored (CUDA only; dg__kda_in_ptr) */
} kda_wy_bwd_io;
static inline dg_status kda_run_wy_bwd(dg_ctx *ctx, const kda_cfg *c, const kda_wy_bwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda) {
        kda_cuda_dims cd = kda_qk_cd(c, &a->qk);
        cd.leaf_bf16 = a->leaf_bf16;
        return dg__kda_wy_bwd_cuda(ctx, &cd, a->qk.q, a->qk.k, a->v, a->beta, a->G, a->Tm, a->dW,
                                   a->dU, a->dKG, a->dQG, a->dq, a->dk, a->dv, a->dbeta, a->dG,
                                   a->dTm, a->acc);
    }
#endif
    if (a->acc)
        return dg__err(DG_ERR_STATE, "kda wy backward: accumulating outputs is CUDA-only");
    DG_TRY(kda_qk_cpu("kda wy backward", &a->qk));
    if (c->dt == DG_F64)
        return dg__kda_wy_bwd_f64(&c->d, a->qk.q, a->qk.k, a->v, a->beta, a->G, a->Tm, a->dW, a->dU,
                                  a->dKG, a->dQG, a->dq, a->dk, a->dv, a->dbeta, a->dG, a->dTm);
    return dg__kda_wy_bwd_f32(&c->d, a->qk.q, a->qk.k, a->v, a->beta, a->G, a->Tm, a->dW, a->dU,
                              a->dKG, a->dQG, a->dq, a->dk, a->dv, a->dbeta, a->dG, a->dTm);
}

/* N6. */
typedef struct kda_state_fwd_io {
    const void *W, *U, *KG, *G, *h0;
    void *h, *E, *ht;
} kda_state_fwd_io;
static inline dg_status kda_run_state_fwd(dg_ctx *ctx, const kda_cfg *c,
                                          const kda_state_fwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda)
        return dg__kda_state_fwd_cuda(ctx, &c->cd, a->W, a->U, a->KG, a->G, a->h0, a->h, a->E,
                                      a->ht);
#endif
    if (c->dt == DG_F64)
        return dg__kda_state_fwd_f64(&c->d, a->W, a->U, a->KG, a->G, a->h0, a->h, a->E, a->ht);
    return dg__kda_state_fwd_f32(&c->d, a->W, a->U, a->KG, a->G, a->h0, a->h, a->E, a->ht);
}
typedef struct kda_state_bwd_io {
    const void *W, *KG, *G, *h, *E, *dh, *dE, *dht;
    void *dW, *dU, *dKG, *dG, *dh0;
} kda_state_bwd_io;
/* The CPU references only: on CUDA the state node runs the backward in its two halves
 * (dg__kda_state_bwd_seq_cuda, dg__kda_state_bwd_rows_cuda; ops/kda/state.c). */
static inline dg_status kda_run_state_bwd(dg_ctx *ctx, const kda_cfg *c,
                                          const kda_state_bwd_io *a) {
    (void)ctx;
    if (c->cuda)
        return dg__err(DG_ERR_STATE, "kda state backward: CUDA runs the two halves (state.c)");
    if (c->dt == DG_F64)
        return dg__kda_state_bwd_f64(&c->d, a->W, a->KG, a->G, a->h, a->E, a->dh, a->dE, a->dht,
                                     a->dW, a->dU, a->dKG, a->dG, a->dh0);
    return dg__kda_state_bwd_f32(&c->d, a->W, a->KG, a->G, a->h, a->E, a->dh, a->dE, a->dht, a->dW,
                                 a->dU, a->dKG, a->dG, a->dh0);
}

/* N7 with scale c->scale. */
typedef struct kda_output_fwd_io {
    const void *QG, *h, *Aqk, *E;
    void *O;
    int leaf_bf16; /* O is the op's bf16 output, written as stored (CUDA only) */
} kda_output_fwd_io;
static inline dg_status kda_run_output_fwd(dg_ctx *ctx, const kda_cfg *c,
                                           const kda_output_fwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda) {
        kda_cuda_dims cd = c->cd;
        cd.leaf_bf16 = a->leaf_bf16;
        return dg__kda_output_fwd_cuda(ctx, &cd, (float)c->scale, a->QG, a->h, a->Aqk, a->E, a->O);
    }
#endif
    if (c->dt == DG_F64)
        dg__kda_output_fwd_f64(&c->d, c->scale, a->QG, a->h, a->Aqk, a->E, a->O);
    else
        dg__kda_output_fwd_f32(&c->d, (float)c->scale, a->QG, a->h, a->Aqk, a->E, a->O);
    return DG_OK;
}
typedef struct kda_output_bwd_io {
    const void *QG, *h, *Aqk, *E, *dO;
    void *dQG, *dh, *dAqk, *dE;
    int leaf_bf16; /* dO is the bf16 gradient of the op's output as stored (CUDA only) */
} kda_output_bwd_io;
static inline dg_status kda_run_output_bwd(dg_ctx *ctx, const kda_cfg *c,
                                           const kda_output_bwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda) {
        kda_cuda_dims cd = c->cd;
        cd.leaf_bf16 = a->leaf_bf16;
        return dg__kda_output_bwd_cuda(ctx, &cd, (float)c->scale, a->QG, a->h, a->Aqk, a->E, a->dO,
                                       a->dQG, a->dh, a->dAqk, a->dE);
    }
#endif
    if (c->dt == DG_F64)
        dg__kda_output_bwd_f64(&c->d, c->scale, a->QG, a->h, a->Aqk, a->E, a->dO, a->dQG, a->dh,
                               a->dAqk, a->dE);
    else
        dg__kda_output_bwd_f32(&c->d, (float)c->scale, a->QG, a->h, a->Aqk, a->E, a->dO, a->dQG,
                               a->dh, a->dAqk, a->dE);
    return DG_OK;
}

/* The recurrence (§11.1) with scale c->scale: q, k normalised, g the log decay, beta transformed.
 */
typedef struct kda_recurrent_fwd_io {
    const void *q, *k, *v, *g, *beta, *h0;
    void *o, *ht;
} kda_recurrent_fwd_io;
static inline dg_status kda_run_recurrent_fwd(dg_ctx *ctx, const kda_cfg *c,
                                              const kda_recurrent_fwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda)
        return dg__kda_recurrent_fwd_cuda(ctx, &c->cd, (float)c->scale, a->q, a->k, a->v, a->g,
                                          a->beta, a->h0, a->o, a->ht);
#endif
    if (c->dt == DG_F64)
        return dg__kda_recurrent_fwd_f64(&c->d, c->scale, a->q, a->k, a->v, a->g, a->beta, a->h0,
                                         a->o, a->ht);
    return dg__kda_recurrent_fwd_f32(&c->d, (float)c->scale, a->q, a->k, a->v, a->g, a->beta, a->h0,
                                     a->o, a->ht);
}
typedef struct kda_recurrent_bwd_io {
    const void *q, *k, *v, *g, *beta, *h0, *dO, *dht;
    void *dq, *dk, *dv, *dg, *dbeta, *dh0;
} kda_recurrent_bwd_io;
static inline dg_status kda_run_recurrent_bwd(dg_ctx *ctx, const kda_cfg *c,
                                              const kda_recurrent_bwd_io *a) {
#ifdef DG_HAVE_CUDA
    if (c->cuda)
        return dg__kda_recurrent_bwd_cuda(ctx, &c->cd, (float)c->scale, a->q, a->k, a->v, a->g,
                                          a->beta, a->h0, a->dO, a->dht, a->dq, a->dk, a->dv, a->dg,
                                          a->dbeta, a->dh0);
#endif
    if (c->dt == DG_F64)
        return dg__kda_recurrent_bwd_f64(&c->d, c->scale, a->q, a->k, a->v, a->g, a->beta, a->h0,
                                         a->dO, a->dht, a->dq, a->dk, a->dv, a->dg, a->dbeta,
                                         a->dh0);
    return dg__kda_recurrent_bwd_f32(&c->d, (float)c->scale, a->q, a->k, a->v, a->g, a->beta, a->h0,
                                     a->dO, a->dht, a->dq, a->dk, a->dv, a->dg, a->dbeta, a->dh0);
}

/* ---- the recompute group of the wy/state/output nodes (kda_group.c: the table) -------------
 * Members (nodes whose backward reads derived tensors), the group's inputs (what rebuilds them)
 * and the derived tensors. Shared by the nodes of one dg_kda_chunk / dg_kda_chunk_cp call; used
 * alone by dg_kda_state and dg_kda_output (their inputs kept). */
enum { KDA_M_STATE, KDA_M_LINK, KDA_M_OUTPUT, KDA_NMEMBERS };
enum {
    KDA_IN_Q,
    KDA_IN_K,
    KDA_IN_V,
    KDA_IN_BETA,
    KDA_IN_G,
    KDA_IN_TM,
    KDA_IN_H0,
    KDA_IN_RQ, /* the row scales of a factored q, k (NULL: none) */
    KDA_IN_RK,
    KDA_NINPUTS
};
enum { KDA_W, KDA_U, KDA_KG, KDA_QG, KDA_H, KDA_E, KDA_NDERIVED };

/* A group for an op call with cfg (tables copied, device tables shared). */
dg_status dg__kda_group_new(const kda_cfg *cfg, dg__group **out);
/* The device tables of the group's cfg (NULL on the CPU). */
kda_dev *dg__kda_group_dev(const dg__group *g);

/* Params block of every KDA node: the cfg (tables copied behind it), an optional recompute
 * group, and a few node-specific integers. */
typedef struct kda_np {
    kda_cfg cfg;
    dg__group *grp;
    int flags;
    int64_t tab[]; /* cfg.tab points here */
} kda_np;
/* Allocate the params of n from cfg (tables copied). grp may be NULL; a non-NULL grp is
 * retained and released when the node is destroyed. */
kda_np *dg__kda_np_new(dg_node *n, const kda_cfg *cfg, dg__group *grp);

/* ---- factored q, k ---------------------------------------------------------------------------
 * On CUDA the composite's in-op L2 norm of a bf16 q (and k) does not store the normalised rows:
 * its node outputs qn, a view of q's own storage, and rq = 1 / ||q|| per row [B,T,H] f32, and
 * qn stands for the normalised q = q rq, the factored form. The intra and WY nodes (and the
 * recompute group's rebuild of W, U, KG, QG) take qn with rq and form q rq in registers as
 * they read it -- bit for bit the product the norm would have stored -- so q is read in bf16
 * and never written as f32. The gradient the tape keeps for qn is that of the normalised q, in
 * f32 (what the intra and WY kernels add into), and the norm's backward turns it into q's
 * gradient from q and rq. rq itself is a constant to its readers: the norm's backward holds its
 * whole Jacobian. Only these nodes may see a factored tensor; it is never returned to a user.
 * dg__kda_l2norm_factored (ops/kda/l2norm.c) makes it where dg__kda_l2norm_factors says it
 * applies: CUDA, contiguous bf16 q and k, and the tensor-core path of both stages
 * (dg__kda_qk_fits). Elsewhere the norm stores f32 rows and rq, rk are NULL. */
int dg__kda_l2norm_factors(const kda_dev *dev, const dg_tensor *q, const dg_tensor *k);
/* defer: r is allocated and the node recorded, but r is filled by the intra kernel's prep (kda_prep
 * below); else the norm's own kernel computes it. */
dg_status dg__kda_l2norm_factored(dg_ctx *ctx, dg_tensor *x, int defer, dg_tensor **xn,
                                  dg_tensor **r);

/* ---- the forward prep ------------------------------------------------------------------------
 * Where q, k are factored and the gate input g is bf16 (dg__kda_prep_fits: contiguous, 16-byte
 * aligned, A_log and dt_bias f32 or absent, the tensor-core path of the intra stage), the
 * composite's intra kernel also computes, on behalf of their nodes, what the norm (N1: rq, rk)
 * and gate (N3: G) nodes would compute first (kernels/kda/kda_cuda.h, kda_intra_prep): those
 * nodes are recorded as always -- same inputs, outputs, saved tensors and backward -- with their
 * outputs allocated but not filled (defer = 1), and dg__kda_intra_x, given the kda_prep, fills
 * them before any other stage reads them. G and rq, rk follow the gate's and the norm's formulas,
 * evaluated and summed otherwise (f32 accuracy; kernels/kda/kda_cuda.h). One kernel reads q, k and
 * g once instead of three kernels reading them and the intra kernel reading q, k and G again. */
typedef struct kda_prep {
    dg_tensor *g, *A_log, *dt_bias; /* N3's inputs */
} kda_prep;
int dg__kda_prep_fits(const kda_dev *dev, const dg_kda_opts *opts, const dg_tensor *q,
                      const dg_tensor *k, const dg_tensor *g, const dg_tensor *A_log,
                      const dg_tensor *dt_bias);
/* q, k (and rq, rk, each NULL or the row scales of a factored q, k) of an intra or WY call as
 * the kernels read them: on CUDA contiguous bf16 q and k as stored (out->bf16 = 1), else in the
 * compute dtype (converted copies held in *tq, *tk, NULL where none was needed). */
dg_status dg__kda_qk_ptrs(dg_ctx *ctx, const kda_cfg *c, const dg_tensor *q, const dg_tensor *k,
                          const dg_tensor *rq, const dg_tensor *rk, dg_tensor **tq, dg_tensor **tk,
                          kda_qk_in *out);

/* ---- internal entry points used by the composite (the public ones pass NULL / 0) ------------
 * keep_f32: the output stays in the compute dtype (f32 on CUDA) instead of the input's dtype, so
 * that the composite keeps normalised q, k and beta in f32. share: device tables to reuse. rq,
 * rk: the row scales of a factored q, k (NULL: q, k are the normalised rows themselves). */
dg_status dg__kda_l2norm_x(dg_ctx *ctx, dg_tensor *x, int keep_f32, dg_tensor **y);
dg_status dg__kda_beta_x(dg_ctx *ctx, dg_tensor *b, int allow_neg_eigval, int keep_f32,
                         dg_tensor **beta);
/* defer: the forward prep above fills G (0: the gate's own kernel does). */
dg_status dg__kda_gate_x(dg_ctx *ctx, dg_tensor *g, dg_tensor *A_log, dg_tensor *dt_bias,
                         const dg_kda_opts *opts, kda_dev *share, int defer, dg_tensor **G);
dg_status dg__kda_intra_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *rq, dg_tensor *rk,
                          dg_tensor *beta, dg_tensor *G, const dg_kda_opts *opts, kda_dev *share,
                          const kda_prep *prep, dg_tensor **Aqk, dg_tensor **Tm);
dg_status dg__kda_wy_x(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *rq, dg_tensor *rk,
                       dg_tensor *v, dg_tensor *beta, dg_tensor *G, dg_tensor *Tm,
                       const dg_kda_opts *opts, kda_dev *share, dg_tensor **W, dg_tensor **U,
                       dg_tensor **KG, dg_tensor **QG);
/* grp: the composite's recompute group (NULL: the node makes its own). */
dg_status dg__kda_state_x(dg_ctx *ctx, dg_tensor *W, dg_tensor *U, dg_tensor *KG, dg_tensor *G,
                          dg_tensor *h0, const dg_kda_opts *opts, dg__group *grp, dg_tensor **h,
                          dg_tensor **E, dg_tensor **ht);
/* The local part of the chunked composite, N1..N5 (ops/kda/chunk.c), shared by dg_kda_chunk and
 * the context-parallel dg_kda_chunk_cp: normalised q, k (qn, kn; factored with rq, rk where those
 * are not NULL), beta (bt), G, Aqk, Tm, W, U, KG, QG, each an owned reference
 * (dg__kda_local_free releases them; on error nothing is held). */
typedef struct kda_local {
    dg_tensor *qn, *kn, *rq, *rk, *bt, *G, *Aqk, *Tm, *W, *U, *KG, *QG;
} kda_local;
dg_status dg__kda_local_stages(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *g,
                               dg_tensor *beta, dg_tensor *A_log, dg_tensor *dt_bias,
                               const dg_kda_opts *opts, kda_dev *dev, kda_local *l);
/* The recompute group of the wy/state/output nodes over l, from initial state h0: its inputs,
 * and W, U, KG, QG offered to it (kept when the policy of "kda_wy" is CACHE). */
dg_status dg__kda_local_group(const kda_cfg *cfg, const kda_local *l, dg_tensor *v, dg_tensor *h0,
                              dg__group **grp);
void dg__kda_local_free(kda_local *l);
/* out_dt: dtype of o (DG_NDTYPES: the compute dtype); o is computed in the compute dtype and
 * converted. */
/* grp as for dg__kda_state_x. */
dg_status dg__kda_output_x(dg_ctx *ctx, dg_tensor *QG, dg_tensor *h, dg_tensor *Aqk, dg_tensor *E,
                           const dg_kda_opts *opts, dg__group *grp, dg_dtype out_dt, dg_tensor **o);

#endif /* DG_OPS_KDA_H */

/*
 * ops/kda/kcp.c -- dg_kda_chunk_cp: chunked KDA over a context-parallel split (KCP; shared spec
 * KCP.md §3-4, generalised to uneven splits, an initial state and the final state).
 *
 * The state pass is affine in its initial state: over one piece of a sequence,
 *     h_out = M h_in + h_ext,      M = prod_c (Diag(exp lambda_c) - KG_c^T W_c)   (last chunk left)
 * and its backward is the transpose, dh_in = M^T dh_out + dh_ext. Each rank summarises one piece
 * per value head as [h_ext | M] ([HV, K, V+K], the compute dtype), all ranks exchange summaries
 * with one all_gather, and each rank chains the summaries of the earlier ranks into the true
 * initial state of its local sequence 0. Backward does the same in reverse with [dh_ext | M^T] of
 * the first local sequence, giving the gradient of the state that leaves the last local sequence.
 *
 * On the tape (stage nodes of dg_kda_chunk, plus two):
 *   N1..N5 as dg_kda_chunk          (local, no communication)
 *   summary + all_gather + merge    -> h0m [n_local,HV,K,V]   ("kda_cp_init": routes the
 *                                      gradient of h0m into the rows of the caller's h0)
 *   N6 state (h0 = h0m, ht always)  -> h, E, ht_loc
 *   "kda_cp_link": (h, E, ht_loc) -> (h', E', ht)   forward: h', E' alias h, E; ht puts ht_loc
 *                   into the global rows of sequences that end here. Backward (it runs after N7's
 *                   backward, before N6's): the reverse summary of the first local sequence from
 *                   N7's dh and dE, all_gather, merge into dht of the last local sequence.
 *   N7 output (h', E')              -> o
 * The dh0 that N6 produces for a local sequence 0 that started on an earlier rank is dropped: the
 * earlier ranks already received its content through the backward all_gather (KCP.md §4.3).
 * Both all_gathers send every rank's summary (the ones a rank does not need are zero or unused),
 * one collective each way, HV K (V+K) values per rank.
 * CUDA: the stages run on the device as in dg_kda_chunk. On the tensor-core path (bf16 inputs,
 * K % 16 == 0) each summary is two state passes on the device (summary_dev,
 * dg__kda_state_summary_cuda) and only the small [HV, K, V+K] result comes to the host; otherwise
 * W, U, KG, G and the upstream gradients are copied down and summarised by the loops below
 * (correct but slow). Merges and row moves run on host copies, and the MPI communicator carries
 * host buffers, so several processes can share one GPU. The CPU path runs the same code without
 * copies.
 */
#ifndef KDA_TMPL
#include "../../dist/dist.h"
#include "kda.h"
#define KDA_TMPL "kcp.c"
#include "kda_tmpl.h"
#endif

#ifdef KT
/* ---- reference ------------------------------------------------------------------------------ */

/* A = Diag(exp(lam)) - X^T Y over the L rows of chunk ch (X, Y rows of K at token stride HV*K):
 * A[a][b] = delta_ab exp(lam_a) - sum_i X[i][a] Y[i][b]. */
static void KF(kcp_chunk_mat)(const kda_dims *d, kda_chunk ch, int hv, const KT *X, const KT *Y,
                              const KT *lam, KT *A) {
    const int HV = d->HV, K = d->K;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++)
            A[a * K + b] = a == b ? KEXP(lam[a]) : (KT)0;
    for (int i = 0; i < ch.L; i++) {
        const int64_t ti = ch.t0 + i;
        const KT *x = X + (ti * HV + hv) * K, *y = Y + (ti * HV + hv) * K;
        for (int a = 0; a < K; a++)
            for (int b = 0; b < K; b++)
                A[a * K + b] -= x[a] * y[b];
    }
}

/* Y = A X for A [K,K], X [K,n] with row stride ldx; Y [K,n] (stride ldy), Y != X. */
static void KF(kcp_mm)(int K, int n, const KT *A, const KT *X, int ldx, KT *Y, int ldy) {
    for (int a = 0; a < K; a++) {
        KT *y = Y + (int64_t)a * ldy;
        for (int b = 0; b < n; b++)
            y[b] = 0;
        for (int c = 0; c < K; c++) {
            const KT s = A[a * K + c];
            const KT *x = X + (int64_t)c * ldx;
            for (int b = 0; b < n; b++)
                y[b] += s * x[b];
        }
    }
}

/* Forward summary of local sequence n, per value head: hm[hv] = [h_out | M] ([K, V+K]) with
 * h_out the state after the sequence's chunks starting from hin[hv] ([K,V]; NULL: zero). */
static dg_status KF(kcp_pre_fwd)(const kda_dims *d, int n, const KT *W, const KT *U, const KT *KG,
                                 const KT *G, const KT *hin, KT *hm) {
    const int HV = d->HV, K = d->K, V = d->V, C = V + K;
    const size_t per = (size_t)K * K + 2 * (size_t)K * C;
    KT *scr = (KT *)DG_MALLOC(sizeof(KT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kcp_pre_fwd: no memory");
    KDA_OMP(parallel for schedule(dynamic, 1) if (HV > 1))
    for (int hv = 0; hv < HV; hv++) {
        KT *A = scr + per * (size_t)kda_thread_id(), *S = A + K * K, *S2 = S + (size_t)K * C;
        /* S = [h | M], starts [hin | I] */
        for (int a = 0; a < K; a++)
            for (int b = 0; b < C; b++)
                S[a * C + b] =
                    b < V ? (hin ? hin[((int64_t)hv * K + a) * V + b] : (KT)0) : (KT)(b - V == a);
        for (int64_t c = 0; c < kda_nchunks(d, n); c++) {
            kda_chunk ch = kda_chunk_at(d, n, c);
            const KT *lam = G + ((ch.t0 + ch.L - 1) * HV + hv) * K;
            KF(kcp_chunk_mat)(d, ch, hv, KG, W, lam, A); /* A = Diag - KG^T W */
            KF(kcp_mm)(K, C, A, S, C, S2, C);            /* [h | M] <- A [h | M] */
            for (int i = 0; i < ch.L; i++) {             /* h += KG^T U */
                const int64_t ti = ch.t0 + i;
                const KT *kg = KG + (ti * HV + hv) * K, *u = U + (ti * HV + hv) * V;
                for (int a = 0; a < K; a++)
                    for (int b = 0; b < V; b++)
                        S2[a * C + b] += kg[a] * u[b];
            }
            KT *t = S;
            S = S2;
            S2 = t;
        }
        memcpy(hm + (int64_t)hv * K * C, S, sizeof(KT) * (size_t)K * C);
    }
    DG_FREE(scr);
    return DG_OK;
}

/* Backward summary of local sequence n, per value head: dhm[hv] = [dh_in | M^T] with dh_in the
 * gradient of the state entering the sequence given dh_out[hv] (NULL: zero) for the state that
 * leaves it, and the local upstream dh [NC,HV,K,V], dE [TT,HV,V] (either NULL: zero). */
static dg_status KF(kcp_pre_bwd)(const kda_dims *d, int n, const KT *W, const KT *KG, const KT *G,
                                 const KT *dh, const KT *dE, const KT *dhout, KT *dhm) {
    const int HV = d->HV, K = d->K, V = d->V, C = V + K;
    const size_t per = (size_t)K * K + 2 * (size_t)K * C;
    KT *scr = (KT *)DG_MALLOC(sizeof(KT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kcp_pre_bwd: no memory");
    KDA_OMP(parallel for schedule(dynamic, 1) if (HV > 1))
    for (int hv = 0; hv < HV; hv++) {
        KT *A = scr + per * (size_t)kda_thread_id(), *S = A + K * K, *S2 = S + (size_t)K * C;
        for (int a = 0; a < K; a++)
            for (int b = 0; b < C; b++)
                S[a * C + b] = b < V ? (dhout ? dhout[((int64_t)hv * K + a) * V + b] : (KT)0)
                                     : (KT)(b - V == a);
        for (int64_t c = kda_nchunks(d, n) - 1; c >= 0; c--) {
            kda_chunk ch = kda_chunk_at(d, n, c);
            const KT *lam = G + ((ch.t0 + ch.L - 1) * HV + hv) * K;
            KF(kcp_chunk_mat)(d, ch, hv, W, KG, lam, A); /* A^T = Diag - W^T KG */
            KF(kcp_mm)(K, C, A, S, C, S2, C);
            if (dE) /* dH -= W^T dE_loc */
                for (int i = 0; i < ch.L; i++) {
                    const int64_t ti = ch.t0 + i;
                    const KT *w = W + (ti * HV + hv) * K, *de = dE + (ti * HV + hv) * V;
                    for (int a = 0; a < K; a++)
                        for (int b = 0; b < V; b++)
                            S2[a * C + b] -= w[a] * de[b];
                }
            if (dh) { /* dH += dh_c (gradient of the state at the chunk's start) */
                const KT *dhc = dh + (ch.idx * HV + hv) * (int64_t)K * V;
                for (int a = 0; a < K; a++)
                    for (int b = 0; b < V; b++)
                        S2[a * C + b] += dhc[a * V + b];
            }
            KT *t = S;
            S = S2;
            S2 = t;
        }
        memcpy(dhm + (int64_t)hv * K * C, S, sizeof(KT) * (size_t)K * C);
    }
    DG_FREE(scr);
    return DG_OK;
}

/* Chain gathered summaries ag [world, HV, K, V+K]: x = 0; for each j in order: x = M_j x + x_j.
 * out [HV,K,V]. */
static dg_status KF(kcp_merge)(int HV, int K, int V, const KT *ag, const int *order, int n,
                               KT *out) {
    const int C = V + K;
    const int64_t per = (int64_t)HV * K * C;
    KT *rows = (KT *)DG_MALLOC(sizeof(KT) * (size_t)HV * K * V); /* x_new per head */
    if (!rows)
        return dg__err(DG_ERR_NOMEM, "kcp_merge: no memory");
    memset(out, 0, sizeof(KT) * (size_t)HV * K * V);
    for (int s = 0; s < n; s++) {
#pragma omp parallel for schedule(static) if (HV * (int64_t)K * K * V > 1 << 20)
        for (int hv = 0; hv < HV; hv++) {
            const KT *sm = ag + order[s] * per + (int64_t)hv * K * C;
            KT *x = out + (int64_t)hv * K * V, *row = rows + (int64_t)hv * K * V;
            for (int a = 0; a < K; a++) { /* row a of Sh + SM x, x walked row by row */
                KT *r = row + (int64_t)a * V;
                for (int b = 0; b < V; b++)
                    r[b] = sm[a * C + b];
                for (int c = 0; c < K; c++) {
                    const KT m = sm[a * C + V + c];
                    const KT *xc = x + (int64_t)c * V;
                    for (int b = 0; b < V; b++)
                        r[b] += m * xc[b];
                }
            }
            memcpy(x, row, sizeof(KT) * (size_t)K * V);
        }
    }
    DG_FREE(rows);
    return DG_OK;
}

#else
/* ---- nodes ---------------------------------------------------------------------------------- */

#define OP "dg_kda_chunk_cp"

/* Params of the two CP nodes: the local cfg (tables copied behind), the recompute group (the
 * link node reads W, KG through it), the communicator, the plan's numbers. */
typedef struct kcp_np {
    kda_cfg cfg;
    dg__group *grp;
    dg_comm *comm;
    int rank, world, pre, post, seq0, n_global;
    int64_t tab[];
} kcp_np;

static void kcp_np_free(void *params) {
    kcp_np *np = (kcp_np *)params;
    dg__group_release(&np->grp);
    dg__kda_dev_release(&np->cfg.dev);
}

static kcp_np *kcp_np_new(dg_node *n, const kda_cfg *cfg, dg__group *grp, dg_comm *comm,
                          const dg_cp_plan *p) {
    size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    kcp_np *np = (kcp_np *)dg__node_params(n, sizeof(kcp_np) + ntab * sizeof(int64_t));
    if (!np)
        return NULL;
    np->cfg = *cfg;
    memcpy(np->tab, cfg->tab, ntab * sizeof(int64_t));
    np->cfg.tab = np->tab;
    np->cfg.d.cu = np->tab;
    np->cfg.d.chunk_off = np->tab + cfg->d.N + 1;
    np->cfg.dev = dg__kda_dev_retain(cfg->dev);
    np->grp = dg__group_retain(grp);
    np->comm = comm;
    np->rank = p->rank;
    np->world = p->world;
    np->pre = p->pre_ranks;
    np->post = p->post_ranks;
    np->seq0 = p->seq0;
    np->n_global = p->n_seqs;
    n->params_free = kcp_np_free;
    return np;
}

/* Does local sequence i end on this rank (its final state is a row of ht)? */
static int ends_here(const kcp_np *np, int i) { return i < np->cfg.d.N - 1 || np->post == 0; }
/* Does local sequence i start on this rank (its initial state is a row of h0)? */
static int starts_here(const kcp_np *np, int i) { return i > 0 || np->pre == 0; }

static size_t kv_bytes(const kda_cfg *c) {
    return (size_t)c->d.HV * c->d.K * c->d.V * dg_dtype_size(c->dt);
}

/* ---- host staging: the summaries, merges and row moves run on host copies, so the same code
 * serves CPU tensors (no copy) and CUDA tensors (copied down and up; the local chunked work
 * stays on the device). ---- */

/* The context host tensors are made in: ctx itself on the CPU, else a new CPU context. */
static dg_status host_ctx(dg_ctx *ctx, dg_ctx **hc) {
    if (dg_ctx_device(ctx).kind == DG_DEV_CPU) {
        *hc = ctx;
        return DG_OK;
    }
    return dg_ctx_new(dg_cpu(), hc);
}

static void host_ctx_free(dg_ctx *ctx, dg_ctx **hc) {
    if (*hc && *hc != ctx)
        dg_ctx_free(hc);
    *hc = NULL;
}

/* t as a contiguous host tensor of dtype dt: t itself (retained) when it is one, else a copy.
 * Not recorded. */
static dg_status to_host(dg_ctx *hc, const dg_tensor *t, dg_dtype dt, dg_tensor **out) {
    *out = NULL;
    if (!t)
        return DG_OK;
    if (!dg__is_cuda(t) && t->dtype == dt && dg_tensor_is_contiguous(t)) {
        *out = dg_tensor_retain((dg_tensor *)t);
        return DG_OK;
    }
    DG_TRY(dg_tensor_new(hc, dt, t->ndim, t->shape, out));
    dg_status st = dg_tensor_copy_(*out, t);
    if (st != DG_OK)
        dg_tensor_free(out);
    return st;
}

/* Host tensor h on ctx's device: h itself (retained) on the CPU, else a copy. */
static dg_status to_dev(dg_ctx *ctx, dg_tensor *h, dg_tensor **out) {
    *out = NULL;
    if (dg_ctx_device(ctx).kind == DG_DEV_CPU) {
        *out = dg_tensor_retain(h);
        return DG_OK;
    }
    DG_TRY(dg_tensor_new(ctx, h->dtype, h->ndim, h->shape, out));
    dg_status st = dg_tensor_copy_(*out, h);
    if (st != DG_OK)
        dg_tensor_free(out);
    return st;
}

static const void *hptr(const dg_tensor *t) { return t ? dg_tensor_data(t) : NULL; }

/* The reference summaries and merge on host arrays of the compute dtype: the _f64 or _f32
 * function by c->dt (or dt). */
static dg_status run_pre_fwd(const kda_cfg *c, int n, const void *W, const void *U, const void *KG,
                             const void *G, const void *hin, void *hm) {
    if (c->dt == DG_F64)
        return kcp_pre_fwd_f64(&c->d, n, W, U, KG, G, hin, hm);
    return kcp_pre_fwd_f32(&c->d, n, W, U, KG, G, hin, hm);
}
static dg_status run_pre_bwd(const kda_cfg *c, int n, const void *W, const void *KG, const void *G,
                             const void *dh, const void *dE, const void *dhout, void *dhm) {
    if (c->dt == DG_F64)
        return kcp_pre_bwd_f64(&c->d, n, W, KG, G, dh, dE, dhout, dhm);
    return kcp_pre_bwd_f32(&c->d, n, W, KG, G, dh, dE, dhout, dhm);
}
static dg_status run_merge(dg_dtype dt, int HV, int K, int V, const void *ag, const int *order,
                           int n, void *out) {
    if (dt == DG_F64)
        return kcp_merge_f64(HV, K, V, ag, order, n, out);
    return kcp_merge_f32(HV, K, V, ag, order, n, out);
}

/* The summary of local sequence `seq` computed on the device (CUDA, tensor-core path: see
 * dg__kda_state_summary_cuda) into the host tensor dst [HV, K, V+K] ([Sh | SM] per value head).
 * A1, X0, A2, G, Sup, S0 are device tensors or pointers (S0, X0, Sup may be NULL). Returns
 * DG_ERR_UNSUPPORTED when the sizes need the host path. */
static dg_status summary_dev(dg_ctx *ctx, dg_ctx *hc, const kda_cfg *c, int seq, int bwd,
                             const dg_tensor *A1, const dg_tensor *X0, const dg_tensor *A2,
                             const dg_tensor *G, const dg_tensor *Sup, const void *S0,
                             dg_tensor *dst) {
#ifdef DG_HAVE_CUDA
    if (!c->cuda || !dg__kda_state_summary_fits(&c->cd))
        return DG_ERR_UNSUPPORTED;
    const int HV = c->d.HV, K = c->d.K, V = c->d.V;
    int64_t sh[3] = {HV, K, V}, smm[3] = {HV, K, K};
    /* converted copies (NULL where the tensor already has the dtype the kernel reads): A1, A2
     * and the forward's X0 (W, KG, U) in the intermediates' storage dtype, the rest f32 */
    dg_tensor *tA1 = NULL, *tX0 = NULL, *tA2 = NULL, *tG = NULL, *tSup = NULL;
    dg_tensor *dh = NULL, *dm = NULL, *hh = NULL, *hm = NULL;
    const void *pA1 = NULL, *pX0 = NULL, *pA2 = NULL, *pG = NULL, *pSup = NULL;
    dg_status st = DG_OK;
    if (A1)
        st = dg__kda_ptr(ctx, A1, c->mid, &tA1, &pA1);
    if (st == DG_OK && X0)
        st = dg__kda_ptr(ctx, X0, bwd ? DG_F32 : c->mid, &tX0, &pX0);
    if (st == DG_OK && A2)
        st = dg__kda_ptr(ctx, A2, c->mid, &tA2, &pA2);
    if (st == DG_OK && G)
        st = dg__kda_ptr(ctx, G, DG_F32, &tG, &pG);
    if (st == DG_OK && Sup)
        st = dg__kda_ptr(ctx, Sup, DG_F32, &tSup, &pSup);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 3, sh, &dh);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 3, smm, &dm);
    if (st == DG_OK && !bwd)
        dg__profile_forward(ctx, "kda_cp_summary_prep");
    if (st == DG_OK)
        st = dg__kda_state_summary_cuda(ctx, &c->cd, seq, bwd, pA1, pX0, pA2, pG, pSup, S0,
                                        dg_tensor_data(dh), dg_tensor_data(dm));
    if (st == DG_OK && !bwd)
        dg__profile_forward(ctx, "kda_cp_summary_kernels");
    if (st == DG_OK)
        st = to_host(hc, dh, c->dt, &hh);
    if (st == DG_OK)
        st = to_host(hc, dm, c->dt, &hm);
    if (st == DG_OK) { /* interleave [Sh | SM] row by row */
        const size_t es = dg_dtype_size(c->dt);
        char *o = (char *)dg_tensor_data(dst);
        const char *a = (const char *)dg_tensor_data(hh), *b = (const char *)dg_tensor_data(hm);
        for (int64_t r = 0; r < (int64_t)HV * K; r++) {
            memcpy(o + (size_t)r * (V + K) * es, a + (size_t)r * V * es, (size_t)V * es);
            memcpy(o + ((size_t)r * (V + K) + V) * es, b + (size_t)r * K * es, (size_t)K * es);
        }
    }
    dg_tensor *all[9] = {tA1, tX0, tA2, tG, tSup, dh, dm, hh, hm};
    for (int i = 0; i < 9; i++)
        dg_tensor_free(&all[i]);
    return st;
#else
    (void)ctx, (void)hc, (void)c, (void)seq, (void)bwd, (void)A1, (void)X0, (void)A2, (void)G;
    (void)Sup, (void)S0, (void)dst;
    return DG_ERR_UNSUPPORTED;
#endif
}

/* ---- kda_cp_init: h0m rows from the caller's h0 (backward only routes gradients) ---- */
static dg_status init_backward(dg_ctx *ctx, dg_node *n) {
    const kcp_np *np = (const kcp_np *)n->params;
    const dg_tensor *go = dg__node_grad_out(n, 0);
    if (!go || !dg__node_wants_grad(n, 0))
        return DG_OK;
    const kda_cfg *c = &np->cfg;
    dg_ctx *hc = NULL;
    dg_tensor *gh = NULL, *g0 = NULL, *g0d = NULL;
    int64_t s0[4] = {np->n_global, c->d.HV, c->d.K, c->d.V};
    const size_t row = kv_bytes(c);
    dg_status st = host_ctx(ctx, &hc);
    if (st == DG_OK)
        st = to_host(hc, go, c->dt, &gh);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, c->dt, 4, s0, &g0);
    for (int i = 0; i < c->d.N && st == DG_OK; i++)
        if (starts_here(np, i))
            memcpy((char *)dg_tensor_data(g0) + (size_t)(np->seq0 + i) * row,
                   (const char *)dg_tensor_data(gh) + (size_t)i * row, row);
    if (st == DG_OK)
        st = to_dev(ctx, g0, &g0d);
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, g0d);
    dg_tensor_free(&gh);
    dg_tensor_free(&g0);
    dg_tensor_free(&g0d);
    host_ctx_free(ctx, &hc);
    return st;
}

/* ---- kda_cp_link: (h, E, ht_loc) -> (h', E', ht) ---- */
static dg_status link_backward_body(dg_ctx *ctx, dg_node *n) {
    const kcp_np *np = (const kcp_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const int HV = c->d.HV, K = c->d.K, V = c->d.V, NL = c->d.N;
    /* the gradients of the outputs h', E', ht, and their host copies */
    const dg_tensor *gh = dg__node_grad_out(n, 0), *gE = dg__node_grad_out(n, 1);
    const dg_tensor *ght = dg__node_grad_out(n, 2);
    const size_t row = kv_bytes(c);
    dg_ctx *hc = NULL;
    dg_tensor *gh_h = NULL, *gE_h = NULL, *ght_h = NULL;
    dg_tensor *W = NULL, *KG = NULL, *wh = NULL, *kh = NULL, *gg = NULL;
    dg_tensor *dhm = NULL, *ag = NULL, *dhtl = NULL, *dhtd = NULL;
    int64_t sm[3] = {HV, K, V + K}, sa[4] = {np->world, HV, K, V + K};
    int64_t sl[4] = {NL, HV, K, V};
    dg_status st = host_ctx(ctx, &hc);
    if (st == DG_OK)
        st = to_host(hc, ght, c->dt, &ght_h);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, c->dt, 3, sm, &dhm);
    if (st == DG_OK)
        st = dg_tensor_new(hc, c->dt, 4, sa, &ag);
    if (st == DG_OK && np->pre > 0) { /* reverse summary of local sequence 0 */
        st = dg__group_get(np->grp, ctx, KDA_M_LINK, KDA_W, &W);
        if (st == DG_OK)
            st = dg__group_get(np->grp, ctx, KDA_M_LINK, KDA_KG, &KG);
        int on_dev = 0; /* on the device when the sizes allow (dg__kda_state_summary_cuda) */
        if (st == DG_OK && c->cuda) {
            const void *dhout = NULL; /* local sequence 0 ends here: its ht row's gradient */
            dg_tensor *gt = NULL;
            if (ends_here(np, 0) && ght)
                st = dg__kda_ptr(ctx, ght, DG_F32, &gt, &dhout);
            if (st == DG_OK && dhout)
                dhout = (const char *)dhout + (size_t)np->seq0 * HV * K * V * sizeof(float);
            if (st == DG_OK) {
                st = summary_dev(ctx, hc, c, 0, 1, KG, gE, W, n->saved[0], gh, dhout, dhm);
                on_dev = st == DG_OK;
                if (st == DG_ERR_UNSUPPORTED)
                    st = DG_OK;
            }
            dg_tensor_free(&gt);
        }
        if (!on_dev) { /* on host copies */
            if (st == DG_OK)
                st = to_host(hc, gh, c->dt, &gh_h);
            if (st == DG_OK)
                st = to_host(hc, gE, c->dt, &gE_h);
            if (st == DG_OK)
                st = to_host(hc, W, c->dt, &wh);
            if (st == DG_OK)
                st = to_host(hc, KG, c->dt, &kh);
            if (st == DG_OK)
                st = to_host(hc, n->saved[0], c->dt, &gg);
            const void *dhout = NULL;
            if (ends_here(np, 0) && ght_h)
                dhout = (const char *)dg_tensor_data(ght_h) + (size_t)np->seq0 * row;
            if (st == DG_OK)
                st = run_pre_bwd(c, 0, hptr(wh), hptr(kh), hptr(gg), hptr(gh_h), hptr(gE_h), dhout,
                                 dg_tensor_data(dhm));
        }
    }
    /* every rank joins the collective, whatever it has to send */
    if (st == DG_OK)
        st = dg_comm_all_gather(np->comm, dhm, ag);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, c->dt, 4, sl, &dhtl);
    for (int i = 0; i < NL && st == DG_OK; i++)
        if (ends_here(np, i) && ght_h)
            memcpy((char *)dg_tensor_data(dhtl) + (size_t)i * row,
                   (const char *)dg_tensor_data(ght_h) + (size_t)(np->seq0 + i) * row, row);
    if (st == DG_OK && np->post > 0) { /* farthest rank first */
        int order[64], *ord = np->post <= 64 ? order : (int *)DG_MALLOC(sizeof(int) * np->post);
        for (int s = 0; ord && s < np->post; s++)
            ord[s] = np->rank + np->post - s;
        if (!ord)
            st = dg__err(DG_ERR_NOMEM, OP ": backward: out of host memory");
        else
            st = run_merge(c->dt, HV, K, V, dg_tensor_data(ag), ord, np->post,
                           (void *)((char *)dg_tensor_data(dhtl) + (size_t)(NL - 1) * row));
        if (ord && ord != order)
            DG_FREE(ord);
    }
    if (st == DG_OK && gh && dg__node_wants_grad(n, 0)) /* h' aliases h */
        st = dg__node_accum(ctx, n, 0, (dg_tensor *)gh);
    if (st == DG_OK && gE && dg__node_wants_grad(n, 1)) /* E' aliases E */
        st = dg__node_accum(ctx, n, 1, (dg_tensor *)gE);
    if (st == DG_OK && dg__node_wants_grad(n, 2)) {
        st = to_dev(ctx, dhtl, &dhtd);
        if (st == DG_OK)
            st = dg__node_accum(ctx, n, 2, dhtd);
    }
    dg_tensor *locals[10] = {gh_h, gE_h, ght_h, wh, kh, gg, dhm, ag, dhtl, dhtd};
    for (int i = 0; i < 10; i++)
        dg_tensor_free(&locals[i]);
    host_ctx_free(ctx, &hc);
    return st;
}

static dg_status link_backward(dg_ctx *ctx, dg_node *n) {
    dg_status st = link_backward_body(ctx, n);
    dg__group_done(((const kcp_np *)n->params)->grp, KDA_M_LINK);
    return st;
}

/* A new tensor object sharing t's storage (not recorded). */
static dg_status alias(dg_tensor *t, dg_tensor **out) {
    dg_no_grad_begin();
    dg_status st = dg_reshape(t, t->ndim, t->shape, out);
    dg_no_grad_end();
    return st;
}

static dg_status check_plan(dg_comm *comm, const dg_cp_plan *plan, const dg_kda_opts *opts) {
    DG_TRY(dg__check_ptr(OP, "comm", comm));
    DG_TRY(dg__check_ptr(OP, "plan", plan));
    if (plan->world != dg_comm_size(comm) || plan->rank != dg_comm_rank(comm))
        return dg__err(DG_ERR_ARG, OP ": plan is for rank %d of %d but comm is rank %d of %d",
                       plan->rank, plan->world, dg_comm_rank(comm), dg_comm_size(comm));
    if (opts && opts->cu_seqlens)
        return dg__err(DG_ERR_ARG, OP ": opts->cu_seqlens must be NULL (the plan holds the "
                                      "sequences: build it with dg_cp_plan_new)");
    return DG_OK;
}

dg_status dg_kda_chunk_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *q,
                          dg_tensor *k, dg_tensor *v, dg_tensor *g, dg_tensor *beta,
                          dg_tensor *A_log, dg_tensor *dt_bias, dg_tensor *h0,
                          const dg_kda_opts *opts, dg_tensor **o, dg_tensor **ht) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "o", o));
    *o = NULL;
    if (ht)
        *ht = NULL;
    if (opts && opts->output_final_state && !ht)
        return dg__err(DG_ERR_ARG, OP ": opts->output_final_state is set but ht is NULL");
    DG_TRY(check_plan(comm, plan, opts));
    DG_TRY(dg__kda_check_first(OP, "q", q, ctx, 4, "1,T_r,H,K"));
    if (q->shape[0] != 1 || q->shape[1] != plan->end - plan->begin)
        return dg__err(DG_ERR_SHAPE,
                       OP ": q must be [1, %lld, H, K] (this rank's %lld tokens of the plan), "
                          "got %s",
                       (long long)(plan->end - plan->begin), (long long)(plan->end - plan->begin),
                       dg_tensor_desc(q));
    dg_kda_opts lo;
    memset(&lo, 0, sizeof lo);
    if (opts)
        lo = *opts;
    lo.cu_seqlens = plan->cu_local;
    lo.n_seqs = plan->n_local;
    lo.output_final_state = 0;
    kda_cfg cfg;
    DG_TRY(dg__kda_check_inputs(OP, ctx, q, k, v, g, beta, A_log, dt_bias, NULL, &lo, &cfg));
    const int want_ht = opts && opts->output_final_state;
    const int HV = cfg.d.HV, K = cfg.d.K, V = cfg.d.V, NL = cfg.d.N;
    int64_t s0[4] = {plan->n_seqs, HV, K, V}, sl[4] = {NL, HV, K, V};
    int64_t sm[3] = {HV, K, V + K}, sa[4] = {plan->world, HV, K, V + K};
    dg_status st = DG_OK;
    if (h0)
        st = dg__kda_check(OP, "h0", h0, ctx, cfg.m_f, 4, s0, "n_seqs,HV,K,V (global sequences)");
    if (st != DG_OK) {
        dg__kda_cfg_free(&cfg);
        return st;
    }

    dg_tensor *h = NULL, *E = NULL, *htl = NULL;
    dg_tensor *hm = NULL, *ag = NULL, *h0m = NULL, *h2 = NULL, *E2 = NULL, *htu = NULL;
    /* host copies */
    dg_tensor *Wh = NULL, *Uh = NULL, *KGh = NULL, *Gh = NULL, *h0h = NULL;
    dg_tensor *h0mh = NULL, *htlh = NULL, *htuh = NULL;
    const void *h0p = NULL; /* h0's host values (NULL without h0) */
    dg__group *grp = NULL;
    dg_ctx *hc = NULL;
    kcp_np probe; /* the plan's numbers, for ends_here / starts_here before a node exists */
    memset(&probe, 0, sizeof probe);
    probe.cfg = cfg;
    probe.pre = plan->pre_ranks;
    probe.post = plan->post_ranks;
    const size_t row = kv_bytes(&cfg);

    kda_local l;
    st = dg__kda_local_stages(ctx, q, k, v, g, beta, A_log, dt_bias, &lo, cfg.dev, &l);

    /* forward summary of the last local sequence, all_gather, merge into h0m */
    if (st == DG_OK)
        st = host_ctx(ctx, &hc);
    if (st == DG_OK) {
        st = to_host(hc, h0, cfg.dt, &h0h);
        h0p = hptr(h0h);
    }
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, cfg.dt, 3, sm, &hm);
    if (st == DG_OK)
        st = dg_tensor_new(hc, cfg.dt, 4, sa, &ag);
    if (st == DG_OK && plan->post_ranks > 0) {
        const int known = starts_here(&probe, NL - 1) && h0; /* its initial state is a row of h0 */
        int on_dev = 0; /* on the device when the sizes allow (dg__kda_state_summary_cuda) */
        if (cfg.cuda) {
            const void *hin = NULL;
            dg_tensor *ht0 = NULL;
            if (known)
                st = dg__kda_ptr(ctx, h0, DG_F32, &ht0, &hin);
            if (st == DG_OK && hin)
                hin =
                    (const char *)hin + (size_t)(plan->seq0 + NL - 1) * HV * K * V * sizeof(float);
            if (st == DG_OK) {
                st = summary_dev(ctx, hc, &cfg, NL - 1, 0, l.W, l.U, l.KG, l.G, NULL, hin, hm);
                on_dev = st == DG_OK;
                if (st == DG_ERR_UNSUPPORTED)
                    st = DG_OK;
            }
            dg_tensor_free(&ht0);
        }
        if (!on_dev) { /* on host copies */
            if (st == DG_OK)
                st = to_host(hc, l.W, cfg.dt, &Wh);
            if (st == DG_OK)
                st = to_host(hc, l.U, cfg.dt, &Uh);
            if (st == DG_OK)
                st = to_host(hc, l.KG, cfg.dt, &KGh);
            if (st == DG_OK)
                st = to_host(hc, l.G, cfg.dt, &Gh);
            const void *hin =
                known ? (const char *)h0p + (size_t)(plan->seq0 + NL - 1) * row : NULL;
            if (st == DG_OK)
                st = run_pre_fwd(&cfg, NL - 1, hptr(Wh), hptr(Uh), hptr(KGh), hptr(Gh), hin,
                                 dg_tensor_data(hm));
        }
    }
    dg__profile_forward(ctx, "kda_cp_summary"); /* the CP phases are timed apart */
    if (st == DG_OK)
        st = dg_comm_all_gather(comm, hm, ag);
    dg__profile_forward(ctx, "kda_cp_all_gather");
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, cfg.dt, 4, sl, &h0mh);
    for (int i = 0; i < NL && st == DG_OK && h0p; i++)
        if (starts_here(&probe, i))
            memcpy((char *)dg_tensor_data(h0mh) + (size_t)i * row,
                   (const char *)h0p + (size_t)(plan->seq0 + i) * row, row);
    if (st == DG_OK && plan->pre_ranks > 0) { /* oldest rank first */
        int order[64],
            *ord = plan->pre_ranks <= 64 ? order : (int *)DG_MALLOC(sizeof(int) * plan->pre_ranks);
        for (int s = 0; ord && s < plan->pre_ranks; s++)
            ord[s] = plan->rank - plan->pre_ranks + s;
        if (!ord)
            st = dg__err(DG_ERR_NOMEM, OP ": out of host memory");
        else
            st = run_merge(cfg.dt, HV, K, V, dg_tensor_data(ag), ord, plan->pre_ranks,
                           dg_tensor_data(h0mh));
        if (ord && ord != order)
            DG_FREE(ord);
    }
    if (st == DG_OK)
        st = to_dev(ctx, h0mh, &h0m);
    dg__profile_forward(ctx, "kda_cp_merge");
    if (st == DG_OK && h0 && dg__needs_grad(1, &h0)) {
        dg_node *n = NULL;
        st = dg__node_new("kda_cp_init", DG_POLICY_CACHE, init_backward, ctx, &n);
        if (st == DG_OK)
            st = dg__node_input(n, h0);
        if (st == DG_OK)
            st = dg__node_output(n, h0m);
        kcp_np *np = st == DG_OK ? kcp_np_new(n, &cfg, NULL, comm, plan) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    }

    /* the local state pass from h0m, then the link node, then the output */
    if (st == DG_OK)
        st = dg__kda_local_group(&cfg, &l, v, h0m, &grp);
    if (st == DG_OK)
        st = dg__kda_state_x(ctx, l.W, l.U, l.KG, l.G, h0m, &lo, grp, &h, &E, &htl);
    if (st == DG_OK)
        st = to_host(hc, htl, cfg.dt, &htlh);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, cfg.dt, 4, s0, &htuh);
    for (int i = 0; i < NL && st == DG_OK; i++)
        if (ends_here(&probe, i))
            memcpy((char *)dg_tensor_data(htuh) + (size_t)(plan->seq0 + i) * row,
                   (const char *)dg_tensor_data(htlh) + (size_t)i * row, row);
    if (st == DG_OK)
        st = to_dev(ctx, htuh, &htu);
    dg_tensor *lin[3] = {h, E, htl};
    if (st == DG_OK && dg__needs_grad(3, lin)) {
        st = alias(h, &h2);
        if (st == DG_OK)
            st = alias(E, &E2);
        dg_node *n = NULL;
        if (st == DG_OK)
            st = dg__node_new("kda_cp_link", DG_POLICY_CACHE, link_backward, ctx, &n);
        for (int i = 0; i < 3 && st == DG_OK; i++)
            st = dg__node_input(n, lin[i]);
        if (st == DG_OK)
            st = dg__node_output(n, h2);
        if (st == DG_OK)
            st = dg__node_output(n, E2);
        if (st == DG_OK)
            st = dg__node_output(n, htu);
        if (st == DG_OK)
            st = dg__node_save(n, l.G);
        if (st == DG_OK)
            st = dg__group_join(grp, KDA_M_LINK, n);
        kcp_np *np = st == DG_OK ? kcp_np_new(n, &cfg, grp, comm, plan) : NULL;
        if (st == DG_OK && !np)
            st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
        if (st == DG_OK)
            st = dg__node_commit(n);
        else if (n)
            dg__node_abort(n);
    } else if (st == DG_OK) {
        h2 = dg_tensor_retain(h);
        E2 = dg_tensor_retain(E);
    }
    if (st == DG_OK)
        st = dg__kda_output_x(ctx, l.QG, h2, l.Aqk, E2, &lo, grp, q->dtype, o);
    if (st == DG_OK && want_ht)
        *ht = dg_tensor_retain(htu);

    dg__group_release(&grp);
    dg__kda_local_free(&l);
    dg_tensor *locals[9] = {h, E, htl, hm, ag, h0m, h2, E2, htu};
    for (int i = 0; i < 9; i++)
        dg_tensor_free(&locals[i]);
    dg_tensor *staged[8] = {Wh, Uh, KGh, Gh, h0h, h0mh, htlh, htuh};
    for (int i = 0; i < 8; i++)
        dg_tensor_free(&staged[i]);
    host_ctx_free(ctx, &hc);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK) {
        dg_tensor_free(o);
        if (ht)
            dg_tensor_free(ht);
    }
    return st;
}
#endif

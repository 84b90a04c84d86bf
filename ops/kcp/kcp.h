/*
 * ops/kcp/kcp.h -- the op-independent part of context parallelism over a chunked state pass (KCP,
 * docs/distributed.md K1-K8), used by dg_kda_chunk_cp (ops/kda/kcp.c) and dg_dplr_chunk_cp
 * (ops/dplr/kcp.c).
 *
 * Both ops have a state pass that is affine in its initial state. Over one piece of a sequence,
 * per value head (h in R^{K x V}):
 *     h_out = M h_in + h_ext,     M = prod_c M_c (last chunk left),
 *     M_c = Diag(exp lam_c) + s X_c^T Y_c          (KDA: s = -1, X = KG, Y = W;
 *                                                   DPLR: s = +1, X = bg, Y = w)
 * and the backward is the transpose, dh_in = M^T dh_out + dh_ext. What differs between the ops is
 * only which tensors form M_c and which rank-one terms feed h_ext (the raw summary below takes
 * them as arguments) and which tensors the link node reads in backward (a callback). Shared:
 *   - the raw summary [h_ext | M] / [dh_ext | M^T] of one local sequence ([HV, K, V+K]) and the
 *     merge of gathered summaries (summary.c, f64 and f32);
 *   - the host staging of CUDA tensors (the summaries, merges and row moves run on host copies;
 *     the MPI communicator carries host buffers), and the summary of tensors on host copies
 *     (dg__kcp_summary_host: the op names X, Y, G and its terms);
 *   - the forward exchange: all_gather of the summaries, the initial states of the local
 *     sequences (h0 rows, and the chained summaries of the earlier ranks for local sequence 0),
 *     and the init node that routes their gradient back to h0 (kcp_nodes.c);
 *   - the link node between the op's state and output nodes: its backward builds the reverse
 *     summary of local sequence 0 (through the op's callback), all_gathers it and chains the
 *     later ranks' summaries into dht of the last local sequence.
 * The op keeps its own stage nodes, its recompute group (the link node is one of its members)
 * and the choice of tensors for its summaries (and KDA its device summaries); kcp_fwd carries
 * the rest of its forward (dg__kcp_fwd_begin .. dg__kcp_fwd_end).
 */
#ifndef DG_OPS_KCP_H
#define DG_OPS_KCP_H

#include "../kda/kda.h"

/* ---- raw summaries (summary.c) --------------------------------------------------------------
 * Arrays in the compute dtype, layouts of kda.h (tokens x HV heads). */

/* One rank-one-per-token term of the affine part: sum over the chunk's rows of A_i^T B_i
 * (A [TT,HV,K], B [TT,HV,V]) added to (neg: subtracted from) the state columns. */
typedef struct kcp_term {
    const void *A, *B;
    int neg;
} kcp_term;

/* The summary of local sequence `seq`, per value head: S = [S0 | I] ([K, V+K]; S0 [HV,K,V] or
 * NULL for zero), then for each chunk c of the sequence (in reverse order when `reverse`):
 *     S <- (Diag(exp lam_c) + s X_c^T Y_c) S       s = -1 when neg_xy, else +1
 *     S[:, :V] += (or -=) A_t^T B_t for each term t
 *     S[:, :V] += dh_c                              when dh ([NC,HV,K,V]) is given
 * with lam_c = G at the chunk's last row (G: the chunk-local cumulative log decay [TT,HV,K]).
 * out [HV, K, V+K]. Forward (distributed.md K3): S0 = the known initial state, out = [h_out | M].
 * Backward (distributed.md K4): pass X, Y swapped (M_c^T = Diag + s Y^T X), S0 = the gradient of
 * the state that leaves the sequence; out = [dh_in | M^T]. */
typedef struct kcp_summary_io {
    int seq, reverse;
    const void *X, *Y, *G;
    int neg_xy;
    int nterm;
    kcp_term term[2];
    const void *dh, *S0;
    void *out;
} kcp_summary_io;
dg_status dg__kcp_summary_f64(const kda_dims *d, const kcp_summary_io *io);
dg_status dg__kcp_summary_f32(const kda_dims *d, const kcp_summary_io *io);
/* Chain gathered summaries ag [world, HV, K, V+K]: x = 0; for s in 0..n-1: x = M_j x + x_j with
 * j = order[s]. out [HV, K, V] receives x. */
dg_status dg__kcp_merge_f64(int HV, int K, int V, const void *ag, const int *order, int n,
                            void *out);
dg_status dg__kcp_merge_f32(int HV, int K, int V, const void *ag, const int *order, int n,
                            void *out);
/* By dtype (DG_F64 or DG_F32). */
static inline dg_status dg__kcp_summary(dg_dtype dt, const kda_dims *d, const kcp_summary_io *io) {
    return dt == DG_F64 ? dg__kcp_summary_f64(d, io) : dg__kcp_summary_f32(d, io);
}

/* ---- host staging (kcp_nodes.c) ------------------------------------------------------------ */

/* The context host tensors are made in: ctx itself on the CPU, else a new CPU context. */
dg_status dg__kcp_host_ctx(dg_ctx *ctx, dg_ctx **hc);
void dg__kcp_host_ctx_free(dg_ctx *ctx, dg_ctx **hc);
/* t as a contiguous host tensor of dtype dt: t itself (retained) when it is one, else a copy
 * (*out = NULL for t = NULL). Not recorded. */
dg_status dg__kcp_to_host(dg_ctx *hc, const dg_tensor *t, dg_dtype dt, dg_tensor **out);
/* Host tensor h on ctx's device: h itself (retained) on the CPU, else a copy. */
dg_status dg__kcp_to_dev(dg_ctx *ctx, dg_tensor *h, dg_tensor **out);
static inline const void *dg__kcp_ptr(const dg_tensor *t) { return t ? dg_tensor_data(t) : NULL; }

/* kcp_summary_io with tensors of any device (NULL: absent) in place of host arrays: X, Y, G, the
 * terms' A and B and dh are brought to the host in cfg's compute dtype (dg__kcp_to_host); S0 is
 * already a host array (NULL: zero). */
typedef struct kcp_summary_args {
    int seq, reverse;
    const dg_tensor *X, *Y, *G;
    int neg_xy;
    int nterm;
    const dg_tensor *A[2], *B[2];
    int neg[2];
    const dg_tensor *dh;
    const void *S0;
} kcp_summary_args;
/* dg__kcp_summary of a on host copies into the host tensor out [HV, K, V+K]. */
dg_status dg__kcp_summary_host(dg_ctx *hc, const kda_cfg *cfg, const kcp_summary_args *a,
                               dg_tensor *out);
/* A summary computed on the device as its two halves, Sh [HV, K, V] and SM [HV, K, K] (f32
 * device tensors), into the host tensor out [HV, K, V+K] of cfg's compute dtype ([Sh | SM] per
 * row). */
dg_status dg__kcp_summary_from_dev(dg_ctx *hc, const kda_cfg *cfg, const dg_tensor *Sh,
                                   const dg_tensor *SM, dg_tensor *out);

/* ---- the op's description and the CP nodes' params ---- */

typedef struct kcp_np kcp_np;

typedef struct kcp_ops {
    const char *op;        /* the public entry point, in messages */
    const char *init_kind; /* op kinds of the two CP nodes ("kda_cp_init", "kda_cp_link") */
    const char *link_kind;
    const char *prof_all_gather; /* forward profile labels after the all_gather and the merge */
    const char *prof_merge;
    int link_member; /* the link node's member index in the op's recompute group */
    /* The reverse summary [dh_in | M^T] of local sequence 0 (distributed.md K4) into dhm (a zeroed
     * host tensor [HV, K, V+K] of the compute dtype), run by the link node's backward when local
     * sequence 0 started on an earlier rank. gh, gx: the upstream gradients of the state
     * pass's h and of its second output (KDA's E, DPLR's v2), either NULL (zero); ght: the
     * gradient of the op's global ht (NULL: zero) and ght_h its host copy (compute dtype). The
     * state leaving local sequence 0 is a row of ht when the sequence ends here
     * (dg__kcp_ends_here(np, 0)): row np->seq0. The link node saved the op's G (n->saved[0]). */
    dg_status (*bwd_summary)(dg_ctx *ctx, dg_ctx *hc, dg_node *n, const dg_tensor *gh,
                             const dg_tensor *gx, const dg_tensor *ght, const dg_tensor *ght_h,
                             dg_tensor *dhm);
} kcp_ops;

/* Params of the init and link nodes: the local cfg (tables copied behind), the recompute group
 * (link node), the communicator, the plan's numbers. */
struct kcp_np {
    kda_cfg cfg;
    dg__group *grp;
    dg_comm *comm;
    const kcp_ops *ops;
    int rank, world, pre, post, seq0, n_global;
    int64_t tab[];
};

/* Does local sequence i end on this rank (its final state is a row of ht)? */
static inline int dg__kcp_ends_here(const kcp_np *np, int i) {
    return i < np->cfg.d.N - 1 || np->post == 0;
}
/* Does local sequence i start on this rank (its initial state is a row of h0)? */
static inline int dg__kcp_starts_here(const kcp_np *np, int i) { return i > 0 || np->pre == 0; }
/* Bytes of one [HV, K, V] state in the compute dtype. */
static inline size_t dg__kcp_kv_bytes(const kda_cfg *c) {
    return (size_t)c->d.HV * c->d.K * c->d.V * dg_dtype_size(c->dt);
}
/* The plan's numbers for cfg, as the nodes hold them (grp, comm, ops unset): for
 * dg__kcp_ends_here / dg__kcp_starts_here before a node exists. */
kcp_np dg__kcp_probe(const kda_cfg *cfg, const dg_cp_plan *plan);

/* ---- checks ---- */

/* comm and plan given and of the same rank and world; cu_seqlens (the op's option) NULL. */
dg_status dg__kcp_check_plan(const char *op, dg_comm *comm, const dg_cp_plan *plan,
                             const int64_t *cu_seqlens);
/* The first activation input `arg` (dg__kda_check_first, 4 dims) is [1, T_r, ., .] with T_r
 * this rank's tokens of the plan; `names` spells the last two dims ("H,K"). */
dg_status dg__kcp_check_slice(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx,
                              const dg_cp_plan *plan, const char *names);
/* What every CP entry point checks first: ctx and o given (*o and, when given, *ht cleared), ht
 * given when output_final_state, the plan (dg__kcp_check_plan) and q as this rank's slice
 * (dg__kcp_check_slice, "H,K"). */
dg_status dg__kcp_check_entry(const char *op, dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan,
                              const dg_tensor *q, int output_final_state, const int64_t *cu_seqlens,
                              dg_tensor **o, dg_tensor **ht);
/* Row `row` of a host state tensor [rows, HV, K, V] of cfg's compute dtype (h0, the gradient of
 * ht), or NULL when the tensor is. */
static inline const void *dg__kcp_row(const kda_cfg *cfg, const dg_tensor *h, int64_t row) {
    return h ? (const char *)dg_tensor_data(h) + (size_t)row * dg__kcp_kv_bytes(cfg) : NULL;
}

/* h0 (when given) is [n_seqs, HV, K, V] over the plan's global sequences, of cfg's float dtype;
 * `names` spells the dims in messages. */
dg_status dg__kcp_check_h0(const char *op, dg_ctx *ctx, const kda_cfg *cfg, const dg_cp_plan *plan,
                           const dg_tensor *h0, const char *names);

/* ---- forward ---- */

/* The op-independent side of an op's forward: the host context, h0's host copy (NULL without
 * h0), the summary of the last local sequence hm (zeros, [HV, K, V+K], compute dtype, for the op
 * to fill), the plan's numbers, and what dg__kcp_fwd_exchange and dg__kcp_fwd_link make. */
typedef struct kcp_fwd {
    dg_ctx *hc;
    dg_comm *comm;
    const dg_cp_plan *plan;
    const kda_cfg *cfg;
    const kcp_ops *ops;
    dg_tensor *h0h, *hm;
    dg_tensor *h0m;           /* dg__kcp_fwd_exchange */
    dg_tensor *h2, *x2, *htu; /* dg__kcp_fwd_link */
    kcp_np probe;
} kcp_fwd;
/* f zeroed (for dg__kcp_fwd_end whatever happens), then the host context, h0h and hm. */
dg_status dg__kcp_fwd_begin(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const kda_cfg *cfg,
                            const kcp_ops *ops, const dg_tensor *h0, kcp_fwd *f);
/* dg__kcp_forward_exchange of f->hm into f->h0m. */
dg_status dg__kcp_fwd_exchange(dg_ctx *ctx, kcp_fwd *f, dg_tensor *h0);
/* dg__kcp_link of the op's state pass (h, x, htl) into f->h2, f->x2, f->htu. */
dg_status dg__kcp_fwd_link(dg_ctx *ctx, kcp_fwd *f, dg__group *grp, dg_tensor *G, dg_tensor *h,
                           dg_tensor *x, dg_tensor *htl);
/* Frees what f holds; when st is DG_OK and ht is given, *ht = the final states (f->htu).
 * Returns st. */
dg_status dg__kcp_fwd_end(dg_ctx *ctx, kcp_fwd *f, dg_status st, dg_tensor **ht);
/* Does the op summarise its last local sequence (it continues on later ranks), and the host row
 * of h0 that is that sequence's initial state (NULL: zero, or it started on an earlier rank)? */
static inline int dg__kcp_fwd_summarise(const kcp_fwd *f) { return f->probe.post > 0; }
static inline const void *dg__kcp_fwd_hin(const kda_cfg *cfg, const kcp_fwd *f) {
    const int last = cfg->d.N - 1;
    return dg__kcp_starts_here(&f->probe, last) ? dg__kcp_row(cfg, f->h0h, f->probe.seq0 + last)
                                                : NULL;
}

/* After the op has put the summary of its last local sequence into hm (host, [HV, K, V+K],
 * zeros when nothing continues on later ranks): one all_gather (every rank), then the initial
 * states h0m [NL, HV, K, V] on ctx's device: rows of h0 (h0_h: its host values
 * [n_seqs, HV, K, V], or NULL for none) for local sequences that start here, and for local
 * sequence 0 when it started earlier the summaries of ranks r-pre .. r-1 chained oldest first.
 * When h0 needs a gradient, records the init node (h0 -> h0m) that routes it back. */
dg_status dg__kcp_forward_exchange(dg_ctx *ctx, dg_ctx *hc, dg_comm *comm, const dg_cp_plan *plan,
                                   const kda_cfg *cfg, const kcp_ops *ops, dg_tensor *hm,
                                   dg_tensor *h0, const dg_tensor *h0_h, dg_tensor **h0m);
/* After the op's state pass (h, x, htl: its state at chunk starts, its second output, the final
 * states of the local sequences [NL, HV, K, V]): h2, x2 alias h, x (the output node reads them),
 * htu [n_seqs, HV, K, V] on ctx's device holds htl's rows of the sequences that end here, the
 * other rows zero. When any of h, x, htl needs a gradient, records the link node (saving G,
 * joining grp as ops->link_member): its backward runs between the output's and the state's. */
dg_status dg__kcp_link(dg_ctx *ctx, dg_ctx *hc, dg_comm *comm, const dg_cp_plan *plan,
                       const kda_cfg *cfg, const kcp_ops *ops, dg__group *grp, dg_tensor *G,
                       dg_tensor *h, dg_tensor *x, dg_tensor *htl, dg_tensor **h2, dg_tensor **x2,
                       dg_tensor **htu);

#endif /* DG_OPS_KCP_H */

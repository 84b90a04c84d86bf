/*
 * autograd/tape.h -- how an op records itself on the tape (library-internal).
 *
 * The pattern every differentiable op follows (see ops/elementwise.c for a complete one):
 *
 *     compute `out` ...
 *     if (dg__needs_grad(2, (dg_tensor *[]){a, b})) {
 *         dg_node *n;
 *         DG_TRY(dg__node_new("mul", DG_POLICY_CACHE, mul_backward, ctx, &n));
 *         dg__node_input(n, a);  dg__node_input(n, b);      // gradient destinations, in order
 *         dg__node_output(n, out);    // out now requires grad (out of memory: commit fails)
 *         dg__node_save(n, a);   dg__node_save(n, b);       // what backward reads
 *         my_params *p = dg__node_params(n, sizeof *p);      // plain data copied into the node
 *         DG_TRY(dg__node_commit(n));
 *     }
 *
 * and its backward:
 *
 *     static dg_status mul_backward(dg_ctx *ctx, dg_node *n) {
 *         const dg_tensor *gy = dg__node_grad_out(n, 0);     // never NULL when called
 *         if (dg__node_wants_grad(n, 0)) { ...compute ga...; DG_TRY(dg__node_accum(ctx, n, 0, ga));
 * }
 *         ...
 *     }
 *
 * dg__node_accum takes its own reference (or a copy); the caller still frees its tensor. A node's
 * backward must not modify its saved tensors or the output gradients.
 */
#ifndef DG_TAPE_INTERNAL_H
#define DG_TAPE_INTERNAL_H

#include "../tensor/tensor.h"

#define DG_NODE_MAX_IO 16
#define DG_NODE_MAX_SAVED 24

typedef struct dg_node dg_node;
typedef dg_status (*dg_backward_fn)(dg_ctx *ctx, dg_node *n);

struct dg_node {
    const char *op; /* static string: the op kind, also the key for per-op policy */
    dg_policy policy;
    dg_backward_fn backward;
    dg_ctx *ctx;
    int n_in;
    dg_gslot *in[DG_NODE_MAX_IO]; /* NULL where the input does not require grad */
    int n_out;
    dg_gslot *out[DG_NODE_MAX_IO];
    int n_saved;
    dg_tensor *saved[DG_NODE_MAX_SAVED];
    void *params;
    void (*params_free)(void *params); /* optional, for params that own memory */
    dg_status failed; /* DG_OK, or the error of a recording step that dg__node_commit returns */
};

/* Grad mode on and at least one of the tensors (NULL entries ignored) requires grad. */
int dg__needs_grad(int n, dg_tensor *const *ts);

/* A node whose policy is resolved from `op` and `default_policy` (dg_policy_resolve). */
dg_status dg__node_new(const char *op, dg_policy default_policy, dg_backward_fn bw, dg_ctx *ctx,
                       dg_node **out);
/* Inputs in order; an input that is NULL or needs no grad gets no gradient. Cannot fail. */
void dg__node_input(dg_node *n, dg_tensor *t);
/* Outputs in order; marks t as requiring grad (a fresh non-leaf slot). Fails only for want of
 * memory; the node remembers the failure, and dg__node_commit then destroys the node and returns
 * the same error, so a caller may check either this call or the commit. */
dg_status dg__node_output(dg_node *n, dg_tensor *t);
/* The same, with t's gradient accumulated in dtype grad_dt instead of t's own (a bf16
 * intermediate whose gradient keeps f32 precision). */
dg_status dg__node_output_as(dg_node *n, dg_tensor *t, dg_dtype grad_dt);
/* Keep a reference to t for backward (NULL allowed: kept as an empty entry). Cannot fail. */
void dg__node_save(dg_node *n, dg_tensor *t);
/* Drop n's last saved reference to t (a recompute group's kept tensor, freed after its last
 * reader in backward: autograd/group.h); the entry becomes NULL. */
void dg__node_unsave(dg_node *n, const dg_tensor *t);
/* Zeroed parameter block of `bytes`, owned by the node. */
void *dg__node_params(dg_node *n, size_t bytes);
/* Append to the active tape. On failure the node is destroyed. */
dg_status dg__node_commit(dg_node *n);
/* Copy `bytes` of plain parameters into the node, then commit; on failure (no memory for the
 * copy or the tape) the node is destroyed and the error names the node's op. */
dg_status dg__node_commit_params(dg_node *n, const void *params, size_t bytes);
/* Destroy a node that was never committed. */
void dg__node_abort(dg_node *n);

/* In backward: output i's gradient (NULL if nothing flowed into it: treat as zero). */
const dg_tensor *dg__node_grad_out(const dg_node *n, int i);
/* In backward: the node has read output i's gradient for the last time, so it is freed now
 * instead of when the node's backward returns (a backward that allocates more after reading it
 * lowers the peak this way). A leaf's or a retained gradient is kept. Pointers to it dangle. */
void dg__node_drop_grad_out(dg_node *n, int i);
/* Does input i need a gradient? */
int dg__node_wants_grad(const dg_node *n, int i);
/* grad(input i) += g. g must have input i's shape; its dtype is converted if needed. */
dg_status dg__node_accum(dg_ctx *ctx, dg_node *n, int i, dg_tensor *g);
/* The gradient already accumulated for input i when a backward may add to it in place (a kernel
 * that accumulates instead of a separate dg__node_accum): it exists, is contiguous and 16-byte
 * aligned, has dtype dt, nothing but the slot holds it and no other input of n shares the slot.
 * NULL otherwise (then use dg__node_accum). A bf16 leaf's gradient that several nodes add to is
 * f32 until its last reader has run (autograd/tape.c), so dt = DG_F32 finds it. */
dg_tensor *dg__node_grad_inplace(dg_node *n, int i, dg_dtype dt);

/* Accumulate into a slot directly (used by the tape and by gradcheck). */
dg_status dg__slot_accum(dg_ctx *ctx, dg_gslot *s, dg_tensor *g);

/* Multi-output backward: seed outs[i] with grads[i] (NULL = skip). */
dg_status dg__tape_backward_multi(dg_ctx *ctx, int n, dg_tensor *const *outs,
                                  const dg_tensor *const *grads);

/* Profiling hooks (autograd/profile.c); no-ops unless dg_profile_enable(1). */
void dg__profile_forward(dg_ctx *ctx, const char *op);
double dg__profile_begin(dg_ctx *ctx);
void dg__profile_backward(dg_ctx *ctx, const char *op, double t0);

#endif /* DG_TAPE_INTERNAL_H */

/*
 * tools/explain_kcp.h -- the sequence split over simulated ranks, shared by the KDA and DPLR walks
 * of `deltagrad explain` (tools/explain_kcp.c): the forward (summaries, merge, local state pass)
 * and the backward (reverse summaries, reverse merge, each rank's local backward) as
 * ops/kcp/kcp_nodes.c runs them, with every identity checked. What differs by op (the stages on
 * a slice, what feeds the summaries, the recurrence) the op gives as an ex_kcp.
 */
#ifndef DG_TOOLS_EXPLAIN_KCP_H
#define DG_TOOLS_EXPLAIN_KCP_H

#include "ops/kcp/kcp.h"
#include "tools/explain.h"
#include "tools/explain_kda.h"

/* One rank's slice [s0, s1) of the sequence: its dims (one sequence of Tr tokens) and the op's
 * n arrays for it. */
typedef struct ex_slice {
    int s0, s1, Tr;
    kda_dims d;
    int64_t tab[4];
    int n;
    double **a;
} ex_slice;

/* Enough ex_kcp_op.gname entries for every op's gradients. */
#define EX_KCP_MAXG 8
/* Values per token of a gradient: K, V or 1. */
enum { EX_PER_K, EX_PER_V, EX_PER_1 };

/* An op's side of the simulated ranks. Every callback gets x, the op's example; the int ones
 * return 0, or 2 after printing a message. */
typedef struct ex_kcp_op {
    int n;                /* arrays per slice */
    int i_o, i_ht, i_dh0; /* which of them hold o, the final state, dh0 */
    /* the sizes of the n arrays of slice l (its s0, s1, Tr and tab are set) */
    void (*sizes)(const void *x, const ex_slice *l, int64_t *sz);
    /* the stages before the state pass (no communication) */
    int (*stages)(const void *x, ex_slice *l);
    /* the state pass from hin, the output, and the output's backward from dO */
    int (*state_out)(const void *x, ex_slice *l, const double *hin);
    /* the backward of the rest, dht the gradient of the state leaving the slice */
    int (*backward)(const void *x, ex_slice *l, const double *dht);
    /* what feeds the slice's summary (reverse: the backward's); io is zeroed, out and S0 set */
    void (*summary)(const void *x, const ex_slice *l, int reverse, kcp_summary_io *io);
    /* the recurrence's state after token t, and its gradient there (t < T) */
    int (*rec_prefix)(const void *x, int t, double *S);
    int (*rec_suffix_dh)(const void *x, int t, double *dS); /* ex_rec_suffix_dh */
    /* print the slice's gradients */
    void (*print_grads)(const ex_run *r, const void *x, const ex_slice *l);
    /* the gradients compared with the one-rank backward: name, array, EX_PER_* */
    int ng;
    const char *gname[EX_KCP_MAXG];
    int gi[EX_KCP_MAXG], gper[EX_KCP_MAXG];
    /* what the walks print under their headings */
    const char *fwd_intro, *bwd_title, *bwd_intro;
} ex_kcp_op;

/* One example split over N ranks. */
typedef struct ex_kcp {
    const ex_kcp_op *op;
    const void *x;
    int N, T, BT, K, V;
    const double *h0, *dht; /* the initial state and the gradient of the final one */
    const double *o, *ht;   /* the unsplit pass's output [T, V] and final state [K, V] */
} ex_kcp;

/* The forward over the ranks: each rank's merged initial state against the recurrence, its
 * summary as the affine map of its state pass, o and the final state against the unsplit pass.
 * 0 or 2. */
int ex_kcp_forward(ex_run *r, const ex_kcp *k);
/* The backward over the ranks: the reverse merges against the recurrence's gradients, the
 * reverse summaries as affine maps and as transposes of the forward ones, every gradient against
 * the one-rank backward. 0 or 2. */
int ex_kcp_backward(ex_run *r, const ex_kcp *k);

/* The recurrence's state after the first t tokens (h0 [K, V] for t = 0) into S: rec runs the
 * op's recurrence on the first t tokens (dims d, output o [t, V]). 0, or 2 with a message. */
int ex_rec_prefix(const void *x, int t, int BT, int K, int V, const double *h0,
                  dg_status (*rec)(const void *x, const kda_dims *d, double *o, double *S),
                  double *S);

/* The recurrence's gradient of the state after token t (t < T), into dS [K, V]: dh0 of the
 * recurrent backward of tokens t..T-1 from the recurrence's state there (rec_prefix), run by
 * rec_bwd on those tokens (dims d) with the walk's dO and dht; g is scratch for the gradients of
 * its inputs ([n,K], [n,K], [n,V], [n,K], [n,K], [n,K] with n = T - t). 0, or 2 with a message. */
int ex_rec_suffix_dh(const void *x, int t, int T, int BT, int K, int V,
                     int (*rec_prefix)(const void *x, int t, double *S),
                     dg_status (*rec_bwd)(const void *x, const kda_dims *d, int t, const double *S,
                                          double *const *g, double *dS),
                     double *dS);

/* The state pass of a walk: prints the states h [NC, K, V] at the chunk starts and, chunk by
 * chunk, the pass's per-token values vals [T, V] (titled "chunk c: vname"); checks h against the
 * recurrence's states after tokens c BT (rec_prefix as in ex_kcp) and the final state ht against
 * the recurrence's htrec, then vals at every token t, column e against want(x, t, e, S) with S
 * the recurrence's state before t (the identity named want_name). 0 or 2. */
int ex_walk_states(ex_run *r, const void *x, int (*rec_prefix)(const void *x, int t, double *S),
                   int T, int BT, int K, int V, const double *h, const double *ht,
                   const double *htrec, const char *vname, const double *vals,
                   double (*want)(const void *x, int t, int e, const double *S),
                   const char *want_name);

#endif

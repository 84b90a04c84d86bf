/*
 * tools/explain_kda.h -- the KDA example of `deltagrad explain` (tools/explain_kda.c), shared
 * with the plots (tools/explain_plots.c): one sequence, one head, f64 arrays in the layouts of
 * ops/kda/kda.h.
 */
#ifndef DG_TOOLS_EXPLAIN_KDA_H
#define DG_TOOLS_EXPLAIN_KDA_H

#include "ops/kda/kda.h"
#include "tools/explain.h"

typedef struct kx {
    const ex_opts *o;
    int T, BT, K, V, NC;
    kda_dims d;
    int64_t tab[4];
    double scale, lb, A_log[1];
    dg_gate_kind gate;
    /* raw inputs: q, k before l2norm, v, beta's logit, the gate input, dt_bias [K], h0 = 0 */
    double *qr, *kr, *v, *braw, *x, *dt_bias, *h0;
    double *dO, *dht; /* upstream gradients of o and the final state (random) */
    /* the stages' outputs */
    double *q, *k, *rq, *rk, *beta, *g, *G, *Aqk, *Tm, *W, *U, *KG, *QG, *h, *E, *ht, *O;
    double *orec, *htrec; /* the recurrence */
} kx;

/* kda_dims of one sequence of T tokens, one head; tab holds its tables. */
void kx_dims(kda_dims *d, int64_t *tab, int T, int BT, int K, int V);
/* The seeded example (o's gate and strength, the given sizes). */
int kx_init(kx *x, const ex_opts *o, int T, int BT, int K, int V);
void kx_free(kx *x);
/* The chunked forward from the raw inputs, and the recurrence (orec, htrec): 0 or 2. */
int kx_forward(kx *x);
int kx_recurrent(kx *x);
/* Lkk of chunk c (L x L at row stride BT; zero on and above the diagonal) from its definition,
 * Lkk[i,j] = beta_i sum_d k_id k_jd exp(G_id - G_jd) for j < i (the tool's check of Tm). */
void kx_lkk(const kx *x, int c, double *A);

#endif

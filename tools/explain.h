/*
 * tools/explain.h -- shared by the files of `deltagrad explain`: the options, the printing of
 * compact matrices and identity lines, the finite-difference check, and the walks over the
 * stages of KDA (explain_kda.c) and DPLR (explain_dplr.c), their walks over simulated ranks
 * (explain_kcp.c) and the plots (explain_plots.c).
 *
 * Every walk runs the library's raw f64 stage functions (ops/kda/kda.h, ops/dplr/dplr.h,
 * ops/kcp/kcp.h) on one sequence with one head; the tool computes only the checks.
 */
#ifndef DG_TOOLS_EXPLAIN_H
#define DG_TOOLS_EXPLAIN_H

#include "deltagrad.h"

#include <stdint.h>
#include <stdio.h>

/* Residuals above this (f64) fail an identity: exit status 1. */
#define EX_TOL 1e-10

typedef struct ex_opts {
    int T, BT, K, V;
    dg_gate_kind gate; /* DG_GATE_KDA or DG_GATE_LOWERBOUND */
    double strength;   /* KDA: A_log = log(strength); LOWERBOUND: lb = -strength */
    uint64_t seed;
    const char *stage; /* NULL: every stage */
    int backward, dplr, cp;
    const char *plots; /* directory, or NULL */
} ex_opts;

/* The state of one walk: the options and how many identities were checked / failed. */
typedef struct ex_run {
    const ex_opts *o;
    int checks, failed;
    double worst;
} ex_run;

/* Is stage `name` shown (no --stage filter, or the filter names it)? */
int ex_shown(const ex_run *r, const char *name);
/* A section heading for stage `name` (printed only when shown). */
void ex_heading(const ex_run *r, const char *name, const char *title);
/* One identity: "  name: residual X (ok)" or "(NOT OK)" against EX_TOL. Printed when its stage
 * is shown, and always when it fails. */
void ex_check(ex_run *r, const char *stage, const char *name, double residual);

/* A matrix to print: rows x cols at row stride ld. */
typedef struct ex_mat {
    const char *title;
    const double *a;
    int rows, cols, ld;
} ex_mat;
/* Print up to 6 matrices side by side (rows aligned at the top), indented by two spaces. */
void ex_print(const ex_run *r, const char *stage, int n, const ex_mat *m);
/* Print n states [K,V] (array h [n,K,V]) as name[i], four to a row. */
void ex_print_states(const ex_run *r, const char *stage, const char *name, const double *h, int n,
                     int K, int V);

/* Chunk by chunk (chunks of BT of the T rows of K values): print the rows of a and b (titled
 * "chunk c: <na>" and nb) under stage, and return the largest error of the chunk-local cumsums
 * of g in incl (inclusive) and excl (exclusive); either may be NULL (not checked). */
double ex_chunk_cumsums(const ex_run *r, const char *stage, int T, int BT, int K, const char *na,
                        const double *a, const char *nb, const double *b, const double *g,
                        const double *incl, const double *excl);
/* Max |a - b| over n values, divided by max(1, max |b|). */
double ex_relres(const double *a, const double *b, int64_t n);

/* The gradient of f at x (n values, changed in place and restored) by central differences:
 * the 4-point difference D(h) = (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h at steps
 * h = 1e-3 max(1, |x_i|) and h/2, extrapolated (16 D(h/2) - D(h)) / 15 (error O(h^6)),
 * compared with g: returns ex_relres(g, fd). skip (optional, n flags) marks entries not
 * compared (the function does not read them). */
double ex_fdcheck(double (*f)(void *ctx), void *ctx, double *x, int64_t n, const double *g,
                  const unsigned char *skip);

/* Deterministic inputs: n normal values times scale. Caller frees. */
double *ex_randn(int64_t n, uint64_t seed, double scale);
double *ex_zeros(int64_t n);
/* sum a_i b_i */
double ex_dot(const double *a, const double *b, int64_t n);

/* The first line of a walk: "deltagrad explain<flag>: chunked <what> on one sequence, ..." with
 * the sizes and options of o. */
void ex_banner(const ex_opts *o, const char *flag, const char *what);
/* The last: how many identities were checked and failed. Returns 1 when one failed, else 0. */
int ex_summary(const ex_run *r);

/* The walks. Each returns 0 when every identity held, 1 when one failed, 2 on an error. */
int ex_kda(const ex_opts *o);
int ex_dplr(const ex_opts *o);
int ex_plots(const ex_opts *o);

/* The reference card of the chunked KDA stages (the card text of stage `name`, or NULL). */
const char *ex_card_text(const char *name);

#endif

/*
 * tests/case_table.h -- the machinery of the table-driven CUDA suites (test_kda_cuda.c,
 * test_dplr_cuda.c): a table of cases run through stages in several variants.
 *
 * Axes: the suite's stage, direction and variant names (ct_suite.axes). Stages from first_extra
 * on are extras: one row each, no direction. The last variant is "none" (checks of no variant).
 *
 * Filter: the command line after the mode: --list, --case C,..., --stage S,..., --variant V,...
 * and, where the suite filters by direction, --dir D,...; ct_sel() and ct_sel_x() say whether a
 * cell is wanted, ct_case_wanted() whether a case is.
 *
 * Tally: every check the harness makes is counted in the current cell (stage, direction, variant;
 * ct_cell), with the largest norm-relative error noted there (ct_note_err); ct_print_tally()
 * prints checks and errors per stage and variant.
 *
 * Layout: a case's rows, tokens, varlen tables and name (ct_layout_init, ct_name_add).
 *
 * Main: ct_main() is the suite's main(): --list prints the cases; cpu mode runs the cpu extras,
 * gpu mode every selected case and the gpu extras; the tally at the end.
 *
 * Ops: one entry point run through the tape on a context and compared against another run
 * (ct_op, ct_in, ct_res; ct_run_op, ct_compare, ct_gpu_vs_cpu).
 */
#ifndef DG_TEST_CASE_TABLE_H
#define DG_TEST_CASE_TABLE_H

#include "harness.h"

#include <stddef.h>
#include <stdint.h>

/* ---- axes, filter and tally ------------------------------------------------------------------ */

#define CT_MAXSTAGE 16
#define CT_MAXDIR 3
#define CT_MAXVAR 8

typedef struct ct_axes {
    const char *const *stage_name; /* nstage names; stages >= first_extra are extras */
    int nstage, first_extra;
    const char *const *dir_name; /* ndir names ("fwd", "bwd", ...) */
    int ndir;
    const char *const *var_name; /* nvar names, the last "none" */
    int nvar;
    int dir_filter; /* --dir accepted (the suite asks ct_sel() per direction) */
} ct_axes;

/* Stage s in direction dir of variant v selected? (The "none" variant: only without --variant.) */
int ct_sel(int s, int dir, int v);
/* The same for an extra, or a stage in any direction. */
int ct_sel_x(int s, int v);
/* Case idx named `name` selected by --case (a number, or text the name contains)? */
int ct_case_wanted(int idx, const char *name);

/* Counts the checks made since the last switch in the current cell, then switches to (s, dir, v).
 */
void ct_cell(int s, int dir, int v);
/* Notes a norm-relative error of the current cell (INFINITY: not finite). */
void ct_note_err(double rel);
/* Checks and the largest norm-relative error per stage and variant. */
void ct_print_tally(void);

/* ---- comparisons ----------------------------------------------------------------------------- */

/* Norm-relative error max|got - want| / max(max|want|, 1e-12) (the dg_check_rel metric; INFINITY
 * if a value is not finite). */
double ct_rel_err(const double *got, const double *want, int64_t n);
/* dg_check_rel, with the error noted in the current cell. */
void ct_check_rel(const char *name, const double *got, const double *want, int64_t n, double tol);
double ct_max_abs(const double *x, int64_t n);

/* ---- a case's layout ------------------------------------------------------------------------- */

#define CT_MAXSEQ 7

typedef struct ct_layout {
    int idx;
    char name[160];
    int64_t B, T, TT, NC; /* rows, tokens per row, all tokens, chunks */
    int N, nseq;          /* sequences; varlen sequences (0: B rows of T) */
    int64_t cu[CT_MAXSEQ + 1];
} ct_layout;

/* B rows of T tokens, or (nseq > 0) one row packing the sequences lens[0..nseq) (0 allowed);
 * chunk size BT, H heads. The name starts "varlen a/b/c" or "B=.. T=..", then " BT=.. H=..". */
void ct_layout_init(ct_layout *L, int idx, int64_t B, int64_t T, int nseq, const int64_t *lens,
                    int BT, int H);
/* Appends to L->name. */
void ct_name_add(ct_layout *L, const char *fmt, ...);

/* ---- the suite ------------------------------------------------------------------------------- */

typedef struct ct_suite {
    const char *name; /* "kda_cuda" */
    ct_axes axes;
    const char *const *group_name; /* the bits of a case's `runs` column */
    int ngroup;
    int ncases;
    /* Case i's layout (sizes, name) into *L; returns its groups. */
    unsigned (*layout)(int i, ct_layout *L);
    /* Case i through the groups and cells the filter selects. */
    void (*run)(dg_ctx *cpu, dg_ctx *gpu, int i);
    /* The extras tied to no case (left out with --case) of cpu and gpu mode; NULL: none. */
    void (*cpu_extras)(dg_ctx *cpu);
    void (*gpu_extras)(dg_ctx *gpu);
} ct_suite;

/* The suite's main(): parses the filter after the mode; --list prints the cases and the variants;
 * else dg_test_main() runs cpu mode (the cpu extras) or gpu mode (every selected case on CUDA
 * device 0, then the gpu extras), each ending with the tally. */
int ct_main(int argc, char **argv, const ct_suite *suite);
/* "-- case i: name (TT=.. N=.. NC=..; groups ..)", the line a case's checks follow. */
void ct_print_case(const ct_layout *L, unsigned runs);

/* ---- ops through the tape -------------------------------------------------------------------- */

#define CT_MAXIN 10
#define CT_MAXOUT 5

/* One entry point: `call` runs it on in[] (NULL: absent) into out[0..n_out). */
typedef struct ct_op {
    dg_status (*call)(dg_ctx *ctx, dg_tensor *const *in, dg_tensor **out, const void *user);
    const void *user;
    int n_out;
    const char *out_name[CT_MAXOUT];
    int first_only; /* seed only the first output (the others get no gradient) */
} ct_op;

/* The op calling `call` on `user`, its outputs named by the non-NULL names[0..CT_MAXOUT) less the
 * last `drop` (outputs not asked for). */
ct_op ct_op_of(dg_status (*call)(dg_ctx *, dg_tensor *const *, dg_tensor **, const void *),
               const void *user, const char *const *names, int drop, int first_only);

/* One input: NULL x = absent. f32: kept f32 on CUDA whatever the activation dtype. */
typedef struct ct_in {
    const char *name;
    int ndim;
    int64_t shape[5];
    const double *x;
    int f32;
} ct_in;

ct_in ct_mkin(const char *name, int ndim, const int64_t *shape, const double *x, int f32);

/* What one run produced, as host doubles; xin / seed: the values actually used (seed[j] NULL:
 * output j was not seeded). */
typedef struct ct_res {
    int n_in, n_out;
    double *out[CT_MAXOUT], *seed[CT_MAXOUT], *grad[CT_MAXIN], *xin[CT_MAXIN];
    int64_t nout[CT_MAXOUT], nin[CT_MAXIN];
    dg_dtype out_dt[CT_MAXOUT], grad_dt[CT_MAXIN];
} ct_res;

void ct_free_res(ct_res *r);

/* Forward in ctx, then backward seeded with `from`'s seeds (or fresh random ones from `seed`).
 * On CUDA the activation inputs get `act` and the f32 ones f32; on the CPU every input gets
 * `act` (f64 or f32). */
void ct_run_op(dg_ctx *ctx, dg_dtype act, const ct_op *op, int n_in, const ct_in *ins,
               const ct_res *from, uint64_t seed, ct_res *r);

/* Tolerances of one comparison: `tol` for every output and gradient, except input i's gradient
 * when itol[i] > 0 (norm-relative) or iatol[i] > 0 (absolute). */
typedef struct ct_tols {
    double tol, itol[CT_MAXIN], iatol[CT_MAXIN];
} ct_tols;

ct_tols ct_tols_all(double tol);

/* got vs want: every output (counted as stage s forward of variant v) and every input gradient
 * (backward; an extra row s counts both as one). */
void ct_compare(const char *label, const ct_op *op, const ct_in *ins, const ct_res *got,
                const ct_res *want, const ct_tols *t, int s, int v);

/* The op on CUDA (activations in `act`) against the CPU f64 op on the values the CUDA op used,
 * counted as stage s of variant v; the checks are named "<f32 |bf16> label". */
void ct_gpu_vs_cpu(dg_ctx *cpu, dg_ctx *gpu, const char *label, const ct_op *op, int n_in,
                   const ct_in *ins, dg_dtype act, uint64_t seed, const ct_tols *t, int s, int v);

#endif

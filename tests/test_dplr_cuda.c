/*
 * tests/test_dplr_cuda.c -- the CUDA path of DPLR (kernels/dplr/, dispatched from ops/dplr/),
 * table driven: every case of one table of shapes (dcases[] below) through the stages its `runs`
 * column names, in three variants, each against the CPU f64 reference.
 *
 * Stages (rows of the summary): gate (the chunk cumsums), intra, wy, state, output, recurrent
 * (the token recurrence) and chunk (dg_dplr_chunk), each forward (fwd: every output) and
 * backward (bwd: every gradient); extras: policy, errors, args.
 * Variants (columns of the summary):
 *   raw   the raw launchers (kernels/dplr/dplr_cuda.h) on f32 arrays against the raw CPU f64
 *         functions (ops/dplr/dplr.h) on the same values. Every device output is poisoned with
 *         NaN first, so an element a kernel forgets to write fails; the chunk-square inputs carry
 *         junk above the diagonal (a kernel reading outside the triangle it may read fails) and
 *         the upstream chunk-square gradients fill whole rows; optional inputs and outputs are
 *         also left out (NULL h0 / ht / dh0, NULL upstream gradients, wy outputs skipped).
 *         The state rows include the KCP summaries (dg__dplr_state_summary_cuda) against the
 *         shared f64 summary (ops/kcp/summary.c).
 *   f32   the entry points (dg_dplr_*) on CUDA through the tape with f32 tensors, against the
 *         CPU f64 op on the same values: forward values and the gradient of every input, the
 *         backward seeded with random output gradients (and, for the stage nodes and the
 *         composite, once more with only the first output seeded: NULL upstream gradients)
 *   bf16  the same with the leaf activations q, k, v, a, b, gk in bf16 (the intermediates and h0
 *         stay f32), against the CPU f64 op on the values the CUDA op used (the bf16 leaves, the
 *         f32-rounded intermediates, the bf16-rounded seeds of a bf16 output)
 * Groups (the `runs` column):
 *   GR  raw: every stage forward and backward, and the recurrence
 *   GS  f32, bf16: every stage node on its own (state under RECOMPUTE and CACHE), fed the
 *       intermediates the CPU f64 pipeline makes from the case's inputs (so the state chain stays
 *       a contraction)
 *   GC  f32, bf16: dg_dplr_chunk and dg_dplr_recurrent against the CPU f64 ops, CUDA chunked
 *       against CUDA recurrent (f32), and the output / gradient dtypes of a bf16 call
 *   GP  dg_dplr_chunk on CUDA under CACHE and RECOMPUTE (global and per op kind): bitwise equal
 *   GE  device, dtype and size errors of the entry points and the raw launchers (errors row)
 * Extra: args (cpu mode: argument checks of the raw launchers, no device touched).
 * Inputs (RWKV-7's stable form, as tests/test_dplr.c): q normal, k normal / sqrt(K), v normal,
 * a = -kh, b = alpha kh with kh unit-norm rows and alpha in (0.1, 0.9); gk uniform in
 * [-0.5, -0.01], logsigmoid(2x) of normal x, or RWKV-7's -e^{-1/2} sigmoid(x); h0 normal / 2;
 * upstream gradients normal. None is zero. The cases cover chunk sizes 16, 32, 64, K != V, K and
 * V not multiples of 32, T not a multiple of the chunk, B = 2, varlen packs with partial chunks
 * and empty sequences, T = 1, K = 256 (the largest state tile and recurrence registers) and
 * recurrences crossing checkpoint segments (150 tokens).
 * At the end: checks and the largest norm-relative error per stage and variant.
 *
 * Usage: test_dplr_cuda cpu|gpu [--list] [--case C,...] [--stage S,...] [--variant V,...]
 *   cpu mode runs the args extra only, gpu mode the rest (exit 77, skipped, without a device).
 *   C is a case number (as --list prints) or text the case name contains, S a stage or extra
 *   name, V a variant. A small run for compute-sanitizer, e.g.:
 *     compute-sanitizer --tool racecheck ./build-cuda/test_dplr_cuda gpu --case 1 --variant raw
 */
#include "case_table.h"
#include "harness.h"
#include "kda_testutil.h"
#include "ops/dplr/dplr.h"
#include "ops/kcp/kcp.h"

#include <stdarg.h>
#include <string.h>

#ifndef DG_HAVE_CUDA
/* Without CUDA there is nothing to run: gpu mode reports skipped, cpu mode is not registered. */
int main(int argc, char **argv) { return dg_test_main(argc, argv, "dplr_cuda", NULL, NULL); }
#else

/* ---- tolerances ------------------------------------------------------------------------------ */

/* f32 on CUDA against f64 (raw and ops): the kernels compute every product in f32 with f32
 * accumulation, over at most BT-long rows, K- or V-long dot products and a state chain of a few
 * chunks; the CPU f32 reference stays within ~2e-6 of f64 on such inputs (test_dplr), and the
 * kernels only sum in other orders. 1e-5 is the requirement on the CUDA path. */
#define TOL_F32 1e-5
/* CUDA chunked against CUDA recurrent (both f32): each is within TOL_F32 of the same f64 result. */
#define TOL_CHUNK_VS_REC 2e-5
/* bf16 leaves, f32 math: a result stored in bf16 once (o, the gradient of a leaf that one node
 * writes) is off by at most half a bf16 ulp, 2^-8 ~ 3.9e-3 of the largest element; f32 results
 * (the intermediates' gradients, ht, dh0) are far inside. */
#define TOL_BF16 5e-3

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

/* ---- stages, variants and directions (the axes of the tally, case_table.h) --------------------
 */

enum {
    S_GATE,
    S_INTRA,
    S_WY,
    S_STATE,
    S_OUTPUT,
    S_REC,
    S_CHUNK,
    S_POLICY,
    S_ERRORS,
    S_ARGS,
    NSTAGE
};
static const char *stage_name[NSTAGE] = {"gate",      "intra", "wy",     "state",  "output",
                                         "recurrent", "chunk", "policy", "errors", "args"};
enum { D_FWD, D_BWD, NDIR };
static const char *dir_name[NDIR] = {"fwd", "bwd"};
enum { V_RAW, V_F32, V_BF16, V_NONE, NVAR };
static const char *var_name[NVAR] = {"raw", "f32", "bf16", "none"};

/* check_rel measured against at least floor (for gradients that are sums of larger terms which
 * cancel: the f32 kernels round at the size of the terms, not of what is left). */
static void check_rel_floor(const char *name, const double *got, const double *want, int64_t n,
                            double floor, double tol) {
    double num = 0, den = floor;
    for (int64_t i = 0; i < n; i++) {
        num = isfinite(got[i]) && isfinite(want[i]) ? fmax(num, fabs(got[i] - want[i])) : INFINITY;
        den = fmax(den, fabs(want[i]));
    }
    const double e = num / den;
    dg_check(e <= tol, "%s n=%lld rel err=%.3e (floor %.3e, tol %g)", name, (long long)n, e, floor,
             tol);
    ct_note_err(e);
}

/* ---- the cases ------------------------------------------------------------------------------- */

enum { GR = 1, GS = 2, GC = 4, GP = 8, GE = 16 };
enum { G_UNIFORM, G_LOGSIG, G_RWKV7 }; /* gk ranges (see the header; kt_dplr_abg's gate) */

typedef struct dcase {
    int64_t B, T;    /* rows and tokens per row; varlen (nseq > 0): B = 1, T = sum of lens */
    int H, K, V, BT; /* heads, key dim, value dim, chunk size */
    int nseq;        /* varlen: sequences in lens (0 may appear: an empty sequence) */
    int64_t lens[6];
    int h0;   /* a random h0 (else none) */
    int gate; /* G_UNIFORM, G_LOGSIG, G_RWKV7 */
    unsigned runs;
    uint64_t seed;
} dcase;

/* clang-format off */
static const dcase dcases[] = {
    /* B    T  H    K    V  BT  nseq lens                  h0 gate       runs            seed */
    {  2, 100, 2,  64,  64, 64, 0, {0},                     1, G_RWKV7,   GR|GS|GC|GP,    1000},
    {  2,  75, 1,  32,  48, 16, 0, {0},                     0, G_UNIFORM, GR|GS|GC,       2000},
    {  1,   0, 2,  64,  32, 32, 3, {37, 64, 91},            1, G_LOGSIG,  GR|GS|GC|GP,    3000},
    /* empty sequences, and a sequence of one token */
    {  1,   0, 2,  16,  24, 16, 5, {0, 17, 0, 64, 1},       1, G_UNIFORM, GR|GS|GC,       4000},
    /* 150 tokens: three checkpoint segments of the recurrence backward; an empty sequence */
    {  1,   0, 1, 128,  64, 64, 4, {1, 0, 150, 20},         1, G_RWKV7,   GR|GC,          5000},
    /* K, V not multiples of 32 */
    {  1, 130, 2,  40,  20, 32, 0, {0},                     1, G_UNIFORM, GR|GS|GC,       6000},
    {  1,   1, 1,   8,   8, 16, 0, {0},                     1, G_RWKV7,   GR|GC,          7000},
    /* K = 256: the largest state tile (65 KB of shared memory) and recurrence registers */
    {  1,  70, 1, 256, 128, 64, 0, {0},                     1, G_RWKV7,   GR|GS|GC,       8000},
    {  2,  45, 2,  16,  16, 16, 0, {0},                     1, G_UNIFORM, GE,              900},
};
/* clang-format on */

/* A case resolved: sizes, varlen tables, a name. */
typedef struct crun {
    const dcase *c;
    ct_layout L;
} crun;

/* Case idx resolved: sizes, varlen tables and name; returns its groups. */
static unsigned case_layout(int idx, ct_layout *L) {
    const dcase *c = &dcases[idx];
    ct_layout_init(L, idx, c->B, c->T, c->nseq, c->lens, c->BT, c->H);
    if (c->K == c->V)
        ct_name_add(L, " K=V=%d", c->K);
    else
        ct_name_add(L, " K=%d V=%d", c->K, c->V);
    ct_name_add(L, "%s %s", c->h0 ? " h0" : "",
                c->gate == G_UNIFORM  ? "gk uniform"
                : c->gate == G_LOGSIG ? "gk logsigmoid"
                                      : "gk rwkv7");
    return c->runs;
}

static dg_dplr_opts opts_of(const crun *r) {
    dg_dplr_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = r->c->BT;
    o.cu_seqlens = r->c->nseq ? r->L.cu : NULL;
    o.n_seqs = r->c->nseq;
    return o;
}

/* ---- the data: leaves and the CPU f64 pipeline's intermediates ------------------------------- */

enum { IQ, IK, IV, IA, IB, IG, IH0, NLEAF };
static const char *leaf_name[NLEAF] = {"q", "k", "v", "a", "b", "gk", "h0"};

typedef struct ddata {
    double *x[NLEAF]; /* q k v a b gk h0 (h0 NULL without) */
    double *Gi, *Ge, *Aqk, *Aqb, *Aak, *Tab, *w, *u, *qg, *kg, *bg, *h, *v2;
    int64_t sk[4], sv[4], sa[4], s0[4], sh[5];
    int64_t nk, nv, na, n0, nh;
} ddata;

static int64_t numel(int ndim, const int64_t *s) { return kt_numel(ndim, s); }

static double *host_of(const dg_tensor *t) { return kt_host(t, dg_tensor_numel(t)); }

static void make_data(dg_ctx *cpu, const crun *r, uint64_t seed, ddata *d) {
    memset(d, 0, sizeof *d);
    const dcase *c = r->c;
    const int64_t B = r->L.B, T = r->L.T, N = r->L.N, H = c->H, K = c->K, V = c->V;
    const int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, sa[4] = {B, T, H, c->BT};
    const int64_t s0[4] = {N, H, K, V}, sh[5] = {B, r->L.NC / B, H, K, V};
    memcpy(d->sk, sk, sizeof sk);
    memcpy(d->sv, sv, sizeof sv);
    memcpy(d->sa, sa, sizeof sa);
    memcpy(d->s0, s0, sizeof s0);
    memcpy(d->sh, sh, sizeof sh);
    d->nk = numel(4, sk);
    d->nv = numel(4, sv);
    d->na = numel(4, sa);
    d->n0 = numel(4, s0);
    d->nh = numel(5, sh);
    const int64_t nk = d->nk, rows = nk / K;
    d->x[IQ] = kt_randn(nk, seed + 1, 1.0);
    d->x[IK] = kt_randn(nk, seed + 2, 1.0 / sqrt((double)K));
    d->x[IV] = kt_randn(d->nv, seed + 3, 1.0);
    kt_dplr_abg(rows, (int)K, seed + 4, c->gate, &d->x[IA], &d->x[IB], &d->x[IG]);
    if (c->h0)
        d->x[IH0] = kt_randn(d->n0, seed + 7, 0.5);

    /* the intermediates, from the CPU f64 stage ops (no tape: nothing requires grad) */
    dg_tensor *t[NLEAF] = {0};
    for (int i = 0; i < NLEAF; i++)
        t[i] = kt_tensor(cpu, DG_F64, 4, i == IV ? sv : i == IH0 ? s0 : sk, d->x[i], 0);
    dg_dplr_opts o = opts_of(r);
    dg_tensor *Gi = NULL, *Ge = NULL, *Aqk = NULL, *Aqb = NULL, *Aak = NULL, *Tab = NULL;
    dg_tensor *w = NULL, *u = NULL, *qg = NULL, *kg = NULL, *bg = NULL, *h = NULL, *v2 = NULL;
    DG_TEST_TRY(dg_dplr_gate_cumsum(cpu, t[IG], &o, &Gi, &Ge));
    DG_TEST_TRY(dg_dplr_intra(cpu, t[IQ], t[IK], t[IA], t[IB], Gi, Ge, &o, &Aqk, &Aqb, &Aak, &Tab));
    DG_TEST_TRY(dg_dplr_wy(cpu, t[IQ], t[IK], t[IV], t[IA], t[IB], Gi, Ge, Aak, Tab, &o, &w, &u,
                           &qg, &kg, &bg));
    DG_TEST_TRY(dg_dplr_state(cpu, w, u, kg, bg, t[IV], Gi, t[IH0], &o, &h, &v2, NULL));
    d->Gi = host_of(Gi);
    d->Ge = host_of(Ge);
    d->Aqk = host_of(Aqk);
    d->Aqb = host_of(Aqb);
    d->Aak = host_of(Aak);
    d->Tab = host_of(Tab);
    d->w = host_of(w);
    d->u = host_of(u);
    d->qg = host_of(qg);
    d->kg = host_of(kg);
    d->bg = host_of(bg);
    d->h = host_of(h);
    d->v2 = host_of(v2);
    dg_tensor *all[13] = {Gi, Ge, Aqk, Aqb, Aak, Tab, w, u, qg, kg, bg, h, v2};
    for (int i = 0; i < 13; i++)
        dg_tensor_free(&all[i]);
    for (int i = 0; i < NLEAF; i++)
        dg_tensor_free(&t[i]);
}

static void free_data(ddata *d) {
    for (int i = 0; i < NLEAF; i++)
        free(d->x[i]);
    double *all[13] = {d->Gi, d->Ge, d->Aqk, d->Aqb, d->Aak, d->Tab, d->w,
                       d->u,  d->qg, d->kg,  d->bg,  d->h,   d->v2};
    for (int i = 0; i < 13; i++)
        free(all[i]);
}

/* ---- group GR: the raw launchers ------------------------------------------------------------- */

/* One raw array: the host values (rounded to f32, what the device holds) and the device copy. */
typedef struct rarr {
    double *h;
    dg_tensor *t;
    int64_t n;
} rarr;

#define RMAX 96
typedef struct rset {
    rarr a[RMAX];
    int n;
} rset;

/* An input: x rounded to f32, uploaded. */
static rarr *rin(rset *s, dg_ctx *gpu, const double *x, int64_t n) {
    if (s->n >= RMAX) {
        fprintf(stderr, "FATAL: raw: more than %d arrays\n", RMAX);
        exit(1);
    }
    rarr *r = &s->a[s->n++];
    r->n = n;
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_F32, 1, &n, x, &r->t));
    r->h = host_of(r->t);
    return r;
}
/* An output: a device array poisoned with NaN (h: the host buffer of the reference). */
static rarr *rout(rset *s, dg_ctx *gpu, int64_t n) {
    if (s->n >= RMAX) {
        fprintf(stderr, "FATAL: raw: more than %d arrays\n", RMAX);
        exit(1);
    }
    rarr *r = &s->a[s->n++];
    r->n = n;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F32, 1, &n, &r->t));
    DG_TEST_TRY(dg_tensor_fill_(r->t, NAN));
    r->h = kt_alloc(n);
    return r;
}
static void rset_free(rset *s) {
    for (int i = 0; i < s->n; i++) {
        dg_tensor_free(&s->a[i].t);
        free(s->a[i].h);
    }
    s->n = 0;
}
/* Device pointer / host pointer of an optional array. */
static float *D(const rarr *r) { return r ? (float *)dg_tensor_data(r->t) : NULL; }
static double *Hh(const rarr *r) { return r ? r->h : NULL; }

/* The device result of `got` against the host reference in its h. */
static void rcmp(const char *cname, const char *what, const rarr *got) {
    double *g = host_of(got->t);
    char name[256];
    snprintf(name, sizeof name, "raw %s | %s", cname, what);
    ct_check_rel(name, g, got->h, got->n, TOL_F32);
    free(g);
}

/* A copy of a per-chunk matrix [TT,H,BT] with junk above the diagonal (never to be read). */
static double *junk_upper(const kda_dims *d, const double *M) {
    const int64_t n = d->B * d->T * d->H * d->BT;
    double *t = kt_alloc(n);
    memcpy(t, M, sizeof(double) * (size_t)n);
    for (int sq = 0; sq < d->N; sq++)
        for (int64_t c = 0; c < kda_nchunks(d, sq); c++) {
            const kda_chunk ch = kda_chunk_at(d, sq, c);
            for (int i = 0; i < ch.L; i++)
                for (int hh = 0; hh < d->H; hh++)
                    for (int j = i + 1; j < d->BT; j++)
                        t[((ch.t0 + i) * d->H + hh) * d->BT + j] = 1e3 + j;
        }
    return t;
}

static void raw_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r, const ddata *d) {
    const dcase *c = r->c;
    const char *cn = r->L.name;
    dg_dplr_opts opts = opts_of(r);
    kda_cfg cfg;
    DG_TEST_TRY(dg__dplr_cfg_init("test_dplr_cuda", cpu, &opts, r->L.B, r->L.T, c->H, c->K, c->V,
                                  DG_F64, &cfg));
    kda_cuda_dims dd;
    DG_TEST_TRY(dg__kda_cuda_dims_new(gpu, r->L.TT, c->H, c->H, c->K, c->V, c->BT, cfg.d.N,
                                      cfg.d.cu, cfg.d.chunk_off, &dd));
    const kda_dims *hd = &cfg.d;
    const double s = cfg.scale;
    const float fs = (float)s;
    const int64_t nk = d->nk, nv = d->nv, na = d->na, n0 = d->n0, nh = d->nh;
    const uint64_t sd = c->seed + 500;
    double *AqkJ = junk_upper(hd, d->Aqk), *AqbJ = junk_upper(hd, d->Aqb);
    double *AakJ = junk_upper(hd, d->Aak), *TabJ = junk_upper(hd, d->Tab);
    double *up[8];
    for (int i = 0; i < 8; i++) /* upstream gradients, whole rows of the chunk-square ones */
        up[i] = kt_randn(i < 4 ? na : i < 6 ? nk : i < 7 ? nv : nh, sd + (uint64_t)i, 1.0);
    double *upv = kt_randn(nv, sd + 20, 1.0), *upk = kt_randn(nk, sd + 21, 1.0);
    double *upk2 = kt_randn(nk, sd + 22, 1.0), *up0 = kt_randn(n0, sd + 23, 1.0);
    rset S = {0};

    /* gate */
    if (ct_sel_x(S_GATE, V_RAW)) {
        ct_cell(S_GATE, D_FWD, V_RAW);
        rarr *gk = rin(&S, gpu, d->x[IG], nk), *Gi = rout(&S, gpu, nk), *Ge = rout(&S, gpu, nk);
        DG_TEST_TRY(dg__dplr_cumsum_fwd_cuda(gpu, &dd, 0, D(gk), D(Gi), D(Ge)));
        dg__dplr_cumsum_fwd_f64(hd, gk->h, Gi->h, Ge->h);
        rcmp(cn, "cumsum fwd Gi", Gi);
        rcmp(cn, "cumsum fwd Ge", Ge);
        ct_cell(S_GATE, D_BWD, V_RAW);
        for (int pass = 0; pass < 2; pass++) { /* pass 1: dGe NULL */
            rarr *dGi = rin(&S, gpu, upk, nk), *dGe = pass ? NULL : rin(&S, gpu, upk2, nk);
            rarr *dgk = rout(&S, gpu, nk);
            DG_TEST_TRY(dg__dplr_cumsum_bwd_cuda(gpu, &dd, 0, D(gk), D(dGi), D(dGe), D(dgk)));
            dg__dplr_cumsum_bwd_f64(hd, gk->h, dGi->h, Hh(dGe), dgk->h);
            rcmp(cn, pass ? "cumsum bwd dgk (dGe NULL)" : "cumsum bwd dgk", dgk);
        }
        rset_free(&S);
    }

    /* intra */
    if (ct_sel_x(S_INTRA, V_RAW)) {
        ct_cell(S_INTRA, D_FWD, V_RAW);
        rarr *q = rin(&S, gpu, d->x[IQ], nk), *k = rin(&S, gpu, d->x[IK], nk);
        rarr *a = rin(&S, gpu, d->x[IA], nk), *b = rin(&S, gpu, d->x[IB], nk);
        rarr *Gi = rin(&S, gpu, d->Gi, nk), *Ge = rin(&S, gpu, d->Ge, nk);
        rarr *o[4];
        for (int i = 0; i < 4; i++)
            o[i] = rout(&S, gpu, na);
        DG_TEST_TRY(dg__dplr_intra_fwd_cuda(gpu, &dd, fs, 0, D(q), D(k), D(a), D(b), D(Gi), D(Ge),
                                            D(o[0]), D(o[1]), D(o[2]), D(o[3])));
        DG_TEST_TRY(dg__dplr_intra_fwd_f64(hd, s, q->h, k->h, a->h, b->h, Gi->h, Ge->h, o[0]->h,
                                           o[1]->h, o[2]->h, o[3]->h));
        static const char *on[4] = {"intra fwd Aqk", "intra fwd Aqb", "intra fwd Aak",
                                    "intra fwd Tab"};
        for (int i = 0; i < 4; i++)
            rcmp(cn, on[i], o[i]);
        ct_cell(S_INTRA, D_BWD, V_RAW);
        rarr *Tab = rin(&S, gpu, TabJ, na);
        for (int pass = 0; pass < 2; pass++) { /* pass 1: dAqb and dTab NULL */
            rarr *g[4];
            for (int i = 0; i < 4; i++)
                g[i] = pass && (i == 1 || i == 3) ? NULL : rin(&S, gpu, up[i], na);
            rarr *gr[6];
            for (int i = 0; i < 6; i++)
                gr[i] = rout(&S, gpu, nk);
            DG_TEST_TRY(dg__dplr_intra_bwd_cuda(
                gpu, &dd, fs, 0, D(q), D(k), D(a), D(b), D(Gi), D(Ge), D(Tab), D(g[0]), D(g[1]),
                D(g[2]), D(g[3]), D(gr[0]), D(gr[1]), D(gr[2]), D(gr[3]), D(gr[4]), D(gr[5])));
            DG_TEST_TRY(dg__dplr_intra_bwd_f64(hd, s, q->h, k->h, a->h, b->h, Gi->h, Ge->h, Tab->h,
                                               Hh(g[0]), Hh(g[1]), Hh(g[2]), Hh(g[3]), gr[0]->h,
                                               gr[1]->h, gr[2]->h, gr[3]->h, gr[4]->h, gr[5]->h));
            static const char *gn[6] = {"dq", "dk", "da", "db", "dGi", "dGe"};
            /* dGi, dGe: sums over x in q, k, a, b of x dx-like terms that cancel (exactly, for a
             * one-token chunk's diagonal), so measured against the size of those terms */
            const rarr *xs[4] = {q, k, a, b};
            double floor = 0;
            for (int i = 0; i < 4; i++)
                floor += ct_max_abs(xs[i]->h, xs[i]->n) * ct_max_abs(gr[i]->h, gr[i]->n);
            for (int i = 0; i < 6; i++) {
                char what[64];
                snprintf(what, sizeof what, "intra bwd %s%s", gn[i],
                         pass ? " (dAqb, dTab NULL)" : "");
                if (i < 4) {
                    rcmp(cn, what, gr[i]);
                    continue;
                }
                double *gh = host_of(gr[i]->t);
                char name[256];
                snprintf(name, sizeof name, "raw %s | %s", cn, what);
                check_rel_floor(name, gh, gr[i]->h, gr[i]->n, floor, TOL_F32);
                free(gh);
            }
        }
        rset_free(&S);
    }

    /* wy */
    if (ct_sel_x(S_WY, V_RAW)) {
        ct_cell(S_WY, D_FWD, V_RAW);
        rarr *q = rin(&S, gpu, d->x[IQ], nk), *k = rin(&S, gpu, d->x[IK], nk);
        rarr *v = rin(&S, gpu, d->x[IV], nv), *a = rin(&S, gpu, d->x[IA], nk);
        rarr *b = rin(&S, gpu, d->x[IB], nk), *Gi = rin(&S, gpu, d->Gi, nk);
        rarr *Ge = rin(&S, gpu, d->Ge, nk), *Aak = rin(&S, gpu, AakJ, na);
        rarr *Tab = rin(&S, gpu, TabJ, na);
        static const char *on[5] = {"w", "u", "qg", "kg", "bg"};
        for (int pass = 0; pass < 2; pass++) { /* pass 1: only u and qg asked for */
            rarr *o[5];
            for (int i = 0; i < 5; i++)
                o[i] = pass && i != 1 && i != 2 ? NULL : rout(&S, gpu, i == 1 ? nv : nk);
            DG_TEST_TRY(dg__dplr_wy_fwd_cuda(gpu, &dd, fs, 0, D(q), D(k), D(v), D(a), D(b), D(Gi),
                                             D(Ge), D(Aak), D(Tab), D(o[0]), D(o[1]), D(o[2]),
                                             D(o[3]), D(o[4])));
            DG_TEST_TRY(dg__dplr_wy_fwd_f64(hd, s, q->h, k->h, v->h, a->h, b->h, Gi->h, Ge->h,
                                            Aak->h, Tab->h, Hh(o[0]), Hh(o[1]), Hh(o[2]), Hh(o[3]),
                                            Hh(o[4])));
            for (int i = 0; i < 5; i++)
                if (o[i]) {
                    char what[64];
                    snprintf(what, sizeof what, "wy fwd %s%s", on[i], pass ? " (u, qg only)" : "");
                    rcmp(cn, what, o[i]);
                }
        }
        ct_cell(S_WY, D_BWD, V_RAW);
        for (int pass = 0; pass < 2; pass++) {                     /* pass 1: du and dkg NULL */
            const double *wyu[5] = {up[4], upv, upk, up[5], upk2}; /* dw du dqg dkg dbg */
            rarr *g[5];
            for (int i = 0; i < 5; i++)
                g[i] = pass && (i == 1 || i == 3) ? NULL : rin(&S, gpu, wyu[i], i == 1 ? nv : nk);
            rarr *gr[9];
            for (int i = 0; i < 9; i++)
                gr[i] = rout(&S, gpu, i == 2 ? nv : i >= 7 ? na : nk);
            DG_TEST_TRY(dg__dplr_wy_bwd_cuda(
                gpu, &dd, fs, 0, D(q), D(k), D(v), D(a), D(b), D(Gi), D(Ge), D(Aak), D(Tab),
                D(g[0]), D(g[1]), D(g[2]), D(g[3]), D(g[4]), D(gr[0]), D(gr[1]), D(gr[2]), D(gr[3]),
                D(gr[4]), D(gr[5]), D(gr[6]), D(gr[7]), D(gr[8])));
            DG_TEST_TRY(dg__dplr_wy_bwd_f64(hd, s, q->h, k->h, v->h, a->h, b->h, Gi->h, Ge->h,
                                            Aak->h, Tab->h, Hh(g[0]), Hh(g[1]), Hh(g[2]), Hh(g[3]),
                                            Hh(g[4]), gr[0]->h, gr[1]->h, gr[2]->h, gr[3]->h,
                                            gr[4]->h, gr[5]->h, gr[6]->h, gr[7]->h, gr[8]->h));
            static const char *gn[9] = {"dq", "dk", "dv", "da", "db", "dGi", "dGe", "dAak", "dTab"};
            for (int i = 0; i < 9; i++) {
                char what[64];
                snprintf(what, sizeof what, "wy bwd %s%s", gn[i], pass ? " (du, dkg NULL)" : "");
                rcmp(cn, what, gr[i]);
            }
        }
        rset_free(&S);
    }

    /* state */
    if (ct_sel_x(S_STATE, V_RAW)) {
        ct_cell(S_STATE, D_FWD, V_RAW);
        rarr *w = rin(&S, gpu, d->w, nk), *u = rin(&S, gpu, d->u, nv);
        rarr *kg = rin(&S, gpu, d->kg, nk), *bg = rin(&S, gpu, d->bg, nk);
        rarr *v = rin(&S, gpu, d->x[IV], nv), *Gi = rin(&S, gpu, d->Gi, nk);
        rarr *h0 = d->x[IH0] ? rin(&S, gpu, d->x[IH0], n0) : NULL;
        for (int pass = 0; pass < 2; pass++) { /* pass 1: h0 and ht NULL */
            rarr *hh = rout(&S, gpu, nh), *v2 = rout(&S, gpu, nv);
            rarr *ht = pass ? NULL : rout(&S, gpu, n0), *h0p = pass ? NULL : h0;
            DG_TEST_TRY(dg__dplr_state_fwd_cuda(gpu, &dd, 0, D(w), D(u), D(kg), D(bg), D(v), D(Gi),
                                                D(h0p), D(hh), D(v2), D(ht)));
            DG_TEST_TRY(dg__dplr_state_fwd_f64(hd, w->h, u->h, kg->h, bg->h, v->h, Gi->h, Hh(h0p),
                                               hh->h, v2->h, Hh(ht)));
            rcmp(cn, pass ? "state fwd h (no h0)" : "state fwd h", hh);
            rcmp(cn, pass ? "state fwd v2 (no h0)" : "state fwd v2", v2);
            if (ht)
                rcmp(cn, "state fwd ht", ht);
        }
        ct_cell(S_STATE, D_BWD, V_RAW);
        rarr *hh = rin(&S, gpu, d->h, nh), *v2 = rin(&S, gpu, d->v2, nv);
        for (int pass = 0; pass < 2; pass++) { /* pass 1: dh, dht and dh0 NULL */
            rarr *dh = pass ? NULL : rin(&S, gpu, up[7], nh), *dv2 = rin(&S, gpu, upv, nv);
            rarr *dht = pass ? NULL : rin(&S, gpu, up0, n0);
            rarr *gr[7];
            for (int i = 0; i < 7; i++)
                gr[i] = i == 6 && pass ? NULL
                                       : rout(&S, gpu,
                                              i == 1 || i == 4 ? nv
                                              : i == 6         ? n0
                                                               : nk);
            DG_TEST_TRY(dg__dplr_state_bwd_cuda(gpu, &dd, 0, D(w), D(kg), D(bg), D(v), D(Gi), D(hh),
                                                D(v2), D(dh), D(dv2), D(dht), D(gr[0]), D(gr[1]),
                                                D(gr[2]), D(gr[3]), D(gr[4]), D(gr[5]), D(gr[6])));
            DG_TEST_TRY(dg__dplr_state_bwd_f64(hd, w->h, kg->h, bg->h, v->h, Gi->h, hh->h, v2->h,
                                               Hh(dh), dv2->h, Hh(dht), gr[0]->h, gr[1]->h,
                                               gr[2]->h, gr[3]->h, gr[4]->h, gr[5]->h, Hh(gr[6])));
            static const char *gn[7] = {"dw", "du", "dkg", "dbg", "dv", "dGi", "dh0"};
            for (int i = 0; i < 7; i++)
                if (gr[i]) {
                    char what[64];
                    snprintf(what, sizeof what, "state bwd %s%s", gn[i],
                             pass ? " (dh, dht NULL)" : "");
                    rcmp(cn, what, gr[i]);
                }
        }
        /* the KCP summaries (dg__dplr_state_summary_cuda) of the last sequence forward and of
         * the first backward, each from a given S0 and from zero, against the shared f64
         * reference (ops/kcp/summary.c) with the operands ops/dplr/kcp.c gives it */
        const int64_t nsh = (int64_t)c->H * c->K * c->V, nsm = (int64_t)c->H * c->K * c->K;
        double *ref = kt_alloc(nsh + nsm);
        for (int bwd = 0; bwd < 2; bwd++)
            for (int pass = 0; pass < 2; pass++) { /* pass 1: S0 NULL */
                ct_cell(S_STATE, bwd ? D_BWD : D_FWD, V_RAW);
                const int seq = bwd ? 0 : hd->N - 1;
                const double *s0h = bwd ? up0 : d->x[IH0];
                rarr *S0 = !pass && s0h ? rin(&S, gpu, s0h + (size_t)seq * nsh, nsh) : NULL;
                rarr *dh = bwd ? rin(&S, gpu, up[7], nh) : NULL;
                rarr *dv2 = bwd ? rin(&S, gpu, upv, nv) : NULL;
                rarr *Sh = rout(&S, gpu, nsh), *SM = rout(&S, gpu, nsm);
                DG_TEST_TRY(dg__dplr_state_summary_cuda(
                    gpu, &dd, seq, bwd, 0, D(w), bwd ? NULL : D(u), D(kg), D(bg), bwd ? NULL : D(v),
                    D(Gi), D(dh), D(dv2), D(S0), D(Sh), D(SM)));
                kcp_summary_io io;
                memset(&io, 0, sizeof io);
                io.seq = seq;
                io.reverse = bwd;
                io.X = bwd ? w->h : bg->h;
                io.Y = bwd ? bg->h : w->h;
                io.G = Gi->h;
                io.nterm = bwd ? 1 : 2;
                io.term[0] = bwd ? (kcp_term){w->h, dv2->h, 0} : (kcp_term){kg->h, v->h, 0};
                io.term[1] = (kcp_term){bg->h, u->h, 0};
                io.dh = Hh(dh);
                io.S0 = Hh(S0);
                io.out = ref;
                DG_TEST_TRY(dg__kcp_summary_f64(hd, &io));
                for (int64_t rw = 0; rw < (int64_t)c->H * c->K; rw++) { /* [Sh | SM] rows */
                    memcpy(Sh->h + rw * c->V, ref + rw * (c->V + c->K), sizeof(double) * c->V);
                    memcpy(SM->h + rw * c->K, ref + rw * (c->V + c->K) + c->V,
                           sizeof(double) * c->K);
                }
                char what[64];
                snprintf(what, sizeof what, "state summary %s Sh%s", bwd ? "bwd" : "fwd",
                         pass ? " (S0 NULL)" : "");
                rcmp(cn, what, Sh);
                snprintf(what, sizeof what, "state summary %s SM%s", bwd ? "bwd" : "fwd",
                         pass ? " (S0 NULL)" : "");
                rcmp(cn, what, SM);
            }
        free(ref);
        rset_free(&S);
    }

    /* output */
    if (ct_sel_x(S_OUTPUT, V_RAW)) {
        ct_cell(S_OUTPUT, D_FWD, V_RAW);
        rarr *qg = rin(&S, gpu, d->qg, nk), *hh = rin(&S, gpu, d->h, nh);
        rarr *Aqk = rin(&S, gpu, AqkJ, na), *Aqb = rin(&S, gpu, AqbJ, na);
        rarr *v = rin(&S, gpu, d->x[IV], nv), *v2 = rin(&S, gpu, d->v2, nv);
        rarr *o = rout(&S, gpu, nv);
        DG_TEST_TRY(
            dg__dplr_output_fwd_cuda(gpu, &dd, 0, D(qg), D(hh), D(Aqk), D(Aqb), D(v), D(v2), D(o)));
        dg__dplr_output_fwd_f64(hd, qg->h, hh->h, Aqk->h, Aqb->h, v->h, v2->h, o->h);
        rcmp(cn, "output fwd o", o);
        ct_cell(S_OUTPUT, D_BWD, V_RAW);
        rarr *dO = rin(&S, gpu, upv, nv);
        rarr *gr[6];
        for (int i = 0; i < 6; i++)
            gr[i] = rout(&S, gpu, i == 0 ? nk : i == 1 ? nh : i < 4 ? na : nv);
        DG_TEST_TRY(dg__dplr_output_bwd_cuda(gpu, &dd, 0, D(qg), D(hh), D(Aqk), D(Aqb), D(v), D(v2),
                                             D(dO), D(gr[0]), D(gr[1]), D(gr[2]), D(gr[3]),
                                             D(gr[4]), D(gr[5])));
        dg__dplr_output_bwd_f64(hd, qg->h, hh->h, Aqk->h, Aqb->h, v->h, v2->h, dO->h, gr[0]->h,
                                gr[1]->h, gr[2]->h, gr[3]->h, gr[4]->h, gr[5]->h);
        static const char *gn[6] = {"dqg", "dh", "dAqk", "dAqb", "dv", "dv2"};
        for (int i = 0; i < 6; i++) {
            char what[64];
            snprintf(what, sizeof what, "output bwd %s", gn[i]);
            rcmp(cn, what, gr[i]);
        }
        rset_free(&S);
    }

    /* the recurrence */
    if (ct_sel_x(S_REC, V_RAW)) {
        ct_cell(S_REC, D_FWD, V_RAW);
        rarr *x[6];
        for (int i = 0; i < 6; i++)
            x[i] = rin(&S, gpu, d->x[i], i == IV ? nv : nk);
        rarr *h0 = d->x[IH0] ? rin(&S, gpu, d->x[IH0], n0) : NULL;
        rarr *o = rout(&S, gpu, nv), *ht = rout(&S, gpu, n0);
        DG_TEST_TRY(dg__dplr_recurrent_fwd_cuda(gpu, &dd, fs, 0, D(x[0]), D(x[1]), D(x[2]), D(x[3]),
                                                D(x[4]), D(x[5]), D(h0), D(o), D(ht)));
        DG_TEST_TRY(dg__dplr_recurrent_fwd_f64(hd, s, x[0]->h, x[1]->h, x[2]->h, x[3]->h, x[4]->h,
                                               x[5]->h, Hh(h0), o->h, ht->h));
        rcmp(cn, "recurrent fwd o", o);
        rcmp(cn, "recurrent fwd ht", ht);
        ct_cell(S_REC, D_BWD, V_RAW);
        for (int pass = 0; pass < 2; pass++) { /* pass 1: dht, dh0 NULL */
            rarr *dO = rin(&S, gpu, upv, nv), *dht = pass ? NULL : rin(&S, gpu, up0, n0);
            rarr *gr[7];
            for (int i = 0; i < 7; i++)
                gr[i] = i == 6 && pass ? NULL : rout(&S, gpu, i == 2 ? nv : i == 6 ? n0 : nk);
            DG_TEST_TRY(dg__dplr_recurrent_bwd_cuda(
                gpu, &dd, fs, 0, D(x[0]), D(x[1]), D(x[2]), D(x[3]), D(x[4]), D(x[5]), D(h0), D(dO),
                D(dht), D(gr[0]), D(gr[1]), D(gr[2]), D(gr[3]), D(gr[4]), D(gr[5]), D(gr[6])));
            DG_TEST_TRY(dg__dplr_recurrent_bwd_f64(
                hd, s, x[0]->h, x[1]->h, x[2]->h, x[3]->h, x[4]->h, x[5]->h, Hh(h0), dO->h, Hh(dht),
                gr[0]->h, gr[1]->h, gr[2]->h, gr[3]->h, gr[4]->h, gr[5]->h, Hh(gr[6])));
            static const char *gn[7] = {"dq", "dk", "dv", "da", "db", "dgk", "dh0"};
            for (int i = 0; i < 7; i++)
                if (gr[i]) {
                    char what[64];
                    snprintf(what, sizeof what, "recurrent bwd %s%s", gn[i],
                             pass ? " (dht NULL)" : "");
                    rcmp(cn, what, gr[i]);
                }
        }
        rset_free(&S);
    }

    free(AqkJ);
    free(AqbJ);
    free(AakJ);
    free(TabJ);
    for (int i = 0; i < 8; i++)
        free(up[i]);
    free(upv);
    free(upk);
    free(upk2);
    free(up0);
    dg__kda_cuda_dims_free(gpu, &dd);
    dg__kda_cfg_free(&cfg);
}

/* ---- groups GS, GC, GP: the entry points through the tape ------------------------------------ */

typedef enum { OP_GATE, OP_INTRA, OP_WY, OP_STATE, OP_OUTPUT, OP_CHUNK, OP_REC } opk;

typedef struct ucall {
    opk op;
    dg_dplr_opts opts;
    int want_ht;    /* state: ask for ht */
    int first_only; /* seed only the first output (the others get no gradient) */
} ucall;

static dg_status call_op(dg_ctx *ctx, dg_tensor *const *in, dg_tensor **out, const void *user) {
    const ucall *u = user;
    const dg_dplr_opts *o = &u->opts;
    switch (u->op) {
    case OP_GATE:
        return dg_dplr_gate_cumsum(ctx, in[0], o, &out[0], &out[1]);
    case OP_INTRA:
        return dg_dplr_intra(ctx, in[0], in[1], in[2], in[3], in[4], in[5], o, &out[0], &out[1],
                             &out[2], &out[3]);
    case OP_WY:
        return dg_dplr_wy(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], in[8], o,
                          &out[0], &out[1], &out[2], &out[3], &out[4]);
    case OP_STATE:
        return dg_dplr_state(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], o, &out[0],
                             &out[1], u->want_ht ? &out[2] : NULL);
    case OP_OUTPUT:
        return dg_dplr_output(ctx, in[0], in[1], in[2], in[3], in[4], in[5], o, &out[0]);
    case OP_CHUNK:
        return dg_dplr_chunk(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], o, &out[0],
                             &out[1]);
    case OP_REC:
        return dg_dplr_recurrent(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], o, &out[0],
                                 &out[1]);
    }
    return DG_ERR_ARG;
}

/* The entry point of u for the shared runner (case_table.h): its outputs by op. */
static ct_op op_of(const ucall *u) {
    static const char *const names[][CT_MAXOUT] = {{"Gi", "Ge"},
                                                   {"Aqk", "Aqb", "Aak", "Tab"},
                                                   {"w", "u", "qg", "kg", "bg"},
                                                   {"h", "v2", "ht"},
                                                   {"o"},
                                                   {"o", "ht"},
                                                   {"o", "ht"}};
    return ct_op_of(call_op, u, names[u->op], u->op == OP_STATE && !u->want_ht, u->first_only);
}

static int var_of(dg_dtype act) { return act == DG_BF16 ? V_BF16 : V_F32; }

/* The op on CUDA (leaves in `act`) against the CPU f64 op on the values it used; stage s. */
static void gpu_vs_cpu(dg_ctx *cpu, dg_ctx *gpu, const char *label, const ucall *u, int n_in,
                       const ct_in *ins, dg_dtype act, uint64_t seed, const ct_tols *t, int s) {
    const ct_op op = op_of(u);
    const ct_tols dflt = ct_tols_all(act == DG_BF16 ? TOL_BF16 : TOL_F32);
    ct_gpu_vs_cpu(cpu, gpu, label, &op, n_in, ins, act, seed, t ? t : &dflt, s, var_of(act));
}

/* -- GS: every stage node on its own */

static void stages_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r, const ddata *d) {
    const uint64_t seed = r->c->seed + 100;
    char label[224];
    ucall u;
    memset(&u, 0, sizeof u);
    u.opts = opts_of(r);
    const int64_t *sk = d->sk, *sv = d->sv, *sa = d->sa, *s0 = d->s0, *sh = d->sh;
    for (int vi = 0; vi < 2; vi++) {
        const dg_dtype act = vi ? DG_BF16 : DG_F32;
        if (!ct_sel_x(S_GATE, var_of(act)) && !ct_sel_x(S_INTRA, var_of(act)) &&
            !ct_sel_x(S_WY, var_of(act)) && !ct_sel_x(S_STATE, var_of(act)) &&
            !ct_sel_x(S_OUTPUT, var_of(act)))
            continue;
        /* f32 runs a second time with only the first output seeded */
        for (int fo = 0; fo <= (act == DG_F32); fo++) {
            u.first_only = fo;
            if (ct_sel_x(S_GATE, var_of(act))) {
                ct_in in[1] = {ct_mkin("gk", 4, sk, d->x[IG], 0)};
                u.op = OP_GATE;
                snprintf(label, sizeof label, "gate_cumsum %s", r->L.name);
                gpu_vs_cpu(cpu, gpu, label, &u, 1, in, act, seed + 1, NULL, S_GATE);
            }
            if (ct_sel_x(S_INTRA, var_of(act))) {
                ct_in in[6] = {ct_mkin("q", 4, sk, d->x[IQ], 0), ct_mkin("k", 4, sk, d->x[IK], 0),
                               ct_mkin("a", 4, sk, d->x[IA], 0), ct_mkin("b", 4, sk, d->x[IB], 0),
                               ct_mkin("Gi", 4, sk, d->Gi, 1),   ct_mkin("Ge", 4, sk, d->Ge, 1)};
                u.op = OP_INTRA;
                snprintf(label, sizeof label, "intra %s", r->L.name);
                gpu_vs_cpu(cpu, gpu, label, &u, 6, in, act, seed + 2, NULL, S_INTRA);
            }
            if (ct_sel_x(S_WY, var_of(act))) {
                ct_in in[9] = {ct_mkin("q", 4, sk, d->x[IQ], 0), ct_mkin("k", 4, sk, d->x[IK], 0),
                               ct_mkin("v", 4, sv, d->x[IV], 0), ct_mkin("a", 4, sk, d->x[IA], 0),
                               ct_mkin("b", 4, sk, d->x[IB], 0), ct_mkin("Gi", 4, sk, d->Gi, 1),
                               ct_mkin("Ge", 4, sk, d->Ge, 1),   ct_mkin("Aak", 4, sa, d->Aak, 1),
                               ct_mkin("Tab", 4, sa, d->Tab, 1)};
                u.op = OP_WY;
                snprintf(label, sizeof label, "wy %s", r->L.name);
                gpu_vs_cpu(cpu, gpu, label, &u, 9, in, act, seed + 3, NULL, S_WY);
            }
            if (ct_sel_x(S_STATE, var_of(act))) {
                ct_in in[7] = {ct_mkin("w", 4, sk, d->w, 1),      ct_mkin("u", 4, sv, d->u, 1),
                               ct_mkin("kg", 4, sk, d->kg, 1),    ct_mkin("bg", 4, sk, d->bg, 1),
                               ct_mkin("v", 4, sv, d->x[IV], 0),  ct_mkin("Gi", 4, sk, d->Gi, 1),
                               ct_mkin("h0", 4, s0, d->x[IH0], 1)};
                u.op = OP_STATE;
                u.want_ht = 1;
                for (int pol = 0; pol < 2; pol++) { /* RECOMPUTE (the default), CACHE */
                    if (pol)
                        dg_policy_set("dplr_state", DG_POLICY_CACHE);
                    snprintf(label, sizeof label, "state %s %s", pol ? "CACHE" : "RECOMPUTE",
                             r->L.name);
                    gpu_vs_cpu(cpu, gpu, label, &u, 7, in, act, seed + 4, NULL, S_STATE);
                    dg_policy_reset();
                }
                u.want_ht = 0;
            }
            if (ct_sel_x(S_OUTPUT, var_of(act)) && !fo) { /* one output: nothing to leave out */
                ct_in in[6] = {ct_mkin("qg", 4, sk, d->qg, 1),   ct_mkin("h", 5, sh, d->h, 1),
                               ct_mkin("Aqk", 4, sa, d->Aqk, 1), ct_mkin("Aqb", 4, sa, d->Aqb, 1),
                               ct_mkin("v", 4, sv, d->x[IV], 0), ct_mkin("v2", 4, sv, d->v2, 1)};
                u.op = OP_OUTPUT;
                snprintf(label, sizeof label, "output %s", r->L.name);
                gpu_vs_cpu(cpu, gpu, label, &u, 6, in, act, seed + 5, NULL, S_OUTPUT);
            }
        }
        u.first_only = 0;
    }
}

/* -- GC: the composite and the recurrence */

static void leaf_inputs(const ddata *d, ct_in *in) {
    for (int i = 0; i < NLEAF; i++)
        in[i] = ct_mkin(leaf_name[i], 4,
                        i == IV    ? d->sv
                        : i == IH0 ? d->s0
                                   : d->sk,
                        d->x[i], i == IH0);
}

static ucall ccall(const crun *r, opk op) {
    ucall u;
    memset(&u, 0, sizeof u);
    u.op = op;
    u.opts = opts_of(r);
    u.opts.output_final_state = 1;
    return u;
}

static void composite_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r, const ddata *d) {
    const uint64_t seed = r->c->seed + 200;
    ct_in in[NLEAF];
    leaf_inputs(d, in);
    ucall uc = ccall(r, OP_CHUNK), ur = ccall(r, OP_REC);
    char label[240];

    if (ct_sel_x(S_CHUNK, V_F32) || ct_sel_x(S_REC, V_F32)) {
        /* CUDA chunked (gc) and recurrent (gr) with the same seeds; CPU f64 on the same values */
        ct_res gc, gr, cc, cr;
        const ct_op oc = op_of(&uc), orec = op_of(&ur);
        ct_run_op(gpu, DG_F32, &oc, NLEAF, in, NULL, seed, &gc);
        ct_run_op(gpu, DG_F32, &orec, NLEAF, in, &gc, seed, &gr);
        ct_in used[NLEAF];
        for (int i = 0; i < NLEAF; i++) {
            used[i] = in[i];
            used[i].x = gc.xin[i];
        }
        ct_run_op(cpu, DG_F64, &oc, NLEAF, used, &gc, seed, &cc);
        ct_run_op(cpu, DG_F64, &orec, NLEAF, used, &gc, seed, &cr);
        ct_tols t = ct_tols_all(TOL_F32), tcr = ct_tols_all(TOL_CHUNK_VS_REC);
        snprintf(label, sizeof label, "f32  chunk %s", r->L.name);
        ct_compare(label, &oc, in, &gc, &cc, &t, S_CHUNK, V_F32);
        snprintf(label, sizeof label, "f32  recurrent %s", r->L.name);
        ct_compare(label, &orec, in, &gr, &cr, &t, S_REC, V_F32);
        snprintf(label, sizeof label, "CUDA chunk vs CUDA recurrent %s", r->L.name);
        ct_compare(label, &oc, in, &gc, &gr, &tcr, S_CHUNK, V_F32);
        ct_res *all[4] = {&gc, &gr, &cc, &cr};
        for (int i = 0; i < 4; i++)
            ct_free_res(all[i]);
        /* o seeded alone: no dht, the state pass starts from a zero gradient */
        uc.first_only = ur.first_only = 1;
        snprintf(label, sizeof label, "chunk %s", r->L.name);
        gpu_vs_cpu(cpu, gpu, label, &uc, NLEAF, in, DG_F32, seed + 1, NULL, S_CHUNK);
        snprintf(label, sizeof label, "recurrent %s", r->L.name);
        gpu_vs_cpu(cpu, gpu, label, &ur, NLEAF, in, DG_F32, seed + 2, NULL, S_REC);
        uc.first_only = ur.first_only = 0;
    }

    if (ct_sel_x(S_CHUNK, V_BF16) || ct_sel_x(S_REC, V_BF16)) {
        /* the composite's leaf gradients collect contributions of several nodes (dq, dk, da,
         * db: intra and wy; dv: wy, state and output); the tape sums them in f32 and rounds to
         * bf16 once, so TOL_BF16 holds for them as for the rest */
        snprintf(label, sizeof label, "chunk %s", r->L.name);
        gpu_vs_cpu(cpu, gpu, label, &uc, NLEAF, in, DG_BF16, seed + 3, NULL, S_CHUNK);
        snprintf(label, sizeof label, "recurrent %s", r->L.name);
        gpu_vs_cpu(cpu, gpu, label, &ur, NLEAF, in, DG_BF16, seed + 4, NULL, S_REC);

        /* dtypes of a bf16 call: o bf16, ht f32, each gradient in its input's dtype */
        for (int op = 0; op < 2; op++) {
            ct_res bf;
            const ct_op ob = op_of(op ? &ur : &uc);
            ct_run_op(gpu, DG_BF16, &ob, NLEAF, in, NULL, seed + 5, &bf);
            int ok = bf.out_dt[0] == DG_BF16 && bf.out_dt[1] == DG_F32;
            for (int i = 0; i < NLEAF; i++)
                if (bf.xin[i])
                    ok &= bf.grad_dt[i] == (in[i].f32 ? DG_F32 : DG_BF16);
            ct_cell(op ? S_REC : S_CHUNK, D_FWD, V_BF16);
            dg_check(ok, "bf16 %s %s: o bf16, ht f32, each gradient in its input's dtype",
                     op ? "recurrent" : "chunk", r->L.name);
            ct_free_res(&bf);
        }
    }
}

/* -- GP: CACHE and RECOMPUTE run the same kernels on the same inputs: bitwise equal results */

static void policy_case(dg_ctx *gpu, const crun *r, const ddata *d) {
    ct_in in[NLEAF];
    leaf_inputs(d, in);
    const ucall u = ccall(r, OP_CHUNK);
    const ct_op op = op_of(&u);
    static const char *what[3] = {"global CACHE", "dplr_wy CACHE", "dplr_state CACHE"};
    for (int a = 0; a < 2; a++) {
        const dg_dtype act = a ? DG_BF16 : DG_F32;
        if (!ct_sel_x(S_POLICY, var_of(act)))
            continue;
        ct_res rc;
        dg_policy_reset();
        ct_run_op(gpu, act, &op, NLEAF, in, NULL, r->c->seed + 300, &rc);
        for (int p = 0; p < 3; p++) {
            ct_res ca;
            if (p == 0)
                dg_policy_set_global(DG_POLICY_CACHE);
            else
                dg_policy_set(p == 1 ? "dplr_wy" : "dplr_state", DG_POLICY_CACHE);
            ct_run_op(gpu, act, &op, NLEAF, in, &rc, r->c->seed + 300, &ca);
            dg_policy_reset();
            char label[256];
            snprintf(label, sizeof label, "%s %s %s vs RECOMPUTE (bitwise)",
                     act == DG_BF16 ? "bf16" : "f32 ", r->L.name, what[p]);
            ct_tols exact = ct_tols_all(0.0);
            ct_compare(label, &op, in, &ca, &rc, &exact, S_POLICY, var_of(act));
            ct_free_res(&ca);
        }
        ct_free_res(&rc);
    }
}

/* -- GE: device, dtype and size errors */

static dg_tensor *tens(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, const double *x) {
    return kt_tensor(ctx, dt, ndim, shape, x, 0);
}

static void errors_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r, const ddata *d) {
    if (!r->c->h0) {
        fprintf(stderr, "FATAL: group GE needs a case with h0 (%s)\n", r->L.name);
        exit(1);
    }
    ct_cell(S_ERRORS, D_FWD, V_NONE);
    printf("-- device, dtype and size errors\n");
    dg_tensor *t[NLEAF] = {0};
    for (int i = 0; i < NLEAF; i++)
        t[i] = tens(gpu, DG_F32, 4, i == IV ? d->sv : i == IH0 ? d->s0 : d->sk, d->x[i]);
    dg_dplr_opts o = opts_of(r);
    o.output_final_state = 1;
    dg_tensor *out = NULL, *ht = NULL, *bad = NULL;
#define CHUNK(ctx_, q_, k_, h0_)                                                                   \
    dg_dplr_chunk(ctx_, q_, k_, t[IV], t[IA], t[IB], t[IG], h0_, &o, &out, &ht)
    bad = tens(cpu, DG_F32, 4, d->sk, d->x[IK]);
    dg_check_err(CHUNK(gpu, t[IQ], bad, t[IH0]), DG_ERR_DEVICE, "'k' must be on cuda",
                 "chunk: CPU k with CUDA q");
    dg_tensor_free(&bad);
    dg_check_err(CHUNK(cpu, t[IQ], t[IK], t[IH0]), DG_ERR_DEVICE, "must be on cpu",
                 "chunk: CUDA tensors with a CPU context");
    bad = tens(gpu, DG_F64, 4, d->sk, d->x[IQ]);
    dg_check_err(CHUNK(gpu, bad, t[IK], t[IH0]), DG_ERR_DTYPE, "f32 or bf16 on CUDA",
                 "chunk: f64 q on CUDA");
    dg_tensor_free(&bad);
    bad = tens(gpu, DG_BF16, 4, d->sk, d->x[IK]);
    dg_check_err(CHUNK(gpu, t[IQ], bad, t[IH0]), DG_ERR_DTYPE, "k must be",
                 "chunk: bf16 k with f32 q (one leaf dtype)");
    dg_tensor_free(&bad);
    bad = tens(gpu, DG_BF16, 4, d->s0, d->x[IH0]);
    dg_check_err(CHUNK(gpu, t[IQ], t[IK], bad), DG_ERR_DTYPE, "h0 must be", "chunk: bf16 h0");
    dg_check_err(
        dg_dplr_recurrent(gpu, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], bad, &o, &out, &ht),
        DG_ERR_DTYPE, "h0 must be", "recurrent: bf16 h0");
    dg_tensor_free(&bad);
#undef CHUNK
    /* the intermediates are f32 on CUDA */
    dg_tensor *Gb = tens(gpu, DG_BF16, 4, d->sk, d->Gi), *G = tens(gpu, DG_F32, 4, d->sk, d->Gi);
    dg_tensor *m[5] = {0};
    dg_check_err(
        dg_dplr_intra(gpu, t[IQ], t[IK], t[IA], t[IB], Gb, G, &o, &m[0], &m[1], &m[2], &m[3]),
        DG_ERR_DTYPE, "Gi must be", "intra: bf16 Gi");
    dg_check_err(dg_dplr_state(gpu, Gb, t[IV], G, G, t[IV], G, NULL, &o, &m[0], &m[1], NULL),
                 DG_ERR_DTYPE, "w must be", "state: bf16 w");
    /* K > 256 */
    const int64_t sbig[4] = {1, 4, 1, 260};
    double *xb = kt_rand(260 * 4, 7, -0.5, -0.1);
    bad = tens(gpu, DG_F32, 4, sbig, xb);
    dg_check_err(dg_dplr_gate_cumsum(gpu, bad, &o, &m[0], &m[1]), DG_ERR_UNSUPPORTED, "K <= 256",
                 "gate_cumsum: K = 260 on CUDA");
    dg_tensor_free(&bad);
    free(xb);
    /* the raw launchers: one value head per head, f32 intermediates */
    kda_cfg cfg;
    DG_TEST_TRY(dg__dplr_cfg_init("test_dplr_cuda", cpu, &o, r->L.B, r->L.T, r->c->H, r->c->K,
                                  r->c->V, DG_F64, &cfg));
    kda_cuda_dims dd;
    DG_TEST_TRY(dg__kda_cuda_dims_new(gpu, r->L.TT, r->c->H, 2 * r->c->H, r->c->K, r->c->V,
                                      r->c->BT, cfg.d.N, cfg.d.cu, cfg.d.chunk_off, &dd));
    float *g = (float *)dg_tensor_data(G);
    dg_check_err(dg__dplr_cumsum_fwd_cuda(gpu, &dd, 0, g, g, g), DG_ERR_SHAPE, "HV == H",
                 "raw cumsum: dims with HV = 2H");
    dd.HV = dd.H;
    dd.mid = 1;
    dg_check_err(dg__dplr_cumsum_fwd_cuda(gpu, &dd, 0, g, g, g), DG_ERR_UNSUPPORTED,
                 "mid must be 0", "raw cumsum: dims with mid = 1");
    dd.mid = 0;
    dg__kda_cuda_dims_free(gpu, &dd);
    dg__kda_cfg_free(&cfg);
    dg_tensor_free(&Gb);
    dg_tensor_free(&G);
    for (int i = 0; i < NLEAF; i++)
        dg_tensor_free(&t[i]);
}

/* ---- extras ---------------------------------------------------------------------------------- */

/* args: argument checks of the raw launchers (no device touched: each fails before a CUDA
 * call). */
static void test_args(void) {
    ct_cell(S_ARGS, D_FWD, V_NONE);
    kda_cuda_dims dd;
    memset(&dd, 0, sizeof dd);
    float x = 0;
    dg_check_err(dg__dplr_cumsum_fwd_cuda(NULL, &dd, 0, &x, &x, &x), DG_ERR_ARG, "ctx and a dims",
                 "cumsum fwd: no context");
    dg_check_err(dg__dplr_intra_bwd_cuda(NULL, NULL, 1.f, 0, &x, &x, &x, &x, &x, &x, &x, NULL, NULL,
                                         NULL, NULL, &x, &x, &x, &x, &x, &x),
                 DG_ERR_ARG, "ctx and a dims", "intra bwd: no dims");
    dg_check_err(dg__dplr_state_fwd_cuda(NULL, &dd, 0, &x, &x, &x, &x, &x, &x, NULL, &x, &x, NULL),
                 DG_ERR_ARG, "ctx and a dims", "state fwd: no context");
    dg_check_err(dg__dplr_recurrent_bwd_cuda(NULL, &dd, 1.f, 0, &x, &x, &x, &x, &x, &x, NULL, &x,
                                             NULL, &x, &x, &x, &x, &x, &x, NULL),
                 DG_ERR_ARG, "ctx and a dims", "recurrent bwd: no context");
}

/* ---- the driver ------------------------------------------------------------------------------ */

static int any_sel(int s0, int s1, int v) {
    for (int s = s0; s <= s1; s++)
        if (ct_sel_x(s, v))
            return 1;
    return 0;
}

static void run_case(dg_ctx *cpu, dg_ctx *gpu, int idx) {
    crun cr;
    cr.c = &dcases[idx];
    case_layout(idx, &cr.L);
    const crun *r = &cr;
    const unsigned runs = r->c->runs;
    const int gr = (runs & GR) && any_sel(S_GATE, S_REC, V_RAW);
    const int gs =
        (runs & GS) && (any_sel(S_GATE, S_OUTPUT, V_F32) || any_sel(S_GATE, S_OUTPUT, V_BF16));
    const int gc =
        (runs & GC) && (any_sel(S_REC, S_CHUNK, V_F32) || any_sel(S_REC, S_CHUNK, V_BF16));
    const int gp = (runs & GP) && (ct_sel_x(S_POLICY, V_F32) || ct_sel_x(S_POLICY, V_BF16));
    const int ge = (runs & GE) && ct_sel_x(S_ERRORS, V_NONE);
    if (!gr && !gs && !gc && !gp && !ge)
        return;
    ct_print_case(&r->L, runs);
    ddata d;
    make_data(cpu, r, r->c->seed, &d);
    if (gr)
        raw_case(cpu, gpu, r, &d);
    if (gs)
        stages_case(cpu, gpu, r, &d);
    if (gc)
        composite_case(cpu, gpu, r, &d);
    if (gp)
        policy_case(gpu, r, &d);
    if (ge)
        errors_case(cpu, gpu, r, &d);
    free_data(&d);
}

/* cpu mode: the args extra (no device touched) */
static void cpu_extras(dg_ctx *cpu) {
    if (ct_sel_x(S_ARGS, V_NONE))
        test_args();
}

static const char *const groups[] = {"GR", "GS", "GC", "GP", "GE"};
static const ct_suite suite = {
    .name = "dplr_cuda",
    .axes = {stage_name, NSTAGE, S_POLICY, dir_name, NDIR, var_name, NVAR, 0},
    .group_name = groups,
    .ngroup = NELEM(groups),
    .ncases = NELEM(dcases),
    .layout = case_layout,
    .run = run_case,
    .cpu_extras = cpu_extras,
    .gpu_extras = NULL};

int main(int argc, char **argv) { return ct_main(argc, argv, &suite); }
#endif

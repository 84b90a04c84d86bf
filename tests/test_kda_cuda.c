/*
 * tests/test_kda_cuda.c -- the CUDA path of KDA, table driven: every case of one table of shapes
 * (kcases[] below) through the stages and kernel variants its `runs` column names.
 *
 * Stages (rows of the summary): l2norm, beta, gate (+ chunk cumsum, every gate kind), intra (Aqk,
 * Tm), wy (W, U, KG, QG), state (h, E, ht), output (O), recurrent (the token recurrence) and
 * chunk (the chunked pipeline: the raw stages chained on the device, or the composite
 * dg_kda_chunk), each forward (fwd) and backward (bwd; acc: the accumulating mode of the intra
 * and wy backward kernels, KDA_ACC_*, in the tc variants).
 * Variants (columns of the summary):
 *   f32       raw kernels (kernels/kda/kda_cuda.h) with tc = 0 against the raw CPU f32 functions
 *             (ops/kda/kda.h) on the same f32 inputs (groups RF, RB)
 *   ffma      raw kernels with tc = 0 against the raw CPU f64 functions (group TC)
 *   tf32      the same with tc = 1 (TF32 tensor cores / mma.sync)
 *   3xtf32    the same with tc = 2 (3xTF32 in the intra stage; f32 FFMA in wy, state, output)
 *   mid       tc = 1 with kda_cuda_dims.mid = 1: W, U, KG, QG, h, E and dh stored as bf16 on the
 *             device, against the CPU f64 functions fed the same bf16-rounded values (group TC,
 *             the cases where dg__kda_mid_fits holds; the others are skipped, not failed)
 *   ops-f32   the ops-layer entry points (dg_kda_*) on CUDA through the tape, f32 activations,
 *             against the CPU f64 op run on the values the CUDA op actually used: forward values
 *             and the gradient of every input, seeded with random output gradients (OS, OC)
 *   ops-bf16  the same with bf16 activations
 * Groups (the `runs` column; a case runs the stages of each group it names):
 *   RF  f32: every forward stage, NULL-output variants, gates of every kind with and without the
 *       cumsum, and the chunked pipeline on the device (from raw q, k, g, b) against the device
 *       recurrence
 *   RB  f32: every backward stage; Aqk and Tm carry junk above the diagonal and the upstream dAqk,
 *       dTm fill whole rows (a kernel reading outside the lower triangle fails); NULL upstream
 *       gradients (= zero) and NULL outputs (= skipped); every reduction runs twice and must agree
 *       bit for bit (no float atomics)
 *   TC  ffma, tf32, 3xtf32: intra, wy, state, output forward and backward against one f64 chain
 *       (each stage fed the f32 rounding of the chain's own inputs), outputs alone, upstream
 *       gradients left out, the acc mode of the intra and wy backward, and the wy backward with
 *       v and dv as the op's bf16 leaf (kda_cuda_dims.leaf_bf16); mid: the stages that
 *       read or write the bf16 intermediates (wy, state, output forward; state, output backward),
 *       and the refusal of mid = 1 where it does not apply (errors row, column mid)
 *   OS  ops-f32, ops-bf16: every stage entry point on its own (l2norm and state under both
 *       policies, beta c = 1 and 2, gate_cumsum with every gate kind; state and output take f32
 *       intermediates only, so they run in ops-f32)
 *   OC  ops-f32, ops-bf16: dg_kda_chunk and dg_kda_recurrent with the case's gate options, CUDA
 *       chunked against CUDA recurrent, and the output / gradient dtypes of a bf16 call
 *   OP  the composite under CACHE and RECOMPUTE: bitwise equal (policy row)
 *   OE  device and dtype errors of the entry points (errors row)
 * Extras (rows of their own, column "none" unless said): tables (the device chunk tables of the
 * raw groups), rule (the ops-layer rule choosing tc), args (argument checks of the raw launchers:
 * cpu mode, no device touched), timing (a table of the forward and backward stage times at (B, T,
 * H, K = V) = (2, 4096, 16, 128), printed, not asserted; DG_KDA_NO_BENCH=1 skips it), and the
 * policy and errors rows of OP and OE.
 *
 * Common to every check: device outputs are poisoned with NaN first, so an element a kernel
 * forgets to write fails (every element compared is one the reference writes); inputs are random
 * and never zero (q, k rows L2-normalised or normalised in the op, per-step log decays of the
 * case's range, beta in (0, 1) or from logits, v, h0 and upstream gradients uniform or normal).
 * The cases cover T not a multiple of BT, B = 2, varlen with odd lengths (1 included), GVA (HV a
 * multiple of H), BT = 16/32/64, K = V = 64, 128, 256, K and V not multiples of 32 (K = 80 V = 40
 * and smaller), T = 1 and T < BT, steep gates (-45..-35 per step: exponents masked, never
 * overflowed; g = -40), gates on both sides of the intra kernels' middle-row limit (-7..-0.01),
 * h0 given or not, and the gates NONE / KDA / LOWERBOUND with in-op l2norm and beta sigmoid.
 * At the end: checks and the largest norm-relative error per stage and variant.
 *
 * Usage: test_kda_cuda cpu|gpu [--list] [--case C,...] [--stage S,...] [--variant V,...]
 *                              [--dir fwd|bwd|acc,...]
 *   cpu mode runs the args extra only (the CPU reference has its own suites), gpu mode the rest
 *   (exit 77, skipped, without a device). --list prints the cases and exits. C is a
 *   case number (as --list prints) or text the case name contains; S a stage or extra name; V a
 *   variant. Without a filter everything runs; with --variant the extras without a variant
 *   (tables, errors, rule, args, timing) are left out, with --case the extras not tied to a case
 *   (rule, args, timing). --list also names the variants. A small run for compute-sanitizer, e.g.:
 *     compute-sanitizer --tool racecheck ./build-cuda/test_kda_cuda gpu --case 7 \
 *         --variant tf32 --stage intra,state
 *   The bf16 intermediates alone (stages and the errors row): --variant mid.
 */
#include "case_table.h"
#include "harness.h"
#include "kda_testutil.h"
#include "ops/kda/kda.h"
#ifdef DG_HAVE_CUDA
#include "kernels/kda/kda_cuda.h"
#include "kernels/l2norm.cuh"
#endif

#include <stdarg.h>
#include <string.h>
#include <time.h>

#ifndef DG_HAVE_CUDA
/* Without CUDA there is nothing to run: gpu mode reports skipped, cpu mode is not registered. */
int main(int argc, char **argv) { return dg_test_main(argc, argv, "kda_cuda", NULL, NULL); }
#else

/* ---- tolerances ------------------------------------------------------------------------------ */

/* Raw f32 kernels against the raw CPU f32 functions, both computing in f32: the kernels sum in
 * other orders than the CPU loops (tiles, warp trees, partial sums over tiles and value heads),
 * so results differ by a few ulps of the largest terms; 1e-5 of the largest value leaves ~100x
 * headroom over what such reorderings give at these sizes. */
#define TOL_RAW_F32 1e-5
/* The chunked pipeline against the recurrence, both on the device: two different f32 algorithms
 * (the WY inverse and the state products round differently from T rank-1 updates). */
#define TOL_RAW_CHUNK_VS_REC 1e-4
/* tc = 1 against f64: TF32 operands keep 10 mantissa bits (bf16: 8), so each product is off by up
 * to ~2^-11 relative per operand; sums of K, V or BT such products and a few chunks of state stay
 * well inside 1e-2 of the largest value -- the accuracy bf16 activations allow anyway. */
#define TOL_TF32 1e-2
/* tc = 2: 3xTF32 (hi*hi + hi*lo + lo*hi) drops only lo*lo (~2^-22 relative) and accumulates in
 * f32: f32-like, with 10x headroom over what the f32 FFMA kernels reach against f64 here. (Only
 * the intra stage has 3xTF32 kernels; wy, state and output run their FFMA kernels in this mode.) */
#define TOL_3XTF32 1e-4
/* tc = 0 (the f32 FFMA kernels) against f64: the contrast to the two above, asserted loosely. */
#define TOL_FFMA 1e-4
/* mid (tc = 1, W, U, KG, QG, h, E and dh stored as bf16), the outputs stored as bf16: the final
 * round-to-nearest-even alone is up to 2^-9 ~ 2e-3 of each element, on top of the TF32 / bf16
 * product errors of the mma.sync kernels (TOL_TF32's budget); the references are the exact f64
 * values, so 1e-2 of the largest value leaves ~5x over the storage rounding. The f32 outputs of
 * the mid variant (ht, O and the gradients) are computed from the same bf16 inputs as their f64
 * references, so only the kernels' own roundings count: the TF32 products, and in the bf16 mma
 * forms the bf16 staging of the state / X operands (2^-9 per operand instead of TF32's 2^-11,
 * accumulated in f32); they are held to TOL_TF32. */
#define TOL_MID 1e-2
/* Ops layer, f32 CUDA against f64: the kernels sum in f32 over at most BT-long rows, K/V-long dot
 * products and a state chain of a few chunks; the CPU f32 reference stays within 1e-5 of f64 on
 * the same cases (test_kda_chunk), and the kernels only reorder those sums. */
#define TOL_OPS_F32 1e-5
/* Ops layer, bf16 inputs, f32 math, bf16 outputs and gradients: the final rounding alone is 2^-9
 * of the largest value; 1e-2 leaves room for rounded seeds of the backward (o is bf16). */
#define TOL_BF16 1e-2
/* Ops layer, CUDA chunked against CUDA recurrent: each is within TOL_OPS_F32 of the same f64
 * result. */
#define TOL_OPS_CHUNK_VS_REC 2e-5

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

/* ---- stages, variants and directions (the axes of the tally, case_table.h) --------------------
 */

enum {
    S_L2,
    S_BETA,
    S_GATE,
    S_INTRA,
    S_WY,
    S_STATE,
    S_OUTPUT,
    S_REC,
    S_CHUNK,
    S_TABLES, /* extras from here on */
    S_POLICY,
    S_ERRORS,
    S_RULE,
    S_ARGS,
    S_TIMING,
    NSTAGE
};
static const char *stage_name[NSTAGE] = {"l2norm", "beta",   "gate",      "intra", "wy",
                                         "state",  "output", "recurrent", "chunk", "tables",
                                         "policy", "errors", "rule",      "args",  "timing"};
enum { D_FWD, D_BWD, D_ACC, NDIR };
static const char *dir_name[NDIR] = {"fwd", "bwd", "acc"};
enum { V_F32, V_FFMA, V_TF32, V_3XTF32, V_MID, V_OPS_F32, V_OPS_BF16, V_NONE, NVAR };
static const char *var_name[NVAR] = {"f32", "ffma",    "tf32",     "3xtf32",
                                     "mid", "ops-f32", "ops-bf16", "none"};

/* An ops-layer unit checks forward values and gradients of one tape run: either direction. */
static int sel_ops(int s, int v) { return ct_sel(s, D_FWD, v) || ct_sel(s, D_BWD, v); }

/* ---- the cases ------------------------------------------------------------------------------- */

/* Groups (see the header). */
enum { RF = 1, RB = 2, TC = 4, OS = 8, OC = 16, OP = 32, OE = 64 };
/* Options of the composite (OC, OP, OE): gate KDA or LOWERBOUND (else NONE), in-op l2norm of q
 * and k, beta from logits through the sigmoid, allow_neg_eigval. */
enum { GK = 1, GL = 2, L2 = 4, SG = 8, NE = 16 };
/* The usual per-step log decay range. */
#define GS -0.5, -0.01

typedef struct kcase {
    int64_t B, T;    /* rows and tokens per row; varlen (lens given): B = 1, T = sum of lens */
    int H, HV, K, V; /* heads, value heads (GVA: HV > H), key dim, value dim */
    int BT;          /* chunk size */
    int64_t lens[4]; /* varlen sequence lengths (0-terminated; {0}: B rows of T) */
    int h0;          /* raw groups and OC: a random h0 (else none) */
    double glo, ghi; /* per-step log decay range of the raw groups' and gate NONE's g (glo == ghi:
                        every g equals it) */
    unsigned opt;    /* composite options */
    unsigned runs;   /* groups */
    uint64_t seed;   /* base of the case's random streams */
} kcase;

/* clang-format off */
static const kcase kcases[] = {
    /* B    T  H HV    K    V  BT  lens          h0  g range    opt          runs        seed */
    {  2, 100, 2, 2,  64,  64, 64, {0},           1, GS,        0,           RF|RB|TC,   1000},
    {  2,  75, 1, 2,  64,  64, 16, {0},           0, GS,        0,           RF|RB|TC,   2000},
    {  1,   0, 2, 4, 128,  64, 32, {37,64,91},    1, GS,        0,           RF|RB,      3000},
    {  1,   0, 2, 2, 128,  64, 64, {37,64,91},    1, GS,        0,           RF,         4000},
    /* 150 tokens: three checkpoint segments of the recurrence backward */
    {  1,   0, 2, 2, 128,  64, 64, {37,150,91},   1, GS,        0,           RB,         4500},
    {  2, 130, 2, 4, 128,  64, 64, {0},           1, GS,        0,           RF|RB,      5000},
    /* K = V = 256: the state kernel's largest shared memory */
    {  1,  45, 1, 2, 256, 256, 32, {0},           1, GS,        0,           RF|RB|TC,   6000},
    {  2,  53, 2, 2,  80,  40, 16, {0},           1, GS,        0,           RF|RB|TC,   7000},
    /* steep gates: the factorised intra blocks must underflow to zero, never overflow */
    {  2,  70, 2, 2,  64,  64, 32, {0},           1, -45, -35,  0,           RF|TC,      8000},
    {  1,   0, 1, 2,  64,  64, 64, {1,64,20},     0, -45, -35,  0,           RF|TC,      9000},
    {  1,   0, 2, 4, 128, 128, 32, {37,64,91},    1, GS,        0,           TC,        21000},
    {  1, 150, 2, 2, 128, 128, 64, {0},           1, GS,        0,           TC,        28000},
    {  1,   0, 1, 3,  80,  40, 32, {1,33,20},     1, GS,        0,           TC,        42000},
    {  1,   0, 1, 2,  80,  40, 64, {7,70},        0, GS,        0,           TC,        49000},
    {  1, 130, 1, 1, 256, 256, 64, {0},           1, GS,        0,           TC,        63000},
    /* blocks on both sides of the intra kernels' middle-row limit (MID_SPAN = 40): some blocks /
     * key tiles factorised, others exact, within one chunk */
    {  2,  90, 2, 2, 128, 128, 64, {0},           1, -7, -0.01, 0,           TC,        77000},
    {  2,  45, 2, 4,  40,  24, 16, {0},           1, GS,        0,           OS|OC|OE,    500},
    {  1,   0, 1, 2,  64,  64, 32, {13,37,33},    1, GS,        GK|L2|SG,    OS|OC|OP,    600},
    {  1, 150, 1, 3,  33,  20, 64, {0},           0, GS,        0,           OS,          700},
    {  1,   0, 1, 2,  16,  24, 16, {7,23,1,23},   1, GS,        GL|L2|SG|NE, OC,         2200},
    {  1, 150, 2, 2,  48,  40, 64, {0},           1, GS,        GK|L2|SG,    OC,         2300},
    {  1,  70, 1, 1, 128, 128, 32, {0},           0, GS,        GL|L2|SG,    OC,         2400},
    {  2,   1, 1, 1,   8,   8, 16, {0},           1, GS,        0,           OC,         2500},
    {  1,  10, 1, 3,  20,  12, 64, {0},           0, GS,        GL|L2,       OC,         2600},
    /* g = -40 per step: exponents masked, never overflowed; the true dg cancels to ~1e-18 */
    {  1,  40, 1, 1,  16,  16, 16, {0},           1, -40, -40,  0,           OC,         2700},
};
/* clang-format on */

/* A case resolved: sizes, varlen tables, a name. */
typedef struct crun {
    const kcase *c;
    ct_layout L;
} crun;

static int const_gate(const kcase *c) { return c->glo == c->ghi; }

/* Case idx resolved: sizes, varlen tables and name; returns its groups. */
static unsigned case_layout(int idx, ct_layout *L) {
    const kcase *c = &kcases[idx];
    int nseq = 0;
    while (nseq < 4 && c->lens[nseq] > 0)
        nseq++;
    ct_layout_init(L, idx, c->B, c->T, nseq, c->lens, c->BT, c->H);
    if (c->HV != c->H)
        ct_name_add(L, " HV=%d (GVA)", c->HV);
    if (c->K == c->V)
        ct_name_add(L, " K=V=%d", c->K);
    else
        ct_name_add(L, " K=%d V=%d", c->K, c->V);
    if (c->h0)
        ct_name_add(L, " h0");
    if (const_gate(c))
        ct_name_add(L, " g=%g/step", c->glo);
    else if (c->glo != -0.5 || c->ghi != -0.01)
        ct_name_add(L, " g %g..%g/step", c->glo, c->ghi);
    if (c->runs & (OC | OP | OE))
        ct_name_add(L, "%s%s%s%s",
                    c->opt & GK   ? " KDA"
                    : c->opt & GL ? " LB"
                                  : "",
                    c->opt & L2 ? " l2" : "", c->opt & SG ? " sig" : "", c->opt & NE ? " neg" : "");
    return c->runs;
}

/* ---- tensors --------------------------------------------------------------------------------- */

/* Data pointer of a tensor; NULL stays NULL (an optional argument). F: as float (f32 tensors). */
static void *P(const dg_tensor *t) { return t ? dg_tensor_data(t) : NULL; }
static float *F(const dg_tensor *t) { return (float *)P(t); }

/* New tensor of dtype dt [n0, n1, n2, n3] (trailing zeros drop dims); mk: f32. */
static dg_tensor *mkt(dg_ctx *ctx, dg_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    int64_t s[4] = {n0, n1, n2, n3};
    int nd = n3 ? 4 : n2 ? 3 : n1 ? 2 : 1;
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, dt, nd, s, &t));
    return t;
}
static dg_tensor *mk(dg_ctx *ctx, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    return mkt(ctx, DG_F32, n0, n1, n2, n3);
}

/* Uniform in [lo, hi) (the same draws in f32 and f64: lo + (hi - lo) * dg_rand_u01(seed, i)). */
static dg_tensor *mk_rand(dg_ctx *ctx, dg_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                          uint64_t seed, double lo, double hi) {
    dg_tensor *t = mkt(ctx, dt, n0, n1, n2, n3);
    DG_TEST_TRY(dg_tensor_rand_uniform(t, seed, lo, hi));
    return t;
}

/* A device f32 output shaped like the reference `like` (NULL: none), filled with NaN so that an
 * element a kernel forgets to write fails the comparison. */
static dg_tensor *poisoned(dg_ctx *gpu, const dg_tensor *like) {
    if (!like)
        return NULL;
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F32, dg_tensor_ndim(like), dg_tensor_shape(like), &t));
    DG_TEST_TRY(dg_tensor_fill_(t, NAN));
    return t;
}

/* The device f32 copy (the f32 rounding of an f64 tensor); NULL (an absent input) stays NULL. */
static dg_tensor *up(dg_ctx *gpu, dg_tensor *t) {
    if (!t)
        return NULL;
    dg_tensor *g = NULL;
    if (dg_tensor_dtype(t) == DG_F32) {
        DG_TEST_TRY(dg_to_device(gpu, t, &g));
        return g;
    }
    double *x = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(t, &x));
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_F32, dg_tensor_ndim(t), dg_tensor_shape(t), x, &g));
    free(x);
    return g;
}

static double *host64(const dg_tensor *t) {
    double *x = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(t, &x));
    return x;
}

static void free_all(dg_tensor **t, size_t n) {
    for (size_t i = 0; i < n; i++)
        dg_tensor_free(&t[i]);
}

/* Two device results of the same call must be identical bit for bit. */
static void same_bits(const char *cname, const char *what, const dg_tensor *a, const dg_tensor *b) {
    const size_t n = dg_tensor_nbytes(a);
    char *ha = malloc(n ? n : 1), *hb = malloc(n ? n : 1);
    if (!ha || !hb) {
        fprintf(stderr, "FATAL: out of host memory\n");
        exit(1);
    }
    DG_TEST_TRY(dg_tensor_to_host(a, ha, n));
    DG_TEST_TRY(dg_tensor_to_host(b, hb, n));
    dg_check(dg_tensor_nbytes(b) == n && memcmp(ha, hb, n) == 0,
             "%s | %s: two runs agree bit for bit (deterministic)", cname, what);
    free(ha);
    free(hb);
}

/* ---- the raw kernels (groups RF, RB, TC) ----------------------------------------------------- */

/* The chunk tables of a case: on the host (cfg.d) and on the device (dd). */
typedef struct rtab {
    dg_kda_opts opts;
    kda_cfg cfg;
    kda_cuda_dims dd;
} rtab;

static void rtab_init(dg_ctx *cpu, dg_ctx *gpu, crun *r, rtab *t) {
    const kcase *c = r->c;
    memset(&t->opts, 0, sizeof t->opts);
    t->opts.chunk_size = c->BT;
    if (r->L.nseq) {
        t->opts.cu_seqlens = r->L.cu;
        t->opts.n_seqs = r->L.nseq;
    }
    DG_TEST_TRY(dg__kda_cfg_init("test_kda_cuda", cpu, &t->opts, r->L.B, r->L.T, c->H, c->HV, c->K,
                                 c->V, DG_F32, &t->cfg));
    DG_TEST_TRY(dg__kda_cuda_dims_new(gpu, r->L.TT, c->H, c->HV, c->K, c->V, c->BT, t->cfg.d.N,
                                      t->cfg.d.cu, t->cfg.d.chunk_off, &t->dd));
    if (ct_sel_x(S_TABLES, V_NONE)) {
        ct_cell(S_TABLES, D_FWD, V_NONE);
        dg_check(t->dd.NC == kda_cfg_nc(&t->cfg) && t->dd.NC == r->L.NC,
                 "%s: device tables hold NC=%lld chunks (CPU %lld)", r->L.name, (long long)t->dd.NC,
                 (long long)kda_cfg_nc(&t->cfg));
        dg_check(t->dd.tc == 0, "%s: dg__kda_cuda_dims_new leaves tc = 0", r->L.name);
    }
}

static void rtab_free(dg_ctx *gpu, rtab *t) {
    dg__kda_cuda_dims_free(gpu, &t->dd);
    dg__kda_cfg_free(&t->cfg);
}

/* A world: one input set of a case, the CPU chain of references computed from it in f32 (the
 * world of variant f32: kernels and references both compute in f32) or in f64 (the world of the
 * tc variants), and the device f32 copies of every stage input (suffix _d). Each stage is fed
 * the chain's own values, so an error points at one kernel. Inputs: q, k the L2-normalised rows
 * of uniform [-1, 1] draws, g uniform in the case's range, beta = sigmoid of uniform [-3, 3]
 * logits, v, h0 and upstream gradients uniform in [-1, 1]; the f64 world draws the same numbers.
 * Above the diagonal of Aqk and Tm (never to be read) the f32 world gives the backward stages junk
 * (and the forward stages the clean matrices); the f64 world gives every stage an Aqk with junk
 * there and the clean Tm. The upstream dAqk and dTm fill whole rows.
 * The mid world (variant mid, f64): W, U, KG, QG are rounded to bf16 right after the wy forward,
 * h, E right after the state forward and the upstream dh (stored like h) when drawn, so every
 * later stage of the chain (and every backward
 * reference) is computed from exactly the bf16 values the device holds (uploaded as bf16: the
 * upload of a bf16-exact value is exact); the forward stages producing them are compared against
 * the values before the rounding (Wo .. Eo). */
#define WORLD_MAXT 112

typedef struct world {
    const crun *r;
    const kda_dims *d;
    kda_cuda_dims *dd;
    dg_dtype dt;
    int mode, var; /* tc of the kernels being checked and its variant */
    int mid;       /* W, U, KG, QG, h, E stored as bf16 on the device (kda_cuda_dims.mid) */
    double tol;    /* the variant's tolerance */
    int64_t TT, NC;
    int N, H, HV, K, V, BT;
    double scale;
    /* host (dt) */
    dg_tensor *qraw, *kraw, *v, *graw, *braw, *h0, *xg, *Alog, *dtb;
    dg_tensor *q, *k, *rq, *beta, *beta2, *G, *Aqk, *Tm, *AqkB, *TmB, *W, *U, *KG, *QG, *h, *E, *ht,
        *O, *orec, *htrec;
    /* the references of the wy and state forward outputs: W .. E before the mid world's bf16
     * rounding (the same tensors outside it) */
    dg_tensor *Wo, *Uo, *KGo, *QGo, *ho, *Eo;
    dg_tensor *dy, *dbu, *dGu, *dAu, *dTu, *dWu, *dUu, *dKGu, *dQGu, *dhu, *dEu, *dht, *dO;
    /* device (f32); AqkF/TmF: what the forward stages get, AqkB/TmB the backward ones */
    dg_tensor *qraw_d, *kraw_d, *q_d, *k_d, *rq_d, *v_d, *graw_d, *braw_d, *h0_d, *xg_d, *Alog_d,
        *dtb_d, *beta_d, *G_d, *AqkF_d, *AqkB_d, *TmF_d, *TmB_d, *W_d, *U_d, *KG_d, *QG_d, *h_d,
        *E_d;
    dg_tensor *dy_d, *dbu_d, *dGu_d, *dAu_d, *dTu_d, *dWu_d, *dUu_d, *dKGu_d, *dQGu_d, *dhu_d,
        *dEu_d, *dht_d, *dO_d;
    dg_tensor *all[WORLD_MAXT];
    int nall;
} world;

/* The raw CPU function fn of the world's precision (array arguments as void pointers). */
#define REF(w, fn, ...)                                                                            \
    ((w)->dt == DG_F64 ? dg__kda_##fn##_f64(__VA_ARGS__) : dg__kda_##fn##_f32(__VA_ARGS__))

static dg_tensor *keep(world *w, dg_tensor *t) {
    if (w->nall >= WORLD_MAXT) {
        fprintf(stderr, "FATAL: world: more than %d tensors\n", WORLD_MAXT);
        exit(1);
    }
    w->all[w->nall++] = t;
    return t;
}

/* A host reference of the world's dtype. */
static dg_tensor *ref(const world *w, dg_ctx *cpu, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    return mkt(cpu, w->dt, n0, n1, n2, n3);
}

/* A copy of a per-chunk matrix [TT,HV,BT] with junk above the diagonal (column > row of the
 * chunk). */
static dg_tensor *junk_upper(world *w, dg_ctx *cpu, const dg_tensor *M) {
    const kda_dims *d = w->d;
    dg_tensor *t = keep(w, ref(w, cpu, w->TT, d->HV, d->BT, 0));
    DG_TEST_TRY(dg_tensor_copy_(t, M));
    void *m = P(t);
    for (int n = 0; n < d->N; n++)
        for (int64_t c = 0; c < kda_nchunks(d, n); c++) {
            kda_chunk ch = kda_chunk_at(d, n, c);
            for (int i = 0; i < ch.L; i++)
                for (int hv = 0; hv < d->HV; hv++)
                    for (int j = i + 1; j < d->BT; j++) {
                        const int64_t at = ((ch.t0 + i) * d->HV + hv) * d->BT + j;
                        if (w->dt == DG_F64)
                            ((double *)m)[at] = 1e3 + j;
                        else
                            ((float *)m)[at] = 1e3f + (float)j;
                    }
        }
    return t;
}

/* A kept copy of t (the value before round_bf16_ changes t). */
static dg_tensor *kept_copy(world *w, dg_ctx *cpu, const dg_tensor *t) {
    dg_tensor *c = NULL;
    DG_TEST_TRY(dg_tensor_new(cpu, dg_tensor_dtype(t), dg_tensor_ndim(t), dg_tensor_shape(t), &c));
    DG_TEST_TRY(dg_tensor_copy_(c, t));
    return keep(w, c);
}

/* Round the host f64 tensor t to bf16 in place (to nearest even, through a bf16 tensor: the same
 * conversion as any bf16 upload). */
static void round_bf16_(dg_ctx *cpu, dg_tensor *t) {
    double *x = host64(t);
    dg_tensor *b = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_BF16, dg_tensor_ndim(t), dg_tensor_shape(t), x, &b));
    free(x);
    x = host64(b);
    memcpy(P(t), x, (size_t)dg_tensor_numel(t) * sizeof(double));
    free(x);
    dg_tensor_free(&b);
}

/* The device copy of a world input: bf16 for the mid intermediates of the mid world (their host
 * values are bf16-exact there), else f32 (up). */
static dg_tensor *up_mid(dg_ctx *gpu, const world *w, dg_tensor *t) {
    if (!w->mid || !t)
        return up(gpu, t);
    double *x = host64(t);
    dg_tensor *g = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_BF16, dg_tensor_ndim(t), dg_tensor_shape(t), x, &g));
    free(x);
    return g;
}

/* A poisoned device output for one of the mid intermediates: bf16 in the mid world. */
static dg_tensor *poisoned_mid(dg_ctx *gpu, const world *w, const dg_tensor *like) {
    if (!w->mid)
        return poisoned(gpu, like);
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_BF16, dg_tensor_ndim(like), dg_tensor_shape(like), &t));
    DG_TEST_TRY(dg_tensor_fill_(t, NAN));
    return t;
}

/* mid: the world of variant mid (dt must be DG_F64). */
static void world_setup(dg_ctx *cpu, dg_ctx *gpu, const crun *r, rtab *tab, dg_dtype dt, int mid,
                        world *w) {
    memset(w, 0, sizeof *w);
    const kcase *c = r->c;
    const kda_dims *d = &tab->cfg.d;
    const int f64 = dt == DG_F64;
    w->r = r;
    w->d = d;
    w->dd = &tab->dd;
    w->dt = dt;
    w->mid = mid;
    const int64_t TT = r->L.TT, NC = r->L.NC;
    const int N = r->L.N, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    w->TT = TT;
    w->NC = NC;
    w->N = N;
    w->H = H;
    w->HV = HV;
    w->K = K;
    w->V = V;
    w->BT = BT;
    w->scale = f64 ? 1.0 / sqrt((double)K) : (double)(1.0f / sqrtf((float)K));
    const double scale = w->scale;
    const uint64_t s = c->seed;

    /* inputs */
    w->qraw = keep(w, mk_rand(cpu, dt, TT, H, K, 0, s + 1, -1, 1));
    w->kraw = keep(w, mk_rand(cpu, dt, TT, H, K, 0, s + 2, -1, 1));
    w->v = keep(w, mk_rand(cpu, dt, TT, HV, V, 0, s + 3, -1, 1));
    w->graw = keep(w, mk_rand(cpu, dt, TT, HV, K, 0, s + 4, c->glo, c->ghi));
    w->braw = keep(w, mk_rand(cpu, dt, TT, HV, 0, 0, s + 5, -3, 3));
    w->h0 = keep(w, c->h0 ? mk_rand(cpu, dt, N, HV, K, V, s + 6, -1, 1) : NULL);
    w->xg = keep(w, mk_rand(cpu, dt, TT, HV, K, 0, s + 7, -3, 3));
    w->Alog = keep(w, mk_rand(cpu, dt, HV, 0, 0, 0, s + 8, 0, 2.77)); /* log U(1,16) */
    w->dtb = keep(w, mk_rand(cpu, dt, (int64_t)HV * K, 0, 0, 0, s + 9, -1, 1));

    /* the CPU chain of references */
    w->q = keep(w, ref(w, cpu, TT, H, K, 0));
    w->k = keep(w, ref(w, cpu, TT, H, K, 0));
    w->rq = keep(w, ref(w, cpu, TT, H, 0, 0));
    (void)dg__l2norm_run_fwd(NULL, 0, w->dt, TT * H, K, KDA_L2_EPS, 0, P(w->qraw), P(w->q),
                             P(w->rq)); /* the CPU: cannot fail */
    (void)dg__l2norm_run_fwd(NULL, 0, w->dt, TT * H, K, KDA_L2_EPS, 0, P(w->kraw), P(w->k), NULL);
    w->beta = keep(w, ref(w, cpu, TT, HV, 0, 0));
    w->beta2 = keep(w, ref(w, cpu, TT, HV, 0, 0));
    REF(w, beta_fwd, TT * HV, 1.0, P(w->braw), P(w->beta));
    REF(w, beta_fwd, TT * HV, 2.0, P(w->braw), P(w->beta2));
    w->G = keep(w, ref(w, cpu, TT, HV, K, 0));
    REF(w, gate_fwd, d, DG_GATE_NONE, 0.0, 1, P(w->graw), NULL, NULL, P(w->G));
    w->Aqk = keep(w, ref(w, cpu, TT, HV, BT, 0));
    w->Tm = keep(w, ref(w, cpu, TT, HV, BT, 0));
    DG_TEST_TRY(
        REF(w, intra_fwd, d, scale, P(w->q), P(w->k), P(w->beta), P(w->G), P(w->Aqk), P(w->Tm)));
    w->W = keep(w, ref(w, cpu, TT, HV, K, 0));
    w->U = keep(w, ref(w, cpu, TT, HV, V, 0));
    w->KG = keep(w, ref(w, cpu, TT, HV, K, 0));
    w->QG = keep(w, ref(w, cpu, TT, HV, K, 0));
    DG_TEST_TRY(REF(w, wy_fwd, d, P(w->q), P(w->k), P(w->v), P(w->beta), P(w->G), P(w->Tm), P(w->W),
                    P(w->U), P(w->KG), P(w->QG)));
    dg_tensor **mw[4] = {&w->W, &w->U, &w->KG, &w->QG},
              **mwo[4] = {&w->Wo, &w->Uo, &w->KGo, &w->QGo};
    for (int i = 0; i < 4; i++) {
        *mwo[i] = mid ? kept_copy(w, cpu, *mw[i]) : *mw[i];
        if (mid)
            round_bf16_(cpu, *mw[i]);
    }
    w->h = keep(w, ref(w, cpu, NC, HV, K, V));
    w->E = keep(w, ref(w, cpu, TT, HV, V, 0));
    w->ht = keep(w, ref(w, cpu, N, HV, K, V));
    DG_TEST_TRY(REF(w, state_fwd, d, P(w->W), P(w->U), P(w->KG), P(w->G), P(w->h0), P(w->h),
                    P(w->E), P(w->ht)));
    w->ho = mid ? kept_copy(w, cpu, w->h) : w->h;
    w->Eo = mid ? kept_copy(w, cpu, w->E) : w->E;
    if (mid) {
        round_bf16_(cpu, w->h);
        round_bf16_(cpu, w->E);
    }
    w->O = keep(w, ref(w, cpu, TT, HV, V, 0));
    REF(w, output_fwd, d, scale, P(w->QG), P(w->h), P(w->Aqk), P(w->E), P(w->O));
    w->orec = keep(w, ref(w, cpu, TT, HV, V, 0));
    w->htrec = keep(w, ref(w, cpu, N, HV, K, V));
    DG_TEST_TRY(REF(w, recurrent_fwd, d, scale, P(w->q), P(w->k), P(w->v), P(w->graw), P(w->beta),
                    P(w->h0), P(w->orec), P(w->htrec)));

    /* junk above the diagonal, and upstream gradients uniform in [-1, 1] */
    dg_tensor *AqkJ = junk_upper(w, cpu, w->Aqk), *TmJ = f64 ? NULL : junk_upper(w, cpu, w->Tm);
    w->AqkB = f64 ? w->Aqk : AqkJ;
    w->TmB = f64 ? w->Tm : TmJ;
    w->dy = keep(w, mk_rand(cpu, dt, TT, H, K, 0, s + 10, -1, 1));
    w->dbu = keep(w, mk_rand(cpu, dt, TT, HV, 0, 0, s + 11, -1, 1));
    w->dGu = keep(w, mk_rand(cpu, dt, TT, HV, K, 0, s + 12, -1, 1));
    w->dAu = keep(w, mk_rand(cpu, dt, TT, HV, BT, 0, s + 13, -1, 1));
    w->dTu = keep(w, mk_rand(cpu, dt, TT, HV, BT, 0, s + 14, -1, 1));
    w->dWu = keep(w, mk_rand(cpu, dt, TT, HV, K, 0, s + 15, -1, 1));
    w->dUu = keep(w, mk_rand(cpu, dt, TT, HV, V, 0, s + 16, -1, 1));
    w->dKGu = keep(w, mk_rand(cpu, dt, TT, HV, K, 0, s + 17, -1, 1));
    w->dQGu = keep(w, mk_rand(cpu, dt, TT, HV, K, 0, s + 18, -1, 1));
    w->dhu = keep(w, mk_rand(cpu, dt, NC, HV, K, V, s + 19, -1, 1));
    if (mid) /* h's gradient is stored like h */
        round_bf16_(cpu, w->dhu);
    w->dEu = keep(w, mk_rand(cpu, dt, TT, HV, V, 0, s + 20, -1, 1));
    w->dht = keep(w, mk_rand(cpu, dt, N, HV, K, V, s + 21, -1, 1));
    w->dO = keep(w, mk_rand(cpu, dt, TT, HV, V, 0, s + 22, -1, 1));

    /* the same on the device */
    dg_tensor **to[] = {&w->qraw_d, &w->kraw_d, &w->q_d,   &w->k_d,    &w->rq_d,   &w->v_d,
                        &w->graw_d, &w->braw_d, &w->h0_d,  &w->xg_d,   &w->Alog_d, &w->dtb_d,
                        &w->beta_d, &w->G_d,    &w->W_d,   &w->U_d,    &w->KG_d,   &w->QG_d,
                        &w->h_d,    &w->E_d,    &w->dy_d,  &w->dbu_d,  &w->dGu_d,  &w->dAu_d,
                        &w->dTu_d,  &w->dWu_d,  &w->dUu_d, &w->dKGu_d, &w->dQGu_d, &w->dhu_d,
                        &w->dEu_d,  &w->dht_d,  &w->dO_d};
    dg_tensor *from[] = {w->qraw, w->kraw, w->q,   w->k,    w->rq,  w->v,    w->graw,
                         w->braw, w->h0,   w->xg,  w->Alog, w->dtb, w->beta, w->G,
                         w->W,    w->U,    w->KG,  w->QG,   w->h,   w->E,    w->dy,
                         w->dbu,  w->dGu,  w->dAu, w->dTu,  w->dWu, w->dUu,  w->dKGu,
                         w->dQGu, w->dhu,  w->dEu, w->dht,  w->dO};
    for (size_t i = 0; i < NELEM(to); i++) {
        const int m = from[i] == w->W || from[i] == w->U || from[i] == w->KG || from[i] == w->QG ||
                      from[i] == w->h || from[i] == w->E || from[i] == w->dhu;
        *to[i] = keep(w, m ? up_mid(gpu, w, from[i]) : up(gpu, from[i]));
    }
    w->AqkF_d = keep(w, up(gpu, f64 ? AqkJ : w->Aqk));
    w->AqkB_d = f64 ? w->AqkF_d : keep(w, up(gpu, AqkJ));
    w->TmF_d = keep(w, up(gpu, w->Tm));
    w->TmB_d = f64 ? w->TmF_d : keep(w, up(gpu, TmJ));
}

static void world_free(world *w) { free_all(w->all, (size_t)w->nall); }

static const char *mode_label(const world *w) { return var_name[w->var]; }

/* Host values g (freed here) of a device result against the host reference want (f32 or f64),
 * norm-relative within tol; floor > 0: the error is measured against at least floor (see
 * raw_floor). */
static void wcmp_host(const world *w, const char *kern, const char *what, double *g,
                      const dg_tensor *want, double floor, double tol) {
    double *x = host64(want);
    const int64_t n = dg_tensor_numel(want);
    double num = 0, den = floor;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(g[i]) || !isfinite(x[i]))
            finite = 0;
        num = fmax(num, fabs(g[i] - x[i]));
        den = fmax(den, fabs(x[i]));
    }
    const double rel = finite ? num / (den > 1e-12 ? den : 1e-12) : INFINITY;
    ct_note_err(rel);
    char name[240];
    snprintf(name, sizeof name, "%s | %s %s %s", w->r->L.name, mode_label(w), kern, what);
    if (floor > 0)
        dg_check(rel <= tol, "%s: rel err %.3e against max(max|want|, %.3e) (tol %g)", name, rel,
                 floor, tol);
    else
        dg_check_rel(name, g, x, n, tol);
    free(g);
    free(x);
}

static void wcmp_tol(const world *w, const char *kern, const char *what, const dg_tensor *got,
                     const dg_tensor *want, double floor, double tol) {
    wcmp_host(w, kern, what, host64(got), want, floor, tol);
}

static void wcmp(const world *w, const char *kern, const char *what, const dg_tensor *got,
                 const dg_tensor *want) {
    wcmp_tol(w, kern, what, got, want, 0.0, w->tol);
}

/* wcmp for an output stored in the intermediates' storage (W, U, KG, QG, h, E): TOL_MID in the
 * mid world. */
static void wcmp_mid(const world *w, const char *kern, const char *what, const dg_tensor *got,
                     const dg_tensor *want) {
    wcmp_tol(w, kern, what, got, want, 0.0, w->mid ? TOL_MID : w->tol);
}

static double max_abs_t(const dg_tensor *t) {
    double *x = host64(t), m = 0;
    for (int64_t i = 0; i < dg_tensor_numel(t); i++)
        m = fmax(m, fabs(x[i]));
    free(x);
    return m;
}

/* The floor of a dG comparison against f64 (0 in the f32 world, which compares plainly): dG is a
 * difference of larger terms (intra: q.Rq + k.Rk - k.C; wy: q dQG gamma - k a + X dX), and the f32
 * kernels round at the size of those terms, not of what is left after they cancel (with steep
 * gates the intra dG cancels to ~1e-17 exactly, the diagonal terms q dA k - k dA q). */
static double raw_floor(const world *w, const dg_tensor *dq, const dg_tensor *dk) {
    if (w->dt != DG_F64)
        return 0.0;
    return max_abs_t(w->q) * max_abs_t(dq) + max_abs_t(w->k) * max_abs_t(dk);
}

/* The acc mode: got started from the device rounding of pre; what the kernel added is got - pre,
 * compared like wcmp_tol. */
static void wcmp_added(const world *w, const char *kern, const char *what, const dg_tensor *got,
                       const dg_tensor *pre, const dg_tensor *want, double floor) {
    double *g = host64(got), *p0 = host64(pre);
    for (int64_t i = 0; i < dg_tensor_numel(want); i++)
        g[i] -= p0[i];
    free(p0);
    wcmp_host(w, kern, what, g, want, floor, w->tol);
}

/* A device f32 copy of a random start value per element for the acc mode, in [-s, s] with s
 * half the largest expected addition (like accumulating gradients of similar size; far larger
 * start values would swallow what is added below their own f32 rounding). */
static dg_tensor *start_values(dg_ctx *gpu, uint64_t seed, const dg_tensor *want) {
    const int64_t n = dg_tensor_numel(want);
    if (n < 1 || n > ((int64_t)1 << 40)) {
        fprintf(stderr, "FATAL: start_values: bad size %lld\n", (long long)n);
        exit(1);
    }
    double amp = max_abs_t(want);
    amp = amp > 0 ? 0.5 * amp : 1e-30;
    double *x = kt_rand(n, seed, -amp, amp);
    dg_tensor *t = NULL;
    DG_TEST_TRY(
        dg_tensor_from_f64(gpu, DG_F32, dg_tensor_ndim(want), dg_tensor_shape(want), x, &t));
    free(x);
    return t;
}

/* The gate kinds of both directions (x: g for NONE, else the gate logits xg). */
static const struct gate_kind {
    const char *what;
    dg_gate_kind kind;
    int cumsum, use_A, use_b, bwd_only;
} gate_kinds[] = {
    {"NONE cumsum", DG_GATE_NONE, 1, 0, 0, 0},
    {"NONE no cumsum", DG_GATE_NONE, 0, 0, 0, 1},
    {"KDA cumsum", DG_GATE_KDA, 1, 1, 1, 0},
    {"KDA no cumsum", DG_GATE_KDA, 0, 1, 1, 0},
    {"KDA cumsum no dt_bias", DG_GATE_KDA, 1, 1, 0, 0},
    {"LOWERBOUND cumsum", DG_GATE_LOWERBOUND, 1, 1, 1, 0},
    {"LOWERBOUND no A_log/dt_bias", DG_GATE_LOWERBOUND, 1, 0, 0, 0},
};

/* -- the forward stages */

static void raw_fwd(dg_ctx *cpu, dg_ctx *gpu, world *w, int s) {
    const kda_dims *d = w->d;
    const kda_cuda_dims *dd = w->dd;
    const int64_t TT = w->TT;
    const int H = w->H, HV = w->HV, K = w->K, f64 = w->dt == DG_F64;
    const float scale = (float)w->scale;
    dg_tensor *o1, *o2, *o3, *o4;
    ct_cell(s, D_FWD, w->var);
    switch (s) {
    case S_L2: /* y and 1/norm of the raw q rows */
        o1 = poisoned(gpu, w->q);
        o2 = poisoned(gpu, w->rq);
        dg_check_ok(dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 0, F(w->qraw_d), F(o1), F(o2)),
                    "l2norm launch");
        wcmp(w, "kda_l2norm_fwd", "y", o1, w->q);
        wcmp(w, "kda_l2norm_fwd", "r", o2, w->rq);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        break;
    case S_BETA: /* c = 1 and c = 2 */
        o1 = poisoned(gpu, w->beta);
        o2 = poisoned(gpu, w->beta);
        dg_check_ok(dg__kda_beta_fwd_cuda(gpu, TT * HV, 1.0f, 0, F(w->braw_d), F(o1)),
                    "beta c=1 launch");
        dg_check_ok(dg__kda_beta_fwd_cuda(gpu, TT * HV, 2.0f, 0, F(w->braw_d), F(o2)),
                    "beta c=2 launch");
        wcmp(w, "kda_beta_fwd", "c=1", o1, w->beta);
        wcmp(w, "kda_beta_fwd", "c=2", o2, w->beta2);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        break;
    case S_GATE: /* every kind, with and without the chunk cumsum */
        for (size_t i = 0; i < NELEM(gate_kinds); i++) {
            const struct gate_kind *gk = &gate_kinds[i];
            if (gk->bwd_only)
                continue;
            const int none = gk->kind == DG_GATE_NONE;
            dg_tensor *want = ref(w, cpu, TT, HV, K, 0);
            REF(w, gate_fwd, d, gk->kind, -5.0, gk->cumsum, P(none ? w->graw : w->xg),
                gk->use_A ? P(w->Alog) : NULL, gk->use_b ? P(w->dtb) : NULL, P(want));
            o1 = poisoned(gpu, want);
            dg_check_ok(dg__kda_gate_fwd_cuda(
                            gpu, dd, gk->kind, -5.0f, gk->cumsum, 0, F(none ? w->graw_d : w->xg_d),
                            gk->use_A ? F(w->Alog_d) : NULL, gk->use_b ? F(w->dtb_d) : NULL, F(o1)),
                        "gate launch");
            wcmp(w, "kda_gate_fwd", gk->what, o1, want);
            dg_tensor_free(&o1);
            dg_tensor_free(&want);
        }
        break;
    case S_INTRA:
        o1 = poisoned(gpu, w->Aqk);
        o2 = poisoned(gpu, w->Tm);
        dg_check_ok(dg__kda_intra_fwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d), F(w->beta_d),
                                           F(w->G_d), F(o1), F(o2)),
                    "intra launch");
        wcmp(w, "kda_intra_fwd", "Aqk", o1, w->Aqk);
        wcmp(w, "kda_intra_fwd", "Tm", o2, w->Tm);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        break;
    case S_WY: /* all four outputs, then W alone, then U with QG (f32) or U alone (f64), then KG
                  and QG alone: NULL outputs are skipped */
        o1 = poisoned_mid(gpu, w, w->W);
        o2 = poisoned_mid(gpu, w, w->U);
        o3 = poisoned_mid(gpu, w, w->KG);
        o4 = poisoned_mid(gpu, w, w->QG);
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, dd, F(w->q_d), F(w->k_d), F(w->v_d), F(w->beta_d),
                                        F(w->G_d), F(w->TmF_d), F(o1), F(o2), F(o3), F(o4)),
                    "wy launch");
        wcmp_mid(w, "kda_wy_fwd", "W", o1, w->Wo);
        wcmp_mid(w, "kda_wy_fwd", "U", o2, w->Uo);
        wcmp_mid(w, "kda_wy_fwd", "KG", o3, w->KGo);
        wcmp_mid(w, "kda_wy_fwd", "QG", o4, w->QGo);
        DG_TEST_TRY(dg_tensor_fill_(o1, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o4, NAN));
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, dd, NULL, F(w->k_d), NULL, F(w->beta_d), F(w->G_d),
                                        F(w->TmF_d), F(o1), NULL, NULL, NULL),
                    "wy launch (W only)");
        wcmp_mid(w, "kda_wy_fwd", "W (alone)", o1, w->Wo);
        if (f64) {
            dg_check_ok(dg__kda_wy_fwd_cuda(gpu, dd, NULL, NULL, F(w->v_d), F(w->beta_d), F(w->G_d),
                                            F(w->TmF_d), NULL, F(o2), NULL, NULL),
                        "wy launch (U only)");
            wcmp_mid(w, "kda_wy_fwd", "U (alone)", o2, w->Uo);
        } else {
            dg_check_ok(dg__kda_wy_fwd_cuda(gpu, dd, F(w->q_d), NULL, F(w->v_d), F(w->beta_d),
                                            F(w->G_d), F(w->TmF_d), NULL, F(o2), NULL, F(o4)),
                        "wy launch (U and QG)");
            wcmp_mid(w, "kda_wy_fwd", "U (with QG)", o2, w->Uo);
            wcmp_mid(w, "kda_wy_fwd", "QG (with U)", o4, w->QGo);
        }
        /* KG and QG alone need neither beta, Tm nor v: NULL ones must not be read */
        DG_TEST_TRY(dg_tensor_fill_(o3, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o4, NAN));
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, dd, F(w->q_d), F(w->k_d), NULL, NULL, F(w->G_d), NULL,
                                        NULL, NULL, F(o3), F(o4)),
                    "wy launch (KG and QG alone)");
        wcmp_mid(w, "kda_wy_fwd", "KG (with QG alone)", o3, w->KGo);
        wcmp_mid(w, "kda_wy_fwd", "QG (with KG alone)", o4, w->QGo);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        dg_tensor_free(&o3);
        dg_tensor_free(&o4);
        break;
    case S_STATE: /* with and without ht */
        o1 = poisoned_mid(gpu, w, w->h);
        o2 = poisoned_mid(gpu, w, w->E);
        o3 = poisoned(gpu, w->ht);
        dg_check_ok(dg__kda_state_fwd_cuda(gpu, dd, F(w->W_d), F(w->U_d), F(w->KG_d), F(w->G_d),
                                           F(w->h0_d), F(o1), F(o2), F(o3)),
                    "state launch");
        wcmp_mid(w, "kda_state_fwd", "h", o1, w->ho);
        wcmp_mid(w, "kda_state_fwd", "E", o2, w->Eo);
        wcmp(w, "kda_state_fwd", "ht", o3, w->ht);
        DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
        dg_check_ok(dg__kda_state_fwd_cuda(gpu, dd, F(w->W_d), F(w->U_d), F(w->KG_d), F(w->G_d),
                                           F(w->h0_d), F(o1), F(o2), NULL),
                    "state launch (no ht)");
        wcmp_mid(w, "kda_state_fwd", "E (no ht)", o2, w->Eo);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        dg_tensor_free(&o3);
        break;
    case S_OUTPUT:
        o1 = poisoned(gpu, w->O);
        dg_check_ok(dg__kda_output_fwd_cuda(gpu, dd, scale, F(w->QG_d), F(w->h_d), F(w->AqkF_d),
                                            F(w->E_d), F(o1)),
                    "output launch");
        wcmp(w, "kda_output_fwd", "O", o1, w->O);
        dg_tensor_free(&o1);
        break;
    case S_REC:
        o1 = poisoned(gpu, w->orec);
        o2 = poisoned(gpu, w->htrec);
        dg_check_ok(dg__kda_recurrent_fwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d), F(w->v_d),
                                               F(w->graw_d), F(w->beta_d), F(w->h0_d), F(o1),
                                               F(o2)),
                    "recurrent launch");
        wcmp(w, "kda_recurrent_fwd", "o", o1, w->orec);
        wcmp(w, "kda_recurrent_fwd", "ht", o2, w->htrec);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        break;
    case S_CHUNK: { /* the whole chunked forward on the device (from raw q, k, g, b) against the
                       device recurrence */
        dg_tensor *ro = poisoned(gpu, w->orec), *rht = poisoned(gpu, w->htrec);
        dg_tensor *qd = poisoned(gpu, w->q), *kd = poisoned(gpu, w->k);
        dg_tensor *bd = poisoned(gpu, w->beta), *Gd = poisoned(gpu, w->G);
        dg_tensor *Ad = poisoned(gpu, w->Aqk), *Td = poisoned(gpu, w->Tm);
        dg_tensor *Wd = poisoned(gpu, w->W), *Ud = poisoned(gpu, w->U);
        dg_tensor *KGd = poisoned(gpu, w->KG), *QGd = poisoned(gpu, w->QG);
        dg_tensor *hd = poisoned(gpu, w->h), *Ed = poisoned(gpu, w->E);
        dg_tensor *htd = poisoned(gpu, w->ht), *Od = poisoned(gpu, w->O);
        dg_status st =
            dg__kda_recurrent_fwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d), F(w->v_d),
                                       F(w->graw_d), F(w->beta_d), F(w->h0_d), F(ro), F(rht));
        if (st == DG_OK)
            st = dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 0, F(w->qraw_d), F(qd), NULL);
        if (st == DG_OK)
            st = dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 0, F(w->kraw_d), F(kd), NULL);
        if (st == DG_OK)
            st = dg__kda_beta_fwd_cuda(gpu, TT * HV, 1.0f, 0, F(w->braw_d), F(bd));
        if (st == DG_OK)
            st = dg__kda_gate_fwd_cuda(gpu, dd, DG_GATE_NONE, 0.f, 1, 0, F(w->graw_d), NULL, NULL,
                                       F(Gd));
        if (st == DG_OK)
            st = dg__kda_intra_fwd_cuda(gpu, dd, scale, F(qd), F(kd), F(bd), F(Gd), F(Ad), F(Td));
        if (st == DG_OK)
            st = dg__kda_wy_fwd_cuda(gpu, dd, F(qd), F(kd), F(w->v_d), F(bd), F(Gd), F(Td), F(Wd),
                                     F(Ud), F(KGd), F(QGd));
        if (st == DG_OK)
            st = dg__kda_state_fwd_cuda(gpu, dd, F(Wd), F(Ud), F(KGd), F(Gd), F(w->h0_d), F(hd),
                                        F(Ed), F(htd));
        if (st == DG_OK)
            st = dg__kda_output_fwd_cuda(gpu, dd, scale, F(QGd), F(hd), F(Ad), F(Ed), F(Od));
        if (dg_check_ok(st, "chunked pipeline and recurrence on the device")) {
            wcmp_tol(w, "chunked vs recurrent (GPU)", "O", Od, ro, 0.0, TOL_RAW_CHUNK_VS_REC);
            wcmp_tol(w, "chunked vs recurrent (GPU)", "final state", htd, rht, 0.0,
                     TOL_RAW_CHUNK_VS_REC);
        }
        dg_tensor *all[] = {ro, rht, qd, kd, bd, Gd, Ad, Td, Wd, Ud, KGd, QGd, hd, Ed, htd, Od};
        free_all(all, NELEM(all));
        break;
    }
    default:
        break;
    }
}

/* -- the backward stages */

/* acc of the intra backward: dq, dk, dG added to start values. o: the dq, dk, dbeta, dG outputs;
 * want: the references with both upstream gradients. */
static void raw_intra_acc(dg_ctx *gpu, world *w, dg_tensor *const *o, dg_tensor *const *want,
                          double floor) {
    const uint64_t seed = w->r->c->seed;
    const char *kn = "kda_intra_bwd";
    ct_cell(S_INTRA, D_ACC, w->var);
    dg_tensor *p1 = start_values(gpu, seed + 21, want[0]);
    dg_tensor *p2 = start_values(gpu, seed + 22, want[1]);
    dg_tensor *p4 = start_values(gpu, seed + 23, want[3]);
    DG_TEST_TRY(dg_tensor_copy_(o[0], p1));
    DG_TEST_TRY(dg_tensor_copy_(o[1], p2));
    DG_TEST_TRY(dg_tensor_copy_(o[3], p4));
    dg_check_ok(dg__kda_intra_bwd_cuda(gpu, w->dd, (float)w->scale, F(w->q_d), F(w->k_d),
                                       F(w->beta_d), F(w->G_d), F(w->TmB_d), F(w->dAu_d),
                                       F(w->dTu_d), F(o[0]), F(o[1]), F(o[2]), F(o[3]),
                                       KDA_ACC_DQ | KDA_ACC_DK | KDA_ACC_DG),
                "intra bwd launch (acc)");
    wcmp_added(w, kn, "dq (acc)", o[0], p1, want[0], 0.0);
    wcmp_added(w, kn, "dk (acc)", o[1], p2, want[1], 0.0);
    wcmp(w, kn, "dbeta (with acc)", o[2], want[2]);
    wcmp_added(w, kn, "dG (acc)", o[3], p4, want[3], floor);
    dg_tensor_free(&p1);
    dg_tensor_free(&p2);
    dg_tensor_free(&p4);
    ct_cell(S_INTRA, D_BWD, w->var);
}

/* The WY backward with v as the op's bf16 leaf (kda_cuda_dims.leaf_bf16): v read and dv written
 * as bf16 (as stored on the mma path at tc == 1, through f32 copies otherwise), against the f64
 * reference on the same bf16-rounded v. dv is held to TOL_MID (its final rounding), the other
 * outputs to the variant's tolerance. Run in the f64 worlds of ffma, tf32 and 3xtf32 (tc = 1
 * takes the mma path, the others the f32 copies) and counted in the table's mid column (bf16
 * storage on the device), so the variants' own wy bwd cells keep their f32 outputs' errors. */
static void raw_wy_leaf_bf16(dg_ctx *cpu, dg_ctx *gpu, world *w, dg_tensor *uW, dg_tensor *uU,
                             dg_tensor *uKG, dg_tensor *uQG) {
    const kda_dims *d = w->d;
    const int64_t TT = w->TT;
    const int H = w->H, HV = w->HV, K = w->K, V = w->V, BT = w->BT;
    static const char *nm[6] = {"dq", "dk", "dv", "dbeta", "dG", "dTm"};
    char what[96];
    dg_tensor *vr = NULL, *vb_d = NULL;
    const int nd = dg_tensor_ndim(w->v);
    DG_TEST_TRY(dg_tensor_new(cpu, dg_tensor_dtype(w->v), nd, dg_tensor_shape(w->v), &vr));
    DG_TEST_TRY(dg_tensor_copy_(vr, w->v));
    round_bf16_(cpu, vr);
    double *x = host64(vr);
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_BF16, nd, dg_tensor_shape(vr), x, &vb_d));
    free(x);
    dg_tensor *want[6] = {ref(w, cpu, TT, H, K, 0),  ref(w, cpu, TT, H, K, 0),
                          ref(w, cpu, TT, HV, V, 0), ref(w, cpu, TT, HV, 0, 0),
                          ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, BT, 0)};
    DG_TEST_TRY(REF(w, wy_bwd, d, P(w->q), P(w->k), P(vr), P(w->beta), P(w->G), P(w->TmB), P(uW),
                    P(uU), P(uKG), P(uQG), P(want[0]), P(want[1]), P(want[2]), P(want[3]),
                    P(want[4]), P(want[5])));
    const double floor = raw_floor(w, want[0], want[1]);
    dg_tensor *o[6];
    for (int i = 0; i < 6; i++)
        if (i == 2) {
            DG_TEST_TRY(dg_tensor_new(gpu, DG_BF16, dg_tensor_ndim(want[2]),
                                      dg_tensor_shape(want[2]), &o[i]));
            DG_TEST_TRY(dg_tensor_fill_(o[i], NAN));
        } else {
            o[i] = poisoned(gpu, want[i]);
        }
    kda_cuda_dims lb = *w->dd;
    lb.leaf_bf16 = 1;
    ct_cell(S_WY, D_BWD, V_MID);
    dg_check_ok(dg__kda_wy_bwd_cuda(gpu, &lb, F(w->q_d), F(w->k_d), F(vb_d), F(w->beta_d),
                                    F(w->G_d), F(w->TmB_d), F(w->dWu_d), F(w->dUu_d), F(w->dKGu_d),
                                    F(w->dQGu_d), F(o[0]), F(o[1]), F(o[2]), F(o[3]), F(o[4]),
                                    F(o[5]), 0),
                "wy bwd launch (bf16 v, dv)");
    for (int i = 0; i < 6; i++) {
        snprintf(what, sizeof what, "%s (bf16 v, dv)", nm[i]);
        wcmp_tol(w, "kda_wy_bwd", what, o[i], want[i], i == 4 ? floor : 0.0,
                 i == 2 ? TOL_MID : w->tol);
    }
    ct_cell(S_WY, D_BWD, w->var);
    free_all(want, 6);
    free_all(o, 6);
    dg_tensor_free(&vr);
    dg_tensor_free(&vb_d);
}
/* A device bf16 copy of the host tensor t, and (*rounded, the caller's) t rounded to bf16. */
static dg_tensor *bf16_dev(dg_ctx *cpu, dg_ctx *gpu, const dg_tensor *t, dg_tensor **rounded) {
    *rounded = NULL;
    DG_TEST_TRY(
        dg_tensor_new(cpu, dg_tensor_dtype(t), dg_tensor_ndim(t), dg_tensor_shape(t), rounded));
    DG_TEST_TRY(dg_tensor_copy_(*rounded, t));
    round_bf16_(cpu, *rounded);
    double *x = host64(*rounded);
    dg_tensor *g = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_BF16, dg_tensor_ndim(t), dg_tensor_shape(t), x, &g));
    free(x);
    return g;
}

/* The n outputs f of a factored call against o, the same call on the stored rows (the same
 * bits), and want, the f64 references (output fi above the world's floor; mid: outputs stored
 * like the intermediates); frees all three sets. */
static void factored_cmp(const world *w, const char *kern, const char *stage, const char *const *nm,
                         int n, dg_tensor **o, dg_tensor **f, dg_tensor **want, int fi,
                         double floor, int mid) {
    char what[96];
    for (int i = 0; i < n; i++) {
        snprintf(what, sizeof what, "%s %s factored == from y", stage, nm[i]);
        same_bits(w->r->L.name, what, o[i], f[i]);
        snprintf(what, sizeof what, "%s (factored)", nm[i]);
        if (mid)
            wcmp_mid(w, kern, what, f[i], want[i]);
        else
            wcmp_tol(w, kern, what, f[i], want[i], i == fi ? floor : 0.0, w->tol);
    }
    free_all(want, (size_t)n);
    free_all(o, (size_t)n);
    free_all(f, (size_t)n);
}

/* Factored q, k (kda_cuda_dims.qk_bf16, rq, rk): the in-op L2 norm's bf16 input rows x and their
 * reciprocal norms r, instead of the f32 rows y = x r. The intra backward, the WY functions
 * (both directions) and the norm's backward must give exactly what they give from y -- bit for
 * bit: they form the same products -- and agree with the f64 references on the normalised rows
 * of the bf16 x. The tensor-core intra forward sums the products of the rows as stored and
 * applies the scales to each finished element (the sums are bilinear in the rows), so it rounds
 * differently from y's and is held to the f64 reference alone, with the variant's tolerance (the
 * FFMA intra forward, which takes the rows widened to y, keeps the same-bits check). Run in the f64
 * worlds (every kernel variant). */
static void raw_qk_factored(dg_ctx *cpu, dg_ctx *gpu, world *w) {
    const kda_dims *d = w->d;
    const int64_t TT = w->TT;
    const int H = w->H, HV = w->HV, K = w->K, V = w->V, BT = w->BT;
    const float scale = (float)w->scale;
    const char *cn = w->r->L.name;
    /* x: the raw rows rounded to bf16; y, r from the device norm; qh, kh: f64 normalised x */
    dg_tensor *xq_h, *xk_h;
    dg_tensor *xq_d = bf16_dev(cpu, gpu, w->qraw, &xq_h);
    dg_tensor *xk_d = bf16_dev(cpu, gpu, w->kraw, &xk_h);
    dg_tensor *yq_d = poisoned(gpu, w->q), *yk_d = poisoned(gpu, w->k);
    dg_tensor *rq_d = poisoned(gpu, w->rq), *rk_d = poisoned(gpu, w->rq);
    dg_check_ok(dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 1, F(xq_d), F(yq_d), F(rq_d)),
                "l2norm launch (bf16 q)");
    dg_check_ok(dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 1, F(xk_d), F(yk_d), F(rk_d)),
                "l2norm launch (bf16 k)");
    dg_tensor *qh = ref(w, cpu, TT, H, K, 0), *kh = ref(w, cpu, TT, H, K, 0);
    dg_tensor *rqh = ref(w, cpu, TT, H, 0, 0), *rkh = ref(w, cpu, TT, H, 0, 0);
    dg__l2norm_fwd_f64(TT * H, K, 1e-6, P(xq_h), P(qh), P(rqh));
    dg__l2norm_fwd_f64(TT * H, K, 1e-6, P(xk_h), P(kh), P(rkh));
    kda_cuda_dims fd = *w->dd; /* the factored call */
    fd.qk_bf16 = 1;
    fd.rq = F(rq_d);
    fd.rk = F(rk_d);

    /* the norm's backward from x and r (y NULL), dx in bf16 */
    ct_cell(S_L2, D_BWD, w->var);
    {
        dg_tensor *want = ref(w, cpu, TT, H, K, 0), *g1 = NULL, *g2 = NULL;
        (void)dg__l2norm_run_bwd(NULL, 0, w->dt, TT * H, K, P(qh), P(rqh), P(w->dy), 0, P(want));
        DG_TEST_TRY(dg_tensor_new(gpu, DG_BF16, dg_tensor_ndim(w->q), dg_tensor_shape(w->q), &g1));
        DG_TEST_TRY(dg_tensor_new(gpu, DG_BF16, dg_tensor_ndim(w->q), dg_tensor_shape(w->q), &g2));
        dg_check_ok(
            dg__l2norm_bwd_cuda(gpu, TT * H, K, NULL, F(xq_d), F(rq_d), F(w->dy_d), 1, F(g1)),
            "l2norm bwd launch (factored)");
        dg_check_ok(
            dg__l2norm_bwd_cuda(gpu, TT * H, K, F(yq_d), NULL, F(rq_d), F(w->dy_d), 1, F(g2)),
            "l2norm bwd launch (y)");
        same_bits(cn, "l2norm dx factored == from y", g1, g2);
        wcmp_tol(w, "kda_l2norm_bwd", "dx (factored, bf16)", g1, want, 0.0, TOL_MID);
        dg_tensor_free(&want);
        dg_tensor_free(&g1);
        dg_tensor_free(&g2);
    }

    /* intra forward */
    ct_cell(S_INTRA, D_FWD, w->var);
    {
        dg_tensor *wA = ref(w, cpu, TT, HV, BT, 0), *wT = ref(w, cpu, TT, HV, BT, 0);
        DG_TEST_TRY(
            REF(w, intra_fwd, d, w->scale, P(qh), P(kh), P(w->beta), P(w->G), P(wA), P(wT)));
        dg_tensor *o[4] = {poisoned(gpu, wA), poisoned(gpu, wT), NULL, NULL};
        dg_check_ok(dg__kda_intra_fwd_cuda(gpu, &fd, scale, F(xq_d), F(xk_d), F(w->beta_d),
                                           F(w->G_d), F(o[0]), F(o[1])),
                    "intra launch (factored)");
        if (w->mode == 0) { /* the FFMA kernel takes the rows widened to y: the same bits */
            o[2] = poisoned(gpu, wA);
            o[3] = poisoned(gpu, wT);
            dg_check_ok(dg__kda_intra_fwd_cuda(gpu, w->dd, scale, F(yq_d), F(yk_d), F(w->beta_d),
                                               F(w->G_d), F(o[2]), F(o[3])),
                        "intra launch (y)");
            same_bits(cn, "intra Aqk factored == from y (ffma)", o[2], o[0]);
            same_bits(cn, "intra Tm factored == from y (ffma)", o[3], o[1]);
        }
        wcmp(w, "kda_intra_fwd", "Aqk (factored)", o[0], wA);
        wcmp(w, "kda_intra_fwd", "Tm (factored)", o[1], wT);
        free_all(o, 4);
        dg_tensor_free(&wA);
        dg_tensor_free(&wT);
    }

    /* intra forward with its prep (kda_intra_prep): G of each gate kind (cumsum) from a bf16
     * gate input and rq, rk, each formed in another order (G: with the hardware exponential) than
     * the gate and norm kernels, so held to the f64 references at f32 accuracy (and G to the gate
     * kernel's); Aqk, Tm against the f64 references from the f64 normalised rows and the f64 G of
     * the rounded gate input. Where it applies (tc == 1). */
    for (size_t gi = 0; gi < NELEM(gate_kinds); gi++) {
        const struct gate_kind *gk = &gate_kinds[gi];
        dg_tensor *x = gk->kind == DG_GATE_NONE ? w->graw : w->xg, *x_h = NULL;
        dg_tensor *x_d = bf16_dev(cpu, gpu, x, &x_h);
        if (!gk->cumsum || !dg__kda_intra_prep_fits(&fd, P(xq_d), P(xk_d), P(x_d))) {
            dg_tensor_free(&x_d);
            dg_tensor_free(&x_h);
            continue;
        }
        ct_cell(S_INTRA, D_FWD, w->var);
        char what[96];
        const float *A = gk->use_A ? F(w->Alog_d) : NULL, *b = gk->use_b ? F(w->dtb_d) : NULL;
        dg_tensor *wG = ref(w, cpu, TT, HV, K, 0), *wA = ref(w, cpu, TT, HV, BT, 0);
        dg_tensor *wT = ref(w, cpu, TT, HV, BT, 0);
        REF(w, gate_fwd, d, gk->kind, -5.0, 1, P(x_h), gk->use_A ? P(w->Alog) : NULL,
            gk->use_b ? P(w->dtb) : NULL, P(wG));
        DG_TEST_TRY(REF(w, intra_fwd, d, w->scale, P(qh), P(kh), P(w->beta), P(wG), P(wA), P(wT)));
        dg_tensor *G1 = poisoned(gpu, wG),
                  *o[5] = {poisoned(gpu, wG), poisoned(gpu, rqh), poisoned(gpu, rkh),
                           poisoned(gpu, wA), poisoned(gpu, wT)};
        dg_check_ok(dg__kda_gate_fwd_cuda(gpu, w->dd, gk->kind, -5.0f, 1, 1, P(x_d), A, b, F(G1)),
                    "gate launch (bf16 x)");
        kda_cuda_dims pd = fd; /* rq, rk are the prep's outputs */
        pd.rq = pd.rk = NULL;
        const kda_intra_prep pp = {P(x_d), A, b, gk->kind, -5.0f, 1e-6f, F(o[0]), F(o[1]), F(o[2])};
        dg_check_ok(dg__kda_intra_prep_fwd_cuda(gpu, &pd, scale, F(xq_d), F(xk_d), F(w->beta_d),
                                                &pp, F(o[3]), F(o[4])),
                    "intra launch (prep)");
        snprintf(what, sizeof what, "G (prep, %s)", gk->what);
        wcmp_tol(w, "kda_intra_fwd", what, o[0], wG, 0.0, TOL_RAW_F32);
        double *g1 = host64(G1); /* the gate kernel's G, as a reference of its own */
        snprintf(what, sizeof what, "G (prep, %s) against the gate kernel", gk->what);
        dg_tensor *g1t = NULL;
        DG_TEST_TRY(
            dg_tensor_from_f64(cpu, w->dt, dg_tensor_ndim(wG), dg_tensor_shape(wG), g1, &g1t));
        free(g1);
        wcmp_tol(w, "kda_intra_fwd", what, o[0], g1t, 0.0, TOL_RAW_F32);
        dg_tensor_free(&g1t);
        wcmp_tol(w, "kda_intra_fwd", "rq (prep)", o[1], rqh, 0.0, TOL_RAW_F32);
        wcmp_tol(w, "kda_intra_fwd", "rk (prep)", o[2], rkh, 0.0, TOL_RAW_F32);
        snprintf(what, sizeof what, "Aqk (prep, %s)", gk->what);
        wcmp(w, "kda_intra_fwd", what, o[3], wA);
        snprintf(what, sizeof what, "Tm (prep, %s)", gk->what);
        wcmp(w, "kda_intra_fwd", what, o[4], wT);
        free_all(o, 5);
        dg_tensor *rest[6] = {G1, wG, wA, wT, x_d, x_h};
        free_all(rest, 6);
    }

    /* intra backward, both upstream gradients */
    ct_cell(S_INTRA, D_BWD, w->var);
    {
        static const char *nm[4] = {"dq", "dk", "dbeta", "dG"};
        dg_tensor *want[4] = {ref(w, cpu, TT, H, K, 0), ref(w, cpu, TT, H, K, 0),
                              ref(w, cpu, TT, HV, 0, 0), ref(w, cpu, TT, HV, K, 0)};
        DG_TEST_TRY(REF(w, intra_bwd, d, w->scale, P(qh), P(kh), P(w->beta), P(w->G), P(w->TmB),
                        P(w->dAu), P(w->dTu), P(want[0]), P(want[1]), P(want[2]), P(want[3])));
        const double floor = raw_floor(w, want[0], want[1]);
        dg_tensor *o[4], *f[4];
        for (int i = 0; i < 4; i++) {
            o[i] = poisoned(gpu, want[i]);
            f[i] = poisoned(gpu, want[i]);
        }
        dg_check_ok(dg__kda_intra_bwd_cuda(gpu, w->dd, scale, F(yq_d), F(yk_d), F(w->beta_d),
                                           F(w->G_d), F(w->TmB_d), F(w->dAu_d), F(w->dTu_d),
                                           F(o[0]), F(o[1]), F(o[2]), F(o[3]), 0),
                    "intra bwd launch (y)");
        dg_check_ok(dg__kda_intra_bwd_cuda(gpu, &fd, scale, F(xq_d), F(xk_d), F(w->beta_d),
                                           F(w->G_d), F(w->TmB_d), F(w->dAu_d), F(w->dTu_d),
                                           F(f[0]), F(f[1]), F(f[2]), F(f[3]), 0),
                    "intra bwd launch (factored)");
        factored_cmp(w, "kda_intra_bwd", "intra", nm, 4, o, f, want, 3, floor, 0);
    }

    /* WY forward, all four outputs */
    ct_cell(S_WY, D_FWD, w->var);
    {
        static const char *nm[4] = {"W", "U", "KG", "QG"};
        dg_tensor *want[4] = {ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, V, 0),
                              ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, K, 0)};
        DG_TEST_TRY(REF(w, wy_fwd, d, P(qh), P(kh), P(w->v), P(w->beta), P(w->G), P(w->Tm),
                        P(want[0]), P(want[1]), P(want[2]), P(want[3])));
        dg_tensor *o[4], *f[4];
        for (int i = 0; i < 4; i++) {
            o[i] = poisoned_mid(gpu, w, want[i]);
            f[i] = poisoned_mid(gpu, w, want[i]);
        }
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, w->dd, F(yq_d), F(yk_d), F(w->v_d), F(w->beta_d),
                                        F(w->G_d), F(w->TmF_d), F(o[0]), F(o[1]), F(o[2]), F(o[3])),
                    "wy launch (y)");
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &fd, F(xq_d), F(xk_d), F(w->v_d), F(w->beta_d),
                                        F(w->G_d), F(w->TmF_d), F(f[0]), F(f[1]), F(f[2]), F(f[3])),
                    "wy launch (factored)");
        factored_cmp(w, "kda_wy_fwd", "wy", nm, 4, o, f, want, -1, 0.0, 1);
    }

    /* WY backward, all four upstream gradients */
    ct_cell(S_WY, D_BWD, w->var);
    {
        static const char *nm[6] = {"dq", "dk", "dv", "dbeta", "dG", "dTm"};
        dg_tensor *want[6] = {ref(w, cpu, TT, H, K, 0),  ref(w, cpu, TT, H, K, 0),
                              ref(w, cpu, TT, HV, V, 0), ref(w, cpu, TT, HV, 0, 0),
                              ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, BT, 0)};
        DG_TEST_TRY(REF(w, wy_bwd, d, P(qh), P(kh), P(w->v), P(w->beta), P(w->G), P(w->TmB),
                        P(w->dWu), P(w->dUu), P(w->dKGu), P(w->dQGu), P(want[0]), P(want[1]),
                        P(want[2]), P(want[3]), P(want[4]), P(want[5])));
        const double floor = raw_floor(w, want[0], want[1]);
        dg_tensor *o[6], *f[6];
        for (int i = 0; i < 6; i++) {
            o[i] = poisoned(gpu, want[i]);
            f[i] = poisoned(gpu, want[i]);
        }
        dg_check_ok(dg__kda_wy_bwd_cuda(gpu, w->dd, F(yq_d), F(yk_d), F(w->v_d), F(w->beta_d),
                                        F(w->G_d), F(w->TmB_d), F(w->dWu_d), F(w->dUu_d),
                                        F(w->dKGu_d), F(w->dQGu_d), F(o[0]), F(o[1]), F(o[2]),
                                        F(o[3]), F(o[4]), F(o[5]), 0),
                    "wy bwd launch (y)");
        dg_check_ok(dg__kda_wy_bwd_cuda(gpu, &fd, F(xq_d), F(xk_d), F(w->v_d), F(w->beta_d),
                                        F(w->G_d), F(w->TmB_d), F(w->dWu_d), F(w->dUu_d),
                                        F(w->dKGu_d), F(w->dQGu_d), F(f[0]), F(f[1]), F(f[2]),
                                        F(f[3]), F(f[4]), F(f[5]), 0),
                    "wy bwd launch (factored)");
        factored_cmp(w, "kda_wy_bwd", "wy", nm, 6, o, f, want, 4, floor, 0);
    }
    dg_tensor *all[12] = {xq_d, xk_d, yq_d, yk_d, rq_d, rk_d, xq_h, xk_h, qh, kh, rqh, rkh};
    free_all(all, 12);
}

/* acc of the wy backward: dq, dk, dG added to start values (o: the six outputs, want: the
 * references with all four upstream gradients). */
static void raw_wy_acc(dg_ctx *gpu, world *w, dg_tensor *const *o, dg_tensor *const *want,
                       double floor) {
    const uint64_t seed = w->r->c->seed;
    const char *kn = "kda_wy_bwd";
    static const char *nm[6] = {"dq", "dk", "dv", "dbeta", "dG", "dTm"};
    const int ai[3] = {0, 1, 4};
    dg_tensor *pre[3];
    ct_cell(S_WY, D_ACC, w->var);
    for (int a = 0; a < 3; a++) {
        pre[a] = start_values(gpu, seed + 31 + (uint64_t)a, want[ai[a]]);
        DG_TEST_TRY(dg_tensor_copy_(o[ai[a]], pre[a]));
    }
    dg_check_ok(dg__kda_wy_bwd_cuda(gpu, w->dd, F(w->q_d), F(w->k_d), F(w->v_d), F(w->beta_d),
                                    F(w->G_d), F(w->TmB_d), F(w->dWu_d), F(w->dUu_d), F(w->dKGu_d),
                                    F(w->dQGu_d), F(o[0]), F(o[1]), F(o[2]), F(o[3]), F(o[4]),
                                    F(o[5]), KDA_ACC_DQ | KDA_ACC_DK | KDA_ACC_DG),
                "wy bwd launch (acc)");
    for (int a = 0; a < 3; a++) {
        char what[64];
        snprintf(what, sizeof what, "%s (acc)", nm[ai[a]]);
        wcmp_added(w, kn, what, o[ai[a]], pre[a], want[ai[a]], ai[a] == 4 ? floor : 0.0);
        dg_tensor_free(&pre[a]);
    }
    wcmp(w, kn, "dv (with acc)", o[2], want[2]);
    wcmp(w, kn, "dTm (with acc)", o[5], want[5]);
    ct_cell(S_WY, D_BWD, w->var);
}

/* The backward of stage s. bwd: the plain checks; acc: the acc mode (intra, wy), which reuses
 * the outputs of the first plain call when both run, else starts from poisoned ones. */
static void raw_bwd(dg_ctx *cpu, dg_ctx *gpu, world *w, int s, int bwd, int acc) {
    const kda_dims *d = w->d;
    const kda_cuda_dims *dd = w->dd;
    const int64_t TT = w->TT, NC = w->NC;
    const int N = w->N, H = w->H, HV = w->HV, K = w->K, V = w->V, BT = w->BT;
    const int f64 = w->dt == DG_F64;
    const float scale = (float)w->scale;
    const char *cn = w->r->L.name;
    char what[128];
    ct_cell(s, D_BWD, w->var);
    switch (s) {
    case S_L2: { /* the q rows: y = q, r = 1/norm */
        dg_tensor *want = ref(w, cpu, TT, H, K, 0), *got = poisoned(gpu, want);
        (void)dg__l2norm_run_bwd(NULL, 0, w->dt, TT * H, K, P(w->q), P(w->rq), P(w->dy), 0,
                                 P(want));
        dg_check_ok(
            dg__l2norm_bwd_cuda(gpu, TT * H, K, F(w->q_d), NULL, F(w->rq_d), F(w->dy_d), 0, F(got)),
            "l2norm bwd launch");
        wcmp(w, "kda_l2norm_bwd", "dx", got, want);
        dg_tensor_free(&want);
        dg_tensor_free(&got);
        break;
    }
    case S_BETA: /* c = 1 and c = 2 */
        for (int ci = 1; ci <= 2; ci++) {
            dg_tensor *want = ref(w, cpu, TT, HV, 0, 0), *got = poisoned(gpu, want);
            REF(w, beta_bwd, TT * HV, (double)ci, P(w->braw), P(w->dbu), P(want));
            dg_check_ok(dg__kda_beta_bwd_cuda(gpu, TT * HV, (float)ci, 0, F(w->braw_d), F(w->dbu_d),
                                              F(got)),
                        "beta bwd launch");
            wcmp(w, "kda_beta_bwd", ci == 1 ? "db (c=1)" : "db (c=2)", got, want);
            dg_tensor_free(&want);
            dg_tensor_free(&got);
        }
        break;
    case S_GATE: /* every kind, with and without the chunk cumsum; the reductions alone */
        for (size_t i = 0; i < NELEM(gate_kinds); i++) {
            const struct gate_kind *gk = &gate_kinds[i];
            const int none = gk->kind == DG_GATE_NONE;
            dg_tensor *x = none ? w->graw : w->xg, *x_d = none ? w->graw_d : w->xg_d;
            const float *A_d = gk->use_A ? F(w->Alog_d) : NULL;
            const float *b_d = gk->use_b ? F(w->dtb_d) : NULL;
            dg_tensor *wx = ref(w, cpu, TT, HV, K, 0), *wA = ref(w, cpu, HV, 0, 0, 0);
            dg_tensor *wb = ref(w, cpu, (int64_t)HV * K, 0, 0, 0);
            REF(w, gate_bwd, d, gk->kind, -5.0, gk->cumsum, P(x), gk->use_A ? P(w->Alog) : NULL,
                gk->use_b ? P(w->dtb) : NULL, P(w->dGu), P(wx), P(wA), P(wb));
            dg_tensor *gx = poisoned(gpu, wx), *gA = poisoned(gpu, wA), *gb = poisoned(gpu, wb);
            dg_tensor *gA2 = poisoned(gpu, wA), *gb2 = poisoned(gpu, wb);
            dg_check_ok(dg__kda_gate_bwd_cuda(gpu, dd, gk->kind, -5.0f, gk->cumsum, 0, F(x_d), A_d,
                                              b_d, F(w->dGu_d), F(gx), F(gA), F(gb)),
                        "gate bwd launch");
            snprintf(what, sizeof what, "%s dx", gk->what);
            wcmp(w, "kda_gate_bwd", what, gx, wx);
            snprintf(what, sizeof what, "%s dA_log", gk->what);
            wcmp(w, "kda_gate_bwd", what, gA, wA);
            snprintf(what, sizeof what, "%s ddt_bias", gk->what);
            wcmp(w, "kda_gate_bwd", what, gb, wb);
            /* the reductions alone (dx not wanted) and their determinism */
            dg_check_ok(dg__kda_gate_bwd_cuda(gpu, dd, gk->kind, -5.0f, gk->cumsum, 0, F(x_d), A_d,
                                              b_d, F(w->dGu_d), NULL, F(gA2), F(gb2)),
                        "gate bwd launch (dx NULL)");
            snprintf(what, sizeof what, "gate %s dA_log", gk->what);
            same_bits(cn, what, gA, gA2);
            snprintf(what, sizeof what, "gate %s ddt_bias", gk->what);
            same_bits(cn, what, gb, gb2);
            dg_tensor *all[] = {wx, wA, wb, gx, gA, gb, gA2, gb2};
            free_all(all, NELEM(all));
        }
        break;
    case S_INTRA: /* both upstream gradients, then dAqk = NULL and dTm = NULL; with both: the
                     determinism of the GVA and tile reductions (f32), dk alone (dG not wanted;
                     f64) and acc */
        for (int var = 0; var < 3 && (bwd || var == 0); var++) {
            static const char *tag[3] = {"", " (dAqk NULL)", " (dTm NULL)"};
            const char *kn = "kda_intra_bwd";
            dg_tensor *uA = var == 1 ? NULL : w->dAu, *uT = var == 2 ? NULL : w->dTu;
            const dg_tensor *uA_d = var == 1 ? NULL : w->dAu_d, *uT_d = var == 2 ? NULL : w->dTu_d;
            dg_tensor *want[4] = {ref(w, cpu, TT, H, K, 0), ref(w, cpu, TT, H, K, 0),
                                  ref(w, cpu, TT, HV, 0, 0), ref(w, cpu, TT, HV, K, 0)};
            DG_TEST_TRY(REF(w, intra_bwd, d, w->scale, P(w->q), P(w->k), P(w->beta), P(w->G),
                            P(w->TmB), P(uA), P(uT), P(want[0]), P(want[1]), P(want[2]),
                            P(want[3])));
            const double floor = raw_floor(w, want[0], want[1]);
            dg_tensor *o[4];
            for (int i = 0; i < 4; i++)
                o[i] = poisoned(gpu, want[i]);
            if (bwd) {
                dg_check_ok(dg__kda_intra_bwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d),
                                                   F(w->beta_d), F(w->G_d), F(w->TmB_d), F(uA_d),
                                                   F(uT_d), F(o[0]), F(o[1]), F(o[2]), F(o[3]), 0),
                            "intra bwd launch");
                snprintf(what, sizeof what, "dq%s", tag[var]);
                wcmp(w, kn, what, o[0], want[0]);
                snprintf(what, sizeof what, "dk%s", tag[var]);
                wcmp(w, kn, what, o[1], want[1]);
                snprintf(what, sizeof what, "dbeta%s", tag[var]);
                wcmp(w, kn, what, o[2], want[2]);
                snprintf(what, sizeof what, "dG%s", tag[var]);
                wcmp_tol(w, kn, what, o[3], want[3], floor, w->tol);
            }
            if (bwd && var == 0 && !f64) {
                dg_tensor *o2[3] = {poisoned(gpu, want[0]), poisoned(gpu, want[1]),
                                    poisoned(gpu, want[2])};
                dg_check_ok(dg__kda_intra_bwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d),
                                                   F(w->beta_d), F(w->G_d), F(w->TmB_d), F(uA_d),
                                                   F(uT_d), F(o2[0]), F(o2[1]), F(o2[2]), NULL, 0),
                            "intra bwd launch (dG NULL)");
                same_bits(cn, "intra dq", o[0], o2[0]);
                same_bits(cn, "intra dk", o[1], o2[1]);
                same_bits(cn, "intra dbeta", o[2], o2[2]);
                free_all(o2, 3);
            }
            if (bwd && var == 0 && f64) {
                DG_TEST_TRY(dg_tensor_fill_(o[1], NAN));
                dg_check_ok(dg__kda_intra_bwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d),
                                                   F(w->beta_d), F(w->G_d), F(w->TmB_d), F(uA_d),
                                                   F(uT_d), NULL, F(o[1]), NULL, NULL, 0),
                            "intra bwd launch (dk only)");
                wcmp(w, kn, "dk (alone)", o[1], want[1]);
            }
            if (acc && var == 0)
                raw_intra_acc(gpu, w, o, want, floor);
            free_all(want, 4);
            free_all(o, 4);
        }
        break;
    case S_WY: /* all four upstream gradients, then dW = dKG = NULL, then dU = dQG = NULL; with
                  all four: the determinism of the reductions (f32) and acc */
        for (int var = 0; var < 3 && (bwd || var == 0); var++) {
            static const char *tag[3] = {"", " (dW,dKG NULL)", " (dU,dQG NULL)"};
            static const char *nm[6] = {"dq", "dk", "dv", "dbeta", "dG", "dTm"};
            dg_tensor *uW = var == 1 ? NULL : w->dWu, *uKG = var == 1 ? NULL : w->dKGu;
            dg_tensor *uU = var == 2 ? NULL : w->dUu, *uQG = var == 2 ? NULL : w->dQGu;
            const dg_tensor *uW_d = var == 1 ? NULL : w->dWu_d;
            const dg_tensor *uKG_d = var == 1 ? NULL : w->dKGu_d;
            const dg_tensor *uU_d = var == 2 ? NULL : w->dUu_d;
            const dg_tensor *uQG_d = var == 2 ? NULL : w->dQGu_d;
            dg_tensor *want[6] = {ref(w, cpu, TT, H, K, 0),  ref(w, cpu, TT, H, K, 0),
                                  ref(w, cpu, TT, HV, V, 0), ref(w, cpu, TT, HV, 0, 0),
                                  ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, BT, 0)};
            DG_TEST_TRY(REF(w, wy_bwd, d, P(w->q), P(w->k), P(w->v), P(w->beta), P(w->G), P(w->TmB),
                            P(uW), P(uU), P(uKG), P(uQG), P(want[0]), P(want[1]), P(want[2]),
                            P(want[3]), P(want[4]), P(want[5])));
            const double floor = raw_floor(w, want[0], want[1]);
            dg_tensor *o[6];
            for (int i = 0; i < 6; i++)
                o[i] = poisoned(gpu, want[i]);
            if (bwd) {
                dg_check_ok(dg__kda_wy_bwd_cuda(gpu, dd, F(w->q_d), F(w->k_d), F(w->v_d),
                                                F(w->beta_d), F(w->G_d), F(w->TmB_d), F(uW_d),
                                                F(uU_d), F(uKG_d), F(uQG_d), F(o[0]), F(o[1]),
                                                F(o[2]), F(o[3]), F(o[4]), F(o[5]), 0),
                            "wy bwd launch");
                for (int i = 0; i < 6; i++) {
                    snprintf(what, sizeof what, "%s%s", nm[i], tag[var]);
                    wcmp_tol(w, "kda_wy_bwd", what, o[i], want[i], i == 4 ? floor : 0.0, w->tol);
                }
            }
            if (bwd && var == 0 && !f64) {
                dg_tensor *o2[3] = {poisoned(gpu, want[0]), poisoned(gpu, want[1]),
                                    poisoned(gpu, want[3])};
                dg_check_ok(dg__kda_wy_bwd_cuda(gpu, dd, F(w->q_d), F(w->k_d), F(w->v_d),
                                                F(w->beta_d), F(w->G_d), F(w->TmB_d), F(uW_d),
                                                F(uU_d), F(uKG_d), F(uQG_d), F(o2[0]), F(o2[1]),
                                                NULL, F(o2[2]), NULL, NULL, 0),
                            "wy bwd launch (dv, dG, dTm NULL)");
                same_bits(cn, "wy dq", o[0], o2[0]);
                same_bits(cn, "wy dk", o[1], o2[1]);
                same_bits(cn, "wy dbeta", o[3], o2[2]);
                free_all(o2, 3);
            }
            if (acc && var == 0)
                raw_wy_acc(gpu, w, o, want, floor);
            if (bwd && var == 0 && f64 && !w->mid)
                raw_wy_leaf_bf16(cpu, gpu, w, uW, uU, uKG, uQG);
            if (bwd && var == 0 && f64) {
                raw_qk_factored(cpu, gpu, w);
                ct_cell(S_WY, D_BWD, w->var);
            }
            free_all(want, 6);
            free_all(o, 6);
        }
        break;
    case S_STATE: { /* every output; f32: dW alone (dE_tot then lives in scratch), then dh = dht
                       = NULL (and no dh0), then dE = NULL; f64: dU + dh0 only (no
                       chunk-parallel part), dW alone, dKG + dG alone */
        static const char *tag[3] = {"", " (dh,dht NULL)", " (dE NULL)"};
        static const char *nm[5] = {"dW", "dU", "dKG", "dG", "dh0"};
        const char *kn = "kda_state_bwd";
        for (int var = 0; var < (f64 ? 1 : 3); var++) {
            dg_tensor *uh = var == 1 ? NULL : w->dhu, *uht = var == 1 ? NULL : w->dht;
            dg_tensor *uE = var == 2 ? NULL : w->dEu;
            const dg_tensor *uh_d = var == 1 ? NULL : w->dhu_d;
            const dg_tensor *uht_d = var == 1 ? NULL : w->dht_d;
            const dg_tensor *uE_d = var == 2 ? NULL : w->dEu_d;
            dg_tensor *want[5] = {ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, V, 0),
                                  ref(w, cpu, TT, HV, K, 0), ref(w, cpu, TT, HV, K, 0),
                                  ref(w, cpu, N, HV, K, V)};
            DG_TEST_TRY(REF(w, state_bwd, d, P(w->W), P(w->KG), P(w->G), P(w->h), P(w->E), P(uh),
                            P(uE), P(uht), P(want[0]), P(want[1]), P(want[2]), P(want[3]),
                            P(want[4])));
            dg_tensor *o[5];
            for (int i = 0; i < 5; i++)
                o[i] = poisoned(gpu, want[i]);
            const int want_h0 = var != 1;
            dg_check_ok(dg__kda_state_bwd_cuda(gpu, dd, F(w->W_d), F(w->KG_d), F(w->G_d), F(w->h_d),
                                               F(w->E_d), F(uh_d), F(uE_d), F(uht_d), F(o[0]),
                                               F(o[1]), F(o[2]), F(o[3]), want_h0 ? F(o[4]) : NULL),
                        "state bwd launch");
            for (int i = 0; i < (want_h0 ? 5 : 4); i++) {
                snprintf(what, sizeof what, "%s%s", nm[i], tag[var]);
                wcmp(w, kn, what, o[i], want[i]);
            }
            if (var == 0 && !f64) {
                DG_TEST_TRY(dg_tensor_fill_(o[0], NAN));
                dg_check_ok(dg__kda_state_bwd_cuda(gpu, dd, F(w->W_d), F(w->KG_d), F(w->G_d),
                                                   F(w->h_d), F(w->E_d), F(uh_d), F(uE_d), F(uht_d),
                                                   F(o[0]), NULL, NULL, NULL, NULL),
                            "state bwd launch (dW only)");
                wcmp(w, kn, "dW (alone)", o[0], want[0]);
            }
            if (var == 0 && f64) {
                for (int i = 0; i < 5; i++)
                    DG_TEST_TRY(dg_tensor_fill_(o[i], NAN));
                dg_check_ok(dg__kda_state_bwd_cuda(gpu, dd, F(w->W_d), F(w->KG_d), F(w->G_d),
                                                   F(w->h_d), F(w->E_d), F(uh_d), F(uE_d), F(uht_d),
                                                   NULL, F(o[1]), NULL, NULL, F(o[4])),
                            "state bwd launch (dU, dh0)");
                dg_check_ok(dg__kda_state_bwd_cuda(gpu, dd, F(w->W_d), F(w->KG_d), F(w->G_d),
                                                   F(w->h_d), F(w->E_d), F(uh_d), F(uE_d), F(uht_d),
                                                   F(o[0]), NULL, NULL, NULL, NULL),
                            "state bwd launch (dW only)");
                dg_check_ok(dg__kda_state_bwd_cuda(gpu, dd, F(w->W_d), F(w->KG_d), F(w->G_d),
                                                   F(w->h_d), F(w->E_d), F(uh_d), F(uE_d), F(uht_d),
                                                   NULL, NULL, F(o[2]), F(o[3]), NULL),
                            "state bwd launch (dKG, dG)");
                wcmp(w, kn, "dU (with dh0 only)", o[1], want[1]);
                wcmp(w, kn, "dh0 (with dU only)", o[4], want[4]);
                wcmp(w, kn, "dW (alone)", o[0], want[0]);
                wcmp(w, kn, "dKG (with dG)", o[2], want[2]);
                wcmp(w, kn, "dG (with dKG)", o[3], want[3]);
            }
            free_all(want, 5);
            free_all(o, 5);
        }
        break;
    }
    case S_OUTPUT: { /* all four; f64: then dAqk alone and dE alone */
        dg_tensor *want[4] = {ref(w, cpu, TT, HV, K, 0), ref(w, cpu, NC, HV, K, V),
                              ref(w, cpu, TT, HV, BT, 0), ref(w, cpu, TT, HV, V, 0)};
        static const char *nm[4] = {"dQG", "dh", "dAqk", "dE"};
        REF(w, output_bwd, d, w->scale, P(w->QG), P(w->h), P(w->AqkB), P(w->E), P(w->dO),
            P(want[0]), P(want[1]), P(want[2]), P(want[3]));
        dg_tensor *o[4]; /* dh is stored like h */
        for (int i = 0; i < 4; i++)
            o[i] = i == 1 ? poisoned_mid(gpu, w, want[i]) : poisoned(gpu, want[i]);
        dg_check_ok(dg__kda_output_bwd_cuda(gpu, dd, scale, F(w->QG_d), F(w->h_d), F(w->AqkB_d),
                                            F(w->E_d), F(w->dO_d), F(o[0]), F(o[1]), F(o[2]),
                                            F(o[3])),
                    "output bwd launch");
        for (int i = 0; i < 4; i++)
            (i == 1 ? wcmp_mid : wcmp)(w, "kda_output_bwd", nm[i], o[i], want[i]);
        if (f64) {
            DG_TEST_TRY(dg_tensor_fill_(o[2], NAN));
            DG_TEST_TRY(dg_tensor_fill_(o[3], NAN));
            dg_check_ok(dg__kda_output_bwd_cuda(gpu, dd, scale, F(w->QG_d), F(w->h_d), F(w->AqkB_d),
                                                F(w->E_d), F(w->dO_d), NULL, NULL, F(o[2]), NULL),
                        "output bwd launch (dAqk only)");
            dg_check_ok(dg__kda_output_bwd_cuda(gpu, dd, scale, F(w->QG_d), F(w->h_d), F(w->AqkB_d),
                                                F(w->E_d), F(w->dO_d), NULL, NULL, NULL, F(o[3])),
                        "output bwd launch (dE only)");
            wcmp(w, "kda_output_bwd", "dAqk (alone)", o[2], want[2]);
            wcmp(w, "kda_output_bwd", "dE (alone)", o[3], want[3]);
        }
        free_all(want, 4);
        free_all(o, 4);
        break;
    }
    case S_REC: /* with dht, then dht = NULL; the determinism of the reductions */
        for (int var = 0; var < 2; var++) {
            dg_tensor *uht = var ? NULL : w->dht;
            const dg_tensor *uht_d = var ? NULL : w->dht_d;
            dg_tensor *want[6] = {ref(w, cpu, TT, H, K, 0),  ref(w, cpu, TT, H, K, 0),
                                  ref(w, cpu, TT, HV, V, 0), ref(w, cpu, TT, HV, K, 0),
                                  ref(w, cpu, TT, HV, 0, 0), ref(w, cpu, N, HV, K, V)};
            static const char *nm[6] = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
            DG_TEST_TRY(REF(w, recurrent_bwd, d, w->scale, P(w->q), P(w->k), P(w->v), P(w->graw),
                            P(w->beta), P(w->h0), P(w->dO), P(uht), P(want[0]), P(want[1]),
                            P(want[2]), P(want[3]), P(want[4]), P(want[5])));
            dg_tensor *o[6];
            for (int i = 0; i < 6; i++)
                o[i] = poisoned(gpu, want[i]);
            dg_check_ok(dg__kda_recurrent_bwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d), F(w->v_d),
                                                   F(w->graw_d), F(w->beta_d), F(w->h0_d),
                                                   F(w->dO_d), F(uht_d), F(o[0]), F(o[1]), F(o[2]),
                                                   F(o[3]), F(o[4]), F(o[5])),
                        "recurrent bwd launch");
            for (int i = 0; i < 6; i++) {
                snprintf(what, sizeof what, "%s%s", nm[i], var ? " (dht NULL)" : "");
                wcmp(w, "kda_recurrent_bwd", what, o[i], want[i]);
            }
            if (var == 0) {
                dg_tensor *o2[4] = {poisoned(gpu, want[0]), poisoned(gpu, want[1]),
                                    poisoned(gpu, want[3]), poisoned(gpu, want[4])};
                dg_check_ok(dg__kda_recurrent_bwd_cuda(gpu, dd, scale, F(w->q_d), F(w->k_d),
                                                       F(w->v_d), F(w->graw_d), F(w->beta_d),
                                                       F(w->h0_d), F(w->dO_d), F(uht_d), F(o2[0]),
                                                       F(o2[1]), NULL, F(o2[2]), F(o2[3]), NULL),
                            "recurrent bwd launch (dv, dh0 NULL)");
                same_bits(cn, "recurrent dq", o[0], o2[0]);
                same_bits(cn, "recurrent dk", o[1], o2[1]);
                same_bits(cn, "recurrent dg", o[3], o2[2]);
                same_bits(cn, "recurrent dbeta", o[4], o2[3]);
                free_all(o2, 4);
            }
            free_all(want, 6);
            free_all(o, 6);
        }
        break;
    default:
        break;
    }
}

/* Stages of each variant (bits of S_*): f32 every stage (the chunked pipeline forward only);
 * the tc variants the stages with a tensor-core path; mid the stages reading or writing the bf16
 * intermediates (the wy backward reads none of them: f32 inputs, f32 upstream gradients). */
#define STAGE_BITS(a, b) ((2u << (b)) - (1u << (a)))
static const unsigned raw_fwd_stages[3] = {STAGE_BITS(S_L2, S_CHUNK), STAGE_BITS(S_INTRA, S_OUTPUT),
                                           STAGE_BITS(S_WY, S_OUTPUT)};
static const unsigned raw_bwd_stages[3] = {STAGE_BITS(S_L2, S_REC), STAGE_BITS(S_INTRA, S_OUTPUT),
                                           STAGE_BITS(S_STATE, S_OUTPUT)};

/* Every selected stage of world w with tc = w->mode; fwd/bwd: run those directions at all. */
static void raw_run(dg_ctx *cpu, dg_ctx *gpu, world *w, int fwd, int bwd) {
    const int f64 = w->dt == DG_F64, set = w->mid ? 2 : f64;
    for (int s = S_L2; s <= S_CHUNK && fwd; s++)
        if ((raw_fwd_stages[set] >> s & 1) && ct_sel(s, D_FWD, w->var))
            raw_fwd(cpu, gpu, w, s);
    for (int s = S_L2; s <= S_REC && bwd; s++) {
        if (!(raw_bwd_stages[set] >> s & 1))
            continue;
        const int b = ct_sel(s, D_BWD, w->var);
        const int a = f64 && (s == S_INTRA || s == S_WY) && ct_sel(s, D_ACC, w->var);
        if (b || a)
            raw_bwd(cpu, gpu, w, s, b, a);
    }
}

/* errors, column mid: the raw launchers refuse mid = 1 where it does not apply, with
 * DG_ERR_UNSUPPORTED and kda_mid_refused's message: tc == 0 (every launcher that reads or writes
 * the bf16 intermediates; none of them has an FFMA bf16 kernel) and tc == 1 with K % 16 != 0 (the
 * state pass, forward and backward: its bf16 form is the mma.sync kernel alone). The calls take
 * the mid world's arrays and f32 outputs (at least as large as bf16 ones; K - 8 only shrinks
 * what a launch would touch), so a launcher that failed to refuse would still stay in bounds. */
static void mid_refusals(dg_ctx *gpu, world *w) {
    ct_cell(S_ERRORS, D_FWD, V_MID);
    const char *needle = "bf16 intermediates (mid = 1) need", *cn = w->r->L.name;
    const float scale = (float)w->scale;
    kda_cuda_dims bad = *w->dd; /* shares the device tables of w->dd; never freed */
    bad.mid = 1;
    dg_tensor *o[10] = {poisoned(gpu, w->W),  poisoned(gpu, w->U),   poisoned(gpu, w->KG),
                        poisoned(gpu, w->QG), poisoned(gpu, w->G),   poisoned(gpu, w->h),
                        poisoned(gpu, w->E),  poisoned(gpu, w->Aqk), poisoned(gpu, w->ht),
                        poisoned(gpu, w->O)};
    float *fW = F(o[0]), *fU = F(o[1]), *fKG = F(o[2]), *fQG = F(o[3]), *fG = F(o[4]);
    float *fh = F(o[5]), *fE = F(o[6]), *fA = F(o[7]), *fht = F(o[8]), *fO = F(o[9]);
    char what[240];
#define REFUSED(call, tag)                                                                         \
    do {                                                                                           \
        snprintf(what, sizeof what, "%s | mid %s refused (tc=%d K=%d)", cn, tag, bad.tc, bad.K);   \
        dg_check_err((call), DG_ERR_UNSUPPORTED, needle, what);                                    \
    } while (0)
    bad.tc = 0;
    REFUSED(dg__kda_wy_fwd_cuda(gpu, &bad, F(w->q_d), F(w->k_d), F(w->v_d), F(w->beta_d), F(w->G_d),
                                F(w->TmF_d), fW, fU, fKG, fQG),
            "wy fwd");
    REFUSED(dg__kda_output_fwd_cuda(gpu, &bad, scale, F(w->QG_d), F(w->h_d), F(w->AqkF_d),
                                    F(w->E_d), fO),
            "output fwd");
    REFUSED(dg__kda_output_bwd_cuda(gpu, &bad, scale, F(w->QG_d), F(w->h_d), F(w->AqkB_d),
                                    F(w->E_d), F(w->dO_d), fQG, fh, fA, fE),
            "output bwd");
    for (int i = 0; i < 2; i++) { /* the state pass: tc == 0, then tc == 1 with K % 16 != 0 */
        bad.tc = i;
        bad.K = w->dd->K - 8 * i;
        REFUSED(dg__kda_state_fwd_cuda(gpu, &bad, F(w->W_d), F(w->U_d), F(w->KG_d), F(w->G_d),
                                       F(w->h0_d), fh, fE, fht),
                "state fwd");
        REFUSED(dg__kda_state_bwd_cuda(gpu, &bad, F(w->W_d), F(w->KG_d), F(w->G_d), F(w->h_d),
                                       F(w->E_d), F(w->dhu_d), F(w->dEu_d), F(w->dht_d), fW, fU,
                                       fKG, fG, fht),
                "state bwd");
    }
#undef REFUSED
    DG_TEST_TRY(dg_ctx_sync(gpu));
    free_all(o, NELEM(o));
}

/* ---- groups OS, OC, OP, OE: the ops-layer entry points through the tape ---------------------- */

typedef enum {
    OP_L2,
    OP_BETA,
    OP_GATE,
    OP_INTRA,
    OP_WY,
    OP_STATE,
    OP_OUTPUT,
    OP_CHUNK,
    OP_REC
} opk;

typedef struct ucall {
    opk op;
    dg_kda_opts opts;
    int neg;     /* beta: allow_neg_eigval */
    int want_ht; /* state: ask for ht */
} ucall;

static dg_status call_op(dg_ctx *ctx, dg_tensor *const *in, dg_tensor **out, const void *user) {
    const ucall *u = user;
    switch (u->op) {
    case OP_L2:
        return dg_kda_l2norm(ctx, in[0], &out[0]);
    case OP_BETA:
        return dg_kda_beta(ctx, in[0], u->neg, &out[0]);
    case OP_GATE:
        return dg_kda_gate_cumsum(ctx, in[0], in[1], in[2], &u->opts, &out[0]);
    case OP_INTRA:
        return dg_kda_intra(ctx, in[0], in[1], in[2], in[3], &u->opts, &out[0], &out[1]);
    case OP_WY:
        return dg_kda_wy(ctx, in[0], in[1], in[2], in[3], in[4], in[5], &u->opts, &out[0], &out[1],
                         &out[2], &out[3]);
    case OP_STATE:
        return dg_kda_state(ctx, in[0], in[1], in[2], in[3], in[4], &u->opts, &out[0], &out[1],
                            u->want_ht ? &out[2] : NULL);
    case OP_OUTPUT:
        return dg_kda_output(ctx, in[0], in[1], in[2], in[3], &u->opts, &out[0]);
    case OP_CHUNK:
        return dg_kda_chunk(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], &u->opts,
                            &out[0], &out[1]);
    case OP_REC:
        return dg_kda_recurrent(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7],
                                &u->opts, &out[0], &out[1]);
    }
    return DG_ERR_ARG;
}

/* The entry point of u for the shared runner (case_table.h): its outputs by op. */
static ct_op op_of(const ucall *u) {
    static const char *const names[][CT_MAXOUT] = {
        {"y"}, {"beta"},    {"G"},      {"Aqk", "Tm"}, {"W", "U", "KG", "QG"}, {"h", "E", "ht"},
        {"o"}, {"o", "ht"}, {"o", "ht"}};
    return ct_op_of(call_op, u, names[u->op], u->op == OP_STATE && !u->want_ht, 0);
}

static int ops_var(dg_dtype act) { return act == DG_BF16 ? V_OPS_BF16 : V_OPS_F32; }

/* The op on CUDA (activations in `act`) against the CPU f64 op on the same values; stage s. */
static void gpu_vs_cpu(dg_ctx *cpu, dg_ctx *gpu, const char *label, const ucall *u, int n_in,
                       const ct_in *ins, dg_dtype act, uint64_t seed, const ct_tols *t, int s) {
    const ct_op op = op_of(u);
    const ct_tols dflt = ct_tols_all(act == DG_BF16 ? TOL_BF16 : TOL_OPS_F32);
    ct_gpu_vs_cpu(cpu, gpu, label, &op, n_in, ins, act, seed, t ? t : &dflt, s, ops_var(act));
}

static dg_kda_opts opts_of(const crun *r) {
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = r->c->BT;
    o.cu_seqlens = r->L.nseq ? r->L.cu : NULL;
    o.n_seqs = r->L.nseq;
    return o;
}

/* -- OS: every stage node on its own */

/* Realistic stage inputs: unit q/k rows, decays of the case's range, and the intermediates the
 * CPU f64 pipeline makes from them (so the state chain stays a contraction). */
typedef struct sdata {
    double *q, *k, *v, *g, *beta, *h0, *G, *Aqk, *Tm, *W, *U, *KG, *QG, *h, *E;
} sdata;

static double *host_of(dg_tensor *t) { return kt_host(t, dg_tensor_numel(t)); }

static void make_sdata(dg_ctx *cpu, const crun *r, uint64_t seed, sdata *s) {
    const kcase *c = r->c;
    const int64_t B = r->L.B, T = r->L.T, TT = B * T, N = r->L.N;
    const int64_t nq = TT * c->H * c->K, nv = TT * c->HV * c->V, ng = TT * c->HV * c->K;
    s->q = kt_randn(nq, seed + 1, 1.0);
    s->k = kt_randn(nq, seed + 2, 1.0);
    kt_rownorm(s->q, nq / c->K, c->K);
    kt_rownorm(s->k, nq / c->K, c->K);
    s->v = kt_randn(nv, seed + 3, 1.0);
    s->g = kt_rand(ng, seed + 4, c->glo, c->ghi);
    s->beta = kt_rand(TT * c->HV, seed + 5, 0.05, 0.95);
    s->h0 = kt_randn(N * c->HV * c->K * c->V, seed + 6, 0.5);
    int64_t sq[4] = {B, T, c->H, c->K}, sv[4] = {B, T, c->HV, c->V};
    int64_t sg[4] = {B, T, c->HV, c->K}, sb[3] = {B, T, c->HV};
    int64_t s0[4] = {N, c->HV, c->K, c->V};
    dg_tensor *q = kt_tensor(cpu, DG_F64, 4, sq, s->q, 0);
    dg_tensor *k = kt_tensor(cpu, DG_F64, 4, sq, s->k, 0);
    dg_tensor *v = kt_tensor(cpu, DG_F64, 4, sv, s->v, 0);
    dg_tensor *g = kt_tensor(cpu, DG_F64, 4, sg, s->g, 0);
    dg_tensor *b = kt_tensor(cpu, DG_F64, 3, sb, s->beta, 0);
    dg_tensor *h0 = kt_tensor(cpu, DG_F64, 4, s0, s->h0, 0);
    dg_kda_opts o = opts_of(r);
    dg_tensor *G = NULL, *Aqk = NULL, *Tm = NULL, *W = NULL, *U = NULL, *KG = NULL, *QG = NULL;
    dg_tensor *h = NULL, *E = NULL;
    DG_TEST_TRY(dg_kda_gate_cumsum(cpu, g, NULL, NULL, &o, &G));
    DG_TEST_TRY(dg_kda_intra(cpu, q, k, b, G, &o, &Aqk, &Tm));
    DG_TEST_TRY(dg_kda_wy(cpu, q, k, v, b, G, Tm, &o, &W, &U, &KG, &QG));
    DG_TEST_TRY(dg_kda_state(cpu, W, U, KG, G, h0, &o, &h, &E, NULL));
    s->G = host_of(G);
    s->Aqk = host_of(Aqk);
    s->Tm = host_of(Tm);
    s->W = host_of(W);
    s->U = host_of(U);
    s->KG = host_of(KG);
    s->QG = host_of(QG);
    s->h = host_of(h);
    s->E = host_of(E);
    dg_tensor *all[15] = {q, k, v, g, b, h0, G, Aqk, Tm, W, U, KG, QG, h, E};
    free_all(all, 15);
}

static void free_sdata(sdata *s) {
    double *all[15] = {s->q,  s->k, s->v, s->g,  s->beta, s->h0, s->G, s->Aqk,
                       s->Tm, s->W, s->U, s->KG, s->QG,   s->h,  s->E};
    for (int i = 0; i < 15; i++)
        free(all[i]);
}

static void os_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r) {
    const kcase *c = r->c;
    const uint64_t seed = c->seed;
    sdata s;
    make_sdata(cpu, r, seed, &s);
    const int64_t B = r->L.B, T = r->L.T, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    const int64_t N = r->L.N, NC = r->L.NC, TT = B * T;
    const char *cn = r->L.name;
    char label[224];
    ucall u;
    memset(&u, 0, sizeof u);
    u.opts = opts_of(r);
    double *xraw = kt_randn(TT * H * K, seed + 11, 1.5); /* l2norm input: not unit rows */
    double *braw = kt_randn(TT * HV, seed + 12, 2.0);    /* beta logits */
    double *graw = kt_randn(TT * HV * K, seed + 13, 1.0);
    double *alog = kt_rand(HV, seed + 14, -0.5, 1.0);
    double *dtb = kt_randn(HV * K, seed + 15, 0.5);

    for (int a = 0; a < 2; a++) {
        const dg_dtype act = a ? DG_BF16 : DG_F32;
        const int v = ops_var(act);
        /* N1 l2norm, both policies */
        if (sel_ops(S_L2, v)) {
            u.op = OP_L2;
            const ct_in l2in[1] = {{"x", 4, {B, T, H, K}, xraw, 0}};
            for (int p = 0; p < 2; p++) {
                dg_policy_set("kda_l2norm", p ? DG_POLICY_RECOMPUTE : DG_POLICY_CACHE);
                snprintf(label, sizeof label, "%s l2norm (%s)", cn, p ? "RECOMPUTE" : "CACHE");
                gpu_vs_cpu(cpu, gpu, label, &u, 1, l2in, act, seed + 20, NULL, S_L2);
            }
            dg_policy_reset();
        }
        /* N2 beta, c = 1 and 2 */
        if (sel_ops(S_BETA, v)) {
            u.op = OP_BETA;
            const ct_in bin[1] = {{"b", 3, {B, T, HV}, braw, 0}};
            for (u.neg = 0; u.neg < 2; u.neg++) {
                snprintf(label, sizeof label, "%s beta c=%d", cn, u.neg + 1);
                gpu_vs_cpu(cpu, gpu, label, &u, 1, bin, act, seed + 21, NULL, S_BETA);
            }
            u.neg = 0;
        }
        /* N3 gate_cumsum: NONE, KDA, LOWERBOUND (+A_log), LOWERBOUND lb = -2 without A_log */
        if (sel_ops(S_GATE, v)) {
            u.op = OP_GATE;
            static const char *gname[4] = {"NONE", "KDA + A_log + dt_bias",
                                           "LOWERBOUND + A_log + dt_bias", "LOWERBOUND lb=-2"};
            for (int gk = 0; gk < 4; gk++) {
                u.opts.gate = gk == 0 ? DG_GATE_NONE : gk == 1 ? DG_GATE_KDA : DG_GATE_LOWERBOUND;
                u.opts.lower_bound = gk == 3 ? -2.0 : 0.0;
                const ct_in gin[3] = {{"g", 4, {B, T, HV, K}, gk ? graw : s.g, 0},
                                      {"A_log", 1, {HV}, gk == 1 || gk == 2 ? alog : NULL, 1},
                                      {"dt_bias", 1, {HV * K}, gk ? dtb : NULL, 1}};
                snprintf(label, sizeof label, "%s gate %s", cn, gname[gk]);
                gpu_vs_cpu(cpu, gpu, label, &u, 3, gin, act, seed + 22 + (uint64_t)gk, NULL,
                           S_GATE);
            }
            u.opts.gate = DG_GATE_NONE;
            u.opts.lower_bound = 0;
        }
        /* N4 intra */
        if (sel_ops(S_INTRA, v)) {
            u.op = OP_INTRA;
            const ct_in iin[4] = {{"q", 4, {B, T, H, K}, s.q, 0},
                                  {"k", 4, {B, T, H, K}, s.k, 0},
                                  {"beta", 3, {B, T, HV}, s.beta, 0},
                                  {"G", 4, {B, T, HV, K}, s.G, 1}};
            snprintf(label, sizeof label, "%s intra", cn);
            gpu_vs_cpu(cpu, gpu, label, &u, 4, iin, act, seed + 30, NULL, S_INTRA);
        }
        /* N5 wy */
        if (sel_ops(S_WY, v)) {
            u.op = OP_WY;
            const ct_in win[6] = {
                {"q", 4, {B, T, H, K}, s.q, 0},  {"k", 4, {B, T, H, K}, s.k, 0},
                {"v", 4, {B, T, HV, V}, s.v, 0}, {"beta", 3, {B, T, HV}, s.beta, 0},
                {"G", 4, {B, T, HV, K}, s.G, 1}, {"Tm", 4, {B, T, HV, BT}, s.Tm, 1}};
            snprintf(label, sizeof label, "%s wy", cn);
            gpu_vs_cpu(cpu, gpu, label, &u, 6, win, act, seed + 31, NULL, S_WY);
        }
        if (act == DG_BF16)
            continue; /* state and output take f32 intermediates only */
        /* N6 state: h0 + ht under both policies, then no h0 / no ht */
        if (sel_ops(S_STATE, v)) {
            u.op = OP_STATE;
            for (int p = 0; p < 3; p++) {
                dg_policy_set("kda_state", p == 1 ? DG_POLICY_CACHE : DG_POLICY_RECOMPUTE);
                u.want_ht = p < 2;
                const ct_in sin_[5] = {{"W", 4, {B, T, HV, K}, s.W, 1},
                                       {"U", 4, {B, T, HV, V}, s.U, 1},
                                       {"KG", 4, {B, T, HV, K}, s.KG, 1},
                                       {"G", 4, {B, T, HV, K}, s.G, 1},
                                       {"h0", 4, {N, HV, K, V}, p < 2 ? s.h0 : NULL, 1}};
                snprintf(label, sizeof label, "%s state %s", cn,
                         p == 0   ? "+h0 +ht (RECOMPUTE)"
                         : p == 1 ? "+h0 +ht (CACHE)"
                                  : "no h0, no ht");
                gpu_vs_cpu(cpu, gpu, label, &u, 5, sin_, act, seed + 40 + (uint64_t)p, NULL,
                           S_STATE);
            }
            dg_policy_reset();
            u.want_ht = 0;
        }
        /* N7 output */
        if (sel_ops(S_OUTPUT, v)) {
            u.op = OP_OUTPUT;
            const ct_in oin[4] = {{"QG", 4, {B, T, HV, K}, s.QG, 1},
                                  {"h", 5, {B, NC / B, HV, K, V}, s.h, 1},
                                  {"Aqk", 4, {B, T, HV, BT}, s.Aqk, 1},
                                  {"E", 4, {B, T, HV, V}, s.E, 1}};
            snprintf(label, sizeof label, "%s output", cn);
            gpu_vs_cpu(cpu, gpu, label, &u, 4, oin, act, seed + 50, NULL, S_OUTPUT);
        }
    }
    free(xraw);
    free(braw);
    free(graw);
    free(alog);
    free(dtb);
    free_sdata(&s);
}

/* -- OC: the composite and the recurrence */

enum { IQ, IK, IV, IG, IBETA, IA, ID, IH0, NIN };

typedef struct kdata {
    double *x[NIN];
    ct_in in[NIN];
} kdata;

static dg_gate_kind gate_of(const kcase *c) {
    return c->opt & GK ? DG_GATE_KDA : c->opt & GL ? DG_GATE_LOWERBOUND : DG_GATE_NONE;
}

static void make_kdata(const crun *r, uint64_t seed, kdata *d) {
    const kcase *c = r->c;
    memset(d, 0, sizeof *d);
    const int64_t B = r->L.B, T = r->L.T, TT = B * T, N = r->L.N;
    const ct_in proto[NIN] = {
        {"q", 4, {B, T, c->H, c->K}, NULL, 0},   {"k", 4, {B, T, c->H, c->K}, NULL, 0},
        {"v", 4, {B, T, c->HV, c->V}, NULL, 0},  {"g", 4, {B, T, c->HV, c->K}, NULL, 0},
        {"beta", 3, {B, T, c->HV}, NULL, 0},     {"A_log", 1, {c->HV}, NULL, 1},
        {"dt_bias", 1, {c->HV * c->K}, NULL, 1}, {"h0", 4, {N, c->HV, c->K, c->V}, NULL, 1}};
    const int64_t nq = TT * c->H * c->K, ng = TT * c->HV * c->K;
    d->x[IQ] = kt_randn(nq, seed + 1, 1.0);
    d->x[IK] = kt_randn(nq, seed + 2, 1.0);
    if (!(c->opt & L2)) { /* the op expects unit keys/queries then */
        kt_rownorm(d->x[IQ], nq / c->K, c->K);
        kt_rownorm(d->x[IK], nq / c->K, c->K);
    }
    d->x[IV] = kt_randn(TT * c->HV * c->V, seed + 3, 1.0);
    if (gate_of(c) == DG_GATE_NONE) {
        d->x[IG] = kt_rand(ng, seed + 4, c->glo, c->ghi); /* glo == ghi: every g equals it */
    } else {
        d->x[IG] = kt_randn(ng, seed + 4, 1.0);
        d->x[IA] = kt_rand(c->HV, seed + 6, -0.5, 1.0);
        d->x[ID] = kt_randn(c->HV * c->K, seed + 7, 0.5);
    }
    d->x[IBETA] = c->opt & SG ? kt_randn(TT * c->HV, seed + 5, 1.0)
                              : kt_rand(TT * c->HV, seed + 5, 0.05, 0.95);
    if (c->h0)
        d->x[IH0] = kt_randn(N * c->HV * c->K * c->V, seed + 8, 0.5);
    for (int i = 0; i < NIN; i++) {
        d->in[i] = proto[i];
        d->in[i].x = d->x[i];
    }
}

static void free_kdata(kdata *d) {
    for (int i = 0; i < NIN; i++)
        free(d->x[i]);
}

static ucall kcall(const crun *r, opk op) {
    const kcase *c = r->c;
    ucall u;
    memset(&u, 0, sizeof u);
    u.op = op;
    u.opts = opts_of(r);
    u.opts.gate = gate_of(c);
    u.opts.l2norm_qk = (c->opt & L2) != 0;
    u.opts.beta_sigmoid = (c->opt & SG) != 0;
    u.opts.allow_neg_eigval = (c->opt & NE) != 0;
    u.opts.output_final_state = 1;
    return u;
}

static void oc_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r) {
    const kcase *c = r->c;
    const uint64_t seed = c->seed;
    kdata d;
    make_kdata(r, seed, &d);
    const ucall uc = kcall(r, OP_CHUNK), ur = kcall(r, OP_REC);
    const ct_op oc = op_of(&uc), orec = op_of(&ur);
    char label[240];

    if (sel_ops(S_CHUNK, V_OPS_F32) || sel_ops(S_REC, V_OPS_F32)) {
        /* f32: CUDA chunked (gc) and recurrent (gr) with the same seeds; CPU f64 (c64) and CPU
         * f32 (c32, r32) on the same values */
        ct_res gc, gr, c64, c32, r32;
        ct_run_op(gpu, DG_F32, &oc, NIN, d.in, NULL, seed + 60, &gc);
        ct_run_op(gpu, DG_F32, &orec, NIN, d.in, &gc, seed + 60, &gr);
        ct_in used[NIN];
        for (int i = 0; i < NIN; i++) {
            used[i] = d.in[i];
            used[i].x = gc.xin[i];
        }
        ct_run_op(cpu, DG_F64, &oc, NIN, used, &gc, seed + 60, &c64);
        ct_run_op(cpu, DG_F32, &oc, NIN, used, &gc, seed + 60, &c32);
        ct_run_op(cpu, DG_F32, &orec, NIN, used, &gc, seed + 60, &r32);
        /* dA_log and ddt_bias sum B*T (x K) per-token terms that cancel to a result up to ~100x
         * smaller than the terms, so the f32 rounding of the per-token gate gradients (~1e-6 of
         * their scale, more for the chunked form whose dg comes out of a reverse cumsum of
         * differences) is amplified there: the CPU f32 reference itself misses 1e-5 on them in
         * some cases. Those two must be within 1e-5 or within 2x of the CPU f32 reference's own
         * error. */
        ct_tols tc = ct_tols_all(TOL_OPS_F32), tr = ct_tols_all(TOL_OPS_F32);
        ct_tols tcr = ct_tols_all(TOL_OPS_CHUNK_VS_REC);
        for (int i = IA; i <= ID; i++)
            if (gc.xin[i]) {
                double ec = ct_rel_err(c32.grad[i], c64.grad[i], c32.nin[i]);
                double er = ct_rel_err(r32.grad[i], c64.grad[i], r32.nin[i]);
                printf("   CPU f32 reference error on d%s: chunked %.3e, recurrent %.3e\n",
                       d.in[i].name, ec, er);
                tc.itol[i] = fmax(TOL_OPS_F32, 2 * ec);
                tr.itol[i] = fmax(TOL_OPS_F32, 2 * er);
                tcr.itol[i] = fmax(TOL_OPS_CHUNK_VS_REC, 2 * (ec + er));
            }
        if (const_gate(c)) {
            /* g = -40 per step: the true dg is ~1e-18, the residue of O(1) terms that cancel;
             * compare it in absolute terms against the O(1) scale of the other gradients (f32
             * rounding of those terms ~1e-7) */
            tc.iatol[IG] = tr.iatol[IG] = 1e-6;
            tcr.iatol[IG] = 2e-6;
        }
        snprintf(label, sizeof label, "f32  chunk %s", r->L.name);
        ct_compare(label, &oc, d.in, &gc, &c64, &tc, S_CHUNK, V_OPS_F32);
        snprintf(label, sizeof label, "f32  recurrent %s", r->L.name);
        ct_compare(label, &orec, d.in, &gr, &c64, &tr, S_REC, V_OPS_F32);
        snprintf(label, sizeof label, "CUDA chunk vs CUDA recurrent %s", r->L.name);
        ct_compare(label, &oc, d.in, &gc, &gr, &tcr, S_CHUNK, V_OPS_F32);
        if (const_gate(c)) {
            ct_cell(S_CHUNK, D_FWD, V_OPS_F32);
            dg_check(
                kt_all_finite(gc.out[0], gc.nout[0]) && kt_all_finite(gc.grad[IG], gc.nin[IG]) &&
                    kt_all_finite(gr.out[0], gr.nout[0]) && kt_all_finite(gr.grad[IG], gr.nin[IG]),
                "g=%g per step on CUDA: o and dg finite (chunked and recurrent)", c->glo);
        }
        ct_res *all[5] = {&gc, &gr, &c64, &c32, &r32};
        for (int i = 0; i < 5; i++)
            ct_free_res(all[i]);
    }

    if (sel_ops(S_CHUNK, V_OPS_BF16) || sel_ops(S_REC, V_OPS_BF16)) {
        /* bf16 against the CPU f64 result on the bf16-rounded inputs and seeds */
        ct_tols tb = ct_tols_all(TOL_BF16);
        if (const_gate(c))
            tb.iatol[IG] = 1e-5; /* as above, plus the bf16 rounding of the O(1) seeds */
        snprintf(label, sizeof label, "chunk %s", r->L.name);
        gpu_vs_cpu(cpu, gpu, label, &uc, NIN, d.in, DG_BF16, seed + 62, &tb, S_CHUNK);
        snprintf(label, sizeof label, "recurrent %s", r->L.name);
        gpu_vs_cpu(cpu, gpu, label, &ur, NIN, d.in, DG_BF16, seed + 63, &tb, S_REC);

        /* output and gradient dtypes of a bf16 call: o and q/k/v/g/beta grads bf16, ht and the
         * f32 inputs' grads f32 */
        ct_res bf;
        ct_run_op(gpu, DG_BF16, &oc, NIN, d.in, NULL, seed + 64, &bf);
        int ok = bf.out_dt[0] == DG_BF16 && bf.out_dt[1] == DG_F32;
        for (int i = 0; i < NIN; i++)
            if (bf.xin[i])
                ok &= bf.grad_dt[i] == (d.in[i].f32 ? DG_F32 : DG_BF16);
        ct_cell(S_CHUNK, D_FWD, V_OPS_BF16);
        dg_check(ok, "bf16 chunk %s: o bf16, ht f32, each gradient in its input's dtype",
                 r->L.name);
        ct_free_res(&bf);
    }
    free_kdata(&d);
}

/* -- OP: the recomputation reruns the same deterministic kernels on the same inputs */

static void policy_case(dg_ctx *gpu, const crun *r) {
    kdata d;
    make_kdata(r, r->c->seed + 77, &d);
    const ucall u = kcall(r, OP_CHUNK);
    const ct_op op = op_of(&u);
    for (int a = 0; a < 2; a++) {
        const dg_dtype act = a ? DG_BF16 : DG_F32;
        if (!ct_sel_x(S_POLICY, ops_var(act)))
            continue;
        ct_res rc, ca;
        dg_policy_set_global(DG_POLICY_RECOMPUTE);
        ct_run_op(gpu, act, &op, NIN, d.in, NULL, r->c->seed + 78, &rc);
        dg_policy_set_global(DG_POLICY_CACHE);
        ct_run_op(gpu, act, &op, NIN, d.in, &rc, r->c->seed + 78, &ca);
        dg_policy_reset();
        char label[224];
        snprintf(label, sizeof label, "%s %s CACHE vs RECOMPUTE (bitwise)",
                 act == DG_BF16 ? "bf16" : "f32", r->L.name);
        ct_tols exact = ct_tols_all(0.0);
        ct_compare(label, &op, d.in, &ca, &rc, &exact, S_POLICY, ops_var(act));
        ct_free_res(&rc);
        ct_free_res(&ca);
    }
    free_kdata(&d);
}

/* -- OE: argument errors that need a device (the case must have h0 and gate NONE) */

static void errors_case(dg_ctx *cpu, dg_ctx *gpu, const crun *r) {
    if (!r->c->h0 || gate_of(r->c) != DG_GATE_NONE) {
        fprintf(stderr, "FATAL: group OE needs a case with h0 and gate NONE (%s)\n", r->L.name);
        exit(1);
    }
    ct_cell(S_ERRORS, D_FWD, V_NONE);
    printf("-- device and dtype errors\n");
    kdata d;
    make_kdata(r, r->c->seed + 5, &d);
    dg_tensor *t[NIN] = {0};
    for (int i = 0; i < NIN; i++)
        if (d.x[i])
            t[i] = kt_tensor(gpu, DG_F32, d.in[i].ndim, d.in[i].shape, d.x[i], 0);
    ucall u = kcall(r, OP_CHUNK);
    dg_tensor *o = NULL, *ht = NULL, *bad = NULL;
#define CHUNK(ctx_, q_, k_, h0_)                                                                   \
    dg_kda_chunk(ctx_, q_, k_, t[IV], t[IG], t[IBETA], NULL, NULL, h0_, &u.opts, &o, &ht)
    bad = kt_tensor(cpu, DG_F32, d.in[IK].ndim, d.in[IK].shape, d.x[IK], 0);
    dg_check_err(CHUNK(gpu, t[IQ], bad, t[IH0]), DG_ERR_DEVICE, "'k' must be on cuda",
                 "CPU k with CUDA q");
    dg_tensor_free(&bad);
    dg_check_err(CHUNK(cpu, t[IQ], t[IK], t[IH0]), DG_ERR_DEVICE, "must be on cpu",
                 "CUDA tensors with a CPU context");
    bad = kt_tensor(gpu, DG_F64, d.in[IQ].ndim, d.in[IQ].shape, d.x[IQ], 0);
    dg_check_err(CHUNK(gpu, bad, t[IK], t[IH0]), DG_ERR_DTYPE, "f32 or bf16 on CUDA",
                 "f64 q on CUDA");
    dg_tensor_free(&bad);
    bad = kt_tensor(gpu, DG_BF16, d.in[IK].ndim, d.in[IK].shape, d.x[IK], 0);
    dg_check_err(CHUNK(gpu, t[IQ], bad, t[IH0]), DG_ERR_DTYPE, "k must be",
                 "bf16 k with f32 q (one activation dtype)");
    dg_tensor_free(&bad);
    bad = kt_tensor(gpu, DG_BF16, d.in[IH0].ndim, d.in[IH0].shape, d.x[IH0], 0);
    dg_check_err(CHUNK(gpu, t[IQ], t[IK], bad), DG_ERR_DTYPE, "h0 must be", "bf16 h0 on CUDA");
    dg_check_err(dg_kda_recurrent(gpu, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, bad,
                                  &u.opts, &o, &ht),
                 DG_ERR_DTYPE, "h0 must be", "recurrent: bf16 h0 on CUDA");
    dg_tensor_free(&bad);
    /* stage nodes: G is an f32 intermediate on CUDA (W, U, KG may be bf16: the intermediates'
     * storage on the tensor-core path) */
    bad = kt_tensor(gpu, DG_BF16, d.in[IG].ndim, d.in[IG].shape, d.x[IG], 0);
    dg_tensor *h = NULL, *E = NULL, *Aqk = NULL, *Tm = NULL;
    dg_check_err(dg_kda_state(gpu, bad, t[IV], bad, bad, NULL, &u.opts, &h, &E, NULL), DG_ERR_DTYPE,
                 "G must be", "state: bf16 G on CUDA");
    dg_check_err(dg_kda_intra(gpu, t[IQ], t[IK], t[IBETA], bad, &u.opts, &Aqk, &Tm), DG_ERR_DTYPE,
                 "G must be", "intra: bf16 G on CUDA");
    dg_tensor_free(&bad);
#undef CHUNK
    free_all(t, NIN);
    free_kdata(&d);
}

/* ---- extras ---------------------------------------------------------------------------------- */

/* args: argument checks of the raw launchers (no device touched: every one fails before a CUDA
 * call). */
static void test_args(dg_ctx *cpu) {
    ct_cell(S_ARGS, D_FWD, V_NONE);
    int64_t cu[3] = {0, 40, 100}, off[3] = {0, 3, 7}, bad_off[3] = {0, 2, 6};
    kda_cuda_dims dd;
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 4, 64, 64, 48, 2, cu, off, &dd), DG_ERR_ARG,
                 "BT must be 16, 32 or 64", "dims_new: BT = 48");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 4, 320, 64, 16, 2, cu, off, &dd), DG_ERR_SHAPE,
                 "K <= 256", "dims_new: K = 320");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 3, 64, 64, 16, 2, cu, off, &dd), DG_ERR_SHAPE,
                 "HV % H == 0", "dims_new: HV not a multiple of H");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 4, 64, 64, 16, 2, cu, bad_off, &dd), DG_ERR_ARG,
                 "chunk_off gives it", "dims_new: chunk_off inconsistent with cu");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 99, 2, 4, 64, 64, 16, 2, cu, off, &dd), DG_ERR_ARG,
                 "cu must run from 0 to TT", "dims_new: cu[N] != TT");
    dg_check(dd.buf == NULL && dd.NC == 0, "failed dims_new leaves the struct empty");
    float x = 0.f;
    dg_check_err(dg__kda_intra_fwd_cuda(cpu, NULL, 1.f, &x, &x, &x, &x, &x, &x), DG_ERR_ARG,
                 "dg__kda_cuda_dims_new", "intra: NULL dims");
    dg_check_err(dg__l2norm_fwd_cuda(cpu, 4, 0, 1e-6f, 0, &x, &x, NULL), DG_ERR_ARG, "K=0",
                 "l2norm: K = 0");
}

/* rule: tc follows bf16 activations (and opts.tensor_cores), stays 0 for f32, and the stages
 * sharing a composite's tables inherit it; a bad tensor_cores is refused. */
static void test_rule(dg_ctx *gpu) {
    ct_cell(S_RULE, D_FWD, V_NONE);
    printf("-- ops-layer rule\n");
    const char *op = "test_kda_cuda";
    dg_kda_opts opts;
    memset(&opts, 0, sizeof opts);
    static const dg_kda_tc modes[3] = {DG_KDA_TC_DEFAULT, DG_KDA_TC_OFF, DG_KDA_TC_3XTF32};
    static const int want_tc[3] = {1, 0, 2};
    for (int i = 0; i < 3; i++) {
        opts.tensor_cores = modes[i];
        kda_cfg c;
        DG_TEST_TRY(dg__kda_cfg_init(op, gpu, &opts, 2, 70, 2, 2, 64, 64, DG_BF16, &c));
        dg_check(c.tc == want_tc[i], "bf16 entry point, tensor_cores %d: tc = %d (want %d)",
                 (int)modes[i], c.tc, want_tc[i]);
        dg__kda_cfg_free(&c);
    }
    opts.tensor_cores = (dg_kda_tc)7;
    {
        kda_cfg c;
        dg_check_err(dg__kda_cfg_init(op, gpu, &opts, 2, 70, 2, 2, 64, 64, DG_BF16, &c), DG_ERR_ARG,
                     "tensor_cores", "tensor_cores out of range");
    }
    opts.tensor_cores = DG_KDA_TC_DEFAULT;
    kda_cfg cb, cf, cs;
    DG_TEST_TRY(dg__kda_cfg_init(op, gpu, &opts, 2, 70, 2, 2, 64, 64, DG_BF16, &cb));
    DG_TEST_TRY(dg__kda_cfg_dev(op, gpu, &cb, NULL));
    DG_TEST_TRY(dg__kda_cfg_init(op, gpu, &opts, 2, 70, 2, 2, 64, 64, DG_F32, &cf));
    DG_TEST_TRY(dg__kda_cfg_dev(op, gpu, &cf, NULL));
    /* an f32 stage (like state, fed f32 intermediates) sharing the bf16 composite's tables */
    DG_TEST_TRY(dg__kda_cfg_init(op, gpu, &opts, 2, 70, 2, 2, 64, 64, DG_F32, &cs));
    DG_TEST_TRY(dg__kda_cfg_dev(op, gpu, &cs, cb.dev));
    dg_check(cb.cd.tc == 1, "bf16 entry point: tc = %d (want 1)", cb.cd.tc);
    dg_check(cf.cd.tc == 0, "f32 entry point: tc = %d (want 0)", cf.cd.tc);
    dg_check(cs.cd.tc == cb.cd.tc, "f32 stage sharing a bf16 composite's tables: tc = %d (want %d)",
             cs.cd.tc, cb.cd.tc);
    dg__kda_cfg_free(&cs);
    dg__kda_cfg_free(&cf);
    dg__kda_cfg_free(&cb);
}

/* timing: the forward and the backward stages at one training-like shape (printed, not
 * asserted: host clock around dg_ctx_sync, median of 10 runs). */

static double now_ms(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum { B_L2, B_BETA, B_GATE, B_INTRA, B_WY, B_STATE, B_OUTPUT, B_REC, NB };

typedef struct tbufs {
    kda_cuda_dims *dd;
    float scale;
    /* forward inputs and quantities (made by the CUDA forward) */
    dg_tensor *qraw, *kraw, *q, *k, *r, *v, *x, *Alog, *dtb, *b, *beta, *g, *G, *Aqk, *Tm, *W, *U,
        *KG, *QG, *h, *E, *ht, *O, *o;
    /* upstream gradients and backward outputs */
    dg_tensor *uK, *uV, *uHV, *uBT, *uH, *uS, *dqh, *dkh, *dK1, *dK2, *dK3, *dV1, *dHV1, *dBT1, *dA,
        *ddt, *dS, *dh;
} tbufs;

static dg_status time_fwd(dg_ctx *gpu, tbufs *z, int s) {
    const kda_cuda_dims *d = z->dd;
    switch (s) {
    case B_L2:
        DG_TRY(dg__l2norm_fwd_cuda(gpu, d->TT * d->H, d->K, 1e-6f, 0, F(z->qraw), F(z->q), NULL));
        return dg__l2norm_fwd_cuda(gpu, d->TT * d->H, d->K, 1e-6f, 0, F(z->kraw), F(z->k), NULL);
    case B_BETA:
        return dg__kda_beta_fwd_cuda(gpu, d->TT * d->HV, 1.0f, 0, F(z->b), F(z->beta));
    case B_GATE:
        return dg__kda_gate_fwd_cuda(gpu, d, DG_GATE_KDA, 0.f, 1, 0, F(z->x), F(z->Alog), F(z->dtb),
                                     F(z->G));
    case B_INTRA:
        return dg__kda_intra_fwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->beta), F(z->G),
                                      F(z->Aqk), F(z->Tm));
    case B_WY:
        return dg__kda_wy_fwd_cuda(gpu, d, F(z->q), F(z->k), F(z->v), F(z->beta), F(z->G), F(z->Tm),
                                   F(z->W), F(z->U), F(z->KG), F(z->QG));
    case B_STATE:
        return dg__kda_state_fwd_cuda(gpu, d, F(z->W), F(z->U), F(z->KG), F(z->G), NULL, F(z->h),
                                      F(z->E), F(z->ht));
    case B_OUTPUT:
        return dg__kda_output_fwd_cuda(gpu, d, z->scale, F(z->QG), F(z->h), F(z->Aqk), F(z->E),
                                       F(z->O));
    case B_REC:
        return dg__kda_recurrent_fwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->v), F(z->g),
                                          F(z->beta), NULL, F(z->o), F(z->ht));
    default:
        return DG_ERR_ARG;
    }
}

static dg_status time_bwd(dg_ctx *gpu, tbufs *z, int s) {
    const kda_cuda_dims *d = z->dd;
    switch (s) {
    case B_L2:
        DG_TRY(dg__l2norm_bwd_cuda(gpu, d->TT * d->H, d->K, F(z->q), NULL, F(z->r), F(z->dqh), 0,
                                   F(z->dkh)));
        return dg__l2norm_bwd_cuda(gpu, d->TT * d->H, d->K, F(z->k), NULL, F(z->r), F(z->dqh), 0,
                                   F(z->dkh));
    case B_BETA:
        return dg__kda_beta_bwd_cuda(gpu, d->TT * d->HV, 1.0f, 0, F(z->b), F(z->uHV), F(z->dHV1));
    case B_GATE:
        return dg__kda_gate_bwd_cuda(gpu, d, DG_GATE_KDA, 0.f, 1, 0, F(z->x), F(z->Alog), F(z->dtb),
                                     F(z->uK), F(z->dK1), F(z->dA), F(z->ddt));
    case B_INTRA:
        return dg__kda_intra_bwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->beta), F(z->G),
                                      F(z->Tm), F(z->uBT), F(z->uBT), F(z->dqh), F(z->dkh),
                                      F(z->dHV1), F(z->dK1), 0);
    case B_WY:
        return dg__kda_wy_bwd_cuda(gpu, d, F(z->q), F(z->k), F(z->v), F(z->beta), F(z->G), F(z->Tm),
                                   F(z->uK), F(z->uV), F(z->uK), F(z->uK), F(z->dqh), F(z->dkh),
                                   F(z->dV1), F(z->dHV1), F(z->dK1), F(z->dBT1), 0);
    case B_STATE:
        return dg__kda_state_bwd_cuda(gpu, d, F(z->W), F(z->KG), F(z->G), F(z->h), F(z->E),
                                      F(z->uH), F(z->uV), F(z->uS), F(z->dK1), F(z->dV1), F(z->dK2),
                                      F(z->dK3), F(z->dS));
    case B_OUTPUT:
        return dg__kda_output_bwd_cuda(gpu, d, z->scale, F(z->QG), F(z->h), F(z->Aqk), F(z->E),
                                       F(z->uV), F(z->dK1), F(z->dh), F(z->dBT1), F(z->dV1));
    case B_REC:
        return dg__kda_recurrent_bwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->v), F(z->g),
                                          F(z->beta), NULL, F(z->uV), F(z->uS), F(z->dqh),
                                          F(z->dkh), F(z->dV1), F(z->dK1), F(z->dHV1), F(z->dS));
    default:
        return DG_ERR_ARG;
    }
}

static void time_table(dg_ctx *gpu, tbufs *z, int bwd) {
    static const char *names[2][NB] = {{"l2norm (q and k)", "beta", "gate KDA + cumsum", "intra",
                                        "wy (W, U, KG, QG)", "state", "output", "recurrent (ref)"},
                                       {"l2norm (q and k)", "beta", "gate KDA + cumsum", "intra",
                                        "wy", "state", "output", "recurrent (ref)"}};
    const kda_cuda_dims *d = z->dd;
    enum { R = 10 };
    double med[NB], mn[NB];
    printf("-- timing, %s: (B,T,H,HV,K,V,BT) = (2,%lld,%d,%d,%d,%d,%d), median of %d runs, "
           "host clock around dg_ctx_sync\n",
           bwd ? "backward" : "forward", (long long)(d->TT / 2), d->H, d->HV, d->K, d->V, d->BT, R);
    for (int s = 0; s < NB; s++) {
        double t[R];
        /* warm-up (scratch blocks enter the cache), and the inputs of later stages */
        DG_TEST_TRY(bwd ? time_bwd(gpu, z, s) : time_fwd(gpu, z, s));
        DG_TEST_TRY(dg_ctx_sync(gpu));
        for (int r = 0; r < R; r++) {
            double t0 = now_ms();
            DG_TEST_TRY(bwd ? time_bwd(gpu, z, s) : time_fwd(gpu, z, s));
            DG_TEST_TRY(dg_ctx_sync(gpu));
            t[r] = now_ms() - t0;
        }
        qsort(t, R, sizeof t[0], cmp_double);
        med[s] = 0.5 * (t[R / 2 - 1] + t[R / 2]);
        mn[s] = t[0];
    }
    double chunked = 0;
    for (int s = 0; s < B_REC; s++)
        chunked += med[s];
    printf("   %-22s %10s %10s %8s\n", "stage", "median ms", "min ms", "share");
    for (int s = 0; s < NB; s++)
        printf("   %-22s %10.3f %10.3f %7.1f%%\n", names[bwd][s], med[s], mn[s],
               s < B_REC ? 100.0 * med[s] / chunked : 0.0);
    printf("   %-22s %10.3f   (sum of the chunked stages' medians)\n",
           bwd ? "chunked backward" : "chunked forward", chunked);
    dg_check(chunked > 0 && isfinite(chunked), "timing table printed (not an assertion on speed)");
}

static void timing(dg_ctx *gpu) {
    const int64_t B = 2, T = 4096;
    const int H = 16, HV = 16, K = 128, V = 128, BT = 64, N = (int)B;
    const int64_t TT = B * T, NT = T / BT, NC = B * NT;
    int64_t cu[3] = {0, T, 2 * T}, off[3] = {0, NT, 2 * NT};
    kda_cuda_dims dd;
    DG_TEST_TRY(dg__kda_cuda_dims_new(gpu, TT, H, HV, K, V, BT, N, cu, off, &dd));
    tbufs z;
    memset(&z, 0, sizeof z);
    z.dd = &dd;
    z.scale = 1.0f / sqrtf((float)K);
    z.qraw = mk_rand(gpu, DG_F32, TT, H, K, 0, 101, -1, 1);
    z.kraw = mk_rand(gpu, DG_F32, TT, H, K, 0, 102, -1, 1);
    z.v = mk_rand(gpu, DG_F32, TT, HV, V, 0, 103, -1, 1);
    z.x = mk_rand(gpu, DG_F32, TT, HV, K, 0, 104, -3, 3);
    z.Alog = mk_rand(gpu, DG_F32, HV, 0, 0, 0, 105, 0, 2.77);
    z.dtb = mk_rand(gpu, DG_F32, (int64_t)HV * K, 0, 0, 0, 106, -1, 1);
    z.b = mk_rand(gpu, DG_F32, TT, HV, 0, 0, 107, -3, 3);
    z.q = mk(gpu, TT, H, K, 0);
    z.k = mk(gpu, TT, H, K, 0);
    z.r = mk(gpu, TT, H, 0, 0);
    z.beta = mk(gpu, TT, HV, 0, 0);
    z.g = mk(gpu, TT, HV, K, 0);
    z.G = mk(gpu, TT, HV, K, 0);
    z.Aqk = mk(gpu, TT, HV, BT, 0);
    z.Tm = mk(gpu, TT, HV, BT, 0);
    z.W = mk(gpu, TT, HV, K, 0);
    z.U = mk(gpu, TT, HV, V, 0);
    z.KG = mk(gpu, TT, HV, K, 0);
    z.QG = mk(gpu, TT, HV, K, 0);
    z.h = mk(gpu, NC, HV, K, V);
    z.E = mk(gpu, TT, HV, V, 0);
    z.ht = mk(gpu, N, HV, K, V);
    z.O = mk(gpu, TT, HV, V, 0);
    z.o = mk(gpu, TT, HV, V, 0);
    /* the forward quantities, and the per-step log decay of the recurrence (the same gate without
     * the cumsum) */
    DG_TEST_TRY(dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 0, F(z.qraw), F(z.q), F(z.r)));
    DG_TEST_TRY(dg__l2norm_fwd_cuda(gpu, TT * H, K, 1e-6f, 0, F(z.kraw), F(z.k), NULL));
    DG_TEST_TRY(dg__kda_beta_fwd_cuda(gpu, TT * HV, 1.0f, 0, F(z.b), F(z.beta)));
    DG_TEST_TRY(dg__kda_gate_fwd_cuda(gpu, &dd, DG_GATE_KDA, 0.f, 0, 0, F(z.x), F(z.Alog), F(z.dtb),
                                      F(z.g)));
    DG_TEST_TRY(dg__kda_gate_fwd_cuda(gpu, &dd, DG_GATE_KDA, 0.f, 1, 0, F(z.x), F(z.Alog), F(z.dtb),
                                      F(z.G)));
    DG_TEST_TRY(dg__kda_intra_fwd_cuda(gpu, &dd, z.scale, F(z.q), F(z.k), F(z.beta), F(z.G),
                                       F(z.Aqk), F(z.Tm)));
    DG_TEST_TRY(dg__kda_wy_fwd_cuda(gpu, &dd, F(z.q), F(z.k), F(z.v), F(z.beta), F(z.G), F(z.Tm),
                                    F(z.W), F(z.U), F(z.KG), F(z.QG)));
    DG_TEST_TRY(dg__kda_state_fwd_cuda(gpu, &dd, F(z.W), F(z.U), F(z.KG), F(z.G), NULL, F(z.h),
                                       F(z.E), NULL));
    z.uK = mk_rand(gpu, DG_F32, TT, HV, K, 0, 201, -1, 1);
    z.uV = mk_rand(gpu, DG_F32, TT, HV, V, 0, 202, -1, 1);
    z.uHV = mk_rand(gpu, DG_F32, TT, HV, 0, 0, 203, -1, 1);
    z.uBT = mk_rand(gpu, DG_F32, TT, HV, BT, 0, 204, -1, 1);
    z.uH = mk_rand(gpu, DG_F32, NC, HV, K, V, 205, -1, 1);
    z.uS = mk_rand(gpu, DG_F32, N, HV, K, V, 206, -1, 1);
    z.dqh = mk(gpu, TT, H, K, 0);
    z.dkh = mk(gpu, TT, H, K, 0);
    z.dK1 = mk(gpu, TT, HV, K, 0);
    z.dK2 = mk(gpu, TT, HV, K, 0);
    z.dK3 = mk(gpu, TT, HV, K, 0);
    z.dV1 = mk(gpu, TT, HV, V, 0);
    z.dHV1 = mk(gpu, TT, HV, 0, 0);
    z.dBT1 = mk(gpu, TT, HV, BT, 0);
    z.dA = mk(gpu, HV, 0, 0, 0);
    z.ddt = mk(gpu, (int64_t)HV * K, 0, 0, 0);
    z.dS = mk(gpu, N, HV, K, V);
    z.dh = mk(gpu, NC, HV, K, V);
    ct_cell(S_TIMING, D_FWD, V_NONE);
    time_table(gpu, &z, 0);
    time_table(gpu, &z, 1);
    dg_tensor *all[] = {z.qraw, z.kraw, z.q,  z.k,   z.r,   z.v,   z.x,   z.Alog, z.dtb,
                        z.b,    z.beta, z.g,  z.G,   z.Aqk, z.Tm,  z.W,   z.U,    z.KG,
                        z.QG,   z.h,    z.E,  z.ht,  z.O,   z.o,   z.uK,  z.uV,   z.uHV,
                        z.uBT,  z.uH,   z.uS, z.dqh, z.dkh, z.dK1, z.dK2, z.dK3,  z.dV1,
                        z.dHV1, z.dBT1, z.dA, z.ddt, z.dS,  z.dh};
    free_all(all, NELEM(all));
    dg__kda_cuda_dims_free(gpu, &dd);
}

/* ---- the driver ------------------------------------------------------------------------------ */

static int any_raw(int dir, int s0, int s1, int v0, int v1) {
    for (int s = s0; s <= s1; s++)
        for (int v = v0; v <= v1; v++)
            if (ct_sel(s, dir, v))
                return 1;
    return 0;
}

static int any_ops(int s0, int s1) {
    for (int s = s0; s <= s1; s++)
        if (sel_ops(s, V_OPS_F32) || sel_ops(s, V_OPS_BF16))
            return 1;
    return 0;
}

static void run_case(dg_ctx *cpu, dg_ctx *gpu, int idx) {
    crun cr;
    cr.c = &kcases[idx];
    case_layout(idx, &cr.L);
    crun *r = &cr;
    const unsigned runs = r->c->runs;
    const int rf = (runs & RF) && any_raw(D_FWD, S_L2, S_CHUNK, V_F32, V_F32);
    const int rb = (runs & RB) && any_raw(D_BWD, S_L2, S_REC, V_F32, V_F32);
    const int tc = (runs & TC) && (any_raw(D_FWD, S_INTRA, S_OUTPUT, V_FFMA, V_3XTF32) ||
                                   any_raw(D_BWD, S_INTRA, S_OUTPUT, V_FFMA, V_3XTF32) ||
                                   any_raw(D_ACC, S_INTRA, S_WY, V_FFMA, V_3XTF32));
    const int mid = (runs & TC) &&
                    (any_raw(D_FWD, S_WY, S_OUTPUT, V_MID, V_MID) ||
                     any_raw(D_BWD, S_STATE, S_OUTPUT, V_MID, V_MID) || ct_sel_x(S_ERRORS, V_MID));
    const int tables =
        (runs & (RF | RB | TC)) && (rf || rb || tc || mid || ct_sel_x(S_TABLES, V_NONE));
    const int os = (runs & OS) && any_ops(S_L2, S_OUTPUT);
    const int oc = (runs & OC) && any_ops(S_REC, S_CHUNK);
    const int op = (runs & OP) && (ct_sel_x(S_POLICY, V_OPS_F32) || ct_sel_x(S_POLICY, V_OPS_BF16));
    const int oe = (runs & OE) && ct_sel_x(S_ERRORS, V_NONE);
    if (!tables && !os && !oc && !op && !oe)
        return;
    ct_print_case(&r->L, runs);
    if (tables) {
        rtab tab;
        rtab_init(cpu, gpu, r, &tab);
        world w;
        if (rf || rb) { /* variant f32: tc = 0 against the CPU f32 chain */
            world_setup(cpu, gpu, r, &tab, DG_F32, 0, &w);
            w.mode = 0;
            w.var = V_F32;
            w.tol = TOL_RAW_F32;
            raw_run(cpu, gpu, &w, rf, rb);
            world_free(&w);
        }
        if (tc) { /* variants tf32, 3xtf32, ffma: tc = 1, 2, 0 against the CPU f64 chain */
            static const int modes[3] = {1, 2, 0};
            static const double mode_tol[3] = {TOL_FFMA, TOL_TF32, TOL_3XTF32};
            world_setup(cpu, gpu, r, &tab, DG_F64, 0, &w);
            for (int i = 0; i < 3; i++) {
                w.mode = tab.dd.tc = modes[i];
                w.var = V_FFMA + w.mode;
                w.tol = mode_tol[w.mode];
                raw_run(cpu, gpu, &w, 1, 1);
            }
            tab.dd.tc = 0;
            world_free(&w);
        }
        if (mid) { /* variant mid: tc = 1 and bf16 intermediates where the sizes allow them */
            tab.dd.tc = 1;
            tab.dd.mid = 1;
            if (dg__kda_mid_fits(&tab.dd)) {
                world_setup(cpu, gpu, r, &tab, DG_F64, 1, &w);
                w.mode = 1;
                w.var = V_MID;
                w.tol = TOL_TF32;
                raw_run(cpu, gpu, &w, 1, 1);
                if (ct_sel_x(S_ERRORS, V_MID))
                    mid_refusals(gpu, &w);
                world_free(&w);
            } else {
                printf("   mid: skipped (needs K %% 16 == 0, K <= 256, V %% 16 == 0; K=%d V=%d)\n",
                       r->c->K, r->c->V);
            }
            tab.dd.tc = 0;
            tab.dd.mid = 0;
        }
        rtab_free(gpu, &tab);
    }
    if (os)
        os_case(cpu, gpu, r);
    if (oc)
        oc_case(cpu, gpu, r);
    if (op)
        policy_case(gpu, r);
    if (oe)
        errors_case(cpu, gpu, r);
}

/* cpu mode: the args extra (no device touched) */
static void cpu_extras(dg_ctx *cpu) {
    if (ct_sel_x(S_ARGS, V_NONE))
        test_args(cpu);
}

static void gpu_extras(dg_ctx *gpu) {
    if (ct_sel_x(S_RULE, V_NONE))
        test_rule(gpu);
    if (ct_sel_x(S_TIMING, V_NONE) && !getenv("DG_KDA_NO_BENCH"))
        timing(gpu);
}

static const char *const groups[] = {"RF", "RB", "TC", "OS", "OC", "OP", "OE"};
static const ct_suite suite = {
    .name = "kda_cuda",
    .axes = {stage_name, NSTAGE, S_TABLES, dir_name, NDIR, var_name, NVAR, 1},
    .group_name = groups,
    .ngroup = NELEM(groups),
    .ncases = NELEM(kcases),
    .layout = case_layout,
    .run = run_case,
    .cpu_extras = cpu_extras,
    .gpu_extras = gpu_extras};

int main(int argc, char **argv) { return ct_main(argc, argv, &suite); }
#endif

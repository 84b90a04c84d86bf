/*
 * tests/test_kda_cuda.c -- every KDA entry point on CUDA, through the tape, against the CPU f64
 * reference: each stage node on its own (l2norm under both policies, beta c = 1/2, gate_cumsum
 * with every gate kind, intra, wy, state with/without h0 under both policies, output), the
 * composite dg_kda_chunk and the recurrence dg_kda_recurrent: forward values AND the gradient of
 * every input, seeded with random output gradients.
 *
 * Each comparison runs the CUDA op first, reads back the inputs and seeds it actually used (bf16
 * rounded for bf16 runs, f32 rounded for f32 tensors) and runs the CPU f64 op on exactly those
 * values, so the error measured is the CUDA computation's own: f32 within 1e-5 (norm-relative),
 * bf16 within 1e-2. Cases: T not a multiple of BT, B = 2, nonzero h0, varlen with 3 and 4
 * odd-length sequences, GVA, BT = 16/32/64, K and V not multiples of 32, gates NONE / KDA /
 * LOWERBOUND with in-op l2norm and beta sigmoid, T = 1, T < BT, g = -40 per step; then
 * chunked == recurrent on CUDA, CACHE == RECOMPUTE on CUDA (bitwise), output dtypes, and device /
 * dtype errors. cpu mode: nothing to run (the CPU reference has its own tests).
 */
#include "harness.h"
#include "kda_testutil.h"

/* f32 CUDA vs f64: the kernels sum in f32 over at most BT-long rows, K/V-long dot products and
 * a state chain of a few chunks; the CPU f32 reference stays within 1e-5 of f64 on the same
 * cases (test_kda_chunk), and the kernels only reorder those sums. */
#define TOL_F32 1e-5
/* bf16 inputs, f32 math, bf16 outputs and gradients: the final rounding alone is 2^-9 of the
 * largest value; 1e-2 leaves room for rounded seeds of the backward (o is bf16). */
#define TOL_BF16 1e-2
/* CUDA chunked vs CUDA recurrent: each is within TOL_F32 of the same f64 result. */
#define TOL_CHUNK_REC 2e-5

#define MAXIN 8
#define MAXOUT 4

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

static int n_outputs(const ucall *u) {
    switch (u->op) {
    case OP_INTRA:
        return 2;
    case OP_WY:
        return 4;
    case OP_STATE:
        return u->want_ht ? 3 : 2;
    case OP_CHUNK:
    case OP_REC:
        return 2;
    default:
        return 1;
    }
}

static dg_status call_op(dg_ctx *ctx, dg_tensor *const *in, dg_tensor **out, const ucall *u) {
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

/* One input: NULL x = absent. f32: kept f32 on CUDA whatever the activation dtype (A_log,
 * dt_bias, h0 and the intermediates G, Tm, W, U, KG, QG, h, Aqk, E). */
typedef struct tin {
    const char *name;
    int ndim;
    int64_t shape[5];
    const double *x;
    int f32;
} tin;

/* What one run produced, as host doubles; xin/seed: the values actually used. */
typedef struct tres {
    int n_in, n_out;
    double *out[MAXOUT], *seed[MAXOUT], *grad[MAXIN], *xin[MAXIN];
    int64_t nout[MAXOUT], nin[MAXIN];
    dg_dtype out_dt[MAXOUT], grad_dt[MAXIN];
} tres;

static void free_res(tres *r) {
    for (int j = 0; j < MAXOUT; j++) {
        free(r->out[j]);
        free(r->seed[j]);
    }
    for (int i = 0; i < MAXIN; i++) {
        free(r->grad[i]);
        free(r->xin[i]);
    }
    memset(r, 0, sizeof *r);
}

/* Forward in ctx, then backward seeded with `from`'s seeds (or fresh random ones from `seed`).
 * On CUDA the activation inputs get `act` and the f32 ones f32; on the CPU every input gets
 * `act` (f64 or f32). */
static void run(dg_ctx *ctx, dg_dtype act, const ucall *u, int n_in, const tin *ins,
                const tres *from, uint64_t seed, tres *r) {
    memset(r, 0, sizeof *r);
    const int cpu = dg_ctx_device(ctx).kind == DG_DEV_CPU;
    dg_tensor *t[MAXIN] = {0}, *out[MAXOUT] = {0}, *sd[MAXOUT] = {0};
    r->n_in = n_in;
    r->n_out = n_outputs(u);
    for (int i = 0; i < n_in; i++) {
        if (!ins[i].x)
            continue;
        dg_dtype dt = cpu || !ins[i].f32 ? act : DG_F32;
        t[i] = kt_tensor(ctx, dt, ins[i].ndim, ins[i].shape, ins[i].x, 1);
        r->nin[i] = dg_tensor_numel(t[i]);
        r->xin[i] = kt_host(t[i], r->nin[i]);
    }
    dg_tape_reset();
    DG_TEST_TRY(call_op(ctx, t, out, u));
    for (int j = 0; j < r->n_out; j++) {
        if (!out[j]) {
            fprintf(stderr, "FATAL: output %d of op %d is NULL\n", j, (int)u->op);
            exit(1);
        }
        r->nout[j] = dg_tensor_numel(out[j]);
        r->out_dt[j] = dg_tensor_dtype(out[j]);
        double *s = from ? from->seed[j] : kt_randn(r->nout[j], seed + 101 + 7 * (uint64_t)j, 1.0);
        sd[j] = kt_tensor(ctx, r->out_dt[j], dg_tensor_ndim(out[j]), dg_tensor_shape(out[j]), s, 0);
        if (!from)
            free(s);
        r->seed[j] = kt_host(sd[j], r->nout[j]);
        r->out[j] = kt_host(out[j], r->nout[j]);
    }
    DG_TEST_TRY(dg_tape_backward_multi(ctx, r->n_out, out, (const dg_tensor *const *)sd));
    for (int i = 0; i < n_in; i++) {
        if (!t[i])
            continue;
        const dg_tensor *g = dg_tensor_grad(t[i]);
        r->grad_dt[i] = g ? dg_tensor_dtype(g) : dg_tensor_dtype(t[i]);
        r->grad[i] = kt_host(g, r->nin[i]); /* zeros when nothing flowed */
    }
    dg_tape_reset();
    for (int i = 0; i < MAXIN; i++)
        dg_tensor_free(&t[i]);
    for (int j = 0; j < MAXOUT; j++) {
        dg_tensor_free(&out[j]);
        dg_tensor_free(&sd[j]);
    }
}

static const char *out_names(const ucall *u, int j) {
    static const char *names[][4] = {
        {"y"}, {"beta"},    {"G"},      {"Aqk", "Tm"}, {"W", "U", "KG", "QG"}, {"h", "E", "ht"},
        {"o"}, {"o", "ht"}, {"o", "ht"}};
    return names[u->op][j];
}

/* Norm-relative error (the dg_check_rel metric). */
static double rel_err(const double *got, const double *want, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i]))
            return INFINITY;
        num = fmax(num, fabs(got[i] - want[i]));
        den = fmax(den, fabs(want[i]));
    }
    return num / (den > 1e-12 ? den : 1e-12);
}

/* Tolerances of one comparison: `tol` for every output and gradient, except input i's gradient
 * when itol[i] > 0 (norm-relative) or iatol[i] > 0 (absolute). */
typedef struct tols {
    double tol, itol[MAXIN], iatol[MAXIN];
} tols;

static tols tols_all(double tol) {
    tols t;
    memset(&t, 0, sizeof t);
    t.tol = tol;
    return t;
}

/* got vs want: every output and every input gradient. */
static void compare(const char *label, const ucall *u, const tin *ins, const tres *got,
                    const tres *want, const tols *t) {
    char name[288];
    for (int j = 0; j < got->n_out; j++) {
        snprintf(name, sizeof name, "%s %s", label, out_names(u, j));
        dg_check_rel(name, got->out[j], want->out[j], got->nout[j], t->tol);
    }
    for (int i = 0; i < got->n_in; i++) {
        if (!got->xin[i])
            continue;
        snprintf(name, sizeof name, "%s d%s", label, ins[i].name);
        if (t->iatol[i] > 0)
            dg_check_close(name, got->grad[i], want->grad[i], got->nin[i], t->iatol[i], 0);
        else
            dg_check_rel(name, got->grad[i], want->grad[i], got->nin[i],
                         t->itol[i] > 0 ? t->itol[i] : t->tol);
    }
}

/* The op on CUDA (activations in `act`) against the CPU f64 op on the same values. */
static void gpu_vs_cpu(dg_ctx *cpu, dg_ctx *gpu, const char *label, const ucall *u, int n_in,
                       const tin *ins, dg_dtype act, uint64_t seed, const tols *t) {
    tres g, c;
    run(gpu, act, u, n_in, ins, NULL, seed, &g);
    tin used[MAXIN];
    for (int i = 0; i < n_in; i++) {
        used[i] = ins[i];
        used[i].x = g.xin[i];
    }
    run(cpu, DG_F64, u, n_in, used, &g, seed, &c);
    char name[224];
    snprintf(name, sizeof name, "%s %s", act == DG_BF16 ? "bf16" : "f32 ", label);
    tols dflt = tols_all(act == DG_BF16 ? TOL_BF16 : TOL_F32);
    compare(name, u, ins, &g, &c, t ? t : &dflt);
    free_res(&g);
    free_res(&c);
}

/* ---- data ------------------------------------------------------------------------------------ */

typedef struct dcase {
    const char *name;
    int B, T, H, HV, K, V, BT;
    const int64_t *cu;
    int nseq;
} dcase;

static int nseqs(const dcase *c) { return c->cu ? c->nseq : c->B; }
static int64_t nchunks(const dcase *c) {
    int64_t nc = 0;
    for (int n = 0; n < nseqs(c); n++) {
        int64_t len = c->cu ? c->cu[n + 1] - c->cu[n] : c->T;
        nc += (len + c->BT - 1) / c->BT;
    }
    return nc;
}

static dg_kda_opts opts_of(const dcase *c) {
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = c->BT;
    o.cu_seqlens = c->cu;
    o.n_seqs = c->cu ? c->nseq : 0;
    return o;
}

/* Realistic stage inputs: unit q/k rows, decays in (-0.5, -0.01), and the intermediates the CPU
 * f64 pipeline makes from them (so the state chain stays a contraction). */
typedef struct sdata {
    double *q, *k, *v, *g, *beta, *h0, *G, *Aqk, *Tm, *W, *U, *KG, *QG, *h, *E;
} sdata;

static double *host_of(dg_tensor *t) {
    double *p = kt_host(t, dg_tensor_numel(t));
    return p;
}

static void make_sdata(dg_ctx *cpu, const dcase *c, uint64_t seed, sdata *s) {
    const int64_t TT = (int64_t)c->B * c->T, N = nseqs(c);
    const int64_t nq = TT * c->H * c->K, nv = TT * c->HV * c->V, ng = TT * c->HV * c->K;
    s->q = kt_randn(nq, seed + 1, 1.0);
    s->k = kt_randn(nq, seed + 2, 1.0);
    kt_rownorm(s->q, nq / c->K, c->K);
    kt_rownorm(s->k, nq / c->K, c->K);
    s->v = kt_randn(nv, seed + 3, 1.0);
    s->g = kt_rand(ng, seed + 4, -0.5, -0.01);
    s->beta = kt_rand(TT * c->HV, seed + 5, 0.05, 0.95);
    s->h0 = kt_randn(N * c->HV * c->K * c->V, seed + 6, 0.5);
    int64_t sq[4] = {c->B, c->T, c->H, c->K}, sv[4] = {c->B, c->T, c->HV, c->V};
    int64_t sg[4] = {c->B, c->T, c->HV, c->K}, sb[3] = {c->B, c->T, c->HV};
    int64_t s0[4] = {N, c->HV, c->K, c->V};
    dg_tensor *q = kt_tensor(cpu, DG_F64, 4, sq, s->q, 0),
              *k = kt_tensor(cpu, DG_F64, 4, sq, s->k, 0);
    dg_tensor *v = kt_tensor(cpu, DG_F64, 4, sv, s->v, 0),
              *g = kt_tensor(cpu, DG_F64, 4, sg, s->g, 0);
    dg_tensor *b = kt_tensor(cpu, DG_F64, 3, sb, s->beta, 0);
    dg_tensor *h0 = kt_tensor(cpu, DG_F64, 4, s0, s->h0, 0);
    dg_kda_opts o = opts_of(c);
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
    for (int i = 0; i < 15; i++)
        dg_tensor_free(&all[i]);
}

static void free_sdata(sdata *s) {
    double *all[15] = {s->q,  s->k, s->v, s->g,  s->beta, s->h0, s->G, s->Aqk,
                       s->Tm, s->W, s->U, s->KG, s->QG,   s->h,  s->E};
    for (int i = 0; i < 15; i++)
        free(all[i]);
}

/* ---- every stage node on its own ------------------------------------------------------------- */

static void test_stages(dg_ctx *cpu, dg_ctx *gpu, const dcase *c, uint64_t seed) {
    printf("-- stages %s\n", c->name);
    sdata s;
    make_sdata(cpu, c, seed, &s);
    const int64_t B = c->B, T = c->T, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    const int64_t N = nseqs(c), NC = nchunks(c), TT = B * T;
    char label[200];
    ucall u;
    memset(&u, 0, sizeof u);
    u.opts = opts_of(c);
    double *xraw = kt_randn(TT * H * K, seed + 11, 1.5); /* l2norm input: not unit rows */
    double *braw = kt_randn(TT * HV, seed + 12, 2.0);    /* beta logits */
    double *graw = kt_randn(TT * HV * K, seed + 13, 1.0);
    double *alog = kt_rand(HV, seed + 14, -0.5, 1.0);
    double *dtb = kt_randn(HV * K, seed + 15, 0.5);

    for (int a = 0; a < 2; a++) {
        const dg_dtype act = a ? DG_BF16 : DG_F32;
        /* N1 l2norm, both policies */
        u.op = OP_L2;
        const tin l2in[1] = {{"x", 4, {B, T, H, K}, xraw, 0}};
        for (int p = 0; p < 2; p++) {
            dg_policy_set("kda_l2norm", p ? DG_POLICY_RECOMPUTE : DG_POLICY_CACHE);
            snprintf(label, sizeof label, "%s l2norm (%s)", c->name, p ? "RECOMPUTE" : "CACHE");
            gpu_vs_cpu(cpu, gpu, label, &u, 1, l2in, act, seed + 20, NULL);
        }
        dg_policy_reset();
        /* N2 beta, c = 1 and 2 */
        u.op = OP_BETA;
        const tin bin[1] = {{"b", 3, {B, T, HV}, braw, 0}};
        for (u.neg = 0; u.neg < 2; u.neg++) {
            snprintf(label, sizeof label, "%s beta c=%d", c->name, u.neg + 1);
            gpu_vs_cpu(cpu, gpu, label, &u, 1, bin, act, seed + 21, NULL);
        }
        u.neg = 0;
        /* N3 gate_cumsum: NONE, KDA, LOWERBOUND (+A_log), LOWERBOUND lb = -2 without A_log */
        u.op = OP_GATE;
        static const char *gname[4] = {"NONE", "KDA + A_log + dt_bias",
                                       "LOWERBOUND + A_log + dt_bias", "LOWERBOUND lb=-2"};
        for (int gk = 0; gk < 4; gk++) {
            u.opts.gate = gk == 0 ? DG_GATE_NONE : gk == 1 ? DG_GATE_KDA : DG_GATE_LOWERBOUND;
            u.opts.lower_bound = gk == 3 ? -2.0 : 0.0;
            const tin gin[3] = {{"g", 4, {B, T, HV, K}, gk ? graw : s.g, 0},
                                {"A_log", 1, {HV}, gk == 1 || gk == 2 ? alog : NULL, 1},
                                {"dt_bias", 1, {HV * K}, gk ? dtb : NULL, 1}};
            snprintf(label, sizeof label, "%s gate %s", c->name, gname[gk]);
            gpu_vs_cpu(cpu, gpu, label, &u, 3, gin, act, seed + 22 + (uint64_t)gk, NULL);
        }
        u.opts.gate = DG_GATE_NONE;
        u.opts.lower_bound = 0;
        /* N4 intra */
        u.op = OP_INTRA;
        const tin iin[4] = {{"q", 4, {B, T, H, K}, s.q, 0},
                            {"k", 4, {B, T, H, K}, s.k, 0},
                            {"beta", 3, {B, T, HV}, s.beta, 0},
                            {"G", 4, {B, T, HV, K}, s.G, 1}};
        snprintf(label, sizeof label, "%s intra", c->name);
        gpu_vs_cpu(cpu, gpu, label, &u, 4, iin, act, seed + 30, NULL);
        /* N5 wy */
        u.op = OP_WY;
        const tin win[6] = {{"q", 4, {B, T, H, K}, s.q, 0},  {"k", 4, {B, T, H, K}, s.k, 0},
                            {"v", 4, {B, T, HV, V}, s.v, 0}, {"beta", 3, {B, T, HV}, s.beta, 0},
                            {"G", 4, {B, T, HV, K}, s.G, 1}, {"Tm", 4, {B, T, HV, BT}, s.Tm, 1}};
        snprintf(label, sizeof label, "%s wy", c->name);
        gpu_vs_cpu(cpu, gpu, label, &u, 6, win, act, seed + 31, NULL);
        if (act == DG_BF16)
            continue; /* state and output take f32 intermediates only */
        /* N6 state: h0 + ht under both policies, then no h0 / no ht */
        u.op = OP_STATE;
        for (int p = 0; p < 3; p++) {
            dg_policy_set("kda_state", p == 1 ? DG_POLICY_CACHE : DG_POLICY_RECOMPUTE);
            u.want_ht = p < 2;
            const tin sin_[5] = {{"W", 4, {B, T, HV, K}, s.W, 1},
                                 {"U", 4, {B, T, HV, V}, s.U, 1},
                                 {"KG", 4, {B, T, HV, K}, s.KG, 1},
                                 {"G", 4, {B, T, HV, K}, s.G, 1},
                                 {"h0", 4, {N, HV, K, V}, p < 2 ? s.h0 : NULL, 1}};
            snprintf(label, sizeof label, "%s state %s", c->name,
                     p == 0   ? "+h0 +ht (RECOMPUTE)"
                     : p == 1 ? "+h0 +ht (CACHE)"
                              : "no h0, no ht");
            gpu_vs_cpu(cpu, gpu, label, &u, 5, sin_, act, seed + 40 + (uint64_t)p, NULL);
        }
        dg_policy_reset();
        u.want_ht = 0;
        /* N7 output */
        u.op = OP_OUTPUT;
        const tin oin[4] = {{"QG", 4, {B, T, HV, K}, s.QG, 1},
                            {"h", 5, {B, NC / B, HV, K, V}, s.h, 1},
                            {"Aqk", 4, {B, T, HV, BT}, s.Aqk, 1},
                            {"E", 4, {B, T, HV, V}, s.E, 1}};
        snprintf(label, sizeof label, "%s output", c->name);
        gpu_vs_cpu(cpu, gpu, label, &u, 4, oin, act, seed + 50, NULL);
    }
    free(xraw);
    free(braw);
    free(graw);
    free(alog);
    free(dtb);
    free_sdata(&s);
}

/* ---- the composite and the recurrence -------------------------------------------------------- */

enum { IQ, IK, IV, IG, IBETA, IA, ID, IH0, NIN };

typedef struct kcase {
    dcase d;
    dg_gate_kind gate;
    int l2, sig, neg, h0;
    double gconst; /* gate NONE: every g equals this when nonzero */
} kcase;

typedef struct kdata {
    double *x[NIN];
    tin in[NIN];
} kdata;

static void make_kdata(const kcase *kc, uint64_t seed, kdata *d) {
    const dcase *c = &kc->d;
    memset(d, 0, sizeof *d);
    const int64_t B = c->B, T = c->T, TT = B * T, N = nseqs(c);
    const tin proto[NIN] = {
        {"q", 4, {B, T, c->H, c->K}, NULL, 0},   {"k", 4, {B, T, c->H, c->K}, NULL, 0},
        {"v", 4, {B, T, c->HV, c->V}, NULL, 0},  {"g", 4, {B, T, c->HV, c->K}, NULL, 0},
        {"beta", 3, {B, T, c->HV}, NULL, 0},     {"A_log", 1, {c->HV}, NULL, 1},
        {"dt_bias", 1, {c->HV * c->K}, NULL, 1}, {"h0", 4, {N, c->HV, c->K, c->V}, NULL, 1}};
    const int64_t nq = TT * c->H * c->K, ng = TT * c->HV * c->K;
    d->x[IQ] = kt_randn(nq, seed + 1, 1.0);
    d->x[IK] = kt_randn(nq, seed + 2, 1.0);
    if (!kc->l2) { /* the op expects unit keys/queries then */
        kt_rownorm(d->x[IQ], nq / c->K, c->K);
        kt_rownorm(d->x[IK], nq / c->K, c->K);
    }
    d->x[IV] = kt_randn(TT * c->HV * c->V, seed + 3, 1.0);
    if (kc->gate == DG_GATE_NONE) {
        d->x[IG] = kt_rand(ng, seed + 4, -0.5, -0.01);
        if (kc->gconst != 0)
            for (int64_t i = 0; i < ng; i++)
                d->x[IG][i] = kc->gconst;
    } else {
        d->x[IG] = kt_randn(ng, seed + 4, 1.0);
        d->x[IA] = kt_rand(c->HV, seed + 6, -0.5, 1.0);
        d->x[ID] = kt_randn(c->HV * c->K, seed + 7, 0.5);
    }
    d->x[IBETA] =
        kc->sig ? kt_randn(TT * c->HV, seed + 5, 1.0) : kt_rand(TT * c->HV, seed + 5, 0.05, 0.95);
    if (kc->h0)
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

static ucall kcall(const kcase *kc, opk op) {
    ucall u;
    memset(&u, 0, sizeof u);
    u.op = op;
    u.opts = opts_of(&kc->d);
    u.opts.gate = kc->gate;
    u.opts.l2norm_qk = kc->l2;
    u.opts.beta_sigmoid = kc->sig;
    u.opts.allow_neg_eigval = kc->neg;
    u.opts.output_final_state = 1;
    return u;
}

static const int64_t cu3[] = {0, 13, 50, 83};    /* 13, 37, 33: three odd lengths */
static const int64_t cu4[] = {0, 7, 30, 31, 54}; /* 7, 23, 1, 23 */

/* clang-format off */
static const kcase kcases[] = {
    /* name                                   B   T   H HV   K   V  BT  cu nseq   gate           l2 sig neg h0 g */
    {{"[B=2 T=45 BT=16 GVA HV=2H K=40 V=24 h0]", 2, 45, 2, 4, 40, 24, 16, NULL, 0}, DG_GATE_NONE, 0, 0, 0, 1, 0},
    {{"[varlen 13+37+33 BT=32 K=V=64 KDA l2 sig h0]", 1, 83, 1, 2, 64, 64, 32, cu3, 3}, DG_GATE_KDA, 1, 1, 0, 1, 0},
    {{"[varlen 4 seqs BT=16 LB l2 sig neg h0]", 1, 54, 1, 2, 16, 24, 16, cu4, 4}, DG_GATE_LOWERBOUND, 1, 1, 1, 1, 0},
    {{"[T=150 BT=64 H=2 K=48 V=40 KDA l2 sig h0]", 1, 150, 2, 2, 48, 40, 64, NULL, 0}, DG_GATE_KDA, 1, 1, 0, 1, 0},
    {{"[T=70 BT=32 K=V=128 LB l2 sig]", 1, 70, 1, 1, 128, 128, 32, NULL, 0}, DG_GATE_LOWERBOUND, 1, 1, 0, 0, 0},
    {{"[T=1 B=2 BT=16 h0]", 2, 1, 1, 1, 8, 8, 16, NULL, 0}, DG_GATE_NONE, 0, 0, 0, 1, 0},
    {{"[T=10 < BT=64 GVA HV=3H LB l2]", 1, 10, 1, 3, 20, 12, 64, NULL, 0}, DG_GATE_LOWERBOUND, 1, 0, 0, 0, 0},
    {{"[g=-40 per step BT=16 T=40 h0]", 1, 40, 1, 1, 16, 16, 16, NULL, 0}, DG_GATE_NONE, 0, 0, 0, 1, -40},
};
/* clang-format on */

static void test_composite(dg_ctx *cpu, dg_ctx *gpu, const kcase *kc, uint64_t seed) {
    printf("-- chunked and recurrent %s\n", kc->d.name);
    kdata d;
    make_kdata(kc, seed, &d);
    ucall uc = kcall(kc, OP_CHUNK), ur = kcall(kc, OP_REC);
    char label[240];

    /* f32: CUDA chunked (gc) and recurrent (gr) with the same seeds; CPU f64 (c64) and CPU f32
     * (c32, r32) on the same values */
    tres gc, gr, c64, c32, r32;
    run(gpu, DG_F32, &uc, NIN, d.in, NULL, seed + 60, &gc);
    run(gpu, DG_F32, &ur, NIN, d.in, &gc, seed + 60, &gr);
    tin used[NIN];
    for (int i = 0; i < NIN; i++) {
        used[i] = d.in[i];
        used[i].x = gc.xin[i];
    }
    run(cpu, DG_F64, &uc, NIN, used, &gc, seed + 60, &c64);
    run(cpu, DG_F32, &uc, NIN, used, &gc, seed + 60, &c32);
    run(cpu, DG_F32, &ur, NIN, used, &gc, seed + 60, &r32);
    /* dA_log and ddt_bias sum B*T (x K) per-token terms that cancel to a result up to ~100x
     * smaller than the terms, so the f32 rounding of the per-token gate gradients (~1e-6 of
     * their scale, more for the chunked form whose dg comes out of a reverse cumsum of
     * differences) is amplified there: the CPU f32 reference itself misses 1e-5 on them in some
     * cases. Those two must be within 1e-5 or within 2x of the CPU f32 reference's own error. */
    tols tc = tols_all(TOL_F32), tr = tols_all(TOL_F32), tcr = tols_all(TOL_CHUNK_REC);
    for (int i = IA; i <= ID; i++)
        if (gc.xin[i]) {
            double ec = rel_err(c32.grad[i], c64.grad[i], c32.nin[i]);
            double er = rel_err(r32.grad[i], c64.grad[i], r32.nin[i]);
            printf("   CPU f32 reference error on d%s: chunked %.3e, recurrent %.3e\n",
                   d.in[i].name, ec, er);
            tc.itol[i] = fmax(TOL_F32, 2 * ec);
            tr.itol[i] = fmax(TOL_F32, 2 * er);
            tcr.itol[i] = fmax(TOL_CHUNK_REC, 2 * (ec + er));
        }
    if (kc->gconst != 0) {
        /* g = -40 per step: the true dg is ~1e-18, the residue of O(1) terms that cancel;
         * compare it in absolute terms against the O(1) scale of the other gradients (f32
         * rounding of those terms ~1e-7) */
        tc.iatol[IG] = tr.iatol[IG] = 1e-6;
        tcr.iatol[IG] = 2e-6;
    }
    snprintf(label, sizeof label, "f32  chunk %s", kc->d.name);
    compare(label, &uc, d.in, &gc, &c64, &tc);
    snprintf(label, sizeof label, "f32  recurrent %s", kc->d.name);
    compare(label, &ur, d.in, &gr, &c64, &tr);
    snprintf(label, sizeof label, "CUDA chunk vs CUDA recurrent %s", kc->d.name);
    compare(label, &uc, d.in, &gc, &gr, &tcr);
    if (kc->gconst != 0)
        dg_check(kt_all_finite(gc.out[0], gc.nout[0]) && kt_all_finite(gc.grad[IG], gc.nin[IG]) &&
                     kt_all_finite(gr.out[0], gr.nout[0]) && kt_all_finite(gr.grad[IG], gr.nin[IG]),
                 "g=%g per step on CUDA: o and dg finite (chunked and recurrent)", kc->gconst);

    /* bf16 against the CPU f64 result on the bf16-rounded inputs and seeds */
    tols tb = tols_all(TOL_BF16);
    if (kc->gconst != 0)
        tb.iatol[IG] = 1e-5; /* as above, plus the bf16 rounding of the O(1) seeds */
    snprintf(label, sizeof label, "chunk %s", kc->d.name);
    gpu_vs_cpu(cpu, gpu, label, &uc, NIN, d.in, DG_BF16, seed + 62, &tb);
    snprintf(label, sizeof label, "recurrent %s", kc->d.name);
    gpu_vs_cpu(cpu, gpu, label, &ur, NIN, d.in, DG_BF16, seed + 63, &tb);

    /* output and gradient dtypes of a bf16 call: o and q/k/v/g/beta grads bf16, ht and the
     * f32 inputs' grads f32 */
    tres bf;
    run(gpu, DG_BF16, &uc, NIN, d.in, NULL, seed + 64, &bf);
    int ok = bf.out_dt[0] == DG_BF16 && bf.out_dt[1] == DG_F32;
    for (int i = 0; i < NIN; i++)
        if (bf.xin[i])
            ok &= bf.grad_dt[i] == (d.in[i].f32 ? DG_F32 : DG_BF16);
    dg_check(ok, "bf16 chunk %s: o bf16, ht f32, each gradient in its input's dtype", kc->d.name);
    tres *all[6] = {&gc, &gr, &c64, &c32, &r32, &bf};
    for (int i = 0; i < 6; i++)
        free_res(all[i]);
    free_kdata(&d);
}

/* The recomputation reruns the same deterministic kernels on the same inputs. */
static void test_policies(dg_ctx *gpu) {
    printf("-- CACHE vs RECOMPUTE on CUDA (composite)\n");
    const kcase *kc = &kcases[1];
    kdata d;
    make_kdata(kc, 77, &d);
    ucall u = kcall(kc, OP_CHUNK);
    for (int a = 0; a < 2; a++) {
        const dg_dtype act = a ? DG_BF16 : DG_F32;
        tres rc, ca;
        dg_policy_set_global(DG_POLICY_RECOMPUTE);
        run(gpu, act, &u, NIN, d.in, NULL, 78, &rc);
        dg_policy_set_global(DG_POLICY_CACHE);
        run(gpu, act, &u, NIN, d.in, &rc, 78, &ca);
        dg_policy_reset();
        char label[160];
        snprintf(label, sizeof label, "%s CACHE vs RECOMPUTE (bitwise)",
                 act == DG_BF16 ? "bf16" : "f32");
        tols exact = tols_all(0.0);
        compare(label, &u, d.in, &ca, &rc, &exact);
        free_res(&rc);
        free_res(&ca);
    }
    free_kdata(&d);
}

/* ---- argument errors that need a device ------------------------------------------------------ */

static void test_errors(dg_ctx *cpu, dg_ctx *gpu) {
    printf("-- device and dtype errors\n");
    const kcase *kc = &kcases[0];
    kdata d;
    make_kdata(kc, 5, &d);
    dg_tensor *t[NIN] = {0};
    for (int i = 0; i < NIN; i++)
        if (d.x[i])
            t[i] = kt_tensor(gpu, DG_F32, d.in[i].ndim, d.in[i].shape, d.x[i], 0);
    ucall u = kcall(kc, OP_CHUNK);
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
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    free_kdata(&d);
}

/* clang-format off */
static const dcase scases[] = {
    /* name                                       B   T  H HV   K   V  BT  cu  nseq */
    {"[B=2 T=45 BT=16 GVA HV=2H K=40 V=24]",      2, 45, 2, 4, 40, 24, 16, NULL, 0},
    {"[varlen 13+37+33 BT=32 K=V=64]",            1, 83, 1, 2, 64, 64, 32, cu3, 3},
    {"[T=150 BT=64 GVA HV=3H K=33 V=20]",         1, 150, 1, 3, 33, 20, 64, NULL, 0},
};
/* clang-format on */

int main(int argc, char **argv) {
    if (!dg_test_init(argc, argv, "kda_cuda"))
        return dg_test_skip("CUDA-only suite (the CPU reference is tested by kda_chunk and "
                            "kda_stages)");
    int skip = dg_test_need_gpu();
    if (skip)
        return skip;
    dg_ctx *cpu = NULL, *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    for (size_t i = 0; i < sizeof scases / sizeof scases[0]; i++)
        test_stages(cpu, gpu, &scases[i], 500 + 100 * (uint64_t)i);
    for (size_t i = 0; i < sizeof kcases / sizeof kcases[0]; i++)
        test_composite(cpu, gpu, &kcases[i], 2000 + 100 * (uint64_t)i);
    test_policies(gpu);
    test_errors(cpu, gpu);
    dg_ctx_free(&gpu);
    dg_ctx_free(&cpu);
    return dg_test_finish();
}

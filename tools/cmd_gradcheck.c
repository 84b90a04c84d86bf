/*
 * tools/cmd_gradcheck.c -- `deltagrad gradcheck kda|dplr`: the float64 finite-difference check of
 * one stage of the chunked algorithm (or of the whole composite, or the recurrence) on shapes the
 * user picks: the project's gradient-check tests (tests/test_kda_stages.c, tests/test_dplr.c) on
 * the user's own configuration.
 *
 * Inputs are random (seeded) and drawn as the tests draw them: unit q, k rows where the op expects
 * them, log decays in a mild range, KDA's beta in (0.05, 0.95), DPLR's a, b in RWKV-7's form
 * (a = -kh, b = alpha kh, kh of unit norm), so every transition is a contraction. Each input is
 * checked on its own (dg_gradcheck with only that input requiring grad), which gives a progress
 * line per input; its error is dg_gradcheck's norm-relative measure
 *   max_i |analytic_i - numeric_i| / max_i |numeric_i|.
 * Exit codes: 0 every input within --tol, 1 an input over it (or the op failed), 2 bad flags.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "deltagrad.h"
#include "tools/commands.h"
#include "tools/args.h"
#include "tools/cli.h"
#include "tools/host_rand.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { OP_KDA, OP_DPLR };
enum { ST_L2NORM, ST_BETA, ST_GATE, ST_INTRA, ST_WY, ST_STATE, ST_OUTPUT, ST_RECURRENT, ST_CHUNK };
static const char *const g_stage_names[] = {"l2norm", "beta",   "gate_cumsum", "intra", "wy",
                                            "state",  "output", "recurrent",   "chunk"};
enum { DGATE_UNIFORM, DGATE_LOGSIGMOID, DGATE_RWKV7 }; /* how DPLR's gk is drawn */

#define GC_MAX_IN 10
#define GC_MAX_SEQS 4096

typedef struct gc_cfg {
    int op, stage;
    int B, T, H, HV, K, V, BT;
    int t_set, hv_set, b_set;
    dg_gate_kind gate;
    double lb;
    int dgate;
    int l2, sig, neg, h0;
    double scale, eps, tol;
    int64_t seed;
    int policy; /* -1: the ops' defaults */
    int64_t cu[GC_MAX_SEQS + 1];
    int nseq; /* 0: no --cu-seqlens */
    int quiet;
} gc_cfg;

/* One input of the function under test: host values and shape (x NULL: an absent input). */
typedef struct gc_in {
    const char *name;
    int ndim;
    int64_t shape[5];
    double *x;
} gc_in;

typedef struct gc_job {
    const gc_cfg *c;
    dg_kda_opts ko;
    dg_dplr_opts po;
    int n_in, n_out;
    gc_in in[GC_MAX_IN];
} gc_job;

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: deltagrad gradcheck kda|dplr [--stage NAME] [options]\n"
        "\n"
        "Checks the analytic gradients of one stage of the chunked algorithm, of the whole\n"
        "composite (the default) or of the token-by-token recurrence against central finite\n"
        "differences, in float64 on the CPU only, on random (seeded) inputs of the shapes given.\n"
        "Prints the max relative error of each input's gradient,\n"
        "  max_i |analytic_i - numeric_i| / max_i |numeric_i|,\n"
        "and a PASS / FAIL line against --tol.\n"
        "\n"
        "  --stage NAME         kda:  l2norm beta gate_cumsum intra wy state output recurrent "
        "chunk\n"
        "                       dplr: gate_cumsum intra wy state output recurrent chunk\n"
        "                       (default chunk: dg_kda_chunk / dg_dplr_chunk as a whole; "
        "recurrent:\n"
        "                       dg_kda_recurrent / dg_dplr_recurrent; the others: the stage node\n"
        "                       of the same name, e.g. dg_kda_intra, on independent random "
        "inputs)\n"
        "  --B N                batch rows (default 1)\n"
        "  --T N                tokens per row (default 40; with --cu-seqlens: its last entry)\n"
        "  --H N                q/k heads (default 1)\n"
        "  --HV N               kda: value heads, a multiple of --H (default --H)\n"
        "  --K N, --V N         key and value dims (default 4 and 3)\n"
        "  --chunk-size N       16, 32 or 64 (default 16)\n"
        "  --cu-seqlens LIST    packed sequences, e.g. 0,5,5,40 (needs --B 1): starts at 0, never\n"
        "                       decreases, ends at T\n"
        "  --no-h0              no initial state (default: a random h0 for state, recurrent,\n"
        "                       chunk)\n"
        "  --scale S            output scale, > 0 (default K^-1/2)\n"
        "  --gate G             kda: none|kda|lowerbound, the op's gate (default none: g is the\n"
        "                       log decay, drawn in [-0.5, -0.01])\n"
        "  --g-dist D           dplr: uniform|logsigmoid|rwkv7, how the log decay gk is drawn\n"
        "                       (default uniform: [-0.5, -0.01]; logsigmoid: log sigmoid(2x),\n"
        "                       x normal; rwkv7: -e^-1/2 sigmoid(x))\n"
        "  --lower-bound X      kda: lower bound for --gate lowerbound, in [-5, 0) (default -5)\n"
        "  --l2norm-qk          kda: L2-normalise q and k inside the op (recurrent, chunk)\n"
        "  --beta-sigmoid       kda: beta is a raw logit, beta = sigmoid(b) (recurrent, chunk)\n"
        "  --allow-neg-eigval   kda: beta = 2 sigmoid(b) (stage beta; with --beta-sigmoid)\n"
        "  --recompute P        none|default|all: the tape policy, as for deltagrad train (none:\n"
        "                       every node keeps its intermediates; all: every node rebuilds them\n"
        "                       in backward; default: each op's own); all must give the same\n"
        "                       gradients\n"
        "  --seed N             seed of the inputs and of the random projections (default 1)\n"
        "  --eps X              finite-difference step, in (0, 0.01] (default 1e-6)\n"
        "  --tol X              pass if every input's error is below X, in (0, 1) (default 1e-6:\n"
        "                       central differences in f64 typically give 1e-10 to 1e-8)\n"
        "  --quiet              print only the PASS / FAIL line and errors\n"
        "\n"
        "Cost: two forward runs per input element (B T H K elements for q, ...); the command\n"
        "prints its estimate first and a line per input as it goes. Keep shapes small.\n"
        "Exit codes: 0 pass, 1 an error over --tol (or the op failed), 2 bad flags.\n");
}

static int bad(const char *flag, const char *why) {
    fprintf(stderr, "deltagrad gradcheck: %s %s\n(deltagrad gradcheck --help lists the flags)\n",
            flag, why);
    return 2;
}

static int bad_arg(void) {
    fprintf(stderr, "deltagrad gradcheck: %s\n(deltagrad gradcheck --help lists the flags)\n",
            dg_last_error());
    return 2;
}

/* "0,5,5,40" into c->cu; 0 or 2 after naming the flag. */
static int parse_cu(gc_cfg *c, const char *flag, const char *v) {
    char buf[64];
    int n = 0;
    const char *p = v;
    for (;;) {
        size_t l = strcspn(p, ",");
        if (l >= sizeof buf)
            return bad(flag, "has an entry that is too long");
        memcpy(buf, p, l);
        buf[l] = 0;
        if (n > GC_MAX_SEQS)
            return bad(flag, "has too many entries (at most 4097)");
        if (dg_arg_i64(flag, buf, 0, 1 << 20, &c->cu[n]) != DG_OK)
            return bad_arg();
        if (n == 0 && c->cu[0] != 0)
            return bad(flag, "must start at 0");
        if (n > 0 && c->cu[n] < c->cu[n - 1])
            return bad(flag, "must never decrease");
        n++;
        if (!p[l])
            break;
        p += l + 1;
    }
    if (n < 2)
        return bad(flag, "needs at least two entries (0 and T)");
    c->nseq = n - 1;
    return 0;
}

/* 0 parsed, 1 --help / --version printed, 2 usage error. */
static int parse(int argc, char **argv, gc_cfg *c) {
    memset(c, 0, sizeof *c);
    c->B = 1, c->T = 40, c->H = 1, c->K = 4, c->V = 3, c->BT = 16;
    c->h0 = 1, c->eps = 1e-6, c->tol = 1e-6, c->seed = 1, c->policy = -1;
    c->stage = ST_CHUNK;
    if (argc < 2) {
        fprintf(stderr, "deltagrad gradcheck: which op? kda or dplr (see --help)\n");
        return 2;
    }
    if (argv[1][0] == '-') { /* --help, --version; the other flags come after the op */
        int r = dg_cli_lead_flag("gradcheck", usage, argc, argv);
        return r == 0 ? 1 : r == DG_CLI_END ? 2 : r;
    }
    if (!strcmp(argv[1], "kda"))
        c->op = OP_KDA;
    else if (!strcmp(argv[1], "dplr"))
        c->op = OP_DPLR;
    else {
        fprintf(stderr, "deltagrad gradcheck: unknown op '%s': kda or dplr (see --help)\n",
                argv[1]);
        return 2;
    }
    const int kda = c->op == OP_KDA;
    static const int chunks[3] = {16, 32, 64};
    static const dg_cli_flag flags[] = {
        {"--stage", "a stage name"},
        {"--B", "an integer"},
        {"--T", "an integer"},
        {"--H", "an integer"},
        {"--HV", "an integer"},
        {"--K", "an integer"},
        {"--V", "an integer"},
        {"--chunk-size", "16, 32 or 64"},
        {"--cu-seqlens", "a list like 0,5,40"},
        {"--no-h0", NULL},
        {"--scale", "a number > 0"},
        {"--gate", "none, kda or lowerbound"},
        {"--g-dist", "uniform, logsigmoid or rwkv7"},
        {"--lower-bound", "a number in [-5, 0)"},
        {"--l2norm-qk", NULL},
        {"--beta-sigmoid", NULL},
        {"--allow-neg-eigval", NULL},
        {"--recompute", "none, default or all"},
        {"--seed", "an integer"},
        {"--eps", "a number"},
        {"--tol", "a number"},
        {"--quiet", NULL},
    };
    static const char *const kda_only[] = {"--HV",           "--lower-bound",      "--l2norm-qk",
                                           "--beta-sigmoid", "--allow-neg-eigval", "--gate"};
    dg_cli cli;
    dg_cli_init(&cli, kda ? "gradcheck kda" : "gradcheck dplr", usage, flags, DG_CLI_N(flags),
                argc - 1, argv + 1);
    const char *f, *v;
    int pr;
    while ((pr = dg_cli_next(&cli, &f, &v)) == DG_CLI_FLAG) {
        for (size_t k = 0; !kda && k < sizeof kda_only / sizeof *kda_only; k++)
            if (!strcmp(f, kda_only[k]))
                return bad(f, "applies to kda only (DPLR has one head count, --H, and no gate "
                              "or beta options; --g-dist draws its log decay)");
        if (kda && !strcmp(f, "--g-dist"))
            return bad(f, "applies to dplr only (kda draws g in [-0.5, -0.01], or from --gate)");
        if (0) {
        } else if (!strcmp(f, "--no-h0")) {
            c->h0 = 0;
        } else if (!strcmp(f, "--l2norm-qk")) {
            c->l2 = 1;
        } else if (!strcmp(f, "--beta-sigmoid")) {
            c->sig = 1;
        } else if (!strcmp(f, "--allow-neg-eigval")) {
            c->neg = 1;
        } else if (!strcmp(f, "--quiet")) {
            c->quiet = 1;
        } else {
            dg_status s = DG_OK;
            if (!strcmp(f, "--stage")) {
                int st = -1;
                for (int k = kda ? 0 : ST_GATE; k <= ST_CHUNK; k++)
                    if (!strcmp(v, g_stage_names[k]))
                        st = k;
                if (kda && !strcmp(v, "gate"))
                    st = ST_GATE;
                if (st < 0)
                    return bad(f, kda ? "must be l2norm, beta, gate_cumsum, intra, wy, state, "
                                        "output, recurrent or chunk"
                                      : "must be gate_cumsum, intra, wy, state, output, "
                                        "recurrent or chunk");
                c->stage = st;
            } else if (!strcmp(f, "--B")) {
                s = dg_arg_int(f, v, 1, 64, &c->B);
                c->b_set = 1;
            } else if (!strcmp(f, "--T")) {
                s = dg_arg_int(f, v, 1, 1 << 20, &c->T);
                c->t_set = 1;
            } else if (!strcmp(f, "--H")) {
                s = dg_arg_int(f, v, 1, 256, &c->H);
            } else if (!strcmp(f, "--HV")) {
                s = dg_arg_int(f, v, 1, 256, &c->HV);
                c->hv_set = 1;
            } else if (!strcmp(f, "--K")) {
                s = dg_arg_int(f, v, 1, 256, &c->K);
            } else if (!strcmp(f, "--V")) {
                s = dg_arg_int(f, v, 1, 256, &c->V);
            } else if (!strcmp(f, "--chunk-size")) {
                s = dg_arg_choice(f, v, chunks, 3, &c->BT);
            } else if (!strcmp(f, "--cu-seqlens")) {
                int rc = parse_cu(c, f, v);
                if (rc)
                    return rc;
            } else if (!strcmp(f, "--scale")) {
                s = dg_arg_f64(f, v, 0.0, INFINITY, DG_ARG_LO_OPEN, &c->scale);
            } else if (!strcmp(f, "--lower-bound")) {
                s = dg_arg_f64(f, v, -5.0, 0.0, DG_ARG_HI_OPEN, &c->lb);
            } else if (!strcmp(f, "--eps")) {
                s = dg_arg_f64(f, v, 0.0, 1e-2, DG_ARG_LO_OPEN, &c->eps);
            } else if (!strcmp(f, "--tol")) {
                s = dg_arg_f64(f, v, 0.0, 1.0, DG_ARG_LO_OPEN | DG_ARG_HI_OPEN, &c->tol);
            } else if (!strcmp(f, "--seed")) {
                s = dg_arg_i64(f, v, 0, 2147483647, &c->seed);
            } else if (!strcmp(f, "--recompute")) {
                if (!strcmp(v, "none"))
                    c->policy = DG_POLICY_CACHE;
                else if (!strcmp(v, "all"))
                    c->policy = DG_POLICY_RECOMPUTE;
                else if (!strcmp(v, "default"))
                    c->policy = -1;
                else
                    return bad(f, "must be none, default or all");
            } else if (!strcmp(f, "--gate")) { /* kda */
                if (dg_arg_gate(v, &c->gate))
                    return bad(f, "must be none, kda or lowerbound");
            } else { /* --g-dist, dplr */
                if (!strcmp(v, "uniform"))
                    c->dgate = DGATE_UNIFORM;
                else if (!strcmp(v, "logsigmoid"))
                    c->dgate = DGATE_LOGSIGMOID;
                else if (!strcmp(v, "rwkv7"))
                    c->dgate = DGATE_RWKV7;
                else
                    return bad(f, "must be uniform, logsigmoid or rwkv7");
            }
            if (s != DG_OK)
                return bad_arg();
        }
    }
    if (pr != DG_CLI_END)
        return pr == 0 ? 1 : pr;
    if (!c->hv_set)
        c->HV = c->H;
    if (c->HV % c->H != 0)
        return bad("--HV", "must be a multiple of --H (value head hv reads q/k head hv / (HV/H))");
    if (c->nseq) {
        if (c->B != 1)
            return bad("--cu-seqlens", "needs --B 1 (the sequences are packed into one row)");
        if (c->t_set && c->cu[c->nseq] != c->T)
            return bad("--cu-seqlens", "must end at --T");
        c->T = (int)c->cu[c->nseq];
        if (c->T < 1)
            return bad("--cu-seqlens", "must hold at least one token");
    }
    return 0;
}

/* ---- random inputs ----------------------------------------------------------------------------
 */

static double *alloc_n(int64_t n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof *p);
    if (!p) {
        fprintf(stderr, "deltagrad gradcheck: out of host memory (%lld values)\n", (long long)n);
        exit(1);
    }
    return p;
}

static double *rnd_uniform(int64_t n, uint64_t seed, double lo, double hi) {
    double *p = alloc_n(n);
    for (int64_t i = 0; i < n; i++)
        p[i] = lo + (hi - lo) * dg_rand_u01(seed, (uint64_t)i);
    return p;
}

/* Normal values (Box-Muller) times `scale`. */
static double *rnd_normal(int64_t n, uint64_t seed, double scale) {
    double *p = alloc_n(n);
    dg__host_randn(p, n, seed, scale);
    return p;
}

static void rownorm(double *x, int64_t rows, int K) {
    for (int64_t r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < K; c++)
            s += x[r * K + c] * x[r * K + c];
        s = 1.0 / sqrt(s);
        for (int c = 0; c < K; c++)
            x[r * K + c] *= s;
    }
}

/* First token of each sequence, N + 1 entries (rows of T, or the packed table). */
static int seq_starts(const gc_cfg *c, int64_t *st) {
    const int N = c->nseq ? c->nseq : c->B;
    for (int n = 0; n <= N; n++)
        st[n] = c->nseq ? c->cu[n] : (int64_t)n * c->T;
    return N;
}

/* Chunk-local inclusive (Gi) and exclusive (Ge, may be NULL) cumsums of g [TT, row]. */
static void chunk_cumsum(const gc_cfg *c, int64_t row, const double *g, double *Gi, double *Ge) {
    int64_t st[GC_MAX_SEQS + 1];
    const int N = seq_starts(c, st);
    for (int n = 0; n < N; n++)
        for (int64_t e = 0; e < row; e++) {
            double acc = 0;
            for (int64_t t = st[n]; t < st[n + 1]; t++) {
                if ((t - st[n]) % c->BT == 0)
                    acc = 0;
                if (Ge)
                    Ge[t * row + e] = acc;
                acc += g[t * row + e];
                Gi[t * row + e] = acc;
            }
        }
}

/* Total chunks over all sequences. */
static int64_t n_chunks(const gc_cfg *c) {
    int64_t st[GC_MAX_SEQS + 1], nc = 0;
    const int N = seq_starts(c, st);
    for (int n = 0; n < N; n++)
        nc += (st[n + 1] - st[n] + c->BT - 1) / c->BT;
    return nc;
}

static void add_in(gc_job *j, const char *name, int ndim, const int64_t *shape, double *x) {
    gc_in *e = &j->in[j->n_in++];
    e->name = name;
    e->ndim = ndim;
    memcpy(e->shape, shape, sizeof(int64_t) * (size_t)ndim);
    e->x = x;
}

static int64_t numel(int ndim, const int64_t *s) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= s[d];
    return n;
}

/* DPLR's a = -kh, b = alpha kh (kh unit rows, alpha in (0.1, 0.9)): RWKV-7's form. */
static void rwkv7_ab(int64_t n, int K, uint64_t seed, double **a, double **b) {
    double *kh = rnd_normal(n, seed, 1.0), *al = rnd_uniform(n, seed + 1, 0.1, 0.9);
    rownorm(kh, n / K, K);
    *a = alloc_n(n);
    *b = alloc_n(n);
    for (int64_t i = 0; i < n; i++) {
        (*a)[i] = -kh[i];
        (*b)[i] = al[i] * kh[i];
    }
    free(kh);
    free(al);
}

/* DPLR's gk per --gate. */
static double *dplr_gk(const gc_cfg *c, int64_t n, uint64_t seed) {
    if (c->dgate == DGATE_UNIFORM)
        return rnd_uniform(n, seed, -0.5, -0.01);
    double *g = rnd_normal(n, seed, 1.0);
    for (int64_t i = 0; i < n; i++)
        g[i] =
            c->dgate == DGATE_LOGSIGMOID ? -log1p(exp(-2 * g[i])) : -exp(-0.5) / (1 + exp(-g[i]));
    return g;
}

static void build_kda(gc_job *j, uint64_t s) {
    const gc_cfg *c = j->c;
    const int64_t B = c->B, T = c->T, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    const int64_t N = c->nseq ? c->nseq : B, NC = n_chunks(c);
    const int64_t sq[4] = {B, T, H, K}, sg[4] = {B, T, HV, K}, sv[4] = {B, T, HV, V};
    const int64_t sb[3] = {B, T, HV}, sa[4] = {B, T, HV, BT}, s0[4] = {N, HV, K, V};
    const int64_t sh[5] = {c->nseq ? 1 : B, c->nseq ? NC : NC / B, HV, K, V};
    const int64_t nq = numel(4, sq), ng = numel(4, sg), nv = numel(4, sv), nb = numel(3, sb);
    const int64_t na = numel(4, sa), n0 = numel(4, s0), nh = numel(5, sh);
    double *G = NULL;
    if (c->stage == ST_INTRA || c->stage == ST_WY || c->stage == ST_STATE) {
        double *g = rnd_uniform(ng, s + 99, -0.5, -0.01);
        G = alloc_n(ng);
        chunk_cumsum(c, HV * K, g, G, NULL);
        free(g);
    }
    const int gated = c->gate != DG_GATE_NONE;
    switch (c->stage) {
    case ST_L2NORM:
        add_in(j, "x", 4, sq, rnd_normal(nq, s, 1.0));
        j->n_out = 1;
        break;
    case ST_BETA:
        add_in(j, "b", 3, sb, rnd_normal(nb, s, 2.0));
        j->n_out = 1;
        break;
    case ST_GATE:
        add_in(j, "g", 4, sg, gated ? rnd_normal(ng, s, 1.0) : rnd_uniform(ng, s, -0.5, -0.01));
        add_in(j, "A_log", 1, (int64_t[]){HV}, gated ? rnd_uniform(HV, s + 1, -0.5, 1.0) : NULL);
        add_in(j, "dt_bias", 1, (int64_t[]){HV * K}, gated ? rnd_normal(HV * K, s + 2, 0.5) : NULL);
        j->n_out = 1;
        break;
    case ST_INTRA:
        add_in(j, "q", 4, sq, rnd_normal(nq, s, 1.0));
        add_in(j, "k", 4, sq, rnd_normal(nq, s + 1, 1.0));
        add_in(j, "beta", 3, sb, rnd_uniform(nb, s + 2, 0.05, 0.95));
        add_in(j, "G", 4, sg, G);
        G = NULL;
        j->n_out = 2;
        break;
    case ST_WY:
        add_in(j, "q", 4, sq, rnd_normal(nq, s, 1.0));
        add_in(j, "k", 4, sq, rnd_normal(nq, s + 1, 1.0));
        add_in(j, "v", 4, sv, rnd_normal(nv, s + 2, 1.0));
        add_in(j, "beta", 3, sb, rnd_uniform(nb, s + 3, 0.05, 0.95));
        add_in(j, "G", 4, sg, G);
        G = NULL;
        add_in(j, "Tm", 4, sa, rnd_uniform(na, s + 4, -0.5, 0.5));
        j->n_out = 4;
        break;
    case ST_STATE:
        add_in(j, "W", 4, sg, rnd_normal(ng, s, 0.5));
        add_in(j, "U", 4, sv, rnd_normal(nv, s + 1, 0.5));
        add_in(j, "KG", 4, sg, rnd_normal(ng, s + 2, 0.5));
        add_in(j, "G", 4, sg, G);
        G = NULL;
        add_in(j, "h0", 4, s0, c->h0 ? rnd_normal(n0, s + 3, 0.5) : NULL);
        j->n_out = 3;
        break;
    case ST_OUTPUT:
        add_in(j, "QG", 4, sg, rnd_normal(ng, s, 0.5));
        add_in(j, "h", 5, sh, rnd_normal(nh, s + 1, 0.5));
        add_in(j, "Aqk", 4, sa, rnd_uniform(na, s + 2, -0.5, 0.5));
        add_in(j, "E", 4, sv, rnd_normal(nv, s + 3, 0.5));
        j->n_out = 1;
        break;
    default: { /* recurrent, chunk: the inputs of dg_kda_chunk */
        double *q = rnd_normal(nq, s, 1.0), *k = rnd_normal(nq, s + 1, 1.0);
        if (!c->l2) { /* the op expects unit q, k rows then */
            rownorm(q, nq / K, (int)K);
            rownorm(k, nq / K, (int)K);
        }
        add_in(j, "q", 4, sq, q);
        add_in(j, "k", 4, sq, k);
        add_in(j, "v", 4, sv, rnd_normal(nv, s + 2, 1.0));
        add_in(j, "g", 4, sg,
               gated ? rnd_normal(ng, s + 3, 1.0) : rnd_uniform(ng, s + 3, -0.5, -0.01));
        add_in(j, "beta", 3, sb,
               c->sig ? rnd_normal(nb, s + 4, 1.0) : rnd_uniform(nb, s + 4, 0.05, 0.95));
        add_in(j, "A_log", 1, (int64_t[]){HV}, gated ? rnd_uniform(HV, s + 5, -0.5, 1.0) : NULL);
        add_in(j, "dt_bias", 1, (int64_t[]){HV * K}, gated ? rnd_normal(HV * K, s + 6, 0.5) : NULL);
        add_in(j, "h0", 4, s0, c->h0 ? rnd_normal(n0, s + 7, 0.5) : NULL);
        j->n_out = 2;
    }
    }
    free(G);
}

static void build_dplr(gc_job *j, uint64_t s) {
    const gc_cfg *c = j->c;
    const int64_t B = c->B, T = c->T, H = c->H, K = c->K, V = c->V, BT = c->BT;
    const int64_t N = c->nseq ? c->nseq : B, NC = n_chunks(c);
    const int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, sa[4] = {B, T, H, BT};
    const int64_t s0[4] = {N, H, K, V}, sh[5] = {c->nseq ? 1 : B, c->nseq ? NC : NC / B, H, K, V};
    const int64_t nk = numel(4, sk), nv = numel(4, sv), na = numel(4, sa), n0 = numel(4, s0);
    const int64_t nh = numel(5, sh);
    double *a = NULL, *b = NULL, *Gi = NULL, *Ge = NULL;
    if (c->stage == ST_INTRA || c->stage == ST_WY || c->stage == ST_STATE) {
        double *g = dplr_gk(c, nk, s + 99);
        Gi = alloc_n(nk);
        Ge = alloc_n(nk);
        chunk_cumsum(c, H * K, g, Gi, Ge);
        free(g);
    }
    switch (c->stage) {
    case ST_GATE:
        add_in(j, "gk", 4, sk, dplr_gk(c, nk, s));
        j->n_out = 2;
        break;
    case ST_INTRA:
        rwkv7_ab(nk, (int)K, s + 2, &a, &b);
        add_in(j, "q", 4, sk, rnd_normal(nk, s, 0.7));
        add_in(j, "k", 4, sk, rnd_normal(nk, s + 1, 0.7));
        add_in(j, "a", 4, sk, a);
        add_in(j, "b", 4, sk, b);
        add_in(j, "Gi", 4, sk, Gi);
        add_in(j, "Ge", 4, sk, Ge);
        Gi = Ge = NULL;
        j->n_out = 4;
        break;
    case ST_WY:
        rwkv7_ab(nk, (int)K, s + 3, &a, &b);
        add_in(j, "q", 4, sk, rnd_normal(nk, s, 0.7));
        add_in(j, "k", 4, sk, rnd_normal(nk, s + 1, 0.7));
        add_in(j, "v", 4, sv, rnd_normal(nv, s + 2, 0.7));
        add_in(j, "a", 4, sk, a);
        add_in(j, "b", 4, sk, b);
        add_in(j, "Gi", 4, sk, Gi);
        add_in(j, "Ge", 4, sk, Ge);
        Gi = Ge = NULL;
        add_in(j, "Aak", 4, sa, rnd_uniform(na, s + 5, -0.5, 0.5));
        add_in(j, "Tab", 4, sa, rnd_uniform(na, s + 6, -0.5, 0.5));
        j->n_out = 5;
        break;
    case ST_STATE:
        add_in(j, "w", 4, sk, rnd_normal(nk, s, 0.5));
        add_in(j, "u", 4, sv, rnd_normal(nv, s + 1, 0.5));
        add_in(j, "kg", 4, sk, rnd_normal(nk, s + 2, 0.5));
        add_in(j, "bg", 4, sk, rnd_normal(nk, s + 3, 0.5));
        add_in(j, "v", 4, sv, rnd_normal(nv, s + 4, 0.5));
        add_in(j, "Gi", 4, sk, Gi);
        Gi = NULL;
        add_in(j, "h0", 4, s0, c->h0 ? rnd_normal(n0, s + 5, 0.5) : NULL);
        j->n_out = 3;
        break;
    case ST_OUTPUT:
        add_in(j, "qg", 4, sk, rnd_normal(nk, s, 0.5));
        add_in(j, "h", 5, sh, rnd_normal(nh, s + 1, 0.5));
        add_in(j, "Aqk", 4, sa, rnd_uniform(na, s + 2, -0.5, 0.5));
        add_in(j, "Aqb", 4, sa, rnd_uniform(na, s + 3, -0.5, 0.5));
        add_in(j, "v", 4, sv, rnd_normal(nv, s + 4, 0.5));
        add_in(j, "v2", 4, sv, rnd_normal(nv, s + 5, 0.5));
        j->n_out = 1;
        break;
    default: /* recurrent, chunk */
        rwkv7_ab(nk, (int)K, s + 3, &a, &b);
        add_in(j, "q", 4, sk, rnd_normal(nk, s, 1.0));
        add_in(j, "k", 4, sk, rnd_normal(nk, s + 1, 1.0 / sqrt((double)K)));
        add_in(j, "v", 4, sv, rnd_normal(nv, s + 2, 1.0));
        add_in(j, "a", 4, sk, a);
        add_in(j, "b", 4, sk, b);
        add_in(j, "gk", 4, sk, dplr_gk(c, nk, s + 5));
        add_in(j, "h0", 4, s0, c->h0 ? rnd_normal(n0, s + 6, 0.5) : NULL);
        j->n_out = 2;
    }
    free(Gi);
    free(Ge);
}

/* ---- the function under test ------------------------------------------------------------------
 */

static dg_status kda_fn(dg_ctx *ctx, const gc_job *j, dg_tensor *const *in, dg_tensor **out) {
    const dg_kda_opts *o = &j->ko;
    switch (j->c->stage) {
    case ST_L2NORM:
        return dg_kda_l2norm(ctx, in[0], &out[0]);
    case ST_BETA:
        return dg_kda_beta(ctx, in[0], j->c->neg, &out[0]);
    case ST_GATE:
        return dg_kda_gate_cumsum(ctx, in[0], in[1], in[2], o, &out[0]);
    case ST_INTRA:
        return dg_kda_intra(ctx, in[0], in[1], in[2], in[3], o, &out[0], &out[1]);
    case ST_WY:
        return dg_kda_wy(ctx, in[0], in[1], in[2], in[3], in[4], in[5], o, &out[0], &out[1],
                         &out[2], &out[3]);
    case ST_STATE:
        return dg_kda_state(ctx, in[0], in[1], in[2], in[3], in[4], o, &out[0], &out[1], &out[2]);
    case ST_OUTPUT:
        return dg_kda_output(ctx, in[0], in[1], in[2], in[3], o, &out[0]);
    case ST_RECURRENT:
        return dg_kda_recurrent(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], o,
                                &out[0], &out[1]);
    default:
        return dg_kda_chunk(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], o, &out[0],
                            &out[1]);
    }
}

static dg_status dplr_fn(dg_ctx *ctx, const gc_job *j, dg_tensor *const *in, dg_tensor **out) {
    const dg_dplr_opts *o = &j->po;
    switch (j->c->stage) {
    case ST_GATE:
        return dg_dplr_gate_cumsum(ctx, in[0], o, &out[0], &out[1]);
    case ST_INTRA:
        return dg_dplr_intra(ctx, in[0], in[1], in[2], in[3], in[4], in[5], o, &out[0], &out[1],
                             &out[2], &out[3]);
    case ST_WY:
        return dg_dplr_wy(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], in[8], o,
                          &out[0], &out[1], &out[2], &out[3], &out[4]);
    case ST_STATE:
        return dg_dplr_state(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], o, &out[0],
                             &out[1], &out[2]);
    case ST_OUTPUT:
        return dg_dplr_output(ctx, in[0], in[1], in[2], in[3], in[4], in[5], o, &out[0]);
    case ST_RECURRENT:
        return dg_dplr_recurrent(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], o, &out[0],
                                 &out[1]);
    default:
        return dg_dplr_chunk(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], o, &out[0],
                             &out[1]);
    }
}

static dg_status job_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                        void *user) {
    (void)n_in, (void)n_out;
    const gc_job *j = (const gc_job *)user;
    return j->c->op == OP_KDA ? kda_fn(ctx, j, in, out) : dplr_fn(ctx, j, in, out);
}

/* ---- the command --------------------------------------------------------------------------------
 */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *s) {
    size_t l = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && l < n; d++)
        l += (size_t)snprintf(buf + l, n - l, "%s%lld", d ? "," : "", (long long)s[d]);
    if (l < n)
        snprintf(buf + l, n - l, "]");
}

/* Seconds of one forward with grad mode off (the unit of the finite differences). */
static dg_status time_forward(dg_ctx *ctx, gc_job *j, dg_tensor *const *t, double *sec) {
    dg_tensor *out[8] = {0};
    dg_no_grad_begin();
    double t0 = now_s();
    dg_status s = job_fn(ctx, t, j->n_in, out, j->n_out, j);
    *sec = now_s() - t0;
    dg_no_grad_end();
    for (int k = 0; k < 8; k++)
        dg_tensor_free(&out[k]);
    return s;
}

static int fail(const char *what) {
    fprintf(stderr, "deltagrad gradcheck: %s: %s\n", what, dg_last_error());
    return 1;
}

int dg_cmd_gradcheck(int argc, char **argv) {
    static gc_cfg c; /* the cu_seqlens table is large */
    int rc = parse(argc, argv, &c);
    if (rc)
        return rc == 1 ? 0 : rc;
    gc_job j;
    memset(&j, 0, sizeof j);
    j.c = &c;
    j.ko.chunk_size = j.po.chunk_size = c.BT;
    j.ko.scale = j.po.scale = c.scale;
    j.ko.output_final_state = j.po.output_final_state = 1;
    j.ko.cu_seqlens = j.po.cu_seqlens = c.nseq ? c.cu : NULL;
    j.ko.n_seqs = j.po.n_seqs = c.nseq;
    j.ko.gate = c.gate;
    j.ko.lower_bound = c.lb;
    j.ko.l2norm_qk = c.l2;
    j.ko.beta_sigmoid = c.sig;
    j.ko.allow_neg_eigval = c.neg;
    if (c.op == OP_KDA)
        build_kda(&j, (uint64_t)c.seed * 1000);
    else
        build_dplr(&j, (uint64_t)c.seed * 1000);
    if (c.policy >= 0)
        dg_policy_set_global((dg_policy)c.policy);

    const char *opn = c.op == OP_KDA ? "kda" : "dplr", *stn = g_stage_names[c.stage];
    dg_ctx *ctx = NULL;
    dg_tensor *t[GC_MAX_IN] = {0};
    int64_t total = 0;
    if (dg_ctx_new(dg_cpu(), &ctx) != DG_OK) {
        rc = fail("cpu context");
        goto done;
    }
    for (int i = 0; i < j.n_in; i++) {
        if (!j.in[i].x)
            continue;
        if (dg_tensor_from_f64(ctx, DG_F64, j.in[i].ndim, j.in[i].shape, j.in[i].x, &t[i]) !=
            DG_OK) {
            rc = fail(j.in[i].name);
            goto done;
        }
        total += numel(j.in[i].ndim, j.in[i].shape);
    }
    double fwd = 0;
    if (time_forward(ctx, &j, t, &fwd) != DG_OK) {
        rc = fail(c.op == OP_KDA ? "the KDA forward" : "the DPLR forward");
        goto done;
    }
    if (!c.quiet) {
        printf("deltagrad gradcheck: %s %s, f64 on the CPU: B=%d T=%d H=%d", opn, stn, c.B, c.T,
               c.H);
        if (c.op == OP_KDA)
            printf(" HV=%d", c.HV);
        printf(" K=%d V=%d chunk %d", c.K, c.V, c.BT);
        if (c.nseq)
            printf(", %d packed sequences", c.nseq);
        if (c.op == OP_KDA)
            printf(", gate %s", c.gate == DG_GATE_NONE  ? "none"
                                : c.gate == DG_GATE_KDA ? "kda"
                                                        : "lowerbound");
        else
            printf(", gk %s", c.dgate == DGATE_UNIFORM      ? "uniform"
                              : c.dgate == DGATE_LOGSIGMOID ? "logsigmoid"
                                                            : "rwkv7");
        printf(", seed %lld, eps %g, tol %g\n", (long long)c.seed, c.eps, c.tol);
        printf("%lld input elements: %lld forward runs of ~%.2g ms (about %.1f s)\n",
               (long long)total, (long long)(2 * total), 1e3 * fwd, 2.0 * (double)total * fwd);
    }
    double worst = 0;
    int n_bad = 0;
    for (int i = 0; i < j.n_in; i++) {
        if (!t[i])
            continue;
        char sh[96];
        const int64_t n = numel(j.in[i].ndim, j.in[i].shape);
        shape_str(sh, sizeof sh, j.in[i].ndim, j.in[i].shape);
        if (!c.quiet) {
            printf("  %-8s %-20s %9lld elements ", j.in[i].name, sh, (long long)n);
            fflush(stdout);
        }
        dg_tensor_set_requires_grad(t[i], 1);
        dg_gradcheck_report rep;
        double t0 = now_s();
        dg_status s = dg_gradcheck(ctx, job_fn, &j, t, j.n_in, j.n_out, c.eps,
                                   (uint64_t)c.seed * 7919 + 13, &rep);
        dg_tensor_set_requires_grad(t[i], 0);
        if (s != DG_OK) {
            if (!c.quiet)
                printf("\n");
            rc = fail(j.in[i].name);
            goto done;
        }
        const double e = rep.rel_err[i];
        const int ok = e < c.tol; /* NaN fails */
        n_bad += !ok;
        if (!(e <= worst))
            worst = e;
        if (!c.quiet)
            printf("rel err %.3e  abs err %.3e  %s(%.1f s)\n", e, rep.abs_err[i],
                   ok ? "" : "OVER TOL ", now_s() - t0);
    }
    if (n_bad)
        printf("FAIL: gradcheck %s %s: %d input(s) over tol %g (max rel err %.3e)\n", opn, stn,
               n_bad, c.tol, worst);
    else
        printf("PASS: gradcheck %s %s: max rel err %.3e < tol %g\n", opn, stn, worst, c.tol);
    rc = n_bad ? 1 : 0;
done:
    dg_tape_reset();
    dg_policy_reset();
    for (int i = 0; i < GC_MAX_IN; i++) {
        dg_tensor_free(&t[i]);
        free(j.in[i].x);
    }
    dg_ctx_free(&ctx);
    return rc;
}

/*
 * tools/cmd_explain.c -- `deltagrad explain`: the chunked KDA algorithm on a small seeded example.
 * It runs the recurrence and every chunked stage through the library's raw f64 functions, prints
 * each intermediate as compact matrices and checks the identities that make the chunked form
 * equal the recurrence (tools/explain_kda.c; DPLR in tools/explain_dplr.c; both split over
 * simulated ranks by tools/explain_kcp.c; plots in tools/explain_plots.c). `--card` prints the
 * reference card instead: what each tape node computes, its shapes, what it keeps for backward
 * under each policy. This file holds the card, the options and the printing shared by the walks
 * (tools/explain.h).
 */
#include "tools/explain.h"
#include "tools/commands.h"
#include "tools/args.h"
#include "tools/cli.h"
#include "tools/host_rand.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *name, *title, *text;
} stage_doc;

static const stage_doc g_stages[] = {
    {"recurrence", "The recurrence (ground truth, dg_kda_recurrent)",
     "  For each token t, per (sequence, value head), with state S [K,V] (S_-1 = h0):\n"
     "    S'  = Diag(exp(g_t)) S_{t-1}            decay every key row of the state\n"
     "    e_t = beta_t (v_t - S'^T k_t)          the delta: what the decayed state mispredicts\n"
     "    S_t = S' + k_t e_t^T                   rank-1 write\n"
     "    o_t = scale * S_t^T q_t                read-out after the write\n"
     "  One token at a time: T sequential steps of O(K V) work. The chunked form below computes\n"
     "  exactly the same o and final state with matrix products over chunks of BT tokens.\n"},
    {"l2norm", "N1 kda_l2norm: q, k -> unit rows (optional)",
     "  y = x / sqrt(sum x^2 + 1e-6)                         q, k [B,T,H,K]\n"
     "  keeps y and 1/norm; backward dx = r (dy - (dy.y) y).\n"
     "  Unit keys with beta in (0,1) make (I - beta k k^T) a contraction: the state stays "
     "bounded.\n"},
    {"beta", "N2 kda_beta: beta = c * sigmoid(b) (optional)",
     "  c = 1, or 2 with allow_neg_eigval (eigenvalues of I - beta k k^T then in (-1, 1)).\n"},
    {"gate_cumsum", "N3 kda_gate_cumsum: gate, then chunk-local cumulative sum",
     "  g = -exp(A_log) softplus(x + dt_bias)          (gate kda)\n"
     "  g = lb * sigmoid(exp(A_log) (x + dt_bias))     (gate lowerbound, lb in [-5, 0))\n"
     "  G_i = sum_{r<=i} g_r inside each chunk (restarts every BT tokens)     [B,T,HV,K] f32\n"
     "  G is non-increasing in a chunk, so exp(G_i - G_j) <= 1 for j <= i: only such differences\n"
     "  are ever exponentiated. Backward: reverse cumsum, then the gate's derivative.\n"},
    {"intra", "N4 kda_intra: the intra-chunk matrices and the triangular solve",
     "  Aqk[i,j] = scale * sum_d q_id k_jd exp(G_id - G_jd)     j <= i      [B,T,HV,BT]\n"
     "  Lkk[i,j] = beta_i * sum_d k_id k_jd exp(G_id - G_jd)    j <  i\n"
     "  Tm = (I + Lkk)^{-1}   unit lower triangular, by forward substitution  [B,T,HV,BT]\n"
     "  Aqk and Tm are always kept (they are what the backward needs most, and are small).\n"
     "  Backward: dLkk = -stril(Tm^T dTm Tm^T), then the pair sums give dq, dk, dbeta, dG.\n"},
    {"wy", "N5 kda_wy: the WY (UT) representation",
     "  W  = Tm (beta * k * exp(G))         U = Tm (beta * v)\n"
     "  KG = k * exp(G_last - G)            QG = q * exp(G)                  [B,T,HV,K|V]\n"
     "  RECOMPUTE (default): keeps nothing extra, rebuilt from Tm in backward (one cheap pass).\n"
     "  CACHE: keeps W, U, KG, QG (3K + V values per token per head).\n"},
    {"state", "N6 kda_state: the inter-chunk state pass (the only sequential stage)",
     "  for each chunk c in order:   h_c = state at the chunk start        h [B,NT,HV,K,V]\n"
     "      E_c     = U_c - W_c h_c                  (= the per-token deltas e_t, 'v_new')\n"
     "      h_{c+1} = Diag(exp(G_last)) h_c + KG_c^T E_c\n"
     "  final state = h_NT.  CACHE (default) keeps h and E (K*V/BT + V values per token\n"
     "  per head); RECOMPUTE reruns this pass in backward from h0. The backward pass runs\n"
     "  the same loop in reverse for dh.\n"},
    {"output", "N7 kda_output: inter-chunk term + intra-chunk term",
     "  O_c = scale * QG_c h_c  +  Aqk_c E_c          [B,T,HV,V]\n"
     "  Backward: dQG = s dO h^T, dh = s QG^T dO, dAqk = tril(dO E^T), dE = Aqk^T dO.\n"
     "  Its backward runs first: what N5/N6 did not keep (W, U, KG, QG, h, E) it rebuilds once,\n"
     "  for itself and N6; each of them, kept or rebuilt, is freed when its last reader's\n"
     "  backward ends.\n"},
};

const char *ex_card_text(const char *name) {
    for (size_t i = 0; i < sizeof g_stages / sizeof *g_stages; i++)
        if (!strcmp(name, g_stages[i].name))
            return g_stages[i].text;
    return NULL;
}

static int print_card(const char *only) {
    int shown = 0;
    if (!only)
        printf("Chunked Kimi Delta Attention in deltagrad (per sequence and value head; letters:\n"
               "B batch, T tokens, H q/k heads, HV value heads, K key dim, V value dim, BT chunk)\n"
               "\n");
    for (size_t i = 0; i < sizeof g_stages / sizeof *g_stages; i++) {
        if (only && strcmp(only, g_stages[i].name))
            continue;
        printf("%s\n%s\n", g_stages[i].title, g_stages[i].text);
        shown++;
    }
    if (!shown) {
        fprintf(stderr, "deltagrad explain: the card has no stage named '%s'\n", only);
        return 2;
    }
    if (!only)
        printf("Policies: dg_policy_set(\"kda_state\", DG_POLICY_CACHE) per stage, or\n"
               "dg_policy_set_global(...) for all; dg_tape_bytes() shows what the tape holds.\n"
               "Every stage has a CPU reference (f64/f32) and a CUDA kernel, and a test that the\n"
               "chained stages equal the recurrence (tests/test_kda_chunk.c).\n");
    return 0;
}

/* Stage names of the walks (--stage). */
static const char *const g_kda_names[] = {"recurrence", "l2norm",   "beta",  "gate_cumsum",
                                          "intra",      "wy",       "state", "output",
                                          "kcp",        "composite"};
static const char *const g_dplr_names[] = {"recurrence", "cumsum", "intra", "wy",
                                           "state",      "output", "kcp",   "composite"};

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: deltagrad explain [--T N] [--chunk-size N] [--K N] [--V N] [--gate "
        "kda|lowerbound]\n"
        "                         [--strength S] [--seed N] [--stage NAME] [--backward]\n"
        "                         [--dplr] [--cp N] [--plots DIR]\n"
        "       deltagrad explain --card [--stage NAME]\n\n"
        "Runs chunked KDA (or DPLR with --dplr) on a small seeded example, one sequence and one\n"
        "head, through the library's f64 stage functions; prints every intermediate and checks\n"
        "each identity that makes the chunked form equal the recurrence (\"name: residual X\n"
        "(ok)\"; exit 1 when one exceeds %.0e).\n"
        "  --T 16 --chunk-size 4 --K 4 --V 4  tokens, chunk size, key and value dims (defaults)\n"
        "  --gate kda          g = -S softplus(x) (A_log = log S); lowerbound: g = -S sigmoid(x)\n"
        "  --strength 0.5      the gate strength S (lowerbound: S in (0, 5])\n"
        "  --seed 1            the inputs' seed\n"
        "  --stage NAME        only that stage; KDA:",
        EX_TOL);
    for (size_t i = 0; i < sizeof g_kda_names / sizeof *g_kda_names; i++)
        fprintf(f, " %s", g_kda_names[i]);
    fprintf(f, "\n                      DPLR:");
    for (size_t i = 0; i < sizeof g_dplr_names / sizeof *g_dplr_names; i++)
        fprintf(f, " %s", g_dplr_names[i]);
    fprintf(f,
            "\n  --backward          walk the backward stages; each gradient against central\n"
            "                      finite differences of its stage (f64)\n"
            "  --dplr              the same for DPLR (ops/dplr/)\n"
            "  --cp N              also split the sequence over N simulated ranks and merge their\n"
            "                      KCP summaries (ops/kcp/); with --backward also the reverse\n"
            "                      summaries and merge, each rank's gradients against one rank\n"
            "                      (KDA and DPLR)\n"
            "  --plots DIR         gnuplot PNGs: Lkk, Aqk and gate decay heatmaps, state norms,\n"
            "                      chunked-vs-recurrent error in f32 and bf16 (needs gnuplot)\n"
            "  --card              the reference card of the stages (no numbers)\n");
}

static int known_stage(const char *s, int dplr) {
    const char *const *n = dplr ? g_dplr_names : g_kda_names;
    size_t cnt = dplr ? sizeof g_dplr_names / sizeof *g_dplr_names
                      : sizeof g_kda_names / sizeof *g_kda_names;
    for (size_t i = 0; i < cnt; i++)
        if (!strcmp(s, n[i]))
            return 1;
    return 0;
}

int dg_cmd_explain(int argc, char **argv) {
    ex_opts o = {.T = 16, .BT = 4, .K = 4, .V = 4, .gate = DG_GATE_KDA, .strength = 0.5, .seed = 1};
    int card = 0;
    static const dg_cli_flag flags[] = {
        {"--T", "an integer"},    {"--chunk-size", "an integer"},  {"--K", "an integer"},
        {"--V", "an integer"},    {"--gate", "kda or lowerbound"}, {"--strength", "a number"},
        {"--seed", "an integer"}, {"--stage", "a stage name"},     {"--backward", NULL},
        {"--dplr", NULL},         {"--cp", "an integer"},          {"--plots", "DIR"},
        {"--card", NULL},
    };
    dg_cli cli;
    dg_cli_init(&cli, "explain", usage, flags, DG_CLI_N(flags), argc, argv);
    const char *a, *val;
    int pr;
    while ((pr = dg_cli_next(&cli, &a, &val)) == DG_CLI_FLAG) {
        dg_status st = DG_OK;
        int64_t seed = 0;
        if (!strcmp(a, "--card")) {
            card = 1;
        } else if (!strcmp(a, "--backward")) {
            o.backward = 1;
        } else if (!strcmp(a, "--dplr")) {
            o.dplr = 1;
        } else if (!strcmp(a, "--stage")) {
            o.stage = val;
        } else if (!strcmp(a, "--plots")) {
            o.plots = val;
        } else if (!strcmp(a, "--T")) {
            st = dg_arg_int(a, val, 1, 4096, &o.T);
        } else if (!strcmp(a, "--chunk-size")) {
            st = dg_arg_int(a, val, 1, 256, &o.BT);
        } else if (!strcmp(a, "--K")) {
            st = dg_arg_int(a, val, 1, 256, &o.K);
        } else if (!strcmp(a, "--V")) {
            st = dg_arg_int(a, val, 1, 256, &o.V);
        } else if (!strcmp(a, "--cp")) {
            st = dg_arg_int(a, val, 1, 64, &o.cp);
        } else if (!strcmp(a, "--seed")) {
            st = dg_arg_i64(a, val, 0, INT64_MAX, &seed);
            o.seed = (uint64_t)seed;
        } else if (!strcmp(a, "--strength")) {
            st = dg_arg_f64(a, val, 0, 50, DG_ARG_LO_OPEN, &o.strength);
        } else if (!strcmp(a, "--gate")) {
            dg_gate_kind g;
            if (dg_arg_gate(val, &g) || g == DG_GATE_NONE) /* the walks need a gate */
                return dg_cli_bad(&cli, a, "expected kda or lowerbound, got '%s'", val);
            o.gate = g;
        }
        if (st != DG_OK)
            return dg_cli_bad_arg(&cli);
    }
    if (pr != DG_CLI_END)
        return pr;
    if (card)
        return print_card(o.stage);
    if (o.gate == DG_GATE_LOWERBOUND && o.strength > 5) {
        fprintf(stderr,
                "deltagrad explain: --strength: the lower bound -S must lie in [-5, 0), "
                "got S = %g\n",
                o.strength);
        return 2;
    }
    if (o.cp > o.T) {
        fprintf(stderr, "deltagrad explain: --cp %d: more ranks than tokens (--T %d)\n", o.cp, o.T);
        return 2;
    }
    if (o.stage && !known_stage(o.stage, o.dplr)) {
        fprintf(stderr, "deltagrad explain: no %s stage named '%s'\n", o.dplr ? "DPLR" : "KDA",
                o.stage);
        usage(stderr);
        return 2;
    }
    if (o.plots)
        return ex_plots(&o);
    return o.dplr ? ex_dplr(&o) : ex_kda(&o);
}

/* ---- printing and checks shared by the walks ------------------------------------------------ */

int ex_shown(const ex_run *r, const char *name) {
    return !r->o->stage || !strcmp(r->o->stage, name);
}

void ex_heading(const ex_run *r, const char *name, const char *title) {
    if (ex_shown(r, name))
        printf("\n== %s: %s\n", name, title);
}

void ex_check(ex_run *r, const char *stage, const char *name, double residual) {
    int ok = residual <= EX_TOL; /* NaN fails */
    r->checks++;
    if (!ok)
        r->failed++;
    if (!(residual <= r->worst))
        r->worst = residual;
    if (ok && !ex_shown(r, stage))
        return;
    printf("  %s: residual %.1e (%s)\n", name, residual, ok ? "ok" : "NOT OK");
}

void ex_print(const ex_run *r, const char *stage, int n, const ex_mat *m) {
    if (!ex_shown(r, stage))
        return;
    enum { W = 8 }; /* "% 7.3f" */
    int rows = 0;
    for (int i = 0; i < n; i++)
        if (m[i].rows > rows)
            rows = m[i].rows;
    printf("  ");
    for (int i = 0; i < n; i++) {
        int w = m[i].cols * W;
        if (w < (int)strlen(m[i].title))
            w = (int)strlen(m[i].title);
        printf("%-*s%s", w, m[i].title, i + 1 < n ? "   " : "\n");
    }
    for (int row = 0; row < rows; row++) {
        printf("  ");
        for (int i = 0; i < n; i++) {
            int w = m[i].cols * W, tl = (int)strlen(m[i].title);
            for (int c = 0; c < m[i].cols; c++) {
                if (row < m[i].rows) {
                    double v = m[i].a[(int64_t)row * m[i].ld + c];
                    if (fabs(v) >= 999.5 || (v != 0 && fabs(v) < 5e-4))
                        printf(" %7.0e", v);
                    else
                        printf(" % 7.3f", v);
                } else {
                    printf("%*s", W, "");
                }
            }
            printf("%*s%s", w < tl ? tl - w : 0, "", i + 1 < n ? "   " : "\n");
        }
    }
}

void ex_banner(const ex_opts *o, const char *flag, const char *what) {
    printf("deltagrad explain%s: chunked %s on one sequence, one head, f64: T=%d chunk=%d K=%d "
           "V=%d gate=%s strength=%g seed=%llu",
           flag, what, o->T, o->BT, o->K, o->V, o->gate == DG_GATE_KDA ? "kda" : "lowerbound",
           o->strength, (unsigned long long)o->seed);
    if (o->cp)
        printf(" ranks=%d", o->cp);
    printf("%s\n", o->backward ? " (backward)" : "");
}

int ex_summary(const ex_run *r) {
    printf("\n%d identities checked, %d above %.0e (worst residual %.1e)\n", r->checks, r->failed,
           EX_TOL, r->worst);
    return r->failed ? 1 : 0;
}

void ex_print_states(const ex_run *r, const char *stage, const char *name, const double *h, int n,
                     int K, int V) {
    static char titles[4][32];
    for (int c0 = 0; c0 < n; c0 += 4) {
        ex_mat m[4];
        int cnt = n - c0 < 4 ? n - c0 : 4;
        for (int i = 0; i < cnt; i++) {
            snprintf(titles[i], sizeof titles[i], "%s[%d]", name, c0 + i);
            m[i] = (ex_mat){titles[i], h + (int64_t)(c0 + i) * K * V, K, V, V};
        }
        ex_print(r, stage, cnt, m);
    }
}

double ex_relres(const double *a, const double *b, int64_t n) {
    double err = 0, mag = 1;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(a[i] - b[i]);
        if (!(e <= err))
            err = e;
        if (fabs(b[i]) > mag)
            mag = fabs(b[i]);
    }
    return err / mag;
}

/* The 4-point central difference of f in x[i] with step h (error O(h^4)). */
static double fd4(double (*f)(void *ctx), void *ctx, double *x, int64_t i, double h) {
    const double x0 = x[i];
    x[i] = x0 + h;
    double p1 = f(ctx);
    x[i] = x0 - h;
    double m1 = f(ctx);
    x[i] = x0 + 2 * h;
    double p2 = f(ctx);
    x[i] = x0 - 2 * h;
    double m2 = f(ctx);
    x[i] = x0;
    return (8 * (p1 - m1) - (p2 - m2)) / (12 * h);
}

double ex_fdcheck(double (*f)(void *ctx), void *ctx, double *x, int64_t n, const double *g,
                  const unsigned char *skip) {
    double *fd = ex_zeros(n), *gm = ex_zeros(n);
    for (int64_t i = 0; i < n; i++) {
        if (skip && skip[i])
            continue;
        const double h = 1e-3 * (fabs(x[i]) > 1 ? fabs(x[i]) : 1);
        /* Richardson: the h^4 terms of the steps h and h/2 cancel */
        fd[i] = (16 * fd4(f, ctx, x, i, h / 2) - fd4(f, ctx, x, i, h)) / 15;
        gm[i] = g[i];
    }
    double res = ex_relres(gm, fd, n);
    free(fd);
    free(gm);
    return res;
}

double ex_chunk_cumsums(const ex_run *r, const char *stage, int T, int BT, int K, const char *na,
                        const double *a, const char *nb, const double *b, const double *g,
                        const double *incl, const double *excl) {
    double res = 0;
    char title[64];
    for (int t0 = 0; t0 < T; t0 += BT) {
        const int L = T - t0 < BT ? T - t0 : BT;
        snprintf(title, sizeof title, "chunk %d: %s", t0 / BT, na);
        ex_mat m[] = {{title, a + (int64_t)t0 * K, L, K, K}, {nb, b + (int64_t)t0 * K, L, K, K}};
        ex_print(r, stage, 2, m);
        for (int e = 0; e < K; e++) {
            double s = 0;
            for (int i = 0; i < L; i++) {
                const int64_t p = (int64_t)(t0 + i) * K + e;
                if (excl)
                    res = fmax(res, fabs(excl[p] - s));
                s += g[p];
                if (incl)
                    res = fmax(res, fabs(incl[p] - s));
            }
        }
    }
    return res;
}

double *ex_zeros(int64_t n) {
    double *p = (double *)calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    if (!p) {
        fprintf(stderr, "deltagrad explain: out of host memory\n");
        exit(2);
    }
    return p;
}

double *ex_randn(int64_t n, uint64_t seed, double scale) {
    double *p = ex_zeros(n);
    dg__host_randn(p, n, seed, scale);
    return p;
}

double ex_dot(const double *a, const double *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/*
 * tools/explain_dplr.c -- `deltagrad explain --dplr`: the chunked DPLR delta rule on one sequence,
 * one head, every stage run by the library's raw f64 functions (ops/dplr/dplr.h), the KCP
 * summaries and merge by ops/kcp/kcp.h. The tool computes only the checks (Aab from its
 * definition, the triangular identities, prefix runs of the recurrence, finite differences).
 *
 *   recurrence: p_t = S_{t-1}^T a_t;  S_t = Diag(exp gk_t) S_{t-1} + b_t p_t^T + k_t v_t^T;
 *               o_t = s S_t^T q_t
 * Here a = -khat, b = alpha khat (khat a unit vector, alpha in (0, 1)), the decay gk from the
 * gate (--gate, --strength) as for KDA.
 */
#include "ops/dplr/dplr.h"
#include "ops/kcp/kcp.h"
#include "tools/explain.h"
#include "tools/explain_kda.h"
#include "tools/explain_kcp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct px {
    int T, BT, K, V, NC;
    kda_dims d;
    int64_t tab[4];
    double scale;
    double *q, *k, *v, *a, *b, *gk, *h0, *dO, *dht;
    double *Gi, *Ge, *Aqk, *Aqb, *Aak, *Tab, *w, *u, *qg, *kg, *bg, *h, *v2, *ht, *o;
    double *orec, *htrec;
} px;

static int chunk_len(const px *x, int c) {
    const int t0 = c * x->BT;
    return x->T - t0 < x->BT ? x->T - t0 : x->BT;
}

static void px_init(px *x, const ex_opts *o) {
    memset(x, 0, sizeof *x);
    const int T = o->T, BT = o->BT, K = o->K, V = o->V;
    x->T = T;
    x->BT = BT;
    x->K = K;
    x->V = V;
    x->NC = (T + BT - 1) / BT;
    kx_dims(&x->d, x->tab, T, BT, K, V);
    x->scale = 1.0 / sqrt((double)K);
    const int64_t nk = (int64_t)T * K, nv = (int64_t)T * V, kv = (int64_t)K * V;
    const int64_t na = (int64_t)T * BT;
    const uint64_t s = o->seed * 1000 + 500;
    x->q = ex_randn(nk, s + 1, 1.0);
    x->k = ex_randn(nk, s + 2, 1.0 / sqrt((double)K));
    x->v = ex_randn(nv, s + 3, 1.0);
    x->a = ex_randn(nk, s + 4, 1.0);
    x->b = ex_zeros(nk);
    for (int t = 0; t < T; t++) { /* a = -khat, b = alpha khat */
        double n2 = 0, al = dg_rand_u01(s + 5, (uint64_t)t) * 0.8 + 0.1;
        for (int e = 0; e < K; e++)
            n2 += x->a[t * K + e] * x->a[t * K + e];
        for (int e = 0; e < K; e++) {
            const double kh = x->a[t * K + e] / sqrt(n2);
            x->a[t * K + e] = -kh;
            x->b[t * K + e] = al * kh;
        }
    }
    /* the decay from the KDA gate's raw function (cumsum off) */
    double *gx = ex_randn(nk, s + 6, 1.0), *dtb = ex_randn(K, s + 7, 0.3);
    double A_log = log(o->strength);
    x->gk = ex_zeros(nk);
    dg__kda_gate_fwd_f64(&x->d, o->gate, o->gate == DG_GATE_LOWERBOUND ? -o->strength : 0, 0, gx,
                         o->gate == DG_GATE_KDA ? &A_log : NULL, dtb, x->gk);
    free(gx);
    free(dtb);
    x->h0 = ex_zeros(kv);
    x->dO = ex_randn(nv, s + 8, 1.0);
    x->dht = ex_randn(kv, s + 9, 1.0);
    double **f[] = {&x->Gi, &x->Ge, &x->Aqk, &x->Aqb, &x->Aak, &x->Tab, &x->w,
                    &x->u,  &x->qg, &x->kg,  &x->bg,  &x->v2,  &x->o,   &x->orec};
    const int64_t n[] = {nk, nk, na, na, na, na, nk, nv, nk, nk, nk, nv, nv, nv};
    for (size_t i = 0; i < sizeof n / sizeof *n; i++)
        *f[i] = ex_zeros(n[i]);
    x->h = ex_zeros(x->NC * kv);
    x->ht = ex_zeros(kv);
    x->htrec = ex_zeros(kv);
}

static void px_free(px *x) {
    double *p[] = {x->q,  x->k,  x->v,   x->a,   x->b,   x->gk,  x->h0,   x->dO,   x->dht,
                   x->Gi, x->Ge, x->Aqk, x->Aqb, x->Aak, x->Tab, x->w,    x->u,    x->qg,
                   x->kg, x->bg, x->h,   x->v2,  x->ht,  x->o,   x->orec, x->htrec};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++)
        free(p[i]);
}

static int px_forward(px *x) {
    const kda_dims *d = &x->d;
    dg__dplr_cumsum_fwd_f64(d, x->gk, x->Gi, x->Ge);
    if (dg__dplr_intra_fwd_f64(d, x->scale, x->q, x->k, x->a, x->b, x->Gi, x->Ge, x->Aqk, x->Aqb,
                               x->Aak, x->Tab) ||
        dg__dplr_wy_fwd_f64(d, x->scale, x->q, x->k, x->v, x->a, x->b, x->Gi, x->Ge, x->Aak, x->Tab,
                            x->w, x->u, x->qg, x->kg, x->bg) ||
        dg__dplr_state_fwd_f64(d, x->w, x->u, x->kg, x->bg, x->v, x->Gi, x->h0, x->h, x->v2,
                               x->ht)) {
        fprintf(stderr, "deltagrad explain: dplr forward: %s\n", dg_last_error());
        return 2;
    }
    dg__dplr_output_fwd_f64(d, x->qg, x->h, x->Aqk, x->Aqb, x->v, x->v2, x->o);
    return 0;
}

static dg_status rec_run(const void *p, const kda_dims *d, double *o, double *S) {
    const px *x = (const px *)p;
    return dg__dplr_recurrent_fwd_f64(d, x->scale, x->q, x->k, x->v, x->a, x->b, x->gk, x->h0, o,
                                      S);
}

/* The recurrence's state after the first t tokens (h0 for t = 0). */
static int rec_prefix(const void *p, int t, double *S) {
    const px *x = (const px *)p;
    return ex_rec_prefix(x, t, x->BT, x->K, x->V, x->h0, rec_run, S);
}

/* v2 at token t, column e, from the recurrence's state S before it: p_t = S^T a_t. */
static double v2_want(const void *p, int t, int e, const double *S) {
    const px *x = (const px *)p;
    double v = 0;
    for (int i = 0; i < x->K; i++)
        v += S[i * x->V + e] * x->a[(int64_t)t * x->K + i];
    return v;
}

/* (I - Aab) X = R over chunk rows: max |X_i - sum_{j<i} Aab_ij X_j - R_i|. */
static double tri_res(const px *x, const double *A, const double *X, const double *R, int n) {
    double res = 0;
    for (int c = 0; c < x->NC; c++) {
        const int t0 = c * x->BT, L = chunk_len(x, c);
        const double *Ac = A + (int64_t)c * x->BT * x->BT;
        for (int i = 0; i < L; i++)
            for (int e = 0; e < n; e++) {
                double s = X[(int64_t)(t0 + i) * n + e];
                for (int j = 0; j < i; j++)
                    s -= Ac[i * x->BT + j] * X[(int64_t)(t0 + j) * n + e];
                res = fmax(res, fabs(s - R[(int64_t)(t0 + i) * n + e]));
            }
    }
    return res;
}

static int walk_forward(ex_run *r, px *x) {
    const int T = x->T, BT = x->BT, K = x->K, V = x->V, NC = x->NC;
    const int64_t kv = (int64_t)K * V, nk = (int64_t)T * K, nv = (int64_t)T * V;
    char t1[64];

    ex_heading(r, "recurrence", "the ground truth, token by token (dg__dplr_recurrent_fwd_f64)");
    if (ex_shown(r, "recurrence"))
        printf("  p_t = S_{t-1}^T a_t;  S_t = Diag(exp gk_t) S_{t-1} + b_t p_t^T + k_t v_t^T;\n"
               "  o_t = s S_t^T q_t.  Here a_t = -khat_t, b_t = alpha_t khat_t (|khat| = 1,\n"
               "  alpha in (0.1, 0.9)): the transition Diag(exp gk) - alpha khat khat^T is a\n"
               "  contraction, the delta rule with a per-key decay.\n");
    {
        ex_mat m[] = {{"gk (log decay)", x->gk, T, K, K}, {"o (recurrent)", x->orec, T, V, V}};
        ex_print(r, "recurrence", 2, m);
    }

    ex_heading(r, "cumsum",
               "inclusive Gi and exclusive Ge chunk cumsums (dg__dplr_cumsum_fwd_f64)");
    {
        double res = ex_chunk_cumsums(r, "cumsum", x->T, BT, K, "Gi", x->Gi, "Ge", x->Ge, x->gk,
                                      x->Gi, x->Ge);
        ex_check(r, "cumsum", "Gi = inclusive, Ge = exclusive chunk cumsum of gk", res);
    }

    ex_heading(r, "intra", "Aqk, Aqb, Aak and Tab = (I - Aab)^-1 (dg__dplr_intra_fwd_f64)");
    if (ex_shown(r, "intra"))
        printf("  Aqk[i,j] = s q_i.(k_j exp(Gi_i - Gi_j)), Aqb the same with b (j <= i);\n"
               "  Aak[i,j] = a_i.(k_j exp(Ge_i - Gi_j)), Aab the same with b (j < i).\n"
               "  a_i reads the state before token i's decay, hence Ge. Aab is computed here\n"
               "  from its definition, to check Tab.\n");
    double *A = ex_zeros((int64_t)NC * BT * BT);
    {
        double rinv = 0;
        for (int c = 0; c < NC; c++) {
            const int t0 = c * BT, L = chunk_len(x, c);
            double *Ac = A + (int64_t)c * BT * BT;
            for (int i = 0; i < L; i++)
                for (int j = 0; j < i; j++) {
                    double s = 0;
                    for (int e = 0; e < K; e++) {
                        const int64_t pi = (int64_t)(t0 + i) * K + e,
                                      pj = (int64_t)(t0 + j) * K + e;
                        s += x->a[pi] * x->b[pj] * exp(x->Ge[pi] - x->Gi[pj]);
                    }
                    Ac[i * BT + j] = s;
                }
            const int64_t p = (int64_t)t0 * BT;
            snprintf(t1, sizeof t1, "chunk %d: Aqk", c);
            ex_mat m[] = {{t1, x->Aqk + p, L, L, BT},
                          {"Aqb", x->Aqb + p, L, L, BT},
                          {"Aak", x->Aak + p, L, L, BT},
                          {"Aab", Ac, L, L, BT},
                          {"Tab = (I-Aab)^-1", x->Tab + p, L, L, BT}};
            ex_print(r, "intra", 5, m);
            for (int i = 0; i < L; i++)
                for (int j = 0; j <= i; j++) {
                    double s = x->Tab[p + i * BT + j];
                    for (int m2 = j; m2 < i; m2++)
                        s -= Ac[i * BT + m2] * x->Tab[p + m2 * BT + j];
                    rinv = fmax(rinv, fabs(s - (i == j)));
                }
        }
        ex_check(r, "intra", "(I - Aab) Tab = I", rinv);
    }

    ex_heading(r, "wy", "w = Tab (a exp Ge), u = Tab Aak v, qg, kg, bg (dg__dplr_wy_fwd_f64)");
    {
        double *ag = ex_zeros(nk), *av = ex_zeros(nv);
        for (int64_t i = 0; i < nk; i++)
            ag[i] = x->a[i] * exp(x->Ge[i]);
        for (int c = 0; c < NC; c++) {
            const int t0 = c * BT, L = chunk_len(x, c);
            const double *Ak = x->Aak + (int64_t)t0 * BT;
            for (int i = 0; i < L; i++)
                for (int e = 0; e < V; e++) {
                    double s = 0;
                    for (int j = 0; j < i; j++)
                        s += Ak[i * BT + j] * x->v[(int64_t)(t0 + j) * V + e];
                    av[(int64_t)(t0 + i) * V + e] = s;
                }
            snprintf(t1, sizeof t1, "chunk %d: w", c);
            ex_mat m[] = {{t1, x->w + (int64_t)t0 * K, L, K, K},
                          {"u", x->u + (int64_t)t0 * V, L, V, V},
                          {"kg", x->kg + (int64_t)t0 * K, L, K, K},
                          {"bg", x->bg + (int64_t)t0 * K, L, K, K}};
            ex_print(r, "wy", 4, m);
        }
        ex_check(r, "wy", "(I - Aab) w = a exp(Ge)", tri_res(x, A, x->w, ag, K));
        ex_check(r, "wy", "(I - Aab) u = Aak v", tri_res(x, A, x->u, av, V));
        free(ag);
        free(av);
    }
    free(A);

    ex_heading(r, "state", "states at chunk starts and v2 = w h + u (dg__dplr_state_fwd_f64)");
    if (ex_shown(r, "state"))
        printf("  h_{c+1} = Diag(exp lam_c) h_c + kg_c^T v_c + bg_c^T v2_c, v2_c = w_c h_c + u_c;\n"
               "  v2_t is the recurrence's p_t = S_{t-1}^T a_t.\n");
    if (ex_walk_states(r, x, rec_prefix, T, BT, K, V, x->h, x->ht, x->htrec, "v2", x->v2, v2_want,
                       "v2_t = p_t = S_{t-1}^T a_t of the recurrence"))
        return 2;

    ex_heading(r, "output", "o = qg h (inter) + Aqk v + Aqb v2 (intra) (dg__dplr_output_fwd_f64)");
    {
        double *zv = ex_zeros(nv), *zh = ex_zeros(NC * kv), *oi = ex_zeros(nv), *oa = ex_zeros(nv),
               *sum = ex_zeros(nv);
        dg__dplr_output_fwd_f64(&x->d, x->qg, x->h, x->Aqk, x->Aqb, zv, zv, oi);
        dg__dplr_output_fwd_f64(&x->d, x->qg, zh, x->Aqk, x->Aqb, x->v, x->v2, oa);
        for (int64_t i = 0; i < nv; i++)
            sum[i] = oi[i] + oa[i];
        for (int c = 0; c < NC; c++) {
            const int64_t p = (int64_t)c * BT * V;
            const int L = chunk_len(x, c);
            snprintf(t1, sizeof t1, "chunk %d: inter qg h", c);
            ex_mat m[] = {{t1, oi + p, L, V, V},
                          {"intra", oa + p, L, V, V},
                          {"o (chunked)", x->o + p, L, V, V},
                          {"o (recurrent)", x->orec + p, L, V, V}};
            ex_print(r, "output", 4, m);
        }
        ex_check(r, "output", "inter + intra = o", ex_relres(sum, x->o, nv));
        ex_check(r, "output", "chunked o = recurrent o", ex_relres(x->o, x->orec, nv));
        double *fr[] = {zv, zh, oi, oa, sum};
        for (int i = 0; i < 5; i++)
            free(fr[i]);
    }
    return 0;
}

/* ---- backward ------------------------------------------------------------------------------ */

enum { P_OUTPUT, P_STATE, P_WY, P_INTRA, P_CUMSUM, P_FULL, P_NG };
/* The gradient arrays, by name. */
enum {
    G_QG,
    G_H,
    G_AQK,
    G_AQB,
    G_VO,
    G_V2, /* output bwd */
    G_W,
    G_U,
    G_KG,
    G_BG,
    G_VS,
    G_GIS,
    G_H0, /* state bwd */
    G_QW,
    G_KW,
    G_VW,
    G_AW,
    G_BW,
    G_GIW,
    G_GEW,
    G_AAK,
    G_TAB, /* wy bwd */
    G_QI,
    G_KI,
    G_AI,
    G_BI,
    G_GII,
    G_GEI, /* intra bwd */
    G_GI,
    G_GE,
    G_GK,
    G_Q,
    G_K,
    G_V,
    G_A,
    G_B, /* sums, cumsum bwd */
    G_N
};

typedef struct pb {
    px *x;
    int which;
    double *g[G_N];
    double *s[16]; /* scratch outputs of the stage forwards */
} pb;

static double px_loss(void *p) {
    pb *b = (pb *)p;
    px *x = b->x;
    const kda_dims *d = &x->d;
    const int64_t nk = (int64_t)x->T * x->K, nv = (int64_t)x->T * x->V, kv = (int64_t)x->K * x->V;
    const int64_t na = (int64_t)x->T * x->BT, nh = x->NC * kv;
    double **s = b->s, **g = b->g;
    switch (b->which) {
    case P_OUTPUT:
        dg__dplr_output_fwd_f64(d, x->qg, x->h, x->Aqk, x->Aqb, x->v, x->v2, s[0]);
        return ex_dot(x->dO, s[0], nv);
    case P_STATE:
        if (dg__dplr_state_fwd_f64(d, x->w, x->u, x->kg, x->bg, x->v, x->Gi, x->h0, s[1], s[2],
                                   s[3]))
            return NAN;
        return ex_dot(g[G_H], s[1], nh) + ex_dot(g[G_V2], s[2], nv) + ex_dot(x->dht, s[3], kv);
    case P_WY:
        if (dg__dplr_wy_fwd_f64(d, x->scale, x->q, x->k, x->v, x->a, x->b, x->Gi, x->Ge, x->Aak,
                                x->Tab, s[4], s[5], s[6], s[7], s[8]))
            return NAN;
        return ex_dot(g[G_W], s[4], nk) + ex_dot(g[G_U], s[5], nv) + ex_dot(g[G_QG], s[6], nk) +
               ex_dot(g[G_KG], s[7], nk) + ex_dot(g[G_BG], s[8], nk);
    case P_INTRA:
        if (dg__dplr_intra_fwd_f64(d, x->scale, x->q, x->k, x->a, x->b, x->Gi, x->Ge, s[9], s[10],
                                   s[11], s[12]))
            return NAN;
        return ex_dot(g[G_AQK], s[9], na) + ex_dot(g[G_AQB], s[10], na) +
               ex_dot(g[G_AAK], s[11], na) + ex_dot(g[G_TAB], s[12], na);
    case P_CUMSUM:
        dg__dplr_cumsum_fwd_f64(d, x->gk, s[13], s[14]);
        return ex_dot(g[G_GI], s[13], nk) + ex_dot(g[G_GE], s[14], nk);
    default:
        if (px_forward(x))
            return NAN;
        return ex_dot(x->dO, x->o, nv) + ex_dot(x->dht, x->ht, kv);
    }
}

static double pfd(pb *b, int which, double *in, int64_t n, const double *g) {
    b->which = which;
    double res = ex_fdcheck(px_loss, b, in, n, g, NULL);
    if (which == P_FULL && px_forward(b->x))
        return NAN;
    return res;
}

static int walk_backward(ex_run *r, px *x) {
    const int T = x->T, K = x->K, V = x->V, NC = x->NC;
    const int64_t nk = (int64_t)T * K, nv = (int64_t)T * V, kv = (int64_t)K * V;
    const int64_t na = (int64_t)T * x->BT, nh = NC * kv;
    const kda_dims *d = &x->d;
    pb b;
    memset(&b, 0, sizeof b);
    b.x = x;
    const int64_t gn[G_N] = {nk, nh, na, na, nv, nv, nk, nv, nk, nk, nv, nk,
                             kv, nk, nk, nv, nk, nk, nk, nk, na, na, nk, nk,
                             nk, nk, nk, nk, nk, nk, nk, nk, nk, nv, nk, nk};
    const int64_t sn[15] = {nv, nh, nv, kv, nk, nv, nk, nk, nk, na, na, na, na, nk, nk};
    for (int i = 0; i < G_N; i++)
        b.g[i] = ex_zeros(gn[i]);
    for (int i = 0; i < 15; i++)
        b.s[i] = ex_zeros(sn[i]);
    double **g = b.g;
    int rc = 0;

    ex_heading(r, "output", "backward (dg__dplr_output_bwd_f64)");
    if (ex_shown(r, "output"))
        printf("  L = <dO, o> + <dht, ht>; each stage's gradient against central differences of\n"
               "  that stage alone (L_stage = <upstream, its outputs>).\n");
    dg__dplr_output_bwd_f64(d, x->qg, x->h, x->Aqk, x->Aqb, x->v, x->v2, x->dO, g[G_QG], g[G_H],
                            g[G_AQK], g[G_AQB], g[G_VO], g[G_V2]);
    {
        ex_mat m[] = {{"dO", x->dO, T, V, V},
                      {"dqg", g[G_QG], T, K, K},
                      {"dv", g[G_VO], T, V, V},
                      {"dv2", g[G_V2], T, V, V}};
        ex_print(r, "output", 4, m);
        ex_print_states(r, "output", "dh", g[G_H], NC, K, V);
        ex_check(r, "output", "dqg vs finite differences", pfd(&b, P_OUTPUT, x->qg, nk, g[G_QG]));
        ex_check(r, "output", "dh vs finite differences", pfd(&b, P_OUTPUT, x->h, nh, g[G_H]));
        ex_check(r, "output", "dAqk vs finite differences",
                 pfd(&b, P_OUTPUT, x->Aqk, na, g[G_AQK]));
        ex_check(r, "output", "dAqb vs finite differences",
                 pfd(&b, P_OUTPUT, x->Aqb, na, g[G_AQB]));
        ex_check(r, "output", "dv vs finite differences", pfd(&b, P_OUTPUT, x->v, nv, g[G_VO]));
        ex_check(r, "output", "dv2 vs finite differences", pfd(&b, P_OUTPUT, x->v2, nv, g[G_V2]));
    }

    ex_heading(r, "state", "backward: the reverse state pass (dg__dplr_state_bwd_f64)");
    if (dg__dplr_state_bwd_f64(d, x->w, x->kg, x->bg, x->v, x->Gi, x->h, x->v2, g[G_H], g[G_V2],
                               x->dht, g[G_W], g[G_U], g[G_KG], g[G_BG], g[G_VS], g[G_GIS],
                               g[G_H0])) {
        rc = 2;
        goto fail;
    }
    {
        ex_mat m[] = {{"dw", g[G_W], T, K, K},
                      {"du", g[G_U], T, V, V},
                      {"dkg", g[G_KG], T, K, K},
                      {"dbg", g[G_BG], T, K, K}};
        ex_print(r, "state", 4, m);
        ex_check(r, "state", "dw vs finite differences", pfd(&b, P_STATE, x->w, nk, g[G_W]));
        ex_check(r, "state", "du vs finite differences", pfd(&b, P_STATE, x->u, nv, g[G_U]));
        ex_check(r, "state", "dkg vs finite differences", pfd(&b, P_STATE, x->kg, nk, g[G_KG]));
        ex_check(r, "state", "dbg vs finite differences", pfd(&b, P_STATE, x->bg, nk, g[G_BG]));
        ex_check(r, "state", "dv vs finite differences", pfd(&b, P_STATE, x->v, nv, g[G_VS]));
        ex_check(r, "state", "dGi vs finite differences", pfd(&b, P_STATE, x->Gi, nk, g[G_GIS]));
        ex_check(r, "state", "dh0 vs finite differences", pfd(&b, P_STATE, x->h0, kv, g[G_H0]));
    }

    ex_heading(r, "wy", "backward (dg__dplr_wy_bwd_f64)");
    if (dg__dplr_wy_bwd_f64(d, x->scale, x->q, x->k, x->v, x->a, x->b, x->Gi, x->Ge, x->Aak, x->Tab,
                            g[G_W], g[G_U], g[G_QG], g[G_KG], g[G_BG], g[G_QW], g[G_KW], g[G_VW],
                            g[G_AW], g[G_BW], g[G_GIW], g[G_GEW], g[G_AAK], g[G_TAB])) {
        rc = 2;
        goto fail;
    }
    {
        ex_mat m[] = {{"dq", g[G_QW], T, K, K},
                      {"dk", g[G_KW], T, K, K},
                      {"da", g[G_AW], T, K, K},
                      {"db", g[G_BW], T, K, K}};
        ex_print(r, "wy", 4, m);
        double *in[] = {x->q, x->k, x->v, x->a, x->b, x->Gi, x->Ge, x->Aak, x->Tab};
        const int gi[] = {G_QW, G_KW, G_VW, G_AW, G_BW, G_GIW, G_GEW, G_AAK, G_TAB};
        const int64_t n[] = {nk, nk, nv, nk, nk, nk, nk, na, na};
        const char *nm[] = {"dq", "dk", "dv", "da", "db", "dGi", "dGe", "dAak", "dTab"};
        char t1[64];
        for (int i = 0; i < 9; i++) {
            snprintf(t1, sizeof t1, "%s vs finite differences", nm[i]);
            ex_check(r, "wy", t1, pfd(&b, P_WY, in[i], n[i], g[gi[i]]));
        }
    }

    ex_heading(r, "intra", "backward (dg__dplr_intra_bwd_f64)");
    if (dg__dplr_intra_bwd_f64(d, x->scale, x->q, x->k, x->a, x->b, x->Gi, x->Ge, x->Tab, g[G_AQK],
                               g[G_AQB], g[G_AAK], g[G_TAB], g[G_QI], g[G_KI], g[G_AI], g[G_BI],
                               g[G_GII], g[G_GEI])) {
        rc = 2;
        goto fail;
    }
    {
        double *in[] = {x->q, x->k, x->a, x->b, x->Gi, x->Ge};
        const int gi[] = {G_QI, G_KI, G_AI, G_BI, G_GII, G_GEI};
        const char *nm[] = {"dq", "dk", "da", "db", "dGi", "dGe"};
        char t1[64];
        for (int i = 0; i < 6; i++) {
            snprintf(t1, sizeof t1, "%s vs finite differences", nm[i]);
            ex_check(r, "intra", t1, pfd(&b, P_INTRA, in[i], nk, g[gi[i]]));
        }
    }
    for (int64_t i = 0; i < nk; i++) {
        g[G_GI][i] = g[G_GIS][i] + g[G_GIW][i] + g[G_GII][i];
        g[G_GE][i] = g[G_GEW][i] + g[G_GEI][i];
        g[G_Q][i] = g[G_QW][i] + g[G_QI][i];
        g[G_K][i] = g[G_KW][i] + g[G_KI][i];
        g[G_A][i] = g[G_AW][i] + g[G_AI][i];
        g[G_B][i] = g[G_BW][i] + g[G_BI][i];
    }
    for (int64_t i = 0; i < nv; i++)
        g[G_V][i] = g[G_VO][i] + g[G_VS][i] + g[G_VW][i];

    ex_heading(r, "cumsum", "backward: reverse cumsums (dg__dplr_cumsum_bwd_f64)");
    dg__dplr_cumsum_bwd_f64(d, x->gk, g[G_GI], g[G_GE], g[G_GK]);
    ex_check(r, "cumsum", "dgk vs finite differences", pfd(&b, P_CUMSUM, x->gk, nk, g[G_GK]));

    ex_heading(r, "composite",
               "the chained gradients vs the recurrence's backward and vs "
               "differences of the whole chunked forward");
    {
        double *rg[7];
        const int64_t rn[7] = {nk, nk, nv, nk, nk, nk, kv};
        for (int i = 0; i < 7; i++)
            rg[i] = ex_zeros(rn[i]);
        if (dg__dplr_recurrent_bwd_f64(d, x->scale, x->q, x->k, x->v, x->a, x->b, x->gk, x->h0,
                                       x->dO, x->dht, rg[0], rg[1], rg[2], rg[3], rg[4], rg[5],
                                       rg[6])) {
            rc = 2;
        } else {
            const int gi[7] = {G_Q, G_K, G_V, G_A, G_B, G_GK, G_H0};
            const char *nm[7] = {"dq", "dk", "dv", "da", "db", "dgk", "dh0"};
            double *in[7] = {x->q, x->k, x->v, x->a, x->b, x->gk, NULL};
            char t1[80];
            for (int i = 0; i < 7; i++) {
                snprintf(t1, sizeof t1, "%s: chunked = recurrent", nm[i]);
                ex_check(r, "composite", t1, ex_relres(g[gi[i]], rg[i], rn[i]));
            }
            for (int i = 0; i < 6; i++) {
                snprintf(t1, sizeof t1, "%s vs differences of the whole forward", nm[i]);
                ex_check(r, "composite", t1, pfd(&b, P_FULL, in[i], rn[i], g[gi[i]]));
            }
        }
        for (int i = 0; i < 7; i++)
            free(rg[i]);
    }
fail:
    if (rc)
        fprintf(stderr, "deltagrad explain: dplr backward: %s\n", dg_last_error());
    for (int i = 0; i < G_N; i++)
        free(b.g[i]);
    for (int i = 0; i < 15; i++)
        free(b.s[i]);
    return rc;
}

/* ---- context parallelism on simulated ranks ------------------------------------------------ */

/* The arrays of one rank's slice [s0, s1) (an ex_slice): its local stages, state pass and
 * backward through the library's raw functions over Tr = s1 - s0 tokens (its chunks restart at
 * s0). The one-rank pass is [0, T). The walks themselves are tools/explain_kcp.c's. */
enum {
    PL_GI,
    PL_GE,
    PL_AQK,
    PL_AQB,
    PL_AAK,
    PL_TAB,
    PL_W,
    PL_U,
    PL_QG,
    PL_KG,
    PL_BG, /* local */
    PL_H,
    PL_V2,
    PL_HT,
    PL_O, /* state, o */
    PL_DQG,
    PL_DH,
    PL_DAQK,
    PL_DAQB,
    PL_DVO,
    PL_DV2, /* output backward */
    PL_DW,
    PL_DU,
    PL_DKG,
    PL_DBG,
    PL_DVS,
    PL_DGIS,
    PL_DH0, /* state backward */
    PL_DQW,
    PL_DKW,
    PL_DVW,
    PL_DAW,
    PL_DBW,
    PL_DGIW,
    PL_DGEW,
    PL_DAAK,
    PL_DTAB, /* wy */
    PL_DQI,
    PL_DKI,
    PL_DAI,
    PL_DBI,
    PL_DGII,
    PL_DGEI, /* intra backward */
    PL_DQ,
    PL_DK,
    PL_DV,
    PL_DA,
    PL_DB,
    PL_DGI,
    PL_DGE,
    PL_DGK, /* sums, dgk */
    PL_N
};

static void ploc_sizes(const void *p, const ex_slice *l, int64_t *sz) {
    const px *x = (const px *)p;
    const int64_t T = l->Tr, nk = T * x->K, nv = T * x->V, kv = (int64_t)x->K * x->V;
    const int64_t na = T * x->BT, nh = l->tab[3] * kv;
    for (int i = 0; i < PL_N; i++) {
        int64_t n = nk;
        if (i == PL_AQK || i == PL_AQB || i == PL_AAK || i == PL_TAB || i == PL_DAQK ||
            i == PL_DAQB || i == PL_DAAK || i == PL_DTAB)
            n = na;
        else if (i == PL_U || i == PL_V2 || i == PL_O || i == PL_DVO || i == PL_DV2 || i == PL_DU ||
                 i == PL_DVS || i == PL_DVW || i == PL_DV)
            n = nv;
        else if (i == PL_H || i == PL_DH)
            n = nh;
        else if (i == PL_HT || i == PL_DH0)
            n = kv;
        sz[i] = n;
    }
}

/* The slice's inputs. */
#define PL_IN(x, l)                                                                                \
    const double *q = (x)->q + (int64_t)(l)->s0 * (x)->K, *k = (x)->k + (int64_t)(l)->s0 * (x)->K, \
                 *a_ = (x)->a + (int64_t)(l)->s0 * (x)->K,                                         \
                 *b_ = (x)->b + (int64_t)(l)->s0 * (x)->K, *v = (x)->v + (int64_t)(l)->s0 * (x)->V

/* cumsum, intra, wy on the slice (no communication). */
static int ploc_stages(const void *p, ex_slice *l) {
    const px *x = (const px *)p;
    double **g = l->a;
    PL_IN(x, l);
    dg__dplr_cumsum_fwd_f64(&l->d, x->gk + (int64_t)l->s0 * x->K, g[PL_GI], g[PL_GE]);
    if (dg__dplr_intra_fwd_f64(&l->d, x->scale, q, k, a_, b_, g[PL_GI], g[PL_GE], g[PL_AQK],
                               g[PL_AQB], g[PL_AAK], g[PL_TAB]) ||
        dg__dplr_wy_fwd_f64(&l->d, x->scale, q, k, v, a_, b_, g[PL_GI], g[PL_GE], g[PL_AAK],
                            g[PL_TAB], g[PL_W], g[PL_U], g[PL_QG], g[PL_KG], g[PL_BG])) {
        fprintf(stderr, "deltagrad explain: dplr kcp: %s\n", dg_last_error());
        return 2;
    }
    return 0;
}

/* The state pass from hin and the output, then the output's backward from dO (its rows). */
static int ploc_state_out(const void *p, ex_slice *l, const double *hin) {
    const px *x = (const px *)p;
    double **g = l->a;
    const double *v = x->v + (int64_t)l->s0 * x->V;
    if (dg__dplr_state_fwd_f64(&l->d, g[PL_W], g[PL_U], g[PL_KG], g[PL_BG], v, g[PL_GI], hin,
                               g[PL_H], g[PL_V2], g[PL_HT])) {
        fprintf(stderr, "deltagrad explain: dplr kcp: %s\n", dg_last_error());
        return 2;
    }
    dg__dplr_output_fwd_f64(&l->d, g[PL_QG], g[PL_H], g[PL_AQK], g[PL_AQB], v, g[PL_V2], g[PL_O]);
    dg__dplr_output_bwd_f64(&l->d, g[PL_QG], g[PL_H], g[PL_AQK], g[PL_AQB], v, g[PL_V2],
                            x->dO + (int64_t)l->s0 * x->V, g[PL_DQG], g[PL_DH], g[PL_DAQK],
                            g[PL_DAQB], g[PL_DVO], g[PL_DV2]);
    return 0;
}

/* The state, wy, intra backward with dht the gradient of the state leaving the slice, the sums
 * and the reverse cumsums (dgk). */
static int ploc_backward(const void *p, ex_slice *l, const double *dht) {
    const px *x = (const px *)p;
    double **g = l->a;
    PL_IN(x, l);
    if (dg__dplr_state_bwd_f64(&l->d, g[PL_W], g[PL_KG], g[PL_BG], v, g[PL_GI], g[PL_H], g[PL_V2],
                               g[PL_DH], g[PL_DV2], dht, g[PL_DW], g[PL_DU], g[PL_DKG], g[PL_DBG],
                               g[PL_DVS], g[PL_DGIS], g[PL_DH0]) ||
        dg__dplr_wy_bwd_f64(&l->d, x->scale, q, k, v, a_, b_, g[PL_GI], g[PL_GE], g[PL_AAK],
                            g[PL_TAB], g[PL_DW], g[PL_DU], g[PL_DQG], g[PL_DKG], g[PL_DBG],
                            g[PL_DQW], g[PL_DKW], g[PL_DVW], g[PL_DAW], g[PL_DBW], g[PL_DGIW],
                            g[PL_DGEW], g[PL_DAAK], g[PL_DTAB]) ||
        dg__dplr_intra_bwd_f64(&l->d, x->scale, q, k, a_, b_, g[PL_GI], g[PL_GE], g[PL_TAB],
                               g[PL_DAQK], g[PL_DAQB], g[PL_DAAK], g[PL_DTAB], g[PL_DQI], g[PL_DKI],
                               g[PL_DAI], g[PL_DBI], g[PL_DGII], g[PL_DGEI])) {
        fprintf(stderr, "deltagrad explain: dplr kcp backward: %s\n", dg_last_error());
        return 2;
    }
    const int64_t nk = (int64_t)l->Tr * x->K, nv = (int64_t)l->Tr * x->V;
    for (int64_t i = 0; i < nk; i++) {
        g[PL_DGI][i] = g[PL_DGIS][i] + g[PL_DGIW][i] + g[PL_DGII][i];
        g[PL_DGE][i] = g[PL_DGEW][i] + g[PL_DGEI][i];
        g[PL_DQ][i] = g[PL_DQW][i] + g[PL_DQI][i];
        g[PL_DK][i] = g[PL_DKW][i] + g[PL_DKI][i];
        g[PL_DA][i] = g[PL_DAW][i] + g[PL_DAI][i];
        g[PL_DB][i] = g[PL_DBW][i] + g[PL_DBI][i];
    }
    for (int64_t i = 0; i < nv; i++)
        g[PL_DV][i] = g[PL_DVO][i] + g[PL_DVS][i] + g[PL_DVW][i];
    dg__dplr_cumsum_bwd_f64(&l->d, x->gk + (int64_t)l->s0 * x->K, g[PL_DGI], g[PL_DGE], g[PL_DGK]);
    return 0;
}

static dg_status rec_bwd(const void *p, const kda_dims *d, int t, const double *S, double *const *g,
                         double *dS) {
    const px *x = (const px *)p;
    const int64_t ok = (int64_t)t * x->K, ov = (int64_t)t * x->V;
    return dg__dplr_recurrent_bwd_f64(d, x->scale, x->q + ok, x->k + ok, x->v + ov, x->a + ok,
                                      x->b + ok, x->gk + ok, S, x->dO + ov, x->dht, g[0], g[1],
                                      g[2], g[3], g[4], g[5], dS);
}

/* The recurrence's gradient of the state after token t (t < T). */
static int rec_suffix_dh(const void *p, int t, double *dS) {
    const px *x = (const px *)p;
    return ex_rec_suffix_dh(x, t, x->T, x->BT, x->K, x->V, rec_prefix, rec_bwd, dS);
}

/* The slice's summary: forward M_c = Diag(exp lam_c) + bg_c^T w_c, h_ext fed by kg^T v + bg^T u;
 * reverse M_c^T = Diag(exp lam_c) + w_c^T bg_c, dh_ext fed by w^T dv2 and the output's dh. */
static void ploc_summary(const void *p, const ex_slice *l, int reverse, kcp_summary_io *io) {
    const px *x = (const px *)p;
    double *const *g = l->a;
    io->reverse = reverse;
    io->X = reverse ? g[PL_W] : g[PL_BG];
    io->Y = reverse ? g[PL_BG] : g[PL_W];
    io->G = g[PL_GI];
    if (reverse) {
        io->nterm = 1;
        io->term[0].A = g[PL_W];
        io->term[0].B = g[PL_DV2];
        io->dh = g[PL_DH];
    } else {
        io->nterm = 2;
        io->term[0].A = g[PL_KG];
        io->term[0].B = x->v + (int64_t)l->s0 * x->V;
        io->term[1].A = g[PL_BG];
        io->term[1].B = g[PL_U];
    }
}

static void ploc_print(const ex_run *r, const void *p, const ex_slice *l) {
    const px *x = (const px *)p;
    const int K = x->K, V = x->V;
    ex_mat m[] = {{"dq", l->a[PL_DQ], l->Tr, K, K},
                  {"dk", l->a[PL_DK], l->Tr, K, K},
                  {"dv", l->a[PL_DV], l->Tr, V, V}};
    ex_print(r, "kcp", 3, m);
    ex_mat m2[] = {{"da", l->a[PL_DA], l->Tr, K, K},
                   {"db", l->a[PL_DB], l->Tr, K, K},
                   {"dgk", l->a[PL_DGK], l->Tr, K, K}};
    ex_print(r, "kcp", 3, m2);
}

/* The example's side of the simulated ranks (tools/explain_kcp.h). */
static const ex_kcp_op dplr_op = {
    .n = PL_N,
    .i_o = PL_O,
    .i_ht = PL_HT,
    .i_dh0 = PL_DH0,
    .sizes = ploc_sizes,
    .stages = ploc_stages,
    .state_out = ploc_state_out,
    .backward = ploc_backward,
    .summary = ploc_summary,
    .rec_prefix = rec_prefix,
    .rec_suffix_dh = rec_suffix_dh,
    .print_grads = ploc_print,
    .ng = 6,
    .gname = {"dq", "dk", "dv", "da", "db", "dgk"},
    .gi = {PL_DQ, PL_DK, PL_DV, PL_DA, PL_DB, PL_DGK},
    .gper = {EX_PER_K, EX_PER_K, EX_PER_V, EX_PER_K, EX_PER_K, EX_PER_K},
    .fwd_intro =
        "  As for KDA, with M_c = Diag(exp lam_c) + bg_c^T w_c and h_ext fed by\n"
        "  kg^T v + bg^T u: each rank's summary [h_ext | M] (dg__kcp_summary_f64), rank r's\n"
        "  initial state the chain of ranks 0..r-1 (dg__kcp_merge_f64).\n",
    .bwd_title = "backward over the simulated ranks (ops/kcp/kcp_nodes.c, ops/dplr/kcp.c)",
    .bwd_intro =
        "  As for KDA: each rank runs the output's backward on its slice (dh per chunk\n"
        "  start, dv2); dh_in = M^T dh_out + dh_ext with M_c^T = Diag(exp lam_c) + w_c^T bg_c\n"
        "  and dh_ext fed by w^T dv2 and the output's dh (dg__kcp_summary_f64, reverse; the\n"
        "  last rank starts from dht, rank 0 sends zeros). Rank r chains ranks N-1 down to\n"
        "  r+1 (dg__kcp_merge_f64) into the dh entering its slice, then runs the state, wy,\n"
        "  intra and cumsum backward locally; a rank > 0 drops its dh0.\n",
};

static ex_kcp dplr_kcp(const px *x, int N) {
    return (ex_kcp){&dplr_op, x, N, x->T, x->BT, x->K, x->V, x->h0, x->dht, x->o, x->ht};
}

static int walk_kcp(ex_run *r, px *x, int N) {
    ex_kcp k = dplr_kcp(x, N);
    return ex_kcp_forward(r, &k);
}

static int walk_kcp_backward(ex_run *r, px *x, int N) {
    ex_kcp k = dplr_kcp(x, N);
    return ex_kcp_backward(r, &k);
}

int ex_dplr(const ex_opts *o) {
    px x;
    ex_run r = {o, 0, 0, 0};
    px_init(&x, o);
    ex_banner(o, " --dplr", "DPLR");
    int rc = px_forward(&x);
    if (!rc && dg__dplr_recurrent_fwd_f64(&x.d, x.scale, x.q, x.k, x.v, x.a, x.b, x.gk, x.h0,
                                          x.orec, x.htrec)) {
        fprintf(stderr, "deltagrad explain: dplr recurrence: %s\n", dg_last_error());
        rc = 2;
    }
    if (!rc && !o->backward)
        rc = walk_forward(&r, &x);
    if (!rc && o->cp)
        rc = walk_kcp(&r, &x, o->cp);
    if (!rc && o->backward)
        rc = walk_backward(&r, &x);
    if (!rc && o->backward && o->cp)
        rc = walk_kcp_backward(&r, &x, o->cp);
    px_free(&x);
    if (rc)
        return rc;
    return ex_summary(&r);
}

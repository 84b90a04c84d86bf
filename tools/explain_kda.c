/*
 * tools/explain_kda.c -- `deltagrad explain` for KDA: one sequence, one head, every stage run by
 * the library's raw f64 functions (ops/kda/kda.h), the KCP summaries and merge by ops/kcp/kcp.h.
 * What the tool computes itself are the checks: Lkk from its definition, the triangular identity,
 * dLkk from Tm and dTm (the formula inside the intra backward), prefix runs of the recurrence,
 * the finite differences. With --cp N the ranks are simulated one after another in this process,
 * forward (summaries, merge) and, with --backward, backward (reverse summaries, reverse merge,
 * each rank's local backward) as ops/kcp/kcp_nodes.c runs them.
 */
#include "ops/kcp/kcp.h"
#include "ops/kda/kda.h"
#include "tools/explain.h"
#include "tools/explain_kda.h"
#include "tools/explain_kcp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TRY(call)                                                                                  \
    do {                                                                                           \
        dg_status st_ = (call);                                                                    \
        if (st_ != DG_OK) {                                                                        \
            fprintf(stderr, "deltagrad explain: %s failed: %s\n", #call, dg_last_error());         \
            return 2;                                                                              \
        }                                                                                          \
    } while (0)

void kx_dims(kda_dims *d, int64_t *tab, int T, int BT, int K, int V) {
    memset(d, 0, sizeof *d);
    d->B = 1;
    d->T = T;
    d->H = d->HV = 1;
    d->K = K;
    d->V = V;
    d->BT = BT;
    d->N = 1;
    tab[0] = 0;
    tab[1] = T;
    tab[2] = 0;
    tab[3] = (T + BT - 1) / BT;
    d->cu = tab;
    d->chunk_off = tab + 2;
}

int kx_init(kx *x, const ex_opts *o, int T, int BT, int K, int V) {
    memset(x, 0, sizeof *x);
    x->o = o;
    x->T = T;
    x->BT = BT;
    x->K = K;
    x->V = V;
    x->NC = (T + BT - 1) / BT;
    kx_dims(&x->d, x->tab, T, BT, K, V);
    x->scale = 1.0 / sqrt((double)K);
    x->gate = o->gate;
    x->lb = o->gate == DG_GATE_LOWERBOUND ? -o->strength : 0;
    x->A_log[0] = log(o->strength);
    const int64_t nk = (int64_t)T * K, nv = (int64_t)T * V, kv = (int64_t)K * V;
    const uint64_t s = o->seed * 1000;
    x->qr = ex_randn(nk, s + 1, 1.0);
    x->kr = ex_randn(nk, s + 2, 1.0);
    x->v = ex_randn(nv, s + 3, 1.0);
    x->braw = ex_randn(T, s + 4, 1.0);
    x->x = ex_randn(nk, s + 5, 1.0);
    x->dt_bias = ex_randn(K, s + 6, 0.3);
    x->h0 = ex_zeros(kv);
    x->dO = ex_randn(nv, s + 7, 1.0);
    x->dht = ex_randn(kv, s + 8, 1.0);
    double **f[] = {&x->q,  &x->k, &x->rq, &x->rk, &x->beta, &x->g, &x->G, &x->Aqk,
                    &x->Tm, &x->W, &x->U,  &x->KG, &x->QG,   &x->E, &x->O, &x->orec};
    const int64_t n[] = {nk, nk, T,  T,  T,  nk, nk, (int64_t)T * BT, (int64_t)T * BT,
                         nk, nv, nk, nk, nv, nv, nv};
    for (size_t i = 0; i < sizeof n / sizeof *n; i++)
        *f[i] = ex_zeros(n[i]);
    x->h = ex_zeros(x->NC * kv);
    x->ht = ex_zeros(kv);
    x->htrec = ex_zeros(kv);
    return 0;
}

void kx_free(kx *x) {
    double *p[] = {x->qr, x->kr, x->v,  x->braw, x->x,    x->dt_bias, x->h0,  x->dO,   x->dht, x->q,
                   x->k,  x->rq, x->rk, x->beta, x->g,    x->G,       x->Aqk, x->Tm,   x->W,   x->U,
                   x->KG, x->QG, x->E,  x->O,    x->orec, x->h,       x->ht,  x->htrec};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++)
        free(p[i]);
}

/* The chunked forward from the raw inputs, every stage through the library. */
int kx_forward(kx *x) {
    const kda_dims *d = &x->d;
    const double *A_log = x->gate == DG_GATE_KDA ? x->A_log : NULL;
    dg__l2norm_fwd_f64(x->T, x->K, KDA_L2_EPS, x->qr, x->q, x->rq);
    dg__l2norm_fwd_f64(x->T, x->K, KDA_L2_EPS, x->kr, x->k, x->rk);
    dg__kda_beta_fwd_f64(x->T, 1.0, x->braw, x->beta);
    dg__kda_gate_fwd_f64(d, x->gate, x->lb, 0, x->x, A_log, x->dt_bias, x->g);
    dg__kda_gate_fwd_f64(d, x->gate, x->lb, 1, x->x, A_log, x->dt_bias, x->G);
    TRY(dg__kda_intra_fwd_f64(d, x->scale, x->q, x->k, x->beta, x->G, x->Aqk, x->Tm));
    TRY(dg__kda_wy_fwd_f64(d, x->q, x->k, x->v, x->beta, x->G, x->Tm, x->W, x->U, x->KG, x->QG));
    TRY(dg__kda_state_fwd_f64(d, x->W, x->U, x->KG, x->G, x->h0, x->h, x->E, x->ht));
    dg__kda_output_fwd_f64(d, x->scale, x->QG, x->h, x->Aqk, x->E, x->O);
    return 0;
}

int kx_recurrent(kx *x) {
    TRY(dg__kda_recurrent_fwd_f64(&x->d, x->scale, x->q, x->k, x->v, x->g, x->beta, x->h0, x->orec,
                                  x->htrec));
    return 0;
}

static dg_status rec_run(const void *p, const kda_dims *d, double *o, double *S) {
    const kx *x = (const kx *)p;
    return dg__kda_recurrent_fwd_f64(d, x->scale, x->q, x->k, x->v, x->g, x->beta, x->h0, o, S);
}

/* The recurrence's state after the first t tokens (h0 for t = 0), into S [K,V]. */
static int rec_prefix(const void *p, int t, double *S) {
    const kx *x = (const kx *)p;
    return ex_rec_prefix(x, t, x->BT, x->K, x->V, x->h0, rec_run, S);
}

void kx_lkk(const kx *x, int c, double *A) {
    const int t0 = c * x->BT, K = x->K;
    const int L = x->T - t0 < x->BT ? x->T - t0 : x->BT;
    memset(A, 0, sizeof(double) * (size_t)x->BT * x->BT);
    for (int i = 0; i < L; i++)
        for (int j = 0; j < i; j++) {
            double s = 0;
            for (int e = 0; e < K; e++) {
                const int64_t ti = (int64_t)(t0 + i) * K + e, tj = (int64_t)(t0 + j) * K + e;
                s += x->k[ti] * x->k[tj] * exp(x->G[ti] - x->G[tj]);
            }
            A[i * x->BT + j] = x->beta[t0 + i] * s;
        }
}

static int chunk_len(const kx *x, int c) {
    const int t0 = c * x->BT;
    return x->T - t0 < x->BT ? x->T - t0 : x->BT;
}

/* v_new at token t, column e, from the recurrence's state S before it: v_new_t = beta_t (v_t -
 * S'^T k_t), S' = Diag(exp g_t) S_{t-1} (the recurrence's delta). */
static double v_new_want(const void *p, int t, int e, const double *S) {
    const kx *x = (const kx *)p;
    const int K = x->K, V = x->V;
    double s = 0;
    for (int a = 0; a < K; a++)
        s += exp(x->g[(int64_t)t * K + a]) * S[a * V + e] * x->k[(int64_t)t * K + a];
    return x->beta[t] * (x->v[(int64_t)t * V + e] - s);
}

/* ---- the forward walk ---------------------------------------------------------------------- */

static int walk_forward(ex_run *r, kx *x) {
    const int T = x->T, BT = x->BT, K = x->K, V = x->V, NC = x->NC;
    const int64_t kv = (int64_t)K * V;
    char t1[64], t2[64], t3[64], t4[64];

    ex_heading(r, "recurrence", "the ground truth, token by token (dg__kda_recurrent_fwd_f64)");
    if (ex_shown(r, "recurrence"))
        printf("%s", ex_card_text("recurrence"));
    {
        ex_mat m[] = {{"o (recurrent)", x->orec, T, V, V}};
        ex_print(r, "recurrence", 1, m);
        ex_mat m2[] = {{"final state S_T", x->htrec, K, V, V}};
        ex_print(r, "recurrence", 1, m2);
    }

    ex_heading(r, "l2norm", "unit rows of q and k (dg__l2norm_fwd_f64)");
    {
        ex_mat m[] = {{"q", x->q, T, K, K}, {"k", x->k, T, K, K}};
        ex_print(r, "l2norm", 2, m);
        double res = 0;
        for (int t = 0; t < T; t++) {
            double a = 0, s = 0;
            for (int e = 0; e < K; e++) {
                a += x->qr[t * K + e] * x->qr[t * K + e];
                s += x->q[t * K + e] * x->q[t * K + e];
            }
            res = fmax(res, fabs(s - a / (a + KDA_L2_EPS)));
        }
        ex_check(r, "l2norm", "|q_t|^2 = s/(s + 1e-6), s = |q_raw_t|^2", res);
    }

    ex_heading(r, "beta", "beta = sigmoid(b) (dg__kda_beta_fwd_f64)");
    {
        ex_mat m[] = {{"b", x->braw, T, 1, 1}, {"beta", x->beta, T, 1, 1}};
        ex_print(r, "beta", 2, m);
        double res = 0;
        for (int t = 0; t < T; t++)
            res = fmax(res, fabs(x->beta[t] - 1.0 / (1.0 + exp(-x->braw[t]))));
        ex_check(r, "beta", "beta = 1/(1 + exp(-b))", res);
    }

    ex_heading(r, "gate_cumsum", "log decay g and its chunk-local cumsum G (dg__kda_gate_fwd_f64)");
    if (ex_shown(r, "gate_cumsum")) {
        printf("%s", ex_card_text("gate_cumsum"));
        if (x->gate == DG_GATE_KDA)
            printf("  here: gate kda, A_log = log %g, dt_bias random\n", x->o->strength);
        else
            printf("  here: gate lowerbound, lb = %g, no A_log, dt_bias random\n", x->lb);
    }
    {
        double res = ex_chunk_cumsums(r, "gate_cumsum", x->T, BT, K, "g", x->g, "G (cumsum)", x->G,
                                      x->g, x->G, NULL);
        ex_check(r, "gate_cumsum", "G = chunk-local cumsum of g", res);
    }

    ex_heading(r, "intra", "Aqk, Lkk and Tm = (I + Lkk)^-1 per chunk (dg__kda_intra_fwd_f64)");
    if (ex_shown(r, "intra"))
        printf("%s  Lkk is computed here from its definition, to check Tm.\n",
               ex_card_text("intra"));
    double *A = ex_zeros((int64_t)NC * BT * BT);
    {
        double rinv = 0, rqk = 0;
        for (int c = 0; c < NC; c++) {
            const int t0 = c * BT, L = chunk_len(x, c);
            double *Ac = A + (int64_t)c * BT * BT;
            kx_lkk(x, c, Ac);
            const double *Tc = x->Tm + (int64_t)t0 * BT, *Qc = x->Aqk + (int64_t)t0 * BT;
            snprintf(t1, sizeof t1, "chunk %d: Aqk", c);
            ex_mat m[] = {
                {t1, Qc, L, L, BT}, {"Lkk", Ac, L, L, BT}, {"Tm = (I+Lkk)^-1", Tc, L, L, BT}};
            ex_print(r, "intra", 3, m);
            for (int i = 0; i < L; i++)
                for (int j = 0; j <= i; j++) {
                    double s = Tc[i * BT + j]; /* (I + A) Tm, read triangles only */
                    for (int m2 = j; m2 < i; m2++)
                        s += Ac[i * BT + m2] * Tc[m2 * BT + j];
                    rinv = fmax(rinv, fabs(s - (i == j)));
                    double a = 0;
                    for (int e = 0; e < K; e++) {
                        const int64_t ti = (int64_t)(t0 + i) * K + e,
                                      tj = (int64_t)(t0 + j) * K + e;
                        a += x->q[ti] * x->k[tj] * exp(x->G[ti] - x->G[tj]);
                    }
                    rqk = fmax(rqk, fabs(Qc[i * BT + j] - x->scale * a));
                }
        }
        ex_check(r, "intra", "Aqk[i,j] = s sum_d q_id k_jd exp(G_id - G_jd)", rqk);
        ex_check(r, "intra", "(I + Lkk) Tm = I", rinv);
    }

    ex_heading(r, "wy",
               "the WY form: W = Tm (beta k exp(G)), U = Tm (beta v) (dg__kda_wy_fwd_f64)");
    if (ex_shown(r, "wy"))
        printf("%s", ex_card_text("wy"));
    {
        double rw = 0, ru = 0;
        for (int c = 0; c < NC; c++) {
            const int t0 = c * BT, L = chunk_len(x, c);
            const double *Ac = A + (int64_t)c * BT * BT;
            snprintf(t1, sizeof t1, "chunk %d: W", c);
            ex_mat m[] = {{t1, x->W + (int64_t)t0 * K, L, K, K},
                          {"U", x->U + (int64_t)t0 * V, L, V, V},
                          {"KG", x->KG + (int64_t)t0 * K, L, K, K},
                          {"QG", x->QG + (int64_t)t0 * K, L, K, K}};
            ex_print(r, "wy", 4, m);
            /* (I + Lkk) W = beta k exp(G), (I + Lkk) U = beta v */
            for (int i = 0; i < L; i++) {
                const int ti = t0 + i;
                for (int e = 0; e < K; e++) {
                    double s = x->W[(int64_t)ti * K + e];
                    for (int j = 0; j < i; j++)
                        s += Ac[i * BT + j] * x->W[(int64_t)(t0 + j) * K + e];
                    const int64_t p = (int64_t)ti * K + e;
                    rw = fmax(rw, fabs(s - x->beta[ti] * x->k[p] * exp(x->G[p])));
                }
                for (int e = 0; e < V; e++) {
                    double s = x->U[(int64_t)ti * V + e];
                    for (int j = 0; j < i; j++)
                        s += Ac[i * BT + j] * x->U[(int64_t)(t0 + j) * V + e];
                    ru = fmax(ru, fabs(s - x->beta[ti] * x->v[(int64_t)ti * V + e]));
                }
            }
        }
        ex_check(r, "wy", "(I + Lkk) W = beta k exp(G)", rw);
        ex_check(r, "wy", "(I + Lkk) U = beta v", ru);
    }
    free(A);

    ex_heading(r, "state", "states at chunk starts and v_new = U - W h (dg__kda_state_fwd_f64)");
    if (ex_shown(r, "state"))
        printf("%s", ex_card_text("state"));
    if (ex_walk_states(r, x, rec_prefix, T, BT, K, V, x->h, x->ht, x->htrec, "v_new = E", x->E,
                       v_new_want, "v_new_t = beta_t (v_t - (Diag(exp g_t) S_{t-1})^T k_t)"))
        return 2;

    ex_heading(r, "output", "o = s QG h (inter) + Aqk v_new (intra) (dg__kda_output_fwd_f64)");
    if (ex_shown(r, "output"))
        printf("%s  The two parts are the library's output stage with v_new = 0 and h = 0.\n",
               ex_card_text("output"));
    {
        const int64_t nv = (int64_t)T * V;
        double *zE = ex_zeros(nv), *zh = ex_zeros(NC * kv), *oi = ex_zeros(nv), *oa = ex_zeros(nv),
               *sum = ex_zeros(nv);
        dg__kda_output_fwd_f64(&x->d, x->scale, x->QG, x->h, x->Aqk, zE, oi);
        dg__kda_output_fwd_f64(&x->d, x->scale, x->QG, zh, x->Aqk, x->E, oa);
        for (int64_t i = 0; i < nv; i++)
            sum[i] = oi[i] + oa[i];
        for (int c = 0; c < NC; c++) {
            const int t0 = c * BT, L = chunk_len(x, c);
            snprintf(t1, sizeof t1, "chunk %d: inter s QG h", c);
            snprintf(t2, sizeof t2, "intra Aqk E");
            snprintf(t3, sizeof t3, "o (chunked)");
            snprintf(t4, sizeof t4, "o (recurrent)");
            const int64_t p = (int64_t)t0 * V;
            ex_mat m[] = {{t1, oi + p, L, V, V},
                          {t2, oa + p, L, V, V},
                          {t3, x->O + p, L, V, V},
                          {t4, x->orec + p, L, V, V}};
            ex_print(r, "output", 4, m);
        }
        ex_check(r, "output", "inter + intra = o", ex_relres(sum, x->O, nv));
        ex_check(r, "output", "chunked o = recurrent o", ex_relres(x->O, x->orec, nv));
        free(zE);
        free(zh);
        free(oi);
        free(oa);
        free(sum);
    }
    return 0;
}

/* ---- the backward walk --------------------------------------------------------------------- */

/* Scratch outputs of the stage forwards run by the finite differences. */
typedef struct kx_bwd {
    kx *x;
    int which;
    /* upstream gradients and the library's backward results */
    double *dQG, *dh, *dAqk, *dE, *dW, *dU, *dKG, *dGs, *dh0, *dqw, *dkw, *dv, *dbw, *dGw, *dTm,
        *dqi, *dki, *dbi, *dGi, *dG, *dq, *dk, *dbeta, *dx, *dAlog, *ddtb, *db, *dqr, *dkr;
    /* scratch */
    double *sO, *sh, *sE, *sht, *sW, *sU, *sKG, *sQG, *sAqk, *sTm, *sG, *sb, *sq;
} kx_bwd;

enum { L_OUTPUT, L_STATE, L_WY, L_INTRA, L_GATE, L_BETA, L_L2Q, L_L2K, L_FULL };

static double kx_loss(void *p) {
    kx_bwd *b = (kx_bwd *)p;
    kx *x = b->x;
    const kda_dims *d = &x->d;
    const int64_t nk = (int64_t)x->T * x->K, nv = (int64_t)x->T * x->V, kv = (int64_t)x->K * x->V;
    const int64_t na = (int64_t)x->T * x->BT, nh = x->NC * kv;
    const double *A_log = x->gate == DG_GATE_KDA ? x->A_log : NULL;
    switch (b->which) {
    case L_OUTPUT:
        dg__kda_output_fwd_f64(d, x->scale, x->QG, x->h, x->Aqk, x->E, b->sO);
        return ex_dot(x->dO, b->sO, nv);
    case L_STATE:
        if (dg__kda_state_fwd_f64(d, x->W, x->U, x->KG, x->G, x->h0, b->sh, b->sE, b->sht))
            return NAN;
        return ex_dot(b->dh, b->sh, nh) + ex_dot(b->dE, b->sE, nv) + ex_dot(x->dht, b->sht, kv);
    case L_WY:
        if (dg__kda_wy_fwd_f64(d, x->q, x->k, x->v, x->beta, x->G, x->Tm, b->sW, b->sU, b->sKG,
                               b->sQG))
            return NAN;
        return ex_dot(b->dW, b->sW, nk) + ex_dot(b->dU, b->sU, nv) + ex_dot(b->dKG, b->sKG, nk) +
               ex_dot(b->dQG, b->sQG, nk);
    case L_INTRA:
        if (dg__kda_intra_fwd_f64(d, x->scale, x->q, x->k, x->beta, x->G, b->sAqk, b->sTm))
            return NAN;
        return ex_dot(b->dAqk, b->sAqk, na) + ex_dot(b->dTm, b->sTm, na);
    case L_GATE:
        dg__kda_gate_fwd_f64(d, x->gate, x->lb, 1, x->x, A_log, x->dt_bias, b->sG);
        return ex_dot(b->dG, b->sG, nk);
    case L_BETA:
        dg__kda_beta_fwd_f64(x->T, 1.0, x->braw, b->sb);
        return ex_dot(b->dbeta, b->sb, x->T);
    case L_L2Q:
        dg__l2norm_fwd_f64(x->T, x->K, KDA_L2_EPS, x->qr, b->sq, NULL);
        return ex_dot(b->dq, b->sq, nk);
    case L_L2K:
        dg__l2norm_fwd_f64(x->T, x->K, KDA_L2_EPS, x->kr, b->sq, NULL);
        return ex_dot(b->dk, b->sq, nk);
    default:
        if (kx_forward(x))
            return NAN;
        return ex_dot(x->dO, x->O, nv) + ex_dot(x->dht, x->ht, kv);
    }
}

static double fd(kx_bwd *b, int which, double *in, int64_t n, const double *g) {
    b->which = which;
    double res = ex_fdcheck(kx_loss, b, in, n, g, NULL);
    if (which == L_FULL && kx_forward(b->x)) /* back to the unperturbed intermediates */
        return NAN;
    return res;
}

static void print_rows(const ex_run *r, const char *stage, int n, const char *const *names,
                       const double *const *a, const int *cols, int T) {
    ex_mat m[6];
    for (int i = 0; i < n; i++)
        m[i] = (ex_mat){names[i], a[i], T, cols[i], cols[i]};
    ex_print(r, stage, n, m);
}

/* The derivative of the inverse in the intra backward: L = sum_c <dTm_c, (I + Lkk_c)^-1>, the
 * inverse by forward substitution (the tool's own, to check the formula the card states). */
typedef struct kx_inv {
    const kx *x;
    double *Lk;        /* [NC, BT, BT] */
    const double *dTm; /* [T, BT]: chunk c at row c BT */
    double *Ts;        /* scratch [BT, BT] */
} kx_inv;

static double inv_loss(void *p) {
    kx_inv *v = (kx_inv *)p;
    const int BT = v->x->BT;
    double s = 0;
    for (int c = 0; c < v->x->NC; c++) {
        const int L = chunk_len(v->x, c);
        const double *A = v->Lk + (int64_t)c * BT * BT, *D = v->dTm + (int64_t)c * BT * BT;
        for (int i = 0; i < L; i++)
            for (int j = 0; j <= i; j++) {
                double t = i == j;
                for (int m = j; m < i; m++)
                    t -= A[i * BT + m] * v->Ts[m * BT + j];
                v->Ts[i * BT + j] = t;
                s += D[i * BT + j] * t;
            }
    }
    return s;
}

/* dLkk = -stril(Tm^T dTm Tm^T) per chunk into dL [NC, BT, BT], printed, and checked against
 * finite differences of inv_loss. */
static void walk_dlkk(ex_run *r, const kx *x, const double *dTm) {
    const int BT = x->BT, NC = x->NC;
    const int64_t n = (int64_t)NC * BT * BT;
    double *Lk = ex_zeros(n), *dL = ex_zeros(n), *Ts = ex_zeros((int64_t)BT * BT);
    unsigned char *skip = (unsigned char *)calloc((size_t)n, 1);
    char t1[64];
    if (!skip) {
        fprintf(stderr, "deltagrad explain: out of host memory\n");
        exit(2);
    }
    for (int c = 0; c < NC; c++) {
        const int L = chunk_len(x, c);
        const int64_t o = (int64_t)c * BT * BT;
        const double *Tc = x->Tm + o, *Dc = dTm + o;
        kx_lkk(x, c, Lk + o);
        for (int i = 0; i < BT; i++)
            for (int j = 0; j < BT; j++) {
                skip[o + i * BT + j] = !(i < L && j < i);
                if (skip[o + i * BT + j])
                    continue;
                double s = 0; /* (Tm^T dTm Tm^T)[i,j] = sum_{a,b} Tm[a,i] dTm[a,b] Tm[j,b] */
                for (int a = i; a < L; a++)
                    for (int b = 0; b <= j; b++)
                        s += Tc[a * BT + i] * Dc[a * BT + b] * Tc[j * BT + b];
                dL[o + i * BT + j] = -s;
            }
        snprintf(t1, sizeof t1, "chunk %d: dLkk", c);
        ex_mat m[] = {{t1, dL + o, L, L, BT}};
        ex_print(r, "intra", 1, m);
    }
    kx_inv v = {x, Lk, dTm, Ts};
    ex_check(r, "intra", "dLkk = -stril(Tm^T dTm Tm^T) vs differences of (I + Lkk)^-1",
             ex_fdcheck(inv_loss, &v, Lk, n, dL, skip));
    free(Lk);
    free(dL);
    free(Ts);
    free(skip);
}

static int walk_backward(ex_run *r, kx *x) {
    const int T = x->T, BT = x->BT, K = x->K, V = x->V, NC = x->NC;
    const int64_t nk = (int64_t)T * K, nv = (int64_t)T * V, kv = (int64_t)K * V;
    const int64_t na = (int64_t)T * BT, nh = NC * kv;
    const kda_dims *d = &x->d;
    const double *A_log = x->gate == DG_GATE_KDA ? x->A_log : NULL;
    kx_bwd b;
    memset(&b, 0, sizeof b);
    b.x = x;
    double **f[] = {&b.dQG, &b.dh,   &b.dAqk, &b.dE,  &b.dW,    &b.dU,  &b.dKG,   &b.dGs,  &b.dh0,
                    &b.dqw, &b.dkw,  &b.dv,   &b.dbw, &b.dGw,   &b.dTm, &b.dqi,   &b.dki,  &b.dbi,
                    &b.dGi, &b.dG,   &b.dq,   &b.dk,  &b.dbeta, &b.dx,  &b.dAlog, &b.ddtb, &b.db,
                    &b.dqr, &b.dkr,  &b.sO,   &b.sh,  &b.sE,    &b.sht, &b.sW,    &b.sU,   &b.sKG,
                    &b.sQG, &b.sAqk, &b.sTm,  &b.sG,  &b.sb,    &b.sq};
    const int64_t n[] = {nk, nh, na, nv, nk, nv, nk, nk, kv, nk, nk, nv, T, nk,
                         na, nk, nk, T,  nk, nk, nk, nk, T,  nk, 1,  K,  T, nk,
                         nk, nv, nh, nv, kv, nk, nv, nk, nk, na, na, nk, T, nk};
    for (size_t i = 0; i < sizeof n / sizeof *n; i++)
        *f[i] = ex_zeros(n[i]);
    int rc = 0;
    char t1[64];

    ex_heading(r, "output", "backward: dQG, dh, dAqk, dE from dO (dg__kda_output_bwd_f64)");
    if (ex_shown(r, "output"))
        printf(
            "  The loss is L = <dO, o> + <dht, ht> with random dO, dht. Each stage's gradient\n"
            "  is checked against central differences of that stage alone, L_stage = <upstream,\n"
            "  its outputs>; their sum over stages is the chain rule.\n");
    dg__kda_output_bwd_f64(d, x->scale, x->QG, x->h, x->Aqk, x->E, x->dO, b.dQG, b.dh, b.dAqk,
                           b.dE);
    {
        const char *nm[] = {"dO", "dQG", "dE"};
        const double *a[] = {x->dO, b.dQG, b.dE};
        const int cols[] = {V, K, V};
        print_rows(r, "output", 3, nm, a, cols, T);
        ex_print_states(r, "output", "dh", b.dh, NC, K, V);
        ex_check(r, "output", "dQG vs finite differences", fd(&b, L_OUTPUT, x->QG, nk, b.dQG));
        ex_check(r, "output", "dh vs finite differences", fd(&b, L_OUTPUT, x->h, nh, b.dh));
        ex_check(r, "output", "dAqk vs finite differences", fd(&b, L_OUTPUT, x->Aqk, na, b.dAqk));
        ex_check(r, "output", "dE vs finite differences", fd(&b, L_OUTPUT, x->E, nv, b.dE));
    }

    ex_heading(r, "state", "backward: the reverse state pass (dg__kda_state_bwd_f64)");
    if (dg__kda_state_bwd_f64(d, x->W, x->KG, x->G, x->h, x->E, b.dh, b.dE, x->dht, b.dW, b.dU,
                              b.dKG, b.dGs, b.dh0)) {
        fprintf(stderr, "deltagrad explain: state backward: %s\n", dg_last_error());
        rc = 2;
        goto done;
    }
    {
        const char *nm[] = {"dW", "dU", "dKG", "dG (last rows)"};
        const double *a[] = {b.dW, b.dU, b.dKG, b.dGs};
        const int cols[] = {K, V, K, K};
        print_rows(r, "state", 4, nm, a, cols, T);
        ex_check(r, "state", "dW vs finite differences", fd(&b, L_STATE, x->W, nk, b.dW));
        ex_check(r, "state", "dU vs finite differences", fd(&b, L_STATE, x->U, nv, b.dU));
        ex_check(r, "state", "dKG vs finite differences", fd(&b, L_STATE, x->KG, nk, b.dKG));
        ex_check(r, "state", "dG vs finite differences", fd(&b, L_STATE, x->G, nk, b.dGs));
        ex_check(r, "state", "dh0 vs finite differences", fd(&b, L_STATE, x->h0, kv, b.dh0));
    }

    ex_heading(r, "wy", "backward: through W, U, KG, QG (dg__kda_wy_bwd_f64)");
    if (dg__kda_wy_bwd_f64(d, x->q, x->k, x->v, x->beta, x->G, x->Tm, b.dW, b.dU, b.dKG, b.dQG,
                           b.dqw, b.dkw, b.dv, b.dbw, b.dGw, b.dTm)) {
        fprintf(stderr, "deltagrad explain: wy backward: %s\n", dg_last_error());
        rc = 2;
        goto done;
    }
    {
        const char *nm[] = {"dq", "dk", "dv", "dbeta", "dG"};
        const double *a[] = {b.dqw, b.dkw, b.dv, b.dbw, b.dGw};
        const int cols[] = {K, K, V, 1, K};
        print_rows(r, "wy", 5, nm, a, cols, T);
        for (int c = 0; c < NC; c++) {
            snprintf(t1, sizeof t1, "chunk %d: dTm", c);
            ex_mat m[] = {{t1, b.dTm + (int64_t)c * BT * BT, chunk_len(x, c), chunk_len(x, c), BT}};
            ex_print(r, "wy", 1, m);
        }
        ex_check(r, "wy", "dq vs finite differences", fd(&b, L_WY, x->q, nk, b.dqw));
        ex_check(r, "wy", "dk vs finite differences", fd(&b, L_WY, x->k, nk, b.dkw));
        ex_check(r, "wy", "dv vs finite differences", fd(&b, L_WY, x->v, nv, b.dv));
        ex_check(r, "wy", "dbeta vs finite differences", fd(&b, L_WY, x->beta, T, b.dbw));
        ex_check(r, "wy", "dG vs finite differences", fd(&b, L_WY, x->G, nk, b.dGw));
        ex_check(r, "wy", "dTm vs finite differences", fd(&b, L_WY, x->Tm, na, b.dTm));
    }

    ex_heading(r, "intra", "backward: through Aqk and Tm = (I + Lkk)^-1 (dg__kda_intra_bwd_f64)");
    if (dg__kda_intra_bwd_f64(d, x->scale, x->q, x->k, x->beta, x->G, x->Tm, b.dAqk, b.dTm, b.dqi,
                              b.dki, b.dbi, b.dGi)) {
        fprintf(stderr, "deltagrad explain: intra backward: %s\n", dg_last_error());
        rc = 2;
        goto done;
    }
    {
        if (ex_shown(r, "intra"))
            printf("  dLkk (inside dg__kda_intra_bwd_f64; computed here from Tm and dTm):\n");
        walk_dlkk(r, x, b.dTm);
        const char *nm[] = {"dq", "dk", "dbeta", "dG"};
        const double *a[] = {b.dqi, b.dki, b.dbi, b.dGi};
        const int cols[] = {K, K, 1, K};
        print_rows(r, "intra", 4, nm, a, cols, T);
        ex_check(r, "intra", "dq vs finite differences", fd(&b, L_INTRA, x->q, nk, b.dqi));
        ex_check(r, "intra", "dk vs finite differences", fd(&b, L_INTRA, x->k, nk, b.dki));
        ex_check(r, "intra", "dbeta vs finite differences", fd(&b, L_INTRA, x->beta, T, b.dbi));
        ex_check(r, "intra", "dG vs finite differences", fd(&b, L_INTRA, x->G, nk, b.dGi));
    }
    for (int64_t i = 0; i < nk; i++) {
        b.dG[i] = b.dGs[i] + b.dGw[i] + b.dGi[i];
        b.dq[i] = b.dqw[i] + b.dqi[i];
        b.dk[i] = b.dkw[i] + b.dki[i];
    }
    for (int t = 0; t < T; t++)
        b.dbeta[t] = b.dbw[t] + b.dbi[t];

    ex_heading(r, "gate_cumsum", "backward: reverse cumsum, then the gate (dg__kda_gate_bwd_f64)");
    dg__kda_gate_bwd_f64(d, x->gate, x->lb, 1, x->x, A_log, x->dt_bias, b.dG, b.dx,
                         A_log ? b.dAlog : NULL, b.ddtb);
    {
        const char *nm[] = {"dG (sum of 3)", "dx"};
        const double *a[] = {b.dG, b.dx};
        const int cols[] = {K, K};
        print_rows(r, "gate_cumsum", 2, nm, a, cols, T);
        ex_check(r, "gate_cumsum", "dx vs finite differences", fd(&b, L_GATE, x->x, nk, b.dx));
        if (A_log)
            ex_check(r, "gate_cumsum", "dA_log vs finite differences",
                     fd(&b, L_GATE, x->A_log, 1, b.dAlog));
        ex_check(r, "gate_cumsum", "ddt_bias vs finite differences",
                 fd(&b, L_GATE, x->dt_bias, K, b.ddtb));
    }

    ex_heading(r, "beta", "backward: beta = sigmoid(b) (dg__kda_beta_bwd_f64)");
    dg__kda_beta_bwd_f64(T, 1.0, x->braw, b.dbeta, b.db);
    ex_check(r, "beta", "db vs finite differences", fd(&b, L_BETA, x->braw, T, b.db));

    ex_heading(r, "l2norm", "backward: unit rows (dg__l2norm_bwd_f64)");
    dg__l2norm_bwd_f64(T, K, x->q, x->rq, b.dq, b.dqr);
    dg__l2norm_bwd_f64(T, K, x->k, x->rk, b.dk, b.dkr);
    ex_check(r, "l2norm", "dq_raw vs finite differences", fd(&b, L_L2Q, x->qr, nk, b.dqr));
    ex_check(r, "l2norm", "dk_raw vs finite differences", fd(&b, L_L2K, x->kr, nk, b.dkr));

    ex_heading(r, "composite",
               "the chained gradients vs the recurrence's backward and vs "
               "differences of the whole chunked forward");
    {
        double *rq = ex_zeros(nk), *rk = ex_zeros(nk), *rv = ex_zeros(nv), *rg = ex_zeros(nk),
               *rb = ex_zeros(T), *rh0 = ex_zeros(kv), *dg = ex_zeros(nk);
        if (dg__kda_recurrent_bwd_f64(d, x->scale, x->q, x->k, x->v, x->g, x->beta, x->h0, x->dO,
                                      x->dht, rq, rk, rv, rg, rb, rh0)) {
            fprintf(stderr, "deltagrad explain: recurrent backward: %s\n", dg_last_error());
            rc = 2;
        } else {
            /* the chunked dg: dG through the reverse chunk cumsum alone (gate NONE) */
            dg__kda_gate_bwd_f64(d, DG_GATE_NONE, 0, 1, x->g, NULL, NULL, b.dG, dg, NULL, NULL);
            ex_check(r, "composite", "dq (unit rows): chunked = recurrent",
                     ex_relres(b.dq, rq, nk));
            ex_check(r, "composite", "dk (unit rows): chunked = recurrent",
                     ex_relres(b.dk, rk, nk));
            ex_check(r, "composite", "dv: chunked = recurrent", ex_relres(b.dv, rv, nv));
            ex_check(r, "composite", "dbeta: chunked = recurrent", ex_relres(b.dbeta, rb, T));
            ex_check(r, "composite", "dg (log decay): chunked = recurrent", ex_relres(dg, rg, nk));
            ex_check(r, "composite", "dh0: chunked = recurrent", ex_relres(b.dh0, rh0, kv));
            ex_check(r, "composite", "dq_raw vs differences of the whole forward",
                     fd(&b, L_FULL, x->qr, nk, b.dqr));
            ex_check(r, "composite", "dk_raw vs differences of the whole forward",
                     fd(&b, L_FULL, x->kr, nk, b.dkr));
            ex_check(r, "composite", "dv vs differences of the whole forward",
                     fd(&b, L_FULL, x->v, nv, b.dv));
            ex_check(r, "composite", "db vs differences of the whole forward",
                     fd(&b, L_FULL, x->braw, T, b.db));
            ex_check(r, "composite", "dx (gate input) vs differences of the whole forward",
                     fd(&b, L_FULL, x->x, nk, b.dx));
        }
        double *fr[] = {rq, rk, rv, rg, rb, rh0, dg};
        for (int i = 0; i < 7; i++)
            free(fr[i]);
    }
done:
    for (size_t i = 0; i < sizeof n / sizeof *n; i++)
        free(*f[i]);
    return rc;
}

/* ---- context parallelism on simulated ranks ------------------------------------------------ */

/* The arrays of one rank's slice [s0, s1) of the example (an ex_slice): its local stages, state
 * pass and backward through the library's raw functions, in the layouts of kda.h over
 * Tr = s1 - s0 tokens (its chunks restart at s0). The unsplit (one-rank) pass is the slice
 * [0, T). The walks themselves are tools/explain_kcp.c's. */
enum {
    KL_G,
    KL_AQK,
    KL_TM,
    KL_W,
    KL_U,
    KL_KG,
    KL_QG,
    KL_H,
    KL_E,
    KL_HT,
    KL_O, /* forward */
    KL_DQG,
    KL_DH,
    KL_DAQK,
    KL_DE, /* N7 backward */
    KL_DW,
    KL_DU,
    KL_DKG,
    KL_DGS,
    KL_DH0, /* N6 backward */
    KL_DQW,
    KL_DKW,
    KL_DV,
    KL_DBW,
    KL_DGW,
    KL_DTM, /* N5 backward */
    KL_DQI,
    KL_DKI,
    KL_DBI,
    KL_DGI, /* N4 backward */
    KL_DQ,
    KL_DK,
    KL_DBETA,
    KL_DG,
    KL_DLOG, /* sums; dg */
    KL_N
};

static void kloc_sizes(const void *p, const ex_slice *l, int64_t *sz) {
    const kx *x = (const kx *)p;
    const int64_t T = l->Tr, nk = T * x->K, nv = T * x->V, kv = (int64_t)x->K * x->V;
    const int64_t na = T * x->BT, nh = l->tab[3] * kv;
    const int64_t n[KL_N] = {
        [KL_G] = nk,   [KL_AQK] = na,  [KL_TM] = na,   [KL_W] = nk,   [KL_U] = nv,   [KL_KG] = nk,
        [KL_QG] = nk,  [KL_H] = nh,    [KL_E] = nv,    [KL_HT] = kv,  [KL_O] = nv,   [KL_DQG] = nk,
        [KL_DH] = nh,  [KL_DAQK] = na, [KL_DE] = nv,   [KL_DW] = nk,  [KL_DU] = nv,  [KL_DKG] = nk,
        [KL_DGS] = nk, [KL_DH0] = kv,  [KL_DQW] = nk,  [KL_DKW] = nk, [KL_DV] = nv,  [KL_DBW] = T,
        [KL_DGW] = nk, [KL_DTM] = na,  [KL_DQI] = nk,  [KL_DKI] = nk, [KL_DBI] = T,  [KL_DGI] = nk,
        [KL_DQ] = nk,  [KL_DK] = nk,   [KL_DBETA] = T, [KL_DG] = nk,  [KL_DLOG] = nk};
    memcpy(sz, n, sizeof n);
}

/* N3-N5 on the slice (no communication). */
static int kloc_stages(const void *p, ex_slice *l) {
    const kx *x = (const kx *)p;
    double **a = l->a;
    const int K = x->K, s0 = l->s0;
    const double *A_log = x->gate == DG_GATE_KDA ? x->A_log : NULL;
    const double *q = x->q + (int64_t)s0 * K, *k = x->k + (int64_t)s0 * K;
    const double *v = x->v + (int64_t)s0 * x->V, *beta = x->beta + s0;
    dg__kda_gate_fwd_f64(&l->d, x->gate, x->lb, 1, x->x + (int64_t)s0 * K, A_log, x->dt_bias,
                         a[KL_G]);
    TRY(dg__kda_intra_fwd_f64(&l->d, x->scale, q, k, beta, a[KL_G], a[KL_AQK], a[KL_TM]));
    TRY(dg__kda_wy_fwd_f64(&l->d, q, k, v, beta, a[KL_G], a[KL_TM], a[KL_W], a[KL_U], a[KL_KG],
                           a[KL_QG]));
    return 0;
}

/* N6-N7 from the slice's initial state hin, then N7's backward from dO (its rows of the slice):
 * dQG, dh per chunk start, dAqk, dE. */
static int kloc_state_out(const void *p, ex_slice *l, const double *hin) {
    const kx *x = (const kx *)p;
    double **a = l->a;
    TRY(dg__kda_state_fwd_f64(&l->d, a[KL_W], a[KL_U], a[KL_KG], a[KL_G], hin, a[KL_H], a[KL_E],
                              a[KL_HT]));
    dg__kda_output_fwd_f64(&l->d, x->scale, a[KL_QG], a[KL_H], a[KL_AQK], a[KL_E], a[KL_O]);
    dg__kda_output_bwd_f64(&l->d, x->scale, a[KL_QG], a[KL_H], a[KL_AQK], a[KL_E],
                           x->dO + (int64_t)l->s0 * x->V, a[KL_DQG], a[KL_DH], a[KL_DAQK],
                           a[KL_DE]);
    return 0;
}

/* N6-N4's backward with dht the gradient of the state leaving the slice, the sums, and dg (the
 * gradient of the per-token log decay: dG through the reverse chunk-local cumsum). */
static int kloc_backward(const void *p, ex_slice *l, const double *dht) {
    const kx *x = (const kx *)p;
    double **a = l->a;
    const int K = x->K, s0 = l->s0;
    const double *q = x->q + (int64_t)s0 * K, *k = x->k + (int64_t)s0 * K;
    const double *v = x->v + (int64_t)s0 * x->V, *beta = x->beta + s0;
    const int64_t nk = (int64_t)l->Tr * K;
    TRY(dg__kda_state_bwd_f64(&l->d, a[KL_W], a[KL_KG], a[KL_G], a[KL_H], a[KL_E], a[KL_DH],
                              a[KL_DE], dht, a[KL_DW], a[KL_DU], a[KL_DKG], a[KL_DGS], a[KL_DH0]));
    TRY(dg__kda_wy_bwd_f64(&l->d, q, k, v, beta, a[KL_G], a[KL_TM], a[KL_DW], a[KL_DU], a[KL_DKG],
                           a[KL_DQG], a[KL_DQW], a[KL_DKW], a[KL_DV], a[KL_DBW], a[KL_DGW],
                           a[KL_DTM]));
    TRY(dg__kda_intra_bwd_f64(&l->d, x->scale, q, k, beta, a[KL_G], a[KL_TM], a[KL_DAQK], a[KL_DTM],
                              a[KL_DQI], a[KL_DKI], a[KL_DBI], a[KL_DGI]));
    for (int64_t i = 0; i < nk; i++) {
        a[KL_DQ][i] = a[KL_DQW][i] + a[KL_DQI][i];
        a[KL_DK][i] = a[KL_DKW][i] + a[KL_DKI][i];
        a[KL_DG][i] = a[KL_DGS][i] + a[KL_DGW][i] + a[KL_DGI][i];
    }
    for (int t = 0; t < l->Tr; t++)
        a[KL_DBETA][t] = a[KL_DBW][t] + a[KL_DBI][t];
    dg__kda_gate_bwd_f64(&l->d, DG_GATE_NONE, 0, 1, x->g + (int64_t)s0 * K, NULL, NULL, a[KL_DG],
                         a[KL_DLOG], NULL, NULL);
    return 0;
}

/* The slice's summary: forward M_c = Diag(exp lam_c) - KG_c^T W_c, h_ext fed by KG^T U;
 * reverse M_c^T = Diag(exp lam_c) - W_c^T KG_c, dh_ext fed by - W^T dE and N7's dh. */
static void kloc_summary(const void *p, const ex_slice *l, int reverse, kcp_summary_io *io) {
    double *const *a = l->a;
    (void)p;
    io->reverse = reverse;
    io->X = reverse ? a[KL_W] : a[KL_KG];
    io->Y = reverse ? a[KL_KG] : a[KL_W];
    io->G = a[KL_G];
    io->neg_xy = 1;
    io->nterm = 1;
    io->term[0].A = reverse ? a[KL_W] : a[KL_KG];
    io->term[0].B = reverse ? a[KL_DE] : a[KL_U];
    io->term[0].neg = reverse;
    io->dh = reverse ? a[KL_DH] : NULL;
}

static dg_status rec_bwd(const void *p, const kda_dims *d, int t, const double *S, double *const *g,
                         double *dS) {
    const kx *x = (const kx *)p;
    const int64_t ok = (int64_t)t * x->K, ov = (int64_t)t * x->V;
    return dg__kda_recurrent_bwd_f64(d, x->scale, x->q + ok, x->k + ok, x->v + ov, x->g + ok,
                                     x->beta + t, S, x->dO + ov, x->dht, g[0], g[1], g[2], g[3],
                                     g[4], dS);
}

/* The recurrence's gradient of the state after token t (t < T). */
static int rec_suffix_dh(const void *p, int t, double *dS) {
    const kx *x = (const kx *)p;
    return ex_rec_suffix_dh(x, t, x->T, x->BT, x->K, x->V, rec_prefix, rec_bwd, dS);
}

static void kloc_print(const ex_run *r, const void *p, const ex_slice *l) {
    const kx *x = (const kx *)p;
    const int K = x->K, V = x->V;
    const char *nm[] = {"dq", "dk", "dv", "dg", "dbeta"};
    const double *ar[] = {l->a[KL_DQ], l->a[KL_DK], l->a[KL_DV], l->a[KL_DLOG], l->a[KL_DBETA]};
    const int cols[] = {K, K, V, K, 1};
    print_rows(r, "kcp", 5, nm, ar, cols, l->Tr);
}

/* The example's side of the simulated ranks (tools/explain_kcp.h). */
static const ex_kcp_op kda_op = {
    .n = KL_N,
    .i_o = KL_O,
    .i_ht = KL_HT,
    .i_dh0 = KL_DH0,
    .sizes = kloc_sizes,
    .stages = kloc_stages,
    .state_out = kloc_state_out,
    .backward = kloc_backward,
    .summary = kloc_summary,
    .rec_prefix = rec_prefix,
    .rec_suffix_dh = rec_suffix_dh,
    .print_grads = kloc_print,
    .ng = 5,
    .gname = {"dq", "dk", "dv", "dg", "dbeta"},
    .gi = {KL_DQ, KL_DK, KL_DV, KL_DLOG, KL_DBETA},
    .gper = {EX_PER_K, EX_PER_K, EX_PER_V, EX_PER_K, EX_PER_1},
    .fwd_intro =
        "  Rank r holds tokens [s_r, s_{r+1}) and runs N3-N5 on its slice (its chunks restart\n"
        "  at s_r). Its state pass is affine in the unknown initial state: h_out = M h_in +\n"
        "  h_ext. dg__kcp_summary_f64 computes [h_ext | M] (h_in = 0; rank 0 uses h0);\n"
        "  all ranks exchange them (an all_gather), and rank r chains those of ranks\n"
        "  0..r-1 (dg__kcp_merge_f64) into its h_in, then runs N6-N7 locally. Here the\n"
        "  ranks are simulated in one process, one after another.\n",
    .bwd_title = "backward over the simulated ranks (ops/kcp/kcp_nodes.c, ops/kda/kcp.c)",
    .bwd_intro =
        "  Each rank runs N7's backward on its slice (dh per chunk start, dE). Its state\n"
        "  pass's backward is affine in the unknown gradient dh_out of the state leaving\n"
        "  the slice: dh_in = M^T dh_out + dh_ext. Ranks 1..N-1 compute [dh_ext | M^T]\n"
        "  (dg__kcp_summary_f64, reverse: X = W, Y = KG, term - W^T dE, plus N7's dh; the\n"
        "  last rank starts from the loss's dht); rank 0 sends zeros. After an all_gather,\n"
        "  rank r chains the summaries of ranks N-1 down to r+1 (dg__kcp_merge_f64, farthest\n"
        "  first) into the dh entering its slice from the right, then runs N6-N4's backward\n"
        "  locally. A rank > 0 drops the dh0 it computes: rank r-1 already got it through\n"
        "  the merge. dq, dk are gradients of the unit rows, dg of the per-token log decay\n"
        "  (N1-N3's backward is per token, the same split or not).\n",
};

static ex_kcp kda_kcp(const kx *x) {
    return (ex_kcp){&kda_op, x, x->o->cp, x->T, x->BT, x->K, x->V, x->h0, x->dht, x->O, x->ht};
}

static int walk_kcp(ex_run *r, kx *x) {
    ex_kcp k = kda_kcp(x);
    return ex_kcp_forward(r, &k);
}

static int walk_kcp_backward(ex_run *r, kx *x) {
    ex_kcp k = kda_kcp(x);
    return ex_kcp_backward(r, &k);
}

int ex_kda(const ex_opts *o) {
    kx x;
    ex_run r = {o, 0, 0, 0};
    kx_init(&x, o, o->T, o->BT, o->K, o->V);
    ex_banner(o, "", "KDA");
    int rc = kx_forward(&x);
    if (!rc)
        rc = kx_recurrent(&x);
    if (!rc && !o->backward)
        rc = walk_forward(&r, &x);
    if (!rc && o->cp)
        rc = walk_kcp(&r, &x);
    if (!rc && o->backward)
        rc = walk_backward(&r, &x);
    if (!rc && o->backward && o->cp)
        rc = walk_kcp_backward(&r, &x);
    kx_free(&x);
    if (rc)
        return rc;
    return ex_summary(&r);
}

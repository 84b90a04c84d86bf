/*
 * tools/explain_kcp.c -- the sequence split over simulated ranks, shared by the KDA and DPLR walks
 * of `deltagrad explain` (tools/explain_kcp.h). The ranks run one after another in this process;
 * the all_gathers are arrays of summaries [N, K, V+K].
 */
#include "tools/explain_kcp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int ex_rec_prefix(const void *x, int t, int BT, int K, int V, const double *h0,
                  dg_status (*rec)(const void *x, const kda_dims *d, double *o, double *S),
                  double *S) {
    if (t == 0) {
        memcpy(S, h0, sizeof(double) * (size_t)K * V);
        return 0;
    }
    kda_dims d;
    int64_t tab[4];
    kx_dims(&d, tab, t, BT, K, V);
    double *o = ex_zeros((int64_t)t * V);
    dg_status st = rec(x, &d, o, S);
    free(o);
    if (st != DG_OK) {
        fprintf(stderr, "deltagrad explain: recurrence: %s\n", dg_last_error());
        return 2;
    }
    return 0;
}

int ex_walk_states(ex_run *r, const void *x, int (*rec_prefix)(const void *x, int t, double *S),
                   int T, int BT, int K, int V, const double *h, const double *ht,
                   const double *htrec, const char *vname, const double *vals,
                   double (*want)(const void *x, int t, int e, const double *S),
                   const char *want_name) {
    const int NC = (T + BT - 1) / BT;
    const int64_t kv = (int64_t)K * V;
    char t1[96];
    ex_print_states(r, "state", "h", h, NC, K, V);
    for (int c = 0; c < NC; c++) {
        const int t0 = c * BT, L = T - t0 < BT ? T - t0 : BT;
        snprintf(t1, sizeof t1, "chunk %d: %s", c, vname);
        ex_mat m[] = {{t1, vals + (int64_t)t0 * V, L, V, V}};
        ex_print(r, "state", 1, m);
    }
    double *S = ex_zeros(kv);
    for (int c = 0; c < NC; c++) {
        if (rec_prefix(x, c * BT, S)) {
            free(S);
            return 2;
        }
        snprintf(t1, sizeof t1, "h[%d] = recurrence state after token %d", c, c * BT);
        ex_check(r, "state", t1, ex_relres(h + (int64_t)c * kv, S, kv));
    }
    ex_check(r, "state", "final state = recurrence S_T", ex_relres(ht, htrec, kv));
    double re = 0;
    for (int t = 0; t < T; t++) {
        if (rec_prefix(x, t, S)) {
            free(S);
            return 2;
        }
        for (int e = 0; e < V; e++)
            re = fmax(re, fabs(vals[(int64_t)t * V + e] - want(x, t, e, S)));
    }
    ex_check(r, "state", want_name, re);
    free(S);
    return 0;
}

int ex_rec_suffix_dh(const void *x, int t, int T, int BT, int K, int V,
                     int (*rec_prefix)(const void *x, int t, double *S),
                     dg_status (*rec_bwd)(const void *x, const kda_dims *d, int t, const double *S,
                                          double *const *g, double *dS),
                     double *dS) {
    const int n = T - t;
    const int64_t nk = (int64_t)n * K, nv = (int64_t)n * V;
    kda_dims d;
    int64_t tab[4];
    kx_dims(&d, tab, n, BT, K, V);
    double *S = ex_zeros((int64_t)K * V), *g[6];
    const int64_t gn[6] = {nk, nk, nv, nk, nk, nk};
    for (int i = 0; i < 6; i++)
        g[i] = ex_zeros(gn[i]);
    int rc = rec_prefix(x, t, S);
    if (!rc && rec_bwd(x, &d, t, S, g, dS) != DG_OK) {
        fprintf(stderr, "deltagrad explain: recurrent backward: %s\n", dg_last_error());
        rc = 2;
    }
    free(S);
    for (int i = 0; i < 6; i++)
        free(g[i]);
    return rc;
}

/* The N slices of the ranks (n = 1: the whole sequence), their arrays zeroed. */
static ex_slice *slices_new(const ex_kcp *k, int n) {
    ex_slice *l = (ex_slice *)calloc((size_t)n, sizeof(ex_slice));
    int64_t *sz = (int64_t *)calloc((size_t)k->op->n, sizeof(int64_t));
    if (!l || !sz) {
        fprintf(stderr, "deltagrad explain: out of host memory\n");
        exit(2);
    }
    for (int i = 0; i < n; i++) {
        l[i].s0 = (int)((int64_t)i * k->T / n);
        l[i].s1 = (int)((int64_t)(i + 1) * k->T / n);
        l[i].Tr = l[i].s1 - l[i].s0;
        kx_dims(&l[i].d, l[i].tab, l[i].Tr, k->BT, k->K, k->V);
        l[i].n = k->op->n;
        l[i].a = (double **)calloc((size_t)k->op->n, sizeof(double *));
        if (!l[i].a) {
            fprintf(stderr, "deltagrad explain: out of host memory\n");
            exit(2);
        }
        k->op->sizes(k->x, &l[i], sz);
        for (int j = 0; j < k->op->n; j++)
            l[i].a[j] = ex_zeros(sz[j]);
    }
    free(sz);
    return l;
}

static void slices_free(ex_slice *l, int n) {
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < l[i].n; j++)
            free(l[i].a[j]);
        free(l[i].a);
    }
    free(l);
}

static int kcp_failed(const char *what) {
    fprintf(stderr, "deltagrad explain: %s: %s\n", what, dg_last_error());
    return 2;
}

/* Rank i's summary (reverse: of the backward) into ag [N, K, V+K]; S0 the state entering the
 * chain there (h0 on the first rank, dht on the last in reverse), else none. */
static int summarize(const ex_kcp *k, const ex_slice *l, int i, int reverse, const double *S0,
                     double *ag) {
    kcp_summary_io io;
    memset(&io, 0, sizeof io);
    k->op->summary(k->x, l, reverse, &io);
    io.S0 = S0;
    io.out = ag + (int64_t)i * k->K * (k->V + k->K);
    return dg__kcp_summary_f64(&l->d, &io) ? kcp_failed("kcp summary") : 0;
}

/* pred = h_ext + M h of a summary s [K, V+K] (h_ext alone when !use_h). */
static void affine(const double *s, int K, int V, const double *h, int use_h, double *pred) {
    const int C = V + K;
    for (int p = 0; p < K; p++)
        for (int e = 0; e < V; e++) {
            double sum = s[p * C + e];
            for (int b = 0; b < K && use_h; b++)
                sum += s[p * C + V + b] * h[b * V + e];
            pred[p * V + e] = sum;
        }
}

/* The forward summaries of every rank (agf), the merges (hin [N, K, V]) and the local state
 * passes, as the forward of both walks runs them. */
static int ranks_forward(const ex_kcp *k, ex_slice *rk, double *agf, double *hin) {
    const int N = k->N;
    const int64_t kv = (int64_t)k->K * k->V;
    int order[64], rc = 0;
    for (int i = 0; i < N && !rc; i++) {
        rc = k->op->stages(k->x, &rk[i]);
        if (!rc)
            rc = summarize(k, &rk[i], i, 0, i == 0 ? k->h0 : NULL, agf);
    }
    for (int i = 0; i < N && !rc; i++) {
        for (int s = 0; s < i; s++)
            order[s] = s;
        if (i == 0)
            memcpy(hin, k->h0, sizeof(double) * (size_t)kv);
        else if (dg__kcp_merge_f64(1, k->K, k->V, agf, order, i, hin + i * kv))
            rc = kcp_failed("kcp merge");
        if (!rc)
            rc = k->op->state_out(k->x, &rk[i], hin + i * kv);
    }
    return rc;
}

int ex_kcp_forward(ex_run *r, const ex_kcp *k) {
    const int N = k->N, K = k->K, V = k->V, C = V + K;
    const int64_t kv = (int64_t)K * V;
    char t1[96];
    ex_heading(r, "kcp", "the sequence split over simulated ranks (ops/kcp/summary.c)");
    if (ex_shown(r, "kcp"))
        printf("%s", k->op->fwd_intro);
    ex_slice *rk = slices_new(k, N);
    double *ag = ex_zeros((int64_t)N * K * C), *hin = ex_zeros((int64_t)N * kv);
    double *S = ex_zeros(kv), *pred = ex_zeros(kv);
    double ro = 0;
    int rc = ranks_forward(k, rk, ag, hin);
    for (int i = 0; i < N && !rc; i++) {
        const ex_slice *l = &rk[i];
        const double *out = ag + (int64_t)i * K * C, *h = hin + i * kv;
        snprintf(t1, sizeof t1, "rank %d (tokens %d..%d): h_ext", i, l->s0, l->s1 - 1);
        ex_mat m[] = {{t1, out, K, V, C}, {"M", out + V, K, K, C}, {"h_in (merged)", h, K, V, V}};
        ex_print(r, "kcp", 3, m);
        if ((rc = k->op->rec_prefix(k->x, l->s0, S)))
            break;
        snprintf(t1, sizeof t1, "rank %d: merged h_in = recurrence state after token %d", i, l->s0);
        ex_check(r, "kcp", t1, ex_relres(h, S, kv));
        /* the summary is the affine map: M h_in + h_ext = the local final state (rank 0's h_ext
         * already holds M h0) */
        affine(out, K, V, h, i > 0, pred);
        snprintf(t1, sizeof t1, "rank %d: M h_in + h_ext = its final state", i);
        ex_check(r, "kcp", t1, ex_relres(pred, l->a[k->op->i_ht], kv));
        ro = fmax(ro, ex_relres(l->a[k->op->i_o], k->o + (int64_t)l->s0 * V, (int64_t)l->Tr * V));
    }
    if (!rc) {
        ex_check(r, "kcp", "o of the ranks = o of the unsplit pass", ro);
        ex_check(r, "kcp", "last rank's final state = unsplit final state",
                 ex_relres(rk[N - 1].a[k->op->i_ht], k->ht, kv));
    }
    slices_free(rk, N);
    double *fr[] = {ag, hin, S, pred};
    for (int i = 0; i < 4; i++)
        free(fr[i]);
    return rc;
}

/* The reverse summaries of ranks 1..N-1 (agb), the reverse merges (dho [N, K, V]) and each
 * rank's local backward. */
static int ranks_backward(const ex_kcp *k, ex_slice *rk, double *agb, double *dho) {
    const int N = k->N;
    const int64_t kv = (int64_t)k->K * k->V;
    int order[64], rc = 0;
    for (int i = 1; i < N && !rc; i++)
        rc = summarize(k, &rk[i], i, 1, i == N - 1 ? k->dht : NULL, agb);
    for (int i = 0; i < N && !rc; i++) {
        if (i == N - 1) {
            memcpy(dho + i * kv, k->dht, sizeof(double) * (size_t)kv);
        } else {
            for (int s = 0; s < N - 1 - i; s++)
                order[s] = N - 1 - s;
            if (dg__kcp_merge_f64(1, k->K, k->V, agb, order, N - 1 - i, dho + i * kv))
                rc = kcp_failed("kcp merge");
        }
        if (!rc)
            rc = k->op->backward(k->x, &rk[i], dho + i * kv);
    }
    return rc;
}

/* Rank i's identities of the backward: its merged dh_out against the recurrence, its reverse
 * summary sm as the affine map onto its local dh0 and as the transpose of its forward one fm. */
static int rank_backward_checks(ex_run *r, const ex_kcp *k, const ex_slice *rk, int i,
                                const double *sm, const double *fm, const double *dho) {
    const int N = k->N, K = k->K, V = k->V, C = V + K;
    const int64_t kv = (int64_t)K * V;
    const ex_slice *l = &rk[i];
    const double *dh = dho + i * kv, *dh0 = l->a[k->op->i_dh0];
    char t1[112];
    if (i < N - 1) {
        double *S = ex_zeros(kv);
        int rc = k->op->rec_suffix_dh(k->x, l->s1, S);
        if (!rc) {
            snprintf(t1, sizeof t1,
                     "rank %d: merged dh_out = recurrence gradient of the state after token %d", i,
                     l->s1);
            ex_check(r, "kcp", t1, ex_relres(dh, S, kv));
        }
        free(S);
        if (rc)
            return rc;
    }
    if (i == 0)
        return 0;
    /* the reverse summary is the affine map: M^T dh_out + dh_ext = the local dh0 (the last
     * rank's dh_ext already holds M^T dht) */
    double *pred = ex_zeros(kv);
    affine(sm, K, V, dh, i < N - 1, pred);
    snprintf(t1, sizeof t1, "rank %d: %s = its local dh0", i,
             i < N - 1 ? "M^T dh_out + dh_ext" : "dh_ext (from dht)");
    ex_check(r, "kcp", t1, ex_relres(pred, dh0, kv));
    free(pred);
    snprintf(t1, sizeof t1, "rank %d: its local dh0 = dh_out merged for rank %d", i, i - 1);
    ex_check(r, "kcp", t1, ex_relres(dh0, dho + (i - 1) * kv, kv));
    double rt = 0;
    for (int p = 0; p < K; p++)
        for (int b = 0; b < K; b++)
            rt = fmax(rt, fabs(sm[p * C + V + b] - fm[b * C + V + p]));
    snprintf(t1, sizeof t1, "rank %d: backward M^T = transpose of forward M", i);
    ex_check(r, "kcp", t1, rt);
    return 0;
}

int ex_kcp_backward(ex_run *r, const ex_kcp *k) {
    const int N = k->N, K = k->K, V = k->V, C = V + K;
    const int64_t kv = (int64_t)K * V;
    char t1[112];
    ex_heading(r, "kcp", k->op->bwd_title);
    if (ex_shown(r, "kcp"))
        printf("%s", k->op->bwd_intro);
    ex_slice *one = slices_new(k, 1), *rk = slices_new(k, N);
    double *agf = ex_zeros((int64_t)N * K * C), *agb = ex_zeros((int64_t)N * K * C);
    double *hin = ex_zeros((int64_t)N * kv), *dho = ex_zeros((int64_t)N * kv);
    /* the one-rank backward */
    int rc = k->op->stages(k->x, one);
    if (!rc)
        rc = k->op->state_out(k->x, one, k->h0);
    if (!rc)
        rc = k->op->backward(k->x, one, k->dht);
    /* the forward on the ranks, then the reverse summaries, merges and local backwards */
    if (!rc)
        rc = ranks_forward(k, rk, agf, hin);
    if (!rc)
        rc = ranks_backward(k, rk, agb, dho);
    for (int i = 0; i < N && !rc; i++) {
        const ex_slice *l = &rk[i];
        const double *sm = agb + (int64_t)i * K * C, *dh = dho + i * kv;
        snprintf(t1, sizeof t1, "rank %d (tokens %d..%d): dh_ext%s", i, l->s0, l->s1 - 1,
                 i == N - 1 ? " (from dht)" : "");
        if (i > 0) {
            ex_mat m[] = {{t1, sm, K, V, C},
                          {"M^T", sm + V, K, K, C},
                          {i == N - 1 ? "dh_out = dht" : "dh_out (merged)", dh, K, V, V}};
            ex_print(r, "kcp", 3, m);
        } else if (ex_shown(r, "kcp")) {
            printf("  rank 0 (tokens %d..%d): no summary (no rank before it)\n", l->s0, l->s1 - 1);
            ex_mat m[] = {{N == 1 ? "dh_out = dht" : "dh_out (merged)", dh, K, V, V}};
            ex_print(r, "kcp", 1, m);
        }
        k->op->print_grads(r, k->x, l);
        rc = rank_backward_checks(r, k, rk, i, sm, agf + (int64_t)i * K * C, dho);
    }
    for (int j = 0; j < k->op->ng && !rc; j++) {
        const int g = k->op->gi[j];
        const int per = k->op->gper[j] == EX_PER_K ? K : k->op->gper[j] == EX_PER_V ? V : 1;
        double res = 0;
        for (int i = 0; i < N; i++)
            res = fmax(res, ex_relres(rk[i].a[g], one->a[g] + (int64_t)rk[i].s0 * per,
                                      (int64_t)rk[i].Tr * per));
        snprintf(t1, sizeof t1, "%s of the ranks = %s of the one-rank backward", k->op->gname[j],
                 k->op->gname[j]);
        ex_check(r, "kcp", t1, res);
    }
    if (!rc)
        ex_check(r, "kcp", "rank 0's dh0 = dh0 of the one-rank backward",
                 ex_relres(rk[0].a[k->op->i_dh0], one->a[k->op->i_dh0], kv));
    slices_free(one, 1);
    slices_free(rk, N);
    double *fr[] = {agf, agb, hin, dho};
    for (int i = 0; i < 4; i++)
        free(fr[i]);
    return rc;
}

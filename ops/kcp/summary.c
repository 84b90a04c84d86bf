/*
 * ops/kcp/summary.c -- the raw KCP summaries and merge (distributed.md K3, K4,
 * distributed.md K4, K6) for every op whose state pass is affine in its initial state: f64 and f32
 * bodies written once (ops/ref_tmpl.h). See kcp.h for what they compute.
 *
 * The summary carries [h | M] through the sequence's chunks as one [K, V+K] block per value
 * head: each chunk multiplies it by its K x K transition, formed explicitly, and adds the
 * chunk's rank-one terms to the first V columns. It is the reference (the CUDA path of KDA
 * computes the same block with two state passes on the device: ops/kda/kcp.c).
 */
#ifndef DG_REF_TMPL
#include "kcp.h"
#define DG_REF_TMPL "kcp/summary.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* A[a][b] += x[a] y[b] (neg: -=) for a < m, b < n; A has row stride lda. */
static void RF(ger)(int m, int n, const RT *x, const RT *y, int neg, RT *A, int lda) {
    if (neg)
        for (int a = 0; a < m; a++)
            for (int b = 0; b < n; b++)
                A[a * lda + b] -= x[a] * y[b];
    else
        for (int a = 0; a < m; a++)
            for (int b = 0; b < n; b++)
                A[a * lda + b] += x[a] * y[b];
}

/* A = Diag(exp(lam)) + s X^T Y over the L rows of chunk ch (X, Y rows of K at token stride
 * HV*K): A[a][b] = delta_ab exp(lam_a) + s sum_i X[i][a] Y[i][b], s = -1 when neg. */
static void RF(chunk_mat)(const kda_dims *d, kda_chunk ch, int hv, const RT *X, const RT *Y,
                          int neg, const RT *lam, RT *A) {
    const int HV = d->HV, K = d->K;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++)
            A[a * K + b] = a == b ? REXP(lam[a]) : (RT)0;
    for (int i = 0; i < ch.L; i++) {
        const int64_t ti = ch.t0 + i;
        RF(ger)(K, K, X + (ti * HV + hv) * K, Y + (ti * HV + hv) * K, neg, A, K);
    }
}

/* Y = A X for A [K,K], X [K,n] with row stride ldx; Y [K,n] (stride ldy), Y != X. */
static void RF(mm)(int K, int n, const RT *A, const RT *X, int ldx, RT *Y, int ldy) {
    for (int a = 0; a < K; a++) {
        RT *y = Y + (int64_t)a * ldy;
        for (int b = 0; b < n; b++)
            y[b] = 0;
        for (int c = 0; c < K; c++) {
            const RT s = A[a * K + c];
            const RT *x = X + (int64_t)c * ldx;
            for (int b = 0; b < n; b++)
                y[b] += s * x[b];
        }
    }
}

dg_status RF(dg__kcp_summary)(const kda_dims *d, const kcp_summary_io *io) {
    const int HV = d->HV, K = d->K, V = d->V, C = V + K, n = io->seq;
    const RT *X = (const RT *)io->X, *Y = (const RT *)io->Y, *G = (const RT *)io->G;
    const RT *dh = (const RT *)io->dh, *S0 = (const RT *)io->S0;
    const size_t per = (size_t)K * K + 2 * (size_t)K * C;
    RT *scr = (RT *)DG_MALLOC(sizeof(RT) * per * (size_t)kda_max_threads());
    if (!scr)
        return dg__err(DG_ERR_NOMEM, "kcp summary: no memory");
    const int64_t nc = kda_nchunks(d, n);
    KDA_OMP(parallel for schedule(dynamic, 1) if (HV > 1))
    for (int hv = 0; hv < HV; hv++) {
        RT *A = scr + per * (size_t)kda_thread_id(), *S = A + K * K, *S2 = S + (size_t)K * C;
        /* S = [S0 | I] */
        for (int a = 0; a < K; a++)
            for (int b = 0; b < C; b++)
                S[a * C + b] =
                    b < V ? (S0 ? S0[((int64_t)hv * K + a) * V + b] : (RT)0) : (RT)(b - V == a);
        for (int64_t s = 0; s < nc; s++) {
            const kda_chunk ch = kda_chunk_at(d, n, io->reverse ? nc - 1 - s : s);
            const RT *lam = G + ((ch.t0 + ch.L - 1) * HV + hv) * K;
            RF(chunk_mat)(d, ch, hv, X, Y, io->neg_xy, lam, A);
            RF(mm)(K, C, A, S, C, S2, C); /* [h | M] <- A [h | M] */
            for (int t = 0; t < io->nterm; t++) {
                const RT *PA = (const RT *)io->term[t].A, *PB = (const RT *)io->term[t].B;
                if (!PA || !PB)
                    continue;
                for (int i = 0; i < ch.L; i++) {
                    const int64_t ti = ch.t0 + i;
                    RF(ger)
                    (K, V, PA + (ti * HV + hv) * K, PB + (ti * HV + hv) * V, io->term[t].neg, S2,
                     C);
                }
            }
            if (dh) { /* the upstream gradient of the state at the chunk's start */
                const RT *dhc = dh + (ch.idx * HV + hv) * (int64_t)K * V;
                for (int a = 0; a < K; a++)
                    for (int b = 0; b < V; b++)
                        S2[a * C + b] += dhc[a * V + b];
            }
            RT *tmp = S;
            S = S2;
            S2 = tmp;
        }
        memcpy((RT *)io->out + (int64_t)hv * K * C, S, sizeof(RT) * (size_t)K * C);
    }
    DG_FREE(scr);
    return DG_OK;
}

dg_status RF(dg__kcp_merge)(int HV, int K, int V, const void *agv, const int *order, int n,
                            void *outv) {
    const int C = V + K;
    const int64_t per = (int64_t)HV * K * C;
    const RT *ag = (const RT *)agv;
    RT *out = (RT *)outv;
    RT *rows = (RT *)DG_MALLOC(sizeof(RT) * (size_t)HV * K * V); /* x_new per head */
    if (!rows)
        return dg__err(DG_ERR_NOMEM, "kcp merge: no memory");
    memset(out, 0, sizeof(RT) * (size_t)HV * K * V);
    for (int s = 0; s < n; s++) {
        KDA_OMP(parallel for schedule(static) if (HV * (int64_t)K * K * V > 1 << 20))
        for (int hv = 0; hv < HV; hv++) {
            const RT *sm = ag + order[s] * per + (int64_t)hv * K * C;
            RT *x = out + (int64_t)hv * K * V, *row = rows + (int64_t)hv * K * V;
            for (int a = 0; a < K; a++) { /* row a of Sh + SM x, x walked row by row */
                RT *r = row + (int64_t)a * V;
                for (int b = 0; b < V; b++)
                    r[b] = sm[a * C + b];
                for (int c = 0; c < K; c++) {
                    const RT m = sm[a * C + V + c];
                    const RT *xc = x + (int64_t)c * V;
                    for (int b = 0; b < V; b++)
                        r[b] += m * xc[b];
                }
            }
            memcpy(x, row, sizeof(RT) * (size_t)K * V);
        }
    }
    DG_FREE(rows);
    return DG_OK;
}
#endif

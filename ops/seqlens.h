/*
 * ops/seqlens.h -- the varlen sequence table of the token-local ops along T (dg_short_conv,
 * dg_token_shift; library-internal): its check and the search for the sequence of a row.
 *
 * cu_seqlens: NULL (batch mode: each of the B rows of x [B,T,C] is one sequence), or host int64
 * [n_seqs+1] with B == 1, cu[0] = 0, cu[n_seqs] = T, non-decreasing.
 */
#ifndef DG_OPS_SEQLENS_H
#define DG_OPS_SEQLENS_H

#include "../autograd/tape.h"

/* cu (NULL: nothing to check) against x [B,T,C], errors naming `op`. */
static inline dg_status dg__check_cu_seqlens(const char *op, const dg_tensor *x, const int64_t *cu,
                                             int n_seqs) {
    if (!cu)
        return DG_OK;
    const int64_t B = x->shape[0], T = x->shape[1];
    if (n_seqs < 1)
        return dg__err(DG_ERR_ARG, "%s: n_seqs = %d with cu_seqlens; need at least 1", op, n_seqs);
    if (B != 1)
        return dg__err(DG_ERR_ARG, "%s: cu_seqlens requires B == 1 (packed sequences), x is %s", op,
                       dg_tensor_desc(x));
    if (cu[0] != 0)
        return dg__err(DG_ERR_ARG, "%s: cu_seqlens[0] must be 0, got %lld", op, (long long)cu[0]);
    for (int i = 0; i < n_seqs; i++)
        if (cu[i + 1] < cu[i])
            return dg__err(DG_ERR_ARG,
                           "%s: cu_seqlens must be non-decreasing: cu_seqlens[%d] = %lld < "
                           "cu_seqlens[%d] = %lld",
                           op, i + 1, (long long)cu[i + 1], i, (long long)cu[i]);
    if (cu[n_seqs] != T)
        return dg__err(DG_ERR_ARG, "%s: cu_seqlens[%d] must equal T = %lld, got %lld", op, n_seqs,
                       (long long)T, (long long)cu[n_seqs]);
    return DG_OK;
}

/* The sequence [st, en) holding row r = b*T + t (cu NULL: row b; else the same search as the
 * CUDA kernels). */
static inline void dg__seq_bounds(int64_t r, int64_t T, const int64_t *cu, int n_seqs, int64_t *st,
                                  int64_t *en) {
    if (!cu) {
        *st = r / T * T;
        *en = *st + T;
        return;
    }
    int lo = 0, hi = n_seqs;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (cu[mid] <= r)
            lo = mid;
        else
            hi = mid;
    }
    *st = cu[lo];
    *en = cu[lo + 1];
}

#endif

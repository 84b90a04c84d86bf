/*
 * dist/cp_plan.c -- dg_cp_plan: one rank's view of a context-parallel split (docs/distributed.md
 * K2, with uneven splits).
 *
 * The global token axis [0, total) holds n_seqs sequences (cu_seqlens) and is cut into world
 * contiguous slices; rank r owns [bound[r], bound[r+1]). The sequences overlapping the slice are
 * the local ones, clipped to it and renumbered from 0. Only local sequence 0 can have started on
 * an earlier rank (pre_ranks > 0: ranks r-pre .. r-1 hold its beginning, pre_tokens of it) and
 * only the last local sequence can continue on later ranks (post_ranks > 0). Every local
 * sequence is chunked from its local start.
 */
#include "../tensor/tensor.h"

#define OP "dg_cp_plan_new"

/* The rank owning global token t: the last r with bound[r] <= t. */
static int owner(const int64_t *bound, int world, int64_t t) {
    int lo = 0, hi = world - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (bound[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

dg_status dg_cp_plan_new(int world, int rank, int64_t total, const int64_t *cu_seqlens, int n_seqs,
                         const int64_t *rank_tokens, dg_cp_plan **out) {
    DG_TRY(dg__check_ptr(OP, "out", out));
    *out = NULL;
    if (world < 1 || rank < 0 || rank >= world)
        return dg__err(DG_ERR_ARG, OP ": need world >= 1 and 0 <= rank < world, got rank %d of %d",
                       rank, world);
    int64_t one[2] = {0, total};
    if (!cu_seqlens) {
        cu_seqlens = one;
        n_seqs = 1;
    }
    if (n_seqs < 1)
        return dg__err(DG_ERR_ARG, OP ": n_seqs must be >= 1 with cu_seqlens, got %d", n_seqs);
    const int64_t *cu = cu_seqlens;
    if (cu[0] != 0 || cu[n_seqs] != total)
        return dg__err(DG_ERR_ARG,
                       OP ": cu_seqlens must run from 0 to total=%lld, got cu_seqlens[0]=%lld "
                          "cu_seqlens[%d]=%lld",
                       (long long)total, (long long)cu[0], n_seqs, (long long)cu[n_seqs]);
    for (int n = 0; n < n_seqs; n++)
        if (cu[n + 1] <= cu[n])
            return dg__err(DG_ERR_ARG,
                           OP ": cu_seqlens must be strictly increasing under context "
                              "parallelism (no empty sequences), got cu_seqlens[%d]=%lld, "
                              "cu_seqlens[%d]=%lld",
                           n, (long long)cu[n], n + 1, (long long)cu[n + 1]);
    if (total < world)
        return dg__err(DG_ERR_ARG, OP ": total=%lld tokens cannot give each of %d ranks one",
                       (long long)total, world);
    int64_t *bound = (int64_t *)DG_MALLOC(sizeof(int64_t) * ((size_t)world + 1));
    if (!bound)
        return dg__err(DG_ERR_NOMEM, OP ": out of host memory");
    bound[0] = 0;
    for (int r = 0; r < world; r++) {
        int64_t len = rank_tokens ? rank_tokens[r] : total / world + (r < total % world);
        if (len < 1) {
            DG_FREE(bound);
            return dg__err(DG_ERR_ARG, OP ": rank_tokens[%d] must be >= 1, got %lld", r,
                           (long long)len);
        }
        bound[r + 1] = bound[r] + len;
    }
    if (bound[world] != total) {
        long long sum = (long long)bound[world];
        DG_FREE(bound);
        return dg__err(DG_ERR_ARG, OP ": rank_tokens must sum to total=%lld, got %lld",
                       (long long)total, sum);
    }
    const int64_t b = bound[rank], e = bound[rank + 1];
    int si = 0, ei = 0; /* local sequences: global si .. ei-1 */
    while (cu[si + 1] <= b)
        si++;
    ei = si;
    while (ei < n_seqs && cu[ei] < e)
        ei++;
    dg_cp_plan *p = (dg_cp_plan *)DG_CALLOC(1, sizeof *p);
    int64_t *cl = (int64_t *)DG_MALLOC(sizeof(int64_t) * ((size_t)(ei - si) + 1));
    if (!p || !cl) {
        DG_FREE(p);
        DG_FREE(cl);
        DG_FREE(bound);
        return dg__err(DG_ERR_NOMEM, OP ": out of host memory");
    }
    for (int i = 0; i <= ei - si; i++) {
        int64_t t = cu[si + i] < b ? b : cu[si + i] > e ? e : cu[si + i];
        cl[i] = t - b;
    }
    p->rank = rank;
    p->world = world;
    p->total = total;
    p->begin = b;
    p->end = e;
    p->n_seqs = n_seqs;
    p->n_local = ei - si;
    p->seq0 = si;
    p->cu_local = cl;
    p->pre_ranks = rank - owner(bound, world, cu[si]);
    p->post_ranks = owner(bound, world, cu[ei] - 1) - rank;
    p->pre_tokens = b - cu[si];
    p->bounds = bound;
    *out = p;
    return DG_OK;
}

void dg_cp_plan_free(dg_cp_plan **p) {
    if (!p || !*p)
        return;
    DG_FREE((*p)->cu_local);
    DG_FREE((*p)->bounds);
    DG_FREE(*p);
    *p = NULL;
}

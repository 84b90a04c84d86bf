/*
 * tests/kda_cuda_testutil.h -- helpers shared by the raw KDA CUDA kernel tests
 * (test_kda_cuda_fwd.c, test_kda_cuda_bwd.c, test_kda_tc.c): the chunk tables of a test case on
 * both devices, f32 tensors on either device, NaN-poisoned device outputs, and a norm-relative
 * comparison that also reports its error to the caller.
 */
#ifndef DG_KDA_CUDA_TESTUTIL_H
#define DG_KDA_CUDA_TESTUTIL_H

#include "harness.h"
#include "kernels/kda/kda_cuda.h"
#include "ops/kda/kda.h"

#include <math.h>
#include <string.h>

/* Device (or host) float pointer of an f32 tensor; NULL stays NULL (an optional argument). */
static inline float *F(const dg_tensor *t) { return t ? (float *)dg_tensor_data(t) : NULL; }

/* New f32 tensor [n0, n1, n2, n3] (trailing zeros drop dims). */
static inline dg_tensor *mk(dg_ctx *ctx, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    int64_t s[4] = {n0, n1, n2, n3};
    int nd = n3 ? 4 : n2 ? 3 : n1 ? 2 : 1;
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, DG_F32, nd, s, &t));
    return t;
}

static inline dg_tensor *mk_rand(dg_ctx *ctx, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                                 uint64_t seed, double lo, double hi) {
    dg_tensor *t = mk(ctx, n0, n1, n2, n3);
    DG_TEST_TRY(dg_tensor_rand_uniform(t, seed, lo, hi));
    return t;
}

/* A device output shaped like the CPU reference `like` (NULL: none), filled with NaN so that an
 * element a kernel forgets to write fails the comparison. */
static inline dg_tensor *poisoned(dg_ctx *gpu, const dg_tensor *like) {
    if (!like)
        return NULL;
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F32, dg_tensor_ndim(like), dg_tensor_shape(like), &t));
    DG_TEST_TRY(dg_tensor_fill_(t, NAN));
    return t;
}

/* Copy to the device; NULL (an absent optional input) stays NULL. */
static inline dg_tensor *up(dg_ctx *gpu, dg_tensor *t) {
    if (!t)
        return NULL;
    dg_tensor *g = NULL;
    DG_TEST_TRY(dg_to_device(gpu, t, &g));
    return g;
}

/* dg_check_rel on two tensors; returns the error (INFINITY when either side is not finite) so
 * the caller can keep a per-kernel worst-case table. */
static inline double check_rel_tensors(const char *name, const dg_tensor *got,
                                       const dg_tensor *want, double tol) {
    double *g = NULL, *w = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(got, &g));
    DG_TEST_TRY(dg_tensor_to_f64(want, &w));
    const int64_t n = dg_tensor_numel(want);
    double num = 0, den = 0;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(g[i]) || !isfinite(w[i]))
            finite = 0;
        double d = fabs(g[i] - w[i]);
        num = d > num ? d : num;
        den = fabs(w[i]) > den ? fabs(w[i]) : den;
    }
    dg_check_rel(name, g, w, n, tol);
    free(g);
    free(w);
    return finite ? num / (den > 1e-12 ? den : 1e-12) : INFINITY;
}

/* The tables of a test case: B rows of T tokens, or (nseq > 0, B = 1) varlen sequences of
 * lens[0..nseq). cu (room for nseq + 1) and opts must outlive cfg; dd lives on gpu. */
static inline void case_tables(const char *suite, dg_ctx *cpu, dg_ctx *gpu, int64_t B, int64_t T,
                               int H, int HV, int K, int V, int BT, int nseq, const int64_t *lens,
                               dg_dtype dt, int64_t *cu, dg_kda_opts *opts, kda_cfg *cfg,
                               kda_cuda_dims *dd) {
    memset(opts, 0, sizeof *opts);
    opts->chunk_size = BT;
    if (nseq) {
        cu[0] = 0;
        for (int i = 0; i < nseq; i++)
            cu[i + 1] = cu[i] + lens[i];
        opts->cu_seqlens = cu;
        opts->n_seqs = nseq;
    }
    DG_TEST_TRY(dg__kda_cfg_init(suite, cpu, opts, B, T, H, HV, K, V, dt, cfg));
    DG_TEST_TRY(dg__kda_cuda_dims_new(gpu, B * T, H, HV, K, V, BT, cfg->d.N, cfg->d.cu,
                                  cfg->d.chunk_off, dd));
}

#endif

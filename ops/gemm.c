/*
 * ops/gemm.c -- the CPU GEMM (see ops/gemm.h): cache-blocked, packed, OpenMP over row blocks of C.
 * One body serves f64 and f32 (ops/ref_tmpl.h); the register-tile kernel, ops/gemm_micro.h, is
 * instantiated in it once per vector width.
 *
 * Tiles: a GMR x GNR register tile of C (GNR = two 256-bit vectors of the dtype), a GMC x GKC
 * block of A kept in L2, a GKC x GNC panel of B streamed from L3. With GCC/Clang on x86-64 the
 * tile kernel is also compiled for AVX2 and chosen at run time when the CPU has it (about 2x the
 * 128-bit kernel), with bitwise the same results.
 *
 * Blocking in the GotoBLAS manner: for each NC-wide column panel of C and each KC-deep slice of k,
 * B's slice is packed into NR-wide strips ([kc][NR] each, zero padded), then each MC-tall row block
 * of A is packed into MR-tall strips ([kc][MR]) by the thread that owns the row block, and an
 * MR x NR register tile of C is accumulated over the kc slice. The transposes are resolved while
 * packing, so the inner kernel always streams two contiguous arrays.
 */
#ifndef DG_REF_TMPL
#include "gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__)
#define GEMM_HAVE_VEC 1
#define GEMM_UNROLL _Pragma("GCC unroll 16")
#if defined(__x86_64__)
#define GEMM_X86_WIDE 1
#endif
#else
#define GEMM_UNROLL
#endif

#define GMC 96 /* a multiple of both GMR values */
#define GKC 256
#define GNC 2048

#define DG_REF_TMPL "gemm.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
/* The register tile: GNR = two 256-bit vectors of the dtype. */
#if RT_F64
#define GMR 4
#define GNR 8
#else
#define GMR 6
#define GNR 16
#endif

/* A row block [i0, i0+mc) x [p0, p0+kc) of op(A) into MR-tall strips. */
static void RF(pack_a)(const dg_gemm_desc *g, const RT *a, int64_t i0, int64_t mc, int64_t p0,
                       int64_t kc, RT *dst) {
    for (int64_t ir = 0; ir < mc; ir += GMR) {
        int64_t mr = mc - ir < GMR ? mc - ir : GMR;
        RT *d = dst + ir * kc;
        for (int64_t r = 0; r < GMR; r++) {
            if (r >= mr) {
                for (int64_t p = 0; p < kc; p++)
                    d[p * GMR + r] = 0;
                continue;
            }
            int64_t i = i0 + ir + r;
            if (g->trans_a)
                for (int64_t p = 0; p < kc; p++)
                    d[p * GMR + r] = a[(p0 + p) * g->lda + i];
            else
                for (int64_t p = 0; p < kc; p++)
                    d[p * GMR + r] = a[i * g->lda + p0 + p];
        }
    }
}

/* NR-wide strip number `s` of the slice [p0, p0+kc) x [j0, j0+nc) of op(B). */
static void RF(pack_b_strip)(const dg_gemm_desc *g, const RT *b, int64_t p0, int64_t kc, int64_t j0,
                             int64_t nc, int64_t s, RT *dst) {
    int64_t jr = s * GNR;
    int64_t nr = nc - jr < GNR ? nc - jr : GNR;
    RT *d = dst + jr * kc;
    for (int64_t p = 0; p < kc; p++) {
        RT *row = d + p * GNR;
        if (g->trans_b)
            for (int64_t c = 0; c < nr; c++)
                row[c] = b[(j0 + jr + c) * g->ldb + p0 + p];
        else
            for (int64_t c = 0; c < nr; c++)
                row[c] = b[(p0 + p) * g->ldb + j0 + jr + c];
        for (int64_t c = nr; c < GNR; c++)
            row[c] = 0;
    }
}

/* The register-tile kernel, twice: 256-bit vectors (picked at run time where the CPU has AVX2)
 * and 128-bit vectors (any target). Both do the same multiplies and adds in the same order (the
 * build is ISO C: no contraction into FMA), so the result does not depend on which one runs. */
#ifdef GEMM_X86_WIDE
#define GMICRO RF(micro_wide)
#define GVB 32
#define GMICRO_ATTR __attribute__((target("avx2")))
#include "gemm_micro.h"
#endif
#define GMICRO RF(micro_base)
#define GVB 16
#define GMICRO_ATTR
#include "gemm_micro.h"

typedef void (*RF(micro_fn))(int64_t, const RT *, const RT *, RT *, int64_t, int64_t, int64_t, RT,
                             RT, int);

static RF(micro_fn) RF(pick_micro)(void) {
#ifdef GEMM_X86_WIDE
    if (__builtin_cpu_supports("avx2"))
        return RF(micro_wide);
#endif
    return RF(micro_base);
}

/* One batch item, C = alpha op(A) op(B) + beta C, by thread `tid` of `nth`: B strips and row
 * blocks are dealt out cyclically. With nth > 1 every thread of the team calls this and the
 * barriers order packing before use; with nth == 1 it runs alone (no barriers). */
static void RF(gemm_item)(const dg_gemm_desc *g, const RT *A, const RT *B, RT *C,
                          RF(micro_fn) micro, int64_t mc_max, int64_t kc_max, int64_t nc_max,
                          RT *ap, RT *bp, int tid, int nth) {
    const int64_t M = g->m, N = g->n, K = g->k;
    const RT alpha = (RT)g->alpha, beta = (RT)g->beta;
    const int64_t n_iblk = (M + mc_max - 1) / mc_max;
    for (int64_t j0 = 0; j0 < N; j0 += nc_max) {
        int64_t nc = N - j0 < nc_max ? N - j0 : nc_max;
        int64_t n_strips = (nc + GNR - 1) / GNR;
        for (int64_t p0 = 0; p0 < K; p0 += kc_max) {
            int64_t kc = K - p0 < kc_max ? K - p0 : kc_max;
            for (int64_t s = tid; s < n_strips; s += nth)
                RF(pack_b_strip)(g, B, p0, kc, j0, nc, s, bp);
            if (nth > 1) {
#ifdef _OPENMP
#pragma omp barrier
#endif
            }
            for (int64_t ib = tid; ib < n_iblk; ib += nth) {
                int64_t i0 = ib * mc_max;
                int64_t mc = M - i0 < mc_max ? M - i0 : mc_max;
                RF(pack_a)(g, A, i0, mc, p0, kc, ap);
                for (int64_t jr = 0; jr < nc; jr += GNR) {
                    int64_t nr = nc - jr < GNR ? nc - jr : GNR;
                    for (int64_t ir = 0; ir < mc; ir += GMR) {
                        int64_t mr = mc - ir < GMR ? mc - ir : GMR;
                        micro(kc, ap + ir * kc, bp + jr * kc, C + (i0 + ir) * g->ldc + j0 + jr,
                              g->ldc, mr, nr, alpha, beta, p0 == 0);
                    }
                }
            }
            if (nth > 1) { /* bp is repacked next round */
#ifdef _OPENMP
#pragma omp barrier
#endif
            }
        }
    }
}

static RT *RF(alloc_pack)(int64_t elems) {
    return aligned_alloc(64, (size_t)((elems * (int64_t)sizeof(RT) + 63) & ~(int64_t)63));
}

dg_status RF(dg__gemm)(const dg_gemm_desc *g, const RT *a, const RT *b, RT *c) {
    const int64_t M = g->m, N = g->n, K = g->k;
    if (M <= 0 || N <= 0 || g->batch <= 0)
        return DG_OK;
    if (K <= 0) { /* empty sum: C = beta C */
        const RT beta = (RT)g->beta;
        for (int64_t bt = 0; bt < g->batch; bt++)
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) {
                    RT *cp = c + bt * g->stride_c + i * g->ldc + j;
                    *cp = beta == 0 ? 0 : beta * *cp;
                }
        return DG_OK;
    }
    const RF(micro_fn) micro = RF(pick_micro)();
    int nthreads = 1;
#ifdef _OPENMP
    nthreads = omp_get_max_threads();
#endif
    const double work = (double)M * N * K; /* multiply-adds per batch item */
    /* Threads pay off past a few hundred thousand multiply-adds. Many small items: one item per
     * thread at a time (no barriers); otherwise the team shares each item by row blocks. */
    const int par = nthreads > 1 && work * (double)g->batch > 2e5;
    const int by_item = par && g->batch >= nthreads && work < 4e6;
    int64_t mc_max = GMC;
    if (par && !by_item) { /* give every thread a row block when M is small */
        int64_t per = (M + nthreads - 1) / nthreads;
        per = (per + GMR - 1) / GMR * GMR;
        if (per < mc_max)
            mc_max = per;
    }
    const int64_t kc_max = K < GKC ? K : GKC;
    int64_t nc_max = N < GNC ? N : GNC;
    nc_max = (nc_max + GNR - 1) / GNR * GNR;
    const int nbp = by_item ? nthreads : 1; /* B panels: one per thread when items are private */
    RT *bpack = RF(alloc_pack)(nbp * kc_max * nc_max);
    RT *apack = RF(alloc_pack)(nthreads * mc_max * kc_max);
    if (!bpack || !apack) {
        free(bpack);
        free(apack);
        return dg__err(DG_ERR_NOMEM, "gemm: out of host memory for packing buffers");
    }
    if (by_item) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int64_t bt = 0; bt < g->batch; bt++) {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            RF(gemm_item)
            (g, a + bt * g->stride_a, b + bt * g->stride_b, c + bt * g->stride_c, micro, mc_max,
             kc_max, nc_max, apack + (int64_t)tid * mc_max * kc_max,
             bpack + (int64_t)tid * kc_max * nc_max, 0, 1);
        }
    } else {
        (void)par;
#ifdef _OPENMP
#pragma omp parallel if (par)
#endif
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            for (int64_t bt = 0; bt < g->batch; bt++)
                RF(gemm_item)
            (g, a + bt * g->stride_a, b + bt * g->stride_b, c + bt * g->stride_c, micro, mc_max,
             kc_max, nc_max, apack + (int64_t)tid * mc_max * kc_max, bpack, tid, nth);
        }
    }
    free(bpack);
    free(apack);
    return DG_OK;
}

#undef GMR
#undef GNR
#endif

/*
 * tests/test_kda_tc.c -- the tensor-core path of the KDA CUDA kernels (kda_cuda_dims.tc, see
 * kernels/kda/kda_cuda.h) against the CPU f64 raw functions (ops/kda/kda.h): kda_intra_fwd (Aqk,
 * Tm; off-diagonal blocks factorised around a reference row), kda_wy_fwd (W, U,
 * KG, QG), kda_state_fwd (h, E, ht), kda_output_fwd (O), kda_output_bwd (dQG, dh, dAqk, dE),
 * kda_state_bwd (dW, dU, dKG, dG, dh0) and kda_intra_bwd (dq, dk, dbeta, dG from random dAqk
 * and dTm over whole rows, each alone too; off-diagonal 16-row blocks factorised) and kda_wy_bwd
 * (dq, dk, dv, dbeta, dG, dTm; with dW = dKG = NULL and dU = dQG = NULL too), each run
 * with tc = 1 (TF32), tc = 2 (3xTF32) and tc = 0 (the f32 FFMA kernels, printed for contrast),
 * and the ops-layer rule that turns tc on for bf16 activations only.
 *
 * Each stage gets the f32 rounding of the f64 chain's own inputs, so an error points at one
 * kernel; device outputs are poisoned with NaN first, so an element a kernel forgets to write
 * fails. Inputs are never zero: q, k rows L2-normalised, g in [-0.5, -0.01] per step, beta in
 * (0, 1), v, h0 and the upstream gradients uniform in [-1, 1]. Cases: T not a multiple of BT,
 * varlen with odd lengths (1 included), GVA, BT = 16/32/64, K = V = 64, K = V = 128, K = 80 V = 40,
 * K = V = 256 (the state kernel's largest shared memory), two cases with g in [-45, -35] per
 * step (the factorised intra blocks must underflow to zero, never overflow) and one with g in
 * [-7, -0.01] (blocks on both sides of the intra kernels' middle-row limit). cpu mode: nothing to
 * run (CUDA-only suite).
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kda_testutil.h"
#include "kda_cuda_testutil.h"
#include "ops/kda/kda.h"
#ifdef DG_HAVE_CUDA
#include "kernels/kda/kda_cuda.h"
#endif

#ifndef DG_HAVE_CUDA
int main(int argc, char **argv) {
    dg_test_init(argc, argv, "kda_tc");
    return dg_test_skip("CUDA-only suite (built without CUDA)");
}
#else

/* TF32 operands keep 10 mantissa bits (bf16: 8), so each product is off by up to ~2^-11
 * relative per operand; sums of K, V or BT such products and a few chunks of state stay well
 * inside 1e-2 of the largest value -- the accuracy bf16 activations allow anyway. */
#define TOL_TF32 1e-2
/* 3xTF32 (hi*hi + hi*lo + lo*hi) drops only lo*lo (~2^-22 relative) and accumulates in f32:
 * f32-like, with 10x headroom over what the f32 FFMA kernels reach against f64 here. */
#define TOL_3XTF32 1e-4
/* The f32 FFMA kernels (tc = 0) against f64: only printed for contrast, asserted loosely. */
#define TOL_FFMA 1e-4

static const char *mode_name[3] = {"f32 FFMA (tc=0)", "TF32 (tc=1)", "3xTF32 (tc=2)"};
static const double mode_tol[3] = {TOL_FFMA, TOL_TF32, TOL_3XTF32};
#define NKERN 8
static double g_worst[3][NKERN]; /* [mode][kernel] */
static const char *kern_name[NKERN] = {"kda_wy_fwd",     "kda_state_fwd", "kda_output_fwd",
                                       "kda_output_bwd", "kda_state_bwd", "kda_intra_fwd",
                                       "kda_intra_bwd",  "kda_wy_bwd"};

typedef struct tc_case {
    const char *name;
    int64_t B, T;
    int H, HV, K, V, BT;
    int nseq; /* > 0: varlen, B = 1, T = sum of lens */
    int64_t lens[4];
    int use_h0;
    double glo, ghi; /* per-step log decay range; 0, 0: [-0.5, -0.01] */
} tc_case;

/* Host f64 array of n with the device buffer holding its f32 rounding. */
typedef struct buf {
    double *x;
    dg_tensor *d;
    int64_t n;
} buf;

static buf mkbuf(int64_t n) {
    buf b;
    b.x = kt_alloc(n);
    b.d = NULL;
    b.n = n;
    return b;
}

static void upload(dg_ctx *gpu, buf *b) {
    int64_t s[1] = {b->n};
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_F32, 1, s, b->x, &b->d));
}

static void free_buf(buf *b) {
    free(b->x);
    b->x = NULL;
    dg_tensor_free(&b->d);
}

/* A flat f32 device buffer of n elements filled with NaN. */
static dg_tensor *poisoned_n(dg_ctx *gpu, int64_t n) {
    int64_t s[1] = {n};
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F32, 1, s, &t));
    DG_TEST_TRY(dg_tensor_fill_(t, NAN));
    return t;
}

/* Norm-relative check of a device result against the f64 reference; tracks the worst error. */
static void cmp_floor(int mode, int kern, const char *cname, const char *what, const dg_tensor *got,
                      const double *want, int64_t n, double floor);
static void cmp(int mode, int kern, const char *cname, const char *what, const dg_tensor *got,
                const double *want, int64_t n) {
    cmp_floor(mode, kern, cname, what, got, want, n, 0.0);
}

static double max_abs(const double *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* As cmp, with the error measured against at least `floor`: for a result that is a difference
 * of larger terms (the intra dG = q.Rq + k.Rk - k.C), the f32 kernels round at the size of the
 * terms, not of what is left after they cancel (with steep gates dG cancels to ~1e-17 exactly,
 * the diagonal terms q dA k - k dA q). */
static void cmp_host(int mode, int kern, const char *cname, const char *what, double *g,
                     const double *want, int64_t n, double floor);
static void cmp_floor(int mode, int kern, const char *cname, const char *what, const dg_tensor *got,
                      const double *want, int64_t n, double floor) {
    double *g = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(got, &g));
    cmp_host(mode, kern, cname, what, g, want, n, floor);
}

/* The accumulating mode (acc): got started from the device rounding of pre; what the kernel
 * added is got - pre, compared like cmp_floor. */
static void cmp_added(int mode, int kern, const char *cname, const char *what, const dg_tensor *got,
                      const dg_tensor *pre, const double *want, int64_t n, double floor) {
    double *g = NULL, *p0 = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(got, &g));
    DG_TEST_TRY(dg_tensor_to_f64(pre, &p0));
    for (int64_t i = 0; i < n; i++)
        g[i] -= p0[i];
    free(p0);
    cmp_host(mode, kern, cname, what, g, want, n, floor);
}

/* A device f32 copy of a random start value per element for the acc mode, in [-s, s] with s
 * half the largest expected addition (like accumulating gradients of similar size; far larger
 * start values would swallow what is added below their own f32 rounding). */
static dg_tensor *start_values(dg_ctx *gpu, int64_t n, uint64_t seed, const double *want) {
    if (n < 1 || n > ((int64_t)1 << 40)) {
        fprintf(stderr, "FATAL: start_values: bad size %lld\n", (long long)n);
        exit(1);
    }
    double amp = 0;
    for (int64_t i = 0; i < n; i++)
        amp = fmax(amp, fabs(want[i]));
    amp = amp > 0 ? 0.5 * amp : 1e-30;
    double *x = kt_rand(n, seed, -amp, amp);
    int64_t shape[1] = {n};
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(gpu, DG_F32, 1, shape, x, &t));
    free(x);
    return t;
}

static void cmp_host(int mode, int kern, const char *cname, const char *what, double *g,
                     const double *want, int64_t n, double floor) {
    double num = 0, den = floor;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(g[i]))
            finite = 0;
        num = fmax(num, fabs(g[i] - want[i]));
        den = fmax(den, fabs(want[i]));
    }
    const double rel = finite ? num / (den > 1e-12 ? den : 1e-12) : INFINITY;
    g_worst[mode][kern] = fmax(g_worst[mode][kern], rel);
    char name[200];
    snprintf(name, sizeof name, "%s | %s %s %s", cname, mode_name[mode], kern_name[kern], what);
    if (floor > 0)
        dg_check(rel <= mode_tol[mode], "%s: rel err %.3e against max(max|want|, %.3e) (tol %g)",
                 name, rel, floor, mode_tol[mode]);
    else
        dg_check_rel(name, g, want, n, mode_tol[mode]);
    free(g);
}

static void run_case(dg_ctx *cpu, dg_ctx *gpu, const tc_case *c, uint64_t seed) {
    int64_t cu[5];
    dg_kda_opts opts;
    kda_cfg cfg;
    kda_cuda_dims dd;
    case_tables("test_kda_tc", cpu, gpu, c->B, c->T, c->H, c->HV, c->K, c->V, c->BT, c->nseq,
                c->lens, DG_F64, cu, &opts, &cfg, &dd);
    const kda_dims *d = &cfg.d;
    const int64_t TT = c->B * c->T, NC = kda_cfg_nc(&cfg);
    const int N = d->N, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    const double scale = 1.0 / sqrt((double)K);
    dg_check(dd.tc == 0, "%s: dg__kda_cuda_dims_new leaves tc = 0", c->name);
    printf("-- case: %s (TT=%lld N=%d NC=%lld H=%d HV=%d K=%d V=%d BT=%d, h0 %s)\n", c->name,
           (long long)TT, N, (long long)NC, H, HV, K, V, BT, c->use_h0 ? "random" : "NULL");

    /* ---- the f64 chain on the CPU */
    const int64_t nqk = TT * H * K, nv = TT * HV * V, nk = TT * HV * K, nb = TT * HV;
    const int64_t na = TT * HV * BT, nh = NC * HV * K * V, n0 = (int64_t)N * HV * K * V;
    buf q = mkbuf(nqk), k = mkbuf(nqk), v = mkbuf(nv), beta = mkbuf(nb), G = mkbuf(nk);
    buf Aqk = mkbuf(na), Tm = mkbuf(na), W = mkbuf(nk), U = mkbuf(nv), KG = mkbuf(nk);
    buf QG = mkbuf(nk), h = mkbuf(nh), E = mkbuf(nv), ht = mkbuf(n0), O = mkbuf(nv);
    buf h0 = mkbuf(n0), dO = mkbuf(nv), dQG = mkbuf(nk), dh = mkbuf(nh), dAqk = mkbuf(na);
    buf dE = mkbuf(nv), uh = mkbuf(nh), uE = mkbuf(nv), uht = mkbuf(n0), dW = mkbuf(nk);
    buf dU = mkbuf(nv), dKG = mkbuf(nk), dG = mkbuf(nk), dh0 = mkbuf(n0);
    /* intra backward: upstream dAqk, dTm random over whole rows (only the lower triangle may be
     * read), and the f64 gradients of q, k, beta, G, with dAqk alone and dTm alone too */
    buf uA = mkbuf(na), uT = mkbuf(na), iq[3], ik[3], ib[3], iG[3];
    /* wy backward: upstream dW, dU, dKG, dQG random; gradients with all four, with dW = dKG =
     * NULL and with dU = dQG = NULL */
    buf uW = mkbuf(nk), uU = mkbuf(nv), uKG = mkbuf(nk), uQG = mkbuf(nk), wq[3], wk[3], wv[3],
        wb[3], wG[3], wT[3];
    for (int u = 0; u < 3; u++) {
        wq[u] = mkbuf(nqk);
        wk[u] = mkbuf(nqk);
        wv[u] = mkbuf(nv);
        wb[u] = mkbuf(nb);
        wG[u] = mkbuf(nk);
        wT[u] = mkbuf(na);
        iq[u] = mkbuf(nqk);
        ik[u] = mkbuf(nqk);
        ib[u] = mkbuf(nb);
        iG[u] = mkbuf(nk);
    }
    {
        double *qraw = kt_rand(nqk, seed + 1, -1, 1), *kraw = kt_rand(nqk, seed + 2, -1, 1);
        double *g =
            c->glo < 0 ? kt_rand(nk, seed + 4, c->glo, c->ghi) : kt_rand(nk, seed + 4, -0.5, -0.01);
        double *rv = kt_rand(nv, seed + 3, -1, 1), *rb = kt_rand(nb, seed + 5, 0.02, 0.98);
        double *r0 = kt_rand(n0, seed + 6, -1, 1), *rdo = kt_rand(nv, seed + 7, -1, 1);
        double *ruh = kt_rand(nh, seed + 8, -1, 1), *ruE = kt_rand(nv, seed + 9, -1, 1);
        double *ruht = kt_rand(n0, seed + 10, -1, 1);
        double *ruA = kt_rand(na, seed + 11, -1, 1), *ruT = kt_rand(na, seed + 12, -1, 1);
        double *r1 = kt_rand(nk, seed + 13, -1, 1), *r2 = kt_rand(nv, seed + 14, -1, 1);
        double *r3 = kt_rand(nk, seed + 15, -1, 1), *r4 = kt_rand(nk, seed + 16, -1, 1);
        memcpy(uW.x, r1, sizeof(double) * (size_t)nk);
        memcpy(uU.x, r2, sizeof(double) * (size_t)nv);
        memcpy(uKG.x, r3, sizeof(double) * (size_t)nk);
        memcpy(uQG.x, r4, sizeof(double) * (size_t)nk);
        free(r1);
        free(r2);
        free(r3);
        free(r4);
        memcpy(uA.x, ruA, sizeof(double) * (size_t)na);
        memcpy(uT.x, ruT, sizeof(double) * (size_t)na);
        free(ruA);
        free(ruT);
        memcpy(uh.x, ruh, sizeof(double) * (size_t)nh);
        memcpy(uE.x, ruE, sizeof(double) * (size_t)nv);
        memcpy(uht.x, ruht, sizeof(double) * (size_t)n0);
        free(ruh);
        free(ruE);
        free(ruht);
        dg__kda_l2norm_fwd_f64(TT * H, K, qraw, q.x, NULL);
        dg__kda_l2norm_fwd_f64(TT * H, K, kraw, k.x, NULL);
        memcpy(v.x, rv, sizeof(double) * (size_t)nv);
        memcpy(beta.x, rb, sizeof(double) * (size_t)nb);
        memcpy(h0.x, r0, sizeof(double) * (size_t)n0);
        memcpy(dO.x, rdo, sizeof(double) * (size_t)nv);
        dg__kda_gate_fwd_f64(d, DG_GATE_NONE, 0.0, 1, g, NULL, NULL, G.x);
        free(qraw);
        free(kraw);
        free(g);
        free(rv);
        free(rb);
        free(r0);
        free(rdo);
    }
    const double *h0x = c->use_h0 ? h0.x : NULL;
    DG_TEST_TRY(dg__kda_intra_fwd_f64(d, scale, q.x, k.x, beta.x, G.x, Aqk.x, Tm.x));
    DG_TEST_TRY(dg__kda_wy_fwd_f64(d, q.x, k.x, v.x, beta.x, G.x, Tm.x, W.x, U.x, KG.x, QG.x));
    DG_TEST_TRY(dg__kda_state_fwd_f64(d, W.x, U.x, KG.x, G.x, h0x, h.x, E.x, ht.x));
    dg__kda_output_fwd_f64(d, scale, QG.x, h.x, Aqk.x, E.x, O.x);
    dg__kda_output_bwd_f64(d, scale, QG.x, h.x, Aqk.x, E.x, dO.x, dQG.x, dh.x, dAqk.x, dE.x);
    DG_TEST_TRY(dg__kda_state_bwd_f64(d, W.x, KG.x, G.x, h.x, E.x, uh.x, uE.x, uht.x, dW.x, dU.x,
                                      dKG.x, dG.x, dh0.x));
    for (int u = 0; u < 3; u++) /* 0: both upstream gradients, 1: dAqk only, 2: dTm only */
        DG_TEST_TRY(dg__kda_intra_bwd_f64(d, scale, q.x, k.x, beta.x, G.x, Tm.x,
                                          u == 2 ? NULL : uA.x, u == 1 ? NULL : uT.x, iq[u].x,
                                          ik[u].x, ib[u].x, iG[u].x));
    for (int u = 0; u < 3; u++) /* 0: all four, 1: dW = dKG = NULL, 2: dU = dQG = NULL */
        DG_TEST_TRY(dg__kda_wy_bwd_f64(d, q.x, k.x, v.x, beta.x, G.x, Tm.x, u == 1 ? NULL : uW.x,
                                       u == 2 ? NULL : uU.x, u == 1 ? NULL : uKG.x,
                                       u == 2 ? NULL : uQG.x, wq[u].x, wk[u].x, wv[u].x, wb[u].x,
                                       wG[u].x, wT[u].x));
    buf *ins[] = {&q, &k,  &v,  &beta, &G,  &Tm,  &Aqk, &W,  &U,  &KG, &QG,  &h,
                  &E, &h0, &dO, &uh,   &uE, &uht, &uA,  &uT, &uW, &uU, &uKG, &uQG};
    /* The device Aqk carries garbage above the diagonal (the kernels read j <= i only); the
     * host copy, which the intra output is compared with, is restored after the upload. */
    double *aqk_keep = malloc(sizeof(double) * (size_t)na);
    if (!aqk_keep) {
        fprintf(stderr, "FATAL: no host memory for the Aqk copy\n");
        exit(1);
    }
    memcpy(aqk_keep, Aqk.x, sizeof(double) * (size_t)na);
    for (int64_t ci = 0; ci < NC; ci++) {
        const kda_chunk chk = kda_chunk_idx(d, ci);
        for (int r = 0; r < chk.L; r++)
            for (int hv = 0; hv < HV; hv++)
                for (int j = r + 1; j < BT; j++)
                    Aqk.x[((chk.t0 + r) * HV + hv) * BT + j] = 1e3 + j;
    }
    for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
        upload(gpu, ins[i]);
    memcpy(Aqk.x, aqk_keep, sizeof(double) * (size_t)na);
    free(aqk_keep);
    const float *h0d = c->use_h0 ? F(h0.d) : NULL;

    static const int modes[3] = {1, 2, 0};
    for (int mi = 0; mi < 3; mi++) {
        const int m = modes[mi];
        dd.tc = m;
        dg_tensor *o1, *o2, *o3, *o4;
        /* intra */
        o1 = poisoned_n(gpu, na);
        o2 = poisoned_n(gpu, na);
        dg_check_ok(dg__kda_intra_fwd_cuda(gpu, &dd, (float)scale, F(q.d), F(k.d), F(beta.d),
                                           F(G.d), F(o1), F(o2)),
                    "intra launch");
        cmp(m, 5, c->name, "Aqk", o1, Aqk.x, na);
        cmp(m, 5, c->name, "Tm", o2, Tm.x, na);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        /* wy: all four outputs, then W alone and U alone (NULL outputs are skipped) */
        o1 = poisoned_n(gpu, nk);
        o2 = poisoned_n(gpu, nv);
        o3 = poisoned_n(gpu, nk);
        o4 = poisoned_n(gpu, nk);
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &dd, F(q.d), F(k.d), F(v.d), F(beta.d), F(G.d),
                                        F(Tm.d), F(o1), F(o2), F(o3), F(o4)),
                    "wy launch");
        cmp(m, 0, c->name, "W", o1, W.x, nk);
        cmp(m, 0, c->name, "U", o2, U.x, nv);
        cmp(m, 0, c->name, "KG", o3, KG.x, nk);
        cmp(m, 0, c->name, "QG", o4, QG.x, nk);
        DG_TEST_TRY(dg_tensor_fill_(o1, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &dd, NULL, F(k.d), NULL, F(beta.d), F(G.d), F(Tm.d),
                                        F(o1), NULL, NULL, NULL),
                    "wy launch (W only)");
        dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &dd, NULL, NULL, F(v.d), F(beta.d), F(G.d), F(Tm.d),
                                        NULL, F(o2), NULL, NULL),
                    "wy launch (U only)");
        cmp(m, 0, c->name, "W (alone)", o1, W.x, nk);
        cmp(m, 0, c->name, "U (alone)", o2, U.x, nv);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        dg_tensor_free(&o3);
        dg_tensor_free(&o4);

        /* state, with and without ht */
        o1 = poisoned_n(gpu, nh);
        o2 = poisoned_n(gpu, nv);
        o3 = poisoned_n(gpu, n0);
        dg_check_ok(dg__kda_state_fwd_cuda(gpu, &dd, F(W.d), F(U.d), F(KG.d), F(G.d), h0d, F(o1),
                                           F(o2), F(o3)),
                    "state launch");
        cmp(m, 1, c->name, "h", o1, h.x, nh);
        cmp(m, 1, c->name, "E", o2, E.x, nv);
        cmp(m, 1, c->name, "ht", o3, ht.x, n0);
        DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
        dg_check_ok(dg__kda_state_fwd_cuda(gpu, &dd, F(W.d), F(U.d), F(KG.d), F(G.d), h0d, F(o1),
                                           F(o2), NULL),
                    "state launch (no ht)");
        cmp(m, 1, c->name, "E (no ht)", o2, E.x, nv);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        dg_tensor_free(&o3);

        /* output forward */
        o1 = poisoned_n(gpu, nv);
        dg_check_ok(dg__kda_output_fwd_cuda(gpu, &dd, (float)scale, F(QG.d), F(h.d), F(Aqk.d),
                                            F(E.d), F(o1)),
                    "output launch");
        cmp(m, 2, c->name, "O", o1, O.x, nv);
        dg_tensor_free(&o1);

        /* output backward: all four, then each alone */
        o1 = poisoned_n(gpu, nk);
        o2 = poisoned_n(gpu, nh);
        o3 = poisoned_n(gpu, na);
        o4 = poisoned_n(gpu, nv);
        dg_check_ok(dg__kda_output_bwd_cuda(gpu, &dd, (float)scale, F(QG.d), F(h.d), F(Aqk.d),
                                            F(E.d), F(dO.d), F(o1), F(o2), F(o3), F(o4)),
                    "output bwd launch");
        cmp(m, 3, c->name, "dQG", o1, dQG.x, nk);
        cmp(m, 3, c->name, "dh", o2, dh.x, nh);
        cmp(m, 3, c->name, "dAqk", o3, dAqk.x, na);
        cmp(m, 3, c->name, "dE", o4, dE.x, nv);
        DG_TEST_TRY(dg_tensor_fill_(o3, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o4, NAN));
        dg_check_ok(dg__kda_output_bwd_cuda(gpu, &dd, (float)scale, F(QG.d), F(h.d), F(Aqk.d),
                                            F(E.d), F(dO.d), NULL, NULL, F(o3), NULL),
                    "output bwd launch (dAqk only)");
        dg_check_ok(dg__kda_output_bwd_cuda(gpu, &dd, (float)scale, F(QG.d), F(h.d), F(Aqk.d),
                                            F(E.d), F(dO.d), NULL, NULL, NULL, F(o4)),
                    "output bwd launch (dE only)");
        cmp(m, 3, c->name, "dAqk (alone)", o3, dAqk.x, na);
        cmp(m, 3, c->name, "dE (alone)", o4, dE.x, nv);
        dg_tensor_free(&o1);
        dg_tensor_free(&o2);
        dg_tensor_free(&o3);
        dg_tensor_free(&o4);

        /* state backward: every output, then dU + dh0 only (no chunk-parallel part), then dW
         * alone (dE_tot in scratch) and dKG + dG alone */
        dg_tensor *o5;
        o1 = poisoned_n(gpu, nk);
        o2 = poisoned_n(gpu, nv);
        o3 = poisoned_n(gpu, nk);
        o4 = poisoned_n(gpu, nk);
        o5 = poisoned_n(gpu, n0);
        dg_check_ok(dg__kda_state_bwd_cuda(gpu, &dd, F(W.d), F(KG.d), F(G.d), F(h.d), F(E.d),
                                           F(uh.d), F(uE.d), F(uht.d), F(o1), F(o2), F(o3), F(o4),
                                           F(o5)),
                    "state bwd launch");
        cmp(m, 4, c->name, "dW", o1, dW.x, nk);
        cmp(m, 4, c->name, "dU", o2, dU.x, nv);
        cmp(m, 4, c->name, "dKG", o3, dKG.x, nk);
        cmp(m, 4, c->name, "dG", o4, dG.x, nk);
        cmp(m, 4, c->name, "dh0", o5, dh0.x, n0);
        DG_TEST_TRY(dg_tensor_fill_(o1, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o3, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o4, NAN));
        DG_TEST_TRY(dg_tensor_fill_(o5, NAN));
        dg_check_ok(dg__kda_state_bwd_cuda(gpu, &dd, F(W.d), F(KG.d), F(G.d), F(h.d), F(E.d),
                                           F(uh.d), F(uE.d), F(uht.d), NULL, F(o2), NULL, NULL,
                                           F(o5)),
                    "state bwd launch (dU, dh0)");
        dg_check_ok(dg__kda_state_bwd_cuda(gpu, &dd, F(W.d), F(KG.d), F(G.d), F(h.d), F(E.d),
                                           F(uh.d), F(uE.d), F(uht.d), F(o1), NULL, NULL, NULL,
                                           NULL),
                    "state bwd launch (dW)");
        dg_check_ok(dg__kda_state_bwd_cuda(gpu, &dd, F(W.d), F(KG.d), F(G.d), F(h.d), F(E.d),
                                           F(uh.d), F(uE.d), F(uht.d), NULL, NULL, F(o3), F(o4),
                                           NULL),
                    "state bwd launch (dKG, dG)");
        cmp(m, 4, c->name, "dU (with dh0 only)", o2, dU.x, nv);
        cmp(m, 4, c->name, "dh0 (with dU only)", o5, dh0.x, n0);
        cmp(m, 4, c->name, "dW (alone)", o1, dW.x, nk);
        cmp(m, 4, c->name, "dKG (with dG)", o3, dKG.x, nk);
        cmp(m, 4, c->name, "dG (with dKG)", o4, dG.x, nk);
        dg_tensor *os[5] = {o1, o2, o3, o4, o5};
        for (int i = 0; i < 5; i++)
            dg_tensor_free(&os[i]);

        /* intra backward: both upstream gradients, each alone, and dG not wanted */
        static const char *itag[3] = {"", " (dTm NULL)", " (dAqk NULL)"};
        for (int u = 0; u < 3; u++) {
            o1 = poisoned_n(gpu, nqk);
            o2 = poisoned_n(gpu, nqk);
            o3 = poisoned_n(gpu, nb);
            o4 = poisoned_n(gpu, nk);
            dg_check_ok(dg__kda_intra_bwd_cuda(gpu, &dd, (float)scale, F(q.d), F(k.d), F(beta.d),
                                               F(G.d), F(Tm.d), u == 2 ? NULL : F(uA.d),
                                               u == 1 ? NULL : F(uT.d), F(o1), F(o2), F(o3), F(o4),
                                               0),
                        "intra bwd launch");
            char what[64];
            snprintf(what, sizeof what, "dq%s", itag[u]);
            cmp(m, 6, c->name, what, o1, iq[u].x, nqk);
            snprintf(what, sizeof what, "dk%s", itag[u]);
            cmp(m, 6, c->name, what, o2, ik[u].x, nqk);
            snprintf(what, sizeof what, "dbeta%s", itag[u]);
            cmp(m, 6, c->name, what, o3, ib[u].x, nb);
            snprintf(what, sizeof what, "dG%s", itag[u]);
            cmp_floor(m, 6, c->name, what, o4, iG[u].x, nk,
                      max_abs(q.x, nqk) * max_abs(iq[u].x, nqk) +
                          max_abs(k.x, nqk) * max_abs(ik[u].x, nqk));
            if (u == 0) {
                DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
                dg_check_ok(dg__kda_intra_bwd_cuda(gpu, &dd, (float)scale, F(q.d), F(k.d),
                                                   F(beta.d), F(G.d), F(Tm.d), F(uA.d), F(uT.d),
                                                   NULL, F(o2), NULL, NULL, 0),
                            "intra bwd launch (dk only)");
                cmp(m, 6, c->name, "dk (alone)", o2, ik[0].x, nqk);
                /* acc: dq, dk, dG added to start values */
                dg_tensor *p1 = start_values(gpu, nqk, seed + 21, iq[0].x);
                dg_tensor *p2 = start_values(gpu, nqk, seed + 22, ik[0].x);
                dg_tensor *p4 = start_values(gpu, nk, seed + 23, iG[0].x);
                DG_TEST_TRY(dg_tensor_copy_(o1, p1));
                DG_TEST_TRY(dg_tensor_copy_(o2, p2));
                DG_TEST_TRY(dg_tensor_copy_(o4, p4));
                dg_check_ok(dg__kda_intra_bwd_cuda(gpu, &dd, (float)scale, F(q.d), F(k.d),
                                                   F(beta.d), F(G.d), F(Tm.d), F(uA.d), F(uT.d),
                                                   F(o1), F(o2), F(o3), F(o4),
                                                   KDA_ACC_DQ | KDA_ACC_DK | KDA_ACC_DG),
                            "intra bwd launch (acc)");
                cmp_added(m, 6, c->name, "dq (acc)", o1, p1, iq[0].x, nqk, 0.0);
                cmp_added(m, 6, c->name, "dk (acc)", o2, p2, ik[0].x, nqk, 0.0);
                cmp(m, 6, c->name, "dbeta (with acc)", o3, ib[0].x, nb);
                cmp_added(m, 6, c->name, "dG (acc)", o4, p4, iG[0].x, nk,
                          max_abs(q.x, nqk) * max_abs(iq[0].x, nqk) +
                              max_abs(k.x, nqk) * max_abs(ik[0].x, nqk));
                dg_tensor_free(&p1);
                dg_tensor_free(&p2);
                dg_tensor_free(&p4);
            }
            dg_tensor *io[4] = {o1, o2, o3, o4};
            for (int i = 0; i < 4; i++)
                dg_tensor_free(&io[i]);
        }

        /* wy backward: all upstream gradients, then dW = dKG = NULL, then dU = dQG = NULL */
        static const char *wtag[3] = {"", " (dW,dKG NULL)", " (dU,dQG NULL)"};
        for (int u = 0; u < 3; u++) {
            const int64_t wn[6] = {nqk, nqk, nv, nb, nk, na};
            static const char *wname[6] = {"dq", "dk", "dv", "dbeta", "dG", "dTm"};
            buf *want[6] = {&wq[u], &wk[u], &wv[u], &wb[u], &wG[u], &wT[u]};
            dg_tensor *wo[6];
            for (int i = 0; i < 6; i++)
                wo[i] = poisoned_n(gpu, wn[i]);
            dg_check_ok(dg__kda_wy_bwd_cuda(gpu, &dd, F(q.d), F(k.d), F(v.d), F(beta.d), F(G.d),
                                            F(Tm.d), u == 1 ? NULL : F(uW.d),
                                            u == 2 ? NULL : F(uU.d), u == 1 ? NULL : F(uKG.d),
                                            u == 2 ? NULL : F(uQG.d), F(wo[0]), F(wo[1]), F(wo[2]),
                                            F(wo[3]), F(wo[4]), F(wo[5]), 0),
                        "wy bwd launch");
            for (int i = 0; i < 6; i++) {
                char what[64];
                snprintf(what, sizeof what, "%s%s", wname[i], wtag[u]);
                if (i == 4) /* dG = q dQG gamma - k a + X dX: a difference of such terms */
                    cmp_floor(m, 7, c->name, what, wo[i], want[i]->x, wn[i],
                              max_abs(q.x, nqk) * max_abs(wq[u].x, nqk) +
                                  max_abs(k.x, nqk) * max_abs(wk[u].x, nqk));
                else
                    cmp(m, 7, c->name, what, wo[i], want[i]->x, wn[i]);
            }
            if (u == 0) { /* acc: dq, dk, dG added to start values */
                const int ai[3] = {0, 1, 4};
                dg_tensor *pre[3];
                for (int a = 0; a < 3; a++) {
                    pre[a] = start_values(gpu, wn[ai[a]], seed + 31 + (uint64_t)a, want[ai[a]]->x);
                    DG_TEST_TRY(dg_tensor_copy_(wo[ai[a]], pre[a]));
                }
                dg_check_ok(dg__kda_wy_bwd_cuda(gpu, &dd, F(q.d), F(k.d), F(v.d), F(beta.d), F(G.d),
                                                F(Tm.d), F(uW.d), F(uU.d), F(uKG.d), F(uQG.d),
                                                F(wo[0]), F(wo[1]), F(wo[2]), F(wo[3]), F(wo[4]),
                                                F(wo[5]), KDA_ACC_DQ | KDA_ACC_DK | KDA_ACC_DG),
                            "wy bwd launch (acc)");
                for (int a = 0; a < 3; a++) {
                    char what[64];
                    snprintf(what, sizeof what, "%s (acc)", wname[ai[a]]);
                    cmp_added(m, 7, c->name, what, wo[ai[a]], pre[a], want[ai[a]]->x, wn[ai[a]],
                              ai[a] == 4 ? max_abs(q.x, nqk) * max_abs(wq[u].x, nqk) +
                                               max_abs(k.x, nqk) * max_abs(wk[u].x, nqk)
                                         : 0.0);
                    dg_tensor_free(&pre[a]);
                }
                cmp(m, 7, c->name, "dv (with acc)", wo[2], want[2]->x, wn[2]);
                cmp(m, 7, c->name, "dTm (with acc)", wo[5], want[5]->x, wn[5]);
            }
            for (int i = 0; i < 6; i++)
                dg_tensor_free(&wo[i]);
        }
    }

    buf *all[] = {&q,  &k,  &v,   &beta, &G,    &Aqk, &Tm, &W,  &U,   &KG, &QG, &h,   &E,  &ht, &O,
                  &h0, &dO, &dQG, &dh,   &dAqk, &dE,  &uh, &uE, &uht, &dW, &dU, &dKG, &dG, &dh0};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free_buf(all[i]);
    free_buf(&uA);
    free_buf(&uT);
    free_buf(&uW);
    free_buf(&uU);
    free_buf(&uKG);
    free_buf(&uQG);
    for (int u = 0; u < 3; u++) {
        free_buf(&wq[u]);
        free_buf(&wk[u]);
        free_buf(&wv[u]);
        free_buf(&wb[u]);
        free_buf(&wG[u]);
        free_buf(&wT[u]);
        free_buf(&iq[u]);
        free_buf(&ik[u]);
        free_buf(&ib[u]);
        free_buf(&iG[u]);
    }
    dg__kda_cuda_dims_free(gpu, &dd);
    dg__kda_cfg_free(&cfg);
}

/* The ops-layer rule: tc follows bf16 activations (and opts.tensor_cores), stays 0 for f32, and
 * the stages sharing a composite's tables inherit it; a bad tensor_cores is refused. */
static void test_rule(dg_ctx *gpu) {
    printf("-- ops-layer rule\n");
    dg_kda_opts opts;
    memset(&opts, 0, sizeof opts);
    static const dg_kda_tc modes[3] = {DG_KDA_TC_DEFAULT, DG_KDA_TC_OFF, DG_KDA_TC_3XTF32};
    static const int want[3] = {1, 0, 2};
    for (int i = 0; i < 3; i++) {
        opts.tensor_cores = modes[i];
        kda_cfg c;
        DG_TEST_TRY(dg__kda_cfg_init("test_kda_tc", gpu, &opts, 2, 70, 2, 2, 64, 64, DG_BF16, &c));
        dg_check(c.tc == want[i], "bf16 entry point, tensor_cores %d: tc = %d (want %d)",
                 (int)modes[i], c.tc, want[i]);
        dg__kda_cfg_free(&c);
    }
    opts.tensor_cores = (dg_kda_tc)7;
    {
        kda_cfg c;
        dg_check_err(dg__kda_cfg_init("test_kda_tc", gpu, &opts, 2, 70, 2, 2, 64, 64, DG_BF16, &c),
                     DG_ERR_ARG, "tensor_cores", "tensor_cores out of range");
    }
    opts.tensor_cores = DG_KDA_TC_DEFAULT;
    kda_cfg cb, cf, cs;
    DG_TEST_TRY(dg__kda_cfg_init("test_kda_tc", gpu, &opts, 2, 70, 2, 2, 64, 64, DG_BF16, &cb));
    DG_TEST_TRY(dg__kda_cfg_dev("test_kda_tc", gpu, &cb, NULL));
    DG_TEST_TRY(dg__kda_cfg_init("test_kda_tc", gpu, &opts, 2, 70, 2, 2, 64, 64, DG_F32, &cf));
    DG_TEST_TRY(dg__kda_cfg_dev("test_kda_tc", gpu, &cf, NULL));
    /* an f32 stage (like state, fed f32 intermediates) sharing the bf16 composite's tables */
    DG_TEST_TRY(dg__kda_cfg_init("test_kda_tc", gpu, &opts, 2, 70, 2, 2, 64, 64, DG_F32, &cs));
    DG_TEST_TRY(dg__kda_cfg_dev("test_kda_tc", gpu, &cs, cb.dev));
    dg_check(cb.cd.tc == 1, "bf16 entry point: tc = %d (want 1)", cb.cd.tc);
    dg_check(cf.cd.tc == 0, "f32 entry point: tc = %d (want 0)", cf.cd.tc);
    dg_check(cs.cd.tc == cb.cd.tc, "f32 stage sharing a bf16 composite's tables: tc = %d (want %d)",
             cs.cd.tc, cb.cd.tc);
    dg__kda_cfg_free(&cs);
    dg__kda_cfg_free(&cf);
    dg__kda_cfg_free(&cb);
}

int main(int argc, char **argv) {
    int gpu_mode = dg_test_init(argc, argv, "kda_tc");
    if (!gpu_mode)
        return dg_test_skip("CUDA-only suite");
    int skip = dg_test_need_gpu();
    if (skip)
        return skip;
    dg_ctx *cpu = NULL, *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    const tc_case cases[] = {
        {"B=2 T=100 BT=64 K=V=64", 2, 100, 2, 2, 64, 64, 64, 0, {0}, 1, 0, 0},
        {"B=2 T=75 BT=16 GVA K=V=64 no h0", 2, 75, 1, 2, 64, 64, 16, 0, {0}, 0, 0, 0},
        {"varlen 37/64/91 BT=32 GVA K=V=128", 1, 192, 2, 4, 128, 128, 32, 3, {37, 64, 91}, 1, 0, 0},
        {"B=1 T=150 BT=64 K=V=128", 1, 150, 2, 2, 128, 128, 64, 0, {0}, 1, 0, 0},
        {"B=2 T=53 BT=16 K=80 V=40", 2, 53, 2, 2, 80, 40, 16, 0, {0}, 1, 0, 0},
        {"varlen 1/33/20 BT=32 GVA K=80 V=40", 1, 54, 1, 3, 80, 40, 32, 3, {1, 33, 20}, 1, 0, 0},
        {"varlen 7/70 BT=64 GVA K=80 V=40 no h0", 1, 77, 1, 2, 80, 40, 64, 2, {7, 70}, 0, 0, 0},
        {"B=1 T=45 BT=32 K=V=256", 1, 45, 1, 2, 256, 256, 32, 0, {0}, 1, 0, 0},
        {"B=1 T=130 BT=64 K=V=256", 1, 130, 1, 1, 256, 256, 64, 0, {0}, 1, 0, 0},
        {"B=2 T=70 BT=32 gates -45..-35/step", 2, 70, 2, 2, 64, 64, 32, 0, {0}, 1, -45, -35},
        /* blocks on both sides of the intra kernels' middle-row limit (MID_SPAN = 40): some
         * blocks / key tiles factorised, others exact, within one chunk */
        {"B=2 T=90 BT=64 K=V=128 gates -7..-0.01/step (mixed)",
         2,
         90,
         2,
         2,
         128,
         128,
         64,
         0,
         {0},
         1,
         -7,
         -0.01},
        {"varlen 1/64/20 BT=64 GVA gates -45..-35/step",
         1,
         85,
         1,
         2,
         64,
         64,
         64,
         3,
         {1, 64, 20},
         0,
         -45,
         -35},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(cpu, gpu, &cases[i], 7000 * (uint64_t)(i + 1));
    test_rule(gpu);

    printf("-- largest norm-relative error vs f64 per kernel and mode\n");
    printf("   %-16s %16s %16s %16s\n", "kernel", mode_name[0], mode_name[1], mode_name[2]);
    for (int f = 0; f < NKERN; f++)
        printf("   %-16s %16.3e %16.3e %16.3e\n", kern_name[f], g_worst[0][f], g_worst[1][f],
               g_worst[2][f]);
    dg_ctx_free(&gpu);
    dg_ctx_free(&cpu);
    return dg_test_finish();
}
#endif

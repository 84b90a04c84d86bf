/*
 * tests/test_kda_cuda_bwd.c -- the CUDA backward kernels of KDA (kernels/kda/) against the CPU
 * f32 raw reference functions (ops/kda/kda.h), function by function: l2norm, beta, gate
 * (+ reverse chunk cumsum, dA_log, ddt_bias), intra (dq, dk, dbeta, dG), wy (dq, dk, dv, dbeta,
 * dG, dTm), state (dW, dU, dKG, dG, dh0), output (dQG, dh, dAqk, dE) and the token recurrence
 * (dq, dk, dv, dg, dbeta, dh0).
 *
 * Inputs are realistic (q, k L2-normalised, per-step log decay g in [-0.5, -0.01], G its chunk
 * cumsum, beta = sigmoid in (0, 1), Aqk/Tm/W/U/KG/QG/h/E from the CPU forward) and upstream
 * gradients uniform in [-1, 1]; both sides get the same numbers (built on the CPU, copied to the
 * device). The entries of Aqk and Tm above the diagonal (never read) are overwritten with junk,
 * and random upstream dAqk/dTm fill whole rows, so a kernel that reads outside the lower triangle
 * fails. Device outputs are poisoned with NaN first; every element compared is one the CPU
 * writes. Variants with NULL upstream gradients (= zero) and NULL outputs (= skipped) run too,
 * and every reduction is run twice and must agree bit for bit (no float atomics).
 * Cases: T not a multiple of BT, B = 2, varlen with 3 odd-length sequences (one of 150 tokens:
 * three checkpoint segments of the recurrence), GVA (HV = 2H), BT = 16/32/64, K = V = 64,
 * K = 128 V = 64, K = 80 V = 40 (not multiples of 32), K = V = 256.
 * cpu mode: skipped (CUDA-only suite); gpu mode: the comparisons, a per-function error table, and
 * a timing table of the backward stages at (B, T, H, K = V) = (2, 4096, 16, 128) (the environment
 * variable DG_KDA_BWD_NO_BENCH skips it).
 */
#include "harness.h"
#include "kda_cuda_testutil.h"
#include "ops/kda/kda.h"
#ifdef DG_HAVE_CUDA
#include "kernels/kda/kda_cuda.h"
#endif

#include <string.h>
#include <time.h>

#ifndef DG_HAVE_CUDA
int main(int argc, char **argv) {
    dg_test_init(argc, argv, "kda_cuda_bwd");
    return dg_test_skip("CUDA-only suite (built without CUDA)");
}
#else

/* f32 against f32, both computing in f32: the kernels sum in other orders than the CPU loops
 * (tiles, warp trees, partial sums over tiles and value heads), so results differ by a few ulps
 * of the largest terms; 1e-5 of the largest value leaves ~100x headroom at these sizes. */
#define TOL_F32 1e-5

enum { F_L2, F_BETA, F_GATE, F_INTRA, F_WY, F_STATE, F_OUTPUT, F_REC, NF };
static const char *fn_names[NF] = {"kda_l2norm_bwd", "kda_beta_bwd",     "kda_gate_bwd",
                                   "kda_intra_bwd",  "kda_wy_bwd",       "kda_state_bwd",
                                   "kda_output_bwd", "kda_recurrent_bwd"};
static double g_worst[NF];
static int g_seen[NF];

static void cmp(int f, const char *cname, const char *what, const dg_tensor *got,
                const dg_tensor *want) {
    char name[200];
    snprintf(name, sizeof name, "%s | %s %s", cname, fn_names[f], what);
    double rel = check_rel_tensors(name, got, want, TOL_F32);
    if (rel > g_worst[f] || !g_seen[f])
        g_worst[f] = rel;
    g_seen[f] = 1;
}

/* Two device results of the same call must be identical bit for bit. */
static void same_bits(const char *cname, const char *what, const dg_tensor *a, const dg_tensor *b) {
    const size_t n = dg_tensor_nbytes(a);
    char *ha = malloc(n ? n : 1), *hb = malloc(n ? n : 1);
    if (!ha || !hb) {
        fprintf(stderr, "FATAL: out of host memory\n");
        exit(1);
    }
    DG_TEST_TRY(dg_tensor_to_host(a, ha, n));
    DG_TEST_TRY(dg_tensor_to_host(b, hb, n));
    dg_check(dg_tensor_nbytes(b) == n && memcmp(ha, hb, n) == 0,
             "%s | %s: two runs agree bit for bit (deterministic)", cname, what);
    free(ha);
    free(hb);
}

/* Overwrite the entries of a per-chunk matrix [TT,HV,BT] above the diagonal (column > row of
 * the chunk) with junk: the backward must never read them. */
static void junk_upper(dg_tensor *M, const kda_dims *d) {
    float *m = F(M);
    for (int n = 0; n < d->N; n++)
        for (int64_t c = 0; c < kda_nchunks(d, n); c++) {
            kda_chunk ch = kda_chunk_at(d, n, c);
            for (int i = 0; i < ch.L; i++)
                for (int hv = 0; hv < d->HV; hv++)
                    for (int j = i + 1; j < d->BT; j++)
                        m[((ch.t0 + i) * d->HV + hv) * d->BT + j] = 1e3f + (float)j;
        }
}

typedef struct bwd_case {
    const char *name;
    int64_t B, T;
    int H, HV, K, V, BT;
    int nseq; /* > 0: varlen, B = 1, T = sum of lens */
    int64_t lens[4];
    int use_h0;
} bwd_case;

static void free_all(dg_tensor **t, size_t n) {
    for (size_t i = 0; i < n; i++)
        dg_tensor_free(&t[i]);
}

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

static void run_case(dg_ctx *cpu, dg_ctx *gpu, const bwd_case *c, uint64_t seed) {
    int64_t cu[5];
    dg_kda_opts opts;
    kda_cfg cfg;
    kda_cuda_dims dd;
    case_tables("test_kda_cuda_bwd", cpu, gpu, c->B, c->T, c->H, c->HV, c->K, c->V, c->BT, c->nseq,
                c->lens, DG_F32, cu, &opts, &cfg, &dd);
    const kda_dims *d = &cfg.d;
    const int64_t TT = c->B * c->T, NC = kda_cfg_nc(&cfg);
    const int N = d->N, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    const float scale = 1.0f / sqrtf((float)K);
    const char *cn = c->name;
    printf("-- case: %s (TT=%lld N=%d NC=%lld H=%d HV=%d K=%d V=%d BT=%d, h0 %s)\n", cn,
           (long long)TT, N, (long long)NC, H, HV, K, V, BT, c->use_h0 ? "random" : "NULL");

    /* ---- forward quantities on the CPU (the inputs of the backward functions) */
    uint64_t s = seed;
    dg_tensor *qraw = mk_rand(cpu, TT, H, K, 0, ++s, -1, 1);
    dg_tensor *kraw = mk_rand(cpu, TT, H, K, 0, ++s, -1, 1);
    dg_tensor *v = mk_rand(cpu, TT, HV, V, 0, ++s, -1, 1);
    dg_tensor *g = mk_rand(cpu, TT, HV, K, 0, ++s, -0.5, -0.01);
    dg_tensor *braw = mk_rand(cpu, TT, HV, 0, 0, ++s, -3, 3);
    dg_tensor *h0 = c->use_h0 ? mk_rand(cpu, N, HV, K, V, ++s, -1, 1) : NULL;
    dg_tensor *xg = mk_rand(cpu, TT, HV, K, 0, ++s, -3, 3);
    dg_tensor *Alog = mk_rand(cpu, HV, 0, 0, 0, ++s, 0, 2.77); /* log U(1,16) */
    dg_tensor *dtb = mk_rand(cpu, (int64_t)HV * K, 0, 0, 0, ++s, -1, 1);
    dg_tensor *q = mk(cpu, TT, H, K, 0), *k = mk(cpu, TT, H, K, 0), *rq = mk(cpu, TT, H, 0, 0);
    dg__kda_l2norm_fwd_f32(TT * H, K, F(qraw), F(q), F(rq));
    dg__kda_l2norm_fwd_f32(TT * H, K, F(kraw), F(k), NULL);
    dg_tensor *beta = mk(cpu, TT, HV, 0, 0);
    dg__kda_beta_fwd_f32(TT * HV, 1.0f, F(braw), F(beta));
    dg_tensor *G = mk(cpu, TT, HV, K, 0);
    dg__kda_gate_fwd_f32(d, DG_GATE_NONE, 0.f, 1, F(g), NULL, NULL, F(G));
    dg_tensor *Aqk = mk(cpu, TT, HV, BT, 0), *Tm = mk(cpu, TT, HV, BT, 0);
    DG_TEST_TRY(dg__kda_intra_fwd_f32(d, scale, F(q), F(k), F(beta), F(G), F(Aqk), F(Tm)));
    dg_tensor *W = mk(cpu, TT, HV, K, 0), *U = mk(cpu, TT, HV, V, 0);
    dg_tensor *KG = mk(cpu, TT, HV, K, 0), *QG = mk(cpu, TT, HV, K, 0);
    DG_TEST_TRY(
        dg__kda_wy_fwd_f32(d, F(q), F(k), F(v), F(beta), F(G), F(Tm), F(W), F(U), F(KG), F(QG)));
    dg_tensor *h = mk(cpu, NC, HV, K, V), *E = mk(cpu, TT, HV, V, 0);
    DG_TEST_TRY(dg__kda_state_fwd_f32(d, F(W), F(U), F(KG), F(G), F(h0), F(h), F(E), NULL));
    junk_upper(Aqk, d);
    junk_upper(Tm, d);

    /* ---- upstream gradients, uniform in [-1, 1] */
    dg_tensor *dy = mk_rand(cpu, TT, H, K, 0, ++s, -1, 1);
    dg_tensor *dbu = mk_rand(cpu, TT, HV, 0, 0, ++s, -1, 1);
    dg_tensor *dGu = mk_rand(cpu, TT, HV, K, 0, ++s, -1, 1);
    dg_tensor *dAu = mk_rand(cpu, TT, HV, BT, 0, ++s, -1, 1);
    dg_tensor *dTu = mk_rand(cpu, TT, HV, BT, 0, ++s, -1, 1);
    dg_tensor *dWu = mk_rand(cpu, TT, HV, K, 0, ++s, -1, 1);
    dg_tensor *dUu = mk_rand(cpu, TT, HV, V, 0, ++s, -1, 1);
    dg_tensor *dKGu = mk_rand(cpu, TT, HV, K, 0, ++s, -1, 1);
    dg_tensor *dQGu = mk_rand(cpu, TT, HV, K, 0, ++s, -1, 1);
    dg_tensor *dhu = mk_rand(cpu, NC, HV, K, V, ++s, -1, 1);
    dg_tensor *dEu = mk_rand(cpu, TT, HV, V, 0, ++s, -1, 1);
    dg_tensor *dht = mk_rand(cpu, N, HV, K, V, ++s, -1, 1);
    dg_tensor *dO = mk_rand(cpu, TT, HV, V, 0, ++s, -1, 1);

    /* ---- the same on the device */
    dg_tensor *q_d = up(gpu, q), *k_d = up(gpu, k), *v_d = up(gpu, v), *g_d = up(gpu, g);
    dg_tensor *rq_d = up(gpu, rq), *braw_d = up(gpu, braw), *xg_d = up(gpu, xg);
    dg_tensor *Alog_d = up(gpu, Alog), *dtb_d = up(gpu, dtb), *beta_d = up(gpu, beta);
    dg_tensor *G_d = up(gpu, G), *Aqk_d = up(gpu, Aqk), *Tm_d = up(gpu, Tm), *W_d = up(gpu, W);
    dg_tensor *KG_d = up(gpu, KG), *QG_d = up(gpu, QG), *h_d = up(gpu, h), *E_d = up(gpu, E);
    dg_tensor *h0_d = up(gpu, h0), *dy_d = up(gpu, dy), *dbu_d = up(gpu, dbu);
    dg_tensor *dGu_d = up(gpu, dGu), *dAu_d = up(gpu, dAu), *dTu_d = up(gpu, dTu);
    dg_tensor *dWu_d = up(gpu, dWu), *dUu_d = up(gpu, dUu), *dKGu_d = up(gpu, dKGu);
    dg_tensor *dQGu_d = up(gpu, dQGu), *dhu_d = up(gpu, dhu), *dEu_d = up(gpu, dEu);
    dg_tensor *dht_d = up(gpu, dht), *dO_d = up(gpu, dO);

    /* ---- l2norm (the q rows: y = q, r = 1/norm) */
    {
        dg_tensor *want = mk(cpu, TT, H, K, 0), *got = poisoned(gpu, want);
        dg__kda_l2norm_bwd_f32(TT * H, K, F(q), F(rq), F(dy), F(want));
        dg_check_ok(dg__kda_l2norm_bwd_cuda(gpu, TT * H, K, F(q_d), F(rq_d), F(dy_d), 0, F(got)),
                    "l2norm bwd launch");
        cmp(F_L2, cn, "dx", got, want);
        dg_tensor_free(&want);
        dg_tensor_free(&got);
    }

    /* ---- beta, c = 1 and c = 2 */
    for (int ci = 1; ci <= 2; ci++) {
        dg_tensor *want = mk(cpu, TT, HV, 0, 0), *got = poisoned(gpu, want);
        dg__kda_beta_bwd_f32(TT * HV, (float)ci, F(braw), F(dbu), F(want));
        dg_check_ok(dg__kda_beta_bwd_cuda(gpu, TT * HV, (float)ci, 0, F(braw_d), F(dbu_d), F(got)),
                    "beta bwd launch");
        cmp(F_BETA, cn, ci == 1 ? "db (c=1)" : "db (c=2)", got, want);
        dg_tensor_free(&want);
        dg_tensor_free(&got);
    }

    /* ---- gate: every kind, with and without the chunk cumsum */
    struct {
        const char *what;
        dg_gate_kind kind;
        int cumsum, use_A, use_b;
    } gk[] = {
        {"NONE cumsum", DG_GATE_NONE, 1, 0, 0},
        {"NONE no cumsum", DG_GATE_NONE, 0, 0, 0},
        {"KDA cumsum", DG_GATE_KDA, 1, 1, 1},
        {"KDA no cumsum", DG_GATE_KDA, 0, 1, 1},
        {"KDA cumsum no dt_bias", DG_GATE_KDA, 1, 1, 0},
        {"LOWERBOUND cumsum", DG_GATE_LOWERBOUND, 1, 1, 1},
        {"LOWERBOUND no A_log/dt_bias", DG_GATE_LOWERBOUND, 1, 0, 0},
    };
    for (size_t i = 0; i < NELEM(gk); i++) {
        dg_tensor *x = gk[i].kind == DG_GATE_NONE ? g : xg;
        dg_tensor *x_d = gk[i].kind == DG_GATE_NONE ? g_d : xg_d;
        const float *A = gk[i].use_A ? F(Alog) : NULL, *A_d = gk[i].use_A ? F(Alog_d) : NULL;
        const float *b = gk[i].use_b ? F(dtb) : NULL, *b_d = gk[i].use_b ? F(dtb_d) : NULL;
        dg_tensor *wx = mk(cpu, TT, HV, K, 0), *wA = mk(cpu, HV, 0, 0, 0);
        dg_tensor *wb = mk(cpu, (int64_t)HV * K, 0, 0, 0);
        dg__kda_gate_bwd_f32(d, gk[i].kind, -5.0f, gk[i].cumsum, F(x), A, b, F(dGu), F(wx), F(wA),
                             F(wb));
        dg_tensor *gx = poisoned(gpu, wx), *gA = poisoned(gpu, wA), *gb = poisoned(gpu, wb);
        dg_tensor *gA2 = poisoned(gpu, wA), *gb2 = poisoned(gpu, wb);
        dg_check_ok(dg__kda_gate_bwd_cuda(gpu, &dd, gk[i].kind, -5.0f, gk[i].cumsum, 0, F(x_d), A_d,
                                          b_d, F(dGu_d), F(gx), F(gA), F(gb)),
                    "gate bwd launch");
        char what[96];
        snprintf(what, sizeof what, "%s dx", gk[i].what);
        cmp(F_GATE, cn, what, gx, wx);
        snprintf(what, sizeof what, "%s dA_log", gk[i].what);
        cmp(F_GATE, cn, what, gA, wA);
        snprintf(what, sizeof what, "%s ddt_bias", gk[i].what);
        cmp(F_GATE, cn, what, gb, wb);
        /* the reductions alone (dx not wanted) and their determinism */
        dg_check_ok(dg__kda_gate_bwd_cuda(gpu, &dd, gk[i].kind, -5.0f, gk[i].cumsum, 0, F(x_d), A_d,
                                          b_d, F(dGu_d), NULL, F(gA2), F(gb2)),
                    "gate bwd launch (dx NULL)");
        snprintf(what, sizeof what, "gate %s dA_log", gk[i].what);
        same_bits(cn, what, gA, gA2);
        snprintf(what, sizeof what, "gate %s ddt_bias", gk[i].what);
        same_bits(cn, what, gb, gb2);
        dg_tensor *all[] = {wx, wA, wb, gx, gA, gb, gA2, gb2};
        free_all(all, NELEM(all));
    }

    /* ---- intra: full, then dAqk = NULL and dTm = NULL */
    for (int var = 0; var < 3; var++) {
        const dg_tensor *uA = var == 1 ? NULL : dAu, *uT = var == 2 ? NULL : dTu;
        const dg_tensor *uA_d = var == 1 ? NULL : dAu_d, *uT_d = var == 2 ? NULL : dTu_d;
        static const char *tag[3] = {"", " (dAqk NULL)", " (dTm NULL)"};
        dg_tensor *wq = mk(cpu, TT, H, K, 0), *wk = mk(cpu, TT, H, K, 0);
        dg_tensor *wb = mk(cpu, TT, HV, 0, 0), *wG = mk(cpu, TT, HV, K, 0);
        DG_TEST_TRY(dg__kda_intra_bwd_f32(d, scale, F(q), F(k), F(beta), F(G), F(Tm), F(uA), F(uT),
                                          F(wq), F(wk), F(wb), F(wG)));
        dg_tensor *gq = poisoned(gpu, wq), *gk_ = poisoned(gpu, wk), *gb = poisoned(gpu, wb);
        dg_tensor *gG = poisoned(gpu, wG);
        dg_check_ok(dg__kda_intra_bwd_cuda(gpu, &dd, scale, F(q_d), F(k_d), F(beta_d), F(G_d),
                                           F(Tm_d), F(uA_d), F(uT_d), F(gq), F(gk_), F(gb), F(gG),
                                           0),
                    "intra bwd launch");
        char what[64];
        snprintf(what, sizeof what, "dq%s", tag[var]);
        cmp(F_INTRA, cn, what, gq, wq);
        snprintf(what, sizeof what, "dk%s", tag[var]);
        cmp(F_INTRA, cn, what, gk_, wk);
        snprintf(what, sizeof what, "dbeta%s", tag[var]);
        cmp(F_INTRA, cn, what, gb, wb);
        snprintf(what, sizeof what, "dG%s", tag[var]);
        cmp(F_INTRA, cn, what, gG, wG);
        if (var == 0) { /* determinism of the GVA and tile reductions */
            dg_tensor *gq2 = poisoned(gpu, wq), *gk2 = poisoned(gpu, wk), *gb2 = poisoned(gpu, wb);
            dg_check_ok(dg__kda_intra_bwd_cuda(gpu, &dd, scale, F(q_d), F(k_d), F(beta_d), F(G_d),
                                               F(Tm_d), F(uA_d), F(uT_d), F(gq2), F(gk2), F(gb2),
                                               NULL, 0),
                        "intra bwd launch (dG NULL)");
            same_bits(cn, "intra dq", gq, gq2);
            same_bits(cn, "intra dk", gk_, gk2);
            same_bits(cn, "intra dbeta", gb, gb2);
            dg_tensor *all2[] = {gq2, gk2, gb2};
            free_all(all2, NELEM(all2));
        }
        dg_tensor *all[] = {wq, wk, wb, wG, gq, gk_, gb, gG};
        free_all(all, NELEM(all));
    }

    /* ---- wy: full, then dW = dKG = NULL, then dU = dQG = NULL */
    for (int var = 0; var < 3; var++) {
        static const char *tag[3] = {"", " (dW,dKG NULL)", " (dU,dQG NULL)"};
        const dg_tensor *uW = var == 1 ? NULL : dWu, *uKG = var == 1 ? NULL : dKGu;
        const dg_tensor *uU = var == 2 ? NULL : dUu, *uQG = var == 2 ? NULL : dQGu;
        const dg_tensor *uW_d = var == 1 ? NULL : dWu_d, *uKG_d = var == 1 ? NULL : dKGu_d;
        const dg_tensor *uU_d = var == 2 ? NULL : dUu_d, *uQG_d = var == 2 ? NULL : dQGu_d;
        dg_tensor *w[6] = {mk(cpu, TT, H, K, 0),  mk(cpu, TT, H, K, 0),  mk(cpu, TT, HV, V, 0),
                           mk(cpu, TT, HV, 0, 0), mk(cpu, TT, HV, K, 0), mk(cpu, TT, HV, BT, 0)};
        static const char *nm[6] = {"dq", "dk", "dv", "dbeta", "dG", "dTm"};
        DG_TEST_TRY(dg__kda_wy_bwd_f32(d, F(q), F(k), F(v), F(beta), F(G), F(Tm), F(uW), F(uU),
                                       F(uKG), F(uQG), F(w[0]), F(w[1]), F(w[2]), F(w[3]), F(w[4]),
                                       F(w[5])));
        dg_tensor *gt[6];
        for (int i = 0; i < 6; i++)
            gt[i] = poisoned(gpu, w[i]);
        dg_check_ok(dg__kda_wy_bwd_cuda(gpu, &dd, F(q_d), F(k_d), F(v_d), F(beta_d), F(G_d),
                                        F(Tm_d), F(uW_d), F(uU_d), F(uKG_d), F(uQG_d), F(gt[0]),
                                        F(gt[1]), F(gt[2]), F(gt[3]), F(gt[4]), F(gt[5]), 0),
                    "wy bwd launch");
        for (int i = 0; i < 6; i++) {
            char what[64];
            snprintf(what, sizeof what, "%s%s", nm[i], tag[var]);
            cmp(F_WY, cn, what, gt[i], w[i]);
        }
        if (var == 0) {
            dg_tensor *g2[3] = {poisoned(gpu, w[0]), poisoned(gpu, w[1]), poisoned(gpu, w[3])};
            dg_check_ok(dg__kda_wy_bwd_cuda(gpu, &dd, F(q_d), F(k_d), F(v_d), F(beta_d), F(G_d),
                                            F(Tm_d), F(uW_d), F(uU_d), F(uKG_d), F(uQG_d), F(g2[0]),
                                            F(g2[1]), NULL, F(g2[2]), NULL, NULL, 0),
                        "wy bwd launch (dv, dG, dTm NULL)");
            same_bits(cn, "wy dq", gt[0], g2[0]);
            same_bits(cn, "wy dk", gt[1], g2[1]);
            same_bits(cn, "wy dbeta", gt[3], g2[2]);
            free_all(g2, 3);
        }
        free_all(w, 6);
        free_all(gt, 6);
    }

    /* ---- state: full, then dh = dht = NULL (and no dh0), then dE = NULL */
    for (int var = 0; var < 3; var++) {
        static const char *tag[3] = {"", " (dh,dht NULL)", " (dE NULL)"};
        const dg_tensor *uh = var == 1 ? NULL : dhu, *uht = var == 1 ? NULL : dht;
        const dg_tensor *uE = var == 2 ? NULL : dEu;
        const dg_tensor *uh_d = var == 1 ? NULL : dhu_d, *uht_d = var == 1 ? NULL : dht_d;
        const dg_tensor *uE_d = var == 2 ? NULL : dEu_d;
        dg_tensor *w[5] = {mk(cpu, TT, HV, K, 0), mk(cpu, TT, HV, V, 0), mk(cpu, TT, HV, K, 0),
                           mk(cpu, TT, HV, K, 0), mk(cpu, N, HV, K, V)};
        static const char *nm[5] = {"dW", "dU", "dKG", "dG", "dh0"};
        DG_TEST_TRY(dg__kda_state_bwd_f32(d, F(W), F(KG), F(G), F(h), F(E), F(uh), F(uE), F(uht),
                                          F(w[0]), F(w[1]), F(w[2]), F(w[3]), F(w[4])));
        dg_tensor *gt[5];
        for (int i = 0; i < 5; i++)
            gt[i] = poisoned(gpu, w[i]);
        const int want_h0 = var != 1;
        dg_check_ok(dg__kda_state_bwd_cuda(gpu, &dd, F(W_d), F(KG_d), F(G_d), F(h_d), F(E_d),
                                           F(uh_d), F(uE_d), F(uht_d), F(gt[0]), F(gt[1]), F(gt[2]),
                                           F(gt[3]), want_h0 ? F(gt[4]) : NULL),
                    "state bwd launch");
        for (int i = 0; i < (want_h0 ? 5 : 4); i++) {
            char what[64];
            snprintf(what, sizeof what, "%s%s", nm[i], tag[var]);
            cmp(F_STATE, cn, what, gt[i], w[i]);
        }
        if (var == 0) { /* dW without dU (dE_tot then lives in scratch) */
            DG_TEST_TRY(dg_tensor_fill_(gt[0], NAN));
            dg_check_ok(dg__kda_state_bwd_cuda(gpu, &dd, F(W_d), F(KG_d), F(G_d), F(h_d), F(E_d),
                                               F(uh_d), F(uE_d), F(uht_d), F(gt[0]), NULL, NULL,
                                               NULL, NULL),
                        "state bwd launch (dW only)");
            cmp(F_STATE, cn, "dW (alone)", gt[0], w[0]);
        }
        free_all(w, 5);
        free_all(gt, 5);
    }

    /* ---- output */
    {
        dg_tensor *w[4] = {mk(cpu, TT, HV, K, 0), mk(cpu, NC, HV, K, V), mk(cpu, TT, HV, BT, 0),
                           mk(cpu, TT, HV, V, 0)};
        static const char *nm[4] = {"dQG", "dh", "dAqk", "dE"};
        dg__kda_output_bwd_f32(d, scale, F(QG), F(h), F(Aqk), F(E), F(dO), F(w[0]), F(w[1]),
                               F(w[2]), F(w[3]));
        dg_tensor *gt[4];
        for (int i = 0; i < 4; i++)
            gt[i] = poisoned(gpu, w[i]);
        dg_check_ok(dg__kda_output_bwd_cuda(gpu, &dd, scale, F(QG_d), F(h_d), F(Aqk_d), F(E_d),
                                            F(dO_d), F(gt[0]), F(gt[1]), F(gt[2]), F(gt[3])),
                    "output bwd launch");
        for (int i = 0; i < 4; i++)
            cmp(F_OUTPUT, cn, nm[i], gt[i], w[i]);
        free_all(w, 4);
        free_all(gt, 4);
    }

    /* ---- recurrence: with dht, then dht = NULL */
    for (int var = 0; var < 2; var++) {
        const dg_tensor *uht = var ? NULL : dht, *uht_d = var ? NULL : dht_d;
        dg_tensor *w[6] = {mk(cpu, TT, H, K, 0),  mk(cpu, TT, H, K, 0),  mk(cpu, TT, HV, V, 0),
                           mk(cpu, TT, HV, K, 0), mk(cpu, TT, HV, 0, 0), mk(cpu, N, HV, K, V)};
        static const char *nm[6] = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
        DG_TEST_TRY(dg__kda_recurrent_bwd_f32(d, scale, F(q), F(k), F(v), F(g), F(beta), F(h0),
                                              F(dO), F(uht), F(w[0]), F(w[1]), F(w[2]), F(w[3]),
                                              F(w[4]), F(w[5])));
        dg_tensor *gt[6];
        for (int i = 0; i < 6; i++)
            gt[i] = poisoned(gpu, w[i]);
        dg_check_ok(dg__kda_recurrent_bwd_cuda(gpu, &dd, scale, F(q_d), F(k_d), F(v_d), F(g_d),
                                               F(beta_d), F(h0_d), F(dO_d), F(uht_d), F(gt[0]),
                                               F(gt[1]), F(gt[2]), F(gt[3]), F(gt[4]), F(gt[5])),
                    "recurrent bwd launch");
        for (int i = 0; i < 6; i++) {
            char what[64];
            snprintf(what, sizeof what, "%s%s", nm[i], var ? " (dht NULL)" : "");
            cmp(F_REC, cn, what, gt[i], w[i]);
        }
        if (var == 0) {
            dg_tensor *g2[4] = {poisoned(gpu, w[0]), poisoned(gpu, w[1]), poisoned(gpu, w[3]),
                                poisoned(gpu, w[4])};
            dg_check_ok(dg__kda_recurrent_bwd_cuda(gpu, &dd, scale, F(q_d), F(k_d), F(v_d), F(g_d),
                                                   F(beta_d), F(h0_d), F(dO_d), F(uht_d), F(g2[0]),
                                                   F(g2[1]), NULL, F(g2[2]), F(g2[3]), NULL),
                        "recurrent bwd launch (dv, dh0 NULL)");
            same_bits(cn, "recurrent dq", gt[0], g2[0]);
            same_bits(cn, "recurrent dk", gt[1], g2[1]);
            same_bits(cn, "recurrent dg", gt[3], g2[2]);
            same_bits(cn, "recurrent dbeta", gt[4], g2[3]);
            free_all(g2, 4);
        }
        free_all(w, 6);
        free_all(gt, 6);
    }

    dg_tensor *all[] = {qraw,   kraw,   v,      g,     braw,   h0,    xg,    Alog,  dtb,   q,
                        k,      rq,     beta,   G,     Aqk,    Tm,    W,     U,     KG,    QG,
                        h,      E,      dy,     dbu,   dGu,    dAu,   dTu,   dWu,   dUu,   dKGu,
                        dQGu,   dhu,    dEu,    dht,   dO,     q_d,   k_d,   v_d,   g_d,   rq_d,
                        braw_d, xg_d,   Alog_d, dtb_d, beta_d, G_d,   Aqk_d, Tm_d,  W_d,   KG_d,
                        QG_d,   h_d,    E_d,    h0_d,  dy_d,   dbu_d, dGu_d, dAu_d, dTu_d, dWu_d,
                        dUu_d,  dKGu_d, dQGu_d, dhu_d, dEu_d,  dht_d, dO_d};
    free_all(all, NELEM(all));
    dg__kda_cuda_dims_free(gpu, &dd);
    dg__kda_cfg_free(&cfg);
}

/* ---- timing of the backward stages (printed, not asserted) */

static double now_ms(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum { B_L2, B_BETA, B_GATE, B_INTRA, B_WY, B_STATE, B_OUTPUT, B_REC, NB };

typedef struct bench_bufs {
    kda_cuda_dims *dd;
    float scale;
    /* forward quantities (made by the CUDA forward) */
    dg_tensor *q, *k, *r, *v, *x, *Alog, *dtb, *b, *beta, *g, *G, *Aqk, *Tm, *W, *U, *KG, *QG, *h,
        *E;
    /* upstream gradients and outputs */
    dg_tensor *uK, *uV, *uHV, *uBT, *uH, *uS, *dqh, *dkh, *dK1, *dK2, *dK3, *dV1, *dHV1, *dBT1, *dA,
        *ddt, *dS, *dh;
} bench_bufs;

static dg_status bench_run(dg_ctx *gpu, bench_bufs *z, int s) {
    const kda_cuda_dims *d = z->dd;
    switch (s) {
    case B_L2:
        DG_TRY(dg__kda_l2norm_bwd_cuda(gpu, d->TT * d->H, d->K, F(z->q), F(z->r), F(z->dqh), 0,
                                       F(z->dkh)));
        return dg__kda_l2norm_bwd_cuda(gpu, d->TT * d->H, d->K, F(z->k), F(z->r), F(z->dqh), 0,
                                       F(z->dkh));
    case B_BETA:
        return dg__kda_beta_bwd_cuda(gpu, d->TT * d->HV, 1.0f, 0, F(z->b), F(z->uHV), F(z->dHV1));
    case B_GATE:
        return dg__kda_gate_bwd_cuda(gpu, d, DG_GATE_KDA, 0.f, 1, 0, F(z->x), F(z->Alog), F(z->dtb),
                                     F(z->uK), F(z->dK1), F(z->dA), F(z->ddt));
    case B_INTRA:
        return dg__kda_intra_bwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->beta), F(z->G),
                                      F(z->Tm), F(z->uBT), F(z->uBT), F(z->dqh), F(z->dkh),
                                      F(z->dHV1), F(z->dK1), 0);
    case B_WY:
        return dg__kda_wy_bwd_cuda(gpu, d, F(z->q), F(z->k), F(z->v), F(z->beta), F(z->G), F(z->Tm),
                                   F(z->uK), F(z->uV), F(z->uK), F(z->uK), F(z->dqh), F(z->dkh),
                                   F(z->dV1), F(z->dHV1), F(z->dK1), F(z->dBT1), 0);
    case B_STATE:
        return dg__kda_state_bwd_cuda(gpu, d, F(z->W), F(z->KG), F(z->G), F(z->h), F(z->E),
                                      F(z->uH), F(z->uV), F(z->uS), F(z->dK1), F(z->dV1), F(z->dK2),
                                      F(z->dK3), F(z->dS));
    case B_OUTPUT:
        return dg__kda_output_bwd_cuda(gpu, d, z->scale, F(z->QG), F(z->h), F(z->Aqk), F(z->E),
                                       F(z->uV), F(z->dK1), F(z->dh), F(z->dBT1), F(z->dV1));
    case B_REC:
        return dg__kda_recurrent_bwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->v), F(z->g),
                                          F(z->beta), NULL, F(z->uV), F(z->uS), F(z->dqh),
                                          F(z->dkh), F(z->dV1), F(z->dK1), F(z->dHV1), F(z->dS));
    default:
        return DG_ERR_ARG;
    }
}

static void bench(dg_ctx *gpu) {
    const int64_t B = 2, T = 4096;
    const int H = 16, HV = 16, K = 128, V = 128, BT = 64, N = (int)B, R = 10;
    const int64_t TT = B * T, NT = T / BT, NC = B * NT;
    int64_t cu[3] = {0, T, 2 * T}, off[3] = {0, NT, 2 * NT};
    kda_cuda_dims dd;
    DG_TEST_TRY(dg__kda_cuda_dims_new(gpu, TT, H, HV, K, V, BT, N, cu, off, &dd));
    bench_bufs z;
    memset(&z, 0, sizeof z);
    z.dd = &dd;
    z.scale = 1.0f / sqrtf((float)K);
    dg_tensor *qraw = mk_rand(gpu, TT, H, K, 0, 101, -1, 1);
    dg_tensor *kraw = mk_rand(gpu, TT, H, K, 0, 102, -1, 1);
    z.v = mk_rand(gpu, TT, HV, V, 0, 103, -1, 1);
    z.x = mk_rand(gpu, TT, HV, K, 0, 104, -3, 3);
    z.Alog = mk_rand(gpu, HV, 0, 0, 0, 105, 0, 2.77);
    z.dtb = mk_rand(gpu, (int64_t)HV * K, 0, 0, 0, 106, -1, 1);
    z.b = mk_rand(gpu, TT, HV, 0, 0, 107, -3, 3);
    z.q = mk(gpu, TT, H, K, 0);
    z.k = mk(gpu, TT, H, K, 0);
    z.r = mk(gpu, TT, H, 0, 0);
    z.beta = mk(gpu, TT, HV, 0, 0);
    z.g = mk(gpu, TT, HV, K, 0);
    z.G = mk(gpu, TT, HV, K, 0);
    z.Aqk = mk(gpu, TT, HV, BT, 0);
    z.Tm = mk(gpu, TT, HV, BT, 0);
    z.W = mk(gpu, TT, HV, K, 0);
    z.U = mk(gpu, TT, HV, V, 0);
    z.KG = mk(gpu, TT, HV, K, 0);
    z.QG = mk(gpu, TT, HV, K, 0);
    z.h = mk(gpu, NC, HV, K, V);
    z.E = mk(gpu, TT, HV, V, 0);
    DG_TEST_TRY(dg__kda_l2norm_fwd_cuda(gpu, TT * H, K, 0, F(qraw), F(z.q), F(z.r)));
    DG_TEST_TRY(dg__kda_l2norm_fwd_cuda(gpu, TT * H, K, 0, F(kraw), F(z.k), NULL));
    DG_TEST_TRY(dg__kda_beta_fwd_cuda(gpu, TT * HV, 1.0f, 0, F(z.b), F(z.beta)));
    DG_TEST_TRY(dg__kda_gate_fwd_cuda(gpu, &dd, DG_GATE_KDA, 0.f, 0, 0, F(z.x), F(z.Alog), F(z.dtb),
                                      F(z.g)));
    DG_TEST_TRY(dg__kda_gate_fwd_cuda(gpu, &dd, DG_GATE_KDA, 0.f, 1, 0, F(z.x), F(z.Alog), F(z.dtb),
                                      F(z.G)));
    DG_TEST_TRY(dg__kda_intra_fwd_cuda(gpu, &dd, z.scale, F(z.q), F(z.k), F(z.beta), F(z.G),
                                       F(z.Aqk), F(z.Tm)));
    DG_TEST_TRY(dg__kda_wy_fwd_cuda(gpu, &dd, F(z.q), F(z.k), F(z.v), F(z.beta), F(z.G), F(z.Tm),
                                    F(z.W), F(z.U), F(z.KG), F(z.QG)));
    DG_TEST_TRY(dg__kda_state_fwd_cuda(gpu, &dd, F(z.W), F(z.U), F(z.KG), F(z.G), NULL, F(z.h),
                                       F(z.E), NULL));
    z.uK = mk_rand(gpu, TT, HV, K, 0, 201, -1, 1);
    z.uV = mk_rand(gpu, TT, HV, V, 0, 202, -1, 1);
    z.uHV = mk_rand(gpu, TT, HV, 0, 0, 203, -1, 1);
    z.uBT = mk_rand(gpu, TT, HV, BT, 0, 204, -1, 1);
    z.uH = mk_rand(gpu, NC, HV, K, V, 205, -1, 1);
    z.uS = mk_rand(gpu, N, HV, K, V, 206, -1, 1);
    z.dqh = mk(gpu, TT, H, K, 0);
    z.dkh = mk(gpu, TT, H, K, 0);
    z.dK1 = mk(gpu, TT, HV, K, 0);
    z.dK2 = mk(gpu, TT, HV, K, 0);
    z.dK3 = mk(gpu, TT, HV, K, 0);
    z.dV1 = mk(gpu, TT, HV, V, 0);
    z.dHV1 = mk(gpu, TT, HV, 0, 0);
    z.dBT1 = mk(gpu, TT, HV, BT, 0);
    z.dA = mk(gpu, HV, 0, 0, 0);
    z.ddt = mk(gpu, (int64_t)HV * K, 0, 0, 0);
    z.dS = mk(gpu, N, HV, K, V);
    z.dh = mk(gpu, NC, HV, K, V);
    static const char *names[NB] = {
        "l2norm (q and k)", "beta",           "gate KDA + cumsum", "intra", "wy", "state",
        "output",           "recurrent (ref)"};
    double med[NB], mn[NB];
    printf("-- timing: (B,T,H,HV,K,V,BT) = (%lld,%lld,%d,%d,%d,%d,%d), median of %d runs, "
           "host clock around dg_ctx_sync\n",
           (long long)B, (long long)T, H, HV, K, V, BT, R);
    for (int s = 0; s < NB; s++) {
        double t[10];
        DG_TEST_TRY(bench_run(gpu, &z, s)); /* warm-up (scratch blocks enter the cache) */
        DG_TEST_TRY(dg_ctx_sync(gpu));
        for (int r = 0; r < R; r++) {
            double t0 = now_ms();
            DG_TEST_TRY(bench_run(gpu, &z, s));
            DG_TEST_TRY(dg_ctx_sync(gpu));
            t[r] = now_ms() - t0;
        }
        qsort(t, R, sizeof t[0], cmp_double);
        med[s] = 0.5 * (t[R / 2 - 1] + t[R / 2]);
        mn[s] = t[0];
    }
    double chunked = 0;
    for (int s = 0; s < B_REC; s++)
        chunked += med[s];
    printf("   %-22s %10s %10s %8s\n", "stage", "median ms", "min ms", "share");
    for (int s = 0; s < NB; s++)
        printf("   %-22s %10.3f %10.3f %7.1f%%\n", names[s], med[s], mn[s],
               s < B_REC ? 100.0 * med[s] / chunked : 0.0);
    printf("   %-22s %10.3f   (sum of the chunked stages' medians)\n", "chunked backward", chunked);
    dg_check(chunked > 0 && isfinite(chunked), "timing table printed (not an assertion on speed)");
    dg_tensor *all[] = {qraw,   kraw,  z.q,   z.k,    z.r,    z.v,  z.x,   z.Alog, z.dtb, z.b,
                        z.beta, z.g,   z.G,   z.Aqk,  z.Tm,   z.W,  z.U,   z.KG,   z.QG,  z.h,
                        z.E,    z.uK,  z.uV,  z.uHV,  z.uBT,  z.uH, z.uS,  z.dqh,  z.dkh, z.dK1,
                        z.dK2,  z.dK3, z.dV1, z.dHV1, z.dBT1, z.dA, z.ddt, z.dS,   z.dh};
    free_all(all, NELEM(all));
    dg__kda_cuda_dims_free(gpu, &dd);
}

int main(int argc, char **argv) {
    int gpu_mode = dg_test_init(argc, argv, "kda_cuda_bwd");
    if (!gpu_mode)
        return dg_test_skip("CUDA-only suite");
    int skip = dg_test_need_gpu();
    if (skip)
        return skip;
    dg_ctx *cpu = NULL, *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    const bwd_case cases[] = {
        {"B=2 T=100 BT=64 K=V=64", 2, 100, 2, 2, 64, 64, 64, 0, {0}, 1},
        {"B=2 T=75 BT=16 GVA K=V=64 no h0", 2, 75, 1, 2, 64, 64, 16, 0, {0}, 0},
        {"varlen 37/64/91 BT=32 GVA K=128 V=64", 1, 192, 2, 4, 128, 64, 32, 3, {37, 64, 91}, 1},
        {"varlen 37/150/91 BT=64 K=128 V=64", 1, 278, 2, 2, 128, 64, 64, 3, {37, 150, 91}, 1},
        {"B=2 T=130 BT=64 GVA K=128 V=64", 2, 130, 2, 4, 128, 64, 64, 0, {0}, 1},
        {"B=2 T=53 BT=16 K=80 V=40 (not /32)", 2, 53, 2, 2, 80, 40, 16, 0, {0}, 1},
        {"B=1 T=45 BT=32 GVA K=V=256", 1, 45, 1, 2, 256, 256, 32, 0, {0}, 1},
    };
    for (size_t i = 0; i < NELEM(cases); i++)
        run_case(cpu, gpu, &cases[i], 1000 * (uint64_t)(i + 1));

    printf("-- largest norm-relative error per function over all cases (tolerance %.0e)\n",
           TOL_F32);
    for (int f = 0; f < NF; f++)
        printf("   %-20s %.3e%s\n", fn_names[f], g_worst[f], g_seen[f] ? "" : " (not run)");
    if (!getenv("DG_KDA_BWD_NO_BENCH"))
        bench(gpu);
    dg_ctx_free(&gpu);
    dg_ctx_free(&cpu);
    return dg_test_finish();
}
#endif

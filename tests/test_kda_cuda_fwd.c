/*
 * tests/test_kda_cuda_fwd.c -- the CUDA forward kernels of KDA (kernels/kda/) against the CPU
 * f32 raw reference functions (ops/kda/kda.h), stage by stage: l2norm, beta, gate (+ chunk
 * cumsum), intra (Aqk, Tm), wy (W, U, KG, QG), state (h, E, ht), output (O), the token-by-token
 * recurrence (o, ht), and the chunked pipeline on the GPU against the GPU recurrence.
 *
 * Each stage gets the same inputs on both sides (computed once on the CPU, copied to the device),
 * so an error points at one kernel. Device outputs are poisoned with NaN first: an element the
 * kernel forgets to write fails the check (every element compared is one the CPU writes).
 * Cases: T not a multiple of BT, B = 2, varlen with 3 odd-length sequences, GVA (HV = 2H),
 * BT = 16/32/64, K = V = 64, K = 128 V = 64, K = V = 256, K and V not multiples of 32, and gates
 * of -45..-35 per step (exponents must be masked, never overflowed).
 * cpu mode: argument checks of the launchers (no device needed); gpu mode: the comparisons, a
 * per-function table of the largest error, and a timing table of the forward stages at
 * (B, T, H, K = V) = (2, 4096, 16, 128).
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
    dg_test_init(argc, argv, "kda_cuda_fwd");
    return dg_test_skip("CUDA-only suite (built without CUDA)");
}
#else

/* f32 against f32: kernels sum in other orders than the CPU loops (tiles, warp trees), so
 * results differ by a few ulps of the largest terms; 1e-5 of the largest value leaves ~100x
 * headroom over what such reorderings give at these sizes. */
#define TOL_F32 1e-5
/* Chunked pipeline vs the recurrence, both on the GPU: two different f32 algorithms (the WY
 * inverse and the state products round differently from T rank-1 updates). */
#define TOL_CHUNK_VS_REC 1e-4

enum { F_L2, F_BETA, F_GATE, F_INTRA, F_WY, F_STATE, F_OUTPUT, F_REC, F_E2E, NF };
static const char *fn_names[NF] = {
    "kda_l2norm_fwd", "kda_beta_fwd",      "kda_gate_fwd",
    "kda_intra_fwd",  "kda_wy_fwd",        "kda_state_fwd",
    "kda_output_fwd", "kda_recurrent_fwd", "chunked vs recurrent (GPU)"};
static double g_worst[NF];
static int g_seen[NF];

static void cmp(int f, const char *cname, const char *what, const dg_tensor *got,
                const dg_tensor *want, double tol) {
    char name[160];
    snprintf(name, sizeof name, "%s | %s %s", cname, fn_names[f], what);
    double rel = check_rel_tensors(name, got, want, tol);
    if (rel > g_worst[f] || !g_seen[f])
        g_worst[f] = rel;
    g_seen[f] = 1;
}

typedef struct fwd_case {
    const char *name;
    int64_t B, T;
    int H, HV, K, V, BT;
    int nseq; /* > 0: varlen, B = 1, T = sum of lens */
    int64_t lens[4];
    double glo, ghi; /* per-step log decay range */
    int use_h0;
} fwd_case;

static void run_case(dg_ctx *cpu, dg_ctx *gpu, const fwd_case *c, uint64_t seed) {
    int64_t cu[5];
    dg_kda_opts opts;
    kda_cfg cfg;
    kda_cuda_dims dd;
    case_tables("test_kda_cuda_fwd", cpu, gpu, c->B, c->T, c->H, c->HV, c->K, c->V, c->BT, c->nseq,
                c->lens, DG_F32, cu, &opts, &cfg, &dd);
    const kda_dims *d = &cfg.d;
    const int64_t TT = c->B * c->T, NC = kda_cfg_nc(&cfg);
    const int N = d->N, H = c->H, HV = c->HV, K = c->K, V = c->V, BT = c->BT;
    const float scale = 1.0f / sqrtf((float)K);
    dg_check(dd.NC == NC, "%s: device tables hold NC=%lld chunks (CPU %lld)", c->name,
             (long long)dd.NC, (long long)NC);
    printf("-- case: %s (TT=%lld N=%d NC=%lld H=%d HV=%d K=%d V=%d BT=%d, g in [%g,%g], h0 %s)\n",
           c->name, (long long)TT, N, (long long)NC, H, HV, K, V, BT, c->glo, c->ghi,
           c->use_h0 ? "random" : "NULL");

    /* ---- CPU inputs and the CPU chain of references */
    dg_tensor *qraw = mk_rand(cpu, TT, H, K, 0, seed + 1, -1, 1);
    dg_tensor *kraw = mk_rand(cpu, TT, H, K, 0, seed + 2, -1, 1);
    dg_tensor *v = mk_rand(cpu, TT, HV, V, 0, seed + 3, -1, 1);
    dg_tensor *graw = mk_rand(cpu, TT, HV, K, 0, seed + 4, c->glo, c->ghi);
    dg_tensor *braw = mk_rand(cpu, TT, HV, 0, 0, seed + 5, -3, 3);
    dg_tensor *h0 = c->use_h0 ? mk_rand(cpu, N, HV, K, V, seed + 6, -1, 1) : NULL;
    dg_tensor *xg = mk_rand(cpu, TT, HV, K, 0, seed + 7, -3, 3);
    dg_tensor *Alog = mk_rand(cpu, HV, 0, 0, 0, seed + 8, 0, 2.77); /* log U(1,16) */
    dg_tensor *dtb = mk_rand(cpu, (int64_t)HV * K, 0, 0, 0, seed + 9, -1, 1);

    dg_tensor *q = mk(cpu, TT, H, K, 0), *k = mk(cpu, TT, H, K, 0), *rq = mk(cpu, TT, H, 0, 0);
    dg__kda_l2norm_fwd_f32(TT * H, K, F(qraw), F(q), F(rq));
    dg__kda_l2norm_fwd_f32(TT * H, K, F(kraw), F(k), NULL);
    dg_tensor *beta = mk(cpu, TT, HV, 0, 0), *beta2 = mk(cpu, TT, HV, 0, 0);
    dg__kda_beta_fwd_f32(TT * HV, 1.0f, F(braw), F(beta));
    dg__kda_beta_fwd_f32(TT * HV, 2.0f, F(braw), F(beta2));
    dg_tensor *G = mk(cpu, TT, HV, K, 0);
    dg__kda_gate_fwd_f32(d, DG_GATE_NONE, 0.f, 1, F(graw), NULL, NULL, F(G));
    dg_tensor *Aqk = mk(cpu, TT, HV, BT, 0), *Tm = mk(cpu, TT, HV, BT, 0);
    DG_TEST_TRY(dg__kda_intra_fwd_f32(d, scale, F(q), F(k), F(beta), F(G), F(Aqk), F(Tm)));
    dg_tensor *W = mk(cpu, TT, HV, K, 0), *U = mk(cpu, TT, HV, V, 0);
    dg_tensor *KG = mk(cpu, TT, HV, K, 0), *QG = mk(cpu, TT, HV, K, 0);
    DG_TEST_TRY(
        dg__kda_wy_fwd_f32(d, F(q), F(k), F(v), F(beta), F(G), F(Tm), F(W), F(U), F(KG), F(QG)));
    dg_tensor *h = mk(cpu, NC, HV, K, V), *E = mk(cpu, TT, HV, V, 0), *ht = mk(cpu, N, HV, K, V);
    DG_TEST_TRY(dg__kda_state_fwd_f32(d, F(W), F(U), F(KG), F(G), F(h0), F(h), F(E), F(ht)));
    dg_tensor *O = mk(cpu, TT, HV, V, 0);
    dg__kda_output_fwd_f32(d, scale, F(QG), F(h), F(Aqk), F(E), F(O));
    dg_tensor *orec = mk(cpu, TT, HV, V, 0), *htrec = mk(cpu, N, HV, K, V);
    DG_TEST_TRY(dg__kda_recurrent_fwd_f32(d, scale, F(q), F(k), F(v), F(graw), F(beta), F(h0),
                                          F(orec), F(htrec)));

    /* ---- the same inputs on the device */
    dg_tensor *qraw_d = up(gpu, qraw), *q_d = up(gpu, q), *k_d = up(gpu, k), *v_d = up(gpu, v);
    dg_tensor *graw_d = up(gpu, graw), *braw_d = up(gpu, braw), *xg_d = up(gpu, xg);
    dg_tensor *Alog_d = up(gpu, Alog), *dtb_d = up(gpu, dtb), *beta_d = up(gpu, beta);
    dg_tensor *G_d = up(gpu, G), *Tm_d = up(gpu, Tm), *Aqk_d = up(gpu, Aqk);
    dg_tensor *W_d = up(gpu, W), *U_d = up(gpu, U), *KG_d = up(gpu, KG), *QG_d = up(gpu, QG);
    dg_tensor *h_d = up(gpu, h), *E_d = up(gpu, E);
    dg_tensor *h0_d = h0 ? up(gpu, h0) : NULL;
    dg_tensor *o1, *o2, *o3, *o4;

    /* l2norm: y and 1/norm of the raw q rows */
    o1 = poisoned(gpu, q);
    o2 = poisoned(gpu, rq);
    dg_check_ok(dg__kda_l2norm_fwd_cuda(gpu, TT * H, K, 0, F(qraw_d), F(o1), F(o2)),
                "l2norm launch");
    cmp(F_L2, c->name, "y", o1, q, TOL_F32);
    cmp(F_L2, c->name, "r", o2, rq, TOL_F32);
    dg_tensor_free(&o1);
    dg_tensor_free(&o2);

    /* beta, c = 1 and c = 2 */
    o1 = poisoned(gpu, beta);
    o2 = poisoned(gpu, beta);
    dg_check_ok(dg__kda_beta_fwd_cuda(gpu, TT * HV, 1.0f, 0, F(braw_d), F(o1)), "beta c=1 launch");
    dg_check_ok(dg__kda_beta_fwd_cuda(gpu, TT * HV, 2.0f, 0, F(braw_d), F(o2)), "beta c=2 launch");
    cmp(F_BETA, c->name, "c=1", o1, beta, TOL_F32);
    cmp(F_BETA, c->name, "c=2", o2, beta2, TOL_F32);
    dg_tensor_free(&o1);
    dg_tensor_free(&o2);

    /* gate: every kind, with and without the chunk cumsum */
    struct {
        const char *what;
        dg_gate_kind kind;
        int cumsum, use_A, use_b;
        const dg_tensor *x, *xd;
    } gk[] = {
        {"NONE cumsum", DG_GATE_NONE, 1, 0, 0, graw, graw_d},
        {"KDA cumsum", DG_GATE_KDA, 1, 1, 1, xg, xg_d},
        {"KDA no cumsum", DG_GATE_KDA, 0, 1, 1, xg, xg_d},
        {"KDA cumsum no dt_bias", DG_GATE_KDA, 1, 1, 0, xg, xg_d},
        {"LOWERBOUND cumsum", DG_GATE_LOWERBOUND, 1, 1, 1, xg, xg_d},
        {"LOWERBOUND no A_log/dt_bias", DG_GATE_LOWERBOUND, 1, 0, 0, xg, xg_d},
    };
    for (size_t i = 0; i < sizeof gk / sizeof gk[0]; i++) {
        dg_tensor *want = mk(cpu, TT, HV, K, 0);
        dg__kda_gate_fwd_f32(d, gk[i].kind, -5.0f, gk[i].cumsum, F(gk[i].x),
                             gk[i].use_A ? F(Alog) : NULL, gk[i].use_b ? F(dtb) : NULL, F(want));
        o1 = poisoned(gpu, want);
        dg_check_ok(dg__kda_gate_fwd_cuda(gpu, &dd, gk[i].kind, -5.0f, gk[i].cumsum, 0, F(gk[i].xd),
                                          gk[i].use_A ? F(Alog_d) : NULL,
                                          gk[i].use_b ? F(dtb_d) : NULL, F(o1)),
                    "gate launch");
        cmp(F_GATE, c->name, gk[i].what, o1, want, TOL_F32);
        dg_tensor_free(&o1);
        dg_tensor_free(&want);
    }

    /* intra */
    o1 = poisoned(gpu, Aqk);
    o2 = poisoned(gpu, Tm);
    dg_check_ok(
        dg__kda_intra_fwd_cuda(gpu, &dd, scale, F(q_d), F(k_d), F(beta_d), F(G_d), F(o1), F(o2)),
        "intra launch");
    cmp(F_INTRA, c->name, "Aqk", o1, Aqk, TOL_F32);
    cmp(F_INTRA, c->name, "Tm", o2, Tm, TOL_F32);
    dg_tensor_free(&o1);
    dg_tensor_free(&o2);

    /* wy: all four outputs, then W alone and U + QG (NULL outputs are skipped) */
    o1 = poisoned(gpu, W);
    o2 = poisoned(gpu, U);
    o3 = poisoned(gpu, KG);
    o4 = poisoned(gpu, QG);
    dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &dd, F(q_d), F(k_d), F(v_d), F(beta_d), F(G_d), F(Tm_d),
                                    F(o1), F(o2), F(o3), F(o4)),
                "wy launch");
    cmp(F_WY, c->name, "W", o1, W, TOL_F32);
    cmp(F_WY, c->name, "U", o2, U, TOL_F32);
    cmp(F_WY, c->name, "KG", o3, KG, TOL_F32);
    cmp(F_WY, c->name, "QG", o4, QG, TOL_F32);
    DG_TEST_TRY(dg_tensor_fill_(o1, NAN));
    DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
    DG_TEST_TRY(dg_tensor_fill_(o4, NAN));
    dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &dd, NULL, F(k_d), NULL, F(beta_d), F(G_d), F(Tm_d), F(o1),
                                    NULL, NULL, NULL),
                "wy launch (W only)");
    cmp(F_WY, c->name, "W (alone)", o1, W, TOL_F32);
    dg_check_ok(dg__kda_wy_fwd_cuda(gpu, &dd, F(q_d), NULL, F(v_d), F(beta_d), F(G_d), F(Tm_d),
                                    NULL, F(o2), NULL, F(o4)),
                "wy launch (U and QG)");
    cmp(F_WY, c->name, "U (with QG)", o2, U, TOL_F32);
    cmp(F_WY, c->name, "QG (with U)", o4, QG, TOL_F32);
    dg_tensor_free(&o1);
    dg_tensor_free(&o2);
    dg_tensor_free(&o3);
    dg_tensor_free(&o4);

    /* state, with and without ht */
    o1 = poisoned(gpu, h);
    o2 = poisoned(gpu, E);
    o3 = poisoned(gpu, ht);
    dg_check_ok(dg__kda_state_fwd_cuda(gpu, &dd, F(W_d), F(U_d), F(KG_d), F(G_d), F(h0_d), F(o1),
                                       F(o2), F(o3)),
                "state launch");
    cmp(F_STATE, c->name, "h", o1, h, TOL_F32);
    cmp(F_STATE, c->name, "E", o2, E, TOL_F32);
    cmp(F_STATE, c->name, "ht", o3, ht, TOL_F32);
    DG_TEST_TRY(dg_tensor_fill_(o2, NAN));
    dg_check_ok(dg__kda_state_fwd_cuda(gpu, &dd, F(W_d), F(U_d), F(KG_d), F(G_d), F(h0_d), F(o1),
                                       F(o2), NULL),
                "state launch (no ht)");
    cmp(F_STATE, c->name, "E (no ht)", o2, E, TOL_F32);
    dg_tensor_free(&o1);
    dg_tensor_free(&o2);
    dg_tensor_free(&o3);

    /* output */
    o1 = poisoned(gpu, O);
    dg_check_ok(dg__kda_output_fwd_cuda(gpu, &dd, scale, F(QG_d), F(h_d), F(Aqk_d), F(E_d), F(o1)),
                "output launch");
    cmp(F_OUTPUT, c->name, "O", o1, O, TOL_F32);
    dg_tensor_free(&o1);

    /* recurrence */
    o1 = poisoned(gpu, orec);
    o2 = poisoned(gpu, htrec);
    dg_check_ok(dg__kda_recurrent_fwd_cuda(gpu, &dd, scale, F(q_d), F(k_d), F(v_d), F(graw_d),
                                           F(beta_d), F(h0_d), F(o1), F(o2)),
                "recurrent launch");
    cmp(F_REC, c->name, "o", o1, orec, TOL_F32);
    cmp(F_REC, c->name, "ht", o2, htrec, TOL_F32);

    /* the whole chunked forward on the device (from raw q, k, g, b) vs the device recurrence */
    {
        dg_tensor *qd = poisoned(gpu, q), *kd = poisoned(gpu, k), *bd = poisoned(gpu, beta);
        dg_tensor *Gd = poisoned(gpu, G), *Ad = poisoned(gpu, Aqk), *Td = poisoned(gpu, Tm);
        dg_tensor *Wd = poisoned(gpu, W), *Ud = poisoned(gpu, U), *KGd = poisoned(gpu, KG);
        dg_tensor *QGd = poisoned(gpu, QG), *hd = poisoned(gpu, h), *Ed = poisoned(gpu, E);
        dg_tensor *htd = poisoned(gpu, ht), *Od = poisoned(gpu, O);
        dg_tensor *kraw_d = up(gpu, kraw);
        dg_status st = dg__kda_l2norm_fwd_cuda(gpu, TT * H, K, 0, F(qraw_d), F(qd), NULL);
        if (st == DG_OK)
            st = dg__kda_l2norm_fwd_cuda(gpu, TT * H, K, 0, F(kraw_d), F(kd), NULL);
        if (st == DG_OK)
            st = dg__kda_beta_fwd_cuda(gpu, TT * HV, 1.0f, 0, F(braw_d), F(bd));
        if (st == DG_OK)
            st = dg__kda_gate_fwd_cuda(gpu, &dd, DG_GATE_NONE, 0.f, 1, 0, F(graw_d), NULL, NULL,
                                       F(Gd));
        if (st == DG_OK)
            st = dg__kda_intra_fwd_cuda(gpu, &dd, scale, F(qd), F(kd), F(bd), F(Gd), F(Ad), F(Td));
        if (st == DG_OK)
            st = dg__kda_wy_fwd_cuda(gpu, &dd, F(qd), F(kd), F(v_d), F(bd), F(Gd), F(Td), F(Wd),
                                     F(Ud), F(KGd), F(QGd));
        if (st == DG_OK)
            st = dg__kda_state_fwd_cuda(gpu, &dd, F(Wd), F(Ud), F(KGd), F(Gd), F(h0_d), F(hd),
                                        F(Ed), F(htd));
        if (st == DG_OK)
            st = dg__kda_output_fwd_cuda(gpu, &dd, scale, F(QGd), F(hd), F(Ad), F(Ed), F(Od));
        if (dg_check_ok(st, "chunked pipeline on the device")) {
            cmp(F_E2E, c->name, "O", Od, o1, TOL_CHUNK_VS_REC);
            cmp(F_E2E, c->name, "final state", htd, o2, TOL_CHUNK_VS_REC);
        }
        dg_tensor *all[] = {qd, kd, bd, Gd, Ad, Td, Wd, Ud, KGd, QGd, hd, Ed, htd, Od, kraw_d};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            dg_tensor_free(&all[i]);
    }
    dg_tensor_free(&o1);
    dg_tensor_free(&o2);

    dg_tensor *all[] = {qraw, kraw,   v,      graw,  braw,   h0,    xg,     Alog,   dtb,  q,
                        k,    rq,     beta,   beta2, G,      Aqk,   Tm,     W,      U,    KG,
                        QG,   h,      E,      ht,    O,      orec,  htrec,  qraw_d, q_d,  k_d,
                        v_d,  graw_d, braw_d, xg_d,  Alog_d, dtb_d, beta_d, G_d,    Tm_d, Aqk_d,
                        W_d,  U_d,    KG_d,   QG_d,  h_d,    E_d,   h0_d};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dg_tensor_free(&all[i]);
    dg__kda_cuda_dims_free(gpu, &dd);
    dg__kda_cfg_free(&cfg);
}

/* ---- timing (printed, not asserted) */

static double now_ms(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef enum { B_L2, B_BETA, B_GATE, B_INTRA, B_WY, B_STATE, B_OUTPUT, B_REC, NB } bench_stage;

typedef struct bench_bufs {
    kda_cuda_dims *dd;
    float scale;
    dg_tensor *qraw, *kraw, *q, *k, *v, *x, *Alog, *dtb, *b, *beta, *g, *G, *Aqk, *Tm, *W, *U, *KG,
        *QG, *h, *E, *ht, *O, *o;
} bench_bufs;

static dg_status bench_run(dg_ctx *gpu, bench_bufs *z, bench_stage s) {
    const kda_cuda_dims *d = z->dd;
    switch (s) {
    case B_L2:
        DG_TRY(dg__kda_l2norm_fwd_cuda(gpu, d->TT * d->H, d->K, 0, F(z->qraw), F(z->q), NULL));
        return dg__kda_l2norm_fwd_cuda(gpu, d->TT * d->H, d->K, 0, F(z->kraw), F(z->k), NULL);
    case B_BETA:
        return dg__kda_beta_fwd_cuda(gpu, d->TT * d->HV, 1.0f, 0, F(z->b), F(z->beta));
    case B_GATE:
        return dg__kda_gate_fwd_cuda(gpu, d, DG_GATE_KDA, 0.f, 1, 0, F(z->x), F(z->Alog), F(z->dtb),
                                     F(z->G));
    case B_INTRA:
        return dg__kda_intra_fwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->beta), F(z->G),
                                      F(z->Aqk), F(z->Tm));
    case B_WY:
        return dg__kda_wy_fwd_cuda(gpu, d, F(z->q), F(z->k), F(z->v), F(z->beta), F(z->G), F(z->Tm),
                                   F(z->W), F(z->U), F(z->KG), F(z->QG));
    case B_STATE:
        return dg__kda_state_fwd_cuda(gpu, d, F(z->W), F(z->U), F(z->KG), F(z->G), NULL, F(z->h),
                                      F(z->E), F(z->ht));
    case B_OUTPUT:
        return dg__kda_output_fwd_cuda(gpu, d, z->scale, F(z->QG), F(z->h), F(z->Aqk), F(z->E),
                                       F(z->O));
    case B_REC:
        return dg__kda_recurrent_fwd_cuda(gpu, d, z->scale, F(z->q), F(z->k), F(z->v), F(z->g),
                                          F(z->beta), NULL, F(z->o), F(z->ht));
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
    z.qraw = mk_rand(gpu, TT, H, K, 0, 101, -1, 1);
    z.kraw = mk_rand(gpu, TT, H, K, 0, 102, -1, 1);
    z.v = mk_rand(gpu, TT, HV, V, 0, 103, -1, 1);
    z.x = mk_rand(gpu, TT, HV, K, 0, 104, -3, 3);
    z.Alog = mk_rand(gpu, HV, 0, 0, 0, 105, 0, 2.77);
    z.dtb = mk_rand(gpu, (int64_t)HV * K, 0, 0, 0, 106, -1, 1);
    z.b = mk_rand(gpu, TT, HV, 0, 0, 107, -3, 3);
    z.q = mk(gpu, TT, H, K, 0);
    z.k = mk(gpu, TT, H, K, 0);
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
    z.ht = mk(gpu, N, HV, K, V);
    z.O = mk(gpu, TT, HV, V, 0);
    z.o = mk(gpu, TT, HV, V, 0);
    /* per-step log decay for the recurrence: the same gate without the cumsum */
    DG_TEST_TRY(dg__kda_gate_fwd_cuda(gpu, &dd, DG_GATE_KDA, 0.f, 0, 0, F(z.x), F(z.Alog), F(z.dtb),
                                      F(z.g)));
    static const char *names[NB] = {"l2norm (q and k)",
                                    "beta",
                                    "gate KDA + cumsum",
                                    "intra",
                                    "wy (W, U, KG, QG)",
                                    "state",
                                    "output",
                                    "recurrent (ref)"};
    double med[NB], mn[NB];
    printf("-- timing: (B,T,H,HV,K,V,BT) = (%lld,%lld,%d,%d,%d,%d,%d), median of %d runs, "
           "host clock around dg_ctx_sync\n",
           (long long)B, (long long)T, H, HV, K, V, BT, R);
    for (int s = 0; s < NB; s++) {
        double t[10];
        DG_TEST_TRY(bench_run(gpu, &z, (bench_stage)s)); /* warm-up, and inputs of later stages */
        DG_TEST_TRY(dg_ctx_sync(gpu));
        for (int r = 0; r < R; r++) {
            double t0 = now_ms();
            DG_TEST_TRY(bench_run(gpu, &z, (bench_stage)s));
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
    printf("   %-22s %10.3f   (sum of the chunked stages' medians)\n", "chunked forward", chunked);
    dg_check(chunked > 0 && isfinite(chunked), "timing table printed (not an assertion on speed)");
    dg_tensor *all[] = {z.qraw, z.kraw, z.q, z.k, z.v,  z.x,  z.Alog, z.dtb, z.b,  z.beta, z.g, z.G,
                        z.Aqk,  z.Tm,   z.W, z.U, z.KG, z.QG, z.h,    z.E,   z.ht, z.O,    z.o};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dg_tensor_free(&all[i]);
    dg__kda_cuda_dims_free(gpu, &dd);
}

/* ---- argument checks (no device touched: every one fails before a CUDA call) */

static void test_args(void) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    int64_t cu[3] = {0, 40, 100}, off[3] = {0, 3, 7}, bad_off[3] = {0, 2, 6};
    kda_cuda_dims dd;
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 4, 64, 64, 48, 2, cu, off, &dd), DG_ERR_ARG,
                 "BT must be 16, 32 or 64", "dims_new: BT = 48");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 4, 320, 64, 16, 2, cu, off, &dd), DG_ERR_SHAPE,
                 "K <= 256", "dims_new: K = 320");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 3, 64, 64, 16, 2, cu, off, &dd), DG_ERR_SHAPE,
                 "HV % H == 0", "dims_new: HV not a multiple of H");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 100, 2, 4, 64, 64, 16, 2, cu, bad_off, &dd), DG_ERR_ARG,
                 "chunk_off gives it", "dims_new: chunk_off inconsistent with cu");
    dg_check_err(dg__kda_cuda_dims_new(cpu, 99, 2, 4, 64, 64, 16, 2, cu, off, &dd), DG_ERR_ARG,
                 "cu must run from 0 to TT", "dims_new: cu[N] != TT");
    dg_check(dd.buf == NULL && dd.NC == 0, "failed dims_new leaves the struct empty");
    float x = 0.f;
    dg_check_err(dg__kda_intra_fwd_cuda(cpu, NULL, 1.f, &x, &x, &x, &x, &x, &x), DG_ERR_ARG,
                 "dg__kda_cuda_dims_new", "intra: NULL dims");
    dg_check_err(dg__kda_l2norm_fwd_cuda(cpu, 4, 0, 0, &x, &x, NULL), DG_ERR_ARG, "K=0",
                 "l2norm: K = 0");
    dg_ctx_free(&cpu);
}

int main(int argc, char **argv) {
    int gpu_mode = dg_test_init(argc, argv, "kda_cuda_fwd");
    if (!gpu_mode) {
        test_args();
        return dg_test_finish();
    }
    int skip = dg_test_need_gpu();
    if (skip)
        return skip;
    dg_ctx *cpu = NULL, *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    const fwd_case cases[] = {
        {"B=2 T=100 BT=64 K=V=64", 2, 100, 2, 2, 64, 64, 64, 0, {0}, -0.5, -0.01, 1},
        {"B=2 T=75 BT=16 GVA K=V=64 no h0", 2, 75, 1, 2, 64, 64, 16, 0, {0}, -0.5, -0.01, 0},
        {"varlen 37/64/91 BT=32 GVA K=128 V=64",
         1,
         192,
         2,
         4,
         128,
         64,
         32,
         3,
         {37, 64, 91},
         -0.5,
         -0.01,
         1},
        {"varlen 37/64/91 BT=64 K=128 V=64",
         1,
         192,
         2,
         2,
         128,
         64,
         64,
         3,
         {37, 64, 91},
         -0.5,
         -0.01,
         1},
        {"B=2 T=130 BT=64 GVA K=128 V=64", 2, 130, 2, 4, 128, 64, 64, 0, {0}, -0.5, -0.01, 1},
        {"B=1 T=45 BT=32 K=V=256", 1, 45, 1, 2, 256, 256, 32, 0, {0}, -0.5, -0.01, 1},
        {"B=2 T=53 BT=16 K=80 V=40 (not /32)", 2, 53, 2, 2, 80, 40, 16, 0, {0}, -0.5, -0.01, 1},
        {"B=2 T=70 BT=32 gates -45..-35/step", 2, 70, 2, 2, 64, 64, 32, 0, {0}, -45, -35, 1},
        {"varlen 1/64/20 BT=64 gates -45..-35/step",
         1,
         85,
         1,
         2,
         64,
         64,
         64,
         3,
         {1, 64, 20},
         -45,
         -35,
         0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(cpu, gpu, &cases[i], 1000 * (uint64_t)(i + 1));

    printf("-- largest norm-relative error per function over all cases (tolerance %.0e; "
           "chunked vs recurrent %.0e)\n",
           TOL_F32, TOL_CHUNK_VS_REC);
    for (int f = 0; f < NF; f++)
        printf("   %-28s %.3e%s\n", fn_names[f], g_worst[f], g_seen[f] ? "" : " (not run)");

    bench(gpu);
    dg_ctx_free(&gpu);
    dg_ctx_free(&cpu);
    return dg_test_finish();
}
#endif

/*
 * tests/test_kda_stages.c -- every KDA stage node on its own against central finite differences
 * (f64): l2norm, beta, gate_cumsum (gate kinds NONE, KDA, LOWERBOUND with and without A_log),
 * intra, wy, state (with/without h0, both policies, varlen), output. Shapes are tiny but give two
 * chunks with the second one partial (T = 20, BT = 16), GVA (HV = 2H) where the stage sees heads.
 */
#include "harness.h"
#include "kda_testutil.h"

typedef enum { S_L2, S_BETA, S_GATE, S_INTRA, S_WY, S_STATE, S_OUTPUT } stage;

typedef struct st_user {
    stage s;
    dg_kda_opts opts;
    int neg; /* beta: allow_neg_eigval */
    int want_ht;
} st_user;

static dg_status stage_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                          void *user) {
    const st_user *u = (const st_user *)user;
    switch (u->s) {
    case S_L2:
        return dg_kda_l2norm(ctx, in[0], &out[0]);
    case S_BETA:
        return dg_kda_beta(ctx, in[0], u->neg, &out[0]);
    case S_GATE:
        return dg_kda_gate_cumsum(ctx, in[0], in[1], in[2], &u->opts, &out[0]);
    case S_INTRA:
        return dg_kda_intra(ctx, in[0], in[1], in[2], in[3], &u->opts, &out[0], &out[1]);
    case S_WY:
        return dg_kda_wy(ctx, in[0], in[1], in[2], in[3], in[4], in[5], &u->opts, &out[0], &out[1],
                         &out[2], &out[3]);
    case S_STATE:
        return dg_kda_state(ctx, in[0], in[1], in[2], in[3], in[4], &u->opts, &out[0], &out[1],
                            u->want_ht ? &out[2] : NULL);
    case S_OUTPUT:
        return dg_kda_output(ctx, in[0], in[1], in[2], in[3], &u->opts, &out[0]);
    }
    return DG_ERR_ARG;
}

/* Up to 6 inputs described by shape and fill. */
typedef struct spec_in {
    int ndim;
    int64_t shape[5];
    int fill; /* 0 normal, 1 uniform(lo,hi), 2 chunk cumsum of uniform(-0.5,-0.01) [B,T,HV,K] */
    double lo, hi;
} spec_in;

static double *fill_host(const spec_in *s, uint64_t seed, int BT, const int64_t *cu, int nseq) {
    int64_t n = kt_numel(s->ndim, s->shape);
    if (s->fill == 0)
        return kt_randn(n, seed, s->lo != 0 ? s->lo : 1.0);
    if (s->fill == 1)
        return kt_rand(n, seed, s->lo, s->hi);
    /* G: per sequence (cu or rows of T), per chunk, inclusive cumsum over tokens */
    double *x = kt_rand(n, seed, -0.5, -0.01);
    const int64_t B = s->shape[0], T = s->shape[1], row = s->shape[2] * s->shape[3];
    int64_t starts[64], ns = 0;
    if (cu) {
        for (int i = 0; i <= nseq; i++)
            starts[ns++] = cu[i];
    } else {
        for (int64_t b = 0; b <= B; b++)
            starts[ns++] = b * T;
    }
    for (int64_t q = 0; q + 1 < ns; q++)
        for (int64_t t = starts[q]; t < starts[q + 1]; t++)
            if ((t - starts[q]) % BT != 0)
                for (int64_t e = 0; e < row; e++)
                    x[t * row + e] += x[(t - 1) * row + e];
    return x;
}

static void check_stage(dg_ctx *ctx, const char *name, st_user *u, int n_in, const spec_in *sp,
                        int n_out, uint64_t seed) {
    dg_tensor *t[6] = {0};
    const int BT = u->opts.chunk_size ? u->opts.chunk_size : 64;
    for (int i = 0; i < n_in; i++) {
        if (sp[i].ndim == 0)
            continue; /* an absent optional input */
        double *x =
            fill_host(&sp[i], seed + 17 * (uint64_t)i, BT, u->opts.cu_seqlens, u->opts.n_seqs);
        t[i] = kt_tensor(ctx, DG_F64, sp[i].ndim, sp[i].shape, x, 1);
        free(x);
    }
    dg_gradcheck_report rep;
    dg_status s = dg_gradcheck(ctx, stage_fn, u, t, n_in, n_out, 1e-6, seed, &rep);
    if (!dg_check_ok(s, name))
        goto done;
    for (int i = 0; i < n_in; i++)
        if (t[i])
            printf("     input %d rel err %.3e\n", i, rep.rel_err[i]);
    /* central differences, eps 1e-6, f64: expect ~1e-9; 1e-6 leaves room for curvature */
    dg_check(rep.max_rel_err < 1e-6, "gradcheck %-44s max rel err %.3e (tol 1e-6)", name,
             rep.max_rel_err);
done:
    for (int i = 0; i < n_in; i++)
        dg_tensor_free(&t[i]);
}

enum { B = 1, T = 20, H = 1, HV = 2, K = 4, V = 3, BT = 16, NT = 2 };

static void cpu_cases(dg_ctx *ctx) {
    st_user u;
    memset(&u, 0, sizeof u);
    u.opts.chunk_size = BT;

    const spec_in qk = {4, {B, T, H, K}, 0, 0, 0};
    const spec_in vv = {4, {B, T, HV, V}, 0, 0, 0};
    const spec_in bb = {3, {B, T, HV}, 1, 0.05, 0.95};
    const spec_in GG = {4, {B, T, HV, K}, 2, 0, 0};
    const spec_in kv = {4, {B, T, HV, K}, 0, 0.5, 0};
    const spec_in vk = {4, {B, T, HV, V}, 0, 0.5, 0};
    const spec_in mat = {4, {B, T, HV, BT}, 1, -0.5, 0.5};
    const spec_in hh = {5, {B, NT, HV, K, V}, 0, 0.5, 0};
    const spec_in h0 = {4, {B, HV, K, V}, 0, 0.5, 0};
    const spec_in none = {0, {0}, 0, 0, 0};

    printf("-- N1 l2norm, N2 beta\n");
    for (int p = 0; p < 2; p++) {
        dg_policy_set_global(p ? DG_POLICY_RECOMPUTE : DG_POLICY_CACHE);
        u.s = S_L2;
        check_stage(ctx, p ? "l2norm (RECOMPUTE)" : "l2norm (CACHE)", &u, 1, &qk, 1, 11);
    }
    dg_policy_reset();
    u.s = S_BETA;
    spec_in braw = {3, {B, T, HV}, 0, 2.0, 0};
    check_stage(ctx, "beta c=1", &u, 1, &braw, 1, 12);
    u.neg = 1;
    check_stage(ctx, "beta c=2 (allow_neg_eigval)", &u, 1, &braw, 1, 13);

    printf("-- N3 gate_cumsum\n");
    u.s = S_GATE;
    const spec_in gneg = {4, {B, T, HV, K}, 1, -0.5, -0.01};
    const spec_in graw = {4, {B, T, HV, K}, 0, 1.0, 0};
    const spec_in alog = {1, {HV}, 1, -0.5, 1.0};
    const spec_in dtb = {1, {HV * K}, 0, 0.5, 0};
    spec_in gin[3] = {gneg, none, none};
    u.opts.gate = DG_GATE_NONE;
    check_stage(ctx, "gate_cumsum NONE", &u, 3, gin, 1, 21);
    gin[0] = graw;
    gin[1] = alog;
    gin[2] = dtb;
    u.opts.gate = DG_GATE_KDA;
    check_stage(ctx, "gate_cumsum KDA + A_log + dt_bias", &u, 3, gin, 1, 22);
    u.opts.gate = DG_GATE_LOWERBOUND;
    check_stage(ctx, "gate_cumsum LOWERBOUND lb=-5 + A_log + dt_bias", &u, 3, gin, 1, 23);
    u.opts.lower_bound = -2;
    gin[1] = none;
    check_stage(ctx, "gate_cumsum LOWERBOUND lb=-2, no A_log", &u, 3, gin, 1, 24);
    u.opts.gate = DG_GATE_NONE;
    u.opts.lower_bound = 0;

    printf("-- N4 intra, N5 wy\n");
    u.s = S_INTRA;
    const spec_in iin[4] = {qk, qk, bb, GG};
    check_stage(ctx, "intra (GVA, 2 chunks, 2nd partial)", &u, 4, iin, 2, 31);
    u.s = S_WY;
    const spec_in win[6] = {qk, qk, vv, bb, GG, mat};
    check_stage(ctx, "wy (GVA, 2 chunks, 2nd partial)", &u, 6, win, 4, 41);

    printf("-- N6 state, N7 output\n");
    u.s = S_STATE;
    const spec_in sin_[5] = {kv, vk, kv, GG, h0};
    for (int p = 0; p < 2; p++) {
        dg_policy_set("kda_state", p ? DG_POLICY_CACHE : DG_POLICY_RECOMPUTE);
        u.want_ht = 1;
        check_stage(ctx, p ? "state + h0 + ht (CACHE)" : "state + h0 + ht (RECOMPUTE)", &u, 5, sin_,
                    3, 51 + (uint64_t)p);
    }
    dg_policy_reset();
    const spec_in sin0[5] = {kv, vk, kv, GG, none};
    u.want_ht = 0;
    check_stage(ctx, "state, no h0, no ht", &u, 5, sin0, 2, 53);
    const int64_t cu[4] = {0, 3, 8, 20}; /* chunks: 1 + 1 + 1 = 3 */
    u.opts.cu_seqlens = cu;
    u.opts.n_seqs = 3;
    const spec_in h0v = {4, {3, HV, K, V}, 0, 0.5, 0};
    const spec_in sinv[5] = {kv, vk, kv, GG, h0v};
    u.want_ht = 1;
    check_stage(ctx, "state varlen 3+5+12 + h0 + ht", &u, 5, sinv, 3, 54);
    u.s = S_OUTPUT;
    const spec_in hv3 = {5, {B, 3, HV, K, V}, 0, 0.5, 0};
    const spec_in oinv[4] = {kv, hv3, mat, vk};
    check_stage(ctx, "output varlen 3+5+12", &u, 4, oinv, 1, 61);
    u.opts.cu_seqlens = NULL;
    u.opts.n_seqs = 0;
    const spec_in oin[4] = {kv, hh, mat, vk};
    check_stage(ctx, "output (2 chunks, 2nd partial)", &u, 4, oin, 1, 62);

    printf("-- stage argument checks\n");
    {
        int64_t s4[4] = {B, T, HV, K}, sa[4] = {B, T, HV, 32}, shh[5] = {B, NT, HV, K, V};
        int64_t se[4] = {B, T, HV, V};
        dg_tensor *QG = NULL, *A = NULL, *h = NULL, *E = NULL, *o = NULL, *h2 = NULL, *E2 = NULL;
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, s4, &QG));
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sa, &A));
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 5, shh, &h));
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, se, &E));
        dg_check_err(dg_kda_output(ctx, QG, h, A, E, &u.opts, &o), DG_ERR_SHAPE,
                     "Aqk must be [B,T,HV,BT]", "output: Aqk with BT=32 under chunk_size 16");
        dg_check_err(dg_kda_state(ctx, QG, E, QG, E, NULL, &u.opts, &h2, &E2, NULL), DG_ERR_SHAPE,
                     "G must be [B,T,HV,K]", "state: G given with V columns");
        dg_tensor_free(&QG);
        dg_tensor_free(&A);
        dg_tensor_free(&h);
        dg_tensor_free(&E);
    }
}

/* cpu mode only: the CPU reference; the CUDA comparisons of every KDA stage, the composite and
 * the recurrence are in test_kda_cuda.c */
int main(int argc, char **argv) { return dg_test_main(argc, argv, "kda_stages", cpu_cases, NULL); }

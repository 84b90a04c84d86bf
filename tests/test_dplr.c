/*
 * tests/test_dplr.c -- DPLR on the CPU.
 *   The recurrence (dg_dplr_recurrent): forward against a dense per-token evaluation written
 *   here, f32 against f64, finite-difference gradchecks (partial sequences, h0, varlen).
 *   The chunked form: every stage node (gate_cumsum, intra, wy, state, output) against finite
 *   differences; dg_dplr_chunk against finite differences and against the recurrence (o, ht and
 *   every gradient, f64, chunk sizes 16/32/64, T not a multiple of the chunk, varlen packs with
 *   boundaries on and off chunk boundaries and empty sequences, with and without h0, three gate
 *   ranges); f32 against f64; CACHE and RECOMPUTE giving identical gradients; KDA written as
 *   DPLR. Bad inputs, and the refusal of f64 tensors on CUDA (gpu mode; the CUDA path itself is
 *   tests/test_dplr_cuda.c).
 */
#include "harness.h"
#include "kda_testutil.h"

#include "autograd/tape.h"

enum { IQ, IK, IV, IA, IB, IG, IH0, NIN };
static const char *grad_name[NIN] = {"dq", "dk", "dv", "da", "db", "dgk", "dh0"};

typedef struct dcase {
    const char *name;
    int B, T, H, K, V, BT;
    int h0;
    const int64_t *cu;
    int nseq;
    int gate; /* gk: 0 uniform [-0.5, -0.01]; 1 logsigmoid(2 randn); 2 -e^{-1/2} sigmoid(randn) */
} dcase;

static int nseqs(const dcase *c) { return c->cu ? c->nseq : c->B; }
static int64_t numel4(const int64_t *s) { return s[0] * s[1] * s[2] * s[3]; }

/* RWKV-7-like inputs (kt_dplr_abg: a, b, and gk per c->gate). */
static void make_data(const dcase *c, uint64_t seed, kt_data *d) {
    memset(d, 0, sizeof *d);
    const int64_t B = c->B, T = c->T, N = nseqs(c);
    const int64_t sh[NIN][4] = {{B, T, c->H, c->K},   {B, T, c->H, c->K}, {B, T, c->H, c->V},
                                {B, T, c->H, c->K},   {B, T, c->H, c->K}, {B, T, c->H, c->K},
                                {N, c->H, c->K, c->V}};
    memcpy(d->shape, sh, sizeof sh);
    d->nin = NIN;
    for (int i = 0; i < NIN; i++)
        d->ndim[i] = 4;
    const int64_t nk = numel4(sh[IQ]), rows = nk / c->K;
    d->x[IQ] = kt_randn(nk, seed + 1, 1.0);
    d->x[IK] = kt_randn(nk, seed + 2, 1.0 / sqrt((double)c->K));
    d->x[IV] = kt_randn(numel4(sh[IV]), seed + 3, 1.0);
    kt_dplr_abg(rows, c->K, seed + 4, c->gate, &d->x[IA], &d->x[IB], &d->x[IG]);
    if (c->h0)
        d->x[IH0] = kt_randn(numel4(sh[IH0]), seed + 7, 0.5);
    d->no = numel4(sh[IV]);
    d->nht = numel4(sh[IH0]);
    d->dO = kt_randn(d->no, seed + 8, 1.0);
    d->dht = kt_randn(d->nht, seed + 9, 1.0);
}

static dg_dplr_opts opts_of(const dcase *c) {
    dg_dplr_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = c->BT;
    o.scale = 0.4;
    o.output_final_state = 1;
    o.cu_seqlens = c->cu;
    o.n_seqs = c->nseq;
    return o;
}

typedef dg_status (*dplr_fn)(dg_ctx *, dg_tensor *, dg_tensor *, dg_tensor *, dg_tensor *,
                             dg_tensor *, dg_tensor *, dg_tensor *, const dg_dplr_opts *,
                             dg_tensor **, dg_tensor **);

/* The op of one run: dg_dplr_chunk or dg_dplr_recurrent, with its options. */
typedef struct dcall {
    dplr_fn fn;
    dg_dplr_opts opts;
} dcall;

static dg_status dplr_op(dg_ctx *ctx, dg_tensor *const *t, const void *user, dg_tensor **o,
                         dg_tensor **ht) {
    const dcall *u = user;
    return u->fn(ctx, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], t[IH0], &u->opts, o, ht);
}

/* Forward in dtype dt, backward seeded with dO and dht. */
static void run(dg_ctx *ctx, dplr_fn fn, const dcase *c, const kt_data *d, dg_dtype dt, kt_res *r) {
    const dcall u = {fn, opts_of(c)};
    kt_run(ctx, dplr_op, &u, d, dt, r);
}

static void compare(const char *what, const dcase *c, const kt_data *d, const kt_res *got,
                    const kt_res *want, double tol) {
    kt_compare(what, c->name, grad_name, d, got, want, tol, -1, 0);
}

/* Dense evaluation: per head, the K x K transition M_t = Diag(exp(gk_t)) + b_t a_t^T is formed
 * explicitly and S_t = M_t S_{t-1} + k_t v_t^T. */
static void dense_forward(const dcase *c, const kt_data *d, double scale, double *o, double *ht) {
    const int H = c->H, K = c->K, V = c->V, N = nseqs(c);
    double *S = kt_alloc((int64_t)K * V), *S2 = kt_alloc((int64_t)K * V);
    double *M = kt_alloc((int64_t)K * K);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const int64_t t0 = c->cu ? c->cu[n] : (int64_t)n * c->T;
            const int64_t t1 = c->cu ? c->cu[n + 1] : t0 + c->T;
            for (int i = 0; i < K * V; i++)
                S[i] = d->x[IH0] ? d->x[IH0][((int64_t)n * H + h) * K * V + i] : 0;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t r = (t * H + h) * K, rv = (t * H + h) * V;
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < K; j++)
                        M[i * K + j] =
                            (i == j ? exp(d->x[IG][r + i]) : 0) + d->x[IB][r + i] * d->x[IA][r + j];
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < V; j++) {
                        double s = d->x[IK][r + i] * d->x[IV][rv + j];
                        for (int l = 0; l < K; l++)
                            s += M[i * K + l] * S[l * V + j];
                        S2[i * V + j] = s;
                    }
                memcpy(S, S2, sizeof(double) * (size_t)(K * V));
                for (int j = 0; j < V; j++) {
                    double s = 0;
                    for (int i = 0; i < K; i++)
                        s += d->x[IQ][r + i] * S[i * V + j];
                    o[rv + j] = scale * s;
                }
            }
            memcpy(ht + ((int64_t)n * H + h) * K * V, S, sizeof(double) * (size_t)(K * V));
        }
    free(S);
    free(S2);
    free(M);
}

static const int64_t cu4[] = {0, 7, 30, 31, 54};
static const int64_t cu3[] = {0, 5, 20};

/* clang-format off */
static const dcase cases[] = {
    /* name                      B   T  H  K  V  BT h0 cu nseq */
    {"[B=2 T=40 H=2 K=8 V=6]",    2, 40, 2, 8, 6, 16, 1, NULL, 0, 0},
    {"[T=1]",                     1,  1, 1, 4, 3, 16, 1, NULL, 0, 0},
    {"[T=150 no h0 K=16 V=16]",   1,150, 1,16,16, 32, 0, NULL, 0, 0},
    {"[varlen 7+23+1+23 H=2]",    1, 54, 2, 8, 4, 16, 1, cu4,  4, 0},
};
/* clang-format on */

static void test_recurrent_dense(dg_ctx *ctx) {
    printf("-- dg_dplr_recurrent forward vs the dense evaluation (f64)\n");
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const dcase *c = &cases[ci];
        kt_data d;
        make_data(c, 100 + ci, &d);
        kt_res r;
        run(ctx, dg_dplr_recurrent, c, &d, DG_F64, &r);
        double *o = kt_alloc(d.no), *ht = kt_alloc(d.nht);
        dense_forward(c, &d, 0.4, o, ht);
        char name[160];
        snprintf(name, sizeof name, "recurrent vs dense %s o", c->name);
        dg_check_rel(name, r.o, o, d.no, 1e-12);
        snprintf(name, sizeof name, "recurrent vs dense %s ht", c->name);
        dg_check_rel(name, r.ht, ht, d.nht, 1e-12);
        free(o);
        free(ht);
        kt_res_free(&r);
        kt_data_free(&d);
    }
}

static void test_recurrent_f32(dg_ctx *ctx) {
    printf("-- dg_dplr_recurrent f32 vs f64 (forward and every gradient)\n");
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const dcase *c = &cases[ci];
        kt_data d;
        make_data(c, 200 + ci, &d);
        kt_res r64, r32;
        run(ctx, dg_dplr_recurrent, c, &d, DG_F64, &r64);
        run(ctx, dg_dplr_recurrent, c, &d, DG_F32, &r32);
        compare("recurrent f32 vs f64", c, &d, &r32, &r64, 1e-5);
        kt_res_free(&r64);
        kt_res_free(&r32);
        kt_data_free(&d);
    }
}

/* ---- gradchecks ---- */

typedef struct gc_user {
    dg_dplr_opts opts;
    dplr_fn fn;
} gc_user;

static double g_last_gc; /* max rel err of the last gradcheck_case */

static dg_status gc_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                       void *user) {
    const gc_user *u = (const gc_user *)user;
    return u->fn(ctx, in[IQ], in[IK], in[IV], in[IA], in[IB], in[IG], in[IH0], &u->opts, &out[0],
                 &out[1]);
}

static void gradcheck_case(dg_ctx *ctx, dplr_fn fn, const char *fname, const dcase *c) {
    kt_data d;
    make_data(c, 4242, &d);
    dg_tensor *t[NIN];
    for (int i = 0; i < NIN; i++)
        t[i] = kt_tensor(ctx, DG_F64, 4, d.shape[i], d.x[i], 1);
    gc_user u = {opts_of(c), fn};
    dg_gradcheck_report rep;
    DG_TEST_TRY(dg_gradcheck(ctx, gc_fn, &u, t, NIN, 2, 1e-6, 99, &rep));
    for (int i = 0; i < NIN; i++)
        if (t[i])
            printf("     %-4s rel err %.3e\n", grad_name[i], rep.rel_err[i]);
    dg_check(rep.max_rel_err < 1e-6, "gradcheck %s %s: max rel err %.3e (tol 1e-6)", fname, c->name,
             rep.max_rel_err);
    g_last_gc = rep.max_rel_err;
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    kt_data_free(&d);
}

static const dcase gc_cases[] = {
    {"[T=20 H=2 K=4 V=3 h0]", 1, 20, 2, 4, 3, 16, 1, NULL, 0, 0},
    {"[varlen 5+15 K=4 V=3 h0]", 1, 20, 1, 4, 3, 16, 1, cu3, 2, 0},
    {"[T=70 K=2 V=2 h0: crosses a checkpoint]", 1, 70, 1, 2, 2, 16, 1, NULL, 0, 0},
};

static void test_recurrent_gradcheck(dg_ctx *ctx) {
    printf("-- finite-difference gradchecks of dg_dplr_recurrent (f64)\n");
    for (size_t i = 0; i < sizeof gc_cases / sizeof gc_cases[0]; i++)
        gradcheck_case(ctx, dg_dplr_recurrent, "dg_dplr_recurrent", &gc_cases[i]);
}

/* ---- stage: gate cumsum ---- */

static dg_status gc_cumsum(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                           void *user) {
    return dg_dplr_gate_cumsum(ctx, in[0], (const dg_dplr_opts *)user, &out[0], &out[1]);
}

static void test_gate_cumsum(dg_ctx *ctx) {
    printf("-- dg_dplr_gate_cumsum: direct sums, gradcheck (f64)\n");
    static const dcase cc[] = {
        {"[B=2 T=40 H=2 K=3 BT=16]", 2, 40, 2, 3, 1, 16, 0, NULL, 0, 0},
        {"[varlen 7+23+1+23 BT=32]", 1, 54, 1, 2, 1, 32, 0, cu4, 4, 0},
    };
    for (size_t ci = 0; ci < sizeof cc / sizeof cc[0]; ci++) {
        const dcase *c = &cc[ci];
        const int64_t sh[4] = {c->B, c->T, c->H, c->K}, n = numel4(sh), HK = c->H * c->K;
        double *g = kt_rand(n, 400 + ci, -0.5, -0.01), *wi = kt_alloc(n), *we = kt_alloc(n);
        dg_dplr_opts op = opts_of(c);
        for (int s = 0; s < nseqs(c); s++) { /* direct sums from each token's chunk start */
            const int64_t t0 = c->cu ? c->cu[s] : (int64_t)s * c->T;
            const int64_t t1 = c->cu ? c->cu[s + 1] : t0 + c->T;
            for (int64_t t = t0; t < t1; t++)
                for (int64_t j = 0; j < HK; j++) {
                    const int64_t cs = t0 + (t - t0) / c->BT * c->BT;
                    double e = 0;
                    for (int64_t r = cs; r < t; r++)
                        e += g[r * HK + j];
                    we[t * HK + j] = e;
                    wi[t * HK + j] = e + g[t * HK + j];
                }
        }
        dg_tensor *tg = kt_tensor(ctx, DG_F64, 4, sh, g, 1), *Gi = NULL, *Ge = NULL;
        DG_TEST_TRY(dg_dplr_gate_cumsum(ctx, tg, &op, &Gi, &Ge));
        double *hi = kt_host(Gi, n), *he = kt_host(Ge, n);
        char name[160];
        snprintf(name, sizeof name, "gate cumsum %s Gi", c->name);
        dg_check_rel(name, hi, wi, n, 1e-14);
        snprintf(name, sizeof name, "gate cumsum %s Ge", c->name);
        dg_check_rel(name, he, we, n, 1e-14);
        dg_tape_reset();
        dg_tensor_free(&Gi);
        dg_tensor_free(&Ge);
        dg_gradcheck_report rep;
        DG_TEST_TRY(dg_gradcheck(ctx, gc_cumsum, &op, &tg, 1, 2, 1e-6, 7, &rep));
        dg_check(rep.max_rel_err < 1e-8, "gradcheck dg_dplr_gate_cumsum %s: max rel err %.3e",
                 c->name, rep.max_rel_err);
        dg_tensor_free(&tg);
        free(g);
        free(wi);
        free(we);
        free(hi);
        free(he);
    }
}

/* ---- stages of the chunked form: gradchecks ---- */

/* Host chunk-local cumsums (the forward of dg_dplr_gate_cumsum written out): per sequence (rows
 * of T, or cu), per chunk of BT from the sequence start, per column of `row` values. */
static void chunk_cumsums(int64_t B, int64_t T, int64_t row, int BT, const int64_t *cu, int nseq,
                          const double *g, double *Gi, double *Ge) {
    const int N = cu ? nseq : (int)B;
    for (int n = 0; n < N; n++) {
        const int64_t t0 = cu ? cu[n] : n * T, t1 = cu ? cu[n + 1] : t0 + T;
        for (int64_t e = 0; e < row; e++) {
            double acc = 0;
            for (int64_t t = t0; t < t1; t++) {
                if ((t - t0) % BT == 0)
                    acc = 0;
                Ge[t * row + e] = acc;
                acc += g[t * row + e];
                Gi[t * row + e] = acc;
            }
        }
    }
}

typedef enum { ST_INTRA, ST_WY, ST_STATE, ST_OUTPUT } dstage;

typedef struct st_user {
    dstage s;
    dg_dplr_opts opts;
    int want_ht;
} st_user;

static dg_status stage_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                          void *user) {
    const st_user *u = (const st_user *)user;
    switch (u->s) {
    case ST_INTRA:
        return dg_dplr_intra(ctx, in[0], in[1], in[2], in[3], in[4], in[5], &u->opts, &out[0],
                             &out[1], &out[2], &out[3]);
    case ST_WY:
        return dg_dplr_wy(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], in[8],
                          &u->opts, &out[0], &out[1], &out[2], &out[3], &out[4]);
    case ST_STATE:
        return dg_dplr_state(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], &u->opts,
                             &out[0], &out[1], u->want_ht ? &out[2] : NULL);
    case ST_OUTPUT:
        return dg_dplr_output(ctx, in[0], in[1], in[2], in[3], in[4], in[5], &u->opts, &out[0]);
    }
    return DG_ERR_ARG;
}

/* Inputs of one stage check: n host arrays with their shapes (NULL data = absent input). */
typedef struct st_in {
    int n;
    int ndim[10];
    int64_t shape[10][5];
    double *x[10];
} st_in;

static void st_add(st_in *in, int ndim, const int64_t *shape, double *x) {
    in->ndim[in->n] = ndim;
    memcpy(in->shape[in->n], shape, sizeof(int64_t) * (size_t)ndim);
    in->x[in->n++] = x;
}

static void st_check(dg_ctx *ctx, const char *name, st_user *u, st_in *in, int n_out,
                     uint64_t seed) {
    dg_tensor *t[10] = {0};
    for (int i = 0; i < in->n; i++)
        t[i] = kt_tensor(ctx, DG_F64, in->ndim[i], in->shape[i], in->x[i], 1);
    dg_gradcheck_report rep;
    dg_status st = dg_gradcheck(ctx, stage_fn, u, t, in->n, n_out, 1e-6, seed, &rep);
    if (dg_check_ok(st, name)) {
        for (int i = 0; i < in->n; i++)
            if (t[i])
                printf("     input %d rel err %.3e\n", i, rep.rel_err[i]);
        dg_check(rep.max_rel_err < 1e-6, "gradcheck %-48s max rel err %.3e (tol 1e-6)", name,
                 rep.max_rel_err);
    }
    dg_tape_reset();
    for (int i = 0; i < in->n; i++) {
        dg_tensor_free(&t[i]);
        free(in->x[i]);
    }
    memset(in, 0, sizeof *in);
}

static int64_t n_chunks(const dcase *c) {
    if (!c->cu)
        return (int64_t)c->B * ((c->T + c->BT - 1) / c->BT);
    int64_t nc = 0;
    for (int n = 0; n < c->nseq; n++)
        nc += (c->cu[n + 1] - c->cu[n] + c->BT - 1) / c->BT;
    return nc;
}

/* Every stage node of one case against central differences (f64). */
static void stage_gradchecks(dg_ctx *ctx, const dcase *c, uint64_t seed) {
    const int64_t B = c->B, T = c->T, H = c->H, K = c->K, V = c->V, BT = c->BT;
    const int64_t N = nseqs(c), NC = n_chunks(c);
    const int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, sa[4] = {B, T, H, BT};
    const int64_t sh[5] = {B, NC / B, H, K, V}, s0[4] = {N, H, K, V};
    const int64_t nk = B * T * H * K, nv = B * T * H * V, na = B * T * H * BT;
    const int64_t nh = NC * H * K * V, n0 = N * H * K * V;
    st_user u;
    memset(&u, 0, sizeof u);
    u.opts = opts_of(c);
    st_in in;
    memset(&in, 0, sizeof in);
    char name[160];
    /* Gi, Ge from a gate in [-0.5, -0.01]: the exponent ranges the stages see in practice */
    double *g = kt_rand(nk, seed, -0.5, -0.01), *Gi = kt_alloc(nk), *Ge = kt_alloc(nk);
    chunk_cumsums(B, T, H * K, c->BT, c->cu, c->nseq, g, Gi, Ge);
#define DUP(x, n) memcpy(kt_alloc(n), x, sizeof(double) * (size_t)(n))

    u.s = ST_INTRA;
    for (int i = 0; i < 4; i++)
        st_add(&in, 4, sk, kt_randn(nk, seed + 1 + (uint64_t)i, 0.7));
    st_add(&in, 4, sk, DUP(Gi, nk));
    st_add(&in, 4, sk, DUP(Ge, nk));
    snprintf(name, sizeof name, "intra %s", c->name);
    st_check(ctx, name, &u, &in, 4, seed + 10);

    u.s = ST_WY;
    st_add(&in, 4, sk, kt_randn(nk, seed + 11, 0.7));
    st_add(&in, 4, sk, kt_randn(nk, seed + 12, 0.7));
    st_add(&in, 4, sv, kt_randn(nv, seed + 13, 0.7));
    st_add(&in, 4, sk, kt_randn(nk, seed + 14, 0.7));
    st_add(&in, 4, sk, kt_randn(nk, seed + 15, 0.7));
    st_add(&in, 4, sk, DUP(Gi, nk));
    st_add(&in, 4, sk, DUP(Ge, nk));
    st_add(&in, 4, sa, kt_rand(na, seed + 16, -0.5, 0.5));
    st_add(&in, 4, sa, kt_rand(na, seed + 17, -0.5, 0.5));
    snprintf(name, sizeof name, "wy %s", c->name);
    st_check(ctx, name, &u, &in, 5, seed + 20);

    u.s = ST_STATE;
    for (int p = 0; p < 3; p++) { /* RECOMPUTE + h0 + ht, CACHE + h0 + ht, no h0 no ht */
        dg_policy_set("dplr_state", p == 1 ? DG_POLICY_CACHE : DG_POLICY_RECOMPUTE);
        u.want_ht = p < 2;
        st_add(&in, 4, sk, kt_randn(nk, seed + 21, 0.5));
        st_add(&in, 4, sv, kt_randn(nv, seed + 22, 0.5));
        st_add(&in, 4, sk, kt_randn(nk, seed + 23, 0.5));
        st_add(&in, 4, sk, kt_randn(nk, seed + 24, 0.5));
        st_add(&in, 4, sv, kt_randn(nv, seed + 25, 0.5));
        st_add(&in, 4, sk, DUP(Gi, nk));
        st_add(&in, 4, s0, p < 2 ? kt_randn(n0, seed + 26, 0.5) : NULL);
        snprintf(name, sizeof name, "state %s%s", c->name,
                 p == 0   ? " h0 ht (RECOMPUTE)"
                 : p == 1 ? " h0 ht (CACHE)"
                          : " no h0 no ht");
        st_check(ctx, name, &u, &in, p < 2 ? 3 : 2, seed + 30 + (uint64_t)p);
    }
    dg_policy_reset();
    u.want_ht = 0;

    u.s = ST_OUTPUT;
    st_add(&in, 4, sk, kt_randn(nk, seed + 41, 0.5));
    st_add(&in, 5, sh, kt_randn(nh, seed + 42, 0.5));
    st_add(&in, 4, sa, kt_rand(na, seed + 43, -0.5, 0.5));
    st_add(&in, 4, sa, kt_rand(na, seed + 44, -0.5, 0.5));
    st_add(&in, 4, sv, kt_randn(nv, seed + 45, 0.5));
    st_add(&in, 4, sv, kt_randn(nv, seed + 46, 0.5));
    snprintf(name, sizeof name, "output %s", c->name);
    st_check(ctx, name, &u, &in, 1, seed + 50);
#undef DUP
    free(g);
    free(Gi);
    free(Ge);
}

static const int64_t cu3b[] = {0, 3, 8, 20};    /* chunks at BT=16: 1 + 1 + 1 */
static const int64_t cu_gc[] = {0, 16, 19, 40}; /* 16 (on a chunk boundary) + 3 + 21 */

static void test_stages(dg_ctx *ctx) {
    printf("-- DPLR stage nodes vs finite differences (f64)\n");
    static const dcase sc[] = {
        {"[T=20 H=2 K=4 V=3 BT=16: 2 chunks, 2nd partial]", 1, 20, 2, 4, 3, 16, 1, NULL, 0, 0},
        {"[B=2 T=20 K=3 V=2 BT=16]", 2, 20, 1, 3, 2, 16, 1, NULL, 0, 0},
        {"[varlen 3+5+12 K=4 V=3 BT=16]", 1, 20, 1, 4, 3, 16, 1, cu3b, 3, 0},
        {"[varlen 16+3+21 K=3 V=2 BT=16]", 1, 40, 1, 3, 2, 16, 1, cu_gc, 3, 0},
    };
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++)
        stage_gradchecks(ctx, &sc[i], 700 + 100 * i);
}

/* ---- the composite dg_dplr_chunk ---- */

static const int64_t cu_on[] = {0, 32, 45, 46, 110, 130};  /* 32 + 13 + 1 + 64 + 20 */
static const int64_t cu_empty[] = {0, 0, 17, 17, 81, 100}; /* 0 + 17 + 0 + 64 + 19 */

/* clang-format off */
static const dcase chunk_cases[] = {
    /* name                                        B    T  H   K   V  BT h0 cu nseq gate */
    {"[B=2 T=50 H=2 K=8 V=6 BT=16 h0]",             2,  50, 2,  8,  6, 16, 1, NULL, 0, 0},
    {"[T=100 K=16 V=8 BT=32 no h0]",                1, 100, 1, 16,  8, 32, 0, NULL, 0, 0},
    {"[B=2 T=64 K=8 V=8 BT=64 h0: T = BT]",         2,  64, 1,  8,  8, 64, 1, NULL, 0, 2},
    {"[T=150 K=16 V=16 BT=64 h0 logsigmoid gate]",  1, 150, 1, 16, 16, 64, 1, NULL, 0, 1},
    {"[T=96 H=2 K=8 V=4 BT=16 no h0 logsigmoid]",   1,  96, 2,  8,  4, 16, 0, NULL, 0, 1},
    {"[T=1 K=4 V=3 BT=16 h0]",                      1,   1, 1,  4,  3, 16, 1, NULL, 0, 0},
    {"[varlen 32+13+1+64+20 H=2 BT=16 h0]",         1, 130, 2,  8,  4, 16, 1, cu_on, 5, 0},
    {"[varlen 32+13+1+64+20 BT=32 logsigmoid]",     1, 130, 1,  8,  4, 32, 0, cu_on, 5, 1},
    {"[varlen 32+13+1+64+20 H=2 BT=64 h0 rwkv7]",   1, 130, 2,  8,  6, 64, 1, cu_on, 5, 2},
    {"[varlen 0+17+0+64+19 BT=16 h0 empty seqs]",   1, 100, 1,  8,  4, 16, 1, cu_empty, 5, 0},
    {"[varlen 0+17+0+64+19 H=2 BT=32 rwkv7]",       1, 100, 2,  4,  4, 32, 0, cu_empty, 5, 2},
};
/* clang-format on */
#define N_CHUNK_CASES (sizeof chunk_cases / sizeof chunk_cases[0])

static double g_max_chunk_err, g_max_f32_err, g_max_gc_chunk;

/* max |got - want| / max |want| over o, ht and every gradient */
static double max_rel(const dcase *c, const kt_data *d, const kt_res *got, const kt_res *want) {
    double worst = 0;
    const double *g[NIN + 2], *w[NIN + 2];
    int64_t n[NIN + 2];
    g[0] = got->o, w[0] = want->o, n[0] = d->no;
    g[1] = got->ht, w[1] = want->ht, n[1] = d->nht;
    for (int i = 0; i < NIN; i++) {
        g[2 + i] = got->grad[i], w[2 + i] = want->grad[i];
        n[2 + i] = d->x[i] ? numel4(d->shape[i]) : 0;
    }
    for (int a = 0; a < NIN + 2; a++) {
        double m = 0, e = 0;
        for (int64_t i = 0; i < n[a]; i++) {
            m = fmax(m, fabs(w[a][i]));
            e = fmax(e, fabs(g[a][i] - w[a][i]));
        }
        if (n[a] && e / fmax(m, 1e-300) > worst)
            worst = e / fmax(m, 1e-300);
    }
    (void)c;
    return worst;
}

static void test_chunk_vs_recurrent(dg_ctx *ctx) {
    printf("-- dg_dplr_chunk vs dg_dplr_recurrent: o, ht and every gradient (f64)\n");
    for (size_t ci = 0; ci < N_CHUNK_CASES; ci++) {
        const dcase *c = &chunk_cases[ci];
        kt_data d;
        make_data(c, 1000 + ci, &d);
        kt_res rr, rc;
        run(ctx, dg_dplr_recurrent, c, &d, DG_F64, &rr);
        run(ctx, dg_dplr_chunk, c, &d, DG_F64, &rc);
        compare("chunk vs recurrent", c, &d, &rc, &rr, 1e-10);
        g_max_chunk_err = fmax(g_max_chunk_err, max_rel(c, &d, &rc, &rr));
        kt_res_free(&rr);
        kt_res_free(&rc);
        kt_data_free(&d);
    }
}

static void test_chunk_f32(dg_ctx *ctx) {
    printf("-- dg_dplr_chunk f32 vs f64 (forward and every gradient)\n");
    for (size_t ci = 0; ci < N_CHUNK_CASES; ci++) {
        const dcase *c = &chunk_cases[ci];
        kt_data d;
        make_data(c, 2000 + ci, &d);
        kt_res r64, r32;
        run(ctx, dg_dplr_chunk, c, &d, DG_F64, &r64);
        run(ctx, dg_dplr_chunk, c, &d, DG_F32, &r32);
        compare("chunk f32 vs f64", c, &d, &r32, &r64, 2e-5);
        g_max_f32_err = fmax(g_max_f32_err, max_rel(c, &d, &r32, &r64));
        kt_res_free(&r64);
        kt_res_free(&r32);
        kt_data_free(&d);
    }
}

/* A decay of zero (gk = -inf, or a huge negative gk) wipes the decayed state in the recurrence;
 * the chunked form floors gk at -128 and must give the same finite result and gradients. */
static void test_chunk_zero_decay(dg_ctx *ctx) {
    printf("-- dg_dplr_chunk vs dg_dplr_recurrent with decays of zero (gk = -inf, -1e6)\n");
    static const size_t which[] = {0, 6};
    for (size_t w = 0; w < sizeof which / sizeof which[0]; w++) {
        const dcase *c = &chunk_cases[which[w]];
        kt_data d;
        make_data(c, 4000 + w, &d);
        const int64_t n = numel4(d.shape[IG]);
        for (int64_t i = 5; i < n; i += 37)
            d.x[IG][i] = i % 2 ? -INFINITY : -1e6;
        kt_res rr, rc;
        run(ctx, dg_dplr_recurrent, c, &d, DG_F64, &rr);
        run(ctx, dg_dplr_chunk, c, &d, DG_F64, &rc);
        int finite = kt_all_finite(rc.o, d.no) && kt_all_finite(rc.ht, d.nht);
        for (int i = 0; i < NIN; i++)
            if (d.x[i])
                finite = finite && kt_all_finite(rc.grad[i], numel4(d.shape[i]));
        dg_check(finite, "zero decay %s: o, ht and every gradient finite", c->name);
        compare("zero decay: chunk vs recurrent", c, &d, &rc, &rr, 1e-10);
        kt_res_free(&rr);
        kt_res_free(&rc);
        kt_data_free(&d);
    }
}

/* CACHE and RECOMPUTE run the same arithmetic: the results must be bitwise equal, and CACHE must
 * keep more on the tape. */
static void test_chunk_policies(dg_ctx *ctx) {
    printf("-- dg_dplr_chunk: CACHE vs RECOMPUTE (per stage and global), bitwise\n");
    static const size_t which[] = {0, 3, 6, 9};
    for (size_t w = 0; w < sizeof which / sizeof which[0]; w++) {
        const dcase *c = &chunk_cases[which[w]];
        kt_data d;
        make_data(c, 3000 + w, &d);
        kt_res ref, r;
        dg_policy_reset();
        run(ctx, dg_dplr_chunk, c, &d, DG_F64, &ref);
        const size_t bytes_rec = ref.tape_bytes;
        for (int p = 0; p < 4; p++) {
            static const char *pn[4] = {"wy CACHE", "state CACHE", "wy+state CACHE",
                                        "global CACHE"};
            dg_policy_reset();
            if (p == 0 || p == 2)
                dg_policy_set("dplr_wy", DG_POLICY_CACHE);
            if (p == 1 || p == 2)
                dg_policy_set("dplr_state", DG_POLICY_CACHE);
            if (p == 3)
                dg_policy_set_global(DG_POLICY_CACHE);
            run(ctx, dg_dplr_chunk, c, &d, DG_F64, &r);
            char what[64];
            snprintf(what, sizeof what, "%s vs RECOMPUTE", pn[p]);
            compare(what, c, &d, &r, &ref, 0.0);
            dg_check(r.tape_bytes > bytes_rec, "%s %s keeps more: %zu > %zu bytes", pn[p], c->name,
                     r.tape_bytes, bytes_rec);
            kt_res_free(&r);
        }
        dg_policy_reset();
        kt_res_free(&ref);
        kt_data_free(&d);
    }
}

static const dcase gc_chunk_cases[] = {
    {"[T=20 H=2 K=4 V=3 BT=16 h0]", 1, 20, 2, 4, 3, 16, 1, NULL, 0, 0},
    {"[B=2 T=35 K=3 V=2 BT=16 no h0 logsigmoid]", 2, 35, 1, 3, 2, 16, 0, NULL, 0, 1},
    {"[varlen 16+3+21 K=3 V=2 BT=16 h0 rwkv7]", 1, 40, 1, 3, 2, 16, 1, cu_gc, 3, 2},
    {"[T=40 K=3 V=2 BT=32 h0]", 1, 40, 1, 3, 2, 32, 1, NULL, 0, 0},
};

static void test_chunk_gradcheck(dg_ctx *ctx) {
    printf("-- finite-difference gradchecks of dg_dplr_chunk (f64, both policies)\n");
    for (size_t i = 0; i < sizeof gc_chunk_cases / sizeof gc_chunk_cases[0]; i++)
        for (int p = 0; p < 2; p++) {
            dg_policy_set_global(p ? DG_POLICY_CACHE : DG_POLICY_RECOMPUTE);
            gradcheck_case(ctx, dg_dplr_chunk, p ? "dg_dplr_chunk (CACHE)" : "dg_dplr_chunk",
                           &gc_chunk_cases[i]);
            g_max_gc_chunk = fmax(g_max_gc_chunk, g_last_gc);
        }
    dg_policy_reset();
}

/* Arguments of the stage entry points. */
static void test_stage_bad_inputs(dg_ctx *ctx) {
    printf("-- bad inputs of the DPLR stage nodes\n");
    dg_dplr_opts op;
    memset(&op, 0, sizeof op);
    op.chunk_size = 16;
    const int64_t sk[4] = {1, 20, 2, 4}, sv[4] = {1, 20, 2, 3}, sa[4] = {1, 20, 2, 16};
    const int64_t sa32[4] = {1, 20, 2, 32}, sh[5] = {1, 2, 2, 4, 3}, sh3[5] = {1, 3, 2, 4, 3};
    const int64_t s0[4] = {1, 2, 4, 3}, s0b[4] = {2, 2, 4, 3}, sk19[4] = {1, 19, 2, 4};
    dg_tensor *K4[6], *V4[2], *A[2], *Hh = NULL, *H3 = NULL, *h0 = NULL, *h0b = NULL, *A32 = NULL;
    dg_tensor *K19 = NULL, *Kf = NULL;
    for (int i = 0; i < 6; i++)
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sk, &K4[i]));
    for (int i = 0; i < 2; i++) {
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sv, &V4[i]));
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sa, &A[i]));
    }
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 5, sh, &Hh));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 5, sh3, &H3));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, s0, &h0));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, s0b, &h0b));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sa32, &A32));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sk19, &K19));
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F32, 4, sk, &Kf));
    dg_tensor *o[5] = {0};
    dg_check_err(
        dg_dplr_intra(ctx, K4[0], K4[1], K4[2], K4[3], K4[4], K19, &op, &o[0], &o[1], &o[2], &o[3]),
        DG_ERR_SHAPE, "Ge must be [B,T,H,K]", "intra: Ge with T=19");
    dg_check_err(
        dg_dplr_intra(ctx, K4[0], K4[1], Kf, K4[3], K4[4], K4[5], &op, &o[0], &o[1], &o[2], &o[3]),
        DG_ERR_DTYPE, "a must be", "intra: f32 a with f64 q");
    dg_check_err(dg_dplr_intra(ctx, K4[0], K4[1], K4[2], K4[3], K4[4], K4[5], &op, &o[0], NULL,
                               &o[2], &o[3]),
                 DG_ERR_ARG, "Aqb", "intra: NULL Aqb");
    dg_check_err(dg_dplr_wy(ctx, K4[0], K4[1], V4[0], K4[2], K4[3], K4[4], K4[5], A[0], A32, &op,
                            &o[0], &o[1], &o[2], &o[3], &o[4]),
                 DG_ERR_SHAPE, "Tab must be [B,T,H,BT]", "wy: Tab with BT=32 for chunk 16");
    dg_check_err(dg_dplr_wy(ctx, K4[0], K4[1], V4[0], K4[2], NULL, K4[4], K4[5], A[0], A[1], &op,
                            &o[0], &o[1], &o[2], &o[3], &o[4]),
                 DG_ERR_ARG, "b is NULL", "wy: NULL b");
    dg_check_err(
        dg_dplr_state(ctx, K4[0], V4[0], K4[1], K4[2], V4[1], K4[3], h0b, &op, &o[0], &o[1], &o[2]),
        DG_ERR_SHAPE, "h0 must be [N,H,K,V]", "state: h0 with N=2 for one sequence");
    dg_check_err(
        dg_dplr_state(ctx, K4[0], V4[0], K4[1], K4[2], K19, K4[3], h0, &op, &o[0], &o[1], &o[2]),
        DG_ERR_SHAPE, "v must be [B,T,H,V]", "state: v of the wrong shape");
    dg_check_err(dg_dplr_output(ctx, K4[0], H3, A[0], A[1], V4[0], V4[1], &op, &o[0]), DG_ERR_SHAPE,
                 "h must be [B,NT,H,K,V]", "output: h with 3 chunks instead of 2");
    dg_check_err(dg_dplr_output(ctx, K4[0], Hh, A[0], A[1], V4[0], NULL, &op, &o[0]), DG_ERR_ARG,
                 "v2 is NULL", "output: NULL v2");
    dg_dplr_opts bo = op;
    bo.chunk_size = 8;
    dg_check_err(dg_dplr_output(ctx, K4[0], Hh, A[0], A[1], V4[0], V4[1], &bo, &o[0]), DG_ERR_ARG,
                 "chunk_size must be 16, 32 or 64", "output: chunk_size 8");
    for (int i = 0; i < 5; i++)
        dg_check(o[i] == NULL, "no output is left behind by a failed call (%d)", i);
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&K4[i]);
    for (int i = 0; i < 2; i++) {
        dg_tensor_free(&V4[i]);
        dg_tensor_free(&A[i]);
    }
    dg_tensor *rest[7] = {Hh, H3, h0, h0b, A32, K19, Kf};
    for (int i = 0; i < 7; i++)
        dg_tensor_free(&rest[i]);
}

/* ---- KDA written as DPLR (dplr.md D2) ----
 * k' = beta k, a = -exp(g) k, b = beta k, gk = g, q and v unchanged: the mapping is built with
 * differentiable elementwise ops, so the gradients of q, k, v, g, beta, h0 flow through it into
 * dg_dplr_recurrent or dg_dplr_chunk (dplr != NULL) and are compared with dg_kda_chunk's (f64;
 * gate NONE, unit q and k). */
static void kda_as_dplr(dg_ctx *ctx, dplr_fn dplr, const dcase *c, uint64_t seed, kt_res *out) {
    const int64_t B = c->B, T = c->T, N = nseqs(c);
    const int64_t sk[4] = {B, T, c->H, c->K}, sv[4] = {B, T, c->H, c->V}, sb[3] = {B, T, c->H};
    const int64_t sb4[4] = {B, T, c->H, 1}, s0[4] = {N, c->H, c->K, c->V};
    const int64_t nk = numel4(sk), nv = numel4(sv), nb = B * T * c->H, n0 = numel4(s0);
    double *x[6];
    x[0] = kt_randn(nk, seed + 1, 1.0);
    x[1] = kt_randn(nk, seed + 2, 1.0);
    kt_rownorm(x[0], nk / c->K, c->K);
    kt_rownorm(x[1], nk / c->K, c->K);
    x[2] = kt_randn(nv, seed + 3, 1.0);
    x[3] = kt_rand(nk, seed + 4, -0.5, -0.01);
    x[4] = kt_rand(nb, seed + 5, 0.05, 0.95);
    x[5] = kt_randn(n0, seed + 6, 0.5);
    double *dO = kt_randn(nv, seed + 7, 1.0), *dht = kt_randn(n0, seed + 8, 1.0);
    dg_tensor *q = kt_tensor(ctx, DG_F64, 4, sk, x[0], 1),
              *k = kt_tensor(ctx, DG_F64, 4, sk, x[1], 1);
    dg_tensor *v = kt_tensor(ctx, DG_F64, 4, sv, x[2], 1),
              *g = kt_tensor(ctx, DG_F64, 4, sk, x[3], 1);
    dg_tensor *beta = kt_tensor(ctx, DG_F64, 3, sb, x[4], 1);
    dg_tensor *h0 = kt_tensor(ctx, DG_F64, 4, s0, x[5], 1);
    dg_tensor *o = NULL, *ht = NULL, *tmp[6] = {0};
    dg_tape_reset();
    if (!dplr) {
        dg_kda_opts ko;
        memset(&ko, 0, sizeof ko);
        ko.chunk_size = c->BT;
        ko.scale = 0.4;
        ko.output_final_state = 1;
        ko.cu_seqlens = c->cu;
        ko.n_seqs = c->nseq;
        DG_TEST_TRY(dg_kda_chunk(ctx, q, k, v, g, beta, NULL, NULL, h0, &ko, &o, &ht));
    } else {
        dg_dplr_opts po = opts_of(c);
        DG_TEST_TRY(dg_reshape(beta, 4, sb4, &tmp[0]));    /* beta [B,T,H,1] */
        DG_TEST_TRY(dg_mul(ctx, k, tmp[0], &tmp[1]));      /* beta k: k' and b */
        DG_TEST_TRY(dg_exp(ctx, g, &tmp[2]));              /* exp(g) */
        DG_TEST_TRY(dg_mul(ctx, tmp[2], k, &tmp[3]));      /* exp(g) k */
        DG_TEST_TRY(dg_scale(ctx, tmp[3], -1.0, &tmp[4])); /* a = -exp(g) k */
        DG_TEST_TRY(dplr(ctx, q, tmp[1], v, tmp[4], tmp[1], g, h0, &po, &o, &ht));
    }
    dg_tensor *tO = kt_tensor(ctx, DG_F64, 4, sv, dO, 0),
              *tH = kt_tensor(ctx, DG_F64, 4, s0, dht, 0);
    dg_tensor *outs[2] = {o, ht};
    const dg_tensor *seeds[2] = {tO, tH};
    DG_TEST_TRY(dg__tape_backward_multi(ctx, 2, outs, seeds));
    memset(out, 0, sizeof *out);
    out->o = kt_host(o, nv);
    out->ht = kt_host(ht, n0);
    dg_tensor *in[6] = {q, k, v, g, beta, h0};
    const int64_t n_in[6] = {nk, nk, nv, nk, nb, n0};
    for (int i = 0; i < 6; i++)
        out->grad[i] = kt_host(dg_tensor_grad(in[i]), n_in[i]);
    dg_tape_reset();
    for (int i = 0; i < 6; i++) {
        dg_tensor_free(&in[i]);
        dg_tensor_free(&tmp[i]);
        free(x[i]);
    }
    dg_tensor_free(&o);
    dg_tensor_free(&ht);
    dg_tensor_free(&tO);
    dg_tensor_free(&tH);
    free(dO);
    free(dht);
}

static void test_kda_as_dplr(dg_ctx *ctx) {
    printf(
        "-- KDA written as DPLR (recurrent and chunked) vs dg_kda_chunk, forward and backward\n");
    static const char *names[6] = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
    static const dcase kc[] = {
        {"[B=2 T=45 H=2 K=8 V=6 BT=16]", 2, 45, 2, 8, 6, 16, 1, NULL, 0, 0},
        {"[varlen 7+23+1+23 BT=32]", 1, 54, 1, 8, 4, 32, 1, cu4, 4, 0},
    };
    static const dplr_fn fns[2] = {dg_dplr_recurrent, dg_dplr_chunk};
    static const char *fnames[2] = {"recurrent", "chunk"};
    for (size_t ci = 0; ci < sizeof kc / sizeof kc[0]; ci++) {
        const dcase *c = &kc[ci];
        kt_res rk;
        kda_as_dplr(ctx, NULL, c, 300 + ci, &rk);
        for (int f = 0; f < 2; f++) {
            kt_res rd;
            kda_as_dplr(ctx, fns[f], c, 300 + ci, &rd);
            const int64_t nk = (int64_t)c->B * c->T * c->H * c->K, nv = nk / c->K * c->V;
            const int64_t n0 = (int64_t)nseqs(c) * c->H * c->K * c->V;
            const int64_t n[6] = {nk, nk, nv, nk, nk / c->K, n0};
            char name[160];
            snprintf(name, sizeof name, "KDA as DPLR (%s) %s o", fnames[f], c->name);
            dg_check_rel(name, rd.o, rk.o, nv, 1e-10);
            snprintf(name, sizeof name, "KDA as DPLR (%s) %s ht", fnames[f], c->name);
            dg_check_rel(name, rd.ht, rk.ht, n0, 1e-10);
            for (int i = 0; i < 6; i++) {
                snprintf(name, sizeof name, "KDA as DPLR (%s) %s %s", fnames[f], c->name, names[i]);
                dg_check_rel(name, rd.grad[i], rk.grad[i], n[i], 1e-10);
            }
            kt_res_free(&rd);
        }
        kt_res_free(&rk);
    }
}

/* ---- bad inputs ---- */

static void test_bad_inputs(dg_ctx *ctx, dplr_fn fn, const char *fname) {
    printf("-- bad inputs of %s\n", fname);
    dcase c = {"", 1, 20, 2, 4, 4, 16, 1, NULL, 0, 0};
    kt_data d;
    make_data(&c, 5, &d);
    dg_tensor *t[NIN];
    for (int i = 0; i < NIN; i++)
        t[i] = kt_tensor(ctx, DG_F64, 4, d.shape[i], d.x[i], 0);
    dg_dplr_opts op = opts_of(&c);
    dg_tensor *o = NULL, *ht = NULL, *bad = NULL;
#define CALL(opts_, q_, k_, v_, a_, b_, g_, h0_)                                                   \
    fn(ctx, q_, k_, v_, a_, b_, g_, h0_, opts_, &o, &ht)
    int64_t sv[4] = {1, 19, 2, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sv, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], bad, t[IA], t[IB], t[IG], t[IH0]), DG_ERR_SHAPE,
                 "v must be [B,T,H,V]", "v with T=19 while q has T=20");
    dg_check_err(CALL(&op, t[IQ], t[IK], t[IV], bad, t[IB], t[IG], t[IH0]), DG_ERR_SHAPE,
                 "a must be [B,T,H,K]", "a of the wrong shape");
    dg_tensor_free(&bad);
    int64_t sk[4] = {1, 20, 2, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F32, 4, sk, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], t[IV], t[IA], bad, t[IG], t[IH0]), DG_ERR_DTYPE,
                 "b must be", "f32 b with f64 q");
    dg_check_err(CALL(&op, t[IQ], t[IK], t[IV], t[IA], t[IB], bad, t[IH0]), DG_ERR_DTYPE,
                 "gk must be", "f32 gk with f64 q");
    dg_tensor_free(&bad);
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_BF16, 4, sk, &bad));
    dg_check_err(CALL(&op, bad, t[IK], t[IV], t[IA], t[IB], t[IG], t[IH0]), DG_ERR_DTYPE,
                 "q must be f64 or f32", "bf16 q on the CPU");
    dg_tensor_free(&bad);
    int64_t sh0[4] = {2, 2, 4, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sh0, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], bad), DG_ERR_SHAPE,
                 "h0 must be [N,H,K,V]", "h0 with N=2 for one sequence");
    dg_tensor_free(&bad);
    dg_check_err(CALL(&op, t[IQ], NULL, t[IV], t[IA], t[IB], t[IG], NULL), DG_ERR_ARG, "k is NULL",
                 "NULL k");
    dg_dplr_opts bo = op;
    bo.chunk_size = 48;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], t[IH0]), DG_ERR_ARG,
                 "chunk_size must be 16, 32 or 64", "chunk_size 48");
    const int64_t cu_end[3] = {0, 7, 19};
    bo = op;
    bo.cu_seqlens = cu_end;
    bo.n_seqs = 2;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], NULL), DG_ERR_ARG,
                 "cu_seqlens", "cu_seqlens ending at 19 != T");
    bo = op;
    bo.output_final_state = 1;
    dg_check_err(fn(ctx, t[IQ], t[IK], t[IV], t[IA], t[IB], t[IG], NULL, &bo, &o, NULL), DG_ERR_ARG,
                 "ht is NULL", "output_final_state without ht");
#undef CALL
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    kt_data_free(&d);
}

/* gpu mode: on CUDA the kernels compute in f32 and read f32 or bf16 activations; every DPLR
 * entry point refuses f64 tensors there (the CUDA path itself: test_dplr_cuda). */
static void gpu_cases(dg_ctx *cpu) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &ctx));
    int64_t sk[4] = {1, 8, 1, 4};
    dg_tensor *x[6] = {0};
    for (int i = 0; i < 6; i++)
        DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sk, &x[i]));
    static const char *want = "f32 or bf16 on CUDA";
    dg_tensor *o = NULL, *ht = NULL;
    dg_check_err(dg_dplr_recurrent(ctx, x[0], x[1], x[2], x[3], x[4], x[5], NULL, NULL, &o, &ht),
                 DG_ERR_DTYPE, want, "dg_dplr_recurrent: f64 on CUDA");
    dg_check_err(dg_dplr_gate_cumsum(ctx, x[5], NULL, &o, &ht), DG_ERR_DTYPE, want,
                 "dg_dplr_gate_cumsum: f64 on CUDA");
    dg_check_err(dg_dplr_chunk(ctx, x[0], x[1], x[2], x[3], x[4], x[5], NULL, NULL, &o, &ht),
                 DG_ERR_DTYPE, want, "dg_dplr_chunk: f64 on CUDA");
    dg_tensor *m[5] = {0};
    dg_check_err(
        dg_dplr_intra(ctx, x[0], x[1], x[3], x[4], x[5], x[5], NULL, &m[0], &m[1], &m[2], &m[3]),
        DG_ERR_DTYPE, want, "dg_dplr_intra: f64 on CUDA");
    dg_check_err(dg_dplr_wy(ctx, x[0], x[1], x[2], x[3], x[4], x[5], x[5], x[0], x[0], NULL, &m[0],
                            &m[1], &m[2], &m[3], &m[4]),
                 DG_ERR_DTYPE, want, "dg_dplr_wy: f64 on CUDA");
    dg_check_err(
        dg_dplr_state(ctx, x[0], x[2], x[1], x[4], x[2], x[5], NULL, NULL, &m[0], &m[1], NULL),
        DG_ERR_DTYPE, want, "dg_dplr_state: f64 on CUDA");
    dg_check_err(dg_dplr_output(ctx, x[0], x[0], x[0], x[0], x[2], x[2], NULL, &o), DG_ERR_DTYPE,
                 want, "dg_dplr_output: f64 on CUDA");
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&x[i]);
    dg_ctx_free(&ctx);
}

static void cpu_cases(dg_ctx *ctx) {
    test_recurrent_dense(ctx);
    test_recurrent_f32(ctx);
    test_recurrent_gradcheck(ctx);
    test_gate_cumsum(ctx);
    test_stages(ctx);
    test_chunk_vs_recurrent(ctx);
    test_chunk_f32(ctx);
    test_chunk_zero_decay(ctx);
    test_chunk_policies(ctx);
    test_chunk_gradcheck(ctx);
    test_kda_as_dplr(ctx);
    test_bad_inputs(ctx, dg_dplr_recurrent, "dg_dplr_recurrent");
    test_bad_inputs(ctx, dg_dplr_chunk, "dg_dplr_chunk");
    test_stage_bad_inputs(ctx);
    printf("-- summary: chunk vs recurrent (f64) max rel err %.3e; f32 vs f64 max rel err %.3e; "
           "chunk gradcheck max rel err %.3e\n",
           g_max_chunk_err, g_max_f32_err, g_max_gc_chunk);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "dplr", cpu_cases, gpu_cases); }

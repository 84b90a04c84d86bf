/*
 * tests/test_kda_chunk.c -- the chunked KDA (dg_kda_chunk, a chain of stage nodes) against the
 * token-by-token recurrence (dg_kda_recurrent, one node with its own backward through time):
 * forward o, ht and every gradient, in f64 (to 1e-10) and f32 (against f64, to 1e-5); partial
 * chunks, nonzero h0, varlen, GVA, chunk sizes 16/32/64, in-op l2norm/beta sigmoid/gates, T = 1,
 * T < BT, very negative gates. Then CACHE vs RECOMPUTE, finite-difference gradchecks of both ops,
 * and bad-input errors.
 */
#include "harness.h"
#include "kda_testutil.h"

#include "autograd/tape.h"

#ifdef _OPENMP
#include <omp.h>
#endif

enum { IQ, IK, IV, IG, IBETA, IA, ID, IH0, NIN };
static const char *grad_name[NIN] = {"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"};

typedef struct kcase {
    const char *name;
    int B, T, H, HV, K, V, BT;
    dg_gate_kind gate;
    int l2, sig, neg, h0;
    const int64_t *cu;
    int nseq;
    double gconst; /* gate NONE: every g equals this when nonzero */
} kcase;

static int nseqs(const kcase *c) { return c->cu ? c->nseq : c->B; }

static void make_data(const kcase *c, uint64_t seed, kt_data *d) {
    memset(d, 0, sizeof *d);
    d->nin = NIN;
    const int64_t B = c->B, T = c->T, N = nseqs(c);
    const int64_t sh[NIN][4] = {{B, T, c->H, c->K},      {B, T, c->H, c->K},    {B, T, c->HV, c->V},
                                {B, T, c->HV, c->K},     {B, T, c->HV, 0},      {c->HV, 0, 0, 0},
                                {c->HV * c->K, 0, 0, 0}, {N, c->HV, c->K, c->V}};
    const int nd[NIN] = {4, 4, 4, 4, 3, 1, 1, 4};
    for (int i = 0; i < NIN; i++) {
        d->ndim[i] = nd[i];
        memcpy(d->shape[i], sh[i], sizeof sh[i]);
    }
    int64_t n[NIN];
    for (int i = 0; i < NIN; i++)
        n[i] = kt_numel(nd[i], sh[i]);
    d->x[IQ] = kt_randn(n[IQ], seed + 1, 1.0);
    d->x[IK] = kt_randn(n[IK], seed + 2, 1.0);
    if (!c->l2) { /* the op expects unit keys/queries then */
        kt_rownorm(d->x[IQ], n[IQ] / c->K, c->K);
        kt_rownorm(d->x[IK], n[IK] / c->K, c->K);
    }
    d->x[IV] = kt_randn(n[IV], seed + 3, 1.0);
    if (c->gate == DG_GATE_NONE) {
        d->x[IG] = kt_rand(n[IG], seed + 4, -0.5, -0.01);
        if (c->gconst != 0)
            for (int64_t i = 0; i < n[IG]; i++)
                d->x[IG][i] = c->gconst;
    } else {
        d->x[IG] = kt_randn(n[IG], seed + 4, 1.0);
        d->x[IA] = kt_rand(n[IA], seed + 6, -0.5, 1.0);
        d->x[ID] = kt_randn(n[ID], seed + 7, 0.5);
    }
    d->x[IBETA] =
        c->sig ? kt_randn(n[IBETA], seed + 5, 1.0) : kt_rand(n[IBETA], seed + 5, 0.05, 0.95);
    if (c->h0)
        d->x[IH0] = kt_randn(n[IH0], seed + 8, 0.5);
    d->no = B * T * c->HV * c->V;
    d->nht = N * c->HV * c->K * c->V;
    d->dO = kt_randn(d->no, seed + 9, 1.0);
    d->dht = kt_randn(d->nht, seed + 10, 1.0);
}

static dg_kda_opts opts_of(const kcase *c) {
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = c->BT;
    o.gate = c->gate;
    o.l2norm_qk = c->l2;
    o.beta_sigmoid = c->sig;
    o.allow_neg_eigval = c->neg;
    o.output_final_state = 1;
    o.cu_seqlens = c->cu;
    o.n_seqs = c->nseq;
    return o;
}

/* The op of one run: chunked or recurrent, with its options. */
typedef struct kcall {
    int chunked;
    dg_kda_opts opts;
} kcall;

static dg_status kda_op(dg_ctx *ctx, dg_tensor *const *t, const void *user, dg_tensor **o,
                        dg_tensor **ht) {
    const kcall *u = user;
    if (u->chunked)
        return dg_kda_chunk(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA], t[ID], t[IH0],
                            &u->opts, o, ht);
    return dg_kda_recurrent(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA], t[ID], t[IH0],
                            &u->opts, o, ht);
}

/* Forward (chunked or recurrent) in dtype dt, backward seeded with dO and dht. */
static void run(dg_ctx *ctx, const kcase *c, const kt_data *d, dg_dtype dt, int chunked,
                kt_res *r) {
    const kcall u = {chunked, opts_of(c)};
    kt_run(ctx, kda_op, &u, d, dt, r);
}

/* With g = -40 per step the true dg is ~1e-18: it is what is left after O(1) terms cancel, so
 * it is compared in absolute terms (dg_atol > 0) against the O(1) scale of the other gradients. */
static void compare(const char *what, const kcase *c, const kt_data *d, const kt_res *got,
                    const kt_res *want, double tol, double dg_atol) {
    kt_compare(what, c->name, grad_name, d, got, want, tol, IG, dg_atol);
}

static const int64_t cu4[] = {0, 7, 30, 31, 54}; /* odd lengths 7, 23, 1, 23 */
static const int64_t cu5[] = {0, 33, 34, 99, 130, 131};
static const int64_t cu3[] = {0, 5, 20};

/* clang-format off */
static const kcase cases[] = {
    /* name                         B   T  H HV K  V  BT  gate                l2 sig neg h0 cu nseq g */
    {"[T=20 BT=16 B=2 h0]",         2, 20, 2, 2, 8, 8, 16, DG_GATE_NONE,       0, 0, 0, 1, NULL, 0, 0},
    {"[GVA HV=2H BT=32 T=45 KDA]",  1, 45, 1, 2, 6, 5, 32, DG_GATE_KDA,        0, 0, 0, 1, NULL, 0, 0},
    {"[varlen 4 seqs LB l2 sig neg]", 1, 54, 1, 2, 4, 6, 16, DG_GATE_LOWERBOUND, 1, 1, 1, 1, cu4, 4, 0},
    {"[BT=64 T=150 KDA l2 sig]",    1, 150, 2, 2, 8, 8, 64, DG_GATE_KDA,       1, 1, 0, 1, NULL, 0, 0},
    {"[varlen 5 seqs H=2 HV=4 K=V=16 BT=32]", 1, 131, 2, 4, 16, 16, 32, DG_GATE_KDA, 1, 1, 0, 1, cu5, 5, 0},
    {"[T=1 B=2]",                   2, 1, 1, 1, 4, 4, 16, DG_GATE_NONE,        0, 0, 0, 1, NULL, 0, 0},
    {"[T=10 < BT=64 GVA]",          1, 10, 1, 3, 5, 4, 64, DG_GATE_LOWERBOUND, 1, 0, 0, 0, NULL, 0, 0},
    {"[g=-40 per step, BT=16]",     1, 40, 1, 1, 4, 4, 16, DG_GATE_NONE,       0, 0, 0, 1, NULL, 0, -40},
};
/* clang-format on */

static void test_chunk_vs_recurrent(dg_ctx *ctx) {
    printf("-- chunked vs recurrent (f64) and f32 chunked vs f64 chunked\n");
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const kcase *c = &cases[ci];
        kt_data d;
        make_data(c, 1000 + 37 * ci, &d);
        kt_res ref, chk, f32;
        run(ctx, c, &d, DG_F64, 0, &ref);
        run(ctx, c, &d, DG_F64, 1, &chk);
        /* same math, different association order: f64 rounding only */
        compare("f64 chunk vs recurrent", c, &d, &chk, &ref, 1e-10, c->gconst != 0 ? 1e-13 : 0);
        run(ctx, c, &d, DG_F32, 1, &f32);
        /* f32 arithmetic throughout (eps 6e-8) on O(BT) sums and a T-long state chain */
        compare("f32 chunk vs f64", c, &d, &f32, &chk, 1e-5, c->gconst != 0 ? 1e-6 : 0);
        if (c->gconst != 0)
            dg_check(kt_all_finite(f32.o, d.no) && kt_all_finite(chk.o, d.no) &&
                         kt_all_finite(f32.grad[IG], d.no / c->V * c->K),
                     "g=%g per step: f32 and f64 outputs and dg are finite", c->gconst);
        kt_res_free(&ref);
        kt_res_free(&chk);
        kt_res_free(&f32);
        kt_data_free(&d);
    }
}

static void test_policies(dg_ctx *ctx) {
    printf("-- CACHE vs RECOMPUTE (composite)\n");
    const kcase *c = &cases[2];
    kt_data d;
    make_data(c, 77, &d);
    kt_res rc, ca;
    dg_policy_set_global(DG_POLICY_RECOMPUTE);
    run(ctx, c, &d, DG_F64, 1, &rc);
    dg_policy_set_global(DG_POLICY_CACHE);
    run(ctx, c, &d, DG_F64, 1, &ca);
    dg_policy_reset();
    /* the recomputation reruns the same deterministic loops on the same inputs */
    compare("CACHE vs RECOMPUTE", c, &d, &ca, &rc, 1e-14, 0);
    printf("   tape bytes: CACHE %zu, RECOMPUTE %zu (%d nodes)\n", ca.tape_bytes, rc.tape_bytes,
           rc.nodes);
    dg_check(ca.tape_bytes > rc.tape_bytes,
             "tape holds more under CACHE (%zu) than RECOMPUTE (%zu)", ca.tape_bytes,
             rc.tape_bytes);
    /* l2norm q, l2norm k, beta, gate_cumsum, intra, wy, state, output */
    dg_check(rc.nodes == 8 && ca.nodes == 8, "composite records one node per stage: %d nodes",
             rc.nodes);
    kt_res df;
    run(ctx, c, &d, DG_F64, 1, &df);
    compare("default policy vs RECOMPUTE", c, &d, &df, &rc, 1e-14, 0);
    /* default: l2norm and state cache (y, 1/norm; h, E), wy recomputes (kda.md §3) */
    printf("   tape bytes with the default policies: %zu\n", df.tape_bytes);
    dg_check(df.tape_bytes < ca.tape_bytes, "default policies keep less than CACHE (%zu < %zu)",
             df.tape_bytes, ca.tape_bytes);
    kt_res_free(&rc);
    kt_res_free(&ca);
    kt_res_free(&df);
    kt_data_free(&d);
}

/* Only one input requires grad: the tape then holds a subset of the stage nodes (e.g. no state
 * node when only q needs a gradient), and the recompute group must still serve the rest. */
static void test_partial_grad(dg_ctx *ctx) {
    printf("-- one input requiring grad at a time\n");
    const kcase *c = &cases[1];
    kt_data d;
    make_data(c, 91, &d);
    kt_res full;
    run(ctx, c, &d, DG_F64, 1, &full);
    for (int only = 0; only < NIN; only++) {
        if (!d.x[only])
            continue;
        dg_tensor *t[NIN];
        for (int i = 0; i < NIN; i++)
            t[i] = kt_tensor(ctx, DG_F64, d.ndim[i], d.shape[i], d.x[i], i == only);
        dg_kda_opts op = opts_of(c);
        dg_tensor *o = NULL, *ht = NULL;
        DG_TEST_TRY(dg_kda_chunk(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA], t[ID], t[IH0],
                                 &op, &o, &ht));
        int nodes = dg_tape_num_nodes();
        dg_tensor *dO = kt_tensor(ctx, DG_F64, 4, dg_tensor_shape(o), d.dO, 0);
        dg_tensor *dht = kt_tensor(ctx, DG_F64, 4, dg_tensor_shape(ht), d.dht, 0);
        dg_tensor *outs[2] = {o, ht};
        const dg_tensor *seeds[2] = {dO, dht};
        DG_TEST_TRY(dg__tape_backward_multi(ctx, 2, outs, seeds));
        int64_t n = kt_numel(d.ndim[only], d.shape[only]);
        double *g = kt_host(dg_tensor_grad(t[only]), n);
        char name[96];
        snprintf(name, sizeof name, "only %s requires grad (%d nodes) vs all", grad_name[only],
                 nodes);
        /* the same loops run on the same inputs: identical up to summation order of dq/dk */
        dg_check_rel(name, g, full.grad[only], n, 1e-14);
        free(g);
        dg_tape_reset();
        for (int i = 0; i < NIN; i++)
            dg_tensor_free(&t[i]);
        dg_tensor_free(&o);
        dg_tensor_free(&ht);
        dg_tensor_free(&dO);
        dg_tensor_free(&dht);
    }
    kt_res_free(&full);
    kt_data_free(&d);
}

/* The raw loops run on OpenMP threads over independent (chunk or sequence, head) items, each in
 * the serial order: every output and gradient must be bitwise the same for any thread count. */
static void test_threads(dg_ctx *ctx) {
#ifdef _OPENMP
    printf("-- 1 thread vs 4 threads (bitwise)\n");
    const int saved = omp_get_max_threads();
    const kcase *cs[2] = {&cases[4], &cases[1]}; /* varlen GVA H=2 HV=4; GVA one q/k head */
    for (int ci = 0; ci < 2; ci++)
        for (int dt = 0; dt < 2; dt++)
            for (int chunked = 0; chunked < 2; chunked++) {
                const kcase *c = cs[ci];
                kt_data d;
                make_data(c, 555, &d);
                kt_res one, many;
                omp_set_num_threads(1);
                run(ctx, c, &d, dt ? DG_F32 : DG_F64, chunked, &one);
                omp_set_num_threads(4);
                run(ctx, c, &d, dt ? DG_F32 : DG_F64, chunked, &many);
                char what[96];
                snprintf(what, sizeof what, "%s %s 1 vs 4 threads", chunked ? "chunk" : "recurrent",
                         dt ? "f32" : "f64");
                compare(what, c, &d, &many, &one, 0.0, 0);
                kt_res_free(&one);
                kt_res_free(&many);
                kt_data_free(&d);
            }
    omp_set_num_threads(saved);
#else
    (void)ctx;
    printf("-- built without OpenMP: no thread-count check\n");
#endif
}

/* ---- gradchecks ---- */

typedef struct gc_user {
    dg_kda_opts opts;
    int chunked;
} gc_user;

static dg_status gc_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                       void *user) {
    const gc_user *u = (const gc_user *)user;
    if (u->chunked)
        return dg_kda_chunk(ctx, in[IQ], in[IK], in[IV], in[IG], in[IBETA], in[IA], in[ID], in[IH0],
                            &u->opts, &out[0], &out[1]);
    return dg_kda_recurrent(ctx, in[IQ], in[IK], in[IV], in[IG], in[IBETA], in[IA], in[ID], in[IH0],
                            &u->opts, &out[0], &out[1]);
}

static void gradcheck_case(dg_ctx *ctx, const kcase *c, int chunked, const char *label) {
    kt_data d;
    make_data(c, 4242, &d);
    dg_tensor *t[NIN];
    for (int i = 0; i < NIN; i++)
        t[i] = kt_tensor(ctx, DG_F64, d.ndim[i], d.shape[i], d.x[i], 1);
    gc_user u = {opts_of(c), chunked};
    dg_gradcheck_report rep;
    DG_TEST_TRY(dg_gradcheck(ctx, gc_fn, &u, t, NIN, 2, 1e-6, 99, &rep));
    for (int i = 0; i < NIN; i++)
        if (t[i])
            printf("     %-8s rel err %.3e\n", grad_name[i], rep.rel_err[i]);
    /* central differences with eps 1e-6 in f64: truncation ~1e-12, rounding ~1e-10 */
    dg_check(rep.max_rel_err < 1e-6, "gradcheck %s %s %s: max rel err %.3e (tol 1e-6)",
             chunked ? "dg_kda_chunk" : "dg_kda_recurrent", label, c->name, rep.max_rel_err);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    kt_data_free(&d);
}

static void test_gradchecks(dg_ctx *ctx) {
    printf("-- finite-difference gradchecks (f64)\n");
    static const kcase small[] = {
        {"[T=20 BT=16 GVA LB l2 sig neg h0]", 1, 20, 1, 2, 4, 3, 16, DG_GATE_LOWERBOUND, 1, 1, 1, 1,
         NULL, 0, 0},
        {"[varlen 5+15 BT=16 KDA h0]", 1, 20, 1, 1, 4, 3, 16, DG_GATE_KDA, 0, 0, 0, 1, cu3, 2, 0},
    };
    gradcheck_case(ctx, &small[0], 1, "RECOMPUTE");
    gradcheck_case(ctx, &small[1], 1, "RECOMPUTE");
    dg_policy_set_global(DG_POLICY_CACHE);
    gradcheck_case(ctx, &small[0], 1, "CACHE");
    dg_policy_reset();
    gradcheck_case(ctx, &small[0], 0, "");
    gradcheck_case(ctx, &small[1], 0, "");
}

/* ---- bad inputs ---- */

static void test_bad_inputs(dg_ctx *ctx) {
    printf("-- bad inputs\n");
    kcase c = {"", 1, 20, 2, 2, 4, 4, 16, DG_GATE_NONE, 0, 0, 0, 1, NULL, 0, 0};
    kt_data d;
    make_data(&c, 5, &d);
    dg_tensor *t[NIN];
    for (int i = 0; i < NIN; i++)
        t[i] = kt_tensor(ctx, DG_F64, d.ndim[i], d.shape[i], d.x[i], 0);
    dg_kda_opts op = opts_of(&c);
    dg_tensor *o = NULL, *ht = NULL, *bad = NULL;
#define CALL(opts_, q_, k_, v_, g_, b_, A_, D_, h0_)                                               \
    dg_kda_chunk(ctx, q_, k_, v_, g_, b_, A_, D_, h0_, opts_, &o, &ht)

    int64_t sv[4] = {1, 19, 2, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sv, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], bad, t[IG], t[IBETA], NULL, NULL, t[IH0]), DG_ERR_SHAPE,
                 "v must be [B,T,HV,V]", "v with T=19 while q has T=20");
    dg_tensor_free(&bad);
    int64_t sb[3] = {1, 20, 2};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F32, 3, sb, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], t[IV], t[IG], bad, NULL, NULL, t[IH0]), DG_ERR_DTYPE,
                 "beta", "f32 beta with f64 q");
    dg_tensor_free(&bad);
    int64_t sq[4] = {1, 20, 2, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_BF16, 4, sq, &bad));
    dg_check_err(CALL(&op, bad, t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, t[IH0]), DG_ERR_DTYPE,
                 "q must be f64 or f32", "bf16 q on the CPU");
    dg_tensor_free(&bad);
    int64_t sh0[4] = {2, 2, 4, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sh0, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, bad), DG_ERR_SHAPE,
                 "h0 must be [N,HV,K,V]", "h0 with N=2 for one sequence");
    dg_tensor_free(&bad);
    int64_t sv3[4] = {1, 20, 3, 4};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 4, sv3, &bad));
    dg_check_err(CALL(&op, t[IQ], t[IK], bad, t[IG], t[IBETA], NULL, NULL, NULL), DG_ERR_SHAPE,
                 "multiple of the q/k heads", "HV=3 with H=2");
    dg_tensor_free(&bad);
    dg_check_err(CALL(&op, NULL, t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, NULL), DG_ERR_ARG,
                 "q is NULL", "NULL q");

    dg_kda_opts bo = op;
    bo.chunk_size = 48;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, t[IH0]), DG_ERR_ARG,
                 "chunk_size", "chunk_size 48");
    bo = op;
    bo.gate = DG_GATE_LOWERBOUND;
    bo.lower_bound = -6;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, t[IH0]), DG_ERR_ARG,
                 "lower_bound", "lower_bound -6");
    bo = op;
    bo.gate = DG_GATE_KDA;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, t[IH0]), DG_ERR_ARG,
                 "A_log", "DG_GATE_KDA without A_log");
    bo = op;
    const int64_t cu_end[3] = {0, 7, 19}, cu_dec[4] = {0, 9, 4, 20}, cu_ok[3] = {0, 7, 20};
    bo.cu_seqlens = cu_end;
    bo.n_seqs = 2;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, NULL), DG_ERR_ARG,
                 "cu_seqlens", "cu_seqlens ending at 19 != T");
    bo.cu_seqlens = cu_dec;
    bo.n_seqs = 3;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, NULL), DG_ERR_ARG,
                 "non-decreasing", "decreasing cu_seqlens");
    bo.cu_seqlens = cu_ok;
    bo.n_seqs = 2;
    dg_check_err(CALL(&bo, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, t[IH0]), DG_ERR_SHAPE,
                 "h0", "varlen with 2 sequences but h0 for 1");
    dg_check_ok(
        dg_kda_recurrent(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, NULL, &bo, &o, &ht),
        "recurrent accepts the same varlen call without h0");
    dg_tensor_free(&o);
    dg_tensor_free(&ht);
#undef CALL
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    kt_data_free(&d);

    /* B > 1 with cu_seqlens */
    kcase c2 = {"", 2, 10, 1, 1, 4, 4, 16, DG_GATE_NONE, 0, 0, 0, 0, NULL, 0, 0};
    make_data(&c2, 6, &d);
    for (int i = 0; i < NIN; i++)
        t[i] = kt_tensor(ctx, DG_F64, d.ndim[i], d.shape[i], d.x[i], 0);
    dg_kda_opts vo = opts_of(&c2);
    const int64_t cu2[2] = {0, 10};
    vo.cu_seqlens = cu2;
    vo.n_seqs = 1;
    dg_check_err(
        dg_kda_recurrent(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, NULL, &vo, &o, &ht),
        DG_ERR_ARG, "B == 1", "recurrent: B=2 with cu_seqlens");
    dg_check_err(
        dg_kda_chunk(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], NULL, NULL, NULL, &vo, &o, &ht),
        DG_ERR_ARG, "B == 1", "chunk: B=2 with cu_seqlens");
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&t[i]);
    kt_data_free(&d);
}

static void cpu_cases(dg_ctx *ctx) {
    test_chunk_vs_recurrent(ctx);
    test_policies(ctx);
    test_partial_grad(ctx);
    test_threads(ctx);
    test_gradchecks(ctx);
    test_bad_inputs(ctx);
}

/* cpu mode only: the CPU reference; the CUDA comparisons of every KDA stage, the composite and
 * the recurrence are in test_kda_cuda.c */
int main(int argc, char **argv) { return dg_test_main(argc, argv, "kda_chunk", cpu_cases, NULL); }

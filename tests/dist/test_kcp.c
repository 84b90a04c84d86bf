/*
 * tests/dist/test_kcp.c -- dg_kda_chunk_cp (KCP) on 2 and 4 ranks against dg_kda_chunk on one.
 *
 * The comparison of kcp_util.h (shared with test_kcp_dplr.c): every rank builds the same global
 * inputs, runs the unsplit op itself (the reference), then its slice through the CP op; o, ht
 * and every gradient must equal the reference (norm-relative: f64 1e-10, f32 1e-5). Per-token
 * tensors (o, dq, dk, dv, dg, dbeta) are compared on the rank's slice; ht (zero rows for
 * sequences ending elsewhere) and the gradients of A_log, dt_bias, h0 (each rank's share) are
 * summed over the ranks first. Cases: one long sequence cut at and off
 * chunk boundaries, varlen packs whose sequences start, end or span rank boundaries, uneven
 * splits (a rank holding only the middle of a sequence), h0 and ht, B > 1 packed as varlen.
 * Also: the plan of distributed.md K2's worked example, and argument errors. gpu mode: the
 * f32 cases on CUDA (every rank on device 0, the MPI backend staging through host memory)
 * against the unsplit op on CUDA.
 */
#include "kcp_util.h"

enum { IQ, IK, IV, IG, IBETA, IA, ID, IH0, NIN };
static const char *const grad_name[NIN] = {"dq",    "dk",     "dv",       "dg",
                                           "dbeta", "dA_log", "ddt_bias", "dh0"};
static const int per_token[NIN] = {1, 1, 1, 1, 1, 0, 0, 0};

typedef struct kcase {
    const char *name;
    int64_t T; /* total tokens */
    int H, HV, K, V, BT;
    const int64_t *cu; /* NULL: one sequence */
    int nseq;
    int h0;
    int uneven;      /* split by kcp_uneven_tokens() instead of evenly */
    int lower_bound; /* DG_GATE_LOWERBOUND with allow_neg_eigval instead of DG_GATE_KDA */
} kcase;

static void make_data(const void *cv, uint64_t seed, kcp_data *d) {
    const kcase *c = (const kcase *)cv;
    memset(d, 0, sizeof *d);
    const int64_t T = c->T, N = c->cu ? c->nseq : 1;
    const int64_t sh[NIN][4] = {{1, T, c->H, c->K},      {1, T, c->H, c->K},    {1, T, c->HV, c->V},
                                {1, T, c->HV, c->K},     {1, T, c->HV, 0},      {c->HV, 0, 0, 0},
                                {c->HV * c->K, 0, 0, 0}, {N, c->HV, c->K, c->V}};
    const int nd[NIN] = {4, 4, 4, 4, 3, 1, 1, 4};
    d->T = T;
    for (int i = 0; i < NIN; i++) {
        d->ndim[i] = nd[i];
        memcpy(d->shape[i], sh[i], sizeof sh[i]);
        d->row[i] = kt_numel(nd[i], sh[i]) / T;
    }
    d->x[IQ] = kt_randn(kcp_sz(kt_numel(4, sh[IQ])), seed + 1, 1.0);
    d->x[IK] = kt_randn(kcp_sz(kt_numel(4, sh[IK])), seed + 2, 1.0);
    d->x[IV] = kt_randn(kcp_sz(kt_numel(4, sh[IV])), seed + 3, 1.0);
    d->x[IG] = kt_randn(kcp_sz(kt_numel(4, sh[IG])), seed + 4, 1.0);
    d->x[IBETA] = kt_randn(kcp_sz(kt_numel(3, sh[IBETA])), seed + 5, 1.0);
    d->x[IA] = kt_rand(kcp_sz(kt_numel(1, sh[IA])), seed + 6, -1.0, 0.5);
    d->x[ID] = kt_randn(kcp_sz(kt_numel(1, sh[ID])), seed + 7, 0.5);
    if (c->h0)
        d->x[IH0] = kt_randn(kcp_sz(kt_numel(4, sh[IH0])), seed + 8, 0.5);
    d->ov = (int64_t)c->HV * c->V;
    d->nht = N * c->HV * c->K * c->V;
    d->dO = kt_randn(kcp_sz(T * d->ov), seed + 9, 1.0);
    d->dht = kt_randn(kcp_sz(d->nht), seed + 10, 1.0);
}

static dg_kda_opts opts_of(const kcase *c) {
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = c->BT;
    o.gate = c->lower_bound ? DG_GATE_LOWERBOUND : DG_GATE_KDA;
    o.lower_bound = c->lower_bound ? -3.0 : 0.0;
    o.allow_neg_eigval = c->lower_bound;
    o.l2norm_qk = 1;
    o.beta_sigmoid = 1;
    o.output_final_state = 1;
    return o;
}

/* kcp_spec.call: dg_kda_chunk_cp on this rank's slice, or the unsplit dg_kda_chunk. */
static void call(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const void *cv,
                 dg_tensor *const *t, dg_tensor **o, dg_tensor **ht) {
    const kcase *c = (const kcase *)cv;
    dg_kda_opts op = opts_of(c);
    if (plan) {
        DG_TEST_TRY(dg_kda_chunk_cp(ctx, comm, plan, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA],
                                    t[ID], t[IH0], &op, o, ht));
    } else {
        op.cu_seqlens = c->cu;
        op.n_seqs = c->nseq;
        DG_TEST_TRY(dg_kda_chunk(ctx, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA], t[ID], t[IH0],
                                 &op, o, ht));
    }
}

static kcp_split split_of(const void *cv) {
    const kcase *c = (const kcase *)cv;
    const kcp_split sp = {c->name, c->T, c->cu, c->nseq, c->uneven};
    return sp;
}

/* bf16 activations; A_log, dt_bias, h0 stay f32 (CUDA) */
static const kcp_spec spec = {NIN, grad_name, per_token, IA, call, make_data, split_of, 1000};

/* The example of distributed.md K2: cu = [0,30,31,130,170,200], 4 ranks of 50 tokens. */
static void test_plan_example(void) {
    static const int64_t cu[] = {0, 30, 31, 130, 170, 200};
    static const int64_t loc[4][4] = {
        {0, 30, 31, 50}, {0, 50, -1, -1}, {0, 30, 50, -1}, {0, 20, 50, -1}};
    static const int nloc[4] = {3, 1, 2, 2}, pre[4] = {0, 1, 2, 1}, post[4] = {2, 1, 1, 0};
    static const int64_t conv[4] = {0, 19, 69, 20};
    for (int r = 0; r < 4; r++) {
        dg_cp_plan *p = NULL;
        DG_TEST_TRY(dg_cp_plan_new(4, r, 200, cu, 5, NULL, &p));
        int ok = p->n_local == nloc[r] && p->pre_ranks == pre[r] && p->post_ranks == post[r] &&
                 p->pre_tokens == conv[r] && p->begin == 50 * r && p->end == 50 * (r + 1);
        for (int i = 0; ok && i <= p->n_local; i++)
            ok = p->cu_local[i] == loc[r][i];
        dg_check(ok, "plan of the K2 example, rank %d: %d local, pre %d, post %d, pre_tokens %lld",
                 r, p->n_local, p->pre_ranks, p->post_ranks, (long long)p->pre_tokens);
        dg_cp_plan_free(&p);
    }
    dg_cp_plan *p = NULL;
    static const int64_t bad_cu[] = {0, 10, 10, 20};
    dg_check_err(dg_cp_plan_new(2, 0, 20, bad_cu, 3, NULL, &p), DG_ERR_ARG, "strictly increasing",
                 "plan: empty sequence");
    dg_check_err(dg_cp_plan_new(2, 2, 20, NULL, 0, NULL, &p), DG_ERR_ARG, "rank", "plan: rank");
    dg_check_err(dg_cp_plan_new(4, 0, 3, NULL, 0, NULL, &p), DG_ERR_ARG, "cannot give",
                 "plan: fewer tokens than ranks");
    static const int64_t toks[2] = {5, 6};
    dg_check_err(dg_cp_plan_new(2, 0, 10, NULL, 0, toks, &p), DG_ERR_ARG, "sum",
                 "plan: rank_tokens do not sum");
}

static void test_errors(dg_ctx *ctx, dg_comm *comm) {
    const kcase c = {"err", 64, 1, 1, 4, 4, 16, NULL, 0, 0, 0, 0};
    kcp_err e;
    kcp_err_begin(ctx, comm, &spec, &c, &e);
    dg_tensor *const *t = e.t, *full = e.full;
    const dg_cp_plan *plan = e.plan, *other = e.other;
    dg_kda_opts op = opts_of(&c);
    dg_tensor *o = NULL, *ht = NULL;
    dg_check_err(dg_kda_chunk_cp(ctx, comm, other, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA],
                                 t[ID], NULL, &op, &o, &ht),
                 DG_ERR_ARG, "plan is for rank", "plan of another world size");
    dg_check_err(dg_kda_chunk_cp(ctx, comm, plan, full, t[IK], t[IV], t[IG], t[IBETA], t[IA], t[ID],
                                 NULL, &op, &o, &ht),
                 DG_ERR_SHAPE, "this rank's", "q with the global T");
    static const int64_t cu[] = {0, 64};
    op.cu_seqlens = cu;
    op.n_seqs = 1;
    dg_check_err(dg_kda_chunk_cp(ctx, comm, plan, t[IQ], t[IK], t[IV], t[IG], t[IBETA], t[IA],
                                 t[ID], NULL, &op, &o, &ht),
                 DG_ERR_ARG, "cu_seqlens must be NULL", "cu_seqlens in opts");
    kcp_err_end(&e);
}

static const int64_t cu_var[] = {0, 30, 31, 64, 130, 170, 203}; /* at and off BT=16 boundaries */
static const int64_t cu_b3[] = {0, 40, 80, 120};                /* B = 3 rows of T = 40 */
static const int64_t cu_many[] = {0, 3, 9, 10, 12, 40, 41, 47, 80}; /* short ones */

static const kcase cases[] = {
    /* name             T    H  HV K  V  BT  cu       nseq h0 uneven lower_bound */
    {"one seq aligned", 128, 1, 2, 8, 8, 16, NULL, 0, 1, 0, 0},
    {"one seq unaligned", 101, 1, 2, 8, 8, 16, NULL, 0, 1, 0, 0},
    {"one seq uneven", 150, 1, 2, 8, 8, 16, NULL, 0, 1, 1, 0},
    {"varlen", 203, 1, 2, 8, 8, 16, cu_var, 6, 1, 0, 0},
    {"varlen uneven", 203, 1, 2, 8, 8, 16, cu_var, 6, 1, 1, 0},
    {"B=3 packed", 120, 2, 2, 8, 4, 16, cu_b3, 3, 1, 0, 0},
    {"short seqs", 80, 1, 1, 4, 8, 16, cu_many, 8, 0, 1, 0},
    {"BT=32 no h0", 160, 1, 2, 8, 8, 32, NULL, 0, 0, 0, 0},
    {"lower-bound gate, neg eigval", 150, 1, 2, 8, 8, 16, NULL, 0, 1, 1, 1},
};

int main(int argc, char **argv) {
    dg_comm *comm = dt_init(argc, argv, "kcp");
    dg_ctx *ctx = dt_ctx(&comm);
    const int gpu = dg_test_gpu_mode();
    test_plan_example();
    if (!gpu)
        test_errors(ctx, comm);
    kcp_cases(ctx, comm, &spec, cases, sizeof *cases, sizeof cases / sizeof *cases, gpu);
    if (gpu) {
        /* bf16 on the tensor-core path, where the summaries run on the device (K % 16 == 0): CP
         * against the unsplit bf16 op on the same GPU. Both sides round to bf16 and TF32 in
         * different places (the summaries and merges reassociate the state pass), so the bound
         * is the bf16 one the two-GPU acceptance uses, 2e-2 relative. */
        static const kcase bf[] = {
            {"tensor-core summaries, one seq uneven", 300, 1, 2, 32, 32, 64, NULL, 0, 1, 1, 0},
            {"tensor-core summaries, varlen", 203, 1, 2, 16, 16, 16, cu_var, 6, 1, 0, 0},
        };
        for (size_t i = 0; i < sizeof bf / sizeof *bf; i++)
            kcp_case(ctx, comm, &spec, &bf[i], NULL, DG_BF16, 2e-2);
    }
    /* the tape policies: W, U, KG, QG, h, E cached instead of recomputed, and everything
     * recomputed (the link node reads W and KG through the shared recompute group) */
    kcp_policies(ctx, comm, &spec, &cases[4] /* varlen uneven */, gpu);
    kcp_print_max_err();
    dg_ctx_free(&ctx);
    return dt_finish(&comm, "kcp");
}

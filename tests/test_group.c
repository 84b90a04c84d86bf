/*
 * tests/test_group.c -- recompute groups (autograd/group.h): the rules on a small table whose
 * recipes count their runs (what is rebuilt, when, and when it is freed, in full and partial
 * backward passes, under CACHE, and on errors), then the KDA and DPLR composites and stage nodes:
 * after a backward under every policy, and after backwards that reach only part of the chain,
 * no rebuilt tensor is left alive and a second backward over the same tape gives the same
 * gradients.
 */
#include "harness.h"

#include "autograd/group.h"

#include <string.h>

/* ---- a small table: members A (recorded first) and B; input x; derived P, Q (one recipe, from
 * x) and S (from P and Q, and x). B reads P and S, A reads S, nobody reads Q. Backward runs B
 * then A. */
enum { MA, MB, NM };
enum { IX, NI };
enum { TP, TQ, TS, NT };
static int g_runs[2];
static unsigned g_pq_made; /* the make mask of r_pq's last run */

static dg_status make_like_x(dg__group *g, dg_ctx *ctx, int i, double v) {
    dg_tensor *x = dg__group_input(g, IX), *t = NULL;
    DG_TRY(dg_tensor_zeros(ctx, DG_F64, dg_tensor_ndim(x), dg_tensor_shape(x), &t));
    ((double *)dg_tensor_data(t))[0] = v;
    dg__group_put(g, i, t);
    dg_tensor_free(&t);
    return DG_OK;
}

static dg_status r_pq(dg__group *g, dg_ctx *ctx, unsigned make) {
    g_runs[0]++;
    g_pq_made = make;
    if (make & DG_BIT(TP))
        DG_TRY(make_like_x(g, ctx, TP, 1));
    if (make & DG_BIT(TQ))
        DG_TRY(make_like_x(g, ctx, TQ, 2));
    return DG_OK;
}

static dg_status r_s(dg__group *g, dg_ctx *ctx, unsigned make) {
    g_runs[1]++;
    const double p = ((double *)dg_tensor_data(dg__group_tensor(g, TP)))[0];
    const double q = ((double *)dg_tensor_data(dg__group_tensor(g, TQ)))[0];
    return (make & DG_BIT(TS)) ? make_like_x(g, ctx, TS, p + q) : DG_OK;
}

static const dg__group_row toy_rows[NT] = {
    {"P", "toy_pq", DG_POLICY_RECOMPUTE, DG_BIT(MB), 0},
    {"Q", "toy_pq", DG_POLICY_RECOMPUTE, 0, 0},
    {"S", "toy_s", DG_POLICY_RECOMPUTE, DG_BIT(MA) | DG_BIT(MB), 1},
};
static const dg__group_recipe toy_recipes[2] = {
    {"r_pq", DG_BIT(IX), 0, r_pq},
    {"r_s", DG_BIT(IX), DG_BIT(TP) | DG_BIT(TQ), r_s},
};
static const char *const toy_members[NM] = {"toy_a", "toy_b"};
static const char *const toy_inputs[NI] = {"x"};
static const dg__group_spec toy = {
    .op = "toy",
    .n_members = NM,
    .members = toy_members,
    .n_inputs = NI,
    .inputs = toy_inputs,
    .n_tensors = NT,
    .tensors = toy_rows,
    .recipes = toy_recipes,
};

/* A group with input x (or none), P Q S offered as made by a forward, and nodes a, b joined as
 * members A then B (never committed: the test plays the tape). */
typedef struct toy_run {
    dg__group *g;
    dg_node *a, *b;
    dg_tensor *y; /* what the forward made (offered as P, Q and S) */
} toy_run;

static void toy_setup(dg_ctx *ctx, dg_tensor *x, toy_run *r) {
    const int64_t sh[1] = {3};
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 1, sh, &r->y));
    DG_TEST_TRY(dg__group_new(&toy, NULL, NULL, &r->g));
    dg__group_set_input(r->g, IX, x);
    for (int i = 0; i < NT; i++)
        dg__group_offer(r->g, i, r->y);
    DG_TEST_TRY(dg__node_new("toy_a", DG_POLICY_DEFAULT, NULL, ctx, &r->a));
    DG_TEST_TRY(dg__node_new("toy_b", DG_POLICY_DEFAULT, NULL, ctx, &r->b));
    dg__group_join(r->g, MA, r->a);
    dg__group_join(r->g, MB, r->b);
}

static void toy_teardown(toy_run *r) {
    dg__node_abort(r->a);
    dg__node_abort(r->b);
    dg__group_release(&r->g);
    dg_tensor_free(&r->y);
}

static int held(const toy_run *r, int i) { return dg__group_tensor(r->g, i) != NULL; }

static void test_rules(dg_ctx *ctx) {
    printf("-- the rules on a small table\n");
    const int64_t sh[1] = {3};
    dg_tensor *x = NULL, *t = NULL;
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F64, 1, sh, &x));
    toy_run r;

    /* RECOMPUTE: B (first in backward) rebuilds S on behalf of A, and P, Q on the way */
    g_runs[0] = g_runs[1] = 0;
    toy_setup(ctx, x, &r);
    dg_check(r.b->n_saved == 1 && r.b->saved[0] == x, "join saves the inputs (%d saved)",
             r.b->n_saved);
    dg_check(!held(&r, TP) && !held(&r, TQ) && !held(&r, TS), "RECOMPUTE: nothing kept");
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TS, &t));
    dg_check(g_runs[0] == 1 && g_runs[1] == 1 && ((double *)dg_tensor_data(t))[0] == 3,
             "B's get of S runs r_pq then r_s once (runs %d %d)", g_runs[0], g_runs[1]);
    dg_check(g_pq_made == (DG_BIT(TP) | DG_BIT(TQ)), "r_pq made P and Q (r_s reads both)");
    dg_check(held(&r, TP) && !held(&r, TQ) && held(&r, TS),
             "after the rebuild Q (read by nobody) is freed, P (B reads it) and S stay");
    dg_check(dg__group_rebuilt_alive() == 2, "2 rebuilt tensors alive (%d)",
             dg__group_rebuilt_alive());
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TP, &t));
    dg_check(g_runs[0] == 1, "B's get of P finds it (no second run)");
    dg__group_done(r.g, MB);
    dg_check(!held(&r, TP) && held(&r, TS), "B done: P freed, S stays for A");
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    dg_check(g_runs[1] == 1, "A's get of S finds what B rebuilt");
    dg__group_done(r.g, MA);
    dg_check(dg__group_rebuilt_alive() == 0, "A done: nothing rebuilt is alive");

    /* a second backward over the same tape rebuilds again */
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TS, &t));
    dg__group_done(r.g, MB);
    dg__group_done(r.g, MA);
    dg_check(g_runs[0] == 2 && g_runs[1] == 2 && dg__group_rebuilt_alive() == 0,
             "a second pass rebuilds once more and frees everything (runs %d %d)", g_runs[0],
             g_runs[1]);

    /* a pass that skips B (no gradient reached it): A rebuilds S; P, Q are not kept for B */
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    dg_check(held(&r, TS) && !held(&r, TP) && !held(&r, TQ),
             "B skipped: A's rebuild keeps only S (B, recorded after A, has had its turn)");
    dg__group_done(r.g, MA);
    dg_check(dg__group_rebuilt_alive() == 0, "B skipped: A done frees S");

    /* B's backward ends without asking for anything: A's later get still works */
    dg__group_done(r.g, MB);
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    dg__group_done(r.g, MA);
    dg_check(dg__group_rebuilt_alive() == 0, "B asked for nothing: A rebuilds and frees");

    /* a member that does not read a tensor may not ask for it */
    dg_check_err(dg__group_get(r.g, ctx, MA, TP, &t), DG_ERR_STATE, "toy_a",
                 "A asking for P (not one of its reads)");
    toy_teardown(&r);

    /* CACHE of toy_s: S is kept from the forward and serves both readers; once its last reader
     * (A) has ended it is freed, from the nodes' saved lists too (x is there to rebuild it), and
     * a second pass rebuilds it like a RECOMPUTE one */
    g_runs[0] = g_runs[1] = 0;
    dg_policy_set("toy_s", DG_POLICY_CACHE);
    toy_setup(ctx, x, &r);
    dg_check(held(&r, TS) && !held(&r, TP), "CACHE of toy_s: S kept, P not");
    dg_check(r.a->n_saved == 2 && r.a->saved[1] == r.y, "join saves the kept S too (%d saved)",
             r.a->n_saved);
    /* B asks for P: r_pq makes P only (Q would serve only r_s, which S being kept never runs) */
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TP, &t));
    dg_check(g_runs[0] == 1 && g_pq_made == DG_BIT(TP) && held(&r, TP) && !held(&r, TQ),
             "CACHE of toy_s: B's get of P makes P alone (make mask %#x)", g_pq_made);
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TS, &t));
    dg_check(t == r.y && g_runs[1] == 0, "CACHE: B reads the forward's S, r_s does not run");
    dg__group_done(r.g, MB);
    dg_check(!held(&r, TP) && held(&r, TS) && dg__group_rebuilt_alive() == 0,
             "B done: P freed, the kept S stays for A");
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    dg_check(t == r.y && g_runs[1] == 0, "CACHE: A reads the forward's S");
    dg__group_done(r.g, MA);
    dg_check(!held(&r, TS) && r.a->saved[1] == NULL && r.b->saved[1] == NULL &&
                 r.a->saved[0] == x && r.b->saved[0] == x,
             "A done: the kept S is freed, from both saved lists (the input x stays)");
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TS, &t));
    dg__group_done(r.g, MB);
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    const double s2 = ((double *)dg_tensor_data(t))[0];
    dg__group_done(r.g, MA);
    dg_check(g_runs[1] == 1 && s2 == 3 && dg__group_rebuilt_alive() == 0,
             "a second pass rebuilds S once and frees it (r_s runs %d, S = %g)", g_runs[1], s2);
    toy_teardown(&r);
    dg_policy_reset();

    /* a kept tensor that cannot be rebuilt (no x) stays after its last reader */
    dg_policy_set("toy_s", DG_POLICY_CACHE);
    toy_setup(ctx, NULL, &r);
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TS, &t));
    dg__group_done(r.g, MB);
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    dg__group_done(r.g, MA);
    dg_check(held(&r, TS) && r.a->saved[r.a->n_saved - 1] == r.y,
             "CACHE without x: S stays after its last reader (it could not come back)");
    toy_teardown(&r);
    dg_policy_reset();

    /* CACHE of toy_pq: P and Q kept (Q for r_s, which may have to rebuild S); with toy_s cached
     * as well no recipe can run, and Q, which only r_s reads, is not kept */
    dg_policy_set("toy_pq", DG_POLICY_CACHE);
    toy_setup(ctx, x, &r);
    dg_check(held(&r, TP) && held(&r, TQ) && !held(&r, TS), "CACHE of toy_pq: P, Q kept, S not");
    toy_teardown(&r);
    dg_policy_set("toy_s", DG_POLICY_CACHE);
    g_runs[0] = g_runs[1] = 0;
    toy_setup(ctx, x, &r);
    dg_check(held(&r, TP) && !held(&r, TQ) && held(&r, TS),
             "CACHE of both: P, S kept, Q (read by r_s only) not");
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TS, &t));
    DG_TEST_TRY(dg__group_get(r.g, ctx, MB, TP, &t));
    dg__group_done(r.g, MB);
    DG_TEST_TRY(dg__group_get(r.g, ctx, MA, TS, &t));
    dg__group_done(r.g, MA);
    dg_check(g_runs[0] == 0 && g_runs[1] == 0, "CACHE of both: no recipe runs");
    toy_teardown(&r);
    dg_policy_reset();

    /* a recipe input missing: the error names it, nothing half-made stays */
    toy_setup(ctx, NULL, &r);
    dg_check_err(dg__group_get(r.g, ctx, MB, TS, &t), DG_ERR_STATE, "without x",
                 "rebuilding S without its input x");
    dg_check(dg__group_rebuilt_alive() == 0 && !held(&r, TP) && !held(&r, TS),
             "a failed rebuild leaves nothing behind");
    toy_teardown(&r);
    dg_tensor_free(&x);
}

/* ---- KDA and DPLR ---- */

/* Inputs of one op call (n of them, each requiring grad when `want` says so), its outputs o, ht,
 * and fixed upstream gradients. */
typedef struct opcall {
    int n;
    dg_tensor *in[8], *o, *ht, *dO, *dht;
} opcall;

static void opcall_free(opcall *c) {
    for (int i = 0; i < c->n; i++)
        dg_tensor_free(&c->in[i]);
    dg_tensor_free(&c->o);
    dg_tensor_free(&c->ht);
    dg_tensor_free(&c->dO);
    dg_tensor_free(&c->dht);
}

static const int64_t g_cu[4] = {0, 21, 22, 40}; /* three sequences, one of a single token */

static void kda_call(dg_ctx *ctx, unsigned want, opcall *c) {
    memset(c, 0, sizeof *c);
    const int64_t B = 1, T = 40, H = 1, HV = 2, K = 4, V = 3, N = 3;
    const int64_t sq[4] = {B, T, H, K}, sv[4] = {B, T, HV, V}, sg[4] = {B, T, HV, K};
    const int64_t sb[3] = {B, T, HV}, s0[4] = {N, HV, K, V};
    c->n = 6;
    c->in[0] = dg_test_rand(ctx, DG_F64, 4, sq, 1, -1, 1);
    c->in[1] = dg_test_rand(ctx, DG_F64, 4, sq, 2, -1, 1);
    c->in[2] = dg_test_rand(ctx, DG_F64, 4, sv, 3, -1, 1);
    c->in[3] = dg_test_rand(ctx, DG_F64, 4, sg, 4, -0.5, -0.01);
    c->in[4] = dg_test_rand(ctx, DG_F64, 3, sb, 5, 0.1, 0.9);
    c->in[5] = dg_test_rand(ctx, DG_F64, 4, s0, 6, -0.5, 0.5);
    for (int i = 0; i < c->n; i++)
        dg_tensor_set_requires_grad(c->in[i], (want >> i) & 1);
    dg_kda_opts op;
    memset(&op, 0, sizeof op);
    op.chunk_size = 16;
    op.l2norm_qk = 1;
    op.output_final_state = 1;
    op.cu_seqlens = g_cu;
    op.n_seqs = 3;
    DG_TEST_TRY(dg_kda_chunk(ctx, c->in[0], c->in[1], c->in[2], c->in[3], c->in[4], NULL, NULL,
                             c->in[5], &op, &c->o, &c->ht));
    c->dO = dg_test_rand(ctx, DG_F64, 4, sv, 7, -1, 1);
    c->dht = dg_test_rand(ctx, DG_F64, 4, s0, 8, -1, 1);
}

static void dplr_call(dg_ctx *ctx, unsigned want, opcall *c) {
    memset(c, 0, sizeof *c);
    const int64_t B = 2, T = 21, H = 2, K = 4, V = 3;
    const int64_t sq[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, s0[4] = {B, H, K, V};
    c->n = 7;
    c->in[0] = dg_test_rand(ctx, DG_F64, 4, sq, 11, -1, 1);
    c->in[1] = dg_test_rand(ctx, DG_F64, 4, sq, 12, -0.5, 0.5);
    c->in[2] = dg_test_rand(ctx, DG_F64, 4, sv, 13, -1, 1);
    c->in[3] = dg_test_rand(ctx, DG_F64, 4, sq, 14, -0.3, 0.3);
    c->in[4] = dg_test_rand(ctx, DG_F64, 4, sq, 15, -0.3, 0.3);
    c->in[5] = dg_test_rand(ctx, DG_F64, 4, sq, 16, -0.5, -0.01);
    c->in[6] = dg_test_rand(ctx, DG_F64, 4, s0, 17, -0.5, 0.5);
    for (int i = 0; i < c->n; i++)
        dg_tensor_set_requires_grad(c->in[i], (want >> i) & 1);
    dg_dplr_opts op;
    memset(&op, 0, sizeof op);
    op.chunk_size = 16; /* two chunks per sequence: the state pass carries h across */
    op.output_final_state = 1;
    DG_TEST_TRY(dg_dplr_chunk(ctx, c->in[0], c->in[1], c->in[2], c->in[3], c->in[4], c->in[5],
                              c->in[6], &op, &c->o, &c->ht));
    c->dO = dg_test_rand(ctx, DG_F64, 4, sv, 18, -1, 1);
    c->dht = dg_test_rand(ctx, DG_F64, 4, s0, 19, -1, 1);
}

/* Backward from o and/or ht; copies of the input gradients into g[i] (NULL where none). */
static void backward(dg_ctx *ctx, opcall *c, int seed_o, int seed_ht, double **g) {
    dg_tensor *outs[2] = {c->o, c->ht};
    const dg_tensor *seeds[2] = {seed_o ? c->dO : NULL, seed_ht ? c->dht : NULL};
    for (int i = 0; i < c->n; i++)
        dg_tensor_zero_grad(c->in[i]);
    DG_TEST_TRY(dg_tape_backward_multi(ctx, 2, outs, seeds));
    for (int i = 0; i < c->n; i++) {
        g[i] = NULL;
        if (dg_tensor_grad(c->in[i]))
            DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(c->in[i]), &g[i]));
    }
}

/* Backward twice over one tape: nothing rebuilt stays alive after either, same gradients. */
static void check_passes(dg_ctx *ctx, const char *what, opcall *c, int seed_o, int seed_ht) {
    double *g1[8], *g2[8];
    backward(ctx, c, seed_o, seed_ht, g1);
    dg_check(dg__group_rebuilt_alive() == 0, "%s: no rebuilt tensor alive after backward (%d)",
             what, dg__group_rebuilt_alive());
    backward(ctx, c, seed_o, seed_ht, g2);
    dg_check(dg__group_rebuilt_alive() == 0, "%s: none after a second backward either", what);
    int same = 1, any = 0;
    for (int i = 0; i < c->n; i++) {
        if (!g1[i] != !g2[i])
            same = 0;
        if (g1[i] && g2[i]) {
            any = 1;
            const int64_t n = dg_tensor_numel(c->in[i]);
            same &= memcmp(g1[i], g2[i], sizeof(double) * (size_t)n) == 0;
        }
        free(g1[i]);
        free(g2[i]);
    }
    dg_check(same && any, "%s: the second backward gives the same gradients bitwise", what);
}

static void test_ops(dg_ctx *ctx) {
    printf("-- KDA and DPLR: nothing rebuilt outlives the backward\n");
    static const char *pn[5] = {"default", "wy CACHE", "state CACHE", "both CACHE",
                                "all RECOMPUTE"};
    for (int p = 0; p < 5; p++) {
        for (int op = 0; op < 2; op++) {
            const char *pre = op ? "dplr" : "kda";
            char k[32];
            dg_policy_reset();
            if (p == 1 || p == 3) {
                snprintf(k, sizeof k, "%s_wy", pre);
                dg_policy_set(k, DG_POLICY_CACHE);
            }
            if (p == 2 || p == 3) {
                snprintf(k, sizeof k, "%s_state", pre);
                dg_policy_set(k, DG_POLICY_CACHE);
            }
            if (p == 4)
                dg_policy_set_global(DG_POLICY_RECOMPUTE);
            /* seeds: o and ht, o only, ht only (the output node's backward does not run) */
            for (int s = 0; s < 3; s++) {
                opcall c;
                if (op)
                    dplr_call(ctx, 0x7f, &c);
                else
                    kda_call(ctx, 0x3f, &c);
                char what[96];
                snprintf(what, sizeof what, "%s %s, seeds %s", pre, pn[p],
                         s == 0   ? "o+ht"
                         : s == 1 ? "o"
                                  : "ht");
                check_passes(ctx, what, &c, s != 2, s != 1);
                dg_tape_reset();
                opcall_free(&c);
            }
        }
    }
    dg_policy_reset();
    /* one input requiring grad at a time: the tape holds part of the chain */
    for (int i = 0; i < 6; i++) {
        opcall c;
        kda_call(ctx, 1u << i, &c);
        char what[64];
        snprintf(what, sizeof what, "kda, only input %d requires grad (%d nodes)", i,
                 dg_tape_num_nodes());
        check_passes(ctx, what, &c, 1, 1);
        dg_tape_reset();
        opcall_free(&c);
    }
}

/* dg_kda_state alone under RECOMPUTE rebuilds h, E itself and frees them (under its default,
 * CACHE, it keeps them). */
static void test_state_alone(dg_ctx *ctx) {
    printf("-- dg_kda_state alone\n");
    const int64_t B = 1, T = 20, HV = 2, K = 4, V = 3;
    const int64_t sk[4] = {B, T, HV, K}, sv[4] = {B, T, HV, V}, s0[4] = {B, HV, K, V};
    opcall c;
    memset(&c, 0, sizeof c);
    c.n = 5;
    c.in[0] = dg_test_rand(ctx, DG_F64, 4, sk, 21, -0.5, 0.5);
    c.in[1] = dg_test_rand(ctx, DG_F64, 4, sv, 22, -1, 1);
    c.in[2] = dg_test_rand(ctx, DG_F64, 4, sk, 23, -0.5, 0.5);
    c.in[3] = dg_test_rand(ctx, DG_F64, 4, sk, 24, -1, -0.1);
    c.in[4] = dg_test_rand(ctx, DG_F64, 4, s0, 25, -0.5, 0.5);
    for (int i = 0; i < c.n; i++)
        dg_tensor_set_requires_grad(c.in[i], 1);
    dg_kda_opts op;
    memset(&op, 0, sizeof op);
    op.chunk_size = 16;
    op.output_final_state = 1;
    dg_tensor *h = NULL, *E = NULL;
    dg_policy_set("kda_state", DG_POLICY_RECOMPUTE);
    DG_TEST_TRY(dg_kda_state(ctx, c.in[0], c.in[1], c.in[2], c.in[3], c.in[4], &op, &h, &E, &c.ht));
    dg_policy_reset();
    /* seed E through o's slot: o is E here */
    c.o = E;
    c.dO = dg_test_rand(ctx, DG_F64, 4, sv, 26, -1, 1);
    c.dht = dg_test_rand(ctx, DG_F64, 4, s0, 27, -1, 1);
    check_passes(ctx, "kda_state alone (RECOMPUTE)", &c, 1, 1);
    dg_tape_reset();
    dg_tensor_free(&h);
    opcall_free(&c);
}

static void cpu_cases(dg_ctx *ctx) {
    test_rules(ctx);
    test_ops(ctx);
    test_state_alone(ctx);
}

/* cpu mode only: the bookkeeping of recompute groups */
int main(int argc, char **argv) { return dg_test_main(argc, argv, "group", cpu_cases, NULL); }

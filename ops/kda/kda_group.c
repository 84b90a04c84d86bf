/*
 * ops/kda/kda_group.c -- what the wy, state and output nodes keep for backward and what backward
 * rebuilds (kda.md §3): the table of the KDA recompute group. The rules that apply it (when a
 * tensor is rebuilt, when it is freed) are in autograd/group.h.
 *
 * FLA keeps only Aqk and Tm from the forward and, in backward, rebuilds W, U, KG, QG from Tm
 * (recompute_w_u) and h, E by rerunning the state pass from h0. Here each of these derived
 * tensors is either kept from the forward or rebuilt once in backward, by this table:
 *
 *   tensor  made by    kept when         read in backward by     else rebuilt by  from
 *   W       kda_wy     "kda_wy" CACHE    state, cp_link          rebuild_wy       q k v beta G Tm
 *   U       kda_wy     "kda_wy" CACHE    (rebuild_state only)    rebuild_wy       q k v beta G Tm
 *   KG      kda_wy     "kda_wy" CACHE    state, cp_link          rebuild_wy       q k v beta G Tm
 *   QG      kda_wy     "kda_wy" CACHE    output                  rebuild_wy       q k v beta G Tm
 *   h       kda_state  "kda_state" CACHE state, output           rebuild_state    W U KG G [h0]
 *   E       kda_state  "kda_state" CACHE state, output           rebuild_state    W U KG G [h0]
 *
 * The inputs q, k, v, beta, G, Tm, h0 (q, k normalised -- factored with the row scales rq, rk
 * where those are given (kda.h) -- beta transformed: what the wy node reads) are kept by the wy
 * and state nodes anyway. Defaults: "kda_wy" RECOMPUTE, "kda_state" CACHE. Keeping h and E
 * (K V / BT + V values per token and value head: 768 bytes in bf16 at K = V = 128) saves the
 * second run of the serial pass, the one stage whose time does not shrink with more parallel
 * work; W, U, KG, QG (3 K + V values) are rebuilt by a chunk-parallel pass. A kept tensor is
 * freed as soon as its last reader's backward has ended (group.h, "keep"), like a rebuilt one,
 * so within one op call caching costs no peak memory (the peak is reached in the WY backward,
 * after both readers); what it costs is memory between the forward and the backward, which a
 * model holds for every layer at once (docs/kda.md §3). The members are recorded state, cp_link
 * (dg_kda_chunk_cp only), output, so backward runs output first, then cp_link, then state. What
 * happens, per pair of policies ("kda_wy", "kda_state"):
 *
 *   RECOMPUTE, RECOMPUTE  output's backward runs rebuild_wy (W U KG QG) and rebuild_state (h E),
 *                         for itself and for the later readers; U is freed at once, QG when
 *                         output ends, W KG h E when state ends.
 *   CACHE, RECOMPUTE      output's backward runs rebuild_state from the kept W U KG; U is freed
 *                         then, QG when output ends, W KG h E when state ends.
 *   RECOMPUTE, CACHE      (the default) output's backward runs rebuild_wy for QG (itself) and
 *                         W, KG (state), not U (nobody needs it); QG is freed when output
 *                         ends, W KG h E when state ends.
 *   CACHE, CACHE          nothing is rebuilt; U is not kept (only rebuild_state reads it); QG
 *                         is freed when output ends, W KG h E when state ends.
 * When only ht is seeded, output's backward does not run and state's rebuilds what it reads.
 *
 * Used alone, dg_kda_state keeps W, U, KG (its own inputs) and G, h0, so under RECOMPUTE of
 * "kda_state" it rebuilds h, E itself; dg_kda_output keeps QG, h, E.
 */
#include "kda.h"

#define M(m) DG_BIT(KDA_M_##m)
#define I(i) DG_BIT(KDA_IN_##i)
#define T(t) DG_BIT(KDA_##t)
enum { R_WY, R_STATE };

static dg_status rebuild_wy(dg__group *g, dg_ctx *ctx, unsigned make);
static dg_status rebuild_state(dg__group *g, dg_ctx *ctx, unsigned make);

/* clang-format off */
static const dg__group_row kda_tensors[KDA_NDERIVED] = {
    /* name  made by      its default           read in backward by     rebuilt by */
    {"W",    "kda_wy",    DG_POLICY_RECOMPUTE,  M(STATE) | M(LINK),     R_WY},
    {"U",    "kda_wy",    DG_POLICY_RECOMPUTE,  0,                      R_WY},
    {"KG",   "kda_wy",    DG_POLICY_RECOMPUTE,  M(STATE) | M(LINK),     R_WY},
    {"QG",   "kda_wy",    DG_POLICY_RECOMPUTE,  M(OUTPUT),              R_WY},
    {"h",    "kda_state", DG_POLICY_CACHE,      M(STATE) | M(OUTPUT),   R_STATE},
    {"E",    "kda_state", DG_POLICY_CACHE,      M(STATE) | M(OUTPUT),   R_STATE},
};

static const dg__group_recipe kda_recipes[] = {
    /* [R_WY] the wy node's forward: the inputs it needs, the derived tensors it reads */
    {"rebuild_wy",    I(Q) | I(K) | I(V) | I(BETA) | I(G) | I(TM),
                      0,                   rebuild_wy},
    /* [R_STATE] the state node's forward (h0 optional) */
    {"rebuild_state", I(G),
                      T(W) | T(U) | T(KG), rebuild_state},
};
/* clang-format on */

static const char *const kda_members[KDA_NMEMBERS] = {"kda_state", "kda_cp_link", "kda_output"};
static const char *const kda_inputs[KDA_NINPUTS] = {"q",  "k",  "v",  "beta", "G",
                                                    "Tm", "h0", "rq", "rk"};

static const dg__group_spec kda_group = {
    .op = "dg_kda",
    .n_members = KDA_NMEMBERS,
    .members = kda_members,
    .n_inputs = KDA_NINPUTS,
    .inputs = kda_inputs,
    .n_tensors = KDA_NDERIVED,
    .tensors = kda_tensors,
    .recipes = kda_recipes,
};

/* ---- the group's data: the cfg of the op call (tables and device tables owned) ---- */

static void cfg_free(void *p) {
    dg__kda_cfg_free((kda_cfg *)p);
    DG_FREE(p);
}

dg_status dg__kda_group_new(const kda_cfg *cfg, dg__group **out) {
    *out = NULL;
    kda_cfg *c = (kda_cfg *)DG_CALLOC(1, sizeof *c);
    size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    int64_t *tab = (int64_t *)DG_MALLOC(ntab * sizeof(int64_t));
    if (!c || !tab) {
        DG_FREE(c);
        DG_FREE(tab);
        return dg__err(DG_ERR_NOMEM, "dg_kda: no memory for the recompute group");
    }
    dg__kda_cfg_copy(c, cfg, tab);
    return dg__group_new(&kda_group, c, cfg_free, out);
}

kda_dev *dg__kda_group_dev(const dg__group *g) { return ((const kda_cfg *)dg__group_data(g))->dev; }

/* ---- recipes ---- */

/* Pointer to group input i in the compute dtype (a converted copy for bf16 inputs on CUDA). */
static dg_status in_ptr(dg_ctx *ctx, const dg__group *g, int i, dg_tensor **tmp, const void **p) {
    const kda_cfg *c = (const kda_cfg *)dg__group_data(g);
    return dg__kda_ptr(ctx, dg__group_input(g, i), c->dt, tmp, p);
}

/* W, U, KG, QG: recompute_w_u (kda.md §11.4(c)), the wy node's forward, for the tensors in make. */
static dg_status rebuild_wy(dg__group *g, dg_ctx *ctx, unsigned make) {
    const kda_cfg *c = (const kda_cfg *)dg__group_data(g);
    const int64_t sk[4] = {c->d.B, c->d.T, c->d.HV, c->d.K};
    const int64_t sv[4] = {c->d.B, c->d.T, c->d.HV, c->d.V};
    dg_tensor *out[4] = {NULL};             /* KDA_W .. KDA_QG */
    void *po[4] = {NULL};                   /* NULL: not made (kda_wy_fwd skips that output) */
    dg_tensor *tmp[KDA_IN_TM + 1] = {NULL}; /* converted copies of q .. Tm */
    const void *pi[KDA_IN_TM + 1] = {NULL};
    kda_qk_in qk = {0};
    dg_status st = DG_OK;
    for (int s = KDA_W; s <= KDA_QG && st == DG_OK; s++)
        if (make & DG_BIT(s)) {
            st = dg__kda_new_mid(ctx, c, 4, s == KDA_U ? sv : sk, &out[s]);
            if (st == DG_OK)
                po[s] = dg_tensor_data(out[s]);
        }
    int vbf16 = 0; /* v is read as stored when it is the op's bf16 input on CUDA */
    if (st == DG_OK)
        st = dg__kda_qk_ptrs(ctx, c, dg__group_input(g, KDA_IN_Q), dg__group_input(g, KDA_IN_K),
                             dg__group_input(g, KDA_IN_RQ), dg__group_input(g, KDA_IN_RK),
                             &tmp[KDA_IN_Q], &tmp[KDA_IN_K], &qk);
    for (int i = KDA_IN_V; i <= KDA_IN_TM && st == DG_OK; i++) {
        const dg_tensor *t = dg__group_input(g, i);
        st = i == KDA_IN_V ? dg__kda_in_ptr(ctx, t, c->dt, &tmp[i], &pi[i], &vbf16)
                           : in_ptr(ctx, g, i, &tmp[i], &pi[i]);
    }
    if (st == DG_OK) {
        kda_wy_fwd_io io = {0};
        io.leaf_bf16 = vbf16;
        io.qk = qk;
        io.v = pi[KDA_IN_V];
        io.beta = pi[KDA_IN_BETA];
        io.G = pi[KDA_IN_G];
        io.Tm = pi[KDA_IN_TM];
        io.W = po[KDA_W];
        io.U = po[KDA_U];
        io.KG = po[KDA_KG];
        io.QG = po[KDA_QG];
        st = kda_run_wy_fwd(ctx, c, &io);
    }
    for (int s = KDA_W; s <= KDA_QG; s++) {
        if (st == DG_OK && out[s])
            dg__group_put(g, s, out[s]);
        dg_tensor_free(&out[s]);
    }
    for (int i = KDA_IN_Q; i <= KDA_IN_TM; i++)
        dg_tensor_free(&tmp[i]);
    return st;
}

/* h, E: the sequential state pass (kda.md §11.4(d)), the state node's forward, rerun from h0. */
static dg_status rebuild_state(dg__group *g, dg_ctx *ctx, unsigned make) {
    const kda_cfg *c = (const kda_cfg *)dg__group_data(g);
    const int64_t NC = kda_cfg_nc(c);
    const int64_t sh[5] = {c->d.B, NC / c->d.B, c->d.HV, c->d.K, c->d.V};
    const int64_t se[4] = {c->d.B, c->d.T, c->d.HV, c->d.V};
    dg_tensor *h = NULL, *E = NULL, *tG = NULL, *th0 = NULL, *tW = NULL, *tU = NULL, *tKG = NULL;
    kda_state_fwd_io io = {0}; /* ht: not needed */
    dg_status st = dg__kda_new_mid(ctx, c, 5, sh, &h);
    if (st == DG_OK)
        st = dg__kda_new_mid(ctx, c, 4, se, &E);
    /* W, U, KG in the storage dtype (tensors kept by a lone state node may differ) */
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, dg__group_tensor(g, KDA_W), c->mid, &tW, &io.W);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, dg__group_tensor(g, KDA_U), c->mid, &tU, &io.U);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, dg__group_tensor(g, KDA_KG), c->mid, &tKG, &io.KG);
    if (st == DG_OK)
        st = in_ptr(ctx, g, KDA_IN_G, &tG, &io.G);
    if (st == DG_OK && dg__group_input(g, KDA_IN_H0))
        st = in_ptr(ctx, g, KDA_IN_H0, &th0, &io.h0);
    if (st == DG_OK) {
        io.h = dg_tensor_data(h);
        io.E = dg_tensor_data(E);
        st = kda_run_state_fwd(ctx, c, &io);
    }
    if (st == DG_OK && (make & T(H)))
        dg__group_put(g, KDA_H, h);
    if (st == DG_OK && (make & T(E)))
        dg__group_put(g, KDA_E, E);
    dg_tensor_free(&h);
    dg_tensor_free(&E);
    dg_tensor_free(&tG);
    dg_tensor_free(&th0);
    dg_tensor_free(&tW);
    dg_tensor_free(&tU);
    dg_tensor_free(&tKG);
    return st;
}

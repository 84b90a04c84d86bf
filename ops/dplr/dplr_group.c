/*
 * ops/dplr/dplr_group.c -- what the DPLR wy, state and output nodes keep for backward and what
 * backward rebuilds (dplr.md D4: FLA's DPLR backward recomputes everything from q, k, v, a, b, gk,
 * h0 unless disable_recompute is set): the table of the DPLR recompute group. The rules that
 * apply it are in autograd/group.h; KDA's table (ops/kda/kda_group.c) is the same story.
 *
 *   tensor  made by     kept when           read in backward by   else rebuilt by  from
 *   w       dplr_wy     "dplr_wy" CACHE     state, cp_link        rebuild_wy       (1)
 *   u       dplr_wy     "dplr_wy" CACHE     (rebuild_state only)  rebuild_wy       (1)
 *   qg      dplr_wy     "dplr_wy" CACHE     output                rebuild_wy       (1)
 *   kg      dplr_wy     "dplr_wy" CACHE     state, cp_link (CUDA) rebuild_wy       (1)
 *   bg      dplr_wy     "dplr_wy" CACHE     state, cp_link        rebuild_wy       (1)
 *   h       dplr_state  "dplr_state" CACHE  state, output         rebuild_state    (2)
 *   v2      dplr_state  "dplr_state" CACHE  state, output         rebuild_state    (2)
 *   (1) q k v a b Gi Ge Aak Tab     (2) w u kg bg v Gi [h0]
 *
 * The inputs are kept by the intra, wy and state nodes anyway (the intra node always keeps Aqk,
 * Aqb, Aak, Tab). Both policies default to RECOMPUTE. The members are recorded state, cp_link
 * (dg_dplr_chunk_cp only: its h0 input is then the merged initial states), output, so backward
 * runs output, then cp_link, then state:
 *
 *   RECOMPUTE, RECOMPUTE  output's backward runs rebuild_wy (w u qg kg bg) and rebuild_state
 *                         (h v2), for itself and for state; u is freed at once, qg when output
 *                         ends, the rest when state ends.
 *   CACHE, RECOMPUTE      output's backward runs rebuild_state from the kept w u kg bg.
 *   RECOMPUTE, CACHE      output's backward runs rebuild_wy (qg for itself, w kg bg for state);
 *                         u is freed at once, qg when output ends, w kg bg when state ends.
 *   CACHE, CACHE          nothing is rebuilt.
 *
 * Used alone, dg_dplr_state keeps w, u, kg, bg and v, Gi, h0 (its own inputs), so under
 * RECOMPUTE of "dplr_state" it rebuilds h, v2 itself; dg_dplr_output keeps qg, h, v2.
 */
#include "dplr.h"

#define M(m) DG_BIT(DPLR_M_##m)
#define I(i) DG_BIT(DPLR_IN_##i)
#define T(t) DG_BIT(DPLR_##t)
enum { R_WY, R_STATE };

static dg_status rebuild_wy(dg__group *g, dg_ctx *ctx, unsigned make);
static dg_status rebuild_state(dg__group *g, dg_ctx *ctx, unsigned make);

/* clang-format off */
static const dg__group_row dplr_tensors[DPLR_NDERIVED] = {
    /* name  made by       its default           read in backward by     rebuilt by */
    {"w",    "dplr_wy",    DG_POLICY_RECOMPUTE,  M(STATE) | M(LINK),     R_WY},
    {"u",    "dplr_wy",    DG_POLICY_RECOMPUTE,  0,                      R_WY},
    {"qg",   "dplr_wy",    DG_POLICY_RECOMPUTE,  M(OUTPUT),              R_WY},
    {"kg",   "dplr_wy",    DG_POLICY_RECOMPUTE,  M(STATE) | M(LINK),     R_WY},
    {"bg",   "dplr_wy",    DG_POLICY_RECOMPUTE,  M(STATE) | M(LINK),     R_WY},
    {"h",    "dplr_state", DG_POLICY_RECOMPUTE,  M(STATE) | M(OUTPUT),   R_STATE},
    {"v2",   "dplr_state", DG_POLICY_RECOMPUTE,  M(STATE) | M(OUTPUT),   R_STATE},
};

static const dg__group_recipe dplr_recipes[] = {
    /* [R_WY] the wy node's forward: the inputs it needs, the derived tensors it reads */
    {"rebuild_wy",    I(Q) | I(K) | I(V) | I(A) | I(B) | I(GI) | I(GE) | I(AAK) | I(TAB),
                      0,                           rebuild_wy},
    /* [R_STATE] the state node's forward (h0 optional) */
    {"rebuild_state", I(V) | I(GI),
                      T(W) | T(U) | T(KG) | T(BG), rebuild_state},
};
/* clang-format on */

static const char *const dplr_members[DPLR_NMEMBERS] = {"dplr_state", "dplr_cp_link",
                                                        "dplr_output"};
static const char *const dplr_inputs[DPLR_NINPUTS] = {"q",  "k",  "v",   "a",   "b",
                                                      "Gi", "Ge", "Aak", "Tab", "h0"};

static const dg__group_spec dplr_group = {
    .op = "dg_dplr",
    .n_members = DPLR_NMEMBERS,
    .members = dplr_members,
    .n_inputs = DPLR_NINPUTS,
    .inputs = dplr_inputs,
    .n_tensors = DPLR_NDERIVED,
    .tensors = dplr_tensors,
    .recipes = dplr_recipes,
};

/* ---- the group's data: the cfg of the op call (host tables owned, device tables retained) ---- */

static void cfg_free(void *p) {
    dg__kda_cfg_free((kda_cfg *)p);
    DG_FREE(p);
}

dg_status dg__dplr_group_new(const kda_cfg *cfg, dg__group **out) {
    *out = NULL;
    kda_cfg *c = (kda_cfg *)DG_CALLOC(1, sizeof *c);
    const size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    int64_t *tab = (int64_t *)DG_MALLOC(ntab * sizeof(int64_t));
    if (!c || !tab) {
        DG_FREE(c);
        DG_FREE(tab);
        return dg__err(DG_ERR_NOMEM, "dg_dplr: no memory for the recompute group");
    }
    dg__kda_cfg_copy(c, cfg, tab);
    return dg__group_new(&dplr_group, c, cfg_free, out);
}

kda_dev *dg__dplr_group_dev(const dg__group *g) {
    return ((const kda_cfg *)dg__group_data(g))->dev;
}

/* ---- recipes ---- */

/* w, u, qg, kg, bg (dplr.md D3, the WY stage), the wy node's forward, for the tensors in make. */
static dg_status rebuild_wy(dg__group *g, dg_ctx *ctx, unsigned make) {
    const kda_cfg *c = (const kda_cfg *)dg__group_data(g);
    const int64_t sk[4] = {c->d.B, c->d.T, c->d.H, c->d.K};
    const int64_t sv[4] = {c->d.B, c->d.T, c->d.H, c->d.V};
    dg_tensor *out[DPLR_BG + 1] = {NULL}, *tmp[DPLR_IN_TAB + 1] = {NULL};
    void *o[DPLR_BG + 1] = {NULL}; /* NULL: not made */
    const void *p[DPLR_IN_TAB + 1] = {NULL};
    dg_status st = DG_OK;
    for (int s = DPLR_W; s <= DPLR_BG && st == DG_OK; s++)
        if (make & DG_BIT(s)) {
            st = dg__kda_new(ctx, c, 4, s == DPLR_U ? sv : sk, &out[s]);
            if (st == DG_OK)
                o[s] = dg_tensor_data(out[s]);
        }
    /* q, k, v, a, b: the leaves, read as the forward read them */
    const int bf16 = dplr_bf16(c, dg__group_input(g, DPLR_IN_Q));
    for (int i = 0; i <= DPLR_IN_TAB && st == DG_OK; i++)
        st = dg__kda_ptr(ctx, dg__group_input(g, i), i <= DPLR_IN_B ? dplr_leaf_dt(c, bf16) : c->dt,
                         &tmp[i], &p[i]);
    if (st == DG_OK)
        st = dplr_run_wy_fwd(ctx, c, bf16, p[DPLR_IN_Q], p[DPLR_IN_K], p[DPLR_IN_V], p[DPLR_IN_A],
                             p[DPLR_IN_B], p[DPLR_IN_GI], p[DPLR_IN_GE], p[DPLR_IN_AAK],
                             p[DPLR_IN_TAB], o[DPLR_W], o[DPLR_U], o[DPLR_QG], o[DPLR_KG],
                             o[DPLR_BG]);
    for (int s = DPLR_W; s <= DPLR_BG; s++) {
        if (st == DG_OK && out[s])
            dg__group_put(g, s, out[s]);
        dg_tensor_free(&out[s]);
    }
    for (int i = 0; i <= DPLR_IN_TAB; i++)
        dg_tensor_free(&tmp[i]);
    return st;
}

/* h, v2: the sequential state pass (dplr.md D3), the state node's forward, rerun from h0. */
static dg_status rebuild_state(dg__group *g, dg_ctx *ctx, unsigned make) {
    const kda_cfg *c = (const kda_cfg *)dg__group_data(g);
    const int64_t NC = kda_cfg_nc(c);
    const int64_t sh[5] = {c->d.B, NC / c->d.B, c->d.H, c->d.K, c->d.V};
    const int64_t sv[4] = {c->d.B, c->d.T, c->d.H, c->d.V};
    dg_tensor *h = NULL, *v2 = NULL, *tmp[3] = {NULL};
    const void *p[3] = {NULL};
    const int ins[3] = {DPLR_IN_V, DPLR_IN_GI, DPLR_IN_H0};
    dg_status st = dg__kda_new(ctx, c, 5, sh, &h);
    if (st == DG_OK)
        st = dg__kda_new(ctx, c, 4, sv, &v2);
    const int bf16 = dplr_bf16(c, dg__group_input(g, DPLR_IN_V)); /* v: the leaf */
    for (int i = 0; i < 3 && st == DG_OK; i++)
        if (dg__group_input(g, ins[i]))
            st = dg__kda_ptr(ctx, dg__group_input(g, ins[i]),
                             i == 0 ? dplr_leaf_dt(c, bf16) : c->dt, &tmp[i], &p[i]);
    if (st == DG_OK)
        st = dplr_run_state_fwd(ctx, c, bf16, dg_tensor_data(dg__group_tensor(g, DPLR_W)),
                                dg_tensor_data(dg__group_tensor(g, DPLR_U)),
                                dg_tensor_data(dg__group_tensor(g, DPLR_KG)),
                                dg_tensor_data(dg__group_tensor(g, DPLR_BG)), p[0], p[1], p[2],
                                dg_tensor_data(h), dg_tensor_data(v2), NULL);
    if (st == DG_OK && (make & T(H)))
        dg__group_put(g, DPLR_H, h);
    if (st == DG_OK && (make & T(V2)))
        dg__group_put(g, DPLR_V2, v2);
    dg_tensor_free(&h);
    dg_tensor_free(&v2);
    for (int i = 0; i < 3; i++)
        dg_tensor_free(&tmp[i]);
    return st;
}

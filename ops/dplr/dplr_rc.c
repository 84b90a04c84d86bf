/*
 * ops/dplr/dplr_rc.c -- the recompute context of the DPLR state and output nodes (spec §5:
 * FLA's DPLR backward recomputes everything from q, k, v, a, b, gk, h0 unless
 * disable_recompute is set).
 *
 * The same scheme as ops/kda/kda_rc.c. The intra node always keeps Aqk, Aqb, Aak and Tab; the
 * tensors of the later stages (w, u, qg, kg, bg from dplr_wy; h, v2 from dplr_state) are either
 * cached here (policy CACHE of "dplr_wy" / "dplr_state") or rebuilt in backward from the inputs
 * q, k, v, a, b, Gi, Ge, Aak, Tab, h0, which earlier nodes keep anyway. The output node's
 * backward (run first) triggers the recomputation; the state node's backward (the last user)
 * drops the recomputed tensors again.
 */
#include "dplr.h"

enum { IN_Q, IN_K, IN_V, IN_A, IN_B, IN_GI, IN_GE, IN_AAK, IN_TAB, IN_H0, NIN };

struct dplr_rc {
    int refcount;
    kda_cfg cfg; /* owns its tables */
    dg_tensor *in[NIN];
    dg_tensor *slot[DPLR_RC_NSLOT];
    int recomputed[DPLR_RC_NSLOT];
};

dg_status dplr_rc_new(const kda_cfg *cfg, dplr_rc **out) {
    dplr_rc *rc = (dplr_rc *)DG_CALLOC(1, sizeof *rc);
    const size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    int64_t *tab = (int64_t *)DG_MALLOC(ntab * sizeof(int64_t));
    if (!rc || !tab) {
        DG_FREE(rc);
        DG_FREE(tab);
        return dg__err(DG_ERR_NOMEM, "dg_dplr: no memory for the recompute context");
    }
    rc->refcount = 1;
    rc->cfg = *cfg;
    memcpy(tab, cfg->tab, ntab * sizeof(int64_t));
    rc->cfg.tab = tab;
    rc->cfg.d.cu = tab;
    rc->cfg.d.chunk_off = tab + cfg->d.N + 1;
    rc->cfg.dev = NULL; /* CPU only */
    *out = rc;
    return DG_OK;
}

dplr_rc *dplr_rc_retain(dplr_rc *rc) {
    rc->refcount++;
    return rc;
}

void dplr_rc_drop_recomputed(dplr_rc *rc) {
    for (int s = 0; s < DPLR_RC_NSLOT; s++)
        if (rc->recomputed[s]) {
            dg_tensor_free(&rc->slot[s]);
            rc->recomputed[s] = 0;
        }
}

void dplr_rc_release(dplr_rc **prc) {
    dplr_rc *rc = *prc;
    *prc = NULL;
    if (!rc || --rc->refcount > 0)
        return;
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&rc->in[i]);
    for (int s = 0; s < DPLR_RC_NSLOT; s++)
        dg_tensor_free(&rc->slot[s]);
    kda_cfg_free(&rc->cfg);
    DG_FREE(rc);
}

static void put(dg_tensor **dst, dg_tensor *t) {
    dg_tensor_free(dst);
    *dst = t ? dg_tensor_retain(t) : NULL;
}

void dplr_rc_set_inputs(dplr_rc *rc, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                        dg_tensor *b, dg_tensor *Gi, dg_tensor *Ge, dg_tensor *Aak, dg_tensor *Tab,
                        dg_tensor *h0) {
    dg_tensor *ts[NIN] = {q, k, v, a, b, Gi, Ge, Aak, Tab, h0};
    for (int i = 0; i < NIN; i++)
        put(&rc->in[i], ts[i]);
}

void dplr_rc_cache(dplr_rc *rc, dplr_rc_slot s, dg_tensor *t) {
    put(&rc->slot[s], t);
    rc->recomputed[s] = 0;
}

static dg_status need_input(const dplr_rc *rc, int i, const char *what) {
    static const char *names[NIN] = {"q", "k", "v", "a", "b", "Gi", "Ge", "Aak", "Tab", "h0"};
    if (!rc->in[i])
        return dg__err(DG_ERR_STATE, "dg_dplr backward: cannot recompute %s without %s", what,
                       names[i]);
    return DG_OK;
}

/* A new tensor in slot s, marked as recomputed. */
static dg_status new_slot(dplr_rc *rc, dg_ctx *ctx, dplr_rc_slot s, int ndim,
                          const int64_t *shape) {
    DG_TRY(kda_new(ctx, &rc->cfg, ndim, shape, &rc->slot[s]));
    rc->recomputed[s] = 1;
    return DG_OK;
}

/* w, u, qg, kg, bg (spec §4, the WY stage) for the slots that are missing. */
static dg_status recompute_wy(dplr_rc *rc, dg_ctx *ctx) {
    const kda_cfg *c = &rc->cfg;
    for (int i = IN_Q; i <= IN_TAB; i++)
        DG_TRY(need_input(rc, i, "w/u/qg/kg/bg"));
    const int64_t sk[4] = {c->d.B, c->d.T, c->d.H, c->d.K};
    const int64_t sv[4] = {c->d.B, c->d.T, c->d.H, c->d.V};
    dg_tensor *tmp[IN_TAB + 1] = {0};
    const void *p[IN_TAB + 1] = {0};
    void *o[DPLR_BG + 1] = {0};
    dg_status st = DG_OK;
    for (int s = DPLR_W; s <= DPLR_BG && st == DG_OK; s++) {
        if (rc->slot[s])
            continue;
        st = new_slot(rc, ctx, (dplr_rc_slot)s, 4, s == DPLR_U ? sv : sk);
        if (st == DG_OK)
            o[s] = dg_tensor_data(rc->slot[s]);
    }
    for (int i = 0; i <= IN_TAB && st == DG_OK; i++)
        st = kda_ptr(ctx, rc->in[i], c->dt, &tmp[i], &p[i]);
    if (st == DG_OK)
        st = dplr_run_wy_fwd(c, p[IN_Q], p[IN_K], p[IN_V], p[IN_A], p[IN_B], p[IN_GI], p[IN_GE],
                             p[IN_AAK], p[IN_TAB], o[DPLR_W], o[DPLR_U], o[DPLR_QG], o[DPLR_KG],
                             o[DPLR_BG]);
    for (int i = 0; i <= IN_TAB; i++)
        dg_tensor_free(&tmp[i]);
    if (st != DG_OK) /* nothing half-written stays behind */
        dplr_rc_drop_recomputed(rc);
    return st;
}

/* h, v2: the sequential state pass (spec §4) rerun from h0. */
static dg_status recompute_state(dplr_rc *rc, dg_ctx *ctx) {
    const kda_cfg *c = &rc->cfg;
    dg_tensor *w, *u, *kg, *bg;
    DG_TRY(dplr_rc_get(rc, ctx, DPLR_W, &w));
    DG_TRY(dplr_rc_get(rc, ctx, DPLR_U, &u));
    DG_TRY(dplr_rc_get(rc, ctx, DPLR_KG, &kg));
    DG_TRY(dplr_rc_get(rc, ctx, DPLR_BG, &bg));
    DG_TRY(need_input(rc, IN_V, "h/v2"));
    DG_TRY(need_input(rc, IN_GI, "h/v2"));
    const int64_t NC = kda_cfg_nc(c);
    const int64_t sh[5] = {c->d.B, NC / c->d.B, c->d.H, c->d.K, c->d.V};
    const int64_t sv[4] = {c->d.B, c->d.T, c->d.H, c->d.V};
    dg_tensor *h = NULL, *v2 = NULL, *tmp[3] = {0};
    const void *p[3] = {0};
    const int ins[3] = {IN_V, IN_GI, IN_H0};
    dg_status st = kda_new(ctx, c, 5, sh, &h);
    if (st == DG_OK)
        st = kda_new(ctx, c, 4, sv, &v2);
    for (int i = 0; i < 3 && st == DG_OK; i++)
        if (rc->in[ins[i]])
            st = kda_ptr(ctx, rc->in[ins[i]], c->dt, &tmp[i], &p[i]);
    if (st == DG_OK)
        st = dplr_run_state_fwd(c, dg_tensor_data(w), dg_tensor_data(u), dg_tensor_data(kg),
                                dg_tensor_data(bg), p[0], p[1], p[2], dg_tensor_data(h),
                                dg_tensor_data(v2), NULL);
    if (st == DG_OK) {
        dg_tensor *made[2] = {h, v2};
        const dplr_rc_slot s[2] = {DPLR_H, DPLR_V2};
        for (int i = 0; i < 2; i++)
            if (!rc->slot[s[i]]) {
                rc->slot[s[i]] = dg_tensor_retain(made[i]);
                rc->recomputed[s[i]] = 1;
            }
    }
    dg_tensor_free(&h);
    dg_tensor_free(&v2);
    for (int i = 0; i < 3; i++)
        dg_tensor_free(&tmp[i]);
    if (st != DG_OK)
        dplr_rc_drop_recomputed(rc);
    return st;
}

dg_status dplr_rc_get(dplr_rc *rc, dg_ctx *ctx, dplr_rc_slot s, dg_tensor **out) {
    if (!rc->slot[s])
        DG_TRY(s <= DPLR_BG ? recompute_wy(rc, ctx) : recompute_state(rc, ctx));
    *out = rc->slot[s];
    return DG_OK;
}

dg_status dplr_rc_save_all(dplr_rc *rc, dg_node *n) {
    for (int i = 0; i < NIN; i++)
        if (rc->in[i])
            DG_TRY(dg__node_save(n, rc->in[i]));
    for (int s = 0; s < DPLR_RC_NSLOT; s++)
        if (rc->slot[s] && !rc->recomputed[s])
            DG_TRY(dg__node_save(n, rc->slot[s]));
    return DG_OK;
}

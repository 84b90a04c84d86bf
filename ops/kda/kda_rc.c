/*
 * ops/kda/kda_rc.c -- the recompute context of the wy/state/output nodes (spec §6.7).
 *
 * FLA keeps only Aqk and Tm from the forward and, in the backward, recomputes W, U, KG, QG from
 * Tm (recompute_w_u) and h, E by rerunning the sequential state pass from h0. On a tape the nodes
 * that consume those tensors (state, output) would normally keep them alive by saving them. So
 * instead they hold this context: under CACHE it holds the tensors themselves; under RECOMPUTE
 * only the inputs needed to rebuild them (q, k, v, beta, G, Tm, h0, which earlier nodes keep
 * anyway). The output node's backward (run first) triggers the recomputation; the state node's
 * backward (the last user) drops the recomputed tensors again.
 */
#include "kda.h"

struct kda_rc {
    int refcount;
    kda_cfg cfg;      /* owns its tables */
    dg_tensor *in[7]; /* q, k, v, beta, G, Tm, h0 */
    dg_tensor *slot[KDA_RC_NSLOT];
    int recomputed[KDA_RC_NSLOT];
};
enum { IN_Q, IN_K, IN_V, IN_BETA, IN_G, IN_TM, IN_H0 };

dg_status kda_rc_new(const kda_cfg *cfg, kda_rc **out) {
    kda_rc *rc = (kda_rc *)DG_CALLOC(1, sizeof *rc);
    size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    int64_t *tab = (int64_t *)DG_MALLOC(ntab * sizeof(int64_t));
    if (!rc || !tab) {
        DG_FREE(rc);
        DG_FREE(tab);
        return dg__err(DG_ERR_NOMEM, "dg_kda: no memory for the recompute context");
    }
    rc->refcount = 1;
    rc->cfg = *cfg;
    memcpy(tab, cfg->tab, ntab * sizeof(int64_t));
    rc->cfg.tab = tab;
    rc->cfg.d.cu = tab;
    rc->cfg.d.chunk_off = tab + cfg->d.N + 1;
    rc->cfg.dev = kda_dev_retain(cfg->dev);
    *out = rc;
    return DG_OK;
}

kda_dev *kda_rc_dev(kda_rc *rc) { return rc->cfg.dev; }

kda_rc *kda_rc_retain(kda_rc *rc) {
    rc->refcount++;
    return rc;
}

void kda_rc_drop_recomputed(kda_rc *rc) {
    for (int s = 0; s < KDA_RC_NSLOT; s++)
        if (rc->recomputed[s]) {
            dg_tensor_free(&rc->slot[s]);
            rc->recomputed[s] = 0;
        }
}

void kda_rc_release(kda_rc **prc) {
    kda_rc *rc = *prc;
    *prc = NULL;
    if (!rc || --rc->refcount > 0)
        return;
    for (int i = 0; i < 7; i++)
        dg_tensor_free(&rc->in[i]);
    for (int s = 0; s < KDA_RC_NSLOT; s++)
        dg_tensor_free(&rc->slot[s]);
    kda_cfg_free(&rc->cfg);
    DG_FREE(rc);
}

static void put(dg_tensor **dst, dg_tensor *t) {
    dg_tensor_free(dst);
    *dst = t ? dg_tensor_retain(t) : NULL;
}

void kda_rc_set_inputs(kda_rc *rc, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *beta,
                       dg_tensor *G, dg_tensor *Tm, dg_tensor *h0) {
    dg_tensor *ts[7] = {q, k, v, beta, G, Tm, h0};
    for (int i = 0; i < 7; i++)
        put(&rc->in[i], ts[i]);
}

void kda_rc_cache(kda_rc *rc, kda_rc_slot s, dg_tensor *t) {
    put(&rc->slot[s], t);
    rc->recomputed[s] = 0;
}

static dg_status need_input(const kda_rc *rc, int i, const char *what) {
    static const char *names[7] = {"q", "k", "v", "beta", "G", "Tm", "h0"};
    if (!rc->in[i])
        return dg__err(DG_ERR_STATE, "dg_kda backward: cannot recompute %s without %s", what,
                       names[i]);
    return DG_OK;
}

/* Pointer to a recipe input in the compute dtype (a converted copy for bf16 inputs on CUDA). */
static dg_status in_ptr(dg_ctx *ctx, kda_rc *rc, int i, dg_tensor **tmp, const void **p) {
    return kda_ptr(ctx, rc->in[i], rc->cfg.dt, tmp, p);
}

/* Slot s of the wy outputs: when missing, a new tensor of `shape` is made for it (marked
 * recomputed) and *out is its data; when held, *out = NULL (kda_wy_fwd skips that output). */
static dg_status wy_slot(kda_rc *rc, dg_ctx *ctx, kda_rc_slot s, const int64_t *shape, void **out) {
    *out = NULL;
    if (rc->slot[s])
        return DG_OK;
    DG_TRY(kda_new(ctx, &rc->cfg, 4, shape, &rc->slot[s]));
    rc->recomputed[s] = 1;
    *out = dg_tensor_data(rc->slot[s]);
    return DG_OK;
}

/* W, U, KG, QG: recompute_w_u (spec §5.2) for the slots that are missing. */
static dg_status recompute_wy(kda_rc *rc, dg_ctx *ctx) {
    const kda_cfg *c = &rc->cfg;
    static const char *what = "W/U/KG/QG";
    for (int i = IN_Q; i <= IN_TM; i++)
        DG_TRY(need_input(rc, i, what));
    int64_t sk[4] = {c->d.B, c->d.T, c->d.HV, c->d.K}, sv[4] = {c->d.B, c->d.T, c->d.HV, c->d.V};
    /* converted copies (NULL where the input already has the compute dtype) */
    dg_tensor *tq = NULL, *tk = NULL, *tv = NULL, *tbeta = NULL, *tG = NULL, *tTm = NULL;
    kda_wy_fwd_io io = {0};
    dg_status st = wy_slot(rc, ctx, KDA_W, sk, &io.W);
    if (st == DG_OK)
        st = wy_slot(rc, ctx, KDA_U, sv, &io.U);
    if (st == DG_OK)
        st = wy_slot(rc, ctx, KDA_KG, sk, &io.KG);
    if (st == DG_OK)
        st = wy_slot(rc, ctx, KDA_QG, sk, &io.QG);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_Q, &tq, &io.q);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_K, &tk, &io.k);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_V, &tv, &io.v);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_BETA, &tbeta, &io.beta);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_G, &tG, &io.G);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_TM, &tTm, &io.Tm);
    if (st == DG_OK)
        st = kda_run_wy_fwd(ctx, c, &io);
    dg_tensor *owned[6] = {tq, tk, tv, tbeta, tG, tTm};
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&owned[i]);
    return st;
}

/* Keep t (retained, marked recomputed) as slot s unless the slot is already held. */
static void keep_recomputed(kda_rc *rc, kda_rc_slot s, dg_tensor *t) {
    if (!rc->slot[s]) {
        rc->slot[s] = dg_tensor_retain(t);
        rc->recomputed[s] = 1;
    }
}

/* h, E: the sequential state pass (spec §5.3) rerun from h0. */
static dg_status recompute_state(kda_rc *rc, dg_ctx *ctx) {
    const kda_cfg *c = &rc->cfg;
    dg_tensor *W, *U, *KG;
    DG_TRY(kda_rc_get(rc, ctx, KDA_W, &W));
    DG_TRY(kda_rc_get(rc, ctx, KDA_U, &U));
    DG_TRY(kda_rc_get(rc, ctx, KDA_KG, &KG));
    DG_TRY(need_input(rc, IN_G, "h/E"));
    int64_t NC = kda_cfg_nc(c);
    int64_t sh[5] = {c->d.B, NC / c->d.B, c->d.HV, c->d.K, c->d.V};
    int64_t se[4] = {c->d.B, c->d.T, c->d.HV, c->d.V};
    dg_tensor *h = NULL, *E = NULL, *tg = NULL, *th = NULL;
    kda_state_fwd_io io = {0}; /* ht: not needed */
    dg_status st = kda_new(ctx, c, 5, sh, &h);
    if (st == DG_OK)
        st = kda_new(ctx, c, 4, se, &E);
    if (st == DG_OK)
        st = in_ptr(ctx, rc, IN_G, &tg, &io.G);
    if (st == DG_OK && rc->in[IN_H0])
        st = in_ptr(ctx, rc, IN_H0, &th, &io.h0);
    if (st == DG_OK) {
        io.W = dg_tensor_data(W);
        io.U = dg_tensor_data(U);
        io.KG = dg_tensor_data(KG);
        io.h = dg_tensor_data(h);
        io.E = dg_tensor_data(E);
        st = kda_run_state_fwd(ctx, c, &io);
    }
    if (st == DG_OK) {
        keep_recomputed(rc, KDA_H, h);
        keep_recomputed(rc, KDA_E, E);
    }
    dg_tensor_free(&h);
    dg_tensor_free(&E);
    dg_tensor_free(&tg);
    dg_tensor_free(&th);
    return st;
}

dg_status kda_rc_get(kda_rc *rc, dg_ctx *ctx, kda_rc_slot s, dg_tensor **out) {
    if (!rc->slot[s])
        DG_TRY(s <= KDA_QG ? recompute_wy(rc, ctx) : recompute_state(rc, ctx));
    *out = rc->slot[s];
    return DG_OK;
}

dg_status kda_rc_save_all(kda_rc *rc, dg_node *n) {
    for (int i = 0; i < 7; i++)
        if (rc->in[i])
            DG_TRY(dg__node_save(n, rc->in[i]));
    for (int s = 0; s < KDA_RC_NSLOT; s++)
        if (rc->slot[s] && !rc->recomputed[s])
            DG_TRY(dg__node_save(n, rc->slot[s]));
    return DG_OK;
}

/*
 * autograd/group.c -- recompute groups (the rules are in group.h; each op's table is with the
 * op: ops/kda/kda_group.c, ops/dplr/dplr_group.c).
 */
#include "group.h"

struct dg__group {
    int refcount;
    const dg__group_spec *spec;
    void *data;
    void (*data_free)(void *);
    dg_tensor *in[DG_GROUP_MAX]; /* group inputs */
    dg_tensor *t[DG_GROUP_MAX];  /* derived tensors held now (kept or rebuilt) */
    unsigned rebuilt;            /* DG_BIT(i): t[i] was rebuilt in backward, the group frees it */
    int pos[DG_GROUP_MAX];       /* member m joined as the pos[m]-th member (tape order); 0: not */
    dg_node *node[DG_GROUP_MAX]; /* member m's node (its saved list holds the kept tensors) */
    int joined;
};

static int g_rebuilt_alive; /* over all groups, for tests */

int dg__group_rebuilt_alive(void) { return g_rebuilt_alive; }

dg_status dg__group_new(const dg__group_spec *spec, void *data, void (*data_free)(void *),
                        dg__group **out) {
    DG_ASSERT(spec->n_members <= DG_GROUP_MAX && spec->n_inputs <= DG_GROUP_MAX &&
              spec->n_tensors <= DG_GROUP_MAX);
    *out = NULL;
    dg__group *g = (dg__group *)DG_CALLOC(1, sizeof *g);
    if (!g) {
        if (data && data_free)
            data_free(data);
        return dg__err(DG_ERR_NOMEM, "%s: no memory for the recompute group", spec->op);
    }
    g->refcount = 1;
    g->spec = spec;
    g->data = data;
    g->data_free = data_free;
    *out = g;
    return DG_OK;
}

dg__group *dg__group_retain(dg__group *g) {
    if (g)
        g->refcount++;
    return g;
}

static void drop(dg__group *g, int i) {
    if (g->rebuilt & DG_BIT(i))
        g_rebuilt_alive--;
    g->rebuilt &= ~DG_BIT(i);
    dg_tensor_free(&g->t[i]);
}

void dg__group_release(dg__group **pg) {
    dg__group *g = *pg;
    *pg = NULL;
    if (!g || --g->refcount > 0)
        return;
    for (int i = 0; i < g->spec->n_inputs; i++)
        dg_tensor_free(&g->in[i]);
    for (int i = 0; i < g->spec->n_tensors; i++)
        drop(g, i);
    if (g->data && g->data_free)
        g->data_free(g->data);
    DG_FREE(g);
}

void *dg__group_data(const dg__group *g) { return g->data; }
dg_tensor *dg__group_input(const dg__group *g, int i) { return g->in[i]; }
dg_tensor *dg__group_tensor(const dg__group *g, int i) { return g->t[i]; }

static void hold(dg_tensor **dst, dg_tensor *t) {
    dg_tensor *old = *dst;
    *dst = t ? dg_tensor_retain(t) : NULL;
    dg_tensor_free(&old);
}

void dg__group_set_input(dg__group *g, int i, dg_tensor *t) { hold(&g->in[i], t); }

void dg__group_keep(dg__group *g, int i, dg_tensor *t) {
    drop(g, i);
    hold(&g->t[i], t);
}

static int caches(const dg__group_row *row) {
    return dg_policy_resolve(row->made_by, row->by_default) == DG_POLICY_CACHE;
}

/* Can backward read derived tensor i: has it a reader, or does a recipe read it that may have to
 * run (one that makes a tensor whose policy is not CACHE)? */
static int may_be_read(const dg__group *g, int i) {
    const dg__group_spec *s = g->spec;
    if (s->tensors[i].readers)
        return 1;
    for (int j = 0; j < s->n_tensors; j++) {
        const int r = s->tensors[j].recipe;
        if (r >= 0 && (s->recipes[r].reads & DG_BIT(i)) && !caches(&s->tensors[j]))
            return 1;
    }
    return 0;
}

void dg__group_offer(dg__group *g, int i, dg_tensor *t) {
    if (caches(&g->spec->tensors[i]) && may_be_read(g, i))
        dg__group_keep(g, i, t);
}

void dg__group_put(dg__group *g, int i, dg_tensor *t) {
    drop(g, i);
    hold(&g->t[i], t);
    g->rebuilt |= DG_BIT(i);
    g_rebuilt_alive++;
}

void dg__group_join(dg__group *g, int m, dg_node *n) {
    DG_ASSERT(m >= 0 && m < g->spec->n_members && g->pos[m] == 0);
    g->pos[m] = ++g->joined;
    g->node[m] = n;
    for (int i = 0; i < g->spec->n_inputs; i++)
        if (g->in[i])
            dg__node_save(n, g->in[i]);
    for (int i = 0; i < g->spec->n_tensors; i++)
        if (g->t[i] && !(g->rebuilt & DG_BIT(i)))
            dg__node_save(n, g->t[i]);
}

/* ---- backward ---- */

/* Is derived tensor i still needed by a member that joined before position `before` (those are
 * the members still to run in this backward), directly or through a recipe that would have to
 * rebuild a missing tensor for one of them? */
static int needed(const dg__group *g, int i, int before) {
    const dg__group_spec *s = g->spec;
    for (int m = 0; m < s->n_members; m++)
        if ((s->tensors[i].readers & DG_BIT(m)) && g->pos[m] && g->pos[m] < before)
            return 1;
    for (int j = 0; j < s->n_tensors; j++) {
        const int r = s->tensors[j].recipe;
        if (!g->t[j] && r >= 0 && (s->recipes[r].reads & DG_BIT(i)) && needed(g, j, before))
            return 1;
    }
    return 0;
}

/* Can derived tensor i be rebuilt if it goes: it has a recipe, the recipe's inputs are set, and
 * every derived tensor the recipe reads is present or can itself be rebuilt (no cycles). */
static int rebuildable(const dg__group *g, int i) {
    const dg__group_spec *s = g->spec;
    const int r = s->tensors[i].recipe;
    if (r < 0)
        return 0;
    for (int k = 0; k < s->n_inputs; k++)
        if ((s->recipes[r].needs & DG_BIT(k)) && !g->in[k])
            return 0;
    for (int j = 0; j < s->n_tensors; j++)
        if ((s->recipes[r].reads & DG_BIT(j)) && !g->t[j] && !rebuildable(g, j))
            return 0;
    return 1;
}

/* Free every tensor that no member before position `before` needs: rebuilt ones, and kept ones
 * that can be rebuilt (their references in the members' saved lists go too). */
static void release_unneeded(dg__group *g, int before) {
    for (int i = 0; i < g->spec->n_tensors; i++) {
        if (!g->t[i] || needed(g, i, before))
            continue;
        if (g->rebuilt & DG_BIT(i)) {
            drop(g, i);
        } else if (rebuildable(g, i)) {
            for (int m = 0; m < g->spec->n_members; m++)
                if (g->node[m])
                    dg__node_unsave(g->node[m], g->t[i]);
            drop(g, i);
        }
    }
}

/* Make derived tensor i present for the members before position `before`: rebuild what its
 * recipe reads, then run the recipe for i and for the other missing tensors of its rows that
 * those members still need. */
static dg_status rebuild(dg__group *g, dg_ctx *ctx, int i, int before) {
    const dg__group_spec *s = g->spec;
    const int r = s->tensors[i].recipe;
    if (r < 0)
        return dg__err(DG_ERR_STATE, "%s backward: %s was not kept and cannot be rebuilt", s->op,
                       s->tensors[i].name);
    const dg__group_recipe *rc = &s->recipes[r];
    for (int j = 0; j < s->n_tensors; j++)
        if ((rc->reads & DG_BIT(j)) && !g->t[j])
            DG_TRY(rebuild(g, ctx, j, before));
    for (int k = 0; k < s->n_inputs; k++)
        if ((rc->needs & DG_BIT(k)) && !g->in[k])
            return dg__err(DG_ERR_STATE, "%s backward: cannot rebuild %s (%s) without %s", s->op,
                           s->tensors[i].name, rc->name, s->inputs[k]);
    unsigned make = 0;
    for (int j = 0; j < s->n_tensors; j++)
        if (s->tensors[j].recipe == r && !g->t[j] && (j == i || needed(g, j, before)))
            make |= DG_BIT(j);
    dg_status st = rc->run(g, ctx, make);
    if (st == DG_OK)
        for (int j = 0; j < s->n_tensors && st == DG_OK; j++)
            if ((make & DG_BIT(j)) && !g->t[j])
                st = dg__err(DG_ERR_STATE, "%s backward: %s did not make %s", s->op, rc->name,
                             s->tensors[j].name);
    if (st != DG_OK) /* nothing half-written stays behind */
        for (int j = 0; j < s->n_tensors; j++)
            if (make & DG_BIT(j))
                drop(g, j);
    return st;
}

dg_status dg__group_get(dg__group *g, dg_ctx *ctx, int m, int i, dg_tensor **out) {
    const dg__group_spec *s = g->spec;
    DG_ASSERT(m >= 0 && m < s->n_members && i >= 0 && i < s->n_tensors);
    *out = NULL;
    if (!(s->tensors[i].readers & DG_BIT(m)) || !g->pos[m])
        return dg__err(DG_ERR_STATE, "%s backward: %s is not a recorded reader of %s", s->op,
                       s->members[m], s->tensors[i].name);
    const int before = g->pos[m] + 1; /* the members still to run, m itself included */
    dg_status st = g->t[i] ? DG_OK : rebuild(g, ctx, i, before);
    release_unneeded(g, before);
    if (st == DG_OK)
        *out = g->t[i];
    return st;
}

void dg__group_done(dg__group *g, int m) {
    DG_ASSERT(m >= 0 && m < g->spec->n_members);
    if (g->pos[m])
        release_unneeded(g, g->pos[m]);
}

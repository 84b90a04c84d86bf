/*
 * autograd/policy.c -- the cache-vs-recompute policy registry.
 *
 * Resolution for a node of kind `op` whose own default is `d`: the global override if one is set,
 * else the per-kind setting, else `d`, else CACHE. Kinds are matched by name, so "kda_state" can be
 * set before any such node exists. Settings are few (one per op kind), so a small table suffices.
 */
#include "tape.h"

#define DG_POLICY_MAX_KINDS 64

static struct {
    char op[32];
    dg_policy p;
} g_kinds[DG_POLICY_MAX_KINDS];
static int g_nkinds;
static dg_policy g_global = DG_POLICY_DEFAULT;

void dg_policy_set(const char *op_kind, dg_policy p) {
    if (!op_kind)
        return;
    for (int i = 0; i < g_nkinds; i++)
        if (strcmp(g_kinds[i].op, op_kind) == 0) {
            g_kinds[i].p = p;
            return;
        }
    if (g_nkinds == DG_POLICY_MAX_KINDS)
        return;
    snprintf(g_kinds[g_nkinds].op, sizeof g_kinds[0].op, "%s", op_kind);
    g_kinds[g_nkinds++].p = p;
}

void dg_policy_set_global(dg_policy p) { g_global = p; }
dg_policy dg_policy_get_global(void) { return g_global; }

void dg_policy_reset(void) {
    g_nkinds = 0;
    g_global = DG_POLICY_DEFAULT;
}

dg_policy dg_policy_resolve(const char *op_kind, dg_policy op_default) {
    if (g_global != DG_POLICY_DEFAULT)
        return g_global;
    for (int i = 0; op_kind && i < g_nkinds; i++)
        if (strcmp(g_kinds[i].op, op_kind) == 0 && g_kinds[i].p != DG_POLICY_DEFAULT)
            return g_kinds[i].p;
    return op_default != DG_POLICY_DEFAULT ? op_default : DG_POLICY_CACHE;
}

const char *dg_policy_name(dg_policy p) {
    switch (p) {
    case DG_POLICY_CACHE:
        return "cache";
    case DG_POLICY_RECOMPUTE:
        return "recompute";
    default:
        return "default";
    }
}

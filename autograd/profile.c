/*
 * autograd/profile.c -- where a step's time goes, by op kind.
 *
 * When enabled, the tape synchronises the node's device at every node boundary: in forward, the
 * time since the previous boundary is charged to the node being committed (ops that record no
 * node are charged to the next one that does); in backward, each node's backward is timed on its
 * own. The synchronisation slows the run down, so use it for the split, not for throughput.
 * Nothing is timed while the node's context captures a CUDA graph (no sync is allowed then, and
 * the captured calls run nothing).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "tape.h"

#include <time.h>

#define DG_PROFILE_MAX 128

static struct {
    int on;
    double last;
    int n;
    dg_profile_entry e[DG_PROFILE_MAX];
} g_prof;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void dg_profile_enable(int on) {
    g_prof.on = on;
    g_prof.last = now_s();
}
int dg_profile_enabled(void) { return g_prof.on; }
void dg_profile_reset(void) {
    g_prof.n = 0;
    g_prof.last = now_s();
}
/* Profiling applies to this context now. */
static int timing(const dg_ctx *ctx) { return g_prof.on && !dg_graph_capturing(ctx); }

void dg_profile_mark(dg_ctx *ctx) {
    if (!timing(ctx))
        return;
    dg_ctx_sync(ctx);
    g_prof.last = now_s();
}

static dg_profile_entry *entry(const char *op) {
    for (int i = 0; i < g_prof.n; i++)
        if (!strcmp(g_prof.e[i].op, op))
            return &g_prof.e[i];
    if (g_prof.n == DG_PROFILE_MAX)
        return NULL;
    dg_profile_entry *e = &g_prof.e[g_prof.n++];
    memset(e, 0, sizeof *e);
    snprintf(e->op, sizeof e->op, "%s", op);
    return e;
}

void dg__profile_forward(dg_ctx *ctx, const char *op) {
    if (!timing(ctx))
        return;
    dg_ctx_sync(ctx);
    double t = now_s();
    dg_profile_entry *e = entry(op);
    if (e) {
        e->fwd_s += t - g_prof.last;
        e->fwd_n++;
    }
    g_prof.last = t;
}

double dg__profile_begin(dg_ctx *ctx) {
    if (!timing(ctx))
        return 0;
    dg_ctx_sync(ctx);
    return now_s();
}

void dg__profile_backward(dg_ctx *ctx, const char *op, double t0) {
    if (!timing(ctx))
        return;
    dg_ctx_sync(ctx);
    double t = now_s();
    dg_profile_entry *e = entry(op);
    if (e) {
        e->bwd_s += t - t0;
        e->bwd_n++;
    }
    g_prof.last = t;
}

int dg_profile_entries(const dg_profile_entry **out) {
    *out = g_prof.e;
    return g_prof.n;
}

static const char *category(const char *op) {
    if (!strncmp(op, "kda", 3))
        return "KDA stages";
    if (!strcmp(op, "matmul") || !strcmp(op, "linear"))
        return "matmuls";
    return "rest";
}

void dg_profile_dump(FILE *f) {
    static const char *cats[] = {"KDA stages", "matmuls", "rest"};
    double cat_s[3] = {0}, total = 0;
    for (int i = 0; i < g_prof.n; i++) {
        double s = g_prof.e[i].fwd_s + g_prof.e[i].bwd_s;
        total += s;
        for (int c = 0; c < 3; c++)
            if (!strcmp(category(g_prof.e[i].op), cats[c]))
                cat_s[c] += s;
    }
    fprintf(f, "%-20s %10s %10s %8s  %s\n", "op kind", "fwd s", "bwd s", "share", "category");
    for (int i = 0; i < g_prof.n; i++) {
        const dg_profile_entry *e = &g_prof.e[i];
        fprintf(f, "%-20s %10.4f %10.4f %7.1f%%  %s\n", e->op, e->fwd_s, e->bwd_s,
                total > 0 ? 100 * (e->fwd_s + e->bwd_s) / total : 0, category(e->op));
    }
    for (int c = 0; c < 3; c++)
        fprintf(f, "%-20s %21.4f %7.1f%%\n", cats[c], cat_s[c],
                total > 0 ? 100 * cat_s[c] / total : 0);
}

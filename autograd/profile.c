/*
 * autograd/profile.c -- where a step's time goes, by op kind.
 *
 * When enabled, the tape synchronises the node's device at every node boundary: in forward, the
 * time since the previous boundary is charged to the node being committed (ops that record no
 * node are charged to the next one that does); in backward, each node's backward is timed on its
 * own. The synchronisation slows the run down, so use it for the split, not for throughput.
 * Nothing is timed while the node's context captures a CUDA graph (no sync is allowed then, and
 * the captured calls run nothing). Memory: at every boundary the context's device high-water
 * mark is read; when it rose during a segment, the new mark is charged to that segment's op kind
 * (peak_bytes), so the op kind holding the largest value is where the run's peak was reached
 * (since the last dg_ctx_reset_peak).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "tape.h"

#include <time.h>

#define DG_PROFILE_MAX 128

static struct {
    int on;
    double last;
    size_t mark; /* the context's peak_in_use at the last boundary */
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
    g_prof.mark = dg_ctx_mem_stats(ctx).peak_in_use;
}

/* Charge a rise of the context's high-water mark since the last boundary to e. */
static void charge_peak(const dg_ctx *ctx, dg_profile_entry *e) {
    const size_t p = ctx ? dg_ctx_mem_stats(ctx).peak_in_use : 0;
    if (p > g_prof.mark && e && p > e->peak_bytes)
        e->peak_bytes = p;
    g_prof.mark = p;
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
    charge_peak(ctx, e);
    g_prof.last = t;
}

double dg__profile_begin(dg_ctx *ctx) {
    if (!timing(ctx))
        return 0;
    dg_ctx_sync(ctx);
    charge_peak(ctx, NULL); /* a rise between nodes belongs to no op kind */
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
    charge_peak(ctx, e);
    g_prof.last = t;
}

int dg_profile_entries(const dg_profile_entry **out) {
    *out = g_prof.e;
    return g_prof.n;
}

static const char *category(const char *op) {
    if (!strncmp(op, "kda", 3))
        return "KDA stages";
    if (!strcmp(op, "matmul") || !strcmp(op, "linear") || !strcmp(op, "swiglu_linear"))
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
    size_t top = 0; /* the run's high-water mark: the largest charged to an op kind */
    for (int i = 0; i < g_prof.n; i++)
        if (g_prof.e[i].peak_bytes > top)
            top = g_prof.e[i].peak_bytes;
    fprintf(f, "%-20s %10s %10s %8s  %-12s %s\n", "op kind", "fwd s", "bwd s", "share", "category",
            "peak GiB (* = the run's)");
    for (int i = 0; i < g_prof.n; i++) {
        const dg_profile_entry *e = &g_prof.e[i];
        char pk[32] = "";
        if (e->peak_bytes)
            snprintf(pk, sizeof pk, "%.2f%s", (double)e->peak_bytes / (1u << 30),
                     e->peak_bytes == top ? " *" : "");
        fprintf(f, "%-20s %10.4f %10.4f %7.1f%%  %-12s %s\n", e->op, e->fwd_s, e->bwd_s,
                total > 0 ? 100 * (e->fwd_s + e->bwd_s) / total : 0, category(e->op), pk);
    }
    for (int c = 0; c < 3; c++)
        fprintf(f, "%-20s %21.4f %7.1f%%\n", cats[c], cat_s[c],
                total > 0 ? 100 * cat_s[c] / total : 0);
}

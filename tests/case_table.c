/* tests/case_table.c -- see case_table.h. */
#include "case_table.h"

#include "kda_testutil.h"

#include <stdarg.h>
#include <string.h>

/* ---- axes, filter and tally ------------------------------------------------------------------ */

static const ct_suite *g_suite;
static const ct_axes *g_ax;

static struct {
    unsigned stages, vars, dirs; /* bit masks, all set when not given */
    int by_case, by_var, list;
    const char *cases; /* the --case list */
} g_f;

static int g_n[CT_MAXSTAGE][CT_MAXDIR][CT_MAXVAR], g_bad[CT_MAXSTAGE][CT_MAXDIR][CT_MAXVAR];
static int g_has_err[CT_MAXSTAGE][CT_MAXDIR][CT_MAXVAR];
static double g_err[CT_MAXSTAGE][CT_MAXDIR][CT_MAXVAR];
static int g_cs = -1, g_cd, g_cv;       /* the cell new checks are counted in */
static int g_seen_checks, g_seen_fails; /* the harness totals at the last cell switch */

static void setup(const ct_axes *axes) {
    if (axes->nstage > CT_MAXSTAGE || axes->ndir > CT_MAXDIR || axes->nvar > CT_MAXVAR) {
        fprintf(stderr, "FATAL: case table axes %d x %d x %d exceed %d x %d x %d\n", axes->nstage,
                axes->ndir, axes->nvar, CT_MAXSTAGE, CT_MAXDIR, CT_MAXVAR);
        exit(1);
    }
    g_ax = axes;
    g_f.stages = (1u << axes->nstage) - 1;
    g_f.vars = (1u << axes->nvar) - 1;
    g_f.dirs = (1u << axes->ndir) - 1;
}

static void usage(const char *prog) {
    fprintf(stderr, "usage: %s cpu|gpu [--list] [--case C,...] [--stage S,...] [--variant V,...]",
            prog);
    if (g_ax->dir_filter) {
        fprintf(stderr, " [--dir ");
        for (int d = 0; d < g_ax->ndir; d++)
            fprintf(stderr, "%s%s", d ? "|" : "", g_ax->dir_name[d]);
        fprintf(stderr, ",...]");
    }
    fprintf(stderr, "\n  stages:");
    for (int s = 0; s < g_ax->nstage; s++)
        fprintf(stderr, " %s", g_ax->stage_name[s]);
    fprintf(stderr, "\n  variants:");
    for (int v = 0; v < g_ax->nvar - 1; v++)
        fprintf(stderr, " %s", g_ax->var_name[v]);
    fprintf(stderr, "\n");
    exit(2);
}

/* Bits of the comma-separated names in `list` among names[0..n). */
static unsigned parse_names(const char *prog, const char *list, const char *const *names, int n) {
    unsigned m = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int i = 0;
        while (i < n && strcmp(tok, names[i]) != 0)
            i++;
        if (i == n) {
            fprintf(stderr, "unknown name '%s'\n", tok);
            usage(prog);
        }
        m |= 1u << i;
    }
    return m;
}

/* Parses argv[2..] (argv[1] is the mode); prints the usage and exits 2 on an error. */
static void parse_args(int argc, char **argv) {
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--list") == 0) {
            g_f.list = 1;
            continue;
        }
        if (i + 1 >= argc)
            usage(argv[0]);
        const char *v = argv[++i];
        if (strcmp(a, "--case") == 0) {
            g_f.cases = v;
            g_f.by_case = 1;
        } else if (strcmp(a, "--stage") == 0) {
            g_f.stages = parse_names(argv[0], v, g_ax->stage_name, g_ax->nstage);
        } else if (strcmp(a, "--variant") == 0) {
            g_f.vars = parse_names(argv[0], v, g_ax->var_name, g_ax->nvar - 1);
            g_f.by_var = 1;
        } else if (strcmp(a, "--dir") == 0 && g_ax->dir_filter) {
            g_f.dirs = parse_names(argv[0], v, g_ax->dir_name, g_ax->ndir);
        } else {
            usage(argv[0]);
        }
    }
}

int ct_sel_x(int s, int v) {
    return (g_f.stages >> s & 1) && (v == g_ax->nvar - 1 ? !g_f.by_var : (int)(g_f.vars >> v & 1));
}

int ct_sel(int s, int dir, int v) { return (g_f.dirs >> dir & 1) && ct_sel_x(s, v); }

int ct_case_wanted(int idx, const char *name) {
    if (!g_f.by_case)
        return 1;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", g_f.cases);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        char *end = NULL;
        long n = strtol(tok, &end, 10);
        if (end != tok && *end == '\0' ? n == idx : strstr(name, tok) != NULL)
            return 1;
    }
    return 0;
}

void ct_cell(int s, int dir, int v) {
    int n, f;
    dg_test_counts(&n, &f);
    if (g_cs >= 0) {
        g_n[g_cs][g_cd][g_cv] += n - g_seen_checks;
        g_bad[g_cs][g_cd][g_cv] += f - g_seen_fails;
    }
    g_seen_checks = n;
    g_seen_fails = f;
    g_cs = s;
    g_cd = dir;
    g_cv = v;
}

void ct_note_err(double rel) {
    if (g_cs < 0)
        return;
    g_err[g_cs][g_cd][g_cv] = fmax(g_err[g_cs][g_cd][g_cv], rel);
    g_has_err[g_cs][g_cd][g_cv] = 1;
}

/* One table: t = 0 the checks (failed in parentheses), t = 1 the largest errors. */
static void print_table(int t) {
    const ct_axes *ax = g_ax;
    printf(t ? "-- largest norm-relative error per stage and variant\n"
             : "-- checks per stage and variant (failed in parentheses)\n");
    printf("   %-16s", "stage");
    for (int v = 0; v < ax->nvar; v++)
        printf(" %11s", ax->var_name[v]);
    printf("\n");
    int total = 0;
    for (int s = 0; s < ax->nstage; s++)
        for (int dir = 0; dir < ax->ndir; dir++) {
            int any = 0;
            for (int v = 0; v < ax->nvar; v++)
                any |= t ? g_has_err[s][dir][v] : g_n[s][dir][v] > 0;
            if (!any)
                continue;
            char row[40];
            if (s < ax->first_extra)
                snprintf(row, sizeof row, "%s %s", ax->stage_name[s], ax->dir_name[dir]);
            else
                snprintf(row, sizeof row, "%s", ax->stage_name[s]);
            printf("   %-16s", row);
            for (int v = 0; v < ax->nvar; v++) {
                char c[32] = ".";
                if (t && g_has_err[s][dir][v])
                    snprintf(c, sizeof c, "%.2e", g_err[s][dir][v]);
                else if (!t && g_bad[s][dir][v])
                    snprintf(c, sizeof c, "%d(%d)", g_n[s][dir][v], g_bad[s][dir][v]);
                else if (!t && g_n[s][dir][v])
                    snprintf(c, sizeof c, "%d", g_n[s][dir][v]);
                printf(" %11s", c);
                total += t ? 0 : g_n[s][dir][v];
            }
            printf("\n");
        }
    if (!t)
        printf("   %-16s %11d\n", "total", total);
}

void ct_print_tally(void) {
    ct_cell(-1, 0, 0);
    int any_err = 0;
    for (int s = 0; s < g_ax->nstage; s++)
        for (int dir = 0; dir < g_ax->ndir; dir++)
            for (int v = 0; v < g_ax->nvar; v++)
                any_err |= g_has_err[s][dir][v];
    print_table(0);
    if (any_err)
        print_table(1);
}

/* ---- the suite ------------------------------------------------------------------------------- */

static void print_groups(unsigned runs) {
    for (int i = 0; i < g_suite->ngroup; i++)
        if (runs >> i & 1)
            printf(" %s", g_suite->group_name[i]);
}

void ct_print_case(const ct_layout *L, unsigned runs) {
    printf("-- case %d: %s (TT=%lld N=%d NC=%lld; groups", L->idx, L->name, (long long)L->TT, L->N,
           (long long)L->NC);
    print_groups(runs);
    printf(")\n");
}

static void list_cases(void) {
    printf("   #  case%*s groups\n", 60, "");
    for (int i = 0; i < g_suite->ncases; i++) {
        ct_layout L;
        const unsigned runs = g_suite->layout(i, &L);
        printf("  %2d  %-64s", i, L.name);
        print_groups(runs);
        printf("\n");
    }
    printf("   variants:");
    for (int v = 0; v < g_ax->nvar - 1; v++)
        printf(" %s", g_ax->var_name[v]);
    printf("\n");
}

static void cpu_cases(dg_ctx *cpu) {
    if (!g_f.by_case && g_suite->cpu_extras)
        g_suite->cpu_extras(cpu);
    ct_print_tally();
}

static void gpu_cases(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    for (int i = 0; i < g_suite->ncases; i++) {
        ct_layout L;
        g_suite->layout(i, &L);
        if (ct_case_wanted(i, L.name))
            g_suite->run(cpu, gpu, i);
    }
    if (!g_f.by_case && g_suite->gpu_extras)
        g_suite->gpu_extras(gpu);
    ct_print_tally();
    dg_ctx_free(&gpu);
}

int ct_main(int argc, char **argv, const ct_suite *suite) {
    g_suite = suite;
    setup(&suite->axes);
    parse_args(argc, argv);
    if (g_f.list) {
        list_cases();
        return 0;
    }
    return dg_test_main(argc, argv, suite->name, cpu_cases, gpu_cases);
}

/* ---- comparisons ----------------------------------------------------------------------------- */

double ct_rel_err(const double *got, const double *want, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i]))
            return INFINITY;
        num = fmax(num, fabs(got[i] - want[i]));
        den = fmax(den, fabs(want[i]));
    }
    return num / (den > 1e-12 ? den : 1e-12);
}

void ct_check_rel(const char *name, const double *got, const double *want, int64_t n, double tol) {
    dg_check_rel(name, got, want, n, tol);
    ct_note_err(ct_rel_err(got, want, n));
}

double ct_max_abs(const double *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* ---- a case's layout ------------------------------------------------------------------------- */

void ct_name_add(ct_layout *L, const char *fmt, ...) {
    const size_t used = strlen(L->name), room = sizeof L->name;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->name + used, room - used, fmt, ap);
    va_end(ap);
}

void ct_layout_init(ct_layout *L, int idx, int64_t B, int64_t T, int nseq, const int64_t *lens,
                    int BT, int H) {
    if (nseq > CT_MAXSEQ) {
        fprintf(stderr, "FATAL: case %d: %d sequences, at most %d\n", idx, nseq, CT_MAXSEQ);
        exit(1);
    }
    memset(L, 0, sizeof *L);
    L->idx = idx;
    L->nseq = nseq;
    L->B = B;
    L->T = T;
    L->N = (int)B;
    if (nseq) {
        for (int i = 0; i < nseq; i++)
            L->cu[i + 1] = L->cu[i] + lens[i];
        L->B = 1;
        L->T = L->cu[nseq];
        L->N = nseq;
    }
    L->TT = L->B * L->T;
    for (int n = 0; n < L->N; n++) {
        const int64_t len = nseq ? lens[n] : L->T;
        L->NC += (len + BT - 1) / BT;
    }
    if (nseq) {
        ct_name_add(L, "varlen %lld", (long long)lens[0]);
        for (int i = 1; i < nseq; i++)
            ct_name_add(L, "/%lld", (long long)lens[i]);
    } else {
        ct_name_add(L, "B=%lld T=%lld", (long long)B, (long long)T);
    }
    ct_name_add(L, " BT=%d H=%d", BT, H);
}

/* ---- ops through the tape -------------------------------------------------------------------- */

ct_op ct_op_of(dg_status (*call)(dg_ctx *, dg_tensor *const *, dg_tensor **, const void *),
               const void *user, const char *const *names, int drop, int first_only) {
    ct_op o;
    memset(&o, 0, sizeof o);
    o.call = call;
    o.user = user;
    o.first_only = first_only;
    while (o.n_out < CT_MAXOUT && names[o.n_out]) {
        o.out_name[o.n_out] = names[o.n_out];
        o.n_out++;
    }
    o.n_out -= drop;
    return o;
}

ct_in ct_mkin(const char *name, int ndim, const int64_t *shape, const double *x, int f32) {
    ct_in t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.ndim = ndim;
    memcpy(t.shape, shape, sizeof(int64_t) * (size_t)ndim);
    t.x = x;
    t.f32 = f32;
    return t;
}

void ct_free_res(ct_res *r) {
    for (int j = 0; j < CT_MAXOUT; j++) {
        free(r->out[j]);
        free(r->seed[j]);
    }
    for (int i = 0; i < CT_MAXIN; i++) {
        free(r->grad[i]);
        free(r->xin[i]);
    }
    memset(r, 0, sizeof *r);
}

void ct_run_op(dg_ctx *ctx, dg_dtype act, const ct_op *op, int n_in, const ct_in *ins,
               const ct_res *from, uint64_t seed, ct_res *r) {
    memset(r, 0, sizeof *r);
    const int cpu = dg_ctx_device(ctx).kind == DG_DEV_CPU;
    dg_tensor *t[CT_MAXIN] = {0}, *out[CT_MAXOUT] = {0}, *sd[CT_MAXOUT] = {0};
    r->n_in = n_in;
    r->n_out = op->n_out;
    for (int i = 0; i < n_in; i++) {
        if (!ins[i].x)
            continue;
        const dg_dtype dt = cpu || !ins[i].f32 ? act : DG_F32;
        t[i] = kt_tensor(ctx, dt, ins[i].ndim, ins[i].shape, ins[i].x, 1);
        r->nin[i] = dg_tensor_numel(t[i]);
        r->xin[i] = kt_host(t[i], r->nin[i]);
    }
    dg_tape_reset();
    DG_TEST_TRY(op->call(ctx, t, out, op->user));
    for (int j = 0; j < r->n_out; j++) {
        if (!out[j]) {
            fprintf(stderr, "FATAL: output %d (%s) is NULL\n", j, op->out_name[j]);
            exit(1);
        }
        r->nout[j] = dg_tensor_numel(out[j]);
        r->out_dt[j] = dg_tensor_dtype(out[j]);
        r->out[j] = kt_host(out[j], r->nout[j]);
        double *s = NULL;
        if (from)
            s = from->seed[j];
        else if (j == 0 || !op->first_only)
            s = kt_randn(r->nout[j], seed + 101 + 7 * (uint64_t)j, 1.0);
        sd[j] = kt_tensor(ctx, r->out_dt[j], dg_tensor_ndim(out[j]), dg_tensor_shape(out[j]), s, 0);
        if (!from)
            free(s);
        if (sd[j])
            r->seed[j] = kt_host(sd[j], r->nout[j]);
    }
    DG_TEST_TRY(dg_tape_backward_multi(ctx, r->n_out, out, (const dg_tensor *const *)sd));
    for (int i = 0; i < n_in; i++) {
        if (!t[i])
            continue;
        const dg_tensor *g = dg_tensor_grad(t[i]);
        r->grad_dt[i] = g ? dg_tensor_dtype(g) : dg_tensor_dtype(t[i]);
        r->grad[i] = kt_host(g, r->nin[i]); /* zeros when nothing flowed */
    }
    dg_tape_reset();
    for (int i = 0; i < CT_MAXIN; i++)
        dg_tensor_free(&t[i]);
    for (int j = 0; j < CT_MAXOUT; j++) {
        dg_tensor_free(&out[j]);
        dg_tensor_free(&sd[j]);
    }
}

ct_tols ct_tols_all(double tol) {
    ct_tols t;
    memset(&t, 0, sizeof t);
    t.tol = tol;
    return t;
}

void ct_compare(const char *label, const ct_op *op, const ct_in *ins, const ct_res *got,
                const ct_res *want, const ct_tols *t, int s, int v) {
    char name[320];
    ct_cell(s, 0, v);
    for (int j = 0; j < got->n_out; j++) {
        snprintf(name, sizeof name, "%s %s", label, op->out_name[j]);
        ct_check_rel(name, got->out[j], want->out[j], got->nout[j], t->tol);
    }
    ct_cell(s, s < g_ax->first_extra ? 1 : 0, v);
    for (int i = 0; i < got->n_in; i++) {
        if (!got->xin[i])
            continue;
        snprintf(name, sizeof name, "%s d%s", label, ins[i].name);
        if (t->iatol[i] > 0)
            dg_check_close(name, got->grad[i], want->grad[i], got->nin[i], t->iatol[i], 0);
        else
            ct_check_rel(name, got->grad[i], want->grad[i], got->nin[i],
                         t->itol[i] > 0 ? t->itol[i] : t->tol);
    }
}

void ct_gpu_vs_cpu(dg_ctx *cpu, dg_ctx *gpu, const char *label, const ct_op *op, int n_in,
                   const ct_in *ins, dg_dtype act, uint64_t seed, const ct_tols *t, int s, int v) {
    ct_res g, c;
    ct_run_op(gpu, act, op, n_in, ins, NULL, seed, &g);
    ct_in used[CT_MAXIN];
    for (int i = 0; i < n_in; i++) {
        used[i] = ins[i];
        used[i].x = g.xin[i];
    }
    ct_run_op(cpu, DG_F64, op, n_in, used, &g, seed, &c);
    char name[288];
    snprintf(name, sizeof name, "%s %s%s", act == DG_BF16 ? "bf16" : "f32 ", label,
             op->first_only ? " (first output seeded)" : "");
    ct_compare(name, op, ins, &g, &c, t, s, v);
    ct_free_res(&g);
    ct_free_res(&c);
}

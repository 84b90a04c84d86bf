/*
 * tools/op_runner.c -- the shared part of the op runners `deltagrad kda` and `deltagrad dplr`
 * (see op_runner.h): common flags, loading, backward, writing, exit codes.
 */
#define _POSIX_C_SOURCE 200809L /* mkdir, stat, access */
#include "tools/op_runner.h"
#include "tools/cli.h"
#include "tools/args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void dg_runner_init(dg_runner *r, const char *cmd, void (*usage)(FILE *f)) {
    memset(r, 0, sizeof *r);
    r->cmd = cmd;
    r->usage = usage;
    r->dev = dg_cpu();
    r->out_dt = -1;
}

int dg_runner_bad(const dg_runner *r, const char *flag, const char *why) {
    fprintf(stderr, "deltagrad %s: %s %s\n(deltagrad %s --help lists the flags)\n", r->cmd, flag,
            why, r->cmd);
    return 2;
}

int dg_runner_bad_arg(const dg_runner *r) {
    fprintf(stderr, "deltagrad %s: %s\n(deltagrad %s --help lists the flags)\n", r->cmd,
            dg_last_error(), r->cmd);
    return 2;
}

static const dg_cli_flag k_common[] = {
    {"--in", "DIR"},
    {"--out", "DIR"},
    {"--device", "cpu, cuda or cuda:N"},
    {"--dtype", "f64, f32 or bf16"},
    {"--out-dtype", "same, f64 or f32"},
    {"--chunk-size", "16, 32 or 64"},
    {"--scale", "a number > 0"},
    {"--recurrent", NULL},
    {"--allow-nonfinite", NULL},
    {"--quiet", NULL},
};

/* One of the common flags (k_common) with its value: 0, or 2 after the error. */
static int common_flag(dg_runner *r, const char *f, const char *v) {
    static const int chunks[3] = {16, 32, 64};
    if (!strcmp(f, "--recurrent")) {
        r->recurrent = 1;
    } else if (!strcmp(f, "--allow-nonfinite")) {
        r->allow_nonfinite = 1;
    } else if (!strcmp(f, "--quiet")) {
        r->quiet = 1;
    } else if (!strcmp(f, "--in")) {
        r->in_dir = v;
    } else if (!strcmp(f, "--out")) {
        r->out_dir = v;
    } else if (!strcmp(f, "--device")) {
        if (dg_device_parse(v, &r->dev) != DG_OK)
            return dg_runner_bad(r, f, "must be cpu, cuda or cuda:N");
    } else if (!strcmp(f, "--dtype")) {
        if (dg_dtype_parse(v, &r->dt) != DG_OK || !dg_dtype_is_float(r->dt))
            return dg_runner_bad(r, f, "must be f64, f32 or bf16");
        r->dt_set = 1;
    } else if (!strcmp(f, "--chunk-size")) {
        if (dg_arg_choice(f, v, chunks, 3, &r->chunk_size) != DG_OK)
            return dg_runner_bad_arg(r);
    } else if (!strcmp(f, "--scale")) {
        if (dg_arg_f64(f, v, 0.0, INFINITY, DG_ARG_LO_OPEN, &r->scale) != DG_OK)
            return dg_runner_bad_arg(r);
    } else { /* --out-dtype */
        dg_dtype od;
        if (!strcmp(v, "same"))
            r->out_dt = -1;
        else if (dg_dtype_parse(v, &od) == DG_OK && (od == DG_F64 || od == DG_F32))
            r->out_dt = (int)od;
        else
            return dg_runner_bad(r, f, "must be same, f64 or f32");
    }
    return 0;
}

int dg_runner_parse(dg_runner *r, int argc, char **argv, const dg_cli_flag *own, int n_own,
                    int (*own_flag)(dg_runner *r, const char *f, const char *v, void *user),
                    void *user) {
    dg_cli_flag all[DG_CLI_MAX_FLAGS];
    int n = 0;
    for (int i = 0; i < DG_CLI_N(k_common); i++)
        all[n++] = k_common[i];
    for (int i = 0; i < n_own && n < DG_CLI_MAX_FLAGS; i++)
        all[n++] = own[i];
    dg_cli c;
    dg_cli_init(&c, r->cmd, r->usage, all, n, argc, argv);
    c.quiet = r->check_only;
    const char *f, *v;
    int rc;
    while ((rc = dg_cli_next(&c, &f, &v)) == DG_CLI_FLAG) {
        int mine = 0;
        for (int i = 0; i < n_own; i++)
            mine |= own[i].name == f;
        int e = mine ? own_flag(r, f, v, user) : common_flag(r, f, v);
        if (e)
            return e;
    }
    if (rc == DG_CLI_END)
        return 0;
    return rc == 0 ? 1 : rc; /* 1: --help or --version printed */
}

int dg_runner_parse_cmd(dg_runner *r, const char *cmd, void (*usage)(FILE *f), int check_only,
                        int argc, char **argv, const dg_cli_flag *own, int n_own,
                        int (*own_flag)(dg_runner *r, const char *f, const char *v, void *user),
                        void *user) {
    dg_runner_init(r, cmd, usage);
    r->check_only = check_only;
    int rc = dg_runner_parse(r, argc, argv, own, n_own, own_flag, user);
    return rc ? rc : dg_runner_args_done(r);
}

int dg_runner_args_done(dg_runner *r) {
    if (!r->in_dir || !r->out_dir) {
        fprintf(stderr,
                "deltagrad %s: --in DIR and --out DIR are required\n(deltagrad %s --help lists "
                "the flags)\n",
                r->cmd, r->cmd);
        return 2;
    }
    if (!r->dt_set)
        r->dt = r->dev.kind == DG_DEV_CPU ? DG_F64 : DG_F32;
    if (r->dev.kind == DG_DEV_CPU && r->dt == DG_BF16)
        return dg_runner_bad(r, "--dtype", "bf16 runs on cuda only; use f32 or f64 on the cpu");
    return 0;
}

dg_dtype dg_runner_state_dtype(const dg_runner *r) {
    return r->dev.kind == DG_DEV_CPU ? r->dt : DG_F32;
}

static void npy_path(char *p, size_t n, const char *dir, const char *name) {
    snprintf(p, n, "%s/%s.npy", dir, name);
}

static int file_exists(const char *dir, const char *name) {
    char p[4096];
    npy_path(p, sizeof p, dir, name);
    return access(p, R_OK) == 0;
}

/* Load DIR/name.npy: a float `dt` converts it on ctx's device, an integer one keeps the file's
 * dtype on the host. */
static dg_status load(dg_runner *r, int i) {
    const dg_runner_in *e = &r->inputs[i];
    char p[4096];
    npy_path(p, sizeof p, r->in_dir, e->name);
    dg_tensor *h = NULL, *c = NULL;
    dg_status s = dg_npy_load(r->host, p, &h);
    if (s != DG_OK)
        return s;
    r->file_dt[i] = dg_tensor_dtype(h);
    if (!dg_dtype_is_float(e->dt)) {
        r->t[i] = h;
        return DG_OK;
    }
    s = dg_to_dtype(r->host, h, e->dt, &c);
    dg_tensor_free(&h);
    if (s != DG_OK)
        return s;
    s = dg_to_device(r->ctx, c, &r->t[i]);
    dg_tensor_free(&c);
    return s;
}

/* The index of the loaded input called name, or -1. */
static int find(const dg_runner *r, const char *name) {
    for (int i = 0; i < r->n; i++)
        if (r->t[i] && !strcmp(r->inputs[i].name, name))
            return i;
    return -1;
}

int dg_runner_start(dg_runner *r, const dg_runner_in *in, int n) {
    if (n > DG_RUNNER_MAX_IN) {
        fprintf(stderr, "deltagrad %s: %d inputs, at most %d\n", r->cmd, n, DG_RUNNER_MAX_IN);
        return 1;
    }
    r->inputs = in;
    r->n = n;
    char missing[1024] = "";
    for (int i = 0; i < n; i++)
        if (in[i].need == DG_RUNNER_REQUIRED && !file_exists(r->in_dir, in[i].name)) {
            size_t l = strlen(missing);
            snprintf(missing + l, sizeof missing - l, " %s.npy%s%s%s", in[i].name,
                     in[i].why ? " (" : "", in[i].why ? in[i].why : "", in[i].why ? ")" : "");
        }
    if (missing[0]) {
        fprintf(stderr, "deltagrad %s: missing in %s:%s\n", r->cmd, r->in_dir, missing);
        return 1;
    }
    if (mkdir(r->out_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "deltagrad %s: cannot create --out %s: %s\n", r->cmd, r->out_dir,
                strerror(errno));
        return 1;
    }
    if (dg_ctx_new(dg_cpu(), &r->host) != DG_OK)
        return dg_runner_fail(r, "cpu context");
    if (r->dev.kind == DG_DEV_CPU)
        r->ctx = r->host;
    else if (dg_ctx_new(r->dev, &r->ctx) != DG_OK)
        return dg_runner_fail(r, "--device");
    for (int i = 0; i < n; i++) {
        if (in[i].need == DG_RUNNER_SKIP ||
            (in[i].need == DG_RUNNER_OPTIONAL && !file_exists(r->in_dir, in[i].name)))
            continue;
        if (load(r, i) != DG_OK) {
            fprintf(stderr, "deltagrad %s: %s/%s.npy: %s\n", r->cmd, r->in_dir, in[i].name,
                    dg_last_error());
            return 1;
        }
    }
    if (find(r, "do") >= 0)
        for (int i = 0; i < n; i++)
            if (r->t[i] && in[i].grad)
                dg_tensor_set_requires_grad(r->t[i], 1);
    return 0;
}

int dg_runner_seqlens(dg_runner *r, const dg_tensor *cu, const dg_tensor *q, int64_t **out,
                      int *n_seqs) {
    *out = NULL;
    if (!cu)
        return 0;
    int64_t n = dg_tensor_numel(cu);
    int64_t T = dg_tensor_ndim(q) >= 2 ? dg_tensor_shape(q)[1] : -1;
    int64_t *tab = malloc((size_t)(n > 0 ? n : 1) * sizeof *tab);
    dg_status s = tab ? dg_kda_seqlens(cu, T, tab, n, n_seqs) : DG_ERR_NOMEM;
    if (s != DG_OK) {
        fprintf(stderr, "deltagrad %s: %s/cu_seqlens.npy: %s\n", r->cmd, r->in_dir,
                tab ? dg_last_error() : "out of memory");
        free(tab);
        return 1;
    }
    *out = tab;
    return 0;
}

int dg_runner_fail(const dg_runner *r, const char *what) {
    const char *e = dg_last_error();
    size_t l = strlen(what);
    /* the library's messages usually start with the function's name already */
    if (!strncmp(e, what, l) && e[l] == ':')
        fprintf(stderr, "deltagrad %s: %s\n", r->cmd, e);
    else
        fprintf(stderr, "deltagrad %s: %s: %s\n", r->cmd, what, e);
    if (strstr(e, "out of memory"))
        fprintf(stderr, "hint: smaller inputs (fewer tokens or heads per run), or --device cpu\n");
    return 1;
}

int dg_runner_op_fail(const dg_runner *r, const char *op, dg_status s) {
    dg_runner_fail(r, op);
    if (s == DG_ERR_SHAPE || s == DG_ERR_DTYPE || s == DG_ERR_ARG)
        fprintf(stderr, "  (the op's arguments are the .npy files of the same names in %s)\n",
                r->in_dir);
    return 1;
}

/* Number of NaN / Inf values in t (-1 if it cannot be read). */
static int64_t count_nonfinite(const dg_tensor *t) {
    double *d = NULL;
    if (dg_tensor_to_f64(t, &d) != DG_OK)
        return -1;
    int64_t n = dg_tensor_numel(t), bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !isfinite(d[i]);
    free(d);
    return bad;
}

/* Write OUT/name.npy in `like` (the dtype of its input file) or the --out-dtype; a file is
 * written whole or not at all (dg_npy_save). */
static dg_status save(dg_runner *r, const char *name, const dg_tensor *t, dg_dtype like) {
    if (!t)
        return DG_OK;
    char p[4096];
    npy_path(p, sizeof p, r->out_dir, name);
    dg_dtype want = r->out_dt >= 0 ? (dg_dtype)r->out_dt : like;
    if (!dg_dtype_is_float(want) || want == DG_BF16)
        want = DG_F32;
    dg_tensor *c = NULL, *h = NULL;
    dg_status s = dg_to_device(r->host, (dg_tensor *)t, &h);
    if (s == DG_OK)
        s = dg_to_dtype(r->host, h, want, &c);
    if (s == DG_OK) { /* counted after the conversion: an f64 value may overflow f32 */
        int64_t bad = count_nonfinite(c);
        size_t l = strlen(r->nonfinite);
        if (bad != 0)
            snprintf(r->nonfinite + l, sizeof r->nonfinite - l, " %s.npy (%lld)", name,
                     (long long)bad);
        s = dg_npy_save(p, c);
    }
    dg_tensor_free(&c);
    dg_tensor_free(&h);
    return s;
}

static void shape_str(char *buf, size_t n, const dg_tensor *t) {
    size_t l = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < dg_tensor_ndim(t) && l < n; d++)
        l += (size_t)snprintf(buf + l, n - l, "%s%lld", d ? "," : "",
                              (long long)dg_tensor_shape(t)[d]);
    if (l < n)
        snprintf(buf + l, n - l, "]");
}

/* An upstream gradient file must have its output's shape; 0 or 1 after naming the file. */
static int check_upstream(const dg_runner *r, int i, const dg_tensor *out, const char *out_name) {
    if (i < 0 || !out)
        return 0;
    const dg_tensor *g = r->t[i];
    int same = dg_tensor_ndim(g) == dg_tensor_ndim(out);
    for (int d = 0; same && d < dg_tensor_ndim(out); d++)
        same = dg_tensor_shape(g)[d] == dg_tensor_shape(out)[d];
    if (same)
        return 0;
    char want[160], got[160];
    shape_str(want, sizeof want, out);
    shape_str(got, sizeof got, g);
    fprintf(stderr, "deltagrad %s: %s/%s.npy: expected %s (the shape of %s.npy), got %s\n", r->cmd,
            r->in_dir, r->inputs[i].name, want, out_name, got);
    return 1;
}

int dg_runner_finish(dg_runner *r, dg_dtype o_like, dg_dtype ht_like) {
    dg_tensor *o = r->o, *ht = r->ht;
    const int dO = find(r, "do"), dht = find(r, "dht");
    if (check_upstream(r, dO, o, "o") || check_upstream(r, dht, ht, "ht"))
        return 1;
    if (save(r, "o", o, o_like) != DG_OK || save(r, "ht", ht, ht_like) != DG_OK)
        return dg_runner_fail(r, "writing outputs");
    if (dO >= 0) {
        dg_tensor *outs[2] = {o, ht};
        const dg_tensor *grads[2] = {r->t[dO], dht >= 0 ? r->t[dht] : NULL};
        if (dg_tape_backward_multi(r->ctx, dht >= 0 ? 2 : 1, outs, grads) != DG_OK)
            return dg_runner_fail(r, "backward");
        for (int i = 0; i < r->n; i++)
            if (r->t[i] && r->inputs[i].grad && dg_tensor_grad(r->t[i]))
                if (save(r, r->inputs[i].grad, dg_tensor_grad(r->t[i]), r->file_dt[i]) != DG_OK)
                    return dg_runner_fail(r, "writing gradients");
    }
    int rc = 0;
    if (r->nonfinite[0]) {
        fprintf(stderr, "deltagrad %s: %s: non-finite values (NaN/Inf) in%s%s\n", r->cmd,
                r->out_dir, r->nonfinite,
                r->allow_nonfinite ? " (allowed by --allow-nonfinite)"
                                   : "; pass --allow-nonfinite to accept them");
        if (!r->allow_nonfinite)
            rc = 3;
    }
    if (!r->quiet)
        printf("deltagrad %s: %s on %s (%s), wrote o.npy ht.npy%s to %s\n", r->cmd,
               r->recurrent ? "recurrent" : "chunked", dg_device_str(r->dev), dg_dtype_name(r->dt),
               dO >= 0 ? " and gradients" : "", r->out_dir);
    return rc;
}

void dg_runner_free(dg_runner *r) {
    dg_tape_reset();
    dg_tensor_free(&r->o);
    dg_tensor_free(&r->ht);
    for (int i = 0; i < DG_RUNNER_MAX_IN; i++)
        dg_tensor_free(&r->t[i]);
    if (r->ctx != r->host)
        dg_ctx_free(&r->ctx);
    r->ctx = NULL;
    dg_ctx_free(&r->host);
}

void dg_runner_in_common(dg_runner_in *in, const int at[DG_RUNNER_NCOMMON], dg_dtype dt,
                         dg_dtype st) {
    const dg_runner_in common[DG_RUNNER_NCOMMON] = {
        [DG_RUNNER_Q] = {"q", DG_RUNNER_REQUIRED, NULL, dt, "dq"},
        [DG_RUNNER_K] = {"k", DG_RUNNER_REQUIRED, NULL, dt, "dk"},
        [DG_RUNNER_V] = {"v", DG_RUNNER_REQUIRED, NULL, dt, "dv"},
        [DG_RUNNER_H0] = {"h0", DG_RUNNER_OPTIONAL, NULL, st, "dh0"},
        [DG_RUNNER_CU] = {"cu_seqlens", DG_RUNNER_OPTIONAL, NULL, DG_I64, NULL},
        [DG_RUNNER_DO] = {"do", DG_RUNNER_OPTIONAL, NULL, dt, NULL},
        [DG_RUNNER_DHT] = {"dht", DG_RUNNER_OPTIONAL, NULL, st, NULL},
    };
    for (int i = 0; i < DG_RUNNER_NCOMMON; i++)
        in[at[i]] = common[i];
}

int dg_runner_run(dg_runner *r, const dg_runner_in *in, int n, int q, int h0, int cu,
                  dg_runner_op_fn op, void *user) {
    int64_t *tab = NULL;
    int n_seqs = 0;
    int rc = dg_runner_start(r, in, n);
    if (!rc)
        rc = dg_runner_seqlens(r, r->t[cu], r->t[q], &tab, &n_seqs);
    if (!rc) {
        dg_status s = op(r, tab, n_seqs, user);
        if (s != DG_OK) {
            char name[64];
            snprintf(name, sizeof name, "dg_%s_%s", r->cmd, r->recurrent ? "recurrent" : "chunk");
            rc = dg_runner_op_fail(r, name, s);
        }
    }
    if (!rc)
        rc = dg_runner_finish(r, r->file_dt[q], r->t[h0] ? r->file_dt[h0] : r->file_dt[q]);
    free(tab);
    dg_runner_free(r);
    return rc;
}

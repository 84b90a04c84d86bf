/*
 * tools/cmd_kda.c -- `deltagrad kda`: run chunked (or recurrent) KDA on tensors stored as .npy
 * files, so users of NumPy / PyTorch can check the op on their own data.
 *
 *   DIR/{q,k,v,g,beta}.npy         required; [B,T,H,K] [B,T,H,K] [B,T,HV,V] [B,T,HV,K] [B,T,HV]
 *   DIR/h0.npy                     optional initial state [N,HV,K,V]
 *   DIR/A_log.npy, dt_bias.npy     with --gate kda|lowerbound (g is then the raw gate input)
 *   DIR/cu_seqlens.npy             optional int64 [N+1], B must be 1
 *   DIR/do.npy (+ dht.npy)         optional: also run backward
 * Writes OUT/o.npy, OUT/ht.npy and, with do.npy, dq dk dv dg dbeta dh0 (+ dA_log ddt_bias).
 * Each output keeps the dtype of the input file it belongs to unless --out-dtype says otherwise;
 * non-finite values in any output make the command fail (exit 3) unless --allow-nonfinite.
 */
#include "deltagrad.h"
#include "tools/commands.h"
#include "train/args.h"

#include <math.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: deltagrad kda --in DIR --out DIR [options]\n"
            "\n"
            "Runs KDA on .npy tensors in DIR (time-major [B,T,H,K] layout, see below).\n"
            "\n"
            "  --in DIR             input folder: q k v g beta .npy (+ h0, A_log, dt_bias,\n"
            "                       cu_seqlens, do, dht)\n"
            "  --out DIR            output folder (created if missing)\n"
            "  --device cpu|cuda    where to run (default cpu)\n"
            "  --dtype f64|f32|bf16 compute dtype (default f64 on cpu, f32 on cuda; bf16: cuda)\n"
            "  --out-dtype D        same | f64 | f32: dtype of the written files (default same:\n"
            "                       each output has the dtype of its input file, see below)\n"
            "  --chunk-size N       16, 32 or 64 (default 64)\n"
            "  --gate none|kda|lowerbound  how g is produced (default none: g is the log decay)\n"
            "  --lower-bound X      lower bound for --gate lowerbound, in [-5, 0) (default -5)\n"
            "  --l2norm-qk          L2-normalise q and k inside the op\n"
            "  --beta-sigmoid       beta.npy holds raw logits: beta = sigmoid(b)\n"
            "  --allow-neg-eigval   with --beta-sigmoid: beta = 2 sigmoid(b)\n"
            "  --scale S            output scale, > 0 (default K^-1/2)\n"
            "  --recurrent          run the token-by-token recurrence instead of the chunked form\n"
            "  --allow-nonfinite    write outputs holding NaN or Inf and exit 0 (default: exit 3)\n"
            "  --quiet              print nothing but errors\n"
            "\n"
            "Files written to OUT (none when an input is refused or the forward fails; o and ht\n"
            "but no gradients when only the backward fails):\n"
            "  always            o.npy [B,T,HV,V] (dtype of q.npy), ht.npy [N,HV,K,V] (dtype of\n"
            "                    h0.npy if given, else of q.npy)\n"
            "  with do.npy       also dq dk dv dg dbeta .npy (dtype of q k v g beta .npy), and\n"
            "                    dh0.npy if h0.npy is given\n"
            "  with do.npy and --gate kda|lowerbound\n"
            "                    also dA_log.npy, and ddt_bias.npy if dt_bias.npy is given\n"
            "A file is written whole or not at all (temp file + rename). When an output holds\n"
            "NaN or Inf the files are still written and the command exits 3 naming the output.\n"
            "\n"
            "Shapes: q,k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; h0 [N,HV,K,V];\n"
            "A_log [HV]; dt_bias [HV*K]; cu_seqlens [N+1] of int64 or int32 (a float array is\n"
            "refused) with B = 1.\n");
}

typedef struct {
    const char *in, *out;
    dg_device dev;
    dg_dtype dt;
    int dt_set, recurrent, quiet, allow_nonfinite;
    int out_dt; /* -1: the dtype of each output's input file; else a dg_dtype */
    dg_kda_opts o;
} kda_args;

/* Set by dg_cmd_kda_check: parse and validate only. */
static int g_check_only;

static int bad(const char *flag, const char *why) {
    fprintf(stderr, "deltagrad kda: %s %s\n", flag, why);
    return 2;
}

static int bad_arg(void) {
    fprintf(stderr, "deltagrad kda: %s\n", dg_last_error());
    return 2;
}

static int parse(int argc, char **argv, kda_args *a) {
    memset(a, 0, sizeof *a);
    a->dev = dg_cpu();
    a->out_dt = -1;
    static const int chunks[3] = {16, 32, 64};
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED()                                                                                     \
    do {                                                                                           \
        if (!v)                                                                                    \
            return bad(f, "needs a value");                                                        \
        i++;                                                                                       \
    } while (0)
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            if (!g_check_only)
                usage(stdout);
            return 1;
        } else if (!strcmp(f, "--in")) {
            NEED();
            a->in = v;
        } else if (!strcmp(f, "--out")) {
            NEED();
            a->out = v;
        } else if (!strcmp(f, "--device")) {
            NEED();
            if (dg_device_parse(v, &a->dev) != DG_OK)
                return bad(f, "must be cpu, cuda or cuda:N");
        } else if (!strcmp(f, "--dtype")) {
            NEED();
            if (dg_dtype_parse(v, &a->dt) != DG_OK || !dg_dtype_is_float(a->dt))
                return bad(f, "must be f64, f32 or bf16");
            a->dt_set = 1;
        } else if (!strcmp(f, "--chunk-size")) {
            NEED();
            if (dg_arg_choice(f, v, chunks, 3, &a->o.chunk_size) != DG_OK)
                return bad_arg();
        } else if (!strcmp(f, "--gate")) {
            NEED();
            if (!strcmp(v, "none"))
                a->o.gate = DG_GATE_NONE;
            else if (!strcmp(v, "kda"))
                a->o.gate = DG_GATE_KDA;
            else if (!strcmp(v, "lowerbound"))
                a->o.gate = DG_GATE_LOWERBOUND;
            else
                return bad(f, "must be none, kda or lowerbound");
        } else if (!strcmp(f, "--lower-bound")) {
            NEED();
            if (dg_arg_f64(f, v, -5.0, 0.0, DG_ARG_HI_OPEN, &a->o.lower_bound) != DG_OK)
                return bad_arg();
        } else if (!strcmp(f, "--scale")) {
            NEED();
            if (dg_arg_f64(f, v, 0.0, INFINITY, DG_ARG_LO_OPEN, &a->o.scale) != DG_OK)
                return bad_arg();
        } else if (!strcmp(f, "--out-dtype")) {
            NEED();
            dg_dtype od;
            if (!strcmp(v, "same"))
                a->out_dt = -1;
            else if (dg_dtype_parse(v, &od) == DG_OK && (od == DG_F64 || od == DG_F32))
                a->out_dt = (int)od;
            else
                return bad(f, "must be same, f64 or f32");
        } else if (!strcmp(f, "--allow-nonfinite")) {
            a->allow_nonfinite = 1;
        } else if (!strcmp(f, "--l2norm-qk")) {
            a->o.l2norm_qk = 1;
        } else if (!strcmp(f, "--beta-sigmoid")) {
            a->o.beta_sigmoid = 1;
        } else if (!strcmp(f, "--allow-neg-eigval")) {
            a->o.allow_neg_eigval = 1;
        } else if (!strcmp(f, "--recurrent")) {
            a->recurrent = 1;
        } else if (!strcmp(f, "--quiet")) {
            a->quiet = 1;
        } else {
            fprintf(stderr, "deltagrad kda: unknown option '%s' (see --help)\n", f);
            return 2;
        }
#undef NEED
    }
    if (!a->in || !a->out) {
        fprintf(stderr, "deltagrad kda: --in DIR and --out DIR are required (see --help)\n");
        return 2;
    }
    if (!a->dt_set)
        a->dt = a->dev.kind == DG_DEV_CPU ? DG_F64 : DG_F32;
    if (a->dev.kind == DG_DEV_CPU && a->dt == DG_BF16)
        return bad("--dtype", "bf16 runs on cuda only; use f32 or f64 on the cpu");
    a->o.output_final_state = 1;
    return 0;
}

static int file_exists(const char *dir, const char *name) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s.npy", dir, name);
    return access(p, R_OK) == 0;
}

/* Load DIR/name.npy and convert to `dt` on ctx's device (integer files keep their dtype);
 * *file_dt gets the dtype the file holds. */
static dg_status load(dg_ctx *host, dg_ctx *ctx, const char *dir, const char *name, dg_dtype dt,
                      dg_tensor **out, dg_dtype *file_dt) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s.npy", dir, name);
    dg_tensor *h = NULL, *c = NULL;
    dg_status s = dg_npy_load(host, p, &h);
    if (s != DG_OK)
        return s;
    *file_dt = dg_tensor_dtype(h);
    if (!dg_dtype_is_float(dt)) {
        *out = h;
        return DG_OK;
    }
    s = dg_to_dtype(host, h, dt, &c);
    dg_tensor_free(&h);
    if (s != DG_OK)
        return s;
    s = dg_to_device(ctx, c, out);
    dg_tensor_free(&c);
    return s;
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

typedef struct {
    const char *dir;
    dg_ctx *host;
    int out_dt; /* -1: each file's own */
    char nonfinite[512]; /* names of outputs holding NaN / Inf */
} saver;

/* Write DIR/name.npy in `like` (the dtype of its input file) or the --out-dtype. */
static dg_status save(saver *sv, const char *name, const dg_tensor *t, dg_dtype like) {
    if (!t)
        return DG_OK;
    char p[4096];
    snprintf(p, sizeof p, "%s/%s.npy", sv->dir, name);
    dg_dtype want = sv->out_dt >= 0 ? (dg_dtype)sv->out_dt : like;
    if (!dg_dtype_is_float(want) || want == DG_BF16)
        want = DG_F32;
    dg_tensor *c = NULL, *h = NULL;
    dg_status s = dg_to_device(sv->host, (dg_tensor *)t, &h);
    if (s == DG_OK)
        s = dg_to_dtype(sv->host, h, want, &c);
    if (s == DG_OK) { /* counted after the conversion: an f64 value may overflow f32 */
        int64_t bad = count_nonfinite(c);
        if (bad != 0)
            snprintf(sv->nonfinite + strlen(sv->nonfinite),
                     sizeof sv->nonfinite - strlen(sv->nonfinite), " %s.npy (%lld)", name,
                     (long long)bad);
        s = dg_npy_save(p, c);
    }
    dg_tensor_free(&c);
    dg_tensor_free(&h);
    return s;
}

static int fail(const char *what) {
    fprintf(stderr, "deltagrad kda: %s: %s\n", what, dg_last_error());
    if (strstr(dg_last_error(), "out of memory"))
        fprintf(stderr, "hint: smaller inputs (fewer tokens or heads per run), or --device cpu\n");
    return 1;
}

int dg_cmd_kda(int argc, char **argv) {
    kda_args a;
    int rc = parse(argc, argv, &a);
    if (rc)
        return rc == 1 ? 0 : rc;

    /* Every missing required file is listed at once. */
    const char *req[] = {"q", "k", "v", "g", "beta"};
    char missing[512] = "";
    for (size_t i = 0; i < sizeof req / sizeof *req; i++)
        if (!file_exists(a.in, req[i]))
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " %s.npy",
                     req[i]);
    if (a.o.gate != DG_GATE_NONE && !file_exists(a.in, "A_log"))
        snprintf(missing + strlen(missing), sizeof missing - strlen(missing),
                 " A_log.npy (needed by --gate)");
    if (missing[0]) {
        fprintf(stderr, "deltagrad kda: missing in %s:%s\n", a.in, missing);
        return 1;
    }
    if (mkdir(a.out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "deltagrad kda: cannot create --out %s: %s\n", a.out, strerror(errno));
        return 1;
    }

    dg_ctx *host = NULL, *ctx = NULL;
    if (dg_ctx_new(dg_cpu(), &host) != DG_OK)
        return fail("cpu context");
    if (a.dev.kind == DG_DEV_CPU) {
        ctx = host;
    } else if (dg_ctx_new(a.dev, &ctx) != DG_OK) {
        dg_ctx_free(&host);
        return fail("--device");
    }
    /* State, gate parameters: the compute dtype on the CPU, f32 on CUDA (KDA.md §1). */
    dg_dtype aux = a.dev.kind == DG_DEV_CPU ? a.dt : DG_F32;

    enum { Q, K, V, G, BETA, H0, ALOG, DTB, CU, DO, DHT, NIN };
    static const char *names[NIN] = {"q",     "k",       "v",          "g",  "beta", "h0",
                                     "A_log", "dt_bias", "cu_seqlens", "do", "dht"};
    dg_tensor *in[NIN] = {0};
    dg_dtype file_dt[NIN] = {0};
    dg_status s = DG_OK;
    for (int i = 0; i < NIN && s == DG_OK; i++) {
        int required = i <= BETA || (i == ALOG && a.o.gate != DG_GATE_NONE);
        if (!required && !file_exists(a.in, names[i]))
            continue;
        if ((i == ALOG || i == DTB) && a.o.gate == DG_GATE_NONE)
            continue;
        dg_ctx *where = i == CU ? host : ctx;
        dg_dtype dt = i <= BETA || i == DO ? a.dt : i == CU ? DG_I64 : aux;
        s = load(host, where, a.in, names[i], dt, &in[i], &file_dt[i]);
        if (s != DG_OK) {
            fprintf(stderr, "deltagrad kda: %s/%s.npy: %s\n", a.in, names[i], dg_last_error());
            rc = 1;
        }
    }
    int64_t *cu = NULL;
    if (s == DG_OK && in[CU]) {
        int64_t n = dg_tensor_numel(in[CU]);
        int64_t T = dg_tensor_ndim(in[Q]) >= 2 ? dg_tensor_shape(in[Q])[1] : -1;
        cu = malloc((size_t)(n > 0 ? n : 1) * sizeof *cu);
        s = cu ? dg_kda_seqlens(in[CU], T, cu, n, &a.o.n_seqs) : DG_ERR_NOMEM;
        if (s != DG_OK) {
            fprintf(stderr, "deltagrad kda: %s/cu_seqlens.npy: %s\n", a.in,
                    cu ? dg_last_error() : "out of memory");
            rc = 1;
        } else {
            a.o.cu_seqlens = cu;
        }
    }
    int backward = in[DO] != NULL;
    if (s == DG_OK && backward)
        for (int i = Q; i <= DTB; i++)
            if (in[i])
                dg_tensor_set_requires_grad(in[i], 1);

    dg_tensor *o = NULL, *ht = NULL;
    if (s == DG_OK) {
        s = (a.recurrent ? dg_kda_recurrent : dg_kda_chunk)(ctx, in[Q], in[K], in[V], in[G],
                                                            in[BETA], in[ALOG], in[DTB], in[H0],
                                                            &a.o, &o, &ht);
        if (s != DG_OK)
            rc = fail(a.recurrent ? "dg_kda_recurrent" : "dg_kda_chunk");
    }
    saver sv = {a.out, host, a.out_dt, ""};
    if (s == DG_OK &&
        ((s = save(&sv, "o", o, file_dt[Q])) != DG_OK ||
         (s = save(&sv, "ht", ht, in[H0] ? file_dt[H0] : file_dt[Q])) != DG_OK))
        rc = fail("writing outputs");
    if (s == DG_OK && backward) {
        dg_tensor *outs[2] = {o, ht};
        const dg_tensor *grads[2] = {in[DO], in[DHT]};
        s = dg_tape_backward_multi(ctx, in[DHT] ? 2 : 1, outs, grads);
        if (s != DG_OK)
            rc = fail("backward");
        static const char *gnames[] = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log",
                                       "ddt_bias"};
        for (int i = Q; s == DG_OK && i <= DTB; i++)
            if (in[i] && dg_tensor_grad(in[i]))
                if ((s = save(&sv, gnames[i], dg_tensor_grad(in[i]), file_dt[i])) != DG_OK)
                    rc = fail("writing gradients");
    }
    if (s == DG_OK && sv.nonfinite[0]) {
        fprintf(stderr, "deltagrad kda: %s: non-finite values (NaN/Inf) in%s%s\n", a.out,
                sv.nonfinite,
                a.allow_nonfinite ? " (allowed by --allow-nonfinite)"
                                  : "; pass --allow-nonfinite to accept them");
        if (!a.allow_nonfinite)
            rc = 3;
    }
    if (s == DG_OK && !a.quiet) {
        printf("deltagrad kda: %s on %s (%s), wrote o.npy ht.npy%s to %s\n",
               a.recurrent ? "recurrent" : "chunked", dg_device_str(a.dev), dg_dtype_name(a.dt),
               backward ? " and gradients" : "", a.out);
    }
    dg_tape_reset();
    dg_tensor_free(&o);
    dg_tensor_free(&ht);
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&in[i]);
    free(cu);
    if (ctx != host)
        dg_ctx_free(&ctx);
    dg_ctx_free(&host);
    return s == DG_OK ? rc : (rc ? rc : 1);
}

int dg_cmd_kda_check(int argc, char **argv) {
    kda_args a;
    g_check_only = 1;
    int rc = parse(argc, argv, &a);
    g_check_only = 0;
    return rc == 1 ? 0 : rc;
}

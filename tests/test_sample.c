/*
 * tests/test_sample.c -- decoding with the recurrent state (dg_model_state, dg_model_generate)
 * and `deltagrad sample`.
 *
 * cpu: (a) for every position of a random prompt + a generated continuation, the stateful path
 *      (the prompt in one chunked forward, then one recurrent token step per byte) gives the
 *      logits of dg_model_forward over the whole sequence: f64 within 1e-12 and f32 within 1e-5
 *      of each position's largest logit (the reasons are at TOL_F32 / TOL_F64). Prompts of 1
 *      and 2 bytes (shorter than the conv width 4) and 37 bytes (more than two chunks of 16),
 *      also fed in pieces; lower-bound and KDA gates, GVA, conv width 1, the KDA and the DPLR
 *      mixer; nothing goes on the tape; greedy sampling picks the full forward's argmax;
 *      (b) argument errors of the library; a failed call leaves the state as it was;
 *      (c) `deltagrad sample` on a tiny checkpoint writes the prompt and exactly --tokens bytes,
 *      the bytes dg_model_generate makes, raw (bytes >= 0x80 pass through) or with --escape;
 *      bad flags and a bad checkpoint get an error naming the flag.
 * gpu: the same equivalence on CUDA (f32), CUDA against the CPU, bf16 compute, and the command
 *      with --device cuda.
 */
#define _XOPEN_SOURCE 700 /* nftw (an XSI interface); also POSIX.1-2008 */
#include "tests/harness.h"
#include "tools/commands.h"
#include "train/checkpoint.h"
#include "train/model.h"
#include "train/train.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Tolerances of stateful against full-forward logits, per position: max_j |got_j - want_j| /
 * max_j |want_j|. Both paths compute the same function with the same weights; they differ only
 * in summation order: the mixer runs the chunked (WY) form over the whole sequence on one
 * side and the chunked form over the prompt followed by the token-by-token recurrence on the
 * other, and the GEMMs see 1 row instead of T. Each reordering moves a result by a few ulps
 * (f32: 6e-8, f64: 1.1e-16 relative) and two layers of norms and projections carry them to the
 * logits: we measure at most 2e-6 (f32) and 4e-15 (f64) here. The bounds leave a margin of 5x
 * and 250x, while a real fault moves logits by O(1): dropping the conv tails or the KDA state
 * between pieces gives errors of 1.7-1.9 on these models. */
#define TOL_F32 1e-5
#define TOL_F64 1e-12
/* CUDA f32: other kernels on both sides (chunked and recurrent KDA kernels, cuBLAS without
 * TF32); the CUDA-vs-CPU model checks of test_train use 1e-4 for the same reason. */
#define TOL_CUDA 1e-4

/* ---- helpers -------------------------------------------------------------------------------- */

static char g_tmp[256];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void tmp_setup(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/dg_test_sample_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        exit(1);
    }
}

static void tmp_cleanup(void) { nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

typedef struct model_case {
    const char *name;
    int HV;              /* value heads (H = 2) */
    dg_gate_kind gate;   /* lower-bound or KDA gate */
    int conv;            /* short conv width */
    dg_mixer_kind mixer; /* KDA or DPLR */
} model_case;

static const model_case g_cases[] = {
    {"lower-bound gate, HV=H=2, conv 4", 2, DG_GATE_LOWERBOUND, 4, DG_MIXER_KDA},
    {"KDA gate, GVA HV=4 H=2, conv 4", 4, DG_GATE_KDA, 4, DG_MIXER_KDA},
    {"lower-bound gate, conv 1 (no conv state)", 2, DG_GATE_LOWERBOUND, 1, DG_MIXER_KDA},
    {"DPLR mixer, lower-bound gate, conv 4", 2, DG_GATE_LOWERBOUND, 4, DG_MIXER_DPLR},
    {"DPLR mixer, KDA gate, conv 1", 2, DG_GATE_KDA, 1, DG_MIXER_DPLR},
};

/* A tiny 2-layer model: d 32, K = V = 16, chunk 16. The matrices get std 0.2 instead of 0.02 so
 * every path (conv taps, state, gate) carries signal into the logits. */
static dg_model *tiny_model(dg_ctx *ctx, const model_case *mc, dg_dtype param, dg_dtype compute,
                            uint64_t seed) {
    dg_model_config c;
    DG_TEST_TRY(dg_model_config_preset("cpu", &c));
    c.d = 32, c.n_layers = 2, c.n_heads = 2, c.n_v_heads = mc->HV;
    c.head_k = c.head_v = 16, c.inter = 64, c.chunk = 16, c.conv = mc->conv, c.gate = mc->gate;
    c.mixer = mc->mixer;
    dg_model *m = NULL;
    DG_TEST_TRY(dg_model_new(ctx, &c, param, compute, &m));
    DG_TEST_TRY(dg_model_init(m, seed));
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].decay)
            DG_TEST_TRY(dg_tensor_rand_normal(m->params[i].t, seed * 1000 + (uint64_t)i, 0.0, 0.2));
    return m;
}

static void rand_bytes(uint8_t *b, int n, uint64_t seed) {
    for (int i = 0; i < n; i++)
        b[i] = (uint8_t)(dg_rand_u01(seed, (uint64_t)i) * 256.0);
}

/* Logits [n, vocab] of dg_model_forward over bytes[0..n), to host doubles. */
static double *full_logits(dg_model *m, const uint8_t *bytes, int n) {
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    for (int i = 0; i < n; i++)
        ids[i] = bytes[i];
    dg_tensor *t = NULL, *lg = NULL;
    DG_TEST_TRY(dg_tensor_from_host(m->ctx, DG_I32, 2, (int64_t[]){1, n}, ids, &t));
    dg_no_grad_begin();
    DG_TEST_TRY(dg_model_forward(m, t, &lg));
    dg_no_grad_end();
    double *v = NULL;
    DG_TEST_TRY(dg_tensor_to_f64(lg, &v));
    dg_tensor_free(&lg);
    dg_tensor_free(&t);
    free(ids);
    return v;
}

/* Logits [n, vocab] of the stateful path: bytes fed in pieces of the given sizes (summing to at
 * most n), then the rest one token at a time. Sets *tape_nodes to the most nodes the tape held
 * after any call (grad mode stays on: the state must record nothing). */
static double *state_logits(dg_model *m, const uint8_t *bytes, int n, const int *pieces,
                            int n_pieces, int *tape_nodes) {
    const int V = m->cfg.vocab;
    double *all = malloc((size_t)n * V * sizeof *all);
    dg_model_state *s = NULL;
    DG_TEST_TRY(dg_model_state_new(m, &s));
    *tape_nodes = dg_tape_num_nodes();
    int pos = 0;
    for (int p = 0; pos < n; p++) {
        int len = p < n_pieces ? pieces[p] : 1;
        int32_t *ids = malloc((size_t)len * sizeof *ids);
        for (int i = 0; i < len; i++)
            ids[i] = bytes[pos + i];
        dg_tensor *t = NULL, *lg = NULL;
        DG_TEST_TRY(dg_tensor_from_host(m->ctx, DG_I32, 2, (int64_t[]){1, len}, ids, &t));
        DG_TEST_TRY(dg_model_forward_state(s, t, &lg));
        if (dg_tape_num_nodes() > *tape_nodes)
            *tape_nodes = dg_tape_num_nodes();
        double *v = NULL;
        DG_TEST_TRY(dg_tensor_to_f64(lg, &v));
        memcpy(all + (size_t)pos * V, v, (size_t)len * V * sizeof *v);
        free(v);
        dg_tensor_free(&lg);
        dg_tensor_free(&t);
        free(ids);
        pos += len;
    }
    if (s->n_tokens != n)
        dg_check(0, "state counts %lld tokens, fed %d", (long long)s->n_tokens, n);
    dg_model_state_free(&s);
    return all;
}

/* The worst position: max over t of max_j |got - want| / max_j |want| (row t of [n, V]). */
static double worst_row_rel(const double *got, const double *want, int n, int V, int *at) {
    double worst = 0.0;
    *at = 0;
    for (int t = 0; t < n; t++) {
        double d = 0.0, w = 0.0;
        for (int j = 0; j < V; j++) {
            double e = fabs(got[(size_t)t * V + j] - want[(size_t)t * V + j]);
            d = isnan(e) || e > d ? e : d;
            w = fmax(w, fabs(want[(size_t)t * V + j]));
        }
        double r = d / (w > 1e-30 ? w : 1e-30);
        if (!(r <= worst)) {
            worst = r;
            *at = t;
        }
    }
    return worst;
}

typedef struct byte_log {
    uint8_t b[4096];
    int n;
} byte_log;

static dg_status log_byte(uint8_t b, void *user) {
    byte_log *l = user;
    if (l->n < (int)sizeof l->b)
        l->b[l->n++] = b;
    return DG_OK;
}

/* One model, one prompt: generate a continuation, then compare stateful and full logits at every
 * position of prompt + continuation. pieces: how the prompt is fed (NULL: in one piece). */
static void equivalence_case(dg_model *m, const char *label, int P, const int *pieces, int n_pieces,
                             double tol) {
    enum { N = 24 };
    const int V = m->cfg.vocab, n = P + N;
    uint8_t seq[128];
    rand_bytes(seq, P, 1000 + (uint64_t)P);
    byte_log lg = {{0}, 0};
    /* sampled (temperature 1, every byte allowed): a continuation the model itself makes */
    DG_TEST_TRY(dg_model_generate(m, seq, P, N, 1.0, 0, 77 + (uint64_t)P, seq + P, log_byte, &lg));
    dg_check(lg.n == N && memcmp(lg.b, seq + P, N) == 0,
             "%s, prompt %d: the callback saw the %d generated bytes in order", label, P, N);
    int one[1] = {P};
    int nodes = 0;
    double *full = full_logits(m, seq, n);
    double *st = state_logits(m, seq, n, pieces ? pieces : one, pieces ? n_pieces : 1, &nodes);
    int at = 0;
    double rel = worst_row_rel(st, full, n, V, &at);
    char how[64] = "one piece";
    if (pieces) {
        int k = snprintf(how, sizeof how, "pieces");
        for (int i = 0; i < n_pieces && k < (int)sizeof how - 8; i++)
            k += snprintf(how + k, sizeof how - (size_t)k, "%s%d", i ? "+" : " ", pieces[i]);
    }
    dg_check(rel <= tol,
             "%s, prompt %d (%s) + %d generated: stateful == full logits at all %d positions, "
             "worst %.2e at position %d (tol %.0e)",
             label, P, how, N, n, rel, at, tol);
    dg_check(nodes == 0, "  ...and the stateful path put nothing on the tape (%d nodes)", nodes);
    free(st);

    /* greedy: each byte is the argmax of the full forward at the position before it (checked
     * where the top two logits are apart by more than the tolerance) */
    uint8_t greedy[N];
    DG_TEST_TRY(dg_model_generate(m, seq, P, N, 0.0, 0, 1, greedy, NULL, NULL));
    memcpy(seq + P, greedy, N);
    free(full);
    full = full_logits(m, seq, n);
    int agree = 0, checked = 0;
    for (int i = 0; i < N; i++) {
        const double *row = full + (size_t)(P - 1 + i) * V;
        int best = 0;
        double top = -INFINITY, second = -INFINITY, mx = 0.0;
        for (int j = 0; j < V; j++) {
            mx = fmax(mx, fabs(row[j]));
            if (row[j] > top)
                second = top, top = row[j], best = j;
            else if (row[j] > second)
                second = row[j];
        }
        if (top - second <= 10 * tol * mx)
            continue;
        checked++;
        agree += best == greedy[i];
    }
    dg_check(agree == checked && checked >= N / 2,
             "  greedy bytes are the full forward's argmax (%d of %d clear-cut positions)", agree,
             checked);
    free(full);
}

/* ---- (a) stateful == full forward ----------------------------------------------------------- */

static void test_equivalence(dg_ctx *ctx, dg_dtype dt, double tol) {
    const int pieces[] = {5, 1, 19, 12}; /* 37 bytes: a piece inside a chunk, one over two */
    for (size_t c = 0; c < sizeof g_cases / sizeof *g_cases; c++) {
        dg_model *m = tiny_model(ctx, &g_cases[c], dt, dt, 3 + c);
        char label[160];
        snprintf(label, sizeof label, "%s %s %s", dg_dtype_name(dt),
                 dg_device_str(dg_ctx_device(ctx)), g_cases[c].name);
        printf("  model: %s\n", label);
        /* the parameters require grad and grad mode is on: the state must not record */
        equivalence_case(m, label, 1, NULL, 0, tol);
        equivalence_case(m, label, 2, NULL, 0, tol);
        equivalence_case(m, label, 37, NULL, 0, tol);
        if (c == 0 || (g_cases[c].mixer != g_cases[c - 1].mixer)) /* first case of a mixer */
            equivalence_case(m, label, 37, pieces, 4, tol);
        dg_model_free(&m);
        dg_tape_reset();
    }
}

/* ---- (b) errors ----------------------------------------------------------------------------- */

static void test_errors(void) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model *m = tiny_model(ctx, &g_cases[0], DG_F32, DG_F32, 5);
    dg_model_state *s = NULL;
    DG_TEST_TRY(dg_model_state_new(m, &s));
    dg_tensor *ids = NULL, *lg = NULL;
    int32_t v[6] = {65, 66, 67, 68, 69, 70};
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 2, (int64_t[]){2, 3}, v, &ids));
    dg_check_err(dg_model_forward_state(s, ids, &lg), DG_ERR_SHAPE, "[1,T]",
                 "forward_state refuses a batch of 2");
    dg_tensor_free(&ids);
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 2, (int64_t[]){1, 3}, v, &ids));
    DG_TEST_TRY(dg_model_forward_state(s, ids, &lg));
    dg_tensor_free(&lg);
    dg_tensor_free(&ids);
    int32_t badid = 300;
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 2, (int64_t[]){1, 1}, &badid, &ids));
    dg_status st = dg_model_forward_state(s, ids, &lg);
    dg_check(st != DG_OK && s->n_tokens == 3 && lg == NULL,
             "an id outside the vocab fails (%s) and leaves the state at 3 tokens",
             dg_status_str(st));
    dg_tensor_free(&ids);
    dg_model_state_reset(s);
    dg_check(s->n_tokens == 0 && s->slot[3] == NULL, "reset goes back to the sequence start");
    dg_model_state_free(&s);
    dg_model_state_free(&s); /* a second free is a no-op */

    uint8_t out[4];
    dg_check_err(dg_model_generate(m, (const uint8_t *)"", 0, 4, 0.8, 40, 1, out, NULL, NULL),
                 DG_ERR_ARG, "prompt", "generate with an empty prompt");
    dg_check_err(dg_model_generate(m, (const uint8_t *)"a", 1, -1, 0.8, 40, 1, out, NULL, NULL),
                 DG_ERR_ARG, "n_new", "generate with a negative length");
    dg_check_err(dg_model_generate(m, (const uint8_t *)"a", 1, 4, NAN, 40, 1, out, NULL, NULL),
                 DG_ERR_ARG, "temperature", "generate with temperature NaN");
    dg_check_err(dg_model_generate(m, (const uint8_t *)"a", 1, 4, -1.0, 40, 1, out, NULL, NULL),
                 DG_ERR_ARG, "temperature", "generate with a negative temperature");
    dg_cp_plan *plan = NULL;
    DG_TEST_TRY(dg_cp_plan_new(2, 0, 16, NULL, 0, NULL, &plan));
    m->cp_plan = plan;
    dg_check_err(dg_model_state_new(m, &s), DG_ERR_STATE, "context parallelism",
                 "no decoding state for a model set up for KCP");
    m->cp_plan = NULL;
    dg_cp_plan_free(&plan);
    dg_model_free(&m);
    dg_tape_reset();
    dg_ctx_free(&ctx);
}

/* ---- (c) the command ------------------------------------------------------------------------ */

/* Runs a command in this process with stdout and stderr going to files; their contents come
 * back in out (n bytes read into *out_n) and err (NUL-terminated). */
static int run_cmd(int (*fn)(int, char **), char **argv, uint8_t *out, size_t n, size_t *out_n,
                   char *err, size_t en) {
    int argc = 0;
    while (argv[argc])
        argc++;
    char op[300], ep[300];
    snprintf(op, sizeof op, "%s/stdout.bin", g_tmp);
    snprintf(ep, sizeof ep, "%s/stderr.txt", g_tmp);
    fflush(stdout);
    fflush(stderr);
    int so = dup(1), se = dup(2);
    int fo = open(op, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int fe = open(ep, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fo, 1);
    dup2(fe, 2);
    close(fo);
    close(fe);
    int rc = fn(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(so, 1);
    dup2(se, 2);
    close(so);
    close(se);
    FILE *f = fopen(op, "rb");
    *out_n = f ? fread(out, 1, n, f) : 0;
    if (f)
        fclose(f);
    f = fopen(ep, "r");
    size_t got = f ? fread(err, 1, en - 1, f) : 0;
    err[got] = 0;
    if (f)
        fclose(f);
    return rc;
}

/* Writes a weights-only checkpoint of m to g_tmp/name. */
static void save_ckpt(dg_model *m, const char *name, char *path, size_t n) {
    snprintf(path, n, "%s/%s", g_tmp, name);
    dg_train_opts o;
    DG_TEST_TRY(dg_train_opts_default("cpu", &o));
    o.model = m->cfg;
    o.out_dir[0] = 0;
    dg_train_state st = {1, 0, 0, 0};
    DG_TEST_TRY(dg_ckpt_save(path, m, NULL, NULL, &o, &st));
}

/* `deltagrad sample` on the checkpoint of m (on device dev): prompt + exactly N raw bytes, the
 * bytes dg_model_generate makes with the same settings. */
static void cli_case(dg_model *m, const char *path, const char *device) {
    enum { N = 120 };
    static uint8_t out[65536];
    static char err[8192];
    size_t n = 0;
    const char *prompt = "Caf\xc3\xa9 \xe2\x82\xac \xff!"; /* UTF-8 and a lone 0xff */
    const size_t np = strlen(prompt);
    char ntok[16];
    snprintf(ntok, sizeof ntok, "%d", N);
    char *argv[] = {"sample",   "--ckpt", (char *)path, "--prompt", (char *)prompt,
                    "--tokens", ntok,     "--top-k",    "0",        "--temperature",
                    "1.5",      "--seed", "11",         "--device", (char *)device,
                    NULL,       NULL};
    int rc = run_cmd(dg_cmd_sample, argv, out, sizeof out, &n, err, sizeof err);
    dg_check(rc == 0, "sample --device %s --tokens %d exits 0 (%d: %.200s)", device, N, rc, err);
    dg_check(n == np + N, "  stdout holds the prompt (%zu bytes) + exactly %d bytes (got %zu)", np,
             N, n);
    dg_check(n >= np && memcmp(out, prompt, np) == 0,
             "  the prompt is echoed byte for byte (UTF-8 and 0xff unescaped)");
    uint8_t want[N];
    DG_TEST_TRY(
        dg_model_generate(m, (const uint8_t *)prompt, (int)np, N, 1.5, 0, 11, want, NULL, NULL));
    int high = 0;
    for (int i = 0; i < N; i++)
        high += want[i] >= 0x80;
    dg_check(n == np + N && memcmp(out + np, want, N) == 0,
             "  the generated bytes are dg_model_generate's, raw (%d of them >= 0x80)", high);

    /* --escape: printable ASCII only, and it decodes to the same bytes */
    char *eargv[18];
    memcpy(eargv, argv, sizeof argv);
    eargv[15] = "--escape";
    eargv[16] = NULL;
    rc = run_cmd(dg_cmd_sample, eargv, out, sizeof out, &n, err, sizeof err);
    uint8_t dec[4096];
    size_t dn = 0;
    int printable = 1;
    for (size_t i = 0; i < n && dn < sizeof dec; i++) {
        if (out[i] != '\n' && out[i] != '\t' && (out[i] < 32 || out[i] >= 127))
            printable = 0;
        if (out[i] == '\\' && i + 1 < n && out[i + 1] == '\\') {
            dec[dn++] = '\\', i++;
        } else if (out[i] == '\\' && i + 3 < n && out[i + 1] == 'x') {
            char hx[3] = {(char)out[i + 2], (char)out[i + 3], 0};
            dec[dn++] = (uint8_t)strtol(hx, NULL, 16), i += 3;
        } else {
            dec[dn++] = out[i];
        }
    }
    dg_check(rc == 0 && printable && dn == np + N && memcmp(dec, prompt, np) == 0 &&
                 memcmp(dec + np, want, N) == 0,
             "  --escape writes printable ASCII (%zu bytes) that decodes to the same bytes", n);
}

static void test_cli(void) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model *m = tiny_model(ctx, &g_cases[1], DG_F32, DG_F32, 9);
    char path[400];
    save_ckpt(m, "tiny.safetensors", path, sizeof path);
    cli_case(m, path, "cpu");

    /* bad input: exit 2 (usage) or 1 (the run), the message naming the flag */
    static uint8_t out[4096];
    static char err[8192];
    size_t n = 0;
    char garbage[400];
    snprintf(garbage, sizeof garbage, "%s/garbage.safetensors", g_tmp);
    FILE *f = fopen(garbage, "wb");
    fputs("not a checkpoint", f);
    fclose(f);
    struct {
        const char *flag, *value;
        int rc;
        const char *needle;
    } bad[] = {
        {"--tokens", "0", 2, "--tokens"},
        {"--tokens", "-5", 2, "--tokens"},
        {"--prompt", "", 2, "--prompt"},
        {"--temperature", "-1", 2, "--temperature"},
        {"--temperature", "nan", 2, "--temperature"},
        {"--top-k", "257", 2, "--top-k"},
        {"--ckpt", garbage, 1, "--ckpt"},
        {"--ckpt", "/nonexistent/ckpt.safetensors", 1, "/nonexistent/ckpt.safetensors"},
        {"--context", "64", 2, "--context"}, /* the stateful path has no context window */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *argv[] = {"sample",   "--ckpt", path, (char *)bad[i].flag, (char *)bad[i].value,
                        "--tokens", "3",      NULL};
        if (!strcmp(bad[i].flag, "--tokens")) /* the flag under test comes last */
            argv[5] = NULL;
        int rc = run_cmd(dg_cmd_sample, argv, out, sizeof out, &n, err, sizeof err);
        dg_check(rc == bad[i].rc && strstr(err, bad[i].needle) && n == 0,
                 "sample %s '%s': exit %d naming %s, nothing on stdout (%d: %.150s)", bad[i].flag,
                 bad[i].value, bad[i].rc, bad[i].needle, rc, err);
    }
    dg_model_free(&m);
    dg_tape_reset();
    dg_ctx_free(&ctx);
}

/* ---- gpu ------------------------------------------------------------------------------------ */

static void test_gpu(void) {
    dg_ctx *cpu = NULL, *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    /* stateful == full forward on CUDA, every case and prompt length */
    test_equivalence(gpu, DG_F32, TOL_CUDA);

    /* CUDA against the CPU, and bf16 compute: the same weights (counter-based init) */
    const model_case *mc = &g_cases[1];
    dg_model *mc32 = tiny_model(cpu, mc, DG_F32, DG_F32, 21);
    dg_model *mg32 = tiny_model(gpu, mc, DG_F32, DG_F32, 21);
    dg_model *mg16 = tiny_model(gpu, mc, DG_F32, DG_BF16, 21);
    enum { P = 37, N = 24 };
    uint8_t seq[P + N];
    rand_bytes(seq, P + N, 5);
    const int V = mc32->cfg.vocab, one[1] = {P};
    int nodes = 0, at = 0;
    double *want = full_logits(mc32, seq, P + N);
    double *g32 = state_logits(mg32, seq, P + N, one, 1, &nodes);
    double rel = worst_row_rel(g32, want, P + N, V, &at);
    dg_check(rel <= TOL_CUDA, "cuda f32 stateful vs cpu f32 full: worst %.2e at %d (tol %.0e)", rel,
             at, TOL_CUDA);
    double *g16 = state_logits(mg16, seq, P + N, one, 1, &nodes);
    rel = worst_row_rel(g16, want, P + N, V, &at);
    /* bf16 activations (8-bit mantissa) through 2 layers, as test_train's bf16 check */
    dg_check(rel <= 5e-2, "cuda bf16 stateful vs cpu f32 full: worst %.2e at %d (tol 5e-2)", rel,
             at);
    dg_check(nodes == 0, "  ...nothing on the tape (%d nodes)", nodes);
    free(want), free(g32), free(g16);

    /* the command on CUDA */
    char path[400];
    save_ckpt(mg32, "tiny_gpu.safetensors", path, sizeof path); /* copied through the host */
    cli_case(mg32, path, "cuda");
    dg_model_free(&mc32);
    dg_model_free(&mg32);
    dg_model_free(&mg16);
    dg_tape_reset();
    dg_ctx_free(&gpu);
    dg_ctx_free(&cpu);
}

static void cpu_cases(dg_ctx *cpu) {
    tmp_setup();
    test_equivalence(cpu, DG_F64, TOL_F64);
    test_equivalence(cpu, DG_F32, TOL_F32);
    test_errors();
    test_cli();
    tmp_cleanup();
}

static void gpu_cases(dg_ctx *cpu) {
    /* the CUDA runs make their own contexts */
    tmp_setup();
    test_gpu();
    tmp_cleanup();
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "sample", cpu_cases, gpu_cases); }

/*
 * tests/test_train.c -- the toy KDA language model and its training loop.
 *
 * cpu: (a) a few dozen steps on a slice of the bundled text lower the loss a lot, and a stream
 *      of random bytes keeps the loss near ln 256 (a model that beats that sees the future);
 *      (b) N steps straight == N/2 steps + checkpoint + resume N/2, loss for loss, bit for bit,
 *      with the losses read from the device every step or every 4-5 steps (--log-every: the
 *      same log.csv, one event per step in order);
 *      (c) SIGKILL during checkpoint writes never leaves an unreadable latest checkpoint, and a
 *      leftover temp file is never taken for a checkpoint;
 *      (d) causality: changing bytes after position t leaves logits at <= t bit-identical,
 *      across chunk boundaries; chunked and recurrent mixers give the same logits;
 *      (e) clear errors for a missing / empty / tiny --data file, --log-every 0 and malformed
 *      checkpoints;
 *      (f) --graph on is refused on the CPU (library and command), left to its default the CPU
 *      runs every step eagerly;
 *      (g) the DPLR mixer (--mixer dplr): f64 gradchecks of every parameter of its layer (both
 *      gates) and of the block around it; chunked == recurrent DPLR inside the model (f64 logits
 *      and every parameter gradient); causality (in (d)); 40 steps lower the loss; stop +
 *      resume == straight bit for bit; checkpoints record the mixer (round trip, mismatch
 *      refused, configs without the key are KDA); `deltagrad train --mixer dplr` end to end
 *      and its flag errors (bad name, GVA, with --resume, with --cp);
 *      plus config JSON round trip and parameter counts (training.md M3: 28,132,896).
 * gpu: the same model on CUDA matches the CPU (f32 logits and one training step), and bf16
 *      compute runs and stays close; the step captured in a CUDA graph and replayed (--graph
 *      on, and the default) trains exactly as the eager step (--graph off): the same losses,
 *      validation losses, gradient norms, weights and AdamW moments, bit for bit, in f32 and
 *      bf16 compute, with accumulation, evaluations, samples and checkpoints between replays;
 *      with profiling on the default runs eagerly and --graph on is refused; a --mixer dplr
 *      model's first 3 steps follow the CPU's losses.
 */
#define _XOPEN_SOURCE 700 /* nftw (an XSI interface); also POSIX.1-2008 */
#include "tests/harness.h"
#include "tools/commands.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/model.h"
#include "train/train.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define KJV DG_SOURCE_DIR "/data/kjv.txt"

/* ---- helpers -------------------------------------------------------------------------------- */

static char g_tmp[256];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void tmp_setup(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/dg_test_train_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        exit(1);
    }
}

static void tmp_cleanup(void) { nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static void tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", g_tmp, name);
}

/* The tiny model of the fast tests: 2 chunks of 32 per row of 64 bytes. */
static dg_model_config tiny_config(void) {
    dg_model_config c;
    DG_TEST_TRY(dg_model_config_preset("cpu", &c));
    c.d = 64;
    c.n_layers = 1;
    c.n_heads = c.n_v_heads = 2;
    c.head_k = c.head_v = 32;
    c.inter = 128;
    c.chunk = 32;
    return c;
}

static dg_train_opts tiny_opts(const char *out_dir) {
    dg_train_opts o;
    DG_TEST_TRY(dg_train_opts_default("cpu", &o));
    o.model = tiny_config();
    snprintf(o.data_path, sizeof o.data_path, "%s", KJV);
    o.max_data_bytes = 200000;
    if (out_dir)
        snprintf(o.out_dir, sizeof o.out_dir, "%s", out_dir);
    else
        o.out_dir[0] = 0;
    o.steps = 40;
    o.warmup = 5;
    o.batch = 4;
    o.seq_len = 64;
    o.lr = 3e-3;
    o.eval_every = 0;
    o.eval_batches = 2;
    o.sample_every = -1;
    o.ckpt_every = 0;
    o.plot = 0;
    o.seed = 1234;
    return o;
}

static double mean_range(const double *v, int64_t a, int64_t b) {
    double s = 0;
    for (int64_t i = a; i < b; i++)
        s += v[i];
    return s / (double)(b - a);
}

/* ---- (a) the loss falls; random bytes stay at ln 256 ---------------------------------------- */

static void test_loss_falls(void) {
    dg_train_opts o = tiny_opts(NULL);
    dg_train_result r;
    double t0 = (double)clock() / CLOCKS_PER_SEC;
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &r), "train 40 tiny steps"))
        return;
    double first = mean_range(r.losses, 0, 3), last = mean_range(r.losses, o.steps - 5, o.steps);
    printf("  loss: first 3 steps %.4f, last 5 steps %.4f, val %.4f (%.1f s cpu)\n", first, last,
           r.final_val, (double)clock() / CLOCKS_PER_SEC - t0);
    /* starts at ln 256 = 5.545 (small init); 40 steps of 256 bytes reach unigram level (~3.1) */
    dg_check(first > 5.0 && first < 6.0, "initial loss %.4f is near ln 256 = 5.545", first);
    dg_check(last < first - 1.5, "loss falls by > 1.5 nats in 40 steps (%.4f -> %.4f)", first,
             last);
    dg_check(r.final_val < 3.8, "validation loss %.4f < 3.8 after 40 steps", r.final_val);
    dg_train_result_free(&r);

    /* random bytes: nothing to learn, the loss must stay near ln 256 */
    char path[512];
    tmp_path(path, sizeof path, "random.bin");
    FILE *f = fopen(path, "wb");
    for (int i = 0; i < 100000; i++)
        fputc((int)(dg_rand_u01(99, (uint64_t)i) * 256.0), f);
    fclose(f);
    o = tiny_opts(NULL);
    snprintf(o.data_path, sizeof o.data_path, "%s", path);
    o.steps = 25;
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &r), "train on random bytes"))
        return;
    /* 25 steps x 256 bytes cannot memorise 90 kB: any drop well below ln 256 means leakage */
    dg_check(r.final_val > 5.3, "random bytes: val loss %.4f stays near ln 256 (> 5.3)",
             r.final_val);
    dg_train_result_free(&r);
}

/* ---- (b) resume reproduces the uninterrupted run ------------------------------------------- */

/* DG_EV_STEP events: each step once, in order. */
typedef struct step_seen {
    int64_t next, bad;
} step_seen;

static void count_steps(const dg_train_event *ev, void *user) {
    step_seen *c = user;
    if (ev->kind != DG_EV_STEP)
        return;
    if (ev->step != c->next)
        c->bad++;
    c->next = ev->step + 1;
}

/* The first `cols` comma-separated fields of every line of a CSV file, concatenated. */
static char *csv_cols(const char *path, int cols) {
    FILE *f = fopen(path, "r");
    size_t cap = 1 << 16, n = 0;
    char *out = calloc(cap, 1), line[512];
    while (f && out && fgets(line, sizeof line, f)) {
        int c = 0;
        for (char *p = line; *p && *p != '\n' && n + 2 < cap; p++) {
            if (*p == ',' && ++c == cols)
                break;
            out[n++] = *p;
        }
        out[n++] = '\n';
    }
    if (f)
        fclose(f);
    return out;
}

static void test_resume(void) {
    char a[512], b[512];
    tmp_path(a, sizeof a, "straight");
    tmp_path(b, sizeof b, "resumed");
    const int64_t N = 12;
    dg_train_opts o = tiny_opts(a);
    o.steps = N;
    o.accum = 2; /* the data position must advance per micro-batch */
    o.eval_every = 3;
    dg_train_result straight, half, rest;
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &straight), "straight run"))
        return;
    o = tiny_opts(b);
    o.steps = N;
    o.accum = 2;
    o.eval_every = 3;
    o.stop_at = N / 2;
    o.log_every = 4; /* the host reads the device at steps 3 (eval), 4 and 6 (eval, stop) */
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &half), "first half"))
        return;
    /* resume takes everything from the checkpoint: garble what it must not use */
    dg_train_opts o2 = tiny_opts(b);
    o2.resume = 1;
    o2.lr = 1.0;
    o2.seed = 777;
    o2.batch = 3;
    o2.data_path[0] = 0; /* the checkpoint's own text */
    o2.eval_every = 3;
    o2.log_every = 5;
    step_seen seen = {N / 2 + 1, 0};
    if (!dg_check_ok(dg_train_run(&o2, count_steps, &seen, &rest), "resumed second half"))
        return;
    dg_check(seen.bad == 0 && seen.next == N + 1,
             "--log-every 5: one step event per step, in order (%lld out of order)",
             (long long)seen.bad);
    dg_check(half.last_step == N / 2 && rest.first_step == N / 2 + 1 && rest.last_step == N,
             "resume continues at step %lld and ends at %lld", (long long)rest.first_step,
             (long long)rest.last_step);
    int same = 1;
    for (int64_t s = 0; s < N; s++) {
        double want = straight.losses[s], got = s < N / 2 ? half.losses[s] : rest.losses[s];
        if (memcmp(&want, &got, sizeof want) != 0) {
            printf("  step %lld: straight %.9g, interrupted %.9g\n", (long long)s + 1, want, got);
            same = 0;
        }
    }
    dg_check(same,
             "per-step losses of straight and save/resume runs are bit-identical (%lld "
             "steps, last %.6f)",
             (long long)N, straight.losses[N - 1]);
    dg_check(memcmp(&straight.final_val, &rest.final_val, sizeof(double)) == 0,
             "final validation loss identical (%.9g vs %.9g)", straight.final_val, rest.final_val);

    /* the CSV of the resumed run holds each step once */
    char csv[600];
    snprintf(csv, sizeof csv, "%s/log.csv", b);
    FILE *f = fopen(csv, "r");
    int lines = 0, header = 0;
    char line[512];
    while (f && fgets(line, sizeof line, f))
        lines++, header += !strncmp(line,
                                    "step,train_loss,val_loss,lr,grad_norm,tokens_per_s,"
                                    "elapsed_s,mem_bytes",
                                    60);
    if (f)
        fclose(f);
    dg_check(header == 1 && lines == N + 1, "log.csv after resume: header + %lld lines (got %d)",
             (long long)N, lines);
    /* what the device kept and the host read every 4 or 5 steps is what it read every step */
    char csv_a[600];
    snprintf(csv_a, sizeof csv_a, "%s/log.csv", a);
    char *ca = csv_cols(csv_a, 5), *cb = csv_cols(csv, 5);
    dg_check(ca && cb && strlen(ca) > 100 && !strcmp(ca, cb),
             "log.csv step, train_loss, val_loss, lr, grad_norm: --log-every 1 == --log-every "
             "4 then 5 with a resume between");
    free(ca);
    free(cb);

    /* resuming a finished run does nothing; resuming a missing one names the path */
    dg_train_result again;
    dg_check_ok(dg_train_run(&o2, NULL, NULL, &again), "resume of a finished run");
    dg_check(again.last_step < again.first_step, "a finished run trains no further steps");
    dg_train_result_free(&again);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/nowhere", g_tmp);
    dg_train_opts o3 = tiny_opts(missing);
    o3.resume = 1;
    dg_check_err(dg_train_run(&o3, NULL, NULL, NULL), DG_ERR_IO, "nowhere/ckpt_latest",
                 "resume from a directory without a checkpoint");
    dg_train_result_free(&straight);
    dg_train_result_free(&half);
    dg_train_result_free(&rest);
}

/* ---- (c) SIGKILL during checkpoint writes -------------------------------------------------- */

static void ckpt_writer(const char *dir, int fd, int64_t base) {
    dg_ctx *ctx = NULL;
    dg_model *m = NULL;
    dg_model_config c = tiny_config();
    c.d = 256, c.n_layers = 2, c.inter = 768; /* ~2M parameters: ~25 MB per checkpoint */
    if (dg_ctx_new(dg_cpu(), &ctx) || dg_model_new(ctx, &c, DG_F32, DG_F32, &m) ||
        dg_model_init(m, 5))
        _exit(3);
    dg_tensor **am = calloc((size_t)m->n_params, sizeof *am);
    for (int i = 0; i < m->n_params; i++)
        if (dg_tensor_zeros(ctx, DG_F32, dg_tensor_ndim(m->params[i].t),
                            dg_tensor_shape(m->params[i].t), &am[i]))
            _exit(3);
    dg_train_opts o = tiny_opts(dir);
    dg_train_state st = {0, 0, 1, 1};
    char path[600];
    dg_ckpt_latest_path(dir, path, sizeof path);
    for (int64_t step = base + 1;; step++) {
        st.step = step;
        st.data_counter = (uint64_t)step * 10;
        if (dg_ckpt_save(path, m, am, am, &o, &st) != DG_OK)
            _exit(4);
        if (step == base + 1 && write(fd, "x", 1) != 1)
            _exit(5);
    }
}

static void test_kill_during_save(void) {
    char dir[512], path[600];
    tmp_path(dir, sizeof dir, "killed");
    mkdir(dir, 0777);
    dg_ckpt_latest_path(dir, path, sizeof path);
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    int rounds = 6, loaded = 0, temps_seen = 0;
    for (int round = 0; round < rounds; round++) {
        int fds[2];
        if (pipe(fds) != 0) {
            dg_check(0, "pipe");
            return;
        }
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            ckpt_writer(dir, fds[1], 1000000 * (int64_t)round);
            _exit(0);
        }
        close(fds[1]);
        char byte;
        ssize_t got = read(fds[0], &byte, 1); /* one complete checkpoint exists */
        close(fds[0]);
        /* then kill it at a pseudo-random moment, usually in the middle of a write */
        unsigned delay_us = (unsigned)(dg_rand_u01(42, (uint64_t)round) * 60000.0);
        struct timespec ts = {0, (long)delay_us * 1000L};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        int status = 0;
        waitpid(pid, &status, 0);
        if (got != 1) {
            dg_check(0, "checkpoint writer failed before its first checkpoint (status %d)", status);
            continue;
        }
        /* leftover temp files do not look like checkpoints */
        DIR *d = opendir(dir);
        struct dirent *e;
        int stray = 0;
        while (d && (e = readdir(d))) {
            if (strstr(e->d_name, ".tmp."))
                temps_seen++;
            else if (e->d_name[0] != '.' && strcmp(e->d_name, DG_CKPT_LATEST) != 0)
                stray++;
        }
        if (d)
            closedir(d);
        dg_check(stray == 0, "round %d: no file besides the latest checkpoint and temps", round);
        dg_ckpt ck;
        dg_status s = dg_ckpt_load(ctx, path, &ck);
        if (s == DG_OK) {
            loaded++;
            /* this round's writer completed at least its first checkpoint before the kill */
            dg_check(ck.state.step > 1000000 * (int64_t)round &&
                         ck.state.data_counter == 10 * (uint64_t)ck.state.step,
                     "round %d (killed after %u us): latest checkpoint loads, step %lld", round,
                     delay_us, (long long)ck.state.step);
            dg_ckpt_free(&ck);
        } else {
            dg_check(0, "round %d: latest checkpoint unreadable after SIGKILL: %s", round,
                     dg_last_error());
        }
    }
    dg_check(loaded == rounds, "%d of %d kills left a loadable checkpoint (%d temp files seen)",
             loaded, rounds, temps_seen);
    /* a new run cleans leftover temps of dead writers */
    dg_ckpt_clean_temps(dir);
    DIR *d = opendir(dir);
    struct dirent *e;
    int temps = 0;
    while (d && (e = readdir(d)))
        temps += strstr(e->d_name, ".tmp.") != NULL;
    if (d)
        closedir(d);
    dg_check(temps == 0, "dg_ckpt_clean_temps removed the temp files of killed writers");
    dg_ctx_free(&ctx);
}

/* ---- (d) causality and chunked == recurrent ------------------------------------------------- */

static float *logits_of(dg_model *m, const int32_t *ids, int B, int T) {
    dg_tensor *t = NULL, *lg = NULL;
    DG_TEST_TRY(dg_tensor_from_host(m->ctx, DG_I32, 2, (int64_t[]){B, T}, ids, &t));
    dg_no_grad_begin();
    DG_TEST_TRY(dg_model_forward(m, t, &lg));
    dg_no_grad_end();
    size_t n = (size_t)dg_tensor_numel(lg);
    float *v = malloc(n * sizeof *v);
    DG_TEST_TRY(dg_tensor_to_host(lg, v, n * sizeof *v));
    dg_tensor_free(&lg);
    dg_tensor_free(&t);
    return v;
}

static void causality_case(dg_mixer_kind mixer, int HV, int chunk) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model_config c = tiny_config();
    c.d = 48, c.head_k = c.head_v = 16, c.chunk = chunk, c.n_layers = 2, c.inter = 96;
    c.n_v_heads = HV;
    c.mixer = mixer;
    printf("  model: %s mixer, H=%d HV=%d chunk=%d, 2 layers\n", dg_mixer_name(mixer), c.n_heads,
           HV, chunk);
    dg_model *m = NULL;
    DG_TEST_TRY(dg_model_new(ctx, &c, DG_F32, DG_F32, &m));
    /* larger init than 0.02 so every path carries signal */
    DG_TEST_TRY(dg_model_init(m, 3));
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].decay)
            DG_TEST_TRY(dg_tensor_rand_normal(m->params[i].t, 100 + (uint64_t)i, 0.0, 0.2));
    const int T = 56, V = c.vocab; /* chunk 16: [0,16) [16,32) [32,48) [48,56) */
    int32_t ids[56], ids2[56];
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)(dg_rand_u01(7, (uint64_t)i) * 256);
    float *base = logits_of(m, ids, 1, T);
    const int ts[] = {5, 15, 16, 20, 31, 47};
    for (size_t k = 0; k < sizeof ts / sizeof *ts; k++) {
        int t = ts[k];
        memcpy(ids2, ids, sizeof ids);
        for (int i = t + 1; i < T; i++)
            ids2[i] = (ids[i] + 1 + (int32_t)(dg_rand_u01(8, (uint64_t)i) * 254)) % 256;
        float *alt = logits_of(m, ids2, 1, T);
        int same = memcmp(base, alt, (size_t)(t + 1) * V * sizeof(float)) == 0;
        double diff_next = 0.0;
        for (int j = 0; j < V; j++)
            diff_next += fabs((double)base[(t + 1) * V + j] - alt[(t + 1) * V + j]);
        dg_check(same, "causality: bytes after %d changed, logits 0..%d bit-identical", t, t);
        dg_check(diff_next > 0.0, "  ...and logits at %d do change (sum |diff| %.3e)", t + 1,
                 diff_next);
        free(alt);
    }
    /* two rows of a batch are independent */
    int32_t two[112];
    memcpy(two, ids, sizeof ids);
    memcpy(two + T, ids2, sizeof ids2);
    float *both = logits_of(m, two, 2, T);
    dg_check(memcmp(both, base, (size_t)T * V * sizeof(float)) == 0,
             "row 0 of a batch equals the same row alone (rows do not mix)");
    free(both);

    /* chunked vs token-by-token recurrence */
    m->recurrent_mixer = 1;
    float *rec = logits_of(m, ids, 1, T);
    m->recurrent_mixer = 0;
    double md = 0.0, mx = 0.0;
    for (int i = 0; i < T * V; i++) {
        md = fmax(md, fabs((double)rec[i] - base[i]));
        mx = fmax(mx, fabs((double)base[i]));
    }
    /* f32 through 2 layers: the two orders of summation differ by a few ulps of the logits */
    dg_check(md <= 1e-4 * (mx > 1 ? mx : 1),
             "chunked == recurrent logits: max diff %.3e (max %.3f)", md, mx);
    free(rec);
    free(base);
    dg_model_free(&m);
    dg_tape_reset();
    dg_ctx_free(&ctx);
}

static void test_causality(void) {
    causality_case(DG_MIXER_KDA, 2, 16);
    causality_case(DG_MIXER_KDA, 4, 32); /* GVA: 2 value heads per q/k head */
    causality_case(DG_MIXER_DPLR, 2, 16);
}

/* ---- (e) errors ----------------------------------------------------------------------------- */

static void test_errors(void) {
    dg_text t;
    dg_check_err(dg_text_load("/nonexistent/dir/text.txt", 0, 64, &t), DG_ERR_IO,
                 "'/nonexistent/dir/text.txt'", "missing --data file");
    dg_check_err(dg_text_load("/nonexistent/dir/text.txt", 0, 64, &t), DG_ERR_IO, "--data",
                 "the message names the flag");
    char path[512];
    tmp_path(path, sizeof path, "empty.txt");
    fclose(fopen(path, "w"));
    dg_check_err(dg_text_load(path, 0, 64, &t), DG_ERR_ARG, "is empty", "empty --data file");
    dg_train_opts ol = tiny_opts(NULL);
    ol.log_every = 0;
    dg_check_err(dg_train_run(&ol, NULL, NULL, NULL), DG_ERR_ARG, "--log-every must be in [1, ",
                 "--log-every 0");
    tmp_path(path, sizeof path, "tiny.txt");
    FILE *f = fopen(path, "w");
    fputs("In the beginning God created the heaven and the earth.\n", f);
    fclose(f);
    dg_check_err(dg_text_load(path, 0, 64, &t), DG_ERR_ARG, "holds only 55 bytes",
                 "tiny --data file");
    dg_check_err(dg_text_load(g_tmp, 0, 64, &t), DG_ERR_IO, "is a directory",
                 "a directory as --data");
    dg_check_ok(dg_text_load(path, 0, 3, &t), "a small file with a short --seq-len loads");
    dg_check(t.n == 55 && t.n_train == 50, "90/10 split of 55 bytes: %lld train",
             (long long)t.n_train);
    dg_text_free(&t);

    /* through the command: exit code 2 and the path on stderr */
    fflush(stdout);
    char *argv[] = {"train", "--data", "/nonexistent/dir/text.txt", "--no-out", NULL};
    int rc = dg_cmd_train(4, argv);
    dg_check(rc != 0, "deltagrad train --data <missing> fails (exit %d)", rc);
    char *argv2[] = {"train", "--steps", "abc", NULL};
    rc = dg_cmd_train(3, argv2);
    dg_check(rc == 2, "deltagrad train --steps abc exits 2 (got %d)", rc);
    char *argv3[] = {"train", "--bogus", "1", NULL};
    rc = dg_cmd_train(3, argv3);
    dg_check(rc == 2, "an unknown flag exits 2 (got %d)", rc);

    /* malformed checkpoints */
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_ckpt ck;
    tmp_path(path, sizeof path, "garbage.safetensors");
    f = fopen(path, "wb");
    fputs("this is not a checkpoint at all", f);
    fclose(f);
    dg_status s = dg_ckpt_load(ctx, path, &ck);
    dg_check(s != DG_OK && strstr(dg_last_error(), "garbage.safetensors"),
             "garbage checkpoint: error names the file (%s)", dg_last_error());
    /* a valid safetensors file that is not ours */
    tmp_path(path, sizeof path, "plain.safetensors");
    dg_tensor *x = NULL;
    DG_TEST_TRY(dg_tensor_zeros(ctx, DG_F32, 1, (int64_t[]){4}, &x));
    const char *nm = "x";
    DG_TEST_TRY(dg_safetensors_save(path, 1, &nm, (const dg_tensor *const *)&x, 0, NULL, NULL));
    dg_check_err(dg_ckpt_load(ctx, path, &ck), DG_ERR_FORMAT, "not a deltagrad checkpoint",
                 "safetensors without our metadata");
    dg_tensor_free(&x);
    /* a real checkpoint cut short */
    dg_model *m = NULL;
    dg_model_config c = tiny_config();
    DG_TEST_TRY(dg_model_new(ctx, &c, DG_F32, DG_F32, &m));
    DG_TEST_TRY(dg_model_init(m, 1));
    dg_train_opts o = tiny_opts(NULL);
    dg_train_state st = {3, 30, 1, 1};
    tmp_path(path, sizeof path, "cut.safetensors");
    DG_TEST_TRY(dg_ckpt_save(path, m, NULL, NULL, &o, &st));
    dg_check_ok(dg_ckpt_load(ctx, path, &ck), "weights-only checkpoint loads");
    dg_check(!ck.has_optim && ck.state.step == 3, "weights-only: no optimizer state, step 3");
    dg_model *m2 = NULL;
    DG_TEST_TRY(dg_model_new(ctx, &ck.cfg, DG_F32, DG_F32, &m2));
    dg_check_ok(dg_ckpt_restore_model(&ck, m2), "restore the weights into a fresh model");
    double *w1, *w2;
    DG_TEST_TRY(dg_tensor_to_f64(m->params[3].t, &w1));
    DG_TEST_TRY(dg_tensor_to_f64(m2->params[3].t, &w2));
    dg_check(memcmp(w1, w2, (size_t)dg_tensor_numel(m->params[3].t) * sizeof(double)) == 0,
             "restored weights equal the saved ones");
    free(w1), free(w2);
    dg_tensor **mv = calloc((size_t)m2->n_params, sizeof *mv);
    dg_check_err(dg_ckpt_restore_optim(&ck, m2, mv, mv), DG_ERR_FORMAT, "weights only",
                 "resuming from a weights-only checkpoint");
    free(mv);
    dg_ckpt_free(&ck);
    dg_model_free(&m2);
    struct stat sb;
    stat(path, &sb);
    if (truncate(path, sb.st_size / 2) != 0)
        perror("truncate");
    s = dg_ckpt_load(ctx, path, &ck);
    dg_check(s == DG_ERR_FORMAT && strstr(dg_last_error(), "cut.safetensors"),
             "truncated checkpoint: DG_ERR_FORMAT naming the file (%s)", dg_last_error());
    dg_model_free(&m);
    dg_ctx_free(&ctx);
}

/* ---- (f) --graph where it cannot apply ----------------------------------------------------- */

static void test_graph_flag(void) {
    dg_train_opts o = tiny_opts(NULL);
    o.steps = 2;
    o.graph = DG_TRAIN_GRAPH_ON;
    dg_check_err(dg_train_run(&o, NULL, NULL, NULL), DG_ERR_ARG,
                 "--graph on: CUDA graphs need a CUDA device", "--graph on with a CPU device");
    o.graph = DG_TRAIN_GRAPH_AUTO;
    dg_train_result r;
    if (dg_check_ok(dg_train_run(&o, NULL, NULL, &r), "--graph left to its default on the CPU")) {
        dg_check(r.graph_steps == 0 && r.last_step == 2,
                 "the CPU runs every step eagerly (%lld of 2 steps from a graph)",
                 (long long)r.graph_steps);
        dg_train_result_free(&r);
    }
    fflush(stdout);
    char *a1[] = {"train", "--device", "cpu", "--graph", "on", NULL};
    int rc = dg_cmd_train_check(5, a1);
    dg_check(rc == 2, "deltagrad train --device cpu --graph on exits 2 (got %d)", rc);
    char *a2[] = {"train", "--device", "cpu", "--graph", "maybe", NULL};
    rc = dg_cmd_train_check(5, a2);
    dg_check(rc == 2, "deltagrad train --graph maybe exits 2 (got %d)", rc);
    char *a3[] = {"train", "--device", "cpu", "--graph", "off", NULL};
    rc = dg_cmd_train_check(5, a3);
    dg_check(rc == 0, "deltagrad train --device cpu --graph off is accepted (got %d)", rc);
}

/* ---- configs -------------------------------------------------------------------------------- */

static void test_config(void) {
    dg_model_config c, back;
    DG_TEST_TRY(dg_model_config_preset("bench", &c));
    dg_check(dg_model_config_num_params(&c) == 28132896,
             "bench config (training.md M3) has 28,132,896 parameters (%lld)",
             (long long)dg_model_config_num_params(&c));
    char json[2048];
    c.gate = DG_GATE_KDA;
    c.tie = 1;
    c.lower_bound = -3.25;
    c.mixer = DG_MIXER_DPLR;
    DG_TEST_TRY(dg_model_config_to_json(&c, json, sizeof json));
    dg_check_ok(dg_model_config_from_json(json, &back), "config JSON parses back");
    /* field by field: the struct has padding bytes that memcmp would read */
    dg_check(c.vocab == back.vocab && c.d == back.d && c.n_layers == back.n_layers &&
                 c.n_heads == back.n_heads && c.n_v_heads == back.n_v_heads &&
                 c.head_k == back.head_k && c.head_v == back.head_v && c.inter == back.inter &&
                 c.conv == back.conv && c.chunk == back.chunk && c.gate == back.gate &&
                 c.lower_bound == back.lower_bound && c.norm_eps == back.norm_eps &&
                 c.tie == back.tie && c.init_std == back.init_std && c.mixer == back.mixer,
             "config JSON round trip is exact");
    /* the mixer: written as a string, a config without it is KDA, an unknown one is refused */
    char *mx = strstr(json, ", \"mixer\": \"dplr\"}");
    dg_check(mx != NULL, "the JSON records \"mixer\": \"dplr\"");
    if (mx) {
        snprintf(mx, sizeof json - (size_t)(mx - json), ", \"mixer\": \"rwkv\"}");
        dg_check_err(dg_model_config_from_json(json, &back), DG_ERR_FORMAT, "\"mixer\"",
                     "an unknown mixer in the JSON");
        snprintf(mx, sizeof json - (size_t)(mx - json), "}");
        dg_check(dg_model_config_from_json(json, &back) == DG_OK && back.mixer == DG_MIXER_KDA,
                 "a config JSON without \"mixer\" is KDA");
    }
    dg_check_err(dg_model_config_from_json("{\"vocab_size\": 256}", &back), DG_ERR_FORMAT,
                 "hidden_size", "a config missing a key");
    DG_TEST_TRY(dg_model_config_preset("cpu", &c));
    c.n_v_heads = 3;
    dg_check_err(dg_model_config_check(&c), DG_ERR_ARG, "num_v_heads", "HV not a multiple of H");
    c.n_v_heads = 4;
    c.mixer = DG_MIXER_DPLR;
    dg_check_err(dg_model_config_check(&c), DG_ERR_ARG, "one value head per key head",
                 "the DPLR mixer with GVA (HV = 4, H = 2)");
    c.mixer = (dg_mixer_kind)7;
    dg_check_err(dg_model_config_check(&c), DG_ERR_ARG, "mixer must be kda or dplr",
                 "a mixer outside the enum");

    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    DG_TEST_TRY(dg_model_config_preset("cpu", &c));
    for (int tie = 0; tie < 2; tie++) {
        c.tie = tie;
        dg_model *m = NULL;
        DG_TEST_TRY(dg_model_new(ctx, &c, DG_F32, DG_F32, &m));
        dg_check(dg_model_num_params(m) == dg_model_config_num_params(&c),
                 "toy model (tie=%d): %lld parameters, formula %lld", tie,
                 (long long)dg_model_num_params(m), (long long)dg_model_config_num_params(&c));
        dg_check(dg_model_find(m, "model.layers.1.attn.q_conv1d.weight") &&
                     dg_tensor_ndim(dg_model_find(m, "model.layers.1.attn.q_conv1d.weight")->t) ==
                         3,
                 "conv weights use PyTorch's [C,1,W] layout");
        dg_check(!dg_model_find(m, "model.layers.0.attn.A_log")->decay &&
                     !dg_model_find(m, "model.layers.0.attn.g_proj.1.bias")->decay &&
                     !dg_model_find(m, "model.norm.weight")->decay &&
                     dg_model_find(m, "model.layers.0.mlp.up_proj.weight")->decay,
                 "weight decay on matrices only");
        dg_check((dg_model_find(m, "lm_head.weight") != NULL) == !tie,
                 "lm_head present iff untied");
        dg_model_free(&m);
    }
    dg_ctx_free(&ctx);
    dg_train_opts o;
    DG_TEST_TRY(dg_train_opts_default("cpu", &o));
    dg_check(fabs(dg_train_lr(&o, o.warmup) - o.lr) < 1e-15 &&
                 fabs(dg_train_lr(&o, o.steps) - o.lr * o.min_lr_frac) < 1e-12 &&
                 dg_train_lr(&o, 1) < o.lr / 10,
             "schedule: warmup to lr, cosine down to 10%%");
}

/* ---- (g) the DPLR mixer --------------------------------------------------------------------- */

/* A small model in f64 with the given mixer and gate: d 16, H = HV = 2, K = V = 8, chunk 16. The
 * matrices get std 0.2 instead of 0.02 so every path (convs, gate, alpha, state) carries signal
 * into the logits. */
static dg_model *f64_model(dg_ctx *ctx, dg_mixer_kind mixer, dg_gate_kind gate, int layers,
                           uint64_t seed) {
    dg_model_config c = tiny_config();
    c.d = 16, c.n_layers = layers, c.n_heads = c.n_v_heads = 2, c.head_k = c.head_v = 8;
    c.inter = 16, c.chunk = 16, c.gate = gate, c.mixer = mixer;
    dg_model *m = NULL;
    DG_TEST_TRY(dg_model_new(ctx, &c, DG_F64, DG_F64, &m));
    DG_TEST_TRY(dg_model_init(m, seed));
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].decay)
            DG_TEST_TRY(dg_tensor_rand_normal(m->params[i].t, seed * 100 + (uint64_t)i, 0.0, 0.2));
    return m;
}

static dg_tensor *rand_ids(dg_ctx *ctx, int B, int T, uint64_t seed) {
    int32_t *v = malloc((size_t)B * T * sizeof *v);
    for (int i = 0; i < B * T; i++)
        v[i] = (int32_t)(dg_rand_u01(seed, (uint64_t)i) * 256);
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_host(ctx, DG_I32, 2, (int64_t[]){B, T}, v, &t));
    free(v);
    return t;
}

typedef struct model_arg {
    dg_model *m;
    dg_tensor *ids;
} model_arg;

/* gradcheck's function: the model's logits. The inputs are some of the model's own parameters,
 * which gradcheck perturbs in place; the forward reads them from the model. */
static dg_status logits_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                           void *user) {
    (void)ctx, (void)in, (void)n_in, (void)n_out;
    model_arg *a = user;
    return dg_model_forward(a->m, a->ids, &out[0]);
}

static void gradcheck_params(dg_ctx *ctx, model_arg *arg, const int *ix, int n, const char *what) {
    dg_tensor *in[DG_GRADCHECK_MAX_INPUTS];
    for (int i = 0; i < n; i++)
        in[i] = arg->m->params[ix[i]].t;
    dg_gradcheck_report rep;
    dg_status st = dg_gradcheck(ctx, logits_fn, arg, in, n, 1, 1e-6, 5, &rep);
    if (!dg_check_ok(st, what))
        return;
    int worst = 0;
    for (int i = 1; i < n; i++)
        if (rep.rel_err[i] > rep.rel_err[worst])
            worst = i;
    if (rep.max_rel_err >= 1e-6)
        for (int i = 0; i < n; i++)
            printf("     %-40s rel err %.3e\n", arg->m->params[ix[i]].name, rep.rel_err[i]);
    dg_check(rep.max_rel_err < 1e-6, "%s: max rel err %.3e (worst %s; tol 1e-6)", what,
             rep.max_rel_err, arg->m->params[ix[worst]].name);
}

/* f64 finite differences of the logits w.r.t. every parameter of the DPLR layer (and the block
 * around it): 2 rows of 24 tokens, two chunks of 16, the second partial. */
static void dplr_gradcheck_case(dg_gate_kind gate) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model *m = f64_model(ctx, DG_MIXER_DPLR, gate, 1, gate == DG_GATE_KDA ? 31 : 17);
    model_arg arg = {m, rand_ids(ctx, 2, 24, 3)};
    const dg_layer_ix *L = &m->layers[0];
    const int mix[16] = {L->q_proj,  L->k_proj,  L->v_proj, L->q_conv, L->k_conv,  L->v_conv,
                         L->f_proj0, L->f_proj1, L->b_proj, L->A_log,  L->dt_bias, L->g_proj0,
                         L->g_proj1, L->g_bias,  L->o_norm, L->o_proj};
    const int rest[6] = {L->attn_norm, L->mlp_norm,  L->gate_proj,
                         L->up_proj,   L->down_proj, m->final_norm};
    const char *gn = gate == DG_GATE_KDA ? "KDA gate" : "lower-bound gate";
    char what[160];
    snprintf(what, sizeof what, "gradcheck DPLR model (%s): the 16 mixer parameters", gn);
    gradcheck_params(ctx, &arg, mix, 16, what);
    if (gate == DG_GATE_LOWERBOUND) {
        snprintf(what, sizeof what, "gradcheck DPLR model (%s): norms and MLP", gn);
        gradcheck_params(ctx, &arg, rest, 6, what);
    }
    dg_tensor_free(&arg.ids);
    dg_model_free(&m);
    dg_tape_reset();
    dg_ctx_free(&ctx);
}

/* Logits and the gradients of every parameter (concatenated, f64) for loss = <logits, R>. */
static double *logits_and_grads(dg_model *m, dg_tensor *ids, uint64_t seed, double **grads,
                                int64_t *n_logits, int64_t *n_grads) {
    dg_tensor *lg = NULL, *R = NULL;
    DG_TEST_TRY(dg_model_forward(m, ids, &lg));
    R = dg_test_rand(m->ctx, DG_F64, dg_tensor_ndim(lg), dg_tensor_shape(lg), seed, -1, 1);
    for (int i = 0; i < m->n_params; i++)
        dg_tensor_zero_grad(m->params[i].t);
    DG_TEST_TRY(dg_tape_backward_with(m->ctx, lg, R));
    *n_grads = dg_model_num_params(m);
    double *g = calloc((size_t)*n_grads, sizeof *g), *lv = NULL;
    int64_t at = 0;
    for (int i = 0; i < m->n_params; i++) {
        const dg_tensor *gt = dg_tensor_grad(m->params[i].t);
        int64_t n = dg_tensor_numel(m->params[i].t);
        if (gt) {
            double *v = NULL;
            DG_TEST_TRY(dg_tensor_to_f64(gt, &v));
            memcpy(g + at, v, (size_t)n * sizeof *v);
            free(v);
        }
        at += n;
    }
    DG_TEST_TRY(dg_tensor_to_f64(lg, &lv));
    *n_logits = dg_tensor_numel(lg);
    *grads = g;
    dg_tensor_free(&R);
    dg_tensor_free(&lg);
    dg_tape_reset();
    return lv;
}

/* The chunked DPLR op against its token-by-token recurrence inside the model, f64: the logits
 * and the gradients of all parameters. 2 layers, 2 rows of 50 tokens: chunks of 16, the last
 * partial. The op's own test measures the two forms ~3e-15 apart (tolerance 1e-10); the model
 * adds norms and projections around it, not new reorderings of the recurrence. */
static void test_dplr_chunk_vs_recurrent(void) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model *m = f64_model(ctx, DG_MIXER_DPLR, DG_GATE_LOWERBOUND, 2, 23);
    dg_tensor *ids = rand_ids(ctx, 2, 50, 4);
    int64_t nl = 0, ng = 0;
    double *gc = NULL, *gr = NULL;
    double *lc = logits_and_grads(m, ids, 9, &gc, &nl, &ng);
    m->recurrent_mixer = 1;
    double *lr = logits_and_grads(m, ids, 9, &gr, &nl, &ng);
    m->recurrent_mixer = 0;
    dg_check_rel("DPLR model f64: chunked vs recurrent logits", lc, lr, nl, 1e-10);
    dg_check_rel("DPLR model f64: chunked vs recurrent parameter gradients", gc, gr, ng, 1e-10);
    double gmax = 0.0;
    for (int64_t i = 0; i < ng; i++)
        gmax = fmax(gmax, fabs(gc[i]));
    dg_check(gmax > 1e-3, "  ...the gradients are not trivially zero (max %.3e)", gmax);
    free(lc), free(lr), free(gc), free(gr);
    dg_tensor_free(&ids);
    dg_model_free(&m);
    dg_ctx_free(&ctx);
}

/* The header event's text. */
static void keep_header(const dg_train_event *ev, void *user) {
    if (ev->kind == DG_EV_HEADER && ev->text)
        snprintf((char *)user, 4096, "%s", ev->text);
}

/* Training: the loss falls as it does with KDA; a run interrupted and resumed (the mixer coming
 * from the checkpoint) repeats the uninterrupted one bit for bit. */
static void test_dplr_train(void) {
    dg_train_opts o = tiny_opts(NULL);
    o.model.mixer = DG_MIXER_DPLR;
    dg_train_result r;
    char head[4096] = "";
    if (!dg_check_ok(dg_train_run(&o, keep_header, head, &r), "DPLR: train 40 tiny steps"))
        return;
    double first = mean_range(r.losses, 0, 3), last = mean_range(r.losses, o.steps - 5, o.steps);
    printf("  DPLR loss: first 3 steps %.4f, last 5 steps %.4f, val %.4f, %lld parameters\n", first,
           last, r.final_val, (long long)r.n_params);
    dg_check(strstr(head, "dplr mixer") != NULL, "the header names the DPLR mixer");
    dg_check(r.n_params == dg_model_config_num_params(&o.model),
             "DPLR model: %lld parameters, as the formula (the KDA layer's list)",
             (long long)r.n_params);
    dg_check(first > 5.0 && first < 6.0, "DPLR: initial loss %.4f is near ln 256 = 5.545", first);
    dg_check(last < first - 1.5, "DPLR: loss falls by > 1.5 nats in 40 steps (%.4f -> %.4f)", first,
             last);
    dg_check(r.final_val < 3.8, "DPLR: validation loss %.4f < 3.8 after 40 steps", r.final_val);
    dg_train_result_free(&r);

    char a[512], b[512];
    tmp_path(a, sizeof a, "dplr_straight");
    tmp_path(b, sizeof b, "dplr_resumed");
    const int64_t N = 6;
    dg_train_result straight, half, rest;
    o = tiny_opts(a);
    o.model.mixer = DG_MIXER_DPLR;
    o.steps = N;
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &straight), "DPLR: straight run"))
        return;
    o = tiny_opts(b);
    o.model.mixer = DG_MIXER_DPLR;
    o.steps = N;
    o.stop_at = N / 2;
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &half), "DPLR: first half")) {
        dg_train_result_free(&straight);
        return;
    }
    dg_train_opts o2 = tiny_opts(b);
    o2.resume = 1;
    o2.model.mixer = DG_MIXER_KDA; /* ignored: the model comes from the checkpoint */
    head[0] = 0;
    if (dg_check_ok(dg_train_run(&o2, keep_header, head, &rest), "DPLR: resumed second half")) {
        int same = 1;
        for (int64_t s = 0; s < N; s++) {
            double want = straight.losses[s], got = s < N / 2 ? half.losses[s] : rest.losses[s];
            same &= memcmp(&want, &got, sizeof want) == 0;
        }
        dg_check(same && strstr(head, "dplr mixer"),
                 "DPLR: straight == stop + resume, the %lld losses bit for bit (the resumed run "
                 "is a DPLR model)",
                 (long long)N);
        dg_train_result_free(&rest);
    }
    dg_train_result_free(&straight);
    dg_train_result_free(&half);
}

/* The checkpoint's config without its "mixer" key, as written before the key existed. */
static void strip_mixer(const char *path, const char *out) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_safetensors st;
    DG_TEST_TRY(dg_safetensors_load(ctx, path, &st));
    char cfg[4096];
    for (int i = 0; i < st.n_meta; i++) {
        if (strcmp(st.meta_keys[i], "config") != 0)
            continue;
        snprintf(cfg, sizeof cfg, "%s", st.meta_values[i]);
        char *p = strstr(cfg, ", \"mixer\": ");
        if (p)
            snprintf(p, sizeof cfg - (size_t)(p - cfg), "}");
        free(st.meta_values[i]);
        st.meta_values[i] = strdup(cfg);
    }
    DG_TEST_TRY(dg_safetensors_save(
        out, st.n, (const char *const *)st.names, (const dg_tensor *const *)st.tensors, st.n_meta,
        (const char *const *)st.meta_keys, (const char *const *)st.meta_values));
    dg_safetensors_free(&st);
    dg_ctx_free(&ctx);
}

/* path with its metadata entry `key` set to val (NULL: removed), written to out. */
static void set_meta(const char *path, const char *out, const char *key, const char *val) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_safetensors st;
    DG_TEST_TRY(dg_safetensors_load(ctx, path, &st));
    int w = 0;
    for (int i = 0; i < st.n_meta; i++) {
        if (!strcmp(st.meta_keys[i], key)) {
            if (!val) {
                free(st.meta_keys[i]);
                free(st.meta_values[i]);
                continue;
            }
            free(st.meta_values[i]);
            st.meta_values[i] = strdup(val);
        }
        st.meta_keys[w] = st.meta_keys[i];
        st.meta_values[w++] = st.meta_values[i];
    }
    st.n_meta = w;
    DG_TEST_TRY(dg_safetensors_save(
        out, st.n, (const char *const *)st.names, (const dg_tensor *const *)st.tensors, st.n_meta,
        (const char *const *)st.meta_keys, (const char *const *)st.meta_values));
    dg_safetensors_free(&st);
    dg_ctx_free(&ctx);
}

static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

/* Format 2 stores the reference's config.json beside the native config and the data path
 * relative to the checkpoint; format-1 checkpoints (absolute or command-line data paths, no
 * config.json) still load; other formats are refused naming both. */
static void test_ckpt_format(void) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model_config c = tiny_config();
    dg_model *m = NULL;
    DG_TEST_TRY(dg_model_new(ctx, &c, DG_F32, DG_F32, &m));
    DG_TEST_TRY(dg_model_init(m, 3));
    dg_train_opts o = tiny_opts(NULL); /* data_path: the bundled text, an absolute path */
    dg_train_state st = {2, 20, 1, 1};
    char path[512], old[512], bad[512];
    tmp_path(path, sizeof path, "fmt2.safetensors");
    tmp_path(old, sizeof old, "fmt1.safetensors");
    tmp_path(bad, sizeof bad, "fmt9.safetensors");
    DG_TEST_TRY(dg_ckpt_save(path, m, NULL, NULL, &o, &st));
    dg_ckpt ck;
    if (dg_check_ok(dg_ckpt_load(ctx, path, &ck), "format-2 checkpoint loads")) {
        const char *fmt = dg_safetensors_meta(&ck.st, "format");
        const char *cj = dg_safetensors_meta(&ck.st, "config.json");
        const char *dp = dg_safetensors_meta(&ck.st, "data.path");
        dg_check(ck.format == 2 && fmt && !strcmp(fmt, "deltagrad-checkpoint/2"),
                 "the format is deltagrad-checkpoint/2");
        dg_check(cj && strstr(cj, "\"model_type\": \"kda\"") && strstr(cj, "\"safe_gate\": true") &&
                     strstr(cj, "\"lower_bound\": -5") && strstr(cj, "\"expand_v\": 1") &&
                     strstr(cj, "\"head_dim\": 32") && strstr(cj, "\"num_hidden_layers\": 1") &&
                     strstr(cj, "\"conv_size\": 4"),
                 "config.json carries the reference's keys: %.300s", cj ? cj : "(missing)");
        dg_check(dp && dp[0] && dp[0] != '/', "data.path '%s' is not absolute", dp ? dp : "");
        dg_check(same_file(ck.opts.data_path, KJV),
                 "the stored relative data path resolves to the text (%s)", ck.opts.data_path);
        dg_ckpt_free(&ck);
    }
    set_meta(path, old, "config.json", NULL);
    set_meta(old, old, "format", "deltagrad-checkpoint/1");
    set_meta(old, old, "data.path", KJV);
    if (dg_check_ok(dg_ckpt_load(ctx, old, &ck), "a format-1 checkpoint still loads")) {
        dg_check(ck.format == 1 && !strcmp(ck.opts.data_path, KJV) && ck.cfg.d == c.d,
                 "format 1: its data path as stored, its config");
        dg_model *m1 = NULL;
        DG_TEST_TRY(dg_model_new(ctx, &ck.cfg, DG_F32, DG_F32, &m1));
        dg_check_ok(dg_ckpt_restore_model(&ck, m1), "format 1: the model restores");
        dg_model_free(&m1);
        dg_ckpt_free(&ck);
    }
    set_meta(path, bad, "format", "deltagrad-checkpoint/9");
    dg_check_err(dg_ckpt_load(ctx, bad, &ck), DG_ERR_FORMAT, "deltagrad-checkpoint/9",
                 "an unknown format is refused");
    dg_ckpt_free(&ck);
    dg_model_free(&m);
    dg_ctx_free(&ctx);
}

/* Checkpoints record the mixer: a DPLR checkpoint restores a DPLR model (the same logits bit for
 * bit) and is refused by a KDA model; a checkpoint without the key is KDA. */
static void test_dplr_ckpt(void) {
    dg_ctx *ctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &ctx));
    dg_model_config c = tiny_config();
    c.mixer = DG_MIXER_DPLR;
    dg_model *m = NULL, *m2 = NULL, *mk = NULL;
    DG_TEST_TRY(dg_model_new(ctx, &c, DG_F32, DG_F32, &m));
    DG_TEST_TRY(dg_model_init(m, 4));
    dg_train_opts o = tiny_opts(NULL);
    o.model = c;
    dg_train_state st = {5, 50, 1, 1};
    char path[512], old[512];
    tmp_path(path, sizeof path, "dplr.safetensors");
    DG_TEST_TRY(dg_ckpt_save(path, m, NULL, NULL, &o, &st));
    dg_ckpt ck;
    if (!dg_check_ok(dg_ckpt_load(ctx, path, &ck), "DPLR checkpoint loads"))
        return;
    dg_check(ck.cfg.mixer == DG_MIXER_DPLR, "the checkpoint's config says dplr");
    DG_TEST_TRY(dg_model_new(ctx, &ck.cfg, DG_F32, DG_F32, &m2));
    dg_check_ok(dg_ckpt_restore_model(&ck, m2), "DPLR checkpoint restores a DPLR model");
    int32_t ids[2 * 40];
    for (int i = 0; i < 80; i++)
        ids[i] = (int32_t)(dg_rand_u01(12, (uint64_t)i) * 256);
    float *l1 = logits_of(m, ids, 2, 40), *l2 = logits_of(m2, ids, 2, 40);
    dg_check(memcmp(l1, l2, sizeof(float) * 80 * 256) == 0,
             "restored DPLR model: the same logits bit for bit");
    free(l1), free(l2);
    dg_model_config ckda = c;
    ckda.mixer = DG_MIXER_KDA;
    DG_TEST_TRY(dg_model_new(ctx, &ckda, DG_F32, DG_F32, &mk));
    dg_check_err(dg_ckpt_restore_model(&ck, mk), DG_ERR_FORMAT,
                 "holds a model with the dplr mixer, but this model uses the kda mixer",
                 "a DPLR checkpoint into a KDA model");
    dg_ckpt_free(&ck);

    /* a KDA checkpoint written before "mixer" existed loads as KDA */
    tmp_path(path, sizeof path, "kda.safetensors");
    tmp_path(old, sizeof old, "kda_old.safetensors");
    DG_TEST_TRY(dg_ckpt_save(path, mk, NULL, NULL, &o, &st));
    strip_mixer(path, old);
    if (dg_check_ok(dg_ckpt_load(ctx, old, &ck), "a checkpoint without \"mixer\" loads")) {
        const char *cfg = dg_safetensors_meta(&ck.st, "config");
        dg_check(cfg && !strstr(cfg, "mixer") && ck.cfg.mixer == DG_MIXER_KDA,
                 "a config without \"mixer\" is a KDA model");
        dg_check_ok(dg_ckpt_restore_model(&ck, mk), "  ...and restores a KDA model");
        dg_check_err(dg_ckpt_restore_model(&ck, m2), DG_ERR_FORMAT,
                     "holds a model with the kda mixer, but this model uses the dplr mixer",
                     "  ...and is refused by a DPLR model");
        dg_ckpt_free(&ck);
    }
    dg_model_free(&mk);
    dg_model_free(&m2);
    dg_model_free(&m);
    dg_tape_reset();
    dg_ctx_free(&ctx);
}

/* dg_cmd_train's stdout while it runs argv, into buf (NUL-terminated). */
static int run_captured(int argc, char **argv, char *buf, size_t n) {
    char path[512];
    tmp_path(path, sizeof path, "stdout.txt");
    fflush(stdout);
    int saved = dup(STDOUT_FILENO);
    FILE *f = fopen(path, "w");
    dup2(fileno(f), STDOUT_FILENO);
    int rc = dg_cmd_train(argc, argv);
    fflush(stdout);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    fclose(f);
    f = fopen(path, "r");
    size_t got = f ? fread(buf, 1, n - 1, f) : 0;
    buf[got] = 0;
    if (f)
        fclose(f);
    return rc;
}

/* `deltagrad train --mixer dplr` end to end on the CPU, and its flag errors. */
static void test_dplr_cli(void) {
    char *run[] = {"train",  "--device",       "cpu", "--mixer",
                   "dplr",   "--steps",        "3",   "--d",
                   "32",     "--layers",       "1",   "--heads",
                   "2",      "--head-dim",     "16",  "--inter",
                   "64",     "--chunk-size",   "32",  "--batch",
                   "2",      "--seq-len",      "64",  "--max-bytes",
                   "200000", "--eval-batches", "1",   "--sample-tokens",
                   "16",     "--no-out",       NULL};
    int argc = (int)(sizeof run / sizeof *run) - 1;
    static char out[1 << 16];
    int rc = run_captured(argc, run, out, sizeof out);
    dg_check(rc == 0, "deltagrad train --mixer dplr: 3 steps on the CPU (exit %d)", rc);
    dg_check(strstr(out, "dplr mixer") && strstr(out, " parameters (") &&
                 strstr(out, "step 1/3 loss") && strstr(out, "step 3/3 loss") &&
                 strstr(out, "--- sample at step 3 ---") && strstr(out, "done: step 3"),
             "  ...prints the header (mixer, parameter count), every step, a sample and the "
             "summary");
    if (rc != 0 || !strstr(out, "done: step 3"))
        printf("%s\n", out);
    char *bad_mixer[] = {"train", "--device", "cpu", "--mixer", "rwkv", NULL};
    rc = dg_cmd_train_check(5, bad_mixer);
    dg_check(rc == 2, "--mixer rwkv exits 2 (got %d)", rc);
    char *gva[] = {"train",   "--device", "cpu",         "--mixer", "dplr",     "--v-heads", "4",
                   "--steps", "1",        "--max-bytes", "200000",  "--no-out", NULL};
    rc = dg_cmd_train(12, gva);
    dg_check(rc == 2, "--mixer dplr --v-heads 4 (GVA) exits 2 (got %d)", rc);
    char dir[512];
    tmp_path(dir, sizeof dir, "dplr_cli");
    char *res[] = {"train", "--device", "cpu", "--resume", "--mixer", "dplr", "--out", dir, NULL};
    rc = dg_cmd_train_check(8, res);
    dg_check(rc == 2, "--mixer with --resume exits 2 (the checkpoint holds the mixer; got %d)", rc);
    dg_train_opts o = tiny_opts(NULL);
    o.model.mixer = DG_MIXER_DPLR;
    o.cp = 2;
    /* the DPLR mixer has a context-parallel form: --cp is refused only for want of processes */
    dg_check_err(dg_train_run(&o, NULL, NULL, NULL), DG_ERR_ARG, "needs 2 processes",
                 "--mixer dplr with --cp 2 in one process");
}

static void test_dplr(void) {
    dplr_gradcheck_case(DG_GATE_LOWERBOUND);
    dplr_gradcheck_case(DG_GATE_KDA);
    test_dplr_chunk_vs_recurrent();
    test_dplr_train();
    test_dplr_ckpt();
    test_dplr_cli();
}

/* gpu: a DPLR model's first training steps on CUDA (f32) follow the CPU's losses. */
static void test_dplr_gpu(void) {
    dg_train_opts o = tiny_opts(NULL);
    o.model.mixer = DG_MIXER_DPLR;
    o.model.chunk = 16;
    o.steps = 3;
    dg_train_result rc, rg;
    DG_TEST_TRY(dg_train_run(&o, NULL, NULL, &rc));
    o.device = dg_cuda(0);
    o.compute_dtype = DG_F32;
    if (dg_check_ok(dg_train_run(&o, NULL, NULL, &rg),
                    "DPLR model: 3 training steps on CUDA (f32)")) {
        dg_check_rel("DPLR: cuda f32 training losses vs cpu (3 steps)", rg.losses, rc.losses, 3,
                     1e-4);
        dg_train_result_free(&rg);
    }
    dg_train_result_free(&rc);
}

/* ---- gpu: CUDA vs CPU ------------------------------------------------------------------------ */

static void test_gpu(void) {
    dg_ctx *cpu = NULL, *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    dg_model_config c = tiny_config();
    c.chunk = 16;
    const int B = 2, T = 50; /* 4 chunks, the last partial */
    int32_t ids[100];
    for (int i = 0; i < B * T; i++)
        ids[i] = (int32_t)(dg_rand_u01(11, (uint64_t)i) * 256);
    dg_model *mc = NULL, *mg = NULL, *mb = NULL;
    DG_TEST_TRY(dg_model_new(cpu, &c, DG_F32, DG_F32, &mc));
    DG_TEST_TRY(dg_model_new(gpu, &c, DG_F32, DG_F32, &mg));
    DG_TEST_TRY(dg_model_new(gpu, &c, DG_F32, DG_BF16, &mb));
    DG_TEST_TRY(dg_model_init(mc, 9));
    DG_TEST_TRY(dg_model_init(mg, 9));
    DG_TEST_TRY(dg_model_init(mb, 9));
    float *lc = logits_of(mc, ids, B, T), *lg = logits_of(mg, ids, B, T);
    double *dc = malloc(sizeof(double) * B * T * 256), *dgv = malloc(sizeof(double) * B * T * 256);
    for (int i = 0; i < B * T * 256; i++)
        dc[i] = lc[i], dgv[i] = lg[i];
    dg_check_rel("cuda f32 logits vs cpu", dgv, dc, B * T * 256, 1e-4);
    /* bf16 compute: logits within bf16 rounding of a few layers */
    dg_tensor *tid = NULL, *lb = NULL;
    DG_TEST_TRY(dg_tensor_from_host(gpu, DG_I32, 2, (int64_t[]){B, T}, ids, &tid));
    dg_no_grad_begin();
    dg_status s = dg_model_forward(mb, tid, &lb);
    dg_no_grad_end();
    if (dg_check_ok(s, "bf16 forward on CUDA")) {
        double *bv;
        DG_TEST_TRY(dg_tensor_to_f64(lb, &bv));
        dg_check_rel("cuda bf16 logits vs cpu f32", bv, dc, B * T * 256, 5e-2);
        free(bv);
    }
    dg_tensor_free(&lb);
    dg_tensor_free(&tid);
    free(lc), free(lg), free(dc), free(dgv);
    dg_model_free(&mc);
    dg_model_free(&mg);
    dg_model_free(&mb);

    /* a few training steps on both devices follow the same losses */
    dg_train_opts o = tiny_opts(NULL);
    o.steps = 5;
    o.model.chunk = 16;
    dg_train_result rc, rg;
    DG_TEST_TRY(dg_train_run(&o, NULL, NULL, &rc));
    o.device = dg_cuda(0);
    DG_TEST_TRY(dg_train_run(&o, NULL, NULL, &rg));
    dg_check_rel("cuda f32 training losses vs cpu (5 steps)", rg.losses, rc.losses, 5, 1e-4);
    o.compute_dtype = DG_BF16;
    dg_train_result rb;
    if (dg_check_ok(dg_train_run(&o, NULL, NULL, &rb), "bf16 training on CUDA")) {
        dg_check_rel("cuda bf16 training losses vs cpu f32 (5 steps)", rb.losses, rc.losses, 5,
                     3e-2);
        dg_train_result_free(&rb);
    }
    dg_train_result_free(&rc);
    dg_train_result_free(&rg);
    dg_tape_reset();
    dg_ctx_free(&gpu);
    dg_ctx_free(&cpu);
}

/* ---- gpu: the captured step == the eager step ----------------------------------------------- */

/* What a run reported about its CUDA graph. */
typedef struct graph_seen {
    int captured, warns;
    char warn[1024];
} graph_seen;

static void watch_graph(const dg_train_event *ev, void *user) {
    graph_seen *g = user;
    if (ev->kind == DG_EV_INFO && ev->text && strstr(ev->text, "CUDA graph: step"))
        g->captured++;
    if (ev->kind == DG_EV_WARN) {
        if (!g->warns)
            snprintf(g->warn, sizeof g->warn, "%s", ev->text ? ev->text : "");
        g->warns++;
    }
}

/* Every tensor of checkpoint a (weights and AdamW moments) equals the tensor of that name in
 * checkpoint b bit for bit, and b has no others; *n: how many were compared. */
static int same_ckpt_tensors(const char *a, const char *b, int *n) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    dg_safetensors sa, sb;
    memset(&sa, 0, sizeof sa);
    memset(&sb, 0, sizeof sb);
    DG_TEST_TRY(dg_safetensors_load(cpu, a, &sa));
    DG_TEST_TRY(dg_safetensors_load(cpu, b, &sb));
    int same = sa.n == sb.n && sa.n > 0;
    *n = 0;
    for (int i = 0; same && i < sa.n; i++) {
        const dg_tensor *ta = sa.tensors[i], *tb = dg_safetensors_get(&sb, sa.names[i]);
        size_t nb = dg_tensor_nbytes(ta);
        same = tb && dg_tensor_dtype(ta) == dg_tensor_dtype(tb) && dg_tensor_nbytes(tb) == nb &&
               memcmp(dg_tensor_data(ta), dg_tensor_data(tb), nb) == 0;
        if (!same)
            printf("  %s differs\n", sa.names[i]);
        (*n)++;
    }
    dg_safetensors_free(&sa);
    dg_safetensors_free(&sb);
    dg_ctx_free(&cpu);
    return same;
}

/* The same run with the step captured and replayed, and eagerly. Bit for bit, not within a
 * tolerance: a replay launches the kernels of the captured step with the same arguments on the
 * same addresses, the kernels reduce in fixed orders (no float atomics), and cuBLAS works in
 * the context's one fixed workspace, so it picks the same algorithm for a captured GEMM as for
 * the eager one. The first step of both runs is eager; steps 2-9 are the capture and its
 * replays against eager steps, with evaluations, samples and checkpoints (host reads of the
 * weights) between launches. */
static void graph_case(dg_dtype compute, dg_train_graph mode) {
    const char *dn = dg_dtype_name(compute), *mn = mode == DG_TRAIN_GRAPH_ON ? "on" : "default";
    char don[512], doff[512], name[64];
    snprintf(name, sizeof name, "graph_%s_%s", mn, dn);
    tmp_path(don, sizeof don, name);
    snprintf(name, sizeof name, "eager_%s_%s", mn, dn);
    tmp_path(doff, sizeof doff, name);
    dg_train_opts o = tiny_opts(don);
    o.device = dg_cuda(0);
    o.compute_dtype = compute;
    o.model.chunk = 16;
    o.steps = 9;
    o.accum = 2; /* the capture holds both micro-batches and the update */
    o.log_every = 3;
    o.eval_every = 4;
    o.sample_every = 4;
    o.sample_tokens = 16;
    o.ckpt_every = 4;
    o.graph = mode;
    graph_seen seen;
    memset(&seen, 0, sizeof seen);
    dg_train_result rg, re;
    char what[160];
    snprintf(what, sizeof what, "%s, --graph %s: train 9 steps", dn, mn);
    if (!dg_check_ok(dg_train_run(&o, watch_graph, &seen, &rg), what))
        return;
    dg_check(seen.warns == 0, "%s, --graph %s: no warning (%s)", dn, mn, seen.warn);
    dg_check(seen.captured == 1 && rg.graph_steps == 8,
             "%s, --graph %s: step 2 captured, steps 2-9 from the graph (%lld)", dn, mn,
             (long long)rg.graph_steps);
    o = tiny_opts(doff);
    o.device = dg_cuda(0);
    o.compute_dtype = compute;
    o.model.chunk = 16;
    o.steps = 9;
    o.accum = 2;
    o.log_every = 3;
    o.eval_every = 4;
    o.sample_every = 4;
    o.sample_tokens = 16;
    o.ckpt_every = 4;
    o.graph = DG_TRAIN_GRAPH_OFF;
    snprintf(what, sizeof what, "%s, --graph off: train 9 steps", dn);
    if (!dg_check_ok(dg_train_run(&o, NULL, NULL, &re), what)) {
        dg_train_result_free(&rg);
        return;
    }
    dg_check(re.graph_steps == 0, "%s, --graph off: every step eager", dn);
    int same = 1;
    for (int64_t s = 0; s < 9; s++)
        if (memcmp(&rg.losses[s], &re.losses[s], sizeof(double)) != 0) {
            printf("  step %lld: graph %.9g, eager %.9g\n", (long long)s + 1, rg.losses[s],
                   re.losses[s]);
            same = 0;
        }
    dg_check(same, "%s, --graph %s: the 9 losses equal the eager run's bit for bit (last %.6f)", dn,
             mn, re.losses[8]);
    dg_check(memcmp(&rg.final_val, &re.final_val, sizeof(double)) == 0,
             "%s: final validation loss identical (%.9g vs %.9g)", dn, rg.final_val, re.final_val);
    char ca[600], cb[600];
    snprintf(ca, sizeof ca, "%s/log.csv", don);
    snprintf(cb, sizeof cb, "%s/log.csv", doff);
    char *la = csv_cols(ca, 5), *lb = csv_cols(cb, 5);
    dg_check(la && lb && strlen(la) > 100 && !strcmp(la, lb),
             "%s: log.csv step, train_loss, val_loss, lr, grad_norm identical", dn);
    free(la);
    free(lb);
    dg_ckpt_latest_path(don, ca, sizeof ca);
    dg_ckpt_latest_path(doff, cb, sizeof cb);
    int n = 0;
    dg_check(same_ckpt_tensors(ca, cb, &n),
             "%s: final weights and AdamW moments identical bit for bit (%d tensors)", dn, n);
    dg_train_result_free(&rg);
    dg_train_result_free(&re);
}

static void test_graph(void) {
    graph_case(DG_F32, DG_TRAIN_GRAPH_AUTO);
    graph_case(DG_BF16, DG_TRAIN_GRAPH_ON);
    /* profiling times every node with a sync: the default steps aside, on is refused */
    dg_train_opts o = tiny_opts(NULL);
    o.device = dg_cuda(0);
    o.model.chunk = 16;
    o.steps = 3;
    dg_profile_enable(1);
    dg_train_result r;
    if (dg_check_ok(dg_train_run(&o, NULL, NULL, &r), "--profile, --graph left to its default")) {
        dg_check(r.graph_steps == 0, "with --profile the default runs every step eagerly");
        dg_train_result_free(&r);
    }
    o.graph = DG_TRAIN_GRAPH_ON;
    dg_check_err(dg_train_run(&o, NULL, NULL, NULL), DG_ERR_ARG, "--profile",
                 "--graph on with --profile");
    dg_profile_enable(0);
    dg_profile_reset();
}

static void cpu_cases(dg_ctx *cpu) {
    /* each case makes the contexts its runs need */
    tmp_setup();
    test_config();
    test_errors();
    test_graph_flag();
    test_causality();
    test_loss_falls();
    test_resume();
    test_kill_during_save();
    test_ckpt_format();
    test_dplr();
    tmp_cleanup();
}

static void gpu_cases(dg_ctx *cpu) {
    tmp_setup();
    test_gpu();
    test_graph();
    test_dplr_gpu();
    tmp_cleanup();
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "train", cpu_cases, gpu_cases); }

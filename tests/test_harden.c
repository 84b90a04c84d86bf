/*
 * tests/test_harden.c -- hostile inputs and injected faults (issue "Hardening"), one section per
 * class; docs/RELIABILITY.md quotes the case counts that this suite prints at the end.
 *
 * cpu: (1) special files (FIFO, character device, socket, directory) as every kind of input file
 *      are refused with an error naming the file and what it is, and never block;
 *      the other sections are listed in main().
 *
 * A watchdog alarm fails the suite instead of letting a blocked open hang ctest.
 */
#define _XOPEN_SOURCE 700 /* nftw (an XSI interface); also POSIX.1-2008 */
#define _DEFAULT_SOURCE   /* flock, usleep */
#include "tests/harness.h"
#include "tools/commands.h"
#include "tools/args.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/model.h"
#include "train/train.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <ftw.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define KJV DG_SOURCE_DIR "/data/kjv.txt"

/* ---- helpers -------------------------------------------------------------------------------- */

static char g_tmp[256];
static dg_ctx *g_ctx;
static int g_cases[16];   /* cases run per class, for the summary */
static int g_rejects[16]; /* of which: a bad input refused (or a bad output reported) */
static int g_faults[16];  /* faults injected (signals, write failures, non-finite weights) */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", g_tmp, name);
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "FATAL: test_harden: the watchdog fired (a call blocked)\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    _exit(1);
}

/* A check counted under class `cls`. */
#define CASE(cls, expr)                                                                            \
    do {                                                                                           \
        g_cases[cls]++;                                                                            \
        expr;                                                                                      \
    } while (0)

/* A case that checks a bad input is refused. */
#define REJ(cls, expr)                                                                             \
    do {                                                                                           \
        g_rejects[cls]++;                                                                          \
        CASE(cls, expr);                                                                           \
    } while (0)

/* The flags of the tiny training run the fault cases use (one thread, no eval, samples or
 * periodic checkpoints), spliced into their argv lists. */
#define DG_TINY_RUN_ARGS                                                                           \
    "--batch", "2", "--seq-len", "32", "--d", "16", "--heads", "1", "--head-dim", "16", "--inter", \
        "32", "--chunk-size", "16", "--eval-every", "0", "--sample-every", "-1", "--ckpt-every",   \
        "0", "--no-plot", "--threads", "1"

/* The status must be `want` and the message must hold every needle (NULL ends the list): a
 * rejection case. */
static int check_err_all(int cls, dg_status s, dg_status want, const char *what, ...) {
    g_cases[cls]++;
    g_rejects[cls]++;
    const char *msg = dg_last_error();
    int ok = s == want;
    va_list ap;
    va_start(ap, what);
    for (const char *n = va_arg(ap, const char *); n; n = va_arg(ap, const char *))
        if (!strstr(msg, n))
            ok = 0;
    va_end(ap);
    return dg_check(ok, "%s -> %s (want %s): \"%s\"", what, dg_status_str(s), dg_status_str(want),
                    msg);
}

/* Runs an in-process command with stderr sent to a file; its text into err[n]. */
static int run_captured(int (*fn)(int, char **), char **argv, char *err, size_t n) {
    int argc = 0;
    while (argv[argc])
        argc++;
    char path[300];
    tmp_path(path, sizeof path, "stderr.txt");
    fflush(stdout);
    fflush(stderr);
    int saved = dup(2), fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
    int out_saved = dup(1), devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1); /* the commands' progress output is not what is checked */
    close(devnull);
    int rc = fn(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(saved, 2);
    dup2(out_saved, 1);
    close(saved);
    close(out_saved);
    FILE *f = fopen(path, "r");
    size_t got = f ? fread(err, 1, n - 1, f) : 0;
    err[got] = 0;
    if (f)
        fclose(f);
    return rc;
}

/* Runs the deltagrad binary (argv[0] is ignored) and returns its exit status (128+N for signal
 * N); stderr text into err[n]. fsize > 0 limits the size of files it writes (RLIMIT_FSIZE, with
 * SIGXFSZ ignored: writes past it fail as on a full disk). The library's OpenMP threads do not
 * survive fork(), so a child always execs the binary rather than calling into the library. */
static int run_binary_fsize(char **argv, long fsize, char *err, size_t n) {
    int pfd[2];
    if (pipe(pfd) != 0) {
        perror("pipe");
        exit(1);
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        int nul = open("/dev/null", O_WRONLY);
        dup2(pfd[1], 2);
        dup2(nul, 1);
        if (fsize > 0) {
            signal(SIGXFSZ, SIG_IGN);
            struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
            setrlimit(RLIMIT_FSIZE, &rl);
        }
        argv[0] = DG_BINARY_DIR "/deltagrad";
        execv(argv[0], argv);
        _exit(127);
    }
    close(pfd[1]);
    size_t got = 0;
    ssize_t r;
    char sink[256];
    while ((r = read(pfd[0], got + 1 < n ? err + got : sink,
                     got + 1 < n ? n - 1 - got : sizeof sink)) > 0 ||
           (r < 0 && errno == EINTR))
        if (r > 0 && got + 1 < n)
            got += (size_t)r;
    err[got] = 0;
    close(pfd[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int run_binary(char **argv, char *err, size_t n) {
    return run_binary_fsize(argv, 0, err, n);
}

/* ---- (1) special files ---------------------------------------------------------------------- */

typedef struct special {
    const char *label, *path, *kind;
} special;

static void test_special_files(void) {
    char fifo[300], sock[300], dir[300];
    tmp_path(fifo, sizeof fifo, "fifo.npy");
    tmp_path(sock, sizeof sock, "sock.npy");
    tmp_path(dir, sizeof dir, "dir.npy");
    if (mkfifo(fifo, 0600) != 0 || mkdir(dir, 0700) != 0) {
        perror("mkfifo/mkdir");
        exit(1);
    }
    int sfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    int have_sock = strlen(sock) < sizeof sa.sun_path;
    if (have_sock)
        memcpy(sa.sun_path, sock, strlen(sock) + 1);
    have_sock = have_sock && sfd >= 0 && bind(sfd, (struct sockaddr *)&sa, sizeof sa) == 0;
    special sp[] = {{"a FIFO", fifo, "FIFO"},
                    {"/dev/zero", "/dev/zero", "character device"},
                    {"a directory", dir, "directory"},
                    {"a socket", sock, "socket"}};
    int n_sp = have_sock ? 4 : 3;
    if (!have_sock)
        printf("note: cannot bind a unix socket here; the socket cases are left out\n");
    for (int i = 0; i < n_sp; i++) {
        char what[128];
        dg_tensor *t = NULL;
        snprintf(what, sizeof what, "dg_npy_load of %s", sp[i].label);
        check_err_all(1, dg_npy_load(g_ctx, sp[i].path, &t), DG_ERR_IO, what, sp[i].path,
                      sp[i].kind, "not a regular file", NULL);
        dg_safetensors st;
        snprintf(what, sizeof what, "dg_safetensors_load of %s", sp[i].label);
        check_err_all(1, dg_safetensors_load(g_ctx, sp[i].path, &st), DG_ERR_IO, what, sp[i].path,
                      sp[i].kind, NULL);
        dg_ckpt ck;
        snprintf(what, sizeof what, "dg_ckpt_load of %s", sp[i].label);
        check_err_all(1, dg_ckpt_load(g_ctx, sp[i].path, &ck), DG_ERR_IO, what, sp[i].path,
                      sp[i].kind, NULL);
        dg_text tx;
        snprintf(what, sizeof what, "dg_text_load (--data) of %s", sp[i].label);
        check_err_all(1, dg_text_load(sp[i].path, 0, 16, &tx), DG_ERR_IO, what, "--data",
                      sp[i].path, sp[i].kind, NULL);
    }
    /* through the commands: `sample --ckpt FIFO` and `train --data FIFO` fail without blocking */
    fflush(stdout);
    char *sargv[] = {"sample", "--ckpt", fifo, "--tokens", "1", NULL};
    int rc = dg_cmd_sample(5, sargv);
    REJ(1, dg_check(rc == 1, "deltagrad sample --ckpt <FIFO> exits 1 (got %d)", rc));
    char *targv[] = {"train", "--data", fifo, "--no-out", "--steps", "1", NULL};
    rc = dg_cmd_train(6, targv);
    REJ(1, dg_check(rc == 1, "deltagrad train --data <FIFO> exits 1 (got %d)", rc));
    /* a FIFO where the run's log.csv goes: refused, not opened for append (which would block) */
    char run[300], csv[320];
    tmp_path(run, sizeof run, "fifo_run");
    mkdir(run, 0700);
    snprintf(csv, sizeof csv, "%s/log.csv", run);
    mkfifo(csv, 0600);
    char *cargv[] = {"train", "--data",  KJV, "--max-bytes",  "20000", "--out",
                     run,     "--steps", "1", "--batch",      "1",     "--seq-len",
                     "16",    "--d",     "8", "--heads",      "1",     "--head-dim",
                     "8",     "--inter", "8", "--chunk-size", "16",    NULL};
    rc = dg_cmd_train(23, cargv);
    REJ(1, dg_check(rc == 1, "deltagrad train with a FIFO as DIR/log.csv exits 1 (got %d)", rc));
    /* `train --plot DIR` reading a FIFO log.csv, and `kda` reading a FIFO q.npy */
    char *pargv[] = {"train", "--plot", run, NULL};
    char err[4096];
    rc = run_captured(dg_cmd_train, pargv, err, sizeof err);
    REJ(1, dg_check(rc == 1 && strstr(err, "FIFO"),
                    "train --plot with a FIFO log.csv: exit 1 "
                    "naming it (%d: %.160s)",
                    rc, err));
    char kin[300], kout[300], q[320];
    tmp_path(kin, sizeof kin, "kda_fifo_in");
    tmp_path(kout, sizeof kout, "kda_fifo_out");
    mkdir(kin, 0700);
    static const char *const names[] = {"k", "v", "g", "beta"};
    for (int i = 0; i < 4; i++) {
        char p[320];
        snprintf(p, sizeof p, "%s/%s.npy", kin, names[i]);
        FILE *f = fopen(p, "wb");
        if (f)
            fclose(f);
    }
    snprintf(q, sizeof q, "%s/q.npy", kin);
    mkfifo(q, 0600);
    char *kargv[] = {"deltagrad", "kda", "--in", kin, "--out", kout, NULL};
    rc = run_binary(kargv, err, sizeof err);
    REJ(1, dg_check(rc == 1 && strstr(err, "q.npy") && strstr(err, "FIFO"),
                    "deltagrad kda with a FIFO q.npy: exit 1 naming it (%d: %.160s)", rc, err));
    if (have_sock)
        close(sfd);
}

/* ---- shared: tiny runs ----------------------------------------------------------------------- */

static dg_model_config tiny_config(void) {
    dg_model_config c;
    DG_TEST_TRY(dg_model_config_preset("cpu", &c));
    c.d = 16;
    c.n_layers = 1;
    c.n_heads = c.n_v_heads = 1;
    c.head_k = c.head_v = 16;
    c.inter = 32;
    c.chunk = 16;
    return c;
}

static dg_train_opts tiny_opts(const char *out_dir, int64_t steps) {
    dg_train_opts o;
    DG_TEST_TRY(dg_train_opts_default("cpu", &o));
    o.model = tiny_config();
    snprintf(o.data_path, sizeof o.data_path, "%s", KJV);
    o.max_data_bytes = 20000;
    snprintf(o.out_dir, sizeof o.out_dir, "%s", out_dir ? out_dir : "");
    o.steps = steps;
    o.warmup = 1;
    o.batch = 2;
    o.seq_len = 32;
    o.eval_every = 0;
    o.eval_batches = 1;
    o.sample_every = -1;
    o.ckpt_every = 0;
    o.plot = 0;
    return o;
}

/* The bytes of a file (NULL if unreadable); its size into *n. */
static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(sz > 0 ? (size_t)sz : 1);
    *n = b && fread(b, 1, (size_t)sz, f) == (size_t)sz ? (size_t)sz : 0;
    fclose(f);
    return b;
}

static int same_file(const char *path, const unsigned char *bytes, size_t n) {
    size_t m = 0;
    unsigned char *b = slurp(path, &m);
    int same = b && m == n && memcmp(b, bytes, n) == 0;
    free(b);
    return same;
}

/* Names in dir holding ".tmp" (temp files of any writer). */
static int count_temps(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp")) {
            printf("  leftover temp file %s/%s\n", dir, e->d_name);
            n++;
        }
    if (d)
        closedir(d);
    return n;
}

static int csv_lines(const char *dir) {
    char p[400];
    snprintf(p, sizeof p, "%s/log.csv", dir);
    FILE *f = fopen(p, "r");
    int n = 0, ch;
    while (f && (ch = fgetc(f)) != EOF)
        n += ch == '\n';
    if (f)
        fclose(f);
    return n - 1; /* without the header */
}

/* ---- (5) checkpoints ------------------------------------------------------------------------ */

/* Rewrites checkpoint `src` into `dst` with metadata `key` set to `val` (NULL: removed) and,
 * when poison >= 0, tensor number `poison` overwritten with NaN. */
static void rewrite_ckpt(const char *src, const char *dst, const char *key, const char *val,
                         int poison) {
    dg_safetensors st;
    DG_TEST_TRY(dg_safetensors_load(g_ctx, src, &st));
    const char *mk[64], *mv[64];
    int nm = 0;
    for (int i = 0; i < st.n_meta; i++) {
        if (key && !strcmp(st.meta_keys[i], key))
            continue;
        if (poison >= 0 && !strcmp(st.meta_keys[i], "checksums"))
            continue;
        mk[nm] = st.meta_keys[i], mv[nm++] = st.meta_values[i];
    }
    if (key && val)
        mk[nm] = key, mv[nm++] = val;
    if (poison >= 0)
        DG_TEST_TRY(dg_tensor_fill_(st.tensors[poison], NAN));
    DG_TEST_TRY(dg_safetensors_save(dst, st.n, (const char *const *)st.names,
                                    (const dg_tensor *const *)st.tensors, nm, mk, mv));
    dg_safetensors_free(&st);
}

static void test_checkpoints(void) {
    char dir[300], ck[400], bad[400];
    tmp_path(dir, sizeof dir, "ckpt_run");
    dg_train_opts o = tiny_opts(dir, 2);
    DG_TEST_TRY(dg_train_run(&o, NULL, NULL, NULL));
    dg_ckpt_latest_path(dir, ck, sizeof ck);
    tmp_path(bad, sizeof bad, "bad.safetensors");
    dg_ckpt c;
    CASE(5, dg_check_ok(dg_ckpt_load(g_ctx, ck, &c), "a fresh checkpoint loads and verifies"));
    int n_t = c.st.n;
    char first[128], last[128];
    snprintf(first, sizeof first, "%s", c.st.names[0]);
    snprintf(last, sizeof last, "%s", c.st.names[n_t - 1]);
    CASE(5, dg_check(dg_safetensors_meta(&c.st, "checksums") != NULL,
                     "the checkpoint records checksums for its %d tensors", n_t));
    dg_ckpt_free(&c);

    /* one flipped bit in the data of the first and of the last tensor */
    size_t n = 0;
    unsigned char *bytes = slurp(ck, &n);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--)
        hlen = hlen << 8 | bytes[k];
    size_t at[2] = {(size_t)(8 + hlen + 5), n - 3};
    const char *who[2] = {first, last};
    for (int i = 0; i < 2; i++) {
        bytes[at[i]] ^= 0x10;
        FILE *f = fopen(bad, "wb");
        fwrite(bytes, 1, n, f);
        fclose(f);
        bytes[at[i]] ^= 0x10;
        check_err_all(5, dg_ckpt_load(g_ctx, bad, &c), DG_ERR_FORMAT,
                      "a flipped bit in tensor data is detected", "corrupted", who[i], "bad.safe",
                      NULL);
    }
    /* counters out of range, and non-numbers, in the metadata */
    static const char *const meta_cases[][2] = {{"step", "99999999999999999999"},
                                                {"step", "-1"},
                                                {"step", "1099511627777"},
                                                {"train.accum", "1000000"},
                                                {"train.accum", "0"},
                                                {"train.eval_batches", "0"},
                                                {"train.eval_batches", "70000"},
                                                {"train.batch", "70000"},
                                                {"train.seq_len", "1"},
                                                {"train.steps", "0"},
                                                {"train.warmup", "2199023255552"},
                                                {"data_counter", "18446744073709551615"},
                                                {"data_counter", "-5"},
                                                {"train.lr", "nan"},
                                                {"train.clip", "inf"},
                                                {"train.beta1", "1e999"},
                                                {"train.steps", "12abc"}};
    for (size_t i = 0; i < sizeof meta_cases / sizeof *meta_cases; i++) {
        rewrite_ckpt(ck, bad, meta_cases[i][0], meta_cases[i][1], -1);
        char what[160];
        snprintf(what, sizeof what, "metadata %s = %s is refused", meta_cases[i][0],
                 meta_cases[i][1]);
        check_err_all(5, dg_ckpt_load(g_ctx, bad, &c), DG_ERR_FORMAT, what, meta_cases[i][0], NULL);
    }
    rewrite_ckpt(ck, bad, "checksums", "fnv1a64 bogus=0000000000000000", -1);
    check_err_all(5, dg_ckpt_load(g_ctx, bad, &c), DG_ERR_FORMAT,
                  "a checksum list that does not match the tensors", "checksums", NULL);

    /* non-finite weights: never written; a file holding them is refused by sample and resume */
    dg_model *m = NULL;
    dg_model_config cfg = tiny_config();
    DG_TEST_TRY(dg_model_new(g_ctx, &cfg, DG_F32, DG_F32, &m));
    DG_TEST_TRY(dg_model_init(m, 3));
    dg_train_state tst = {2, 4, 0, 0};
    char good[400];
    tmp_path(good, sizeof good, "good.safetensors");
    DG_TEST_TRY(dg_ckpt_save(good, m, NULL, NULL, &o, &tst));
    size_t gn = 0;
    unsigned char *gbytes = slurp(good, &gn);
    DG_TEST_TRY(dg_tensor_fill_(m->params[2].t, INFINITY));
    tst.step = 3;
    g_faults[5]++;
    check_err_all(5, dg_ckpt_save(good, m, NULL, NULL, &o, &tst), DG_ERR_NUMERIC,
                  "a checkpoint of non-finite weights is not written", m->params[2].name,
                  "non-finite", NULL);
    CASE(5, dg_check(same_file(good, gbytes, gn), "the previous checkpoint is byte-identical"));
    CASE(5, dg_check(count_temps(g_tmp) == 0, "no temp file is left behind"));
    free(gbytes);
    dg_model_free(&m);
    rewrite_ckpt(ck, bad, NULL, NULL, 1);
    char err[4096];
    char *sargv[] = {"sample", "--ckpt", bad, "--tokens", "2", NULL};
    int rc = run_captured(dg_cmd_sample, sargv, err, sizeof err);
    REJ(5, dg_check(rc == 1 && strstr(err, "non-finite") && strstr(err, "bad.safetensors"),
                    "sample refuses NaN weights (exit %d: %.200s)", rc, err));
    /* a run whose weights overflow: stopped before any checkpoint of them is written */
    char div[300], divck[400];
    tmp_path(div, sizeof div, "diverged");
    dg_train_opts d = tiny_opts(div, 3);
    d.lr = 1e39; /* past the largest float: the first update makes the f32 weights infinite */
    d.ckpt_every = 1;
    g_faults[5]++;
    check_err_all(5, dg_train_run(&d, NULL, NULL, NULL), DG_ERR_NUMERIC,
                  "a diverged run stops with a numeric error", "non-finite", NULL);
    dg_ckpt_latest_path(div, divck, sizeof divck);
    CASE(5, dg_check(access(divck, F_OK) != 0, "no checkpoint of the diverged weights exists"));
    free(bytes);
}

/* `deltagrad train` on a tiny model in a child process (a long run into dir); its pid. */
static pid_t start_trainer(const char *dir) {
    pid_t pid = fork();
    if (pid == 0) {
        int nul = open("/dev/null", O_WRONLY);
        dup2(nul, 1);
        dup2(nul, 2);
        char *argv[] = {DG_BINARY_DIR "/deltagrad",
                        "train",
                        "--data",
                        KJV,
                        "--max-bytes",
                        "20000",
                        "--out",
                        (char *)dir,
                        "--steps",
                        "1000000",
                        DG_TINY_RUN_ARGS,
                        NULL};
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Waits (at most a minute) until dir/log.csv shows `n` steps. */
static void wait_steps(const char *dir, int n) {
    for (int i = 0; i < 6000 && csv_lines(dir) < n; i++)
        usleep(10000);
}

/* Signals a trainer and returns its exit status. */
static int stop_trainer(pid_t pid, int sig) {
    kill(pid, sig);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* `deltagrad train` in a child, stopped by `sig` once log.csv shows `after` steps. Returns the
 * child's exit status. */
static int train_then_signal(const char *dir, int sig, int after) {
    pid_t pid = start_trainer(dir);
    wait_steps(dir, after);
    return stop_trainer(pid, sig);
}

/* ---- (6) run directories -------------------------------------------------------------------- */

static void test_run_dirs(void) {
    char dir[300], csv[400], ck[400];
    tmp_path(dir, sizeof dir, "rundir");
    dg_train_opts o = tiny_opts(dir, 2);
    o.keep_step_ckpts = 1;
    DG_TEST_TRY(dg_train_run(&o, NULL, NULL, NULL));
    snprintf(csv, sizeof csv, "%s/log.csv", dir);
    dg_ckpt_latest_path(dir, ck, sizeof ck);
    size_t cn = 0, kn = 0;
    unsigned char *cb = slurp(csv, &cn), *kb = slurp(ck, &kn);
    dg_train_opts again = tiny_opts(dir, 3);
    check_err_all(6, dg_train_run(&again, NULL, NULL, NULL), DG_ERR_ARG,
                  "a fresh run into a directory holding a run is refused", "already holds a run",
                  "--overwrite", "--resume", NULL);
    CASE(6, dg_check(same_file(csv, cb, cn) && same_file(ck, kb, kn),
                     "the refused run left log.csv and the checkpoint untouched"));
    char *argv[] = {"train", "--data",  KJV, "--max-bytes",  "20000", "--out",
                    dir,     "--steps", "1", "--batch",      "1",     "--seq-len",
                    "16",    "--d",     "8", "--heads",      "1",     "--head-dim",
                    "8",     "--inter", "8", "--chunk-size", "16",    NULL};
    char err[4096];
    int rc = run_captured(dg_cmd_train, argv, err, sizeof err);
    REJ(6, dg_check(rc == 2 && strstr(err, "--overwrite"),
                    "deltagrad train into a used --out exits 2 (%d: %.160s)", rc, err));
    again.overwrite = 1;
    again.keep_step_ckpts = 0;
    CASE(6, dg_check_ok(dg_train_run(&again, NULL, NULL, NULL), "--overwrite replaces the run"));
    char old_step[400];
    snprintf(old_step, sizeof old_step, "%s/ckpt_step000002.safetensors", dir);
    CASE(6, dg_check(access(old_step, F_OK) != 0 && csv_lines(dir) == 3,
                     "--overwrite removed the old run's checkpoints; log.csv has the 3 new steps"));
    free(cb), free(kb);

    /* a second trainer on the directory */
    char lock[400];
    snprintf(lock, sizeof lock, "%s/train.lock", dir);
    int fd = open(lock, O_RDWR);
    CASE(6, dg_check(fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0,
                     "train.lock exists and is free after the run"));
    dg_train_opts second = tiny_opts(dir, 4);
    second.resume = 1;
    check_err_all(6, dg_train_run(&second, NULL, NULL, NULL), DG_ERR_STATE,
                  "a second trainer on a locked directory is refused", "in use", "train.lock",
                  NULL);
    second.overwrite = 1;
    second.resume = 0;
    check_err_all(6, dg_train_run(&second, NULL, NULL, NULL), DG_ERR_STATE, "even with --overwrite",
                  "in use", NULL);
    if (fd >= 0)
        close(fd);

    /* two processes: a second `deltagrad train` on a directory in use fails at once */
    char busy[300], pidtxt[32];
    tmp_path(busy, sizeof busy, "busy");
    pid_t first = start_trainer(busy);
    wait_steps(busy, 2);
    snprintf(pidtxt, sizeof pidtxt, "pid %ld", (long)first);
    char *resume[] = {"deltagrad", "train", "--resume", "--out", busy, "--threads", "1", NULL};
    rc = run_binary(resume, err, sizeof err);
    REJ(6, dg_check(rc == 1 && strstr(err, "in use") && strstr(err, pidtxt),
                    "a second trainer (--resume) on a busy directory: exit 1 naming %s (%d: "
                    "%.200s)",
                    pidtxt, rc, err));
    char *fresh[] = {"deltagrad", "train",   "--out", busy,           "--overwrite", "--steps",
                     "1",         "--d",     "8",     "--heads",      "1",           "--head-dim",
                     "8",         "--inter", "8",     "--chunk-size", "16",          "--data",
                     KJV,         NULL};
    rc = run_binary(fresh, err, sizeof err);
    REJ(6, dg_check(rc == 1 && strstr(err, "in use"),
                    "a second trainer with --overwrite is refused too (%d: %.160s)", rc, err));
    int lines_before = csv_lines(busy);
    rc = stop_trainer(first, SIGTERM);
    CASE(6, dg_check(rc == 128 + SIGTERM && csv_lines(busy) >= lines_before,
                     "the first trainer ran on undisturbed and stopped cleanly (exit %d)", rc));

    /* log.csv cannot be written (a file size limit, as on a full disk): the run stops at once.
     * The limit leaves room for the OpenMP runtime's own start-up files (LLVM's libomp sizes a
     * 1 KiB shared-memory registration file and aborts when it cannot); log.csv passes 4 KiB
     * after about 80 of the 200 steps (some 52 bytes a line). */
    char full[300];
    tmp_path(full, sizeof full, "csv_full");
    char *fargv[] = {"deltagrad", "train", "--data",  KJV,   "--max-bytes",    "20000",
                     "--out",     full,    "--steps", "200", DG_TINY_RUN_ARGS, NULL};
    g_faults[6]++;
    rc = run_binary_fsize(fargv, 4096, err, sizeof err);
    CASE(6,
         dg_check(rc == 1 && strstr(err, "log.csv") && strstr(err, "the run stops"),
                  "a failed log.csv write stops the run, exit 1 naming it (%d: %.200s)", rc, err));
    int lines = csv_lines(full);
    CASE(6, dg_check(lines >= 1 && lines < 200, "the run stopped early (%d steps logged)", lines));
    CASE(6, dg_check(count_temps(full) == 0, "no temp file left after the failed write"));
}

/* ---- (9) faults ----------------------------------------------------------------------------- */

static void test_faults(void) {
    static const int sigs[2] = {SIGTERM, SIGINT};
    for (int i = 0; i < 2; i++) {
        char dir[300], ck[400];
        tmp_path(dir, sizeof dir, i ? "sigint" : "sigterm");
        g_faults[9]++;
        int rc = train_then_signal(dir, sigs[i], 3);
        CASE(9, dg_check(rc == 128 + sigs[i], "%s during training: exit %d (want %d)",
                         i ? "SIGINT" : "SIGTERM", rc, 128 + sigs[i]));
        dg_ckpt_latest_path(dir, ck, sizeof ck);
        dg_ckpt c;
        dg_status s = dg_ckpt_load(g_ctx, ck, &c);
        int lines = csv_lines(dir);
        CASE(9, dg_check(s == DG_OK && c.state.step == lines && lines >= 3,
                         "the final checkpoint loads and is at the last logged step (%lld, %d "
                         "lines): %s",
                         (long long)c.state.step, lines, s == DG_OK ? "ok" : dg_last_error()));
        if (s == DG_OK)
            dg_ckpt_free(&c);
        CASE(9, dg_check(count_temps(dir) == 0, "no temp file after the signal"));
        /* the run goes on from there */
        dg_train_opts r = tiny_opts(dir, 0);
        r.resume = 1;
        r.data_path[0] = 0;
        r.resume_steps = lines + 1;
        dg_train_result res;
        s = dg_train_run(&r, NULL, NULL, &res);
        CASE(9, dg_check(s == DG_OK && res.first_step == lines + 1 && res.last_step == lines + 1,
                         "--resume continues at step %d (%s)", lines + 1,
                         s == DG_OK ? "ok" : dg_last_error()));
        if (s == DG_OK)
            dg_train_result_free(&res);
    }

    /* a full disk while the checkpoint is written: the previous one stays, byte for byte */
    char dir[300], ck[400];
    tmp_path(dir, sizeof dir, "ckpt_full");
    dg_train_opts o = tiny_opts(dir, 4);
    o.stop_at = 2;
    DG_TEST_TRY(dg_train_run(&o, NULL, NULL, NULL));
    dg_ckpt_latest_path(dir, ck, sizeof ck);
    size_t n = 0;
    unsigned char *before = slurp(ck, &n);
    char *rargv[] = {"deltagrad", "train",     "--resume", "--out",     dir, "--steps",
                     "4",         "--threads", "1",        "--no-plot", NULL};
    char msg[4096];
    g_faults[9]++;
    int rc = run_binary_fsize(rargv, (long)n / 2, msg, sizeof msg);
    CASE(9, dg_check(rc == 1, "the resumed run fails (exit %d)", rc));
    CASE(9, dg_check(strstr(msg, "ckpt_latest") != NULL,
                     "a checkpoint write past the size limit fails naming the file: %.200s", msg));
    CASE(9, dg_check(before && same_file(ck, before, n),
                     "the previous checkpoint is byte-identical after the failed save"));
    CASE(9, dg_check(count_temps(dir) == 0, "the failed save left no temp file"));
    dg_ckpt c;
    dg_status s = dg_ckpt_load(g_ctx, ck, &c);
    CASE(9, dg_check(s == DG_OK && c.state.step == 2, "it still loads, at step 2"));
    if (s == DG_OK)
        dg_ckpt_free(&c);
    free(before);
}

/* ---- (2) numeric flags ---------------------------------------------------------------------- */

typedef struct num_case {
    const char *text;
    int ok;      /* accepted? */
    double want; /* the value when accepted */
} num_case;

static void test_numeric_parser(void) {
    /* integers in [1, 100] */
    static const num_case ints[] = {{"16", 1, 16},  {"1", 1, 1},     {"100", 1, 100},
                                    {"+7", 1, 7},   {"16abc", 0, 0}, {"abc", 0, 0},
                                    {"", 0, 0},     {" 5", 0, 0},    {"5 ", 0, 0},
                                    {"0x10", 0, 0}, {"1e3", 0, 0},   {"1.0", 0, 0},
                                    {"0", 0, 0},    {"101", 0, 0},   {"-1", 0, 0},
                                    {"-", 0, 0},    {"--5", 0, 0},   {"99999999999999999999", 0, 0},
                                    {"5\n", 0, 0},  {"\t3", 0, 0}};
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) {
        int64_t v = -99;
        dg_status st = dg_arg_i64("--n", ints[i].text, 1, 100, &v);
        if (ints[i].ok)
            CASE(2, dg_check(st == DG_OK && v == (int64_t)ints[i].want, "--n '%s' -> %lld",
                             ints[i].text, (long long)v));
        else
            check_err_all(2, st, DG_ERR_ARG, "an integer flag refuses a bad value", "--n",
                          "[1, 100]", NULL);
    }
    /* numbers in [-5, 0) */
    static const num_case reals[] = {
        {"-5", 1, -5},    {"-2.5", 1, -2.5}, {"-1e-3", 1, -1e-3}, {"-.5", 1, -0.5}, {"0", 0, 0},
        {"-0", 0, 0},     {"-5.0001", 0, 0}, {"nan", 0, 0},       {"-inf", 0, 0},   {"inf", 0, 0},
        {"-1e999", 0, 0}, {"-0x1p1", 0, 0},  {"-1abc", 0, 0},     {"", 0, 0},       {".", 0, 0},
        {"-", 0, 0},      {"-1e", 0, 0},     {" -1", 0, 0},       {"-1 ", 0, 0},    {"e5", 0, 0}};
    for (size_t i = 0; i < sizeof reals / sizeof *reals; i++) {
        double v = 99;
        dg_status st = dg_arg_f64("--lower-bound", reals[i].text, -5.0, 0.0, DG_ARG_HI_OPEN, &v);
        if (reals[i].ok)
            CASE(2, dg_check(st == DG_OK && v == reals[i].want, "--lower-bound '%s' -> %g",
                             reals[i].text, v));
        else
            check_err_all(2, st, DG_ERR_ARG, "a number flag refuses a bad value", "--lower-bound",
                          "[-5, 0)", NULL);
    }
    double v = 0;
    check_err_all(2, dg_arg_f64("--lr", "0", 0.0, INFINITY, DG_ARG_LO_OPEN, &v), DG_ERR_ARG,
                  "an open lower bound excludes the bound", "--lr", "> 0", NULL);
    check_err_all(2, dg_arg_f64("--x", "1e-400", -1.0, 1.0, 0, &v), DG_ERR_ARG,
                  "a value that underflows to zero is refused", "--x", NULL);
    int c = 0;
    static const int chunks[3] = {16, 32, 64};
    CASE(2, dg_check(dg_arg_choice("--chunk-size", "32", chunks, 3, &c) == DG_OK && c == 32,
                     "--chunk-size 32 is a valid choice"));
    check_err_all(2, dg_arg_choice("--chunk-size", "48", chunks, 3, &c), DG_ERR_ARG,
                  "--chunk-size 48 is not a choice", "--chunk-size", "one of 16, 32, 64", NULL);
    check_err_all(2, dg_arg_choice("--chunk-size", "16abc", chunks, 3, &c), DG_ERR_ARG,
                  "--chunk-size 16abc is refused", "16abc", NULL);
}

/* Every numeric flag of `train`, `sample`, `kda`, `dplr`, `bench` and `gradcheck` refuses trailing
 * garbage, no digits, an empty value and an out-of-range value, with exit 2 and a message naming
 * the flag. */
typedef struct flag_case {
    const char *flag, *out_of_range;
} flag_case;

static void test_numeric_flags(void) {
    static const flag_case train_flags[] = {{"--max-bytes", "-1"},    {"--steps", "0"},
                                            {"--stop-at", "0"},       {"--seed", "-1"},
                                            {"--batch", "65537"},     {"--seq-len", "1"},
                                            {"--accum", "0"},         {"--lr", "0"},
                                            {"--warmup", "-1"},       {"--min-lr-frac", "1.5"},
                                            {"--beta1", "1"},         {"--beta2", "-0.1"},
                                            {"--adam-eps", "0"},      {"--weight-decay", "-1"},
                                            {"--clip", "0"},          {"--d", "0"},
                                            {"--layers", "257"},      {"--heads", "0"},
                                            {"--v-heads", "0"},       {"--head-dim", "257"},
                                            {"--head-v-dim", "0"},    {"--inter", "0"},
                                            {"--chunk-size", "48"},   {"--lower-bound", "0"},
                                            {"--eval-every", "-1"},   {"--eval-batches", "0"},
                                            {"--sample-every", "-2"}, {"--sample-tokens", "-1"},
                                            {"--temperature", "-1"},  {"--top-k", "257"},
                                            {"--ckpt-every", "-1"},   {"--log-every", "0"},
                                            {"--threads", "-1"}};
    static const flag_case sample_flags[] = {{"--tokens", "0"},
                                             {"--temperature", "-0.5"},
                                             {"--top-k", "300"},
                                             {"--seed", "-3"},
                                             {"--threads", "5000"}};
    static const char *const bad_values[] = {"16abc", "abc", ""};
    char err[4096];
    for (int which = 0; which < 2; which++) {
        const flag_case *fl = which ? sample_flags : train_flags;
        int n = which ? (int)(sizeof sample_flags / sizeof *sample_flags)
                      : (int)(sizeof train_flags / sizeof *train_flags);
        int (*fn)(int, char **) = which ? dg_cmd_sample : dg_cmd_train;
        const char *cmd = which ? "sample" : "train";
        for (int i = 0; i < n; i++)
            for (int b = 0; b < 4; b++) {
                const char *val = b < 3 ? bad_values[b] : fl[i].out_of_range;
                char *argv[] = {(char *)cmd, (char *)fl[i].flag, (char *)val, "--ckpt", "x", NULL};
                if (!which)
                    argv[3] = NULL;
                int rc = run_captured(fn, argv, err, sizeof err);
                REJ(2, dg_check(rc == 2 && strstr(err, fl[i].flag) && strstr(err, "expected"),
                                "%s %s '%s' -> exit %d: %.120s", cmd, fl[i].flag, val, rc, err));
            }
    }
    /* the other tools, through the binary */
    static const char *const tool_cases[][6] = {
        {"kda", "--in", ".", "--chunk-size", "16abc", "--chunk-size"},
        {"kda", "--in", ".", "--chunk-size", "48", "--chunk-size"},
        {"kda", "--in", ".", "--lower-bound", "0", "--lower-bound"},
        {"kda", "--in", ".", "--lower-bound", "-2x", "--lower-bound"},
        {"kda", "--in", ".", "--scale", "abc", "--scale"},
        {"kda", "--in", ".", "--scale", "0", "--scale"},
        {"kda", "--in", ".", "--scale", "", "--scale"},
        {"dplr", "--in", ".", "--chunk-size", "16abc", "--chunk-size"},
        {"dplr", "--in", ".", "--chunk-size", "48", "--chunk-size"},
        {"dplr", "--in", ".", "--scale", "abc", "--scale"},
        {"dplr", "--in", ".", "--scale", "0", "--scale"},
        {"dplr", "--in", ".", "--scale", "", "--scale"},
        {"bench", "core", "--reps", "5x", NULL, "--reps"},
        {"bench", "core", "--warmup", "-1", NULL, "--warmup"},
        {"bench", "core", "--m", "abc", NULL, "--m"},
        {"bench", "core", "--copy-mib", "0", NULL, "--copy-mib"},
        {"bench", "core", "--peak-tflops", "inf", NULL, "--peak-tflops"},
        {"bench", "core", "--sizes", "64,1x", NULL, "--sizes"},
        {"bench", "kda", "--reps", "3x", NULL, "--reps"},
        {"bench", "kda", "--reps", "65", NULL, "--reps"},
        {"bench", "dplr", "--reps", "3x", NULL, "--reps"},
        {"bench", "dplr", "--chunk-size", "48", NULL, "--chunk-size"},
        {"bench", "cp", "--T", "16abc", NULL, "--T"},
        {"bench", "cp", "--chunk-size", "48", NULL, "--chunk-size"},
        {"bench", "cp", "--reps", "0", NULL, "--reps"},
        {"bench", "cp", "--cores", "", NULL, "--cores"},
        {"gradcheck", "kda", "--B", "0", NULL, "--B"},
        {"gradcheck", "kda", "--T", "16abc", NULL, "--T"},
        {"gradcheck", "kda", "--H", "abc", NULL, "--H"},
        {"gradcheck", "kda", "--HV", "", NULL, "--HV"},
        {"gradcheck", "kda", "--K", "257", NULL, "--K"},
        {"gradcheck", "kda", "--V", "0", NULL, "--V"},
        {"gradcheck", "kda", "--chunk-size", "48", NULL, "--chunk-size"},
        {"gradcheck", "kda", "--lower-bound", "0", NULL, "--lower-bound"},
        {"gradcheck", "kda", "--scale", "0", NULL, "--scale"},
        {"gradcheck", "kda", "--seed", "-1", NULL, "--seed"},
        {"gradcheck", "kda", "--eps", "1", NULL, "--eps"},
        {"gradcheck", "kda", "--tol", "0", NULL, "--tol"},
        {"gradcheck", "kda", "--cu-seqlens", "0,1x", NULL, "--cu-seqlens"},
        {"gradcheck", "dplr", "--T", "", NULL, "--T"},
        {"gradcheck", "dplr", "--K", "2.5", NULL, "--K"},
        {"gradcheck", "dplr", "--chunk-size", "16abc", NULL, "--chunk-size"}};
    for (size_t i = 0; i < sizeof tool_cases / sizeof *tool_cases; i++) {
        char *argv[12] = {"deltagrad"};
        int k = 1;
        for (int j = 0; j < 5 && tool_cases[i][j]; j++)
            argv[k++] = (char *)tool_cases[i][j];
        if (!strcmp(tool_cases[i][0], "kda") || !strcmp(tool_cases[i][0], "dplr")) {
            argv[k++] = "--out";
            argv[k++] = g_tmp;
        }
        argv[k] = NULL;
        int rc = run_binary(argv, err, sizeof err);
        /* "bench" and "gradcheck" name a sub-command before the flag */
        int bench = !strcmp(tool_cases[i][0], "bench") || !strcmp(tool_cases[i][0], "gradcheck");
        REJ(2, dg_check(rc == 2 && strstr(err, tool_cases[i][5]) && strstr(err, "expected"),
                        "deltagrad %s %s %s '%s' -> exit %d: %.120s", tool_cases[i][0],
                        tool_cases[i][1], tool_cases[i][bench ? 2 : 3],
                        tool_cases[i][bench ? 3 : 4], rc, err));
    }
}

/* ---- (3) index arrays ----------------------------------------------------------------------- */

static dg_tensor *tensor_of(dg_dtype dt, int ndim, const int64_t *shape, const double *v) {
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(g_ctx, dt, ndim, shape, v, &t));
    return t;
}

static void test_index_arrays(void) {
    int64_t out[8];
    int n = 0;
    const double good[3] = {0, 3, 8}, frac[3] = {0, 3.7, 8}, rows[4] = {0, 3, 3, 8};
    dg_dtype floats[3] = {DG_F64, DG_F32, DG_BF16};
    for (int i = 0; i < 3; i++) {
        dg_tensor *t = tensor_of(floats[i], 1, (int64_t[]){3}, frac);
        check_err_all(3, dg_kda_seqlens(t, 8, out, 8, &n), DG_ERR_DTYPE,
                      "float cu_seqlens are refused, not truncated", "integer",
                      dg_dtype_name(floats[i]), NULL);
        dg_tensor_free(&t);
    }
    dg_tensor *t = tensor_of(DG_I64, 2, (int64_t[]){2, 2}, rows);
    check_err_all(3, dg_kda_seqlens(t, 8, out, 8, &n), DG_ERR_SHAPE, "2-d cu_seqlens", "1-d", NULL);
    dg_tensor_free(&t);
    t = tensor_of(DG_I64, 1, (int64_t[]){1}, good);
    check_err_all(3, dg_kda_seqlens(t, 8, out, 8, &n), DG_ERR_SHAPE, "one entry", "N+1", NULL);
    dg_tensor_free(&t);
    static const struct {
        double v[4];
        int n;
        const char *needle;
    } bad[] = {{{1, 3, 8}, 3, "start at 0"},
               {{0, 5, 3, 8}, 4, "non-decreasing"},
               {{0, 3, 7}, 3, "end at T=8"},
               {{0, -1, 8}, 3, "non-decreasing"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        t = tensor_of(DG_I64, 1, (int64_t[]){bad[i].n}, bad[i].v);
        check_err_all(3, dg_kda_seqlens(t, 8, out, 8, &n), DG_ERR_ARG, "bad cu_seqlens values",
                      bad[i].needle, NULL);
        dg_tensor_free(&t);
    }
    dg_dtype ints[2] = {DG_I32, DG_I64};
    for (int i = 0; i < 2; i++) {
        t = tensor_of(ints[i], 1, (int64_t[]){3}, good);
        dg_status st = dg_kda_seqlens(t, 8, out, 8, &n);
        CASE(3, dg_check(st == DG_OK && n == 2 && out[0] == 0 && out[1] == 3 && out[2] == 8,
                         "%s cu_seqlens [0,3,8] accepted as 2 sequences", dg_dtype_name(ints[i])));
        dg_tensor_free(&t);
    }
    /* float -> integer conversions saturate (a C cast of these is undefined behaviour) */
    const double wild[6] = {NAN, 1e30, -1e30, INFINITY, 3.9, -3.9};
    t = tensor_of(DG_F64, 1, (int64_t[]){6}, wild);
    for (int i = 0; i < 2; i++) {
        dg_tensor *c = NULL;
        DG_TEST_TRY(dg_to_dtype(g_ctx, t, ints[i], &c));
        double *d = NULL;
        DG_TEST_TRY(dg_tensor_to_f64(c, &d));
        double mx = ints[i] == DG_I32 ? 2147483647.0 : 9223372036854775807.0;
        double mn = ints[i] == DG_I32 ? -2147483648.0 : -9223372036854775808.0;
        CASE(3, dg_check(d[0] == 0 && d[1] == mx && d[2] == mn && d[3] == mx && d[4] == 3 &&
                             d[5] == -3,
                         "f64 -> %s: NaN 0, +-1e30 and inf saturate, 3.9 -> 3, -3.9 -> -3",
                         dg_dtype_name(ints[i])));
        free(d);
        dg_tensor_free(&c);
    }
    dg_tensor_free(&t);
}

/* ---- (4) decay of exactly zero -------------------------------------------------------------- */

enum { ZQ, ZK, ZV, ZG, ZB, ZH0, ZA, ZDT, ZN };

typedef struct zres {
    dg_tensor *o, *ht, *grad[ZN];
} zres;

/* Forward + backward of chunked or recurrent KDA with fixed output gradients. */
/* On ctx (src on the CPU is moved there): activations q, k, v, g, beta in dt, h0, A_log,
 * dt_bias in dt_state (CUDA wants them f32). */
static zres zero_decay_run(dg_ctx *ctx, int chunked, dg_dtype dt, dg_dtype dt_state,
                           dg_tensor *const *src, dg_gate_kind gate, const dg_tensor *do_,
                           const dg_tensor *dht) {
    dg_tensor *in[ZN] = {0};
    for (int i = 0; i < ZN; i++)
        if (src[i]) {
            dg_tensor *c = NULL;
            DG_TEST_TRY(dg_to_dtype(g_ctx, src[i], i <= ZB ? dt : dt_state, &c));
            DG_TEST_TRY(dg_to_device(ctx, c, &in[i]));
            dg_tensor_free(&c);
            dg_tensor_set_requires_grad(in[i], 1);
        }
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    o.chunk_size = 16;
    o.gate = gate;
    o.output_final_state = 1;
    zres r;
    memset(&r, 0, sizeof r);
    dg_tensor *ro = NULL, *rht = NULL;
    DG_TEST_TRY((chunked ? dg_kda_chunk : dg_kda_recurrent)(
        ctx, in[ZQ], in[ZK], in[ZV], in[ZG], in[ZB], in[ZA], in[ZDT], in[ZH0], &o, &ro, &rht));
    dg_tensor *dd = NULL, *dh = NULL, *c1 = NULL, *c2 = NULL;
    DG_TEST_TRY(dg_to_dtype(g_ctx, (dg_tensor *)do_, dt, &c1));
    DG_TEST_TRY(dg_to_dtype(g_ctx, (dg_tensor *)dht, dg_tensor_dtype(rht), &c2));
    DG_TEST_TRY(dg_to_device(ctx, c1, &dd));
    DG_TEST_TRY(dg_to_device(ctx, c2, &dh));
    dg_tensor_free(&c1);
    dg_tensor_free(&c2);
    dg_tensor *outs[2] = {ro, rht};
    const dg_tensor *grads[2] = {dd, dh};
    DG_TEST_TRY(dg_tape_backward_multi(ctx, 2, outs, grads));
    /* results as f64 on the CPU */
    dg_tensor *res[2 + ZN] = {ro, rht};
    for (int i = 0; i < ZN; i++)
        res[2 + i] = in[i] ? (dg_tensor *)dg_tensor_grad(in[i]) : NULL;
    dg_tensor **dst[2 + ZN] = {&r.o, &r.ht};
    for (int i = 0; i < ZN; i++)
        dst[2 + i] = &r.grad[i];
    for (int i = 0; i < 2 + ZN; i++)
        if (res[i]) {
            dg_tensor *h = NULL;
            DG_TEST_TRY(dg_to_device(g_ctx, res[i], &h));
            DG_TEST_TRY(dg_to_dtype(g_ctx, h, DG_F64, dst[i]));
            dg_tensor_free(&h);
        }
    dg_tensor_free(&ro);
    dg_tensor_free(&rht);
    dg_tape_reset();
    for (int i = 0; i < ZN; i++)
        dg_tensor_free(&in[i]);
    dg_tensor_free(&dd);
    dg_tensor_free(&dh);
    return r;
}

static void zres_free(zres *r) {
    dg_tensor_free(&r->o);
    dg_tensor_free(&r->ht);
    for (int i = 0; i < ZN; i++)
        dg_tensor_free(&r->grad[i]);
}

static int all_finite(const dg_tensor *t) {
    double *d = NULL;
    if (!t || dg_tensor_to_f64(t, &d) != DG_OK)
        return 0;
    int ok = 1;
    for (int64_t i = 0; i < dg_tensor_numel(t); i++)
        ok &= isfinite(d[i]) != 0;
    free(d);
    return ok;
}

static void test_zero_decay(void) {
    const int B = 1, T = 40, H = 2, K = 8, V = 4;
    const int64_t qs[4] = {B, T, H, K}, vs[4] = {B, T, H, V}, bs[3] = {B, T, H},
                  hs[4] = {B, H, K, V}, as[1] = {H}, ds[1] = {H * K};
    static const char *const gname[ZN] = {"dq",    "dk",  "dv",     "dg",
                                          "dbeta", "dh0", "dA_log", "ddt_bias"};
    /* 0: a whole token with g = -inf mid-chunk; 1: single key dims at -inf, at chunk starts and
     * ends too; 2: saturated finite gates (-1e6); 3: the KDA gate saturating (z = 1e8) */
    for (int cs = 0; cs < 4; cs++) {
        dg_tensor *src[ZN] = {0};
        src[ZQ] = dg_test_randn(g_ctx, DG_F64, 4, qs, 11);
        src[ZK] = dg_test_rand(g_ctx, DG_F64, 4, qs, 12, -0.4, 0.4);
        src[ZV] = dg_test_randn(g_ctx, DG_F64, 4, vs, 13);
        src[ZB] = dg_test_rand(g_ctx, DG_F64, 3, bs, 14, 0.1, 0.9);
        src[ZH0] = dg_test_randn(g_ctx, DG_F64, 4, hs, 15);
        double *gv = NULL;
        dg_tensor *g0 = cs == 3 ? dg_test_randn(g_ctx, DG_F64, 4, qs, 16)
                                : dg_test_rand(g_ctx, DG_F64, 4, qs, 16, -0.6, -0.01);
        DG_TEST_TRY(dg_tensor_to_f64(g0, &gv));
        dg_tensor_free(&g0);
        const int row = H * K;
        if (cs == 0)
            for (int e = 0; e < row; e++)
                gv[5 * row + e] = -INFINITY;
        if (cs == 1 || cs == 2) {
            const int at[5] = {0, 15, 16, 22, 39};
            for (int i = 0; i < 5; i++)
                gv[at[i] * row + (i * 3) % row] = cs == 1 ? -INFINITY : -1e6;
        }
        if (cs == 3) {
            gv[7 * row + 3] = 1e8;
            gv[20 * row + 9] = 1e8;
            src[ZA] = dg_test_rand(g_ctx, DG_F64, 1, as, 17, 0.0, 1.0);
            src[ZDT] = dg_test_rand(g_ctx, DG_F64, 1, ds, 18, -0.5, 0.5);
        }
        DG_TEST_TRY(dg_tensor_from_f64(g_ctx, DG_F64, 4, qs, gv, &src[ZG]));
        free(gv);
        dg_gate_kind gate = cs == 3 ? DG_GATE_KDA : DG_GATE_NONE;
        dg_tensor *do_ = dg_test_randn(g_ctx, DG_F64, 4, vs, 19);
        dg_tensor *dht = dg_test_randn(g_ctx, DG_F64, 4, hs, 20);
        static const char *const label[4] = {"g=-inf token", "g=-inf dims", "g=-1e6",
                                             "saturated KDA gate"};
        zres ref = zero_decay_run(g_ctx, 0, DG_F64, DG_F64, src, gate, do_, dht);
        int ref_finite = all_finite(ref.o) && all_finite(ref.ht);
        CASE(4, dg_check(ref_finite, "%s: the recurrence is finite", label[cs]));
        dg_dtype dts[2] = {DG_F64, DG_F32};
        for (int p = 0; p < 2; p++) {
            double tol = dts[p] == DG_F64 ? 1e-10 : 1e-5;
            zres got = zero_decay_run(g_ctx, 1, dts[p], dts[p], src, gate, do_, dht);
            zres want = dts[p] == DG_F64
                            ? ref
                            : zero_decay_run(g_ctx, 0, DG_F32, DG_F32, src, gate, do_, dht);
            char nm[128];
            snprintf(nm, sizeof nm, "%s %s: chunked o", label[cs], dg_dtype_name(dts[p]));
            CASE(4, dg_check(all_finite(got.o) && all_finite(got.ht), "%s and ht are finite", nm));
            CASE(4, dg_check_tensor_rel(nm, got.o, want.o, tol));
            snprintf(nm, sizeof nm, "%s %s: chunked ht", label[cs], dg_dtype_name(dts[p]));
            CASE(4, dg_check_tensor_rel(nm, got.ht, want.ht, tol));
            for (int i = 0; i < ZN; i++) {
                if (!want.grad[i])
                    continue;
                snprintf(nm, sizeof nm, "%s %s: chunked %s", label[cs], dg_dtype_name(dts[p]),
                         gname[i]);
                CASE(4, dg_check(got.grad[i] && all_finite(got.grad[i]), "%s is finite", nm));
                if (got.grad[i])
                    CASE(4, dg_check_tensor_rel(nm, got.grad[i], want.grad[i], tol));
            }
            zres_free(&got);
            if (dts[p] != DG_F64)
                zres_free(&want);
        }
        zres_free(&ref);
        dg_tensor_free(&do_);
        dg_tensor_free(&dht);
        for (int i = 0; i < ZN; i++)
            dg_tensor_free(&src[i]);
    }
}

/* ---- (7) the op runner ---------------------------------------------------------------------- */

/* DIR/name.npy of dtype dt filled from a deterministic pattern scaled into [lo, hi]. */
static void write_npy(const char *dir, const char *name, dg_dtype dt, int ndim,
                      const int64_t *shape, double lo, double hi, uint64_t seed) {
    dg_tensor *t = dg_test_rand(g_ctx, dt, ndim, shape, seed, lo, hi);
    char p[400];
    snprintf(p, sizeof p, "%s/%s.npy", dir, name);
    DG_TEST_TRY(dg_npy_save(p, t));
    dg_tensor_free(&t);
}

static void kda_inputs(const char *dir, dg_dtype dt, int with_do) {
    mkdir(dir, 0700);
    const int64_t qs[4] = {1, 20, 2, 4}, vs[4] = {1, 20, 2, 4}, bs[3] = {1, 20, 2};
    write_npy(dir, "q", dt, 4, qs, -1, 1, 1);
    write_npy(dir, "k", dt, 4, qs, -1, 1, 2);
    write_npy(dir, "v", dt, 4, vs, -1, 1, 3);
    write_npy(dir, "g", dt, 4, qs, -0.5, -0.01, 4);
    write_npy(dir, "beta", dt, 3, bs, 0.1, 0.9, 5);
    if (with_do)
        write_npy(dir, "do", dt, 4, vs, -1, 1, 6);
}

static dg_dtype npy_dtype(const char *dir, const char *name) {
    char p[400];
    snprintf(p, sizeof p, "%s/%s.npy", dir, name);
    dg_tensor *t = NULL;
    if (dg_npy_load(g_ctx, p, &t) != DG_OK)
        return (dg_dtype)-1;
    dg_dtype dt = dg_tensor_dtype(t);
    dg_tensor_free(&t);
    return dt;
}

static void test_op_runner(void) {
    char in[300], out[300], out64[300], err[4096];
    tmp_path(in, sizeof in, "kda_in");
    tmp_path(out, sizeof out, "kda_out");
    tmp_path(out64, sizeof out64, "kda_out64");
    kda_inputs(in, DG_F32, 1);
    /* f32 files computed in f64: outputs come back f32, equal to the f64 outputs rounded */
    char *argv[] = {"deltagrad", "kda", "--in",    in,   "--out", out,
                    "--dtype",   "f64", "--quiet", NULL, NULL,    NULL};
    int rc = run_binary(argv, err, sizeof err);
    CASE(7, dg_check(rc == 0, "deltagrad kda on f32 files exits 0 (%d: %.200s)", rc, err));
    static const char *const files[] = {"o", "ht", "dq", "dk", "dv", "dg", "dbeta"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++)
        CASE(7, dg_check(npy_dtype(out, files[i]) == DG_F32, "%s.npy keeps the inputs' f32",
                         files[i]));
    /* exactly the files --help promises: no h0.npy, so no dh0.npy; no gate, no dA_log */
    int extra = 0, n_files = 0;
    DIR *d = opendir(out);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        n_files++;
        int known = 0;
        for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.npy", files[i]);
            known |= !strcmp(nm, e->d_name);
        }
        if (!known) {
            printf("  unexpected output file %s\n", e->d_name);
            extra++;
        }
    }
    if (d)
        closedir(d);
    CASE(7, dg_check(extra == 0 && n_files == 7, "OUT holds exactly o ht dq dk dv dg dbeta (%d)",
                     n_files));
    argv[5] = out64;
    argv[9] = "--out-dtype";
    argv[10] = "f64";
    rc = run_binary(argv, err, sizeof err);
    CASE(7, dg_check(rc == 0 && npy_dtype(out64, "o") == DG_F64,
                     "--out-dtype f64 writes f64 (exit %d)", rc));
    char p1[400], p2[400];
    snprintf(p1, sizeof p1, "%s/o.npy", out);
    snprintf(p2, sizeof p2, "%s/o.npy", out64);
    dg_tensor *a = NULL, *b = NULL, *b32 = NULL;
    if (dg_npy_load(g_ctx, p1, &a) == DG_OK && dg_npy_load(g_ctx, p2, &b) == DG_OK &&
        dg_to_dtype(g_ctx, b, DG_F32, &b32) == DG_OK)
        CASE(7, dg_check_tensor_close("o.npy (f32) == f64 result rounded to f32", a, b32, 0, 0));
    else
        CASE(7, dg_check(0, "reading o.npy back: %s", dg_last_error()));
    dg_tensor_free(&a), dg_tensor_free(&b), dg_tensor_free(&b32);

    /* a NaN in v: the outputs are written but the command fails, naming them */
    char nin[300], nout[300];
    tmp_path(nin, sizeof nin, "kda_nan_in");
    tmp_path(nout, sizeof nout, "kda_nan_out");
    kda_inputs(nin, DG_F64, 0);
    const int64_t vs[4] = {1, 20, 2, 4};
    double *vals = calloc(160, sizeof *vals);
    vals[17] = NAN;
    dg_tensor *v = tensor_of(DG_F64, 4, vs, vals);
    free(vals);
    char vp[400];
    snprintf(vp, sizeof vp, "%s/v.npy", nin);
    DG_TEST_TRY(dg_npy_save(vp, v));
    dg_tensor_free(&v);
    char *nargv[] = {"deltagrad", "kda", "--in", nin, "--out", nout, "--quiet", NULL, NULL};
    rc = run_binary(nargv, err, sizeof err);
    REJ(7, dg_check(rc == 3 && strstr(err, "o.npy") && strstr(err, "non-finite"),
                    "NaN outputs: exit 3 naming o.npy (%d: %.200s)", rc, err));
    nargv[7] = "--allow-nonfinite";
    rc = run_binary(nargv, err, sizeof err);
    CASE(7, dg_check(rc == 0 && strstr(err, "allowed"),
                     "--allow-nonfinite: exit 0 with a note (%d: %.200s)", rc, err));
    /* f64 values beyond f32's range: finite in f64, Inf once written as f32 */
    char bin[300], bout[300];
    tmp_path(bin, sizeof bin, "kda_big_in");
    tmp_path(bout, sizeof bout, "kda_big_out");
    kda_inputs(bin, DG_F64, 0);
    write_npy(bin, "v", DG_F64, 4, vs, 1e300, 1e301, 9);
    char *bargv[] = {"deltagrad", "kda",         "--in", bin,       "--out",
                     bout,        "--out-dtype", "f32",  "--quiet", NULL};
    rc = run_binary(bargv, err, sizeof err);
    REJ(7, dg_check(rc == 3 && strstr(err, "o.npy"),
                    "values that overflow the written f32 are reported (%d: %.200s)", rc, err));

    /* float cu_seqlens through the runner: refused naming the file, nothing written */
    char cin[300], cout[300];
    tmp_path(cin, sizeof cin, "kda_cu_in");
    tmp_path(cout, sizeof cout, "kda_cu_out");
    kda_inputs(cin, DG_F64, 0);
    dg_tensor *cu = tensor_of(DG_F64, 1, (int64_t[]){3}, (double[]){0, 7.5, 20});
    snprintf(vp, sizeof vp, "%s/cu_seqlens.npy", cin);
    DG_TEST_TRY(dg_npy_save(vp, cu));
    dg_tensor_free(&cu);
    char *cargv[] = {"deltagrad", "kda", "--in", cin, "--out", cout, "--quiet", NULL};
    rc = run_binary(cargv, err, sizeof err);
    snprintf(vp, sizeof vp, "%s/o.npy", cout);
    REJ(3, dg_check(rc == 1 && strstr(err, "cu_seqlens") && strstr(err, "integer") &&
                        access(vp, F_OK) != 0,
                    "deltagrad kda with float cu_seqlens.npy: exit 1, no o.npy (%d: %.200s)", rc,
                    err));
    /* the help names every file and when it is written */
    char *hargv[] = {"deltagrad", "kda", "--help", NULL};
    char hpath[300];
    tmp_path(hpath, sizeof hpath, "help.txt");
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(hpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 1);
        execv(DG_BINARY_DIR "/deltagrad", hargv);
        _exit(127);
    }
    waitpid(pid, NULL, 0);
    FILE *f = fopen(hpath, "r");
    char help[8192];
    size_t got = f ? fread(help, 1, sizeof help - 1, f) : 0;
    help[got] = 0;
    if (f)
        fclose(f);
    static const char *const promised[] = {
        "o.npy",      "ht.npy",       "dq dk dv dg dbeta", "dh0.npy",
        "dA_log.npy", "ddt_bias.npy", "--allow-nonfinite", "--out-dtype"};
    int all = 1;
    for (size_t i = 0; i < sizeof promised / sizeof *promised; i++)
        if (!strstr(help, promised[i])) {
            printf("  --help lacks '%s'\n", promised[i]);
            all = 0;
        }
    CASE(7, dg_check(all, "deltagrad kda --help names every output file and the flags"));
}

/* ---- (9) out of memory: the error names the allocation -------------------------------------- */

static void test_oom_message(void) {
#if defined(__SANITIZE_ADDRESS__)
    printf("note: under AddressSanitizer a 256 TiB allocation aborts; the out-of-memory message "
           "case runs in the plain build\n");
#else
    dg_tensor *t = NULL;
    /* 256 TiB of f32: more than the address space, so even an overcommitting kernel refuses */
    const int64_t huge[2] = {(int64_t)1 << 23, (int64_t)1 << 23};
    check_err_all(9, dg_tensor_new(g_ctx, DG_F32, 2, huge, &t), DG_ERR_NOMEM,
                  "an allocation that cannot succeed names the tensor", "out of memory",
                  "[8388608,8388608]", "281474976710656 bytes", "cpu", NULL);
    g_rejects[9]--; /* a fault, not an input */
    g_faults[9]++;
#endif
}

/* ---- main ----------------------------------------------------------------------------------- */

/* gpu mode: class 4 on CUDA. The same inputs as test_zero_decay (without the -1e6 case, which
 * differs from the -inf one only before the floor), chunked on the device in f32 and bf16
 * against the f64 recurrence on the CPU of the same (for bf16: bf16-rounded) inputs. */
static void test_zero_decay_gpu(dg_ctx *gpu) {
    const int B = 1, T = 40, H = 2, K = 16, V = 16;
    const int64_t qs[4] = {B, T, H, K}, vs[4] = {B, T, H, V}, bs[3] = {B, T, H},
                  hs[4] = {B, H, K, V}, as[1] = {H}, ds[1] = {H * K};
    static const char *const label[3] = {"g=-inf token", "g=-inf dims", "saturated KDA gate"};
    for (int cs = 0; cs < 3; cs++)
        for (int bf = 0; bf < 2; bf++) {
            const dg_dtype act = bf ? DG_BF16 : DG_F32;
            dg_tensor *src[ZN] = {0};
            src[ZQ] = dg_test_randn(g_ctx, DG_F64, 4, qs, 31);
            src[ZK] = dg_test_rand(g_ctx, DG_F64, 4, qs, 32, -0.4, 0.4);
            src[ZV] = dg_test_randn(g_ctx, DG_F64, 4, vs, 33);
            src[ZB] = dg_test_rand(g_ctx, DG_F64, 3, bs, 34, 0.1, 0.9);
            src[ZH0] = dg_test_randn(g_ctx, DG_F64, 4, hs, 35);
            double *gv = NULL;
            dg_tensor *g0 = cs == 2 ? dg_test_randn(g_ctx, DG_F64, 4, qs, 36)
                                    : dg_test_rand(g_ctx, DG_F64, 4, qs, 36, -0.6, -0.01);
            DG_TEST_TRY(dg_tensor_to_f64(g0, &gv));
            dg_tensor_free(&g0);
            const int row = H * K;
            if (cs == 0)
                for (int e = 0; e < row; e++)
                    gv[5 * row + e] = -INFINITY;
            if (cs == 1) {
                const int at[5] = {0, 15, 16, 22, 39};
                for (int i = 0; i < 5; i++)
                    gv[at[i] * row + (i * 7) % row] = -INFINITY;
            }
            if (cs == 2) {
                gv[7 * row + 3] = 1e8;
                gv[20 * row + 9] = 1e8;
                src[ZA] = dg_test_rand(g_ctx, DG_F64, 1, as, 37, 0.0, 1.0);
                src[ZDT] = dg_test_rand(g_ctx, DG_F64, 1, ds, 38, -0.5, 0.5);
            }
            DG_TEST_TRY(dg_tensor_from_f64(g_ctx, DG_F64, 4, qs, gv, &src[ZG]));
            free(gv);
            /* round the activations to the device dtype first, so both sides see one input */
            for (int i = ZQ; i <= ZB; i++) {
                dg_tensor *r = NULL, *back = NULL;
                DG_TEST_TRY(dg_to_dtype(g_ctx, src[i], act, &r));
                DG_TEST_TRY(dg_to_dtype(g_ctx, r, DG_F64, &back));
                dg_tensor_free(&r);
                dg_tensor_free(&src[i]);
                src[i] = back;
            }
            const dg_gate_kind gate = cs == 2 ? DG_GATE_KDA : DG_GATE_NONE;
            dg_tensor *do_ = dg_test_randn(g_ctx, DG_F64, 4, vs, 39);
            dg_tensor *dht = dg_test_randn(g_ctx, DG_F64, 4, hs, 40);
            zres ref = zero_decay_run(g_ctx, 0, DG_F64, DG_F64, src, gate, do_, dht);
            zres got = zero_decay_run(gpu, 1, act, DG_F32, src, gate, do_, dht);
            /* f32: the CUDA f32 path's bound against f64; bf16 inputs run the TF32 tensor-core
             * path (operands rounded to 2^-11), bound 1e-2 as the other bf16 CUDA checks */
            const double tol = bf ? 1e-2 : 1e-5;
            static const char *const gname[ZN] = {"dq",    "dk",  "dv",     "dg",
                                                  "dbeta", "dh0", "dA_log", "ddt_bias"};
            char nm[160];
            snprintf(nm, sizeof nm, "CUDA %s %s: chunked o", dg_dtype_name(act), label[cs]);
            CASE(4, dg_check(all_finite(got.o) && all_finite(got.ht), "%s and ht are finite", nm));
            CASE(4, dg_check_tensor_rel(nm, got.o, ref.o, tol));
            snprintf(nm, sizeof nm, "CUDA %s %s: chunked ht", dg_dtype_name(act), label[cs]);
            CASE(4, dg_check_tensor_rel(nm, got.ht, ref.ht, tol));
            for (int i = 0; i < ZN; i++) {
                if (!ref.grad[i])
                    continue;
                snprintf(nm, sizeof nm, "CUDA %s %s: chunked %s", dg_dtype_name(act), label[cs],
                         gname[i]);
                CASE(4, dg_check(got.grad[i] && all_finite(got.grad[i]), "%s is finite", nm));
                if (got.grad[i])
                    CASE(4, dg_check_tensor_rel(nm, got.grad[i], ref.grad[i], tol));
            }
            zres_free(&ref);
            zres_free(&got);
            dg_tensor_free(&do_);
            dg_tensor_free(&dht);
            for (int i = 0; i < ZN; i++)
                dg_tensor_free(&src[i]);
        }
}

static void gpu_cases(dg_ctx *cpu) {
    g_ctx = cpu;
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    test_zero_decay_gpu(gpu);
    printf("class 4 (zero decay) on CUDA: %d cases\n", g_cases[4]);
    /* class 9 on CUDA: an allocation the device cannot hold names itself */
    dg_tensor *t = NULL;
    const int64_t huge[2] = {(int64_t)1 << 23, (int64_t)1 << 23};
    check_err_all(9, dg_tensor_new(gpu, DG_F32, 2, huge, &t), DG_ERR_NOMEM,
                  "a CUDA allocation that cannot succeed names the tensor", "out of memory",
                  "[8388608,8388608]", "281474976710656 bytes", "cuda", NULL);
    dg_ctx_free(&gpu);
    g_ctx = NULL;
}

static void cpu_cases(dg_ctx *cpu) {
    signal(SIGALRM, on_alarm);
    alarm(600);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/dg_test_harden_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        exit(1);
    }
    g_ctx = cpu;
    test_special_files();
    test_numeric_parser();
    test_numeric_flags();
    test_index_arrays();
    test_zero_decay();
    test_op_runner();
    test_checkpoints();
    test_run_dirs();
    test_faults();
    test_oom_message();
    g_ctx = NULL;
    nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    static const char *const names[] = {"",           "special files", "numeric flags", "indices",
                                        "zero decay", "checkpoints",   "run dirs",      "op runner",
                                        "",           "faults"};
    int total[3] = {0, 0, 0};
    for (int c = 1; c < (int)(sizeof names / sizeof *names); c++)
        if (g_cases[c]) {
            printf("class %d (%s): %d cases, %d inputs rejected, %d faults injected\n", c, names[c],
                   g_cases[c], g_rejects[c], g_faults[c]);
            total[0] += g_cases[c], total[1] += g_rejects[c], total[2] += g_faults[c];
        }
    printf("all classes: %d cases, %d inputs rejected, %d faults injected\n", total[0], total[1],
           total[2]);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "harden", cpu_cases, gpu_cases); }

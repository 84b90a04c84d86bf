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
#define _XOPEN_SOURCE 700
#include "tests/harness.h"
#include "tools/commands.h"
#include "train/args.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/model.h"
#include "train/train.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define KJV DG_SOURCE_DIR "/data/kjv.txt"

/* ---- helpers -------------------------------------------------------------------------------- */

static char g_tmp[256];
static dg_ctx *g_ctx;
static int g_cases[16]; /* cases run per class, for the summary */

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

/* The status must be `want` and the message must hold every needle (NULL ends the list). */
static int check_err_all(int cls, dg_status s, dg_status want, const char *what, ...) {
    g_cases[cls]++;
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
 * N); stderr text into err[n]. */
static int run_binary(char **argv, char *err, size_t n) {
    char path[300];
    tmp_path(path, sizeof path, "bin_stderr.txt");
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int nul = open("/dev/null", O_WRONLY);
        dup2(fd, 2);
        dup2(nul, 1);
        argv[0] = DG_BINARY_DIR "/deltagrad";
        execv(argv[0], argv);
        _exit(127);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    FILE *f = fopen(path, "r");
    size_t got = f ? fread(err, 1, n - 1, f) : 0;
    err[got] = 0;
    if (f)
        fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
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
    CASE(1, dg_check(rc == 1, "deltagrad sample --ckpt <FIFO> exits 1 (got %d)", rc));
    char *targv[] = {"train", "--data", fifo, "--no-out", "--steps", "1", NULL};
    rc = dg_cmd_train(6, targv);
    CASE(1, dg_check(rc == 1, "deltagrad train --data <FIFO> exits 1 (got %d)", rc));
    /* a FIFO where the run's log.csv goes: refused, not opened for append (which would block) */
    char run[300], csv[320];
    tmp_path(run, sizeof run, "fifo_run");
    mkdir(run, 0700);
    snprintf(csv, sizeof csv, "%s/log.csv", run);
    mkfifo(csv, 0600);
    char *cargv[] = {"train", "--data",  KJV,  "--max-bytes", "20000", "--out", run, "--steps",
                     "1",     "--batch", "1",  "--seq-len",   "16",    "--d",   "8", "--heads",
                     "1",     "--head-dim", "8", "--inter", "8", "--chunk", "16", NULL};
    rc = dg_cmd_train(23, cargv);
    CASE(1, dg_check(rc == 1, "deltagrad train with a FIFO as DIR/log.csv exits 1 (got %d)", rc));
    if (have_sock)
        close(sfd);
}

/* ---- (2) numeric flags ---------------------------------------------------------------------- */

typedef struct num_case {
    const char *text;
    int ok;      /* accepted? */
    double want; /* the value when accepted */
} num_case;

static void test_numeric_parser(void) {
    /* integers in [1, 100] */
    static const num_case ints[] = {
        {"16", 1, 16},   {"1", 1, 1},     {"100", 1, 100},   {"+7", 1, 7},      {"16abc", 0, 0},
        {"abc", 0, 0},   {"", 0, 0},      {" 5", 0, 0},      {"5 ", 0, 0},      {"0x10", 0, 0},
        {"1e3", 0, 0},   {"1.0", 0, 0},   {"0", 0, 0},       {"101", 0, 0},     {"-1", 0, 0},
        {"-", 0, 0},     {"--5", 0, 0},   {"99999999999999999999", 0, 0},       {"5\n", 0, 0},
        {"\t3", 0, 0}};
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
        {"-5", 1, -5},     {"-2.5", 1, -2.5}, {"-1e-3", 1, -1e-3}, {"-.5", 1, -0.5},
        {"0", 0, 0},       {"-0", 0, 0},      {"-5.0001", 0, 0},   {"nan", 0, 0},
        {"-inf", 0, 0},    {"inf", 0, 0},     {"-1e999", 0, 0},    {"-0x1p1", 0, 0},
        {"-1abc", 0, 0},   {"", 0, 0},        {".", 0, 0},         {"-", 0, 0},
        {"-1e", 0, 0},     {" -1", 0, 0},     {"-1 ", 0, 0},       {"e5", 0, 0}};
    for (size_t i = 0; i < sizeof reals / sizeof *reals; i++) {
        double v = 99;
        dg_status st = dg_arg_f64("--lower-bound", reals[i].text, -5.0, 0.0, DG_ARG_HI_OPEN, &v);
        if (reals[i].ok)
            CASE(2, dg_check(st == DG_OK && v == reals[i].want, "--lower-bound '%s' -> %g",
                             reals[i].text, v));
        else
            check_err_all(2, st, DG_ERR_ARG, "a number flag refuses a bad value",
                          "--lower-bound", "[-5, 0)", NULL);
    }
    double v = 0;
    check_err_all(2, dg_arg_f64("--lr", "0", 0.0, INFINITY, DG_ARG_LO_OPEN, &v), DG_ERR_ARG,
                  "an open lower bound excludes the bound", "--lr", "> 0", NULL);
    check_err_all(2, dg_arg_f64("--x", "1e-400", -1.0, 1.0, 0, &v), DG_ERR_ARG,
                  "a value that underflows to zero is refused", "--x", NULL);
    int c = 0;
    static const int chunks[3] = {16, 32, 64};
    CASE(2, dg_check(dg_arg_choice("--chunk", "32", chunks, 3, &c) == DG_OK && c == 32,
                     "--chunk 32 is a valid choice"));
    check_err_all(2, dg_arg_choice("--chunk", "48", chunks, 3, &c), DG_ERR_ARG,
                  "--chunk 48 is not a choice", "--chunk", "one of 16, 32, 64", NULL);
    check_err_all(2, dg_arg_choice("--chunk", "16abc", chunks, 3, &c), DG_ERR_ARG,
                  "--chunk 16abc is refused", "16abc", NULL);
}

/* Every numeric flag of `train`, `sample`, `kda` and `bench` refuses trailing garbage, no digits,
 * an empty value and an out-of-range value, with exit 2 and a message naming the flag. */
typedef struct flag_case {
    const char *flag, *out_of_range;
} flag_case;

static void test_numeric_flags(void) {
    static const flag_case train_flags[] = {
        {"--max-bytes", "-1"},     {"--steps", "0"},         {"--stop-at", "0"},
        {"--seed", "-1"},          {"--batch", "65537"},     {"--seq-len", "1"},
        {"--accum", "0"},          {"--lr", "0"},            {"--warmup", "-1"},
        {"--min-lr-frac", "1.5"},  {"--beta1", "1"},         {"--beta2", "-0.1"},
        {"--adam-eps", "0"},       {"--weight-decay", "-1"}, {"--clip", "0"},
        {"--d", "0"},              {"--layers", "257"},      {"--heads", "0"},
        {"--v-heads", "0"},        {"--head-dim", "257"},    {"--head-v-dim", "0"},
        {"--inter", "0"},          {"--chunk", "48"},        {"--lower-bound", "0"},
        {"--eval-every", "-1"},    {"--eval-batches", "0"},  {"--sample-every", "-2"},
        {"--sample-tokens", "-1"}, {"--temperature", "-1"},  {"--top-k", "257"},
        {"--ckpt-every", "-1"},    {"--log-every", "0"},     {"--threads", "-1"}};
    static const flag_case sample_flags[] = {{"--tokens", "-1"},     {"--temperature", "-0.5"},
                                             {"--top-k", "300"},     {"--seed", "-3"},
                                             {"--context", "0"},     {"--threads", "5000"}};
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
                CASE(2, dg_check(rc == 2 && strstr(err, fl[i].flag) && strstr(err, "expected"),
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
        {"bench", "core", "--reps", "5x", NULL, "--reps"},
        {"bench", "core", "--warmup", "-1", NULL, "--warmup"},
        {"bench", "core", "--m", "abc", NULL, "--m"},
        {"bench", "core", "--copy-mib", "0", NULL, "--copy-mib"},
        {"bench", "core", "--peak-tflops", "inf", NULL, "--peak-tflops"},
        {"bench", "core", "--sizes", "64,1x", NULL, "--sizes"},
        {"bench", "kda", "--reps", "3x", NULL, "--reps"},
        {"bench", "kda", "--reps", "65", NULL, "--reps"}};
    for (size_t i = 0; i < sizeof tool_cases / sizeof *tool_cases; i++) {
        char *argv[12] = {"deltagrad"};
        int k = 1;
        for (int j = 0; j < 5 && tool_cases[i][j]; j++)
            argv[k++] = (char *)tool_cases[i][j];
        if (!strcmp(tool_cases[i][0], "kda")) {
            argv[k++] = "--out";
            argv[k++] = g_tmp;
        }
        argv[k] = NULL;
        int rc = run_binary(argv, err, sizeof err);
        CASE(2, dg_check(rc == 2 && strstr(err, tool_cases[i][5]) && strstr(err, "expected"),
                         "deltagrad %s %s %s '%s' -> exit %d: %.120s", tool_cases[i][0],
                         tool_cases[i][1], tool_cases[i][3],
                         tool_cases[i][4] ? tool_cases[i][4] : tool_cases[i][3], rc, err));
    }
}

/* ---- main ----------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (dg_test_init(argc, argv, "harden"))
        return dg_test_skip("the hardening cases are host-only");
    signal(SIGALRM, on_alarm);
    alarm(600);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/dg_test_harden_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &g_ctx));
    test_special_files();
    test_numeric_parser();
    test_numeric_flags();
    dg_ctx_free(&g_ctx);
    nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    static const char *const names[] = {"",        "special files", "numeric flags",
                                        "indices", "zero decay",    "checkpoints",
                                        "run dirs", "op runner",    "",
                                        "faults"};
    for (int c = 1; c < (int)(sizeof names / sizeof *names); c++)
        if (g_cases[c])
            printf("class %d (%s): %d cases\n", c, names[c], g_cases[c]);
    return dg_test_finish();
}

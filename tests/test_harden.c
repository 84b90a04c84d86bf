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

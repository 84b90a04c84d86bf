/*
 * tools/cli.h -- the one argument parser of every `deltagrad` command, on getopt_long.
 *
 * Every command accepts `--flag value` and `--flag=value`, `-h` / `--help` (its help text) and
 * `--version` (what `deltagrad version` prints). A flag must be spelled in full (getopt_long's
 * abbreviations are refused: `--chunk` is not `--chunk-size`). An unknown flag, a missing value,
 * a value given to a switch and a stray positional argument are usage errors: one line naming the
 * flag and what it expects, then the pointer to --help, and exit code 2.
 *
 * A command lists its flags and loops:
 *     static const dg_cli_flag flags[] = {{"--in", "DIR"}, {"--quiet", NULL}, ...};
 *     dg_cli c;
 *     dg_cli_init(&c, "kda", usage, flags, DG_CLI_N(flags), argc, argv);
 *     const char *f, *v;
 *     int r;
 *     while ((r = dg_cli_next(&c, &f, &v)) == DG_CLI_FLAG) {
 *         if (!strcmp(f, "--in")) ...          (f is the table's spelling, v its value or NULL)
 *     }
 *     if (r != DG_CLI_END)
 *         return r;                          (0 after --help / --version, 2 after an error)
 * argv[0] is the command's name; parsing starts at argv[1].
 */
#ifndef DG_TOOLS_CLI_H
#define DG_TOOLS_CLI_H

#include <getopt.h>
#include <stdio.h>

#define DG_CLI_MAX_FLAGS 96
#define DG_CLI_N(a) ((int)(sizeof(a) / sizeof *(a)))

/* One flag: its full spelling with the dashes, and for a flag that takes a value, what the value
 * is (shown in "needs a value" errors, e.g. "DIR", "16, 32 or 64"); NULL for a switch. */
typedef struct dg_cli_flag {
    const char *name;
    const char *value;
} dg_cli_flag;

typedef struct dg_cli {
    const char *cmd; /* "train", "bench kda": names the command in every message */
    void (*help)(FILE *f);
    const dg_cli_flag *flags;
    int n_flags;
    int argc;
    char **argv;
    int quiet; /* check-only parsing: --help and --version print nothing */
    struct option opts[DG_CLI_MAX_FLAGS + 3];
} dg_cli;

enum { DG_CLI_FLAG = -1, DG_CLI_END = -2 };

/* Set up parsing of argv[1..argc-1] (resets getopt's state). n_flags <= DG_CLI_MAX_FLAGS. */
void dg_cli_init(dg_cli *c, const char *cmd, void (*help)(FILE *f), const dg_cli_flag *flags,
                 int n_flags, int argc, char **argv);
/* The next flag: DG_CLI_FLAG with *flag (the table's spelling) and *value (NULL for a switch);
 * DG_CLI_END after the last one; else the exit code after --help / --version (0) or after a
 * usage error it printed (2). */
int dg_cli_next(dg_cli *c, const char **flag, const char **value);
/* The flags of a command whose first word picks what it runs (bench core, gradcheck kda), given
 * before that word (--help, --version): what dg_cli_next returns for the first of them. */
int dg_cli_lead_flag(const char *cmd, void (*help)(FILE *f), int argc, char **argv);
/* Print "deltagrad <cmd>: <flag>: <what>" and the pointer to --help; returns 2. flag may be NULL
 * (a message about the command line as a whole). */
int dg_cli_bad(const dg_cli *c, const char *flag, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Print dg_last_error() (a tools/args.c refusal, which names the flag) the same way; 2. */
int dg_cli_bad_arg(const dg_cli *c);
/* What `deltagrad version` prints. */
void dg_cli_print_version(FILE *f);

#endif /* DG_TOOLS_CLI_H */

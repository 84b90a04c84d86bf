/*
 * tools/cli.c -- the commands' argument parser on getopt_long (see cli.h).
 */
#include "tools/cli.h"
#include "deltagrad.h"

#include <stdarg.h>
#include <string.h>

enum { OPT_HELP = 'h', OPT_VERSION = 0x100, OPT_FLAG0 = 0x200 };

void dg_cli_print_version(FILE *f) {
    /* the library's own version: a shared libdeltagrad found at run time may not be the one
     * this command was built against */
    fprintf(f, "deltagrad %s (commit %s, CUDA architectures: %s)\n", dg_version(),
            dg_build_commit(), dg_build_cuda_archs());
    if (strcmp(dg_version(), DG_VERSION) != 0)
        fprintf(f, "warning: the command was built against deltagrad.h %s\n", DG_VERSION);
    fprintf(f, "CUDA: %s, NCCL: %s, MPI: %s, CUDA devices: %d\n", dg_have_cuda() ? "yes" : "no",
            dg_have_nccl() ? "yes" : "no", dg_have_mpi() ? "yes" : "no", dg_cuda_device_count());
}

void dg_cli_init(dg_cli *c, const char *cmd, void (*help)(FILE *f), const dg_cli_flag *flags,
                 int n_flags, int argc, char **argv) {
    memset(c, 0, sizeof *c);
    c->cmd = cmd;
    c->help = help;
    c->flags = flags;
    c->n_flags = n_flags < DG_CLI_MAX_FLAGS ? n_flags : DG_CLI_MAX_FLAGS;
    c->argc = argc;
    c->argv = argv;
    int k = 0;
    for (int i = 0; i < c->n_flags; i++)
        c->opts[k++] =
            (struct option){flags[i].name + 2, flags[i].value ? required_argument : no_argument,
                            NULL, OPT_FLAG0 + i};
    c->opts[k++] = (struct option){"help", no_argument, NULL, OPT_HELP};
    c->opts[k++] = (struct option){"version", no_argument, NULL, OPT_VERSION};
    c->opts[k] = (struct option){NULL, 0, NULL, 0};
    optind = 0; /* glibc: 0 starts a fresh scan (the check-only parsers run several times) */
    opterr = 0; /* the messages are ours */
}

static int vbad(const dg_cli *c, const char *flag, const char *fmt, va_list ap) {
    fprintf(stderr, "deltagrad %s: ", c->cmd);
    if (flag)
        fprintf(stderr, "%s: ", flag);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(deltagrad %s --help lists the flags)\n", c->cmd);
    return 2;
}

int dg_cli_bad(const dg_cli *c, const char *flag, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = vbad(c, flag, fmt, ap);
    va_end(ap);
    return rc;
}

int dg_cli_bad_arg(const dg_cli *c) { return dg_cli_bad(c, NULL, "%s", dg_last_error()); }

/* The table entry the token `--name` or `--name=value` names exactly, or -1. */
static int lookup(const dg_cli *c, const char *tok) {
    size_t n = strcspn(tok, "=");
    for (int i = 0; i < c->n_flags; i++)
        if (strlen(c->flags[i].name) == n && !strncmp(c->flags[i].name, tok, n))
            return i;
    return -1;
}

int dg_cli_next(dg_cli *c, const char **flag, const char **value) {
    *flag = *value = NULL;
    if (c->argc < 1)
        return DG_CLI_END;
    int at = optind > 0 ? optind : 1; /* the token getopt_long reads next ("+": no reordering) */
    const char *tok = at < c->argc ? c->argv[at] : "";
    int ch = getopt_long(c->argc, c->argv, "+:h", c->opts, NULL);
    if (ch == -1) {
        if (optind < c->argc)
            return dg_cli_bad(c, NULL, "unexpected argument '%s' (every option is a --flag)",
                              c->argv[optind]);
        return DG_CLI_END;
    }
    /* getopt_long takes unambiguous abbreviations; one spelling per flag: the full name only */
    if (ch >= OPT_FLAG0 || ch == OPT_VERSION || (ch == OPT_HELP && strcmp(tok, "-h") != 0)) {
        size_t n = strcspn(tok, "=");
        const char *full = ch >= OPT_FLAG0     ? c->flags[ch - OPT_FLAG0].name
                           : ch == OPT_VERSION ? "--version"
                                               : "--help";
        if (strncmp(tok, "--", 2) != 0 || strlen(full) != n || strncmp(tok, full, n) != 0)
            return dg_cli_bad(c, NULL, "unknown flag '%.*s' (did you mean %s?)", (int)n, tok, full);
    }
    if (ch == OPT_HELP) {
        if (!c->quiet && c->help)
            c->help(stdout);
        return 0;
    }
    if (ch == OPT_VERSION) {
        if (!c->quiet)
            dg_cli_print_version(stdout);
        return 0;
    }
    if (ch >= OPT_FLAG0) {
        *flag = c->flags[ch - OPT_FLAG0].name;
        *value = c->flags[ch - OPT_FLAG0].value ? optarg : NULL;
        return DG_CLI_FLAG;
    }
    if (ch == ':') { /* a flag that takes a value came last */
        int i = lookup(c, tok);
        if (i >= 0)
            return dg_cli_bad(c, c->flags[i].name, "needs a value (%s)", c->flags[i].value);
    }
    /* '?': unknown, ambiguous, or a switch given a value */
    if (strncmp(tok, "--", 2) == 0) {
        int i = lookup(c, tok);
        size_t n = strcspn(tok, "=");
        if ((i >= 0 && !c->flags[i].value) ||
            (tok[n] == '=' && (!strncmp(tok, "--help", n) || !strncmp(tok, "--version", n))))
            return dg_cli_bad(c, NULL, "%.*s takes no value, got '%s'", (int)n, tok, tok + n + 1);
        for (int k = 0; k < c->n_flags; k++) /* an abbreviation getopt_long would take */
            if (n > 2 && !strncmp(c->flags[k].name, tok, n))
                return dg_cli_bad(c, NULL, "unknown flag '%.*s' (did you mean %s?)", (int)n, tok,
                                  c->flags[k].name);
        return dg_cli_bad(c, NULL, "unknown flag '%.*s'", (int)n, tok);
    }
    return dg_cli_bad(c, NULL, "unknown flag '%s'", tok);
}

int dg_cli_lead_flag(const char *cmd, void (*help)(FILE *f), int argc, char **argv) {
    dg_cli cli;
    dg_cli_init(&cli, cmd, help, NULL, 0, argc, argv);
    const char *f, *v;
    return dg_cli_next(&cli, &f, &v);
}

/*
 * tools/deltagrad.c -- the `deltagrad` command: one binary, several subcommands.
 */
#include "deltagrad.h"
#include "tools/cli.h"
#include "tools/commands.h"

#include <stdio.h>
#include <string.h>

static void version_help(FILE *f) {
    fprintf(f, "usage: deltagrad version\n\n"
               "Prints the library's version, its git commit, the CUDA architectures built, and\n"
               "whether this build has CUDA, NCCL and MPI and how many CUDA devices it sees.\n"
               "Every command also takes --version and prints the same.\n");
}

static int cmd_version(int argc, char **argv) {
    dg_cli c;
    dg_cli_init(&c, "version", version_help, NULL, 0, argc, argv);
    const char *f, *v;
    int r = dg_cli_next(&c, &f, &v);
    if (r != DG_CLI_END)
        return r;
    dg_cli_print_version(stdout);
    return 0;
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} g_cmds[] = {
    {"train", dg_cmd_train, "train the toy KDA language model"},
    {"sample", dg_cmd_sample, "generate text from a checkpoint"},
    {"info", dg_cmd_info, "a checkpoint's config.json-style metadata (reference model keys)"},
    {"kda", dg_cmd_kda, "run chunked KDA (forward/backward) on .npy files"},
    {"dplr", dg_cmd_dplr, "run chunked DPLR (forward/backward) on .npy files"},
    {"bench", dg_cmd_bench,
     "benchmarks: `bench core` (matmul, bandwidth), `bench kda`, `bench dplr`, `bench cp` "
     "(under mpirun)"},
    {"explain", dg_cmd_explain, "chunked KDA/DPLR on a seeded example, identities checked"},
    {"gradcheck", dg_cmd_gradcheck,
     "finite-difference check (f64, CPU) of a KDA or DPLR stage or composite on chosen shapes"},
    {"version", cmd_version, "print version and what this build supports"},
};

#define N_CMDS (sizeof g_cmds / sizeof *g_cmds)

static void usage(FILE *f) {
    fprintf(f, "usage: deltagrad <command> [options]\n"
               "       deltagrad help <command>       (the same as deltagrad <command> --help)\n"
               "       deltagrad --version\n\n"
               "Every command takes --flag value or --flag=value, -h / --help and --version.\n\n"
               "commands:\n");
    for (size_t i = 0; i < N_CMDS; i++)
        fprintf(f, "  %-10s %s\n", g_cmds[i].name, g_cmds[i].help);
    fprintf(f, "  %-10s %s\n", "help", "help CMD: the help of command CMD; alone: this list");
}

static int find(const char *name) {
    for (size_t i = 0; i < N_CMDS; i++)
        if (!strcmp(name, g_cmds[i].name))
            return (int)i;
    return -1;
}

static int unknown(const char *name) {
    fprintf(stderr, "deltagrad: unknown command '%s'\n\n", name);
    usage(stderr);
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *a = argv[1];
    if (!strcmp(a, "--help") || !strcmp(a, "-h") || (!strcmp(a, "help") && argc == 2)) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(a, "--version"))
        return cmd_version(argc - 1, argv + 1);
    if (!strcmp(a, "help")) {
        /* help CMD [SUB...]: CMD [SUB...] --help */
        if (!strcmp(argv[2], "help")) {
            usage(stdout);
            return 0;
        }
        int i = find(argv[2]);
        if (i < 0)
            return unknown(argv[2]);
        char *hargv[16];
        int n = 0;
        for (int k = 2; k < argc && n < 14; k++)
            hargv[n++] = argv[k];
        static char help_flag[] = "--help";
        hargv[n++] = help_flag;
        hargv[n] = NULL;
        return g_cmds[i].fn(n, hargv);
    }
    if (a[0] == '-') {
        fprintf(stderr, "deltagrad: unknown flag '%s' before the command\n\n", a);
        usage(stderr);
        return 2;
    }
    int i = find(a);
    return i < 0 ? unknown(a) : g_cmds[i].fn(argc - 1, argv + 1);
}

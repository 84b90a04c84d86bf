/*
 * tools/deltagrad.c -- the `deltagrad` command: one binary, several subcommands.
 */
#include "deltagrad.h"
#include "tools/commands.h"

#include <stdio.h>
#include <string.h>

static int cmd_version(int argc, char **argv) {
    (void)argc;
    (void)argv;
    /* the library's own version: a shared libdeltagrad found at run time may not be the one
     * this command was built against */
    printf("deltagrad %s (commit %s, CUDA architectures: %s)\n", dg_version(), dg_build_commit(),
           dg_build_cuda_archs());
    if (strcmp(dg_version(), DG_VERSION) != 0)
        printf("warning: the command was built against deltagrad.h %s\n", DG_VERSION);
    printf("CUDA: %s, NCCL: %s, MPI: %s, CUDA devices: %d\n", dg_have_cuda() ? "yes" : "no",
           dg_have_nccl() ? "yes" : "no", dg_have_mpi() ? "yes" : "no", dg_cuda_device_count());
    return 0;
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} g_cmds[] = {
    {"train", dg_cmd_train, "train the toy KDA language model"},
    {"sample", dg_cmd_sample, "generate text from a checkpoint"},
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

static void usage(FILE *f) {
    fprintf(f, "usage: deltagrad <command> [options]   (deltagrad <command> --help for more)\n\n");
    for (size_t i = 0; i < sizeof g_cmds / sizeof *g_cmds; i++)
        fprintf(f, "  %-10s %s\n", g_cmds[i].name, g_cmds[i].help);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof g_cmds / sizeof *g_cmds; i++)
        if (!strcmp(argv[1], g_cmds[i].name))
            return g_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "deltagrad: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

/* tools/commands.h -- the deltagrad CLI's subcommands. Each returns a process exit code. */
#ifndef DG_TOOLS_COMMANDS_H
#define DG_TOOLS_COMMANDS_H

int dg_cmd_train(int argc, char **argv);  /* tools/cmd_train.c */
int dg_cmd_sample(int argc, char **argv); /* tools/cmd_train.c */
/* The same argument parsing and checks, without running anything (0: the arguments are valid;
 * else the usage error's exit code). For tests and the argument fuzzer. */
int dg_cmd_train_check(int argc, char **argv);
int dg_cmd_sample_check(int argc, char **argv);
int dg_cmd_kda(int argc, char **argv); /* tools/cmd_kda.c */
/* Its argument parsing alone: 0 when valid, else the usage error's exit code. */
int dg_cmd_kda_check(int argc, char **argv);
int dg_cmd_dplr(int argc, char **argv); /* tools/cmd_dplr.c */
/* Its argument parsing alone: 0 when valid, else the usage error's exit code. */
int dg_cmd_dplr_check(int argc, char **argv);
int dg_cmd_bench(int argc, char **argv); /* tools/cmd_bench.c */
/* `deltagrad bench kda ...` (tools/bench_kda.c); argv[0] is "kda". */
int dg_bench_kda(int argc, char **argv);
/* `deltagrad bench dplr ...` (tools/bench_dplr.c); argv[0] is "dplr". */
int dg_bench_dplr(int argc, char **argv);
/* `deltagrad bench cp ...` (tools/bench_cp.c): KCP on the ranks of an MPI job; argv[0] is "cp". */
int dg_bench_cp(int argc, char **argv);
int dg_cmd_explain(int argc, char **argv); /* tools/cmd_explain.c */
/* `deltagrad gradcheck kda|dplr ...` (tools/cmd_gradcheck.c); argv[1] is the op. */
int dg_cmd_gradcheck(int argc, char **argv);

#endif

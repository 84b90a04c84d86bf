/*
 * tools/op_runner.h -- what the op runners (`deltagrad kda`, `deltagrad dplr`) share: the common
 * flags, loading DIR/<name>.npy onto the run device, running backward from do.npy (+ dht.npy),
 * writing OUT/<name>.npy in the dtype of its input file with a count of non-finite values, and
 * the exit codes: 0 done, 1 an input or the op failed, 2 a usage error, 3 an output holds NaN or
 * Inf (unless --allow-nonfinite).
 *
 * A command built on it:
 *   dg_runner_parse_cmd with a table of its own flags and a function taking them (the common
 *   ones are handled there);
 *   a table of inputs (dg_runner_in) and its op for dg_runner_run: every missing required file
 *   listed at once, OUT created, the contexts opened, every input loaded (the error names the
 *   file); the op on r->t[...]; o.npy, ht.npy, and with do.npy the backward and one gradient
 *   file per input that names one; everything freed.
 * Every message starts with "deltagrad <cmd>: ".
 */
#ifndef DG_TOOLS_OP_RUNNER_H
#define DG_TOOLS_OP_RUNNER_H

#include "deltagrad.h"

#include <stdint.h>
#include <stdio.h>

struct dg_cli_flag;

#define DG_RUNNER_MAX_IN 16 /* inputs of one command */

enum { DG_RUNNER_SKIP, DG_RUNNER_OPTIONAL, DG_RUNNER_REQUIRED };

/* One input file DIR/<name>.npy. The entries named "do" and "dht" are the upstream gradients of
 * o and ht: with do.npy loaded, every input that names a `grad` file gets requires_grad. */
typedef struct dg_runner_in {
    const char *name;
    int need;         /* DG_RUNNER_SKIP, _OPTIONAL (loaded when the file exists), _REQUIRED */
    const char *why;  /* a required file: shown after its name when missing (NULL: nothing) */
    dg_dtype dt;      /* a float dtype: converted to it on the run device; an integer dtype: kept
                         as the file holds it, on the host (index arrays) */
    const char *grad; /* OUT/<grad>.npy gets its gradient; NULL: none */
} dg_runner_in;

typedef struct dg_runner {
    const char *cmd;              /* "kda", "dplr": names the command in every message */
    void (*usage)(FILE *f);       /* the command's --help text */
    const char *in_dir, *out_dir; /* --in, --out */
    dg_device dev;
    dg_dtype dt; /* compute dtype of the activations */
    int dt_set, recurrent, quiet, allow_nonfinite;
    int out_dt;     /* -1: each output in its input file's dtype; else DG_F64 or DG_F32 */
    int chunk_size; /* --chunk-size; 0: the op's default */
    double scale;   /* --scale; 0: the op's default (K^-1/2) */
    int check_only; /* parse only: --help prints nothing */
    /* after dg_runner_start: the CPU context and the run context (ctx == host on the CPU) */
    dg_ctx *host, *ctx;
    const dg_runner_in *inputs; /* dg_runner_start's table (n entries) */
    int n;
    dg_tensor *t[DG_RUNNER_MAX_IN];     /* inputs[i] as loaded, or NULL */
    dg_dtype file_dt[DG_RUNNER_MAX_IN]; /* the dtype the file of inputs[i] holds */
    dg_tensor *o, *ht;   /* the op's outputs: pass &r->o, &r->ht to it; freed by dg_runner_free */
    char nonfinite[512]; /* names of the written outputs that hold NaN / Inf */
} dg_runner;

/* Pieces of the runners' --help text (string literals, for concatenation): the common flags
 * before --chunk-size, those after the command's own, and the paragraph on writing and exit
 * codes. */
#define DG_RUNNER_HELP_IO                                                                          \
    "  --out DIR            output folder (created if missing)\n"                                  \
    "  --device cpu|cuda    where to run (default cpu)\n"                                          \
    "  --dtype f64|f32|bf16 compute dtype (default f64 on cpu, f32 on cuda; bf16: cuda)\n"         \
    "  --out-dtype D        same | f64 | f32: dtype of the written files (default same:\n"         \
    "                       each output has the dtype of its input file, see below)\n"
#define DG_RUNNER_HELP_RUN                                                                         \
    "  --scale S            output scale, > 0 (default K^-1/2)\n"                                  \
    "  --recurrent          run the token-by-token recurrence instead of the chunked form\n"       \
    "  --allow-nonfinite    write outputs holding NaN or Inf and exit 0 (default: exit 3)\n"       \
    "  --quiet              print nothing but errors\n"                                            \
    "\n"                                                                                           \
    "Files written to OUT (none when an input is refused or the forward fails; o and ht\n"         \
    "but no gradients when only the backward fails):\n"
#define DG_RUNNER_HELP_EXIT                                                                        \
    "A file is written whole or not at all (temp file + rename). When an output holds\n"           \
    "NaN or Inf the files are still written and the command exits 3 naming the output.\n"          \
    "Exit codes: 0 done, 1 an input or the op failed, 2 bad flags, 3 non-finite outputs.\n"

void dg_runner_init(dg_runner *r, const char *cmd, void (*usage)(FILE *f));
/* Parse argv (tools/cli.h: --flag value or --flag=value, --help, --version) with the common
 * flags --in, --out, --device, --dtype, --out-dtype, --chunk-size, --scale, --recurrent,
 * --allow-nonfinite, --quiet and the command's own (own[n_own], handed with their value to
 * own_flag, which returns 0 or 2 after printing the error). Returns 0 when parsed, 1 after --help
 * or --version (printed unless check_only), 2 after printing a usage error. */
int dg_runner_parse(dg_runner *r, int argc, char **argv, const struct dg_cli_flag *own, int n_own,
                    int (*own_flag)(dg_runner *r, const char *f, const char *v, void *user),
                    void *user);
/* dg_runner_init, dg_runner_parse and dg_runner_args_done in one, for the command `cmd` with its
 * --help text; check_only: parse only (--help prints nothing). Returns as dg_runner_parse, or 2
 * after dg_runner_args_done refused the flags. */
int dg_runner_parse_cmd(dg_runner *r, const char *cmd, void (*usage)(FILE *f), int check_only,
                        int argc, char **argv, const struct dg_cli_flag *own, int n_own,
                        int (*own_flag)(dg_runner *r, const char *f, const char *v, void *user),
                        void *user);
/* Print "deltagrad <cmd>: <flag> <why>" and return 2. */
int dg_runner_bad(const dg_runner *r, const char *flag, const char *why);
/* Print dg_last_error() (a dg_arg_* refusal, which names the flag) and return 2. */
int dg_runner_bad_arg(const dg_runner *r);
/* After the flags: --in and --out are required; the default dtype (f64 on the CPU, f32 on
 * CUDA); bf16 runs on CUDA only. 0 or 2. */
int dg_runner_args_done(dg_runner *r);
/* The dtype of the state files (h0, dht): the compute dtype on the CPU, f32 on CUDA (the state is
 * f32 there, kda.md §11.1 and dplr.md D1). */
dg_dtype dg_runner_state_dtype(const dg_runner *r);

/* Check that every required input of in[n] (n <= DG_RUNNER_MAX_IN) exists (all missing ones
 * listed in one message), create OUT, open the contexts and load in[i] into r->t[i]. 0, or 1
 * after printing the error (free with dg_runner_free in either case). */
int dg_runner_start(dg_runner *r, const dg_runner_in *in, int n);
/* cu (an integer [N+1] tensor, or NULL) as the op's host table: checked against q's T
 * (dg_kda_seqlens) into *out (malloc'd, free it; NULL when cu is NULL), *n_seqs = N. 0, or 1
 * after printing the error naming cu_seqlens.npy. */
int dg_runner_seqlens(dg_runner *r, const dg_tensor *cu, const dg_tensor *q, int64_t **out,
                      int *n_seqs);
/* Print "deltagrad <cmd>: <what>: <dg_last_error()>" (with a hint after out of memory); 1. */
int dg_runner_fail(const dg_runner *r, const char *what);
/* The op `op` returned s: dg_runner_fail, and after a shape, dtype or argument error a note that
 * the arguments it names are the .npy files of the same names in DIR. 1. */
int dg_runner_op_fail(const dg_runner *r, const char *op, dg_status s);
/* After a successful op: check that do.npy and dht.npy have the shapes of o and ht (nothing is
 * written otherwise), write r->o as o.npy (dtype o_like) and r->ht as ht.npy (ht_like; r->ht
 * may be NULL), then, when do.npy was loaded, run backward from o and ht seeded with do and dht
 * (optional) and write the gradient of every input that names one; report non-finite outputs and
 * print the summary line. Returns the exit code. */
int dg_runner_finish(dg_runner *r, dg_dtype o_like, dg_dtype ht_like);
/* Reset the tape, free the outputs, the inputs and the contexts. */
void dg_runner_free(dg_runner *r);

/* The inputs every runner has, set in in[] at the indices at[0..6]: q.npy, k.npy and v.npy
 * (required, compute dtype dt, gradients dq dk dv), h0.npy (optional, state dtype st, gradient
 * dh0), cu_seqlens.npy (optional, integer), and the upstream gradients do.npy (dt) and dht.npy
 * (st). */
enum {
    DG_RUNNER_Q,
    DG_RUNNER_K,
    DG_RUNNER_V,
    DG_RUNNER_H0,
    DG_RUNNER_CU,
    DG_RUNNER_DO,
    DG_RUNNER_DHT,
    DG_RUNNER_NCOMMON
};
void dg_runner_in_common(dg_runner_in *in, const int at[DG_RUNNER_NCOMMON], dg_dtype dt,
                         dg_dtype st);
/* In an op's options o (dg_kda_opts, dg_dplr_opts): the common flags (--chunk-size, --scale),
 * the final state asked for, and the sequence table cu of n_seqs sequences (dg_runner_op_fn's). */
#define DG_RUNNER_SET_OPTS(o, r, cu, n_seqs)                                                       \
    ((o)->chunk_size = (r)->chunk_size, (o)->scale = (r)->scale, (o)->output_final_state = 1,      \
     (o)->cu_seqlens = (cu), (o)->n_seqs = (n_seqs))

/* The op of a command on r->t[...], writing r->o and r->ht: cu is the host table of sequence
 * starts (NULL without cu_seqlens.npy) and n_seqs its N (0 without it). */
typedef dg_status (*dg_runner_op_fn)(dg_runner *r, const int64_t *cu, int n_seqs, void *user);
/* All a command does after parsing: dg_runner_start on in[n]; dg_runner_seqlens of r->t[cu]
 * against r->t[q]; op (a failure named dg_<cmd>_recurrent or dg_<cmd>_chunk, dg_runner_op_fail);
 * dg_runner_finish with o.npy in the dtype of q's file and ht.npy in h0's (q's without h0.npy);
 * dg_runner_free. Returns the exit code. */
int dg_runner_run(dg_runner *r, const dg_runner_in *in, int n, int q, int h0, int cu,
                  dg_runner_op_fn op, void *user);

#endif /* DG_TOOLS_OP_RUNNER_H */

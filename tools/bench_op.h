/* tools/bench_op.h -- what the op benches (bench kda, bench dplr) share: their flags, the device
 * and its measured peaks, the reference shapes, the timing of one op's forward and
 * forward+backward under both policies, and the table of times, peaks and floor ratios. Each bench
 * keeps its inputs, its FLOP and byte counts and its notes. */
#ifndef DG_TOOLS_BENCH_OP_H
#define DG_TOOLS_BENCH_OP_H

#include "deltagrad.h"
#include "tools/cli.h"

#include <stddef.h>
#include <stdio.h>

/* In a function returning int: on a failing status print "<who>: <expr> failed: <why>" and return
 * -1. */
#define DG_BENCH_TRY(who, expr)                                                                    \
    do {                                                                                           \
        dg_status dg__bs = (expr);                                                                 \
        if (dg__bs != DG_OK) {                                                                     \
            fprintf(stderr, "%s: %s failed: %s\n", who, #expr, dg_last_error());                   \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

/* B rows of T tokens, H heads, K = V. */
typedef struct dg_bench_shape {
    int B, T, H, K;
} dg_bench_shape;

typedef struct dg_bench_result {
    double fwd_ms, fb_ms, fb_cache_ms; /* fwd+bwd: default policy, everything cached */
    size_t peak_cache, peak_recompute;
} dg_bench_result;

/* FLOP and bytes that must move, forward and forward+backward: the floors' numerators. */
typedef struct dg_bench_work {
    double flop_fwd, flop_fb, bytes_fwd, bytes_fb;
} dg_bench_work;

/* The options every op bench takes: --reps N (1..64), --dtype bf16|f32, --shape B,T,H,K
 * (repeatable, at most 8: sel[0..nsel-1]) and --profile. */
typedef struct dg_bench_opts {
    int reps, profile, nsel;
    dg_dtype dt;
    dg_bench_shape sel[8];
} dg_bench_opts;
#define DG_BENCH_OPTS_INIT                                                                         \
    {                                                                                              \
        10, 0, 0, DG_BF16, {                                                                       \
            { 0, 0, 0, 0 }                                                                         \
        }                                                                                          \
    }
/* Flag f with value v into o when it is one of those: 0 when parsed, the exit code after printing
 * why a value is bad (2), or -1 when f is not one of them. */
int dg_bench_opt(const dg_cli *cli, const char *f, const char *v, dg_bench_opts *o);

/* A flag of a bench that takes one of n words (n <= 8): words[i] sets *out = i. */
typedef struct dg_bench_word {
    const char *flag;
    const char *const *words;
    int n;
    int *out;
} dg_bench_word;

/* Parse argv for bench `who` ("bench kda"; help: its --help text; flags[nflags]: every flag it
 * takes): the common options into *o (dg_bench_opt), the word flags words[nwords] (another word:
 * "must be a, b or c, got 'x'") and, when chunk is not NULL, --chunk-size 16|32|64 into *chunk.
 * Returns DG_CLI_END when parsed, else the exit code (0 after --help, 2 after a bad flag). */
int dg_bench_parse(const char *who, void (*help)(FILE *f), const dg_cli_flag *flags, int nflags,
                   int argc, char **argv, dg_bench_opts *o, const dg_bench_word *words, int nwords,
                   int *chunk);

/* One forward of the timed op into *out (recorded on the tape when its inputs require grad). */
typedef dg_status (*dg_bench_fwd_fn)(dg_ctx *ctx, const void *user, dg_tensor **out);

/* Opens CUDA device 0 and measures its peaks (bf16 GEMM FLOP/s, copy bytes/s), printed. Returns
 * 0, or the command's exit code after printing why (`who` starts the message: "bench kda"). */
int dg_bench_open(const char *who, dg_ctx **ctx, double *flops, double *bw);

/* Times `fwd`: forward alone without recording, then forward+backward (seeded with dO) under
 * CACHE and under the default policy, each the median of reps (<= 64) runs after 2 untimed ones,
 * with the peak device memory of a run. The leaves get requires_grad and are zeroed between runs
 * (and at the end). profile: one more forward+backward with the time of every tape node printed.
 * Returns 0, or -1 with the failing call printed. */
int dg_bench_time_op(dg_ctx *ctx, const char *who, dg_bench_fwd_fn fwd, const void *user,
                     dg_tensor *const *leaves, int nleaves, const dg_tensor *dO, int reps,
                     int profile, dg_bench_result *r);

/* One shape of a bench: time it into *r and count its work into *w; 0 or -1 (on an error). */
typedef int (*dg_bench_shape_fn)(dg_ctx *ctx, dg_bench_shape s, const void *user,
                                 dg_bench_result *r, dg_bench_work *w);

/* The table: each of the nsel shapes in sel (none: the reference shapes) through `run`, a row of
 * times, ratios to the compute and memory floors and peaks each. Returns 0, or 1 if a shape
 * failed (its row says why). */
int dg_bench_shapes(dg_ctx *ctx, const dg_bench_shape *sel, int nsel, dg_bench_shape_fn run,
                    const void *user, double flops, double bw);

/* A whole bench after parsing: dg_bench_open, the header printed (after the peaks), the table of
 * o's shapes through run (dg_bench_shapes), then the notes. Returns the exit code. */
int dg_bench_main(const char *who, const char *header, const dg_bench_opts *o,
                  dg_bench_shape_fn run, const void *user, const char *notes);

#endif

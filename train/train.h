/*
 * train/train.h -- the training loop of the toy KDA language model.
 *
 * One step: `accum` micro-batches of B rows x T bytes, each forward + backward through the tape
 * (the loss scaled by 1/accum, gradients accumulating in the master weights), then the global
 * gradient norm, clipping to `clip`, and AdamW with a linear warmup + cosine decay to
 * min_lr_frac * lr. Every eval_every steps the mean loss over fixed validation windows; every
 * sample_every steps a sample from the prompt; every ckpt_every steps (and at the end) an atomic
 * checkpoint DIR/ckpt_latest.safetensors. DIR/log.csv gets one line per step.
 *
 * The loop prints nothing: it reports through a callback (the CLI prints; tests collect).
 */
#ifndef DG_TRAIN_TRAIN_H
#define DG_TRAIN_TRAIN_H

#include "deltagrad.h"
#include "train/model.h"

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#define DG_PATH_MAX 4096

/* Upper bounds of the counts a run may have (CLI flags and checkpoint metadata alike): with them
 * every product the loop forms (batch * seq_len, steps * accum * batch windows drawn, ...) stays
 * far inside int64_t. */
#define DG_TRAIN_MAX_STEPS ((int64_t)1 << 40)
#define DG_TRAIN_MAX_BATCH 65536
#define DG_TRAIN_MAX_SEQ_LEN (1 << 24)
#define DG_TRAIN_MAX_ACCUM 65536
#define DG_TRAIN_MAX_EVAL_BATCHES 65536
#define DG_TRAIN_MAX_SAMPLE (1 << 20)
/* batch * seq_len (one micro-batch) and batch * accum (windows per step) */
#define DG_TRAIN_MAX_TOKENS ((int64_t)1 << 31)
#define DG_TRAIN_MAX_ROWS_PER_STEP ((int64_t)1 << 22)

/* Whether the training step runs as a CUDA graph (docs/training.md, "CUDA graphs"). */
typedef enum dg_train_graph {
    DG_TRAIN_GRAPH_AUTO = 0, /* on where it applies (one process on CUDA, no profiling), else off */
    DG_TRAIN_GRAPH_ON,       /* on; refused (DG_ERR_ARG) where it cannot apply */
    DG_TRAIN_GRAPH_OFF,      /* every step eagerly */
} dg_train_graph;

typedef struct dg_train_opts {
    char config_name[16]; /* the preset the defaults came from: cpu, gpu, bench */
    dg_model_config model;
    char data_path[DG_PATH_MAX];
    int64_t max_data_bytes;    /* use only the first bytes of the file (0: all) */
    char out_dir[DG_PATH_MAX]; /* "" writes no files */
    int resume;                /* continue from out_dir/ckpt_latest.safetensors: the model and
                                  every hyperparameter then come from the checkpoint */
    int64_t resume_steps;      /* with resume: a new total step count (0 keeps the checkpoint's) */
    dg_device device;
    dg_dtype param_dtype;   /* master weights: f32 (f64 for tests) */
    dg_dtype compute_dtype; /* f32, or bf16 on CUDA */
    int64_t steps;          /* total steps of the schedule */
    int64_t stop_at;        /* stop after this step (0: run to `steps`); the schedule still
                               spans `steps`, so a later --resume continues the same run */
    int batch, seq_len, accum;
    double lr, min_lr_frac;
    int64_t warmup;
    double beta1, beta2, adam_eps, weight_decay, clip;
    uint64_t seed;
    int64_t eval_every;   /* 0: only at the end */
    int eval_batches;     /* validation batches of `batch` rows */
    int64_t sample_every; /* 0: only at the end; < 0: never */
    int sample_tokens;
    double temperature;
    int top_k;
    char prompt[256];
    int64_t ckpt_every; /* 0: only at the end */
    /* The host reads the steps' losses and gradient norms (kept on the device) and the device's
     * bad-input record every `log_every` steps, and at every evaluation, sample, checkpoint,
     * stop and the last step; the steps in between run without a host sync, and their log.csv
     * lines and DG_EV_STEP events come together at the read. >= 1 (cpu config 1, gpu/bench 10).
     */
    int64_t log_every;
    int keep_step_ckpts; /* also keep ckpt_step<N>.safetensors */
    dg_policy recompute; /* global tape policy for the run */
    int plot;            /* render DIR/loss.png with gnuplot at the end */
    /* Several processes (launch-time only, not stored in checkpoints): `comm` is the world (not
     * owned; NULL: one process) and the ranks form groups of `cp` (context parallelism: each
     * group's rows are packed into one token axis and split over its cp ranks); the
     * world / cp groups share the batch rows (data parallelism; batch % groups == 0). Gradients
     * and losses are summed over every rank, so the run computes what one process would. Only
     * rank 0 reports events and writes files. */
    dg_comm *comm;
    int cp; /* ranks per context-parallel group (0 or 1: off) */
    /* The step as a CUDA graph (launch-time, not stored in checkpoints): the first step of an
     * invocation runs eagerly, the second is captured (forward, backward, loss sum, clipping
     * and AdamW over every micro-batch of the step) and every later step replays the capture
     * after uploading its batch. A capture that fails is reported (DG_EV_WARN) and the run goes
     * on eagerly. ON needs a CUDA device, one process and profiling off. */
    dg_train_graph graph;
    int overwrite; /* a fresh run may replace the run already in out_dir (else refused) */
    /* Checked after every step: once non-zero (a signal handler sets it), the run writes a
     * checkpoint (when it has a directory) and returns DG_ERR_STATE ("interrupted"). NULL: never.
     */
    const volatile sig_atomic_t *stop;
} dg_train_opts;

/* Defaults of a preset ("cpu", "gpu", "bench"): model config and training hyperparameters. */
dg_status dg_train_opts_default(const char *config, dg_train_opts *o);

typedef enum dg_train_event_kind {
    DG_EV_HEADER, /* text: multi-line description of the run */
    DG_EV_INFO,   /* text: one line (tape size after the first forward, resumed from, ...) */
    DG_EV_STEP,   /* step finished: step, loss, lr, grad_norm, tok_s, elapsed, eta, mem; sent
                     at the read after it (log_every), in step order */
    DG_EV_EVAL,   /* val_loss */
    DG_EV_SAMPLE, /* text: the prompt + generated bytes */
    DG_EV_CKPT,   /* text: the checkpoint path */
    DG_EV_WARN,   /* text: something went wrong that does not stop the run */
    DG_EV_DONE,
} dg_train_event_kind;

typedef struct dg_train_event {
    dg_train_event_kind kind;
    int64_t step, steps, last_step; /* last_step: where this invocation stops */
    double loss, val_loss, lr, grad_norm, tok_s, elapsed_s, eta_s;
    size_t mem_bytes;
    const char *text;
} dg_train_event;

typedef void (*dg_train_cb)(const dg_train_event *ev, void *user);

typedef struct dg_train_result {
    int64_t first_step, last_step; /* steps run by this call */
    double *losses;   /* [steps]: train loss of step s at losses[s-1]; NaN for steps not run */
    double final_val; /* last validation loss (NaN if none) */
    double seconds;
    int64_t tokens;
    size_t tape_bytes; /* after the first forward */
    int64_t n_params;
    int64_t graph_steps; /* steps run by replaying a captured CUDA graph (the capture included) */
} dg_train_result;
void dg_train_result_free(dg_train_result *r);

/* Runs training. res may be NULL.
 * With a run directory (out_dir), the run holds DIR/train.lock (flock) from start to end, so a
 * second trainer on the same directory is refused (DG_ERR_STATE) instead of interleaving its
 * log and checkpoints. A fresh run (not resume) into a directory that already holds a run
 * (log.csv or ckpt_latest.safetensors) is refused (DG_ERR_ARG) unless opts->overwrite, which
 * first removes the old checkpoints. A failed write of log.csv stops the run (DG_ERR_IO). A
 * checkpoint is never written from non-finite weights: the run stops (DG_ERR_NUMERIC) and the
 * last good checkpoint stays the latest. */
dg_status dg_train_run(const dg_train_opts *opts, dg_train_cb cb, void *user, dg_train_result *res);

/* 1 if the last dg_train_run of this thread stopped because opts->stop was set (on any rank). */
int dg_train_was_interrupted(void);

/* Learning rate at `step` (1-based): linear warmup to lr, cosine to min_lr_frac * lr at `steps`. */
double dg_train_lr(const dg_train_opts *o, int64_t step);

/* Writes DIR/loss.gp and runs gnuplot on it to make DIR/loss.png from DIR/log.csv.
 * DG_ERR_UNSUPPORTED if gnuplot is not on PATH. */
dg_status dg_train_plot(const char *dir);

#endif /* DG_TRAIN_TRAIN_H */

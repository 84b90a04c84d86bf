/*
 * train/train.c -- the training loop (see train.h): data, forward/backward with gradient
 * accumulation, clipping, AdamW with warmup + cosine, evaluation, sampling, checkpoints, the CSV
 * log and the gnuplot loss curve.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* flock */
#include "train/train.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "tensor/fileio.h"
#include "tensor/tensor.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CSV_HEADER "step,train_loss,val_loss,lr,grad_norm,tokens_per_s,elapsed_s,mem_bytes"

/* ---- options -------------------------------------------------------------------------------- */

dg_status dg_train_opts_default(const char *config, dg_train_opts *o) {
    if (!o)
        return dg__err(DG_ERR_ARG, "dg_train_opts_default: NULL opts");
    memset(o, 0, sizeof *o);
    const char *name = config ? config : "cpu";
    DG_TRY(dg_model_config_preset(name, &o->model));
    snprintf(o->config_name, sizeof o->config_name, "%s", name);
    o->device = dg_cpu();
    o->param_dtype = DG_F32;
    o->compute_dtype = DG_F32;
    o->accum = 1;
    o->min_lr_frac = 0.1;
    o->beta1 = 0.9;
    o->beta2 = 0.95;
    o->adam_eps = 1e-8;
    o->weight_decay = 0.1;
    o->clip = 1.0;
    o->seed = 1;
    o->temperature = 0.8;
    o->top_k = 40;
    o->sample_tokens = 200;
    snprintf(o->prompt, sizeof o->prompt, "%s", "And God said");
    o->recompute = DG_POLICY_DEFAULT;
    o->plot = 1;
    if (!strcmp(name, "cpu")) {
        /* ~300k bytes: a few CPU minutes; validation reaches ~1.7 nats/byte on the KJV text */
        o->steps = 300;
        o->warmup = 30;
        o->batch = 8;
        o->seq_len = 128;
        o->lr = 3e-3;
        o->eval_every = 50;
        o->eval_batches = 8;
        o->sample_every = 0;
        o->ckpt_every = 100;
        o->log_every = 1;
    } else if (!strcmp(name, "gpu")) {
        o->steps = 2000;
        o->warmup = 100;
        o->batch = 16;
        o->seq_len = 1024;
        o->lr = 1.5e-3;
        o->eval_every = 200;
        o->eval_batches = 8;
        o->sample_every = 500;
        o->ckpt_every = 500;
        o->log_every = 10;
    } else { /* bench: training.md M3 */
        o->steps = 50;
        o->warmup = 10;
        o->batch = 16;
        o->seq_len = 2048;
        o->lr = 1e-3;
        o->eval_every = 0;
        o->eval_batches = 2;
        o->sample_every = -1;
        o->ckpt_every = 0;
        o->log_every = 10;
        o->plot = 0;
    }
    return DG_OK;
}

double dg_train_lr(const dg_train_opts *o, int64_t step) {
    if (o->warmup > 0 && step <= o->warmup)
        return o->lr * (double)step / (double)o->warmup;
    int64_t span = o->steps - o->warmup;
    double t = span > 0 ? (double)(step - o->warmup) / (double)span : 1.0;
    if (t > 1.0)
        t = 1.0;
    if (t < 0.0)
        t = 0.0;
    double f = o->min_lr_frac + (1.0 - o->min_lr_frac) * 0.5 * (1.0 + cos(M_PI * t));
    return o->lr * f;
}

static dg_status check_opts(const dg_train_opts *o) {
#define NEED(cond, ...)                                                                            \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return dg__err(DG_ERR_ARG, __VA_ARGS__);                                               \
    } while (0)
    NEED(o->steps >= 1 && o->steps <= DG_TRAIN_MAX_STEPS, "--steps must be in [1, %lld] (got %lld)",
         (long long)DG_TRAIN_MAX_STEPS, (long long)o->steps);
    NEED(o->stop_at <= DG_TRAIN_MAX_STEPS, "--stop-at must be <= %lld (got %lld)",
         (long long)DG_TRAIN_MAX_STEPS, (long long)o->stop_at);
    NEED(o->batch <= DG_TRAIN_MAX_BATCH, "--batch must be <= %d (got %d)", DG_TRAIN_MAX_BATCH,
         o->batch);
    NEED(o->seq_len <= DG_TRAIN_MAX_SEQ_LEN, "--seq-len must be <= %d (got %d)",
         DG_TRAIN_MAX_SEQ_LEN, o->seq_len);
    NEED(o->accum <= DG_TRAIN_MAX_ACCUM, "--accum must be <= %d (got %d)", DG_TRAIN_MAX_ACCUM,
         o->accum);
    NEED((int64_t)o->batch * o->seq_len <= DG_TRAIN_MAX_TOKENS,
         "--batch x --seq-len (%d x %d) exceeds %lld tokens per micro-batch", o->batch, o->seq_len,
         (long long)DG_TRAIN_MAX_TOKENS);
    NEED((int64_t)o->batch * o->accum <= DG_TRAIN_MAX_ROWS_PER_STEP,
         "--batch x --accum (%d x %d) exceeds %lld rows per step", o->batch, o->accum,
         (long long)DG_TRAIN_MAX_ROWS_PER_STEP);
    NEED(o->eval_batches <= DG_TRAIN_MAX_EVAL_BATCHES, "--eval-batches must be <= %d (got %d)",
         DG_TRAIN_MAX_EVAL_BATCHES, o->eval_batches);
    NEED(o->warmup <= DG_TRAIN_MAX_STEPS, "--warmup must be <= %lld (got %lld)",
         (long long)DG_TRAIN_MAX_STEPS, (long long)o->warmup);
    NEED(o->sample_tokens <= DG_TRAIN_MAX_SAMPLE, "--sample-tokens must be <= %d (got %d)",
         DG_TRAIN_MAX_SAMPLE, o->sample_tokens);
    NEED(isfinite(o->temperature) && o->temperature >= 0.0, "--temperature must be >= 0 (got %g)",
         o->temperature);
    NEED(o->top_k <= 256, "--top-k must be <= 256 (got %d)", o->top_k);
    NEED(o->stop_at >= 0, "--stop-at must be >= 0 (got %lld)", (long long)o->stop_at);
    NEED(o->batch >= 1, "--batch must be >= 1 (got %d)", o->batch);
    NEED(o->seq_len >= 2, "--seq-len must be >= 2 (got %d)", o->seq_len);
    NEED(o->accum >= 1, "--accum must be >= 1 (got %d)", o->accum);
    NEED(o->lr > 0.0 && isfinite(o->lr), "--lr must be > 0 (got %g)", o->lr);
    NEED(o->min_lr_frac >= 0.0 && o->min_lr_frac <= 1.0, "--min-lr-frac must be in [0,1] (got %g)",
         o->min_lr_frac);
    NEED(o->warmup >= 0, "--warmup must be >= 0 (got %lld)", (long long)o->warmup);
    NEED(o->beta1 >= 0.0 && o->beta1 < 1.0, "--beta1 must be in [0,1) (got %g)", o->beta1);
    NEED(o->beta2 >= 0.0 && o->beta2 < 1.0, "--beta2 must be in [0,1) (got %g)", o->beta2);
    NEED(o->adam_eps > 0.0 && isfinite(o->adam_eps), "--adam-eps must be > 0 (got %g)",
         o->adam_eps);
    NEED(o->weight_decay >= 0.0 && isfinite(o->weight_decay),
         "--weight-decay must be >= 0 (got %g)", o->weight_decay);
    NEED(o->clip > 0.0 && isfinite(o->clip), "--clip must be > 0 (got %g)", o->clip);
    NEED(o->eval_every >= 0, "--eval-every must be >= 0 (got %lld)", (long long)o->eval_every);
    NEED(o->eval_batches >= 1, "--eval-batches must be >= 1 (got %d)", o->eval_batches);
    NEED(o->sample_tokens >= 0, "--sample-tokens must be >= 0 (got %d)", o->sample_tokens);
    NEED(o->prompt[0] || o->sample_tokens == 0 || o->sample_every < 0,
         "--prompt must not be empty (the sample continues its bytes)");
    NEED(o->top_k >= 0, "--top-k must be >= 0 (got %d)", o->top_k);
    NEED(o->ckpt_every >= 0, "--ckpt-every must be >= 0 (got %lld)", (long long)o->ckpt_every);
    NEED(o->log_every >= 1 && o->log_every <= DG_TRAIN_MAX_STEPS,
         "--log-every must be in [1, %lld] (got %lld)", (long long)DG_TRAIN_MAX_STEPS,
         (long long)o->log_every);
    NEED(!o->resume || o->out_dir[0], "--resume needs --out DIR (the run directory to resume)");
    NEED(o->cp >= 0, "--cp must be >= 1 (got %d)", o->cp);
    NEED(o->cp <= 1 || o->comm,
         "--cp %d needs %d processes: launch with mpirun -np %d deltagrad train --cp %d (or "
         "torchrun --nproc-per-node %d on GPUs)",
         o->cp, o->cp, o->cp, o->cp, o->cp);
#undef NEED
    return DG_OK;
}

/* ---- helpers -------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static dg_status mkdir_p(const char *dir) {
    char buf[DG_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(buf, 0777) != 0 && errno != EEXIST)
            return dg__err(DG_ERR_IO, "--out: cannot create directory '%s': %s", buf,
                           strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0777) != 0 && errno != EEXIST)
        return dg__err(DG_ERR_IO, "--out: cannot create directory '%s': %s", buf, strerror(errno));
    struct stat sb;
    if (stat(buf, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return dg__err(DG_ERR_IO, "--out: '%s' is not a directory", buf);
    return DG_OK;
}

typedef struct run {
    dg_train_opts o;
    dg_train_cb cb;
    void *user;
    dg_ctx *ctx;
    dg_model *m;
    dg_tensor **am, **av;    /* AdamW moments, one per parameter */
    dg_adamw *opt;           /* AdamW over every parameter, clipping on the device */
    const dg_tensor **grads; /* this step's gradients, one per parameter (NULL: none) */
    /* What a step leaves on the device until the host reads it (every log_every steps):
     * step_out, f64 [2]: the step's loss summed over micro-batches (loss_acc, a view of
     * step_out[0]) and its gradient norm; ring, f64 [2 * log_every]: step_out of steps
     * ring_first .. ring_first + ring_n - 1. */
    dg_tensor *step_out, *loss_acc, *ring;
    int64_t ring_first, ring_n;
    double *ring_lr; /* the host's lr of those steps */
    double t_mark;   /* when the steps of the ring began (the end of the last read) */
    dg_text text;
    dg_train_state state;
    int32_t *ids, *tgt; /* host batch buffers [B*T] */
    /* The step's batch on the device, i32 [2 * accum * n] (n = mb_shape[0] * mb_shape[1]):
     * this rank's ids of micro-batches 0 .. accum-1, then their targets, filled before each step
     * by one asynchronous copy from `stage` (see upload_batch). This rank's micro-batch is
     * [mb_shape] tokens from offset mb_off of the host batch [B*T]; mb_frac: their share of the
     * batch's tokens. */
    dg_stage *stage;
    dg_tensor *batch;
    int64_t mb_shape[2], mb_off;
    double mb_frac;
    /* CUDA graphs: graph_on while the step is (to be) captured; graph: the captured step */
    int graph_on;
    dg_graph *graph;
    FILE *csv;
    char csv_path[DG_PATH_MAX + 32];
    int lock_fd;       /* DIR/train.lock, flock'ed for the whole run; -1 when none */
    int64_t ckpt_step; /* step of the last checkpoint written by this run (0: none) */
    double t_start;
    int64_t last_step;
    /* several processes: world = cp x dp ranks; this rank is cp_rank of group dp_index */
    int rank, world, cp, dp, dp_index;
    dg_comm *cp_comm; /* this rank's context-parallel group (owned; NULL when cp == 1) */
    dg_cp_plan *plan; /* this rank's slice of the group's packed rows (owned) */
} run;

static void emit(run *r, dg_train_event ev) {
    ev.steps = r->o.steps;
    ev.last_step = r->last_step;
    if (r->cb && r->rank == 0)
        r->cb(&ev, r->user);
}

static void emitf(run *r, dg_train_event_kind kind, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static void emitf(run *r, dg_train_event_kind kind, const char *fmt, ...) {
    char buf[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    dg_train_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = kind;
    ev.step = r->state.step;
    ev.text = buf;
    emit(r, ev);
}

static size_t mem_bytes(const run *r) {
    if (dg_ctx_device(r->ctx).kind == DG_DEV_CUDA)
        return dg_ctx_mem_stats(r->ctx).peak_in_use;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (size_t)ru.ru_maxrss * 1024; /* peak resident set of the process */
}

/* This rank's part of the host batch [B,T] as tensors: the rows of its data-parallel group,
 * and under context parallelism its token slice [1, T_r] of those rows packed end to end. *frac:
 * its share of the batch's tokens (the local mean loss times frac, summed over ranks, is the
 * batch mean). */
static dg_status local_batch(run *r, dg_tensor **ids, dg_tensor **tgt, double *frac) {
    *frac = r->mb_frac;
    DG_TRY(dg_tensor_from_host(r->ctx, DG_I32, 2, r->mb_shape, r->ids + r->mb_off, ids));
    dg_status s = dg_tensor_from_host(r->ctx, DG_I32, 2, r->mb_shape, r->tgt + r->mb_off, tgt);
    if (s != DG_OK)
        dg_tensor_free(ids);
    return s;
}

/* Where this rank's part of a host batch lies (local_batch), set once the ranks are known. */
static void set_local_part(run *r) {
    const int64_t B = r->o.batch, T = r->o.seq_len, Bd = B / r->dp;
    r->mb_off = r->dp_index * Bd * T;
    r->mb_shape[0] = Bd;
    r->mb_shape[1] = T;
    if (r->plan) {
        r->mb_off += r->plan->begin;
        r->mb_shape[0] = 1;
        r->mb_shape[1] = r->plan->end - r->plan->begin;
    }
    r->mb_frac = (double)(r->mb_shape[0] * r->mb_shape[1]) / (double)(B * T);
}

/* The step's training batches, `accum` micro-batches drawn at the data position (which moves
 * on), into r->batch: the host writes this rank's part of each into the stage's next buffer,
 * then one asynchronous copy moves them all (no host wait; see dg_stage). */
static dg_status upload_batch(run *r) {
    const dg_train_opts *o = &r->o;
    const int64_t n = r->mb_shape[0] * r->mb_shape[1], full = (int64_t)o->batch * o->seq_len;
    int32_t *buf = NULL;
    DG_TRY(dg_stage_next(r->stage, (void **)&buf));
    for (int a = 0; a < o->accum; a++) {
        int32_t *ids = buf + (int64_t)a * n, *tgt = buf + (int64_t)(o->accum + a) * n;
        if (n == full) { /* the whole batch is this rank's: straight into the buffer */
            dg_text_train_batch(&r->text, o->seed, r->state.data_counter, o->batch, o->seq_len, ids,
                                tgt);
        } else {
            dg_text_train_batch(&r->text, o->seed, r->state.data_counter, o->batch, o->seq_len,
                                r->ids, r->tgt);
            memcpy(ids, r->ids + r->mb_off, (size_t)n * sizeof *ids);
            memcpy(tgt, r->tgt + r->mb_off, (size_t)n * sizeof *tgt);
        }
        r->state.data_counter += (uint64_t)o->batch;
    }
    return dg_stage_upload(r->stage, r->batch);
}

/* Micro-batch a's ids and targets: views [mb_shape] of r->batch (no copy, no device work). */
static dg_status micro_batch(run *r, int a, dg_tensor **ids, dg_tensor **tgt) {
    const int64_t n = r->mb_shape[0] * r->mb_shape[1];
    dg_tensor *v = NULL;
    dg_status s = dg_slice(r->batch, 0, a * n, (a + 1) * n, &v);
    if (s == DG_OK)
        s = dg_reshape(v, 2, r->mb_shape, ids);
    dg_tensor_free(&v);
    const int64_t t0 = (int64_t)(r->o.accum + a) * n;
    if (s == DG_OK)
        s = dg_slice(r->batch, 0, t0, t0 + n, &v);
    if (s == DG_OK)
        s = dg_reshape(v, 2, r->mb_shape, tgt);
    dg_tensor_free(&v);
    if (s != DG_OK)
        dg_tensor_free(ids);
    return s;
}

/* Set when the last dg_train_run of this thread stopped on opts->stop. */
static _Thread_local int g_interrupted;

int dg_train_was_interrupted(void) { return g_interrupted; }

/* Sum *v over every rank (a no-op for one process). */
static dg_status sum_ranks(run *r, double *v) {
    if (r->world == 1)
        return DG_OK;
    dg_tensor *t = NULL;
    DG_TRY(dg_tensor_from_f64(r->ctx, DG_F64, 1, (int64_t[]){1}, v, &t));
    dg_status s = dg_comm_all_reduce(r->o.comm, t);
    if (s == DG_OK)
        s = dg_tensor_item(t, v);
    dg_tensor_free(&t);
    return s;
}

/* Sum every parameter gradient over the ranks (each holds its share of the batch's loss). */
static dg_status sum_grads(run *r) {
    if (r->world == 1)
        return DG_OK;
    for (int i = 0; i < r->m->n_params; i++) {
        dg_tensor *g = (dg_tensor *)dg_tensor_grad(r->m->params[i].t);
        if (!g)
            return dg__err(DG_ERR_STATE,
                           "data parallelism: parameter %s got no gradient on "
                           "rank %d (every rank must use every parameter)",
                           r->m->params[i].name, r->rank);
        DG_TRY(dg_comm_all_reduce(r->o.comm, g));
    }
    return DG_OK;
}

/* Ranks, groups and the context-parallel plan (world = cp x dp ranks). */
static dg_status setup_dist(run *r) {
    const dg_train_opts *o = &r->o;
    r->world = o->comm ? dg_comm_size(o->comm) : 1;
    r->rank = o->comm ? dg_comm_rank(o->comm) : 0;
    r->cp = o->cp > 1 ? o->cp : 1;
    if (r->world < r->cp)
        return dg__err(DG_ERR_ARG,
                       "--cp %d needs %d processes, this job has %d: launch with mpirun -np %d "
                       "deltagrad train --cp %d ... (or torchrun --nproc-per-node %d on GPUs)",
                       r->cp, r->cp, r->world, r->cp, r->cp, r->cp);
    if (r->world % r->cp)
        return dg__err(DG_ERR_ARG, "--cp %d must divide the number of processes (%d)", r->cp,
                       r->world);
    r->dp = r->world / r->cp;
    r->dp_index = r->rank / r->cp;
    if (o->batch % r->dp)
        return dg__err(DG_ERR_ARG,
                       "--batch %d must be a multiple of the %d data-parallel groups (processes "
                       "/ --cp)",
                       o->batch, r->dp);
    if (r->cp == 1)
        return DG_OK;
    const int Bd = o->batch / r->dp;
    int64_t *cu = malloc(sizeof(int64_t) * ((size_t)Bd + 1));
    if (!cu)
        return dg__err(DG_ERR_NOMEM, "--cp: out of host memory");
    for (int b = 0; b <= Bd; b++)
        cu[b] = (int64_t)b * o->seq_len;
    dg_status s = dg_comm_split(o->comm, r->dp_index, r->rank, &r->cp_comm);
    if (s == DG_OK)
        s = dg_cp_plan_new(r->cp, r->rank % r->cp, cu[Bd], cu, Bd, NULL, &r->plan);
    free(cu);
    DG_TRY(s);
    if (r->plan->end - r->plan->begin < o->model.conv - 1)
        return dg__err(DG_ERR_ARG,
                       "--cp %d: each rank holds %lld tokens, fewer than the conv width - 1 = %d; "
                       "use a longer --seq-len or a smaller --cp",
                       r->cp, (long long)(r->plan->end - r->plan->begin), o->model.conv - 1);
    r->m->cp_comm = r->cp_comm;
    r->m->cp_plan = r->plan;
    return DG_OK;
}

static dg_status evaluate(run *r, double *out) {
    const dg_train_opts *o = &r->o;
    int64_t n_rows = (int64_t)o->eval_batches * o->batch;
    double total = 0.0;
    dg_status s = DG_OK;
    dg_no_grad_begin();
    for (int b = 0; b < o->eval_batches && s == DG_OK; b++) {
        dg_text_val_batch(&r->text, (int64_t)b * o->batch, n_rows, o->batch, o->seq_len, r->ids,
                          r->tgt);
        dg_tensor *ids = NULL, *tgt = NULL, *loss = NULL;
        double v = 0.0, frac = 1.0;
        s = local_batch(r, &ids, &tgt, &frac);
        if (s == DG_OK)
            s = dg_model_loss(r->m, ids, tgt, &loss);
        if (s == DG_OK)
            s = dg_tensor_item(loss, &v);
        total += v * frac;
        dg_tensor_free(&loss);
        dg_tensor_free(&ids);
        dg_tensor_free(&tgt);
    }
    dg_no_grad_end();
    if (s == DG_OK)
        s = sum_ranks(r, &total);
    *out = total / o->eval_batches;
    return s;
}

/* One optimizer step's forward/backward over the `accum` micro-batches in r->batch. The loss
 * stays on the device: r->loss_acc = sum over micro-batches of this rank's share (summed over
 * ranks), read later. */
static dg_status forward_backward(run *r, size_t *tape_bytes, int *tape_nodes) {
    const dg_train_opts *o = &r->o;
    DG_TRY(dg_tensor_fill_(r->loss_acc, 0.0));
    for (int a = 0; a < o->accum; a++) {
        dg_tensor *ids = NULL, *tgt = NULL, *l = NULL, *ls = NULL;
        const double frac = r->mb_frac;
        dg_status s = micro_batch(r, a, &ids, &tgt);
        dg_profile_mark(r->ctx); /* charge batch preparation to nobody */
        if (s == DG_OK)
            s = dg_model_loss(r->m, ids, tgt, &l);
        if (s == DG_OK && tape_bytes && !*tape_bytes) {
            *tape_bytes = dg_tape_bytes();
            *tape_nodes = dg_tape_num_nodes();
        }
        if (s == DG_OK) /* loss_acc += frac * loss, in f64 */
            s = dg__axpy(r->ctx, r->loss_acc, frac, l);
        if (s == DG_OK) /* this rank's share of the mean over the batch and the micro-batches */
            s = o->accum > 1 || frac != 1.0 ? dg_scale(r->ctx, l, frac / o->accum, &ls)
                                            : (ls = dg_tensor_retain(l), DG_OK);
        if (s == DG_OK)
            s = dg_tape_backward(r->ctx, ls);
        dg_tape_reset();
        dg_tensor_free(&ls);
        dg_tensor_free(&l);
        dg_tensor_free(&ids);
        dg_tensor_free(&tgt);
        DG_TRY(s);
    }
    if (r->world > 1)
        DG_TRY(dg_comm_all_reduce(o->comm, r->loss_acc));
    return sum_grads(r);
}

/* Clip by global norm and apply AdamW to every parameter (dg_adamw: on the device, no sync),
 * with the step and lr set by dg_adamw_set_step before; grads are cleared. The gradient norm
 * goes to step_out[1]. */
static dg_status optimizer_step(run *r) {
    dg_model *m = r->m;
    for (int i = 0; i < m->n_params; i++)
        r->grads[i] = dg_tensor_grad(m->params[i].t);
    dg_status s = dg_adamw_update(r->opt, r->grads);
    for (int i = 0; i < m->n_params; i++) {
        r->grads[i] = NULL;
        dg_tensor_zero_grad(m->params[i].t);
    }
    dg_tensor *dst = NULL, *norm = NULL;
    if (s == DG_OK)
        s = dg_slice(r->step_out, 0, 1, 2, &dst);
    if (s == DG_OK) /* dg_adamw_stats: {norm, coef} */
        s = dg_slice((dg_tensor *)dg_adamw_stats(r->opt), 0, 0, 1, &norm);
    if (s == DG_OK)
        s = dg_tensor_copy_(dst, norm);
    dg_tensor_free(&dst);
    dg_tensor_free(&norm);
    return s;
}

/* The device work of a step once its batch is in r->batch and dg_adamw_set_step has run: what
 * a CUDA graph captures (see train_step). */
static dg_status step_core(run *r, size_t *tape_bytes, int *tape_nodes) {
    DG_TRY(forward_backward(r, tape_bytes, tape_nodes));
    return optimizer_step(r);
}

/* Keep the step's loss sum and gradient norm on the device, in the ring's next slot (one device
 * copy, no sync). Outside the graph: the slot moves from step to step, a replay writes the
 * addresses its capture wrote. */
static dg_status push_step(run *r, int64_t step, double lr) {
    if (r->ring_n == 0)
        r->ring_first = step;
    const int64_t k = r->ring_n;
    dg_tensor *dst = NULL;
    dg_status s = dg_slice(r->ring, 0, 2 * k, 2 * k + 2, &dst);
    if (s == DG_OK)
        s = dg_tensor_copy_(dst, r->step_out);
    dg_tensor_free(&dst);
    r->ring_lr[k] = lr;
    r->ring_n++;
    return s;
}

/* This rank's bad-input record (dg_ctx_check_errors); the error says `when` it was found. */
static dg_status check_inputs_local(run *r, const char *when) {
    dg_status s = dg_ctx_check_errors(r->ctx);
    if (s == DG_OK)
        return DG_OK;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", dg_last_error());
    return dg__err(s, "%s (found %s)", msg, when);
}

/* The bad inputs the kernels recorded since the last check (dg_ctx_check_errors), on every rank:
 * if any rank has one, every rank stops here (they would deadlock otherwise). `when` says which
 * steps the check covers. */
static dg_status check_inputs(run *r, const char *when) {
    dg_status s = check_inputs_local(r, when);
    if (r->world == 1)
        return s;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", s != DG_OK ? dg_last_error() : "");
    double bad = s != DG_OK;
    DG_TRY(sum_ranks(r, &bad));
    if (s != DG_OK)
        return dg__err(s, "%s", msg);
    if (bad > 0)
        return dg__err(DG_ERR_ARG, "another rank found a bad input %s (see its error)", when);
    return DG_OK;
}

/* The host's copy of the ring, checked: losses[k] (mean over micro-batches) and gnorms[k] of
 * steps ring_first + k. Reads the bad-input record first, then the ring: two device reads. */
static dg_status read_steps(run *r, double *losses, double *gnorms) {
    const int64_t a = r->ring_first, b = r->ring_first + r->ring_n - 1;
    char when[96];
    if (a == b)
        snprintf(when, sizeof when, "by the check after step %lld", (long long)b);
    else
        snprintf(when, sizeof when, "by the check after steps %lld-%lld", (long long)a,
                 (long long)b);
    DG_TRY(check_inputs(r, when));
    double *h = NULL;
    DG_TRY(dg_tensor_to_f64(r->ring, &h));
    dg_status s = DG_OK;
    for (int64_t k = 0; k < r->ring_n && s == DG_OK; k++) {
        losses[k] = h[2 * k] / r->o.accum;
        gnorms[k] = h[2 * k + 1];
        const char *range = a == b ? "" : when;
        if (!isfinite(losses[k]))
            s = dg__err(DG_ERR_NUMERIC, "training diverged: loss is %g at step %lld%s%s%s",
                        losses[k], (long long)(a + k), *range ? " (found " : "", range,
                        *range ? ")" : "");
        else if (!isfinite(gnorms[k]))
            s = dg__err(DG_ERR_NUMERIC, "training diverged: gradient norm is %g at step %lld%s%s%s",
                        gnorms[k], (long long)(a + k), *range ? " (found " : "", range,
                        *range ? ")" : "");
    }
    free(h);
    return s;
}

/* log.csv: fresh for a new run; on resume keep the lines up to the resumed step. Written to
 * log.csv.tmp and renamed, so a failure leaves the old log and no temp file. */
static dg_status open_csv(run *r) {
    snprintf(r->csv_path, sizeof r->csv_path, "%s/log.csv", r->o.out_dir);
    char tmp[DG_PATH_MAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp", r->csv_path);
    FILE *out = fopen(tmp, "w");
    if (!out)
        return dg__err(DG_ERR_IO, "--out: cannot write '%s': %s", tmp, strerror(errno));
    int ok = fprintf(out, "%s\n", CSV_HEADER) > 0;
    FILE *in = NULL;
    if (r->o.resume) {
        uint64_t size = 0;
        if (access(r->csv_path, F_OK) == 0 &&
            dg__open_read("--resume", r->csv_path, &in, &size) != DG_OK) {
            fclose(out);
            remove(tmp);
            return DG_ERR_IO;
        }
    }
    if (in) {
        char line[1024];
        while (ok && fgets(line, sizeof line, in)) {
            char *end;
            long long st = strtoll(line, &end, 10);
            if (end != line && *end == ',' && st >= 1 && st <= r->state.step)
                ok = fputs(line, out) >= 0;
        }
        fclose(in);
    }
    int e = 0;
    if (!ok || fflush(out) != 0 || ferror(out))
        e = errno ? errno : EIO;
    if (fclose(out) != 0 && !e)
        e = errno;
    if (!e && rename(tmp, r->csv_path) != 0)
        e = errno;
    if (e) {
        remove(tmp);
        return dg__err(DG_ERR_IO, "--out: cannot write '%s': %s", r->csv_path, strerror(e));
    }
    r->csv = fopen(r->csv_path, "a");
    if (!r->csv)
        return dg__err(DG_ERR_IO, "--out: cannot append to '%s': %s", r->csv_path, strerror(errno));
    return DG_OK;
}

/* One step's line of log.csv, flushed; any failure (a full disk) stops the run. */
static dg_status csv_line(run *r, int64_t step, double loss, int have_val, double v, double lr,
                          double gnorm, double tok_s, double elapsed, size_t mem) {
    errno = 0;
    int ok = fprintf(r->csv, "%lld,%.6f,", (long long)step, loss) > 0;
    if (ok && have_val)
        ok = fprintf(r->csv, "%.6f", v) > 0;
    if (ok)
        ok = fprintf(r->csv, ",%.6g,%.6g,%.1f,%.3f,%zu\n", lr, gnorm, tok_s, elapsed, mem) > 0;
    if (ok)
        ok = fflush(r->csv) == 0 && !ferror(r->csv);
    if (ok)
        return DG_OK;
    int e = errno ? errno : EIO;
    char last[64] = "no checkpoint was written by this run";
    if (r->ckpt_step > 0)
        snprintf(last, sizeof last, "the last checkpoint is from step %lld",
                 (long long)r->ckpt_step);
    return dg__err(DG_ERR_IO,
                   "--out: writing step %lld to '%s' failed: %s; the run stops here (%s)",
                   (long long)step, r->csv_path, strerror(e), last);
}

/* Takes DIR/train.lock for the run (see train.h). */
static dg_status lock_dir(run *r) {
    char path[DG_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/train.lock", r->o.out_dir);
    DG_TRY(dg__check_not_special("--out", path));
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0)
        return dg__err(DG_ERR_IO, "--out: cannot create the lock file '%s': %s", path,
                       strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char who[32] = "";
        ssize_t n = pread(fd, who, sizeof who - 1, 0);
        who[n > 0 ? n : 0] = 0;
        who[strcspn(who, "\n")] = 0;
        close(fd);
        if (e == EWOULDBLOCK)
            return dg__err(DG_ERR_STATE,
                           "--out: '%s' is in use by another trainer (pid %s holds '%s'); two "
                           "runs cannot share a directory",
                           r->o.out_dir, who[0] ? who : "?", path);
        return dg__err(DG_ERR_IO, "--out: cannot lock '%s': %s", path, strerror(e));
    }
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
        /* the pid is only informative; the lock itself is held */
    }
    r->lock_fd = fd;
    return DG_OK;
}

/* A fresh run must not silently replace the run already in DIR. */
static dg_status check_fresh_dir(run *r) {
    const char *dir = r->o.out_dir;
    char csv[DG_PATH_MAX + 32], ck[DG_PATH_MAX + 64];
    snprintf(csv, sizeof csv, "%s/log.csv", dir);
    dg_ckpt_latest_path(dir, ck, sizeof ck);
    DG_TRY(dg__check_not_special("--out", csv));
    DG_TRY(dg__check_not_special("--out", ck));
    struct stat sb;
    int has_csv = lstat(csv, &sb) == 0, has_ck = lstat(ck, &sb) == 0;
    if (!has_csv && !has_ck)
        return DG_OK;
    if (!r->o.overwrite)
        return dg__err(DG_ERR_ARG,
                       "--out: '%s' already holds a run (%s%s%s): pass --resume to continue it, "
                       "--overwrite to replace it, or another --out",
                       dir, has_csv ? "log.csv" : "", has_csv && has_ck ? ", " : "",
                       has_ck ? DG_CKPT_LATEST : "");
    /* --overwrite: the old checkpoints go first, so an early failure cannot pair the new log
     * with the old run's checkpoint */
    DIR *d = opendir(dir);
    if (!d)
        return dg__err(DG_ERR_IO, "--out: cannot list '%s': %s", dir, strerror(errno));
    struct dirent *e;
    char p[DG_PATH_MAX + 300];
    dg_status s = DG_OK;
    while ((e = readdir(d)) != NULL && s == DG_OK) {
        const char *nm = e->d_name;
        size_t n = strlen(nm);
        if (strncmp(nm, "ckpt_", 5) != 0 || n < 12 || strcmp(nm + n - 12, ".safetensors") != 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, nm);
        if (remove(p) != 0)
            s = dg__err(DG_ERR_IO, "--overwrite: cannot remove '%s': %s", p, strerror(errno));
    }
    closedir(d);
    return s;
}

static dg_status save_ckpt(run *r, int64_t step) {
    if (r->rank != 0) /* every rank holds the same weights: one writes */
        return DG_OK;
    char path[DG_PATH_MAX + 64];
    dg_ckpt_latest_path(r->o.out_dir, path, sizeof path);
    /* never from weights a bad input reached: the loop checked every rank just before; this is
     * the writer's own last look at its record */
    char when[64];
    snprintf(when, sizeof when, "before writing the checkpoint of step %lld", (long long)step);
    DG_TRY(check_inputs_local(r, when));
    DG_TRY(dg_ckpt_save(path, r->m, r->am, r->av, &r->o, &r->state));
    if (r->o.keep_step_ckpts) {
        char sp[DG_PATH_MAX + 64];
        snprintf(sp, sizeof sp, "%s/ckpt_step%06lld.safetensors", r->o.out_dir, (long long)step);
        DG_TRY(dg_ckpt_save(sp, r->m, r->am, r->av, &r->o, &r->state));
    }
    r->ckpt_step = step;
    emitf(r, DG_EV_CKPT, "%s", path);
    return DG_OK;
}

static dg_status sample(run *r, int64_t step) {
    const dg_train_opts *o = &r->o;
    if (r->rank != 0) /* rank 0 samples alone, with the unsplit model */
        return DG_OK;
    int np = (int)strlen(o->prompt);
    uint8_t *buf = malloc((size_t)np + (size_t)o->sample_tokens + 1);
    if (!buf)
        return dg__err(DG_ERR_NOMEM, "sampling: out of host memory");
    memcpy(buf, o->prompt, (size_t)np);
    /* its own stream: sampling never moves the training data position */
    uint64_t seed = o->seed * 0x9e3779b97f4a7c15ull + (uint64_t)step + 0x5a5a;
    r->m->cp_plan = NULL;
    dg_status s = dg_model_generate(r->m, (const uint8_t *)o->prompt, np, o->sample_tokens,
                                    o->temperature, o->top_k, seed, buf + np, NULL, NULL);
    r->m->cp_plan = r->plan;
    if (s == DG_OK) {
        buf[np + o->sample_tokens] = 0;
        dg_train_event ev;
        memset(&ev, 0, sizeof ev);
        ev.kind = DG_EV_SAMPLE;
        ev.step = step;
        ev.text = (const char *)buf;
        emit(r, ev);
    }
    free(buf);
    return s;
}

static void header(run *r) {
    const dg_train_opts *o = &r->o;
    const dg_model_config *c = &o->model;
    int64_t np = dg_model_num_params(r->m), tok = (int64_t)o->batch * o->seq_len * o->accum;
    char out[DG_PATH_MAX + 64];
    snprintf(out, sizeof out, "%s", o->out_dir[0] ? o->out_dir : "(none: no log, no checkpoints)");
    emitf(r, DG_EV_HEADER,
          "config %s: %lld parameters (%.2fM)\n"
          "  model   %s mixer, d=%d layers=%d heads=%d/%d K=%d V=%d I=%d conv=%d chunk=%d "
          "gate=%s%s%s\n"
          "  data    %s: %lld bytes (%lld train / %lld validation)\n"
          "  batch   %d x %d bytes x accum %d = %lld tokens/step; %lld steps, first %lld, last "
          "%lld\n"
          "  optim   AdamW lr %g (warmup %lld, cosine to %g%%) betas %g/%g eps %g wd %g, clip "
          "%g; seed %llu\n"
          "  device  %s, params %s, compute %s, recompute %s%s\n"
          "  eval    every %lld steps on %d x %d fixed validation windows\n"
          "  out     %s",
          o->config_name, (long long)np, np / 1e6, dg_mixer_name(c->mixer), c->d, c->n_layers,
          c->n_heads, c->n_v_heads, c->head_k, c->head_v, c->inter, c->conv, c->chunk,
          c->gate == DG_GATE_KDA ? "kda" : "lower_bound", c->gate == DG_GATE_KDA ? "" : " lb=",
          c->gate == DG_GATE_KDA ? "" : (c->lower_bound == -5.0 ? "-5" : "custom"), o->data_path,
          (long long)r->text.n, (long long)r->text.n_train,
          (long long)(r->text.n - r->text.n_train), o->batch, o->seq_len, o->accum, (long long)tok,
          (long long)o->steps, (long long)r->state.step + 1, (long long)r->last_step, o->lr,
          (long long)o->warmup, 100.0 * o->min_lr_frac, o->beta1, o->beta2, o->adam_eps,
          o->weight_decay, o->clip, (unsigned long long)o->seed,
          dg_device_str(dg_ctx_device(r->ctx)), dg_dtype_name(o->param_dtype),
          dg_dtype_name(o->compute_dtype),
          o->recompute == DG_POLICY_CACHE       ? "none (cache everything)"
          : o->recompute == DG_POLICY_RECOMPUTE ? "all (recompute everything)"
                                                : "default (per-op choice)",
          dg_ctx_device(r->ctx).kind != DG_DEV_CUDA ? ""
          : r->graph_on                             ? ", CUDA graph on (--graph)"
                                                    : ", CUDA graph off (--graph)",
          (long long)(o->eval_every ? o->eval_every : o->steps), o->eval_batches, o->batch, out);
}

/* ---- setup ---------------------------------------------------------------------------------- */

/* The optimizer over every parameter and what a step keeps on the device; bad inputs found by
 * kernels are recorded, not read back, from here on (read by check_inputs). */
static dg_status setup_step_state(run *r) {
    const dg_train_opts *o = &r->o;
    const int n = r->m->n_params;
    dg_tensor **ps = calloc((size_t)n + 1, sizeof *ps);
    int *decay = calloc((size_t)n + 1, sizeof *decay);
    r->grads = calloc((size_t)n + 1, sizeof *r->grads);
    r->ring_lr = calloc((size_t)o->log_every, sizeof *r->ring_lr);
    dg_status s = DG_OK;
    if (!ps || !decay || !r->grads || !r->ring_lr)
        s = dg__err(DG_ERR_NOMEM, "optimizer: out of host memory");
    for (int i = 0; s == DG_OK && i < n; i++) {
        ps[i] = r->m->params[i].t;
        decay[i] = r->m->params[i].decay;
    }
    dg_adamw_hparams hp = {o->lr, o->beta1, o->beta2, o->adam_eps, o->weight_decay};
    if (s == DG_OK)
        s = dg_adamw_new(r->ctx, n, ps, r->am, r->av, decay, &hp, o->clip, &r->opt);
    free(ps);
    free(decay);
    int64_t two = 2, len = 2 * o->log_every;
    if (s == DG_OK)
        s = dg_tensor_zeros(r->ctx, DG_F64, 1, &two, &r->step_out);
    if (s == DG_OK)
        s = dg_slice(r->step_out, 0, 0, 1, &r->loss_acc);
    if (s == DG_OK)
        s = dg_tensor_zeros(r->ctx, DG_F64, 1, &len, &r->ring);
    /* the step's batch: accum micro-batches of ids and targets, and its staging buffers */
    const int64_t nb = 2 * (int64_t)o->accum * r->mb_shape[0] * r->mb_shape[1];
    if (s == DG_OK)
        s = dg_tensor_new(r->ctx, DG_I32, 1, &nb, &r->batch);
    if (s == DG_OK)
        s = dg_stage_new(r->ctx, dg_tensor_nbytes(r->batch), &r->stage);
    dg_ctx_defer_checks(r->ctx, 1);
    return s;
}

/* --graph: whether the step is captured (see train.h). */
static dg_status setup_graph(run *r) {
    const dg_train_opts *o = &r->o;
    const char *why = NULL;
    if (dg_ctx_device(r->ctx).kind != DG_DEV_CUDA)
        why = "CUDA graphs need a CUDA device (--device cuda); on the CPU every op runs at once, "
              "there is nothing to capture";
    else if (r->world > 1)
        why = "the step is captured for one process only: with several, the gradient and loss "
              "sums over ranks (and the context-parallel ops) are host-driven collectives "
              "bounded by timeouts, which a graph cannot replay";
    else if (dg_profile_enabled())
        why = "--profile times every tape node with a device sync, and a graph replay runs no "
              "host code";
    if (o->graph == DG_TRAIN_GRAPH_ON && why)
        return dg__err(DG_ERR_ARG, "--graph on: %s; use --graph off (or leave --graph out)", why);
    r->graph_on = o->graph != DG_TRAIN_GRAPH_OFF && !why;
    return DG_OK;
}

static dg_status setup(run *r, const dg_train_opts *in) {
    r->o = *in;
    dg_train_opts *o = &r->o;
    DG_TRY(dg_ctx_new(o->device, &r->ctx));
    /* an existing run directory is locked before anything in it is read */
    struct stat dsb;
    if (o->out_dir[0] && (!o->comm || dg_comm_rank(o->comm) == 0) && stat(o->out_dir, &dsb) == 0 &&
        S_ISDIR(dsb.st_mode))
        DG_TRY(lock_dir(r));
    dg_ckpt ck;
    memset(&ck, 0, sizeof ck);
    if (o->resume) {
        char path[DG_PATH_MAX + 64];
        dg_ckpt_latest_path(o->out_dir, path, sizeof path);
        if (access(path, F_OK) != 0)
            return dg__err(DG_ERR_IO, "--resume: no checkpoint '%s' to resume from", path);
        DG_TRY(dg_ckpt_load(r->ctx, path, &ck));
        /* the run is the checkpoint's: model, schedule, batch shape, seed, data */
        const dg_train_opts *c = &ck.opts;
        o->model = ck.cfg;
        snprintf(o->config_name, sizeof o->config_name, "%s", c->config_name);
        o->steps = o->resume_steps > 0 ? o->resume_steps : c->steps;
        o->batch = c->batch, o->seq_len = c->seq_len, o->accum = c->accum;
        o->lr = c->lr, o->min_lr_frac = c->min_lr_frac, o->warmup = c->warmup;
        o->beta1 = c->beta1, o->beta2 = c->beta2, o->adam_eps = c->adam_eps;
        o->weight_decay = c->weight_decay, o->clip = c->clip, o->seed = c->seed;
        o->eval_batches = c->eval_batches, o->max_data_bytes = c->max_data_bytes;
        o->param_dtype = c->param_dtype;
        if (!o->data_path[0])
            snprintf(o->data_path, sizeof o->data_path, "%s", c->data_path);
        r->state = ck.state;
    }
    dg_status s = check_opts(o);
    if (s == DG_OK)
        s = dg_text_load(o->data_path, o->max_data_bytes, o->seq_len, &r->text);
    if (s == DG_OK && o->resume &&
        (r->text.hash != ck.state.data_hash || r->text.n != ck.state.data_bytes))
        s = dg__err(DG_ERR_ARG,
                    "--resume: the text '%s' (%lld bytes) is not the one the checkpoint was "
                    "trained on (%lld bytes, hash %016llx); pass --data with that file",
                    o->data_path, (long long)r->text.n, (long long)ck.state.data_bytes,
                    (unsigned long long)ck.state.data_hash);
    if (s == DG_OK)
        s = dg_model_new(r->ctx, &o->model, o->param_dtype, o->compute_dtype, &r->m);
    if (s == DG_OK)
        s = setup_dist(r);
    if (s == DG_OK) {
        set_local_part(r);
        s = setup_graph(r);
    }
    if (s == DG_OK && o->resume)
        s = dg_ckpt_restore_model(&ck, r->m);
    else if (s == DG_OK)
        s = dg_model_init(r->m, o->seed);
    if (s == DG_OK) {
        r->am = calloc((size_t)r->m->n_params, sizeof *r->am);
        r->av = calloc((size_t)r->m->n_params, sizeof *r->av);
        if (!r->am || !r->av)
            s = dg__err(DG_ERR_NOMEM, "optimizer: out of host memory");
    }
    for (int i = 0; s == DG_OK && i < r->m->n_params; i++) {
        const dg_tensor *p = r->m->params[i].t;
        dg_dtype dt = dg_tensor_dtype(p) == DG_F64 ? DG_F64 : DG_F32;
        s = dg_tensor_zeros(r->ctx, dt, dg_tensor_ndim(p), dg_tensor_shape(p), &r->am[i]);
        if (s == DG_OK)
            s = dg_tensor_zeros(r->ctx, dt, dg_tensor_ndim(p), dg_tensor_shape(p), &r->av[i]);
    }
    if (s == DG_OK && o->resume)
        s = dg_ckpt_restore_optim(&ck, r->m, r->am, r->av);
    dg_ckpt_free(&ck);
    DG_TRY(s);
    DG_TRY(setup_step_state(r));
    if (!o->resume) {
        r->state.step = 0;
        r->state.data_counter = 0;
    }
    r->state.data_hash = r->text.hash;
    r->state.data_bytes = r->text.n;
    r->ids = malloc((size_t)o->batch * (size_t)o->seq_len * sizeof *r->ids);
    r->tgt = malloc((size_t)o->batch * (size_t)o->seq_len * sizeof *r->tgt);
    if (!r->ids || !r->tgt)
        return dg__err(DG_ERR_NOMEM, "batches: out of host memory");
    if (o->out_dir[0] && r->rank == 0) {
        DG_TRY(mkdir_p(o->out_dir));
        if (r->lock_fd < 0)
            DG_TRY(lock_dir(r));
        if (!o->resume)
            DG_TRY(check_fresh_dir(r));
        dg_ckpt_clean_temps(o->out_dir);
        DG_TRY(open_csv(r));
    }
    return DG_OK;
}

static void teardown(run *r) {
    /* the graph and the stage first: both may still have work in flight on the context */
    dg_graph_free(&r->graph);
    dg_stage_free(&r->stage);
    if (r->csv)
        fclose(r->csv);
    if (r->lock_fd >= 0)
        close(r->lock_fd); /* releases the flock */
    for (int i = 0; r->m && i < r->m->n_params; i++) {
        if (r->am)
            dg_tensor_free(&r->am[i]);
        if (r->av)
            dg_tensor_free(&r->av[i]);
    }
    free(r->am);
    free(r->av);
    dg_adamw_free(&r->opt);
    free(r->grads);
    dg_tensor_free(&r->loss_acc);
    dg_tensor_free(&r->step_out);
    dg_tensor_free(&r->batch);
    dg_tensor_free(&r->ring);
    free(r->ring_lr);
    free(r->ids);
    free(r->tgt);
    dg_model_free(&r->m);
    dg_cp_plan_free(&r->plan);
    dg_comm_free(&r->cp_comm);
    dg_text_free(&r->text);
    dg_tape_reset();
    dg_ctx_free(&r->ctx);
}

void dg_train_result_free(dg_train_result *res) {
    if (!res)
        return;
    free(res->losses);
    memset(res, 0, sizeof *res);
}

/* ---- the loop ------------------------------------------------------------------------------- */

/* Capture the step's device work (step_core) in a CUDA graph and launch it for this step. The
 * step before ran the same calls eagerly and released what they returned, so the allocator's
 * cache holds every block the capture asks for, the KDA chunk tables are on the device and
 * every kernel is loaded. If the capture fails, the run says why (DG_EV_WARN) and this step and
 * every later one run eagerly. */
static dg_status capture_step(run *r, int64_t step, dg_train_result *res) {
    char why[2048] = "";
    dg_status s = dg_graph_begin(r->ctx);
    if (s == DG_OK) {
        dg_status sc = step_core(r, NULL, NULL);
        if (sc != DG_OK) /* a call refused during the capture (the capture may still end well) */
            snprintf(why, sizeof why, "%s", dg_last_error());
        dg_graph *g = NULL;
        s = dg_graph_end(r->ctx, &g); /* on failure: its message names the capture's first error */
        if (s == DG_OK && sc != DG_OK) {
            dg_graph_free(&g);
            s = sc;
        } else if (s != DG_OK) {
            snprintf(why, sizeof why, "%s", dg_last_error());
        }
        if (s == DG_OK) {
            r->graph = g;
            dg_mem_stats ms = dg_ctx_mem_stats(r->ctx);
            emitf(r, DG_EV_INFO,
                  "CUDA graph: step %lld captured (forward, backward, AdamW over %d "
                  "micro-batch%s); later steps replay it (its temporaries: %.2f MiB kept for "
                  "it; --graph off runs every step eagerly)",
                  (long long)step, r->o.accum, r->o.accum > 1 ? "es" : "",
                  (double)ms.graph / 1048576.0);
            if (res)
                res->graph_steps++;
            return dg_graph_launch(r->ctx, r->graph);
        }
    } else {
        snprintf(why, sizeof why, "%s", dg_last_error());
    }
    dg_clear_error();
    r->graph_on = 0;
    /* nothing of the capture ran: drop what it left on the host side and run the step eagerly */
    dg_tape_reset();
    for (int i = 0; i < r->m->n_params; i++)
        dg_tensor_zero_grad(r->m->params[i].t);
    emitf(r, DG_EV_WARN,
          "CUDA graph: capturing step %lld failed, so every step runs eagerly (--graph off "
          "skips the attempt): %s",
          (long long)step, why);
    return step_core(r, NULL, NULL);
}

/* One step, queued: its batch uploaded (asynchronously), the step's lr and bias corrections
 * written to the device (dg_adamw_set_step), forward/backward over the micro-batches and AdamW
 * (eagerly, or as one launch of the captured graph), the step's loss and norm into the ring.
 * No host sync (on CUDA the host may run ahead of the device, by two steps at most: the
 * stage's buffers). */
static dg_status train_step(run *r, int64_t step, int64_t first, dg_train_result *res) {
    const dg_train_opts *o = &r->o;
    double lr = dg_train_lr(o, step);
    size_t tb = 0;
    int tn = 0;
    if (step == first)
        dg_ctx_reset_peak(r->ctx);
    DG_TRY(upload_batch(r));
    /* outside the graph: it writes this step's values into the device memory the update reads
     * (inside, the capture would keep the captured step's values as kernel arguments) */
    DG_TRY(dg_adamw_set_step(r->opt, step, lr));
    if (r->graph) {
        DG_TRY(dg_graph_launch(r->ctx, r->graph));
        if (res)
            res->graph_steps++;
    } else if (r->graph_on && step > first) {
        DG_TRY(capture_step(r, step, res));
    } else {
        DG_TRY(step_core(r, step == first ? &tb : NULL, &tn));
    }
    if (step == first) {
        if (res)
            res->tape_bytes = tb;
        emitf(r, DG_EV_INFO, "tape after the first forward: %d nodes holding %.2f MiB (%s)", tn,
              tb / 1048576.0,
              o->recompute == DG_POLICY_CACHE       ? "--recompute none"
              : o->recompute == DG_POLICY_RECOMPUTE ? "--recompute all"
                                                    : "--recompute default");
    }
    DG_TRY(push_step(r, step, lr));
    r->state.step = step;
    return DG_OK;
}

static dg_status loop(run *r, dg_train_result *res) {
    const dg_train_opts *o = &r->o;
    int64_t first = r->state.step + 1;
    r->last_step = o->stop_at > 0 && o->stop_at < o->steps ? o->stop_at : o->steps;
    if (res) {
        res->losses = malloc((size_t)o->steps * sizeof *res->losses);
        if (!res->losses)
            return dg__err(DG_ERR_NOMEM, "result: out of host memory");
        for (int64_t i = 0; i < o->steps; i++)
            res->losses[i] = NAN;
        res->first_step = first;
        res->last_step = first - 1;
        res->final_val = NAN;
        res->n_params = dg_model_num_params(r->m);
    }
    header(r);
    if (r->world > 1)
        emitf(r, DG_EV_INFO,
              "%d processes (%s): %d data-parallel group%s of %d context-parallel rank%s; "
              "rank 0 holds tokens [%lld, %lld) of its group's %d rows packed end to end",
              r->world, dg_comm_kind(o->comm) == DG_COMM_NCCL ? "NCCL" : "MPI", r->dp,
              r->dp > 1 ? "s" : "", r->cp, r->cp > 1 ? "s" : "",
              (long long)(r->plan ? r->plan->begin : 0),
              (long long)(r->plan ? r->plan->end : (int64_t)o->batch / r->dp * o->seq_len),
              o->batch / r->dp);
    if (first > r->last_step) {
        emitf(r, DG_EV_INFO,
              "the checkpoint is at step %lld of %lld: nothing to do (pass --steps N to train "
              "further)",
              (long long)r->state.step, (long long)o->steps);
        return DG_OK;
    }
    if (o->resume)
        emitf(r, DG_EV_INFO, "resumed from step %lld (data position %llu)",
              (long long)r->state.step, (unsigned long long)r->state.data_counter);
    int64_t tokens_per_step = (int64_t)o->batch * o->seq_len * o->accum;
    double train_time = 0.0, val = NAN;
    int64_t steps_timed = 0;
    double *losses = malloc((size_t)o->log_every * sizeof *losses);
    double *gnorms = malloc((size_t)o->log_every * sizeof *gnorms);
    if (!losses || !gnorms) {
        free(losses);
        free(gnorms);
        return dg__err(DG_ERR_NOMEM, "log: out of host memory");
    }
    r->t_start = now_s();
    r->t_mark = r->t_start;
    r->ring_n = 0;
    dg_status s = DG_OK;
    for (int64_t step = first; step <= r->last_step && s == DG_OK; step++) {
        s = train_step(r, step, first, res);
        if (s != DG_OK)
            break;
        /* the host looks at the device only here: every log_every steps and wherever it must */
        int do_eval = (o->eval_every > 0 && step % o->eval_every == 0) || step == r->last_step;
        int do_sample =
            o->sample_tokens > 0 && o->sample_every >= 0 &&
            ((o->sample_every > 0 && step % o->sample_every == 0) || step == r->last_step);
        int do_ckpt = o->out_dir[0] &&
                      ((o->ckpt_every > 0 && step % o->ckpt_every == 0) || step == r->last_step);
        int read = r->ring_n == o->log_every || do_eval || do_sample || do_ckpt;
        /* one process looks at the stop flag after every step; several agree on it where they
         * all read anyway, or they would deadlock */
        int stop = o->stop && *o->stop && (r->world == 1 || read);
        if (r->world > 1 && read) {
            double any = stop;
            s = sum_ranks(r, &any);
            stop = any > 0;
        }
        if (s != DG_OK || !(read || stop))
            continue;
        const int64_t n = r->ring_n, a = r->ring_first;
        s = read_steps(r, losses, gnorms);
        if (s != DG_OK)
            break;
        r->ring_n = 0;
        /* the interval's time, spread evenly over its steps (without syncs, a step's own time
         * is not known) */
        double span = now_s() - r->t_mark, dt = span / (double)n;
        train_time += span;
        steps_timed += n;
        double tok_s = tokens_per_step / (dt > 0 ? dt : 1e-9);
        double v = NAN;
        if (do_eval) {
            s = evaluate(r, &v);
            if (s == DG_OK)
                s = check_inputs(r, "by the check after the evaluation");
            if (s != DG_OK)
                break;
            val = v;
        }
        double elapsed = now_s() - r->t_start;
        size_t mem = mem_bytes(r);
        for (int64_t k = 0; k < n && s == DG_OK; k++) {
            const int64_t st = a + k;
            const int ev_here = do_eval && st == step;
            if (res) {
                res->losses[st - 1] = losses[k];
                res->last_step = st;
                res->tokens += tokens_per_step;
                res->final_val = val;
            }
            if (r->csv)
                s = csv_line(r, st, losses[k], ev_here, v, r->ring_lr[k], gnorms[k], tok_s, elapsed,
                             mem);
            dg_train_event ev;
            memset(&ev, 0, sizeof ev);
            ev.kind = DG_EV_STEP;
            ev.step = st;
            ev.loss = losses[k];
            ev.val_loss = ev_here ? v : NAN;
            ev.lr = r->ring_lr[k];
            ev.grad_norm = gnorms[k];
            ev.tok_s = tok_s;
            ev.elapsed_s = elapsed;
            ev.eta_s = (train_time / steps_timed) * (double)(r->last_step - st);
            ev.mem_bytes = mem;
            if (ev_here) { /* first, so the step's own line can show it */
                ev.kind = DG_EV_EVAL;
                emit(r, ev);
                ev.kind = DG_EV_STEP;
            }
            emit(r, ev);
        }
        if (s == DG_OK && do_sample) {
            s = sample(r, step);
            if (s == DG_OK)
                s = check_inputs(r, "by the check after sampling");
        }
        if (s == DG_OK && o->out_dir[0] && (do_ckpt || stop))
            s = save_ckpt(r, step);
        r->t_mark = now_s();
        if (s == DG_OK && stop && step < r->last_step) {
            g_interrupted = 1;
            if (r->world > 1) { /* the others wait until rank 0 has written the checkpoint */
                double done = 0;
                s = sum_ranks(r, &done);
            }
            if (s == DG_OK && o->out_dir[0])
                s = dg__err(DG_ERR_STATE,
                            "interrupted after step %lld: checkpoint '%s/%s' written; "
                            "continue with --resume --out %s",
                            (long long)step, o->out_dir, DG_CKPT_LATEST, o->out_dir);
            else if (s == DG_OK)
                s = dg__err(DG_ERR_STATE, "interrupted after step %lld (no --out: nothing saved)",
                            (long long)step);
        }
    }
    free(losses);
    free(gnorms);
    DG_TRY(s);
    if (res)
        res->seconds = now_s() - r->t_start;
    if (r->csv) {
        fclose(r->csv);
        r->csv = NULL;
    }
    if (o->plot && o->out_dir[0] && r->rank == 0) {
        dg_status ps = dg_train_plot(o->out_dir);
        if (ps != DG_OK)
            emitf(r, DG_EV_WARN, "%s", dg_last_error());
        else
            emitf(r, DG_EV_INFO, "loss curve: %s/loss.png", o->out_dir);
        dg_clear_error();
    }
    dg_train_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = DG_EV_DONE;
    ev.step = r->state.step;
    ev.val_loss = val;
    ev.elapsed_s = now_s() - r->t_start;
    ev.tok_s = train_time > 0 ? (double)(steps_timed * tokens_per_step) / train_time : 0.0;
    ev.mem_bytes = mem_bytes(r);
    emit(r, ev);
    return DG_OK;
}

dg_status dg_train_run(const dg_train_opts *opts, dg_train_cb cb, void *user,
                       dg_train_result *res) {
    if (!opts)
        return dg__err(DG_ERR_ARG, "dg_train_run: opts must not be NULL");
    if (res)
        memset(res, 0, sizeof *res);
    run *r = calloc(1, sizeof *r);
    if (!r)
        return dg__err(DG_ERR_NOMEM, "dg_train_run: out of host memory");
    r->cb = cb;
    r->user = user;
    r->lock_fd = -1;
    g_interrupted = 0;
    dg_policy saved = dg_policy_get_global();
    dg_policy_set_global(opts->recompute);
    dg_status s = setup(r, opts);
    if (s == DG_OK)
        s = loop(r, res);
    /* keep the error text across teardown */
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", dg_last_error());
    teardown(r);
    free(r);
    dg_policy_set_global(saved);
    if (s == DG_ERR_NOMEM)
        return dg__err(s,
                       "%s\nhint: the run needs less memory with a smaller --batch or --seq-len "
                       "(--accum N keeps the tokens per step), --recompute all, or a smaller model",
                       msg);
    if (s != DG_OK)
        return dg__err(s, "%s", msg);
    return DG_OK;
}

/* ---- the loss curve ------------------------------------------------------------------------- */

static int on_path(const char *prog) {
    const char *path = getenv("PATH");
    if (!path)
        return 0;
    char buf[DG_PATH_MAX];
    const char *p = path;
    while (*p) {
        const char *colon = strchr(p, ':');
        size_t len = colon ? (size_t)(colon - p) : strlen(p);
        snprintf(buf, sizeof buf, "%.*s/%s", (int)len, len ? p : ".", prog);
        if (access(buf, X_OK) == 0)
            return 1;
        if (!colon)
            break;
        p = colon + 1;
    }
    return 0;
}

dg_status dg_train_plot(const char *dir) {
    if (!dir || !*dir)
        return dg__err(DG_ERR_ARG, "--plot: no directory given");
    char csv[DG_PATH_MAX + 32], gp[DG_PATH_MAX + 32];
    snprintf(csv, sizeof csv, "%s/log.csv", dir);
    snprintf(gp, sizeof gp, "%s/loss.gp", dir);
    if (access(csv, R_OK) != 0)
        return dg__err(DG_ERR_IO, "--plot: cannot read '%s': %s", csv, strerror(errno));
    DG_TRY(dg__check_not_special("--plot", csv));
    if (!on_path("gnuplot"))
        return dg__err(DG_ERR_UNSUPPORTED,
                       "gnuplot is not installed (not on PATH): %s/loss.png not drawn; %s has the "
                       "numbers (apt-get install gnuplot-nox to get the plot)",
                       dir, csv);
    FILE *f = fopen(gp, "w");
    if (!f)
        return dg__err(DG_ERR_IO, "--plot: cannot write '%s': %s", gp, strerror(errno));
    fprintf(f, "# loss curve of a deltagrad run: gnuplot loss.gp (in the run directory)\n"
               "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
               "    set terminal pngcairo size 1000,560\n"
               "} else {\n"
               "    set terminal png size 1000,560\n"
               "}\n"
               "set output 'loss.png'\n"
               "set datafile separator ','\n"
               "set datafile missing ''\n"
               "set key autotitle columnhead\n"
               "set title 'deltagrad: KDA byte-level LM'\n"
               "set xlabel 'step'\n"
               "set ylabel 'loss (nats/byte)'\n"
               "set grid\n"
               "set key top right\n"
               "plot 'log.csv' using 1:2 with lines lw 1 lc rgb '#4a90d9' title 'train', \\\n"
               "     'log.csv' using 1:3 with linespoints pt 7 ps 0.8 lw 2 lc rgb '#d94a4a' "
               "title 'validation'\n");
    if (fclose(f) != 0)
        return dg__err(DG_ERR_IO, "--plot: cannot write '%s'", gp);
    pid_t pid = fork();
    if (pid < 0)
        return dg__err(DG_ERR_IO, "--plot: fork failed: %s", strerror(errno));
    if (pid == 0) {
        /* child: run in the directory, quiet */
        if (chdir(dir) != 0)
            _exit(126);
        FILE *null = freopen("/dev/null", "w", stdout);
        FILE *log = freopen("loss.gp.log", "w", stderr);
        (void)null, (void)log;
        execlp("gnuplot", "gnuplot", "loss.gp", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return dg__err(DG_ERR_IO, "gnuplot failed on '%s' (exit %d); see %s/loss.gp.log", gp,
                       WIFEXITED(status) ? WEXITSTATUS(status) : -1, dir);
    char log[DG_PATH_MAX + 32];
    snprintf(log, sizeof log, "%s/loss.gp.log", dir);
    remove(log);
    return DG_OK;
}

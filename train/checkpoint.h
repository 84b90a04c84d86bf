/*
 * train/checkpoint.h -- training checkpoints as safetensors files.
 *
 * Tensors: every parameter under its model name (see model.h; these load into PyTorch as is),
 * plus the AdamW moments as "optim.m.<name>" and "optim.v.<name>".
 * __metadata__ (all strings):
 *   format        "deltagrad-checkpoint/2" (format 1, still loaded: no config.json, and data.path
 *                 as given on the command line)
 *   config        the model config as JSON (model.h; "mixer" is "kda" or "dplr", absent in
 *                 checkpoints written before the DPLR mixer, which are KDA)
 *   config.json   the same config as the reference model's config.json (its keys: model_type,
 *                 hidden_size, num_heads, head_dim, expand_v, safe_gate, lower_bound, ...; ours
 *                 under "deltagrad"); written for readers, the loader reads `config`
 *   step          steps completed
 *   data_counter  training windows drawn so far (the data position; see data.h)
 *   train.*       every hyperparameter that shapes later steps (seed, lr, schedule, batch, ...)
 *   data.*        size and FNV-1a hash of the training text, and its path relative to the
 *                 checkpoint's directory (never absolute; the base name where it cannot be made
 *                 relative)
 * The file is written by dg_safetensors_save: a temp file beside it, fsync, rename. A reader of
 * DIR/ckpt_latest.safetensors therefore sees the previous complete checkpoint or the new one.
 */
#ifndef DG_TRAIN_CHECKPOINT_H
#define DG_TRAIN_CHECKPOINT_H

#include "deltagrad.h"
#include "train/model.h"
#include "train/train.h"

#define DG_CKPT_FORMAT "deltagrad-checkpoint/2"
#define DG_CKPT_FORMAT_1 "deltagrad-checkpoint/1"
#define DG_CKPT_LATEST "ckpt_latest.safetensors"

typedef struct dg_train_state {
    int64_t step;
    uint64_t data_counter;
    uint64_t data_hash;
    int64_t data_bytes;
} dg_train_state;

/* adam_m / adam_v: one per model parameter, or NULL to store weights only. */
dg_status dg_ckpt_save(const char *path, const dg_model *m, dg_tensor *const *adam_m,
                       dg_tensor *const *adam_v, const dg_train_opts *o, const dg_train_state *s);

typedef struct dg_ckpt {
    dg_safetensors st;
    dg_model_config cfg;
    dg_train_opts opts; /* the hyperparameters stored in train.* (others default) */
    dg_train_state state;
    int has_optim;
    int format; /* 1 or 2 (DG_CKPT_FORMAT) */
    char path[DG_PATH_MAX];
} dg_ckpt;

/* Loads and validates a checkpoint (format, config, step). Errors name the path and what is
 * wrong (DG_ERR_IO, DG_ERR_FORMAT). Tensors are placed in ctx. */
dg_status dg_ckpt_load(dg_ctx *ctx, const char *path, dg_ckpt *out);
void dg_ckpt_free(dg_ckpt *c);
/* Copies every parameter of m from the checkpoint (names and shapes must match, and so must the
 * config's mixer: DG_ERR_FORMAT naming both). */
dg_status dg_ckpt_restore_model(const dg_ckpt *c, dg_model *m);
/* Copies the AdamW moments (arrays of m->n_params tensors). */
dg_status dg_ckpt_restore_optim(const dg_ckpt *c, const dg_model *m, dg_tensor *const *adam_m,
                                dg_tensor *const *adam_v);

/* DIR/ckpt_latest.safetensors into buf. */
void dg_ckpt_latest_path(const char *dir, char *buf, size_t n);
/* Removes leftover temp files of interrupted checkpoint writes (names "ckpt_*.safetensors.tmp.*")
 * from dir; returns how many were removed. */
int dg_ckpt_clean_temps(const char *dir);

#endif /* DG_TRAIN_CHECKPOINT_H */

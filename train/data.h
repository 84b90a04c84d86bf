/*
 * train/data.h -- the training text: bytes of one file, a 90/10 train/validation split, and
 * deterministic batches.
 *
 * Training rows are windows of T+1 bytes at positions drawn from a counter-based generator:
 * window number c (counting every row of every batch since step 0) starts at
 * floor(u01(seed, c) * (n_train - T)). A run therefore resumes bit-exactly from (seed, c) alone.
 * Validation rows are fixed, evenly spaced windows of the validation split, so every evaluation
 * of a run (and of runs with the same T) sees the same bytes.
 */
#ifndef DG_TRAIN_DATA_H
#define DG_TRAIN_DATA_H

#include "deltagrad.h"

#include <stdint.h>

typedef struct dg_text {
    uint8_t *bytes;
    int64_t n;       /* total bytes */
    int64_t n_train; /* bytes [0, n_train) train; [n_train, n) validation */
    uint64_t hash;   /* FNV-1a of the bytes: a resumed run checks it is the same text */
} dg_text;

/* Reads `path` (at most max_bytes of it when max_bytes > 0). Errors name the path: a missing or
 * unreadable file (DG_ERR_IO), or one too small for windows of seq_len+1 bytes in both splits
 * (DG_ERR_ARG). */
dg_status dg_text_load(const char *path, int64_t max_bytes, int seq_len, dg_text *out);
void dg_text_free(dg_text *t);

/* Smallest file dg_text_load accepts for seq_len. */
int64_t dg_text_min_bytes(int seq_len);

/* B training rows of T inputs and T targets (i32), windows counter0 .. counter0+B-1. */
void dg_text_train_batch(const dg_text *t, uint64_t seed, uint64_t counter0, int B, int T,
                         int32_t *ids, int32_t *targets);
/* Validation rows row0 .. row0+B-1 of n_rows evenly spaced windows. */
void dg_text_val_batch(const dg_text *t, int64_t row0, int64_t n_rows, int B, int T, int32_t *ids,
                       int32_t *targets);

/* The bundled KJV text: DG_SOURCE_DIR/data/kjv.txt, else data/kjv.txt next to (or one level
 * above) the running binary. Writes the path into buf; returns 0 if no candidate exists (buf
 * then holds the first candidate, for the error message). */
int dg_default_data_path(char *buf, size_t n);

#endif /* DG_TRAIN_DATA_H */

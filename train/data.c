/*
 * train/data.c -- loading the text, the split and deterministic batches (see data.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "train/data.h"
#include "tensor/fileio.h"
#include "tensor/tensor.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int64_t dg_text_min_bytes(int seq_len) {
    /* the validation tenth must hold one window of seq_len+1 bytes */
    return 10 * ((int64_t)seq_len + 1) + 10;
}

dg_status dg_text_load(const char *path, int64_t max_bytes, int seq_len, dg_text *out) {
    if (!out)
        return dg__err(DG_ERR_ARG, "dg_text_load: out must not be NULL");
    memset(out, 0, sizeof *out);
    if (!path || !*path)
        return dg__err(DG_ERR_ARG, "--data: no file given");
    if (seq_len < 1)
        return dg__err(DG_ERR_ARG, "dg_text_load: seq_len must be >= 1 (got %d)", seq_len);
    FILE *f = NULL;
    uint64_t fsize = 0;
    DG_TRY(dg__open_read("--data", path, &f, &fsize));
    int64_t size = fsize > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)fsize;
    if (max_bytes > 0 && size > max_bytes)
        size = max_bytes;
    int64_t need = dg_text_min_bytes(seq_len);
    if (size < need) {
        fclose(f);
        if (size == 0)
            return dg__err(DG_ERR_ARG, "--data: '%s' is empty", path);
        return dg__err(DG_ERR_ARG,
                       "--data: '%s' holds only %lld bytes; --seq-len %d needs at least %lld "
                       "(the 10%% validation split must hold a window of seq-len+1 bytes)",
                       path, (long long)size, seq_len, (long long)need);
    }
    uint8_t *buf = malloc((size_t)size);
    if (!buf) {
        fclose(f);
        return dg__err(DG_ERR_NOMEM, "--data: cannot allocate %lld bytes for '%s'", (long long)size,
                       path);
    }
    size_t got = fread(buf, 1, (size_t)size, f);
    int err = ferror(f);
    fclose(f);
    if (err || got != (size_t)size) {
        free(buf);
        return dg__err(DG_ERR_IO, "--data: reading '%s' failed after %zu of %lld bytes", path, got,
                       (long long)size);
    }
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t i = 0; i < size; i++)
        h = (h ^ buf[i]) * 0x100000001b3ull;
    out->bytes = buf;
    out->n = size;
    out->n_train = size - size / 10;
    out->hash = h;
    return DG_OK;
}

void dg_text_free(dg_text *t) {
    if (!t)
        return;
    free(t->bytes);
    memset(t, 0, sizeof *t);
}

static void window(const dg_text *t, int64_t pos, int T, int32_t *ids, int32_t *targets) {
    for (int i = 0; i < T; i++) {
        ids[i] = t->bytes[pos + i];
        targets[i] = t->bytes[pos + i + 1];
    }
}

void dg_text_train_batch(const dg_text *t, uint64_t seed, uint64_t counter0, int B, int T,
                         int32_t *ids, int32_t *targets) {
    int64_t span = t->n_train - T; /* window starts 0 .. n_train-T-1 */
    for (int b = 0; b < B; b++) {
        int64_t pos = (int64_t)(dg_rand_u01(seed, counter0 + (uint64_t)b) * (double)span);
        if (pos >= span)
            pos = span - 1;
        window(t, pos, T, ids + (int64_t)b * T, targets + (int64_t)b * T);
    }
}

void dg_text_val_batch(const dg_text *t, int64_t row0, int64_t n_rows, int B, int T, int32_t *ids,
                       int32_t *targets) {
    int64_t n_val = t->n - t->n_train;
    int64_t last = n_val - T - 1; /* largest start offset inside the split */
    for (int b = 0; b < B; b++) {
        int64_t r = row0 + b;
        int64_t off = n_rows > 1 ? (r % n_rows) * last / (n_rows - 1) : 0;
        window(t, t->n_train + off, T, ids + (int64_t)b * T, targets + (int64_t)b * T);
    }
}

static int exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

int dg_default_data_path(char *buf, size_t n) {
    char first[4096] = "";
#ifdef DG_SOURCE_DIR
    snprintf(buf, n, "%s/data/kjv.txt", DG_SOURCE_DIR);
    snprintf(first, sizeof first, "%s", buf);
    if (exists(buf))
        return 1;
#endif
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            const char *rel[] = {"data/kjv.txt", "../data/kjv.txt", "../share/deltagrad/kjv.txt"};
            for (size_t i = 0; i < sizeof rel / sizeof *rel; i++) {
                snprintf(buf, n, "%s/%s", exe, rel[i]);
                if (!first[0])
                    snprintf(first, sizeof first, "%s", buf);
                if (exists(buf))
                    return 1;
            }
        }
    }
    snprintf(buf, n, "%s", first[0] ? first : "data/kjv.txt");
    return 0;
}

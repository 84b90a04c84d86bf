/* tests/fuzz/fuzz_data.c -- the training text loader and the batch windows on arbitrary files:
 * the first byte picks seq_len and max_bytes, the rest is the text. */
#define _POSIX_C_SOURCE 200809L /* fuzz_util.h: getpid, dup, dup2, open */
#include "tests/fuzz/fuzz_util.h"
#include "train/data.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2)
        return 0;
    int seq_len = 1 + data[0] % 32;
    int64_t max_bytes = data[1] & 1 ? 0 : (int64_t)(data[1] * 3);
    const char *path = fz_file(data + 2, size - 2, ".txt");
    dg_text t;
    if (dg_text_load(path, max_bytes, seq_len, &t) != DG_OK)
        return 0;
    if (t.n < dg_text_min_bytes(seq_len) || t.n_train <= seq_len || t.n - t.n_train <= seq_len)
        abort();
    int32_t ids[4 * 32], tgt[4 * 32];
    dg_text_train_batch(&t, data[0], (uint64_t)size, 4, seq_len, ids, tgt);
    dg_text_val_batch(&t, data[1], 1 + data[0] % 7, 4, seq_len, ids, tgt);
    for (int i = 0; i < 4 * seq_len; i++)
        if (ids[i] < 0 || ids[i] > 255 || tgt[i] < 0 || tgt[i] > 255)
            abort();
    dg_text_free(&t);
    return 0;
}

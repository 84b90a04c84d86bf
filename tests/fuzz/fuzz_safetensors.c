/* tests/fuzz/fuzz_safetensors.c -- dg_safetensors_load and dg_ckpt_load (metadata, bounds,
 * checksums) on arbitrary bytes. */
#define _POSIX_C_SOURCE 200809L /* fuzz_util.h: getpid, dup, dup2, open */
#include "tests/fuzz/fuzz_util.h"
#include "train/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fz_file(data, size, ".safetensors");
    dg_safetensors st;
    if (dg_safetensors_load(fz_ctx(), path, &st) == DG_OK) {
        for (int i = 0; i < st.n; i++)
            if (!st.names[i] || !st.tensors[i] || dg_safetensors_get(&st, st.names[i]) == NULL)
                abort();
        for (int i = 0; i < st.n_meta; i++)
            if (!dg_safetensors_meta(&st, st.meta_keys[i]))
                abort();
        dg_safetensors_free(&st);
    }
    dg_ckpt c;
    if (dg_ckpt_load(fz_ctx(), path, &c) == DG_OK) {
        /* what a resume would rely on is in range */
        if (c.state.step < 0 || c.state.step > DG_TRAIN_MAX_STEPS || c.opts.batch < 1 ||
            c.opts.batch > DG_TRAIN_MAX_BATCH || c.opts.accum < 1 ||
            c.opts.accum > DG_TRAIN_MAX_ACCUM || c.opts.eval_batches < 1 ||
            c.opts.eval_batches > DG_TRAIN_MAX_EVAL_BATCHES)
            abort();
        dg_model *m = NULL;
        if (dg_model_config_check(&c.cfg) == DG_OK && c.cfg.d <= 64 && c.cfg.inter <= 256 &&
            c.cfg.n_layers <= 2 && (int64_t)c.cfg.n_v_heads * c.cfg.head_v <= 256 &&
            (int64_t)c.cfg.n_heads * c.cfg.head_k <= 256 &&
            dg_model_new(fz_ctx(), &c.cfg, DG_F32, DG_F32, &m) == DG_OK) {
            (void)dg_ckpt_restore_model(&c, m);
            dg_model_free(&m);
        }
        dg_ckpt_free(&c);
    }
    return 0;
}

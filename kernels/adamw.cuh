/*
 * kernels/adamw.cuh -- CUDA launchers of dg_adamw_step and of the multi-tensor dg_adamw
 * (ops/adamw.c). C-compatible.
 */
#ifndef DG_KERNELS_ADAMW_CUH
#define DG_KERNELS_ADAMW_CUH

#include "../tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One AdamW step over n contiguous elements; param, m, v f32, grad f32 or bf16 (gdt).
 *   p -= lr_wd * p   (lr_wd = lr * weight_decay, 0 to skip)
 *   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
 *   p -= lr * (m / bc1) / (sqrt(v / bc2) + eps)      bc1 = 1 - b1^step, bc2 = 1 - b2^step */
dg_status dg__adamw_cuda(dg_ctx *ctx, float *param, dg_dtype gdt, const void *grad, float *m,
                         float *v, int64_t n, float lr, float b1, float b2, float eps, float lr_wd,
                         float bc1, float bc2);

/* ---- multi-tensor AdamW ----
 * The parameters are cut into chunks of DG_ADAMW_CHUNK elements (a parameter's last chunk may
 * be shorter); every kernel runs one grid over all chunks, block c finding its parameter by a
 * binary search of chunk_begin. The per-step scalars live in device memory (sc, f64):
 * norm, clip coefficient, lr, lr * weight_decay, 1 - b1^step, 1 - b2^step. */
#define DG_ADAMW_CHUNK 4096
enum {
    DG_ADAMW_NORM,
    DG_ADAMW_COEF,
    DG_ADAMW_LR,
    DG_ADAMW_LR_WD,
    DG_ADAMW_BC1,
    DG_ADAMW_BC2,
    DG_ADAMW_NSCALARS
};

typedef struct dg_adamw_entry {
    float *p, *m, *v;
    int64_t n;
    int32_t decay, pad;
} dg_adamw_entry;

/* Device pointers (one allocation, ops/adamw.c): entries[n]; chunk_begin[n+1] (parameter i owns
 * chunks [chunk_begin[i], chunk_begin[i+1])); grads[n] and gdt[n] (this step's gradients, NULL:
 * none, and their dtypes); partials[n_chunks]. */
typedef struct dg_adamw_dev {
    dg_adamw_entry *entries;
    int64_t *chunk_begin;
    const void **grads;
    int32_t *gdt;
    double *partials;
    int n;
    int64_t n_chunks;
} dg_adamw_dev;

/* sc[LR..BC2] = the arguments (a one-thread kernel: no sync). */
dg_status dg__adamw_set_step_cuda(dg_ctx *ctx, double *sc, double lr, double lr_wd, double bc1,
                                  double bc2);
/* d->grads[i], d->gdt[i] = grads[i], gdt[i] for i < d->n (kernel arguments: no sync). */
dg_status dg__adamw_set_grads_cuda(dg_ctx *ctx, const dg_adamw_dev *d, const void *const *grads,
                                   const dg_dtype *gdt);
/* sc[NORM] = sqrt(sum of squares of every gradient) in f64 (per-chunk fixed trees, then one
 * fixed tree over the chunks: bitwise repeatable); sc[COEF] = clip / (norm + 1e-6) when clip > 0
 * and norm > clip, else 1; then one launch updates every parameter that has a gradient with
 * g * (float)coef. No sync. */
dg_status dg__adamw_multi_cuda(dg_ctx *ctx, const dg_adamw_dev *d, double *sc, double clip,
                               float b1, float b2, float eps);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_ADAMW_CUH */

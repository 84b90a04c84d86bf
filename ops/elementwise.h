/*
 * ops/elementwise.h -- helpers shared by the elementwise and reduction ops (library-internal):
 * the per-device float dtype check, and the deterministic sums that both the reductions and the
 * backward of every broadcasting op are built on.
 */
#ifndef DG_OPS_ELEMENTWISE_H
#define DG_OPS_ELEMENTWISE_H

#include "../tensor/tensor.h"

/* The float dtypes each device computes: f64 and f32 on the CPU (bf16 is a CUDA storage type),
 * f32 and bf16 on CUDA (the kernels do not compute f64). DG_ERR_DTYPE naming op and arg if not. */
dg_status dg__check_float_dtype(const char *op, const char *arg, const dg_tensor *t);

/* y[o,i] = scale * sum_{j<n} x[o,j,i]  (defined in ops/reduce.c)
 * x: contiguous, viewed as [outer, n, inner]; y: contiguous, outer*inner elements, same dtype and
 * device. Every output has one fixed summation order (no atomics), so results are bit-for-bit
 * repeatable. n == 0 gives 0 * scale. Not recorded on the tape. */
dg_status dg__sum_mid(dg_ctx *ctx, const dg_tensor *x, int64_t outer, int64_t n, int64_t inner,
                      double scale, dg_tensor *y);

/* The reverse of broadcasting: sum g over the dims along which a tensor of `shape` was broadcast
 * to g's shape, times scale (defined in ops/reduce.c).
 * shape: ndim <= g's ndim dims, right-aligned against g's; each equals g's dim or is 1.
 * out: a new contiguous tensor of `shape` (or a new reference to g when g already has that shape
 * and scale == 1). Not recorded on the tape. */
dg_status dg__sum_to_shape(dg_ctx *ctx, const dg_tensor *g, int ndim, const int64_t *shape,
                           double scale, dg_tensor **out);

#endif /* DG_OPS_ELEMENTWISE_H */

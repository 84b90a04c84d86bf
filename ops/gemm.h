/*
 * ops/gemm.h -- the CPU GEMM behind dg_matmul and dg_linear (library-internal).
 *
 * dg_gemm_desc (kernels/matmul.cuh) describes C = alpha op(A) op(B) + beta C, row-major, with
 * per-operand transpose flags so backward passes never materialise a transpose. f32 computes in
 * f32, f64 in f64. Results do not depend on the number of OpenMP threads: every C element is
 * summed by one thread over k in a fixed order (slices of GKC, in order).
 */
#ifndef DG_OPS_GEMM_H
#define DG_OPS_GEMM_H

#include "../kernels/matmul.cuh"

dg_status dg__gemm_f64(const dg_gemm_desc *g, const double *a, const double *b, double *c);
dg_status dg__gemm_f32(const dg_gemm_desc *g, const float *a, const float *b, float *c);

#endif /* DG_OPS_GEMM_H */

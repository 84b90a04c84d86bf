/*
 * ops/gemm.c -- the CPU GEMM (see ops/gemm.h): cache-blocked, packed, OpenMP over row blocks of C.
 * One body (ops/gemm_body.h) serves f64 and f32.
 *
 * Tiles: a GMR x GNR register tile of C (GNR = two 256-bit vectors of the dtype), a GMC x GKC
 * block of A kept in L2, a GKC x GNC panel of B streamed from L3. With GCC/Clang on x86-64 the
 * tile kernel is also compiled for AVX2 and chosen at run time when the CPU has it (about 2x the
 * 128-bit kernel), with bitwise the same results.
 */
#include "gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__)
#define GEMM_HAVE_VEC 1
#define GEMM_UNROLL _Pragma("GCC unroll 16")
#if defined(__x86_64__)
#define GEMM_X86_WIDE 1
#endif
#else
#define GEMM_UNROLL
#endif

#define GMC 96 /* a multiple of both GMR values */
#define GKC 256
#define GNC 2048

#define GT double
#define GSUF f64
#define GMR 4
#define GNR 8
#include "gemm_body.h"
#undef GT
#undef GSUF
#undef GMR
#undef GNR

#define GT float
#define GSUF f32
#define GMR 6
#define GNR 16
#include "gemm_body.h"
#undef GT
#undef GSUF
#undef GMR
#undef GNR

/*
 * ops/ref_tmpl.h -- instantiate a file's CPU reference functions for f64 and f32.
 *
 * Every CPU reference (the core ops, gemm, each KDA and DPLR stage) is written once, as ordinary
 * lines, and compiled twice. A file starts with
 *     #ifndef DG_REF_TMPL
 *     #include ...                      (what both parts need)
 *     #define DG_REF_TMPL "kda/intra.c" (its own path, relative to ops/)
 *     #include "ref_tmpl.h"             (path from the file to this header)
 *     #endif
 *     #ifdef RT   ... reference functions written with the names below ...
 *     #else       ... the rest (argument checks, dispatch, tape nodes), compiled once ...
 *     #endif
 * This header includes the file twice more, with RT = double and RT = float, so the f32
 * instantiation computes in f32 (constants must be cast: (RT)1). Names:
 *     RT             the element type
 *     RT_F64         1 in the double instantiation, 0 in the float one
 *     RF(name)       name_f64 / name_f32
 *     REXP RLOG RLOG1P RSQRT RFABS RTANH RPOW   the <math.h> functions of that type
 * After each instantiation the header includes itself with DG_REF_TMPL_END set, which undefines
 * these names.
 */
#ifdef DG_REF_TMPL_END
#undef RT
#undef RT_F64
#undef RF
#undef REXP
#undef RLOG
#undef RLOG1P
#undef RSQRT
#undef RFABS
#undef RTANH
#undef RPOW
#undef DG_REF_TMPL_END
#else
#include <math.h>

#define RT double
#define RT_F64 1
#define RF(name) name##_f64
#define REXP exp
#define RLOG log
#define RLOG1P log1p
#define RSQRT sqrt
#define RFABS fabs
#define RTANH tanh
#define RPOW pow
#include DG_REF_TMPL
#define DG_REF_TMPL_END
#include "ref_tmpl.h"

#define RT float
#define RT_F64 0
#define RF(name) name##_f32
#define REXP expf
#define RLOG logf
#define RLOG1P log1pf
#define RSQRT sqrtf
#define RFABS fabsf
#define RTANH tanhf
#define RPOW powf
#include DG_REF_TMPL
#define DG_REF_TMPL_END
#include "ref_tmpl.h"
#endif

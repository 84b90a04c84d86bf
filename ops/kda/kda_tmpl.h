/*
 * ops/kda/kda_tmpl.h -- instantiate a stage file's raw reference functions for f64 and f32.
 *
 * A stage file starts with
 *     #ifndef KDA_TMPL
 *     #define KDA_TMPL "intra.c"       (its own name)
 *     #include "kda_tmpl.h"
 *     #endif
 *     #ifdef KT   ... raw functions written with KT, KF(name), KEXP, ... ...
 *     #else       ... node code (compiled once) ...
 *     #endif
 * This header includes the file twice more with KT = double and KT = float, so both
 * instantiations share one body and the f32 one computes in f32 (constants must be cast: (KT)1).
 */
#include <math.h>

#define KT double
#define KF(name) name##_f64
#define KEXP exp
#define KLOG1P log1p
#define KSQRT sqrt
#define KFABS fabs
#include KDA_TMPL
#undef KT
#undef KF
#undef KEXP
#undef KLOG1P
#undef KSQRT
#undef KFABS

#define KT float
#define KF(name) name##_f32
#define KEXP expf
#define KLOG1P log1pf
#define KSQRT sqrtf
#define KFABS fabsf
#include KDA_TMPL
#undef KT
#undef KF
#undef KEXP
#undef KLOG1P
#undef KSQRT
#undef KFABS

/*
 * ops/dplr/dplr_tmpl.h -- instantiate a DPLR stage file's raw reference functions for f64 and f32
 * (the same scheme as ops/kda/kda_tmpl.h: the stage file defines DPLR_TMPL as its own name and
 * includes this header, which includes the file twice more with KT = double and KT = float).
 */
#include <math.h>

#define KT double
#define KF(name) name##_f64
#define KEXP exp
#include DPLR_TMPL
#undef KT
#undef KF
#undef KEXP

#define KT float
#define KF(name) name##_f32
#define KEXP expf
#include DPLR_TMPL
#undef KT
#undef KF
#undef KEXP

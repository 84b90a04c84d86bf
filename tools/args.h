/*
 * tools/args.h -- the one strict parser behind every numeric flag of every `deltagrad` command.
 *
 * A value is accepted only when the whole string is a number: no leading blanks, no trailing
 * text ("16abc"), not empty, no "inf"/"nan", no hex; integers in base 10 without overflow. It
 * must then lie in the flag's range. Errors (DG_ERR_ARG) name the flag, the expected range and
 * the text given, e.g.
 *     --batch: expected an integer in [1, 65536], got '16abc'
 *     --lower-bound: expected a number in [-5, 0), got '0'
 */
#ifndef DG_TOOLS_ARGS_H
#define DG_TOOLS_ARGS_H

#include "deltagrad.h"

#include <stdint.h>

/* Bits of `open` for dg_arg_f64: the bound itself is excluded. */
#define DG_ARG_LO_OPEN 1u
#define DG_ARG_HI_OPEN 2u

/* Integer in [lo, hi]. */
dg_status dg_arg_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out);
dg_status dg_arg_int(const char *flag, const char *s, int lo, int hi, int *out);
/* Integer that must be one of the n values in `allowed` (e.g. chunk sizes 16, 32, 64). */
dg_status dg_arg_choice(const char *flag, const char *s, const int *allowed, int n, int *out);
/* Finite number between lo and hi (either may be -INFINITY / INFINITY: no bound on that side). */
dg_status dg_arg_f64(const char *flag, const char *s, double lo, double hi, unsigned open,
                     double *out);

/* A gate word (--gate of kda, gradcheck, explain): "none", "kda" or "lowerbound" into *out, 0;
 * another word: -1, *out untouched (the caller says what its flag takes). */
int dg_arg_gate(const char *s, dg_gate_kind *out);

#endif /* DG_TOOLS_ARGS_H */

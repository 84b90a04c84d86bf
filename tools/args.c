/*
 * tools/args.c -- strict numeric flag values (see args.h).
 */
#include "tools/args.h"
#include "tensor/tensor.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "<flag>: expected <what>, got '<s>'" with the value quoted at most 64 bytes long. */
static dg_status reject(const char *flag, const char *what, const char *s) {
    size_t n = strlen(s);
    return dg__err(DG_ERR_ARG, "%s: expected %s, got '%.64s%s'", flag ? flag : "value", what, s,
                   n > 64 ? "..." : "");
}

static void int_range(char *buf, size_t n, int64_t lo, int64_t hi) {
    if (hi == INT64_MAX)
        snprintf(buf, n, "an integer >= %lld", (long long)lo);
    else
        snprintf(buf, n, "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
}

dg_status dg_arg_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char what[96];
    int_range(what, sizeof what, lo, hi);
    if (!s || !out)
        return dg__err(DG_ERR_ARG, "%s: no value given", flag ? flag : "value");
    /* digits with an optional sign: strtoll alone would take " 5", "5x" as far as it goes */
    const char *p = s + (s[0] == '-' || s[0] == '+');
    if (!*p || strspn(p, "0123456789") != strlen(p))
        return reject(flag, what, s);
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno == ERANGE || *end || v < lo || v > hi)
        return reject(flag, what, s);
    *out = (int64_t)v;
    return DG_OK;
}

dg_status dg_arg_int(const char *flag, const char *s, int lo, int hi, int *out) {
    int64_t v = 0;
    DG_TRY(dg_arg_i64(flag, s, lo, hi, &v));
    *out = (int)v;
    return DG_OK;
}

dg_status dg_arg_choice(const char *flag, const char *s, const int *allowed, int n, int *out) {
    char what[128] = "one of";
    for (int i = 0; i < n; i++)
        snprintf(what + strlen(what), sizeof what - strlen(what), "%s %d", i ? "," : "",
                 allowed[i]);
    int64_t v = 0;
    if (dg_arg_i64(flag, s, INT64_MIN, INT64_MAX, &v) != DG_OK)
        return reject(flag, what, s ? s : "");
    for (int i = 0; i < n; i++)
        if (v == allowed[i]) {
            *out = allowed[i];
            return DG_OK;
        }
    return reject(flag, what, s);
}

static void num(char *buf, size_t n, double x) { snprintf(buf, n, "%.10g", x); }

dg_status dg_arg_f64(const char *flag, const char *s, double lo, double hi, unsigned open,
                     double *out) {
    char what[128], a[40], b[40];
    num(a, sizeof a, lo);
    num(b, sizeof b, hi);
    int has_lo = isfinite(lo), has_hi = isfinite(hi);
    int lo_open = (open & DG_ARG_LO_OPEN) != 0, hi_open = (open & DG_ARG_HI_OPEN) != 0;
    if (has_lo && has_hi)
        snprintf(what, sizeof what, "a number in %c%s, %s%c", lo_open ? '(' : '[', a, b,
                 hi_open ? ')' : ']');
    else if (has_lo)
        snprintf(what, sizeof what, "a number %s %s", lo_open ? ">" : ">=", a);
    else if (has_hi)
        snprintf(what, sizeof what, "a number %s %s", hi_open ? "<" : "<=", b);
    else
        snprintf(what, sizeof what, "a finite number");
    if (!s || !out)
        return dg__err(DG_ERR_ARG, "%s: no value given", flag ? flag : "value");
    /* plain decimal only: sign, digits, one point, an exponent; strtod would also take blanks,
     * "inf", "nan" and hex */
    const char *p = s + (s[0] == '-' || s[0] == '+');
    if (!*p || strspn(p, "0123456789.eE+-") != strlen(p) || !strpbrk(p, "0123456789") ||
        !(isdigit((unsigned char)p[0]) || p[0] == '.'))
        return reject(flag, what, s);
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (*end || !isfinite(v) || (errno == ERANGE && fabs(v) > 1.0))
        return reject(flag, what, s);
    if (errno == ERANGE && v == 0.0 && strpbrk(p, "123456789")) /* underflow to zero */
        return reject(flag, what, s);
    if ((has_lo && (lo_open ? !(v > lo) : !(v >= lo))) ||
        (has_hi && (hi_open ? !(v < hi) : !(v <= hi))))
        return reject(flag, what, s);
    *out = v;
    return DG_OK;
}

int dg_arg_gate(const char *s, dg_gate_kind *out) {
    static const char *const words[] = {"none", "kda", "lowerbound"};
    static const dg_gate_kind kinds[] = {DG_GATE_NONE, DG_GATE_KDA, DG_GATE_LOWERBOUND};
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, words[i])) {
            *out = kinds[i];
            return 0;
        }
    return -1;
}

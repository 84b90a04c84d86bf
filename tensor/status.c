/*
 * tensor/status.c -- error reporting (a per-thread reason string, stb style), dtype and device
 * names, and the argument checks every op uses so that messages read the same everywhere.
 */
#include "tensor.h"

#include <stdio.h>

static _Thread_local char g_err[1024];

dg_status dg__err(dg_status s, const char *fmt, ...) {
    /* Format into a scratch buffer first: callers may pass dg_last_error() as an argument to
     * wrap an inner message. */
    char tmp[sizeof g_err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(g_err, tmp, sizeof g_err);
    return s;
}

const char *dg_last_error(void) { return g_err; }
void dg_clear_error(void) { g_err[0] = 0; }

const char *dg_status_str(dg_status s) {
    switch (s) {
    case DG_OK:
        return "DG_OK";
    case DG_ERR_ARG:
        return "DG_ERR_ARG";
    case DG_ERR_SHAPE:
        return "DG_ERR_SHAPE";
    case DG_ERR_DTYPE:
        return "DG_ERR_DTYPE";
    case DG_ERR_DEVICE:
        return "DG_ERR_DEVICE";
    case DG_ERR_NOMEM:
        return "DG_ERR_NOMEM";
    case DG_ERR_IO:
        return "DG_ERR_IO";
    case DG_ERR_FORMAT:
        return "DG_ERR_FORMAT";
    case DG_ERR_CUDA:
        return "DG_ERR_CUDA";
    case DG_ERR_CUBLAS:
        return "DG_ERR_CUBLAS";
    case DG_ERR_NCCL:
        return "DG_ERR_NCCL";
    case DG_ERR_UNSUPPORTED:
        return "DG_ERR_UNSUPPORTED";
    case DG_ERR_STATE:
        return "DG_ERR_STATE";
    case DG_ERR_NUMERIC:
        return "DG_ERR_NUMERIC";
    case DG_ERR_COMM:
        return "DG_ERR_COMM";
    }
    return "DG_ERR_?";
}

static const char *const g_dtype_names[DG_NDTYPES] = {"f64", "f32", "bf16", "i32", "i64"};
static const size_t g_dtype_sizes[DG_NDTYPES] = {8, 4, 2, 4, 8};

size_t dg_dtype_size(dg_dtype t) { return (unsigned)t < DG_NDTYPES ? g_dtype_sizes[t] : 0; }
const char *dg_dtype_name(dg_dtype t) { return (unsigned)t < DG_NDTYPES ? g_dtype_names[t] : "?"; }
int dg_dtype_is_float(dg_dtype t) { return t == DG_F64 || t == DG_F32 || t == DG_BF16; }

dg_status dg_dtype_parse(const char *s, dg_dtype *out) {
    if (!s || !out)
        return dg__err(DG_ERR_ARG, "dg_dtype_parse: NULL argument");
    for (int i = 0; i < DG_NDTYPES; i++)
        if (strcmp(s, g_dtype_names[i]) == 0) {
            *out = (dg_dtype)i;
            return DG_OK;
        }
    return dg__err(DG_ERR_ARG, "unknown dtype '%s' (expected f64, f32, bf16, i32 or i64)", s);
}

dg_device dg_cpu(void) { return (dg_device){DG_DEV_CPU, 0}; }
dg_device dg_cuda(int index) { return (dg_device){DG_DEV_CUDA, index}; }
int dg_device_eq(dg_device a, dg_device b) {
    return a.kind == b.kind && (a.kind == DG_DEV_CPU || a.index == b.index);
}

const char *dg_device_str(dg_device d) {
    static _Thread_local char buf[4][32];
    static _Thread_local int next;
    char *b = buf[next++ & 3];
    if (d.kind == DG_DEV_CPU)
        snprintf(b, 32, "cpu");
    else
        snprintf(b, 32, "cuda:%d", d.index);
    return b;
}

dg_status dg_device_parse(const char *s, dg_device *out) {
    if (!s || !out)
        return dg__err(DG_ERR_ARG, "dg_device_parse: NULL argument");
    if (strcmp(s, "cpu") == 0) {
        *out = dg_cpu();
        return DG_OK;
    }
    if (strcmp(s, "cuda") == 0) {
        *out = dg_cuda(0);
        return DG_OK;
    }
    if (strncmp(s, "cuda:", 5) == 0) {
        char *end;
        long i = strtol(s + 5, &end, 10);
        if (s[5] >= '0' && s[5] <= '9' && *end == 0 && i >= 0 && i < 1024) {
            *out = dg_cuda((int)i);
            return DG_OK;
        }
    }
    return dg__err(DG_ERR_ARG, "unknown device '%s' (expected cpu, cuda or cuda:N)", s);
}

dg_status dg__no_cuda(const char *op) {
    return dg__err(DG_ERR_UNSUPPORTED,
                   "%s: tensor is on a CUDA device but libdeltagrad was built without CUDA", op);
}

/* ---- checks ---- */

dg_status dg__check_ptr(const char *op, const char *arg, const void *p) {
    if (!p)
        return dg__err(DG_ERR_ARG, "%s: argument '%s' is NULL", op, arg);
    return DG_OK;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape, int wild) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++) {
        if (wild && shape[i] < 0)
            k += (size_t)snprintf(buf + k, n - k, "%s*", i ? "," : "");
        else
            k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? "," : "", (long long)shape[i]);
    }
    if (k < n)
        snprintf(buf + k, n - k, "]");
}

const char *dg_tensor_desc(const dg_tensor *t) {
    static _Thread_local char buf[4][96];
    static _Thread_local int next;
    char *b = buf[next++ & 3];
    if (!t) {
        snprintf(b, 96, "(null)");
        return b;
    }
    char s[64];
    shape_str(s, sizeof s, t->ndim, t->shape, 0);
    snprintf(b, 96, "%s %s %s", s, dg_dtype_name(t->dtype), dg_device_str(t->device));
    return b;
}

dg_status dg__check_shape(const char *op, const char *arg, const dg_tensor *t, int ndim,
                          const int64_t *want) {
    DG_TRY(dg__check_ptr(op, arg, t));
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        if (want[i] >= 0 && t->shape[i] != want[i])
            ok = 0;
    if (ok)
        return DG_OK;
    char w[64];
    shape_str(w, sizeof w, ndim, want, 1);
    return dg__err(DG_ERR_SHAPE, "%s: '%s' must have shape %s, got %s", op, arg, w,
                   dg_tensor_desc(t));
}

dg_status dg__check_dtype(const char *op, const char *arg, const dg_tensor *t, unsigned mask) {
    DG_TRY(dg__check_ptr(op, arg, t));
    if (mask & DG_MASK(t->dtype))
        return DG_OK;
    char allowed[64] = "";
    for (int i = 0; i < DG_NDTYPES; i++)
        if (mask & DG_MASK(i)) {
            strncat(allowed, allowed[0] ? "/" : "", sizeof allowed - strlen(allowed) - 1);
            strncat(allowed, g_dtype_names[i], sizeof allowed - strlen(allowed) - 1);
        }
    return dg__err(DG_ERR_DTYPE, "%s: '%s' must have dtype %s, got %s", op, arg, allowed,
                   dg_tensor_desc(t));
}

dg_status dg__check_same_dtype(const char *op, const char *arg, const dg_tensor *t,
                               const dg_tensor *ref) {
    DG_TRY(dg__check_ptr(op, arg, t));
    if (t->dtype == ref->dtype)
        return DG_OK;
    return dg__err(DG_ERR_DTYPE, "%s: '%s' must have dtype %s like the other inputs, got %s", op,
                   arg, dg_dtype_name(ref->dtype), dg_tensor_desc(t));
}

dg_status dg__check_device(const char *op, const char *arg, const dg_tensor *t, const dg_ctx *ctx) {
    DG_TRY(dg__check_ptr(op, arg, t));
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    if (dg_device_eq(t->device, ctx->device))
        return DG_OK;
    return dg__err(DG_ERR_DEVICE, "%s: '%s' must be on %s (the context's device), got %s", op, arg,
                   dg_device_str(ctx->device), dg_tensor_desc(t));
}

dg_status dg__check_float(const char *op, const char *arg, const dg_tensor *t, const dg_ctx *ctx) {
    DG_TRY(dg__check_device(op, arg, t, ctx));
    DG_TRY(dg__check_dtype(op, arg, t, DG_FLOATS));
    if (!dg__is_cuda(t) && t->dtype == DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "%s: '%s' is %s, but bf16 is a CUDA dtype; use f32 or f64 on the CPU", op,
                       arg, dg_tensor_desc(t));
    if (dg__is_cuda(t) && t->dtype == DG_F64)
        return dg__err(DG_ERR_DTYPE, "%s: '%s' is %s; the CUDA kernels run f32 or bf16", op, arg,
                       dg_tensor_desc(t));
    return DG_OK;
}

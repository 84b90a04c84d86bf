/*
 * autograd/gradcheck.c -- analytic gradients vs central finite differences, in float64.
 *
 * loss(x) = sum_k <out_k(x), R_k> with fixed random R_k, so one backward gives the full gradient
 * of a scalar that depends on every output element. Each input element is then perturbed by
 * +-eps and the projected loss re-evaluated with grad mode off. The error per input is
 * max_i |analytic_i - numeric_i| / max(max_i |numeric_i|, 1e-12), a norm-relative measure that
 * does not blow up on elements whose true gradient is zero.
 */
#include "tape.h"

#include <math.h>

#define GC_MAX_OUT 16

static dg_status run_fn(dg_ctx *ctx, dg_fn fn, void *user, dg_tensor *const *in, int n_in,
                        dg_tensor **outs, int n_out) {
    for (int k = 0; k < n_out; k++)
        outs[k] = NULL;
    dg_status s = fn(ctx, in, n_in, outs, n_out, user);
    if (s != DG_OK)
        return s;
    for (int k = 0; k < n_out; k++)
        if (!outs[k])
            return dg__err(DG_ERR_STATE, "dg_gradcheck: function left output %d NULL", k);
    return DG_OK;
}

static void free_outs(dg_tensor **outs, int n) {
    for (int k = 0; k < n; k++)
        dg_tensor_free(&outs[k]);
}

static dg_status projected(dg_ctx *ctx, dg_fn fn, void *user, dg_tensor *const *in, int n_in,
                           int n_out, double *const *R, double *val) {
    dg_tensor *outs[GC_MAX_OUT];
    dg_status s = run_fn(ctx, fn, user, in, n_in, outs, n_out);
    double acc = 0;
    for (int k = 0; s == DG_OK && k < n_out; k++) {
        double *o;
        s = dg_tensor_to_f64(outs[k], &o);
        if (s != DG_OK)
            break;
        for (int64_t i = 0; i < dg_tensor_numel(outs[k]); i++)
            acc += o[i] * R[k][i];
        free(o);
    }
    free_outs(outs, n_out);
    *val = acc;
    return s;
}

dg_status dg_gradcheck(dg_ctx *ctx, dg_fn fn, void *user, dg_tensor *const *inputs, int n_in,
                       int n_out, double eps, uint64_t seed, dg_gradcheck_report *rep) {
    const char *op = "dg_gradcheck";
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "fn", (const void *)(uintptr_t)fn));
    DG_TRY(dg__check_ptr(op, "report", rep));
    if (n_in < 1 || n_in > DG_GRADCHECK_MAX_INPUTS || n_out < 1 || n_out > GC_MAX_OUT)
        return dg__err(DG_ERR_ARG, "%s: need 1..%d inputs and 1..%d outputs, got %d and %d", op,
                       DG_GRADCHECK_MAX_INPUTS, GC_MAX_OUT, n_in, n_out);
    for (int i = 0; i < n_in; i++) {
        if (!inputs[i])
            continue;
        if (inputs[i]->dtype != DG_F64 || inputs[i]->device.kind != DG_DEV_CPU ||
            !dg_tensor_is_contiguous(inputs[i]))
            return dg__err(DG_ERR_DTYPE, "%s: input %d must be a contiguous f64 CPU tensor, got %s",
                           op, i, dg_tensor_desc(inputs[i]));
    }
    if (eps <= 0)
        eps = 1e-6;
    memset(rep, 0, sizeof *rep);
    rep->n_in = n_in;
    dg_tape_reset();
    for (int i = 0; i < n_in; i++)
        dg_tensor_zero_grad(inputs[i]);

    /* Analytic pass. */
    dg_tensor *outs[GC_MAX_OUT];
    dg_tensor *Rt[GC_MAX_OUT] = {0};
    double *R[GC_MAX_OUT] = {0};
    double *ana[DG_GRADCHECK_MAX_INPUTS] = {0};
    dg_status s = run_fn(ctx, fn, user, inputs, n_in, outs, n_out);
    for (int k = 0; s == DG_OK && k < n_out; k++) {
        s = dg_tensor_new(ctx, outs[k]->dtype, outs[k]->ndim, outs[k]->shape, &Rt[k]);
        if (s == DG_OK)
            s = dg_tensor_rand_uniform(Rt[k], seed + 977 * (uint64_t)k, -1.0, 1.0);
        if (s == DG_OK)
            s = dg_tensor_to_f64(Rt[k], &R[k]);
    }
    if (s == DG_OK)
        s = dg__tape_backward_multi(ctx, n_out, outs, (const dg_tensor *const *)Rt);
    for (int i = 0; s == DG_OK && i < n_in; i++) {
        if (!inputs[i] || !inputs[i]->slot)
            continue;
        int64_t n = dg_tensor_numel(inputs[i]);
        const dg_tensor *g = dg_tensor_grad(inputs[i]);
        if (g) {
            s = dg_tensor_to_f64(g, &ana[i]);
        } else {
            ana[i] = calloc((size_t)(n ? n : 1), sizeof(double));
            if (!ana[i])
                s = dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
        }
    }
    free_outs(outs, n_out);
    dg_tape_reset();

    /* Numeric pass. */
    dg_no_grad_begin();
    for (int i = 0; s == DG_OK && i < n_in; i++) {
        if (!ana[i])
            continue;
        double *x = dg__f64(inputs[i]);
        double max_num = 0, max_diff = 0;
        int64_t worst = -1;
        for (int64_t j = 0; s == DG_OK && j < dg_tensor_numel(inputs[i]); j++) {
            double x0 = x[j], fp = 0, fm = 0;
            x[j] = x0 + eps;
            s = projected(ctx, fn, user, inputs, n_in, n_out, R, &fp);
            x[j] = x0 - eps;
            if (s == DG_OK)
                s = projected(ctx, fn, user, inputs, n_in, n_out, R, &fm);
            x[j] = x0;
            double num = (fp - fm) / (2 * eps);
            double d = fabs(num - ana[i][j]);
            if (fabs(num) > max_num)
                max_num = fabs(num);
            if (!(d <= max_diff)) { /* NaN counts as worst */
                max_diff = d;
                worst = j;
            }
        }
        rep->abs_err[i] = max_diff;
        rep->rel_err[i] = max_diff / (max_num > 1e-12 ? max_num : 1e-12);
        rep->worst_index[i] = worst;
        if (!(rep->rel_err[i] <= rep->max_rel_err))
            rep->max_rel_err = rep->rel_err[i];
    }
    dg_no_grad_end();

    for (int k = 0; k < n_out; k++) {
        dg_tensor_free(&Rt[k]);
        free(R[k]);
    }
    for (int i = 0; i < n_in; i++) {
        free(ana[i]);
        if (inputs[i])
            dg_tensor_zero_grad(inputs[i]);
    }
    return s;
}

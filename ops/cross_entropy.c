/*
 * ops/cross_entropy.c -- dg_cross_entropy: mean softmax cross-entropy, fused and stable.
 *
 *   m_i = max_j x_ij,  l_i = log sum_j exp(x_ij - m_i)       logits x [N, Vocab]
 *   loss  = (1 / C) sum_{i counted} ((m_i - x_{i,t_i}) + l_i)   targets t [N] i32/i64
 *   dx_ij = (exp((x_ij - m_i) - l_i) - [j = t_i]) * dloss / C  for counted rows, 0 for ignored
 * Rows whose target equals ignore_index are not counted; C is the number of counted rows. When
 * every row is ignored (C = 0) the loss is 0 and the gradient is all zeros (not NaN).
 * Output: [1], f64 for f64 logits, f32 for f32 and bf16. A target outside [0, Vocab) that is not
 * ignore_index is DG_ERR_ARG (on CUDA the kernel records it in the context's bad-input record,
 * gives the row a zero loss, and the op reads the record back: one sync per forward; with
 * dg_ctx_defer_checks it is left for dg_ctx_check_errors).
 *
 * Policy: CACHE (default) keeps the row statistics (m_i, l_i) ([N,2], 8 or 16 bytes a row) for
 * backward; RECOMPUTE keeps only the logits and targets and recomputes them with the same code
 * (the same bits).
 */
#ifndef DG_REF_TMPL
#include "../autograd/tape.h"

#include <math.h>

#ifdef DG_HAVE_CUDA
#include "../kernels/cuda_api.h"
#include "../kernels/cross_entropy.cuh"
#endif

static int64_t tgt_at(const void *t, dg_dtype dt, int64_t i) {
    return dt == DG_I32 ? (int64_t)((const int32_t *)t)[i] : ((const int64_t *)t)[i];
}

#ifdef _OPENMP
#define CE_PARALLEL_FOR _Pragma("omp parallel for if (N * V > (1 << 16))")
#else
#define CE_PARALLEL_FOR
#endif

#define DG_REF_TMPL "cross_entropy.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference

/* One body per dtype; f32 computes in f32 (expf, logf). The row statistics are kept as the pair
 * (m, log s) rather than lse = m + log s: with logits ~1e4, x - m is exact (Sterbenz) while
 * x - lse would inherit lse's rounding at 1e4 (~1e-3 in f32) and spoil the softmax. */
static void RF(ce_stats)(const RT *x, int64_t V, RT *st) {
    RT m = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; j++)
        m = x[j] > m ? x[j] : m;
    if (m != -INFINITY)
        for (int64_t j = 0; j < V; j++)
            s += REXP(x[j] - m);
    st[0] = m;
    st[1] = RLOG(s);
}
static void RF(ce_fwd)(const RT *x, int64_t N, int64_t V, const void *tg, dg_dtype tdt,
                       int64_t ignore, RT *row_loss, RT *stats) {
    CE_PARALLEL_FOR
    for (int64_t i = 0; i < N; i++) {
        int64_t t = tgt_at(tg, tdt, i);
        RT st[2];
        RF(ce_stats)(x + i * V, V, st);
        row_loss[i] = t == ignore ? 0 : (st[0] - x[i * V + t]) + st[1];
        if (stats) {
            stats[2 * i] = st[0];
            stats[2 * i + 1] = st[1];
        }
    }
}
static void RF(ce_bwd)(const RT *x, int64_t N, int64_t V, const void *tg, dg_dtype tdt,
                       int64_t ignore, const RT *stats, RT scale, RT *g) {
    CE_PARALLEL_FOR
    for (int64_t i = 0; i < N; i++) {
        int64_t t = tgt_at(tg, tdt, i);
        RT *gi = g + i * V;
        const RT *xi = x + i * V;
        if (t == ignore || scale == 0) {
            memset(gi, 0, (size_t)V * sizeof(RT));
            continue;
        }
        RT st[2];
        if (stats) {
            st[0] = stats[2 * i];
            st[1] = stats[2 * i + 1];
        } else {
            RF(ce_stats)(xi, V, st);
        }
        for (int64_t j = 0; j < V; j++)
            gi[j] = (REXP((xi[j] - st[0]) - st[1]) - (j == t ? (RT)1 : (RT)0)) * scale;
    }
}

#else

// ---- backward

typedef struct {
    int64_t ignore;
} ce_params;

/* saved: logits (contiguous), targets (contiguous), count ([1] i64), stats ([N,2] or NULL) */
static dg_status cross_entropy_backward(dg_ctx *ctx, dg_node *nd) {
    const ce_params *p = nd->params;
    dg_tensor *x = nd->saved[0], *tg = nd->saved[1], *cnt = nd->saved[2], *stats = nd->saved[3];
    const dg_tensor *gy = dg__node_grad_out(nd, 0);
    const int64_t N = x->shape[0], V = x->shape[1];
    dg_tensor *gx = NULL;
    DG_TRY(dg_tensor_new(ctx, x->dtype, 2, x->shape, &gx));
    dg_status s = DG_OK;
    if (x->device.kind == DG_DEV_CPU) {
        int64_t c = *(const int64_t *)dg_tensor_data(cnt);
        double dl = dg__load_f64(dg_tensor_data(gy), gy->dtype, 0);
        const void *lv = stats ? dg_tensor_data(stats) : NULL;
        if (x->dtype == DG_F64)
            ce_bwd_f64(dg__f64(x), N, V, dg_tensor_data(tg), tg->dtype, p->ignore, lv,
                       c > 0 ? dl / (double)c : 0.0, dg__f64(gx));
        else
            ce_bwd_f32(dg__f32(x), N, V, dg_tensor_data(tg), tg->dtype, p->ignore, lv,
                       c > 0 ? (float)dl / (float)c : 0.0f, dg__f32(gx));
    } else {
#ifdef DG_HAVE_CUDA
        dg_tensor *g32 = NULL; /* the loss gradient is f32 on CUDA; convert if it arrived f64 */
        s = gy->dtype == DG_F32 ? DG_OK : dg_to_dtype(ctx, (dg_tensor *)gy, DG_F32, &g32);
        if (s == DG_OK)
            s = dg__cross_entropy_bwd_cuda(ctx, x->dtype, dg_tensor_data(x), N, V, tg->dtype,
                                           dg_tensor_data(tg), p->ignore,
                                           stats ? dg__f32(stats) : NULL, dg_tensor_data(cnt),
                                           dg__f32(g32 ? g32 : gy), dg_tensor_data(gx));
        dg_tensor_free(&g32);
#else
        s = dg__no_cuda("dg_cross_entropy backward");
#endif
    }
    if (s == DG_OK)
        s = dg__node_accum(ctx, nd, 0, gx);
    dg_tensor_free(&gx);
    return s;
}

// ---- forward

dg_status dg__cross_entropy_bad_target(const dg_tensor *logits, int64_t row, int64_t t,
                                       int64_t ignore) {
    return dg__err(DG_ERR_ARG,
                   "dg_cross_entropy: targets[%lld] = %lld is outside [0, %lld) and is not "
                   "ignore_index (%lld); logits %s",
                   (long long)row, (long long)t, (long long)logits->shape[1], (long long)ignore,
                   dg_tensor_desc(logits));
}

/* The loss and count on the CPU; stats may be NULL. */
static dg_status ce_forward_cpu(dg_tensor *x, dg_tensor *tg, int64_t ignore, dg_tensor *loss,
                                dg_tensor *cnt, dg_tensor *stats) {
    const int64_t N = x->shape[0], V = x->shape[1];
    const void *tv = dg_tensor_data(tg);
    int64_t c = 0;
    for (int64_t i = 0; i < N; i++) {
        int64_t t = tgt_at(tv, tg->dtype, i);
        if (t == ignore)
            continue;
        if (t < 0 || t >= V)
            return dg__cross_entropy_bad_target(x, i, t, ignore);
        c++;
    }
    size_t es = dg_dtype_size(x->dtype);
    void *rows = DG_MALLOC((size_t)(N ? N : 1) * es);
    if (!rows)
        return dg__err(DG_ERR_NOMEM, "dg_cross_entropy: out of host memory");
    if (x->dtype == DG_F64) {
        double *r = rows, sum = 0;
        ce_fwd_f64(dg__f64(x), N, V, tv, tg->dtype, ignore, r, stats ? dg__f64(stats) : NULL);
        for (int64_t i = 0; i < N; i++)
            sum += r[i];
        dg__f64(loss)[0] = c > 0 ? sum / (double)c : 0.0;
    } else {
        float *r = rows, sum = 0;
        ce_fwd_f32(dg__f32(x), N, V, tv, tg->dtype, ignore, r, stats ? dg__f32(stats) : NULL);
        for (int64_t i = 0; i < N; i++)
            sum += r[i];
        dg__f32(loss)[0] = c > 0 ? sum / (float)c : 0.0f;
    }
    DG_FREE(rows);
    *(int64_t *)dg_tensor_data(cnt) = c;
    return DG_OK;
}

dg_status dg_cross_entropy(dg_ctx *ctx, dg_tensor *logits, dg_tensor *targets, int64_t ignore_index,
                           dg_tensor **out) {
    const char *op = "dg_cross_entropy";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_shape(op, "logits", logits, 2, (int64_t[]){-1, -1}));
    DG_TRY(dg__check_dtype(op, "logits", logits, DG_FLOATS));
    DG_TRY(dg__check_shape(op, "targets", targets, 1, (int64_t[]){logits->shape[0]}));
    DG_TRY(dg__check_dtype(op, "targets", targets, DG_INTS));
    DG_TRY(dg__check_device(op, "logits", logits, ctx));
    DG_TRY(dg__check_device(op, "targets", targets, ctx));
    const int cuda = logits->device.kind == DG_DEV_CUDA;
    if (!cuda && logits->dtype == DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "%s: bf16 is a CUDA dtype; on the CPU use f32 or f64 (logits %s)", op,
                       dg_tensor_desc(logits));
    if (cuda && logits->dtype == DG_F64)
        return dg__err(DG_ERR_DTYPE, "%s: CUDA kernels take f32 or bf16 logits, got %s", op,
                       dg_tensor_desc(logits));
#ifndef DG_HAVE_CUDA
    if (cuda)
        return dg__no_cuda(op);
#endif
    const int64_t N = logits->shape[0];
    const int grad = dg__needs_grad(1, &logits);
    const int keep_stats =
        grad && dg_policy_resolve("cross_entropy", DG_POLICY_CACHE) != DG_POLICY_RECOMPUTE;
    const dg_dtype odt = logits->dtype == DG_F64 ? DG_F64 : DG_F32;

    dg_tensor *x = NULL, *tg = NULL, *loss = NULL, *cnt = NULL, *stats = NULL;
    int64_t one = 1;
    dg_status s = dg__contig(ctx, logits, &x);
    if (s == DG_OK)
        s = dg__contig(ctx, targets, &tg);
    if (s == DG_OK)
        s = dg_tensor_new(ctx, odt, 1, &one, &loss);
    if (s == DG_OK)
        s = dg_tensor_new(ctx, DG_I64, 1, &one, &cnt);
    if (s == DG_OK && keep_stats)
        s = dg_tensor_new(ctx, odt, 2, (int64_t[]){N, 2}, &stats);
    if (s == DG_OK && !cuda) {
        s = ce_forward_cpu(x, tg, ignore_index, loss, cnt, stats);
    } else if (s == DG_OK) {
#ifdef DG_HAVE_CUDA
        dg_deverr_site site;
        memset(&site, 0, sizeof site);
        site.kind = DG_DEVERR_CE_TARGET;
        site.idx_ndim = 1;
        site.idx_shape[0] = N;
        site.ref_dtype = (int32_t)logits->dtype;
        site.ref_ndim = 2;
        site.ref_shape[0] = N;
        site.ref_shape[1] = logits->shape[1];
        site.ignore = ignore_index;
        s = dg__cross_entropy_fwd_cuda(ctx, x->dtype, dg_tensor_data(x), N, x->shape[1], tg->dtype,
                                       dg_tensor_data(tg), ignore_index, dg__f32(loss),
                                       dg_tensor_data(cnt), stats ? dg__f32(stats) : NULL, &site);
        if (s == DG_OK && !ctx->defer_checks)
            s = dg_ctx_check_errors(ctx);
#endif
    }
    if (s == DG_OK && grad) {
        dg_node *nd;
        s = dg__node_new("cross_entropy", DG_POLICY_CACHE, cross_entropy_backward, ctx, &nd);
        if (s == DG_OK) {
            dg__node_input(nd, logits);
            dg__node_output(nd, loss);
            dg__node_save(nd, x);
            dg__node_save(nd, tg);
            dg__node_save(nd, cnt);
            dg__node_save(nd, stats);
            s = dg__node_commit_params(nd, &(ce_params){.ignore = ignore_index}, sizeof(ce_params));
        }
    }
    dg_tensor_free(&x);
    dg_tensor_free(&tg);
    dg_tensor_free(&cnt);
    dg_tensor_free(&stats);
    if (s != DG_OK) {
        dg_tensor_free(&loss);
        return s;
    }
    *out = loss;
    return DG_OK;
}
#endif

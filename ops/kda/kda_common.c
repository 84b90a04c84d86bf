/*
 * ops/kda/kda_common.c -- what every KDA entry point shares: option resolution and the
 * sequence/chunk tables (kda.md §11.8), argument checks with messages that name the argument and
 * the expected shape, host pointers of inputs, and the params block of a KDA tape node.
 */
#include "kda.h"

#include <stdio.h>
#include <stdlib.h>

dg_status dg_kda_seqlens(const dg_tensor *cu, int64_t T, int64_t *out, int64_t cap, int *n_seqs) {
    static const char *op = "dg_kda_seqlens";
    DG_TRY(dg__check_ptr(op, "cu", cu));
    DG_TRY(dg__check_ptr(op, "out", out));
    DG_TRY(dg__check_ptr(op, "n_seqs", n_seqs));
    dg_dtype dt = dg_tensor_dtype(cu);
    if (dt != DG_I64 && dt != DG_I32)
        return dg__err(DG_ERR_DTYPE,
                       "%s: cu_seqlens must be an integer array (i64 or i32), got %s %s: float "
                       "offsets are refused rather than truncated",
                       op, dg_dtype_name(dt), dg_tensor_desc(cu));
    if (dg_tensor_ndim(cu) != 1)
        return dg__err(DG_ERR_SHAPE, "%s: cu_seqlens must be 1-d [N+1], got %s", op,
                       dg_tensor_desc(cu));
    int64_t n = dg_tensor_numel(cu);
    if (n < 2 || n - 1 > INT32_MAX)
        return dg__err(DG_ERR_SHAPE,
                       "%s: cu_seqlens must hold N+1 entries with 1 <= N <= %d, got %lld", op,
                       INT32_MAX, (long long)n);
    if (cap < n)
        return dg__err(DG_ERR_ARG, "%s: out holds %lld entries, cu_seqlens has %lld", op,
                       (long long)cap, (long long)n);
    void *host = DG_MALLOC((size_t)n * dg_dtype_size(dt));
    if (!host)
        return dg__err(DG_ERR_NOMEM, "%s: no memory for %lld offsets", op, (long long)n);
    dg_status s = dg_tensor_to_host(cu, host, (size_t)n * dg_dtype_size(dt));
    for (int64_t i = 0; s == DG_OK && i < n; i++)
        out[i] = dt == DG_I64 ? ((const int64_t *)host)[i] : ((const int32_t *)host)[i];
    DG_FREE(host);
    DG_TRY(s);
    if (out[0] != 0)
        return dg__err(DG_ERR_ARG, "%s: cu_seqlens must start at 0, got %lld", op,
                       (long long)out[0]);
    for (int64_t i = 0; i + 1 < n; i++)
        if (out[i + 1] < out[i])
            return dg__err(DG_ERR_ARG,
                           "%s: cu_seqlens must be non-decreasing, got cu_seqlens[%lld]=%lld > "
                           "cu_seqlens[%lld]=%lld",
                           op, (long long)i, (long long)out[i], (long long)(i + 1),
                           (long long)out[i + 1]);
    if (T >= 0 && out[n - 1] != T)
        return dg__err(DG_ERR_ARG, "%s: cu_seqlens must end at T=%lld, got cu_seqlens[%lld]=%lld",
                       op, (long long)T, (long long)(n - 1), (long long)out[n - 1]);
    *n_seqs = (int)(n - 1);
    return DG_OK;
}

dg_status dg__kda_cfg_init(const char *op, dg_ctx *ctx, const dg_kda_opts *opts, int64_t B,
                           int64_t T, int H, int HV, int K, int V, dg_dtype dt_in, kda_cfg *cfg) {
    static const dg_kda_opts defaults;
    memset(cfg, 0, sizeof *cfg);
    if (!opts)
        opts = &defaults;
    int BT = opts->chunk_size ? opts->chunk_size : 64;
    if (BT != 16 && BT != 32 && BT != 64)
        return dg__err(DG_ERR_ARG,
                       "%s: opts->chunk_size must be 16, 32 or 64 (0 selects 64), got %d", op,
                       opts->chunk_size);
    if (opts->gate != DG_GATE_NONE && opts->gate != DG_GATE_KDA && opts->gate != DG_GATE_LOWERBOUND)
        return dg__err(DG_ERR_ARG,
                       "%s: opts->gate must be DG_GATE_NONE, DG_GATE_KDA or "
                       "DG_GATE_LOWERBOUND, got %d",
                       op, (int)opts->gate);
    if (opts->tensor_cores < DG_KDA_TC_DEFAULT || opts->tensor_cores > DG_KDA_TC_3XTF32)
        return dg__err(DG_ERR_ARG,
                       "%s: opts->tensor_cores must be DG_KDA_TC_DEFAULT, _OFF or _3XTF32 (0..2), "
                       "got %d",
                       op, (int)opts->tensor_cores);
    double lb = opts->lower_bound == 0 ? -5.0 : opts->lower_bound;
    if (opts->gate == DG_GATE_LOWERBOUND && !(lb >= -5.0 && lb < 0.0))
        return dg__err(DG_ERR_ARG,
                       "%s: opts->lower_bound must be in [-5, 0) (0 selects -5), got %g", op,
                       opts->lower_bound);
    if (B < 1 || T < 1 || K < 1 || V < 1 || H < 1 || HV < 1)
        return dg__err(DG_ERR_SHAPE,
                       "%s: every dim must be >= 1, got B=%lld T=%lld H=%d HV=%d K=%d V=%d", op,
                       (long long)B, (long long)T, H, HV, K, V);
    if (HV % H != 0)
        return dg__err(DG_ERR_SHAPE,
                       "%s: value heads HV=%d must be a multiple of the q/k heads H=%d (GVA)", op,
                       HV, H);
    if (!isfinite(opts->scale))
        return dg__err(DG_ERR_ARG, "%s: opts->scale must be finite, got %g", op, opts->scale);

    int N;
    if (opts->cu_seqlens) {
        if (B != 1)
            return dg__err(DG_ERR_ARG,
                           "%s: cu_seqlens needs B == 1 (varlen packs the sequences into one row), "
                           "got B=%lld",
                           op, (long long)B);
        if (opts->n_seqs < 1)
            return dg__err(DG_ERR_ARG, "%s: opts->n_seqs must be >= 1 with cu_seqlens, got %d", op,
                           opts->n_seqs);
        N = opts->n_seqs;
        const int64_t *cu = opts->cu_seqlens;
        if (cu[0] != 0 || cu[N] != T)
            return dg__err(
                DG_ERR_ARG,
                "%s: cu_seqlens must start at 0 and end at T=%lld, got cu_seqlens[0]=%lld "
                "cu_seqlens[%d]=%lld",
                op, (long long)T, (long long)cu[0], N, (long long)cu[N]);
        for (int n = 0; n < N; n++)
            if (cu[n + 1] < cu[n])
                return dg__err(DG_ERR_ARG,
                               "%s: cu_seqlens must be non-decreasing, got cu_seqlens[%d]=%lld > "
                               "cu_seqlens[%d]=%lld",
                               op, n, (long long)cu[n], n + 1, (long long)cu[n + 1]);
    } else {
        if (B > INT32_MAX)
            return dg__err(DG_ERR_SHAPE, "%s: B=%lld is too large", op, (long long)B);
        N = (int)B;
    }

    cfg->tab = (int64_t *)DG_MALLOC(sizeof(int64_t) * 2 * ((size_t)N + 1));
    if (!cfg->tab)
        return dg__err(DG_ERR_NOMEM, "%s: no memory for the chunk tables", op);
    int64_t *cu = cfg->tab, *off = cfg->tab + N + 1;
    off[0] = 0;
    for (int n = 0; n <= N; n++)
        cu[n] = opts->cu_seqlens ? opts->cu_seqlens[n] : (int64_t)n * T;
    for (int n = 0; n < N; n++)
        off[n + 1] = off[n] + (cu[n + 1] - cu[n] + BT - 1) / BT;

    cfg->d.B = B;
    cfg->d.T = T;
    cfg->d.H = H;
    cfg->d.HV = HV;
    cfg->d.K = K;
    cfg->d.V = V;
    cfg->d.BT = BT;
    cfg->d.N = N;
    cfg->d.cu = cu;
    cfg->d.chunk_off = off;
    cfg->cuda = ctx->device.kind == DG_DEV_CUDA;
    cfg->dt = cfg->cuda ? DG_F32 : dt_in;
    cfg->m_in = cfg->cuda ? DG_MASK(DG_F32) | DG_MASK(DG_BF16) : DG_MASK(dt_in);
    cfg->m_f = DG_MASK(cfg->dt);
    cfg->mid = cfg->dt; /* dg__kda_cfg_dev may choose bf16 on CUDA */
    /* bf16 activations: TF32 tensor-core products are within that dtype's accuracy */
    cfg->tc = cfg->cuda && dt_in == DG_BF16 ? kda_tc_of(opts->tensor_cores) : 0;
    cfg->scale = opts->scale > 0 ? opts->scale : 1.0 / sqrt((double)K);
    cfg->gate = opts->gate;
    cfg->lb = lb;
    cfg->beta_c = opts->allow_neg_eigval ? 2.0 : 1.0;
    return DG_OK;
}

void dg__kda_cfg_free(kda_cfg *cfg) {
    DG_FREE(cfg->tab);
    cfg->tab = NULL;
    dg__kda_dev_release(&cfg->dev);
}

dg_status dg__kda_finish(kda_cfg *cfg, dg_status st, dg_tensor **o, dg_tensor **ht) {
    dg__kda_cfg_free(cfg);
    if (st != DG_OK) {
        dg_tensor_free(o);
        if (ht)
            dg_tensor_free(ht);
    }
    return st;
}

kda_dev *dg__kda_dev_retain(kda_dev *dv) {
    if (dv)
        dv->refcount++;
    return dv;
}

void dg__kda_dev_release(kda_dev **pdv) {
    kda_dev *dv = *pdv;
    *pdv = NULL;
    if (!dv || --dv->refcount > 0)
        return;
#ifdef DG_HAVE_CUDA
    dg__kda_cuda_dims_free(dv->ctx, &dv->d);
#endif
    DG_FREE(dv);
}

dg_status dg__kda_cfg_dev(const char *op, dg_ctx *ctx, kda_cfg *c, kda_dev *share) {
    if (!c->cuda)
        return DG_OK;
#ifdef DG_HAVE_CUDA
    const kda_dims *d = &c->d;
    if (share) {
        /* the stages of one composite call see the same sequences and chunk size */
        if (share->d.N != d->N || share->d.BT != d->BT || share->d.NC != kda_cfg_nc(c) ||
            share->d.TT != d->B * d->T)
            return dg__err(DG_ERR_STATE, "%s: shared chunk tables do not match this call", op);
        c->dev = dg__kda_dev_retain(share);
    } else {
        kda_dev *dv = (kda_dev *)DG_CALLOC(1, sizeof *dv);
        if (!dv)
            return dg__err(DG_ERR_NOMEM, "%s: no memory for the device chunk tables", op);
        dg_status st = dg__kda_cuda_dims_new(ctx, d->B * d->T, d->H, d->HV, d->K, d->V, d->BT, d->N,
                                             d->cu, d->chunk_off, &dv->d);
        if (st != DG_OK) {
            DG_FREE(dv);
            return st;
        }
        dv->refcount = 1;
        dv->ctx = ctx;
        dv->d.tc = c->tc; /* what the stages of a composite sharing these tables inherit */
        c->dev = dv;
    }
    /* the tables (and buf, which the launchers check) come from dev; the sizes are this stage's */
    c->cd = c->dev->d;
    c->cd.H = d->H;
    c->cd.HV = d->HV;
    c->cd.K = d->K;
    c->cd.V = d->V;
    if (c->tc) /* bf16 inputs of this stage's own; else the composite's mode (or 0) */
        c->cd.tc = c->tc;
    /* bf16 storage of the intermediates wherever every kernel that touches them can take it;
     * a function of the mode and the sizes only, so the stages of a composite agree */
    c->cd.mid = dg__kda_mid_fits(&c->cd);
    c->mid = c->cd.mid ? DG_BF16 : c->dt;
    return DG_OK;
#else
    (void)ctx;
    (void)share;
    return dg__no_cuda(op);
#endif
}

static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t len = 0;
    len += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (len < n)
        snprintf(buf + len, n - len, "]");
}

static const char *mask_name(unsigned m) {
    if (m == (DG_MASK(DG_F32) | DG_MASK(DG_BF16)))
        return "f32 or bf16";
    for (int t = 0; t < DG_NDTYPES; t++)
        if (m == DG_MASK(t))
            return dg_dtype_name((dg_dtype)t);
    return "a float dtype";
}

/* Non-NULL and on ctx's device. */
static dg_status check_place(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx) {
    if (!t)
        return dg__err(DG_ERR_ARG, "%s: %s is NULL", op, arg);
    return dg__check_device(op, arg, t, ctx);
}

dg_status dg__kda_check_first(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx,
                              int ndim, const char *names) {
    DG_TRY(check_place(op, arg, t, ctx));
    if (dg__is_cuda(t)) {
        if (t->dtype != DG_F32 && t->dtype != DG_BF16)
            return dg__err(
                DG_ERR_DTYPE,
                "%s: %s must be f32 or bf16 on CUDA (the kernels compute in f32), got %s", op, arg,
                dg_tensor_desc(t));
    } else if (t->dtype != DG_F64 && t->dtype != DG_F32) {
        return dg__err(DG_ERR_DTYPE, "%s: %s must be f64 or f32 on the CPU, got %s", op, arg,
                       dg_tensor_desc(t));
    }
    if (t->ndim != ndim)
        return dg__err(DG_ERR_SHAPE, "%s: %s must be [%s] (%d-D), got %s", op, arg, names, ndim,
                       dg_tensor_desc(t));
    return DG_OK;
}

dg_status dg__kda_check(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx,
                        unsigned mask, int ndim, const int64_t *shape, const char *names) {
    DG_TRY(check_place(op, arg, t, ctx));
    char want[128];
    fmt_shape(want, sizeof want, ndim, shape);
    const char *why = dg__is_cuda(t) ? "" : " (one dtype for all inputs)";
    if (!(mask & DG_MASK(t->dtype)))
        return dg__err(DG_ERR_DTYPE, "%s: %s must be [%s] = %s %s%s, got %s", op, arg, names, want,
                       mask_name(mask), why, dg_tensor_desc(t));
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = t->shape[i] == shape[i];
    if (!ok)
        return dg__err(DG_ERR_SHAPE, "%s: %s must be [%s] = %s %s, got %s", op, arg, names, want,
                       mask_name(mask), dg_tensor_desc(t));
    return DG_OK;
}

dg_status dg__kda_ptr(dg_ctx *ctx, const dg_tensor *t, dg_dtype dt, dg_tensor **tmp,
                      const void **ptr) {
    return dg__data_as(ctx, t, dt, 0, tmp, ptr, NULL);
}

dg_status dg__kda_in_ptr(dg_ctx *ctx, const dg_tensor *t, dg_dtype dt, dg_tensor **tmp,
                         const void **ptr, int *bf16) {
    return dg__data_as(ctx, t, dt, 1, tmp, ptr, bf16);
}

dg_status dg__kda_copy_new(dg_ctx *ctx, const dg_tensor *src, dg_dtype dt, dg_tensor **out) {
    DG_TRY(dg_tensor_new(ctx, dt, src->ndim, src->shape, out));
    dg_status s = dg_tensor_copy_(*out, src);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg__kda_as_dtype(dg_ctx *ctx, dg_tensor *src, dg_dtype dt, dg_tensor **out) {
    if (src->dtype == dt) {
        *out = dg_tensor_retain(src);
        return DG_OK;
    }
    return dg__kda_copy_new(ctx, src, dt, out);
}

dg_status dg__kda_new(dg_ctx *ctx, const kda_cfg *c, int ndim, const int64_t *shape,
                      dg_tensor **out) {
    return dg_tensor_new(ctx, c->dt, ndim, shape, out);
}

dg_status dg__kda_new_mid(dg_ctx *ctx, const kda_cfg *c, int ndim, const int64_t *shape,
                          dg_tensor **out) {
    return dg_tensor_new(ctx, c->mid, ndim, shape, out);
}

static void np_free(void *params) {
    kda_np *np = (kda_np *)params;
    dg__group_release(&np->grp);
    dg__kda_dev_release(&np->cfg.dev);
}

void dg__kda_cfg_copy(kda_cfg *dst, const kda_cfg *src, int64_t *tab) {
    *dst = *src;
    memcpy(tab, src->tab, 2 * ((size_t)src->d.N + 1) * sizeof(int64_t));
    dst->tab = tab;
    dst->d.cu = tab;
    dst->d.chunk_off = tab + src->d.N + 1;
    dst->dev = dg__kda_dev_retain(src->dev);
}

kda_np *dg__kda_np_new(dg_node *n, const kda_cfg *cfg, dg__group *grp) {
    size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    kda_np *np = (kda_np *)dg__node_params(n, sizeof(kda_np) + ntab * sizeof(int64_t));
    if (!np)
        return NULL;
    dg__kda_cfg_copy(&np->cfg, cfg, np->tab);
    np->grp = dg__group_retain(grp);
    n->params_free = np_free;
    return np;
}

dg_status dg__kda_check_inputs(const char *op, dg_ctx *ctx, dg_tensor *q, dg_tensor *k,
                               dg_tensor *v, dg_tensor *g, dg_tensor *beta, dg_tensor *A_log,
                               dg_tensor *dt_bias, dg_tensor *h0, const dg_kda_opts *opts,
                               kda_cfg *cfg) {
    DG_TRY(dg__kda_check_first(op, "q", q, ctx, 4, "B,T,H,K"));
    DG_TRY(dg__kda_check_first(op, "v", v, ctx, 4, "B,T,HV,V"));
    const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
    const int64_t HV = v->shape[2], V = v->shape[3];
    DG_TRY(dg__kda_cfg_init(op, ctx, opts, B, T, (int)H, (int)HV, (int)K, (int)V, q->dtype, cfg));
    const unsigned mi = DG_MASK(q->dtype), mf = cfg->m_f; /* q, k, v, g, beta share q's dtype */
    int64_t sq[4] = {B, T, H, K}, sv[4] = {B, T, HV, V}, sg[4] = {B, T, HV, K}, sb[3] = {B, T, HV};
    int64_t sA[1] = {HV}, sd[1] = {HV * K}, s0[4] = {cfg->d.N, HV, K, V};
    dg_status st = dg__kda_check(op, "k", k, ctx, mi, 4, sq, "B,T,H,K");
    if (st == DG_OK)
        st = dg__kda_check(op, "v", v, ctx, mi, 4, sv, "B,T,HV,V");
    if (st == DG_OK)
        st = dg__kda_check(op, "g", g, ctx, mi, 4, sg, "B,T,HV,K");
    if (st == DG_OK)
        st = dg__kda_check(op, "beta", beta, ctx, mi, 3, sb, "B,T,HV");
    if (st == DG_OK && cfg->gate == DG_GATE_NONE && (A_log || dt_bias))
        st = dg__err(DG_ERR_ARG,
                     "%s: A_log/dt_bias were given but opts->gate is DG_GATE_NONE (g is "
                     "used as the log decay itself)",
                     op);
    if (st == DG_OK && cfg->gate == DG_GATE_KDA && !A_log)
        st = dg__err(DG_ERR_ARG, "%s: A_log [HV] is required with DG_GATE_KDA", op);
    if (st == DG_OK && A_log)
        st = dg__kda_check(op, "A_log", A_log, ctx, mf, 1, sA, "HV");
    if (st == DG_OK && dt_bias)
        st = dg__kda_check(op, "dt_bias", dt_bias, ctx, mf, 1, sd, "HV*K");
    if (st == DG_OK && h0)
        st = dg__kda_check(op, "h0", h0, ctx, mf, 4, s0, "N,HV,K,V");
    if (st == DG_OK)
        st = dg__kda_cfg_dev(op, ctx, cfg, NULL);
    if (st != DG_OK)
        dg__kda_cfg_free(cfg);
    return st;
}

kda_acc_targets dg__kda_grad_targets(dg_node *n, const kda_cfg *c, int iq, int ik, int iG) {
    kda_acc_targets t = {NULL, NULL, NULL, 0u};
    if (!c->cuda)
        return t;
    t.dq = dg__node_grad_inplace(n, iq, DG_F32);
    t.dk = dg__node_grad_inplace(n, ik, DG_F32);
    t.dG = dg__node_grad_inplace(n, iG, DG_F32);
    t.acc = (t.dq ? KDA_ACC_DQ : 0u) | (t.dk ? KDA_ACC_DK : 0u) | (t.dG ? KDA_ACC_DG : 0u);
    return t;
}

dg_status dg__kda_grad_buffer(dg_ctx *ctx, const kda_cfg *c, const dg_tensor *t, dg_tensor *into,
                              dg_tensor **out, void **ptr) {
    *out = NULL;
    if (into) {
        *ptr = dg_tensor_data(into);
        return DG_OK;
    }
    DG_TRY(kda_new_as(ctx, c, t, out));
    *ptr = dg_tensor_data(*out);
    return DG_OK;
}

dg_status dg__kda_qk_ptrs(dg_ctx *ctx, const kda_cfg *c, const dg_tensor *q, const dg_tensor *k,
                          const dg_tensor *rq, const dg_tensor *rk, dg_tensor **tq, dg_tensor **tk,
                          kda_qk_in *out) {
    memset(out, 0, sizeof *out);
    *tq = *tk = NULL;
    if (c->cuda && q->dtype == DG_BF16 && k->dtype == DG_BF16 && dg_tensor_is_contiguous(q) &&
        dg_tensor_is_contiguous(k)) {
        out->q = dg_tensor_data(q);
        out->k = dg_tensor_data(k);
        out->bf16 = 1;
    } else {
        DG_TRY(dg__kda_ptr(ctx, q, c->dt, tq, &out->q));
        dg_status st = dg__kda_ptr(ctx, k, c->dt, tk, &out->k);
        if (st != DG_OK) {
            dg_tensor_free(tq);
            return st;
        }
    }
    out->rq = rq ? (const float *)dg_tensor_data(rq) : NULL;
    out->rk = rk ? (const float *)dg_tensor_data(rk) : NULL;
    return DG_OK;
}

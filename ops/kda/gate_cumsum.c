/*
 * ops/kda/gate_cumsum.c -- N3: the gate and the chunk-local cumsum (kda.md §11.2, §11.4(a), §11.6
 * B5).
 *
 *   z = x + dt_bias[hv,d]
 *   NONE:        g = x                                   (x is already the log decay, <= 0)
 *   KDA:         g = -exp(A_log[hv]) softplus(z)
 *   LOWERBOUND:  g = lb sigmoid(a z),  a = exp(A_log[hv]) (1 without A_log)
 *   G_i = sum_{r <= i} g_r  inside each chunk (restarts every BT tokens of each sequence)
 * Backward: dg = reverse chunk cumsum of dG, then the elementwise gate backward, reducing
 * dA_log [HV] and ddt_bias [HV*K] over all tokens. Natural-log convention (exp, not exp2).
 * Shapes: x, G [B,T,HV,K]. Saved: x, A_log, dt_bias (G is cheap to recompute and its backward
 * does not need it, so CACHE and RECOMPUTE keep the same).
 * CUDA: g f32 or bf16, A_log and dt_bias f32; G is f32.
 *
 * Decay of (nearly) zero: before the cumsum, g is floored at KDA_G_FLOOR (-128) on the CPU. A
 * step with g = -inf (or a saturated gate, g = -1e6) wipes the state in the recurrence; in the
 * chunked form the gate differences G_i - G_j of two tokens after that step would be
 * -inf - (-inf) = NaN. exp(-128) ~ 2.6e-56 is far below f64 resolution relative to the state
 * (and 0 in f32), so the floored chunked form equals the recurrence; the gradient through a
 * floored g is 0, which is what the recurrence gives there (exp(g) = 0).
 */
#ifndef DG_REF_TMPL
#include "kda.h"
#define DG_REF_TMPL "kda/gate_cumsum.c"
#include "../ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

#ifndef KDA_G_FLOOR
#define KDA_G_FLOOR (-128)
#endif

void RF(dg__kda_gate_fwd)(const kda_dims *d, dg_gate_kind kind, RT lb, int cumsum, const RT *x,
                          const RT *A_log, const RT *dt_bias, RT *G) {
    const int HV = d->HV, K = d->K, row = HV * K;
    const int64_t TT = d->B * d->T;
    KDA_OMP(parallel for schedule(static) if (TT * row > 32768))
    for (int64_t t = 0; t < TT; t++)
        for (int hv = 0; hv < HV; hv++) {
            const RT *xr = x + t * row + hv * K;
            RT *gr = G + t * row + hv * K;
            RT a = A_log ? REXP(A_log[hv]) : (RT)1;
            for (int c = 0; c < K; c++) {
                RT z = xr[c] + (dt_bias ? dt_bias[hv * K + c] : (RT)0);
                if (kind == DG_GATE_KDA)
                    gr[c] = -a * RF(kda_softplus)(z);
                else if (kind == DG_GATE_LOWERBOUND)
                    gr[c] = lb * RF(kda_sigmoid)(a * z);
                else
                    gr[c] = xr[c];
                if (cumsum && gr[c] < (RT)KDA_G_FLOOR) /* NaN stays NaN */
                    gr[c] = (RT)KDA_G_FLOOR;
            }
        }
    if (!cumsum)
        return;
    /* rows of one chunk are consecutive tokens, each row HV*K wide; chunks are independent */
    const int64_t NC = d->chunk_off[d->N];
    KDA_OMP(parallel for schedule(static) if (TT * row > 32768))
    for (int64_t idx = 0; idx < NC; idx++) {
        kda_chunk ch = kda_chunk_idx(d, idx);
        for (int i = 1; i < ch.L; i++) {
            RT *cur = G + (ch.t0 + i) * row;
            const RT *prev = cur - row;
            for (int e = 0; e < row; e++)
                cur[e] += prev[e];
        }
    }
}

void RF(dg__kda_gate_bwd)(const kda_dims *d, dg_gate_kind kind, RT lb, int cumsum, const RT *x,
                          const RT *A_log, const RT *dt_bias, const RT *dG, RT *dx, RT *dA_log,
                          RT *ddt_bias) {
    const int HV = d->HV, K = d->K, row = HV * K;
    const int64_t TT = d->B * d->T, NC = d->chunk_off[d->N];
    memcpy(dx, dG, sizeof(RT) * (size_t)(TT * row));
    if (cumsum) {
        KDA_OMP(parallel for schedule(static) if (TT * row > 32768))
        for (int64_t idx = 0; idx < NC; idx++) {
            kda_chunk ch = kda_chunk_idx(d, idx);
            for (int i = ch.L - 2; i >= 0; i--) {
                RT *cur = dx + (ch.t0 + i) * row;
                const RT *next = cur + row;
                for (int e = 0; e < row; e++)
                    cur[e] += next[e];
            }
        }
    }
    if (dA_log)
        memset(dA_log, 0, sizeof(RT) * (size_t)HV);
    if (ddt_bias)
        memset(ddt_bias, 0, sizeof(RT) * (size_t)row);
    if (kind == DG_GATE_NONE) {
        if (cumsum) /* a floored g does not move G */
            for (int64_t i = 0; i < TT * row; i++)
                if (x[i] < (RT)KDA_G_FLOOR)
                    dx[i] = 0;
        return;
    }
    /* one value head per work item: dA_log[hv] and ddt_bias[hv, :] are summed over the tokens
     * in token order, as a serial loop would, so the reductions are deterministic */
    KDA_OMP(parallel for schedule(static) if (TT * row > 32768))
    for (int hv = 0; hv < HV; hv++) {
        const RT a = A_log ? REXP(A_log[hv]) : (RT)1;
        for (int64_t t = 0; t < TT; t++) {
            const RT *xr = x + t * row + hv * K;
            RT *dr = dx + t * row + hv * K;
            RT da = 0;
            for (int c = 0; c < K; c++) {
                RT z = xr[c] + (dt_bias ? dt_bias[hv * K + c] : (RT)0);
                RT dz;
                if (cumsum && kind == DG_GATE_KDA && -a * RF(kda_softplus)(z) < (RT)KDA_G_FLOOR)
                    dr[c] = 0; /* floored in the forward: no gradient */
                if (kind == DG_GATE_KDA) {
                    /* dg/dz = -a sigmoid(z), dg/dA_log = g */
                    dz = -dr[c] * a * RF(kda_sigmoid)(z);
                    da += dr[c] * (-a * RF(kda_softplus)(z));
                } else {
                    /* u = a z: dg/du = lb s (1 - s); du/dz = a, du/dA_log = u */
                    RT u = a * z, s = RF(kda_sigmoid)(u);
                    RT du = dr[c] * lb * s * ((RT)1 - s);
                    dz = du * a;
                    da += du * u;
                }
                dr[c] = dz;
                if (ddt_bias)
                    ddt_bias[hv * K + c] += dz;
            }
            if (dA_log)
                dA_log[hv] += da;
        }
    }
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_gate_cumsum"

/* The node's inputs, also its saved tensors in the same order (A_log, dt_bias may be NULL). */
enum { IN_X, IN_A_LOG, IN_DT_BIAS };

static dg_status gate_backward(dg_ctx *ctx, dg_node *n) {
    const kda_np *np = (const kda_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const dg_tensor *gG = dg__node_grad_out(n, 0);
    if (!gG)
        return DG_OK;
    dg_tensor *x = n->saved[IN_X], *A = n->saved[IN_A_LOG], *bias = n->saved[IN_DT_BIAS];
    /* converted copies (NULL where the tensor already has the compute dtype) */
    dg_tensor *tx = NULL, *tA = NULL, *tbias = NULL, *tgG = NULL;
    dg_tensor *dx = NULL, *dA = NULL, *db = NULL;
    kda_gate_bwd_io io = {0};
    dg_status st = dg__kda_in_ptr(ctx, x, c->dt, &tx, &io.x, &io.xbf16);
    if (st == DG_OK && A)
        st = dg__kda_ptr(ctx, A, c->dt, &tA, &io.A_log);
    if (st == DG_OK && bias)
        st = dg__kda_ptr(ctx, bias, c->dt, &tbias, &io.dt_bias);
    if (st == DG_OK)
        st = dg__kda_ptr(ctx, gG, c->dt, &tgG, &io.dG);
    if (st == DG_OK) /* in x's dtype where the kernel writes bf16 */
        st = io.xbf16 ? dg_tensor_new(ctx, DG_BF16, x->ndim, x->shape, &dx)
                      : kda_new_as(ctx, c, x, &dx);
    if (st == DG_OK && A && dg__node_wants_grad(n, IN_A_LOG))
        st = kda_new_as(ctx, c, A, &dA);
    if (st == DG_OK && bias && dg__node_wants_grad(n, IN_DT_BIAS))
        st = kda_new_as(ctx, c, bias, &db);
    if (st == DG_OK) {
        io.dx = dg_tensor_data(dx);
        io.dA_log = dA ? dg_tensor_data(dA) : NULL;
        io.ddt_bias = db ? dg_tensor_data(db) : NULL;
        st = kda_run_gate_bwd(ctx, c, 1, &io);
    }
    if (st == DG_OK && dg__node_wants_grad(n, IN_X))
        st = dg__node_accum(ctx, n, IN_X, dx);
    if (st == DG_OK && dA)
        st = dg__node_accum(ctx, n, IN_A_LOG, dA);
    if (st == DG_OK && db)
        st = dg__node_accum(ctx, n, IN_DT_BIAS, db);
    dg_tensor_free(&tx);
    dg_tensor_free(&tA);
    dg_tensor_free(&tbias);
    dg_tensor_free(&tgG);
    dg_tensor_free(&dx);
    dg_tensor_free(&dA);
    dg_tensor_free(&db);
    return st;
}

dg_status dg__kda_gate_x(dg_ctx *ctx, dg_tensor *g, dg_tensor *A_log, dg_tensor *dt_bias,
                         const dg_kda_opts *opts, kda_dev *share, int defer, dg_tensor **G) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "G", G));
    *G = NULL;
    DG_TRY(dg__kda_check_first(OP, "g", g, ctx, 4, "B,T,HV,K"));
    const int64_t *s = g->shape;
    kda_cfg cfg;
    DG_TRY(dg__kda_cfg_init(OP, ctx, opts, s[0], s[1], (int)s[2], (int)s[2], (int)s[3], 1, g->dtype,
                            &cfg));
    dg_status st = DG_OK;
    if (cfg.gate == DG_GATE_NONE && (A_log || dt_bias))
        st = dg__err(DG_ERR_ARG, OP ": A_log/dt_bias were given but opts->gate is DG_GATE_NONE "
                                    "(g is used as the log decay itself)");
    else if (cfg.gate == DG_GATE_KDA && !A_log)
        st = dg__err(DG_ERR_ARG, OP ": A_log [HV] is required with DG_GATE_KDA");
    int64_t shA[1] = {s[2]}, shB[1] = {s[2] * s[3]};
    if (st == DG_OK && A_log)
        st = dg__kda_check(OP, "A_log", A_log, ctx, cfg.m_f, 1, shA, "HV");
    if (st == DG_OK && dt_bias)
        st = dg__kda_check(OP, "dt_bias", dt_bias, ctx, cfg.m_f, 1, shB, "HV*K");
    if (st == DG_OK)
        st = dg__kda_cfg_dev(OP, ctx, &cfg, share);
    dg_tensor *tg = NULL, *tA = NULL, *tbias = NULL; /* converted copies */
    kda_gate_fwd_io io = {0};
    if (st == DG_OK)
        st = dg__kda_in_ptr(ctx, g, cfg.dt, &tg, &io.x, &io.xbf16);
    if (st == DG_OK && A_log)
        st = dg__kda_ptr(ctx, A_log, cfg.dt, &tA, &io.A_log);
    if (st == DG_OK && dt_bias)
        st = dg__kda_ptr(ctx, dt_bias, cfg.dt, &tbias, &io.dt_bias);
    if (st == DG_OK) /* G is an f32 intermediate on CUDA whatever g's dtype */
        st = dg__kda_new(ctx, &cfg, 4, g->shape, G);
    if (st == DG_OK && !defer) { /* defer: the intra kernel's prep fills G (kda.h) */
        io.G = dg_tensor_data(*G);
        st = kda_run_gate_fwd(ctx, &cfg, 1, &io);
    }
    dg_tensor *in[3] = {g, A_log, dt_bias}; /* IN_X, IN_A_LOG, IN_DT_BIAS */
    if (st == DG_OK && dg__needs_grad(3, in)) {
        dg_node *n;
        st = dg__node_new("kda_gate_cumsum", DG_POLICY_RECOMPUTE, gate_backward, ctx, &n);
        if (st == DG_OK) {
            for (int i = 0; i < 3 && st == DG_OK; i++)
                dg__node_input(n, in[i]);
            if (st == DG_OK)
                st = dg__node_output(n, *G);
            for (int i = 0; i < 3 && st == DG_OK; i++)
                dg__node_save(n, in[i]);
            if (st == DG_OK && !dg__kda_np_new(n, &cfg, NULL))
                st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
            if (st == DG_OK)
                st = dg__node_commit(n);
            else
                dg__node_abort(n);
        }
    }
    dg_tensor_free(&tg);
    dg_tensor_free(&tA);
    dg_tensor_free(&tbias);
    dg__kda_cfg_free(&cfg);
    if (st != DG_OK)
        dg_tensor_free(G);
    return st;
}

dg_status dg_kda_gate_cumsum(dg_ctx *ctx, dg_tensor *g, dg_tensor *A_log, dg_tensor *dt_bias,
                             const dg_kda_opts *opts, dg_tensor **G) {
    return dg__kda_gate_x(ctx, g, A_log, dt_bias, opts, NULL, 0, G);
}
#endif

/*
 * examples/tiny_model/tiny_model.c -- a one-layer byte-level language model with a KDA token
 * mixer, trained a few steps on one line of text with the tape and AdamW (f32 on the CPU).
 *
 *   x      = embed(ids)                                  [1,T,d]
 *   h      = rmsnorm(x)
 *   q,k,g  = h Wq, h Wk, h Wg  as [1,T,H,K];  v = h Wv  as [1,T,H,K];  b = h Wb  [1,T,H]
 *   x      = x + kda_chunk(q, k, v, g, b) Wo             (KDA gate, q/k L2-normalised, raw beta)
 *   logits = rmsnorm(x) Wout                             [T,Vocab]
 *   loss   = cross_entropy(logits, next byte)
 *
 * Prints the loss of every step; exits 1 unless the last loss is below half the first.
 */
#include <deltagrad.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        dg_status st_ = (expr);                                                                    \
        if (st_ != DG_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, dg_status_str(st_),             \
                    dg_last_error());                                                              \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

enum { VOCAB = 128, D = 32, H = 2, K = 16, T = 96, STEPS = 40 };

/* the parameters, in one array for the optimizer */
enum { P_EMB, P_N1, P_WQ, P_WK, P_WV, P_WG, P_WB, P_ALOG, P_DTB, P_WO, P_N2, P_OUT, NPARAM };

/* Every intermediate tensor of a step, freed together after the update. */
static dg_tensor *g_tmp[64];
static int g_ntmp;
static dg_tensor *keep(dg_tensor *t) {
    if (g_ntmp == (int)(sizeof g_tmp / sizeof *g_tmp)) {
        fprintf(stderr, "too many intermediates\n");
        exit(2);
    }
    return g_tmp[g_ntmp++] = t;
}
static void free_step(void) {
    while (g_ntmp > 0)
        dg_tensor_free(&g_tmp[--g_ntmp]);
}

static dg_tensor *linear(dg_ctx *ctx, dg_tensor *x, dg_tensor *w) {
    dg_tensor *y;
    TRY(dg_linear(ctx, x, w, &y));
    return keep(y);
}

static dg_tensor *reshape4(dg_tensor *x, int64_t d2, int64_t d3) {
    const int64_t shape[4] = {1, T, d2, d3};
    dg_tensor *y;
    TRY(dg_reshape(x, 4, shape, &y));
    return keep(y);
}

static dg_tensor *forward_loss(dg_ctx *ctx, dg_tensor **p, dg_tensor *ids, dg_tensor *targets) {
    dg_tensor *x, *h, *o, *ht, *x2, *y, *loss;
    TRY(dg_embedding(ctx, p[P_EMB], ids, &x));
    keep(x);
    TRY(dg_rmsnorm(ctx, x, p[P_N1], 1e-6, &h));
    keep(h);
    dg_tensor *q = reshape4(linear(ctx, h, p[P_WQ]), H, K);
    dg_tensor *k = reshape4(linear(ctx, h, p[P_WK]), H, K);
    dg_tensor *v = reshape4(linear(ctx, h, p[P_WV]), H, K);
    dg_tensor *g = reshape4(linear(ctx, h, p[P_WG]), H, K);
    dg_tensor *b = linear(ctx, h, p[P_WB]);
    dg_kda_opts opts = {0};
    opts.gate = DG_GATE_KDA;
    opts.l2norm_qk = 1;
    opts.beta_sigmoid = 1;
    TRY(dg_kda_chunk(ctx, q, k, v, g, b, p[P_ALOG], p[P_DTB], NULL, &opts, &o, &ht));
    keep(o);
    const int64_t s_btd[3] = {1, T, D}, s_tv[2] = {T, VOCAB};
    dg_tensor *o3;
    TRY(dg_reshape(o, 3, s_btd, &o3));
    keep(o3);
    TRY(dg_add(ctx, x, linear(ctx, o3, p[P_WO]), &x2));
    keep(x2);
    TRY(dg_rmsnorm(ctx, x2, p[P_N2], 1e-6, &y));
    keep(y);
    dg_tensor *logits;
    TRY(dg_reshape(linear(ctx, y, p[P_OUT]), 2, s_tv, &logits));
    keep(logits);
    TRY(dg_cross_entropy(ctx, logits, targets, -1, &loss));
    return keep(loss);
}

int main(void) {
    printf("deltagrad %s, commit %s\n", dg_version(), dg_build_commit());
    dg_ctx *ctx;
    TRY(dg_ctx_new(dg_cpu(), &ctx));

    /* the data: T + 1 bytes of text; predict byte t + 1 from bytes 0..t */
    const char *text = "the quick brown fox jumps over the lazy dog; ";
    int64_t ids_h[T], tgt_h[T];
    for (int t = 0; t < T; t++) {
        ids_h[t] = (unsigned char)text[t % strlen(text)] % VOCAB;
        tgt_h[t] = (unsigned char)text[(t + 1) % strlen(text)] % VOCAB;
    }
    const int64_t s_ids[2] = {1, T}, s_tgt[1] = {T};
    dg_tensor *ids, *targets;
    TRY(dg_tensor_from_host(ctx, DG_I64, 2, s_ids, ids_h, &ids));
    TRY(dg_tensor_from_host(ctx, DG_I64, 1, s_tgt, tgt_h, &targets));

    /* parameters: shape, init std (0: filled with `fill`) */
    static const struct {
        int ndim;
        int64_t shape[2];
        double std, fill;
        int decay;
    } spec[NPARAM] = {
        [P_EMB] = {2, {VOCAB, D}, 0.5, 0, 0}, [P_N1] = {1, {D}, 0, 1, 0},
        [P_WQ] = {2, {H * K, D}, 0.2, 0, 1},  [P_WK] = {2, {H * K, D}, 0.2, 0, 1},
        [P_WV] = {2, {H * K, D}, 0.2, 0, 1},  [P_WG] = {2, {H * K, D}, 0.2, 0, 1},
        [P_WB] = {2, {H, D}, 0.2, 0, 1},      [P_ALOG] = {1, {H}, 0, 0, 0},
        [P_DTB] = {1, {H * K}, 0, 0, 0},      [P_WO] = {2, {D, H * K}, 0.2, 0, 1},
        [P_N2] = {1, {D}, 0, 1, 0},           [P_OUT] = {2, {VOCAB, D}, 0.2, 0, 1},
    };
    dg_tensor *p[NPARAM], *m[NPARAM], *v[NPARAM];
    int decay[NPARAM];
    for (int i = 0; i < NPARAM; i++) {
        TRY(dg_tensor_new(ctx, DG_F32, spec[i].ndim, spec[i].shape, &p[i]));
        if (spec[i].std > 0)
            TRY(dg_tensor_rand_normal(p[i], 100 + (uint64_t)i, 0.0, spec[i].std));
        else
            TRY(dg_tensor_fill_(p[i], spec[i].fill));
        dg_tensor_set_requires_grad(p[i], 1);
        TRY(dg_tensor_zeros(ctx, DG_F32, spec[i].ndim, spec[i].shape, &m[i]));
        TRY(dg_tensor_zeros(ctx, DG_F32, spec[i].ndim, spec[i].shape, &v[i]));
        decay[i] = spec[i].decay;
    }
    const dg_adamw_hparams hp = {
        .lr = 0, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.01};
    dg_adamw *opt;
    TRY(dg_adamw_new(ctx, NPARAM, p, m, v, decay, &hp, 1.0, &opt));

    double first = 0, last = 0;
    for (int step = 1; step <= STEPS; step++) {
        dg_tensor *loss = forward_loss(ctx, p, ids, targets);
        TRY(dg_tape_backward(ctx, loss));
        TRY(dg_tensor_item(loss, &last));
        if (step == 1)
            first = last;
        const dg_tensor *grads[NPARAM];
        for (int i = 0; i < NPARAM; i++)
            grads[i] = dg_tensor_grad(p[i]);
        TRY(dg_adamw_set_step(opt, step, 1e-2));
        TRY(dg_adamw_update(opt, grads));
        for (int i = 0; i < NPARAM; i++)
            dg_tensor_zero_grad(p[i]);
        dg_tape_reset();
        free_step();
        if (step == 1 || step % 5 == 0)
            printf("step %3d  loss %.4f\n", step, last);
    }
    int ok = last < 0.5 * first;
    printf("%s: loss %.4f -> %.4f over %d steps\n", ok ? "OK" : "FAIL", first, last, STEPS);

    dg_adamw_free(&opt);
    for (int i = 0; i < NPARAM; i++) {
        dg_tensor_free(&p[i]);
        dg_tensor_free(&m[i]);
        dg_tensor_free(&v[i]);
    }
    dg_tensor_free(&ids);
    dg_tensor_free(&targets);
    dg_ctx_free(&ctx);
    return ok ? 0 : 1;
}

/*
 * examples/kda_check/kda_check.c -- chunked KDA against its token-by-token recurrence, forward
 * and backward, on random f64 tensors on the CPU.
 *
 * Both forms get the same inputs (the KDA gate, q and k L2-normalised inside the op, a raw beta,
 * an initial state); the loss is sum(o * do) + sum(ht * dht) with random do, dht, so the
 * gradients of every input are compared too. Prints the max relative error of each tensor
 * (max |chunk - recurrent| / max |recurrent|) and exits 1 when one exceeds 1e-10.
 */
#include <deltagrad.h>

#include <stdio.h>
#include <stdlib.h>

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        dg_status st_ = (expr);                                                                    \
        if (st_ != DG_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, dg_status_str(st_),             \
                    dg_last_error());                                                              \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

enum { B = 2, T = 100, H = 2, K = 16, V = 24, NIN = 8 };

static const char *const g_in_names[NIN] = {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"};

/* max |a - b| / max |b| over all elements */
static double rel_err(const dg_tensor *a, const dg_tensor *b) {
    double *x, *y, num = 0, den = 0;
    TRY(dg_tensor_to_f64(a, &x));
    TRY(dg_tensor_to_f64(b, &y));
    for (int64_t i = 0; i < dg_tensor_numel(b); i++) {
        double d = x[i] > y[i] ? x[i] - y[i] : y[i] - x[i];
        double m = y[i] < 0 ? -y[i] : y[i];
        num = d > num ? d : num;
        den = m > den ? m : den;
    }
    free(x);
    free(y);
    return num / (den > 1e-300 ? den : 1e-300);
}

/* One forward and backward of the chunked (chunked = 1) or recurrent form. Returns o and ht and
 * the gradients of the inputs (copies: they outlive the tape). */
static void run(dg_ctx *ctx, int chunked, dg_tensor **in, dg_tensor *d_o, dg_tensor *d_ht,
                dg_tensor **o, dg_tensor **ht, dg_tensor **grads) {
    dg_kda_opts opts = {0};
    opts.chunk_size = 32;
    opts.gate = DG_GATE_KDA;
    opts.l2norm_qk = 1;
    opts.beta_sigmoid = 1;
    opts.output_final_state = 1;
    dg_status (*kda)(dg_ctx *, dg_tensor *, dg_tensor *, dg_tensor *, dg_tensor *, dg_tensor *,
                     dg_tensor *, dg_tensor *, dg_tensor *, const dg_kda_opts *, dg_tensor **,
                     dg_tensor **) = chunked ? dg_kda_chunk : dg_kda_recurrent;
    TRY(kda(ctx, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], &opts, o, ht));

    dg_tensor *po, *pht, *so, *sht, *loss;
    TRY(dg_mul(ctx, *o, d_o, &po));
    TRY(dg_mul(ctx, *ht, d_ht, &pht));
    TRY(dg_sum_all(ctx, po, &so));
    TRY(dg_sum_all(ctx, pht, &sht));
    TRY(dg_add(ctx, so, sht, &loss));
    TRY(dg_tape_backward(ctx, loss));
    for (int i = 0; i < NIN; i++) {
        const dg_tensor *gr = dg_tensor_grad(in[i]);
        if (!gr) {
            fprintf(stderr, "no gradient reached %s\n", g_in_names[i]);
            exit(2);
        }
        TRY(dg_tensor_zeros(ctx, DG_F64, dg_tensor_ndim(gr), dg_tensor_shape(gr), &grads[i]));
        TRY(dg_tensor_copy_(grads[i], gr));
        dg_tensor_zero_grad(in[i]);
    }
    dg_tape_reset();
    dg_tensor *tmp[] = {po, pht, so, sht, loss};
    for (size_t i = 0; i < sizeof tmp / sizeof *tmp; i++)
        dg_tensor_free(&tmp[i]);
}

int main(void) {
    printf("deltagrad %s (header %s), commit %s\n", dg_version(), DG_VERSION, dg_build_commit());
    dg_ctx *ctx;
    TRY(dg_ctx_new(dg_cpu(), &ctx));

    const int64_t s_qk[] = {B, T, H, K}, s_v[] = {B, T, H, V}, s_beta[] = {B, T, H};
    const int64_t s_alog[] = {H}, s_dtb[] = {H * K}, s_h[] = {B, H, K, V};
    const int64_t *shapes[NIN] = {s_qk, s_qk, s_v, s_qk, s_beta, s_alog, s_dtb, s_h};
    const int ndims[NIN] = {4, 4, 4, 4, 3, 1, 1, 4};
    dg_tensor *in[NIN];
    for (int i = 0; i < NIN; i++) {
        TRY(dg_tensor_new(ctx, DG_F64, ndims[i], shapes[i], &in[i]));
        TRY(dg_tensor_rand_normal(in[i], 1000 + (uint64_t)i, 0.0, i == 7 ? 0.1 : 1.0));
        dg_tensor_set_requires_grad(in[i], 1);
    }
    dg_tensor *d_o, *d_ht;
    TRY(dg_tensor_new(ctx, DG_F64, 4, s_v, &d_o));
    TRY(dg_tensor_new(ctx, DG_F64, 4, s_h, &d_ht));
    TRY(dg_tensor_rand_normal(d_o, 7, 0.0, 1.0));
    TRY(dg_tensor_rand_normal(d_ht, 8, 0.0, 1.0));

    dg_tensor *o[2], *ht[2], *grads[2][NIN];
    for (int c = 0; c < 2; c++)
        run(ctx, c == 0, in, d_o, d_ht, &o[c], &ht[c], grads[c]);

    const double tol = 1e-10; /* f64: the two forms agree to ~1e-14 */
    int bad = 0;
    double e = rel_err(o[0], o[1]);
    printf("%-8s max rel error %.3e\n", "o", e);
    bad += !(e <= tol);
    e = rel_err(ht[0], ht[1]);
    printf("%-8s max rel error %.3e\n", "ht", e);
    bad += !(e <= tol);
    for (int i = 0; i < NIN; i++) {
        e = rel_err(grads[0][i], grads[1][i]);
        printf("d%-7s max rel error %.3e\n", g_in_names[i], e);
        bad += !(e <= tol);
    }
    printf("%s: chunked KDA %s the recurrence (tolerance %.0e)\n", bad ? "FAIL" : "OK",
           bad ? "differs from" : "equals", tol);

    for (int c = 0; c < 2; c++) {
        dg_tensor_free(&o[c]);
        dg_tensor_free(&ht[c]);
        for (int i = 0; i < NIN; i++)
            dg_tensor_free(&grads[c][i]);
    }
    for (int i = 0; i < NIN; i++)
        dg_tensor_free(&in[i]);
    dg_tensor_free(&d_o);
    dg_tensor_free(&d_ht);
    dg_ctx_free(&ctx);
    return bad ? 1 : 0;
}

/*
 * tools/explain_plots.c -- `deltagrad explain --plots DIR`: gnuplot PNGs of the KDA example.
 * For each plot the data file (.dat) and the gnuplot script (.gp) are written to DIR and gnuplot
 * renders the PNG (pngcairo, else png):
 *   lkk.png, aqk.png      heatmaps of Lkk and Aqk over the whole sequence (block diagonal: one
 *                         block per chunk), the example's sizes and gate
 *   decay.png             the gate decay matrix, mean over the key dims of
 *                         exp(g_{j+1} + ... + g_i), j <= i: how much of token j's write is left at
 * i state_norms.png       |h_c|_F at each chunk start (T >= 256), for three gate strengths
 *   error_chunk.png       max |o - o_ref| / max |o_ref| of the chunked form against the f64
 *   error_gate.png        recurrence, by chunk size and by gate strength, in f32 and in bf16
 * f32: every stage is the library's raw f32 function (f32 inputs, f32 arithmetic). bf16: the
 * inputs q, k, v, beta and the gate input are rounded to bf16, the stages run in f32, and W, U,
 * KG, QG, h and E are rounded to bf16 between the stages, as the CUDA tensor-core path stores
 * them; the rounding is the library's host conversion (dg__f32_to_bf16). The bf16 reference is
 * the f64 recurrence on the rounded inputs, so the curve shows the error of the computation, not
 * of the inputs' rounding. The f32 recurrence is plotted for comparison.
 */
#define _POSIX_C_SOURCE 200809L /* mkdir */

#include "tensor/tensor.h"
#include "tools/explain.h"
#include "tools/explain_kda.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char g_dir[1024];

static FILE *open_in_dir(const char *name) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "w");
    if (!f)
        fprintf(stderr, "deltagrad explain: cannot write %s: %s\n", path, strerror(errno));
    return f;
}

/* Render DIR/name.gp; check DIR/name.png is a non-empty PNG. */
static int render(const char *name) {
    char cmd[1400], path[1400];
    snprintf(cmd, sizeof cmd, "cd '%s' && gnuplot '%s.gp'", g_dir, name);
    if (system(cmd) != 0) {
        fprintf(stderr, "deltagrad explain: gnuplot failed on %s/%s.gp\n", g_dir, name);
        return 2;
    }
    snprintf(path, sizeof path, "%s/%s.png", g_dir, name);
    FILE *f = fopen(path, "rb");
    unsigned char sig[8] = {0};
    static const unsigned char png[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    long size = 0;
    if (f) {
        size_t got = fread(sig, 1, 8, f);
        fseek(f, 0, SEEK_END);
        size = ftell(f);
        fclose(f);
        if (got != 8)
            size = 0;
    }
    if (!f || size <= 8 || memcmp(sig, png, 8)) {
        fprintf(stderr, "deltagrad explain: %s is missing or not a PNG\n", path);
        return 2;
    }
    printf("  %s (%ld bytes)\n", path, size);
    return 0;
}

/* The script header: terminal and output. */
static FILE *script(const char *name, const char *term, int w, int h) {
    char fn[64];
    snprintf(fn, sizeof fn, "%s.gp", name);
    FILE *f = open_in_dir(fn);
    if (f)
        fprintf(f, "set terminal %s size %d,%d\nset output '%s.png'\n", term, w, h, name);
    return f;
}

static int heatmap(const char *name, const char *title, const double *m, int n, const char *term) {
    char fn[64];
    snprintf(fn, sizeof fn, "%s.dat", name);
    FILE *f = open_in_dir(fn);
    if (!f)
        return 2;
    double mx = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            fprintf(f, "%.9g%c", m[(int64_t)i * n + j], j + 1 < n ? ' ' : '\n');
            mx = fmax(mx, fabs(m[(int64_t)i * n + j]));
        }
    fclose(f);
    f = script(name, term, 640, 560);
    if (!f)
        return 2;
    fprintf(f,
            "set title \"%s\"\nset xlabel 'column j (token)'\nset ylabel 'row i (token)'\n"
            "set yrange [%g:%g]\nset xrange [%g:%g]\nset size ratio -1\n"
            "set palette defined (-1 'blue', 0 'white', 1 'red')\nset cbrange [%g:%g]\n"
            "plot '%s.dat' matrix with image notitle\n",
            title, n - 0.5, -0.5, -0.5, n - 0.5, mx > 0 ? -mx : -1, mx > 0 ? mx : 1, name);
    fclose(f);
    return render(name);
}

/* Round n values to bf16 in place. */
static void to_bf16(float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        a[i] = dg__bf16_to_f32(dg__f32_to_bf16(a[i]));
}
static float *to_f32(const double *a, int64_t n) {
    float *p = (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!p) {
        fprintf(stderr, "deltagrad explain: out of host memory\n");
        exit(2);
    }
    for (int64_t i = 0; i < n; i++)
        p[i] = a ? (float)a[i] : 0.0f;
    return p;
}

/* max |o - ref| / max |ref| */
static double err_of(const float *o, const double *ref, int64_t n) {
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)o[i] - ref[i]));
        m = fmax(m, fabs(ref[i]));
    }
    return m > 0 ? e / m : e;
}

/* The chunked forward in f32 from the example's raw inputs (l2norm, beta and gate included);
 * bf16 rounds the inputs and the stored intermediates. o: [T, V]. */
static int chunked_f32(const kx *x, int bf16, float *o) {
    const kda_dims *d = &x->d;
    const int64_t nk = (int64_t)x->T * x->K, nv = (int64_t)x->T * x->V, kv = (int64_t)x->K * x->V;
    const int64_t na = (int64_t)x->T * x->BT;
    float *qr = to_f32(x->qr, nk), *kr = to_f32(x->kr, nk), *v = to_f32(x->v, nv);
    float *br = to_f32(x->braw, x->T), *gx = to_f32(x->x, nk), *dtb = to_f32(x->dt_bias, x->K);
    float A_log = (float)x->A_log[0];
    float *q = to_f32(NULL, nk), *k = to_f32(NULL, nk), *beta = to_f32(NULL, x->T);
    float *G = to_f32(NULL, nk), *Aqk = to_f32(NULL, na), *Tm = to_f32(NULL, na);
    float *W = to_f32(NULL, nk), *U = to_f32(NULL, nv), *KG = to_f32(NULL, nk);
    float *QG = to_f32(NULL, nk), *h = to_f32(NULL, x->NC * kv), *E = to_f32(NULL, nv);
    dg__l2norm_fwd_f32(x->T, x->K, KDA_L2_EPS, qr, q, NULL);
    dg__l2norm_fwd_f32(x->T, x->K, KDA_L2_EPS, kr, k, NULL);
    dg__kda_beta_fwd_f32(x->T, 1.0f, br, beta);
    if (bf16) {
        to_bf16(q, nk);
        to_bf16(k, nk);
        to_bf16(v, nv);
        to_bf16(beta, x->T);
        to_bf16(gx, nk);
    }
    dg__kda_gate_fwd_f32(d, x->gate, (float)x->lb, 1, gx, x->gate == DG_GATE_KDA ? &A_log : NULL,
                         dtb, G);
    int rc = 0;
    if (dg__kda_intra_fwd_f32(d, (float)x->scale, q, k, beta, G, Aqk, Tm) ||
        dg__kda_wy_fwd_f32(d, q, k, v, beta, G, Tm, W, U, KG, QG))
        rc = 2;
    if (!rc && bf16) {
        to_bf16(W, nk);
        to_bf16(U, nv);
        to_bf16(KG, nk);
        to_bf16(QG, nk);
    }
    if (!rc && dg__kda_state_fwd_f32(d, W, U, KG, G, NULL, h, E, NULL))
        rc = 2;
    if (!rc) {
        if (bf16) {
            to_bf16(h, x->NC * kv);
            to_bf16(E, nv);
        }
        dg__kda_output_fwd_f32(d, (float)x->scale, QG, h, Aqk, E, o);
    }
    if (rc)
        fprintf(stderr, "deltagrad explain: f32 forward: %s\n", dg_last_error());
    float *fr[] = {qr, kr, v, br, gx, dtb, q, k, beta, G, Aqk, Tm, W, U, KG, QG, h, E};
    for (size_t i = 0; i < sizeof fr / sizeof *fr; i++)
        free(fr[i]);
    return rc;
}

/* The f64 reference on the bf16-rounded inputs (or the exact ones) and the f32 recurrence. */
static int reference(kx *x, int bf16, double *oref, float *orec32) {
    const int64_t nk = (int64_t)x->T * x->K, nv = (int64_t)x->T * x->V;
    double *q = ex_zeros(nk), *k = ex_zeros(nk), *v = ex_zeros(nv), *beta = ex_zeros(x->T),
           *gx = ex_zeros(nk), *g = ex_zeros(nk);
    float *t = to_f32(NULL, nk > nv ? nk : nv);
    dg__l2norm_fwd_f64(x->T, x->K, KDA_L2_EPS, x->qr, q, NULL);
    dg__l2norm_fwd_f64(x->T, x->K, KDA_L2_EPS, x->kr, k, NULL);
    dg__kda_beta_fwd_f64(x->T, 1.0, x->braw, beta);
    memcpy(v, x->v, sizeof(double) * (size_t)nv);
    memcpy(gx, x->x, sizeof(double) * (size_t)nk);
    double *rd[] = {q, k, v, beta, gx};
    const int64_t rn[] = {nk, nk, nv, x->T, nk};
    for (int i = 0; i < 5 && bf16; i++) { /* round as the f32 path does: f32, then bf16 */
        for (int64_t j = 0; j < rn[i]; j++)
            t[j] = (float)rd[i][j];
        to_bf16(t, rn[i]);
        for (int64_t j = 0; j < rn[i]; j++)
            rd[i][j] = t[j];
    }
    dg__kda_gate_fwd_f64(&x->d, x->gate, x->lb, 0, gx, x->gate == DG_GATE_KDA ? x->A_log : NULL,
                         x->dt_bias, g);
    int rc = dg__kda_recurrent_fwd_f64(&x->d, x->scale, q, k, v, g, beta, NULL, oref, NULL) ? 2 : 0;
    if (!rc && orec32) {
        float *fq = to_f32(q, nk), *fk = to_f32(k, nk), *fv = to_f32(v, nv), *fg = to_f32(g, nk),
              *fb = to_f32(beta, x->T);
        if (dg__kda_recurrent_fwd_f32(&x->d, (float)x->scale, fq, fk, fv, fg, fb, NULL, orec32,
                                      NULL))
            rc = 2;
        float *fr[] = {fq, fk, fv, fg, fb};
        for (int i = 0; i < 5; i++)
            free(fr[i]);
    }
    double *fr[] = {q, k, v, beta, gx, g};
    for (int i = 0; i < 6; i++)
        free(fr[i]);
    free(t);
    return rc;
}

static int error_plots(const ex_opts *o, const char *term) {
    enum { NB = 6, NS = 7, T = 256, KD = 16 };
    static const int chunks[NB] = {4, 8, 16, 32, 64, 128};
    static const double str[NS] = {0.05, 0.1, 0.25, 0.5, 1, 2, 4};
    double e32[NB][NS], e16[NB][NS], er32[NB][NS];
    printf("  chunked vs recurrent, T=%d K=V=%d, gate %s: max |o - o_ref| / max |o_ref|\n", T, KD,
           o->gate == DG_GATE_KDA ? "kda" : "lowerbound");
    printf("  %6s %8s %10s %10s %10s\n", "chunk", "strength", "f32", "bf16", "f32 rec");
    for (int bi = 0; bi < NB; bi++)
        for (int si = 0; si < NS; si++) {
            ex_opts oo = *o;
            oo.strength = str[si];
            kx x;
            kx_init(&x, &oo, T, chunks[bi], KD, KD);
            const int64_t nv = (int64_t)T * KD;
            double *ref = ex_zeros(nv);
            float *o32 = to_f32(NULL, nv), *r32 = to_f32(NULL, nv);
            int rc = reference(&x, 0, ref, r32);
            if (!rc)
                rc = chunked_f32(&x, 0, o32);
            if (!rc) {
                e32[bi][si] = err_of(o32, ref, nv);
                er32[bi][si] = err_of(r32, ref, nv);
                rc = reference(&x, 1, ref, NULL);
            }
            if (!rc)
                rc = chunked_f32(&x, 1, o32);
            if (!rc)
                e16[bi][si] = err_of(o32, ref, nv);
            free(ref);
            free(o32);
            free(r32);
            kx_free(&x);
            if (rc)
                return rc;
            printf("  %6d %8g %10.2e %10.2e %10.2e\n", chunks[bi], str[si], e32[bi][si],
                   e16[bi][si], er32[bi][si]);
        }
    /* by chunk size: one block per strength; by strength: one block per chunk size */
    FILE *f = open_in_dir("error_chunk.dat");
    if (!f)
        return 2;
    fprintf(f, "# chunk f32 bf16 f32_recurrent; one block per gate strength\n");
    for (int si = 0; si < NS; si++) {
        fprintf(f, "# strength %g\n", str[si]);
        for (int bi = 0; bi < NB; bi++)
            fprintf(f, "%d %.6e %.6e %.6e\n", chunks[bi], e32[bi][si], e16[bi][si], er32[bi][si]);
        fprintf(f, "\n\n");
    }
    fclose(f);
    f = open_in_dir("error_gate.dat");
    if (!f)
        return 2;
    fprintf(f, "# strength f32 bf16 f32_recurrent; one block per chunk size\n");
    for (int bi = 0; bi < NB; bi++) {
        fprintf(f, "# chunk %d\n", chunks[bi]);
        for (int si = 0; si < NS; si++)
            fprintf(f, "%g %.6e %.6e %.6e\n", str[si], e32[bi][si], e16[bi][si], er32[bi][si]);
        fprintf(f, "\n\n");
    }
    fclose(f);
    const char *gate = o->gate == DG_GATE_KDA ? "kda" : "lowerbound";
    f = script("error_chunk", term, 1100, 480);
    if (!f)
        return 2;
    fprintf(
        f,
        "set multiplot layout 1,2 title 'chunked vs recurrent KDA, gate %s, T=%d K=V=%d'\n"
        "set logscale xy\nset xlabel 'chunk size'\nset ylabel 'max |o - o_{ref}| / max |o_{ref}|'\n"
        "set key left top font ',8'\nset format y '%%.0e'\n"
        "set title 'f32 (dashed: f32 recurrence)'\n"
        "plot for [i=0:%d] 'error_chunk.dat' index i using 1:2 with linespoints lt i+1 "
        "title sprintf('strength %%s', word('0.05 0.1 0.25 0.5 1 2 4', i+1)), "
        "for [i=0:%d] 'error_chunk.dat' index i using 1:4 with lines lt i+1 dt 2 notitle\n"
        "set title 'bf16 inputs and stored intermediates'\n"
        "plot for [i=0:%d] 'error_chunk.dat' index i using 1:3 with linespoints lt i+1 "
        "title sprintf('strength %%s', word('0.05 0.1 0.25 0.5 1 2 4', i+1))\n"
        "unset multiplot\n",
        gate, T, KD, NS - 1, NS - 1, NS - 1);
    fclose(f);
    int rc = render("error_chunk");
    if (rc)
        return rc;
    f = script("error_gate", term, 1100, 480);
    if (!f)
        return 2;
    fprintf(f,
            "set multiplot layout 1,2 title 'chunked vs recurrent KDA, gate %s, T=%d K=V=%d'\n"
            "set logscale xy\nset xlabel 'gate strength'\nset ylabel 'max |o - o_{ref}| / max "
            "|o_{ref}|'\n"
            "set key left top font ',8'\nset format y '%%.0e'\n"
            "set title 'f32'\n"
            "plot for [i=0:%d] 'error_gate.dat' index i using 1:2 with linespoints lt i+1 "
            "title sprintf('chunk %%s', word('4 8 16 32 64 128', i+1))\n"
            "set title 'bf16 inputs and stored intermediates'\n"
            "plot for [i=0:%d] 'error_gate.dat' index i using 1:3 with linespoints lt i+1 "
            "title sprintf('chunk %%s', word('4 8 16 32 64 128', i+1))\n"
            "unset multiplot\n",
            gate, T, KD, NB - 1, NB - 1);
    fclose(f);
    return render("error_gate");
}

static int state_norms(const ex_opts *o, const char *term) {
    const int T = o->T < 256 ? 256 : o->T;
    double s3[3] = {o->strength / 4, o->strength, o->strength * 4};
    if (o->gate == DG_GATE_LOWERBOUND && s3[2] > 5)
        s3[2] = 5;
    FILE *f = open_in_dir("state_norms.dat");
    if (!f)
        return 2;
    fprintf(f, "# token |h_c|_F at each chunk start (chunk %d); one block per gate strength\n",
            o->BT);
    for (int si = 0; si < 3; si++) {
        ex_opts oo = *o;
        oo.strength = s3[si];
        kx x;
        kx_init(&x, &oo, T, o->BT, o->K, o->V);
        int rc = kx_forward(&x);
        if (!rc) {
            fprintf(f, "# strength %g\n", s3[si]);
            const int64_t kv = (int64_t)o->K * o->V;
            for (int c = 0; c <= x.NC; c++) {
                const double *h = c < x.NC ? x.h + c * kv : x.ht;
                fprintf(f, "%d %.9g\n", c < x.NC ? c * o->BT : T, sqrt(ex_dot(h, h, kv)));
            }
            fprintf(f, "\n\n");
        }
        kx_free(&x);
        if (rc) {
            fclose(f);
            return rc;
        }
    }
    fclose(f);
    f = script("state_norms", term, 800, 480);
    if (!f)
        return 2;
    fprintf(f,
            "set title 'state norm at chunk starts, T=%d chunk=%d K=%d V=%d, gate %s'\n"
            "set xlabel 'token'\nset ylabel '|h|_F'\nset key right bottom\n"
            "plot for [i=0:2] 'state_norms.dat' index i using 1:2 with linespoints pt 7 ps 0.5 "
            "title sprintf('strength %%s', word('%g %g %g', i+1))\n",
            T, o->BT, o->K, o->V, o->gate == DG_GATE_KDA ? "kda" : "lowerbound", s3[0], s3[1],
            s3[2]);
    fclose(f);
    return render("state_norms");
}

int ex_plots(const ex_opts *o) {
    if (strlen(o->plots) >= sizeof g_dir - 1 || strchr(o->plots, '\'')) {
        fprintf(stderr, "deltagrad explain: --plots: directory name too long or has a quote\n");
        return 2;
    }
    snprintf(g_dir, sizeof g_dir, "%s", o->plots);
    if (mkdir(g_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "deltagrad explain: --plots: cannot create %s: %s\n", g_dir,
                strerror(errno));
        return 2;
    }
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        fprintf(stderr, "deltagrad explain: --plots needs gnuplot, which is not installed "
                        "(apt-get install gnuplot-nox)\n");
        return 3;
    }
    const char *term =
        system("gnuplot -e 'set terminal pngcairo' >/dev/null 2>&1") == 0 ? "pngcairo" : "png";
    printf("deltagrad explain --plots %s (gnuplot, terminal %s)\n", g_dir, term);

    kx x;
    kx_init(&x, o, o->T, o->BT, o->K, o->V);
    int rc = kx_forward(&x);
    const int T = x.T, BT = x.BT, K = x.K;
    double *lkk = ex_zeros((int64_t)T * T), *aqk = ex_zeros((int64_t)T * T),
           *dec = ex_zeros((int64_t)T * T), *A = ex_zeros((int64_t)BT * BT);
    for (int c = 0; c < x.NC && !rc; c++) {
        const int t0 = c * BT, L = T - t0 < BT ? T - t0 : BT;
        kx_lkk(&x, c, A);
        for (int i = 0; i < L; i++)
            for (int j = 0; j <= i; j++) {
                lkk[(int64_t)(t0 + i) * T + t0 + j] = A[i * BT + j];
                aqk[(int64_t)(t0 + i) * T + t0 + j] = x.Aqk[(int64_t)(t0 + i) * BT + j];
            }
    }
    for (int j = 0; j < T; j++) { /* dec[i][j] = mean_d exp(g_{j+1,d} + ... + g_{i,d}) */
        double *s = ex_zeros(K);
        for (int i = j; i < T; i++) {
            double m = 0;
            for (int e = 0; e < K; e++) {
                if (i > j)
                    s[e] += x.g[(int64_t)i * K + e];
                m += exp(s[e]);
            }
            dec[(int64_t)i * T + j] = m / K;
        }
        free(s);
    }
    char title[200];
    if (!rc) {
        snprintf(title, sizeof title, "Lkk (block per chunk of %d), T=%d K=%d", BT, T, K);
        rc = heatmap("lkk", title, lkk, T, term);
    }
    if (!rc) {
        snprintf(title, sizeof title, "Aqk (block per chunk of %d), T=%d K=%d", BT, T, K);
        rc = heatmap("aqk", title, aqk, T, term);
    }
    if (!rc) {
        snprintf(title, sizeof title, "gate decay mean_d exp(g_{j+1}+...+g_i), strength %g",
                 o->strength);
        rc = heatmap("decay", title, dec, T, term);
    }
    free(lkk);
    free(aqk);
    free(dec);
    free(A);
    kx_free(&x);
    if (!rc)
        rc = state_norms(o, term);
    if (!rc)
        rc = error_plots(o, term);
    return rc;
}

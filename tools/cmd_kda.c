/*
 * tools/cmd_kda.c -- `deltagrad kda`: run chunked (or recurrent) KDA on tensors stored as .npy
 * files, so users of NumPy / PyTorch can check the op on their own data.
 *
 *   DIR/{q,k,v,g,beta}.npy         required; [B,T,H,K] [B,T,H,K] [B,T,HV,V] [B,T,HV,K] [B,T,HV]
 *   DIR/h0.npy                     optional initial state [N,HV,K,V]
 *   DIR/A_log.npy, dt_bias.npy     with --gate kda|lowerbound (g is then the raw gate input)
 *   DIR/cu_seqlens.npy             optional int64 [N+1], B must be 1
 *   DIR/do.npy (+ dht.npy)         optional: also run backward
 * Writes OUT/o.npy, OUT/ht.npy and, with do.npy, dq dk dv dg dbeta dh0 (+ dA_log ddt_bias).
 * Each output keeps the dtype of the input file it belongs to unless --out-dtype says otherwise;
 * non-finite values in any output make the command fail (exit 3) unless --allow-nonfinite.
 * What every op runner does alike (flags, loading, backward, writing) is in tools/op_runner.c.
 */
#include "deltagrad.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/op_runner.h"
#include "tools/args.h"

#include <stdio.h>
#include <string.h>

/* clang-format off */
static void usage(FILE *f) {
    fprintf(f,
            "usage: deltagrad kda --in DIR --out DIR [options]\n"
            "\n"
            "Runs KDA on .npy tensors in DIR (time-major [B,T,H,K] layout, see below).\n"
            "\n"
            "  --in DIR             input folder: q k v g beta .npy (+ h0, A_log, dt_bias,\n"
            "                       cu_seqlens, do, dht)\n"
            DG_RUNNER_HELP_IO
            "  --chunk-size N       16, 32 or 64 (default 64)\n"
            "  --gate none|kda|lowerbound  how g is produced (default none: g is the log decay)\n"
            "  --lower-bound X      lower bound for --gate lowerbound, in [-5, 0) (default -5)\n"
            "  --l2norm-qk          L2-normalise q and k inside the op\n"
            "  --beta-sigmoid       beta.npy holds raw logits: beta = sigmoid(b)\n"
            "  --allow-neg-eigval   with --beta-sigmoid: beta = 2 sigmoid(b)\n"
            DG_RUNNER_HELP_RUN
            "  always            o.npy [B,T,HV,V] (dtype of q.npy), ht.npy [N,HV,K,V] (dtype of\n"
            "                    h0.npy if given, else of q.npy)\n"
            "  with do.npy       also dq dk dv dg dbeta .npy (dtype of q k v g beta .npy), and\n"
            "                    dh0.npy if h0.npy is given\n"
            "  with do.npy and --gate kda|lowerbound\n"
            "                    also dA_log.npy, and ddt_bias.npy if dt_bias.npy is given\n"
            DG_RUNNER_HELP_EXIT
            "\n"
            "Shapes: q,k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; h0 [N,HV,K,V];\n"
            "A_log [HV]; dt_bias [HV*K]; cu_seqlens [N+1] of int64 or int32 (a float array is\n"
            "refused) with B = 1.\n");
}
/* clang-format on */

/* KDA's own flags: the gate, beta and q/k options (the common ones are dg_runner_parse's). */
static const dg_cli_flag k_flags[] = {
    {"--gate", "none, kda or lowerbound"},
    {"--lower-bound", "a number in [-5, 0)"},
    {"--l2norm-qk", NULL},
    {"--beta-sigmoid", NULL},
    {"--allow-neg-eigval", NULL},
};

static int own_flag(dg_runner *r, const char *f, const char *v, void *user) {
    dg_kda_opts *o = user;
    if (!strcmp(f, "--gate")) {
        if (dg_arg_gate(v, &o->gate))
            return dg_runner_bad(r, f, "must be none, kda or lowerbound");
    } else if (!strcmp(f, "--lower-bound")) {
        if (dg_arg_f64(f, v, -5.0, 0.0, DG_ARG_HI_OPEN, &o->lower_bound) != DG_OK)
            return dg_runner_bad_arg(r);
    } else if (!strcmp(f, "--l2norm-qk")) {
        o->l2norm_qk = 1;
    } else if (!strcmp(f, "--beta-sigmoid")) {
        o->beta_sigmoid = 1;
    } else { /* --allow-neg-eigval */
        o->allow_neg_eigval = 1;
    }
    return 0;
}

enum { Q, K, V, G, BETA, H0, ALOG, DTB, CU, DO, DHT, NIN };

static dg_status run_op(dg_runner *r, const int64_t *cu, int n_seqs, void *user) {
    dg_kda_opts *o = user;
    DG_RUNNER_SET_OPTS(o, r, cu, n_seqs);
    return (r->recurrent ? dg_kda_recurrent : dg_kda_chunk)(r->ctx, r->t[Q], r->t[K], r->t[V],
                                                            r->t[G], r->t[BETA], r->t[ALOG],
                                                            r->t[DTB], r->t[H0], o, &r->o, &r->ht);
}

/* The command; check_only: parse and validate the flags only. */
static int cmd(int argc, char **argv, int check_only) {
    dg_runner r;
    dg_kda_opts o;
    memset(&o, 0, sizeof o);
    int rc = dg_runner_parse_cmd(&r, "kda", usage, check_only, argc, argv, k_flags,
                                 DG_CLI_N(k_flags), own_flag, &o);
    if (rc || check_only)
        return rc == 1 ? 0 : rc;
    /* State and gate parameters: the compute dtype on the CPU, f32 on CUDA (kda.md §11.1). */
    const dg_dtype dt = r.dt, aux = dg_runner_state_dtype(&r);
    const int gate = o.gate != DG_GATE_NONE;
    dg_runner_in in[NIN] = {
        [G] = {"g", DG_RUNNER_REQUIRED, NULL, dt, "dg"},
        [BETA] = {"beta", DG_RUNNER_REQUIRED, NULL, dt, "dbeta"},
        [ALOG] = {"A_log", gate ? DG_RUNNER_REQUIRED : DG_RUNNER_SKIP, "needed by --gate", aux,
                  "dA_log"},
        [DTB] = {"dt_bias", gate ? DG_RUNNER_OPTIONAL : DG_RUNNER_SKIP, NULL, aux, "ddt_bias"},
    };
    dg_runner_in_common(in, (const int[DG_RUNNER_NCOMMON]){Q, K, V, H0, CU, DO, DHT}, dt, aux);
    return dg_runner_run(&r, in, NIN, Q, H0, CU, run_op, &o);
}

int dg_cmd_kda(int argc, char **argv) { return cmd(argc, argv, 0); }

int dg_cmd_kda_check(int argc, char **argv) { return cmd(argc, argv, 1); }

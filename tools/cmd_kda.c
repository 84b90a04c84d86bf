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

static void usage(FILE *f) {
    fprintf(f,
            "usage: deltagrad kda --in DIR --out DIR [options]\n"
            "\n"
            "Runs KDA on .npy tensors in DIR (time-major [B,T,H,K] layout, see below).\n"
            "\n"
            "  --in DIR             input folder: q k v g beta .npy (+ h0, A_log, dt_bias,\n"
            "                       cu_seqlens, do, dht)\n"
            "  --out DIR            output folder (created if missing)\n"
            "  --device cpu|cuda    where to run (default cpu)\n"
            "  --dtype f64|f32|bf16 compute dtype (default f64 on cpu, f32 on cuda; bf16: cuda)\n"
            "  --out-dtype D        same | f64 | f32: dtype of the written files (default same:\n"
            "                       each output has the dtype of its input file, see below)\n"
            "  --chunk-size N       16, 32 or 64 (default 64)\n"
            "  --gate none|kda|lowerbound  how g is produced (default none: g is the log decay)\n"
            "  --lower-bound X      lower bound for --gate lowerbound, in [-5, 0) (default -5)\n"
            "  --l2norm-qk          L2-normalise q and k inside the op\n"
            "  --beta-sigmoid       beta.npy holds raw logits: beta = sigmoid(b)\n"
            "  --allow-neg-eigval   with --beta-sigmoid: beta = 2 sigmoid(b)\n"
            "  --scale S            output scale, > 0 (default K^-1/2)\n"
            "  --recurrent          run the token-by-token recurrence instead of the chunked form\n"
            "  --allow-nonfinite    write outputs holding NaN or Inf and exit 0 (default: exit 3)\n"
            "  --quiet              print nothing but errors\n"
            "\n"
            "Files written to OUT (none when an input is refused or the forward fails; o and ht\n"
            "but no gradients when only the backward fails):\n"
            "  always            o.npy [B,T,HV,V] (dtype of q.npy), ht.npy [N,HV,K,V] (dtype of\n"
            "                    h0.npy if given, else of q.npy)\n"
            "  with do.npy       also dq dk dv dg dbeta .npy (dtype of q k v g beta .npy), and\n"
            "                    dh0.npy if h0.npy is given\n"
            "  with do.npy and --gate kda|lowerbound\n"
            "                    also dA_log.npy, and ddt_bias.npy if dt_bias.npy is given\n"
            "A file is written whole or not at all (temp file + rename). When an output holds\n"
            "NaN or Inf the files are still written and the command exits 3 naming the output.\n"
            "Exit codes: 0 done, 1 an input or the op failed, 2 bad flags, 3 non-finite outputs.\n"
            "\n"
            "Shapes: q,k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; h0 [N,HV,K,V];\n"
            "A_log [HV]; dt_bias [HV*K]; cu_seqlens [N+1] of int64 or int32 (a float array is\n"
            "refused) with B = 1.\n");
}

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
        if (!strcmp(v, "none"))
            o->gate = DG_GATE_NONE;
        else if (!strcmp(v, "kda"))
            o->gate = DG_GATE_KDA;
        else if (!strcmp(v, "lowerbound"))
            o->gate = DG_GATE_LOWERBOUND;
        else
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

/* check_only: parse and validate only (dg_cmd_kda_check). */
static int parse(int argc, char **argv, int check_only, dg_runner *r, dg_kda_opts *o) {
    memset(o, 0, sizeof *o);
    int rc = dg_runner_parse_cmd(r, "kda", usage, check_only, argc, argv, k_flags,
                                 DG_CLI_N(k_flags), own_flag, o);
    o->chunk_size = r->chunk_size;
    o->scale = r->scale;
    o->output_final_state = 1;
    return rc;
}

enum { Q, K, V, G, BETA, H0, ALOG, DTB, CU, DO, DHT, NIN };

static dg_status run_op(dg_runner *r, const int64_t *cu, int n_seqs, void *user) {
    dg_kda_opts *o = user;
    o->cu_seqlens = cu;
    o->n_seqs = n_seqs;
    return (r->recurrent ? dg_kda_recurrent : dg_kda_chunk)(r->ctx, r->t[Q], r->t[K], r->t[V],
                                                            r->t[G], r->t[BETA], r->t[ALOG],
                                                            r->t[DTB], r->t[H0], o, &r->o, &r->ht);
}

int dg_cmd_kda(int argc, char **argv) {
    dg_runner r;
    dg_kda_opts o;
    int rc = parse(argc, argv, 0, &r, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    /* State and gate parameters: the compute dtype on the CPU, f32 on CUDA (kda.md §11.1). */
    const dg_dtype dt = r.dt, aux = dg_runner_state_dtype(&r);
    const int gate = o.gate != DG_GATE_NONE;
    const dg_runner_in in[NIN] = {
        [Q] = {"q", DG_RUNNER_REQUIRED, NULL, dt, "dq"},
        [K] = {"k", DG_RUNNER_REQUIRED, NULL, dt, "dk"},
        [V] = {"v", DG_RUNNER_REQUIRED, NULL, dt, "dv"},
        [G] = {"g", DG_RUNNER_REQUIRED, NULL, dt, "dg"},
        [BETA] = {"beta", DG_RUNNER_REQUIRED, NULL, dt, "dbeta"},
        [H0] = {"h0", DG_RUNNER_OPTIONAL, NULL, aux, "dh0"},
        [ALOG] = {"A_log", gate ? DG_RUNNER_REQUIRED : DG_RUNNER_SKIP, "needed by --gate", aux,
                  "dA_log"},
        [DTB] = {"dt_bias", gate ? DG_RUNNER_OPTIONAL : DG_RUNNER_SKIP, NULL, aux, "ddt_bias"},
        [CU] = {"cu_seqlens", DG_RUNNER_OPTIONAL, NULL, DG_I64, NULL},
        [DO] = {"do", DG_RUNNER_OPTIONAL, NULL, dt, NULL},
        [DHT] = {"dht", DG_RUNNER_OPTIONAL, NULL, aux, NULL},
    };
    return dg_runner_run(&r, in, NIN, Q, H0, CU, run_op, &o);
}

int dg_cmd_kda_check(int argc, char **argv) {
    dg_runner r;
    dg_kda_opts o;
    int rc = parse(argc, argv, 1, &r, &o);
    return rc == 1 ? 0 : rc;
}

/*
 * tools/cmd_dplr.c -- `deltagrad dplr`: run chunked (or recurrent) DPLR on tensors stored as .npy
 * files, the counterpart of `deltagrad kda` (same flags where they apply, same files and exit
 * codes; what they share is in tools/op_runner.c).
 *
 *   DIR/{q,k,v,a,b,gk}.npy         required; [B,T,H,K] except v [B,T,H,V]
 *   DIR/h0.npy                     optional initial state [N,H,K,V]
 *   DIR/cu_seqlens.npy             optional int64 [N+1], B must be 1
 *   DIR/do.npy (+ dht.npy)         optional: also run backward
 * Writes OUT/o.npy, OUT/ht.npy and, with do.npy, dq dk dv da db dgk (+ dh0 with h0.npy).
 */
#include "deltagrad.h"
#include "tools/commands.h"
#include "tools/op_runner.h"

#include <stdio.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: deltagrad dplr --in DIR --out DIR [options]\n"
            "\n"
            "Runs DPLR on .npy tensors in DIR (time-major [B,T,H,K] layout, see below), per head\n"
            "with state S [K,V]:\n"
            "  S_t = Diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T\n"
            "  o_t = scale S_t^T q_t\n"
            "\n"
            "  --in DIR             input folder: q k v a b gk .npy (+ h0, cu_seqlens, do, dht)\n"
            "  --out DIR            output folder (created if missing)\n"
            "  --device cpu|cuda    where to run (default cpu)\n"
            "  --dtype f64|f32|bf16 compute dtype (default f64 on cpu, f32 on cuda; bf16: cuda)\n"
            "  --out-dtype D        same | f64 | f32: dtype of the written files (default same:\n"
            "                       each output has the dtype of its input file, see below)\n"
            "  --chunk-size N       16, 32 or 64 (default 16)\n"
            "  --scale S            output scale, > 0 (default K^-1/2)\n"
            "  --recurrent          run the token-by-token recurrence instead of the chunked form\n"
            "  --allow-nonfinite    write outputs holding NaN or Inf and exit 0 (default: exit 3)\n"
            "  --quiet              print nothing but errors\n"
            "\n"
            "Files written to OUT (none when an input is refused or the forward fails; o and ht\n"
            "but no gradients when only the backward fails):\n"
            "  always            o.npy [B,T,H,V] (dtype of q.npy), ht.npy [N,H,K,V] (dtype of\n"
            "                    h0.npy if given, else of q.npy)\n"
            "  with do.npy       also dq dk dv da db dgk .npy (dtype of q k v a b gk .npy), and\n"
            "                    dh0.npy if h0.npy is given\n"
            "A file is written whole or not at all (temp file + rename). When an output holds\n"
            "NaN or Inf the files are still written and the command exits 3 naming the output.\n"
            "Exit codes: 0 done, 1 an input or the op failed, 2 bad flags, 3 non-finite outputs.\n"
            "\n"
            "Shapes: q,k,a,b,gk [B,T,H,K]; v [B,T,H,V]; h0 [N,H,K,V]; do [B,T,H,V]; dht\n"
            "[N,H,K,V]; cu_seqlens [N+1] of int64 or int32 (a float array is refused) with B = 1;\n"
            "without it N = B. gk is the log decay (<= 0). Keeping the eigenvalues of\n"
            "Diag(exp(gk_t)) + b_t a_t^T within [-1, 1] is up to the inputs, e.g. RWKV-7's\n"
            "a = -kh, b = alpha kh with kh of unit norm and alpha in (0, 1).\n");
}

/* DPLR has no flags of its own: the common ones (dg_runner_parse) are all it takes.
 * check_only: parse and validate only (dg_cmd_dplr_check). */
static int parse(int argc, char **argv, int check_only, dg_runner *r, dg_dplr_opts *o) {
    memset(o, 0, sizeof *o);
    int rc = dg_runner_parse_cmd(r, "dplr", usage, check_only, argc, argv, NULL, 0, NULL, NULL);
    o->chunk_size = r->chunk_size;
    o->scale = r->scale;
    o->output_final_state = 1;
    return rc;
}

enum { Q, K, V, A, B, GK, H0, CU, DO, DHT, NIN };

static dg_status run_op(dg_runner *r, const int64_t *cu, int n_seqs, void *user) {
    dg_dplr_opts *o = user;
    o->cu_seqlens = cu;
    o->n_seqs = n_seqs;
    return (r->recurrent ? dg_dplr_recurrent : dg_dplr_chunk)(
        r->ctx, r->t[Q], r->t[K], r->t[V], r->t[A], r->t[B], r->t[GK], r->t[H0], o, &r->o, &r->ht);
}

int dg_cmd_dplr(int argc, char **argv) {
    dg_runner r;
    dg_dplr_opts o;
    int rc = parse(argc, argv, 0, &r, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    /* the state: the compute dtype on the CPU, f32 on CUDA (dplr.md D1) */
    const dg_dtype dt = r.dt, st = dg_runner_state_dtype(&r);
    const dg_runner_in in[NIN] = {
        [Q] = {"q", DG_RUNNER_REQUIRED, NULL, dt, "dq"},
        [K] = {"k", DG_RUNNER_REQUIRED, NULL, dt, "dk"},
        [V] = {"v", DG_RUNNER_REQUIRED, NULL, dt, "dv"},
        [A] = {"a", DG_RUNNER_REQUIRED, NULL, dt, "da"},
        [B] = {"b", DG_RUNNER_REQUIRED, NULL, dt, "db"},
        [GK] = {"gk", DG_RUNNER_REQUIRED, NULL, dt, "dgk"},
        [H0] = {"h0", DG_RUNNER_OPTIONAL, NULL, st, "dh0"},
        [CU] = {"cu_seqlens", DG_RUNNER_OPTIONAL, NULL, DG_I64, NULL},
        [DO] = {"do", DG_RUNNER_OPTIONAL, NULL, dt, NULL},
        [DHT] = {"dht", DG_RUNNER_OPTIONAL, NULL, st, NULL},
    };
    return dg_runner_run(&r, in, NIN, Q, H0, CU, run_op, &o);
}

int dg_cmd_dplr_check(int argc, char **argv) {
    dg_runner r;
    dg_dplr_opts o;
    int rc = parse(argc, argv, 1, &r, &o);
    return rc == 1 ? 0 : rc;
}

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
#include <stdlib.h>
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

/* Set by dg_cmd_dplr_check: parse and validate only. */
static int g_check_only;

/* DPLR has no flags of its own: the common ones (dg_runner_parse) are all it takes. */
static int parse(int argc, char **argv, dg_runner *r, dg_dplr_opts *o) {
    dg_runner_init(r, "dplr", usage);
    r->check_only = g_check_only;
    memset(o, 0, sizeof *o);
    int rc = dg_runner_parse(r, argc, argv, NULL, 0, NULL, NULL);
    if (rc)
        return rc;
    rc = dg_runner_args_done(r);
    o->chunk_size = r->chunk_size;
    o->scale = r->scale;
    o->output_final_state = 1;
    return rc;
}

int dg_cmd_dplr(int argc, char **argv) {
    dg_runner r;
    dg_dplr_opts o;
    int rc = parse(argc, argv, &r, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    /* the state: the compute dtype on the CPU, f32 on CUDA (dplr.md D1) */
    const dg_dtype dt = r.dt, st = dg_runner_state_dtype(&r);
    enum { Q, K, V, A, B, GK, H0, CU, DO, DHT, NIN };
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
    int64_t *cu = NULL;
    rc = dg_runner_start(&r, in, NIN);
    if (!rc)
        rc = dg_runner_seqlens(&r, r.t[CU], r.t[Q], &cu, &o.n_seqs);
    o.cu_seqlens = cu;
    if (!rc) {
        const char *op = r.recurrent ? "dg_dplr_recurrent" : "dg_dplr_chunk";
        dg_status s = (r.recurrent ? dg_dplr_recurrent : dg_dplr_chunk)(
            r.ctx, r.t[Q], r.t[K], r.t[V], r.t[A], r.t[B], r.t[GK], r.t[H0], &o, &r.o, &r.ht);
        rc = s == DG_OK ? 0 : dg_runner_op_fail(&r, op, s);
    }
    if (!rc)
        rc = dg_runner_finish(&r, r.file_dt[Q], r.t[H0] ? r.file_dt[H0] : r.file_dt[Q]);
    free(cu);
    dg_runner_free(&r);
    return rc;
}

int dg_cmd_dplr_check(int argc, char **argv) {
    dg_runner r;
    dg_dplr_opts o;
    g_check_only = 1;
    int rc = parse(argc, argv, &r, &o);
    g_check_only = 0;
    return rc == 1 ? 0 : rc;
}

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

/* clang-format off */
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
            DG_RUNNER_HELP_IO
            "  --chunk-size N       16, 32 or 64 (default 64)\n"
            DG_RUNNER_HELP_RUN
            "  always            o.npy [B,T,H,V] (dtype of q.npy), ht.npy [N,H,K,V] (dtype of\n"
            "                    h0.npy if given, else of q.npy)\n"
            "  with do.npy       also dq dk dv da db dgk .npy (dtype of q k v a b gk .npy), and\n"
            "                    dh0.npy if h0.npy is given\n"
            DG_RUNNER_HELP_EXIT
            "\n"
            "Shapes: q,k,a,b,gk [B,T,H,K]; v [B,T,H,V]; h0 [N,H,K,V]; do [B,T,H,V]; dht\n"
            "[N,H,K,V]; cu_seqlens [N+1] of int64 or int32 (a float array is refused) with B = 1;\n"
            "without it N = B. gk is the log decay (<= 0). Keeping the eigenvalues of\n"
            "Diag(exp(gk_t)) + b_t a_t^T within [-1, 1] is up to the inputs, e.g. RWKV-7's\n"
            "a = -kh, b = alpha kh with kh of unit norm and alpha in (0, 1).\n");
}
/* clang-format on */

enum { Q, K, V, A, B, GK, H0, CU, DO, DHT, NIN };

static dg_status run_op(dg_runner *r, const int64_t *cu, int n_seqs, void *user) {
    dg_dplr_opts *o = user;
    DG_RUNNER_SET_OPTS(o, r, cu, n_seqs);
    return (r->recurrent ? dg_dplr_recurrent : dg_dplr_chunk)(
        r->ctx, r->t[Q], r->t[K], r->t[V], r->t[A], r->t[B], r->t[GK], r->t[H0], o, &r->o, &r->ht);
}

/* The command; check_only: parse and validate the flags only. DPLR has no flags of its own: the
 * common ones (dg_runner_parse) are all it takes. */
static int cmd(int argc, char **argv, int check_only) {
    dg_runner r;
    dg_dplr_opts o;
    memset(&o, 0, sizeof o);
    int rc = dg_runner_parse_cmd(&r, "dplr", usage, check_only, argc, argv, NULL, 0, NULL, NULL);
    if (rc || check_only)
        return rc == 1 ? 0 : rc;
    /* the state: the compute dtype on the CPU, f32 on CUDA (dplr.md D1) */
    const dg_dtype dt = r.dt, st = dg_runner_state_dtype(&r);
    dg_runner_in in[NIN] = {
        [A] = {"a", DG_RUNNER_REQUIRED, NULL, dt, "da"},
        [B] = {"b", DG_RUNNER_REQUIRED, NULL, dt, "db"},
        [GK] = {"gk", DG_RUNNER_REQUIRED, NULL, dt, "dgk"},
    };
    dg_runner_in_common(in, (const int[DG_RUNNER_NCOMMON]){Q, K, V, H0, CU, DO, DHT}, dt, st);
    return dg_runner_run(&r, in, NIN, Q, H0, CU, run_op, &o);
}

int dg_cmd_dplr(int argc, char **argv) { return cmd(argc, argv, 0); }

int dg_cmd_dplr_check(int argc, char **argv) { return cmd(argc, argv, 1); }

/*
 * tools/cmd_explain.c -- `deltagrad explain`: the chunked KDA algorithm, stage by stage, as the
 * tape sees it: what each node computes, its shapes, what it keeps for backward under each policy,
 * and its cost. `--stage NAME` prints one stage.
 */
#include "deltagrad.h"
#include "tools/commands.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name, *title, *text;
} stage_doc;

static const stage_doc g_stages[] = {
    {"recurrence", "The recurrence (ground truth, dg_kda_recurrent)",
     "  For each token t, per (sequence, value head), with state S [K,V] (S_-1 = h0):\n"
     "    S'  = Diag(exp(g_t)) S_{t-1}            decay every key row of the state\n"
     "    e_t = beta_t (v_t - S'^T k_t)          the delta: what the decayed state mispredicts\n"
     "    S_t = S' + k_t e_t^T                   rank-1 write\n"
     "    o_t = scale * S_t^T q_t                read-out after the write\n"
     "  One token at a time: T sequential steps of O(K V) work. The chunked form below computes\n"
     "  exactly the same o and final state with matrix products over chunks of BT tokens.\n"},
    {"l2norm", "N1 kda_l2norm: q, k -> unit rows (optional)",
     "  y = x / sqrt(sum x^2 + 1e-6)                         q, k [B,T,H,K]\n"
     "  keeps y and 1/norm; backward dx = r (dy - (dy.y) y).\n"
     "  Unit keys with beta in (0,1) make (I - beta k k^T) a contraction: the state stays bounded.\n"},
    {"beta", "N2 kda_beta: beta = c * sigmoid(b) (optional)",
     "  c = 1, or 2 with allow_neg_eigval (eigenvalues of I - beta k k^T then in (-1, 1)).\n"},
    {"gate_cumsum", "N3 kda_gate_cumsum: gate, then chunk-local cumulative sum",
     "  g = -exp(A_log) softplus(x + dt_bias)          (gate kda)\n"
     "  g = lb * sigmoid(exp(A_log) (x + dt_bias))     (gate lowerbound, lb in [-5, 0))\n"
     "  G_i = sum_{r<=i} g_r inside each chunk (restarts every BT tokens)     [B,T,HV,K] f32\n"
     "  G is non-increasing in a chunk, so exp(G_i - G_j) <= 1 for j <= i: only such differences\n"
     "  are ever exponentiated. Backward: reverse cumsum, then the gate's derivative.\n"},
    {"intra", "N4 kda_intra: the intra-chunk matrices and the triangular solve",
     "  Aqk[i,j] = scale * sum_d q_id k_jd exp(G_id - G_jd)     j <= i      [B,T,HV,BT]\n"
     "  Lkk[i,j] = beta_i * sum_d k_id k_jd exp(G_id - G_jd)    j <  i\n"
     "  Tm = (I + Lkk)^{-1}   unit lower triangular, by forward substitution  [B,T,HV,BT]\n"
     "  Aqk and Tm are always kept (they are what the backward needs most, and are small).\n"
     "  Backward: dLkk = -stril(Tm^T dTm Tm^T), then the pair sums give dq, dk, dbeta, dG.\n"},
    {"wy", "N5 kda_wy: the WY (UT) representation",
     "  W  = Tm (beta * k * exp(G))         U = Tm (beta * v)\n"
     "  KG = k * exp(G_last - G)            QG = q * exp(G)                  [B,T,HV,K|V]\n"
     "  RECOMPUTE (default): keeps nothing extra, rebuilt from Tm in backward (one cheap pass).\n"
     "  CACHE: keeps W, U, KG, QG (3K + V values per token per head).\n"},
    {"state", "N6 kda_state: the inter-chunk state pass (the only sequential stage)",
     "  for each chunk c in order:   h_c = state at the chunk start        h [B,NT,HV,K,V]\n"
     "      E_c     = U_c - W_c h_c                  (= the per-token deltas e_t, 'v_new')\n"
     "      h_{c+1} = Diag(exp(G_last)) h_c + KG_c^T E_c\n"
     "  final state = h_NT.  RECOMPUTE (default) reruns this pass in backward from h0;\n"
     "  CACHE keeps h and E. The backward pass runs the same loop in reverse for dh.\n"},
    {"output", "N7 kda_output: inter-chunk term + intra-chunk term",
     "  O_c = scale * QG_c h_c  +  Aqk_c E_c          [B,T,HV,V]\n"
     "  Backward: dQG = s dO h^T, dh = s QG^T dO, dAqk = tril(dO E^T), dE = Aqk^T dO.\n"
     "  Its backward runs first: what N5/N6 did not keep (W, U, KG, QG, h, E) it rebuilds once,\n"
     "  for itself and N6; each rebuilt tensor is freed when its last reader's backward ends.\n"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: deltagrad explain [--stage NAME]\n\n"
               "Prints the chunked KDA algorithm as deltagrad runs it, one tape node per stage.\n"
               "Stages:");
    for (size_t i = 0; i < sizeof g_stages / sizeof *g_stages; i++)
        fprintf(f, " %s", g_stages[i].name);
    fprintf(f, "\n");
}

int dg_cmd_explain(int argc, char **argv) {
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--stage") && i + 1 < argc) {
            only = argv[++i];
        } else {
            fprintf(stderr, "deltagrad explain: unknown option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    int shown = 0;
    if (!only)
        printf("Chunked Kimi Delta Attention in deltagrad (per sequence and value head; letters:\n"
               "B batch, T tokens, H q/k heads, HV value heads, K key dim, V value dim, BT chunk)\n"
               "\n");
    for (size_t i = 0; i < sizeof g_stages / sizeof *g_stages; i++) {
        if (only && strcmp(only, g_stages[i].name))
            continue;
        printf("%s\n%s\n", g_stages[i].title, g_stages[i].text);
        shown++;
    }
    if (!shown) {
        fprintf(stderr, "deltagrad explain: no stage named '%s'\n", only);
        usage(stderr);
        return 2;
    }
    if (!only)
        printf("Policies: dg_policy_set(\"kda_state\", DG_POLICY_CACHE) per stage, or\n"
               "dg_policy_set_global(...) for all; dg_tape_bytes() shows what the tape holds.\n"
               "Every stage has a CPU reference (f64/f32) and a CUDA kernel, and a test that the\n"
               "chained stages equal the recurrence (tests/test_kda_chunk.c).\n");
    return 0;
}

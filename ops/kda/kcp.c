/*
 * ops/kda/kcp.c -- dg_kda_chunk_cp: chunked KDA over a context-parallel split (KCP;
 * docs/distributed.md K3-K4, generalised to uneven splits, an initial state and the final state).
 *
 * The state pass is affine in its initial state: over one piece of a sequence,
 *     h_out = M h_in + h_ext,      M = prod_c (Diag(exp lambda_c) - KG_c^T W_c)   (last chunk left)
 * and its backward is the transpose, dh_in = M^T dh_out + dh_ext. Each rank summarises one piece
 * per value head as [h_ext | M] ([HV, K, V+K], the compute dtype), all ranks exchange summaries
 * with one all_gather, and each rank chains the summaries of the earlier ranks into the true
 * initial state of its local sequence 0. Backward does the same in reverse with [dh_ext | M^T] of
 * the first local sequence, giving the gradient of the state that leaves the last local sequence.
 * The exchange, the merges, the init and link nodes are shared with DPLR (ops/kcp/: the order of
 * the nodes on the tape is described in kcp_nodes.c); this file holds what is KDA's own:
 *   N1..N5 as dg_kda_chunk          (local, no communication)
 *   forward summary of the last local sequence: X = KG, Y = W, s = -1, term + KG^T U
 *   exchange + merge                -> h0m        ("kda_cp_init")
 *   N6 state (h0 = h0m, ht always)  -> h, E, ht_loc
 *   "kda_cp_link"                   -> h', E', ht; its backward's reverse summary of the first
 *                                      local sequence: X = W, Y = KG, s = -1, term - W^T dE,
 *                                      plus N7's dh per chunk
 *   N7 output (h', E')              -> o
 * CUDA: the stages run on the device as in dg_kda_chunk. On the tensor-core path (bf16 inputs,
 * K % 16 == 0) each summary is two state passes on the device (summary_dev,
 * dg__kda_state_summary_cuda) and only the small [HV, K, V+K] result comes to the host; otherwise
 * W, U, KG, G and the upstream gradients are copied down and summarised by the shared reference
 * (correct but slow). The CPU path runs the same code without copies.
 */
#include "../kcp/kcp.h"

#define OP "dg_kda_chunk_cp"

/* The summary of local sequence `seq` computed on the device (CUDA, tensor-core path: see
 * dg__kda_state_summary_cuda) into the host tensor dst [HV, K, V+K] ([Sh | SM] per value head).
 * A1, X0, A2, G, Sup, S0 are device tensors or pointers (S0, X0, Sup may be NULL). Returns
 * DG_ERR_UNSUPPORTED when the sizes need the host path. */
static dg_status summary_dev(dg_ctx *ctx, dg_ctx *hc, const kda_cfg *c, int seq, int bwd,
                             const dg_tensor *A1, const dg_tensor *X0, const dg_tensor *A2,
                             const dg_tensor *G, const dg_tensor *Sup, const void *S0,
                             dg_tensor *dst) {
#ifdef DG_HAVE_CUDA
    if (!c->cuda || !dg__kda_state_summary_fits(&c->cd))
        return DG_ERR_UNSUPPORTED;
    const int HV = c->d.HV, K = c->d.K, V = c->d.V;
    const int64_t sh[3] = {HV, K, V}, smm[3] = {HV, K, K};
    /* converted copies (NULL where the tensor already has the dtype the kernel reads): A1, A2,
     * the forward's X0 (W, KG, U) and Sup (dh) in the intermediates' storage dtype, the rest
     * f32 */
    dg_tensor *tA1 = NULL, *tX0 = NULL, *tA2 = NULL, *tG = NULL, *tSup = NULL;
    dg_tensor *dh = NULL, *dm = NULL;
    const void *pA1 = NULL, *pX0 = NULL, *pA2 = NULL, *pG = NULL, *pSup = NULL;
    dg_status st = DG_OK;
    if (A1)
        st = dg__kda_ptr(ctx, A1, c->mid, &tA1, &pA1);
    if (st == DG_OK && X0)
        st = dg__kda_ptr(ctx, X0, bwd ? DG_F32 : c->mid, &tX0, &pX0);
    if (st == DG_OK && A2)
        st = dg__kda_ptr(ctx, A2, c->mid, &tA2, &pA2);
    if (st == DG_OK && G)
        st = dg__kda_ptr(ctx, G, DG_F32, &tG, &pG);
    if (st == DG_OK && Sup)
        st = dg__kda_ptr(ctx, Sup, c->mid, &tSup, &pSup);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 3, sh, &dh);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 3, smm, &dm);
    if (st == DG_OK && !bwd)
        dg__profile_forward(ctx, "kda_cp_summary_prep");
    if (st == DG_OK)
        st = dg__kda_state_summary_cuda(ctx, &c->cd, seq, bwd, pA1, pX0, pA2, pG, pSup, S0,
                                        dg_tensor_data(dh), dg_tensor_data(dm));
    if (st == DG_OK && !bwd)
        dg__profile_forward(ctx, "kda_cp_summary_kernels");
    if (st == DG_OK)
        st = dg__kcp_summary_from_dev(hc, c, dh, dm, dst);
    dg_tensor *all[7] = {tA1, tX0, tA2, tG, tSup, dh, dm};
    for (int i = 0; i < 7; i++)
        dg_tensor_free(&all[i]);
    return st;
#else
    (void)ctx, (void)hc, (void)c, (void)seq, (void)bwd, (void)A1, (void)X0, (void)A2, (void)G;
    (void)Sup, (void)S0, (void)dst;
    return DG_ERR_UNSUPPORTED;
#endif
}

/* kcp_ops.bwd_summary: the reverse summary of local sequence 0 from N7's dh (gh) and dE (gE). */
static dg_status bwd_summary(dg_ctx *ctx, dg_ctx *hc, dg_node *n, const dg_tensor *gh,
                             const dg_tensor *gE, const dg_tensor *ght, const dg_tensor *ght_h,
                             dg_tensor *dhm) {
    const kcp_np *np = (const kcp_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const int HV = c->d.HV, K = c->d.K, V = c->d.V;
    dg_tensor *W = NULL, *KG = NULL;
    dg_status st = dg__group_get(np->grp, ctx, KDA_M_LINK, KDA_W, &W);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, KDA_M_LINK, KDA_KG, &KG);
    int on_dev = 0; /* on the device when the sizes allow (dg__kda_state_summary_cuda) */
    if (st == DG_OK && c->cuda) {
        const void *dhout = NULL; /* local sequence 0 ends here: its ht row's gradient */
        dg_tensor *gt = NULL;
        if (dg__kcp_ends_here(np, 0) && ght)
            st = dg__kda_ptr(ctx, ght, DG_F32, &gt, &dhout);
        if (st == DG_OK && dhout)
            dhout = (const char *)dhout + (size_t)np->seq0 * HV * K * V * sizeof(float);
        if (st == DG_OK) {
            st = summary_dev(ctx, hc, c, 0, 1, KG, gE, W, n->saved[0], gh, dhout, dhm);
            on_dev = st == DG_OK;
            if (st == DG_ERR_UNSUPPORTED)
                st = DG_OK;
        }
        dg_tensor_free(&gt);
    }
    if (st == DG_OK && !on_dev) { /* on host copies: X = W, Y = KG, term - W^T dE */
        const kcp_summary_args sa = {
            .seq = 0,
            .reverse = 1,
            .X = W,
            .Y = KG,
            .G = n->saved[0],
            .neg_xy = 1,
            .nterm = 1,
            .A = {W},
            .B = {gE},
            .neg = {1},
            .dh = gh,
            .S0 = dg__kcp_ends_here(np, 0) ? dg__kcp_row(c, ght_h, np->seq0) : NULL,
        };
        st = dg__kcp_summary_host(hc, c, &sa, dhm);
    }
    return st;
}

static const kcp_ops kda_kcp_ops = {
    .op = OP,
    .init_kind = "kda_cp_init",
    .link_kind = "kda_cp_link",
    .prof_all_gather = "kda_cp_all_gather",
    .prof_merge = "kda_cp_merge",
    .link_member = KDA_M_LINK,
    .bwd_summary = bwd_summary,
};

dg_status dg_kda_chunk_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *q,
                          dg_tensor *k, dg_tensor *v, dg_tensor *g, dg_tensor *beta,
                          dg_tensor *A_log, dg_tensor *dt_bias, dg_tensor *h0,
                          const dg_kda_opts *opts, dg_tensor **o, dg_tensor **ht) {
    DG_TRY(dg__kcp_check_entry(OP, ctx, comm, plan, q, opts && opts->output_final_state,
                               opts ? opts->cu_seqlens : NULL, o, ht));
    dg_kda_opts lo;
    memset(&lo, 0, sizeof lo);
    if (opts)
        lo = *opts;
    lo.cu_seqlens = plan->cu_local;
    lo.n_seqs = plan->n_local;
    lo.output_final_state = 0;
    kda_cfg cfg;
    DG_TRY(dg__kda_check_inputs(OP, ctx, q, k, v, g, beta, A_log, dt_bias, NULL, &lo, &cfg));
    const int want_ht = opts && opts->output_final_state;
    const int HV = cfg.d.HV, K = cfg.d.K, V = cfg.d.V, NL = cfg.d.N;
    dg_status st = dg__kcp_check_h0(OP, ctx, &cfg, plan, h0, "n_seqs,HV,K,V (global sequences)");
    if (st != DG_OK)
        return dg__kda_finish(&cfg, st, o, ht);

    dg_tensor *h = NULL, *E = NULL, *htl = NULL;
    dg__group *grp = NULL;
    kcp_fwd f;
    memset(&f, 0, sizeof f);

    kda_local l;
    st = dg__kda_local_stages(ctx, q, k, v, g, beta, A_log, dt_bias, &lo, cfg.dev, &l);

    /* forward summary of the last local sequence */
    if (st == DG_OK)
        st = dg__kcp_fwd_begin(ctx, comm, plan, &cfg, &kda_kcp_ops, h0, &f);
    if (st == DG_OK && dg__kcp_fwd_summarise(&f)) {
        int on_dev = 0; /* on the device when the sizes allow (dg__kda_state_summary_cuda) */
        if (cfg.cuda) {
            const void *hin = NULL; /* initial state: h0 row */
            dg_tensor *ht0 = NULL;
            if (dg__kcp_starts_here(&f.probe, NL - 1) && h0)
                st = dg__kda_ptr(ctx, h0, DG_F32, &ht0, &hin);
            if (st == DG_OK && hin)
                hin =
                    (const char *)hin + (size_t)(plan->seq0 + NL - 1) * HV * K * V * sizeof(float);
            if (st == DG_OK) {
                st = summary_dev(ctx, f.hc, &cfg, NL - 1, 0, l.W, l.U, l.KG, l.G, NULL, hin, f.hm);
                on_dev = st == DG_OK;
                if (st == DG_ERR_UNSUPPORTED)
                    st = DG_OK;
            }
            dg_tensor_free(&ht0);
        }
        if (st == DG_OK && !on_dev) { /* on host copies: X = KG, Y = W, term + KG^T U */
            const kcp_summary_args sa = {
                .seq = NL - 1,
                .X = l.KG,
                .Y = l.W,
                .G = l.G,
                .neg_xy = 1,
                .nterm = 1,
                .A = {l.KG},
                .B = {l.U},
                .S0 = dg__kcp_fwd_hin(&cfg, &f),
            };
            st = dg__kcp_summary_host(f.hc, &cfg, &sa, f.hm);
        }
    }
    dg__profile_forward(ctx, "kda_cp_summary"); /* the CP phases are timed apart */
    /* all_gather, merge into h0m */
    if (st == DG_OK)
        st = dg__kcp_fwd_exchange(ctx, &f, h0);

    /* the local state pass from h0m, then the link node, then the output */
    if (st == DG_OK)
        st = dg__kda_local_group(&cfg, &l, v, f.h0m, &grp);
    if (st == DG_OK)
        st = dg__kda_state_x(ctx, l.W, l.U, l.KG, l.G, f.h0m, &lo, grp, &h, &E, &htl);
    if (st == DG_OK)
        st = dg__kcp_fwd_link(ctx, &f, grp, l.G, h, E, htl);
    if (st == DG_OK)
        st = dg__kda_output_x(ctx, l.QG, f.h2, l.Aqk, f.x2, &lo, grp, q->dtype, o);

    dg__group_release(&grp);
    dg__kda_local_free(&l);
    dg_tensor *locals[3] = {h, E, htl};
    for (int i = 0; i < 3; i++)
        dg_tensor_free(&locals[i]);
    st = dg__kcp_fwd_end(ctx, &f, st, want_ht ? ht : NULL);
    return dg__kda_finish(&cfg, st, o, ht);
}

/*
 * ops/dplr/kcp.c -- dg_dplr_chunk_cp: chunked DPLR over a context-parallel split (KCP, shared
 * distributed.md K6, the "bg" path; with KDA's generalisations: uneven splits, varlen packs across
 * ranks, an initial state and the final state).
 *
 * The DPLR state pass (state.c) is affine in its initial state. Per chunk c, with
 * v2 = w h + u:
 *     h <- Diag(exp lam_c) h + kg_c^T v_c + bg_c^T v2_c
 *        = M_c h + kg_c^T v_c + bg_c^T u_c,          M_c = Diag(exp lam_c) + bg_c^T w_c
 * and in backward, with dH the gradient of the state leaving chunk c and dv2_loc the output
 * node's gradient of v2 (Aqb^T dO), dh_c its gradient of the state at the chunk's start (qg^T dO):
 *     dv2 = dv2_loc + bg dH,     dH <- Diag(exp lam_c) dH + w^T dv2 + dh_c
 *                                    = Mt_c dH + w^T dv2_loc + dh_c,   Mt_c = M_c^T.
 * Both are the shared summary (ops/kcp/summary.c) with the low-rank part added (s = +1):
 *     forward  X = bg, Y = w, terms + kg^T v, + bg^T u        -> [h_ext | M]   last local seq
 *     backward X = w, Y = bg, term  + w^T dv2_loc, + dh_c     -> [dh_ext | M^T] first local seq
 * The exchange, merges and the init and link nodes are the shared ones (ops/kcp/kcp_nodes.c):
 *   gate_cumsum, intra, wy          (local, no communication)
 *   forward summary, exchange       -> h0m          ("dplr_cp_init")
 *   state (h0 = h0m, ht always)     -> h, v2, ht_loc
 *   "dplr_cp_link"                  -> h', v2', ht  (reads w, bg through the recompute group)
 *   output (h', v2')                -> o
 * The recompute group's h0 input is h0m, so the backward's rebuild of h starts every local
 * sequence from its true initial state (distributed.md K8).
 * CUDA: the local stages run their kernels; each summary is two serial state passes on the
 * device over the one sequence (summary_dev, dg__dplr_state_summary_cuda: from S0 with the terms,
 * then from the identity without them), and only the [H, K, V+K] result comes to the host. The
 * CPU path runs the shared reference (dg__kcp_summary_host) without copies.
 */
#include "../kcp/kcp.h"
#include "dplr.h"

#define OP "dg_dplr_chunk_cp"

/* The summary of local sequence `seq` computed on the device (CUDA: dg__dplr_state_summary_cuda)
 * into the host tensor dst [H, K, V+K]. Forward: w, u, kg, bg, v, Gi; backward: w, kg, bg, Gi
 * and the output's gradients dh, dv2. S0 is the device tensor whose row `row` is the initial
 * state (forward) or the final state's gradient (backward), NULL for zero. v is read in the
 * leaf dtype, everything else in f32. */
static dg_status summary_dev(dg_ctx *ctx, dg_ctx *hc, const kda_cfg *c, int seq, int bwd,
                             const dg_tensor *w, const dg_tensor *u, const dg_tensor *kg,
                             const dg_tensor *bg, const dg_tensor *v, const dg_tensor *Gi,
                             const dg_tensor *dh, const dg_tensor *dv2, const dg_tensor *S0,
                             int64_t row, dg_tensor *dst) {
#ifdef DG_HAVE_CUDA
    const int H = c->d.H, K = c->d.K, V = c->d.V;
    const int64_t sh[3] = {H, K, V}, smm[3] = {H, K, K};
    const int bf16 = dplr_bf16(c, v);
    const dg_tensor *in[8] = {w, u, kg, bg, v, Gi, dh, dv2};
    dg_tensor *tmp[9] = {NULL}, *Sh = NULL, *SM = NULL;
    const void *p[9] = {NULL};
    dg_status st = DG_OK;
    for (int i = 0; i < 8 && st == DG_OK; i++)
        if (in[i])
            st = dg__kda_ptr(ctx, in[i], i == 4 ? dplr_leaf_dt(c, bf16) : DG_F32, &tmp[i], &p[i]);
    if (st == DG_OK && S0)
        st = dg__kda_ptr(ctx, S0, DG_F32, &tmp[8], &p[8]);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 3, sh, &Sh);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, DG_F32, 3, smm, &SM);
    if (st == DG_OK) {
        const float *s0 = p[8] ? (const float *)p[8] + (size_t)row * H * K * V : NULL;
        st = dg__dplr_state_summary_cuda(ctx, &c->cd, seq, bwd, bf16, p[0], p[1], p[2], p[3], p[4],
                                         p[5], p[6], p[7], s0, dg_tensor_data(Sh),
                                         dg_tensor_data(SM));
    }
    if (st == DG_OK)
        st = dg__kcp_summary_from_dev(hc, c, Sh, SM, dst);
    for (int i = 0; i < 9; i++)
        dg_tensor_free(&tmp[i]);
    dg_tensor_free(&Sh);
    dg_tensor_free(&SM);
    return st;
#else
    (void)ctx, (void)hc, (void)c, (void)seq, (void)bwd, (void)w, (void)u, (void)kg, (void)bg;
    (void)v, (void)Gi, (void)dh, (void)dv2, (void)S0, (void)row, (void)dst;
    return dg__no_cuda(OP);
#endif
}

/* kcp_ops.bwd_summary: the reverse summary of local sequence 0 from the output node's dh (gh)
 * and dv2 (gv2): X = w, Y = bg (M_c^T = Diag + w^T bg), term + w^T dv2_loc, plus dh per chunk. */
static dg_status bwd_summary(dg_ctx *ctx, dg_ctx *hc, dg_node *n, const dg_tensor *gh,
                             const dg_tensor *gv2, const dg_tensor *ght, const dg_tensor *ght_h,
                             dg_tensor *dhm) {
    const kcp_np *np = (const kcp_np *)n->params;
    dg_tensor *w = NULL, *bg = NULL;
    dg_status st = dg__group_get(np->grp, ctx, DPLR_M_LINK, DPLR_W, &w);
    if (st == DG_OK)
        st = dg__group_get(np->grp, ctx, DPLR_M_LINK, DPLR_BG, &bg);
    if (st != DG_OK)
        return st;
    const int ends = dg__kcp_ends_here(np, 0); /* then S0 = its ht row's gradient */
    if (np->cfg.cuda) {
        dg_tensor *kg = NULL;
        st = dg__group_get(np->grp, ctx, DPLR_M_LINK, DPLR_KG, &kg);
        if (st != DG_OK)
            return st;
        return summary_dev(ctx, hc, &np->cfg, 0, 1, w, NULL, kg, bg, NULL, n->saved[0], gh, gv2,
                           ends ? ght : NULL, np->seq0, dhm);
    }
    const kcp_summary_args sa = {
        .seq = 0,
        .reverse = 1,
        .X = w,
        .Y = bg,
        .G = n->saved[0],
        .nterm = 1,
        .A = {w},
        .B = {gv2},
        .dh = gh,
        .S0 = ends ? dg__kcp_row(&np->cfg, ght_h, np->seq0) : NULL,
    };
    return dg__kcp_summary_host(hc, &np->cfg, &sa, dhm);
}

static const kcp_ops dplr_kcp_ops = {
    .op = OP,
    .init_kind = "dplr_cp_init",
    .link_kind = "dplr_cp_link",
    .prof_all_gather = "dplr_cp_all_gather",
    .prof_merge = "dplr_cp_merge",
    .link_member = DPLR_M_LINK,
    .bwd_summary = bwd_summary,
};

dg_status dg_dplr_chunk_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *q,
                           dg_tensor *k, dg_tensor *v, dg_tensor *a, dg_tensor *b, dg_tensor *gk,
                           dg_tensor *h0, const dg_dplr_opts *opts, dg_tensor **o, dg_tensor **ht) {
    DG_TRY(dg__kcp_check_entry(OP, ctx, comm, plan, q, opts && opts->output_final_state,
                               opts ? opts->cu_seqlens : NULL, o, ht));
    dg_dplr_opts lo;
    memset(&lo, 0, sizeof lo);
    if (opts)
        lo = *opts;
    lo.cu_seqlens = plan->cu_local;
    lo.n_seqs = plan->n_local;
    lo.output_final_state = 0;
    kda_cfg cfg;
    DG_TRY(dg__dplr_check_inputs(OP, ctx, q, k, v, a, b, gk, NULL, &lo, &cfg));
    const int want_ht = opts && opts->output_final_state;
    dg_status st = dg__kcp_check_h0(OP, ctx, &cfg, plan, h0, "n_seqs,H,K,V (global sequences)");
    if (st != DG_OK)
        return dg__kda_finish(&cfg, st, o, ht);

    dg_tensor *h = NULL, *v2 = NULL, *htl = NULL;
    dg__group *grp = NULL;
    kcp_fwd f;
    memset(&f, 0, sizeof f);

    dplr_local l;
    st = dg__dplr_local_stages(ctx, q, k, v, a, b, gk, &lo, cfg.dev, &l);

    /* forward summary of the last local sequence: X = bg, Y = w (M_c = Diag + bg^T w), terms
     * + kg^T v, + bg^T u */
    if (st == DG_OK)
        st = dg__kcp_fwd_begin(ctx, comm, plan, &cfg, &dplr_kcp_ops, h0, &f);
    if (st == DG_OK && dg__kcp_fwd_summarise(&f) && cfg.cuda) {
        const int starts = dg__kcp_starts_here(&f.probe, cfg.d.N - 1); /* then S0 = an h0 row */
        st = summary_dev(ctx, f.hc, &cfg, cfg.d.N - 1, 0, l.w, l.u, l.kg, l.bg, v, l.Gi, NULL, NULL,
                         starts ? h0 : NULL, plan->seq0 + cfg.d.N - 1, f.hm);
    } else if (st == DG_OK && dg__kcp_fwd_summarise(&f)) {
        const kcp_summary_args sa = {
            .seq = cfg.d.N - 1,
            .X = l.bg,
            .Y = l.w,
            .G = l.Gi,
            .nterm = 2,
            .A = {l.kg, l.bg},
            .B = {v, l.u},
            .S0 = dg__kcp_fwd_hin(&cfg, &f),
        };
        st = dg__kcp_summary_host(f.hc, &cfg, &sa, f.hm);
    }
    dg__profile_forward(ctx, "dplr_cp_summary"); /* the CP phases are timed apart */
    /* all_gather, merge into h0m */
    if (st == DG_OK)
        st = dg__kcp_fwd_exchange(ctx, &f, h0);

    /* the local state pass from h0m, then the link node, then the output */
    if (st == DG_OK)
        st = dg__dplr_local_group(&cfg, q, k, v, a, b, &l, f.h0m, &grp);
    if (st == DG_OK)
        st = dg__dplr_state_x(ctx, l.w, l.u, l.kg, l.bg, v, l.Gi, f.h0m, &lo, grp, &h, &v2, &htl);
    if (st == DG_OK)
        st = dg__kcp_fwd_link(ctx, &f, grp, l.Gi, h, v2, htl);
    if (st == DG_OK)
        st = dg__dplr_output_x(ctx, l.qg, f.h2, l.Aqk, l.Aqb, v, f.x2, &lo, grp, o);

    dg__group_release(&grp);
    dg__dplr_local_free(&l);
    dg_tensor *locals[3] = {h, v2, htl};
    for (int i = 0; i < 3; i++)
        dg_tensor_free(&locals[i]);
    st = dg__kcp_fwd_end(ctx, &f, st, want_ht ? ht : NULL);
    return dg__kda_finish(&cfg, st, o, ht);
}

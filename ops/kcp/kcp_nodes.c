/*
 * ops/kcp/kcp_nodes.c -- the op-independent tape side of KCP (distributed.md K3,
 * distributed.md K4): host staging, the forward exchange with its init node, and the link node
 * whose backward does the reverse exchange. The ops (ops/kda/kcp.c, ops/dplr/kcp.c) record, around
 * their own stage nodes:
 *
 *   local stages (no communication)
 *   op's summary of the last local sequence -> dg__kcp_forward_exchange -> h0m [NL,HV,K,V]
 *                                   (init node "<op>_cp_init": routes h0m's gradient into the
 *                                    rows of the caller's h0)
 *   state pass from h0m, ht always  -> h, x, htl       (x: KDA's E, DPLR's v2)
 *   dg__kcp_link: (h, x, htl) -> (h', x', ht)   forward: h', x' alias h, x; ht puts htl's rows
 *                  of the sequences that end here into their global rows. Backward (after the
 *                  output node's backward, before the state node's): the op's reverse summary of
 *                  local sequence 0 from the output's gradients, all_gather, merge into dht of the
 *                  last local sequence.
 *   output from (h', x')
 * The dh0 the state node produces for a local sequence 0 that started on an earlier rank is
 * dropped: the earlier ranks already received its content through the backward all_gather
 * (distributed.md K4). Both all_gathers send every rank's summary (the ones a rank does not need
 * are zero or unused), one collective each way, HV K (V+K) values per rank. Merges and row moves
 * run on host copies, and the MPI communicator carries host buffers, so several processes can share
 * one GPU; on the CPU the same code runs without copies.
 */
#include "kcp.h"

/* ---- host staging ---- */

dg_status dg__kcp_host_ctx(dg_ctx *ctx, dg_ctx **hc) {
    if (dg_ctx_device(ctx).kind == DG_DEV_CPU) {
        *hc = ctx;
        return DG_OK;
    }
    return dg_ctx_new(dg_cpu(), hc);
}

void dg__kcp_host_ctx_free(dg_ctx *ctx, dg_ctx **hc) {
    if (*hc && *hc != ctx)
        dg_ctx_free(hc);
    *hc = NULL;
}

dg_status dg__kcp_to_host(dg_ctx *hc, const dg_tensor *t, dg_dtype dt, dg_tensor **out) {
    *out = NULL;
    if (!t)
        return DG_OK;
    if (!dg__is_cuda(t) && t->dtype == dt && dg_tensor_is_contiguous(t)) {
        *out = dg_tensor_retain((dg_tensor *)t);
        return DG_OK;
    }
    return dg__kda_copy_new(hc, t, dt, out);
}

dg_status dg__kcp_to_dev(dg_ctx *ctx, dg_tensor *h, dg_tensor **out) {
    *out = NULL;
    if (dg_ctx_device(ctx).kind == DG_DEV_CPU) {
        *out = dg_tensor_retain(h);
        return DG_OK;
    }
    return dg__kda_copy_new(ctx, h, h->dtype, out);
}

dg_status dg__kcp_summary_host(dg_ctx *hc, const kda_cfg *cfg, const kcp_summary_args *a,
                               dg_tensor *out) {
    const dg_tensor *src[8] = {a->X, a->Y, a->G, a->A[0], a->B[0], a->A[1], a->B[1], a->dh};
    dg_tensor *hx[8] = {NULL};
    dg_status st = DG_OK;
    for (int i = 0; i < 8 && st == DG_OK; i++)
        st = dg__kcp_to_host(hc, src[i], cfg->dt, &hx[i]);
    if (st == DG_OK) {
        kcp_summary_io io;
        memset(&io, 0, sizeof io);
        io.seq = a->seq;
        io.reverse = a->reverse;
        io.X = dg__kcp_ptr(hx[0]);
        io.Y = dg__kcp_ptr(hx[1]);
        io.G = dg__kcp_ptr(hx[2]);
        io.neg_xy = a->neg_xy;
        io.nterm = a->nterm;
        for (int t = 0; t < a->nterm; t++) {
            io.term[t].A = dg__kcp_ptr(hx[3 + 2 * t]);
            io.term[t].B = dg__kcp_ptr(hx[4 + 2 * t]);
            io.term[t].neg = a->neg[t];
        }
        io.dh = dg__kcp_ptr(hx[7]);
        io.S0 = a->S0;
        io.out = dg_tensor_data(out);
        st = dg__kcp_summary(cfg->dt, &cfg->d, &io);
    }
    for (int i = 0; i < 8; i++)
        dg_tensor_free(&hx[i]);
    return st;
}

dg_status dg__kcp_summary_from_dev(dg_ctx *hc, const kda_cfg *cfg, const dg_tensor *Sh,
                                   const dg_tensor *SM, dg_tensor *out) {
    const int64_t rows = (int64_t)cfg->d.HV * cfg->d.K;
    const size_t es = dg_dtype_size(cfg->dt), V = (size_t)cfg->d.V, K = (size_t)cfg->d.K;
    dg_tensor *a = NULL, *b = NULL;
    dg_status st = dg__kcp_to_host(hc, Sh, cfg->dt, &a);
    if (st == DG_OK)
        st = dg__kcp_to_host(hc, SM, cfg->dt, &b);
    if (st == DG_OK) {
        char *o = (char *)dg_tensor_data(out);
        const char *pa = (const char *)dg_tensor_data(a), *pb = (const char *)dg_tensor_data(b);
        for (int64_t r = 0; r < rows; r++) {
            memcpy(o + (size_t)r * (V + K) * es, pa + (size_t)r * V * es, V * es);
            memcpy(o + ((size_t)r * (V + K) + V) * es, pb + (size_t)r * K * es, K * es);
        }
    }
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    return st;
}

static dg_status merge(dg_dtype dt, int HV, int K, int V, const void *ag, const int *order, int n,
                       void *out) {
    if (dt == DG_F64)
        return dg__kcp_merge_f64(HV, K, V, ag, order, n, out);
    return dg__kcp_merge_f32(HV, K, V, ag, order, n, out);
}

/* Chain the summaries of ranks first, first + step, ... (n of them) into out. */
static dg_status merge_ranks(const char *op, dg_dtype dt, int HV, int K, int V, const dg_tensor *ag,
                             int first, int step, int n, void *out) {
    int order[64], *ord = n <= 64 ? order : (int *)DG_MALLOC(sizeof(int) * (size_t)n);
    if (!ord)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    for (int s = 0; s < n; s++)
        ord[s] = first + s * step;
    dg_status st = merge(dt, HV, K, V, dg_tensor_data(ag), ord, n, out);
    if (ord != order)
        DG_FREE(ord);
    return st;
}

/* ---- params ---- */

kcp_np dg__kcp_probe(const kda_cfg *cfg, const dg_cp_plan *plan) {
    kcp_np p;
    memset(&p, 0, sizeof p);
    p.cfg = *cfg;
    p.rank = plan->rank;
    p.world = plan->world;
    p.pre = plan->pre_ranks;
    p.post = plan->post_ranks;
    p.seq0 = plan->seq0;
    p.n_global = plan->n_seqs;
    return p;
}

static void np_free(void *params) {
    kcp_np *np = (kcp_np *)params;
    dg__group_release(&np->grp);
    dg__kda_dev_release(&np->cfg.dev);
}

static kcp_np *np_new(dg_node *n, const kda_cfg *cfg, const kcp_ops *ops, dg__group *grp,
                      dg_comm *comm, const dg_cp_plan *p) {
    size_t ntab = 2 * ((size_t)cfg->d.N + 1);
    kcp_np *np = (kcp_np *)dg__node_params(n, sizeof(kcp_np) + ntab * sizeof(int64_t));
    if (!np)
        return NULL;
    *np = dg__kcp_probe(cfg, p);
    dg__kda_cfg_copy(&np->cfg, cfg, np->tab);
    np->grp = dg__group_retain(grp);
    np->comm = comm;
    np->ops = ops;
    n->params_free = np_free;
    return np;
}

/* The end of recording a CP node whose inputs and outputs are set (st: how that went): its params
 * (np_new), then commit, or abort on any error. */
static dg_status node_finish(dg_node *n, dg_status st, const kda_cfg *cfg, const kcp_ops *ops,
                             dg__group *grp, dg_comm *comm, const dg_cp_plan *plan) {
    kcp_np *np = st == DG_OK ? np_new(n, cfg, ops, grp, comm, plan) : NULL;
    if (st == DG_OK && !np)
        st = dg__err(DG_ERR_NOMEM, "%s: no memory for the node", ops->op);
    if (st == DG_OK)
        st = dg__node_commit(n);
    else if (n)
        dg__node_abort(n);
    return st;
}

/* ---- checks ---- */

dg_status dg__kcp_check_h0(const char *op, dg_ctx *ctx, const kda_cfg *cfg, const dg_cp_plan *plan,
                           const dg_tensor *h0, const char *names) {
    if (!h0)
        return DG_OK;
    int64_t s0[4] = {plan->n_seqs, cfg->d.HV, cfg->d.K, cfg->d.V};
    return dg__kda_check(op, "h0", h0, ctx, cfg->m_f, 4, s0, names);
}

dg_status dg__kcp_check_plan(const char *op, dg_comm *comm, const dg_cp_plan *plan,
                             const int64_t *cu_seqlens) {
    DG_TRY(dg__check_ptr(op, "comm", comm));
    DG_TRY(dg__check_ptr(op, "plan", plan));
    if (plan->world != dg_comm_size(comm) || plan->rank != dg_comm_rank(comm))
        return dg__err(DG_ERR_ARG, "%s: plan is for rank %d of %d but comm is rank %d of %d", op,
                       plan->rank, plan->world, dg_comm_rank(comm), dg_comm_size(comm));
    if (cu_seqlens)
        return dg__err(DG_ERR_ARG,
                       "%s: opts->cu_seqlens must be NULL (the plan holds the sequences: build "
                       "it with dg_cp_plan_new)",
                       op);
    return DG_OK;
}

dg_status dg__kcp_check_slice(const char *op, const char *arg, const dg_tensor *t, dg_ctx *ctx,
                              const dg_cp_plan *plan, const char *names) {
    char dims[64];
    snprintf(dims, sizeof dims, "1,T_r,%s", names);
    DG_TRY(dg__kda_check_first(op, arg, t, ctx, 4, dims));
    const long long tr = (long long)(plan->end - plan->begin);
    if (t->shape[0] != 1 || t->shape[1] != plan->end - plan->begin)
        return dg__err(DG_ERR_SHAPE,
                       "%s: %s must be [1,%lld,%s] (this rank's %lld tokens of the plan), got %s",
                       op, arg, tr, names, tr, dg_tensor_desc(t));
    return DG_OK;
}

dg_status dg__kcp_check_entry(const char *op, dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan,
                              const dg_tensor *q, int output_final_state, const int64_t *cu_seqlens,
                              dg_tensor **o, dg_tensor **ht) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "o", o));
    *o = NULL;
    if (ht)
        *ht = NULL;
    if (output_final_state && !ht)
        return dg__err(DG_ERR_ARG, "%s: opts->output_final_state is set but ht is NULL", op);
    DG_TRY(dg__kcp_check_plan(op, comm, plan, cu_seqlens));
    return dg__kcp_check_slice(op, "q", q, ctx, plan, "H,K");
}

/* ---- the init node: h0 -> h0m (backward only routes gradients) ---- */

static dg_status init_backward(dg_ctx *ctx, dg_node *n) {
    const kcp_np *np = (const kcp_np *)n->params;
    const dg_tensor *go = dg__node_grad_out(n, 0);
    if (!go || !dg__node_wants_grad(n, 0))
        return DG_OK;
    const kda_cfg *c = &np->cfg;
    dg_ctx *hc = NULL;
    dg_tensor *gh = NULL, *g0 = NULL, *g0d = NULL;
    int64_t s0[4] = {np->n_global, c->d.HV, c->d.K, c->d.V};
    const size_t row = dg__kcp_kv_bytes(c);
    dg_status st = dg__kcp_host_ctx(ctx, &hc);
    if (st == DG_OK)
        st = dg__kcp_to_host(hc, go, c->dt, &gh);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, c->dt, 4, s0, &g0);
    for (int i = 0; i < c->d.N && st == DG_OK; i++)
        if (dg__kcp_starts_here(np, i))
            memcpy((char *)dg_tensor_data(g0) + (size_t)(np->seq0 + i) * row,
                   (const char *)dg_tensor_data(gh) + (size_t)i * row, row);
    if (st == DG_OK)
        st = dg__kcp_to_dev(ctx, g0, &g0d);
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, g0d);
    dg_tensor_free(&gh);
    dg_tensor_free(&g0);
    dg_tensor_free(&g0d);
    dg__kcp_host_ctx_free(ctx, &hc);
    return st;
}

dg_status dg__kcp_forward_exchange(dg_ctx *ctx, dg_ctx *hc, dg_comm *comm, const dg_cp_plan *plan,
                                   const kda_cfg *cfg, const kcp_ops *ops, dg_tensor *hm,
                                   dg_tensor *h0, const dg_tensor *h0_h, dg_tensor **h0m) {
    *h0m = NULL;
    const int HV = cfg->d.HV, K = cfg->d.K, V = cfg->d.V, NL = cfg->d.N;
    int64_t sa[4] = {plan->world, HV, K, V + K}, sl[4] = {NL, HV, K, V};
    const size_t row = dg__kcp_kv_bytes(cfg);
    const kcp_np probe = dg__kcp_probe(cfg, plan);
    const char *h0p = (const char *)dg__kcp_ptr(h0_h);
    dg_tensor *ag = NULL, *h0mh = NULL;
    dg_status st = dg_tensor_new(hc, cfg->dt, 4, sa, &ag);
    if (st == DG_OK) /* every rank joins the collective, whatever it has to send */
        st = dg_comm_all_gather(comm, hm, ag);
    dg__profile_forward(ctx, ops->prof_all_gather);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, cfg->dt, 4, sl, &h0mh);
    for (int i = 0; i < NL && st == DG_OK && h0p; i++)
        if (dg__kcp_starts_here(&probe, i))
            memcpy((char *)dg_tensor_data(h0mh) + (size_t)i * row,
                   h0p + (size_t)(plan->seq0 + i) * row, row);
    if (st == DG_OK && plan->pre_ranks > 0) /* oldest rank first */
        st = merge_ranks(ops->op, cfg->dt, HV, K, V, ag, plan->rank - plan->pre_ranks, 1,
                         plan->pre_ranks, dg_tensor_data(h0mh));
    if (st == DG_OK)
        st = dg__kcp_to_dev(ctx, h0mh, h0m);
    dg__profile_forward(ctx, ops->prof_merge);
    if (st == DG_OK && h0 && dg__needs_grad(1, &h0)) {
        dg_node *n = NULL;
        st = dg__node_new(ops->init_kind, DG_POLICY_CACHE, init_backward, ctx, &n);
        if (st == DG_OK)
            dg__node_input(n, h0);
        if (st == DG_OK)
            st = dg__node_output(n, *h0m);
        st = node_finish(n, st, cfg, ops, NULL, comm, plan);
    }
    dg_tensor_free(&ag);
    dg_tensor_free(&h0mh);
    if (st != DG_OK)
        dg_tensor_free(h0m);
    return st;
}

/* ---- the link node: (h, x, htl) -> (h', x', ht) ---- */

static dg_status link_backward_body(dg_ctx *ctx, dg_node *n) {
    const kcp_np *np = (const kcp_np *)n->params;
    const kda_cfg *c = &np->cfg;
    const int HV = c->d.HV, K = c->d.K, V = c->d.V, NL = c->d.N;
    /* the gradients of the outputs h', x', ht */
    const dg_tensor *gh = dg__node_grad_out(n, 0), *gx = dg__node_grad_out(n, 1);
    const dg_tensor *ght = dg__node_grad_out(n, 2);
    const size_t row = dg__kcp_kv_bytes(c);
    dg_ctx *hc = NULL;
    dg_tensor *ght_h = NULL, *dhm = NULL, *ag = NULL, *dhtl = NULL, *dhtd = NULL;
    int64_t sm[3] = {HV, K, V + K}, sa[4] = {np->world, HV, K, V + K};
    int64_t sl[4] = {NL, HV, K, V};
    dg_status st = dg__kcp_host_ctx(ctx, &hc);
    if (st == DG_OK)
        st = dg__kcp_to_host(hc, ght, c->dt, &ght_h);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, c->dt, 3, sm, &dhm);
    if (st == DG_OK)
        st = dg_tensor_new(hc, c->dt, 4, sa, &ag);
    if (st == DG_OK && np->pre > 0) /* the reverse summary of local sequence 0 */
        st = np->ops->bwd_summary(ctx, hc, n, gh, gx, ght, ght_h, dhm);
    /* every rank joins the collective, whatever it has to send */
    if (st == DG_OK)
        st = dg_comm_all_gather(np->comm, dhm, ag);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, c->dt, 4, sl, &dhtl);
    for (int i = 0; i < NL && st == DG_OK; i++)
        if (dg__kcp_ends_here(np, i) && ght_h)
            memcpy((char *)dg_tensor_data(dhtl) + (size_t)i * row,
                   (const char *)dg_tensor_data(ght_h) + (size_t)(np->seq0 + i) * row, row);
    if (st == DG_OK && np->post > 0) /* farthest rank first */
        st = merge_ranks(np->ops->op, c->dt, HV, K, V, ag, np->rank + np->post, -1, np->post,
                         (char *)dg_tensor_data(dhtl) + (size_t)(NL - 1) * row);
    if (st == DG_OK && gh && dg__node_wants_grad(n, 0)) /* h' aliases h */
        st = dg__node_accum(ctx, n, 0, (dg_tensor *)gh);
    if (st == DG_OK && gx && dg__node_wants_grad(n, 1)) /* x' aliases x */
        st = dg__node_accum(ctx, n, 1, (dg_tensor *)gx);
    if (st == DG_OK && dg__node_wants_grad(n, 2)) {
        st = dg__kcp_to_dev(ctx, dhtl, &dhtd);
        if (st == DG_OK)
            st = dg__node_accum(ctx, n, 2, dhtd);
    }
    dg_tensor *locals[5] = {ght_h, dhm, ag, dhtl, dhtd};
    for (int i = 0; i < 5; i++)
        dg_tensor_free(&locals[i]);
    dg__kcp_host_ctx_free(ctx, &hc);
    return st;
}

static dg_status link_backward(dg_ctx *ctx, dg_node *n) {
    dg_status st = link_backward_body(ctx, n);
    const kcp_np *np = (const kcp_np *)n->params;
    dg__group_done(np->grp, np->ops->link_member);
    return st;
}

/* A new tensor object sharing t's storage (not recorded). */
static dg_status alias(dg_tensor *t, dg_tensor **out) {
    dg_no_grad_begin();
    dg_status st = dg_reshape(t, t->ndim, t->shape, out);
    dg_no_grad_end();
    return st;
}

dg_status dg__kcp_link(dg_ctx *ctx, dg_ctx *hc, dg_comm *comm, const dg_cp_plan *plan,
                       const kda_cfg *cfg, const kcp_ops *ops, dg__group *grp, dg_tensor *G,
                       dg_tensor *h, dg_tensor *x, dg_tensor *htl, dg_tensor **h2, dg_tensor **x2,
                       dg_tensor **htu) {
    *h2 = *x2 = *htu = NULL;
    const int HV = cfg->d.HV, K = cfg->d.K, V = cfg->d.V, NL = cfg->d.N;
    int64_t s0[4] = {plan->n_seqs, HV, K, V};
    const size_t row = dg__kcp_kv_bytes(cfg);
    const kcp_np probe = dg__kcp_probe(cfg, plan);
    dg_tensor *htlh = NULL, *htuh = NULL;
    dg_status st = dg__kcp_to_host(hc, htl, cfg->dt, &htlh);
    if (st == DG_OK)
        st = dg_tensor_zeros(hc, cfg->dt, 4, s0, &htuh);
    for (int i = 0; i < NL && st == DG_OK; i++)
        if (dg__kcp_ends_here(&probe, i))
            memcpy((char *)dg_tensor_data(htuh) + (size_t)(plan->seq0 + i) * row,
                   (const char *)dg_tensor_data(htlh) + (size_t)i * row, row);
    if (st == DG_OK)
        st = dg__kcp_to_dev(ctx, htuh, htu);
    dg_tensor *lin[3] = {h, x, htl};
    if (st == DG_OK && dg__needs_grad(3, lin)) {
        st = alias(h, h2);
        if (st == DG_OK)
            st = alias(x, x2);
        dg_node *n = NULL;
        if (st == DG_OK)
            st = dg__node_new(ops->link_kind, DG_POLICY_CACHE, link_backward, ctx, &n);
        for (int i = 0; i < 3 && st == DG_OK; i++)
            dg__node_input(n, lin[i]);
        /* h', x' alias h, x: their gradients are kept in the dtypes h's and x's are */
        if (st == DG_OK)
            st = dg__node_output_as(n, *h2, h->slot ? h->slot->dtype : h->dtype);
        if (st == DG_OK)
            st = dg__node_output_as(n, *x2, x->slot ? x->slot->dtype : x->dtype);
        if (st == DG_OK)
            st = dg__node_output(n, *htu);
        if (st == DG_OK)
            dg__node_save(n, G);
        if (st == DG_OK)
            dg__group_join(grp, ops->link_member, n);
        st = node_finish(n, st, cfg, ops, grp, comm, plan);
    } else if (st == DG_OK) {
        *h2 = dg_tensor_retain(h);
        *x2 = dg_tensor_retain(x);
    }
    dg_tensor_free(&htlh);
    dg_tensor_free(&htuh);
    if (st != DG_OK) {
        dg_tensor_free(h2);
        dg_tensor_free(x2);
        dg_tensor_free(htu);
    }
    return st;
}

/* ---- an op's forward ---- */

dg_status dg__kcp_fwd_begin(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, const kda_cfg *cfg,
                            const kcp_ops *ops, const dg_tensor *h0, kcp_fwd *f) {
    memset(f, 0, sizeof *f);
    f->comm = comm;
    f->plan = plan;
    f->cfg = cfg;
    f->ops = ops;
    f->probe = dg__kcp_probe(cfg, plan);
    int64_t sm[3] = {cfg->d.HV, cfg->d.K, cfg->d.V + cfg->d.K};
    dg_status st = dg__kcp_host_ctx(ctx, &f->hc);
    if (st == DG_OK)
        st = dg__kcp_to_host(f->hc, h0, cfg->dt, &f->h0h);
    if (st == DG_OK)
        st = dg_tensor_zeros(f->hc, cfg->dt, 3, sm, &f->hm);
    return st;
}

dg_status dg__kcp_fwd_exchange(dg_ctx *ctx, kcp_fwd *f, dg_tensor *h0) {
    return dg__kcp_forward_exchange(ctx, f->hc, f->comm, f->plan, f->cfg, f->ops, f->hm, h0, f->h0h,
                                    &f->h0m);
}

dg_status dg__kcp_fwd_link(dg_ctx *ctx, kcp_fwd *f, dg__group *grp, dg_tensor *G, dg_tensor *h,
                           dg_tensor *x, dg_tensor *htl) {
    return dg__kcp_link(ctx, f->hc, f->comm, f->plan, f->cfg, f->ops, grp, G, h, x, htl, &f->h2,
                        &f->x2, &f->htu);
}

dg_status dg__kcp_fwd_end(dg_ctx *ctx, kcp_fwd *f, dg_status st, dg_tensor **ht) {
    if (st == DG_OK && ht)
        *ht = dg_tensor_retain(f->htu);
    dg_tensor *all[6] = {f->h0h, f->hm, f->h0m, f->h2, f->x2, f->htu};
    for (int i = 0; i < 6; i++)
        dg_tensor_free(&all[i]);
    dg__kcp_host_ctx_free(ctx, &f->hc);
    memset(f, 0, sizeof *f);
    return st;
}

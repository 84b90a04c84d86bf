/*
 * autograd/tape.c -- the one active tape: nodes appended during forward, walked in reverse by
 * backward; gradient slots; grad mode; the byte count of what nodes keep.
 *
 * The tape is the reverse topological order by construction (a node is recorded after its inputs
 * exist), so backward needs no sort: it visits nodes last to first and runs each node that has a
 * gradient on at least one output. Output gradients of a node are released right after it runs
 * unless the tensor is a leaf or asked to retain its gradient, so peak memory during backward is
 * what the saved tensors hold plus the live frontier of gradients.
 */
#include "tape.h"

typedef struct {
    dg_node **nodes;
    int n, cap;
} dg_tape;

static dg_tape g_tape;
static int g_no_grad_depth;

/* A bf16 leaf's gradient that a backward creates and that more than one node adds to is summed in
 * f32 (one rounding instead of one per contribution, and kernels can add to the f32 buffer in
 * place: dg__node_grad_inplace) from its first contribution until the last node that reads the
 * leaf has run; then it is converted to bf16. A leaf with one contributor is stored in bf16 at
 * once, as before (no f32 copy held longer). */
static struct {
    dg_gslot **s;
    int n, cap;
    int active; /* inside dg__tape_backward_multi */
    int pos;    /* the tape index of the node whose backward runs */
} g_wide;

/* ---- grad mode ---- */

void dg_no_grad_begin(void) { g_no_grad_depth++; }
void dg_no_grad_end(void) {
    if (g_no_grad_depth > 0)
        g_no_grad_depth--;
}
int dg_grad_enabled(void) { return g_no_grad_depth == 0; }

/* ---- slots ---- */

static dg_gslot *slot_new(const dg_tensor *t, int is_leaf) {
    dg_gslot *s = DG_CALLOC(1, sizeof *s);
    if (!s)
        return NULL;
    s->refcount = 1;
    s->ndim = t->ndim;
    memcpy(s->shape, t->shape, sizeof s->shape);
    s->dtype = t->dtype;
    s->ctx = t->storage->ctx;
    s->is_leaf = is_leaf;
    return s;
}

void dg_tensor_set_requires_grad(dg_tensor *t, int on) {
    if (!t)
        return;
    if (on && !t->slot)
        t->slot = slot_new(t, 1);
    else if (!on && t->slot)
        dg__slot_release(&t->slot);
}

int dg_tensor_requires_grad(const dg_tensor *t) { return t && t->slot != NULL; }

const dg_tensor *dg_tensor_grad(const dg_tensor *t) {
    return (t && t->slot) ? t->slot->grad : NULL;
}

void dg_tensor_zero_grad(dg_tensor *t) {
    if (t && t->slot)
        dg_tensor_free(&t->slot->grad);
}

void dg_tensor_retain_grad(dg_tensor *t) {
    if (t && t->slot)
        t->slot->retain = 1;
}

/* *out = a new tensor of dtype dt holding src's values (NULL on failure). */
static dg_status copy_as(dg_ctx *ctx, dg_dtype dt, const dg_tensor *src, dg_tensor **out) {
    DG_TRY(dg_tensor_new(ctx, dt, src->ndim, src->shape, out));
    dg_status st = dg_tensor_copy_(*out, src);
    if (st != DG_OK)
        dg_tensor_free(out);
    return st;
}

/* Does node nd read slot s? */
static int node_reads(const dg_node *nd, const dg_gslot *s) {
    for (int q = 0; q < nd->n_in; q++)
        if (nd->in[q] == s)
            return 1;
    return 0;
}

/* Register s as accumulating in f32 until the last node that reads it has run; 0 where it stays
 * in its own dtype (not a bf16 leaf, no backward running, no later node reads it, no memory for
 * the list, or a gradient kept from an earlier backward: that tensor is added to where it is,
 * which a captured CUDA graph relies on). */
static int slot_widen(dg_gslot *s) {
    if (s->wide)
        return 1;
    if (!g_wide.active || !s->is_leaf || s->dtype != DG_BF16 || s->grad)
        return 0;
    int last = -1; /* the reader that runs last: the lowest tape index below pos */
    for (int j = 0; j < g_wide.pos && last < 0; j++)
        if (node_reads(g_tape.nodes[j], s))
            last = j;
    if (last < 0)
        return 0;
    if (g_wide.n == g_wide.cap) {
        int cap = g_wide.cap ? 2 * g_wide.cap : 16;
        dg_gslot **p = DG_REALLOC(g_wide.s, (size_t)cap * sizeof *p);
        if (!p)
            return 0;
        g_wide.s = p;
        g_wide.cap = cap;
    }
    s->wide = last + 1;
    s->refcount++;
    g_wide.s[g_wide.n++] = s;
    return 1;
}

/* Convert the widened slots whose last reader has run (tape index >= done; done < 0: all, at
 * the end of a backward) back to bf16. A slot whose conversion fails loses its gradient (never
 * left in the wrong dtype); the first error is returned, its message set unless quiet (a
 * backward that already failed keeps its own). */
static dg_status slots_narrow(int done, int quiet) {
    dg_status st = DG_OK;
    int keep = 0;
    for (int i = 0; i < g_wide.n; i++) {
        dg_gslot *s = g_wide.s[i];
        if (done >= 0 && s->wide - 1 < done) {
            g_wide.s[keep++] = s;
            continue;
        }
        s->wide = 0;
        if (s->grad && s->grad->dtype != s->dtype) {
            dg_tensor *t = NULL;
            const dg_status cs = copy_as(s->ctx, s->dtype, s->grad, &t);
            dg_tensor_free(&s->grad);
            s->grad = t;
            if (st == DG_OK && cs != DG_OK)
                st = quiet ? cs
                           : dg__err(cs, "backward: converting a leaf gradient to %s: %s",
                                     dg_dtype_name(s->dtype), dg_last_error());
        }
        dg__slot_release(&s);
    }
    g_wide.n = keep;
    if (keep == 0 && g_wide.cap > 4096) {
        DG_FREE(g_wide.s);
        g_wide.s = NULL;
        g_wide.cap = 0;
    }
    return st;
}

dg_status dg__slot_accum(dg_ctx *ctx, dg_gslot *s, dg_tensor *g) {
    if (g->ndim != s->ndim || memcmp(g->shape, s->shape, (size_t)s->ndim * sizeof(int64_t)) != 0)
        return dg__err(DG_ERR_SHAPE, "backward: gradient %s does not match its tensor's shape",
                       dg_tensor_desc(g));
    const dg_dtype dt = slot_widen(s) ? DG_F32 : s->dtype;
    if (s->grad)
        return dg__axpy(ctx, s->grad, 1.0, g);
    /* First contribution: take g itself when nobody else can see or change it. */
    if (g->refcount == 1 && g->storage->refcount == 1 && g->dtype == dt &&
        dg_tensor_is_contiguous(g) && !g->slot) {
        s->grad = dg_tensor_retain(g);
        return DG_OK;
    }
    return copy_as(ctx, dt, g, &s->grad);
}

/* ---- nodes ---- */

int dg__needs_grad(int n, dg_tensor *const *ts) {
    if (!dg_grad_enabled())
        return 0;
    for (int i = 0; i < n; i++)
        if (ts[i] && ts[i]->slot)
            return 1;
    return 0;
}

dg_status dg__node_new(const char *op, dg_policy default_policy, dg_backward_fn bw, dg_ctx *ctx,
                       dg_node **out) {
    dg_node *n = DG_CALLOC(1, sizeof *n);
    if (!n)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory recording a tape node", op);
    n->op = op;
    n->policy = dg_policy_resolve(op, default_policy);
    n->backward = bw;
    n->ctx = ctx;
    *out = n;
    return DG_OK;
}

static void node_free(dg_node *n) {
    if (!n)
        return;
    for (int i = 0; i < n->n_in; i++)
        dg__slot_release(&n->in[i]);
    for (int i = 0; i < n->n_out; i++)
        dg__slot_release(&n->out[i]);
    for (int i = 0; i < n->n_saved; i++)
        dg_tensor_free(&n->saved[i]);
    if (n->params_free)
        n->params_free(n->params);
    DG_FREE(n->params);
    DG_FREE(n);
}

void dg__node_abort(dg_node *n) { node_free(n); }

void dg__node_input(dg_node *n, dg_tensor *t) {
    DG_ASSERT(n->n_in < DG_NODE_MAX_IO);
    dg_gslot *s = (t && t->slot) ? t->slot : NULL;
    if (s)
        s->refcount++;
    n->in[n->n_in++] = s;
}

dg_status dg__node_output(dg_node *n, dg_tensor *t) {
    DG_ASSERT(n->n_out < DG_NODE_MAX_IO);
    DG_ASSERT(t != NULL);
    if (t->slot)
        dg__slot_release(&t->slot);
    t->slot = slot_new(t, 0);
    if (!t->slot)
        return n->failed = dg__err(DG_ERR_NOMEM, "%s: out of host memory", n->op);
    t->slot->refcount++;
    n->out[n->n_out++] = t->slot;
    return DG_OK;
}

dg_status dg__node_output_as(dg_node *n, dg_tensor *t, dg_dtype grad_dt) {
    DG_TRY(dg__node_output(n, t));
    t->slot->dtype = grad_dt;
    return DG_OK;
}

void dg__node_save(dg_node *n, dg_tensor *t) {
    DG_ASSERT(n->n_saved < DG_NODE_MAX_SAVED);
    n->saved[n->n_saved++] = dg_tensor_retain(t);
}

void dg__node_unsave(dg_node *n, const dg_tensor *t) {
    for (int i = n->n_saved - 1; i >= 0; i--)
        if (n->saved[i] == t) {
            dg_tensor_free(&n->saved[i]);
            return;
        }
}

void *dg__node_params(dg_node *n, size_t bytes) {
    DG_ASSERT(n->params == NULL);
    n->params = DG_CALLOC(1, bytes ? bytes : 1);
    return n->params;
}

dg_status dg__node_commit(dg_node *n) {
    if (n->failed != DG_OK) { /* dg__node_output ran out of memory; its error is the last one */
        dg_status s = n->failed;
        node_free(n);
        return s;
    }
    if (g_tape.n == g_tape.cap) {
        int cap = g_tape.cap ? 2 * g_tape.cap : 256;
        dg_node **p = DG_REALLOC(g_tape.nodes, (size_t)cap * sizeof *p);
        if (!p) {
            node_free(n);
            return dg__err(DG_ERR_NOMEM, "out of host memory growing the tape");
        }
        g_tape.nodes = p;
        g_tape.cap = cap;
    }
    g_tape.nodes[g_tape.n++] = n;
    dg__profile_forward(n->ctx ? n->ctx : NULL, n->op);
    return DG_OK;
}

dg_status dg__node_commit_params(dg_node *n, const void *params, size_t bytes) {
    void *p = dg__node_params(n, bytes);
    if (!p) {
        const char *op = n->op;
        dg__node_abort(n);
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory recording the tape node", op);
    }
    memcpy(p, params, bytes);
    return dg__node_commit(n);
}

const dg_tensor *dg__node_grad_out(const dg_node *n, int i) {
    return (i < n->n_out && n->out[i]) ? n->out[i]->grad : NULL;
}

void dg__node_drop_grad_out(dg_node *n, int i) {
    dg_gslot *o = i < n->n_out ? n->out[i] : NULL;
    if (o && !o->is_leaf && !o->retain) /* the rule the tape applies after the backward */
        dg_tensor_free(&o->grad);
}

int dg__node_wants_grad(const dg_node *n, int i) { return i < n->n_in && n->in[i] != NULL; }

dg_status dg__node_accum(dg_ctx *ctx, dg_node *n, int i, dg_tensor *g) {
    if (!dg__node_wants_grad(n, i))
        return DG_OK;
    /* Passing an output gradient straight through: the slot must get its own copy, since the
     * output's slot may keep (retain) that tensor and later accumulation happens in place. */
    dg_tensor *own = NULL;
    for (int j = 0; j < n->n_out; j++)
        if (n->out[j] && n->out[j]->grad == g) {
            DG_TRY(dg__contig(ctx, g, &own));
            if (own == g) {
                dg_tensor_free(&own);
                DG_TRY(copy_as(ctx, g->dtype, g, &own));
            }
            g = own;
            break;
        }
    dg_status s = dg__slot_accum(ctx, n->in[i], g);
    dg_tensor_free(&own);
    if (s != DG_OK && s != DG_ERR_NOMEM)
        return dg__err(s, "%s backward, input %d: %s", n->op, i, dg_last_error());
    return s;
}

dg_tensor *dg__node_grad_inplace(dg_node *n, int i, dg_dtype dt) {
    if (!dg__node_wants_grad(n, i))
        return NULL;
    for (int j = 0; j < n->n_in; j++) /* one tensor passed as two inputs: accumulate normally */
        if (j != i && n->in[j] == n->in[i])
            return NULL;
    dg_tensor *g = n->in[i]->grad;
    if (!g || g->dtype != dt || g->refcount != 1 || g->storage->refcount != 1 ||
        !dg_tensor_is_contiguous(g))
        return NULL;
    /* kernels write it with vector stores: a view at an odd offset takes the ordinary path */
    if (((uintptr_t)dg_tensor_data(g) & 15) != 0)
        return NULL;
    return g;
}

/* ---- the tape ---- */

void dg_tape_reset(void) {
    for (int i = 0; i < g_tape.n; i++)
        node_free(g_tape.nodes[i]);
    g_tape.n = 0;
    if (g_tape.cap > 4096) { /* give back an unusually large array */
        DG_FREE(g_tape.nodes);
        g_tape.nodes = NULL;
        g_tape.cap = 0;
    }
}

int dg_tape_num_nodes(void) { return g_tape.n; }

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return x < y ? -1 : x > y;
}

static size_t saved_bytes(dg_node *const *nodes, int nn) {
    int total = 0;
    for (int i = 0; i < nn; i++)
        total += nodes[i]->n_saved;
    if (!total)
        return 0;
    dg_storage **st = DG_MALLOC((size_t)total * sizeof *st);
    if (!st)
        return 0;
    int k = 0;
    for (int i = 0; i < nn; i++)
        for (int j = 0; j < nodes[i]->n_saved; j++)
            if (nodes[i]->saved[j])
                st[k++] = nodes[i]->saved[j]->storage;
    qsort(st, (size_t)k, sizeof *st, cmp_ptr);
    size_t bytes = 0;
    for (int i = 0; i < k; i++)
        if (i == 0 || st[i] != st[i - 1])
            bytes += st[i]->bytes;
    DG_FREE(st);
    return bytes;
}

size_t dg_tape_bytes(void) { return saved_bytes(g_tape.nodes, g_tape.n); }

void dg_tape_dump(FILE *f) {
    for (int i = 0; i < g_tape.n; i++) {
        dg_node *n = g_tape.nodes[i];
        fprintf(f, "%4d %-20s %-9s in=%d out=%d saved=%d (%zu bytes)\n", i, n->op,
                dg_policy_name(n->policy), n->n_in, n->n_out, n->n_saved, saved_bytes(&n, 1));
    }
}

/* Seed slot s with the caller's gradient g. A slot that already has a gradient adds g to it; an
 * empty one may hold g itself only where nothing can change it later: no node of the tape reads
 * s (so nothing adds to it) and s is neither a leaf nor retained (its gradient is freed once its
 * producer has run), and no other seed goes to s. Otherwise a copy, so the caller's tensor is
 * never written. */
static dg_status seed_slot(dg_ctx *ctx, dg_gslot *s, const dg_tensor *g, int seeded_twice) {
    int read = s->is_leaf || s->retain || seeded_twice;
    for (int j = 0; j < g_tape.n && !read && !s->grad; j++)
        read = node_reads(g_tape.nodes[j], s);
    if (s->grad || !read)
        return dg__slot_accum(ctx, s, (dg_tensor *)g);
    dg_tensor *c = NULL;
    DG_TRY(copy_as(ctx, g->dtype, g, &c));
    dg_status st = dg__slot_accum(ctx, s, c);
    dg_tensor_free(&c);
    return st;
}

dg_status dg__tape_backward_multi(dg_ctx *ctx, int n, dg_tensor *const *outs,
                                  const dg_tensor *const *grads) {
    int any = 0;
    for (int i = 0; i < n; i++) {
        if (!outs[i] || !grads[i])
            continue;
        if (!outs[i]->slot)
            return dg__err(DG_ERR_STATE,
                           "backward: output %d does not require grad (no op on the tape "
                           "produced it from a tensor that requires grad)",
                           i);
        int twice = 0;
        for (int j = 0; j < n; j++)
            twice |= j != i && outs[j] && grads[j] && outs[j]->slot == outs[i]->slot;
        DG_TRY(seed_slot(ctx, outs[i]->slot, grads[i], twice));
        any = 1;
    }
    if (!any)
        return dg__err(DG_ERR_STATE, "backward: nothing to differentiate");
    dg_no_grad_begin(); /* backward functions use ops; they must not record */
    /* a backward started from inside a backward function leaves the widened slots to the outer */
    const int outer = !g_wide.active, pos0 = g_wide.pos;
    g_wide.active = 1;
    dg_status s = DG_OK;
    for (int i = g_tape.n - 1; i >= 0 && s == DG_OK; i--) {
        dg_node *node = g_tape.nodes[i];
        int has = 0;
        for (int j = 0; j < node->n_out; j++)
            if (node->out[j] && node->out[j]->grad)
                has = 1;
        int wants = 0;
        for (int j = 0; j < node->n_in; j++)
            if (node->in[j])
                wants = 1;
        if (has && wants) {
            double t0 = dg__profile_begin(node->ctx ? node->ctx : ctx);
            g_wide.pos = i;
            s = node->backward(ctx, node);
            dg__profile_backward(node->ctx ? node->ctx : ctx, node->op, t0);
        }
        if (s == DG_OK && outer && g_wide.n > 0)
            s = slots_narrow(i, 0);
        for (int j = 0; j < node->n_out; j++) {
            dg_gslot *o = node->out[j];
            if (o && !o->is_leaf && !o->retain)
                dg_tensor_free(&o->grad);
        }
    }
    dg_status ns = DG_OK;
    if (outer) { /* every slot back to bf16 (also after a failure: no slot is left in f32) */
        g_wide.active = 0;
        ns = slots_narrow(-1, s != DG_OK);
    } else {
        g_wide.pos = pos0;
    }
    dg_no_grad_end();
    return s != DG_OK ? s : ns;
}

dg_status dg_tape_backward_with(dg_ctx *ctx, dg_tensor *out, const dg_tensor *grad_out) {
    DG_TRY(dg__check_ptr("dg_tape_backward", "ctx", ctx));
    DG_TRY(dg__check_ptr("dg_tape_backward", "out", out));
    DG_TRY(dg__check_ptr("dg_tape_backward", "grad_out", grad_out));
    if (!dg__same_shape(out, grad_out))
        return dg__err(DG_ERR_SHAPE, "dg_tape_backward: grad_out %s must match out %s",
                       dg_tensor_desc(grad_out), dg_tensor_desc(out));
    return dg__tape_backward_multi(ctx, 1, &out, &grad_out);
}

dg_status dg_tape_backward(dg_ctx *ctx, dg_tensor *loss) {
    DG_TRY(dg__check_ptr("dg_tape_backward", "ctx", ctx));
    DG_TRY(dg__check_ptr("dg_tape_backward", "loss", loss));
    if (dg_tensor_numel(loss) != 1)
        return dg__err(DG_ERR_SHAPE, "dg_tape_backward: loss must have one element, got %s",
                       dg_tensor_desc(loss));
    dg_tensor *one = NULL;
    DG_TRY(dg_tensor_new(ctx, loss->dtype, loss->ndim, loss->shape, &one));
    dg_status s = dg_tensor_fill_(one, 1.0);
    if (s == DG_OK)
        s = dg_tape_backward_with(ctx, loss, one);
    dg_tensor_free(&one);
    return s;
}

dg_status dg_tape_backward_multi(dg_ctx *ctx, int n, dg_tensor *const *outs,
                                 const dg_tensor *const *grads) {
    DG_TRY(dg__check_ptr("dg_tape_backward_multi", "ctx", ctx));
    if (n < 1 || !outs || !grads)
        return dg__err(DG_ERR_ARG, "dg_tape_backward_multi: need n >= 1 outputs and gradients");
    for (int i = 0; i < n; i++)
        if (outs[i] && grads[i] && !dg__same_shape(outs[i], grads[i]))
            return dg__err(DG_ERR_SHAPE,
                           "dg_tape_backward_multi: grads[%d] %s must match outs[%d] %s", i,
                           dg_tensor_desc(grads[i]), i, dg_tensor_desc(outs[i]));
    return dg__tape_backward_multi(ctx, n, outs, grads);
}

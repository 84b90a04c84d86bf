/*
 * autograd/group.h -- recompute groups: tensors that several tape nodes of one op call read in
 * backward, kept or rebuilt by one table (library-internal).
 *
 * A chunked op records a chain of nodes, and some of them read in backward a tensor that another
 * node of the chain made in forward (KDA: the state and output nodes read W, KG, QG from the wy
 * node and h, E from the state node). On a tape a node keeps what it reads, so "do not keep W"
 * cannot be decided by the node that makes W. The nodes therefore read such "derived" tensors
 * through a group, and one table per op (dg__group_spec) says for each derived tensor:
 *   - the op kind of the node that makes it; that kind's policy decides whether the tensor made
 *     by the forward is kept (CACHE) or dropped after the forward (RECOMPUTE);
 *   - the members (nodes of the chain) whose backward reads it;
 *   - the recipe that rebuilds it in backward, and what that recipe reads: group inputs (tensors
 *     the chain keeps anyway) and other derived tensors (rebuilt first when missing).
 * The op's own table, with its recipes, is the place to read what is kept and rebuilt (KDA:
 * ops/kda/kda_group.c, DPLR: ops/dplr/dplr_group.c). The rules below are all there is:
 *
 *   keep     A tensor kept in forward (dg__group_keep, or dg__group_offer when its policy is
 *            CACHE and backward may read it) serves its readers in backward without a rebuild.
 *            When no member still to run needs it (the release rule below), it is freed if its
 *            recipe could make it again (the recipe's inputs are set), with the references the
 *            members' saved lists hold (dg__group_join put them there); a second backward then
 *            rebuilds it like a RECOMPUTE tensor. One that could not come back (a node used
 *            alone keeps its own inputs, with no recipe inputs set) stays until the group is
 *            released with the last node holding it (dg_tape_reset).
 *   rebuild  A missing tensor is rebuilt when a member's backward first asks for it
 *            (dg__group_get). That is the first reader in backward order; the later readers find
 *            it. A recipe makes, in one pass, every missing tensor of its table rows that a member
 *            still to run needs (directly or through another recipe), and nothing else.
 *   release  A rebuilt tensor (or a kept one that can be rebuilt) is freed as soon as neither a
 *            member still to run in this backward reads it nor a recipe still to run needs it.
 *            Backward visits the tape in reverse and members join the group as they are
 *            recorded, so the members still to come after member m are exactly those that joined
 *            before m: no other ordering knowledge is needed. The check runs after every
 *            dg__group_get and at dg__group_done, which each member's backward calls when it
 *            ends (on every path).
 *
 * A member whose backward the tape skips (no gradient reached it) neither asks nor calls
 * dg__group_done; whatever it would have read is freed when a member recorded before it ends. If
 * none runs, a tensor rebuilt for the skipped member stays (reused, not rebuilt, by the next
 * backward) until dg_tape_reset; in KDA and DPLR a member that a reader hands gradients to always
 * runs, so this does not arise. A second backward over the same tape rebuilds again: the rules
 * hold per pass without any per-pass state.
 */
#ifndef DG_AUTOGRAD_GROUP_H
#define DG_AUTOGRAD_GROUP_H

#include "tape.h"

/* Members, inputs and derived tensors of one group (each a bit in an unsigned mask). */
#define DG_GROUP_MAX 16
#define DG_BIT(i) (1u << (i))

typedef struct dg__group dg__group;

/* One row of the table: a derived tensor. */
typedef struct dg__group_row {
    const char *name;     /* in messages */
    const char *made_by;  /* op kind of the node that makes it in forward (also its policy key) */
    dg_policy by_default; /* that op kind's own default (dg_policy_resolve) */
    unsigned readers;     /* DG_BIT(member): the members whose backward reads it */
    int recipe;           /* index into dg__group_spec.recipes, or -1: never rebuilt */
} dg__group_row;

/* How some derived tensors are rebuilt: run() makes each tensor i of `make` (rows whose recipe
 * this is, all missing) and hands it over with dg__group_put. */
typedef struct dg__group_recipe {
    const char *name;
    unsigned needs; /* DG_BIT(input): group inputs it cannot do without (others are optional) */
    unsigned reads; /* DG_BIT(tensor): derived tensors it reads (made by other recipes: no
                     * cycles), all present when run() is called */
    dg_status (*run)(dg__group *g, dg_ctx *ctx, unsigned make);
} dg__group_recipe;

typedef struct dg__group_spec {
    const char *op; /* names the op in messages */
    int n_members;
    const char *const *members;
    int n_inputs;
    const char *const *inputs;
    int n_tensors;
    const dg__group_row *tensors;
    const dg__group_recipe *recipes;
} dg__group_spec;

/* A group over `spec` (static). data (may be NULL) belongs to the group from now on, also on
 * failure: data_free(data) runs when the group goes. */
dg_status dg__group_new(const dg__group_spec *spec, void *data, void (*data_free)(void *),
                        dg__group **out);
dg__group *dg__group_retain(dg__group *g);
void dg__group_release(dg__group **g);
void *dg__group_data(const dg__group *g);

/* ---- forward ---- */
/* Group input i (retained; NULL: not available, recipes that need it report an error). */
void dg__group_set_input(dg__group *g, int i, dg_tensor *t);
/* Keep derived tensor i (retained) whatever the policy: a node used alone keeps its inputs. */
void dg__group_keep(dg__group *g, int i, dg_tensor *t);
/* Derived tensor i as made by the forward: kept when the policy of its made_by kind is CACHE and
 * backward may read it (it has readers, or a recipe reads it that makes a tensor not cached: KDA's
 * U, read only by rebuild_state, is not kept when h and E are). */
void dg__group_offer(dg__group *g, int i, dg_tensor *t);
/* Node n, being recorded, is member m: remembers n and its tape order and adds every input and
 * kept tensor of the group to n's saved list (so dg_tape_bytes counts what the group holds; a
 * kept tensor freed in backward leaves those lists, dg__node_unsave). The caller keeps a
 * reference to g in n's params (dg__group_retain). */
void dg__group_join(dg__group *g, int m, dg_node *n);

/* ---- backward ---- */
/* Borrowed pointer to derived tensor i for member m's backward (m must be one of its readers),
 * rebuilt when missing. Valid until member m calls dg__group_done. */
dg_status dg__group_get(dg__group *g, dg_ctx *ctx, int m, int i, dg_tensor **out);
/* Member m's backward has ended: rebuilt tensors that no member still to come needs are freed. */
void dg__group_done(dg__group *g, int m);

/* ---- for recipes ---- */
dg_tensor *dg__group_input(const dg__group *g, int i);  /* NULL when not set */
dg_tensor *dg__group_tensor(const dg__group *g, int i); /* NULL when missing */
/* Hand over rebuilt tensor i (the group takes its own reference; the caller still frees t). */
void dg__group_put(dg__group *g, int i, dg_tensor *t);

/* Rebuilt tensors alive in all groups (tests check it is 0 after a full backward). */
int dg__group_rebuilt_alive(void);

#endif /* DG_AUTOGRAD_GROUP_H */

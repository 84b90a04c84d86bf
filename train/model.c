/*
 * train/model.c -- the byte-level language model with a KDA or DPLR token mixer: config presets
 * and JSON, the parameter list and its init, the forward pass (all dg_ ops, so it records on the
 * tape), the loss, the decoding state (conv tails and mixer states carried between pieces of a
 * sequence) and sampling.
 * Shapes: B rows of T bytes; d model width; H/HV heads; K/V head dims; I MLP width.
 */
#include "train/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Everything in this file reports errors through dg_last_error(); this records one. */
#include "tensor/tensor.h"

/* ---- config --------------------------------------------------------------------------------- */

const char *dg_mixer_name(dg_mixer_kind k) {
    return k == DG_MIXER_KDA ? "kda" : k == DG_MIXER_DPLR ? "dplr" : NULL;
}

dg_status dg_mixer_parse(const char *s, dg_mixer_kind *out) {
    if (!s || !out)
        return dg__err(DG_ERR_ARG, "dg_mixer_parse: s and out must not be NULL");
    if (!strcmp(s, "kda"))
        *out = DG_MIXER_KDA;
    else if (!strcmp(s, "dplr"))
        *out = DG_MIXER_DPLR;
    else
        return dg__err(DG_ERR_ARG, "--mixer: '%.64s' is not kda or dplr", s);
    return DG_OK;
}

dg_status dg_model_config_preset(const char *name, dg_model_config *out) {
    if (!name || !out)
        return dg__err(DG_ERR_ARG, "dg_model_config_preset: name and out must not be NULL");
    dg_model_config c = {
        .vocab = 256,
        .d = 128,
        .n_layers = 2,
        .n_heads = 2,
        .n_v_heads = 2,
        .head_k = 64,
        .head_v = 64,
        .inter = 384,
        .conv = 4,
        .chunk = 64,
        .gate = DG_GATE_LOWERBOUND,
        .lower_bound = -5.0,
        .norm_eps = 1e-6,
        .tie = 0,
        .init_std = 0.02,
        .mixer = DG_MIXER_KDA,
    };
    if (!strcmp(name, "cpu")) {
        /* training.md M3's toy as is. */
    } else if (!strcmp(name, "gpu")) {
        c.d = 512, c.n_layers = 6, c.n_heads = c.n_v_heads = 4, c.head_k = c.head_v = 128;
        c.inter = 1408;
    } else if (!strcmp(name, "bench")) {
        c.d = 512, c.n_layers = 8, c.n_heads = c.n_v_heads = 4, c.head_k = c.head_v = 128;
        c.inter = 1408;
    } else {
        return dg__err(DG_ERR_ARG, "unknown model config '%s' (expected cpu, gpu or bench)", name);
    }
    *out = c;
    return DG_OK;
}

dg_status dg_model_config_check(const dg_model_config *c) {
    if (!c)
        return dg__err(DG_ERR_ARG, "model config: NULL");
#define NEED(cond, ...)                                                                            \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return dg__err(DG_ERR_ARG, __VA_ARGS__);                                               \
    } while (0)
    NEED(c->vocab >= 2 && c->vocab <= 1 << 20, "model config: vocab_size %d out of range",
         c->vocab);
    NEED(c->d >= 1 && c->d <= DG_MODEL_MAX_DIM,
         "model config: hidden_size (--d) %d out of range [1,%d]", c->d, DG_MODEL_MAX_DIM);
    NEED(c->n_layers >= 1 && c->n_layers <= DG_MODEL_MAX_LAYERS,
         "model config: num_hidden_layers (--layers) %d out of range", c->n_layers);
    NEED(c->n_heads >= 1 && c->n_heads <= DG_MODEL_MAX_DIM,
         "model config: num_heads (--heads) %d out of range [1,%d]", c->n_heads, DG_MODEL_MAX_DIM);
    NEED(c->n_v_heads <= DG_MODEL_MAX_DIM,
         "model config: num_v_heads (--v-heads) %d out of range [1,%d]", c->n_v_heads,
         DG_MODEL_MAX_DIM);
    NEED(c->n_v_heads >= c->n_heads && c->n_v_heads % c->n_heads == 0,
         "model config: num_v_heads (--v-heads, %d) must be a multiple of num_heads (--heads, %d)",
         c->n_v_heads, c->n_heads);
    NEED(c->head_k >= 1 && c->head_k <= DG_MODEL_MAX_HEAD_K,
         "model config: head_dim (--head-dim) %d out of range [1,256]", c->head_k);
    NEED(c->head_v >= 1 && c->head_v <= DG_MODEL_MAX_DIM,
         "model config: head_v_dim (--head-v-dim) %d out of range [1,%d]", c->head_v,
         DG_MODEL_MAX_DIM);
    NEED((int64_t)c->n_v_heads * c->head_v <= DG_MODEL_MAX_DIM &&
             (int64_t)c->n_v_heads * c->head_k <= DG_MODEL_MAX_DIM,
         "model config: num_v_heads x head dims (%d x %d, %d) exceed %d", c->n_v_heads, c->head_k,
         c->head_v, DG_MODEL_MAX_DIM);
    NEED(c->inter >= 1 && c->inter <= DG_MODEL_MAX_DIM,
         "model config: intermediate_size (--inter) %d out of range [1,%d]", c->inter,
         DG_MODEL_MAX_DIM);
    NEED(c->conv >= 1 && c->conv <= 8, "model config: conv_size %d out of range [1,8]", c->conv);
    NEED(c->chunk == 16 || c->chunk == 32 || c->chunk == 64,
         "model config: chunk_size (--chunk-size) must be 16, 32 or 64 (got %d)", c->chunk);
    NEED(c->gate == DG_GATE_LOWERBOUND || c->gate == DG_GATE_KDA,
         "model config: gate must be lower_bound or kda");
    NEED(c->gate != DG_GATE_LOWERBOUND || (c->lower_bound >= -5.0 && c->lower_bound < 0.0),
         "model config: lower_bound (--lower-bound) must be in [-5, 0) (got %g)", c->lower_bound);
    NEED(c->norm_eps > 0.0 && c->norm_eps < 1.0, "model config: norm_eps must be > 0 (got %g)",
         c->norm_eps);
    NEED(c->init_std > 0.0 && c->init_std < 1e3,
         "model config: initializer_range must be > 0 (got %g)", c->init_std);
    NEED(dg_mixer_name(c->mixer), "model config: mixer must be kda or dplr (got %d)",
         (int)c->mixer);
    NEED(c->mixer != DG_MIXER_DPLR || c->n_v_heads == c->n_heads,
         "model config: the DPLR mixer (--mixer dplr) has one value head per key head: "
         "num_v_heads (--v-heads, %d) must equal num_heads (--heads, %d)",
         c->n_v_heads, c->n_heads);
#undef NEED
    return DG_OK;
}

dg_status dg_model_config_to_json(const dg_model_config *c, char *buf, size_t n) {
    int len = snprintf(
        buf, n,
        "{\"vocab_size\": %d, \"hidden_size\": %d, \"num_hidden_layers\": %d, \"num_heads\": %d, "
        "\"num_v_heads\": %d, \"head_dim\": %d, \"head_v_dim\": %d, \"intermediate_size\": %d, "
        "\"conv_size\": %d, \"chunk_size\": %d, \"gate\": \"%s\", \"lower_bound\": %.17g, "
        "\"norm_eps\": %.17g, \"tie_word_embeddings\": %s, \"initializer_range\": %.17g, "
        "\"mixer\": \"%s\"}",
        c->vocab, c->d, c->n_layers, c->n_heads, c->n_v_heads, c->head_k, c->head_v, c->inter,
        c->conv, c->chunk, c->gate == DG_GATE_KDA ? "kda" : "lower_bound", c->lower_bound,
        c->norm_eps, c->tie ? "true" : "false", c->init_std,
        dg_mixer_name(c->mixer) ? dg_mixer_name(c->mixer) : "?");
    if (len < 0 || (size_t)len >= n)
        return dg__err(DG_ERR_ARG, "model config: JSON buffer of %zu bytes is too small", n);
    return DG_OK;
}

/* x in the fewest digits that read back as x (JSON readers print 1e-06, not 9.99...e-07). */
static void short_num(double x, char *buf, size_t n) {
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            return;
    }
}

dg_status dg_model_config_to_ref_json(const dg_model_config *c, char *buf, size_t n) {
    if (!c || !buf)
        return dg__err(DG_ERR_ARG, "dg_model_config_to_ref_json: config and buf must not be NULL");
    const int kda = c->mixer == DG_MIXER_KDA, lb = c->gate == DG_GATE_LOWERBOUND;
    char lower[40] = "null", ev[40], eps[40], std[40];
    if (lb)
        short_num(c->lower_bound, lower, sizeof lower);
    short_num((double)c->head_v / c->head_k, ev, sizeof ev);
    short_num(c->norm_eps, eps, sizeof eps);
    short_num(c->init_std, std, sizeof std);
    int len = snprintf(buf, n,
                       "{\n"
                       "  \"model_type\": \"%s\",\n"
                       "  \"architectures\": [%s],\n"
                       "  \"attn_mode\": \"chunk\",\n"
                       "  \"vocab_size\": %d,\n"
                       "  \"hidden_size\": %d,\n"
                       "  \"num_hidden_layers\": %d,\n"
                       "  \"num_heads\": %d,\n"
                       "  \"num_v_heads\": %d,\n"
                       "  \"head_dim\": %d,\n"
                       "  \"expand_v\": %s,\n"
                       "  \"intermediate_size\": %d,\n"
                       "  \"hidden_ratio\": null,\n"
                       "  \"hidden_act\": \"swish\",\n"
                       "  \"use_short_conv\": true,\n"
                       "  \"conv_size\": %d,\n"
                       "  \"allow_neg_eigval\": false,\n"
                       "  \"safe_gate\": %s,\n"
                       "  \"lower_bound\": %s,\n"
                       "  \"norm_eps\": %s,\n"
                       "  \"tie_word_embeddings\": %s,\n"
                       "  \"initializer_range\": %s,\n"
                       "  \"bos_token_id\": null,\n"
                       "  \"eos_token_id\": null,\n"
                       "  \"pad_token_id\": null,\n"
                       "  \"deltagrad\": {\"mixer\": \"%s\", \"chunk_size\": %d, \"gate\": \"%s\", "
                       "\"head_v_dim\": %d, \"vocab\": \"bytes\"}\n"
                       "}\n",
                       kda ? "kda" : "deltagrad_dplr", kda ? "\"KDAForCausalLM\"" : "", c->vocab,
                       c->d, c->n_layers, c->n_heads, c->n_v_heads, c->head_k, ev, c->inter,
                       c->conv, lb ? "true" : "false", lower, eps, c->tie ? "true" : "false", std,
                       dg_mixer_name(c->mixer) ? dg_mixer_name(c->mixer) : "?", c->chunk,
                       lb ? "lower_bound" : "kda", c->head_v);
    if (len < 0 || (size_t)len >= n)
        return dg__err(DG_ERR_ARG, "model config: JSON buffer of %zu bytes is too small", n);
    return DG_OK;
}

/* The text after `"key"` and its colon, or NULL. A match followed by something other than a
 * colon is a string value that happens to equal the key ("gate": "lower_bound"): keep looking. */
static const char *json_value(const char *json, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    for (const char *p = strstr(json, pat); p; p = strstr(p + 1, pat)) {
        const char *q = p + strlen(pat);
        while (*q == ' ' || *q == '\t')
            q++;
        if (*q != ':')
            continue;
        q++;
        while (*q == ' ' || *q == '\t')
            q++;
        return q;
    }
    return NULL;
}

static dg_status json_num(const char *json, const char *key, double *out) {
    const char *p = json_value(json, key);
    if (!p)
        return dg__err(DG_ERR_FORMAT, "model config: key \"%s\" is missing", key);
    char *end;
    double v = strtod(p, &end);
    if (end == p || !isfinite(v))
        return dg__err(DG_ERR_FORMAT, "model config: key \"%s\" is not a number", key);
    *out = v;
    return DG_OK;
}

static dg_status json_int(const char *json, const char *key, int *out) {
    double v = 0.0;
    DG_TRY(json_num(json, key, &v));
    if (v != floor(v) || fabs(v) > 1e9)
        return dg__err(DG_ERR_FORMAT, "model config: key \"%s\" is not an integer", key);
    *out = (int)v;
    return DG_OK;
}

dg_status dg_model_config_from_json(const char *json, dg_model_config *out) {
    if (!json || !out)
        return dg__err(DG_ERR_ARG, "dg_model_config_from_json: NULL argument");
    dg_model_config c;
    memset(&c, 0, sizeof c);
    DG_TRY(json_int(json, "vocab_size", &c.vocab));
    DG_TRY(json_int(json, "hidden_size", &c.d));
    DG_TRY(json_int(json, "num_hidden_layers", &c.n_layers));
    DG_TRY(json_int(json, "num_heads", &c.n_heads));
    DG_TRY(json_int(json, "num_v_heads", &c.n_v_heads));
    DG_TRY(json_int(json, "head_dim", &c.head_k));
    DG_TRY(json_int(json, "head_v_dim", &c.head_v));
    DG_TRY(json_int(json, "intermediate_size", &c.inter));
    DG_TRY(json_int(json, "conv_size", &c.conv));
    DG_TRY(json_int(json, "chunk_size", &c.chunk));
    DG_TRY(json_num(json, "lower_bound", &c.lower_bound));
    DG_TRY(json_num(json, "norm_eps", &c.norm_eps));
    DG_TRY(json_num(json, "initializer_range", &c.init_std));
    const char *g = json_value(json, "gate");
    if (g && !strncmp(g, "\"kda\"", 5))
        c.gate = DG_GATE_KDA;
    else if (g && !strncmp(g, "\"lower_bound\"", 13))
        c.gate = DG_GATE_LOWERBOUND;
    else
        return dg__err(DG_ERR_FORMAT,
                       "model config: key \"gate\" must be \"kda\" or \"lower_bound\"");
    const char *t = json_value(json, "tie_word_embeddings");
    if (t && !strncmp(t, "true", 4))
        c.tie = 1;
    else if (t && !strncmp(t, "false", 5))
        c.tie = 0;
    else
        return dg__err(DG_ERR_FORMAT,
                       "model config: key \"tie_word_embeddings\" must be true/false");
    /* written since the DPLR mixer exists; a config without it is a KDA model */
    const char *mx = json_value(json, "mixer");
    if (!mx || !strncmp(mx, "\"kda\"", 5))
        c.mixer = DG_MIXER_KDA;
    else if (!strncmp(mx, "\"dplr\"", 6))
        c.mixer = DG_MIXER_DPLR;
    else
        return dg__err(DG_ERR_FORMAT, "model config: key \"mixer\" must be \"kda\" or \"dplr\"");
    DG_TRY(dg_model_config_check(&c));
    *out = c;
    return DG_OK;
}

/* The DPLR mixer has the KDA layer's parameters exactly (b_proj gives its alpha), so the count
 * does not depend on cfg.mixer. */
int64_t dg_model_config_num_params(const dg_model_config *c) {
    int64_t d = c->d, H = c->n_heads, HV = c->n_v_heads, K = c->head_k, V = c->head_v;
    int64_t W = c->conv, I = c->inter;
    int64_t attn = 2 * d * H * K + d * HV * V + W * (2 * H * K + HV * V) + (d * V + V * HV * K) +
                   d * HV + HV + HV * K + (d * V + V * HV * V + HV * V) + V + HV * V * d;
    int64_t layer = attn + 3 * d * I + 2 * d;
    return c->n_layers * layer + (int64_t)c->vocab * d * (c->tie ? 1 : 2) + d;
}

/* ---- parameters ----------------------------------------------------------------------------- */

static dg_status add_param(dg_model *m, int *ix, const char *name, int ndim, const int64_t *shape,
                           int decay, int keep_f32) {
    dg_param *p = &m->params[m->n_params];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->decay = decay;
    p->keep_f32 = keep_f32;
    dg_dtype dt = (keep_f32 && m->param_dtype != DG_F64) ? DG_F32 : m->param_dtype;
    DG_TRY(dg_tensor_zeros(m->ctx, dt, ndim, shape, &p->t));
    dg_tensor_set_name(p->t, name);
    dg_tensor_set_requires_grad(p->t, 1);
    *ix = m->n_params++;
    return DG_OK;
}

#define SHAPE(...)                                                                                 \
    (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]) { __VA_ARGS__ }

static dg_status build_params(dg_model *m) {
    const dg_model_config *c = &m->cfg;
    int64_t d = c->d, HK = (int64_t)c->n_heads * c->head_k, HVK = (int64_t)c->n_v_heads * c->head_k;
    int64_t HVV = (int64_t)c->n_v_heads * c->head_v, V = c->head_v, W = c->conv, I = c->inter;
    char nm[80];
    DG_TRY(add_param(m, &m->embed, "model.embeddings.weight", SHAPE(c->vocab, d), 1, 0));
    for (int l = 0; l < c->n_layers; l++) {
        dg_layer_ix *L = &m->layers[l];
#define P(field, suffix, decay, keep, ...)                                                         \
    do {                                                                                           \
        snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix);                                  \
        DG_TRY(add_param(m, &L->field, nm, SHAPE(__VA_ARGS__), decay, keep));                      \
    } while (0)
        P(attn_norm, "attn_norm.weight", 0, 0, d);
        P(q_proj, "attn.q_proj.weight", 1, 0, HK, d);
        P(k_proj, "attn.k_proj.weight", 1, 0, HK, d);
        P(v_proj, "attn.v_proj.weight", 1, 0, HVV, d);
        P(q_conv, "attn.q_conv1d.weight", 1, 0, HK, 1, W);
        P(k_conv, "attn.k_conv1d.weight", 1, 0, HK, 1, W);
        P(v_conv, "attn.v_conv1d.weight", 1, 0, HVV, 1, W);
        P(f_proj0, "attn.f_proj.0.weight", 1, 0, V, d);
        P(f_proj1, "attn.f_proj.1.weight", 1, 0, HVK, V);
        P(b_proj, "attn.b_proj.weight", 1, 0, c->n_v_heads, d);
        P(A_log, "attn.A_log", 0, 1, c->n_v_heads);
        P(dt_bias, "attn.dt_bias", 0, 1, HVK);
        P(g_proj0, "attn.g_proj.0.weight", 1, 0, V, d);
        P(g_proj1, "attn.g_proj.1.weight", 1, 0, HVV, V);
        P(g_bias, "attn.g_proj.1.bias", 0, 0, HVV);
        P(o_norm, "attn.o_norm.weight", 0, 0, V);
        P(o_proj, "attn.o_proj.weight", 1, 0, d, HVV);
        P(mlp_norm, "mlp_norm.weight", 0, 0, d);
        P(gate_proj, "mlp.gate_proj.weight", 1, 0, I, d);
        P(up_proj, "mlp.up_proj.weight", 1, 0, I, d);
        P(down_proj, "mlp.down_proj.weight", 1, 0, d, I);
#undef P
    }
    DG_TRY(add_param(m, &m->final_norm, "model.norm.weight", SHAPE(d), 0, 0));
    if (c->tie)
        m->lm_head = m->embed;
    else
        DG_TRY(add_param(m, &m->lm_head, "lm_head.weight", SHAPE(c->vocab, d), 1, 0));
    return DG_OK;
}

dg_status dg_model_new(dg_ctx *ctx, const dg_model_config *cfg, dg_dtype param_dtype,
                       dg_dtype compute_dtype, dg_model **out) {
    if (!ctx || !cfg || !out)
        return dg__err(DG_ERR_ARG, "dg_model_new: ctx, cfg and out must not be NULL");
    *out = NULL;
    DG_TRY(dg_model_config_check(cfg));
    if (param_dtype != DG_F32 && param_dtype != DG_F64)
        return dg__err(DG_ERR_DTYPE, "dg_model_new: parameters must be f32 or f64, not %s",
                       dg_dtype_name(param_dtype));
    if (!dg_dtype_is_float(compute_dtype))
        return dg__err(DG_ERR_DTYPE, "dg_model_new: compute dtype must be f64, f32 or bf16");
    if (compute_dtype == DG_BF16 && dg_ctx_device(ctx).kind != DG_DEV_CUDA)
        return dg__err(DG_ERR_DTYPE, "dg_model_new: bf16 compute needs a CUDA device "
                                     "(use --dtype f32 on the CPU)");
    dg_model *m = calloc(1, sizeof *m);
    if (!m)
        return dg__err(DG_ERR_NOMEM, "dg_model_new: out of host memory");
    m->cfg = *cfg;
    m->ctx = ctx;
    m->param_dtype = param_dtype;
    m->compute_dtype = compute_dtype;
    m->params = calloc((size_t)(21 * cfg->n_layers + 4), sizeof *m->params);
    m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->params || !m->layers) {
        dg_model_free(&m);
        return dg__err(DG_ERR_NOMEM, "dg_model_new: out of host memory");
    }
    dg_status s = build_params(m);
    if (s != DG_OK) {
        dg_model_free(&m);
        return s;
    }
    *out = m;
    return DG_OK;
}

void dg_model_free(dg_model **mp) {
    if (!mp || !*mp)
        return;
    dg_model *m = *mp;
    for (int i = 0; i < m->n_params; i++)
        dg_tensor_free(&m->params[i].t);
    free(m->params);
    free(m->layers);
    free(m);
    *mp = NULL;
}

dg_param *dg_model_find(dg_model *m, const char *name) {
    for (int i = 0; m && name && i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name))
            return &m->params[i];
    return NULL;
}

int64_t dg_model_num_params(const dg_model *m) {
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++)
        n += dg_tensor_numel(m->params[i].t);
    return n;
}

/* splitmix64: one independent seed per parameter from the run seed. */
static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static dg_status fill_host(dg_tensor *t, const double *vals) {
    dg_tensor *tmp = NULL;
    DG_TRY(dg_tensor_from_f64(dg_tensor_ctx(t), dg_tensor_dtype(t), dg_tensor_ndim(t),
                              dg_tensor_shape(t), vals, &tmp));
    dg_status s = dg_tensor_copy_(t, tmp);
    dg_tensor_free(&tmp);
    return s;
}

dg_status dg_model_init(dg_model *m, uint64_t seed) {
    if (!m)
        return dg__err(DG_ERR_ARG, "dg_model_init: NULL model");
    for (int i = 0; i < m->n_params; i++) {
        dg_param *p = &m->params[i];
        uint64_t ps = mix64(seed ^ mix64((uint64_t)i + 1));
        const char *nm = p->name;
        size_t ln = strlen(nm);
        int64_t n = dg_tensor_numel(p->t);
        if (ln >= 5 && !strcmp(nm + ln - 5, "A_log")) {
            double *v = malloc((size_t)n * sizeof *v);
            if (!v)
                return dg__err(DG_ERR_NOMEM, "dg_model_init: out of host memory");
            for (int64_t j = 0; j < n; j++) /* safe gate: a = 1; plain gate: A ~ U(1,16) */
                v[j] =
                    m->cfg.gate == DG_GATE_LOWERBOUND ? 0.0 : log(1.0 + 15.0 * dg_rand_u01(ps, j));
            dg_status s = fill_host(p->t, v);
            free(v);
            DG_TRY(s);
        } else if (ln >= 7 && !strcmp(nm + ln - 7, "dt_bias")) {
            double *v = malloc((size_t)n * sizeof *v);
            if (!v)
                return dg__err(DG_ERR_NOMEM, "dg_model_init: out of host memory");
            for (int64_t j = 0; j < n; j++) {
                double lo = log(1e-3), hi = log(1e-1);
                double dt = exp(lo + dg_rand_u01(ps, j) * (hi - lo));
                if (dt < 1e-4)
                    dt = 1e-4;
                v[j] = dt + log(-expm1(-dt)); /* softplus^-1(dt) */
            }
            dg_status s = fill_host(p->t, v);
            free(v);
            DG_TRY(s);
        } else if (strstr(nm, "norm")) {
            DG_TRY(dg_tensor_fill_(p->t, 1.0));
        } else if (ln >= 4 && !strcmp(nm + ln - 4, "bias")) {
            DG_TRY(dg_tensor_fill_(p->t, 0.0));
        } else {
            DG_TRY(dg_tensor_rand_normal(p->t, ps, 0.0, m->cfg.init_std));
        }
    }
    return DG_OK;
}

/* ---- forward -------------------------------------------------------------------------------- */

/* Intermediates of one forward, freed together (the tape keeps what backward needs). */
typedef struct scratch {
    dg_tensor **t;
    int n, cap;
} scratch;

static dg_tensor *keep(scratch *s, dg_tensor *t) {
    if (s->n < s->cap)
        s->t[s->n++] = t;
    return t;
}

static void scratch_free(scratch *s) {
    for (int i = 0; i < s->n; i++)
        dg_tensor_free(&s->t[i]);
    s->n = 0;
}

/* Each op writes into a fresh local and is kept for freeing; on error jump to `fail`. */
#define RUN(expr)                                                                                  \
    do {                                                                                           \
        st = (expr);                                                                               \
        if (st != DG_OK)                                                                           \
            goto fail;                                                                             \
    } while (0)
#define NEWT(var, expr)                                                                            \
    do {                                                                                           \
        var = NULL;                                                                                \
        RUN(expr);                                                                                 \
        keep(sc, var);                                                                             \
    } while (0)

/* The short convolution of q, k or v with its SiLU: a [B,T,C] -> out [B,T,C]. With tail_in /
 * tail_out (state mode, B == 1, W > 1) the sequence continues after the W-1 inputs *tail_in
 * ([1,W-1,C], NULL: zeros, the sequence start), and *tail_out gets the last W-1 inputs of
 * tail_in ++ a. The conv runs over [tail_in ++ a] and drops the first W-1 rows, so every output
 * row sums exactly the terms of the full-sequence conv. */
static dg_status conv_silu(dg_model *m, dg_tensor *a, dg_tensor *w, dg_tensor *tail_in,
                           dg_tensor **tail_out, dg_tensor **out) {
    dg_ctx *ctx = m->ctx;
    if (m->cp_plan)
        return dg_short_conv_cp(ctx, m->cp_comm, m->cp_plan, a, w, NULL, DG_ACT_SILU, out);
    if (!tail_out || m->cfg.conv == 1)
        return dg_short_conv(ctx, a, w, NULL, DG_ACT_SILU, NULL, 0, out);
    const int64_t P = m->cfg.conv - 1, T = dg_tensor_dim(a, 1), C = dg_tensor_dim(a, 2);
    const dg_dtype dt = dg_tensor_dtype(a);
    dg_tensor *x = NULL, *dst = NULL, *y = NULL, *src = NULL, *tail = NULL;
    dg_status st = dg_tensor_zeros(ctx, dt, 3, (int64_t[]){1, P + T, C}, &x);
    if (st == DG_OK && tail_in)
        st = dg_slice(x, 1, 0, P, &dst);
    if (st == DG_OK && tail_in)
        st = dg_tensor_copy_(dst, tail_in);
    dg_tensor_free(&dst);
    if (st == DG_OK)
        st = dg_slice(x, 1, P, P + T, &dst);
    if (st == DG_OK)
        st = dg_tensor_copy_(dst, a);
    if (st == DG_OK)
        st = dg_short_conv(ctx, x, w, NULL, DG_ACT_SILU, NULL, 0, &y);
    if (st == DG_OK) /* [1,T,C] rows of a contiguous [1,P+T,C]: a contiguous view */
        st = dg_slice(y, 1, P, P + T, out);
    /* the new tail is copied out, so the state never pins this call's buffers */
    if (st == DG_OK)
        st = dg_slice(x, 1, T, T + P, &src);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, dt, 3, (int64_t[]){1, P, C}, &tail);
    if (st == DG_OK)
        st = dg_tensor_copy_(tail, src);
    if (st == DG_OK)
        *tail_out = tail, tail = NULL;
    else
        dg_tensor_free(out);
    dg_tensor_free(&tail);
    dg_tensor_free(&src);
    dg_tensor_free(&y);
    dg_tensor_free(&dst);
    dg_tensor_free(&x);
    return st;
}

/* The KDA layer's gate as its own tape nodes: gk [B,T,H,K] = the per-channel log decay the KDA
 * op forms inside from graw, A_log [H] and dt_bias [H*K] (ops/kda/gate_cumsum.c):
 *   lower bound:  gk = lb * sigmoid(exp(A_log) * (graw + dt_bias))    in (lb, 0)
 *   KDA:          gk = -exp(A_log) * softplus(graw + dt_bias)         < 0
 * A_log and dt_bias are cast to graw's dtype where they differ (they are kept in f32). */
static dg_status dplr_gate(dg_model *m, dg_tensor *const *W, const dg_layer_ix *L, dg_tensor *graw,
                           scratch *sc, dg_tensor **out) {
    const dg_model_config *c = &m->cfg;
    dg_ctx *ctx = m->ctx;
    dg_status st = DG_OK;
    const int64_t H = c->n_heads, K = c->head_k;
    const dg_dtype dt = dg_tensor_dtype(graw);
    dg_tensor *Al = W[L->A_log], *db = W[L->dt_bias], *A4, *d4, *A, *z, *u, *s, *res;
    if (dg_tensor_dtype(Al) != dt)
        NEWT(Al, dg_to_dtype(ctx, W[L->A_log], dt, &Al));
    if (dg_tensor_dtype(db) != dt)
        NEWT(db, dg_to_dtype(ctx, W[L->dt_bias], dt, &db));
    NEWT(A4, dg_reshape(Al, 2, (int64_t[]){H, 1}, &A4));
    NEWT(d4, dg_reshape(db, 2, (int64_t[]){H, K}, &d4));
    NEWT(A, dg_exp(ctx, A4, &A));
    NEWT(z, dg_add(ctx, graw, d4, &z));
    if (c->gate == DG_GATE_LOWERBOUND) {
        NEWT(u, dg_mul(ctx, z, A, &u));
        NEWT(s, dg_sigmoid(ctx, u, &s));
        res = NULL;
        RUN(dg_scale(ctx, s, c->lower_bound, &res));
    } else {
        NEWT(s, dg_softplus(ctx, z, &s));
        NEWT(u, dg_mul(ctx, s, A, &u));
        res = NULL;
        RUN(dg_scale(ctx, u, -1.0, &res));
    }
    *out = res;
    return DG_OK;
fail:
    return st;
}

/* The DPLR recurrence of the DPLR mixer in RWKV-7's form (docs/training.md, "The DPLR mixer"):
 *   qh, kh = l2norm(q), l2norm(k) per head;  alpha = sigmoid(braw) per head [B,T,H];
 *   a = -kh, b = alpha * kh, gk = dplr_gate(graw):
 *   S_t = (Diag(exp(gk_t)) - alpha_t kh_t kh_t^T) S_{t-1} + kh_t v_t^T,  o_t = K^-1/2 S_t^T qh_t
 * The transition is symmetric with eigenvalues in (-1, 1): the state never grows through it. */
static dg_status dplr_mix(dg_model *m, dg_tensor *const *W, const dg_layer_ix *L, dg_tensor *q,
                          dg_tensor *k, dg_tensor *v, dg_tensor *graw, dg_tensor *braw,
                          dg_tensor *h0, dg_tensor **ht, scratch *sc, dg_tensor **out) {
    const dg_model_config *c = &m->cfg;
    dg_ctx *ctx = m->ctx;
    dg_status st = DG_OK;
    const int64_t B = dg_tensor_dim(q, 0), T = dg_tensor_dim(q, 1), H = c->n_heads;
    dg_tensor *qh, *kh, *a, *al, *al4, *b, *gk, *o;
    NEWT(qh, dg_l2norm(ctx, q, 1e-6, &qh));
    NEWT(kh, dg_l2norm(ctx, k, 1e-6, &kh));
    NEWT(a, dg_scale(ctx, kh, -1.0, &a));
    NEWT(al, dg_sigmoid(ctx, braw, &al));
    NEWT(al4, dg_reshape(al, 4, (int64_t[]){B, T, H, 1}, &al4));
    NEWT(b, dg_mul(ctx, kh, al4, &b));
    NEWT(gk, dplr_gate(m, W, L, graw, sc, &gk));
    dg_dplr_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.chunk_size = c->chunk;
    opts.scale = 1.0 / sqrt((double)c->head_k);
    opts.output_final_state = ht != NULL;
    o = NULL;
    /* one token: the recurrence is the whole work (O(K V) per head) */
    if (m->recurrent_mixer || (ht && T == 1))
        RUN(dg_dplr_recurrent(ctx, qh, kh, v, a, b, gk, h0, &opts, &o, ht));
    else if (m->cp_plan) /* this rank's slice of the packed rows (no state mode under CP) */
        RUN(dg_dplr_chunk_cp(ctx, m->cp_comm, m->cp_plan, qh, kh, v, a, b, gk, NULL, &opts, &o,
                             NULL));
    else
        RUN(dg_dplr_chunk(ctx, qh, kh, v, a, b, gk, h0, &opts, &o, ht));
    *out = o;
    return DG_OK;
fail:
    return st;
}

/* The token mixer (training.md M1 for KDA; cfg.mixer picks KDA or DPLR, which differ only in the
 * recurrence between the input projections and the output gate). h: [B,T,d] -> out: [B,T,d]
 * (a new reference).
 * State mode (sin, sout not NULL; B == 1): sin[0..2] are the q, k, v conv tails and sin[3] the
 * mixer's state the sequence continues from (NULL: the sequence start); sout[0..3] get the new
 * ones. */
static dg_status mixer_layer(dg_model *m, dg_tensor *const *W, const dg_layer_ix *L, dg_tensor *h,
                             dg_tensor *const *sin, dg_tensor **sout, scratch *sc,
                             dg_tensor **out) {
    const dg_model_config *c = &m->cfg;
    dg_ctx *ctx = m->ctx;
    dg_status st = DG_OK;
    int64_t B = dg_tensor_dim(h, 0), T = dg_tensor_dim(h, 1);
    int64_t H = c->n_heads, HV = c->n_v_heads, K = c->head_k, V = c->head_v;
    dg_tensor *a, *wq, *wk, *wv, *qc, *kc, *vc, *q, *k, *v, *g1, *g2, *g, *beta, *o, *y, *z;
    dg_tensor *gp, *gb, *gate, *res;
    const int state = sin && sout;

    /* q, k, v = SiLU(conv(x W)) viewed per head */
    NEWT(wq, dg_reshape(W[L->q_conv], 2, (int64_t[]){H * K, c->conv}, &wq));
    NEWT(wk, dg_reshape(W[L->k_conv], 2, (int64_t[]){H * K, c->conv}, &wk));
    NEWT(wv, dg_reshape(W[L->v_conv], 2, (int64_t[]){HV * V, c->conv}, &wv));
    NEWT(a, dg_linear(ctx, h, W[L->q_proj], &a));
    NEWT(qc, conv_silu(m, a, wq, state ? sin[0] : NULL, state ? &sout[0] : NULL, &qc));
    NEWT(q, dg_reshape(qc, 4, (int64_t[]){B, T, H, K}, &q));
    NEWT(a, dg_linear(ctx, h, W[L->k_proj], &a));
    NEWT(kc, conv_silu(m, a, wk, state ? sin[1] : NULL, state ? &sout[1] : NULL, &kc));
    NEWT(k, dg_reshape(kc, 4, (int64_t[]){B, T, H, K}, &k));
    NEWT(a, dg_linear(ctx, h, W[L->v_proj], &a));
    NEWT(vc, conv_silu(m, a, wv, state ? sin[2] : NULL, state ? &sout[2] : NULL, &vc));
    NEWT(v, dg_reshape(vc, 4, (int64_t[]){B, T, HV, V}, &v));

    /* raw gate through the low-rank pair, raw beta (KDA) / alpha (DPLR) */
    NEWT(g1, dg_linear(ctx, h, W[L->f_proj0], &g1));
    NEWT(g2, dg_linear(ctx, g1, W[L->f_proj1], &g2));
    NEWT(g, dg_reshape(g2, 4, (int64_t[]){B, T, HV, K}, &g));
    NEWT(beta, dg_linear(ctx, h, W[L->b_proj], &beta));

    dg_tensor *h0 = state ? sin[3] : NULL, **ht = state ? &sout[3] : NULL;
    if (c->mixer == DG_MIXER_DPLR) {
        NEWT(o, dplr_mix(m, W, L, q, k, v, g, beta, h0, ht, sc, &o));
    } else {
        /* the op applies the gate, the sigmoid of beta and the l2norm of q and k */
        dg_kda_opts opts;
        memset(&opts, 0, sizeof opts);
        opts.chunk_size = c->chunk;
        opts.gate = c->gate;
        opts.lower_bound = c->lower_bound;
        opts.l2norm_qk = 1;
        opts.beta_sigmoid = 1;
        opts.scale = 1.0 / sqrt((double)K);
        opts.output_final_state = state;
        /* one token: the recurrence is the whole work (O(K V) per head) */
        if (m->recurrent_mixer || (state && T == 1))
            NEWT(o, dg_kda_recurrent(ctx, q, k, v, g, beta, W[L->A_log], W[L->dt_bias], h0, &opts,
                                     &o, ht));
        else if (m->cp_plan)
            NEWT(o, dg_kda_chunk_cp(ctx, m->cp_comm, m->cp_plan, q, k, v, g, beta, W[L->A_log],
                                    W[L->dt_bias], NULL, &opts, &o, NULL));
        else
            NEWT(o, dg_kda_chunk(ctx, q, k, v, g, beta, W[L->A_log], W[L->dt_bias], h0, &opts, &o,
                                 ht));
    }

    /* output gate, per-head gated RMSNorm, output projection */
    NEWT(a, dg_linear(ctx, h, W[L->g_proj0], &a));
    NEWT(gp, dg_linear(ctx, a, W[L->g_proj1], &gp));
    NEWT(gb, dg_add(ctx, gp, W[L->g_bias], &gb));
    NEWT(gate, dg_reshape(gb, 4, (int64_t[]){B, T, HV, V}, &gate));
    NEWT(y, dg_gated_rmsnorm(ctx, o, W[L->o_norm], gate, c->norm_eps, DG_ACT_SIGMOID, &y));
    NEWT(z, dg_reshape(y, 3, (int64_t[]){B, T, HV * V}, &z));
    res = NULL;
    RUN(dg_linear(ctx, z, W[L->o_proj], &res));
    *out = res;
    return DG_OK;
fail:
    return st;
}

/* SwiGLU MLP: h [B,T,d] -> [B,T,d] (a new reference). */
static dg_status mlp(dg_model *m, dg_tensor *const *W, const dg_layer_ix *L, dg_tensor *h,
                     scratch *sc, dg_tensor **out) {
    dg_ctx *ctx = m->ctx;
    dg_status st = DG_OK;
    dg_tensor *gt, *up, *res;
    NEWT(gt, dg_linear(ctx, h, W[L->gate_proj], &gt));
    NEWT(up, dg_linear(ctx, h, W[L->up_proj], &up));
    res = NULL; /* the down projection forms silu(gt) up again in backward (swiglu_linear) */
    RUN(dg_swiglu_linear(ctx, gt, up, W[L->down_proj], &res));
    *out = res;
    return DG_OK;
fail:
    return st;
}

/* W[i] = parameter i in the compute dtype (casts are tape nodes in grad mode, so gradients reach
 * the masters); A_log and dt_bias stay f32. On failure the entries set so far are freed. */
static dg_status cast_weights(dg_model *m, dg_tensor **W) {
    for (int i = 0; i < m->n_params; i++) {
        dg_param *p = &m->params[i];
        dg_status st = DG_OK;
        if (p->keep_f32 || dg_tensor_dtype(p->t) == m->compute_dtype)
            W[i] = dg_tensor_retain(p->t);
        else
            st = dg_to_dtype(m->ctx, p->t, m->compute_dtype, &W[i]);
        if (st != DG_OK) {
            for (int j = 0; j < i; j++)
                dg_tensor_free(&W[j]);
            return st;
        }
    }
    return DG_OK;
}

/* Embedding -> blocks -> final norm -> logits with the weights W. sin/sout: NULL, or the state
 * slots (4 per layer) the sequence continues from / the new ones (see mixer_layer). */
static dg_status model_run(dg_model *m, dg_tensor *const *W, dg_tensor *ids, dg_tensor *const *sin,
                           dg_tensor **sout, dg_tensor **logits) {
    const dg_model_config *c = &m->cfg;
    dg_ctx *ctx = m->ctx;
    dg_status st = DG_OK;
    int cap = 64;
    scratch scr = {calloc((size_t)cap, sizeof(dg_tensor *)), 0, cap}, *sc = &scr;
    dg_tensor *x = NULL, *h = NULL, *r = NULL, *x2 = NULL;
    if (!scr.t) {
        st = dg__err(DG_ERR_NOMEM, "dg_model_forward: out of host memory");
        goto fail;
    }
    /* Each residual add is fused with the norm that reads its result (dg_add_rmsnorm): the MLP's
     * pre-norm, the next layer's attention pre-norm, and after the last layer the final norm.
     * Only the first layer's attention pre-norm stands alone. h: the normed input of what comes
     * next; x: the residual stream. */
    RUN(dg_embedding(ctx, W[m->embed], ids, &x));
    RUN(dg_rmsnorm(ctx, x, W[m->layers[0].attn_norm], c->norm_eps, &h));
    for (int l = 0; l < c->n_layers; l++) {
        const dg_layer_ix *L = &m->layers[l];
        int next_norm = l + 1 < c->n_layers ? m->layers[l + 1].attn_norm : m->final_norm;
        RUN(mixer_layer(m, W, L, h, sin ? sin + 4 * l : NULL, sout ? sout + 4 * l : NULL, sc, &r));
        dg_tensor_free(&h);
        RUN(dg_add_rmsnorm(ctx, x, r, W[L->mlp_norm], c->norm_eps, &x2, &h));
        dg_tensor_free(&r);
        dg_tensor_free(&x);
        x = x2, x2 = NULL;
        RUN(mlp(m, W, L, h, sc, &r));
        dg_tensor_free(&h);
        RUN(dg_add_rmsnorm(ctx, x, r, W[next_norm], c->norm_eps, &x2, &h));
        dg_tensor_free(&r);
        dg_tensor_free(&x);
        x = x2, x2 = NULL;
        scratch_free(sc);
    }
    RUN(dg_linear(ctx, h, W[m->lm_head], logits));
fail:
    dg_tensor_free(&x);
    dg_tensor_free(&x2);
    dg_tensor_free(&h);
    dg_tensor_free(&r);
    scratch_free(sc);
    free(scr.t);
    return st;
}

dg_status dg_model_forward(dg_model *m, dg_tensor *ids, dg_tensor **logits) {
    if (!m || !ids || !logits)
        return dg__err(DG_ERR_ARG, "dg_model_forward: model, ids and logits must not be NULL");
    *logits = NULL;
    if (dg_tensor_ndim(ids) != 2)
        return dg__err(DG_ERR_SHAPE, "dg_model_forward: ids must be [B,T], got %s",
                       dg_tensor_desc(ids));
    dg_tensor **W = calloc((size_t)m->n_params, sizeof *W);
    if (!W)
        return dg__err(DG_ERR_NOMEM, "dg_model_forward: out of host memory");
    dg_status st = cast_weights(m, W);
    if (st == DG_OK) {
        st = model_run(m, W, ids, NULL, NULL, logits);
        for (int i = 0; i < m->n_params; i++)
            dg_tensor_free(&W[i]);
    }
    free(W);
    return st;
}

dg_status dg_model_loss(dg_model *m, dg_tensor *ids, dg_tensor *targets, dg_tensor **loss) {
    if (!m || !ids || !targets || !loss)
        return dg__err(DG_ERR_ARG, "dg_model_loss: NULL argument");
    *loss = NULL;
    dg_tensor *logits = NULL, *flat = NULL, *tflat = NULL;
    dg_status st = dg_model_forward(m, ids, &logits);
    int64_t n = dg_tensor_numel(ids);
    if (st == DG_OK)
        st = dg_reshape(logits, 2, (int64_t[]){n, m->cfg.vocab}, &flat);
    if (st == DG_OK)
        st = dg_reshape(targets, 1, (int64_t[]){n}, &tflat);
    if (st == DG_OK)
        st = dg_cross_entropy(m->ctx, flat, tflat, -1, loss);
    dg_tensor_free(&logits);
    dg_tensor_free(&flat);
    dg_tensor_free(&tflat);
    return st;
}

/* ---- decoding with a recurrent state -------------------------------------------------------- */

dg_status dg_model_state_new(dg_model *m, dg_model_state **out) {
    if (!m || !out)
        return dg__err(DG_ERR_ARG, "dg_model_state_new: model and out must not be NULL");
    *out = NULL;
    if (m->cp_plan)
        return dg__err(DG_ERR_STATE, "dg_model_state_new: the model is set up for context "
                                     "parallelism (cp_plan); decoding runs on one rank");
    dg_model_state *s = calloc(1, sizeof *s);
    if (s) {
        s->W = calloc((size_t)m->n_params, sizeof *s->W);
        s->slot = calloc((size_t)m->cfg.n_layers * 4, sizeof *s->slot);
    }
    if (!s || !s->W || !s->slot) {
        if (s)
            free(s->W), free(s->slot);
        free(s);
        return dg__err(DG_ERR_NOMEM, "dg_model_state_new: out of host memory");
    }
    s->m = m;
    dg_no_grad_begin(); /* plain copies: the state's weights are not on the tape */
    dg_status st = cast_weights(m, s->W);
    dg_no_grad_end();
    if (st != DG_OK) {
        free(s->W), free(s->slot), free(s);
        return st;
    }
    *out = s;
    return DG_OK;
}

void dg_model_state_reset(dg_model_state *s) {
    if (!s)
        return;
    for (int i = 0; i < 4 * s->m->cfg.n_layers; i++)
        dg_tensor_free(&s->slot[i]);
    s->n_tokens = 0;
}

void dg_model_state_free(dg_model_state **sp) {
    if (!sp || !*sp)
        return;
    dg_model_state *s = *sp;
    dg_model_state_reset(s);
    for (int i = 0; i < s->m->n_params; i++)
        dg_tensor_free(&s->W[i]);
    free(s->W), free(s->slot), free(s);
    *sp = NULL;
}

dg_status dg_model_forward_state(dg_model_state *s, dg_tensor *ids, dg_tensor **logits) {
    if (!s || !ids || !logits)
        return dg__err(DG_ERR_ARG,
                       "dg_model_forward_state: state, ids and logits must not be NULL");
    *logits = NULL;
    if (dg_tensor_ndim(ids) != 2 || dg_tensor_dim(ids, 0) != 1 || dg_tensor_dim(ids, 1) < 1)
        return dg__err(DG_ERR_SHAPE,
                       "dg_model_forward_state: ids must be [1,T] with T >= 1 (one sequence), "
                       "got %s",
                       dg_tensor_desc(ids));
    dg_model *m = s->m;
    if (m->cp_plan)
        return dg__err(DG_ERR_STATE, "dg_model_forward_state: the model is set up for context "
                                     "parallelism (cp_plan)");
    const int n = 4 * m->cfg.n_layers;
    dg_tensor **next = calloc((size_t)n, sizeof *next);
    if (!next)
        return dg__err(DG_ERR_NOMEM, "dg_model_forward_state: out of host memory");
    dg_no_grad_begin();
    dg_status st = model_run(m, s->W, ids, s->slot, next, logits);
    dg_no_grad_end();
    /* commit the new states only when every layer succeeded */
    for (int i = 0; i < n; i++) {
        if (st == DG_OK) {
            dg_tensor_free(&s->slot[i]);
            s->slot[i] = next[i];
        } else {
            dg_tensor_free(&next[i]);
        }
    }
    free(next);
    if (st == DG_OK)
        s->n_tokens += dg_tensor_dim(ids, 1);
    return st;
}

/* ---- sampling ------------------------------------------------------------------------------- */

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Pick a token from logits[0..n) with temperature and top-k, using u in [0,1). */
static int pick(const double *logits, int n, double temperature, int top_k, double u,
                double *work) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    if (temperature <= 0.0)
        return best;
    double cut = -INFINITY;
    if (top_k > 0 && top_k < n) {
        memcpy(work, logits, (size_t)n * sizeof *work);
        qsort(work, (size_t)n, sizeof *work, cmp_desc);
        cut = work[top_k - 1];
    }
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        work[i] = logits[i] >= cut ? exp((logits[i] - logits[best]) / temperature) : 0.0;
        total += work[i];
    }
    double target = u * total, acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += work[i];
        if (work[i] > 0.0 && acc > target)
            return i;
    }
    return best;
}

/* Feeds ids[0..n) to the state and copies the logits of the last one to host lv[vocab]. */
static dg_status feed(dg_model_state *s, const int32_t *ids, int n, double *lv) {
    dg_model *m = s->m;
    dg_tensor *tid = NULL, *logits = NULL, *last = NULL;
    dg_status st = dg_tensor_from_host(m->ctx, DG_I32, 2, (int64_t[]){1, n}, ids, &tid);
    if (st == DG_OK)
        st = dg_model_forward_state(s, tid, &logits);
    if (st == DG_OK)
        st = dg_slice(logits, 1, n - 1, n, &last);
    double *v = NULL;
    if (st == DG_OK)
        st = dg_tensor_to_f64(last, &v);
    if (st == DG_OK)
        memcpy(lv, v, (size_t)m->cfg.vocab * sizeof *lv);
    free(v);
    dg_tensor_free(&last);
    dg_tensor_free(&logits);
    dg_tensor_free(&tid);
    return st;
}

dg_status dg_model_generate(dg_model *m, const uint8_t *prompt, int n_prompt, int n_new,
                            double temperature, int top_k, uint64_t seed, uint8_t *out,
                            dg_byte_fn on_byte, void *user) {
    if (!m)
        return dg__err(DG_ERR_ARG, "dg_model_generate: model must not be NULL");
    if (!prompt || n_prompt < 1)
        return dg__err(DG_ERR_ARG,
                       "dg_model_generate: the prompt must hold at least one byte (got %d)",
                       n_prompt);
    if (n_new < 0)
        return dg__err(DG_ERR_ARG, "dg_model_generate: n_new must be >= 0 (got %d)", n_new);
    if (!(temperature >= 0.0) || !isfinite(temperature))
        return dg__err(DG_ERR_ARG,
                       "dg_model_generate: temperature must be finite and >= 0 (got %g)",
                       temperature);
    if (top_k < 0)
        return dg__err(DG_ERR_ARG, "dg_model_generate: top_k must be >= 0 (got %d)", top_k);
    if (n_new == 0)
        return DG_OK;
    const int V = m->cfg.vocab;
    int32_t *ids = malloc((size_t)n_prompt * sizeof *ids);
    double *lv = malloc((size_t)V * sizeof *lv), *work = malloc((size_t)V * sizeof *work);
    dg_model_state *s = NULL;
    dg_status st = DG_OK;
    if (!ids || !lv || !work)
        st = dg__err(DG_ERR_NOMEM, "dg_model_generate: out of host memory");
    if (st == DG_OK)
        st = dg_model_state_new(m, &s);
    /* the prompt in one forward (chunked KDA), then one token step per new byte */
    for (int i = 0; st == DG_OK && i < n_prompt; i++)
        ids[i] = prompt[i];
    if (st == DG_OK)
        st = feed(s, ids, n_prompt, lv);
    for (int i = 0; st == DG_OK && i < n_new; i++) {
        int32_t tok = pick(lv, V, temperature, top_k, dg_rand_u01(seed, (uint64_t)i), work);
        if (out)
            out[i] = (uint8_t)tok;
        if (on_byte)
            st = on_byte((uint8_t)tok, user);
        if (st == DG_OK && i + 1 < n_new)
            st = feed(s, &tok, 1, lv);
    }
    dg_model_state_free(&s);
    free(ids), free(lv), free(work);
    return st;
}

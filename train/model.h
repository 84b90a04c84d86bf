/*
 * train/model.h -- the byte-level KDA language model (training.md M1-M2) built from dg_ ops.
 *
 *   ids [B,T] -> Embed [B,T,d] -> L x Block -> RMSNorm -> logits [B,T,vocab]
 *   Block(x): x += mixer(RMSNorm(x));  x += SwiGLU_MLP(RMSNorm(x))
 *
 * The token mixer is the KDA layer (default) or the DPLR layer (cfg.mixer, `--mixer dplr`,
 * docs/training.md "The DPLR mixer"): the same projections, short convs, gate, output norm and
 * output projection, with the DPLR recurrence S_t = (Diag(exp(gk_t)) - alpha_t kh_t kh_t^T)
 * S_{t-1} + kh_t v_t^T in place of KDA's delta rule. Both have the parameter list below.
 *
 * Parameters live in one named list in FLA / PyTorch layout ([out,in] linear weights, [C,1,W]
 * conv weights), so a checkpoint's tensors load into the PyTorch model by name:
 *
 *   model.embeddings.weight                     [vocab, d]
 *   model.layers.{i}.attn_norm.weight           [d]
 *   model.layers.{i}.attn.{q,k}_proj.weight     [H*K, d]     v_proj: [HV*V, d]
 *   model.layers.{i}.attn.{q,k}_conv1d.weight   [H*K, 1, W]  v_conv1d: [HV*V, 1, W]
 *   model.layers.{i}.attn.f_proj.0.weight       [V, d]       f_proj.1: [HV*K, V]
 *   model.layers.{i}.attn.b_proj.weight         [HV, d]
 *   model.layers.{i}.attn.A_log                 [HV]   f32   (no weight decay)
 *   model.layers.{i}.attn.dt_bias               [HV*K] f32   (no weight decay)
 *   model.layers.{i}.attn.g_proj.0.weight       [V, d]       g_proj.1: weight [HV*V, V], bias
 * [HV*V] model.layers.{i}.attn.o_norm.weight         [V] model.layers.{i}.attn.o_proj.weight [d,
 * HV*V] model.layers.{i}.mlp_norm.weight            [d] model.layers.{i}.mlp.{gate,up}_proj.weight
 * [I, d]       down_proj: [d, I] model.norm.weight                           [d] lm_head.weight
 * [vocab, d]   (absent when tied to the embedding)
 *
 * Parameters are kept in `param_dtype` (f32 master weights; f64 for tests). Each forward casts
 * them to `compute_dtype` with dg_to_dtype (differentiable, so gradients land in the masters);
 * A_log and dt_bias always stay f32, as the KDA op wants them.
 */
#ifndef DG_TRAIN_MODEL_H
#define DG_TRAIN_MODEL_H

#include "deltagrad.h"

#include <stddef.h>
#include <stdint.h>

/* Upper bounds of the config's sizes (flags and checkpoint configs alike). */
#define DG_MODEL_MAX_DIM 65536
#define DG_MODEL_MAX_LAYERS 256
#define DG_MODEL_MAX_HEAD_K 256

/* The token mixer of every block. */
typedef enum dg_mixer_kind {
    DG_MIXER_KDA = 0, /* Kimi Delta Attention (training.md M1) */
    DG_MIXER_DPLR,    /* the DPLR delta rule in RWKV-7's form (CPU only for now) */
} dg_mixer_kind;

/* "kda" / "dplr" (NULL for a value outside the enum). */
const char *dg_mixer_name(dg_mixer_kind k);
/* "kda" or "dplr" -> *out; DG_ERR_ARG naming the text otherwise. */
dg_status dg_mixer_parse(const char *s, dg_mixer_kind *out);

typedef struct dg_model_config {
    int vocab; /* 256: raw bytes */
    int d;     /* hidden size */
    int n_layers;
    int n_heads;        /* H: q/k heads */
    int n_v_heads;      /* HV: value heads, HV % H == 0 */
    int head_k;         /* K */
    int head_v;         /* V (= K * expand_v) */
    int inter;          /* I: SwiGLU width */
    int conv;           /* short conv width W */
    int chunk;          /* BT of the chunked KDA op: 16, 32 or 64 */
    dg_gate_kind gate;  /* DG_GATE_LOWERBOUND (default) or DG_GATE_KDA */
    double lower_bound; /* lb for the lower-bound gate */
    double norm_eps;
    int tie;         /* tie the LM head to the embedding */
    double init_std; /* 0.02 */
    /* KDA (0, the default) or DPLR. DPLR has one value head per key head (HV == H). JSON key
     * "mixer"; a config without it (checkpoints written before the key existed) is KDA. */
    dg_mixer_kind mixer;
} dg_model_config;

/* Presets: "cpu" (training.md M3's toy, tuned for a few CPU minutes), "gpu" (~21M parameters),
 * "bench" (training.md M3 exactly: 28,132,896 parameters). */
dg_status dg_model_config_preset(const char *name, dg_model_config *out);
/* Checks the config's internal consistency; the message names the offending field. */
dg_status dg_model_config_check(const dg_model_config *c);
/* A one-line JSON object holding every field (for checkpoint metadata). */
dg_status dg_model_config_to_json(const dg_model_config *c, char *buf, size_t n);
/* The config as a `config.json` of the reference's model (flash-linear-attention's KDAConfig
 * keys: model_type, hidden_size, num_hidden_layers, num_heads, num_v_heads, head_dim, expand_v,
 * intermediate_size, use_short_conv, conv_size, safe_gate, lower_bound, norm_eps, vocab_size,
 * tie_word_embeddings, ...), with deltagrad's own keys under "deltagrad" (mixer, chunk_size,
 * gate). Indented JSON text, newline-terminated. The DPLR mixer has no reference model: its
 * model_type is "deltagrad_dplr" and "architectures" is empty. */
dg_status dg_model_config_to_ref_json(const dg_model_config *c, char *buf, size_t n);
dg_status dg_model_config_from_json(const char *json, dg_model_config *out);
/* Number of scalar parameters a model with this config has. */
int64_t dg_model_config_num_params(const dg_model_config *c);

typedef struct dg_param {
    char name[80];
    dg_tensor *t; /* the master weight, requires grad */
    int decay;    /* weight decay applies (matrices and embeddings only) */
    int keep_f32; /* never cast to the compute dtype (A_log, dt_bias) */
} dg_param;

/* Indices into dg_model.params for one block. */
typedef struct dg_layer_ix {
    int attn_norm, q_proj, k_proj, v_proj, q_conv, k_conv, v_conv, f_proj0, f_proj1, b_proj, A_log,
        dt_bias, g_proj0, g_proj1, g_bias, o_norm, o_proj, mlp_norm, gate_proj, up_proj, down_proj;
} dg_layer_ix;

typedef struct dg_model {
    dg_model_config cfg;
    dg_ctx *ctx;
    dg_dtype param_dtype;   /* f32 (or f64 for tests) */
    dg_dtype compute_dtype; /* f32, bf16 (CUDA) or f64 */
    int n_params;
    dg_param *params;
    int embed, final_norm, lm_head; /* lm_head == embed when tied */
    dg_layer_ix *layers;
    /* use the token-by-token recurrence (dg_kda_recurrent / dg_dplr_recurrent) instead of the
     * chunked op (tests: same logits) */
    int recurrent_mixer;
    /* Context parallelism (set by the training loop, not owned): when cp_plan is not NULL the
     * forward takes this rank's slice [1, T_r] of the packed sequences and runs the short convs
     * and KDA through dg_short_conv_cp / dg_kda_chunk_cp over cp_comm. */
    dg_comm *cp_comm;
    const dg_cp_plan *cp_plan;
} dg_model;

/* A model with allocated (uninitialised) parameters that require grad. For the DPLR mixer it
 * first runs the chunked DPLR op once on a few zeros of the compute dtype on ctx's device
 * (without grad): an op that refuses the device or dtype (DPLR on CUDA before its kernels exist:
 * DG_ERR_UNSUPPORTED) fails here with the op's reason, before any training step. */
dg_status dg_model_new(dg_ctx *ctx, const dg_model_config *cfg, dg_dtype param_dtype,
                       dg_dtype compute_dtype, dg_model **out);
void dg_model_free(dg_model **m);
/* FLA's init: weights N(0, init_std), biases 0, norms 1, A_log = 0 (lower-bound gate) or
 * log U(1,16) (KDA gate), dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]. Counter
 * based: the same seed gives the same weights on every device. */
dg_status dg_model_init(dg_model *m, uint64_t seed);
/* The parameter called `name`, or NULL. */
dg_param *dg_model_find(dg_model *m, const char *name);
int64_t dg_model_num_params(const dg_model *m);

/* logits [B,T,vocab] (compute dtype) for ids [B,T] i32/i64 on the model's device. Records on
 * the tape when grad mode is on. */
dg_status dg_model_forward(dg_model *m, dg_tensor *ids, dg_tensor **logits);
/* Mean next-token cross entropy: position t of `ids` predicts targets[t]. Output [1] f32/f64. */
dg_status dg_model_loss(dg_model *m, dg_tensor *ids, dg_tensor *targets, dg_tensor **loss);

/* ---- decoding with a recurrent state ----------------------------------------------------------
 *
 * A mixer's view of the past is finite: the last W-1 inputs of each of its three short
 * convolutions (q, k, v, before the conv) and its state S [HV,K,V]. dg_model_state holds them
 * for one sequence (batch 1), so a sequence can be fed in pieces, each piece costing only its own
 * tokens: the prompt in one chunked forward, then one token at a time (the recurrence), with
 * the same logits as dg_model_forward over the whole sequence up to rounding. */
typedef struct dg_model_state {
    dg_model *m;
    /* the weights in the compute dtype (A_log, dt_bias f32), taken at dg_model_state_new: after
     * changing the parameters make a new state */
    dg_tensor **W;
    /* per layer l, slots 4l..4l+3: the q, k, v conv tails [1, W-1, C] (compute dtype; NULL when
     * W == 1) and the mixer's state [1, HV, K, V] (KDA on CUDA: f32; else the compute dtype).
     * NULL before the first token: the zero history of a sequence start. */
    dg_tensor **slot;
    int64_t n_tokens; /* tokens fed since the start */
} dg_model_state;

/* A fresh state (the start of a sequence) for model m, which it borrows. Fails for a model set
 * up for context parallelism (cp_plan). */
dg_status dg_model_state_new(dg_model *m, dg_model_state **out);
/* Back to the start of a sequence (the weights are kept). */
void dg_model_state_reset(dg_model_state *s);
void dg_model_state_free(dg_model_state **s);
/* Continues the sequence held by s with ids [1,T] (i32/i64, T >= 1, on the model's device):
 * logits [1,T,vocab] (compute dtype), and s moves past the T tokens. Runs without grad (nothing
 * is recorded on the tape whatever the grad mode). T == 1 takes the token-by-token recurrence;
 * longer pieces the chunked op starting from the state. On failure s is left unchanged. */
dg_status dg_model_forward_state(dg_model_state *s, dg_tensor *ids, dg_tensor **logits);

/* Called with each generated byte as soon as it is chosen; a status other than DG_OK stops the
 * generation and is returned by dg_model_generate. */
typedef dg_status (*dg_byte_fn)(uint8_t byte, void *user);

/* Autoregressive sampling without grad: continues `prompt` (n_prompt >= 1 bytes) by n_new bytes.
 * The prompt goes through one chunked forward, then each new byte costs one token step
 * (dg_model_forward_state). Byte i is drawn from softmax(logits / temperature) restricted to
 * the top_k most likely bytes with uniform number dg_rand_u01(seed, i); temperature 0 is greedy,
 * top_k 0 keeps every byte. out (n_new bytes) and on_byte may each be NULL. */
dg_status dg_model_generate(dg_model *m, const uint8_t *prompt, int n_prompt, int n_new,
                            double temperature, int top_k, uint64_t seed, uint8_t *out,
                            dg_byte_fn on_byte, void *user);

#endif /* DG_TRAIN_MODEL_H */

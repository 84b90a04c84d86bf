/*
 * train/checkpoint.c -- saving and loading training checkpoints (format in checkpoint.h).
 */
#define _POSIX_C_SOURCE 200809L
#define _XOPEN_SOURCE 700 /* realpath */
#include "train/checkpoint.h"
#include "tensor/tensor.h"

#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* ---- metadata ------------------------------------------------------------------------------- */

#define META_MAX 48

typedef struct meta {
    int n;
    char keys[META_MAX][40];
    char vals[META_MAX][DG_PATH_MAX + 16];
} meta;

static void meta_put(meta *md, const char *key, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static void meta_put(meta *md, const char *key, const char *fmt, ...) {
    if (md->n >= META_MAX)
        return;
    snprintf(md->keys[md->n], sizeof md->keys[0], "%s", key);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(md->vals[md->n], sizeof md->vals[0], fmt, ap);
    va_end(ap);
    md->n++;
}

/* ---- checksums and finiteness --------------------------------------------------------------- */

static uint64_t fnv1a64(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* Host bytes of t into *buf (grown as needed); the count of NaN/Inf values into *bad. */
static dg_status host_bytes(const dg_tensor *t, void **buf, size_t *cap, size_t *n, int64_t *bad) {
    dg_dtype dt = dg_tensor_dtype(t);
    int64_t numel = dg_tensor_numel(t);
    *n = (size_t)numel * dg_dtype_size(dt);
    if (*n > *cap) {
        void *nb = realloc(*buf, *n);
        if (!nb)
            return dg__err(DG_ERR_NOMEM, "checkpoint: out of host memory for %zu bytes", *n);
        *buf = nb;
        *cap = *n;
    }
    DG_TRY(dg_tensor_to_host(t, *buf, *n ? *n : 1));
    *bad = 0;
    for (int64_t i = 0; i < numel && dg_dtype_is_float(dt); i++) {
        double v = dt == DG_F64   ? ((const double *)*buf)[i]
                   : dt == DG_F32 ? ((const float *)*buf)[i]
                                  : dg__bf16_to_f32(((const uint16_t *)*buf)[i]);
        *bad += !isfinite(v);
    }
    return DG_OK;
}

/* The "checksums" metadata value: "fnv1a64" then " <name>=<16 hex digits>" per tensor, over the
 * tensor's bytes. Refuses (DG_ERR_NUMERIC) any tensor holding NaN or Inf. */
static dg_status ckpt_checksums(const char *path, int n, const char *const *names,
                                const dg_tensor *const *ts, char **out) {
    size_t len = 8;
    for (int i = 0; i < n; i++)
        len += strlen(names[i]) + 18;
    char *txt = malloc(len + 1);
    if (!txt)
        return dg__err(DG_ERR_NOMEM, "dg_ckpt_save: out of host memory");
    size_t at = (size_t)snprintf(txt, len + 1, "fnv1a64");
    void *buf = NULL;
    size_t cap = 0, nb = 0;
    dg_status s = DG_OK;
    for (int i = 0; i < n && s == DG_OK; i++) {
        int64_t bad = 0;
        s = host_bytes(ts[i], &buf, &cap, &nb, &bad);
        if (s == DG_OK && bad)
            s = dg__err(DG_ERR_NUMERIC,
                        "dg_ckpt_save: tensor '%s' holds %lld non-finite values (NaN/Inf): the "
                        "checkpoint is not written and '%s' keeps its previous contents",
                        names[i], (long long)bad, path);
        if (s == DG_OK)
            at += (size_t)snprintf(txt + at, len + 1 - at, " %s=%016llx", names[i],
                                   (unsigned long long)fnv1a64(buf, nb));
    }
    free(buf);
    if (s != DG_OK) {
        free(txt);
        return s;
    }
    *out = txt;
    return DG_OK;
}

/* The recorded checksum of `name` in a "checksums" value; 0 if it is not listed. */
static int find_checksum(const char *sums, const char *name, uint64_t *h) {
    size_t nl = strlen(name);
    for (const char *p = strchr(sums, ' '); p; p = strchr(p + 1, ' ')) {
        if (strncmp(p + 1, name, nl) != 0 || p[1 + nl] != '=')
            continue;
        const char *hex = p + 2 + nl;
        char *end;
        if (strspn(hex, "0123456789abcdef") < 16)
            return 0;
        errno = 0;
        unsigned long long v = strtoull(hex, &end, 16);
        if (errno || end != hex + 16 || (*end && *end != ' '))
            return 0;
        *h = v;
        return 1;
    }
    return 0;
}

/* Every tensor's bytes against the "checksums" metadata (checkpoints written before checksums
 * were recorded carry none and are accepted as they are). */
static dg_status verify_checksums(const dg_ckpt *c) {
    const char *sums = dg_safetensors_meta(&c->st, "checksums");
    if (!sums)
        return DG_OK;
    if (strncmp(sums, "fnv1a64", 7) != 0 || (sums[7] && sums[7] != ' '))
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': unknown checksum kind in '%.32s'", c->path,
                       sums);
    int listed = 0;
    for (const char *p = strchr(sums, ' '); p; p = strchr(p + 1, ' '))
        listed++;
    if (listed != c->st.n)
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s': the file holds %d tensors but checksums for %d", c->path,
                       c->st.n, listed);
    void *buf = NULL;
    size_t cap = 0, nb = 0;
    dg_status s = DG_OK;
    for (int i = 0; i < c->st.n && s == DG_OK; i++) {
        uint64_t want = 0;
        int64_t bad = 0;
        if (!find_checksum(sums, c->st.names[i], &want)) {
            s = dg__err(DG_ERR_FORMAT, "checkpoint '%s': tensor '%s' has no recorded checksum",
                        c->path, c->st.names[i]);
            break;
        }
        s = host_bytes(c->st.tensors[i], &buf, &cap, &nb, &bad);
        if (s == DG_OK && fnv1a64(buf, nb) != want)
            s = dg__err(DG_ERR_FORMAT,
                        "checkpoint '%s': tensor '%s' is corrupted: its data does not match the "
                        "recorded checksum (%016llx)",
                        c->path, c->st.names[i], (unsigned long long)want);
    }
    free(buf);
    return s;
}

/* Refuses tensors holding NaN / Inf (weights that would only produce garbage). */
static dg_status check_finite(const dg_ckpt *c, const char *name, const dg_tensor *t) {
    void *buf = NULL;
    size_t cap = 0, nb = 0;
    int64_t bad = 0;
    dg_status s = host_bytes(t, &buf, &cap, &nb, &bad);
    free(buf);
    DG_TRY(s);
    if (bad)
        return dg__err(DG_ERR_NUMERIC,
                       "checkpoint '%s': tensor '%s' holds %lld non-finite values (NaN/Inf): "
                       "refusing to use these weights",
                       c->path, name, (long long)bad);
    return DG_OK;
}

/* ---- paths in the metadata ------------------------------------------------------------------ */

/* The directory part of path ("." when it has none) into buf. */
static void dir_of(const char *path, char *buf, size_t n) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(buf, n, ".");
    else if (slash == path)
        snprintf(buf, n, "/");
    else
        snprintf(buf, n, "%.*s", (int)(slash - path), path);
}

/* The data file as the checkpoint stores it (format 2): relative to the checkpoint's directory,
 * so that no absolute path is written and a run directory moved together with its text still
 * resumes; the file's base name when either path cannot be resolved. */
static void data_path_for_ckpt(const char *ckpt, const char *data, char *buf, size_t n) {
    const char *base = strrchr(data, '/') ? strrchr(data, '/') + 1 : data;
    snprintf(buf, n, "%s", base);
    char dir[DG_PATH_MAX];
    dir_of(ckpt, dir, sizeof dir);
    char *rd = realpath(dir, NULL), *rf = data[0] ? realpath(data, NULL) : NULL;
    if (rd && rf) {
        /* the longest common run of whole components, then one ".." per remaining one of dir */
        size_t i = 0, common = 0;
        while (rd[i] && rd[i] == rf[i]) {
            if (rd[i] == '/')
                common = i;
            i++;
        }
        if (!rd[i] && rf[i] == '/')
            common = i;
        else if (!rd[i] && !rf[i])
            common = i;
        if (!strcmp(rd, "/"))
            common = 0;
        size_t len = 0;
        buf[0] = 0;
        for (const char *p = rd + common; *p; p++)
            if (*p == '/' && len + 4 < n)
                len += (size_t)snprintf(buf + len, n - len, "../");
        const char *rest = rf + common + (rf[common] == '/');
        if (len + strlen(rest) + 1 < n)
            snprintf(buf + len, n - len, "%s", rest);
        else
            snprintf(buf, n, "%s", base);
    }
    free(rd);
    free(rf);
}

/* The data path of a format-2 checkpoint as a path usable from here: relative ones are relative
 * to the checkpoint's directory. */
static void data_path_from_ckpt(const char *ckpt, const char *stored, char *buf, size_t n) {
    if (!stored[0] || stored[0] == '/') {
        snprintf(buf, n, "%s", stored);
        return;
    }
    char dir[DG_PATH_MAX];
    dir_of(ckpt, dir, sizeof dir);
    if (!strcmp(dir, "."))
        snprintf(buf, n, "%s", stored);
    else if (snprintf(buf, n, "%s/%s", dir, stored) >= (int)n)
        snprintf(buf, n, "%s", stored); /* too long to join: as stored */
}

dg_status dg_ckpt_save(const char *path, const dg_model *m, dg_tensor *const *adam_m,
                       dg_tensor *const *adam_v, const dg_train_opts *o, const dg_train_state *s) {
    if (!path || !m || !o || !s)
        return dg__err(DG_ERR_ARG, "dg_ckpt_save: path, model, opts and state must not be NULL");
    int np = m->n_params, with_optim = adam_m && adam_v;
    int n = np * (with_optim ? 3 : 1);
    const char **names = calloc((size_t)n, sizeof *names);
    const dg_tensor **ts = calloc((size_t)n, sizeof *ts);
    char(*onames)[96] = calloc((size_t)(2 * np), sizeof *onames);
    meta *md = calloc(1, sizeof *md);
    char *cfg = malloc(4096);
    if (!names || !ts || !onames || !md || !cfg) {
        free(names), free(ts), free(onames), free(md), free(cfg);
        return dg__err(DG_ERR_NOMEM, "dg_ckpt_save: out of host memory");
    }
    int k = 0;
    for (int i = 0; i < np; i++) {
        names[k] = m->params[i].name;
        ts[k++] = m->params[i].t;
    }
    for (int i = 0; with_optim && i < np; i++) {
        snprintf(onames[2 * i], sizeof onames[0], "optim.m.%s", m->params[i].name);
        snprintf(onames[2 * i + 1], sizeof onames[0], "optim.v.%s", m->params[i].name);
        names[k] = onames[2 * i];
        ts[k++] = adam_m[i];
        names[k] = onames[2 * i + 1];
        ts[k++] = adam_v[i];
    }
    char *sums = NULL;
    dg_status st = dg_model_config_to_json(&m->cfg, cfg, 4096);
    if (st == DG_OK)
        st = ckpt_checksums(path, k, names, ts, &sums);
    if (st == DG_OK) {
        meta_put(md, "format", "%s", DG_CKPT_FORMAT);
        meta_put(md, "config", "%s", cfg);
        if (dg_model_config_to_ref_json(&m->cfg, cfg, 4096) == DG_OK)
            meta_put(md, "config.json", "%s", cfg);
        meta_put(md, "step", "%lld", (long long)s->step);
        meta_put(md, "data_counter", "%llu", (unsigned long long)s->data_counter);
        meta_put(md, "data.hash", "%016llx", (unsigned long long)s->data_hash);
        meta_put(md, "data.bytes", "%lld", (long long)s->data_bytes);
        char rel[DG_PATH_MAX];
        data_path_for_ckpt(path, o->data_path, rel, sizeof rel);
        meta_put(md, "data.path", "%s", rel);
        meta_put(md, "train.config_name", "%s", o->config_name);
        meta_put(md, "train.steps", "%lld", (long long)o->steps);
        meta_put(md, "train.batch", "%d", o->batch);
        meta_put(md, "train.seq_len", "%d", o->seq_len);
        meta_put(md, "train.accum", "%d", o->accum);
        meta_put(md, "train.lr", "%.17g", o->lr);
        meta_put(md, "train.min_lr_frac", "%.17g", o->min_lr_frac);
        meta_put(md, "train.warmup", "%lld", (long long)o->warmup);
        meta_put(md, "train.beta1", "%.17g", o->beta1);
        meta_put(md, "train.beta2", "%.17g", o->beta2);
        meta_put(md, "train.adam_eps", "%.17g", o->adam_eps);
        meta_put(md, "train.weight_decay", "%.17g", o->weight_decay);
        meta_put(md, "train.clip", "%.17g", o->clip);
        meta_put(md, "train.seed", "%llu", (unsigned long long)o->seed);
        meta_put(md, "train.eval_batches", "%d", o->eval_batches);
        meta_put(md, "train.max_data_bytes", "%lld", (long long)o->max_data_bytes);
        meta_put(md, "train.param_dtype", "%s", dg_dtype_name(m->param_dtype));
        meta_put(md, "train.compute_dtype", "%s", dg_dtype_name(m->compute_dtype));
        const char *mk[META_MAX + 1], *mv[META_MAX + 1];
        for (int i = 0; i < md->n; i++)
            mk[i] = md->keys[i], mv[i] = md->vals[i];
        mk[md->n] = "checksums";
        mv[md->n] = sums;
        st = dg_safetensors_save(path, k, names, ts, md->n + 1, mk, mv);
    }
    free(names), free(ts), free(onames), free(md), free(cfg), free(sums);
    return st;
}

/* ---- loading -------------------------------------------------------------------------------- */

static dg_status meta_str(const dg_ckpt *c, const char *key, const char **out) {
    const char *v = dg_safetensors_meta(&c->st, key);
    if (!v)
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': metadata key '%s' is missing", c->path,
                       key);
    *out = v;
    return DG_OK;
}

static dg_status meta_i64(const dg_ckpt *c, const char *key, int64_t lo, int64_t hi, int64_t *out) {
    const char *v = NULL;
    DG_TRY(meta_str(c, key, &v));
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi)
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s': metadata '%s' = '%.40s' is not a count in [%lld, %lld]",
                       c->path, key, v, (long long)lo, (long long)hi);
    *out = x;
    return DG_OK;
}

static dg_status meta_int(const dg_ckpt *c, const char *key, int lo, int hi, int *out) {
    int64_t x = 0;
    DG_TRY(meta_i64(c, key, lo, hi, &x));
    *out = (int)x;
    return DG_OK;
}

static dg_status meta_u64(const dg_ckpt *c, const char *key, int base, uint64_t *out) {
    const char *v = NULL;
    DG_TRY(meta_str(c, key, &v));
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, base);
    if (end == v || *end || errno || !isxdigit((unsigned char)v[0]))
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': metadata '%s' = '%s' is not a number",
                       c->path, key, v);
    *out = x;
    return DG_OK;
}

static dg_status meta_f64(const dg_ckpt *c, const char *key, double *out) {
    const char *v = NULL;
    DG_TRY(meta_str(c, key, &v));
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x))
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': metadata '%s' = '%s' is not a number",
                       c->path, key, v);
    *out = x;
    return DG_OK;
}

static dg_status parse_meta(dg_ckpt *c) {
    const char *fmt = NULL;
    if (!dg_safetensors_meta(&c->st, "format"))
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s': no 'format' in the safetensors metadata: this is not a "
                       "deltagrad checkpoint",
                       c->path);
    DG_TRY(meta_str(c, "format", &fmt));
    if (!strcmp(fmt, DG_CKPT_FORMAT))
        c->format = 2;
    else if (!strcmp(fmt, DG_CKPT_FORMAT_1))
        c->format = 1;
    else
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s': format '%s' is not '%s' (nor the older "
                       "'%s')",
                       c->path, fmt, DG_CKPT_FORMAT, DG_CKPT_FORMAT_1);
    const char *cfg = NULL;
    DG_TRY(meta_str(c, "config", &cfg));
    dg_status s = dg_model_config_from_json(cfg, &c->cfg);
    if (s != DG_OK)
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': bad model config: %s", c->path,
                       dg_last_error());
    dg_train_opts *o = &c->opts;
    DG_TRY(dg_train_opts_default("cpu", o));
    o->model = c->cfg;
    int64_t step;
    DG_TRY(meta_i64(c, "step", 0, DG_TRAIN_MAX_STEPS, &step));
    c->state.step = step;
    DG_TRY(meta_u64(c, "data_counter", 10, &c->state.data_counter));
    /* windows drawn: at most steps x accum x batch, kept far from wrapping */
    if (c->state.data_counter > ((uint64_t)1 << 62))
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s': metadata 'data_counter' = %llu is too large", c->path,
                       (unsigned long long)c->state.data_counter);
    DG_TRY(meta_u64(c, "data.hash", 16, &c->state.data_hash));
    DG_TRY(meta_i64(c, "data.bytes", 0, INT64_MAX, &c->state.data_bytes));
    const char *dp = NULL, *cn = NULL;
    DG_TRY(meta_str(c, "data.path", &dp));
    if (c->format >= 2)
        data_path_from_ckpt(c->path, dp, o->data_path, sizeof o->data_path);
    else /* format 1 stored the path as given on the command line */
        snprintf(o->data_path, sizeof o->data_path, "%s", dp);
    DG_TRY(meta_str(c, "train.config_name", &cn));
    snprintf(o->config_name, sizeof o->config_name, "%s", cn);
    DG_TRY(meta_i64(c, "train.steps", 1, DG_TRAIN_MAX_STEPS, &o->steps));
    DG_TRY(meta_int(c, "train.batch", 1, DG_TRAIN_MAX_BATCH, &o->batch));
    DG_TRY(meta_int(c, "train.seq_len", 2, DG_TRAIN_MAX_SEQ_LEN, &o->seq_len));
    DG_TRY(meta_int(c, "train.accum", 1, DG_TRAIN_MAX_ACCUM, &o->accum));
    DG_TRY(meta_f64(c, "train.lr", &o->lr));
    DG_TRY(meta_f64(c, "train.min_lr_frac", &o->min_lr_frac));
    DG_TRY(meta_i64(c, "train.warmup", 0, DG_TRAIN_MAX_STEPS, &o->warmup));
    DG_TRY(meta_f64(c, "train.beta1", &o->beta1));
    DG_TRY(meta_f64(c, "train.beta2", &o->beta2));
    DG_TRY(meta_f64(c, "train.adam_eps", &o->adam_eps));
    DG_TRY(meta_f64(c, "train.weight_decay", &o->weight_decay));
    DG_TRY(meta_f64(c, "train.clip", &o->clip));
    DG_TRY(meta_u64(c, "train.seed", 10, &o->seed));
    DG_TRY(meta_int(c, "train.eval_batches", 1, DG_TRAIN_MAX_EVAL_BATCHES, &o->eval_batches));
    DG_TRY(meta_i64(c, "train.max_data_bytes", 0, INT64_MAX, &o->max_data_bytes));
    const char *pd = NULL, *cd = NULL;
    DG_TRY(meta_str(c, "train.param_dtype", &pd));
    DG_TRY(meta_str(c, "train.compute_dtype", &cd));
    if (dg_dtype_parse(pd, &o->param_dtype) != DG_OK ||
        (o->param_dtype != DG_F32 && o->param_dtype != DG_F64))
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': train.param_dtype '%s' is not f32/f64",
                       c->path, pd);
    if (dg_dtype_parse(cd, &o->compute_dtype) != DG_OK || !dg_dtype_is_float(o->compute_dtype))
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': train.compute_dtype '%s' is not a float",
                       c->path, cd);
    dg_clear_error();
    return DG_OK;
}

dg_status dg_ckpt_load(dg_ctx *ctx, const char *path, dg_ckpt *out) {
    if (!ctx || !path || !out)
        return dg__err(DG_ERR_ARG, "dg_ckpt_load: ctx, path and out must not be NULL");
    memset(out, 0, sizeof *out);
    snprintf(out->path, sizeof out->path, "%s", path);
    dg_status s = dg_safetensors_load(ctx, path, &out->st);
    if (s != DG_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", dg_last_error());
        return dg__err(s, "cannot load checkpoint '%s': %s", path, msg);
    }
    s = parse_meta(out);
    if (s == DG_OK)
        s = verify_checksums(out);
    if (s == DG_OK) {
        /* the moments are all there or all absent */
        int nm = 0;
        for (int i = 0; i < out->st.n; i++)
            nm += !strncmp(out->st.names[i], "optim.", 6);
        out->has_optim = nm > 0;
    }
    if (s != DG_OK)
        dg_ckpt_free(out);
    return s;
}

void dg_ckpt_free(dg_ckpt *c) {
    if (!c)
        return;
    dg_safetensors_free(&c->st);
    memset(c, 0, sizeof *c);
}

static dg_status copy_named(const dg_ckpt *c, const char *name, dg_tensor *dst) {
    dg_tensor *src = dg_safetensors_get(&c->st, name);
    if (!src)
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': tensor '%s' is missing", c->path, name);
    int ok = dg_tensor_ndim(src) == dg_tensor_ndim(dst);
    for (int i = 0; ok && i < dg_tensor_ndim(dst); i++)
        ok = dg_tensor_shape(src)[i] == dg_tensor_shape(dst)[i];
    if (!ok) {
        char want[96];
        snprintf(want, sizeof want, "%s", dg_tensor_desc(dst));
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': tensor '%s' is %s, the model needs %s",
                       c->path, name, dg_tensor_desc(src), want);
    }
    if (dg_tensor_dtype(src) != dg_tensor_dtype(dst))
        return dg__err(DG_ERR_FORMAT, "checkpoint '%s': tensor '%s' is %s, expected %s", c->path,
                       name, dg_dtype_name(dg_tensor_dtype(src)),
                       dg_dtype_name(dg_tensor_dtype(dst)));
    return dg_tensor_copy_(dst, src);
}

dg_status dg_ckpt_restore_model(const dg_ckpt *c, dg_model *m) {
    if (!c || !m)
        return dg__err(DG_ERR_ARG, "dg_ckpt_restore_model: NULL argument");
    /* the two mixers have the same parameter names and shapes: only the config tells them apart */
    if (c->cfg.mixer != m->cfg.mixer)
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s' holds a model with the %s mixer, but this model uses the "
                       "%s mixer (--mixer %s): their parameters have the same names and shapes "
                       "but not the same meaning",
                       c->path, dg_mixer_name(c->cfg.mixer), dg_mixer_name(m->cfg.mixer),
                       dg_mixer_name(m->cfg.mixer));
    for (int i = 0; i < m->n_params; i++) {
        DG_TRY(copy_named(c, m->params[i].name, m->params[i].t));
        DG_TRY(check_finite(c, m->params[i].name, m->params[i].t));
    }
    return DG_OK;
}

dg_status dg_ckpt_restore_optim(const dg_ckpt *c, const dg_model *m, dg_tensor *const *adam_m,
                                dg_tensor *const *adam_v) {
    if (!c || !m || !adam_m || !adam_v)
        return dg__err(DG_ERR_ARG, "dg_ckpt_restore_optim: NULL argument");
    if (!c->has_optim)
        return dg__err(DG_ERR_FORMAT,
                       "checkpoint '%s' holds weights only (no optim.* tensors): cannot resume "
                       "training from it",
                       c->path);
    char name[128];
    for (int i = 0; i < m->n_params; i++) {
        snprintf(name, sizeof name, "optim.m.%s", m->params[i].name);
        DG_TRY(copy_named(c, name, adam_m[i]));
        snprintf(name, sizeof name, "optim.v.%s", m->params[i].name);
        DG_TRY(copy_named(c, name, adam_v[i]));
    }
    return DG_OK;
}

void dg_ckpt_latest_path(const char *dir, char *buf, size_t n) {
    snprintf(buf, n, "%s/%s", dir, DG_CKPT_LATEST);
}

int dg_ckpt_clean_temps(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int removed = 0;
    struct dirent *e;
    char path[DG_PATH_MAX + 256];
    while ((e = readdir(d)) != NULL) {
        const char *nm = e->d_name, *tmp = strstr(nm, ".safetensors.tmp.");
        if (strncmp(nm, "ckpt_", 5) != 0 || !tmp)
            continue;
        /* the temp name ends in the writer's pid: leave files of live writers alone */
        char *end;
        long pid = strtol(tmp + strlen(".safetensors.tmp."), &end, 10);
        if (*end == 0 && pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM) &&
            pid != (long)getpid())
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, nm);
        if (remove(path) == 0)
            removed++;
    }
    closedir(d);
    return removed;
}

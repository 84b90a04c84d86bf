/*
 * tensor/safetensors.c -- safetensors files: dg_safetensors_save / _load / _free / _get / _meta.
 *
 * Layout: an 8-byte little-endian header length N, N bytes of JSON, then the data section.
 *     {"__metadata__": {"k": "v", ...},
 *      "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
 * Offsets are bytes relative to the start of the data section; data is raw little-endian, C order.
 * dtypes: F64 F32 BF16 I32 I64 (the safetensors names of our five dtypes); others are refused.
 *
 * The header is read and validated by the strict parser in safetensors_header.c before any
 * tensor data is touched. Loading keeps the header's order; gaps between tensors are allowed,
 * overlaps are not. Saving packs tensors in the given order and writes atomically.
 */
#define _POSIX_C_SOURCE 200809L

#include "tensor/safetensors.h"

static const char *const OP_LOAD = "dg_safetensors_load";
static const char *const OP_SAVE = "dg_safetensors_save";

/* =============================================================================================
 * Load
 * ============================================================================================= */

static dg_status load_open(dg_ctx *ctx, const char *path, FILE *f, uint64_t size, dg__st_header *h,
                           dg_safetensors *out) {
    if (size == 0)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': file is empty", OP_LOAD, path);
    if (size < 8)
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': file is too short (%llu bytes) for the 8-byte header length",
                       OP_LOAD, path, (unsigned long long)size);
    unsigned char pre[8];
    DG_TRY(dg__read_at(OP_LOAD, path, f, 0, pre, 8, "the header length"));
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--)
        hlen = hlen << 8 | pre[k];
    if (hlen == 0)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': header length is 0", OP_LOAD, path);
    if (hlen > DG__ST_MAX_HEADER)
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': header length %llu exceeds the 100 MB limit (corrupt file?)",
                       OP_LOAD, path, (unsigned long long)hlen);
    if (hlen > size - 8)
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': header length %llu is larger than the rest of the file (%llu "
                       "bytes): truncated header",
                       OP_LOAD, path, (unsigned long long)hlen, (unsigned long long)(size - 8));

    char *text = (char *)DG_MALLOC((size_t)hlen);
    if (!text)
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for a %llu byte header", OP_LOAD,
                       (unsigned long long)hlen);
    uint64_t data_start = 8 + hlen, data_len = size - data_start;
    dg_status s = dg__read_at(OP_LOAD, path, f, 8, text, (size_t)hlen, "the JSON header");
    if (s == DG_OK)
        s = dg__st_header_parse(path, text, (size_t)hlen, data_len, h);
    DG_FREE(text);
    DG_TRY(s);

    size_t nmax = (size_t)(h->n > 0 ? h->n : 1);
    out->names = (char **)DG_CALLOC(nmax, sizeof(char *));
    out->tensors = (dg_tensor **)DG_CALLOC(nmax, sizeof(dg_tensor *));
    if (!out->names || !out->tensors)
        return dg__err(DG_ERR_NOMEM, "%s: out of memory", OP_LOAD);
    uint64_t maxb = 1;
    for (int i = 0; i < h->n; i++)
        if (h->e[i].end - h->e[i].begin > maxb)
            maxb = h->e[i].end - h->e[i].begin;
    void *buf = DG_MALLOC((size_t)maxb);
    if (!buf)
        return dg__err(DG_ERR_NOMEM, "%s: '%s': out of memory for %llu bytes", OP_LOAD, path,
                       (unsigned long long)maxb);
    for (int i = 0; i < h->n && s == DG_OK; i++) {
        dg__st_entry *e = &h->e[i];
        uint64_t nb = e->end - e->begin;
        s = dg__read_at(OP_LOAD, path, f, data_start + e->begin, buf, (size_t)nb, e->name);
        if (s != DG_OK)
            break;
        size_t es = dg_dtype_size(e->dtype);
        dg__le_convert(buf, (size_t)nb / es, es);
        int ndim = e->ndim;
        int64_t one = 1;
        s = dg_tensor_from_host(ctx, e->dtype, ndim ? ndim : 1, ndim ? e->shape : &one, buf,
                                &out->tensors[i]);
        if (s != DG_OK) {
            char why[256]; /* dg__err overwrites the buffer dg_last_error() points to */
            snprintf(why, sizeof why, "%s", dg_last_error());
            s = dg__err(s, "%s: '%s': tensor '%s': %s", OP_LOAD, path, e->name, why);
            break;
        }
        out->names[i] = e->name; /* ownership moves to out */
        e->name = NULL;
        out->n = i + 1;
    }
    DG_FREE(buf);
    DG_TRY(s);
    out->n_meta = h->nm;
    out->meta_keys = h->mk;
    out->meta_values = h->mv;
    h->mk = h->mv = NULL;
    h->nm = h->mcap = 0;
    return DG_OK;
}

dg_status dg_safetensors_load(dg_ctx *ctx, const char *path, dg_safetensors *out) {
    DG_TRY(dg__check_ptr(OP_LOAD, "out", out));
    memset(out, 0, sizeof *out);
    DG_TRY(dg__check_ptr(OP_LOAD, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP_LOAD, "path", path));
    FILE *f;
    uint64_t size;
    DG_TRY(dg__open_read(OP_LOAD, path, &f, &size));
    dg__st_header h = {0};
    dg_status s = load_open(ctx, path, f, size, &h, out);
    fclose(f);
    dg__st_header_free(&h);
    if (s != DG_OK)
        dg_safetensors_free(out);
    return s;
}

void dg_safetensors_free(dg_safetensors *st) {
    if (!st)
        return;
    for (int i = 0; i < st->n; i++) {
        if (st->names)
            DG_FREE(st->names[i]);
        if (st->tensors)
            dg_tensor_free(&st->tensors[i]);
    }
    for (int i = 0; i < st->n_meta; i++) {
        DG_FREE(st->meta_keys[i]);
        DG_FREE(st->meta_values[i]);
    }
    DG_FREE(st->names);
    DG_FREE(st->tensors);
    DG_FREE(st->meta_keys);
    DG_FREE(st->meta_values);
    memset(st, 0, sizeof *st);
}

dg_tensor *dg_safetensors_get(const dg_safetensors *st, const char *name) {
    if (!st || !name)
        return NULL;
    for (int i = 0; i < st->n; i++)
        if (st->names[i] && strcmp(st->names[i], name) == 0)
            return st->tensors[i];
    return NULL;
}

const char *dg_safetensors_meta(const dg_safetensors *st, const char *key) {
    if (!st || !key)
        return NULL;
    for (int i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta_keys[i], key) == 0)
            return st->meta_values[i];
    return NULL;
}

/* =============================================================================================
 * Save
 * ============================================================================================= */

/* A JSON string literal. Bytes >= 0x80 pass through (names are taken to be UTF-8). */
static void json_str(dg__sbuf *b, const char *s) {
    dg__sb_put(b, "\"", 1);
    for (const char *p = s; *p; p++) {
        unsigned char ch = (unsigned char)*p;
        switch (ch) {
        case '"':
            dg__sb_puts(b, "\\\"");
            break;
        case '\\':
            dg__sb_puts(b, "\\\\");
            break;
        case '\n':
            dg__sb_puts(b, "\\n");
            break;
        case '\r':
            dg__sb_puts(b, "\\r");
            break;
        case '\t':
            dg__sb_puts(b, "\\t");
            break;
        case '\b':
            dg__sb_puts(b, "\\b");
            break;
        case '\f':
            dg__sb_puts(b, "\\f");
            break;
        default:
            if (ch < 0x20)
                dg__sb_printf(b, "\\u%04x", ch);
            else
                dg__sb_put(b, p, 1);
        }
    }
    dg__sb_put(b, "\"", 1);
}

static dg_status check_save_args(const char *path, int n, const char *const *names,
                                 const dg_tensor *const *tensors, int n_meta,
                                 const char *const *meta_keys, const char *const *meta_values) {
    DG_TRY(dg__check_ptr(OP_SAVE, "path", path));
    if (n < 0)
        return dg__err(DG_ERR_ARG, "%s: n must be >= 0, got %d", OP_SAVE, n);
    if (n_meta < 0)
        return dg__err(DG_ERR_ARG, "%s: n_meta must be >= 0, got %d", OP_SAVE, n_meta);
    if (n > 0) {
        DG_TRY(dg__check_ptr(OP_SAVE, "names", names));
        DG_TRY(dg__check_ptr(OP_SAVE, "tensors", tensors));
    }
    if (n_meta > 0) {
        DG_TRY(dg__check_ptr(OP_SAVE, "meta_keys", meta_keys));
        DG_TRY(dg__check_ptr(OP_SAVE, "meta_values", meta_values));
    }
    for (int i = 0; i < n; i++) {
        if (!names[i])
            return dg__err(DG_ERR_ARG, "%s: names[%d] is NULL", OP_SAVE, i);
        if (!tensors[i])
            return dg__err(DG_ERR_ARG, "%s: tensors[%d] ('%s') is NULL", OP_SAVE, i, names[i]);
        if (strcmp(names[i], "__metadata__") == 0)
            return dg__err(DG_ERR_ARG, "%s: names[%d]: \"__metadata__\" is reserved", OP_SAVE, i);
        dg_dtype dt = dg_tensor_dtype(tensors[i]);
        if ((int)dt < 0 || dt >= DG_NDTYPES)
            return dg__err(DG_ERR_DTYPE, "%s: tensors[%d] ('%s') has an unknown dtype %d", OP_SAVE,
                           i, names[i], (int)dt);
        for (int j = 0; j < i; j++)
            if (strcmp(names[j], names[i]) == 0)
                return dg__err(DG_ERR_ARG, "%s: names[%d] and names[%d] are both '%s'", OP_SAVE, j,
                               i, names[i]);
    }
    for (int i = 0; i < n_meta; i++) {
        if (!meta_keys[i] || !meta_values[i])
            return dg__err(DG_ERR_ARG, "%s: meta_%s[%d] is NULL", OP_SAVE,
                           meta_keys[i] ? "values" : "keys", i);
        for (int j = 0; j < i; j++)
            if (strcmp(meta_keys[j], meta_keys[i]) == 0)
                return dg__err(DG_ERR_ARG, "%s: meta_keys[%d] and meta_keys[%d] are both '%s'",
                               OP_SAVE, j, i, meta_keys[i]);
    }
    return DG_OK;
}

dg_status dg_safetensors_save(const char *path, int n, const char *const *names,
                              const dg_tensor *const *tensors, int n_meta,
                              const char *const *meta_keys, const char *const *meta_values) {
    DG_TRY(check_save_args(path, n, names, tensors, n_meta, meta_keys, meta_values));

    /* The header, with tensors packed in the given order. */
    dg__sbuf hb = {0};
    dg__sb_put(&hb, "{", 1);
    if (n_meta > 0) {
        dg__sb_puts(&hb, "\"__metadata__\":{");
        for (int i = 0; i < n_meta; i++) {
            if (i)
                dg__sb_put(&hb, ",", 1);
            json_str(&hb, meta_keys[i]);
            dg__sb_put(&hb, ":", 1);
            json_str(&hb, meta_values[i]);
        }
        dg__sb_put(&hb, "}", 1);
    }
    uint64_t off = 0;
    size_t maxb = 1;
    for (int i = 0; i < n; i++) {
        const dg_tensor *t = tensors[i];
        size_t nb = (size_t)dg_tensor_numel(t) * dg_dtype_size(dg_tensor_dtype(t));
        if (nb > maxb)
            maxb = nb;
        if (i || n_meta > 0)
            dg__sb_put(&hb, ",", 1);
        json_str(&hb, names[i]);
        dg__sb_printf(&hb, ":{\"dtype\":\"%s\",\"shape\":[",
                      dg__st_dtype_names[dg_tensor_dtype(t)]);
        const int64_t *shape = dg_tensor_shape(t);
        for (int d = 0; d < dg_tensor_ndim(t); d++)
            dg__sb_printf(&hb, d ? ",%lld" : "%lld", (long long)shape[d]);
        dg__sb_printf(&hb, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                      (unsigned long long)(off + nb));
        off += nb;
    }
    dg__sb_put(&hb, "}", 1);
    /* Pad with spaces so the data section starts 8-byte aligned. */
    while ((8 + hb.len) % 8 != 0)
        dg__sb_put(&hb, " ", 1);
    if (hb.oom) {
        dg__sb_free(&hb);
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for the header", OP_SAVE);
    }
    if ((uint64_t)hb.len > DG__ST_MAX_HEADER) {
        size_t len = hb.len;
        dg__sb_free(&hb);
        return dg__err(DG_ERR_ARG, "%s: the header would be %zu bytes, over the 100 MB limit",
                       OP_SAVE, len);
    }

    unsigned char pre[8];
    for (int k = 0; k < 8; k++)
        pre[k] = (unsigned char)((uint64_t)hb.len >> (8 * k));
    void *buf = DG_MALLOC(maxb);
    if (!buf) {
        dg__sb_free(&hb);
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for %zu bytes", OP_SAVE, maxb);
    }
    dg__awriter w;
    dg_status s = dg__aw_open(OP_SAVE, path, &w);
    if (s == DG_OK)
        s = dg__aw_write(&w, pre, sizeof pre);
    if (s == DG_OK)
        s = dg__aw_write(&w, hb.s, hb.len);
    for (int i = 0; i < n && s == DG_OK; i++) {
        const dg_tensor *t = tensors[i];
        size_t es = dg_dtype_size(dg_tensor_dtype(t));
        size_t numel = (size_t)dg_tensor_numel(t);
        s = dg_tensor_to_host(t, buf, numel * es);
        if (s != DG_OK) {
            char why[256]; /* dg__err overwrites the buffer dg_last_error() points to */
            snprintf(why, sizeof why, "%s", dg_last_error());
            s = dg__err(s, "%s: tensor '%s': %s", OP_SAVE, names[i], why);
            dg__aw_abort(&w);
            break;
        }
        dg__le_convert(buf, numel, es);
        s = dg__aw_write(&w, buf, numel * es);
    }
    if (s == DG_OK)
        s = dg__aw_commit(&w);
    DG_FREE(buf);
    dg__sb_free(&hb);
    return s;
}

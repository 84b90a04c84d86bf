/*
 * tensor/safetensors_header.c -- the strict reader of the safetensors JSON header.
 *
 *     {"__metadata__": {"k": "v", ...},
 *      "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
 *
 * Deliberately minimal: it accepts exactly that schema (no unknown keys, integers only where
 * integers belong, strings with the JSON escapes incl. \uXXXX and surrogate pairs, decoded to
 * UTF-8) and nothing else. No recursion, no allocation sized by anything but the header bytes
 * themselves, and validation of every offset against the data section before any tensor is
 * read, so a corrupt or hostile header yields an error naming the problem.
 */
#define _POSIX_C_SOURCE 200809L

#include "tensor/safetensors.h"

static const char *const OP_LOAD = "dg_safetensors_load";

const char *const dg__st_dtype_names[DG_NDTYPES] = {"F64", "F32", "BF16", "I32", "I64"};

void dg__st_header_free(dg__st_header *h) {
    for (int i = 0; i < h->n; i++)
        DG_FREE(h->e[i].name);
    for (int i = 0; i < h->nm; i++) {
        DG_FREE(h->mk[i]);
        DG_FREE(h->mv[i]);
    }
    DG_FREE(h->e);
    DG_FREE(h->mk);
    DG_FREE(h->mv);
    memset(h, 0, sizeof *h);
}

/* =============================================================================================
 * JSON reading
 * ============================================================================================= */

typedef struct jcur {
    const char *s;
    size_t n, i;
    const char *path;
} jcur;

/* Header bytes start at file offset 8. */
static dg_status jbad(const jcur *c, const char *what) {
    return dg__err(DG_ERR_FORMAT, "%s: '%s': bad JSON header at byte %zu: %s", OP_LOAD, c->path,
                   c->i + 8, what);
}

static void jws(jcur *c) {
    while (c->i < c->n &&
           (c->s[c->i] == ' ' || c->s[c->i] == '\t' || c->s[c->i] == '\n' || c->s[c->i] == '\r'))
        c->i++;
}

/* Skip whitespace; if the next character is ch, consume it and return 1. */
static int jaccept(jcur *c, char ch) {
    jws(c);
    if (c->i < c->n && c->s[c->i] == ch) {
        c->i++;
        return 1;
    }
    return 0;
}

static dg_status jexpect(jcur *c, char ch, const char *what) {
    if (!jaccept(c, ch))
        return jbad(c, what);
    return DG_OK;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

/* Four hex digits at c->i (just after "\u"). */
static dg_status hex4(jcur *c, uint32_t *v) {
    if (c->n - c->i < 4)
        return jbad(c, "truncated \\u escape");
    uint32_t x = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(c->s[c->i + (size_t)k]);
        if (h < 0)
            return jbad(c, "bad hex digit in a \\u escape");
        x = x << 4 | (uint32_t)h;
    }
    c->i += 4;
    *v = x;
    return DG_OK;
}

static void put_utf8(dg__sbuf *b, uint32_t cp) {
    char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xc0 | cp >> 6);
        u[1] = (char)(0x80 | (cp & 0x3f));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xe0 | cp >> 12);
        u[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        u[2] = (char)(0x80 | (cp & 0x3f));
        n = 3;
    } else {
        u[0] = (char)(0xf0 | cp >> 18);
        u[1] = (char)(0x80 | (cp >> 12 & 0x3f));
        u[2] = (char)(0x80 | (cp >> 6 & 0x3f));
        u[3] = (char)(0x80 | (cp & 0x3f));
        n = 4;
    }
    dg__sb_put(b, u, n);
}

/* One escape sequence; c->i is just past the backslash. */
static dg_status jescape(jcur *c, dg__sbuf *b) {
    if (c->i >= c->n)
        return jbad(c, "unterminated string");
    char e = c->s[c->i++];
    char lit;
    switch (e) {
    case '"':
        lit = '"';
        break;
    case '\\':
        lit = '\\';
        break;
    case '/':
        lit = '/';
        break;
    case 'b':
        lit = '\b';
        break;
    case 'f':
        lit = '\f';
        break;
    case 'n':
        lit = '\n';
        break;
    case 'r':
        lit = '\r';
        break;
    case 't':
        lit = '\t';
        break;
    case 'u': {
        uint32_t cp;
        DG_TRY(hex4(c, &cp));
        if (cp >= 0xdc00 && cp <= 0xdfff)
            return jbad(c, "unpaired low surrogate in a \\u escape");
        if (cp >= 0xd800 && cp <= 0xdbff) {
            uint32_t lo;
            if (c->n - c->i < 2 || c->s[c->i] != '\\' || c->s[c->i + 1] != 'u')
                return jbad(c, "unpaired high surrogate in a \\u escape");
            c->i += 2;
            DG_TRY(hex4(c, &lo));
            if (lo < 0xdc00 || lo > 0xdfff)
                return jbad(c, "high surrogate not followed by a low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        if (cp == 0)
            return jbad(c, "\\u0000 (NUL) is not allowed in names");
        put_utf8(b, cp);
        return DG_OK;
    }
    default:
        c->i--;
        return jbad(c, "invalid escape sequence in a string");
    }
    dg__sb_put(b, &lit, 1);
    return DG_OK;
}

/* A JSON string, decoded into a fresh NUL-terminated buffer (*out, caller frees). */
static dg_status jstring(jcur *c, char **out, const char *what) {
    *out = NULL;
    jws(c);
    if (c->i >= c->n || c->s[c->i] != '"')
        return jbad(c, what);
    c->i++;
    dg__sbuf b = {0};
    dg__sb_put(&b, "", 0);
    dg_status s = DG_OK;
    for (;;) {
        if (c->i >= c->n) {
            s = jbad(c, "unterminated string");
            break;
        }
        unsigned char ch = (unsigned char)c->s[c->i];
        if (ch == '"') {
            c->i++;
            break;
        }
        if (ch < 0x20) {
            s = jbad(c, "raw control character inside a string");
            break;
        }
        if (ch == '\\') {
            c->i++;
            s = jescape(c, &b);
            if (s != DG_OK)
                break;
            continue;
        }
        /* Copy a run of plain bytes at once. */
        size_t j = c->i;
        while (j < c->n && c->s[j] != '"' && c->s[j] != '\\' && (unsigned char)c->s[j] >= 0x20)
            j++;
        dg__sb_put(&b, c->s + c->i, j - c->i);
        c->i = j;
    }
    if (s == DG_OK && b.oom)
        s = dg__err(DG_ERR_NOMEM, "%s: out of memory while reading the header", OP_LOAD);
    if (s != DG_OK) {
        dg__sb_free(&b);
        return s;
    }
    *out = b.s;
    return DG_OK;
}

/* A JSON number that must be an integer (no fraction, no exponent), in int64 range. */
static dg_status jint(jcur *c, int64_t *v, const char *what) {
    jws(c);
    int neg = 0;
    if (c->i < c->n && c->s[c->i] == '-') {
        neg = 1;
        c->i++;
    }
    if (c->i >= c->n || c->s[c->i] < '0' || c->s[c->i] > '9')
        return jbad(c, what);
    if (c->s[c->i] == '0' && c->i + 1 < c->n && c->s[c->i + 1] >= '0' && c->s[c->i + 1] <= '9')
        return jbad(c, "leading zeros are not allowed in JSON numbers");
    uint64_t x = 0;
    while (c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9') {
        uint64_t d = (uint64_t)(c->s[c->i] - '0');
        if (x > ((uint64_t)INT64_MAX - d) / 10)
            return jbad(c, "integer overflows int64");
        x = x * 10 + d;
        c->i++;
    }
    if (c->i < c->n && (c->s[c->i] == '.' || c->s[c->i] == 'e' || c->s[c->i] == 'E'))
        return jbad(c, "expected an integer, found a fraction or exponent");
    *v = neg ? -(int64_t)x : (int64_t)x;
    return DG_OK;
}

static dg_status parse_dtype(const jcur *c, const char *tname, const char *s, dg_dtype *dt) {
    for (int k = 0; k < DG_NDTYPES; k++)
        if (strcmp(s, dg__st_dtype_names[k]) == 0) {
            *dt = (dg_dtype)k;
            return DG_OK;
        }
    return dg__err(DG_ERR_DTYPE,
                   "%s: '%s': tensor '%s' has dtype \"%s\", which is not supported (F64, F32, "
                   "BF16, I32, I64 are)",
                   OP_LOAD, c->path, tname, s);
}

/* '[' [int (',' int)*] ']' */
static dg_status parse_shape(jcur *c, dg__st_entry *e) {
    DG_TRY(jexpect(c, '[', "expected '[' to start \"shape\""));
    int nd = 0;
    if (!jaccept(c, ']')) {
        for (;;) {
            int64_t d;
            DG_TRY(jint(c, &d, "expected an integer in \"shape\""));
            if (d < 0)
                return dg__err(DG_ERR_FORMAT,
                               "%s: '%s': tensor '%s' has a negative dimension (%lld) in its shape",
                               OP_LOAD, c->path, e->name, (long long)d);
            if (nd >= DG_MAX_DIMS)
                return dg__err(DG_ERR_SHAPE,
                               "%s: '%s': tensor '%s' has more than DG_MAX_DIMS (%d) dimensions",
                               OP_LOAD, c->path, e->name, DG_MAX_DIMS);
            e->shape[nd++] = d;
            if (jaccept(c, ']'))
                break;
            DG_TRY(jexpect(c, ',', "expected ',' or ']' in \"shape\""));
        }
    }
    e->ndim = nd;
    return DG_OK;
}

static dg_status parse_offsets(jcur *c, dg__st_entry *e) {
    int64_t b, en;
    DG_TRY(jexpect(c, '[', "expected '[' to start \"data_offsets\""));
    DG_TRY(jint(c, &b, "expected an integer in \"data_offsets\""));
    DG_TRY(jexpect(c, ',', "\"data_offsets\" must hold exactly two integers"));
    DG_TRY(jint(c, &en, "expected an integer in \"data_offsets\""));
    DG_TRY(jexpect(c, ']', "\"data_offsets\" must hold exactly two integers"));
    if (b < 0 || en < b)
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': tensor '%s' has invalid data_offsets [%lld, %lld] (need 0 <= "
                       "begin <= end)",
                       OP_LOAD, c->path, e->name, (long long)b, (long long)en);
    e->begin = (uint64_t)b;
    e->end = (uint64_t)en;
    return DG_OK;
}

/* {"dtype": ..., "shape": ..., "data_offsets": ...}, each key exactly once. */
static dg_status parse_entry(jcur *c, dg__st_entry *e) {
    int have_dtype = 0, have_shape = 0, have_off = 0;
    DG_TRY(jexpect(c, '{', "expected '{' to start a tensor entry"));
    if (!jaccept(c, '}')) {
        for (;;) {
            char *key;
            DG_TRY(jstring(c, &key, "expected a key string in a tensor entry"));
            dg_status s = jexpect(c, ':', "expected ':' after a key");
            int *seen = NULL;
            if (s == DG_OK) {
                if (strcmp(key, "dtype") == 0) {
                    seen = &have_dtype;
                } else if (strcmp(key, "shape") == 0) {
                    seen = &have_shape;
                } else if (strcmp(key, "data_offsets") == 0) {
                    seen = &have_off;
                } else {
                    s = dg__err(DG_ERR_FORMAT, "%s: '%s': tensor '%s' has an unknown key \"%s\"",
                                OP_LOAD, c->path, e->name, key);
                }
            }
            if (s == DG_OK && (*seen)++)
                s = dg__err(DG_ERR_FORMAT, "%s: '%s': tensor '%s' repeats the key \"%s\"", OP_LOAD,
                            c->path, e->name, key);
            if (s == DG_OK) {
                if (seen == &have_dtype) {
                    char *ds;
                    s = jstring(c, &ds, "expected a string for \"dtype\"");
                    if (s == DG_OK) {
                        s = parse_dtype(c, e->name, ds, &e->dtype);
                        DG_FREE(ds);
                    }
                } else if (seen == &have_shape) {
                    s = parse_shape(c, e);
                } else {
                    s = parse_offsets(c, e);
                }
            }
            DG_FREE(key);
            DG_TRY(s);
            if (jaccept(c, '}'))
                break;
            DG_TRY(jexpect(c, ',', "expected ',' or '}' in a tensor entry"));
        }
    }
    if (!have_dtype || !have_shape || !have_off)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': tensor '%s' lacks \"%s\"", OP_LOAD, c->path,
                       e->name,
                       !have_dtype   ? "dtype"
                       : !have_shape ? "shape"
                                     : "data_offsets");
    return DG_OK;
}

static dg_status parse_meta(jcur *c, dg__st_header *h) {
    if (h->seen_meta++)
        return jbad(c, "duplicate \"__metadata__\"");
    DG_TRY(jexpect(c, '{', "\"__metadata__\" must be an object of strings"));
    if (jaccept(c, '}'))
        return DG_OK;
    for (;;) {
        char *k = NULL, *v = NULL;
        DG_TRY(jstring(c, &k, "expected a key string in \"__metadata__\""));
        dg_status s = jexpect(c, ':', "expected ':' after a key");
        if (s == DG_OK)
            s = jstring(c, &v, "\"__metadata__\" values must be strings");
        if (s == DG_OK && h->nm == h->mcap) {
            int cap = h->mcap ? 2 * h->mcap : 8;
            char **nk = (char **)DG_REALLOC(h->mk, (size_t)cap * sizeof *nk);
            if (nk)
                h->mk = nk;
            char **nv = nk ? (char **)DG_REALLOC(h->mv, (size_t)cap * sizeof *nv) : NULL;
            if (nv)
                h->mv = nv;
            if (!nk || !nv)
                s = dg__err(DG_ERR_NOMEM, "%s: out of memory for metadata", OP_LOAD);
            else
                h->mcap = cap;
        }
        if (s != DG_OK) {
            DG_FREE(k);
            DG_FREE(v);
            return s;
        }
        h->mk[h->nm] = k;
        h->mv[h->nm] = v;
        h->nm++;
        if (jaccept(c, '}'))
            return DG_OK;
        DG_TRY(jexpect(c, ',', "expected ',' or '}' in \"__metadata__\""));
    }
}

static dg_status parse_top(jcur *c, dg__st_header *h) {
    DG_TRY(jexpect(c, '{', "the header must be a JSON object"));
    if (!jaccept(c, '}')) {
        for (;;) {
            char *name;
            DG_TRY(jstring(c, &name, "expected a tensor name string"));
            dg_status s = jexpect(c, ':', "expected ':' after a tensor name");
            if (s == DG_OK && strcmp(name, "__metadata__") == 0) {
                DG_FREE(name);
                DG_TRY(parse_meta(c, h));
            } else {
                if (s == DG_OK && h->n == h->cap) {
                    int cap = h->cap ? 2 * h->cap : 16;
                    dg__st_entry *ne = (dg__st_entry *)DG_REALLOC(h->e, (size_t)cap * sizeof *ne);
                    if (!ne) {
                        s = dg__err(DG_ERR_NOMEM, "%s: out of memory for tensor entries", OP_LOAD);
                    } else {
                        h->e = ne;
                        h->cap = cap;
                    }
                }
                if (s != DG_OK) {
                    DG_FREE(name);
                    return s;
                }
                dg__st_entry *e = &h->e[h->n++];
                memset(e, 0, sizeof *e);
                e->name = name; /* owned by h from here on */
                DG_TRY(parse_entry(c, e));
            }
            if (jaccept(c, '}'))
                break;
            DG_TRY(jexpect(c, ',', "expected ',' or '}' after a tensor entry"));
        }
    }
    jws(c);
    if (c->i != c->n)
        return jbad(c, "unexpected text after the header object");
    return DG_OK;
}

/* =============================================================================================
 * Validation
 * ============================================================================================= */

static int cmp_name(const void *a, const void *b) {
    const dg__st_entry *x = *(const dg__st_entry *const *)a, *y = *(const dg__st_entry *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_begin(const void *a, const void *b) {
    const dg__st_entry *x = *(const dg__st_entry *const *)a, *y = *(const dg__st_entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static dg_status validate(const char *path, const dg__st_header *h, uint64_t data_len) {
    if (h->nm > 1) {
        char **k = (char **)DG_MALLOC((size_t)h->nm * sizeof *k);
        if (!k)
            return dg__err(DG_ERR_NOMEM, "%s: out of memory", OP_LOAD);
        memcpy(k, h->mk, (size_t)h->nm * sizeof *k);
        qsort(k, (size_t)h->nm, sizeof *k, cmp_str);
        dg_status s = DG_OK;
        for (int i = 1; i < h->nm && s == DG_OK; i++)
            if (strcmp(k[i - 1], k[i]) == 0)
                s = dg__err(DG_ERR_FORMAT, "%s: '%s': duplicate \"__metadata__\" key \"%s\"",
                            OP_LOAD, path, k[i]);
        DG_FREE(k);
        DG_TRY(s);
    }
    for (int i = 0; i < h->n; i++) {
        const dg__st_entry *e = &h->e[i];
        if (e->end > data_len)
            return dg__err(DG_ERR_FORMAT,
                           "%s: '%s': tensor '%s' has data_offsets [%llu, %llu] outside the data "
                           "section (%llu bytes)",
                           OP_LOAD, path, e->name, (unsigned long long)e->begin,
                           (unsigned long long)e->end, (unsigned long long)data_len);
        uint64_t numel = 1, bytes;
        int ok = 1;
        for (int d = 0; d < e->ndim && ok; d++)
            ok = dg__mul_u64(numel, (uint64_t)e->shape[d], &numel);
        ok = ok && dg__mul_u64(numel, dg_dtype_size(e->dtype), &bytes);
        if (!ok)
            return dg__err(DG_ERR_FORMAT,
                           "%s: '%s': tensor '%s' has a shape whose byte count overflows 64 bits",
                           OP_LOAD, path, e->name);
        if (!dg__shape_fits(e->ndim, e->shape))
            return dg__err(DG_ERR_FORMAT,
                           "%s: '%s': tensor '%s' has extents too large for a tensor", OP_LOAD,
                           path, e->name);
        if (bytes != e->end - e->begin)
            return dg__err(DG_ERR_FORMAT,
                           "%s: '%s': tensor '%s' has data_offsets spanning %llu bytes, but its "
                           "shape and dtype %s need %llu",
                           OP_LOAD, path, e->name, (unsigned long long)(e->end - e->begin),
                           dg__st_dtype_names[e->dtype], (unsigned long long)bytes);
    }
    if (h->n < 2)
        return DG_OK;
    const dg__st_entry **p = (const dg__st_entry **)DG_MALLOC((size_t)h->n * sizeof *p);
    if (!p)
        return dg__err(DG_ERR_NOMEM, "%s: out of memory", OP_LOAD);
    for (int i = 0; i < h->n; i++)
        p[i] = &h->e[i];
    dg_status s = DG_OK;
    qsort(p, (size_t)h->n, sizeof *p, cmp_name);
    for (int i = 1; i < h->n && s == DG_OK; i++)
        if (strcmp(p[i - 1]->name, p[i]->name) == 0)
            s = dg__err(DG_ERR_FORMAT, "%s: '%s': duplicate tensor name '%s'", OP_LOAD, path,
                        p[i]->name);
    if (s == DG_OK) {
        qsort(p, (size_t)h->n, sizeof *p, cmp_begin);
        /* Empty tensors take no bytes and overlap nothing. */
        const dg__st_entry *prev = NULL;
        for (int i = 0; i < h->n && s == DG_OK; i++) {
            if (p[i]->begin == p[i]->end)
                continue;
            if (prev && p[i]->begin < prev->end)
                s = dg__err(DG_ERR_FORMAT,
                            "%s: '%s': tensors '%s' and '%s' overlap in the data section", OP_LOAD,
                            path, prev->name, p[i]->name);
            prev = p[i];
        }
    }
    DG_FREE(p);
    return s;
}

dg_status dg__st_header_parse(const char *path, const char *text, size_t len, uint64_t data_len,
                              dg__st_header *h) {
    jcur c = {text, len, 0, path};
    DG_TRY(parse_top(&c, h));
    return validate(path, h, data_len);
}

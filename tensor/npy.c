/*
 * tensor/npy.c -- NumPy .npy files: dg_npy_save / dg_npy_load.
 *
 * Layout: "\x93NUMPY", major, minor, a header length (u16 LE for 1.0, u32 LE for 2.0/3.0), then
 * the header: a Python dict literal such as
 *     {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 * padded with spaces and a final '\n', then the raw C-order data.
 *
 * The header is parsed by a small hand-written reader of exactly that dict grammar (strings in
 * ' or ", True/False, tuples of integers), never by anything that evaluates text. Every length
 * and size is checked against the file size before anything is allocated, in overflow-safe
 * 64-bit arithmetic, so a corrupt file gives an error naming the problem instead of a crash or
 * a huge allocation.
 */
#define _POSIX_C_SOURCE 200809L

#include "tensor/fileio.h"

#include <ctype.h>

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
/* numpy's own reader refuses headers past 10000 bytes by default; ours are < 200 bytes. A
 * generous cap still stops a corrupt length from allocating gigabytes. */
#define NPY_MAX_HEADER (1u << 20)
#define NPY_ALIGN 64

static const char *const OP_LOAD = "dg_npy_load";
static const char *const OP_SAVE = "dg_npy_save";

/* ---- header parsing ---- */

typedef struct npy_cur {
    const char *s; /* header text (not NUL terminated) */
    size_t n, i;
    size_t base; /* file offset of s[0], for messages */
    const char *path;
} npy_cur;

typedef struct npy_header {
    char descr[32];
    int fortran;
    int ndim; /* -1 until 'shape' is seen */
    int64_t shape[DG_MAX_DIMS];
} npy_header;

static dg_status bad(const npy_cur *c, const char *what) {
    return dg__err(DG_ERR_FORMAT, "%s: '%s': malformed header at byte %zu: %s", OP_LOAD, c->path,
                   c->base + c->i, what);
}

static void skip_ws(npy_cur *c) {
    while (c->i < c->n &&
           (c->s[c->i] == ' ' || c->s[c->i] == '\t' || c->s[c->i] == '\n' || c->s[c->i] == '\r'))
        c->i++;
}

/* Skip whitespace, then require character ch. */
static dg_status expect(npy_cur *c, char ch, const char *what) {
    skip_ws(c);
    if (c->i >= c->n || c->s[c->i] != ch)
        return bad(c, what);
    c->i++;
    return DG_OK;
}

/* A quoted string without escapes ('...' or "..."), copied into dst[cap]. */
static dg_status parse_str(npy_cur *c, char *dst, size_t cap, const char *what) {
    skip_ws(c);
    if (c->i >= c->n || (c->s[c->i] != '\'' && c->s[c->i] != '"'))
        return bad(c, what);
    char q = c->s[c->i++];
    size_t len = 0;
    for (;;) {
        if (c->i >= c->n)
            return bad(c, "unterminated string");
        char ch = c->s[c->i];
        if (ch == q)
            break;
        if (ch == '\\')
            return bad(c, "escape sequences are not supported in header strings");
        if ((unsigned char)ch < 0x20)
            return bad(c, "control character inside a string");
        if (len + 1 >= cap)
            return bad(c, "string is too long");
        dst[len++] = ch;
        c->i++;
    }
    c->i++;
    dst[len] = '\0';
    return DG_OK;
}

/* A Python integer literal, possibly negative, with an optional Python 2 'L' suffix. */
static dg_status parse_int(npy_cur *c, int64_t *v) {
    skip_ws(c);
    int neg = 0;
    if (c->i < c->n && c->s[c->i] == '-') {
        neg = 1;
        c->i++;
    }
    if (c->i >= c->n || !isdigit((unsigned char)c->s[c->i]))
        return bad(c, "expected an integer in 'shape'");
    uint64_t x = 0;
    while (c->i < c->n && isdigit((unsigned char)c->s[c->i])) {
        uint64_t d = (uint64_t)(c->s[c->i] - '0');
        if (x > ((uint64_t)INT64_MAX - d) / 10)
            return bad(c, "dimension in 'shape' overflows int64");
        x = x * 10 + d;
        c->i++;
    }
    if (c->i < c->n && (c->s[c->i] == 'L' || c->s[c->i] == 'l'))
        c->i++;
    *v = neg ? -(int64_t)x : (int64_t)x;
    return DG_OK;
}

/* '(' [int (',' int)* [',']] ')'. Dimensions beyond DG_MAX_DIMS are counted, not stored. */
static dg_status parse_shape(npy_cur *c, npy_header *h) {
    DG_TRY(expect(c, '(', "expected '(' to start 'shape'"));
    int nd = 0;
    skip_ws(c);
    while (c->i < c->n && c->s[c->i] != ')') {
        int64_t d = 0;
        DG_TRY(parse_int(c, &d));
        if (d < 0)
            return dg__err(DG_ERR_FORMAT, "%s: '%s': 'shape' has a negative dimension (%lld)",
                           OP_LOAD, c->path, (long long)d);
        if (nd < DG_MAX_DIMS)
            h->shape[nd] = d;
        if (nd == 64)
            return bad(c, "'shape' has more than 64 dimensions");
        nd++;
        skip_ws(c);
        if (c->i < c->n && c->s[c->i] == ',') {
            c->i++;
            skip_ws(c);
        } else if (c->i < c->n && c->s[c->i] != ')') {
            return bad(c, "expected ',' or ')' in 'shape'");
        }
    }
    DG_TRY(expect(c, ')', "unterminated 'shape' tuple"));
    if (nd > DG_MAX_DIMS)
        return dg__err(DG_ERR_SHAPE,
                       "%s: '%s': array has %d dimensions, more than DG_MAX_DIMS (%d)", OP_LOAD,
                       c->path, nd, DG_MAX_DIMS);
    h->ndim = nd;
    return DG_OK;
}

static dg_status parse_bool(npy_cur *c, int *v) {
    skip_ws(c);
    if (c->n - c->i >= 4 && memcmp(c->s + c->i, "True", 4) == 0) {
        *v = 1;
        c->i += 4;
        return DG_OK;
    }
    if (c->n - c->i >= 5 && memcmp(c->s + c->i, "False", 5) == 0) {
        *v = 0;
        c->i += 5;
        return DG_OK;
    }
    return bad(c, "expected True or False for 'fortran_order'");
}

/* The whole dict: exactly the keys descr, fortran_order and shape, in any order. */
static dg_status parse_header(npy_cur *c, npy_header *h) {
    memset(h, 0, sizeof *h);
    h->ndim = -1;
    int seen_descr = 0, seen_fortran = 0;
    DG_TRY(expect(c, '{', "expected '{' at the start of the header dict"));
    for (;;) {
        skip_ws(c);
        if (c->i < c->n && c->s[c->i] == '}')
            break;
        char key[32];
        DG_TRY(parse_str(c, key, sizeof key, "expected a quoted key"));
        DG_TRY(expect(c, ':', "expected ':' after a key"));
        if (strcmp(key, "descr") == 0) {
            if (seen_descr++)
                return bad(c, "duplicate key 'descr'");
            skip_ws(c);
            if (c->i < c->n && (c->s[c->i] == '[' || c->s[c->i] == '{'))
                return dg__err(DG_ERR_DTYPE,
                               "%s: '%s': structured dtypes are not supported (descr is a list)",
                               OP_LOAD, c->path);
            DG_TRY(parse_str(c, h->descr, sizeof h->descr, "expected a string for 'descr'"));
        } else if (strcmp(key, "fortran_order") == 0) {
            if (seen_fortran++)
                return bad(c, "duplicate key 'fortran_order'");
            DG_TRY(parse_bool(c, &h->fortran));
        } else if (strcmp(key, "shape") == 0) {
            if (h->ndim >= 0)
                return bad(c, "duplicate key 'shape'");
            DG_TRY(parse_shape(c, h));
        } else {
            return dg__err(DG_ERR_FORMAT, "%s: '%s': unexpected key '%s' in the header", OP_LOAD,
                           c->path, key);
        }
        skip_ws(c);
        if (c->i < c->n && c->s[c->i] == ',') {
            c->i++;
            continue;
        }
        if (c->i < c->n && c->s[c->i] == '}')
            break;
        return bad(c, "expected ',' or '}' after a value");
    }
    c->i++; /* '}' */
    skip_ws(c);
    if (c->i != c->n)
        return bad(c, "unexpected text after the header dict");
    if (!seen_descr || !seen_fortran || h->ndim < 0)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': header lacks %s", OP_LOAD, c->path,
                       !seen_descr     ? "'descr'"
                       : !seen_fortran ? "'fortran_order'"
                                       : "'shape'");
    return DG_OK;
}

static dg_status descr_dtype(const char *path, const char *d, dg_dtype *dt) {
    static const struct {
        const char *descr;
        dg_dtype dt;
    } known[] = {{"<f8", DG_F64}, {"<f4", DG_F32}, {"<i4", DG_I32}, {"<i8", DG_I64}};
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++)
        if (strcmp(d, known[k].descr) == 0) {
            *dt = known[k].dt;
            return DG_OK;
        }
    if (d[0] == '>')
        return dg__err(DG_ERR_DTYPE,
                       "%s: '%s': big-endian data (descr '%s') is not supported; save it "
                       "little-endian (e.g. a.astype(a.dtype.newbyteorder('<')))",
                       OP_LOAD, path, d);
    if (strcmp(d, "<f2") == 0)
        return dg__err(DG_ERR_DTYPE,
                       "%s: '%s': float16 (descr '<f2') is not supported; supported descrs are "
                       "'<f8', '<f4', '<i4', '<i8'",
                       OP_LOAD, path);
    return dg__err(DG_ERR_DTYPE,
                   "%s: '%s': unsupported descr '%s'; supported descrs are '<f8', '<f4', '<i4', "
                   "'<i8'",
                   OP_LOAD, path, d);
}

/* ---- load ---- */

static dg_status load_open(dg_ctx *ctx, const char *path, FILE *f, uint64_t size, dg_tensor **out) {
    unsigned char pre[12];
    if (size == 0)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': file is empty", OP_LOAD, path);
    if (size < 10)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': file is too short for a .npy header (%llu bytes)",
                       OP_LOAD, path, (unsigned long long)size);
    DG_TRY(dg__read_at(OP_LOAD, path, f, 0, pre, 10, "the .npy preamble"));
    if (memcmp(pre, NPY_MAGIC, NPY_MAGIC_LEN) != 0)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': not a .npy file (bad magic)", OP_LOAD, path);
    int major = pre[6], minor = pre[7];
    uint64_t prefix, hlen;
    if (major == 1 && minor == 0) {
        prefix = 10;
        hlen = (uint64_t)pre[8] | (uint64_t)pre[9] << 8;
    } else if ((major == 2 || major == 3) && minor == 0) {
        prefix = 12;
        if (size < prefix)
            return dg__err(DG_ERR_FORMAT, "%s: '%s': file is truncated inside the header length",
                           OP_LOAD, path);
        DG_TRY(dg__read_at(OP_LOAD, path, f, 10, pre + 10, 2, "the .npy preamble"));
        hlen = (uint64_t)pre[8] | (uint64_t)pre[9] << 8 | (uint64_t)pre[10] << 16 |
               (uint64_t)pre[11] << 24;
    } else {
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': unsupported .npy format version %d.%d (1.0, 2.0, 3.0 are read)",
                       OP_LOAD, path, major, minor);
    }
    if (hlen == 0)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': header length is 0", OP_LOAD, path);
    if (hlen > size - prefix)
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': header is truncated: header length is %llu bytes but only %llu "
                       "follow the preamble",
                       OP_LOAD, path, (unsigned long long)hlen,
                       (unsigned long long)(size - prefix));
    if (hlen > NPY_MAX_HEADER)
        return dg__err(DG_ERR_FORMAT, "%s: '%s': header length %llu exceeds the %u byte limit",
                       OP_LOAD, path, (unsigned long long)hlen, NPY_MAX_HEADER);

    char *htext = (char *)DG_MALLOC((size_t)hlen);
    if (!htext)
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for a %llu byte header", OP_LOAD,
                       (unsigned long long)hlen);
    dg_status s = dg__read_at(OP_LOAD, path, f, prefix, htext, (size_t)hlen, "the header");
    npy_header h;
    if (s == DG_OK) {
        npy_cur c = {htext, (size_t)hlen, 0, (size_t)prefix, path};
        s = parse_header(&c, &h);
    }
    DG_FREE(htext);
    DG_TRY(s);

    dg_dtype dt = DG_F32;
    DG_TRY(descr_dtype(path, h.descr, &dt));
    if (h.fortran)
        return dg__err(DG_ERR_UNSUPPORTED,
                       "%s: '%s': fortran_order True is not supported; save a C-order array "
                       "(np.ascontiguousarray)",
                       OP_LOAD, path);
    if (h.ndim == 0) { /* a 0-d array loads as shape [1] */
        h.ndim = 1;
        h.shape[0] = 1;
    }
    uint64_t numel = 1, bytes;
    for (int d = 0; d < h.ndim; d++)
        if (!dg__mul_u64(numel, (uint64_t)h.shape[d], &numel) || numel > (uint64_t)INT64_MAX)
            return dg__err(DG_ERR_FORMAT, "%s: '%s': element count of 'shape' overflows", OP_LOAD,
                           path);
    if (!dg__shape_fits(h.ndim, h.shape)) /* a zero extent beside huge ones: strides overflow */
        return dg__err(DG_ERR_FORMAT, "%s: '%s': 'shape' has extents too large for a tensor",
                       OP_LOAD, path);
    uint64_t esize = dg_dtype_size(dt);
    uint64_t avail = size - prefix - hlen;
    if (!dg__mul_u64(numel, esize, &bytes))
        return dg__err(DG_ERR_FORMAT, "%s: '%s': 'shape' (%llu elements) is too large", OP_LOAD,
                       path, (unsigned long long)numel);
    if (bytes > avail)
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': file is truncated: header says %llu bytes of data, found %llu",
                       OP_LOAD, path, (unsigned long long)bytes, (unsigned long long)avail);
    /* Bytes past the array are ignored, as numpy does. */

    void *data = DG_MALLOC(bytes ? (size_t)bytes : 1);
    if (!data)
        return dg__err(DG_ERR_NOMEM, "%s: '%s': out of memory for %llu bytes of data", OP_LOAD,
                       path, (unsigned long long)bytes);
    s = dg__read_at(OP_LOAD, path, f, prefix + hlen, data, (size_t)bytes, "the array data");
    if (s == DG_OK) {
        dg__le_convert(data, (size_t)numel, (size_t)esize);
        s = dg_tensor_from_host(ctx, dt, h.ndim, h.shape, data, out);
    }
    DG_FREE(data);
    return s;
}

dg_status dg_npy_load(dg_ctx *ctx, const char *path, dg_tensor **out) {
    DG_TRY(dg__check_ptr(OP_LOAD, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(OP_LOAD, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP_LOAD, "path", path));
    FILE *f;
    uint64_t size;
    DG_TRY(dg__open_read(OP_LOAD, path, &f, &size));
    dg_status s = load_open(ctx, path, f, size, out);
    fclose(f);
    return s;
}

/* ---- save ---- */

dg_status dg_npy_save(const char *path, const dg_tensor *t) {
    DG_TRY(dg__check_ptr(OP_SAVE, "path", path));
    DG_TRY(dg__check_ptr(OP_SAVE, "t", t));
    dg_dtype dt = dg_tensor_dtype(t);
    const char *descr;
    switch (dt) {
    case DG_F64:
        descr = "<f8";
        break;
    case DG_F32:
        descr = "<f4";
        break;
    case DG_BF16:
        descr = "<f4";
        break; /* numpy has no bfloat16: widen exactly to f32 */
    case DG_I32:
        descr = "<i4";
        break;
    case DG_I64:
        descr = "<i8";
        break;
    default:
        return dg__err(DG_ERR_DTYPE, "%s: t has an unknown dtype %d", OP_SAVE, (int)dt);
    }
    int ndim = dg_tensor_ndim(t);
    const int64_t *shape = dg_tensor_shape(t);
    if (ndim < 0 || ndim > DG_MAX_DIMS)
        return dg__err(DG_ERR_SHAPE, "%s: t has %d dims", OP_SAVE, ndim);

    dg__sbuf hb = {0};
    dg__sb_printf(&hb, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
    for (int d = 0; d < ndim; d++)
        dg__sb_printf(&hb, d ? ", %lld" : "%lld", (long long)shape[d]);
    dg__sb_puts(&hb, ndim == 1 ? ",), }" : "), }");
    /* Pad with spaces and a final '\n' so the data starts at a multiple of 64 bytes. */
    size_t total = 10 + hb.len + 1;
    size_t pad = (NPY_ALIGN - total % NPY_ALIGN) % NPY_ALIGN;
    for (size_t k = 0; k < pad; k++)
        dg__sb_put(&hb, " ", 1);
    dg__sb_put(&hb, "\n", 1);
    if (hb.oom) {
        dg__sb_free(&hb);
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for the header", OP_SAVE);
    }
    DG_ASSERT(hb.len <= 0xffff);

    size_t numel = (size_t)dg_tensor_numel(t);
    size_t src_bytes = numel * dg_dtype_size(dt);
    size_t esize = dt == DG_BF16 ? 4 : dg_dtype_size(dt);
    void *host = DG_MALLOC(src_bytes ? src_bytes : 1);
    void *wide = NULL;
    if (!host) {
        dg__sb_free(&hb);
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for %zu bytes of data", OP_SAVE, src_bytes);
    }
    dg_status s = dg_tensor_to_host(t, host, src_bytes);
    const void *payload = host;
    if (s == DG_OK && dt == DG_BF16) {
        wide = DG_MALLOC(numel ? numel * 4 : 1);
        if (!wide) {
            s = dg__err(DG_ERR_NOMEM, "%s: out of memory for the f32 copy of a bf16 tensor",
                        OP_SAVE);
        } else {
            const uint16_t *b = (const uint16_t *)host;
            float *w = (float *)wide;
            for (size_t i = 0; i < numel; i++)
                w[i] = dg__bf16_to_f32(b[i]);
            payload = wide;
        }
    }
    if (s == DG_OK) {
        dg__le_convert((void *)payload, numel, esize);
        unsigned char pre[10];
        memcpy(pre, NPY_MAGIC, NPY_MAGIC_LEN);
        pre[6] = 1;
        pre[7] = 0;
        pre[8] = (unsigned char)(hb.len & 0xff);
        pre[9] = (unsigned char)(hb.len >> 8);
        dg__awriter w;
        s = dg__aw_open(OP_SAVE, path, &w);
        if (s == DG_OK)
            s = dg__aw_write(&w, pre, sizeof pre);
        if (s == DG_OK)
            s = dg__aw_write(&w, hb.s, hb.len);
        if (s == DG_OK)
            s = dg__aw_write(&w, payload, numel * esize);
        if (s == DG_OK)
            s = dg__aw_commit(&w);
    }
    DG_FREE(wide);
    DG_FREE(host);
    dg__sb_free(&hb);
    return s;
}

/*
 * tests/test_io.c -- .npy and safetensors files: round trips for every dtype and 1..5-d shapes,
 * views saved in logical order, metadata, atomic saves, one clear error per kind of malformed
 * file, NumPy interop (when /usr/bin/python3 has numpy), and a deterministic fuzz loop that
 * truncates and corrupts valid files (run it under the sanitizer build to catch bad reads).
 *
 * Files live under a mkdtemp() directory that is removed at the end.
 */
#define _POSIX_C_SOURCE 200809L

#include "harness.h"

#include <dirent.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];
static dg_ctx *g_ctx;

/* ---- helpers ---- */

static void tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", g_dir, name);
}

static void write_bytes(const char *path, const void *buf, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(buf, 1, n, f) != n) || fclose(f) != 0) {
        fprintf(stderr, "FATAL: cannot write %s\nHINT: is /tmp writable?\n", path);
        exit(1);
    }
}

/* A string literal's bytes, without its NUL (literals may hold embedded NULs). */
#define WRITE_LIT(path, lit) write_bytes((path), (lit), sizeof(lit) - 1)

static unsigned char *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "FATAL: cannot read %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = (unsigned char *)malloc(sz > 0 ? (size_t)sz : 1);
    if (!buf || fread(buf, 1, (size_t)sz, f) != (size_t)sz) {
        fprintf(stderr, "FATAL: cannot read %s\n", path);
        exit(1);
    }
    fclose(f);
    *n = (size_t)sz;
    return buf;
}

/* Deterministic values that every dtype holds exactly (bf16 included): quarter steps in [-1, 1]
 * for floats, small signed integers for ints. Flat index i in row-major order. */
static double test_value(dg_dtype dt, int64_t i) {
    if (dt == DG_I32 || dt == DG_I64)
        return (double)(i * 3 - 5);
    return (double)(i % 9) * 0.25 - 1.0;
}

static dg_tensor *make_tensor(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    double *v = (double *)malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = test_value(dt, i);
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, ndim, shape, v, &t));
    free(v);
    return t;
}

static int same_shape(const dg_tensor *a, int ndim, const int64_t *shape) {
    if (dg_tensor_ndim(a) != ndim)
        return 0;
    for (int d = 0; d < ndim; d++)
        if (dg_tensor_shape(a)[d] != shape[d])
            return 0;
    return 1;
}

/* got must have dtype `dt`, the shape of want, and exactly want's values. */
static void check_same(const char *what, const dg_tensor *got, const dg_tensor *want, dg_dtype dt) {
    if (!dg_check(got && dg_tensor_dtype(got) == dt &&
                      same_shape(got, dg_tensor_ndim(want), dg_tensor_shape(want)),
                  "%s: dtype %s and shape %s", what,
                  got ? dg_dtype_name(dg_tensor_dtype(got)) : "-",
                  got ? dg_tensor_desc(got) : "(null)"))
        return;
    dg_check_tensor_close(what, got, want, 0.0, 0.0); /* files store bits: exact */
}

static const int64_t k_shapes[5][5] = {{7}, {3, 4}, {2, 3, 4}, {2, 1, 3, 2}, {1, 2, 2, 3, 2}};
static const dg_dtype k_dtypes[5] = {DG_F64, DG_F32, DG_BF16, DG_I32, DG_I64};

/* Hand-made .npy bytes: preamble for (major, 0), header text as given, then data. */
static void write_npy_raw(const char *path, int major, const char *header, const void *data,
                          size_t ndata) {
    size_t hl = strlen(header);
    size_t pre = major == 1 ? 10 : 12;
    unsigned char *buf = (unsigned char *)malloc(pre + hl + ndata + 1);
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (unsigned char)major;
    buf[7] = 0;
    for (size_t k = 0; k < pre - 8; k++)
        buf[8 + k] = (unsigned char)(hl >> (8 * k));
    memcpy(buf + pre, header, hl);
    if (ndata)
        memcpy(buf + pre + hl, data, ndata);
    write_bytes(path, buf, pre + hl + ndata);
    free(buf);
}

/* Hand-made safetensors bytes: length, JSON text, data. */
static void write_st_raw(const char *path, const char *json, const void *data, size_t ndata) {
    size_t hl = strlen(json);
    unsigned char *buf = (unsigned char *)malloc(8 + hl + ndata + 1);
    for (int k = 0; k < 8; k++)
        buf[k] = (unsigned char)((uint64_t)hl >> (8 * k));
    memcpy(buf + 8, json, hl);
    if (ndata)
        memcpy(buf + 8 + hl, data, ndata);
    write_bytes(path, buf, 8 + hl + ndata);
    free(buf);
}

static int count_tmp_leftovers(void) {
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp."))
            n++;
    if (d)
        closedir(d);
    return n;
}

static void remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[512];
    while (d && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(p, &st) == 0 && S_ISDIR(st.st_mode))
            remove_tree(p);
        else
            remove(p);
    }
    if (d)
        closedir(d);
    rmdir(dir);
}

/* ---- round trips ---- */

static void test_npy_roundtrip(void) {
    char p[256], what[96];
    for (int k = 0; k < 5; k++)
        for (int nd = 1; nd <= 5; nd++) {
            dg_dtype dt = k_dtypes[k];
            dg_tensor *t = make_tensor(g_ctx, dt, nd, k_shapes[nd - 1]), *u = NULL;
            snprintf(what, sizeof what, "npy %s %d-d", dg_dtype_name(dt), nd);
            tmp_path(p, sizeof p, "rt.npy");
            if (dg_check_ok(dg_npy_save(p, t), what) &&
                dg_check_ok(dg_npy_load(g_ctx, p, &u), what))
                check_same(what, u, t, dt == DG_BF16 ? DG_F32 : dt); /* bf16 -> f32 */
            dg_tensor_free(&u);
            dg_tensor_free(&t);
        }
}

static void test_st_roundtrip(void) {
    char p[256], what[96];
    char names[25][48];
    const char *np[25];
    dg_tensor *ts[25];
    int n = 0;
    for (int k = 0; k < 5; k++)
        for (int nd = 1; nd <= 5; nd++, n++) {
            /* Names with characters JSON must escape, and one non-ASCII name. */
            snprintf(names[n], sizeof names[n],
                     n == 3   ? "w\"q\\%d\n\t\x01"
                     : n == 4 ? "caf\xc3\xa9.%d"
                              : "layers.%d.weight",
                     n);
            np[n] = names[n];
            ts[n] = make_tensor(g_ctx, k_dtypes[k], nd, k_shapes[nd - 1]);
        }
    const char *mk[3] = {"format", "note \"quoted\"", "empty"};
    const char *mv[3] = {"pt", "line1\nline2 \\ tab\t caf\xc3\xa9 \x02", ""};
    tmp_path(p, sizeof p, "rt.safetensors");
    dg_safetensors st;
    if (dg_check_ok(dg_safetensors_save(p, n, np, (const dg_tensor *const *)ts, 3, mk, mv),
                    "safetensors save 25 tensors + metadata") &&
        dg_check_ok(dg_safetensors_load(g_ctx, p, &st), "safetensors load")) {
        int order_ok = st.n == n;
        for (int i = 0; order_ok && i < n; i++)
            order_ok = strcmp(st.names[i], np[i]) == 0;
        dg_check(order_ok, "safetensors: %d names back, in the saved order, escapes intact", st.n);
        for (int i = 0; i < n && i < st.n; i++) {
            snprintf(what, sizeof what, "safetensors %s %d-d",
                     dg_dtype_name(dg_tensor_dtype(ts[i])), dg_tensor_ndim(ts[i]));
            check_same(what, dg_safetensors_get(&st, np[i]), ts[i], dg_tensor_dtype(ts[i]));
        }
        int meta_ok = st.n_meta == 3;
        for (int i = 0; meta_ok && i < 3; i++)
            meta_ok = dg_safetensors_meta(&st, mk[i]) &&
                      strcmp(dg_safetensors_meta(&st, mk[i]), mv[i]) == 0;
        dg_check(meta_ok, "safetensors: metadata round trip (3 pairs, escapes, empty value)");
        dg_check(dg_safetensors_get(&st, "nope") == NULL &&
                     dg_safetensors_meta(&st, "nope") == NULL,
                 "safetensors: get/meta of a missing name give NULL");
        dg_safetensors_free(&st);
        dg_check(st.n == 0 && st.names == NULL, "safetensors_free clears the struct");
        dg_safetensors_free(&st); /* twice is harmless */
    }

    /* The data section starts 8-byte aligned, and tensors are packed in order. */
    size_t len;
    unsigned char *b = read_bytes(p, &len);
    uint64_t hl = 0;
    for (int k = 7; k >= 0; k--)
        hl = hl << 8 | b[k];
    size_t want = 0;
    for (int i = 0; i < n; i++)
        want += dg_tensor_nbytes(ts[i]);
    dg_check((8 + hl) % 8 == 0 && 8 + hl + want == len,
             "safetensors: header %llu bytes (8-aligned data), data %zu bytes packed, file %zu",
             (unsigned long long)hl, want, len);
    free(b);

    /* No tensors and no metadata is a valid file too. */
    tmp_path(p, sizeof p, "empty.safetensors");
    if (dg_check_ok(dg_safetensors_save(p, 0, NULL, NULL, 0, NULL, NULL), "safetensors save n=0") &&
        dg_check_ok(dg_safetensors_load(g_ctx, p, &st), "safetensors load n=0")) {
        dg_check(st.n == 0 && st.n_meta == 0, "safetensors n=0: nothing back");
        dg_safetensors_free(&st);
    }
    for (int i = 0; i < n; i++)
        dg_tensor_free(&ts[i]);
}

/* A transposed view is saved in its logical (row-major) order, not its storage order. */
static void test_views(void) {
    int64_t shape[2] = {3, 4};
    dg_tensor *x = make_tensor(g_ctx, DG_F32, 2, shape), *xt = NULL, *u = NULL;
    DG_TEST_TRY(dg_transpose(x, 0, 1, &xt));
    double want[12];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++)
            want[j * 3 + i] = test_value(DG_F32, i * 4 + j);
    int64_t tshape[2] = {4, 3};
    dg_tensor *w = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(g_ctx, DG_F32, 2, tshape, want, &w));
    char p[256];
    tmp_path(p, sizeof p, "view.npy");
    if (dg_check_ok(dg_npy_save(p, xt), "npy save of a transposed view") &&
        dg_check_ok(dg_npy_load(g_ctx, p, &u), "npy load of the view"))
        check_same("npy view in logical order", u, w, DG_F32);
    dg_tensor_free(&u);

    tmp_path(p, sizeof p, "view.safetensors");
    const char *nm[2] = {"xt", "x"};
    const dg_tensor *ts[2] = {xt, x};
    dg_safetensors st;
    if (dg_check_ok(dg_safetensors_save(p, 2, nm, ts, 0, NULL, NULL),
                    "safetensors save of a view") &&
        dg_check_ok(dg_safetensors_load(g_ctx, p, &st), "safetensors load of the view")) {
        check_same("safetensors view in logical order", dg_safetensors_get(&st, "xt"), w, DG_F32);
        check_same("safetensors source next to its view", dg_safetensors_get(&st, "x"), x, DG_F32);
        dg_safetensors_free(&st);
    }
    dg_tensor_free(&w);
    dg_tensor_free(&xt);
    dg_tensor_free(&x);
}

/* Saves go through a temp file: an overwrite replaces the file; a failed save leaves no temp
 * file and the old contents untouched. */
static void test_atomic(void) {
    int64_t s1[1] = {4}, s2[2] = {2, 2};
    dg_tensor *a = make_tensor(g_ctx, DG_F64, 1, s1), *b = make_tensor(g_ctx, DG_I32, 2, s2);
    dg_tensor *u = NULL;
    char p[256];
    tmp_path(p, sizeof p, "atomic.npy");
    DG_TEST_TRY(dg_npy_save(p, a));
    DG_TEST_TRY(dg_npy_save(p, b));
    if (dg_check_ok(dg_npy_load(g_ctx, p, &u), "npy load after overwrite"))
        check_same("npy overwrite gives the new tensor", u, b, DG_I32);
    dg_tensor_free(&u);

    /* Renaming onto a directory fails after the data was written: the error must be IO, the
     * directory must survive and the temp file must be gone. */
    char d[256];
    tmp_path(d, sizeof d, "a_directory");
    mkdir(d, 0700);
    const char *nm[1] = {"a"};
    const dg_tensor *ts[1] = {a};
    dg_check_err(dg_safetensors_save(d, 1, nm, ts, 0, NULL, NULL), DG_ERR_IO, "rename",
                 "safetensors save onto a directory fails at rename");
    dg_check_err(dg_npy_save(d, a), DG_ERR_IO, "rename", "npy save onto a directory fails");
    struct stat st;
    dg_check(stat(d, &st) == 0 && S_ISDIR(st.st_mode), "the directory is untouched");

    /* The existing file stays as it was when a save fails before writing. */
    size_t n0, n1;
    unsigned char *before = read_bytes(p, &n0);
    const char *dup[2] = {"a", "a"};
    const dg_tensor *ts2[2] = {a, a};
    dg_check_err(dg_safetensors_save(p, 2, dup, ts2, 0, NULL, NULL), DG_ERR_ARG, "both 'a'",
                 "safetensors save with duplicate names");
    unsigned char *after = read_bytes(p, &n1);
    dg_check(n0 == n1 && memcmp(before, after, n0) == 0, "old file unchanged after a failed save");
    free(before);
    free(after);

    char nodir[256];
    tmp_path(nodir, sizeof nodir, "no/such/dir/x.npy");
    dg_check_err(dg_npy_save(nodir, a), DG_ERR_IO, "cannot create", "npy save into a missing dir");
    dg_check(count_tmp_leftovers() == 0, "no '.tmp.' files left behind");
    dg_tensor_free(&a);
    dg_tensor_free(&b);
}

/* ---- malformed .npy ---- */

static dg_status npy_try(const char *path) {
    dg_tensor *t = NULL;
    dg_status s = dg_npy_load(g_ctx, path, &t);
    if (s == DG_OK)
        dg_tensor_free(&t);
    else if (t != NULL)
        dg_check(0, "a failed load left *out non-NULL");
    return s;
}

static void test_npy_malformed(void) {
    char p[256];
    tmp_path(p, sizeof p, "bad.npy");
    double d8[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const char *hdr_ok = "{'descr': '<f8', 'fortran_order': False, 'shape': (8,), }  \n";

    dg_check_err(npy_try(g_dir), DG_ERR_IO, "not a regular file", "npy: a directory");
    char missing[256];
    tmp_path(missing, sizeof missing, "missing.npy");
    dg_check_err(npy_try(missing), DG_ERR_IO, "cannot open", "npy: missing file");
    dg_tensor *t = NULL;
    dg_check_err(dg_npy_load(NULL, p, &t), DG_ERR_ARG, "ctx", "npy: NULL ctx");
    dg_check_err(dg_npy_load(g_ctx, NULL, &t), DG_ERR_ARG, "path", "npy: NULL path");
    dg_check_err(dg_npy_save(p, NULL), DG_ERR_ARG, "t", "npy: save NULL tensor");

    WRITE_LIT(p, "");
    dg_check_err(npy_try(p), DG_ERR_FORMAT, "file is empty", "npy: empty file");
    WRITE_LIT(p, "\x93NUM");
    dg_check_err(npy_try(p), DG_ERR_FORMAT, "too short", "npy: 4-byte file");
    WRITE_LIT(p, "\x93NUMPX\x01\x00\x10\x00{}              ");
    dg_check_err(npy_try(p), DG_ERR_FORMAT, "bad magic", "npy: bad magic");
    WRITE_LIT(p, "PK\x03\x04 this is a zip file, not npy");
    dg_check_err(npy_try(p), DG_ERR_FORMAT, "bad magic", "npy: a zip (.npz) file");
    write_npy_raw(p, 4, hdr_ok, d8, sizeof d8);
    dg_check_err(npy_try(p), DG_ERR_FORMAT, "version 4.0", "npy: version 4.0");

    /* Header length problems. */
    write_npy_raw(p, 1, "", NULL, 0);
    dg_check_err(npy_try(p), DG_ERR_FORMAT, "header length is 0", "npy: header length 0");
    {
        unsigned char b[40] = "\x93NUMPY\x01\x00\xff\xff{'descr': '<f8', 'fortr";
        write_bytes(p, b, 30);
        dg_check_err(npy_try(p), DG_ERR_FORMAT, "header is truncated",
                     "npy: header length 65535 in a 30-byte file");
        unsigned char b2[40] = "\x93NUMPY\x02\x00\xff\xff\xff\xff{'descr': '<f8'}";
        write_bytes(p, b2, 30);
        dg_check_err(npy_try(p), DG_ERR_FORMAT, "header is truncated",
                     "npy: v2 header length 4 GiB in a 30-byte file");
        write_bytes(p, b2, 11);
        dg_check_err(npy_try(p), DG_ERR_FORMAT, "header length",
                     "npy: v2 file cut inside the header length");
    }
    {
        /* A valid file cut in the middle of its header. */
        write_npy_raw(p, 1, hdr_ok, d8, sizeof d8);
        size_t n;
        unsigned char *b = read_bytes(p, &n);
        write_bytes(p, b, 10 + 20);
        dg_check_err(npy_try(p), DG_ERR_FORMAT, "header is truncated", "npy: truncated header");
        write_bytes(p, b, n - 40);
        dg_check_err(npy_try(p), DG_ERR_FORMAT,
                     "file is truncated: header says 64 bytes of data, found 24",
                     "npy: truncated data");
        free(b);
    }

    /* Header contents. */
    struct {
        const char *hdr;
        dg_status want;
        const char *needle;
        const char *what;
    } cases[] = {
        {"{'descr': '<f8', 'fortran_order': True, 'shape': (8,), }\n", DG_ERR_UNSUPPORTED,
         "fortran_order True", "npy: fortran_order True"},
        {"{'descr': '<c16', 'fortran_order': False, 'shape': (8,), }\n", DG_ERR_DTYPE,
         "unsupported descr '<c16'", "npy: unknown descr <c16"},
        {"{'descr': '|u1', 'fortran_order': False, 'shape': (8,), }\n", DG_ERR_DTYPE,
         "unsupported descr '|u1'", "npy: unsupported descr |u1"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (8,), }\n", DG_ERR_DTYPE, "float16",
         "npy: float16 refused"},
        {"{'descr': '>f8', 'fortran_order': False, 'shape': (8,), }\n", DG_ERR_DTYPE, "big-endian",
         "npy: big-endian refused"},
        {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (8,), }\n", DG_ERR_DTYPE,
         "structured", "npy: structured dtype refused"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (2, -4), }\n", DG_ERR_FORMAT,
         "negative dimension (-4)", "npy: negative dim"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1, 1, 1, 2, 4), }\n", DG_ERR_SHAPE,
         "6 dimensions, more than DG_MAX_DIMS", "npy: 6 dims"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,), }\n",
         DG_ERR_FORMAT, "overflows int64", "npy: dim overflows int64"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }\n",
         DG_ERR_FORMAT, "overflows", "npy: element count overflows"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }\n",
         DG_ERR_FORMAT, "too large", "npy: byte count overflows"},
        {"{'descr': '<i4', 'fortran_order': False, 'shape': (0, 2091089261388016296, 2, 2), }\n",
         DG_ERR_FORMAT, "extents too large", "npy: zero extent beside overflowing ones"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }\n", DG_ERR_FORMAT,
         "header says 96 bytes of data, found 64", "npy: shape needs more data than present"},
        {"{'descr': '<f8', 'fortran_order': False, }\n", DG_ERR_FORMAT, "lacks 'shape'",
         "npy: missing shape"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (8,), 'extra': 1}\n", DG_ERR_FORMAT,
         "unexpected key 'extra'", "npy: extra key"},
        {"{'descr': '<f8', 'descr': '<f8', 'fortran_order': False, 'shape': (8,)}\n", DG_ERR_FORMAT,
         "duplicate key 'descr'", "npy: duplicate key"},
        {"{'descr': '<f8', 'fortran_order': Maybe, 'shape': (8,)}\n", DG_ERR_FORMAT,
         "True or False", "npy: fortran_order not a bool"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (8,) \n", DG_ERR_FORMAT,
         "malformed header", "npy: unterminated dict"},
        {"{'descr': '<f8, 'fortran_order': False, 'shape': (8,)}\n", DG_ERR_FORMAT,
         "malformed header", "npy: unbalanced quotes"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (8,)} junk\n", DG_ERR_FORMAT,
         "after the header dict", "npy: text after the dict"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': [8]}\n", DG_ERR_FORMAT, "expected '('",
         "npy: shape as a list"},
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (8.0,)}\n", DG_ERR_FORMAT,
         "expected ',' or ')'", "npy: float dim"},
        {"hello world\n", DG_ERR_FORMAT, "expected '{'", "npy: header is not a dict"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        write_npy_raw(p, 1, cases[k].hdr, d8, sizeof d8);
        dg_check_err(npy_try(p), cases[k].want, cases[k].needle, cases[k].what);
    }

    /* Things that are valid: a 0-d array (loaded as [1]), format 2.0 and 3.0, double quotes and
     * a Python 2 'L' suffix, trailing bytes after the data (ignored, as numpy does). */
    struct {
        int major;
        const char *hdr;
        size_t ndata;
        int ndim;
        int64_t shape[2];
        const char *what;
    } good[] = {
        {1, "{'descr': '<f8', 'fortran_order': False, 'shape': (), }\n", 8, 1, {1}, "npy: 0-d"},
        {2,
         "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 4), }\n",
         64,
         2,
         {2, 4},
         "npy: version 2.0"},
        {3,
         "{'descr': '<f8', 'fortran_order': False, 'shape': (8,), }\n",
         64,
         1,
         {8},
         "npy: version 3.0"},
        {1,
         "{\"shape\": (2L, 2L), \"fortran_order\": False, \"descr\": \"<f8\"}",
         32,
         2,
         {2, 2},
         "npy: double quotes, any key order, 2L"},
        {1,
         "{'descr': '<f8', 'fortran_order': False, 'shape': (4,), }\n",
         64,
         1,
         {4},
         "npy: trailing bytes ignored"},
    };
    for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
        write_npy_raw(p, good[k].major, good[k].hdr, d8, good[k].ndata);
        dg_tensor *u = NULL;
        dg_status s = dg_npy_load(g_ctx, p, &u);
        if (dg_check_ok(s, good[k].what)) {
            double *v = NULL;
            DG_TEST_TRY(dg_tensor_to_f64(u, &v));
            dg_check(same_shape(u, good[k].ndim, good[k].shape) && v[0] == 1.0 &&
                         v[dg_tensor_numel(u) - 1] == (double)dg_tensor_numel(u),
                     "%s: shape %s, values 1..%lld", good[k].what, dg_tensor_desc(u),
                     (long long)dg_tensor_numel(u));
            free(v);
        }
        dg_tensor_free(&u);
    }
}

/* ---- malformed safetensors ---- */

static dg_status st_try(const char *path) {
    dg_safetensors st;
    dg_status s = dg_safetensors_load(g_ctx, path, &st);
    if (s != DG_OK && (st.n != 0 || st.names || st.tensors || st.n_meta))
        dg_check(0, "a failed safetensors load left the struct non-empty");
    dg_safetensors_free(&st);
    return s;
}

static void test_st_malformed(void) {
    char p[256];
    tmp_path(p, sizeof p, "bad.safetensors");
    float f4[4] = {1, 2, 3, 4};

    char missing[256];
    tmp_path(missing, sizeof missing, "missing.safetensors");
    dg_check_err(st_try(missing), DG_ERR_IO, "cannot open", "st: missing file");
    dg_safetensors st;
    dg_check_err(dg_safetensors_load(NULL, p, &st), DG_ERR_ARG, "ctx", "st: NULL ctx");
    dg_check_err(dg_safetensors_save(p, 1, NULL, NULL, 0, NULL, NULL), DG_ERR_ARG, "names",
                 "st: save with NULL names");
    {
        int64_t s1[1] = {2};
        dg_tensor *a = make_tensor(g_ctx, DG_F32, 1, s1);
        const char *nm[1] = {"__metadata__"};
        const dg_tensor *ts[1] = {a};
        dg_check_err(dg_safetensors_save(p, 1, nm, ts, 0, NULL, NULL), DG_ERR_ARG, "reserved",
                     "st: save a tensor named __metadata__");
        const char *mk[2] = {"k", "k"}, *mv[2] = {"1", "2"};
        dg_check_err(dg_safetensors_save(p, 0, NULL, NULL, 2, mk, mv), DG_ERR_ARG, "both 'k'",
                     "st: save duplicate metadata keys");
        dg_tensor_free(&a);
    }

    WRITE_LIT(p, "");
    dg_check_err(st_try(p), DG_ERR_FORMAT, "file is empty", "st: empty file");
    WRITE_LIT(p, "\x10\0\0");
    dg_check_err(st_try(p), DG_ERR_FORMAT, "too short", "st: 3-byte file");
    WRITE_LIT(p, "\0\0\0\0\0\0\0\0{}");
    dg_check_err(st_try(p), DG_ERR_FORMAT, "header length is 0", "st: header length 0");
    WRITE_LIT(p, "\0\0\0\0\0\x01\0\0{}");
    dg_check_err(st_try(p), DG_ERR_FORMAT, "exceeds the 100 MB limit", "st: header length 2^40");
    WRITE_LIT(p, "\xff\xff\xff\xff\xff\xff\xff\xff{}");
    dg_check_err(st_try(p), DG_ERR_FORMAT, "exceeds the 100 MB limit", "st: header length 2^64-1");
    WRITE_LIT(p, "\xe8\x03\0\0\0\0\0\0{\"a\": {}}");
    dg_check_err(st_try(p), DG_ERR_FORMAT, "larger than the rest of the file",
                 "st: header length 1000 in a 17-byte file");

    struct {
        const char *json;
        size_t ndata;
        dg_status want;
        const char *needle;
        const char *what;
    } cases[] = {
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}", 16,
         DG_ERR_FORMAT, "bad JSON header", "st: unterminated object"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},}", 16,
         DG_ERR_FORMAT, "expected a tensor name", "st: trailing comma"},
        {"{\"a\" {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_FORMAT, "expected ':'", "st: missing colon"},
        {"[1, 2, 3]", 16, DG_ERR_FORMAT, "must be a JSON object", "st: header is an array"},
        {"{'a': {}}", 16, DG_ERR_FORMAT, "expected a tensor name", "st: single quotes"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}} x", 16,
         DG_ERR_FORMAT, "unexpected text after", "st: text after the object"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 400]}}", 16,
         DG_ERR_FORMAT, "outside the data section (16 bytes)", "st: offsets out of range"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 16,
         DG_ERR_FORMAT, "spanning 4 bytes, but its shape and dtype F32 need 8",
         "st: wrong byte count"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, "
         "16]}}",
         16, DG_ERR_FORMAT, "byte count overflows", "st: shape overflows"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [0, 4294967296, 4294967296], \"data_offsets\": "
         "[0, 0]}}",
         16, DG_ERR_FORMAT, "extents too large", "st: zero extent beside overflowing ones"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}}", 16,
         DG_ERR_FORMAT, "invalid data_offsets [8, 0]", "st: begin > end"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}, \"a\": "
         "{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}",
         16, DG_ERR_FORMAT, "duplicate tensor name 'a'", "st: duplicate names"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 12]}, \"b\": "
         "{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}",
         16, DG_ERR_FORMAT, "'a' and 'b' overlap", "st: overlapping tensors"},
        {"{\"a\": {\"dtype\": \"F16\", \"shape\": [8], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_DTYPE, "tensor 'a' has dtype \"F16\"", "st: dtype F16 refused"},
        {"{\"w\": {\"dtype\": \"U8\", \"shape\": [16], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_DTYPE, "tensor 'w' has dtype \"U8\"", "st: dtype U8 refused"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [-4], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_FORMAT, "negative dimension (-4)", "st: negative dim"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,4], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_SHAPE, "more than DG_MAX_DIMS", "st: 6 dims"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4.0], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_FORMAT, "fraction or exponent", "st: float in shape"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [04], \"data_offsets\": [0, 16]}}", 16,
         DG_ERR_FORMAT, "leading zeros", "st: leading zero"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16, 32]}}", 16,
         DG_ERR_FORMAT, "exactly two integers", "st: three offsets"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4]}}", 16, DG_ERR_FORMAT,
         "tensor 'a' lacks \"data_offsets\"", "st: missing data_offsets"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16], \"x\": 1}}", 16,
         DG_ERR_FORMAT, "unknown key \"x\"", "st: unknown key"},
        {"{\"a\": {\"dtype\": \"F32\", \"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, "
         "16]}}",
         16, DG_ERR_FORMAT, "repeats the key \"dtype\"", "st: repeated key"},
        {"{\"__metadata__\": {\"k\": 3}}", 0, DG_ERR_FORMAT, "values must be strings",
         "st: non-string metadata value"},
        {"{\"__metadata__\": {\"k\": \"1\", \"k\": \"2\"}}", 0, DG_ERR_FORMAT,
         "duplicate \"__metadata__\" key \"k\"", "st: duplicate metadata key"},
        {"{\"__metadata__\": {}, \"__metadata__\": {}}", 0, DG_ERR_FORMAT,
         "duplicate \"__metadata__\"", "st: two metadata objects"},
        {"{\"a\\x\": {}}", 0, DG_ERR_FORMAT, "invalid escape", "st: bad escape"},
        {"{\"a\\u12G4\": {}}", 0, DG_ERR_FORMAT, "bad hex digit", "st: bad \\u escape"},
        {"{\"a\\ud800\": {}}", 0, DG_ERR_FORMAT, "unpaired high surrogate", "st: lone surrogate"},
        {"{\"a\\u0000\": {}}", 0, DG_ERR_FORMAT, "NUL", "st: NUL in a name"},
        {"{\"a\tb\": {}}", 0, DG_ERR_FORMAT, "control character", "st: raw tab in a name"},
        {"{\"a", 0, DG_ERR_FORMAT, "unterminated string", "st: unterminated name"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        write_st_raw(p, cases[k].json, f4, cases[k].ndata);
        dg_check_err(st_try(p), cases[k].want, cases[k].needle, cases[k].what);
    }

    /* Valid by hand: escapes decode, scalars load as [1], gaps between tensors are fine, empty
     * tensors take no bytes. */
    write_st_raw(p,
                 "{ \"caf\\u00e9\\n\\\"q\\\"\\ud83d\\ude00\" : {\"dtype\":\"F32\",\"shape\":[],"
                 "\"data_offsets\":[4,8]},\n \"b\":{\"shape\":[2],\"data_offsets\":[8,16],"
                 "\"dtype\":\"F32\"} , \"__metadata__\":{\"k\\/\":\"v\\t\"}}   ",
                 f4, 16);
    if (dg_check_ok(dg_safetensors_load(g_ctx, p, &st), "st: hand-written valid file")) {
        dg_tensor *a = dg_safetensors_get(&st, "caf\xc3\xa9\n\"q\"\xf0\x9f\x98\x80");
        dg_tensor *b = dg_safetensors_get(&st, "b");
        double va = 0, vb[2] = {0, 0};
        double *pb = NULL;
        if (a)
            dg_tensor_item(a, &va);
        if (b && dg_tensor_to_f64(b, &pb) == DG_OK) {
            vb[0] = pb[0];
            vb[1] = pb[1];
            free(pb);
        }
        dg_check(a && b && dg_tensor_ndim(a) == 1 && dg_tensor_shape(a)[0] == 1 && va == 2.0 &&
                     vb[0] == 3.0 && vb[1] == 4.0,
                 "st: \\u escapes (incl. a surrogate pair) decode; scalar -> [1]; gap skipped");
        const char *m = dg_safetensors_meta(&st, "k/");
        dg_check(m && strcmp(m, "v\t") == 0, "st: metadata escapes decode");
        dg_safetensors_free(&st);
    }
}

/* ---- NumPy interop ---- */

/* DG_IO_PYTHON overrides the interpreter (e.g. to check that the skip path works). */
static const char *k_py = "/usr/bin/python3";

static int have_numpy(void) {
    if (getenv("DG_IO_PYTHON"))
        k_py = getenv("DG_IO_PYTHON");
    if (access(k_py, X_OK) != 0) {
        printf("  (numpy interop skipped: %s is missing)\n", k_py);
        return 0;
    }
    char cmd[256];
    snprintf(cmd, sizeof cmd, "%s -c 'import numpy' >/dev/null 2>&1", k_py);
    if (system(cmd) != 0) {
        printf("  (numpy interop skipped: %s cannot import numpy)\n", k_py);
        return 0;
    }
    return 1;
}

static int run_python(const char *script_name, const char *script) {
    char sp[256], cmd[640];
    tmp_path(sp, sizeof sp, script_name);
    write_bytes(sp, script, strlen(script));
    snprintf(cmd, sizeof cmd, "%s %s %s", k_py, sp, g_dir);
    int rc = system(cmd);
    return rc;
}

/* The same values as test_value(), in Python. */
#define PY_PRELUDE                                                                                 \
    "import sys, os, json, struct\n"                                                               \
    "import numpy as np\n"                                                                         \
    "d = sys.argv[1]\n"                                                                            \
    "def val(dt, shape):\n"                                                                        \
    "    i = np.arange(int(np.prod(shape)), dtype=np.int64)\n"                                     \
    "    v = i * 3 - 5 if np.dtype(dt).kind == 'i' else (i % 9) * 0.25 - 1.0\n"                    \
    "    return v.astype(dt).reshape(shape)\n"

static void test_numpy_interop(void) {
    if (!have_numpy())
        return;
    /* numpy writes, we read. */
    const char *py_write = PY_PRELUDE
        "np.save(os.path.join(d, 'py_f8.npy'), val('<f8', (2, 3)))\n"
        "np.save(os.path.join(d, 'py_f4.npy'), val('<f4', (4,)))\n"
        "np.save(os.path.join(d, 'py_i4.npy'), val('<i4', (2, 2, 2)))\n"
        "np.save(os.path.join(d, 'py_i8.npy'), val('<i8', (1, 2, 1, 2, 2)))\n"
        "np.save(os.path.join(d, 'py_0d.npy'), np.float64(-1.0))\n"
        "with open(os.path.join(d, 'py_v2.npy'), 'wb') as f:\n"
        "    np.lib.format.write_array(f, val('<f4', (3, 2)), version=(2, 0))\n"
        "np.save(os.path.join(d, 'py_fortran.npy'), np.asfortranarray(val('<f8', (3, 2))))\n"
        "np.save(os.path.join(d, 'py_be.npy'), val('>f4', (3,)))\n"
        "np.save(os.path.join(d, 'py_f2.npy'), val('<f2', (3,)))\n"
        "np.save(os.path.join(d, 'py_bool.npy'), np.array([True, False]))\n";
    if (!dg_check(run_python("write.py", py_write) == 0, "numpy: python wrote test files"))
        return;
    struct {
        const char *file;
        dg_dtype dt;
        int ndim;
        int64_t shape[5];
    } ok[] = {
        {"py_f8.npy", DG_F64, 2, {2, 3}},    {"py_f4.npy", DG_F32, 1, {4}},
        {"py_i4.npy", DG_I32, 3, {2, 2, 2}}, {"py_i8.npy", DG_I64, 5, {1, 2, 1, 2, 2}},
        {"py_0d.npy", DG_F64, 1, {1}},       {"py_v2.npy", DG_F32, 2, {3, 2}},
    };
    char p[256], what[96];
    for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
        tmp_path(p, sizeof p, ok[k].file);
        snprintf(what, sizeof what, "numpy -> C: %s", ok[k].file);
        dg_tensor *u = NULL;
        if (dg_check_ok(dg_npy_load(g_ctx, p, &u), what)) {
            dg_tensor *w = make_tensor(g_ctx, ok[k].dt, ok[k].ndim, ok[k].shape);
            check_same(what, u, w, ok[k].dt);
            dg_tensor_free(&w);
        }
        dg_tensor_free(&u);
    }
    tmp_path(p, sizeof p, "py_fortran.npy");
    dg_check_err(npy_try(p), DG_ERR_UNSUPPORTED, "fortran_order", "numpy -> C: Fortran order");
    tmp_path(p, sizeof p, "py_be.npy");
    dg_check_err(npy_try(p), DG_ERR_DTYPE, "big-endian", "numpy -> C: big-endian");
    tmp_path(p, sizeof p, "py_f2.npy");
    dg_check_err(npy_try(p), DG_ERR_DTYPE, "float16", "numpy -> C: float16");
    tmp_path(p, sizeof p, "py_bool.npy");
    dg_check_err(npy_try(p), DG_ERR_DTYPE, "'|b1'", "numpy -> C: bool");

    /* We write, numpy reads; python exits non-zero on any mismatch. */
    struct {
        const char *file;
        dg_dtype dt;
        int ndim;
        int64_t shape[5];
    } out[] = {
        {"c_f64.npy", DG_F64, 2, {2, 3}},          {"c_f32.npy", DG_F32, 1, {5}},
        {"c_bf16.npy", DG_BF16, 3, {2, 1, 3}},     {"c_i32.npy", DG_I32, 4, {1, 2, 2, 2}},
        {"c_i64.npy", DG_I64, 5, {2, 1, 1, 2, 1}},
    };
    const char *st_names[5] = {"f64", "f32", "bf16", "i32", "i64"};
    dg_tensor *ts[5];
    for (int k = 0; k < 5; k++) {
        ts[k] = make_tensor(g_ctx, out[k].dt, out[k].ndim, out[k].shape);
        tmp_path(p, sizeof p, out[k].file);
        DG_TEST_TRY(dg_npy_save(p, ts[k]));
    }
    int64_t s34[2] = {3, 4};
    dg_tensor *x = make_tensor(g_ctx, DG_F32, 2, s34), *xt = NULL;
    DG_TEST_TRY(dg_transpose(x, 0, 1, &xt));
    tmp_path(p, sizeof p, "c_view.npy");
    DG_TEST_TRY(dg_npy_save(p, xt));
    tmp_path(p, sizeof p, "c.safetensors");
    const char *mk[1] = {"who"}, *mv[1] = {"deltagrad \"test\""};
    DG_TEST_TRY(dg_safetensors_save(p, 5, st_names, (const dg_tensor *const *)ts, 1, mk, mv));

    const char *py_read = PY_PRELUDE
        "bad = []\n"
        "def check(name, got, want):\n"
        "    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, "
        "want):\n"
        "        bad.append('%s: got %s %s %r' % (name, got.dtype, got.shape, got.ravel()[:4]))\n"
        "want = {'f64': val('<f8', (2, 3)), 'f32': val('<f4', (5,)),\n"
        "        'bf16': val('<f4', (2, 1, 3)), 'i32': val('<i4', (1, 2, 2, 2)),\n"
        "        'i64': val('<i8', (2, 1, 1, 2, 1))}\n"
        "for k, w in want.items():\n"
        "    check('c_%s.npy' % k, np.load(os.path.join(d, 'c_%s.npy' % k)), w)\n"
        "check('c_view.npy', np.load(os.path.join(d, 'c_view.npy')), val('<f4', (3, 4)).T)\n"
        "raw = open(os.path.join(d, 'c.safetensors'), 'rb').read()\n"
        "n = struct.unpack('<Q', raw[:8])[0]\n"
        "if (8 + n) % 8: bad.append('data section not 8-aligned')\n"
        "hdr = json.loads(raw[8:8 + n].decode('utf-8'))\n"
        "if hdr.get('__metadata__') != {'who': 'deltagrad \"test\"'}: bad.append('metadata')\n"
        "data = raw[8 + n:]\n"
        "np_of = {'F64': '<f8', 'F32': '<f4', 'I32': '<i4', 'I64': '<i8'}\n"
        "for k, w in want.items():\n"
        "    e = hdr[k]\n"
        "    b, en = e['data_offsets']\n"
        "    if e['dtype'] == 'BF16':\n"
        "        u = np.frombuffer(data[b:en], '<u2').astype('<u4') << 16\n"
        "        got = u.view('<f4').reshape(e['shape'])\n"
        "    else:\n"
        "        got = np.frombuffer(data[b:en], np_of[e['dtype']]).reshape(e['shape'])\n"
        "    check('safetensors ' + k, got, w)\n"
        "for m in bad: print('    python: MISMATCH', m)\n"
        "sys.exit(1 if bad else 0)\n";
    dg_check(run_python("read.py", py_read) == 0,
             "C -> numpy: 5 dtypes (bf16 as f32), a transposed view and a safetensors file "
             "read back by numpy/json with equal values");
    for (int k = 0; k < 5; k++)
        dg_tensor_free(&ts[k]);
    dg_tensor_free(&xt);
    dg_tensor_free(&x);
}

/* ---- fuzz: truncations and byte flips never crash ---- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_rand(void) { /* xorshift64*, deterministic */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 0x2545f4914f6cdd1dull;
}

typedef dg_status (*load_fn)(const char *path);

static void fuzz_file(const char *label, const char *path, load_fn load, size_t hdr_end,
                      int n_flips) {
    size_t n;
    unsigned char *orig = read_bytes(path, &n);
    unsigned char *buf = (unsigned char *)malloc(n);
    char fp[256];
    tmp_path(fp, sizeof fp, "fuzz.bin");

    /* Every truncation must be refused: each prefix lacks data the header promises. */
    int trunc_bad = 0, silent = 0;
    for (size_t len = 0; len < n; len++) {
        write_bytes(fp, orig, len);
        dg_clear_error();
        dg_status s = load(fp);
        if (s == DG_OK)
            trunc_bad++;
        else if (dg_last_error()[0] == '\0')
            silent++;
    }
    dg_check(trunc_bad == 0 && silent == 0,
             "%s fuzz: all %zu truncations refused (%d loaded, %d without a message)", label, n,
             trunc_bad, silent);

    /* Random flips, biased to the header where the parser lives, and to bytes that matter to it. */
    static const char special[] = "{}[]()\"',:-0123456789 \\eE.Lu\x00\xff\x7f\n";
    int loaded = 0, refused = 0;
    silent = 0;
    for (int k = 0; k < n_flips; k++) {
        memcpy(buf, orig, n);
        int nflip = 1 + (int)(next_rand() % 3);
        for (int f = 0; f < nflip; f++) {
            uint64_t r = next_rand();
            size_t pos = (r & 3) ? (size_t)((r >> 8) % hdr_end) : (size_t)((r >> 8) % n);
            if ((r >> 4) & 1)
                buf[pos] = (unsigned char)special[(r >> 40) % (sizeof special - 1)];
            else
                buf[pos] ^= (unsigned char)(1u << ((r >> 32) % 8));
        }
        write_bytes(fp, buf, n);
        dg_clear_error();
        dg_status s = load(fp);
        if (s == DG_OK) {
            loaded++;
        } else {
            refused++;
            if (dg_last_error()[0] == '\0')
                silent++;
        }
    }
    dg_check(silent == 0, "%s fuzz: %d corrupted copies: %d loaded, %d refused, all with a message",
             label, n_flips, loaded, refused);
    remove(fp);
    free(buf);
    free(orig);
}

static void test_fuzz(void) {
    /* DG_IO_FUZZ_SCALE=k multiplies the number of corrupted copies (for longer local runs). */
    const char *env = getenv("DG_IO_FUZZ_SCALE");
    int scale = env ? atoi(env) : 1;
    if (scale < 1)
        scale = 1;
    char p[256];
    int64_t s34[2] = {3, 4}, s2[1] = {2}, s223[3] = {2, 2, 3};
    dg_tensor *a = make_tensor(g_ctx, DG_F32, 2, s34);
    dg_tensor *b = make_tensor(g_ctx, DG_I64, 1, s2);
    dg_tensor *c = make_tensor(g_ctx, DG_BF16, 3, s223);

    tmp_path(p, sizeof p, "fuzz_src.npy");
    DG_TEST_TRY(dg_npy_save(p, a));
    fuzz_file("npy", p, npy_try, 128, 600 * scale);

    tmp_path(p, sizeof p, "fuzz_src.safetensors");
    const char *nm[3] = {"weight", "ids\\\"x", "b"};
    const dg_tensor *ts[3] = {a, b, c};
    const char *mk[1] = {"format"}, *mv[1] = {"pt"};
    DG_TEST_TRY(dg_safetensors_save(p, 3, nm, ts, 1, mk, mv));
    size_t n;
    unsigned char *raw = read_bytes(p, &n);
    size_t hdr_end = 8 + (size_t)raw[0] + ((size_t)raw[1] << 8);
    free(raw);
    fuzz_file("safetensors", p, st_try, hdr_end, 1500 * scale);

    dg_tensor_free(&a);
    dg_tensor_free(&b);
    dg_tensor_free(&c);
}

/* ---- GPU: device tensors are saved through the host and loaded into the given context ---- */

static void run_gpu(void) {
    dg_ctx *gctx = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gctx));
    char p[256];
    for (int k = 0; k < 5; k++) {
        dg_tensor *t = make_tensor(gctx, k_dtypes[k], 3, k_shapes[2]), *u = NULL;
        char what[96];
        snprintf(what, sizeof what, "cuda npy %s", dg_dtype_name(k_dtypes[k]));
        tmp_path(p, sizeof p, "gpu.npy");
        if (dg_check_ok(dg_npy_save(p, t), what) && dg_check_ok(dg_npy_load(gctx, p, &u), what)) {
            dg_check(dg_device_eq(dg_tensor_device(u), dg_cuda(0)), "%s: loaded on cuda:0", what);
            check_same(what, u, t, k_dtypes[k] == DG_BF16 ? DG_F32 : k_dtypes[k]);
        }
        dg_tensor_free(&u);
        dg_safetensors st;
        const char *nm[1] = {"t"};
        const dg_tensor *ts[1] = {t};
        snprintf(what, sizeof what, "cuda safetensors %s", dg_dtype_name(k_dtypes[k]));
        tmp_path(p, sizeof p, "gpu.safetensors");
        if (dg_check_ok(dg_safetensors_save(p, 1, nm, ts, 0, NULL, NULL), what) &&
            dg_check_ok(dg_safetensors_load(gctx, p, &st), what)) {
            dg_tensor *g = dg_safetensors_get(&st, "t");
            dg_check(g && dg_device_eq(dg_tensor_device(g), dg_cuda(0)), "%s: loaded on cuda:0",
                     what);
            check_same(what, g, t, k_dtypes[k]);
            dg_safetensors_free(&st);
        }
        dg_tensor_free(&t);
    }
    dg_ctx_free(&gctx);
}

static void make_temp_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/dg_io_XXXXXX");
    if (!mkdtemp(g_dir)) {
        fprintf(stderr, "FATAL: mkdtemp failed\nHINT: is /tmp writable?\n");
        exit(1);
    }
    printf("  temp dir %s\n", g_dir);
}

static void cpu_cases(dg_ctx *cpu) {
    make_temp_dir();
    g_ctx = cpu;
    test_npy_roundtrip();
    test_st_roundtrip();
    test_views();
    test_atomic();
    test_npy_malformed();
    test_st_malformed();
    test_numpy_interop();
    test_fuzz();
    g_ctx = NULL;
    remove_tree(g_dir);
}

static void gpu_cases(dg_ctx *cpu) {
    make_temp_dir();
    run_gpu();
    remove_tree(g_dir);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "io", cpu_cases, gpu_cases); }

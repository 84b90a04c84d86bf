/*
 * tensor/fileio.h -- the file plumbing that .npy and safetensors share (library-internal): exact
 * reads at an offset, the file size, an atomic writer (temp file + fsync + rename), a growable
 * string buffer for headers, and little-endian conversion for big-endian hosts.
 *
 * Every function reports failures through dg__err() with the operation name and the path, so a
 * caller can simply DG_TRY() them.
 */
#ifndef DG_FILEIO_INTERNAL_H
#define DG_FILEIO_INTERNAL_H

#include "tensor/tensor.h"

#include <stdio.h>

/* ---- reading ---- */
/* Open `path` for reading and get its size in bytes. Anything but a regular file (a FIFO, a
 * device, a socket, a directory) is refused with an error naming the path and what it is; the
 * open never blocks, so a FIFO without a writer does not hang the caller. Every reader of an
 * outside file (.npy, safetensors, checkpoints, training text) goes through here. */
dg_status dg__open_read(const char *op, const char *path, FILE **f, uint64_t *size);
/* DG_OK if `path` does not exist or is a regular file (links followed); else an error naming
 * what it is. For files about to be written or appended to. */
dg_status dg__check_not_special(const char *op, const char *path);
/* "directory", "FIFO (named pipe)", "character device", ... for an st_mode. */
const char *dg__file_kind(unsigned mode);
/* Read exactly n bytes at byte offset `off`. `what` names the part of the file for messages. */
dg_status dg__read_at(const char *op, const char *path, FILE *f, uint64_t off, void *dst, size_t n,
                      const char *what);

/* ---- atomic writing ----
 * Bytes go to "<path>.tmp.<pid>"; dg__aw_commit flushes, fsyncs, closes and renames it over
 * `path` (then fsyncs the directory, best effort). On any failure, or on dg__aw_abort, the temp
 * file is removed and an existing `path` is left untouched. */
typedef struct dg__awriter {
    FILE *f;
    char *tmp;
    const char *path;
    const char *op;
} dg__awriter;
dg_status dg__aw_open(const char *op, const char *path, dg__awriter *w);
/* On failure the writer is aborted (temp removed); the caller must not call abort again,
 * though doing so is harmless. */
dg_status dg__aw_write(dg__awriter *w, const void *buf, size_t n);
dg_status dg__aw_commit(dg__awriter *w);
void dg__aw_abort(dg__awriter *w);

/* ---- a growable, always NUL-terminated string ---- */
typedef struct dg__sbuf {
    char *s;
    size_t len, cap;
    int oom; /* sticky: an allocation failed; s then holds what fit */
} dg__sbuf;
void dg__sb_put(dg__sbuf *b, const char *s, size_t n);
void dg__sb_puts(dg__sbuf *b, const char *s);
void dg__sb_printf(dg__sbuf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void dg__sb_free(dg__sbuf *b);

/* ---- byte order ---- */
int dg__host_is_le(void);
/* Swap each `elem`-byte element of buf in place when the host is big-endian (files are LE). */
void dg__le_convert(void *buf, size_t n_elems, size_t elem);

/* ---- checked arithmetic ---- */
/* *out = a * b; returns 0 on overflow of uint64_t. */
static inline int dg__mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

#endif /* DG_FILEIO_INTERNAL_H */

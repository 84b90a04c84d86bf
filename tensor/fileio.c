/*
 * tensor/fileio.c -- file plumbing shared by the .npy and safetensors code (see fileio.h).
 * POSIX: fstat/fseeko for 64-bit sizes and offsets, fsync + rename for atomic saves.
 */
#define _POSIX_C_SOURCE 200809L

#include "tensor/fileio.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* ---- reading ---- */

const char *dg__file_kind(unsigned mode) {
    if (S_ISREG(mode))
        return "regular file";
    if (S_ISDIR(mode))
        return "directory";
    if (S_ISFIFO(mode))
        return "FIFO (named pipe)";
    if (S_ISCHR(mode))
        return "character device";
    if (S_ISBLK(mode))
        return "block device";
    if (S_ISSOCK(mode))
        return "socket";
    return "special file";
}

dg_status dg__open_read(const char *op, const char *path, FILE **f, uint64_t *size) {
    *f = NULL;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO that has no writer would otherwise wait forever. The mode is
     * checked on the open descriptor (no window between a stat and the open), and blocking reads
     * are restored before a regular file is handed out. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        int e = errno;
        struct stat st;
        if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) /* a socket cannot be opened at all */
            return dg__err(DG_ERR_IO, "%s: '%s' is a %s, not a regular file", op, path,
                           dg__file_kind((unsigned)st.st_mode));
        return dg__err(DG_ERR_IO, "%s: cannot open '%s' for reading: %s", op, path, strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return dg__err(DG_ERR_IO, "%s: cannot stat '%s': %s", op, path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return dg__err(DG_ERR_IO, "%s: '%s' is a %s, not a regular file", op, path,
                       dg__file_kind((unsigned)st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(fd);
        return dg__err(DG_ERR_IO, "%s: cannot set up reading of '%s': %s", op, path, strerror(e));
    }
    FILE *fp = fdopen(fd, "rb");
    if (!fp) {
        int e = errno;
        close(fd);
        return dg__err(DG_ERR_IO, "%s: cannot open '%s' for reading: %s", op, path, strerror(e));
    }
    *f = fp;
    *size = (uint64_t)st.st_size;
    return DG_OK;
}

dg_status dg__check_not_special(const char *op, const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT)
            return DG_OK;
        return dg__err(DG_ERR_IO, "%s: cannot stat '%s': %s", op, path, strerror(errno));
    }
    if (S_ISLNK(st.st_mode) && stat(path, &st) != 0)
        return DG_OK; /* a dangling link: creating the file replaces it */
    if (!S_ISREG(st.st_mode))
        return dg__err(DG_ERR_IO, "%s: '%s' is a %s, not a regular file", op, path,
                       dg__file_kind((unsigned)st.st_mode));
    return DG_OK;
}

dg_status dg__read_at(const char *op, const char *path, FILE *f, uint64_t off, void *dst, size_t n,
                      const char *what) {
    if (n == 0)
        return DG_OK;
    if (off > (uint64_t)INT64_MAX || fseeko(f, (off_t)off, SEEK_SET) != 0)
        return dg__err(DG_ERR_IO, "%s: '%s': cannot seek to byte %llu (%s)", op, path,
                       (unsigned long long)off, what);
    size_t got = fread(dst, 1, n, f);
    if (got != n) {
        if (ferror(f))
            return dg__err(DG_ERR_IO, "%s: '%s': read error in %s: %s", op, path, what,
                           strerror(errno));
        return dg__err(DG_ERR_FORMAT,
                       "%s: '%s': file is truncated in %s: wanted %zu bytes, found %zu", op, path,
                       what, n, got);
    }
    return DG_OK;
}

/* ---- atomic writing ---- */

dg_status dg__aw_open(const char *op, const char *path, dg__awriter *w) {
    memset(w, 0, sizeof *w);
    w->op = op;
    w->path = path;
    size_t len = strlen(path) + 32;
    w->tmp = (char *)DG_MALLOC(len);
    if (!w->tmp)
        return dg__err(DG_ERR_NOMEM, "%s: out of memory for the temp file name", op);
    snprintf(w->tmp, len, "%s.tmp.%ld", path, (long)getpid());
    w->f = fopen(w->tmp, "wb");
    if (!w->f) {
        int e = errno;
        dg_status s = dg__err(DG_ERR_IO, "%s: cannot create temp file '%s' for '%s': %s", op,
                              w->tmp, path, strerror(e));
        DG_FREE(w->tmp);
        w->tmp = NULL;
        return s;
    }
    return DG_OK;
}

void dg__aw_abort(dg__awriter *w) {
    if (w->f) {
        fclose(w->f);
        w->f = NULL;
    }
    if (w->tmp) {
        remove(w->tmp);
        DG_FREE(w->tmp);
        w->tmp = NULL;
    }
}

dg_status dg__aw_write(dg__awriter *w, const void *buf, size_t n) {
    if (!w->f)
        return dg__err(DG_ERR_STATE, "%s: write to a closed file '%s'", w->op, w->path);
    if (n && fwrite(buf, 1, n, w->f) != n) {
        int e = errno;
        dg_status s =
            dg__err(DG_ERR_IO, "%s: write to '%s' failed: %s", w->op, w->tmp, strerror(e));
        dg__aw_abort(w);
        return s;
    }
    return DG_OK;
}

/* fsync the directory holding `path` so the rename itself is durable. Best effort: some
 * filesystems refuse fsync on directories, and the data is already safe by then. */
static void sync_parent_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash) {
        dir = (char *)DG_MALLOC(2);
        if (!dir)
            return;
        strcpy(dir, ".");
    } else {
        size_t n = slash == path ? 1 : (size_t)(slash - path);
        dir = (char *)DG_MALLOC(n + 1);
        if (!dir)
            return;
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
    DG_FREE(dir);
}

dg_status dg__aw_commit(dg__awriter *w) {
    if (!w->f)
        return dg__err(DG_ERR_STATE, "%s: commit of a closed file '%s'", w->op, w->path);
    const char *step = NULL;
    if (fflush(w->f) != 0)
        step = "flush";
    else if (fsync(fileno(w->f)) != 0)
        step = "fsync";
    if (step) {
        int e = errno;
        dg_status s =
            dg__err(DG_ERR_IO, "%s: %s of '%s' failed: %s", w->op, step, w->tmp, strerror(e));
        dg__aw_abort(w);
        return s;
    }
    int rc = fclose(w->f);
    w->f = NULL;
    if (rc != 0) {
        int e = errno;
        dg_status s = dg__err(DG_ERR_IO, "%s: closing '%s' failed: %s", w->op, w->tmp, strerror(e));
        dg__aw_abort(w);
        return s;
    }
    if (rename(w->tmp, w->path) != 0) {
        int e = errno;
        dg_status s = dg__err(DG_ERR_IO, "%s: cannot rename '%s' to '%s': %s", w->op, w->tmp,
                              w->path, strerror(e));
        dg__aw_abort(w);
        return s;
    }
    DG_FREE(w->tmp);
    w->tmp = NULL;
    sync_parent_dir(w->path);
    return DG_OK;
}

/* ---- string buffer ---- */

static int sb_reserve(dg__sbuf *b, size_t extra) {
    if (b->oom)
        return 0;
    if (extra > SIZE_MAX - b->len - 1) {
        b->oom = 1;
        return 0;
    }
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *s = (char *)DG_REALLOC(b->s, cap);
    if (!s) {
        b->oom = 1;
        return 0;
    }
    b->s = s;
    b->cap = cap;
    return 1;
}

void dg__sb_put(dg__sbuf *b, const char *s, size_t n) {
    if (!sb_reserve(b, n))
        return;
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

void dg__sb_puts(dg__sbuf *b, const char *s) { dg__sb_put(b, s, strlen(s)); }

void dg__sb_printf(dg__sbuf *b, const char *fmt, ...) {
    char small[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = 1;
        return;
    }
    if ((size_t)n < sizeof small) {
        dg__sb_put(b, small, (size_t)n);
        return;
    }
    if (!sb_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void dg__sb_free(dg__sbuf *b) {
    DG_FREE(b->s);
    memset(b, 0, sizeof *b);
}

/* ---- byte order ---- */

int dg__host_is_le(void) {
    const uint16_t one = 1;
    unsigned char c;
    memcpy(&c, &one, 1);
    return c == 1;
}

void dg__le_convert(void *buf, size_t n_elems, size_t elem) {
    if (dg__host_is_le() || elem < 2)
        return;
    unsigned char *p = (unsigned char *)buf;
    for (size_t i = 0; i < n_elems; i++, p += elem)
        for (size_t a = 0, z = elem - 1; a < z; a++, z--) {
            unsigned char t = p[a];
            p[a] = p[z];
            p[z] = t;
        }
}

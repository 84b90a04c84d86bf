/*
 * tensor/safetensors.h -- the parsed safetensors header (library-internal), shared by the strict
 * JSON header reader (safetensors_header.c) and the load/save code (safetensors.c).
 */
#ifndef DG_SAFETENSORS_INTERNAL_H
#define DG_SAFETENSORS_INTERNAL_H

#include "tensor/fileio.h"

/* The reference implementation refuses headers over 100 MB; so do we, both ways. */
#define DG__ST_MAX_HEADER (100ull * 1000 * 1000)

/* safetensors dtype names, indexed by dg_dtype: "F64", "F32", "BF16", "I32", "I64". */
extern const char *const dg__st_dtype_names[DG_NDTYPES];

/* One tensor entry; shape holds ndim dims (ndim 0 for a scalar). Offsets are relative to the
 * start of the data section. */
typedef struct dg__st_entry {
    char *name;
    dg_dtype dtype;
    int ndim;
    int64_t shape[DG_MAX_DIMS];
    uint64_t begin, end;
} dg__st_entry;

typedef struct dg__st_header {
    dg__st_entry *e; /* n entries in header order */
    int n, cap;
    char **mk, **mv; /* nm "__metadata__" pairs */
    int nm, mcap;
    int seen_meta;
} dg__st_header;

/* Parse the `len` header bytes at `text` (file bytes 8 .. 8+len) into *h, then validate them
 * against a data section of data_len bytes: offsets in range, byte spans matching shape x dtype,
 * unique names and metadata keys, no overlapping spans. Errors name `path`. On failure *h may
 * hold partial results: always call dg__st_header_free. */
dg_status dg__st_header_parse(const char *path, const char *text, size_t len, uint64_t data_len,
                              dg__st_header *h);
void dg__st_header_free(dg__st_header *h);

#endif /* DG_SAFETENSORS_INTERNAL_H */

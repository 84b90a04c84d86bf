/*
 * kernels/runtime.cu -- per-context CUDA state: stream, cuBLAS handle, and a caching allocator.
 *
 * The allocator rounds each request to a size class (multiples of 512 B, or of 1/8 of the request's
 * power of two above 4 KiB, so at most 12.5% is wasted) and keeps freed blocks in a list keyed by
 * class. A training step asks for the same sizes every time, so after the first step nothing goes
 * to cudaMalloc. On an out-of-memory error the cache is emptied and the call retried once.
 * Frees are stream-ordered: a block is reused only by work queued later on the same stream.
 *
 * The context also owns its bad-input record (dg_deverr, see cuda_api.h): allocated outside the
 * cache, committed by a one-thread kernel queued after each checking launch, read by the host.
 */
#include "common.cuh"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

typedef struct dg_cuda_block {
    size_t size;
    void *ptr;
} dg_cuda_block;

/* A read-only table uploaded once per context (see dg__cuda_table). */
typedef struct dg_cuda_table {
    uint64_t hash;
    size_t bytes;
    void *host; /* the bytes it was made from, to compare on a hash match */
    void *dev;
} dg_cuda_table;

/* Tables kept per context: enough for every shape a training run or a test suite uses. */
enum { DG_TABLES_MAX = 256 };
#define DG_TABLE_BYTES_MAX ((size_t)64 << 20)

struct dg_cuda_alloc {
    dg_cuda_block *free_list;
    int n, cap;
    dg_cuda_table tables[DG_TABLES_MAX];
    int ntables;
    size_t table_bytes;
};

static size_t size_class(size_t n) {
    if (n <= 4096)
        return (n + 511) & ~(size_t)511;
    size_t p = 1;
    while (p < n)
        p <<= 1;
    size_t g = p >> 3;
    return (n + g - 1) / g * g;
}

extern "C" int dg__cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no device" error */
        return 0;
    }
    return n;
}

extern "C" dg_status dg__cuda_ctx_init(dg_ctx *ctx) {
    DG_CHECK_CUDA(cudaSetDevice(ctx->device.index));
    cudaStream_t st;
    DG_CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ctx->stream = st;
    cublasHandle_t h;
    cublasStatus_t cs = cublasCreate(&h);
    if (cs != CUBLAS_STATUS_SUCCESS) {
        cudaStreamDestroy(st);
        return dg__err(DG_ERR_CUBLAS, "cublasCreate failed: %s", cublasGetStatusString(cs));
    }
    /* f32 GEMMs stay true f32 (no TF32): the CUDA-vs-CPU tests hold f32 to 1e-5. */
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    cublasSetStream(h, st);
    ctx->cublas = h;
    ctx->alloc = (dg_cuda_alloc *)calloc(1, sizeof(dg_cuda_alloc));
    if (!ctx->alloc) {
        cublasDestroy(h);
        cudaStreamDestroy(st);
        return dg__err(DG_ERR_NOMEM, "dg_ctx_new: out of host memory");
    }
    /* the bad-input record: nothing pending, nothing recorded */
    dg_deverr init;
    memset(&init, 0, sizeof init);
    init.pending = ULLONG_MAX;
    cudaError_t e = cudaMalloc(&ctx->deverr, sizeof(dg_deverr));
    if (e == cudaSuccess)
        e = cudaMemcpy(ctx->deverr, &init, sizeof init, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        cudaGetLastError();
        dg__cuda_ctx_destroy(ctx);
        return dg__err(DG_ERR_CUDA, "dg_ctx_new: allocating the bad-input record on %s failed: %s",
                       dg_device_str(ctx->device), cudaGetErrorString(e));
    }
    return DG_OK;
}

// ---- the bad-input record

__global__ void deverr_commit_kernel(dg_deverr *e, dg_deverr_site site, const void *idx,
                                     int idx_i64) {
    unsigned long long p = e->pending;
    if (p == ULLONG_MAX)
        return;
    if (e->count == 0) {
        e->pos = (long long)p;
        e->value = idx_i64 ? ((const long long *)idx)[p] : (long long)((const int *)idx)[p];
        e->site = site;
    }
    e->count++;
    e->pending = ULLONG_MAX;
}

extern "C" dg_deverr *dg__deverr(dg_ctx *ctx) { return (dg_deverr *)ctx->deverr; }

extern "C" dg_status dg__deverr_commit(dg_ctx *ctx, const dg_deverr_site *site, dg_dtype idt,
                                       const void *idx) {
    deverr_commit_kernel<<<1, 1, 0, dg__stream(ctx)>>>(dg__deverr(ctx), *site, idx,
                                                       idt == DG_I64);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__deverr_read(dg_ctx *ctx, dg_deverr *out) {
    dg_deverr *e = dg__deverr(ctx);
    DG_CHECK_CUDA(cudaMemcpyAsync(out, e, sizeof *out, cudaMemcpyDeviceToHost, dg__stream(ctx)));
    DG_CHECK_CUDA(cudaStreamSynchronize(dg__stream(ctx)));
    if (out->count > 0) /* pending is already reset by the commit */
        DG_CHECK_CUDA(cudaMemsetAsync(&e->count, 0, sizeof e->count, dg__stream(ctx)));
    return DG_OK;
}

extern "C" void dg__cuda_empty_cache(dg_ctx *ctx) {
    dg_cuda_alloc *a = ctx->alloc;
    if (!a)
        return;
    cudaStreamSynchronize(dg__stream(ctx));
    for (int i = 0; i < a->n; i++) {
        cudaFree(a->free_list[i].ptr);
        ctx->stats.reserved -= a->free_list[i].size;
    }
    ctx->stats.cached = 0;
    a->n = 0;
}

extern "C" void dg__cuda_ctx_destroy(dg_ctx *ctx) {
    cudaSetDevice(ctx->device.index);
    if (ctx->stream)
        cudaStreamSynchronize(dg__stream(ctx));
    dg__cuda_empty_cache(ctx);
    if (ctx->alloc) {
        for (int i = 0; i < ctx->alloc->ntables; i++) {
            cudaFree(ctx->alloc->tables[i].dev);
            free(ctx->alloc->tables[i].host);
        }
        free(ctx->alloc->free_list);
        free(ctx->alloc);
        ctx->alloc = NULL;
    }
    if (ctx->cublas)
        cublasDestroy(dg__cublas(ctx));
    if (ctx->stream)
        cudaStreamDestroy(dg__stream(ctx));
    if (ctx->deverr)
        cudaFree(ctx->deverr);
    ctx->deverr = NULL;
    ctx->cublas = NULL;
    ctx->stream = NULL;
}

extern "C" dg_status dg__cuda_sync(dg_ctx *ctx) {
    DG_CHECK_CUDA(cudaStreamSynchronize(dg__stream(ctx)));
    return DG_OK;
}

extern "C" dg_status dg__cuda_malloc(dg_ctx *ctx, size_t bytes, void **ptr) {
    dg_cuda_alloc *a = ctx->alloc;
    size_t sz = size_class(bytes);
    for (int i = a->n - 1; i >= 0; i--) {
        if (a->free_list[i].size == sz) {
            *ptr = a->free_list[i].ptr;
            a->free_list[i] = a->free_list[--a->n];
            ctx->stats.cached -= sz;
            goto done;
        }
    }
    {
        cudaError_t e = cudaMalloc(ptr, sz);
        if (e == cudaErrorMemoryAllocation) {
            cudaGetLastError();
            dg__cuda_empty_cache(ctx);
            e = cudaMalloc(ptr, sz);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            return dg__err(DG_ERR_NOMEM, "cudaMalloc of %zu bytes on %s failed: %s (in use %zu, "
                           "reserved %zu)", sz, dg_device_str(ctx->device), cudaGetErrorString(e),
                           ctx->stats.in_use, ctx->stats.reserved);
        }
        ctx->stats.reserved += sz;
    }
done:
    ctx->stats.in_use += sz;
    if (ctx->stats.in_use > ctx->stats.peak_in_use)
        ctx->stats.peak_in_use = ctx->stats.in_use;
    return DG_OK;
}

extern "C" void dg__cuda_free(dg_ctx *ctx, void *ptr, size_t bytes) {
    if (!ptr)
        return;
    dg_cuda_alloc *a = ctx->alloc;
    size_t sz = size_class(bytes);
    ctx->stats.in_use -= sz;
    if (a->n == a->cap) {
        int cap = a->cap ? 2 * a->cap : 256;
        dg_cuda_block *p = (dg_cuda_block *)realloc(a->free_list, (size_t)cap * sizeof *p);
        if (!p) { /* cannot cache it: give it back */
            cudaFree(ptr);
            ctx->stats.reserved -= sz;
            return;
        }
        a->free_list = p;
        a->cap = cap;
    }
    a->free_list[a->n++] = dg_cuda_block{sz, ptr};
    ctx->stats.cached += sz;
}

extern "C" dg_status dg__cuda_memcpy(dg_ctx *ctx, void *dst, const void *src, size_t bytes,
                                     dg_copy_kind k) {
    if (!bytes)
        return DG_OK;
    cudaMemcpyKind kind = k == DG_COPY_H2D   ? cudaMemcpyHostToDevice
                          : k == DG_COPY_D2H ? cudaMemcpyDeviceToHost
                                             : cudaMemcpyDeviceToDevice;
    DG_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, dg__stream(ctx)));
    if (k != DG_COPY_D2D)
        DG_CHECK_CUDA(cudaStreamSynchronize(dg__stream(ctx)));
    return DG_OK;
}

/* FNV-1a over the bytes: tables are small (a few KB), and a hit is confirmed with memcmp. */
static uint64_t table_hash(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

extern "C" dg_status dg__cuda_table(dg_ctx *ctx, const void *host, size_t bytes, const void **dev) {
    *dev = NULL;
    dg_cuda_alloc *a = ctx->alloc;
    if (!a || !host || !bytes)
        return dg__err(DG_ERR_ARG, "dg__cuda_table: context, host and bytes > 0 are required");
    const uint64_t h = table_hash(host, bytes);
    for (int i = 0; i < a->ntables; i++) {
        const dg_cuda_table *t = &a->tables[i];
        if (t->hash == h && t->bytes == bytes && memcmp(t->host, host, bytes) == 0) {
            *dev = t->dev;
            return DG_OK;
        }
    }
    if (a->ntables == DG_TABLES_MAX || a->table_bytes + bytes > DG_TABLE_BYTES_MAX)
        return DG_OK; /* full: the caller keeps a copy of its own */
    void *hcopy = malloc(bytes);
    if (!hcopy)
        return dg__err(DG_ERR_NOMEM, "dg__cuda_table: no host memory for %zu bytes", bytes);
    memcpy(hcopy, host, bytes);
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, bytes);
    if (e == cudaSuccess) {
        /* synchronous: host may be freed by the caller as soon as this returns */
        e = cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, dg__stream(ctx));
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(dg__stream(ctx));
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        cudaFree(d);
        free(hcopy);
        return dg__err(e == cudaErrorMemoryAllocation ? DG_ERR_NOMEM : DG_ERR_CUDA,
                       "dg__cuda_table: upload of %zu bytes on %s failed: %s", bytes,
                       dg_device_str(ctx->device), cudaGetErrorString(e));
    }
    a->tables[a->ntables++] = dg_cuda_table{h, bytes, hcopy, d};
    a->table_bytes += bytes;
    ctx->stats.reserved += bytes;
    *dev = d;
    return DG_OK;
}

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
 *
 * CUDA graphs (dg_graph_*). While a context captures, nothing may call cudaMalloc/cudaFree or
 * wait for the stream: a request the cache cannot serve, or a chunk table the context has not
 * uploaded yet, fails with DG_ERR_STATE and marks the capture failed (dg_graph_end reports it and
 * discards the capture); host copies and syncs are refused without failing it. A replay writes
 * the same addresses the capture wrote, so a block the capture touched must not go to anyone
 * else while the graph exists: every block handed out or freed during a graph's capture is owned
 * by that graph (a hash map ptr -> graph, `own`). When an owned block is freed it goes to its
 * graph's free list (its pool), which only that graph's capture draws from; dg_graph_free gives
 * the pool back to the context's cache and drops the ownership of blocks still in use. Every
 * host array the capture may need (the pool's list, the map) is sized at dg_graph_begin: the
 * blocks a capture can touch are the ones that exist then, since it never creates any.
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

/* A block's owner graph; ptr != NULL with g == NULL is a deleted entry (the key stays so that
 * probing goes on past it). */
typedef struct dg_owned {
    void *ptr;
    dg_graph *g;
} dg_owned;

struct dg_cuda_alloc {
    dg_cuda_block *free_list;
    int n, cap;
    int64_t nlive; /* blocks handed out and not freed */
    dg_cuda_table tables[DG_TABLES_MAX];
    int ntables;
    size_t table_bytes;
    dg_graph *capture; /* the graph being captured, or NULL */
    dg_graph *graphs;  /* every graph of the context (the one being captured too) */
    dg_owned *own;     /* open addressing, linear probing, load <= 1/2 */
    size_t own_cap, own_used, own_live; /* slots, slots ever used, live entries */
    void *cublas_ws; /* cuBLAS's workspace (see dg__cuda_ctx_init), outside the cache */
    size_t cublas_ws_bytes;
};

/* A captured graph and its pool (kernels/cuda_api.h, include/deltagrad.h). */
struct dg_graph {
    dg_ctx *ctx;          /* NULL once the context is freed */
    cudaGraphExec_t exec; /* NULL until the capture ends well */
    dg_cuda_block *pool;  /* owned blocks that are free: for this graph's capture only */
    int npool, cap;       /* cap: every block the capture could own (fixed at begin) */
    dg_status status;     /* the first failure during the capture */
    char msg[768];        /* ... and its message */
    int freed;            /* given up (dg_graph_free) during another capture: released after it */
    dg_graph *next;
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
    /* cuBLAS's workspace: a buffer of the context's own, set once. Without it cuBLAS takes one
     * from its default pool, and during a CUDA graph capture allocates one (stream-ordered)
     * that the graph then holds. With it an eager GEMM and the same GEMM captured in a graph
     * run with the same workspace, so cuBLAS picks the same algorithm for both, and a capture
     * allocates nothing. Size: cuBLAS's recommendation, 32 MiB from Hopper on, 4 MiB before. */
    int major = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device.index);
    const size_t ws = (size_t)(major >= 9 ? 32 : 4) << 20;
    if (e == cudaSuccess)
        e = cudaMalloc(&ctx->alloc->cublas_ws, ws);
    if (e == cudaSuccess) {
        ctx->alloc->cublas_ws_bytes = ws;
        ctx->stats.reserved += ws;
        cs = cublasSetWorkspace(h, ctx->alloc->cublas_ws, ws);
    }
    if (e != cudaSuccess || cs != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();
        dg__cuda_ctx_destroy(ctx);
        return dg__err(e == cudaErrorMemoryAllocation ? DG_ERR_NOMEM
                       : e != cudaSuccess             ? DG_ERR_CUDA
                                                      : DG_ERR_CUBLAS,
                       "dg_ctx_new: setting up cuBLAS's workspace of %zu bytes on %s failed: %s",
                       ws, dg_device_str(ctx->device),
                       e != cudaSuccess ? cudaGetErrorString(e) : cublasGetStatusString(cs));
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
    deverr_commit_kernel<<<1, 1, 0, dg__stream(ctx)>>>(dg__deverr(ctx), *site, idx, idt == DG_I64);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

// ---- capture state

extern "C" int dg__cuda_capturing(const dg_ctx *ctx) {
    return ctx && ctx->device.kind == DG_DEV_CUDA && ctx->alloc && ctx->alloc->capture;
}

/* Record the first failure of the capture in progress (its message: the thread's last error, set
 * by the caller) and return s. */
static dg_status capture_fail(dg_ctx *ctx, dg_status s) {
    dg_graph *g = ctx->alloc->capture;
    if (g && g->status == DG_OK) {
        g->status = s;
        snprintf(g->msg, sizeof g->msg, "%s", dg_last_error());
    }
    return s;
}

/* A call that would make the host wait for the stream, refused during a capture (it does not
 * fail the capture: nothing was queued). */
static dg_status refused(const dg_ctx *ctx, const char *what) {
    return dg__err(DG_ERR_STATE,
                   "%s on %s is not allowed while the context captures a CUDA graph (between "
                   "dg_graph_begin and dg_graph_end): it makes the host wait for the device; do it "
                   "before the capture, or after dg_graph_end / dg_graph_launch",
                   what, dg_device_str(ctx->device));
}

// ---- which graph owns a block (open addressing on the pointer, see the top of the file)

static size_t own_slot(const void *p, size_t cap) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static dg_graph *own_find(const dg_cuda_alloc *a, const void *p) {
    if (!a->own_live)
        return NULL;
    for (size_t i = own_slot(p, a->own_cap);; i = (i + 1) & (a->own_cap - 1)) {
        if (!a->own[i].ptr)
            return NULL;
        if (a->own[i].ptr == p)
            return a->own[i].g; /* NULL: a deleted entry */
    }
}

/* p becomes g's unless a graph owns it already (the first owner keeps it). Room was reserved by
 * own_reserve, so the table never fills. */
static void own_add(dg_cuda_alloc *a, void *p, dg_graph *g) {
    for (size_t i = own_slot(p, a->own_cap);; i = (i + 1) & (a->own_cap - 1)) {
        dg_owned *o = &a->own[i];
        if (o->ptr == p) {
            if (!o->g) {
                o->g = g;
                a->own_live++;
            }
            return;
        }
        if (!o->ptr) {
            o->ptr = p;
            o->g = g;
            a->own_used++;
            a->own_live++;
            return;
        }
    }
}

/* Room for `extra` more entries at load <= 1/2 (rebuilt without deleted entries when short). */
static int own_reserve(dg_cuda_alloc *a, size_t extra) {
    if (a->own_cap && 2 * (a->own_used + extra) <= a->own_cap)
        return 1;
    size_t cap = 64;
    while (cap < 2 * (a->own_live + extra))
        cap <<= 1;
    dg_owned *t = (dg_owned *)calloc(cap, sizeof *t);
    if (!t)
        return 0;
    dg_owned *old = a->own;
    const size_t old_cap = a->own_cap;
    a->own = t;
    a->own_cap = cap;
    a->own_used = a->own_live = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].ptr && old[i].g)
            own_add(a, old[i].ptr, old[i].g);
    free(old);
    return 1;
}

static void own_drop(dg_cuda_alloc *a, const dg_graph *g) {
    for (size_t i = 0; i < a->own_cap; i++)
        if (a->own[i].ptr && a->own[i].g == g) {
            a->own[i].g = NULL;
            a->own_live--;
        }
}

// ---- the context's cache

/* Keep a free block for reuse. When the list cannot grow (no host memory) the block goes back to
 * the driver, except during a capture (no cudaFree then): it stays reserved, unused. */
static void cache_put(dg_ctx *ctx, void *ptr, size_t sz) {
    dg_cuda_alloc *a = ctx->alloc;
    if (a->n == a->cap) {
        int cap = a->cap ? 2 * a->cap : 256;
        dg_cuda_block *p = (dg_cuda_block *)realloc(a->free_list, (size_t)cap * sizeof *p);
        if (!p) {
            if (!a->capture && cudaFree(ptr) == cudaSuccess)
                ctx->stats.reserved -= sz;
            else /* nothing the caller can do; keep the error out of later checks */
                cudaGetLastError();
            return;
        }
        a->free_list = p;
        a->cap = cap;
    }
    a->free_list[a->n++] = dg_cuda_block{sz, ptr};
    ctx->stats.cached += sz;
}

/* A graph's pool holds its free blocks; its capacity covers every block the graph can own. */
static void pool_put(dg_ctx *ctx, dg_graph *g, void *ptr, size_t sz) {
    DG_ASSERT(g->npool < g->cap);
    g->pool[g->npool++] = dg_cuda_block{sz, ptr};
    ctx->stats.graph += sz;
}

// ---- the bad-input record, read by the host

extern "C" dg_status dg__deverr_read(dg_ctx *ctx, dg_deverr *out) {
    if (dg__cuda_capturing(ctx))
        return refused(ctx, "reading the bad-input record");
    dg_deverr *e = dg__deverr(ctx);
    DG_CHECK_CUDA(cudaMemcpyAsync(out, e, sizeof *out, cudaMemcpyDeviceToHost, dg__stream(ctx)));
    DG_CHECK_CUDA(cudaStreamSynchronize(dg__stream(ctx)));
    if (out->count > 0) /* pending is already reset by the commit */
        DG_CHECK_CUDA(cudaMemsetAsync(&e->count, 0, sizeof e->count, dg__stream(ctx)));
    return DG_OK;
}

extern "C" void dg__cuda_empty_cache(dg_ctx *ctx) {
    dg_cuda_alloc *a = ctx->alloc;
    if (!a || a->capture) /* no sync and no cudaFree during a capture */
        return;
    if (cudaStreamSynchronize(dg__stream(ctx)) != cudaSuccess) {
        cudaGetLastError(); /* a failed launch's error; the blocks are still freed below */
    }
    int kept = 0;
    for (int i = 0; i < a->n; i++) {
        if (cudaFree(a->free_list[i].ptr) == cudaSuccess) {
            ctx->stats.reserved -= a->free_list[i].size;
            ctx->stats.cached -= a->free_list[i].size;
        } else {
            cudaGetLastError();
            a->free_list[kept++] = a->free_list[i];
        }
    }
    a->n = kept;
}

// ---- graphs

/* Give a graph up: its executable, its ownership of blocks still in use (they go back to the
 * cache when their tensors are freed) and its pool (into the cache now: a block handed out from
 * there is used by work queued later on the same stream, after the graph's launches). Freed
 * while its context captures another graph, it is only marked: the capture may still be
 * recording frees into its pool, and an executable is not destroyed in the middle of one. */
static void graph_release(dg_graph *g) {
    dg_ctx *ctx = g->ctx;
    if (ctx) {
        dg_cuda_alloc *a = ctx->alloc;
        if (a->capture && a->capture != g) {
            g->freed = 1;
            return;
        }
        if (g->exec && cudaGraphExecDestroy(g->exec) != cudaSuccess)
            cudaGetLastError(); /* in-flight launches finish on their own; nothing else to do */
        for (dg_graph **p = &a->graphs; *p; p = &(*p)->next)
            if (*p == g) {
                *p = g->next;
                break;
            }
        own_drop(a, g);
        for (int i = 0; i < g->npool; i++) {
            ctx->stats.graph -= g->pool[i].size;
            cache_put(ctx, g->pool[i].ptr, g->pool[i].size);
        }
    }
    free(g->pool);
    free(g);
}

/* Graphs given up during a capture, released once it is over. */
static void release_freed(dg_cuda_alloc *a) {
    for (dg_graph *g = a->graphs, *next; g; g = next) {
        next = g->next;
        if (g->freed)
            graph_release(g);
    }
}

extern "C" dg_status dg__cuda_graph_begin(dg_ctx *ctx) {
    dg_cuda_alloc *a = ctx->alloc;
    const char *dev = dg_device_str(ctx->device);
    if (a->capture)
        return dg__err(DG_ERR_STATE,
                       "dg_graph_begin: %s is already capturing a graph (one capture at a time per "
                       "context: end it with dg_graph_end first)",
                       dev);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    DG_CHECK_CUDA(cudaStreamIsCapturing(dg__stream(ctx), &cs));
    if (cs != cudaStreamCaptureStatusNone)
        return dg__err(DG_ERR_STATE, "dg_graph_begin: the stream of %s is already capturing", dev);
    /* The blocks this capture can own are the ones that exist now (it creates none): the cache's
     * and those in use. Everything the allocator needs for them is allocated here. */
    const int64_t nb = (int64_t)a->n + a->nlive;
    if (nb >= INT32_MAX)
        return dg__err(DG_ERR_NOMEM, "dg_graph_begin: %lld device blocks are too many to track",
                       (long long)nb);
    dg_graph *g = (dg_graph *)calloc(1, sizeof *g);
    if (g)
        g->pool = (dg_cuda_block *)malloc((size_t)(nb ? nb : 1) * sizeof *g->pool);
    if (!g || !g->pool || !own_reserve(a, (size_t)nb)) {
        if (g)
            free(g->pool);
        free(g);
        return dg__err(DG_ERR_NOMEM, "dg_graph_begin: no host memory to track %lld device blocks",
                       (long long)nb);
    }
    g->cap = (int)nb;
    g->ctx = ctx;
    g->status = DG_OK;
    cudaError_t e = cudaStreamBeginCapture(dg__stream(ctx), cudaStreamCaptureModeGlobal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(g->pool);
        free(g);
        return dg__err(DG_ERR_CUDA, "dg_graph_begin: cudaStreamBeginCapture on %s failed: %s", dev,
                       cudaGetErrorString(e));
    }
    g->next = a->graphs;
    a->graphs = g;
    a->capture = g;
    return DG_OK;
}

extern "C" dg_status dg__cuda_graph_end(dg_ctx *ctx, dg_graph **out) {
    *out = NULL;
    dg_cuda_alloc *a = ctx->alloc;
    dg_graph *g = a->capture;
    const char *dev = dg_device_str(ctx->device);
    if (!g)
        return dg__err(DG_ERR_STATE,
                       "dg_graph_end: %s is not capturing a graph (no dg_graph_begin)", dev);
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(dg__stream(ctx), &graph);
    if (e == cudaErrorStreamCaptureWrongThread) { /* still capturing */
        cudaGetLastError();
        return dg__err(DG_ERR_STATE,
                       "dg_graph_end: the capture on %s was begun on another thread: "
                       "end it on that thread",
                       dev);
    }
    a->capture = NULL;
    dg_status st = DG_OK;
    if (g->status != DG_OK) {
        st = dg__err(g->status,
                     "dg_graph_end: the capture on %s failed and was discarded (the "
                     "context works as before): %s",
                     dev, g->msg);
    } else if (e != cudaSuccess) {
        st = dg__err(DG_ERR_CUDA,
                     "dg_graph_end: the capture on %s was invalidated and discarded: "
                     "%s (a call CUDA forbids during a capture ran on this thread, or on another "
                     "one: the capture runs in CUDA's global mode; the context works as before)",
                     dev, cudaGetErrorString(e));
    } else {
        cudaGraphExec_t exec = NULL;
        e = cudaGraphInstantiateWithFlags(&exec, graph, 0);
        if (e == cudaSuccess)
            g->exec = exec;
        else
            st =
                dg__err(DG_ERR_CUDA, "dg_graph_end: cudaGraphInstantiateWithFlags on %s failed: %s",
                        dev, cudaGetErrorString(e));
    }
    if (e != cudaSuccess)
        cudaGetLastError();
    if (graph) {
        e = cudaGraphDestroy(graph); /* the executable does not need it */
        if (e != cudaSuccess) {
            cudaGetLastError();
            if (st == DG_OK)
                st = dg__err(DG_ERR_CUDA, "dg_graph_end: cudaGraphDestroy on %s failed: %s", dev,
                             cudaGetErrorString(e));
        }
    }
    if (st != DG_OK)
        graph_release(g);
    release_freed(a);
    if (st == DG_OK)
        *out = g;
    return st;
}

extern "C" dg_status dg__cuda_graph_launch(dg_ctx *ctx, const dg_graph *g) {
    if (g->ctx != ctx || !g->exec)
        return dg__err(DG_ERR_ARG, "dg_graph_launch: the graph was not captured on %s",
                       dg_device_str(ctx->device));
    if (ctx->alloc->capture)
        return dg__err(DG_ERR_STATE,
                       "dg_graph_launch: %s is capturing a graph: launch after "
                       "dg_graph_end",
                       dg_device_str(ctx->device));
    DG_CHECK_CUDA(cudaGraphLaunch(g->exec, dg__stream(ctx)));
    return DG_OK;
}

extern "C" void dg__cuda_graph_free(dg_graph *g) {
    if (g)
        graph_release(g);
}

// ---- the context

extern "C" void dg__cuda_ctx_destroy(dg_ctx *ctx) {
    if (cudaSetDevice(ctx->device.index) != cudaSuccess)
        cudaGetLastError();
    dg_cuda_alloc *a = ctx->alloc;
    void *cublas_ws = a ? a->cublas_ws : NULL; /* freed after the handle that uses it */
    if (a && a->capture) {                     /* abandon it: nothing it recorded ever runs */
        dg_graph *g = a->capture;
        cudaGraph_t graph = NULL;
        if (cudaStreamEndCapture(dg__stream(ctx), &graph) != cudaSuccess)
            cudaGetLastError(); /* an invalidated capture: no graph */
        if (graph && cudaGraphDestroy(graph) != cudaSuccess)
            cudaGetLastError();
        a->capture = NULL;
        graph_release(g);
        release_freed(a);
    }
    if (ctx->stream && cudaStreamSynchronize(dg__stream(ctx)) != cudaSuccess)
        cudaGetLastError();
    if (a) {
        /* graphs the user still holds: no more launches; their pools go back to the driver and
         * dg_graph_free then frees only the host object */
        for (dg_graph *g = a->graphs, *next; g; g = next) {
            next = g->next;
            if (g->exec && cudaGraphExecDestroy(g->exec) != cudaSuccess)
                cudaGetLastError();
            g->exec = NULL;
            for (int i = 0; i < g->npool; i++)
                if (cudaFree(g->pool[i].ptr) == cudaSuccess)
                    ctx->stats.reserved -= g->pool[i].size;
                else
                    cudaGetLastError();
            ctx->stats.graph = 0;
            g->npool = 0;
            g->ctx = NULL;
            g->next = NULL;
            if (g->freed) { /* nobody holds it any more */
                free(g->pool);
                free(g);
            }
        }
        a->graphs = NULL;
    }
    dg__cuda_empty_cache(ctx);
    if (a) {
        for (int i = 0; i < a->ntables; i++) {
            cudaFree(a->tables[i].dev);
            free(a->tables[i].host);
        }
        free(a->free_list);
        free(a->own);
        free(a);
        ctx->alloc = NULL;
    }
    if (ctx->cublas)
        cublasDestroy(dg__cublas(ctx));
    if (cublas_ws)
        cudaFree(cublas_ws);
    if (ctx->stream)
        cudaStreamDestroy(dg__stream(ctx));
    if (ctx->deverr)
        cudaFree(ctx->deverr);
    cudaGetLastError();
    ctx->deverr = NULL;
    ctx->cublas = NULL;
    ctx->stream = NULL;
}

extern "C" dg_status dg__cuda_sync(dg_ctx *ctx) {
    if (dg__cuda_capturing(ctx))
        return refused(ctx, "a sync");
    DG_CHECK_CUDA(cudaStreamSynchronize(dg__stream(ctx)));
    return DG_OK;
}

// ---- the allocator

extern "C" dg_status dg__cuda_malloc(dg_ctx *ctx, size_t bytes, void **ptr) {
    dg_cuda_alloc *a = ctx->alloc;
    size_t sz = size_class(bytes);
    dg_graph *g = a->capture;
    if (g) /* first the blocks this capture freed (they stay the graph's) */
        for (int i = g->npool - 1; i >= 0; i--)
            if (g->pool[i].size == sz) {
                *ptr = g->pool[i].ptr;
                g->pool[i] = g->pool[--g->npool];
                ctx->stats.graph -= sz;
                goto done;
            }
    for (int i = a->n - 1; i >= 0; i--) {
        if (a->free_list[i].size == sz) {
            *ptr = a->free_list[i].ptr;
            a->free_list[i] = a->free_list[--a->n];
            ctx->stats.cached -= sz;
            if (g)
                own_add(a, *ptr, g);
            goto done;
        }
    }
    if (g)
        return capture_fail(
            ctx, dg__err(DG_ERR_STATE,
                         "allocation of %zu bytes (size class %zu) on %s during graph capture "
                         "missed the cache: run the step once eagerly first, and free what it "
                         "returned, before dg_graph_begin (a capture cannot call cudaMalloc)",
                         bytes, sz, dg_device_str(ctx->device)));
    {
        cudaError_t e = cudaMalloc(ptr, sz);
        if (e == cudaErrorMemoryAllocation) {
            cudaGetLastError();
            dg__cuda_empty_cache(ctx);
            e = cudaMalloc(ptr, sz);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            return dg__err(DG_ERR_NOMEM,
                           "cudaMalloc of %zu bytes on %s failed: %s (in use %zu, "
                           "reserved %zu)",
                           sz, dg_device_str(ctx->device), cudaGetErrorString(e), ctx->stats.in_use,
                           ctx->stats.reserved);
        }
        ctx->stats.reserved += sz;
    }
done:
    a->nlive++;
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
    a->nlive--;
    /* a graph's block, or one the capture in progress may have used: kept for that graph */
    dg_graph *g = own_find(a, ptr);
    if (!g && a->capture) {
        g = a->capture;
        own_add(a, ptr, g);
    }
    if (g)
        pool_put(ctx, g, ptr, sz);
    else
        cache_put(ctx, ptr, sz);
}

extern "C" dg_status dg__cuda_memcpy(dg_ctx *ctx, void *dst, const void *src, size_t bytes,
                                     dg_copy_kind k) {
    if (!bytes)
        return DG_OK;
    if (k != DG_COPY_D2D && dg__cuda_capturing(ctx))
        return refused(ctx, k == DG_COPY_H2D ? "a copy from host memory" : "a copy to host memory");
    cudaMemcpyKind kind = k == DG_COPY_H2D   ? cudaMemcpyHostToDevice
                          : k == DG_COPY_D2H ? cudaMemcpyDeviceToHost
                                             : cudaMemcpyDeviceToDevice;
    DG_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, dg__stream(ctx)));
    if (k != DG_COPY_D2D)
        DG_CHECK_CUDA(cudaStreamSynchronize(dg__stream(ctx)));
    return DG_OK;
}

// ---- staged uploads (dg_stage, tensor/stage.c)

extern "C" dg_status dg__cuda_host_alloc(dg_ctx *ctx, size_t bytes, void **host) {
    *host = NULL;
    cudaError_t e = cudaHostAlloc(host, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *host = NULL;
        return dg__err(e == cudaErrorMemoryAllocation ? DG_ERR_NOMEM : DG_ERR_CUDA,
                       "cudaHostAlloc of %zu page-locked bytes (for %s) failed: %s", bytes,
                       dg_device_str(ctx->device), cudaGetErrorString(e));
    }
    return DG_OK;
}

extern "C" void dg__cuda_host_free(void *host) {
    if (host && cudaFreeHost(host) != cudaSuccess)
        cudaGetLastError();
}

extern "C" dg_status dg__cuda_event_new(dg_ctx *ctx, void **ev) {
    *ev = NULL;
    DG_CHECK_CUDA(cudaSetDevice(ctx->device.index));
    cudaEvent_t e;
    DG_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *ev = (void *)e;
    return DG_OK;
}

extern "C" void dg__cuda_event_free(void *ev) {
    if (ev && cudaEventDestroy((cudaEvent_t)ev) != cudaSuccess)
        cudaGetLastError();
}

extern "C" dg_status dg__cuda_event_record(dg_ctx *ctx, void *ev) {
    DG_CHECK_CUDA(cudaEventRecord((cudaEvent_t)ev, dg__stream(ctx)));
    return DG_OK;
}

extern "C" dg_status dg__cuda_event_wait(void *ev) {
    DG_CHECK_CUDA(cudaEventSynchronize((cudaEvent_t)ev));
    return DG_OK;
}

extern "C" dg_status dg__cuda_memcpy_h2d_async(dg_ctx *ctx, void *dst, const void *host,
                                               size_t bytes) {
    if (dg__cuda_capturing(ctx))
        return refused(ctx, "an upload from a host buffer");
    if (!bytes)
        return DG_OK;
    DG_CHECK_CUDA(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, dg__stream(ctx)));
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
    const int full = a->ntables == DG_TABLES_MAX || a->table_bytes + bytes > DG_TABLE_BYTES_MAX;
    if (a->capture) /* an upload (cudaMalloc, a synchronous copy) cannot be captured */
        return capture_fail(
            ctx, dg__err(DG_ERR_STATE,
                         "a device table of %zu bytes (e.g. the KDA chunk tables of a sequence "
                         "layout) is not on %s and cannot be uploaded during graph capture%s: run "
                         "the step once eagerly first, before dg_graph_begin",
                         bytes, dg_device_str(ctx->device),
                         full ? " (the context's table space, 256 tables / 64 MiB, is full, so a "
                                "call with this layout can never be captured)"
                              : ""));
    if (full)
        return DG_OK; /* the caller keeps a copy of its own */
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

/*
 * deltagrad.h -- the public API of libdeltagrad: tensors, a tape-based autograd, the ops a small
 * language model needs, and the chunked Kimi Delta Attention (KDA) operator with every stage of
 * the chunked algorithm as its own tape node.
 *
 * ---------------------------------------------------------------------------------------------
 * A five-minute tour
 *
 *     dg_ctx *ctx;                                     // one per device: CPU, or CUDA:n
 *     dg_ctx_new(dg_cpu(), &ctx);
 *     int64_t shape[2] = {4, 3};
 *     dg_tensor *x, *w, *y, *loss;
 *     dg_tensor_new(ctx, DG_F64, 2, shape, &x);
 *     dg_tensor_rand_normal(x, 42, 0.0, 1.0);           // counter-based: same numbers on CPU and
 * GPU
 *     ... w likewise, shape {3, 3} ...
 *     dg_tensor_set_requires_grad(w, 1);                // w is a leaf the tape tracks
 *     dg_matmul(ctx, x, w, &y);                         // records a node on the tape
 *     dg_sum_all(ctx, y, &loss);
 *     dg_tape_backward(ctx, loss);                      // walks the tape in reverse
 *     const dg_tensor *gw = dg_tensor_grad(w);          // d loss / d w, same shape as w
 *     dg_tape_reset();                                  // drops every node and saved tensor
 *     dg_tensor_free(&x); ...                           // whoever creates frees
 *
 * Every call returns a dg_status; on failure dg_last_error() says what was wrong, naming the
 * argument and the expected shape, dtype or device. Nothing in the library prints or exits.
 *
 * ---------------------------------------------------------------------------------------------
 * Dimension letters, used in every shape comment of the project
 *
 *   B   batch rows                    T   tokens per row (varlen: total tokens, with B = 1)
 *   H   query/key heads               HV  value heads (HV % H == 0; HV = H unless GVA)
 *   K   key head dim                  V   value head dim
 *   BT  chunk size of the chunked KDA algorithm (64 by default; 16 and 32 allowed)
 *   NT  chunks per sequence = ceil(T / BT)   N  number of sequences
 *   d   model width                   I   MLP width
 *
 * Tensors are row-major with element strides; the KDA tensors are time-major, [B,T,H,K].
 *
 * ---------------------------------------------------------------------------------------------
 * Ownership
 *
 *   - dg_tensor objects are reference counted. Every function that hands out a tensor through an
 *     `out` pointer gives the caller one reference; dg_tensor_free() drops it and sets the
 *     pointer to NULL. Views share storage with their source and keep it alive.
 *   - The tape holds references to the tensors its nodes saved until dg_tape_reset().
 *   - A tensor that requires grad owns its gradient (dg_tensor_grad()).
 *   - DG_MALLOC / DG_FREE may be defined at build time to route host allocations.
 */
#ifndef DELTAGRAD_H
#define DELTAGRAD_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this header (semantic versioning; while the major version is 0, a new minor
 * version may change the API and the ABI, a new patch version changes neither). dg_version()
 * gives the version of the library actually linked, which must equal DG_VERSION. */
#define DG_VERSION_MAJOR 0
#define DG_VERSION_MINOR 9
#define DG_VERSION_PATCH 0
#define DG__VERSION_STR2(a, b, c) #a "." #b "." #c
#define DG__VERSION_STR(a, b, c) DG__VERSION_STR2(a, b, c)
#define DG_VERSION DG__VERSION_STR(DG_VERSION_MAJOR, DG_VERSION_MINOR, DG_VERSION_PATCH)
/* One number for #if comparisons: 0.9.0 is 900, 1.2.3 is 10203. */
#define DG_VERSION_NUMBER (DG_VERSION_MAJOR * 10000 + DG_VERSION_MINOR * 100 + DG_VERSION_PATCH)
#define DG_MAX_DIMS 5

/* =============================================================================================
 * Status and errors
 * ============================================================================================= */

typedef enum dg_status {
    DG_OK = 0,
    DG_ERR_ARG,         /* a bad argument: NULL, out of range, inconsistent options */
    DG_ERR_SHAPE,       /* shapes do not match what the op expects */
    DG_ERR_DTYPE,       /* unsupported or mismatched dtype */
    DG_ERR_DEVICE,      /* tensors on different devices, or the op has no kernel there */
    DG_ERR_NOMEM,       /* host or device allocation failed */
    DG_ERR_IO,          /* a file could not be opened, read or written */
    DG_ERR_FORMAT,      /* a malformed .npy / safetensors / checkpoint file */
    DG_ERR_CUDA,        /* a CUDA runtime call failed */
    DG_ERR_CUBLAS,      /* a cuBLAS call failed */
    DG_ERR_NCCL,        /* an NCCL call failed */
    DG_ERR_UNSUPPORTED, /* built without the feature (CUDA, NCCL) or not implemented for it */
    DG_ERR_STATE,       /* called at the wrong time (backward on an empty tape, ...) */
    DG_ERR_NUMERIC,     /* a non-finite value where a finite one is required */
    DG_ERR_COMM,        /* a communication call failed, or a peer did not answer in time */
} dg_status;

/* The reason for the last failure on this thread ("" if none). */
const char *dg_last_error(void);
/* A short name for a status code ("DG_ERR_SHAPE"). */
const char *dg_status_str(dg_status s);
/* Forget the last error. */
void dg_clear_error(void);

/* =============================================================================================
 * Devices and contexts
 * ============================================================================================= */

typedef enum dg_dtype { DG_F64 = 0, DG_F32, DG_BF16, DG_I32, DG_I64, DG_NDTYPES } dg_dtype;
typedef enum dg_device_kind { DG_DEV_CPU = 0, DG_DEV_CUDA = 1 } dg_device_kind;
typedef struct dg_device {
    dg_device_kind kind;
    int index; /* CUDA ordinal; 0 for the CPU */
} dg_device;

dg_device dg_cpu(void);
dg_device dg_cuda(int index);
int dg_device_eq(dg_device a, dg_device b);
/* "cpu", "cuda:0". The returned pointer is to a per-thread buffer. */
const char *dg_device_str(dg_device d);
/* Parse "cpu", "cuda", "cuda:1". */
dg_status dg_device_parse(const char *s, dg_device *out);

size_t dg_dtype_size(dg_dtype t);
const char *dg_dtype_name(dg_dtype t); /* "f64", "f32", "bf16", "i32", "i64" */
dg_status dg_dtype_parse(const char *s, dg_dtype *out);
int dg_dtype_is_float(dg_dtype t);

/* Was the library built with CUDA / NCCL? */
int dg_have_cuda(void);
int dg_have_nccl(void);
/* The library's version ("0.9.0"; DG_VERSION of the header it was built with), the git commit
 * it was built from ("unknown" outside a git checkout; "-dirty" appended when the tree had
 * uncommitted changes) and the CUDA architectures its kernels were compiled for ("90", "80,90";
 * "none" without CUDA). Static strings. */
const char *dg_version(void);
int dg_version_number(void);
const char *dg_build_commit(void);
const char *dg_build_cuda_archs(void);
/* Number of usable CUDA devices: 0 when built without CUDA or when no device is present. */
int dg_cuda_device_count(void);

/* A context owns what one device needs: for CUDA a stream, a cuBLAS handle and a caching
 * allocator (so a training loop does not cudaMalloc every step). Tensors are created in a context
 * and live on its device; an op runs in the context of its inputs' device. */
typedef struct dg_ctx dg_ctx;

dg_status dg_ctx_new(dg_device dev, dg_ctx **out);
void dg_ctx_free(dg_ctx **ctx);
dg_device dg_ctx_device(const dg_ctx *ctx);
/* Wait for all work queued in the context (a no-op on the CPU). */
dg_status dg_ctx_sync(dg_ctx *ctx);
/* Bad inputs that CUDA kernels find (an embedding id, a cross-entropy target outside
 * [0, Vocab)) are recorded in device memory, one record per context. By default the op reads the
 * record back at once (one sync per call) and fails like the CPU op. With deferred checks on
 * (dg_ctx_defer_checks(ctx, 1), e.g. inside a training step) ops only record: the first bad input
 * since the last check (op, argument, position, value) stays on the device, later ones are
 * counted, and no host sync is needed; dg_ctx_check_errors reads the record (one sync), clears it
 * and returns that error. A bad call's outputs stay well defined (a bad id gives a zero row and
 * no gradient, a bad target a zero row loss) and nothing is read out of bounds. On the CPU ops
 * always check on the spot: both calls do nothing there. */
void dg_ctx_defer_checks(dg_ctx *ctx, int on);
dg_status dg_ctx_check_errors(dg_ctx *ctx);
/* Device memory statistics of the context's allocator (0 on the CPU). */
typedef struct dg_mem_stats {
    size_t in_use;      /* bytes handed out to live tensors */
    size_t peak_in_use; /* high-water mark of in_use since the last reset */
    size_t cached;      /* bytes held in free lists for reuse */
    size_t reserved;    /* bytes obtained from the driver */
    size_t graph;       /* free bytes kept for CUDA graphs (dg_graph_free moves them to cached) */
} dg_mem_stats;
dg_mem_stats dg_ctx_mem_stats(const dg_ctx *ctx);
void dg_ctx_reset_peak(dg_ctx *ctx);
/* Give cached device blocks back to the driver (not those kept for graphs; nothing during a
 * capture). */
void dg_ctx_empty_cache(dg_ctx *ctx);

/* ---- CUDA graphs ----
 * A CUDA context can record the device work that a sequence of calls queues (e.g. a training
 * step's forward and backward) into a CUDA graph, then replay it with one launch (docs/runtime.md:
 * the procedure, the memory rule, which calls have been checked for capture).
 * A replay runs no host code (no argument checks, no tape, no allocator): it repeats the
 * recorded kernels and copies on the very same device addresses. So the sequence must do the
 * same thing every time, and new inputs are copied into the tensors the capture read (a
 * device-to-device dg_tensor_copy_, outside the graph) before each launch.
 *
 *     ... run the step once eagerly ...     // uploads tables, fills the cache, loads kernels
 *     dg_tape_reset(); free its outputs; dg_tensor_zero_grad(...)  // release what it kept
 *     dg_graph_begin(ctx);
 *     ... the step's calls (they queue nothing that runs now) ...
 *     dg_graph_end(ctx, &g);                       // on any failure: the capture is discarded
 *     for each step: copy inputs in; dg_graph_launch(ctx, g); read outputs and gradients
 *     dg_graph_free(&g);
 *
 * Between begin and end:
 *   - Memory comes from the context's cache only (a capture cannot call cudaMalloc). A request
 *     the cache cannot serve fails with DG_ERR_STATE ("allocation of N bytes during graph capture
 *     missed the cache: run the step once eagerly first ...") and fails the capture. Likewise a
 *     KDA call whose chunk tables (one per sequence layout and chunk size) the context has not
 *     uploaded yet. The warm-up fills the cache when what it returned (outputs, gradients, the
 *     tape's saved tensors) is freed before dg_graph_begin.
 *   - Calls that make the host wait for the device are refused with DG_ERR_STATE and queue
 *     nothing, without failing the capture: dg_ctx_sync, dg_tensor_to_host (to_f64, item, the
 *     file savers), dg_tensor_from_host (from_f64), dg_tensor_copy_ between host and device,
 *     dg_ctx_check_errors, and an embedding or cross-entropy that checks its indices at once.
 *     With dg_ctx_defer_checks on, those ops only record bad inputs on the device, on every
 *     replay; dg_ctx_check_errors after a launch reads the record as usual.
 *   - The outputs the calls return hold their values only after a launch.
 *   - Profiling (dg_profile_enable) does not time a capture.
 *   - The capture uses CUDA's global capture mode: no thread may make a call that CUDA forbids
 *     during a capture (cudaMalloc, a synchronous copy, ...; e.g. work on another context that
 *     misses its cache) until dg_graph_end; end it on the thread that began it.
 * dg_graph_end must follow every dg_graph_begin that succeeded: it returns the capture's first
 * failure (DG_ERR_STATE, or DG_ERR_CUDA when CUDA invalidated the capture) and then leaves no
 * graph (*out = NULL): the context is usable eagerly again at once.
 *
 * Memory rule. A replay writes the blocks its capture wrote. So every device block that was
 * handed out, or freed, during a graph's capture belongs to that graph until dg_graph_free: when
 * it is freed (during the capture, or later: an output, a gradient, the tape's saved tensors at
 * dg_tape_reset) it is kept for the graph (dg_mem_stats.graph) instead of going back to the
 * cache, and only that graph's capture reuses it. dg_graph_free gives those blocks back to the
 * cache (blocks still in use return to it when their tensors are freed). Tensors made before the
 * capture and read or written by it (inputs, weights, gradients it accumulates into) are the
 * caller's: keep them alive, and do not free them, while the graph may be launched. Tensors the
 * capture returned (outputs, gradients of leaves that had none) are rewritten by every launch.
 * A gradient that existed before the capture is accumulated into by every launch, as the
 * captured backward did.
 *
 * On a CPU context (and in builds without CUDA) every call is DG_ERR_UNSUPPORTED. */
typedef struct dg_graph dg_graph;
dg_status dg_graph_begin(dg_ctx *ctx);
dg_status dg_graph_end(dg_ctx *ctx, dg_graph **out);
/* Queue one replay on ctx's stream (asynchronous, like any op). g must come from ctx; refused
 * while ctx is capturing. */
dg_status dg_graph_launch(dg_ctx *ctx, const dg_graph *g);
/* Destroy the graph (launches in flight finish first) and release its blocks; sets *g = NULL.
 * Free every graph before its context (a graph outliving it can only be freed). */
void dg_graph_free(dg_graph **g);
/* Is ctx between dg_graph_begin and dg_graph_end? */
int dg_graph_capturing(const dg_ctx *ctx);

/* =============================================================================================
 * Tensors
 * ============================================================================================= */

typedef struct dg_tensor dg_tensor;

/* New tensor with uninitialised contents, contiguous, on ctx's device. */
dg_status dg_tensor_new(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                        dg_tensor **out);
dg_status dg_tensor_zeros(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                          dg_tensor **out);
/* New tensor filled from host memory holding numel values of `dtype`, row-major. */
dg_status dg_tensor_from_host(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                              const void *data, dg_tensor **out);
/* New tensor of `dtype` filled from host doubles (converted; bf16 rounds to nearest even). */
dg_status dg_tensor_from_f64(dg_ctx *ctx, dg_dtype dtype, int ndim, const int64_t *shape,
                             const double *data, dg_tensor **out);
/* Copy the tensor's values, in logical row-major order and its own dtype, to host memory.
 * `bytes` must be at least numel * dtype size. Works for views and device tensors. */
dg_status dg_tensor_to_host(const dg_tensor *t, void *dst, size_t bytes);
/* Copy to a freshly malloc'd host array of doubles (caller frees with free()). */
dg_status dg_tensor_to_f64(const dg_tensor *t, double **out);
/* The value of a one-element tensor. */
dg_status dg_tensor_item(const dg_tensor *t, double *out);

dg_tensor *dg_tensor_retain(dg_tensor *t);
void dg_tensor_free(dg_tensor **t);

int dg_tensor_ndim(const dg_tensor *t);
const int64_t *dg_tensor_shape(const dg_tensor *t);
const int64_t *dg_tensor_strides(const dg_tensor *t); /* in elements */
int64_t dg_tensor_dim(const dg_tensor *t, int axis);  /* negative axis counts from the end */
int64_t dg_tensor_numel(const dg_tensor *t);
size_t dg_tensor_nbytes(const dg_tensor *t);
dg_dtype dg_tensor_dtype(const dg_tensor *t);
dg_device dg_tensor_device(const dg_tensor *t);
dg_ctx *dg_tensor_ctx(const dg_tensor *t);
int dg_tensor_is_contiguous(const dg_tensor *t);
/* Pointer to the first element (device pointer for CUDA tensors). */
void *dg_tensor_data(const dg_tensor *t);
/* "[2,3,4] f32 cuda:0" into a per-thread buffer, for messages. */
const char *dg_tensor_desc(const dg_tensor *t);
/* Optional name used in error messages and dumps. */
void dg_tensor_set_name(dg_tensor *t, const char *name);
const char *dg_tensor_name(const dg_tensor *t);

/* Views (no copy; differentiable). reshape needs a contiguous source and accepts one -1. */
dg_status dg_reshape(dg_tensor *t, int ndim, const int64_t *shape, dg_tensor **out);
dg_status dg_slice(dg_tensor *t, int axis, int64_t start, int64_t end, dg_tensor **out);
dg_status dg_transpose(dg_tensor *t, int axis0, int axis1, dg_tensor **out);
/* Copies (differentiable). contiguous() returns a new reference to t when already contiguous. */
dg_status dg_contiguous(dg_ctx *ctx, dg_tensor *t, dg_tensor **out);
/* Float to integer conversion rounds toward zero and saturates at the integer type's range;
 * NaN becomes 0 (never undefined behaviour). */
dg_status dg_to_dtype(dg_ctx *ctx, dg_tensor *t, dg_dtype dtype, dg_tensor **out);
/* Copy to the device of `dst_ctx`. */
dg_status dg_to_device(dg_ctx *dst_ctx, dg_tensor *t, dg_tensor **out);
/* Elementwise copy src -> dst (same shape; dtype converted; devices may differ). Not recorded. */
dg_status dg_tensor_copy_(dg_tensor *dst, const dg_tensor *src);

/* ---- staged uploads ----
 * A dg_stage moves data from host memory into device tensors without making the host wait
 * (dg_tensor_from_host and dg_tensor_copy_ from the host are synchronous). It holds two host
 * buffers of `bytes` each, page-locked on CUDA (so a copy out of them runs asynchronously),
 * used in turn:
 *
 *     dg_stage_new(ctx, bytes, &s);
 *     each step: dg_stage_next(s, &buf); write the step's data to buf; dg_stage_upload(s, dst);
 *                then queue the work that reads dst (ops, or dg_graph_launch)
 *     dg_stage_free(&s);
 *
 * dg_stage_next hands out the buffer the last upload did not use, after waiting on the host
 * until the device has finished the copy that the upload before it queued from that buffer:
 * a buffer is never rewritten while a copy may still read it, and the host runs at most two
 * uploads ahead of the device. Write to the buffer only between dg_stage_next and
 * dg_stage_upload. dg_stage_upload queues a copy of the buffer's first dg_tensor_nbytes(dst)
 * bytes into dst (contiguous, on the stage's context, at most `bytes` bytes) on the context's
 * stream, ordered with the context's other work like any op, and returns at once. On a CPU
 * context the buffers are ordinary memory and the upload is a memcpy. Both calls are refused
 * (DG_ERR_STATE, nothing queued) while the context captures a CUDA graph: a replay would read
 * the buffer at launch time, whatever it then holds; upload before dg_graph_launch instead. */
typedef struct dg_stage dg_stage;
dg_status dg_stage_new(dg_ctx *ctx, size_t bytes, dg_stage **out);
dg_status dg_stage_next(dg_stage *s, void **buf);
dg_status dg_stage_upload(dg_stage *s, dg_tensor *dst);
/* Waits for the stage's copies in flight, then frees it; sets *s = NULL. Free it before its
 * context. */
void dg_stage_free(dg_stage **s);

/* In-place fills (not recorded on the tape). The random fills are counter based: element i of a
 * tensor filled with seed s gets the same value on every device and in every dtype (up to the
 * dtype's rounding), so a CPU run and a GPU run can start from identical numbers. */
dg_status dg_tensor_fill_(dg_tensor *t, double value);
dg_status dg_tensor_rand_uniform(dg_tensor *t, uint64_t seed, double lo, double hi);
dg_status dg_tensor_rand_normal(dg_tensor *t, uint64_t seed, double mean, double std);
/* The scalar generator behind the fills: uniform in [0,1) for (seed, counter). */
double dg_rand_u01(uint64_t seed, uint64_t counter);

/* ---- files ----
 * Errors: DG_ERR_IO (cannot open/read/write), DG_ERR_FORMAT (malformed or truncated file; the
 * message names the path and what is wrong), DG_ERR_DTYPE (a dtype we do not hold),
 * DG_ERR_SHAPE (more than DG_MAX_DIMS dims). Device tensors are copied through the host. */

/* NumPy .npy. Save writes format 1.0, little-endian, C order, in the tensor's logical order (views
 * are fine): f64 '<f8', f32 '<f4', i32 '<i4', i64 '<i8', and bf16 as '<f4' (numpy has no
 * bfloat16; the widening is exact). Load reads format 1.0/2.0/3.0 headers with descr '<f8' '<f4'
 * '<i4' '<i8' into a tensor of that dtype in ctx; '<f2', big-endian and other descrs are refused
 * (DG_ERR_DTYPE), as is fortran_order True (DG_ERR_UNSUPPORTED). A 0-d array loads as shape [1].
 * Bytes after the array data are ignored, as numpy does. Saves are atomic like safetensors. */
dg_status dg_npy_save(const char *path, const dg_tensor *t);
dg_status dg_npy_load(dg_ctx *ctx, const char *path, dg_tensor **out);

/* safetensors: an 8-byte little-endian header length, a JSON header (at most 100 MB), then raw
 * little-endian data. dtypes "F64" "F32" "BF16" "I32" "I64"; others ("F16", "U8", ...) are
 * refused with DG_ERR_DTYPE naming the tensor. Load checks every offset against the file, that
 * each tensor's byte span matches its shape and dtype, and that names are unique and spans do
 * not overlap; it keeps the header's order, and a scalar (shape []) loads as shape [1]. */
typedef struct dg_safetensors {
    int n;
    char **names;        /* n names, owned */
    dg_tensor **tensors; /* n tensors in the load context, owned */
    int n_meta;          /* "__metadata__" string pairs */
    char **meta_keys;
    char **meta_values;
} dg_safetensors;
/* Writes tensors in the given order, packed, the data section 8-byte aligned. Atomic: writes
 * "<path>.tmp.<pid>", fsyncs it and renames it over `path`; on any failure the temp file is
 * removed and an existing `path` is left untouched. Names must be unique and not "__metadata__".
 * meta_* may be NULL when n_meta is 0. */
dg_status dg_safetensors_save(const char *path, int n, const char *const *names,
                              const dg_tensor *const *tensors, int n_meta,
                              const char *const *meta_keys, const char *const *meta_values);
/* On failure *out is left empty (safe to pass to dg_safetensors_free). */
dg_status dg_safetensors_load(dg_ctx *ctx, const char *path, dg_safetensors *out);
/* Frees names, tensors and metadata and zeroes *st; NULL and repeated calls are fine. */
void dg_safetensors_free(dg_safetensors *st);
/* The tensor named `name` (borrowed) or NULL. */
dg_tensor *dg_safetensors_get(const dg_safetensors *st, const char *name);
/* The metadata value for `key` (borrowed) or NULL. */
const char *dg_safetensors_meta(const dg_safetensors *st, const char *key);

/* =============================================================================================
 * Autograd: the tape
 *
 * While grad mode is on, every op whose inputs include a tensor that requires grad appends a node
 * {op name, inputs, saved tensors, backward} to the one active tape. dg_tape_backward(loss) seeds
 * d loss = 1 and runs the nodes' backward functions in reverse order, accumulating (+=) gradients
 * into the inputs. Gradients of intermediate tensors are released as soon as their producing
 * node has run; leaves keep theirs until dg_tensor_zero_grad() or they are freed.
 *
 * Policy: each node kind declares what it keeps for backward. CACHE saves the intermediates its
 * backward needs; RECOMPUTE saves only its inputs and recomputes the intermediates in backward.
 * The policy is resolved per node when it is recorded: the global override if set, else the
 * setting for its op kind, else the op's own default.
 * ============================================================================================= */

typedef enum dg_policy {
    DG_POLICY_DEFAULT = 0, /* "let the op decide" */
    DG_POLICY_CACHE,
    DG_POLICY_RECOMPUTE,
} dg_policy;

void dg_tensor_set_requires_grad(dg_tensor *t, int on);
int dg_tensor_requires_grad(const dg_tensor *t);
/* Gradient of a tensor after backward (borrowed), or NULL if none was accumulated. It has the
 * tensor's dtype; a bf16 leaf's gradient that a backward creates from several ops' contributions
 * is summed in f32 and rounded to bf16 once (one that already exists is added to in bf16). */
const dg_tensor *dg_tensor_grad(const dg_tensor *t);
void dg_tensor_zero_grad(dg_tensor *t);
/* Keep the gradient of a non-leaf tensor after backward (for tests and inspection). */
void dg_tensor_retain_grad(dg_tensor *t);

/* Grad mode: disabled inside a no_grad scope; scopes nest. */
void dg_no_grad_begin(void);
void dg_no_grad_end(void);
int dg_grad_enabled(void);

/* Run backward from a one-element tensor. Leaves the tape's nodes in place. */
dg_status dg_tape_backward(dg_ctx *ctx, dg_tensor *loss);
/* Run backward seeding `out` with gradient `grad_out` (same shape). */
dg_status dg_tape_backward_with(dg_ctx *ctx, dg_tensor *out, const dg_tensor *grad_out);
/* Run backward from several outputs at once: outs[i] seeded with grads[i] (NULL entries skip). */
dg_status dg_tape_backward_multi(dg_ctx *ctx, int n, dg_tensor *const *outs,
                                 const dg_tensor *const *grads);
/* Drop all nodes and saved tensors. Call once per training step. */
void dg_tape_reset(void);
int dg_tape_num_nodes(void);
/* Bytes of the distinct storages the tape's nodes hold for backward. */
size_t dg_tape_bytes(void);
/* One line per node: index, op, policy, saved bytes. */
void dg_tape_dump(FILE *f);

void dg_policy_set(const char *op_kind, dg_policy p);
void dg_policy_set_global(dg_policy p);
dg_policy dg_policy_get_global(void);
/* The policy a node of `op_kind` whose own default is `op_default` would get now. */
dg_policy dg_policy_resolve(const char *op_kind, dg_policy op_default);
const char *dg_policy_name(dg_policy p);
/* Forget every per-op setting and the global override. */
void dg_policy_reset(void);

/* ---- profiling ----
 * With profiling on, the tape synchronises the device at every node boundary and charges the
 * elapsed time to the node's op kind (forward: time since the previous boundary; backward: the
 * node's backward). It slows the run: use it for the time split, not for throughput. */
typedef struct dg_profile_entry {
    char op[32];
    double fwd_s, bwd_s;
    int64_t fwd_n, bwd_n;
    size_t peak_bytes; /* the context's device high-water mark when this op kind's forward or
                          backward raised it (0: never; see dg_ctx_reset_peak) */
} dg_profile_entry;
void dg_profile_enable(int on);
int dg_profile_enabled(void);
void dg_profile_reset(void);
/* Start the forward clock (e.g. at the start of a step). */
void dg_profile_mark(dg_ctx *ctx);
int dg_profile_entries(const dg_profile_entry **out);
/* Table per op kind and totals for KDA stages / matmuls / rest. */
void dg_profile_dump(FILE *f);

/* ---- gradcheck ----
 * A function under test maps n_in inputs to n_out outputs through dg_ ops (so it records on the
 * tape). gradcheck projects the outputs onto fixed random directions R_k (loss = sum_k
 * <out_k,R_k>), runs backward, and compares each input's gradient with central finite differences.
 * Inputs must be f64 CPU tensors; only those that require grad are checked. */
typedef dg_status (*dg_fn)(dg_ctx *ctx, dg_tensor *const *inputs, int n_in, dg_tensor **outputs,
                           int n_out, void *user);

#define DG_GRADCHECK_MAX_INPUTS 16
typedef struct dg_gradcheck_report {
    int n_in;
    /* max_i |analytic_i - numeric_i| / max(max_i |numeric_i|, 1e-12), per input */
    double rel_err[DG_GRADCHECK_MAX_INPUTS];
    double abs_err[DG_GRADCHECK_MAX_INPUTS];
    int64_t worst_index[DG_GRADCHECK_MAX_INPUTS];
    double max_rel_err; /* over all checked inputs */
} dg_gradcheck_report;

/* eps <= 0 selects 1e-6. */
dg_status dg_gradcheck(dg_ctx *ctx, dg_fn fn, void *user, dg_tensor *const *inputs, int n_in,
                       int n_out, double eps, uint64_t seed, dg_gradcheck_report *report);

/* =============================================================================================
 * Ops. Each one: shape/dtype/device checks, CPU reference (f64, f32), CUDA kernels (f32, bf16
 * with f32 accumulation), forward and backward, recorded on the tape. Outputs have the inputs'
 * dtype and device unless stated.
 * ============================================================================================= */

/* ---- elementwise, broadcasting (NumPy rules, up to DG_MAX_DIMS) ----
 * Shapes are right-aligned; each output dim is the larger one, each input dim must match it or be
 * 1. a and b must have the same dtype. Gradients are summed back over the broadcast dims. */
dg_status dg_add(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out);
dg_status dg_sub(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out);
dg_status dg_mul(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out);
/* out = a * s */
dg_status dg_scale(dg_ctx *ctx, dg_tensor *a, double s, dg_tensor **out);

/* ---- unary ----
 * softplus(x) = max(x,0) + log1p(exp(-|x|)) and sigmoid are evaluated without overflow. */
dg_status dg_exp(dg_ctx *ctx, dg_tensor *a, dg_tensor **out);
dg_status dg_log(dg_ctx *ctx, dg_tensor *a, dg_tensor **out);
dg_status dg_sigmoid(dg_ctx *ctx, dg_tensor *a, dg_tensor **out);
dg_status dg_softplus(dg_ctx *ctx, dg_tensor *a, dg_tensor **out);
dg_status dg_silu(dg_ctx *ctx, dg_tensor *a, dg_tensor **out);

/* ---- reductions ----
 * Over one axis (negative counts from the end); keepdim keeps it with size 1. Reducing the only
 * axis of a 1-d tensor without keepdim gives shape [1]. Deterministic: a fixed summation order,
 * no atomics (f32 accumulation for bf16 on CUDA). The mean over an empty axis is NaN. */
dg_status dg_sum(dg_ctx *ctx, dg_tensor *a, int axis, int keepdim, dg_tensor **out);
dg_status dg_mean(dg_ctx *ctx, dg_tensor *a, int axis, int keepdim, dg_tensor **out);
/* Sum of all elements into a one-element tensor of shape [1]. */
dg_status dg_sum_all(dg_ctx *ctx, dg_tensor *a, dg_tensor **out);

/* ---- matrix products (cuBLAS on CUDA; f32 without TF32) ----
 * matmul: a [M,K] @ b [K,N] -> [M,N];  a [Bt,M,K] @ b [Bt,K,N] or b [K,N] -> [Bt,M,N].
 * linear: x [..., in] @ w^T, w [out, in] (PyTorch's layout) -> [..., out]; any number of leading
 * dims (x may be 1-d). Inputs share one dtype: f64/f32 on the CPU (a blocked GEMM, f32 computed
 * in f32), f64/f32/bf16 on CUDA (bf16 accumulates in f32). Transposed views of the last two dims
 * are read in place; other strided views are copied first. An empty inner dim gives zeros. */
dg_status dg_matmul(dg_ctx *ctx, dg_tensor *a, dg_tensor *b, dg_tensor **out);
dg_status dg_linear(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor **out);

/* ---- normalisation and activations over the last axis ---- */
/* y = x / sqrt(sum x^2 + eps)    (eps inside the sqrt; 1e-6 in KDA) */
dg_status dg_l2norm(dg_ctx *ctx, dg_tensor *x, double eps, dg_tensor **out);
/* y = x / sqrt(mean x^2 + eps) * w       w: [last] or NULL */
dg_status dg_rmsnorm(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, double eps, dg_tensor **out);
/* The residual add and the RMSNorm after it, fused (one tape node, one kernel each way on CUDA):
 *   sum = x + r                         (the new residual stream; x, r: the same shape)
 *   y = rmsnorm(sum) * w                (dg_rmsnorm of sum as stored; w: [last] or NULL)
 * Equal to dg_add then dg_rmsnorm, forward and gradients, up to rounding (the sum's gradient and
 * the norm's are added before being rounded to the dtype). eps must be > 0. Either output may be
 * left out of the loss; both are new references. */
dg_status dg_add_rmsnorm(dg_ctx *ctx, dg_tensor *x, dg_tensor *r, dg_tensor *w, double eps,
                         dg_tensor **sum, dg_tensor **y);
typedef enum dg_act { DG_ACT_NONE = 0, DG_ACT_SILU, DG_ACT_SIGMOID } dg_act;
/* y = rmsnorm(x) * w * act(gate)         x, gate: same shape; w: [last] or NULL;
 * act NONE is the identity (y = rmsnorm(x) * w * gate). */
dg_status dg_gated_rmsnorm(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor *gate, double eps,
                           dg_act act, dg_tensor **out);
/* y = silu(gate) * up */
dg_status dg_swiglu(dg_ctx *ctx, dg_tensor *gate, dg_tensor *up, dg_tensor **out);
/* out = swiglu(gate, up) @ w^T: the SwiGLU and the linear layer that reads it (an MLP's down
 * projection) as one tape node, "swiglu_linear". gate, up: [..., in] (one shape and dtype), w
 * [out, in]. Equal to dg_swiglu then dg_linear, forward and gradients, bit for bit. Under
 * RECOMPUTE (its default policy) backward forms swiglu(gate, up) again instead of keeping it: the
 * saved activations shrink by one [..., in] tensor. CACHE keeps it. */
dg_status dg_swiglu_linear(dg_ctx *ctx, dg_tensor *gate, dg_tensor *up, dg_tensor *w,
                           dg_tensor **out);

/* ---- embeddings, convolution, loss ---- */
/* weight [Vocab, d], ids i32/i64 of any shape S (at most 4 dims) -> [S..., d]. An id outside
 * [0, Vocab) is DG_ERR_ARG naming its position and value (on CUDA this costs one sync, unless
 * checks are deferred: dg_ctx_defer_checks). weight: f64/f32 on the CPU, f32/bf16 on CUDA. The
 * backward (a scatter-add into dweight) is deterministic on both devices: no float atomics. On
 * CUDA an id's gradient is summed in position order in f32 up to 32 occurrences, beyond that in
 * a fixed two-level order (sums of 32, then of those): the same bits every run, not the CPU's. */
dg_status dg_embedding(dg_ctx *ctx, dg_tensor *weight, dg_tensor *ids, dg_tensor **out);
/* Causal depthwise conv along T: x [B,T,C], w [C,W] (1 <= W <= 8, 4 typical), bias [C] or NULL.
 *   y[b,t,c] = act( sum_{i<W} w[c,i] x[b, t-W+1+i, c] + bias[c] ), x before the sequence start = 0.
 * act: NONE or SILU. cu_seqlens: NULL (n_seqs ignored), or host int64 [n_seqs+1] with B == 1,
 * cu[0] = 0, cu[n_seqs] = T, non-decreasing (each sequence starts fresh); copied, so it need not
 * outlive the call. */
dg_status dg_short_conv(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor *bias, dg_act act,
                        const int64_t *cu_seqlens, int n_seqs, dg_tensor **out);
/* Token shift (RWKV-style): y[b,t,c] = x[b,t-1,c] - x[b,t,c] with x before the sequence start = 0.
 * x [B,T,C]; cu_seqlens as for dg_short_conv (NULL: each of the B rows is one sequence). CPU f64
 * and f32; on CUDA (f32, bf16) it runs as dg_short_conv with taps [1, -1]. */
dg_status dg_token_shift(dg_ctx *ctx, dg_tensor *x, const int64_t *cu_seqlens, int n_seqs,
                         dg_tensor **out);
/* Mean softmax cross-entropy of logits [N,Vocab] against targets i32/i64 [N]; targets equal to
 * ignore_index do not count. Output: [1], f32 for f32/bf16 logits, f64 for f64. Fused and stable
 * (finite for logits of any magnitude). If every target is ignored the loss is 0 and the gradient
 * is 0. Any other target outside [0, Vocab) is DG_ERR_ARG (on CUDA this costs one sync, unless
 * checks are deferred: dg_ctx_defer_checks). Logits: f64/f32 on the CPU, f32/bf16 on CUDA.
 * Policy "cross_entropy": CACHE keeps 2 numbers a row. */
dg_status dg_cross_entropy(dg_ctx *ctx, dg_tensor *logits, dg_tensor *targets, int64_t ignore_index,
                           dg_tensor **out);

/* ---- optimizer (not recorded on the tape) ---- */
typedef struct dg_adamw_hparams {
    double lr, beta1, beta2, eps, weight_decay;
} dg_adamw_hparams;
/* One AdamW step (decoupled weight decay) on param with its gradient; m, v: same shape, f32
 * (f64 for f64 params). step counts from 1. A NULL gradient leaves everything unchanged.
 * decay: 0 skips weight decay for this parameter. In place; param, m, v must be contiguous.
 *   p -= lr*wd*p (if decay);  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
 *   p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
 * CPU: f64 or f32 params with a gradient of the same dtype. CUDA: f32 params, f32 or bf16 grad. */
dg_status dg_adamw_step(dg_ctx *ctx, dg_tensor *param, const dg_tensor *grad, dg_tensor *m,
                        dg_tensor *v, int64_t step, const dg_adamw_hparams *hp, int decay);
/* Global L2 norm of a list of tensors (e.g. gradients), accumulated in f64 on the host side.
 * Each tensor's sum of squares is taken on its device in f64 with a fixed reduction order, so
 * the result is bitwise repeatable. All tensors on ctx's device; NULL entries count as zero. */
dg_status dg_global_norm(dg_ctx *ctx, const dg_tensor *const *ts, int n, double *out);

/* AdamW over a list of parameters with gradient-norm clipping, and no host sync per step.
 * Built once over n parameters and their moments (each as dg_adamw_step wants them: same
 * shapes, contiguous; f32 on CUDA); decay[i] = 0 skips weight decay for params[i] (decay NULL:
 * all decay). hp: betas, eps, weight decay (hp->lr is unused: each step's lr comes from
 * dg_adamw_set_step). clip > 0 scales the gradients by clip / (norm + 1e-6) when their global L2
 * norm exceeds clip; 0: no clipping. The tensors are referenced, not copied; on CUDA a device
 * table of their pointers, sizes and decay flags is built here, once. */
typedef struct dg_adamw dg_adamw;
dg_status dg_adamw_new(dg_ctx *ctx, int n, dg_tensor *const *params, dg_tensor *const *m,
                       dg_tensor *const *v, const int *decay, const dg_adamw_hparams *hp,
                       double clip, dg_adamw **out);
void dg_adamw_free(dg_adamw **opt);
/* The step (from 1) and lr of the next update. The lr, lr * weight_decay and the bias
 * corrections 1 - beta^step are computed on the host and written to device memory by a small
 * kernel launch (no sync); the update reads them there, so an update captured in a CUDA graph
 * follows them when the graph is replayed after each dg_adamw_set_step. */
dg_status dg_adamw_set_step(dg_adamw *opt, int64_t step, double lr);
/* One step for every parameter with grads[i] (NULL: params[i] and its moments unchanged; the
 * param's shape, any strides; f32 or bf16 on CUDA, the param's dtype on the CPU): the gradients'
 * global L2 norm, the clip coefficient, then dg_adamw_step's update with the gradient times the
 * coefficient. CPU: dg_global_norm, dg_scale (when clipping) and dg_adamw_step per parameter,
 * the reference. CUDA: no host sync; the norm (f64, a fixed reduction order: bitwise
 * repeatable), the coefficient and the update stay on the device, the update of all parameters
 * is one launch (the gradient pointers are passed as kernel arguments, so a captured update
 * reads the gradient buffers of the capture). A non-finite norm is not an error here: read
 * dg_adamw_stats. */
dg_status dg_adamw_update(dg_adamw *opt, const dg_tensor *const *grads);
/* f64 [2] on the optimizer's device, owned by it and rewritten by each update: the gradient
 * norm of the last update (before clipping) and the coefficient the gradients were scaled by. */
const dg_tensor *dg_adamw_stats(const dg_adamw *opt);

/* =============================================================================================
 * KDA: Kimi Delta Attention (the equations: docs/kda.md §11). Defined in ops/kda/.
 * ============================================================================================= */

typedef enum dg_gate_kind {
    DG_GATE_NONE = 0,   /* g is the per-token log decay itself (g <= 0) */
    DG_GATE_KDA,        /* g = -exp(A_log) * softplus(x + dt_bias) */
    DG_GATE_LOWERBOUND, /* g = lb * sigmoid(exp(A_log) * (x + dt_bias)),  lb < 0 */
} dg_gate_kind;

/* How bf16 KDA on CUDA uses the tensor cores (f32 inputs always take the exact f32 path). */
typedef enum dg_kda_tc {
    DG_KDA_TC_DEFAULT = 0, /* TF32 products with f32 accumulation (the fast path) */
    DG_KDA_TC_OFF,         /* plain f32 FMA kernels, as for f32 inputs */
    DG_KDA_TC_3XTF32,      /* 3xTF32 products (close to f32) in the kernels that have them */
} dg_kda_tc;

typedef struct dg_kda_opts {
    int chunk_size;            /* BT: 16, 32 or 64; 0 selects 64 */
    dg_gate_kind gate;         /* how g is produced from the raw input */
    double lower_bound;        /* lb for DG_GATE_LOWERBOUND, in [-5, 0); 0 selects -5 */
    int l2norm_qk;             /* L2-normalise q and k inside the op (eps 1e-6 inside the sqrt) */
    int beta_sigmoid;          /* beta input is raw: beta = c * sigmoid(b) */
    int allow_neg_eigval;      /* c = 2 instead of 1 */
    double scale;              /* output scale; <= 0 selects K^-1/2 */
    int output_final_state;    /* return ht [N,HV,K,V] f32 */
    const int64_t *cu_seqlens; /* host int64 [n_seqs+1] with B == 1, or NULL */
    int n_seqs;
    dg_kda_tc tensor_cores; /* bf16 inputs on CUDA only; 0 is DG_KDA_TC_DEFAULT */
} dg_kda_opts;

/* Chunked KDA. q, k: [B,T,H,K]; v: [B,T,HV,V]; g: [B,T,HV,K]; beta: [B,T,HV];
 * A_log: [HV] and dt_bias: [HV*K] (gate kinds other than NONE; dt_bias may be NULL);
 * h0: [N,HV,K,V] or NULL. On the CPU every tensor has q's dtype (f64, or f32 computed in f32).
 * On CUDA (every tensor on ctx's device, else DG_ERR_DEVICE) q, k, v, g, beta are f32 or bf16
 * (one dtype), A_log, dt_bias, h0 are f32, and the math is f32; o has q's dtype, ht is f32.
 * Outputs o: [B,T,HV,V], ht: [N,HV,K,V] when opts->output_final_state (else *ht = NULL; ht itself
 * may be NULL then). A decay of zero (g = -inf, or a gate that saturates below -128) resets the
 * state as in the recurrence: on the CPU the log decay is floored at -128 (exp(-128) is below
 * f64 resolution), so the result stays finite and equals dg_kda_recurrent's. */
dg_status dg_kda_chunk(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *g,
                       dg_tensor *beta, dg_tensor *A_log, dg_tensor *dt_bias, dg_tensor *h0,
                       const dg_kda_opts *opts, dg_tensor **o, dg_tensor **ht);
/* Checks an index tensor meant as dg_kda_opts.cu_seqlens and copies it to out[cap] (host int64):
 * it must be a 1-d i64 or i32 tensor of N+1 >= 2 entries (float arrays are refused, never
 * truncated), start at 0, never decrease and, when T >= 0, end at T. *n_seqs gets N. */
dg_status dg_kda_seqlens(const dg_tensor *cu, int64_t T, int64_t *out, int64_t cap, int *n_seqs);
/* The token-by-token recurrence, same arguments: the ground truth the chunked form must equal. */
dg_status dg_kda_recurrent(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *g,
                           dg_tensor *beta, dg_tensor *A_log, dg_tensor *dt_bias, dg_tensor *h0,
                           const dg_kda_opts *opts, dg_tensor **o, dg_tensor **ht);

/* ---- KDA stage nodes (the chunked algorithm, one tape node each; see ops/kda/) ---- */
/* KDA_STAGE_API_BEGIN */
/* The chunked algorithm of dg_kda_chunk as separate tape nodes (kda.md §2), for tests and
 * for callers that want to reorder or fuse stages. `opts` supplies chunk_size, gate, lower_bound,
 * allow_neg_eigval, scale and cu_seqlens exactly as for dg_kda_chunk (other fields are ignored).
 * All tensors share one dtype (f64 or f32 on the CPU). On CUDA the activation inputs (x, b, g, q,
 * k, v, beta) may each be f32 or bf16 and everything else (A_log, dt_bias, h0, G, Tm, W, U, KG,
 * QG, h, Aqk, E) is f32; y and beta come out in their input's dtype, every other output in f32.
 * Per-chunk matrices [B,T,HV,BT]: token row
 * t holds row (t - chunk start) of its chunk's matrix; h: [B, NT, HV, K, V] (varlen: [1, NC, ...]
 * with NC = total chunks over all sequences), the state at the START of each chunk.
 * Op kinds for dg_policy_set: "kda_l2norm" (default CACHE: keeps y and 1/norm), "kda_beta",
 * "kda_gate_cumsum", "kda_intra" (nothing to recompute: Aqk and Tm are always kept), "kda_wy"
 * (default RECOMPUTE: W, U, KG, QG are rebuilt from Tm in backward), "kda_state" (default
 * CACHE: h and E are kept; RECOMPUTE rebuilds them by a second sequential pass), "kda_output",
 * "kda_recurrent". */

/* N1: y = x / sqrt(sum_K x^2 + 1e-6) over the last axis. x: [..., K]. */
dg_status dg_kda_l2norm(dg_ctx *ctx, dg_tensor *x, dg_tensor **y);
/* N2: beta = c * sigmoid(b), c = 2 if allow_neg_eigval else 1. b: any shape ([B,T,HV]). */
dg_status dg_kda_beta(dg_ctx *ctx, dg_tensor *b, int allow_neg_eigval, dg_tensor **beta);
/* N3: G = chunk-local inclusive cumsum of gate(g) (natural log). g, G: [B,T,HV,K];
 * A_log: [HV] (required for DG_GATE_KDA, optional for DG_GATE_LOWERBOUND, NULL for NONE);
 * dt_bias: [HV*K] or NULL. */
dg_status dg_kda_gate_cumsum(dg_ctx *ctx, dg_tensor *g, dg_tensor *A_log, dg_tensor *dt_bias,
                             const dg_kda_opts *opts, dg_tensor **G);
/* N4: Aqk = scale * (q_i . k_j exp(G_i - G_j))_{j<=i};  Tm = (I + Diag(beta) P)^{-1} with
 * P = (k_i . k_j exp(G_i - G_j))_{j<i}. q, k: [B,T,H,K]; beta: [B,T,HV]; G: [B,T,HV,K];
 * Aqk, Tm: [B,T,HV,BT]. */
dg_status dg_kda_intra(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *beta, dg_tensor *G,
                       const dg_kda_opts *opts, dg_tensor **Aqk, dg_tensor **Tm);
/* N5: W = Tm (beta k exp(G)), U = Tm (beta v), KG = k exp(G_last - G), QG = q exp(G).
 * q, k: [B,T,H,K]; v: [B,T,HV,V]; beta: [B,T,HV]; G: [B,T,HV,K]; Tm: [B,T,HV,BT] (only its lower
 * triangle incl. the diagonal is read). W, KG, QG: [B,T,HV,K]; U: [B,T,HV,V]. */
dg_status dg_kda_wy(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *beta,
                    dg_tensor *G, dg_tensor *Tm, const dg_kda_opts *opts, dg_tensor **W,
                    dg_tensor **U, dg_tensor **KG, dg_tensor **QG);
/* N6: sequential over chunks: h_c (state at chunk start), E_c = U_c - W_c h_c,
 * h_{c+1} = Diag(exp(G_last)) h_c + KG_c^T E_c. W, KG, G: [B,T,HV,K]; U: [B,T,HV,V];
 * h0: [N,HV,K,V] or NULL (zero). h: [B,NT,HV,K,V]; E: [B,T,HV,V]; ht: [N,HV,K,V] (pass NULL to
 * skip it). */
dg_status dg_kda_state(dg_ctx *ctx, dg_tensor *W, dg_tensor *U, dg_tensor *KG, dg_tensor *G,
                       dg_tensor *h0, const dg_kda_opts *opts, dg_tensor **h, dg_tensor **E,
                       dg_tensor **ht);
/* N7: O_c = scale * QG_c h_c + Aqk_c E_c (Aqk read for j <= i only). QG: [B,T,HV,K];
 * h: [B,NT,HV,K,V]; Aqk: [B,T,HV,BT]; E: [B,T,HV,V]; o: [B,T,HV,V]. scale from opts (<= 0:
 * K^-1/2). */
dg_status dg_kda_output(dg_ctx *ctx, dg_tensor *QG, dg_tensor *h, dg_tensor *Aqk, dg_tensor *E,
                        const dg_kda_opts *opts, dg_tensor **o);
/* KDA_STAGE_API_END */

/* =============================================================================================
 * DPLR: the generalised delta rule with a diagonal-plus-low-rank transition (the equations:
 * docs/dplr.md D1-D5). Defined in ops/dplr/ (CPU) and kernels/dplr/ (CUDA). On the CPU every
 * tensor of a call has one dtype, f64 or f32 (computed in f32). On CUDA the kernels compute in
 * f32: the activations q, k, v, a, b, gk are f32 or bf16 (one dtype per call), h0 and the
 * intermediates of the stage nodes are f32, o has the activations' dtype; K <= 256.
 * ============================================================================================= */

typedef struct dg_dplr_opts {
    int chunk_size;            /* BT: 16, 32 or 64; 0 selects 64 */
    double scale;              /* output scale; <= 0 selects K^-1/2 */
    int output_final_state;    /* return ht [N,H,K,V] */
    const int64_t *cu_seqlens; /* host int64 [n_seqs+1] with B == 1, or NULL */
    int n_seqs;
} dg_dplr_opts;

/* The token-by-token DPLR recurrence, per head (S in R^{K x V}, S_0 = h0 or 0):
 *   S_t = Diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,   o_t = scale * S_t^T q_t.
 * q, k, a, b, gk: [B,T,H,K]; v: [B,T,H,V]; h0: [N,H,K,V] or NULL (dtypes: see above). Outputs
 * o: [B,T,H,V], ht: [N,H,K,V] when opts->output_final_state (else *ht = NULL; ht itself may be
 * NULL then). One tape node with its own backward through time. */
dg_status dg_dplr_recurrent(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                            dg_tensor *b, dg_tensor *gk, dg_tensor *h0, const dg_dplr_opts *opts,
                            dg_tensor **o, dg_tensor **ht);
/* The chunked form of the same recurrence (dplr.md D3), same arguments and outputs as
 * dg_dplr_recurrent: a chain of the stage nodes below (gate_cumsum, intra, wy, state, output),
 * chunks of opts->chunk_size tokens from each sequence's start (the last one may be partial).
 * What the state and output stages keep for backward follows the policies of "dplr_wy" and
 * "dplr_state" (dg_policy_set; default RECOMPUTE: w, u, qg, kg, bg, h, v2 are rebuilt in
 * backward from the kept intra matrices and h0; CACHE keeps them). Both give the same
 * gradients. */
dg_status dg_dplr_chunk(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                        dg_tensor *b, dg_tensor *gk, dg_tensor *h0, const dg_dplr_opts *opts,
                        dg_tensor **o, dg_tensor **ht);

/* ---- DPLR stage nodes (the chunked algorithm, one tape node each; see ops/dplr/) ----
 * CPU: every tensor has one dtype (f64, or f32 computed in f32); CUDA: the activations (q, k,
 * v, a, b, gk) f32 or bf16, every other input f32, the outputs f32 except dg_dplr_output's o
 * (v's dtype). `opts` supplies
 * chunk_size, scale and cu_seqlens exactly as for dg_dplr_chunk (other fields are ignored).
 * Per-chunk matrices [B,T,H,BT]: token row t holds row (t - chunk start) of its chunk's matrix;
 * h: [B,NT,H,K,V] (varlen: [1,NC,H,K,V], NC = total chunks over all sequences), the state at the
 * START of each chunk. Op kinds for dg_policy_set: "dplr_gate_cumsum" (keeps only gk itself),
 * "dplr_intra" (Aqk, Aqb, Aak, Tab are always kept), "dplr_wy" and "dplr_state"
 * (default RECOMPUTE, see dg_dplr_chunk), "dplr_output", "dplr_recurrent". */

/* Gi, Ge = the chunk-local inclusive and exclusive cumulative sums of gk [B,T,H,K]. gk is floored
 * at -128 first (exp(-128) ~ 2.6e-56: a decay of zero, gk = -inf, then gives the recurrence's
 * result instead of NaN; the gradient of a floored entry is 0). */
dg_status dg_dplr_gate_cumsum(dg_ctx *ctx, dg_tensor *gk, const dg_dplr_opts *opts, dg_tensor **Gi,
                              dg_tensor **Ge);
/* The four intra-chunk matrices and the WY solve, per chunk:
 *   Aqk = scale (q_i . k_j exp(Gi_i - Gi_j))_{j<=i}   Aqb = the same with b_j in place of k_j
 *   Aak = (a_i . k_j exp(Ge_i - Gi_j))_{j<i}          Tab = (I - Aab)^{-1}, Aab likewise with b
 * q, k, a, b, Gi, Ge: [B,T,H,K]; Aqk, Aqb, Aak, Tab: [B,T,H,BT] (zero outside the triangle that
 * is read; Tab is unit lower triangular). */
dg_status dg_dplr_intra(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *a, dg_tensor *b,
                        dg_tensor *Gi, dg_tensor *Ge, const dg_dplr_opts *opts, dg_tensor **Aqk,
                        dg_tensor **Aqb, dg_tensor **Aak, dg_tensor **Tab);
/* WY: w = Tab (a exp(Ge)), u = Tab Aak v, qg = scale q exp(Gi), kg = k exp(lam - Gi),
 * bg = b exp(lam - Gi) with lam = Gi at the chunk's last row. q, k, a, b, Gi, Ge: [B,T,H,K];
 * v: [B,T,H,V]; Aak, Tab: [B,T,H,BT] (read for j < i and j <= i). w, qg, kg, bg: [B,T,H,K];
 * u: [B,T,H,V]. */
dg_status dg_dplr_wy(dg_ctx *ctx, dg_tensor *q, dg_tensor *k, dg_tensor *v, dg_tensor *a,
                     dg_tensor *b, dg_tensor *Gi, dg_tensor *Ge, dg_tensor *Aak, dg_tensor *Tab,
                     const dg_dplr_opts *opts, dg_tensor **w, dg_tensor **u, dg_tensor **qg,
                     dg_tensor **kg, dg_tensor **bg);
/* State pass, sequential over the chunks of each sequence: h_c (state at chunk start),
 * v2_c = w_c h_c + u_c, h_{c+1} = Diag(exp(lam_c)) h_c + kg_c^T v_c + bg_c^T v2_c.
 * w, kg, bg, Gi: [B,T,H,K]; u, v: [B,T,H,V]; h0: [N,H,K,V] or NULL (zero). h: [B,NT,H,K,V];
 * v2: [B,T,H,V]; ht: [N,H,K,V] (pass NULL to skip it). */
dg_status dg_dplr_state(dg_ctx *ctx, dg_tensor *w, dg_tensor *u, dg_tensor *kg, dg_tensor *bg,
                        dg_tensor *v, dg_tensor *Gi, dg_tensor *h0, const dg_dplr_opts *opts,
                        dg_tensor **h, dg_tensor **v2, dg_tensor **ht);
/* Output: o_c = qg_c h_c + Aqk_c v_c + Aqb_c v2_c (Aqk, Aqb read for j <= i; the scale is inside
 * qg, Aqk and Aqb). qg: [B,T,H,K]; h: [B,NT,H,K,V]; Aqk, Aqb: [B,T,H,BT]; v, v2, o: [B,T,H,V]. */
dg_status dg_dplr_output(dg_ctx *ctx, dg_tensor *qg, dg_tensor *h, dg_tensor *Aqk, dg_tensor *Aqb,
                         dg_tensor *v, dg_tensor *v2, const dg_dplr_opts *opts, dg_tensor **o);

/* =============================================================================================
 * Distributed: communicators (dist/) and context parallelism (KCP) for KDA, DPLR and the short
 * conv
 * ============================================================================================= */

/* A group of ranks. MPI backend: host tensors, and CUDA tensors staged through host buffers (so
 * several processes may share one GPU). NCCL backend: CUDA tensors, one process per GPU. Every
 * call is collective over the group (dg_comm_shift: over the ranks named). A peer that died or
 * does not answer within the communicator's timeout makes the call fail with DG_ERR_COMM and a
 * message naming the call, the rank and the timeout; the communicator is then unusable (further
 * calls fail at once) and the caller should end the job (dg_comm_abort). */
typedef struct dg_comm dg_comm;
typedef enum dg_comm_backend { DG_COMM_MPI = 0, DG_COMM_NCCL = 1 } dg_comm_backend;

/* Was the library built with MPI? */
int dg_have_mpi(void);
/* The world communicator over MPI (MPI_Init on first use; launched by mpirun, or a single rank
 * when started directly). timeout_s > 0: the time any one call may take; <= 0 selects 300 s.
 * Built without MPI: DG_ERR_UNSUPPORTED. */
dg_status dg_comm_init_mpi(double timeout_s, dg_comm **out);
/* The world communicator over NCCL for CUDA tensors on ctx's device. Bootstrap from RANK,
 * WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun style: rank 0 hands the NCCL id to the others
 * over TCP), or, when those are not set and the process was started by mpirun, over MPI. Built
 * without NCCL: DG_ERR_UNSUPPORTED. */
dg_status dg_comm_init_nccl(dg_ctx *ctx, double timeout_s, dg_comm **out);
/* How this process was started (from the launcher's environment variables): torchrun (RANK,
 * WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), mpirun (Open MPI's OMPI_COMM_WORLD_*, or PMI), or
 * alone (rank 0 of 1). */
typedef struct dg_launch {
    int by_torchrun, by_mpirun;
    int rank, world;             /* this process in the job */
    int local_rank, local_world; /* this process among those on this machine */
} dg_launch;
dg_launch dg_launch_info(void);
/* The device a rank should use: `asked` when it is the CPU or names its index explicitly
 * (explicit_index != 0), else GPU (local rank modulo the number of GPUs). */
dg_device dg_launch_device(dg_device asked, int explicit_index);
typedef enum dg_comm_pick {
    DG_COMM_PICK_AUTO = 0, /* NCCL when ctx is CUDA, NCCL is built in and every local rank has a
                              GPU of its own; else MPI */
    DG_COMM_PICK_MPI = 1,
    DG_COMM_PICK_NCCL = 2
} dg_comm_pick;
/* The world communicator for this launch (see dg_comm_pick). ctx: the rank's context (NULL or a
 * CPU context means MPI). A torchrun launch that would need MPI is an error naming the fix. */
dg_status dg_comm_init_launch(dg_ctx *ctx, dg_comm_pick pick, double timeout_s, dg_comm **out);
/* Split into sub-groups: ranks with equal `color` form one, ordered by `key` (MPI_Comm_split).
 * Collective over c. */
dg_status dg_comm_split(dg_comm *c, int color, int key, dg_comm **out);
void dg_comm_free(dg_comm **c);
/* Shut MPI down (after every communicator is freed); a no-op when MPI was not started here. */
void dg_comm_finalize(void);
/* End every process of the job (MPI_Abort); for tools after an unrecoverable DG_ERR_COMM. A
 * NULL or NCCL communicator exits this process only. Does not return. */
void dg_comm_abort(dg_comm *c, int code);
int dg_comm_rank(const dg_comm *c);
int dg_comm_size(const dg_comm *c);
dg_comm_backend dg_comm_kind(const dg_comm *c);
double dg_comm_timeout(const dg_comm *c);
/* out = [size, x's shape...]: rank i's x in out[i]. x, out contiguous, same dtype and device. */
dg_status dg_comm_all_gather(dg_comm *c, const dg_tensor *x, dg_tensor *out);
/* x = sum over ranks of x, in place (f64, f32; bf16 summed in f32). Contiguous. */
dg_status dg_comm_all_reduce(dg_comm *c, dg_tensor *x);
/* Neighbour exchange: send `send` to rank dst and receive rank src's message into `recv`
 * (dst, src: -1 for none; send/recv NULL then). Sizes in bytes must match the peer's. */
dg_status dg_comm_shift(dg_comm *c, const dg_tensor *send, int dst, dg_tensor *recv, int src);
dg_status dg_comm_barrier(dg_comm *c);
/* Bytes this rank sent and seconds it spent inside communicator calls, since creation or reset. */
typedef struct dg_comm_stats {
    int64_t bytes_sent;
    int64_t calls;
    double seconds;
} dg_comm_stats;
void dg_comm_get_stats(const dg_comm *c, dg_comm_stats *out);
void dg_comm_reset_stats(dg_comm *c);

/* Context parallelism: one token axis of global sequences (cu_seqlens over all ranks) split into
 * contiguous slices, rank r owning global tokens [begin, end). A plan is this rank's view. */
typedef struct dg_cp_plan {
    int rank, world;
    int64_t total;      /* tokens over all ranks */
    int64_t begin, end; /* this rank's global token range */
    int n_seqs;         /* global sequences */
    int n_local;        /* local sequences (pieces of global sequences on this rank) */
    int seq0;           /* global index of local sequence 0 (local i is global seq0 + i) */
    int64_t *cu_local;  /* [n_local+1] local cu_seqlens, cu_local[0] = 0, cu_local[n] = end-begin */
    int pre_ranks;      /* earlier ranks holding part of local sequence 0 (0: it starts here) */
    int post_ranks;     /* later ranks holding part of the last local sequence (0: it ends here) */
    int64_t pre_tokens; /* tokens of local sequence 0 on earlier ranks */
    int64_t *bounds;    /* [world+1]: rank i owns global tokens [bounds[i], bounds[i+1]) */
} dg_cp_plan;
/* cu_seqlens: host int64 [n_seqs+1], strictly increasing from 0 to total (NULL: one sequence of
 * `total` tokens; B rows of T tokens: cu = {0, T, 2T, ...}). rank_tokens: [world] tokens per
 * rank, each >= 1, summing to total (NULL: as even as possible, the first total % world ranks
 * one more). */
dg_status dg_cp_plan_new(int world, int rank, int64_t total, const int64_t *cu_seqlens, int n_seqs,
                         const int64_t *rank_tokens, dg_cp_plan **out);
void dg_cp_plan_free(dg_cp_plan **p);

/* dg_kda_chunk over a context-parallel split (KCP, docs/distributed.md): every rank calls it with
 * its slice, q, k: [1,T_r,H,K] etc. (T_r = plan->end - plan->begin), with the dtypes and devices
 * of dg_kda_chunk (on CUDA the summaries run on the device for bf16 inputs with K % 16 == 0, on
 * host copies otherwise).
 * opts->cu_seqlens must be NULL (the plan holds the sequences). h0: [n_seqs,HV,K,V] global or
 * NULL; each row is read by the rank where its sequence starts. ht (output_final_state):
 * [n_seqs,HV,K,V]; rows of sequences that end on this rank hold the final state, the others are
 * zero (so the sum over ranks is the unsplit ht). Forward: one all_gather of a [HV,K,V+K] state
 * summary per rank; backward: one more. Every rank must run backward through the op. */
dg_status dg_kda_chunk_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *q,
                          dg_tensor *k, dg_tensor *v, dg_tensor *g, dg_tensor *beta,
                          dg_tensor *A_log, dg_tensor *dt_bias, dg_tensor *h0,
                          const dg_kda_opts *opts, dg_tensor **o, dg_tensor **ht);
/* dg_dplr_chunk over a context-parallel split (KCP with the DPLR transition Diag(exp(lam)) +
 * bg^T w, distributed.md K6), called like dg_kda_chunk_cp: every rank passes its slice,
 * q, k, a, b, gk: [1,T_r,H,K], v: [1,T_r,H,V] (T_r = plan->end - plan->begin), in the dtypes of
 * dg_dplr_chunk (CPU: f64, or f32 computed in f32; on CUDA the local stages run on the device
 * and the summaries on host copies). opts->cu_seqlens must be NULL (the plan holds the sequences).
 * h0: [n_seqs,H,K,V] global or NULL, each row read by the rank where its sequence starts. ht
 * (output_final_state): [n_seqs,H,K,V], rows of sequences that end on this rank filled, the
 * others zero. One all_gather of a [H,K,V+K] summary per rank forward and one backward; every
 * rank must run backward through the op. */
dg_status dg_dplr_chunk_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *q,
                           dg_tensor *k, dg_tensor *v, dg_tensor *a, dg_tensor *b, dg_tensor *gk,
                           dg_tensor *h0, const dg_dplr_opts *opts, dg_tensor **o, dg_tensor **ht);
/* dg_short_conv over a context-parallel split: x [1,T_r,C] is this rank's slice; the last W-1
 * rows go to the next rank (and their gradient comes back in backward). Every rank must hold at
 * least W-1 tokens. */
dg_status dg_short_conv_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                           dg_tensor *w, dg_tensor *bias, dg_act act, dg_tensor **out);
/* dg_token_shift over a context-parallel split: x [1,T_r,C] is this rank's slice; its last row
 * goes to the next rank, where it is x[-1] of local sequence 0 if that sequence started earlier
 * (its gradient comes back in backward). The same halo exchange as dg_short_conv_cp, one row. */
dg_status dg_token_shift_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                            dg_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* DELTAGRAD_H */

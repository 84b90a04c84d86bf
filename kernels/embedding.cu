/*
 * kernels/embedding.cu -- embedding gather (forward) and its deterministic scatter-add (backward).
 *
 * Backward without atomics on floats: a token's gradient row must be added into the row of its id,
 * and many tokens share an id, some (a space byte in byte-level text) thousands of times. We sort
 * the pairs (id, position) by id with CUB's stable radix sort, so each id's positions form one run
 * in increasing position order, and cut every run into segments of EMB_SEG (32) consecutive
 * positions, so that a long run is spread over many blocks:
 *   1. a thread per id finds its run by binary search and counts its segments; an exclusive scan
 *      gives each id its first segment and (ids with two or more segments) its first partial row;
 *   2. a block per (segment, column tile) sums the segment's dy rows in position order in f32; an
 *      id with one segment writes its dweight row from there, the others an f32 partial row;
 *   3. a block per (id with two or more segments, column tile) adds its partials: warp r
 *      (r < EMB_WARPS = 16) sums partials r, r + 16, r + 32, ... in increasing order, then the 16
 *      warp sums are added in order r = 0, 1, ..., 15, and the row is rounded once to its dtype.
 * Rows of ids that do not occur are 0. Every sum is in an order fixed by the ids alone, so the
 * result is bitwise reproducible. An id with at most 32 positions is summed in the CPU reference's
 * order (position order, f32); a longer run is not: it is the two-level sum above, whose rounding
 * error is of the same order as (for long runs smaller than) the CPU's sequential f32 sum.
 */
#include "common.cuh"
#include "embedding.cuh"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <limits.h>

// ---- CUDA kernels

template <typename T, typename I>
__global__ void embedding_fwd_kernel(const T *weight, int64_t V, int64_t d, const I *ids, int64_t n,
                                     T *out, unsigned long long *bad) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        int64_t id = (int64_t)ids[i];
        T *o = out + i * d;
        if (id < 0 || id >= V) {
            if (threadIdx.x == 0)
                atomicMin(bad, (unsigned long long)i);
            for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
                dg_st(o, c, 0.0f);
            continue;
        }
        const T *w = weight + id * d;
        for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
            o[c] = w[c];
    }
}

/* An id outside [0, V) (recorded by the forward; possible with deferred checks) gets key V: it
 * sorts after every row and no row's run includes it. */
template <typename I>
__global__ void embedding_keys_kernel(const I *ids, int64_t n, int64_t V, unsigned int *keys,
                                      int *pos) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t id = (int64_t)ids[i];
        keys[i] = (unsigned int)(id >= 0 && id < V ? id : V);
        pos[i] = (int)i;
    }
}

/* First index in sorted keys[0, n) whose key is >= v. */
__device__ __forceinline__ int64_t lower_bound(const unsigned int *keys, int64_t n,
                                               unsigned int v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) >> 1;
        if (keys[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Sorted positions per segment, and warps that share one id's segment partials. */
#define EMB_SEG 32
#define EMB_WARPS 16

/* Per id (and, after the exclusive scan, the offsets before it): segments in the high 32 bits of
 * seg_rows, partial rows in the low 32 bits (only ids with two or more segments have partial
 * rows), and multi = ids with two or more segments. The segments number at most n < 2^31 and the
 * partial rows fewer than 2 n / EMB_SEG < 2^32, so the low half never carries into the high. */
struct emb_off {
    unsigned long long seg_rows;
    unsigned long long multi;
};

struct emb_off_add {
    __host__ __device__ emb_off operator()(const emb_off &a, const emb_off &b) const {
        emb_off r;
        r.seg_rows = a.seg_rows + b.seg_rows;
        r.multi = a.multi + b.multi;
        return r;
    }
};

__device__ __forceinline__ int64_t off_seg(const emb_off &o) { return (int64_t)(o.seg_rows >> 32); }
__device__ __forceinline__ int64_t off_row(const emb_off &o) {
    return (int64_t)(o.seg_rows & 0xffffffffull);
}

/* v in [0, V]: start[v] = first sorted index with key >= v (start[V] = number of valid ids), and
 * cnt[v] = id v's segments, partial rows and multi flag (zero for v == V, so the exclusive scan's
 * entry V holds the totals). */
__global__ void embedding_runs_kernel(const unsigned int *keys, int64_t n, int64_t V, int *start,
                                      emb_off *cnt) {
    for (int64_t v = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; v <= V;
         v += (int64_t)gridDim.x * blockDim.x) {
        int64_t a = lower_bound(keys, n, (unsigned int)v);
        emb_off c;
        c.seg_rows = 0;
        c.multi = 0;
        if (v < V) {
            int64_t len = lower_bound(keys, n, (unsigned int)v + 1u) - a;
            unsigned long long segs = (unsigned long long)((len + EMB_SEG - 1) / EMB_SEG);
            c.seg_rows = segs << 32 | (segs > 1 ? segs : 0ull);
            c.multi = segs > 1 ? 1ull : 0ull;
        }
        start[v] = (int)a;
        cnt[v] = c;
    }
}

/* VEC consecutive elements as one access (a dg_pack, 16 bytes at most). */

template <typename T, int VEC> __device__ __forceinline__ dg_pack<T, VEC> emb_load(const T *p) {
    return *reinterpret_cast<const dg_pack<T, VEC> *>(p);
}

template <typename T, int VEC>
__device__ __forceinline__ void emb_add(float (&acc)[VEC], const dg_pack<T, VEC> &x) {
#pragma unroll
    for (int i = 0; i < VEC; i++)
        acc[i] += dg_ld(x.v, i);
}

template <typename T, int VEC>
__device__ __forceinline__ void emb_store(T *p, const float (&acc)[VEC]) {
    dg_pack<T, VEC> x;
#pragma unroll
    for (int i = 0; i < VEC; i++)
        dg_st(x.v, i, acc[i]);
    *reinterpret_cast<dg_pack<T, VEC> *>(p) = x;
}

/* The largest v in [0, V) with field(off[v]) <= j, for j < field(off[V]): the id whose range of
 * the scanned field holds j (field(off[0]) == 0, and an id with an empty range is skipped). */
template <bool SEG>
__device__ __forceinline__ int64_t emb_find(const emb_off *off, int64_t V, int64_t j) {
    int64_t lo = 0, hi = V - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) >> 1;
        int64_t f = SEG ? off_seg(off[mid]) : (int64_t)off[mid].multi;
        if (f <= j)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* One block per (segment, column tile), grid-strided on both; a thread owns VEC columns and sums
 * the segment's dy rows (at most EMB_SEG, in sorted = position order) in f32. An id with one
 * segment writes its dweight row here; the others write partial row off_row(off[v]) + k. Blocks
 * past the device-side segment count exit at once. No shared memory, no barrier. */
template <typename T, int VEC>
__global__ void embedding_seg_kernel(const int *pos, const int *start, const emb_off *off,
                                     int64_t V, const T *__restrict__ dy, int64_t d, T *dweight,
                                     float *part) {
    const int64_t total = off_seg(off[V]);
    for (int64_t g = blockIdx.x; g < total; g += gridDim.x) {
        int64_t v = emb_find<true>(off, V, g);
        int64_t s0 = off_seg(off[v]), k = g - s0, nseg = off_seg(off[v + 1]) - s0;
        int64_t p0 = (int64_t)start[v] + k * EMB_SEG, p1 = (int64_t)start[v + 1];
        if (p1 > p0 + EMB_SEG)
            p1 = p0 + EMB_SEG;
        for (int64_t c = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * VEC; c < d;
             c += (int64_t)gridDim.y * blockDim.x * VEC) {
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; i++)
                acc[i] = 0.0f;
            int64_t p = p0;
            for (; p + 4 <= p1; p += 4) { /* four loads in flight, added in order */
                dg_pack<T, VEC> x0 = emb_load<T, VEC>(dy + (int64_t)pos[p] * d + c);
                dg_pack<T, VEC> x1 = emb_load<T, VEC>(dy + (int64_t)pos[p + 1] * d + c);
                dg_pack<T, VEC> x2 = emb_load<T, VEC>(dy + (int64_t)pos[p + 2] * d + c);
                dg_pack<T, VEC> x3 = emb_load<T, VEC>(dy + (int64_t)pos[p + 3] * d + c);
                emb_add<T, VEC>(acc, x0);
                emb_add<T, VEC>(acc, x1);
                emb_add<T, VEC>(acc, x2);
                emb_add<T, VEC>(acc, x3);
            }
            for (; p < p1; p++)
                emb_add<T, VEC>(acc, emb_load<T, VEC>(dy + (int64_t)pos[p] * d + c));
            if (nseg == 1)
                emb_store<T, VEC>(dweight + v * d + c, acc);
            else
                emb_store<float, VEC>(part + (off_row(off[v]) + k) * d + c, acc);
        }
    }
}

/* One block of 32 x EMB_WARPS threads per (id with two or more segments, tile of 32 VEC
 * columns), grid-strided on both (every loop bound is uniform over the block, so the barriers
 * are reached by all threads). Warp r sums partials r, r + EMB_WARPS, ... in increasing order;
 * warp 0 then adds the EMB_WARPS warp sums in order r = 0, 1, ... and writes the dweight row. */
template <typename T, int VEC>
__global__ void embedding_combine_kernel(const emb_off *off, int64_t V, const float *part,
                                         int64_t d, T *dweight) {
    __shared__ float red[EMB_WARPS][VEC][32];
    const int lane = threadIdx.x, r = threadIdx.y;
    const int64_t total = (int64_t)off[V].multi, tiles = (d + 32 * VEC - 1) / (32 * VEC);
    for (int64_t j = blockIdx.x; j < total; j += gridDim.x) {
        int64_t v = emb_find<false>(off, V, j);
        int64_t s0 = off_seg(off[v]), nseg = off_seg(off[v + 1]) - s0, row0 = off_row(off[v]);
        for (int64_t t = blockIdx.y; t < tiles; t += gridDim.y) {
            int64_t c = (t * 32 + lane) * VEC;
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; i++)
                acc[i] = 0.0f;
            if (c < d) {
                const float *pr = part + row0 * d + c;
                int64_t k = r;
                for (; k + 3 * EMB_WARPS < nseg; k += 4 * EMB_WARPS) {
                    dg_pack<float, VEC> x0 = emb_load<float, VEC>(pr + k * d);
                    dg_pack<float, VEC> x1 = emb_load<float, VEC>(pr + (k + EMB_WARPS) * d);
                    dg_pack<float, VEC> x2 = emb_load<float, VEC>(pr + (k + 2 * EMB_WARPS) * d);
                    dg_pack<float, VEC> x3 = emb_load<float, VEC>(pr + (k + 3 * EMB_WARPS) * d);
                    emb_add<float, VEC>(acc, x0);
                    emb_add<float, VEC>(acc, x1);
                    emb_add<float, VEC>(acc, x2);
                    emb_add<float, VEC>(acc, x3);
                }
                for (; k < nseg; k += EMB_WARPS)
                    emb_add<float, VEC>(acc, emb_load<float, VEC>(pr + k * d));
            }
#pragma unroll
            for (int i = 0; i < VEC; i++)
                red[r][i][lane] = acc[i];
            __syncthreads();
            if (r == 0 && c < d) {
                for (int w = 1; w < EMB_WARPS; w++) {
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        acc[i] += red[w][i][lane];
                }
                emb_store<T, VEC>(dweight + v * d + c, acc);
            }
            __syncthreads(); /* red is rewritten by the next tile or id */
        }
    }
}

// ---- kernel launchers

template <typename T, typename I>
static dg_status launch_fwd(dg_ctx *ctx, const void *w, int64_t V, int64_t d, const void *ids,
                            int64_t n, void *out, unsigned long long *bad) {
    int threads = d >= 256 ? 256 : d >= 128 ? 128 : 64;
    embedding_fwd_kernel<T, I><<<dg__blocks(n, 1), threads, 0, dg__stream(ctx)>>>(
        (const T *)w, V, d, (const I *)ids, n, (T *)out, bad);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__embedding_fwd_cuda(dg_ctx *ctx, dg_dtype wdt, const void *weight,
                                            int64_t V, int64_t d, dg_dtype idt, const void *ids,
                                            int64_t n, void *out, const dg_deverr_site *site) {
    if (n <= 0 || d <= 0)
        return DG_OK;
    if (wdt != DG_F32 && wdt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "embedding (cuda): weight dtype %s, expected f32 or bf16",
                       dg_dtype_name(wdt));
    unsigned long long *bad = &dg__deverr(ctx)->pending;
    dg_status s;
    if (wdt == DG_F32 && idt == DG_I32)
        s = launch_fwd<float, int32_t>(ctx, weight, V, d, ids, n, out, bad);
    else if (wdt == DG_F32)
        s = launch_fwd<float, int64_t>(ctx, weight, V, d, ids, n, out, bad);
    else if (idt == DG_I32)
        s = launch_fwd<__nv_bfloat16, int32_t>(ctx, weight, V, d, ids, n, out, bad);
    else
        s = launch_fwd<__nv_bfloat16, int64_t>(ctx, weight, V, d, ids, n, out, bad);
    DG_TRY(s);
    return dg__deverr_commit(ctx, site, idt, ids);
}

/* Scratch of the backward, one allocation (each array 256-B aligned): CUB's temp storage (shared
 * by the sort and the scan, which run one after the other), the keys and positions in and out of
 * the sort, the run starts start[V + 1], the per-id counts and their exclusive scan (V + 1 each),
 * and the f32 partial rows [2 ceil(n / EMB_SEG), d] (an id with c > EMB_SEG positions has
 * ceil(c / EMB_SEG) < 2 c / EMB_SEG segments, so all of them together fewer than 2 n / EMB_SEG). */
typedef struct {
    void *tmp;
    size_t tmp_bytes;
    unsigned int *keys_in, *keys;
    int *pos_in, *pos;
    int *start;
    emb_off *cnt, *off;
    float *part;
} sort_bufs;

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* The widest VEC <= max (a power of 2) that divides d with both pointers VEC-element aligned. */
static int pick_vec(int max, int64_t d, size_t elt, const void *a, const void *b) {
    int v = max;
    while (v > 1 && (d % v != 0 || (uintptr_t)a % (v * elt) != 0 || (uintptr_t)b % (v * elt) != 0))
        v >>= 1;
    return v;
}

static unsigned cap_grid(int64_t b, int64_t cap) {
    return (unsigned)(b < 1 ? 1 : b > cap ? cap : b);
}

template <typename T, int VEC>
static dg_status launch_seg(cudaStream_t st, const sort_bufs *sb, int64_t V, int64_t n,
                            const void *dy, int64_t d, void *dweight) {
    /* a thread per VEC columns; segments are at most min(n, ceil(n / EMB_SEG) + min(V, n)) */
    int64_t nv = (d + VEC - 1) / VEC;
    int threads = nv >= 256 ? 256 : (int)((nv + 31) / 32 * 32);
    int64_t segs = (n + EMB_SEG - 1) / EMB_SEG + (V < n ? V : n);
    if (segs > n)
        segs = n;
    dim3 grid(cap_grid(segs, 65535LL * 16), cap_grid((nv + threads - 1) / threads, 65535));
    embedding_seg_kernel<T, VEC><<<grid, threads, 0, st>>>(
        sb->pos, sb->start, sb->off, V, (const T *)dy, d, (T *)dweight, sb->part);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

template <typename T, int VEC>
static dg_status launch_combine(cudaStream_t st, const sort_bufs *sb, int64_t V, int64_t n,
                                int64_t d, void *dweight) {
    int64_t multi = n / (EMB_SEG + 1); /* ids with two or more segments, at most */
    if (multi == 0)
        return DG_OK;
    int64_t tiles = (d + 32 * VEC - 1) / (32 * VEC);
    dim3 grid(cap_grid(multi, 65535LL * 16), cap_grid(tiles, 65535)), block(32, EMB_WARPS);
    embedding_combine_kernel<T, VEC><<<grid, block, 0, st>>>(sb->off, V, sb->part, d, (T *)dweight);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

/* launch_seg with the first VEC (halving from the template's) not above vec. */
template <typename T, int VEC>
static dg_status seg_vec(int vec, cudaStream_t st, const sort_bufs *sb, int64_t V, int64_t n,
                         const void *dy, int64_t d, void *dweight) {
    if (VEC == 1 || vec >= VEC)
        return launch_seg<T, VEC>(st, sb, V, n, dy, d, dweight);
    return seg_vec<T, (VEC > 1 ? VEC / 2 : 1)>(vec, st, sb, V, n, dy, d, dweight);
}

/* Segment sums then the combine, with the widest vector accesses (16 bytes at most) that d and
 * the pointers allow; the summation order does not depend on the width. */
template <typename T>
static dg_status bwd_sums(cudaStream_t st, const sort_bufs *sb, int64_t V, int64_t n,
                          const void *dy, int64_t d, void *dweight) {
    int vec = pick_vec((int)(16 / sizeof(T)), d, sizeof(T), dy, dweight);
    DG_TRY((seg_vec<T, (int)(16 / sizeof(T))>(vec, st, sb, V, n, dy, d, dweight)));
    if (pick_vec(4, d, sizeof(T), dweight, dweight) == 4)
        return launch_combine<T, 4>(st, sb, V, n, d, dweight);
    return launch_combine<T, 1>(st, sb, V, n, d, dweight);
}

static dg_status bwd_run(dg_ctx *ctx, dg_dtype wdt, void *dweight, int64_t V, int64_t d,
                         dg_dtype idt, const void *ids, int64_t n, const void *dy, int end_bit,
                         const sort_bufs *sb) {
    cudaStream_t st = dg__stream(ctx);
    /* rows without a valid id stay 0; the kernels below write every other row */
    DG_CHECK_CUDA(cudaMemsetAsync(dweight, 0, (size_t)(V * d) * dg_dtype_size(wdt), st));
    if (idt == DG_I32)
        embedding_keys_kernel<int32_t><<<dg__blocks(n, 256), 256, 0, st>>>(
            (const int32_t *)ids, n, V, sb->keys_in, sb->pos_in);
    else
        embedding_keys_kernel<int64_t><<<dg__blocks(n, 256), 256, 0, st>>>(
            (const int64_t *)ids, n, V, sb->keys_in, sb->pos_in);
    DG_CHECK_LAUNCH();
    size_t tb = sb->tmp_bytes;
    DG_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(sb->tmp, tb, sb->keys_in, sb->keys, sb->pos_in,
                                                  sb->pos, (int)n, 0, end_bit, st));
    embedding_runs_kernel<<<dg__blocks(V + 1, 256), 256, 0, st>>>(sb->keys, n, V, sb->start,
                                                                  sb->cnt);
    DG_CHECK_LAUNCH();
    emb_off zero = {0, 0};
    tb = sb->tmp_bytes;
    DG_CHECK_CUDA(cub::DeviceScan::ExclusiveScan(sb->tmp, tb, sb->cnt, sb->off, emb_off_add(), zero,
                                                 V + 1, st));
    if (wdt == DG_F32)
        return bwd_sums<float>(st, sb, V, n, dy, d, dweight);
    return bwd_sums<__nv_bfloat16>(st, sb, V, n, dy, d, dweight);
}

extern "C" dg_status dg__embedding_bwd_cuda(dg_ctx *ctx, dg_dtype wdt, void *dweight, int64_t V,
                                            int64_t d, dg_dtype idt, const void *ids, int64_t n,
                                            const void *dy) {
    if (V <= 0 || d <= 0)
        return DG_OK;
    if (wdt != DG_F32 && wdt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "embedding (cuda): weight dtype %s, expected f32 or bf16",
                       dg_dtype_name(wdt));
    if (n > INT_MAX || V >= (int64_t)UINT_MAX)
        return dg__err(DG_ERR_ARG,
                       "embedding (cuda): backward supports up to 2^31-1 ids and 2^32-2 rows, "
                       "got %lld ids and %lld rows",
                       (long long)n, (long long)V);
    if (n == 0) {
        DG_CHECK_CUDA(
            cudaMemsetAsync(dweight, 0, (size_t)(V * d) * dg_dtype_size(wdt), dg__stream(ctx)));
        return DG_OK;
    }
    int end_bit = 1; /* sort only the bits a key can have (keys are at most V) */
    while (end_bit < 32 && ((uint64_t)1 << end_bit) <= (uint64_t)V)
        end_bit++;
    sort_bufs sb;
    memset(&sb, 0, sizeof sb);
    DG_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
        NULL, sb.tmp_bytes, (const unsigned int *)NULL, (unsigned int *)NULL, (const int *)NULL,
        (int *)NULL, (int)n, 0, end_bit, dg__stream(ctx)));
    size_t scan_bytes = 0;
    emb_off zero = {0, 0};
    DG_CHECK_CUDA(cub::DeviceScan::ExclusiveScan(NULL, scan_bytes, (const emb_off *)NULL,
                                                 (emb_off *)NULL, emb_off_add(), zero, V + 1,
                                                 dg__stream(ctx)));
    if (scan_bytes > sb.tmp_bytes)
        sb.tmp_bytes = scan_bytes;
    int64_t prows = 2 * ((n + EMB_SEG - 1) / EMB_SEG);
    size_t arr = align256((size_t)n * 4), head = align256(sb.tmp_bytes);
    size_t starts = align256((size_t)(V + 1) * sizeof(int));
    size_t offs = align256((size_t)(V + 1) * sizeof(emb_off));
    size_t parts = align256((size_t)prows * (size_t)d * sizeof(float));
    size_t total = head + 4 * arr + starts + 2 * offs + parts;
    void *buf = NULL;
    DG_TRY(dg__cuda_malloc(ctx, total, &buf));
    char *b = (char *)buf;
    sb.tmp = b;
    b += head;
    sb.keys_in = (unsigned int *)b;
    sb.keys = (unsigned int *)(b + arr);
    sb.pos_in = (int *)(b + 2 * arr);
    sb.pos = (int *)(b + 3 * arr);
    b += 4 * arr;
    sb.start = (int *)b;
    b += starts;
    sb.cnt = (emb_off *)b;
    sb.off = (emb_off *)(b + offs);
    b += 2 * offs;
    sb.part = (float *)b;
    dg_status s = bwd_run(ctx, wdt, dweight, V, d, idt, ids, n, dy, end_bit, &sb);
    dg__cuda_free(ctx, buf, total);
    return s;
}

/* tests/fuzz/fuzz_seqlens.c -- cu_seqlens validation (dg_kda_seqlens) and, for the arrays it
 * accepts, chunked KDA over those sequences (chunk tables, varlen indexing). Byte 0: dtype and
 * rank; byte 1: T (-1: unchecked); the rest: the entries. */
#define _POSIX_C_SOURCE 200809L /* fuzz_util.h: getpid, dup, dup2, open */
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2)
        return 0;
    dg_dtype dt = (dg_dtype)(data[0] % DG_NDTYPES);
    int two_d = data[0] & 0x40;
    int64_t T = data[1] == 255 ? -1 : data[1] % 80;
    size_t es = dg_dtype_size(dt), n = (size - 2) / es;
    if (n == 0 || n > 64)
        return 0;
    dg_ctx *ctx = fz_ctx();
    dg_tensor *cu = NULL;
    int64_t shape[2] = {two_d ? 2 : (int64_t)n, two_d ? (int64_t)n / 2 : 1};
    if (two_d && n < 2)
        return 0;
    if (dg_tensor_from_host(ctx, dt, two_d ? 2 : 1, shape, data + 2, &cu) != DG_OK)
        abort();
    int64_t out[64];
    int ns = 0;
    dg_status s = dg_kda_seqlens(cu, T, out, 64, &ns);
    dg_tensor_free(&cu);
    if (s != DG_OK)
        return 0;
    if (two_d || !(dt == DG_I32 || dt == DG_I64) || ns < 1 || out[0] != 0)
        abort();
    int64_t Tn = out[ns];
    for (int i = 0; i < ns; i++)
        if (out[i + 1] < out[i])
            abort();
    if (Tn < 1 || Tn > 80)
        return 0;
    const int64_t qs[4] = {1, Tn, 1, 4}, vs[4] = {1, Tn, 1, 2}, bs[3] = {1, Tn, 1};
    dg_tensor *q = NULL, *k = NULL, *v = NULL, *g = NULL, *b = NULL, *o = NULL, *ht = NULL;
    if (dg_tensor_zeros(ctx, DG_F64, 4, qs, &q) || dg_tensor_zeros(ctx, DG_F64, 4, qs, &k) ||
        dg_tensor_zeros(ctx, DG_F64, 4, vs, &v) || dg_tensor_zeros(ctx, DG_F64, 4, qs, &g) ||
        dg_tensor_zeros(ctx, DG_F64, 3, bs, &b))
        abort();
    dg_tensor_fill_(q, 0.5);
    dg_tensor_fill_(k, 0.25);
    dg_tensor_fill_(v, 1.0);
    dg_tensor_fill_(g, -0.1);
    dg_tensor_fill_(b, 0.5);
    dg_kda_opts o_ = {0};
    o_.chunk_size = 16;
    o_.cu_seqlens = out;
    o_.n_seqs = ns;
    o_.output_final_state = 1;
    if (dg_kda_chunk(ctx, q, k, v, g, b, NULL, NULL, NULL, &o_, &o, &ht) != DG_OK)
        abort(); /* dg_kda_seqlens accepted it: the op must too */
    dg_tensor *all[] = {q, k, v, g, b, o, ht};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    return 0;
}

/* tests/fuzz/fuzz_npy.c -- dg_npy_load on arbitrary bytes: an error or a tensor whose size the
 * file really holds, never a crash, a leak or a huge allocation. */
#define _POSIX_C_SOURCE 200809L /* fuzz_util.h: getpid, dup, dup2, open */
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fz_file(data, size, ".npy");
    dg_tensor *t = NULL;
    dg_status s = dg_npy_load(fz_ctx(), path, &t);
    if (s == DG_OK) {
        /* a loaded tensor's bytes came from the file */
        if (!t || dg_tensor_numel(t) * (int64_t)dg_dtype_size(dg_tensor_dtype(t)) > (int64_t)size)
            abort();
        double *d = NULL;
        if (dg_tensor_to_f64(t, &d) != DG_OK)
            abort();
        free(d);
        dg_tensor_free(&t);
    } else if (t || !dg_last_error()[0]) {
        abort(); /* a failure leaves no tensor and says why */
    }
    return 0;
}

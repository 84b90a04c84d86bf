/* tools/host_rand.h -- normal values on the host for the commands that make their own inputs
 * (explain, gradcheck): the same counter-based stream as the library (dg_rand_u01), so a seed
 * gives the same values in every command. */
#ifndef DG_TOOLS_HOST_RAND_H
#define DG_TOOLS_HOST_RAND_H

#include "deltagrad.h"

#include <math.h>
#include <stdint.h>

/* p[0..n-1] = scale * N(0, 1) (Box-Muller on the pairs 2i, 2i+1 of seed's stream). */
static inline void dg__host_randn(double *p, int64_t n, uint64_t seed, double scale) {
    for (int64_t i = 0; i < n; i++) {
        double u1 = dg_rand_u01(seed, 2 * (uint64_t)i), u2 = dg_rand_u01(seed, 2 * (uint64_t)i + 1);
        if (u1 < 1e-300)
            u1 = 1e-300;
        p[i] = scale * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    }
}

#endif /* DG_TOOLS_HOST_RAND_H */

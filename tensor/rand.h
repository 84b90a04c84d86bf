/*
 * tensor/rand.h -- the counter-based generator shared by the CPU and CUDA fills.
 *
 * u01(seed, i) hashes (seed, i) with two rounds of the splitmix64 finaliser and keeps 53 bits, so
 * element i of a fill depends only on (seed, i): the same numbers on every device, in any order,
 * with any number of threads. normal(seed, i) is Box-Muller on the pair of counters (2i, 2i+1).
 */
#ifndef DG_RAND_H
#define DG_RAND_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define DG_HD __host__ __device__ __forceinline__
#else
#define DG_HD static inline
#endif

DG_HD uint64_t dg__mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

DG_HD double dg__u01(uint64_t seed, uint64_t i) {
    uint64_t z = dg__mix64(seed * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL);
    z = dg__mix64(z ^ (i * 0xd1b54a32d192ed03ULL + 0x8cb92ba72f3d8dd7ULL));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

DG_HD double dg__normal(uint64_t seed, uint64_t i) {
    double u1 = dg__u01(seed, 2 * i), u2 = dg__u01(seed, 2 * i + 1);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif

/*
 * ops/gemm_micro.h -- the GMR x GNR register-tile kernel of the CPU GEMM, included by the
 * reference part of ops/gemm.c (element type RT, ops/ref_tmpl.h) once per vector width with
 * GMICRO (its name), GVB (vector bytes) and GMICRO_ATTR (target attribute) defined.
 *
 *   acc[GMR][GNR] = sum_p ap[p][:] (outer) bp[p][:]        (ap: [kc][GMR], bp: [kc][GNR], packed)
 *   C tile = (first ? beta C : C) + alpha acc               (only the mr x nr valid part)
 *
 * The accumulators are GCC vectors so the tile stays in registers; other compilers get plain
 * loops.
 */
GMICRO_ATTR static void GMICRO(int64_t kc, const RT *restrict ap, const RT *restrict bp, RT *c,
                               int64_t ldc, int64_t mr, int64_t nr, RT alpha, RT beta, int first) {
    RT acc[GMR][GNR];
#ifdef GEMM_HAVE_VEC
#define GVL (GVB / (int)sizeof(RT))
    typedef RT vec __attribute__((vector_size(GVB), aligned(sizeof(RT)), may_alias));
    vec va[GMR][GNR / GVL];
    for (int r = 0; r < GMR; r++)
        for (int v = 0; v < GNR / GVL; v++)
            va[r][v] = (vec){0};
    for (int64_t p = 0; p < kc; p++) {
        vec bv[GNR / GVL];
        GEMM_UNROLL
        for (int v = 0; v < GNR / GVL; v++)
            bv[v] = *(const vec *)(bp + p * GNR + v * GVL);
        GEMM_UNROLL
        for (int r = 0; r < GMR; r++) {
            RT a = ap[p * GMR + r];
            GEMM_UNROLL
            for (int v = 0; v < GNR / GVL; v++)
                va[r][v] += a * bv[v];
        }
    }
    for (int r = 0; r < GMR; r++)
        for (int v = 0; v < GNR / GVL; v++)
            for (int j = 0; j < GVL; j++)
                acc[r][v * GVL + j] = va[r][v][j];
#undef GVL
#else
    for (int r = 0; r < GMR; r++)
        for (int j = 0; j < GNR; j++)
            acc[r][j] = 0;
    for (int64_t p = 0; p < kc; p++)
        for (int r = 0; r < GMR; r++)
            for (int j = 0; j < GNR; j++)
                acc[r][j] += ap[p * GMR + r] * bp[p * GNR + j];
#endif
    for (int64_t r = 0; r < mr; r++) {
        RT *cr = c + r * ldc;
        if (first && beta == 0)
            for (int64_t j = 0; j < nr; j++)
                cr[j] = alpha * acc[r][j];
        else if (first)
            for (int64_t j = 0; j < nr; j++)
                cr[j] = beta * cr[j] + alpha * acc[r][j];
        else
            for (int64_t j = 0; j < nr; j++)
                cr[j] += alpha * acc[r][j];
    }
}

#undef GMICRO
#undef GVB
#undef GMICRO_ATTR

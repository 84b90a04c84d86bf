/*
 * tensor/version.c -- the library's version and the facts of its build (commit, CUDA
 * architectures). dg_build_info.h is written into the build tree at build time by
 * cmake/build_info.cmake.
 */
#include "deltagrad.h"
#include "dg_build_info.h"

_Static_assert(DG__BUILD_VERSION_NUMBER == DG_VERSION_NUMBER,
               "the project version in CMake must be the header's DG_VERSION");

const char *dg_version(void) { return DG_VERSION; }

int dg_version_number(void) { return DG_VERSION_NUMBER; }

const char *dg_build_commit(void) { return DG__BUILD_COMMIT; }

const char *dg_build_cuda_archs(void) { return DG__BUILD_CUDA_ARCHS; }

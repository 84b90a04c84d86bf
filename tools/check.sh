#!/usr/bin/env bash
# tools/check.sh -- build everything and run the tests: the project's one test command.
#
#   1. the `default` preset: auto-detects CUDA/NCCL/MPI, so where nvcc is present every kernel is
#      compiled; runs the cpu, gpu and dist labels (gpu tests report "skipped" without a device;
#      dist tests run under mpirun with 2 and 4 ranks when MPI is installed).
#   2. the `sanitize` preset (host only, ASan + UBSan): runs the cpu label again, and the MPI
#      test programs of the dist label (leak checking off there: Open MPI's own allocations).
# Set DG_CHECK_FAST=1 to skip step 2.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

echo "== [1/2] default build (CUDA if available) + cpu, gpu and dist tests"
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs"

if [ "${DG_CHECK_FAST:-0}" != 1 ]; then
    echo "== [2/2] sanitizer build (ASan + UBSan, host only) + cpu and dist tests"
    cmake --preset sanitize
    cmake --build --preset sanitize -j "$jobs"
    ASAN_OPTIONS=detect_leaks=1 ctest --preset sanitize -j "$jobs"
fi
echo "== all checks passed"

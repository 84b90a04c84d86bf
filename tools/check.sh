#!/usr/bin/env bash
# tools/check.sh -- build everything and run the tests: the project's one test command.
#
#   1. the `default` preset: auto-detects CUDA/NCCL/MPI, so where nvcc is present every kernel is
#      compiled; runs the cpu, gpu and dist labels (gpu tests report "skipped" without a device;
#      dist tests run under mpirun with 2 and 4 ranks when MPI is installed). Then that build is
#      installed to a temporary prefix and examples/* are built against the installed package,
#      with CMake (find_package) and with pkg-config, and run (tools/check_examples.sh).
#   2. the host-only build with the other compilers and OpenMP settings: the presets
#      `cpu-noomp` (gcc), `cpu-clang` and `cpu-clang-noomp`, each running the cpu and dist labels
#      (step 1 is the gcc + OpenMP one). The clang ones need clang and, with OpenMP, libomp-dev
#      (.ci/run installs both).
#   3. the `sanitize` preset (host only, ASan + UBSan): runs the cpu label again, and the MPI
#      test programs of the dist label (leak checking off there: Open MPI's own allocations).
#   4. tools/fuzz.sh: the libFuzzer targets, DG_FUZZ_SECONDS (default 30) each, when clang can
#      link libFuzzer (.ci/run installs it).
#   0. tools/format.sh --check: every C, CUDA and header file as clang-format 14 formats it.
# Set DG_CHECK_FAST=1 to skip steps 2 to 4.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

echo "== [0/4] formatting (clang-format)"
if command -v clang-format >/dev/null; then
    bash tools/format.sh --check
else
    echo "skipped: clang-format is not installed (apt-get install clang-format)"
fi

echo "== [1/4] default build (CUDA if available) + cpu, gpu and dist tests"
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs"
echo "== [1/3] install the default build; the examples against it (CMake and pkg-config)"
bash tools/check_examples.sh build

if [ "${DG_CHECK_FAST:-0}" != 1 ]; then
    echo "== [2/4] host-only builds: gcc without OpenMP, clang with and without OpenMP"
    presets=(cpu-noomp)
    if command -v clang >/dev/null; then
        presets+=(cpu-clang cpu-clang-noomp)
    else
        echo "skipped: cpu-clang, cpu-clang-noomp (clang is not installed: apt-get install clang" \
            "libomp-dev)"
    fi
    for p in "${presets[@]}"; do
        echo "-- $p"
        cmake --preset "$p"
        cmake --build --preset "$p" -j "$jobs"
        ctest --preset "$p" -j "$jobs"
    done

    echo "== [3/4] sanitizer build (ASan + UBSan, host only) + cpu and dist tests"
    cmake --preset sanitize
    cmake --build --preset sanitize -j "$jobs"
    ASAN_OPTIONS=detect_leaks=1 ctest --preset sanitize -j "$jobs"

    echo "== [4/4] fuzzing (clang + libFuzzer, ASan + UBSan)"
    probe=$(mktemp -d)
    printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }\n' \
        >"$probe/p.c"
    if command -v clang >/dev/null && clang -fsanitize=fuzzer "$probe/p.c" -o "$probe/p" \
        >/dev/null 2>&1; then
        rm -rf "$probe"
        bash tools/fuzz.sh
    else
        rm -rf "$probe"
        echo "skipped: clang with libFuzzer is not installed (apt-get install clang libclang-rt-14-dev)"
    fi
fi
echo "== all checks passed"

#!/usr/bin/env bash
# bench/gpu_run.sh -- one batch on a GPU machine: build (cuda preset), run the gpu tests, then the
# benchmarks given as arguments (e.g. "core" "kda"). Logs go to $OUT (or ./out) and a short
# table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
{ cmake --preset cuda && cmake --build --preset cuda -j 16; } > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
ctest --preset cuda -L "${DG_LABELS:-gpu}" -j 4 --timeout 600 -V > "$out/ctest.log" 2>&1
rc=$?
for b in "$@"; do
    ./build-cuda/deltagrad bench "$b" > "$out/bench_$b.log" 2>&1
done
grep -E "NOT OK|FATAL" -B2 "$out"/ctest.log | head -40
grep -E "^[0-9]+: == .*(checks|SKIPPED)|^[0-9]+: SKIPPED" "$out/ctest.log"
grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/ctest.log" | tail -15
for b in "$@"; do echo "== bench $b"; tail -30 "$out/bench_$b.log"; done
exit $rc

#!/usr/bin/env bash
# bench/gpu_kda.sh -- the KDA performance batch: build (cuda preset), run the gpu tests, then
# `bench kda` with a per-node profile at the largest shape, all six reference shapes, and the
# training bench config. Logs go to $OUT (or ./out); a short summary is printed last.
#   DG_TESTS=0 skips the tests; DG_TRAIN=0 skips the training run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
{ cmake --preset cuda && cmake --build --preset cuda -j 16; } > "$out/build.log" 2>&1 \
    || { grep -E "error|Error" "$out/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
rc=0
if [ "${DG_TESTS:-1}" = 1 ]; then
    ctest --preset cuda -L gpu -j 4 --timeout 300 > "$out/ctest.log" 2>&1
    rc=$?
    grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/ctest.log" | tail -12
fi
./build-cuda/deltagrad bench kda --reps 3 --shape 1,8192,96,128 --profile > "$out/bench_profile.log" 2>&1
./build-cuda/deltagrad bench kda --reps 7 > "$out/bench_kda.log" 2>&1
if [ "${DG_TRAIN:-1}" = 1 ]; then
    ./build-cuda/deltagrad train --config bench --steps 30 --no-out > "$out/train_bench.log" 2>&1
    echo "train bench config: rc=$? $(grep -E 'done:' "$out/train_bench.log")"
    ./build-cuda/deltagrad train --config bench --steps 6 --no-out --profile > "$out/train_prof.log" 2>&1
    grep -E "^(KDA stages|matmuls|rest) " "$out/train_prof.log"
fi
echo "== per-node profile (1,8192,96,128)"; grep -A30 "per-stage" "$out/bench_profile.log" | head -30
echo "== bench kda"; tail -12 "$out/bench_kda.log"
exit $rc

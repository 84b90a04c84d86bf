#!/usr/bin/env bash
# bench/gpu_final.sh -- gpu tests, bench kda with and without the tensor-core path, the bench
# training config, and compute-sanitizer on the raw-kernel variants of the KDA CUDA suite
# (memcheck: every case of the tc variants; racecheck: two small cases, TF32 and 3xTF32).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
DG_LABELS=gpu bash bench/gpu_run.sh > "$out/gpu_run.txt" 2>&1
echo "gpu tests: rc=$?"; grep -E "checks|SKIPPED|tests passed|tests failed|Failed" "$out/gpu_run.txt" | grep -v "^ *[0-9]*/[0-9]* Test.*Passed"
./build-cuda/deltagrad bench kda --reps 5 > "$out/bench_kda_tc.log" 2>&1
./build-cuda/deltagrad bench kda --reps 5 --tc off > "$out/bench_kda_ffma.log" 2>&1
echo "== bench kda (TF32 tensor cores for bf16)"; tail -12 "$out/bench_kda_tc.log" | head -9
echo "== bench kda (--tc off: FFMA)"; tail -12 "$out/bench_kda_ffma.log" | head -9
./build-cuda/deltagrad train --config bench --steps 30 --no-out > "$out/train_bench.log" 2>&1
echo "train bench config: rc=$? $(grep done: "$out/train_bench.log")"
timeout 150 compute-sanitizer --tool memcheck ./build-cuda/test_kda_cuda gpu \
    --variant ffma,tf32,3xtf32 > "$out/memcheck.log" 2>&1
echo "memcheck test_kda_cuda (tc variants): rc=$? $(grep -E 'ERROR SUMMARY' "$out/memcheck.log")"
timeout 150 compute-sanitizer --tool racecheck ./build-cuda/test_kda_cuda gpu --case 0,7 \
    --variant tf32,3xtf32 > "$out/racecheck.log" 2>&1
echo "racecheck test_kda_cuda --case 0,7: rc=$? $(grep -E 'RACECHECK SUMMARY' "$out/racecheck.log")"

#!/usr/bin/env bash
# bench/gpu_cp.sh -- the context-parallel batch for a machine with two or more GPUs: build (cuda
# preset), the NCCL tests (2 ranks, one GPU each), `bench cp` of one long bf16 sequence on 1 vs 2
# GPUs (mpirun and torchrun-style launches) beside a plain run of half the length, and the bench
# training config with --cp 2 against one GPU. Logs go to $OUT (or ./out); a summary is printed
# last.  DG_TESTS=0 skips the tests; DG_TRAIN=0 the training runs; DG_CP_T="32768 65536" the T's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
t0=$(date +%s)
{ cmake --preset cuda && cmake --build --preset cuda -j 16; } > "$out/build.log" 2>&1 \
    || { grep -E "error|Error" "$out/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
dg=./build-cuda/deltagrad
rc=0
if [ "${DG_TESTS:-1}" = 1 ]; then
    ctest --preset cuda -R "gpu_nccl_np2|cp_train_gpu|kcp_gpu_np2" --timeout 300 \
        --output-on-failure > "$out/ctest.log" 2>&1
    rc=$?
    grep -E "Test +#|tests passed|tests failed" "$out/ctest.log" | tail -8
    grep -hE "NOT OK|FATAL" build-cuda/*.rank1.log build-cuda/cp_train_gpu/*.txt 2>/dev/null | head -20
fi
H=${DG_CP_H:-16}
for T in ${DG_CP_T:-32768 65536}; do
    common=(bench cp --device cuda --dtype bf16 --H "$H" --K 128 --V 128 --reps 10 --warmup 2)
    mpirun -np 2 --bind-to none "$dg" "${common[@]}" --T "$T" > "$out/cp_mpirun_T$T.log" 2>&1
    echo "T=$T mpirun 2 GPUs: rc=$?"; grep -E "^  [0-9]" "$out/cp_mpirun_T$T.log"
    port=$((29500 + RANDOM % 2000))
    for r in 0 1; do
        RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=$port "$dg" "${common[@]}" --T "$T" > "$out/cp_torchrun_T$T.log.$r" 2>&1 &
    done
    wait
    cat "$out/cp_torchrun_T$T.log.1" >> "$out/cp_torchrun_T$T.log.0"; mv "$out/cp_torchrun_T$T.log.0" "$out/cp_torchrun_T$T.log"; rm -f "$out/cp_torchrun_T$T.log.1"
    echo "T=$T torchrun-style 2 GPUs:"; grep -E "^  [0-9]|failed" "$out/cp_torchrun_T$T.log"
    "$dg" "${common[@]}" --T $((T / 2)) > "$out/cp_half_T$T.log" 2>&1
    echo "T=$((T / 2)) one GPU (the half-length run, plain then as KCP with one rank):"; grep -E "^  [0-9]" "$out/cp_half_T$T.log"
done
if [ "${DG_TRAIN:-1}" = 1 ]; then
    steps=${DG_CP_STEPS:-200}
    "$dg" train --config bench --steps "$steps" --eval-every 50 --out /tmp/train_1gpu --no-plot \
        --overwrite > "$out/train_1gpu.log" 2>&1
    echo "train bench 1 GPU: rc=$? $(grep -E 'done:' "$out/train_1gpu.log")"
    cp /tmp/train_1gpu/log.csv "$out/train_1gpu.csv"
    mpirun -np 2 --bind-to none "$dg" train --config bench --cp 2 --steps "$steps" --eval-every 50 \
        --out /tmp/train_cp2 --no-plot --overwrite > "$out/train_cp2.log" 2>&1
    echo "train bench --cp 2 (2 GPUs): rc=$? $(grep -E 'processes|done:' "$out/train_cp2.log" | tr '\n' ' ')"
    cp /tmp/train_cp2/log.csv "$out/train_cp2.csv"
fi
exit $rc

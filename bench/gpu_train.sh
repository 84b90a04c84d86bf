#!/usr/bin/env bash
# bench/gpu_train.sh -- the toy KDA language model on a GPU: a short run of the `gpu` config
# (loss curve, tokens/s), the training.md M3 `bench` config under each recompute policy (tokens/s,
# peak memory), its time split by op kind (--profile), and the docs' PyTorch loading snippet on
# the resulting checkpoint. Logs and the loss curve go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
{ cmake --preset cuda && cmake --build --preset cuda -j 16; } > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
dg=./build-cuda/deltagrad
gsteps=${DG_GPU_STEPS:-400}
bsteps=${DG_BENCH_STEPS:-30}

./build-cuda/test_train gpu > "$out/test_train_gpu.log" 2>&1
echo "test_train gpu: rc=$? $(tail -1 "$out/test_train_gpu.log")"

$dg train --config gpu --steps "$gsteps" --out runs/gpu --overwrite > "$out/train_gpu.log" 2>&1
echo "train --config gpu --steps $gsteps: rc=$?"
cp runs/gpu/loss.png "$out/loss_gpu.png" 2>/dev/null
cp runs/gpu/log.csv "$out/log_gpu.csv" 2>/dev/null
grep -E "^model|^config|params|tape after|done:" "$out/train_gpu.log"

for pol in none default all; do
    $dg train --config bench --steps "$bsteps" --recompute $pol --no-out \
        > "$out/bench_$pol.log" 2>&1
    echo "bench config, --recompute $pol: rc=$? $(grep -E 'tape after' "$out/bench_$pol.log")"
    grep -E "done:" "$out/bench_$pol.log"
done
$dg train --config bench --steps 8 --profile --no-out > "$out/bench_profile.log" 2>&1
sed -n '/time per op kind/,$p' "$out/bench_profile.log" | tail -25

# The PyTorch snippet of docs/training.md, on the gpu run's checkpoint.
sed -n '/^```python/,/^```/p' docs/training.md | sed '1d;$d' \
    | sed 's#runs/cpu/ckpt_latest.safetensors#runs/gpu/ckpt_latest.safetensors#' > "$out/snippet.py"
python3 "$out/snippet.py" > "$out/snippet.log" 2>&1
echo "docs PyTorch snippet: rc=$? $(tail -2 "$out/snippet.log" | head -c 300)"

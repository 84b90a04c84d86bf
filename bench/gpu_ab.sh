#!/usr/bin/env bash
# bench/gpu_ab.sh -- A/B of the working tree against a base commit on one GPU machine, in one
# call: both trees built side by side (cuda preset), the op's CUDA suite on the new tree, ncu per
# kernel of one `bench OP --reps 1` run at the first reference shape for both, then `bench OP`
# alternated new / base. Logs go to $OUT (or ./out); a short table is printed last.
#   bench/gpu_ab.sh [BASE_REF]          (default HEAD)
#   DG_AB_OP=kda|dplr                   the op (default kda): test_OP_cuda, bench OP
#   DG_AB_TESTS="--stage intra,wy"      extra arguments for test_OP_cuda gpu ("" runs all)
#   DG_AB_KERNELS=regex                 the kernels ncu times (default: the op's stages)
#   DG_AB_REPS=5                        bench OP --reps
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
base_ref=${1:-HEAD}
op=${DG_AB_OP:-kda}
case $op in
kda) kre_default='intra|wy_|state|out|l2norm|gate|kda' ;;
dplr) kre_default='dplr|state|out_|rows_|axpy|copy' ;;
*) echo "gpu_ab.sh: DG_AB_OP must be kda or dplr, got '$op'" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
base=/tmp/dg_base
rm -rf "$base" && mkdir -p "$base" && git archive "$base_ref" | tar -x -C "$base" || exit 1
echo "base: $(git rev-parse --short "$base_ref")"
t0=$(date +%s)
build() { (cd "$1" && cmake --preset cuda && cmake --build --preset cuda -j 8 --target deltagrad_cli test_${op}_cuda); }
build . > "$out/build_new.log" 2>&1 &
pn=$!
build "$base" > "$out/build_base.log" 2>&1 &
pb=$!
wait $pn || { grep -E "error" "$out/build_new.log" | head -20; exit 1; }
wait $pb || { grep -E "error" "$out/build_base.log" | head -20; exit 1; }
echo "builds: $(( $(date +%s) - t0 )) s"
rc=0
./build-cuda/test_${op}_cuda gpu ${DG_AB_TESTS:-} > "$out/test_${op}_cuda.log" 2>&1
rc=$?
echo "test_${op}_cuda gpu ${DG_AB_TESTS:-}: rc=$rc $(grep -E '^== .*checks' "$out/test_${op}_cuda.log" | tail -1)"
grep -E "NOT OK" "$out/test_${op}_cuda.log" | head -10
shape=1,8192,96,128
kre=${DG_AB_KERNELS:-$kre_default}
for t in new base; do
    bin=./build-cuda/deltagrad
    [ $t = base ] && bin=$base/build-cuda/deltagrad
    ncu --metrics gpu__time_duration.sum --csv -k "regex:$kre" --launch-skip 0 --launch-count 400 \
        $bin bench $op --shape $shape --reps 1 > "$out/ncu_$t.csv" 2> "$out/ncu_$t.err"
    echo "== ncu $t ($shape, one bench $op --reps 1 run: warm-up + timed calls)"
    python3 bench/ncu_kernels.py "$out/ncu_$t.csv" 14
done
reps=${DG_AB_REPS:-5}
for i in 1 2; do
    ./build-cuda/deltagrad bench $op --reps $reps > "$out/bench_new_$i.log" 2>&1
    $base/build-cuda/deltagrad bench $op --reps $reps > "$out/bench_base_$i.log" 2>&1
done
for f in new_1 base_1 new_2 base_2; do echo "== bench $op $f"; tail -12 "$out/bench_$f.log" | head -9; done
exit $rc

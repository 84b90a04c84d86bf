#!/usr/bin/env bash
# bench/gpu_ab.sh -- A/B of the working tree against a base commit on one GPU machine, in one
# call: both trees built side by side (cuda preset), each op's CUDA suite on the new tree, ncu per
# kernel of one `bench OP --reps 1` run at the first reference shape for both, then `bench OP`
# alternated new / base. Logs go to $OUT (or ./out), packed into gpu_ab_logs.tgz at the end; a
# short table is printed last.
#   bench/gpu_ab.sh [BASE_REF]          (default HEAD)
#   DG_AB_OP=kda|dplr|kda,dplr          the ops (default kda): test_OP_cuda, bench OP for each
#   DG_AB_TESTS="--stage intra,wy"      extra arguments for test_OP_cuda gpu ("" runs all)
#   DG_AB_KERNELS=regex                 the kernels ncu times (default: the op's stages)
#   DG_AB_REPS=5                        bench OP --reps
#   DG_AB_SAN="racecheck:--case 7;memcheck:--stage wy --case 1,13"
#                                       compute-sanitizer runs of test_OP_cuda gpu (';'-separated
#                                       TOOL:ARGS, at most 150 s each), right after its tests and
#                                       before any timing, so that a call cut short still has them
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
base_ref=${1:-HEAD}
IFS=, read -r -a ops <<< "${DG_AB_OP:-kda}"
targets=(deltagrad_cli)
for op in "${ops[@]}"; do
    case $op in
    kda | dplr) targets+=("test_${op}_cuda") ;;
    *) echo "gpu_ab.sh: DG_AB_OP must list kda and/or dplr, got '$op'" >&2; exit 2 ;;
    esac
done
kre_of() {
    case $1 in
    kda) echo 'intra|wy_|state|out|l2norm|gate|kda' ;;
    dplr) echo 'dplr|state|out_|rows_|axpy|copy' ;;
    esac
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
base=/tmp/dg_base
rm -rf "$base" && mkdir -p "$base" && git archive "$base_ref" | tar -x -C "$base" || exit 1
echo "base: $(git rev-parse --short "$base_ref")"
t0=$(date +%s)
build() { (cd "$1" && cmake --preset cuda && cmake --build --preset cuda -j "$2" --target "${@:3}"); }
build . 10 "${targets[@]}" > "$out/build_new.log" 2>&1 &
pn=$!
build "$base" 6 deltagrad_cli > "$out/build_base.log" 2>&1 &
pb=$!
wait $pn || { grep -E "error" "$out/build_new.log" | head -20; exit 1; }
wait $pb || { grep -E "error" "$out/build_base.log" | head -20; exit 1; }
echo "builds: $(( $(date +%s) - t0 )) s"
rc=0
shape=1,8192,96,128
reps=${DG_AB_REPS:-5}
for op in "${ops[@]}"; do
    ./build-cuda/test_${op}_cuda gpu ${DG_AB_TESTS:-} > "$out/test_${op}_cuda.log" 2>&1
    r=$?
    [ $r -ne 0 ] && rc=$r
    echo "test_${op}_cuda gpu ${DG_AB_TESTS:-}: rc=$r $(grep -E '^== .*checks' "$out/test_${op}_cuda.log" | tail -1)"
    grep -E "NOT OK" "$out/test_${op}_cuda.log" | head -10
    IFS=';' read -r -a sans <<< "${DG_AB_SAN:-}"
    si=0
    for sa in "${sans[@]}"; do
        tool=${sa%%:*}
        sargs=${sa#*:}
        [ "$sargs" = "$sa" ] && sargs=""
        si=$((si + 1))
        slog="$out/san_${op}_${si}_$tool.log"
        timeout 150 compute-sanitizer --tool "$tool" --print-limit 5 ./build-cuda/test_${op}_cuda gpu \
            $sargs > "$slog" 2>&1
        r=$?
        [ $r -ne 0 ] && rc=$r
        echo "compute-sanitizer --tool $tool test_${op}_cuda gpu $sargs: rc=$r" \
            "$(grep -E 'SUMMARY' "$slog" | tail -1) $(grep -E '^== .*checks' "$slog" | tail -1)"
        grep -E "NOT OK" "$slog" | head -5
    done
    kre=${DG_AB_KERNELS:-$(kre_of "$op")}
    for t in new base; do
        bin=./build-cuda/deltagrad
        [ $t = base ] && bin=$base/build-cuda/deltagrad
        ncu --metrics gpu__time_duration.sum --csv -k "regex:$kre" --launch-skip 0 --launch-count 400 \
            $bin bench $op --shape $shape --reps 1 > "$out/ncu_${op}_$t.csv" 2> "$out/ncu_${op}_$t.err"
        echo "== ncu $op $t ($shape, one bench $op --reps 1 run: warm-up + timed calls)"
        python3 bench/ncu_kernels.py "$out/ncu_${op}_$t.csv" 14
    done
    for i in 1 2; do
        ./build-cuda/deltagrad bench $op --reps $reps > "$out/bench_${op}_new_$i.log" 2>&1
        $base/build-cuda/deltagrad bench $op --reps $reps > "$out/bench_${op}_base_$i.log" 2>&1
    done
done
for op in "${ops[@]}"; do
    for f in new_1 base_1 new_2 base_2; do
        echo "== bench $op $f"
        grep -E "^B,T,H|^[0-9]+," "$out/bench_${op}_$f.log"
    done
done
# every log in one archive (ncu tables, test and bench logs, builds): one file to copy back
(cd "$out" && tar czf gpu_ab_logs.tgz --remove-files gpu.txt build_*.log test_*_cuda.log san_*.log ncu_* bench_*_*.log 2>/dev/null)
exit $rc

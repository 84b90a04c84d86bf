#!/usr/bin/env bash
# tests/scripts/train_cp.sh MPIRUN DELTAGRAD WORKDIR -- `deltagrad train --cp N` computes what one
# process computes: the same loss curve (CPU f32, up to the order of rounding) with the KDA mixer
# and with `--mixer dplr`, and checkpoints move between a CP run and a one-process run in both
# directions.
#
# Tolerance: 2e-5 relative per step. The CP run sums the same terms in another order (chunk grids
# start at each rank's slice, losses and gradients are summed over ranks), so f32 results differ
# by a few units of f32 rounding (observed ~4e-7 relative); 2e-5 leaves room for that to grow
# over 8 optimizer steps, and is far below a real error (a lost carried state moves the loss by
# ~1e-2 at the first step).
#
# A 4th argument `cuda` runs the two-process comparisons on CUDA (f32), exit 77 without a device.
# With one GPU both processes share it through the MPI backend's host staging; with two or more,
# mpirun gives each rank its own GPU and the NCCL backend, and a torchrun-style launch (RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the NCCL id over TCP) is compared too.
set -u
mpirun=$1 dg=$2 work=$3 device=${4:-cpu}
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
args=(--steps 8 --eval-every 4 --sample-every -1 --seq-len 64 --batch 4 --layers 1 --d 32
      --no-plot --threads 1 --device "$device")
if [ "$device" = cuda ]; then
    "$dg" version | grep -qE "CUDA devices: [1-9]" || { echo "SKIPPED: no CUDA device"; exit 77; }
    args+=(--dtype f32)
fi
fail=0
run1() { "$dg" train "${args[@]}" "$@" >/dev/null 2>err.txt || { cat err.txt; echo "NOT OK: $dg train $*"; fail=1; }; }
runN() { local np=$1; shift
         "$mpirun" --oversubscribe -np "$np" "$dg" train "${args[@]}" "$@" >last.out 2>err.txt ||
             { cat err.txt; echo "NOT OK: mpirun -np $np deltagrad train $*"; fail=1; }; }
# compare NAME REF.csv GOT.csv: train_loss (column 2) of every step, and val_loss (column 3)
compare() {
    awk -F, -v name="$1" 'NR == FNR { if (FNR > 1) { a[$1] = $2; v[$1] = $3 } next }
        FNR > 1 { n++; d = $2 - a[$1]; if (d < 0) d = -d; r = d / a[$1]; if (r > m) m = r
                  if ($3 != "" && v[$1] != "") { d = $3 - v[$1]; if (d < 0) d = -d
                      if (d / v[$1] > m) m = d / v[$1] } }
        END { ok = n == 8 && m <= 2e-5
              printf "%s %-44s %d steps, max rel diff %.2e (tol 2e-5)\n", ok ? "OK    " : "NOT OK", name, n, m
              exit ok ? 0 : 1 }' "$2" "$3" || fail=1
}
run1 --out one
runN 2 --cp 2 --out cp2
compare "--cp 2 vs one process" one/log.csv cp2/log.csv
if [ "$device" = cuda ]; then # the rest repeats device-independent logic
    run1 --mixer dplr --out one_dplr
    runN 2 --cp 2 --mixer dplr --out cp2_dplr
    compare "--mixer dplr --cp 2 vs one process" one_dplr/log.csv cp2_dplr/log.csv
    runN 2 --cp 2 --out a --stop-at 4
    "$dg" train --out a --resume --no-plot --threads 1 --device cuda --dtype f32 >/dev/null \
        2>err.txt || { cat err.txt; fail=1; }
    compare "--cp 2 to step 4, resumed by one process" one/log.csv a/log.csv
    ngpu=$("$dg" version | sed -n 's/.*CUDA devices: \([0-9]*\).*/\1/p')
    if [ "${ngpu:-0}" -ge 2 ]; then
        port=$((29500 + RANDOM % 2000))
        for r in 0 1; do
            RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
                MASTER_PORT=$port "$dg" train "${args[@]}" --cp 2 --out tr >"tr$r.out" 2>&1 &
            pids[$r]=$!
        done
        for r in 0 1; do wait "${pids[$r]}" || { cat "tr$r.out"; echo "NOT OK: rank $r"; fail=1; }; done
        if grep -q "2 processes (NCCL)" tr0.out; then echo "OK     torchrun-style launch uses NCCL"
        else echo "NOT OK torchrun-style launch: no '2 processes (NCCL)' line"; fail=1; fi
        compare "--cp 2 torchrun-style (NCCL) vs one process" one/log.csv tr/log.csv
        if grep -q "2 processes (NCCL)" last.out; then echo "OK     mpirun with 2 GPUs uses NCCL"
        else echo "NOT OK mpirun with 2 GPUs: no '2 processes (NCCL)' line"; fail=1; fi
    fi
    exit $fail
fi
runN 4 --cp 4 --out cp4
compare "--cp 4 vs one process" one/log.csv cp4/log.csv
runN 4 --cp 2 --out cp2dp2
compare "--cp 2 x 2 data-parallel vs one process" one/log.csv cp2dp2/log.csv
runN 2 --out dp2
compare "2 data-parallel processes vs one process" one/log.csv dp2/log.csv
run1 --out one_acc --accum 2 --batch 2
runN 4 --cp 2 --accum 2 --batch 2 --out cp2dp2_acc
compare "--cp 2 x 2 groups, --accum 2 vs one process" one_acc/log.csv cp2dp2_acc/log.csv
# the DPLR mixer: its KCP (dg_dplr_chunk_cp) under the model, 2 and 4 ranks
run1 --mixer dplr --out one_dplr
runN 2 --cp 2 --mixer dplr --out cp2_dplr
compare "--mixer dplr --cp 2 vs one process" one_dplr/log.csv cp2_dplr/log.csv
runN 4 --cp 4 --mixer dplr --out cp4_dplr
compare "--mixer dplr --cp 4 vs one process" one_dplr/log.csv cp4_dplr/log.csv
# a CP checkpoint resumed by one process, and the other way round
runN 2 --cp 2 --out a --stop-at 4
"$dg" train --out a --resume --no-plot --threads 1 --device cpu >/dev/null 2>err.txt ||
    { cat err.txt; fail=1; }
compare "--cp 2 to step 4, resumed by one process" one/log.csv a/log.csv
run1 --out b --stop-at 4
"$mpirun" --oversubscribe -np 2 "$dg" train --out b --resume --cp 2 --no-plot --threads 1 \
    --device cpu >/dev/null 2>err.txt || { cat err.txt; fail=1; }
compare "one process to step 4, resumed by --cp 2" one/log.csv b/log.csv
# misuse gives a clear error
out=$("$dg" train "${args[@]}" --cp 2 --no-out 2>&1); rc=$?
if [ $rc -eq 2 ] && echo "$out" | grep -q "launch with mpirun -np 2"; then
    echo "OK     --cp 2 without mpirun: exit 2, names the launch command"
else echo "NOT OK --cp 2 without mpirun: exit $rc: $out"; fail=1; fi
out=$(RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 \
      "$dg" train "${args[@]}" --cp 2 --no-out 2>&1); rc=$?
if [ $rc -eq 2 ] && echo "$out" | grep -q "started by torchrun" && echo "$out" | grep -q "mpirun"; then
    echo "OK     torchrun-style launch on the CPU: exit 2, says to use mpirun"
else echo "NOT OK torchrun-style launch on the CPU: exit $rc: $out"; fail=1; fi
out=$("$mpirun" --oversubscribe -np 3 "$dg" train "${args[@]}" --cp 2 --no-out 2>&1); rc=$?
if [ $rc -ne 0 ] && echo "$out" | grep -q "must divide the number of processes"; then
    echo "OK     --cp 2 on 3 processes: fails, says why"
else echo "NOT OK --cp 2 on 3 processes: exit $rc: $out"; fail=1; fi
exit $fail

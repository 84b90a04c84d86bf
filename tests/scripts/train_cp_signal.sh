#!/usr/bin/env bash
# tests/scripts/train_cp_signal.sh MPIRUN DELTAGRAD WORKDIR -- SIGTERM to `mpirun -np 2 deltagrad
# train --cp 2`: every rank stops after the same step, rank 0 writes the checkpoint of that step
# before anyone exits, the job exits non-zero, and --resume continues from the checkpoint.
set -u
mpirun=$1 dg=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
src=$(cd "$(dirname "$0")/../.." && pwd)
run="$work/run"
flags=(--cp 2 --data "$src/data/kjv.txt" --max-bytes 20000 --out "$run" --batch 2 --seq-len 32
       --d 16 --heads 1 --head-dim 16 --inter 32 --chunk-size 16 --eval-every 0 --sample-every -1
       --ckpt-every 0 --no-plot --threads 1)
fail=0
lines() { [ -f "$run/log.csv" ] && echo $(($(wc -l <"$run/log.csv") - 1)) || echo 0; }
ckpt_step() {
    /usr/bin/python3 - "$run/ckpt_latest.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
print(json.loads(b[8:8 + n])["__metadata__"]["step"])
PY
}

"$mpirun" --oversubscribe -np 2 "$dg" train --steps 1000000 "${flags[@]}" \
    >"$work/out.txt" 2>"$work/err.txt" &
pid=$!
for _ in $(seq 600); do
    [ "$(lines)" -ge 5 ] && break
    sleep 0.2
done
kill -TERM "$pid"
wait "$pid" # a job that never ends is caught by the test's ctest TIMEOUT
rc=$?
n=$(lines)
step=$(ckpt_step 2>/dev/null || echo none)
stopped=$(grep -c "stopped" "$work/err.txt")
echo "SIGTERM after $n logged steps: exit $rc, checkpoint step $step, $stopped rank(s) report the stop"
grep -E "stopped|rank" "$work/err.txt" | head -4
if [ "$rc" -eq 0 ]; then echo "NOT OK the job exited 0"; fail=1; fi
if [ "$step" != "$n" ]; then echo "NOT OK checkpoint step $step != logged steps $n"; fail=1; fi
if [ "$stopped" -ne 2 ]; then echo "NOT OK not every rank stopped cleanly"; fail=1; fi
if ls "$run" | grep -q "\.tmp"; then echo "NOT OK temp files left: $(ls "$run")"; fail=1; fi

if [ "$fail" -eq 0 ]; then
    target=$((n + 2))
    "$mpirun" --oversubscribe -np 2 "$dg" train --resume --out "$run" --steps "$target" \
        --threads 1 --no-plot >"$work/resume.txt" 2>&1
    rc=$?
    echo "--resume to step $target: exit $rc, log.csv now $(lines) steps"
    if [ "$rc" -ne 0 ] || [ "$(lines)" -ne "$target" ]; then
        echo "NOT OK the resumed run did not reach step $target"
        tail -5 "$work/resume.txt"
        fail=1
    fi
fi
[ "$fail" -eq 0 ] && echo "OK     SIGTERM under mpirun: one step, one checkpoint, resumable"
exit $fail

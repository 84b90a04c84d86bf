#!/usr/bin/env bash
# tests/scripts/ckpt_torch_check.sh DELTAGRAD PYTHON3 WORKDIR -- tools/ckpt_to_torch.py against
# `deltagrad sample --print-logits` on small trained checkpoints (KDA with the lower-bound gate
# and GVA, KDA with the plain gate and a tied head, the DPLR mixer), on a prompt longer than the
# chunk size. With PyTorch importable it runs the PyTorch model; otherwise the NumPy one
# (--numpy); with neither it exits 77 (skipped).
set -u
dg=$1
py=$2
work=$3
backend=()
pick=""
for cand in "$py" python3 /usr/bin/python3; do
    if command -v "$cand" >/dev/null && "$cand" -c "import torch, numpy" 2>/dev/null; then
        pick=$cand
        break
    fi
done
if [ -z "$pick" ]; then
    for cand in "$py" python3 /usr/bin/python3; do
        if command -v "$cand" >/dev/null && "$cand" -c "import numpy" 2>/dev/null; then
            pick=$cand
            backend=(--numpy)
            break
        fi
    done
fi
if [ -z "$pick" ]; then
    echo "SKIPPED: neither torch nor numpy can be imported (apt-get install python3-numpy)"
    exit 77
fi
echo "backend: $pick ${backend[*]:-(torch)}"
here=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work"
mkdir -p "$work"
fail=0
prompt="In the beginning God created the heaven and the earth."
run() {
    local name=$1
    shift
    if ! "$dg" train --device cpu --threads 1 --steps 30 --batch 2 --seq-len 32 --d 32 \
        --layers 2 --inter 48 --chunk-size 16 --eval-every 0 --sample-every -1 --no-plot \
        --max-bytes 60000 --lr 1e-2 --warmup 2 --out "$work/$name" "$@" >"$work/$name.log" 2>&1; then
        echo "NOT OK $name: deltagrad train failed"
        sed 's/^/    /' "$work/$name.log"
        fail=1
        return
    fi
    local out rc
    out=$("$pick" "$here/tools/ckpt_to_torch.py" "$work/$name" --deltagrad "$dg" \
        --prompt "$prompt" "${backend[@]}" 2>&1)
    rc=$?
    echo "$out" | sed 's/^/    /'
    if [ $rc -eq 0 ] && echo "$out" | grep -q '^PASS: '; then
        echo "OK     $name"
    else
        echo "NOT OK $name (exit $rc)"
        fail=1
    fi
}
run kda_lowerbound_gva --heads 1 --v-heads 2 --head-dim 8 --head-v-dim 16
run kda_gate_tie --heads 2 --head-dim 8 --gate kda --tie
run dplr --mixer dplr --heads 2 --head-dim 8
# the comparison can fail: f32 against f64 is not within 1e-12
out=$("$pick" "$here/tools/ckpt_to_torch.py" "$work/dplr" --deltagrad "$dg" --prompt "$prompt" \
    --tol 1e-12 "${backend[@]}" 2>&1)
rc=$?
if [ $rc -eq 1 ] && echo "$out" | grep -q '^FAIL: '; then
    echo "OK     --tol 1e-12 fails (exit 1)"
else
    echo "NOT OK --tol 1e-12 -> exit $rc"
    fail=1
fi
exit $fail

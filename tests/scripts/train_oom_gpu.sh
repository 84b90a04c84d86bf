#!/usr/bin/env bash
# tests/scripts/train_oom_gpu.sh DELTAGRAD -- a training run that cannot fit on the GPU ends with
# a non-zero exit, an error that names the allocation (its bytes and the device) and the hint on
# how to need less memory. Skipped (77) where the build or the machine has no CUDA device.
set -u
dg=$1
devs=$("$dg" version | sed -n 's/.*CUDA devices: \([0-9]*\).*/\1/p')
if [ -z "$devs" ] || [ "$devs" -lt 1 ]; then
    echo "SKIPPED train_oom_gpu: no CUDA device"
    exit 77
fi
# 4096 sequences of 65536 bytes: the first activation alone is 512 GiB
out=$("$dg" train --device cuda --config bench --batch 4096 --seq-len 65536 --steps 1 --no-out 2>&1)
rc=$?
echo "$out" | tail -5
fail=0
check() { if echo "$out" | grep -q -- "$1"; then echo "OK     $2"; else echo "NOT OK $2"; fail=1; fi; }
if [ $rc -eq 0 ]; then echo "NOT OK the run exited 0"; fail=1; else echo "OK     exit $rc"; fi
check "out of memory" "the error says out of memory"
check "bytes" "the error names the allocation's size"
check "cuda" "the error names the device"
check "hint:" "the error gives a hint"
check "recompute all" "the hint names --recompute all"
exit $fail

#!/usr/bin/env bash
# tests/scripts/bench_cp.sh MPIRUN DELTAGRAD NP -- `deltagrad bench cp` runs on NP ranks, prints
# both rows, and counts the bytes KCP must send: two all_gathers (forward, backward) of
# HV*K*(K+V) f32 values per rank, each reaching the NP-1 other ranks.
set -u
mpirun=$1 dg=$2 np=$3
H=2 K=16 V=32
out=$("$mpirun" --oversubscribe -np "$np" "$dg" bench cp --T 512 --H $H --K $K --V $V \
      --chunk-size 32 --reps 2 --warmup 1 2>&1)
rc=$?
echo "$out"
want=$((2 * H * K * (K + V) * 4 * (np - 1)))
got=$(echo "$out" | awk -v np="$np" '$1 == np && NF >= 6 { print $5 }')
if [ $rc -ne 0 ]; then echo "NOT OK bench cp exited $rc"; exit 1; fi
if [ "$got" != "$want" ]; then echo "NOT OK bytes sent per rank: got '$got', want $want"; exit 1; fi
echo "OK     bench cp on $np ranks: bytes sent per rank and iteration $got (want $want)"

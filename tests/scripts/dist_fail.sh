#!/usr/bin/env bash
# tests/scripts/dist_fail.sh MPIRUN COMM_FAIL_EXE NP -- a hung rank and a dead rank must end the
# job with a clear error within the timeout, never a silent hang.
set -u
mpirun=$1 exe=$2 np=$3
timeout_s=2
limit=45 # seconds for the whole job: the timeout plus mpirun's start and tear-down
fail=0
for mode in hang die; do
    SECONDS=0
    out=$(timeout $((limit + 30)) "$mpirun" --oversubscribe -np "$np" "$exe" "$mode" "$timeout_s" 2>&1)
    rc=$?
    el=$SECONDS
    echo "---- $mode (np $np): exit $rc after ${el}s"
    echo "$out" | grep -E "comm_fail|exited|non-zero|Abort|abort" | head -12
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then
        echo "NOT OK $mode: the job did not end with an error (exit $rc)"
        fail=1
    elif [ "$el" -gt "$limit" ]; then
        echo "NOT OK $mode: the job took ${el}s (limit ${limit}s)"
        fail=1
    fi
    if [ "$mode" = hang ]; then
        if ! echo "$out" | grep -q "DG_ERR_COMM.*did not complete the call within the timeout of 2.0 s"; then
            echo "NOT OK hang: no rank reported the timeout"
            fail=1
        else
            echo "OK     hang: the waiting ranks reported DG_ERR_COMM and ended the job"
        fi
    else
        if ! echo "$out" | grep -qE "DG_ERR_COMM|non-zero status|exited on signal"; then
            echo "NOT OK die: neither a timeout nor mpirun named the dead rank"
            fail=1
        else
            echo "OK     die: the job ended with an error naming the failure"
        fi
    fi
done
exit $fail

#!/usr/bin/env bash
# tools/fuzz.sh -- build the libFuzzer targets (preset `fuzz`: clang, ASan + UBSan) and run each
# for a bounded time on its seed corpus (tests/fuzz/corpus/<target>).
#
#   DG_FUZZ_SECONDS   seconds per target (default 30)
#   DG_FUZZ_TARGETS   which targets (default: all of tests/fuzz/fuzz_*.c)
#
# First every committed input (corpus and tests/fuzz/regress/<target>, the inputs of past
# crashes) is replayed through ctest. Then each target mutates its corpus; new inputs go to
# build-fuzz/fuzz-work/<target>/corpus, never into the source tree. A crash, leak, UB report or a
# run longer than 10 s on one input fails the script; the input is kept under
# build-fuzz/fuzz-work/<target>/artifacts and replayed once with its report shown. Copy it into
# tests/fuzz/regress/<target>/ with the fix, so it is replayed from then on.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${DG_FUZZ_SECONDS:-30}
jobs=$(nproc 2>/dev/null || echo 2)
targets=${DG_FUZZ_TARGETS:-$(cd tests/fuzz && ls fuzz_*.c | sed 's/^fuzz_//; s/\.c$//')}

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$jobs"
ctest --preset fuzz -j "$jobs"

work=build-fuzz/fuzz-work
status=0
for t in $targets; do
    mkdir -p "$work/$t/corpus" "$work/$t/artifacts"
    log="$work/$t/log"
    if ./build-fuzz/"fuzz_$t" -max_total_time="$secs" -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$work/$t/artifacts/" "$work/$t/corpus" "tests/fuzz/corpus/$t" \
        >"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        echo "fuzz $t: ${runs:-?} inputs in ${secs}s, no failure"
    else
        status=1
        echo "fuzz $t: FAILED; the end of its log:"
        tail -n 40 "$log"
        for a in "$work/$t"/artifacts/*; do
            [ -f "$a" ] || continue
            echo "--- replaying $a"
            DG_FUZZ_VERBOSE=1 ./build-fuzz/"fuzz_$t" "$a" 2>&1 | tail -n 40 || true
        done
    fi
done
exit $status

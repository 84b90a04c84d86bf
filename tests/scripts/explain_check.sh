#!/usr/bin/env bash
# `deltagrad explain`: every identity it prints holds (residual <= 1e-10, exit 0), in the forward
# and backward walks of KDA and DPLR, with KCP on simulated ranks and with a --stage filter; with
# `plots`, --plots DIR renders non-empty PNGs (skipped, exit 77, without gnuplot).
# usage: explain_check.sh DELTAGRAD OUTDIR [ids|plots]
set -u
cli=$1
out=$2
mode=${3:-ids}
mkdir -p "$out"
fail=0

if [ "$mode" = plots ]; then
    if ! command -v gnuplot >/dev/null 2>&1; then
        echo "SKIP: gnuplot is not installed"
        exit 77
    fi
    rm -rf "$out/plots"
    if ! "$cli" explain --plots "$out/plots" >"$out/plots.log" 2>&1; then
        cat "$out/plots.log"
        echo "FAIL: explain --plots exited non-zero"
        exit 1
    fi
    sig=$(printf '\211PNG\r\n\032\n' | od -An -tx1 | tr -d ' \n')
    for p in lkk aqk decay state_norms error_chunk error_gate; do
        f="$out/plots/$p.png"
        for aux in "$out/plots/$p.gp"; do
            [ -s "$aux" ] || { echo "FAIL: $aux missing"; fail=1; }
        done
        if [ ! -s "$f" ]; then
            echo "FAIL: $f missing or empty"
            fail=1
        elif [ "$(head -c 8 "$f" | od -An -tx1 | tr -d ' \n')" != "$sig" ]; then
            echo "FAIL: $f is not a PNG"
            fail=1
        else
            echo "ok: $f ($(wc -c <"$f") bytes)"
        fi
    done
    exit $fail
fi

# run NAME ARGS...: exit 0, at least one residual line, every one ok and <= 1e-10
run() {
    local name=$1
    shift
    local log="$out/$name.log"
    "$cli" explain "$@" >"$log" 2>&1
    local rc=$?
    local n bad
    n=$(grep -c ': residual ' "$log")
    bad=$(grep ': residual ' "$log" | awk '{
        for (i = 1; i < NF; i++) if ($i == "residual") v = $(i + 1);
        if ($NF != "(ok)" || !(v + 0 <= 1e-10)) print }')
    if [ "$rc" -ne 0 ] || [ "$n" -eq 0 ] || [ -n "$bad" ]; then
        echo "FAIL: explain $* (exit $rc, $n residual lines)"
        [ -n "$bad" ] && echo "$bad"
        tail -20 "$log"
        fail=1
    else
        echo "ok: explain $* ($n identities)"
    fi
}

run kda
run kda_backward --backward
run kda_cp2 --cp 2
run kda_cp3_odd --cp 3 --T 21 --chunk-size 4 --K 3 --V 5 --gate lowerbound --strength 2
run kda_stage --stage intra
run kda_stage_bwd --backward --stage wy
run kda_cp2_backward --cp 2 --backward
run kda_cp3_backward --cp 3 --backward
run kda_cp3_backward_odd --cp 3 --backward --T 21 --chunk-size 4 --K 3 --V 5 --gate lowerbound \
    --strength 2
run dplr --dplr
run dplr_backward --dplr --backward --cp 2
run dplr_cp3_backward --dplr --backward --cp 3
run dplr_stage --dplr --stage state

# --cp N --backward walks the KCP backward: the reverse merge checked against the recurrence on
# every rank but the last, the affine map and M^T on every rank but the first, and every gradient
# of the ranks against the one-rank backward
cp_bwd() { # cp_bwd LOG N GRADIENTS...
    local log="$out/$1.log" n=$2 want=0 got i g
    shift 2
    for ((i = 0; i < n - 1; i++)); do
        want=$((want + 1))
        grep -q "^  rank $i: merged dh_out = recurrence gradient of the state after token .*(ok)$" \
            "$log" || { echo "FAIL: $log: no reverse-merge identity for rank $i"; fail=1; }
    done
    for ((i = 1; i < n; i++)); do
        want=$((want + 3))
        grep -q "^  rank $i: .* = its local dh0: residual .*(ok)$" "$log" &&
            grep -q "^  rank $i: backward M^T = transpose of forward M: .*(ok)$" "$log" ||
            { echo "FAIL: $log: no reverse-summary identities for rank $i"; fail=1; }
    done
    for g in "$@"; do
        want=$((want + 1))
        grep -q "^  $g of the ranks = $g of the one-rank backward: residual .*(ok)$" "$log" ||
            { echo "FAIL: $log: no identity for $g of the ranks"; fail=1; }
    done
    want=$((want + 1))
    grep -q "^  rank 0's dh0 = dh0 of the one-rank backward: residual .*(ok)$" "$log" ||
        { echo "FAIL: $log: no identity for rank 0's dh0"; fail=1; }
    got=$(sed -n '/^== kcp: backward/,$p' "$log" | grep -c ': residual .*(ok)$')
    if [ "$got" -ne "$want" ]; then
        echo "FAIL: $log: $got KCP backward identities, expected $want"
        fail=1
    fi
}
cp_bwd kda_cp2_backward 2 dq dk dv dg dbeta
cp_bwd kda_cp3_backward 3 dq dk dv dg dbeta
cp_bwd kda_cp3_backward_odd 3 dq dk dv dg dbeta
cp_bwd dplr_backward 2 dq dk dv da db dgk
cp_bwd dplr_cp3_backward 3 dq dk dv da db dgk

# --stage shows one stage only
if grep -q '^== ' "$out/kda_stage.log" && [ "$(grep -c '^== ' "$out/kda_stage.log")" -ne 1 ]; then
    echo "FAIL: --stage intra printed more than one stage"
    fail=1
fi
# the card is still there
if ! "$cli" explain --card | grep -q 'N5 kda_wy'; then
    echo "FAIL: explain --card lacks the stage card"
    fail=1
fi
# a bad stage name is a usage error
"$cli" explain --stage nope >/dev/null 2>&1
if [ $? -ne 2 ]; then
    echo "FAIL: explain --stage nope did not exit 2"
    fail=1
fi
exit $fail

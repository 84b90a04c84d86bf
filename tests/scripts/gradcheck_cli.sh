#!/usr/bin/env bash
# tests/scripts/gradcheck_cli.sh DELTAGRAD -- `deltagrad gradcheck` through the binary: stages and
# composites of both ops on a few shapes (varlen, GVA, gates, policies) exit 0 with every printed
# error below 1e-6 and a PASS line; an impossible --tol gives FAIL and exit 1; bad flags exit 2
# with a message that names the flag. The numeric flags' strict parsing is in test_harden's table.
set -u
dg=$1
fail=0
ok() { echo "OK     $1"; }
notok() { echo "NOT OK $1"; fail=1; }

# A run that must pass: exit 0, a PASS line, at least one "rel err" and every one below 1e-6.
pass_case() {
    local out rc
    out=$("$dg" gradcheck "$@" 2>&1)
    rc=$?
    local errs
    errs=$(echo "$out" | sed -n 's/^  .* rel err \([^ ]*\) .*/\1/p')
    local bad
    bad=$(echo "$errs" | awk 'NF && !($1 + 0 < 1e-6) {print}')
    if [ $rc -eq 0 ] && [ -n "$errs" ] && [ -z "$bad" ] && echo "$out" | grep -q '^PASS: '; then
        ok "gradcheck $* ($(echo "$errs" | wc -l) inputs, max $(echo "$errs" | sort -g | tail -1))"
    else
        notok "gradcheck $* -> exit $rc"
        echo "$out" | sed 's/^/    /'
    fi
}

# A usage error: exit 2 and the flag named on stderr.
bad_case() {
    local flag=$1
    shift
    local err rc
    err=$("$dg" gradcheck "$@" 2>&1 >/dev/null)
    rc=$?
    if [ $rc -eq 2 ] && echo "$err" | grep -q -- "$flag"; then
        ok "gradcheck $* -> exit 2 naming $flag"
    else
        notok "gradcheck $* -> exit $rc: $err"
    fi
}

echo "-- stages and composites (f64, CPU)"
for st in l2norm beta gate_cumsum intra wy state output recurrent chunk; do
    pass_case kda --stage "$st"
done
pass_case kda --stage beta --allow-neg-eigval
pass_case kda --stage gate --gate kda --H 2 --HV 4
pass_case kda --stage gate_cumsum --gate lowerbound --lower-bound -2 --B 2
pass_case kda --stage intra --H 2 --HV 4 --chunk-size 32 --T 45
pass_case kda --stage state --cu-seqlens 0,16,19,40 --recompute none
pass_case kda --stage output --cu-seqlens 0,3,8,20
pass_case kda --gate lowerbound --l2norm-qk --beta-sigmoid --allow-neg-eigval --HV 2
pass_case kda --gate kda --cu-seqlens 0,5,5,21,40 --no-h0 --recompute none
for st in gate_cumsum intra wy state output recurrent chunk; do
    pass_case dplr --stage "$st"
done
pass_case dplr --stage wy --g-dist rwkv7 --cu-seqlens 0,3,8,20
pass_case dplr --stage state --no-h0 --B 2 --K 3 --V 2
pass_case dplr --g-dist logsigmoid --H 2 --K 8 --V 4 --T 50 --chunk-size=32 --recompute=all
pass_case dplr --stage recurrent --T 70 --K 2 --V 2 --seed 7

echo "-- a tolerance no gradient can meet"
out=$("$dg" gradcheck kda --stage l2norm --tol 1e-15 2>&1)
rc=$?
if [ $rc -eq 1 ] && echo "$out" | grep -q '^FAIL: ' && echo "$out" | grep -q 'OVER TOL'; then
    ok "--tol 1e-15: FAIL, exit 1"
else
    notok "--tol 1e-15 -> exit $rc: $out"
fi

echo "-- bad flags"
bad_case --stage kda --stage nosuch
bad_case --stage dplr --stage l2norm
bad_case --HV kda --H 2 --HV 3
bad_case --HV dplr --HV 2
bad_case --l2norm-qk dplr --l2norm-qk
bad_case --gate kda --gate uniform
bad_case --gate dplr --gate lowerbound
bad_case --gate dplr --gate rwkv7
bad_case --cu-seqlens kda --cu-seqlens 0,8,4
bad_case --cu-seqlens kda --cu-seqlens 2,8
bad_case --cu-seqlens kda --cu-seqlens 0,8 --B 2
bad_case --cu-seqlens kda --cu-seqlens 0,8 --T 9
bad_case --cu-seqlens dplr --cu-seqlens 0,8,x
bad_case --recompute kda --recompute sometimes
bad_case --g-dist kda --g-dist uniform
bad_case --g-dist dplr --g-dist=nosuch
bad_case "unknown flag '--chunk'" kda --chunk 32
bad_case --quiet kda --quiet=1
bad_case "'extra'" kda extra
bad_case --bogus kda --bogus
bad_case --T kda --T
bad_case "unknown op" nosuch
bad_case "kda or dplr"
out=$("$dg" gradcheck --help)
if [ $? -eq 0 ] && echo "$out" | grep -q "CPU only" && echo "$out" | grep -q -- "--stage"; then
    ok "--help exits 0 and says CPU only"
else
    notok "--help"
fi
out=$("$dg" help gradcheck)
if [ $? -eq 0 ] && [ "$out" = "$("$dg" gradcheck --help)" ]; then
    ok "help gradcheck prints the text of gradcheck --help"
else
    notok "help gradcheck"
fi
out=$("$dg" gradcheck kda --version)
if [ $? -eq 0 ] && [ "$out" = "$("$dg" version)" ]; then
    ok "gradcheck kda --version prints what deltagrad version prints"
else
    notok "gradcheck kda --version: $out"
fi
exit $fail

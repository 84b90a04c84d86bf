#!/usr/bin/env bash
# tests/scripts/cli_conventions.sh DELTAGRAD WORKDIR -- the conventions every `deltagrad` command
# shares (tools/cli.c): --version prints what `deltagrad version` prints, `deltagrad help CMD`
# prints what `deltagrad CMD --help` prints, --flag=value means --flag value, and an unknown
# flag, an abbreviation, a missing value, a value given to a switch and a stray argument exit 2
# with a message naming the flag.
set -u
dg=$1
work=$2
fail=0
ok() { echo "OK     $1"; }
notok() { echo "NOT OK $1"; fail=1; }
rm -rf "$work"
mkdir -p "$work"

version=$("$dg" version)
[ $? -eq 0 ] && [ -n "$version" ] || notok "deltagrad version"
cmds=("train" "sample" "info" "kda" "dplr" "bench" "bench core" "bench kda" "bench dplr"
      "bench cp" "explain" "gradcheck" "gradcheck kda" "gradcheck dplr" "version")

echo "-- --version and help CMD, every command"
for c in "${cmds[@]}"; do
    # shellcheck disable=SC2086
    out=$("$dg" $c --version 2>&1)
    if [ $? -eq 0 ] && [ "$out" = "$version" ]; then
        ok "$c --version"
    else
        notok "$c --version: $out"
    fi
    # shellcheck disable=SC2086
    h1=$("$dg" $c --help 2>&1)
    r1=$?
    # shellcheck disable=SC2086
    h2=$("$dg" help $c 2>&1)
    r2=$?
    # shellcheck disable=SC2086
    h3=$("$dg" $c -h 2>&1)
    if [ $r1 -eq 0 ] && [ $r2 -eq 0 ] && [ "$h1" = "$h2" ] && [ "$h1" = "$h3" ] &&
        echo "$h1" | grep -q 'usage'; then
        ok "help $c = $c --help = $c -h"
    else
        notok "help $c (exit $r1 / $r2)"
    fi
done
out=$("$dg" --version)
[ "$out" = "$version" ] && ok "deltagrad --version" || notok "deltagrad --version: $out"
out=$("$dg" help)
if [ $? -eq 0 ] && echo "$out" | grep -q '^  gradcheck ' && echo "$out" | grep -q '^  info '; then
    ok "help lists the commands"
else
    notok "help: $out"
fi

# A usage error: exit 2 and every given pattern on stderr.
bad() {
    local what=$1
    shift
    local pats=()
    while [ "$1" != "--" ]; do
        pats+=("$1")
        shift
    done
    shift
    local err rc
    err=$("$dg" "$@" 2>&1 >/dev/null)
    rc=$?
    local miss=""
    for p in "${pats[@]}"; do
        echo "$err" | grep -qF -- "$p" || miss="$miss '$p'"
    done
    if [ $rc -eq 2 ] && [ -z "$miss" ]; then
        ok "$what: exit 2: $(echo "$err" | head -1)"
    else
        notok "$what: $* -> exit $rc, missing$miss: $err"
    fi
}
echo "-- usage errors"
bad "deltagrad alone" "usage" --
bad "unknown command" "unknown command 'nosuch'" -- nosuch
bad "help of an unknown command" "unknown command 'nosuch'" -- help nosuch
for c in train sample info kda dplr explain "bench core" "bench kda" "bench dplr" "bench cp" \
    "gradcheck kda"; do
    # shellcheck disable=SC2086
    bad "$c unknown flag" "unknown flag '--no-such-flag'" "--help lists the flags" -- $c \
        --no-such-flag
    # shellcheck disable=SC2086
    bad "$c unknown flag=value" "unknown flag '--no-such-flag'" -- $c --no-such-flag=3
    # shellcheck disable=SC2086
    bad "$c stray argument" "unexpected argument 'stray'" -- $c stray
done
bad "abbreviation" "unknown flag '--chunk'" "--chunk-size" -- train --chunk 16
bad "abbreviation=value" "unknown flag '--chunk'" "--chunk-size" -- kda --chunk=16
bad "abbreviation of a switch" "unknown flag '--quie'" -- dplr --quie
bad "missing value" "--in: needs a value" -- kda --in
bad "missing value (train)" "--lower-bound: needs a value" -- train --lower-bound
bad "missing value (sample)" "--ckpt: needs a value" -- sample --ckpt
bad "switch given a value" "--quiet takes no value" -- kda --quiet=yes
bad "--help given a value" "--help takes no value" -- sample --help=1
bad "bad value via =" "--chunk-size" "one of 16, 32, 64" "48" -- train --chunk-size=48
bad "bad value via = (kda)" "--lower-bound" "[-5, 0)" -- kda --in . --out . --lower-bound=0
bad "old gate name" "--gate" "lowerbound or kda" -- train --gate lb
bad "gradcheck --policy is gone" "unknown flag '--policy'" -- gradcheck kda --policy cache
bad "bench cp --heads is gone" "unknown flag '--heads'" -- bench cp --heads 2
bad "info without --ckpt" "--ckpt" -- info

echo "-- --flag=value is --flag value"
a=$("$dg" explain --T=8 --chunk-size=4 --K=3 --V=2 --seed=3 --stage=recurrence 2>&1)
ra=$?
b=$("$dg" explain --T 8 --chunk-size 4 --K 3 --V 2 --seed 3 --stage recurrence 2>&1)
rb=$?
if [ $ra -eq 0 ] && [ $rb -eq 0 ] && [ "$a" = "$b" ] && [ -n "$a" ]; then
    ok "explain --T=8 ... = explain --T 8 ..."
else
    notok "explain with = (exit $ra / $rb)"
fi
if "$dg" train --device=cpu --threads=1 --steps=2 --batch=1 --seq-len=32 --d=16 --layers=1 \
    --heads=1 --head-dim=8 --inter=16 --chunk-size=16 --gate=lowerbound --lower-bound=-3 \
    --eval-every=0 --sample-every=-1 --no-plot --max-bytes=5000 --out="$work/run" \
    >"$work/train.log" 2>&1; then
    ok "train with --flag=value everywhere"
else
    notok "train with --flag=value: $(tail -3 "$work/train.log")"
fi
a=$("$dg" sample --ckpt="$work/run" --prompt="And God" --tokens=20 --seed=5 --temperature=0.5 --escape)
ra=$?
b=$("$dg" sample --ckpt "$work/run" --prompt "And God" --tokens 20 --seed 5 --temperature 0.5 --escape)
rb=$?
if [ $ra -eq 0 ] && [ $rb -eq 0 ] && [ "$a" = "$b" ] && [ ${#a} -ge 20 ]; then
    ok "sample --ckpt=... = sample --ckpt ..."
else
    notok "sample with = (exit $ra / $rb): '$a' / '$b'"
fi
out=$("$dg" info --ckpt "$work/run")
if [ $? -eq 0 ] && echo "$out" | grep -q '"model_type": "kda"' &&
    echo "$out" | grep -q '"lower_bound": -3' && echo "$out" | grep -q '"safe_gate": true' &&
    echo "$out" | grep -q '"expand_v": 1' && echo "$out" | grep -q '"hidden_size": 16'; then
    ok "info prints the config.json block"
else
    notok "info: $out"
fi
meta=$("$dg" info --ckpt "$work/run" --all)
dp=$(echo "$meta" | sed -n 's/^data\.path = //p')
if [ -n "$dp" ] && [ "${dp#/}" = "$dp" ] && [ -f "$work/run/$dp" ]; then
    ok "data.path '$dp' is relative to the run directory and names the text"
else
    notok "data.path '$dp'"
fi
if echo "$meta" | grep -v '^checksums' | grep -q ' = /'; then
    notok "an absolute path in the metadata: $(echo "$meta" | grep ' = /')"
else
    ok "no absolute path in the metadata"
fi
exit $fail

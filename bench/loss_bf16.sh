#!/usr/bin/env bash
# bench/loss_bf16.sh -- bf16 end-to-end accuracy: the loss curve of the `cpu` config trained in
# bf16 on a GPU against the same run in f32 on the CPU (same seed, same steps), with the GPU's
# own f32 run as the yardstick (the difference that f32 on another device, in another reduction
# order, already makes).
#
#   bash bench/loss_bf16.sh cpu-run DIR        f32 on the CPU          -> DIR/cpu_f32/
#   bash bench/loss_bf16.sh gpu-run DIR        bf16 and f32 on CUDA   -> DIR/gpu_bf16/, gpu_f32/
#   bash bench/loss_bf16.sh compare CPU_F32 GPU_BF16 GPU_F32 OUT.png
#
# compare takes run directories or their log.csv files, prints each run's final train and
# validation loss and the largest and mean absolute difference of the train-loss curves (each
# smoothed by a trailing moving average over DG_MA steps, default 10) of GPU bf16 vs CPU f32 and
# GPU f32 vs CPU f32, writes the smoothed curves to OUT.dat and draws them with gnuplot to OUT.png.
#
# The binary: $DG if set, else the first of build-cpu/, build/, build-cuda/ (cpu-run) or
# build-cuda/, build/ (gpu-run) that holds deltagrad; gpu-run builds the cuda preset's
# deltagrad_cli target when none does. Steps and seed: DG_STEPS (300), DG_SEED (1). Each run's
# stdout is DIR/<run>/train.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

steps=${DG_STEPS:-300}
seed=${DG_SEED:-1}

usage() {
    echo "usage:" >&2
    sed -n '7,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

find_dg() { # candidates... -> prints the first that exists and runs
    if [ -n "${DG:-}" ]; then
        [ -x "$DG" ] || { echo "loss_bf16: DG='$DG' is not an executable" >&2; return 1; }
        echo "$DG"
        return 0
    fi
    for b in "$@"; do
        if [ -x "$b/deltagrad" ]; then
            echo "$b/deltagrad"
            return 0
        fi
    done
    return 1
}

one_run() { # dg device dtype dir
    local dg=$1 dev=$2 dt=$3 dir=$4
    mkdir -p "$dir" || exit 1
    echo "train --config cpu --device $dev --dtype $dt --steps $steps --seed $seed --out $dir"
    local t0 t1 rc
    t0=$(date +%s.%N)
    "$dg" train --config cpu --device "$dev" --dtype "$dt" --steps "$steps" --seed "$seed" \
        --out "$dir" --overwrite > "$dir/train.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    if [ $rc -ne 0 ]; then
        echo "loss_bf16: the $dev $dt run failed (exit $rc); the end of $dir/train.log:" >&2
        tail -20 "$dir/train.log" >&2
        exit 1
    fi
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "  done in %.1f s wall\n", b - a }'
    grep -E "^done|done:" "$dir/train.log" | tail -1 | sed 's/^/  /'
}

mode=${1:-}
case "$mode" in
cpu-run)
    [ $# -eq 2 ] || usage
    dg=$(find_dg build-cpu build build-cuda) \
        || { echo "loss_bf16: no deltagrad binary: build one (cmake --preset cpu &&" \
                  "cmake --build build-cpu -j) or set DG" >&2; exit 1; }
    one_run "$dg" cpu f32 "$2/cpu_f32"
    ;;
gpu-run)
    [ $# -eq 2 ] || usage
    if ! dg=$(find_dg build-cuda build); then
        [ -z "${DG:-}" ] || exit 1
        export PATH=/usr/local/cuda/bin:$PATH
        mkdir -p "$2" || exit 1
        echo "building the cuda preset (log: $2/build.log)"
        { cmake --preset cuda \
              && cmake --build --preset cuda -j "$(nproc)" --target deltagrad_cli; } \
            > "$2/build.log" 2>&1 || { tail -40 "$2/build.log" >&2; exit 1; }
        dg=build-cuda/deltagrad
    fi
    one_run "$dg" cuda bf16 "$2/gpu_bf16"
    one_run "$dg" cuda f32 "$2/gpu_f32"
    ;;
compare)
    [ $# -eq 5 ] || usage
    command -v python3 > /dev/null || { echo "loss_bf16: compare needs python3" >&2; exit 1; }
    python3 - "${DG_MA:-10}" "$2" "$3" "$4" "$5" <<'PY'
import csv, os, shutil, subprocess, sys, tempfile

ma_n = int(sys.argv[1])
names = ["CPU f32", "GPU bf16", "GPU f32"]
paths = []
for name, p in zip(names, sys.argv[2:5]):
    if os.path.isdir(p):
        p = os.path.join(p, "log.csv")
    if not os.path.isfile(p):
        sys.exit(f"loss_bf16: compare: the {name} log '{p}' is missing "
                 f"(run `bash bench/loss_bf16.sh {'cpu' if name == 'CPU f32' else 'gpu'}-run DIR` "
                 "first)")
    paths.append(p)
png = sys.argv[5]

def load(name, path):
    train, val = {}, {}
    with open(path, newline="") as f:
        rows = csv.reader(f)
        head = next(rows, None)
        if not head or head[:3] != ["step", "train_loss", "val_loss"]:
            sys.exit(f"loss_bf16: compare: '{path}' ({name}) does not start with the log.csv "
                     "header step,train_loss,val_loss,...")
        for r in rows:
            if len(r) < 3:
                continue
            s = int(r[0])
            train[s] = float(r[1])
            if r[2]:
                val[s] = float(r[2])
    if not train:
        sys.exit(f"loss_bf16: compare: '{path}' ({name}) has no steps")
    return train, val

runs = [load(n, p) for n, p in zip(names, paths)]
steps = sorted(set.intersection(*(set(t) for t, _ in runs)))
if not steps:
    sys.exit("loss_bf16: compare: the three logs have no step in common")
for (t, _), n in zip(runs, names):
    if len(t) != len(steps):
        print(f"note: {n} has {len(t)} steps, {len(steps)} in common with the others; "
              "the curves are compared on the common ones")

def smooth(t):  # trailing moving average over ma_n steps (fewer at the start)
    out, win = [], []
    for s in steps:
        win.append(t[s])
        if len(win) > ma_n:
            win.pop(0)
        out.append(sum(win) / len(win))
    return out

ma = [smooth(t) for t, _ in runs]

print(f"steps compared: {steps[0]}..{steps[-1]} ({len(steps)}); moving average over {ma_n} steps")
print(f"{'run':10s} {'train@' + str(steps[-1]):>10s} {'MA':>7s} {'last val':>15s}  log")
for (t, v), m, n, p in zip(runs, ma, names, paths):
    vs = f"{v[max(v)]:.4f}@{max(v)}" if v else "-"
    print(f"{n:10s} {t[steps[-1]]:10.4f} {m[-1]:7.4f} {vs:>15s}  {p}")

def diff(i, j, label):
    d = [abs(a - b) for a, b in zip(ma[i], ma[j])]
    k = max(range(len(d)), key=d.__getitem__)
    raw = [abs(runs[i][0][s] - runs[j][0][s]) for s in steps]
    vs = sorted(set(runs[i][1]) & set(runs[j][1]))
    vd = max((abs(runs[i][1][s] - runs[j][1][s]) for s in vs), default=None)
    vtxt = f", val max {vd:.4f} over {len(vs)} evals" if vd is not None else ""
    print(f"{label:22s} MA: max {d[k]:.4f} (step {steps[k]}), mean {sum(d) / len(d):.4f};"
          f" per step: max {max(raw):.4f}, mean {sum(raw) / len(raw):.4f}{vtxt}")
    return max(d), sum(d) / len(d)

print("|train loss difference|")
b_max, b_mean = diff(1, 0, "GPU bf16 vs CPU f32")
f_max, f_mean = diff(2, 0, "GPU f32 vs CPU f32")
if f_mean > 0:
    print(f"bf16 / f32 yardstick: max {b_max / f_max:.2f}x, mean {b_mean / f_mean:.2f}x")
else:
    print("bf16 / f32 yardstick: the GPU f32 curve equals the CPU one (no ratio)")

base = png[:-4] if png.endswith(".png") else png
dat = base + ".dat"
if os.path.dirname(dat):
    os.makedirs(os.path.dirname(dat), exist_ok=True)
with open(dat, "w") as f:
    f.write(f"# step, train loss moving average over {ma_n} steps: CPU f32, GPU bf16, GPU f32;"
            " then val loss (empty when not evaluated): CPU f32, GPU bf16, GPU f32\n")
    for k, s in enumerate(steps):
        vals = [f"{runs[i][1][s]:.6f}" if s in runs[i][1] else "" for i in range(3)]
        f.write(f"{s},{ma[0][k]:.6f},{ma[1][k]:.6f},{ma[2][k]:.6f},{','.join(vals)}\n")
print(f"curves: {dat}")

if not shutil.which("gnuplot"):
    sys.exit(f"loss_bf16: gnuplot is not installed (not on PATH): {png} not drawn; {dat} has "
             "the curves (apt-get install gnuplot-nox)")
gp = f"""
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {{
    set terminal pngcairo size 1000,800
}} else {{
    set terminal png size 1000,800
}}
set output '{png}'
set datafile separator ','
set datafile missing ''
set multiplot layout 2,1
set grid
set key top right
set title 'deltagrad, config cpu: train loss ({ma_n}-step moving average), val loss (points)'
set ylabel 'loss (nats/byte), log scale'
set logscale y
set autoscale yfix
set ytics (1, 1.2, 1.4, 1.6, 1.8, 2, 2.5, 3, 4, 5, 6, 8)
plot '{dat}' using 1:2 with lines lw 2 lc rgb '#333333' title 'CPU f32', \\
     '{dat}' using 1:3 with lines lw 1.5 lc rgb '#d94a4a' title 'GPU bf16', \\
     '{dat}' using 1:4 with lines lw 1.5 dt 2 lc rgb '#4a90d9' title 'GPU f32', \\
     '{dat}' using 1:5 with points pt 7 ps 1.0 lc rgb '#333333' notitle, \\
     '{dat}' using 1:6 with points pt 6 ps 1.4 lc rgb '#d94a4a' notitle, \\
     '{dat}' using 1:7 with points pt 4 ps 1.4 lc rgb '#4a90d9' notitle
unset logscale y
set autoscale y
set ytics autofreq
set title 'difference of the smoothed train loss from CPU f32'
set xlabel 'step'
set ylabel 'loss - CPU f32 loss'
plot '{dat}' using 1:($3-$2) with lines lw 1.5 lc rgb '#d94a4a' title 'GPU bf16', \\
     '{dat}' using 1:($4-$2) with lines lw 1.5 dt 2 lc rgb '#4a90d9' title 'GPU f32', \\
     0 with lines lc rgb '#999999' notitle
unset multiplot
"""
with tempfile.NamedTemporaryFile("w", suffix=".gp", delete=False) as f:
    f.write(gp)
    gpf = f.name
r = subprocess.run(["gnuplot", gpf], capture_output=True, text=True)
os.unlink(gpf)
if r.returncode != 0:
    sys.exit(f"loss_bf16: gnuplot failed (exit {r.returncode}) drawing {png}:\n{r.stderr}")
print(f"plot: {png}")
PY
    ;;
*)
    usage
    ;;
esac

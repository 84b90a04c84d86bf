#!/usr/bin/env bash
# bench/gpu_prof.sh -- per-kernel profiles of one KDA fwd+bwd on a GPU machine: build (cuda
# preset), then for each kernel name given (a regex each) one `ncu --set full` launch at the
# first reference shape, its headline metrics and its instruction / stall table
# (bench/ncu_sass.py). The tables go to $OUT/prof.txt (or ./out), their heads are printed last.
#   bench/gpu_prof.sh wy_cols_mma intra_main_mma ...
#   DG_PROF_SHAPE=1,8192,96,128   the shape; DG_PROF_SKIP=N skips N matching launches first
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
{ cmake --preset cuda && cmake --build --preset cuda -j 16 --target deltagrad_cli; } \
    > "$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -20; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
shape=${DG_PROF_SHAPE:-1,8192,96,128}
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics+=",launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem"
metrics+=",smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active"
metrics+=",dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum"
work=/tmp/dg_prof
mkdir -p "$work"
for k in "$@"; do
    rep="$work/$k"
    ncu --set full -k "regex:$k" -c 1 --launch-skip "${DG_PROF_SKIP:-0}" --import-source no \
        -o "$rep" ./build-cuda/deltagrad bench kda --shape "$shape" --reps 1 > "$rep.log" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>/dev/null
    {
        echo "=== $k"
        ncu -i "$rep.ncu-rep" --page raw --csv --metrics "$metrics" 2>/dev/null |
            python3 -c 'import csv,sys
r=list(csv.reader(sys.stdin))
if len(r)>=3:
    for n,u,v in zip(r[0],r[1],r[2]):
        if "__" in n or n=="Kernel Name": print(f"  {n:60s} {v} {u}")'
        ncu -i "$rep.ncu-rep" --page details --section WarpStateStats --section MemoryWorkloadAnalysis_Tables 2>/dev/null | grep -vE "^ *-+ *$" | head -60
        python3 bench/ncu_sass.py "$rep.sass.csv" --top 10
    } > "$rep.txt" 2>&1
    rm -f "$rep.sass.csv"
done
for k in "$@"; do cat "$work/$k.txt"; done > "$out/prof.txt"
for k in "$@"; do head -18 "$work/$k.txt"; done

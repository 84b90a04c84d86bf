#!/usr/bin/env python3
"""Summarise `ncu --csv --metrics gpu__time_duration.sum` output: total time, count and mean per
kernel name, largest first.

Usage: python3 bench/ncu_kernels.py ncu.csv [top] [--train-step]

--train-step: only the kernels of one training step, the second one profiled (from the second
launch of the embedding forward kernel to the third), so start-up work and the first step's
one-time costs are left out. Profile at least three steps with --graph off."""
import csv
import sys
from collections import defaultdict

args = [a for a in sys.argv[1:] if not a.startswith('--')]
one_step = '--train-step' in sys.argv
with open(args[0]) as f:
    lines = [l for l in f if l.startswith('"')]
rows = [r for r in csv.DictReader(lines) if r.get('Metric Name') == 'gpu__time_duration.sum']
if one_step:
    starts = [i for i, r in enumerate(rows) if r['Kernel Name'].startswith('void embedding_fwd')]
    if len(starts) < 3:
        sys.exit("--train-step: fewer than three embedding forward launches in the profile")
    rows = rows[starts[1]:starts[2]]
tot = defaultdict(float)
cnt = defaultdict(int)
for r in rows:
    name = r['Kernel Name'].split('(')[0]
    tot[name] += float(r['Metric Value'].replace(',', '')) / 1e6  # ns -> ms
    cnt[name] += 1
top = int(args[1]) if len(args) > 1 else 40
all_ms = sum(tot.values())
print(f"{'kernel':60s} {'calls':>6s} {'total ms':>9s} {'mean ms':>8s} {'share':>6s}")
for k in sorted(tot, key=tot.get, reverse=True)[:top]:
    print(f"{k[:60]:60s} {cnt[k]:6d} {tot[k]:9.3f} {tot[k]/cnt[k]:8.3f} {100*tot[k]/all_ms:5.1f}%")
print(f"{'all kernels':60s} {sum(cnt.values()):6d} {all_ms:9.3f}")

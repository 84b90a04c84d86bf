#!/usr/bin/env python3
"""Summarise `ncu --csv --metrics gpu__time_duration.sum` output: total time, count and mean per
kernel name, largest first. Usage: python3 bench/ncu_kernels.py ncu.csv [top]"""
import csv
import sys
from collections import defaultdict

rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
tot = defaultdict(float)
cnt = defaultdict(int)
for r in csv.DictReader(lines):
    if r.get('Metric Name') != 'gpu__time_duration.sum':
        continue
    name = r['Kernel Name'].split('(')[0]
    tot[name] += float(r['Metric Value'].replace(',', '')) / 1e6  # ns -> ms
    cnt[name] += 1
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
all_ms = sum(tot.values())
print(f"{'kernel':60s} {'calls':>6s} {'total ms':>9s} {'mean ms':>8s} {'share':>6s}")
for k in sorted(tot, key=tot.get, reverse=True)[:top]:
    print(f"{k[:60]:60s} {cnt[k]:6d} {tot[k]:9.3f} {tot[k]/cnt[k]:8.3f} {100*tot[k]/all_ms:5.1f}%")
print(f"{'all kernels':60s} {sum(cnt.values()):6d} {all_ms:9.3f}")

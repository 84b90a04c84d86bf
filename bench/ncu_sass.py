#!/usr/bin/env python3
"""Where one kernel's instructions and stalls go, from Nsight Compute's per-instruction SASS
table: the opcode mix (share of executed warp instructions and of stall samples), the hottest
straight-line segments (runs of consecutive instructions executed the same number of times,
roughly the basic blocks, with how often each warp ran them), and the instructions that collect
the most stall samples with the instructions just before them (a stall is charged to the
instruction that waits, so its producer is usually one of those).

Usage:
    ncu --set full -k regex:NAME -c 1 --import-source no -o rep ./build-cuda/deltagrad ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 bench/ncu_sass.py sass.csv [--top N]

"Per warp" divides by the execution count of the kernel's first instruction, which every warp
runs once."""
import csv
import sys
from collections import Counter


def opcode(src):
    words = src.split()
    if not words:
        return ''
    op = words[1] if words[0].startswith('@') and len(words) > 1 else words[0]
    return op.split('.')[0]


def main():
    args = sys.argv[1:]
    top = 12
    if '--top' in args:
        i = args.index('--top')
        top = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    with open(args[0], newline='') as f:
        rows = list(csv.reader(f))
    # the first line names the kernel, the second is the header
    head = next((i for i, r in enumerate(rows) if 'Source' in r and 'Address' in r), None)
    if head is None:
        sys.exit('%s: no per-instruction table (expected ncu --page source --csv)' % args[0])
    hdr = rows[head]
    c_src = hdr.index('Source')
    c_exe = hdr.index('Instructions Executed')
    c_stl = hdr.index('Warp Stall Sampling (All Samples)')
    code = [(r[c_src].strip(), int(r[c_exe].replace(',', '') or 0),
             int(r[c_stl].replace(',', '') or 0)) for r in rows[head + 1:] if len(r) > c_stl]
    if not code:
        sys.exit('%s: the table is empty' % args[0])
    kernel = ' '.join(rows[0][1:2])[:100] if head > 0 else ''
    n_exe = sum(e for _, e, _ in code) or 1
    n_stl = sum(s for _, _, s in code) or 1
    warps = code[0][1] or 1
    print('%s\n%d SASS instructions, %d warp instructions executed (%.0f per warp), %d stall '
          'samples' % (kernel, len(code), n_exe, n_exe / warps, n_stl))

    exe, stl = Counter(), Counter()
    for src, e, s in code:
        exe[opcode(src)] += e
        stl[opcode(src)] += s
    print('\nopcode: share of executed / of stall samples')
    print('  ' + '  '.join('%s %.1f%%/%.1f%%' % (o, 100 * c / n_exe, 100 * stl[o] / n_stl)
                           for o, c in exe.most_common(top)))

    segs = []  # [first, last, executions, stall samples]
    for i, (_, e, s) in enumerate(code):
        if segs and segs[-1][2] == e and segs[-1][1] == i - 1:
            segs[-1][1] = i
            segs[-1][3] += s
        else:
            segs.append([i, i, e, s])
    segs.sort(key=lambda g: -(g[1] - g[0] + 1) * g[2])
    print('\nhottest segments: instructions, runs per warp, share of executed / of stalls, first '
          'instruction')
    for a, b, e, s in segs[:top]:
        n = b - a + 1
        print('  %5d-%-5d %4d  x%-7.2f %5.1f%% %5.1f%%  %s' %
              (a, b, n, e / warps, 100 * n * e / n_exe, 100 * s / n_stl, code[a][0][:60]))

    print('\nmost stalled instructions (and the two before them)')
    for i in sorted(range(len(code)), key=lambda k: -code[k][2])[:top]:
        print('  %5d %5.1f%%  %s' % (i, 100 * code[i][2] / n_stl, code[i][0][:70]))
        for j in range(max(0, i - 2), i):
            print('  %5d         %s' % (j, code[j][0][:70]))


if __name__ == '__main__':
    main()

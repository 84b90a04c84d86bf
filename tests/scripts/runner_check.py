"""What the op runner checks (kda_runner_check.py, dplr_runner_check.py) share: the arguments,
the skip rules, rounding inputs to the compute dtype, running `deltagrad <op>` chunked and
recurrent, and comparing arrays and the two runs.

Skips (exit 77, which ctest reports as skipped): NumPy missing (on import), or --device cuda
where `deltagrad version` reports "CUDA devices: 0".
"""
import argparse
import os
import re
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: python3-numpy is not installed")
    sys.exit(77)

SKIP = 77


def cuda_devices(exe):
    """The device count `deltagrad version` reports (0 when it says nothing about it)."""
    out = subprocess.run([exe, "version"], check=True, capture_output=True, text=True).stdout
    m = re.search(r"CUDA devices:\s*(\d+)", out)
    return int(m.group(1)) if m else 0


def parse_args(dtypes_cpu=("f64",), dtypes_cuda=("f32",)):
    """exe, work, device, dtypes; --dtype may be given several times (default: dtypes_cpu or
    dtypes_cuda by device). Exits 77 for --device cuda without a device."""
    ap = argparse.ArgumentParser()
    ap.add_argument("exe")
    ap.add_argument("work")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", action="append", choices=("f64", "f32", "bf16"))
    args = ap.parse_args()
    dtypes = args.dtype or list(dtypes_cpu if args.device == "cpu" else dtypes_cuda)
    if args.device == "cuda" and cuda_devices(args.exe) == 0:
        print("SKIPPED: `deltagrad version` reports no CUDA device")
        sys.exit(SKIP)
    return args.exe, args.work, args.device, dtypes


def to_f32(a):
    return np.asarray(a).astype(np.float32).astype(np.float64)


def to_bf16(a):
    """Round to nearest even bf16, as the CLI's conversion does; returned as float64."""
    u = np.asarray(a).astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def rounder(dtype):
    """The rounding the CLI applies to an input converted to `dtype` (identity for f64)."""
    return {"f64": lambda a: np.asarray(a, dtype=np.float64), "f32": to_f32,
            "bf16": to_bf16}[dtype]


def save_inputs(folder, arrays):
    os.makedirs(folder, exist_ok=True)
    for name, arr in arrays.items():
        np.save(os.path.join(folder, name + ".npy"), arr)


def run_cli(exe, op, ind, outd, device, dtype, extra=()):
    """Run `deltagrad <op>` on ind into outd; returns (exit code, stderr). stderr is echoed."""
    cmd = [exe, op, "--in", ind, "--out", outd, "--device", device, "--dtype", dtype] + list(extra)
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(p.stdout)
    sys.stdout.write(p.stderr)
    sys.stdout.flush()
    return p.returncode, p.stderr


def load_outputs(outd, names):
    return {n: np.load(os.path.join(outd, n + ".npy")).astype(np.float64) for n in names}


class Checker:
    """Relative max-abs comparisons, one line each; .ok is False after any failure."""

    def __init__(self):
        self.ok = True

    def rel(self, name, a, b, tol):
        err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))
        self.line(name, err, tol)

    def line(self, name, err, tol):
        good = bool(np.isfinite(err) and err <= tol)
        self.ok &= good
        print(f"  {'OK' if good else 'NOT OK':6s} {name:46s} rel err {err:.3e} (tol {tol:.0e})")

    def cond(self, name, good):
        self.ok &= bool(good)
        print(f"  {'OK' if good else 'NOT OK':6s} {name}")


def run_both(exe, op, ind, work, device, dtype, grads, after=None):
    """`deltagrad <op>` chunked and recurrent on ind (--chunk-size 16), and off f64 the chunked
    f64 CPU run that is the gradient reference: {"<mode>-<device>-<dtype>": outputs (o, ht and
    grads)}, or None after printing why. after(tag, device, outd) runs after each run."""
    runs = [("chunk", device, dtype), ("recurrent", device, dtype)]
    if dtype != "f64":
        runs.append(("chunk", "cpu", "f64"))  # the gradient reference
    outs = {}
    for mode, dev, dt in runs:
        tag = f"{mode}-{dev}-{dt}"
        od = os.path.join(work, tag)
        rc, _ = run_cli(exe, op, ind, od, dev, dt, ["--chunk-size", "16"]
                        + (["--recurrent"] if mode == "recurrent" else []))
        if rc != 0:
            print(f"== {op} runner {dtype}: NOT OK (`deltagrad {op}` exited {rc})")
            return None
        outs[tag] = load_outputs(od, ("o", "ht") + tuple(grads))
        if after:
            after(tag, dev, od)
    return outs


def compare_both(c, outs, device, dtype, o_ref, ht_ref, grads, tol):
    """o and ht of both runs against the NumPy recurrence; the gradients of the chunked and the
    recurrent run against each other in f64, else each against the f64 CPU run."""
    ch, re_ = outs[f"chunk-{device}-{dtype}"], outs[f"recurrent-{device}-{dtype}"]
    c.rel("o: chunked cli vs numpy recurrence", ch["o"], o_ref, tol)
    c.rel("ht: chunked cli vs numpy recurrence", ch["ht"], ht_ref, tol)
    c.rel("o: recurrent cli vs numpy recurrence", re_["o"], o_ref, tol)
    c.rel("ht: recurrent cli vs numpy recurrence", re_["ht"], ht_ref, tol)
    if dtype == "f64":
        for n in grads:
            c.rel(f"{n}: chunked vs recurrent cli", ch[n], re_[n], tol)
    else:
        ref = outs["chunk-cpu-f64"]
        for n in grads:
            c.rel(f"{n}: chunked {device} {dtype} vs cpu f64", ch[n], ref[n], tol)
            c.rel(f"{n}: recurrent {device} {dtype} vs cpu f64", re_[n], ref[n], tol)

#!/usr/bin/env python3
"""Check `deltagrad kda` against an independent NumPy recurrence on random tensors.

usage: kda_runner_check.py DELTAGRAD_BINARY WORKDIR [--device cpu|cuda]

Writes random q k v g beta h0 cu_seqlens do dht (.npy) to WORKDIR/in, runs the chunked op and the
recurrent op through the CLI, and compares o, ht and the gradients with each other and o/ht with
a float64 NumPy recurrence written here from the spec (KDA.md section 2). Exit 0 on success,
77 when NumPy is missing (ctest reports it as skipped), 1 on a mismatch.
"""
import os
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: python3-numpy is not installed")
    sys.exit(77)


def naive(q, k, v, g, beta, scale, h0, cu):
    """o, ht for packed sequences (B = 1) per KDA.md section 2; q, k already unit rows."""
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    G = HV // H
    o = np.zeros((1, T, HV, V))
    ht = np.zeros((len(cu) - 1, HV, K, V))
    for n in range(len(cu) - 1):
        for hv in range(HV):
            S = h0[n, hv].copy()
            for t in range(cu[n], cu[n + 1]):
                kt, qt = k[0, t, hv // G], q[0, t, hv // G]
                S = np.exp(g[0, t, hv])[:, None] * S
                e = beta[0, t, hv] * (v[0, t, hv] - S.T @ kt)
                S = S + np.outer(kt, e)
                o[0, t, hv] = scale * (S.T @ qt)
            ht[n, hv] = S
    return o, ht


def main():
    exe, work = sys.argv[1], sys.argv[2]
    device = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--device" else "cpu"
    rng = np.random.default_rng(20261122)
    H, HV, K, V = 2, 4, 16, 8
    cu = np.array([0, 37, 101, 150], dtype=np.int64)  # three sequences of odd lengths
    T = int(cu[-1])
    q = rng.standard_normal((1, T, H, K))
    k = rng.standard_normal((1, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, T, HV, V))
    g = -rng.uniform(0.01, 0.5, (1, T, HV, K))
    beta = rng.uniform(0.1, 0.9, (1, T, HV))
    h0 = rng.standard_normal((len(cu) - 1, HV, K, V)) * 0.5
    do = rng.standard_normal((1, T, HV, V))
    dht = rng.standard_normal(h0.shape)
    ind = os.path.join(work, "in")
    os.makedirs(ind, exist_ok=True)
    for name, arr in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu_seqlens=cu, do=do,
                          dht=dht).items():
        np.save(os.path.join(ind, name + ".npy"), arr)

    dtype = "f64" if device == "cpu" else "f32"
    outs = {}
    for mode in ("chunk", "recurrent"):
        od = os.path.join(work, mode)
        cmd = [exe, "kda", "--in", ind, "--out", od, "--device", device, "--dtype", dtype,
               "--chunk-size", "16"] + (["--recurrent"] if mode == "recurrent" else [])
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        outs[mode] = {n: np.load(os.path.join(od, n + ".npy"))
                      for n in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")}

    o_ref, ht_ref = naive(q, k, v, g, beta, K ** -0.5, h0, cu)
    # f64 on the CPU agrees to rounding; f32 on CUDA to f32 accumulation error.
    tol = 1e-10 if dtype == "f64" else 1e-5
    ok = True

    def check(name, a, b):
        nonlocal ok
        err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))
        good = np.isfinite(err) and err <= tol
        ok &= good
        print(f"  {'OK' if good else 'NOT OK':6s} {name:36s} rel err {err:.3e} (tol {tol:.0e})")

    check("o: chunked cli vs numpy recurrence", outs["chunk"]["o"], o_ref)
    check("ht: chunked cli vs numpy recurrence", outs["chunk"]["ht"], ht_ref)
    check("o: recurrent cli vs numpy recurrence", outs["recurrent"]["o"], o_ref)
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        check(f"{n}: chunked vs recurrent cli", outs["chunk"][n], outs["recurrent"][n])
    print("== kda runner:", "overall okay" if ok else "NOT OK")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

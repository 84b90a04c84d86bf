#!/usr/bin/env python3
"""Check `deltagrad dplr` against an independent NumPy recurrence on random tensors.

usage: dplr_runner_check.py DELTAGRAD_BINARY WORKDIR [--device cpu|cuda] [--dtype f64|f32|bf16]...

For each --dtype (default f64 and f32 on cpu, f32 on cuda): writes random q k v a b gk h0
cu_seqlens do dht (.npy) to WORKDIR/<dtype>/in in RWKV-7's form, which keeps the recurrence
stable (a = -kh, b = alpha * kh with kh of unit norm and alpha in (0, 1); gk = -e^-1/2 sigmoid(x),
RWKV-7's decay), runs the chunked op and the recurrent op through the CLI, and compares o and ht
with a float64 NumPy recurrence written here from docs/dplr.md D1.
Gradients: in f64 the chunked and recurrent CLI runs must agree to rounding, and the chunked ones
must match central differences of the NumPy recurrence along one random direction per input (so
the backward is held to the recurrence, not only to itself); in f32/bf16 each run is compared with
an f64 CPU run of the CLI on the same files. On the CPU it also checks that OUT holds exactly the
files `--help` promises, and that bad inputs (a missing file, a wrong shape, a wrong dtype,
cu_seqlens with B != 1, a do.npy of the wrong shape) exit 1 naming the file and write nothing.

Exit 0 on success, 1 on a mismatch, 77 (ctest: skipped) when NumPy is missing or --device cuda
finds no device. The part shared with kda_runner_check.py is runner_check.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_check import (Checker, compare_both, np, parse_args, rounder,  # noqa: E402
                          run_both, run_cli, save_inputs, to_f32)

GRADS = {"dq": "q", "dk": "k", "dv": "v", "da": "a", "db": "b", "dgk": "gk", "dh0": "h0"}


def naive(x, scale, cu):
    """o, ht for packed sequences (B = 1) per docs/dplr.md D1, per head with S [K,V]:
    S_t = Diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,  o_t = scale S_t^T q_t."""
    q, k, v, a, b, gk, h0 = (x[n] for n in ("q", "k", "v", "a", "b", "gk", "h0"))
    T, H, K = q.shape[1:]
    V = v.shape[3]
    o = np.zeros((1, T, H, V))
    ht = np.zeros((len(cu) - 1, H, K, V))
    for n in range(len(cu) - 1):
        for h in range(H):
            S = h0[n, h].copy()
            for t in range(cu[n], cu[n + 1]):
                p = S.T @ a[0, t, h]  # reads the undecayed previous state
                S = (np.exp(gk[0, t, h])[:, None] * S + np.outer(b[0, t, h], p)
                     + np.outer(k[0, t, h], v[0, t, h]))
                o[0, t, h] = scale * (S.T @ q[0, t, h])
            ht[n, h] = S
    return o, ht


def inputs(rng, cu, H, K, V):
    T, N = int(cu[-1]), len(cu) - 1
    kh = rng.standard_normal((1, T, H, K))
    kh /= np.linalg.norm(kh, axis=-1, keepdims=True)
    alpha = rng.uniform(0.05, 0.95, (1, T, H, K))
    return dict(q=rng.standard_normal((1, T, H, K)),
                k=rng.standard_normal((1, T, H, K)) * K ** -0.5,
                v=rng.standard_normal((1, T, H, V)),
                a=-kh, b=alpha * kh,
                gk=-np.exp(-0.5) / (1 + np.exp(-2 * rng.standard_normal((1, T, H, K)))),
                h0=rng.standard_normal((N, H, K, V)) * 0.5,
                do=rng.standard_normal((1, T, H, V)),
                dht=rng.standard_normal((N, H, K, V)))


def directional(c, x, g, scale, cu, rng):
    """Central differences of L = <o, do> + <ht, dht> of the NumPy recurrence along a random
    direction of each input, against <grad, direction> from the CLI's gradients."""
    def loss(y):
        o, ht = naive(y, scale, cu)
        return float(np.sum(o * x["do"]) + np.sum(ht * x["dht"]))

    eps = 1e-5
    for gname, name in GRADS.items():
        d = rng.standard_normal(x[name].shape)
        lp = loss({**x, name: x[name] + eps * d})
        lm = loss({**x, name: x[name] - eps * d})
        fd, an = (lp - lm) / (2 * eps), float(np.sum(g[gname] * d))
        # central differences: truncation ~eps^2 (relative ~1e-10 here) and cancellation
        # ~1e-16 |L| / eps (~1e-9 of the derivative); measured below 6e-10 on every input
        c.line(f"{gname}: chunked cli vs numpy central diff", abs(fd - an) / abs(an), 1e-7)


def bad_inputs(c, exe, x, cu, work):
    """Refused inputs: exit 1, the message names the file (and the expected shape or dtype),
    nothing written to OUT."""
    def case(what, edit, expect):
        ind, outd = os.path.join(work, "bad", what, "in"), os.path.join(work, "bad", what, "out")
        files = {n: x[n] for n in ("q", "k", "v", "a", "b", "gk", "h0")}
        files["cu_seqlens"] = cu
        files = edit(files)
        save_inputs(ind, files)
        rc, err = run_cli(exe, "dplr", ind, outd, "cpu", "f64", ["--quiet"])
        written = os.listdir(outd) if os.path.isdir(outd) else []
        c.cond(f"{what}: exit 1 ({rc}), message names {expect}, nothing written {written}",
               rc == 1 and all(e in err for e in expect) and not written)

    def drop(f, n):
        f.pop(n)
        return f

    case("missing files", lambda f: drop(drop(f, "gk"), "b"), ["missing", "b.npy", "gk.npy"])
    case("wrong shape", lambda f: {**f, "k": f["k"][..., :-1]}, ["k must be", "[B,T,H,K]"])
    case("wrong h0 shape", lambda f: {**f, "h0": f["h0"][:2]}, ["h0 must be", "[N,H,K,V]"])
    case("float16 q", lambda f: {**f, "q": f["q"].astype(np.float16)}, ["q.npy", "float16"])
    case("float cu_seqlens", lambda f: {**f, "cu_seqlens": f["cu_seqlens"].astype(np.float64)},
         ["cu_seqlens.npy", "integer"])
    case("cu_seqlens with B = 2",
         lambda f: {**{n: np.concatenate([a, a]) for n, a in f.items() if n != "cu_seqlens"},
                    "cu_seqlens": f["cu_seqlens"]}, ["cu_seqlens", "B == 1", "B=2"])
    case("do of the wrong shape", lambda f: {**f, "do": x["do"][:, :, :, :-1]},
         ["do.npy", "the shape of o.npy"])


def check_dtype(exe, work, device, dtype):
    """The whole check in one compute dtype: True when every comparison holds."""
    rng = np.random.default_rng(20261125)
    H, K, V = 2, 16, 8
    cu = np.array([0, 37, 101, 150], dtype=np.int64)  # three sequences of odd lengths
    x = inputs(rng, cu, H, K, V)
    if dtype != "f64":
        # the CLI rounds every input to the compute dtype (h0, dht: f32 on CUDA); give it
        # values it holds exactly, so every side below sees the same inputs
        x = {n: (to_f32 if n in ("h0", "dht") else rounder(dtype))(a) for n, a in x.items()}
    ind = os.path.join(work, "in")
    save_inputs(ind, {**x, "cu_seqlens": cu})

    c = Checker()

    def files(tag, dev, od):
        if dev == "cpu":
            # exactly the files --help promises with do.npy and h0.npy, nothing else
            c.cond(f"{tag}: OUT holds exactly o ht {' '.join(GRADS)}",
                   sorted(os.listdir(od)) == sorted(n + ".npy" for n in ("o", "ht", *GRADS)))

    outs = run_both(exe, "dplr", ind, work, device, dtype, GRADS, files)
    if outs is None:
        return False

    o_ref, ht_ref = naive(x, K ** -0.5, cu)
    # f64 agrees to rounding. f32 (f32 accumulation over at most 16-row chunks, K/V = 16/8 long
    # dot products, state chains of <= 64 tokens; inputs exactly representable): the CPU f32 path
    # stays below 3e-7 on every value here (o, ht and every gradient), so 1e-5 bounds a
    # reordering of the same sums with ~30x headroom. bf16: the output rounding alone is 2^-9 of
    # the largest value.
    tol = {"f64": 1e-10, "f32": 1e-5, "bf16": 1e-2}[dtype]
    compare_both(c, outs, device, dtype, o_ref, ht_ref, GRADS, tol)
    if dtype == "f64":
        directional(c, x, outs[f"chunk-{device}-{dtype}"], K ** -0.5, cu, rng)
        if device == "cpu":
            bad_inputs(c, exe, x, cu, work)
    print(f"== dplr runner {dtype}:", "okay" if c.ok else "NOT OK")
    return c.ok


def main():
    exe, work, device, dtypes = parse_args(dtypes_cpu=("f64", "f32"))
    results = [check_dtype(exe, os.path.join(work, dt), device, dt) for dt in dtypes]
    if False in results:
        print("== dplr runner: NOT OK")
        return 1
    print("== dplr runner: overall okay")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""tools/ckpt_to_torch.py -- load a deltagrad checkpoint into a plain PyTorch re-implementation of
the toy language model (train/model.h, docs/training.md), run a prompt, and compare its logits
for the next byte with `deltagrad sample --print-logits`.

    python3 tools/ckpt_to_torch.py CKPT [--deltagrad BIN] [--prompt TEXT] [--tol X] [--numpy]

CKPT is a checkpoint file or a run directory (its ckpt_latest.safetensors). The safetensors file
is read here (no safetensors package needed); the model config comes from the checkpoint's
metadata. The re-implementation runs in float64, token by token (the KDA or DPLR recurrence, no
chunking), so it shares no code and no algorithm with the C library beyond the equations:

    x = embed[ids]
    per layer:  x += mixer(rmsnorm(x));  x += down(silu(gate(h)) * up(h)),  h = rmsnorm(x)
    logits = rmsnorm(x) @ lm_head^T          (lm_head = embed with --tie)
    mixer: q, k, v = silu(causal depthwise conv(h W)), graw = (h F0^T) F1^T, braw = h B^T
           KDA:  S = Diag(exp(g_t)) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = s S^T q_t
                 with q, k L2-normalised, beta = sigmoid(braw), g the lower-bound or KDA gate
           DPLR: S = Diag(exp(g_t)) S - alpha_t kh_t (kh_t^T S) + kh_t v_t^T;  o_t = s S^T qh_t
           out = o_proj(rmsnorm_V(o) * o_norm * sigmoid(G1 (G0 h) + bias))

The comparison passes when max |logit_deltagrad - logit_here| <= tol * max(1, max |logit_here|)
with tol = 1e-4 by default: deltagrad computes in f32 (a checkpoint's parameters are f32), this
script in f64, and a few layers of f32 rounding stay well below it. Exit codes: 0 the logits
agree, 1 they do not (or deltagrad failed), 2 bad usage, 77 the backend (torch, or numpy with
--numpy) cannot be imported.

--numpy runs the same model written with NumPy only, for machines without PyTorch.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys


def read_safetensors(path):
    """(tensors as float64 numpy arrays by name, metadata dict)."""
    import numpy as np

    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + hlen].decode("utf-8"))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        raw = blob[base + a : base + b]
        shape = tuple(info["shape"])
        dt = info["dtype"]
        if dt == "F64":
            arr = np.frombuffer(raw, dtype="<f8")
        elif dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif dt == "BF16":  # the upper half of an f32
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
            arr = (u16 << 16).view(np.float32)
        elif dt in ("I64", "I32"):
            arr = np.frombuffer(raw, dtype="<i8" if dt == "I64" else "<i4")
        else:
            raise ValueError(f"{path}: tensor {name}: dtype {dt} is not handled")
        out[name] = arr.reshape(shape).astype(np.float64)
    return out, meta


class NumpyOps:
    name = "numpy"

    def __init__(self):
        import numpy as np

        self.np = np

    def tensor(self, a):
        return self.np.array(a, dtype=self.np.float64)

    def zeros(self, *shape):
        return self.np.zeros(shape, dtype=self.np.float64)

    def exp(self, x):
        return self.np.exp(x)

    def sigmoid(self, x):
        return 1.0 / (1.0 + self.np.exp(-x))

    def silu(self, x):
        return x * self.sigmoid(x)

    def softplus(self, x):
        return self.np.logaddexp(0.0, x)

    def rsqrt(self, x):
        return 1.0 / self.np.sqrt(x)

    def sum_last(self, x):
        return x.sum(axis=-1, keepdims=True)

    def mean_last(self, x):
        return x.mean(axis=-1, keepdims=True)

    def outer(self, a, b):
        return self.np.outer(a, b)

    def causal_conv(self, x, w):
        """x [T, C], w [C, 1, W]: y[t, c] = sum_i w[c, 0, i] x[t - W + 1 + i, c]."""
        T, C = x.shape
        W = w.shape[2]
        xp = self.np.concatenate([self.np.zeros((W - 1, C)), x], axis=0)
        y = self.np.zeros((T, C))
        for i in range(W):
            y += w[:, 0, i][None, :] * xp[i : i + T]
        return y

    def to_list(self, x):
        return [float(v) for v in x]


class TorchOps:
    name = "torch"

    def __init__(self):
        import torch
        import torch.nn.functional as F

        self.torch = torch
        self.F = F

    def tensor(self, a):
        return self.torch.tensor(a, dtype=self.torch.float64)

    def zeros(self, *shape):
        return self.torch.zeros(*shape, dtype=self.torch.float64)

    def exp(self, x):
        return self.torch.exp(x)

    def sigmoid(self, x):
        return self.torch.sigmoid(x)

    def silu(self, x):
        return self.F.silu(x)

    def softplus(self, x):
        return self.F.softplus(x)

    def rsqrt(self, x):
        return self.torch.rsqrt(x)

    def sum_last(self, x):
        return x.sum(dim=-1, keepdim=True)

    def mean_last(self, x):
        return x.mean(dim=-1, keepdim=True)

    def outer(self, a, b):
        return self.torch.outer(a, b)

    def causal_conv(self, x, w):
        """x [T, C], w [C, 1, W]: PyTorch's depthwise conv1d, padded W-1 on the left."""
        T, C = x.shape
        W = w.shape[2]
        y = self.F.conv1d(x.t().unsqueeze(0), w, padding=W - 1, groups=C)  # [1, C, T + W - 1]
        return y[0, :, :T].t()

    def to_list(self, x):
        return [float(v) for v in x.tolist()]


class ToyModel:
    """The byte-level model of train/model.h, parameters by their checkpoint names."""

    def __init__(self, ops, tensors, cfg):
        self.ops = ops
        self.cfg = cfg
        self.p = {n: ops.tensor(a) for n, a in tensors.items() if not n.startswith("optim.")}
        self.d = int(cfg["hidden_size"])
        self.L = int(cfg["num_hidden_layers"])
        self.H = int(cfg["num_heads"])
        self.HV = int(cfg["num_v_heads"])
        self.K = int(cfg["head_dim"])
        self.V = int(cfg["head_v_dim"])
        self.eps = float(cfg["norm_eps"])
        self.mixer = cfg.get("mixer", "kda")  # configs without "mixer" are KDA
        self.gate = cfg["gate"]  # "lower_bound" or "kda"
        self.lb = float(cfg["lower_bound"])
        self.tie = bool(cfg["tie_word_embeddings"])

    def rmsnorm(self, x, w):
        o = self.ops
        return x * o.rsqrt(o.mean_last(x * x) + self.eps) * w

    def l2norm(self, x):
        o = self.ops
        return x * o.rsqrt(o.sum_last(x * x) + 1e-6)

    def log_decay(self, graw, A_log, dt_bias):
        """graw [T, HV, K] -> g [T, HV, K], natural-log decay per key channel."""
        o = self.ops
        z = graw + dt_bias.reshape(self.HV, self.K)
        a = o.exp(A_log).reshape(self.HV, 1)
        if self.gate == "lower_bound":
            return self.lb * o.sigmoid(a * z)
        return -a * o.softplus(z)

    def mixer_layer(self, pre, h):
        o, P = self.ops, self.p
        T = h.shape[0]
        H, HV, K, V = self.H, self.HV, self.K, self.V
        q = o.silu(o.causal_conv(h @ P[pre + "q_proj.weight"].T, P[pre + "q_conv1d.weight"]))
        k = o.silu(o.causal_conv(h @ P[pre + "k_proj.weight"].T, P[pre + "k_conv1d.weight"]))
        v = o.silu(o.causal_conv(h @ P[pre + "v_proj.weight"].T, P[pre + "v_conv1d.weight"]))
        q, k, v = q.reshape(T, H, K), k.reshape(T, H, K), v.reshape(T, HV, V)
        graw = (h @ P[pre + "f_proj.0.weight"].T) @ P[pre + "f_proj.1.weight"].T
        g = self.log_decay(graw.reshape(T, HV, K), P[pre + "A_log"], P[pre + "dt_bias"])
        braw = h @ P[pre + "b_proj.weight"].T  # [T, HV]
        qn, kn = self.l2norm(q), self.l2norm(k)
        s = K**-0.5
        rows = []
        S = [o.zeros(K, V) for _ in range(HV)]
        for t in range(T):
            heads = []
            for hv in range(HV):
                hq = hv // (HV // H)
                decay = o.exp(g[t, hv]).reshape(K, 1)
                if self.mixer == "dplr":  # a = -kh, b = alpha kh, alpha = sigmoid(braw)
                    alpha = o.sigmoid(braw[t, hv])
                    kh = kn[t, hq]
                    S[hv] = decay * S[hv] - alpha * o.outer(kh, kh @ S[hv]) + o.outer(kh, v[t, hv])
                else:
                    beta = o.sigmoid(braw[t, hv])
                    S[hv] = decay * S[hv]
                    e = beta * (v[t, hv] - kn[t, hq] @ S[hv])
                    S[hv] = S[hv] + o.outer(kn[t, hq], e)
                heads.append(s * (qn[t, hq] @ S[hv]))
            rows.append(heads)
        ot = o.zeros(T, HV, V)
        for t in range(T):
            for hv in range(HV):
                ot[t, hv] = rows[t][hv]
        gate = (h @ P[pre + "g_proj.0.weight"].T) @ P[pre + "g_proj.1.weight"].T
        gate = (gate + P[pre + "g_proj.1.bias"]).reshape(T, HV, V)
        y = self.rmsnorm(ot, P[pre + "o_norm.weight"]) * o.sigmoid(gate)
        return y.reshape(T, HV * V) @ P[pre + "o_proj.weight"].T

    def mlp(self, pre, h):
        o, P = self.ops, self.p
        a = h @ P[pre + "gate_proj.weight"].T
        b = h @ P[pre + "up_proj.weight"].T
        return (o.silu(a) * b) @ P[pre + "down_proj.weight"].T

    def next_logits(self, ids):
        P = self.p
        E = P["model.embeddings.weight"]
        x = E[ids]
        for i in range(self.L):
            pre = f"model.layers.{i}."
            x = x + self.mixer_layer(pre + "attn.", self.rmsnorm(x, P[pre + "attn_norm.weight"]))
            x = x + self.mlp(pre + "mlp.", self.rmsnorm(x, P[pre + "mlp_norm.weight"]))
        h = self.rmsnorm(x, P["model.norm.weight"])
        head = E if self.tie else P["lm_head.weight"]
        return self.ops.to_list(h[-1] @ head.T)


def deltagrad_logits(binary, ckpt, prompt):
    cmd = [binary, "sample", "--ckpt", ckpt, "--prompt", prompt, "--print-logits", "--threads=1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
    out = {}
    for line in r.stdout.splitlines():
        b, x = line.split()
        out[int(b)] = float(x)
    return [out[i] for i in range(len(out))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="checkpoint file or run directory")
    ap.add_argument("--deltagrad", default="deltagrad", help="the deltagrad binary")
    ap.add_argument("--prompt", default="And God said", help="prompt (default: And God said)")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    ap.add_argument("--numpy", action="store_true", help="NumPy instead of PyTorch")
    args = ap.parse_args()
    if not args.prompt:
        ap.error("--prompt must not be empty")
    try:
        ops = NumpyOps() if args.numpy else TorchOps()
        import numpy  # noqa: F401  (the safetensors reader uses it in both modes)
    except ImportError as e:
        print(f"SKIPPED: {e} (the {'--numpy' if args.numpy else 'torch'} backend)")
        return 77
    path = args.ckpt
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt_latest.safetensors")
    tensors, meta = read_safetensors(path)
    if "config" not in meta:
        print(f"{path}: no 'config' in the metadata: not a deltagrad checkpoint", file=sys.stderr)
        return 1
    cfg = json.loads(meta["config"])
    print(f"checkpoint {path}: format {meta.get('format', '?')}, step {meta.get('step', '?')}")
    print(f"  {cfg.get('mixer', 'kda')} mixer, d {cfg['hidden_size']}, layers "
          f"{cfg['num_hidden_layers']}, heads {cfg['num_heads']}/{cfg['num_v_heads']}, head dims "
          f"{cfg['head_dim']}/{cfg['head_v_dim']}, gate {cfg['gate']}")
    model = ToyModel(ops, tensors, cfg)
    ids = list(args.prompt.encode("utf-8"))
    mine = model.next_logits(ids)
    try:
        theirs = deltagrad_logits(args.deltagrad, args.ckpt, args.prompt)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"FAIL: deltagrad sample --print-logits: {e}")
        return 1
    if len(theirs) != len(mine):
        print(f"FAIL: deltagrad printed {len(theirs)} logits, the model has {len(mine)}")
        return 1
    scale = max(1.0, max(abs(x) for x in mine))
    err = max(abs(a - b) for a, b in zip(mine, theirs))
    top = sorted(range(len(mine)), key=lambda i: -mine[i])[:5]
    print(f"  prompt {args.prompt!r} ({len(ids)} bytes), backend {ops.name} (f64, token by token)")
    print("  top next bytes here:      " + ", ".join(f"{i} ({mine[i]:.4f})" for i in top))
    print("  the same in deltagrad:    " + ", ".join(f"{i} ({theirs[i]:.4f})" for i in top))
    ok = err <= args.tol * scale and all(math.isfinite(x) for x in theirs)
    print(f"{'PASS' if ok else 'FAIL'}: max |logit difference| {err:.3g}, limit {args.tol:g} x "
          f"{scale:.3g} = {args.tol * scale:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One forward (and backward) of the Triton attention kernels per subprocess, for a case that faulted on the GPU
(session 29: 72/72 causal bf16, q token-major, k/v padded views): which setting makes it fault? Each variant
splits the value head whatever the alignment ("force": the launchers now split only 16-byte-aligned rows).

    python scripts/debug_value_split.py            # every variant, one subprocess each
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def one(spec: dict) -> str:
    import torch

    from mla_attn.ops.attention import triton_fwd
    from mla_attn.ops.attention.triton_bwd import flash_attn_bwd
    from mla_attn.testing import attention_oracle

    triton_fwd.VALUE_SPLIT = spec.get("split", True)
    if spec.get("force", True):  # split whatever the rows' alignment (the launchers no longer do: rows_aligned)
        triton_fwd.rows_aligned = lambda *tensors: True
    triton_fwd.STRIDE_UNITS = spec.get("units", True)
    b, hq, hkv, m, n, dqk, dv = spec.get("shape", (1, 3, 3, 257, 255, 72, 72))
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    torch.manual_seed(0)
    q = torch.randn(b, hq, m, dqk, device="cuda").to(dtype)
    k = torch.randn(b, hkv, n, dqk, device="cuda").to(dtype)
    v = torch.randn(b, hkv, n, dv, device="cuda").to(dtype)
    layout = spec.get("layout", "strided")
    if layout == "strided":
        def pad(t, pn=3, pd=5):
            bb, h, L, d = t.shape
            buf = torch.full((bb, L + pn, h, d + pd), float("nan"), dtype=t.dtype, device=t.device)
            view = buf[:, :L, :, :d].transpose(1, 2)
            view.copy_(t)
            return view
        qs, ks, vs = q.transpose(1, 2).contiguous().transpose(1, 2), pad(k), pad(v)
    else:
        qs, ks, vs = q, k, v
    cfg = tuple(spec["cfg"]) if spec.get("cfg") else None
    causal = spec.get("causal", True)
    o, lse = triton_fwd.flash_attn_fwd(qs, ks, vs, causal, dqk ** -0.5, config=cfg)
    torch.cuda.synchronize()
    ref, _ = attention_oracle(q.double(), k.double(), v.double(), causal=causal, scale=dqk ** -0.5)
    err = ((o.double() - ref).norm() / ref.norm()).item()
    res = f"fwd ok rel_err {err:.2e}"
    if spec.get("bwd"):
        do = torch.randn_like(o)
        dq, dk, dvv = flash_attn_bwd(do, qs, ks, vs, o, lse, causal, dqk ** -0.5)
        torch.cuda.synchronize()
        res += f"; bwd ok finite {bool(torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dvv).all())}"
    return res


VARIANTS = [
    {"name": "failing case"},
    {"name": "no value split", "split": False},
    {"name": "contiguous (unit 8)", "layout": "contiguous"},
    {"name": "contiguous, units off", "layout": "contiguous", "units": False},
    {"name": "contiguous, units off, no split", "layout": "contiguous", "units": False, "split": False},
    {"name": "fp16", "dtype": "float16"},
    {"name": "not causal", "causal": False},
    {"name": "tiles 64,64,4,2", "cfg": [64, 64, 4, 2]},
    {"name": "tiles 128,64,8,1", "cfg": [128, 64, 8, 1]},
    {"name": "96/96 strided (64 + 32)", "shape": [1, 3, 3, 257, 255, 96, 96]},
    {"name": "40/40 strided", "shape": [1, 3, 3, 257, 255, 40, 40]},
    {"name": "72/72 N = M = 256", "shape": [1, 3, 3, 256, 256, 72, 72]},
    {"name": "contiguous + bwd", "layout": "contiguous", "bwd": True},
    {"name": "no split + bwd", "split": False, "bwd": True},
]

if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(one(json.loads(sys.argv[1])))
        sys.exit(0)
    for spec in VARIANTS:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        r = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True, env=env,
                           timeout=240)
        tail = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else \
            "FAULT: " + " | ".join(l for l in r.stderr.strip().splitlines()[-3:])[:300]
        print(f"{spec['name']:28s} {tail}", flush=True)

"""Where the one-pass backward's time goes (gluon_bwd_fused.py), on the H200.

Times the fused kernel alone at two tile choices (rows a step, ring stages), with its dQ out in order
(DQ_MODE 0) and in the diagnostic modes (the kernel's DQ_MODE comment), with dQ_j out by TMA (bulk; also
its adds unordered, and its counters without the adds),
against the two-pass backward's kernels alone (the Gluon dK/dV pass, the Triton dQ pass), on causal
bf16 rows. Each time a do_bench median; TFLOP/s count the backward's 2.5 x forward FLOPs.

    python scripts/probe_fused_bwd.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.testing import do_bench

ROWS = [(4, 32, 32, 4096), (8, 32, 8, 2048)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from mla_attn.ops.attention import gluon_bwd, gluon_bwd_fused, triton_bwd
    from mla_attn.ops.attention.triton_fwd import flash_attn_fwd

    lines = ["| B | Hq/Hkv | L | variant | ms | TFLOP/s (bwd, 2.5 x fwd) |", "|---|---|---|---|---|---|"]
    for b, hq, hkv, n in ROWS:
        d = 128
        torch.manual_seed(0)
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
        scale = d ** -0.5
        o, lse = flash_attn_fwd(q, k, v, True, scale)
        delta = (o.float() * do.float()).sum(-1).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        flops = 2.5 * 2 * b * hq * n * n * 2 * d / 2

        def add(name, fn):
            ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
            lines.append(f"| {b} | {hq}/{hkv} | {n} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
            print(lines[-1], flush=True)

        for bm, st in ((64, 2), (32, 3)):
            for mode in (0, 2, 4):
                add(f"fused, rows {bm}, stages {st}, DQ_MODE {mode}", lambda m=mode, bm=bm, st=st: gluon_bwd_fused.bwd_fused_gluon(
                    q, k, v, do, lse, delta, dq, dk, dv, causal=True, scale=scale, dq_mode=m, block_m=bm, stages=st))
        add("fused, rows 64, stages 2, bulk (TMA reduce-add)", lambda: gluon_bwd_fused.bwd_fused_gluon(
            q, k, v, do, lse, delta, dq, dk, dv, causal=True, scale=scale, bulk=True))
        add("fused, rows 64, stages 2, bulk + cast pass", lambda: gluon_bwd_fused.bwd_fused_gluon(
            q, k, v, do, lse, delta, dq, dk, dv, causal=True, scale=scale, bulk=True, cast=True))
        # Timing only (wrong dq): the TMA adds unordered (2), the counters in order without the adds (3), the adds
        # unordered with only their buffer's read waited for (5).
        for mode in (2, 3, 5):
            add(f"fused, rows 64, stages 2, bulk + cast pass, DQ_MODE {mode}", lambda m=mode: gluon_bwd_fused.bwd_fused_gluon(
                q, k, v, do, lse, delta, dq, dk, dv, causal=True, scale=scale, bulk=True, cast=True, dq_mode=m))
        add("two-pass: Gluon dK/dV pass alone", lambda: gluon_bwd.dkdv_gluon(
            q, k, v, do, lse, delta, dk, dv, causal=True, scale=scale))
        add("two-pass: whole backward (flash_attn_bwd, fused off)", lambda: triton_bwd.flash_attn_bwd(
            do, q, k, v, o, lse, True, scale))
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

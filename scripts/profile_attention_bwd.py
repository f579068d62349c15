"""Where the flash-attention backward's GPU time goes: each kernel's duration on the benchmark rows.

For each row of bench_attention.py this prints the per-call GPU time of every kernel a forward + backward
through the public op launches (torch.profiler; the forward, the delta preprocess, the dK/dV pass, the dQ
pass), with dQ on its side stream (as routed) and on the main stream, and the wall time of the whole
step in each mode. The difference between the two modes is the overlap the side stream buys.

The number this is for: how much of the backward the dQ pass takes. Our backward is deterministic, so dQ
has a pass of its own that recomputes S and dP (docs/benchmarks.md, session 20, "Next"). A fused dQ
with an ordered fp32 reduction would remove that pass's two recompute GEMMs, about 2/3 of its tensor work.

    PYTHONPATH=. python3 scripts/profile_attention_bwd.py [--out profile.txt]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import ROWS, _ms, _ours, _train_row  # noqa: E402
from profile_decode import _kernel_us  # noqa: E402


def profile_rows(rows=ROWS):
    """Lines of text: for each row and dQ stream mode, the step's time and each kernel's time per call."""
    from mla_attn.ops.attention import triton_bwd

    lines = []
    for b, hq, hkv, n, dqk, dv in rows:
        scale, flops, q, k, v, do = _train_row(b, hq, hkv, n, dqk, dv)

        def step():
            for t in (q, k, v):
                t.grad = None
            _ours(q, k, v, scale).backward(do)

        for side in (True, False):
            old, triton_bwd.SIDE_STREAM_DQ = triton_bwd.SIDE_STREAM_DQ, side
            try:
                ms = _ms(step, [q, k, v])
                kernels = _kernel_us(step)
            finally:
                triton_bwd.SIDE_STREAM_DQ = old
            mode = "dQ on a side stream" if side else "dQ on the main stream"
            lines.append(f"B={b} H={hq}/{hkv} L={n} D={dqk}/{dv}, {mode}: step {ms * 1e3:.0f} us "
                         f"({flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s as counted)")
            total = sum(kernels.values())
            for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                lines.append(f"    {us:9.1f} us  {100 * us / total:5.1f}%  {name}")
            print("\n".join(lines[-len(kernels) - 1:]), flush=True)
        torch.cuda.empty_cache()
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the lines here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_attention_bwd.py needs a CUDA GPU")
    lines = profile_rows()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

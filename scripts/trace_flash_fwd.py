"""Timeline of one program of the Gluon flash-attention forward's steady loop (H200 diagnostics).

Runs the TRACE build of ``gluon_fwd._flash_fwd_gluon`` (clock64 stamps in ``_overlap_step``,
constexpr-off in the normal build, whose SASS is unchanged) on the benchmark's d 128 and 192/128 rows,
and prints for program (0, 0) (causal: the head's last, longest row block) the median cycles of each
part of a steady step:

- barrier: step start -> both warpgroups past the CTA barrier (P_j V_j issued);
- S issue: -> tile j + 2 landed and S_{j+2} issued (includes the wait for the tile);
- softmax: -> the softmax of tile j + 1 done (under both wgmmas);
- P V wait: -> P_j V_j done;
- S wait: -> acc rescaled, P_{j+1} converted and S_{j+2} done;

and the step period, with the tensor-core time a step needs at the measured 687 TFLOP/s for scale.
The stamped build uses a few more registers (221 against 208 at d 128, no spills); its times are
upper bounds. Eager-call times of both builds are printed beside.

    PYTHONPATH=. python3 scripts/trace_flash_fwd.py [OUT.txt]
"""

from __future__ import annotations

import statistics
import sys

import torch

from probe_mla_decode import _write  # the report so far, rewritten after each case
from trace_mla_decode import run_traced

PARTS = [("barrier", 0, 2), ("S issue", 2, 4), ("softmax", 4, 5), ("P V wait", 5, 6), ("S wait", 6, 8)]


def _run(b, h, hk, n, dqk, dv, lines, token_major=False):
    from mla_attn.ops.attention import gluon_fwd

    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    if token_major:  # the layers' layout: [B, L, H, D] seen through transpose(1, 2)
        q = torch.randn(b, n, h, dqk, generator=gen).to("cuda", dt).transpose(1, 2)
        k = torch.randn(b, n, hk, dqk, generator=gen).to("cuda", dt).transpose(1, 2)
        v = torch.randn(b, n, hk, dv, generator=gen).to("cuda", dt).transpose(1, 2)
    else:
        q = torch.randn(b, h, n, dqk, generator=gen).to("cuda", dt)
        k = torch.randn(b, hk, n, dqk, generator=gen).to("cuda", dt)
        v = torch.randn(b, hk, n, dv, generator=gen).to("cuda", dt)
    tiles, events = gluon_fwd.TRACE_TILES.value, gluon_fwd.TRACE_EVENTS.value
    tr = torch.zeros(1, tiles, events, dtype=torch.int64, device="cuda")
    scale = dqk ** -0.5

    def call(trace=None):
        return gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, token_major=token_major, trace=trace)[0]

    t_plain, t_trace = run_traced(call, tr)
    flops = 2 * b * h * n * n * (dqk + dv) / 2
    x = tr[0].cpu()
    steps = [j for j in range(tiles) if int(x[j, 0]) and int(x[j, 8])]
    add = lines.append
    add(f"\n## B {b}, H {h}/{hk}, L {n}, D {dqk}/{dv}, causal{', token-major' if token_major else ''}: "
        f"program (0, 0), {len(steps)} steady steps stamped")
    add(f"normal build {t_plain * 1e3:.1f} us ({flops / t_plain / 1e9:.0f} TFLOP/s), "
        f"TRACE build {t_trace * 1e3:.1f} us ({flops / t_trace / 1e9:.0f})")
    if len(steps) < 8:
        return
    mid = steps[2:-2]
    per = [int(x[j + 1, 0]) - int(x[j, 0]) for j in mid if j + 1 in steps]
    add(f"  {'period':10s} {statistics.median(per):8.0f} cycles a step (one 128-row x 64-key tile)")
    for name, a, c in PARTS:
        add(f"  {name:10s} {statistics.median(int(x[j, c]) - int(x[j, a]) for j in mid):8.0f}")
    tensor = 2 * 128 * 64 * (dqk + dv) / (687e12 / 132)  # seconds a step's wgmmas need at the measured peak
    add(f"  (a step's wgmmas at 687 TFLOP/s / 132 SMs: {tensor * 1e9:.0f} ns; the SM clock converts cycles)")


def main(out):
    lines = [f"# Gluon flash forward trace, {torch.cuda.get_device_name()}"]
    for b, h, hk, n, dqk, dv, tm in [(4, 32, 32, 4096, 128, 128, False), (4, 32, 32, 4096, 128, 128, True),
                                     (8, 32, 8, 2048, 128, 128, False), (4, 128, 128, 2048, 192, 128, False)]:
        _run(b, h, hk, n, dqk, dv, lines, token_major=tm)
        _write(out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "trace_flash_fwd.txt")

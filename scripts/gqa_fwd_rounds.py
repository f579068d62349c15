"""The GQA benchmark row of the flash forward (8 x 32/8 x 2048, d 128, causal, bf16), timed in rotated rounds:
the routed op, the Gluon kernel called directly, the same kernel without head pairs, the grid schedule with head
pairs, and SDPA, with the SM clock after each round, then each one's median, spread and median ratio to SDPA. For
run-to-run spread: one bench_attention.py table is a single A B B A sample.

    PYTHONPATH=. python3 scripts/gqa_fwd_rounds.py [ROUNDS]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

from mla_attn.ops.attention import gluon_fwd  # noqa: E402

B, HQ, HKV, L, D = 8, 32, 8, 2048, 128


def _clock() -> int:
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no NVML in this torch build
        return -1


def main(rounds: int = 6) -> None:
    if not torch.cuda.is_available():
        sys.exit("gqa_fwd_rounds.py needs a CUDA GPU")
    flops = 2.0 * B * HQ * L * L * 2 * D / 2
    scale = D ** -0.5
    with torch.no_grad():
        q, k, v = ba._inputs(B, HQ, HKV, L, D, D)
        cands = {
            "op": lambda: ba._ours(q, k, v, scale),
            "direct": lambda: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale),
            "sdpa": lambda: ba._sdpa(q, k, v, scale),
            "onehead": lambda: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, pair=False),
            "grid": lambda: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, persistent=False),
        }
        names = list(cands)
        tf = {nm: [] for nm in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for nm in order:
                tf[nm].append(flops / (ba._ms(cands[nm]) * 1e-3) / 1e12)
            print(f"round {r}: " + ", ".join(f"{nm} {tf[nm][-1]:.0f}" for nm in order) + f" | clock {_clock()} MHz",
                  flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    for nm in names:
        ratio = [a / b for a, b in zip(tf[nm], tf["sdpa"])]
        print(f"{nm}: median {med(tf[nm]):.0f}, min {min(tf[nm]):.0f}, max {max(tf[nm]):.0f} TFLOP/s; "
              f"per-round ratio to SDPA median {med(ratio):.3f}, min {min(ratio):.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)

"""One flash-attention row timed many times against SDPA: the spread of the ratio across fresh inputs and rounds.

A single ``bench_attention.py`` run reads the 4 x 128 x 2048 192/128 forward anywhere from 0.86 to 0.92 of SDPA
(same kernel, same GPU). This times ``--rounds`` rounds, each with fresh random inputs, ours and SDPA in A B B A
order (``bench_attention._ms_pair``), under no_grad and in grad mode, and prints every round's ratio and the
median, so a claim about the row rests on a distribution rather than on one draw.

``--direct`` adds, where the op routes the inputs to the Gluon forward, that kernel called directly
(``gluon_fwd.flash_fwd_gluon``, timed A B B A against the op): what the op's own path costs on top of the
kernel. Session 13's clock64 trace script read 501 TF/s on this row calling the kernel directly, while the op
read 440 in the same session.

    python scripts/bench_row_repeat.py [--row B,HQ,HKV,L,DQK,DV] [--rounds 7] [--direct] [--out FILE.md]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402


def _direct(q, k, v, scale):
    """The Gluon forward called directly with what the op would pass it, or None where the op does not route
    these inputs to it or the direct call's output is not bit for bit the op's (then a warning says so)."""
    from mla_attn.ops.attention import function

    if not function._gluon_takes(q, k, v):
        return None
    from mla_attn.ops.attention import gluon_fwd

    def call():
        return gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, token_major=function.GLUON_TOKEN_MAJOR)[0]

    diff = (call().float() - ba._ours(q, k, v, scale).float()).abs().max().item()
    if diff != 0.0:  # not the kernel the op ran: no column, rather than a comparison of two different things
        print(f"bench_row_repeat: the direct Gluon call differs from the op by {diff}; its column is left '-'",
              file=sys.stderr)
        return None
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="4,128,128,2048,192,128", help="B,HQ,HKV,L,DQK,DV")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--direct", action="store_true", help="also time the Gluon forward called directly")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        b, hq, hkv, n, dqk, dv = (int(x) for x in a.row.split(","))
    except ValueError:
        ap.error(f"--row wants six integers B,HQ,HKV,L,DQK,DV, got {a.row!r}")
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_row_repeat: needs a CUDA GPU")
    scale = dqk ** -0.5
    flops = 2.0 * b * hq * n * n * (dqk + dv) / 2
    tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    lines = [f"GPU {torch.cuda.get_device_name()}; row {b} x {hq}/{hkv} x {n}, {dqk}/{dv}, bf16, causal; "
             f"forward TF/s, ours / SDPA / ratio, {a.rounds} rounds of fresh inputs", "",
             "| round | no_grad: ours | SDPA | ratio | grad mode: ours | SDPA | ratio |"
             + (" direct kernel TF/s | op / direct |" if a.direct else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if a.direct else "")]
    op_over_direct = []
    ratios = {False: [], True: []}
    for r in range(a.rounds):
        cells = []
        for grad in (False, True):
            q, k, v = ba._inputs(b, hq, hkv, n, dqk, dv, grad=grad)
            with torch.set_grad_enabled(grad):
                mo, ms = ba._ms_pair(lambda: ba._ours(q, k, v, scale), lambda: ba._sdpa(q, k, v, scale))
            ratios[grad].append(ms / mo)
            cells += [f"{tf(mo):.0f}", f"{tf(ms):.0f}", f"{ms / mo:.3f}"]
            if a.direct and not grad:
                direct = _direct(q, k, v, scale)
                if direct is None:
                    cells_d = ["-", "-"]
                else:
                    mo2, md = ba._ms_pair(lambda: ba._ours(q, k, v, scale), direct)
                    op_over_direct.append(md / mo2)
                    cells_d = [f"{tf(md):.0f}", f"{md / mo2:.3f}"]
        if a.direct:
            cells += cells_d
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    med = {g: statistics.median(x) for g, x in ratios.items()}
    lines += ["", f"median ratio: no_grad {med[False]:.3f} (range {min(ratios[False]):.3f}-{max(ratios[False]):.3f}), "
              f"grad mode {med[True]:.3f} (range {min(ratios[True]):.3f}-{max(ratios[True]):.3f})"]
    if op_over_direct:
        lines[-1] += (f"; op / direct kernel (no_grad) {statistics.median(op_over_direct):.3f} "
                      f"(range {min(op_over_direct):.3f}-{max(op_over_direct):.3f})")
    print(lines[-1])
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""The issue's GQA decode rows timed in rounds against SDPA: the spread of the ratio across fresh caches and rounds.

One ``bench_decode.py --graph`` run is a single draw per row, and the large-batch rows sit within about 1% of SDPA
(on the H200, 0.2-1.3% behind at 637252e; on H100s, tied to 0.5% behind at B 32 and 0.6-1% ahead at B 128). This
tells a gap from run-to-run noise: it times ``--rounds`` rounds, each over a fresh random cache: ``gqa_decode`` and
SDPA (``enable_gqa=True``), each captured in a CUDA graph, timed A B B A (``triton.testing.do_bench`` medians, the
pair's two runs averaged), and, with ``--layers N``, the per-step time of N steps over N cache copies in one graph
the same way. It prints every round's times, GB/s of cache read and ratio (SDPA time / ours: above 1 means ours is
faster), then the medians, so a claim about a row rests on a distribution rather than on one draw.

    PYTHONPATH=. python3 scripts/decode_rounds.py [--shapes gqa1,gqa32,gqa128] [--rounds 7] [--layers 8]
                                                  [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402

D = 128


def _pair(fa, fb):
    """Seconds of fa and fb timed A B B A, each side the mean of its two runs (cancels a linear clock drift)."""
    a1, b1, b2, a2 = bd._bench(fa), bd._bench(fb), bd._bench(fb), bd._bench(fa)
    return (a1 + a2) / 2, (b1 + b2) / 2


def _round(b, hq, hkv, length, gen, layers, dev="cuda", dtype=torch.bfloat16):
    """One round over a fresh cache: {"graph": (ours_s, sdpa_s), "layers": (ours_s, sdpa_s) or None}. ``dev`` and
    ``dtype`` are for the CPU test (the interpreter's bf16 dots are wrong); the script times CUDA bf16."""
    from mla_attn.ops.decode.triton_decode import gqa_decode

    seq_lens = torch.full((b,), length, dtype=torch.int32, device=dev)  # SDPA has no varlen decode
    q = torch.randn(b, hq, 1, D, generator=gen, device=dev).to(dtype)
    k = torch.randn(b, hkv, length, D, generator=gen, device=dev).to(dtype)
    v = torch.randn(b, hkv, length, D, generator=gen, device=dev).to(dtype)
    scale = D ** -0.5

    def ours(kk=k, vv=v):
        return gqa_decode(q, kk, vv, seq_lens, None, scale, None)

    def sdpa(kk=k, vv=v):
        return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    err = (ours()[0].float().reshape(b, hq, D) - sdpa().float().reshape(b, hq, D)).abs().max().item()
    if not err < 5e-3:  # outputs reach ~0.03-0.08 here, bf16 rounding ~3e-4; zeros or garbage fail (NaN too)
        raise RuntimeError(f"gqa_decode differs from SDPA by {err} at B {b} {hq}/{hkv} L {length}")
    out = {"graph": _pair(bd.capture_graph(ours).replay, bd.capture_graph(sdpa).replay), "layers": None}
    if layers:
        copies = [(k.clone(), v.clone()) for _ in range(layers)]
        g_ours = bd.capture_graph(lambda: [ours(kk, vv) for kk, vv in copies])
        g_sdpa = bd.capture_graph(lambda: [sdpa(kk, vv) for kk, vv in copies])
        t_ours, t_sdpa = _pair(g_ours.replay, g_sdpa.replay)
        out["layers"] = (t_ours / layers, t_sdpa / layers)
        del copies, g_ours, g_sdpa
    torch.cuda.empty_cache()
    return out


def rows_and_generator(ap, a, script: str):
    """The checks both round scripts share: ``a.shapes`` (names gqaB of bench_decode.GQA_SHAPES, comma-separated)
    as {name: (B, Hq, Hkv, L)} in the order given, ``a.rounds`` >= 1 (argparse errors otherwise), a CUDA GPU (exit
    naming ``script`` otherwise); with a seeded CUDA generator."""
    known = {f"gqa{s[0]}": s for s in bd.GQA_SHAPES}
    wanted = [s for s in a.shapes.split(",") if s]
    if not wanted or any(s not in known for s in wanted):
        ap.error(f"--shapes takes names from {sorted(known)}, got {a.shapes!r}")
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    return {s: known[s] for s in wanted}, gen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gqa1,gqa32,gqa128", help="rows of bench_decode.GQA_SHAPES, as gqaB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8, help="also time N steps over N cache copies in one graph (0: off)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.layers < 0:
        ap.error(f"--layers must be >= 0, got {a.layers}")
    known, gen = rows_and_generator(ap, a, "decode_rounds")
    wanted = list(known)
    lines = [f"GPU {torch.cuda.get_device_name()}; commit {os.environ.get('GIT_COMMIT', '?')}; GQA decode, bf16, "
             f"d {D}, one new token; graph replay, A B B A per round, {a.rounds} rounds of fresh caches; "
             "ratio = SDPA time / ours (> 1: ours faster)", ""]
    summary = []
    for name in wanted:
        b, hq, hkv, length = known[name]
        nbytes = b * length * hkv * 2 * D * 2
        gbs = lambda s: nbytes / s / 1e9  # noqa: E731
        lines += [f"### B {b}, {hq}/{hkv}, L {length}", "",
                  "| round | graph: ours us | SDPA us | ours GB/s | ratio |"
                  + (f" {a.layers}-layer step: ours us | SDPA us | ours GB/s | ratio |" if a.layers else ""),
                  "|---|---|---|---|---|" + ("---|---|---|---|" if a.layers else "")]
        ratios = {"graph": [], "layers": []}
        ours_gbs = {"graph": [], "layers": []}
        for r in range(a.rounds):
            res = _round(b, hq, hkv, length, gen, a.layers)
            cells = []
            for kind in ("graph", "layers"):
                if res[kind] is None:
                    continue
                to, ts = res[kind]
                ratios[kind].append(ts / to)
                ours_gbs[kind].append(gbs(to))
                cells += [f"{to * 1e6:.1f}", f"{ts * 1e6:.1f}", f"{gbs(to):.0f}", f"{ts / to:.4f}"]
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
            print(name, lines[-1], flush=True)
        for kind in ("graph", "layers"):
            if ratios[kind]:
                x = ratios[kind]
                summary.append(f"- {name} {kind if kind == 'graph' else f'{a.layers}-layer step'}: median ratio "
                               f"{statistics.median(x):.4f} (range {min(x):.4f}-{max(x):.4f}), ours median "
                               f"{statistics.median(ours_gbs[kind]):.0f} GB/s")
        lines.append("")
    lines += ["### Medians", ""] + summary
    print("\n".join(summary))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

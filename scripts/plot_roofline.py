"""Roofline plot of a decode benchmark JSON (from scripts/bench_decode.py --out X.md -> X.json).

    python scripts/plot_roofline.py docs/bench_decode_latest.json --out docs/decode_roofline.png

Each point is one (op, impl, shape): x = arithmetic intensity (FLOP per cache byte), y = achieved
TFLOP/s; the roof is min(4.25 TB/s * x, 687 TFLOP/s), the H200's measured copy bandwidth and bf16
matmul rate.
"""

from __future__ import annotations

import argparse
import json

PEAK_BW = 4.25e12
PEAK_FLOPS = 687e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="benchmark JSON written by bench_decode.py")
    ap.add_argument("--out", default="docs/decode_roofline.png")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if r["impl"] in ("triton", "triton-paged64", "einsum", "sdpa")]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [r["tflops"] * 1e3 / r["gbs"] for r in rows]  # FLOP per byte
    lo, hi = min(xs) / 2, max(xs) * 2
    ridge = PEAK_FLOPS / PEAK_BW
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(PEAK_BW * x, PEAK_FLOPS) / 1e12 for x in grid], "k-", lw=1,
            label=f"roof: 4.25 TB/s, 687 TFLOP/s (ridge {ridge:.0f} FLOP/B)")
    style = {"triton": ("o", "C0"), "triton-paged64": ("s", "C1"), "einsum": ("x", "C2"), "sdpa": ("^", "C3")}
    seen = set()
    for r, x in zip(rows, xs):
        marker, color = style[r["impl"]]
        label = f"{r['op']} {r['impl']}"
        filled = r["op"] == "mla" or marker == "x"  # GQA: hollow markers ('x' has no face to leave empty)
        ax.scatter([x], [r["tflops"]], marker=marker, facecolors=color if filled else "none",
                   edgecolors=None if marker == "x" else color, label=None if label in seen else label, s=36)
        seen.add(label)
        if r["impl"] == "triton":
            ax.annotate(f"B{r['B']} H{r['H']} L{r['L']}", (x, r["tflops"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per cache byte)")
    ax.set_ylabel("TFLOP/s")
    meta = data.get("meta", {})
    ax.set_title(f"Decode roofline, bf16 ({meta.get('gpu', '?')}, {meta.get('date', '')})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

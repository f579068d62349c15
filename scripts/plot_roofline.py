"""Roofline plot of a decode benchmark JSON (from scripts/bench_decode.py --out X.md -> X.json).

    python scripts/plot_roofline.py docs/bench_decode_latest.json --out docs/decode_roofline.png

Each point is one (op, impl, shape): x = arithmetic intensity (FLOP per cache byte), y = achieved
TFLOP/s (from the CUDA-graph replay times when the JSON has them, as a serving engine runs a decode
step; ``--eager`` plots the eager calls, host launch cost included); the roof is
min(4.25 TB/s * x, 687 TFLOP/s), the H200's measured copy bandwidth and bf16 matmul rate.
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
    ap.add_argument("--eager", action="store_true", help="plot eager-call times, not graph replays")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as f:
        data = json.load(f)
    for r in data["rows"]:  # "triton [gluon]": the op, which ran the Gluon kernel there (plotted as the op)
        r["impl"] = r["impl"].replace(" [gluon]", "")
    rows = [r for r in data["rows"] if r["impl"] in ("triton", "triton-paged64", "einsum", "sdpa")]
    graph = not args.eager and all(r.get("graph_us") for r in rows)
    for r in rows:  # the rate to plot: same work, the chosen time
        r["plot_tflops"] = r["tflops"] * r["us"] / r["graph_us"] if graph else r["tflops"]
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
        ax.scatter([x], [r["plot_tflops"]], marker=marker, facecolors=color if filled else "none",
                   edgecolors=None if marker == "x" else color, label=None if label in seen else label, s=36)
        seen.add(label)
        if r["impl"] == "triton":
            ax.annotate(f"B{r['B']} H{r['H']} L{r['L']}", (x, r["plot_tflops"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per cache byte)")
    ax.set_ylabel("TFLOP/s")
    meta = data.get("meta", {})
    timing = "CUDA-graph replays" if graph else "eager calls"
    ax.set_title(f"Decode roofline, bf16, {timing} ({meta.get('gpu', '?')}, {meta.get('date', '')})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

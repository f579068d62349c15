"""Bar chart of ``bench_attention.py --odd-widths``: TFLOP/s per head width, before session 29 (strides as they
are, value head padded), with the stride units, with units and the value-head split, and SDPA.

    python scripts/plot_odd_widths.py docs/raw/bench_odd_widths_890d698_h100.md --out docs/odd_widths.png
"""

from __future__ import annotations

import argparse


def read_rows(path: str) -> list[dict]:
    """The table's rows: width label, then (before, units, split, sdpa) for the forward and for fwd+bwd."""
    rows = []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 18 or not cells[0].isdigit():
            continue
        b, h, n, d = cells[0], cells[1], cells[2], cells[3]
        fwd = [float(x) for x in cells[6:10]]
        fb = [float(x) for x in cells[12:16]]
        rows.append({"label": f"{d}\n{b}x{h}x{n}", "fwd": fwd, "fwd+bwd": fb})
    if not rows:
        raise SystemExit(f"{path}: no rows of bench_attention.py --odd-widths found")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="markdown table written by bench_attention.py --odd-widths")
    ap.add_argument("--out", default="docs/odd_widths.png")
    ap.add_argument("--title", default="Flash attention at odd head widths (bf16, causal)")
    args = ap.parse_args(argv)
    rows = read_rows(args.table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["before (strides as they are, Dv padded)", "stride units", "units + value split", "SDPA (cuDNN)"]
    colors = ["#bbbbbb", "#8fb3d9", "#1f5fa8", "#d9822b"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    width = 0.2
    for ax, key in zip(axes, ("fwd", "fwd+bwd")):
        for i, (name, color) in enumerate(zip(names, colors)):
            xs = [j + (i - 1.5) * width for j in range(len(rows))]
            ax.bar(xs, [r[key][i] for r in rows], width, label=name, color=color)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["label"] for r in rows], fontsize=8)
        ax.set_title("forward" if key == "fwd" else "forward + backward")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    fig.suptitle(args.title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()

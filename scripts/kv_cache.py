#!/usr/bin/env python3
"""KV-cache calculator: bytes per token and per sequence for the configs in configs/ (or given files).

    python scripts/kv_cache.py                       # every configs/*.json, bf16, 32k and 128k context
    python scripts/kv_cache.py configs/DeepSeek-V3.json --context 131072 --batch 64 --dtype-bytes 1
    python scripts/kv_cache.py --plot docs/kv_cache.png

For each model: the cache it really keeps (GQA: K and V of each KV head; MLA: the latent plus the
shared rope key), and what plain MHA with the same query heads and head dims would keep.
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def per_token_values(cfg: dict) -> tuple[str, int, int]:
    """(kind, cached values per token per layer, MHA-equivalent values per token per layer)."""
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        return "MLA", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], heads * (qk + cfg["v_head_dim"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    kind = "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else "GQA")
    return kind, 2 * kv_heads * head_dim, 2 * heads * head_dim


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:,.1f} {unit}" if unit != "B" else f"{nbytes:,.0f} B"
        nbytes /= 1024
    raise AssertionError


def main(argv=None) -> int:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="config.json files (default: configs/*.json)")
    parser.add_argument("--context", type=int, nargs="+", default=[32768, 131072], help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2 for bf16/fp16, 1 for fp8")
    parser.add_argument("--plot", help="write a bar chart of bytes per token (needs matplotlib)")
    args = parser.parse_args(argv)
    paths = args.configs or sorted(glob.glob(os.path.join(root, "*.json")))
    if not paths:
        parser.error("no config files found")
    rows = []
    for path in paths:
        with open(path) as f:
            cfg = json.load(f)
        kind, vals, mha_vals = per_token_values(cfg)
        layers = cfg["num_hidden_layers"]
        name = os.path.splitext(os.path.basename(path))[0]
        rows.append((name, kind, vals * layers * args.dtype_bytes, mha_vals * layers * args.dtype_bytes, layers))
    ctx_cols = " | ".join(f"{c // 1024}k ctx x{args.batch}" for c in args.context)
    print(f"| model | attention | layers | cache / token | MHA-equivalent / token | saving | {ctx_cols} |")
    print("|---|---|---:|---:|---:|---:|" + "---:|" * len(args.context))
    for name, kind, per_tok, mha_tok, layers in rows:
        ctx = " | ".join(human(per_tok * c * args.batch) for c in args.context)
        print(f"| {name} | {kind} | {layers} | {human(per_tok)} | {human(mha_tok)} | {mha_tok / per_tok:.1f}x | {ctx} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
        names = [f"{r[0]} ({r[1]})" for r in rows]
        ax.barh(names, [r[3] / 1024 for r in rows], color="#cccccc", label="MHA with the same heads")
        ax.barh(names, [r[2] / 1024 for r in rows], color="#1f77b4", label="cache actually kept")
        ax.set_xscale("log")
        ax.set_xlabel(f"KV cache per token, all layers (KiB, {args.dtype_bytes}-byte values, log scale)")
        for i, r in enumerate(rows):
            ax.text(r[2] / 1024, i, f" {r[2] / 1024:,.0f}", va="center", fontsize=8, color="white"
                    if r[2] > 3 * 1024 else "black", ha="right" if r[2] > 3 * 1024 else "left")
        ax.invert_yaxis()
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title("What one token costs in the KV cache")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

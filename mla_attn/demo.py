"""The main job: a DeepSeek-V2-Lite-shaped MLA stack prefills, decodes through a paged latent cache
with the absorbed path, is checked against the expanded (training) path, and reports a table.

    python -m mla_attn                      # embedded DeepSeek-V2-Lite shape, 4 layers, CPU-sized
    python -m mla_attn --config configs/DeepSeek-V3.json --layers 2 --device cuda
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

# DeepSeek-V2-Lite's attention, as published in its config.json.
DEEPSEEK_V2_LITE = {
    "hidden_size": 2048, "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 163840, "num_hidden_layers": 27, "rms_norm_eps": 1e-6,
}


class Block(nn.Module):
    """Pre-norm residual attention block (the MLP is left out: the demo is about attention)."""

    def __init__(self, config, impl):
        super().__init__()
        from .layers import MultiHeadLatentAttention

        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = MultiHeadLatentAttention(config, impl=impl)

    def forward(self, x, cache=None, path=None):
        kwargs = {} if path is None else {"path": path}
        return x + self.attn(self.norm(x), cache=cache, **kwargs)


def run_stack(blocks, x, caches=None, path=None):
    for i, block in enumerate(blocks):
        x = block(x, cache=None if caches is None else caches[i], path=path)
    return x


def cache_bytes_per_token(config, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes per token per layer of the MHA and GQA caches an MLA layer replaces, and of MLA itself."""
    h = config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    per_head = qk + config.v_head_dim
    gqa_heads = max(1, h // 8)  # a Llama-style 8:1 grouping of the same heads
    return {
        f"MHA ({h} KV heads, K {qk} + V {config.v_head_dim})": h * per_head * dtype_bytes,
        f"GQA ({gqa_heads} KV heads, same head dims)": gqa_heads * per_head * dtype_bytes,
        f"MLA (latent {config.kv_lora_rank} + rope key {config.qk_rope_head_dim})":
            (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes,
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_attn", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="an MLA config.json (default: DeepSeek-V2-Lite's, embedded)")
    parser.add_argument("--layers", type=int, default=4, help="attention layers in the stack (default 4)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16, help="paged latent cache page size; 0 = contiguous")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graph", action="store_true",
                        help="CUDA: replay each decode step from a CUDA graph (mla_attn.layers.DecodeGraph)")
    args = parser.parse_args(argv)
    for name in ("layers", "batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    from .layers import MLAConfig
    from .layers.graph import DecodeGraph

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if args.config:
        config = MLAConfig.from_file(args.config)
        with open(args.config) as f:
            total_layers = json.load(f).get("num_hidden_layers", args.layers)
        name = args.config
    else:
        config = MLAConfig.from_hf(DEEPSEEK_V2_LITE)
        total_layers, name = DEEPSEEK_V2_LITE["num_hidden_layers"], "DeepSeek-V2-Lite (embedded)"

    torch.manual_seed(args.seed)
    blocks = nn.ModuleList(Block(config, impl="auto") for _ in range(args.layers)).to(device=device, dtype=dtype)
    blocks.eval()
    b, p, t = args.batch, args.prompt_len, args.new_tokens
    x = torch.randn(b, p + t, config.hidden_size, device=device, dtype=dtype)
    page_size = args.page_size or None

    with torch.no_grad():
        # Warm-up on throwaway caches: the first call of each kernel compiles it (seconds on a fresh
        # machine), which is not what the timings below are about.
        warm = [blk.attn.new_cache(b, p + t, page_size=page_size, dtype=dtype, device=device) for blk in blocks]
        run_stack(blocks, x[:, :p], warm)
        run_stack(blocks, x[:, p: p + 1], warm)
        del warm
        caches = [blk.attn.new_cache(b, p + t, page_size=page_size, dtype=dtype, device=device) for blk in blocks]
        _sync(device)
        t0 = time.perf_counter()
        y_prefill = run_stack(blocks, x[:, :p], caches)  # expanded path, writes the latent caches
        _sync(device)
        t1 = time.perf_counter()
        steps = []
        step = (DecodeGraph(lambda xt: run_stack(blocks, xt, caches), caches) if args.graph
                else (lambda xt: run_stack(blocks, xt, caches)))
        for i in range(t):  # absorbed path over the paged latent cache, one token at a time
            steps.append(step(x[:, p + i: p + i + 1]))
            if args.graph and i == 1:  # steps 1-2 ran eagerly / captured the graph: time the replays
                _sync(device)
                t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        timed = t - 2 if args.graph and t > 2 else t
        y_decode = torch.cat(steps, dim=1)
        y_full = run_stack(blocks, x)  # the training path over the whole sequence

    def rel(a, ref):
        return ((a.float() - ref.float()).norm() / ref.float().norm()).item()

    diff_prefill = (y_prefill.float() - y_full[:, :p].float()).abs().max().item()
    diff_decode = (y_decode.float() - y_full[:, p:].float()).abs().max().item()
    float_bytes = sum(buf.numel() * buf.element_size() for buf in caches[0].buffers() if buf.is_floating_point())
    measured = float_bytes / (b * (p + t))

    print(f"mla_attn demo: {name}; {args.layers} of {total_layers} layers; batch {b}; prompt {p}; "
          f"{t} new tokens; {device.type} {str(dtype).replace('torch.', '')}; "
          f"{'paged cache, page ' + str(page_size) if page_size else 'contiguous cache'}\n")
    elem = 2  # serving stores the cache in bf16 whatever this run computes in
    print(f"| KV cache per token (bf16) | bytes / layer | KiB / token, {total_layers} layers | vs MLA |")
    print("|---|---:|---:|---:|")
    rows = cache_bytes_per_token(config, elem)
    mla_bytes = list(rows.values())[-1]
    for label, nbytes in rows.items():
        print(f"| {label} | {nbytes:,} | {nbytes * total_layers / 2**10:,.1f} | {nbytes / mla_bytes:.1f}x |")
    values = measured / torch.finfo(dtype).bits * 8
    print(f"| measured: this run's cache buffers hold {values:,.0f} values / token / layer | "
          f"{values * elem:,.0f} | | |")
    print()
    print("| check / speed | value |")
    print("|---|---:|")
    print(f"| prefill (expanded) throughput | {b * p / (t1 - t0):,.0f} tok/s |")
    how = ("paged" if page_size else "contiguous") + (", CUDA graph" if args.graph and device.type == "cuda" else "")
    print(f"| decode (absorbed, {how}) throughput | {b * timed / (t2 - t1):,.1f} tok/s |")
    print(f"| decode step latency, {args.layers} layers | {(t2 - t1) / timed * 1e3:.2f} ms |")
    print(f"| max abs diff, prefill vs training path | {diff_prefill:.2e} |")
    print(f"| max abs diff, absorbed decode vs expanded training path | {diff_decode:.2e} "
          f"(rel {rel(y_decode, y_full[:, p:]):.1e}) |")
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    ok = rel(y_decode, y_full[:, p:]) < tol and rel(y_prefill, y_full[:, :p]) < tol
    print(f"\n{'OK' if ok else 'MISMATCH'}: decode through the cache {'matches' if ok else 'does NOT match'} "
          f"the full-sequence path (relative tolerance {tol:g} for {str(dtype).replace('torch.', '')})")
    return 0 if ok else 1

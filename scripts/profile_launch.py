"""Host-side cost of one eager decode call (CUDA): where the microseconds go before the GPU starts.

At batch 1 a decode step's GPU work is tens of microseconds, so an eager call is only as fast as its
Python path (validation, allocations, Triton's launcher). This times the host side alone (many calls
queued without synchronising) and prints a cProfile of the same calls.

    PYTHONPATH=. python3 scripts/profile_launch.py [--calls 300] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def _cases(device):
    import mla_attn

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(1, 32, 128, generator=gen).to(device, bf)
    k = torch.randn(1, 8, 32768, 128, generator=gen).to(device, bf)
    v = torch.randn(1, 8, 32768, 128, generator=gen).to(device, bf)
    lens = torch.full((1,), 32768, dtype=torch.int32, device=device)
    buf = torch.randn(1, 32768, 576, generator=gen).to(device, bf)
    ql = torch.randn(1, 128, 512, generator=gen).to(device, bf)
    qr = torch.randn(1, 128, 64, generator=gen).to(device, bf)

    def gqa():
        return mla_attn.decode_attention(q, k, v, lens)

    def gqa_1split():
        return mla_attn.decode_attention(q, k, v, lens, num_splits=1)

    def mla():
        return mla_attn.mla_decode(ql, qr, buf[..., :512], buf[..., 512:], lens, scale=0.1)

    return {"gqa B1 L32768 (auto splits)": gqa, "gqa B1 (num_splits=1, one launch)": gqa_1split,
            "mla B1 H128 L32768 (auto splits)": mla}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    device = torch.device("cuda")
    for name, fn in _cases(device).items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t1) / args.calls
        print(f"{name}: host {host * 1e6:.1f} us per call (no sync), wall {wall * 1e6:.1f} us per call", flush=True)
    name, fn = next(iter(_cases(device).items()))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {args.calls} calls of {name} (tottime order):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()

"""Where a split decode step's GPU time goes: decode kernel vs split combine vs the gaps between them.

For each case (MLA with varlen lengths in [3L/4, L], as bench_decode.py) this prints, for the
per-sequence and the balanced split, the CUDA-graph replay time of the whole step, the per-step time
in a graph of 8 steps over 8 cache copies, and the per-kernel GPU durations from torch.profiler, so
"step - kernels" is the launch gap. (Session 11's first runs, with combine and PDL variants, are in
docs/raw/profile_decode_2026-12-03_s11.txt.)

    PYTHONPATH=. python3 scripts/profile_decode.py [--only mla|gqa] [--quick] [--out profile.txt]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import DC, DR, _bench_graph, _paged_from_contiguous, _varlen, bench_steps  # noqa: E402


def _kernel_us(fn, calls=20):
    """Mean GPU duration per call of each kernel fn launches (torch.profiler, eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count:
            out[e.key[:40]] = t / calls
    return out


LAYERS = 8  # steps per graph in the "graph x8" column, each over its own cache (as a model's layers)


def _cases(gen, only=None):
    from mla_attn.ops.decode.triton_decode import gqa_decode, mla_decode

    dev, bf = "cuda", torch.bfloat16
    # GQA (1, 32/8, 32768), d 128
    n_gqa = 32768 if only in (None, "gqa") else 64  # a stub when only MLA is asked for
    lens = torch.full((1,), n_gqa, dtype=torch.int32, device=dev)
    k = torch.randn(1, 8, n_gqa, 128, generator=gen).to(dev, bf)
    v = torch.randn(1, 8, n_gqa, 128, generator=gen).to(dev, bf)
    q = torch.randn(1, 32, 1, 128, generator=gen).to(dev, bf)
    gqa_bytes = 32768 * 8 * 256 * 2
    copies = [(k, v)] + [(k.clone(), v.clone()) for _ in range(LAYERS - 1)]

    def gqa_make(i, ns=None, cfg=None):
        ki, vi = copies[i]
        return lambda: gqa_decode(q, ki, vi, lens, None, 0.088, ns, config=cfg)

    if only in (None, "gqa"):
        yield "gqa B1 H32/8 L32768", gqa_bytes, gqa_make
    copies.clear()
    if only == "gqa":
        return
    for b, h, length in [(1, 128, 32768), (16, 128, 8192), (64, 16, 8192), (128, 16, 4096), (128, 128, 8192)]:
        lens_m = _varlen(b, length, gen, dev)  # as bench_decode.py: lengths in [3L/4, L]
        buf = torch.randn(b, length, DC + DR, generator=gen).to(dev, bf)
        ql = torch.randn(b, h, 1, DC, generator=gen).to(dev, bf)
        qr = torch.randn(b, h, 1, DR, generator=gen).to(dev, bf)
        pool, table = _paged_from_contiguous(buf, gen)
        del buf
        nbytes = int(lens_m.sum()) * (DC + DR) * 2
        pools = [pool] + [pool.clone() for _ in range(LAYERS - 1)]

        def mla_make(i, ns=None, cfg=None, ql=ql, qr=qr, pools=pools, table=table, lens_m=lens_m):
            p = pools[i]
            return lambda: mla_decode(ql, qr, p[..., :DC], p[..., DC:], lens_m, table, 0.072, ns, config=cfg)

        yield f"mla B{b} H{h} L{length} paged64", nbytes, mla_make
        del pools, pool
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["mla", "gqa"], default=None)
    ap.add_argument("--quick", action="store_true", help="skip the GQA tile variants and SDPA")
    args = ap.parse_args()
    from mla_attn.ops.decode import triton_decode

    gen = torch.Generator().manual_seed(0)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    variants = {"per-sequence split": False, "balanced split": True}  # triton_decode.BALANCE
    saved = triton_decode.BALANCE
    for name, nbytes, make in _cases(gen, args.only):
        fn = make(0)
        ref = fn()[0].float()
        say(f"## {name}")
        for vname, balance in variants.items():
            triton_decode.BALANCE = balance
            try:
                out = fn()[0].float()
                err = (out - ref).abs().max().item()
                tg = _bench_graph(fn)
                ks = _kernel_us(fn)
                tl8 = bench_steps([make(i) for i in range(LAYERS)])
            except Exception as e:  # report, go on
                say(f"{vname:22s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            kern = ", ".join(f"{k}={v:.1f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1]))
            gs = "-" if tg is None else f"{tg * 1e6:.1f} us {nbytes / tg / 1e9:.0f} GB/s"
            say(f"{vname:22s} graph {gs} | graph x{LAYERS} per step {tl8 * 1e6:.1f} us "
                f"{nbytes / tl8 / 1e9:.0f} GB/s | max|diff| {err:.2e} | kernels(us): {kern}")
        triton_decode.BALANCE = saved
        if args.quick:
            continue
        if name.startswith("gqa"):
            import torch.nn.functional as F

            from mla_attn.ops.decode.triton_decode import DecodeConfig

            for label, ns, cfg in [("splits 16 (default)", None, None),
                                   ("splits 33, 64-key tiles x3, 2/SM", 33, DecodeConfig(16, 64, 4, 3, 2)),
                                   ("splits 33, 64-key tiles x4, 2/SM", 33, DecodeConfig(16, 64, 4, 4, 2)),
                                   ("splits 16, 64-key tiles x4", 16, DecodeConfig(16, 64, 4, 4)),
                                   ("splits 16, 128-key tiles x2", 16, DecodeConfig(16, 128, 4, 2)),
                                   ("splits 16, 128-key tiles x3, 8 warps", 16, DecodeConfig(16, 128, 8, 3)),
                                   ("splits 12 (default tiles)", 12, None)]:
                try:
                    f0 = make(0, ns, cfg)
                    kt = _kernel_us(f0)
                    tl8 = bench_steps([make(i, ns, cfg) for i in range(LAYERS)])
                except Exception as e:
                    say(f"{label}: failed: {type(e).__name__}: {str(e)[:160]}")
                    continue
                kern = ", ".join(f"{k}={v:.1f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1]))
                say(f"{label:40s} graph x{LAYERS} per step {tl8 * 1e6:.1f} us {nbytes / tl8 / 1e9:.0f} GB/s | "
                    f"kernels(us): {kern}")
            gen2 = torch.Generator().manual_seed(1)
            qq = torch.randn(1, 32, 1, 128, generator=gen2).to("cuda", torch.bfloat16)
            kv = [(torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16),
                   torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
            sd = [lambda kk=kk, vv=vv: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True) for kk, vv in kv]
            tl8 = bench_steps(sd)
            say(f"{'sdpa':40s} graph x{LAYERS} per step {tl8 * 1e6:.1f} us {nbytes / tl8 / 1e9:.0f} GB/s | "
                f"kernels(us): {', '.join(f'{k}={v:.1f}' for k, v in _kernel_us(sd[0]).items())}")
            del kv, sd
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

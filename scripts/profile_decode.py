"""Where a split decode step's GPU time goes: decode kernel vs split combine vs the gaps between them.

For each case this prints the CUDA-graph replay time of the whole step (as bench_decode.py) under a
few variants of the split combine (parts per step, programmatic dependent launch on/off), and the
per-kernel GPU durations from torch.profiler, so "step - kernels" is the launch gap a variant removes.

    PYTHONPATH=. python3 scripts/profile_decode.py [--out profile.txt]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import DC, DR, _bench, _bench_graph, _paged_from_contiguous  # noqa: E402


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


def _cases(gen):
    from mla_attn.ops.decode.triton_decode import gqa_decode, mla_decode

    dev, bf = "cuda", torch.bfloat16
    # GQA (1, 32/8, 32768), d 128
    lens = torch.full((1,), 32768, dtype=torch.int32, device=dev)
    k = torch.randn(1, 8, 32768, 128, generator=gen).to(dev, bf)
    v = torch.randn(1, 8, 32768, 128, generator=gen).to(dev, bf)
    q = torch.randn(1, 32, 1, 128, generator=gen).to(dev, bf)
    gqa_bytes = 32768 * 8 * 256 * 2
    yield "gqa B1 H32/8 L32768", gqa_bytes, lambda ns=None: gqa_decode(q, k, v, lens, None, 0.088, ns)
    for b, h, length in [(1, 128, 32768), (16, 128, 8192), (64, 16, 8192)]:
        lens_m = torch.full((b,), length, dtype=torch.int32, device=dev)
        buf = torch.randn(b, length, DC + DR, generator=gen).to(dev, bf)
        ql = torch.randn(b, h, 1, DC, generator=gen).to(dev, bf)
        qr = torch.randn(b, h, 1, DR, generator=gen).to(dev, bf)
        pool, table = _paged_from_contiguous(buf, gen)
        del buf
        nbytes = b * length * (DC + DR) * 2

        def fn(ns=None, ql=ql, qr=qr, pool=pool, table=table, lens_m=lens_m):
            return mla_decode(ql, qr, pool[..., :DC], pool[..., DC:], lens_m, table, 0.072, ns)

        yield f"mla B{b} H{h} L{length} paged64", nbytes, fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from mla_attn.ops.decode import combine, triton_decode

    gen = torch.Generator().manual_seed(0)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    variants = {  # name: (step_elements, max_chunk, target_programs, pdl)
        "base 4096/16": (4096, 16, 512, False),
        "pdl 4096/16": (4096, 16, 512, None),
        "8192/64": (8192, 64, 512, False),
        "pdl 8192/64": (8192, 64, 512, None),
        "pdl 8192/64 t1024": (8192, 64, 1024, None),
        "pdl 16384/64": (16384, 64, 512, None),
    }
    saved = (combine._STEP_ELEMENTS, combine._MAX_CHUNK, combine._TARGET_PROGRAMS, triton_decode.USE_PDL)
    for name, nbytes, fn in _cases(gen):
        ref = fn()[0].float()
        say(f"## {name}")
        for vname, (se, mc, tp, pdl) in variants.items():
            combine._STEP_ELEMENTS, combine._MAX_CHUNK, combine._TARGET_PROGRAMS = se, mc, tp
            combine._combine_tiles.cache_clear()
            triton_decode.USE_PDL = pdl
            try:
                out = fn()[0].float()
                err = (out - ref).abs().max().item()
                t = _bench(fn)
                tg = _bench_graph(fn)
                ks = _kernel_us(fn)
            except Exception as e:  # report, go on
                say(f"{vname:22s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            kern = ", ".join(f"{k}={v:.1f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1]))
            gs = "-" if tg is None else f"{tg * 1e6:.1f} us {nbytes / tg / 1e9:.0f} GB/s"
            say(f"{vname:22s} eager {t * 1e6:.1f} us | graph {gs} | max|diff| {err:.2e} | kernels(us): {kern}")
        combine._STEP_ELEMENTS, combine._MAX_CHUNK, combine._TARGET_PROGRAMS, triton_decode.USE_PDL = saved
        combine._combine_tiles.cache_clear()
        if name.startswith("gqa"):
            for ns in (8, 12, 16, 24, 32, 33, 48, 64):
                tg = _bench_graph(lambda ns=ns: fn(ns))
                say(f"splits {ns:3d} (default combine): graph "
                    f"{'-' if tg is None else f'{tg * 1e6:.1f} us {nbytes / tg / 1e9:.0f} GB/s'}")
        if name.startswith("mla B1 "):
            for ns in (16, 32, 48, 63, 96, 128):
                tg = _bench_graph(lambda ns=ns: fn(ns))
                say(f"splits {ns:3d} (default combine): graph "
                    f"{'-' if tg is None else f'{tg * 1e6:.1f} us {nbytes / tg / 1e9:.0f} GB/s'}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

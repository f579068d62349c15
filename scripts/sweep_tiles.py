"""Tile / variant sweep on the GPU: times each kernel under alternative configs so the tables in
triton_fwd.py, triton_bwd.py and triton_decode.py can be chosen from measurements.

    PYTHONPATH=. python3 scripts/sweep_tiles.py [--only attn|mla|gqa|gqa-batch|ab-gqa-paged|ab-gqa-splits] [--out sweep.json]

Every line printed is one measurement: kernel, shape, variant, median ms (triton.testing.do_bench),
and the rate. Decode variants are timed as CUDA-graph replays (GPU time, no host launch cost).
A config that fails to compile is printed as failed, not fatal.
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_decode's helpers

RESULTS: list[dict] = []


def _ms(fn):
    return do_bench(fn, warmup=25, rep=80, return_mode="median")


def _record(kind, shape, variant, fn, work, unit):
    try:
        ms = fn()
    except Exception as e:  # out of resources, an unsupported variant: report and go on
        print(f"{kind:10s} {shape:28s} {variant:40s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        RESULTS.append(dict(kind=kind, shape=shape, variant=variant, ms=None))
        return
    rate = work / (ms * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9)
    print(f"{kind:10s} {shape:28s} {variant:40s} {ms:8.4f} ms {rate:7.1f} {unit}", flush=True)
    RESULTS.append(dict(kind=kind, shape=shape, variant=variant, ms=ms, rate=rate, unit=unit))


def sweep_attn(args):
    from mla_attn.ops.attention.triton_bwd import flash_attn_bwd
    from mla_attn.ops.attention.triton_fwd import flash_attn_fwd

    rows = [(4, 32, 32, 4096, 128, 128), (2, 16, 16, 8192, 192, 128)]
    # One-warpgroup tiles (64, 64, 4, s) were tried on 2026-12-03 and lost (docs/benchmarks.md).
    fwd_cfgs = {128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3)],
                192: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3)]}
    dkdv_cfgs = {128: [(64, 128, 8, 3), (64, 64, 4, 3)], 192: [(64, 128, 8, 3)]}
    dq_cfgs = {128: [(128, 64, 8, 3), (128, 32, 4, 5), (64, 64, 4, 4), (128, 128, 8, 2)],
               192: [(128, 64, 8, 3), (128, 32, 4, 3)]}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for (b, hq, hkv, n, dqk, dv) in rows:
        q = torch.randn(b, hq, n, dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, n, dv, device="cuda", dtype=torch.bfloat16)
        scale = dqk ** -0.5
        flops = 2.0 * b * hq * n * n * (dqk + dv) / 2
        shape = f"{b}x{hq}/{hkv}x{n} d{dqk}/{dv}"
        o, lse = flash_attn_fwd(q, k, v, True, scale)
        do = torch.randn_like(o)
        for cfg in fwd_cfgs[dqk]:
            _record("fwd", shape, str(cfg), lambda: _ms(lambda: flash_attn_fwd(q, k, v, True, scale, config=cfg)),
                    flops, "TFLOP/s")
        _record("fwd", shape, "sdpa", lambda: _ms(lambda: sdpa(q, k, v, is_causal=True, scale=scale)), flops, "TFLOP/s")
        for cfg in dkdv_cfgs[dqk]:  # whole backward, dQ at its table entry
            _record("bwd-dkdv", shape, str(cfg),
                    lambda: _ms(lambda: flash_attn_bwd(do, q, k, v, o, lse, True, scale, dkdv_config=cfg)),
                    2.5 * flops, "TFLOP/s")
        for cfg in dq_cfgs[dqk]:  # whole backward, dK/dV at its table entry
            _record("bwd-dq", shape, str(cfg),
                    lambda: _ms(lambda: flash_attn_bwd(do, q, k, v, o, lse, True, scale, dq_config=cfg)),
                    2.5 * flops, "TFLOP/s")


def _graph_ms(fn):
    from bench_decode import capture_graph

    return _ms(capture_graph(fn).replay)


def sweep_mla(args):
    from bench_decode import _paged_from_contiguous, _varlen

    from mla_attn.ops.decode import triton_decode as td
    C = td.DecodeConfig
    shapes = [(128, 16, 4096), (64, 16, 8192), (1, 128, 32768), (16, 128, 8192), (64, 128, 4096)]
    # H = 128: the default (UNCHAIN, 32 keys, 4 stages) against the chained tiles it replaced and a
    # shallower UNCHAIN one; UNCHAIN at H = 16 lost on 2026-12-03 (docs/raw/sweep_2026-12-03_unchain.txt).
    cfgs = {16: [None, C(16, 32, 4, 4, 2), C(16, 32, 4, 3, 2), C(16, 64, 4, 3, 2), C(16, 64, 8, 3, 1)],
            128: [None, C(64, 64, 8, 2, unchain=False), C(64, 32, 8, 3, unchain=True)]}
    gen = torch.Generator().manual_seed(0)
    for b, h, length in shapes:
        seq_lens = _varlen(b, length, gen, "cuda")
        tokens = int(seq_lens.sum())
        buf = torch.randn(b, length, 576, generator=gen).to("cuda", torch.bfloat16)
        q4 = torch.randn(b, h, 1, 512, generator=gen).to("cuda", torch.bfloat16)
        qr4 = torch.randn(b, h, 1, 64, generator=gen).to("cuda", torch.bfloat16)
        pool, table = _paged_from_contiguous(buf, gen)
        scale = 192 ** -0.5
        nbytes = tokens * 576 * 2
        shape = f"B{b} H{h} L{length}"
        for cfg in cfgs[h]:
            name = "default" if cfg is None else (
                f"h{cfg.block_h}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}c{cfg.ctas_per_sm}u{cfg.unchain}")
            _record("mla", shape, f"paged64 {name}", lambda: _graph_ms(
                lambda: td.mla_decode(q4, qr4, pool[..., :512], pool[..., 512:], seq_lens, table, scale, None,
                                      config=cfg)), nbytes, "GB/s")
            if cfg is None:
                _record("mla", shape, f"contig {name}", lambda: _graph_ms(
                    lambda: td.mla_decode(q4, qr4, buf[..., :512], buf[..., 512:], seq_lens, None, scale, None)),
                    nbytes, "GB/s")


def sweep_gqa(args):
    from mla_attn.ops.decode import triton_decode as td
    C = td.DecodeConfig
    b, hq, hkv, length, d = 1, 32, 8, 32768, 128
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    nbytes = b * length * hkv * 2 * d * 2
    shape = f"B{b} {hq}/{hkv} L{length}"
    for cfg in [None, C(16, 128, 4, 3, 2), C(16, 64, 4, 4, 2), C(16, 128, 4, 4, 1), C(16, 64, 4, 3, 4),
                C(16, 128, 8, 3, 1), C(16, 32, 4, 4, 4)]:
        for splits in [None, 16, 32, 64]:
            name = ("default" if cfg is None else
                    f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}c{cfg.ctas_per_sm}") + f" splits={splits}"
            _record("gqa", shape, name, lambda: _graph_ms(
                lambda: td.gqa_decode(q, k, v, lens, None, d ** -0.5, splits, config=cfg)), nbytes, "GB/s")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _record("gqa", shape, "sdpa", lambda: _graph_ms(lambda: sdpa(q, k, v, enable_gqa=True)), nbytes, "GB/s")


def sweep_gqa_batch(args):
    """GQA at the benchmark's large batches (never swept before session 19): the default tile against
    shallower, narrower and two- or three-per-SM ones, contiguous and paged 64, with SDPA beside them."""
    from bench_decode import paged_kv

    from mla_attn.ops.decode import triton_decode as td
    C = td.DecodeConfig
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # ctas_per_sm: how many fit an SM by shared memory (sm_90a, compile_sm90.py decode --gqa: the default
    # 139 KB, 64 keys x 4 stages 104 KB, 64 x 3 72 KB, 128 x 2 74 KB, 32 x 4 54 KB, 32 x 6 87 KB), so
    # that the split heuristic sees the occupancy each tile really gets.
    cfgs = [None, C(16, 64, 4, 4, 2), C(16, 64, 4, 3, 3), C(16, 128, 4, 2, 3), C(16, 128, 8, 3, 1),
            C(16, 64, 8, 3, 3), C(16, 32, 4, 4, 4), C(16, 32, 4, 6, 2), C(16, 64, 4, 4, 1)]
    gen = torch.Generator().manual_seed(0)
    d = 128
    for b, hq, hkv, length in [(32, 32, 8, 8192), (128, 64, 8, 4096)]:
        torch.cuda.empty_cache()
        q = torch.randn(b, hq, 1, d, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(b, hkv, length, d, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn(b, hkv, length, d, generator=gen).to("cuda", torch.bfloat16)
        kp, vp, table = paged_kv(k, v, gen)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        nbytes = b * length * hkv * 2 * d * 2
        shape = f"B{b} {hq}/{hkv} L{length}"
        _record("gqa", shape, "sdpa", lambda: _graph_ms(lambda: sdpa(q, k, v, enable_gqa=True)), nbytes, "GB/s")
        for cfg in cfgs:
            name = "default" if cfg is None else f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}c{cfg.ctas_per_sm}"
            _record("gqa", shape, f"contig {name}", lambda: _graph_ms(
                lambda: td.gqa_decode(q, k, v, lens, None, d ** -0.5, None, config=cfg)), nbytes, "GB/s")
            _record("gqa", shape, f"paged64 {name}", lambda: _graph_ms(
                lambda: td.gqa_decode(q, kp, vp, lens, table, d ** -0.5, None, config=cfg)), nbytes, "GB/s")
        _record("gqa", shape, "sdpa (again)", lambda: _graph_ms(lambda: sdpa(q, k, v, enable_gqa=True)), nbytes,
                "GB/s")


def ab_gqa_paged(args):
    """The default GQA tile against 8 warps (128 keys, 3 stages: the gqa-batch sweep's best paged tile) on the
    large-batch shapes over pages of 64: three alternating rounds, each a lone graph and a step of an
    8-layer graph (8 cache copies)."""
    from bench_decode import _bench_layers, _paged_from_contiguous

    from mla_attn.ops.decode import triton_decode as td
    alt = td.DecodeConfig(16, 128, 8, 3, 1)
    gen = torch.Generator().manual_seed(1)
    d = 128
    for b, hq, hkv, length in [(128, 64, 8, 4096), (32, 32, 8, 8192)]:
        torch.cuda.empty_cache()
        q = torch.randn(b, hq, 1, d, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(b, length, hkv * d, generator=gen).to("cuda", torch.bfloat16)
        kp, table = _paged_from_contiguous(k, gen)
        kp = kp.view(-1, 64, hkv, d)
        vp = torch.randn_like(kp)
        del k
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        nbytes = b * length * hkv * 2 * d * 2
        shape = f"B{b} {hq}/{hkv} L{length} paged64"
        for r in range(3):
            for name, cfg in (("default", None), ("n128w8s3", alt)) if r % 2 == 0 else (("n128w8s3", alt),
                                                                                           ("default", None)):
                _record("gqa", shape, f"{name} round {r}", lambda: _graph_ms(
                    lambda: td.gqa_decode(q, kp, vp, lens, table, d ** -0.5, None, config=cfg)), nbytes, "GB/s")
                _record("gqa", shape, f"{name} round {r} 8-layer step", lambda: 1e3 * _bench_layers(
                    lambda: (lambda kk=kp.clone(), vv=vp.clone(): td.gqa_decode(q, kk, vv, lens, table, d ** -0.5,
                                                                                None, config=cfg)), 8), nbytes, "GB/s")


def ab_gqa_splits(args):
    """Large-batch GQA split more finely: the per-sequence split at 1 (the heuristic's choice once the batch
    fills a wave), 2, 3 and 4, and a two-per-SM tile at 1 and 2, against SDPA. The question: at B=32 a
    program streams 4 MB (two waves of 256 long programs), at B=128 1 MB (eight waves), and only B=32
    trails SDPA; shorter programs shrink the tail where too few SMs are left to keep DRAM busy.
    Two rounds in rotated order, each variant as a lone graph and as a step of an 8-layer graph."""
    from bench_decode import _bench_layers, paged_kv

    from mla_attn.ops.decode import triton_decode as td
    sdpa = torch.nn.functional.scaled_dot_product_attention
    two = td.DecodeConfig(16, 64, 4, 4, 2)
    variants = [("default s=auto", None, None), ("default s=2", None, 2), ("default s=3", None, 3),
                ("default s=4", None, 4), ("n64s4c2 s=auto", two, None), ("n64s4c2 s=2", two, 2)]
    gen = torch.Generator().manual_seed(2)
    d = 128
    for b, hq, hkv, length, paged in [(32, 32, 8, 8192, False), (32, 32, 8, 8192, True),
                                      (128, 64, 8, 4096, False)]:
        torch.cuda.empty_cache()
        q = torch.randn(b, hq, 1, d, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(b, hkv, length, d, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn(b, hkv, length, d, generator=gen).to("cuda", torch.bfloat16)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        table = None
        if paged:
            k, v, table = paged_kv(k, v, gen)
        nbytes = b * length * hkv * 2 * d * 2
        shape = f"B{b} {hq}/{hkv} L{length}" + (" paged64" if paged else "")
        runs = [(name, (lambda cfg=cfg, sp=sp, kk=k, vv=v: td.gqa_decode(q, kk, vv, lens, table, d ** -0.5, sp,
                                                                        config=cfg)),
                 (lambda cfg=cfg, sp=sp: (lambda kk=k.clone(), vv=v.clone(): td.gqa_decode(
                     q, kk, vv, lens, table, d ** -0.5, sp, config=cfg))))
                for name, cfg, sp in variants]
        if not paged:
            runs.append(("sdpa", lambda: sdpa(q, k, v, enable_gqa=True),
                         lambda: (lambda kk=k.clone(), vv=v.clone(): sdpa(q, kk, vv, enable_gqa=True))))
        for r in range(2):
            for name, fn, make in (runs if r == 0 else runs[::-1]):
                _record("gqa", shape, f"{name} round {r}", lambda: _graph_ms(fn), nbytes, "GB/s")
                _record("gqa", shape, f"{name} round {r} 8-layer step", lambda: 1e3 * _bench_layers(make, 8),
                        nbytes, "GB/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=["attn", "mla", "gqa", "gqa-batch", "ab-gqa-paged",
                                                             "ab-gqa-splits"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_tiles.py needs a CUDA GPU")
    t0 = time.time()
    for part in args.only or ["attn", "mla", "gqa"]:
        {"attn": sweep_attn, "mla": sweep_mla, "gqa": sweep_gqa, "gqa-batch": sweep_gqa_batch,
         "ab-gqa-paged": ab_gqa_paged, "ab-gqa-splits": ab_gqa_splits}[part](args)
        print(f"-- {part} done at {time.time() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()

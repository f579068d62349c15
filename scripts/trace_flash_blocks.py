"""Where a Gluon flash forward's time goes between and around its row blocks (H200 diagnostics).

The block-timeline build of ``gluon_fwd._flash_fwd_gluon`` (``block_trace=``; the normal build has no
stamps) makes every program write ``%globaltimer``, ``%clock64`` and ``%smid`` three times: at entry,
when its key loop is done and once its output is stored. From those this script prints, per case:

- the SM clock while the kernel runs (clock64 cycles per globaltimer ns, over each block);
- a least-squares line of a block's key-loop cycles against its key-tile count: the fixed cycles a
  block pays (prologue loads, first and last tiles that nothing overlaps) and the cycles a tile;
- the epilogue (normalise, store O and the LSE), and the gap between one block's end and the next
  block's start on the same SM (the launch of the next program);
- how the kernel's span splits into key-loop tiles, fixed cost, epilogue, gaps and the tail (SMs
  idle after their last block while others finish).

Each case runs the grid build and the two persistent work orders (experimental; their blocks are stamped
at the top of the work loop, so "gap" there is the loop's back edge).

    PYTHONPATH=. python3 scripts/trace_flash_blocks.py [OUT.txt]
"""

from __future__ import annotations

import statistics
import sys

import torch

from probe_mla_decode import _fit, _write  # the least-squares line; the report so far, rewritten after each case

CASES = [(4, 32, 32, 4096, 128, 128), (8, 32, 8, 2048, 128, 128), (2, 16, 16, 8192, 192, 128),
         (4, 128, 128, 2048, 192, 128)]


def block_tiles(pid_m: int, m: int, n: int, block_m: int, block_n: int, causal: bool) -> int:
    """Key tiles row block pid_m visits (the kernel's ``_block_tiles``)."""
    end = min(n, (pid_m + 1) * block_m + (n - m)) if causal else n
    return max(0, -(-end // block_n))


def analyse(x, n_mb: int, tiles_of) -> list[str]:
    """x: int64 [programs, 9] stamps in launch order (program = pid_bh * n_mb + grid pid_m; the causal
    kernel runs row block n_mb - 1 - grid pid_m); tiles_of(row block) -> key tiles. Returns report lines."""
    rows = []
    for i in range(x.shape[0]):
        ns0, c0, sm0, ns1, c1, sm1, ns2, c2, sm2 = (int(v) for v in x[i])
        if not (ns0 and ns2) or not (sm0 == sm1 == sm2):
            raise ValueError(f"program {i}: incomplete or migrated stamps {x[i].tolist()}")
        rows.append(dict(i=i, sm=sm0, ns0=ns0, ns2=ns2, c0=c0, c1=c1, c2=c2, tiles=tiles_of(i % n_mb)))
    ghz = statistics.median((r["c2"] - r["c0"]) / (r["ns2"] - r["ns0"]) for r in rows if r["ns2"] - r["ns0"] > 5000)
    xs = [r["tiles"] for r in rows]
    ys = [r["c1"] - r["c0"] for r in rows]
    n = len(xs)
    fixed, slope = _fit(xs, ys) if len(set(xs)) > 1 else (sum(ys) / n, 0.0)  # equal blocks: no slope to fit
    resid = statistics.pstdev(b - (fixed + slope * a) for a, b in zip(xs, ys))
    epi = [r["c2"] - r["c1"] for r in rows]
    by_sm: dict[int, list] = {}
    for r in rows:
        by_sm.setdefault(r["sm"], []).append(r)
    gaps, overlap = [], 0
    for blocks in by_sm.values():
        blocks.sort(key=lambda r: r["c0"])
        for a, b in zip(blocks, blocks[1:]):
            g = b["c0"] - a["c2"]
            if g < 0:
                overlap += 1  # two programs resident at once on this SM
            else:
                gaps.append(g)
    t0 = min(r["ns0"] for r in rows)
    t1 = max(r["ns2"] for r in rows)
    span = (t1 - t0) * ghz  # cycles
    sms = len(by_sm)
    total = span * sms
    tile_c = slope * sum(xs)
    fixed_c = fixed * n
    epi_c = sum(epi)
    gap_c = sum(gaps)
    tail_c = sum((t1 - max(r["ns2"] for r in b)) * ghz for b in by_sm.values())
    head_c = sum((min(r["ns0"] for r in b) - t0) * ghz for b in by_sm.values())
    other = total - tile_c - fixed_c - epi_c - gap_c - tail_c - head_c
    us = 1e-3 / ghz  # cycles -> us
    out = [f"  SM clock          {ghz:.3f} GHz (median over blocks); {sms} SMs, {n} blocks, "
           f"{n / sms:.1f} a SM; span {span * us:.1f} us",
           f"  key loop          {fixed:8.0f} + {slope:6.0f} x tiles cycles (residual sd {resid:.0f})",
           f"  epilogue          {statistics.median(epi):8.0f} cycles (median)",
           f"  gap to next block {statistics.median(gaps) if gaps else 0:8.0f} cycles (median)"
           + (f"; {overlap} back-to-back pairs overlapped" if overlap else ""),
           "  share of SM x span:"]
    for name, c in [("key tiles", tile_c), ("fixed per block", fixed_c), ("epilogue", epi_c),
                    ("gaps", gap_c), ("head (first start)", head_c), ("tail (after last end)", tail_c),
                    ("rest", other)]:
        out.append(f"    {name:22s} {100 * c / total:5.1f}%  ({c * us / sms:7.1f} us a SM)")
    return out


VARIANTS = [("grid", {"persistent": False, "s1_early": False}),
            ("persistent, static snake", {"persistent": True, "schedule": 1, "s1_early": False}),
            ("persistent, atomic counter", {"persistent": True, "schedule": 0, "s1_early": False}),
            ("grid, S_1 before tile 0's softmax", {"persistent": False, "s1_early": True}),
            ("persistent snake + S_1 early", {"persistent": True, "schedule": 1, "s1_early": True})]


def _run(b, h, hk, n, dqk, dv, lines, variants=VARIANTS):
    import triton

    from mla_attn.ops.attention import gluon_fwd

    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(b, h, n, dqk, generator=gen).to("cuda", dt)
    k = torch.randn(b, hk, n, dqk, generator=gen).to("cuda", dt)
    v = torch.randn(b, hk, n, dv, generator=gen).to("cuda", dt)
    block_m = 128
    n_mb = -(-n // block_m)
    bt = torch.zeros(n_mb * b * h, 9, dtype=torch.int64, device="cuda")
    scale = dqk ** -0.5
    flops = 2 * b * h * n * n * (dqk + dv) / 2
    bn = 64 if max(dqk, dv) <= 192 else 32
    lines.append(f"\n## B {b}, H {h}/{hk}, L {n}, D {dqk}/{dv}, causal")
    ref = None
    for name, kw in variants:
        def call(block_trace=None, kw=kw):
            return gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, block_m=block_m,
                                             block_trace=block_trace, **kw)[0]

        try:
            got = call()
            if ref is None:
                ref = got
            for _ in range(3):
                bt.zero_()
                got_t = call(bt)
            torch.cuda.synchronize()
            bad = max((got.float() - ref.float()).abs().max().item(), (got_t.float() - ref.float()).abs().max().item())
            if bad >= 1e-2:
                raise AssertionError(f"output differs from the grid build's by {bad:.3g}")
            t_plain = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
            t_bt = triton.testing.do_bench(lambda: call(bt), warmup=10, rep=50, return_mode="median")
            bt.zero_()
            call(bt)
            torch.cuda.synchronize()
        except Exception as e:  # report, go on with the next variant
            lines.append(f"### {name}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        lines.append(f"### {name}: normal build {t_plain * 1e3:.1f} us ({flops / t_plain / 1e9:.0f} TFLOP/s), "
                     f"block-timeline build {t_bt * 1e3:.1f} us ({flops / t_bt / 1e9:.0f})")
        lines += analyse(bt.cpu(), n_mb, lambda g: block_tiles(n_mb - 1 - g, n, n, block_m, bn, True))


def main(out):
    lines = [f"# Gluon flash forward, block timeline ({torch.cuda.get_device_name()})"]
    for case in CASES:
        _run(*case, lines)
        _write(out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "trace_flash_blocks.txt")

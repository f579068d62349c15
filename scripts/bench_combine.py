"""Split-KV combine alone, on the GPU: tile sweep per merge shape, partials cold (HBM) and hot (L2).

The merge shapes are the ones the decode benchmark's split cases produce (parts K, rows R = B * H * S,
Dv). For each, every (BLOCK_R, BLOCK_DV, CHUNK, num_warps) in a small grid is timed two ways:
cold (triton.testing.do_bench, which flushes L2 before each call) and hot (back-to-back calls, as
after the decode kernel that just wrote the partials). Two partial layouts: split-outer
[K, R, Dv] (what the decode kernel writes today) and split-inner [R, K, Dv] (a row's parts adjacent).

    PYTHONPATH=. python3 scripts/bench_combine.py [--out combine.txt] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_decode's graph capture

SHAPES = {  # name: (K, R, Dv)
    "mla B1 H128 (63 parts)": (63, 128, 512),
    "mla B16 H128 (4 parts)": (4, 2048, 512),
    "mla B64 H16 (2 parts)": (2, 1024, 512),
    "gqa B1 H32 (16 parts)": (16, 32, 128),
}


def _hot_us(fn, n=20, reps=10):
    """Per-call time of n calls back to back, replayed from one CUDA graph (no host launch cost, and no
    L2 flush between calls, unlike do_bench)."""
    from bench_decode import capture_graph

    g = capture_graph(lambda: [fn() for _ in range(n)])
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (n * reps)


def main():
    import triton

    from mla_attn.ops._common import cdiv
    from mla_attn.ops.decode import combine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="the current rule and a handful of tiles only")
    args = ap.parse_args()
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, r, dv) in SHAPES.items():
        lse_n = torch.randn(k, r, device="cuda", generator=gen) * 3
        o_n = torch.randn(k, r, dv, device="cuda", generator=gen)
        ref_w = torch.softmax(lse_n, 0)
        ref = (ref_w[..., None] * o_n).sum(0)
        layouts = {"outer": (o_n, lse_n),
                   "inner": (o_n.transpose(0, 1).contiguous().transpose(0, 1), lse_n.t().contiguous().t())}
        nbytes = k * r * (dv + 1) * 4 + r * dv * 2
        say(f"## {name}: K={k} R={r} Dv={dv}, {nbytes / 1e6:.1f} MB moved")
        rule = combine._combine_tiles(k, r, dv)
        grid_r = (1, 2, 4, 8, 16, 32)
        grid_dv = (64, 128, 256, 512) if dv >= 512 else (32, 64, 128)
        grid_c = tuple(c for c in (1, 2, 4, 8, 16, 32, 64) if c <= triton.next_power_of_2(k))
        cands = [rule] if args.quick else [rule] + [
            (br, bd, c, w) for br, bd, c, w in itertools.product(grid_r, grid_dv, grid_c, (4, 8))
            if 1024 <= br * bd * c <= 16384 and bd <= dv]
        results = []
        for lname, (o_p, l_p) in layouts.items():
            for br, bd, c, w in cands:
                o = torch.empty(r, dv, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(r, device="cuda")

                def fn(o_p=o_p, l_p=l_p, o=o, lse=lse, br=br, bd=bd, c=c, w=w):
                    combine._combine_kernel[(cdiv(r, br), cdiv(dv, bd))](
                        o_p, l_p, o, lse, k, r, *o_p.stride(), *l_p.stride(), *o.stride(), *lse.stride(),
                        DV=dv, BLOCK_R=br, BLOCK_DV=bd, CHUNK=c, num_warps=w)

                try:
                    fn()
                    err = (o.float() - ref).abs().max().item()
                    cold = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
                    hot = _hot_us(fn)
                except Exception as e:  # out of resources and the like: report, go on
                    say(f"{lname} {(br, bd, c, w)} failed: {type(e).__name__}: {str(e)[:100]}")
                    continue
                tag = " (current rule)" if (br, bd, c, w) == rule else ""
                results.append((hot, cold, lname, (br, bd, c, w), err, tag))
        results.sort()
        for hot, cold, lname, cfg, err, tag in results[:12] + [x for x in results[12:] if x[5]]:
            say(f"  {lname:5s} R,Dv,C,w={cfg!s:18s} hot {hot:6.1f} us ({nbytes / hot / 1e3:5.0f} GB/s)  "
                f"cold {cold:6.1f} us  err {err:.1e}{tag}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

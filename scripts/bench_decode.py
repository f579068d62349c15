"""Decode benchmark (bf16, CUDA): our Triton kernels vs the naive einsum absorbed MLA path vs SDPA (GQA),
paged (page 64 and page 1) vs contiguous caches.

Reports the median time (triton.testing.do_bench), GB/s of cache read and TFLOP/s, each also as a
fraction of the H200's measured copy bandwidth (4.25 TB/s) and bf16 matmul rate (687 TFLOP/s).
Bytes and FLOPs count the tokens actually attended (sum of seq_lens):
MLA bytes = sum(L) * (Dc + Dr) * 2, FLOPs = 2 * H * sum(L) * (Dc + Dr + Dc);
GQA bytes = sum(L) * Hkv * (D + Dv) * 2, FLOPs = 2 * Hq * sum(L) * (D + Dv).

    PYTHONPATH=. python3 scripts/bench_decode.py --out docs/bench_decode_latest.md [--sweep] [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

PEAK_BW = 4.25e12
PEAK_FLOPS = 687e12
DC, DR, PAGE = 512, 64, 64

MLA_SHAPES = [(1, 128, 32768), (16, 128, 8192), (64, 128, 4096), (128, 16, 4096), (64, 16, 8192), (128, 128, 8192)]
SWEEP_MLA = {(64, 128, 4096), (64, 16, 8192), (128, 16, 4096)}  # --sweep times alternative tiles on these
GQA_SHAPES = [(1, 32, 8, 32768), (32, 32, 8, 8192), (128, 64, 8, 4096)]


def _bench(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def _bench_b2b(fn, calls=200):
    """Wall seconds per call of ``calls`` eager calls issued back to back, no L2 flush between them: what
    a loop of eager decode steps sees, host time included. (``do_bench`` zeroes a 256 MB buffer before
    each call, and the host prepares the next call while that runs, so its eager time hides host work up
    to the flush's length.)"""
    from profile_launch import _host_and_wall_us  # scripts/ is on sys.path when this file runs as a script

    return _host_and_wall_us(fn, calls, 10)[1] * 1e-6


def capture_graph(fn):
    """``fn`` captured in a CUDA graph, after one warm-up call on a side stream (as PyTorch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _bench_graph(fn):
    """Median time of one replay of ``fn`` captured in a CUDA graph (no host launch cost), or None."""
    try:
        return _bench(capture_graph(fn).replay)
    except Exception as e:  # report, do not abort the table
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None


def bench_steps(fns):
    """Median time per step of the steps ``fns`` captured in one CUDA graph, in seconds."""
    return _bench(capture_graph(lambda: [f() for f in fns]).replay) / len(fns)


def _bench_layers(make, n):
    """Per-step time of n decode steps captured in one CUDA graph, each over its own copy of the cache
    (``make()`` clones one and returns the step), as the attention steps of n layers in a model's
    captured decode step: kernel time plus in-graph gaps, the graph's launch shared by n steps, and
    no step finding the previous step's cache in L2. None if it fails."""
    try:
        return bench_steps([make() for _ in range(n)])
    except Exception as e:  # out of memory, a failed capture: report, do not abort the table
        print(f"layered graph failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None
    finally:
        torch.cuda.empty_cache()


def _varlen(b, length, gen, device):
    """Lengths in [3L/4, L], the first one L (so B = 1 is exactly L)."""
    lens = torch.randint(3 * length // 4, length + 1, (b,), generator=gen)
    lens[0] = length
    return lens.to(torch.int32).to(device)


def _paged_from_contiguous(buf, gen, page=PAGE):
    """buf [B, N, W] -> (pool [B*N/P, P, W] with pages at a random permutation, block_table int32 [B, N/P])."""
    b, n, w = buf.shape
    pages = n // page
    perm = torch.randperm(b * pages, generator=gen).to(buf.device)
    pool = torch.empty(b * pages, page, w, dtype=buf.dtype, device=buf.device)
    pool[perm] = buf.reshape(b * pages, page, w)
    return pool, perm.view(b, pages).to(torch.int32)


def paged_kv(k, v, gen, page=PAGE):
    """GQA caches k, v [B, Hkv, L, D] -> (k_pool, v_pool [B*L/P, P, Hkv, D], block_table [B, L/P]): the same
    shuffled pages for both."""
    b, hkv, length, d = k.shape
    kp, table = _paged_from_contiguous(k.transpose(1, 2).reshape(b, length, hkv * d), gen, page=page)
    vp = torch.empty_like(kp)
    vp[table.view(-1).long()] = v.transpose(1, 2).reshape(b * length // page, page, hkv * d)
    return kp.view(-1, page, hkv, d), vp.view(-1, page, hkv, d), table


def _naive_mla(ql, qr, c, kr, seq_lens, scale):
    """The einsum absorbed path a model would write without a kernel: scores over the whole cache, masked."""
    s = torch.einsum("bhd,bnd->bhn", ql, c).float() + torch.einsum("bhd,bnd->bhn", qr, kr).float()
    n = c.shape[1]
    mask = torch.arange(n, device=c.device)[None, None, :] < seq_lens[:, None, None]
    p = torch.softmax((s * scale).masked_fill(~mask, float("-inf")), dim=-1).to(c.dtype)
    return torch.einsum("bhn,bnd->bhd", p, c)


def _with_decode_flag(fn, flag, value):
    """fn with ``triton_decode.<flag>`` set to value while it runs (and while a graph of it is captured)."""
    from mla_attn.ops.decode import triton_decode

    def run():
        saved = getattr(triton_decode, flag)
        setattr(triton_decode, flag, value)
        try:
            return fn()
        finally:
            setattr(triton_decode, flag, saved)

    return run


def _balanced(fn, on):
    """fn with the decode's balanced split forced on or off."""
    return _with_decode_flag(fn, "BALANCE", on)


def _switch_variants(cands, layered, names, flag, labels):
    """Add 'NAME <on label>' / 'NAME <off label>' rows (both the call and its 8-layer step) for each name, with
    ``triton_decode.<flag>`` forced on / off, in alternating order so that drift in the GPU's clocks does not favour
    one side."""
    for name in names:
        for i, on in enumerate((True, False, True, False)):
            tag = f"{name} {labels[0] if on else labels[1]} #{i // 2 + 1}"
            cands[tag] = _with_decode_flag(cands[name], flag, on)
            if name in layered:
                layered[tag] = (lambda mk=layered[name], on=on: _with_decode_flag(mk(), flag, on))


def _fused_variants(cands, layered, names):
    """'NAME fused' / 'NAME combine' rows: the fused merge (triton_decode.FUSED_MERGE) on and off."""
    _switch_variants(cands, layered, names, "FUSED_MERGE", ("fused", "combine"))


def _tail_variants(cands, layered, names):
    """'NAME tail' / 'NAME masked' rows: key masks on the partial last tile only (triton_decode.SPLIT_TAIL) or on
    every tile."""
    _switch_variants(cands, layered, names, "SPLIT_TAIL", ("tail", "masked"))


# --tail-pipe-variants: label -> (SPLIT_TAIL, TAIL_PIPELINED) forced
TAIL_PIPE_LABELS = {"pipe": (True, True), "regs": (True, False), "masked": (False, False)}


def _tail_pipe_variants(cands, layered, names):
    """'NAME pipe' / 'NAME regs' / 'NAME masked' rows, twice each in rotating order: SPLIT_TAIL forced on with its
    partial tile pipelined (triton_decode.TAIL_PIPELINED) or loaded through registers, and every tile masked
    (SPLIT_TAIL off). NAME's own row is the default rule. Each pipe / regs row is checked on its first call against
    NAME's output with every tile masked."""
    for name in names:
        ref = _with_decode_flags(cands[name], {"SPLIT_TAIL": False, "TAIL_PIPELINED": False})
        for i in range(2):
            for label, (split, pipe) in TAIL_PIPE_LABELS.items():
                tag = f"{name} {label} #{i + 1}"
                flags = {"SPLIT_TAIL": split, "TAIL_PIPELINED": pipe}
                fn = _with_decode_flags(cands[name], flags)
                cands[tag] = _checked_against(fn, ref) if split else fn
                if name in layered:
                    layered[tag] = (lambda mk=layered[name], f=flags: _with_decode_flags(mk(), f))


def _checked_against(fn, ref, atol=2e-2):
    """fn, whose first call also runs ref and raises RuntimeError where their first outputs differ by more than atol
    (bf16 outputs of the same attention: the variants differ only in how the cache is loaded)."""
    state = {"checked": False}

    def run():
        out = fn()
        if not state["checked"]:
            state["checked"] = True
            a, b = (x[0] if isinstance(x, tuple) else x for x in (out, ref()))
            err = (a.float() - b.float()).abs().max().item()
            if not err <= atol:
                raise RuntimeError(f"variant differs from its reference by {err:.3g} (> {atol})")
        return out

    return run


def _no_gluon(fn):
    """fn with the Gluon MLA kernel switched off."""
    return _with_decode_flag(fn, "GLUON_MLA", False)


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def bench_mla(args, gen, rows, configs=None):
    from mla_attn.ops.decode.triton_decode import mla_decode

    dev = "cuda"
    for b, h, length in MLA_SHAPES:
        if args.shapes and f"mla{b}x{h}" not in args.shapes.split(","):
            continue
        torch.cuda.empty_cache()
        seq_lens = _varlen(b, length, gen, dev)
        tokens = int(seq_lens.sum())
        buf = torch.randn(b, length, DC + DR, generator=gen).to(dev, torch.bfloat16)
        ql = torch.randn(b, h, DC, generator=gen).to(dev, torch.bfloat16)
        qr = torch.randn(b, h, DR, generator=gen).to(dev, torch.bfloat16)
        scale = (128 + 64) ** -0.5
        pool, table = _paged_from_contiguous(buf, gen)
        c, kr = buf[..., :DC], buf[..., DC:]
        pc, pkr = pool[..., :DC], pool[..., DC:]
        q4, qr4 = ql.unsqueeze(2), qr.unsqueeze(2)
        nbytes = tokens * (DC + DR) * 2
        flops = 2 * h * tokens * (DC + DR + DC)
        pool1, table1 = _paged_from_contiguous(buf, gen, page=1)  # page size 1: one table entry per token
        cands = {"triton": lambda: mla_decode(q4, qr4, c, kr, seq_lens, None, scale, None),
                 "triton-paged64": lambda: mla_decode(q4, qr4, pc, pkr, seq_lens, table, scale, None),
                 "triton-paged1": lambda: mla_decode(q4, qr4, pool1[..., :DC], pool1[..., DC:], seq_lens, table1,
                                                     scale, None)}
        layered = {"triton": lambda: (lambda bb=buf.clone(): mla_decode(q4, qr4, bb[..., :DC], bb[..., DC:], seq_lens,
                                                                        None, scale, None)),
                   "triton-paged64": lambda: (lambda pp=pool.clone(): mla_decode(q4, qr4, pp[..., :DC], pp[..., DC:],
                                                                                seq_lens, table, scale, None))}
        # On Hopper, H a multiple of 64: the op runs the Gluon kernel (ops/decode/gluon_mla.py) where it
        # takes the call; those rows are marked, and the Triton kernel is timed beside them.
        from mla_attn.ops.decode import triton_decode as td

        if td._gluon_mla_takes(q4, qr4, c, kr, None, None):
            for name in ("triton", "triton-paged64"):
                cands[f"{name} [gluon]"] = cands.pop(name)
                layered[f"{name} [gluon]"] = layered[name]
                cands[f"{name} [triton kernel]"] = _no_gluon(cands[f"{name} [gluon]"])
                layered[f"{name} [triton kernel]"] = (lambda mk=layered.pop(name): _no_gluon(mk()))
            if td._gluon_mla_takes(q4, qr4, pool1[..., :DC], pool1[..., DC:], table1, None):  # SMALL_PAGES
                cands["triton-paged1 [gluon]"] = cands.pop("triton-paged1")
                cands["triton-paged1 [triton kernel]"] = _no_gluon(cands["triton-paged1 [gluon]"])
            else:
                cands["triton-paged1"] = cands.pop("triton-paged1")  # keep the table's order
        if args.balance_variants:
            for name in [k for k in cands if k.startswith("triton") and "paged1" not in k]:
                for on in (True, False):
                    cands[f"{name} {'balanced' if on else 'per-seq'}"] = _balanced(cands[name], on)
        if args.fused_variants and h <= 16:
            _fused_variants(cands, layered, ["triton", "triton-paged64"])
        triton_rows = [k for k in ("triton", "triton-paged64", "triton-paged1", "triton [triton kernel]",
                                   "triton-paged64 [triton kernel]") if k in cands]
        if args.tail_variants:  # the Triton kernel's rows only (SPLIT_TAIL does not reach the Gluon kernel)
            _tail_variants(cands, layered, triton_rows)
        if args.tail_pipe_variants:
            _tail_pipe_variants(cands, layered, triton_rows)
        if configs and (b, h, length) in SWEEP_MLA:
            for name, cfg in configs(h).items():
                cands[f"paged64 {name}"] = (lambda cfg=cfg: mla_decode(q4, qr4, pc, pkr, seq_lens, table, scale, None,
                                                                      config=cfg))
        if b * h * length <= 64 * 128 * 8192:  # the naive path materialises [B, H, L] fp32 scores
            cands["einsum"] = lambda: _naive_mla(ql, qr, c, kr, seq_lens, scale)
        for name, fn in cands.items():
            try:
                t = _bench(fn)
                tb = _bench_b2b(fn)
                tg = _bench_graph(fn) if args.graph else None
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"MLA B={b} H={h} L={length} {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tl_ = _bench_layers(layered[name], args.layers) if args.graph and args.layers and name in layered else None
            rows.append(dict(op="mla", impl=name, B=b, H=h, L=length, tokens=tokens, us=t * 1e6,
                             gbs=nbytes / t / 1e9, tflops=flops / t / 1e12,
                             graph_us=None if tg is None else tg * 1e6,
                             graph_gbs=None if tg is None else nbytes / tg / 1e9,
                             layers_us=None if tl_ is None else tl_ * 1e6,
                             layers_gbs=None if tl_ is None else nbytes / tl_ / 1e9, b2b_us=tb * 1e6))
            print(_row_md(rows[-1]), flush=True)


def bench_gqa(args, gen, rows, configs=None):
    from mla_attn.ops.decode.triton_decode import gqa_decode

    dev, d = "cuda", 128
    for b, hq, hkv, length in GQA_SHAPES:
        if args.shapes and f"gqa{b}" not in args.shapes.split(","):
            continue
        torch.cuda.empty_cache()
        seq_lens = torch.full((b,), length, dtype=torch.int32, device=dev)  # SDPA has no varlen decode
        tokens = b * length
        q = torch.randn(b, hq, 1, d, generator=gen).to(dev, torch.bfloat16)
        k = torch.randn(b, hkv, length, d, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(b, hkv, length, d, generator=gen).to(dev, torch.bfloat16)
        kp, vp, table = paged_kv(k, v, gen)
        kp1, vp1, table1 = paged_kv(k, v, gen, page=1)
        nbytes = tokens * hkv * 2 * d * 2
        flops = 2 * hq * tokens * 2 * d
        cands = {"triton": lambda: gqa_decode(q, k, v, seq_lens, None, d ** -0.5, None),
                 "triton-paged64": lambda: gqa_decode(q, kp, vp, seq_lens, table, d ** -0.5, None),
                 "triton-paged1": lambda: gqa_decode(q, kp1, vp1, seq_lens, table1, d ** -0.5, None),
                 "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        layered = {"triton": lambda: (lambda kk=k.clone(), vv=v.clone(): gqa_decode(q, kk, vv, seq_lens, None,
                                                                                   d ** -0.5, None)),
                   "triton-paged64": lambda: (lambda kk=kp.clone(), vv=vp.clone(): gqa_decode(q, kk, vv, seq_lens, table,
                                                                                           d ** -0.5, None)),
                   "sdpa": lambda: (lambda kk=k.clone(), vv=v.clone(): F.scaled_dot_product_attention(q, kk, vv,
                                                                                                    enable_gqa=True))}
        if args.balance_variants:
            for name in ("triton", "triton-paged64"):
                for on in (True, False):
                    cands[f"{name} {'balanced' if on else 'per-seq'}"] = _balanced(cands[name], on)
        if args.fused_variants:
            _fused_variants(cands, layered, ["triton", "triton-paged64"])
        if args.tail_variants:
            _tail_variants(cands, layered, ["triton", "triton-paged64", "triton-paged1"])
        if args.tail_pipe_variants:
            _tail_pipe_variants(cands, layered, ["triton", "triton-paged64", "triton-paged1"])
        if configs:
            for name, cfg in configs(hq // hkv).items():
                cands[f"contig {name}"] = lambda cfg=cfg: gqa_decode(q, k, v, seq_lens, None, d ** -0.5, None,
                                                                     config=cfg)
        for name, fn in cands.items():
            try:
                t = _bench(fn)
                tb = _bench_b2b(fn)
                tg = _bench_graph(fn) if args.graph else None
            except Exception as e:
                print(f"GQA B={b} {hq}/{hkv} L={length} {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tl_ = _bench_layers(layered[name], args.layers) if args.graph and args.layers and name in layered else None
            rows.append(dict(op="gqa", impl=name, B=b, H=f"{hq}/{hkv}", L=length, tokens=tokens, us=t * 1e6,
                             gbs=nbytes / t / 1e9, tflops=flops / t / 1e12,
                             graph_us=None if tg is None else tg * 1e6,
                             graph_gbs=None if tg is None else nbytes / tg / 1e9,
                             layers_us=None if tl_ is None else tl_ * 1e6,
                             layers_gbs=None if tl_ is None else nbytes / tl_ / 1e9, b2b_us=tb * 1e6))
            print(_row_md(rows[-1]), flush=True)


def _row_md(r):
    return (f"| {r['op']} | {r['impl']} | {r['B']} | {r['H']} | {r['L']} | {r['us']:.1f} | {r['gbs']:.0f} | "
            f"{r['gbs'] * 1e9 / PEAK_BW:.2f} | {r['tflops']:.1f} | {r['tflops'] * 1e12 / PEAK_FLOPS:.2f} | "
            f"{_fmt(r.get('graph_us'))} | {_fmt(r.get('graph_gbs'), 0)} | {_fmt(r.get('layers_us'))} | "
            f"{_fmt(r.get('layers_gbs'), 0)} | {_fmt(r.get('b2b_us'))} |")


HEADER = ("| op | impl | B | H | L | time (us) | GB/s | of 4.25 TB/s | TFLOP/s | of 687 | graph (us) | graph GB/s "
          "| step in 8-layer graph (us) | 8-layer GB/s | eager back to back (us) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _sweep_configs_mla(h):
    from mla_attn.ops.decode.triton_decode import DecodeConfig as C

    if h >= 64:
        return {"h64n64w8s1": C(64, 64, 8, 1), "h64n32w8s2": C(64, 32, 8, 2)}
    return {"h16n64w4s3c1": C(16, 64, 4, 3, 1), "h16n32w8s4c2": C(16, 32, 8, 4, 2), "h16n64w4s2c2": C(16, 64, 4, 2, 2),
            "h16n16w4s6c2": C(16, 16, 4, 6, 2)}


def _sweep_configs_gqa(group):
    from mla_attn.ops.decode.triton_decode import DecodeConfig as C

    return {"n64w4s4c2": C(16, 64, 4, 4, 2), "n128w4s3c2": C(16, 128, 4, 3, 2)}


def bench_gluon_mla(out):
    """The Gluon MLA decode kernel (ops/decode/gluon_mla.py) called directly on a contiguous cache (unsplit
    where the batch fills the GPU, else the heuristic's splits), and its experimental S-once schedule,
    against the Triton kernel: graph replays, each checked against the Triton output first."""
    from mla_attn.ops import decode as decode_ops
    from mla_attn.ops.decode import gluon_mla

    gen = torch.Generator().manual_seed(0)
    lines = ["| B | H | L | Triton us | Triton TF/s | Gluon, scores twice us | TF/s | max abs diff | Gluon, S once us | TF/s |"
             " max abs diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, h, length in [(64, 128, 4096), (16, 128, 8192), (1, 128, 32768), (128, 128, 8192)]:
        seq_lens = _varlen(b, length, gen, "cuda")
        buf = torch.randn(b, length, 576, generator=gen).to("cuda", torch.bfloat16)
        ql = torch.randn(b, h, 512, generator=gen).to("cuda", torch.bfloat16)
        qr = torch.randn(b, h, 64, generator=gen).to("cuda", torch.bfloat16)
        scale = 192 ** -0.5
        flops = 2.0 * h * int(seq_lens.sum()) * (576 + 512)

        @_no_gluon
        def tri():
            return decode_ops.mla_decode(ql, qr, buf[..., :512], buf[..., 512:], seq_lens, scale=scale, impl="triton")

        splits = None if b * h // 64 < 66 else 1  # B = 16: the heuristic's splits

        def glu():
            return gluon_mla.mla_decode_ws(ql, qr, buf, seq_lens, scale, num_splits=splits, s_once=False)[0]

        def once():  # the default schedule: each score tile computed once
            return gluon_mla.mla_decode_ws(ql, qr, buf, seq_lens, scale, num_splits=splits, s_once=True)[0]

        try:
            ref = tri().float()
            err = (glu().float() - ref).abs().max().item()
            t_t, t_g = _bench_graph(tri), _bench_graph(glu)
            g = f"{t_g * 1e6:.1f} | {flops / t_g / 1e12:.0f}" if err < 0.05 else "wrong | -"
            try:
                if os.environ.get("MLA_ATTN_BENCH_S_ONCE", "1") == "0":  # the tests failed: do not time it
                    raise RuntimeError("skipped (MLA_ATTN_BENCH_S_ONCE=0)")
                err1 = (once().float() - ref).abs().max().item()
                t_1 = _bench_graph(once)
                g1 = f"{t_1 * 1e6:.1f} | {flops / t_1 / 1e12:.0f} | {err1:.1e}" if err1 < 0.05 else f"wrong | - | {err1:.1e}"
            except Exception as e:  # report, go on
                g1 = f"failed: {type(e).__name__}: {str(e)[:80]} | |"
            lines.append(f"| {b} | {h} | {length} | {t_t * 1e6:.1f} | {flops / t_t / 1e12:.0f} | {g} | {err:.1e} | {g1} |")
        except Exception as e:  # report, go on
            lines.append(f"| {b} | {h} | {length} | failed: {type(e).__name__}: {str(e)[:120]} | | | | |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


ODD_SHAPES = [(1, 32, 8, 32768), (32, 32, 8, 8192)]  # GQA (B, Hq, Hkv, L)
ODD_WIDTHS = (72, 80, 96, 128, 160)
ODD_VARIANTS = {  # name -> triton_decode flags
    "split": {"HEAD_SPLIT": True, "SPLIT_MAX_FILL": 1.0},  # strides in units, the head split wherever it narrows
    "padded": {"HEAD_SPLIT": False},  # strides in units, the head padded to its power of two
    "before": {"STRIDE_UNITS": False, "HEAD_SPLIT": False},  # strides as they are, head padded
}


def _with_decode_flags(fn, flags):
    for flag, value in flags.items():
        fn = _with_decode_flag(fn, flag, value)
    return fn


def _gqa_width_inputs(b, hq, hkv, length, d, gen):
    """bf16 GQA decode inputs at every length L, contiguous and paged 64, and the bytes of K and V read."""
    torch.cuda.empty_cache()
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, 1, d, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(b, hkv, length, d, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(b, hkv, length, d, generator=gen).to("cuda", torch.bfloat16)
    kp, vp, table = paged_kv(k, v, gen)
    return seq_lens, q, k, v, kp, vp, table, b * length * hkv * 2 * d * 2


def bench_odd_widths(out, shapes=None):
    """GQA decode at head widths 72, 80, 96, 160 (and 128 for reference) against SDPA, contiguous and paged 64: strides
    in units of their power of two (triton_decode._stride_unit) with the head split 64 + 16 / 64 + 32 / 128 + 32
    (_head_split, wherever it narrows the tile) and with the head padded ('default' names the one gqa_decode takes
    by default), and as before both (strides as they are, head padded). CUDA-graph replays (GPU time,
    no host), the variants in two rotated rounds (mean of the two medians); GB/s of K and V read."""
    from mla_attn.ops.decode import triton_decode
    from mla_attn.ops.decode.triton_decode import gqa_decode

    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton
    names = list(ODD_VARIANTS)
    lines = [f"GPU {props.name}, torch {torch.__version__}, triton {triton.__version__}; bf16, one new token, all "
             "lengths L; CUDA-graph replay medians (do_bench), the variants in two rotated rounds (mean of the "
             "two); GB/s of K and V read (B * L * Hkv * 2d * 2 bytes), and split's as a fraction of "
             f"{PEAK_BW / 1e12:.2f} TB/s. 'split': strides in units, head split (its score tiles in 'tiles'); "
             "'padded': strides in units, head padded to its power of two; 'before': strides as they are, head "
             "padded; 'default': which of split / padded gqa_decode takes by default.", "",
             "| B | Hq/Hkv | L | d | cache | unit | tiles | default | " + " | ".join(f"{n} GB/s" for n in names)
             + " | SDPA GB/s | split / SDPA | padded / SDPA | split / padded |",
             "|---|---|---|---|---|---|---|---|" + "---|" * (len(names) + 3)]
    print("\n".join(lines), flush=True)
    for b, hq, hkv, length in ODD_SHAPES:
        if shapes and f"gqa{b}" not in shapes.split(","):
            continue
        for d in ODD_WIDTHS:
            seq_lens, q, k, v, kp, vp, table, nbytes = _gqa_width_inputs(b, hq, hkv, length, d, gen)
            sdpa = _bench_graph(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            for cache, kk, vv, tt in (("contiguous", k, v, None), ("paged 64", kp, vp, table)):
                unit = triton_decode._stride_unit(q.stride(), kk.stride(), vv.stride())
                tiles = _with_decode_flags(lambda: triton_decode._head_split(d, q, kk, vv), ODD_VARIANTS["split"])()
                default = "split" if triton_decode._head_split(d, q, kk, vv)[1] else "padded"
                call = (lambda kk=kk, vv=vv, tt=tt: gqa_decode(q, kk, vv, seq_lens, tt, d ** -0.5, None))
                times = {n: [] for n in names}
                for r in range(2):
                    for n in names[r:] + names[:r]:
                        t = _bench_graph(_with_decode_flags(call, ODD_VARIANTS[n]))
                        if t is not None:
                            times[n].append(t)
                gbs = {n: (nbytes / (sum(ts) / len(ts)) / 1e9 if ts else None) for n, ts in times.items()}
                sd = None if sdpa is None else nbytes / sdpa / 1e9
                sp, pa = gbs["split"], gbs["padded"]

                def ratio(x, y):
                    return _fmt(None if x is None or not y else x / y, 2)

                lines.append(f"| {b} | {hq}/{hkv} | {length} | {d} | {cache} | {unit} | {tiles[0]}+{tiles[1]} | {default} | "
                             f"{_fmt(sp, 0)} ({_fmt(None if sp is None else sp * 1e9 / PEAK_BW, 2)}) | "
                             + " | ".join(_fmt(gbs[n], 0) for n in names[1:])
                             + f" | {_fmt(sd, 0)} | {ratio(sp, sd)} | {ratio(pa, sd)} | {ratio(sp, pa)} |")
                print(lines[-1], flush=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def bench_paged_stages(out, shapes=None):
    """GQA decode over pages of 64 keys at d 72 / 80 / 128: the default (a page of 64 becomes the tile, so each
    stage holds half the keys of a contiguous one: 20-23 KB at d 72 / 80, 32 KB at d 128), with 4 stages, and with
    the 128-key tile across pages (triton_decode.PAGE_SPAN: a page looked up per key), 3 and 4 stages; against the
    contiguous cache and SDPA. CUDA-graph replays, the variants in two rotated rounds (mean), GB/s of K and V read.
    Session 31 (H100, 70d0f27) timed 3-6 stages without the span: 4 gained 3-4% at B 1, lost 3% at B 32."""
    from mla_attn.ops.decode import triton_decode
    from mla_attn.ops.decode.triton_decode import gqa_decode

    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton
    names = ["default", "4 stages", "span", "span 4 stages"]
    lines = [f"GPU {props.name}, torch {torch.__version__}, triton {triton.__version__}; bf16, one new token, all "
             "lengths L; CUDA-graph replay medians (do_bench), the variants in two rotated rounds (mean); GB/s of K "
             "and V read. Paged 64 with the default config ('default'), its stage count replaced, and the tile "
             "across pages (PAGE_SPAN).", "",
             "| B | Hq/Hkv | L | d | default config | contiguous | " + " | ".join(f"paged {n}" for n in names)
             + " | SDPA |", "|---|---|---|---|---|---|" + "---|" * (len(names) + 1)]
    print("\n".join(lines), flush=True)
    for b, hq, hkv, length in ODD_SHAPES:
        if shapes and f"gqa{b}" not in shapes.split(","):
            continue
        for d in (72, 80, 128):
            seq_lens, q, k, v, kp, vp, table, nbytes = _gqa_width_inputs(b, hq, hkv, length, d, gen)
            base = triton_decode.default_config(hq // hkv, d, d, q.dtype, mla=False, device=q.device)
            if triton_decode._paged_gqa_wide(False, True, PAGE, base, b * hkv, q.device):
                base = dataclasses.replace(base, num_warps=8)
            four = dataclasses.replace(base, num_stages=4)

            def call(cfg=None):
                return gqa_decode(q, kp, vp, seq_lens, table, d ** -0.5, None, config=cfg)
            calls = {"default": call, "4 stages": lambda: call(four),
                     "span": _with_decode_flag(call, "PAGE_SPAN", True),
                     "span 4 stages": _with_decode_flag(lambda: call(four), "PAGE_SPAN", True)}
            times = {n: [] for n in names}
            for r in range(2):
                for n in names[r:] + names[:r]:
                    try:
                        t = _bench_graph(calls[n])
                    except Exception as e:  # a stage count that does not fit: report, go on
                        print(f"{n}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                        t = None
                    if t is not None:
                        times[n].append(t)
            gbs = {n: (nbytes / (sum(ts) / len(ts)) / 1e9 if ts else None) for n, ts in times.items()}
            cont = _bench_graph(lambda: gqa_decode(q, k, v, seq_lens, None, d ** -0.5, None))
            sdpa = _bench_graph(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            lines.append(f"| {b} | {hq}/{hkv} | {length} | {d} | {base.block_h}x{base.block_n}, {base.num_warps}w "
                         f"{base.num_stages}s | {_fmt(None if cont is None else nbytes / cont / 1e9, 0)} | "
                         + " | ".join(_fmt(gbs[n], 0) for n in names)
                         + f" | {_fmt(None if sdpa is None else nbytes / sdpa / 1e9, 0)} |")
            print(lines[-1], flush=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown path; a .json with the same stem is written beside it")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--graph", action="store_true",
                    help="also time each call replayed from a CUDA graph (GPU time without host launch overhead)")
    ap.add_argument("--only", choices=["mla", "gqa"], default=None)
    ap.add_argument("--layers", type=int, default=8,
                    help="with --graph: also time N steps over N cache copies in one graph, per step (0: off)")
    ap.add_argument("--balance-variants", action="store_true",
                    help="also time the contiguous and paged-64 calls with the balanced split forced on and off")
    ap.add_argument("--fused-variants", action="store_true",
                    help="also time GQA and MLA H <= 16 with the fused merge forced on and off "
                         "(twice each, alternating)")
    ap.add_argument("--tail-variants", action="store_true",
                    help="also time the Triton kernel's rows with key masks on the partial last tile only "
                         "(triton_decode.SPLIT_TAIL) and on every tile (twice each, alternating)")
    ap.add_argument("--tail-pipe-variants", action="store_true",
                    help="also time the Triton kernel's rows with SPLIT_TAIL on, its partial tile pipelined "
                         "(triton_decode.TAIL_PIPELINED) and through registers, and with every tile masked (twice "
                         "each, in rotation; the first two checked against the masked output first)")
    ap.add_argument("--shapes", default=None,
                    help="only these rows, e.g. 'gqa1,mla64x16' (gqaB: GQA batch B; mlaBxH: MLA batch B, H heads)")
    ap.add_argument("--gluon-mla", metavar="OUT", help="only: time the Gluon MLA decode kernel (both schedules, direct calls) against the Triton kernel")
    ap.add_argument("--odd-widths", metavar="OUT", help="only: GQA decode at d 72 / 80 / 96 / 160 (128 for reference) "
                    "with stride units and the head split on and off, against SDPA")
    ap.add_argument("--paged-stages", metavar="OUT", help="only: GQA decode over pages of 64 at d 72 / 80 / 128 "
                    "with 3 / 4 stages and the tile across pages (PAGE_SPAN), against contiguous and SDPA")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU")
    if args.paged_stages:
        bench_paged_stages(args.paged_stages, args.shapes)
        return
    if args.odd_widths:
        bench_odd_widths(args.odd_widths, args.shapes)
        return
    if args.gluon_mla:
        bench_gluon_mla(args.gluon_mla)
        return
    import triton

    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    print(HEADER, flush=True)
    t0 = time.time()
    if args.only in (None, "mla"):
        bench_mla(args, gen, rows, _sweep_configs_mla if args.sweep else None)
    if args.only in (None, "gqa"):
        bench_gqa(args, gen, rows, _sweep_configs_gqa if args.sweep else None)
    props = torch.cuda.get_device_properties(0)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=props.name, sms=props.multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, seconds=round(time.time() - t0, 1))
    text = (f"# Decode benchmark ({meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})\n\n"
            "bf16, Dc=512, Dr=64 (MLA; varlen lengths in [3L/4, L], bytes/FLOPs from the actual lengths), "
            "d=128 (GQA, all lengths L); page size 64 with a shuffled block table; "
            "triton.testing.do_bench median of eager calls (its L2 flush before each call hides host time up to "
            "the flush's length); 'eager back to back': wall time per call of 200 eager calls in a row, host "
            "time included (what a loop of eager steps sees); 'graph' columns: "
            "the same call replayed from a CUDA graph, as a serving engine runs a decode step; '8-layer' columns: "
            "8 such steps over 8 copies of the cache in one graph, per step (a model's layers: the graph's launch "
            "is shared, no step finds its cache in L2).\n\n" + HEADER + "\n" + "\n".join(_row_md(r) for r in rows) + "\n")
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark: Triton flash attention vs torch SDPA, causal, bf16, forward and forward+backward.

    PYTHONPATH=. python scripts/bench_attention.py --out docs/bench_attention_latest.md [--sweep]

FLOPs (as FlashAttention counts them): forward = 2 * B * Hq * M * N * (Dqk + Dv), halved for causal;
forward+backward = 3.5 x forward (the backward counted as 2.5 x forward). Times are medians of
triton.testing.do_bench. "extra MiB" is the peak memory of one forward+backward above the inputs, dO
and the three gradients. For GQA rows SDPA gets enable_gqa=True when this torch has it, else the KV
heads are repeated before the call (the table says which).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import mla_attn
from mla_attn.ops.attention.reference import SDPA_GQA
from mla_attn.ops.attention.triton_bwd import flash_attn_bwd
from mla_attn.ops.attention.triton_fwd import flash_attn_fwd

ROWS = [  # B, Hq, Hkv, L, Dqk, Dv
    (4, 32, 32, 4096, 128, 128),
    (2, 16, 16, 8192, 192, 128),
    (4, 128, 128, 2048, 192, 128),
    (8, 32, 8, 2048, 128, 128),
]
HAS_GQA = SDPA_GQA  # this torch's SDPA takes enable_gqa (the package's probe)


def _inputs(b, hq, hkv, n, dqk, dv, grad=False):
    q = torch.randn(b, hq, n, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(b, hkv, n, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(b, hkv, n, dv, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    return q, k, v


def _sdpa(q, k, v, scale):
    if q.shape[1] != k.shape[1]:
        if HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _ours(q, k, v, scale):
    return mla_attn.ops.attention(q, k, v, causal=True, scale=scale, impl="triton")


def _ms(fn, grads=None):
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def _ms_pair(fa, fb, grads=None):
    """Medians of fa and fb timed A B B A, each the mean of its two runs. The GPU's clock drifts within a
    run (the H200's SDPA forward read 528 TFLOP/s timed after ours and 565-607 timed first, same shape),
    so timing one side always first biases the ratio; this order cancels a linear drift."""
    a1, b1, b2, a2 = _ms(fa, grads), _ms(fb, grads), _ms(fb, grads), _ms(fa, grads)
    return (a1 + a2) / 2, (b1 + b2) / 2


def _rotated_medians(cands: dict, rounds: int, grads=None) -> dict:
    """Median ms of each candidate over ``rounds`` rounds, every candidate once a round, the order rotated each
    round (so no candidate always runs first, or just after the same one)."""
    names = list(cands)
    times = {nm: [] for nm in names}
    for r in range(rounds):
        for nm in names[r % len(names):] + names[:r % len(names)]:
            times[nm].append(_ms(cands[nm], grads))
    return {nm: sorted(ts)[len(ts) // 2] for nm, ts in times.items()}


def _no_side(fn):
    """fn() with the backward's side-stream dQ switched off for the call."""
    from mla_attn.ops.attention import triton_bwd

    old, triton_bwd.SIDE_STREAM_DQ = triton_bwd.SIDE_STREAM_DQ, False
    try:
        return fn()
    finally:
        triton_bwd.SIDE_STREAM_DQ = old


def _extra_mib(fn, q, k, v, do):
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn().backward(do)
    torch.cuda.synchronize()
    grads = sum(t.numel() * t.element_size() for t in (q, k, v))
    return (torch.cuda.max_memory_allocated() - base - grads) / 2**20


def bench_row(b, hq, hkv, n, dqk, dv):
    scale = dqk ** -0.5
    fwd_flops = 2.0 * b * hq * n * n * (dqk + dv) / 2
    res = {}
    with torch.no_grad():
        q, k, v = _inputs(b, hq, hkv, n, dqk, dv)
        res["fwd_ours"], res["fwd_sdpa"] = _ms_pair(lambda: _ours(q, k, v, scale), lambda: _sdpa(q, k, v, scale))
    q, k, v = _inputs(b, hq, hkv, n, dqk, dv, grad=True)
    # The forward as a training step runs it: grad mode, inputs that need grad (SDPA may pick a different
    # kernel than under no_grad; ours runs the same one).
    res["fwdg_ours"], res["fwdg_sdpa"] = _ms_pair(lambda: _ours(q, k, v, scale), lambda: _sdpa(q, k, v, scale))
    do = torch.randn(b, hq, n, dv, device="cuda", dtype=torch.bfloat16)
    res["fb_ours"], res["fb_sdpa"] = _ms_pair(lambda: _ours(q, k, v, scale).backward(do),
                                              lambda: _sdpa(q, k, v, scale).backward(do), [q, k, v])
    res["mem_ours"] = _extra_mib(lambda: _ours(q, k, v, scale), q, k, v, do)
    res["mem_sdpa"] = _extra_mib(lambda: _sdpa(q, k, v, scale), q, k, v, do)
    tf = lambda ms, mult: mult * fwd_flops / (ms * 1e-3) / 1e12  # noqa: E731
    res["tf_fwd_ours"], res["tf_fwd_sdpa"] = tf(res["fwd_ours"], 1.0), tf(res["fwd_sdpa"], 1.0)
    res["tf_fwdg_ours"], res["tf_fwdg_sdpa"] = tf(res["fwdg_ours"], 1.0), tf(res["fwdg_sdpa"], 1.0)
    res["tf_fb_ours"], res["tf_fb_sdpa"] = tf(res["fb_ours"], 3.5), tf(res["fb_sdpa"], 3.5)
    return res


def sweep():
    """Time a few tile configs per kernel at the two head-width classes; prints a table per kernel."""
    fwd_cfgs = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)]
    dkdv_cfgs = [(64, 128, 8, 3), (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 4, 3)]
    dq_cfgs = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 4)]
    for (b, hq, hkv, n, dqk, dv) in [ROWS[0], ROWS[1]]:
        q, k, v = _inputs(b, hq, hkv, n, dqk, dv)
        scale = dqk ** -0.5
        flops = 2.0 * b * hq * n * n * (dqk + dv) / 2
        o, lse = flash_attn_fwd(q, k, v, True, scale)
        do = torch.randn_like(o)
        for cfg in fwd_cfgs:
            try:
                ms = _ms(lambda: flash_attn_fwd(q, k, v, True, scale, config=cfg))
                print(f"sweep fwd  D{dqk}/{dv} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:  # out of shared memory / registers: report and go on
                print(f"sweep fwd  D{dqk}/{dv} {cfg}: failed {type(e).__name__}", flush=True)
        for cfg in dkdv_cfgs:
            try:
                ms = _ms(lambda: flash_attn_bwd(do, q, k, v, o, lse, True, scale, dkdv_config=cfg))
                print(f"sweep bwd(dkdv) D{dqk}/{dv} {cfg}: {ms:.3f} ms {2.5 * flops / ms / 1e9:.0f} TFLOP/s",
                      flush=True)
            except Exception as e:
                print(f"sweep bwd(dkdv) D{dqk}/{dv} {cfg}: failed {type(e).__name__}", flush=True)
        for cfg in dq_cfgs:
            try:
                ms = _ms(lambda: flash_attn_bwd(do, q, k, v, o, lse, True, scale, dq_config=cfg))
                print(f"sweep bwd(dq) D{dqk}/{dv} {cfg}: {ms:.3f} ms {2.5 * flops / ms / 1e9:.0f} TFLOP/s",
                      flush=True)
            except Exception as e:
                print(f"sweep bwd(dq) D{dqk}/{dv} {cfg}: failed {type(e).__name__}", flush=True)
        torch.cuda.empty_cache()


def bench_gluon(out=None):
    """Forward only: the experimental Gluon kernel (gluon_fwd.py) vs ours and SDPA, on the rows it takes,
    with a check against SDPA first (a wrong kernel's time is not reported)."""
    from mla_attn.ops.attention import function, gluon_fwd

    lines_fb, lines_fb_var = [], []
    lines = ["| B | Hq/Hkv | L | Dqk/Dv | variant | max abs diff vs SDPA | fwd TF/s | SDPA TF/s | ours (Triton) TF/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, hq, hkv, n, dqk, dv in ROWS:
        q, k, v = _inputs(b, hq, hkv, n, dqk, dv)
        if not gluon_fwd.supported(q, k, v):
            continue
        scale = dqk ** -0.5
        flops = 2 * b * hq * n * n * (dqk + dv) / 2
        ref = _sdpa(q, k, v, scale)
        function.GLUON_FORWARD = False  # the Triton forward, for the last column
        t_sdpa, t_ours = _ms_pair(lambda: _sdpa(q, k, v, scale), lambda: _ours(q, k, v, scale))
        function.GLUON_FORWARD = True
        # (A 64-row, one-warpgroup, 3-stage variant that fits two programs an SM was timed at d3655cf:
        # 401 against 465 TFLOP/s at 4 x 32 x 4096 x 128, 397 against 405 on the GQA row; dropped.)
        variants = [("overlap bn64 s4 Q in regs (default)", {}), ("overlap bn64 s4 Q in smem", dict(q_in_regs=False))]
        for name, kw in variants:
            try:
                o, _ = gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, **kw)
                err = (o.float() - ref.float()).abs().max().item()
                t = _ms(lambda kw=kw: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, **kw))
            except Exception as e:  # a variant that does not compile or fit: report, go on
                print(f"gluon {name} B={b} {hq}/{hkv} L={n}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            ok = err < 0.05  # bf16 outputs of O(1): SDPA and a correct kernel differ by ~1e-2 at most
            lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {name} | {err:.1e} | "
                         f"{flops / t / 1e9 if ok else float('nan'):.0f} | {flops / t_sdpa / 1e9:.0f} | "
                         f"{flops / t_ours / 1e9:.0f} |")
            print(lines[-1], flush=True)
        # fwd+bwd: the Gluon kernels (forward and dK/dV pass) against the Triton ones and SDPA.
        from mla_attn.ops.attention import triton_bwd
        qg, kg, vg = _inputs(b, hq, hkv, n, dqk, dv, grad=True)
        do = torch.randn(b, hq, n, dv, device="cuda", dtype=torch.bfloat16)
        fb = {}
        for name, on in (("gluon", True), ("triton", False)):
            function.GLUON_FORWARD = triton_bwd.GLUON_DKDV = on
            fb[name] = _ms(lambda: _ours(qg, kg, vg, scale).backward(do), [qg, kg, vg])
        function.GLUON_FORWARD = triton_bwd.GLUON_DKDV = True
        from mla_attn.ops.attention import gluon_bwd
        saved = gluon_bwd.TILES
        for tiles in ((64, 2), (32, 3)):  # the dK/dV pass's (rows a step, stages) against the default
            gluon_bwd.TILES = tiles
            t = _ms(lambda: _ours(qg, kg, vg, scale).backward(do), [qg, kg, vg])
            print(f"  dK/dV tiles {tiles}: fwd+bwd {3.5 * flops / t / 1e9:.0f} TF/s (default {gluon_bwd._tiles(dqk)}: "
                  f"{3.5 * flops / fb['gluon'] / 1e9:.0f})", flush=True)
            lines_fb_var.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {tiles} | {3.5 * flops / t / 1e9:.0f} |")
        gluon_bwd.TILES = saved
        # The Gluon dQ pass (off by default until checked): fwd+bwd with it on, after a check of dq.
        triton_bwd.GLUON_DQ = True
        try:
            o1 = _ours(qg, kg, vg, scale)
            g1 = torch.autograd.grad(o1, qg, do)[0]
            triton_bwd.GLUON_DQ = False
            g0 = torch.autograd.grad(_ours(qg, kg, vg, scale), qg, do)[0]
            err = ((g1.float() - g0.float()).abs().max() / g0.float().abs().max()).item()
            triton_bwd.GLUON_DQ = True
            t = _ms(lambda: _ours(qg, kg, vg, scale).backward(do), [qg, kg, vg])
            msg = f"{3.5 * flops / t / 1e9:.0f}" if err < 0.05 else f"wrong (rel err {err:.2e})"
        except Exception as e:  # report, go on
            msg = f"failed: {type(e).__name__}: {str(e)[:120]}"
        triton_bwd.GLUON_DQ = False
        print(f"  + Gluon dQ: fwd+bwd {msg}", flush=True)
        lines_fb_var.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | default + Gluon dQ | {msg} |")
        # The dQ pass on a side stream, beside the dK/dV pass (the default), against one stream.
        side_default, triton_bwd.SIDE_STREAM_DQ = triton_bwd.SIDE_STREAM_DQ, True
        try:
            t_side, t_one = _ms_pair(lambda: _ours(qg, kg, vg, scale).backward(do),
                                     lambda: _no_side(lambda: _ours(qg, kg, vg, scale).backward(do)), [qg, kg, vg])
            msg = f"{3.5 * flops / t_side / 1e9:.0f} (one stream, same run: {3.5 * flops / t_one / 1e9:.0f})"
        except Exception as e:  # report, go on
            msg = f"failed: {type(e).__name__}: {str(e)[:120]}"
        triton_bwd.SIDE_STREAM_DQ = side_default
        print(f"  + dQ on a side stream: fwd+bwd {msg}", flush=True)
        lines_fb_var.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | default, dQ on a side stream | {msg} |")
        fb["sdpa"] = _ms(lambda: _sdpa(qg, kg, vg, scale).backward(do), [qg, kg, vg])
        lines_fb.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {3.5 * flops / fb['gluon'] / 1e9:.0f} | "
                        f"{3.5 * flops / fb['triton'] / 1e9:.0f} | {3.5 * flops / fb['sdpa'] / 1e9:.0f} | "
                        f"{fb['sdpa'] / fb['gluon']:.2f} |")
        print(lines_fb[-1], flush=True)
        torch.cuda.empty_cache()
    # The layers' layout: [B, L, H, D] tensors seen through transpose(1, 2). The Gluon forward reads them in
    # place with token_major=True (off in the router until checked); Triton reads strides; SDPA the same views.
    lines_tm = []
    for b, hq, hkv, n, dqk, dv in ROWS:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(b, hq, hkv, n, dqk, dv))
        if not gluon_fwd.supported(q, k, v):
            continue
        scale = dqk ** -0.5
        flops = 2 * b * hq * n * n * (dqk + dv) / 2
        try:
            ref = _sdpa(q, k, v, scale)
            o, _ = gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, token_major=True)
            err = (o.float() - ref.float()).abs().max().item()
            t_g, t_s = _ms_pair(lambda: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, token_major=True),
                                lambda: _sdpa(q, k, v, scale))
            function.GLUON_FORWARD = False
            t_t = _ms(lambda: _ours(q, k, v, scale))
            function.GLUON_FORWARD = True
            g = f"{flops / t_g / 1e9:.0f}" if err < 0.05 else f"wrong ({err:.1e})"
            lines_tm.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {g} | {flops / t_t / 1e9:.0f} | "
                            f"{flops / t_s / 1e9:.0f} |")
        except Exception as e:  # report, go on
            function.GLUON_FORWARD = True
            lines_tm.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | failed: {type(e).__name__}: {str(e)[:100]} | | |")
        print(lines_tm[-1], flush=True)
        torch.cuda.empty_cache()
    lines += ["", "Forward on token-major views ([B, L, H, D] through transpose(1, 2), the layers' layout), TFLOP/s",
              "", "| B | Hq/Hkv | L | Dqk/Dv | Gluon, token_major | Triton (strides) | SDPA |", "|---|---|---|---|---|---|---|"]
    lines += lines_tm
    lines += ["", "fwd+bwd TFLOP/s (3.5 x forward FLOPs): Gluon forward + Gluon dK/dV + Triton dQ, all-Triton, SDPA",
              "", "| B | Hq/Hkv | L | Dqk/Dv | Gluon | Triton | SDPA | Gluon / SDPA |", "|---|---|---|---|---|---|---|---|"]
    lines += lines_fb
    lines += ["", "Gluon dK/dV (rows a step, stages) variants, fwd+bwd TFLOP/s", "",
              "| B | Hq/Hkv | L | Dqk/Dv | tiles | fwd+bwd |", "|---|---|---|---|---|---|"] + lines_fb_var
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)


def _bench_forward_variants(out, label, variants, takes=lambda q, k, v: True, rounds=3, rows=None):
    """Forward only: each variant (name, fn(q, k, v, scale) -> (o, lse)) against the Gluon forward in use and
    SDPA on the benchmark rows that ``takes``, each checked against SDPA (a NaN rate when it differs by
    0.05 or more). The clock drifts by several percent within a run, so every candidate of a row is timed
    ``rounds`` times, the order rotated each round, and the median kept; "vs in use" is the ratio of the
    variant's median to the in-use forward's. A variant that fails is reported and skipped. ``rows``: (B, Hq, Hkv,
    L, Dqk, Dv) tuples instead of the benchmark's rows."""
    from mla_attn.ops.attention import gluon_fwd

    lines = [f"| B | Hq/Hkv | L | Dqk/Dv | variant | max abs diff vs SDPA | {label} TF/s | Gluon (in use) TF/s "
             "| vs in use | SDPA TF/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b, hq, hkv, n, dqk, dv in rows or ROWS:
        q, k, v = _inputs(b, hq, hkv, n, dqk, dv)
        if not takes(q, k, v):
            continue
        scale = dqk ** -0.5
        flops = 2 * b * hq * n * n * (dqk + dv) / 2
        ref = _sdpa(q, k, v, scale)
        cands = {"in use": lambda: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale),
                 "sdpa": lambda: _sdpa(q, k, v, scale)}
        errs = {}
        for name, fn in variants:
            try:
                o, _ = fn(q, k, v, scale)
                errs[name] = (o.float() - ref.float()).abs().max().item()
                cands[name] = lambda fn=fn: fn(q, k, v, scale)
            except Exception as e:  # report, go on
                print(f"{label} {name} B={b} {hq}/{hkv} L={n}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        med = _rotated_medians(cands, rounds)
        for name, _ in variants:
            if name not in errs:
                continue
            ok = errs[name] < 0.05
            lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {name} | {errs[name]:.1e} | "
                         f"{flops / med[name] / 1e9 if ok else float('nan'):.0f} | {flops / med['in use'] / 1e9:.0f} | "
                         f"{med['in use'] / med[name] if ok else float('nan'):.3f} | {flops / med['sdpa'] / 1e9:.0f} |")
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)


def bench_gluon_ws(out=None):
    """The experimental warp-specialised Gluon forward (gluon_fwd_ws.py) on the rows it takes (Dqk = Dv <= 128)."""
    from mla_attn.ops.attention import gluon_fwd_ws

    def ws(**kw):
        return lambda q, k, v, scale: gluon_fwd_ws.flash_fwd_ws(q, k, v, causal=True, scale=scale, **kw)

    _bench_forward_variants(out, "ws", [("bn128 s2 (default)", ws()), ("bn64 s3", ws(block_n=64, stages=3)),
                                        ("bn128 s2, consumers 240 regs", ws(consumer_regs=240))],
                            takes=gluon_fwd_ws.supported)


def bench_gluon_persistent(out=None):
    """The schedules of the Gluon forward, every benchmark row, against the one in use (at d 128 the
    persistent snake with S_1 early, the grid elsewhere): the grid and the persistent schedule, with and
    without TAIL (the last heads' row blocks length-major)."""
    from mla_attn.ops.attention import gluon_fwd

    def variant(**kw):
        return lambda q, k, v, scale: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, **kw)

    _bench_forward_variants(out, "variant", [
        ("grid", variant(persistent=False, s1_early=False, tail=False)),
        ("grid, tail length-major", variant(persistent=False, s1_early=False, tail=True)),
        ("persistent snake + S_1 early", variant(persistent=True, schedule=1, s1_early=True, tail=False)),
        ("persistent snake + S_1 early, tail length-major", variant(persistent=True, schedule=1, s1_early=True,
                                                                    tail=True)),
        ("persistent counter, tail length-major", variant(persistent=True, schedule=0, s1_early=False, tail=True)),
    ], rounds=5)


def bench_fwd_192(out=None):
    """The Gluon forward at Dqk 192 (the MLA prefill rows), against the grid in use there: the persistent
    schedule with 4 stages stores O directly (no shared memory left for a buffer of its own), with 3 stages
    it has room for one and stores O by TMA; the grid with 3 stages separates the ring's depth from the
    schedule. Also a shorter MLA row (L 1024), where a block's fixed cost weighs more."""
    from mla_attn.ops.attention import gluon_fwd

    def variant(**kw):
        return lambda q, k, v, scale: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, **kw)

    rows = [r for r in ROWS if r[4] == 192] + [(8, 128, 128, 1024, 192, 128)]
    _bench_forward_variants(out, "variant", [
        ("grid, 3 stages", variant(persistent=False, stages=3)),
        ("persistent snake, 4 stages (O direct)", variant(persistent=True, schedule=1)),
        ("persistent snake, 3 stages (O by TMA)", variant(persistent=True, schedule=1, stages=3)),
        ("persistent snake + S_1 early, 3 stages (O by TMA)", variant(persistent=True, schedule=1, stages=3,
                                                                      s1_early=True)),
    ], rounds=5, rows=rows)


def bench_fwd_occupancy(out=None):
    """Narrow heads (Dqk = Dv <= 96) with two programs an SM against the forward in use (one 8-warp program an
    SM: the PV-overlap schedule takes 158-203 registers). The plain schedule capped at 128 registers (no spills at
    64-96 on sm_90a) fits two 8-warp programs; 64-row blocks of one warpgroup fit two (overlap) or three (plain)."""
    from mla_attn.ops.attention import gluon_fwd

    def variant(**kw):
        return lambda q, k, v, scale: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, **kw)

    rows = [(4, 32, 32, 2048, 64, 64), (4, 32, 32, 2048, 72, 72), (4, 32, 8, 2048, 72, 72),
            (4, 32, 32, 2048, 80, 80), (4, 32, 32, 2048, 96, 96), (2, 32, 32, 8192, 64, 64)]
    _bench_forward_variants(out, "variant", [
        ("128 rows, plain, 3 stages, cap 128 (2 an SM)", variant(pv_overlap=False, q_in_regs=False, stages=3,
                                                                maxnreg=128)),
        ("128 rows, plain, 3 stages, no cap", variant(pv_overlap=False, q_in_regs=False, stages=3)),
        ("64 rows x 4 warps, overlap, 4 stages (2 an SM)", variant(block_m=64, num_warps=4)),
        ("64 rows x 4 warps, plain, 3 stages (3 an SM)", variant(block_m=64, num_warps=4, pv_overlap=False,
                                                                q_in_regs=False, stages=3)),
    ], rounds=5, rows=rows)


def bench_gluon_pair(out=None):
    """Head pairs (``gluon_fwd.HEAD_PAIR``: a block is 64 rows of each of two query heads sharing a KV head) against
    one-head blocks, in the persistent schedule (in use at d 128) and the grid, on GQA rows: the benchmark's
    (L 2048), a longer one, and a shorter one with groups of 2."""
    from mla_attn.ops.attention import gluon_fwd

    def variant(**kw):
        return lambda q, k, v, scale: gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=scale, **kw)

    _bench_forward_variants(out, "variant", [
        ("persistent, head pairs", variant(pair=True)),
        ("grid, one head", variant(persistent=False, s1_early=False, pair=False)),
        ("grid, head pairs", variant(persistent=False, s1_early=False, pair=True)),
    ], rounds=5, rows=[(8, 32, 8, 2048, 128, 128), (4, 32, 8, 4096, 128, 128), (16, 16, 8, 1024, 128, 128)])


def _write_table(out, lines):
    """The table's lines to the file out (None: nowhere)."""
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def _train_row(b, hq, hkv, n, dqk, dv):
    """A causal benchmark row for forward + backward: (scale, FLOPs counted as 3.5 x forward, q, k, v needing
    grad, dO)."""
    q, k, v = _inputs(b, hq, hkv, n, dqk, dv, grad=True)
    do = torch.randn(b, hq, n, dv, device="cuda", dtype=torch.bfloat16)
    return dqk ** -0.5, 3.5 * 2 * b * hq * n * n * (dqk + dv) / 2, q, k, v, do


def _bench_toggle(out, mod, attr, values, labels, rows, rounds=5):
    """Forward + backward through the public op with ``mod.attr`` set to each of ``values`` (two), and SDPA,
    on ``rows``: ``rounds`` rounds, the order rotated each round, medians kept."""
    a, b_ = labels
    lines = [f"| B | Hq/Hkv | L | Dqk/Dv | fwd+bwd, {a} TF/s | {b_} TF/s | {a} / {b_} | SDPA TF/s | {a} / SDPA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, hq, hkv, n, dqk, dv in rows:
        scale, flops, q, k, v, do = _train_row(b, hq, hkv, n, dqk, dv)

        def ours(value):
            def run():
                old = getattr(mod, attr)
                setattr(mod, attr, value)
                try:
                    _ours(q, k, v, scale).backward(do)
                finally:
                    setattr(mod, attr, old)
            return run

        cands = {a: ours(values[0]), b_: ours(values[1]), "sdpa": lambda: _sdpa(q, k, v, scale).backward(do)}
        tf = {nm: flops / (t * 1e-3) / 1e12 for nm, t in _rotated_medians(cands, rounds, [q, k, v]).items()}
        lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {tf[a]:.0f} | {tf[b_]:.0f} | "
                     f"{tf[a] / tf[b_]:.3f} | {tf['sdpa']:.0f} | {tf[a] / tf['sdpa']:.3f} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    _write_table(out, lines)


def bench_dkdv_narrow(out=None, rounds=3):
    """Forward + backward through the op at narrow heads with the Gluon dK/dV pass's tiles replaced: 64 keys a
    program on one warpgroup (two or three programs an SM: 191-235 registers at 64 rows, 133-183 at 32, sm_90a)
    against the default 128 keys on two warpgroups (named, so DKDV_NARROW does not apply to it). Each variant's dK
    and dV are checked against the default's (max abs difference)."""
    import functools

    from mla_attn.ops.attention import gluon_bwd

    real = gluon_bwd.dkdv_gluon
    variants = {"default (128 keys, 8 warps)": dict(block_n=128, num_warps=8), "64 keys, 4 warps, 64 rows, 2 stages":
                dict(block_n=64, num_warps=4, block_m=64, stages=2),
                "64 keys, 4 warps, 32 rows, 3 stages": dict(block_n=64, num_warps=4, block_m=32, stages=3)}
    lines = ["| B | Hq/Hkv | L | Dqk/Dv | dK/dV tiles | max abs diff dK, dV vs default | fwd+bwd TF/s | vs default "
             "| SDPA TF/s |", "|---|---|---|---|---|---|---|---|---|"]
    rows = [(4, 32, 32, 2048, 64, 64), (4, 32, 8, 2048, 64, 64), (4, 32, 32, 2048, 80, 80), (4, 32, 32, 2048, 96, 96),
            (4, 32, 32, 2048, 72, 72)]
    for b, hq, hkv, n, dqk, dv in rows:
        scale, flops, q, k, v, do = _train_row(b, hq, hkv, n, dqk, dv)
        cands, grads = {}, {}
        for name, kw in variants.items():
            fn = functools.partial(real, **kw)

            def step(fn=fn):
                gluon_bwd.dkdv_gluon = fn
                try:
                    _ours(q, k, v, scale).backward(do)
                finally:
                    gluon_bwd.dkdv_gluon = real
            try:
                for t in (q, k, v):
                    t.grad = None
                step()
                grads[name] = (k.grad.clone(), v.grad.clone())
                cands[name] = step
            except Exception as e:  # report, go on
                print(f"dkdv narrow {name} {dqk}/{dv}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        cands["sdpa"] = lambda: _sdpa(q, k, v, scale).backward(do)
        med = _rotated_medians(cands, rounds, grads=[q, k, v])
        base = grads.get("default (128 keys, 8 warps)")
        for name in variants:
            if name not in grads or base is None:
                continue
            diff = max((a.float() - b_.float()).abs().max().item() for a, b_ in zip(grads[name], base))
            lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {name} | {diff:.1e} | {flops / med[name] / 1e9:.0f} "
                         f"| {med['default (128 keys, 8 warps)'] / med[name]:.3f} | {flops / med['sdpa'] / 1e9:.0f} |")
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    _write_table(out, lines)


def bench_dkdv_store(out=None, rounds=5):
    """The Gluon dK/dV pass storing dK/dV by TMA (``gluon_bwd.DKDV_TMA_STORE``) or directly, on every row."""
    from mla_attn.ops.attention import gluon_bwd

    _bench_toggle(out, gluon_bwd, "DKDV_TMA_STORE", ("1", "0"), ("dK/dV by TMA", "direct stores"), ROWS, rounds)


def bench_dkdv_fresh(out=None, rounds=5):
    """The Gluon dK/dV pass with K/V's descriptors recomputed each step (``gluon_bwd.DKDV_FRESH_DESC``) or held."""
    from mla_attn.ops.attention import gluon_bwd

    _bench_toggle(out, gluon_bwd, "DKDV_FRESH_DESC", ("1", "0"), ("fresh descriptors", "held"), ROWS, rounds)


def bench_fused_bwd(out=None, rounds=5):
    """The one-pass backward (``gluon_bwd_fused.FUSED_BWD``) against the two-pass one, on the rows it takes
    (Dqk 128) and two more GQA shapes."""
    from mla_attn.ops.attention import gluon_bwd_fused

    rows = [r for r in ROWS if r[4] <= 128] + [(4, 32, 8, 4096, 128, 128), (16, 16, 8, 1024, 128, 128)]
    _bench_toggle(out, gluon_bwd_fused, "FUSED_BWD", ("1", "0"), ("one pass", "two passes"), rows, rounds)


def _graphed(fn):
    """A CUDA graph of fn() (a forward + backward), captured after three warm-up runs on a side stream; returns
    its replay. The .grad tensors fn() fills are allocated at capture and refilled by each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def bench_host_overhead(out=None):
    """Forward + backward run eagerly and as a CUDA-graph replay, ours and SDPA: where eager time exceeds the
    replay, the host (Python launches, descriptors) is the limit. Small rows first, where that shows."""
    from mla_attn.ops import _launch

    from bench_decode import _bench_b2b  # scripts/ is on sys.path when this file runs as a script

    lines = ["| B | Hq/Hkv | L | Dqk/Dv | ours eager, plans off TF/s | ours eager TF/s | ours graph TF/s | SDPA eager TF/s "
             "| SDPA graph TF/s | ours torch.compile reduce-overhead TF/s | ours / SDPA eager back to back TF/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, hq, hkv, n, dqk, dv in [(16, 16, 8, 1024, 128, 128), (8, 32, 8, 2048, 128, 128), (4, 32, 32, 4096, 128, 128)]:
        scale, flops, q, k, v, do = _train_row(b, hq, hkv, n, dqk, dv)
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        # The Gluon launchers' cached plans (gluon_fwd.DescPlan) off, then on (as in every other column).
        _launch.FAST = False
        row = [f"{tf(_ms(lambda: _ours(q, k, v, scale).backward(do), [q, k, v])):.0f}"]
        _launch.FAST = True
        for t in (q, k, v):
            t.grad = None
        for name, fn in (("ours", lambda: _ours(q, k, v, scale).backward(do)),
                         ("sdpa", lambda: _sdpa(q, k, v, scale).backward(do))):
            for t in (q, k, v):
                t.grad = None
            eager = _ms(fn, [q, k, v])
            for t in (q, k, v):
                t.grad = None
            try:
                replay = _graphed(fn)
                row += [f"{tf(eager):.0f}", f"{tf(_ms(replay)):.0f}"]
            except RuntimeError as e:  # a backend that cannot be captured: say so
                row += [f"{tf(eager):.0f}", f"capture failed: {str(e)[:60]}"]
            for t in (q, k, v):
                t.grad = None
        # What a user who wants the graph's host savings without capturing by hand gets: torch.compile's
        # CUDA graphs around the custom ops (the step returns the gradients: .grad is not graph memory).
        step = torch.compile(lambda q, k, v: torch.autograd.grad(_ours(q, k, v, scale), (q, k, v), do),
                             mode="reduce-overhead")
        try:
            for _ in range(3):
                step(q, k, v)
            row.append(f"{tf(_ms(lambda: step(q, k, v))):.0f}")
        except Exception as e:  # noqa: BLE001 - a compile failure is a result to report
            row.append(f"failed: {type(e).__name__}: {str(e)[:60]}")
        # do_bench flushes L2 before each call, which hides host time up to the flush's length (eager can read
        # above graph); back to back, no flush, host included, is what a loop of eager steps sees.
        def eager_step(attn):
            for t in (q, k, v):  # as do_bench's grad_to_none: no accumulation kernel
                t.grad = None
            attn(q, k, v, scale).backward(do)

        b2b = [flops / _bench_b2b(lambda: eager_step(attn), 50) / 1e12 for attn in (_ours, _sdpa)]
        row.append(f"{b2b[0]:.0f} / {b2b[1]:.0f}")
        lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    _write_table(out, lines)


def _same_grads_twice(fn, leaves):
    """Whether two runs of fn() (a forward + backward) leave bit-for-bit the same gradients on leaves."""
    runs = []
    for _ in range(2):
        for t in leaves:
            t.grad = None
        fn()
        runs.append([t.grad.clone() for t in leaves])
    return all(torch.equal(a, b) for a, b in zip(*runs))


def bench_deterministic_peer(out=None):
    """Forward + backward against SDPA in PyTorch's deterministic mode, on every benchmark row.

    Our backward is deterministic by design: dQ has a pass of its own, which recomputes S and dP (7 GEMMs
    where the FLOP count has 5), rather than atomic adds from the dK/dV pass. SDPA's default (cuDNN on the
    H200) is not bound to that. ``torch.use_deterministic_algorithms(True)`` excludes cuDNN attention and picks
    a deterministic backend, the peer a user who needs reproducible gradients would get. Timed A B B A: ours
    (default mode, the same kernels either way) and SDPA in deterministic mode. Also reported: whether two
    backward passes give bit-for-bit the same gradients, for ours, SDPA by default and SDPA in
    deterministic mode. A backend that fails there is reported, not timed."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for SDPA's math path
    lines = ["| B | Hq/Hkv | L | Dqk/Dv | ours TF/s | SDPA deterministic TF/s | ours / SDPA det. | SDPA default TF/s "
             "| same grads twice: ours / SDPA default / SDPA det. |", "|---|---|---|---|---|---|---|---|---|"]
    for b, hq, hkv, n, dqk, dv in ROWS:
        scale, flops, q, k, v, do = _train_row(b, hq, hkv, n, dqk, dv)
        ours = lambda: _ours(q, k, v, scale).backward(do)  # noqa: E731
        sdpa = lambda: _sdpa(q, k, v, scale).backward(do)  # noqa: E731
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        same_ours, same_sdpa = _same_grads_twice(ours, (q, k, v)), _same_grads_twice(sdpa, (q, k, v))
        t_sdpa = _ms(sdpa, [q, k, v])
        prev = torch.are_deterministic_algorithms_enabled()
        try:
            a1 = _ms(ours, [q, k, v])
            torch.use_deterministic_algorithms(True)
            b1, b2 = _ms(sdpa, [q, k, v]), _ms(sdpa, [q, k, v])
            same_det = _same_grads_twice(sdpa, (q, k, v))
            torch.use_deterministic_algorithms(prev)
            a2 = _ms(ours, [q, k, v])
            t_ours, t_det = (a1 + a2) / 2, (b1 + b2) / 2
            det = f"{tf(t_det):.0f} | {t_det / t_ours:.2f}"
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # no deterministic backend here: report it
            torch.use_deterministic_algorithms(prev)
            t_ours, same_det = _ms(ours, [q, k, v]), None
            det = f"failed: {type(e).__name__}: {str(e)[:80]} | n/a"
        lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {tf(t_ours):.0f} | {det} | {tf(t_sdpa):.0f} | "
                     f"{same_ours} / {same_sdpa} / {same_det} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    _write_table(out, lines)


GQA_SWEEP_ROWS = [  # B, Hq, Hkv, L, Dqk, Dv: the GQA row's group grown to MQA, two longer GQA/MQA rows, odd head widths
    (8, 32, 8, 2048, 128, 128),
    (8, 32, 4, 2048, 128, 128),
    (8, 32, 2, 2048, 128, 128),
    (8, 32, 1, 2048, 128, 128),
    (2, 64, 8, 4096, 128, 128),
    (4, 32, 1, 4096, 128, 128),
    (4, 32, 32, 2048, 64, 64),
    (4, 32, 32, 2048, 72, 72),
    (4, 32, 32, 2048, 96, 64),
]


def _row_line(row, r) -> str:
    b, hq, hkv, n, dqk, dv = row
    return (f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {r['tf_fwd_ours']:.0f} | {r['tf_fwd_sdpa']:.0f} | "
            f"{r['tf_fwd_ours'] / r['tf_fwd_sdpa']:.2f} | {r['tf_fwdg_ours']:.0f} / {r['tf_fwdg_sdpa']:.0f} / "
            f"{r['tf_fwdg_ours'] / r['tf_fwdg_sdpa']:.2f} | {r['tf_fb_ours']:.0f} | {r['tf_fb_sdpa']:.0f} | "
            f"{r['tf_fb_ours'] / r['tf_fb_sdpa']:.2f} | {r['mem_ours']:.0f} | {r['mem_sdpa']:.0f} |")


_TABLE_HEAD = [
    "| B | Hq/Hkv | L | Dqk/Dv | fwd ours TF/s | fwd SDPA TF/s | fwd ratio | fwd, grad mode: ours / SDPA / ratio "
    "| fwd+bwd ours TF/s | fwd+bwd SDPA TF/s | fwd+bwd ratio | extra MiB ours | extra MiB SDPA |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def _sdpa_kernels(b, hq, hkv, n, dqk, dv) -> str:
    """The attention kernels one SDPA fwd+bwd launches on this row (names cut short), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _inputs(b, hq, hkv, n, dqk, dv, grad=True)
    do = torch.randn(b, hq, n, dv, device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _sdpa(q, k, v, dqk ** -0.5).backward(do)
        torch.cuda.synchronize()
    keys = ("attn", "attention", "fmha", "flash", "cudnn", "sdpa", "mha", "repeat", "index", "reduce", "sum")
    evs = [e for e in prof.key_averages() if any(w in e.key.lower() for w in keys)]
    gpu = [e for e in evs if str(getattr(e, "device_type", "")).endswith("CUDA")]  # kernels, not aten ops
    names = sorted({e.key for e in gpu or evs})
    return "; ".join(nm[:48] for nm in names[:6]) or "-"


def bench_hsplit(out=None, rounds=3):
    """fwd+bwd with the dK/dV pass's heads split (``gluon_bwd.DKDV_HSPLIT``) off, "auto" and forced 2 / 4 ways,
    against SDPA, on MQA and large-group rows: every candidate of a row timed ``rounds`` times, the order rotated
    each round, medians kept."""
    from mla_attn.ops.attention import gluon_bwd

    rows = [(8, 32, 1, 2048, 128, 128), (4, 32, 1, 4096, 128, 128), (8, 32, 2, 2048, 128, 128),
            (2, 64, 8, 4096, 128, 128), (4, 32, 1, 4096, 192, 128), (8, 32, 8, 2048, 128, 128)]
    lines = ["| B | Hq/Hkv | L | Dqk/Dv | split: auto chooses | off TF/s | auto | 2 | 4 | SDPA | auto / off | auto / SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    old = gluon_bwd.DKDV_HSPLIT
    try:
        for row in rows:
            scale, flops, q, k, v, do = _train_row(*row)
            cands = {}
            for name in ("0", "auto", "2", "4"):
                def run(name=name):
                    gluon_bwd.DKDV_HSPLIT = name
                    _ours(q, k, v, scale).backward(do)
                cands[name] = run
            cands["sdpa"] = lambda: _sdpa(q, k, v, scale).backward(do)
            med = _rotated_medians(cands, rounds, [q, k, v])
            gluon_bwd.DKDV_HSPLIT = "auto"
            hs = gluon_bwd._hsplit(row[0], row[1], row[2], row[3], 128, q.device)
            tf = {nm: flops / (t * 1e-3) / 1e12 for nm, t in med.items()}
            b, hq, hkv, n, dqk, dv = row
            lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {hs} | {tf['0']:.0f} | {tf['auto']:.0f} | "
                         f"{tf['2']:.0f} | {tf['4']:.0f} | {tf['sdpa']:.0f} | {tf['auto'] / tf['0']:.3f} | "
                         f"{tf['auto'] / tf['sdpa']:.2f} |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    finally:
        gluon_bwd.DKDV_HSPLIT = old
    _write_table(out, lines)


def _switched_call(set_flags, flags, q, k, v, do, scale, grad):
    """A call through the public op after ``set_flags(flags)``: the forward (no grad), or with ``grad`` forward and
    backward of dO."""
    def run():
        set_flags(flags)
        if grad:
            _ours(q, k, v, scale).backward(do)
        else:
            with torch.no_grad():
                _ours(q, k, v, scale)
    return run


def _sdpa_no_grad(q, k, v, scale):
    """SDPA's forward alone (no autograd graph), as a callable."""
    def run():
        with torch.no_grad():
            _sdpa(q, k, v, scale)
    return run


ODD_WIDTH_ROWS = [  # B, Hq, Hkv, L, Dqk, Dv: head widths of real models whose rows are not 16-element multiples or powers of two
    (4, 32, 32, 2048, 64, 64),     # for reference: the Gluon kernels
    (4, 32, 32, 2048, 40, 40),     # Stable Diffusion 1.5's first UNet stage
    (4, 32, 32, 2048, 72, 72),
    (4, 32, 8, 2048, 72, 72),
    (4, 32, 32, 2048, 80, 80),     # Phi-2, SD 1.5's second stage
    (4, 32, 32, 2048, 96, 96),     # Phi-3-mini
    (4, 16, 16, 2048, 160, 160),   # SD 1.5's third stage
]


def bench_odd_widths(out=None, rounds=3):
    """Forward and fwd+bwd at head widths the Gluon kernels do not take (so the Triton kernels run), three ways:
    strides as they are and the value head padded to its power of two (before session 29), strides in units
    (``triton_fwd.STRIDE_UNITS``), and units with the value head split (``VALUE_SPLIT``, the default), against
    SDPA: ``rounds`` rounds, the order rotated each round, medians kept."""
    from mla_attn.ops.attention import gluon_bwd, gluon_fwd, triton_fwd

    variants = {"before": (False, False), "units": (True, False), "split": (True, True)}
    # the Triton kernels throughout: the Gluon ones' odd widths (on by default at 72 / 80 / 96) kept off
    old_gluon = gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD
    gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD = "0", "0"
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16, causal; "
             "'unit': what the leading strides are passed divided by (triton_fwd.stride_unit); 'Dv tiles': the value "
             "head's split (split_value_dim); 'before': strides as they are, Dv padded; TF/s, medians", "",
             "| B | Hq/Hkv | L | Dqk/Dv | unit | Dv tiles | fwd: before | units | units + split | SDPA | best / before | "
             "split / SDPA | fwd+bwd: before | units | units + split | SDPA | best / before | split / SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    old = triton_fwd.STRIDE_UNITS, triton_fwd.VALUE_SPLIT
    try:
        for row in ODD_WIDTH_ROWS:
            scale, flops, q, k, v, do = _train_row(*row)
            triton_fwd.STRIDE_UNITS, triton_fwd.VALUE_SPLIT = True, True
            unit, tiles = triton_fwd.stride_unit(q, k, v), triton_fwd.split_value_dim(row[5])

            def set_flags(flags):
                triton_fwd.STRIDE_UNITS, triton_fwd.VALUE_SPLIT = flags

            def ours(flags, grad):
                return _switched_call(set_flags, flags, q, k, v, do, scale, grad)

            sdpa_fwd = _sdpa_no_grad(q, k, v, scale)
            tf = {}
            for grad in (False, True):
                cands = {nm: ours(flags, grad) for nm, flags in variants.items()}
                cands["sdpa"] = (lambda: _sdpa(q, k, v, scale).backward(do)) if grad else sdpa_fwd
                f = flops if grad else flops / 3.5
                for nm, t in _rotated_medians(cands, rounds, [q, k, v] if grad else None).items():
                    tf[(grad, nm)] = f / (t * 1e-3) / 1e12
            b, hq, hkv, n, dqk, dv = row
            cells = []
            for grad in (False, True):
                t = {nm: tf[(grad, nm)] for nm in ("before", "units", "split", "sdpa")}
                best = max(t["units"], t["split"])
                cells += [f"{t['before']:.0f}", f"{t['units']:.0f}", f"{t['split']:.0f}", f"{t['sdpa']:.0f}",
                          f"{best / t['before']:.2f}", f"{t['split'] / t['sdpa']:.2f}"]
            lines.append(f"| {b} | {hq}/{hkv} | {n} | {dqk}/{dv} | {unit} | {'+'.join(map(str, tiles))} | "
                         + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    finally:
        triton_fwd.STRIDE_UNITS, triton_fwd.VALUE_SPLIT = old
        gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD = old_gluon
    _write_table(out, lines)


def bench_gluon_odd(out=None, rounds=3):
    """Forward and fwd+bwd through the public op at the odd head widths: on the Triton kernels (both switches "0"),
    with the forward on Gluon (``gluon_fwd.ODD_WIDTHS``: Dqk / Dv split into power-of-two TMA blocks, a padded
    tail zero-filled, two value accumulators), and with the dK/dV pass on Gluon too (``gluon_bwd.DKDV_ODD``, Dv
    up to 128), against SDPA. ``rounds`` rounds, the order rotated each round, medians kept."""
    from mla_attn.ops.attention import gluon_bwd, gluon_fwd

    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16, causal, "
             "[B, H, L, D] inputs; 'tiles': how the switches split Dqk / Dv (a '-p' tail has p padding columns); "
             "'triton': both switches off, 'fwd': ODD_WIDTHS on, 'fwd+dkdv': DKDV_ODD on too "
             "(where the dK/dV pass takes the widths); TF/s, medians", "",
             "| B | Hq/Hkv | L | Dqk/Dv | tiles | fwd: triton | gluon | SDPA | gluon / triton | gluon / SDPA | "
             "fwd+bwd: triton | fwd | fwd+dkdv | SDPA | best / triton | best / SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def tiles(d):
        d0, d1, pad = gluon_fwd._split_padded(d)
        return str(d0) + (f"+{d1}" if d1 else "") + (f"-{pad}" if pad else "")

    old = gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD
    try:
        for row in ODD_WIDTH_ROWS:
            scale, flops, q, k, v, do = _train_row(*row)

            def set_flags(flags):
                gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD = flags

            def ours(flags, grad):
                return _switched_call(set_flags, flags, q, k, v, do, scale, grad)

            sdpa_fwd = _sdpa_no_grad(q, k, v, scale)
            gluon_bwd.DKDV_ODD = True
            dkdv_takes = gluon_bwd.supported(q, k, v)
            fwd = {"triton": ours((False, False), False), "gluon": ours((True, False), False), "sdpa": sdpa_fwd}
            bwd = {"triton": ours((False, False), True), "fwd": ours((True, False), True),
                   "sdpa": lambda: _sdpa(q, k, v, scale).backward(do)}
            if dkdv_takes:
                bwd["fwd+dkdv"] = ours((True, True), True)
            tf = {nm: flops / 3.5 / (t * 1e-3) / 1e12 for nm, t in _rotated_medians(fwd, rounds).items()}
            tb = {nm: flops / (t * 1e-3) / 1e12 for nm, t in _rotated_medians(bwd, rounds, [q, k, v]).items()}
            best = max(tb["fwd"], tb.get("fwd+dkdv", 0.0))
            b, hq, hkv, n, dqk, dv = row
            cells = [str(b), f"{hq}/{hkv}", str(n), f"{dqk}/{dv}", f"{tiles(dqk)} / {tiles(dv)}",
                     f"{tf['triton']:.0f}", f"{tf['gluon']:.0f}", f"{tf['sdpa']:.0f}",
                     f"{tf['gluon'] / tf['triton']:.2f}", f"{tf['gluon'] / tf['sdpa']:.2f}",
                     f"{tb['triton']:.0f}", f"{tb['fwd']:.0f}", f"{tb['fwd+dkdv']:.0f}" if dkdv_takes else "-",
                     f"{tb['sdpa']:.0f}", f"{best / tb['triton']:.2f}", f"{best / tb['sdpa']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    finally:
        gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD = old
    _write_table(out, lines)


def bench_gqa_sweep(out=None):
    """The main table's columns on rows where SDPA has to repeat KV heads (the GQA row's group grown from 4 to
    32, i.e. MQA) or handle unusual head widths (64, 72, 96/64): where does ours pass SDPA?"""
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16, causal; "
             f"SDPA GQA: {'enable_gqa=True' if HAS_GQA else 'KV heads repeated'}", ""] + _TABLE_HEAD
    lines[-2] = lines[-2] + " SDPA's kernels (fwd+bwd, profiler) |"
    lines[-1] = lines[-1] + "---|"
    for row in GQA_SWEEP_ROWS:
        try:
            lines.append(_row_line(row, bench_row(*row)) + f" {_sdpa_kernels(*row)} |")
        except Exception as e:  # a row SDPA or ours cannot run here: report it, go on
            lines.append(f"| {row[0]} | {row[1]}/{row[2]} | {row[3]} | {row[4]}/{row[5]} | failed: "
                         f"{type(e).__name__}: {str(e)[:120]} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    _write_table(out, lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--sweep", action="store_true", help="also time a few tile configs per kernel")
    ap.add_argument("--gluon", metavar="OUT", help="only: time the Gluon kernels' variants, table to OUT")
    ap.add_argument("--gluon-ws", metavar="OUT", help="only: time the experimental warp-specialised forward")
    ap.add_argument("--gluon-persistent", metavar="OUT",
                    help="only: time the experimental persistent schedule of the Gluon forward")
    ap.add_argument("--gluon-pair", metavar="OUT", help="only: time head pairs in the Gluon forward (GQA rows)")
    ap.add_argument("--gqa-sweep", metavar="OUT", help="only: the main table on GQA groups up to MQA and odd head widths")
    ap.add_argument("--gluon-odd", metavar="OUT", help="only: fwd and fwd+bwd at odd head widths, on Triton or with the "
                    "forward and the dK/dV pass on Gluon (gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD), against SDPA")
    ap.add_argument("--odd-widths", metavar="OUT", help="only: fwd and fwd+bwd at odd head widths: before / stride units / units + value split")
    ap.add_argument("--hsplit", metavar="OUT", help="only: fwd+bwd with the dK/dV pass's heads split off / auto / 2 / 4")
    ap.add_argument("--fwd-occupancy", metavar="OUT", help="only: narrow heads with two programs an SM (the Gluon "
                    "forward's register cap and 64-row blocks) against the forward in use")
    ap.add_argument("--dkdv-narrow", metavar="OUT", help="only: fwd+bwd at narrow heads with the Gluon dK/dV pass on "
                    "64-key one-warpgroup programs against its default tiles")
    ap.add_argument("--fwd-192", metavar="OUT", help="only: the Gluon forward's schedules and ring depths at Dqk 192")
    ap.add_argument("--dkdv-store", metavar="OUT",
                    help="only: fwd+bwd with the Gluon dK/dV pass storing by TMA or directly, and SDPA")
    ap.add_argument("--dkdv-fresh", metavar="OUT", help="only: fwd+bwd with the dK/dV pass's descriptors fresh or held")
    ap.add_argument("--host-overhead", metavar="OUT", help="only: fwd+bwd eager against a CUDA-graph replay, ours and SDPA")
    ap.add_argument("--fused-bwd", metavar="OUT", help="only: fwd+bwd with the one-pass backward or the two-pass one, and SDPA")
    ap.add_argument("--deterministic-peer", metavar="OUT",
                    help="only: fwd+bwd against SDPA in PyTorch's deterministic mode, and who repeats its gradients")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    only = {"gluon": bench_gluon, "gluon_ws": bench_gluon_ws, "gluon_persistent": bench_gluon_persistent,
            "gluon_pair": bench_gluon_pair, "fwd_192": bench_fwd_192, "fwd_occupancy": bench_fwd_occupancy, "dkdv_narrow": bench_dkdv_narrow, "gqa_sweep": bench_gqa_sweep, "odd_widths": bench_odd_widths, "gluon_odd": bench_gluon_odd, "hsplit": bench_hsplit, "dkdv_store": bench_dkdv_store, "fused_bwd": bench_fused_bwd, "host_overhead": bench_host_overhead, "dkdv_fresh": bench_dkdv_fresh,
            "deterministic_peer": bench_deterministic_peer}
    for name, bench in only.items():  # each of these runs alone, its table to the path given
        if getattr(args, name):
            bench(getattr(args, name))
            return
    if args.sweep:
        sweep()
    lines = [
        f"# Flash attention vs SDPA ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16, causal; "
        "median of triton.testing.do_bench, ours and SDPA timed in A B B A order (each the mean of its two).",
        "FLOPs: forward = 2*B*H*L*L*(Dqk+Dv)/2 (causal); forward+backward = 3.5 x forward. "
        f"SDPA GQA: {'enable_gqa=True' if HAS_GQA else 'KV heads repeated'}. "
        "Extra MiB: peak memory of one fwd+bwd beyond inputs, dO and gradients.",
        "",
        "'fwd': under torch.no_grad(); 'fwd, grad mode': inputs that need grad, as in training.",
        "",
    ] + _TABLE_HEAD
    for row in ROWS:
        lines.append(_row_line(row, bench_row(*row)))
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

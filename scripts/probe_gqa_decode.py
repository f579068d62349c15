"""Where large-batch GQA decode loses its last percent to SDPA: which kernel SDPA runs, and A/B of load strategies.

``decode_rounds.py`` showed our GQA decode 0.5% behind SDPA at B 32, 32/8, L 8192 on an H100 (rounds spanning
0.08%), and the H200 had it 1.2-1.3% behind. Tile shapes, KV splits and an L2 prefetch of the first tiles were
timed before and do not close it. This probe asks two further questions in one GPU call:

1. **What does SDPA run?** One call of each side under ``torch.profiler``: kernel names and, from the trace, grid,
   block, registers per thread, shared memory and the profiler's occupancy estimate.
2. **Does the way the cache is loaded matter?** A minimal copy of our kernel for this case (contiguous
   ``[B, Hkv, L, D]`` cache, one new token, no split, full tiles only) is timed with one change at a time:

   - ``base``: pointer loads (``cp.async`` through Triton's pipeliner), as ``gqa_decode`` does;
   - ``kvmajor``: programs ordered KV head first, so programs running together read different heads;
   - ``seqload`` / ``kvmajor_seqload``: the loop's bound read from a ``seq_lens`` tensor, as ``gqa_decode`` reads
     it, so the first K/V loads wait for that load (the length given as an argument in the others);
   - ``masked``: ``seqload`` with every tile's K / V loads and scores masked to that length, as ``gqa_decode``'s
     loop masks them (predicated ``cp.async`` with zero fill, and a select on the scores);
   - ``tma``: the K and V tiles through TMA tensor descriptors (host-built, on the 2-D ``[B * Hkv * L, D]``
     view), pipelined by Triton into a ring of shared-memory buffers;
   - ``tma4``: the same with four stages (three 64 KB buffers in flight, against two);
   - ``tma64``: TMA over 64-key tiles, four stages (96 KB: two programs an SM);
   - ``persist`` / ``persist_tma``: one program per SM taking (sequence, KV head) units in turn through one
     flattened tile loop, so the pipeline runs on from one unit's last tiles into the next unit's first ones
     instead of draining and refilling at every unit (the unit's state is reset and its output stored inside the
     loop).

   (``eviction_policy="evict_first"`` was meant to be a variant too, but Triton 3.6 drops it from the pipelined
   ``cp.async`` loads: the sm_90a PTX is the same as ``base``'s.)

   ``gqa_decode_kvmajor`` is ``gqa_decode`` itself with ``triton_decode.KV_MAJOR`` on, ``gqa_decode_masked`` with
   ``triton_decode.SPLIT_TAIL`` off (key masks on every tile, as before session 41; ``masked`` is its minimal
   counterpart). ``gqa_decode`` masks the partial last tile only, its default on a contiguous cache.

   If ``base`` matches ``gqa_decode``, the general kernel's extra code costs nothing here and a variant that beats
   ``base`` names the change to make there.

Every variant is checked against SDPA before it is timed (max abs difference < 5e-3, or RuntimeError). Times are
CUDA-graph replays (``triton.testing.do_bench`` medians), in ``--rounds`` rounds over fresh caches with the
variants' order rotated each round.

    PYTHONPATH=. python3 scripts/probe_gqa_decode.py [--shapes gqa32,gqa128] [--rounds 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_attn.ops.decode import triton_decode as td  # noqa: E402

D = 128
_LOG2E = 1.4426950408889634
# variant -> (load mode, program order: False (b, kv head), True (kv head, b) or "persist", num_stages, keys per tile);
# the *seqload variants read the length from memory (SEQ_LOAD), as gqa_decode reads seq_lens[b]; masked masks every
# tile's keys against it (MASKED), as gqa_decode's loop does
VARIANTS = {
    "base": ("ptr", False, 3, 128),
    "kvmajor": ("ptr", True, 3, 128),
    "seqload": ("ptr", False, 3, 128),
    "kvmajor_seqload": ("ptr", True, 3, 128),
    "masked": ("ptr", False, 3, 128),
    "tma": ("tma", False, 3, 128),
    "tma4": ("tma", False, 4, 128),
    "tma64": ("tma", False, 4, 64),
    "persist": ("ptr", "persist", 3, 128),
    "persist_tma": ("tma", "persist", 3, 128),
}


@triton.jit
def _tile(P, PD, key0, o_n, o_d, m_n, D: tl.constexpr, MODE: tl.constexpr, MASKED: tl.constexpr):
    """The [BLOCK_N, D] K or V tile from key row key0: through the descriptor PD (tma), else pointer loads from P,
    the rows masked by m_n when MASKED."""
    if MODE == "tma":
        return PD.load([key0.to(tl.int32), 0])
    elif MASKED:
        return tl.load(P + (key0 + o_n)[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
    else:
        return tl.load(P + (key0 + o_n)[:, None] * D + o_d[None, :])


@triton.jit
def _mini_decode(Q, K, V, O, KD, VD, SEQ_LENS, qk_scale, batch, seq_len,
                 HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                 MODE: tl.constexpr,  # "ptr" or "tma"
                 KV_MAJOR: tl.constexpr, SEQ_LOAD: tl.constexpr, MASKED: tl.constexpr = False):
    """One program per (sequence, KV head): its GROUP query rows (padded to BLOCK_H) over all seq_len keys,
    which must be a multiple of BLOCK_N (the probe's shapes are). q, o: [B, HKV * GROUP, D]; K, V: [B, HKV, L, D]."""
    pid = tl.program_id(0)
    if KV_MAJOR:
        i_b = pid % batch
        i_kvh = pid // batch
    else:
        i_b = pid // HKV
        i_kvh = pid % HKV
    o_r = tl.arange(0, BLOCK_H)
    m_r = o_r < GROUP
    o_d = tl.arange(0, D)
    row0 = (i_b * HKV + i_kvh) * GROUP
    b_q = tl.load(Q + (row0 + o_r)[:, None].to(tl.int64) * D + o_d[None, :], mask=m_r[:, None], other=0.0)
    seq0 = (i_b * HKV + i_kvh).to(tl.int64) * seq_len  # first key row of this (b, kv head)
    o_n = tl.arange(0, BLOCK_N)
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    n_keys = seq_len
    if SEQ_LOAD:  # the loop's bound waits for this load (the cache's rows still start at seq0)
        n_keys = tl.load(SEQ_LENS + i_b)
    for start in range(0, n_keys, BLOCK_N):
        m_n = start + o_n < n_keys
        b_k = _tile(K, KD, seq0 + start, o_n, o_d, m_n, D, MODE, MASKED)
        b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale
        if MASKED:
            b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None]
        b_v = _tile(V, VD, seq0 + start, o_n, o_d, m_n, D, MODE, MASKED)
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc)
        b_m = b_m_new
    b_o = b_acc / b_l[:, None]
    tl.store(O + (row0 + o_r)[:, None].to(tl.int64) * D + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_r[:, None])


@triton.jit
def _mini_persist(Q, K, V, O, KD, VD, SEQ_LENS, qk_scale, batch, seq_len,
                  HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """_mini_decode's work over num_programs(0) persistent programs: program p takes units p, p + P, ... (unit =
    b * HKV + kv head), all their tiles in one loop; q is reloaded each tile (1 KB against 64 KB of K and V)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    units = batch * HKV
    tiles = seq_len // BLOCK_N
    total = tl.cdiv(units - pid, nprog) * tiles
    o_r = tl.arange(0, BLOCK_H)
    m_r = o_r < GROUP
    o_d = tl.arange(0, D)
    o_n = tl.arange(0, BLOCK_N)
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for it in range(0, total):
        unit = pid + (it // tiles) * nprog
        t = it % tiles
        row0 = unit * GROUP
        key0 = unit.to(tl.int64) * seq_len + t * BLOCK_N
        b_q = tl.load(Q + (row0 + o_r)[:, None].to(tl.int64) * D + o_d[None, :], mask=m_r[:, None], other=0.0)
        if MODE == "tma":
            b_k = KD.load([key0.to(tl.int32), 0])
        else:
            b_k = tl.load(K + (key0 + o_n)[:, None] * D + o_d[None, :])
        first = t == 0
        b_m = tl.where(first, float("-inf"), b_m)
        b_l = tl.where(first, 0.0, b_l)
        b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.where(first, 0.0, tl.exp2(b_m - b_m_new))
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None]
        if MODE == "tma":
            b_v = VD.load([key0.to(tl.int32), 0])
        else:
            b_v = tl.load(V + (key0 + o_n)[:, None] * D + o_d[None, :])
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc)
        b_m = b_m_new
        if t == tiles - 1:
            b_o = b_acc / b_l[:, None]
            tl.store(O + (row0 + o_r)[:, None].to(tl.int64) * D + o_d[None, :], b_o.to(O.dtype.element_ty),
                     mask=m_r[:, None])


def mini_decode(q, k, v, variant: str, block_n: int | None = None, num_warps: int = 4, seq_lens=None):
    """q [B, Hq, 1, D], k / v [B, Hkv, L, D] contiguous, L a multiple of the tile (``block_n``, default the
    variant's): o [B, Hq, 1, D]. The *seqload and masked variants take ``seq_lens`` (int32 [B], each L)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    mode, kv_major, stages, tile = VARIANTS[variant]
    block_n = block_n or tile
    b, hq, s, d = q.shape
    _, hkv, length, dk = k.shape
    if s != 1 or d != dk or hq % hkv or length % block_n or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"mini_decode takes q [B, Hq, 1, D] and contiguous k / v [B, Hkv, L, D] with Hq % Hkv == 0 "
                         f"and L % {block_n} == 0; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    group = hq // hkv
    o = torch.empty_like(q)
    kd = vd = None
    if mode == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        kd = TensorDescriptor.from_tensor(k.view(-1, d), [block_n, d])
        vd = TensorDescriptor.from_tensor(v.view(-1, d), [block_n, d])
    masked = variant == "masked"
    seq_load = variant.endswith("seqload") or masked
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()  # no host read while a graph is captured
    if seq_load and (seq_lens is None or seq_lens.shape != (b,) or (not capturing and bool((seq_lens != length).any()))):
        raise ValueError(f"variant {variant!r} takes seq_lens of shape ({b},), each {length}; got "
                         f"{None if seq_lens is None else tuple(seq_lens.tolist())}")
    args = (q, k, v, o, kd if kd is not None else k, vd if vd is not None else v,
            seq_lens if seq_load else q, d ** -0.5 * _LOG2E, b, length)
    meta = dict(HKV=hkv, GROUP=group, D=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
                MODE=mode, num_warps=num_warps, num_stages=stages)
    if kv_major == "persist":
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 3
        _mini_persist[(min(b * hkv, sms),)](*args, **meta)
    else:
        _mini_decode[(b * hkv,)](*args, KV_MAJOR=kv_major, SEQ_LOAD=seq_load, MASKED=masked, **meta)
    return o


def kernel_table(fn) -> list[dict]:
    """The GPU kernels one call of ``fn`` launches, with the launch facts the profiler's trace records."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    keys = ("grid", "block", "registers per thread", "shared memory", "est. achieved occupancy %")
    return [{"name": e["name"][:90], "us": e.get("dur"), **{k: e.get("args", {}).get(k) for k in keys}}
            for e in events if e.get("cat") == "kernel"]


def _round(b, hq, hkv, length, variants, gen, r, profile=False, dev="cuda", dtype=torch.bfloat16):
    """One round over a fresh cache: ({kernel: seconds}, markdown lines of the profiled kernels). Every kernel is
    checked against SDPA first (RuntimeError past 5e-3); the timing order is rotated by ``r``. ``dev`` / ``dtype``
    are for the CPU test (the interpreter's bf16 dots are wrong); the script times CUDA bf16."""
    import bench_decode as bd


    seq_lens = torch.full((b,), length, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, 1, D, generator=gen, device=dev).to(dtype)
    k = torch.randn(b, hkv, length, D, generator=gen, device=dev).to(dtype)
    v = torch.randn(b, hkv, length, D, generator=gen, device=dev).to(dtype)
    def ours(switch=None, value=True):  # gqa_decode with one module switch of td set (KV_MAJOR, SPLIT_TAIL: in its
        old = getattr(td, switch) if switch else None  # plan key), put back after
        if switch:
            setattr(td, switch, value)
        try:
            return td.gqa_decode(q, k, v, seq_lens, None, D ** -0.5, None)[0]
        finally:
            if switch:
                setattr(td, switch, old)

    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
           "gqa_decode": ours, "gqa_decode_kvmajor": lambda: ours("KV_MAJOR"),
           "gqa_decode_masked": lambda: ours("SPLIT_TAIL", False)}
    for var in variants:
        fns[var] = lambda var=var: mini_decode(q, k, v, var, seq_lens=seq_lens)
    ref = fns["sdpa"]().float().reshape(b, hq, D)
    for key, fn in fns.items():
        err = (fn().float().reshape(b, hq, D) - ref).abs().max().item()
        if not err < 5e-3:  # outputs ~0.03-0.1 here, bf16 rounding ~3e-4; zeros, garbage and NaN fail
            raise RuntimeError(f"{key} differs from SDPA by {err} at B {b} {hq}/{hkv} L {length}")
    lines = []
    if profile:
        for key in ("sdpa", "gqa_decode", *variants[:1]):
            lines += [f"Kernels of `{key}` (torch.profiler):", ""]
            lines += [f"- {row}" for row in kernel_table(fns[key])]
            lines.append("")
    graphs = {key: bd.capture_graph(fn) for key, fn in fns.items()}
    order = list(graphs)
    order = order[r % len(order):] + order[:r % len(order)]
    times = {key: bd._bench(graphs[key].replay) for key in order}
    del graphs
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {key: times[key] for key in fns}, lines


def main(argv=None):
    from decode_rounds import rows_and_generator

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gqa32,gqa128", help="rows of bench_decode.GQA_SHAPES, as gqaB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {list(VARIANTS)}")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    variants = [s for s in a.variants.split(",") if s]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants takes names from {list(VARIANTS)}, got {a.variants!r}")
    known, gen = rows_and_generator(ap, a, "probe_gqa_decode")
    wanted = list(known)
    lines = [f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; commit "
             f"{os.environ.get('GIT_COMMIT', '?')}; GQA decode, bf16, d {D}, one new token, contiguous cache; graph "
             f"replays, {a.rounds} rounds of fresh caches, variants' order rotated per round", ""]
    for name in wanted:
        b, hq, hkv, length = known[name]
        nbytes = b * length * hkv * 2 * D * 2
        lines += [f"## B {b}, {hq}/{hkv}, L {length} ({nbytes / 1e9:.2f} GB of K and V)", ""]
        times = {}
        for r in range(a.rounds):
            got, prof = _round(b, hq, hkv, length, variants, gen, r, profile=r == 0)
            lines += prof
            for key, t in got.items():
                times.setdefault(key, []).append(t)
            print(name, "round", r, {key: f"{t[-1] * 1e6:.1f}" for key, t in times.items()}, flush=True)
        sdpa = statistics.median(times["sdpa"])
        lines += ["| kernel | median us | range us | GB/s | SDPA time / this |", "|---|---|---|---|---|"]
        for key, t in times.items():
            med = statistics.median(t)
            lines.append(f"| {key} | {med * 1e6:.1f} | {min(t) * 1e6:.1f}-{max(t) * 1e6:.1f} | {nbytes / med / 1e9:.0f} "
                         f"| {sdpa / med:.4f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

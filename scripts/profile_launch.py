"""Host-side cost of one eager decode call, or of one training step (CUDA): where the microseconds go
before the GPU starts.

Decode cases and training steps run with ``mla_attn.ops._launch.FAST`` off and on, alternately (cached launch
plans and binder-free launches; ``MLA_ATTN_FAST_LAUNCH``).

At batch 1 a decode step's GPU work is tens of microseconds, so an eager call is only as fast as its
Python path (validation, allocations, Triton's launcher). This times the host side alone (many calls
queued without synchronising) and prints a cProfile of the same calls.

    PYTHONPATH=. python3 scripts/profile_launch.py [--calls 300] [--top 25]
    PYTHONPATH=. python3 scripts/profile_launch.py --train [--calls 100]

``--train``: forward + backward of ``mla_attn.ops.attention`` (causal, bf16): host time per step at a row
whose GPU work is a few microseconds, wall time per step at the 16 x 16/8 x 1024 row against its CUDA-graph
replay, the kernels one step launches (torch.profiler), and a cProfile of the small row's steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def _cases(device):
    import importlib

    import mla_attn

    td = importlib.import_module("mla_attn.ops.decode.triton_decode")
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(1, 32, 128, generator=gen).to(device, bf)
    k = torch.randn(1, 8, 32768, 128, generator=gen).to(device, bf)
    v = torch.randn(1, 8, 32768, 128, generator=gen).to(device, bf)
    lens = torch.full((1,), 32768, dtype=torch.int32, device=device)
    buf = torch.randn(1, 32768, 576, generator=gen).to(device, bf)
    ql = torch.randn(1, 128, 512, generator=gen).to(device, bf)
    qr = torch.randn(1, 128, 64, generator=gen).to(device, bf)
    ql16, qr16 = ql[:, :16].contiguous(), qr[:, :16].contiguous()

    def gqa():
        return mla_attn.decode_attention(q, k, v, lens)

    def gqa_launcher():
        return td.gqa_decode(q.unsqueeze(2), k, v, lens, None, 0.088, None)

    def gqa_1split():
        return mla_attn.decode_attention(q, k, v, lens, num_splits=1)

    def mla():
        return mla_attn.mla_decode(ql, qr, buf[..., :512], buf[..., 512:], lens, scale=0.1)

    def mla16():
        return mla_attn.mla_decode(ql16, qr16, buf[..., :512], buf[..., 512:], lens, scale=0.1)

    # Paged 64, pages in order (the host path does not depend on the order): back to back, the paged calls ran
    # ~30 us slower than the contiguous ones at equal graph times (H100, session 26).
    kp, vp = (t.transpose(1, 2).reshape(512, 64, 8, 128) for t in (k, v))
    table = torch.arange(512, dtype=torch.int32, device=device).view(1, 512)

    def gqa_paged_launcher():
        return td.gqa_decode(q.unsqueeze(2), kp, vp, lens, table, 0.088, None)

    # The same pages in a shuffled order (as bench_decode.py's paged caches): bench_decode's back-to-back
    # column read paged 86 us against contiguous 53 us, where case 5 (pages in order) ran both at the host's
    # 70 us (H100, session 27). Same host path; only the physical page order differs. Measured: shuffled pages
    # ran back to back as fast as contiguous ones (52-53 us), so paging was not the cause.
    perm = torch.randperm(512, generator=gen).to(device)
    kps, vps = torch.empty_like(kp), torch.empty_like(vp)
    kps[perm], vps[perm] = kp, vp
    table_s = perm.view(1, 512).to(torch.int32)

    def gqa_paged_shuffled_launcher():
        return td.gqa_decode(q.unsqueeze(2), kps, vps, lens, table_s, 0.088, None)

    return {"gqa B1 L32768 (auto splits)": gqa, "gqa B1 L32768, launcher gqa_decode (no validation)": gqa_launcher,
            "gqa B1 (num_splits=1, one launch)": gqa_1split, "mla B1 H128 L32768 (auto splits, Gluon)": mla,
            "mla B1 H16 L32768 (auto splits, Triton kernel)": mla16,
            "gqa B1 L32768 paged 64, launcher gqa_decode (no validation)": gqa_paged_launcher,
            "gqa B1 L32768 paged 64 shuffled, launcher gqa_decode (no validation)": gqa_paged_shuffled_launcher}


def _train_cases(device):
    import mla_attn

    gen = torch.Generator().manual_seed(0)
    cases = {}
    for name, (b, hq, hkv, n) in {"train 1x2/1x128 d128": (1, 2, 1, 128),
                                  "train 16x16/8x1024 d128": (16, 16, 8, 1024)}.items():
        q, k, v = (torch.randn(b, h, n, 128, generator=gen).to(device, torch.bfloat16).requires_grad_()
                   for h in (hq, hkv, hkv))
        do = torch.randn(b, hq, n, 128, generator=gen).to(device, torch.bfloat16)

        def step(q=q, k=k, v=v, do=do):
            for t in (q, k, v):
                t.grad = None
            mla_attn.ops.attention(q, k, v, causal=True, impl="triton").backward(do)

        cases[name] = step
    return cases


def _graph_ms(fn, reps=50):
    """Milliseconds per replay of a CUDA graph of fn() (bench_attention._graphed: captured after warm-up)."""
    from bench_attention import _graphed  # scripts/ is on sys.path when this file runs as a script

    replay = _graphed(fn)
    replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _host_and_wall_us(fn, calls, warm):
    """(host us per call with no sync, wall us per call) over `calls` back-to-back calls after `warm` ones."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls
    return host * 1e6, wall * 1e6


def _kernels_per_step(fn, steps=5):
    """(CUDA kernels launched per step, {kernel name: launches per step}) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    names = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            names[ev.name] = names.get(ev.name, 0) + 1
    return sum(names.values()) / steps, {k: c / steps for k, c in sorted(names.items(), key=lambda x: -x[1])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--train", action="store_true", help="forward + backward of the flash attention op")
    ap.add_argument("--profile-case", type=int, default=0,
                    help="decode: which case (0-based, in the printed order) gets the cProfile")
    ap.add_argument("--cases", default=None, help="decode: comma-separated case indices to time (default all)")
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.train:
        return _main_train(args, device)
    from mla_attn.ops import _launch

    cases = list(_cases(device).items())
    chosen = range(len(cases)) if args.cases is None else [int(i) for i in args.cases.split(",")]
    for name, fn in (cases[i] for i in chosen):
        for fast in (False, True, False, True):  # plans and binder-free launches off / on, alternating
            _launch.FAST = fast
            host, wall = _host_and_wall_us(fn, args.calls, 20)
            print(f"{name} [fast launch {'on' if fast else 'off'}]: host {host:.1f} us per call (no sync), "
                  f"wall {wall:.1f} us per call", flush=True)
    _launch.FAST = True
    _cprofile(*cases[args.profile_case], args, ("tottime", "cumulative"), "calls")


def _cprofile(name, fn, args, orders, what):
    """cProfile of args.calls calls of fn, printed in each of `orders` (pstats sort keys)."""
    for order in orders:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile of {args.calls} {what} of {name} ({order} order):")
        pstats.Stats(prof).sort_stats(order).print_stats(args.top)


def _per_call_us(fn, calls=2000):
    """Host us per call, no sync."""
    return _host_and_wall_us(fn, calls, 20)[0]


def _side_stream_forced(fn):
    from mla_attn.ops.attention import triton_bwd

    old = triton_bwd.SIDE_STREAM_DQ, triton_bwd.SIDE_STREAM_MIN_WORK
    triton_bwd.SIDE_STREAM_DQ, triton_bwd.SIDE_STREAM_MIN_WORK = True, 0
    try:
        return fn()
    finally:
        triton_bwd.SIDE_STREAM_DQ, triton_bwd.SIDE_STREAM_MIN_WORK = old


def _host_pieces(device):
    """Host microseconds of the pieces a training step is made of, each timed alone (no profiler)."""
    import mla_attn
    from mla_attn.ops.attention import gluon_fwd, triton_bwd

    bf = torch.bfloat16
    o, do = (torch.randn(1, 2, 128, 128, device=device, dtype=bf) for _ in range(2))
    lse, delta = (torch.zeros(1, 2, 128, device=device) for _ in range(2))
    pre_args = (o, do, delta, lse, lse, *o.stride()[:3], *do.stride(), 0, 0, 0, 2, 128, 128, 128, 64, False)
    jit = lambda: triton_bwd._bwd_preprocess[(2, 2)](*pre_args)  # noqa: E731
    compiled = jit()
    runner = compiled[(2, 2, 1)]
    q = torch.randn(1, 2, 128, 128, device=device, dtype=bf)
    side = torch.cuda.Stream()

    def switch():
        main = torch.cuda.current_stream(device)
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main)

    # The backward's parts, called directly with a forward's saved tensors.
    from mla_attn.ops.attention import gluon_bwd
    from mla_attn.ops.attention.function import _flash_attn_fwd_impl

    kv = q[:, :1].contiguous()
    out, lse1 = _flash_attn_fwd_impl(q, kv, kv, True, 0.1)
    g_lse, g_delta = torch.zeros_like(lse1), torch.zeros_like(lse1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(kv), torch.empty_like(kv)
    leaves = [t.clone().requires_grad_() for t in (q, kv, kv)]

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    def empty_step():
        Empty.apply(*leaves).backward(q)

    def fwd_grad():
        mla_attn.ops.attention(*leaves, causal=True, impl="triton")

    pieces = {
        "forward with grad (public op, graph built)": _per_call_us(fwd_grad, 500),
        "backward launcher alone, dQ on the side stream (forced)": _side_stream_forced(lambda: _per_call_us(
            lambda: triton_bwd.flash_attn_bwd(do, q, kv, kv, out, lse1, True, 0.1), 500)),
        "backward launcher alone, default (one stream below SIDE_STREAM_MIN_WORK)": _per_call_us(
            lambda: triton_bwd.flash_attn_bwd(do, q, kv, kv, out, lse1, True, 0.1), 500),
        "dK/dV pass alone (gluon_bwd.dkdv_gluon)": _per_call_us(
            lambda: gluon_bwd.dkdv_gluon(q, kv, kv, do, g_lse, g_delta, dk, dv, causal=True, scale=0.1), 500),
        "forward launcher alone (gluon_fwd.flash_fwd_gluon)": _per_call_us(
            lambda: gluon_fwd.flash_fwd_gluon(q, kv, kv, causal=True, scale=0.1), 500),
        "autograd: fwd + bwd of a Python Function doing one clone": _per_call_us(empty_step, 500),
    }
    del dq
    with torch.no_grad():
        fwd = lambda: mla_attn.ops.attention(q, q[:, :1], q[:, :1], causal=True, impl="triton")  # noqa: E731
        return pieces | {
            "Triton launch through the JIT (_bwd_preprocess)": _per_call_us(jit),
            "same kernel, compiled[grid](*args) (no binder)": _per_call_us(lambda: runner(*pre_args)),
            "TMA descriptor (gluon_fwd._desc)": _per_call_us(lambda: gluon_fwd._desc(q.view(256, 128), 128, 128,
                                                                                      gluon_fwd.gl.bfloat16)),
            "stream switch and back": _per_call_us(switch),
            "side.wait_stream(main)": _per_call_us(lambda: side.wait_stream(torch.cuda.current_stream(device))),
            "torch.empty (1, 2, 128, 128)": _per_call_us(lambda: torch.empty(1, 2, 128, 128, device=device, dtype=bf)),
            "forward alone (no grad, public op)": _per_call_us(fwd, 500),
        }


def _main_train(args, device):
    from mla_attn.ops import _launch

    for fast in (False, True):  # the Gluon launchers' plans (gluon_fwd.DescPlan) off / on
        _launch.FAST = fast
        for name, us in _host_pieces(device).items():
            print(f"piece [fast launch {'on' if fast else 'off'}]: {name}: {us:.1f} us", flush=True)
    cases = _train_cases(device)
    for name, fn in cases.items():
        for fast in (False, True, False, True):
            _launch.FAST = fast
            host, wall = _host_and_wall_us(fn, args.calls, 10)
            print(f"{name} [fast launch {'on' if fast else 'off'}]: host {host:.1f} us per step (no sync), "
                  f"wall {wall:.1f} us per step", flush=True)
        graph = _graph_ms(fn)
        print(f"{name}: CUDA-graph replay {graph * 1e3:.1f} us per step", flush=True)
        count, names = _kernels_per_step(fn)
        print(f"  kernels per step: {count:g}: " + ", ".join(f"{k[:60]} x{c:g}" for k, c in names.items()), flush=True)
    _cprofile(*next(iter(cases.items())), args, ("tottime", "cumulative"), "steps")


if __name__ == "__main__":
    main()

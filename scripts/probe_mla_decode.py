"""Where the Gluon MLA decode kernel's time goes (H200 diagnostics, not a benchmark table for users).

Three probes, each timed as CUDA-graph replays (triton.testing.do_bench median):

1. **Tile rate.** Unsplit calls with one program per SM (B x H/64 = 132) at fixed lengths L: the time
   against L / 64 tiles is a line whose slope is the steady time per 64-key tile and whose intercept is
   the per-program fixed cost (Q load, ring fill, epilogue, launch).
2. **Same, cache in L2.** A paged cache where every sequence's block table points at the same pages, so
   the programs read one sequence's few MB: the slope without HBM (compute, shared memory and the L2
   path only).
3. **Batch 1 split sweep.** B = 1, H = 128, L = 32768: the step's time against num_splits, with the
   decode kernel's and the combine's own GPU durations (torch.profiler).
4. **Batch 1, default schedule only** (``--b1``, alone): more split counts, and the combine's tile rule
   (``combine._TARGET_PROGRAMS`` etc.) varied, each row with its output's max abs difference from the
   float32 reference, so a faster rule is also checked on the GPU.

Each line is one consumer schedule of ``gluon_mla`` (``_schedules``: the default first, the experimental
ones last, and only when MLA_ATTN_PROBE_EXPERIMENTAL is not 0). The table is rewritten after every line,
so a hang or a time limit keeps what was measured.

    PYTHONPATH=. python3 scripts/probe_mla_decode.py [OUT.md]
    PYTHONPATH=. python3 scripts/probe_mla_decode.py --b1 [OUT.md]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import _bench_graph  # noqa: E402
from profile_decode import _kernel_us  # noqa: E402


def _write(out, lines):
    """The table so far (a hang or a time limit later keeps what was measured)."""
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def _fit(xs, ys):
    """Least-squares line y = a + b x -> (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _schedules():
    """(s_once, pv_first, dedicated) of the schedules to time; the experimental ones (not yet run on a GPU
    when written) last, and left out when MLA_ATTN_PROBE_EXPERIMENTAL=0 (gpu_check.sh sets it when their
    tests failed)."""
    out = [(True, 1, 1), (True, 1, 0), (True, 0, 0), (False, 0, 0)]
    if os.environ.get("MLA_ATTN_PROBE_EXPERIMENTAL", "1") != "0":
        out += [(True, 2, 0), (True, 1, 2), (True, 1, 3)]
    return out


def _schedule_name(s_once, pv_first, dedicated):
    if not s_once:
        return "scores twice"
    if dedicated:
        return "S once, dedicated scorer" + {1: "", 2: ", Q half in registers", 3: ", S issued early"}[dedicated]
    return ["S once, S first", "S once, PV first", "S once, PV first, waited"][pv_first]


def main(out, dev="cuda", lengths=(64, 1024, 4096, 8192)):
    from mla_attn.ops.decode import gluon_mla

    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    scale = 192 ** -0.5
    lines = [f"# Gluon MLA decode probe ({torch.cuda.get_device_name()})", ""]

    def queries(b, h):
        return (torch.randn(b, h, 512, generator=gen).to(dev, dt), torch.randn(b, h, 64, generator=gen).to(dev, dt))

    lines += ["## Tile rate (unsplit, one program per SM, graph replay us)", "",
              "| B | H | cache | schedule | " + " | ".join(f"L {n}" for n in lengths) + " | us per 64-key tile | fixed us |"
              " TFLOP/s per tile |", "|---|---|---|---|" + "---|" * len(lengths) + "---|---|---|"]
    # every schedule at H = 128 from HBM; the default and the S-first order on the other two
    for b, h, cache, scheds in [(66, 128, "hbm", _schedules()), (66, 128, "l2", _schedules()[:2]),
                                (132, 64, "hbm", _schedules()[:2])]:
        ql, qr = queries(b, h)
        times = {sc: [] for sc in scheds}
        for n in lengths:
            seq_lens = torch.full((b,), n, dtype=torch.int32, device=dev)
            if cache == "hbm":
                buf = torch.randn(b, n, 576, generator=gen).to(dev, dt)
                kv, kr, bt = buf[..., :512], buf[..., 512:], None
            else:  # every sequence's pages are the same n / 64 pages: the whole cache stays in L2
                pages = torch.randn(n // 64, 64, 576, generator=gen).to(dev, dt)
                kv, kr = pages[..., :512], pages[..., 512:]
                bt = torch.arange(n // 64, dtype=torch.int32, device=dev).expand(b, -1).contiguous()
            for sc in scheds:
                def step(sc=sc):
                    return gluon_mla.mla_decode_gluon(ql, qr, kv, kr, seq_lens, bt, scale, num_splits=1,
                                                      s_once=sc[0], pv_first=sc[1], dedicated=sc[2])[0]

                t = _bench_graph(step)
                times[sc].append(t * 1e6 if t else float("nan"))
            torch.cuda.empty_cache()
        for sc in scheds:
            a, slope = _fit([n / 64 for n in lengths], times[sc])
            tf = 2 * 64 * 64 * 1088 * (b * h // 64) / (slope * 1e-6) / 1e12
            lines.append(f"| {b} | {h} | {cache} | {_schedule_name(*sc)} | "
                         + " | ".join(f"{t:.1f}" for t in times[sc]) + f" | {slope:.3f} | {a:.1f} | {tf:.0f} |")
            print(lines[-1], flush=True)
            _write(out, lines)

    lines += ["", "## Batch 1, H 128, L 32768 (fixed length): split count", "",
              "| num_splits | schedule | step us (graph) | TFLOP/s | decode kernel us | combine us |", "|---|---|---|---|---|---|"]
    b, h, n = 1, 128, 32768
    ql, qr = queries(b, h)
    buf = torch.randn(b, n, 576, generator=gen).to(dev, dt)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    flops = 2.0 * h * n * 1088
    for splits, pv_first, ded in [(s_, p_, d_) for once, p_, d_ in _schedules() if once for s_ in (48, 66)]:
        def step():
            return gluon_mla.mla_decode_gluon(ql, qr, buf[..., :512], buf[..., 512:], seq_lens, None, scale,
                                              num_splits=splits, pv_first=pv_first, dedicated=ded)[0]

        t = _bench_graph(step)
        ks = _kernel_us(step)
        dec = sum(v for k, v in ks.items() if "mla_decode" in k)
        comb = sum(v for k, v in ks.items() if "combine" in k)
        lines.append(f"| {splits} | {_schedule_name(True, pv_first, ded)} | {t * 1e6:.1f} | {flops / t / 1e12:.0f} | {dec:.1f} | {comb:.1f} |")
        print(lines[-1], flush=True)
        _write(out, lines)


# combine rules for the B = 1 sweep: (target programs, elements a step, most parts a step, most columns,
# programmatic dependent launch)
COMBINE_RULES = {
    "default": None,
    "default, PDL launch": (256, 8192, 32, 256, True),
    "1 row x 64 cols, 128 parts a step": (1024, 8192, 128, 64, False),
    "1 row x 128 cols, 64 parts a step": (512, 8192, 64, 128, False),
    "1 row x 128 cols, 128 parts a step": (512, 16384, 128, 128, False),
    "1 row x 64 cols, 128 parts a step, PDL launch": (1024, 8192, 128, 64, True),
}
_RULE_NAMES = ("_TARGET_PROGRAMS", "_STEP_ELEMENTS", "_MAX_CHUNK", "_MAX_DV", "_PDL")


def b1_sweep(out, dev="cuda", splits_list=(60, 64, 66, 72, 80, 96), rule_splits=(64, 66), n=32768):
    """The default schedule at B = 1, H = 128: step time against num_splits, then the combine's tile rules
    at ``rule_splits``; every row's output checked against the float32 reference."""
    from mla_attn.ops.decode import combine, gluon_mla
    from mla_attn.ops.decode.reference import mla_decode_reference

    gen = torch.Generator().manual_seed(1)
    dt, scale, h = torch.bfloat16, 192 ** -0.5, 128
    ql = torch.randn(1, h, 512, generator=gen).to(dev, dt)
    qr = torch.randn(1, h, 64, generator=gen).to(dev, dt)
    buf = torch.randn(1, n, 576, generator=gen).to(dev, dt)
    seq_lens = torch.full((1,), n, dtype=torch.int32, device=dev)
    ref = mla_decode_reference(ql.unsqueeze(2).float(), qr.unsqueeze(2).float(), buf[..., :512].float(),
                               buf[..., 512:].float(), seq_lens, None, scale)[0].squeeze(2)
    flops = 2.0 * h * n * 1088
    lines = [f"# Gluon MLA decode, B 1, H {h}, L {n}: splits and combine rules ({torch.cuda.get_device_name()})", "",
             f"schedule: {_schedule_name(True, gluon_mla.PV_FIRST, gluon_mla.DEDICATED)}; combine default rule "
             f"{_RULE_NAMES}: {tuple(getattr(combine, a) for a in _RULE_NAMES)}", "",
             "| num_splits | combine rule | tiles (rows, cols, parts a step, warps) | step us (graph) | TFLOP/s "
             "| decode kernel us | combine us | max abs diff vs fp32 |", "|---|---|---|---|---|---|---|---|"]
    saved = tuple(getattr(combine, a) for a in _RULE_NAMES)
    cases = [(s_, "default") for s_ in splits_list] + [(s_, r) for s_ in rule_splits for r in COMBINE_RULES
                                                        if r != "default"]
    for splits, rule in cases:
        vals = COMBINE_RULES[rule] or saved
        for a, v in zip(_RULE_NAMES, vals):
            setattr(combine, a, v)
        try:
            def step():
                return gluon_mla.mla_decode_gluon(ql, qr, buf[..., :512], buf[..., 512:], seq_lens, None, scale,
                                                  num_splits=splits)[0]

            diff = (step().float() - ref).abs().max().item()
            t = _bench_graph(step)
            ks = _kernel_us(step)
            dec = sum(v for k, v in ks.items() if "mla_decode" in k)
            comb = sum(v for k, v in ks.items() if "combine" in k)
            tiles = combine._combine_tiles(splits, h, 512, *vals[:4])
            lines.append(f"| {splits} | {rule} | {tiles} | {t * 1e6:.1f} | {flops / t / 1e12:.0f} | {dec:.1f} "
                         f"| {comb:.1f} | {diff:.1e} |")
        except Exception as e:  # one rule failing (a launch option, a capture) must not lose the others
            lines.append(f"| {splits} | {rule} | failed: {type(e).__name__}: {str(e)[:120]} | | | | | |")
        finally:
            for a, v in zip(_RULE_NAMES, saved):
                setattr(combine, a, v)
        print(lines[-1], flush=True)
        _write(out, lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--b1"]
    if "--b1" in sys.argv[1:]:
        b1_sweep(args[0] if args else "probe_mla_b1.md")
    else:
        main(args[0] if args else "probe_mla_decode.md")

"""The GPU diagnostic scripts' arithmetic, checked off the GPU with the kernels stubbed out.

scripts/probe_mla_decode.py fits time against tiles to get the per-tile rate, and scripts/trace_flash_fwd.py
turns clock64 stamps into per-step medians. A device call is too scarce to find a slip in either, so
here they are fed synthetic timings whose answer is known.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))


def _stub_mla(monkeypatch, probe, per_tile, fixed):
    """The Gluon MLA decode stubbed, and graph timing that returns fixed + per_tile * tiles (seconds) for the
    call just made, so the fit must find exactly those."""
    from mla_attn.ops.decode import gluon_mla

    seen = []

    def fake(ql, qr, kv, kr, seq_lens, bt, scale, num_splits=None, **kw):
        seen.append((int(seq_lens[0]), kw.get("s_once"), kw.get("pv_first"), kw.get("dedicated")))
        return (ql.new_zeros(1),)

    monkeypatch.setattr(gluon_mla, "mla_decode_gluon", fake)
    monkeypatch.setattr(probe, "_bench_graph", lambda fn: (fn(), fixed + per_tile * seen[-1][0] / 64)[1])
    monkeypatch.setattr(probe, "_kernel_us", lambda fn: {"_mla_decode_s1": 30.0, "_combine_kernel": 7.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    return seen


@pytest.mark.parametrize("experimental", ["1", "0"])
def test_probe_fits_per_tile_time(tmp_path, monkeypatch, experimental):
    import probe_mla_decode as probe

    monkeypatch.setenv("MLA_ATTN_PROBE_EXPERIMENTAL", experimental)
    seen = _stub_mla(monkeypatch, probe, per_tile=2.5e-6, fixed=20e-6)
    out = tmp_path / "probe.md"
    probe.main(str(out), dev="cpu", lengths=(64, 128, 256, 512))
    rows = [r for r in out.read_text().splitlines() if r.startswith("| 66 | 128 | hbm")]
    names = [r.split(" | ")[3] for r in rows]
    assert names[0] == "S once, dedicated scorer" and "S once, PV first" in names and "scores twice" in names
    assert any("Q half" in n or "waited" in n for n in names) == (experimental == "1")
    for r in rows:  # slope 2.5 us a tile, intercept 20 us, as fed
        cells = r.strip("|").split(" | ")
        assert cells[-3].strip() == "2.500" and cells[-2].strip() == "20.0", r
    assert {s[1:] for s in seen if s[1] is not None} == {sc for sc in probe._schedules()}


def test_probe_b1_sweep_rows_and_restores_rule(tmp_path, monkeypatch):
    """--b1: one row per split count and per alternative combine rule, each with the rule's tiles and
    the output's difference from the float32 reference; the module's rule is restored after each row."""
    import probe_mla_decode as probe

    from mla_attn.ops.decode import combine, gluon_mla
    from mla_attn.ops.decode.reference import mla_decode_reference

    rules_seen = []

    def fake(ql, qr, kv, kr, seq_lens, bt, scale, num_splits=None, **kw):
        rules_seen.append(tuple(getattr(combine, a) for a in probe._RULE_NAMES))
        o = mla_decode_reference(ql.unsqueeze(2).float(), qr.unsqueeze(2).float(), kv.float(), kr.float(), seq_lens,
                                 None, scale)[0].squeeze(2)
        return (o + 0.25,)  # off by exactly 0.25 everywhere

    monkeypatch.setattr(gluon_mla, "mla_decode_gluon", fake)
    monkeypatch.setattr(probe, "_bench_graph", lambda fn: (fn(), 40e-6)[1])
    monkeypatch.setattr(probe, "_kernel_us", lambda fn: {"_mla_decode_s1": 30.0, "_combine_kernel": 7.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    saved = tuple(getattr(combine, a) for a in probe._RULE_NAMES)
    out = tmp_path / "b1.md"
    probe.b1_sweep(str(out), dev="cpu", splits_list=(60, 64), rule_splits=(66,), n=256)
    rows = [r for r in out.read_text().splitlines() if r.startswith("| 6")]
    assert len(rows) == 2 + len(probe.COMBINE_RULES) - 1
    assert all(r.split(" | ")[-1].startswith("2.5e-01") for r in rows)
    assert tuple(getattr(combine, a) for a in probe._RULE_NAMES) == saved
    assert set(rules_seen) == {saved} | {v for v in probe.COMBINE_RULES.values() if v}
    assert "(1, 64, 128, 4)" in out.read_text()


@pytest.mark.skipif(not __import__("mla_attn.ops.attention.gluon_fwd", fromlist=["AVAILABLE"]).AVAILABLE,
                    reason="needs Triton's Gluon (for the TRACE buffer's shape)")
def test_flash_trace_medians(monkeypatch):
    import triton

    import trace_flash_fwd as trace
    from mla_attn.ops.attention import gluon_fwd

    deltas = {0: 0, 2: 300, 4: 900, 5: 1500, 6: 1700, 8: 2200}  # event -> cycles after the step's start

    def fake(q, k, v, causal, scale, token_major=False, trace=None):
        if trace is not None:
            for j in range(40):
                for e, d in deltas.items():
                    trace[0, j, e] = 1000 + 3000 * j + d
        return (q.new_zeros(1),)

    monkeypatch.setattr(gluon_fwd, "flash_fwd_gluon", fake)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    real_to, real_zeros = torch.Tensor.to, torch.zeros
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: real_to(self, *("cpu" if x == "cuda" else x
                                                                                   for x in a), **kw))
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: real_zeros(*a, **{**kw, "device": "cpu"}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    lines = []
    trace._run(1, 2, 2, 256, 128, 128, lines)
    assert lines[0].endswith("40 steady steps stamped")
    assert lines[2].split()[:2] == ["period", "3000"]
    parts = {ln[:13].strip(): int(ln[13:].split()[0]) for ln in lines[3:8]}
    assert parts == {"barrier": 300, "S issue": 600, "softmax": 600, "P V wait": 200, "S wait": 500}


def _dedicated_stamps(n_tiles, tiles=64):
    """Synthetic stamps of the dedicated-scorer build with a known schedule: a 4000-cycle period, S issued
    100 after the tile lands and done 2800 later, and so on (the expected parts: DEDICATED_WANT)."""
    x = torch.zeros(4, tiles, 8, dtype=torch.int64)
    for t in range(n_tiles):
        b = 10_000 + 4000 * t  # tile t lands for the scorer
        x[0, t, :6] = torch.tensor([b, b + 100, b + 2900, b + 3800, b + 3850, b + 4300])
        pub = b + 4300
        for w, start, dur in ((1, 200, 1000), (2, 250, 1100)):
            x[w, t, 0] = pub - 50
            x[w, t, 1] = pub + start
            x[w, t, 2] = pub + start + dur
        x[1, t, 3] = pub + 250 + 1100 + 30  # loads of t + 2, 30 after both P V are done
    x[3, :3, 0] = torch.tensor([9_000, 8_000, 9_100])  # starts: scorer, P V 0, P V 1
    return x


DEDICATED_WANT = dict(period=4000, scorer_wait_data=0, s_issue=100, s_wait=2800, softmax=900, pfree_wait=50,
                      publish=450, pv0_start=200, pv1_start=250, pv0=1000, pv1=1100, refill=30,
                      tma=8000 - 4300 - 1380)


def test_dedicated_trace_rows():
    """The dedicated-scorer trace's per-tile parts, from synthetic stamps with a known schedule."""
    import trace_mla_decode as trace

    n_tiles = 12
    rows = trace.dedicated_rows(_dedicated_stamps(n_tiles), n_tiles, 64)
    assert len(rows) == n_tiles - 1 - 1 - 3
    for r in rows:
        assert r == DEDICATED_WANT
    assert trace.dedicated_rows(_dedicated_stamps(6), 6, 64) == []  # too few tiles for a steady state


@pytest.mark.skipif(not __import__("mla_attn.ops.decode.gluon_mla", fromlist=["AVAILABLE"]).AVAILABLE,
                    reason="needs Triton's Gluon (for the TRACE buffer's shape)")
def test_dedicated_trace_report(monkeypatch):
    """The dedicated case's report: the prologue line from the loading warpgroup's start, every part's
    median, and a timeline, from the synthetic stamps (the traced run stubbed out)."""
    import trace_mla_decode as trace

    lines = []
    monkeypatch.setattr(trace, "_traced_case", lambda b, h, n, splits, out, title, **kw: (
        _dedicated_stamps(12), 12, out.append))
    trace._run_dedicated(66, 128, 768, 1, lines, 1)
    text = "\n".join(lines)
    assert "scorer start 1000" in text and "P V 1 start 1100" in text and "tile 0 landed 2000" in text
    for k, v in DEDICATED_WANT.items():
        assert any(line.split() == [k, str(v)] for line in lines), k
    assert "timeline of up to 4 steady tiles" in text and "pv1 t7 PV done" in text


def test_flash_block_timeline_analysis():
    """Two SMs run eight row blocks back to back at 2 GHz: key loop 5000 + 1800 x tiles cycles, epilogue
    3000, 1000 cycles between blocks, and SM 1 starts 500 cycles late. The report must find those."""
    import trace_flash_blocks as tfb

    n_mb, ghz = 4, 2.0

    def tiles_of(g):
        return 2 * (n_mb - g)

    x = torch.zeros(8, 9, dtype=torch.int64)
    clock = {0: 10_000, 1: 10_500}
    for i in range(8):
        sm = i % 2
        c0 = clock[sm]
        c1 = c0 + 5000 + 1800 * tiles_of(i % n_mb)
        c2 = c1 + 3000
        clock[sm] = c2 + 1000
        for k, c in enumerate((c0, c1, c2)):
            x[i, 3 * k:3 * k + 3] = torch.tensor([int(c / ghz), c, sm])
    text = "\n".join(tfb.analyse(x, n_mb, tiles_of))
    assert "2.000 GHz" in text and "4.0 a SM" in text
    assert "5000 +   1800 x tiles" in text
    assert "epilogue              3000" in text and "gap to next block     1000" in text
    rest = [ln for ln in text.splitlines() if ln.strip().startswith("rest")][0]
    assert abs(float(rest.split()[1].rstrip("%"))) < 0.5, text  # every cycle accounted for
    assert tfb.block_tiles(0, 2048, 2048, 128, 64, True) == 2 and tfb.block_tiles(15, 2048, 2048, 128, 64, True) == 32
    x[3, 6] = 0
    with pytest.raises(ValueError, match="program 3"):
        tfb.analyse(x, n_mb, tiles_of)


def test_bench_decode_back_to_back_column(monkeypatch):
    """bench_decode's 'eager back to back' column: wall time per call over calls issued in a row (the host
    included), and the markdown row carries it in the header's last column."""
    import time

    import bench_decode

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    per_call = bench_decode._bench_b2b(lambda: (calls.append(1), time.sleep(0.002)), calls=20)
    assert len(calls) == 30  # 10 warm-up calls, then the 20 timed
    assert 0.002 <= per_call < 0.02
    row = dict(op="gqa", impl="triton", B=1, H="32/8", L=1024, us=10.0, gbs=1.0, tflops=1.0, graph_us=9.0,
               graph_gbs=1.0, layers_us=None, layers_gbs=None, b2b_us=12.5)
    cells = bench_decode._row_md(row).strip("|").split("|")
    header = bench_decode.HEADER.splitlines()[0].strip("|").split("|")
    assert len(cells) == len(header) and header[-1].strip() == "eager back to back (us)"
    assert cells[-1].strip() == "12.5"


def test_bench_decode_switch_variants():
    """--tail-variants / --fused-variants rows: each named call four times, on / off alternating, the module switch
    set while the row runs (and while its layered step runs) and put back after."""
    import bench_decode

    from mla_attn.ops.decode import triton_decode as td

    seen = []
    cands = {"triton": lambda: seen.append(td.SPLIT_TAIL), "sdpa": lambda: None}
    layered = {"triton": lambda: lambda: seen.append(("step", td.SPLIT_TAIL))}
    bench_decode._tail_variants(cands, layered, ["triton"])
    tags = [k for k in cands if k.startswith("triton ")]
    assert tags == ["triton tail #1", "triton masked #1", "triton tail #2", "triton masked #2"]
    for tag in tags:
        cands[tag]()
        layered[tag]()()
    assert seen == [True, ("step", True), False, ("step", False), True, ("step", True), False, ("step", False)]
    assert td.SPLIT_TAIL is None and "sdpa tail #1" not in cands
    bench_decode._fused_variants(cands, layered, ["triton"])
    assert "triton fused #1" in cands and "triton combine #2" in cands


def test_bench_decode_tail_pipe_variants():
    """--tail-pipe-variants rows: SPLIT_TAIL forced on with TAIL_PIPELINED on / off, and every tile masked, in
    rotation, the switches put back after; each split-tail row's first call is checked against the row's output with
    every tile masked, and a variant that differs raises instead of being timed."""
    import bench_decode

    from mla_attn.ops.decode import triton_decode as td

    seen = []

    def triton():
        seen.append((td.SPLIT_TAIL, td.TAIL_PIPELINED))
        return torch.ones(2), None

    cands = {"triton": triton}
    layered = {"triton": lambda: lambda: seen.append(("step", td.SPLIT_TAIL, td.TAIL_PIPELINED))}
    bench_decode._tail_pipe_variants(cands, layered, ["triton"])
    tags = [k for k in cands if k != "triton"]
    assert tags == ["triton pipe #1", "triton regs #1", "triton masked #1",
                    "triton pipe #2", "triton regs #2", "triton masked #2"]
    assert list(layered) == ["triton"] + tags
    cands["triton pipe #1"]()  # the variant, then its reference with every tile masked
    assert seen == [(True, True), (False, False)]
    cands["triton pipe #1"]()  # checked once
    layered["triton regs #1"]()()
    cands["triton masked #2"]()  # the reference itself: not checked against itself
    assert seen[2:] == [(True, True), ("step", True, False), (False, False)]
    assert td.SPLIT_TAIL is None and td.TAIL_PIPELINED is False

    bad = bench_decode._checked_against(lambda: torch.ones(3) * 1.05, lambda: (torch.ones(3), None))
    with pytest.raises(RuntimeError, match="differs from its reference by 0.05"):
        bad()
    nan = bench_decode._checked_against(lambda: torch.full((3,), float("nan")), lambda: torch.ones(3))
    with pytest.raises(RuntimeError, match="nan"):
        nan()


def test_plot_odd_widths_reads_the_bench_table():
    # The bar chart's parser against a table bench_attention.py --odd-widths wrote on the GPU (no matplotlib).
    import plot_odd_widths

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = plot_odd_widths.read_rows(os.path.join(root, "docs", "raw", "bench_odd_widths_890d698_h100.md"))
    assert [r["label"].split("\n")[0] for r in rows] == ["64/64", "40/40", "72/72", "72/72", "80/80", "96/96",
                                                          "160/160"]
    assert rows[-1]["fwd+bwd"] == [28.0, 28.0, 252.0, 262.0] and rows[2]["fwd"] == [100.0, 212.0, 217.0, 289.0]


def _stub_row_repeat(monkeypatch, timings):
    """scripts/bench_row_repeat.py with no GPU: inputs stubbed, and each A B B A pair it times returns the next
    (first, second) milliseconds from ``timings`` (an iterator the test may swap: ``feed[0]``)."""
    import bench_attention as ba

    feed = [iter(timings)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(ba, "_inputs", lambda *a, **kw: (None, None, None))
    monkeypatch.setattr(ba, "_ms_pair", lambda fa, fb, grads=None: next(feed[0]))
    return feed


def test_row_repeat_ratios_and_median(tmp_path, monkeypatch):
    """scripts/bench_row_repeat.py: each round's ratio is SDPA's time over ours, its TF/s from the causal FLOPs,
    and the summary line's median and range come from those rounds (timings fed, one per round and mode)."""
    import bench_row_repeat as rr

    _stub_row_repeat(monkeypatch, [(2.0, 1.8), (1.0, 0.9), (2.0, 1.9), (1.0, 1.0), (2.0, 1.6), (1.0, 0.8)])  # ms
    out = tmp_path / "r.md"
    rr.main(["--row", "1,1,1,100000,64,64", "--rounds", "3", "--out", str(out)])
    text = out.read_text()
    rows = [r for r in text.splitlines() if r[:4] in ("| 0 ", "| 1 ", "| 2 ")]
    # forward FLOPs 2 * 1 * 1 * 1e5^2 * 128 / 2 = 1.28e12: 640 TF/s at 2 ms, 711 at 1.8, 1280 at 1, 1422 at 0.9
    assert rows[0].split(" | ")[1:3] == ["640", "711"] and rows[0].split(" | ")[4:6] == ["1280", "1422"]
    assert [r.split(" | ")[3] for r in rows] == ["0.900", "0.950", "0.800"]
    assert [r.split(" | ")[6].rstrip(" |") for r in rows] == ["0.900", "1.000", "0.800"]
    assert "no_grad 0.900 (range 0.800-0.950), grad mode 0.900 (range 0.800-1.000)" in text
    with pytest.raises(SystemExit):
        rr.main(["--row", "1,2"])


def test_row_repeat_direct_column(tmp_path, monkeypatch):
    """--direct: the Gluon kernel called directly, timed against the op under no_grad; its column is the op's
    rate over the direct call's, and a row the op does not route to Gluon prints '-' there."""
    import bench_row_repeat as rr

    # per round: no_grad (ours, SDPA), then (op, direct), then grad mode (ours, SDPA); ms
    feed = _stub_row_repeat(monkeypatch, [(2.0, 1.8), (2.0, 1.6), (1.0, 0.9), (2.0, 1.8), (2.2, 2.0), (1.0, 0.9)])
    monkeypatch.setattr(rr, "_direct", lambda q, k, v, scale: (lambda: None))
    out = tmp_path / "r.md"
    rr.main(["--row", "1,1,1,100000,64,64", "--rounds", "2", "--direct", "--out", str(out)])
    text = out.read_text()
    rows = [r for r in text.splitlines() if r[:4] in ("| 0 ", "| 1 ")]
    # direct at 1.6 ms: 800 TF/s, op / direct 1.6 / 2.0 = 0.800; then 2.0 / 2.2 = 0.909
    assert [r.strip(" |").split(" | ")[-2:] for r in rows] == [["800", "0.800"], ["640", "0.909"]]
    assert "op / direct kernel (no_grad) 0.855 (range 0.800-0.909)" in text
    monkeypatch.setattr(rr, "_direct", lambda q, k, v, scale: None)
    feed[0] = iter([(2.0, 1.8), (1.0, 0.9)])
    rr.main(["--row", "1,1,1,100000,64,64", "--rounds", "1", "--direct", "--out", str(out)])
    row, = [r for r in out.read_text().splitlines() if r.startswith("| 0 ")]
    assert row.strip(" |").split(" | ")[-2:] == ["-", "-"]


def test_decode_rounds_ratios_and_medians(tmp_path, monkeypatch):
    """scripts/decode_rounds.py: each round's ratio is SDPA's time over ours, GB/s from the row's cache bytes, and
    the medians and ranges come from those rounds; the A B B A pair averages each side's two runs."""
    import bench_decode as bd
    import decode_rounds as dr

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(torch, "Generator", lambda device=None: type("G", (), {"manual_seed": lambda s, x: s})())
    # per round (graph, 8-layer step) as (ours, SDPA) seconds
    feed = iter([((100e-6, 99e-6), (90e-6, 91e-6)), ((100e-6, 101e-6), (90e-6, 90e-6)),
                 ((100e-6, 100e-6), (90e-6, 88.2e-6))])
    monkeypatch.setattr(dr, "_round",
                        lambda b, hq, hkv, length, gen, layers: dict(zip(("graph", "layers"), next(feed))))
    out = tmp_path / "d.md"
    dr.main(["--shapes", "gqa32", "--rounds", "3", "--out", str(out)])
    text = out.read_text()
    rows = [r for r in text.splitlines() if r[:4] in ("| 0 ", "| 1 ", "| 2 ")]
    # B 32 x 8192 tokens x 8 KV heads x (128 + 128) x 2 bytes = 1.0737e9 bytes: 10737 GB/s at 100 us, 11930 at 90
    assert rows[0].strip(" |").split(" | ")[1:] == ["100.0", "99.0", "10737", "0.9900",
                                                    "90.0", "91.0", "11930", "1.0111"]
    assert [r.split(" | ")[4] for r in rows] == ["0.9900", "1.0100", "1.0000"]
    assert "gqa32 graph: median ratio 1.0000 (range 0.9900-1.0100), ours median 10737 GB/s" in text
    assert "gqa32 8-layer step: median ratio 1.0000 (range 0.9800-1.0111), ours median 11930 GB/s" in text
    for bad in (["--shapes", "gqa5"], ["--rounds", "0"], ["--layers", "-1"], ["--shapes", ""]):
        with pytest.raises(SystemExit):
            dr.main(bad)
    runs = iter([1.0, 5.0, 7.0, 3.0])  # A B B A
    monkeypatch.setattr(bd, "_bench", lambda fn: next(runs))
    assert dr._pair(None, None) == (2.0, 6.0)


def test_decode_rounds_round_runs_and_checks(monkeypatch):
    """decode_rounds._round on the CPU (the decode kernel under the interpreter, graphs and timing stubbed): it
    checks ours against SDPA before timing, and a wrong kernel stops it rather than being timed."""
    import bench_decode as bd
    import decode_rounds as dr
    from mla_attn.ops.decode import triton_decode

    monkeypatch.setattr(bd, "capture_graph", lambda fn: type("G", (), {"replay": staticmethod(fn)})())
    calls = []
    monkeypatch.setattr(bd, "_bench", lambda fn: (calls.append(fn()), 1e-4)[1])
    gen = torch.Generator().manual_seed(0)
    res = dr._round(2, 4, 2, 40, gen, 3, dev="cpu", dtype=torch.float32)
    assert res == {"graph": (1e-4, 1e-4), "layers": (1e-4 / 3, 1e-4 / 3)} and len(calls) == 8
    real = triton_decode.gqa_decode
    monkeypatch.setattr(triton_decode, "gqa_decode", lambda *a, **kw: (real(*a, **kw)[0] * 0.5, None))
    with pytest.raises(RuntimeError, match="differs from SDPA"):
        dr._round(2, 4, 2, 40, gen, 0, dev="cpu", dtype=torch.float32)


@pytest.mark.parametrize("variant", ["base", "kvmajor", "seqload", "kvmajor_seqload", "masked", "tma", "tma4", "tma64",
                                     "persist", "persist_tma"])
def test_probe_gqa_decode_mini_kernel_matches_the_oracle(variant):
    """scripts/probe_gqa_decode.py's minimal GQA decode kernel, every load variant, under the interpreter in fp32
    (3 sequences, 8/2 and 6/1 heads, two tiles of keys; the persistent ones on 3 programs, so one takes two units) against the float64 oracle; tolerance 1e-5 (fp32 dots of 128
    terms, softmax over 64 keys; outputs are O(0.1))."""
    import probe_gqa_decode as probe

    from mla_attn.testing.oracle import attention_oracle

    gen = torch.Generator().manual_seed(1)
    for b, hq, hkv, length in [(3, 8, 2, 64), (1, 6, 1, 32)]:
        q = torch.randn(b, hq, 1, 128, generator=gen)
        k = torch.randn(b, hkv, length, 128, generator=gen)
        v = torch.randn(b, hkv, length, 128, generator=gen)
        seq_lens = torch.full((b,), length, dtype=torch.int32)
        o = probe.mini_decode(q, k, v, variant, block_n=32, seq_lens=seq_lens)
        ref, _ = attention_oracle(q, k, v, scale=128 ** -0.5)
        assert o.shape == q.shape
        assert (o.double() - ref).abs().max().item() < 1e-5


def test_probe_gqa_decode_rejects_what_it_cannot_run():
    """The minimal kernel takes only full tiles of contiguous caches and known variants: anything else is a
    ValueError naming the shapes, not a wrong answer."""
    import probe_gqa_decode as probe

    q, k = torch.randn(2, 8, 1, 128), torch.randn(2, 2, 64, 128)
    with pytest.raises(ValueError, match="variant"):
        probe.mini_decode(q, k, k, "evict")
    with pytest.raises(ValueError, match=r"k \(2, 2, 40, 128\)"):
        probe.mini_decode(q, k[:, :, :40], k[:, :, :40], "base", block_n=32)
    with pytest.raises(ValueError, match="contiguous"):
        probe.mini_decode(q, k.transpose(2, 3).contiguous().transpose(2, 3), k, "base", block_n=32)
    with pytest.raises(ValueError, match="seq_lens"):  # the length it would read must be the cache's
        probe.mini_decode(q, k, k, "seqload", block_n=32)
    with pytest.raises(ValueError, match="seq_lens"):
        probe.mini_decode(q, k, k, "masked", block_n=32)
    with pytest.raises(ValueError, match=r"seq_lens.*\(64, 32\)"):
        probe.mini_decode(q, k, k, "seqload", block_n=32, seq_lens=torch.tensor([64, 32], dtype=torch.int32))
    with pytest.raises(SystemExit):
        probe.main(["--variants", "evict"])


def test_probe_gqa_decode_round_checks_then_times(monkeypatch):
    """probe_gqa_decode._round on the CPU (kernels under the interpreter, fp32; graphs, timing and the profiler
    stubbed): every kernel is compared with SDPA before anything is timed, each is timed once, the profiled
    kernels are listed, and a wrong variant stops the round instead of being timed."""
    import bench_decode as bd
    import probe_gqa_decode as probe

    monkeypatch.setattr(bd, "capture_graph", lambda fn: type("G", (), {"replay": staticmethod(fn)})())
    timed = []
    monkeypatch.setattr(bd, "_bench", lambda fn: (timed.append(fn), 1e-4 * len(timed))[1])
    monkeypatch.setattr(probe, "kernel_table", lambda fn: [{"name": "k", "grid": [1, 1, 1]}])
    gen = torch.Generator().manual_seed(0)
    times, lines = probe._round(2, 4, 2, 128, ["base", "seqload", "persist"], gen, 1, profile=True, dev="cpu",
                                dtype=torch.float32)
    assert list(times) == ["sdpa", "gqa_decode", "gqa_decode_kvmajor", "gqa_decode_masked", "base", "seqload",
                           "persist"]
    assert len(timed) == 7
    # rotated by one: gqa_decode was timed first, sdpa last
    assert times["gqa_decode"] == 1e-4 and times["sdpa"] == 1e-4 * 7
    assert probe.td.KV_MAJOR is False and probe.td.SPLIT_TAIL is None  # those rows put the module switches back
    assert sum(line.startswith("Kernels of") for line in lines) == 3 and "- {'name': 'k', 'grid': [1, 1, 1]}" in lines
    real = probe.mini_decode
    monkeypatch.setattr(probe, "mini_decode", lambda *a, **kw: real(*a, **kw) * 0.5)
    timed.clear()
    with pytest.raises(RuntimeError, match="base differs from SDPA"):
        probe._round(2, 4, 2, 128, ["base"], gen, 0, dev="cpu", dtype=torch.float32)
    assert timed == []
    monkeypatch.setattr(probe, "mini_decode", real)  # a wrong KV-major order in gqa_decode stops it too
    td, real_gqa = probe.td, probe.td.gqa_decode
    monkeypatch.setattr(td, "gqa_decode", lambda *a, **kw: (real_gqa(*a, **kw)[0] * (0.5 if td.KV_MAJOR else 1), None))
    with pytest.raises(RuntimeError, match="gqa_decode_kvmajor differs from SDPA"):
        probe._round(2, 4, 2, 128, [], gen, 0, dev="cpu", dtype=torch.float32)
    assert timed == []
    monkeypatch.setattr(td, "gqa_decode",
                        lambda *a, **kw: (real_gqa(*a, **kw)[0] * (0.5 if td.SPLIT_TAIL is False else 1), None))
    with pytest.raises(RuntimeError, match="gqa_decode_masked differs from SDPA"):
        probe._round(2, 4, 2, 128, [], gen, 0, dev="cpu", dtype=torch.float32)
    assert timed == [] and td.SPLIT_TAIL is None


def test_probe_gqa_decode_table(tmp_path, monkeypatch):
    """probe_gqa_decode.main: medians and ranges over the rounds, GB/s from the row's bytes, ratio SDPA / kernel."""
    import probe_gqa_decode as probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(torch, "Generator", lambda device=None: type("G", (), {"manual_seed": lambda s, x: s})())
    feed = iter([{"sdpa": 100e-6, "gqa_decode": 101e-6, "tma": 98e-6}, {"sdpa": 102e-6, "gqa_decode": 103e-6, "tma": 99e-6},
                 {"sdpa": 101e-6, "gqa_decode": 102e-6, "tma": 100e-6}])
    monkeypatch.setattr(probe, "_round", lambda *a, **kw: (next(feed), ["profiled"] if kw.get("profile") else []))
    out = tmp_path / "p.md"
    probe.main(["--shapes", "gqa32", "--variants", "tma", "--rounds", "3", "--out", str(out)])
    text = out.read_text()
    assert text.count("profiled") == 1
    # 1.0737e9 bytes: 10631 GB/s at 101 us
    assert "| gqa_decode | 102.0 | 101.0-103.0 | 10527 | 0.9902 |" in text
    assert "| sdpa | 101.0 | 100.0-102.0 | 10631 | 1.0000 |" in text
    assert "| tma | 99.0 | 98.0-100.0 | 10846 | 1.0202 |" in text
    for bad in (["--shapes", "gqa5"], ["--rounds", "0"], ["--variants", ""]):
        with pytest.raises(SystemExit):
            probe.main(bad)

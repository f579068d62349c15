"""Timeline of one program of the Gluon MLA decode kernel's S-once schedules (H200 diagnostics).

Runs the TRACE build of ``gluon_mla._mla_decode_s1`` (clock64 stamps, constexpr-off in the normal
build: its SASS is unchanged), the dedicated-scorer schedule (the default) first, then the alternating
scorers, and prints, for program (0, 0, 0):
- the median cycles of each step of a steady tile (scorer's ready wait, S, softmax, P V, hand-over);
- the raw event timeline of a few steady tiles, relative to one publish;
- the prologue and epilogue (producer start, Q landed, P_0 published, loop done, stores issued).
The stamped builds spill more (alternating scorers: 860 against 360 bytes; dedicated scorer: 20
against 0), so their times are upper bounds; each total is printed beside the normal build's.

    PYTHONPATH=. python3 scripts/trace_mla_decode.py [OUT.txt]
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from probe_mla_decode import _write  # the report so far, rewritten after each case

EVENTS = ["tile landed", "S issued", "PV(t-1) issued", "S done", "softmax done", "PV(t-1) done", "P(t-1) free",
          "P(t) published"]


def run_traced(call, tr):
    """Fill the stamp buffer tr with a warm TRACE run of call(trace=tr), check that its output is the
    normal build's, and return (normal, TRACE) milliseconds per eager call (do_bench medians)."""
    import triton

    ref = call()
    for _ in range(3):
        tr.zero_()
        got = call(tr)
    torch.cuda.synchronize()
    assert (got.float() - ref.float()).abs().max().item() < 1e-2, "the TRACE build's output differs"
    return (triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median"),
            triton.testing.do_bench(lambda: call(tr), warmup=10, rep=50, return_mode="median"))


DEDICATED_EVENTS = {0: ["tile landed", "S issued", "S done", "softmax done", "P(t-1) free", "P(t) published"],
                    1: ["top", "PV issued", "PV done", "loads of t+2 issued"], 2: ["top", "PV issued", "PV done"]}


def _inputs(b, h, n, dev="cuda"):
    """Queries, a [B, L, 576] cache, the lengths (all n) and a zeroed stamp buffer for one traced case."""
    from mla_attn.ops.decode import gluon_mla

    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    ql = torch.randn(b, h, 512, generator=gen).to(dev, dt)
    qr = torch.randn(b, h, 64, generator=gen).to(dev, dt)
    buf = torch.randn(b, n, 576, generator=gen).to(dev, dt)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    tr = torch.zeros(4, gluon_mla.TRACE_TILES.value, gluon_mla.TRACE_EVENTS.value, dtype=torch.int64, device=dev)
    return ql, qr, buf, seq_lens, tr


def _traced_case(b, h, n, splits, out_lines, title, **kw):
    """Run one case's TRACE build (kw: the schedule) and add its heading and timings to out_lines ->
    (the stamps on the host, the program's tiles, out_lines.append)."""
    from mla_attn.ops.decode import gluon_mla

    ql, qr, buf, seq_lens, tr = _inputs(b, h, n)

    def call(trace=None):
        return gluon_mla.mla_decode_gluon(ql, qr, buf[..., :512], buf[..., 512:], seq_lens, None, 192 ** -0.5,
                                          num_splits=splits, trace=trace, **kw)[0]

    t_plain, t_trace = (t * 1e3 for t in run_traced(call, tr))
    n_tiles = -(-(-(-n // splits)) // 64)
    add = out_lines.append
    add(f"\n## B {b}, H {h}, L {n}, splits {splits}, {title}: program (0, 0, 0), {n_tiles} tiles")
    add(f"eager call: normal build {t_plain:.1f} us, TRACE build {t_trace:.1f} us (includes the host launch)")
    return tr.cpu(), n_tiles, add


def dedicated_rows(x, n_tiles, tiles, stages=2):
    """Per steady tile of the dedicated-scorer build's stamps x [4, tiles, 8] (row 0 the scorer, rows 1-2
    the P V warpgroups, the first of which issues the loads): cycle counts of each part, or [] when the
    program has too few tiles for a steady state."""
    last = min(n_tiles, tiles - 1) - 1  # the last slot also holds every later tile's stamps
    if last < 6:
        return []
    sc, pv0, pv1 = x[0], x[1], x[2]
    rows = []
    for t in range(3, last - 1):
        pub, pub_prev = int(sc[t, 5]), int(sc[t - 1, 5])
        pv_done = max(int(pv0[t, 2]), int(pv1[t, 2]))
        rows.append(dict(
            period=pub - pub_prev,
            scorer_wait_data=max(int(sc[t, 0]) - pub_prev, 0),  # published t - 1 -> tile t landed
            s_issue=int(sc[t, 1] - sc[t, 0]), s_wait=int(sc[t, 2] - sc[t, 1]), softmax=int(sc[t, 3] - sc[t, 2]),
            pfree_wait=int(sc[t, 4] - sc[t, 3]), publish=int(sc[t, 5] - sc[t, 4]),
            pv0_start=int(pv0[t, 1]) - pub, pv1_start=int(pv1[t, 1]) - pub,  # P_t out -> P_t V_t issued
            pv0=int(pv0[t, 2] - pv0[t, 1]), pv1=int(pv1[t, 2] - pv1[t, 1]),
            refill=int(pv0[t, 3]) - pv_done,  # both P_t V_t done -> tile t + STAGES's loads issued
            tma=int(sc[t + stages, 0] - pv0[t, 3]),  # those loads issued -> the scorer sees tile t + STAGES
        ))
    return rows


def _run_dedicated(b, h, n, splits, out_lines, dedicated):
    from mla_attn.ops.decode import gluon_mla

    x, n_tiles, add = _traced_case(b, h, n, splits, out_lines, "dedicated scorer"
                                   + (", Q half in registers" if dedicated == 2 else ""), dedicated=dedicated)
    tiles = gluon_mla.TRACE_TILES.value
    pro = x[3]
    t0 = int(pro[1, 0])
    add("prologue / epilogue, cycles from the loading warpgroup's start: "
        + ", ".join(f"{name} {int(v) - t0}" for name, v in [
            ("scorer start", pro[0, 0]), ("P V 1 start", pro[2, 0]), ("prologue loads issued", pro[1, 1]),
            ("Q landed", pro[0, 1]), ("tile 0 landed", x[0, 0, 0]), ("P_0 published", x[0, 0, 5]),
            ("scorer loop done", pro[0, 2]), ("P V 0 loop done", pro[1, 2]), ("P V 1 loop done", pro[2, 2]),
            ("lse stored", pro[0, 3]), ("P V 0 stores issued", pro[1, 3]), ("P V 1 stores issued", pro[2, 3])]))
    rows = dedicated_rows(x, n_tiles, tiles)
    if not rows:
        return
    add(f"steady tiles 3..{len(rows) + 2}, median cycles:")
    for k in rows[0]:
        add(f"  {k:18s} {statistics.median(r[k] for r in rows):8.0f}")
    t_a = 3 + min(4, max(len(rows) - 4, 0))
    base = int(x[0, t_a - 1, 5])
    ev = [(int(x[w, t, k]) - base, f"{['scorer', 'pv0', 'pv1'][w]} t{t} {name}")
          for t in range(t_a, min(t_a + 4, min(n_tiles, tiles))) for w in (0, 1, 2)
          for k, name in enumerate(DEDICATED_EVENTS[w]) if int(x[w, t, k])]
    add(f"timeline of up to 4 steady tiles (cycles from P(t{t_a - 1}) published):")
    for v, name in sorted(ev):
        add(f"  {v:8d}  {name}")


def _run(b, h, n, splits, out_lines, pv_first=0):
    from mla_attn.ops.decode import gluon_mla

    x, n_tiles, add = _traced_case(b, h, n, splits, out_lines,
                                   ["S first", "P V first", "P V first, waited"][int(pv_first)], pv_first=pv_first,
                                   dedicated=0)
    tiles = gluon_mla.TRACE_TILES.value
    pro = x[3]
    t0 = int(pro[2, 0])
    add("prologue / epilogue, cycles from the producer's start: "
        + ", ".join(f"{name} {int(v) - t0}" for name, v in [
            ("consumer 0 start", pro[0, 0]), ("consumer 1 start", pro[1, 0]), ("Q landed", pro[0, 1]),
            ("P_0 published", pro[0, 2]), ("loop done c0", pro[0, 3]), ("loop done c1", pro[1, 3]),
            ("stores issued c0", pro[0, 4]), ("stores issued c1", pro[1, 4])]))
    last = min(n_tiles, tiles) - 1
    if last < 6:
        return
    lo, hi = 3, last - 1  # steady tiles
    pub = {t: int(x[t % 2, t, 7]) for t in range(lo - 1, hi + 1)}
    rows = []
    for t in range(lo, hi + 1):
        c = t % 2
        e = [int(v) for v in x[c, t]]
        o = [int(v) for v in x[1 - c, t]]
        prod = int(x[2, t, 0])
        rows.append(dict(
            period=pub[t] - pub[t - 1],
            tma=e[0] - prod,  # stage freed -> tile landed (seen by the scorer's wait)
            wait_data=e[0] - pub[t - 1] if e[0] > pub[t - 1] else 0,
            s_issue=e[1] - e[0], pv_issue=e[2] - e[1], s_wait=e[3] - e[2], softmax=e[4] - e[3], pv_wait=e[5] - e[4],
            pfree=e[6] - e[5], publish=e[7] - e[6],
            other_pv=o[5] - o[2], free_to_prod=prod - max(int(x[(t - 2) % 2, t - 1, 5]), int(x[(t - 1) % 2, t - 1, 5])),
        ))
    add(f"steady tiles {lo}..{hi}, median cycles:")
    for k in rows[0]:
        add(f"  {k:14s} {statistics.median(r[k] for r in rows):8.0f}")
    if lo + 8 > last:
        return
    add("timeline of 4 steady tiles (cycles from P(t0-1) published; c = consumer, p = producer):")
    t0s = lo + 4
    base = pub[t0s - 1]
    ev = []
    for t in range(t0s, t0s + 4):
        for c in (0, 1):
            for k in range(8):
                v = int(x[c, t, k])
                if v:
                    ev.append((v - base, f"c{c} t{t} {EVENTS[k]}"))
        ev.append((int(x[2, t, 0]) - base, f"p  t{t} stage free, loads issued"))
    for v, name in sorted(ev):
        add(f"  {v:8d}  {name}")


def main(out):
    lines = [f"# Gluon MLA decode (S once) trace, {torch.cuda.get_device_name()}"]
    for dedicated in (1, 2):  # the default schedule first
        _run_dedicated(66, 128, 4096, 1, lines, dedicated)
        _write(out, lines)
        _run_dedicated(1, 128, 32768, 64, lines, dedicated)
        _write(out, lines)
    for pv_first in (0, 1, 2) if os.environ.get("MLA_ATTN_PROBE_EXPERIMENTAL", "1") != "0" else (0, 1):
        _run(66, 128, 4096, 1, lines, pv_first)
        _write(out, lines)
        _run(1, 128, 32768, 66, lines, pv_first)
        _write(out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "trace_mla_decode.txt")

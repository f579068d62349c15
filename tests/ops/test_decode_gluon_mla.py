"""The Gluon MLA decode kernel (mla_attn/ops/decode/gluon_mla.py) against the float64 oracle, called
directly and through the public op. GPU-only; scripts/gpu_check.sh runs it in a hang-guarded step (a wrong mbarrier phase hangs).
Unused cache slots are NaN. The lengths straddle the 64-key tiles (0, 1, 63, 64, 65, a long one), and
the tolerances are those of the Triton MLA decode tests (within 2x of PyTorch's own bf16 error).
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.ops import decode as decode_ops
from mla_attn.ops.decode import triton_decode as td
from mla_attn.testing import mla_decode_oracle
from test_decode_triton import BF16, _check, _lowp_mla, _mla_inputs

gm = pytest.importorskip("mla_attn.ops.decode.gluon_mla")

pytestmark = pytest.mark.usefixtures("nan_decode_outputs")  # launcher buffers start as NaN (conftest.py)

from mla_attn.testing import gluon_gpu  # noqa: E402

HOPPER = gluon_gpu()


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("h,lens", [(128, [0, 1, 63, 64, 65, 700]), (64, [129, 2048]), (192, [300])],
                         ids=lambda x: str(x))
def test_gluon_mla_decode_matches_oracle(h, lens):
    gen = torch.Generator(device="cuda").manual_seed(h)
    b, n = len(lens), max(max(lens), 1) + 40  # room past the longest: those slots are unused too
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ql = torch.randn(b, h, 512, device="cuda", generator=gen).to(BF16)
    qr = torch.randn(b, h, 64, device="cuda", generator=gen).to(BF16)
    buf = torch.randn(b, n, 576, device="cuda", generator=gen).to(BF16)
    pos = torch.arange(n, device="cuda")
    buf = buf.masked_fill((pos[None, :] >= seq_lens[:, None].long()).unsqueeze(-1), float("nan"))
    scale = 192 ** -0.5
    o, lse = gm.mla_decode_ws(ql, qr, buf, seq_lens, scale)
    c, kr = buf[..., :512], buf[..., 512:]
    q4, r4 = ql.unsqueeze(2), qr.unsqueeze(2)
    ref_o, ref_lse = mla_decode_oracle(q4, r4, c, kr, seq_lens, scale=scale, block_table=None)
    _check(o.unsqueeze(2), lse.unsqueeze(2), ref_o, ref_lse, _lowp_mla(q4, r4, c, kr, seq_lens, None, scale), BF16)


def _spy(monkeypatch):
    """Count the Gluon kernel's calls; let it take any batch (the op keeps B x H / 64 < SMs / 8 on Triton)."""
    monkeypatch.setattr(td, "GLUON_MLA_MIN_PROGRAMS", 0)
    calls = []
    real = gm.mla_decode_gluon
    monkeypatch.setattr(gm, "mla_decode_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


MIXED_LENS = [0, 1, 63, 64, 65, 700, 1500, 129]  # around the 64-key tiles, and long enough to split


def _check_op(calls, h, page, splits, seed, what="the Gluon MLA kernel did not run"):
    """One op call over MIXED_LENS (NaN in unused slots, shuffled block tables when paged) against the
    float64 oracle, with the Gluon kernel's call counted by ``_spy``."""
    ql, qr, c, kr, seq_lens, table = _mla_inputs(len(MIXED_LENS), h, 512, 64, 1, MIXED_LENS, page, BF16, seed=seed)
    o, lse = decode_ops.mla_decode(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table, num_splits=splits,
                                   return_lse=True, impl="triton")
    assert calls, what
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table)
    _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.1), BF16)


# (H, page size or None, num_splits, separate latent / rope buffers, query scale)
OP_CASES = [
    (128, 64, None, False, 1.0),
    (128, 128, 3, False, 1.0),
    (64, 256, 7, False, 100.0),
    (128, None, 2, False, 1.0),
    (192, 64, 1, True, 1.0),
    (64, None, None, True, 1.0),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "H{}-page{}-splits{}-{}-q{:g}".format(
    c[0], c[1], c[2], "separate" if c[3] else "onebuffer", c[4]))
def test_gluon_mla_through_the_op(case, monkeypatch):
    """The public op routes to the Gluon kernel (one new token, H a multiple of 64) and matches the
    float64 oracle: split intervals (incl. empty ones), paged caches with shuffled block tables,
    NaN in unused pages and page tails and 2**31 - 8 in block-table entries past each sequence's last
    page (to_paged), latent and rope in one buffer or two, large queries."""
    h, page, splits, separate, qmul = case
    calls = _spy(monkeypatch)
    lens = [0, 1, 63, 64, 65, 700, 1500]
    ql, qr, c, kr, seq_lens, table = _mla_inputs(len(lens), h, 512, 64, 1, lens, page, BF16, qmul=qmul,
                                                 seed=h + (page or 0))
    if separate:
        c, kr = c.contiguous(), kr.contiguous()
    scale = 192 ** -0.5
    o, lse = decode_ops.mla_decode(ql, qr, c, kr, seq_lens, scale=scale, block_table=table, num_splits=splits,
                                   return_lse=True, impl="triton")
    assert calls, "the Gluon MLA kernel did not run"
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=scale, block_table=table)
    _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, scale), BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
def test_gluon_mla_not_taken_where_it_does_not_apply(monkeypatch):
    """H = 16, two new tokens, pages of 16 keys with SMALL_PAGES off: the Triton kernel, still correct."""
    monkeypatch.setattr(gm, "SMALL_PAGES", False)
    calls = _spy(monkeypatch)
    for h, s, page in ((16, 1, 64), (128, 2, 64), (128, 1, 16)):
        ql, qr, c, kr, seq_lens, table = _mla_inputs(2, h, 512, 64, s, [100, 300], page, BF16)
        o, lse = decode_ops.mla_decode(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table, return_lse=True,
                                       impl="triton")
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table)
        _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.1), BF16)
    assert not calls


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
def test_gluon_mla_cuda_graph_replay(monkeypatch):
    """A captured decode step on the Gluon kernel (heuristic splits) replays with new seq_lens and q."""
    calls = _spy(monkeypatch)
    monkeypatch.setattr(td, "GLUON_MLA_MIN_PROGRAMS", 1 / 8)  # the default: B = 10, H = 128 is above it
    b, h, n = 10, 128, 2600
    gen = torch.Generator(device="cuda").manual_seed(7)
    ql = torch.randn(b, h, 1, 512, device="cuda", generator=gen).to(BF16)
    qr = torch.randn(b, h, 1, 64, device="cuda", generator=gen).to(BF16)
    buf = torch.randn(b, n, 576, device="cuda", generator=gen).to(BF16)
    c, kr = buf[..., :512], buf[..., 512:]
    seq_lens = torch.tensor([2000, 1] * 5, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        td.mla_decode(ql, qr, c, kr, seq_lens, None, 0.1, None)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, None, 0.1, None)
    assert calls
    for lens in ([2000, 1] * 5, [2600, 0, 7, 64, 65, 1000, 2599, 3, 128, 129], [0] * 10, [1, 2599] * 5):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        ql.copy_(torch.randn_like(ql))
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.1, block_table=None)
        _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, None, 0.1), BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("s_once,pv_first,dedicated", [(True, 0, 0), (True, 1, 0), (True, 2, 0), (True, 1, 1),
                                                       (True, 1, 2), (True, 1, 3), (False, 0, 0)],
                         ids=["s_once", "s_once_pv_first", "s_once_pv_first_waited_experimental",
                              "s_once_dedicated_scorer", "s_once_dedicated_scorer_qa_regs_experimental",
                              "s_once_dedicated_scorer_early_s_experimental", "scores_twice"])
@pytest.mark.parametrize("page,splits", [(None, 1), (64, 3), (128, None)], ids=lambda x: str(x))
def test_gluon_mla_schedules(page, splits, s_once, pv_first, dedicated, monkeypatch):
    """The consumer schedules, each forced: scores once per tile (S_ONCE, the default), with the scorer's
    P V after S, before S (PV_FIRST 1, the default) or before S and waited for (2), or by a dedicated
    scorer warpgroup (DEDICATED 1, the default; 2 with half of Q in its registers; 3 issuing S_{t+1} before
    the softmax of tile t), and scores twice (the first version). The same oracle checks
    as through the op (lengths around the tiles, NaN in unused slots, splits, paged)."""
    monkeypatch.setattr(gm, "S_ONCE", s_once)
    monkeypatch.setattr(gm, "PV_FIRST", pv_first)
    monkeypatch.setattr(gm, "DEDICATED", dedicated)
    _check_op(_spy(monkeypatch), 128, page, splits, seed=11)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("splits", [None, 3], ids=lambda x: f"splits{x}")
@pytest.mark.parametrize("page", [1, 4, 16, 32, 48], ids=lambda x: f"page{x}")
def test_gluon_mla_small_pages(page, splits, monkeypatch):
    """SMALL_PAGES (on by default): pages smaller than a 64-key tile (or not a multiple of it) gathered
    by cp.async, each key looking its own page up. Shuffled block tables with 2**31 - 8 past each
    sequence's last page, NaN in unused pages and page tails, lengths around the tiles and the pages,
    splits that cut pages in two; the same float64 oracle and tolerances as the TMA-fed cases."""
    monkeypatch.setattr(gm, "SMALL_PAGES", True)
    monkeypatch.setattr(gm, "S_ONCE", True)
    monkeypatch.setattr(gm, "DEDICATED", 1)
    _check_op(_spy(monkeypatch), 128, page, splits, seed=17 + page,
              what="the Gluon MLA kernel did not take the small pages")


SMALL_HEAD_CASES = [(16, None, None), (16, 64, 3), (16, 1, None), (1, None, 2), (63, 16, None), (3, 64, None),
                    (32, None, 5)]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("h,page,splits", SMALL_HEAD_CASES, ids=lambda x: str(x))
def test_gluon_mla_small_heads_experimental(h, page, splits, monkeypatch):
    """SMALL_HEADS (experimental, off): fewer than 64 heads in one 64-row tile, whose rows past H hold the
    next sequence's queries or TMA zeros and are never stored (the outputs start as NaN: a stray row
    store or a missing one shows). Odd head counts, contiguous / paged 64 / gathered small pages, splits;
    the same float64 oracle and tolerances as above."""
    monkeypatch.setattr(gm, "SMALL_HEADS", True)
    monkeypatch.setattr(gm, "S_ONCE", True)
    monkeypatch.setattr(gm, "DEDICATED", 1)
    _check_op(_spy(monkeypatch), h, page, splits, seed=29 + h,
              what="the Gluon MLA kernel did not take the small head count")


def test_round_splits_to_whole_combine_rounds():
    """Past 32 parts (one combine load round) the split count goes up to a whole number of rounds when
    the programs still fit in one wave, else down; 32 or fewer are left alone. Pure Python."""
    from mla_attn.ops.decode.gluon_mla import _round_splits

    assert _round_splits(63, 2, 132) == 64  # B 1, H 128: the wave rule's 63 -> 64 (128 programs)
    assert _round_splits(66, 2, 132) == 64  # 3 rounds would not fit: down to 2
    assert _round_splits(122, 1, 132) == 128  # H 64
    assert _round_splits(31, 4, 132) == 31 and _round_splits(1, 132, 132) == 1
    for splits, programs in [(33, 3), (40, 3), (95, 1), (127, 1)]:
        r = _round_splits(splits, programs, 132)
        assert r % 32 == 0 and (programs * r <= 132 or r < splits)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("rebase", [False, True], ids=["fresh-descriptors", "rebased-descriptors"])
@pytest.mark.parametrize("b,page,splits", [(1, None, None), (4, 64, 3), (3, 1, None)], ids=lambda x: str(x))
def test_gluon_mla_plan_replay(b, page, splits, rebase, monkeypatch):
    """Cached plans (mla_attn/ops/_launch.py) over the Gluon kernel: a replay without Triton's binder is
    bit-identical to a launch through the JIT, and later calls with new queries and new lengths (0
    included) over the same NaN-poisoned cache match the oracle, each with fresh outputs."""
    from mla_attn.ops import _launch

    monkeypatch.setattr(gm, "REBASE_DESCRIPTORS", rebase)
    lens = [3000, 1, 0, 777][:b] if b > 1 else [4000]
    ql, qr, c, kr, seq_lens, table = _mla_inputs(b, 128, 512, 64, 1, lens, page, BF16, seed=b)
    ql, qr = ql.squeeze(2), qr.squeeze(2)

    def call():
        return gm.mla_decode_gluon(ql, qr, c, kr, seq_lens, table, 0.1, splits)

    monkeypatch.setattr(_launch, "FAST", False)
    o_jit, lse_jit = call()
    assert not gm._plans
    monkeypatch.setattr(_launch, "FAST", True)
    call()
    plan = next(iter(gm._plans.values()))
    assert plan.decode.runner is not None and (plan.combine is None or plan.combine.runner is not None)
    o_fast, lse_fast = call()
    torch.cuda.synchronize()
    assert torch.equal(o_fast, o_jit) and torch.equal(lse_fast, lse_jit)
    outs = [o_fast]
    for new_lens in ([max(x - 70, 0) for x in lens], [0] + lens[1:]):
        seq_lens = torch.tensor(new_lens, dtype=torch.int32, device="cuda")
        ql = torch.randn_like(ql)
        o, lse = call()
        q4, r4 = ql.unsqueeze(2), qr.unsqueeze(2)
        ref_o, ref_lse = mla_decode_oracle(q4, r4, c, kr, seq_lens, scale=0.1, block_table=table)
        _check(o.unsqueeze(2), lse.unsqueeze(2), ref_o, ref_lse, _lowp_mla(q4, r4, c, kr, seq_lens, table, 0.1), BF16)
        outs.append(o)
    assert len(gm._plans) == 1
    assert len({o.data_ptr() for o in outs}) == len(outs)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("rebase", [False, True], ids=["fresh-descriptors", "rebased-descriptors"])
def test_gluon_mla_plan_keeps_no_tensor_alive(rebase, monkeypatch):
    """The Gluon plan keeps its TMA descriptors' layouts, not their tensors: a freed cache is freed."""
    import gc
    import weakref

    monkeypatch.setattr(gm, "REBASE_DESCRIPTORS", rebase)

    def make_and_run():
        ql, qr, c, kr, seq_lens, table = _mla_inputs(2, 128, 512, 64, 1, [300, 70], 64, BF16)
        for _ in range(2):  # plan, then replay
            gm.mla_decode_gluon(ql.squeeze(2), qr.squeeze(2), c, kr, seq_lens, table, 0.1, None)
        torch.cuda.synchronize()
        assert len(gm._plans) == 1
        return [weakref.ref(t) for t in (ql, qr, c, kr, seq_lens, table)]

    refs = make_and_run()
    gc.collect()
    assert all(r() is None for r in refs), "a launch plan kept an input tensor alive"


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("page,splits", [(None, None), (64, 3)], ids=lambda x: str(x))
def test_op_replays_gluon_plan_without_router_checks(page, splits, monkeypatch):
    """Through the public op, a call whose key has a Gluon plan replays it before the router's checks
    (gluon_mla.replay): the checks do not run, the result is bitwise the unplanned call's and matches the
    oracle with new queries and lengths; with the Gluon kernel switched off no plan is replayed."""
    from mla_attn.ops import _launch

    calls = _spy(monkeypatch)
    lens = [3000, 1, 0]
    ql, qr, c, kr, seq_lens, table = _mla_inputs(3, 128, 512, 64, 1, lens, page, BF16, seed=11)
    ql, qr = ql.squeeze(2), qr.squeeze(2)

    def op():
        return decode_ops.mla_decode(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table, num_splits=splits,
                                     return_lse=True, impl="triton")

    op()  # plans
    assert calls == [1] and len(gm._plans) == 1
    takes, supported = td._gluon_mla_takes, gm.supported

    def checked(*a, **k):
        raise AssertionError("the router's checks ran for a call with a plan")

    monkeypatch.setattr(td, "_gluon_mla_takes", checked)
    monkeypatch.setattr(gm, "supported", checked)
    for new_lens in ([2000, 0, 0], [64, 1, 0]):  # within the lengths the cache holds (NaN past them)
        seq_lens = torch.tensor(new_lens, dtype=torch.int32, device="cuda")
        ql = torch.randn_like(ql)
        o, lse = op()
        monkeypatch.setattr(_launch, "FAST", False)  # the same call, decided and launched anew
        monkeypatch.setattr(td, "_gluon_mla_takes", takes)
        monkeypatch.setattr(gm, "supported", supported)
        o_jit, lse_jit = op()
        monkeypatch.setattr(_launch, "FAST", True)
        monkeypatch.setattr(td, "_gluon_mla_takes", checked)
        monkeypatch.setattr(gm, "supported", checked)
        torch.cuda.synchronize()
        assert torch.equal(o, o_jit) and torch.equal(lse, lse_jit)
        q4, r4 = ql.unsqueeze(2), qr.unsqueeze(2)
        ref_o, ref_lse = mla_decode_oracle(q4, r4, c, kr, seq_lens, scale=0.1, block_table=table)
        _check(o.unsqueeze(2), lse.unsqueeze(2), ref_o, ref_lse, _lowp_mla(q4, r4, c, kr, seq_lens, table, 0.1), BF16)
    assert calls == [1, 1, 1]  # only the unplanned calls reached mla_decode_gluon
    monkeypatch.setattr(td, "GLUON_MLA", False)
    monkeypatch.setattr(td, "_gluon_mla_takes", takes)
    monkeypatch.setattr(gm, "replay", checked)
    o, lse = op()  # the Triton kernel
    ref_o, ref_lse = mla_decode_oracle(ql.unsqueeze(2), qr.unsqueeze(2), c, kr, seq_lens, scale=0.1, block_table=table)
    _check(o.unsqueeze(2), lse.unsqueeze(2), ref_o, ref_lse,
           _lowp_mla(ql.unsqueeze(2), qr.unsqueeze(2), c, kr, seq_lens, table, 0.1), BF16)
    assert calls == [1, 1, 1]

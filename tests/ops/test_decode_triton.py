"""Triton decode kernels (GQA / MLA, split-KV, paged) and the combine kernel against the float64 oracle.

Interpreter cases (fp32 / fp16; CPU) run everywhere; ``@pytest.mark.gpu`` cases run bf16 at
benchmark-like shapes on CUDA.

Tolerances: the kernel's relative error against the float64 oracle must be at most 2x the error of
the same computation done by PyTorch in the kernel's dtype (``_lowp_*`` below: scores from a
matmul in the input dtype, softmax in fp32, P rounded to the input dtype before P @ V — the
rounding points of the kernel), and never needs to beat ``dtype_floor`` (a few units of rounding
of the output dtype: 2e-5 fp32, 2e-3 fp16, 1.6e-2 bf16). lse is compared in absolute terms:
``|lse - ref| <= eps * (1 + max|ref|)`` with eps 1e-5 (fp32 accumulate of fp32 inputs) or 1e-4
(fp32 accumulate of fp16 / bf16 inputs; the oracle sees the same rounded inputs, so only the
accumulation order differs); -inf must match exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_attn.ops import decode as decode_ops
from mla_attn.ops.decode import combine as combine_mod
from mla_attn.ops.decode import triton_decode as td
from mla_attn.ops.decode.reference import decode_mask, gather_tokens
from mla_attn.testing import (SENTINEL_PAGE, assert_close, assert_lse_close, decode_oracle, dtype_floor,
                              merge_oracle, mla_decode_oracle, to_paged)

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _nan_outputs(nan_decode_outputs):
    """Decode launcher buffers start as NaN (tests/ops/conftest.py)."""


@pytest.fixture(autouse=True)
def _head_split_on(monkeypatch):
    """The GQA head split (td.HEAD_SPLIT) on wherever it narrows the tile, for every case here, so that the widths
    the default rule pads (40, 48, 96: td.SPLIT_MAX_FILL) run its code paths too; test_head_split checks the
    default rule, test_gqa_decode_unaligned_rows runs split and padded."""
    monkeypatch.setattr(td, "HEAD_SPLIT", True)
    monkeypatch.setattr(td, "SPLIT_MAX_FILL", 1.0)


def _lse_atol(dtype, ref):
    finite = ref[torch.isfinite(ref)]
    mag = 1.0 + (finite.abs().max().item() if finite.numel() else 0.0)
    return (1e-5 if dtype == torch.float32 else 1e-4) * mag


# ----------------------------------------------------------------------------------------------
# PyTorch in the kernel's dtype: the baseline error the kernel is held to (2x).

def _lowp_softmax_pv(scores, vals, mask, dtype):
    """scores fp32 [..., R, n], vals [..., n, Dv] (dtype), mask bool broadcastable -> o in dtype."""
    s = scores.masked_fill(~mask, float("-inf"))
    alive = mask.any(-1, keepdim=True)
    p = torch.softmax(torch.where(alive, s, torch.zeros_like(s)), dim=-1) * alive
    return torch.matmul(p.to(dtype), vals).to(dtype)


def _lowp_gqa(q, k_cache, v_cache, seq_lens, block_table, scale):
    b, hq, s, d = q.shape
    if block_table is None:
        k_tok, v_tok = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    else:
        k_tok, v_tok = k_cache, v_cache
    hkv = k_tok.shape[2]
    n = int(seq_lens.max()) if b else 0
    k, _ = gather_tokens(k_tok, seq_lens, n, block_table)  # [B, n, Hkv, D]
    v, _ = gather_tokens(v_tok, seq_lens, n, block_table)
    g = hq // hkv
    qg = q.reshape(b, hkv, g * s, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, Hkv, G*S, n]
    mask = decode_mask(seq_lens, s, n, q.device).unsqueeze(1).unsqueeze(1).expand(b, 1, g, s, n).reshape(b, 1, g * s, n)
    o = _lowp_softmax_pv(scores, v.permute(0, 2, 1, 3), mask, q.dtype)
    return o.reshape(b, hq, s, -1)


def _lowp_mla(ql, qr, c_cache, kr_cache, seq_lens, block_table, scale):
    b, h, s, dc = ql.shape
    n = int(seq_lens.max()) if b else 0
    c, _ = gather_tokens(c_cache, seq_lens, n, block_table)  # [B, n, Dc]
    scores = torch.matmul(ql.reshape(b, h * s, dc), c.transpose(1, 2)).float()
    if qr is not None:
        kr, _ = gather_tokens(kr_cache, seq_lens, n, block_table)
        scores = scores + torch.matmul(qr.reshape(b, h * s, -1), kr.transpose(1, 2)).float()
    mask = decode_mask(seq_lens, s, n, ql.device).unsqueeze(1).expand(b, h, s, n).reshape(b, h * s, n)
    return _lowp_softmax_pv(scores * scale, c, mask, ql.dtype).reshape(b, h, s, dc)


# ----------------------------------------------------------------------------------------------
# Input makers

def _paged_pair(caches, seq_lens, page_size, seed):
    """Page several token-major caches [B, N, ...] with one shared (shuffled) block table."""
    out, table = [], None
    for cache in caches:
        gen = torch.Generator().manual_seed(seed)
        pool, t = to_paged(cache, seq_lens.cpu(), page_size, generator=gen)
        if table is not None:
            assert torch.equal(t, table)
        table = t
        out.append(pool)
    return out, table


def _gqa_inputs(b, hq, hkv, d, dv, s, lens, page, dtype, qmul=1.0, strided=False, seed=0):
    n = max(max(lens), 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(b, hq, s, d, device=DEV).to(dtype) * qmul
    if strided:  # q as a transposed view, caches as slices of wider buffers
        q = torch.randn(b, s, hq, d, device=DEV).to(dtype).mul(qmul).transpose(1, 2)
    k_tok = torch.randn(b, n, hkv, d, device=DEV).to(dtype)  # token-major
    v_tok = torch.randn(b, n, hkv, dv, device=DEV).to(dtype)
    if page is None:
        k = k_tok.transpose(1, 2)
        v = v_tok.transpose(1, 2)
        if strided:
            kbuf = torch.full((b, hkv, n + 5, d + 3), float("nan"), device=DEV, dtype=dtype)
            kbuf[:, :, :n, :d] = k
            k = kbuf[:, :, :n, :d]
        else:
            k, v = k.contiguous(), v.contiguous()
        # NaN in every slot past each sequence's length
        pos = torch.arange(n, device=DEV)
        dead = (pos[None, :] >= seq_lens[:, None].long()).view(b, 1, n, 1)
        k = k.masked_fill(dead, float("nan")) if not strided else k.masked_fill_(dead, float("nan"))
        v = v.masked_fill(dead, float("nan"))
        return q, k, v, seq_lens, None
    (kp, vp), table = _paged_pair([k_tok, v_tok], seq_lens, page, seed)
    return q, kp, vp, seq_lens, table.to(DEV)


def _mla_inputs(b, h, dc, dr, s, lens, page, dtype, qmul=1.0, seed=0):
    n = max(max(lens), 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ql = (torch.randn(b, h, s, dc, device=DEV) * qmul).to(dtype)
    qr = (torch.randn(b, h, s, dr, device=DEV) * qmul).to(dtype) if dr else None
    buf = torch.randn(b, n, dc + dr, device=DEV).to(dtype)  # one [.., Dc + Dr] buffer, two views
    if page is None:
        pos = torch.arange(n, device=DEV)
        buf = buf.masked_fill((pos[None, :] >= seq_lens[:, None].long()).unsqueeze(-1), float("nan"))
        table = None
    else:
        (buf,), table = _paged_pair([buf], seq_lens, page, seed)
        table = table.to(DEV)
    c = buf[..., :dc]
    kr = buf[..., dc:] if dr else None
    return ql, qr, c, kr, seq_lens, table


def _kernel_launches(monkeypatch, pick):
    """A list to which each _decode_kernel launch from now on appends pick(its constexpr kwargs)."""
    passed = []

    class Spy(td.Launch):
        def __init__(self, fn, grid, args, kwargs, options):
            if fn is td._decode_kernel:
                passed.append(pick(kwargs))
            super().__init__(fn, grid, args, kwargs, options)
    monkeypatch.setattr(td, "Launch", Spy)
    return passed


def _check(o, lse, ref_o, ref_lse, base_o, dtype):
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, ref_o, floor=dtype_floor(dtype), baseline=base_o)
    assert_lse_close(lse, ref_lse, atol=_lse_atol(dtype, ref_lse))
    dead = torch.isneginf(ref_lse)
    if dead.any():  # rows that see no key: exact zeros
        assert torch.equal(o[dead].float(), torch.zeros_like(o[dead].float()))


# ----------------------------------------------------------------------------------------------
# Interpreter (and GPU) cases: a covering set rather than the cross product.

F32, F16 = torch.float32, torch.float16
# (B, Hq, Hkv, D, Dv, S, lens, page, splits, dtype, qmul, strided, via_api)
GQA_CASES = [
    (3, 4, 4, 64, 64, 1, [0, 17, 100], None, 1, F32, 1.0, False, False),
    (3, 8, 2, 64, 64, 2, [1, 64, 100], 4, 2, F16, 1.0, False, True),
    (3, 9, 3, 63, 33, 2, [0, 17, 113], 1, 5, F32, 1.0, False, False),
    (1, 6, 1, 64, 64, 1, [100], 16, None, F16, 1.0, False, True),
    (3, 16, 1, 64, 64, 2, [0, 1, 64], None, 5, F16, 100.0, True, False),
    (3, 9, 3, 64, 64, 1, [17, 64, 100], 16, 2, F32, 100.0, False, True),
    (1, 4, 4, 64, 64, 1, [0], 4, 2, F32, 1.0, False, False),
]


def _gqa_id(c):
    b, hq, hkv, d, dv, s, lens, page, splits, dtype, qmul, strided, api = c
    return (f"B{b}-Hq{hq}-Hkv{hkv}-D{d}-Dv{dv}-S{s}-L{'_'.join(map(str, lens))}-{'P' + str(page) if page else 'contig'}"
            f"-splits{splits}-{str(dtype)[6:]}" + ("-q100" if qmul != 1 else "") + ("-strided" if strided else "")
            + ("-api" if api else ""))


@pytest.mark.parametrize("case", GQA_CASES, ids=[_gqa_id(c) for c in GQA_CASES])
def test_gqa_decode(case):
    b, hq, hkv, d, dv, s, lens, page, splits, dtype, qmul, strided, via_api = case
    q, k, v, seq_lens, table = _gqa_inputs(b, hq, hkv, d, dv, s, lens, page, dtype, qmul, strided)
    scale = d ** -0.5
    if via_api:
        o, lse = decode_ops.decode_attention(q, k, v, seq_lens, block_table=table, scale=scale, num_splits=splits,
                                             return_lse=True, impl="triton")
    else:
        o, lse = td.gqa_decode(q, k, v, seq_lens, table, scale, splits)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=scale)
    base = _lowp_gqa(q, k, v, seq_lens, table, scale)
    _check(o, lse, ref_o, ref_lse, base, dtype)


def test_stride_unit_divides_the_leading_strides():
    unit = td._stride_unit
    assert unit((2 * 4 * 72, 4 * 72, 72, 1), (0, 0, 0, 0), (16 * 2 * 72, 2 * 72, 72, 1)) == 8
    assert unit((8 * 128, 128, 128, 1), (64 * 576, 576, 0, 1)) == 1  # multiples of 16 (MLA's 576): as they are
    assert unit((36, 36, 36, 1), (20, 20, 1)) == 4
    assert unit((63, 63, 1), (72, 1)) == 1  # an odd stride: nothing to gain
    assert unit((72, 72, 1000)) == 8  # the last stride (the head-dim one) does not count


def test_head_split(monkeypatch):
    split = td._head_split
    widths = (16, 40, 48, 63, 64, 72, 80, 96, 128, 160)
    aligned, padded = torch.empty(2, 3, 72), torch.empty(2, 3, 77)[..., :72]
    assert [split(d) for d in widths] == [  # every split that narrows the tile (this file's fixture)
        (16, 0), (32, 16), (32, 16), (64, 0), (64, 0), (64, 16), (64, 16), (64, 32), (128, 0), (128, 32)]
    assert split(72, aligned) == (64, 16) and split(72, aligned, padded) == (128, 0)  # unaligned rows: padded
    monkeypatch.setattr(td, "SPLIT_MAX_FILL", 0.625)  # the default rule: only splits that fill <= 5/8 of the pad
    assert [split(d) for d in widths] == [
        (16, 0), (64, 0), (64, 0), (64, 0), (64, 0), (64, 16), (64, 16), (128, 0), (128, 0), (128, 32)]
    monkeypatch.setattr(td, "HEAD_SPLIT", False)
    assert [split(d) for d in widths] == [(16, 0)] + [(64, 0)] * 4 + [(128, 0)] * 4 + [(256, 0)]


# Tiles across pages (td.PAGE_SPAN, off by default): pages of 16 are smaller than the interpreter's 32-key tile, so
# with it on a tile covers two or more pages, a page looked up per key. The spy asserts the tile did span.
# (B, Hq, Hkv, D, S, lens, page, splits, dtype)
SPAN_CASES = [
    (3, 8, 2, 72, 1, [0, 45, 113], 16, None, F32),
    (3, 9, 3, 64, 2, [17, 64, 100], 16, 2, F16),
    (2, 4, 1, 64, 1, [1, 97], 16, 5, F32),
]


@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: f"D{c[3]}-S{c[4]}-P{c[6]}-splits{c[7]}")
def test_gqa_decode_tiles_span_pages(case, monkeypatch):
    b, hq, hkv, d, s, lens, page, splits, dtype = case
    monkeypatch.setattr(td, "PAGE_SPAN", True)
    tiles, real = [], td._tile_keys
    monkeypatch.setattr(td, "_tile_keys", lambda *a: tiles.append(real(*a)) or tiles[-1])
    q, k, v, seq_lens, table = _gqa_inputs(b, hq, hkv, d, d, s, lens, page, dtype)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, d ** -0.5, splits)
    assert tiles and all(t > page for t in tiles)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=d ** -0.5)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, d ** -0.5), dtype)


# Head widths whose rows are not multiples of 16 elements: _launch passes the leading strides divided by a power
# of two (td._stride_unit) and the kernel multiplies them back. The unit each case runs with is asserted.
# (B, Hq, Hkv, D, Dv, S, lens, page, splits, dtype, strided, unit)
UNIT_CASES = [
    (3, 8, 2, 72, 72, 1, [0, 70, 113], None, 2, F32, False, 8),
    (2, 6, 2, 72, 72, 2, [45, 113], 16, 3, F16, False, 8),
    (2, 4, 1, 40, 40, 1, [1, 97], 1, 1, F32, True, 8),
    (2, 9, 3, 36, 20, 2, [64, 17], 4, 5, F32, False, 4),
]


@pytest.mark.parametrize("split", [True, False], ids=["split", "padded"])
@pytest.mark.parametrize("case", UNIT_CASES, ids=lambda c: f"D{c[3]}x{c[4]}-{'P' + str(c[7]) if c[7] else 'contig'}"
                         f"-unit{c[11]}")
def test_gqa_decode_unaligned_rows(case, split, monkeypatch):
    b, hq, hkv, d, dv, s, lens, page, splits, dtype, strided, want = case
    monkeypatch.setattr(td, "HEAD_SPLIT", split)
    seen, tiles = [], []
    real, real_split = td._stride_unit, td._head_split
    monkeypatch.setattr(td, "_stride_unit", lambda *st: seen.append(real(*st)) or seen[-1])
    monkeypatch.setattr(td, "_head_split", lambda *a: tiles.append(real_split(*a)) or tiles[-1])
    q, k, v, seq_lens, table = _gqa_inputs(b, hq, hkv, d, dv, s, lens, page, dtype, strided=strided)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, d ** -0.5, splits)
    assert seen == [want]
    if split:
        assert tiles == [td.split_head_dim(d), td.split_head_dim(dv) if dv != 20 else (32, 0)]  # 20: 16 + 16 no gain
    else:
        assert tiles == [(td._pow2(d), 0), (td._pow2(dv), 0)]
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=d ** -0.5)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, d ** -0.5), dtype)


# (B, H, Dc, Dr, S, lens, page, splits, dtype, qmul, via_api)
MLA_CASES = [
    (3, 16, 64, 16, 1, [0, 17, 100], None, 1, F32, 1.0, False),
    (3, 9, 64, 16, 2, [1, 64, 100], 4, 5, F16, 1.0, True),
    (1, 4, 512, 64, 1, [100], 16, 2, F32, 1.0, False),
    (3, 16, 512, 64, 2, [0, 17, 64], 1, None, F16, 1.0, True),
    (3, 6, 64, 0, 1, [1, 17, 100], 16, 2, F32, 100.0, True),
    (3, 3, 48, 8, 2, [0, 63, 64], 16, 5, F32, 100.0, False),
    (1, 1, 64, 16, 1, [113], None, None, F16, 1.0, False),
    (2, 5, 64, 16, 1, [130, 49], 128, 3, F32, 1.0, False),  # a page larger than the tile
    (2, 5, 64, 16, 2, [130, 49], 48, 2, F32, 1.0, False),  # a page size that is no power of two
]


def _mla_id(c):
    b, h, dc, dr, s, lens, page, splits, dtype, qmul, api = c
    return (f"B{b}-H{h}-Dc{dc}-Dr{dr}-S{s}-L{'_'.join(map(str, lens))}-{'P' + str(page) if page else 'contig'}"
            f"-splits{splits}-{str(dtype)[6:]}" + ("-q100" if qmul != 1 else "") + ("-api" if api else ""))


@pytest.mark.parametrize("case", MLA_CASES, ids=[_mla_id(c) for c in MLA_CASES])
def test_mla_decode(case):
    b, h, dc, dr, s, lens, page, splits, dtype, qmul, via_api = case
    ql, qr, c, kr, seq_lens, table = _mla_inputs(b, h, dc, dr, s, lens, page, dtype, qmul)
    scale = 0.125
    if via_api:
        o, lse = decode_ops.mla_decode(ql, qr, c, kr, seq_lens, scale=scale, block_table=table, num_splits=splits,
                                       return_lse=True, impl="triton")
    else:
        o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, scale, splits)
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=scale, block_table=table)
    base = _lowp_mla(ql, qr, c, kr, seq_lens, table, scale)
    _check(o, lse, ref_o, ref_lse, base, dtype)


# td.SPLIT_TAIL forced on in the MLA kernel (its default there is off): two score blocks, NoPE, S 2, pages larger than the tile and
# pages of no power of two, against the same oracle.
SPLIT_TAIL_MLA = [MLA_CASES[i] for i in (0, 1, 4, 5, 7, 8)]


@pytest.mark.parametrize("case", SPLIT_TAIL_MLA, ids=[_mla_id(c) for c in SPLIT_TAIL_MLA])
def test_mla_decode_split_tail(case, monkeypatch):
    monkeypatch.setattr(td, "SPLIT_TAIL", True)
    passed = _kernel_launches(monkeypatch, lambda kwargs: kwargs.get("SPLIT_TAIL", False))
    test_mla_decode(case)
    assert passed and all(passed)


@pytest.mark.parametrize("unchain", [True, False])
def test_unchained_dots_same_answer(unchain):
    """The UNCHAIN variant (independent score dots, an always-taken branch around P @ V; the default for
    8-warp tiles on the GPU) against the oracle, pinned on in the interpreter's 4-warp tiles."""
    cfg = td.DecodeConfig(16, 32, 4, 1, unchain=unchain)
    for dtype in (F32, F16):
        ql, qr, c, kr, seq_lens, table = _mla_inputs(3, 9, 64, 16, 2, [0, 17, 100], 16, dtype, 1.0)
        o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.125, 2, config=cfg)
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.125, block_table=table)
        _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.125), dtype)
    for d in (64, 72):  # 72: the head split (64 + 16) with its second accumulator rescaled in the branch
        q, k, v, seq_lens, table = _gqa_inputs(3, 8, 2, d, d, 1, [1, 64, 100], None, F32, 1.0, False)
        o, lse = td.gqa_decode(q, k, v, seq_lens, table, 0.125, 3, config=cfg)
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.125)
        _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, 0.125), F32)


# (kind, B, H(q), Hkv, S, lens, page, SMs): SMs sets the worker count W = SMs // (KV heads x head tiles).
BALANCED_CASES = [
    ("mla", 3, 16, 1, 1, [0, 17, 100], 16, 8),  # W=8 over 8 tiles of 16 keys: one sequence per worker or less
    ("mla", 5, 9, 1, 2, [33, 0, 1, 100, 64], None, 3),  # W < B: runs cross sequences, a zero length inside
    ("mla", 2, 4, 1, 1, [100, 3], 4, 50),  # W > T: empty runs inside a sequence's worker range (skipped)
    ("gqa", 3, 8, 2, 2, [1, 64, 100], 4, 6),
    ("gqa", 4, 9, 3, 1, [0, 0, 77, 0], None, 9),  # all but one sequence empty
    ("gqa", 1, 6, 1, 1, [113], 16, 7),
]


@pytest.mark.parametrize("case", BALANCED_CASES, ids=lambda c: "{}-B{}-H{}-Hkv{}-S{}-L{}-P{}-sm{}".format(
    c[0], c[1], c[2], c[3], c[4], "_".join(map(str, c[5])), c[6], c[7]))
def test_balanced_split(case, monkeypatch):
    """The balanced split (workers share the batch's key tiles, runs crossing sequences) against the
    oracle: varlen with zeros, S = 2, paged and contiguous, fewer and more workers than tiles, and
    NaN in every unused slot (the part buffer is NaN-filled, so a slot read but never written shows)."""
    kind, b, h, hkv, s, lens, page, sms = case
    monkeypatch.setattr(td, "BALANCE", True)
    monkeypatch.setattr(td, "_num_sms", lambda device: sms)
    for dtype in (F32, F16):
        if kind == "mla":
            ql, qr, c, kr, seq_lens, table = _mla_inputs(b, h, 64, 16, s, lens, page, dtype)
            o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.125, None)
            ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.125, block_table=table)
            base = _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.125)
        else:
            q, k, v, seq_lens, table = _gqa_inputs(b, h, hkv, 64, 48, s, lens, page, dtype)
            o, lse = td.gqa_decode(q, k, v, seq_lens, table, 0.125, None)
            ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.125)
            base = _lowp_gqa(q, k, v, seq_lens, table, 0.125)
        _check(o, lse, ref_o, ref_lse, base, dtype)


def test_api_3d_query_matches_4d():
    """decode_attention with q [B, Hq, D] is the S = 1 case of [B, Hq, 1, D]."""
    q, k, v, seq_lens, table = _gqa_inputs(3, 8, 2, 64, 64, 1, [5, 0, 40], 4, F32)
    o3, lse3 = decode_ops.decode_attention(q[:, :, 0], k, v, seq_lens, block_table=table, return_lse=True,
                                           impl="triton")
    ref_o, ref_lse = decode_oracle(q[:, :, 0], k, v, seq_lens, block_table=table)
    assert o3.shape == (3, 8, 64) and lse3.shape == (3, 8)
    _check(o3, lse3, ref_o, ref_lse, None, F32)


def test_sentinel_block_table_is_not_read():
    """The block table past each sequence's last page holds 2**31 - 8 (a read would fault or give NaN)."""
    q, k, v, seq_lens, table = _gqa_inputs(3, 4, 4, 16, 16, 1, [0, 17, 100], 16, F32)
    assert (table[0] == SENTINEL_PAGE).all() and (table[1, 2:] == SENTINEL_PAGE).all()
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, 0.25, 3)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.25)
    _check(o, lse, ref_o, ref_lse, None, F32)


# ----------------------------------------------------------------------------------------------
# Combine

MERGE_CASES = [(1, (3, 5), 32, F32), (3, (2, 9), 64, F16), (7, (4,), 48, F32), (3, (2, 3, 1), 512, F32),
               (13, (40,), 32, F32), (20, (3, 7), 72, F16)]


@pytest.mark.parametrize("case", MERGE_CASES, ids=[f"K{k}-R{'x'.join(map(str, r))}-Dv{dv}-{str(dt)[6:]}"
                                                   for k, r, dv, dt in MERGE_CASES])
@pytest.mark.parametrize("via_api", [False, True], ids=["launcher", "api"])
def test_merge_attention_states(case, via_api):
    k, rows, dv, dtype = case
    o_parts = torch.randn((k,) + rows + (dv,), device=DEV).to(dtype)
    lse_parts = torch.randn((k,) + rows, device=DEV) * 20
    dead = torch.rand((k,) + rows, device=DEV) < 0.3
    dead.view(k, -1)[:, 0] = True  # one row with every part dead
    lse_parts = lse_parts.masked_fill(dead, float("-inf"))
    o_parts = o_parts.masked_fill(dead.unsqueeze(-1), float("nan"))  # a dead part's o must never be read
    if via_api:
        o, lse = decode_ops.merge_attention_states(o_parts, lse_parts, impl="triton")
    else:
        o, lse = combine_mod.merge_attention_states_triton(o_parts, lse_parts)
    ref_o, ref_lse = merge_oracle(o_parts, lse_parts)
    assert o.dtype == dtype and o.shape == rows + (dv,)
    assert_close(o, ref_o, floor=dtype_floor(dtype))
    assert_lse_close(lse, ref_lse, atol=1e-5 * (1 + ref_lse[torch.isfinite(ref_lse)].abs().max().item()))
    assert torch.equal(o.reshape(-1, dv)[0].float(), torch.zeros(dv, device=DEV))


@pytest.mark.parametrize("tiles", [(1, 16, 8, 1), (4, 32, 2, 1), (16, 128, 1, 4), (2, 64, 4, 2), (1, 64, 128, 4)],
                         ids=lambda t: "R{}-Dv{}-chunk{}-w{}".format(*t))
def test_merge_tile_shapes(tiles, monkeypatch):
    """Every combine tile shape (rows per program, columns, parts per step) gives the oracle's answer,
    with partial row/column/part tiles and dead parts holding NaN."""
    monkeypatch.setattr(combine_mod, "_combine_tiles", lambda *a, **k: tiles)
    k, rows, dv = 11, (3, 7), 72
    o_parts = torch.randn((k,) + rows + (dv,), device=DEV)
    lse_parts = torch.randn((k,) + rows, device=DEV) * 20
    dead = torch.rand((k,) + rows, device=DEV) < 0.3
    dead.view(k, -1)[:, 0] = True
    lse_parts = lse_parts.masked_fill(dead, float("-inf"))
    o_parts = o_parts.masked_fill(dead.unsqueeze(-1), float("nan"))
    o, lse = combine_mod.merge_attention_states_triton(o_parts, lse_parts)
    ref_o, ref_lse = merge_oracle(o_parts, lse_parts)
    assert_close(o, ref_o, floor=dtype_floor(F32))
    assert_lse_close(lse, ref_lse, atol=1e-5 * (1 + ref_lse[torch.isfinite(ref_lse)].abs().max().item()))


def test_combine_tiles_choice():
    """The rule timed on the H200: many rows -> 8 rows x 256 columns, one part per step; few rows and
    many parts (batch 1) -> one row, up to 32 parts per step; never more than 8192 elements a step."""
    assert combine_mod._combine_tiles(2, 64 * 16, 512) == (8, 256, 1, 4)  # B=64 H=16, 2 splits
    assert combine_mod._combine_tiles(4, 16 * 128, 512) == (8, 256, 1, 4)  # B=16 H=128, 4 splits
    assert combine_mod._combine_tiles(63, 128, 512) == (1, 256, 32, 4)  # B=1 H=128, 63 splits
    assert combine_mod._combine_tiles(16, 32, 128) == (1, 128, 16, 4)  # GQA B=1 32 heads, 16 splits
    assert combine_mod._combine_tiles(16, 32, 128, 0)[0] == 8  # the interpreter: always 8 rows
    # the probe's alternative rules (scripts/probe_mla_decode.py --b1): one load round for B=1's 66 parts
    assert combine_mod._combine_tiles(66, 128, 512, 1024, 8192, 128, 64) == (1, 64, 128, 4)
    assert combine_mod._combine_tiles(66, 128, 512, 512, 8192, 64, 128) == (1, 128, 64, 4)
    for parts, rows, dv in [(128, 1, 1024), (3, 5, 16), (40, 300, 72)]:
        br, bdv, chunk, _ = combine_mod._combine_tiles(parts, rows, dv)
        assert br * bdv * chunk <= 8192 and bdv >= min(dv, 16)


# ----------------------------------------------------------------------------------------------
# Fused merge: the last split of a row tile merges the partials in the decode kernel.

def _no_combine(*a, **k):
    raise AssertionError("combine launched for a merge the decode kernel should have fused")


# (kind, B, Hq, Hkv or None, lens, page, dtype, split counts run one after another on the same tickets)
FUSED_CASES = [
    ("gqa", 3, 8, 2, [0, 17, 100], 4, F32, (2, 5, 16, 3)),
    ("gqa", 1, 12, 4, [113], None, F16, (7, 2)),
    ("gqa", 2, 16, 1, [64, 1], 16, F32, (3,)),  # MQA: 16 rows a tile
    ("mla", 3, 16, None, [0, 17, 100], 4, F32, (3, 2, 5)),
    ("mla", 2, 9, None, [130, 49], None, F16, (4,)),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "{}-B{}-H{}-L{}-P{}-{}".format(
    c[0], c[1], c[2], "_".join(map(str, c[4])), c[5], str(c[6])[6:]))
def test_fused_merge_replaces_combine(case, monkeypatch):
    """Small merges (GQA, MLA at H <= 16) happen in the decode kernel: no combine launch, the oracle's
    answer (NaN-poisoned unused pages and outputs), and every ticket back at 0 after each call, so
    calls with other split counts on the same tickets stay right."""
    kind, b, hq, hkv, lens, page, dtype, splits_seq = case
    monkeypatch.setattr(td, "combine_splits", _no_combine)
    monkeypatch.setattr(td, "FUSED_MERGE", True)
    if kind == "gqa":
        q, k, v, seq_lens, table = _gqa_inputs(b, hq, hkv, 64, 48, 1, lens, page, dtype)
        call = lambda n: td.gqa_decode(q, k, v, seq_lens, table, 0.125, n)
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.125)
        base = _lowp_gqa(q, k, v, seq_lens, table, 0.125)
    else:
        ql, qr, c, kr, seq_lens, table = _mla_inputs(b, hq, 64, 16, 1, lens, page, dtype)
        call = lambda n: td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.125, n)
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.125, block_table=table)
        base = _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.125)
    for n in splits_seq:
        o, lse = call(n)
        _check(o, lse, ref_o, ref_lse, base, dtype)
        assert int(td._ticket_counters(seq_lens.device).abs().sum()) == 0


def test_fused_merge_off_uses_combine(monkeypatch):
    """With FUSED_MERGE off the same split calls go through combine.py, with the same answer."""
    calls = []
    real = td.combine_splits
    monkeypatch.setattr(td, "combine_splits", lambda *a: (calls.append(1), real(*a)))
    monkeypatch.setattr(td, "FUSED_MERGE", False)
    q, k, v, seq_lens, table = _gqa_inputs(3, 8, 2, 64, 64, 1, [0, 17, 100], 4, F32)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, 0.125, 5)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.125)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, 0.125), F32)
    assert calls == [1]


# Module switches of the kernel: programs ordered KV head first (td.KV_MAJOR, off by default) and key masks on the
# partial last tile only (td.SPLIT_TAIL; by default on contiguous GQA caches only), each forced on, and SPLIT_TAIL
# forced off (every tile masked, the default for paged caches and MLA). Each gives the same answer over odd head
# counts, zero-length sequences, lengths that are and are not whole 32-key tiles (the interpreter's), pages and
# splits (NaN in every unused slot). The spy asserts the kernel was given the switch as set.
# (B, Hq, Hkv, D, S, lens, page, splits, dtype)
SWITCH_CASES = [
    (3, 9, 3, 64, 1, [0, 63, 113], None, 1, F32),
    (5, 6, 2, 32, 2, [1, 17, 0, 64, 45], 16, 3, F16),
    (2, 12, 3, 64, 1, [113, 70], 4, None, F32),
    (3, 8, 2, 64, 1, [64, 32, 0], None, 2, F32),  # whole tiles only: no masked pass
    (2, 4, 2, 32, 2, [96, 33], 16, 1, F16),  # S 2 over whole tiles: the causal mask without the key mask
    (2, 4, 2, 32, 2, [96, 33], None, 1, F16),  # the same, contiguous
]


@pytest.mark.parametrize("switch,value", [("KV_MAJOR", True), ("SPLIT_TAIL", True), ("SPLIT_TAIL", False)],
                         ids=["KV_MAJOR", "SPLIT_TAIL", "every-tile-masked"])
@pytest.mark.parametrize("case", SWITCH_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}_{c[2]}-L{max(c[5])}-P{c[6]}-splits{c[7]}")
def test_gqa_decode_switches(case, switch, value, monkeypatch):
    b, hq, hkv, d, s, lens, page, splits, dtype = case
    monkeypatch.setattr(td, switch, value)
    passed = _kernel_launches(monkeypatch, lambda kwargs: kwargs.get(switch, False))
    q, k, v, seq_lens, table = _gqa_inputs(b, hq, hkv, d, d, s, lens, page, dtype)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, d ** -0.5, splits)
    assert passed and all(p is value for p in passed)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=d ** -0.5)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, d ** -0.5), dtype)


@pytest.mark.parametrize("split_tail", [True, None], ids=["split-tail", "default"])
def test_tail_pipelined_reaches_the_kernel(split_tail, monkeypatch):
    """td.TAIL_PIPELINED on: passed to the kernel only where SPLIT_TAIL is taken (with SPLIT_TAIL None, the default,
    not for MLA or a paged GQA cache), and the answer is the oracle's. The interpreter ignores num_stages, so this
    checks the wiring and the answer; the pipelined schedule itself runs on the GPU (scripts/gpu_check.sh
    ONLY=tailpipe)."""
    monkeypatch.setattr(td, "SPLIT_TAIL", split_tail)
    monkeypatch.setattr(td, "TAIL_PIPELINED", True)
    passed = _kernel_launches(monkeypatch,
                              lambda kwargs: (kwargs.get("SPLIT_TAIL", False), kwargs.get("TAIL_PIPELINED", False)))
    for page in (None, 16):
        q, k, v, seq_lens, table = _gqa_inputs(3, 9, 3, 32, 32, 1, [0, 63, 45], page, F32)
        o, lse = td.gqa_decode(q, k, v, seq_lens, table, 32 ** -0.5, 2)
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=32 ** -0.5)
        _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, 32 ** -0.5), F32)
    ql, qr, c, kr, seq_lens, table = _mla_inputs(2, 4, 64, 16, 1, [17, 100], 16, F32, 1.0)
    o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.125, 1)
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.125, block_table=table)
    _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.125), F32)
    on = (True, True)
    assert passed == ([on, on, on] if split_tail else [on, (False, False), (False, False)])


def test_split_tail_default_rule(monkeypatch):
    """SPLIT_TAIL None (the default): contiguous GQA caches, and MLA over whole-page tiles under TAIL_PIPELINED's rule
    (None) only; True / False: everywhere / nowhere."""
    monkeypatch.setattr(td, "SPLIT_TAIL", None)
    monkeypatch.setattr(td, "TAIL_PIPELINED", False)
    f = td._split_tail
    assert f(False, False)  # GQA, contiguous
    assert not f(False, True) and not f(True, False) and not f(True, True)  # GQA paged, MLA
    assert not f(True, True, True)  # whole-page MLA tiles with the tail in registers: they would spill
    monkeypatch.setattr(td, "TAIL_PIPELINED", None)
    assert f(True, True, True)  # MLA, tiles of 64+ keys inside a page, the tail pipelined
    assert f(False, False) and not f(True, True)
    monkeypatch.setattr(td, "SPLIT_TAIL", True)
    assert f(True, True) and f(False, True)
    monkeypatch.setattr(td, "SPLIT_TAIL", False)
    assert not f(False, False)
    assert not f(True, True, True)


def test_tail_pipelined_default_rule(monkeypatch):
    """Whole-page tiles: MLA, paged, 64 keys or more a tile, the page a multiple of it (timed: pages of 64, H 16).
    TAIL_PIPELINED None (the rule, =auto) pipelines the tail there only; True / False force it on / off; False is
    the default until the GPU tests run with the rule."""
    w = td._whole_page_tiles
    assert w(True, True, 64, 64) and w(True, True, 128, 64) and w(True, True, 256, 128)
    assert not w(True, False, 1, 64)  # contiguous MLA (tied on the H100: left as it was)
    assert not w(True, True, 1, 64) and not w(True, True, 16, 16) and not w(True, True, 32, 32)  # small pages
    assert not w(True, True, 64, 128) and not w(True, True, 96, 64)  # a tile across pages
    assert not w(False, True, 64, 64)  # GQA
    monkeypatch.setattr(td, "TAIL_PIPELINED", None)
    assert td._tail_pipelined(True) and not td._tail_pipelined(False)
    monkeypatch.setattr(td, "TAIL_PIPELINED", True)
    assert td._tail_pipelined(False)
    monkeypatch.setattr(td, "TAIL_PIPELINED", False)
    assert not td._tail_pipelined(True)


@pytest.mark.parametrize("tail_pipelined", [None, False, True], ids=["rule", "off", "forced"])
def test_mla_whole_page_tail_reaches_the_kernel(tail_pipelined, monkeypatch):
    """The tail rule end to end (SPLIT_TAIL None): with TAIL_PIPELINED None, MLA over pages of 64 with 64-key tiles
    launches SPLIT_TAIL with TAIL_PIPELINED, pages of 16 and contiguous caches every tile masked; off or forced on
    (the latter pipelines only where SPLIT_TAIL is taken), every MLA tile masked. All against the oracle, over lengths
    with and without a partial tile, NaN-poisoned pages and a zero-length sequence."""
    monkeypatch.setattr(td, "SPLIT_TAIL", None)
    monkeypatch.setattr(td, "TAIL_PIPELINED", tail_pipelined)
    passed = _kernel_launches(monkeypatch, lambda kwargs: (kwargs["BLOCK_N"], kwargs.get("SPLIT_TAIL", False),
                                                           kwargs.get("TAIL_PIPELINED", False)))
    cfg = td.DecodeConfig(16, 64, 4, 1)
    for page in (64, 16, None):
        ql, qr, c, kr, seq_lens, table = _mla_inputs(3, 5, 64, 16, 1, [0, 128, 113], page, F32, 1.0)
        o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.125, 2, config=cfg)
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.125, block_table=table)
        _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.125), F32)
    rule = tail_pipelined is None
    assert passed == [(64, rule, rule), (16, False, False), (64, False, False)]


def test_fused_merge_tiles_rule(monkeypatch):
    """Which merges are fused: [parts, rows, Dv] steps of at most FUSE_STEP values, at most FUSE_MAX_STEPS."""
    monkeypatch.setattr(td, "FUSED_MERGE", True)
    f = td._fused_merge_tiles
    assert f(16, 4, 128) == (4, 16)  # GQA B=1 32/8: 16 splits in one step
    assert f(33, 4, 128) == (4, 16)  # three steps
    assert f(2, 16, 512) == (16, 1)  # MLA H=16 B=64: two parts, one per step
    assert f(1, 4, 128) is None  # nothing to merge
    assert f(100, 4, 128) is None  # seven steps: combine.py spreads it out
    assert f(4, 64, 512) is None  # MLA H=128 tile: 32768 values a part
    assert f(5, 16, 512) is None  # five steps of one part
    monkeypatch.setattr(td, "FUSED_MERGE", False)
    assert f(16, 4, 128) is None


def test_paged_gqa_wide_rule(monkeypatch):
    """8 warps only where they were timed to win: GQA, pages of 64, a program for every SM, on CUDA."""
    monkeypatch.setattr(td, "_num_sms", lambda device: 132)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    cfg = td.DecodeConfig(16, 128, 4, 3, 1)
    f = td._paged_gqa_wide
    assert f(False, True, 64, cfg, 1024, cuda) and f(False, True, 64, cfg, 132, cuda)
    assert not f(False, True, 64, cfg, 131, cuda)  # split (batch 1): 4 warps
    assert not f(False, False, 1, cfg, 1024, cuda)  # contiguous
    assert not f(False, True, 16, cfg, 1024, cuda)  # page sizes not timed
    assert not f(True, True, 64, td.DecodeConfig(16, 64, 4, 3, 1), 1024, cuda)  # MLA
    assert not f(False, True, 64, cfg, 1024, cpu)  # the interpreter
    assert not f(False, True, 64, td.DecodeConfig(16, 64, 4, 3, 1), 1024, cuda)  # fp32 tiles (64 keys)


# ----------------------------------------------------------------------------------------------
# Split heuristic (pure Python)

def test_balanced_rule():
    """Balanced split only where it was measured to win: MLA tiles over 32 rows, a wave of programs."""
    f = td._use_balanced
    assert f(True, 128, 128, 2, 132) and f(True, 128, 64, 2, 132)  # H=128 at B=128 / B=64
    assert not f(True, 128, 16, 2, 132) and not f(True, 128, 1, 2, 132)  # batch too small: per-sequence
    assert not f(True, 16, 128, 1, 132)  # H=16 (memory-bound tiles)
    assert not f(False, 64, 128, 8, 132)  # GQA


def test_choose_num_splits():
    f = td.choose_num_splits
    assert f(128, 1, 4096, 132) == 1  # a full GPU is not split
    assert f(1, 2, 32768, 132) >= 32  # batch 1: fill the SMs
    assert f(1, 1, 100, 132, block_n=64) <= 1  # 100 tokens: fewer than 4 tiles, no split
    assert f(4, 1, 0, 132) == 1 and f(0, 1, 4096, 132) == 1
    for b, t in [(1, 2), (3, 1), (16, 2), (64, 1)]:
        s = f(b, t, 1 << 20, 132)
        waves = b * t * s / 132
        assert waves / math.ceil(waves) >= 0.8, (b, t, s)


def test_out_of_resources_falls_back_to_smaller_tiles(monkeypatch):
    """A default tile that does not fit the GPU (raised at compile time) is replaced by a smaller one,
    once per problem key, and the answer is still right; a pinned config is never replaced."""
    from triton.runtime.errors import OutOfResources

    real = td._decode_kernel
    seen = []

    class Picky:  # compiles only tiles of at most 16 keys
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["BLOCK_N"])
                if kw["BLOCK_N"] > 16:
                    raise OutOfResources(300000, 232448, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(td, "_decode_kernel", Picky())
    monkeypatch.setattr(td, "_fitted", {})
    ql, qr, c, kr, seq_lens, table = _mla_inputs(2, 4, 64, 16, 1, [0, 45], None, F32)
    o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, None, 0.125, 2)
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.125)
    _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, None, 0.125), F32)
    assert seen[0] > 16 and seen[-1] == 16 and len(td._fitted) == 1
    seen.clear()
    td.mla_decode(ql, qr, c, kr, seq_lens, None, 0.125, 2)
    assert seen == [16]  # remembered: no second failed compile
    with pytest.raises(OutOfResources):
        td.mla_decode(ql, qr, c, kr, seq_lens, None, 0.125, 2, config=td.DecodeConfig(16, 32, 4, 1))


# ----------------------------------------------------------------------------------------------
# GPU: bf16 at benchmark-like shapes, heuristic == single split, CUDA-graph replay.

BF16 = torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("h", [1, 3, 9, 63, 64, 126, 128])
def test_mla_decode_bf16_gpu(h):
    lens = [2048, 1, 0, 1500 + h]
    page = 64 if h % 2 == 0 else None
    for s in (1, 2) if h in (9, 128) else (1,):
        ql, qr, c, kr, seq_lens, table = _mla_inputs(4, h, 512, 64, s, lens, page, BF16, seed=h)
        scale = 192 ** -0.5
        o, lse = decode_ops.mla_decode(ql, qr, c, kr, seq_lens, scale=scale, block_table=table, return_lse=True,
                                       impl="triton")
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=scale, block_table=table)
        _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, scale), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("unchain", [True, False])
@pytest.mark.parametrize("block_n,stages", [(32, 2), (32, 3), (64, 1)])
def test_mla_decode_h128_tiles_gpu(unchain, block_n, stages):
    """The H = 128 tile candidates (8 warps, both UNCHAIN settings) at bf16, split and paged."""
    cfg = td.DecodeConfig(64, block_n, 8, stages, unchain=unchain)
    ql, qr, c, kr, seq_lens, table = _mla_inputs(3, 128, 512, 64, 1, [3000, 0, 777], 64, BF16, seed=5)
    o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, 192 ** -0.5, 3, config=cfg)
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=192 ** -0.5, block_table=table)
    _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 192 ** -0.5), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,page", [(32, 8, 64), (64, 8, None), (12, 4, 16), (8, 1, 1)])
def test_gqa_decode_bf16_gpu(hq, hkv, page):
    lens = [3000, 0, 1, 777]
    q, k, v, seq_lens, table = _gqa_inputs(4, hq, hkv, 128, 128, 1, lens, page, BF16)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, 128 ** -0.5, None)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=128 ** -0.5)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, 128 ** -0.5), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "padded"])
@pytest.mark.parametrize("page", [None, 64, 16])
@pytest.mark.parametrize("d", [72, 80, 96, 160])
def test_gqa_decode_d72_bf16_gpu(d, page, split, monkeypatch):
    # Rows of 72 elements: strides passed divided by 8 and multiplied back in the kernel (td._stride_unit). All
    # four widths take the head split when it is on (64 + 16, 64 + 32, 128 + 32; td._head_split, the fixture
    # letting 96 split too); paged 64 at B 32 takes 8 warps (value padded, score split).
    monkeypatch.setattr(td, "HEAD_SPLIT", split)
    for b, lens in ((4, [3000, 0, 1, 777]), (32, [500 + 37 * i for i in range(32)])):
        q, k, v, seq_lens, table = _gqa_inputs(b, 32, 8, d, d, 1, lens, page, BF16)
        if d == 72:
            assert td._stride_unit(q.stride(), k.stride(), v.stride()) == 8
        assert (td._head_split(d, q, k, v)[1] > 0) == split
        o, lse = td.gqa_decode(q, k, v, seq_lens, table, d ** -0.5, None)
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=d ** -0.5)
        _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, d ** -0.5), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [64, 16])
@pytest.mark.parametrize("d", [72, 128])
def test_gqa_decode_tiles_span_pages_bf16_gpu(d, page, monkeypatch):
    # td.PAGE_SPAN (off by default): the 128-key tile over pages of 64 / 16, a page looked up per key.
    monkeypatch.setattr(td, "PAGE_SPAN", True)
    for b, lens in ((4, [3000, 0, 1, 777]), (32, [500 + 37 * i for i in range(32)])):
        q, k, v, seq_lens, table = _gqa_inputs(b, 32, 8, d, d, 1, lens, page, BF16)
        o, lse = td.gqa_decode(q, k, v, seq_lens, table, d ** -0.5, None)
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=d ** -0.5)
        _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, d ** -0.5), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mla16", "mla128", "gqa"])
def test_balanced_matches_single_split_gpu(kind, monkeypatch):
    """bf16 at benchmark-like shapes: the balanced split against the oracle, as close as num_splits=1."""
    monkeypatch.setattr(td, "BALANCE", True)
    monkeypatch.setattr(td, "GLUON_MLA", False)  # H = 128 would go to the Gluon kernel (no balanced split)
    lens = [3000, 4096, 0, 1, 3333, 4000, 17, 2048]
    if kind == "gqa":
        q, k, v, seq_lens, table = _gqa_inputs(8, 32, 8, 128, 128, 1, lens, 64, BF16)
        o_b, lse_b = td.gqa_decode(q, k, v, seq_lens, table, 0.088, None)
        o_1, _ = td.gqa_decode(q, k, v, seq_lens, table, 0.088, 1)
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.088)
    else:
        ql, qr, c, kr, seq_lens, table = _mla_inputs(8, 16 if kind == "mla16" else 128, 512, 64, 1, lens, 64, BF16)
        o_b, lse_b = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.1, None)
        o_1, _ = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.1, 1)
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table)
    _check(o_b, lse_b, ref_o, ref_lse, o_1, BF16)


@pytest.mark.gpu
def test_heuristic_splits_match_single_split_gpu():
    ql, qr, c, kr, seq_lens, table = _mla_inputs(1, 128, 512, 64, 1, [8000], 64, BF16)
    cap = table.shape[1] * 64
    assert td.choose_num_splits(1, 2, cap, td._num_sms(ql.device)) > 1
    o_h, lse_h = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.1, None)
    o_1, lse_1 = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.1, 1)
    ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table)
    _check(o_h, lse_h, ref_o, ref_lse, o_1, BF16)  # the split result is as close as the unsplit one (2x)
    assert_close(o_h, o_1.double(), floor=dtype_floor(BF16))
    assert (lse_h - lse_1).abs().max().item() <= 1e-3


@pytest.mark.gpu
def test_gqa_paged_wide_tile_gpu():
    """The 8-warp tile that paged GQA gets at a full batch: bf16 against the oracle (lengths 0, 1, 63, 64,
    65 and long ones, shuffled pages, NaN in unused pages and page tails)."""
    lens = [3000, 0, 1, 63, 64, 65, 2047, 4096] * 3
    q, k, v, seq_lens, table = _gqa_inputs(len(lens), 64, 8, 128, 128, 1, lens, 64, BF16, seed=7)
    assert td._paged_gqa_wide(False, True, 64, td.default_config(8, 128, 128, BF16, mla=False, device=q.device),
                              len(lens) * 8, q.device)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, 128 ** -0.5, None)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=128 ** -0.5)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, 128 ** -0.5), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "combine"])
def test_gqa_batch1_heuristic_splits_gpu(fused, monkeypatch):
    """The benchmark's GQA batch-1 shape (32/8, 32768 keys, bf16), heuristic splits with the merge fused
    in the kernel or launched: as close to the oracle as PyTorch's bf16, and as one split."""
    monkeypatch.setattr(td, "FUSED_MERGE", fused)
    q, k, v, seq_lens, table = _gqa_inputs(1, 32, 8, 128, 128, 1, [32768], None, BF16, seed=3)
    splits = td.choose_num_splits(8, 1, 32768, td._num_sms(q.device), block_n=128)
    assert splits > 1 and (td._fused_merge_tiles(splits, 4, 128) is not None) == fused
    o, lse = td.gqa_decode(q, k, v, seq_lens, None, 128 ** -0.5, None)
    o_1, lse_1 = td.gqa_decode(q, k, v, seq_lens, None, 128 ** -0.5, 1)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, scale=128 ** -0.5)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, None, 128 ** -0.5), BF16)
    _check(o_1, lse_1, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, None, 128 ** -0.5), BF16)
    assert int(td._ticket_counters(q.device).abs().sum()) == 0


@pytest.mark.gpu
def test_fused_merge_two_streams_gpu(monkeypatch):
    """Split decodes with fused merges running at the same time on two streams (each stream has its
    own tickets) and back to back on one: every result as close to the oracle as PyTorch's bf16."""
    monkeypatch.setattr(td, "FUSED_MERGE", True)
    cases = []
    for seed, lens in ((1, [3000, 17, 2048]), (2, [1, 4000, 900])):
        q, k, v, seq_lens, table = _gqa_inputs(3, 32, 8, 128, 128, 1, lens, 64, BF16, seed=seed)
        ref = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.1)
        cases.append(((q, k, v, seq_lens, table), ref, _lowp_gqa(q, k, v, seq_lens, table, 0.1)))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(20):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(td.gqa_decode(*cases[i][0], 0.1, 6))
    torch.cuda.synchronize()
    for i in range(2):
        for o, lse in outs[i]:
            _check(o, lse, *cases[i][1], cases[i][2], BF16)


@pytest.mark.gpu
def test_cuda_graph_replay_fused_merge_gpu(monkeypatch):
    """A captured GQA decode step whose merge is fused replays right with new lengths (zeros included)."""
    monkeypatch.setattr(td, "FUSED_MERGE", True)
    q, k, v, seq_lens, _ = _gqa_inputs(2, 32, 8, 128, 128, 1, [4096, 3000], None, BF16, seed=4)
    # Longer replayed lengths read former tails: make the NaN poison there real data.
    k, v = (torch.where(torch.isnan(x), torch.randn_like(x), x) for x in (k, v))
    calls = []
    real = td.combine_splits
    monkeypatch.setattr(td, "combine_splits", lambda *a: (calls.append(1), real(*a)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        td.gqa_decode(q, k, v, seq_lens, None, 0.1, None)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, lse = td.gqa_decode(q, k, v, seq_lens, None, 0.1, None)
    assert calls == []  # the heuristic split's merge was fused
    for lens in ([4096, 3000], [1, 4095], [0, 2222], [0, 0]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, scale=0.1)
        _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, None, 0.1), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("balance", [False, True], ids=["per-sequence", "balanced"])
def test_cuda_graph_replay_new_seq_lens_gpu(balance, monkeypatch):
    """A captured decode step (heuristic splits, per-sequence or balanced) replays correctly after seq_lens
    and q change in place: the balanced workers re-deal the new lengths on the device."""
    monkeypatch.setattr(td, "BALANCE", balance)
    b, h, page, max_pages = 3, 16, 64, 40
    ql, qr, c, kr, seq_lens, table = _mla_inputs(b, h, 512, 64, 1, [2000, 2500, 1], page, BF16)
    # Give every sequence max_pages real pages (fresh ones past its current last page), so that
    # later, longer seq_lens have pages to read. The NaN poison (page tails, unused pages) becomes
    # random data here: a longer replayed seq_len legitimately reads a former page tail.
    pool_pages = c.shape[0]
    big = torch.randn(pool_pages + b * max_pages, page, 576, device=DEV).to(BF16)
    old = torch.cat([c, kr], -1)
    big[:pool_pages] = torch.where(torch.isnan(old), big[:pool_pages], old)
    c, kr = big[..., :512], big[..., 512:]
    full = (torch.randperm(b * max_pages, device=DEV).view(b, max_pages) + pool_pages).to(torch.int32)
    used = table != SENTINEL_PAGE
    full[:, : table.shape[1]] = torch.where(used, table, full[:, : table.shape[1]])
    table = full
    seq_lens = torch.tensor([2000, 2500, 1], dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.1, None)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, lse = td.mla_decode(ql, qr, c, kr, seq_lens, table, 0.1, None)
    for lens in ([2000, 2500, 1], [2560, 0, 77], [1, 2559, 1999], [0, 0, 0]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        ql.copy_(torch.randn_like(ql))
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = mla_decode_oracle(ql, qr, c, kr, seq_lens, scale=0.1, block_table=table)
        _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, c, kr, seq_lens, table, 0.1), BF16)


# ----------------------------------------------------------------------------------------------
# Cached launch plans (mla_attn/ops/_launch.py): later calls with the same shapes replay the host
# decisions of the first and, on CUDA, launch the compiled kernels without Triton's binder.

# (kind, B, H, Hkv, lens, page, splits, dtype, balance)
PLAN_CASES = [
    ("gqa", 3, 8, 2, [100, 17, 64], None, 1, F32, None),
    ("gqa", 3, 9, 3, [100, 1, 64], 16, 3, F16, None),  # the split merge replays too
    ("mla", 3, 16, 1, [113, 0, 64], 4, 5, F32, None),
    ("mla", 2, 9, 1, [100, 63], None, None, F16, True),  # balanced: its merge reads seq_lens
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: "{}-B{}-H{}-P{}-splits{}-{}-bal{}".format(
    c[0], c[1], c[2], c[5], c[6], str(c[7])[6:], c[8]))
def test_plan_replay_new_inputs(case, monkeypatch):
    """Three calls with one call key: one plan, fresh outputs each time, each against the oracle with new
    queries and new lengths (0 included) over the same NaN-poisoned cache."""
    kind, b, h, hkv, lens, page, splits, dtype, balance = case
    monkeypatch.setattr(td, "BALANCE", balance)
    if kind == "gqa":
        q, k, v, seq_lens, table = _gqa_inputs(b, h, hkv, 64, 64, 1, lens, page, dtype)
    else:
        q, qr, c, kr, seq_lens, table = _mla_inputs(b, h, 64, 16, 1, lens, page, dtype)
    outs = []
    for step, new_lens in enumerate((lens, [max(x - 7, 0) for x in lens], [0] + lens[1:])):
        seq_lens = torch.tensor(new_lens, dtype=torch.int32, device=DEV)
        q = torch.randn_like(q)
        if kind == "gqa":
            o, lse = td.gqa_decode(q, k, v, seq_lens, table, 0.125, splits)
            ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.125)
            base = _lowp_gqa(q, k, v, seq_lens, table, 0.125)
        else:
            o, lse = td.mla_decode(q, qr, c, kr, seq_lens, table, 0.125, splits)
            ref_o, ref_lse = mla_decode_oracle(q, qr, c, kr, seq_lens, scale=0.125, block_table=table)
            base = _lowp_mla(q, qr, c, kr, seq_lens, table, 0.125)
        _check(o, lse, ref_o, ref_lse, base, dtype)
        assert len(td._plans) == 1, f"call {step} made a new plan: {len(td._plans)} plans"
        outs.append(o)
    assert len({o.data_ptr() for o in outs}) == 3, "a replayed plan must not hand back an earlier call's output"
    plan = next(iter(td._plans.values()))
    if HAS_CUDA:  # the replays went around Triton's binder
        assert plan.decode.runner is not None
        assert plan.combine is None or plan.combine.runner is not None


def test_plan_key_sees_layout_alignment_and_splits():
    """A call that Triton would specialise differently gets its own plan: other strides, a pointer off
    16-byte alignment, another split count."""
    q, k, v, seq_lens, _ = _gqa_inputs(2, 4, 2, 64, 64, 1, [40, 9], None, F32)
    scale = 0.125

    def run(qx, splits=1):
        o, lse = td.gqa_decode(qx, k, v, seq_lens, None, scale, splits)
        ref_o, ref_lse = decode_oracle(qx, k, v, seq_lens, scale=scale)
        _check(o, lse, ref_o, ref_lse, _lowp_gqa(qx, k, v, seq_lens, None, scale), F32)

    run(q)
    run(q.clone())
    assert len(td._plans) == 1
    run(q.transpose(0, 1).contiguous().transpose(0, 1))  # [B, H] strides swapped
    assert len(td._plans) == 2
    flat = torch.randn(q.numel() + 1, device=DEV)
    run(flat[1:].view(q.shape))  # 4 bytes past an aligned start
    assert len(td._plans) == 3
    run(q, splits=2)
    assert len(td._plans) == 4


class _FakeCompiled:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        assert len(grid) == 3, f"a compiled kernel's runner reads grid[0..2], got {grid}"
        return lambda *args: self.calls.append((grid, args))


class _FakeJit:
    """A JIT function stand-in: Triton's arg_names / signature, and a compile that returns _FakeCompiled."""

    def __init__(self, fn):
        import inspect

        self.signature = inspect.signature(fn)
        self.arg_names = list(self.signature.parameters)
        self.compiled = _FakeCompiled()
        self.jit_calls = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return call


def test_launch_replays_all_arguments_in_parameter_order(monkeypatch):
    """After the JIT call, Launch hands the compiled kernel every parameter in order: per-call slots,
    fixed integers, constexprs given by keyword and the defaults of those not given."""
    from mla_attn.ops import _launch

    def kernel(X, Y, n, stride, BLOCK=None, FLAG=False, EXTRA=7, num_warps=None):  # noqa: N803 - kernel-style
        pass

    monkeypatch.setattr(_launch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(_launch, "FAST", True)
    fn = _FakeJit(kernel)
    launch = _launch.Launch(fn, (3, 2), (_launch.Slot(0), _launch.Slot(1), 5, 64), dict(BLOCK=16, FLAG=True),
                            dict(num_warps=4))
    launch("x0", "y0")
    assert fn.jit_calls == [((3, 2), ("x0", "y0", 5, 64), dict(BLOCK=16, FLAG=True, num_warps=4))]
    launch("x1", "y1")
    launch("x2", "y2")
    assert len(fn.jit_calls) == 1
    # num_warps is both a launch option and (as in Gluon kernels) a parameter
    assert fn.compiled.calls == [((3, 2, 1), ("x1", "y1", 5, 64, 16, True, 7, 4)),
                                 ((3, 2, 1), ("x2", "y2", 5, 64, 16, True, 7, 4))]
    monkeypatch.setattr(_launch, "FAST", False)  # MLA_ATTN_FAST_LAUNCH=0: every call through the JIT
    slow = _launch.Launch(fn, (1,), (_launch.Slot(0), _launch.Slot(1), 5, 64), {}, {})
    slow("a", "b")
    slow("c", "d")
    assert len(fn.jit_calls) == 3 and slow.runner is None


def test_plan_cache_is_bounded(monkeypatch):
    from mla_attn.ops import _launch

    monkeypatch.setattr(_launch, "MAX_PLANS", 3)
    cache = _launch.PlanCache()
    for i in range(7):
        cache.put(i, i)
        assert len(cache) <= 3 and cache[i] == i


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gqa-b1", "gqa-paged", "mla16", "mla128-triton"])
def test_fast_launch_equals_jit_launch_gpu(kind, monkeypatch):
    """bf16 at benchmark-like shapes: the binder-free replay gives bit-identical results to a launch
    through Triton's JIT (MLA_ATTN_FAST_LAUNCH=0), and both match the oracle."""
    from mla_attn.ops import _launch

    monkeypatch.setattr(td, "GLUON_MLA", False)
    if kind.startswith("gqa"):
        page = 64 if kind == "gqa-paged" else None
        q, k, v, seq_lens, table = _gqa_inputs(1 if kind == "gqa-b1" else 4, 32, 8, 128, 128, 1,
                                               [8000] if kind == "gqa-b1" else [3000, 0, 1, 777], page, BF16)
        call = lambda: td.gqa_decode(q, k, v, seq_lens, table, 0.088, None)  # noqa: E731
        oracle = lambda: decode_oracle(q, k, v, seq_lens, block_table=table, scale=0.088)  # noqa: E731
        base = lambda: _lowp_gqa(q, k, v, seq_lens, table, 0.088)  # noqa: E731
    else:
        h = 16 if kind == "mla16" else 128
        q, qr, c, kr, seq_lens, table = _mla_inputs(4, h, 512, 64, 1, [3000, 0, 1, 2222], 64, BF16)
        call = lambda: td.mla_decode(q, qr, c, kr, seq_lens, table, 0.1, None)  # noqa: E731
        oracle = lambda: mla_decode_oracle(q, qr, c, kr, seq_lens, scale=0.1, block_table=table)  # noqa: E731
        base = lambda: _lowp_mla(q, qr, c, kr, seq_lens, table, 0.1)  # noqa: E731
    monkeypatch.setattr(_launch, "FAST", False)
    o_jit, lse_jit = call()
    td._plans.clear()
    monkeypatch.setattr(_launch, "FAST", True)
    call()  # builds the plan through the JIT
    plan = next(iter(td._plans.values()))
    assert plan.decode.runner is not None
    o_fast, lse_fast = call()  # replayed: no binder
    torch.cuda.synchronize()
    assert torch.equal(o_fast, o_jit) and torch.equal(lse_fast, lse_jit)
    ref_o, ref_lse = oracle()
    _check(o_fast, lse_fast, ref_o, ref_lse, base(), BF16)


def test_plan_keeps_no_tensor_alive():
    """A cached plan holds no tensor of the call that made it: a freed cache is really freed."""
    import gc
    import weakref

    q, k, v, seq_lens, table = _gqa_inputs(2, 4, 2, 64, 64, 1, [40, 9], 16, F32)
    td.gqa_decode(q, k, v, seq_lens, table, 0.125, 2)
    assert len(td._plans) == 1
    refs = [weakref.ref(t) for t in (q, k, v, seq_lens, table)]
    del q, k, v, seq_lens, table
    gc.collect()
    assert all(r() is None for r in refs), "a launch plan kept an input tensor alive"


def test_no_plans_while_torch_compile_traces(monkeypatch):
    """While Dynamo traces, launches go through kernel[grid](...) (which it captures) and nothing is cached."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v, seq_lens, _ = _gqa_inputs(2, 4, 2, 64, 64, 1, [40, 9], None, F32)
    o, lse = td.gqa_decode(q, k, v, seq_lens, None, 0.125, 2)
    assert len(td._plans) == 0
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, scale=0.125)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, None, 0.125), F32)

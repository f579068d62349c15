"""The Triton decode kernels read only the cache slots of each sequence's first seq_len tokens (CPU interpreter).

Issue 5 asks that entries past a sequence's last page are never read. The oracle tests poison those pages with
NaN and the block table past the last page with 2**31 - 8, which catches a read whose value reaches the
output. This checks more: no load with its mask on may touch a token at or past a sequence's length (in a
page or in a contiguous cache), a block-table entry past its last page, or anything but q, seq_lens and the
launchers' own buffers. Split-KV (with its merge) and zero-length sequences included.
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.ops.decode import combine as combine_mod
from mla_attn.ops.decode import triton_decode as td
from mla_attn.testing import decode_oracle, to_paged


@pytest.fixture
def check(access_check, monkeypatch):
    """The access check, with the decode launchers' buffers (NaN-filled) and the fused merge's tickets allowed."""

    def alloc(*shape, dtype=None, device=None):
        t = torch.full(*shape, float("nan"), dtype=dtype, device=device)
        access_check.allow(t)
        return t

    monkeypatch.setattr(td, "_alloc", alloc)
    monkeypatch.setattr(combine_mod, "_alloc", alloc)
    access_check.allow_later(lambda: list(td._tickets.values()))
    return access_check


def _allow_tokens(chk, cache, lens, table=None, page=None):
    """Allow the slots of each sequence's first lens[b] tokens: cache [B, H, N, D] (contiguous layout) or a pool
    [pages, P, ...] through ``table``; and, when paged, the table entries up to each sequence's last page."""
    for b, n in enumerate(lens):
        if table is None:
            if n:
                chk.allow(cache[b, :, :n])
            continue
        pages = -(-n // page)
        if pages:
            chk.allow(table[b, :pages])
        for t in range(n):
            chk.allow(cache[int(table[b, t // page]), t % page])


# d 72: the leading strides go to the kernel divided by 8 and are multiplied back there (td._stride_unit), and the
# head split (td.HEAD_SPLIT) on and off, and tiles across pages (td.PAGE_SPAN, off by default).
@pytest.mark.parametrize("page,splits,d,split,span", [
    (None, 1, 32, False, False), (None, 5, 32, False, False), (4, 2, 32, False, False), (16, 3, 32, False, False),
    (1, 2, 32, False, False), (None, 5, 72, True, False), (16, 3, 72, True, False), (16, 3, 72, False, False),
    (16, 3, 72, True, True), (16, 1, 32, False, True)], ids=lambda x: str(x))
def test_gqa_decode_reads_only_live_tokens(page, splits, d, split, span, check, monkeypatch):
    monkeypatch.setattr(td, "HEAD_SPLIT", split)
    monkeypatch.setattr(td, "PAGE_SPAN", span)  # tiles across pages of 16 (the interpreter's tile: 32 keys)
    b, hq, hkv, s = 3, 8, 2, 2
    lens = [0, 17, 45]
    n = max(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(b, hq, s, d)
    k_tok, v_tok = torch.randn(b, n, hkv, d), torch.randn(b, n, hkv, d)
    if page is None:
        k, v, table = k_tok.transpose(1, 2).contiguous(), v_tok.transpose(1, 2).contiguous(), None
    else:
        k, table = to_paged(k_tok, seq_lens, page, generator=torch.Generator().manual_seed(1))
        v, table_v = to_paged(v_tok, seq_lens, page, generator=torch.Generator().manual_seed(1))
        assert torch.equal(table, table_v)
    for t in (q, seq_lens):
        check.allow(t)
    _allow_tokens(check, k, lens, table, page)
    _allow_tokens(check, v, lens, table, page)
    o, lse = td.gqa_decode(q, k, v, seq_lens, table, d ** -0.5, splits)
    assert not check.bad, check.bad
    ref, _ = decode_oracle(q, k, v, seq_lens, block_table=table, scale=d ** -0.5)
    torch.testing.assert_close(o, ref.float(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("switch,value", [("KV_MAJOR", True), ("SPLIT_TAIL", True), ("SPLIT_TAIL", False)],
                         ids=["KV_MAJOR", "SPLIT_TAIL", "every-tile-masked"])
@pytest.mark.parametrize("page,splits", [(None, 1), (None, 5), (16, 3)], ids=lambda x: str(x))
def test_gqa_decode_switches_read_only_live_tokens(page, splits, switch, value, check, monkeypatch):
    """The same bounds with programs ordered KV head first (td.KV_MAJOR, off by default), with the key masks on the
    partial last tile only (td.SPLIT_TAIL forced on, paged too: the whole tiles load unmasked) and on every tile
    (forced off, contiguous too)."""
    monkeypatch.setattr(td, switch, value)
    test_gqa_decode_reads_only_live_tokens(page, splits, 32, False, False, check, monkeypatch)


@pytest.mark.parametrize("page,splits", [(None, 2), (16, 1), (16, 5), (1, 3)], ids=lambda x: str(x))
def test_mla_decode_reads_only_live_tokens(page, splits, check):
    b, h, dc, dr, s = 3, 4, 64, 16, 1
    lens = [33, 0, 20]
    n = max(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ql, qr = torch.randn(b, h, s, dc), torch.randn(b, h, s, dr)
    buf = torch.randn(b, n, dc + dr)  # one [.., Dc + Dr] buffer, two views
    table = None
    if page is not None:
        buf, table = to_paged(buf, seq_lens, page, generator=torch.Generator().manual_seed(2))
    for t in (ql, qr, seq_lens):
        check.allow(t)
    if table is None:
        for i, length in enumerate(lens):
            if length:
                check.allow(buf[i, :length])
    else:
        _allow_tokens(check, buf, lens, table, page)
    o, lse = td.mla_decode(ql, qr, buf[..., :dc], buf[..., dc:], seq_lens, table, 0.125, splits)
    assert not check.bad, check.bad


def test_the_check_sees_a_read_past_a_length(check):
    # The same call allowing one token fewer than the sequence holds: that token's reads are flagged.
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    seq_lens = torch.tensor([9], dtype=torch.int32)
    for t in (q, seq_lens):
        check.allow(t)
    _allow_tokens(check, k, [8])
    _allow_tokens(check, v, [8])
    td.gqa_decode(q, k, v, seq_lens, None, 0.25, 1)
    assert check.bad and all(kind == "load" for kind, _ in check.bad)


@pytest.mark.parametrize("k,rows,dv", [(3, 7, 72), (5, 13, 33), (1, 4, 512)], ids=lambda x: str(x))
def test_merge_touches_only_its_parts(k, rows, dv, check):
    # The split-KV combine alone: parts with -inf rows, odd widths; it may touch only its inputs and outputs.
    o_parts = torch.randn(k, rows, dv)
    lse_parts = torch.randn(k, rows)
    lse_parts[0, 1] = float("-inf")
    for t in (o_parts, lse_parts):
        check.allow(t)
    o, lse = combine_mod.merge_attention_states_triton(o_parts, lse_parts)
    assert not check.bad, check.bad
    w = torch.softmax(lse_parts, 0).nan_to_num(0.0)  # a row whose parts are all -inf: o = 0
    torch.testing.assert_close(o, (w[..., None] * o_parts).sum(0), atol=1e-5, rtol=1e-5)

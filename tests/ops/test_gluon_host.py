"""Host-side pieces of the Gluon kernels, on the CPU: the 2-D views their TMA descriptors are built on,
and the routing rules. (The kernels themselves are GPU-only: tests/ops/test_attention_gluon*.py.)"""

from __future__ import annotations

import pytest
import torch

gluon_fwd = pytest.importorskip("mla_attn.ops.attention.gluon_fwd")
from mla_attn.ops.attention import function, gluon_bwd  # noqa: E402


def _element(view2d, rb, rh, ch, b, h, pos, d):
    """The row the kernel reads for (batch b, head h, position pos): row = b * RB + h * RH + pos, columns
    from h * CH."""
    return view2d[b * rb + h * rh + pos, h * ch:h * ch + d]


@pytest.mark.parametrize("layout", ["head-major", "token-major", "sliced"])
@pytest.mark.parametrize("token_major", [True, False])
def test_tma_view_addresses_every_row(layout, token_major):
    b, h, length, d = 2, 3, 5, 8
    if layout == "head-major":
        t = torch.randn(b, h, length, d)
    elif layout == "token-major":  # the layers' [B, L, H, D] seen through transpose(1, 2)
        t = torch.randn(b, length, h, d).transpose(1, 2)
    else:  # MLA's v: a slice of a wider [B, L, H, Dk + Dv] tensor, transposed
        t = torch.randn(b, length, h, d + 4)[..., 4:].transpose(1, 2)
    view2d, rb, rh, ch = gluon_fwd._tma_view(t, token_major)
    assert view2d.dim() == 2 and view2d.is_contiguous()
    in_place = token_major and layout == "token-major"
    assert (ch == d) == in_place and (view2d.data_ptr() == t.data_ptr()) == (in_place or layout == "head-major")
    for bi in range(b):
        for hi in range(h):
            for pos in range(length):
                assert torch.equal(_element(view2d, rb, rh, ch, bi, hi, pos, d), t[bi, hi, pos])


def test_tma_ready_realigns_an_unaligned_start():
    flat = torch.randn(1 + 4 * 16, dtype=torch.bfloat16)
    t = flat[1:].view(1, 1, 4, 16)
    assert t.data_ptr() % 16 != 0
    r = gluon_fwd._tma_ready(t)
    assert r.data_ptr() % 16 == 0 and torch.equal(r, t)


def test_split_head_dim():
    assert gluon_fwd._split_head_dim(128) == (128, 0)
    assert gluon_fwd._split_head_dim(192) == (128, 64)
    assert gluon_fwd._split_head_dim(72) is None  # 64 + 8: a TMA block must be >= 16 wide
    assert gluon_fwd._split_head_dim(320) is None


def test_dkdv_tiles_by_head_width(monkeypatch):
    assert gluon_bwd._tiles(128) == (64, 2) and gluon_bwd._tiles(64) == (64, 2)
    assert gluon_bwd._tiles(192) == (32, 3)
    monkeypatch.setattr(gluon_bwd, "TILES", (16, 4))
    assert gluon_bwd._tiles(128) == (16, 4)


def test_cpu_tensors_never_route_to_gluon():
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    assert not function._gluon_takes(q, q, q)
    assert not gluon_fwd.supported(q, q, q) and not gluon_bwd.supported(q, q, q)

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


# ---- the Gluon MLA decode kernel (ops/decode/gluon_mla.py) ----

def test_mla_rows_reads_latent_and_rope_in_place():
    """One [pages, P, 576] buffer seen as latent [.., :512] and rope [.., 512:]: each becomes a 2-D
    [pages * P, D] view of the same memory (row r = page * P + slot), no copy."""
    from mla_attn.ops.decode import gluon_mla as gm

    buf = torch.randn(3, 64, 576, dtype=torch.bfloat16)
    c, kr = buf[..., :512], buf[..., 512:]
    c2, kr2 = gm._rows(c), gm._rows(kr)
    assert c2.shape == (192, 512) and kr2.shape == (192, 64)
    assert c2.data_ptr() == c.data_ptr() and kr2.data_ptr() == kr.data_ptr()
    for page, slot in ((0, 0), (1, 17), (2, 63)):
        assert torch.equal(c2[page * 64 + slot], c[page, slot])
        assert torch.equal(kr2[page * 64 + slot], kr[page, slot])


def test_mla_rows_refuses_what_tma_cannot_read():
    from mla_attn.ops.decode import gluon_mla as gm

    buf = torch.randn(2, 8, 600, dtype=torch.bfloat16)
    assert gm._rows(buf[:, :, :512]) is not None  # row stride 600 x 2 B = 1200, a multiple of 16
    assert gm._rows(buf[:, :4, :512]) is None  # rows not evenly spaced across the first dim
    assert gm._rows(torch.randn(2, 8, 515, dtype=torch.bfloat16)[..., :512]) is None  # 1030-byte rows
    assert gm._rows(buf[..., 1:513]) is None  # start not 16-byte aligned
    assert gm._rows(torch.randn(2, 8, 512, dtype=torch.bfloat16).transpose(0, 1)) is None


def test_mla_query_rows_copies_only_when_needed():
    from mla_attn.ops.decode import gluon_mla as gm

    q = torch.randn(2, 128, 1, 512, dtype=torch.bfloat16)
    assert gm._query_rows(q, 256).data_ptr() == q.data_ptr()
    wide = torch.randn(2, 128, 1, 576, dtype=torch.bfloat16)
    ql, qr = wide[..., :512], wide[..., 512:]
    assert gm._query_rows(ql, 256).data_ptr() == ql.data_ptr()  # a view: row stride 576
    assert torch.equal(gm._query_rows(qr, 256), qr.reshape(256, 64))
    odd = torch.randn(2, 128, 1, 513, dtype=torch.bfloat16)[..., 1:]
    out = gm._query_rows(odd, 256)
    assert out.is_contiguous() and out.data_ptr() % 16 == 0 and torch.equal(out, odd.reshape(256, 512))


def test_mla_cpu_tensors_never_route_to_gluon():
    from mla_attn.ops.decode import gluon_mla as gm
    from mla_attn.ops.decode import triton_decode as td

    ql = torch.randn(1, 128, 1, 512, dtype=torch.bfloat16)
    qr = torch.randn(1, 128, 1, 64, dtype=torch.bfloat16)
    buf = torch.randn(1, 64, 576, dtype=torch.bfloat16)
    assert not gm.supported(ql, qr, buf[..., :512], buf[..., 512:])
    assert not td._gluon_mla_takes(ql, qr, buf[..., :512], buf[..., 512:], None, None)


# ---- which Triton the Gluon kernels route on (ops/_gluon_compat.py) ----
def test_gluon_compat_names_and_version_gate(monkeypatch):
    import warnings

    import triton

    compat = pytest.importorskip("mla_attn.ops._gluon_compat")
    from triton.experimental.gluon.language.nvidia.hopper import tma

    # whichever name this Triton has for the TMA copies, and the same function the kernels call
    assert compat.tma_load is (getattr(tma, "async_load", None) or tma.async_copy_global_to_shared)
    assert compat.tma_store is (getattr(tma, "async_store", None) or tma.async_copy_shared_to_global)
    assert gluon_fwd._tma_load is compat.tma_load and gluon_fwd._tma_store is compat.tma_store
    assert compat._version("3.6.0") == (3, 6) and compat._version("3.10.1+git") == (3, 10)
    assert compat._version("nightly") == (0, 0)
    tested = compat._version(triton.__version__) in compat.TESTED
    assert compat.VERSION_OK == (tested or __import__("os").environ.get("MLA_ATTN_GLUON_ANY_TRITON") == "1")
    monkeypatch.setattr(compat, "_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.warn_untested()
        compat.warn_untested()
    assert len(seen) == 1 and "Triton kernels run instead" in str(seen[0].message)

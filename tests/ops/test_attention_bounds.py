"""The Triton attention kernels touch only the elements of their tensors (CPU interpreter).

Every load and store the interpreter runs is checked lane by lane: an address that a mask leaves on
must be an element of q, k, v, dO or of a buffer the launchers allocated. Padding inside a strided
view's storage counts as outside. On a GPU an access past an allocation faults, or silently reads a
neighbour, and the oracle tests cannot tell which lanes read what. The inputs are token-major q and
k/v views into padded storage (rows of 77 elements: the strides are passed as they are), at the GPU
table's tile shapes, for head widths whose value tail is split off (72 = 64 + 16, 40 = 32 + 16).
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.ops.attention import triton_fwd
from mla_attn.ops.attention.triton_bwd import flash_attn_bwd
from mla_attn.ops.attention.triton_fwd import flash_attn_fwd

@pytest.fixture
def accesses(access_check, monkeypatch):
    """(register(tensor), bad), with every buffer the launchers allocate registered (and NaN-filled)."""

    def alloc(shape, device, dtype):
        t = torch.full(shape, float("nan"), device=device, dtype=dtype)
        access_check.allow(t)
        return t

    monkeypatch.setattr(triton_fwd, "_alloc", alloc)
    return access_check.allow, access_check.bad


def _padded(t: torch.Tensor, pad_n: int = 3, pad_d: int = 5) -> torch.Tensor:
    b, h, n, d = t.shape
    buf = torch.full((b, n + pad_n, h, d + pad_d), float("nan"), dtype=t.dtype)
    view = buf[:, :n, :, :d].transpose(1, 2)
    view.copy_(t)
    return view


@pytest.mark.parametrize("layout", ["padded", "token-major"])
@pytest.mark.parametrize("dqk,dv", [(72, 72), (40, 40)], ids=lambda d: str(d))
@pytest.mark.parametrize("m,n", [(130, 127), (61, 140)], ids=lambda x: str(x))
def test_triton_kernels_touch_only_their_tensors(dqk, dv, m, n, layout, accesses):
    # padded: k/v rows of 77 elements (strides as they are, the value head padded); token-major: [B, L, H, D]
    # views as the layers pass them (strides in units of 8, the value head split).
    register, bad = accesses
    q = torch.randn(1, m, 2, dqk).transpose(1, 2)
    if layout == "padded":
        k, v = _padded(torch.randn(1, 2, n, dqk)), _padded(torch.randn(1, 2, n, dv))
    else:
        k, v = torch.randn(1, n, 2, dqk).transpose(1, 2), torch.randn(1, n, 2, dv).transpose(1, 2)
    do = torch.randn(1, 2, m, dv)
    for t in (q, k, v, do):
        register(t)
    aligned = layout != "padded"
    assert triton_fwd.rows_aligned(q, k, v) == aligned
    assert triton_fwd.stride_unit(q, k, v) == (8 if aligned else 1)
    # The GPU table's tiles (triton_fwd._fwd_config, triton_bwd._dkdv_config / _dq_config at widths <= 192).
    o, lse = flash_attn_fwd(q, k, v, True, dqk ** -0.5, config=(128, 64, 8, 3))
    assert not bad, f"forward: {bad}"
    flash_attn_bwd(do, q, k, v, o, lse, True, dqk ** -0.5, dkdv_config=(64, 128, 8, 3), dq_config=(128, 64, 8, 3))
    assert not bad, f"backward: {bad}"


def test_the_check_sees_an_access_outside(accesses):
    # The same call with v left unregistered: every read of v is outside.
    register, bad = accesses
    q, k, v = torch.randn(1, 2, 20, 72), torch.randn(1, 2, 20, 72), torch.randn(1, 2, 20, 72)
    register(q)
    register(k)
    flash_attn_fwd(q, k, v, True, 0.1, config=(32, 32, 4, 1))
    assert bad and all(kind == "load" for kind, _ in bad)


@pytest.mark.parametrize("hq,hkv,dqk,dv", [(4, 1, 128, 128), (4, 2, 192, 128), (3, 3, 48, 32)],
                         ids=["mqa-128", "gqa-192x128", "mha-48x32"])
def test_triton_kernels_touch_only_their_tensors_gqa(hq, hkv, dqk, dv, accesses):
    # Power-of-two and MLA-expanded widths, GQA / MQA, M > N (rows that see no key), on padded k/v views.
    register, bad = accesses
    m, n = 70, 45
    q = torch.randn(1, m, hq, dqk).transpose(1, 2)
    k, v = _padded(torch.randn(1, hkv, n, dqk)), _padded(torch.randn(1, hkv, n, dv))
    do = torch.randn(1, hq, m, dv)
    for t in (q, k, v, do):
        register(t)
    o, lse = flash_attn_fwd(q, k, v, True, dqk ** -0.5, config=(128, 64, 8, 3))
    assert not bad, f"forward: {bad}"
    flash_attn_bwd(do, q, k, v, o, lse, True, dqk ** -0.5, dkdv_config=(64, 128, 8, 3), dq_config=(128, 64, 8, 3))
    assert not bad, f"backward: {bad}"

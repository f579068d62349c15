"""lse from attention(..., return_lse=True) is differentiable on every impl (the reference's always was)."""

import pytest
import torch

import mla_attn
from mla_attn.testing import assert_close, attention_oracle, dtype_floor


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_gradient(impl, causal):
    # A loss on o and lse (merging attention over key chunks uses both): rows 0..3 see no key when causal.
    q, k, v = torch.randn(1, 4, 9, 24), torch.randn(1, 2, 5, 24), torch.randn(1, 2, 5, 16)
    w, u = torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = mla_attn.attention(*leaves, causal=causal, return_lse=True, impl=impl)
    assert lse.requires_grad
    ((o * w).sum() + (lse.masked_fill(lse.isneginf(), 0) * u).sum()).backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o_r, lse_r = attention_oracle(*ref, causal=causal)
    ((o_r * w.double()).sum() + (lse_r.masked_fill(lse_r.isneginf(), 0) * u.double()).sum()).backward()
    for name, a, r in zip(("dq", "dk", "dv"), leaves, ref):
        assert torch.isfinite(a.grad).all()
        assert_close(a.grad, r.grad, floor=5 * dtype_floor(torch.float32), name=name)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_lse_gradient_expanded_and_nan_on_empty_rows(impl):
    # lse.sum()'s gradient reaches the backward as an expanded tensor (strides 0), and a gradient given at rows
    # that see no key (lse = -inf) may be anything, NaN included: those rows have P = 0 and add nothing.
    q, k, v = torch.randn(1, 4, 9, 24), torch.randn(1, 2, 5, 24), torch.randn(1, 2, 5, 16)
    w = torch.randn(1, 4, 9, 16)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o_r, lse_r = attention_oracle(*ref, causal=True)
    ((o_r * w.double()).sum() + lse_r.masked_fill(lse_r.isneginf(), 0).sum()).backward()
    dlse_nan = torch.ones(1, 4, 9).index_fill_(2, torch.arange(4), float("nan"))  # rows 0..3 see no key
    for dlse in (torch.ones(()).expand(1, 4, 9), dlse_nan):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = mla_attn.attention(*leaves, causal=True, return_lse=True, impl=impl)
        assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
        torch.autograd.backward([o, lse], [w, dlse])
        for name, a, r in zip(("dq", "dk", "dv"), leaves, ref):
            assert torch.isfinite(a.grad).all(), name
            assert_close(a.grad, r.grad, floor=5 * dtype_floor(torch.float32), name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_lse_gradient_expanded_and_nan_on_empty_rows(dtype):
    # On CUDA (bf16: the Gluon forward and dK/dV pass; fp32: the Triton kernels), with dlse folded into the
    # backward's preprocess launch: an expanded dlse, a NaN dlse on rows with no key, a dlse weighted per row.
    # Tolerance: 5x the dtype's output floor, as for the gradients in test_attention_triton.py.
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(*s, device="cuda", generator=g).to(dtype) for s in ((2, 4, 200, 64), (2, 2, 150, 64),
                                                                              (2, 2, 150, 64)))
    w, u = torch.randn(2, 4, 200, 64, device="cuda", generator=g), torch.randn(2, 4, 200, device="cuda", generator=g)
    dead = 50  # causal, M = 200 > N = 150: rows 0..49 see no key
    nan_rows = u.clone()
    nan_rows[:, :, :dead] = float("nan")
    for dlse in (torch.ones((), device="cuda").expand(2, 4, 200), nan_rows):
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        o_r, lse_r = attention_oracle(*ref, causal=True)
        torch.autograd.backward([o_r, lse_r], [w.double(), dlse.double().masked_fill(lse_r.isneginf(), 0)])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = mla_attn.attention(*leaves, causal=True, return_lse=True, impl="triton")
        assert torch.isneginf(lse[:, :, :dead]).all() and torch.isfinite(lse[:, :, dead:]).all()
        torch.autograd.backward([o, lse], [w.to(dtype), dlse])
        for name, a, r in zip(("dq", "dk", "dv"), leaves, ref):
            assert torch.isfinite(a.grad).all(), name
            assert_close(a.grad, r.grad, floor=5 * dtype_floor(dtype), name=name)


@pytest.mark.parametrize("use", ["o", "lse"])
def test_unused_output_gets_no_materialised_gradient(use, monkeypatch):
    # The Function does not materialise zero gradients (ctx.set_materialize_grads(False)): a loss on o alone
    # reaches the backward launcher with dlse None (no fill kernel, no dlse reads); a loss on lse alone gets
    # dO = 0 made there. Both match the float64 oracle.
    from mla_attn.ops.attention import function

    seen = []
    real = function.flash_attn_bwd
    monkeypatch.setattr(function, "flash_attn_bwd", lambda *a, dlse=None, **kw: seen.append(dlse) or real(
        *a, dlse=dlse, **kw))
    q, k, v = torch.randn(1, 4, 9, 24), torch.randn(1, 2, 7, 24), torch.randn(1, 2, 7, 16)
    w = torch.randn(1, 4, 9, 16)

    def loss(o, lse):
        return (o * w.to(o.dtype)).sum() if use == "o" else (lse * w[..., 0].to(lse.dtype)).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*mla_attn.attention(*leaves, causal=True, return_lse=True, impl="triton")).backward()
    assert len(seen) == 1 and (seen[0] is None) == (use == "o")
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    loss(*attention_oracle(*ref, causal=True)).backward()
    for name, a, r in zip(("dq", "dk", "dv"), leaves, ref):
        if r.grad is None:  # lse does not depend on v: dV is exactly zero
            assert use == "lse" and name == "dv" and torch.equal(a.grad, torch.zeros_like(a.grad))
        else:
            assert_close(a.grad, r.grad, floor=5 * dtype_floor(torch.float32), name=name)

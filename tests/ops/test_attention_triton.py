"""Triton flash attention (forward + backward) against the float64 oracle.

Interpreter part (CPU, fp32/fp16, small shapes): every case checks o, lse and dq/dk/dv against the
float64 oracle, with launcher buffers NaN-poisoned and K/V passed as strided views into NaN-filled
storage, so an unwritten output or a read past N / past Dqk or Dv fails loudly.

Tolerances (rel_err = ||x - ref|| / ||ref||, from mla_attn.testing):
- the kernel may be at most 2x as far from the oracle as PyTorch's own computation in the same dtype
  (``_torch_same_dtype``), never required to beat the floor;
- floors: outputs ``dtype_floor(dtype)`` (a few units of the dtype's rounding: fp32 2e-5, fp16 2e-3,
  bf16 1.6e-2); gradients 5x that, because dS = P * (dP - delta) subtracts two nearly equal sums and
  dQ/dK add up to N such terms, so their relative error is a few times the output's;
- lse: absolute 1e-4 in fp32 inputs (fp32 log of a sum of exps of scores ~ O(10)), 2e-3 for fp16 inputs
  (fp16 rounding of q and k is in the oracle too, but the kernel's dot products accumulate in fp32
  and the score scale is applied after the dot, ~1e-3 of a score of magnitude ~3).
"""

from __future__ import annotations


import pytest
import torch

from mla_attn import attention
from mla_attn.ops.attention import triton_fwd
from mla_attn.ops.attention.function import flash_attention
from mla_attn.ops.attention.triton_bwd import flash_attn_bwd
from mla_attn.ops.attention.triton_fwd import flash_attn_fwd
from mla_attn.testing import assert_close, assert_lse_close, attention_oracle, dtype_floor

GRAD_FLOOR_FACTOR = 5.0
LSE_ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launchers allocate (o, lse, delta, dq, dk, dv) starts as NaN."""

    def alloc(shape, device, dtype):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    monkeypatch.setattr(triton_fwd, "_alloc", alloc)


def _strided(t: torch.Tensor, pad_n: int = 3, pad_d: int = 5) -> torch.Tensor:
    """A view of t [B, H, L, D] inside NaN storage [B, L + pad_n, H, D + pad_d] (token-major, padded rows)."""
    b, h, n, d = t.shape
    buf = torch.full((b, n + pad_n, h, d + pad_d), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:, :n, :, :d].transpose(1, 2)
    view.copy_(t)
    return view


def _torch_same_dtype(q, k, v, causal, scale):
    """Attention done by PyTorch in the inputs' own dtype (scores, softmax, P V): the error baseline."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    m, n = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(m, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(j > i + n - m, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: 0, as the op defines
    return p @ v


def _grads(fn, inputs, do):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(do.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _check(b, hq, hkv, m, n, dqk, dv, causal, dtype, *, scale=None, q_mul=1.0, k_mul=1.0, device="cpu",
           strided=True, pad_d=5, tiles=None):
    """``tiles``: (forward, dK/dV, dQ) configs for the launchers, called directly; None goes through the autograd
    function and its own choice."""
    scale = dqk ** -0.5 if scale is None else scale
    q = (torch.randn(b, hq, m, dqk, device=device) * q_mul).to(dtype)
    k = (torch.randn(b, hkv, n, dqk, device=device) * k_mul).to(dtype)
    v = torch.randn(b, hkv, n, dv, device=device).to(dtype)
    do = torch.randn(b, hq, m, dv, device=device).to(dtype)
    # q as a [B, M, H, D] transpose, k/v inside NaN-padded token-major storage (strided), or as they are.
    if strided:
        qs = q.transpose(1, 2).contiguous().transpose(1, 2)
        ks, vs = _strided(k, pad_d=pad_d), _strided(v, pad_d=pad_d)
    else:
        qs, ks, vs = q, k, v

    # detach() keeps the views' strides (clone() would make the padded views contiguous again, and the
    # kernels would never see the NaN padding).
    leaves = [t.detach().requires_grad_() for t in (qs, ks, vs)]
    if strided:
        assert not leaves[1].is_contiguous() and leaves[1].stride(-2) != leaves[1].shape[-1], leaves[1].stride()
    if tiles is None:
        o, lse = flash_attention(*leaves, causal, scale)
        o.backward(do)
        grads = [t.grad for t in leaves]
    else:
        o, lse = flash_attn_fwd(*leaves, causal, scale, config=tiles[0])
        grads = flash_attn_bwd(do, *leaves, o, lse, causal, scale, dkdv_config=tiles[1], dq_config=tiles[2])

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_oracle(q64, k64, v64, causal=causal, scale=scale)
    o_ref.backward(do.double())
    o_base, g_base = _grads(lambda a, b_, c: _torch_same_dtype(a, b_, c, causal, scale), (q, k, v), do)

    floor = dtype_floor(dtype)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, floor=floor, baseline=o_base, name="o")
    assert_lse_close(lse, lse_ref, atol=LSE_ATOL[dtype])
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad), g_base):
        assert got.shape == want.shape
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        if want.norm() < 1e-9:
            # N = 1 (or no visible key): dS = P * (dP - delta) is exactly 0, so dq and dk are 0 up to the
            # cancellation of dP and delta, each a dot product of size Dv: absolute bound.
            assert got.abs().max() <= floor * do.abs().max() * v.abs().max() * dv, f"{name}: not ~0"
            continue
        assert_close(got, want, floor=GRAD_FLOOR_FACTOR * floor, baseline=base, name=name)
    return o, lse, grads


# (B, Hq, Hkv, M, N, Dqk, Dv, causal, dtype): MHA/GQA/MQA, causal and not, the (M, N) pairs
# and head dims, plus odd widths (8 < 16, 72 = 64 + padded tail, 192 = MLA expanded), with
# non-power-of-two head counts. A covering set, not the cross product.
CASES = [
    (1, 2, 2, 1, 1, 16, 16, True, torch.float32),
    (2, 6, 2, 7, 3, 48, 32, True, torch.float32),       # M > N: 4 rows see no key
    (1, 3, 1, 113, 203, 64, 64, True, torch.float32),   # MQA, cached prefix
    (1, 4, 2, 113, 203, 48, 32, False, torch.float16),
    (1, 3, 3, 64, 64, 64, 64, True, torch.float16),
    (1, 5, 1, 65, 130, 16, 16, False, torch.float32),
    (2, 4, 2, 65, 130, 48, 32, True, torch.float32),
    (1, 6, 3, 130, 65, 64, 64, True, torch.float32),    # M > N: 65 rows see no key
    (1, 2, 1, 33, 47, 192, 128, True, torch.float32),   # MLA expanded widths
    (1, 2, 2, 17, 40, 72, 72, False, torch.float16),   # Dv 72 = 64 + 16 (split_value_dim), tail padded
    (1, 4, 2, 37, 70, 96, 96, True, torch.float32),    # 64 + 32, no padding
    (2, 3, 3, 29, 29, 40, 40, False, torch.float16),   # 32 + 16, tail padded
    (1, 4, 1, 50, 80, 64, 80, True, torch.float32),    # MQA, Dv 80 = 64 + 16 wider than Dqk
    (1, 2, 1, 20, 33, 160, 160, True, torch.float32),  # 128 + 32 (padded views: copied, see below)
    (1, 3, 1, 9, 9, 8, 24, True, torch.float32),
]


def _case_id(c):
    b, hq, hkv, m, n, dqk, dv, causal, dtype = c
    return f"B{b}-Hq{hq}-Hkv{hkv}-M{m}-N{n}-D{dqk}x{dv}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flash_attention_matches_oracle(case, poison):
    _check(*case)


def test_split_value_dim():
    # A tail only where main + tail is narrower than the power of two the whole width would pad to.
    split = triton_fwd.split_value_dim
    assert [split(d) for d in (8, 16, 20, 32, 40, 48, 64, 72, 80, 96, 128, 160, 512)] == [
        (16, 0), (16, 0), (32, 0), (32, 0), (32, 16), (32, 16), (64, 0), (64, 16), (64, 16), (64, 32), (128, 0),
        (128, 32), (512, 0)]
    # Rows that are not 16-byte aligned keep the padded tile (Triton 3.6 miscompiles the split there).
    assert split(72, aligned=False) == (128, 0) and split(40, aligned=False) == (64, 0)
    assert triton_fwd.rows_aligned(torch.empty(2, 3, 5, 72, dtype=torch.bfloat16))
    assert not triton_fwd.rows_aligned(torch.empty(2, 3, 5, 77, dtype=torch.bfloat16)[..., :72])
    assert triton_fwd.rows_aligned(torch.empty(2, 3, 5, 36, dtype=torch.float32), None)


def test_unaligned_rows_are_copied(monkeypatch):
    # Rows that are not 16-byte aligned (views into padded storage): the op copies them to contiguous for the
    # kernels (element-wide loads are slow, and Triton 3.6 miscompiled them at 160/160); rows a copy would not
    # align go as they are, and so do aligned ones.
    from mla_attn.ops.attention import function

    seen = []
    real = function.flash_attn_fwd
    monkeypatch.setattr(function, "flash_attn_fwd", lambda q, k, v, *a: seen.append((q, k, v)) or real(q, k, v, *a))
    for dv, pad, copied in ((72, 5, True), (64, 5, True), (64, 8, False), (20, 5, False)):
        buf = torch.randn(1, 12, 2, dv + pad, dtype=torch.float16)
        k = v = buf[:, :, :, :dv].transpose(1, 2)
        q = torch.randn(1, 2, 7, dv, dtype=torch.float16)
        flash_attention(q, k, v, True, 0.2)
        got_k = seen[-1][1]
        assert got_k.is_contiguous() == copied and torch.equal(got_k, k), (dv, pad)
        assert (got_k is k) != copied
    fwd = triton_fwd.aligned_rows
    a, b = torch.empty(1, 2, 3, 72), torch.empty(1, 2, 3, 77)[..., :72]
    assert fwd(a, None)[0] is a and fwd(b)[0].is_contiguous() and fwd(a, b)[0] is a
    odd = torch.empty(1, 2, 3, 9)[..., :7]  # 28-byte rows: a copy would not align them, nothing is copied
    assert fwd(b, odd)[0] is b
    c = torch.empty(2 * 72 + 1)[1:].view(1, 1, 2, 72)  # contiguous, but 4 bytes off 16: copied all the same
    assert c.is_contiguous() and not triton_fwd.rows_aligned(c) and triton_fwd.rows_aligned(fwd(c)[0])


def test_stride_unit_is_what_divides_every_leading_stride():
    unit = triton_fwd.stride_unit
    assert unit(torch.empty(2, 3, 40, 128)) == 1  # all multiples of 16: passed as they are
    assert unit(torch.empty(2, 3, 40, 72)) == 8
    assert unit(torch.empty(2, 3, 40, 36), torch.empty(2, 3, 40, 20)) == 4
    assert unit(torch.empty(2, 3, 41, 64)) == 1
    assert unit(torch.empty(2, 40, 3, 18).transpose(1, 2)) == 2
    assert unit(torch.empty(2, 3, 40, 72), torch.empty(1, 3, 5, 77)) == 1  # odd rows: nothing to gain
    assert unit(torch.empty(2, 3, 40, 72), None) == 8
    assert triton_fwd.unit_strides(torch.empty(2, 3, 40, 72), 8) == (3 * 40 * 9, 40 * 9, 9, 1)


# Head widths whose row strides are not multiples of 16 elements: the launchers pass the strides divided by
# a power of two and the kernels multiply it back (triton_fwd.stride_unit). Contiguous and [B, L, H, D]
# layouts, so each unit is used; the unit each case runs with is asserted, so the case cannot pass
# without taking the path it names.
UNIT_CASES = [
    # B, Hq, Hkv, M, N, Dqk, Dv, causal, dtype, layout, unit
    (2, 4, 2, 37, 70, 72, 72, True, torch.float32, "contiguous", 8),
    (1, 3, 1, 70, 37, 72, 72, True, torch.float16, "token-major", 8),
    (1, 4, 4, 45, 45, 36, 20, False, torch.float32, "contiguous", 4),
    (1, 6, 3, 29, 61, 18, 10, True, torch.float32, "token-major", 2),
]


@pytest.mark.parametrize("case", UNIT_CASES, ids=lambda c: f"D{c[5]}x{c[6]}-{c[9]}-unit{c[10]}")
def test_unaligned_row_strides_match_oracle(case, poison, monkeypatch):
    *shape, dtype, layout, want_unit = case
    seen = []
    real = triton_fwd.stride_unit

    def spy(*tensors):
        seen.append(real(*tensors))
        return seen[-1]

    monkeypatch.setattr(triton_fwd, "stride_unit", spy)
    from mla_attn.ops.attention import triton_bwd
    monkeypatch.setattr(triton_bwd, "stride_unit", spy)
    if layout == "token-major":
        # q, k, v as the layers pass them: [B, L, H, D] storage seen as [B, H, L, D].
        b, hq, hkv, m, n, dqk, dv, causal = shape
        torch.manual_seed(0)
        q = torch.randn(b, m, hq, dqk).to(dtype).transpose(1, 2)
        k = torch.randn(b, n, hkv, dqk).to(dtype).transpose(1, 2)
        v = torch.randn(b, n, hkv, dv).to(dtype).transpose(1, 2)
        do = torch.randn(b, hq, m, dv).to(dtype)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse = flash_attention(*leaves, causal, dqk ** -0.5)
        o.backward(do)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        o_ref, lse_ref = attention_oracle(q64, k64, v64, causal=causal, scale=dqk ** -0.5)
        o_ref.backward(do.double())
        floor = dtype_floor(dtype)
        o_base, g_base = _grads(lambda a, b_, c: _torch_same_dtype(a, b_, c, causal, dqk ** -0.5), (q, k, v), do)
        assert_close(o, o_ref, floor=floor, baseline=o_base, name="o")
        assert_lse_close(lse, lse_ref, atol=LSE_ATOL[dtype])
        for name, leaf, want, base in zip(("dq", "dk", "dv"), leaves, (q64.grad, k64.grad, v64.grad), g_base):
            assert_close(leaf.grad, want, floor=GRAD_FLOOR_FACTOR * floor, baseline=base, name=name)
    else:
        _check(*shape, dtype, strided=False)
    assert seen and all(u == want_unit for u in seen), seen  # the forward's and the backward's


def test_large_magnitude_inputs_backward(poison):
    # q*5, k*3: scores reach ~+-40, the softmax is nearly one-hot; no overflow, no NaN.
    _check(1, 4, 2, 65, 97, 64, 64, True, torch.float32, q_mul=5.0, k_mul=3.0)
    _check(1, 4, 2, 65, 97, 64, 64, False, torch.float16, q_mul=5.0, k_mul=3.0)


def test_rows_without_keys_give_zero_and_neg_inf(poison):
    m, n = 20, 6  # rows 0..13 see no key
    o, lse, (dq, dk, dv) = _check(1, 2, 1, m, n, 32, 32, True, torch.float32)
    dead = m - n
    assert torch.equal(o[:, :, :dead], torch.zeros_like(o[:, :, :dead]))
    assert torch.isneginf(lse[:, :, :dead]).all() and torch.isfinite(lse[:, :, dead:]).all()
    assert torch.equal(dq[:, :, :dead], torch.zeros_like(dq[:, :, :dead]))


@pytest.mark.parametrize("m,n", [(0, 5), (5, 0), (0, 0)], ids=lambda x: str(x))
def test_zero_length(m, n, poison):
    q = torch.randn(1, 2, m, 16, requires_grad=True)
    k = torch.randn(1, 1, n, 16, requires_grad=True)
    v = torch.randn(1, 1, n, 16, requires_grad=True)
    o, lse = flash_attention(q, k, v, True, 0.25)
    assert o.shape == (1, 2, m, 16) and lse.shape == (1, 2, m)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("fwd_cfg,dkdv_cfg,dq_cfg", [
    ((16, 64, 4, 1), (64, 16, 4, 1), (16, 64, 4, 1)),
    ((64, 16, 4, 1), (16, 64, 4, 1), (64, 16, 4, 1)),
], ids=["tall-keys", "tall-queries"])
def test_other_tile_shapes(fwd_cfg, dkdv_cfg, dq_cfg, poison):
    # The causal block bounds are computed from BLOCK_M, BLOCK_N and N - M: check unequal tiles both ways.
    for m, n in ((50, 77), (77, 50)):
        q = torch.randn(1, 4, m, 32)
        k = torch.randn(1, 2, n, 32)
        v = torch.randn(1, 2, n, 16)
        do = torch.randn(1, 4, m, 16)
        o, lse = flash_attn_fwd(q, k, v, True, 0.3, config=fwd_cfg)
        dq, dk, dv = flash_attn_bwd(do, q, k, v, o, lse, True, 0.3, dkdv_config=dkdv_cfg, dq_config=dq_cfg)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        o_ref, lse_ref = attention_oracle(q64, k64, v64, causal=True, scale=0.3)
        o_ref.backward(do.double())
        assert_close(o, o_ref, floor=dtype_floor(torch.float32), name="o")
        assert_lse_close(lse, lse_ref, atol=1e-4)
        for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
            assert_close(got, want, floor=GRAD_FLOOR_FACTOR * dtype_floor(torch.float32), name=name)


def test_public_op_dispatches_to_triton(poison):
    import mla_attn

    q = torch.randn(2, 4, 19, 32, requires_grad=True)
    k = torch.randn(2, 2, 23, 32, requires_grad=True)
    v = torch.randn(2, 2, 23, 16, requires_grad=True)
    o, lse = mla_attn.ops.attention(q, k, v, causal=True, return_lse=True, impl="triton")
    o_r, lse_r = mla_attn.ops.attention(q, k, v, causal=True, return_lse=True, impl="reference")
    assert_close(o, o_r.detach(), floor=dtype_floor(torch.float32))
    assert_lse_close(lse, lse_r, atol=1e-4)
    assert lse.requires_grad  # lse is differentiable (review: lse_grad.patch)
    (g,) = torch.autograd.grad(o.sum(), q)
    (g_r,) = torch.autograd.grad(o_r.sum(), q)
    assert_close(g, g_r, floor=GRAD_FLOOR_FACTOR * dtype_floor(torch.float32))


def test_autocast_runs_in_autocast_dtype():
    q = torch.randn(1, 2, 24, 32)
    k = torch.randn(1, 2, 24, 32)
    v = torch.randn(1, 2, 24, 32)
    with torch.autocast("cpu", dtype=torch.float16):
        o, lse = flash_attention(q, k, v, True, 32 ** -0.5)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    o_ref, _ = attention_oracle(q.half(), k.half(), v.half(), causal=True)
    assert_close(o, o_ref, floor=dtype_floor(torch.float16))


def test_torch_compile_traces_the_custom_ops():
    # aot_eager needs no C++ compiler, yet traces the custom ops through their fake implementations
    # (shapes, dtypes) in forward and backward.
    def f(q, k, v):
        o, lse = flash_attention(q, k, v, True, 0.2)
        return (o * o).sum() + lse[lse.isfinite()].sum()

    q = torch.randn(1, 4, 20, 16, requires_grad=True)
    k = torch.randn(1, 2, 12, 16, requires_grad=True)
    v = torch.randn(1, 2, 12, 16, requires_grad=True)
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


def test_torch_compile_graph_holds_the_custom_ops():
    # Eager calls skip the dispatcher (function._fwd/_bwd); under torch.compile the graphs must still hold the
    # opaque custom ops, forward and backward, not a trace through the launchers.
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen = []

    def record(gm, _inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=record, bw_compiler=record)

    def f(q, k, v):
        o, _ = flash_attention(q, k, v, True, 0.2)
        return (o * o).sum()

    q, k, v = (torch.randn(1, h, n, 16, requires_grad=True) for h, n in ((4, 20), (2, 12), (2, 12)))
    torch.compile(f, backend=backend, fullgraph=True)(q, k, v).backward()
    assert "mla_attn.flash_attn_fwd.default" in seen and "mla_attn.flash_attn_bwd.default" in seen, seen


def test_launch_falls_back_when_tiles_do_not_fit(monkeypatch):
    # A table entry too large for the GPU raises OutOfResources while compiling; the launcher must
    # try smaller tiles, remember the one that fit, and raise if none does.
    from mla_attn.ops.attention.triton_fwd import OutOfResources, launch_with_fallback

    monkeypatch.setattr(triton_fwd, "_chosen", {})
    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg[0] * cfg[1] > 64 * 32:
            raise OutOfResources(300000, 232448, "shared memory")
        return cfg

    first = (128, 64, 8, 3)
    assert launch_with_fallback(launch, "k", first) == (64, 32, 4, 2)
    assert tried == [first, (64, 64, 4, 2), (64, 32, 4, 2)]
    tried.clear()
    assert launch_with_fallback(launch, "k", first) == (64, 32, 4, 2) and tried == [(64, 32, 4, 2)]
    with pytest.raises(OutOfResources):
        launch_with_fallback(launch, "pinned", first, pinned=True)
    with pytest.raises(RuntimeError, match="no tile configuration"):
        launch_with_fallback(lambda cfg: launch((10**6, 1, 1, 1)), "none", first)


def test_float64_is_refused_with_a_clear_error():
    q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        flash_attention(q, q, q, False, 0.25)


# ----------------------------------------------------------------------------------------------
# GPU: bf16 / fp16 at the benchmark shapes (batch and heads reduced) and the long odd lengths.
GPU_CASES = [
    # B, Hq, Hkv, M, N, Dqk, Dv, causal
    (1, 4, 4, 4096, 4096, 128, 128, True),
    (1, 2, 2, 8192, 8192, 192, 128, True),
    (1, 8, 8, 2048, 2048, 192, 128, True),
    (2, 8, 2, 2048, 2048, 128, 128, True),
    (1, 4, 4, 1023, 1024, 128, 128, True),
    (1, 4, 2, 1023, 1024, 128, 128, False),
    (1, 2, 2, 4224, 4224, 128, 128, True),
    (1, 4, 1, 300, 700, 576, 512, True),
    (1, 3, 3, 257, 255, 72, 72, True),   # contiguous: leading strides passed / 8 (stride_unit)
    (2, 6, 2, 333, 333, 36, 20, True),   # ... / 4
    (1, 4, 2, 300, 300, 40, 40, True),   # the value head split 32 + 16 (contiguous; strided: padded to 64)
    (1, 4, 4, 257, 257, 96, 96, True),   # ... 64 + 32
    (1, 2, 2, 257, 257, 160, 160, True),  # ... 128 + 32
    (1, 4, 2, 257, 300, 48, 32, False),
    (1, 4, 4, 511, 511, 64, 64, True),
]


def _gpu_id(c):
    b, hq, hkv, m, n, dqk, dv, causal = c
    return f"B{b}-Hq{hq}-Hkv{hkv}-M{m}-N{n}-D{dqk}x{dv}-{'causal' if causal else 'full'}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
def test_gpu_matches_oracle(case, dtype, poison):
    # Strided views (the Triton kernels on every GPU) and, in bf16, contiguous inputs (on Hopper, where
    # the Gluon forward and dK/dV pass take them; test_attention_gluon.py covers fp16 there).
    _check(*case, dtype, device="cuda")
    if dtype == torch.bfloat16:
        _check(*case, dtype, device="cuda", strided=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dqk,dv", [(128, 128), (192, 128), (72, 72)], ids=lambda d: str(d))
def test_gpu_float32_fits(dqk, dv, poison):
    # fp32 tiles are twice as large: the launcher must pick (or fall back to) tiles that fit.
    _check(1, 4, 2, 300, 333, dqk, dv, True, torch.float32, device="cuda")


@pytest.mark.gpu
def test_gpu_float32_wide_heads_are_refused_by_triton_and_run_by_auto():
    # fp32 at 576/512 did not finish compiling in minutes on the H200 (2026-12-02): the public op
    # refuses it under impl="triton" and runs the reference under "auto".
    q = torch.randn(1, 2, 40, 576, device="cuda")
    k, v = torch.randn(1, 1, 50, 576, device="cuda"), torch.randn(1, 1, 50, 512, device="cuda")
    with pytest.raises(ValueError, match="float32 only up to head dims 256"):
        attention(q, k, v, impl="triton")
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, impl="reference"))


@pytest.mark.gpu
def test_gpu_deterministic():
    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 1100, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 1100, 128, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = flash_attention(*leaves, True, 0.09)
        o.backward(do)
        runs.append([o, lse] + [t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_gpu_side_stream_dq_same_gradients(strided, monkeypatch):
    """The dQ pass on a side stream (triton_bwd.SIDE_STREAM_DQ, on by default): gradients bitwise equal
    to the one-stream backward, against the oracle, and again inside a captured CUDA graph."""
    from mla_attn.ops.attention import triton_bwd

    monkeypatch.setattr(triton_bwd, "SIDE_STREAM_DQ", False)
    _check(2, 8, 2, 300, 333, 128, 128, True, torch.bfloat16, device="cuda", strided=strided)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(*s_, device="cuda", generator=g).to(torch.bfloat16)
                   for s_ in ((2, 8, 700, 128), (2, 2, 700, 128), (2, 2, 700, 128), (2, 8, 700, 128)))

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, True, 0.09)[0].backward(do)
        return [t.grad for t in leaves]

    one = grads()
    monkeypatch.setattr(triton_bwd, "SIDE_STREAM_DQ", True)
    monkeypatch.setattr(triton_bwd, "SIDE_STREAM_MIN_WORK", 0)  # these rows are below the default threshold
    _check(2, 8, 2, 300, 333, 128, 128, True, torch.bfloat16, device="cuda", strided=strided)
    two = grads()
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dq, dk, dv = torch.autograd.grad(flash_attention(*leaves, True, 0.09)[0], leaves, do)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dq, dk, dv = torch.autograd.grad(flash_attention(*leaves, True, 0.09)[0], leaves, do)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(one, (dq, dk, dv)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_torch_compile_and_autocast():
    def f(q, k, v):
        return flash_attention(q, k, v, True, 64 ** -0.5)[0].float().square().mean()

    q = torch.randn(2, 4, 300, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, 300, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, 300, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = torch.autograd.grad(f(q, k, v), (q, k, v))
        got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        assert a.dtype == torch.float32  # gradients come back in the leaves' dtype
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "expanded-dlse"])
def test_backward_plan_replays_new_inputs(with_dlse, poison, monkeypatch):
    """flash_attn_bwd's cached plan (triton_bwd._BwdPlan): later calls with new inputs of the same layout give
    bit for bit the gradients of an unplanned call, into fresh NaN-poisoned buffers; one plan is kept, and a
    call with another layout (strided k) makes a second one."""
    from mla_attn.ops import _launch
    from mla_attn.ops.attention import triton_bwd

    b, hq, hkv, m, n, d, causal = 1, 4, 2, 37, 50, 16, True
    scale = d ** -0.5

    def inputs():
        q, k, v, do = (torch.randn(b, h, length, d) for h, length in ((hq, m), (hkv, n), (hkv, n), (hq, m)))
        o, lse = flash_attn_fwd(q, k, v, causal, scale)
        dlse = torch.randn(1, 1, 1).expand(b, hq, m) if with_dlse else None
        return do, q, k, v, o, lse, dlse

    calls = [inputs() for _ in range(3)]
    monkeypatch.setattr(_launch, "FAST", False)
    expect = [flash_attn_bwd(*c[:6], causal, scale, dlse=c[6]) for c in calls]
    assert not triton_bwd._plans
    monkeypatch.setattr(_launch, "FAST", True)
    got = [flash_attn_bwd(*c[:6], causal, scale, dlse=c[6]) for c in calls]
    assert len(triton_bwd._plans) == 1
    for e, g in zip(expect, got):
        for a, b_ in zip(e, g):
            assert not torch.isnan(b_).any() and torch.equal(a, b_)
    assert len({g[0].data_ptr() for g in got}) == 3  # fresh outputs each call
    do, q, k, v, o, lse, dlse = calls[0]
    strided_k = _strided(k)
    out = flash_attn_bwd(do, q, strided_k, v, o, lse, causal, scale, dlse=dlse)
    assert len(triton_bwd._plans) == 2
    monkeypatch.setattr(_launch, "FAST", False)
    ref = flash_attn_bwd(do, q, strided_k, v, o, lse, causal, scale, dlse=dlse)
    assert all(torch.equal(a, b_) for a, b_ in zip(out, ref))


def test_backward_plan_keeps_no_tensor_alive():
    import gc
    import weakref

    from mla_attn.ops.attention import triton_bwd

    def run():
        q, k, v, do = (torch.randn(1, 2, 20, 16) for _ in range(4))
        o, lse = flash_attn_fwd(q, k, v, False, 0.25)
        for _ in range(2):
            flash_attn_bwd(do, q, k, v, o, lse, False, 0.25)
        assert len(triton_bwd._plans) == 1
        return [weakref.ref(t) for t in (q, k, v, do, o, lse)]

    refs = run()
    gc.collect()
    assert all(r() is None for r in refs), "a backward plan kept a tensor alive"


def test_forward_plan_replays_new_inputs(poison, monkeypatch):
    """flash_attn_fwd's cached plan (triton_fwd._FwdPlan): new inputs of the same layout give bit for bit the
    unplanned outputs, into fresh NaN-poisoned buffers; a strided k is another key; no tensor is kept alive."""
    import gc
    import weakref

    from mla_attn.ops import _launch

    calls = [[torch.randn(1, h, length, 16) for h, length in ((6, 33), (2, 45), (2, 45))] for _ in range(3)]
    monkeypatch.setattr(_launch, "FAST", False)
    expect = [flash_attn_fwd(*c, True, 0.3) for c in calls]
    assert not triton_fwd._plans
    monkeypatch.setattr(_launch, "FAST", True)
    got = [flash_attn_fwd(*c, True, 0.3) for c in calls]
    assert len(triton_fwd._plans) == 1
    for e, g in zip(expect, got):
        for a, b_ in zip(e, g):
            assert not torch.isnan(b_).any() and torch.equal(a, b_)
    assert len({g[0].data_ptr() for g in got}) == 3
    q, k, v = calls[0]
    out = flash_attn_fwd(q, _strided(k), v, True, 0.3)
    assert len(triton_fwd._plans) == 2 and all(torch.equal(a, b_) for a, b_ in zip(out, expect[0]))
    refs = [weakref.ref(t) for c in calls for t in c]
    del calls, q, k, v, expect, got, out
    gc.collect()
    assert all(r() is None for r in refs), "a forward plan kept a tensor alive"

"""Review of the functional ops (interpreter): edge cases each of which failed before its fix.

Every comparison is against the float64 oracle in mla_attn.testing, fp32 inputs, so the floors of
``dtype_floor(torch.float32)`` apply (2e-5 relative; gradients 5x that, as in test_attention_triton.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mla_attn
from mla_attn.ops.attention import function as attn_function
from mla_attn.ops.decode import combine as combine_mod
from mla_attn.ops.decode import triton_decode as td
from mla_attn.testing import (assert_close, assert_lse_close, attention_oracle, decode_oracle, dtype_floor,
                              merge_oracle, mla_decode_oracle)

F32 = torch.float32
FLOOR = dtype_floor(F32)
IMPLS = ["reference", "triton"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _nan_outputs(nan_decode_outputs):
    """Decode launcher buffers start as NaN (tests/ops/conftest.py)."""


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_decode_reads_a_strided_seq_lens_view(impl, dtype):
    # seq_lens = column 0 of a [B, 2] table (stride 2). The kernel read SEQ_LENS + b, i.e. the raw
    # storage [7, 0, 3, 0, 5, 0] -> lengths 7, 0, 3 instead of 7, 3, 5.
    table = torch.tensor([[7, 0], [3, 0], [5, 0]], dtype=dtype)
    seq_lens = table[:, 0]
    assert seq_lens.stride() == (2,)
    q = torch.randn(3, 6, 2, 16)
    k, v = torch.randn(3, 2, 7, 16), torch.randn(3, 2, 7, 8)
    o, lse = mla_attn.decode_attention(q, k, v, seq_lens, num_splits=2, return_lse=True, impl=impl)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens)
    assert_close(o, ref_o, floor=FLOOR)
    assert_lse_close(lse, ref_lse, atol=1e-5)

    ql, qr = torch.randn(3, 4, 32), torch.randn(3, 4, 8)
    buf = torch.randn(3, 7, 40)
    o, lse = mla_attn.mla_decode(ql, qr, buf[..., :32], buf[..., 32:], seq_lens, scale=0.2, return_lse=True,
                                 impl=impl)
    ref_o, ref_lse = mla_decode_oracle(ql, qr, buf[..., :32], buf[..., 32:], seq_lens, scale=0.2)
    assert_close(o, ref_o, floor=FLOOR)
    assert_lse_close(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_mla_decode_with_zero_width_rope_tensors(impl):
    # Dr = 0 passed as [B, H, 0] / [B, N, 0] tensors rather than None: the kernel used to take them as
    # a rope block of width 1 and read column 0 of an empty tensor (a segfault under the interpreter,
    # an out-of-bounds read on CUDA).
    ql, c = torch.randn(2, 4, 32), torch.randn(2, 10, 32)
    qr, kr = torch.randn(2, 4, 0), torch.randn(2, 10, 0)
    seq_lens = torch.tensor([5, 10], dtype=torch.int32)
    o, lse = mla_attn.mla_decode(ql, qr, c, kr, seq_lens, scale=0.2, return_lse=True, impl=impl)
    ref_o, ref_lse = mla_decode_oracle(ql, None, c, None, seq_lens, scale=0.2)
    assert_close(o, ref_o, floor=FLOOR)
    assert_lse_close(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_of_no_parts_is_empty(impl):
    # K = 0 parts: the same as every part being -inf (o = 0, lse = -inf); the reference raised in amax.
    o_parts, lse_parts = torch.randn(0, 3, 5, 8), torch.randn(0, 3, 5)
    o, lse = mla_attn.merge_attention_states(o_parts, lse_parts, impl=impl)
    ref_o, ref_lse = merge_oracle(o_parts, lse_parts)
    assert o.shape == (3, 5, 8) and o.dtype == F32 and lse.shape == (3, 5) and lse.dtype == F32
    assert torch.equal(o.double(), ref_o) and torch.equal(lse.double(), ref_lse)
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("scale", [0.0, -0.25])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_scale_not_positive(scale, causal):
    # The Triton kernels mask with -inf before scaling (scale 0: -inf * 0 = NaN) and take the row max
    # before scaling (wrong for scale < 0). impl="triton" must refuse; "auto" and "reference" must be right.
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    with pytest.raises(ValueError, match="scale > 0"):
        mla_attn.attention(q, k, v, causal=causal, scale=scale, impl="triton")
    ref_o, ref_lse = attention_oracle(q, k, v, causal=causal, scale=scale)
    for impl in ("auto", "reference"):
        o, lse = mla_attn.attention(q, k, v, causal=causal, scale=scale, return_lse=True, impl=impl)
        assert_close(o, ref_o, floor=FLOOR)
        assert_lse_close(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_zero_head_dim_is_a_value_error(impl):
    # Dqk = 0 used to die in ``0 ** -0.5`` (ZeroDivisionError) or, with a scale, in the tile split
    # ("negative shift count") on the Triton path.
    q, k, v = torch.randn(1, 2, 3, 0), torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 8)
    for scale in (None, 1.0):
        with pytest.raises(ValueError, match="head dim"):
            mla_attn.attention(q, k, v, scale=scale, impl=impl)


def test_auto_never_runs_triton_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("impl='auto' ran a Triton launcher on CPU tensors")

    monkeypatch.setattr(attn_function, "flash_attention", boom)
    monkeypatch.setattr(td, "gqa_decode", boom)
    monkeypatch.setattr(td, "mla_decode", boom)
    monkeypatch.setattr(combine_mod, "merge_attention_states_triton", boom)
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    sl = torch.tensor([5], dtype=torch.int32)
    mla_attn.attention(q, k, v, causal=True)
    mla_attn.decode_attention(q, k, v, sl)
    mla_attn.mla_decode(q[:, :, 0], None, k[:, 0], None, sl, scale=0.25)
    mla_attn.merge_attention_states(torch.randn(2, 3, 8), torch.randn(2, 3))


# The flash attention kernels formed row offsets as int32 (offs_m * stride_qm, start_n * stride_kn):
# with the layers' [B, T, H, D].transpose(1, 2) views, stride_qm = H * D, so a long prefill (MLA expanded:
# 128 heads * 192 -> 87K tokens) wrapped past 2^31 elements and read far outside q / k. The check
# below puts rows 2^25 elements apart in one 4 GiB (virtual, mostly untouched) buffer, so rows >= 64
# sit past 2^31; it runs in a subprocess because the bug is a segfault.
_BIG_STRIDE_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from mla_attn.ops.attention.function import flash_attention
    from mla_attn.testing import assert_close, assert_lse_close, attention_oracle, dtype_floor

    torch.manual_seed(0)
    L, D, ROW = 70, 16, 2 ** 25  # ROW * 64 = 2^31; tile offsets (32 rows * ROW) stay below it
    buf = torch.empty(ROW * (L - 1) + 4 * D, dtype=torch.float32)

    def strided(i):  # [1, 1, L, D], row stride ROW, at column block i of the shared buffer
        t = buf.as_strided((1, 1, L, D), (0, 0, ROW, 1), i * D)
        t.copy_(torch.randn(1, 1, L, D))
        return t

    q, k, v, do = (strided(i) for i in range(4))
    for causal in (False, True):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse = flash_attention(*leaves, causal, 0.25)
        o.backward(do)
        ref = [t.detach().clone().double().requires_grad_() for t in (q, k, v)]
        o_ref, lse_ref = attention_oracle(*ref, causal=causal, scale=0.25)
        o_ref.backward(do.double())
        floor = dtype_floor(torch.float32)
        assert_close(o, o_ref, floor=floor, name="o")
        assert_lse_close(lse, lse_ref, atol=1e-5)
        for name, a, b in zip(("dq", "dk", "dv"), leaves, ref):
            assert_close(a.grad, b.grad, floor=5 * floor, name=name)
    print("ok")
""")


def test_attention_row_offsets_past_2_to_31():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _BIG_STRIDE_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit code {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}")


# ----------------------------------------------------------------------------------------------
# Coverage of the review's shape list (these passed at review time; they guard the cases above).

def _decode_inputs(b, hq, hkv, d, dv, s, lens, page, extra_cols, dtype=F32):
    from mla_attn.testing import SENTINEL_PAGE, to_paged

    n = max(max(lens), 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(b, s, hq, d).to(dtype).transpose(1, 2)  # a transposed view
    k_tok, v_tok = torch.randn(b, n, hkv, d).to(dtype), torch.randn(b, n, hkv, dv).to(dtype)
    if page is None:
        return q, k_tok.transpose(1, 2), v_tok.transpose(1, 2), seq_lens, None
    k, table = to_paged(k_tok, seq_lens, page, generator=torch.Generator().manual_seed(1))
    v, table_v = to_paged(v_tok, seq_lens, page, generator=torch.Generator().manual_seed(1))
    assert torch.equal(table, table_v)
    wide = torch.full((b, extra_cols), SENTINEL_PAGE, dtype=torch.int32)  # a table wider than needed
    return q, k, v, seq_lens, torch.cat([table, wide], 1)


# (B, Hq, Hkv, D, Dv, S, lens, page, extra table columns, num_splits)
DECODE_CASES = [
    (3, 12, 4, 8, 24, 1, [0, 5, 40], 3, 2, None),      # page 3, empty row
    (3, 10, 5, 24, 40, 3, [1, 2, 40], 5, 0, 4),        # S > seq_len: token 0 of row 0 sees nothing
    (2, 12, 4, 1, 1, 2, [33, 7], 24, 1, 7),            # head dim 1, page 24
    (2, 4, 2, 100, 40, 1, [96, 96], 96, 3, 20),        # seq_len == capacity, more splits than tiles
]


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}x{c[4]}-S{c[5]}-P{c[7]}")
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_odd_shapes(case, impl):
    b, hq, hkv, d, dv, s, lens, page, extra, splits = case
    q, k, v, seq_lens, table = _decode_inputs(b, hq, hkv, d, dv, s, lens, page, extra)
    o, lse = mla_attn.decode_attention(q, k, v, seq_lens, block_table=table, num_splits=splits, return_lse=True,
                                       impl=impl)
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table)
    assert o.dtype == F32 and o.shape == (b, hq, s, dv) and lse.shape == (b, hq, s)
    assert_close(o, ref_o, floor=FLOOR)
    assert_lse_close(lse, ref_lse, atol=1e-5)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(o[dead], torch.zeros_like(o[dead]))


# (Hq, Hkv, M, N, Dqk, Dv, causal): GQA 12/4 and 10/5, head dims 1, 24, 40, 100, M > N with dead rows
ATTN_CASES = [(12, 4, 9, 5, 1, 1, True), (10, 5, 9, 5, 24, 40, True), (4, 2, 3, 37, 100, 8, False)]


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"Hq{c[0]}-Hkv{c[1]}-M{c[2]}-N{c[3]}-D{c[4]}x{c[5]}")
def test_attention_triton_odd_shapes_with_views(case):
    # q a transposed [B, M, H, D] view, k/v expanded over the batch (stride 0): gradients flow back
    # to the un-expanded leaves; rows that see no key give o = 0, lse = -inf and zero dq.
    hq, hkv, m, n, dqk, dv, causal = case
    q0, k0, v0 = torch.randn(2, m, hq, dqk), torch.randn(1, hkv, n, dqk), torch.randn(1, hkv, n, dv)
    do = torch.randn(2, hq, m, dv)
    leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    o, lse = mla_attn.attention(leaves[0].transpose(1, 2), leaves[1].expand(2, -1, -1, -1),
                                leaves[2].expand(2, -1, -1, -1), causal=causal, return_lse=True, impl="triton")
    o.backward(do)
    ref = [t.double().requires_grad_() for t in (q0, k0, v0)]
    o_ref, lse_ref = attention_oracle(ref[0].transpose(1, 2), ref[1].expand(2, -1, -1, -1),
                                      ref[2].expand(2, -1, -1, -1), causal=causal)
    o_ref.backward(do.double())
    assert o.dtype == F32 and lse.dtype == F32 and lse.shape == (2, hq, m)
    assert_close(o, o_ref, floor=FLOOR, name="o")
    assert_lse_close(lse, lse_ref, atol=1e-5)
    for name, a, r in zip(("dq", "dk", "dv"), leaves, ref):
        assert a.grad.shape == r.grad.shape and torch.isfinite(a.grad).all()
        assert_close(a.grad, r.grad, floor=5 * FLOOR, name=name)
    dead = torch.isneginf(lse_ref)
    if dead.any():
        assert torch.equal(leaves[0].grad.transpose(1, 2)[dead], torch.zeros_like(leaves[0].grad.transpose(1, 2)[dead]))

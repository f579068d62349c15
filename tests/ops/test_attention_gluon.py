"""The experimental Gluon flash forward (mla_attn/ops/attention/gluon_fwd.py) against the float64 oracle.

GPU-only (Hopper, a Triton with Gluon): run through scripts/gpu_check.sh. Tolerances as for the Triton
kernel: within 2x of PyTorch's own same-dtype attention's error, LSE within LSE_ATOL. Nothing routes
to this kernel until these pass on the H200.
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.testing import assert_close, assert_lse_close, attention_oracle, dtype_floor
from test_attention_triton import LSE_ATOL, _torch_same_dtype

gluon_fwd = pytest.importorskip("mla_attn.ops.attention.gluon_fwd")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

# (B, Hq, Hkv, M, N, D_qk, D_v, causal): ragged lengths (M, N not multiples of the tiles), M > N
# (rows that see no key), cached prefix (M < N), GQA and MQA, the head widths the kernel takes.
CASES = [
    (1, 4, 4, 1023, 1024, 128, 128, True),
    (1, 4, 2, 1023, 1024, 128, 128, False),
    (2, 8, 2, 2048, 2048, 128, 128, True),
    (1, 3, 1, 113, 203, 64, 64, True),
    (1, 2, 2, 130, 65, 64, 64, True),
    (1, 2, 2, 1, 1, 64, 64, True),
    (1, 2, 2, 257, 300, 256, 256, False),
    (1, 3, 3, 4224, 4224, 128, 128, True),
    (1, 2, 2, 300, 333, 192, 128, True),   # MLA expanded: Dqk split 128 + 64
    (1, 4, 1, 257, 511, 192, 128, False),
    (2, 8, 8, 1024, 1024, 192, 128, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, overlap", [(c, o) for c in CASES for o in (True, False) if not (o and c[6] > 128)],
                         ids=lambda x: ("overlap" if x else "plain") if isinstance(x, bool) else
                         "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_matches_oracle(case, overlap):
    """bf16, both schedules (the overlapped one exists for Dv <= 128 only: registers)."""
    _check(*case, torch.bfloat16, overlap)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[8]], ids=lambda c: f"M{c[3]}-N{c[4]}-D{c[5]}x{c[6]}")
def test_gluon_forward_fp16(case):
    _check(*case, torch.float16, True)


def _check(b, hq, hkv, m, n, dqk, dv, causal, dtype, overlap):
    scale = dqk ** -0.5
    q = torch.randn(b, hq, m, dqk, device="cuda").to(dtype)
    k = torch.randn(b, hkv, n, dqk, device="cuda").to(dtype)
    v = torch.randn(b, hkv, n, dv, device="cuda").to(dtype)
    o, lse = gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=scale, pv_overlap=overlap)
    o_ref, lse_ref = attention_oracle(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    base = _torch_same_dtype(q, k, v, causal, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, floor=dtype_floor(dtype), baseline=base, name="o")
    assert_lse_close(lse, lse_ref, atol=LSE_ATOL[dtype])
    dead = torch.isneginf(lse_ref)
    if dead.any():  # rows that see no key: exact zeros
        assert torch.equal(o[dead].float(), torch.zeros_like(o[dead].float()))

"""The experimental warp-specialised Gluon forward (mla_attn/ops/attention/gluon_fwd_ws.py) against the
float64 oracle. GPU-only (Hopper, a Triton whose Gluon has warp_specialize). scripts/gpu_check.sh runs
this file in a step of its own with a short time limit: a wrong mbarrier phase hangs, it does not fail.
Tolerances as for the other flash kernels (within 2x of PyTorch's own same-dtype error).
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.testing import assert_close, assert_lse_close, attention_oracle, dtype_floor
from test_attention_triton import LSE_ATOL, _torch_same_dtype

ws = pytest.importorskip("mla_attn.ops.attention.gluon_fwd_ws")

from mla_attn.testing import gluon_gpu  # noqa: E402

HOPPER = gluon_gpu()

# Ragged lengths, M > N (rows that see no key), a cached prefix (M < N), GQA and MQA, a block whose first
# consumer sees fewer key tiles than its second (causal), one row, d 64 and 128.
CASES = [
    (1, 2, 2, 1, 1, 128, True),
    (1, 4, 4, 1023, 1024, 128, True),
    (2, 8, 2, 600, 600, 128, False),
    (1, 3, 1, 113, 203, 64, True),
    (1, 2, 2, 130, 65, 64, True),
    (2, 4, 4, 2048, 2048, 128, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and ws.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_ws_forward_matches_oracle(case, dtype):
    b, hq, hkv, m, n, d, causal = case
    scale = d ** -0.5
    q = torch.randn(b, hq, m, d, device="cuda").to(dtype)
    k = torch.randn(b, hkv, n, d, device="cuda").to(dtype)
    v = torch.randn(b, hkv, n, d, device="cuda").to(dtype)
    o, lse = ws.flash_fwd_ws(q, k, v, causal=causal, scale=scale)
    o_ref, lse_ref = attention_oracle(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    assert_close(o, o_ref, floor=dtype_floor(dtype), baseline=_torch_same_dtype(q, k, v, causal, scale), name="o")
    assert_lse_close(lse, lse_ref, atol=LSE_ATOL[dtype])
    dead = torch.isneginf(lse_ref)
    if dead.any():
        assert torch.equal(o[dead].float(), torch.zeros_like(o[dead].float()))

"""The one-pass Gluon backward (mla_attn/ops/attention/gluon_bwd_fused.py) against the float64 oracle.

GPU-only (Hopper, a Triton with Gluon): run through scripts/gpu_check.sh (ONLY=fusedbwd). Tolerances as
for the Triton kernels (test_attention_triton._check): each gradient within 2x of PyTorch's own
same-dtype attention's error. The pass orders its dQ additions; the tests here check that two runs
agree bit for bit, that every gradient element is written (NaN-poisoned outputs), and that more
programs than the GPU holds at once (where a wrong launch order would deadlock) finish.
"""

from __future__ import annotations

import pytest
import torch

from test_attention_triton import _check as _check_fwd_bwd

fused = pytest.importorskip("mla_attn.ops.attention.gluon_bwd_fused")

from mla_attn.testing import gluon_gpu  # noqa: E402

HOPPER = gluon_gpu()
needs_hopper = pytest.mark.skipif(not (HOPPER and fused.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")

# (B, Hq, Hkv, M, N, D_qk, D_v, causal)
CASES = [
    (1, 4, 1, 130, 65, 128, 128, True),      # M > N: the first 65 rows see no key (dq 0, no contributor)
    (1, 3, 3, 1, 1, 128, 64, False),          # one row, one key
    (1, 2, 2, 333, 257, 128, 64, False),      # ragged, Dv < Dqk
    (1, 8, 2, 600, 600, 128, 128, True),      # GQA 4, a partial last key block
    (2, 8, 2, 512, 512, 128, 128, True),      # whole key blocks only
    (1, 4, 4, 1023, 1024, 128, 128, True),    # cached prefix of 1, ragged last row tile
    (2, 6, 3, 63, 113, 128, 64, True),        # M < N, odd sizes, Dv 64
    (1, 9, 3, 200, 200, 128, 128, False),     # non-power-of-two heads
    (1, 8, 1, 257, 640, 128, 128, True),      # MQA
    (2, 32, 8, 2048, 2048, 128, 128, True),   # 256 programs: more than the H200 holds at once
    (2, 16, 16, 1024, 2048, 128, 128, False),  # 512 programs, every key block adds to every row tile
]
IDS = ["B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*c[:7], "causal" if c[7] else "full") for c in CASES]


@pytest.mark.parametrize("causal, m, n", [(True, 130, 65), (True, 63, 113), (False, 1, 1)])
def test_dq_cast_matches_workspace(causal, m, n):
    """The cast pass of FUSED_CAST (plain Triton; the interpreter on a CPU): dq = scale * workspace for rows < M;
    rows that see no key are 0 even where the workspace holds NaN (a row tile nobody wrote)."""
    b, h, d, block_m = 2, 3, 64, 64
    rows = (m + block_m - 1) // block_m * block_m
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    acc = torch.randn(b * h * rows, d, device=dev)
    view = acc.view(b, h, rows, d)
    if causal and m > n:
        view[:, :, :m - n] = float("nan")  # rows that see no key: never written by the kernel
    view[:, :, m:] = float("nan")  # the last tile's rows past M
    dq = torch.full((b, h, m, d), float("nan"), device=dev, dtype=torch.float16)
    fused.dq_cast(acc, dq, rows, causal, n - m, 0.125)
    want = view[:, :, :m] * 0.125
    if causal and m > n:
        want[:, :, :m - n] = 0
    assert torch.equal(dq, want.to(torch.float16))


def _route(monkeypatch, calls, bulk="0"):
    from mla_attn.ops.attention import triton_bwd

    monkeypatch.setattr(triton_bwd, "GLUON_DKDV", True)
    monkeypatch.setattr(fused, "FUSED_BWD", "1")
    monkeypatch.setattr(fused, "FUSED_BULK", bulk)
    real = fused.bwd_fused_gluon
    monkeypatch.setattr(fused, "bwd_fused_gluon", lambda *a, **kw: calls.append(kw.get("token_major")) or real(*a, **kw))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_backward_matches_oracle(case, monkeypatch):
    calls = []
    _route(monkeypatch, calls)
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert calls, "the fused backward did not run"


BULK_CASES = [0, 2, 3, 5, 6, 7, 9, 10]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("cast", ["0", "1"], ids=["last-adds", "cast-pass"])
@pytest.mark.parametrize("case", [CASES[i] for i in BULK_CASES], ids=[IDS[i] for i in BULK_CASES])
def test_fused_backward_bulk_matches_oracle(case, cast, monkeypatch):
    """dQ_j out by TMA store / reduce-add (FUSED_BULK), each counter released a step later; dq written by key
    block 0 or by the cast pass (FUSED_CAST)."""
    calls = []
    _route(monkeypatch, calls, bulk="1")
    monkeypatch.setattr(fused, "FUSED_CAST", cast)
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert calls, "the fused backward did not run"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=[IDS[0], IDS[3], IDS[6]])
def test_fused_backward_fp16(case, monkeypatch):
    calls = []
    _route(monkeypatch, calls)
    _check_fwd_bwd(*case, torch.float16, device="cuda", strided=False)
    assert calls, "the fused backward did not run"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("bulk", ["0", "1"], ids=["atomic", "bulk"])
@pytest.mark.parametrize("case, token_major", [(CASES[0], False), (CASES[3], True), (CASES[9], False),
                                               (CASES[10], True)],
                         ids=[IDS[0], IDS[3] + "-token-major", IDS[9], IDS[10] + "-token-major"])
def test_fused_backward_is_deterministic_and_writes_everything(case, token_major, bulk, monkeypatch):
    """Two backward passes into NaN-poisoned gradient buffers: no NaN left, bit for bit the same."""
    from mla_attn.ops.attention import triton_fwd
    from mla_attn.ops.attention.function import flash_attention

    b, hq, hkv, m, n, dqk, dv, causal = case
    calls = []
    _route(monkeypatch, calls, bulk)
    monkeypatch.setattr(triton_fwd, "_alloc", lambda shape, device, dtype: torch.full(shape, float("nan"),
                                                                                     device=device, dtype=dtype))
    gen = torch.Generator().manual_seed(7)
    dims = ((hq, m, dqk), (hkv, n, dqk), (hkv, n, dv))
    if token_major:
        base = [torch.randn(b, L, h, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2) for h, L, d in dims]
    else:
        base = [torch.randn(b, h, L, d, generator=gen).to("cuda", torch.bfloat16) for h, L, d in dims]
    do = torch.randn(b, hq, m, dv, generator=gen).to("cuda", torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in base]
        o, _ = flash_attention(*leaves, causal, dqk ** -0.5)
        o.backward(do)
        grads.append([t.grad for t in leaves])
    assert len(calls) == 2 and all(c == token_major for c in calls), calls
    for name, a, b_ in zip(("dq", "dk", "dv"), *grads):
        assert not torch.isnan(a).any(), f"{name}: elements left unwritten"
        assert torch.equal(a, b_), f"{name}: two runs differ"


@pytest.mark.gpu
@needs_hopper
def test_fused_backward_supported_shapes():
    """Dqk 128 only (the dQ product splits Dqk between the warpgroups); 64 and 192/128 stay two-pass."""
    mk = (lambda *s: torch.empty(*s, device="cuda", dtype=torch.bfloat16))
    assert fused.supported(mk(1, 2, 8, 128), mk(1, 2, 8, 128), mk(1, 2, 8, 128))
    assert not fused.supported(mk(1, 2, 8, 192), mk(1, 2, 8, 192), mk(1, 2, 8, 128))
    assert not fused.supported(mk(1, 2, 8, 64), mk(1, 2, 8, 64), mk(1, 2, 8, 64))
    assert not fused.supported(mk(1, 2, 8, 128).float(), mk(1, 2, 8, 128).float(), mk(1, 2, 8, 128).float())

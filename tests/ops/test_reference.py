"""Reference ops (impl="reference") against the float64 oracle on fresh random inputs."""

import pytest
import torch

from mla_attn import attention, decode_attention, merge_attention_states, mla_decode
from mla_attn.testing import (assert_close, assert_lse_close, attention_oracle, decode_oracle, dtype_floor,
                              merge_oracle, mla_decode_oracle, poison_tail, to_paged)

HEADS = [(8, 8), (8, 2), (9, 3), (6, 1)]
# Reference ops compute in fp32; vs the float64 oracle their error is fp32 rounding, far under 1e-5.
FP32_TOL = 1e-5


@pytest.mark.parametrize("hq,hkv", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("m,n,causal", [(1, 1, True), (63, 63, True), (113, 63, True), (5, 0, False),
                                        (0, 7, True), (7, 113, True), (17, 40, False)],
                         ids=lambda x: str(x))
def test_attention_reference(hq, hkv, m, n, causal):
    q = torch.randn(2, hq, m, 48)
    k = torch.randn(2, hkv, n, 48)
    v = torch.randn(2, hkv, n, 32)  # Dqk != Dv
    o, lse = attention(q, k, v, causal=causal, return_lse=True, impl="reference")
    o_ref, lse_ref = attention_oracle(q, k, v, causal=causal)
    assert o.shape == (2, hq, m, 32) and lse.dtype == torch.float32
    assert_close(o, o_ref, floor=FP32_TOL)
    assert_lse_close(lse, lse_ref, atol=1e-4)
    if causal and m > n:  # rows that see no key are exactly zero
        assert torch.equal(o[:, :, : m - n], torch.zeros_like(o[:, :, : m - n]))


def test_attention_reference_grad_matches_oracle_and_has_no_nan():
    q = torch.randn(1, 4, 9, 16, requires_grad=True)
    k = torch.randn(1, 2, 5, 16, requires_grad=True)
    v = torch.randn(1, 2, 5, 8, requires_grad=True)
    do = torch.randn(1, 4, 9, 8)
    (attention(q * 5, k * 3, v, causal=True, impl="reference") * do).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    (attention_oracle(q64 * 5, k64 * 3, v64, causal=True)[0] * do.double()).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert_close(got, want, floor=1e-4)


# impl="auto" off CUDA without return_lse: PyTorch's SDPA (attention_sdpa), the readable path where SDPA could
# differ (no keys, no queries, causal M > N). The spy records which ran; the results are held to the oracle
# with the readable path's tolerance.
@pytest.mark.parametrize("hq,hkv", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("m,n,causal,via", [(1, 1, True, "sdpa"), (63, 63, True, "sdpa"), (7, 113, True, "sdpa"),
                                            (17, 40, False, "sdpa"), (113, 63, True, "reference"),
                                            (113, 63, False, "sdpa"), (5, 0, False, "reference"),
                                            (0, 7, True, "reference")], ids=lambda x: str(x))
def test_attention_auto_off_cuda(hq, hkv, m, n, causal, via, monkeypatch):
    from mla_attn.ops.attention import api, reference

    ran = []
    real = reference.attention_sdpa
    monkeypatch.setattr(api, "attention_sdpa", lambda *a, **kw: ran.append(real(*a, **kw)) or ran[-1])
    q = torch.randn(2, hq, m, 48)
    k = torch.randn(2, hkv, n, 48)
    v = torch.randn(2, hkv, n, 32)
    o = attention(q, k, v, causal=causal)
    assert (ran[-1] is not None) == (via == "sdpa")
    o_ref, _ = attention_oracle(q, k, v, causal=causal)
    assert o.shape == (2, hq, m, 32) and o.dtype == q.dtype
    assert_close(o, o_ref, floor=FP32_TOL)
    if causal and m > n:
        assert torch.equal(o[:, :, : m - n], torch.zeros_like(o[:, :, : m - n]))
    ran.clear()
    attention(q, k, v, causal=causal, return_lse=True)  # lse asked for: the readable path, never SDPA
    assert ran == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_attention_auto_off_cuda_grads_and_low_precision(dtype):
    # Gradients through SDPA against the float64 oracle (scaled-up q, k as in the reference's grad test), and
    # bf16 / fp16 outputs within twice the readable path's own error against the fp32 oracle.
    q = torch.randn(2, 6, 40, 32, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 57, 32, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 57, 24, dtype=dtype, requires_grad=True)
    do = torch.randn(2, 6, 40, 24, dtype=dtype)
    o = attention(q * 5, k * 3, v, causal=True)
    (o * do).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, _ = attention_oracle(q64 * 5, k64 * 3, v64, causal=True)
    (o64 * do.double()).sum().backward()
    if dtype == torch.float32:
        assert_close(o, o64, floor=FP32_TOL)
        for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
            assert_close(got, want, floor=1e-4)
    else:
        readable = attention(q * 5, k * 3, v, causal=True, impl="reference")
        err, base = (o.double() - o64).abs().max(), (readable.double() - o64).abs().max()
        assert err <= 2 * base + 1e-6, (err, base)
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def _decode_case(b, hq, hkv, lens, s, d, dv, dtype=torch.float32, n=None):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    n = n or max(max(lens), 1) + 5
    q = torch.randn(b, hq, s, d, dtype=dtype) if s else torch.randn(b, hq, d, dtype=dtype)
    k = torch.randn(b, hkv, n, d, dtype=dtype)
    v = torch.randn(b, hkv, n, dv, dtype=dtype)
    return q, poison_tail(k, seq_lens, dim=2), poison_tail(v, seq_lens, dim=2), seq_lens


@pytest.mark.parametrize("hq,hkv", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("s", [0, 1, 2], ids=lambda s: f"S{s}")  # 0 = the 3-D q form
def test_decode_reference_contiguous(hq, hkv, s):
    q, k, v, seq_lens = _decode_case(4, hq, hkv, [0, 1, 63, 113], s, 40, 24)
    o, lse = decode_attention(q, k, v, seq_lens, return_lse=True, impl="reference")
    o_ref, lse_ref = decode_oracle(q, k, v, seq_lens)
    assert_close(o, o_ref, floor=FP32_TOL)
    assert_lse_close(lse, lse_ref, atol=1e-4)
    assert torch.equal(o[0], torch.zeros_like(o[0]))  # seq_len 0: output exactly 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (9, 3)], ids=lambda x: str(x))
def test_decode_reference_paged(page_size, hq, hkv):
    q, k, v, seq_lens = _decode_case(3, hq, hkv, [17, 0, 64], 2, 32, 32, n=70)
    # K and V share one block table: page them together, then split into two strided views
    pool, table = to_paged(torch.cat([k, v], dim=-1).transpose(1, 2), seq_lens, page_size)
    kp, vp = pool[..., :32], pool[..., 32:]
    o, lse = decode_attention(q, kp, vp, seq_lens, block_table=table, return_lse=True, impl="reference")
    o_ref, lse_ref = decode_oracle(q, kp, vp, seq_lens, block_table=table)
    o_contig = decode_oracle(q, k, v, seq_lens)[0]
    assert_close(o_ref, o_contig, floor=1e-12, name="oracle paged vs contiguous")
    assert_close(o, o_ref, floor=FP32_TOL)
    assert_lse_close(lse, lse_ref, atol=1e-4)


@pytest.mark.parametrize("dr", [16, 0])
@pytest.mark.parametrize("page_size", [None, 1, 4, 16])
def test_mla_decode_reference(dr, page_size):
    b, h, s, dc = 3, 9, 2, 64
    seq_lens = torch.tensor([0, 1, 113], dtype=torch.int32)
    buf = poison_tail(torch.randn(b, 120, dc + dr), seq_lens)
    q_lat = torch.randn(b, h, s, dc) * 100  # large-magnitude queries
    q_rope = torch.randn(b, h, s, dr) if dr else None
    table = None
    if page_size:
        buf, table = to_paged(buf, seq_lens, page_size)
    kv_latent, k_rope = buf[..., :dc], (buf[..., dc:] if dr else None)  # two views into one buffer
    scale = 0.1
    o, lse = mla_decode(q_lat, q_rope, kv_latent, k_rope, seq_lens, scale=scale, block_table=table,
                        return_lse=True, impl="reference")
    o_ref, lse_ref = mla_decode_oracle(q_lat, q_rope, kv_latent, k_rope, seq_lens, scale=scale, block_table=table)
    assert o.shape == (b, h, s, dc)
    assert_close(o, o_ref, floor=FP32_TOL)
    assert_lse_close(lse, lse_ref, atol=1e-3)  # |scores| ~ 1e3 here: fp32 rounding of lse is ~1e-4


def test_mla_decode_equals_gqa_decode_with_concatenated_keys():
    b, h, dc, dr = 2, 4, 32, 8
    seq_lens = torch.tensor([5, 9], dtype=torch.int32)
    c, kr = torch.randn(b, 9, dc), torch.randn(b, 9, dr)
    ql, qr = torch.randn(b, h, dc), torch.randn(b, h, dr)
    o = mla_decode(ql, qr, c, kr, seq_lens, scale=0.2, impl="reference")
    k = torch.cat([c, kr], -1).unsqueeze(1)
    o2 = decode_attention(torch.cat([ql, qr], -1), k, c.unsqueeze(1), seq_lens, scale=0.2, impl="reference")
    torch.testing.assert_close(o, o2, rtol=1e-5, atol=1e-6)


def test_merge_reference():
    k_parts, rows, dv = 4, 10, 24
    o_parts = torch.randn(k_parts, 2, rows, dv)
    lse_parts = torch.randn(k_parts, 2, rows) * 3
    lse_parts[1, 0] = float("-inf")  # a dead part
    o_parts[1, 0] = float("nan")  # whose output is garbage: it must not leak
    lse_parts[:, 1, 3] = float("-inf")  # a row where every part is dead
    o, lse = merge_attention_states(o_parts, lse_parts, impl="reference")
    o_ref, lse_ref = merge_oracle(o_parts, lse_parts)
    assert torch.equal(o[1, 3], torch.zeros(dv)) and torch.isneginf(lse[1, 3])
    assert_close(o, o_ref, floor=FP32_TOL)
    assert_lse_close(lse, lse_ref, atol=1e-5)


def test_split_then_merge_equals_whole():
    """Attention over disjoint key intervals, merged, equals attention over all keys."""
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 50, 16), torch.randn(1, 4, 50, 16)
    parts = [attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True, impl="reference")
             for a, b in ((0, 20), (20, 20), (20, 50))]  # the middle interval is empty
    o, lse = merge_attention_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                                    impl="reference")
    o_ref, lse_ref = attention_oracle(q, k, v)
    assert_close(o, o_ref, floor=FP32_TOL)
    assert_lse_close(lse, lse_ref, atol=1e-5)


def test_fp16_reference_within_twice_pytorch_error():
    q, k, v = (torch.randn(1, 4, 33, 64, dtype=torch.float16) for _ in range(3))
    o = attention(q, k, v, causal=True, impl="reference")
    o_ref = attention_oracle(q, k, v, causal=True)[0]
    assert_close(o, o_ref, floor=dtype_floor(torch.float16))


def test_zero_new_tokens_give_empty_outputs():
    seq_lens = torch.tensor([3, 0], dtype=torch.int32)
    o = mla_decode(torch.randn(2, 4, 0, 16), torch.randn(2, 4, 0, 4), torch.randn(2, 5, 16), torch.randn(2, 5, 4),
                   seq_lens, scale=1.0, impl="reference")
    assert o.shape == (2, 4, 0, 16)
    o = decode_attention(torch.randn(2, 4, 0, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 8), seq_lens,
                         impl="reference")
    assert o.shape == (2, 4, 0, 8)

"""Bad input raises ValueError naming the argument and the shapes it got; impl choice is explicit."""

import pytest
import torch

from mla_attn import attention, decode_attention, merge_attention_states, mla_decode


def _gqa(b=2, hq=8, hkv=2, n=16, d=32, dtype=torch.float32):
    return (torch.randn(b, hq, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype),
            torch.randn(b, hkv, n, d, dtype=dtype), torch.full((b,), 4, dtype=torch.int32))


def test_heads_not_divisible():
    with pytest.raises(ValueError, match=r"Hq=9.*Hkv=2"):
        attention(torch.randn(1, 9, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
    q, k, v, sl = _gqa(hq=6, hkv=4)
    with pytest.raises(ValueError, match="Hq=6"):
        decode_attention(q, k, v, sl)


def test_mismatched_head_dims():
    with pytest.raises(ValueError, match=r"k's head dim.*\(1, 2, 4, 16\).*\(1, 2, 4, 8\)"):
        attention(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 16))
    q, k, v, sl = _gqa()
    with pytest.raises(ValueError, match="k_cache's head dim"):
        decode_attention(q[..., :16], k, v, sl)
    with pytest.raises(ValueError, match="kv_latent's width"):
        mla_decode(torch.randn(2, 4, 32), None, torch.randn(2, 8, 16), None, sl, scale=1.0)


def test_seq_lens_beyond_cache():
    q, k, v, _ = _gqa(n=16)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 16\].*17"):
        decode_attention(q, k, v, torch.tensor([3, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q, k, v, torch.tensor([-1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens must be an int32 tensor of shape \[B\] = \[2\]"):
        decode_attention(q, k, v, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        decode_attention(q, k, v, torch.tensor([3.0, 2.0]))
    pool, table = torch.randn(10, 4, 20), torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[0, 12\]"):
        mla_decode(torch.randn(2, 4, 16), torch.randn(2, 4, 4), pool[..., :16], pool[..., 16:],
                   torch.tensor([13, 1], dtype=torch.int32), scale=1.0, block_table=table)


def test_dtype_mismatch_between_q_and_caches():
    q, k, v, sl = _gqa()
    with pytest.raises(ValueError, match="k_cache has dtype torch.float16 but q has torch.float32"):
        decode_attention(q, k.half(), v, sl)
    with pytest.raises(ValueError, match="kv_latent has dtype"):
        mla_decode(torch.randn(2, 4, 16), None, torch.randn(2, 8, 16, dtype=torch.bfloat16), None, sl, scale=1.0)
    with pytest.raises(ValueError, match="v has dtype"):
        attention(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16).double())


def test_block_table_wrong_shape():
    q = torch.randn(2, 8, 32)
    k, v = torch.randn(6, 4, 2, 32), torch.randn(6, 4, 2, 32)
    sl = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table must be \[B, max_pages\] with B = 2, got shape \(3, 2\)"):
        decode_attention(q, k, v, sl, block_table=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table must be \[B, max_pages\].*\(2,\)"):
        decode_attention(q, k, v, sl, block_table=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table must be int32"):
        decode_attention(q, k, v, sl, block_table=torch.zeros(2, 2))


def test_other_bad_shapes():
    q, k, v, sl = _gqa()
    with pytest.raises(ValueError, match=r"q must be 3-D or 4-D"):
        decode_attention(q[0], k, v, sl)
    with pytest.raises(ValueError, match="v_cache must share"):
        decode_attention(q, k, v[:, :1], sl)
    with pytest.raises(ValueError, match="q_rope and k_rope must both"):
        mla_decode(torch.randn(2, 4, 16), torch.randn(2, 4, 4), torch.randn(2, 8, 16), None, sl, scale=1.0)
    with pytest.raises(ValueError, match="k_rope must be"):
        mla_decode(torch.randn(2, 4, 16), torch.randn(2, 4, 4), torch.randn(2, 8, 16), torch.randn(2, 8, 5), sl,
                   scale=1.0)
    with pytest.raises(ValueError, match="scale is required"):
        mla_decode(torch.randn(2, 4, 16), None, torch.randn(2, 8, 16), None, sl, scale=None)
    with pytest.raises(ValueError, match="lse_parts must be"):
        merge_attention_states(torch.randn(2, 3, 8), torch.randn(2, 4))
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k, v, sl, num_splits=0)


def test_impl_choice_is_explicit(monkeypatch):
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="impl must be one of"):
        attention(q, k, v, impl="fast")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="impl='triton' needs CUDA tensors"):
        attention(q, k, v, impl="triton")
    # auto on CPU tensors is the reference path, whatever the interpreter setting
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, impl="reference"))


def test_float64_goes_to_reference_under_auto_and_is_refused_by_triton():
    q = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="impl='triton' runs fp16, bf16 and fp32"):
        attention(q, q, q, impl="triton")
    torch.testing.assert_close(attention(q, q, q), attention(q, q, q, impl="reference"))


def test_checks_after_a_valid_call_with_the_same_signature():
    """The ops skip checks a call signature (shapes, dtypes, devices, scalars) has passed; what is not part
    of the signature is still checked every call: the values of CPU seq_lens, a bad num_splits."""
    from mla_attn.ops.decode import api

    q, k, v, sl = _gqa(n=16)
    decode_attention(q, k, v, sl)
    decode_attention(q, k, v, sl)  # the skip path
    assert len(api._validated) == 1
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 16\].*17"):
        decode_attention(q, k, v, torch.tensor([3, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 16\]"):
        decode_attention(q, k, v, torch.tensor([-1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k, v, sl, num_splits=[2])
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k, v, sl, num_splits=0)
    with pytest.raises(ValueError, match="k_cache's head dim"):
        decode_attention(q[..., :16], k, v, sl)
    c = torch.randn(2, 8, 32)
    ql, qr, kr = torch.randn(2, 4, 32), torch.randn(2, 4, 8), torch.randn(2, 8, 8)
    sl8 = torch.tensor([8, 3], dtype=torch.int32)
    mla_decode(ql, qr, c, kr, sl8, scale=0.1)
    mla_decode(ql, qr, c, kr, sl8, scale=0.1)
    with pytest.raises(ValueError, match="scale is required"):
        mla_decode(ql, qr, c, kr, sl8, scale=None)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 8\].*9"):
        mla_decode(ql, qr, c, kr, torch.tensor([9, 3], dtype=torch.int32), scale=0.1)
    with pytest.raises(ValueError, match="q_rope and k_rope"):
        mla_decode(ql, None, c, kr, sl8, scale=0.1)


def test_skipped_checks_give_the_same_answer():
    q, k, v, sl = _gqa(n=16)
    first = decode_attention(q, k, v, sl, return_lse=True)
    again = decode_attention(q, k, v, sl, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert decode_attention(q[:, :, None], k, v, sl).shape == (2, 8, 1, 32)  # 4-D q: its own signature

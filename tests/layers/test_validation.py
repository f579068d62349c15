"""Bad input to the layers raises ValueError naming the argument (and showing what it got)."""

import pytest
import torch

from layer_kit import YARN
from mla_attn.layers import (GQAConfig, GroupedQueryAttention, MLAConfig, MultiHeadAttention, MultiHeadLatentAttention,
                             MultiQueryAttention)


def _mla():
    return MultiHeadLatentAttention(MLAConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16,
                                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                              rope_scaling=YARN, max_position_embeddings=163840))


def _gqa():
    return GroupedQueryAttention(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=4),
     r"num_attention_heads \(6\).*num_key_value_heads \(4\)"),
    (dict(hidden_size=60, num_attention_heads=8, num_key_value_heads=2),
     r"hidden_size \(60\).*num_attention_heads \(8\)"),
    (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=7), "head_dim must be even"),
    (dict(hidden_size=64, num_attention_heads=0, num_key_value_heads=1), "num_attention_heads must be a positive int"),
    (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, impl="cuda"), "impl"),
    (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "su"}), "rope_type"),
])
def test_gqa_construction_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupedQueryAttention(**kwargs)


def test_presets():
    assert MultiQueryAttention(32, 4).num_kv_heads == 1
    assert MultiHeadAttention(32, 4, 16).head_dim == 16  # head_dim is the presets' third argument
    # A GQA-style call (KV heads third) is refused, not read as head_dim = 4 / 1.
    with pytest.raises(ValueError, match="head_dim third"):
        MultiHeadAttention(32, 4, 4)
    with pytest.raises(ValueError, match="head_dim third"):
        MultiQueryAttention(32, 4, 1)
    assert MultiHeadAttention(64, 8, 8).head_dim == 8  # 8 == 64 // 8: both readings agree
    assert MultiHeadAttention(32, 4, num_key_value_heads=4).num_kv_heads == 4
    with pytest.raises(ValueError, match="num_key_value_heads=1, got num_key_value_heads=2"):
        MultiQueryAttention(32, 4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        GQAConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=3)


@pytest.mark.parametrize("over,match", [
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim must be even"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int"),
    (dict(q_lora_rank=-1), "q_lora_rank must be a positive int"),
    (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "qk_nope_head_dim \\+ qk_rope_head_dim"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}, max_position_embeddings=4096), None),  # valid
])
def test_mla_config_errors(over, match):
    base = dict(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8)
    if match is None:
        assert MLAConfig(**{**base, **over}).rope_scaling["original_max_position_embeddings"] == 4096
        return
    with pytest.raises(ValueError, match=match):
        MLAConfig(**{**base, **over})


@pytest.mark.parametrize("make", [_gqa, _mla], ids=["gqa", "mla"])
def test_call_errors(make):
    layer = make()
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"x must be \[B, T, hidden_size\] with hidden_size=32, got \(2, 5, 31\)"):
        layer(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"positions must be an int tensor of shape \[B, T\] = \[2, 5\], got \(5,\)"):
        layer(x, positions=torch.arange(5))
    with pytest.raises(ValueError, match="positions must hold integers"):
        layer(x, positions=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="batch_size=3"):
        layer(x, cache=layer.new_cache(3, 8))
    with pytest.raises(ValueError, match="cache holds torch.float16"):
        layer(x, cache=layer.new_cache(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="max_seq_len=4"):
        layer(x, cache=layer.new_cache(2, 4))
    with pytest.raises(ValueError, match="cache must be"):
        layer(x, cache=object())
    with pytest.raises(ValueError, match="num_pages"):
        layer.new_cache(2, 8, num_pages=4)


def test_mla_path_errors():
    layer = _mla()
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="path must be"):
        layer(x, path="fast")
    with pytest.raises(ValueError, match="path='absorbed' reads a latent cache"):
        layer(x, path="absorbed")
    cache = layer.new_cache(2, 16)
    with torch.no_grad():
        layer(x, cache=cache)
        cache.free(1)
        with pytest.raises(ValueError, match="same number of tokens"):
            layer(x[:, :1], cache=cache, path="expanded")
    gqa_cache = _gqa().new_cache(2, 8)
    with pytest.raises(ValueError, match="cache must be one of LatentCache"):
        layer(x, cache=gqa_cache)


@pytest.mark.parametrize("make", [_gqa, _mla], ids=["gqa", "mla"])
def test_x_dtype_must_match_the_layer_outside_autocast(make):
    layer = make()
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"x \(2, 3, 32\) is torch.float64 but the layer's weights are torch.float32"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts per op: a bf16 x is fine there
        y = layer(torch.randn(2, 3, 32).to(torch.bfloat16))
    assert y.shape == (2, 3, 32)


@pytest.mark.gpu  # needs a second device type
@pytest.mark.parametrize("make", [_gqa, _mla], ids=["gqa", "mla"])
def test_x_device_must_match_the_layer(make):
    with pytest.raises(ValueError, match="is on cuda"):
        make()(torch.randn(2, 3, 32, device="cuda"))

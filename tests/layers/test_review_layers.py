"""Review findings (layers, caches, rope, configs): each test failed before its fix.

Tolerance as tests/layers/test_hf_parity.py: fp32 relative error (Frobenius) <= 1e-5, where both sides
run the same float32 math and differ only in summation order (~1e-7 relative at these sizes).
"""

import pytest
import torch

from layer_kit import YARN, causal_mask, small_mla_config
from mla_attn.layers import GQAConfig, MLAConfig, MultiHeadAttention, MultiHeadLatentAttention, MultiQueryAttention
from mla_attn.testing import rel_err

TOL = 1e-5


@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q_proj", "q_lora"])
def test_attention_norms_use_hf_eps_whatever_the_model_rms_norm_eps(q_lora_rank, hf_deepseek):
    """Moonlight's config.json says rms_norm_eps=1e-5, but DeepseekV3Attention (and DeepSeek's own code)
    builds q_a_layernorm / kv_a_layernorm with the default eps=1e-6: config.rms_norm_eps is the decoder
    layers' norm. Small activations (mean square ~1e-5, comparable to eps) make the difference visible."""
    kw = {**small_mla_config(q_lora_rank, YARN), "rms_norm_eps": 1e-5}
    cfg, hf, rot = hf_deepseek(**kw)
    ours = MultiHeadLatentAttention(MLAConfig.from_hf(cfg)).eval()
    ours.load_state_dict(hf.state_dict())
    b, t = 2, 7
    x = 2e-3 * torch.randn(b, t, cfg.hidden_size)
    with torch.no_grad():
        ref = hf(x, rot(x, torch.arange(t).expand(b, t)), causal_mask(t))[0]
        assert rel_err(ours(x), ref) <= TOL
    assert MLAConfig.from_hf(cfg.to_dict()).rms_norm_eps == 1e-5  # the config still records the model's eps


def test_presets_from_config():
    """from_config is inherited by MultiHeadAttention / MultiQueryAttention, whose third positional argument
    is head_dim, not num_key_value_heads: the config's fields must go by name."""
    mha = MultiHeadAttention.from_config(GQAConfig(hidden_size=64, num_attention_heads=8, rope_theta=500000.0))
    assert (mha.num_heads, mha.num_kv_heads, mha.head_dim) == (8, 8, 8) and mha.config.rope_theta == 500000.0
    mqa = MultiQueryAttention.from_config({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
                                           "head_dim": 32})
    assert (mqa.num_heads, mqa.num_kv_heads, mqa.head_dim) == (4, 1, 32)
    with pytest.raises(ValueError, match="num_key_value_heads=1, got num_key_value_heads=2"):
        MultiQueryAttention.from_config(GQAConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2))


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn"])
@pytest.mark.parametrize("factor", [0, -2.0, "8"])
def test_rope_scaling_factor_must_be_a_positive_number(kind, factor):
    """A zero or negative factor made inf / NaN frequencies silently (a string failed with a TypeError)."""
    rs = {"rope_type": kind, "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match=r"rope_scaling\['factor'\] must be a positive number"):
        GQAConfig(hidden_size=32, num_attention_heads=4, rope_scaling=rs)

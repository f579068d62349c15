"""Our layers loaded with a Hugging Face layer's state_dict reproduce it (fp32, CPU, no downloads).

Tolerance: relative error (Frobenius norm, mla_attn.testing.rel_err) <= 1e-5. Both sides run the
same float32 math; they differ only in summation order (matmul blocking, the reference op's
softmax vs HF eager softmax), which costs ~1e-7 relative at these sizes. A wrong softmax scale
(the YaRN mscale**2 is 1.3-1.6 here), rope layout, rope factor or weight split moves the output
by 1e-2 or more, so 1e-5 separates right from wrong by three orders of magnitude.
"""

import pytest
import torch

from layer_kit import LLAMA3, YARN, YARN_RATIO, causal_mask, small_mla_config
from mla_attn.layers import GQAConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from mla_attn.testing import rel_err

TOL = 1e-5


def _decode_all(layer, x, cache, prompt, step=1, **kw):
    ys = [layer(x[:, :prompt], cache=cache, **kw)]
    for t in range(prompt, x.shape[1], step):
        ys.append(layer(x[:, t:t + step], cache=cache, **kw))
    return torch.cat(ys, dim=1)


LLAMA_CASES = {
    "gqa-8-2": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2),
    "mha-6-bias": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6, attention_bias=True),
    "mqa-4-1-hd16": dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    "gqa-9-3-llama3": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                           rope_scaling=LLAMA3, rope_theta=500000.0),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_attention(case, hf_llama):
    cfg, hf, rot = hf_llama(max_position_embeddings=4096, **LLAMA_CASES[case])
    ours = GroupedQueryAttention.from_config(cfg).eval()
    ours.load_state_dict(hf.state_dict())  # strict: the names match exactly
    b, t = 2, 13
    x = torch.randn(b, t, cfg.hidden_size)
    # Training path, with positions far past the original context (llama3 bands all active).
    pos = torch.stack([torch.arange(t) + 100, torch.arange(t) * 7 + 3])
    with torch.no_grad():
        ref = hf(x, rot(x, pos), causal_mask(t))[0]
        assert rel_err(ours(x, positions=pos), ref) <= TOL
        # Cached path: prefill 5 tokens then decode one by one, default positions 0..T-1.
        pos0 = torch.arange(t).expand(b, t)
        ref0 = hf(x, rot(x, pos0), causal_mask(t))[0]
        y = _decode_all(ours, x, ours.new_cache(b, 16), 5)
        assert rel_err(y, ref0) <= TOL


@pytest.mark.parametrize("q_lora_rank", [None, 20])
@pytest.mark.parametrize("scaling_name", ["yarn", "yarn-ratio"])
@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_attention(q_lora_rank, scaling_name, interleave, hf_deepseek):
    scaling = {"yarn": YARN, "yarn-ratio": YARN_RATIO}[scaling_name]
    cfg, hf, rot = hf_deepseek(**small_mla_config(q_lora_rank, scaling, interleave))
    ours = MultiHeadLatentAttention(MLAConfig.from_hf(cfg)).eval()
    assert ours.scaling != pytest.approx(ours.qk_head_dim ** -0.5)  # the YaRN mscale is in play
    ours.load_state_dict(hf.state_dict())
    b, t = 3, 11
    x = torch.randn(b, t, cfg.hidden_size)
    pos = torch.stack([torch.arange(t), torch.arange(t) + 5000, torch.arange(t) * 3 + 1])
    with torch.no_grad():
        ref = hf(x, rot(x, pos), causal_mask(t))[0]
        assert rel_err(ours(x, positions=pos), ref) <= TOL  # expanded (training) path
        # Absorbed path over a cache, the whole sequence at once, same positions.
        cache = ours.new_cache(b, t)
        assert rel_err(ours(x, cache=cache, positions=pos, path="absorbed"), ref) <= TOL
        # Prefill (expanded) then absorbed decode, default positions.
        pos0 = torch.arange(t).expand(b, t)
        ref0 = hf(x, rot(x, pos0), causal_mask(t))[0]
        assert rel_err(_decode_all(ours, x, ours.new_cache(b, t, page_size=4), 4), ref0) <= TOL


def test_deepseek_with_biases(hf_deepseek):
    cfg, hf, rot = hf_deepseek(**{**small_mla_config(16, YARN), "attention_bias": True})
    ours = MultiHeadLatentAttention(MLAConfig.from_hf(cfg)).eval()
    ours.load_state_dict(hf.state_dict())
    assert ours.q_a_proj.bias is not None and ours.kv_a_proj_with_mqa.bias is not None
    x = torch.randn(2, 9, cfg.hidden_size)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        ref = hf(x, rot(x, pos), causal_mask(9))[0]
        assert rel_err(ours(x), ref) <= TOL


def test_deepseek_rope_parameters_form(hf_deepseek):
    """A transformers-5 style config (rope_parameters) builds the same layer as the rope_scaling form."""
    kw = small_mla_config(None, None)
    kw.pop("rope_scaling")
    theta = kw.pop("rope_theta")
    rp = {"rope_type": "yarn", "rope_theta": theta, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.8,
          "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
    cfg, hf, rot = hf_deepseek(rope_parameters=dict(rp), **kw)
    ours = MultiHeadLatentAttention(MLAConfig.from_hf(cfg.to_dict())).eval()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 7, cfg.hidden_size)
    with torch.no_grad():
        ref = hf(x, rot(x, torch.arange(7).expand(2, 7)), causal_mask(7))[0]
        assert rel_err(ours(x), ref) <= TOL


def test_llama_from_transformers_dict_and_object_agree(hf_llama):
    cfg, _, _ = hf_llama(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, rope_scaling=LLAMA3,
                         rope_theta=500000.0, max_position_embeddings=4096)
    a, b = GQAConfig.from_hf(cfg), GQAConfig.from_hf(cfg.to_dict())
    assert a == b
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_theta == 500000.0 and a.head_dim == 8

"""RoPE against transformers' Llama / DeepSeek-V3 rotary code and against the definition (complex rotation).

Tolerances: both sides compute the same float32 formulas (inverse frequencies, angles
``pos.float() * inv_freq``, cos/sin); the only differences are op order inside the llama3 / YaRN
frequency formulas, a few float32 ulps. We allow 1e-6 relative on inv_freq and 1e-5 absolute on
rotated unit-scale values (positions up to 1e5: an angle of ~1e5 rad carries float32 rounding of
~4e-3 rad in *both* implementations, identically, since the angle product is the same op). Against
the float64 definition the bound is set by that float32 angle rounding: 1e-3 for positions < 2048.
"""

import math

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds
from transformers.models.llama import modeling_llama as hf_llama

from mla_attn.ops.rope import (RotaryEmbedding, apply_rope, normalize_rope_scaling, rope_cos_sin, rope_inv_freq,
                               rope_softmax_scale_factor, yarn_get_mscale)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN_V2 = {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
           "original_max_position_embeddings": 4096}
YARN_RATIO = {"type": "yarn", "factor": 16, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
              "original_max_position_embeddings": 512}  # attention factor != 1 on cos/sin
YARN_PLAIN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}  # no mscales
YARN_KIMI = {"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 4096}
LINEAR = {"rope_type": "linear", "factor": 2.0}

POSITIONS = torch.tensor([[0, 1, 2, 63, 64, 113, 1000, 4095], [5000, 8191, 8192, 20000, 65535, 100000, 131071, 7]])


def _llama_hf(dim, theta, scaling):
    cfg = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, rope_theta=theta,
                      rope_scaling=scaling, max_position_embeddings=131072)
    return cfg, hf_llama.LlamaRotaryEmbedding(cfg)


def _ds_hf(dim, theta, scaling, interleave=True):
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                           qk_nope_head_dim=8, qk_rope_head_dim=dim, v_head_dim=8, rope_theta=theta,
                           rope_scaling=scaling, rope_interleave=interleave, max_position_embeddings=163840)
    return cfg, hf_ds.DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("name,dim,theta,scaling", [
    ("default-d64", 64, 10000.0, None),
    ("default-d128-t500k", 128, 500000.0, None),
    ("llama3-d128", 128, 500000.0, LLAMA3),
    ("linear-d32", 32, 10000.0, LINEAR),
    ("yarn-plain-d64", 64, 10000.0, YARN_PLAIN),
])
def test_rotate_half_matches_llama(name, dim, theta, scaling):
    cfg, hf_rot = _llama_hf(dim, theta, scaling)
    rope = RotaryEmbedding(dim, theta, scaling, interleaved=False, max_position_embeddings=131072)
    assert torch.allclose(rope.inv_freq, hf_rot.inv_freq, rtol=1e-6, atol=0), name
    assert rope.attention_factor == pytest.approx(hf_rot.attention_scaling, rel=1e-12)
    x = torch.randn(2, 3, POSITIONS.shape[1], dim)  # [B, H, T, D] as HF lays it out
    hf_cos, hf_sin = hf_rot(x, POSITIONS)
    hf_q, hf_k = hf_llama.apply_rotary_pos_emb(x, 2 * x, hf_cos, hf_sin)
    cos, sin = rope(POSITIONS)  # [B, T, D/2]
    assert torch.allclose(torch.cat((cos, cos), -1), hf_cos, atol=1e-6, rtol=0)
    q = rope.rotate(x, cos[:, None], sin[:, None])
    k = rope.rotate(2 * x, cos[:, None], sin[:, None])
    assert (q - hf_q).abs().max().item() <= 1e-5
    assert (k - hf_k).abs().max().item() <= 2e-5


def test_llama3_scaling_changes_low_frequencies_only():
    base, _ = rope_inv_freq(128, 500000.0)
    scaled, factor = rope_inv_freq(128, 500000.0, LLAMA3)
    assert factor == 1.0
    assert torch.equal(scaled[:10], base[:10])  # short wavelengths untouched
    assert torch.allclose(scaled[-5:], base[-5:] / 8.0)  # long wavelengths divided by the factor
    middle = (scaled != base) & ~torch.isclose(scaled, base / 8.0)
    assert middle.any()  # the blended band exists for Llama-3.1's numbers


@pytest.mark.parametrize("name,dim,theta,scaling", [
    ("default-d64", 64, 10000.0, None),
    ("yarn-v2-d64", 64, 10000.0, YARN_V2),
    ("yarn-ratio-d32", 32, 10000.0, YARN_RATIO),
    ("yarn-kimi-d64", 64, 50000.0, YARN_KIMI),
    ("yarn-plain-d16", 16, 10000.0, YARN_PLAIN),
])
@pytest.mark.parametrize("interleaved", [True, False])
def test_matches_deepseek_v3(name, dim, theta, scaling, interleaved):
    cfg, hf_rot = _ds_hf(dim, theta, scaling, interleaved)
    rope = RotaryEmbedding(dim, theta, scaling, interleaved=interleaved, max_position_embeddings=163840)
    assert torch.allclose(rope.inv_freq, hf_rot.inv_freq, rtol=1e-6, atol=0), name
    assert rope.attention_factor == pytest.approx(hf_rot.attention_scaling, rel=1e-12)
    x = torch.randn(2, 5, POSITIONS.shape[1], dim)  # [B, H, T, Dr]
    k = torch.randn(2, 1, POSITIONS.shape[1], dim)
    hf_cos, hf_sin = hf_rot(x, POSITIONS)
    fn = hf_ds.apply_rotary_pos_emb_interleave if interleaved else hf_ds.apply_rotary_pos_emb
    hf_q, hf_k = fn(x, k, hf_cos, hf_sin)
    cos, sin = rope(POSITIONS)
    assert (rope.rotate(x, cos[:, None], sin[:, None]) - hf_q).abs().max().item() <= 1e-5
    assert (rope.rotate(k, cos[:, None], sin[:, None]) - hf_k).abs().max().item() <= 1e-5
    # The softmax-scale correction DeepSeek applies on top.
    hf_scale = hf_ds.yarn_apply_mscale(cfg.rope_parameters, 1.0)
    assert rope_softmax_scale_factor(normalize_rope_scaling(scaling, 163840)) == pytest.approx(hf_scale, rel=1e-12)


def test_yarn_factors_by_hand():
    # V2 numbers: equal mscales cancel on cos/sin, the softmax scale gets the full correction squared.
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert yarn_get_mscale(40, 0.707) == pytest.approx(m)
    assert rope_inv_freq(64, 10000.0, YARN_V2)[1] == pytest.approx(1.0)
    assert rope_softmax_scale_factor(YARN_V2) == pytest.approx(m * m)
    ratio = (0.1 * 1.0 * math.log(16) + 1) / (0.1 * 0.5 * math.log(16) + 1)
    assert rope_inv_freq(32, 10000.0, YARN_RATIO)[1] == pytest.approx(ratio)
    assert rope_inv_freq(16, 10000.0, YARN_PLAIN)[1] == pytest.approx(0.1 * math.log(4) + 1)
    assert rope_softmax_scale_factor(YARN_PLAIN) == 1.0
    assert rope_softmax_scale_factor(None) == 1.0
    assert yarn_get_mscale(1.0, 5.0) == 1.0


@pytest.mark.parametrize("interleaved", [True, False])
def test_against_complex_rotation_definition(interleaved):
    # Definition in float64: pair i of x is the complex number (a + ib), rotated by e^{i pos inv_freq_i}.
    dim, theta = 32, 10000.0
    pos = torch.tensor([[0, 1, 17, 113, 2047]])
    x = torch.randn(1, pos.shape[1], dim, dtype=torch.float64)
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos[..., None].double() * inv  # [1, T, D/2]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : dim // 2], x[..., dim // 2:])
    z = torch.complex(a, b) * torch.polar(torch.ones_like(ang), ang)
    want = torch.cat((z.real, z.imag), -1)  # half-split output layout
    cos, sin = rope_cos_sin(pos, rope_inv_freq(dim, theta)[0])
    got = apply_rope(x.float(), cos, sin, interleaved=interleaved)
    assert (got.double() - want).abs().max().item() <= 1e-3
    # Relative property: q.k after rotation depends only on the position difference.
    q0, k0 = torch.randn(dim), torch.randn(dim)
    def dot(pq, pk):
        c, s = rope_cos_sin(torch.tensor([pq, pk]), rope_inv_freq(dim, theta)[0])
        r = apply_rope(torch.stack((q0, k0)), c, s, interleaved=interleaved)
        return (r[0] * r[1]).sum().item()
    assert dot(7, 3) == pytest.approx(dot(107, 103), abs=1e-4)


def test_bf16_input_rotates_in_float32_and_module_keeps_fp32_frequencies():
    rope = RotaryEmbedding(64, 10000.0, YARN_V2, interleaved=True).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
    assert torch.equal(rope.inv_freq, rope_inv_freq(64, 10000.0, YARN_V2)[0])
    x = torch.randn(3, 7, 64)
    cos, sin = rope(torch.arange(7).expand(3, 7))
    out = rope.rotate(x.bfloat16(), cos, sin)
    assert out.dtype == torch.bfloat16
    ref = rope.rotate(x.bfloat16().float(), cos, sin)
    assert (out.float() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()


def test_cos_sin_cache_rows_equal_on_the_fly():
    rope = RotaryEmbedding(16, 10000.0, LLAMA3)
    cos_t, sin_t = rope.cos_sin_cache(300)
    pos = torch.tensor([[0, 299, 113]])
    cos, sin = rope(pos)
    assert torch.equal(cos_t[pos[0]], cos[0]) and torch.equal(sin_t[pos[0]], sin[0])


@pytest.mark.parametrize("bad,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type"),
    ({"rope_type": "llama3", "factor": 8.0}, "missing"),
    ({"rope_type": "linear"}, "missing"),
    ("yarn", "rope_scaling"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_bad_rope_scaling_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_rope_scaling(bad, 4096)


def test_bad_dims_raise():
    with pytest.raises(ValueError, match="rotary dim"):
        rope_inv_freq(15)
    with pytest.raises(ValueError, match="rope_theta"):
        rope_inv_freq(16, 0.0)
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(torch.randn(2, 8), torch.randn(2, 3), torch.randn(2, 3))


def test_yarn_defaults_factor_and_original_length_from_max_positions():
    rs = normalize_rope_scaling({"type": "yarn", "original_max_position_embeddings": 4096}, 163840)
    assert rs["factor"] == pytest.approx(40.0) and rs["rope_type"] == "yarn"
    rs = normalize_rope_scaling({"rope_type": "yarn", "factor": 4.0}, 2048)
    assert rs["original_max_position_embeddings"] == 2048
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 5.0}) is None

"""absorb_mla_weights: layout against Hugging Face's kv_b_proj split, the absorption identities,
float32 math with one cast, input checking, and the FLOP/byte report."""

import pytest
import torch

from mla_attn.convert import absorb_mla_weights, absorption_cost
from mla_attn.convert.absorb import attention_dims

from convert_fixtures import build_model, tiny_config

# Odd sizes on purpose: 3 heads, widths that are not powers of two.
DIMS = dict(
    hidden_size=40, num_attention_heads=3, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10
)


def random_layer(q_lora_rank=None, dtype=torch.float64, **over):
    d = attention_dims({**DIMS, "q_lora_rank": q_lora_rank, **over})
    shapes = d.expected_shapes()
    names = [n for n in shapes if n.endswith(".weight")]
    return d, {n: torch.randn(shapes[n], dtype=dtype) for n in names}


def test_layout_matches_hf_expand_kv():
    """w_uk / w_uv must split kv_b_proj exactly as DeepseekV3Attention.expand_kv does."""
    model = build_model(tiny_config(q_lora_rank=24), seed=3)
    attn = model.model.layers[0].self_attn
    ab = absorb_mla_weights(attn.state_dict(), model.config)
    c = torch.randn(2, 1, 7, attn.kv_lora_rank)  # [B, 1, T, Dc] latents
    k_rot = torch.randn(2, 1, 7, attn.qk_rope_head_dim)
    with torch.no_grad():
        key, value = attn.expand_kv(c, k_rot)  # [B, H, T, nope + rope], [B, H, T, v]
    k_nope = torch.einsum("bxtc,hnc->bhtn", c, ab["w_uk"])
    v = torch.einsum("bxtc,hcv->bhtv", c, ab["w_uv"])
    torch.testing.assert_close(k_nope, key[..., : attn.qk_nope_head_dim], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_lora_rank", [None, 12], ids=["q_proj", "q_lora"])
def test_absorption_identities_float64(q_lora_rank):
    """In float64 every absorbed form equals the expanded computation to rounding (1e-12 relative:
    fp64 eps 1.1e-16 times sums of <= 40 terms is ~1e-14; a layout error is O(1))."""
    d, sd = random_layer(q_lora_rank)
    h, nope, dv, dc = d.num_attention_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    ab = absorb_mla_weights(sd, d, fused=True)
    assert set(ab) == {"w_uk", "w_uv", "w_q_absorbed", "w_o_absorbed"}
    for name, t in ab.items():
        assert tuple(t.shape) == d.expected_shapes()[name] and t.dtype == torch.float64, name

    kv_b = sd["kv_b_proj.weight"].view(h, nope + dv, dc)
    c_q = torch.randn(5, d.q_in, dtype=torch.float64)  # query input (normalized q latent or x)
    c_kv = torch.randn(7, dc, dtype=torch.float64)  # cached latents
    w_q = sd["q_b_proj.weight" if q_lora_rank else "q_proj.weight"].view(h, nope + d.qk_rope_head_dim, d.q_in)
    q_nope = torch.einsum("hnq,tq->thn", w_q[:, :nope], c_q)  # [T, H, nope]
    k_nope = torch.einsum("hnc,sc->shn", kv_b[:, :nope], c_kv)  # [S, H, nope]
    scores = torch.einsum("thn,shn->hts", q_nope, k_nope)
    q_lat = torch.einsum("thn,hnc->thc", q_nope, ab["w_uk"])
    _close(torch.einsum("thc,sc->hts", q_lat, c_kv), scores)
    _close(torch.einsum("hcq,tq->thc", ab["w_q_absorbed"], c_q), q_lat)

    o_lat = torch.randn(5, h, dc, dtype=torch.float64)  # latent attention output
    o_heads = torch.einsum("thc,hvc->thv", o_lat, kv_b[:, nope:])  # [T, H, v]
    y = o_heads.reshape(5, h * dv) @ sd["o_proj.weight"].T
    _close(torch.einsum("thc,hcv->thv", o_lat, ab["w_uv"]), o_heads)
    _close(torch.einsum("thc,hdc->td", o_lat, ab["w_o_absorbed"]), y)


def _close(a, b):
    err = (a - b).abs().max() / b.abs().max()
    assert err < 1e-12, err


def test_float32_math_one_cast_and_no_aliasing():
    d, sd = random_layer(12, dtype=torch.bfloat16)
    ab = absorb_mla_weights(sd, d, fused=True)
    ref = absorb_mla_weights({k: v.float() for k, v in sd.items()}, d, fused=True, dtype=torch.float32)
    for k in ab:
        assert ab[k].dtype == torch.bfloat16
        assert torch.equal(ab[k], ref[k].to(torch.bfloat16)), k  # computed in fp32, rounded once
    # w_uk / w_uv are pure splits: exactly the stored values.
    h, nope, dv, dc = 3, 8, 10, 20
    assert torch.equal(ab["w_uk"], sd["kv_b_proj.weight"].view(h, nope + dv, dc)[:, :nope])
    # Own storage: changing kv_b_proj afterwards (an optimizer step) does not change them.
    before = ab["w_uk"].clone()
    sd["kv_b_proj.weight"].add_(1.0)
    assert torch.equal(ab["w_uk"], before)
    assert absorb_mla_weights(sd, d, dtype=torch.float16)["w_uv"].dtype == torch.float16


def test_bad_inputs_raise():
    d, sd = random_layer(None, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"unknown keys \['model.layers.0.self_attn.kv_b_proj.weight'\]"):
        absorb_mla_weights({"model.layers.0.self_attn.kv_b_proj.weight": sd["kv_b_proj.weight"]}, d)
    with pytest.raises(ValueError, match=r"kv_b_proj.weight.*expected shape \[54, 20\].*got \[54, 19\]"):
        absorb_mla_weights({"kv_b_proj.weight": torch.randn(54, 19)}, d)
    with pytest.raises(ValueError, match="kv_b_proj.weight' is required"):
        absorb_mla_weights({"o_proj.weight": sd["o_proj.weight"]}, d)
    with pytest.raises(ValueError, match="dequantize it first"):
        absorb_mla_weights({"kv_b_proj.weight": sd["kv_b_proj.weight"].to(torch.float8_e4m3fn)}, d)
    with pytest.raises(ValueError, match="q_proj.weight' is required"):
        absorb_mla_weights({"kv_b_proj.weight": sd["kv_b_proj.weight"]}, d, fused=True)
    with pytest.raises(ValueError, match="fused"):
        absorb_mla_weights(sd, d, fused="yes")
    # Stale absorbed keys in the input are recomputed, never passed through.
    out = absorb_mla_weights({**sd, "w_uk": torch.zeros(3, 8, 20)}, d)
    assert not torch.equal(out["w_uk"], torch.zeros(3, 8, 20))


def test_cost_deepseek_v3_numbers():
    """The figures quoted in mla_attn/convert/README.md, per decoded token per layer."""
    v3 = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip
    cost = absorption_cost(v3)
    assert cost["factored"]["q"]["flops"] == 2 * 128 * 128 * (1536 + 512) == 67_108_864
    assert cost["fused"]["q"]["flops"] == 2 * 128 * 512 * 1536 == 201_326_592
    assert cost["factored"]["o"]["flops"] == 2 * 128 * 128 * (512 + 7168) == 251_658_240
    assert cost["fused"]["o"]["flops"] == 2 * 128 * 512 * 7168 == 939_524_096
    assert cost["factored"]["q"]["weight_bytes"] == 128 * 128 * 2048 * 2  # bf16
    assert cost["cheaper"] == {"q": "factored", "o": "factored"}
    ratio = (cost["fused"]["q"]["flops"] + cost["fused"]["o"]["flops"]) / (
        cost["factored"]["q"]["flops"] + cost["factored"]["o"]["flops"]
    )
    assert 3.5 < ratio < 3.6
    # Context-dependent attention FLOPs are the same for both forms.
    c4k = absorption_cost(v3, context_len=4096)
    assert c4k["shared"]["flops"] - cost["shared"]["flops"] == 2 * 128 * (2 * 512 + 64) * 4096
    # The repository's config file gives the same figures.
    from pathlib import Path

    from mla_attn.layers import MLAConfig

    repo_v3 = absorption_cost(MLAConfig.from_file(Path(__file__).resolve().parents[2] / "configs" / "DeepSeek-V3.json"))
    assert repo_v3["factored"] == cost["factored"] and repo_v3["fused"] == cost["fused"]
    # "auto" adds nothing for V3 shapes (both fused forms cost more)...
    assert set(absorb_mla_weights(*_tiny_v3_like(), fused="auto")) == {"w_uk", "w_uv"}


def _tiny_v3_like():
    d, sd = random_layer(30, dtype=torch.float32)
    return sd, d


def test_auto_fuses_where_cheaper():
    # A narrow latent (Dc=2) with a wide nope part makes W_UK^T W_UQ [H, 2, q_in] the cheaper query.
    d, sd = random_layer(6, dtype=torch.float32, kv_lora_rank=2, qk_nope_head_dim=32)
    cost = absorption_cost(d)
    assert cost["cheaper"]["q"] == "fused"
    out = absorb_mla_weights(sd, d, fused="auto")
    assert "w_q_absorbed" in out and ("w_o_absorbed" in out) == (cost["cheaper"]["o"] == "fused")

"""MultiHeadLatentAttention built from checkpoint weights reproduces Hugging Face's DeepseekV3Attention:
expanded path, cached decode (absorbed path), and after conversion from absorbed weights alone."""

import copy

import pytest
import torch

from mla_attn.convert import absorb_mla_weights, convert_checkpoint, load_checkpoint
from mla_attn.layers import MLAConfig, MultiHeadLatentAttention

from convert_fixtures import hf_attention_forward

B, T, PROMPT = 2, 13, 5


def rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def check_against_hf(y, y_hf32, y_hf64, what):
    """Tolerance from the data: our float32 error against HF in float64 must be within 2x HF's own
    float32 error, plus a floor of 1e-6 (float32 eps 1.2e-7 times ~8 for reductions of <= 600
    terms in a different order). A wrong scale, rope layout or head split is >= 1e-3 here (the
    fixture's weights make attention far from uniform: a 1% change of the softmax scale moves the
    output by ~5e-3)."""
    tol = 2 * rel_err(y_hf32, y_hf64) + 1e-6
    err = rel_err(y, y_hf64)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def run_layer(layer, x, *, page_size=None):
    """(training path on the whole sequence, prefill PROMPT tokens + token-by-token decode)."""
    with torch.no_grad():
        y_full = layer(x)
        cache = layer.new_cache(x.shape[0], x.shape[1], page_size=page_size)
        cache.fill_(float("nan"))  # unwritten slots must never be read
        parts = [layer(x[:, :PROMPT], cache=cache)]
        parts += [layer(x[:, t : t + 1], cache=cache) for t in range(PROMPT, x.shape[1])]
    return y_full, torch.cat(parts, dim=1)


@pytest.mark.parametrize(
    "fixture,page_size",
    [("hf_lora", None), ("hf_plain", None), ("fp8_ckpt", 4)],
    ids=["q_lora-yarn", "q_proj-bias-yarn", "fp8-576x200-paged"],
)
def test_layer_from_checkpoint_matches_hf(fixture, page_size, request):
    fx = request.getfixturevalue(fixture)
    weights = load_checkpoint(fx.path, dtype=torch.float32)
    config = MLAConfig.from_hf(fx.path)
    hf64 = copy.deepcopy(fx.model).double()
    for i, sd in weights.items():
        layer = MultiHeadLatentAttention(config)
        layer.load_state_dict(sd)  # strict: exactly the HF names
        x = torch.randn(B, T, config.hidden_size)
        y_hf32, y_hf64 = hf_attention_forward(fx.model, i, x), hf_attention_forward(hf64, i, x.double())
        y_full, y_dec = run_layer(layer, x, page_size=page_size)
        check_against_hf(y_full, y_hf32, y_hf64, f"layer {i} expanded")
        check_against_hf(y_dec, y_hf32, y_hf64, f"layer {i} prefill + absorbed decode")


@pytest.mark.parametrize("fixture", ["hf_lora", "fp8_ckpt"])
def test_converted_checkpoint_decodes_the_same(fixture, request, tmp_path):
    """Converted folder -> layer built from w_uk / w_uv alone (kv_b_proj dropped) gives the same
    numbers as the layer built from the source checkpoint (bitwise: the weights are equal)."""
    fx = request.getfixturevalue(fixture)
    dst = convert_checkpoint(fx.path, tmp_path / "out", dtype=torch.float32, progress=False)
    src_w, dst_w = load_checkpoint(fx.path, dtype=torch.float32), load_checkpoint(dst, dtype=torch.float32)
    config = MLAConfig.from_hf(dst)
    for i in src_w:
        ref = MultiHeadLatentAttention(config)
        ref.load_state_dict(src_w[i])
        absorbed_only = {k: v for k, v in dst_w[i].items() if k != "kv_b_proj.weight"}
        assert {"w_uk", "w_uv"} <= set(absorbed_only)
        layer = MultiHeadLatentAttention(config)
        layer.load_state_dict(absorbed_only)
        x = torch.randn(B, T, config.hidden_size)
        for got, want in zip(run_layer(layer, x), run_layer(ref, x)):
            assert torch.equal(got, want)


def test_finetune_then_reabsorb(hf_lora):
    """The docs' workflow: train the expanded path, re-absorb; decode uses the trained weights."""
    config = MLAConfig.from_hf(hf_lora.path)
    layer = MultiHeadLatentAttention(config)
    layer.load_state_dict(load_checkpoint(hf_lora.path, layers=[0], dtype=torch.float32)[0])
    before = absorb_mla_weights(layer.state_dict(), config)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(B, T, config.hidden_size)
    layer(x).square().mean().backward()
    opt.step()
    after = absorb_mla_weights(layer.state_dict(), config)
    assert not torch.equal(after["w_uk"], before["w_uk"])
    assert torch.equal(after["w_uk"], layer.w_uk) and torch.equal(after["w_uv"], layer.w_uv)
    y_full, y_dec = run_layer(layer, x)
    torch.testing.assert_close(y_dec, y_full, rtol=1e-5, atol=1e-5 * y_full.abs().max().item())

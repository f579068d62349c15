"""The layers with impl="triton" give the reference layers' numbers (CPU: Triton's interpreter).

The layers only route to the ops, so this checks the wiring (strides, views of the latent buffer,
paged block tables, S > 1 decode) rather than the kernels' accuracy, which tests/ops covers.
Tolerance: fp32 relative error <= 1e-5 under the interpreter (it runs the kernels' float32 math
exactly; only summation order differs, ~1e-7). On CUDA fp32 dots may run as TF32 (10-bit
mantissa, ~5e-4 relative per product), so the bound there is 5e-3.
"""

import pytest
import torch

from layer_kit import YARN, randomize
from mla_attn.layers import GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from mla_attn.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 5e-3 if DEVICE == "cuda" else 1e-5


def _pair(make):
    ref = randomize(make("reference")).to(DEVICE).eval()
    tri = make("triton").to(DEVICE).eval()
    tri.load_state_dict(ref.state_dict())
    return ref, tri


def _mla(impl):
    cfg = MLAConfig(hidden_size=48, num_attention_heads=5, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                    v_head_dim=10, q_lora_rank=16, rope_scaling=YARN, max_position_embeddings=163840)
    return MultiHeadLatentAttention(cfg, impl=impl)


def _gqa(impl):
    return GroupedQueryAttention(54, 9, 3, head_dim=8, impl=impl)


@pytest.mark.parametrize("page_size", [None, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@torch.no_grad()
def test_cached_paths_match_reference(kind, page_size):
    ref, tri = _pair(_mla if kind == "mla" else _gqa)
    x = torch.randn(2, 9, ref.hidden_size, device=DEVICE)
    outs = []
    for layer in (ref, tri):
        cache = layer.new_cache(2, 10, page_size=page_size, shuffle_seed=5 if page_size else None).fill_(float("nan"))
        ys = [layer(x[:, :4], cache=cache), layer(x[:, 4:6], cache=cache)]
        ys += [layer(x[:, i:i + 1], cache=cache) for i in range(6, 9)]
        outs.append(torch.cat(ys, dim=1))
    assert not torch.isnan(outs[1]).any()
    assert rel_err(outs[1], outs[0]) <= TOL


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_training_path_and_gradients_match_reference(kind):
    ref, tri = _pair(_mla if kind == "mla" else _gqa)
    x = torch.randn(2, 7, ref.hidden_size, device=DEVICE)
    grads = []
    for layer in (ref, tri):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
        grads.append((y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y_ref, gx_ref, gp_ref), (y_tri, gx_tri, gp_tri) = grads
    assert rel_err(y_tri, y_ref) <= TOL
    assert rel_err(gx_tri, gx_ref) <= TOL
    for name in gp_ref:
        assert rel_err(gp_tri[name], gp_ref[name]) <= TOL, name

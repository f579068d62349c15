"""Cached paths equal the training path: prefill + token-by-token decode, contiguous and paged caches.

Every cache is poisoned with NaN before use (fill_) and paged caches hand out pages in a shuffled
order, so reading an unwritten slot or a wrong page turns the output NaN or wrong.

Tolerance (fp32): relative error (Frobenius) <= 1e-5. The paths compute the same function; they
differ in summation order (decode reference vs full attention) and, for MLA, in association
(absorbed: (q W_UK) c vs expanded: q (W_UK c)), each ~1e-7 relative at these sizes. An off-by-one
position, a stale or missing cached token, or the wrong scale moves outputs by >1e-2.
"""

import pytest
import torch

from layer_kit import YARN, randomize
from mla_attn.layers import GroupedQueryAttention, MLAConfig, MultiHeadAttention, MultiHeadLatentAttention, \
    MultiQueryAttention
from mla_attn.testing import rel_err

TOL = 1e-5
NAN = float("nan")


def _mla(q_lora_rank=None, heads=5, rope_dim=8, scaling=YARN, dtype=torch.float32):
    cfg = MLAConfig(hidden_size=48, num_attention_heads=heads, kv_lora_rank=24, qk_nope_head_dim=12,
                    qk_rope_head_dim=rope_dim, v_head_dim=10, q_lora_rank=q_lora_rank, rope_scaling=scaling,
                    max_position_embeddings=163840)
    return randomize(MultiHeadLatentAttention(cfg)).to(dtype).eval()


def _gqa(heads=9, kv_heads=3, cls=GroupedQueryAttention, **kw):
    if cls is GroupedQueryAttention:
        layer = cls(hidden_size=54, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, **kw)
    else:
        layer = cls(hidden_size=54, num_attention_heads=heads, head_dim=8, **kw)
    return randomize(layer).eval()


def _run(layer, x, cache, chunks, **kw):
    """Feed x through the cache in chunks of the given sizes; concatenate the outputs."""
    ys, t = [], 0
    for n in chunks:
        ys.append(layer(x[:, t:t + n], cache=cache, **kw))
        t += n
    assert t == x.shape[1]
    return torch.cat(ys, dim=1)


def _cache(layer, b, n, page_size, seed=0):
    cache = layer.new_cache(b, n, page_size=page_size, shuffle_seed=None if page_size is None else seed)
    return cache.fill_(NAN)


PAGE_SIZES = [None, 1, 4, 16]


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"P{p}")
@pytest.mark.parametrize("kind", ["gqa9-3", "mha4", "mqa6"])
@torch.no_grad()
def test_gqa_prefill_then_decode_equals_training(kind, page_size):
    layer = {"gqa9-3": lambda: _gqa(9, 3), "mha4": lambda: _gqa(4, cls=MultiHeadAttention),
             "mqa6": lambda: _gqa(6, cls=MultiQueryAttention)}[kind]()
    b, t, prompt = 3, 19, 7
    x = torch.randn(b, t, layer.hidden_size)
    ref = layer(x)
    cache = _cache(layer, b, 24, page_size)
    y = _run(layer, x, cache, [prompt] + [1] * (t - prompt))
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) <= TOL
    assert len(cache) == t and cache.seq_lens.tolist() == [t] * b and cache.seq_lens.dtype == torch.int32


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"P{p}")
@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q_proj", "q_lora"])
@torch.no_grad()
def test_mla_prefill_then_absorbed_decode_equals_training(q_lora_rank, page_size):
    layer = _mla(q_lora_rank)
    b, t, prompt = 3, 17, 6
    x = torch.randn(b, t, layer.hidden_size)
    ref = layer(x)  # expanded, no cache
    cache = _cache(layer, b, 20, page_size)
    y = _run(layer, x, cache, [prompt] + [1] * (t - prompt))
    assert rel_err(y, ref) <= TOL


@pytest.mark.parametrize("page_size", [None, 4], ids=lambda p: f"P{p}")
@torch.no_grad()
def test_mla_absorbed_equals_expanded(page_size):
    layer = _mla(16, heads=7)
    b, t = 2, 23
    x = torch.randn(b, t, layer.hidden_size)
    expanded = layer(x, cache=_cache(layer, b, t, page_size), path="expanded")
    absorbed = layer(x, cache=_cache(layer, b, t, page_size), path="absorbed")
    assert rel_err(absorbed, expanded) <= TOL
    assert rel_err(expanded, layer(x)) <= TOL


@pytest.mark.parametrize("page_size", [None, 4], ids=lambda p: f"P{p}")
@torch.no_grad()
def test_mla_chunked_prefill_and_multi_token_decode(page_size):
    layer = _mla(None)
    b, t = 2, 21
    x = torch.randn(b, t, layer.hidden_size)
    ref = layer(x)
    # Chunked prefill on the expanded path: the second chunk gathers the cached prefix.
    y = _run(layer, x, _cache(layer, b, t, page_size), [5, 8, 8], path="expanded")
    assert rel_err(y, ref) <= TOL
    # Default path: prefill 5, then absorbed steps of 3 tokens (causal among themselves).
    y = _run(layer, x, _cache(layer, b, t, page_size), [5, 3, 3, 3, 3, 3, 1])
    assert rel_err(y, ref) <= TOL


@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: f"P{p}")
@torch.no_grad()
def test_gqa_multi_token_decode(page_size):
    layer = _gqa(8, 2)
    x = torch.randn(2, 20, layer.hidden_size)
    y = _run(layer, x, _cache(layer, 2, 20, page_size), [1, 4, 4, 1, 10])
    assert rel_err(y, layer(x)) <= TOL


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@torch.no_grad()
def test_sequences_at_different_fills(kind):
    """Free one sequence of a paged batch mid-way and start a new one in its slot: per-sequence lengths
    and positions must keep both right."""
    layer = _gqa(6, 2) if kind == "gqa" else _mla(12)
    h = layer.hidden_size
    cache = _cache(layer, 2, 32, 4, seed=3)
    first = torch.randn(2, 9, h)
    _run(layer, first, cache, [6, 1, 1, 1])
    cache.free(1)
    assert cache.host_seq_lens == [9, 0] and cache.seq_lens.tolist() == [9, 0]
    second = torch.randn(2, 5, h)
    y = _run(layer, second, cache, [1] * 5)  # seq 0 continues at 9, seq 1 starts at 0
    whole0 = layer(torch.cat((first[:1], second[:1]), dim=1))[:, 9:]
    fresh1 = layer(second[1:])
    assert rel_err(y[:1], whole0) <= TOL
    assert rel_err(y[1:], fresh1) <= TOL


@torch.no_grad()
def test_reset_gives_the_same_numbers_again():
    layer = _mla(None)
    x = torch.randn(2, 10, layer.hidden_size)
    cache = _cache(layer, 2, 10, 4, seed=1)
    y1 = _run(layer, x, cache, [4] + [1] * 6)
    cache.reset()
    assert len(cache) == 0 and cache.seq_lens.tolist() == [0, 0] and cache.allocator.num_free == cache.num_pages
    y2 = _run(layer, x, cache, [4] + [1] * 6)
    assert torch.equal(y1, y2)


@torch.no_grad()
def test_explicit_positions_on_the_cached_path():
    layer = _gqa(4, 2)
    b, t = 2, 9
    x = torch.randn(b, t, layer.hidden_size)
    pos = torch.stack([torch.arange(t) + 1000, torch.arange(t) * 2])
    ref = layer(x, positions=pos)
    cache = _cache(layer, b, t, None)
    ys = [layer(x[:, :4], cache=cache, positions=pos[:, :4])]
    ys += [layer(x[:, i:i + 1], cache=cache, positions=pos[:, i:i + 1]) for i in range(4, t)]
    assert rel_err(torch.cat(ys, 1), ref) <= TOL


@torch.no_grad()
def test_mla_without_rope_part():
    layer = _mla(None, rope_dim=0, scaling=None)
    x = torch.randn(2, 8, layer.hidden_size)
    cache = layer.new_cache(2, 8).fill_(NAN)
    assert cache.k_rope is None and cache.kv.shape[-1] == 24
    assert rel_err(_run(layer, x, cache, [3, 1, 1, 1, 1, 1]), layer(x)) <= TOL


@torch.no_grad()
def test_mla_bf16_absorbed_within_twice_expanded_error():
    """bf16: both paths against the fp32 layer; absorbed may be at most 2x as far as expanded (floor 1.6e-2)."""
    layer32 = _mla(16)
    layer16 = MultiHeadLatentAttention(layer32.config).to(torch.bfloat16).eval()
    layer16.load_state_dict(layer32.state_dict())
    x = torch.randn(2, 12, layer32.hidden_size)
    truth = layer32(x.bfloat16().float())
    xb = x.bfloat16()
    expanded = _run(layer16, xb, layer16.new_cache(2, 12), [12])
    absorbed = _run(layer16, xb, layer16.new_cache(2, 12), [4] + [1] * 8)
    assert absorbed.dtype == torch.bfloat16
    base = rel_err(expanded.float(), truth)
    assert rel_err(absorbed.float(), truth) <= max(1.6e-2, 2 * base)


def test_training_path_backward_reaches_every_weight():
    layer = _mla(16)
    x = torch.randn(2, 6, layer.hidden_size, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@torch.no_grad()
def test_zero_new_tokens_is_a_no_op(kind):
    layer = _gqa(6, 2) if kind == "gqa" else _mla(None)
    x = torch.randn(2, 6, layer.hidden_size)
    assert layer(x[:, :0]).shape == (2, 0, layer.hidden_size)
    cache = _cache(layer, 2, 6, 4)
    assert layer(x[:, :0], cache=cache).shape == (2, 0, layer.hidden_size) and len(cache) == 0
    y = [layer(x[:, :3], cache=cache), layer(x[:, 3:3], cache=cache), layer(x[:, 3:], cache=cache)]
    assert len(cache) == 6 and y[1].shape == (2, 0, layer.hidden_size)
    assert rel_err(torch.cat(y, 1), layer(x)) <= TOL


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@torch.no_grad()
def test_decode_steps_trace_under_torch_compile(kind):
    """Dynamo traces the cached path (host bookkeeping runs eagerly) and the numbers do not change.
    backend="eager" keeps this cheap: it checks tracing, guards and graph breaks, not codegen."""
    torch._dynamo.reset()
    layer = _gqa(6, 2) if kind == "gqa" else _mla(12)
    x = torch.randn(2, 10, layer.hidden_size)
    eager = _run(layer, x, _cache(layer, 2, 10, 4), [4] + [1] * 6)
    compiled = torch.compile(layer, backend="eager")
    traced = _run(compiled, x, _cache(layer, 2, 10, 4), [4] + [1] * 6)
    assert rel_err(traced, eager) <= TOL

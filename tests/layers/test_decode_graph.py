"""DecodeGraph: a one-token decode step replayed from a CUDA graph gives the eager step's numbers.

On CUDA (marked gpu): 30 steps over a prefilled cache, paged (page 4, so many steps need a new page,
which the runner allocates outside the graph) and contiguous, GQA and MLA, against the same layer run
eagerly on a copy of the cache; then a sequence is freed and refilled mid-way. Tolerance: fp32
relative error <= 1e-5. The graph replays the same kernels on the same inputs; only cuBLAS may pick
another algorithm under capture (summation order, ~1e-7); lengths and block tables must be equal.
On the CPU the runner runs the step eagerly; the tests check that and the argument checks.
"""

import copy

import pytest
import torch

from layer_kit import YARN, randomize
from mla_attn.layers import GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from mla_attn.layers.graph import DecodeGraph
from mla_attn.testing import rel_err


def _mla():
    cfg = MLAConfig(hidden_size=48, num_attention_heads=5, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                    v_head_dim=10, q_lora_rank=16, rope_scaling=YARN, max_position_embeddings=163840)
    return MultiHeadLatentAttention(cfg)


def _gqa():
    return GroupedQueryAttention(54, 9, 3, head_dim=8)


def _run(kind, page_size, device, steps=30, free_at=None):
    torch.manual_seed(0)
    layer = randomize(_mla() if kind == "mla" else _gqa()).to(device).eval()
    b, prompt = 3, 5
    x = torch.randn(b, prompt + steps, layer.hidden_size, device=device)
    with torch.no_grad():
        cache = layer.new_cache(b, prompt + steps + 1, page_size=page_size,
                                shuffle_seed=3 if page_size else None).fill_(float("nan"))
        layer(x[:, :prompt], cache=cache)
        twin = copy.deepcopy(cache)  # the eager run's cache, same pages
        graph = DecodeGraph(lambda xt: layer(xt, cache=cache), [cache] if free_at is None else None)
        eager, replayed = [], []
        for i in range(prompt, prompt + steps):
            if free_at is not None and i == free_at:  # a sequence ends; its slot starts a new one
                for c in (cache, twin):
                    c.free(1)
            eager.append(layer(x[:, i:i + 1], cache=twin))
            replayed.append(graph(x[:, i:i + 1]))
    return torch.cat(eager, 1), torch.cat(replayed, 1), cache, twin, graph


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("free_at", [None, 17], ids=["steady", "free"])
def test_graph_replay_matches_eager_gpu(kind, page_size, free_at):
    eager, replayed, cache, twin, graph = _run(kind, page_size, "cuda", free_at=free_at)
    assert graph._graph is not None  # it really replayed
    assert not torch.isnan(replayed).any()
    assert rel_err(replayed, eager) <= 1e-5
    assert cache.host_seq_lens == twin.host_seq_lens
    assert torch.equal(cache.seq_lens, twin.seq_lens)
    if page_size:
        assert torch.equal(cache.block_table, twin.block_table)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_cpu_runs_eagerly(kind):
    eager, replayed, cache, twin, graph = _run(kind, 4, "cpu", steps=4)
    assert graph._graph is None
    assert torch.equal(replayed, eager)
    assert cache.host_seq_lens == twin.host_seq_lens == [9, 9, 9]


def test_arguments_are_checked():
    layer = _gqa()
    cache = layer.new_cache(2, 8)
    with pytest.raises(ValueError, match="callable"):
        DecodeGraph(None, [cache])
    with pytest.raises(ValueError, match="caches"):
        DecodeGraph(lambda x: x, [])
    with pytest.raises(ValueError, match="caches"):
        DecodeGraph(lambda x: x, [torch.zeros(1)])
    graph = DecodeGraph(lambda x: layer(x, cache=cache), [cache])
    with pytest.raises(ValueError, match=r"\[B, 1, \.\.\.\]"):
        graph(torch.randn(2, 3, layer.hidden_size))


@torch.no_grad()
def test_first_call_finds_and_checks_the_caches():
    """caches=None takes them from the first call; a cache left out, a cache written twice per step,
    or a step writing none is refused (each would let the graph drift from the host-side lengths)."""
    a, b = _gqa(), _gqa()
    x = torch.randn(2, 1, a.hidden_size)

    def fresh():
        return a.new_cache(2, 8), b.new_cache(2, 8)

    ca, cb = fresh()
    graph = DecodeGraph(lambda xt: b(a(xt, cache=ca), cache=cb))
    graph(x)
    assert [id(c) for c in graph.caches] == [id(ca), id(cb)]
    assert ca.host_seq_lens == cb.host_seq_lens == [1, 1]

    ca, cb = fresh()
    with pytest.raises(ValueError, match="exactly the caches step writes"):
        DecodeGraph(lambda xt: b(a(xt, cache=ca), cache=cb), [ca])(x)
    ca, _ = fresh()
    with pytest.raises(ValueError, match=r"exactly one token.*'KVCache': \[1, 1\]"):
        DecodeGraph(lambda xt: a(a(xt, cache=ca), cache=ca))(x)
    with pytest.raises(ValueError, match="no cache write"):
        DecodeGraph(lambda xt: a(xt))(x)

"""The caches: what they store (sizes), how they fill, overflow, pages, reset and free."""

import pytest
import torch

from layer_kit import YARN, randomize
from mla_attn.cache import BlockAllocator, KVCache, LatentCache, PagedKVCache, PagedLatentCache
from mla_attn.layers import GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention

NAN = float("nan")


def _mla(**kw):
    cfg = MLAConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6,
                    v_head_dim=8, rope_scaling=YARN, max_position_embeddings=163840, **kw)
    return randomize(MultiHeadLatentAttention(cfg)).eval()


def _floating_buffers(cache):
    return {name: buf for name, buf in cache.named_buffers() if buf.is_floating_point()}


@pytest.mark.parametrize("page_size", [None, 1, 4, 16], ids=lambda p: f"P{p}")
def test_mla_cache_holds_dc_plus_dr_per_token_and_nothing_else(page_size):
    layer = _mla()
    b, n, dc, dr = 3, 37, 24, 6
    cache = layer.new_cache(b, n, page_size=page_size)
    floats = _floating_buffers(cache)
    assert list(floats) == ["kv"], floats.keys()  # one buffer; latent and rope key are views of it
    slots = b * n if page_size is None else cache.num_pages * page_size
    assert floats["kv"].numel() == slots * (dc + dr)
    if page_size is not None:
        assert cache.num_pages == b * -(-n // page_size)  # just enough pages by default
    assert cache.kv_latent.shape[-1] == dc and cache.k_rope.shape[-1] == dr
    assert cache.kv_latent.data_ptr() == cache.kv.data_ptr()
    assert cache.k_rope.data_ptr() == cache.kv.data_ptr() + dc * cache.kv.element_size()
    assert cache.values_per_token() == dc + dr
    # The other buffers are the int32 bookkeeping only, and none of it is in the layer's state_dict.
    others = {name: buf.dtype for name, buf in cache.named_buffers() if name not in floats}
    assert set(others.values()) <= {torch.int32}
    assert cache.state_dict() == {}


def test_mla_cache_stores_the_normalized_latent_and_rotated_rope_key():
    layer = _mla()
    x = torch.randn(2, 5, 32)
    cache = layer.new_cache(2, 8).fill_(NAN)
    with torch.no_grad():
        layer(x, cache=cache)
        ckv = layer.kv_a_proj_with_mqa(x)
        latent = layer.kv_a_layernorm(ckv[..., :24])
        cos, sin = layer.rotary_emb(torch.arange(5).expand(2, 5))
        k_rope = layer.rotary_emb.rotate(ckv[..., 24:], cos, sin)
    assert torch.equal(cache.kv_latent[:, :5], latent)
    assert torch.equal(cache.k_rope[:, :5], k_rope)
    assert torch.isnan(cache.kv[:, 5:]).all()  # nothing written past the fill


def test_kv_cache_layouts_match_the_decode_ops():
    layer = GroupedQueryAttention(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    c = layer.new_cache(3, 10)
    assert isinstance(c, KVCache) and c.k.shape == (3, 2, 10, 8) and c.v.shape == (3, 2, 10, 8)
    p = layer.new_cache(3, 10, page_size=4)
    assert isinstance(p, PagedKVCache) and p.k.shape == (9, 4, 2, 8) and p.block_table.shape == (3, 3)
    assert p.block_table.dtype == torch.int32 and p.seq_lens.dtype == torch.int32
    m = _mla().new_cache(2, 10, page_size=4, dtype=torch.float16)
    assert isinstance(m, PagedLatentCache) and m.kv.shape == (6, 4, 30) and m.dtype == torch.float16
    assert isinstance(_mla().new_cache(2, 10), LatentCache)


@pytest.mark.parametrize("paged", [False, True])
def test_overfilling_raises_before_anything_is_written(paged):
    cache = (PagedLatentCache(2, 10, 4, 2, page_size=4) if paged else LatentCache(2, 10, 4, 2)).fill_(NAN)
    cache.update(torch.ones(2, 8, 4), torch.ones(2, 8, 2))
    before = cache.kv.clone()
    pages_free = cache.allocator.num_free if paged else None
    with pytest.raises(ValueError, match="max_seq_len=10"):
        cache.update(torch.zeros(2, 3, 4), torch.zeros(2, 3, 2))
    assert torch.equal(cache.kv.isnan(), before.isnan()) and torch.equal(cache.kv.nan_to_num(), before.nan_to_num())
    assert cache.seq_lens.tolist() == [8, 8] and len(cache) == 8
    if paged:
        assert cache.allocator.num_free == pages_free
    cache.update(torch.zeros(2, 2, 4), torch.zeros(2, 2, 2))  # exactly full is fine
    assert len(cache) == 10


def test_layer_overfill_raises_and_leaves_cache_alone():
    layer = _mla()
    cache = layer.new_cache(2, 6)
    with torch.no_grad():
        layer(torch.randn(2, 4, 32), cache=cache)
        snapshot = cache.kv.clone()
        with pytest.raises(ValueError, match="max_seq_len"):
            layer(torch.randn(2, 3, 32), cache=cache)
    assert torch.equal(cache.kv, snapshot) and cache.seq_lens.tolist() == [4, 4]


def test_shared_page_pool_runs_out_cleanly():
    cache = PagedKVCache(2, 16, 1, 4, page_size=4, num_pages=5, shuffle_seed=7)
    cache.update(torch.ones(2, 1, 6, 4), torch.ones(2, 1, 6, 4))  # 2 pages each, 1 left
    with pytest.raises(ValueError, match="page pool exhausted"):
        cache.update(torch.ones(2, 1, 4, 4), torch.ones(2, 1, 4, 4))  # needs 1 + 1
    assert cache.allocator.num_free == 1 and cache.seq_lens.tolist() == [6, 6]
    cache.free(0)
    assert cache.allocator.num_free == 3 and cache.host_seq_lens == [0, 6]
    cache.update(torch.ones(2, 1, 4, 4), torch.ones(2, 1, 4, 4))  # seq 0: 1 page, seq 1: 1 more
    assert cache.allocator.num_free == 1 and cache.seq_lens.tolist() == [4, 10]


def test_block_tables_are_shuffled_and_pages_distinct():
    cache = PagedKVCache(3, 20, 1, 2, page_size=4, shuffle_seed=0)
    cache.update(torch.randn(3, 1, 17, 2), torch.randn(3, 1, 17, 2))
    table = cache.block_table[:, :5]
    assert table.unique().numel() == 15
    assert not torch.equal(table.flatten(), torch.arange(15, dtype=torch.int32))
    # Token j of sequence b sits at row j % P of page table[b, j // P].
    k, _ = cache.gather(17)
    for b in range(3):
        for j in (0, 3, 4, 16):
            assert torch.equal(k[b, :, j], cache.k[table[b, j // 4], j % 4])


def test_allocator():
    a = BlockAllocator(4)
    p = a.allocate(3)
    assert sorted(p) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(ValueError, match="exhausted"):
        a.allocate(2)
    assert a.num_free == 1
    a.free(p[:2])
    assert a.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        a.free([p[0]])
    with pytest.raises(ValueError, match="num_pages"):
        BlockAllocator(0)


def test_contiguous_free_and_positions():
    c = KVCache(2, 8, 1, 2)
    c.update(torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2))
    assert c.positions(2).tolist() == [[3, 4], [3, 4]]
    c.free(1)
    assert c.positions(1).tolist() == [[3], [0]] and len(c) == 3 and not c.is_empty()
    c.reset()
    assert c.is_empty() and len(c) == 0 and bool(c)  # truthy even when empty


def test_cache_write_checks_shapes_and_dtype():
    c = KVCache(2, 8, 2, 4)
    with pytest.raises(ValueError, match=r"k must be \[2, 2, T, 4\]"):
        c.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    with pytest.raises(ValueError, match="dtype"):
        c.update(torch.randn(2, 2, 1, 4, dtype=torch.float64), torch.randn(2, 2, 1, 4, dtype=torch.float64))
    lc = LatentCache(2, 8, 4, 2)
    with pytest.raises(ValueError, match="k_rope must be"):
        lc.update(torch.randn(2, 1, 4), None)
    with pytest.raises(ValueError, match="latent must be"):
        lc.update(torch.randn(2, 1, 5), torch.randn(2, 1, 2))
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(2, 0, 1, 1)
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(2, 8, 1, 1, page_size=0)

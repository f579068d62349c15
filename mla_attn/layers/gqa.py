"""Grouped-query attention (MHA / GQA / MQA) with Llama's rotate-half RoPE.

Parameter names follow Hugging Face ``LlamaAttention`` (``q_proj, k_proj, v_proj, o_proj``), so
``layer.load_state_dict(hf_attention.state_dict())`` reproduces that layer.

Paths, chosen from explicit state only:

* no cache: training path, ``ops.attention(causal=True)``, differentiable;
* empty cache (prefill): the new K/V are written, attention runs over them as in training;
* non-empty cache (decode, also several tokens at once = chunked prefill): the new K/V are written,
  then ``ops.decode_attention`` reads the whole cache (the new tokens causal among themselves).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import KVCache, PagedKVCache
from ..ops.rope import RotaryEmbedding
from ._common import check_cache, check_positions, check_x, default_positions
from .config import GQAConfig


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with ``num_attention_heads`` query heads sharing ``num_key_value_heads`` KV heads.

    Args:
        hidden_size: model width.
        num_attention_heads: Hq. num_key_value_heads: Hkv, must divide Hq.
        head_dim: per-head width (even); default ``hidden_size // num_attention_heads``.
        rope_theta, rope_scaling: rotary base and scaling dict (``llama3``, ``yarn``, ``linear``).
        attention_bias: biases on the four projections.
        impl: ``"auto" | "triton" | "reference"``, passed to every op.
        max_position_embeddings: only for rope scalings that derive a value from it.
        device, dtype: of the parameters.

    Call: ``y = layer(x, cache=None, positions=None)`` with x ``[B, T, hidden_size]``.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
                 head_dim: int | None = None,
                 rope_theta: float = 10000.0, rope_scaling: dict | None = None, attention_bias: bool = False,
                 impl: str = "auto", *, max_position_embeddings: int = 4096, device=None, dtype=None):
        super().__init__()
        cfg = GQAConfig(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                        num_key_value_heads=num_key_value_heads, head_dim=head_dim, rope_theta=rope_theta,
                        rope_scaling=rope_scaling, attention_bias=attention_bias,
                        max_position_embeddings=max_position_embeddings)
        if impl not in ("auto", "triton", "reference"):
            raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
        self.config = cfg
        self.impl = impl
        self.hidden_size = cfg.hidden_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = self.head_dim ** -0.5
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, self.num_heads * self.head_dim, bias=attention_bias, **kw)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=attention_bias, **kw)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=attention_bias, **kw)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden_size, bias=attention_bias, **kw)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=False,
                                          max_position_embeddings=cfg.max_position_embeddings, device=device)

    @classmethod
    def from_config(cls, config, impl: str = "auto", *, device=None, dtype=None) -> "GroupedQueryAttention":
        """From a :class:`GQAConfig`, a transformers Llama config, a config.json dict, or a path to one."""
        cfg = config if isinstance(config, GQAConfig) else GQAConfig.from_hf(config)
        # By name: the MHA / MQA presets inherit this and take head_dim third.
        return cls(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                   num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                   rope_scaling=cfg.rope_scaling, attention_bias=cfg.attention_bias, impl=impl,
                   max_position_embeddings=cfg.max_position_embeddings, device=device, dtype=dtype)

    def new_cache(self, batch_size: int, max_seq_len: int, page_size: int | None = None, dtype=None, device=None, *,
                  num_pages: int | None = None, shuffle_seed: int | None = None) -> KVCache | PagedKVCache:
        """A cache for this layer: contiguous, or paged when ``page_size`` is given.

        dtype / device default to the layer's parameters'. ``num_pages`` / ``shuffle_seed``: see
        :class:`~mla_attn.cache.PagedKVCache`.
        """
        w = self.q_proj.weight
        dtype = w.dtype if dtype is None else dtype
        device = w.device if device is None else device
        if page_size is None:
            if num_pages is not None:
                raise ValueError(f"num_pages={num_pages} needs page_size (a paged cache)")
            return KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim, dtype=dtype, device=device)
        return PagedKVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim, page_size=page_size,
                            num_pages=num_pages, dtype=dtype, device=device, shuffle_seed=shuffle_seed)

    def forward(self, x: torch.Tensor, cache: KVCache | PagedKVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``.

        ``positions`` int ``[B, T]``: rotary positions; default continues from the cache's fill
        (``0..T-1`` without a cache). They move RoPE only: cache slots always follow the fill.
        """
        b, t = check_x(x, self.hidden_size, self.q_proj.weight)
        if cache is not None:
            check_cache(cache, b, x, (KVCache, PagedKVCache), type(self).__name__)
            cache.check_room(t)  # before any work; the write re-checks
        if positions is None:
            positions = default_positions(cache, b, t, x.device)
        else:
            check_positions(positions, b, t)

        if t == 0:  # nothing to attend from; the cache is unchanged
            return self.o_proj(x.new_zeros(b, 0, self.num_heads * self.head_dim))
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary_emb(positions.to(x.device))  # [B, T, D/2] float32
        cos, sin = cos[:, :, None], sin[:, :, None]
        q = self.rotary_emb.rotate(q, cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = self.rotary_emb.rotate(k, cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.transpose(1, 2)  # [B, Hkv, T, D]

        if cache is None:
            o = ops.attention(q, k, v, causal=True, scale=self.scaling, impl=self.impl)
        elif cache.is_empty():  # prefill
            cache.update(k, v)
            o = ops.attention(q, k, v, causal=True, scale=self.scaling, impl=self.impl)
        else:  # decode: T new tokens against everything cached
            cache.update(k, v)
            o = ops.decode_attention(q, cache.k, cache.v, cache.seq_lens, block_table=cache.block_table,
                                     scale=self.scaling, impl=self.impl)
        o = o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # [B, T, Hq * D]
        return self.o_proj(o)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_attention_heads={self.num_heads}, "
                f"num_key_value_heads={self.num_kv_heads}, head_dim={self.head_dim}, impl={self.impl!r}")


def _check_preset(name: str, given: int | None, fixed: int, hidden_size: int, num_heads: int,
                  head_dim: int | None) -> None:
    if given is not None and given != fixed:
        raise ValueError(f"{name} fixes num_key_value_heads={fixed}, got num_key_value_heads={given}")
    # The presets take head_dim third. A GroupedQueryAttention-style call, MultiHeadAttention(512, 8, 8) or
    # MultiQueryAttention(512, 8, 1), would pass the KV head count there: refuse what can only be that.
    if head_dim is not None and head_dim == fixed and num_heads > 0 and head_dim != hidden_size // num_heads:
        raise ValueError(
            f"{name}(hidden_size={hidden_size}, num_attention_heads={num_heads}, head_dim={head_dim}): head_dim "
            f"equals the preset's KV head count ({fixed}) and not hidden_size // num_attention_heads "
            f"({hidden_size // num_heads}); the presets take head_dim third, not num_key_value_heads. If a head "
            f"width of {head_dim} is meant, use GroupedQueryAttention({hidden_size}, {num_heads}, {fixed}, "
            f"head_dim={head_dim})")


class MultiHeadAttention(GroupedQueryAttention):
    """:class:`GroupedQueryAttention` with one KV head per query head."""

    def __init__(self, hidden_size: int, num_attention_heads: int, head_dim: int | None = None,
                 rope_theta: float = 10000.0, rope_scaling: dict | None = None, attention_bias: bool = False,
                 impl: str = "auto", *, num_key_value_heads: int | None = None, **kwargs):
        _check_preset("MultiHeadAttention", num_key_value_heads, num_attention_heads, hidden_size,
                      num_attention_heads, head_dim)
        super().__init__(hidden_size, num_attention_heads, num_attention_heads, head_dim, rope_theta, rope_scaling,
                         attention_bias, impl, **kwargs)


class MultiQueryAttention(GroupedQueryAttention):
    """:class:`GroupedQueryAttention` with a single KV head."""

    def __init__(self, hidden_size: int, num_attention_heads: int, head_dim: int | None = None,
                 rope_theta: float = 10000.0, rope_scaling: dict | None = None, attention_bias: bool = False,
                 impl: str = "auto", *, num_key_value_heads: int | None = None, **kwargs):
        _check_preset("MultiQueryAttention", num_key_value_heads, 1, hidden_size, num_attention_heads, head_dim)
        super().__init__(hidden_size, num_attention_heads, 1, head_dim, rope_theta, rope_scaling, attention_bias,
                         impl, **kwargs)

"""KV caches for grouped-query attention (MHA / GQA / MQA): contiguous and paged.

Layouts are the ones :func:`mla_attn.ops.decode_attention` reads:

* :class:`KVCache`: ``k [B, Hkv, max_seq_len, D]``, ``v [B, Hkv, max_seq_len, Dv]``.
* :class:`PagedKVCache`: ``k [num_pages, P, Hkv, D]``, ``v [num_pages, P, Hkv, Dv]`` with a block
  table int32 ``[B, ceil(max_seq_len / P)]``; pages come from one :class:`BlockAllocator`.

Both hold detached values (inference state, not part of any autograd graph).
"""

from __future__ import annotations

import torch

from .base import _ContiguousSlots, _PagedSlots


def _check_kv(cache, k: torch.Tensor, v: torch.Tensor) -> int:
    want_k = (cache.batch_size, cache.num_kv_heads, None, cache.head_dim)
    want_v = (cache.batch_size, cache.num_kv_heads, None, cache.v_head_dim)
    for name, t, want in (("k", k, want_k), ("v", v, want_v)):
        if t.dim() != 4 or t.shape[0] != want[0] or t.shape[1] != want[1] or t.shape[3] != want[3]:
            shape = f"[{want[0]}, {want[1]}, T, {want[3]}]"
            raise ValueError(f"{name} must be {shape} (B, Hkv, T, D) for this cache, got {tuple(t.shape)}")
        if t.dtype != cache.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but the cache holds {cache.dtype}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must carry the same number of tokens: k {tuple(k.shape)}, v {tuple(v.shape)}")
    return k.shape[2]


class KVCache(_ContiguousSlots):
    """Contiguous per-sequence KV cache.

    Args:
        batch_size, max_seq_len: B and N.
        num_kv_heads, head_dim: Hkv and D; ``v_head_dim`` defaults to ``head_dim``.
        dtype, device: of the buffers.
    """

    def __init__(self, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype=torch.float32, device=None):
        super().__init__(batch_size, max_seq_len, device=device)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.register_buffer("k", torch.zeros(batch_size, num_kv_heads, max_seq_len, head_dim, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("v", torch.zeros(batch_size, num_kv_heads, max_seq_len, self.v_head_dim, dtype=dtype,
                                              device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens per sequence: k ``[B, Hkv, T, D]``, v ``[B, Hkv, T, Dv]``.

        Raises ValueError, writing nothing, when a sequence would exceed ``max_seq_len``.
        """
        t = _check_kv(self, k, v)
        b, pos = self.reserve(t)  # [B, 1], [B, T]
        # Advanced indices around a slice put their dims first: the target is [B, T, Hkv, D].
        self.k[b, :, pos] = k.detach().transpose(1, 2)
        self.v[b, :, pos] = v.detach().transpose(1, 2)
        self.commit(t)

    def gather(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of every sequence: ``[B, Hkv, length, D]`` and ``[B, Hkv, length, Dv]``."""
        return self.k[:, :, :length], self.v[:, :, :length]

    def fill_(self, value: float) -> "KVCache":
        """Fill the storage (tests poison unused slots with NaN)."""
        self.k.fill_(value)
        self.v.fill_(value)
        return self

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, dtype={self.dtype}")


class PagedKVCache(_PagedSlots):
    """Paged KV cache: one pool of pages, a block table per sequence.

    Args:
        batch_size, max_seq_len: sequences and the most tokens one may hold.
        num_kv_heads, head_dim, v_head_dim: as :class:`KVCache`.
        page_size: P, tokens per page.
        num_pages: pool size; default ``batch_size * ceil(max_seq_len / P)`` (every sequence can
            fill up). A smaller pool is shared first come, first served; running out raises
            ValueError before anything is written.
        shuffle_seed: scramble the allocator's page order (tests).
    """

    def __init__(self, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int | None = None, *, page_size: int = 16, num_pages: int | None = None,
                 dtype=torch.float32, device=None, shuffle_seed: int | None = None):
        super().__init__(batch_size, max_seq_len, page_size, num_pages, device=device, shuffle_seed=shuffle_seed)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.register_buffer("k", torch.zeros(self.num_pages, page_size, num_kv_heads, head_dim, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("v", torch.zeros(self.num_pages, page_size, num_kv_heads, self.v_head_dim, dtype=dtype,
                                              device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens per sequence (k ``[B, Hkv, T, D]``, v ``[B, Hkv, T, Dv]``), allocating pages."""
        t = _check_kv(self, k, v)
        page, row = self.reserve(t)  # [B, T] each
        self.k[page, row] = k.detach().transpose(1, 2)  # [B, T, Hkv, D]
        self.v[page, row] = v.detach().transpose(1, 2)
        self.commit(t)

    def gather(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of every sequence as contiguous ``[B, Hkv, length, D]`` / ``Dv``."""
        k = self.gather_pages(self.k, length).transpose(1, 2)
        v = self.gather_pages(self.v, length).transpose(1, 2)
        return k, v

    def fill_(self, value: float) -> "PagedKVCache":
        self.k.fill_(value)
        self.v.fill_(value)
        return self

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, page_size={self.page_size}, "
                f"num_pages={self.num_pages}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, dtype={self.dtype}")

"""Latent caches for multi-head latent attention (MLA): contiguous and paged.

Per token and layer the cache holds exactly ``Dc + Dr`` values: the normalized latent ``c``
(kv_a_layernorm output, ``kv_lora_rank`` wide) and the rotated rope key ``k_rope``
(``qk_rope_head_dim`` wide, in the layout :mod:`mla_attn.ops.rope` returns). They share one buffer:

* :class:`LatentCache`: ``kv [B, max_seq_len, Dc + Dr]``; views ``kv_latent [B, N, Dc]``, ``k_rope [B, N, Dr]``.
* :class:`PagedLatentCache`: ``kv [num_pages, P, Dc + Dr]``; views ``[num_pages, P, Dc]`` / ``[num_pages, P, Dr]``.

The views are what :func:`mla_attn.ops.mla_decode` reads. Values are detached (inference state).
"""

from __future__ import annotations

import torch

from .base import _ContiguousSlots, _PagedSlots


class _LatentMixin:
    kv: torch.Tensor
    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def kv_latent(self) -> torch.Tensor:
        """``[..., Dc]`` view of the buffer (the normalized latents)."""
        return self.kv[..., : self.kv_lora_rank]

    @property
    def k_rope(self) -> torch.Tensor | None:
        """``[..., Dr]`` view of the buffer (the rotated rope keys); None when Dr = 0."""
        return self.kv[..., self.kv_lora_rank:] if self.qk_rope_head_dim else None

    def _check_latent(self, latent: torch.Tensor, k_rope: torch.Tensor | None) -> int:
        b, dc, dr = self.batch_size, self.kv_lora_rank, self.qk_rope_head_dim
        if latent.dim() != 3 or latent.shape[0] != b or latent.shape[2] != dc:
            raise ValueError(f"latent must be [{b}, T, {dc}] (B, T, kv_lora_rank) for this cache, "
                             f"got {tuple(latent.shape)}")
        if dr == 0:
            if k_rope is not None and k_rope.numel() != 0:
                raise ValueError(f"k_rope must be None for a cache with qk_rope_head_dim=0, got {tuple(k_rope.shape)}")
        elif k_rope is None or k_rope.shape != (b, latent.shape[1], dr):
            got = None if k_rope is None else tuple(k_rope.shape)
            raise ValueError(f"k_rope must be [{b}, {latent.shape[1]}, {dr}] (B, T, qk_rope_head_dim), got {got}")
        for name, t in (("latent", latent), ("k_rope", k_rope)):
            if t is not None and t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the cache holds {self.dtype}")
        return latent.shape[1]

    def fill_(self, value: float):
        """Fill the storage (tests poison unused slots with NaN)."""
        self.kv.fill_(value)
        return self

    def values_per_token(self) -> int:
        """Values stored per token: ``Dc + Dr``."""
        return self.kv.shape[-1]


class LatentCache(_LatentMixin, _ContiguousSlots):
    """Contiguous MLA cache ``[B, max_seq_len, Dc + Dr]``.

    Args:
        batch_size, max_seq_len: B and N.
        kv_lora_rank: Dc. qk_rope_head_dim: Dr (may be 0).
        dtype, device: of the buffer.
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_lora_rank: int, qk_rope_head_dim: int, *,
                 dtype=torch.float32, device=None):
        super().__init__(batch_size, max_seq_len, device=device)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.register_buffer("kv", torch.zeros(batch_size, max_seq_len, kv_lora_rank + qk_rope_head_dim, dtype=dtype,
                                               device=device), persistent=False)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor | None) -> None:
        """Append T tokens per sequence: latent ``[B, T, Dc]``, k_rope ``[B, T, Dr]`` (None when Dr = 0).

        Raises ValueError, writing nothing, when a sequence would exceed ``max_seq_len``.
        """
        t = self._check_latent(latent, k_rope)
        b, pos = self.reserve(t)  # [B, 1], [B, T]
        self.kv[b, pos, : self.kv_lora_rank] = latent.detach()
        if self.qk_rope_head_dim:
            self.kv[b, pos, self.kv_lora_rank:] = k_rope.detach()
        self.commit(t)

    def gather(self, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``length`` tokens: latent ``[B, length, Dc]`` and k_rope ``[B, length, Dr]`` (or None)."""
        kv = self.kv[:, :length]
        return kv[..., : self.kv_lora_rank], (kv[..., self.kv_lora_rank:] if self.qk_rope_head_dim else None)

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, dtype={self.dtype}")


class PagedLatentCache(_LatentMixin, _PagedSlots):
    """Paged MLA cache ``[num_pages, P, Dc + Dr]`` with a block table per sequence.

    Args as :class:`LatentCache`, plus ``page_size``, ``num_pages`` and ``shuffle_seed`` as
    :class:`~mla_attn.cache.PagedKVCache`.
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_lora_rank: int, qk_rope_head_dim: int, *,
                 page_size: int = 64, num_pages: int | None = None, dtype=torch.float32, device=None,
                 shuffle_seed: int | None = None):
        super().__init__(batch_size, max_seq_len, page_size, num_pages, device=device, shuffle_seed=shuffle_seed)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.register_buffer("kv", torch.zeros(self.num_pages, page_size, kv_lora_rank + qk_rope_head_dim,
                                               dtype=dtype, device=device), persistent=False)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor | None) -> None:
        """Append T tokens per sequence (latent ``[B, T, Dc]``, k_rope ``[B, T, Dr]``), allocating pages."""
        t = self._check_latent(latent, k_rope)
        page, row = self.reserve(t)  # [B, T] each
        self.kv[page, row, : self.kv_lora_rank] = latent.detach()
        if self.qk_rope_head_dim:
            self.kv[page, row, self.kv_lora_rank:] = k_rope.detach()
        self.commit(t)

    def gather(self, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``length`` tokens as contiguous latent ``[B, length, Dc]`` and k_rope ``[B, length, Dr]``."""
        kv = self.gather_pages(self.kv, length)
        return kv[..., : self.kv_lora_rank], (kv[..., self.kv_lora_rank:] if self.qk_rope_head_dim else None)

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, page_size={self.page_size}, "
                f"num_pages={self.num_pages}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, dtype={self.dtype}")

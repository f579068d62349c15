"""Shared bookkeeping of the caches: per-sequence lengths, capacity checks, contiguous and paged slots.

Every cache keeps its fill twice: ``seq_lens`` (int32 ``[B]``, a non-persistent buffer on the cache's
device, what the decode ops read) and a host mirror (a list of Python ints) that the capacity and
page checks read, so no check costs a device-to-host sync: a decode step that needs no new page does
no host-device traffic at all (the device side is capturable in a CUDA graph; the host side runs
eagerly under torch.compile). Only the cache's own methods change the fill; both copies move together.

A write of T new tokens per sequence is two steps, so nothing is written when a check fails:
``slots = cache.reserve(T)`` (checks, allocates pages, returns where the tokens go, changes no
fill), the caller (the concrete cache) copies the data, then ``cache.commit(T)``.
"""

from __future__ import annotations

import math
import random

import torch
from torch import nn


# Host-side bookkeeping runs eagerly even inside torch.compile: it reads and writes Python state only
# (plus, for pages, a small host-to-device copy of new block-table entries), never the device.
_eager = torch.compiler.disable


class _SequenceCache(nn.Module):
    """Per-sequence fill, shared by the contiguous and the paged caches."""

    def __init__(self, batch_size: int, max_seq_len: int, device=None):
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.register_buffer("_seq_lens", torch.zeros(batch_size, dtype=torch.int32, device=device), persistent=False)
        self._host_lens = [0] * batch_size  # host mirror of _seq_lens

    # -- fill -------------------------------------------------------------------------------------
    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[B]`` on the cache's device: valid tokens of each sequence (do not write to it)."""
        return self._seq_lens

    @property
    def host_seq_lens(self) -> list[int]:
        """The fill of each sequence as Python ints (from the host mirror: no device sync)."""
        return list(self._host_lens)

    def __len__(self) -> int:
        """Tokens held by the longest sequence (all sequences advance together in the layers)."""
        return max(self._host_lens)

    def __bool__(self) -> bool:
        # An empty cache is still a cache: `if cache:` must not behave like `if cache is not None` inverted.
        return True

    @_eager
    def is_empty(self) -> bool:
        return all(n == 0 for n in self._host_lens)

    @_eager
    def uniform_len(self) -> int | None:
        """The common fill when every sequence holds the same number of tokens, else None."""
        first = self._host_lens[0]
        return first if all(n == first for n in self._host_lens) else None

    def positions(self, num_new: int) -> torch.Tensor:
        """int64 ``[B, num_new]`` positions the next ``num_new`` tokens take: seq_lens[b] + t."""
        t = torch.arange(num_new, device=self._seq_lens.device, dtype=torch.int64)
        return self._seq_lens.to(torch.int64)[:, None] + t

    # -- writes -----------------------------------------------------------------------------------
    @_eager
    def check_room(self, num_new: int) -> None:
        """Raise ValueError when some sequence cannot take ``num_new`` more tokens."""
        if not isinstance(num_new, int) or num_new < 0:
            raise ValueError(f"num_new must be a non-negative int, got {num_new!r}")
        worst = max(range(self.batch_size), key=lambda b: self._host_lens[b])
        if self._host_lens[worst] + num_new > self.max_seq_len:
            raise ValueError(
                f"cache overflow: sequence {worst} holds {self._host_lens[worst]} tokens, writing {num_new} more "
                f"needs {self._host_lens[worst] + num_new} > max_seq_len={self.max_seq_len}; nothing was written")

    @_eager
    def _commit_host(self, num_new: int) -> None:
        self._host_lens = [n + num_new for n in self._host_lens]

    def commit(self, num_new: int) -> None:
        """Advance every sequence's fill by ``num_new`` (after the data is written)."""
        self._commit_host(num_new)
        self._seq_lens += num_new

    def reset(self) -> None:
        """Empty every sequence (buffers keep their stale contents; lengths bound what is read)."""
        self._host_lens = [0] * self.batch_size
        self._seq_lens.zero_()

    def free(self, batch_index: int) -> None:
        """Empty sequence ``batch_index`` only (its slot can take a new sequence)."""
        if not isinstance(batch_index, int) or not 0 <= batch_index < self.batch_size:
            raise ValueError(f"batch_index must be an int in [0, {self.batch_size}), got {batch_index!r}")
        self._host_lens[batch_index] = 0
        self._seq_lens[batch_index] = 0


class _ContiguousSlots(_SequenceCache):
    """Sequence b owns rows ``[b, 0:max_seq_len]`` of the buffers."""

    page_size = None
    block_table = None

    def reserve(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Check room for ``num_new`` more tokens per sequence; return (batch index ``[B, 1]``, position ``[B, T]``)."""
        self.check_room(num_new)
        b = torch.arange(self.batch_size, device=self._seq_lens.device)[:, None]
        return b, self.positions(num_new)


class BlockAllocator:
    """Hands out pages of one pool: a free list of page ids ``0..num_pages-1``.

    ``allocate(n)`` returns n page ids or raises ValueError (taking none) when fewer are free;
    ``free(pages)`` returns them. ``shuffle_seed`` scrambles the initial order (tests use it so block
    tables are not the identity).
    """

    def __init__(self, num_pages: int, *, shuffle_seed: int | None = None):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._shuffle_seed = shuffle_seed
        self.reset()

    def reset(self) -> None:
        free = list(range(self.num_pages))
        if self._shuffle_seed is not None:
            random.Random(self._shuffle_seed).shuffle(free)
        free.reverse()  # pop() from the end hands out the list's first element first
        self._free = free
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"page pool exhausted: asked for {n} pages, {len(self._free)} of "
                             f"{self.num_pages} are free; nothing was allocated")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages) -> None:
        pages = [int(p) for p in pages]
        bad = [p for p in pages if p not in self._used]
        if bad:
            raise ValueError(f"free: pages {bad} are not allocated")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)


class _PagedSlots(_SequenceCache):
    """Sequence b's token j lives at page ``block_table[b, j // P]``, row ``j % P`` of the pool.

    The block table is int32 ``[B, ceil(max_seq_len / P)]`` (a non-persistent buffer, mirrored on the
    host); entries past a sequence's last page hold 0 and are never read by the decode ops.
    """

    def __init__(self, batch_size: int, max_seq_len: int, page_size: int, num_pages: int | None = None, *,
                 device=None, shuffle_seed: int | None = None):
        super().__init__(batch_size, max_seq_len, device=device)
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.max_pages_per_seq = math.ceil(max_seq_len / page_size)
        if num_pages is None:
            num_pages = batch_size * self.max_pages_per_seq
        self.num_pages = num_pages
        self.allocator = BlockAllocator(num_pages, shuffle_seed=shuffle_seed)
        self.register_buffer("_block_table", torch.zeros(batch_size, self.max_pages_per_seq, dtype=torch.int32,
                                                         device=device), persistent=False)
        self._host_pages: list[list[int]] = [[] for _ in range(batch_size)]

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``[B, max_pages_per_seq]`` on the cache's device."""
        return self._block_table

    def reserve(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Check room, allocate the pages the next ``num_new`` tokens need (all or none), return
        (page id ``[B, T]``, row in page ``[B, T]``)."""
        self._allocate(num_new)
        pos = self.positions(num_new)  # [B, T]
        page = torch.gather(self._block_table, 1, pos // self.page_size).to(torch.int64)  # [B, T]
        return page, pos % self.page_size

    @_eager
    def _allocate(self, num_new: int) -> None:
        """Check room and give every sequence the pages its next ``num_new`` tokens need (all or none)."""
        self.check_room(num_new)
        p = self.page_size
        want = [max(0, math.ceil((n + num_new) / p) - len(pages)) for n, pages in zip(self._host_lens, self._host_pages)]
        if sum(want) > self.allocator.num_free:
            raise ValueError(f"page pool exhausted: writing {num_new} tokens per sequence needs {sum(want)} new "
                             f"pages of {p} tokens, {self.allocator.num_free} of {self.num_pages} are free; "
                             "nothing was written")
        for b, n_new in enumerate(want):
            if n_new:
                first = len(self._host_pages[b])
                new = self.allocator.allocate(n_new)
                self._host_pages[b].extend(new)
                self._block_table[b, first:first + n_new] = torch.tensor(new, dtype=torch.int32)

    def free(self, batch_index: int) -> None:
        """Return sequence ``batch_index``'s pages to the pool and empty it."""
        super().free(batch_index)
        self.allocator.free(self._host_pages[batch_index])
        self._host_pages[batch_index] = []
        self._block_table[batch_index].zero_()

    def reset(self) -> None:
        """Empty every sequence and return all pages."""
        super().reset()
        self.allocator.reset()
        self._host_pages = [[] for _ in range(self.batch_size)]
        self._block_table.zero_()

    def gather_pages(self, pool: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` tokens of every sequence from a ``[num_pages, P, ...]`` pool as ``[B, length, ...]``."""
        n_pages = math.ceil(length / self.page_size)
        pages = self._block_table[:, :n_pages].to(torch.int64)  # [B, n_pages]
        out = pool[pages]  # [B, n_pages, P, ...]
        return out.flatten(1, 2)[:, :length]

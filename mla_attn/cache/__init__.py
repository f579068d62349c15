"""KV caches: contiguous and paged for GQA, latent (Dc + Dr per token) for MLA.

All are small ``nn.Module``s with non-persistent buffers and an int32 ``seq_lens`` tensor; ``len(cache)``
is the longest sequence's fill, ``cache.reset()`` empties them, and writing more tokens than a
sequence can hold raises ValueError before anything is written.
"""

from .base import BlockAllocator
from .kv import KVCache, PagedKVCache
from .latent import LatentCache, PagedLatentCache

__all__ = ["BlockAllocator", "KVCache", "PagedKVCache", "LatentCache", "PagedLatentCache"]

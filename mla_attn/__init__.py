"""mla_attn: MHA / GQA / MQA and DeepSeek-style multi-head latent attention for PyTorch.

Functional ops are imported eagerly; the layers and checkpoint tools load on first use.
"""

from __future__ import annotations

import importlib

from .ops import attention, decode_attention, merge_attention_states, mla_decode

__version__ = "0.1.0"

_LAZY = {
    "GroupedQueryAttention": "mla_attn.layers",
    "MultiHeadAttention": "mla_attn.layers",
    "MultiQueryAttention": "mla_attn.layers",
    "MultiHeadLatentAttention": "mla_attn.layers",
    "MLAConfig": "mla_attn.layers",
    "GQAConfig": "mla_attn.layers",
    "KVCache": "mla_attn.cache",
    "PagedKVCache": "mla_attn.cache",
    "LatentCache": "mla_attn.cache",
    "PagedLatentCache": "mla_attn.cache",
    "BlockAllocator": "mla_attn.cache",
    "RotaryEmbedding": "mla_attn.ops.rope",
    "absorb_mla_weights": "mla_attn.convert",
    "load_checkpoint": "mla_attn.convert",
    "convert_checkpoint": "mla_attn.convert",
}

__all__ = ["attention", "decode_attention", "mla_decode", "merge_attention_states", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mla_attn' has no attribute {name!r}")

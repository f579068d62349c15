"""Attention layers (nn.Modules): they call the functional ops in :mod:`mla_attn.ops`, never the reverse."""

from .config import GQAConfig, MLAConfig
from .graph import DecodeGraph
from .gqa import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention
from .mla import MultiHeadLatentAttention, RMSNorm

__all__ = [
    "DecodeGraph",
    "GQAConfig",
    "MLAConfig",
    "GroupedQueryAttention",
    "MultiHeadAttention",
    "MultiQueryAttention",
    "MultiHeadLatentAttention",
    "RMSNorm",
]

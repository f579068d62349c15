"""Functional attention ops: tensors in, tensors out."""

from .attention import attention
from .decode import decode_attention, merge_attention_states, mla_decode

__all__ = ["attention", "decode_attention", "mla_decode", "merge_attention_states"]

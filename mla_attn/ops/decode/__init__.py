from .api import decode_attention, merge_attention_states, mla_decode

__all__ = ["decode_attention", "mla_decode", "merge_attention_states"]

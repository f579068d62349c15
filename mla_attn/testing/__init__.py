"""Test and benchmark support: the float64 oracle and input makers (not part of the fast path)."""

from .inputs import SENTINEL_PAGE, assert_close, assert_lse_close, dtype_floor, poison_tail, rel_err, to_paged
from .oracle import attention_oracle, decode_oracle, merge_oracle, mla_decode_oracle

__all__ = ["attention_oracle", "decode_oracle", "mla_decode_oracle", "merge_oracle", "to_paged", "poison_tail",
           "rel_err", "assert_close", "assert_lse_close", "dtype_floor", "SENTINEL_PAGE"]

"""Test and benchmark support: the float64 oracle and input makers (not part of the fast path)."""

from .inputs import SENTINEL_PAGE, assert_close, assert_lse_close, dtype_floor, poison_tail, rel_err, to_paged
from .oracle import attention_oracle, decode_oracle, merge_oracle, mla_decode_oracle

__all__ = ["gluon_gpu", "attention_oracle", "decode_oracle", "mla_decode_oracle", "merge_oracle", "to_paged", "poison_tail",
           "rel_err", "assert_close", "assert_lse_close", "dtype_floor", "SENTINEL_PAGE"]


def gluon_gpu() -> bool:
    """A Hopper GPU, and a Triton the Gluon kernels have run with (``mla_attn/ops/_gluon_compat.py``); else
    nothing routes to them and their GPU tests skip."""
    import torch

    try:
        from ..ops._gluon_compat import VERSION_OK
    except ImportError:
        return False
    return VERSION_OK and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

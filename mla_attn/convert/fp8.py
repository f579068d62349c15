"""Block-wise FP8 weights as DeepSeek-V3 / Kimi-K2 store them, and their dequantization.

A quantized linear weight ``W`` of shape ``[M, N]`` is stored as

* ``<name>.weight``            ``float8_e4m3fn`` ``[M, N]``
* ``<name>.weight_scale_inv``  ``float32`` ``[ceil(M / bm), ceil(N / bn)]``

with ``(bm, bn) = quantization_config["weight_block_size"]`` (``[128, 128]`` for DeepSeek-V3).
Despite its name, ``weight_scale_inv`` is the factor that *multiplies* the stored values back:
``W[i, j] = float(Wq[i, j]) * scale_inv[i // bm, j // bn]``. The last block row / column may be
partial (DeepSeek-V3's ``kv_a_proj_with_mqa`` is 576 x 7168 and 576 = 4.5 blocks): it has a
scale of its own like every other block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "FP8_DTYPES",
    "SCALE_SUFFIX",
    "block_size_from_config",
    "dequantize_fp8_block",
    "is_fp8",
    "quantize_fp8_block",
    "scale_shape",
]

# The float8 formats a block-quantized checkpoint may hold. e4m3fn is what DeepSeek and Kimi ship.
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
# Sibling tensor holding the per-block scales of `<prefix>.weight`: `<prefix>.weight_scale_inv`.
SCALE_SUFFIX = "_scale_inv"
# The quantization methods whose tensors we know how to read.
KNOWN_QUANT_METHODS = ("fp8",)
DEFAULT_BLOCK_SIZE = (128, 128)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def scale_shape(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scale grid of a ``[M, N]`` weight: ``(ceil(M / bm), ceil(N / bn))``."""
    m, n = shape
    return (math.ceil(m / block_size[0]), math.ceil(n / block_size[1]))


def block_size_from_config(config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The ``(bm, bn)`` block of a config.json's ``quantization_config``; None when unquantized.

    Raises ValueError for a quantization method this module cannot read (the caller adds the
    file name), or a malformed block size.
    """
    qc = (config or {}).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"quantization_config must be a JSON object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in KNOWN_QUANT_METHODS:
        raise ValueError(
            f"unknown quantization_config.quant_method {method!r}: only {list(KNOWN_QUANT_METHODS)} "
            "(block-wise float8 with weight_scale_inv, as DeepSeek-V3 ships it) can be read"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"unknown quantization_config.fmt {fmt!r}: expected 'e4m3' or 'e5m2'")
    block = qc.get("weight_block_size", list(DEFAULT_BLOCK_SIZE))
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size must be two positive ints, got {block!r}"
        )
    return (int(block[0]), int(block[1]))


def _check_pair(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]):
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [M, N] tensor, got shape {tuple(weight.shape)}")
    want = scale_shape(tuple(weight.shape), block_size)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv: expected shape {list(want)} for a weight of shape "
            f"{list(weight.shape)} with blocks {list(block_size)}, got {list(scale_inv.shape)}"
        )


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype | None = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize a block-quantized FP8 weight.

    Args:
        weight: ``[M, N]`` float8 (``float8_e4m3fn`` or ``float8_e5m2``).
        scale_inv: ``[ceil(M / bm), ceil(N / bn)]`` (float32 in DeepSeek checkpoints; any float
            dtype is upcast).
        block_size: ``(bm, bn)``.
        dtype: output dtype; None keeps the float32 result.

    Returns:
        ``[M, N]`` tensor equal to ``float32(weight) * scale_inv`` broadcast over blocks, computed in
        float32 and cast once to ``dtype``. Partial edge blocks use their own scale.
    """
    if not is_fp8(weight.dtype):
        raise ValueError(f"weight: expected a float8 tensor, got dtype {weight.dtype}")
    _check_pair(weight, scale_inv, block_size)
    m, n = weight.shape
    bm, bn = block_size
    out_dtype = torch.float32 if dtype is None else dtype
    out = torch.empty((m, n), dtype=out_dtype, device=weight.device)
    s = scale_inv.to(torch.float32)
    # One block row at a time, so the float32 temporaries are [bm, N], not [M, N].
    for i in range(s.shape[0]):
        rows = slice(i * bm, min((i + 1) * bm, m))
        s_row = s[i].repeat_interleave(bn)[:n]  # [N]: each block's scale over its columns
        out[rows] = weight[rows].to(torch.float32) * s_row
    return out


def quantize_fp8_block(
    weight: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    fp8_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a ``[M, N]`` weight the way DeepSeek-V3 does (amax per block -> max of FP8).

    Used to build FP8 fixtures and to re-quantize. Returns ``(weight_fp8 [M, N],
    scale_inv [ceil(M/bm), ceil(N/bn)] float32)`` such that ``dequantize_fp8_block`` inverts it up
    to FP8 rounding (relative error <= 2**-4 for e4m3 normal values).
    """
    if fp8_dtype is None:
        fp8_dtype = torch.float8_e4m3fn
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [M, N] tensor, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    bm, bn = block_size
    gm, gn = scale_shape((m, n), block_size)
    w = weight.to(torch.float32)
    padded = w.new_zeros(gm * bm, gn * bn)
    padded[:m, :n] = w
    blocks = padded.view(gm, bm, gn, bn)
    amax = blocks.abs().amax(dim=(1, 3))  # [gm, gn]
    fmax = torch.finfo(fp8_dtype).max
    scale_inv = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))  # [gm, gn]
    q = (blocks / scale_inv[:, None, :, None]).clamp_(-fmax, fmax).to(fp8_dtype)
    q = q.view(gm * bm, gn * bn)[:m, :n].contiguous()
    return q, scale_inv.contiguous()

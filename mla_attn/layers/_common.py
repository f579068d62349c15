"""Checks shared by the attention layers."""

from __future__ import annotations

import torch


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


def check_x(x: torch.Tensor, hidden_size: int, weight: torch.Tensor | None = None) -> tuple[int, int]:
    """x must be ``[B, T, hidden_size]``, floating point, on the layer's device and (outside autocast,
    which casts per op) in the layer's dtype; ``weight`` is any parameter of the layer."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden_size:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [B, T, hidden_size] with hidden_size={hidden_size}, got {shape}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if weight is not None:
        if x.device != weight.device:
            raise ValueError(f"x {tuple(x.shape)} is on {x.device} but the layer's weights are on {weight.device}; "
                             "move one of them (layer.to(x.device))")
        if x.dtype != weight.dtype and not _autocast_on(x.device.type):
            raise ValueError(f"x {tuple(x.shape)} is {x.dtype} but the layer's weights are {weight.dtype}; cast one "
                             "of them (layer.to(x.dtype)) or run under torch.autocast")
    return x.shape[0], x.shape[1]


def check_positions(positions: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor) or positions.shape != (batch, tokens):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions must be an int tensor of shape [B, T] = [{batch}, {tokens}], got {shape}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must hold integers, got {positions.dtype}")
    return positions


def check_cache(cache, batch: int, x: torch.Tensor, kinds: tuple[type, ...], layer: str) -> None:
    if not isinstance(cache, kinds):
        names = ", ".join(k.__name__ for k in kinds)
        raise ValueError(f"cache must be one of {names} (from {layer}.new_cache), got {type(cache).__name__}")
    if cache.batch_size != batch:
        raise ValueError(f"cache was made for batch_size={cache.batch_size} but x has batch {batch} "
                         f"(x {tuple(x.shape)})")
    if cache.dtype != x.dtype:
        raise ValueError(f"cache holds {cache.dtype} but x is {x.dtype}; make the cache with dtype=x.dtype")


def default_positions(cache, batch: int, tokens: int, device) -> torch.Tensor:
    """Positions continuing from each sequence's fill (0.. without a cache)."""
    if cache is None:
        return torch.arange(tokens, device=device, dtype=torch.int64).expand(batch, tokens)
    return cache.positions(tokens)

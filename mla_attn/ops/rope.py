"""Rotary position embeddings: rotate-half (Llama), interleaved (DeepSeek), Llama-3 and YaRN scaling.

The numbers follow Hugging Face transformers' Llama / DeepSeek-V3 rotary code (inverse frequencies
computed in float32 the same way, angles ``position.float() * inv_freq``), written independently.

Layouts, for a rotary width ``d`` (even) and pair index ``i < d/2`` with angle ``a_i = pos * inv_freq[i]``:

* rotate-half (Llama, ``interleaved=False``): pair i is ``(x[i], x[i + d/2])``.
* interleaved (DeepSeek checkpoints, HF ``rope_interleave=True``): pair i is ``(x[2i], x[2i+1])``.

Both return the rotated pairs in the half-split layout ``[x1*cos - x2*sin, x2*cos + x1*sin]``, as
Hugging Face does: for interleaved inputs the output is a fixed permutation of the truly interleaved
rotation, applied to q and k alike, so every dot product q.k is unchanged. Caches store k in this
layout.

Scaling (``rope_scaling`` dict, Hugging Face names; ``type`` is accepted for ``rope_type``):

* ``"default"`` / None: ``inv_freq[i] = theta ** (-2i/d)``.
* ``"linear"``: inv_freq / factor.
* ``"llama3"``: ``factor, low_freq_factor, high_freq_factor, original_max_position_embeddings``.
* ``"yarn"``: ``factor, original_max_position_embeddings, beta_fast=32, beta_slow=1, mscale,
  mscale_all_dim, attention_factor, truncate=True``. cos/sin are multiplied by the attention factor
  ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`` (when both mscales
  are given; ``yarn_get_mscale(factor)`` otherwise). DeepSeek's MLA additionally multiplies its
  softmax scale by ``yarn_get_mscale(factor, mscale_all_dim) ** 2``: :func:`rope_softmax_scale_factor`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def normalize_rope_scaling(rope_scaling: Mapping[str, Any] | None,
                           max_position_embeddings: int | None = None) -> dict | None:
    """Validate a ``rope_scaling`` dict and bring it to one form (or None for plain RoPE).

    Accepts the legacy ``type`` key for ``rope_type`` and drops ``rope_theta`` (a separate argument
    here). For ``llama3`` / ``yarn`` a missing ``original_max_position_embeddings`` is taken from
    ``max_position_embeddings``, as transformers does. Raises ValueError naming ``rope_scaling``.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    rs = dict(rope_scaling)
    kind = rs.pop("rope_type", None)
    legacy = rs.pop("type", None)
    kind = kind or legacy or "default"
    rs.pop("rope_theta", None)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling['rope_type'] must be one of {ROPE_TYPES}, got {kind!r}")
    if kind == "default":
        return None
    prf = rs.pop("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise ValueError(f"rope_scaling['partial_rotary_factor'] other than 1.0 is not supported, got {prf!r}")
    if kind in ("llama3", "yarn") and rs.get("original_max_position_embeddings") is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling of type {kind!r} needs 'original_max_position_embeddings' "
                             f"(or max_position_embeddings), got {dict(rope_scaling)}")
        rs["original_max_position_embeddings"] = int(max_position_embeddings)
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ()}[kind]
    missing = [key for key in need if rs.get(key) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} is missing {missing}, got {dict(rope_scaling)}")
    if kind == "yarn" and rs.get("factor") is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling of type 'yarn' needs 'factor' (or max_position_embeddings), "
                             f"got {dict(rope_scaling)}")
        rs["factor"] = max_position_embeddings / rs["original_max_position_embeddings"]
    factor = rs["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"rope_scaling['factor'] must be a positive number, got {factor!r}")
    if kind == "llama3" and rs["high_freq_factor"] == rs["low_freq_factor"]:
        raise ValueError(f"rope_scaling: llama3 needs high_freq_factor != low_freq_factor, got {dict(rope_scaling)}")
    rs["rope_type"] = kind
    return rs


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    # float32 exactly as the reference implementations build it: theta ** (arange(0, d, 2) / d).
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta ** exponent)


def rope_inv_freq(dim: int, rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None,
                  max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for a rotary width ``dim`` and the factor cos/sin are multiplied by.

    Returns:
        ``(inv_freq, attention_factor)``: inv_freq float32 ``[dim // 2]`` on the CPU, and a float
        (1.0 except for YaRN).
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary dim must be a positive even number, got {dim}")
    if rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")
    rs = normalize_rope_scaling(rope_scaling, max_position_embeddings)
    inv_freq = _base_inv_freq(dim, rope_theta)
    if rs is None:
        return inv_freq, 1.0
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rs), 1.0
    return _yarn_inv_freq(dim, rope_theta, rs)


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: Mapping[str, Any]) -> torch.Tensor:
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band in
    # between blended linearly in 1/wavelength.
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, rs: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    factor = rs["factor"]
    old_len = rs["original_max_position_embeddings"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The pair index whose wavelength makes `num_rotations` turns over the original context.
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency, unchanged), 0: interpolate (divide by factor)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - keep) + inv_extra * keep
    return inv_freq, attention_factor


def rope_softmax_scale_factor(rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor DeepSeek's MLA multiplies its softmax scale by: ``yarn_get_mscale(factor, mscale_all_dim)**2``.

    1.0 without scaling or without ``mscale_all_dim`` (transformers applies it for any non-default
    rope type that sets ``mscale_all_dim``; so do we).
    """
    rs = normalize_rope_scaling(rope_scaling, None) if rope_scaling is not None else None
    if rs is None:
        return 1.0
    mscale_all_dim = rs.get("mscale_all_dim") or 0
    if not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(rs["factor"], mscale_all_dim)
    return m * m


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """cos and sin of the rotation angles, float32.

    Args:
        positions: integer ``[...]`` (e.g. ``[B, T]``).
        inv_freq: float32 ``[d/2]``.
        attention_factor: multiplies both (YaRN).

    Returns:
        ``(cos, sin)`` float32 ``[..., d/2]`` (half width: one angle per rotated pair).
    """
    angles = positions[..., None].to(torch.float32) * inv_freq.to(device=positions.device, dtype=torch.float32)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate the last dim of ``x`` by the angles whose cos/sin are given.

    Args:
        x: ``[..., d]`` any float dtype.
        cos, sin: float32 ``[..., d/2]`` broadcastable against ``x[..., :d/2]`` (e.g. ``[B, T, 1, d/2]``
            for x ``[B, T, H, d]``).
        interleaved: pairs ``(x[2i], x[2i+1])`` (DeepSeek) instead of ``(x[i], x[i+d/2])`` (Llama).

    Returns:
        ``[..., d]`` in x's dtype, in the half-split layout (see the module docstring). The rotation is
        computed in float32 and cast once.
    """
    d = x.shape[-1]
    if d % 2 or cos.shape[-1] != d // 2 or sin.shape[-1] != d // 2:
        raise ValueError(f"apply_rope: x's last dim must be even and twice cos/sin's, got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    xf = x.to(torch.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary embedding for one rotary width: holds ``inv_freq`` (non-persistent) and the YaRN factor.

    ``cos, sin = rope(positions)`` gives float32 ``[..., d/2]``; ``rope.rotate(x, cos, sin)`` applies them.
    ``rope.cos_sin_cache(n)`` returns ``[n, d/2]`` tables for kernels that index by position.
    """

    def __init__(self, dim: int, rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, *,
                 interleaved: bool = False, max_position_embeddings: int | None = None, device=None):
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(dim, rope_theta, rope_scaling, max_position_embeddings)
        self.dim = dim
        self.interleaved = interleaved
        self.attention_factor = float(attention_factor)
        self._inv_freq_fp32 = inv_freq  # CPU master copy: module.to(dtype) must not round the frequencies
        self.register_buffer("inv_freq", inv_freq.to(device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Keep float32 frequencies whatever dtype the surrounding model is cast to (devices do move).
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.attention_factor)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin, interleaved=self.interleaved)

    def cos_sin_cache(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[max_len, d/2]`` cos and sin tables for positions 0..max_len-1."""
        return rope_cos_sin(torch.arange(max_len, device=self.inv_freq.device), self.inv_freq, self.attention_factor)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, interleaved={self.interleaved}, attention_factor={self.attention_factor:.6g}"

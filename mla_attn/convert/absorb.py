"""Weight absorption for MLA decode: a pure function from HF-named weights to decode matrices.

The algebra, the shapes and the FLOP / byte comparison of the factored and fused forms are in
``README.md`` beside this file.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .fp8 import is_fp8

__all__ = ["AttentionDims", "absorb_mla_weights", "absorption_cost", "attention_dims"]

# Every name a layer's attention state_dict may hold (Hugging Face DeepSeek-V3 names, plus the
# absorbed matrices this module writes). Anything else is a mistake: a prefixed key, an MoE
# weight, a missing rename.
EXPANDED_NAMES = (
    "q_proj.weight",
    "q_a_proj.weight",
    "q_a_proj.bias",
    "q_a_layernorm.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_a_proj_with_mqa.bias",
    "kv_a_layernorm.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
    "o_proj.bias",
)
ABSORBED_NAMES = ("w_uk", "w_uv", "w_q_absorbed", "w_o_absorbed")
KNOWN_NAMES = EXPANDED_NAMES + ABSORBED_NAMES


@dataclass(frozen=True)
class AttentionDims:
    """The sizes of one MLA attention layer that fix its weight shapes."""

    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    attention_bias: bool = False

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_in(self) -> int:
        """Width of the query projection's input: the q latent, or the hidden state."""
        return self.q_lora_rank if self.q_lora_rank is not None else self.hidden_size

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every expanded weight (HF name -> shape) this layer holds."""
        h, dc, dr = self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        if self.q_lora_rank is None:
            shapes["q_proj.weight"] = (h * self.q_head_dim, self.hidden_size)
        else:
            shapes["q_a_proj.weight"] = (self.q_lora_rank, self.hidden_size)
            shapes["q_a_layernorm.weight"] = (self.q_lora_rank,)
            shapes["q_b_proj.weight"] = (h * self.q_head_dim, self.q_lora_rank)
            if self.attention_bias:
                shapes["q_a_proj.bias"] = (self.q_lora_rank,)
        shapes["kv_a_proj_with_mqa.weight"] = (dc + dr, self.hidden_size)
        shapes["kv_a_layernorm.weight"] = (dc,)
        shapes["kv_b_proj.weight"] = (h * (self.qk_nope_head_dim + self.v_head_dim), dc)
        shapes["o_proj.weight"] = (self.hidden_size, h * self.v_head_dim)
        if self.attention_bias:
            shapes["kv_a_proj_with_mqa.bias"] = (dc + dr,)
            shapes["o_proj.bias"] = (self.hidden_size,)
        shapes["w_uk"] = (h, self.qk_nope_head_dim, dc)
        shapes["w_uv"] = (h, dc, self.v_head_dim)
        shapes["w_q_absorbed"] = (h, dc, self.q_in)
        shapes["w_o_absorbed"] = (h, self.hidden_size, dc)
        return shapes


def _config_mapping(config: Any) -> Mapping[str, Any] | None:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            config = json.load(f)
    if isinstance(config, Mapping):
        # Multimodal wrappers (Kimi-VL, DeepSeek-VL2) nest the language model's config.
        if "kv_lora_rank" not in config and isinstance(config.get("text_config"), Mapping):
            return config["text_config"]
        return config
    return None


def attention_dims(config: Any) -> AttentionDims:
    """Read the MLA sizes from an ``MLAConfig``, a transformers config, a config.json dict, or a
    path to a config.json (or to the folder holding it)."""
    if isinstance(config, AttentionDims):
        return config
    mapping = _config_mapping(config)

    def get(name, default=...):
        if mapping is not None:
            value = mapping.get(name, default)
        else:
            value = getattr(config, name, default)
        if value is ...:
            raise ValueError(f"config: missing {name!r} (needed for MLA weight shapes)")
        return value

    def size(name, default=...):
        value = get(name, default)
        if value is None and default is None:
            return None
        try:
            return operator.index(value)  # ints, numpy ints; not None, floats or strings
        except TypeError:
            raise ValueError(f"config: {name!r} must be an integer, got {value!r}") from None

    return AttentionDims(
        hidden_size=size("hidden_size"),
        num_attention_heads=size("num_attention_heads"),
        kv_lora_rank=size("kv_lora_rank"),
        qk_nope_head_dim=size("qk_nope_head_dim"),
        qk_rope_head_dim=size("qk_rope_head_dim"),
        v_head_dim=size("v_head_dim"),
        q_lora_rank=size("q_lora_rank", None),
        attention_bias=bool(get("attention_bias", False)),
    )


def absorption_cost(config: Any, *, dtype: torch.dtype = torch.bfloat16, context_len: int = 0):
    """FLOPs and weight bytes per decoded token per layer (batch 1) of the factored and fused forms.

    Counted between the query input ``c_q`` (the normalized q latent, or the hidden state when
    ``q_lora_rank`` is None) and the latent query ``q_latent [H, Dc]`` (side ``"q"``), and between
    the latent attention output ``o_latent [H, Dc]`` and the layer output ``y [hidden]`` (side
    ``"o"``). ``shared`` is what both forms pay: the rope part of the query, ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and the attention over ``context_len`` cached tokens. A multiply-add is
    2 FLOPs; weight bytes are what one token reads at batch 1 (at batch B, FLOPs scale by B and the
    weight bytes do not).

    Returns a dict ``{"factored": {"q", "o", "total"}, "fused": {...}, "shared": {...},
    "cheaper": {"q": "factored"|"fused", "o": ...}}`` where each leaf is
    ``{"flops": int, "weight_bytes": int}``.
    """
    d = attention_dims(config)
    h, dc, dr = d.num_attention_heads, d.kv_lora_rank, d.qk_rope_head_dim
    nope, dv, hid, q_in = d.qk_nope_head_dim, d.v_head_dim, d.hidden_size, d.q_in
    esize = torch.empty((), dtype=dtype).element_size()

    def leaf(params, extra_flops=0):
        return {"flops": 2 * params + extra_flops, "weight_bytes": params * esize}

    factored = {
        # W_UQ (nope rows of q_b_proj / q_proj), then W_UK per head.
        "q": leaf(h * nope * q_in + h * nope * dc),
        # W_UV per head, then o_proj.
        "o": leaf(h * dc * dv + hid * h * dv),
    }
    fused = {"q": leaf(h * dc * q_in), "o": leaf(h * hid * dc)}
    shared_params = h * dr * q_in + hid * (dc + dr)
    if d.q_lora_rank is not None:
        shared_params += hid * d.q_lora_rank
    # Scores over Dc + Dr and the latent value over Dc, per head per cached token.
    attn_flops = 2 * h * (2 * dc + dr) * context_len
    shared = leaf(shared_params, attn_flops)
    for form in (factored, fused):
        form["total"] = {
            k: form["q"][k] + form["o"][k] + shared[k] for k in ("flops", "weight_bytes")
        }
    cheaper = {
        side: ("fused" if fused[side]["flops"] < factored[side]["flops"] else "factored")
        for side in ("q", "o")
    }
    return {"factored": factored, "fused": fused, "shared": shared, "cheaper": cheaper}


def _check_shape(state_dict, name, want):
    got = tuple(state_dict[name].shape)
    if got != tuple(want):
        raise ValueError(f"state_dict[{name!r}]: expected shape {list(want)} from config, got {list(got)}")


def absorb_mla_weights(
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    *,
    dtype: torch.dtype | None = None,
    fused: bool | str = False,
) -> dict[str, torch.Tensor]:
    """Precompute the decode-side (absorbed) matrices of one MLA layer.

    Args:
        state_dict: one layer's attention weights under Hugging Face DeepSeek-V3 names, without
            prefix (``kv_b_proj.weight`` ``[H * (qk_nope + v_head), Dc]``, ``q_b_proj.weight`` or
            ``q_proj.weight`` ``[H * (qk_nope + qk_rope), q_in]``, ``o_proj.weight``
            ``[hidden, H * v_head]``, ...; float dtypes, FP8 must be dequantized first). Keys
            outside that set raise ValueError; absorbed keys already present are ignored and
            recomputed (never trusted: they may be stale).
        config: ``MLAConfig``, transformers config, config.json dict or path.
        dtype: output dtype; None uses the dtype of ``kv_b_proj.weight``. All math is float32
            (float64 when the inputs are float64), with one cast at the end.
        fused: False: only the factored matrices. True: also ``w_q_absorbed`` and
            ``w_o_absorbed``. ``"auto"``: each fused matrix only where it costs fewer decode FLOPs
            than the factored pair (``absorption_cost``); for DeepSeek-V2/V3 shapes, neither.

    Returns:
        A new dict with only the derived matrices (merge it into the state_dict yourself):

        * ``w_uk`` ``[H, qk_nope, Dc]``: ``q_latent[h] = q_nope[h] @ w_uk[h]``
        * ``w_uv`` ``[H, Dc, v_head]``: ``o[h] = o_latent[h] @ w_uv[h]``
        * ``w_q_absorbed`` ``[H, Dc, q_in]``: ``q_latent[h] = w_q_absorbed[h] @ c_q``
          (``W_UK[h]^T W_UQ[h]``; ``c_q`` is the normalized q latent, or the hidden state when
          ``q_lora_rank`` is None)
        * ``w_o_absorbed`` ``[H, hidden, Dc]``: ``y = sum_h w_o_absorbed[h] @ o_latent[h]``
          (``W_O[h] W_UV[h]^T``; ``o_proj.bias`` is added separately)
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    unknown = sorted(k for k in state_dict if k not in KNOWN_NAMES)
    if unknown:
        raise ValueError(
            f"state_dict: unknown keys {unknown}; expected one layer's attention weights under "
            f"Hugging Face DeepSeek-V3 names without prefix: {list(KNOWN_NAMES)}"
        )
    if fused not in (True, False, "auto"):
        raise ValueError(f"fused: expected True, False or 'auto', got {fused!r}")
    d = attention_dims(config)
    shapes = d.expected_shapes()
    if "kv_b_proj.weight" not in state_dict:
        raise ValueError(
            "state_dict: 'kv_b_proj.weight' is required to absorb (got keys "
            f"{sorted(state_dict)})"
        )
    for name, tensor in state_dict.items():
        if name in ABSORBED_NAMES:
            continue
        if is_fp8(tensor.dtype):
            raise ValueError(
                f"state_dict[{name!r}]: float8 weight (dtype {tensor.dtype}); dequantize it first "
                "(load_checkpoint does, or mla_attn.convert.fp8.dequantize_fp8_block)"
            )
        if name in shapes:
            _check_shape(state_dict, name, shapes[name])
    kv_b = state_dict["kv_b_proj.weight"]
    out_dtype = dtype if dtype is not None else kv_b.dtype
    h, nope, dv, dc = d.num_attention_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank

    # kv_b_proj rows: heads outermost, each head's qk_nope rows then its v_head rows.
    # Math in float32 (float64 inputs keep float64); one cast at the end.
    acc = torch.promote_types(kv_b.dtype, torch.float32)
    kv_b32 = kv_b.detach().to(acc).reshape(h, nope + dv, dc)
    w_uk = kv_b32[:, :nope, :]  # [H, nope, Dc]
    w_uv = kv_b32[:, nope:, :].transpose(1, 2)  # [H, Dc, v]
    out = {"w_uk": w_uk, "w_uv": w_uv}

    want_q = want_o = bool(fused)
    if fused == "auto":
        cheaper = absorption_cost(d)["cheaper"]
        want_q, want_o = cheaper["q"] == "fused", cheaper["o"] == "fused"
    if want_q:
        q_name = "q_proj.weight" if d.q_lora_rank is None else "q_b_proj.weight"
        if q_name not in state_dict:
            raise ValueError(f"state_dict: {q_name!r} is required for w_q_absorbed (fused=True)")
        w_q = state_dict[q_name].detach().to(acc).reshape(h, d.q_head_dim, d.q_in)
        w_uq = w_q[:, :nope, :]  # [H, nope, q_in]
        out["w_q_absorbed"] = torch.matmul(w_uk.transpose(1, 2), w_uq)  # [H, Dc, q_in]
    if want_o:
        if "o_proj.weight" not in state_dict:
            raise ValueError("state_dict: 'o_proj.weight' is required for w_o_absorbed (fused=True)")
        w_o = state_dict["o_proj.weight"].detach().to(acc)
        w_o = w_o.reshape(d.hidden_size, h, dv).permute(1, 0, 2)  # [H, hidden, v]
        out["w_o_absorbed"] = torch.matmul(w_o, w_uv.transpose(1, 2))  # [H, hidden, Dc]
    # Cast once, into fresh contiguous storage: the results never alias the inputs (a later
    # optimizer step on kv_b_proj must not silently change them, and safetensors refuses views).
    return {
        k: torch.empty(v.shape, dtype=out_dtype, device=v.device).copy_(v) for k, v in out.items()
    }

"""Layer configs: :class:`MLAConfig` (DeepSeek-style latent attention) and :class:`GQAConfig` (Llama-style).

Both read Hugging Face configs with ``from_hf`` (a transformers config object, a ``config.json`` dict,
or a path to the file or its folder) in the two forms found in the wild:

* ``rope_theta`` + ``rope_scaling`` (original releases, transformers 4.x; ``rope_scaling`` may use the
  legacy key ``type``);
* ``rope_parameters`` (transformers 5.x), a dict holding ``rope_theta``, ``rope_type`` and the scaling
  fields.

``from_file`` reads one of this repository's ``configs/*.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..ops.rope import normalize_rope_scaling

_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _load_dict(config) -> dict:
    """A plain dict from a transformers config object, a dict, or a path (file or folder with config.json)."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"config path {str(config)!r} is neither a JSON file nor a folder holding config.json")
        with open(path) as f:
            return json.load(f)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        d = dict(to_dict())
        # transformers 4.x objects keep rope_theta / rope_scaling as attributes; 5.x as rope_parameters.
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "head_dim", "rope_interleave"):
            if key not in d and getattr(config, key, None) is not None:
                d[key] = getattr(config, key)
        return d
    raise ValueError(f"config must be a transformers config, a dict or a path, got {type(config).__name__}")


def _rope_from_dict(d: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either form."""
    max_pos = d.get("max_position_embeddings")
    rp = d.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, Mapping):
            raise ValueError(f"rope_parameters must be a dict, got {type(rp).__name__}")
        if rp and all(isinstance(v, Mapping) for v in rp.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported, got keys {sorted(rp)}")
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        return float(theta), normalize_rope_scaling(rp, max_pos)
    theta = d.get("rope_theta")
    return float(10000.0 if theta is None else theta), normalize_rope_scaling(d.get("rope_scaling"), max_pos)


def _check_positive(cls: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{cls}: {name} must be a positive int, got {v!r}")


@dataclasses.dataclass
class MLAConfig:
    """Multi-head latent attention dimensions, named as DeepSeek-V2/V3 configs name them.

    ``q_lora_rank=None`` means a plain ``q_proj`` (V2-Lite, Moonlight). ``qk_rope_head_dim`` may be 0
    (no rotary part). ``num_hidden_layers`` (optional, not part of the layer) lets
    :meth:`kv_cache_bytes_per_token` answer for a whole model. ``rms_norm_eps`` is the model's (its
    decoder norms'), as in the Hugging Face config: the layer's own q_a / kv_a norms use 1e-6 whatever it
    says, as DeepSeek's code and transformers do (Moonlight's config says 1e-5).
    """

    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    num_hidden_layers: int | None = None

    def __post_init__(self):
        _check_positive("MLAConfig", hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                        kv_lora_rank=self.kv_lora_rank, v_head_dim=self.v_head_dim,
                        max_position_embeddings=self.max_position_embeddings)
        for name in ("qk_nope_head_dim", "qk_rope_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"MLAConfig: {name} must be a non-negative int, got {v!r}")
        if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
            raise ValueError("MLAConfig: qk_nope_head_dim + qk_rope_head_dim must be positive, got 0 + 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig: qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            _check_positive("MLAConfig", q_lora_rank=self.q_lora_rank)
        if self.num_hidden_layers is not None:
            _check_positive("MLAConfig", num_hidden_layers=self.num_hidden_layers)
        if self.rope_theta <= 0:
            raise ValueError(f"MLAConfig: rope_theta must be positive, got {self.rope_theta}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, config) -> "MLAConfig":
        """From a transformers config object, a ``config.json`` dict, or a path to one (or its folder)."""
        d = _load_dict(config)
        missing = [k for k in ("hidden_size", "num_attention_heads") + _MLA_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"config is not an MLA (DeepSeek-style) config: missing {missing}")
        theta, scaling = _rope_from_dict(d)
        interleave = d.get("rope_interleave")
        return cls(
            hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
            kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"], q_lora_rank=d.get("q_lora_rank"),
            rope_theta=theta, rope_scaling=scaling, rope_interleave=True if interleave is None else bool(interleave),
            attention_bias=bool(d.get("attention_bias", False)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            num_hidden_layers=d.get("num_hidden_layers"),
        )

    @classmethod
    def from_file(cls, path) -> "MLAConfig":
        """From a JSON file such as ``configs/DeepSeek-V3.json``."""
        return cls.from_hf(Path(path))

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2, num_layers: int | None = None) -> int:
        """Bytes one token occupies in the latent cache: ``(Dc + Dr) * dtype_bytes * layers``.

        ``num_layers`` defaults to ``num_hidden_layers`` (1 when the config does not say).
        """
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes * self._layers(num_layers)

    def mha_kv_cache_bytes_per_token(self, dtype_bytes: int = 2, num_layers: int | None = None) -> int:
        """Bytes per token if the same heads cached expanded K and V (the MHA MLA replaces):
        ``H * (qk_nope + qk_rope + v) * dtype_bytes * layers``."""
        h = self.num_attention_heads
        return h * (self.qk_head_dim + self.v_head_dim) * dtype_bytes * self._layers(num_layers)

    def _layers(self, num_layers: int | None) -> int:
        n = num_layers if num_layers is not None else (self.num_hidden_layers or 1)
        _check_positive("kv_cache_bytes_per_token", num_layers=n)
        return n


@dataclasses.dataclass
class GQAConfig:
    """Grouped-query attention dimensions, named as Llama configs name them.

    ``num_key_value_heads=None`` means MHA; ``head_dim=None`` means ``hidden_size // num_attention_heads``.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    num_hidden_layers: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_positive("GQAConfig", hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                        num_key_value_heads=self.num_key_value_heads,
                        max_position_embeddings=self.max_position_embeddings)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"GQAConfig: num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"GQAConfig: hidden_size ({self.hidden_size}) must be divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}) when head_dim is not given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive("GQAConfig", head_dim=self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"GQAConfig: head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.num_hidden_layers is not None:
            _check_positive("GQAConfig", num_hidden_layers=self.num_hidden_layers)
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def from_hf(cls, config) -> "GQAConfig":
        """From a transformers (Llama-style) config object, a ``config.json`` dict, or a path to one."""
        d = _load_dict(config)
        if d.get("kv_lora_rank") is not None:
            raise ValueError("config is an MLA config (it has kv_lora_rank); use MLAConfig.from_hf")
        missing = [k for k in ("hidden_size", "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ValueError(f"config is not an attention config: missing {missing}")
        theta, scaling = _rope_from_dict(d)
        return cls(
            hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"), head_dim=d.get("head_dim"),
            rope_theta=theta, rope_scaling=scaling, attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            num_hidden_layers=d.get("num_hidden_layers"),
        )

    @classmethod
    def from_file(cls, path) -> "GQAConfig":
        """From a JSON file such as ``configs/Llama-3.1-70B.json``."""
        return cls.from_hf(Path(path))

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2, num_layers: int | None = None) -> int:
        """Bytes one token occupies in the KV cache: ``2 * Hkv * head_dim * dtype_bytes * layers``.

        ``num_layers`` defaults to ``num_hidden_layers`` (1 when the config does not say).
        """
        return 2 * self.num_key_value_heads * self.head_dim * dtype_bytes * self._layers(num_layers)

    def mha_kv_cache_bytes_per_token(self, dtype_bytes: int = 2, num_layers: int | None = None) -> int:
        """Bytes per token with one KV head per query head (the MHA this GQA replaces)."""
        return 2 * self.num_attention_heads * self.head_dim * dtype_bytes * self._layers(num_layers)

    def _layers(self, num_layers: int | None) -> int:
        n = num_layers if num_layers is not None else (self.num_hidden_layers or 1)
        _check_positive("kv_cache_bytes_per_token", num_layers=n)
        return n

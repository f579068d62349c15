"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight).

Parameter names follow Hugging Face ``DeepseekV3Attention``: ``q_proj`` (when ``q_lora_rank`` is None)
or ``q_a_proj, q_a_layernorm, q_b_proj``; ``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj``.

Two forms of the same attention (the algebra is in ``mla_attn/layers/README.md``):

* expanded (training, prefill): the latent ``c`` goes through ``kv_b_proj`` to per-head
  ``k_nope [H, nope]`` and ``v [H, v]``; ``ops.attention`` with Dqk = nope + rope, Dv = v.
* absorbed (decode): ``q_nope`` goes through ``W_UK`` into latent space, ``ops.mla_decode`` attends
  over the latent cache (value = the latent itself), the latent output goes through ``W_UV`` and
  ``o_proj``. ``W_UK`` / ``W_UV`` are views of ``kv_b_proj.weight`` taken at call time.

Path choice from explicit state: no cache -> expanded; empty cache -> expanded (prefill); cache
holding tokens -> absorbed. ``path="expanded" | "absorbed"`` overrides; expanded over a non-empty
cache (chunked prefill) gathers the cached prefix (all sequences must hold the same number of tokens).

Absorbed weights: a state_dict holding ``w_uk [H, nope, Dc]`` and ``w_uv [H, Dc, v]`` instead of
``kv_b_proj.weight`` loads: ``_load_from_state_dict`` reassembles ``kv_b_proj.weight`` from them
(rows per head: the nope rows of w_uk, then the rows of w_uv transposed). When both are present
``kv_b_proj.weight`` wins and w_uk / w_uv (and the optional fused ``w_q_absorbed`` /
``w_o_absorbed``) are dropped as derived data.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import LatentCache, PagedLatentCache
from ..ops.rope import RotaryEmbedding, rope_softmax_scale_factor
from ._common import check_cache, check_positions, check_x, default_positions
from .config import MLAConfig

PATHS = ("expanded", "absorbed")
_DERIVED_KEYS = ("w_uk", "w_uv", "w_q_absorbed", "w_o_absorbed")
# q_a_layernorm / kv_a_layernorm: DeepSeek's code and transformers' DeepseekV2/V3Attention build them with
# the default eps, not config.rms_norm_eps (the decoder norms'); the two differ for Moonlight (1e-5).
ATTN_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as DeepSeek / Llama do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class MultiHeadLatentAttention(nn.Module):
    """MLA layer.

    Args:
        config: :class:`MLAConfig` (or anything :meth:`MLAConfig.from_hf` reads).
        impl: ``"auto" | "triton" | "reference"``, passed to every op.
        device, dtype: of the parameters.

    Call: ``y = layer(x, cache=None, positions=None, path=None)`` with x ``[B, T, hidden_size]``.
    """

    def __init__(self, config: MLAConfig, impl: str = "auto", *, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MLAConfig):
            config = MLAConfig.from_hf(config)
        if impl not in ("auto", "triton", "reference"):
            raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
        c = self.config = config
        self.impl = impl
        self.hidden_size, self.num_heads = c.hidden_size, c.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.qk_head_dim = c.qk_head_dim
        self.scaling = self.qk_head_dim ** -0.5 * rope_softmax_scale_factor(c.rope_scaling)
        h, kw = self.num_heads, dict(device=device, dtype=dtype)
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, h * self.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, ATTN_NORM_EPS, **kw)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * self.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                            bias=c.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, ATTN_NORM_EPS, **kw)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=c.attention_bias, **kw)
        self.rotary_emb = (RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling,
                                           interleaved=c.rope_interleave,
                                           max_position_embeddings=c.max_position_embeddings, device=device)
                           if c.qk_rope_head_dim else None)

    # -- absorbed weights -------------------------------------------------------------------------
    def _kv_b_heads(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    @property
    def w_uk(self) -> torch.Tensor:
        """``[H, nope, Dc]`` view of ``kv_b_proj.weight``: latent -> per-head k_nope."""
        return self._kv_b_heads()[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """``[H, Dc, v]`` (a transposed view of ``kv_b_proj.weight``): latent -> per-head value."""
        return self._kv_b_heads()[:, self.qk_nope_head_dim:].transpose(1, 2)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        kv_key, uk_key, uv_key = prefix + "kv_b_proj.weight", prefix + "w_uk", prefix + "w_uv"
        if kv_key not in state_dict and uk_key in state_dict and uv_key in state_dict:
            h, nope, dc, v = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank, self.v_head_dim
            w_uk, w_uv = state_dict[uk_key], state_dict[uv_key]
            if w_uk.shape != (h, nope, dc) or w_uv.shape != (h, dc, v):
                raise ValueError(f"absorbed weights must be w_uk [{h}, {nope}, {dc}] and w_uv [{h}, {dc}, {v}], "
                                 f"got w_uk {tuple(w_uk.shape)}, w_uv {tuple(w_uv.shape)}")
            w_uv_rows = w_uv.transpose(1, 2).to(w_uk.dtype)  # [H, v, Dc]
            state_dict[kv_key] = torch.cat((w_uk, w_uv_rows), dim=1).reshape(h * (nope + v), dc)
        for name in _DERIVED_KEYS:
            state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # -- cache ------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_seq_len: int, page_size: int | None = None, dtype=None, device=None, *,
                  num_pages: int | None = None, shuffle_seed: int | None = None) -> LatentCache | PagedLatentCache:
        """A latent cache (Dc + Dr values per token): contiguous, or paged when ``page_size`` is given."""
        w = self.kv_a_proj_with_mqa.weight
        dtype = w.dtype if dtype is None else dtype
        device = w.device if device is None else device
        if page_size is None:
            if num_pages is not None:
                raise ValueError(f"num_pages={num_pages} needs page_size (a paged cache)")
            return LatentCache(batch_size, max_seq_len, self.kv_lora_rank, self.qk_rope_head_dim, dtype=dtype,
                               device=device)
        return PagedLatentCache(batch_size, max_seq_len, self.kv_lora_rank, self.qk_rope_head_dim,
                                page_size=page_size, num_pages=num_pages, dtype=dtype, device=device,
                                shuffle_seed=shuffle_seed)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: LatentCache | PagedLatentCache | None = None,
                positions: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
        """x ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``.

        ``positions`` int ``[B, T]``: rotary positions, default continuing from the cache's fill.
        ``path``: None (from the cache state), ``"expanded"`` or ``"absorbed"`` (needs a cache).
        """
        b, t = check_x(x, self.hidden_size, self.kv_a_proj_with_mqa.weight)
        if path is not None and path not in PATHS:
            raise ValueError(f"path must be None, 'expanded' or 'absorbed', got {path!r}")
        prefix_len = 0
        if cache is None:
            if path == "absorbed":
                raise ValueError("path='absorbed' reads a latent cache: pass cache=layer.new_cache(...)")
            path = "expanded"
        else:
            check_cache(cache, b, x, (LatentCache, PagedLatentCache), type(self).__name__)
            cache.check_room(t)
            if path is None:
                path = "expanded" if cache.is_empty() else "absorbed"
            if path == "expanded" and not cache.is_empty():
                prefix_len = cache.uniform_len()
                if prefix_len is None:
                    raise ValueError(f"path='expanded' over a non-empty cache needs every sequence to hold the "
                                     f"same number of tokens, got seq_lens {cache.host_seq_lens}")
        if positions is None:
            positions = default_positions(cache, b, t, x.device)
        else:
            check_positions(positions, b, t)

        h, nope, dr, dc = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if t == 0:  # nothing to attend from; the cache is unchanged
            return self.o_proj(x.new_zeros(b, 0, h * self.v_head_dim))
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, h, self.qk_head_dim)
        q_nope, q_rope = q[..., :nope], q[..., nope:]  # [B, T, H, nope], [B, T, H, Dr]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, T, Dc + Dr]
        latent = self.kv_a_layernorm(ckv[..., :dc])  # [B, T, Dc]
        k_rope = None
        if dr:
            cos, sin = self.rotary_emb(positions.to(x.device))  # [B, T, Dr/2] float32
            q_rope = self.rotary_emb.rotate(q_rope, cos[:, :, None], sin[:, :, None])
            k_rope = self.rotary_emb.rotate(ckv[..., dc:], cos, sin)  # [B, T, Dr]

        if path == "expanded":
            if cache is not None:
                cache.update(latent, k_rope)
            if prefix_len:
                latent_all, k_rope_all = cache.gather(prefix_len + t)
            else:
                latent_all, k_rope_all = latent, k_rope
            o = self._expanded(q_nope, q_rope, latent_all, k_rope_all)  # [B, T, H, v]
        else:
            cache.update(latent, k_rope)
            o = self._absorbed(q_nope, q_rope, cache)
        return self.o_proj(o.reshape(b, t, h * self.v_head_dim))

    def _expanded(self, q_nope, q_rope, latent, k_rope) -> torch.Tensor:
        """q ``[B, T, H, *]`` against N = latent.shape[1] keys (bottom-right causal); returns ``[B, T, H, v]``."""
        b, n = latent.shape[:2]
        h, nope, dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        kv = self.kv_b_proj(latent).view(b, n, h, nope + self.v_head_dim)  # [B, N, H, nope + v]
        k_nope, v = kv[..., :nope], kv[..., nope:]
        if dr:
            k = torch.cat((k_nope, k_rope[:, :, None].expand(b, n, h, dr)), dim=-1)  # [B, N, H, nope + Dr]
            q = torch.cat((q_nope, q_rope), dim=-1)  # [B, T, H, nope + Dr]
        else:
            k, q = k_nope, q_nope
        o = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, scale=self.scaling,
                          impl=self.impl)  # [B, H, T, v]
        return o.transpose(1, 2)

    def _absorbed(self, q_nope, q_rope, cache) -> torch.Tensor:
        """q against the latent cache (the new tokens already written); returns ``[B, T, H, v]``."""
        q_latent = torch.einsum("bthn,hnc->bhtc", q_nope, self.w_uk)  # [B, H, T, Dc]
        qr = q_rope.transpose(1, 2) if self.qk_rope_head_dim else None  # [B, H, T, Dr]
        o_latent = ops.mla_decode(q_latent, qr, cache.kv_latent, cache.k_rope, cache.seq_lens,
                                  scale=self.scaling, block_table=cache.block_table, impl=self.impl)  # [B, H, T, Dc]
        return torch.einsum("bhtc,hcv->bthv", o_latent, self.w_uv)  # [B, T, H, v]

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden_size={c.hidden_size}, num_attention_heads={c.num_attention_heads}, "
                f"q_lora_rank={c.q_lora_rank}, kv_lora_rank={c.kv_lora_rank}, qk_nope_head_dim={c.qk_nope_head_dim}, "
                f"qk_rope_head_dim={c.qk_rope_head_dim}, v_head_dim={c.v_head_dim}, impl={self.impl!r}")

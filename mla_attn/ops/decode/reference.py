"""Pure-PyTorch decode over contiguous or paged caches: the CPU path and the readable statement.

Each batch row gathers its valid cached tokens (positions < seq_lens[b]); unused slots are zeroed
before any arithmetic so that NaN or garbage in them can never reach the result, and block-table
entries past a sequence's last page are never used as indices. Softmax runs in float32.
"""

from __future__ import annotations

import torch

from ..attention.reference import masked_softmax_attention


def gather_tokens(cache: torch.Tensor, seq_lens: torch.Tensor, n_max: int, block_table: torch.Tensor | None):
    """Token-major gather: contiguous ``[B, N, *rest]`` or paged ``[num_pages, P, *rest]`` -> ``[B, n_max, *rest]``.

    Returns ``(tokens, valid)`` with valid ``[B, n_max]`` bool; invalid tokens are zero.
    """
    b = seq_lens.shape[0]
    pos = torch.arange(n_max, device=cache.device)
    valid = pos.unsqueeze(0) < seq_lens.to(cache.device).long().unsqueeze(1)  # [B, n_max]
    if block_table is None:
        tokens = cache[:, :n_max]
    else:
        page_size = cache.shape[1]
        logical = (pos // page_size).unsqueeze(0).expand(b, -1)  # [B, n_max]
        pages = torch.gather(block_table.to(cache.device).long(), 1, logical)
        pages = torch.where(valid, pages, torch.zeros_like(pages))  # never index with entries past the end
        tokens = cache[pages, (pos % page_size).unsqueeze(0).expand(b, -1)]
    shape = valid.shape + (1,) * (tokens.dim() - 2)
    tokens = torch.where(valid.view(shape), tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device))
    return tokens, valid


def decode_mask(seq_lens: torch.Tensor, s: int, n_max: int, device) -> torch.Tensor:
    """``[B, S, n_max]``: new token s of row b sees cache positions j <= seq_lens[b] - S + s (and j >= 0)."""
    j = torch.arange(n_max, device=device).view(1, 1, n_max)
    t = torch.arange(s, device=device).view(1, s, 1)
    limit = seq_lens.to(device).long().view(-1, 1, 1) - s + t
    return j <= limit


def _host_max(seq_lens: torch.Tensor) -> int:
    return int(seq_lens.max().item()) if seq_lens.numel() else 0


def decode_reference(q, k_cache, v_cache, seq_lens, block_table, scale: float):
    """q [B, Hq, S, D]; caches as in ``decode_attention``. Returns (o [B, Hq, S, Dv] in q.dtype, lse fp32 [B, Hq, S])."""
    b, hq, s, d = q.shape
    if block_table is None:
        hkv = k_cache.shape[1]
        k_tok, v_tok = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # [B, N, Hkv, D]
    else:
        hkv = k_cache.shape[2]
        k_tok, v_tok = k_cache, v_cache
    n_max = _host_max(seq_lens)
    k, _ = gather_tokens(k_tok, seq_lens, n_max, block_table)  # [B, n, Hkv, D]
    v, _ = gather_tokens(v_tok, seq_lens, n_max, block_table)  # [B, n, Hkv, Dv]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = hq // hkv
    qg = q.reshape(b, hkv, group * s, d).to(acc)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1).to(acc)) * scale  # [B, Hkv, G*S, n]
    mask = decode_mask(seq_lens, s, n_max, q.device)  # [B, S, n]
    mask = mask.unsqueeze(1).unsqueeze(1).expand(b, 1, group, s, n_max).reshape(b, 1, group * s, n_max)
    o, lse = masked_softmax_attention(scores, v.permute(0, 2, 1, 3), mask)
    o = o.reshape(b, hq, s, v.shape[-1]).to(q.dtype)
    return o, lse.reshape(b, hq, s).float()


def mla_decode_reference(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale: float):
    """Absorbed MLA decode, q_latent [B, H, S, Dc]; returns (o [B, H, S, Dc] in q_latent.dtype, lse fp32 [B, H, S])."""
    b, h, s, _ = q_latent.shape
    n_max = _host_max(seq_lens)
    acc = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    c, _ = gather_tokens(kv_latent, seq_lens, n_max, block_table)  # [B, n, Dc]
    c = c.to(acc)
    scores = torch.matmul(q_latent.reshape(b, h * s, q_latent.shape[-1]).to(acc), c.transpose(1, 2))  # [B, H*S, n]
    if q_rope is not None:
        kr, _ = gather_tokens(k_rope, seq_lens, n_max, block_table)  # [B, n, Dr]
        scores = scores + torch.matmul(q_rope.reshape(b, h * s, q_rope.shape[-1]).to(acc), kr.to(acc).transpose(1, 2))
    scores = scores * scale
    mask = decode_mask(seq_lens, s, n_max, q_latent.device)  # [B, S, n]
    mask = mask.unsqueeze(1).expand(b, h, s, n_max).reshape(b, h * s, n_max)
    o, lse = masked_softmax_attention(scores, c, mask)
    return o.reshape(b, h, s, q_latent.shape[-1]).to(q_latent.dtype), lse.reshape(b, h, s).float()


def merge_reference(o_parts, lse_parts):
    """o_parts [K, ..., Dv], lse_parts [K, ...] -> (o [..., Dv] in o_parts.dtype, lse [...] fp32)."""
    if o_parts.shape[0] == 0:  # no parts: as if every part were -inf
        return (o_parts.new_zeros(o_parts.shape[1:]),
                torch.full(lse_parts.shape[1:], float("-inf"), dtype=torch.float32, device=lse_parts.device))
    lse = lse_parts.float()
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # [K, ...]; exactly 0 for parts with lse = -inf
    total = w.sum(dim=0)
    empty = total == 0
    wn = w / torch.where(empty, torch.ones_like(total), total)
    contrib = wn.unsqueeze(-1) * o_parts.float()
    contrib = torch.where((w > 0).unsqueeze(-1), contrib, torch.zeros_like(contrib))  # a NaN in a dead part stays out
    o = contrib.sum(dim=0)
    out_lse = (m_safe + torch.log(torch.where(empty, torch.ones_like(total), total))).masked_fill(empty, float("-inf"))
    return o.to(o_parts.dtype), out_lse

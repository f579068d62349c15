"""The one float64 oracle, written from the definition (softmax of scaled scores).

It deliberately shares no code with the reference ops: sequences are walked one at a time and
pages are looked up one token at a time, so the oracle and the ops check each other.
Results are float64 ``(o, lse)``; ``attention_oracle`` is differentiable (use float64 leaves).
"""

from __future__ import annotations

import math

import torch


def _softmax_rows(scores: torch.Tensor, visible: torch.Tensor):
    """scores [..., N] float64, visible bool [..., N] -> (p, lse); rows without a visible key: p = 0, lse = -inf."""
    neg = torch.full_like(scores, -math.inf)
    s = torch.where(visible, scores, neg)
    any_visible = visible.any(dim=-1, keepdim=True)
    row_max = torch.cat([s, neg[..., :1] if s.shape[-1] else s.new_full(s.shape[:-1] + (1,), -math.inf)], -1)
    shift = torch.where(any_visible, row_max.max(dim=-1, keepdim=True).values, torch.zeros_like(row_max[..., :1]))
    e = torch.where(visible, torch.exp(s - shift.detach()), torch.zeros_like(s))
    z = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(any_visible, z, torch.ones_like(z))
    lse = torch.where(any_visible, shift.detach() + torch.log(torch.where(any_visible, z, torch.ones_like(z))),
                      torch.full_like(z, -math.inf))
    return p, lse.squeeze(-1)


def attention_oracle(q, k, v, *, causal=False, scale=None):
    """q [B, Hq, M, Dqk], k [B, Hkv, N, Dqk], v [B, Hkv, N, Dv] -> float64 (o [B, Hq, M, Dv], lse [B, Hq, M])."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, m, dqk = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scale = dqk ** -0.5 if scale is None else scale
    kv_head = torch.arange(hq, device=q.device) // (hq // hkv)
    kx, vx = k[:, kv_head], v[:, kv_head]  # per-query-head copies: clarity over speed
    scores = torch.einsum("bhmd,bhnd->bhmn", q, kx) * scale
    i = torch.arange(m, device=q.device).view(m, 1)
    j = torch.arange(n, device=q.device).view(1, n)
    visible = (j <= i + (n - m)) if causal else torch.ones(m, n, dtype=torch.bool, device=q.device)
    p, lse = _softmax_rows(scores, visible.expand_as(scores))
    return torch.einsum("bhmn,bhnd->bhmd", p, vx), lse


def _token(cache, b: int, pos: int, block_table):
    """One cached token of sequence b: contiguous cache [B, N, ...] or paged [num_pages, P, ...]."""
    if block_table is None:
        return cache[b, pos]
    page_size = cache.shape[1]
    page = int(block_table[b, pos // page_size])
    return cache[page, pos % page_size]


def _seq(cache, b: int, length: int, block_table):
    if length == 0:
        return cache.new_zeros((0,) + tuple(cache.shape[2:])).double()
    return torch.stack([_token(cache, b, p, block_table) for p in range(length)]).double()


def decode_oracle(q, k_cache, v_cache, seq_lens, *, block_table=None, scale=None):
    """decode_attention from the definition; q [B, Hq, D] or [B, Hq, S, D]. float64 (o, lse)."""
    squeeze = q.dim() == 3
    q4 = (q.unsqueeze(2) if squeeze else q).double()
    b, hq, s, d = q4.shape
    scale = d ** -0.5 if scale is None else scale
    if block_table is None:  # make the cache token-major: [B, N, Hkv, D]
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    hkv = k_cache.shape[2]
    o = torch.zeros(b, hq, s, v_cache.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, s), -math.inf, dtype=torch.float64, device=q.device)
    for bi in range(b):
        length = int(seq_lens[bi])
        kb, vb = _seq(k_cache, bi, length, block_table), _seq(v_cache, bi, length, block_table)  # [L, Hkv, D]
        for h in range(hq):
            kvh = h // (hq // hkv)
            scores = q4[bi, h] @ kb[:, kvh].T * scale  # [S, L]
            j = torch.arange(length, device=q.device).view(1, -1)
            t = torch.arange(s, device=q.device).view(-1, 1)
            p, l_ = _softmax_rows(scores, j < length - s + 1 + t)
            o[bi, h] = p @ vb[:, kvh]
            lse[bi, h] = l_
    return (o.squeeze(2), lse.squeeze(2)) if squeeze else (o, lse)


def mla_decode_oracle(q_latent, q_rope, kv_latent, k_rope, seq_lens, *, scale, block_table=None):
    """mla_decode from the definition: scores = scale * (q_latent.c + q_rope.kr), value = c. float64 (o, lse)."""
    squeeze = q_latent.dim() == 3
    ql = (q_latent.unsqueeze(2) if squeeze else q_latent).double()
    qr = None if q_rope is None else (q_rope.unsqueeze(2) if squeeze else q_rope).double()
    b, h, s, dc = ql.shape
    o = torch.zeros(b, h, s, dc, dtype=torch.float64, device=ql.device)
    lse = torch.full((b, h, s), -math.inf, dtype=torch.float64, device=ql.device)
    for bi in range(b):
        length = int(seq_lens[bi])
        c = _seq(kv_latent, bi, length, block_table)  # [L, Dc]
        scores = torch.einsum("hsd,ld->hsl", ql[bi], c)
        if qr is not None:
            scores = scores + torch.einsum("hsd,ld->hsl", qr[bi], _seq(k_rope, bi, length, block_table))
        j = torch.arange(length, device=ql.device).view(1, 1, -1)
        t = torch.arange(s, device=ql.device).view(1, -1, 1)
        p, l_ = _softmax_rows(scores * scale, (j < length - s + 1 + t).expand_as(scores))
        o[bi] = torch.einsum("hsl,ld->hsd", p, c)
        lse[bi] = l_
    return (o.squeeze(2), lse.squeeze(2)) if squeeze else (o, lse)


def merge_oracle(o_parts, lse_parts):
    """Combine partial attentions: o = sum_k exp(lse_k - lse) o_k, lse = log sum_k exp(lse_k). float64."""
    o_parts, lse_parts = o_parts.double(), lse_parts.double()
    lse = torch.logsumexp(lse_parts, dim=0)  # -inf when every part is -inf
    alive = torch.isfinite(lse)
    w = torch.exp(lse_parts - torch.where(alive, lse, torch.zeros_like(lse)))
    w = torch.where(torch.isfinite(lse_parts), w, torch.zeros_like(w))
    terms = torch.where((w > 0).unsqueeze(-1), w.unsqueeze(-1) * o_parts, torch.zeros_like(o_parts))
    return terms.sum(dim=0), lse

"""Split-KV combine: merge partial attentions over disjoint key sets by their log-sum-exps.

For parts k with outputs o_k (each normalised over its own keys) and lse_k:
``lse = log sum_k exp(lse_k)``, ``o = sum_k exp(lse_k - lse) o_k``. Parts with lse_k = -inf weigh
exactly 0 (their o_k is never multiplied in, so a NaN there cannot leak); if every part is -inf
the row gets o = 0 and lse = -inf. Derivation in README.md here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import cdiv, next_pow2

_alloc = torch.empty  # output buffers (tests swap in a NaN-filled allocator)


@triton.jit
def _combine_kernel(
    O_PARTS, LSE_PARTS, O, LSE,
    num_parts,
    stride_opk, stride_opr, stride_opd,
    stride_lpk, stride_lpr,
    stride_or, stride_od,
    stride_lr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)  # output row
    i_d = tl.program_id(1)  # BLOCK_DV-wide slice of it
    o_k = tl.arange(0, BLOCK_K)
    b_lse = tl.load(LSE_PARTS + o_k * stride_lpk + i_r * stride_lpr, mask=o_k < num_parts,
                    other=float("-inf"))  # [BLOCK_K]
    b_m = tl.max(b_lse, 0)
    b_m_safe = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_den = tl.sum(tl.exp(b_lse - b_m_safe), 0)  # dead parts add exactly 0

    o_d = i_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_d = o_d < DV
    b_acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, num_parts, CHUNK):  # CHUNK parts per step: independent loads, no serial chain
        o_c = k0 + tl.arange(0, CHUNK)
        b_lc = tl.load(LSE_PARTS + o_c * stride_lpk + i_r * stride_lpr, mask=o_c < num_parts, other=float("-inf"))
        b_w = tl.exp(b_lc - b_m_safe)  # [CHUNK]
        # A dead part (weight exactly 0) is never read: its o may be anything, NaN included.
        # (A NaN lse gives a NaN weight, which is read and kept: NaN in, NaN out.)
        p_o = O_PARTS + o_c[:, None].to(tl.int64) * stride_opk + i_r * stride_opr + o_d[None, :] * stride_opd
        b_o = tl.load(p_o, mask=(b_w != 0.0)[:, None] & m_d[None, :], other=0.0)  # [CHUNK, BLOCK_DV]
        b_acc += tl.sum(b_w[:, None] * b_o.to(tl.float32), 0)

    dead = b_den == 0.0
    b_out = b_acc / tl.where(dead, 1.0, b_den)
    b_lse_out = tl.where(dead, float("-inf"), b_m_safe + tl.log(tl.where(dead, 1.0, b_den)))
    tl.store(O + i_r * stride_or + o_d * stride_od, b_out.to(O.dtype.element_ty), mask=m_d)
    if i_d == 0:
        tl.store(LSE + i_r * stride_lr, b_lse_out)


def _launch(o_parts3, lse_parts2, o2, lse1):
    """o_parts3 [K, R, Dv], lse_parts2 [K, R] float32 -> writes o2 [R, Dv], lse1 [R]."""
    k, r, dv = o_parts3.shape
    if r == 0:
        return
    block_dv = min(128, max(16, next_pow2(dv)))
    _combine_kernel[(r, cdiv(dv, block_dv))](
        o_parts3, lse_parts2, o2, lse1, k,
        *o_parts3.stride(), *lse_parts2.stride(), *o2.stride(), *lse1.stride(),
        DV=dv, BLOCK_DV=block_dv, BLOCK_K=max(16, next_pow2(k)), CHUNK=8,
        num_warps=4,
    )


def combine_splits(o_part, lse_part, o, lse) -> None:
    """Merge the decode kernel's partials: o_part [K, B, H, S, Dv] fp32, lse_part [K, B, H, S] into
    o [B, H, S, Dv] (its dtype), lse [B, H, S] fp32 (both freshly allocated, contiguous)."""
    k, dv = o_part.shape[0], o_part.shape[-1]
    _launch(o_part.view(k, -1, dv), lse_part.view(k, -1), o.view(-1, dv), lse.view(-1))


def merge_attention_states_triton(o_parts, lse_parts):
    """Combine partial attentions over disjoint key sets.

    Args:
        o_parts: ``[K, ..., Dv]``, each part normalised over its own keys (any float dtype).
        lse_parts: ``[K, ...]`` float32 log-sum-exps; a part with -inf contributes nothing.

    Returns:
        ``o [..., Dv]`` in o_parts' dtype and ``lse [...]`` float32; a row whose parts are all -inf
        gets o = 0 and lse = -inf.
    """
    k, dv = o_parts.shape[0], o_parts.shape[-1]
    lead = tuple(o_parts.shape[1:-1])
    o = _alloc(lead + (dv,), dtype=o_parts.dtype, device=o_parts.device)
    lse = _alloc(lead, dtype=torch.float32, device=o_parts.device)
    if k == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    _launch(o_parts.reshape(k, -1, dv), lse_parts.float().reshape(k, -1), o.view(-1, dv), lse.view(-1))
    return o, lse

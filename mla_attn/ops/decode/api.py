"""Public decode ops: validation and dispatch. Kernels live in triton_decode.py / combine.py."""

from __future__ import annotations

import torch

from .._common import check_dim, check_float, check_same_device, check_same_dtype, resolve_impl
from .._launch import PlanCache
from .reference import decode_reference, merge_reference, mla_decode_reference


def _check_seq_lens(seq_lens, batch: int, capacity: int) -> None:
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        shape = tuple(seq_lens.shape) if isinstance(seq_lens, torch.Tensor) else type(seq_lens).__name__
        raise ValueError(f"seq_lens must be an int32 tensor of shape [B] = [{batch}], got {shape}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32 (or int64), got {seq_lens.dtype}")
    # Values are checked only where that costs no device-to-host sync (a CPU tensor): a CUDA decode
    # step must stay capturable in a CUDA graph.
    if seq_lens.device.type == "cpu" and batch > 0:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > capacity:
            raise ValueError(f"seq_lens must lie in [0, {capacity}] (the cache holds {capacity} tokens per "
                             f"sequence), got values from {lo} to {hi}")


def _check_block_table(block_table, batch: int) -> None:
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B, max_pages] with B = {batch}, got shape {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")


def _check_num_splits(num_splits) -> None:
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")


def _as_int32(t):
    return t if t is None or t.dtype == torch.int32 else t.to(torch.int32)


# Call signatures that passed validation: (op, then per argument its shape, dtype and device, then the
# scalar arguments) -> the checked call's implementation. Every check in the ops below is a function of
# these alone, except the values of a CPU seq_lens, which are checked on every call. An eager decode step
# at batch 1 is bound by its host path; the checks cost about as much as the rest of it. Bounded like the
# launch plans (cleared when full).
_validated = PlanCache()


def _signature(op, tensors, scalars):
    """The validation key of a call, or None when an argument is not a tensor (the checks then run and
    say what is wrong)."""
    if not all(x is None or type(x) in (int, bool, str, type, float) for x in scalars):
        return None  # e.g. num_splits=[2]: the checks say what is wrong
    sig = [op, *scalars]
    for t in tensors:
        if t is None:
            sig.append(None)
        elif isinstance(t, torch.Tensor):
            sig.append((t.shape, t.dtype, t.device))
        else:
            return None
    return tuple(sig)


def _validate(op, tensors, scalars, check, seq_lens, capacity_of):
    """``check()`` (the op's checks, returning its implementation) unless this call signature has passed
    them; the values of a CPU ``seq_lens`` are checked either way (``capacity_of()``: the cache's tokens)."""
    num_splits, impl, scale = scalars
    sig = _signature(op, tensors, (type(num_splits), num_splits, impl, scale is None))
    which = _validated.get(sig) if sig is not None else None
    if which is None:
        which = check()
        if sig is not None:
            _validated.put(sig, which)
    elif seq_lens.device.type == "cpu" and seq_lens.numel():
        _check_seq_lens(seq_lens, seq_lens.shape[0], capacity_of())
    return which


def decode_attention(q, k_cache, v_cache, seq_lens, *, block_table=None, scale=None, num_splits=None,
                     return_lse=False, impl="auto"):
    """Grouped-head decode over a KV cache (GQA / MQA / MHA), split-KV on CUDA.

    Args:
        q: ``[B, Hq, D]`` (one new token per sequence) or ``[B, Hq, S, D]`` (S new tokens, causal
            among themselves). Query head h reads KV head ``h // (Hq // Hkv)``.
        k_cache, v_cache: contiguous ``[B, Hkv, N, D]`` / ``[B, Hkv, N, Dv]``, or paged
            ``[num_pages, P, Hkv, D]`` / ``[num_pages, P, Hkv, Dv]`` when ``block_table`` is given.
            Same dtype as q.
        seq_lens: int32 ``[B]``: valid cached tokens of each sequence, the S new ones included (they
            must already be written). 0 is allowed: that row's output is 0 and its lse -inf.
            New token s sees cache positions ``j < seq_lens[b] - S + 1 + s``; with S = 2 and
            seq_lens = 5::

                cache j:  0 1 2 3 4
                token 0:  1 1 1 1 0
                token 1:  1 1 1 1 1
        block_table: int32 ``[B, max_pages]``; page j of sequence b is ``block_table[b, j]``.
            Entries past a sequence's last page are never read.
        scale: default ``D ** -0.5``.
        num_splits: split-KV intervals per sequence (CUDA); None picks one from the shapes.
        return_lse: also return lse ``[B, Hq, (S)]`` float32.
        impl: ``"auto" | "triton" | "reference"``.

    Returns:
        o ``[B, Hq, (S,) Dv]`` in q's dtype (+ lse).

    Example:
        >>> import torch, mla_attn
        >>> q = torch.randn(2, 8, 64); k = torch.randn(2, 2, 16, 64); v = torch.randn(2, 2, 16, 64)
        >>> mla_attn.decode_attention(q, k, v, torch.tensor([16, 3], dtype=torch.int32)).shape
        torch.Size([2, 8, 64])
    """
    which = _validate("decode_attention", (q, k_cache, v_cache, seq_lens, block_table), (num_splits, impl, scale),
                      lambda: _check_decode_attention(q, k_cache, v_cache, seq_lens, block_table, num_splits, impl),
                      seq_lens, lambda: k_cache.shape[2] if block_table is None
                      else block_table.shape[1] * k_cache.shape[1])
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(2) if squeeze else q
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if which == "triton":
        from .triton_decode import gqa_decode

        o, lse = gqa_decode(q4, k_cache, v_cache, _as_int32(seq_lens), _as_int32(block_table), float(scale),
                            num_splits)
    else:
        o, lse = decode_reference(q4, k_cache, v_cache, seq_lens, block_table, float(scale))
    if squeeze:
        o, lse = o.squeeze(2), lse.squeeze(2)
    return (o, lse) if return_lse else o


def _check_decode_attention(q, k_cache, v_cache, seq_lens, block_table, num_splits, impl):
    """decode_attention's checks -> the implementation that runs it."""
    check_dim("q", q, (3, 4), "[B, Hq, D] or [B, Hq, S, D]")
    check_float("q", q)
    check_dim("k_cache", k_cache, (4,), "[B, Hkv, N, D] (contiguous) or [num_pages, P, Hkv, D] (paged)")
    check_dim("v_cache", v_cache, (4,), "[B, Hkv, N, Dv] (contiguous) or [num_pages, P, Hkv, Dv] (paged)")
    check_same_dtype("q", q, k_cache=k_cache, v_cache=v_cache)
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_table=block_table)
    _check_num_splits(num_splits)
    b, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"contiguous k_cache must be [B, Hkv, N, D] with B = {b}, got {tuple(k_cache.shape)}")
        hkv, n = k_cache.shape[1], k_cache.shape[2]
        token_shape, capacity = k_cache.shape[:3], n
        if v_cache.shape[:3] != token_shape:
            raise ValueError(f"v_cache must share [B, Hkv, N] with k_cache: k_cache {tuple(k_cache.shape)}, "
                             f"v_cache {tuple(v_cache.shape)}")
    else:
        _check_block_table(block_table, b)
        hkv = k_cache.shape[2]
        token_shape, capacity = k_cache.shape[:3], block_table.shape[1] * k_cache.shape[1]
        if v_cache.shape[:3] != token_shape:
            raise ValueError(f"paged v_cache must share [num_pages, P, Hkv] with k_cache: k_cache "
                             f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if k_cache.shape[-1] != d:
        raise ValueError(f"k_cache's head dim must equal q's: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's heads (Hq={hq}) must be a multiple of the cache's KV heads (Hkv={hkv}): "
                         f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    _check_seq_lens(seq_lens, b, capacity)
    return resolve_impl(impl, q, k_cache, v_cache, op="decode_attention")


def mla_decode(q_latent, q_rope, kv_latent, k_rope, seq_lens, *, scale, block_table=None, num_splits=None,
               return_lse=False, impl="auto"):
    """Absorbed MLA decode: MQA over the latent cache whose value is the latent itself.

    score_j = ``scale * (q_latent . c_j + q_rope . kr_j)``; output = softmax-weighted sum of c_j.

    Args:
        q_latent: ``[B, H, Dc]`` or ``[B, H, S, Dc]`` (q_nope already multiplied by W_UK).
        q_rope: ``[B, H, Dr]`` or ``[B, H, S, Dr]``, or None when Dr = 0 (NoPE MLA).
        kv_latent: contiguous ``[B, N, Dc]`` or paged ``[num_pages, P, Dc]``.
        k_rope: ``[B, N, Dr]`` or ``[num_pages, P, Dr]`` (may be views into one
            ``[num_pages, P, Dc + Dr]`` buffer), or None with q_rope None.
        seq_lens, block_table, num_splits, return_lse, impl: as in :func:`decode_attention`.
        scale: required; for DeepSeek ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * mscale**2``.

    Returns:
        latent output ``[B, H, (S,) Dc]`` in q_latent's dtype (+ lse float32).
    """
    which = _validate("mla_decode", (q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table),
                      (num_splits, impl, scale),
                      lambda: _check_mla_decode(q_latent, q_rope, kv_latent, k_rope, seq_lens, scale, block_table,
                                                num_splits, impl),
                      seq_lens, lambda: kv_latent.shape[1] if block_table is None
                      else block_table.shape[1] * kv_latent.shape[1])
    squeeze = q_latent.dim() == 3
    ql = q_latent.unsqueeze(2) if squeeze else q_latent
    qr = None if q_rope is None else (q_rope.unsqueeze(2) if squeeze else q_rope)
    if which == "triton":
        from .triton_decode import mla_decode as mla_decode_triton

        o, lse = mla_decode_triton(ql, qr, kv_latent, k_rope, _as_int32(seq_lens), _as_int32(block_table),
                                   float(scale), num_splits)
    else:
        o, lse = mla_decode_reference(ql, qr, kv_latent, k_rope, seq_lens, block_table, float(scale))
    if squeeze:
        o, lse = o.squeeze(2), lse.squeeze(2)
    return (o, lse) if return_lse else o


def _check_mla_decode(q_latent, q_rope, kv_latent, k_rope, seq_lens, scale, block_table, num_splits, impl):
    """mla_decode's checks -> the implementation that runs it."""
    check_dim("q_latent", q_latent, (3, 4), "[B, H, Dc] or [B, H, S, Dc]")
    check_float("q_latent", q_latent)
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope must both be tensors or both be None (Dr = 0), got "
                         f"q_rope={'None' if q_rope is None else tuple(q_rope.shape)}, "
                         f"k_rope={'None' if k_rope is None else tuple(k_rope.shape)}")
    layout = "[num_pages, P, Dc] (paged)" if block_table is not None else "[B, N, Dc] (contiguous)"
    check_dim("kv_latent", kv_latent, (3,), layout)
    check_same_dtype("q_latent", q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope)
    check_same_device("q_latent", q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope, seq_lens=seq_lens,
                      block_table=block_table)
    if scale is None:
        raise ValueError("scale is required for mla_decode (DeepSeek: (qk_nope_head_dim + qk_rope_head_dim)**-0.5 "
                         "times the YaRN mscale**2)")
    _check_num_splits(num_splits)
    b, dc = q_latent.shape[0], q_latent.shape[-1]
    if q_rope is not None:
        if q_rope.dim() != q_latent.dim() or q_rope.shape[:-1] != q_latent.shape[:-1]:
            raise ValueError(f"q_rope must match q_latent's leading dims: q_latent {tuple(q_latent.shape)}, "
                             f"q_rope {tuple(q_rope.shape)}")
        if k_rope.dim() != 3 or k_rope.shape[:2] != kv_latent.shape[:2] or k_rope.shape[-1] != q_rope.shape[-1]:
            raise ValueError(f"k_rope must be {tuple(kv_latent.shape[:2]) + (q_rope.shape[-1],)} to match kv_latent "
                             f"{tuple(kv_latent.shape)} and q_rope {tuple(q_rope.shape)}, got {tuple(k_rope.shape)}")
    if kv_latent.shape[-1] != dc:
        raise ValueError(f"kv_latent's width must equal q_latent's (Dc): q_latent {tuple(q_latent.shape)}, "
                         f"kv_latent {tuple(kv_latent.shape)}")
    if block_table is None:
        if kv_latent.shape[0] != b:
            raise ValueError(f"contiguous kv_latent must be [B, N, Dc] with B = {b}, got {tuple(kv_latent.shape)}")
        capacity = kv_latent.shape[1]
    else:
        _check_block_table(block_table, b)
        capacity = block_table.shape[1] * kv_latent.shape[1]
    _check_seq_lens(seq_lens, b, capacity)
    return resolve_impl(impl, q_latent, q_rope, kv_latent, k_rope, op="mla_decode")


def merge_attention_states(o_parts, lse_parts, *, impl="auto"):
    """Combine partial attentions over disjoint key sets.

    Args:
        o_parts: ``[K, ..., Dv]`` partial outputs, each normalised over its own keys.
        lse_parts: ``[K, ...]`` their log-sum-exps (float32). A part with lse = -inf contributes nothing.

    Returns:
        ``(o [..., Dv] in o_parts' dtype, lse [...] float32)``; with every part -inf, o = 0 and lse = -inf.
    """
    if o_parts.dim() < 2:
        raise ValueError(f"o_parts must be [K, ..., Dv], got shape {tuple(o_parts.shape)}")
    check_float("o_parts", o_parts)
    if tuple(lse_parts.shape) != tuple(o_parts.shape[:-1]):
        raise ValueError(f"lse_parts must be o_parts' shape without its last dim, {tuple(o_parts.shape[:-1])}, "
                         f"got {tuple(lse_parts.shape)}")
    check_same_device("o_parts", o_parts, lse_parts=lse_parts)
    which = resolve_impl(impl, o_parts, lse_parts, op="merge_attention_states")
    if which == "triton":
        from .combine import merge_attention_states_triton

        return merge_attention_states_triton(o_parts, lse_parts.float())
    return merge_reference(o_parts, lse_parts)

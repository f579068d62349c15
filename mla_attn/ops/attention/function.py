"""Autograd and torch.library wrappers around the Triton flash attention launchers.

Tiers (as in FLA): kernels + launchers (triton_fwd.py, triton_bwd.py) -> custom ops
``mla_attn::flash_attn_fwd`` / ``mla_attn::flash_attn_bwd`` (opaque to torch.compile, with fake
implementations for tracing) -> ``FlashAttnFunction`` (autograd) -> ``flash_attention`` (autocast)
-> the public ``mla_attn.ops.attention`` (validation and dispatch, api.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _env
from .triton_bwd import flash_attn_bwd
from .triton_fwd import aligned_rows, flash_attn_fwd


def _unit_last(t: Tensor) -> Tensor:
    # The kernels take any strides but need unit stride along the head dim; copy only otherwise.
    return t if t.stride(-1) == 1 else t.contiguous()


# The Gluon forward (gluon_fwd.py: Hopper, bf16/fp16, head dims it supports) replaces the Triton one
# where it applies; MLA_ATTN_GLUON=0 in the environment keeps the Triton forward everywhere.
GLUON_FORWARD = _env.flag("MLA_ATTN_GLUON", True)
# [B, L, H, D] tensors seen as [B, H, L, D] (the layers' transposes) read in place by the Gluon forward,
# through [B * L, H * D] descriptors. On the H200 (827090c) that is 404-530 TFLOP/s on the four benchmark
# rows, 4-11% over the Triton forward reading the same strides. MLA_ATTN_GLUON_TOKEN_MAJOR=0 turns it off.
GLUON_TOKEN_MAJOR = _env.flag("MLA_ATTN_GLUON_TOKEN_MAJOR", True) and GLUON_FORWARD


def _token_major(t: Tensor) -> bool:
    return t.transpose(1, 2).is_contiguous()


def _gluon_takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    # Contiguous [B, H, L, D] (or, with GLUON_TOKEN_MAJOR, [B, L, H, D] transposes): any other strided
    # view would need a copy for TMA, which costs more than the kernel gains; the Triton kernel reads
    # strides.
    if not (GLUON_FORWARD and q.is_cuda):
        return False
    if not all(t.is_contiguous() or (GLUON_TOKEN_MAJOR and _token_major(t)) for t in (q, k, v)):
        return False
    from . import gluon_fwd

    return gluon_fwd.supported(q, k, v)


def _flash_attn_fwd_impl(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    # Unaligned rows copied first (aligned_rows): the copies are contiguous, so the Gluon forward may take them.
    q, k, v = aligned_rows(_unit_last(q), _unit_last(k), _unit_last(v))
    if _gluon_takes(q, k, v):
        from .gluon_fwd import flash_fwd_gluon

        return flash_fwd_gluon(q, k, v, causal=causal, scale=scale, token_major=GLUON_TOKEN_MAJOR)
    return flash_attn_fwd(q, k, v, causal, scale)


_flash_attn_fwd_op = torch.library.custom_op("mla_attn::flash_attn_fwd", _flash_attn_fwd_impl, mutates_args=())


@_flash_attn_fwd_op.register_fake
def _(q, k, v, causal, scale):
    b, hq, m, _ = q.shape
    return q.new_empty((b, hq, m, v.shape[-1])), q.new_empty((b, hq, m), dtype=torch.float32)


def _flash_attn_bwd_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor],
                         causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    do, q, k, v = aligned_rows(_unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v))
    return flash_attn_bwd(do, q, k, v, o.contiguous(), lse.contiguous(), causal, scale, dlse=dlse)


_flash_attn_bwd_op = torch.library.custom_op("mla_attn::flash_attn_bwd", _flash_attn_bwd_impl, mutates_args=())


@_flash_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)


def _fwd(q, k, v, causal, scale):
    # The custom ops are what torch.compile sees (opaque, with fake implementations). Eager calls go to the
    # launchers directly: the dispatcher's trip through a Python custom op costs ~25 us a call on the host,
    # and on small rows the host, not the GPU, sets the step time.
    if torch.compiler.is_compiling():
        return torch.ops.mla_attn.flash_attn_fwd(q, k, v, causal, scale)
    return _flash_attn_fwd_impl(q, k, v, causal, scale)


def _bwd(do, q, k, v, o, lse, dlse, causal, scale):
    if torch.compiler.is_compiling():
        return torch.ops.mla_attn.flash_attn_bwd(do, q, k, v, o, lse, dlse, causal, scale)
    return _flash_attn_bwd_impl(do, q, k, v, o, lse, dlse, causal, scale)


class FlashAttnFunction(torch.autograd.Function):
    """o, lse = FlashAttnFunction.apply(q, k, v, causal, scale); gradients of o and lse flow to q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = _fwd(q, k, v, causal, scale)
        # An output the loss does not use gets None, not a materialised zero: lse is unused in most steps, and
        # its zero gradient would cost a fill kernel and the preprocess's reads of it.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.scale = scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        # d lse_i / d s_ij = p_ij, so lse's gradient enters as dS = P * (dP - (delta - dlse)).
        q, k, v, o, lse = ctx.saved_tensors
        if do is None and dlse is None:
            return None, None, None, None, None
        if do is None:  # only lse was used
            do = torch.zeros_like(o)
        dq, dk, dv = _bwd(do, q, k, v, o, lse, dlse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Triton flash attention (inputs already validated by api.py).

    q [B, Hq, M, Dqk], k [B, Hkv, N, Dqk], v [B, Hkv, N, Dv] (Hq % Hkv == 0, kv_head = q_head // (Hq // Hkv)),
    any strides. Returns o [B, Hq, M, Dv] in q.dtype and lse float32 [B, Hq, M] (natural log, both
    differentiable). Causal is aligned bottom-right: query row i sees keys j <= i + N - M; a row that sees
    no key gives o = 0, lse = -inf and zero gradients. Under autocast the inputs are cast to the autocast
    dtype first (as ``torch.amp.custom_fwd(cast_inputs=...)`` would), so the kernel runs in fp16/bf16.
    """
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the Triton attention kernels take fp16, bf16 or fp32; got q {q.dtype} "
                         f"{tuple(q.shape)} (use impl='reference' for float64)")
    return FlashAttnFunction.apply(q, k, v, bool(causal), float(scale))

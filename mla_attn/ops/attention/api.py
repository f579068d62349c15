"""Public full-sequence attention op: validation and dispatch."""

from __future__ import annotations

import torch

from .._common import check_dim, check_float, check_same_device, check_same_dtype, resolve_impl
from .reference import attention_reference, attention_sdpa

FP32_MAX_HEAD_DIM = 256  # widest fp32 head the Triton kernels take on CUDA (see attention())


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              impl: str = "auto"):
    """Full-sequence attention for training and prefill (PyTorch SDPA layout).

    Args:
        q: ``[B, Hq, M, Dqk]`` float16 / bfloat16 / float32.
        k: ``[B, Hkv, N, Dqk]``, same dtype; ``Hq % Hkv == 0`` and query head h reads KV head
            ``h // (Hq // Hkv)`` (MHA: Hkv = Hq, MQA: Hkv = 1).
        v: ``[B, Hkv, N, Dv]``; Dv may differ from Dqk (MLA expanded: 192 / 128).
        causal: mask aligned to the bottom right: query row i sees keys ``j <= i + N - M``.
            With M = 2, N = 5 (a cached prefix of 3)::

                1 1 1 1 0
                1 1 1 1 1

            With M = 5, N = 2 the first three rows see no key and return 0 (lse = -inf)::

                0 0
                0 0
                0 0
                1 0
                1 1
        scale: score scale, default ``Dqk ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled scores, ``[B, Hq, M]`` float32.
        impl: ``"auto"`` (the GPU kernels on CUDA tensors, reference elsewhere: without ``return_lse``
            through PyTorch's ``scaled_dot_product_attention``, the readable path where that could differ),
            ``"triton"`` or ``"reference"`` (the readable path, ``reference.attention_reference``). The GPU
            kernels: on Hopper, for contiguous bf16/fp16 inputs, the forward and the backward's dK/dV pass are
            Gluon kernels (``gluon_fwd.py``, ``gluon_bwd.py``;
            ``MLA_ATTN_GLUON=0`` opts out); everything else is Triton.

    Returns:
        ``o [B, Hq, M, Dv]`` in q's dtype, and ``lse`` when ``return_lse``. Differentiable in q, k, v.

    Example:
        >>> import torch, mla_attn
        >>> q = torch.randn(1, 8, 5, 64); k = torch.randn(1, 2, 7, 64); v = torch.randn(1, 2, 7, 32)
        >>> mla_attn.attention(q, k, v, causal=True).shape
        torch.Size([1, 8, 5, 32])
    """
    check_dim("q", q, (4,), "[B, Hq, M, Dqk]")
    check_dim("k", k, (4,), "[B, Hkv, N, Dqk]")
    check_dim("v", v, (4,), "[B, Hkv, N, Dv]")
    check_float("q", q)
    check_same_dtype("q", q, k=k, v=v)
    check_same_device("q", q, k=k, v=v)
    b, hq, _, dqk = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must share [B, Hkv, N]: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-1] != dqk:
        raise ValueError(f"k's head dim must equal q's (Dqk): q {tuple(q.shape)}, k {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's heads (Hq={hq}) must be a multiple of k's heads (Hkv={hkv}): "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if dqk == 0:
        raise ValueError(f"q and k need a head dim (Dqk) of at least 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if scale is None:
        scale = dqk ** -0.5
    which = resolve_impl(impl, q, k, v, op="attention")
    if which == "triton" and not float(scale) > 0:
        # The kernels mask hidden keys with -inf before scaling and take the row max before scaling:
        # both need scale > 0 (scale = 0 gives NaN, a negative scale wrong rows).
        if impl == "triton":
            raise ValueError(f"attention: impl='triton' needs scale > 0, got {scale}; use impl='reference'")
        which = "reference"
    if which == "triton" and q.is_cuda and q.dtype == torch.float32 and max(dqk, v.shape[-1]) > FP32_MAX_HEAD_DIM:
        # fp32 dots run as exact FMA code (no tensor cores); at 576/512 its compile did not finish in
        # minutes on the H200. Wide fp32 heads stay on the reference path until that is tuned.
        if impl == "triton":
            raise ValueError(f"attention: impl='triton' runs float32 only up to head dims {FP32_MAX_HEAD_DIM}, got "
                             f"Dqk={dqk}, Dv={v.shape[-1]}; use bf16/fp16 or impl='reference'")
        which = "reference"
    if which == "triton":
        from .function import flash_attention

        o, lse = flash_attention(q, k, v, bool(causal), float(scale))
    else:
        o = None
        if impl == "auto" and not return_lse and not q.is_cuda:  # PyTorch's fused kernel: no [M, N] scores
            o = attention_sdpa(q, k, v, causal=bool(causal), scale=float(scale))
        if o is None:
            o, lse = attention_reference(q, k, v, causal=bool(causal), scale=float(scale))
    return (o, lse) if return_lse else o

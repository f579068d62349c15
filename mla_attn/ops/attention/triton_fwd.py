"""Flash attention forward: Triton kernel and its launcher.

One program per (query block, batch * query head). It keeps its query tile in registers and streams
the key/value tiles of its KV head (``kv_head = q_head // group``) through an online softmax, so no
score matrix and no expanded KV heads ever reach memory. The score width is split into a power-of-two
main part and a small tail (192 = 128 + 64, 576 = 512 + 64, 72 = 64 + 16 with 8 columns masked) so
MLA's 192-wide heads do not pay for 256. See README.md beside this file for the algebra.

Causal masking is aligned to the bottom right (query row i sees keys j <= i + N - M). For
``M = 2, N = 5`` (x = visible)::

    keys   0 1 2 3 4
    q0     x x x x .
    q1     x x x x x

and for ``M = 5, N = 2`` the first three rows see nothing: they get o = 0, lse = -inf.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import _env
from .. import _launch as _fast
from .._launch import Launch, PlanCache, Slot, tensor_key
from .._strides import _in_units, pow2_unit

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453  # the kernels write these as literals: Triton's JIT reads only tl.constexpr globals


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _alloc(shape, device, dtype) -> torch.Tensor:
    # Every buffer the launchers create goes through here, so tests can poison them with NaN.
    return torch.empty(shape, device=device, dtype=dtype)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp16/bf16 use the tensor cores as they are; fp32 inputs get true fp32
    products ("ieee") unless PyTorch is allowed tf32 for matmuls, as its own fp32 attention would."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def split_head_dim(d: int) -> tuple[int, int]:
    """Split a head width into (main, tail) tile widths: main the largest power of two <= d (>= 16),
    tail the next power of two >= the remainder (>= 16), or 0 when nothing remains."""
    main = max(16, 1 << (d.bit_length() - 1))
    rest = d - main
    tail = 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))
    return main, tail


# MLA_ATTN_STRIDE_UNITS=0 passes every stride as it is (stride_unit gives 1), MLA_ATTN_VALUE_SPLIT=0 pads the
# value head to its power of two (split_value_dim gives no tail): for A/B timing only.
STRIDE_UNITS = _env.flag("MLA_ATTN_STRIDE_UNITS", True)
VALUE_SPLIT = _env.flag("MLA_ATTN_VALUE_SPLIT", True)


def stride_unit(*tensors) -> int:
    """What the launchers divide every leading (non-head-dim) stride by, the kernels multiplying it back (their
    ``STRIDE_UNIT``): 1 when those strides are all multiples of 16 elements, else the largest power of two
    dividing them all.

    Triton marks an integer argument as 16-divisible only when it is. A row of 72 elements is not, so every
    address built from such a stride looked unaligned: the loads went one element at a time, with no
    ``cp.async`` pipeline (the forward at d 72 read 0.35 of SDPA on the H100). Passed as ``stride // 8`` and
    multiplied by the constant 8 in the kernel, the same addresses are known to be 16-byte aligned."""
    if not STRIDE_UNITS:
        return 1
    return pow2_unit(s for t in tensors if t is not None for s in t.stride()[:-1])


def unit_strides(t: torch.Tensor, unit: int) -> tuple[int, ...]:
    """t's strides with all but the last (the head-dim stride) divided by ``unit`` (see :func:`stride_unit`)."""
    st = t.stride()
    return tuple(x // unit for x in st[:-1]) + st[-1:]


def split_value_dim(d: int, aligned: bool = True) -> tuple[int, int]:
    """Tile widths (main, tail) for a value head of width d: :func:`split_head_dim`'s split where it is narrower
    than d's power of two (72 -> 64 + 16, 96 -> 64 + 32, 40 -> 32 + 16), else (that power of two, 0).

    Only for ``aligned`` rows (:func:`rows_aligned`). With rows that are not, the loads go an element at a time
    and Triton 3.6 miscompiles the split for sm_90: wrong outputs, or a shared-memory read out of bounds
    (compute-sanitizer, H200, session 29; ``scripts/debug_value_split.py``). The padded tile is right there."""
    full = max(16, triton.next_power_of_2(d))
    main, tail = split_head_dim(d)
    return (main, tail) if VALUE_SPLIT and aligned and tail and main + tail < full else (full, 0)


def aligned_rows(*tensors) -> tuple:
    """``tensors`` as the kernels should get them: when some rows are not 16-byte aligned (views into padded
    storage, say) and a copy would align them all, those copied to fresh contiguous storage; else as they are.

    Unaligned rows mean element-wide loads (no ``cp.async``, spills; 0.35 of SDPA at d 72 on the H100), and
    Triton 3.6's sm_90 code for them is not to be trusted: the value-head split was wrong there, and at 160/160
    the unsplit kernel (score 128 + 32, value padded to 256) faulted (H100 and H200, session 29). One copy of
    q, k and v costs far less than either. Rows whose width is no multiple of 16 bytes (d 63 in fp16) stay
    as they are: a copy would not align them."""
    if rows_aligned(*tensors):
        return tensors
    if any(t is not None and t.shape[-1] * t.element_size() % 16 for t in tensors):
        return tensors
    return tuple(t if t is None or rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)
                 for t in tensors)


def rows_aligned(*tensors) -> bool:
    """Whether every tensor starts on 16 bytes and every leading stride is a multiple of 16 bytes: the kernels'
    loads are then 16 bytes wide (with :func:`stride_unit`)."""
    return all(t is None or (t.data_ptr() % 16 == 0 and all(x * t.element_size() % 16 == 0 for x in t.stride()[:-1]))
               for t in tensors)


try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - very old triton
    OutOfResources = RuntimeError

# Smaller tiles to fall back on, in order, when a table entry does not fit the GPU's shared memory or
# registers (fp32 inputs, head widths nobody measured): (BLOCK_M, BLOCK_N, num_warps, num_stages).
FALLBACK_CONFIGS = ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1))
_chosen: dict = {}


def launch_with_fallback(launch, key, first: tuple[int, int, int, int], pinned: bool = False):
    """Call ``launch(config)`` with ``first``, else the fallbacks that fit, remembering per ``key`` what worked.

    Out-of-resources is raised while compiling, on the host, before anything is queued, so trying the
    next config costs a compile once per key and never a device synchronisation. ``pinned`` (a config
    the caller asked for) disables the fallback.
    """
    if pinned:
        return launch(first)
    if key in _chosen:
        return launch(_chosen[key])
    for cfg in (first,) + tuple(c for c in FALLBACK_CONFIGS if c != first):
        try:
            out = launch(cfg)
        except OutOfResources:
            continue
        _chosen[key] = cfg
        return out
    raise RuntimeError(f"flash attention: no tile configuration fits this GPU for {key}")


# Forward tile table, measured on the H200 (triton 3.6, bf16, see README.md): keyed by
# (Dqk main+tail width, padded Dv) ranges. (BLOCK_M, BLOCK_N, num_warps, num_stages)
def _fwd_config(dqk_tiles: int, dv_tile: int, causal: bool) -> tuple[int, int, int, int]:
    if _interpreting():
        return 32, 32, 4, 1
    width = max(dqk_tiles, dv_tile)
    if width <= 192:
        return 128, 64, 8, 3
    # Very wide heads (MLA un-absorbed 576/512): keep the accumulator within the register file.
    return 64, 32, 8, 2


@triton.jit
def _fwd_inner(
    acc, acc1, l_i, m_i, q0, q1,
    k_ptrs0, k_ptrs1, v_ptrs, v_ptrs1, stride_kn, stride_vn,
    offs_m, offs_n, offs_dq1, offs_dv, offs_dv1,
    lo, hi, N, causal_shift, qk_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DQK1: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV1: tl.constexpr,
    PAD_DQK1: tl.constexpr, PAD_DV: tl.constexpr, PAD_DV1: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Stream key blocks [lo, hi). MASKED: the block may hold keys >= N or causally hidden keys.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n = start_n + offs_n  # [BLOCK_N]
        m_n = o_n < N
        # Row offsets of this key tile in int64: start_n * stride can pass 2^31 (strided [B, N, H, D] views).
        off_kn = tl.cast(start_n, tl.int64) * stride_kn
        off_vn = tl.cast(start_n, tl.int64) * stride_vn
        # k^T tiles: [BLOCK_DQK, BLOCK_N]
        if MASKED:
            b_k0 = tl.load(k_ptrs0 + off_kn, mask=m_n[None, :], other=0.0)
        else:
            b_k0 = tl.load(k_ptrs0 + off_kn)
        b_s = tl.dot(q0, b_k0, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] fp32
        if BLOCK_DQK1 > 0:
            if MASKED:
                b_k1 = tl.load(k_ptrs1 + off_kn, mask=m_n[None, :] & (offs_dq1[:, None] < D_QK), other=0.0)
            elif PAD_DQK1:
                b_k1 = tl.load(k_ptrs1 + off_kn, mask=offs_dq1[:, None] < D_QK, other=0.0)
            else:
                b_k1 = tl.load(k_ptrs1 + off_kn)
            b_s += tl.dot(q1, b_k1, input_precision=DOT_PREC)
        if MASKED:
            visible = m_n[None, :]
            if CAUSAL:
                visible = visible & (o_n[None, :] <= offs_m[:, None] + causal_shift)
            b_s = tl.where(visible, b_s, float("-inf"))
        # Online softmax in log2 units (qk_scale = scale * log2(e), applied in one FMA with the max).
        # m_i starts at a finite -1e30, so a fully hidden block gives p = 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)  # [BLOCK_M]
        b_p = tl.math.exp2(b_s * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None]
        if BLOCK_DV1 > 0:
            acc1 = acc1 * alpha[:, None]
        if MASKED:
            b_v = tl.load(v_ptrs + off_vn,
                          mask=m_n[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # [BLOCK_N, BLOCK_DV]
        elif PAD_DV:
            b_v = tl.load(v_ptrs + off_vn, mask=offs_dv[None, :] < D_V, other=0.0)
        else:
            b_v = tl.load(v_ptrs + off_vn)
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=DOT_PREC)
        if BLOCK_DV1 > 0:  # the value tail (columns BLOCK_DV ..): a second, narrow accumulator
            if MASKED:
                b_v1 = tl.load(v_ptrs1 + off_vn, mask=m_n[:, None] & (offs_dv1[None, :] < D_V), other=0.0)
            elif PAD_DV1:
                b_v1 = tl.load(v_ptrs1 + off_vn, mask=offs_dv1[None, :] < D_V, other=0.0)
            else:
                b_v1 = tl.load(v_ptrs1 + off_vn)
            acc1 = tl.dot(b_p.to(b_v1.dtype), b_v1, acc1, input_precision=DOT_PREC)
        m_i = m_new
    return acc, acc1, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om,
    H_Q, M, N, causal_shift, qk_scale,
    GROUP: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DQK0: tl.constexpr, BLOCK_DQK1: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    STRIDE_UNIT: tl.constexpr = 1, BLOCK_DV1: tl.constexpr = 0,
):
    # BLOCK_DV1 > 0: the value head split as the score's is (split_value_dim): columns [0, BLOCK_DV) in one
    # accumulator, [BLOCK_DV, BLOCK_DV + BLOCK_DV1) in a second, so a 72-wide head computes 80 columns, not 128.
    if STRIDE_UNIT != 1:  # the leading strides came divided by it (stride_unit): their alignment is now known
        stride_qb, stride_qh, stride_qm = _in_units(stride_qb, stride_qh, stride_qm, STRIDE_UNIT)
        stride_kb, stride_kh, stride_kn = _in_units(stride_kb, stride_kh, stride_kn, STRIDE_UNIT)
        stride_vb, stride_vh, stride_vn = _in_units(stride_vb, stride_vh, stride_vn, STRIDE_UNIT)
        stride_ob, stride_oh, stride_om = _in_units(stride_ob, stride_oh, stride_om, STRIDE_UNIT)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // H_Q
    i_hq = pid_bh % H_Q
    i_hk = i_hq // GROUP
    # int64 base offsets: batch * stride can pass 2^31 for large tensors.
    Q += i_b.to(tl.int64) * stride_qb + i_hq.to(tl.int64) * stride_qh
    K += i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    V += i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    O += i_b.to(tl.int64) * stride_ob + i_hq.to(tl.int64) * stride_oh
    LSE += pid_bh.to(tl.int64) * M

    # Causal: the last query blocks see the most keys; launch them first for a balanced tail.
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # Pointers step to row start_m in int64 (start_m * stride_qm can pass 2^31 for a strided
    # [B, M, H, D] view); rows within the block use the small offsets o_mb.
    o_mb = tl.arange(0, BLOCK_M)
    Q += start_m.to(tl.int64) * stride_qm
    O += start_m.to(tl.int64) * stride_om
    offs_n = tl.arange(0, BLOCK_N)
    offs_dq0 = tl.arange(0, BLOCK_DQK0)
    offs_dq1 = BLOCK_DQK0 + tl.arange(0, BLOCK_DQK1 if BLOCK_DQK1 > 0 else 16)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dv1 = BLOCK_DV + tl.arange(0, BLOCK_DV1 if BLOCK_DV1 > 0 else 16)
    PAD_DV1: tl.constexpr = BLOCK_DV + BLOCK_DV1 > D_V
    PAD_DQK0: tl.constexpr = BLOCK_DQK0 > D_QK
    PAD_DQK1: tl.constexpr = BLOCK_DQK0 + BLOCK_DQK1 > D_QK
    PAD_DV: tl.constexpr = BLOCK_DV > D_V
    m_m = offs_m < M

    # q tiles [BLOCK_M, BLOCK_DQK0] (+ tail [BLOCK_M, BLOCK_DQK1]) stay in registers.
    if PAD_DQK0:
        q0 = tl.load(Q + o_mb[:, None] * stride_qm + offs_dq0[None, :] * stride_qd,
                     mask=m_m[:, None] & (offs_dq0[None, :] < D_QK), other=0.0)
    else:
        q0 = tl.load(Q + o_mb[:, None] * stride_qm + offs_dq0[None, :] * stride_qd,
                     mask=m_m[:, None], other=0.0)
    if BLOCK_DQK1 > 0:
        q1 = tl.load(Q + o_mb[:, None] * stride_qm + offs_dq1[None, :] * stride_qd,
                     mask=m_m[:, None] & (offs_dq1[None, :] < D_QK), other=0.0)
    else:
        q1 = q0
    # Key tiles are read transposed: [BLOCK_DQK, BLOCK_N].
    k_ptrs0 = K + offs_n[None, :] * stride_kn + offs_dq0[:, None] * stride_kd
    k_ptrs1 = K + offs_n[None, :] * stride_kn + offs_dq1[:, None] * stride_kd
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    v_ptrs1 = V + offs_n[:, None] * stride_vn + offs_dv1[None, :] * stride_vd
    if PAD_DQK0:
        # Only for Dqk < 16: fold the column mask into the key pointer range by clamping reads
        # to column 0 and zeroing q's padded columns (already zero above), so no extra mask is needed.
        k_ptrs0 = K + offs_n[None, :] * stride_kn + tl.where(offs_dq0 < D_QK, offs_dq0, 0)[:, None] * stride_kd

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if BLOCK_DV1 > 0:
        acc1 = tl.zeros([BLOCK_M, BLOCK_DV1], dtype=tl.float32)
    else:
        acc1 = acc  # no tail: passed through the loops untouched
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)

    # Key range: causal rows of this block see at most keys < start_m + BLOCK_M + shift.
    if CAUSAL:
        hi = tl.minimum(N, tl.maximum(start_m + BLOCK_M + causal_shift, 0))
        # Keys < start_m + shift + 1 are visible to every row of the block.
        full = tl.maximum(tl.minimum(start_m + causal_shift + 1, N), 0)
    else:
        hi = N
        full = N
    full = (full // BLOCK_N) * BLOCK_N
    acc, acc1, l_i, m_i = _fwd_inner(
        acc, acc1, l_i, m_i, q0, q1, k_ptrs0, k_ptrs1, v_ptrs, v_ptrs1, stride_kn, stride_vn,
        offs_m, offs_n, offs_dq1, offs_dv, offs_dv1, 0, full, N, causal_shift, qk_scale,
        D_QK, D_V, BLOCK_DQK1, BLOCK_DV, BLOCK_DV1, PAD_DQK1, PAD_DV, PAD_DV1,
        False, CAUSAL, BLOCK_N, DOT_PREC,
    )
    acc, acc1, l_i, m_i = _fwd_inner(
        acc, acc1, l_i, m_i, q0, q1, k_ptrs0, k_ptrs1, v_ptrs, v_ptrs1, stride_kn, stride_vn,
        offs_m, offs_n, offs_dq1, offs_dv, offs_dv1, full, hi, N, causal_shift, qk_scale,
        D_QK, D_V, BLOCK_DQK1, BLOCK_DV, BLOCK_DV1, PAD_DQK1, PAD_DV, PAD_DV1,
        True, CAUSAL, BLOCK_N, DOT_PREC,
    )

    # Rows that saw no key have l_i = 0: o = 0 and lse = -inf (log2(0) = -inf), never NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + offs_m, b_lse, mask=m_m)
    o_ptrs = O + o_mb[:, None] * stride_om + offs_dv[None, :]
    if PAD_DV:
        tl.store(o_ptrs, b_o.to(O.dtype.element_ty), mask=m_m[:, None] & (offs_dv[None, :] < D_V))
    else:
        tl.store(o_ptrs, b_o.to(O.dtype.element_ty), mask=m_m[:, None])
    if BLOCK_DV1 > 0:
        b_o1 = acc1 / l_safe[:, None]
        o_ptrs1 = O + o_mb[:, None] * stride_om + offs_dv1[None, :]
        if PAD_DV1:
            tl.store(o_ptrs1, b_o1.to(O.dtype.element_ty), mask=m_m[:, None] & (offs_dv1[None, :] < D_V))
        else:
            tl.store(o_ptrs1, b_o1.to(O.dtype.element_ty), mask=m_m[:, None])


def flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention forward.

    q [B, Hq, M, Dqk], k [B, Hkv, N, Dqk], v [B, Hkv, N, Dv] (fp16/bf16/fp32, any strides with a
    unit last-dim stride), Hq % Hkv == 0. Returns o [B, Hq, M, Dv] in q.dtype (contiguous) and
    lse float32 [B, Hq, M] (natural log; -inf for rows that see no key). ``config`` overrides the
    tile table: (BLOCK_M, BLOCK_N, num_warps, num_stages). Never synchronises with the host. Calls with the
    default tiles replay a plan kept per call key (:class:`_FwdPlan`).
    """
    key = None
    if _fast.enabled() and config is None:
        key = (tensor_key(q), tensor_key(k), tensor_key(v), bool(causal), dot_precision(q.dtype), STRIDE_UNITS,
               VALUE_SPLIT)
        plan = _plans.get(key)
        if plan is not None:
            return plan.run(q, k, v, scale)
    B, Hq, M, Dqk = q.shape
    Hkv, N, Dv = k.shape[1], k.shape[2], v.shape[3]
    o = _alloc((B, Hq, M, Dv), q.device, q.dtype)
    lse = _alloc((B, Hq, M), q.device, torch.float32)
    if B * Hq * M == 0:
        return o, lse
    bq0, bq1 = split_head_dim(Dqk)
    bdv, bdv1 = split_value_dim(Dv, rows_aligned(q, k, v, o))
    values = (q, k, v, o, lse, scale * LOG2E)  # the per-call values: Slot(i) is the i-th
    unit = stride_unit(q, k, v, o)

    def launch(cfg):  # a Launch of this config, launched once here (compiling: out of resources raises)
        block_m, block_n, warps, stages = cfg
        run = Launch(_flash_fwd_kernel, (triton.cdiv(M, block_m), B * Hq), (
            Slot(0), Slot(1), Slot(2), Slot(3), Slot(4),
            *unit_strides(q, unit), *unit_strides(k, unit), *unit_strides(v, unit), *unit_strides(o, unit)[:3],
            Hq, M, N, N - M, Slot(5),
        ), dict(GROUP=Hq // Hkv, D_QK=Dqk, D_V=Dv, BLOCK_DQK0=bq0, BLOCK_DQK1=bq1, BLOCK_DV=bdv, CAUSAL=bool(causal),
                BLOCK_M=block_m, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype), STRIDE_UNIT=unit, BLOCK_DV1=bdv1),
            dict(num_warps=warps, num_stages=stages))
        run(*values)
        return run

    # fp32 tiles take twice the bytes of fp16/bf16 ones: look them up as twice as wide.
    width = (bq0 + bq1) * q.element_size() // 2
    first = config or _fwd_config(width, (bdv + bdv1) * q.element_size() // 2, causal)
    plan = _FwdPlan()
    plan.o_shape, plan.lse_shape = o.shape, lse.shape
    fkey = ("fwd", q.device.index, q.dtype, bq0, bq1, bdv, bdv1, bool(causal), unit)
    plan.launch = launch_with_fallback(launch, fkey, first,
                                       pinned=config is not None)
    if key is not None:
        _plans.put(key, plan)
    return o, lse


class _FwdPlan:
    """:func:`flash_attn_fwd`'s host decisions for one call key (output shapes, the tile config that fit, as a
    binder-free :class:`Launch`), replayed by later calls with the same layouts (as triton_bwd._BwdPlan)."""

    __slots__ = ("o_shape", "lse_shape", "launch")

    def run(self, q, k, v, scale):
        o = _alloc(self.o_shape, q.device, q.dtype)
        lse = _alloc(self.lse_shape, q.device, torch.float32)
        self.launch(q, k, v, o, lse, scale * LOG2E)
        return o, lse


# flash_attn_fwd's plans by call key; cleared by the tests around each test (tests/conftest.py).
_plans = PlanCache()

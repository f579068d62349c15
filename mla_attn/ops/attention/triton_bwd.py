"""Flash attention backward: Triton kernels and their launcher.

Three launches, none with atomics, so results are bitwise reproducible:

1. ``_bwd_preprocess``: delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] - dlse[b, h, i]   (float32;
   dlse, the gradient of lse, is 0 at rows with lse = -inf and when lse is not used).
2. ``_bwd_dkdv_kernel``: one program per (key block, batch * KV head). It keeps its K/V tiles and
   the dK/dV accumulators in registers and loops over the ``group`` query heads that share the KV
   head and over their query blocks, recomputing P^T from the saved LSE. GQA/MQA gradients are
   thus summed inside one program: no per-query-head partial buffer, no reduction pass.
3. ``_bwd_dq_kernel``: one program per (query block, batch * query head), streaming key blocks.

With P = exp(S - lse), dP = dO V^T, dS = P * (dP - delta): dV = P^T dO, dK = scale * dS^T Q,
dQ = scale * dS K. Rows that saw no key (lse = -inf) are read as lse = +inf, so P = 0 there and
their gradients are 0. Causal alignment is bottom-right, as in the forward (triton_fwd.py).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .. import _env
from .. import _launch as _fast
from .._launch import Launch, PlanCache, Slot, tensor_key
from . import triton_fwd
from .triton_fwd import (LOG2E, _in_units, _interpreting, dot_precision, launch_with_fallback, rows_aligned,
                         split_head_dim, split_value_dim, stride_unit, unit_strides)


# On Hopper the dK/dV pass runs the Gluon kernel (gluon_bwd.py) where it applies; MLA_ATTN_GLUON=0 keeps
# the Triton one (as it keeps the Triton forward, function.py).
GLUON_DKDV = _env.flag("MLA_ATTN_GLUON", True)
# The Gluon dQ pass (gluon_bwd.dq_gluon) passes its oracle tests on the H200 (827090c) but does not beat
# the Triton dQ pass there (fwd+bwd 386 / 383 / 319 / 337 TFLOP/s against 383-395 / 376-379 / 286-324 /
# 344-348 for the Triton dQ, same run): off unless MLA_ATTN_GLUON_DQ=1.
GLUON_DQ = _env.flag("MLA_ATTN_GLUON_DQ", False) and GLUON_DKDV
# Token-major inputs ([B, L, H, D] seen through transpose(1, 2), the layers' layout) read in place by the
# Gluon dK/dV pass, as by the forward (function.py); MLA_ATTN_GLUON_TOKEN_MAJOR=0 turns both off.
GLUON_TOKEN_MAJOR = _env.flag("MLA_ATTN_GLUON_TOKEN_MAJOR", True) and GLUON_DKDV
# The dQ pass and the dK/dV pass read the same inputs and write different outputs, so they can run at
# once: with this on, the dQ pass goes to a side stream (forked from and joined back to the current one)
# and its programs fill the SMs that the dK/dV pass's last wave leaves idle. Each pass stays
# deterministic, and the gradients are bitwise those of one stream (test_gpu_side_stream_dq_same_gradients,
# also from a captured CUDA graph). On the H200 (d3655cf, bench_attention.py --gluon, the two timed in
# A B B A order in one run) fwd+bwd went 381 -> 384, 379 -> 384, 307 -> 318, 343 -> 342 TFLOP/s on the
# four benchmark rows: on by default; MLA_ATTN_BWD_SIDE_STREAM=0 keeps one stream.
SIDE_STREAM_DQ = _env.flag("MLA_ATTN_BWD_SIDE_STREAM", True)
# ... but only where the backward has this much work, B * Hq * M * N * (Dqk + Dv) (half that when causal):
# the fork and join cost 33-81 us of host time a step (profile_launch.py --train, the launcher alone with the
# side stream and without, three H100 calls: 530 vs 449, 584 vs 504, 392 vs 359 us), and below it a step is
# host-bound, so that time is the step's, while the overlap gains 1-3% of the GPU time. 8e10 is ~2 ms of fwd+bwd on the H100/H200 (16 x 16/8 x 1024 x 128, 3.4e10,
# replays in 0.80 ms), above the ~1.3 ms of host time a step takes there.
SIDE_STREAM_MIN_WORK = _env.number("MLA_ATTN_BWD_SIDE_STREAM_MIN_WORK", 8e10)
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One side stream per device, made once (a stream per call would cost a driver call each time)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


# Backward tile tables (BLOCK_M, BLOCK_N, num_warps, num_stages), measured on the H200
# (triton 3.6, bf16, see README.md). The dK/dV pass owns BLOCK_N keys; the dQ pass owns BLOCK_M rows.
def _dkdv_config(dqk_tiles: int, dv_tile: int, causal: bool) -> tuple[int, int, int, int]:
    if _interpreting():
        return 16, 32, 4, 1
    width = max(dqk_tiles, dv_tile)
    if width <= 192:
        return 64, 128, 8, 3
    return 16, 32, 8, 1


def _dq_config(dqk_tiles: int, dv_tile: int, causal: bool) -> tuple[int, int, int, int]:
    if _interpreting():
        return 32, 16, 4, 1
    width = max(dqk_tiles, dv_tile)
    if width <= 192:
        return 128, 64, 8, 3
    return 32, 16, 8, 1


@triton.jit
def _bwd_preprocess(
    O, DO, DELTA, LSE, DLSE,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    H_Q, M,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    STRIDE_UNIT: tl.constexpr = 1,
):
    if STRIDE_UNIT != 1:  # O's and dO's leading strides came divided by it (triton_fwd.stride_unit)
        stride_ob, stride_oh, stride_om = _in_units(stride_ob, stride_oh, stride_om, STRIDE_UNIT)
        stride_dob, stride_doh, stride_dom = _in_units(stride_dob, stride_doh, stride_dom, STRIDE_UNIT)
    # delta = rowsum(dO * O), less lse's own gradient where it has one: dS = P * (dP - delta + dlse). Rows
    # with lse = -inf have P = 0; their dlse is dropped so that a NaN there cannot reach dS (0 * NaN).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // H_Q
    i_h = pid_bh % H_Q
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    o_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < M) & (offs_d[None, :] < D_V)
    # int64 row offsets: start_m * stride_dom can pass 2^31 for a strided dO.
    O += i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh + start_m.to(tl.int64) * stride_om
    DO += i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh + start_m.to(tl.int64) * stride_dom
    b_o = tl.load(O + o_mb[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
    b_do = tl.load(DO + o_mb[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BLOCK_M]
    if HAS_DLSE:
        b_lse = tl.load(LSE + pid_bh.to(tl.int64) * M + offs_m, mask=offs_m < M, other=0.0)
        b_dlse = tl.load(DLSE + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh
                         + offs_m.to(tl.int64) * stride_lm, mask=offs_m < M, other=0.0).to(tl.float32)
        b_delta -= tl.where(b_lse == float("-inf"), 0.0, b_dlse)
    tl.store(DELTA + pid_bh.to(tl.int64) * M + offs_m, b_delta, mask=offs_m < M)


@triton.jit
def _load_lse2(LSE, offs, M):
    # Natural-log LSE -> log2 units; rows with no visible key (-inf) and rows past M read as +inf,
    # which makes their P exactly 0.
    b_lse = tl.load(LSE + offs, mask=offs < M, other=float("-inf"))
    return tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)


@triton.jit
def _inputs_in_units(qb, qh, qm, kb, kh, kn, vb, vh, vn, dob, doh, dom, UNIT: tl.constexpr):
    # q's, k's, v's and dO's leading strides multiplied back by UNIT (triton_fwd.stride_unit), for both passes.
    qb, qh, qm = _in_units(qb, qh, qm, UNIT)
    kb, kh, kn = _in_units(kb, kh, kn, UNIT)
    vb, vh, vn = _in_units(vb, vh, vn, UNIT)
    dob, doh, dom = _in_units(dob, doh, dom, UNIT)
    return qb, qh, qm, kb, kh, kn, vb, vh, vn, dob, doh, dom


@triton.jit
def _dkdv_inner(
    dk0, dk1, dv, dv1, k0, k1, v, v1,
    Q, DO, LSE, DELTA,
    stride_qm, stride_qd, stride_dom, stride_dod,
    offs_n, offs_mb, offs_dq0, offs_dq1, offs_dv, offs_dv1,
    lo, hi, M, causal_shift, qk_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DQK1: tl.constexpr, BLOCK_DV1: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        o_m = start_m + offs_mb  # [BLOCK_M]
        m_m = o_m < M
        # Row tile base in int64 (start_m * stride can pass 2^31); rows within it use offs_mb.
        Qm = Q + tl.cast(start_m, tl.int64) * stride_qm
        DOm = DO + tl.cast(start_m, tl.int64) * stride_dom
        b_q0 = tl.load(Qm + offs_mb[:, None] * stride_qm + offs_dq0[None, :] * stride_qd,
                       mask=m_m[:, None] & (offs_dq0[None, :] < D_QK), other=0.0)  # [BLOCK_M, BLOCK_DQK0]
        b_sT = tl.dot(k0, tl.trans(b_q0), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
        if BLOCK_DQK1 > 0:
            b_q1 = tl.load(Qm + offs_mb[:, None] * stride_qm + offs_dq1[None, :] * stride_qd,
                           mask=m_m[:, None] & (offs_dq1[None, :] < D_QK), other=0.0)
            b_sT += tl.dot(k1, tl.trans(b_q1), input_precision=DOT_PREC)
        b_lse2 = _load_lse2(LSE, o_m, M)
        b_pT = tl.math.exp2(b_sT * qk_scale - b_lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            b_pT = tl.where(offs_n[:, None] <= o_m[None, :] + causal_shift, b_pT, 0.0)
        b_do = tl.load(DOm + offs_mb[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                       mask=m_m[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # [BLOCK_M, BLOCK_DV]
        dv = tl.dot(b_pT.to(b_do.dtype), b_do, dv, input_precision=DOT_PREC)
        if BLOCK_DV1 > 0:  # the value tail (triton_fwd.split_value_dim)
            b_do1 = tl.load(DOm + offs_mb[:, None] * stride_dom + offs_dv1[None, :] * stride_dod,
                            mask=m_m[:, None] & (offs_dv1[None, :] < D_V), other=0.0)
            dv1 = tl.dot(b_pT.to(b_do1.dtype), b_do1, dv1, input_precision=DOT_PREC)
        b_delta = tl.load(DELTA + o_m, mask=m_m, other=0.0)
        b_dpT = tl.dot(v, tl.trans(b_do), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
        if BLOCK_DV1 > 0:
            b_dpT += tl.dot(v1, tl.trans(b_do1), input_precision=DOT_PREC)
        b_dsT = (b_pT * (b_dpT - b_delta[None, :])).to(b_q0.dtype)
        dk0 = tl.dot(b_dsT, b_q0, dk0, input_precision=DOT_PREC)
        if BLOCK_DQK1 > 0:
            dk1 = tl.dot(b_dsT, b_q1, dk1, input_precision=DOT_PREC)
    return dk0, dk1, dv, dv1


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H_Q, H_KV, M, N, causal_shift, qk_scale, scale,
    GROUP: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DQK0: tl.constexpr, BLOCK_DQK1: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    STRIDE_UNIT: tl.constexpr = 1, BLOCK_DV1: tl.constexpr = 0,
):
    # BLOCK_DV1 > 0: V, dO and dV split in columns [0, BLOCK_DV) and [BLOCK_DV, BLOCK_DV + BLOCK_DV1), as in
    # the forward (triton_fwd.split_value_dim).
    if STRIDE_UNIT != 1:  # the leading strides came divided by it (triton_fwd.stride_unit)
        (stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
         stride_dob, stride_doh, stride_dom) = _inputs_in_units(
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_dom, STRIDE_UNIT)
        stride_dkb, stride_dkh, stride_dkn = _in_units(stride_dkb, stride_dkh, stride_dkn, STRIDE_UNIT)
        stride_dvb, stride_dvh, stride_dvn = _in_units(stride_dvb, stride_dvh, stride_dvn, STRIDE_UNIT)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // H_KV
    i_hk = pid_bh % H_KV
    K += i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    V += i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    DK += i_b.to(tl.int64) * stride_dkb + i_hk.to(tl.int64) * stride_dkh
    DV += i_b.to(tl.int64) * stride_dvb + i_hk.to(tl.int64) * stride_dvh

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # Key rows: the block's base in int64 (start_n * stride_kn can pass 2^31), o_nb within it.
    o_nb = tl.arange(0, BLOCK_N)
    K += start_n.to(tl.int64) * stride_kn
    V += start_n.to(tl.int64) * stride_vn
    DK += start_n.to(tl.int64) * stride_dkn
    DV += start_n.to(tl.int64) * stride_dvn
    offs_mb = tl.arange(0, BLOCK_M)
    offs_dq0 = tl.arange(0, BLOCK_DQK0)
    offs_dq1 = BLOCK_DQK0 + tl.arange(0, BLOCK_DQK1 if BLOCK_DQK1 > 0 else 16)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dv1 = BLOCK_DV + tl.arange(0, BLOCK_DV1 if BLOCK_DV1 > 0 else 16)
    m_n = offs_n < N

    # K/V tiles of this program's keys stay in registers: [BLOCK_N, BLOCK_DQK0], [BLOCK_N, BLOCK_DV].
    k0 = tl.load(K + o_nb[:, None] * stride_kn + offs_dq0[None, :] * stride_kd,
                 mask=m_n[:, None] & (offs_dq0[None, :] < D_QK), other=0.0)
    if BLOCK_DQK1 > 0:
        k1 = tl.load(K + o_nb[:, None] * stride_kn + offs_dq1[None, :] * stride_kd,
                     mask=m_n[:, None] & (offs_dq1[None, :] < D_QK), other=0.0)
    else:
        k1 = k0
    v = tl.load(V + o_nb[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=m_n[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    dk0 = tl.zeros([BLOCK_N, BLOCK_DQK0], dtype=tl.float32)
    dk1 = tl.zeros([BLOCK_N, BLOCK_DQK1 if BLOCK_DQK1 > 0 else 16], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if BLOCK_DV1 > 0:
        v1 = tl.load(V + o_nb[:, None] * stride_vn + offs_dv1[None, :] * stride_vd,
                     mask=m_n[:, None] & (offs_dv1[None, :] < D_V), other=0.0)
        dv1 = tl.zeros([BLOCK_N, BLOCK_DV1], dtype=tl.float32)
    else:  # no tail: passed through the loops untouched
        v1 = v
        dv1 = dv

    m_end = tl.cdiv(M, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # Rows i >= start_n - shift see key start_n; rows i >= start_n + BLOCK_N - 1 - shift see
        # every key of the block.
        lo = tl.minimum((tl.maximum(start_n - causal_shift, 0) // BLOCK_M) * BLOCK_M, m_end)
        full = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_shift, 0), BLOCK_M) * BLOCK_M, m_end)
        full = tl.maximum(full, lo)
    else:
        lo = 0
        full = 0

    for g in range(GROUP):
        i_hq = i_hk * GROUP + g
        Qg = Q + i_b.to(tl.int64) * stride_qb + i_hq.to(tl.int64) * stride_qh
        DOg = DO + i_b.to(tl.int64) * stride_dob + i_hq.to(tl.int64) * stride_doh
        row = (i_b * H_Q + i_hq).to(tl.int64) * M
        if CAUSAL:
            dk0, dk1, dv, dv1 = _dkdv_inner(
                dk0, dk1, dv, dv1, k0, k1, v, v1, Qg, DOg, LSE + row, DELTA + row,
                stride_qm, stride_qd, stride_dom, stride_dod,
                offs_n, offs_mb, offs_dq0, offs_dq1, offs_dv, offs_dv1,
                lo, full, M, causal_shift, qk_scale,
                D_QK, D_V, BLOCK_DQK1, BLOCK_DV1, True, BLOCK_M, DOT_PREC,
            )
        dk0, dk1, dv, dv1 = _dkdv_inner(
            dk0, dk1, dv, dv1, k0, k1, v, v1, Qg, DOg, LSE + row, DELTA + row,
            stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_mb, offs_dq0, offs_dq1, offs_dv, offs_dv1,
            full, m_end, M, causal_shift, qk_scale,
            D_QK, D_V, BLOCK_DQK1, BLOCK_DV1, False, BLOCK_M, DOT_PREC,
        )

    dk0 = dk0 * scale
    tl.store(DK + o_nb[:, None] * stride_dkn + offs_dq0[None, :], dk0.to(DK.dtype.element_ty),
             mask=m_n[:, None] & (offs_dq0[None, :] < D_QK))
    if BLOCK_DQK1 > 0:
        dk1 = dk1 * scale
        tl.store(DK + o_nb[:, None] * stride_dkn + offs_dq1[None, :], dk1.to(DK.dtype.element_ty),
                 mask=m_n[:, None] & (offs_dq1[None, :] < D_QK))
    tl.store(DV + o_nb[:, None] * stride_dvn + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=m_n[:, None] & (offs_dv[None, :] < D_V))
    if BLOCK_DV1 > 0:
        tl.store(DV + o_nb[:, None] * stride_dvn + offs_dv1[None, :], dv1.to(DV.dtype.element_ty),
                 mask=m_n[:, None] & (offs_dv1[None, :] < D_V))


@triton.jit
def _dq_inner(
    dq0, dq1, q0, q1, b_do, b_do1, b_lse2, b_delta,
    K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_nb, offs_dq0, offs_dq1, offs_dv, offs_dv1,
    lo, hi, N, causal_shift, qk_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK1: tl.constexpr, BLOCK_DV1: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n = start_n + offs_nb  # [BLOCK_N]
        m_n = o_n < N
        # Key tile base in int64 (start_n * stride can pass 2^31); keys within it use offs_nb.
        Kn = K + tl.cast(start_n, tl.int64) * stride_kn
        Vn = V + tl.cast(start_n, tl.int64) * stride_vn
        b_k0 = tl.load(Kn + offs_nb[:, None] * stride_kn + offs_dq0[None, :] * stride_kd,
                       mask=m_n[:, None] & (offs_dq0[None, :] < D_QK), other=0.0)  # [BLOCK_N, BLOCK_DQK0]
        b_s = tl.dot(q0, tl.trans(b_k0), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        if BLOCK_DQK1 > 0:
            b_k1 = tl.load(Kn + offs_nb[:, None] * stride_kn + offs_dq1[None, :] * stride_kd,
                           mask=m_n[:, None] & (offs_dq1[None, :] < D_QK), other=0.0)
            b_s += tl.dot(q1, tl.trans(b_k1), input_precision=DOT_PREC)
        b_p = tl.math.exp2(b_s * qk_scale - b_lse2[:, None])
        if MASKED:
            visible = m_n[None, :]
            if CAUSAL:
                visible = visible & (o_n[None, :] <= offs_m[:, None] + causal_shift)
            b_p = tl.where(visible, b_p, 0.0)
        b_v = tl.load(Vn + offs_nb[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                      mask=m_n[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # [BLOCK_N, BLOCK_DV]
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        if BLOCK_DV1 > 0:  # the value tail (triton_fwd.split_value_dim)
            b_v1 = tl.load(Vn + offs_nb[:, None] * stride_vn + offs_dv1[None, :] * stride_vd,
                           mask=m_n[:, None] & (offs_dv1[None, :] < D_V), other=0.0)
            b_dp += tl.dot(b_do1, tl.trans(b_v1), input_precision=DOT_PREC)
        b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_k0.dtype)
        dq0 = tl.dot(b_ds, b_k0, dq0, input_precision=DOT_PREC)
        if BLOCK_DQK1 > 0:
            dq1 = tl.dot(b_ds, b_k1, dq1, input_precision=DOT_PREC)
    return dq0, dq1


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm,
    H_Q, M, N, causal_shift, qk_scale, scale,
    GROUP: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DQK0: tl.constexpr, BLOCK_DQK1: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    STRIDE_UNIT: tl.constexpr = 1, BLOCK_DV1: tl.constexpr = 0,
):
    if STRIDE_UNIT != 1:  # the leading strides came divided by it (triton_fwd.stride_unit)
        (stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
         stride_dob, stride_doh, stride_dom) = _inputs_in_units(
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_dom, STRIDE_UNIT)
        stride_dqb, stride_dqh, stride_dqm = _in_units(stride_dqb, stride_dqh, stride_dqm, STRIDE_UNIT)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // H_Q
    i_hq = pid_bh % H_Q
    i_hk = i_hq // GROUP
    Q += i_b.to(tl.int64) * stride_qb + i_hq.to(tl.int64) * stride_qh
    DO += i_b.to(tl.int64) * stride_dob + i_hq.to(tl.int64) * stride_doh
    K += i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    V += i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    DQ += i_b.to(tl.int64) * stride_dqb + i_hq.to(tl.int64) * stride_dqh
    row = pid_bh.to(tl.int64) * M

    if CAUSAL:  # heaviest query blocks first, as in the forward
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # Query rows: the block's base in int64 (start_m * stride can pass 2^31), o_mb within it.
    o_mb = tl.arange(0, BLOCK_M)
    Q += start_m.to(tl.int64) * stride_qm
    DO += start_m.to(tl.int64) * stride_dom
    DQ += start_m.to(tl.int64) * stride_dqm
    offs_nb = tl.arange(0, BLOCK_N)
    offs_dq0 = tl.arange(0, BLOCK_DQK0)
    offs_dq1 = BLOCK_DQK0 + tl.arange(0, BLOCK_DQK1 if BLOCK_DQK1 > 0 else 16)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dv1 = BLOCK_DV + tl.arange(0, BLOCK_DV1 if BLOCK_DV1 > 0 else 16)
    m_m = offs_m < M

    q0 = tl.load(Q + o_mb[:, None] * stride_qm + offs_dq0[None, :] * stride_qd,
                 mask=m_m[:, None] & (offs_dq0[None, :] < D_QK), other=0.0)  # [BLOCK_M, BLOCK_DQK0]
    if BLOCK_DQK1 > 0:
        q1 = tl.load(Q + o_mb[:, None] * stride_qm + offs_dq1[None, :] * stride_qd,
                     mask=m_m[:, None] & (offs_dq1[None, :] < D_QK), other=0.0)
    else:
        q1 = q0
    b_do = tl.load(DO + o_mb[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                   mask=m_m[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # [BLOCK_M, BLOCK_DV]
    if BLOCK_DV1 > 0:  # dO's value tail (triton_fwd.split_value_dim)
        b_do1 = tl.load(DO + o_mb[:, None] * stride_dom + offs_dv1[None, :] * stride_dod,
                        mask=m_m[:, None] & (offs_dv1[None, :] < D_V), other=0.0)
    else:
        b_do1 = b_do
    b_lse2 = _load_lse2(LSE + row, offs_m, M)
    b_delta = tl.load(DELTA + row + offs_m, mask=m_m, other=0.0)
    dq0 = tl.zeros([BLOCK_M, BLOCK_DQK0], dtype=tl.float32)
    dq1 = tl.zeros([BLOCK_M, BLOCK_DQK1 if BLOCK_DQK1 > 0 else 16], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(N, tl.maximum(start_m + BLOCK_M + causal_shift, 0))
        full = tl.maximum(tl.minimum(start_m + causal_shift + 1, N), 0)
    else:
        hi = N
        full = N
    full = (full // BLOCK_N) * BLOCK_N
    dq0, dq1 = _dq_inner(
        dq0, dq1, q0, q1, b_do, b_do1, b_lse2, b_delta,
        K, V, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_nb, offs_dq0, offs_dq1, offs_dv, offs_dv1,
        0, full, N, causal_shift, qk_scale,
        D_QK, D_V, BLOCK_DQK1, BLOCK_DV1, False, CAUSAL, BLOCK_N, DOT_PREC,
    )
    dq0, dq1 = _dq_inner(
        dq0, dq1, q0, q1, b_do, b_do1, b_lse2, b_delta,
        K, V, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_nb, offs_dq0, offs_dq1, offs_dv, offs_dv1,
        full, hi, N, causal_shift, qk_scale,
        D_QK, D_V, BLOCK_DQK1, BLOCK_DV1, True, CAUSAL, BLOCK_N, DOT_PREC,
    )
    dq0 = dq0 * scale
    tl.store(DQ + o_mb[:, None] * stride_dqm + offs_dq0[None, :], dq0.to(DQ.dtype.element_ty),
             mask=m_m[:, None] & (offs_dq0[None, :] < D_QK))
    if BLOCK_DQK1 > 0:
        dq1 = dq1 * scale
        tl.store(DQ + o_mb[:, None] * stride_dqm + offs_dq1[None, :], dq1.to(DQ.dtype.element_ty),
                 mask=m_m[:, None] & (offs_dq1[None, :] < D_QK))


def flash_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    dkdv_config: tuple[int, int, int, int] | None = None,
    dq_config: tuple[int, int, int, int] | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash attention backward.

    do [B, Hq, M, Dv] (any strides with unit last-dim stride), q [B, Hq, M, Dqk], k [B, Hkv, N, Dqk],
    v [B, Hkv, N, Dv] as given to the forward, o [B, Hq, M, Dv] contiguous and lse float32 [B, Hq, M]
    from ``flash_attn_fwd``. Returns contiguous dq, dk, dv in the input dtypes. Deterministic; never
    synchronises with the host. The configs override the tile tables (BLOCK_M, BLOCK_N, warps, stages).
    Calls with the default tiles replay a plan kept per call key (:class:`_BwdPlan`).
    """
    key = None
    if _fast.enabled() and dkdv_config is None and dq_config is None:
        key = (tensor_key(do), tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(o), tensor_key(lse),
               tensor_key(dlse), bool(causal), dot_precision(q.dtype), GLUON_DKDV, GLUON_DQ, GLUON_TOKEN_MAJOR,
               SIDE_STREAM_DQ, SIDE_STREAM_MIN_WORK, getattr(sys.modules.get(_FUSED), "FUSED_BWD", None),
               triton_fwd.STRIDE_UNITS, triton_fwd.VALUE_SPLIT, getattr(sys.modules.get(_GLUON_BWD), "DKDV_ODD", None))
        plan = _plans.get(key)
        if plan is not None:
            return plan.run(do, q, k, v, o, lse, dlse, scale)
    B, Hq, M, Dqk = q.shape
    Hkv, N, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq = triton_fwd._alloc((B, Hq, M, Dqk), q.device, q.dtype)
    dk = triton_fwd._alloc((B, Hkv, N, Dqk), k.device, k.dtype)
    dv = triton_fwd._alloc((B, Hkv, N, Dv), v.device, v.dtype)
    if B * Hkv * N == 0 or M == 0:
        # No query rows (or no keys): every gradient is exactly zero.
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    assert o.is_contiguous() and lse.is_contiguous()
    bq0, bq1 = split_head_dim(Dqk)
    bdv, bdv1 = split_value_dim(Dv, rows_aligned(q, k, v, do, o, dq, dk, dv))
    group = Hq // Hkv
    shift = N - M

    delta = triton_fwd._alloc((B, Hq, M), q.device, torch.float32)
    # Per-call values of the launches, in _BwdPlan.values order: Slot(i) is the i-th.
    S = {name: Slot(i) for i, name in enumerate(_BwdPlan.VALUES)}
    pre_m = 64 if not _interpreting() else 32
    plan = _BwdPlan()
    plan.shapes = (dq.shape, dk.shape, dv.shape, delta.shape)
    # lse's own gradient (dlse) folds into delta in the same launch (any strides: lse.sum()'s is expanded).
    # Every leading stride of the passes' tensors is passed divided by this, the kernels multiplying it back.
    unit = stride_unit(q, k, v, do, o, dq, dk, dv)
    plan.pre = Launch(_bwd_preprocess, (triton.cdiv(M, pre_m), B * Hq), (
        S["o"], S["do"], S["delta"], S["lse"], S["dlse"], *unit_strides(o, unit)[:3], *unit_strides(do, unit),
        *(dlse.stride() if dlse is not None else (0, 0, 0)), Hq, M,
    ), dict(D_V=Dv, BLOCK_DV=max(16, triton.next_power_of_2(Dv)), BLOCK_M=pre_m, HAS_DLSE=dlse is not None,
            STRIDE_UNIT=unit), {})  # the whole row of dO * O (no split: no dot)
    vals = plan.values(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale)
    plan.pre(*vals)

    # dQ on a side stream (SIDE_STREAM_DQ), forked after delta and before the dK/dV pass is queued, so that
    # the two passes overlap (_BwdPlan.passes).
    work = B * Hq * M * N * (Dqk + Dv) / (2 if causal else 1)
    plan.side = SIDE_STREAM_DQ and q.is_cuda and work >= SIDE_STREAM_MIN_WORK

    # The Gluon dK/dV pass takes contiguous inputs only (as the Gluon forward: a copy for its TMA
    # descriptors would cost more than it gains); strided ones stay on the Triton kernel.
    contiguous = all(t.is_contiguous() for t in (q, k, v, do))
    token_major = GLUON_TOKEN_MAJOR and all(t.is_contiguous() or t.transpose(1, 2).is_contiguous()
                                            for t in (q, k, v, do))
    gluon_ok = q.is_cuda and (contiguous or token_major)
    if gluon_ok:
        from . import gluon_bwd

        gluon_ok = gluon_bwd.supported(q, k, v)
    if gluon_ok and dkdv_config is None and dq_config is None and GLUON_DKDV:
        from . import gluon_bwd_fused

        if gluon_bwd_fused.FUSED_BWD == "1" and gluon_bwd_fused.supported(q, k, v):
            # dK, dV and dQ in one pass (not planned: off by default, and its launcher is not one of these).
            gluon_bwd_fused.bwd_fused_gluon(q, k, v, do, lse, delta, dq, dk, dv, causal=bool(causal), scale=scale,
                                            token_major=not contiguous)
            return dq, dk, dv
    gluon_dkdv = gluon_ok and dkdv_config is None and GLUON_DKDV
    gluon_dq = gluon_ok and contiguous and dq_config is None and GLUON_DQ
    plan.causal, plan.token_major = bool(causal), not contiguous

    def triton_launch(kernel, grid, head, tail):
        """make(cfg) for launch_with_fallback: the kernel's args are q, k, v, do, lse, delta, *head, the four
        inputs' strides, *tail."""
        def make(cfg):  # a Launch of this config, launched once here (compiling: out of resources raises)
            bm, bn, warps, stages = cfg
            launch = Launch(kernel, grid(bm, bn), (
                S["q"], S["k"], S["v"], S["do"], S["lse"], S["delta"], *head,
                *unit_strides(q, unit), *unit_strides(k, unit), *unit_strides(v, unit), *unit_strides(do, unit), *tail,
            ), dict(GROUP=group, D_QK=Dqk, D_V=Dv, BLOCK_DQK0=bq0, BLOCK_DQK1=bq1, BLOCK_DV=bdv, CAUSAL=bool(causal),
                    BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=dot_precision(q.dtype), STRIDE_UNIT=unit, BLOCK_DV1=bdv1),
                dict(num_warps=warps, num_stages=stages))
            launch(*vals)
            return launch
        return make

    # fp32 tiles take twice the bytes of fp16/bf16 ones: look them up as twice as wide.
    es = q.element_size()
    width, vwidth = (bq0 + bq1) * es // 2, (bdv + bdv1) * es // 2
    fkey = (q.device.index, q.dtype, bq0, bq1, bdv, bdv1, bool(causal), unit)

    def first_dkdv():  # the first call's dK/dV pass: chooses (and compiles) it, keeps it in the plan
        if gluon_dkdv:
            plan.dkdv = plan.gluon_dkdv
            plan.dkdv(*vals)
            return
        tail = (*unit_strides(dk, unit)[:3], *unit_strides(dv, unit)[:3], Hq, Hkv, M, N, shift, S["scale2"], S["scale"])
        plan.dkdv = launch_with_fallback(
            triton_launch(_bwd_dkdv_kernel, lambda bm, bn: (triton.cdiv(N, bn), B * Hkv), (S["dk"], S["dv"]), tail),
            ("dkdv",) + fkey, dkdv_config or _dkdv_config(width, vwidth, causal), pinned=dkdv_config is not None)

    def first_dq():
        if gluon_dq:
            plan.dq = plan.gluon_dq
            plan.dq(*vals)
            return
        tail = (*unit_strides(dq, unit)[:3], Hq, M, N, shift, S["scale2"], S["scale"])
        plan.dq = launch_with_fallback(
            triton_launch(_bwd_dq_kernel, lambda bm, bn: (triton.cdiv(M, bm), B * Hq), (S["dq"],), tail),
            ("dq",) + fkey, dq_config or _dq_config(width, vwidth, causal), pinned=dq_config is not None)

    plan.passes(q.device, first_dkdv, first_dq)
    if key is not None:
        _plans.put(key, plan)
    return dq, dk, dv


class _BwdPlan:
    """:func:`flash_attn_bwd`'s host decisions for one call key, replayed by later calls: buffer shapes, the
    side stream or not, and its three launches -- the preprocess and the Triton passes as :class:`Launch` es
    (no binder on a replay), the Gluon dK/dV pass through ``gluon_bwd.dkdv_gluon`` (which keeps a plan of its
    own). Holds no tensors."""

    __slots__ = ("shapes", "pre", "dkdv", "dq", "side", "causal", "token_major")
    VALUES = ("q", "k", "v", "do", "o", "lse", "dlse", "delta", "dq", "dk", "dv", "scale2", "scale")

    @staticmethod
    def values(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale) -> tuple:
        """The per-call values in ``VALUES`` order (dlse: lse, unread, when there is none)."""
        return (q, k, v, do, o, lse, lse if dlse is None else dlse, delta, dq, dk, dv, scale * LOG2E, scale)

    def gluon_dkdv(self, q, k, v, do, o, lse, dlse, delta, dq, dk, dv, scale2, scale):
        from . import gluon_bwd

        gluon_bwd.dkdv_gluon(q, k, v, do, lse, delta, dk, dv, causal=self.causal, scale=scale,
                             token_major=self.token_major)

    def gluon_dq(self, q, k, v, do, o, lse, dlse, delta, dq, dk, dv, scale2, scale):
        from . import gluon_bwd

        gluon_bwd.dq_gluon(q, k, v, do, lse, delta, dq, causal=self.causal, scale=scale)

    def passes(self, device, dkdv, dq) -> None:
        """dK/dV on the current stream, then dQ -- on the side stream when ``side`` (forked here, after
        delta and before the dK/dV pass is queued, and joined back): one switch there and one back, since
        each stream change is host time. The buffers the side stream touches were all made on the current
        stream, which does nothing more with them until the join."""
        side = _side_stream(device) if self.side else None
        if side is not None:
            main = torch.cuda.current_stream(device)
            side.wait_stream(main)
        dkdv()
        if side is not None:
            torch.cuda.set_stream(side)
        try:
            dq()
        finally:
            if side is not None:
                torch.cuda.set_stream(main)
        if side is not None:
            main.wait_stream(side)

    def run(self, do, q, k, v, o, lse, dlse, scale):
        dq_shape, dk_shape, dv_shape, delta_shape = self.shapes
        dq = triton_fwd._alloc(dq_shape, q.device, q.dtype)
        dk = triton_fwd._alloc(dk_shape, k.device, k.dtype)
        dv = triton_fwd._alloc(dv_shape, v.device, v.dtype)
        delta = triton_fwd._alloc(delta_shape, q.device, torch.float32)
        vals = self.values(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale)
        self.pre(*vals)
        self.passes(q.device, lambda: self.dkdv(*vals), lambda: self.dq(*vals))
        return dq, dk, dv


# flash_attn_bwd's plans by call key; cleared by the tests around each test (tests/conftest.py).
_plans = PlanCache()
_FUSED = __name__.rsplit(".", 1)[0] + ".gluon_bwd_fused"  # its FUSED_BWD switch is in the key, once imported
_GLUON_BWD = __name__.rsplit(".", 1)[0] + ".gluon_bwd"  # its DKDV_ODD switch too

"""The flash-attention backward in one Gluon pass for Hopper: dK, dV and dQ from the same score tiles.

Why: the two-pass backward (``gluon_bwd._dkdv_gluon``, then a dQ pass) computes S and dP twice, so it
runs 7 GEMMs of a tile where the FLOP count has 5. Each pass runs at 500-535 TFLOP/s on the H200
(``scripts/profile_attention_bwd.py``, session 21), so the two extra GEMMs are ~28% of the backward.

Schedule: ``_dkdv_gluon``'s (a program owns BLOCK_N = 128 keys of one KV head, two warpgroups, and walks
the row tiles of every query head of its group that can see them; Q and dO row tiles stream by TMA),
with dS^T also written to shared memory, from where it feeds both dK += dS^T Q and a third product,
dQ_j = dS_j K (a [BLOCK_M, D] partial, the two warpgroups splitting D). The partial is added into an
fp32 workspace row tile.

Deterministic: the partials of a row tile are added in one fixed order, highest key block first, each
behind a per-row-tile counter (the count of key blocks above this one that have added theirs). The
first contributor stores, the middle ones add, the last (key block 0) adds, scales and writes dq in
the input dtype, so there is no memset and no conversion pass. Programs launch highest key block first
within a (batch, KV head), so every program a waiting one depends on has launched before it: no
deadlock, and, as a key block's program reaches a row tile after the one above it did, waits are rare.

Status (session 21, 3c2a2dd, H200): correct (tests/ops/test_attention_fused_bwd.py, 19 tests: oracle, bit-for-bit
repeatable, NaN-poisoned outputs fully written, 256 / 512 programs). Not faster: at 4 x 32 x 4096 the kernel
takes 4.53 ms against 3.63 for the two-pass backward. Without its dQ out it would take 2.69; the per-thread
ordered atomic adds of dQ_j (4.4 GB into L2) cost the difference. Off (FUSED_BWD). FUSED_BULK (dQ_j added by
TMA reduce-add) and FUSED_CAST: correct on the H200 (20/20, session 22, 37cf58d), but 4.18 / 4.12 ms against the
two passes' 3.48 (docs/benchmarks.md, session 22): off.

Scope: bf16/fp16, Dqk 128 (the dQ product splits it between the warpgroups, 64 columns each: at Dqk 64 the
halves of K's 128-byte swizzled rows gave wrong dQ on the H200, session 21),
Dv 64 or 128, inputs head-major or token-major as ``gluon_bwd.dkdv_gluon``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _env
from .._common import is_hopper
from .gluon_bwd import _LOG2E
from .gluon_fwd import _SMEM_BYTES, _desc, _tma_view

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .._gluon_compat import VERSION_OK as _VERSION_OK
    from .._gluon_compat import thread_barrier as _thread_barrier
    from .._gluon_compat import tma_load as _tma_load
    from .._gluon_compat import tma_reduce_add as _tma_reduce_add
    from .._gluon_compat import tma_store as _tma_store
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

# "1": flash_attn_bwd runs this pass where ``supported`` says so; "0": the two-pass backward.
FUSED_BWD = _env.choice("MLA_ATTN_GLUON_FUSED_BWD", "0")
# "1": dQ_j leaves by TMA (store / reduce-add) from a double buffer, each counter released a step later
# (``_bwd_fused_gluon``'s BULK). Correct on the H200, 5-8% faster than the atomic adds (9-16% with CAST),
# slower than the two passes (session 22); MLA_ATTN_GLUON_FUSED_BULK=1 turns it on.
FUSED_BULK = _env.choice("MLA_ATTN_GLUON_FUSED_BULK", "0")
# With FUSED_BULK, "1": key block 0 adds its dQ_j like the others and a cast kernel (``_dq_cast_kernel``) writes
# dq from the workspace afterwards, instead of key block 0 (the longest program of a head, launched last: the
# tail) loading the workspace tile at every step. Correct on the H200 (session 22); MLA_ATTN_GLUON_FUSED_CAST=1.
FUSED_CAST = _env.choice("MLA_ATTN_GLUON_FUSED_CAST", "0")


@triton.jit
def _dq_cast_kernel(DQACC, DQ, M, ROWS, shift, scale, D: tl.constexpr, BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr):
    """dq[b, h, i] = scale * DQACC[(b * H + h) * ROWS + i] for i < M, in dq's dtype; rows that see no key (causal,
    i + shift < 0: their row tile may have had no contributor, so its workspace is unwritten) are 0."""
    pid_r = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    ok = (rows < M)[:, None]
    vals = tl.load(DQACC + (bh * ROWS + rows)[:, None] * D + cols[None, :], mask=ok, other=0.0)
    if CAUSAL:
        vals = tl.where((rows + shift >= 0)[:, None], vals, 0.0)
    tl.store(DQ + (bh * M + rows)[:, None] * D + cols[None, :], (vals * scale).to(DQ.dtype.element_ty), mask=ok)


def dq_cast(dqacc: torch.Tensor, dq: torch.Tensor, rows_per_head: int, causal: bool, shift: int, scale: float,
            block_r: int = 32) -> torch.Tensor:
    """Fill dq [B, H, M, D] (contiguous) from the fp32 workspace dqacc [B * H * rows_per_head, D] (see
    ``_dq_cast_kernel``)."""
    b, h, m, d = dq.shape
    assert dq.is_contiguous() and dqacc.is_contiguous() and dqacc.shape == (b * h * rows_per_head, d)
    assert d & (d - 1) == 0, f"dq_cast: D must be a power of two, got {d}"
    _dq_cast_kernel[(triton.cdiv(m, block_r), b * h)](dqacc, dq, m, rows_per_head, shift, scale, D=d,
                                                     BLOCK_R=block_r, CAUSAL=causal)
    return dq


if AVAILABLE:
    from .gluon_bwd import _load_rows

    @gluon.jit
    def _load_stats(LSE, DELTA, t, n_tiles, n_rt, rt0, M, H, i_b, i_hk, GROUP_N, o_pf, BLOCK_M: gl.constexpr):
        """lse (base 2; +inf for rows that see no key or lie past M) and delta of flat row tile t, one value a
        thread (compact): they wait in shared memory for their tile, out of the registers the products need."""
        g = t // gl.maximum(n_rt, 1)
        rows = (rt0 + t % gl.maximum(n_rt, 1)) * BLOCK_M + o_pf
        stat = (i_b * H + i_hk * GROUP_N + g).to(gl.int64) * M
        ok = (rows < M) & (t < n_tiles)
        lse = gl.load(LSE + stat + rows, mask=ok, other=float("-inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = gl.load(DELTA + stat + rows, mask=ok, other=0.0)
        return lse2, delta

    @gluon.jit
    def _bulk_wait(x, PENDING: gl.constexpr):
        """Wait until at most PENDING of this thread's bulk async-groups are outstanding, their global writes
        (reductions) complete, not only their shared-memory reads (tma.store_wait's `.read` form), then order
        them before this thread's later generic accesses; returns x (an operand the asm needs)."""
        if PENDING == 0:
            return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, $1;",
                                             "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)
        else:
            return gl.inline_asm_elementwise("cp.async.bulk.wait_group 1; fence.proxy.async.global; mov.b32 $0, $1;",
                                             "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _dq_out(dq_smem, DQ, DQACC, tile, stat, start_m, M, scale, pid_n, kmax, o_wr, o_wd, wo_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, D_QK: gl.constexpr, WO_ROWS: gl.constexpr, DQ_T: gl.constexpr):
        """dQ_j (in shared memory) into its row tile, WO_ROWS rows at a time: the first contributor (kmax)
        stores into the fp32 workspace, the middle ones add atomically, the last (key block 0) adds what is
        there and writes dq in the input dtype. The caller has waited for its turn."""
        base = DQACC + tile.to(gl.int64) * BLOCK_M * D_QK
        if pid_n == 0:
            for c in gl.static_range(0, BLOCK_M, WO_ROWS):
                part = _dq_part(dq_smem, c, wo_layout, WO_ROWS, DQ_T)
                rows = c + o_wr
                if pid_n != kmax:
                    part += gl.load(base + rows[:, None] * D_QK + o_wd[None, :], cache_modifier=".cg")
                o_m = start_m + rows
                dst = DQ + (stat + o_m.to(gl.int64))[:, None] * D_QK + o_wd[None, :]
                gl.store(dst, (part * scale).to(DQ.dtype.element_ty), mask=(o_m < M)[:, None])
        elif pid_n == kmax:
            for c in gl.static_range(0, BLOCK_M, WO_ROWS):
                part = _dq_part(dq_smem, c, wo_layout, WO_ROWS, DQ_T)
                gl.store(base + (c + o_wr)[:, None] * D_QK + o_wd[None, :], part)
        else:
            for c in gl.static_range(0, BLOCK_M, WO_ROWS):
                part = _dq_part(dq_smem, c, wo_layout, WO_ROWS, DQ_T)
                gl.atomic_add(base + (c + o_wr)[:, None] * D_QK + o_wd[None, :], part, sem="relaxed")

    @gluon.jit
    def _dq_part(dq_smem, c, wo_layout: gl.constexpr, WO_ROWS: gl.constexpr, DQ_T: gl.constexpr):
        if DQ_T:
            return dq_smem.slice(c, WO_ROWS, dim=1).permute((1, 0)).load(wo_layout)
        else:
            return dq_smem.slice(c, WO_ROWS, dim=0).load(wo_layout)

    @gluon.jit
    def _bwd_fused_gluon(
        q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DQ, DQACC, SEM, DK, DV,
        qk_scale, scale, M, N, H, HK, GROUP_N,
        Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH,
        D_QK: gl.constexpr, D_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, TOKEN_MAJOR: gl.constexpr, num_warps: gl.constexpr,
        dk_desc=None, dv_desc=None, TMA_STORE: gl.constexpr = False, DQ_MODE: gl.constexpr = 0,
        dqacc_desc=None, BULK: gl.constexpr = False, CAST: gl.constexpr = False,
    ):
        # BULK: dQ_j leaves shared memory by one TMA store (the first contributor) or TMA reduce-add (the
        # middle ones) into DQACC through dqacc_desc ([rows, D_QK] fp32, BLOCK_M x D_QK blocks), from a
        # double buffer; the counter of a step's tile is released one step later, once its group is done.
        # DQ_MODE (diagnostics, scripts/probe_fused_bwd.py): 0 the ordered adds; 2 the same adds in any order
        # (no waits: not deterministic); 4 no dQ out and no counters (the products and dQ_j into shared memory).
        # Session 21 also timed 1 (ordered load-add-store), 3 (counters, no adds), 5 (2 without counters):
        # docs/benchmarks.md. With BULK: 2 the TMA adds in any order (wrong dq: timing only), 3 the counters in
        # order without the TMA store / adds (wrong dq: timing only), 5 as 2 but waiting only for the previous
        # step's buffer to be read, not for its adds to complete (no counters; timing only).
        # DQACC: fp32 [B * H * m_tiles * BLOCK_M, D_QK], row tile (b, h, r) at rows ((b * H + h) * m_tiles
        # + r) * BLOCK_M; SEM: int32 [B * H * m_tiles], zero at launch.
        n_kb = gl.num_programs(0)
        pid_n = n_kb - 1 - gl.program_id(0)  # the highest key block launches first: see the module doc
        pid_bh = gl.program_id(1)
        i_b = pid_bh // HK
        i_hk = pid_bh % HK
        n0 = pid_n * BLOCK_N
        lay = (Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH)
        if TOKEN_MAJOR:
            kv_row0 = i_b * K_RB + i_hk * K_RH + n0
            k_col0 = i_hk * K_CH
            v_row0 = i_b * V_RB + i_hk * V_RH + n0
            v_col0 = i_hk * V_CH
        else:
            kv_row0 = pid_bh * N + n0
            k_col0 = 0
            v_row0 = kv_row0
            v_col0 = 0
        shift = N - M
        m_tiles = gl.cdiv(M, BLOCK_M)

        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D_QK, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D_V, 16])
        # dQ_j [BLOCK_M, D_QK]: the rows in one warpgroup's four warps, D split between the warpgroups.
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                            instr_shape=[16, D_QK // (num_warps // 4), 16])
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if BLOCK_M * 2 >= 128 else BLOCK_M * 2,
                                                       element_bitwidth=16, rank=2)
        # The write-out of dQ_j: 16-byte vectors along a row, WO_ROWS rows at a time.
        WO_COLS: gl.constexpr = D_QK // 4  # threads along a row
        wo_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // WO_COLS, WO_COLS],
                                                   warps_per_cta=[num_warps, 1], order=[1, 0])
        WO_ROWS: gl.constexpr = (32 // WO_COLS) * num_warps
        dqs_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        dtype: gl.constexpr = q_desc.dtype
        DQ_T: gl.constexpr = BLOCK_M < 64  # dQ_j's rows too few for a warpgroup: compute its transpose

        k_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_QK], k_desc.layout)
        v_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_V], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_QK], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_V], do_desc.layout)
        ds_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
        if BULK:
            dq_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, D_QK], dqacc_desc.layout)
            dq_smem = dq_buf.index(0)
        elif DQ_T:
            dq_smem = gl.allocate_shared_memory(gl.float32, [D_QK, BLOCK_M], dqs_layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D_QK], dqs_layout)
        if TMA_STORE:
            dk_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_QK], dk_desc.layout)
            dv_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_V], dv_desc.layout)
        stat_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        rt0 = 0
        if CAUSAL:
            rt0 = gl.minimum(gl.maximum(n0 - shift, 0) // BLOCK_M, m_tiles)
        n_rt = m_tiles - rt0
        n_tiles = GROUP_N * n_rt

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0, k_col0], kv_bar, k_buf.index(0))
        _tma_load(v_desc, [v_row0, v_col0], kv_bar, v_buf.index(0))
        # K, V and dS^T are one buffer each, indexed in the loop by t * ZERO (0, unknown to the compiler):
        # their wgmma descriptors are then recomputed each step instead of ~30 64-bit values held (and
        # spilled) across the loop.
        zero = gl.program_id(2)
        for i in gl.static_range(STAGES):
            _load_rows(q_desc, q_desc, do_desc, q_smem, q_smem, do_smem, bars, i, n_rt, rt0, M, H, i_b, i_hk,
                       GROUP_N, BLOCK_M, STAGES, D_QK, False, n_tiles, lay, TOKEN_MAJOR)

        dk = gl.zeros([BLOCK_N, D_QK], gl.float32, layout=dk_layout)
        dv = gl.zeros([BLOCK_N, D_V], gl.float32, layout=dv_layout)
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        o_key = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        o_rl = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        o_wr = gl.arange(0, WO_ROWS, layout=gl.SliceLayout(1, wo_layout))
        o_wd = gl.arange(0, D_QK, layout=gl.SliceLayout(0, wo_layout))

        pf_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[num_warps],
                                                   order=[0])
        o_pf = gl.arange(0, BLOCK_M, layout=pf_layout)
        for i in gl.static_range(STAGES):
            pf_l, pf_d = _load_stats(LSE, DELTA, i, n_tiles, n_rt, rt0, M, H, i_b, i_hk, GROUP_N, o_pf, BLOCK_M)
            lse_smem.index(i).store(pf_l)
            delta_smem.index(i).store(pf_d)
        _thread_barrier()
        stat_row: gl.constexpr = gl.SliceLayout(0, st_layout)

        prev_tile = pid_n * 0 - 1  # BULK: the row tile whose counter is released next step
        mbarrier.wait(kv_bar, 0)
        for t in range(0, n_tiles):
            stage = t % STAGES
            k_smem = k_buf.index(t * zero)
            v_smem = v_buf.index(t * zero)
            ds_smem = ds_buf.index(t * zero)
            g = t // n_rt
            r = rt0 + t % n_rt
            start_m = r * BLOCK_M
            o_row = start_m + o_rl
            hq = i_hk * GROUP_N + g
            stat = (i_b * H + hq).to(gl.int64) * M
            # The statistics of tile t + STAGES, to shared memory at the end of this step.
            pf_l, pf_d = _load_stats(LSE, DELTA, t + STAGES, n_tiles, n_rt, rt0, M, H, i_b, i_hk, GROUP_N, o_pf,
                                     BLOCK_M)

            mbarrier.wait(bars.index(stage), (t // STAGES) & 1)
            s_t = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), st_zero, use_acc=False,
                                 is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
            lse2 = lse_smem.index(stage).load(stat_row)
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            if CAUSAL:  # keys past N are past every row's diagonal too
                p_t = gl.where(o_key[:, None] <= (o_row + shift)[None, :], p_t, 0.0)
            else:  # keys past N (another head's rows) must not reach dQ
                p_t = gl.where((o_key < N)[:, None], p_t, 0.0)
            # dP^T waited for before dV's product is issued: P^T (fp32) and its bf16 copy are never live
            # together with dP^T in flight (the peak of the registers).
            dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
            delta = delta_smem.index(stage).load(stat_row)
            p_op = gl.convert_layout(p_t.to(dtype), pa_layout)
            ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
            dv = warpgroup_mma(p_op, do_smem.index(stage), dv, is_async=True)
            ds_smem.store(ds_t)
            fence_async_shared()
            _thread_barrier()  # both warpgroups' halves of dS^T are in place
            # dQ_j first, waited for (with dV) and put in shared memory before dK's product is issued: the
            # three accumulators are never in flight together (that spilled ~300 bytes a thread).
            if DQ_T:  # dQ_j^T = K^T dS_j^T [D_QK, BLOCK_M], D split between the warpgroups
                dq = warpgroup_mma(k_smem.permute((1, 0)), ds_smem,
                                   gl.zeros([D_QK, BLOCK_M], gl.float32, layout=st_layout), use_acc=False,
                                   is_async=True)
            else:
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem,
                                   gl.zeros([BLOCK_M, D_QK], gl.float32, layout=dq_layout), use_acc=False,
                                   is_async=True)
            dv, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dq))
            if BULK:
                dq_smem = dq_buf.index(t % 2)  # free: step t - 2's group was waited for at step t - 1
                dq_smem.store(dq)
                fence_async_shared()  # for the TMA unit (after the barrier below)
            else:
                dq_smem.store(dq)
            dk = warpgroup_mma(ds_smem, q_smem.index(stage), dk, is_async=True)
            kmax = n_kb - 1
            if CAUSAL:
                kmax = gl.minimum((start_m + BLOCK_M - 1 + shift) // BLOCK_N, n_kb - 1)
            tile = (i_b * H + hq) * m_tiles + r
            if pid_n != kmax and (DQ_MODE < 2):  # wait for the key blocks above this one
                need = kmax - pid_n
                seen = gl.atomic_add(SEM + tile, 0, sem="acquire")
                while seen < need:
                    seen = gl.atomic_add(SEM + tile, 0, sem="acquire")
            _thread_barrier()  # dQ_j is in shared memory
            if BULK:
                if pid_n == 0 and not CAST:
                    _dq_out(dq_smem, DQ, DQACC, tile, stat, start_m, M, scale, pid_n, kmax, o_wr, o_wd, wo_layout,
                            BLOCK_M, D_QK, WO_ROWS, DQ_T)
                else:
                    # The counter's acquire (generic proxy) before this thread's TMA (async proxy) reaches L2.
                    tile = gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [tile],
                                                     dtype=gl.int32, is_pure=False, pack=1)
                    if DQ_MODE != 3:
                        if pid_n == kmax:
                            _tma_store(dqacc_desc, [tile * BLOCK_M, 0], dq_smem)
                        else:
                            _tma_reduce_add(dqacc_desc, [tile * BLOCK_M, 0], dq_smem)
                    if DQ_MODE == 5:  # timing: the previous step's buffer read, not its adds complete
                        tma.store_wait(1)
                        _thread_barrier()
                    else:
                        # The previous step's tile is in (waited for by the thread that issued it), its buffer
                        # free.
                        done = _bulk_wait(prev_tile, 1)
                        _thread_barrier()
                        if done >= 0:
                            gl.atomic_add(SEM + done, 1, sem="release")
                    prev_tile = tile
            else:
                if DQ_MODE != 4:
                    _dq_out(dq_smem, DQ, DQACC, tile, stat, start_m, M, scale, pid_n, kmax, o_wr, o_wd, wo_layout,
                            BLOCK_M, D_QK, WO_ROWS, DQ_T)
                if pid_n != 0 and DQ_MODE < 4:
                    _thread_barrier()  # every thread's part of the tile is out
                    gl.atomic_add(SEM + tile, 1, sem="release")

            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
            lse_smem.index(stage).store(pf_l)  # every thread read this stage's statistics before dS^T's barrier
            delta_smem.index(stage).store(pf_d)
            _thread_barrier()
            _load_rows(q_desc, q_desc, do_desc, q_smem, q_smem, do_smem, bars, t + STAGES, n_rt, rt0, M, H, i_b,
                       i_hk, GROUP_N, BLOCK_M, STAGES, D_QK, False, n_tiles, lay, TOKEN_MAJOR)

        if BULK:  # the last tile's group, then its counter
            if pid_n != 0 or CAST:
                done = _bulk_wait(prev_tile, 0)
                _thread_barrier()
                if done >= 0:
                    gl.atomic_add(SEM + done, 1, sem="release")
        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        if TMA_STORE and n0 + BLOCK_N <= N:
            dk_smem.store((dk * scale).to(dtype))
            dv_smem.store(dv.to(dtype))
            fence_async_shared()
            _thread_barrier()
            row = pid_bh * N + n0
            _tma_store(dk_desc, [row, 0], dk_smem)
            _tma_store(dv_desc, [row, 0], dv_smem)
            tma.store_wait(0)
        else:
            base = pid_bh.to(gl.int64) * N
            o_nk = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
            o_dk = gl.arange(0, D_QK, layout=gl.SliceLayout(0, dk_layout))
            gl.store(DK + (base + o_nk.to(gl.int64))[:, None] * D_QK + o_dk[None, :],
                     (dk * scale).to(DK.dtype.element_ty), mask=(o_nk < N)[:, None])
            o_nv = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dv_layout))
            o_dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, dv_layout))
            gl.store(DV + (base + o_nv.to(gl.int64))[:, None] * D_V + o_dv[None, :], dv.to(DV.dtype.element_ty),
                     mask=(o_nv < N)[:, None])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`bwd_fused_gluon` takes these inputs."""
    if not (AVAILABLE and _VERSION_OK and q.is_cuda and is_hopper(q.device)):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and q.shape[-1] == 128 and v.shape[-1] in (64, 128) and q.shape[1] % k.shape[1] == 0)


def bwd_fused_gluon(q, k, v, do, lse, delta, dq, dk, dv, *, causal: bool, scale: float, block_m: int = 64,
                    block_n: int = 128, stages: int = 2, num_warps: int = 8, token_major: bool = False,
                    tma_store: bool = False, dq_mode: int = 0, bulk: bool | None = None, cast: bool | None = None):
    """Fill dq [B, H, M, Dqk], dk [B, HK, N, Dqk] and dv [B, HK, N, Dv] (contiguous) from q [B, H, M, Dqk],
    k, v, do [B, H, M, Dv], lse and delta [B, H, M] float32 (contiguous), in one pass. Causal is
    bottom-right. Needs N >= 1 and M >= 1 (the caller zeroes the gradients otherwise)."""
    b, h, m, d_qk = q.shape
    hk, n, d_v = k.shape[1], k.shape[2], v.shape[-1]
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
    assert lse.is_contiguous() and delta.is_contiguous() and n > 0 and m > 0
    el = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    views = [_tma_view(t, token_major) for t in (q, do, k, v)]
    (q2, *_), (do2, *_), (k2, *_), (v2, *_) = views
    lay = [x for vw in views for x in vw[1:]]

    def desc(t, rows, cols):
        return _desc(t, rows, cols, el)

    m_tiles = (m + block_m - 1) // block_m
    dqacc = torch.empty((b * h * m_tiles * block_m, d_qk), device=q.device, dtype=torch.float32)
    sem = torch.zeros((b * h * m_tiles,), device=q.device, dtype=torch.int32)
    bulk = FUSED_BULK == "1" if bulk is None else bulk
    cast = bulk and (FUSED_CAST == "1" if cast is None else cast)
    if causal and m > n and not cast:
        # Row tiles whose rows all see no key get no contribution: their dq is zero.
        dq[:, :, :m - n].zero_()
    smem = 2 * (block_n * (d_qk + d_v) + stages * block_m * (d_qk + d_v) + block_n * block_m) + 4 * block_m * d_qk
    extra = {}
    # dK/dV out by TMA needs 64 KB more shared memory, which leaves the L1 too little for the spills.
    if tma_store and smem + 2 * block_n * (d_qk + d_v) <= _SMEM_BYTES and dk.data_ptr() % 16 == 0 and dv.data_ptr() % 16 == 0:
        extra = {"dk_desc": desc(dk.view(b * hk * n, d_qk), block_n, d_qk),
                 "dv_desc": desc(dv.view(b * hk * n, d_v), block_n, d_v), "TMA_STORE": True}
    if bulk:  # dQ_j out by TMA store / reduce-add from a double buffer
        assert block_m >= 64 and dq_mode in (0, 2, 3, 5), "bulk: 64-row tiles; DQ_MODE 0, or 2 / 3 / 5 to time"
        smem += 4 * block_m * d_qk
        extra["dqacc_desc"] = TensorDescriptor.from_tensor(
            dqacc, [block_m, d_qk], gl.NVMMASharedLayout.get_default_for([block_m, d_qk], gl.float32))
        extra["BULK"] = True
        extra["CAST"] = cast
    assert smem <= _SMEM_BYTES, f"shared memory {smem} > {_SMEM_BYTES}"
    grid = ((n + block_n - 1) // block_n, b * hk, 1)
    _bwd_fused_gluon[grid](
        desc(q2, block_m, d_qk), desc(k2, block_n, d_qk), desc(v2, block_n, d_v), desc(do2, block_m, d_v),
        lse, delta, dq, dqacc, sem, dk, dv,
        scale * _LOG2E, scale, m, n, h, hk, h // hk, *lay,
        D_QK=d_qk, D_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
        TOKEN_MAJOR=any(vw[3] for vw in views), num_warps=num_warps, DQ_MODE=dq_mode, **extra,
    )
    if cast:
        dq_cast(dqacc, dq, m_tiles * block_m, causal, n - m, scale)
    return dq, dk, dv

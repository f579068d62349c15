"""The dK/dV pass of the flash-attention backward for Hopper, written in Gluon.

Why: the Triton dK/dV kernel (``triton_bwd._bwd_dkdv_kernel``) compiles for sm_90a with ptxas C7515
(every wgmma serialised: non-wgmma instructions write accumulator registers inside a pipeline
stage) and, at its tile table's (64, 128, 8, 3), 255 registers with ~0.4 KB spilled
(``scripts/compile_sm90.py dkdv``). Here the wgmmas are issued and waited for explicitly.

A program owns BLOCK_N = 128 keys of one KV head (two warpgroups, 64 keys each) and walks the row tiles
of every query head of its group that can see them. K and V stay in shared memory; Q and dO row tiles
come by TMA through a STAGES-deep ring, one mbarrier each. Per row tile j (S^T, dP^T: [keys, rows]):

    1. issue S^T = K Q_j^T and dP^T = V dO_j^T                 (two wgmma groups)
    2. wait for S^T; P^T = exp2(S^T * scale - lse_j)            (under dP^T)
    3. issue dV += P^T dO_j
    4. wait for dP^T; dS^T = P^T (dP^T - delta_j)               (under dV)
    5. issue dK += dS^T Q_j; wait for everything
    6. barrier; refill the ring stage of tile j with tile j + STAGES

Nothing is in flight at the loop's back edge (ptxas C7514). The softmax statistics come from the
forward: lse (natural log, -inf for rows that see no key) and delta = rowsum(dO * O) - dlse. Rows past
M read lse = +inf, so their P is exactly 0; rows TMA fetches past the tensor's end are zero.

Scope: bf16/fp16, Dqk a power of two or 128 + 64 (MLA expanded 192), Dv 64 or 128, contiguous
[B, H, L, D] inputs. ``triton_bwd.flash_attn_bwd`` routes here where ``supported`` says so
(``MLA_ATTN_GLUON=0`` opts out).

Status (2026-12-03, session 12): the dK/dV pass passes the oracle on the H200 (10 tests in
tests/ops/test_attention_gluon.py at both tile choices, and every flash GPU test through the public
op). fwd+bwd (Gluon forward, this pass, Triton dQ) reads 377 / 375 / 322 / 341 TFLOP/s on the benchmark
rows, against 351 / 366 / 310 / 295 all-Triton (docs/benchmarks.md).

Session 20 (54dd321, H200): dK and dV leave by TMA from shared-memory buffers of their own at d 128
(``DKDV_TMA_STORE``), bit for bit the direct stores' output: +2.6% forward + backward at 4 x 32 x 4096.

Session 13 (827090c, H200): both of these pass their oracle tests.
- ``token_major=True`` in ``dkdv_gluon``: on by default (``MLA_ATTN_GLUON_TOKEN_MAJOR=0`` turns it
  off). It reads the layers' [B, L, H, D] tensors in place. A constexpr keeps the head-major code
  identical.
- ``dq_gluon`` (``MLA_ATTN_GLUON_DQ=1``): off. The same schedule with the roles of queries and keys
  swapped (a program owns 128 rows, K/V tiles stream by TMA). It did not beat the Triton dQ pass
  (ops/attention/README.md has the numbers).
"""

from __future__ import annotations

import torch

from .. import _env
from .._common import is_hopper
from .. import _launch as _fast
from .._launch import Launch, PlanCache, tensor_key
from .gluon_fwd import _SMEM_BYTES, DescPlan, _desc, _num_sms, _split_head_dim, _split_padded, _tma_ready, _tma_view

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from .._gluon_compat import VERSION_OK as _VERSION_OK
    from .._gluon_compat import thread_barrier as _thread_barrier
    from .._gluon_compat import tma_load as _tma_load
    from .._gluon_compat import tma_store as _tma_store
    from .._gluon_compat import warn_untested as _warn_untested
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

_LOG2E = 1.4426950408889634
# dK and dV stored by TMA from shared-memory buffers of their own (``_dkdv_gluon``'s TMA_STORE) instead of
# scattered 4-byte stores from the accumulator layout (those took ~4500 cycles per 128 x 128 block in the
# forward, session 16). A key block past N stores directly. Bit for bit the direct stores' output. H200
# (54dd321, fwd+bwd through the op, five rotated rounds, docs/raw/bench_dkdv_store_54dd321.md): 4 x 32 x 4096 d 128
# 389 -> 399 TFLOP/s (+2.6%), GQA 8 x 32/8 x 2048 +0.5%; at 192/128, where the buffers take shared memory to
# 220 KB, -1.0% (2 x 16 x 8192) and +1.0% (4 x 128 x 2048). "auto" (default): where Dqk is one power of two
# (d 128: 192 KB); "1": wherever the buffers fit (192/128 too); "0": never. MLA_ATTN_GLUON_DKDV_TMA_STORE overrides.
DKDV_TMA_STORE = _env.choice("MLA_ATTN_GLUON_DKDV_TMA_STORE", "auto", _env.AUTO_ON_OFF)
# "1": K/V's wgmma descriptors recomputed each step (``_dkdv_gluon``'s FRESH_DESC): sm_90a spills at d 128 go
# from 32 bytes to none. Off until the H200 has timed it; MLA_ATTN_GLUON_DKDV_FRESH_DESC=1 turns it on.
DKDV_FRESH_DESC = _env.choice("MLA_ATTN_GLUON_DKDV_FRESH_DESC", "0")
# Heads split (``_dkdv_gluon``'s HSPLIT): a KV head's query heads walked by HSPLIT programs instead of one, each
# storing its part's dK / dV in float32, then added in a fixed order (deterministic). Why: with MQA or a large
# group and a small batch there are fewer programs than SMs (MQA 8 x 32/1 x 2048: 128 programs of 128 keys),
# and each walks all its group's heads, so the longest (the first key block, causal) outlasts the rest of the
# backward. "auto": split where B x HK x key blocks < the SM count, into the fewest parts (a power of two
# dividing the group) that give two programs an SM; "0": never; an integer: that many parts wherever it
# divides the group. MLA_ATTN_GLUON_DKDV_HSPLIT overrides.
DKDV_HSPLIT = _env.auto_or_count("MLA_ATTN_GLUON_DKDV_HSPLIT")
# Odd head widths in the dK/dV pass, as ``gluon_fwd.ODD_WIDTHS`` in the forward (``_split_padded``): Dqk 72 as
# 64 + 16 with 8 columns of TMA's zeros, Dv 80 / 96 as two blocks (dP^T from two chained wgmmas, dV in two
# accumulators), Dv up to 128 in all. H100 (d44dbde, session 32): its GPU tests pass; fwd+bwd at 4 x 32 x 2048
# with it and the Gluon forward, against both on Triton: 72 1.10x (GQA 1.08x), 80 1.10x, 96 1.09x, 40 0.97x.
# "auto" (default): where both widths' first block is at least 64; "1" (or True): every width it can take;
# "0" (or False): never. MLA_ATTN_GLUON_DKDV_ODD overrides.
DKDV_ODD = _env.choice("MLA_ATTN_GLUON_DKDV_ODD", "auto", _env.AUTO_ON_OFF)
# Narrow heads in the dK/dV pass, as gluon_fwd.NARROW in the forward (``_dkdv_narrow_tiles``): Dqk = Dv in 64..96
# on 64-key programs of one warpgroup (64 rows a step, 2 stages) instead of 128 keys on two. sm_90a (Triton 3.6):
# 191-235 registers x 128 threads and 49-74 KB of shared memory, so two programs an SM, where the 128-key program
# (191-222 registers x 256) fills one. H100 (1be8d80, session 34; bench_attention.py --dkdv-narrow, fwd+bwd at
# 4 x 32 x 2048 against the 128-key tiles): 64 1.11x, GQA 64 1.12x, 72 1.06x, 80 1.08x, 96 1.08x; 32 rows with 3
# stages 0.99-1.08x, so 64 rows and 2 stages it is. Its GPU tests pass, and the whole Gluon file with it on.
# "auto" (default): those widths; "0": never. MLA_ATTN_GLUON_DKDV_NARROW overrides.
DKDV_NARROW = _env.choice("MLA_ATTN_GLUON_DKDV_NARROW", "auto", _env.AUTO_ON_OFF)

if AVAILABLE:
    from .gluon_fwd import _expect, _load_kv  # the K/V ring refill and its expected bytes, shared with the forward

    @gluon.jit
    def _load_rows(q_desc, q1_desc, do_desc, q_smem, q1_smem, do_smem, bars, t, n_rt, rt0, M, H, i_b, i_hk,
                   GROUP_N, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, D_QK0: gl.constexpr,
                   SPLIT: gl.constexpr, n_tiles, lay, TOKEN_MAJOR: gl.constexpr, do1_desc=None, do1_smem=None,
                   D_V0: gl.constexpr = 0, SPLIT_V: gl.constexpr = False):
        """Start the TMA loads of flat row tile t (query head g = t // n_rt of the group, row tile
        rt0 + t % n_rt) into ring stage t % STAGES; a no-op past the last tile. TOKEN_MAJOR: lay = (row
        stride per batch, per head, column stride per head) of q's and dO's 2-D views, as in
        gluon_fwd._tma_view. SPLIT_V: dO's columns past D_V0 too, into do1_smem."""
        stage = t % STAGES
        pred = t < n_tiles
        g = t // gl.maximum(n_rt, 1)
        pos = (rt0 + t % gl.maximum(n_rt, 1)) * BLOCK_M
        hq = i_hk * GROUP_N + g
        if TOKEN_MAJOR:
            row = i_b * lay[0] + hq * lay[1] + pos
            col = hq * lay[2]
            do_row = i_b * lay[3] + hq * lay[4] + pos
            do_col = hq * lay[5]
        else:  # head-major: the arithmetic the H200 checked in session 12
            row = (i_b * H + hq) * M + pos
            col = 0
            do_row = row
            do_col = 0
        bar = bars.index(stage)
        _expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, q1_desc, do1_desc, SPLIT, SPLIT_V, pred)
        _tma_load(q_desc, [row, col], bar, q_smem.index(stage), pred=pred)
        if SPLIT:
            _tma_load(q1_desc, [row, col + D_QK0], bar, q1_smem.index(stage), pred=pred)
        _tma_load(do_desc, [do_row, do_col], bar, do_smem.index(stage), pred=pred)
        if SPLIT_V:
            _tma_load(do1_desc, [do_row, do_col + D_V0], bar, do1_smem.index(stage), pred=pred)

    @gluon.jit
    def _dkdv_gluon(
        q_desc, q1_desc, k_desc, k1_desc, v_desc, do_desc, LSE, DELTA, DK, DV,
        qk_scale, scale, M, N, H, HK, GROUP_N,
        Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH,
        D_QK0: gl.constexpr, D_QK1: gl.constexpr, D_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, TOKEN_MAJOR: gl.constexpr, num_warps: gl.constexpr,
        dk_desc=None, dk1_desc=None, dv_desc=None, TMA_STORE: gl.constexpr = False,
        FRESH_DESC: gl.constexpr = False, HSPLIT: gl.constexpr = 1,
        v1_desc=None, do1_desc=None, D_V1: gl.constexpr = 0, DQK_W: gl.constexpr = 0, DV_W: gl.constexpr = 0,
    ):
        # DKDV_ODD (D_V1 > 0, or padded blocks): Dv = D_V + D_V1 as two blocks (V / dO in two buffers, dP^T from two
        # chained wgmmas, dV in two accumulators); DQK_W / DV_W: the real row widths of dK / dV when their last block
        # is padded past the row's end (TMA's zeros on loads; the stores are masked), else 0 (the blocks' sum).
        # Not with TMA_STORE or FRESH_DESC (the launcher does not ask for them).
        # FRESH_DESC: K and V (single buffers) indexed in the loop by t * 0 with the 0 unknown to the compiler
        # (program_id(2) of a 1-deep grid), so that their wgmma descriptors are recomputed each step instead of
        # held across the loop (gluon_bwd_fused.py: that took its spills from 324 bytes to none).
        # TMA_STORE: dk_desc / dk1_desc / dv_desc are [B * HK * N, D] views of DK (columns 0 .. D_QK0 and
        # D_QK0 ..) and DV in blocks of BLOCK_N rows.
        # HSPLIT (heads split): axis 1 counts B x HK x HSPLIT programs, and program s of a KV head takes query
        # heads s * GROUP_N .. (s + 1) * GROUP_N of its group (GROUP_N is then the group / HSPLIT); its dK / dV
        # are that part's sums, stored in float32 to DK / DV seen as [B, HK * HSPLIT, N, D] (the launcher adds
        # the parts in a fixed order). i_hq: the index whose GROUP_N query heads this program walks.
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        if HSPLIT > 1:
            i_b = pid_bh // (HK * HSPLIT)
            i_hq = pid_bh % (HK * HSPLIT)
            i_hk = i_hq // HSPLIT
        else:
            i_b = pid_bh // HK
            i_hk = pid_bh % HK
            i_hq = i_hk
        n0 = pid_n * BLOCK_N
        lay = (Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH)
        if TOKEN_MAJOR:  # rows / columns of this program's keys in the 2-D views (gluon_fwd._tma_view)
            kv_row0 = i_b * K_RB + i_hk * K_RH + n0
            k_col0 = i_hk * K_CH
            v_row0 = i_b * V_RB + i_hk * V_RH + n0
            v_col0 = i_hk * V_CH
        else:  # head-major [B * HK * N, D] views
            if HSPLIT > 1:
                kv_row0 = (i_b * HK + i_hk) * N + n0
            else:
                kv_row0 = pid_bh * N + n0
            k_col0 = 0
            v_row0 = kv_row0
            v_col0 = 0
        shift = N - M

        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D_QK0, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D_V, 16])
        SPLIT: gl.constexpr = D_QK1 > 0
        SPLIT_V: gl.constexpr = D_V1 > 0
        dtype: gl.constexpr = q_desc.dtype

        if FRESH_DESC:
            k_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_QK0], k_desc.layout)
            v_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_V], v_desc.layout)
            k_smem = k_buf.index(0)
            v_smem = v_buf.index(0)
        else:
            k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_QK0], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_V], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_QK0], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_V], do_desc.layout)
        if SPLIT_V:
            v1_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_V1], v1_desc.layout)
            do1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_V1], do1_desc.layout)
        else:
            v1_smem = v_smem
            do1_smem = do_smem
        if SPLIT:
            if FRESH_DESC:
                k1_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_QK1], k1_desc.layout)
                k1_smem = k1_buf.index(0)
            else:
                k1_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_QK1], k1_desc.layout)
            q1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_QK1], q1_desc.layout)
        else:
            k1_smem = k_smem
            q1_smem = q_smem
        if TMA_STORE:  # dK's and dV's own buffers (the epilogue)
            dk_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_QK0], dk_desc.layout)
            dv_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_V], dv_desc.layout)
            if SPLIT:
                dk1_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D_QK1], dk1_desc.layout)
            else:
                dk1_smem = dk_smem
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        # Row tiles that can see this key block: causal (bottom-right), row i sees key n0 iff
        # i >= n0 - shift; all of them otherwise.
        n_rows_tiles = gl.cdiv(M, BLOCK_M)
        rt0 = 0
        if CAUSAL:
            rt0 = gl.minimum(gl.maximum(n0 - shift, 0) // BLOCK_M, n_rows_tiles)
        n_rt = n_rows_tiles - rt0
        n_tiles = GROUP_N * n_rt

        _expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, k1_desc, v1_desc, SPLIT, SPLIT_V, True)
        if SPLIT:
            _tma_load(k1_desc, [kv_row0, k_col0 + D_QK0], kv_bar, k1_smem)
        _tma_load(k_desc, [kv_row0, k_col0], kv_bar, k_smem)
        _tma_load(v_desc, [v_row0, v_col0], kv_bar, v_smem)
        if SPLIT_V:
            _tma_load(v1_desc, [v_row0, v_col0 + D_V], kv_bar, v1_smem)
        for i in gl.static_range(STAGES):
            _load_rows(q_desc, q1_desc, do_desc, q_smem, q1_smem, do_smem, bars, i, n_rt, rt0, M, H, i_b, i_hq,
                       GROUP_N, BLOCK_M, STAGES, D_QK0, SPLIT, n_tiles, lay, TOKEN_MAJOR, do1_desc, do1_smem, D_V,
                       SPLIT_V)

        dk = gl.zeros([BLOCK_N, D_QK0], gl.float32, layout=dk_layout)
        if SPLIT:
            dk1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, D_QK1, 16])
            dk1 = gl.zeros([BLOCK_N, D_QK1], gl.float32, layout=dk1_layout)
        else:
            dk1 = dk
        dv = gl.zeros([BLOCK_N, D_V], gl.float32, layout=dv_layout)
        if SPLIT_V:
            dv1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, D_V1, 16])
            dv1 = gl.zeros([BLOCK_N, D_V1], gl.float32, layout=dv1_layout)
            pa1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv1_layout, k_width=2)
        else:
            dv1 = 0
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        dsa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        o_key = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # [BLOCK_N]
        o_rl = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))  # [BLOCK_M]

        mbarrier.wait(kv_bar, 0)
        for t in range(0, n_tiles):
            stage = t % STAGES
            if FRESH_DESC:
                zero_t = t * gl.program_id(2)
                k_smem = k_buf.index(zero_t)
                v_smem = v_buf.index(zero_t)
                if SPLIT:
                    k1_smem = k1_buf.index(zero_t)
            g = t // n_rt
            start_m = (rt0 + t % n_rt) * BLOCK_M
            o_row = start_m + o_rl
            stat = (i_b * H + i_hq * GROUP_N + g).to(gl.int64) * M
            # lse (natural log) -> base 2; -inf (row sees no key) and rows past M -> +inf: P = 0.
            lse = gl.load(LSE + stat + o_row, mask=o_row < M, other=float("-inf"))
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            delta = gl.load(DELTA + stat + o_row, mask=o_row < M, other=0.0)

            mbarrier.wait(bars.index(stage), (t // STAGES) & 1)
            s_t = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), st_zero, use_acc=False, is_async=True)
            if SPLIT:
                s_t = warpgroup_mma(k1_smem, q1_smem.index(stage).permute((1, 0)), s_t, is_async=True)
            dp_t = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), st_zero, use_acc=False,
                                 is_async=True)
            if SPLIT_V:  # dP^T over the value head's second block, chained
                dp_t = warpgroup_mma(v1_smem, do1_smem.index(stage).permute((1, 0)), dp_t, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=2 if SPLIT_V else 1, deps=(s_t,))
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
            if CAUSAL:  # key j is visible to row i iff j <= i + shift
                p_t = gl.where(o_key[:, None] <= (o_row + shift)[None, :], p_t, 0.0)
            p_op = gl.convert_layout(p_t.to(dtype), pa_layout)
            dv = warpgroup_mma(p_op, do_smem.index(stage), dv, is_async=True)
            if SPLIT_V:
                dv1 = warpgroup_mma(gl.convert_layout(p_op, pa1_layout), do1_smem.index(stage), dv1, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=2 if SPLIT_V else 1, deps=(dp_t,))
            ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
            dk = warpgroup_mma(gl.convert_layout(ds_t, dsa_layout), q_smem.index(stage), dk, is_async=True)
            if SPLIT:
                dk1_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk1_layout, k_width=2)
                dk1 = warpgroup_mma(gl.convert_layout(ds_t, dk1_a), q1_smem.index(stage), dk1, is_async=True)
                if SPLIT_V:
                    dv, dv1, dk, dk1 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dv1, dk, dk1))
                else:
                    dv, dk, dk1 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dk1))
            elif SPLIT_V:
                dv, dv1, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dv1, dk))
            else:
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            # Both warpgroups are done with this stage once every thread passes here: refill it.
            _thread_barrier()
            _load_rows(q_desc, q1_desc, do_desc, q_smem, q1_smem, do_smem, bars, t + STAGES, n_rt, rt0, M, H, i_b,
                       i_hq, GROUP_N, BLOCK_M, STAGES, D_QK0, SPLIT, n_tiles, lay, TOKEN_MAJOR, do1_desc, do1_smem,
                       D_V, SPLIT_V)

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        if TMA_STORE:
            if n0 + BLOCK_N <= N:  # a whole key block: registers -> shared memory -> one TMA store each
                dk_smem.store((dk * scale).to(dtype))
                dv_smem.store(dv.to(dtype))
                if SPLIT:
                    dk1_smem.store((dk1 * scale).to(dtype))
                fence_async_shared()
                _thread_barrier()
                row = pid_bh * N + n0
                _tma_store(dk_desc, [row, 0], dk_smem)
                if SPLIT:
                    _tma_store(dk1_desc, [row, D_QK0], dk1_smem)
                _tma_store(dv_desc, [row, 0], dv_smem)
                tma.store_wait(0)
            else:
                _store_dkdv(dk, dk1, dv, DK, DV, pid_bh, n0, N, scale, dk_layout, dv_layout, BLOCK_N, D_QK0, D_QK1,
                            D_V, SPLIT, num_warps, dv1, D_V1, DQK_W, DV_W)
        else:
            _store_dkdv(dk, dk1, dv, DK, DV, pid_bh, n0, N, scale, dk_layout, dv_layout, BLOCK_N, D_QK0, D_QK1, D_V,
                        SPLIT, num_warps, dv1, D_V1, DQK_W, DV_W)

    @gluon.jit
    def _store_dkdv(dk, dk1, dv, DK, DV, pid_bh, n0, N, scale, dk_layout: gl.constexpr, dv_layout: gl.constexpr,
                    BLOCK_N: gl.constexpr, D_QK0: gl.constexpr, D_QK1: gl.constexpr, D_V: gl.constexpr,
                    SPLIT: gl.constexpr, num_warps: gl.constexpr, dv1=0, D_V1: gl.constexpr = 0,
                    DQK_W: gl.constexpr = 0, DV_W: gl.constexpr = 0):
        """dK (scaled) and dV of keys n0 .. n0 + BLOCK_N stored straight from the accumulators, keys >= N left out.
        D_V1 > 0: dV's columns D_V.. are in dv1. DQK_W / DV_W (0: the blocks' sums): the rows' real widths, when a
        last block is padded past them (its padding columns are not stored)."""
        base = pid_bh.to(gl.int64) * N
        if DQK_W > 0:
            d_qk: gl.constexpr = DQK_W
        else:
            d_qk: gl.constexpr = D_QK0 + D_QK1
        if DV_W > 0:
            d_v: gl.constexpr = DV_W
        else:
            d_v: gl.constexpr = D_V + D_V1
        _store_cols(DK, (dk * scale).to(DK.dtype.element_ty), base, n0, N, dk_layout, BLOCK_N, 0, D_QK0, d_qk)
        if SPLIT:
            dk1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, D_QK1, 16])
            _store_cols(DK, (dk1 * scale).to(DK.dtype.element_ty), base, n0, N, dk1_layout, BLOCK_N, D_QK0, D_QK1,
                        d_qk)
        _store_cols(DV, dv.to(DV.dtype.element_ty), base, n0, N, dv_layout, BLOCK_N, 0, D_V, d_v)
        if D_V1 > 0:
            dv1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, D_V1, 16])
            _store_cols(DV, dv1.to(DV.dtype.element_ty), base, n0, N, dv1_layout, BLOCK_N, D_V, D_V1, d_v)

    @gluon.jit
    def _store_cols(T, x, base, n0, N, layout: gl.constexpr, BLOCK_N: gl.constexpr, COL0: gl.constexpr,
                    W: gl.constexpr, ROW: gl.constexpr):
        """x [BLOCK_N, W] (in ``layout``) into columns COL0 .. COL0 + W of rows base + n0 .. of T, rows ROW elements
        long: keys >= N left out, and columns past ROW (a padded last block's)."""
        o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        o_d = COL0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
        ptrs = T + (base + o_n.to(gl.int64))[:, None] * ROW + o_d[None, :]
        if COL0 + W > ROW:
            gl.store(ptrs, x, mask=(o_n < N)[:, None] & (o_d < ROW)[None, :])
        else:
            gl.store(ptrs, x, mask=(o_n < N)[:, None])


if AVAILABLE:
    @gluon.jit
    def _dq_step(j, dq, dq1, q_smem, q1_smem, do_smem, k_smem, k1_smem, v_smem, bars, k_desc, k1_desc, v_desc,
                 kv_row0, n_tiles, lse2, delta, o_m, o_n, M, N, qk_scale, s_zero, dtype: gl.constexpr,
                 dqa_layout: gl.constexpr, dq1a_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, MASK: gl.constexpr, D_QK0: gl.constexpr, SPLIT: gl.constexpr):
        """Key tile j of the dQ pass: S = Q K^T and dP = dO V^T issued together; P under dP; dQ += dS K;
        wait for all; refill this tile's stage with tile j + STAGES."""
        stage = j % STAGES
        mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if SPLIT:
            s = warpgroup_mma(q1_smem, k1_smem.index(stage).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_smem, v_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p = gl.exp2(s * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        if MASK:  # keys past N (the tile's tail holds another head's rows), and the causal diagonal
            cols = j * BLOCK_N + o_n
            vis = (cols < N)[None, :]
            if CAUSAL:
                vis = vis & (cols[None, :] <= (o_m + (N - M))[:, None])
            p = gl.where(vis, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = (p * (dp - delta[:, None])).to(dtype)
        dq = warpgroup_mma(gl.convert_layout(ds, dqa_layout), k_smem.index(stage), dq, is_async=True)
        if SPLIT:
            dq1 = warpgroup_mma(gl.convert_layout(ds, dq1a_layout), k1_smem.index(stage), dq1, is_async=True)
            dq, dq1 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq1))
        else:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        _thread_barrier()  # both warpgroups are done with this stage
        _load_kv(k_desc, k1_desc, v_desc, k_smem, k1_smem, v_smem, bars, j + STAGES, kv_row0, n_tiles, BLOCK_N,
                      STAGES, D_QK0, SPLIT)
        return dq, dq1

    @gluon.jit
    def _dq_gluon(
        q_desc, q1_desc, do_desc, k_desc, k1_desc, v_desc, LSE, DELTA, DQ,
        qk_scale, scale, M, N, H, HK,
        D_QK0: gl.constexpr, D_QK1: gl.constexpr, D_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        if CAUSAL:  # the longest row blocks first
            pid_m = gl.num_programs(0) - 1 - pid_m
        i_b = pid_bh // H
        i_h = pid_bh % H
        i_hk = i_h // (H // HK)
        q_row0 = pid_bh * M + pid_m * BLOCK_M
        kv_row = (i_b * HK + i_hk) * N
        kv_row0 = (kv_row, 0, kv_row, 0)  # (K row, K column, V row, V column): gluon_fwd._load_kv

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D_QK0, 16])
        dqa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        SPLIT: gl.constexpr = D_QK1 > 0
        dtype: gl.constexpr = q_desc.dtype

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_QK0], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_V], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_QK0], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], v_desc.layout)
        if SPLIT:
            dq1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, D_QK1, 16])
            dq1a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq1_layout, k_width=2)
            q1_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_QK1], q1_desc.layout)
            k1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_QK1], k1_desc.layout)
        else:
            dq1_layout: gl.constexpr = dq_layout
            dq1a_layout: gl.constexpr = dqa_layout
            q1_smem = q_smem
            k1_smem = k_smem
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        kv_end = N
        if CAUSAL:  # keys the block's last row sees (bottom-right)
            kv_end = gl.maximum(gl.minimum(N, (pid_m + 1) * BLOCK_M + (N - M)), 0)
        n_tiles = gl.cdiv(kv_end, BLOCK_N)
        # Tiles below n_full are seen whole by every row of the block and lie below N: no mask.
        n_full = n_tiles - 1
        if CAUSAL:
            n_full = gl.minimum(n_full, gl.maximum(pid_m * BLOCK_M + (N - M) + 1, 0) // BLOCK_N)
        n_full = gl.maximum(n_full, 0)

        if SPLIT:
            mbarrier.expect(q_bar, q_desc.block_type.nbytes + q1_desc.block_type.nbytes + do_desc.block_type.nbytes)
            _tma_load(q1_desc, [q_row0, D_QK0], q_bar, q1_smem)
        else:
            mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row0, 0], q_bar, q_smem)
        _tma_load(do_desc, [q_row0, 0], q_bar, do_smem)
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, k1_desc, v_desc, k_smem, k1_smem, v_smem, bars, i, kv_row0, n_tiles, BLOCK_N,
                          STAGES, D_QK0, SPLIT)

        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        stat = pid_bh.to(gl.int64) * M
        lse = gl.load(LSE + stat + o_m, mask=o_m < M, other=float("-inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # P = 0 for empty rows
        delta = gl.load(DELTA + stat + o_m, mask=o_m < M, other=0.0)
        dq = gl.zeros([BLOCK_M, D_QK0], gl.float32, layout=dq_layout)
        dq1 = gl.zeros([BLOCK_M, D_QK1 if SPLIT else D_QK0], gl.float32, layout=dq1_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, 0)
        for j in range(0, n_full):
            dq, dq1 = _dq_step(j, dq, dq1, q_smem, q1_smem, do_smem, k_smem, k1_smem, v_smem, bars, k_desc, k1_desc,
                               v_desc, kv_row0, n_tiles, lse2, delta, o_m, o_n, M, N, qk_scale, s_zero, dtype,
                               dqa_layout, dq1a_layout, BLOCK_N, STAGES, CAUSAL, False, D_QK0, SPLIT)
        for j in range(n_full, n_tiles):
            dq, dq1 = _dq_step(j, dq, dq1, q_smem, q1_smem, do_smem, k_smem, k1_smem, v_smem, bars, k_desc, k1_desc,
                               v_desc, kv_row0, n_tiles, lse2, delta, o_m, o_n, M, N, qk_scale, s_zero, dtype,
                               dqa_layout, dq1a_layout, BLOCK_N, STAGES, CAUSAL, True, D_QK0, SPLIT)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        d_qk: gl.constexpr = D_QK0 + D_QK1
        o_mq = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        o_dq = gl.arange(0, D_QK0, layout=gl.SliceLayout(0, dq_layout))
        rows = (stat + o_mq.to(gl.int64))[:, None] * d_qk
        gl.store(DQ + rows + o_dq[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=(o_mq < M)[:, None])
        if SPLIT:
            o_mq1 = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq1_layout))
            o_dq1 = D_QK0 + gl.arange(0, D_QK1, layout=gl.SliceLayout(0, dq1_layout))
            rows1 = (stat + o_mq1.to(gl.int64))[:, None] * d_qk
            gl.store(DQ + rows1 + o_dq1[None, :], (dq1 * scale).to(DQ.dtype.element_ty), mask=(o_mq1 < M)[:, None])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`dkdv_gluon` takes these inputs (else the Triton dK/dV kernel runs)."""
    if not (AVAILABLE and q.is_cuda and is_hopper(q.device)):
        return False
    if not _VERSION_OK:  # a Triton these kernels were not run with (_gluon_compat)
        _warn_untested()
        return False
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if not (q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and q.shape[1] % k.shape[1] == 0):
        return False
    if _dkdv_odd_split(d_qk, d_v) is not None:
        return True
    split = _split_head_dim(d_qk)
    return split is not None and split[0] <= 128 and d_v in (64, 128)


def _dkdv_odd_split(d_qk: int, d_v: int):
    """(Dqk's, Dv's ``_split_padded``) where DKDV_ODD takes these widths, else None. Registers bound it: dK and
    dV accumulate 128 keys each, over Dqk <= 192 (a first block <= 128) and Dv <= 128 columns."""
    if DKDV_ODD in (False, "0"):
        return None
    qs, vs = _split_padded(d_qk), _split_padded(d_v)
    if qs is None or vs is None or qs[0] > 128 or qs[0] + qs[1] > 192 or vs[0] + vs[1] > 128:
        return None
    if DKDV_ODD in (True, "1") or (qs[0] >= 64 and vs[0] >= 64):  # "auto": where it gained
        return qs, vs
    return None


def _dkdv_narrow_tiles(d_qk: int, d_v: int):
    """DKDV_NARROW's (keys a program, warps, rows a step, stages) for these widths, or None: the default tiles."""
    if DKDV_NARROW in (False, "0") or d_qk != d_v or not 64 <= d_v <= 96 or _split_padded(d_v) is None:
        return None
    return 64, 4, 64, 2


# (rows a step, ring stages) when dkdv_gluon is not told; None: by head width (see _tiles).
TILES = None


def _tiles(d_qk: int) -> tuple[int, int]:
    """H200, fwd+bwd TFLOP/s with this pass (docs/benchmarks.md, session 12). Up to d 128, 64 rows and
    2 stages: 377 vs 347 with (32, 3) at 4 x 32 x 4096, 341 vs 306 at GQA 8 x 32/8 x 2048 (255 registers,
    32 bytes spilled). At 192/128, 64 rows spill 248 bytes and lose (335 vs 375, 276 vs 322): (32, 3)."""
    if TILES is not None:
        return TILES
    return (64, 2) if d_qk <= 128 else (32, 3)


def _hsplit(b: int, h: int, hk: int, n: int, block_n: int, device) -> int:
    """DKDV_HSPLIT's choice for these shapes (see there)."""
    group = h // hk
    if DKDV_HSPLIT != "auto":
        hs = int(DKDV_HSPLIT) or 1
        return hs if group % hs == 0 else 1
    programs, sms = b * hk * -(-n // block_n), _num_sms(device)
    hs = 1
    if programs < sms:
        while programs * hs < 2 * sms and group % (2 * hs) == 0:
            hs *= 2
    return hs


def _part_buffers(dk, dv, hs: int):
    """float32 [B, HK * hs, N, D] buffers for the heads-split parts of dk and dv (through triton_fwd._alloc,
    which the tests poison: a part left unwritten shows)."""
    from .triton_fwd import _alloc

    b, hk, n = dk.shape[:3]
    return (_alloc((b, hk * hs, n, dk.shape[-1]), dk.device, torch.float32),
            _alloc((b, hk * hs, n, dv.shape[-1]), dv.device, torch.float32))


def _add_parts(parts, outs, hs: int) -> None:
    """Each output the sum of its hs parts, added in one order (deterministic), cast to its dtype."""
    for part, out in zip(parts, outs):
        b, hk, n, d = out.shape
        out.copy_(part.view(b, hk, hs, n, d).sum(2))


def dkdv_gluon(q, k, v, do, lse, delta, dk, dv, *, causal: bool, scale: float, block_m: int | None = None,
               block_n: int | None = None, stages: int | None = None, num_warps: int | None = None,
               token_major: bool = False, hsplit: int | None = None):
    """Fill dk [B, HK, N, Dqk] and dv [B, HK, N, Dv] (contiguous) from q [B, H, M, Dqk], k, v, do
    [B, H, M, Dv], lse and delta [B, H, M] float32 (contiguous). Causal is bottom-right.

    Tiles: 128 keys a program (two warpgroups); rows a step and ring stages from ``_tiles``; with none of the
    four given and ``TILES`` unset, ``DKDV_NARROW``'s tiles for narrow heads. ``hsplit`` (None:
    ``DKDV_HSPLIT``): the programs a KV head's query heads are split between (it must divide the group). Calls
    with the default tiles replay a plan kept per call key (``gluon_fwd.DescPlan``)."""
    b, h, m, d_qk = q.shape
    hk, n, d_v = k.shape[1], k.shape[2], v.shape[-1]
    untold = (block_m, block_n, stages, num_warps) == (None,) * 4
    narrow = _dkdv_narrow_tiles(d_qk, d_v) if untold and TILES is None else None
    if narrow:
        block_n, num_warps, block_m, stages = narrow
    block_n = 128 if block_n is None else block_n
    num_warps = 8 if num_warps is None else num_warps
    hs = _hsplit(b, h, hk, n, block_n, q.device) if hsplit is None else hsplit
    if hs < 1 or (h // hk) % hs:
        raise ValueError(f"dkdv_gluon: hsplit must divide the group ({h // hk} query heads a KV head), got {hs}")
    out_k, out_v = _part_buffers(dk, dv, hs) if hs > 1 else (dk, dv)
    key = None
    if _fast.enabled() and untold and hsplit is None:
        key = (tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(do), tensor_key(lse), tensor_key(delta),
               tensor_key(dk), tensor_key(dv), bool(causal), bool(token_major), DKDV_TMA_STORE, DKDV_FRESH_DESC, TILES,
               DKDV_HSPLIT, DKDV_ODD, DKDV_NARROW)
        plan = _plans.get(key)
        if plan is not None:
            plan.launch(*plan.values((q, do, k, v, out_k, out_v), _dkdv_named(lse, delta, out_k, out_v, scale)))
            if hs > 1:
                _add_parts((out_k, out_v), (dk, dv), hs)
            return dk, dv
    block_m = _tiles(d_qk)[0] if block_m is None else block_m
    stages = _tiles(d_qk)[1] if stages is None else stages
    assert dk.is_contiguous() and dv.is_contiguous() and lse.is_contiguous() and delta.is_contiguous()
    el = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    splits = _dkdv_odd_split(d_qk, d_v)
    (d0, d1, qk_pad), (dv0, dv1, v_pad) = splits if splits else (_split_head_dim(d_qk) + (0,), (d_v, 0, 0))
    # A padded block's columns past the row's end must be TMA's zeros (S^T and dP^T must not see them): those
    # tensors are read head-major (gluon_fwd.flash_fwd_gluon does the same).
    majors = (token_major and not qk_pad, token_major and not v_pad, token_major and not qk_pad,
              token_major and not v_pad)
    views = [_tma_view(t, major) for t, major in zip((q, do, k, v), majors)]
    (q2, *_), (do2, *_), (k2, *_), (v2, *_) = views
    lay = [x for vw in views for x in vw[1:]]  # (RB, RH, CH) of q, do, k, v
    # Descriptor sources: 0 q, 1 do, 2 k, 3 v, then dk and dv seen as [B * HK * N, D] (same data pointers).
    plan = DescPlan(majors, (q, do, k, v), (q2, do2, k2, v2, out_k.view(-1, d_qk), out_v.view(-1, d_v)), el)
    desc = plan.desc
    q_desc, do_desc = desc(0, block_m, d0), desc(1, block_m, dv0)
    k_desc, v_desc = desc(2, block_n, d0), desc(3, block_n, dv0)
    q1_desc, k1_desc = (desc(0, block_m, d1), desc(2, block_n, d1)) if d1 else (None, None)  # as the forward
    odd = {}
    if dv1:
        odd.update(v1_desc=desc(3, block_n, dv1), do1_desc=desc(1, block_m, dv1), D_V1=dv1)
    if qk_pad:
        odd["DQK_W"] = d_qk
    if v_pad:
        odd["DV_W"] = d_v
    grid = ((n + block_n - 1) // block_n, b * hk * hs)
    # Shared memory with dK/dV's own buffers: K, V and their output buffers, and the Q / dO ring.
    smem = 2 * (2 * block_n * (d0 + d1 + d_v) + stages * block_m * (d0 + d1 + d_v))
    extra = {}
    tma_store = hs == 1 and (DKDV_TMA_STORE == "1" or (DKDV_TMA_STORE == "auto" and not d1)) and not odd
    if tma_store and smem <= _SMEM_BYTES and dk.data_ptr() % 16 == 0 and dv.data_ptr() % 16 == 0:
        extra = {"dk_desc": desc(4, block_n, d0), "dk1_desc": desc(4, block_n, d1) if d1 else None,
                 "dv_desc": desc(5, block_n, d_v), "TMA_STORE": True}
    if DKDV_FRESH_DESC == "1" and not odd:  # (no second value block in FRESH_DESC's buffers)
        extra["FRESH_DESC"] = True
        grid = grid + (1,)  # program_id(2): the kernel's 0 that the compiler cannot see
    if hs > 1:
        extra["HSPLIT"] = hs
    plan.launch = Launch(_dkdv_gluon, grid, (
        q_desc, q1_desc, k_desc, k1_desc, v_desc, do_desc, plan.slot("lse"), plan.slot("delta"), plan.slot("dk"),
        plan.slot("dv"), plan.slot("scale2"), plan.slot("scale"), m, n, h, hk, h // hk // hs, *lay,
    ), dict(D_QK0=d0, D_QK1=d1, D_V=dv0, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
            TOKEN_MAJOR=any(vw[3] for vw in views), **extra, **odd), {"num_warps": num_warps})
    plan.launch(*plan.values((q, do, k, v, out_k, out_v), _dkdv_named(lse, delta, out_k, out_v, scale)))
    if hs > 1:
        _add_parts((out_k, out_v), (dk, dv), hs)
    if key is not None:
        _plans.put(key, plan.done())
    return dk, dv


def _dkdv_named(lse, delta, dk, dv, scale) -> dict:
    return {"lse": lse, "delta": delta, "dk": dk, "dv": dv, "scale2": scale * _LOG2E, "scale": scale}


# dkdv_gluon's plans by call key (see gluon_fwd.DescPlan); cleared by the tests around each test. Only calls
# with the default tiles are planned.
_plans = PlanCache()


def dq_gluon(q, k, v, do, lse, delta, dq, *, causal: bool, scale: float, block_m: int = 128, block_n: int = 64,
             stages: int = 3, num_warps: int = 8):
    """Fill dq [B, H, M, Dqk] (contiguous) from q, k, v, do, lse and delta as in :func:`dkdv_gluon`.

    Not routed by default: ``triton_bwd.GLUON_DQ`` (``MLA_ATTN_GLUON_DQ=1``) turns it on, until the H200
    has checked and timed it. Tiles: 128 rows (two warpgroups), 64-key tiles, 3 stages (sm_90a: 172
    registers and 164 KB at d 128, 220 and 205 KB at 192/128, no spills, no C75xx)."""
    b, h, m, d_qk = q.shape
    hk, n, d_v = k.shape[1], k.shape[2], v.shape[-1]
    assert dq.is_contiguous() and lse.is_contiguous() and delta.is_contiguous()
    el = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    d0, d1 = _split_head_dim(d_qk)
    q2 = _tma_ready(q).view(b * h * m, d_qk)
    do2 = _tma_ready(do).view(b * h * m, d_v)
    k2 = _tma_ready(k).view(b * hk * n, d_qk)
    v2 = _tma_ready(v).view(b * hk * n, d_v)

    def desc(t, rows, cols):
        return _desc(t, rows, cols, el)

    q_desc, do_desc = desc(q2, block_m, d0), desc(do2, block_m, d_v)
    k_desc, v_desc = desc(k2, block_n, d0), desc(v2, block_n, d_v)
    q1_desc, k1_desc = (desc(q2, block_m, d1), desc(k2, block_n, d1)) if d1 else (q_desc, k_desc)
    grid = ((m + block_m - 1) // block_m, b * h)
    _dq_gluon[grid](
        q_desc, q1_desc, do_desc, k_desc, k1_desc, v_desc, lse, delta, dq,
        scale * _LOG2E, scale, m, n, h, hk,
        D_QK0=d0, D_QK1=d1, D_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
        num_warps=num_warps,
    )
    return dq

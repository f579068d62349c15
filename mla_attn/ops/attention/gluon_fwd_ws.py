"""EXPERIMENTAL, not routed: a warp-specialised ping-pong flash forward for Hopper in Gluon.

The forward in ``gluon_fwd.py`` runs its two warpgroups in lockstep: both wait at the same CTA barriers
(a refill of the K/V ring needs both to be done with a stage), so while one softmaxes the other
cannot be issuing wgmmas. Here, as in FlashAttention 3, the roles are split with
``gl.warp_specialize``:

- a 1-warp producer partition issues every TMA load (Q once, then K/V tiles through a STAGES-deep
  ring: ``ready`` barriers complete on the bytes, ``empty`` barriers on both consumers' arrivals);
- two 4-warp consumer partitions (the default one and a worker) each own 64 rows of a 128-row block
  and take turns issuing their wgmmas (two ``turn`` mbarriers), so one's tensor-core work runs
  under the other's softmax.

Per key tile t a consumer waits for its turn, issues S_t = Q K_t^T and acc += P_{t-1} V_{t-1}, hands
the turn over, waits for S_t alone, runs the softmax of S_t (under P_{t-1} V_{t-1} and the other
consumer's wgmmas), waits for P_{t-1} V_{t-1}, releases tile t - 1's stage and rescales acc. Nothing
is in flight at the loop's back edge. Q sits in registers as the score wgmma's A operand.

Scope of this first version: bf16/fp16 contiguous [B, H, L, D] inputs, Dqk = Dv in {64, 128}, causal
(bottom-right) or not, GQA. Local sm_90a compile: ``scripts/compile_sm90.py gluon_ws``. Its GPU test
is ``tests/ops/test_attention_gluon_ws.py``, run by ``scripts/gpu_check.sh`` in a step of its own with
a short time limit (a wrong barrier phase hangs rather than fails).

Status (session 13, 827090c, H200): it passes its 12 GPU tests, but is not faster than ``gluon_fwd``
(445-473 TFLOP/s at d 128 against 486; 406-420 on the GQA row against 411), so nothing routes to it.
"""

from __future__ import annotations

import torch

from .._common import is_hopper

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from .._gluon_compat import VERSION_OK as _VERSION_OK
    from .._gluon_compat import tma_load as _tma_load
    from .._gluon_compat import warn_untested as _warn_untested

    from .gluon_fwd import _block_epilogue
    AVAILABLE = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

_LOG2E = 1.4426950408889634
HALF_M = 64  # rows per consumer warpgroup

if AVAILABLE:
    @gluon.jit
    def _tiles(pid_m, M, N, ROWS: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """Key tiles seen by rows [pid_m * ROWS, (pid_m + 1) * ROWS) (bottom-right causal)."""
        kv_end = N
        if CAUSAL:
            kv_end = gl.maximum(gl.minimum(N, (pid_m + 1) * ROWS + (N - M)), 0)
        return gl.cdiv(kv_end, BLOCK_N)

    @gluon.jit
    def _softmax(s, m_i, l_i, t, n_full, o_m, o_n, M, N, qk_scale, dtype: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr):
        """Scores of key tile t -> (P in dtype, alpha, m, l), base 2; tiles from n_full on are masked."""
        s = s * qk_scale
        if t >= n_full:  # keys >= N (the tile's tail holds other rows), the causal diagonal
            cols = t * BLOCK_N + o_n
            vis = (cols < N)[None, :]
            if CAUSAL:
                vis = vis & (cols[None, :] <= (o_m + (N - M))[:, None])
            s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_new = l_i * alpha + gl.sum(p, 1)
        return p.to(dtype), alpha, m_new, l_new

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, q_row0, kv_row0, M, N,
                  pid_m, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        for i in gl.static_range(2):
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row0 + i * 64, 0], q_bars.index(i), q_smem.index(i))
        n_tiles = _tiles(pid_m, M, N, 128, CAUSAL, BLOCK_N)
        for t in range(n_tiles):
            s = t % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0: the first pass waits
            # on parity 1 and goes straight through.
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], ready.index(s), k_smem.index(s))
            _tma_load(v_desc, [kv_row0 + t * BLOCK_N, 0], ready.index(s), v_smem.index(s))

    @gluon.jit
    def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N,
                  pid_m, pid_bh, i_b, i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                  D: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D_V, 16])
        qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = k_smem.dtype

        r0 = pid_m * 128 + WG * 64
        o_m = r0 + gl.arange(0, 64, layout=row_s)
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        n_tiles = _tiles(pid_m, M, N, 128, CAUSAL, BLOCK_N)  # what the producer loads
        n_mine = n_tiles
        n_full = n_tiles - 1  # tiles below it: no key >= N, no causal mask
        if CAUSAL:
            n_mine = gl.minimum(n_tiles, gl.cdiv(gl.maximum(gl.minimum(N, r0 + 64 + (N - M)), 0), BLOCK_N))
            n_full = gl.minimum(n_mine - 1, gl.maximum(r0 + (N - M) + 1, 0) // BLOCK_N)
        else:
            n_full = n_mine - 1
        n_full = gl.maximum(n_full, 0)

        mbarrier.wait(q_bars.index(WG), 0)
        q = q_smem.index(WG).load(qa_layout)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([64], gl.float32, layout=row_s)
        acc = gl.zeros([64, D_V], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        p_op = gl.zeros([64, BLOCK_N], dtype, layout=p_layout)

        if n_mine > 0:  # tile 0: no P V yet
            mbarrier.wait(ready.index(0), 0)
            mbarrier.wait(turn.index(WG), 0)
            s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p_lo, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, n_full, o_m, o_n, M, N, qk_scale, dtype, BLOCK_N,
                                             CAUSAL)
            p_op = gl.convert_layout(p_lo, p_layout)
        for t in range(1, n_mine):
            st = t % STAGES
            mbarrier.wait(ready.index(st), (t // STAGES) & 1)
            mbarrier.wait(turn.index(WG), t & 1)  # my turn to issue
            s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index((t - 1) % STAGES), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p_lo, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, n_full, o_m, o_n, M, N, qk_scale, dtype, BLOCK_N,
                                             CAUSAL)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p_lo, p_layout)
        if n_mine > 0:  # P V of my last tile, then release its stage
            last = n_mine - 1
            acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(last % STAGES), count=1)
        # Tiles only the other consumer's rows see (causal): keep the turn order and release each stage,
        # after my own last one (the producer refills stages in order).
        for t in range(n_mine, n_tiles):
            st = t % STAGES
            mbarrier.wait(ready.index(st), (t // STAGES) & 1)
            mbarrier.wait(turn.index(WG), t & 1)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            mbarrier.arrive(empty.index(st), count=1)

        _block_epilogue(acc, m_i, l_i, o_m, O, LSE, i_b, i_h, r0, M, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, o_layout, row_o, 64, D_V)

    @gluon.jit
    def _consumer1(q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh, i_b,
                   i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, q_desc, k_desc, v_desc, q_row0,
                   kv_row0, D: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr):
        _consumer(1, q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh, i_b,
                  i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, D, D_V, BLOCK_N, STAGES, CAUSAL)

    @gluon.jit
    def _producer_w(q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh, i_b,
                    i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, q_desc, k_desc, v_desc, q_row0,
                    kv_row0, D: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr):
        # Worker partitions share one signature; this one uses the descriptors and ring.
        _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, ready, empty, q_row0, kv_row0, M, N,
                  pid_m, BLOCK_N, STAGES, CAUSAL)

    @gluon.jit
    def _consumer0(q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh, i_b,
                   i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, D: gl.constexpr, D_V: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        _consumer(0, q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh, i_b,
                  i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, D, D_V, BLOCK_N, STAGES, CAUSAL)

    @gluon.jit
    def _flash_fwd_ws(q_desc, k_desc, v_desc, O, LSE, qk_scale, M, N, H, HK,
                      stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                      D: gl.constexpr, D_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        if CAUSAL:
            pid_m = gl.num_programs(0) - 1 - pid_m
        i_b = pid_bh // H
        i_h = pid_bh % H
        i_hk = i_h // (H // HK)
        q_row0 = pid_bh * M + pid_m * 128
        kv_row0 = (i_b * HK + i_hk) * N
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release each stage
        # Consumer 0 issues first: its turn barrier starts one phase ahead.
        mbarrier.arrive(turn.index(0), count=1)

        gl.warp_specialize([
            (_consumer0, (q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh,
                          i_b, i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, D, D_V, BLOCK_N, STAGES,
                          CAUSAL)),
            (_consumer1, (q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh,
                          i_b, i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, q_desc, k_desc, v_desc,
                          q_row0, kv_row0, D, D_V, BLOCK_N, STAGES, CAUSAL)),
            (_producer_w, (q_smem, k_smem, v_smem, q_bars, ready, empty, turn, O, LSE, qk_scale, M, N, pid_m, pid_bh,
                           i_b, i_h, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, q_desc, k_desc, v_desc,
                           q_row0, kv_row0, D, D_V, BLOCK_N, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if not (AVAILABLE and q.is_cuda and is_hopper(q.device)):
        return False
    if not _VERSION_OK:  # a Triton these kernels were not run with (_gluon_compat)
        _warn_untested()
        return False
    d, d_v = q.shape[-1], v.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype and d == d_v
            and d in (64, 128) and q.shape[1] % k.shape[1] == 0)


def flash_fwd_ws(q, k, v, *, causal: bool, scale: float, block_n: int = 128, stages: int = 2,
                 consumer_regs: int = 232, maxnreg: int = 168):
    """q [B, H, M, D], k/v [B, HK, N, D] -> (o [B, H, M, D], lse [B, H, M]). Experimental, not routed."""
    if not supported(q, k, v):
        raise ValueError(f"flash_fwd_ws: unsupported inputs q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} on {q.device}")
    from .gluon_fwd import _desc, _tma_ready

    b, h, m, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    o = torch.empty(b, h, m, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, m, dtype=torch.float32, device=q.device)
    if o.numel() == 0 or n == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    el = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q2 = _tma_ready(q).view(b * h * m, d)
    k2 = _tma_ready(k).view(b * hk * n, d)
    v2 = _tma_ready(v).view(b * hk * n, d)

    def desc(t, rows, cols):
        return _desc(t, rows, cols, el)

    grid = ((m + 127) // 128, b * h)
    _flash_fwd_ws[grid](
        desc(q2, 64, d), desc(k2, block_n, d), desc(v2, block_n, d), o, lse, scale * _LOG2E, m, n, h, hk,
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        D=d, D_V=d, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=consumer_regs,
        num_warps=4, maxnreg=maxnreg,
    )
    return o, lse

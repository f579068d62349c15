"""A Hopper flash-attention forward written in Gluon: the forward of ``mla_attn.ops.attention`` on Hopper
for contiguous bf16/fp16 inputs it supports (function.py routes there; strided views stay on Triton,
which reads strides, rather than being copied for TMA; ``MLA_ATTN_GLUON=0`` keeps the Triton forward).
Gluon is marked experimental in Triton, and its API moves between releases: on a Triton without it
(or whose Gluon does not have these names) ``AVAILABLE`` is False and the Triton forward runs; on one
these kernels have not run with on a GPU (``_gluon_compat.VERSION_OK``: 3.6 so far) ``supported`` says
no, with one warning, and the Triton forward runs too.

Why Gluon: the plain-Triton forward (``triton_fwd.py``) tops out at 0.77-0.88x of cuDNN SDPA on the
H200. Triton 3.6 waits for each wgmma right after issuing it whenever its result is used in the
same iteration, so the softmax (MUFU and ALU work) never overlaps the tensor cores (analysis in
docs/benchmarks.md, session 10). Gluon exposes ``warpgroup_mma(is_async=True)`` and
``warpgroup_mma_wait(num_outstanding=...)``, so the overlap can be written out. Per key tile j:

    loop top: S_j = Q K_j^T is complete
    1. issue S_{j+1} = Q K_{j+1}^T                       (tensor cores)
    2. softmax of S_j -> P_j, row rescale alpha_j         (CUDA cores, while 1 runs)
    3. wait for P_{j-1} V_{j-1} (S_{j+1} may still run)
    4. CTA barrier, then refill the ring stage that tile j - 1 used (TMA)
    5. acc = alpha_j * acc; issue acc += P_j V_j          (tensor cores)
    6. wait for S_{j+1} and P_j V_j

That is the plain schedule (``PV_OVERLAP=False``): P_j V_j overlaps nothing. Letting it run on into
the next softmax by waiting only for S_{j+1} at step 6 made ptxas 12.8 (Triton 3.6) report C7514 and
serialise every wgmma: an accumulator still in flight at the loop's back edge gets copied.
``PV_OVERLAP=True`` (the default for Dv <= 128) reorders instead. Step j issues P_j V_j (P_j comes
from step j - 1, acc is already rescaled), refills, and issues S_{j+2}. It runs the softmax of
S_{j+1} under both wgmmas, waits for P_j V_j alone, and rescales acc by alpha_{j+1} and converts
P_{j+1} while S_{j+2} still runs. P_j V_j reads its A operand from the registers P_{j+1} goes to,
so that conversion cannot come earlier. Then it waits for S_{j+2}: nothing is in flight at the back
edge. The steady loop is unrolled by two, so consecutive score tiles sit in two register sets and
the finished S_{j+2} is not copied at the back edge (the single loop spent 32 MOVs a tile on that).
At Dv = 256 the accumulator leaves too few registers (C7512, spills), so that size keeps the plain
schedule. ``Q_IN_REGS`` holds Q in registers as the scores' A operand: a 64 x 64 x 16 wgmma with both
operands in shared memory reads 4 KB in 32 cycles, all of shared memory's 128 B a cycle.

K and V tiles arrive by TMA through a STAGES-deep ring of shared-memory buffers, one mbarrier each.
STAGES >= 3: the stage refilled in iteration j is tile j - 1's, and tile j + 1 must already be on its
way. P goes from the S accumulator to the A operand of P V in registers. Two warpgroups (8 warps)
own 64 rows each of a 128-row block.

Status (2026-12-03, session 12): correct on the H200 (tests/ops/test_attention_gluon.py, 36 GPU tests
against the float64 oracle, and every Triton-forward GPU test through the public op). Against the
Triton forward in the same run (d45e3df, scripts/bench_attention.py --gluon, docs/benchmarks.md):
+4% at 4 x 32 x 4096 x 128, +9% at 2 x 16 x 8192 x 192/128, +7% at 4 x 128 x 2048 x 192/128, +4% at
GQA 8 x 32/8 x 2048 x 128.

The persistent schedule (``PERSISTENT``, "auto": on at Dqk = Dv = 128; ``MLA_ATTN_GLUON_PERSISTENT``): one
program an SM takes row blocks in a static snake over the grid's order. When a block's key loop is done it
re-arms the barriers and requests the next block's Q and first key tiles, then normalises and stores this
block's output by TMA from a buffer of its own, so those loads' latency hides under the epilogue. Why: a
block-timeline build (session 16) put ~4700 fixed cycles on each block of the grid (prologue, epilogue, the
gap before the next), which weighs most at L 2048. History: the first version (c97a5b7: an acq_rel atomic
counter at the top of every block, broadcast behind a CTA barrier; direct stores) was 6-12% slower than the
grid. The rewrite (session 16; run at 712e22f and 1cbb9f5, session 17): fixed cost ~2900 cycles a block,
gap ~100; five rotated rounds against the grid: +1.8% at 4 x 32 x 4096 x 128, +3.0% at GQA 8 x 32/8 x 2048,
-3% and -8% at 192/128, where shared memory has no room for an output buffer of its own (direct stores,
~6600 cycles an epilogue) -- so "auto" keeps the grid there. The relaxed-atomic work order
(``PERSISTENT_SCHEDULE`` 0) was 1.3-7% behind the snake.

``S1_EARLY`` ("auto": with the persistent schedule at d 128): each block issues its second score tile before
its first tile's softmax, so they overlap; at sm_90a the exponentials of tile 0 follow S_1's wgmmas (the row
max is hoisted above them). H200 (1cbb9f5): +0.5% over persistent alone at d 128 (within the noise, never
behind), -0.9% to +1% in the grid.

Head pairs (``HEAD_PAIR``, "auto": causal GQA with an even group): a 128-row block holds 64 rows of each of two
query heads sharing a KV head, at the same positions, so on the causal diagonal both warpgroups see the same
keys. A one-head block's first warpgroup computes the block's last 64-key tile for nothing, because the
warpgroups run in lockstep. H200 (855b928): +2.6% at GQA 8 x 32/8 x 2048 (persistent), +5.5% at 16 x 16/8 x 1024.

The output leaves by TMA (``TMA_STORE``, on): registers -> Q's shared-memory buffer -> one TMA store a
block. A block-timeline build (``block_trace=``, scripts/trace_flash_blocks.py; session 16) had found the
direct stores from the accumulator layout taking ~4500 cycles a block, 7-12% of the kernel; through TMA
the epilogue takes ~2100, and the forward gained 5-8% (H200, 5fb5556).

Scope:
- bf16 or fp16 [B, H, L, D] inputs, copied if not contiguous.
- D_v of 64, 128 or 256.
- D_qk a power of two, or the sum of two: 192 = 128 + 64 takes two TMA blocks and two chained wgmmas.
- ``ODD_WIDTHS`` ("auto" by default: 72, 80, 88, 96 and the like; session 32, H100): both head widths
  split into two power-of-two TMA blocks of at least 16 columns, the second padded by up to 8 columns past the
  row's end, which TMA fills with zeros on loads and clips on stores (Dqk 72 = 64 + 16 - 8, 40 = 32 + 16 - 8).
  A split value head runs two accumulators and two P V wgmma groups (80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32):
  Gluon tensors are powers of two, so one 80-wide accumulator cannot be written. Padded heads are read
  head-major (a token-major row would run into the next head's columns, not zeros). Not in the persistent
  schedule.
- Any M and N, causal bottom-right or not, GQA.
Everything else stays on the Triton kernel.
"""

from __future__ import annotations

import functools

import torch

from .. import _env
from .. import _launch as _fast
from .._common import is_hopper
from .._launch import Launch, PlanCache, Slot, rebased, tensor_key

try:  # Gluon is experimental: absent from older Triton, and its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .._gluon_compat import VERSION_OK as _VERSION_OK
    from .._gluon_compat import thread_barrier as _thread_barrier
    from .._gluon_compat import tma_load as _tma_load
    from .._gluon_compat import warn_untested as _warn_untested
    from .._gluon_compat import tma_store as _tma_store

    from .._gluon_trace import block_stamp as _block_stamp
    from .._gluon_trace import stamp as _trace_stamp
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

_LOG2E = 1.4426950408889634
# The persistent schedule (``_persistent_loop``): one program an SM takes row blocks in a static snake over
# the grid's order and requests the next block's loads before storing this block's output. "auto" (default):
# where the output has a TMA buffer of its own, Dqk = Dv = 128 -- there, on the H200 (1cbb9f5, five rotated
# rounds each), 1.8% (4 x 32 x 4096) and 3.0% (GQA 8 x 32/8 x 2048) faster than the grid; at 192/128 the
# output falls back to direct stores and it was 3-8% slower, so the grid stays. "1" / "0": always / never.
# sm_90a, Triton 3.6, d 128 causal: 248-255 registers, no spills. MLA_ATTN_GLUON_PERSISTENT overrides.
PERSISTENT = _env.choice("MLA_ATTN_GLUON_PERSISTENT", "auto", _env.AUTO_ON_OFF)
# The output stored by TMA through Q's shared-memory buffer (see _block_epilogue); MLA_ATTN_GLUON_TMA_STORE=0
# keeps the direct stores. H200 (5fb5556): bit for bit the direct stores' output; epilogue ~4500 -> ~2100
# cycles a block; 418 -> 446 TFLOP/s at GQA 8 x 32/8 x 2048, 492 -> 517 at 4 x 32 x 4096 x 128.
TMA_STORE = _env.flag("MLA_ATTN_GLUON_TMA_STORE", True)
# The persistent schedule's work order (``_next_work``): 1 (default) a static snake over the grid's order (no
# atomic; programs' work within 1.03x of the mean), 0 a relaxed atomic counter (H200, 1cbb9f5: 1.3-7% slower
# than the snake). MLA_ATTN_GLUON_PERSISTENT_SCHEDULE picks one.
PERSISTENT_SCHEDULE = int(_env.choice("MLA_ATTN_GLUON_PERSISTENT_SCHEDULE", "1"))
# Each row block's second score tile issued before its first tile's softmax (``_block_compute``). "auto"
# (default): with the persistent schedule at d 128, where the pair measured +0.5% over persistent alone (H200,
# 1cbb9f5; within the noise, but never behind); the grid alone measured -0.9% to +1%, so it stays off there.
# "1" / "0": always / never. MLA_ATTN_GLUON_S1_EARLY overrides.
S1_EARLY = _env.choice("MLA_ATTN_GLUON_S1_EARLY", "auto", _env.AUTO_ON_OFF)
# Causal: the last heads' row blocks launched length-major (``_order``), so the last blocks to run are the
# shortest. A block-timeline build (session 16) put the tail (SMs idle after their last block) at 1.5-5% of
# the kernel. EXPERIMENTAL, off: correct on the H200 (0b1dc69, 20 GPU tests, grid and persistent), but no
# gain: five rotated rounds against the grid put the grid with it at +0.4 to +1.1% (noise level) and the
# persistent snake with it 0.7-5.5% behind the snake without (docs/raw/bench_gluon_tail_0b1dc69.md).
# H100 (session 37, bench_row_repeat medians over alternating calls): 4 x 128 x 2048 192/128 0.933 on / 0.938 off
# of SDPA, 2 x 16 x 8192 192/128 0.983 / 0.973 (docs/raw/bench_row_repeat_tail_9c8f9f0_h100.md).
# MLA_ATTN_GLUON_TAIL=1 turns it on.
TAIL = _env.flag("MLA_ATTN_GLUON_TAIL", False)
# Head pairs (``PAIR`` in the kernel): with GQA and an even group, a 128-row block is 64 rows of each of two
# query heads that share a KV head, at the same positions, rather than 128 rows of one head. With causal
# masking the two warpgroups then see the same keys: in a one-head block the first warpgroup's 64 rows see
# none of the block's last 64-key tile, yet compute it in lockstep with the second (~3% of a causal forward at
# L 2048). Each row sees the same tiles in the same order either way, so the output is bit for bit the same.
# H200 (855b928, five rotated rounds, bench_attention.py --gluon-pair): GQA 8 x 32/8 x 2048 persistent 438 ->
# 449 TFLOP/s (+2.6%), 4 x 32/8 x 4096 +0.4%, 16 x 16/8 x 1024 +5.5%; the grid +4-7%. "auto" (default): causal
# GQA with an even group; "1": every even group; "0": never. MLA_ATTN_GLUON_HEAD_PAIR overrides.
HEAD_PAIR = _env.choice("MLA_ATTN_GLUON_HEAD_PAIR", "auto", _env.AUTO_ON_OFF)
# Head widths other than a power of two or a sum of two (``_split_padded``): Dqk 72 as 64 + 16 with the last 8
# columns TMA's zero fill, Dv 72 / 80 / 96 / 160 as two accumulators (64 + 16, 64 + 32, 128 + 32) with two P V
# wgmmas. H100 (d44dbde, session 32): 47 of 47 GPU tests pass (with gluon_bwd.DKDV_ODD); the forward against the
# Triton one at 4 x 32 x 2048: 72 1.08x (GQA 1.13x), 80 1.10x, 96 1.09x, but 40 (32 + 16 - 8) 0.80x and 160 (Dv >
# 128: the plain schedule) 0.91x. "auto" (default): where both widths' first block is at least 64 and Dv <= 128;
# "1" (or True): every width _split_padded takes; "0" (or False): never. MLA_ATTN_GLUON_ODD overrides.
ODD_WIDTHS = _env.choice("MLA_ATTN_GLUON_ODD", "auto", _env.AUTO_ON_OFF)
# Narrow heads (Dqk = Dv from 64 to 96) with two programs an SM (``_narrow_tiles``): at 8 warps and 158-203
# registers one program fills an SM, and its two warpgroups wait at the same barriers, so the tensor cores idle
# through each softmax; a second program's wgmmas fill those gaps. Exact widths take 64-row blocks of one warpgroup
# (PV overlap, 4 stages, Q in registers, no head pairs); padded ones (72, 88: 64 + 16 or 32 with TMA's zero fill)
# take the plain schedule with 128 rows capped at 128 registers (no spills on sm_90a). H100 (e593a4d, session 33,
# 4 x 32 x 2048 causal, against the forward before): 64 1.18x, GQA 64 1.18x, 80 1.15-1.17x, 96 1.14-1.19x;
# 72 1.04-1.08x, 88 1.08x; the 64-row blocks at 128 and 192/128 were 0.81-0.92x (not taken). Routed through the op
# with DKDV_NARROW too (H100, 1be8d80, session 34): the flash-attention GPU tests pass with both on (136 + 127),
# and at 4 x 32 x 2048 the forward reads 0.88 (64), 0.87 (72), 0.90 (GQA 72), 1.00 (80), 1.00 (96) of SDPA, fwd+bwd
# 0.89-0.91 (0.78-0.83 before).
# "auto" (default): those widths; "0": none. MLA_ATTN_GLUON_NARROW overrides.
NARROW = _env.choice("MLA_ATTN_GLUON_NARROW", "auto", _env.AUTO_ON_OFF)
_SMEM_BYTES = 227 * 1024 - 1024  # the H200's shared memory a block may take, less room for the barriers

if AVAILABLE:
    TRACE_TILES = gl.constexpr(128)  # TRACE builds' stamp buffer: [1, TRACE_TILES, TRACE_EVENTS] int64
    TRACE_EVENTS = gl.constexpr(9)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, o_m, o_n, M, N, n0, qk_scale,
                      CAUSAL: gl.constexpr, MASK: gl.constexpr):
        """Scores s [BLOCK_M, BLOCK_N] of key tile n0 -> (p, alpha, m_new, l_new), base 2. The scale is
        applied to the row max and inside p's exponent (one FFMA an element), not to s first."""
        if MASK:
            cols = n0 + o_n
            vis = (cols < N)[None, :]
            if CAUSAL:
                vis = vis & (cols[None, :] <= (o_m + (N - M))[:, None])
            s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)  # qk_scale > 0
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s * qk_scale - m_safe[:, None])
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _expect(bar, nbytes: gl.constexpr, a_desc, b_desc, A: gl.constexpr, B: gl.constexpr, pred):
        """mbarrier.expect of a stage's loads: nbytes, and a_desc's block where A, and b_desc's where B (the
        second blocks of split head widths; None where not loaded)."""
        if A:
            if B:
                mbarrier.expect(bar, nbytes + a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
            else:
                mbarrier.expect(bar, nbytes + a_desc.block_type.nbytes, pred=pred)
        elif B:
            mbarrier.expect(bar, nbytes + b_desc.block_type.nbytes, pred=pred)
        else:
            mbarrier.expect(bar, nbytes, pred=pred)

    @gluon.jit
    def _load_kv(k_desc, k1_desc, v_desc, k_smem, k1_smem, v_smem, bars, tile, kv_row0, n_tiles,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_QK0: gl.constexpr, SPLIT: gl.constexpr,
                 v1_desc=None, v1_smem=None, D_V0: gl.constexpr = 0, SPLIT_V: gl.constexpr = False):
        """Start the TMA loads of key tile ``tile`` into ring stage tile % STAGES (no-op past the end).
        SPLIT_V: the value columns past D_V0 too (Dv 80 = 64 + 16), through v1_desc into v1_smem."""
        stage = tile % STAGES
        pred = tile < n_tiles
        bar = bars.index(stage)
        _expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, k1_desc, v1_desc, SPLIT, SPLIT_V, pred)
        # kv_row0 = (K's first row, K's first column, V's first row, V's first column) of this head in the
        # 2-D views (a [B, H, L, D] tensor as [B * H * L, D], or a [B, L, H, D] one as [B * L, H * D]).
        k_row = kv_row0[0] + tile * BLOCK_N
        v_row = kv_row0[2] + tile * BLOCK_N
        _tma_load(k_desc, [k_row, kv_row0[1]], bar, k_smem.index(stage), pred=pred)
        if SPLIT:  # the key columns past the first power of two (Dqk 192 = 128 + 64)
            _tma_load(k1_desc, [k_row, kv_row0[1] + D_QK0], bar, k1_smem.index(stage),
                                            pred=pred)
        _tma_load(v_desc, [v_row, kv_row0[3]], bar, v_smem.index(stage), pred=pred)
        if SPLIT_V:
            _tma_load(v1_desc, [v_row, kv_row0[3] + D_V0], bar, v1_smem.index(stage), pred=pred)

    @gluon.jit
    def _qk(q_smem, q1_smem, k_smem, k1_smem, stage, s_zero, SPLIT: gl.constexpr):
        """Issue S = Q K^T for the key tile in ``stage`` (one wgmma group, two when the head dim is split)."""
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if SPLIT:
            s = warpgroup_mma(q1_smem, k1_smem.index(stage).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _pv(p_op, v_smem, v1_smem, stage, acc, acc1, p1_layout: gl.constexpr, SPLIT_V: gl.constexpr):
        """Issue acc += P V for the key tile in ``stage``; SPLIT_V: a second wgmma group, acc1 += P V1 over the
        value columns past the first power of two (P is the same A operand, in acc1's operand layout)."""
        acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
        if SPLIT_V:
            acc1 = warpgroup_mma(gl.convert_layout(p_op, p1_layout), v1_smem.index(stage), acc1, is_async=True)
        return acc, acc1

    @gluon.jit
    def _wait_acc(acc, acc1, n: gl.constexpr, SPLIT_V: gl.constexpr):
        """Wait until at most n wgmma groups issued after P V's are in flight: P V (both groups) done."""
        if SPLIT_V:
            acc, acc1 = warpgroup_mma_wait(num_outstanding=n, deps=(acc, acc1))
        else:
            acc = warpgroup_mma_wait(num_outstanding=n, deps=(acc,))
        return acc, acc1

    @gluon.jit
    def _rescale(acc, acc1, alpha, row_o: gl.constexpr, row_o1: gl.constexpr, SPLIT_V: gl.constexpr):
        """acc (and acc1) scaled by alpha row by row."""
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        if SPLIT_V:
            acc1 = acc1 * gl.convert_layout(alpha, row_o1)[:, None]
        return acc, acc1

    @gluon.jit
    def _steady_step(j, s, acc, m_i, l_i, q_smem, q1_smem, k_smem, k1_smem, v_smem, bars, k_desc, k1_desc, v_desc,
                     kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype: gl.constexpr, row_o: gl.constexpr,
                     p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     PV_OVERLAP: gl.constexpr, D_QK0: gl.constexpr, SPLIT: gl.constexpr, acc1=0, v1_smem=None,
                     v1_desc=None, row_o1: gl.constexpr = None, p1_layout: gl.constexpr = None, D_V0: gl.constexpr = 0,
                     SPLIT_V: gl.constexpr = False):
        """Key tile j (not the last): steps 1-6 of the module docstring. s holds tile j's finished
        scores; returns tile j + 1's, and acc (acc1: SPLIT_V's value tail) in flight (wgmma accumulators)."""
        nxt = (j + 1) % STAGES
        mbarrier.wait(bars.index(nxt), ((j + 1) // STAGES) & 1)
        s_next = _qk(q_smem, q1_smem, k_smem, k1_smem, nxt, s_zero, SPLIT)
        # Tile j < n_tiles - 1 lies wholly below N: only the causal mask can apply.
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, o_m, o_n, M, N, j * BLOCK_N, qk_scale, CAUSAL, CAUSAL)
        # P V of tile j - 1 done; the score groups just issued may still run.
        acc, acc1 = _wait_acc(acc, acc1, 2 if SPLIT else 1, SPLIT_V)
        # Both warpgroups must be past tile j - 1 before its stage is refilled: each wgmma wait covers
        # only its own warpgroup.
        _thread_barrier()
        _load_kv(k_desc, k1_desc, v_desc, k_smem, k1_smem, v_smem, bars, j + STAGES - 1, kv_row0, n_tiles, BLOCK_N,
                 STAGES, D_QK0, SPLIT, v1_desc, v1_smem, D_V0, SPLIT_V)
        acc, acc1 = _rescale(acc, acc1, alpha, row_o, row_o1, SPLIT_V)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc, acc1 = _pv(p_op, v_smem, v1_smem, j % STAGES, acc, acc1, p1_layout, SPLIT_V)
        if PV_OVERLAP:  # P_j V_j runs on into the next tile's softmax
            s = warpgroup_mma_wait(num_outstanding=2 if SPLIT_V else 1, deps=(s_next,))
        elif SPLIT_V:
            s, acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc, acc1))
            acc = warpgroup_mma_init(acc)
            acc1 = warpgroup_mma_init(acc1)
        else:
            s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
            acc = warpgroup_mma_init(acc)
        return s, acc, acc1, m_i, l_i

    @gluon.jit
    def _overlap_step(j, p_op, alpha, s, acc, m_i, l_i, q_smem, q1_smem, k_smem, k1_smem, v_smem, bars, k_desc,
                      k1_desc, v_desc, kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype: gl.constexpr,
                      row_o: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, D_QK0: gl.constexpr, SPLIT: gl.constexpr, ISSUE_NEXT: gl.constexpr,
                      MASK: gl.constexpr, TR=None, tr_on=False, TRACE: gl.constexpr = False, acc1=0, v1_smem=None,
                      v1_desc=None, row_o1: gl.constexpr = None, p1_layout: gl.constexpr = None,
                      D_V0: gl.constexpr = 0, SPLIT_V: gl.constexpr = False):
        """PV_OVERLAP schedule, key tile j. In: P_j (dot operand); acc already rescaled by alpha_j; s =
        S_{j+1}, complete. Issue P_j V_j, refill, issue S_{j+2} (ISSUE_NEXT), run the softmax of S_{j+1}
        under both wgmmas. Then wait for P_j V_j alone and rescale acc by alpha_{j+1} and convert P_{j+1}
        while S_{j+2} still runs (the A registers of P_j V_j and acc are free only once it is done), and
        wait for S_{j+2}: nothing is in flight across the loop's back edge."""
        # TRACE events of step j (scripts/trace_flash_fwd.py): 0 step start, 2 both warpgroups past the CTA
        # barrier (P_j V_j issued), 4 tile j + 2 landed and S_{j+2} issued, 5 softmax of tile j + 1 done,
        # 6 P_j V_j done, 8 acc rescaled, P_{j+1} converted and S_{j+2} done. (More stamps push the
        # d 128 build past 255 registers, and ptxas then serialises the wgmmas, C7511.)
        if TRACE:
            _trace_stamp(TR, tr_on, 0, j, 0, TRACE_TILES, TRACE_EVENTS)
        acc, acc1 = _pv(p_op, v_smem, v1_smem, j % STAGES, acc, acc1, p1_layout, SPLIT_V)
        # P_{j-1} V_{j-1} finished in step j - 1 in both warpgroups once all threads pass here, so tile
        # j - 1's stage can be refilled.
        _thread_barrier()
        if TRACE:
            _trace_stamp(TR, tr_on, 0, j, 2, TRACE_TILES, TRACE_EVENTS)
        _load_kv(k_desc, k1_desc, v_desc, k_smem, k1_smem, v_smem, bars, j + STAGES - 1, kv_row0, n_tiles, BLOCK_N,
                 STAGES, D_QK0, SPLIT, v1_desc, v1_smem, D_V0, SPLIT_V)
        if ISSUE_NEXT:
            nxt = (j + 2) % STAGES
            mbarrier.wait(bars.index(nxt), ((j + 2) // STAGES) & 1)
            s_next = _qk(q_smem, q1_smem, k_smem, k1_smem, nxt, s_zero, SPLIT)
            if TRACE:
                _trace_stamp(TR, tr_on, 0, j, 4, TRACE_TILES, TRACE_EVENTS)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, o_m, o_n, M, N, (j + 1) * BLOCK_N, qk_scale, CAUSAL, MASK)
        p_lo = p.to(dtype)
        if TRACE:
            _trace_stamp(TR, tr_on, 0, j, 5, TRACE_TILES, TRACE_EVENTS)
        if ISSUE_NEXT:
            acc, acc1 = _wait_acc(acc, acc1, 2 if SPLIT else 1, SPLIT_V)
        else:
            acc, acc1 = _wait_acc(acc, acc1, 0, SPLIT_V)
        if TRACE:
            _trace_stamp(TR, tr_on, 0, j, 6, TRACE_TILES, TRACE_EVENTS)
        acc, acc1 = _rescale(acc, acc1, alpha, row_o, row_o1, SPLIT_V)
        p_op = gl.convert_layout(p_lo, p_layout)
        if ISSUE_NEXT:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            if TRACE:
                _trace_stamp(TR, tr_on, 0, j, 8, TRACE_TILES, TRACE_EVENTS)
        return p_op, alpha, s, acc, acc1, m_i, l_i

    @gluon.jit
    def _block_rows(pid_m, pid_bh, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH,
                    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TOKEN_MAJOR: gl.constexpr,
                    PAIR: gl.constexpr):
        """Row block pid_m (of ROWS rows a head) of head unit pid_bh -> (i_b, i_h, Q's first row and column, K's
        first row and column, V's first row and column in the 2-D views). A head unit is (batch x head), or
        with PAIR (batch x head pair): heads i_h and i_h + 1 of one KV group, ROWS rows of each."""
        if PAIR:
            i_b = pid_bh // (H // 2)
            i_h = (pid_bh % (H // 2)) * 2
        else:
            i_b = pid_bh // H
            i_h = pid_bh % H
        i_hk = i_h // (H // HK)
        # Row and column of this program's first tile in each 2-D view: row = b * RB + h * RH + position,
        # column = h * CH (see flash_fwd_gluon: head-major [B, H, L, D] or token-major [B, L, H, D]).
        if TOKEN_MAJOR:
            q_row0 = i_b * Q_RB + i_h * Q_RH + pid_m * ROWS
            q_col0 = i_h * Q_CH
            k_r0 = i_b * K_RB + i_hk * K_RH
            k_c0 = i_hk * K_CH
            v_r0 = i_b * V_RB + i_hk * V_RH
            v_c0 = i_hk * V_CH
        else:  # all three head-major: the arithmetic the H200 checked in session 12
            if PAIR:
                q_row0 = (i_b * H + i_h) * M + pid_m * ROWS
            else:
                q_row0 = pid_bh * M + pid_m * ROWS
            q_col0 = 0
            k_r0 = (i_b * HK + i_hk) * N
            k_c0 = 0
            v_r0 = (i_b * HK + i_hk) * N
            v_c0 = 0
        return i_b, i_h, q_row0, q_col0, k_r0, k_c0, v_r0, v_c0

    @gluon.jit
    def _block_tiles(pid_m, M, N, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Key tiles row block pid_m (ROWS rows a head) sees: all of them, or (causal, bottom-right) up to its
        last row's."""
        kv_end = N
        if CAUSAL:
            kv_end = gl.minimum(N, (pid_m + 1) * ROWS + (N - M))
            kv_end = gl.maximum(kv_end, 0)
        return gl.cdiv(kv_end, BLOCK_N)

    @gluon.jit
    def _block_loads(q_desc, q1_desc, k_desc, k1_desc, v_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar, bars,
                     q_row0, q_col0, kv_row0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     D_QK0: gl.constexpr, SPLIT: gl.constexpr, Q_RH, Q_CH, PAIR: gl.constexpr, v1_desc=None,
                     v1_smem=None, D_V0: gl.constexpr = 0, SPLIT_V: gl.constexpr = False):
        """Start a row block's loads: Q on q_bar, key tiles 0 .. STAGES - 2 into the ring. PAIR: Q's descriptor
        is half the block's rows, loaded twice, the second head's (one Q_RH row and Q_CH column further) into
        the lower half."""
        if PAIR:
            HALF: gl.constexpr = q_desc.block_type.shape[0]
            if SPLIT:
                mbarrier.expect(q_bar, 2 * (q_desc.block_type.nbytes + q1_desc.block_type.nbytes))
                _tma_load(q1_desc, [q_row0, q_col0 + D_QK0], q_bar, q1_smem.slice(0, HALF))
                _tma_load(q1_desc, [q_row0 + Q_RH, q_col0 + Q_CH + D_QK0], q_bar, q1_smem.slice(HALF, HALF))
            else:
                mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row0, q_col0], q_bar, q_smem.slice(0, HALF))
            _tma_load(q_desc, [q_row0 + Q_RH, q_col0 + Q_CH], q_bar, q_smem.slice(HALF, HALF))
        else:
            if SPLIT:
                mbarrier.expect(q_bar, q_desc.block_type.nbytes + q1_desc.block_type.nbytes)
                _tma_load(q1_desc, [q_row0, q_col0 + D_QK0], q_bar, q1_smem)
            else:
                mbarrier.expect(q_bar, q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row0, q_col0], q_bar, q_smem)
        for i in gl.static_range(STAGES - 1):
            _load_kv(k_desc, k1_desc, v_desc, k_smem, k1_smem, v_smem, bars, i, kv_row0, n_tiles, BLOCK_N, STAGES,
                     D_QK0, SPLIT, v1_desc, v1_smem, D_V0, SPLIT_V)

    @gluon.jit
    def _block_compute(pid_m, n_tiles, kv_row0, M, N, qk_scale, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar, bars,
                       k_desc, k1_desc, v_desc, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       p_layout: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr, dtype: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, PV_OVERLAP: gl.constexpr, Q_IN_REGS: gl.constexpr, D_QK0: gl.constexpr,
                       SPLIT: gl.constexpr, TR, tr_on, TRACE: gl.constexpr, S1_EARLY: gl.constexpr = False,
                       PAIR: gl.constexpr = False, v1_smem=None, v1_desc=None, o1_layout: gl.constexpr = None,
                       p1_layout: gl.constexpr = None, row_o1: gl.constexpr = None, D_V1: gl.constexpr = 0):
        """A row block's key loop, its loads started by _block_loads and its barriers at phase 0 ->
        (acc, acc1, m_i, l_i, the block's row positions), everything waited for. PAIR: rows BLOCK_M / 2 ..
        BLOCK_M are the second head's, at the same positions as rows 0 .. BLOCK_M / 2. D_V1 > 0: the value
        head is D_V + D_V1 columns, the second part in v1_smem and acc1 (else acc1 is 0, unused)."""
        SPLIT_V: gl.constexpr = D_V1 > 0
        if PAIR:
            row_first = pid_m * (BLOCK_M // 2)
            o_m = row_first + gl.arange(0, BLOCK_M, layout=row_s) % (BLOCK_M // 2)
        else:
            row_first = pid_m * BLOCK_M
            o_m = row_first + gl.arange(0, BLOCK_M, layout=row_s)
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D_V], gl.float32, layout=o_layout)
        if SPLIT_V:
            acc1 = gl.zeros([BLOCK_M, D_V1], gl.float32, layout=o1_layout)
        else:
            acc1 = 0
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, 0)
        # Q as the scores' A operand: from shared memory, or (Q_IN_REGS) loaded once into registers. A
        # 64 x 64 x 16 wgmma with both operands in shared memory reads 4 KB in 32 cycles, the whole
        # 128 B/cycle of shared memory; with A in registers it reads half that.
        if Q_IN_REGS:
            qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
            q_op = q_smem.load(qa_layout)
            if SPLIT:
                q1_op = q1_smem.load(qa_layout)
            else:
                q1_op = q_op
        else:
            q_op = q_smem
            q1_op = q1_smem
        if n_tiles > 0:
            mbarrier.wait(bars.index(0), 0)
            s = _qk(q_op, q1_op, k_smem, k1_smem, 0, s_zero, SPLIT)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if SPLIT_V:
                acc1 = warpgroup_mma_init(acc1)
            acc = warpgroup_mma_init(acc)  # loop-carried as a wgmma accumulator (it ends each iteration in flight)
            # Steady state: tiles 0 .. n_tiles - 2, each with the next score tile in flight. With
            # PV_OVERLAP the loop is unrolled by two, so that the scores of consecutive tiles live in
            # two register sets and no copy of an in-flight accumulator is needed at the back edge.
            n_steady = n_tiles - 1
            if PV_OVERLAP:
                if S1_EARLY:
                    # S_1 on the tensor cores under tile 0's softmax (else they run one after the other, once
                    # a block: ~4700 cycles of fixed cost a block on the H200, scripts/trace_flash_blocks.py).
                    if n_tiles > 1:
                        mbarrier.wait(bars.index(1 % STAGES), (1 // STAGES) & 1)
                        s1 = _qk(q_op, q1_op, k_smem, k1_smem, 1 % STAGES, s_zero, SPLIT)
                        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, o_m, o_n, M, N, 0, qk_scale, CAUSAL, True)
                        p_op = gl.convert_layout(p.to(dtype), p_layout)
                        s = warpgroup_mma_wait(num_outstanding=0, deps=(s1,))
                    else:
                        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, o_m, o_n, M, N, 0, qk_scale, CAUSAL, True)
                        p_op = gl.convert_layout(p.to(dtype), p_layout)
                    acc, acc1 = _wait_acc(acc, acc1, 0, SPLIT_V)
                else:
                    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, o_m, o_n, M, N, 0, qk_scale, CAUSAL, True)
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    acc, acc1 = _wait_acc(acc, acc1, 0, SPLIT_V)
                if n_tiles > 1:
                    if not S1_EARLY:
                        mbarrier.wait(bars.index(1 % STAGES), (1 // STAGES) & 1)
                        s = warpgroup_mma_wait(
                            num_outstanding=0, deps=(_qk(q_op, q1_op, k_smem, k1_smem, 1 % STAGES, s_zero, SPLIT),))
                    # Tiles below n_full are visible to every row of the block: no mask (the mask is
                    # about a third of the softmax's ALU work). Step j runs the softmax of tile j + 1.
                    n_full = n_tiles
                    if CAUSAL:
                        n_full = gl.minimum(n_tiles, gl.maximum(row_first + (N - M) + 1, 0) // BLOCK_N)
                    j_split = gl.maximum(gl.minimum(n_tiles - 2, n_full - 1), 0)
                    # Unrolled by two: the scores of consecutive tiles then live in two register sets,
                    # so the finished S_{j+2} is not copied into S_{j+1}'s registers at the back edge.
                    for j in range(0, j_split - 1, 2):
                        p_op, alpha, s, acc, acc1, m_i, l_i = _overlap_step(
                            j, p_op, alpha, s, acc, m_i, l_i, q_op, q1_op, k_smem, k1_smem, v_smem, bars,
                            k_desc, k1_desc, v_desc, kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype,
                            row_o, p_layout, BLOCK_N, STAGES, CAUSAL, D_QK0, SPLIT, True, False, TR, tr_on, TRACE,
                            acc1, v1_smem, v1_desc, row_o1, p1_layout, D_V, SPLIT_V)
                        p_op, alpha, s, acc, acc1, m_i, l_i = _overlap_step(
                            j + 1, p_op, alpha, s, acc, m_i, l_i, q_op, q1_op, k_smem, k1_smem, v_smem, bars,
                            k_desc, k1_desc, v_desc, kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype,
                            row_o, p_layout, BLOCK_N, STAGES, CAUSAL, D_QK0, SPLIT, True, False, TR, tr_on, TRACE,
                            acc1, v1_smem, v1_desc, row_o1, p1_layout, D_V, SPLIT_V)
                    if j_split % 2 == 1:
                        p_op, alpha, s, acc, acc1, m_i, l_i = _overlap_step(
                            j_split - 1, p_op, alpha, s, acc, m_i, l_i, q_op, q1_op, k_smem, k1_smem, v_smem,
                            bars, k_desc, k1_desc, v_desc, kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero,
                            dtype, row_o, p_layout, BLOCK_N, STAGES, CAUSAL, D_QK0, SPLIT, True, False, TR, tr_on,
                            TRACE, acc1, v1_smem, v1_desc, row_o1, p1_layout, D_V, SPLIT_V)
                    for j in range(j_split, n_tiles - 2):
                        p_op, alpha, s, acc, acc1, m_i, l_i = _overlap_step(
                            j, p_op, alpha, s, acc, m_i, l_i, q_op, q1_op, k_smem, k1_smem, v_smem, bars,
                            k_desc, k1_desc, v_desc, kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype,
                            row_o, p_layout, BLOCK_N, STAGES, CAUSAL, D_QK0, SPLIT, True, CAUSAL, TR, tr_on, TRACE,
                            acc1, v1_smem, v1_desc, row_o1, p1_layout, D_V, SPLIT_V)
                    p_op, alpha, s, acc, acc1, m_i, l_i = _overlap_step(
                        n_tiles - 2, p_op, alpha, s, acc, m_i, l_i, q_op, q1_op, k_smem, k1_smem, v_smem,
                        bars, k_desc, k1_desc, v_desc, kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype,
                        row_o, p_layout, BLOCK_N, STAGES, CAUSAL, D_QK0, SPLIT, False, True, TR, tr_on, TRACE,
                        acc1, v1_smem, v1_desc, row_o1, p1_layout, D_V, SPLIT_V)
                # P V of the last tile (acc already rescaled by its alpha).
                acc, acc1 = _pv(p_op, v_smem, v1_smem, (n_tiles - 1) % STAGES, acc, acc1, p1_layout, SPLIT_V)
                acc, acc1 = _wait_acc(acc, acc1, 0, SPLIT_V)
            else:
                for j in range(0, n_steady):
                    s, acc, acc1, m_i, l_i = _steady_step(
                        j, s, acc, m_i, l_i, q_op, q1_op, k_smem, k1_smem, v_smem, bars, k_desc, k1_desc, v_desc,
                        kv_row0, n_tiles, o_m, o_n, M, N, qk_scale, s_zero, dtype, row_o, p_layout, BLOCK_N, STAGES,
                        CAUSAL, False, D_QK0, SPLIT, acc1, v1_smem, v1_desc, row_o1, p1_layout, D_V, SPLIT_V)
                # Last tile: nothing left to prefetch or to overlap.
                j_last = n_tiles - 1
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, o_m, o_n, M, N, j_last * BLOCK_N, qk_scale,
                                                   CAUSAL, True)
                acc, acc1 = _wait_acc(acc, acc1, 0, SPLIT_V)
                acc, acc1 = _rescale(acc, acc1, alpha, row_o, row_o1, SPLIT_V)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc, acc1 = _pv(p_op, v_smem, v1_smem, j_last % STAGES, acc, acc1, p1_layout, SPLIT_V)
                acc, acc1 = _wait_acc(acc, acc1, 0, SPLIT_V)
        return acc, acc1, m_i, l_i, o_m

    @gluon.jit
    def _store_rows(o, O, i_b, i_h, row0, M, stride_ob, stride_oh, stride_om, o_layout: gl.constexpr,
                    row_o: gl.constexpr, ROWS: gl.constexpr, D_V: gl.constexpr, PAIR: gl.constexpr = False,
                    COL0: gl.constexpr = 0, COLS: gl.constexpr = 0):
        """Rows row0 .. row0 + ROWS of o (in the accumulator's layout) stored straight from registers, rows >= M
        left out. PAIR: the second half of o is head i_h + 1's rows row0 .. row0 + ROWS / 2. COL0 / COLS (a
        value tail): o's columns go to columns COL0.. of O, the first COLS of them only (0: all D_V)."""
        o_d = COL0 + gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
        if PAIR:
            r = gl.arange(0, ROWS, layout=row_o)
            o_mo = row0 + r % (ROWS // 2)
            p_o = (O + i_b.to(gl.int64) * stride_ob + (i_h + r // (ROWS // 2)).to(gl.int64)[:, None] * stride_oh
                   + o_mo.to(gl.int64)[:, None] * stride_om + o_d[None, :])
        else:
            o_mo = row0 + gl.arange(0, ROWS, layout=row_o)
            p_o = (O + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh
                   + o_mo.to(gl.int64)[:, None] * stride_om + o_d[None, :])
        if COLS > 0 and COLS < D_V:
            gl.store(p_o, o, mask=(o_mo < M)[:, None] & (o_d < COL0 + COLS)[None, :])
        else:
            gl.store(p_o, o, mask=(o_mo < M)[:, None])

    @gluon.jit
    def _block_epilogue(acc, m_i, l_i, o_m, O, LSE, i_b, i_h, row0, M, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, o_layout: gl.constexpr, row_o: gl.constexpr, ROWS: gl.constexpr,
                        D_V: gl.constexpr, o_desc=None, o_smem=None, H=0, TMA_STORE: gl.constexpr = False,
                        DEFER_WAIT: gl.constexpr = False, PAIR: gl.constexpr = False, row_s: gl.constexpr = None,
                        acc1=0, o1_desc=None, o1_smem=None, o1_layout: gl.constexpr = None,
                        row_o1: gl.constexpr = None, D_V1: gl.constexpr = 0, DV_TAIL: gl.constexpr = 0):
        """Normalise and store rows row0 .. row0 + ROWS of o (rows >= M not stored) and their lse (o_m: the
        same rows in the scores' row layout). Also the warp-specialised forward's (gluon_fwd_ws.py).

        TMA_STORE (o contiguous, o_desc over it as [B * H * M, D_V]; o_smem a free [ROWS, D_V] buffer in
        o_desc's layout): a block whose rows all lie below M goes registers -> shared memory -> one TMA
        store, instead of 4-byte stores scattered by the accumulator layout (those took ~4500 cycles a
        block on the H200, 7-12% of the forward: scripts/trace_flash_blocks.py). The TMA store is waited
        for (its shared-memory read) before the function returns, or (DEFER_WAIT, the persistent loop) only
        before o_smem is written again, so the read overlaps the next block. A partial last block stores
        directly. PAIR: rows ROWS / 2 .. ROWS are head i_h + 1's (o_desc's blocks are ROWS / 2 rows; row_s is
        o_m's layout). D_V1 > 0: acc1 holds value columns D_V .. D_V + DV_TAIL (its last D_V1 - DV_TAIL are
        padding), stored through o1_desc / o1_smem (TMA; the descriptor's bounds clip the padding) or directly."""
        SPLIT_V: gl.constexpr = D_V1 > 0
        # Rows that saw no key (causal with M > N) have l = 0: o = 0, lse = -inf.
        dead = l_i == 0.0
        lse = gl.where(dead, float("-inf"), (m_i + gl.log2(gl.where(dead, 1.0, l_i))) * 0.6931471805599453)
        inv = gl.convert_layout(1.0 / gl.where(dead, 1.0, l_i), row_o)
        o = (acc * inv[:, None]).to(O.dtype.element_ty)
        if SPLIT_V:
            inv1 = gl.convert_layout(inv, row_o1)
            o1 = (acc1 * inv1[:, None]).to(O.dtype.element_ty)
        if PAIR:
            last_row = row0 + ROWS // 2
        else:
            last_row = row0 + ROWS
        if TMA_STORE:
            if last_row <= M:
                if DEFER_WAIT:  # the previous block's store must have read o_smem, in every thread's view
                    tma.store_wait(0)
                    _thread_barrier()
                o_smem.store(o)
                if SPLIT_V:
                    o1_smem.store(o1)
                fence_async_shared()
                _thread_barrier()
                if PAIR:
                    _tma_store(o_desc, [(i_b * H + i_h) * M + row0, 0], o_smem.slice(0, ROWS // 2))
                    _tma_store(o_desc, [(i_b * H + i_h + 1) * M + row0, 0], o_smem.slice(ROWS // 2, ROWS // 2))
                    if SPLIT_V:
                        _tma_store(o1_desc, [(i_b * H + i_h) * M + row0, D_V], o1_smem.slice(0, ROWS // 2))
                        _tma_store(o1_desc, [(i_b * H + i_h + 1) * M + row0, D_V],
                                   o1_smem.slice(ROWS // 2, ROWS // 2))
                else:
                    _tma_store(o_desc, [(i_b * H + i_h) * M + row0, 0], o_smem)
                    if SPLIT_V:
                        _tma_store(o1_desc, [(i_b * H + i_h) * M + row0, D_V], o1_smem)
            else:
                _store_rows(o, O, i_b, i_h, row0, M, stride_ob, stride_oh, stride_om, o_layout, row_o, ROWS, D_V, PAIR)
                if SPLIT_V:
                    _store_rows(o1, O, i_b, i_h, row0, M, stride_ob, stride_oh, stride_om, o1_layout, row_o1, ROWS,
                                D_V1, PAIR, D_V, DV_TAIL)
        else:
            _store_rows(o, O, i_b, i_h, row0, M, stride_ob, stride_oh, stride_om, o_layout, row_o, ROWS, D_V, PAIR)
            if SPLIT_V:
                _store_rows(o1, O, i_b, i_h, row0, M, stride_ob, stride_oh, stride_om, o1_layout, row_o1, ROWS, D_V1,
                            PAIR, D_V, DV_TAIL)
        p_lse = LSE + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + o_m
        if PAIR:
            p_lse += (gl.arange(0, ROWS, layout=row_s) // (ROWS // 2)).to(gl.int64) * stride_lh
        gl.store(p_lse, lse, mask=o_m < M)
        if TMA_STORE and not DEFER_WAIT:
            tma.store_wait(0)

    @gluon.jit
    def _order(w, n_mb, BH, TAIL_BH, TAIL: gl.constexpr):
        """Launch position w -> (head pid_bh, j: its j-th row block in launch order). Head-major (a head's
        blocks together, sharing its K/V in L2); TAIL: the last TAIL_BH heads' blocks length-major instead
        (every one's j = 0 block, then every one's j = 1, ...), so that with causal the last blocks to run
        are the shortest and the programs finish together."""
        if TAIL:
            w0 = (BH - TAIL_BH) * n_mb
            in_tail = w >= w0
            t = gl.maximum(w - w0, 0)
            pid_bh = gl.where(in_tail, BH - TAIL_BH + t % TAIL_BH, w // n_mb)
            j = gl.where(in_tail, t // TAIL_BH, w % n_mb)
        else:
            pid_bh = w // n_mb
            j = w % n_mb
        return pid_bh, j

    @gluon.jit
    def _work(w, n_mb, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TOKEN_MAJOR: gl.constexpr, BH=0, TAIL_BH=0,
              TAIL: gl.constexpr = False, PAIR: gl.constexpr = False):
        """Work item w, numbered in the non-persistent grid's launch order -> (row block, i_b, i_h, Q's first
        row and column, (K's first row and column, V's first row and column), key tiles). A row block is ROWS
        rows of each head of its unit; PAIR: BH counts head pairs."""
        pid_bh, pid_m = _order(w, n_mb, BH, TAIL_BH, TAIL)
        if CAUSAL:
            pid_m = n_mb - 1 - pid_m
        i_b, i_h, q_row0, q_col0, k_r0, k_c0, v_r0, v_c0 = _block_rows(
            pid_m, pid_bh, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, ROWS, BLOCK_N, CAUSAL,
            TOKEN_MAJOR, PAIR)
        return pid_m, i_b, i_h, q_row0, q_col0, (k_r0, k_c0, v_r0, v_c0), _block_tiles(pid_m, M, N, ROWS, BLOCK_N,
                                                                                      CAUSAL)

    @gluon.jit
    def _next_work(w, r, COUNTER, SCHEDULE: gl.constexpr):
        """The work item after w for this program, whose round (blocks taken so far) was r -> (item, round).
        SCHEDULE 0: the next unclaimed item from COUNTER (a relaxed atomic: no other memory depends on it).
        SCHEDULE 1: static snake, round r + 1 takes item (r + 1) * P + p on even rounds and
        (r + 1) * P + P - 1 - p on odd ones; over the grid's order (each head's longest causal blocks first)
        that pairs long and short blocks, and it needs no atomic."""
        P = gl.num_programs(0)
        if SCHEDULE == 0:
            nxt = gl.atomic_add(COUNTER, 1, sem="relaxed") + P
        else:
            p = gl.program_id(0)
            nxt = (r + 1) * P + gl.where((r + 1) % 2 == 0, p, P - 1 - p)
        return nxt, r + 1

    @gluon.jit
    def _persistent_loop(q_desc, q1_desc, k_desc, k1_desc, v_desc, O, LSE, qk_scale, M, N, H, HK, Q_RB, Q_RH, Q_CH,
                         K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                         COUNTER, BH, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar, bars, s_layout: gl.constexpr,
                         o_layout: gl.constexpr, p_layout: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr,
                         dtype: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr, PV_OVERLAP: gl.constexpr,
                         Q_IN_REGS: gl.constexpr, TOKEN_MAJOR: gl.constexpr, D_QK0: gl.constexpr,
                         SPLIT: gl.constexpr, SCHEDULE: gl.constexpr, o_desc, o_smem, TMA_STORE: gl.constexpr, BT,
                         BLOCK_TRACE: gl.constexpr, S1_EARLY: gl.constexpr, TAIL_BH, TAIL: gl.constexpr,
                         PAIR: gl.constexpr, ROWS: gl.constexpr):
        """PERSISTENT. Program p takes work item p, then the next one from _next_work, in the
        order the non-persistent grid launches its programs. Once a block's key loop is done (every load
        waited for, every wgmma finished), the barriers are re-armed at phase 0 and the next block's Q and
        first key tiles are requested before this block's output is normalised and stored, so those loads'
        latency hides under the epilogue. TMA_STORE: O leaves through its own buffer o_smem (not Q's, which
        holds the next block's Q by then), and the wait for that store's read comes only before the next
        block's output is written there. BLOCK_TRACE: work item w stamps BT[w, 0:9] (its loop top, key loop
        done, output stored), as the normal build's programs do.

        Measured on the H200: see the module docstring (the first version, c97a5b7, with an acq_rel atomic at
        the loop top broadcast behind a CTA barrier, was 6-12% slower than the grid; this one is 2-3% faster
        at d 128). PAIR: BH counts head pairs, and a block is ROWS = BLOCK_M / 2 rows of each head of its pair."""
        n_mb = gl.cdiv(M, ROWS)
        total = n_mb * BH
        w = gl.program_id(0)
        r = 0
        if w < total:
            _, _, _, q_row0, q_col0, kv_row0, n_tiles = _work(w, n_mb, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH,
                                                              V_RB, V_RH, V_CH, ROWS, BLOCK_N, CAUSAL, TOKEN_MAJOR,
                                                              BH, TAIL_BH, TAIL, PAIR)
            _block_loads(q_desc, q1_desc, k_desc, k1_desc, v_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar,
                         bars, q_row0, q_col0, kv_row0, n_tiles, BLOCK_N, STAGES, D_QK0, SPLIT, Q_RH, Q_CH, PAIR)
        while w < total:
            if BLOCK_TRACE:
                _block_stamp(BT, w * 9, 0)
            w_next, r = _next_work(w, r, COUNTER, SCHEDULE)
            pid_m, i_b, i_h, _, _, kv_row0, n_tiles = _work(w, n_mb, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH,
                                                            V_RB, V_RH, V_CH, ROWS, BLOCK_N, CAUSAL, TOKEN_MAJOR,
                                                            BH, TAIL_BH, TAIL, PAIR)
            acc, _, m_i, l_i, o_m = _block_compute(pid_m, n_tiles, kv_row0, M, N, qk_scale, q_smem, q1_smem, k_smem,
                                                k1_smem, v_smem, q_bar, bars, k_desc, k1_desc, v_desc, s_layout,
                                                o_layout, p_layout, row_s, row_o, dtype, BLOCK_M, BLOCK_N, D_V, STAGES,
                                                CAUSAL, PV_OVERLAP, Q_IN_REGS, D_QK0, SPLIT, None, False, False,
                                                S1_EARLY, PAIR)
            if BLOCK_TRACE:
                _block_stamp(BT, w * 9, 3)
            # Both warpgroups are past their last wait of this block: re-arm every barrier at phase 0.
            _thread_barrier()
            mbarrier.invalidate(q_bar)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            fence_async_shared()
            if w_next < total:
                _, _, _, nq_row0, nq_col0, nkv_row0, nn_tiles = _work(
                    w_next, n_mb, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, ROWS, BLOCK_N,
                    CAUSAL, TOKEN_MAJOR, BH, TAIL_BH, TAIL, PAIR)
                _block_loads(q_desc, q1_desc, k_desc, k1_desc, v_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem,
                             q_bar, bars, nq_row0, nq_col0, nkv_row0, nn_tiles, BLOCK_N, STAGES, D_QK0, SPLIT, Q_RH,
                             Q_CH, PAIR)
            _block_epilogue(acc, m_i, l_i, o_m, O, LSE, i_b, i_h, pid_m * ROWS, M, stride_ob, stride_oh, stride_om,
                            stride_lb, stride_lh, o_layout, row_o, BLOCK_M, D_V, o_desc, o_smem, H, TMA_STORE, True,
                            PAIR, row_s)
            if BLOCK_TRACE:
                _block_stamp(BT, w * 9, 6)
            w = w_next
        if TMA_STORE:
            tma.store_wait(0)
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _flash_fwd_gluon(
        q_desc, q1_desc, k_desc, k1_desc, v_desc, O, LSE,  # q1/k1: columns D_QK0.. (SPLIT), else None
        qk_scale, M, N, H, HK,
        Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH,
        stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
        D_QK0: gl.constexpr, D_QK1: gl.constexpr, D_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, PV_OVERLAP: gl.constexpr, Q_IN_REGS: gl.constexpr,
        TOKEN_MAJOR: gl.constexpr, num_warps: gl.constexpr, TR=None, TRACE: gl.constexpr = False,
        PERSISTENT: gl.constexpr = False, COUNTER=None, BH=0, BT=None, BLOCK_TRACE: gl.constexpr = False,
        o_desc=None, TMA_STORE: gl.constexpr = False, SCHEDULE: gl.constexpr = 0, S1_EARLY: gl.constexpr = False,
        TAIL_BH=0, TAIL: gl.constexpr = False, PAIR: gl.constexpr = False,
        v1_desc=None, o1_desc=None, D_V1: gl.constexpr = 0, DV_TAIL: gl.constexpr = 0,
    ):
        # Grid (row blocks, B * H): a head's row blocks launch together and share its K/V in L2 (ordered
        # the other way, a wave would span ~130 heads' K/V, more than the L2 holds). Causal runs each
        # head's longest (last) row blocks first. PERSISTENT: one program an SM takes the row blocks in
        # that same order (a snake over it, or from a counter), and starts the next block's loads before it
        # writes the current block's output. PAIR (GQA, group even): axis 1 / BH counts head pairs of one KV
        # group, and a block is BLOCK_M / 2 rows (ROWS) of each head of the pair at the same positions.
        if PAIR:
            ROWS: gl.constexpr = BLOCK_M // 2
        else:
            ROWS: gl.constexpr = BLOCK_M
        if not PERSISTENT:
            pid_m = gl.program_id(0)
            pid_bh = gl.program_id(1)
            if BLOCK_TRACE:  # program (pid_m, pid_bh) stamps BT[launch index, 0:9]: entry, key loop done, stored
                bt = (pid_bh * gl.num_programs(0) + pid_m) * 9
                _block_stamp(BT, bt, 0)
            # TRACE: program (0, 0) stamps its steady loop: with causal, the head's last (longest) row block
            tr_on = (pid_m == 0) & (pid_bh == 0)
            if TAIL:  # the launch position's block (see _order)
                pid_bh, pid_m = _order(pid_bh * gl.num_programs(0) + pid_m, gl.num_programs(0), BH, TAIL_BH, TAIL)
            if CAUSAL:
                pid_m = gl.num_programs(0) - 1 - pid_m
            i_b, i_h, q_row0, q_col0, k_r0, k_c0, v_r0, v_c0 = _block_rows(
                pid_m, pid_bh, M, N, H, HK, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, ROWS, BLOCK_N,
                CAUSAL, TOKEN_MAJOR, PAIR)
            kv_row0 = (k_r0, k_c0, v_r0, v_c0)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, D_V, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # A value tail (Dv = D_V + D_V1, e.g. 80 = 64 + 16): a second accumulator, as wide as its TMA block.
        SPLIT_V: gl.constexpr = D_V1 > 0
        if SPLIT_V:
            o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                instr_shape=[16, D_V1, 16])
            p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
            row_o1: gl.constexpr = gl.SliceLayout(1, o1_layout)
        else:
            o1_layout: gl.constexpr = o_layout
            p1_layout: gl.constexpr = p_layout
            row_o1: gl.constexpr = row_o

        dtype: gl.constexpr = q_desc.dtype
        SPLIT: gl.constexpr = D_QK1 > 0  # Dqk = D_QK0 + D_QK1, each a power of two (TMA block shapes)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_QK0], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_QK0], k_desc.layout)
        if SPLIT:
            q1_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_QK1], q1_desc.layout)
            k1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_QK1], k1_desc.layout)
        else:
            q1_smem = q_smem
            k1_smem = k_smem
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], v_desc.layout)
        if SPLIT_V:
            v1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V1], v1_desc.layout)
        else:
            v1_smem = v_smem
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        if PERSISTENT:
            if TMA_STORE:  # its own buffer: Q's holds the next block's Q by the time this block's O is stored
                o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_V], o_desc.layout)
            else:
                o_smem = q_smem
            _persistent_loop(q_desc, q1_desc, k_desc, k1_desc, v_desc, O, LSE, qk_scale, M, N, H, HK, Q_RB, Q_RH,
                             Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, stride_ob, stride_oh, stride_om, stride_lb,
                             stride_lh, COUNTER, BH, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar, bars, s_layout,
                             o_layout, p_layout, row_s, row_o, dtype, BLOCK_M, BLOCK_N, D_V, STAGES, CAUSAL,
                             PV_OVERLAP, Q_IN_REGS, TOKEN_MAJOR, D_QK0, SPLIT, SCHEDULE, o_desc, o_smem, TMA_STORE,
                             BT, BLOCK_TRACE, S1_EARLY, TAIL_BH, TAIL, PAIR, ROWS)
        else:
            n_tiles = _block_tiles(pid_m, M, N, ROWS, BLOCK_N, CAUSAL)
            _block_loads(q_desc, q1_desc, k_desc, k1_desc, v_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar,
                         bars, q_row0, q_col0, kv_row0, n_tiles, BLOCK_N, STAGES, D_QK0, SPLIT, Q_RH, Q_CH, PAIR,
                         v1_desc, v1_smem, D_V, SPLIT_V)
            acc, acc1, m_i, l_i, o_m = _block_compute(
                pid_m, n_tiles, kv_row0, M, N, qk_scale, q_smem, q1_smem, k_smem, k1_smem, v_smem, q_bar, bars, k_desc,
                k1_desc, v_desc, s_layout, o_layout, p_layout, row_s, row_o, dtype, BLOCK_M, BLOCK_N, D_V, STAGES,
                CAUSAL, PV_OVERLAP, Q_IN_REGS, D_QK0, SPLIT, TR, tr_on, TRACE, S1_EARLY, PAIR, v1_smem, v1_desc,
                o1_layout, p1_layout, row_o1, D_V1)
            if BLOCK_TRACE:
                _block_stamp(BT, bt, 3)
            mbarrier.invalidate(q_bar)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))
            # TMA_STORE: O goes out through q_smem (D_QK0 == D_V: same shape and layout), free once the last
            # score wgmma is done; each warpgroup writes only the 64 rows its own wgmmas read. A value tail goes
            # through q1_smem (D_QK1 == D_V1).
            _block_epilogue(acc, m_i, l_i, o_m, O, LSE, i_b, i_h, pid_m * ROWS, M, stride_ob, stride_oh, stride_om,
                            stride_lb, stride_lh, o_layout, row_o, BLOCK_M, D_V, o_desc, q_smem, H, TMA_STORE, False,
                            PAIR, row_s, acc1, o1_desc, q1_smem, o1_layout, row_o1, D_V1, DV_TAIL)
            if BLOCK_TRACE:
                _block_stamp(BT, bt, 6)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """The device's SM count, looked up once (the launcher's host path)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, el):
    """A [rows, cols] TMA tile's shared-memory layout, built once: ~10 us of Python a call otherwise, and a
    training step builds a dozen descriptors (the host side is the limit on small rows)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], el)


def _desc(t: torch.Tensor, rows: int, cols: int, el):
    """A TMA descriptor over the 2-D tensor t, [rows, cols] tiles of element type el."""
    return TensorDescriptor.from_tensor(t, [rows, cols], _smem_layout(rows, cols, el))


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`flash_fwd_gluon` takes these inputs (else use the Triton kernel)."""
    if not (AVAILABLE and q.is_cuda and is_hopper(q.device)):
        return False
    if not _VERSION_OK:  # a Triton these kernels were not run with (_gluon_compat)
        _warn_untested()
        return False
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if not (q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and q.shape[1] % k.shape[1] == 0):
        return False
    if _odd_split(d_qk, d_v) is not None:
        return True
    return _split_head_dim(d_qk) is not None and d_v in (64, 128, 256)


def _tma_view(t: torch.Tensor, token_major: bool):
    """(2-D view for a TMA descriptor, row stride per batch, row stride per head, column stride per head)
    of t [B, H, L, D]: a head-major tensor as [B * H * L, D] (row = (b * H + h) * L + pos), or with
    ``token_major`` a view whose [B, L, H, D] transpose is contiguous (the layers' layout) as
    [B * L, H * D] (row = b * L + pos, column = h * D), without a copy. Anything else is copied to
    head-major. A tile past L reads the next head's or sequence's rows: the kernel masks keys >= N
    and never stores rows >= M."""
    b, h, length, d = t.shape
    if token_major and t.stride(-1) == 1 and t.transpose(1, 2).is_contiguous() and t.data_ptr() % 16 == 0 \
            and not t.is_contiguous():
        return t.transpose(1, 2).view(b * length, h * d), length, 0, d
    return _tma_ready(t).view(b * h * length, d), h * length, length, 0


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t contiguous with a 16-byte aligned start (TMA descriptors need both); copies only if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _split_head_dim(d: int):
    """(d0, d1) with d = d0 + d1, d0 a power of two >= 16, d1 0 or a power of two >= 16 (TMA block shapes
    are powers of two: 192 = 128 + 64), d <= 256; None if there is no such split: ``_split_padded``'s splits
    without padding."""
    split = _split_padded(d)
    return split[:2] if split is not None and split[2] == 0 else None


@functools.lru_cache(maxsize=None)
def _split_padded(d: int):
    """(d0, d1, pad) with d = d0 + d1 - pad for the forward's ``ODD_WIDTHS``: d0 a power of two >= 16, d1 0 or a
    power of two >= 16 whose last ``pad`` (at most 8) columns lie past the row's end (TMA fills them with zeros
    on loads and clips them on stores): 72 = 64 + 16 - 8, 80 = 64 + 16, 40 = 32 + 16 - 8. None if there is no
    such split, or d is not a multiple of 8 (a TMA row stride is a multiple of 16 bytes)."""
    if d > 256 or d < 16 or d % 8:
        return None
    d0 = 1 << (d.bit_length() - 1)
    rest = d - d0
    if rest == 0:
        return d0, 0, 0
    d1 = max(16, 1 << (rest - 1).bit_length())
    return (d0, d1, d1 - rest) if d1 - rest <= 8 else None


def _odd_split(d_qk: int, d_v: int):
    """(Dqk's, Dv's ``_split_padded``) where ODD_WIDTHS takes these widths, else None."""
    if ODD_WIDTHS in (False, "0"):
        return None
    qs, vs = _split_padded(d_qk), _split_padded(d_v)
    if qs is None or vs is None:
        return None
    if ODD_WIDTHS in (True, "1") or (qs[0] >= 64 and vs[0] >= 64 and d_v <= 128):  # "auto": where it gained
        return qs, vs
    return None


def _narrow_tiles(d_qk: int, d_v: int, padded: bool) -> tuple | None:
    """NARROW's (block_m, num_warps, stages, pv_overlap, q_in_regs, maxnreg, pair) for these widths, or None: the
    default tiles. ``padded``: a head split with TMA's zero fill (72 = 64 + 16 - 8)."""
    if NARROW in (False, "0") or d_qk != d_v or not 64 <= d_v <= 96:
        return None
    if padded:  # 64-row blocks were 0.85-0.99x here: the plain schedule, two 8-warp programs an SM
        return 128, 8, 3, False, False, 128, None
    return 64, 4, 4, True, True, None, False


def _tail_heads(n_mb: int, bh: int, num_sms: int) -> int:
    """TAIL: heads whose row blocks run length-major at the end -- enough for two blocks an SM."""
    return max(1, min(bh, -(-2 * num_sms // n_mb)))


def _auto_persistent(d_qk: int, d_v: int, trace) -> bool:
    """The "auto" choice of PERSISTENT: where the output has a TMA buffer of its own (see ``PERSISTENT``)."""
    return trace is None and TMA_STORE and d_qk == d_v == 128


def flash_fwd_gluon(q, k, v, *, causal: bool, scale: float, block_m: int | None = None, block_n: int | None = None,
                    stages: int | None = None, num_warps: int | None = None, pv_overlap: bool | None = None,
                    q_in_regs: bool | None = None, token_major: bool = False, trace: torch.Tensor | None = None,
                    persistent: bool | None = None, block_trace: torch.Tensor | None = None,
                    schedule: int | None = None, s1_early: bool | None = None, tail: bool | None = None,
                    pair: bool | None = None, maxnreg: int | None = None):
    """q [B, H, M, Dqk], k [B, HK, N, Dqk], v [B, HK, N, Dv] -> (o [B, H, M, Dv], lse [B, H, M]).

    See the module docstring. Causal is aligned to the bottom right (query i sees keys j <= i + N - M).
    Inputs are copied to contiguous [B, H, L, D] unless they are already, or (``token_major``) unless
    they are [B, L, H, D] tensors seen through ``transpose(1, 2)``: those are read in place through
    [B * L, H * D] descriptors. ``persistent`` (None: ``PERSISTENT``; "auto" takes it at Dqk = Dv = 128): the
    persistent schedule (not with ``trace``), whose work order is ``schedule`` (None: ``PERSISTENT_SCHEDULE``; 0 a
    counter, 1 static snake: see ``_next_work``). ``block_trace``: an int64 [row blocks x B x H, 9] buffer
    for the block-timeline build (see ``_gluon_trace.block_stamp``; a row a block, in the grid's order).
    ``s1_early`` (None: ``S1_EARLY``; "auto" takes it with the persistent schedule at d 128): the second
    score tile issued before the first tile's softmax. ``tail`` (None: ``TAIL``; causal only): the last
    heads' row blocks launched length-major (see ``_order``). ``pair`` (None: ``HEAD_PAIR``): blocks of
    block_m / 2 rows from each of two query heads sharing a KV head (GQA with an even group only; see
    ``HEAD_PAIR``). ``maxnreg``: a register cap for ptxas (None: none). The plain schedule at widths up to 96
    fits 128 registers a thread without spilling (sm_90a, Triton 3.6), so two 8-warp programs share an SM and one's
    softmax runs under the other's wgmmas. ``block_m`` / ``num_warps`` (None: 128 rows, 8 warps; or, with every
    schedule argument left at None, ``NARROW``'s tiles for narrow heads).
    """
    key = None
    if _fast.enabled() and (block_m, block_n, stages, num_warps, pv_overlap, q_in_regs, trace, persistent, block_trace,
                            schedule, s1_early, tail, pair, maxnreg) == _DEFAULTS:
        key = (tensor_key(q), tensor_key(k), tensor_key(v), bool(causal), bool(token_major), PERSISTENT, S1_EARLY,
               TMA_STORE, PERSISTENT_SCHEDULE, TAIL, HEAD_PAIR, ODD_WIDTHS, NARROW)
        plan = _plans.get(key)
        if plan is not None:
            return plan.run_fwd(q, k, v, scale)
    if not supported(q, k, v):
        raise ValueError(f"flash_fwd_gluon: unsupported inputs q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} on {q.device}")
    b, h, m, d_qk = q.shape
    hk, n, d_v = k.shape[1], k.shape[2], v.shape[-1]
    odd = _odd_split(d_qk, d_v)
    if (block_m, block_n, stages, num_warps, pv_overlap, q_in_regs, maxnreg, pair, trace, block_trace) == (None,) * 10 \
            and not persistent and PERSISTENT != "1":
        narrow = _narrow_tiles(d_qk, d_v, bool(odd and (odd[0][2] or odd[1][2])))
        if narrow:
            block_m, num_warps, stages, pv_overlap, q_in_regs, maxnreg, pair = narrow
    block_m = 128 if block_m is None else block_m
    num_warps = 8 if num_warps is None else num_warps
    if block_n is None:  # shared memory: Q + stages x (K + V) within 227 KB
        block_n = 64 if max(d_qk, d_v) <= 192 else 32  # 192/128: Q 48 KB + 4 x 40 KB
    if pv_overlap is None:  # at Dv = 256 the overlap needs more registers than there are (ptxas C7512, spills)
        pv_overlap = d_v <= 128
    if q_in_regs is None:  # 32 (d 128) or 48 (192) registers a thread; at d 256 they are not there
        q_in_regs = d_qk <= 192
    if stages is None:
        # The overlap waits on tile j + 2 in step j: a fourth stage keeps it one step ahead. A fifth or
        # sixth gained nothing on the H200 (two runs: d 128 465 vs 465 TFLOP/s, GQA 413 vs 404 at 5).
        stages = 4 if pv_overlap else 3
    if stages < 3:
        # Iteration j refills the stage of tile j - 1 with tile j + stages - 1 and waits for tile j + 1
        # first: with two stages those are the same tile.
        raise ValueError(f"flash_fwd_gluon: stages must be >= 3, got {stages}")
    from . import triton_fwd  # its _alloc: the tests poison every launcher's buffers through it

    o = triton_fwd._alloc((b, h, m, d_v), q.device, q.dtype)
    lse = triton_fwd._alloc((b, h, m), q.device, torch.float32)
    if o.numel() == 0 or n == 0:  # no rows, or no keys: every row is empty (o = 0, lse = -inf)
        return o.zero_(), lse.fill_(float("-inf"))
    (d0, d1, qk_pad), (dv0, dv1, v_pad) = odd if odd else (_split_head_dim(d_qk) + (0,), (d_v, 0, 0))
    # A padded tail's columns past the row's end must be TMA's zeros (Q K^T must not see them), which needs rows
    # of exactly Dqk (head-major) rather than a token-major row running into the next head; and V's, so that O's
    # padding columns stay finite (they are clipped on the store either way).
    majors = (token_major and not qk_pad, token_major and not qk_pad, token_major and not v_pad)
    (q2, q_rb, q_rh, q_ch), (k2, k_rb, k_rh, k_ch), (v2, v_rb, v_rh, v_ch) = (
        _tma_view(t, major) for t, major in zip((q, k, v), majors))
    el = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    plan = DescPlan(majors, (q, k, v), (q2, k2, v2, o.view(b * h * m, d_v)), el)
    pair_ok = (h // hk) % 2 == 0
    if pair is None:
        pair = pair_ok and (HEAD_PAIR == "1" or (HEAD_PAIR == "auto" and causal))
    elif pair and not pair_ok:
        raise ValueError(f"flash_fwd_gluon: pair=True needs an even number of query heads per KV head, got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    rows = block_m // 2 if pair else block_m  # rows of one head in a block
    units = b * h // 2 if pair else b * h  # head units: (batch, head) or (batch, head pair)

    desc = plan.desc  # (source: 0 q, 1 k, 2 v, 3 o; box rows, box columns) -> the next per-call Slot
    q_desc, k_desc, v_desc = desc(0, rows, d0), desc(1, block_n, d0), desc(2, block_n, dv0)
    # None where Dqk has no second half: the kernel reads them only when D_QK1 > 0, and each descriptor costs
    # the driver an encode at every launch.
    q1_desc, k1_desc = (desc(0, rows, d1), desc(1, block_n, d1)) if d1 else (None, None)
    extra_v = {"v1_desc": desc(2, block_n, dv1), "D_V1": dv1, "DV_TAIL": dv1 - v_pad} if dv1 else {}
    if persistent and dv1:  # the persistent loop has no value tail (its output buffer is one block wide)
        raise ValueError(f"flash_fwd_gluon: the persistent schedule takes no value tail (Dv {d_v} = {dv0} + "
                         f"{dv1 - v_pad}); pass persistent=False")
    if persistent is None:  # "1" in the environment: wherever it applies
        persistent = (_auto_persistent(d_qk, d_v, trace) if PERSISTENT == "auto" else PERSISTENT == "1") and not dv1
    if s1_early is None:
        s1_early = (persistent and d_qk == d_v == 128) if S1_EARLY == "auto" else S1_EARLY == "1"
    # The output leaves by TMA through Q's shared-memory buffer where that buffer has O's block shape; the
    # persistent schedule (Q's buffer holds the next block's Q by then) through a buffer of its own, where
    # shared memory has room for one (d 128: 192 of 227 KB; not 192/128).
    if persistent:
        smem = 2 * (block_m * (d0 + d1) + stages * block_n * (d0 + d1 + d_v) + block_m * d_v)
        tma_store = TMA_STORE and smem <= _SMEM_BYTES and o.is_contiguous()
    else:
        # a value tail through Q's second buffer, which must have its block shape too
        tma_store = TMA_STORE and d0 == dv0 and (dv1 == 0 or d1 == dv1) and o.is_contiguous()
    if tma_store:
        extra_o = {"o_desc": desc(3, rows, dv0), "TMA_STORE": True}  # over o seen as [B * H * M, Dv]
        if dv1:  # the tail's columns dv0 .. dv0 + dv1: the descriptor's bounds clip the padding
            extra_o["o1_desc"] = desc(3, rows, dv1)
    else:
        extra_o = {}
    if persistent and trace is not None:
        raise ValueError("flash_fwd_gluon: the TRACE build stamps the non-persistent schedule; pass persistent=False")
    n_mb = (m + rows - 1) // rows
    if block_trace is not None and (block_trace.dtype != torch.int64 or block_trace.numel() < n_mb * units * 9):
        raise ValueError(f"flash_fwd_gluon: block_trace must be int64 with at least {n_mb * units * 9} elements, "
                         f"got {block_trace.dtype} {tuple(block_trace.shape)}")
    tail = (TAIL if tail is None else tail) and causal and n_mb > 1
    extra_tail = {"TAIL": True, "TAIL_BH": _tail_heads(n_mb, units, _num_sms(q.device))} if tail else {}
    if persistent:
        schedule = PERSISTENT_SCHEDULE if schedule is None else schedule
        if schedule not in (0, 1):
            raise ValueError(f"flash_fwd_gluon: schedule must be 0 (counter) or 1 (static snake), got {schedule!r}")
        grid = (min(n_mb * units, _num_sms(q.device)), 1)
        plan.counter = schedule == 0  # see _fwd_named
        extra = {"PERSISTENT": True, "COUNTER": plan.slot("counter"), "BH": units, "SCHEDULE": schedule}
    else:
        grid = (n_mb, units)
        extra = {"BH": units} if tail else {}
    if pair:
        extra["PAIR"] = True
    plan.launch = Launch(_flash_fwd_gluon, grid, (
        q_desc, q1_desc, k_desc, k1_desc, v_desc, plan.slot("o"), plan.slot("lse"), plan.slot("scale"), m, n, h, hk,
        q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
    ), dict(
        D_QK0=d0, D_QK1=d1, D_V=dv0, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
        PV_OVERLAP=pv_overlap, Q_IN_REGS=q_in_regs, TOKEN_MAJOR=bool(q_ch or k_ch or v_ch),
        **({"TR": trace, "TRACE": True} if trace is not None else {}),
        **({"BT": block_trace, "BLOCK_TRACE": True} if block_trace is not None else {}), **extra, **extra_o,
        **({"S1_EARLY": True} if s1_early and pv_overlap else {}), **extra_tail, **extra_v,
    ), {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    plan.o_shape, plan.lse_shape = o.shape, lse.shape
    plan.launch(*plan.values((q, k, v, o), _fwd_named(plan, o, lse, scale)))
    if key is not None:
        _plans.put(key, plan.done())
    return o, lse


def _fwd_named(plan, o, lse, scale) -> dict:
    """The forward's per-call values other than descriptors (the counter: a fresh zero a call for the counter
    schedule; lse, unused, for the snake)."""
    counter = torch.zeros(1, dtype=torch.int32, device=o.device) if plan.counter else lse
    return {"o": o, "lse": lse, "scale": scale * _LOG2E, "counter": counter}


# The default schedule arguments of flash_fwd_gluon, in the order its plan check lists them: only calls with
# these are planned.
_DEFAULTS = _fast.defaults(flash_fwd_gluon, ("block_m", "block_n", "stages", "num_warps", "pv_overlap", "q_in_regs",
                                             "trace", "persistent", "block_trace", "schedule", "s1_early", "tail",
                                             "pair", "maxnreg"))
# Plans by call key (see DescPlan); cleared by the tests around each test (tests/conftest.py).
_plans = PlanCache()


class DescPlan:
    """A Gluon launch over TMA descriptors whose host decisions are kept per call key and replayed: the
    :class:`Launch`, and its per-call values in slot order -- descriptors over the call's tensors, and named
    values (outputs, scale). The first call builds each descriptor with ``from_tensor`` (which checks
    the layout) and keeps it, without its tensor, as a template; a replay rebases the templates on the new
    tensors (:func:`_launch.rebased`), copying an input for TMA only where the first call had to
    (``_tma_view``: a strided or misaligned one; the key fixes which). Used by the forward here and the
    dK/dV pass (gluon_bwd). Why: on small rows an eager training step is bound by the host, and the forward's
    launcher took ~200 us of it (H100, docs/benchmarks.md session 23), most in ``from_tensor``, Triton's binder
    and the driver's descriptor encoding; a replay skips the first two."""

    __slots__ = ("token_major", "copies", "sources", "el", "order", "launch", "counter", "o_shape", "lse_shape")

    def __init__(self, token_major: bool, inputs, sources, el):
        # sources: the first call's 2-D views of the inputs, then of any outputs (a replay takes the outputs
        # as they are: only their data pointers are read)
        # token_major: one flag for every input, or one each (the forward reads a padded head dim head-major)
        self.token_major = (tuple(token_major) if isinstance(token_major, (tuple, list))
                            else (token_major,) * len(inputs))
        self.el = el
        self.copies = tuple(s.data_ptr() != t.data_ptr() for t, s in zip(inputs, sources))
        self.sources, self.order, self.launch, self.counter = sources, [], None, False

    def desc(self, src: int, rows: int, cols: int) -> Slot:
        """A descriptor over source ``src`` with [rows, cols] boxes, as the next per-call value."""
        self.order.append((src, _desc(self.sources[src], rows, cols, self.el)))
        return Slot(len(self.order) - 1)

    def slot(self, name: str) -> Slot:
        """The named per-call value as the next one."""
        self.order.append((None, name))
        return Slot(len(self.order) - 1)

    def values(self, tensors, named: dict) -> list:
        """The per-call values in slot order; ``tensors``: the inputs, then the outputs, as in ``sources``."""
        if self.sources is not None:  # the first call: its own descriptors
            return [named[x] if src is None else x for src, x in self.order]
        n = len(self.copies)
        bases = [_tma_view(t, major)[0] if c else t for t, c, major in zip(tensors[:n], self.copies, self.token_major)]
        bases += tensors[n:]
        return [named[x] if src is None else rebased(x, bases[src]) for src, x in self.order]

    def done(self) -> "DescPlan":
        """Keep the descriptors as templates, without the first call's tensors (a plan must not keep them alive)."""
        self.order = [(src, x if src is None else rebased(x, None)) for src, x in self.order]
        self.sources = None
        return self

    def run_fwd(self, q, k, v, scale):
        from . import triton_fwd

        o = triton_fwd._alloc(self.o_shape, q.device, q.dtype)
        lse = triton_fwd._alloc(self.lse_shape, q.device, torch.float32)
        self.launch(*self.values((q, k, v, o), _fwd_named(self, o, lse, scale)))
        return o, lse

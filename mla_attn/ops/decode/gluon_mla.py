"""A warp-specialised absorbed-MLA decode kernel for Hopper, in Gluon.

Session 12 wrote it as a probe of the plan in README.md ("Where the absorbed MLA kernel stands"): how
fast does a 64-row x 64-key tile of the absorbed MLA decode run when the schedule is written out? On
the H200 (session 13) it passed its oracle tests first time and beat the Triton kernel's tile rate, so
it now carries split-KV and paged caches and is routed from ``triton_decode.mla_decode`` where it
applies and wins (the rule and its numbers: ``triton_decode.GLUON_MLA``). Scope:
- one new token per sequence (S = 1; speculative rows stay on the Triton kernel);
- H a multiple of 64, Dc = 512, Dr = 64, bf16 or fp16;
- a contiguous [B, N, 512] / [B, N, 64] cache, or a paged [num_pages, P, ...] one with P a multiple of
  64 (a tile never leaves its page: one block-table lookup per tile). Latent and rope may be views
  into one [..., 576] buffer (as the layers keep it) or two tensors: each is read in place through a
  2-D TMA descriptor over its rows;
- split-KV as in the Triton kernel: each sequence cut into num_splits intervals of whole 64-key tiles,
  fp32 partials merged by ``combine.combine_splits``; an empty interval writes o = 0, lse = -inf;
- no balanced split across sequences (the Triton kernel keeps the large batches, where that matters).

Partitions (``gl.warp_specialize``, as ``ops/attention/gluon_fwd_ws.py``):
- **A 1-warp TMA producer.** It loads Q once, as blocks of the latent's columns 0-255 and 256-511 plus
  the rope's 64. Then it streams 64-key cache tiles, as the same three column blocks, through a
  2-stage ring (``ready`` barriers on the bytes, ``empty`` on both consumers' releases).
- **Two 4-warp consumers.** Consumer c owns output columns [256 c, 256 c + 256): acc 64 x 256 fp32.
  V is the latent block already in shared memory for the scores, so nothing extra is loaded.

Two schedules for the consumers:
- **Each score tile once** (``_mla_decode_s1``, the default; ``S_ONCE``). Tile t is scored by consumer
  t % 2: three chained wgmmas (Q and K from shared memory), then the softmax with the running row
  max and sum that the scorer of t - 1 left in shared memory. The scorer publishes P_t (bf16, one
  [64, 64] buffer) and (m_t, l_t, alpha_t) (two slots), then arrives on ``p_ready``. Both consumers
  rescale their acc by alpha_t and issue acc += P_t V_t from shared memory. ``p_free`` (count 2)
  says both are done with P_t, so the next scorer may overwrite it. The softmax chain is serial
  across tiles (m_t needs m_{t-1}); the tensor work per tile is the minimum, S once plus P V once.
  - The scorer's order (``PV_FIRST``, default 1): it issues its P_{t-1} V_{t-1} first, then S_t, and
    releases tile t - 1's stage when that P V is done, so the load of tile t + 1 runs under S_t.
    With S_t first (0, the first version) ptxas waited for S_t before the rescale of acc (C7517),
    and the whole tile loop ran as one serial chain (a clock64 trace, ``scripts/trace_mla_decode.py``).
    2 also waits for that P V before issuing S_t (slower on the H200: 2.80 against 2.60 us a tile).
  - sm_90a: 231 KB of shared memory, 168 registers, 360 bytes spilled, outside the tile loop's hot
    path as far as the SASS shows; no C75xx with ``PV_FIRST`` 1.
  - Fixed roles (``DEDICATED``, default 1 since d283001's H200 probe): the same hand-over, but a scorer
    warpgroup computes every S and softmax (its waits are for S alone), two P V warpgroups own 256
    columns each, and the first of them also issues the loads (12 warps; sm_90a: 168 registers, no
    spills). 2.26 us per 64-key tile at H = 128 against 2.60 for the scorer that alternates (above).
    ``DEDICATED = 2`` also holds Q's latent columns 0-255 in the scorer's registers, so 16 of S's 36
    wgmmas read only K from shared memory: no faster (2.29 us), kept as an option.
- **Each score tile twice** (``_mla_decode_ws``, the first version; ``s_once=False``). Each consumer
  computes the whole score tile and runs the whole softmax itself, so the consumers share no data,
  only the turn to issue (two ``turn`` mbarriers). That is a third more tensor work. It was 3-7% faster
  than the Triton kernel; S once is 13-15% faster than this.

**Unused cache slots may hold NaN.** TMA loads them with the last tile. Their scores are masked, but
0 x NaN is NaN inside a wgmma, so each consumer zeroes those rows of its value half in shared memory
before the last P V.

Local sm_90a compile: ``scripts/compile_sm90.py gluon_mla 64,64,4,2 [--paged] [--s-once [--pv-first N]
[--trace] [--dedicated --consumer-regs 168]]``. GPU tests:
``tests/ops/test_decode_gluon_mla.py``, run by ``scripts/gpu_check.sh`` in a hang-guarded step.
Timing: ``scripts/bench_decode.py --gluon-mla`` (direct calls; both schedules and the Triton kernel)
and ``--graph`` (through the op: its ``[gluon]`` rows, with the Triton kernel beside them).

H200, graph replays through the op, H = 128, contiguous cache, varlen lengths (``bench_decode.py --graph``;
the S-first order at d3655cf, P V first at 4d62e24, the dedicated scorer at 230f3fa):

| B | L | Triton kernel | S once, S first | S once, P V first | dedicated scorer (default) |
|---|---|---|---|---|---|
| 1 | 32768 | 50.9 us | 47.8 us | 43.8 us (208 TFLOP/s) | 37.6 us (243) |
| 16 | 8192 | 135.2 us | 118.5 us | 103.3 us (324) | 82.9 us (404) |
| 64 | 4096 | 257.2 us | 211.5 us | 182.2 us (354) | 147.0 us (438) |
| 128 | 8192 | 884.5 us | 770.1 us | 659.3 us (391) | 556.1 us (461) |

Eager calls are host-bound and their times noisy: bench_decode's eager column at B = 1 read 284 us
(4d62e24) and 133 us (230f3fa), against 150 and 252 for the Triton kernel. CUDA graphs hide it.
"""

from __future__ import annotations

import functools

import torch

from .. import _env
from .. import _launch as _fast
from .._launch import Launch, PlanCache, Slot, tensor_key
from .._launch import rebased as _rebased
from .triton_decode import plan_buffers

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .._gluon_compat import VERSION_OK as _VERSION_OK
    from .._gluon_compat import cp_async as _cp_async
    from .._gluon_compat import cp_async_arrive as _cp_async_arrive
    from .._gluon_compat import thread_barrier as _thread_barrier
    from .._gluon_compat import tma_load as _tma_load
    from .._gluon_compat import warn_untested as _warn_untested

    from .._gluon_trace import stamp as _trace_stamp
    AVAILABLE = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

_LOG2E = 1.4426950408889634
# The schedule that computes each score tile once (``_mla_decode_s1``) instead of once per consumer
# (``_mla_decode_ws``). On the H200 (62a93a0, graph replays, H = 128, contiguous cache) it passed every
# Gluon MLA and MLA decode GPU test and ran B 1 / 16 / 64 / 128 in 48.7 / 118.8 / 210.1 / 776.3 us
# (188 / 282 / 294 / 331 TFLOP/s), against 52.9 / 134.4 / 241.1 / 898.7 for the two-score schedule
# and 51.1 / 136.4 / 248.2 / 890.5 for the Triton kernel. MLA_ATTN_GLUON_MLA_S_ONCE=0 turns it off.
S_ONCE = _env.flag("MLA_ATTN_GLUON_MLA_S_ONCE", True)
# S once, with the scorer of tile t issuing P_{t-1} V_{t-1} before S_t (``PV_FIRST`` in _consumer_s1).
# A clock64 trace of the S-first order on the H200 (scripts/trace_mla_decode.py) showed the tile loop
# serialised: ptxas waits for S_t before the scorer's rescale of acc (C7517), so P_{t-1} V_{t-1}, the
# release of tile t - 1's stage and the load of tile t + 1 into it all wait for S_t, and the next
# scorer then waits ~2000 cycles for that load. P V first (4a813d2, scripts/probe_mla_decode.py, one
# program per SM): 2.56 against 3.01 us per 64-key tile at H = 128 (460 against 390 TFLOP/s per tile),
# 3.17 against 3.51 at H = 64; B = 1, L = 32768, 66 splits: 44.1 against 47.5 us a step. On by
# default; MLA_ATTN_GLUON_MLA_PV_FIRST=0 turns it off. 2 also waits for that P V before issuing S_t (the
# trace showed S_t's issue blocking until most of it has run): slower, see DEDICATED below. PV_FIRST applies
# to the alternating scorers only (DEDICATED = 0).
PV_FIRST = int(_env.choice("MLA_ATTN_GLUON_MLA_PV_FIRST", "1", ("0", "1", "2")))  # 0 S first, 1 P V first, 2 P V first, waited
# S once with a dedicated scorer warpgroup and two P V warpgroups, the first of which also issues the loads
# (``_scorer_sd`` / ``_pv_sd``). sm_90a: 168 registers, no spills, no C75xx. H200 probe at d283001
# (scripts/probe_mla_decode.py, 132 programs, H = 128, cache in HBM): 2.255 us per 64-key tile against
# 2.600 for PV_FIRST 1 alone (522 against 453 TFLOP/s per tile); B = 1, L = 32768, 66 splits: 39.2
# against 44.4 us a step (graph). On by default; MLA_ATTN_GLUON_MLA_DEDICATED=0 turns it off. 2 also holds
# Q's latent columns 0-255 in the scorer's registers (64 a thread) as the A operand of that part of S, so
# S reads 40 KB of Q from shared memory a tile instead of 72: 2.285 us, no gain. PV_FIRST 2 (waited):
# 2.800 us, slower than 1. Both passed their GPU tests. 3 (EXPERIMENTAL): the scorer issues S_{t+1} as soon
# as S_t is done, so it runs under the softmax and publish of tile t (``_scorer_sd``'s EARLY_S; sm_90a: 168
# registers, no spills). Correct on the H200 (c97a5b7) but slower: 3.242 us a tile against 2.203 for 1 in
# the same probe run, so S under the softmax costs the P V warpgroups more than the overlap gains.
DEDICATED = int(_env.choice("MLA_ATTN_GLUON_MLA_DEDICATED", "1", ("0", "1", "2", "3")))
# Pages smaller than a 64-key tile (GATHER): the loading warpgroup gathers each tile by cp.async, every key
# looking its own page up (``_gather_tile``), instead of one TMA box a tile. With the dedicated scorer only.
# On by default: on the H200 (5efecc6, graph replays, H = 128) pages of 1 key ran at 0.91-0.94x of this
# kernel's contiguous rate (B 1 / 16 / 64 / 128: 37.9 / 89.5 / 157.0 / 616.3 us against 35.7 / 82.3 / 145.9 /
# 563.8), where the Triton kernel they ran on before reached 0.52-0.66x (afb81c9). Tests: pages 1, 4, 16,
# 32, 48 with and without splits. MLA_ATTN_GLUON_MLA_SMALL_PAGES=0 sends such caches to the Triton kernel.
SMALL_PAGES = _env.flag("MLA_ATTN_GLUON_MLA_SMALL_PAGES", True)
# Fewer than 64 heads (SMALL_HEADS; H = 16 is DeepSeek-V2-Lite's, and any tensor-parallel shard of 128
# heads over 8 GPUs): one 64-row head tile a sequence, its rows past H filled with the next sequence's
# queries by the TMA box (or zeros past the last), computed and never stored. The memory-bound H = 16 then
# would run at this kernel's tile rate: about 2.6 us a 64-key tile an SM at H = 128, i.e. ~3.8 TB/s of
# cache if the loads kept up. The Triton kernel gets 3.36-3.57 TB/s. With the dedicated scorer only.
# EXPERIMENTAL, off. Correct on the H200 (3c2ee83, 7/7 tests) but no faster. The loads did not keep up:
# two 74 KB stages a program are too few bytes in flight for a memory-bound loop. Graph replays at H = 16:
# - B 128 L 4096: 3461 GB/s against the Triton kernel's 3601.
# - B 64 L 8192: 3349 against 3480; paged 64: 3326 against 3371.
# - 8-layer steps: 3366-3687 against 3570-3872.
# MLA_ATTN_GLUON_MLA_SMALL_HEADS=1 routes such calls here.
SMALL_HEADS = _env.flag("MLA_ATTN_GLUON_MLA_SMALL_HEADS", False)
DC, DR, HALF = 512, 64, 256
BLOCK_H, BLOCK_N = 64, 64

if AVAILABLE:
    # TRACE builds' stamp buffer: [4, TRACE_TILES, TRACE_EVENTS] int64: rows 0 and 1 the consumers' tile loops,
    # row 2 the producer's, row 3 the prologue and epilogue (scripts/trace_mla_decode.py reads it)
    TRACE_TILES = gl.constexpr(64)
    TRACE_EVENTS = gl.constexpr(8)

    @gluon.jit
    def _stamp(TR, on, who, t, event):
        """TRACE builds only (scripts/trace_mla_decode.py): this SM's clock64 into TR[who, t, event] for
        key tiles t < TRACE_TILES, from the program that ``on`` marks. A constexpr-off build has no trace."""
        _trace_stamp(TR, on, who, t, event, TRACE_TILES, TRACE_EVENTS)

    @gluon.jit
    def _load_q(ql_desc, qr_desc, qa, qb, qr, q_bar, q_row0):
        """Q's three column blocks (latent 0-255, 256-511, rope) into shared memory, on q_bar."""
        mbarrier.expect(q_bar, 2 * ql_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        _tma_load(ql_desc, [q_row0, 0], q_bar, qa)
        _tma_load(ql_desc, [q_row0, 256], q_bar, qb)
        _tma_load(qr_desc, [q_row0, 0], q_bar, qr)

    @gluon.jit
    def _load_tile(c_desc, cr_desc, ka, kb, kr, ready, t, lo, c_row0, bt_row, stride_btp, PAGED: gl.constexpr,
                   PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
        """Key tile t of this program's interval into ring stage t % STAGES, on ready[stage]."""
        s = t % STAGES
        pos = lo + t * 64
        if PAGED:  # a 64-key tile never leaves its page (PAGE_SIZE % 64 == 0): one lookup per tile
            page = gl.load(bt_row + (pos // PAGE_SIZE) * stride_btp)
            row = page * PAGE_SIZE + pos % PAGE_SIZE
        else:
            row = c_row0 + pos
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * c_desc.block_type.nbytes + cr_desc.block_type.nbytes)
        _tma_load(c_desc, [row, 0], bar, ka.index(s))
        _tma_load(c_desc, [row, 256], bar, kb.index(s))
        _tma_load(cr_desc, [row, 0], bar, kr.index(s))

    @gluon.jit
    def _gather_tile(ka, kb, kr, ready, t, lo, length, bt_row, stride_btp, C, CR, stride_c, stride_cr,
                     PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
        """GATHER (pages smaller than a tile): key tile t into ring stage t % STAGES by cp.async, 16 bytes a
        copy, issued by every thread of the calling 4-warp partition; each thread's copies arrive on
        ready[stage] when they land (the barrier counts 128 arrivals). Each of the 64 keys looks its own page
        up; keys past the interval are neither looked up nor read: their rows are zero-filled."""
        s = t % STAGES
        g_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        pos = lo + t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, g_layout))
        valid = pos < lo + length
        page = gl.load(bt_row + (pos // PAGE_SIZE) * stride_btp, mask=valid, other=0)
        row = page.to(gl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, g_layout))
        keep = valid[:, None]  # broadcast along a row: one predicate a 16-byte copy
        c_rows = C + (row * stride_c)[:, None]
        for j in gl.static_range(4):
            _cp_async(ka.index(s).slice(j * 64, 64, dim=1), c_rows + (j * 64 + cols)[None, :], mask=keep)
            _cp_async(kb.index(s).slice(j * 64, 64, dim=1), c_rows + (256 + j * 64 + cols)[None, :], mask=keep)
        _cp_async(kr.index(s), CR + (row * stride_cr)[:, None] + cols[None, :], mask=keep)
        _cp_async_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _fill(c_desc, cr_desc, ka, kb, kr, ready, t, lo, length, c_row0, bt_row, stride_btp, C, CR, stride_c,
              stride_cr, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr):
        """Key tile t into its ring stage: TMA (contiguous, or pages of 64 keys or more), or GATHER."""
        if GATHER:
            _gather_tile(ka, kb, kr, ready, t, lo, length, bt_row, stride_btp, C, CR, stride_c, stride_cr, PAGE_SIZE,
                         STAGES)
        else:
            _load_tile(c_desc, cr_desc, ka, kb, kr, ready, t, lo, c_row0, bt_row, stride_btp, PAGED, PAGE_SIZE, STAGES)

    @gluon.jit
    def _producer(ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, q_bar, ready, empty, q_row0, c_row0, lo,
                  bt_row, stride_btp, n_tiles, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
                  TR=None, tr_on=False, TRACE: gl.constexpr = False):
        if TRACE:
            _stamp(TR, tr_on, 3, 2, 0)  # the producer starts
        _load_q(ql_desc, qr_desc, qa, qb, qr, q_bar, q_row0)
        for t in range(n_tiles):
            mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
            if TRACE:
                _stamp(TR, tr_on, 2, t, 0)  # stage free: tile t's loads issue now
            _load_tile(c_desc, cr_desc, ka, kb, kr, ready, t, lo, c_row0, bt_row, stride_btp, PAGED, PAGE_SIZE, STAGES)

    @gluon.jit
    def _scores(qa, qb, qr, ka, kb, kr, st, s_zero):
        s = warpgroup_mma(qa, ka.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qb, kb.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qr, kr.index(st).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _zero_tail_rows(v, tail):
        """Zero rows >= tail of a [64, 256] value block in shared memory. They are unused cache slots
        (NaN allowed): P is 0 there, but 0 x NaN is NaN inside a wgmma."""
        z_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = (gl.arange(0, 64, layout=gl.SliceLayout(1, z_layout)) < tail)[:, None]
        for c in gl.static_range(4):
            sub = v.slice(c * 64, 64, dim=1)
            sub.store(gl.where(keep, sub.load(z_layout), 0.0))
        fence_async_shared()

    @gluon.jit
    def _softmax(s, m_i, l_i, t, n_tiles, length, o_n, qk_scale, dtype: gl.constexpr):
        s = s * qk_scale
        if t == n_tiles - 1:  # the last tile's tail: past the interval (unused slots, another sequence, TMA's 0)
            s = gl.where((t * 64 + o_n < length)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        return p.to(dtype), alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _consumer(C: gl.constexpr, qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length,
                  n_tiles, o_row0, STAGES: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 256, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = ka.dtype
        if C == 0:
            kv = ka  # P V over the latent's columns 0-255
        else:
            kv = kb
        o_n = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([64], gl.float32, layout=row_s)
        acc = gl.zeros([64, 256], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
        p_op = gl.zeros([64, 64], dtype, layout=p_layout)

        mbarrier.wait(q_bar, 0)
        if n_tiles > 0:
            mbarrier.wait(ready.index(0), 0)
            mbarrier.wait(turn.index(C), 0)
            s = _scores(qa, qb, qr, ka, kb, kr, 0, s_zero)
            mbarrier.arrive(turn.index(1 - C), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p_lo, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, n_tiles, length, o_n, qk_scale, dtype)
            p_op = gl.convert_layout(p_lo, p_layout)
        for t in range(1, n_tiles):
            st = t % STAGES
            mbarrier.wait(ready.index(st), (t // STAGES) & 1)
            mbarrier.wait(turn.index(C), t & 1)
            s = _scores(qa, qb, qr, ka, kb, kr, st, s_zero)
            acc = warpgroup_mma(p_op, kv.index((t - 1) % STAGES), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - C), count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p_lo, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, n_tiles, length, o_n, qk_scale, dtype)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p_lo, p_layout)
        if n_tiles > 0:
            last = (n_tiles - 1) % STAGES
            tail = length - (n_tiles - 1) * 64
            if tail < 64:
                # (The other consumer's score wgmma may read these rows meanwhile: their columns are
                # masked to -inf.)
                _zero_tail_rows(kv.index(last), tail)
            acc = warpgroup_mma(p_op, kv.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(last), count=1)

        dead = l_i == 0.0
        inv = gl.convert_layout(1.0 / gl.where(dead, 1.0, l_i), row_o)
        o = acc * inv[:, None]
        o_r = gl.arange(0, 64, layout=row_o)
        o_d = C * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
        gl.store(O + (o_row0 + o_r.to(gl.int64))[:, None] * 512 + o_d[None, :], o.to(O.dtype.element_ty))
        if C == 0:
            lse = gl.where(dead, float("-inf"), (m_i + gl.log2(gl.where(dead, 1.0, l_i))) * 0.6931471805599453)
            gl.store(LSE + o_row0 + gl.arange(0, 64, layout=row_s), lse)

    @gluon.jit
    def _consumer0(qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length, n_tiles, o_row0,
                   STAGES: gl.constexpr):
        _consumer(0, qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length, n_tiles, o_row0,
                  STAGES)

    @gluon.jit
    def _consumer1(qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length, n_tiles, o_row0,
                   STAGES: gl.constexpr):
        _consumer(1, qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length, n_tiles, o_row0,
                  STAGES)

    @gluon.jit
    def _program_rows(SEQ_LENS, BT, H, N, B, num_splits, stride_btb):
        """This program's (64-head tile, sequence, split) -> (interval start lo, its length, 64-key tiles,
        first query row, first contiguous-cache row, block-table row, first output row)."""
        i_t = gl.program_id(0)  # 64-head tile
        i_b = gl.program_id(1)  # sequence
        i_s = gl.program_id(2)  # KV interval (split)
        seq_len = gl.load(SEQ_LENS + i_b)
        # As the Triton kernel: seq_len cut into num_splits intervals of whole 64-key tiles.
        split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), 64) * 64
        lo = i_s * split_len
        length = gl.maximum(gl.minimum(lo + split_len, seq_len) - lo, 0)
        q_row0 = i_b * H + i_t * 64  # rows of the [B * H, 512] / [B * H, 64] query views and of o
        o_row0 = i_s.to(gl.int64) * B * H + q_row0  # split-major partials [num_splits, B * H, 512]
        return (lo, length, gl.cdiv(length, 64), q_row0, i_b * N, BT + i_b.to(gl.int64) * stride_btb,
                o_row0)

    @gluon.jit
    def _mla_decode_ws(ql_desc, qr_desc, c_desc, cr_desc, SEQ_LENS, BT, O, LSE, qk_scale, H, N, B, num_splits,
                       stride_btb, stride_btp, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        lo, length, n_tiles, q_row0, c_row0, bt_row, o_row0 = _program_rows(SEQ_LENS, BT, H, N, B, num_splits,
                                                                             stride_btb)
        dtype: gl.constexpr = ql_desc.dtype
        qa = gl.allocate_shared_memory(dtype, [64, 256], ql_desc.layout)
        qb = gl.allocate_shared_memory(dtype, [64, 256], ql_desc.layout)
        qr = gl.allocate_shared_memory(dtype, [64, 64], qr_desc.layout)
        ka = gl.allocate_shared_memory(dtype, [STAGES, 64, 256], c_desc.layout)
        kb = gl.allocate_shared_memory(dtype, [STAGES, 64, 256], c_desc.layout)
        kr = gl.allocate_shared_memory(dtype, [STAGES, 64, 64], cr_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        mbarrier.arrive(turn.index(0), count=1)  # consumer 0 issues first
        gl.warp_specialize([
            (_consumer0, (qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length, n_tiles,
                          o_row0, STAGES)),
            (_consumer1, (qa, qb, qr, ka, kb, kr, q_bar, ready, empty, turn, O, LSE, qk_scale, length, n_tiles,
                          o_row0, STAGES)),
            (_producer, (ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, q_bar, ready, empty, q_row0,
                         c_row0, lo, bt_row, stride_btp, n_tiles, PAGED, PAGE_SIZE, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


    # ---- S once per tile (the default, ``S_ONCE``): the scorer of tile t is consumer t % 2 ----
    # It computes the whole 64 x 64 score tile once, runs the softmax with the running (m, l) handed over
    # through shared memory by the scorer of t - 1, and publishes P_t (bf16, one [64, 64] buffer) and
    # (m_t, l_t, alpha_t) (two slots) for both consumers' P V. Barriers: p_ready (count 1: the scorer
    # published tile t), p_free (count 2: both consumers' P_t V_t are done, so P may be overwritten).
    # The scorer of t issues S_t, then its P_{t-1} V_{t-1}, and runs softmax_t under that wgmma.

    @gluon.jit
    def _pv_s1(p_smem, kv, a_smem, ready, p_ready, acc, tp, n_tiles, length, STAGES: gl.constexpr,
               o_layout: gl.constexpr, GATHER: gl.constexpr = False):
        """Issue acc = acc * alpha_tp + P_tp V_tp (this consumer's half) once P_tp is published."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        sp = tp % STAGES
        mbarrier.wait(ready.index(sp), (tp // STAGES) & 1)  # V_tp landed (visible to this warpgroup)
        if GATHER:  # cp.async wrote the stage through the generic proxy; the wgmma reads it through the async one
            fence_async_shared()
        mbarrier.wait(p_ready, tp & 1)
        alpha = a_smem.index(tp % 2).load(row_o)
        acc = acc * alpha[:, None]
        tail = length - tp * 64
        if tail < 64:  # the interval's last tile
            _zero_tail_rows(kv.index(sp), tail)
        return warpgroup_mma(p_smem, kv.index(sp), acc, is_async=True)

    @gluon.jit
    def _publish_s1(p, m_new, l_new, alpha, t, p_smem, m_smem, l_smem, a_smem, p_ready):
        slot = t % 2
        p_smem.store(p)
        m_smem.index(slot).store(m_new)
        l_smem.index(slot).store(l_new)
        a_smem.index(slot).store(alpha)
        fence_async_shared()  # P is read by wgmma (the async proxy)
        _thread_barrier()  # every thread's stores are in before the one arrival
        mbarrier.arrive(p_ready, count=1)

    @gluon.jit
    def _consumer_s1(C: gl.constexpr, qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready,
                     p_free, q_bar, O, LSE, qk_scale, length, n_tiles, o_row0, STAGES: gl.constexpr,
                     TR=None, tr_on=False, TRACE: gl.constexpr = False, PV_FIRST: gl.constexpr = 0):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 256, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = ka.dtype
        if C == 0:
            kv = ka
        else:
            kv = kb
        o_n = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        acc = gl.zeros([64, 256], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
        if TRACE:
            _stamp(TR, tr_on, 3, C, 0)  # this consumer starts
        mbarrier.wait(q_bar, 0)
        if TRACE:
            _stamp(TR, tr_on, 3, C, 1)  # Q landed
        if C == 0:
            if n_tiles > 0:  # tile 0: consumer 0 scores it, nothing to overlap with
                mbarrier.wait(ready.index(0), 0)
                s = _scores(qa, qb, qr, ka, kb, kr, 0, s_zero)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                p, alpha, m_new, l_new = _softmax(s, gl.full([64], float("-inf"), gl.float32, layout=row_s),
                                                     gl.zeros([64], gl.float32, layout=row_s), 0, n_tiles, length,
                                                     o_n, qk_scale, dtype)
                _publish_s1(p, m_new, l_new, alpha, 0, p_smem, m_smem, l_smem, a_smem, p_ready)
                if TRACE:
                    _stamp(TR, tr_on, 3, C, 2)  # P_0 published
        for t in range(1, n_tiles + 1):
            tp = t - 1
            # TRACE events of loop step t (scripts/trace_mla_decode.py): 0 tile t landed, 1 S_t issued,
            # 2 P_{t-1} V_{t-1} issued (P_{t-1} published), 3 S_t done, 4 softmax_t done, 5 P_{t-1} V_{t-1}
            # done, 6 the other consumer done with P_{t-1}, 7 P_t published.
            if (PV_FIRST > 0) & (t % 2 == C) & (t < n_tiles):
                # P_{t-1} V_{t-1} first, then S_t: tile t - 1's stage is released as soon as that P V is
                # done (the load of tile t + 1 then runs under S_t and the softmax), and nothing is in
                # flight when acc is rescaled (no injected warpgroup.wait).
                st = t % STAGES
                acc = _pv_s1(p_smem, kv, a_smem, ready, p_ready, acc, tp, n_tiles, length, STAGES, o_layout)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 2)
                if PV_FIRST == 2:
                    # Wait for that P V before issuing S_t: issuing 36 wgmmas blocks the warps until
                    # most of them ran, so a wait placed after S_t would hold the stage until S_t ends.
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    if TRACE:
                        _stamp(TR, tr_on, C, t, 5)
                    mbarrier.arrive(p_free, count=1)
                    mbarrier.arrive(empty.index(tp % STAGES), count=1)
                mbarrier.wait(ready.index(st), (t // STAGES) & 1)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 0)
                s = _scores(qa, qb, qr, ka, kb, kr, st, s_zero)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 1)
                if PV_FIRST != 2:  # (this branch is compiled, dead, at PV_FIRST = 0 too)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the older group: P_{t-1} V_{t-1}
                    if TRACE:
                        _stamp(TR, tr_on, C, t, 5)
                    mbarrier.arrive(p_free, count=1)
                    mbarrier.arrive(empty.index(tp % STAGES), count=1)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                if TRACE:
                    _stamp(TR, tr_on, C, t, 3)
                m_prev = m_smem.index(tp % 2).load(row_s)
                l_prev = l_smem.index(tp % 2).load(row_s)
                p, alpha, m_new, l_new = _softmax(s, m_prev, l_prev, t, n_tiles, length, o_n, qk_scale, dtype)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 4)
                mbarrier.wait(p_free, tp & 1)  # both consumers are done with P_{t-1}
                if TRACE:
                    _stamp(TR, tr_on, C, t, 6)
                _publish_s1(p, m_new, l_new, alpha, t, p_smem, m_smem, l_smem, a_smem, p_ready)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 7)
            elif (t % 2 == C) & (t < n_tiles):
                st = t % STAGES
                mbarrier.wait(ready.index(st), (t // STAGES) & 1)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 0)
                s = _scores(qa, qb, qr, ka, kb, kr, st, s_zero)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 1)
                acc = _pv_s1(p_smem, kv, a_smem, ready, p_ready, acc, tp, n_tiles, length, STAGES, o_layout)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 2)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                if TRACE:
                    _stamp(TR, tr_on, C, t, 3)
                m_prev = m_smem.index(tp % 2).load(row_s)
                l_prev = l_smem.index(tp % 2).load(row_s)
                p, alpha, m_new, l_new = _softmax(s, m_prev, l_prev, t, n_tiles, length, o_n, qk_scale, dtype)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 4)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if TRACE:
                    _stamp(TR, tr_on, C, t, 5)
                mbarrier.arrive(p_free, count=1)
                mbarrier.arrive(empty.index(tp % STAGES), count=1)
                mbarrier.wait(p_free, tp & 1)  # both consumers are done with P_{t-1}
                if TRACE:
                    _stamp(TR, tr_on, C, t, 6)
                _publish_s1(p, m_new, l_new, alpha, t, p_smem, m_smem, l_smem, a_smem, p_ready)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 7)
            else:
                acc = _pv_s1(p_smem, kv, a_smem, ready, p_ready, acc, tp, n_tiles, length, STAGES, o_layout)
                if TRACE:
                    _stamp(TR, tr_on, C, t, 2)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if TRACE:
                    _stamp(TR, tr_on, C, t, 5)
                mbarrier.arrive(p_free, count=1)
                mbarrier.arrive(empty.index(tp % STAGES), count=1)
        if TRACE:
            _stamp(TR, tr_on, 3, C, 3)  # the tile loop is done
        m_fin = gl.full([64], float("-inf"), gl.float32, layout=row_o)
        l_fin = gl.zeros([64], gl.float32, layout=row_o)
        if n_tiles > 0:  # the last scorer's (m, l): published with P_{n-1}, which this consumer has waited for
            m_fin = m_smem.index((n_tiles - 1) % 2).load(row_o)
            l_fin = l_smem.index((n_tiles - 1) % 2).load(row_o)
        dead = l_fin == 0.0
        o = acc * (1.0 / gl.where(dead, 1.0, l_fin))[:, None]
        o_r = gl.arange(0, 64, layout=row_o)
        o_d = C * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
        gl.store(O + (o_row0 + o_r.to(gl.int64))[:, None] * 512 + o_d[None, :], o.to(O.dtype.element_ty))
        if C == 0:
            lse = gl.where(dead, float("-inf"), (m_fin + gl.log2(gl.where(dead, 1.0, l_fin))) * 0.6931471805599453)
            gl.store(LSE + o_row0 + o_r, lse)
        if TRACE:
            _stamp(TR, tr_on, 3, C, 4)  # the output stores are issued

    @gluon.jit
    def _consumer0_s1(qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready, p_free, q_bar, O,
                      LSE, qk_scale, length, n_tiles, o_row0, STAGES: gl.constexpr, TR, tr_on, TRACE: gl.constexpr,
                      PV_FIRST: gl.constexpr):
        _consumer_s1(0, qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready, p_free, q_bar,
                     O, LSE, qk_scale, length, n_tiles, o_row0, STAGES, TR, tr_on, TRACE, PV_FIRST)

    @gluon.jit
    def _consumer1_s1(qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready, p_free, q_bar, O,
                      LSE, qk_scale, length, n_tiles, o_row0, STAGES: gl.constexpr, TR, tr_on, TRACE: gl.constexpr,
                      PV_FIRST: gl.constexpr):
        _consumer_s1(1, qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready, p_free, q_bar,
                     O, LSE, qk_scale, length, n_tiles, o_row0, STAGES, TR, tr_on, TRACE, PV_FIRST)

    # ---- DEDICATED (the default): a scorer warpgroup and two P V warpgroups ----
    # The scorer (the default partition) computes every score tile, keeps (m, l) in registers and
    # publishes P_t and alpha_t as above. It never issues a P V, so its wgmma waits are for S alone,
    # and it starts S_{t+1} as soon as P_t is out. Each P V warpgroup owns 256 output columns: it
    # rescales, issues P_t V_t, waits and releases, so tile t's stage frees as soon as both P_t V_t are
    # done. The first P V warpgroup also issues the TMA loads (Q, then tile t + STAGES once both are done
    # with tile t): a separate producer warp would make 13 warps, whose 65536 / 416 registers a thread
    # are too few for the m64n256 wgmma (ptxas C7602 at 152). 12 warps at 168 registers each fit.

    @gluon.jit
    def _scorer_sd(qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, p_ready, p_free, q_bar, LSE,
                   qk_scale, length, n_tiles, o_row0, STAGES: gl.constexpr, QA_REGS: gl.constexpr, TR=None,
                   tr_on=False, TRACE: gl.constexpr = False, EARLY_S: gl.constexpr = False,
                   GATHER: gl.constexpr = False, ROWS: gl.constexpr = 64):
        # EARLY_S (DEDICATED = 3, EXPERIMENTAL; correct, 47% slower a tile on the H200): S_{t+1} is issued as
        # soon as S_t is done and tile t + 1 has landed, so it runs on the tensor cores under the softmax and publish of
        # tile t (two score register sets; nothing is in flight at the loop's back edge). The scorer owns
        # no accumulator that a P V touches, so no rescale forces a wait on it (the alternating scorers'
        # C7517). Tile t + 1's stage is refilled only after P_{t+1} V_{t+1}, which follows S_{t+1}'s end.
        # TRACE (scripts/trace_mla_decode.py): row 0, tile t: 0 tile landed, 1 S issued, 2 S done, 3 softmax
        # done, 4 P_{t-1} free, 5 P_t published; row 3 slot 0: 0 start, 1 Q landed, 2 loop done, 3 lse stored
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = ka.dtype
        o_n = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([64], gl.float32, layout=row_s)
        if TRACE:
            _stamp(TR, tr_on, 3, 0, 0)
        mbarrier.wait(q_bar, 0)
        if TRACE:
            _stamp(TR, tr_on, 3, 0, 1)
        if QA_REGS:  # Q's latent columns 0-255 as a register A operand (64 registers a thread)
            q_a = qa.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q_a = qa
        if EARLY_S:
            if n_tiles > 0:
                mbarrier.wait(ready.index(0), 0)
                if GATHER:
                    fence_async_shared()
                s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_a, qb, qr, ka, kb, kr, 0, s_zero),))
                for t in range(n_tiles):
                    nxt = t + 1
                    if nxt < n_tiles:
                        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
                        if GATHER:
                            fence_async_shared()
                        s_next = _scores(q_a, qb, qr, ka, kb, kr, nxt % STAGES, s_zero)
                    else:
                        s_next = warpgroup_mma_init(s_zero)  # the last tile: nothing to issue
                    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, n_tiles, length, o_n, qk_scale, dtype)
                    if t > 0:
                        mbarrier.wait(p_free, (t - 1) & 1)  # both P V warpgroups are done with P_{t-1}
                    _publish_s1(p, m_i, l_i, alpha, t, p_smem, m_smem, l_smem, a_smem, p_ready)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
        for t in range(0 if EARLY_S else n_tiles):
            st = t % STAGES
            mbarrier.wait(ready.index(st), (t // STAGES) & 1)
            if GATHER:  # cp.async wrote the stage through the generic proxy; the wgmma reads it through the async one
                fence_async_shared()
            if TRACE:
                _stamp(TR, tr_on, 0, t, 0)
            s = _scores(q_a, qb, qr, ka, kb, kr, st, s_zero)
            if TRACE:
                _stamp(TR, tr_on, 0, t, 1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if TRACE:
                _stamp(TR, tr_on, 0, t, 2)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, n_tiles, length, o_n, qk_scale, dtype)
            if TRACE:
                _stamp(TR, tr_on, 0, t, 3)
            if t > 0:
                mbarrier.wait(p_free, (t - 1) & 1)  # both P V warpgroups are done with P_{t-1}
            if TRACE:
                _stamp(TR, tr_on, 0, t, 4)
            _publish_s1(p, m_i, l_i, alpha, t, p_smem, m_smem, l_smem, a_smem, p_ready)
            if TRACE:
                _stamp(TR, tr_on, 0, t, 5)
        if TRACE:
            _stamp(TR, tr_on, 3, 0, 2)
        dead = l_i == 0.0
        lse = gl.where(dead, float("-inf"), (m_i + gl.log2(gl.where(dead, 1.0, l_i))) * 0.6931471805599453)
        l_r = gl.arange(0, 64, layout=row_s)
        if ROWS < 64:  # SMALL_HEADS: the tile's rows past H are the next sequence's queries (or TMA zeros)
            gl.store(LSE + o_row0 + l_r, lse, mask=l_r < ROWS)
        else:
            gl.store(LSE + o_row0 + l_r, lse)
        if TRACE:
            _stamp(TR, tr_on, 3, 0, 3)

    @gluon.jit
    def _pv_sd(C: gl.constexpr, ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem,
               q_bar, ready, empty, p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles, o_row0,
               PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, TR=None, tr_on=False,
               TRACE: gl.constexpr = False, c_ptr=None, cr_ptr=None, stride_c=0, stride_cr=0,
               GATHER: gl.constexpr = False, ROWS: gl.constexpr = 64):
        # TRACE (scripts/trace_mla_decode.py): row 1 + C, tile t: 0 loop top, 1 P_t V_t issued (after its
        # waits), 2 P_t V_t done, 3 (C = 0) tile t + STAGES's loads issued; row 3 slot 1 + C: 0 start,
        # 1 (C = 0) the prologue's loads issued, 2 loop done, 3 output stores issued
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 256, 16])
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        if TRACE:
            _stamp(TR, tr_on, 3, 1 + C, 0)
        if C == 0:
            kv = ka
            _load_q(ql_desc, qr_desc, qa, qb, qr, q_bar, q_row0)
            for i in gl.static_range(STAGES):
                if i < n_tiles:
                    _fill(c_desc, cr_desc, ka, kb, kr, ready, i, lo, length, c_row0, bt_row, stride_btp, c_ptr,
                          cr_ptr, stride_c, stride_cr, PAGED, PAGE_SIZE, STAGES, GATHER)
            if TRACE:
                _stamp(TR, tr_on, 3, 1, 1)
        else:
            kv = kb
        acc = gl.zeros([64, 256], gl.float32, layout=o_layout)
        for t in range(n_tiles):
            if TRACE:
                _stamp(TR, tr_on, 1 + C, t, 0)
            acc = _pv_s1(p_smem, kv, a_smem, ready, p_ready, acc, t, n_tiles, length, STAGES, o_layout, GATHER)
            if TRACE:
                _stamp(TR, tr_on, 1 + C, t, 1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if TRACE:
                _stamp(TR, tr_on, 1 + C, t, 2)
            mbarrier.arrive(p_free, count=1)
            mbarrier.arrive(empty.index(t % STAGES), count=1)
            if C == 0:
                if t + STAGES < n_tiles:  # refill tile t's stage once both P V warpgroups are done with it
                    mbarrier.wait(empty.index(t % STAGES), (t // STAGES) & 1)
                    _fill(c_desc, cr_desc, ka, kb, kr, ready, t + STAGES, lo, length, c_row0, bt_row, stride_btp,
                          c_ptr, cr_ptr, stride_c, stride_cr, PAGED, PAGE_SIZE, STAGES, GATHER)
                    if TRACE:
                        _stamp(TR, tr_on, 1, t, 3)
        if TRACE:
            _stamp(TR, tr_on, 3, 1 + C, 2)
        l_fin = gl.zeros([64], gl.float32, layout=row_o)
        if n_tiles > 0:  # published with the last P, which this warpgroup has waited for
            l_fin = l_smem.index((n_tiles - 1) % 2).load(row_o)
        o = acc * (1.0 / gl.where(l_fin == 0.0, 1.0, l_fin))[:, None]
        o_r = gl.arange(0, 64, layout=row_o)
        o_d = C * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = O + (o_row0 + o_r.to(gl.int64))[:, None] * 512 + o_d[None, :]
        if ROWS < 64:  # SMALL_HEADS: only this sequence's H rows are stored
            gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(o_r < ROWS)[:, None])
        else:
            gl.store(o_ptrs, o.to(O.dtype.element_ty))
        if TRACE:
            _stamp(TR, tr_on, 3, 1 + C, 3)

    @gluon.jit
    def _pv_sd0(ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem, q_bar, ready, empty,
                p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles, o_row0,
                PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, TR=None, tr_on=False,
                TRACE: gl.constexpr = False, c_ptr=None, cr_ptr=None, stride_c=0, stride_cr=0,
                GATHER: gl.constexpr = False, ROWS: gl.constexpr = 64):
        _pv_sd(0, ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem, q_bar, ready,
               empty, p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles, o_row0, PAGED,
               PAGE_SIZE, STAGES, TR, tr_on, TRACE, c_ptr, cr_ptr, stride_c, stride_cr, GATHER, ROWS)

    @gluon.jit
    def _pv_sd1(ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem, q_bar, ready, empty,
                p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles, o_row0,
                PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, TR=None, tr_on=False,
                TRACE: gl.constexpr = False, c_ptr=None, cr_ptr=None, stride_c=0, stride_cr=0,
                GATHER: gl.constexpr = False, ROWS: gl.constexpr = 64):
        _pv_sd(1, ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem, q_bar, ready,
               empty, p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles, o_row0, PAGED,
               PAGE_SIZE, STAGES, TR, tr_on, TRACE, c_ptr, cr_ptr, stride_c, stride_cr, GATHER, ROWS)

    @gluon.jit
    def _mla_decode_s1(ql_desc, qr_desc, c_desc, cr_desc, SEQ_LENS, BT, O, LSE, qk_scale, H, N, B, num_splits,
                       stride_btb, stride_btp, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr, TR=None, TRACE: gl.constexpr = False,
                       PV_FIRST: gl.constexpr = 0, DEDICATED: gl.constexpr = 0, c_ptr=None, cr_ptr=None, stride_c=0,
                       stride_cr=0, GATHER: gl.constexpr = False, ROWS: gl.constexpr = 64):
        lo, length, n_tiles, q_row0, c_row0, bt_row, o_row0 = _program_rows(SEQ_LENS, BT, H, N, B, num_splits,
                                                                             stride_btb)
        dtype: gl.constexpr = ql_desc.dtype
        qa = gl.allocate_shared_memory(dtype, [64, 256], ql_desc.layout)
        qb = gl.allocate_shared_memory(dtype, [64, 256], ql_desc.layout)
        qr = gl.allocate_shared_memory(dtype, [64, 64], qr_desc.layout)
        ka = gl.allocate_shared_memory(dtype, [STAGES, 64, 256], c_desc.layout)
        kb = gl.allocate_shared_memory(dtype, [STAGES, 64, 256], c_desc.layout)
        kr = gl.allocate_shared_memory(dtype, [STAGES, 64, 64], cr_desc.layout)
        p_smem = gl.allocate_shared_memory(dtype, [64, 64], qr_desc.layout)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_smem = gl.allocate_shared_memory(gl.float32, [2, 64], vec_layout)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, 64], vec_layout)
        a_smem = gl.allocate_shared_memory(gl.float32, [2, 64], vec_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=2)
        for i in gl.static_range(STAGES):
            if GATHER:  # the loading warpgroup's 128 threads each arrive when their cp.asyncs land
                mbarrier.init(ready.index(i), count=128)
            else:
                mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        # TRACE: program (0, 0, 0) stamps its tile loop (scripts/trace_mla_decode.py)
        tr_on = (gl.program_id(0) == 0) & (gl.program_id(1) == 0) & (gl.program_id(2) == 0)
        if DEDICATED > 0:
            # (the partitions' arguments are written out: a tuple variable would turn the constexprs into ints)
            gl.warp_specialize([
                (_scorer_sd, (qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, p_ready, p_free, q_bar,
                              LSE, qk_scale, length, n_tiles, o_row0, STAGES, DEDICATED == 2, TR, tr_on, TRACE,
                              DEDICATED == 3, GATHER, ROWS)),
                (_pv_sd0, (ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem, q_bar,
                           ready, empty, p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles,
                           o_row0, PAGED, PAGE_SIZE, STAGES, TR, tr_on, TRACE, c_ptr, cr_ptr, stride_c, stride_cr,
                           GATHER, ROWS)),
                (_pv_sd1, (ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, p_smem, l_smem, a_smem, q_bar,
                           ready, empty, p_ready, p_free, O, q_row0, c_row0, lo, bt_row, stride_btp, length, n_tiles,
                           o_row0, PAGED, PAGE_SIZE, STAGES, TR, tr_on, TRACE, c_ptr, cr_ptr, stride_c, stride_cr,
                           GATHER, ROWS)),
            ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
        else:
            gl.warp_specialize([
                (_consumer0_s1, (qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready, p_free,
                                 q_bar, O, LSE, qk_scale, length, n_tiles, o_row0, STAGES, TR, tr_on, TRACE, PV_FIRST)),
                (_consumer1_s1, (qa, qb, qr, ka, kb, kr, p_smem, m_smem, l_smem, a_smem, ready, empty, p_ready, p_free,
                                 q_bar, O, LSE, qk_scale, length, n_tiles, o_row0, STAGES, TR, tr_on, TRACE, PV_FIRST)),
                (_producer, (ql_desc, qr_desc, c_desc, cr_desc, qa, qb, qr, ka, kb, kr, q_bar, ready, empty, q_row0,
                             c_row0, lo, bt_row, stride_btp, n_tiles, PAGED, PAGE_SIZE, STAGES, TR, tr_on, TRACE)),
            ], [4, 1], [CONSUMER_REGS, 24])


def _rows(t: torch.Tensor):
    """A [R0, R1, D] view as a 2-D [R0 * R1, D] TMA source without a copy, or None if its rows are not
    evenly spaced, its rows not 16-byte aligned, or its last dim not unit-stride."""
    r0, r1, d = t.shape
    es = t.element_size()
    if t.stride(-1) != 1 or (r0 > 1 and t.stride(0) != r1 * t.stride(1)) or (t.stride(1) * es) % 16 \
            or t.data_ptr() % 16:
        return None
    return t.as_strided((r0 * r1, d), (t.stride(1), 1))


_HOPPER: dict = {}


def _is_hopper(device: torch.device) -> bool:
    if device not in _HOPPER:  # eager decode pays for every host step: look the capability up once
        _HOPPER[device] = torch.cuda.get_device_capability(device)[0] == 9
    return _HOPPER[device]


def supported(q_latent, q_rope, kv_latent, k_rope, block_table=None) -> bool:
    """Whether :func:`mla_decode_gluon` takes these inputs: Hopper, bf16/fp16, Dc = 512, Dr = 64, one new
    token, heads a multiple of 64 (or fewer than 64 with ``SMALL_HEADS``), cache rows readable by TMA in
    place, pages a multiple of 64 keys (or, with ``SMALL_PAGES`` and the dedicated scorer, of any size)."""
    if not (AVAILABLE and q_latent.is_cuda and _is_hopper(q_latent.device)):
        return False
    if not _VERSION_OK:  # a Triton these kernels were not run with (_gluon_compat)
        _warn_untested()
        return False
    if q_rope is None or k_rope is None or q_latent.dtype not in (torch.bfloat16, torch.float16):
        return False
    if any(t.dtype != q_latent.dtype for t in (q_rope, kv_latent, k_rope)):
        return False
    if q_latent.dim() == 4:
        if q_latent.shape[2] != 1:
            return False
    elif q_latent.dim() != 3:
        return False
    if q_latent.shape[-1] != DC or q_rope.shape[-1] != DR:
        return False
    if q_latent.shape[1] % BLOCK_H and not (SMALL_HEADS and q_latent.shape[1] < BLOCK_H and S_ONCE and DEDICATED):
        return False
    if kv_latent.dim() != 3 or kv_latent.shape[-1] != DC or k_rope.dim() != 3 or k_rope.shape[-1] != DR:
        return False
    if block_table is not None and kv_latent.shape[1] % BLOCK_N:
        # GATHER's 16-byte cp.asyncs need rows 16-element aligned as Triton sees integer arguments
        if not (SMALL_PAGES and S_ONCE and DEDICATED and kv_latent.stride(1) % 16 == 0 and k_rope.stride(1) % 16 == 0):
            return False
    return _rows(kv_latent) is not None and _rows(k_rope) is not None


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, el):
    """The TMA tile's shared-memory layout, built once (eager decode calls pay for every host step)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], el)


def _query_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    t2 = t.reshape(rows, t.shape[-1])
    if t2.stride(-1) != 1 or (t2.stride(0) * t2.element_size()) % 16 or t2.data_ptr() % 16:
        t2 = t2.contiguous()
        if t2.data_ptr() % 16:
            t2 = t2.clone()
    return t2


def _round_splits(splits: int, programs: int, num_sms: int) -> int:
    """More than one combine round's parts (``combine._MAX_CHUNK``, 32): up to a whole number of rounds
    if the programs still fit in one wave, else down. The combine loads 32 parts a round, and a last
    round of a few parts costs a whole round (H200, B = 1, H = 128, L = 32768, scripts/probe_mla_decode.py
    --b1 at 226f489, graph replays): 66 splits took 39.5 us (combine 7.3), 64 took 36.3 (combine 5.2).
    63 (the wave rule's pick) cuts 32768 keys into 9-tile intervals, so 57 programs do all the work;
    64 cuts them into 8."""
    from .combine import _MAX_CHUNK

    if splits <= _MAX_CHUNK:
        return splits
    up = -(-splits // _MAX_CHUNK) * _MAX_CHUNK
    return up if programs * up <= num_sms else splits // _MAX_CHUNK * _MAX_CHUNK


def plan_key(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, num_splits):
    """The key of a default-schedule call's plan: every tensor's shape, strides, dtype, device and alignment
    (what :func:`supported` and the launch decide from), the split count asked for, and the switches read."""
    return (tensor_key(q_latent), tensor_key(q_rope), tensor_key(kv_latent), tensor_key(k_rope),
            tensor_key(seq_lens), tensor_key(block_table), num_splits, S_ONCE, PV_FIRST, DEDICATED, SMALL_PAGES,
            SMALL_HEADS)


def replay(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale: float, num_splits):
    """``(o, lse)`` from the plan of an earlier call with this key, or None when there is none. A plan is
    made only for a call that :func:`supported` took, and its key fixes everything that decided that,
    so the op's router may ask here first and skip its own checks (eager batch-1 decode is host-bound)."""
    if not _fast.enabled() or q_rope is None or k_rope is None or q_latent.shape[-1] != DC:
        return None
    if q_latent.shape[1] % BLOCK_H and not SMALL_HEADS:  # no plan can exist: spare the Triton kernel's calls a key
        return None
    plan = _plans.get(plan_key(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, num_splits))
    if plan is None:
        return None
    return plan.run(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale)


def mla_decode_gluon(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale: float,
                     num_splits: int | None = None, *, stages: int = 2, consumer_regs: int = 232, maxnreg: int = 168,
                     checked: bool = False, s_once: bool | None = None, trace: torch.Tensor | None = None,
                     pv_first: int | None = None, dedicated: int | None = None):
    """Absorbed MLA decode on Hopper: q_latent [B, H, (1,) 512], q_rope [B, H, (1,) 64]; kv_latent / k_rope
    contiguous [B, N, 512] / [B, N, 64] or paged [num_pages, P, 512] / [num_pages, P, 64] with block_table
    [B, max_pages] (P a multiple of 64; any P with the dedicated scorer, gathered by cp.async), views into
    one [..., 576] buffer or not; seq_lens int32 [B] -> (o [B, H, (1,) 512] in q's dtype, lse [B, H, (1,)]
    float32). num_splits: KV intervals per sequence
    (None: ``triton_decode.choose_num_splits`` for one program per SM, then ``_round_splits``); their partials are merged by
    ``combine.combine_splits``. See the module docstring for the schedule. ``checked``: the caller has
    just called :func:`supported` on these inputs (the op's router), so it is not asked again.
    ``s_once``: the schedule that computes each score tile once (None: ``S_ONCE``, on by default); False
    runs the first schedule, where both consumers compute every score tile."""
    if not checked and not supported(q_latent, q_rope, kv_latent, k_rope, block_table):
        raise ValueError(f"mla_decode_gluon: unsupported inputs q_latent {tuple(q_latent.shape)} {q_latent.dtype}, "
                         f"kv_latent {tuple(kv_latent.shape)} {kv_latent.dtype}, "
                         f"k_rope {None if k_rope is None else tuple(k_rope.shape)}")
    from .combine import combine_splits
    from .triton_decode import _alloc, _num_sms, choose_num_splits

    defaults = (stages == 2 and consumer_regs == 232 and maxnreg == 168 and s_once is None and trace is None
                and pv_first is None and dedicated is None)
    key = None
    if defaults and _fast.enabled():
        key = plan_key(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, num_splits)
        plan = _plans.get(key)
        if plan is not None:
            return plan.run(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale)
    lead = q_latent.shape[:-1]
    b, h = q_latent.shape[0], q_latent.shape[1]
    paged = block_table is not None
    page_size = kv_latent.shape[1] if paged else 1
    n = 0 if paged else kv_latent.shape[1]
    capacity = block_table.shape[1] * page_size if paged else n
    if num_splits is None:
        sms = _num_sms(q_latent.device)
        tiles = -(-h // BLOCK_H)
        num_splits = _round_splits(choose_num_splits(b, tiles, capacity, sms, block_n=BLOCK_N), b * tiles, sms)
    o = _alloc(tuple(lead) + (DC,), dtype=q_latent.dtype, device=q_latent.device)
    lse = _alloc(tuple(lead), dtype=torch.float32, device=q_latent.device)
    if b * h == 0:
        return o, lse
    plan = _GluonPlan()
    plan.o_shape, plan.lse_shape, plan.dtype, plan.device = tuple(lead) + (DC,), tuple(lead), q_latent.dtype, q_latent.device
    plan.rows, plan.part_numel, plan.lse_offset = b * h, 0, 0
    if num_splits > 1:
        plan.part_numel, plan.lse_offset = num_splits * b * h * (DC + 1), num_splits * b * h * DC
        part = _alloc((plan.part_numel,), dtype=torch.float32, device=q_latent.device)
        o_part = part[: num_splits * b * h * DC].view(num_splits, b * h, DC)
        lse_part = part[num_splits * b * h * DC:].view(num_splits, b * h)
    else:
        o_part, lse_part = o, lse
    el = gl.bfloat16 if q_latent.dtype == torch.bfloat16 else gl.float16
    plan.el, plan.templates = el, None

    seq_lens = seq_lens.to(torch.int32).contiguous()
    bt = block_table.to(torch.int32) if paged else seq_lens  # a dummy pointer when contiguous (never read)
    bt_strides = bt.stride() if paged else (0, 0)
    kernel = _mla_decode_s1 if (S_ONCE if s_once is None else s_once) else _mla_decode_ws
    dedicated = int(DEDICATED if dedicated is None else dedicated) if kernel is _mla_decode_s1 else 0
    if dedicated:  # 12 warps: 168 registers each is what the register file holds
        consumer_regs = maxnreg = 168
    # The two variants below need the dedicated scorer; supported() checks the module defaults, this the call's.
    gather = paged and page_size % BLOCK_N != 0
    if gather and not dedicated:
        raise ValueError(f"mla_decode_gluon: pages of {page_size} keys (not a multiple of {BLOCK_N}) need the "
                         "dedicated-scorer schedule (s_once=True, dedicated >= 1)")
    if h % BLOCK_H and (h > BLOCK_H or not dedicated):
        raise ValueError(f"mla_decode_gluon: {h} heads (not a multiple of {BLOCK_H}) need fewer than {BLOCK_H} heads "
                         "and the dedicated-scorer schedule (s_once=True, dedicated >= 1)")
    # Per-call values: the four descriptors, seq_lens, the block table (or its dummy), o / lse (or the
    # partials), the score scale, and (GATHER) the two cache tensors themselves.
    extra = {"c_ptr": Slot(9), "cr_ptr": Slot(10), "stride_c": kv_latent.stride(1), "stride_cr": k_rope.stride(1),
             "GATHER": True} if gather else {}
    if h < BLOCK_H:  # SMALL_HEADS: the O / LSE stores keep the first h rows of the tile
        extra["ROWS"] = h
    plan.decode = Launch(
        kernel, (-(-h // BLOCK_H), b, num_splits),
        (Slot(0), Slot(1), Slot(2), Slot(3), Slot(4), Slot(5), Slot(6), Slot(7), Slot(8), h, n, b, num_splits,
         *bt_strides),
        dict(PAGED=paged, PAGE_SIZE=page_size, STAGES=stages, CONSUMER_REGS=consumer_regs,
             **({"TR": trace, "TRACE": True} if trace is not None else {}),
             **({"PV_FIRST": int(PV_FIRST if pv_first is None else pv_first), "DEDICATED": dedicated}
                if kernel is _mla_decode_s1 else {}), **extra),
        dict(num_warps=4, maxnreg=maxnreg),
    )
    plan.decode(*plan.descriptors(q_latent, q_rope, kv_latent, k_rope), seq_lens, bt, o_part, lse_part,
                scale * _LOG2E, kv_latent, k_rope)
    plan.combine = None
    if num_splits > 1:
        plan.combine = combine_splits(o_part, lse_part, o.view(b * h, DC), lse.view(b * h))
    if key is not None and (num_splits == 1 or isinstance(plan.combine, Launch)):
        _plans.put(key, plan)
    return o, lse


class _GluonPlan:
    """:func:`mla_decode_gluon`'s host decisions for one call key, replayed by later calls (as
    ``triton_decode._Plan``): buffers, descriptors' boxes, the kernel and merge launches."""

    __slots__ = ("o_shape", "lse_shape", "dtype", "device", "rows", "part_numel", "lse_offset", "el", "decode",
                 "combine", "templates", "copies")

    def descriptors(self, q_latent, q_rope, kv_latent, k_rope):
        """The four TMA descriptors, built by TensorDescriptor.from_tensor (which checks the layout). With
        ``REBASE_DESCRIPTORS`` later calls copy the first call's instead, with the new tensors as base: the
        plan's key fixes the shapes, strides and alignment that were checked, and the launcher reads only
        the base's data pointer."""
        if self.templates is None or not REBASE_DESCRIPTORS:
            def desc(t, rows, cols):
                return TensorDescriptor.from_tensor(t, [rows, cols], _smem_layout(rows, cols, self.el))

            ql, qr = _query_rows(q_latent, self.rows), _query_rows(q_rope, self.rows)
            self.copies = (ql.data_ptr() != q_latent.data_ptr(), qr.data_ptr() != q_rope.data_ptr())
            descs = (desc(ql, 64, 256), desc(qr, 64, 64), desc(_rows(kv_latent), 64, 256), desc(_rows(k_rope), 64, 64))
            if self.templates is None:  # kept without their tensors: a plan must not keep a freed KV cache alive
                self.templates = tuple(_rebased(d, None) for d in descs)
            return descs
        ql = _query_rows(q_latent, self.rows) if self.copies[0] else q_latent  # else a view of the same memory
        qr = _query_rows(q_rope, self.rows) if self.copies[1] else q_rope
        return tuple(_rebased(t, base) for t, base in zip(self.templates, (ql, qr, kv_latent, k_rope)))

    def run(self, q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale):
        o, lse, o_part, lse_part = plan_buffers(self)
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        bt = seq_lens if block_table is None else block_table.to(torch.int32)
        self.decode(*self.descriptors(q_latent, q_rope, kv_latent, k_rope), seq_lens, bt, o_part, lse_part,
                    scale * _LOG2E, kv_latent, k_rope)
        if self.combine is not None:
            self.combine(o_part, lse_part, o, lse, seq_lens)
        return o, lse


# Replays copy the first call's TMA descriptors instead of building new ones (_GluonPlan.descriptors).
# H100 (83b4fd0): test_gluon_mla_plan_replay passed both ways; host time of an eager B = 1, H = 128 call
# 120 -> 93 us (profile_launch.py, two rounds). On; MLA_ATTN_GLUON_MLA_REBASE=0 turns it off.
REBASE_DESCRIPTORS = _env.flag("MLA_ATTN_GLUON_MLA_REBASE", True)


# Plans by call key (see triton_decode._plans); only calls with the default schedule arguments are planned.
_plans = PlanCache()


def mla_decode_ws(q_latent, q_rope, cache, seq_lens, scale: float, **kw):
    """Unsplit by default (one program per 64 heads and sequence), as first probed: q_latent [B, H, 512],
    q_rope [B, H, 64], cache [B, N, 576] -> (o, lse)."""
    kw.setdefault("num_splits", 1)
    return mla_decode_gluon(q_latent, q_rope, cache[..., :DC], cache[..., DC:], seq_lens, None, scale, **kw)

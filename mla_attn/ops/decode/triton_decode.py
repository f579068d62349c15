"""Triton split-KV decode: one kernel for GQA / MQA / MHA and absorbed MLA, contiguous or paged caches.

Kernel -> launcher tiers (see STYLE.md). ``gqa_decode`` and ``mla_decode`` are the launchers that
``api.py`` calls after validation; both run the same ``_decode_kernel``:

* a program owns ``BLOCK_H`` query rows of one KV head (row = (head in group, new token s); for MQA and
  MLA the group is every head) and one KV interval of its sequence, so each K/V tile is loaded once
  for all of its rows;
* MLA is MQA whose score has a second (rope) block, ``K2``, and whose value is the latent tile ``K1``
  itself: the latent is read once and feeds both dot products; the accumulator is Dc wide;
* with ``num_splits > 1`` every program writes a partial ``(o, lse)`` and ``combine.py`` merges them.

The derivations (split-KV combine, absorbed MLA as MQA, the split heuristic) are in README.md here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .. import _env
from .._common import cdiv, next_pow2
from .. import _launch as _fast
from .._launch import Launch, PlanCache, Slot, tensor_key
from .._strides import _in_units, pow2_unit
from ..attention.triton_fwd import rows_aligned, split_head_dim
from .combine import _merge_rows, combine_balanced, combine_splits

_LOG2E = 1.4426950408889634
_alloc = torch.empty  # every output buffer comes from here (tests swap in a NaN-filled allocator)


@triton.jit
def _load_tile(p, m_n, m_d, MASK_N: tl.constexpr, MASK_D: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] cache tile, masked by key (m_n) and by column (m_d) only as asked, zeros where masked."""
    if MASK_N and MASK_D:
        x = tl.load(p, mask=m_n[:, None] & m_d[None, :], other=0.0)
    elif MASK_N:
        x = tl.load(p, mask=m_n[:, None], other=0.0)
    elif MASK_D:
        x = tl.load(p, mask=m_d[None, :], other=0.0)
    else:
        x = tl.load(p)
    return x


@triton.jit
def _attend(
    Q1, Q2, K1, K2, V, BLOCK_TABLE, O, LSE,
    qk_scale, GROUP,
    i_b, i_kvh, i_t,  # sequence, KV head, head tile of these rows
    i_part,  # index of the (o, lse) written along O's / LSE's first (split) axis
    seq_len, lo, hi,  # keys [lo, hi) of a sequence of seq_len
    stride_q1b, stride_q1h, stride_q1s, stride_q1d,
    stride_q2b, stride_q2h, stride_q2s, stride_q2d,
    stride_k1o, stride_k1t, stride_k1h, stride_k1d,  # o: batch (contiguous) or page (paged); t: token in it
    stride_k2o, stride_k2t, stride_k2h, stride_k2d,
    stride_vo, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btp,
    stride_op, stride_ob, stride_oh, stride_os, stride_od,  # p: split
    stride_lp, stride_lb, stride_lh, stride_ls,
    S: tl.constexpr,  # new tokens per sequence
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,  # PAGE_SIZE % BLOCK_N == 0: one page lookup per tile
    HAS_K2: tl.constexpr,  # second score block (MLA rope)
    V_IS_K1: tl.constexpr,  # value = first key block (MLA latent)
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
    UNCHAIN: tl.constexpr,  # keep the score dots from being laid out for the P @ V chain (8 warps)
    BLOCK_DV2: tl.constexpr = 0,  # > 0: the value head split, BLOCK_DV columns then a tail of these (masked to DV)
    SPLIT_TAIL: tl.constexpr = False,  # whole tiles in a loop without key masks, then the last partial tile masked
    TAIL_PIPELINED: tl.constexpr = False,  # SPLIT_TAIL: the partial tile's loop pipelined too (through shared memory)
):
    """One program's rows over one KV interval: online softmax, then (o, lse) written to part i_part."""
    i_b64 = i_b.to(tl.int64)
    # Rows of this program: r = g * S + s (g: head within the group, s: new token).
    o_r = i_t * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_r = o_r < GROUP * S
    o_g = o_r // S
    o_s = o_r % S
    o_qh = (i_kvh * GROUP + o_g).to(tl.int64)
    # New token s sees keys j < seq_len - S + 1 + s (bottom-right causal).
    row_limit = seq_len - S + 1 + o_s  # [BLOCK_H]

    o_d1 = tl.arange(0, BLOCK_D1)
    m_d1 = o_d1 < D1
    p_q1 = Q1 + i_b64 * stride_q1b + o_qh[:, None] * stride_q1h + o_s[:, None] * stride_q1s + o_d1[None, :] * stride_q1d
    b_q1 = tl.load(p_q1, mask=m_r[:, None] & m_d1[None, :], other=0.0)  # [BLOCK_H, BLOCK_D1]
    if HAS_K2:
        o_d2 = tl.arange(0, BLOCK_D2)
        m_d2 = o_d2 < D2
        p_q2 = (Q2 + i_b64 * stride_q2b + o_qh[:, None] * stride_q2h + o_s[:, None] * stride_q2s
                + o_d2[None, :] * stride_q2d)
        b_q2 = tl.load(p_q2, mask=m_r[:, None] & m_d2[None, :], other=0.0)  # [BLOCK_H, BLOCK_D2]
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < DV

    kvh64 = i_kvh.to(tl.int64)
    o_nl = tl.arange(0, BLOCK_N)
    # Loop-invariant in-tile offsets (a tile never leaves its page when TILE_IN_PAGE; int32 is ample).
    off_k1 = o_nl[:, None] * stride_k1t + o_d1[None, :] * stride_k1d  # [BLOCK_N, BLOCK_D1]
    if HAS_K2:
        off_k2 = o_nl[:, None] * stride_k2t + o_d2[None, :] * stride_k2d  # [BLOCK_N, BLOCK_D2]
    if not V_IS_K1:
        off_v = o_nl[:, None] * stride_vt + o_dv[None, :] * stride_vd  # [BLOCK_N, BLOCK_DV]
    if BLOCK_DV2 > 0:  # the value tail: columns BLOCK_DV + [0, BLOCK_DV2), masked to DV
        o_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        m_dv2 = o_dv2 < DV
        off_v2 = o_nl[:, None] * stride_vt + o_dv2[None, :] * stride_vd  # [BLOCK_N, BLOCK_DV2]
        b_acc2 = tl.zeros([BLOCK_H, BLOCK_DV2], dtype=tl.float32)
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (base 2)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum
    b_acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    if PAGED:
        # The page(s) of the next tile are loaded one iteration ahead (loop-carried), so that the K/V
        # loads do not hang off a block-table load of the same iteration: Triton's pipeliner then
        # multi-buffers them as in the contiguous case. Only tokens < hi are looked up, so entries
        # past a sequence's last page are never read.
        p_bt = BLOCK_TABLE + i_b64 * stride_btb
        if TILE_IN_PAGE:
            next_page = tl.load(p_bt + (lo // PAGE_SIZE) * stride_btp, mask=lo < hi, other=0)
        else:  # pages smaller than a tile: one table entry per token
            next_pages = tl.load(p_bt + ((lo + o_nl) // PAGE_SIZE) * stride_btp, mask=lo + o_nl < hi, other=0)
    # SPLIT_TAIL: pass 0 takes the whole tiles of [lo, hi) with no key mask, pass 1 the partial last tile, if any,
    # masked (not pipelined: it runs at most once; TAIL_PIPELINED pipelines it, so that its loads go through shared
    # memory instead of registers). Otherwise one masked pass over [lo, hi), as before SPLIT_TAIL.
    # MASK_D keeps the column masks of that one pass even where a head fills its block (the code it was timed with).
    whole_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # hi < lo: a split past the end (empty)
    MASK_D: tl.constexpr = not SPLIT_TAIL
    for MASK_N in tl.static_range(0 if SPLIT_TAIL else 1, 2):  # a constexpr per pass: 0 whole tiles, 1 masked
        if not SPLIT_TAIL:
            p_lo, p_hi = lo, hi
        elif MASK_N == 0:
            p_lo, p_hi = lo, whole_hi
        else:
            p_lo, p_hi = whole_hi, hi
        for start in tl.range(p_lo, p_hi, BLOCK_N,
                              num_stages=1 if SPLIT_TAIL and MASK_N == 1 and not TAIL_PIPELINED else None):
            o_n = start + o_nl  # [BLOCK_N] token positions
            m_n = o_n < hi  # MASK_N only
            if PAGED and not TILE_IN_PAGE:
                page = next_pages.to(tl.int64)
                o_next = o_n + BLOCK_N
                next_pages = tl.load(p_bt + (o_next // PAGE_SIZE) * stride_btp, mask=o_next < hi, other=0)
                within = (o_n % PAGE_SIZE).to(tl.int64)
                p_k1 = K1 + kvh64 * stride_k1h + (page * stride_k1o + within * stride_k1t)[:, None] + o_d1[None, :] * stride_k1d
                if HAS_K2:
                    p_k2 = (K2 + kvh64 * stride_k2h + (page * stride_k2o + within * stride_k2t)[:, None]
                            + o_d2[None, :] * stride_k2d)
                if not V_IS_K1:
                    p_v = V + kvh64 * stride_vh + (page * stride_vo + within * stride_vt)[:, None] + o_dv[None, :] * stride_vd
                if BLOCK_DV2 > 0:
                    p_v2 = (V + kvh64 * stride_vh + (page * stride_vo + within * stride_vt)[:, None]
                            + o_dv2[None, :] * stride_vd)
            else:
                if PAGED:  # the whole tile lies in one page: one block-table entry (start < hi <= seq_len)
                    page = next_page.to(tl.int64)
                    within = tl.cast(start % PAGE_SIZE, tl.int64)
                    next_page = tl.load(p_bt + ((start + BLOCK_N) // PAGE_SIZE) * stride_btp, mask=start + BLOCK_N < hi,
                                        other=0)
                else:
                    page = i_b64
                    within = tl.cast(start, tl.int64)
                p_k1 = K1 + (kvh64 * stride_k1h + page * stride_k1o + within * stride_k1t) + off_k1
                if HAS_K2:
                    p_k2 = K2 + (kvh64 * stride_k2h + page * stride_k2o + within * stride_k2t) + off_k2
                if not V_IS_K1:
                    p_v = V + (kvh64 * stride_vh + page * stride_vo + within * stride_vt) + off_v
                if BLOCK_DV2 > 0:
                    p_v2 = V + (kvh64 * stride_vh + page * stride_vo + within * stride_vt) + off_v2
            b_k1 = _load_tile(p_k1, m_n, m_d1, MASK_N, MASK_D or D1 < BLOCK_D1)  # [BLOCK_N, BLOCK_D1]
            if IEEE:
                b_s = tl.dot(b_q1, tl.trans(b_k1), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
            else:
                b_s = tl.dot(b_q1, tl.trans(b_k1))
            if HAS_K2:
                b_k2 = _load_tile(p_k2, m_n, m_d2, MASK_N, MASK_D or D2 < BLOCK_D2)  # [BLOCK_N, BLOCK_D2]
                if UNCHAIN:  # two independent dots (no accumulator chaining, no dot+add fusion): see below
                    if IEEE:
                        b_s = b_s * qk_scale + tl.dot(b_q2, tl.trans(b_k2), input_precision="ieee") * qk_scale
                    else:
                        b_s = b_s * qk_scale + tl.dot(b_q2, tl.trans(b_k2)) * qk_scale
                elif IEEE:
                    b_s = tl.dot(b_q2, tl.trans(b_k2), b_s, input_precision="ieee")
                else:
                    b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
            if not (HAS_K2 and UNCHAIN):
                b_s = b_s * qk_scale
            if S > 1 and MASK_N:
                b_s = tl.where(m_n[None, :] & (o_n[None, :] < row_limit[:, None]), b_s, float("-inf"))
            elif S > 1:  # a whole tile: every key is < hi, but the newest S - 1 may lie past a row's limit
                b_s = tl.where(o_n[None, :] < row_limit[:, None], b_s, float("-inf"))
            elif MASK_N:
                b_s = tl.where(m_n[None, :], b_s, float("-inf"))

            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # a row with nothing visible yet
            b_alpha = tl.exp2(b_m - b_m_safe)
            b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]; 0 where masked
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            if not UNCHAIN:  # rescale before the V load: paged GQA at B=128 read 4289 GB/s so, 3910 with it after
                b_acc = b_acc * b_alpha[:, None]
                if BLOCK_DV2 > 0:
                    b_acc2 = b_acc2 * b_alpha[:, None]
            if V_IS_K1:
                b_v = b_k1
            else:
                b_v = _load_tile(p_v, m_n, m_dv, MASK_N, MASK_D or DV < BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
            if BLOCK_DV2 > 0:
                b_v2 = _load_tile(p_v2, m_n, m_dv2, MASK_N, True)  # [BLOCK_N, BLOCK_DV2]
            if UNCHAIN:
                # With 8 warps Triton lays a dot out over warps by looking forward for a chained dot: the
                # score dot feeding P @ V would get all 8 warps along the rows, so both warpgroups would
                # compute the same 64-row score tile. A branch that is always taken (seq_len >= 0) ends
                # that look-ahead at its yield: the score dots split their columns over the warpgroups
                # like P @ V does, and P goes through shared memory to P @ V's operand layout.
                if seq_len >= 0:
                    b_pv = b_p.to(b_v.dtype)
                    b_acc = b_acc * b_alpha[:, None]
                    if BLOCK_DV2 > 0:
                        b_acc2 = b_acc2 * b_alpha[:, None]
                else:
                    b_pv = tl.zeros([BLOCK_H, BLOCK_N], dtype=b_v.dtype)
            else:
                b_pv = b_p.to(b_v.dtype)
            if IEEE:
                b_acc = tl.dot(b_pv, b_v, b_acc, input_precision="ieee")
                if BLOCK_DV2 > 0:
                    b_acc2 = tl.dot(b_pv, b_v2, b_acc2, input_precision="ieee")
            else:
                b_acc = tl.dot(b_pv, b_v, b_acc)
                if BLOCK_DV2 > 0:
                    b_acc2 = tl.dot(b_pv, b_v2, b_acc2)
            b_m = b_m_new

    # Rows with no visible key have l = 0 and acc = 0 exactly: o = 0, lse = -inf. The test is
    # "l == 0", not "l > 0", so that a NaN read from the cache stays NaN instead of passing as empty.
    dead = b_l == 0.0
    b_o = b_acc / tl.where(dead, 1.0, b_l)[:, None]
    b_lse = tl.where(dead, float("-inf"), (b_m + tl.log2(tl.where(dead, 1.0, b_l))) * 0.6931471805599453)

    split64 = i_part.to(tl.int64)
    p_o = (O + split64 * stride_op + i_b64 * stride_ob + o_qh[:, None] * stride_oh + o_s[:, None] * stride_os
           + o_dv[None, :] * stride_od)
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    if BLOCK_DV2 > 0:
        b_o2 = b_acc2 / tl.where(dead, 1.0, b_l)[:, None]
        p_o2 = (O + split64 * stride_op + i_b64 * stride_ob + o_qh[:, None] * stride_oh + o_s[:, None] * stride_os
                + o_dv2[None, :] * stride_od)
        tl.store(p_o2, b_o2.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv2[None, :])
    p_lse = LSE + split64 * stride_lp + i_b64 * stride_lb + o_qh * stride_lh + o_s * stride_ls
    tl.store(p_lse, b_lse, mask=m_r)




@triton.jit
def _decode_kernel(
    Q1, Q2, K1, K2, V, SEQ_LENS, BLOCK_TABLE, O, LSE,
    OF, LSEF, TICKETS,  # FUSED: the final o [B, H, S, DV] and lse [B, H, S] (contiguous), int32 tickets
    qk_scale,  # scale * log2(e): scores are kept in base 2
    num_kv_heads, num_splits,
    GROUP, NUM_HEAD_TILES,  # query heads per KV head; row tiles per KV head (runtime: fewer recompiles)
    batch,  # sequences (BALANCED reads all their lengths)
    stride_q1b, stride_q1h, stride_q1s, stride_q1d,
    stride_q2b, stride_q2h, stride_q2s, stride_q2d,
    stride_k1o, stride_k1t, stride_k1h, stride_k1d,  # o: batch (contiguous) or page (paged); t: token in it
    stride_k2o, stride_k2t, stride_k2h, stride_k2d,
    stride_vo, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btp,
    stride_op, stride_ob, stride_oh, stride_os, stride_od,  # p: split
    stride_lp, stride_lb, stride_lh, stride_ls,
    S: tl.constexpr,  # new tokens per sequence
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,  # PAGE_SIZE % BLOCK_N == 0: one page lookup per tile
    HAS_K2: tl.constexpr,  # second score block (MLA rope)
    V_IS_K1: tl.constexpr,  # value = first key block (MLA latent)
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
    UNCHAIN: tl.constexpr,  # keep the score dots from being laid out for the P @ V chain (8 warps)
    BALANCED: tl.constexpr,  # axis 1 = workers sharing the batch's key tiles equally (README.md here)
    MAX_B: tl.constexpr,  # BALANCED: a power of two >= batch
    FUSED: tl.constexpr = False,  # the last split of each row tile to finish merges them (no combine launch)
    MERGE_ROWS: tl.constexpr = 1,  # FUSED: a power of two >= the tile's live rows, <= BLOCK_H
    MERGE_CHUNK: tl.constexpr = 1,  # FUSED: parts merged per step
    STRIDE_UNIT: tl.constexpr = 1,  # the leading strides of q, the cache and o came divided by it (_stride_unit)
    BLOCK_DV2: tl.constexpr = 0,  # the value head's tail (GQA widths such as 72 = 64 + 16; _head_split)
    MERGE_DV: tl.constexpr = 1,  # FUSED: the merge's width (a power of two >= DV; BLOCK_DV unless the value is split)
    KV_MAJOR: tl.constexpr = False,  # rows ordered (kv head, b, head tile), not (b, kv head, head tile): KV_MAJOR below
    SPLIT_TAIL: tl.constexpr = False,  # _attend's key masks on the partial last tile only: _split_tail below
    TAIL_PIPELINED: tl.constexpr = False,  # SPLIT_TAIL's partial tile pipelined: TAIL_PIPELINED below
):
    if STRIDE_UNIT != 1:  # multiplied back: Triton now knows a d 72 row's addresses are 16-byte aligned
        stride_q1b, stride_q1h, stride_q1s = _in_units(stride_q1b, stride_q1h, stride_q1s, STRIDE_UNIT)
        stride_q2b, stride_q2h, stride_q2s = _in_units(stride_q2b, stride_q2h, stride_q2s, STRIDE_UNIT)
        stride_k1o, stride_k1t, stride_k1h = _in_units(stride_k1o, stride_k1t, stride_k1h, STRIDE_UNIT)
        stride_k2o, stride_k2t, stride_k2h = _in_units(stride_k2o, stride_k2t, stride_k2h, STRIDE_UNIT)
        stride_vo, stride_vt, stride_vh = _in_units(stride_vo, stride_vt, stride_vh, STRIDE_UNIT)
        stride_op, stride_ob, stride_oh = _in_units(stride_op, stride_ob, stride_oh, STRIDE_UNIT)
        stride_os = stride_os * STRIDE_UNIT
    pid_row = tl.program_id(0)  # (b, kv head, head tile), head tiles of one KV head adjacent; BALANCED: b = 0
    pid_split = tl.program_id(1)  # split of the sequence; BALANCED: worker
    i_t = pid_row % NUM_HEAD_TILES
    i_bk = pid_row // NUM_HEAD_TILES
    if KV_MAJOR:  # i_bk = kv head * batch + b (never BALANCED)
        i_kvh = i_bk // batch
    else:
        i_kvh = i_bk % num_kv_heads
    if BALANCED:
        # The batch's key tiles (each sequence cut into BLOCK_N-key tiles, in batch order) are dealt
        # to num_splits workers in equal runs: worker w takes tiles [ceil(w T / W), ceil((w+1) T / W)).
        # A run may cross sequences: each piece is a part of its sequence, written at slot b + w (unique,
        # since a later worker never returns to an earlier sequence). combine.py finds the slots of b
        # from the same arithmetic. No host sync: lengths are read here, on the device.
        o_bb = tl.arange(0, MAX_B)
        n_tiles = tl.cdiv(tl.load(SEQ_LENS + o_bb, mask=o_bb < batch, other=0), BLOCK_N)
        total = tl.sum(n_tiles, 0).to(tl.int64)
        w64 = pid_split.to(tl.int64)
        t = ((w64 * total + num_splits - 1) // num_splits).to(tl.int32)
        t_end = (((w64 + 1) * total + num_splits - 1) // num_splits).to(tl.int32)
        incl = tl.cumsum(n_tiles, 0)
        i_b = tl.sum(((incl <= t) & (o_bb < batch)).to(tl.int32), 0)  # the sequence holding tile t
        excl = tl.sum(tl.where(o_bb < i_b, n_tiles, 0), 0)  # tiles before it
        while t < t_end:
            seq_len = tl.load(SEQ_LENS + i_b)
            nt = tl.cdiv(seq_len, BLOCK_N)
            seg_end = tl.minimum(t_end, excl + nt)
            if seg_end > t:
                lo = (t - excl) * BLOCK_N
                hi = tl.minimum((seg_end - excl) * BLOCK_N, seq_len)
                _attend(Q1, Q2, K1, K2, V, BLOCK_TABLE, O, LSE, qk_scale, GROUP, i_b, i_kvh, i_t, i_b + pid_split,
                        seq_len, lo, hi,
                        stride_q1b, stride_q1h, stride_q1s, stride_q1d, stride_q2b, stride_q2h, stride_q2s, stride_q2d,
                        stride_k1o, stride_k1t, stride_k1h, stride_k1d, stride_k2o, stride_k2t, stride_k2h, stride_k2d,
                        stride_vo, stride_vt, stride_vh, stride_vd, stride_btb, stride_btp,
                        stride_op, stride_ob, stride_oh, stride_os, stride_od, stride_lp, stride_lb, stride_lh, stride_ls,
                        S=S, D1=D1, D2=D2, DV=DV, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2, BLOCK_DV=BLOCK_DV,
                        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, TILE_IN_PAGE=TILE_IN_PAGE,
                        HAS_K2=HAS_K2, V_IS_K1=V_IS_K1, IEEE=IEEE, UNCHAIN=UNCHAIN, BLOCK_DV2=BLOCK_DV2,
                        SPLIT_TAIL=SPLIT_TAIL, TAIL_PIPELINED=TAIL_PIPELINED)
            t = seg_end
            excl += nt
            i_b += 1
    else:
        if KV_MAJOR:
            i_b = i_bk % batch
        else:
            i_b = i_bk // num_kv_heads
        seq_len = tl.load(SEQ_LENS + i_b)
        # KV interval: seq_len cut into num_splits pieces, each a whole number of BLOCK_N tiles.
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = pid_split * split_len
        hi = tl.minimum(lo + split_len, seq_len)
        _attend(Q1, Q2, K1, K2, V, BLOCK_TABLE, O, LSE, qk_scale, GROUP, i_b, i_kvh, i_t, pid_split,
                seq_len, lo, hi,
                stride_q1b, stride_q1h, stride_q1s, stride_q1d, stride_q2b, stride_q2h, stride_q2s, stride_q2d,
                stride_k1o, stride_k1t, stride_k1h, stride_k1d, stride_k2o, stride_k2t, stride_k2h, stride_k2d,
                stride_vo, stride_vt, stride_vh, stride_vd, stride_btb, stride_btp,
                stride_op, stride_ob, stride_oh, stride_os, stride_od, stride_lp, stride_lb, stride_lh, stride_ls,
                S=S, D1=D1, D2=D2, DV=DV, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2, BLOCK_DV=BLOCK_DV,
                BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, TILE_IN_PAGE=TILE_IN_PAGE,
                HAS_K2=HAS_K2, V_IS_K1=V_IS_K1, IEEE=IEEE, UNCHAIN=UNCHAIN, BLOCK_DV2=BLOCK_DV2,
                SPLIT_TAIL=SPLIT_TAIL, TAIL_PIPELINED=TAIL_PIPELINED)
        if FUSED:
            # Split-K ticket: each split of this row tile takes one after storing its partial. The
            # barrier orders every warp's stores before the ticket; acq_rel at GPU scope makes them
            # visible to whoever takes a later ticket, and the last taker sees them all. It merges
            # the parts in one pass (MERGE_CHUNK at a time, loads straight from L2) and puts the
            # counter back to 0 for the next call. Rows are (b, head, s) flattened: the partials
            # and the outputs are contiguous, so this tile's rows are consecutive.
            tl.debug_barrier()
            ticket = tl.atomic_add(TICKETS + pid_row, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                tl.atomic_xchg(TICKETS + pid_row, 0, sem="relaxed", scope="gpu")
                o_rl = i_t * BLOCK_H + tl.arange(0, MERGE_ROWS)  # rows of this tile within the KV head
                o_r = (i_b.to(tl.int64) * num_kv_heads + i_kvh) * GROUP * S + o_rl
                o_d = tl.arange(0, MERGE_DV)  # whole rows, whether or not the value head was split
                _merge_rows(O, LSE, OF, LSEF, o_r, o_r, o_rl < GROUP * S, o_d, o_d < DV, 0, num_splits, 0, 0,
                            num_splits, stride_op, stride_os, stride_od, stride_lp, stride_ls, DV, 1, 1, True,
                            BLOCK_R=MERGE_ROWS, BLOCK_DV=MERGE_DV, CHUNK=MERGE_CHUNK, BALANCED=False, CACHE=".cg")


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and launch parameters of ``_decode_kernel``."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1  # how many programs one SM is expected to hold (for the split heuristic)
    unchain: bool | None = None  # UNCHAIN in the kernel; None: when the rows span two warpgroups (8 warps)


_NUM_SMS: dict[int, int] = {}
# MLA_ATTN_STRIDE_UNITS=0 passes every stride as it is (_stride_unit gives 1): for A/B timing only.
STRIDE_UNITS = _env.flag("MLA_ATTN_STRIDE_UNITS", True)


# The GQA head split (_head_split), on by default since it ran on the H200 (session 31, d4f0737: 29 of 29 decode GPU
# tests with it on and off at d 72 / 80 / 96; docs/raw/bench_decode_odd_widths_d4f0737_h200.md). MLA_ATTN_DECODE_SPLIT=0
# turns it off. It is taken only where the split tiles fill at most SPLIT_MAX_FILL of the padded one: at 72 and 80
# (0.625 of 128) it gained 1.14-1.26x at B 32 contiguous and 1.05-1.06x paged 64, and tied at B 1; at 96 (0.75) it
# was 0.98-1.03x of the padded head, so 96 (and 40 / 48, also 0.75) stay padded.
HEAD_SPLIT = _env.flag("MLA_ATTN_DECODE_SPLIT", True)
SPLIT_MAX_FILL = 0.625


def _head_split(d: int, *tensors) -> tuple[int, int]:
    """(main, tail) tile widths for a GQA head of width d: split like the flash kernels' heads (72 = 64 + 16,
    80 = 64 + 16, 160 = 128 + 32) where the two tiles fill at most SPLIT_MAX_FILL of d's power of two, else (that
    power of two, 0). 96 = 64 + 32 and 40 / 48 = 32 + 16 fill 0.75: padded unless SPLIT_MAX_FILL is raised.

    A d 72 tile padded to 128 columns holds 56% useful bytes, so fewer bytes are in flight per stage than at
    d 128: 2834 GB/s padded against 3558 split at B 32 on the H200 (SDPA 3576). Only for 16-byte-aligned rows:
    with element-wide loads Triton 3.6 miscompiled the flash forward's value split for sm_90 (session 29). Aligned
    rows have strides that are multiples of 16 bytes, which _stride_unit makes known to Triton; with STRIDE_UNITS
    off (A/B timing) they would look unaligned again, so the split is off with it."""
    full = max(16, next_pow2(d))
    if not (HEAD_SPLIT and STRIDE_UNITS):  # the eager decode step's host path: nothing more to compute
        return full, 0
    main, tail = split_head_dim(d)
    if tail and main + tail < full and main + tail <= SPLIT_MAX_FILL * full and rows_aligned(*tensors):
        return main, tail
    return full, 0


def _value_tiles(d_v: int, tiles, block_h: int, num_warps: int) -> tuple[int, int]:
    """(BLOCK_DV, BLOCK_DV2) for a value head that ``_head_split`` split into ``tiles`` (None: not split), under a
    config of ``block_h`` rows and ``num_warps`` warps: the tail widened so that the warps laid along the
    columns (those the rows cannot take, 16 rows a warp) each get 8 of them, else the head padded whole.

    The score and P @ V dots share one MMA layout. A 16-wide tail with 16 rows and 4 warps cannot go 4 ways
    along its columns, so Triton put all 4 warps along the rows, for every dot: each warp computed the same
    16 rows (sm_90a, d 72: 255 registers and spills, against 183 and none padded; scripts/compile_sm90.py)."""
    full = _pow2(d_v)
    if not tiles:
        return full, 0
    main, tail = tiles
    warps_n = max(1, num_warps // max(1, block_h // 16))
    tail = max(tail, 8 * warps_n)
    return (main, tail) if main + tail < full else (full, 0)


def _stride_unit(*strides) -> int:
    """What ``_launch`` divides the leading strides of q, the cache and o by, the kernel multiplying them back
    (``STRIDE_UNIT``; see ops/_strides.py): 1 unless a head width such as 72 makes rows of a number of elements
    that is not a multiple of 16. Then Triton took the cache's rows as unaligned and compiled every load
    element-wide (sm_90a at d 72: no cp.async, 7 KB of spills; scripts/compile_sm90.py decode --gqa)."""
    if not STRIDE_UNITS:
        return 1
    return pow2_unit(x for st in strides for x in st[:-1])
# Balanced split (BALANCED in the kernel): when num_splits is None, the programs along axis 1 share the
# batch's key tiles equally, crossing sequence boundaries, instead of each taking 1/num_splits of one
# sequence. True / False force it; None = the measured rule in _use_balanced.
BALANCE: bool | None = None


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number exercises the heuristic
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


@functools.lru_cache(maxsize=1024)
def choose_num_splits(batch: int, head_tiles: int, max_seq_len_hint: int, num_sms: int, *,
                      block_n: int = 64, ctas_per_sm: int = 1, min_tiles_per_split: int = 4,
                      max_splits: int = 128) -> int:
    """Split count for split-KV decode from shapes alone (never from seq_lens values: graph-capturable).

    ``batch * head_tiles`` programs exist without splitting. Splitting multiplies them; we pick the
    smallest split count whose last wave fills at least 95% of the best fill any allowed count
    reaches, where a wave is ``num_sms * ctas_per_sm`` programs. Each split keeps at least
    ``min_tiles_per_split`` tiles of ``block_n`` keys of the longest possible sequence
    (``max_seq_len_hint``, the cache capacity), so short caches are not over-split.

    Once the batch alone fills a wave, nothing is split. GQA at B=32 (256 programs, about two uneven
    waves) and B=128, split 2-4 ways, was 1.5-4% slower than unsplit on the H100 (2026-12-05,
    ``sweep_tiles.py --only ab-gqa-splits``): the partials and their merge cost more than the tail saved.
    """
    base = batch * head_tiles
    if base <= 0 or max_seq_len_hint <= 0:
        return 1
    slots = max(1, num_sms * ctas_per_sm)
    if base >= slots:
        return 1
    cap = max(1, min(max_splits, math.ceil(max_seq_len_hint / (block_n * min_tiles_per_split))))

    def fill(s: int) -> float:
        waves = base * s / slots
        return waves / math.ceil(waves)

    best = max(fill(s) for s in range(1, cap + 1))
    for s in range(1, cap + 1):
        if fill(s) >= 0.95 * best:
            return s
    return 1


def _use_balanced(mla: bool, rows: int, batch: int, columns: int, slots: int) -> bool:
    """Whether a decode call with num_splits=None runs balanced (see BALANCE).

    Measured on the H200 (2026-12-03, bench_decode.py --balance-variants, varlen lengths in [3L/4, L],
    graph replays): MLA H=128 B=128 L=8192 1083 -> 1204 GB/s (262 -> 291 TFLOP/s), paged 1062 -> 1186;
    B=64 L=4096 +0.5% / +1.6%. Where the per-sequence split already fills the GPU with one wave or
    less it lost: MLA H=128 B=16 1022 -> 784, B=1 740 -> 477, MLA H=16 B=64/128 -8 to -23%, GQA -1
    to -9% (the memory-bound tiles lose more per sequence boundary than they gain from balance). So:
    the compute-bound MLA tiles (more than 32 rows), once the batch alone has about a wave of programs.
    """
    if BALANCE is not None:
        return BALANCE
    return mla and rows > 32 and batch * columns * 10 >= slots * 9


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, next_pow2(x))


@functools.lru_cache(maxsize=256)
def default_config(rows: int, d_qk: int, d_v: int, dtype: torch.dtype, *, mla: bool, device: torch.device) -> DecodeConfig:
    """Tile shapes per problem class, timed on an H200 as CUDA-graph replays (scripts/sweep_tiles.py;
    docs/benchmarks.md). fp32 tiles hold twice the bytes: they get half the keys per tile."""
    if device.type != "cuda":  # the interpreter: big tiles, few iterations
        return DecodeConfig(block_h=min(_pow2(rows), 64), block_n=32, num_warps=4, num_stages=1)
    wide = dtype == torch.float32
    if mla:
        if rows > 32:
            # Two warpgroups over 64 rows, UNCHAIN (each computes half the score columns instead of
            # both the whole tile), 32-key tiles four deep: 1012 GB/s (245 TFLOP/s) at B=64 H=128
            # L=4096 paged, 903 at B=16, 679 at B=1, against 990 / 838 / 595 for the chained 64-key
            # two-stage tiles (sweep_tiles.py, 2026-12-03). fp32 falls back to fewer stages.
            return DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=4, unchain=True)
        if rows > 16:
            return DecodeConfig(block_h=32, block_n=32, num_warps=4, num_stages=2 if wide else 3)
        # Memory-bound (H <= 16): 64-key tiles, three stages in flight, one program per SM: 3400 GB/s
        # at B=128 H=16 L=4096 against 2570 for the earlier 32-key, two-per-SM tiles.
        return DecodeConfig(block_h=16, block_n=32 if wide else 64, num_warps=4, num_stages=3, ctas_per_sm=1)
    if max(d_qk, d_v) <= 128:
        # One program per SM for the split heuristic: at B=1 it picks 16 splits (2690 GB/s) where
        # counting two per SM picked 33 (2470 GB/s); large batches do not split either way.
        return DecodeConfig(block_h=min(_pow2(rows), 64), block_n=64 if wide else 128, num_warps=4, num_stages=3,
                            ctas_per_sm=1)
    return DecodeConfig(block_h=min(_pow2(rows), 64), block_n=16 if wide else 32, num_warps=4, num_stages=3,
                        ctas_per_sm=2)


def _paged_gqa_wide(mla: bool, paged: bool, page_size: int, cfg: DecodeConfig, programs: int,
                    device: torch.device) -> bool:
    """Whether a GQA call over pages of 64 keys, with a program for every SM before any split, gets the
    default tile with 8 warps instead of 4. H200 (sweep_tiles.py --only gqa-batch / ab-gqa-paged,
    docs/raw/ab_gqa_paged_3e0264f.txt, three alternating rounds): B=128 64/8 L=4096 paged 64 4306-4308
    against 4197-4208 GB/s as a lone graph, 4365-4376 against 4272-4277 per step of an 8-layer graph
    (+2.3-2.6%); B=32 32/8 L=8192 +0.2-0.6%. Contiguous caches lost 0.2-0.3% with 8 warps, and batch 1
    (split) lost 5% per 8-layer step (session 11), so they keep 4. Other page sizes were not timed."""
    return (not mla and paged and page_size == 64 and device.type == "cuda" and cfg.num_warps == 4
            and cfg.block_n == 128 and programs >= _num_sms(device))


try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - very old triton
    OutOfResources = RuntimeError

_fitted: dict = {}  # (kernel key) -> the config that compiled, when the first choice did not fit


def _smaller(cfg: DecodeConfig):
    """Configs to try after ``cfg`` ran out of shared memory or registers: fewer stages, then fewer keys."""
    stages, block_n = cfg.num_stages, cfg.block_n
    while stages > 1 or block_n > 16:
        if stages > 1:
            stages -= 1
        else:
            block_n //= 2
        yield DecodeConfig(cfg.block_h, block_n, cfg.num_warps, stages, cfg.ctas_per_sm, cfg.unchain)


# Tiles across pages (PAGE_SPAN; experimental, off): a GQA tile keeps its keys over pages of 16 or more that are
# smaller than it, looking up a page per key (the path pages under 16 keys take) instead of becoming one page. For
# the narrow heads: over pages of 64 a d 72 stage holds 20 KB against 32 KB at d 128, and paged 64 read 0.74-0.84
# of SDPA at d 72 / 80 on the H200 where d 128 read 0.98-1.00 (session 31). `bench_decode.py --paged-stages`
# times it; MLA_ATTN_DECODE_PAGE_SPAN=1 turns it on. H100 (e593a4d, session 33; its GPU tests pass), paged 64, graph
# replays, GB/s: B 32 L 8192 d 72 2031 against 2236 off, d 80 2505 against 2438, d 128 2889 against 2905; B 1 L 32768
# within 1% at 72 / 80 and 4% behind at 128. It gains only at d 80, B 32, so it stays off (the H200 has not timed it).
PAGE_SPAN = _env.flag("MLA_ATTN_DECODE_PAGE_SPAN", False)


def _tile_keys(block_n: int, paged: bool, page_size: int, span: bool = False) -> int:
    """Keys per tile: a page of 16 or more keys smaller than the tile becomes the tile, so that a tile
    never leaves its page (one block-table lookup per tile), unless ``span`` (PAGE_SPAN, GQA): then the tile
    keeps its keys and looks up a page per key."""
    if paged and 16 <= page_size < block_n and page_size & (page_size - 1) == 0 and not span:
        return page_size
    return block_n


# Fused merge (FUSED in the kernel; experimental, off): with a per-sequence split, the last split of
# each row tile to finish merges the tile's parts itself, so no combine kernel is launched. Taken when a
# step of the merge fits FUSE_STEP values ([parts, rows, Dv] in registers after the main loop) and the
# whole merge is at most FUSE_MAX_STEPS such steps: GQA (a group's few rows x 128) and MLA at H <= 16
# (16 x 512). The H = 128 tiles (64 x 512 a part, dozens of parts at batch 1) never take it.
# On the H200 (84c94df, docs/raw/bench_decode_fused_84c94df.md, per step of an 8-layer graph) it lost
# where it matters: GQA B=1 L=32768 39.7-39.8 us against 38.2 with the combine launch, MLA H=16 B=64
# paged 64 147.2-148.3 against 145.8-146.1; it won 1% at MLA H=16 B=64 contiguous (139.8 vs 140.5).
# The ticket's release, its round trip and the merge's loads sit on the critical path of the last
# split, and cost more than the combine launch they replace. MLA_ATTN_FUSED_MERGE=1 turns it on.
FUSED_MERGE = _env.flag("MLA_ATTN_FUSED_MERGE", False)
FUSE_STEP = 8192
FUSE_MAX_STEPS = 4
_TICKET_SLOTS = 1 << 16
_tickets: dict = {}

# Program order (KV_MAJOR in the kernel; experimental, off): GQA rows ordered KV head first, so the programs of one
# wave take every sequence of a few KV heads instead of every KV head of a few sequences. Each program still reads
# its own 2 * L * d of cache; only which programs run together changes. scripts/probe_gqa_decode.py's minimal kernel
# read 0.9993 of SDPA this way against 0.9973 at B 32, 32/8, L 8192, and 1.0074 against 1.0087 at B 128, 64/8,
# L 4096 (H100, 7d99f3b, three rounds each, ranges apart; docs/raw/probe_gqa_decode_7d99f3b_h100.md).
# In gqa_decode itself it did not carry over (H100, 77e6851, five rounds; docs/raw/probe_gqa_decode_77e6851_h100.md):
# 354.4 us against 354.5 at B 32 (ranges overlapping) and 691.0 against 689.6 at B 128 (0.2% slower), so it stays
# off. MLA_ATTN_DECODE_KV_MAJOR=1 turns it on; the probe times gqa_decode both ways.
KV_MAJOR = _env.flag("MLA_ATTN_DECODE_KV_MAJOR", False)

# Key masks on the last partial tile only (SPLIT_TAIL in the kernel): the whole tiles of a KV interval run in a loop
# with no per-key mask and no -inf select, then the partial tile, if any, once with them (not pipelined: its loads
# go through registers). scripts/probe_gqa_decode.py's minimal kernel with every tile masked ran as slowly as
# gqa_decode (354.7 us at B 32, against 353.7 unmasked; H100, 96b01eb), and gqa_decode this way gained 0.6 us at
# B 32 and 1.0 at B 128, ranges apart (docs/raw/probe_gqa_decode_96b01eb_h100.md). Over the rows
# (bench_decode.py --tail-variants, H100, 78e833b; docs/raw/bench_decode_tail_78e833b_h100.md) it won only on
# contiguous GQA caches: 0.6% at B 1, 0.2% at B 32; paged 64 lost 0.4-1.3%, pages of 1 won at B 32 and lost at B 1,
# and MLA H 16 lost 3-8% (its 64 x 576 tail tile through registers spills: 164 / 320 bytes at sm_90a, none without
# SPLIT_TAIL; scripts/compile_sm90.py decode 16,64,4,3 --paged --split-tail). Why paged GQA loses is not known (no
# spills there). So None, the default, takes it for contiguous GQA caches, and, under TAIL_PIPELINED's rule (None,
# not yet the default), for MLA over whole-page tiles with the partial tile pipelined (which removes the spills);
# True / False force it everywhere / nowhere (MLA_ATTN_DECODE_SPLIT_TAIL=1 / 0), for A/B timing.
SPLIT_TAIL = _env.tristate("MLA_ATTN_DECODE_SPLIT_TAIL", None)

# Where SPLIT_TAIL is taken, the partial tile's loop pipelined like the whole tiles' (its K / V through shared
# memory by cp.async) instead of loaded into registers. At sm_90a (Triton 3.6) it takes MLA 16 x 64 from 164 / 320
# bytes of spills to 12 / 20 paged and none contiguous, in the same 164 KB of shared memory (the two loops' buffers
# are shared). On an H100 (97b687c, docs/raw/bench_decode_tailpipe_97b687c_h100.md; graph replays) MLA H 16 over
# pages of 64, one page a tile, ran 1.0-1.4% faster than every tile masked (198.7 against 201.4 us at B 128, 203.6
# against 205.7 at B 64), contiguous MLA tied, and it lost over pages of 1 (4-5%) and in GQA (B 32: 0.3%
# contiguous, 1.3% paged 64). So None (MLA_ATTN_DECODE_TAIL_PIPELINED=auto) takes SPLIT_TAIL with TAIL_PIPELINED for
# MLA where every tile of 64 keys or more lies in one page (_whole_page_tiles; pages of 16 / 32 make 16 / 32-key
# tiles, untimed, and keep every tile masked), and the partial tile in registers wherever else SPLIT_TAIL is taken.
# That rule is written and interpreter-tested but not yet the default: the decode GPU tests have not run with the
# pipelined tail (scripts/gpu_check.sh ONLY=tailpipe), so the default is still False (the tail in registers where
# SPLIT_TAIL is taken, i.e. contiguous GQA). True / False (=1 / =0) force it wherever SPLIT_TAIL is taken / nowhere,
# for A/B timing.
TAIL_PIPELINED = _env.tristate("MLA_ATTN_DECODE_TAIL_PIPELINED", False, none="auto")


def _whole_page_tiles(mla: bool, paged: bool, page_size: int, block_n: int) -> bool:
    """The MLA tiles that the tail rule (TAIL_PIPELINED None) pipelines: paged, 64 keys or more, each in one page."""
    return mla and paged and block_n >= 64 and page_size % block_n == 0


def _split_tail(mla: bool, paged: bool, whole_page_tiles: bool = False) -> bool:
    if SPLIT_TAIL is not None:
        return SPLIT_TAIL
    return (not mla and not paged) or (whole_page_tiles and TAIL_PIPELINED is None)


def _tail_pipelined(whole_page_tiles: bool) -> bool:
    """TAIL_PIPELINED for a call that takes SPLIT_TAIL."""
    return whole_page_tiles if TAIL_PIPELINED is None else TAIL_PIPELINED


def _fused_merge_tiles(num_splits: int, rows_per_tile: int, block_dv: int):
    """(MERGE_ROWS, MERGE_CHUNK) for a fused merge of this shape, or None when it is not fused."""
    merge_rows = next_pow2(max(1, rows_per_tile))
    if not FUSED_MERGE or num_splits <= 1 or merge_rows * block_dv > FUSE_STEP:
        return None
    chunk = min(next_pow2(num_splits), FUSE_STEP // (merge_rows * block_dv))
    if cdiv(num_splits, chunk) > FUSE_MAX_STEPS:
        return None
    return merge_rows, chunk


def _ticket_counters(device: torch.device) -> torch.Tensor:
    """The fused merge's tickets: int32, one per row tile, all 0 between calls (the last taker resets
    its own). One buffer per (device, stream), kept for the life of the process: a CUDA graph that
    captured a decode step keeps pointing at it, and decode steps running at the same time on two
    streams never share a ticket."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _tickets.get(key)
    if buf is None:
        buf = _tickets[key] = torch.zeros(_TICKET_SLOTS, dtype=torch.int32, device=device)
    return buf


def plan_buffers(plan):
    """Fresh ``(o, lse, o_part, lse_part)`` for a replayed plan (this module's or gluon_mla's): outputs of
    ``plan.o_shape`` / ``plan.lse_shape``, and partials in one fp32 buffer of ``plan.part_numel`` whose lse
    part starts at ``plan.lse_offset`` (none when part_numel is 0: the outputs themselves). The kernels and
    the merge read only data pointers, so no views are built."""
    o = _alloc(plan.o_shape, dtype=plan.dtype, device=plan.device)
    lse = _alloc(plan.lse_shape, dtype=torch.float32, device=plan.device)
    if not plan.part_numel:
        return o, lse, o, lse
    part = _alloc((plan.part_numel,), dtype=torch.float32, device=plan.device)
    return o, lse, part, part[plan.lse_offset:]


class _Plan:
    """A decode call's host decisions for one key (:func:`_launch`): output and partial buffer sizes and
    the kernel launches, replayed by later calls with the same shapes, strides, dtypes and alignments."""

    __slots__ = ("o_shape", "lse_shape", "dtype", "device", "part_numel", "lse_offset", "fused", "decode",
                 "combine")

    def run(self, q1, q2, k1, k2, v, seq_lens, block_table, scale):
        o, lse, o_part, lse_part = plan_buffers(self)
        tickets = _ticket_counters(self.device) if self.fused else seq_lens
        self.decode(q1, q1 if q2 is None else q2, k1, k1 if k2 is None else k2, k1 if v is None else v, seq_lens,
                    seq_lens if block_table is None else block_table, o_part, lse_part, o, lse, tickets,
                    scale * _LOG2E)
        if self.combine is not None:
            self.combine(o_part, lse_part, o, lse, seq_lens)
        return o, lse


# Plans by call key. A plan is replayed only for a call that would have made every host decision (tile,
# split count, buffers, grid) and every Triton specialisation (strides, dtypes, pointer alignment) the same;
# module switches read by those decisions are part of the key. Tests that patch other host functions clear it.
_plans = PlanCache()


def _launch(q1, q2, k1, k1_strides, k2, k2_strides, v, v_strides, seq_lens, block_table, page_size, num_kv_heads,
            d_v, scale, num_splits, capacity, mla, config, dv_tiles=None):
    if q2 is not None and q2.shape[-1] == 0:  # a zero-width rope block is no rope block (never read)
        q2 = k2 = None
    seq_lens = seq_lens.contiguous()  # the kernel reads SEQ_LENS + b: a strided view must not reach it
    key = None
    if config is None and _fast.enabled():
        key = (tensor_key(q1), tensor_key(q2), tensor_key(k1), k1_strides, tensor_key(k2), k2_strides,
               tensor_key(v), v_strides, tensor_key(seq_lens), tensor_key(block_table), page_size, num_kv_heads,
               d_v, num_splits, capacity, mla, BALANCE, FUSED_MERGE, STRIDE_UNITS, dv_tiles, PAGE_SPAN, KV_MAJOR,
               SPLIT_TAIL, TAIL_PIPELINED)
        plan = _plans.get(key)
        if plan is not None:
            return plan.run(q1, q2, k1, k2, v, seq_lens, block_table, scale)
    b, h, s, d1 = q1.shape
    d2 = 0 if q2 is None else q2.shape[-1]
    group = h // num_kv_heads
    rows = group * s
    device = q1.device
    paged = block_table is not None
    cfg = config or default_config(rows, d1 + d2, d_v, q1.dtype, mla=mla, device=device)
    if config is None and _paged_gqa_wide(mla, paged, page_size, cfg, b * num_kv_heads * cdiv(rows, cfg.block_h),
                                          device):
        cfg = replace(cfg, num_warps=8)
    # A default that did not fit this GPU (shared memory, registers) was replaced once by a smaller one.
    span = PAGE_SPAN and not mla
    fit_key = (cfg, q1.dtype, d1, d2, d_v, s, paged, page_size, v is None, device.index, span)
    refitted = config is None and fit_key in _fitted
    if refitted:
        cfg = _fitted[fit_key]
    head_tiles = cdiv(rows, cfg.block_h)
    tile_n = _tile_keys(cfg.block_n, paged, page_size, span)
    balanced = num_splits is None and _use_balanced(mla, rows, b, num_kv_heads * head_tiles,
                                                    _num_sms(device) * cfg.ctas_per_sm)
    if balanced:
        # Workers per (KV head, head tile): one wave of programs over the whole batch.
        num_splits = max(1, _num_sms(device) * cfg.ctas_per_sm // (num_kv_heads * head_tiles))
    elif num_splits is None:
        num_splits = choose_num_splits(b * num_kv_heads, head_tiles, capacity, _num_sms(device),
                                       block_n=tile_n, ctas_per_sm=cfg.ctas_per_sm)
    o = _alloc((b, h, s, d_v), dtype=q1.dtype, device=device)
    lse = _alloc((b, h, s), dtype=torch.float32, device=device)
    if o.numel() == 0 or lse.numel() == 0:
        return o, lse.fill_(float("-inf"))
    plan = _Plan()
    plan.o_shape, plan.lse_shape, plan.dtype, plan.device = (b, h, s, d_v), (b, h, s), q1.dtype, device
    plan.part_numel = plan.lse_offset = 0
    if balanced:  # slot b + w: worker w's piece of sequence b; a slot no worker writes is never read
        slots = num_splits + b - 1
        plan.part_numel, plan.lse_offset = slots * h * s * (d_v + 1), slots * h * s * d_v
        part = _alloc((plan.part_numel,), dtype=torch.float32, device=device)
        o_part = part[: plan.lse_offset].view(slots, h, s, d_v)
        lse_part = part[plan.lse_offset:].view(slots, h, s)
        o_strides = (o_part.stride(0), 0) + o_part.stride()[1:]
        lse_strides = (lse_part.stride(0), 0) + lse_part.stride()[1:]
    elif num_splits == 1:
        o_part, lse_part = o.unsqueeze(0), lse.unsqueeze(0)
    else:  # one buffer for both partials: one allocation fewer on the host path
        plan.part_numel, plan.lse_offset = num_splits * b * h * s * (d_v + 1), num_splits * b * h * s * d_v
        part = _alloc((plan.part_numel,), dtype=torch.float32, device=device)
        # Split outermost. A row's parts adjacent ([B, H, S, K, Dv]) timed within 1.3% of it on the
        # H200 (session 11); combine_splits takes either.
        o_part = part[: plan.lse_offset].view(num_splits, b, h, s, d_v)
        lse_part = part[plan.lse_offset:].view(num_splits, b, h, s)
    if not balanced:
        o_strides, lse_strides = o_part.stride(), lse_part.stride()
    fused = None
    if not balanced and b * num_kv_heads * head_tiles <= _TICKET_SLOTS:
        fused = _fused_merge_tiles(num_splits, min(cfg.block_h, rows), _pow2(d_v))
    plan.fused = fused is not None
    tickets = _ticket_counters(device) if fused else seq_lens  # a dummy pointer when not fused

    bt = block_table if paged else seq_lens  # a dummy pointer when contiguous (never dereferenced)
    bt_strides = block_table.stride() if paged else (0, 0)
    q2_ = q1 if q2 is None else q2
    q2_strides = (0, 0, 0, 0) if q2 is None else q2.stride()
    k2_ = k1 if k2 is None else k2
    k2_strides = k2_strides or (0, 0, 0, 0)
    v_ = k1 if v is None else v
    grid = ((1 if balanced else b) * num_kv_heads * head_tiles, num_splits)
    kv_major = KV_MAJOR and not balanced and num_kv_heads > 1
    unit = _stride_unit(q1.stride(), q2_strides, k1_strides, k2_strides, v_strides, o_strides)

    def units(st):  # the leading strides divided by unit, the last (the head-dim stride) as it is
        return tuple(x // unit for x in st[:-1]) + tuple(st[-1:])
    values = (q1, q2_, k1, k2_, v_, seq_lens, bt, o_part, lse_part, o, lse, tickets, scale * _LOG2E)

    def run(c: DecodeConfig) -> Launch:
        block_n = _tile_keys(c.block_n, paged, page_size, span)
        block_dv, block_dv2 = _value_tiles(d_v, dv_tiles, c.block_h, c.num_warps)
        whole_page = _whole_page_tiles(mla, paged, page_size, block_n)
        split_tail = _split_tail(mla, paged, whole_page)
        launch = Launch(
            _decode_kernel, grid,
            (*(Slot(i) for i in range(len(values))),
             num_kv_heads, num_splits, group, head_tiles, b,
             *units(q1.stride()), *units(q2_strides),
             *units(k1_strides), *units(k2_strides), *units(v_strides),
             *bt_strides,
             *units(o_strides), *lse_strides),
            dict(
                S=s,
                D1=d1, D2=max(d2, 1), DV=d_v,
                BLOCK_D1=_pow2(d1), BLOCK_D2=_pow2(d2), BLOCK_DV=block_dv,
                BLOCK_H=c.block_h, BLOCK_N=block_n,
                PAGED=paged, PAGE_SIZE=page_size, TILE_IN_PAGE=paged and page_size % block_n == 0,
                HAS_K2=q2 is not None, V_IS_K1=v is None,
                IEEE=q1.dtype == torch.float32,
                UNCHAIN=c.num_warps >= 8 if c.unchain is None else c.unchain,
                BALANCED=balanced, MAX_B=next_pow2(b) if balanced else 1,
                **(dict(FUSED=True, MERGE_ROWS=fused[0], MERGE_CHUNK=fused[1], MERGE_DV=_pow2(d_v)) if fused else {}),
                **(dict(STRIDE_UNIT=unit) if unit != 1 else {}),
                **(dict(BLOCK_DV2=block_dv2) if block_dv2 else {}),
                **(dict(KV_MAJOR=True) if kv_major else {}),
                **(dict(SPLIT_TAIL=True) if split_tail else {}),
                **(dict(TAIL_PIPELINED=True) if split_tail and _tail_pipelined(whole_page) else {}),
            ),
            dict(num_warps=c.num_warps, num_stages=c.num_stages),
        )
        launch(*values)
        return launch

    if config is not None or refitted:
        plan.decode = run(cfg)  # a pinned config runs as asked (an error says it does not fit); a refitted one fits
    else:
        # Out-of-resources is raised while compiling, on the host, before anything is queued: trying
        # a smaller config costs one compile per key, never a device synchronisation.
        for c in (cfg, *_smaller(cfg)):
            try:
                plan.decode = run(c)
            except OutOfResources:
                continue
            if c != cfg:
                _fitted[fit_key] = c
            break
        else:
            raise RuntimeError(f"decode: no tile configuration fits this GPU, starting from {cfg}")
    merge = needs_merge = None
    if balanced:
        merge, needs_merge = combine_balanced(o_part, lse_part, o, lse, seq_lens, num_splits, tile_n), True
    elif num_splits > 1 and not fused:
        merge, needs_merge = combine_splits(o_part, lse_part, o, lse), True
    plan.combine = merge if needs_merge else None
    # Kept only when every launch is one this module made (a test may have patched a merge function).
    if key is not None and (not needs_merge or isinstance(merge, Launch)):
        _plans.put(key, plan)
    return o, lse


def gqa_decode(q, k_cache, v_cache, seq_lens, block_table, scale: float, num_splits: int | None, *,
               config: DecodeConfig | None = None):
    """Grouped-head decode (GQA / MQA / MHA) over a contiguous or paged cache.

    Args:
        q: ``[B, Hq, S, D]`` (any strides), S new tokens per sequence.
        k_cache, v_cache: contiguous ``[B, Hkv, N, D]`` / ``[B, Hkv, N, Dv]``, or, when ``block_table``
            is given, paged ``[num_pages, P, Hkv, D]`` / ``[num_pages, P, Hkv, Dv]``. Any strides.
        seq_lens: int32 ``[B]`` on q's device: cached tokens including the S new ones. New token s
            sees positions ``j < seq_lens[b] - S + 1 + s`` (S = 2, seq_len = 5: token 0 sees j <= 3,
            token 1 sees j <= 4).
        block_table: int32 ``[B, max_pages]`` or None; only entries below ``ceil(seq_len / P)`` are read.
        scale: score scale.
        num_splits: KV intervals per sequence; None picks one (:func:`choose_num_splits`).
        config: tile override (benchmarks); None uses :func:`default_config`.

    Returns:
        ``o [B, Hq, S, Dv]`` in q's dtype, ``lse [B, Hq, S]`` float32 (natural log); a row that sees
        no key gets o = 0 and lse = -inf.
    """
    if block_table is None:
        _, hkv, n, _ = k_cache.shape
        sb, sh, sn, sd = k_cache.stride()
        k_strides = (sb, sn, sh, sd)
        vb, vh, vn, vd = v_cache.stride()
        v_strides = (vb, vn, vh, vd)
        page_size, capacity = 1, n
    else:
        _, page_size, hkv, _ = k_cache.shape
        k_strides, v_strides = k_cache.stride(), v_cache.stride()
        capacity = block_table.shape[1] * page_size
    d, d_v = q.shape[-1], v_cache.shape[-1]
    main, tail = _head_split(d, q, k_cache, v_cache)
    q1, q2, k1, k2 = q, None, k_cache, None
    if tail:  # the score as two blocks (the rope block's path): [0, main) and the tail [main, d), views
        q1, q2, k1, k2 = q[..., :main], q[..., main:], k_cache[..., :main], k_cache[..., main:]
    dv_tiles = _head_split(d_v, q, k_cache, v_cache)
    return _launch(q1, q2, k1, k_strides, k2, k_strides if tail else None, v_cache, v_strides, seq_lens, block_table,
                   page_size, hkv, d_v, scale, num_splits, capacity, False, config,
                   dv_tiles=dv_tiles if dv_tiles[1] else None)


# The Gluon MLA decode kernel (gluon_mla.py: Hopper, warp-specialised, H a multiple of 64, one new token,
# any page size: pages under 64 keys are gathered by cp.async, gluon_mla.SMALL_PAGES) takes the absorbed
# MLA decode wherever it applies. With its default schedule
# (each score tile once, gluon_mla.S_ONCE) it beat the Triton kernel at every H = 128 benchmark row on
# the H200 (62a93a0, graph replays): B 1 / 16 / 64 / 128 in 48.7 / 118.8 / 210.1 / 776.3 us against
# 51.1 / 136.4 / 248.2 / 890.5, the last against the Triton kernel's balanced split.
# With the first schedule (S_ONCE off, both consumers scoring every tile) it lost at B = 1 and tied at
# B = 128. So it is then not taken below GLUON_MLA_MIN_PROGRAMS x the SM count of unsplit programs
# (B x H / 64) nor from about two waves of programs; an explicit num_splits still takes it (tests).
# MLA_ATTN_GLUON_MLA=0 keeps the Triton kernel everywhere.
GLUON_MLA = _env.flag("MLA_ATTN_GLUON_MLA", True)
GLUON_MLA_MIN_PROGRAMS = 1 / 8


def _gluon_mla_takes(q_latent, q_rope, kv_latent, k_rope, block_table, num_splits) -> bool:
    if not (GLUON_MLA and q_latent.is_cuda):
        return False
    from . import gluon_mla

    if not gluon_mla.supported(q_latent, q_rope, kv_latent, k_rope, block_table):
        return False
    if gluon_mla.S_ONCE:
        return True
    programs = q_latent.shape[0] * (q_latent.shape[1] // gluon_mla.BLOCK_H)
    sms = _num_sms(q_latent.device)
    return num_splits is not None or GLUON_MLA_MIN_PROGRAMS * sms <= programs < 1.5 * sms


def mla_decode(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale: float, num_splits: int | None, *,
               config: DecodeConfig | None = None):
    """Absorbed MLA decode: MQA with score ``scale * (q_latent . c_j + q_rope . kr_j)`` and value ``c_j``.

    Args:
        q_latent: ``[B, H, S, Dc]``; q_rope: ``[B, H, S, Dr]`` or None (Dr = 0).
        kv_latent: contiguous ``[B, N, Dc]`` or paged ``[num_pages, P, Dc]``; k_rope likewise with Dr,
            or None. Both may be strided views into one ``[..., Dc + Dr]`` buffer.
        seq_lens, block_table, scale, num_splits, config: as in :func:`gqa_decode`.

    Returns:
        ``o [B, H, S, Dc]`` in q_latent's dtype, ``lse [B, H, S]`` float32.
    """
    if q_latent.dim() == 3:
        q_latent = q_latent.unsqueeze(2)
        q_rope = None if q_rope is None else q_rope.unsqueeze(2)
    if config is None and GLUON_MLA and q_latent.is_cuda:
        from . import gluon_mla

        if gluon_mla.S_ONCE:  # the router takes every supported call: a plan of this key was one
            out = gluon_mla.replay(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale, num_splits)
            if out is not None:
                return out
    if config is None and _gluon_mla_takes(q_latent, q_rope, kv_latent, k_rope, block_table, num_splits):
        from .gluon_mla import mla_decode_gluon

        return mla_decode_gluon(q_latent, q_rope, kv_latent, k_rope, seq_lens, block_table, scale, num_splits,
                                checked=True)
    if block_table is None:
        page_size, capacity = 1, kv_latent.shape[1]
    else:
        page_size = kv_latent.shape[1]
        capacity = block_table.shape[1] * page_size
    so, st, sd = kv_latent.stride()
    k1_strides = (so, st, 0, sd)
    k2_strides = (0, 0, 0, 0)
    if k_rope is not None:
        ro, rt, rd = k_rope.stride()
        k2_strides = (ro, rt, 0, rd)
    return _launch(q_latent, q_rope, kv_latent, k1_strides, k_rope, k2_strides, None, (0, 0, 0, 0), seq_lens,
                   block_table, page_size, 1, kv_latent.shape[-1], scale, num_splits, capacity, True, config)

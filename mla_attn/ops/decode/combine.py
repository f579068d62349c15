"""Split-KV combine: merge partial attentions over disjoint key sets by their log-sum-exps.

For parts k with outputs o_k (each normalised over its own keys) and lse_k:
``lse = log sum_k exp(lse_k)``, ``o = sum_k exp(lse_k - lse) o_k``. Parts with lse_k = -inf weigh
exactly 0 (their o_k is never multiplied in, so a NaN there cannot leak); if every part is -inf
the row gets o = 0 and lse = -inf. Derivation in README.md here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._common import cdiv, next_pow2
from .._launch import Launch, Slot

_alloc = torch.empty  # output buffers (tests swap in a NaN-filled allocator)


@triton.jit
def _combine_kernel(
    O_PARTS, LSE_PARTS, O, LSE,
    num_parts, num_rows,
    stride_opk, stride_opr, stride_opd,
    stride_lpk, stride_lpr,
    stride_or, stride_od,
    stride_lr,
    DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr,
    # BALANCED: the parts come from the decode kernel's balanced workers (triton_decode.py): part
    # slots are b + w for the workers w that took tiles of sequence b, recomputed here from the lengths.
    SEQ_LENS=None, batch=1, rows_per_seq=1, tile_n=1,
    BALANCED: tl.constexpr = False, MAX_B: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    # A program merges BLOCK_R rows x BLOCK_DV columns in one pass over the parts, CHUNK parts per
    # step, with a running max as in the decode kernel's online softmax: each step's lse and o loads
    # are independent, so a merge of <= CHUNK parts is one memory round trip. Many rows per program
    # keep a big merge at a few hundred programs (one program per row took 98 us to merge 33 MB on
    # the H200 and on an H100); CHUNK parts per step keep a merge of many parts (batch 1: dozens)
    # from a serial chain.
    if PDL:  # launched as a programmatic dependent of the decode kernel: wait for its partials
        tl.extra.cuda.gdc_wait()
    o_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_d = o_d < DV
    if BALANCED:
        # A program's rows lie in one sequence b (grid axis 0: b x row tiles of its rows_per_seq).
        # Worker w took tiles [ceil(w T / W), ceil((w+1) T / W)) of the batch's T, so the workers that
        # touched b's tiles [excl, excl + nt) are floor(excl W / T) .. floor((excl + nt - 1) W / T);
        # a worker in that range whose run is empty (T < W) wrote nothing and is skipped.
        row_tiles = tl.cdiv(rows_per_seq, BLOCK_R)
        i_b = tl.program_id(0) // row_tiles
        o_rl = (tl.program_id(0) % row_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows within b
        m_r = o_rl < rows_per_seq
        o_r = i_b.to(tl.int64) * rows_per_seq + o_rl  # output rows
        o_rp = o_rl.to(tl.int64)  # rows in the part buffers
        o_bb = tl.arange(0, MAX_B)
        n_tiles = tl.cdiv(tl.load(SEQ_LENS + o_bb, mask=o_bb < batch, other=0), tile_n)
        total = tl.sum(n_tiles, 0).to(tl.int64)
        excl = tl.sum(tl.where(o_bb < i_b, n_tiles, 0), 0).to(tl.int64)
        nt = tl.sum(tl.where(o_bb == i_b, n_tiles, 0), 0).to(tl.int64)
        w_first = excl * num_parts // tl.maximum(total, 1)
        w_last = (excl + nt - 1) * num_parts // tl.maximum(total, 1)
        k_lo = i_b + w_first  # first slot
        k_n = tl.where(nt > 0, w_last - w_first + 1, 0)  # slots to visit
    else:
        o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] output rows
        m_r = o_r < num_rows
        o_rp = o_r
        k_lo = 0
        k_n = num_parts
        w_first = 0
        total = 0
    _merge_rows(O_PARTS, LSE_PARTS, O, LSE, o_r, o_rp, m_r, o_d, m_d, k_lo, k_n, w_first, total, num_parts,
                stride_opk, stride_opr, stride_opd, stride_lpk, stride_lpr, stride_or, stride_od, stride_lr,
                tl.program_id(1) == 0, BLOCK_R=BLOCK_R, BLOCK_DV=BLOCK_DV, CHUNK=CHUNK, BALANCED=BALANCED, CACHE="")


@triton.jit
def _merge_rows(
    O_PARTS, LSE_PARTS, O, LSE,
    o_r, o_rp, m_r,  # [BLOCK_R] output rows, rows in the part buffers, live rows
    o_d, m_d,  # [BLOCK_DV] columns, live columns
    k_lo, k_n,  # the parts are slots k_lo .. k_lo + k_n - 1
    w_first, total, num_parts,  # BALANCED only (see _combine_kernel)
    stride_opk, stride_opr, stride_opd, stride_lpk, stride_lpr, stride_or, stride_od, stride_lr,
    store_lse,  # this program writes the rows' lse (one column tile does)
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, BALANCED: tl.constexpr,
    CACHE: tl.constexpr,  # ".cg" when the parts were written by other programs of a running kernel ("" else)
):
    """Merge BLOCK_R rows x BLOCK_DV columns over their parts, CHUNK parts per step, and store o / lse.

    Used by _combine_kernel and by the decode kernel's fused merge (triton_decode.py: the last split
    of a row tile to finish merges them, with CACHE=".cg" so nothing comes from a stale L1 line)."""
    o_c = tl.arange(0, CHUNK)
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)  # running max of the parts' lse
    b_den = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, k_n, CHUNK):
        o_j = k0 + o_c  # [CHUNK] parts of this row block
        m_k = o_j < k_n
        if BALANCED:
            # Only when T < W can a run be empty. The test costs two 64-bit divisions per part, which
            # the GPU emulates in software: done in every step it made the B=1 H=128 merge 30 us
            # (5.7 us for the per-sequence split's merge of as many parts; H200, profile_decode.py).
            if total < num_parts:
                o_w = (w_first + o_j).to(tl.int64)  # the worker that wrote part j
                m_k = m_k & ((o_w * total + num_parts - 1) // num_parts
                             < ((o_w + 1) * total + num_parts - 1) // num_parts)
        o_k = (k_lo + o_j).to(tl.int64)  # [CHUNK] slots
        m_kr = m_k[:, None] & m_r[None, :]
        b_lc = tl.load(LSE_PARTS + o_k[:, None] * stride_lpk + o_rp[None, :] * stride_lpr,
                       mask=m_kr, other=float("-inf"), cache_modifier=CACHE)  # [CHUNK, BLOCK_R]
        p_o = (O_PARTS + o_k[:, None, None] * stride_opk + o_rp[None, :, None] * stride_opr
               + o_d[None, None, :] * stride_opd)
        b_o = tl.load(p_o, mask=m_kr[:, :, None] & m_d[None, None, :], other=0.0,
                      cache_modifier=CACHE)  # [CHUNK, BLOCK_R, BLOCK_DV]
        b_m_new = tl.maximum(b_m, tl.max(b_lc, 0))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no live part yet: weights stay 0
        b_alpha = tl.exp(b_m - b_m_safe)
        b_w = tl.exp(b_lc - b_m_safe[None, :])  # [CHUNK, BLOCK_R]; dead parts weigh exactly 0
        b_den = b_den * b_alpha + tl.sum(b_w, 0)
        # A dead part's o (weight exactly 0) never enters the sum, whatever it holds (NaN included):
        # where(), not a product. (A NaN lse gives a NaN weight, which is kept: NaN in, NaN out.)
        b_wo = tl.where((b_w != 0.0)[:, :, None], b_w[:, :, None] * b_o.to(tl.float32), 0.0)
        b_acc = b_acc * b_alpha[:, None] + tl.sum(b_wo, 0)
        b_m = b_m_new
    b_m_safe = tl.where(b_m == float("-inf"), 0.0, b_m)

    dead = b_den == 0.0
    b_out = b_acc / tl.where(dead, 1.0, b_den)[:, None]
    b_lse_out = tl.where(dead, float("-inf"), b_m_safe + tl.log(tl.where(dead, 1.0, b_den)))
    tl.store(O + o_r[:, None] * stride_or + o_d[None, :] * stride_od, b_out.to(O.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    if store_lse:
        tl.store(LSE + o_r * stride_lr, b_lse_out, mask=m_r)


# Tile rule timed on the H200 (scripts/bench_combine.py, 2026-12-03, partials in L2 as after the decode
# kernel): 63 parts x 128 rows x 512 -> (1, 256, 32) 5.1 us; 4 x 2048 x 512 -> (8, 256, 1) 4.2 us;
# 2 x 1024 x 512 -> (8, 256, 1) 2.5 us. The rule before it, (1|16 rows, 128 columns, up to 16 parts
# per step), took 8.8 / 15.6 / 5.0 us on the same three.
_TARGET_PROGRAMS = 256  # programs to aim for (H200: 132 SMs, two or more each)
_STEP_ELEMENTS = 8192  # most elements of o one step loads per program (CHUNK x BLOCK_R x BLOCK_DV)
_MAX_CHUNK = 32  # most parts per step
_MAX_DV = 256  # most columns per program
# Launch the split combine (CUDA only) as a programmatic dependent launch of the kernel before it, so its
# launch overlaps that kernel's tail; the combine's griddepcontrol.wait then waits for the partials.
# Off: an option the B = 1 probe times (scripts/probe_mla_decode.py --b1).
_PDL = False


@functools.lru_cache(maxsize=256)  # on every split decode call's host path
def _combine_tiles(parts: int, rows: int, dv: int, target_programs: int = _TARGET_PROGRAMS,
                   step_elements: int = _STEP_ELEMENTS, max_chunk: int = _MAX_CHUNK, max_dv: int = _MAX_DV):
    """(BLOCK_R, BLOCK_DV, CHUNK, num_warps) for a merge of ``parts`` x ``rows`` x ``dv``.

    Up to 8 rows x ``max_dv`` (256) columns per program, fewer rows while that leaves fewer than
    ``target_programs`` programs (0: always 8). With 4 or more rows a program takes one part per
    step: the loop's loads pipeline, and a many-row merge has few parts. With fewer rows (a merge of
    dozens of parts at batch 1) CHUNK parts are loaded per step, up to ``max_chunk`` and
    ``step_elements``, so the merge is one or two dependent load rounds.
    """
    block_dv = min(max_dv, max(16, next_pow2(dv)))
    col_tiles = cdiv(dv, block_dv)
    block_r = 8
    while block_r > 1 and cdiv(rows, block_r) * col_tiles < target_programs:
        block_r //= 2
    if block_r >= 4:
        chunk = 1
    else:
        chunk = max(1, min(max_chunk, next_pow2(parts), step_elements // (block_r * block_dv)))
    warps = max(1, min(4, chunk * block_r * block_dv // 512))
    return block_r, block_dv, chunk, warps


def _launch(o_parts3, lse_parts2, o2, lse1):
    """o_parts3 [K, R, Dv], lse_parts2 [K, R] float32 -> writes o2 [R, Dv], lse1 [R].

    Returns the :class:`Launch` it ran (None when there is nothing to merge). Its per-call values are
    ``(o_parts, lse_parts, o, lse, seq_lens)``: tensors with these four's data pointers (views of the same
    memory, or later calls' buffers of the same layout) and a dummy, so a cached decode plan can rerun it."""
    k, r, dv = o_parts3.shape
    if r == 0:
        return None
    # The interpreter runs programs one by one: there, fewer and bigger is faster.
    if o2.is_cuda:
        block_r, block_dv, chunk, warps = _combine_tiles(k, r, dv, _TARGET_PROGRAMS, _STEP_ELEMENTS, _MAX_CHUNK,
                                                          _MAX_DV)
    else:
        block_r, block_dv, chunk, warps = _combine_tiles(k, r, dv, 0)
    pdl = _PDL and o2.is_cuda
    launch = Launch(
        _combine_kernel, (cdiv(r, block_r), cdiv(dv, block_dv)),
        (Slot(0), Slot(1), Slot(2), Slot(3), k, r,
         *o_parts3.stride(), *lse_parts2.stride(), *o2.stride(), *lse1.stride()),
        dict(DV=dv, BLOCK_R=block_r, BLOCK_DV=block_dv, CHUNK=chunk,
             SEQ_LENS=Slot(3), batch=1, rows_per_seq=1, tile_n=1, BALANCED=False, MAX_B=1,  # unused
             **({"PDL": True} if pdl else {})),
        dict(num_warps=warps, **({"launch_pdl": True} if pdl else {})),
    )
    launch(o_parts3, lse_parts2, o2, lse1, lse1)
    return launch


def combine_splits(o_part, lse_part, o, lse):
    """Merge the decode kernel's partials: o_part [K, B, H, S, Dv] fp32, lse_part [K, B, H, S] into
    o [B, H, S, Dv] (its dtype), lse [B, H, S] fp32 (both freshly allocated, contiguous). Returns the
    :class:`Launch` (values ``(o_part, lse_part, o, lse, unused)``) or None."""
    k, dv = o_part.shape[0], o_part.shape[-1]
    rows = o.numel() // dv
    # (B, H, S) collapse to one row index in either partial layout (split outermost or innermost).
    o3 = o_part.as_strided((k, rows, dv), (o_part.stride(0), o_part.stride(-2), o_part.stride(-1)))
    l2 = lse_part.as_strided((k, rows), (lse_part.stride(0), lse_part.stride(-1)))
    return _launch(o3, l2, o.view(-1, dv), lse.view(-1))


def combine_balanced(o_part, lse_part, o, lse, seq_lens, num_workers: int, tile_n: int):
    """Merge the balanced decode's partials: o_part [W + B - 1, H, S, Dv] fp32 and lse_part
    [W + B - 1, H, S] (slot b + w: worker w's piece of sequence b) into o [B, H, S, Dv], lse [B, H, S].
    Returns the :class:`Launch` (values ``(o_part, lse_part, o, lse, seq_lens)``) or None."""
    b, h, s, dv = o.shape
    rows_per_seq = h * s
    if b * rows_per_seq == 0:
        return None
    target = _TARGET_PROGRAMS if o.is_cuda else 0
    block_r, block_dv, chunk, warps = _combine_tiles(cdiv(num_workers, b) + 1, b * rows_per_seq, dv, target)
    block_r = min(block_r, next_pow2(rows_per_seq))  # a program's rows stay in one sequence
    o3 = o_part.view(o_part.shape[0], rows_per_seq, dv)
    l2 = lse_part.view(lse_part.shape[0], rows_per_seq)
    o2, lse1 = o.view(-1, dv), lse.view(-1)
    launch = Launch(
        _combine_kernel, (b * cdiv(rows_per_seq, block_r), cdiv(dv, block_dv)),
        (Slot(0), Slot(1), Slot(2), Slot(3), num_workers, b * rows_per_seq,
         *o3.stride(), *l2.stride(), *o2.stride(), *lse1.stride()),
        dict(DV=dv, BLOCK_R=block_r, BLOCK_DV=block_dv, CHUNK=chunk,
             SEQ_LENS=Slot(4), batch=b, rows_per_seq=rows_per_seq, tile_n=tile_n,
             BALANCED=True, MAX_B=next_pow2(b)),
        dict(num_warps=warps),
    )
    launch(o3, l2, o2, lse1, seq_lens)
    return launch


def merge_attention_states_triton(o_parts, lse_parts):
    """Combine partial attentions over disjoint key sets.

    Args:
        o_parts: ``[K, ..., Dv]``, each part normalised over its own keys (any float dtype).
        lse_parts: ``[K, ...]`` float32 log-sum-exps; a part with -inf contributes nothing.

    Returns:
        ``o [..., Dv]`` in o_parts' dtype and ``lse [...]`` float32; a row whose parts are all -inf
        gets o = 0 and lse = -inf.
    """
    k, dv = o_parts.shape[0], o_parts.shape[-1]
    lead = tuple(o_parts.shape[1:-1])
    o = _alloc(lead + (dv,), dtype=o_parts.dtype, device=o_parts.device)
    lse = _alloc(lead, dtype=torch.float32, device=o_parts.device)
    if k == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    _launch(o_parts.reshape(k, -1, dv), lse_parts.float().reshape(k, -1), o.view(-1, dv), lse.view(-1))
    return o, lse

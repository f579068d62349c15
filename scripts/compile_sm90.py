"""Compile a kernel for Hopper (sm_90a) on a machine without a GPU and report what the GPU would get.

Reads shared memory, registers, spills and ptxas's wgmma warnings, and writes the TTGIR and PTX, so
that a tile or code change can be judged before spending device time. For the H200's numbers, run it
with the Triton the GPU image has (3.6), e.g. from a side virtual environment:

    python3 -m venv /tmp/v36 && /tmp/v36/bin/pip install torch==2.13.0 triton==3.6.0 numpy
    PYTHONPATH=. /tmp/v36/bin/python scripts/compile_sm90.py decode 64,32,8,4 --unchain --paged
    PYTHONPATH=. /tmp/v36/bin/python scripts/compile_sm90.py fwd 128,64,8,3 --dqk 192 --dv 128
    PYTHONPATH=. /tmp/v36/bin/python scripts/compile_sm90.py gluon 128,64,8,3 --dqk 128 --dv 128

Tiles are ``BLOCK_H,BLOCK_N,num_warps,num_stages`` (decode: absorbed MLA, Dc 512 + Dr 64, bf16, one new
token) or ``BLOCK_M,BLOCK_N,num_warps,num_stages`` (fwd: causal flash forward, bf16).

The launch-time specialisations matter: pointers, strides and lengths get ``tt.divisibility = 16`` and
unit strides are the constant 1, as Triton gives them at a real launch. Without those the pipeliner
emits no ``cp.async`` and the shared-memory and register numbers describe a different kernel.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

UNIT_STRIDES = ("stride_q1d", "stride_q2d", "stride_k1d", "stride_k2d", "stride_vd", "stride_od", "stride_ls",
                "stride_btp", "stride_qd", "stride_kd", "stride_opd")  # 1 at every launch: Triton specialises them


def _compile(fn, ptrs: dict, const: dict, warps: int, stages: int, aligned=lambda name: False, maxnreg=None):
    names = list(inspect.signature(fn.fn).parameters)
    const = dict(const)
    for n in names:
        if n in UNIT_STRIDES:
            const[n] = 1
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            if not ptrs[n].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("qk_scale", "scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if aligned(n):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _ptxas() -> str:
    """The ptxas this Triton compiles sm_90a with (Triton 3.9 ships a newer one as ptxas-blackwell and uses it: its
    ``ptxas`` rejects the PTX 9.x that 3.9 emits)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=["decode", "combine", "fwd", "gluon", "dkdv", "dq", "gluon_dkdv", "gluon_dq", "gluon_fused", "gluon_ws",
                                           "gluon_mla"])
    ap.add_argument("tiles", help="BLOCK_H|BLOCK_M,BLOCK_N,num_warps,num_stages")
    ap.add_argument("--unchain", action="store_true", help="decode: UNCHAIN on")
    ap.add_argument("--paged", action="store_true", help="decode: paged cache, page 64")
    ap.add_argument("--gqa", action="store_true", help="decode: GQA (D = Dv = --dqk, separate V, no rope block)")
    ap.add_argument("--split", action="store_true", help="decode --gqa: the head split (72 = 64 + 16; _head_split)")
    ap.add_argument("--fused", metavar="ROWS,CHUNK", help="decode: FUSED merge with MERGE_ROWS, MERGE_CHUNK")
    ap.add_argument("--balanced", action="store_true", help="decode: BALANCED (workers over the batch's tiles)")
    ap.add_argument("--split-tail", action="store_true", help="decode: SPLIT_TAIL (key masks on the partial last tile only)")
    ap.add_argument("--tail-pipelined", action="store_true", help="decode --split-tail: TAIL_PIPELINED (the partial tile pipelined)")
    ap.add_argument("--pv-first", type=int, default=1, help="gluon_mla --s-once: 0 S first, 1 P V of tile t-1 before S of tile t, 2 and waited for")
    ap.add_argument("--dedicated", type=int, default=0,
                    help="gluon_mla --s-once: 1 a scorer warpgroup and two P V warpgroups, 2 with Q's latent half in "
                         "the scorer's registers (use --consumer-regs 168)")
    ap.add_argument("--trace", action="store_true", help="gluon (forward) or gluon_mla --s-once: the TRACE build (clock64 stamps)")
    ap.add_argument("--s1-early", action="store_true", help="gluon: S1_EARLY (S_1 under tile 0's softmax)")
    ap.add_argument("--tail", action="store_true", help="gluon: TAIL (the last heads' row blocks length-major)")
    ap.add_argument("--pair", action="store_true", help="gluon: PAIR (a block is half the rows of two GQA heads)")
    ap.add_argument("--schedule", type=int, default=1, help="gluon --persistent: 0 atomic counter, 1 static snake")
    ap.add_argument("--tma-store", action="store_true",
                    help="gluon: TMA_STORE (O out through Q's shared memory by TMA); gluon_dkdv: dK and dV out by TMA")
    ap.add_argument("--block-trace", action="store_true", help="gluon: the block-timeline build (entry / loop / exit stamps)")
    ap.add_argument("--pv-overlap", action="store_true", help="gluon: PV_OVERLAP (P V runs into the next softmax)")
    ap.add_argument("--dq-mode", type=int, default=0, help="gluon_fused: DQ_MODE (0 ordered adds, 2 unordered, 4 no dQ out)")
    ap.add_argument("--hsplit", type=int, default=1, help="gluon_dkdv: HSPLIT (a KV head's query heads split between programs)")
    ap.add_argument("--fresh-desc", action="store_true", help="gluon_dkdv: FRESH_DESC (K/V descriptors recomputed each step)")
    ap.add_argument("--bulk", action="store_true", help="gluon_fused: BULK (dQ_j out by TMA store / reduce-add)")
    ap.add_argument("--cast", action="store_true", help="gluon_fused --bulk: CAST (key block 0 adds too; a cast kernel writes dq)")
    ap.add_argument("--full", action="store_true", help="fwd / gluon: not causal")
    ap.add_argument("--persistent", action="store_true", help="gluon: PERSISTENT (experimental)")
    ap.add_argument("--q-in-regs", action="store_true", help="gluon: Q_IN_REGS (the scores' A operand in registers)")
    ap.add_argument("--token-major", action="store_true", help="gluon: TOKEN_MAJOR ([B, L, H, D] inputs in place)")
    ap.add_argument("--rows", type=int, default=64, help="gluon_mla --s-once --dedicated 1: ROWS, heads < 64 (SMALL_HEADS)")
    ap.add_argument("--gather", type=int, default=0, metavar="PAGE",
                    help="gluon_mla --s-once --dedicated 1: GATHER, pages of PAGE keys gathered by cp.async")
    ap.add_argument("--s-once", action="store_true", help="gluon_mla: the schedule that scores each tile once")
    ap.add_argument("--consumer-regs", type=int, default=232, help="gluon_mla: registers per consumer thread")
    ap.add_argument("--maxnreg", type=int, default=168, help="gluon_mla: the kernel's register cap")
    ap.add_argument("--cap", type=int, default=None, help="gluon: a register cap (maxnreg; 128 lets two 8-warp programs share an SM)")
    ap.add_argument("--dqk", type=int, default=128, help="fwd: Dqk")
    ap.add_argument("--dv", type=int, default=128, help="fwd: Dv")
    ap.add_argument("--row-align", type=int, default=16,
                    help="fwd / dkdv / dq / decode --gqa: the divisibility Triton sees on the row strides (16 at d 64/128; a d 72 row is 72 elements, 8)")
    ap.add_argument("--stride-unit", type=int, default=1,
                    help="fwd / dkdv / dq: STRIDE_UNIT (the leading strides passed divided by it; triton_fwd.stride_unit)")
    ap.add_argument("--out", default="/tmp/sm90", help="folder for kernel.ttgir / kernel.ptx")
    args = ap.parse_args()
    a, b, warps, stages = map(int, args.tiles.split(","))
    if args.kernel == "decode":
        from mla_attn.ops.decode.triton_decode import _decode_kernel as fn
        ptrs = {"Q1": "*bf16", "Q2": "*bf16", "K1": "*bf16", "K2": "*bf16", "V": "*bf16", "SEQ_LENS": "*i32",
                "BLOCK_TABLE": "*i32", "O": "*fp32", "LSE": "*fp32", "OF": "*bf16", "LSEF": "*fp32", "TICKETS": "*i32"}
        wd = max(16, triton.next_power_of_2(args.dqk))  # --gqa: D = Dv = --dqk, padded as the launcher pads it
        dims = dict(D1=args.dqk, D2=1, DV=args.dqk, BLOCK_D1=wd, BLOCK_D2=16, BLOCK_DV=wd) if args.gqa else \
            dict(D1=512, D2=64, DV=512, BLOCK_D1=512, BLOCK_D2=64, BLOCK_DV=512)
        gqa_split = None
        if args.gqa and args.split:  # the head split as gqa_decode makes it (triton_decode._head_split)
            from mla_attn.ops.decode import triton_decode
            triton_decode.HEAD_SPLIT, triton_decode.SPLIT_MAX_FILL = True, 1.0  # wherever it narrows (96 too)
            gqa_split = triton_decode._head_split(args.dqk)
            if gqa_split[1]:
                from mla_attn.ops.decode.triton_decode import _value_tiles
                main, tail = gqa_split
                bdv, bdv2 = _value_tiles(args.dqk, gqa_split, a, warps)
                dims = dict(D1=main, D2=args.dqk - main, DV=args.dqk, BLOCK_D1=main, BLOCK_D2=tail, BLOCK_DV=bdv,
                            BLOCK_DV2=bdv2)
                print(f"head split: score {main} + {tail}, value {bdv} + {bdv2}")
        # The constexprs a launch leaves at their defaults must be given here, or they compile as runtime ints.
        const = dict(STRIDE_UNIT=1, BLOCK_DV2=0, MERGE_DV=wd if args.gqa else 512)
        const.update(S=1, **dims, BLOCK_H=a, BLOCK_N=b,
                     PAGED=args.paged, PAGE_SIZE=64 if args.paged else 1, TILE_IN_PAGE=args.paged and 64 % b == 0,
                     HAS_K2=not args.gqa or bool(gqa_split and gqa_split[1]), V_IS_K1=not args.gqa, IEEE=False, UNCHAIN=args.unchain,
                     BALANCED=args.balanced, MAX_B=64 if args.balanced else 1, FUSED=False, MERGE_ROWS=1, MERGE_CHUNK=1,
                     KV_MAJOR=False, SPLIT_TAIL=args.split_tail,
                     TAIL_PIPELINED=args.tail_pipelined)
        if args.fused:
            rows, chunk = map(int, args.fused.split(","))
            const.update(FUSED=True, MERGE_ROWS=rows, MERGE_CHUNK=chunk)
        if args.stride_unit != 1:
            const["STRIDE_UNIT"] = args.stride_unit
        # --row-align under 16: the cache's and q's leading strides (a d 72 row) are not known 16-divisible.
        kernel = _compile(fn, ptrs, const, warps, stages,
                          aligned=lambda n: n.startswith("stride") and (args.row_align >= 16 or n[-1] in "dp"))
    elif args.kernel == "combine":  # the split-KV combine (ops/decode/combine.py); tiles: BLOCK_R,BLOCK_DV,warps,CHUNK
        from mla_attn.ops.decode.combine import _combine_kernel as fn
        ptrs = {"O_PARTS": "*fp32", "LSE_PARTS": "*fp32", "O": "*bf16", "LSE": "*fp32", "SEQ_LENS": "*i32"}
        const = dict(DV=512, BLOCK_R=a, BLOCK_DV=b, CHUNK=stages, BALANCED=args.balanced, MAX_B=64, PDL=False)
        kernel = _compile(fn, ptrs, const, warps, 3, aligned=lambda n: n.startswith("stride"))
    elif args.kernel == "gluon":  # the experimental Gluon forward (mla_attn/ops/attention/gluon_fwd.py)
        from triton.experimental.gluon import language as gl

        from mla_attn.ops.attention.gluon_fwd import _flash_fwd_gluon as fn

        def desc(rows, cols):
            return f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)!r}>"

        from mla_attn.ops.attention.gluon_fwd import _split_padded

        # widths as ODD_WIDTHS splits them (the same as the default's where that takes them)
        d0, d1, _ = _split_padded(args.dqk)
        dv0, dv1, v_pad = _split_padded(args.dv)
        qa = a // 2 if args.pair else a  # rows of one head in a block (Q's and O's descriptor blocks)
        ptrs = {"q_desc": desc(qa, d0), "k_desc": desc(b, d0), "v_desc": desc(b, dv0), "O": "*bf16", "LSE": "*fp32"}
        if dv1:  # a value tail: a second accumulator
            ptrs["v1_desc"] = desc(b, dv1)
        const = dict(D_QK0=d0, D_QK1=d1, D_V=dv0, D_V1=dv1, DV_TAIL=dv1 - v_pad, BLOCK_M=a, BLOCK_N=b, STAGES=stages, CAUSAL=not args.full,
                     PV_OVERLAP=args.pv_overlap, Q_IN_REGS=args.q_in_regs, TOKEN_MAJOR=args.token_major,
                     num_warps=warps)
        if d1:  # the launcher passes None for the second-half descriptors when there is no second half
            ptrs.update(q1_desc=desc(qa, d1), k1_desc=desc(b, d1))
        else:
            const.update(q1_desc=None, k1_desc=None)
        if args.trace:  # the clock64 stamps (scripts/trace_flash_fwd.py)
            ptrs["TR"] = "*i64"
            const["TRACE"] = True
        else:
            const.update(TR=None, TRACE=False)
        if args.persistent:  # one program an SM, row blocks from a counter or a static snake (experimental)
            ptrs["COUNTER"] = "*i32"
            const.update(PERSISTENT=True, SCHEDULE=args.schedule)
        else:
            const.update(COUNTER=None, PERSISTENT=False)
        const["S1_EARLY"] = args.s1_early
        const["TAIL"] = args.tail
        const["PAIR"] = args.pair
        if not dv1:
            const.update(v1_desc=None, o1_desc=None)
        if args.tma_store:  # the output stored by TMA through Q's buffer
            ptrs["o_desc"] = desc(qa, dv0)
            if dv1:
                ptrs["o1_desc"] = desc(qa, dv1)
            const["TMA_STORE"] = True
        else:
            const.update(o_desc=None, TMA_STORE=False)
            if dv1:
                const["o1_desc"] = None
        if args.block_trace:  # the block-timeline stamps (scripts/trace_flash_blocks.py)
            ptrs["BT"] = "*i64"
            const["BLOCK_TRACE"] = True
        else:
            const.update(BT=None, BLOCK_TRACE=False)
        kernel = _compile(fn, ptrs, const, warps, stages, aligned=lambda n: n.startswith("stride"), maxnreg=args.cap)
    elif args.kernel == "gluon_mla":  # the experimental MLA decode microkernel (ops/decode/gluon_mla.py)
        from triton.experimental.gluon import language as gl

        from mla_attn.ops.decode.gluon_mla import _mla_decode_s1, _mla_decode_ws
        fn = _mla_decode_s1 if args.s_once else _mla_decode_ws

        def desc(rows, cols):
            return f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)!r}>"

        ptrs = {"ql_desc": desc(64, 256), "qr_desc": desc(64, 64), "c_desc": desc(64, 256), "cr_desc": desc(64, 64),
                "SEQ_LENS": "*i32", "BT": "*i32", "O": "*bf16", "LSE": "*fp32"}
        const = dict(STAGES=stages, CONSUMER_REGS=args.consumer_regs, PAGED=args.paged, PAGE_SIZE=64 if args.paged else 1,
                     num_warps=warps)
        if args.s_once:  # the S-once kernel's clock64 stamps (scripts/trace_mla_decode.py): --trace
            if args.trace:
                ptrs["TR"] = "*i64"
                const["TRACE"] = True
            else:
                const.update(TR=None, TRACE=False)
            const["PV_FIRST"] = args.pv_first
            const["DEDICATED"] = args.dedicated
            if args.rows != 64:  # fewer than 64 heads (SMALL_HEADS)
                const["ROWS"] = args.rows
            if args.gather:  # pages smaller than a tile, gathered by cp.async (SMALL_PAGES)
                ptrs.update(c_ptr="*bf16", cr_ptr="*bf16")
                const.update(PAGED=True, PAGE_SIZE=args.gather, GATHER=True)
            else:
                const.update(c_ptr=None, cr_ptr=None, GATHER=False)
        kernel = _compile(fn, ptrs, const, warps, stages, maxnreg=args.maxnreg,
                          aligned=lambda n: n in ("stride_c", "stride_cr"))
    elif args.kernel == "gluon_ws":  # the warp-specialised forward (gluon_fwd_ws.py): tiles 128,BLOCK_N,4,STAGES
        from triton.experimental.gluon import language as gl

        from mla_attn.ops.attention.gluon_fwd_ws import _flash_fwd_ws as fn

        def desc(rows, cols):
            return f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)!r}>"

        ptrs = {"q_desc": desc(64, args.dqk), "k_desc": desc(b, args.dqk), "v_desc": desc(b, args.dv),
                "O": "*bf16", "LSE": "*fp32"}
        const = dict(D=args.dqk, D_V=args.dv, BLOCK_N=b, STAGES=stages, CAUSAL=not args.full, CONSUMER_REGS=232,
                     num_warps=warps)
        kernel = _compile(fn, ptrs, const, warps, stages, aligned=lambda n: n.startswith("stride"), maxnreg=168)
    elif args.kernel in ("gluon_dkdv", "gluon_dq"):  # the Gluon backward passes (gluon_bwd.py)
        from triton.experimental.gluon import language as gl

        from mla_attn.ops.attention.gluon_bwd import _dkdv_gluon, _dq_gluon
        fn = _dkdv_gluon if args.kernel == "gluon_dkdv" else _dq_gluon
        from mla_attn.ops.attention.gluon_fwd import _split_padded

        def desc(rows, cols):
            return f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)!r}>"

        # widths as DKDV_ODD splits them (the same as the default's where that takes them; dQ: Dv one block)
        d0, d1, qk_pad = _split_padded(args.dqk)
        dv0, dv1, v_pad = _split_padded(args.dv) if args.kernel == "gluon_dkdv" else (args.dv, 0, 0)
        ptrs = {"q_desc": desc(a, d0), "q1_desc": desc(a, d1 or d0), "do_desc": desc(a, dv0),
                "k_desc": desc(b, d0), "k1_desc": desc(b, d1 or d0), "v_desc": desc(b, dv0),
                "LSE": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "DQ": "*bf16"}
        const = dict(D_QK0=d0, D_QK1=d1, D_V=dv0, BLOCK_M=a, BLOCK_N=b, STAGES=stages, CAUSAL=not args.full,
                     num_warps=warps)
        if args.kernel == "gluon_dkdv":
            const["D_V1"] = dv1
            if dv1:
                ptrs.update(v1_desc=desc(b, dv1), do1_desc=desc(a, dv1))
            else:
                const.update(v1_desc=None, do1_desc=None)
            const.update(DQK_W=args.dqk if qk_pad else 0, DV_W=args.dv if v_pad else 0)
        if args.kernel == "gluon_dkdv" and not d1:  # as the launcher: no second-half descriptors
            del ptrs["q1_desc"], ptrs["k1_desc"]
            const.update(q1_desc=None, k1_desc=None)
        if args.kernel == "gluon_dkdv":
            const["TOKEN_MAJOR"] = args.token_major
            const["FRESH_DESC"] = args.fresh_desc
            const["HSPLIT"] = args.hsplit
            if args.tma_store:  # dK and dV out by TMA from buffers of their own
                ptrs.update(dk_desc=desc(b, d0), dv_desc=desc(b, dv0))
                if d1:
                    ptrs["dk1_desc"] = desc(b, d1)
                else:
                    const["dk1_desc"] = None
                const["TMA_STORE"] = True
            else:
                const.update(dk_desc=None, dk1_desc=None, dv_desc=None, TMA_STORE=False)
        kernel = _compile(fn, ptrs, const, warps, stages, aligned=lambda n: n.startswith("stride"))
    elif args.kernel == "gluon_fused":  # the one-pass Gluon backward (gluon_bwd_fused.py), d = --dqk
        from triton.experimental.gluon import language as gl

        from mla_attn.ops.attention.gluon_bwd_fused import _bwd_fused_gluon as fn

        def desc(rows, cols):
            return f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)!r}>"

        ptrs = {"q_desc": desc(a, args.dqk), "do_desc": desc(a, args.dv), "k_desc": desc(b, args.dqk),
                "v_desc": desc(b, args.dv), "LSE": "*fp32", "DELTA": "*fp32", "DQ": "*bf16", "DQACC": "*fp32",
                "SEM": "*i32", "DK": "*bf16", "DV": "*bf16"}
        const = dict(D_QK=args.dqk, D_V=args.dv, BLOCK_M=a, BLOCK_N=b, STAGES=stages, CAUSAL=not args.full,
                     TOKEN_MAJOR=args.token_major, num_warps=warps, DQ_MODE=args.dq_mode)
        if args.tma_store:
            ptrs.update(dk_desc=desc(b, args.dqk), dv_desc=desc(b, args.dv))
            const["TMA_STORE"] = True
        else:
            const.update(dk_desc=None, dv_desc=None, TMA_STORE=False)
        if args.bulk:  # dQ_j out by TMA store / reduce-add
            lay32 = gl.NVMMASharedLayout.get_default_for([a, args.dqk], gl.float32)
            ptrs["dqacc_desc"] = f"tensordesc<fp32[{a}, {args.dqk}],{lay32!r}>"
            const.update(BULK=True, CAST=args.cast)
        else:
            const.update(dqacc_desc=None, BULK=False)
        kernel = _compile(fn, ptrs, const, warps, stages, aligned=lambda n: n.startswith("stride"))
    elif args.kernel in ("dkdv", "dq"):  # the Triton backward's two passes (causal, MHA)
        from mla_attn.ops.attention import triton_bwd
        from mla_attn.ops.attention.triton_fwd import split_head_dim, split_value_dim
        fn = triton_bwd._bwd_dkdv_kernel if args.kernel == "dkdv" else triton_bwd._bwd_dq_kernel
        b0, b1 = split_head_dim(args.dqk)
        v0, v1 = split_value_dim(args.dv)
        ptrs = {n: "*bf16" for n in ("Q", "K", "V", "DO", "DK", "DV", "DQ")}
        ptrs.update(LSE="*fp32", DELTA="*fp32")
        if args.kernel == "dq":
            ptrs["DQ"] = "*bf16"
        const = dict(GROUP=1, D_QK=args.dqk, D_V=args.dv, BLOCK_DQK0=b0, BLOCK_DQK1=b1,
                     BLOCK_DV=v0, BLOCK_DV1=v1, CAUSAL=not args.full, BLOCK_M=a, BLOCK_N=b,
                     DOT_PREC="tf32", STRIDE_UNIT=args.stride_unit)
        rows = ("stride_qm", "stride_kn", "stride_vn", "stride_dom", "stride_dkn", "stride_dvn", "stride_dqm")
        kernel = _compile(fn, ptrs, const, warps, stages,
                          aligned=lambda n: (n.startswith("stride") and (args.row_align >= 16 or n not in rows))
                          or n in ("M", "N"))
    else:
        from mla_attn.ops.attention.triton_fwd import _flash_fwd_kernel as fn
        from mla_attn.ops.attention.triton_fwd import split_head_dim, split_value_dim
        b0, b1 = split_head_dim(args.dqk)
        v0, v1 = split_value_dim(args.dv)
        ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32"}
        const = dict(GROUP=1, D_QK=args.dqk, D_V=args.dv, BLOCK_DQK0=b0, BLOCK_DQK1=b1,
                     BLOCK_DV=v0, BLOCK_DV1=v1, CAUSAL=True, BLOCK_M=a, BLOCK_N=b,
                     DOT_PREC="tf32", STRIDE_UNIT=args.stride_unit)
        rows = ("stride_qm", "stride_kn", "stride_vn", "stride_om")
        kernel = _compile(fn, ptrs, const, warps, stages,
                          aligned=lambda n: (n.startswith("stride") and (args.row_align >= 16 or n not in rows))
                          or n in ("M", "N"))
    os.makedirs(args.out, exist_ok=True)
    ttgir, ptx = os.path.join(args.out, "kernel.ttgir"), os.path.join(args.out, "kernel.ptx")
    with open(ttgir, "w") as f:
        f.write(kernel.asm["ttgir"])
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    res = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(args.out, "kernel.cubin")],
                         capture_output=True, text=True)
    log = res.stdout + res.stderr
    for w in sorted(set(re.findall(r"\(C75\d\d\)[^\n]*", log))):
        print("ptxas:", w[:160])
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    print(f"triton {triton.__version__}  {args.kernel} {args.tiles}")
    print(f"shared memory: {kernel.metadata.shared} bytes (H200 limit 232448)")
    print(f"registers: {regs.group(1) if regs else '?'}  spills (store/load bytes): "
          f"{spills.group(1) + '/' + spills.group(2) if spills else '?'}")
    if not regs:
        print("ptxas said:", log.strip()[:600] or f"nothing (exit {res.returncode})")
    print(f"cp.async in PTX: {kernel.asm['ptx'].count('cp.async.cg')}  wgmma: {kernel.asm['ptx'].count('wgmma.mma_async')}")
    mma = [re.search(r"warpsPerCTA = \[[0-9, ]+\].*instrShape = \[[0-9, ]+\]", line)
           for line in kernel.asm["ttgir"].splitlines() if "nvidia_mma" in line and line.startswith("#")]
    print("mma layouts:", "; ".join(m.group(0) for m in mma if m) or "none")
    for line in log.splitlines():
        if "C7513" in line or "C7514" in line or "C75" in line:
            print("ptxas:", line.strip())
    print(f"wrote {ttgir}, {ptx}")


if __name__ == "__main__":
    main()

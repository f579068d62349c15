"""Clock64 stamps for TRACE builds of the Gluon kernels (diagnostics; a constexpr-off build has none).

``stamp(TR, on, who, t, event, TILES, EVENTS)`` writes this SM's ``%clock64`` into
``TR[who, min(t, TILES - 1), event]`` (an int64 buffer of [rows, TILES, EVENTS]) for t < TILES, from the
program that ``on`` marks. The scripts that read the buffers (scripts/trace_mla_decode.py,
scripts/trace_flash_fwd.py) print per-step medians and a raw timeline. The stamps are volatile inline
assembly and a store: they cost registers and issue slots, so a TRACE build runs somewhat slower than
the normal one and its times are upper bounds.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

if AVAILABLE:
    @gluon.jit
    def stamp(TR, on, who, t, event, TILES: gl.constexpr, EVENTS: gl.constexpr):
        slot = (who * TILES + gl.minimum(t, TILES - 1)) * EVENTS + event
        clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [slot], dtype=gl.int64, is_pure=False,
                                        pack=1)
        if on & (t < TILES):
            gl.store(TR + slot, clk)

    @gluon.jit
    def block_stamp(BT, base, k):
        """Block-timeline builds: ``BT[base + k .. base + k + 2]`` = this SM's ``%globaltimer`` (ns),
        ``%clock64`` and ``%smid``. A program stamps three times (entry, key loop done, output stored), so
        the reader gets each block's length in cycles, the SM clock (cycles per ns) and which blocks ran
        back to back on one SM (scripts/trace_flash_blocks.py)."""
        ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [base], dtype=gl.int64, is_pure=False,
                                       pack=1)
        clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [base], dtype=gl.int64, is_pure=False,
                                        pack=1)
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [base], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(BT + base + k, ns)
        gl.store(BT + base + k + 1, clk)
        gl.store(BT + base + k + 2, sm.to(gl.int64))

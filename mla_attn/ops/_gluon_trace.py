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

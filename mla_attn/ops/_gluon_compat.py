"""What the Gluon kernels need from the installed Triton, across its releases.

Gluon is experimental and its API moves. The kernels here were written against, and run on the H200
with, Triton 3.6. Later releases renamed the Hopper TMA copies (``async_copy_global_to_shared`` /
``async_copy_shared_to_global`` became ``async_load`` / ``async_store``; the old load name now raises),
removed ``gl.thread_barrier`` and changed ``warp_specialize``'s arguments (3.9, what CI installs).

- ``tma_load`` / ``tma_store`` / ``thread_barrier`` / ``cp_async``: whichever name this Triton has. The arguments used
  here are the same in both.
- ``VERSION_OK``: this Triton's Gluon builds of these kernels have been run on a GPU (3.6). The
  ``supported()`` checks that route work to the Gluon kernels ask for it, so a newer Triton runs the
  Triton kernels instead of failing to compile, with one warning (``warn_untested``).
  ``MLA_ATTN_GLUON_ANY_TRITON=1`` skips the check, for porting work.
"""

from __future__ import annotations

import warnings

import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

from . import _env

TESTED = ((3, 6),)


def _version(v: str) -> tuple[int, int]:
    parts = v.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


VERSION_OK = _env.flag("MLA_ATTN_GLUON_ANY_TRITON", False) or _version(triton.__version__) in TESTED

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # a CTA-wide barrier, no arguments
# cp.async (per-thread 16-byte copies into shared memory; masked elements are zero-filled) and the arrival
# on an mbarrier when this thread's copies have landed: 3.9 renamed the copy to async_load.
cp_async = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
cp_async_arrive = _async_copy.mbarrier_arrive

_warned = False


def warn_untested() -> None:
    """Once per process: on a Hopper GPU whose Triton is not one the Gluon kernels were run with."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"mla_attn: the Gluon (Hopper) kernels were run on GPUs with Triton "
                      f"{', '.join('.'.join(map(str, t)) for t in TESTED)} only; this is Triton {triton.__version__}, "
                      "so the Triton kernels run instead (slower). MLA_ATTN_GLUON_ANY_TRITON=1 tries the Gluon "
                      "kernels anyway.", RuntimeWarning, stacklevel=3)

# TMA reduction (add) of a shared-memory tile into global memory: Gluon 3.6 has the op in its builder but no
# wrapper in gluon.language.nvidia.hopper.tma. Same bulk async-group as tma_store: tma.store_wait covers it.
from triton._C.libtriton import ir as _ir  # noqa: E402
from triton.experimental.gluon.language._core import builtin as _builtin  # noqa: E402


@_builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

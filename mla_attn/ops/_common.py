"""Helpers shared by the functional ops: implementation choice and argument checks."""

from __future__ import annotations

import functools
import os

import torch

IMPLS = ("auto", "triton", "reference")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. Plain Python: ``triton.cdiv`` goes through Triton's JIT-function wrapper,
    a few microseconds per call on the host path of a decode step."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1); plain Python, like :func:`cdiv`."""
    return 1 << max(int(x) - 1, 0).bit_length()


def triton_interpreting() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1`` set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """Whether the CUDA device is sm_90 (Hopper), looked up once per device (launchers' host path)."""
    return torch.cuda.get_device_capability(device)[0] == 9


def resolve_impl(impl: str, *tensors: torch.Tensor | None, op: str) -> str:
    """Turn ``impl`` into ``"triton"`` or ``"reference"``.

    ``auto`` picks Triton when every tensor is on CUDA in a kernel dtype (fp16, bf16, fp32) and
    Triton imports, the reference elsewhere (float64 included). ``triton`` raises where it cannot
    run; it never falls back silently.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return "reference"
    present = [t for t in tensors if t is not None]
    on_cuda = bool(present) and all(t.is_cuda for t in present)
    kernel_dtype = all(t.dtype in KERNEL_DTYPES for t in present if t.is_floating_point())
    if impl == "auto":
        return "triton" if on_cuda and kernel_dtype and _triton_importable() else "reference"
    if not kernel_dtype:
        dtypes = sorted({str(t.dtype) for t in present if t.is_floating_point()})
        raise ValueError(f"{op}: impl='triton' runs fp16, bf16 and fp32 tensors, got {dtypes}; "
                         "use impl='reference' for float64")
    if not _triton_importable():
        raise RuntimeError(f"{op}: impl='triton' needs the triton package, which is not importable")
    if not on_cuda and not triton_interpreting():
        devices = sorted({str(t.device) for t in present})
        raise RuntimeError(
            f"{op}: impl='triton' needs CUDA tensors (got {devices}); set TRITON_INTERPRET=1 before "
            "importing triton to run the kernels on the CPU interpreter, or use impl='reference'"
        )
    return "triton"


def check_dim(name: str, t: torch.Tensor, dims: tuple[int, ...], layout: str) -> None:
    if t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want} {layout}, got shape {tuple(t.shape)}")


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"{name} must be a floating-point tensor (fp16, bf16, fp32, fp64), got {t.dtype}")


def check_same_dtype(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")


def check_same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must match")

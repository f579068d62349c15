"""Fixtures shared by the ops tests."""

import numpy as np
import pytest
import torch


@pytest.fixture
def nan_decode_outputs(monkeypatch):
    """Every buffer the decode launchers allocate starts as NaN: an element the kernels do not write fails."""
    from mla_attn.ops.decode import combine, triton_decode

    def nan_empty(*shape, dtype=None, device=None):
        return torch.full(*shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_decode, "_alloc", nan_empty)
    monkeypatch.setattr(combine, "_alloc", nan_empty)


def element_addresses(t: torch.Tensor) -> np.ndarray:
    """Byte addresses of every element of t (any strides)."""
    off = torch.zeros((), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        off = off + torch.arange(size).view(shape) * stride
    return t.data_ptr() + off.flatten().numpy() * t.element_size()


class AccessCheck:
    """Every load and store the Triton interpreter runs, checked lane by lane: an address a mask leaves on must be
    among those allowed (``allow``: a tensor's elements, or an array of addresses; ``allow_later``: a function
    giving tensors, looked at on each access, for buffers made during the call). ``bad`` lists (kind, lanes)."""

    def __init__(self):
        self.allowed: list[np.ndarray] = []
        self.later = []
        self.bad: list[tuple[str, int]] = []

    def allow(self, t) -> None:
        self.allowed.append(element_addresses(t) if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.int64))

    def allow_later(self, fn) -> None:
        self.later.append(fn)

    def check(self, kind, ptrs, mask) -> None:
        on = np.asarray(ptrs.data)[np.asarray(mask.data).astype(bool)]
        if not on.size:
            return
        allowed = self.allowed + [element_addresses(t) for fn in self.later for t in fn()]
        ok = np.isin(on, np.concatenate(allowed)) if allowed else np.zeros(on.shape, bool)
        if not ok.all():
            self.bad.append((kind, int((~ok).sum())))


@pytest.fixture
def access_check(monkeypatch):
    """An :class:`AccessCheck` wired into the interpreter (CPU only: skips where kernels run compiled)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("checks the interpreter's accesses (CPU only)")
    import triton.runtime.interpreter as interp

    chk = AccessCheck()
    load, store = interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store

    def checked_load(self, ptrs, mask, other, *args):
        chk.check("load", ptrs, mask)
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        chk.check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", checked_load)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", checked_store)
    return chk

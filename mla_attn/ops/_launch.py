"""Repeated kernel launches without Triton's per-call argument binder.

An eager decode step at batch 1 is bound by the host, not the GPU: its kernels run for tens of
microseconds, and each launch through ``kernel[grid](...)`` first runs Triton's binder (every argument
specialised, a cache key built and looked up) before the driver call. A :class:`Launch` is one launch
whose grid, integer arguments and constexprs are fixed. Its first call goes through the JIT (compiling
if needed) and keeps the compiled kernel; later calls hand the compiled kernel all arguments in
parameter order, skipping the binder.

That is only right while every later call would have compiled to the same kernel. The owner of a
:class:`Launch` must key it on everything Triton specialises on: the integer arguments' values, the
dtypes, and each pointer's 16-byte alignment (:func:`tensor_key` gives the per-tensor part).

The binder is skipped only on CUDA (the interpreter has no compiled kernel) and never while torch.compile
traces. ``MLA_ATTN_FAST_LAUNCH=0`` turns both the skip and the decode launchers' plan cache off: every call
then decides and binds anew.
"""

from __future__ import annotations

import inspect

import torch

from . import _env
from ._common import triton_interpreting

FAST = _env.flag("MLA_ATTN_FAST_LAUNCH", True)
MAX_PLANS = 512  # per cache: a serving loop sees a handful of shapes; a sweep must not grow without bound


def enabled() -> bool:
    """Whether launchers should use plans now: FAST, and not while torch.compile traces (Dynamo captures a
    ``kernel[grid](...)`` launch as a Triton kernel in its graph; a compiled kernel's runner it cannot)."""
    return FAST and not torch.compiler.is_compiling()


class Slot:
    """A placeholder in a :class:`Launch`'s arguments for the ``index``-th per-call value."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def tensor_key(t: torch.Tensor | None):
    """What a launch's specialisation can depend on in one tensor argument (None for no tensor)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


class Launch:
    """``fn[grid](*args, **kwargs, **options)`` with the values of the :class:`Slot` placeholders in
    ``args`` / ``kwargs`` supplied per call: ``launch(v0, v1, ...)``."""

    __slots__ = ("fn", "grid", "args", "kwargs", "options", "runner", "full", "slots")

    def __init__(self, fn, grid, args, kwargs, options):
        self.fn, self.grid, self.args, self.kwargs, self.options = fn, tuple(grid), tuple(args), kwargs, options
        self.runner = None
        self.full = self.slots = None

    def _fill(self, values):
        args = [values[a.index] if isinstance(a, Slot) else a for a in self.args]
        kwargs = {k: values[a.index] if isinstance(a, Slot) else a for k, a in self.kwargs.items()}
        return args, kwargs

    def __call__(self, *values):
        if self.runner is not None:
            full = list(self.full)  # a copy: two threads may launch one plan at once
            for pos, index in self.slots:
                full[pos] = values[index]
            self.runner(*full)
            return
        args, kwargs = self._fill(values)
        compiled = self.fn[self.grid](*args, **kwargs, **self.options)
        if not triton_interpreting() and enabled():
            self._keep(compiled)

    def _keep(self, compiled) -> None:
        """Keep the compiled kernel and this launch's arguments in parameter order (defaults included)."""
        if compiled is None:
            return
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        try:
            names = list(self.fn.arg_names)
            params = self.fn.signature.parameters
            given = dict(zip(names, self.args)) | self.options | self.kwargs  # an option may be a parameter too
            full, slots = [], []
            for pos, name in enumerate(names):
                if name in given:
                    value = given[name]
                elif params[name].default is not inspect.Parameter.empty:
                    value = params[name].default
                else:
                    return
                if isinstance(value, Slot):
                    slots.append((pos, value.index))
                full.append(value)
            runner = compiled[self.grid + (1,) * (3 - len(self.grid))]  # a compiled kernel reads all 3 axes
        except (AttributeError, KeyError, TypeError):  # another Triton's internals: stay on the JIT path
            return
        self.full, self.slots, self.runner = full, tuple(slots), runner


def defaults(fn, names) -> tuple:
    """The default values of ``fn``'s parameters ``names``, in order: a launcher compares its schedule arguments
    with these to decide whether a call may be planned (read from the signature, not copied by hand)."""
    params = inspect.signature(fn).parameters
    return tuple(params[n].default for n in names)


def rebased(template, base):
    """A copy of the TensorDescriptor ``template`` over the tensor ``base``: same shape, strides, block and
    layout, checked when the template was built by ``from_tensor``; a launch reads only the base's data
    pointer from it. ``rebased(d, None)`` makes a template that keeps no tensor alive. The owner's key must
    fix everything but the pointer (:func:`tensor_key`: shape, strides, dtype, 16-byte alignment)."""
    d = object.__new__(type(template))
    d.__dict__.update(template.__dict__)
    d.base = base
    return d


class PlanCache(dict):
    """A bounded dict of launch plans: cleared when full (plans are cheap to rebuild)."""

    def put(self, key, plan):
        if len(self) >= MAX_PLANS:
            self.clear()
        self[key] = plan
        return plan

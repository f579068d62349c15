"""Replay a one-token decode step from a CUDA graph.

A decode step of a small batch is host-bound in eager PyTorch: an MLA layer launches ~46 kernels per
step, ~2 ms of Python and driver work against ~0.1 ms of GPU work (docs/benchmarks.md). A CUDA graph
records the kernels once and replays them with one launch. Our caches are built for this: their
device side (lengths, block tables, rotary positions, the writes, the decode kernels' split count)
never needs the host, while a host mirror of the lengths answers the capacity checks. Replaying a
graph runs none of that Python, so :class:`DecodeGraph` keeps the mirror itself:

* before each replay it checks room for one more token and gives paged caches the pages that token
  needs (host work, plus a small block-table copy, outside the graph);
* capturing records the step without running it, so the mirror is put back as it was after capture;
* after each replay it advances the mirror by one token, as an eager step would have.

Example (CUDA)::

    step = lambda x: run_stack(blocks, x, caches)        # one new token per sequence
    graph = DecodeGraph(step)                            # the first call finds (and checks) the caches
    for t in range(new_tokens):
        y = graph(x_t)                                   # [B, 1, hidden] in, the step's output out

The first call runs the step eagerly (it compiles the kernels and is the warm-up PyTorch asks for
before a capture), the second captures and replays, later ones only replay. Inputs must keep the
shape, dtype and device of the first; caches must keep their shapes (their contents, lengths and
block tables may change: free or reset a sequence and the graph still reads the right lengths). Off
CUDA every call runs the step eagerly, so the same loop runs on a laptop.

Tested on CUDA (H200, H100) by tests/layers/test_decode_graph.py (marked gpu): replay == eager over
30 steps, GQA and MLA, paged and contiguous, with a sequence freed mid-way.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..cache.base import _PagedSlots, _SequenceCache


class DecodeGraph:
    """Run ``step(x)`` (one new token per sequence, writing ``caches``) from a captured CUDA graph.

    Args:
        step: callable taking ``x [B, 1, ...]`` and returning a tensor; it must write each cache it
            uses exactly once per call (one token per sequence) and nothing else that lives across
            calls.
        caches: the caches ``step`` writes (any of mla_attn.cache's caches), or None to take them
            from the first (eager) call, which records every cache the step commits to. Given or
            not, the first call checks that the step commits one token to each of them exactly once
            and to no other cache: a cache the graph wrote without the runner knowing would drift
            from its host-side lengths and pages, which must not pass silently.

    Calling returns a fresh tensor (a copy of the graph's output buffer), never one the next replay
    overwrites.
    """

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor],
                 caches: Sequence[_SequenceCache] | None = None):
        if not callable(step):
            raise ValueError(f"step must be callable, got {type(step).__name__}")
        if caches is not None:
            caches = list(caches)
            bad = [type(c).__name__ for c in caches if not isinstance(c, _SequenceCache)]
            if not caches or bad:
                raise ValueError(f"caches must be None or a non-empty list of mla_attn caches, got "
                                 f"{bad or 'an empty list'}")
        self.step = step
        self.caches = caches
        self.calls = 0
        self._graph = None
        self._x = None
        self._y = None

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != 1:
            raise ValueError(f"x must be [B, 1, ...] (one new token per sequence), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if self._x is not None and (x.shape != self._x.shape or x.dtype != self._x.dtype
                                    or x.device != self._x.device):
            raise ValueError(f"x must keep the captured shape, dtype and device: captured "
                             f"{tuple(self._x.shape)} {self._x.dtype} {self._x.device}, got "
                             f"{tuple(x.shape)} {x.dtype} {x.device}")

    def _first_call(self, x: torch.Tensor) -> torch.Tensor:
        """Run the step eagerly (on CUDA on a side stream: the warm-up PyTorch asks for before a
        capture) while recording which caches it commits to, and check them."""
        committed: list[tuple[_SequenceCache, int]] = []
        original = _SequenceCache._commit_host

        def recording(cache, num_new):
            committed.append((cache, num_new))
            return original(cache, num_new)

        _SequenceCache._commit_host = recording
        try:
            if x.is_cuda:
                side = torch.cuda.Stream(device=x.device)
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    y = self.step(x)
                torch.cuda.current_stream(x.device).wait_stream(side)
            else:
                y = self.step(x)
        finally:
            _SequenceCache._commit_host = original
        found = list({id(c): c for c, _ in committed}.values())
        counts = {id(c): [n for d, n in committed if d is c] for c in found}
        wrong = {type(c).__name__: counts[id(c)] for c in found if counts[id(c)] != [1]}
        if not found or wrong:
            raise ValueError("step must commit exactly one token to each cache it writes, once per call; got "
                             + (f"commits (tokens per call) {wrong}" if wrong else "no cache write at all"))
        if self.caches is None:
            self.caches = found
        elif {id(c) for c in self.caches} != set(counts):
            raise ValueError(f"caches must be exactly the caches step writes: given {len(self.caches)}, the step "
                             f"wrote {len(found)} (a cache left out would drift from its host-side lengths)")
        return y

    def _before_step(self) -> None:
        # What the step's own Python would do on the host: capacity, and pages for the new token.
        for c in self.caches:
            if isinstance(c, _PagedSlots):
                c._allocate(1)
            else:
                c.check_room(1)

    def _after_step(self) -> None:
        for c in self.caches:
            c._commit_host(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        self.calls += 1
        if self.calls == 1:
            return self._first_call(x)
        if not x.is_cuda:
            return self.step(x)
        self._before_step()
        if self._graph is None:
            self._x = x.clone()
            mirrors = [list(c._host_lens) for c in self.caches]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._y = self.step(self._x)
            # Capture ran the step's Python but none of its kernels: undo its host bookkeeping.
            for c, lens in zip(self.caches, mirrors):
                c._host_lens = lens
            self._graph = graph
        else:
            self._x.copy_(x)
        self._graph.replay()
        self._after_step()
        return self._y.clone()

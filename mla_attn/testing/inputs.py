"""Input makers and error checks shared by the tests and the benchmarks."""

from __future__ import annotations

import math

import torch

SENTINEL_PAGE = 2**31 - 8  # block-table filler past a sequence's last page: reading it would fault


def to_paged(cache, seq_lens, page_size, *, extra_pages=3, shuffle=True, poison=True, sentinel=SENTINEL_PAGE,
             generator=None):
    """Turn a token-major contiguous cache ``[B, N, *rest]`` into a paged pool.

    Returns ``(pool [num_pages, P, *rest], block_table int32 [B, ceil(N / P)])``. Each sequence gets
    ``ceil(seq_lens[b] / P)`` pages, placed at shuffled physical positions; unused pages and the
    tail of each last page hold NaN (``poison``), and block-table entries past a sequence's last
    page hold ``sentinel``, so a kernel that reads either fails loudly.
    """
    b, n = cache.shape[:2]
    rest = tuple(cache.shape[2:])
    lens = [int(x) for x in seq_lens.tolist()]
    max_pages = max(1, math.ceil(n / page_size))
    needed = [math.ceil(length / page_size) for length in lens]
    num_pages = sum(needed) + extra_pages
    fill = float("nan") if poison else 0.0
    pool = torch.full((num_pages, page_size) + rest, fill, dtype=cache.dtype, device=cache.device)
    order = torch.randperm(num_pages, generator=generator) if shuffle else torch.arange(num_pages)
    table = torch.full((b, max_pages), sentinel, dtype=torch.int32)
    nxt = 0
    for bi, (length, pages) in enumerate(zip(lens, needed)):
        for lp in range(pages):
            phys = int(order[nxt])
            nxt += 1
            table[bi, lp] = phys
            lo, hi = lp * page_size, min(length, (lp + 1) * page_size)
            pool[phys, : hi - lo] = cache[bi, lo:hi]
    return pool, table.to(cache.device)


def poison_tail(cache, seq_lens, dim=1):
    """A copy of ``cache`` with positions >= seq_lens[b] along token axis ``dim`` set to NaN (batch is dim 0)."""
    out = cache.clone()
    pos = torch.arange(cache.shape[dim], device=cache.device)
    dead = pos.unsqueeze(0) >= seq_lens.to(cache.device).long().unsqueeze(1)  # [B, N]
    shape = [cache.shape[0]] + [1] * (cache.dim() - 1)
    shape[dim] = cache.shape[dim]
    return out.masked_fill(dead.view(shape), float("nan"))


def rel_err(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 over finite entries of ref (NaN in x gives NaN, which fails any bound)."""
    x, ref = x.double(), ref.double()
    keep = torch.isfinite(ref)
    diff = torch.where(keep, x - ref, torch.where(torch.isnan(x), x, torch.zeros_like(x)))
    denom = torch.where(keep, ref, torch.zeros_like(ref)).norm().item()
    return diff.norm().item() / max(denom, 1e-30)


def assert_close(out, ref, *, floor, baseline=None, factor=2.0, name="output"):
    """Fail unless ``rel_err(out, ref) <= max(floor, factor * rel_err(baseline, ref))``.

    ``baseline`` is the same computation done by PyTorch in the kernel's dtype: the kernel may be
    at most ``factor`` times as far from the float64 oracle as PyTorch itself is, and never has to
    beat ``floor`` (the rounding of the output dtype).
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != oracle {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: contains NaN ({int(torch.isnan(out).sum())} elements)"
    err = rel_err(out, ref)
    bound = floor
    if baseline is not None:
        bound = max(floor, factor * rel_err(baseline, ref))
    assert err <= bound, f"{name}: relative error {err:.3e} > bound {bound:.3e} (floor {floor:.1e})"
    return err


def assert_lse_close(lse, ref, *, atol, name="lse"):
    """-inf exactly where the oracle has -inf (rows that see no key); elsewhere |lse - ref| <= atol."""
    assert lse.shape == ref.shape, f"{name}: shape {tuple(lse.shape)} != oracle {tuple(ref.shape)}"
    lse, ref = lse.double(), ref.double()
    dead = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), dead), f"{name}: -inf pattern differs from the oracle"
    assert not torch.isnan(lse).any(), f"{name}: contains NaN"
    if (~dead).any():
        err = (lse[~dead] - ref[~dead]).abs().max().item()
        assert err <= atol, f"{name}: max abs error {err:.3e} > {atol:.1e}"


def dtype_floor(dtype) -> float:
    """Relative-error floor for an output stored in ``dtype`` (a few units of its rounding)."""
    return {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]

"""Leading strides passed in units of their common power of two, so that Triton sees aligned rows.

Triton marks an integer kernel argument as 16-divisible only when its value is. A head of 72 elements makes
row strides of 72 (or 72 * heads), which are not, so every address built from them looks unaligned and the
loads go one element at a time: no ``cp.async`` pipeline, and spills. The launchers pass such strides divided
by the largest power of two that divides them all (:func:`pow2_unit`), and the kernels multiply them back by
that constant (:func:`_in_units`, a ``tl.constexpr`` ``STRIDE_UNIT``): the addresses are the same, and Triton
now knows they are multiples of the unit. Strides that are already multiples of 16 give unit 1, and the
kernel is unchanged.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl


def pow2_unit(strides) -> int:
    """1 when every stride in ``strides`` is a multiple of 16 (or all are 0), else the largest power of two
    dividing them all."""
    g = 0
    for s in strides:
        g = math.gcd(g, s)
    if g == 0 or g % 16 == 0:
        return 1
    return g & -g


@triton.jit
def _in_units(stride_b, stride_h, stride_row, UNIT: tl.constexpr):
    # One tensor's leading strides, passed divided by UNIT (pow2_unit), multiplied back: Triton now knows
    # each is a multiple of UNIT.
    return stride_b * UNIT, stride_h * UNIT, stride_row * UNIT

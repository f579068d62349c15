"""FP8 block dequantization: the exact block formula, edge blocks, and FP8-sized error."""

import math

import pytest
import torch

from mla_attn.convert.fp8 import (
    block_size_from_config,
    dequantize_fp8_block,
    quantize_fp8_block,
    scale_shape,
)

E4M3 = torch.float8_e4m3fn


def block_formula(w8: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """The definition, block by block, written with loops: W[i, j] = float(Wq[i, j]) * s[i//bm, j//bn]."""
    bm, bn = block
    out = torch.empty(w8.shape, dtype=torch.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * bm, (bi + 1) * bm), slice(bj * bn, (bj + 1) * bn)
            out[rows, cols] = w8[rows, cols].to(torch.float32) * s[bi, bj]
    return out


@pytest.mark.parametrize(
    "shape,block",
    [((576, 200), (128, 128)), ((130, 72), (128, 128)), ((1, 1), (128, 128)), ((63, 113), (16, 32)), ((256, 128), (128, 128))],
    ids=["576x200", "130x72", "1x1", "63x113-b16x32", "256x128-aligned"],
)
def test_dequant_equals_block_formula_and_fp8_error(shape, block):
    m, n = shape
    # Magnitudes that differ by block (so a scale applied to the wrong block is visible).
    w = torch.randn(m, n) * torch.logspace(-3, 1, m)[:, None]
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == E4M3 and q.shape == (m, n)
    assert s.dtype == torch.float32 and tuple(s.shape) == (math.ceil(m / block[0]), math.ceil(n / block[1]))

    deq = dequantize_fp8_block(q, s, block, dtype=None)
    assert deq.dtype == torch.float32
    # Exactly the block formula (one float32 multiply per element, edge blocks included).
    assert torch.equal(deq, block_formula(q, s, block))

    # Within FP8 (e4m3) error of the original: 3 mantissa bits give relative rounding <= 2**-4 for
    # normal values; below the smallest normal (2**-6 * scale) the spacing is 2**-9 * scale, so the
    # absolute error is <= 2**-10 * scale. Both bounds are the format's, not tuned; 2**-20 covers the
    # float32 rounding of w / scale before the FP8 cast.
    s_full = s.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :n]
    bound = (2.0**-4 + 2.0**-20) * w.abs() + 2.0**-10 * s_full
    assert ((deq - w).abs() <= bound).all()
    # And the quantizer actually uses the range: every block's max maps to the e4m3 max (448).
    assert torch.allclose(s * torch.finfo(E4M3).max, _block_amax(w, block), rtol=1e-6)

    # Casting happens once, at the end.
    bf = dequantize_fp8_block(q, s, block, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, deq.to(torch.bfloat16))


def _block_amax(w, block):
    m, n = w.shape
    gm, gn = scale_shape((m, n), block)
    out = torch.empty(gm, gn)
    for i in range(gm):
        for j in range(gn):
            out[i, j] = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].abs().max()
    return out


def test_zero_block_and_bad_inputs():
    w = torch.zeros(130, 72)
    w[0, 0] = 3.0
    q, s = quantize_fp8_block(w)
    assert torch.equal(dequantize_fp8_block(q, s, dtype=None), w)
    with pytest.raises(ValueError, match=r"weight_scale_inv.*\[2, 1\].*\[1, 1\]"):
        dequantize_fp8_block(q, s[:1], dtype=None)
    with pytest.raises(ValueError, match="float8"):
        dequantize_fp8_block(w, s)
    with pytest.raises(ValueError, match="2-D"):
        dequantize_fp8_block(q.reshape(-1), s)


def test_quantization_config():
    assert block_size_from_config({}) is None
    assert block_size_from_config({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32]}}
    assert block_size_from_config(cfg) == (64, 32)
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        block_size_from_config({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="weight_block_size"):
        block_size_from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})

"""The experimental Gluon MLA decode microkernel (mla_attn/ops/decode/gluon_mla.py) against the float64
oracle. GPU-only; scripts/gpu_check.sh runs it in a hang-guarded step (a wrong mbarrier phase hangs).
Unused cache slots are NaN. The lengths straddle the 64-key tiles (0, 1, 63, 64, 65, a long one), and
the tolerances are those of the Triton MLA decode tests (within 2x of PyTorch's own bf16 error).
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.testing import mla_decode_oracle
from test_decode_triton import BF16, _check, _lowp_mla

gm = pytest.importorskip("mla_attn.ops.decode.gluon_mla")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gm.AVAILABLE), reason="needs a Hopper GPU and Gluon's warp_specialize")
@pytest.mark.parametrize("h,lens", [(128, [0, 1, 63, 64, 65, 700]), (64, [129, 2048]), (192, [300])],
                         ids=lambda x: str(x))
def test_gluon_mla_decode_matches_oracle(h, lens):
    gen = torch.Generator(device="cuda").manual_seed(h)
    b, n = len(lens), max(max(lens), 1) + 40  # room past the longest: those slots are unused too
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ql = torch.randn(b, h, 512, device="cuda", generator=gen).to(BF16)
    qr = torch.randn(b, h, 64, device="cuda", generator=gen).to(BF16)
    buf = torch.randn(b, n, 576, device="cuda", generator=gen).to(BF16)
    pos = torch.arange(n, device="cuda")
    buf = buf.masked_fill((pos[None, :] >= seq_lens[:, None].long()).unsqueeze(-1), float("nan"))
    scale = 192 ** -0.5
    o, lse = gm.mla_decode_ws(ql, qr, buf, seq_lens, scale)
    c, kr = buf[..., :512], buf[..., 512:]
    q4, r4 = ql.unsqueeze(2), qr.unsqueeze(2)
    ref_o, ref_lse = mla_decode_oracle(q4, r4, c, kr, seq_lens, scale=scale, block_table=None)
    _check(o.unsqueeze(2), lse.unsqueeze(2), ref_o, ref_lse, _lowp_mla(q4, r4, c, kr, seq_lens, None, scale), BF16)

"""Seeded random cases for the decode and flash-attention kernels, against the float64 oracle.

The case lists in test_decode_triton.py and test_attention_triton.py are covering sets picked by hand: each
tile shape, page size or module switch meets only the few shapes listed beside it. Here every draw
combines shape, head counts, lengths (with zeros and ones), page size (1 to 128, and 48), split count,
dtype (fp32 / fp16 under the interpreter; bf16 / fp16 and caches up to 3000 tokens in the ``gpu`` cases),
query magnitude, strided views, tile configuration, and the decode module's switches
(head split, split tail, pipelined tail, page span, fused merge, KV-major order, stride units). Each case
comes from its seed alone, so a failure reproduces from its id, which also spells the draw out.

CI runs 20 cases of each decode kind and 10 flash cases. For a longer hunt after a kernel change, set
``RANDOM_CASES`` (cases per decode kind; flash gets half) and ``RANDOM_FIRST_SEED`` (default 0), e.g.
``RANDOM_CASES=500 RANDOM_FIRST_SEED=1000 pytest -q tests/ops/test_random_cases.py`` (1,250 cases, 6.5 minutes on
a two-core machine). Before spending device time on the ``gpu`` cases, ``scripts/compile_random_cases.py`` compiles
every kernel they would launch for sm_90a on a machine without a GPU.

Tolerances and input poisoning are those of the two modules (their ``_check`` helpers and input makers):
at most 2x the error of PyTorch's own computation in the same dtype, floors ``dtype_floor(dtype)`` for
outputs and 5x that for gradients, NaN in every unused cache slot, page tail and launcher buffer, and
block-table entries past a sequence's last page set to 2**31 - 8.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_attention_triton import _check as _check_flash
from test_decode_triton import _check, _gqa_inputs, _lowp_gqa, _lowp_mla, _mla_inputs

from mla_attn.ops import decode as decode_ops
from mla_attn.ops.attention import triton_fwd
from mla_attn.ops.decode import triton_decode as td
from mla_attn.testing import decode_oracle, mla_decode_oracle

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
N_DECODE = int(os.environ.get("RANDOM_CASES", "20"))  # cases per decode kind (about 40 s in all under the interpreter)
N_FLASH = max(1, N_DECODE // 2)
FIRST_SEED = int(os.environ.get("RANDOM_FIRST_SEED", "0"))
N_DECODE_GPU = 16  # bf16 / fp16 on CUDA, longer caches: compiled kernels for the drawn tiles and switches


@pytest.fixture(autouse=True)
def _poisoned_buffers(nan_decode_outputs, monkeypatch):
    """Every buffer the decode and flash launchers allocate starts as NaN."""
    monkeypatch.setattr(triton_fwd, "_alloc", lambda shape, device, dtype: torch.full(shape, float("nan"),
                                                                                        device=device, dtype=dtype))


def _lens(r: random.Random, b: int, longest: int) -> list[int]:
    return [0 if x < 0.12 else 1 if x < 0.2 else r.randint(2, longest) for x in (r.random() for _ in range(b))]


def _tiles(r: random.Random):
    """A tile configuration of the kind the GPU defaults pick, or None for default_config's own."""
    if r.random() < 0.3:
        return None
    block_h = r.choice([16, 32, 64])
    warps = r.choice([4, 8]) if block_h == 64 else 4
    return td.DecodeConfig(block_h, r.choice([16, 32, 64, 128]), warps, r.choice([1, 2, 3, 4]),
                           unchain=r.choice([None, True]) if warps == 8 else None)


def _fits(cfg, key_bytes: int, q_bytes: int, acc_cols: int) -> bool:
    """Whether a drawn tile plainly fits an SM (a pinned tile that does not is an error by design,
    test_out_of_resources_falls_back_to_smaller_tiles): num_stages key tiles and the query tile under 160 KB of
    shared memory, and the fp32 accumulator at most 128 registers a thread (the default MLA tile of 32 rows x 512
    over 4 warps), so that no drawn tile spills its way through a long compile."""
    if cfg is None:
        return True
    smem = cfg.num_stages * cfg.block_n * key_bytes + cfg.block_h * q_bytes
    return smem <= 160 * 1024 and cfg.block_h * acc_cols // (32 * cfg.num_warps) <= 128


def _switches(r: random.Random, gqa: bool) -> dict:
    sw = dict(SPLIT_TAIL=r.choice([None, True, False]), TAIL_PIPELINED=r.choice([None, True, False]),
              PAGE_SPAN=r.random() < 0.3, FUSED_MERGE=r.random() < 0.3, KV_MAJOR=r.random() < 0.2,
              STRIDE_UNITS=r.random() < 0.8)
    if gqa:
        sw["HEAD_SPLIT"] = r.random() < 0.5
    return sw


def _gqa_draw(seed: int, gpu: bool = False) -> dict:
    r = random.Random(1_000_003 * seed + 1)
    hkv, group = r.choice([1, 1, 2, 3, 4]), r.choice([1, 2, 3, 4, 5, 7, 8, 16, 32])
    d = r.choice([16, 32, 40, 48, 63, 64, 72, 80, 96, 128])
    b, page = r.randint(1, 4), r.choice([None, None, 1, 2, 4, 8, 16, 32, 64, 128, 48])
    c = dict(b=b, hq=hkv * group, hkv=hkv, d=d, dv=r.choice([d, d, 16, 32, 48, 64]), s=r.choice([1, 1, 2, 3, 4]),
             lens=_lens(r, b, r.choice([300, 1000, 3000] if gpu else [20, 80, 200])), page=page,
             splits=r.choice([None, None, 1, 2, 3, 5, 8]), dtype=r.choice([BF16, F16] if gpu else [F32, F16]),
             qmul=r.choice([1.0, 1.0, 30.0, 100.0]), strided=page is None and r.random() < 0.3, api=r.random() < 0.5,
             cfg=_tiles(r), switches=_switches(r, True))
    if gpu and not _fits(c["cfg"], 2 * (c["d"] + c["dv"]), 2 * c["d"], c["dv"]):
        c["cfg"] = None
    return c


def _mla_draw(seed: int, gpu: bool = False) -> dict:
    r = random.Random(1_000_003 * seed + 2)
    dc = r.choice([16, 32, 48, 64, 96, 128, 512])
    b = r.randint(1, 3)
    longest = [300, 1000, 3000] if gpu else [20, 70] if dc == 512 else [20, 80, 160]
    c = dict(b=b, h=r.choice([1, 2, 3, 4, 9, 16, 17, 32, 64, 128]), dc=dc, dr=r.choice([0, 8, 16, 32, 64]),
             s=r.choice([1, 1, 2, 3]), lens=_lens(r, b, r.choice(longest)),
             page=r.choice([None, None, 1, 4, 16, 32, 64, 128, 48]), splits=r.choice([None, None, 1, 2, 3, 5]),
             dtype=r.choice([BF16, F16] if gpu else [F32, F16]), qmul=r.choice([1.0, 1.0, 100.0]),
             api=r.random() < 0.5, cfg=_tiles(r), switches=_switches(r, False))
    if gpu and not _fits(c["cfg"], 2 * (c["dc"] + c["dr"]), 2 * (c["dc"] + c["dr"]), c["dc"]):
        c["cfg"] = None
    return c


def _flash_draw(seed: int) -> dict:
    r = random.Random(1_000_003 * seed + 3)
    hkv, group = r.choice([1, 2, 3]), r.choice([1, 2, 3, 4])
    dqk, dv = r.choice([(16, 16), (32, 16), (48, 32), (64, 64), (32, 48), (64, 80), (72, 72), (40, 40), (8, 24),
                        (128, 128), (192, 128)])
    m = r.choice([1, r.randint(1, 40), r.randint(1, 150)])
    n = r.choice([1, m, r.randint(1, 40), r.randint(1, 160)])
    tiles = r.random() < 0.5 and dqk <= 128 and dv <= 128  # explicit tiles for the three kernels, else the defaults

    def tile():
        return (r.choice([16, 32, 64, 128]), r.choice([16, 32, 64, 128]), 4, 1)

    return dict(b=r.randint(1, 2), hq=hkv * group, hkv=hkv, m=m, n=n, dqk=dqk, dv=dv, causal=r.random() < 0.6,
                dtype=r.choice([F32, F16]), tiles=(tile(), tile(), tile()) if tiles else None)


def _id(prefix: str, seed: int, draw: dict) -> str:
    def short(v):
        if isinstance(v, torch.dtype):
            return str(v)[6:]
        if isinstance(v, td.DecodeConfig):
            return f"{v.block_h}x{v.block_n}w{v.num_warps}s{v.num_stages}" + ("u" if v.unchain else "")
        if isinstance(v, dict):  # the switches set away from their defaults
            return ",".join(f"{k}={short(x)}" for k, x in v.items() if x is not DEFAULTS[k]) or "defaults"
        if isinstance(v, (list, tuple)):
            return "_".join(short(x) for x in v)
        return str(v)

    return f"{prefix}{seed}-" + "-".join(f"{k}{short(v)}" for k, v in draw.items())


DEFAULTS = {name: getattr(td, name) for name in ("SPLIT_TAIL", "TAIL_PIPELINED", "PAGE_SPAN", "FUSED_MERGE", "KV_MAJOR",
                                                 "STRIDE_UNITS", "HEAD_SPLIT")}


def _apply(switches: dict, monkeypatch) -> None:
    for name, value in switches.items():
        monkeypatch.setattr(td, name, value)
    if switches.get("HEAD_SPLIT"):  # the split wherever it narrows the tile, as in test_decode_triton.py
        monkeypatch.setattr(td, "SPLIT_MAX_FILL", 1.0)


GQA_SEEDS = list(range(FIRST_SEED, FIRST_SEED + N_DECODE))
MLA_SEEDS = list(range(FIRST_SEED, FIRST_SEED + N_DECODE))
FLASH_SEEDS = list(range(FIRST_SEED, FIRST_SEED + N_FLASH))


def _run_gqa(seed, c, monkeypatch):
    _apply(c["switches"], monkeypatch)
    torch.manual_seed(seed)
    q, k, v, seq_lens, table = _gqa_inputs(c["b"], c["hq"], c["hkv"], c["d"], c["dv"], c["s"], c["lens"], c["page"],
                                           c["dtype"], c["qmul"], c["strided"], seed=seed)
    scale = c["d"] ** -0.5
    if c["api"] and c["cfg"] is None:
        o, lse = decode_ops.decode_attention(q, k, v, seq_lens, block_table=table, scale=scale,
                                             num_splits=c["splits"], return_lse=True, impl="triton")
    else:
        o, lse = td.gqa_decode(q, k, v, seq_lens, table, scale, c["splits"], config=c["cfg"])
    ref_o, ref_lse = decode_oracle(q, k, v, seq_lens, block_table=table, scale=scale)
    _check(o, lse, ref_o, ref_lse, _lowp_gqa(q, k, v, seq_lens, table, scale), c["dtype"])


def _run_mla(seed, c, monkeypatch):
    _apply(c["switches"], monkeypatch)
    torch.manual_seed(seed)
    ql, qr, kv, kr, seq_lens, table = _mla_inputs(c["b"], c["h"], c["dc"], c["dr"], c["s"], c["lens"], c["page"],
                                                  c["dtype"], c["qmul"], seed=seed)
    scale = 0.125 if c["qmul"] == 1 else 0.05
    if c["api"] and c["cfg"] is None:
        o, lse = decode_ops.mla_decode(ql, qr, kv, kr, seq_lens, scale=scale, block_table=table,
                                       num_splits=c["splits"], return_lse=True, impl="triton")
    else:
        o, lse = td.mla_decode(ql, qr, kv, kr, seq_lens, table, scale, c["splits"], config=c["cfg"])
    ref_o, ref_lse = mla_decode_oracle(ql, qr, kv, kr, seq_lens, scale=scale, block_table=table)
    _check(o, lse, ref_o, ref_lse, _lowp_mla(ql, qr, kv, kr, seq_lens, table, scale), c["dtype"])


@pytest.mark.parametrize("seed", GQA_SEEDS, ids=[_id("gqa", s, _gqa_draw(s)) for s in GQA_SEEDS])
def test_random_gqa_decode(seed, monkeypatch):
    _run_gqa(seed, _gqa_draw(seed), monkeypatch)


@pytest.mark.parametrize("seed", MLA_SEEDS, ids=[_id("mla", s, _mla_draw(s)) for s in MLA_SEEDS])
def test_random_mla_decode(seed, monkeypatch):
    _run_mla(seed, _mla_draw(seed), monkeypatch)


GPU_SEEDS = list(range(100, 100 + N_DECODE_GPU))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS, ids=[_id("gqa", s, _gqa_draw(s, gpu=True)) for s in GPU_SEEDS])
def test_random_gqa_decode_gpu(seed, monkeypatch):
    _run_gqa(seed, _gqa_draw(seed, gpu=True), monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS, ids=[_id("mla", s, _mla_draw(s, gpu=True)) for s in GPU_SEEDS])
def test_random_mla_decode_gpu(seed, monkeypatch):
    _run_mla(seed, _mla_draw(seed, gpu=True), monkeypatch)


@pytest.mark.parametrize("seed", FLASH_SEEDS, ids=[_id("flash", s, _flash_draw(s)) for s in FLASH_SEEDS])
def test_random_flash_attention(seed):
    """Explicit tiles call the three launchers directly; without, the autograd function. Either way q is a transposed
    view and K/V sit inside NaN-padded storage (a one-key cache is passed as it is: its view would be contiguous)."""
    c = _flash_draw(seed)
    torch.manual_seed(seed)
    _check_flash(c["b"], c["hq"], c["hkv"], c["m"], c["n"], c["dqk"], c["dv"], c["causal"], c["dtype"],
                 strided=c["n"] > 1, tiles=c["tiles"])

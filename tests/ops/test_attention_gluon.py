"""The experimental Gluon flash forward (mla_attn/ops/attention/gluon_fwd.py) against the float64 oracle.

GPU-only (Hopper, a Triton with Gluon): run through scripts/gpu_check.sh. Tolerances as for the Triton
kernel: within 2x of PyTorch's own same-dtype attention's error, LSE within LSE_ATOL. Nothing routes
to this kernel until these pass on the H200.
"""

from __future__ import annotations

import pytest
import torch

from mla_attn.testing import assert_close, assert_lse_close, attention_oracle, dtype_floor
from test_attention_triton import LSE_ATOL, _torch_same_dtype
from test_attention_triton import _check as _check_fwd_bwd

gluon_fwd = pytest.importorskip("mla_attn.ops.attention.gluon_fwd")
gluon_bwd = pytest.importorskip("mla_attn.ops.attention.gluon_bwd")

from mla_attn.testing import gluon_gpu  # noqa: E402

HOPPER = gluon_gpu()

# (B, Hq, Hkv, M, N, D_qk, D_v, causal): ragged lengths (M, N not multiples of the tiles), M > N
# (rows that see no key), cached prefix (M < N), GQA and MQA, the head widths the kernel takes.
CASES = [
    (1, 4, 4, 1023, 1024, 128, 128, True),
    (1, 4, 2, 1023, 1024, 128, 128, False),
    (2, 8, 2, 2048, 2048, 128, 128, True),
    (1, 3, 1, 113, 203, 64, 64, True),
    (1, 2, 2, 130, 65, 64, 64, True),
    (1, 2, 2, 1, 1, 64, 64, True),
    (1, 2, 2, 257, 300, 256, 256, False),
    (1, 3, 3, 4224, 4224, 128, 128, True),
    (1, 2, 2, 300, 333, 192, 128, True),   # MLA expanded: Dqk split 128 + 64
    (1, 4, 1, 257, 511, 192, 128, False),
    (2, 8, 8, 1024, 1024, 192, 128, True),
]
PERSISTENT_CASES = CASES + [(4, 16, 4, 2048, 2048, 128, 128, True), (3, 8, 8, 1500, 1500, 192, 128, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, variant", [(c, o) for c in CASES for o in ("overlap", "plain", "overlap-qregs")
                                             if not (o != "plain" and c[6] > 128)],
                         ids=lambda x: x if isinstance(x, str) else
                         "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_matches_oracle(case, variant):
    """bf16, both schedules (the overlapped one exists for Dv <= 128 only: registers), Q read from shared
    memory or held in registers."""
    _check(*case, torch.bfloat16, variant != "plain", q_in_regs=variant.endswith("qregs"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[8]], ids=lambda c: f"M{c[3]}-N{c[4]}-D{c[5]}x{c[6]}")
def test_gluon_forward_fp16(case):
    _check(*case, torch.float16, True)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", PERSISTENT_CASES,
                         ids=lambda x: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_persistent(case, monkeypatch):
    """The persistent schedule (one program an SM, row blocks in a static snake, the next block's loads
    before this block's stores, d 128 output by TMA from a buffer of its own; S_1 early at d 128 as
    routed), forced on at every head width: the default schedule's checks, including batches of more row
    blocks than SMs (the last two cases: 1024 and 288 blocks), so programs take several blocks. Outputs
    start NaN: a block left unwritten fails."""
    _poison_outputs(monkeypatch)
    _check(*case, torch.bfloat16, case[6] <= 128, q_in_regs=case[5] <= 192, persistent=True, schedule=1)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", PERSISTENT_CASES,
                         ids=lambda x: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_persistent_counter_experimental(case, monkeypatch):
    """The persistent schedule's other work order (a relaxed atomic counter; not routed: slower than the
    snake on the H200), without S_1 early."""
    _poison_outputs(monkeypatch)
    _check(*case, torch.bfloat16, case[6] <= 128, q_in_regs=case[5] <= 192, persistent=True, schedule=0,
           s1_early=False)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [c for c in PERSISTENT_CASES if c[7]],
                         ids=lambda x: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
def test_gluon_forward_tail_experimental(case, persistent, monkeypatch):
    """TAIL forced on (the last heads' row blocks launched length-major): every block still written once,
    with the right rows; outputs start NaN."""
    _poison_outputs(monkeypatch)
    _check(*case, torch.bfloat16, case[6] <= 128, q_in_regs=case[5] <= 192, persistent=persistent, tail=True)


# GQA with an even group (head pairs): a partial last strip (M 1023: its rows stored directly), M > N (rows
# that see no key), a cached prefix, one row, MQA with Dqk split 128 + 64, groups of 2 and 4, and a batch of
# more blocks than SMs.
PAIR_CASES = [
    (1, 4, 2, 1023, 1024, 128, 128, True),
    (1, 4, 2, 1023, 1024, 128, 128, False),
    (2, 8, 2, 2048, 2048, 128, 128, True),
    (1, 2, 1, 113, 203, 64, 64, True),
    (1, 4, 2, 130, 65, 64, 64, True),
    (1, 4, 2, 1, 1, 64, 64, True),
    (1, 4, 1, 257, 511, 192, 128, True),
    (4, 16, 4, 2048, 2048, 128, 128, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", PAIR_CASES,
                         ids=lambda x: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
def test_gluon_forward_head_pairs(case, persistent, monkeypatch):
    """Head pairs forced on (a block is 64 rows of each of two query heads sharing a KV head), in the grid and
    the persistent schedule, against the float64 oracle; outputs start NaN, so a row left unwritten or written
    to the wrong head fails."""
    _poison_outputs(monkeypatch)
    _check(*case, torch.bfloat16, case[6] <= 128, q_in_regs=case[5] <= 192, persistent=persistent, pair=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, token_major", [(PAIR_CASES[0], False), (PAIR_CASES[2], False), (PAIR_CASES[2], True),
                                               (PAIR_CASES[6], True)],
                         ids=lambda x: x if isinstance(x, bool) else "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(
                             *x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_head_pairs_match_one_head_blocks(case, token_major, monkeypatch):
    """A row sees the same key tiles in the same order with or without head pairs (a one-head block's extra
    fully masked tile adds p = 0 with alpha = 1), so the outputs are bit for bit the same, head-major or
    token-major inputs, into NaN-poisoned buffers."""
    b, hq, hkv, m, n, dqk, dv, causal = case
    q, k, v, _ = _seeded_qkv(case, token_major, 11)
    _poison_outputs(monkeypatch)
    _assert_same_outputs(*(gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=dqk ** -0.5,
                                                     token_major=token_major, pair=pair) for pair in (True, False)))


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
def test_gluon_forward_head_pairs_need_an_even_group():
    q = torch.randn(1, 9, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pair=True needs an even number"):
        gluon_fwd.flash_fwd_gluon(q, k, k, causal=True, scale=0.125, pair=True)


def _seeded_qkv(case, token_major, seed):
    """bf16 q, k, v on the GPU for a (B, Hq, Hkv, M, N, Dqk, Dv, causal) case from a seeded CPU generator, and
    the generator: [B, H, L, D] tensors, or (token_major) [B, L, H, D] ones seen through transpose(1, 2)."""
    b, hq, hkv, m, n, dqk, dv, _ = case
    gen = torch.Generator().manual_seed(seed)
    dims = ((hq, m, dqk), (hkv, n, dqk), (hkv, n, dv))
    if token_major:
        q, k, v = (torch.randn(b, L, h, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
                   for h, L, d in dims)
    else:
        q, k, v = (torch.randn(b, h, L, d, generator=gen).to("cuda", torch.bfloat16) for h, L, d in dims)
    return q, k, v, gen


def _assert_same_outputs(first, second):
    """Two forwards' (o, lse): the first fully written (no NaN left from the poisoned buffers), both bit for bit
    the same."""
    (o1, lse1), (o2, lse2) = first, second
    assert not torch.isnan(o1).any() and not torch.isnan(lse1).any()
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)


def _assert_dkdv_switch_is_bitwise(case, token_major, seed, switch, monkeypatch):
    """Forward + backward through the public op with gluon_bwd.<switch> "1" and "0", into NaN-poisoned gradient
    buffers: the Gluon dK/dV pass ran both times, every element was written, and the gradients are bit for bit
    the same."""
    from mla_attn.ops.attention import triton_bwd
    from mla_attn.ops.attention.function import flash_attention

    b, hq, hkv, m, n, dqk, dv, causal = case
    *base, gen = _seeded_qkv(case, token_major, seed)
    do = torch.randn(b, hq, m, dv, generator=gen).to("cuda", torch.bfloat16)
    monkeypatch.setattr(triton_bwd, "GLUON_DKDV", True)
    calls = []
    real = gluon_bwd.dkdv_gluon
    monkeypatch.setattr(gluon_bwd, "dkdv_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _poison_outputs(monkeypatch)
    grads = []
    for on in ("1", "0"):
        monkeypatch.setattr(gluon_bwd, switch, on)
        leaves = [t.detach().requires_grad_() for t in base]
        o, _ = flash_attention(*leaves, causal, dqk ** -0.5)
        o.backward(do)
        grads.append([t.grad for t in leaves])
    assert len(calls) == 2, "the Gluon dK/dV pass did not run"
    for a, b_ in zip(*grads):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b_)


def _poison_outputs(monkeypatch):
    from mla_attn.ops.attention import triton_fwd

    monkeypatch.setattr(triton_fwd, "_alloc", lambda shape, device, dtype: torch.full(shape, float("nan"),
                                                                                     device=device, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [c for c in CASES if c[6] <= 128],
                         ids=lambda x: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_s1_early_experimental(case):
    """S_1 issued before tile 0's softmax (S1_EARLY), forced on: single-tile blocks (M = N = 1, the short
    causal rows) take the other branch."""
    _check(*case, torch.bfloat16, True, q_in_regs=case[5] <= 192, persistent=False, s1_early=True)


def _check(b, hq, hkv, m, n, dqk, dv, causal, dtype, overlap, q_in_regs=False, persistent=False, schedule=None,
           s1_early=None, tail=None, pair=None, **tiles):
    """flash_fwd_gluon with these schedule switches (``tiles``: block_m, num_warps, stages, maxnreg) against the
    float64 oracle."""
    scale = dqk ** -0.5
    q = torch.randn(b, hq, m, dqk, device="cuda").to(dtype)
    k = torch.randn(b, hkv, n, dqk, device="cuda").to(dtype)
    v = torch.randn(b, hkv, n, dv, device="cuda").to(dtype)
    o, lse = gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=scale, pv_overlap=overlap, q_in_regs=q_in_regs,
                                       persistent=persistent, schedule=schedule, s1_early=s1_early, tail=tail,
                                       pair=pair, **tiles)
    o_ref, lse_ref = attention_oracle(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    base = _torch_same_dtype(q, k, v, causal, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, floor=dtype_floor(dtype), baseline=base, name="o")
    assert_lse_close(lse, lse_ref, atol=LSE_ATOL[dtype])
    dead = torch.isneginf(lse_ref)
    if dead.any():  # rows that see no key: exact zeros
        assert torch.equal(o[dead].float(), torch.zeros_like(o[dead].float()))


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, overlap, token_major, persistent", [
    (CASES[0], True, False, False),    # M 1023: whole blocks by TMA, the partial last one stored directly
    (CASES[1], True, False, False),    # non-causal GQA
    (CASES[2], True, False, False),    # M 2048: every block by TMA
    (CASES[2], False, False, False),   # the plain schedule
    (CASES[3], True, False, False),    # d 64, one partial block
    (CASES[6], False, False, False),   # d 256
    (CASES[8], True, False, False),    # 192/128: O through Q's 128-wide half
    (CASES[10], True, True, False),    # 192/128 token-major inputs (o is always [B, H, M, Dv])
    (CASES[0], True, False, True),     # persistent: O through its own buffer, the partial last block direct
    (PERSISTENT_CASES[-2], True, False, True),  # persistent, ~8 row blocks a program
], ids=lambda x: x if isinstance(x, bool) else "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(
    *x[:7], "causal" if x[7] else "full"))
def test_gluon_forward_tma_store_matches_direct_stores(case, overlap, token_major, persistent, monkeypatch):
    """The output stored by TMA (through Q's shared-memory buffer in the grid, a buffer of its own in the
    persistent schedule) is bit for bit the output stored from registers, into NaN-poisoned buffers: same
    o, same lse, every element written. S_1 early off in both, so only the stores differ."""
    b, hq, hkv, m, n, dqk, dv, causal = case
    q, k, v, _ = _seeded_qkv(case, token_major, 7)
    _poison_outputs(monkeypatch)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(gluon_fwd, "TMA_STORE", on)
        outs.append(gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=dqk ** -0.5, pv_overlap=overlap,
                                              token_major=token_major, persistent=persistent, s1_early=False))
    _assert_same_outputs(*outs)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
def test_gluon_forward_edge_inputs():
    """No keys (N = 0), no rows (M = 0), and inputs whose storage starts off a 16-byte boundary (TMA)."""
    q = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.bfloat16)
    empty = torch.empty(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    o, lse = gluon_fwd.flash_fwd_gluon(q, empty, empty, causal=False, scale=0.125)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o, lse = gluon_fwd.flash_fwd_gluon(q[:, :, :0], q, q, causal=True, scale=0.125)
    assert o.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)
    # Views one element into a flat buffer: contiguous, but their data pointers are 2 bytes off.
    flat = torch.randn(3 * 2 * 200 * 128 + 1, device="cuda").to(torch.bfloat16)
    q, k, v = (flat[1 + i * 51200: 1 + (i + 1) * 51200].view(1, 2, 200, 128) for i in range(3))
    assert q.data_ptr() % 16 != 0 and q.is_contiguous()
    o, lse = gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=128 ** -0.5)
    o_ref, lse_ref = attention_oracle(q.double(), k.double(), v.double(), causal=True, scale=128 ** -0.5)
    assert_close(o, o_ref, floor=dtype_floor(torch.bfloat16),
                 baseline=_torch_same_dtype(q, k, v, True, 128 ** -0.5), name="o")
    assert_lse_close(lse, lse_ref, atol=LSE_ATOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
def test_public_op_routes_the_forward_to_gluon(monkeypatch):
    """On Hopper bf16 the public op's forward and dK/dV pass are the Gluon kernels (unless
    MLA_ATTN_GLUON=0), with the same outputs and gradients as the Triton kernels' up to bf16 rounding."""
    import mla_attn
    from mla_attn.ops.attention import function

    calls = []
    real = gluon_fwd.flash_fwd_gluon

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(gluon_fwd, "flash_fwd_gluon", counting)
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
    from mla_attn.ops.attention import triton_bwd

    grads = {}
    for on in (True, False):
        monkeypatch.setattr(function, "GLUON_FORWARD", on)
        monkeypatch.setattr(triton_bwd, "GLUON_DKDV", on)
        n0 = len(calls)
        o = mla_attn.ops.attention(q, k, v, causal=True, impl="triton")
        assert len(calls) - n0 == (1 if on else 0)
        grads[on] = (o.detach(),) + torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(grads[True], grads[False]):  # two bf16 kernels: differences at bf16 rounding
        assert torch.isfinite(a).all()
        assert (a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max() + 1e-2


# The Gluon dK/dV pass through the public op (forward + backward against the float64 oracle, gradients
# within 2x of PyTorch's same-dtype error): rows that see no key (M > N), a cached prefix, MQA, lengths
# off the tiles (32 rows, 128 keys), Dv 64, the 192 = 128 + 64 split.
BWD_CASES = [
    (1, 4, 1, 130, 65, 128, 128, True),
    (2, 6, 2, 77, 300, 192, 128, True),
    (1, 3, 3, 1, 1, 64, 64, False),
    (1, 2, 2, 333, 257, 128, 64, False),
    (1, 8, 2, 600, 600, 128, 128, True),
    (2, 8, 2, 512, 512, 128, 128, True),   # whole key blocks only: dK/dV all out by TMA
    (1, 4, 4, 384, 384, 192, 128, True),   # the same with the 128 + 64 split
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, token_major", [
    (BWD_CASES[4], False),   # N 600: four whole key blocks by TMA, the partial last one direct
    (BWD_CASES[5], False),   # every block by TMA
    (BWD_CASES[5], True),    # [B, L, H, D] inputs (dK/dV are always [B, HK, N, D])
    (BWD_CASES[6], False),   # 192/128: dK in two TMA stores
    (BWD_CASES[1], True),    # 192/128, N 300, token-major
], ids=lambda x: x if isinstance(x, bool) else "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(
    *x[:7], "causal" if x[7] else "full"))
def test_gluon_dkdv_tma_store_matches_direct_stores(case, token_major, monkeypatch):
    """dK and dV stored by TMA from their own shared-memory buffers are bit for bit the direct stores' (the
    same forward, the same Triton dQ), into NaN-poisoned gradient buffers: every element written once."""
    _assert_dkdv_switch_is_bitwise(case, token_major, 5, "DKDV_TMA_STORE", monkeypatch)  # "1": 192/128 too


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, token_major", [
    (BWD_CASES[4], False),   # d 128, a partial last key block
    (BWD_CASES[5], True),    # d 128, token-major, whole blocks by TMA
    (BWD_CASES[1], False),   # 192/128 (K in two buffers), N 300
    (BWD_CASES[3], False),   # not causal, Dv 64
], ids=lambda x: x if isinstance(x, bool) else "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(
    *x[:7], "causal" if x[7] else "full"))
def test_gluon_dkdv_fresh_descriptors_match(case, token_major, monkeypatch):
    """K/V's descriptors recomputed each step (``DKDV_FRESH_DESC``) change no arithmetic: the gradients are bit
    for bit those of the default build, into NaN-poisoned buffers."""
    _assert_dkdv_switch_is_bitwise(case, token_major, 11, "DKDV_FRESH_DESC", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("tiles", [(32, 3), (64, 2)], ids=lambda t: f"rows{t[0]}-stages{t[1]}")
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(
    *c[:7], "causal" if c[7] else "full"))
def test_gluon_dkdv_matches_oracle(case, tiles, monkeypatch):
    from mla_attn.ops.attention import triton_bwd

    monkeypatch.setattr(gluon_bwd, "TILES", tiles)

    calls = []
    real = gluon_bwd.dkdv_gluon
    monkeypatch.setattr(gluon_bwd, "dkdv_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(triton_bwd, "GLUON_DKDV", True)
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert calls, "the Gluon dK/dV pass did not run"
    calls.clear()
    # Padded token-major views whose rows stay 16-byte aligned (8 elements of padding), so the op does not copy
    # them (function.aligned_rows copies unaligned rows, and the copies may go to Gluon): the Triton kernels.
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", pad_d=8)
    if max(case[3], case[4]) > 1:  # with M = N = 1 the [B, L, H, D] transposes are contiguous too
        assert not calls, "strided inputs went to the Gluon dK/dV pass (it would copy them)"


# MQA and GQA for the heads split: causal MQA with a partial key block, 192/128, M > N (rows that see no key), not
# causal with Dv 64, and a group of 16 split 2 / 4 / 8 ways.
HSPLIT_CASES = [
    (1, 8, 1, 300, 333, 128, 128, True),
    (2, 8, 2, 257, 257, 192, 128, True),
    (1, 4, 1, 130, 65, 64, 64, True),
    (1, 8, 2, 200, 180, 128, 64, False),
    (2, 16, 1, 256, 256, 128, 128, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, hsplit", [(c, hs) for c in HSPLIT_CASES for hs in ("2", "4", "8", "auto")
                                          if hs == "auto" or (c[1] // c[2]) % int(hs) == 0],
                         ids=lambda x: f"hsplit-{x}" if isinstance(x, str) else
                         "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_dkdv_heads_split_matches_oracle(case, hsplit, monkeypatch):
    """A KV head's query heads split between programs (``DKDV_HSPLIT``), their float32 parts added after: all
    three gradients against the float64 oracle (the Gluon pass ran, with the split the switch asks for)."""
    from mla_attn.ops.attention import triton_bwd

    b, hq, hkv, m, n = case[:5]
    want = gluon_bwd._hsplit(b, hq, hkv, n, 128, torch.device("cuda")) if hsplit == "auto" else int(hsplit)
    if hsplit == "auto":  # these shapes have a few programs: auto splits them
        assert want > 1
    monkeypatch.setattr(gluon_bwd, "DKDV_HSPLIT", hsplit)
    monkeypatch.setattr(triton_bwd, "GLUON_DKDV", True)
    seen = []
    real = gluon_bwd._add_parts
    monkeypatch.setattr(gluon_bwd, "_add_parts", lambda parts, outs, hs: seen.append(hs) or real(parts, outs, hs))
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert seen and set(seen) == {want}, (seen, want)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, token_major", [(HSPLIT_CASES[0], False), (HSPLIT_CASES[1], True),
                                               (HSPLIT_CASES[2], False)],
                         ids=lambda x: x if isinstance(x, bool) else
                         "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_dkdv_heads_split_repeats_and_writes_all(case, token_major, monkeypatch):
    """With the heads split, two backward passes give bit for bit the same gradients (the parts are added in
    one order), every element written (gradient buffers start NaN), and token-major inputs take it too."""
    from mla_attn.ops.attention import triton_bwd
    from mla_attn.ops.attention.function import flash_attention

    b, hq, hkv, m, n, dqk, dv, causal = case
    monkeypatch.setattr(gluon_bwd, "DKDV_HSPLIT", "2")
    monkeypatch.setattr(triton_bwd, "GLUON_DKDV", True)
    *base, gen = _seeded_qkv(case, token_major, 13)
    do = torch.randn(b, hq, m, dv, generator=gen).to("cuda", torch.bfloat16)
    _poison_outputs(monkeypatch)
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in base]
        o, _ = flash_attention(*leaves, causal, dqk ** -0.5)
        o.backward(do)
        grads.append([t.grad for t in leaves])
    for a, b_ in zip(*grads):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b_)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(
    *c[:7], "causal" if c[7] else "full"))
def test_gluon_dq_matches_oracle(case, monkeypatch):
    """The Gluon dQ pass (off by default: correct on the H200, but no faster than the Triton one), forced on."""
    from mla_attn.ops.attention import triton_bwd

    calls = []
    real = gluon_bwd.dq_gluon
    monkeypatch.setattr(gluon_bwd, "dq_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(triton_bwd, "GLUON_DQ", True)
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert calls, "the Gluon dQ pass did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [(2, 8, 2, 300, 333, 128, 128, True), (2, 4, 4, 257, 257, 192, 128, True),
                                  (1, 6, 3, 130, 65, 64, 64, True), (3, 4, 1, 200, 180, 128, 128, False)],
                         ids=lambda c: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*c[:7], "causal" if c[7] else "full"))
def test_gluon_forward_token_major(case):
    """[B, L, H, D] tensors seen through transpose(1, 2), read in place (token_major): tiles past a
    sequence's end read the next sequence's rows, which must stay masked. v as a slice of a wider
    [B, N, H, Dk + Dv] tensor (MLA's kv) is copied instead."""
    b, hq, hkv, m, n, dqk, dv, causal = case
    scale = dqk ** -0.5
    dt = torch.bfloat16
    q = torch.randn(b, m, hq, dqk, device="cuda").to(dt).transpose(1, 2)
    k = torch.randn(b, n, hkv, dqk, device="cuda").to(dt).transpose(1, 2)
    kv = torch.randn(b, n, hkv, dqk + dv, device="cuda").to(dt)
    for v in (torch.randn(b, n, hkv, dv, device="cuda").to(dt).transpose(1, 2), kv[..., dqk:].transpose(1, 2)):
        o, lse = gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=scale, token_major=True)
        o_ref, lse_ref = attention_oracle(q.double(), k.double(), v.double(), causal=causal, scale=scale)
        assert_close(o, o_ref, floor=dtype_floor(dt), baseline=_torch_same_dtype(q, k, v, causal, scale), name="o")
        assert_lse_close(lse, lse_ref, atol=LSE_ATOL[dt])


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [(2, 8, 2, 300, 333, 128, 128, True), (2, 4, 4, 257, 257, 192, 128, True),
                                  (1, 4, 1, 130, 65, 64, 64, False)],
                         ids=lambda c: "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*c[:7], "causal" if c[7] else "full"))
def test_token_major_through_the_op(case, monkeypatch):
    """The layers' layout (token-major on, as by default since it passed here on the H200): the Gluon
    forward and dK/dV pass read [B, L, H, D] tensors in place; output and gradients against the float64
    oracle."""
    import mla_attn
    from mla_attn.ops.attention import function, triton_bwd

    monkeypatch.setattr(function, "GLUON_TOKEN_MAJOR", True)
    monkeypatch.setattr(triton_bwd, "GLUON_TOKEN_MAJOR", True)
    calls = {"fwd": 0, "dkdv": 0}
    real_f, real_b = gluon_fwd.flash_fwd_gluon, gluon_bwd.dkdv_gluon

    def fwd(*a, **kw):
        calls["fwd"] += bool(kw.get("token_major"))
        return real_f(*a, **kw)

    def dkdv(*a, **kw):
        calls["dkdv"] += bool(kw.get("token_major"))
        return real_b(*a, **kw)

    monkeypatch.setattr(gluon_fwd, "flash_fwd_gluon", fwd)
    monkeypatch.setattr(gluon_bwd, "dkdv_gluon", dkdv)
    b, hq, hkv, m, n, dqk, dv, causal = case
    dt, scale = torch.bfloat16, dqk ** -0.5
    xs = [torch.randn(b, m, hq, dqk, device="cuda").to(dt), torch.randn(b, n, hkv, dqk, device="cuda").to(dt),
          torch.randn(b, n, hkv, dv, device="cuda").to(dt)]
    w = torch.randn(b, m, hq, dv, device="cuda").to(dt)  # dO = w.transpose(1, 2): token-major too
    leaves = [x.clone().requires_grad_() for x in xs]
    o = mla_attn.ops.attention(*(t.transpose(1, 2) for t in leaves), causal=causal, scale=scale, impl="triton")
    (o.transpose(1, 2).float() * w.float()).sum().backward()
    assert calls == {"fwd": 1, "dkdv": 1}, calls
    ref_leaves = [x.double().requires_grad_() for x in xs]
    o_ref, _ = attention_oracle(*(t.transpose(1, 2) for t in ref_leaves), causal=causal, scale=scale)
    (o_ref.transpose(1, 2) * w.double()).sum().backward()
    base_leaves = [x.clone().requires_grad_() for x in xs]
    o_base = _torch_same_dtype(*(t.transpose(1, 2) for t in base_leaves), causal, scale)
    (o_base.transpose(1, 2).float() * w.float()).sum().backward()
    floor = dtype_floor(dt)
    assert_close(o, o_ref, floor=floor, baseline=o_base, name="o")
    for name, got, want, base in zip(("dq", "dk", "dv"), leaves, ref_leaves, base_leaves):
        assert torch.isfinite(got.grad).all(), name
        assert_close(got.grad, want.grad, floor=5 * floor, baseline=base.grad, name=name)


# --- Launch plans of the Gluon training launchers (gluon_fwd.DescPlan) -------------------------------------------

PLAN_CASES = [  # (B, Hq, Hkv, M, N, Dqk, Dv, causal), token-major, a strided q (copied for TMA by every call)
    ((2, 8, 2, 300, 333, 128, 128, True), False, False),   # persistent, head pairs, TMA store
    ((2, 8, 2, 300, 333, 128, 128, True), True, False),    # the same read in place as [B, L, H, D]
    ((1, 4, 4, 257, 511, 192, 128, False), False, False),  # 128 + 64 split, grid schedule
    ((1, 3, 1, 113, 203, 64, 64, True), False, True),      # q a non-contiguous view
]


def _plan_inputs(case, token_major, strided, seed):
    q, k, v, gen = _seeded_qkv(case, token_major, seed)
    if strided:  # every other row of a longer q: strides TMA cannot take, so the launcher copies it
        b, hq, _, m, _, dqk, _, _ = case
        q = torch.randn(b, hq, 2 * m, dqk, generator=gen).to("cuda", torch.bfloat16)[:, :, ::2]
    return q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, token_major, strided", PLAN_CASES, ids=lambda x: x if isinstance(x, bool) else
                         "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(*x[:7], "causal" if x[7] else "full"))
def test_gluon_training_plan_replay(case, token_major, strided, monkeypatch):
    """The forward's and the dK/dV pass's cached plans: a replay (rebased descriptors, no binder) is bit for bit a
    launch through the JIT with fresh descriptors, on new inputs of the same layout, into NaN-poisoned outputs;
    each call gets fresh outputs, and one plan a launcher is kept."""
    from mla_attn.ops import _launch

    b, hq, hkv, m, n, dqk, dv, causal = case
    scale = dqk ** -0.5
    _poison_outputs(monkeypatch)
    inputs = [_plan_inputs(case, token_major, strided, seed) for seed in (21, 22, 23)]

    def fwd_bwd(q, k, v):
        o, lse = gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=scale, token_major=token_major)
        do = torch.randn_like(o)
        delta = (o.float() * do.float()).sum(-1)
        dk = torch.full((b, hkv, n, dqk), float("nan"), device="cuda", dtype=q.dtype)
        dv_ = torch.full((b, hkv, n, dv), float("nan"), device="cuda", dtype=q.dtype)
        # the backward's inputs as its router passes them: q, k, v as given, do in the same layout
        do_in = do.transpose(1, 2).contiguous().transpose(1, 2) if token_major else do
        gluon_bwd.dkdv_gluon(q, k, v, do_in, lse, delta, dk, dv_, causal=causal, scale=scale,
                             token_major=token_major)
        return o, lse, dk, dv_

    monkeypatch.setattr(_launch, "FAST", False)
    torch.manual_seed(5)
    expect = [fwd_bwd(*x) for x in inputs]
    assert not gluon_fwd._plans and not gluon_bwd._plans
    monkeypatch.setattr(_launch, "FAST", True)
    torch.manual_seed(5)
    got = [fwd_bwd(*x) for x in inputs]
    torch.cuda.synchronize()
    assert len(gluon_fwd._plans) == 1 and len(gluon_bwd._plans) == 1
    for plan in (*gluon_fwd._plans.values(), *gluon_bwd._plans.values()):
        assert plan.launch.runner is not None, "the replay went through the JIT"
        assert plan.copies == ((True, False, False) if strided else (False, False, False)) + (() if len(
            plan.copies) == 3 else (False,))
    for e, g in zip(expect, got):
        for a, b_ in zip(e, g):
            assert not torch.isnan(b_).any()  # every poisoned element written
            assert torch.equal(a, b_)
    assert len({g[0].data_ptr() for g in got}) == len(got)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
def test_gluon_training_plans_keep_no_tensor_alive():
    """The plans keep descriptor templates, not the first call's tensors: the inputs of a planned call are freed."""
    import gc
    import weakref

    case = (1, 4, 2, 200, 200, 128, 128, True)

    def make_and_run():
        q, k, v, _ = _seeded_qkv(case, False, 3)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        from mla_attn.ops.attention.function import flash_attention

        for _ in range(2):  # plan, then replay
            o, _ = flash_attention(*leaves, True, 0.1)
            o.sum().backward()
        torch.cuda.synchronize()
        assert len(gluon_fwd._plans) == 1 and len(gluon_bwd._plans) == 1
        return [weakref.ref(t) for t in (q, k, v, *leaves, o)]

    refs = make_and_run()
    gc.collect()
    assert all(r() is None for r in refs), "a launch plan kept a tensor alive"


@pytest.mark.skipif(not gluon_fwd.AVAILABLE, reason="needs Triton's Gluon (its host-side descriptors)")
def test_desc_plan_rebases_like_fresh_descriptors():
    """CPU: a DescPlan's replayed descriptors have the layout a fresh ``from_tensor`` gives on the new tensors
    and their data pointers; an input the first call had to copy for TMA is copied again (its values, not its
    strided storage); the templates keep no tensor alive."""
    import gc
    import weakref

    from mla_attn.ops._launch import Slot

    el = gluon_fwd.gl.bfloat16

    def tensors():
        q = torch.randn(2, 3, 40, 64).to(torch.bfloat16)                           # contiguous
        k = torch.randn(2, 30, 3, 64).to(torch.bfloat16).transpose(1, 2)           # token-major
        v = torch.randn(2, 3, 60, 32).to(torch.bfloat16)[:, :, ::2]                # strided: copied
        o = torch.empty(2, 3, 40, 32, dtype=torch.bfloat16)
        return q, k, v, o

    first = tensors()
    views = [gluon_fwd._tma_view(t, True)[0] for t in first[:3]] + [first[3].view(-1, 32)]
    plan = gluon_fwd.DescPlan(True, first[:3], views, el)
    slots = [plan.desc(0, 64, 64), plan.slot("x"), plan.desc(1, 32, 64), plan.desc(2, 32, 32), plan.desc(3, 64, 32)]
    assert [s.index for s in slots] == [0, 1, 2, 3, 4] and isinstance(slots[0], Slot)
    assert plan.copies == (False, False, True)
    assert plan.values(first, {"x": 7})[1] == 7
    plan.done()
    refs = [weakref.ref(t) for t in first + tuple(views)]
    del first, views
    gc.collect()
    assert all(r() is None for r in refs), "a template kept a tensor alive"

    new = tensors()
    got = plan.values(new, {"x": 9})
    assert got[1] == 9
    fresh_bases = [gluon_fwd._tma_view(t, True)[0] for t in new[:3]] + [new[3].view(-1, 32)]
    boxes = [(64, 64), None, (32, 64), (32, 32), (64, 32)]
    for i, src in ((0, 0), (2, 1), (3, 2), (4, 3)):
        fresh = gluon_fwd._desc(fresh_bases[src], *boxes[i], el)
        d = got[i]
        assert (list(d.shape), list(d.strides), list(d.block_shape), d.layout) == \
               (list(fresh.shape), list(fresh.strides), list(fresh.block_shape), fresh.layout)
        if src == 2:  # recopied: a new contiguous tensor with v's values
            assert d.base.data_ptr() != new[2].data_ptr() and d.base.is_contiguous()
            assert torch.equal(d.base.view(2, 3, 30, 32), new[2])
        else:
            assert d.base.data_ptr() == fresh_bases[src].data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("side", [False, True], ids=["one-stream", "side-stream-dq"])
@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
def test_training_step_plans_match_unplanned(side, token_major, monkeypatch):
    """A whole fwd+bwd through the public autograd Function with every launcher replaying its plan (the Gluon
    forward, triton_bwd's preprocess and dQ launches without the binder, the Gluon dK/dV pass) gives bit for
    bit the outputs and gradients of unplanned calls, on new inputs each step, into NaN-poisoned buffers."""
    from mla_attn.ops import _launch
    from mla_attn.ops.attention import triton_bwd
    from mla_attn.ops.attention.function import flash_attention

    case = (2, 8, 2, 300, 333, 128, 128, True)
    monkeypatch.setattr(triton_bwd, "SIDE_STREAM_DQ", side)
    monkeypatch.setattr(triton_bwd, "SIDE_STREAM_MIN_WORK", 0)
    _poison_outputs(monkeypatch)
    steps = []
    for seed in (31, 32, 33):
        q, k, v, gen = _seeded_qkv(case, token_major, seed)
        steps.append((q, k, v, torch.randn(2, 8, 300, 128, generator=gen).to("cuda", torch.bfloat16)))

    def run():
        outs = []
        for q, k, v, do in steps:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o, lse = flash_attention(*leaves, True, 0.09)
            (o.float() * do.float()).sum().add(lse.sum()).backward()
            outs.append([o.detach(), lse.detach()] + [t.grad for t in leaves])
        torch.cuda.synchronize()
        return outs

    monkeypatch.setattr(_launch, "FAST", False)
    expect = run()
    monkeypatch.setattr(_launch, "FAST", True)
    got = run()
    assert len(gluon_fwd._plans) == len(gluon_bwd._plans) == len(triton_bwd._plans) == 1
    plan = next(iter(triton_bwd._plans.values()))
    assert plan.pre.runner is not None and plan.dq.runner is not None and plan.side == side
    for e, g in zip(expect, got):
        for a, b_ in zip(e, g):
            assert not torch.isnan(b_).any() and torch.equal(a, b_)


# ODD_WIDTHS ("auto" since session 32, on an H100's run of these): head widths split into power-of-two TMA blocks, a
# padded tail's columns past the row's end zero-filled by TMA (72 = 64 + 16 - 8, 40 = 32 + 16 - 8), and the value
# head in two accumulators (80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32). Cases: a partial last row block (stored
# directly, its tail columns masked), M > N (rows that see no key), one row, GQA with head pairs, the plain
# schedule (Dv > 128), a power-of-two value head the default does not take (32), Dqk and Dv split differently
# (no TMA store: Q's buffers lack O's block shapes), a non-power-of-two head count.
ODD_CASES = [
    (1, 4, 4, 1023, 1024, 72, 72, True),
    (2, 8, 2, 300, 333, 80, 80, True),
    (1, 3, 1, 113, 203, 96, 96, False),
    (1, 2, 2, 130, 65, 40, 40, True),
    (1, 2, 2, 1, 1, 72, 72, True),
    (1, 4, 2, 257, 300, 160, 160, True),
    (1, 4, 4, 257, 511, 48, 32, False),
    (2, 4, 4, 512, 512, 72, 80, True),
    (1, 2, 2, 300, 333, 192, 72, True),
    (1, 6, 3, 640, 640, 88, 88, True),
]
_ODD_ID = lambda x: x if isinstance(x, str) else "B{}-Hq{}-Hkv{}-M{}-N{}-D{}x{}-{}".format(  # noqa: E731
    *x[:7], "causal" if x[7] else "full")


def test_split_padded_widths():
    """ODD_WIDTHS' splits (plain Python: runs without a GPU): two power-of-two blocks of at least 16 columns, the
    second padded by at most 8, rows a multiple of 8 elements; everything else stays on the Triton kernel."""
    sp = gluon_fwd._split_padded
    assert [sp(d) for d in (16, 64, 128, 256)] == [(16, 0, 0), (64, 0, 0), (128, 0, 0), (256, 0, 0)]
    assert sp(72) == (64, 16, 8) and sp(80) == (64, 16, 0) and sp(96) == (64, 32, 0) and sp(40) == (32, 16, 8)
    assert sp(160) == (128, 32, 0) and sp(192) == (128, 64, 0) and sp(88) == (64, 32, 8) and sp(24) == (16, 16, 8)
    for d in (8, 36, 63, 104, 112, 200, 264):
        assert sp(d) is None, d
    for d in range(16, 257, 8):  # every split covers d exactly once its padding is taken off
        s = sp(d)
        if s is not None:
            d0, d1, pad = s
            assert d0 + d1 - pad == d and d0 & (d0 - 1) == 0 and (d1 == 0 or (d1 >= 16 and d1 & (d1 - 1) == 0))
            assert 0 <= pad <= 8 and (pad == 0 or d1 > 0)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case, variant", [(c, o) for c in ODD_CASES for o in ("overlap-qregs", "plain")
                                             if not (o != "plain" and c[6] > 128)], ids=_ODD_ID)
def test_gluon_forward_odd_widths_match_oracle(case, variant, monkeypatch):
    """ODD_WIDTHS on, bf16, into NaN-poisoned outputs (a column or row left unwritten fails): against the float64
    oracle within 2x of PyTorch's own bf16 error; rows that see no key exactly 0."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    _poison_outputs(monkeypatch)
    b, hq, hkv, m, n, dqk, dv, causal = case
    q = torch.randn(b, hq, m, dqk, device="cuda", dtype=torch.bfloat16)
    assert gluon_fwd.supported(q, torch.empty(b, hkv, n, dqk, device="cuda", dtype=torch.bfloat16),
                               torch.empty(b, hkv, n, dv, device="cuda", dtype=torch.bfloat16))
    _check(*case, torch.bfloat16, variant != "plain", q_in_regs=variant.endswith("qregs") and dqk <= 192)


# Two programs an SM at narrow heads (Dqk, Dv <= 96): the plain schedule capped at 128 registers (8 warps,
# 128 rows), or 64-row blocks of one warpgroup. The cases: d 64 MHA with a partial block, 72 causal GQA (a padded
# tail), 80 with M > N (rows that see no key), 96 non-causal MQA, 88 with its padded value tail.
TWO_PER_SM_CASES = [
    (2, 4, 4, 300, 300, 64, 64, True),
    (1, 8, 2, 257, 511, 72, 72, True),
    (1, 4, 4, 200, 130, 80, 80, True),
    (2, 6, 1, 129, 190, 96, 96, False),
    (1, 6, 3, 640, 640, 88, 88, True),
]
TWO_PER_SM_TILES = {
    "128rows-plain-cap128": dict(block_m=128, num_warps=8, stages=3, maxnreg=128),
    "64rows-4warps-overlap": dict(block_m=64, num_warps=4),
    "64rows-4warps-plain": dict(block_m=64, num_warps=4, stages=3),
}


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", TWO_PER_SM_CASES, ids=_ODD_ID)
@pytest.mark.parametrize("tiles", list(TWO_PER_SM_TILES), ids=str)
def test_gluon_forward_two_per_sm_tiles(case, tiles, monkeypatch):
    """The narrow-head tiles that let two programs share an SM, bf16 into NaN-poisoned outputs, against the
    float64 oracle within 2x of PyTorch's own bf16 error."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    _poison_outputs(monkeypatch)
    overlap = tiles.endswith("overlap")
    _check(*case, torch.bfloat16, overlap, q_in_regs=overlap, **TWO_PER_SM_TILES[tiles])


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", TWO_PER_SM_CASES, ids=_ODD_ID)
def test_gluon_forward_narrow_through_the_op(case, monkeypatch):
    """NARROW on ("auto"), through the public op in the layers' layout ([B, L, H, D] transposes, read in place
    where the width is exact): the token-major test's checks, with the forward launched with NARROW's tiles."""
    monkeypatch.setattr(gluon_fwd, "NARROW", "auto")
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    tiles = []
    real = gluon_fwd._narrow_tiles
    monkeypatch.setattr(gluon_fwd, "_narrow_tiles", lambda *a: tiles.append(real(*a)) or tiles[-1])
    test_token_major_through_the_op(case, monkeypatch)
    assert tiles and tiles[0] is not None, tiles


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [ODD_CASES[0], ODD_CASES[1], ODD_CASES[5]], ids=_ODD_ID)
def test_gluon_forward_odd_widths_fp16(case, monkeypatch):
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    _check(*case, torch.float16, case[6] <= 128)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [ODD_CASES[0], ODD_CASES[1], ODD_CASES[7], ODD_CASES[9]], ids=_ODD_ID)
@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
def test_gluon_forward_odd_widths_tma_store_matches_direct(case, token_major, monkeypatch):
    """The value tail's TMA store (through Q's second buffer, its padding clipped by the descriptor) is bit for
    bit the direct stores' output, into NaN-poisoned buffers; token-major inputs (a padded head dim read from a
    head-major copy, an exact one in place) give the same output as head-major ones."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    b, hq, hkv, m, n, dqk, dv, causal = case
    q, k, v, _ = _seeded_qkv(case, token_major, 11)
    _poison_outputs(monkeypatch)
    outs = []
    for tma in (True, False):
        monkeypatch.setattr(gluon_fwd, "TMA_STORE", tma)
        outs.append(gluon_fwd.flash_fwd_gluon(q, k, v, causal=causal, scale=dqk ** -0.5, token_major=token_major))
    _assert_same_outputs(*outs)
    hm = tuple(t.contiguous() for t in (q, k, v))
    _assert_same_outputs(outs[0], gluon_fwd.flash_fwd_gluon(*hm, causal=causal, scale=dqk ** -0.5))
    o_ref, lse_ref = attention_oracle(*(t.double() for t in (q, k, v)), causal=causal, scale=dqk ** -0.5)
    assert_close(outs[0][0], o_ref, floor=dtype_floor(torch.bfloat16),
                 baseline=_torch_same_dtype(q, k, v, causal, dqk ** -0.5), name="o")


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_fwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
def test_gluon_forward_odd_widths_plan_replay_and_persistent(monkeypatch):
    """A planned call replays on new tensors (a padded q / k copied head-major again, v token-major in place) with
    the first call's outputs for the same inputs; the persistent schedule, which has no value tail, is refused
    by name, and "1" in the environment leaves such calls on the grid."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    case = (2, 8, 2, 300, 333, 72, 80, True)
    first = _seeded_qkv(case, True, 3)[:3]
    again = tuple(t.clone() for t in first)
    o1 = gluon_fwd.flash_fwd_gluon(*first, causal=True, scale=0.1, token_major=True)
    o2 = gluon_fwd.flash_fwd_gluon(*again, causal=True, scale=0.1, token_major=True)
    other = _seeded_qkv(case, True, 4)[:3]
    o3 = gluon_fwd.flash_fwd_gluon(*other, causal=True, scale=0.1, token_major=True)
    assert torch.equal(o1[0], o2[0]) and torch.equal(o1[1], o2[1])
    o_ref, _ = attention_oracle(*(t.double() for t in other), causal=True, scale=0.1)
    assert_close(o3[0], o_ref, floor=dtype_floor(torch.bfloat16),
                 baseline=_torch_same_dtype(*other, True, 0.1), name="o")
    with pytest.raises(ValueError, match="persistent"):
        gluon_fwd.flash_fwd_gluon(*first, causal=True, scale=0.1, persistent=True)
    monkeypatch.setattr(gluon_fwd, "PERSISTENT", "1")
    o4 = gluon_fwd.flash_fwd_gluon(*first, causal=True, scale=0.1)
    assert torch.equal(o4[0], o1[0])


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [ODD_CASES[1], ODD_CASES[3]], ids=_ODD_ID)
def test_gluon_forward_odd_widths_through_the_op(case, monkeypatch):
    """The public op with ODD_WIDTHS on routes these widths' forward to Gluon (the backward stays on Triton):
    forward and all three gradients against the float64 oracle (test_attention_triton's check)."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    calls = []
    real = gluon_fwd.flash_fwd_gluon
    monkeypatch.setattr(gluon_fwd, "flash_fwd_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert calls


# DKDV_ODD: the dK/dV pass at the odd widths (Dv up to 128 in all): Dqk / Dv as two blocks, a padded block's
# columns TMA's zeros, dP^T from two chained wgmmas, dV in two accumulators, stores masked to the real widths.
ODD_BWD_CASES = [c for c in ODD_CASES if c[6] <= 128]


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", ODD_BWD_CASES, ids=_ODD_ID)
def test_gluon_dkdv_odd_widths_match_oracle(case, monkeypatch):
    """Forward and backward through the public op with ODD_WIDTHS and DKDV_ODD on, into NaN-poisoned outputs and
    gradients: the Gluon dK/dV pass runs, and o, lse and all three gradients match the float64 oracle within
    test_attention_triton's bounds (2x PyTorch's own bf16 error)."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    _poison_outputs(monkeypatch)
    calls = []
    real = gluon_bwd.dkdv_gluon
    monkeypatch.setattr(gluon_bwd, "dkdv_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert calls


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", [ODD_CASES[1], ODD_CASES[7], ODD_CASES[9]], ids=_ODD_ID)
def test_gluon_odd_widths_token_major_through_the_op(case, monkeypatch):
    """The layers' layout ([B, L, H, D] seen through transposes) at odd widths, both passes on Gluon: the
    token-major test's checks (a padded head read from a head-major copy, an exact one in place)."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    test_token_major_through_the_op(case, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("hsplit", [2, 4])
def test_gluon_dkdv_odd_widths_heads_split(hsplit, monkeypatch):
    """The heads split with a value tail: float32 parts (poisoned buffers) written at the real widths and added."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_HSPLIT", str(hsplit))
    _poison_outputs(monkeypatch)
    _check_fwd_bwd(1, 8, 1, 300, 333, 72, 80, True, torch.bfloat16, device="cuda", strided=False)


@pytest.mark.skipif(not gluon_fwd.AVAILABLE, reason="needs Triton's Gluon (its host-side descriptors)")
def test_desc_plan_reads_each_input_its_own_way():
    """CPU: with one token-major flag an input (as the odd-width forward passes: padded q and k head-major, v
    token-major), a replay copies q and k head-major again (their values, contiguous) and reads v in place; a
    padded tail's descriptor keeps the row's real width (72), so TMA's bounds supply the zero columns."""
    el = gluon_fwd.gl.bfloat16

    def tensors():
        q = torch.randn(2, 40, 3, 72).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(2, 30, 3, 72).to(torch.bfloat16).transpose(1, 2)
        v = torch.randn(2, 30, 3, 80).to(torch.bfloat16).transpose(1, 2)
        return q, k, v

    majors = (False, False, True)
    first = tensors()
    views = [gluon_fwd._tma_view(t, m)[0] for t, m in zip(first, majors)]
    plan = gluon_fwd.DescPlan(majors, first, views, el)
    plan.desc(0, 64, 64), plan.desc(0, 64, 16), plan.desc(2, 64, 64), plan.desc(2, 64, 16)
    assert plan.copies == (True, True, False)
    plan.done()
    new = tensors()
    got = plan.values(new + (torch.empty(1),), {})
    assert list(got[1].shape) == [2 * 3 * 40, 72] and list(got[1].block_shape) == [64, 16]
    assert got[0].base.is_contiguous() and torch.equal(got[0].base.view(2, 3, 40, 72), new[0])
    assert got[2].base.data_ptr() == new[2].data_ptr() and list(got[2].shape) == [2 * 30, 3 * 80]


class _RecordedLaunch:
    """Stands in for _launch.Launch on the CPU: keeps what would be launched, launches nothing."""
    calls = []

    options = []  # each launch's options (num_warps, maxnreg), in the order of calls

    def __init__(self, fn, grid, args, kwargs, options):
        self.fn, self.grid, self.args, self.kwargs, self.opts = fn, grid, args, kwargs, options

    def __call__(self, *values):
        from mla_attn.ops._launch import Slot

        fill = lambda a: values[a.index] if isinstance(a, Slot) else a  # noqa: E731
        _RecordedLaunch.calls.append(([fill(a) for a in self.args], {k: fill(a) for k, a in self.kwargs.items()}))
        _RecordedLaunch.options.append(dict(self.opts, grid=tuple(self.grid)))


def _host_only(monkeypatch, mod):
    """mod's launcher runs its host side on the CPU: supported, the SM count and the launch faked."""
    _RecordedLaunch.calls, _RecordedLaunch.options = [], []
    monkeypatch.setattr(mod, "supported", lambda *a: True)
    monkeypatch.setattr(mod, "Launch", _RecordedLaunch)
    monkeypatch.setattr(mod, "_num_sms", lambda device: 132)


@pytest.mark.skipif(not gluon_fwd.AVAILABLE, reason="needs Triton's Gluon (its host-side descriptors)")
@pytest.mark.parametrize("dqk, dv, hk, want", [
    (64, 64, 4, (64, 4, 4, True, True, None, False)),     # exact: 64-row blocks of one warpgroup, no head pairs
    (64, 64, 2, (64, 4, 4, True, True, None, False)),     # GQA too (pairs were 0.75x with 64-row blocks)
    (80, 80, 4, (64, 4, 4, True, True, None, False)),
    (96, 96, 2, (64, 4, 4, True, True, None, False)),
    (72, 72, 4, (128, 8, 3, False, False, 128, False)),  # padded: 128 rows, plain schedule, 128 registers
    (88, 88, 2, (128, 8, 3, False, False, 128, True)),   # ... with head pairs by HEAD_PAIR's rule (causal GQA)
    (128, 128, 4, None), (192, 128, 4, None), (64, 32, 4, None), (48, 48, 4, None), (112, 112, 4, None),
])
def test_gluon_forward_narrow_tiles_launch(dqk, dv, hk, want, monkeypatch):
    """CPU, the forward's host side (kernel faked): NARROW's tiles at Dqk = Dv in 64..96 when no schedule argument
    is given -- rows, warps, stages, PV overlap, Q in registers, the register cap, head pairs -- and the default
    tiles elsewhere, with NARROW off, or when the caller names any schedule argument."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    monkeypatch.setattr(gluon_fwd, "PERSISTENT", "auto")
    monkeypatch.setattr(gluon_fwd, "NARROW", "auto")
    _host_only(monkeypatch, gluon_fwd)
    b, h, m = 2, 4, 300
    q = torch.randn(b, h, m, dqk).to(torch.bfloat16)
    k = torch.randn(b, hk, m, dqk).to(torch.bfloat16)
    v = torch.randn(b, hk, m, dv).to(torch.bfloat16)
    if gluon_fwd._split_padded(dqk) is None or gluon_fwd._split_padded(dv) is None:
        assert want is None and gluon_fwd._narrow_tiles(dqk, dv, False) is None
        return

    def launched(**kw):
        _RecordedLaunch.calls, _RecordedLaunch.options = [], []
        gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=0.1, **kw)
        (_, kwargs), = _RecordedLaunch.calls
        opts, = _RecordedLaunch.options
        return (kwargs["BLOCK_M"], opts["num_warps"], kwargs["STAGES"], kwargs["PV_OVERLAP"], kwargs["Q_IN_REGS"],
                opts.get("maxnreg"), kwargs.get("PAIR", False)), opts["grid"]

    tiles, grid = launched()
    default = (128, 8, 4 if dv <= 128 else 3, dv <= 128, dqk <= 192, None, hk < h and h // hk % 2 == 0)
    if want is None:
        assert tiles[:6] == default[:6]
        return
    assert tiles == want
    rows = want[0] // 2 if want[6] else want[0]
    assert grid == (-(-m // rows), b * h // (2 if want[6] else 1))
    # a caller's schedule argument keeps the default tiles; so does NARROW off
    assert launched(stages=4)[0][:2] == (128, 8) and launched(pair=False)[0][:2] == (128, 8)
    monkeypatch.setattr(gluon_fwd, "NARROW", "0")
    assert launched()[0][:6] == default[:6]


@pytest.mark.skipif(not gluon_fwd.AVAILABLE, reason="needs Triton's Gluon (its host-side descriptors)")
@pytest.mark.parametrize("dqk, dv, tails", [(72, 72, (64, 16, 8, 64, 16, 8)), (80, 80, (64, 16, 0, 64, 16, 0)),
                                            (192, 72, (128, 64, 0, 64, 16, 8)), (48, 32, (32, 16, 0, 32, 0, 0)),
                                            (128, 128, (128, 0, 0, 128, 0, 0))])
def test_gluon_forward_odd_widths_launch_arguments(dqk, dv, tails, monkeypatch):
    """CPU, the forward's host side with ODD_WIDTHS on (the kernel faked): each width's blocks as constexprs, a
    value tail's descriptor and real width, padded heads read from head-major copies (token-major otherwise), O
    by TMA only where Q's buffers have O's block shapes, and the persistent schedule refused with a value tail."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    _host_only(monkeypatch, gluon_fwd)
    d0, d1, qk_pad, dv0, dv1, v_pad = tails
    b, h, hk, m, n = 2, 4, 2, 256, 256
    q = torch.randn(b, m, h, dqk).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, n, hk, dqk).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, n, hk, dv).to(torch.bfloat16).transpose(1, 2)
    gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=0.1, token_major=True)
    (args, kw), = _RecordedLaunch.calls
    assert (kw["D_QK0"], kw["D_QK1"], kw["D_V"]) == (d0, d1, dv0)
    assert kw.get("D_V1", 0) == dv1 and kw.get("DV_TAIL", 0) == (dv1 - v_pad if dv1 else 0)
    q_desc, v_desc = args[0], args[4]
    assert list(q_desc.block_shape)[1] == d0 and list(v_desc.block_shape)[1] == dv0
    if dv1:
        assert list(kw["v1_desc"].block_shape) == [64, dv1] and list(kw["v1_desc"].shape)[-1] == (
            dv if v_pad else hk * dv)
    # q: a padded head is a head-major copy ([B * H * M, Dqk]); an exact one read in place ([B * M, H * Dqk])
    assert list(q_desc.shape) == ([b * h * m, dqk] if qk_pad else [b * m, h * dqk])
    assert q_desc.base.data_ptr() != q.data_ptr() if qk_pad else q_desc.base.data_ptr() == q.data_ptr()
    assert kw.get("TMA_STORE", False) == (d0 == dv0 and (dv1 == 0 or d1 == dv1))
    if kw.get("TMA_STORE") and dv1:
        assert list(kw["o1_desc"].block_shape) == [64, dv1] and list(kw["o1_desc"].shape) == [b * h * m, dv]
    assert ("PERSISTENT" in kw) == (dqk == dv == 128)  # "auto": d 128 only
    if dv1:
        with pytest.raises(ValueError, match="persistent"):
            gluon_fwd.flash_fwd_gluon(q, k, v, causal=True, scale=0.1, persistent=True)


@pytest.mark.skipif(not gluon_bwd.AVAILABLE, reason="needs Triton's Gluon (its host-side descriptors)")
@pytest.mark.parametrize("narrow", ["0", "auto"])
@pytest.mark.parametrize("dqk, dv", [(72, 72), (80, 80), (72, 80), (128, 128)])
def test_gluon_dkdv_odd_widths_launch_arguments(dqk, dv, narrow, monkeypatch):
    """CPU, the dK/dV pass's host side with DKDV_ODD on (the kernel faked): the value head's blocks, dO's and V's
    tail descriptors, the real widths for the masked stores, no TMA stores with odd widths, padded tensors
    read head-major; with DKDV_NARROW on, narrow equal widths' descriptors are 64 keys tall."""
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_NARROW", narrow)
    keys = 64 if narrow == "auto" and dqk == dv and 64 <= dv <= 96 else 128
    _host_only(monkeypatch, gluon_bwd)
    b, h, hk, m, n = 1, 4, 2, 200, 200
    q = torch.randn(b, m, h, dqk).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, n, hk, dqk).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, n, hk, dv).to(torch.bfloat16).transpose(1, 2)
    do = torch.randn(b, m, h, dv).to(torch.bfloat16).transpose(1, 2)
    lse, delta = torch.zeros(b, h, m), torch.zeros(b, h, m)
    dk, dv_ = torch.empty(b, hk, n, dqk, dtype=torch.bfloat16), torch.empty(b, hk, n, dv, dtype=torch.bfloat16)
    gluon_bwd.dkdv_gluon(q, k, v, do, lse, delta, dk, dv_, causal=True, scale=0.1, token_major=True, hsplit=1)
    (args, kw), = _RecordedLaunch.calls
    d0, d1, qk_pad = gluon_fwd._split_padded(dqk)
    dv0, dv1, v_pad = gluon_fwd._split_padded(dv)
    assert (kw["D_QK0"], kw["D_QK1"], kw["D_V"], kw.get("D_V1", 0)) == (d0, d1, dv0, dv1)
    assert kw.get("DQK_W", 0) == (dqk if qk_pad else 0) and kw.get("DV_W", 0) == (dv if v_pad else 0)
    odd = bool(dv1 or qk_pad or v_pad)
    assert "TMA_STORE" not in kw if odd else kw.get("TMA_STORE") is True
    if dv1:
        assert list(kw["v1_desc"].block_shape) == [keys, dv1] and list(kw["do1_desc"].block_shape)[1] == dv1
    q_desc = args[0]
    assert list(q_desc.shape) == ([b * h * m, dqk] if qk_pad else [b * m, h * dqk])


@pytest.mark.skipif(not gluon_bwd.AVAILABLE, reason="needs Triton's Gluon (its host-side descriptors)")
@pytest.mark.parametrize("dqk, dv, narrow", [(64, 64, True), (80, 80, True), (96, 96, True), (72, 72, True),
                                             (128, 128, False), (64, 32, False), (192, 128, False)])
def test_gluon_dkdv_narrow_tiles_launch(dqk, dv, narrow, monkeypatch):
    """CPU, the dK/dV pass's host side (kernel faked) with DKDV_NARROW on: 64-key one-warpgroup programs (twice the
    key blocks in the grid, 64 rows, 2 stages) at Dqk = Dv in 64..96 when no tile is given; the default 128 keys on
    8 warps elsewhere, with DKDV_NARROW off, when a tile is given, or when TILES is set."""
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_NARROW", "auto")
    _host_only(monkeypatch, gluon_bwd)
    b, h, hk, m, n = 1, 4, 2, 200, 300
    q, do = torch.randn(b, h, m, dqk).to(torch.bfloat16), torch.randn(b, h, m, dv).to(torch.bfloat16)
    k, v = torch.randn(b, hk, n, dqk).to(torch.bfloat16), torch.randn(b, hk, n, dv).to(torch.bfloat16)
    lse, delta = torch.zeros(b, h, m), torch.zeros(b, h, m)
    dk, dv_ = torch.empty(b, hk, n, dqk, dtype=torch.bfloat16), torch.empty(b, hk, n, dv, dtype=torch.bfloat16)

    def launched(**kw):
        _RecordedLaunch.calls, _RecordedLaunch.options = [], []
        gluon_bwd.dkdv_gluon(q, k, v, do, lse, delta, dk, dv_, causal=True, scale=0.1, hsplit=1, **kw)
        (_, kwargs), = _RecordedLaunch.calls
        opts, = _RecordedLaunch.options
        return kwargs["BLOCK_N"], opts["num_warps"], kwargs["BLOCK_M"], kwargs["STAGES"], opts["grid"][0]

    default = (128, 8) + gluon_bwd._tiles(dqk) + (-(-n // 128),)
    assert launched() == ((64, 4, 64, 2, -(-n // 64)) if narrow else default)
    assert launched(stages=default[3]) == default
    monkeypatch.setattr(gluon_bwd, "TILES", default[2:4])
    assert launched() == default
    monkeypatch.setattr(gluon_bwd, "TILES", None)
    monkeypatch.setattr(gluon_bwd, "DKDV_NARROW", "0")
    assert launched() == default


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and gluon_bwd.AVAILABLE), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("case", TWO_PER_SM_CASES, ids=_ODD_ID)
@pytest.mark.parametrize("tiles", [None, (64, 4, 32, 3)], ids=["narrow-auto", "keys64-rows32-stages3"])
def test_gluon_dkdv_narrow_tiles_match_oracle(case, tiles, monkeypatch):
    """The dK/dV pass on 64-key one-warpgroup programs (DKDV_NARROW's tiles, and 32 rows with 3 stages), through
    the public op into NaN-poisoned outputs and gradients: o, lse and all three gradients against the float64
    oracle within 2x PyTorch's own bf16 error."""
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", True)
    monkeypatch.setattr(gluon_bwd, "DKDV_NARROW", "auto")
    if tiles is not None:
        monkeypatch.setattr(gluon_bwd, "_dkdv_narrow_tiles", lambda d_qk, d_v: tiles)
    _poison_outputs(monkeypatch)
    launched = []
    real = gluon_bwd.Launch
    monkeypatch.setattr(gluon_bwd, "Launch", lambda fn, grid, a, kw, o: launched.append(kw["BLOCK_N"]) or
                        real(fn, grid, a, kw, o))
    _check_fwd_bwd(*case, torch.bfloat16, device="cuda", strided=False)
    assert launched and set(launched) == {64}, launched


def test_odd_width_switches_auto_rule(monkeypatch):
    """CPU: which widths each switch's modes take. "auto" (default): first blocks of at least 64 and (forward) Dv
    <= 128, the widths that measured faster than the Triton kernels on the H100 (72, 80, 96); not 40 or 160, which
    were slower; "1" every width the kernel can take; "0" none. The dK/dV pass never takes Dv > 128."""
    fwd, bwd = gluon_fwd._odd_split, gluon_bwd._dkdv_odd_split
    monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", "auto")  # the defaults (docs/switches.md's test checks them)
    monkeypatch.setattr(gluon_bwd, "DKDV_ODD", "auto")
    for d in (72, 80, 88, 96):
        assert fwd(d, d) is not None and bwd(d, d) is not None, d
    assert fwd(72, 80) == ((64, 16, 8), (64, 16, 0)) and fwd(192, 72) is not None
    for dqk, dv in ((40, 40), (48, 32), (160, 160), (104, 104)):
        assert fwd(dqk, dv) is None and bwd(dqk, dv) is None, (dqk, dv)
    for on in ("1", True):
        monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", on)
        monkeypatch.setattr(gluon_bwd, "DKDV_ODD", on)
        assert fwd(40, 40) is not None and fwd(160, 160) is not None and fwd(48, 32) is not None
        assert bwd(40, 40) is not None and bwd(160, 160) is None and bwd(256, 64) is None
    for off in ("0", False):
        monkeypatch.setattr(gluon_fwd, "ODD_WIDTHS", off)
        monkeypatch.setattr(gluon_bwd, "DKDV_ODD", off)
        assert fwd(72, 72) is None and bwd(80, 80) is None

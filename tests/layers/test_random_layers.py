"""Seeded random layers fed through their caches in random chunks equal the training path.

test_decode.py checks hand-picked configs and chunk schedules. Each case here draws the layer (MLA: heads, latent
rank, nope / rope / value widths with rope 0 among them, q_lora or not, YaRN or none, interleaved rope or not; GQA:
heads, KV heads, head width, bias), the batch, the length, the schedule of chunks (prefill, single tokens, multi-token
steps), the cache (contiguous, or paged with pages of 1 to 64 handed out shuffled), the MLA path, and the kernels
(the pure-PyTorch reference, or the Triton kernels, under the interpreter on a CPU). Caches start NaN-filled and hold
more tokens than are written, so a read of an unwritten slot turns the output NaN.

Tolerance as in test_decode.py (fp32): relative error <= 1e-5 against the layer on the whole sequence.
"""

from __future__ import annotations

import random

import pytest
import torch

from layer_kit import YARN, randomize
from mla_attn.layers import GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention
from mla_attn.testing import rel_err

TOL = 1e-5
SEEDS = list(range(12))


def _draw(seed: int) -> dict:
    r = random.Random(7_919 * seed + 5)
    c = dict(kind=("mla", "gqa")[seed % 2], impl=r.choice(["reference", "triton"]), hidden=r.choice([32, 48, 64]))
    if c["kind"] == "mla":
        c.update(heads=r.choice([1, 2, 3, 5, 8]), rank=r.choice([16, 24, 32, 64]), nope=r.choice([8, 12, 16, 32]),
                 rope=r.choice([0, 4, 8, 16]), v=r.choice([8, 10, 16, 32]), q_lora=r.choice([None, 24, 40]),
                 yarn=r.random() < 0.5, interleave=r.random() < 0.5,
                 path=r.choice([None, None, "expanded", "absorbed"]))
    else:
        kv = r.choice([1, 2, 3])
        c.update(heads=kv * r.choice([1, 2, 3, 4]), kv_heads=kv, head_dim=r.choice([8, 16, 24, 32]),
                 bias=r.random() < 0.5)
    c.update(b=r.randint(1, 3), t=r.randint(1, 70), page=r.choice([None, 1, 4, 16, 64]), spare=r.randint(0, 9))
    chunks, left = [], c["t"]
    while left:
        chunks.append(min(left, r.choice([1, 1, 2, 3, 5, r.randint(1, 30)])))
        left -= chunks[-1]
    c["chunks"] = chunks
    return c


def _layer(c: dict) -> torch.nn.Module:
    if c["kind"] == "mla":
        cfg = MLAConfig(hidden_size=c["hidden"], num_attention_heads=c["heads"], kv_lora_rank=c["rank"],
                        qk_nope_head_dim=c["nope"], qk_rope_head_dim=c["rope"], v_head_dim=c["v"],
                        q_lora_rank=c["q_lora"], rope_scaling=YARN if c["yarn"] else None,
                        rope_interleave=c["interleave"], max_position_embeddings=163840)
        return randomize(MultiHeadLatentAttention(cfg, impl=c["impl"])).eval()
    return randomize(GroupedQueryAttention(c["hidden"], c["heads"], c["kv_heads"], head_dim=c["head_dim"],
                                           attention_bias=c["bias"], impl=c["impl"])).eval()


def _id(seed: int) -> str:
    c = _draw(seed)
    return f"seed{seed}-" + "-".join(f"{k}{'_'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in c.items())


@pytest.mark.parametrize("seed", SEEDS, ids=[_id(s) for s in SEEDS])
@torch.no_grad()
def test_random_layer_cached_chunks_equal_training(seed):
    c = _draw(seed)
    torch.manual_seed(seed)
    layer = _layer(c)
    b, t = c["b"], c["t"]
    x = torch.randn(b, t, c["hidden"])
    ref = layer(x)
    cache = layer.new_cache(b, t + c["spare"], page_size=c["page"], shuffle_seed=None if c["page"] is None else seed)
    cache.fill_(float("nan"))
    ys, pos = [], 0
    path = {} if c.get("path") is None else {"path": c["path"]}  # MLA: forced on every chunk, the first included
    for n in c["chunks"]:
        ys.append(layer(x[:, pos:pos + n], cache=cache, **path))
        pos += n
    assert cache.host_seq_lens == [t] * b
    assert rel_err(torch.cat(ys, dim=1), ref) <= TOL

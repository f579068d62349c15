"""Checkpoint builders for tests/convert, made on the fly (no downloads): tiny DeepSeek-V3 models
saved sharded, and an FP8 block-quantized variant written the way DeepSeek ships V3 (weight +
weight_scale_inv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from mla_attn.convert.fp8 import dequantize_fp8_block, quantize_fp8_block  # noqa: E402

# Prepended to the peak-memory subprocess scripts: resident-set readings from /proc (Linux only).
PEAK_RSS_HELPERS = """
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
"""

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
FP8_BLOCK = [128, 128]
FP8_QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": FP8_BLOCK}
# Attention weights quantized in the FP8 fixture (DeepSeek-V3 quantizes every linear weight; the
# layernorms and biases stay in high precision).
FP8_NAMES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def tiny_config(*, q_lora_rank=None, attention_bias=False, num_hidden_layers=2, **sizes) -> DeepseekV3Config:
    """A dense (no MoE: first_k_dense_replace >= layers) DeepSeek-V3 with odd sizes and YaRN."""
    kw = dict(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=40,
        moe_intermediate_size=8,
        num_attention_heads=3,
        kv_lora_rank=20,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        max_position_embeddings=128,
    )
    kw.update(sizes)
    kw["num_key_value_heads"] = kw["num_attention_heads"]
    return DeepseekV3Config(
        num_hidden_layers=num_hidden_layers,
        first_k_dense_replace=num_hidden_layers + 1,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=q_lora_rank,
        attention_bias=attention_bias,
        rope_scaling=dict(YARN),
        rope_interleave=True,
        attn_implementation="eager",
        **kw,
    )


def build_model(config: DeepseekV3Config, seed: int) -> DeepseekV3ForCausalLM:
    """HF model with weights large enough that attention is far from uniform (a wrong scale, rope or
    head split changes the output by O(1), not by 1e-4)."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * 1.5)
    return model


def write_config(folder: Path, config_dict: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2))


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], num_shards: int, config_dict: dict) -> dict:
    """Write tensors over `num_shards` files (round-robin by sorted name) with an HF index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k::num_shards]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_config(folder, config_dict)
    return weight_map


class Fixture:
    """A checkpoint folder plus the HF model whose attention it must reproduce."""

    def __init__(self, path: Path, model: DeepseekV3ForCausalLM, expected: dict[int, dict[str, torch.Tensor]]):
        self.path = path
        self.model = model  # HF model holding exactly the weights the folder decodes to
        self.expected = expected  # {layer: {name: tensor}} that load_checkpoint(dtype=None) must return


def attention_weights(model) -> dict[int, dict[str, torch.Tensor]]:
    return {
        i: {k: v.detach().clone() for k, v in layer.self_attn.state_dict().items()}
        for i, layer in enumerate(model.model.layers)
    }


def make_hf_fixture(path: Path, *, q_lora_rank, attention_bias=False, seed=0) -> Fixture:
    model = build_model(tiny_config(q_lora_rank=q_lora_rank, attention_bias=attention_bias), seed)
    model.save_pretrained(path, max_shard_size="12KB")
    assert len(list(path.glob("*.safetensors"))) >= 4, "fixture must be multi-shard"
    return Fixture(path, model, attention_weights(model))


def make_fp8_fixture(path: Path, *, seed=1, mtp=True) -> Fixture:
    """An FP8 checkpoint whose attention shapes are not multiples of the 128 block:
    kv_a_proj_with_mqa 576 x 200 (DeepSeek-V3's 576 rows), q_a_proj 130 x 200, q_b_proj 240 x 130,
    kv_b_proj 120 x 512, o_proj 200 x 72. Every quantized weight gets a float32 weight_scale_inv;
    one scale is moved to a different shard than its weight. With `mtp`, an extra
    multi-token-prediction layer (index num_hidden_layers) is stored as DeepSeek-V3 does."""
    config = tiny_config(
        q_lora_rank=130,
        hidden_size=200,
        num_attention_heads=3,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=16,
        v_head_dim=24,
        intermediate_size=32,
    )
    model = build_model(config, seed)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = config.num_hidden_layers
    if mtp:
        for k, v in list(sd.items()):
            if k.startswith("model.layers.0.self_attn."):
                sd[k.replace("model.layers.0.", f"model.layers.{n}.")] = v.clone() * 0.5
        sd[f"model.layers.{n}.eh_proj.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size)
    tensors = {}
    deq = {}
    for k, v in sd.items():
        parts = k.split(".")
        if len(parts) > 4 and parts[3] == "self_attn" and parts[4] in FP8_NAMES and parts[-1] == "weight":
            q, s = quantize_fp8_block(v, tuple(FP8_BLOCK))
            tensors[k] = q
            tensors[k + "_scale_inv"] = s
            deq[k] = dequantize_fp8_block(q, s, tuple(FP8_BLOCK), dtype=torch.float32)
        else:
            tensors[k] = v
    config_dict = config.to_dict()
    config_dict["quantization_config"] = dict(FP8_QUANT_CONFIG)
    config_dict["num_nextn_predict_layers"] = 1 if mtp else 0
    config_dict.pop("_attn_implementation_autoset", None)
    weight_map = write_sharded(path, tensors, 3, config_dict)
    # Move one scale to a shard other than its weight's (DeepSeek-V3's index allows it).
    w = "model.layers.1.self_attn.kv_b_proj.weight"
    _move_tensor(path, w + "_scale_inv", [f for f in sorted(set(weight_map.values())) if f != weight_map[w]][0])
    # The reference HF model holds the dequantized weights.
    with torch.no_grad():
        for k, v in deq.items():
            if k in model.state_dict():
                model.state_dict()[k].copy_(v)
    (path / "tokenizer_config.json").write_text("{}")  # an extra file the converter must copy
    return Fixture(path, model, attention_weights(model))


def _move_tensor(folder: Path, name: str, to_file: str) -> None:
    from safetensors.torch import load_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    src = index["weight_map"][name]
    if src == to_file:
        return
    a, b = load_file(str(folder / src)), load_file(str(folder / to_file))
    b[name] = a.pop(name)
    save_file(a, str(folder / src), metadata={"format": "pt"})
    save_file(b, str(folder / to_file), metadata={"format": "pt"})
    index["weight_map"][name] = to_file
    index_path.write_text(json.dumps(index, indent=2))


def hf_attention_forward(model: DeepseekV3ForCausalLM, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Causal self-attention output of HF layer `layer` on x [B, T, hidden], called as
    DeepseekV3Model.forward calls it (rotary embeddings from the model, additive causal mask)."""
    attn = model.model.layers[layer].self_attn
    b, t, _ = x.shape
    positions = torch.arange(t)[None].expand(b, t)
    cos, sin = model.model.rotary_emb(x, positions)
    mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)[None, None]  # [1, 1, T, T]
    with torch.no_grad():
        return attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)[0]

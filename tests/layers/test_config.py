"""MLAConfig / GQAConfig: the repository's configs, from_hf in every accepted form, cache byte counts,
and loading absorbed weights (w_uk / w_uv) in place of kv_b_proj."""

import json
from pathlib import Path

import pytest
import torch

from layer_kit import YARN, randomize, small_mla_config
from mla_attn.layers import GQAConfig, GroupedQueryAttention, MLAConfig, MultiHeadLatentAttention

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MLA_FILES = ["DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "Kimi-K2", "Moonlight-16B-A3B"]
LLAMA_FILES = ["Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B"]

# Published attention dimensions: hidden, heads, q_lora_rank, rope_theta, layers, yarn factor (None: no scaling).
MLA_PUBLISHED = {
    "DeepSeek-V2-Lite": (2048, 16, None, 10000.0, 27, 40),
    "DeepSeek-V2": (5120, 128, 1536, 10000.0, 60, 40),
    "DeepSeek-V3": (7168, 128, 1536, 10000.0, 61, 40),
    "Kimi-K2": (7168, 64, 1536, 50000.0, 61, 32),
    "Moonlight-16B-A3B": (2048, 16, None, 50000.0, 27, None),
}
LLAMA_PUBLISHED = {"Llama-3.1-8B": (4096, 32, 32), "Llama-3.1-70B": (8192, 64, 80), "Llama-3.1-405B": (16384, 128, 126)}


def test_configs_folder_holds_exactly_the_expected_files():
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == sorted(MLA_FILES + LLAMA_FILES)


@pytest.mark.parametrize("name", MLA_FILES)
def test_mla_config_files(name):
    cfg = MLAConfig.from_file(CONFIGS / f"{name}.json")
    hidden, heads, q_lora, theta, layers, factor = MLA_PUBLISHED[name]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.rope_theta, cfg.num_hidden_layers) == \
        (hidden, heads, q_lora, theta, layers)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (512, 128, 64, 128)
    assert cfg.rope_interleave is True
    if factor is None:
        assert cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == factor
        assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    # The raw file keeps the model's own config.json names.
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    assert "q_lora_rank" in raw and raw["num_key_value_heads"] == heads


@pytest.mark.parametrize("name", LLAMA_FILES)
def test_llama_config_files(name):
    cfg = GQAConfig.from_file(CONFIGS / f"{name}.json")
    hidden, heads, layers = LLAMA_PUBLISHED[name]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (hidden, heads, 8, 128)
    assert cfg.num_hidden_layers == layers and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="MLA"):
        MLAConfig.from_file(CONFIGS / f"{name}.json")


def test_kv_cache_bytes_per_token():
    v3 = MLAConfig.from_file(CONFIGS / "DeepSeek-V3.json")
    assert v3.kv_cache_bytes_per_token() == (512 + 64) * 2 * 61  # 70,272 B: 68.6 KiB per token
    assert v3.kv_cache_bytes_per_token(dtype_bytes=1, num_layers=1) == 576
    assert v3.mha_kv_cache_bytes_per_token(num_layers=1) == 128 * (192 + 128) * 2
    l70 = GQAConfig.from_file(CONFIGS / "Llama-3.1-70B.json")
    assert l70.kv_cache_bytes_per_token() == 2 * 8 * 128 * 2 * 80  # 320 KiB
    assert l70.mha_kv_cache_bytes_per_token() == 2 * 64 * 128 * 2 * 80
    assert MLAConfig(64, 4, 32, 8, 4, 8).kv_cache_bytes_per_token(dtype_bytes=4) == 36 * 4  # 1 layer by default


def _ds_dict(**over):
    d = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
         "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "rope_theta": 10000,
         "rope_scaling": dict(YARN), "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
         "num_hidden_layers": 3}
    d.update(over)
    return d


def test_from_hf_every_form(tmp_path):
    from transformers import DeepseekV3Config

    want = MLAConfig.from_hf(_ds_dict())
    assert want.rope_scaling["rope_type"] == "yarn" and "type" not in want.rope_scaling
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_ds_dict()))
    assert MLAConfig.from_hf(str(path)) == want
    assert MLAConfig.from_hf(path) == want
    assert MLAConfig.from_hf(tmp_path) == want  # a checkpoint folder
    assert MLAConfig.from_file(path) == want
    hf = DeepseekV3Config(**{k: v for k, v in _ds_dict().items()})
    assert MLAConfig.from_hf(hf) == want  # transformers object
    v5 = hf.to_dict()  # transformers-5 form: rope_parameters, no rope_theta / rope_scaling
    assert "rope_parameters" in v5 and "rope_scaling" not in v5
    assert MLAConfig.from_hf(v5) == want
    rp = dict(YARN, rope_theta=10000.0)
    assert MLAConfig.from_hf(_ds_dict(rope_parameters=rp, rope_theta=None, rope_scaling=None)) == want


def test_from_hf_q_lora_rank_absent_or_null_and_defaults():
    d = _ds_dict()
    del d["q_lora_rank"], d["rope_theta"], d["rope_scaling"]
    cfg = MLAConfig.from_hf(d)
    assert cfg.q_lora_rank is None and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert MLAConfig.from_hf(_ds_dict(q_lora_rank=None)).q_lora_rank is None
    assert MultiHeadLatentAttention(cfg).q_proj.weight.shape == (4 * 12, 64)
    assert MLAConfig.from_hf(_ds_dict(rope_interleave=False)).rope_interleave is False


def test_from_hf_rejects_non_configs(tmp_path):
    with pytest.raises(ValueError, match="missing"):
        MLAConfig.from_hf({"hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="config path"):
        MLAConfig.from_hf(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="transformers config, a dict or a path"):
        MLAConfig.from_hf(42)
    with pytest.raises(ValueError, match="MLA config"):
        GQAConfig.from_hf(_ds_dict())


def test_gqa_from_config_accepts_path_dict_and_object(tmp_path):
    from transformers import LlamaConfig

    lc = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(lc.to_dict()))
    layers = [GroupedQueryAttention.from_config(c) for c in (lc, lc.to_dict(), path, GQAConfig.from_hf(lc))]
    assert {(lay.num_heads, lay.num_kv_heads, lay.head_dim) for lay in layers} == {(8, 2, 8)}
    big = GroupedQueryAttention.from_config(CONFIGS / "Llama-3.1-8B.json", device="meta")
    assert big.k_proj.weight.shape == (8 * 128, 4096)


@torch.no_grad()
@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_absorbed_weights_alone_load_and_decode_identically(q_lora_rank):
    kw = small_mla_config(q_lora_rank, YARN)
    cfg = MLAConfig.from_hf(kw)
    layer = randomize(MultiHeadLatentAttention(cfg)).eval()
    h, nope, dc, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    sd = layer.state_dict()
    kv_b = sd.pop("kv_b_proj.weight").view(h, nope + v, dc)
    sd["w_uk"] = kv_b[:, :nope].clone()  # [H, nope, Dc]
    sd["w_uv"] = kv_b[:, nope:].transpose(1, 2).clone()  # [H, Dc, v]
    assert torch.equal(layer.w_uk, sd["w_uk"]) and torch.equal(layer.w_uv, sd["w_uv"])
    other = MultiHeadLatentAttention(cfg).eval()
    other.load_state_dict(sd)  # strict
    x = torch.randn(2, 9, cfg.hidden_size)
    outs = []
    for lay in (layer, other):
        cache = lay.new_cache(2, 9)
        outs.append(torch.cat([lay(x[:, :3], cache=cache)] + [lay(x[:, i:i + 1], cache=cache) for i in range(3, 9)], 1))
    assert torch.equal(outs[0], outs[1])
    # A converted checkpoint holding both: kv_b_proj wins, the derived tensors are dropped.
    both = dict(layer.state_dict(), w_uk=torch.zeros(h, nope, dc), w_uv=torch.zeros(h, dc, v))
    third = MultiHeadLatentAttention(cfg)
    third.load_state_dict(both)
    assert torch.equal(third.kv_b_proj.weight, layer.kv_b_proj.weight)
    with pytest.raises(ValueError, match="w_uk"):
        MultiHeadLatentAttention(cfg).load_state_dict({**sd, "w_uk": torch.zeros(h, nope + 1, dc)})

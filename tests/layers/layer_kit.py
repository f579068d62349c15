"""Shared by the layer tests: small configs, Hugging Face layer builders, causal masks (imported as `layer_kit`)."""

import torch

YARN = {"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 4096}  # DeepSeek-V2 numbers: softmax mscale**2 = 1.59
YARN_RATIO = {"type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
              "original_max_position_embeddings": 512}  # cos/sin scaled by 1.10, softmax by 1.30
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # short original context: all three bands at d=16


def causal_mask(t: int, dtype=torch.float32) -> torch.Tensor:
    """Additive [1, 1, T, T] mask for HF eager attention."""
    return torch.full((t, t), float("-inf"), dtype=dtype).triu(1)[None, None]


def randomize(module: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    """Random weights everywhere (norm weights around 1) so no parameter is inert."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return module


def small_mla_config(q_lora_rank=None, rope_scaling=YARN, rope_interleave=True, *, heads=5, rope_dim=8):
    """A DeepSeek-shaped MLA config small enough for CPU tests (odd head count on purpose)."""
    return dict(hidden_size=48, num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=24,
                q_lora_rank=q_lora_rank, qk_nope_head_dim=12, qk_rope_head_dim=rope_dim, v_head_dim=10,
                rope_theta=10000.0, rope_scaling=rope_scaling, rope_interleave=rope_interleave,
                max_position_embeddings=163840, rms_norm_eps=1e-6, attention_bias=False)


def hf_deepseek_builder():
    """Build (config, DeepseekV3Attention with random weights, rotary) from small_mla_config kwargs."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    def build(**kw):
        cfg = DeepseekV3Config(**kw)
        cfg._attn_implementation = "eager"
        layer = randomize(DeepseekV3Attention(cfg, layer_idx=0)).eval()
        return cfg, layer, DeepseekV3RotaryEmbedding(cfg)

    return build


def hf_llama_builder():
    """Build (config, LlamaAttention with random weights, rotary) from LlamaConfig kwargs."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    def build(**kw):
        cfg = LlamaConfig(**kw)
        cfg._attn_implementation = "eager"
        layer = randomize(LlamaAttention(cfg, layer_idx=0)).eval()
        return cfg, layer, LlamaRotaryEmbedding(cfg)

    return build

"""Fixtures for the layer tests (helpers live in layer_kit.py)."""

import pytest

from layer_kit import hf_deepseek_builder, hf_llama_builder


@pytest.fixture
def hf_deepseek():
    """Build (config, DeepseekV3Attention with random weights, rotary) from small_mla_config kwargs."""
    return hf_deepseek_builder()


@pytest.fixture
def hf_llama():
    """Build (config, LlamaAttention with random weights, rotary) from LlamaConfig kwargs."""
    return hf_llama_builder()

"""Fixtures for tests/convert: tiny sharded DeepSeek-V3 checkpoints (see convert_fixtures.py).

Session-scoped and read-only: tests that damage a checkpoint work on a copy."""

import pytest

pytest.importorskip("transformers")

from convert_fixtures import Fixture, make_fp8_fixture, make_hf_fixture  # noqa: E402


@pytest.fixture(scope="session")
def hf_lora(tmp_path_factory) -> Fixture:
    """q_lora_rank set (V3 / Kimi-K2 layout), YaRN, 2 dense layers, many shards."""
    return make_hf_fixture(tmp_path_factory.mktemp("hf_lora") / "ckpt", q_lora_rank=24, seed=11)


@pytest.fixture(scope="session")
def hf_plain(tmp_path_factory) -> Fixture:
    """q_lora_rank None (V2-Lite / Moonlight layout) with attention biases, YaRN, many shards."""
    return make_hf_fixture(tmp_path_factory.mktemp("hf_plain") / "ckpt", q_lora_rank=None, attention_bias=True, seed=12)


@pytest.fixture(scope="session")
def fp8_ckpt(tmp_path_factory) -> Fixture:
    return make_fp8_fixture(tmp_path_factory.mktemp("fp8") / "ckpt")

"""Test set-up: Triton's interpreter on machines without CUDA, the `gpu` marker, seeded RNG."""

import os
import zlib

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    # Must happen before triton is imported anywhere: the kernels then run on the CPU.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # A fresh but reproducible stream per test: different tests draw different inputs.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    # Decode calls replay cached host plans (mla_attn/ops/_launch.py); a test that patches a host function
    # (split count, tiles, SM count) must see its patch, so every test starts and ends with no plans.
    import sys

    def clear():
        for name in ("mla_attn.ops.decode.triton_decode", "mla_attn.ops.decode.gluon_mla"):
            plans = getattr(sys.modules.get(name), "_plans", None)
            if plans is not None:
                plans.clear()

    clear()
    yield
    clear()

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
    # Decode calls and the Gluon training launchers replay cached host plans (mla_attn/ops/_launch.py) and skip checks a call signature has
    # passed (decode/api.py); a test that patches a host function (split count, tiles, SM count) or the
    # environment must see its patch, so every test starts and ends with neither.
    import sys

    def clear():
        for name, attr in (("mla_attn.ops.decode.triton_decode", "_plans"), ("mla_attn.ops.decode.gluon_mla", "_plans"),
                           ("mla_attn.ops.decode.api", "_validated"), ("mla_attn.ops.attention.gluon_fwd", "_plans"),
                           ("mla_attn.ops.attention.gluon_bwd", "_plans"),
                           ("mla_attn.ops.attention.triton_bwd", "_plans"),
                           ("mla_attn.ops.attention.triton_fwd", "_plans")):
            cache = getattr(sys.modules.get(name), attr, None)
            if cache is not None:
                cache.clear()

    clear()
    yield
    clear()

"""Fixtures shared by the ops tests."""

import pytest
import torch


@pytest.fixture
def nan_decode_outputs(monkeypatch):
    """Every buffer the decode launchers allocate starts as NaN: an element the kernels do not write fails."""
    from mla_attn.ops.decode import combine, triton_decode

    def nan_empty(*shape, dtype=None, device=None):
        return torch.full(*shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_decode, "_alloc", nan_empty)
    monkeypatch.setattr(combine, "_alloc", nan_empty)

"""Shared fixtures: the real default model, loaded once per test session (bf16 on CPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def engine_05b():
    from hqlab.engines.hf import HFEngine

    torch.manual_seed(0)
    return HFEngine.load("qwen2.5-coder-0.5b", device="cpu", dtype="bfloat16")

"""Shared fixtures: the real default model, loaded once per test session, and what provenance columns must say
for this checkout and environment."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Triton kernels run in the interpreter on machines without a GPU. The variable must be set before any
# @triton.jit function is defined, i.e. before any test module imports hqlab_kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def engine_05b():
    """bf16: the fast CPU dtype the benchmarks use."""
    from hqlab.engines.hf import HFEngine

    torch.manual_seed(0)
    return HFEngine.load("qwen2.5-coder-0.5b", device="cpu", dtype="bfloat16")


@pytest.fixture(scope="session")
def engine_05b_fp32():
    """fp32: lossless checks. In bf16, logits are spaced 0.125 apart near typical values, so a different verify
    shape flips exact and near ties on chat prompts; fp32 leaves only genuine ties."""
    from hqlab.engines.hf import HFEngine

    return HFEngine.load("qwen2.5-coder-0.5b", device="cpu", dtype="float32")


@pytest.fixture
def expected_commit() -> str:
    """This checkout's HEAD as git reports it now (+dirty where tracked files differ), "unknown" outside one."""
    if not (REPO / ".git").exists():
        return "unknown"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


@pytest.fixture(scope="session")
def installed():
    """name -> the installed version of that distribution, None where it is not installed."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return version

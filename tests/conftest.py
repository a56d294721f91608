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

# Under pytest-xdist (`make test` runs a worker per core, up to four) the workers share the cores: two workers of
# two threads each on two cores spend their time in OpenMP's spin-waits. Notebook kernels inherit the variable.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


def pytest_collection_modifyitems(config, items):
    """Keep each test file on one xdist worker (its module fixtures are built once), and the files that share the
    fp32 references on the same one (they are decoded once per worker)."""
    def file(item) -> str:
        return item.nodeid.split("::")[0]

    sharing = {file(item) for item in items if "fp32_suite" in getattr(item, "fixturenames", ())}
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("fp32_suite" if file(item) in sharing else file(item)))


@pytest.fixture(scope="session")
def engine_05b(request):
    """The real model for tests that need one, in bf16 (the dtype the benchmarks use) on a CPU with bf16 arithmetic;
    on one without (`models.native_bf16`), where emulated bf16 is several times slower than fp32 wherever many
    positions are scored at once, the fp32 engine (`engine_05b_fp32`, shared: one model in memory)."""
    from hqlab import models
    from hqlab.engines.hf import HFEngine

    torch.manual_seed(0)
    if not models.native_bf16():
        return request.getfixturevalue("engine_05b_fp32")
    return HFEngine.load("qwen2.5-coder-0.5b", device="cpu", dtype="bfloat16")


@pytest.fixture(scope="session")
def engine_05b_fp32():
    """fp32: lossless checks. In bf16, logits are spaced 0.125 apart near typical values, so a different verify
    shape flips exact and near ties on chat prompts; fp32 leaves only genuine ties."""
    from hqlab.engines.hf import HFEngine

    return HFEngine.load("qwen2.5-coder-0.5b", device="cpu", dtype="float32")


class Fp32Suite:
    """The `all` workload over a 500-token document, encoded for the fp32 engine, and that engine's own
    no-speculation output of 48 tokens for each prompt, computed the first time a test asks for it. The lossless
    and the batched-decoding tests compare against the same references, so each is decoded once per session."""

    DOC_TOKENS = 500
    MAX_NEW_TOKENS = 48

    def __init__(self, engine):
        from hqlab.config import DecodeConfig
        from hqlab.workloads import load_workload

        self.engine, self.decode = engine, DecodeConfig(max_new_tokens=self.MAX_NEW_TOKENS)
        self.prompts = {p.id: p for p in load_workload("all", doc_tokens=self.DOC_TOKENS, tokenizer=engine.tokenizer)}
        self._ids: dict = {}
        self._refs: dict = {}

    def ids(self, prompt_id: str) -> list[int]:
        if prompt_id not in self._ids:
            self._ids[prompt_id] = self.engine.encode_chat(list(self.prompts[prompt_id].messages))
        return self._ids[prompt_id]

    def reference(self, prompt_id: str):
        if prompt_id not in self._refs:
            self._refs[prompt_id] = self.engine.generate(self.ids(prompt_id), None, self.decode, request=prompt_id)
        return self._refs[prompt_id]


@pytest.fixture(scope="session")
def fp32_suite(engine_05b_fp32):
    return Fp32Suite(engine_05b_fp32)


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

"""Provenance: every bench row says which commit, library versions and device produced it (cached traces carry
the same: tests/replay/test_traces.py), and the machine is described in one way."""

from __future__ import annotations

import subprocess
from pathlib import Path

import polars as pl
import pytest
import torch

from hqlab import provenance
from hqlab.config import DecodeConfig

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_git_commit_of_a_checkout_and_outside_one(tmp_path, expected_commit):
    assert provenance.git_commit() == expected_commit
    assert provenance.git_commit(tmp_path) == "unknown"  # not a checkout: no crash
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "f.txt").write_text("a")
    _git("init", "-q", cwd=repo)
    _git("-c", "user.email=a@b", "-c", "user.name=a", "add", "f.txt", cwd=repo)
    _git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one", cwd=repo)
    head = _git("rev-parse", "HEAD", cwd=repo)
    assert provenance.git_commit(repo) == head
    # a folder inside someone else's checkout (e.g. a virtual environment in it) is not that checkout
    assert provenance.git_commit(repo / "pkg") == "unknown"
    (repo / "f.txt").write_text("b")
    provenance.git_commit.cache_clear()
    assert provenance.git_commit(repo) == head + "+dirty"


def test_device_names_and_columns(installed):
    cpu = provenance.device_name("cpu")
    assert cpu.startswith("cpu (") and cpu == provenance.device_name(torch.device("cpu"))
    assert cpu.endswith(f", {torch.backends.cpu.get_cpu_capability()})")  # the kernels' instruction set, e.g. AVX2
    prov = provenance.provenance("cpu")
    assert tuple(prov) == provenance.COLUMNS
    assert prov["torch"] == torch.__version__ and prov["transformers"] == installed("transformers")
    assert prov["triton"] == installed("triton") and prov["vllm"] == installed("vllm")


def test_rows_built_elsewhere_get_the_provenance_columns(expected_commit):
    from hqlab.bench import with_provenance

    rows = pl.DataFrame({"config": ["none"], "machine": ["GPU"], "vllm": [None]})
    out = with_provenance(rows, "cpu")
    assert set(provenance.COLUMNS) <= set(out.columns)
    assert out["device"][0] == provenance.device_name("cpu") and out["git_commit"][0] == expected_commit
    assert out.schema["vllm"] == pl.String  # typed even when every value is null


# ----------------------------------------------------------------------------------------------------------------
# The trace cache key


@pytest.mark.slow
def test_bench_rows_carry_provenance(tmp_path, engine_05b, expected_commit, installed):
    """The bench harness on the real 0.5B (CPU, one short prompt, 8 tokens), single and batched, as written to
    parquet."""
    from hqlab import bench
    from hqlab.workloads import Prompt

    prompts = [Prompt("count", "chat", ({"role": "user", "content": "Count from one to ten."},))]
    decode = DecodeConfig(max_new_tokens=8)
    single, _ = bench.run_bench(engine_05b, prompts, ["lookup:nmin=2,nmax=4,k=4"], decode, warmup=False,
                                progress=False)
    batched, _ = bench.run_batch_bench(engine_05b, prompts, ["lookup:nmin=2,nmax=4,k=4"], decode, batch=1,
                                       progress=False)
    for results in (single, batched):
        results.write_parquet(tmp_path / "r.parquet")
        rows = pl.read_parquet(tmp_path / "r.parquet")
        assert rows.height == 2 and set(provenance.COLUMNS) <= set(rows.columns)
        for column in provenance.COLUMNS:
            assert rows[column].n_unique() == 1 and rows.schema[column] == pl.String, column
        row = rows.row(0, named=True)
        assert row["git_commit"] == expected_commit
        assert row["torch"] == torch.__version__ and row["transformers"] == installed("transformers")
        assert row["triton"] == installed("triton") and row["vllm"] == installed("vllm")
        assert row["device"] == provenance.device_name("cpu") and row["machine"].startswith("CPU ")

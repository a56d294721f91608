"""Provenance: every bench row says which commit, library versions and device produced it; every cached trace
carries the same; the trace cache keeps outputs of different devices and dtypes apart, and a second request for
a trace set is served from the cache without loading the model."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

import polars as pl
import pytest
import torch

from hqlab import provenance, sweep
from hqlab.config import DecodeConfig

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def _expected_commit() -> str:
    if not (REPO / ".git").exists():
        return "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return _git("rev-parse", "HEAD") + ("+dirty" if dirty else "")


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_git_commit_of_a_checkout_and_outside_one(tmp_path):
    assert provenance.git_commit() == _expected_commit()
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


def test_device_names_and_columns():
    cpu = provenance.device_name("cpu")
    assert cpu.startswith("cpu (") and cpu == provenance.device_name(torch.device("cpu"))
    prov = provenance.provenance("cpu")
    assert tuple(prov) == provenance.COLUMNS
    assert prov["torch"] == torch.__version__ and prov["transformers"] == _installed("transformers")
    assert prov["triton"] == _installed("triton") and prov["vllm"] == _installed("vllm")


def test_rows_built_elsewhere_get_the_provenance_columns():
    from hqlab.bench import with_provenance

    rows = pl.DataFrame({"config": ["none"], "machine": ["GPU"], "vllm": [None]})
    out = with_provenance(rows, "cpu")
    assert set(provenance.COLUMNS) <= set(out.columns)
    assert out["device"][0] == provenance.device_name("cpu") and out["git_commit"][0] == _expected_commit()
    assert out.schema["vllm"] == pl.String  # typed even when every value is null


# ----------------------------------------------------------------------------------------------------------------
# The trace cache key


def test_trace_key_separates_devices_dtypes_and_settings():
    ids = [1, 2, 3, 4]
    decode = DecodeConfig(max_new_tokens=32)
    base = sweep.TraceOrigin("qwen2.5-coder-0.5b", "ab" * 32, "bfloat16", "cpu (AMD EPYC 9654 96-Core Processor)")
    cuda = sweep.TraceOrigin(base.model, base.sha256, "bfloat16", "cuda (NVIDIA H200)")
    fp32 = sweep.TraceOrigin(base.model, base.sha256, "float32", base.device)
    other_gpu = sweep.TraceOrigin(base.model, base.sha256, "bfloat16", "cuda (NVIDIA A100-SXM4-80GB)")
    keys = {o.key(ids, decode) for o in (base, cuda, fp32, other_gpu)}
    assert len(keys) == 4
    assert base.key(ids, decode) == sweep.TraceOrigin(*vars(base).values()).key(ids, decode)
    assert base.key(ids, decode) != base.key(ids, DecodeConfig(max_new_tokens=33))
    assert base.key(ids, decode) != base.key([1, 2, 3, 5], decode)
    # resolved without loading anything: dtype and device as the engine would get them
    a = sweep.TraceOrigin.resolve("qwen2.5-coder-0.5b", dtype="auto", device="cpu")
    b = sweep.TraceOrigin.resolve("qwen2.5-coder-0.5b", dtype="float32", device="cpu")
    assert (a.dtype, b.dtype) == ("bfloat16", "float32") and a.device == b.device == provenance.device_name("cpu")
    assert a.key(ids, decode) != b.key(ids, decode)


@pytest.mark.slow
def test_second_request_hits_the_cache_and_another_dtype_misses(tmp_path, engine_05b):
    """Recorded once with the engine, then served from the cache to a caller that loads no model; the same
    prompts in another dtype are not served those outputs."""
    cache = tmp_path / "traces"
    first = sweep.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype="bfloat16", device="cpu", limit=2,
                                engine=engine_05b, cache_dir=cache)
    assert first.recorded == 2 and len(list(cache.glob("*.json"))) == 2
    record = json.loads(next(cache.glob("*.json")).read_text())
    assert record["device"] == provenance.device_name("cpu") and record["dtype"] == "bfloat16"
    assert record["provenance"]["git_commit"] == _expected_commit()
    assert record["provenance"]["transformers"] == _installed("transformers")

    again = sweep.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype="auto", device="cpu", limit=2,
                                cache_dir=cache)
    assert again.recorded == 0 and again.engine is None  # no model was loaded
    assert [t.output_ids for t in again.traces] == [t.output_ids for t in first.traces]
    assert all(t.provenance["device"] == provenance.device_name("cpu") for t in again.traces)
    # the engine-side entry point reads the same cache
    assert sweep.record_traces(engine_05b, first.prompts, DecodeConfig(max_new_tokens=6), cache_dir=cache,
                               progress=False) == first.traces
    with pytest.raises(sweep.TracesMissing, match="float32"):
        sweep.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype="float32", device="cpu", limit=2,
                            cache_dir=cache, record=False)
    with pytest.raises(sweep.TracesMissing, match="max_new_tokens=7"):
        sweep.cached_traces("qwen2.5-coder-0.5b", "chat", 7, dtype="bfloat16", device="cpu", limit=2,
                            cache_dir=cache, record=False)
    # an engine that is not what was asked for is refused, not silently used
    with pytest.raises(sweep.ConfigError, match="not the requested"):
        sweep.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype="float32", device="cpu", limit=2,
                            engine=engine_05b, cache_dir=cache)
    # saved with the trace set and read back
    saved = sweep.load_traces(sweep.save_traces(again.traces, tmp_path / "set.parquet"))
    assert saved == again.traces and saved[0].provenance == again.traces[0].provenance


@pytest.mark.slow
def test_bench_rows_carry_provenance(tmp_path, engine_05b):
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
        assert row["git_commit"] == _expected_commit()
        assert row["torch"] == torch.__version__ and row["transformers"] == _installed("transformers")
        assert row["triton"] == _installed("triton") and row["vllm"] == _installed("vllm")
        assert row["device"] == provenance.device_name("cpu") and row["machine"].startswith("CPU ")

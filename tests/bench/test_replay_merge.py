"""benchmarks/vllm_gpu.py replay --append: a raw file's replay rows replace only the same run's rows for the same
configs (one run's configs come back in several raw files), and a file whose rows carry no run is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _vllm_gpu():
    spec = importlib.util.spec_from_file_location("vllm_gpu_script", ROOT / "benchmarks" / "vllm_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(run: str, config: str, value: float) -> pl.DataFrame:
    return pl.DataFrame({"run": [run, run], "config": [config, config], "prompt_id": ["copy", "qa"],
                         "difference": [value, value]})


def test_replay_rows_of_a_run_accumulate_over_raw_files_and_replace_only_themselves():
    merge = _vllm_gpu().merge_replay
    out = Path("replay.parquet")
    existing = pl.concat([_rows("fa", "gpu-fused:a", 0.1), _rows("fb", "gpu-fused:a", 0.2)])
    second_file = merge(_rows("fb", "gpu-fused:b", 0.3), existing, out)  # another config of run fb: added
    assert second_file.group_by("run", "config").len().sort("run", "config").rows() == [
        ("fa", "gpu-fused:a", 2), ("fb", "gpu-fused:a", 2), ("fb", "gpu-fused:b", 2)]
    again = merge(_rows("fb", "gpu-fused:a", 0.0), second_file, out)  # the same run and config again: replaced
    got = {(r["run"], r["config"]): r["difference"] for r in again.to_dicts()}
    assert got == {("fa", "gpu-fused:a"): 0.1, ("fb", "gpu-fused:a"): 0.0, ("fb", "gpu-fused:b"): 0.3}
    assert again.height == 6


def test_replay_append_refuses_a_file_without_runs():
    merge = _vllm_gpu().merge_replay
    with pytest.raises(SystemExit, match="no `run` column"):
        merge(_rows("fb", "gpu-fused:a", 0.0), _rows("fa", "gpu-fused:a", 0.1).drop("run"), Path("old.parquet"))

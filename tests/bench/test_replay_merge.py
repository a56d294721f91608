"""benchmarks/vllm_gpu.py replay: a raw file's replay rows replace only the same run's rows for the same configs
(one run's configs come back in several raw files), and a table whose rows carry no run is refused
(`hqlab.bench.vllm.merge_replay`)."""

from __future__ import annotations

import polars as pl
import pytest

from hqlab.bench.vllm import merge_replay


def _rows(run: str, config: str, value: float) -> pl.DataFrame:
    return pl.DataFrame({"run": [run, run], "config": [config, config], "prompt_id": ["copy", "qa"],
                         "difference": [value, value]})


def test_replay_rows_of_a_run_accumulate_over_raw_files_and_replace_only_themselves():
    existing = pl.concat([_rows("fa", "gpu-fused:a", 0.1), _rows("fb", "gpu-fused:a", 0.2)])
    second_file = merge_replay(_rows("fb", "gpu-fused:b", 0.3), existing)  # another config of run fb: added
    assert second_file.group_by("run", "config").len().sort("run", "config").rows() == [
        ("fa", "gpu-fused:a", 2), ("fb", "gpu-fused:a", 2), ("fb", "gpu-fused:b", 2)]
    again = merge_replay(_rows("fb", "gpu-fused:a", 0.0), second_file)  # the same run and config again: replaced
    got = {(r["run"], r["config"]): r["difference"] for r in again.to_dicts()}
    assert got == {("fa", "gpu-fused:a"): 0.1, ("fb", "gpu-fused:a"): 0.0, ("fb", "gpu-fused:b"): 0.3}
    assert again.height == 6
    assert merge_replay(_rows("fb", "gpu-fused:a", 0.0), None).height == 2  # a run's first replay


def test_replay_append_refuses_a_table_without_runs():
    with pytest.raises(SystemExit, match="no `run` column"):
        merge_replay(_rows("fb", "gpu-fused:a", 0.0), _rows("fa", "gpu-fused:a", 0.1).drop("run"))

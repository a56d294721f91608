"""benchmarks/vllm_step_cost.py's CPU side: `finish` puts each run's grid in place, one card a run, and says how each
row was measured (the engine in its own process, or in the benchmark's: the first grid's rows predate the column and
were in-process)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl
import pytest

from benchmarks import vllm_step_cost as bench
from hqlab.bench import results


def row(run: str, width: int, machine: str = "NVIDIA H200, torch 2.11", **extra) -> dict:
    return {"run": run, "shape": "qwen2.5-1.5b", "target_params_b": 1.544, "layers": 28, "hidden": 1536,
            "quant": "bf16", "config": "gpu-lookup", "width": width, "context": 1024, "batch": 1, "step_ms": 2.5,
            "step_ms_p10": 2.4, "step_ms_p90": 2.6, "steps": 12, "drafter": "", "engine_start_s": 80.0,
            "machine": machine, "vllm_version": "0.26.0", "git_commit": "abc", **extra}


def write(folder, rows) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"seed_scale_{rows[0]['run']}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_finish_records_the_engine_mode_and_keeps_earlier_runs(tmp_path):
    root = tmp_path / "results"
    write(tmp_path / "old", [row("g1", 1), row("g1", 2)])
    bench.main(["finish", str(tmp_path / "old"), "--results", str(root)])
    write(tmp_path / "new", [row("g2", 1, engine="process"), row("g2", 2, engine="process")])
    bench.main(["finish", str(tmp_path / "new"), "--results", str(root)])
    frame = results.load("seed_scale", kind="grid", root=root)
    assert dict(frame.group_by("run").agg(pl.col("engine").unique().first()).iter_rows()) == \
        {"g1": "inprocess", "g2": "process"}
    assert {r["run"]: r["card"] for r in results.index(root)} == {"g1": "h200", "g2": "h200"}
    assert "grid.jsonl" in results.run_info("seed_scale", "g2", root)["files"]  # the rows as they came back


def test_finish_refuses_to_mix_cards(tmp_path):
    write(tmp_path / "mixed", [row("g2", 1), row("g2", 2, machine="NVIDIA H100 80GB HBM3, torch 2.11")])
    with pytest.raises(SystemExit, match="2 kinds of card"):
        bench.main(["finish", str(tmp_path / "mixed"), "--results", str(tmp_path / "results")])


def test_the_engine_mode_is_an_option_of_both_commands():
    with pytest.raises(SystemExit):
        bench.main(["run", "--tag", "t", "--engine", "threads"])


def test_steps_per_point_is_an_option_and_the_engine_holds_them():
    """--steps N times N steps a point (each one token longer) on top of the warm-up: the engine's context limit
    holds the largest context, all those steps and the widest verify; `run` hands the option to each `one`."""
    args = argparse.Namespace(contexts=(2560,), batches=(), widths=(1, 32), steps=48)
    need = 2560 + bench.WARM_STEPS + 48 + 1 + 32
    assert bench.max_model_len(args) >= need and bench.max_model_len(args) % 64 == 0
    assert bench.max_model_len(args) < need + 64
    default = argparse.Namespace(contexts=(), batches=(), widths=(), steps=None)
    assert bench.max_model_len(default) >= max(bench.CONTEXTS) + bench.WARM_STEPS + bench.MEASURED_STEPS + 1 + 32
    assert "--steps=48" in bench.point_argv(args)
    with pytest.raises(SystemExit):
        bench.main(["run", "--tag", "t", "--steps", "0"])


@pytest.mark.slow
def test_base_folder_builds_every_shape_without_the_model(tmp_path):
    """`base` writes a model's config and tokenizer files (here the default 0.5B's, which the suite converts anyway;
    the GPU calls use the 1.5B's, of the same tokenizer); `--base` builds a shape's folder from them alone (no
    weights: what a GPU host without a converted model gets), with the shape's values, and refuses a folder that
    lacks them, naming it."""
    from hqlab.models import DEFAULT_MODEL

    assert bench.main(["base", str(tmp_path / "base"), "--source", DEFAULT_MODEL]) == 0
    assert sorted(f.name for f in (tmp_path / "base").iterdir()) == sorted(bench.BASE_FILES)
    folder = bench.model_folder("qwen2.5-32b", tmp_path / "work", 8256, base=str(tmp_path / "base"))
    config = json.loads((tmp_path / "work" / "models" / "qwen2.5-32b" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["max_window_layers"]) == (64, 5120, 64)
    assert config["max_position_embeddings"] >= 8256 and not config["use_sliding_window"]
    assert {"tokenizer.json", "config.json"} <= {f.name for f in Path(folder).iterdir()}
    assert folder.endswith("qwen2.5-32b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty: needs config.json and tokenizer.json"):
        bench.model_folder("qwen2.5-14b", tmp_path / "work", 2048, base=str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="empty: needs config.json and tokenizer.json"):  # refused before any engine
        bench.main(["run", "--tag", "t", "--work", str(tmp_path / "w"), "--base", str(tmp_path / "empty")])


def test_a_point_keeps_its_mean_beside_the_median_when_outputs_come_in_bursts():
    """A committed grid's batch-8 width-32 points at 8k: some engine calls returned without a forward pass (p10 below a
    single request's step) and others carried two steps. The median of such intervals is not the step; their mean
    (the wall time over the steps) is, and the row keeps both."""
    args = argparse.Namespace(tag="t", shape="qwen2.5-14b", quant="bf16", engine="process", commit="abc")
    steady = [0.0168] * 15
    bursts = [0.0084] * 8 + [0.0264] * 7  # the same 15 steps' wall time (252 ms), delivered unevenly
    row = bench.point_row(args, "gpu-lookup", 32, 8192, 8, steady, 50.0, "H100", "0.26.0")
    burst_row = bench.point_row(args, "gpu-lookup", 32, 8192, 8, bursts, 50.0, "H100", "0.26.0")
    assert row["step_ms"] == pytest.approx(16.8) and row["step_ms_mean"] == pytest.approx(16.8)
    assert burst_row["step_ms_mean"] == pytest.approx(sum(bursts) / 15 * 1e3)
    assert burst_row["step_ms_mean"] == pytest.approx(16.8) and burst_row["step_ms"] == pytest.approx(8.4)
    assert burst_row["steps"] == 15 and burst_row["step_ms_p10"] == pytest.approx(8.4)

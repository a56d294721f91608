"""Reading the committed vLLM runs (hqlab.bench.vllm_report): labels, ratios inside a run, step breakdowns kept per
run. The data is the H200 results in data/results/, as the vllm_gpu notebook and docs/vllm.md read them."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from hqlab.bench import vllm_report

RESULTS = Path(__file__).resolve().parents[2] / "data" / "results" / "vllm_gpu_h200.parquet"


@pytest.fixture(scope="module")
def data():
    return vllm_report.load(RESULTS)


@pytest.mark.parametrize("config, label", [
    ("none", "none"),
    ("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest", "gpu-lookup 1/32 k=15 earliest"),
    ("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,graphs=false", "gpu-lookup 1/32 k=15 earliest graphs=false"),
    ("lookup:nmin=1,nmax=32,k=15,policy=earliest", "custom_class 1/32 k=15 earliest"),
    ("vllm-ngram-gpu:nmin=2,nmax=5,k=7", "vLLM ngram_gpu 2/5 k=7"),
    ("gpu-lookup:nmin=6,nmax=12,k=15", "gpu-lookup 6/12 k=15"),
])
def test_short_label(config, label):
    assert vllm_report.short_label(config) == label


def test_every_committed_config_gets_a_distinct_label(data):
    configs = data["results"]["config"].unique().to_list()
    labels = {vllm_report.short_label(c) for c in configs}
    assert len(labels) == len(configs)


def test_ratios_are_taken_inside_one_run(data):
    ratios = vllm_report.run_ratios(data["results"])
    assert ratios.filter(pl.col("config") == "none")["vs_none"].to_list() == pytest.approx(
        [1.0] * ratios.filter(pl.col("config") == "none").height)
    # One cell by hand: run f, copy, gpu-lookup k=15 against the same run's none and custom_class lookup.
    alone = data["results"].filter((pl.col("run") == "f") & (pl.col("category") == "copy")
                                   & (pl.col("concurrency") == 1))

    def median(config: str) -> float:
        return float(alone.filter(pl.col("config") == config)["decode_tok_s"].median())

    settings = "nmin=1,nmax=32,k=15,policy=earliest"
    row = ratios.filter((pl.col("run") == "f") & (pl.col("category") == "copy")
                        & (pl.col("config") == f"gpu-lookup:{settings}")).row(0, named=True)
    assert row["vs_none"] == pytest.approx(median(f"gpu-lookup:{settings}") / median("none"))
    assert row["vs_custom_class"] == pytest.approx(median(f"gpu-lookup:{settings}") / median(f"lookup:{settings}"))


def test_step_breakdown_keeps_runs_apart_and_adds_up(data):
    parts = vllm_report.step_breakdown(data["phases"], data["profile_steps"])
    profiled = set(data["phases"]["run"].unique().to_list())
    assert set(parts["run"].unique().to_list()) == profiled and len(profiled) >= 2
    # `none` ran in every profiled run: one row per run, not one pooled row.
    assert parts.filter(pl.col("config") == "none").height == len(profiled)
    assert parts.select("run", "config").is_unique().all()
    total = parts.select(pl.sum_horizontal(vllm_report.PARTS)).to_series()
    assert (total >= parts["step_ms"] - 1e-9).all()  # the last part is the remainder, clipped at zero
    assert (parts["steps"] > 0).all()


def test_concurrency_is_relative_to_the_runs_own_none(data):
    together = vllm_report.concurrency(data["results"])
    assert together.height and together.filter(pl.col("config") == "none")["vs_none"].to_list() == pytest.approx(
        [1.0] * together.filter(pl.col("config") == "none").height)

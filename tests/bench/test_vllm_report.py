"""Reading the committed vLLM runs (hqlab.bench.vllm_report): labels, ratios inside a run, step breakdowns kept per
run. The data is the H200 runs of the study vllm_gpu, as the vllm_gpu notebook and docs/vllm.md read them."""

from __future__ import annotations

import polars as pl
import pytest

from hqlab.bench import results, vllm_report
from hqlab.config import ConfigError


@pytest.fixture(scope="module")
def data():
    return vllm_report.load("vllm_gpu")


@pytest.mark.parametrize("config, label", [
    ("none", "none"),
    ("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest", "gpu-lookup 1/32 k=15 earliest"),
    ("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,graphs=false", "gpu-lookup 1/32 k=15 earliest graphs=false"),
    ("lookup:nmin=1,nmax=32,k=15,policy=earliest", "custom_class 1/32 k=15 earliest"),
    ("vllm-ngram-gpu:nmin=2,nmax=5,k=7", "vLLM ngram_gpu 2/5 k=7"),
    ("gpu-lookup:nmin=6,nmax=12,k=15", "gpu-lookup 6/12 k=15"),
    ("gpu-fused:k=15,draft_block=7,nmax=32,policy=earliest", "gpu-fused k=15 earliest draft_block=7 nmax=32"),
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
    # One cell by hand: copy, gpu-lookup k=15 against the same run's none and custom_class lookup.
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


def test_host_probe_pairs_each_probed_request_with_its_step_time(data):
    """The two committed runs with `--pin-threads` probed the engine core's CPU around every batch-1 request: 4 configs
    x 14 prompts each, step ms = 1000 * tokens/step / decode tok/s; the correlation table is Pearson's r per run and
    config, per run, and over all requests."""
    import numpy as np

    probed = vllm_report.host_probe(data["results"], ["o", "p"])
    assert probed.height == 2 * 4 * 14 and probed["host_unit_ms"].is_finite().all()
    row = data["results"].filter((pl.col("run") == "o") & (pl.col("config") == "none")
                                 & (pl.col("prompt_id") == "copy") & (pl.col("concurrency") == 1)).row(0, named=True)
    mine = probed.filter((pl.col("run") == "o") & (pl.col("config") == "none") & (pl.col("request") == "copy"))
    assert mine["step_ms"][0] == pytest.approx(1e3 * row["tokens_per_step"] / row["decode_tok_s"])
    table = vllm_report.probe_correlation(probed)
    assert table.height == 8 + 2 + 1 and table["requests"].sum() == 3 * probed.height
    cell = probed.filter((pl.col("run") == "p") & (pl.col("config") == "none"))
    r = table.filter((pl.col("run") == "p") & (pl.col("label") == "none"))["r"][0]
    assert r == pytest.approx(np.corrcoef(cell["host_unit_ms"], cell["step_ms"])[0, 1])
    overall = table.filter(pl.col("run") == "all")["r"][0]
    assert overall == pytest.approx(np.corrcoef(probed["host_unit_ms"], probed["step_ms"])[0, 1])
    assert 0.2 < overall < 0.4  # the probe predicts little (the vllm_gpu notebook states r = 0.30)


def test_host_probe_names_runs_without_a_probe(data):
    with pytest.raises(ConfigError, match="host_unit_ms"):
        vllm_report.host_probe(data["results"], ["n"])


def test_width_replay_agrees_with_the_live_run_it_replays():
    """experiments/drafter_skip_replayed/fused_skip_replay.py --settings k=31 --lookup-k 15,31 over a committed fused
    run's outputs: its k = 15 rows are what vLLM measured in that run (the lookup exactly, the fused config as the
    replay check found it), and at k = 31 the lookup and the fused config take more tokens a step where the lookup
    copies."""
    widths = results.load("fused_skip_replay", "width")
    live = results.load("vllm_fused", "fg").filter(pl.col("concurrency") == 1)
    lookup15 = widths.filter(pl.col("config") == "lookup:nmin=1,nmax=32,k=15,policy=earliest")
    measured = (live.filter(pl.col("config") == "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest")
                .group_by("prompt_id").agg(pl.col("tokens_per_step").first()))
    both = lookup15.join(measured, on="prompt_id", suffix="_vllm")
    assert both.height == 14 and (both["tokens_per_step"] - both["tokens_per_step_vllm"]).abs().max() < 1e-9
    check = results.load("vllm_fused", "fg", "replay")
    fused15 = widths.filter(pl.col("config").str.starts_with("fused:k=15"))
    same = fused15.join(check.select("prompt_id", "tokens_per_step"), on="prompt_id", suffix="_check")
    assert same.height == 14 and (same["tokens_per_step"] - same["tokens_per_step_check"]).abs().max() < 1e-9
    per = widths.with_columns(pl.col("config").str.extract(r"^(\w+):").alias("family"),
                              pl.col("config").str.extract(r"k=(\d+)").cast(pl.Int64).alias("k"))
    copying = per.filter(pl.col("category").is_in(["copy", "code", "edit"]))
    for family in ("lookup", "fused"):
        wide = copying.filter((pl.col("family") == family) & (pl.col("k") == 31)).sort("prompt_id")
        narrow = copying.filter((pl.col("family") == family) & (pl.col("k") == 15)).sort("prompt_id")
        assert (wide["tokens_per_step"] > narrow["tokens_per_step"] * 1.7).all()

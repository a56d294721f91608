"""Reading the committed vLLM runs (hqlab.bench.vllm_report): labels, ratios inside a run, step breakdowns kept per
run. The data is the H200 results in data/results/, as the vllm_gpu notebook and docs/vllm.md read them."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from hqlab.bench import vllm_report
from hqlab.config import ConfigError

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


FUSED = RESULTS.with_name("vllm_fused_h200.parquet")


@pytest.fixture(scope="module")
def fused():
    return vllm_report.load(FUSED)


def test_drafter_pass_fit_explains_the_fused_steps_of_run_fb(fused):
    """Run fb's gpu-fused steps against its gpu-lookup steps on the same prompts: one price per drafter pass explains
    them (0.2 ms residual), and the model's fused ÷ lookup rates land near the measured decode ratios per class."""
    table, fit = vllm_report.drafter_pass_fit(fused["steps"], "fb")
    assert set(table["passes"].unique().to_list()) == {2, 4, 7}  # draft_block 2, 4, 7 at the lookup's k=15
    assert 0.8 < fit["per_pass_ms"] < 1.8 and fit["residual_ms"] < 0.5
    model = (vllm_report.fused_what_if(table, fit, [fit["per_pass_ms"]])
             .group_by("category", "config").agg(pl.col("vs_lookup").median()))
    alone = fused["results"].filter((pl.col("run") == "fb") & (pl.col("concurrency") == 1))
    rate = alone.group_by("category", "config").agg(pl.col("decode_tok_s").median())
    lookup = rate.filter(pl.col("config").str.starts_with("gpu-lookup")).select(
        "category", pl.col("decode_tok_s").alias("lookup_tok_s"))
    measured = rate.join(lookup, on="category").with_columns(
        (pl.col("decode_tok_s") / pl.col("lookup_tok_s")).alias("measured"))
    both = model.join(measured, on=["category", "config"])
    assert both.height == 21  # 7 classes x 3 adaptive configs
    assert ((both["vs_lookup"] / both["measured"] - 1).abs() < 0.15).all()


def test_the_breakeven_price_reaches_the_target_and_prices_order_the_rates(fused):
    table, fit = vllm_report.drafter_pass_fit(fused["steps"], "fb")
    grid = vllm_report.fused_what_if(table, fit, [0.0, 0.5, 1.0, 2.0], target=1.1)
    at_breakeven = vllm_report.fused_what_if(table, fit, [0.0], target=1.1).select(
        "request", "config", "breakeven_pass_ms")
    for row in at_breakeven.iter_rows(named=True):
        again = vllm_report.fused_what_if(table.filter((pl.col("request") == row["request"])
                                                       & (pl.col("config") == row["config"])),
                                          fit, [row["breakeven_pass_ms"]], target=1.1)
        assert again["vs_lookup"][0] == pytest.approx(1.1)
    dearer = grid.sort("per_pass_ms").group_by("request", "config").agg(pl.col("vs_lookup"))
    assert all(all(a > b for a, b in zip(v, v[1:])) for v in dearer["vs_lookup"].to_list())


def test_drafter_pass_fit_names_the_run_that_has_no_fused_steps(fused):
    with pytest.raises(ConfigError, match="run 'zz'"):
        vllm_report.drafter_pass_fit(fused["steps"], "zz")


SKIP_REPLAY = RESULTS.with_name("fused_skip_replay.parquet")


def test_drafter_pass_fit_leaves_out_configs_that_skip_the_drafter(fused):
    """A skipping config's steps run 0, 1 or draft_block passes: relabelled as one, run fb's block-4 config drops
    out of the fit, which then stands on blocks 2 and 7 alone."""
    block4 = "gpu-fused:k=15,draft_block=4,nmax=32,policy=earliest,compile=true"
    steps = fused["steps"].with_columns(pl.col("config").replace(block4, block4 + ",skip=2"))
    table, fit = vllm_report.drafter_pass_fit(steps, "fb")
    assert sorted(table["passes"].unique().to_list()) == [2, 7]
    full, _ = vllm_report.drafter_pass_fit(fused["steps"], "fb")
    assert table.height == full.filter(pl.col("passes") != 4).height


def test_skip_replay_prices_agree_with_the_pass_fit_and_with_the_live_replay_check(fused):
    """experiments/drafter_skip_replayed/fused_skip_replay.py over run fb's outputs, priced by `skip_what_if`:
    without skipping, its tokens/step are the replay check's for the same configs (same outputs, the run was
    lossless) and its prices are `fused_what_if`'s; skipping never prices a step above drafting it."""
    table, fit = vllm_report.drafter_pass_fit(fused["steps"], "fb")
    replayed = pl.read_parquet(SKIP_REPLAY)
    priced = vllm_report.skip_what_if(replayed, table, fit)
    assert priced.height == replayed.height  # every replayed prompt is one of the run's
    never = priced.filter(pl.col("skip") == 0)
    assert (never["drafter_share"] == 1.0).all()
    assert (never["lookup_only_ms"] - never["catch_up_ms"]).abs().max() < 1e-9
    assert (priced["lookup_only_ms"] <= priced["catch_up_ms"] + 1e-9).all()
    # gpu-fused as built: between the two, the catch-up pass on one skipped step in SKIP_RUN + 1
    assert (priced["lookup_only_ms"] <= priced["built_ms"] + 1e-9).all()
    assert (priced["built_ms"] <= priced["catch_up_ms"] + 1e-9).all()
    extra = (priced["built_ms"] - priced["lookup_only_ms"]) / (priced["catch_up_ms"] - priced["lookup_only_ms"])
    share = 1 / (vllm_report.GPU_FUSED_SKIP_RUN + 1)
    assert extra.drop_nans().is_between(share - 1e-9, share + 1e-9).all()
    assert (priced.filter(pl.col("skip") > 0)["drafter_share"] < 1.0).any()
    # the live check replayed run fb's own gpu-fused configs: same settings, skip 0, same tokens/step
    check = pl.read_parquet(FUSED.with_name("vllm_fused_h200.replay.parquet")).filter(pl.col("run") == "fb")
    for block in (2, 4, 7):
        live = check.filter(pl.col("config").str.contains(f"k=15,draft_block={block},"))
        mine = never.filter(pl.col("passes") == block).join(live.select("prompt_id", "tokens_per_step"),
                                                            on="prompt_id", suffix="_check")
        assert mine.height == 14 and (mine["tokens_per_step"] - mine["tokens_per_step_check"]).abs().max() < 1e-9
    model = vllm_report.fused_what_if(table, fit, [fit["per_pass_ms"]])
    joined = never.join(model.select("request", "passes", pl.col("tokens_per_step").alias("t"),
                                     pl.col("lookup_step_ms").alias("s")), left_on=["prompt_id", "passes"],
                        right_on=["request", "passes"])
    expected = joined["s"] + fit["fixed_ms"] + joined["passes"] * fit["per_pass_ms"]
    assert (joined["lookup_only_ms"] - expected).abs().max() < 1e-9


def test_host_probe_pairs_each_probed_request_with_its_step_time(data):
    """Runs o and p (`--pin-threads`) probed the engine core's CPU around every batch-1 request: 4 configs x 14
    prompts each, step ms = 1000 * tokens/step / decode tok/s; the correlation table is Pearson's r per run and
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
    """experiments/drafter_skip_replayed/fused_skip_replay.py --settings k=31 --lookup-k 15,31 over run fg's
    outputs: its k = 15 rows are what vLLM measured in run fg (the lookup exactly, the fused config as the replay
    check found it), and at k = 31 the lookup and the fused config take more tokens a step where the lookup copies."""
    widths = pl.read_parquet(RESULTS.with_name("fused_width_replay.parquet"))
    live = pl.read_parquet(FUSED).filter((pl.col("run") == "fg") & (pl.col("concurrency") == 1))
    lookup15 = widths.filter(pl.col("config") == "lookup:nmin=1,nmax=32,k=15,policy=earliest")
    measured = (live.filter(pl.col("config") == "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest")
                .group_by("prompt_id").agg(pl.col("tokens_per_step").first()))
    both = lookup15.join(measured, on="prompt_id", suffix="_vllm")
    assert both.height == 14 and (both["tokens_per_step"] - both["tokens_per_step_vllm"]).abs().max() < 1e-9
    check = pl.read_parquet(FUSED.with_name("vllm_fused_h200.replay.parquet")).filter(pl.col("run") == "fg")
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

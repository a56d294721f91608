"""vLLM's raw runs (as a GPU host returns them) round-trip and become the benchmark's results and step frames
(`hqlab.bench.vllm.frames_from_raw`), benchmarks/vllm_gpu.py finish puts them in place, and the readers of
`hqlab.bench.vllm_report` on committed runs of the studies vllm_gpu and vllm_fused. What each committed run measured is
stated in its claims.json (tests/bench/test_run_claims.py). No vLLM needed."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import pytest

from hqlab.bench import results

ROOT = Path(__file__).resolve().parents[2]
UNK = -1


def _generation(ids, margins=(), steps=3, total=1.0):
    from hqlab.trace import Generation, StepRecord

    records = [StepRecord("p", j, 10 + j, 2, [UNK], [1], 0, 1 if j % 2 else 0, 2 if j % 2 else 1, 0.01, math.nan,
                          0.1 + 0.01 * j, 1, 1) for j in range(steps)]
    return Generation("p", 10, list(ids), "length", 0.1, total, records[-1].t_end, records, list(margins))


def test_raw_runs_round_trip_and_become_bench_rows():
    import polars as pl

    from hqlab.config import DecodeConfig
    from hqlab.bench.vllm import frames_from_raw
    from hqlab.bench.vllm_runs import Run, raw_table, runs_from_raw

    ref = [5, 6, 7, 8, 9, 10]
    runs = [Run("none", "copy", "copy", -1, _generation(ref, margins=[3.0, 0.2, 4.0, 4.0, 4.0, 4.0], total=9.0)),
            Run("none", "copy", "copy", 0, _generation(ref, total=2.0), host_unit_ms=1.0),
            Run("none", "copy", "copy", 1, _generation(ref, total=2.2), host_unit_ms=1.7),
            Run("lookup:k=7", "copy", "copy", 0, _generation(ref, total=1.0)),
            Run("vllm-ngram:k=7", "copy", "copy", 0, _generation([5, 99, 7, 8, 9, 10], total=1.5)),
            Run("pld:k=3", "copy", "copy", 0, _generation([5, 6, 7, 99, 9, 10], total=1.5))]
    table = raw_table(runs)
    back = runs_from_raw(pl.from_arrow(table))
    assert [(r.config, r.repeat, r.generation.output_ids) for r in back] == \
           [(r.config, r.repeat, r.generation.output_ids) for r in runs]
    assert back[3].generation.records[1].emitted == 2 and math.isnan(back[3].generation.records[0].propose_s)
    assert back[1].host_unit_ms == 1.0 and math.isnan(back[3].host_unit_ms)  # NaN: the run did not probe
    older = runs_from_raw(pl.from_arrow(table).drop("host_unit_ms"))  # tables written before the column
    assert all(math.isnan(r.host_unit_ms) for r in older)
    results, steps = frames_from_raw(back, DecodeConfig(max_new_tokens=6), {"dtype": "bfloat16", "model": "m"})
    by = {r["config"]: r for r in results.to_dicts()}
    assert list(by) == ["none", "lookup:k=7", "vllm-ngram:k=7", "pld:k=3"] and results["engine"][0] == "vllm"
    assert by["none"]["total_s"] == pytest.approx(2.1)  # timed runs only: the margins pass is not timed
    assert by["lookup:k=7"]["speedup_e2e"] == pytest.approx(2.1) and by["lookup:k=7"]["divergence"] == "identical"
    assert by["vllm-ngram:k=7"]["divergence"] == "near-tie" and by["vllm-ngram:k=7"]["first_divergence"] == 1
    assert by["pld:k=3"]["divergence"] == "mismatch" and by["pld:k=3"]["divergence_margin"] == 4.0
    assert steps.height == 4 * 3 and set(steps["config"]) == set(by)
    assert by["none"]["host_unit_ms"] == pytest.approx(1.35) and math.isnan(by["lookup:k=7"]["host_unit_ms"])
    # each config's own timed runs: calls finished together can hold different counts (the margins pass is untimed)
    assert by["none"]["repeats"] == 2 and by["lookup:k=7"]["repeats"] == 1


@pytest.mark.parametrize("study", ["vllm_gpu", "vllm_fused"])
def test_committed_rows_count_the_repeats_behind_their_medians(study):
    """Every committed batch-1 row's `repeats` is the number of timed runs of that (run, config, prompt) in the
    run's repeats table, where the run kept one."""
    rows = results.load(study).filter(pl.col("concurrency") <= 1)
    counts = results.load(study, kind="repeats").group_by("run", "config", "prompt_id").agg(pl.len().alias("timed"))
    joined = rows.join(counts, on=["run", "config", "prompt_id"])
    assert joined.height > 200
    assert joined.filter(pl.col("repeats") != pl.col("timed")).select("run", "config").unique().height == 0


def test_gpu_finish_turns_returned_raw_runs_into_a_run_in_place(tmp_path):
    """benchmarks/vllm_gpu.py finish: the GPU host's raw runs (+ engine descriptions) -> a run of the results folder,
    its rows, steps and repeats, and run.json saying the card and the model runners."""
    import importlib.util
    import json

    import pyarrow.parquet as pq

    from hqlab.bench.vllm_runs import Run, raw_table

    spec = importlib.util.spec_from_file_location("vllm_gpu", ROOT / "benchmarks" / "vllm_gpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ref = [5, 6, 7, 8, 9, 10]
    parts = {"a": [Run("none", "copy", "copy", -1, _generation(ref, margins=[1.0] * 6)),
                   Run("none", "copy", "copy", 0, _generation(ref, total=2.0))],
             "b": [Run("lookup:k=7", "copy", "copy", 0, _generation(ref, total=1.0))]}
    raw = []
    for tag, runs in parts.items():
        raw.append(tmp_path / f"vllm_gpu_{tag}.parquet")
        pq.write_table(raw_table(runs), raw[-1])
        engines = [{"config": r.config, "model_runner": "v2" if r.config == "none" else "v1",
                    "async_scheduling": r.config == "none"} for r in runs[-1:]]
        raw[-1].with_suffix(".json").write_text(json.dumps(
            {"machine": "NVIDIA H200, torch 2.11.0+cu130, vllm 0.26.0", "model": "qwen2.5-coder-0.5b",
             "dtype": "bfloat16", "doc_tokens": 2000, "suite": "labd", "max_new_tokens": 6, "engines": engines}))
    root = tmp_path / "results"
    script.main(["finish", *map(str, raw), "--run", "a", "--results", str(root)])
    rows = results.load("vllm_gpu", "a", root=root)
    assert rows["config"].to_list() == ["none", "lookup:k=7"]
    assert rows["vllm_runner"].to_list() == ["v2", "v1"] and rows["speedup_e2e"][1] == pytest.approx(2.0)
    assert rows["machine"][0].startswith("NVIDIA H200") and rows["engine"][0] == "vllm"
    entry = results.run_info("vllm_gpu", "a", root)
    assert entry["card"] == "h200" and entry["vllm_runner"] == ["V1", "V2"]
    assert results.load("vllm_gpu", "a", "steps", root=root).height == 6
    # each timed request's own rate (the margins pass is not timed): the spread the medians hide
    repeats = results.load("vllm_gpu", "a", "repeats", root=root)
    assert repeats["config"].to_list() == ["none", "lookup:k=7"] and repeats["repeat"].to_list() == [0, 0]
    assert repeats["decode_tok_s"].to_list() == pytest.approx(
        [run.generation.decode_tok_s() for run in (parts["a"][1], parts["b"][0])])
    # a config in two calls (each call ran its own `none`) would pool their repeats and batches: refused, and the
    # results already written stay as they were
    again = tmp_path / "vllm_gpu_c.parquet"
    pq.write_table(raw_table(parts["a"]), again)
    again.with_suffix(".json").write_text(raw[0].with_suffix(".json").read_text())
    before = results.run_file("vllm_gpu", "a", "rows.parquet", root).read_bytes()
    with pytest.raises(SystemExit, match="'none' is in both .*vllm_gpu_a.parquet and .*vllm_gpu_c.parquet"):
        script.main(["finish", *map(str, raw), str(again), "--run", "a", "--results", str(root)])
    assert results.run_file("vllm_gpu", "a", "rows.parquet", root).read_bytes() == before
    # a later call with --skip-reference finished as a run of its own: `none` taken from the earlier call's file
    script.main(["finish", str(raw[1]), "--reference", str(raw[0]), "--results", str(root), "--run", "b2"])
    later = results.load("vllm_gpu", "b2", root=root)
    assert later["config"].to_list() == ["none", "lookup:k=7"] and later["speedup_e2e"][1] == pytest.approx(2.0)
    assert results.runs("vllm_gpu", root=root) == ["a", "b2"]
    lookups = tmp_path / "vllm_gpu_d.parquet"  # a file without `none` cannot be the reference
    pq.write_table(raw_table(parts["b"]), lookups)
    lookups.with_suffix(".json").write_text(raw[1].with_suffix(".json").read_text())
    with pytest.raises(SystemExit, match="--reference .*vllm_gpu_d.parquet: it holds no `none` run"):
        script.main(["finish", str(raw[1]), "--reference", str(lookups), "--results", str(root), "--run", "b3"])


def test_burst_and_sustained_loads_are_kept_apart_and_old_tables_read_as_burst():
    """Concurrent runs under the two loads become separate rows and step sequences (`load` column) with their own
    batch throughput; a raw table written before the `load` column existed reads its concurrent runs as bursts."""
    import polars as pl

    from hqlab.bench import vllm_report
    from hqlab.bench.vllm import frames_from_raw
    from hqlab.config import DecodeConfig
    from hqlab.bench.vllm_runs import Run, raw_table, runs_from_raw

    ref = [5, 6, 7, 8, 9, 10]
    runs = [Run("none", "copy", "copy", 0, _generation(ref, total=2.0))]
    for config, burst_wall, sustained_wall in (("none", 4.0, 8.0), ("gpu-lookup:k=15", 5.0, 4.0)):
        runs += [Run(config, pid, "copy", 0, _generation(ref), 2, burst_wall, "burst") for pid in ("copy", "qa")]
        runs += [Run(config, pid, "copy", 0, _generation(ref), 2, sustained_wall, "sustained")
                 for pid in ("copy", "qa", "edit")]
    back = runs_from_raw(pl.from_arrow(raw_table(runs)))
    assert [r.load for r in back] == [r.load for r in runs]
    results, steps = frames_from_raw(back, DecodeConfig(max_new_tokens=6), {"dtype": "bfloat16"})
    # the two loads share configs, requests and concurrency: only `load` keeps their step sequences apart
    per_run = steps.group_by("config", "concurrency", "load", maintain_order=True).agg(pl.col("step"))
    assert per_run.select("config", "load").rows() == [("none", "alone"), ("none", "burst"), ("none", "sustained"),
                                                      ("gpu-lookup:k=15", "burst"), ("gpu-lookup:k=15", "sustained")]
    assert all(s == [0, 1, 2] * (len(s) // 3) for s in per_run["step"].to_list())  # whole sequences, one per request
    assert steps.group_by("load").len().sort("load").to_dicts() == [
        {"load": "alone", "len": 3}, {"load": "burst", "len": 12}, {"load": "sustained", "len": 18}]
    together = results.filter(pl.col("concurrency") > 1)
    assert together.group_by("config", "load").len().sort("config", "load").to_dicts() == [
        {"config": "gpu-lookup:k=15", "load": "burst", "len": 2},
        {"config": "gpu-lookup:k=15", "load": "sustained", "len": 3},
        {"config": "none", "load": "burst", "len": 2}, {"config": "none", "load": "sustained", "len": 3}]
    ratio = {(r["load"], r["config"]): r["vs_none"]
             for r in vllm_report.concurrency(results.with_columns(pl.lit("x").alias("run"))).to_dicts()}
    assert ratio[("burst", "gpu-lookup:k=15")] == pytest.approx(4.0 / 5.0)  # 12 tokens in 5 s vs in 4 s
    assert ratio[("sustained", "gpu-lookup:k=15")] == pytest.approx(8.0 / 4.0)
    old = pl.from_arrow(raw_table(runs)).drop("load")
    assert {r.load for r in runs_from_raw(old)} == {"alone", "burst"}


def test_cost_model_check_holds_each_width_out_on_the_committed_runs():
    """vllm_report.cost_model_check on two committed calls of one session, finished as two runs (together none and
    k = 3, 7, 15, 31): the runs pool under one name, every width of every class is predicted from the others."""
    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    steps = results.load("vllm_gpu", ["l", "l2"], "steps")
    check = vllm_report.cost_model_check(steps, ["l", "l2"])
    assert check["run"].unique().to_list() == ["l+l2"]
    assert check.height == check.select("config", "category").n_unique()  # `none` is training data only
    alone = steps.filter(pl.col("run").is_in(["l", "l2"]) & (pl.col("load") == "alone"))
    for row in check.iter_rows(named=True):  # measured numbers are the recorded steps, pooled
        mine = alone.filter((pl.col("config") == row["config"]) & (pl.col("category") == row["category"]))
        assert row["tokens"] == mine["emitted"].sum()
        assert row["measured_s"] == pytest.approx(mine["step_s"].sum())
    assert check["predicted_s"].is_finite().all() and (check["predicted_s"] > 0).all()
    with pytest.raises(ConfigError, match="at least two gpu-lookup configs"):  # one width: nothing to hold out
        vllm_report.cost_model_check(steps.filter(~pl.col("config").str.contains("k=7")), ["l2"])


def test_request_step_ms_is_each_requests_median_step():
    import polars as pl

    from hqlab.bench import vllm_report

    steps = results.load("vllm_gpu", "m", "steps")
    per = vllm_report.request_step_ms(steps)
    alone = steps.filter(pl.col("load") == "alone")
    assert per.height == alone.select("config", "request").n_unique()
    row = per.filter((pl.col("config") == "none") & (pl.col("request") == "copy")).row(0, named=True)
    mine = alone.filter((pl.col("config") == "none") & (pl.col("request") == "copy"))
    assert row["step_ms"] == pytest.approx(1e3 * mine["step_s"].median()) and row["steps"] == mine.height
    assert row["label"] == "none"


def test_fused_ratios_compare_each_config_with_the_runs_best_baselines():
    """vllm_report.fused_ratios on two committed fused runs, one with vLLM's draft model and one without (its ratio
    to the draft model is null, not zero)."""
    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    fused = results.load("vllm_fused")
    fe = vllm_report.fused_ratios(fused, "fe")
    rows = fused.filter((pl.col("run") == "fe") & (pl.col("concurrency") <= 1))
    assert fe.height == rows.select("category", "config").n_unique()
    copy = fe.filter(pl.col("category") == "copy")
    lookups = copy.filter(pl.col("config").str.starts_with("gpu-lookup"))
    assert (copy["best_gpu_lookup"] == lookups["decode_tok_s"].max()).all()
    assert copy.filter(pl.col("config") == "none")["vs_none"].item() == pytest.approx(1.0)
    mine = rows.filter((pl.col("category") == "copy") & (pl.col("config") == lookups["config"][0]))
    assert lookups["decode_tok_s"][0] == pytest.approx(mine["decode_tok_s"].median())
    assert fe["vs_best_vllm_draft"].is_not_null().all()
    assert vllm_report.fused_ratios(fused, "ff")["vs_best_vllm_draft"].is_null().all()  # no draft model there
    with pytest.raises(ConfigError, match="run 'zz': no batch-1 rows"):
        vllm_report.fused_ratios(fused, "zz")


def test_one_fused_config_compared_across_runs_and_the_host_time_its_speculator_met():
    """fused_ratios_across stacks one config per run (here the compiled skip config of a sequential run and of an
    interleaved one); speculator_host_ms gives each config's own host time per step, the host-level gauge."""
    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    fused = results.load("vllm_fused")
    config = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,skip=2,"
              "skip_on=head,nmin_alone=1,compile_rule=true")
    both = vllm_report.fused_ratios_across(fused, {"ff": config, "fg": config})
    assert both["run"].to_list() == ["ff"] * 7 + ["fg"] * 7 and set(both["config"]) == {config}
    fg = vllm_report.fused_ratios(fused, "fg").filter(pl.col("config") == config)
    assert both.filter(pl.col("run") == "fg")["vs_best_gpu_lookup"].to_list() == fg["vs_best_gpu_lookup"].to_list()
    with pytest.raises(ConfigError, match="run 'fe' has no config"):
        vllm_report.fused_ratios_across(fused, {"fe": config})

    steps = results.load("vllm_fused", kind="steps")
    host = vllm_report.speculator_host_ms(steps, ["ff", "fg"])
    assert "none" not in host["config"].to_list()
    mine = steps.filter((pl.col("run") == "fg") & (pl.col("load") == "alone") & (pl.col("category") == "copy")
                        & (pl.col("config") == config))
    row = host.filter((pl.col("run") == "fg") & (pl.col("category") == "copy") & (pl.col("config") == config))
    assert row["speculator_host_ms"].item() == pytest.approx(1e3 * mine["propose_s"].median())
    with pytest.raises(ConfigError, match="no batch-1 step records"):
        vllm_report.speculator_host_ms(steps, ["zz"])


DEVICE_SKIP_K31 = ("gpu-fused:k=31,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
                   "compile_rule=true,device_skip=true")


def test_best_fused_is_the_fastest_fused_config_of_each_class_against_the_fastest_lookup():
    """A committed run of two fused configs in interleaved rounds, vLLM's draft model from a second call: per class
    the faster fused config, its ratios as `fused_ratios` and `round_ratios` give them, and the lookup's side from
    the same run; a run of another study is named with the runs there are."""
    import polars as pl

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    data = vllm_report.load("vllm_fused")
    table = vllm_report.best_fused(data["results"], data["repeats"], "fj1")
    assert table["category"].to_list() == ["chat", "summary", "qa", "quote", "copy", "code", "edit"]
    ratios = vllm_report.fused_ratios(data["results"], "fj1")
    for row in table.iter_rows(named=True):
        mine = ratios.filter(pl.col("category") == row["category"])
        fused = mine.filter(pl.col("config").str.starts_with("gpu-fused"))
        assert row["config"] == fused.sort("decode_tok_s")["config"][-1]
        assert row["vs_best_gpu_lookup"] == pytest.approx(fused["vs_best_gpu_lookup"].max())
        lookup = mine.filter(pl.col("config") == row["lookup"])
        assert lookup["decode_tok_s"].item() == mine.filter(pl.col("config").str.starts_with("gpu-lookup"))[
            "decode_tok_s"].max()
        assert row["lookup_tokens_per_step"] == lookup["tokens_per_step"].item()
        assert row["paired_low"] <= row["paired_median"] <= row["paired_high"]
    paired = vllm_report.round_ratios(data["repeats"], "fj1", DEVICE_SKIP_K31).filter(pl.col("category") == "code")
    assert table.filter(pl.col("category") == "code")["paired_median"].item() == paired["median"].item()
    with pytest.raises(ConfigError, match=r"run 'w': no batch-1 rows \(runs here: \['fa'"):
        vllm_report.best_fused(data["results"], data["repeats"], "w")  # a run of the GPU lookup's study


def test_round_step_ms_prices_every_rounds_steps_against_the_fastest_lookup():
    """Every round of a committed run: decode time over decode steps per request, median per class and config, and
    its excess over the class's fastest lookup (zero for that lookup)."""
    import polars as pl

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    repeats = results.load("vllm_fused", kind="repeats")
    table = vllm_report.round_step_ms(repeats, "fj1")
    mine = repeats.filter((pl.col("run") == "fj1") & (pl.col("config") == DEVICE_SKIP_K31)
                          & (pl.col("category") == "code"))
    code = table.filter((pl.col("config") == DEVICE_SKIP_K31) & (pl.col("category") == "code")).row(0, named=True)
    assert code["requests"] == mine.height == 10
    assert code["step_ms"] == pytest.approx((1e3 * mine["decode_s"] / (mine["steps"] - 1)).median())
    lookup = table.filter((pl.col("config") == "gpu-lookup:nmin=1,nmax=32,k=31,policy=earliest")
                          & (pl.col("category") == "code")).row(0, named=True)
    assert lookup["over_lookup_ms"] == 0
    assert code["over_lookup_ms"] == pytest.approx(code["step_ms"] - lookup["step_ms"])
    with pytest.raises(ConfigError, match="run 'zz' has no per-repeat rows"):
        vllm_report.round_step_ms(repeats, "zz")


def test_round_ratios_pair_each_request_with_the_best_lookup_in_the_same_round():
    """A committed interleaved run of three rounds: the fused config's decode tok/s over the fastest gpu-lookup config
    of each class, request by request within a round; the ratio of medians lies inside the paired ratios' range."""
    import polars as pl

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    repeats = results.load("vllm_fused", kind="repeats")
    fused = repeats.filter((pl.col("run") == "fh") & pl.col("config").str.starts_with("gpu-fused"))["config"][0]
    table = vllm_report.round_ratios(repeats, "fh", fused)
    assert sorted(table["category"]) == sorted(["copy", "code", "edit", "quote", "summary", "qa", "chat"])
    code = table.filter(pl.col("category") == "code").row(0, named=True)
    assert code["against"] == "gpu-lookup:nmin=1,nmax=32,k=31,policy=earliest" and code["pairs"] == 3
    run = repeats.filter((pl.col("run") == "fh") & (pl.col("prompt_id") == "code"))
    mine = run.filter(pl.col("config") == fused).sort("repeat")["decode_tok_s"]
    theirs = run.filter(pl.col("config") == code["against"]).sort("repeat")["decode_tok_s"]
    assert code["median"] == pytest.approx((mine / theirs).median())
    assert code["low"] <= mine.median() / theirs.median() <= code["high"]
    assert table.filter(pl.col("category") == "chat")["pairs"].item() == 24  # 8 prompts x 3 rounds
    with pytest.raises(ConfigError, match="no config starting with 'vllm-draft'"):
        vllm_report.round_ratios(repeats, "fh", fused, against="vllm-draft")
    with pytest.raises(ConfigError, match="run 'zz' has no per-repeat rows"):
        vllm_report.round_ratios(repeats, "zz", fused)


def test_step_ms_by_passes_splits_steps_by_the_drafters_passes():
    import polars as pl

    from hqlab.bench import vllm_report

    steps = results.load("vllm_fused", kind="steps")
    split = vllm_report.step_ms_by_passes(steps, "ff")
    alone = steps.filter((pl.col("run") == "ff") & (pl.col("load") == "alone"))
    assert split["steps"].sum() == alone.height
    shares = split.group_by("category", "config").agg(pl.col("share").sum())
    assert shares["share"].to_numpy() == pytest.approx(1.0)
    assert set(split.filter(pl.col("config") == "none")["drafter_passes"].to_list()) == {-1}
    fused = split.filter(pl.col("config").str.starts_with("gpu-fused") & (pl.col("category") == "copy"))
    assert set(fused["drafter_passes"].to_list()) <= {0, 1}
    row = fused.filter(pl.col("drafter_passes") == 0).row(0, named=True)
    mine = alone.filter((pl.col("config") == row["config"]) & (pl.col("category") == "copy")
                        & (pl.col("drafter_passes") == 0))
    assert row["step_ms"] == pytest.approx(1e3 * mine["step_s"].median()) and row["steps"] == mine.height


def test_pricing_the_hosts_level_predicts_the_committed_runs_better_than_fixed_prices():
    """Each gpu-lookup config of the committed runs predicted from the run's other configs, with fixed step prices
    and with the host's level (the speculator's own host time in each request) priced: the step of a host-bound
    0.5B follows the host's speed, which fixed prices cannot see."""
    import polars as pl

    from hqlab.bench import vllm_report

    steps = results.load("vllm_gpu", kind="steps")
    runs = [["l", "l2"], ["j"], ["k"], ["m"], ["n"], ["o"], ["p"], ["s"]]
    fixed = pl.concat([vllm_report.cost_model_check(steps, r) for r in runs])
    host = pl.concat([vllm_report.cost_model_check(steps, r, host_level=True) for r in runs])
    assert fixed["model"].unique().to_list() == ["fixed prices"] and host["model"].unique().to_list() == ["host level"]
    assert host.height == fixed.height and not host["config"].str.starts_with("none").any()
    within = {name: int((t["error"].abs() <= 0.1).sum()) for name, t in (("fixed", fixed), ("host", host))}
    assert within["host"] > 2 * within["fixed"], within
    assert host["error"].abs().median() < fixed["error"].abs().median() / 2


def test_host_level_correlation_is_pearson_r_over_each_runs_lookup_requests():
    import numpy as np
    import polars as pl

    from hqlab.bench import vllm_report

    steps = results.load("vllm_gpu", kind="steps")
    per = vllm_report.request_step_ms(steps)
    table = vllm_report.host_level_correlation(per)
    assert table["run"].to_list() == sorted(table["run"].to_list()) and table["r"].is_between(-1, 1).all()
    mine = per.filter((pl.col("run") == "s") & pl.col("config").str.starts_with("gpu-lookup") & (pl.col("steps") >= 5))
    row = table.filter(pl.col("run") == "s").row(0, named=True)
    assert row["requests"] == mine.height
    assert row["r"] == pytest.approx(np.corrcoef(mine["host_ms"], mine["step_ms"])[0, 1])


def test_gpu_phases_take_the_drafting_step_out_of_sampling_and_add_up_to_the_fused_step():
    """A committed run's profiled pass on chat: the drafting step's GPU span sits inside vLLM's sample_tokens span,
    so `gpu_phases` subtracts it; the parts add up to the step's GPU time, and the fused engine's GPU work equals its
    step time over all rounds (the step is GPU-bound); a run without phases is named."""
    import polars as pl

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    data = vllm_report.load("vllm_fused")
    chat = vllm_report.gpu_phases(data["phases"], "fk1", category="chat")
    raw = data["phases"].filter((pl.col("run") == "fk1") & (pl.col("category") == "chat"))
    for row in chat.iter_rows(named=True):
        mine = raw.filter(pl.col("config") == row["config"])
        sampling = mine.filter(pl.col("phase") == "sample_tokens")["gpu_ms"].median()
        assert row["sample + accept"] == pytest.approx(max(sampling - row["propose"], 0.0))
        assert row["gpu_ms"] == pytest.approx(sum(row[p] for p in vllm_report.GPU_PHASES))
    steps = vllm_report.round_step_ms(data["repeats"], "fk1").filter(pl.col("category") == "chat")
    fused = chat.filter(pl.col("config").str.starts_with("gpu-fused")).join(steps, on="config")
    assert ((fused["gpu_ms"] - fused["step_ms"]).abs() < 0.1).all()
    with pytest.raises(ConfigError, match="run 'fj1' has no profiled phases"):
        vllm_report.gpu_phases(data["phases"], "fj1")


def test_prefill_times_read_every_variant_and_call_of_a_prefill_profile():
    """A committed prefill profile (experiments/drafting_step_profile/fused_pass_kernels.py --prefill): four variants,
    five warm lengths and eight first calls each; every warm median inside its repeats' range; the first variant's first
    calls agree with themselves; the captured passes' warm time grows with the 64-position passes a prompt takes (one
    pass for 64 tokens, sixteen for 1,024); a JSON without variant rows is refused."""
    import json

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    profile = json.loads(results.read_text("fused_pass_kernels", "p1", "profile.json"))
    times = vllm_report.prefill_times(profile)
    assert times.group_by("variant", "call").len().sort("variant", "call")["len"].to_list() == [8, 5] * 4
    assert set(times["label"]) == set(vllm_report.PREFILL_LABELS.values())
    warm = times.filter(pl.col("call") == "warm")
    assert ((warm["ms_min"] <= warm["ms"]) & (warm["ms"] <= warm["ms_max"])).all()
    first = times.filter((pl.col("call") == "first") & (pl.col("variant") == "chunk1024"))
    assert first["same_argmax"].all()
    graph = warm.filter(pl.col("variant") == "graph64").sort("prompt")
    per_pass = graph["ms"] / (graph["prompt"] // 64)
    assert per_pass.max() < 1.2 * per_pass.min()  # one replay per 64 positions, each alike
    with pytest.raises(ConfigError, match="no prefill rows"):
        vllm_report.prefill_times({"rows": [{"prompt": 64, "ms": 1.0}]})


def test_pass_kernel_parts_split_the_profiled_drafting_step_by_what_its_kernels_do():
    """Committed kernel tables (experiments/drafting_step_profile/fused_pass_kernels.py, the one-pass config at 2,048
    tokens): the parts add up to the table, each of the 0.5B's 24 layers launches one cache write and three attention
    kernels (FlashAttention, its combine, its scheduler); plan_once drops the scheduler from all but one call; with
    layers=triton a layer is four Triton kernels around the attention, one with the Triton attention too."""
    import json

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    for tag in ("fk", "fk2", "fl"):
        profile = json.loads(results.read_text("fused_pass_kernels", tag, "profile.json"))
        parts = vllm_report.pass_kernel_parts(profile)
        for config, table in profile["kernels"].items():
            mine = {r["part"]: r for r in parts.filter(parts["config"] == config).iter_rows(named=True)}
            assert sum(r["us"] for r in mine.values()) == pytest.approx(sum(k["us_per_step"] for k in table["rows"]))
            if "layers=triton" in config:  # four kernels a layer, the cache written by the first
                assert mine["Triton drafter layers (K1-K4)"]["kernels"] == 4 * 24 and "KV cache write" not in mine
                assert "matrix products" in mine and mine["matrix products"]["kernels"] == 1  # the lm_head row
                continue
            assert mine["KV cache write"]["kernels"] == 24
            # per layer: FlashAttention, + its combine unless splits=1, + its scheduler unless plan_once (then one
            # scheduling call for the whole pass)
            split, plan = "splits=1" in config, "plan_once=true" in config
            expected = 24 * (1 + (not split) + (not plan)) + plan
            assert mine["attention"]["kernels"] == expected
            assert mine["matrix products"]["us"] > mine["fused elementwise (norms, rotary, SiLU)"]["us"]
    with pytest.raises(ConfigError, match="no kernel tables"):
        vllm_report.pass_kernel_parts({"rows": []})
    # the tuned Triton layers, then with the Triton attention (one kernel a layer instead of FlashAttention's two and
    # its scheduler)
    profile = json.loads(results.read_text("fused_pass_kernels", "t1", "profile.json"))
    parts = vllm_report.pass_kernel_parts(profile)
    triton_attention = next(c for c in profile["kernels"] if "attention=triton" in c)
    mine = {r["part"]: r for r in parts.filter(parts["config"] == triton_attention).iter_rows(named=True)}
    assert mine["attention"]["kernels"] == 24 and mine["Triton drafter layers (K1-K4)"]["kernels"] == 4 * 24


def test_tile_sweep_compares_each_kernels_first_and_best_tiles_with_cublas_and_flashattention():
    """A committed tile sweep (experiments/drafter_kernel_tiles/drafter_layer_tiles.py): every kernel at 16 and 64 rows
    and the attention at one and four requests has a reference, the table's time and a best that is no slower than the
    table's (the table's tiles are among the candidates or the best beats them)."""
    import json

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    sweep = json.loads(results.read_text("drafter_layer_tiles", "t1", "sweep.json"))
    table = vllm_report.tile_sweep(sweep)
    assert set(zip(table["kernel"], table["rows"])) == {(k, r) for k in ("qkv", "o_proj", "gate_up", "down")
                                                        for r in (16, 64)} | {("attention", 1), ("attention", 4)}
    assert (table["best_us"] <= table["table_us"] * 1.02).all()
    layers = table.filter(table["kernel"] != "attention")
    assert (layers["reference"] == "cuBLAS product").all() and layers["candidates"].min() > 50
    with pytest.raises(ConfigError, match="no reference rows"):
        vllm_report.tile_sweep({"rows": []})


def test_a_rerun_stands_in_for_a_config_only_where_it_took_the_same_steps():
    """`replay_rows` with a rerun: a later run that repeated one of the run's configs step for step (`same_steps`)
    stands in for that config's replay, every other config keeps the run's own; a rerun whose steps differ (one
    accepted count changed) stands in for nothing; a rerun without a replay, or no step records, is refused."""
    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    replayed = results.load("vllm_fused", ["fn2", "fn3a"], "replay")
    steps = results.load("vllm_fused", ["fn2", "fn3a"], "steps")
    (config,) = replayed.filter(pl.col("run") == "fn3a")["config"].unique().to_list()
    assert vllm_report.same_steps(steps, "fn2", "fn3a", config)
    both = vllm_report.replay_rows(replayed, "fn2", steps, rerun="fn3a")
    assert set(both.filter(pl.col("config") == config)["replay_run"]) == {"fn3a"}
    assert set(both.filter(pl.col("config") != config)["replay_run"]) == {"fn2"}
    changed = steps.with_columns(
        pl.when((pl.col("run") == "fn3a") & (pl.col("request") == "chat-travel") & (pl.col("step") == 3))
        .then(pl.col("accepted") - 1).otherwise(pl.col("accepted")).alias("accepted"))
    assert not vllm_report.same_steps(changed, "fn2", "fn3a", config)
    kept = vllm_report.replay_rows(replayed, "fn2", changed, rerun="fn3a")
    assert set(kept["replay_run"]) == {"fn2"} and kept.height == both.height
    with pytest.raises(ConfigError, match="no replay of that run"):
        vllm_report.replay_rows(replayed, "fn2", steps, rerun="fn3")
    with pytest.raises(ConfigError, match="give the step records"):
        vllm_report.replay_rows(replayed, "fn2", rerun="fn3a")


def test_fused_vs_lookup_gives_each_config_both_ratios_and_names_a_missing_config():
    """A committed run's two one-pass configs over the fastest lookup of each class: the ratio of class medians is
    `fused_ratios`', the paired one `round_ratios`' median; a config the run did not time at batch 1 is named; the
    run's figure is named after its study, card and run."""
    import polars as pl

    from hqlab.bench import vllm_report
    from hqlab.config import ConfigError

    data = vllm_report.load("vllm_fused")
    one_pass = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
                "compile_rule=true,layers=triton,attention=triton")
    configs = [DEVICE_SKIP_K31 + ",layers=triton,attention=triton", one_pass]
    bars = vllm_report.fused_vs_lookup(data["results"], data["repeats"], "fn2", configs)
    assert bars.height == 2 * 2 * 7 and set(bars["config"]) == set(configs)
    medians = vllm_report.fused_ratios(data["results"], "fn2").filter(pl.col("config") == one_pass)
    mine = bars.filter((pl.col("config") == one_pass) & (pl.col("how") == "medians")).join(medians, on="category")
    assert (mine["ratio"] == mine["vs_best_gpu_lookup"]).all()
    paired = vllm_report.round_ratios(data["repeats"], "fn2", one_pass)
    mine = bars.filter((pl.col("config") == one_pass) & (pl.col("how") == "paired")).join(paired, on="category")
    assert mine.height == 7 and (mine["ratio"] == mine["median"]).all()
    assert vllm_report.run_figure("vllm_fused", "fn2") == "vllm_fused_h200_fn2.svg"
    with pytest.raises(ConfigError, match="no batch-1 rows of"):
        vllm_report.fused_vs_lookup(data["results"], data["repeats"], "fn3a", configs)

"""Projected speed at scale (hqlab.replay.scale): the step-cost interpolation, the projection's arithmetic on
hand-checkable frames, and reading a committed run's steps. What the committed grids and validations gave is stated
in the claims.json of data/results/seed_scale/<run>/ (tests/bench/test_run_claims.py)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results
from hqlab.replay import scale

WIDTHS = (1, 2, 4, 8, 16, 32)
CONTEXTS = (1024, 8192, 32768)


def _ms(shape_scale: float, width: int, context: int, batch: int) -> float:
    """A made-up cost surface, curved in the width and the context, so that interpolation is not exact between
    grid points by accident."""
    return shape_scale * (1.0 + 0.05 * width ** 1.5 + 0.2 * math.sqrt(context / 1024) + 0.5 * batch)


def schema_fixture(shapes: dict[str, float] | None = None, *, fused: dict[str, float] | None = None,
                   widths=WIDTHS, contexts=CONTEXTS, batches=(1, 8)) -> pl.DataFrame:
    """A step-cost frame in the schema of a seed-scale run's grid.parquet, with made-up values: a schema
    fixture for the tests, not a result."""
    shapes = shapes or {"s-small": 1.0, "s-large": 4.0}
    rows = []
    for config, table in (("gpu-lookup", shapes), ("gpu-fused", fused or {})):
        for shape, k in table.items():
            for c in contexts:
                for b in batches:
                    for w in widths:
                        if config == "gpu-fused" and w == 1:
                            continue
                        rows.append({"run": "fixture", "shape": shape, "target_params_b": 10 * k, "layers": 1,
                                     "hidden": 1, "quant": "bf16", "config": config, "width": w, "context": c,
                                     "batch": b, "step_ms": _ms(k, w, c, b) + (0.7 if config == "gpu-fused" else 0),
                                     "step_ms_p10": 0.0, "step_ms_p90": 0.0, "steps": 12, "drafter": "",
                                     "engine_start_s": 0.0, "machine": "fixture", "vllm_version": "0",
                                     "git_commit": "fixture"})
    return pl.DataFrame(rows, schema=scale.STEP_COST_SCHEMA)


def flat_fixture(table: dict[tuple[str, str, int], float], *, params: dict[str, float]) -> pl.DataFrame:
    """(shape, config, width) -> ms, the same at contexts 1024 and 8192 and batch 1: hand-checkable costs."""
    rows = [{"run": "fixture", "shape": shape, "target_params_b": params[shape], "layers": 1, "hidden": 1,
             "quant": "bf16", "config": config, "width": w, "context": c, "batch": 1, "step_ms": ms,
             "step_ms_p10": ms, "step_ms_p90": ms, "steps": 12, "drafter": "", "engine_start_s": 0.0,
             "machine": "fixture", "vllm_version": "0", "git_commit": "fixture"}
            for (shape, config, w), ms in table.items() for c in (1024, 8192)]
    return pl.DataFrame(rows, schema=scale.STEP_COST_SCHEMA)


# --- interpolation ---------------------------------------------------------------------------------------------


def test_interpolation_is_exact_at_every_grid_point():
    costs = schema_fixture()
    for shape, k in {"s-small": 1.0, "s-large": 4.0}.items():
        for b in (1, 8):
            w, c = np.meshgrid(WIDTHS, CONTEXTS)
            got = scale.step_ms(costs, shape, "gpu-lookup", w.ravel(), c.ravel(), b)
            want = [_ms(k, wi, ci, b) for wi, ci in zip(w.ravel(), c.ravel())]
            np.testing.assert_allclose(got, want, rtol=1e-12)


def test_interpolation_is_linear_in_width_and_in_log_context():
    costs = schema_fixture()
    # between widths 8 and 16 at a measured context: a straight line
    got = scale.step_ms(costs, "s-small", "gpu-lookup", [10, 12], 8192, 1)
    lo, hi = _ms(1, 8, 8192, 1), _ms(1, 16, 8192, 1)
    np.testing.assert_allclose(got, [lo + (hi - lo) * 2 / 8, (lo + hi) / 2], rtol=1e-12)
    # between contexts 1024 and 8192 (a factor of 8): a quarter of the way in log is 1024 * 8 ** 0.25
    c = 1024 * 8 ** 0.25
    got = scale.step_ms(costs, "s-large", "gpu-lookup", 4, c, 8)[0]
    assert got == pytest.approx(0.75 * _ms(4, 4, 1024, 8) + 0.25 * _ms(4, 4, 8192, 8), rel=1e-12)
    assert got != pytest.approx(_ms(4, 4, c, 8), rel=1e-3)  # not the curved surface itself: interpolated
    # both at once: bilinear
    got = scale.step_ms(costs, "s-small", "gpu-lookup", 3, math.sqrt(8192 * 32768), 1)[0]
    corners = [_ms(1, w, ctx, 1) for w in (2, 4) for ctx in (8192, 32768)]
    assert got == pytest.approx(sum(corners) / 4, rel=1e-12)


@pytest.mark.parametrize("width, context, batch, match", [
    (64, 1024, 1, "width 64 is outside"),
    (0.5, 1024, 1, "width 0.5 is outside"),
    (4, 512, 1, "context 512 is outside"),
    (4, 65536, 1, "context 65536 is outside"),
    (4, 2048, 4, "not measured at batch 4"),
])
def test_points_outside_the_grid_are_refused(width, context, batch, match):
    with pytest.raises(scale.ScaleError, match=match):
        scale.step_ms(schema_fixture(), "s-small", "gpu-lookup", width, context, batch)


def test_a_ragged_grid_refuses_widths_missing_at_the_bracketing_context():
    costs = schema_fixture().filter(~((pl.col("context") == 8192) & (pl.col("width") == 32)))
    assert scale.step_ms(costs, "s-small", "gpu-lookup", 32, 1024, 1)[0] == pytest.approx(_ms(1, 32, 1024, 1))
    with pytest.raises(scale.ScaleError, match="width 32 is outside the widths measured at context 8192"):
        scale.step_ms(costs, "s-small", "gpu-lookup", 32, 2048, 1)


def test_bad_grids_are_refused():
    costs = schema_fixture()
    with pytest.raises(scale.ScaleError, match="missing column"):
        scale.check_step_costs(costs.drop("step_ms"))
    with pytest.raises(scale.ScaleError, match="more than once"):
        scale.check_step_costs(pl.concat([costs, costs.head(1).with_columns(pl.lit("again").alias("run"))]))
    with pytest.raises(scale.ScaleError, match="non-positive"):
        scale.check_step_costs(costs.with_columns(pl.lit(0.0).alias("step_ms")))
    with pytest.raises(scale.ScaleError, match="unknown config"):
        scale.check_step_costs(costs.with_columns(pl.lit("lookup").alias("config")))
    with pytest.raises(scale.ScaleError, match="nothing measured for s-huge"):
        scale.step_ms(costs, "s-huge", "gpu-lookup", 4, 2048, 1)


# --- projection arithmetic -------------------------------------------------------------------------------------

PARAMS = {"t": 30.0, "f": 1.5, "d": 0.5}
FLAT = {("t", "gpu-lookup", 1): 2.0, ("t", "gpu-lookup", 4): 3.0,
        ("f", "gpu-lookup", 1): 1.0, ("f", "gpu-lookup", 4): 3.5, ("f", "gpu-fused", 4): 4.5,
        ("d", "gpu-lookup", 1): 0.8, ("d", "gpu-lookup", 4): 1.2}


def _traces(config: str, passes=(1, 1), contexts=(1024, 1028), emitted=(4, 2)) -> scale.Traces:
    steps = pl.DataFrame({"request": ["r1", "r1"], "category": ["copy", "copy"], "config": [config] * 2,
                          "context_len": list(contexts), "verify_len": [4, 4], "emitted": list(emitted),
                          "drafter_passes": list(passes), "step_s": [0.004, 0.002], "load": ["alone"] * 2,
                          "run": ["x"] * 2},
                         schema_overrides={"context_len": pl.Int32, "verify_len": pl.Int32, "emitted": pl.Int32,
                                           "drafter_passes": pl.Int32})
    return scale.Traces(steps, "x", config, "m", "c0")


def test_lookup_projection_is_tokens_over_summed_step_costs():
    costs = flat_fixture(FLAT, params=PARAMS)
    per = scale.price_requests(_traces("gpu-lookup:k=3"), costs, "t", 1)
    row = per.row(0, named=True)
    assert (row["tokens"], row["steps"]) == (6, 2)
    assert row["ms"] == pytest.approx(6.0)  # two width-4 steps at 3 ms
    assert row["none_ms"] == pytest.approx(12.0)  # six tokens, one 2 ms step each
    assert row["tok_s"] == pytest.approx(1000.0) and row["none_tok_s"] == pytest.approx(500.0)
    assert row["recorded_ms"] == pytest.approx(6.0)


def test_fused_projection_adds_the_measured_pass_where_a_step_ran_it():
    costs = flat_fixture(FLAT, params=PARAMS)
    # pass = f's fused 4.5 - f's lookup 3.5 = 1.0 ms; the first step ran it, the second skipped it
    tr = _traces("gpu-fused:k=3,draft_block=1", passes=(1, 0))
    per = scale.price_requests(tr, costs, "t", 1, fused_shape="f")
    assert per["ms"][0] == pytest.approx((3.0 + 1.0) + 3.0)
    # a drafter scaled from d to f: the pass grows by f's lookup step minus d's (3.5 - 1.2 at width 4)
    per = scale.price_requests(tr, costs, "t", 1, fused_shape="f", drafter_shape="f", measured_drafter_shape="d")
    assert per["ms"][0] == pytest.approx((3.0 + 1.0 + 2.3) + 3.0)
    with pytest.raises(scale.ScaleError, match="fused_shape"):
        scale.price_requests(tr, costs, "t", 1)


def test_project_table_speedups_and_provenance():
    costs = flat_fixture(FLAT, params=PARAMS)
    table = scale.project(costs, [_traces("gpu-lookup:k=3"), _traces("gpu-fused:k=3,draft_block=1")], ["t"], [1],
                          fused_shape="f", measured_drafter_shape="d", drafters=("measured", "scaled"))
    assert set(scale.PROJECTION_COLUMNS) == set(table.columns)
    lookup = table.filter(pl.col("label") == "gpu-lookup k=3").row(0, named=True)
    assert lookup["speedup"] == pytest.approx(2.0) and lookup["tokens_per_step"] == pytest.approx(3.0)
    fused = {r["drafter"]: r for r in table.filter(pl.col("label") == "gpu-fused k=3").iter_rows(named=True)}
    assert fused["measured"]["speedup"] == pytest.approx(12.0 / 8.0)
    # 30B target, ratio 1/20 -> 1.5B: the nearest of the shapes to 1.5 is f
    assert fused["scaled"]["drafter_shape"] == "f"
    assert fused["scaled"]["speedup"] == pytest.approx(12.0 / (8.0 + 2 * 2.3))
    assert table["traces_commit"].unique().to_list() == ["c0"] and table["step_costs_run"][0] == "fixture"


def test_an_fp8_target_takes_the_drafter_pass_measured_in_bf16():
    fp8 = flat_fixture({("t", "gpu-lookup", 1): 1.5, ("t", "gpu-lookup", 4): 2.0}, params=PARAMS).with_columns(
        pl.lit("fp8").alias("quant"))
    costs = pl.concat([flat_fixture(FLAT, params=PARAMS), fp8])
    tr = _traces("gpu-fused:k=3,draft_block=1", passes=(1, 1))
    per = scale.price_requests(tr, costs, "t", 1, quant="fp8", fused_shape="f")
    assert per["ms"][0] == pytest.approx(2 * (2.0 + 1.0)) and per["none_ms"][0] == pytest.approx(6 * 1.5)
    with pytest.raises(scale.ScaleError, match="nothing measured for f fp8 gpu-fused"):
        scale.price_requests(tr, costs, "t", 1, quant="fp8", fused_shape="f", pass_quant="fp8")


def test_validate_compares_class_medians_of_prompts():
    costs = flat_fixture(FLAT, params=PARAMS)
    config = "gpu-lookup:k=3"
    # two copy prompts: r1 emits 6 tokens in two 3 ms steps (1000 tok/s), r2 4 tokens in two (667 tok/s)
    steps = pl.DataFrame({"request": ["r1", "r1", "r2", "r2"], "category": ["copy"] * 4, "config": [config] * 4,
                          "context_len": [1024, 1028, 1024, 1026], "verify_len": [4] * 4, "emitted": [4, 2, 2, 2],
                          "drafter_passes": [-1] * 4, "step_s": [0.003] * 4, "load": ["alone"] * 4, "run": ["x"] * 4})
    results = pl.DataFrame({"run": ["x", "x"], "config": [config] * 2, "category": ["copy"] * 2,
                            "prompt_id": ["r1", "r2"], "concurrency": [1, 1], "decode_tok_s": [900.0, 700.0],
                            "model": ["m", "m"], "git_commit": ["c0", "c0"]})
    table = scale.validate(costs, steps, results, "x", "t")
    row = table.row(0, named=True)
    assert row["predicted_tok_s"] == pytest.approx((1000 + 4000 / 6) / 2)  # the median of two is their mean
    assert row["measured_tok_s"] == pytest.approx(800.0)
    assert row["ratio"] == pytest.approx(row["predicted_tok_s"] / 800.0) and row["within"] is (row["ratio"] <= 1.1)
    assert scale.validation_fraction(table) == float(row["within"])
    assert row["predicted_step_ms"] == pytest.approx(3.0) and row["recorded_step_ms"] == pytest.approx(3.0)
    with pytest.raises(scale.ScaleError, match="no batch-1 result rows"):
        scale.validate(costs, steps, results, "y", "t")


def test_speedup_check_divides_each_side_by_its_own_none():
    table = pl.DataFrame({"run": ["x"] * 4, "config": ["none", "a", "none", "a"], "label": ["none", "a"] * 2,
                          "category": ["copy", "copy", "chat", "chat"],
                          "measured_tok_s": [100.0, 1000.0, 100.0, 150.0],
                          "predicted_tok_s": [50.0, 540.0, 80.0, 100.0]})
    got = {r["category"]: r for r in scale.speedup_check(table).iter_rows(named=True)}
    assert got["copy"]["measured_speedup"] == pytest.approx(10.0)
    assert got["copy"]["predicted_speedup"] == pytest.approx(10.8) and got["copy"]["speedup_within"]
    assert got["chat"]["speedup_ratio"] == pytest.approx(1.25 / 1.5) and not got["chat"]["speedup_within"]
    with pytest.raises(scale.ScaleError, match="no `none` rows"):
        scale.speedup_check(table.filter(pl.col("config") != "none"))


def test_contexts_outside_the_grid_are_refused_unless_clamped_and_then_counted():
    costs = flat_fixture(FLAT, params=PARAMS)
    for contexts in ((500, 504), (1024, 9000)):
        tr = _traces("gpu-lookup:k=3", contexts=contexts)
        with pytest.raises(scale.ScaleError, match="outside the grid's 1024-8192"):
            scale.price_requests(tr, costs, "t", 1)
        per = scale.price_requests(tr, costs, "t", 1, outside_context="clamp")
        assert per["clamped"][0] == sum(c < 1024 or c > 8192 for c in contexts)
        assert per["ms"][0] == pytest.approx(6.0)


def test_a_profiled_pass_prices_fused_steps_at_batch_one():
    costs = flat_fixture(FLAT, params=PARAMS)
    tr = _traces("gpu-fused:k=3,draft_block=1", passes=(1, 0))
    per = scale.price_requests(tr, costs, "t", 1, profiled_pass={4: 1.25})
    assert per["ms"][0] == pytest.approx((3.0 + 1.25) + 3.0)
    scaled = scale.price_requests(tr, costs, "t", 1, profiled_pass={4: 1.25}, drafter_shape="f",
                                  measured_drafter_shape="d")
    assert scaled["ms"][0] == pytest.approx((3.0 + 1.25 + 2.3) + 3.0)
    with pytest.raises(scale.ScaleError, match="no profiled pass at width"):
        scale.price_requests(tr, costs, "t", 1, profiled_pass={16: 1.0})


def test_profiled_pass_leaves_out_skipped_passes_and_long_blocks():
    fused = "gpu-fused:k=31,draft_block=1,device_skip=true"
    phases = pl.DataFrame({
        "run": ["r"] * 7, "phase": ["propose (speculator)"] * 6 + ["execute_model"],
        "config": [fused, fused, fused, "gpu-fused:k=15,draft_block=7", "gpu-lookup:k=15", fused, fused],
        "gpu_ms": [1.2, 1.3, 0.05, 9.0, 0.03, 1.1, 2.5]})
    assert scale.profiled_pass_ms(phases, "r") == {32: pytest.approx(1.2)}  # median of 1.2, 1.3, 1.1
    with pytest.raises(scale.ScaleError, match="no profiled drafter passes"):
        scale.profiled_pass_ms(phases, "other")


def test_scaled_drafter_follows_the_ratio():
    costs = schema_fixture({"a": 0.05, "b": 0.15, "c": 3.0})  # 0.5B, 1.5B and 30B
    assert scale.scaled_drafter_shape(costs, 7.0) == "a"
    assert scale.scaled_drafter_shape(costs, 32.0) == "b"
    with pytest.raises(scale.ScaleError, match="ratio"):
        scale.scaled_drafter_shape(costs, 32.0, ratio=2.0)


def test_labels_and_kinds():
    assert scale.config_label("gpu-fused:k=31,draft_block=1,device_skip=true") == "gpu-fused k=31 device skip"
    assert scale.config_label("gpu-fused:k=15,draft_block=7") == "gpu-fused k=15 block 7"
    with pytest.raises(scale.ScaleError, match="only none"):
        scale.config_kind("vllm-draft:model=x,k=7")


def test_a_projection_without_provenance_or_rows_is_refused():
    costs = flat_fixture(FLAT, params=PARAMS)
    table = scale.project(costs, [_traces("gpu-lookup:k=3")], ["t"], [1])
    assert scale.checked_projection(table) is table
    with pytest.raises(scale.ScaleError, match="traces_commit"):
        scale.checked_projection(table.drop("traces_commit"))
    with pytest.raises(scale.ScaleError, match="no rows"):
        scale.checked_projection(table.clear())


# --- the committed runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fused_run():
    return results.load("vllm_fused", "fn2", "steps"), results.load("vllm_fused", "fn2")


def test_traces_of_the_committed_fused_run(fused_run):
    steps, rows = fused_run
    priced = [c for c in rows["config"].unique().to_list() if scale.priceable(steps, "fn2", c)]
    assert {scale.config_label(c) for c in priced} == {"none", "gpu-lookup k=15", "gpu-lookup k=31",
                                                       "gpu-fused k=15", "gpu-fused k=31 device skip"}
    block = next(c for c in rows["config"].unique().to_list() if "draft_block=7" in c)
    with pytest.raises(scale.ScaleError, match="one pass a step"):
        scale.traces(steps, rows, "fn2", block)
    tr = scale.traces(steps, rows, "fn2", next(c for c in priced if "device_skip" in c))
    assert tr.model == "qwen2.5-coder-1.5b" and (tr.steps["drafter_passes"] == 0).any()


def test_a_none_grid_prices_none_and_the_no_speculation_time_where_it_covers_the_lookups_contexts():
    """`none` and `none_ms` come from the engine without a speculator where the grid measured it (1.5 ms against the
    lookup's width-1 2 ms here); a `none` grid missing one of the lookup's contexts is not used."""
    table = {**FLAT, ("t", "none", 1): 1.5}
    costs = flat_fixture(table, params=PARAMS)
    assert scale.plain_config(costs, "t", 1) == "none" and scale.plain_config(costs, "d", 1) == "gpu-lookup"
    per = scale.price_requests(_traces("gpu-lookup:k=3"), costs, "t", 1)
    assert per["ms"][0] == pytest.approx(6.0) and per["none_ms"][0] == pytest.approx(9.0)  # 6 tokens x 1.5 ms
    plain = scale.price_requests(_traces("none", passes=(-1, -1), emitted=(1, 1)), costs, "t", 1)
    assert plain["ms"][0] == pytest.approx(3.0)  # two one-token steps at 1.5 ms, not the lookup's 2 ms
    partial = costs.filter(~((pl.col("config") == "none") & (pl.col("context") == 8192)))
    assert scale.plain_config(partial, "t", 1) == "gpu-lookup"
    assert scale.price_requests(_traces("gpu-lookup:k=3"), partial, "t", 1)["none_ms"][0] == pytest.approx(12.0)


def test_newest_points_keeps_one_row_a_point_from_the_run_named_last():
    costs = flat_fixture(FLAT, params=PARAMS)
    old = costs.with_columns(pl.lit("a").alias("run"))
    new = old.filter(pl.col("width") == 1).with_columns(pl.lit("b").alias("run"), pl.col("step_ms") * 2)
    both = pl.concat([old, new])
    with pytest.raises(scale.ScaleError, match="appears more than once"):
        scale.check_step_costs(both)
    picked = scale.check_step_costs(scale.newest_points(both, ["a", "b"]))
    assert picked.height == old.height
    assert set(picked.filter(pl.col("width") == 1)["run"]) == {"b"}
    assert set(picked.filter(pl.col("width") != 1)["run"]) == {"a"}
    assert set(scale.newest_points(both, ["b", "a"])["run"]) == {"a"}  # the order named decides, not the file's
    for runs, message in ((["a", "c"], r"no rows of run\(s\) \['c'\]"), (["a", "a"], "named twice"),
                          ([], "at least one run")):
        with pytest.raises(scale.ScaleError, match=message):
            scale.newest_points(both, runs)


def test_decodes_are_priced_with_each_points_mean_where_every_point_has_one():
    """A decode's time is the sum of its steps, so a point's mean prices it (a grid from before the mean was kept,
    or with a point lacking it, keeps the median); the step's price then follows the mean."""
    costs = flat_fixture(FLAT, params=PARAMS)
    assert scale.decode_costs(costs)[1] == "median"
    with_mean = costs.with_columns((pl.col("step_ms") * 1.25).alias("step_ms_mean"))
    priced, statistic = scale.decode_costs(with_mean)
    assert statistic == "mean" and priced["step_ms"].to_list() == with_mean["step_ms_mean"].to_list()
    assert scale.step_ms(priced, "t", "gpu-lookup", 4, 1024, 1) == pytest.approx(3.75)
    one_missing = with_mean.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(None)
                                         .otherwise(pl.col("step_ms_mean")).alias("step_ms_mean"))
    assert scale.decode_costs(one_missing)[1] == "median"
    committed = results.load("seed_scale", "v3a", "grid")  # measured before the mean was kept
    assert scale.decode_costs(committed)[1] == "median"

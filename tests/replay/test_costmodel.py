"""The cost model: recovering known step costs, robustness, extrapolation, proposal cost, the committed live runs
(held out per configuration) and the committed H200 measurements."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results
from hqlab.replay.costmodel import (CostModel, ProposalCost, holdout_predictions, host_levels, robust_lstsq,
                                    suite_errors)
from hqlab.trace import StepRecord

TRUTH = {"fixed": 90.0, "verify_jump": 12.0, "per_position": 0.8, "per_1k_context": 4.0,
         "per_position_1k_context": 1.5}


def _truth(v, c):
    v, c = np.asarray(v, float), np.asarray(c, float) / 1000
    return (TRUTH["fixed"] + TRUTH["verify_jump"] * (v > 1) + TRUTH["per_position"] * (v - 1)
            + TRUTH["per_1k_context"] * c + TRUTH["per_position_1k_context"] * (v - 1) * c)


def test_fit_recovers_the_step_cost_despite_outliers():
    rng = np.random.default_rng(0)
    v = rng.integers(1, 17, 3000)
    c = rng.integers(100, 3000, 3000)
    y = _truth(v, c) + rng.normal(0, 2.0, v.size)
    slow = rng.random(v.size) < 0.08  # another process steals the CPU now and then: much slower steps
    y[slow] *= rng.uniform(1.3, 2.0, slow.sum())
    model = CostModel.fit_points(v, c, y)
    for term, value in TRUTH.items():
        assert model.coef[term] == pytest.approx(value, abs=0.05 * max(abs(value), 1.0)), term
    plain = np.linalg.lstsq(np.stack([np.ones(v.size), v > 1, v - 1, c / 1e3, (v - 1) * c / 1e3], 1), y, rcond=None)[0]
    assert abs(plain[0] - TRUTH["fixed"]) > 3 * abs(model.coef["fixed"] - TRUTH["fixed"])  # least squares is pulled


def test_robust_lstsq_is_least_squares_on_clean_data():
    x = np.stack([np.ones(5), np.arange(5.0)], 1)
    assert robust_lstsq(x, 2 + 3 * np.arange(5.0)) == pytest.approx([2.0, 3.0])


def test_the_jump_is_fitted_only_where_the_data_can_tell_it_from_the_slope():
    grid = pl.DataFrame([{"context_len": c, "verify_len": v, "step_ms": float(_truth(v, c))}
                         for c in (512, 2048) for v in (1, 2, 8, 16)])
    model = CostModel.fit(grid)
    assert model.coef["verify_jump"] == pytest.approx(TRUTH["verify_jump"], rel=1e-6)
    two = grid.filter(pl.col("verify_len").is_in([1, 16]))
    assert CostModel.fit(two).coef["verify_jump"] == 0.0


def test_contexts_outside_the_grid_follow_the_fitted_line_instead_of_the_edge_cell():
    """The old interpolating model clamped chat contexts (150-450 tokens) to the 512-token cell of the grid."""
    grid = pl.DataFrame([{"context_len": c, "verify_len": v, "step_ms": float(_truth(v, c))}
                         for c in (512, 1024, 2048) for v in (1, 4, 8, 16)])
    model = CostModel.fit(grid)
    for v, c in [(1, 150), (8, 300), (16, 4096)]:
        assert model.step_ms(v, c) == pytest.approx(float(_truth(v, c)), rel=1e-9)
    assert np.allclose(model.step_ms(np.array([1, 8]), np.array([150, 300])), _truth([1, 8], [150, 300]))


def test_steps_proposals_and_baseline():
    recs = [StepRecord("r", i, 1000 + 3 * i, 4, [1, 2, 3], [1, 1, 1], 6, 2, 3, 0.2, 0.001, 0.0, block=15)
            for i in range(20)]
    frame = pl.DataFrame([{"verify_len": r.verify_len, "context_len": r.context_len, "step_s": r.step_s,
                           "propose_s": r.propose_s} for r in recs])
    fitted = CostModel.fit_steps(frame)
    assert fitted.step_ms(4, 1000) == pytest.approx(199.0)
    proposal = ProposalCost.fit([1000, 2000, 3000], [0.1, 0.2, 0.3])
    assert proposal.ms(4000) == pytest.approx(0.4)
    model = fitted.with_proposal(proposal)
    expected = sum(199.0 + 0.1 * (r.context_len + 1) / 1000 for r in recs) / 1e3
    assert model.decode_seconds(recs) == pytest.approx(expected)
    assert model.decode_seconds(recs, propose_ms=0.0) == pytest.approx(20 * 0.199)
    assert model.decode_tok_s(recs) == pytest.approx(60 / expected)
    assert model.baseline_seconds(100, 3) == pytest.approx(2 * 0.199)
    assert "ms" in model.describe()


def test_held_out_predictions_of_the_committed_live_runs():
    """For each configuration of the committed core benchmark (0.5B, CPU, labd 512 tokens and chat 128), fit the
    step model on the other configurations' steps and predict this one's decode rate. Pooled per suite, the
    predictions are within 15% everywhere and within 10% for all but one pair (whose run drifted: its steps of
    the same shape took ~25% longer than its neighbours'); per run, the median error is under 10%."""
    steps = results.load("core", "cpu", "steps").filter(pl.col("config") != "hf-pld:k=10")
    pred = holdout_predictions(steps)
    assert pred.height == 70 and pred["predicted_s"].is_finite().all()
    assert pred["tok_s_error"].abs().median() < 0.10
    suites = suite_errors(pred)
    assert suites.height == 10
    errors = suites["tok_s_error"].abs()
    assert errors.max() < 0.15 and int((errors < 0.10).sum()) >= 9


def test_h200_step_cost_fits_with_the_decode_to_verify_jump():
    """The committed H200 measurements (CUDA graphs, batch 1, 2k context) follow the model within a few
    percent, and going from decoding one token to verifying several costs a visible jump on every model."""
    frame = results.load("step_cost", "h200").filter(
        (pl.col("mode") == "graph") & (pl.col("batch") == 1))
    for model_name in frame["model"].unique().to_list():
        rows = frame.filter(pl.col("model") == model_name)
        model = CostModel.fit_points(rows["verify_len"].to_numpy(), rows["context_len"].to_numpy(),
                                     rows["step_ms"].to_numpy())
        pred = model.step_ms(rows["verify_len"].to_numpy(), rows["context_len"].to_numpy())
        rel = np.abs(pred / rows["step_ms"].to_numpy() - 1)
        assert np.median(rel) < 0.03, model_name
        assert model.coef["verify_jump"] > 0, model_name


def test_incomplete_grid_is_refused():
    grid = pl.DataFrame({"context_len": [100, 100, 1100], "verify_len": [1, 4, 1], "step_ms": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="complete"):
        CostModel.fit(grid)


@pytest.mark.slow
def test_measure_step_times_times_the_engine_step(engine_05b):
    import torch

    from hqlab.replay.costmodel import measure_step_times

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the code path is under test, not the speed; one thread stays fast on a busy machine
    try:
        grid = measure_step_times(engine_05b, [32, 96], [1, 4], repeats=2, progress=False)
        again = measure_step_times(engine_05b, [32], [2], repeats=1, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert grid.height == 4 and (grid["samples"] == 2).all() and (grid["step_ms"] > 0).all()
    measure = CostModel.fit(grid)
    assert np.isfinite(measure.step_ms(8, 500)) and measure.coef["fixed"] > 0
    assert again.height == 1 and again["step_ms"][0] > 0


def test_cost_model_interpolates_both_axes():
    frame = pl.DataFrame({"context_len": [100, 100, 1100, 1100], "verify_len": [1, 11, 1, 11],
                          "step_ms": [10.0, 20.0, 30.0, 60.0]})
    cm = CostModel.fit(frame)
    assert cm.step_ms(1, 100) == pytest.approx(10.0)
    assert cm.step_ms(6, 100) == pytest.approx(15.0)
    assert cm.step_ms(1, 600) == pytest.approx(20.0)
    assert cm.step_ms(6, 600) == pytest.approx((15.0 + 45.0) / 2)
    recs = [StepRecord("r", 0, 100, 11, [1] * 10, [1] * 10, 6, 10, 11, 0.0, 0.002, 0.0)]
    assert cm.decode_seconds(recs) == pytest.approx(0.022)
    assert cm.decode_tok_s(recs) == pytest.approx(11 / 0.022)
    with pytest.raises(ValueError, match="complete"):
        CostModel.fit(frame.head(3))


def test_a_host_level_is_priced_instead_of_the_context_and_is_needed_to_predict():
    """Steps that follow the host's speed (ms of the speculator's host time), with a few slowed further."""
    rng = np.random.default_rng(3)
    v = rng.choice([16, 32], 2000)
    c = rng.integers(100, 3000, 2000)
    host = rng.choice([0.04, 0.08], 2000) * rng.uniform(0.95, 1.05, 2000)  # the host's two speeds
    y = 0.6 + 38.0 * host + 0.004 * (v - 1) + rng.normal(0, 0.05, v.size)
    y[rng.random(v.size) < 0.05] *= 1.8
    model = CostModel.fit_points(v, c, y, host_ms=host)
    assert model.coef["per_host_ms"] == pytest.approx(38.0, rel=0.03)
    assert model.coef["fixed"] == pytest.approx(0.6, abs=0.1)
    assert model.coef["per_1k_context"] == 0.0 and model.coef["per_position_1k_context"] == 0.0
    assert model.step_ms(32, 500, 0.08) == pytest.approx(0.6 + 38 * 0.08 + 0.004 * 31, rel=0.03)
    with pytest.raises(ValueError, match="pass host_ms"):
        model.step_ms(32, 500)
    with pytest.raises(ValueError, match="one positive, finite host level per step"):
        CostModel.fit_points(v, c, y, host_ms=host[:10])
    assert CostModel.fit_points(v, c, y).coef["per_host_ms"] == 0.0  # without a level: the old form
    assert np.isfinite(CostModel.fit_points(v, c, y).step_ms(32, 500))


def test_host_levels_are_each_requests_median_speculator_time_and_none_has_none():
    steps = results.load("vllm_gpu", "s", "steps").filter(pl.col("load") == "alone")
    lookups = steps.filter(pl.col("config").str.starts_with("gpu-lookup"))
    levels = lookups.with_columns(host_levels(lookups))
    one = levels.filter((pl.col("config") == lookups["config"][0]) & (pl.col("request") == "copy"))
    assert one["host_ms"].unique().to_list() == [pytest.approx(1e3 * one["propose_s"].median())]
    with pytest.raises(ValueError, match=r"\['none'\]: their host level is not measured"):
        host_levels(steps.filter(pl.col("config").is_in(["none", lookups["config"][0]])))

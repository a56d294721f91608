"""Sweeps: grids of specs, the fast and step-by-step paths agree, categories pool, and the sweep command."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results
from hqlab.config import ConfigError
from hqlab.replay.sweep import by_category, grid, parse_grid, rows_of, sweep
from hqlab.replay.traces import Trace

(TRACES,) = results.trace_files(["0.5b_all_128"])


def test_grid_skips_invalid_and_sweep_pools_categories():
    specs = grid("lookup", nmin=[2, 6], nmax=[4, 8], k=[5])
    assert specs == ["lookup:nmin=2,nmax=4,k=5", "lookup:nmin=2,nmax=8,k=5", "lookup:nmin=6,nmax=8,k=5"]
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 50, 200).tolist()
    traces = [Trace("a", "copy", doc, doc[:30], 30), Trace("b", "copy", doc, doc[50:70], 20),
              Trace("c", "chat", doc, rng.integers(50, 99, 25).tolist(), 25)]
    frame = sweep(traces, specs, progress=False)
    assert frame.height == len(specs) * len(traces)
    pooled = by_category(frame).filter(pl.col("config") == specs[0])
    copy = pooled.filter(pl.col("category") == "copy").row(0, named=True)
    assert copy["tokens_per_step"] == pytest.approx((29 + 19) / copy["steps"])
    chat = pooled.filter(pl.col("category") == "chat").row(0, named=True)
    assert chat["tokens_per_step"] == pytest.approx(1.0)  # tokens never seen before: nothing to accept


def test_rows_of_finds_a_spec_in_a_sweep_however_it_is_spelled_and_refuses_one_it_lacks():
    committed = results.load("suffix_lengths", "cpu", "sweep")  # the suffix_lengths notebook's grid
    rows = rows_of(committed, ["lookup:nmin=6,nmax=12,k=15", "lookup:k=8,nmax=12,nmin=2"])
    point = committed.filter(pl.col("config") == "lookup:nmin=6,nmax=12,k=15,policy=recent")
    assert point.height == committed["prompt_id"].n_unique() > 0
    mine = rows.filter(pl.col("config") == "lookup:nmin=6,nmax=12,k=15")
    assert mine.drop("config").equals(point.drop("config"))  # the grid's rows, labelled as asked
    assert rows.filter(pl.col("config") == "lookup:k=8,nmax=12,nmin=2")["p_k"].unique().to_list() == ["8"]
    assert rows.height == 2 * point.height
    with pytest.raises(ConfigError, match="nmin=5.*not a point of this sweep"):
        rows_of(committed, ["lookup:nmin=5,nmax=12,k=15"])  # nmin 5 is not in the grid: no neighbour stands in
    with pytest.raises(ConfigError, match="earliest.*not a point"):
        rows_of(committed.filter(pl.col("p_policy") == "recent"), ["lookup:nmin=6,nmax=12,k=15,policy=earliest"])


def test_sweep_fast_path_equals_the_step_by_step_path(real_traces):
    from hqlab.replay.costmodel import CostModel

    cost = CostModel.fit(pl.DataFrame({"context_len": [100, 100, 100, 2000, 2000, 2000], "verify_len": [1, 4, 16] * 2,
                                       "step_ms": [10.0, 11.0, 13.0, 12.0, 14.0, 19.0]}))
    specs = ["lookup:nmin=2,nmax=8,k=8", "pld:n=3,k=10"]
    fast = sweep(real_traces, specs, cost=cost, progress=False, time_proposals=False)
    slow = sweep(real_traces, specs, cost=cost, progress=False, time_proposals=False, fast=False)
    assert set(fast["replay"]) == {"fast"} and set(slow["replay"]) == {"step"}
    exact = ["config", "prompt_id", "steps", "accepted"]
    assert fast.select(exact).rows() == slow.select(exact).rows()
    for col in ["tokens_per_step", "pred_decode_s", "pred_base_s"]:  # sums in another order: rounding only
        np.testing.assert_allclose(fast[col].to_numpy(), slow[col].to_numpy(), rtol=1e-12)


def test_parse_grid_expands_any_keys_and_names_bad_ones():
    from hqlab.config import ConfigError

    assert parse_grid("lookup:nmin=1|6,nmax=4|8,k=15") == ["lookup:nmin=1,nmax=4,k=15", "lookup:nmin=1,nmax=8,k=15",
                                                          "lookup:nmin=6,nmax=8,k=15"]
    assert parse_grid("pld") == ["pld"]
    with pytest.raises(ConfigError, match="nmin must be <= nmax"):
        parse_grid("lookup:nmin=9,nmax=2|3")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_grid("lookup:depth=1|2")
    with pytest.raises(ConfigError, match="empty value"):
        parse_grid("lookup:nmin=1||2")


def test_sweep_command_on_a_saved_trace_set(tmp_path, capsys):
    from hqlab.cli import main

    out = tmp_path / "sweep.parquet"
    assert main(["sweep", "--traces", str(TRACES), "--grid", "lookup:nmin=1|2,nmax=8,k=8|15", "--proposer",
                 "pld:n=3,k=10", "--out", str(out)]) == 0
    frame = pl.read_parquet(out)
    assert frame.height == 5 * 14 and set(frame["replay"]) == {"fast"}
    assert main(["sweep", "--traces", str(tmp_path / "missing.parquet"), "--grid", "pld", "--out", str(out)]) == 2
    assert main(["sweep", "--traces", str(TRACES), "--grid", "lookup:nmin=9,nmax=2", "--out", str(out)]) == 2
    assert "nmin must be <= nmax" in capsys.readouterr().err

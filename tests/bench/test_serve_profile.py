"""`hqlab.bench.serve_profile`'s tables: a served step's cost ratio from load rows, the profiled repeats' check, the
figure's bars from timer rows that the real `StepTimer` wrote (on the CPU: host times, no GPU spans), and what the
goodput servers of run s8a chose and priced beside what their steps cost (the online one not as its prior alone
would). The route from a server to these rows is tests/engines/vllm/test_vllm_serve_profile.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import polars as pl
import pytest

from hqlab.bench import results, serve_profile
from hqlab.bench.serve import LoadPoint
from hqlab.config import ConfigError
from hqlab.engines.vllm.worker import StepTimer


def _rows() -> pl.DataFrame:
    """Two repeats at one request: none at 2.5 ms a token; the lookup at 2.0 ms a token and 1.7 tokens a step
    (3.4 ms a step); a third, profiled repeat slower for both."""
    rows = []
    for repeat, (plain, spec, profiled) in enumerate([(2.5, 2.0, False), (2.4, 2.1, False), (3.0, 3.0, True)]):
        for config, tpot, tokens in (("none", plain, float("nan")), ("gpu-lookup:k=15", spec, 1.7)):
            rows.append({"run": "p9", "config": config, "dataset": "chat", "temperature": 0.7, "max_concurrency": 1,
                         "median_tpot_ms": tpot, "acceptance_length": tokens, "repeat": repeat,
                         "profiled": profiled})
    return pl.DataFrame(rows)


def test_a_served_step_costs_tpot_times_tokens_a_step_over_none_s_same_repeat():
    table = serve_profile.step_cost_ratios(_rows())
    lookup = table.filter(pl.col("config") != "none").row(0, named=True)
    ratios = [2.0 * 1.7 / 2.5, 2.1 * 1.7 / 2.4]  # the profiled repeat is left out
    assert lookup["repeats"] == 2 and lookup["ratio"] == pytest.approx(sum(ratios) / 2)
    assert lookup["ratio_min"] == pytest.approx(min(ratios)) and lookup["ratio_max"] == pytest.approx(max(ratios))
    assert table.filter(pl.col("config") == "none")["ratio"][0] == pytest.approx(1.0)


def test_the_served_goodput_servers_went_wide_at_prices_far_below_what_their_steps_cost():
    """Run s8a (H100, sampled chat): at 16 requests and more the online server fixed a width above 0 on ≥ 99 % of its
    calls, the fixed-price one on 83-86 %. Their tables priced the wide step at 32 requests 1.18× (the grid, the
    online server's prior) and 1.43× (the file) a plain one; their served steps cost 2.34× and 2.15×."""
    table = serve_profile.goodput_served_costs(results.load("serve", "s8a", "goodput_decisions"),
                                               results.load("serve", "s8a"))
    online, fixed = "gpu-lookup 1:15/4:7/0 goodput=online", "gpu-lookup 1:15/4:7/0 goodput=served_x2.4"
    at = {(r["label"], r["lo"]): r for r in table.iter_rows(named=True)}
    assert dict(table.select("label", "prices").unique().rows()) == {online: "prior only", fixed: "fixed"}
    assert [(at[online, lo]["load"], at[online, lo]["in_bucket"]) for lo in (1, 2, 4, 8, 16, 32)] == \
        [(8, False)] * 3 + [(8, True), (32, False), (32, True)]
    assert at[online, 16]["wide"] >= 0.99 and at[online, 32]["wide"] >= 0.99
    assert 0.83 <= at[fixed, 16]["wide"] <= at[fixed, 32]["wide"] <= 0.87
    assert at[online, 32]["priced_x"] == pytest.approx(1.18, abs=0.01)
    assert at[fixed, 32]["priced_x"] == pytest.approx(1.43, abs=0.01)
    assert at[online, 32]["measured"] == pytest.approx(2.34, abs=0.01)
    assert at[fixed, 32]["measured"] == pytest.approx(2.15, abs=0.01)
    assert (at[online, 8]["measured"], at[fixed, 8]["measured"]) == (pytest.approx(1.61, abs=0.01),
                                                                    pytest.approx(1.59, abs=0.01))
    assert all(r["measured"] > 1.1 * r["priced_x"] for r in table.filter(pl.col("in_bucket")).iter_rows(named=True))
    shares, steps = serve_profile.goodput_served_bars(table)
    assert shares.columns == ["server", "batches", "width 0", "width 7", "width 15"] and shares.height == 12
    assert shares.filter(pl.col("batches") == "32-63")["width 7"].to_list() == [at[online, 32]["chose_7"], 0.0]
    assert steps.select("load", "series").rows()[:4] == [
        ("8 in flight", f"{online}: priced (prior only)"), ("32 in flight", f"{online}: priced (prior only)"),
        ("8 in flight", f"{online}: measured"), ("32 in flight", f"{online}: measured")]
    assert round(sum(r["chose_7"] * r["decisions"] for r in table.filter(pl.col("label") == online)
                     .iter_rows(named=True))) == 7977
    last = steps.row(-1, named=True)
    assert (last["ratio"], last["lo"], last["hi"]) == (at[fixed, 32]["measured"], at[fixed, 32]["measured_min"],
                                                       at[fixed, 32]["measured_max"])
    rows = results.load("serve", "s8a")
    with pytest.raises(ConfigError, match=r"2 \(dataset, temperature\) pairs"):
        serve_profile.goodput_served_costs(results.load("serve", "s8a", "goodput_decisions"), pl.concat(
            [rows, rows.with_columns(pl.lit("prose").alias("dataset"))]))


def test_a_profiled_repeat_a_point_does_not_run_is_refused():
    point = LoadPoint("chat", 0.7, 1, 12)
    serve_profile.check_repeats([0, 2], point, 3)
    with pytest.raises(ConfigError, match="repeats 0 to 1"):
        serve_profile.check_repeats([2], point, 2)


class _Runner:
    """The V2 runner's calls of a decode step (vLLM's runner needs a GPU), for the real timer to wrap."""

    def __init__(self, propose_s: float) -> None:
        self.speculator = self if propose_s else None
        self.propose_s = propose_s

    def execute_model(self, scheduler_output: object) -> None:
        time.sleep(0.001)

    def sample(self, hidden: object) -> None:
        time.sleep(0.0005)

    def propose(self, batch: object) -> None:
        time.sleep(self.propose_s)

    def sample_tokens(self, grammar_output: object) -> None:
        self.sample(None)
        if self.speculator is not None:
            self.propose(None)


def _phases() -> pl.DataFrame:
    rows = []
    for config, propose_s in (("none", 0.0), ("gpu-lookup:nmin=1,nmax=32,k=15,batch_k=1:15/4:7/0", 0.002)):
        runner = _Runner(propose_s)
        timer = StepTimer(runner)
        for _ in range(4):  # one request decoding, as vLLM's SchedulerOutput says it (the fields step_facts reads)
            runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=16, num_scheduled_tokens={"a": 16},
                                                 scheduled_new_reqs=[], finished_req_ids=set()))
            runner.sample_tokens(None)
        rows += [{**r, "run": "p9", "config": config, "dataset": "chat", "temperature": 0.7, "max_concurrency": 1,
                  "repeat": 0} for r in timer.stop()]
        assert "execute_model" not in vars(runner)  # stop removed the wrappers
    return pl.DataFrame(rows)


def test_the_figure_s_bars_split_each_step_on_the_host_and_on_the_gpu():
    phases = _phases()
    assert phases.filter(pl.col("phase") == "sample")["gpu_ms"].is_null().all()  # no CUDA: no spans
    parts = serve_profile.served_parts(phases)
    assert set(parts["timeline"]) == {"host", "GPU"} and parts["steps"].unique().to_list() == [3]
    spec = parts.filter(pl.col("label") != "none")
    assert spec.filter(pl.col("part") == "speculator (host)")["extra_ms"][0] >= 2.0
    bars = serve_profile.part_bars(parts)
    assert bars.height == 4  # (none, lookup) x (host, GPU) at the one load
    host = bars.filter(pl.col("bar").str.ends_with("host"))
    assert host["bookkeeping (host)"].is_not_null().all() and host["forward (GPU)"].is_null().all()


def test_the_served_online_goodput_server_did_not_decide_with_its_prior_alone():
    """Its record holds only the prior it started from; the rule priced by that prior, deciding again at every
    recorded call from the recorded cells and outcomes, fixes 15 on every one, where the server fixed 7 on 7,977 of
    them: its prices moved with the steps it timed (docs/goodput.md, s8a)."""
    from hqlab.replay.goodput_served import rerun_rule, served_records

    [(_, header, frame)] = [r for r in served_records(results.load("serve", "s8a", "goodput_decisions"))
                            if r[0].endswith("goodput=online")]
    prior = rerun_rule(frame, {**header, "online": False})
    assert prior.decisions == 12218 and dict(prior.widths) == {15: 12218}
    assert prior.width_mismatches == 7977 + 13  # the calls the server fixed 7 or 0 on


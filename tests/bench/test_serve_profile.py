"""`hqlab.bench.serve_profile`'s tables: a served step's cost ratio from load rows, the profiled repeats' check, and
the figure's bars from timer rows that the real `StepTimer` wrote (on the CPU: host times, no GPU spans). The
route from a server to these rows is tests/engines/vllm/test_vllm_serve_profile.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import polars as pl
import pytest

from hqlab.bench import serve_profile
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

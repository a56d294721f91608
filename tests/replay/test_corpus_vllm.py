"""Corpus settings replayed over a committed vLLM corpus run's recorded outputs and priced with its clocks
(hqlab.replay.corpus_vllm): the prices are the run's pooled step times, the closed-loop replay reproduces the run's
tokens per step, the run's own setting is projected near what it measured, and the reuse analysis agrees with the
replay. What the committed sweep over those outputs gave is stated in data/results/corpus_sweep_replay/c1/claims.json.
No GPU."""

from __future__ import annotations

import polars as pl
import pytest

from hqlab.bench import results
from hqlab.config import ConfigError
from hqlab.replay import corpus as rc
from hqlab.replay import corpus_vllm as cv

C1 = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=32768,corpus_policy=longest,corpus_prompts=1"
WORKLOADS = ("multiturn", "template", "agent", "prose")


@pytest.fixture(scope="module")
def requests() -> pl.DataFrame:
    return results.load("corpus", "c1", "requests")


@pytest.fixture(scope="module")
def prices(requests) -> cv.StepPrices:
    return cv.fit_prices(requests, step_grid=results.load("seed_scale", "s2", "grid"))


def test_prices_are_the_runs_pooled_step_times(requests, prices):
    ones = requests.filter(pl.col("load") == 1)
    look = ones.filter((pl.col("config") != "none") & ~pl.col("config").str.contains("corpus="))
    a = float((look["t_last"] - look["ttft_s"]).sum()) * 1000 / float(look["step_emitted"].list.len().sum())
    none = ones.filter(pl.col("config") == "none")
    n = float((none["t_last"] - none["ttft_s"]).sum()) * 1000 / float((none["output_ids"].list.len() - 1).sum())
    assert prices.iteration_ms[1] == pytest.approx(a)
    assert prices.none_ms[1] == pytest.approx(n)
    assert 1.8 < n < prices.iteration_ms[1] < 2.6  # a 16-wide verify costs more than a plain step, not much more
    assert prices.iteration_ms[8] > prices.iteration_ms[1]  # 8 requests an iteration
    assert 0 < prices.live_ms_per_1k < 0.2  # the corpus search: a few percent of a step over a few 1k tokens
    assert prices.k == 15 and prices.width_factor(1, 15) == 1.0
    assert prices.width_factor(1, 31) == pytest.approx(prices.widths[1][32])
    with pytest.raises(ConfigError):
        cv.StepPrices(k=15, iteration_ms={1: 2.0}, none_ms={1: 1.8}, live_ms_per_1k=0.0).ms(1, 31)
    # the committed grids of several runs (other contexts, other hosts): mixing them is refused
    with pytest.raises(ConfigError, match="several runs"):
        cv.fit_prices(requests, step_grid=results.load("seed_scale", kind="grid", card="h100"))


def test_spec_round_trip_and_the_speculator_accepts_it():
    config = rc.parse(cv.replay_spec(C1))
    assert (config.nmin, config.nmax, config.k, config.tie, config.tokens, config.choice, config.prompts) == \
        (1, 32, 15, "earliest", 32768, "longest", True)
    assert cv.gpu_spec(config) == C1
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    got = lookup_config(cv.gpu_spec(rc.parse("corpus:nmin=2,nmax=16,k=31,tie=recent,tokens=4096,choice=own")))
    assert (got.nmin, got.nmax, got.k, got.policy, got.corpus, got.corpus_policy, got.corpus_prompts) == \
        (2, 16, 31, "recent", 4096, "own", False)
    with pytest.raises(ConfigError):
        cv.replay_spec("gpu-lookup:k=15,batch_k=4:15/0")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_closed_loop_replay_reproduces_the_runs_tokens_per_step(requests, prices, workload):
    """Load 1 exactly (the replay is exact there); 8 in flight, where the replay's lockstep only approximates when
    each document entered the corpus, within 1.5 %."""
    measured = results.load("corpus", "c1").filter((pl.col("config") == C1) & (pl.col("workload") == workload)
                                                  & (pl.col("repeat") == 0))
    config = rc.parse(cv.replay_spec(C1))
    for load in (1, 8):
        traces = cv.point_traces(requests, workload=workload, load=load)
        got = cv.project(traces, rc.CorpusReplayConfig(**{**config.__dict__, "inflight": load}), prices)
        want = measured.filter(pl.col("load") == load)["tokens_per_step"][0]
        assert got.tokens_per_step == pytest.approx(want, rel=1e-9 if load == 1 else 0.015), (workload, load)


def test_the_runs_own_setting_is_projected_near_what_it_measured(requests, prices):
    """The calibration docs/corpus.md quotes: one request at a time within 0.11 of the measured ratio (template
    is projected highest above it), and the sweep's rows carry both ratios."""
    pts = {(w, 1): cv.point_traces(requests, workload=w, load=1) for w in WORKLOADS}
    frame = cv.sweep(pts, [cv.replay_spec(C1)], prices)
    from hqlab.bench import corpus_report

    measured = corpus_report.speedups(results.load("corpus", "c1"))
    both = frame.join(measured.select("workload", "load", pl.col("vs_no_corpus").alias("measured")),
                      on=["workload", "load"])
    assert both.height == 4
    for row in both.iter_rows(named=True):
        assert abs(row["vs_no_corpus"] - row["measured"]) < 0.11, row
        assert row["vs_none"] > row["base_vs_none"] * 0.97  # the corpus never costs more than 3 % of the lookup
    assert set(frame["gpu_spec"]) == {C1}


def test_the_oracle_walk_of_own_history_is_the_plain_lookup(requests, prices):
    """Walking `reuse_by_position`'s own-history acceptances step by step is the plain lookup's replay; the better
    of both sources bounds the run's corpus setting's tokens per step from above."""
    traces = cv.point_traces(requests, workload="multiturn", load=1)
    pos = cv.reuse_by_position(traces)
    plain = cv.project(traces, rc.parse("corpus:nmin=1,nmax=32,k=15,tie=earliest,tokens=0"), prices)
    corpus = cv.project(traces, rc.parse(cv.replay_spec(C1)), prices)
    assert cv.oracle_tokens_per_step(pos, "own_accepted") == pytest.approx(plain.tokens_per_step, rel=1e-9)
    best = cv.oracle_tokens_per_step(pos)
    assert corpus.tokens_per_step <= best + 1e-9
    assert best < 1.15 * plain.tokens_per_step  # why multiturn gains little at one request (docs/corpus.md)


def test_closed_loop_and_meets_on_small_cases():
    assert cv.closed_loop_iterations([3, 3, 3], 2) == 4
    assert cv.closed_loop_iterations([5], 8) == 4
    frame = pl.DataFrame({"spec": ["corpus:a,inflight=1,schedule=admit", "corpus:a,inflight=8,schedule=lockstep",
                                   "corpus:b,inflight=1,schedule=admit", "corpus:b,inflight=8,schedule=lockstep"],
                          "workload": ["w"] * 4, "load": [1, 8, 1, 8], "vs_no_corpus": [1.4, 1.31, 1.5, 1.2],
                          "gpu_spec": ["A", "A", "B", "B"]})
    got = cv.meets(frame, {"w": 1.3})
    assert got["setting"].to_list() == ["corpus:a", "corpus:b"]
    assert got["meets_all"].to_list() == [True, False]
    assert got["worst_margin"].to_list() == pytest.approx([0.01, -0.1])

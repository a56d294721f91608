"""Corpus settings replayed over vLLM run c1's recorded outputs and priced with its clocks (hqlab.replay.corpus_vllm),
on the committed run: the prices are the run's pooled step times, the closed-loop replay reproduces the run's tokens
per step, the run's own setting is projected near what it measured, and the reuse analysis agrees with the replay.
No GPU."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from hqlab.config import ConfigError
from hqlab.replay import corpus as rc
from hqlab.replay import corpus_vllm as cv

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = ROOT / "data" / "results" / "vllm_corpus_h200.requests.parquet"
POINTS = ROOT / "data" / "results" / "vllm_corpus_h200.parquet"
GRID = ROOT / "data" / "results" / "seed_scale_h100.parquet"
C1 = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=32768,corpus_policy=longest,corpus_prompts=1"
WORKLOADS = ("multiturn", "template", "agent", "prose")


@pytest.fixture(scope="module")
def requests() -> pl.DataFrame:
    return pl.read_parquet(REQUESTS).filter(pl.col("run") == "c1")


@pytest.fixture(scope="module")
def prices(requests) -> cv.StepPrices:
    return cv.fit_prices(requests, step_grid=pl.read_parquet(GRID).filter(pl.col("run") == "s2"))


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
    # the committed grid file holds runs s2 and v1 (other contexts, another host): mixing them is refused
    with pytest.raises(ConfigError, match="several runs"):
        cv.fit_prices(requests, step_grid=pl.read_parquet(GRID))


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
    measured = pl.read_parquet(POINTS).filter((pl.col("run") == "c1") & (pl.col("config") == C1)
                                              & (pl.col("workload") == workload) & (pl.col("repeat") == 0))
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

    measured = corpus_report.speedups(pl.read_parquet(POINTS).filter(pl.col("run") == "c1"))
    both = frame.join(measured.select("workload", "load", pl.col("vs_no_corpus").alias("measured")),
                      on=["workload", "load"])
    assert both.height == 4
    for row in both.iter_rows(named=True):
        assert abs(row["vs_no_corpus"] - row["measured"]) < 0.11, row
        assert row["vs_none"] > row["base_vs_none"] * 0.97  # the corpus never costs more than 3 % of the lookup
    assert set(frame["gpu_spec"]) == {C1}


def test_the_oracle_walk_of_own_history_is_the_plain_lookup(requests, prices):
    """Walking `reuse_by_position`'s own-history acceptances step by step is the plain lookup's replay; the better
    of both sources bounds the c1 setting's tokens per step from above."""
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


def test_the_committed_sweep_says_what_docs_corpus_md_says():
    """data/results/corpus_sweep_replay.parquet (benchmarks/corpus_sweep_replay.py): 648 GPU settings, none projected
    to reach 1.3x on multi-turn at either load; the template at 8 in flight at most 1.30-1.31x; prose never below
    0.97x among the settings with the best worst margin."""
    from hqlab.bench import corpus_report

    frame = pl.read_parquet(ROOT / "data" / "results" / "corpus_sweep_replay.parquet")
    swept = frame.filter(pl.col("kind") == "sweep")
    assert swept["gpu_spec"].n_unique() == 648
    assert swept.filter(pl.col("workload").is_in(["multiturn", "multiturn16"]))["vs_no_corpus"].max() < 1.2
    assert 1.29 < swept.filter((pl.col("workload") == "template") & (pl.col("load") == 8))["vs_no_corpus"].max() < 1.31
    ranking = cv.meets(swept, corpus_report.BAR)
    assert not ranking["meets_all"].any()
    assert ranking.head(4)["prose_1"].min() >= 0.97 and ranking.head(4)["prose_8"].min() >= 0.97
    assert ranking["gpu_spec"][0].startswith("gpu-lookup:nmin=1,") and ",k=31," in ranking["gpu_spec"][0]
    calibration = frame.filter(pl.col("kind") == "calibration")
    assert calibration.height == 8 and calibration["measured"].null_count() == 0

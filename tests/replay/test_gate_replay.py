"""The gate's replay (`hqlab.replay.gate`): without a gate it is the lab's replay of the lookup, step for step; with
one it closes steps only where the rule says, and its pricing is the arithmetic of two step costs."""

from __future__ import annotations


import numpy as np
import polars as pl
import pytest

from hqlab.bench import results
from hqlab.config import ConfigError, LookupConfig
from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.replay.gate import by_cost_ratio, price, replay_gated, sweep
from hqlab.replay.traces import load_traces
from hqlab.rules.gate import GateConfig, SuffixGate

LOOKUP = LookupConfig(nmin=1, nmax=32, k=15, policy="earliest")


@pytest.fixture(scope="module")
def traces():
    return load_traces(results.trace_files(["0.5b_all_128"])[0])


def test_ungated_is_the_labs_lookup_replay_step_for_step(traces):
    proposer = make_proposer("lookup:nmin=1,nmax=32,k=15,policy=earliest")
    for trace in traces:
        steps = replay_gated(trace, LOOKUP, None)
        records = replay(trace.prompt_ids, trace.output_ids, proposer, max_new_tokens=trace.max_new_tokens)
        assert steps.emitted[0] == 1 and steps.width[0] == 0  # the prefill
        assert list(steps.accepted[1:]) == [r.accepted for r in records], trace.prompt_id
        assert steps.tokens == len(trace.output_ids)


@pytest.mark.parametrize("behind", [1, 3])
def test_a_step_speculates_exactly_when_the_history_behind_it_was_open(traces, behind):
    gate = GateConfig(2, behind=behind)
    for trace in traces:
        s = replay_gated(trace, LOOKUP, gate)
        ends = np.cumsum(s.emitted)  # output tokens known after each step
        for j in range(1, len(s.width)):
            known = j - behind  # before any output is known (known < 0), the prompt alone
            state = SuffixGate(2)
            state.extend(trace.prompt_ids + trace.output_ids[:ends[known] if known >= 0 else 0])
            expected = state.open
            assert (s.width[j] > 0) == expected, (trace.prompt_id, j)
        assert s.tokens == len(trace.output_ids)


def test_price_is_tokens_over_step_time(traces):
    frame = sweep(traces[:3], LOOKUP, [None, 2], workload="w")
    priced = price(frame, plain_ms=2.0, spec_ms=3.0).sort("min_match")
    for row in priced.iter_rows(named=True):
        part = frame.filter(pl.col("min_match") == row["min_match"])
        time = 2.0 * (part["steps"].sum() - part["spec_steps"].sum()) + 3.0 * part["spec_steps"].sum()
        assert row["speedup"] == pytest.approx(part["tokens"].sum() * 2.0 / time, rel=1e-12)
    with pytest.raises(ConfigError, match="step costs must be > 0"):
        price(frame, plain_ms=0.0, spec_ms=3.0)


def test_by_cost_ratio_prices_each_gate_against_the_ungated_lookup_at_each_ratio(traces):
    """Only the ratio of the two step costs matters; a gate closes speculative steps, so its gain over the ungated
    lookup grows with what a speculative step costs."""
    frame = sweep(traces[:6], LOOKUP, [None, 2], workload="w")
    table = by_cost_ratio(frame, [1.0, 1.5]).sort("cost_ratio", "min_match")
    for row in table.iter_rows(named=True):
        same = price(frame, plain_ms=2.0, spec_ms=2.0 * row["cost_ratio"]).filter(
            pl.col("min_match") == row["min_match"])
        assert row["speedup"] == pytest.approx(same["speedup"][0], rel=1e-12)
    assert (table.filter(pl.col("min_match") == 0)["vs_ungated"] == 1.0).all()
    gated = table.filter(pl.col("min_match") == 2)["vs_ungated"].to_list()
    assert gated[0] < gated[1]
    with pytest.raises(ConfigError, match="needs the ungated lookup"):
        by_cost_ratio(frame.filter(pl.col("min_match") == 2), [1.0])

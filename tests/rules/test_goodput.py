"""The goodput rule (`hqlab.rules.goodput`): its features equal the lookup rule on real traces, its estimates are the
empirical acceptance on complete data, and its choice follows the step costs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hqlab.config import ConfigError, LookupConfig
from hqlab.replay.goodput import Policy, replay_engine
from hqlab.replay.traces import load_traces
from hqlab.rules.goodput import (DEFAULT_STEP_COSTS, Calibration, GoodputConfig, GoodputController, MatchLadder,
                                 RequestFeatures, StepCosts, choose_width, step_costs)
from hqlab.rules.lookup import suffix_match

RESULTS = Path(__file__).resolve().parents[2] / "data" / "results"
LOOKUP = LookupConfig(nmin=1, nmax=32, k=15, policy="earliest")
CELL = (1, 0, 0)


@pytest.fixture(scope="module")
def traces():
    picked = load_traces(RESULTS / "traces" / "0.5b_all_128" / "traces.parquet")  # chat and the copying classes
    prose = [t for t in load_traces(RESULTS / "traces" / "0.5b_corpus_128" / "traces.parquet") if t.category == "prose"]
    return picked + prose[:4]


def test_the_ladder_is_the_lookup_rules_match_length_on_every_prefix(traces):
    """Fed token by token over prompt and output, the bucket counts the edges the lookup's match length reaches."""
    edges = GoodputConfig().match_edges
    seen = set()
    for trace in traces[:6]:
        history = np.asarray(trace.prompt_ids + trace.output_ids, dtype=np.int64)
        ladder = MatchLadder(edges)
        start = len(trace.prompt_ids)
        ladder.extend(history[:start])
        for t in range(start, len(history) + 1):
            if t > start:
                ladder.extend(history[t - 1:t])
            length = suffix_match(history[:t], nmin=1, nmax=edges[-1], k=1).match_len
            assert ladder.bucket == sum(e <= length for e in edges), (trace.prompt_id, t)
            seen.add(ladder.bucket)
    assert seen == set(range(len(edges) + 1))  # every bucket occurs: the copy reaches 32, some token is new


def test_on_complete_outcomes_the_estimate_is_the_empirical_mean(traces):
    """Fed every verify step of the lookup at k = 15 on real traces (one cell, a vanishing prior), E(w) is the mean
    of 1 + min(accepted, w): the product of conditional acceptances telescopes to P(accepted >= i)."""
    accepted = []
    for trace in traces:
        run = replay_engine([trace], LOOKUP, Policy.fixed(15), concurrency=1)
        accepted += [e - 1 for e in run.request_emitted[0][1:]]
    calibration = Calibration(GoodputConfig(prior_weight=1e-9), 15)
    for a in accepted:
        calibration.observe(CELL, 15, a)
    a = np.asarray(accepted)
    assert 0 < np.mean(a == 0) < 1 and a.max() == 15
    for w in range(16):
        assert calibration.expected(CELL)[w] == pytest.approx(np.mean(1 + np.minimum(a, w)), rel=1e-7)


def test_observe_counts_each_position_reached_and_accepted():
    calibration = Calibration(GoodputConfig(), 15)
    calibration.observe(CELL, 7, 3)  # positions 1-4 reached, 1-3 accepted
    calibration.observe(CELL, 7, 7)  # all seven reached and accepted
    calibration.observe(CELL, 0, 0)  # a plain step: nothing
    assert calibration.reached[CELL][1:9] == [2, 2, 2, 2, 1, 1, 1, 0]
    assert calibration.hits[CELL][1:9] == [2, 2, 2, 1, 1, 1, 1, 0]
    assert calibration.observed == 2
    with pytest.raises(ConfigError, match="accepted must be in"):
        calibration.observe(CELL, 3, 4)


def test_no_acceptance_and_a_cost_rising_with_width_give_a_plain_step():
    calibration = Calibration(GoodputConfig(), 15)
    for _ in range(200):
        calibration.observe(CELL, 15, 0)
    assert DEFAULT_STEP_COSTS.at(1, 0) < DEFAULT_STEP_COSTS.at(1, 7)
    for batch in (1, 8, 32):
        assert choose_width({CELL: batch}, calibration, (0, 7, 15), DEFAULT_STEP_COSTS) == 0


def test_the_choice_never_narrows_as_acceptance_grows():
    """With one acceptance q at every position (the prior, no outcome yet), the chosen width is a non-decreasing
    function of q at every batch size, from a plain step at q near 0 to the widest at q near 1."""
    for batch in (1, 8, 32):
        chosen = []
        for q in np.linspace(0.01, 0.99, 99):
            calibration = Calibration(GoodputConfig(prior_first=q, prior_next=q), 15)
            chosen.append(choose_width({CELL: batch}, calibration, (0, 3, 7, 15), DEFAULT_STEP_COSTS))
        assert chosen == sorted(chosen), batch
        assert chosen[0] == 0 and chosen[-1] == 15


def test_a_copy_verifies_the_widest_width_where_prose_verifies_none():
    """At one request, with a wide step 1.6x a plain one (the top of the served range, docs/serving.md): four prose
    requests of the 1.5B run mostly plain steps, and the copy task served after them verifies the widest width on
    every step whose width was fixed after its first output was known."""
    dear = StepCosts((1,), (0, 7, 15), ((2.9, 4.5, 4.6),))
    prose = [t for t in load_traces(RESULTS / "traces" / "1.5b_prose_chat_256" / "traces.parquet") if t.category == "prose"][:4]
    copy = next(t for t in load_traces(RESULTS / "traces" / "1.5b_labd_160" / "traces.parquet") if t.category == "copy")
    run = replay_engine(prose + [copy], LOOKUP, Policy.controller((0, 7, 15)), concurrency=1, costs=dear)
    for widths in run.request_widths[:4]:
        assert np.mean(np.asarray(widths[1:]) == 0) > 0.6
    behind = GoodputConfig().behind
    assert len(run.request_widths[4]) > 10 and set(run.request_widths[4][1 + behind:]) == {15}


def test_exploration_verifies_after_a_run_of_plain_steps_and_for_a_cell_never_verified():
    dear = StepCosts((1,), (0, 15), ((1.0, 100.0),))
    controller = GoodputController(GoodputConfig(explore_every=4, explore_new_cells=False), (0, 15), dear)
    assert [controller.decide([CELL]) for _ in range(9)] == [0, 0, 0, 15, 0, 0, 0, 15, 0]
    assert controller.explored == 2
    assert controller.decide([]) == 0 and controller.plain_run == 1  # no requests: no decision, no change
    never = GoodputController(GoodputConfig(explore_every=0, explore_new_cells=False), (0, 15), dear)
    assert {never.decide([CELL]) for _ in range(40)} == {0}
    new = GoodputController(GoodputConfig(explore_every=0), (0, 15), dear)
    assert [new.decide([CELL]) for _ in range(3)] == [15, 15, 15]  # until the cell has an outcome
    new.observe(CELL, 15, 0)
    assert new.decide([CELL]) == 0 and new.decide([CELL, (2, 0, 0)]) == 15


def test_request_features_follow_a_growing_history_and_say_when_it_shrinks():
    config = GoodputConfig(match_edges=(1, 2), accept_edges=(1, 4))
    features = RequestFeatures(config)
    assert features.cell(config, [5, 6, 7]) == (0, 0, 0)
    assert features.cell(config, [5, 6, 7, 5, 6]) == (2, 0, 0)  # "5 6" occurred before
    features.last_accepted = 3
    assert features.cell(config, [5, 6, 7, 5, 6, 9]) == (0, 2, 0)
    with pytest.raises(ValueError, match="history shrank"):
        features.cell(config, [5])
    confident = GoodputConfig(confidence_edges=(0.5,))
    assert confident.cell(1, None, 0.7) == (1, 0, 2) and confident.cell(1, None) == (1, 0, 0)


def test_step_costs_interpolate_extrapolate_and_load(tmp_path):
    costs = StepCosts((1, 8), (0, 7, 15), ((2.0, 3.0, 4.0), (3.0, 5.0, 7.0)), source="made up")
    assert costs.at(8, 7) == 5.0  # a measured point
    assert costs.at(1, 11) == pytest.approx(3.5)  # linear in the width
    assert costs.at(4, 0) == pytest.approx(2.0 + 3 / 7)  # linear in the batch
    assert costs.at(15, 15) == pytest.approx(4.0 + 14 * 3 / 7) and not costs.measured(15)  # extrapolated
    assert StepCosts.from_json(costs.to_json(tmp_path / "c.json")) == costs
    assert step_costs("default") is DEFAULT_STEP_COSTS and step_costs(str(tmp_path / "c.json")) == costs
    with pytest.raises(ConfigError, match="outside the measured widths"):
        costs.at(1, 16)
    with pytest.raises(ConfigError, match="strictly increasing"):
        StepCosts((8, 1), (0,), ((1.0,), (1.0,)))
    with pytest.raises(ConfigError, match="finite and > 0"):
        StepCosts((1,), (0, 7), ((1.0, -1.0),))
    with pytest.raises(ConfigError, match="one row per batch"):
        StepCosts((1, 8), (0, 7), ((1.0, 2.0),))
    (tmp_path / "bad.json").write_text('{"widths": [0]}')
    with pytest.raises(ConfigError, match="missing key"):
        StepCosts.from_json(tmp_path / "bad.json")
    (tmp_path / "notjson.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        step_costs(str(tmp_path / "notjson.json"))


def test_a_bad_config_says_what_to_fix():
    for kwargs, message in [({"match_edges": (4, 2)}, "match_edges"), ({"accept_edges": (0,)}, "accept_edges"),
                            ({"confidence_edges": (1.5,)}, "confidence_edges"), ({"prior_first": 1.0}, "prior_first"),
                            ({"prior_weight": 0}, "prior_weight"), ({"explore_every": -1}, "explore_every"),
                            ({"behind": 0}, "behind")]:
        with pytest.raises(ConfigError, match=message):
            GoodputConfig(**kwargs)
    with pytest.raises(ConfigError, match="must include 0"):
        GoodputController(GoodputConfig(), (7, 15), DEFAULT_STEP_COSTS)
    with pytest.raises(ConfigError, match="wider than the step costs measure"):
        GoodputController(GoodputConfig(), (0, 63), DEFAULT_STEP_COSTS)

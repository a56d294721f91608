"""The goodput replay (`hqlab.replay.goodput`): at one request a fixed width is the lab's lookup replay step for step,
every decision of the controller is the brute-force argmax of its own definition, and on the committed 1.5B traces
the controller is at least as fast as every fixed width at every load, within the committed step costs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results

from hqlab.config import ConfigError, LookupConfig
from hqlab.replay.gate import replay_gated
from hqlab.replay.goodput import (Policy, TraceTables, captured_widths, compare, compare_online, dearer_widths, price,
                                  replay_engine, requests_for, step_costs_from_grid, timed)
from hqlab.replay.traces import load_traces
from hqlab.rules.goodput import DEFAULT_STEP_COSTS, GoodputConfig, StepCosts
from hqlab.rules.online_costs import OnlineCosts

RESULTS = Path(__file__).resolve().parents[2] / "data" / "results"
LOOKUP = LookupConfig(nmin=1, nmax=32, k=15, policy="earliest")
BATCH_K = "1:15/4:7/0"  # the served lookup's widths: 15, 7 and plain steps
# wide steps 1.6x a plain one at one request (the top of the served range, docs/serving.md): every width is chosen
DEAR = StepCosts((1, 8), (0, 7, 15), ((2.9, 3.9, 4.6), (3.1, 4.4, 5.8)), source="a test's")


@pytest.fixture(scope="module")
def workloads():
    chat_prose = load_traces(RESULTS / "traces" / "1.5b_prose_chat_256" / "traces.parquet")
    return {"chat": [t for t in chat_prose if t.category == "chat"],
            "prose": [t for t in chat_prose if t.category == "prose"],
            "labd": load_traces(RESULTS / "traces" / "1.5b_labd_160" / "traces.parquet")}


@pytest.fixture(scope="module")
def tables():
    return TraceTables(LOOKUP)


def test_a_fixed_width_at_one_request_is_the_lookup_replay_step_for_step(workloads, tables):
    for trace in workloads["labd"] + workloads["chat"][:3]:
        run = replay_engine([trace], LOOKUP, Policy.fixed(15), concurrency=1, tables=tables)
        lab = replay_gated(trace, LOOKUP, None)
        assert run.request_emitted[0] == list(lab.emitted), trace.prompt_id
        assert run.request_widths[0] == list(lab.width), trace.prompt_id
        assert run.tokens == len(trace.output_ids)


def brute_force_widths(run, widths, costs, config):
    """Each decision recomputed from its definition: the outcomes seen before it, counted per cell and position,
    the shrunk conditional acceptances, their products, the expected tokens of the step's requests per width over
    the step's cost; the best width (ties to the narrower), or the best other than 0 after `explore_every` plain
    decisions or when a request's cell has no outcome yet."""
    top = max(widths)
    out, plain, used = [], 0, 0
    pool_reached, pool_hits = np.zeros(top + 1), np.zeros(top + 1)
    reached, hits = {}, {}
    for decision in run.decisions:
        seen = [o for o in run.outcomes[used:] if o[0] <= decision.index]  # logged in the order they were seen
        used += len(seen)
        for _, cell, drafted, accepted in seen:
            r, h = reached.setdefault(cell, np.zeros(top + 1)), hits.setdefault(cell, np.zeros(top + 1))
            for i in range(1, drafted + 1):
                if accepted >= i - 1:
                    r[i] += 1
                    pool_reached[i] += 1
                if accepted >= i:
                    h[i] += 1
                    pool_hits[i] += 1
        w = config.prior_weight

        def expected(cell, width):
            total, run_p = 1.0, 1.0
            for i in range(1, width + 1):
                prior = config.prior_first if i == 1 else config.prior_next
                pool = (pool_hits[i] + w * prior) / (pool_reached[i] + w)
                q = pool if cell not in reached else (hits[cell][i] + w * pool) / (reached[cell][i] + w)
                run_p *= q
                total += run_p
            return total

        batch = sum(decision.counts.values())
        rate = {v: sum(n * expected(c, v) for c, n in decision.counts.items()) / costs.at(batch, v) for v in widths}
        best = max(widths, key=lambda v: (rate[v], -v))
        if best == 0:
            plain += 1
            if plain >= config.explore_every or any(c not in reached for c in decision.counts):
                plain, best = 0, max(widths[1:], key=lambda v: (rate[v], -v))
        else:
            plain = 0
        out.append(best)
    return out


@pytest.mark.parametrize("concurrency", [1, 8])
def test_the_replay_is_deterministic_and_each_decision_is_the_brute_force_argmax(workloads, tables, concurrency):
    requests = requests_for(workloads["chat"] + workloads["prose"][:8] + workloads["labd"][:2], 18)
    widths = captured_widths(BATCH_K, 15)
    policy = Policy.controller(widths)
    run = replay_engine(requests, LOOKUP, policy, concurrency=concurrency, costs=DEAR, tables=tables)
    again = replay_engine(requests, LOOKUP, policy, concurrency=concurrency, costs=DEAR, tables=TraceTables(LOOKUP))
    assert (run.width, run.batch, run.request_emitted) == (again.width, again.batch, again.request_emitted)
    assert [d.width for d in run.decisions] == [d.width for d in again.decisions]
    assert [d.width for d in run.decisions] == brute_force_widths(run, widths, DEAR, GoodputConfig())
    assert len({d.width for d in run.decisions}) > 1  # not a constant


def test_price_is_tokens_over_the_summed_cost_of_each_step(workloads, tables):
    run = replay_engine(workloads["chat"], LOOKUP, Policy.fixed(7), concurrency=4, tables=tables)
    priced = price(run, DEAR)
    assert priced["time_ms"] == pytest.approx(sum(DEAR.at(b, w) for b, w in zip(run.batch, run.width)), rel=1e-12)
    assert priced["tok_s"] == pytest.approx(run.tokens / priced["time_ms"] * 1e3, rel=1e-12)
    assert run.tokens == sum(len(t.output_ids) for t in workloads["chat"]) and max(run.batch) == 4
    plain = replay_engine(workloads["chat"], LOOKUP, Policy.none(), concurrency=1, tables=tables)
    assert set(plain.width) == {0} and plain.batch == [1] * len(plain.batch)
    assert len(plain.batch) == run.tokens  # one token a step, and no step scheduled past a request's end


def test_the_controller_is_at_least_as_fast_as_every_fixed_width_at_every_load(workloads, tables):
    """Within the committed step costs (1.5B shape, H100; batches above 8 extrapolated), ten waves of requests at
    1, 8 and 32 in flight: the controller is never slower than the fastest fixed width (none included). Where a
    width's excess over a plain step is doubled (the served range of docs/serving.md) it is faster than every fixed
    width on chat and prose at every load."""
    def controller(costs, names):
        rows = pl.concat([compare(workloads[name], LOOKUP, costs, concurrency=c, batch_k_value=BATCH_K,
                                  workload=name, tables=tables) for name in names for c in (1, 8, 32)])
        return rows.filter(pl.col("policy") == "goodput")

    measured = controller(DEFAULT_STEP_COSTS, ("chat", "prose", "labd"))
    assert measured.height == 9 and (measured["vs_best_fixed"] >= 1.0).all(), measured
    assert (measured["speedup"] > 1.0).all()
    dearer = controller(dearer_widths(DEFAULT_STEP_COSTS, 2.0), ("chat", "prose"))
    assert (dearer["vs_best_fixed"] > 1.0).all(), dearer


def test_dearer_widths_scale_each_widths_excess_over_a_plain_step():
    doubled = dearer_widths(DEAR, 2.0)
    assert dearer_widths(DEAR, 1.0) is DEAR
    for batch in (1, 4, 8):
        assert doubled.at(batch, 0) == pytest.approx(DEAR.at(batch, 0))
        excess = DEAR.at(batch, 15) - DEAR.at(batch, 0)
        assert doubled.at(batch, 15) - doubled.at(batch, 0) == pytest.approx(2 * excess)


def test_the_default_step_costs_are_the_committed_grids(tmp_path):
    grid = results.load("seed_scale", "s2", kind="grid")  # the step-cost grid run that has the 1.5B shape
    built = step_costs_from_grid(grid, "qwen2.5-1.5b")
    assert (built.batches, built.widths) == (DEFAULT_STEP_COSTS.batches, DEFAULT_STEP_COSTS.widths)
    assert np.allclose(built.ms, DEFAULT_STEP_COSTS.ms, rtol=1e-6, atol=0)
    assert "H100" in built.source and "H100" in DEFAULT_STEP_COSTS.source
    tied = pl.concat([grid, grid.with_columns(pl.lit("another").alias("run"))])  # two runs, as many batch sizes
    with pytest.raises(ConfigError, match="filter the grid to one run"):
        step_costs_from_grid(tied, "qwen2.5-1.5b")
    with pytest.raises(ConfigError, match="has no"):
        step_costs_from_grid(grid, "qwen2.5-1.5b", context=3)


def test_the_fused_served_costs_are_the_grid_with_its_width_excess_scaled():
    """data/goodput/fused_served_x3.05.json (the fused spec's costs in docs/goodput.md) is what its source says: the
    grid's costs with each width's excess x3.05, so that a 15-wide step at one request costs 1.46x a plain one."""
    served = StepCosts.from_json(RESULTS.parent / "goodput" / "fused_served_x3.05.json")
    want = dearer_widths(DEFAULT_STEP_COSTS, 3.05)
    assert (served.batches, served.widths) == (want.batches, want.widths)
    assert np.allclose(served.ms, want.ms, atol=5e-5)
    assert round(served.at(1, 15) / served.at(1, 0), 2) == 1.46


def test_online_costs_approach_the_controller_priced_with_the_truth(workloads, tables):
    """The prior is the committed grid, the host's wide steps cost four times its excess (the served range's top):
    priced with the prior the controller verifies 15 wide and falls below `none`; measuring its own steps (5 % noise)
    it comes within 2 % of the controller priced with the truth, on chat and prose at 1, 8 and 32 in flight."""
    truth = dearer_widths(DEFAULT_STEP_COSTS, 4.0)
    for name in ("chat", "prose"):
        for concurrency in (1, 8, 32):
            rows = {r["policy"]: r for r in compare_online(workloads[name], LOOKUP, DEFAULT_STEP_COSTS, truth,
                                                           concurrency=concurrency, batch_k_value=BATCH_K,
                                                           tables=tables).iter_rows(named=True)}
            online, prior = rows["goodput online"], rows["goodput prior"]
            assert online["vs_truth"] >= 0.98 and prior["vs_truth"] < 0.97, (name, concurrency, rows)
            assert online["speedup"] > 1.0 > prior["speedup"], (name, concurrency)
            assert online["gx"] == pytest.approx(4, rel=0.1)


def test_the_exploration_steps_refresh_the_costs_of_wide_steps(workloads, tables):
    """A prior that prices wide steps out (excess x50) on a host where they cost the grid's: priced with it the
    controller verifies on its exploration steps only (one decision in 15); those steps are timed, the costs learn
    that wide steps are cheap, and the online controller verifies on most steps and runs over 10 % faster."""
    prior = dearer_widths(DEFAULT_STEP_COSTS, 50.0)
    requests = workloads["prose"]
    policy = Policy.controller(captured_widths(BATCH_K, 15))
    stuck = replay_engine(requests, LOOKUP, policy, concurrency=1, costs=prior, tables=tables)
    assert 0 < sum(1 for d in stuck.decisions if d.width > 0) < len(stuck.decisions) / 14
    online = replay_engine(requests, LOOKUP, policy, concurrency=1, costs=OnlineCosts(prior), tables=tables,
                           step_ms=timed(DEFAULT_STEP_COSTS))
    first_wide = next(i for i, (w, p) in enumerate(zip(online.width, online.prefills)) if w and not p)
    assert online.width[:first_wide + 1] == stuck.width[:first_wide + 1]  # the same until a wide step was timed
    assert online.costs.scales()[1] < 0.05 and sum(1 for d in online.decisions if d.width > 0) > 0.7 * len(
        online.decisions)
    assert price(online, DEFAULT_STEP_COSTS)["tok_s"] > 1.1 * price(stuck, DEFAULT_STEP_COSTS)["tok_s"]


def test_timed_steps_are_deterministic_within_their_noise_and_prompts_cost_apart():
    step_ms = timed(DEAR, noise=0.05, seed=3)
    values = [step_ms(i, 8, 15, 0) / DEAR.at(8, 15) for i in range(2000)]
    assert values == [timed(DEAR, noise=0.05, seed=3)(i, 8, 15, 0) / DEAR.at(8, 15) for i in range(2000)]
    assert 0.95 <= min(values) < 0.951 and 1.049 < max(values) < 1.05
    assert step_ms(7, 8, 15, 2) == pytest.approx(step_ms(7, 8, 15, 0) + 40.0)
    assert timed(DEAR, seed=4)(7, 8, 15, 0) != step_ms(7, 8, 15, 0)

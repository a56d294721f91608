"""Step costs measured online (`hqlab.rules.online_costs`): which intervals the timer attributes to which step, how
the cells keep them, how the prior's error is carried to widths and batches never measured, what the controller
probes, and the knob's spellings."""

from __future__ import annotations

import pytest

from hqlab.config import ConfigError
from hqlab.rules.goodput import DEFAULT_STEP_COSTS, GoodputConfig, GoodputController, StepCosts
from hqlab.rules.online_costs import OnlineConfig, OnlineCosts, StepTimer, costs_for, micros

CELL = (1, 0, 0)
# a host whose plain steps take 1.3x the grid's and whose wide steps' excess is 4x the grid's
TRUTH = StepCosts(DEFAULT_STEP_COSTS.batches, DEFAULT_STEP_COSTS.widths,
                  tuple(tuple(1.3 * row[0] + 4 * (x - row[0]) for x in row) for row in DEFAULT_STEP_COSTS.ms))


def test_the_timer_attributes_an_interval_to_a_step_queued_behind_the_one_before():
    timer = StepTimer()
    t0, t1 = timer.scheduled(), timer.scheduled()  # the engine core fills its queue of two
    assert timer.processed(t0, 1_000) is None  # the first call: no interval yet
    t2 = timer.scheduled()
    assert timer.processed(t1, 4_000) == 3_000  # step 1 ran right behind step 0
    assert timer.processed(t2, 9_000) == 5_000  # the last before the queue drains: still queued behind step 1
    t3 = timer.scheduled()  # an idle gap: scheduled after step 2 was processed
    assert timer.processed(t3, 900_000) is None
    t4, t5 = timer.scheduled(), timer.scheduled()
    assert timer.processed(t4, 903_000) is None  # scheduled after step 3's call: nothing ran behind step 3
    t6 = timer.scheduled()
    assert timer.processed(None, 904_000) is None  # an output of no tracked step breaks the chain
    assert timer.processed(t5, 907_000) is None
    assert timer.processed(t6, 907_000) is None  # a clock that did not move gives nothing


def test_a_cell_keeps_its_newest_intervals_in_microseconds_and_their_median():
    costs = OnlineCosts(DEFAULT_STEP_COSTS, OnlineConfig(window=4, min_samples=2))
    for ms in (3.0, 3.2, 50.0, 3.1, 3.3):
        assert costs.observe(8, 15, ms, True)
    assert costs.samples[(15, 8)] == [3200, 50000, 3100, 3300] and costs.counts[(15, 8)] == 5
    assert costs.counted() == [(15, 8, 5, 3.2)]  # the lower median: one outlier moves it by one rank
    assert not costs.observe(8, 15, 40.0, False) and costs.prompt_steps == 1 and costs.counts[(15, 8)] == 5
    with pytest.raises(ConfigError, match="finite and > 0"):
        costs.observe(1, 0, 0.0, True)
    with pytest.raises(ConfigError, match="width the prior prices"):
        costs.observe(1, 63, 3.0, True)


def test_unmeasured_the_costs_are_the_prior_and_a_width_counts_once_timed_min_samples_times():
    costs = OnlineCosts(DEFAULT_STEP_COSTS)
    grid = [(b, w) for b in (1, 3, 8, 32) for w in DEFAULT_STEP_COSTS.widths]
    assert all(costs.at(b, w) == pytest.approx(DEFAULT_STEP_COSTS.at(b, w), rel=1e-12) for b, w in grid)
    for batch in (1, 2, 3):  # three batch sizes, one interval each: not yet a measurement
        costs.observe(batch, 15, 2 * DEFAULT_STEP_COSTS.at(batch, 15), True)
    assert costs.counted() == [] and costs.at(1, 15) == pytest.approx(DEFAULT_STEP_COSTS.at(1, 15))
    costs.observe(4, 15, 2 * DEFAULT_STEP_COSTS.at(4, 15), True)
    assert len(costs.counted()) == 4 and costs.at(1, 15) > 1.3 * DEFAULT_STEP_COSTS.at(1, 15)
    assert costs.at(1, 0) == pytest.approx(DEFAULT_STEP_COSTS.at(1, 0))  # plain steps unmeasured: the prior's


def test_timed_steps_bring_every_width_and_batch_to_the_truth_the_error_carried_by_two_scales():
    """Plain and 15-wide steps timed at batches 1 and 8 (no noise): those widths' costs reach the truth at every
    batch (the line), and width 7, never timed, reaches it too, since the truth differs from the prior by a plain
    scale and an excess scale, which is what the rule carries to unmeasured widths."""
    costs = OnlineCosts(DEFAULT_STEP_COSTS)
    for _ in range(200):
        for batch in (1, 8):
            for width in (0, 15):
                costs.observe(batch, width, TRUTH.at(batch, width), True)
    g0, gx = costs.scales()
    assert g0 == pytest.approx(1.3, rel=0.01) and gx == pytest.approx(4, rel=0.01)
    for batch in (1, 4, 8, 16):
        for width in (0, 7, 15):
            assert costs.at(batch, width) == pytest.approx(TRUTH.at(batch, width), rel=0.01), (batch, width)
    table = costs.table()
    assert table.batches == (1, 8) and table.at(8, 7) == pytest.approx(costs.at(8, 7), rel=1e-12)
    assert StepCosts.from_dict(table.to_dict()) == table  # servable with goodput=PATH.json


def test_only_wide_steps_timed_the_error_goes_to_the_excess():
    """A controller that always verifies never times a plain step: the plain part keeps the prior's cost, so a
    wide step timed dearer than the prior says makes verifying look dearer against not verifying."""
    costs = OnlineCosts(DEFAULT_STEP_COSTS)
    for _ in range(100):
        costs.observe(1, 15, TRUTH.at(1, 15), True)
    g0, gx = costs.scales()
    assert g0 == 1.0 and gx > 4  # all of the 1.3x on the plain part read as excess, until plain steps are timed
    assert costs.at(1, 0) == pytest.approx(DEFAULT_STEP_COSTS.at(1, 0))
    assert costs.at(1, 15) == pytest.approx(TRUTH.at(1, 15), rel=0.05)


def test_the_controller_probes_an_untimed_plain_step_every_explore_every_decisions():
    cheap = StepCosts((1,), (0, 15), ((3.0, 3.01),))  # wide steps nearly free: the controller always verifies
    costs = OnlineCosts(cheap, OnlineConfig(min_samples=2))
    controller = GoodputController(GoodputConfig(explore_every=4), (0, 15), costs)
    assert [controller.decide([CELL]) for _ in range(8)] == [15, 15, 15, 0, 15, 15, 15, 0]
    assert controller.probed == 2 and controller.priced == (3.0, 3.01)
    costs.observe(1, 0, 3.0, True)
    costs.observe(1, 0, 3.0, True)  # plain steps timed: nothing more is wanted
    assert costs.wanted((0, 15)) is None and {controller.decide([CELL]) for _ in range(12)} == {15}
    fixed = GoodputController(GoodputConfig(explore_every=4), (0, 15), cheap)
    assert {fixed.decide([CELL]) for _ in range(12)} == {15} and cheap.wanted((0, 15)) is None


def test_the_knob_names_a_fixed_table_or_online_costs_from_a_prior(tmp_path):
    online = costs_for("online")
    assert isinstance(online, OnlineCosts) and online.prior is DEFAULT_STEP_COSTS
    assert costs_for("online") is not online  # one per scheduler: state is never shared
    assert costs_for("online:default").prior is DEFAULT_STEP_COSTS
    path = StepCosts((1,), (0, 15), ((2.0, 4.0),), source="a file").to_json(tmp_path / "prior.json")
    assert costs_for(f"online:{path}").prior == StepCosts.from_json(path)
    assert costs_for("default") is DEFAULT_STEP_COSTS
    with pytest.raises(ConfigError, match="does not exist"):
        costs_for(f"online:{tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="goodput=online"):
        costs_for("online:fast")
    for kwargs, message in [({"window": 0}, "window"), ({"min_samples": 40}, "min_samples"),
                            ({"prior_weight": 0}, "prior_weight"), ({"floor": 0}, "floor")]:
        with pytest.raises(ConfigError, match=message):
            OnlineConfig(**kwargs)


def test_a_step_handed_over_in_microseconds_is_kept_as_its_time_in_ms_is():
    """What a decisions record holds (`micros`) fed back (`observe_us`) is what `observe` kept: an integer µs read
    back as ms rounds to itself, so a record's steps give the same cells."""
    assert all(micros(us / 1000) == us for us in range(1, 400_000, 7))
    assert micros(0.0001) == 1 and micros(3.0004) == 3000 and micros(3.0006) == 3001
    kept, fed = OnlineCosts(DEFAULT_STEP_COSTS), OnlineCosts(DEFAULT_STEP_COSTS)
    for i, ms in enumerate((3.0004, 3.0006, 2.9994, 0.0001, 41.25, 3.1)):
        assert kept.observe(8, 15, ms, i != 4) == fed.observe_us(8, 15, micros(ms), i != 4)
    assert (kept.samples, kept.counts, kept.prompt_steps) == (fed.samples, fed.counts, fed.prompt_steps)
    assert kept.at(8, 15) == fed.at(8, 15)
    with pytest.raises(ConfigError, match=">= 1 us"):
        fed.observe_us(8, 15, 0, True)

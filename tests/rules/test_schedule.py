"""The adaptive long-block scheduler (SPEC §2.5) pinned by tables of step sequences -> block lengths.

A step sequence is a string, one letter per verify step, giving (take_flag, emitted_last_step):
  Q = (True, 8)   qualifies: take flag set and the previous step saturated (8 >= 1 + short 7)
  n = (False, 8)  saturated, but the take flag dropped (e.g. an unmatched line)
  u = (True, 7)   take flag set, previous step one short of saturation (7 < 8)
  W = (True, 16)  qualifies after a fully accepted long block
Expected block lengths are strings too: s = short (7), L = long (15).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab.config import ConfigError
from hqlab.rules.schedule import (
    ScheduleConfig,
    ScheduleState,
    qualify,
    simulate,
    step,
    step_unanimous,
    unanimous_block_len,
)

STEP = {"Q": (True, 8), "n": (False, 8), "u": (True, 7), "W": (True, 16), "0": (False, 0)}
DEFAULT = ScheduleConfig()  # short 7, long 15, sticky 3, entry_steps 2, stale 0, adaptive


def blocks(seq: str, cfg: ScheduleConfig) -> str:
    return "".join("L" if b == cfg.long else "s" for b in simulate([STEP[c] for c in seq], cfg))


# (id, config, steps, expected blocks)
TABLE = [
    # --- qualify = take_flag and emitted_last_step >= 1 + short ------------------------------------------------
    ("no-take-flag-never-qualifies", DEFAULT, "nnnn", "ssss"),
    ("unsaturated-never-qualifies", DEFAULT, "uuuu", "ssss"),  # 7 emitted < 1 + 7
    ("first-step-nothing-emitted", DEFAULT, "0QQ", "ssL"),
    # --- entry: two consecutive qualifying steps ------------------------------------------------------------------
    ("one-saturated-step-does-not-enter", DEFAULT, "Q", "s"),
    ("two-consecutive-enter", DEFAULT, "QQ", "sL"),  # the second qualifying step already verifies long
    ("two-non-consecutive-do-not-enter", DEFAULT, "QnQnQ", "sssss"),
    ("unsaturated-step-breaks-the-run", DEFAULT, "QuQ", "sss"),
    ("saturated-long-step-keeps-qualifying", DEFAULT, "QQWWW", "sLLLL"),
    # --- sticky exit ----------------------------------------------------------------------------------------------
    # sticky 3: the long block survives 3 non-qualifying steps, the 4th is short
    ("sticky-holds-3-then-leaves", DEFAULT, "QQnnnn", "sLLLLs"),
    ("sticky-holds-through-unsaturated", DEFAULT, "QQuuuu", "sLLLLs"),
    # the hold does not depend on qualify: a drop right after entry is held too
    ("sticky-right-after-entry", DEFAULT, "QQnQQ", "sLLLL"),
    # hqlab's reading: a qualifying step while long refreshes the window (full 3 steps again)
    ("qualifying-step-refreshes-window", DEFAULT, "QQnnnQnnnn", "sLLLLLLLLs"),
    ("long-copy-then-drop-gets-full-window", DEFAULT, "QQQQQQnnnn", "sLLLLLLLLs"),
    # sticky 0: leave at the first non-qualifying step
    ("sticky-0-leaves-immediately", replace(DEFAULT, sticky=0), "QQnQQ", "sLssL"),
    ("sticky-1", replace(DEFAULT, sticky=1), "QQnnQ", "sLLss"),
    # --- re-entry needs entry_steps fresh qualifying steps after leaving --------------------------------------------
    ("re-entry-needs-two-fresh", DEFAULT, "QQnnnnQQ", "sLLLLssL"),
    ("re-entry-one-is-not-enough", DEFAULT, "QQnnnnQnQ", "sLLLLssss"),
    ("re-entry-sticky-0", replace(DEFAULT, sticky=0), "QQQnQnQQ", "sLLssssL"),
    # --- entry_steps ------------------------------------------------------------------------------------------------
    ("entry-steps-1", replace(DEFAULT, entry_steps=1), "QnnnnQ", "LLLLsL"),
    ("entry-steps-3", replace(DEFAULT, entry_steps=3), "QQQ", "ssL"),
    # --- stale = 1: the decision at step t reads the flag of step t - 1 -----------------------------------------------
    ("stale-one-flag-not-enough", replace(DEFAULT, stale=1), "QQ", "ss"),
    ("stale-enters-one-step-later", replace(DEFAULT, stale=1), "QQQ", "ssL"),
    ("stale-leaves-one-step-later", replace(DEFAULT, stale=1), "QQnnnnn", "ssLLLLs"),
    # sticky 0, stale: the step where the flag drops still verifies long (the late flag's cost)
    ("stale-sticky-0", replace(DEFAULT, stale=1, sticky=0), "QQnQ", "ssLs"),
    # --- fixed modes ------------------------------------------------------------------------------------------------
    ("fixed-short", replace(DEFAULT, mode="short"), "QQQQnn", "ssssss"),
    ("fixed-long", replace(DEFAULT, mode="long"), "nnQQnn", "LLLLLL"),
]


@pytest.mark.parametrize("cfg,seq,expected", [r[1:] for r in TABLE], ids=[r[0] for r in TABLE])
def test_schedule_table(cfg, seq, expected):
    assert blocks(seq, cfg) == expected


def test_returns_configured_lengths():
    cfg = ScheduleConfig(short=4, long=9)
    assert simulate([(True, 5), (True, 5)], cfg) == [4, 9]  # saturated at short 4 means 5 emitted


def test_state_after_entry_and_hold():
    s = ScheduleState()
    s, b = step(s, True, 8, DEFAULT)
    assert (b, s) == (7, ScheduleState(run=1, hold=0, long=False))
    s, b = step(s, True, 8, DEFAULT)
    assert (b, s) == (15, ScheduleState(run=2, hold=3, long=True))  # on entry the counter is set to sticky
    s, b = step(s, False, 8, DEFAULT)
    assert (b, s) == (15, ScheduleState(run=0, hold=2, long=True))  # decrements while held
    s, b = step(s, False, 8, DEFAULT)
    s, b = step(s, False, 8, DEFAULT)
    assert (b, s) == (15, ScheduleState(run=0, hold=0, long=True))  # third drop: still held, counter spent
    s, b = step(s, False, 8, DEFAULT)
    assert (b, s) == (7, ScheduleState())  # left: counter and run reset


def test_stale_state_carries_the_unread_flag():
    cfg = replace(DEFAULT, stale=1)
    s, b = step(ScheduleState(), True, 8, cfg)
    assert b == 7 and s.pending and s.run == 0  # computed now, read next step


def test_fixed_modes_leave_state_alone():
    s = ScheduleState(run=1, hold=2, long=True, pending=True)
    assert step(s, True, 8, replace(DEFAULT, mode="short")) == (s, 7)
    assert step(s, False, 0, replace(DEFAULT, mode="long")) == (s, 15)


def test_qualify():
    assert qualify(True, 8, DEFAULT) and not qualify(True, 7, DEFAULT) and not qualify(False, 16, DEFAULT)
    with pytest.raises(ValueError):
        qualify(True, -1, DEFAULT)


@pytest.mark.parametrize(
    "kwargs",
    [dict(short=0), dict(short=8, long=7), dict(sticky=-1), dict(entry_steps=0), dict(stale=2),
     dict(mode="auto")],
)
def test_config_rejects(kwargs):
    with pytest.raises(ConfigError):
        ScheduleConfig(**kwargs)


def test_state_rejects_negative_counters():
    with pytest.raises(ValueError):
        ScheduleState(hold=-1)


# ---------------------------------------------------------------------------------------------------------------
# HyperQwen's batch-unanimous mode


def test_unanimous_block_len():
    assert unanimous_block_len([15, 15, 15], DEFAULT) == 15
    assert unanimous_block_len([15, 7, 15], DEFAULT) == 7  # one request not copying keeps the batch short
    assert unanimous_block_len([15], DEFAULT) == 15
    with pytest.raises(ValueError):
        unanimous_block_len([], DEFAULT)


def batch_blocks(seqs: list[str], cfg: ScheduleConfig) -> str:
    states = [ScheduleState()] * len(seqs)
    out = []
    for t in range(len(seqs[0])):
        steps = [STEP[s[t]] for s in seqs]
        states, b = step_unanimous(states, [x[0] for x in steps], [x[1] for x in steps], cfg)
        out.append("L" if b == cfg.long else "s")
    return "".join(out)


# (id, per-request step sequences, expected batch blocks)
UNANIMOUS_TABLE = [
    # long only once every request wants it: A enters at step 1, B at step 2
    ("waits-for-the-last-request", ["QQQQ", "nQQQ"], "ssLL"),
    # per request, A alone would verify "sLLL"
    ("single-request-as-per-request", ["QQQQ"], "sLLL"),
    # sticky applies at batch size 1 ...
    ("sticky-at-batch-1", ["QQnn"], "sLLL"),
    # ... and not above it: both requests leave at the first drop
    ("no-sticky-at-batch-2", ["QQnn", "QQQQ"], "sLss"),
    ("never-if-one-never-qualifies", ["QQQQ", "QQQQ", "nnnn", "QQQQ"], "ssss"),
]


@pytest.mark.parametrize("seqs,expected", [r[1:] for r in UNANIMOUS_TABLE], ids=[r[0] for r in UNANIMOUS_TABLE])
def test_unanimous_table(seqs, expected):
    assert batch_blocks(seqs, DEFAULT) == expected


def test_step_unanimous_rejects_mismatched_batch():
    with pytest.raises(ValueError):
        step_unanimous([ScheduleState()], [True, True], [8, 8], DEFAULT)
    with pytest.raises(ValueError):
        step_unanimous([], [], [], DEFAULT)


# ---------------------------------------------------------------------------------------------------------------
# Properties over random step sequences

configs = st.builds(
    ScheduleConfig,
    short=st.just(7),
    long=st.sampled_from([7, 15]),
    sticky=st.integers(0, 4),
    entry_steps=st.integers(1, 3),
    stale=st.integers(0, 1),
    mode=st.sampled_from(["adaptive", "adaptive", "short", "long"]),
)
seqs = st.lists(st.sampled_from("QQQnu0W"), max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(configs, seqs)
def test_block_is_short_or_long(cfg, seq):
    assert set(simulate([STEP[c] for c in seq], cfg)) <= {cfg.short, cfg.long}


def flags(seq: str) -> list[bool]:
    return [c in "QW" for c in seq]


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 3), seqs)
def test_sticky_0_long_iff_last_entry_steps_qualified(entry_steps, seq):
    cfg = ScheduleConfig(sticky=0, entry_steps=entry_steps)
    q = flags(seq)
    for t, b in enumerate(simulate([STEP[c] for c in seq], cfg)):
        window = q[max(0, t - entry_steps + 1): t + 1]
        assert (b == cfg.long) == (t >= entry_steps - 1 and all(window))


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 4), st.integers(1, 3), seqs)
def test_long_iff_entered_and_no_sticky_plus_one_drops_since(sticky, entry_steps, seq):
    # Independent statement of the documented machine: long at t iff some s <= t had entry_steps qualifying
    # flags in a row ending at s, and (s, t] holds no run of sticky + 1 consecutive non-qualifying steps.
    cfg = ScheduleConfig(sticky=sticky, entry_steps=entry_steps)
    q = flags(seq)

    def long_at(t: int) -> bool:
        for s in range(entry_steps - 1, t + 1):
            if not all(q[s - entry_steps + 1: s + 1]):
                continue
            gap = longest = 0
            for x in q[s + 1: t + 1]:
                gap = 0 if x else gap + 1
                longest = max(longest, gap)
            if longest <= sticky:
                return True
        return False

    got = simulate([STEP[c] for c in seq], cfg)
    assert [b == cfg.long for b in got] == [long_at(t) for t in range(len(seq))]


@settings(max_examples=400, deadline=None)
@given(configs, seqs)
def test_stale_is_a_one_step_shift(cfg, seq):
    fresh = simulate([STEP[c] for c in seq[:-1]], replace(cfg, stale=0))
    late = simulate([STEP[c] for c in seq], replace(cfg, stale=1))
    assert late == ([cfg.long if cfg.mode == "long" else cfg.short] + fresh if seq else [])


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4).flatmap(lambda n: st.lists(st.text("QnuW", min_size=12, max_size=12), min_size=n,
                                                      max_size=n)), st.integers(0, 1), st.integers(0, 3))
def test_unanimous_equals_one_machine_on_the_conjunction(seqs_, stale, sticky):
    # batch > 1: no sticky, so per-request machines + unanimity == one machine fed with all(qualify)
    cfg = ScheduleConfig(stale=stale, sticky=sticky)
    conj = "".join("Q" if all(c in "QW" for c in col) else "n" for col in zip(*seqs_))
    assert batch_blocks(seqs_, cfg) == blocks(conj, replace(cfg, sticky=0))

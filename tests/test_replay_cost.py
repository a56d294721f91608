"""Replay mechanics, the cost model's interpolation and sweep bookkeeping (no model needed: replay only reads
an output sequence; the real-model equality of replay and live runs is in test_engine_lossless.py)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from hqlab.costmodel import CostModel
from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.sweep import Trace, by_category, grid, sweep
from hqlab.trace import StepRecord, acceptance_histogram, per_position_acceptance, tokens_per_step


def test_replay_of_a_pure_copy():
    doc = list(range(100, 160))
    prompt = doc + [1, 2, 3]  # the answer repeats doc
    out = doc[:40]
    recs = replay(prompt, out, make_proposer("lookup:nmin=2,nmax=8,k=8"), max_new_tokens=40)
    # step-by-step: the first token comes from prefill; a 1-token suffix (100) is below nmin=2 so the first step
    # proposes nothing; from then on every step accepts 8 and emits 9, until the budget clips the last step.
    assert recs[0].proposed == [] and recs[0].emitted == 1
    assert all(r.accepted == 8 and r.emitted == 9 for r in recs[1:-1])
    assert sum(r.emitted for r in recs) + 1 == len(out)
    assert recs[-1].accepted <= 40 - 1 - sum(r.emitted for r in recs[:-1])
    assert tokens_per_step(recs) == pytest.approx((len(out) - 1) / len(recs))


def test_replay_budget_matches_engine_rule():
    # near the limit the proposal is clipped to max_new - done - 1, exactly like HFEngine.generate
    prompt = [5, 6, 7, 8] * 10
    out = [5, 6, 7, 8] * 3
    recs = replay(prompt, out, make_proposer("lookup:nmin=1,nmax=4,k=15"), max_new_tokens=len(out))
    done = 1
    for r in recs:
        assert len(r.proposed) <= len(out) - done - 1
        done += r.emitted
    assert done == len(out)


def test_metrics_helpers():
    recs = [StepRecord("r", i, 0, 1 + len(p), p, [1] * len(p), 6, a, a + 1, 0.0, 0.0, 0.0)
            for i, (p, a) in enumerate([([1, 2, 3], 3), ([1, 2, 3], 1), ([], 0), ([4, 5], 0)])]
    assert tokens_per_step(recs) == pytest.approx((4 + 2 + 1 + 1) / 4)
    # drafts = 3 non-empty proposals; accepted > 0: 2 of 3; > 1: 1 of 3; > 2: 1 of 3
    assert per_position_acceptance(recs, 3).tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert acceptance_histogram(recs) == {0: 2, 1: 1, 3: 1}


def test_cost_model_interpolates_both_axes():
    frame = pl.DataFrame({"context_len": [100, 100, 1100, 1100], "verify_len": [1, 11, 1, 11],
                          "step_ms": [10.0, 20.0, 30.0, 60.0]})
    cm = CostModel.fit(frame)
    assert cm.step_ms(1, 100) == pytest.approx(10.0)
    assert cm.step_ms(6, 100) == pytest.approx(15.0)
    assert cm.step_ms(1, 600) == pytest.approx(20.0)
    assert cm.step_ms(6, 600) == pytest.approx((15.0 + 45.0) / 2)
    recs = [StepRecord("r", 0, 100, 11, [1] * 10, [1] * 10, 6, 10, 11, 0.0, 0.002, 0.0)]
    assert cm.decode_seconds(recs) == pytest.approx(0.022)
    assert cm.decode_tok_s(recs) == pytest.approx(11 / 0.022)
    with pytest.raises(ValueError, match="complete"):
        CostModel.fit(frame.head(3))


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

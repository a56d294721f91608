"""Replay mechanics on both paths, and the one entry that picks the path (no model needed: replay only reads an
output sequence; the real-model equality of replay and live runs is in tests/engines/test_hf_lossless.py)."""

from __future__ import annotations

import pytest

from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.trace import tokens_per_step


@pytest.mark.parametrize("path", ["step", "fast"])
def test_replay_of_a_pure_copy(path):
    doc = list(range(100, 160))
    prompt = doc + [1, 2, 3]  # the answer repeats doc
    out = doc[:40]
    recs = replay(prompt, out, make_proposer("lookup:nmin=2,nmax=8,k=8"), max_new_tokens=40, path=path)
    # step-by-step: the first token comes from prefill; a 1-token suffix (100) is below nmin=2 so the first step
    # proposes nothing; from then on every step accepts 8 and emits 9, until the budget clips the last step.
    assert recs[0].proposed == [] and recs[0].emitted == 1
    assert all(r.accepted == 8 and r.emitted == 9 for r in recs[1:-1])
    assert sum(r.emitted for r in recs) + 1 == len(out)
    assert recs[-1].accepted <= 40 - 1 - sum(r.emitted for r in recs[:-1])
    assert tokens_per_step(recs) == pytest.approx((len(out) - 1) / len(recs))


@pytest.mark.parametrize("path", ["step", "fast"])
def test_replay_budget_matches_engine_rule(path):
    # near the limit the proposal is clipped to max_new - done - 1, exactly like HFEngine.generate
    prompt = [5, 6, 7, 8] * 10
    out = [5, 6, 7, 8] * 3
    recs = replay(prompt, out, make_proposer("lookup:nmin=1,nmax=4,k=15"), max_new_tokens=len(out), path=path)
    done = 1
    for r in recs:
        assert len(r.proposed) <= len(out) - done - 1
        done += r.emitted
    assert done == len(out)


def test_the_entry_takes_the_vectorised_path_where_it_applies(monkeypatch):
    """`replay` hands lookup and PLD to the vectorised replay unless proposals are timed; everything else, and
    every timed replay, goes step by step. The two paths give the same records."""
    import hqlab.replay as entry

    calls = []
    for name in ("fast_replay", "step_replay"):
        real = getattr(entry, name)
        monkeypatch.setattr(entry, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    prompt, out = [1, 2, 3, 4] * 5, [1, 2, 3, 4, 1, 2]
    fast = replay(prompt, out, make_proposer("pld:n=2,k=4"), max_new_tokens=8)
    timed = replay(prompt, out, make_proposer("pld:n=2,k=4"), max_new_tokens=8, time_proposals=True)
    replay(prompt, out, make_proposer("none"), max_new_tokens=8)
    replay(prompt, out, make_proposer("lookup:k=4"), max_new_tokens=8, path="step")
    assert calls == ["fast_replay", "step_replay", "step_replay", "step_replay"]
    assert [(r.proposed, r.accepted) for r in fast] == [(r.proposed, r.accepted) for r in timed]
    assert all(r.propose_s > 0 for r in timed if r.proposed) and all(r.propose_s == 0 for r in fast)
    with pytest.raises(ValueError, match="does not time"):
        replay(prompt, out, make_proposer("pld"), max_new_tokens=8, time_proposals=True, path="fast")
    with pytest.raises(ValueError, match="path must be"):
        replay(prompt, out, make_proposer("pld"), max_new_tokens=8, path="vectorised")

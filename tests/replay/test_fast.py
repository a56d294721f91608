"""The fast replay is the reference (step-by-step) replay, record for record: random histories (hypothesis),
batches, the cached real traces of the 0.5B (`real_traces`, tests/replay/conftest.py) and forced hash
collisions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab.config import LookupConfig
from hqlab.proposers import make_proposer
from hqlab.proposers.lookup import LookupProposer
from hqlab.replay import fast as fastreplay
from hqlab.replay.fast import TraceIndex, fast_replay, replay_table
from hqlab.replay.step import step_replay
from hqlab.replay.traces import Trace

# Every rule variant: both policies, search windows, full continuations, PLD, HyperQwen's and the sweep's settings.
SPECS = ["lookup", "lookup:nmin=1,nmax=32,k=15,policy=earliest", "lookup:nmin=6,nmax=12,k=7", "pld:n=3,k=10",
         "lookup:nmin=1,nmax=4,k=5", "lookup:nmin=2,nmax=6,k=3,policy=earliest", "lookup:nmin=1,nmax=3,k=4,full=true",
         "lookup:nmin=1,nmax=5,k=4,policy=earliest,full=true", "lookup:nmin=2,nmax=5,k=6,search=10",
         "lookup:nmin=1,nmax=3,k=4,search=7,policy=earliest", "lookup:nmin=3,nmax=3,k=2,search=5,full=true"]


@st.composite
def histories(draw):
    vocab = draw(st.integers(2, 6))  # a small vocabulary makes matches (and long ones) common
    prompt = draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    out = draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    slack = draw(st.integers(0, 3))
    return prompt, out, len(out) + slack


@st.composite
def configs(draw):
    nmin = draw(st.integers(1, 5))
    return LookupConfig(nmin=nmin, nmax=draw(st.integers(nmin, 8)), k=draw(st.integers(1, 9)),
                        search=draw(st.sampled_from([0, 0, 3, 9])), policy=draw(st.sampled_from(["recent", "earliest"])),
                        full=draw(st.booleans()))


@settings(max_examples=400, deadline=None)
@given(histories(), configs())
def test_random_histories_equal_the_reference(history, config):
    prompt, out, max_new = history
    proposer = LookupProposer(config)
    assert fast_replay(prompt, out, proposer, max_new_tokens=max_new) == \
        step_replay(prompt, out, proposer, max_new_tokens=max_new)


@pytest.mark.parametrize("share", [True, False])
def test_a_batch_equals_replaying_each_trace(share):
    rng = np.random.default_rng(7)
    traces = []
    for i in range(30):
        vocab = int(rng.integers(2, 5))
        out_len = int(rng.integers(0, 40))
        traces.append(Trace.of(rng.integers(0, vocab, int(rng.integers(0, 30))).tolist(),
                               rng.integers(0, vocab, out_len).tolist(), out_len + int(rng.integers(0, 3)), f"r{i}"))
    index = TraceIndex(traces, share=share)
    for spec in SPECS:
        proposer = make_proposer(spec)
        table = replay_table(index, proposer)
        for i, tr in enumerate(traces):
            assert table.records(i) == step_replay(tr.prompt_ids, tr.output_ids, proposer,
                                                   max_new_tokens=tr.max_new_tokens, request=tr.prompt_id), (spec, i)


def test_real_traces_equal_the_reference(real_traces):
    assert len(real_traces) == 14 and {t.category for t in real_traces} >= {"copy", "code", "chat", "summary"}
    index = TraceIndex(real_traces)
    for spec in SPECS:
        proposer = make_proposer(spec)
        table = replay_table(index, proposer)
        for i, tr in enumerate(real_traces):
            expected = step_replay(tr.prompt_ids, tr.output_ids, proposer, max_new_tokens=tr.max_new_tokens,
                                   request=tr.prompt_id)
            assert table.records(i) == expected, (spec, tr.prompt_id)
        assert table.fallbacks == 0


def test_hash_collisions_cannot_change_the_result(monkeypatch):
    """With every token hashed alike, every n-gram collides with every other: all candidates are false, the
    verification rejects them, and the reference rule decides each position, so the records stay exact."""
    monkeypatch.setattr(fastreplay, "_MIX", np.uint64(0))
    rng = np.random.default_rng(3)
    prompt, out = rng.integers(0, 4, 60).tolist(), rng.integers(0, 4, 50).tolist()
    for spec in SPECS:
        proposer = make_proposer(spec)
        for share in (True, False):
            table = replay_table(TraceIndex([Trace.of(prompt, out, 52)], share=share), proposer)
            assert table.records(0) == step_replay(prompt, out, proposer, max_new_tokens=52), spec
    assert replay_table(TraceIndex([Trace.of(prompt, out, 52)]), make_proposer("lookup:nmin=2,nmax=5")).fallbacks > 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="exceed max_new_tokens"):
        TraceIndex([Trace.of([1, 2], [3, 4, 5], 2, "req-a")])
    with pytest.raises(TypeError, match="lookup and PLD"):
        replay_table([Trace.of([1], [2, 3], 2)], make_proposer("none"))
    assert not fastreplay.supports(make_proposer("none")) and fastreplay.supports(make_proposer("pld"))



"""The fast replay is the reference replay, record for record: random histories (hypothesis), batches, the cached
real traces of the 0.5B, forced hash collisions, and the sweep's two paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab import fastreplay
from hqlab.config import LookupConfig
from hqlab.fastreplay import TraceIndex, TraceInput, fast_replay, replay_table
from hqlab.proposers import make_proposer
from hqlab.proposers.lookup import LookupProposer
from hqlab.replay import replay

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
        replay(prompt, out, proposer, max_new_tokens=max_new)


@pytest.mark.parametrize("share", [True, False])
def test_a_batch_equals_replaying_each_trace(share):
    rng = np.random.default_rng(7)
    traces = []
    for i in range(30):
        vocab = int(rng.integers(2, 5))
        out_len = int(rng.integers(0, 40))
        traces.append(TraceInput(rng.integers(0, vocab, int(rng.integers(0, 30))).tolist(),
                                 rng.integers(0, vocab, out_len).tolist(), out_len + int(rng.integers(0, 3)), f"r{i}"))
    index = TraceIndex(traces, share=share)
    for spec in SPECS:
        proposer = make_proposer(spec)
        table = replay_table(index, proposer)
        for i, tr in enumerate(traces):
            assert table.records(i) == replay(tr.prompt_ids, tr.output_ids, proposer, max_new_tokens=tr.max_new_tokens,
                                              request=tr.request), (spec, i)


TRACES = Path(__file__).resolve().parent.parent / "data" / "results" / "traces_0.5b_all_128.parquet"


@pytest.fixture(scope="module")
def real_traces():
    """The 0.5B's greedy outputs on the labd and chat suites (128 new tokens), as committed with the results."""
    from hqlab.sweep import load_traces

    return load_traces(TRACES)


def test_real_traces_equal_the_reference(real_traces):
    assert len(real_traces) == 14 and {t.category for t in real_traces} >= {"copy", "code", "chat", "summary"}
    index = TraceIndex([TraceInput(t.prompt_ids, t.output_ids, t.max_new_tokens, t.prompt_id) for t in real_traces])
    for spec in SPECS:
        proposer = make_proposer(spec)
        table = replay_table(index, proposer)
        for i, tr in enumerate(real_traces):
            expected = replay(tr.prompt_ids, tr.output_ids, proposer, max_new_tokens=tr.max_new_tokens,
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
            table = replay_table(TraceIndex([TraceInput(prompt, out, 52)], share=share), proposer)
            assert table.records(0) == replay(prompt, out, proposer, max_new_tokens=52), spec
    assert replay_table(TraceIndex([TraceInput(prompt, out, 52)]), make_proposer("lookup:nmin=2,nmax=5")).fallbacks > 0


def test_sweep_fast_path_equals_the_step_by_step_path(real_traces):
    from hqlab.costmodel import CostModel
    from hqlab.sweep import sweep

    import polars as pl

    cost = CostModel.fit(pl.DataFrame({"context_len": [100, 100, 100, 2000, 2000, 2000], "verify_len": [1, 4, 16] * 2,
                                       "step_ms": [10.0, 11.0, 13.0, 12.0, 14.0, 19.0]}))
    specs = ["lookup:nmin=2,nmax=8,k=8", "pld:n=3,k=10"]
    fast = sweep(real_traces, specs, cost=cost, progress=False, time_proposals=False)
    slow = sweep(real_traces, specs, cost=cost, progress=False, time_proposals=False, fast=False)
    assert set(fast["replay"]) == {"fast"} and set(slow["replay"]) == {"step"}
    exact = ["config", "prompt_id", "steps", "accepted"]
    assert fast.select(exact).rows() == slow.select(exact).rows()
    for col in ["tokens_per_step", "pred_decode_s", "pred_base_s"]:  # sums in another order: rounding only
        np.testing.assert_allclose(fast[col].to_numpy(), slow[col].to_numpy(), rtol=1e-12)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="exceed max_new_tokens"):
        TraceIndex([TraceInput([1, 2], [3, 4, 5], 2, "req-a")])
    with pytest.raises(TypeError, match="lookup and PLD"):
        replay_table([TraceInput([1], [2, 3], 2)], make_proposer("none"))
    assert not fastreplay.supports(make_proposer("none")) and fastreplay.supports(make_proposer("pld"))


def test_parse_grid_expands_any_keys_and_names_bad_ones():
    from hqlab.config import ConfigError
    from hqlab.sweep import parse_grid

    assert parse_grid("lookup:nmin=1|6,nmax=4|8,k=15") == ["lookup:nmin=1,nmax=4,k=15", "lookup:nmin=1,nmax=8,k=15",
                                                          "lookup:nmin=6,nmax=8,k=15"]
    assert parse_grid("pld") == ["pld"]
    with pytest.raises(ConfigError, match="nmin must be <= nmax"):
        parse_grid("lookup:nmin=9,nmax=2|3")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_grid("lookup:depth=1|2")
    with pytest.raises(ConfigError, match="empty value"):
        parse_grid("lookup:nmin=1||2")


def test_sweep_command_on_a_saved_trace_set(tmp_path, capsys):
    from hqlab.cli import main

    out = tmp_path / "sweep.parquet"
    assert main(["sweep", "--traces", str(TRACES), "--grid", "lookup:nmin=1|2,nmax=8,k=8|15", "--proposer",
                 "pld:n=3,k=10", "--out", str(out)]) == 0
    import polars as pl

    frame = pl.read_parquet(out)
    assert frame.height == 5 * 14 and set(frame["replay"]) == {"fast"}
    assert main(["sweep", "--traces", str(tmp_path / "missing.parquet"), "--grid", "pld", "--out", str(out)]) == 2
    assert main(["sweep", "--traces", str(TRACES), "--grid", "lookup:nmin=9,nmax=2", "--out", str(out)]) == 2
    assert "nmin must be <= nmax" in capsys.readouterr().err

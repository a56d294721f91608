"""The fused proposer's `skip` setting: a request skips the drafter on a step when its block `skip` steps earlier
was the long one (HyperQwen skips the drafter while a copy is in progress). Replayed over a generation that copies
its prompt, with a drafter that records what it was asked for."""

from __future__ import annotations

import numpy as np
import pytest

from hqlab.config import ConfigError
from hqlab.proposers.base import Proposal, Source
from hqlab.proposers.fused import FusedConfig, FusedProposer
from hqlab.replay.step import step_replay
from hqlab.rules.fusion import fuse

K, BLOCK = 15, 4


class ScriptedDrafter:
    """Drafts the true continuation of one known sequence (a drafter that is always right), and records every
    call's budgets: which steps drafted and which skipped."""

    class config:  # noqa: N801 - the attribute FusedProposer reads off a drafter
        temperature = 0.0

    def __init__(self, sequence: np.ndarray) -> None:
        self.sequence, self.k, self.calls = sequence, BLOCK, []

    def propose(self, histories, budgets, keys=None):
        self.calls.append([int(b) for b in budgets])
        out = []
        for h, b in zip(histories, budgets):
            n = max(0, min(self.k, int(b)))
            tokens = np.zeros(n, dtype=np.int64)  # past the sequence's end: some token, as a real drafter would
            known = self.sequence[len(h):len(h) + n]
            tokens[:len(known)] = known
            out.append(Proposal(tokens.astype(np.int64), np.full(len(tokens), Source.DRAFT, dtype=np.int8)))
        return out

    exact = propose


def _copying_generation(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A prompt of novel tokens, then an output that is novel for a while and then copies a long span of the prompt
    (the case HyperQwen's long block is for), then novel again."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1000, 30000, 400)
    output = np.concatenate([rng.integers(30000, 40000, 30), prompt[100:300], rng.integers(30000, 40000, 40)])
    return prompt, output


def _replay(skip: int, prompt, output, skip_on: str = "long"):
    drafter = ScriptedDrafter(np.concatenate([prompt, output]))
    proposer = FusedProposer(FusedConfig(k=K, draft_block=BLOCK, nmax=32, policy="earliest", skip=skip,
                                         skip_on=skip_on), drafter)
    steps = []  # (proposal extras) per step: wrap propose to see them
    inner = proposer.propose

    def propose(histories, budgets, keys=None):
        out = inner(histories, budgets, keys)
        steps.append(dict(out[0].extra))
        return out

    proposer.propose = propose
    records = step_replay(prompt, output, proposer, max_new_tokens=len(output))
    # the proposer's own counters agree with what the drafter was asked
    assert proposer.skipped_steps == sum(s["drafted"] == 0 for s in steps)
    assert proposer.drafted_steps + proposer.skipped_steps == len(steps)
    return records, steps, drafter.calls


@pytest.mark.parametrize("skip", [1, 2, 3])
def test_a_request_skips_the_drafter_exactly_when_its_block_was_long_skip_steps_earlier(skip):
    prompt, output = _copying_generation()
    records, steps, calls = _replay(skip, prompt, output)
    blocks = [s["block"] for s in steps]
    assert K in blocks and BLOCK in blocks  # the copy entered the long block, the novel text stayed short
    for t, (extra, budgets) in enumerate(zip(steps, calls)):
        skipped = t >= skip and blocks[t - skip] == K
        assert (extra["drafted"] == 0) == skipped, (t, blocks[max(0, t - skip):t + 1])
        assert (budgets[0] == 0) == skipped  # the drafter was not asked for a block it would not use
    assert sum(extra["drafted"] == 0 for extra in steps) >= 5
    assert sum(b[0] == 0 for b in calls) == sum(extra["drafted"] == 0 for extra in steps)


@pytest.mark.parametrize("skip", [1, 2])
def test_skip_on_head_skips_after_steps_whose_whole_head_the_lookup_filled(skip):
    prompt, output = _copying_generation(2)
    records, steps, calls = _replay(skip, prompt, output, skip_on="head")
    lookup_head = [len(r.sources) >= BLOCK and all(x == Source.LOOKUP for x in r.sources[:BLOCK]) for r in records]
    for t, extra in enumerate(steps):
        assert (extra["drafted"] == 0) == (t >= skip and lookup_head[t - skip]), t
    long_only = _replay(skip, prompt, output)[1]
    # the head rule starts skipping as soon as the copy starts, before the long block's two-step entry
    first = lambda ss: next(t for t, e in enumerate(ss) if e["drafted"] == 0)  # noqa: E731
    assert first(steps) < first(long_only)


def test_skipping_keeps_the_output_and_only_the_lookup_decides_on_skipped_steps():
    prompt, output = _copying_generation(1)
    plain, plain_steps, _ = _replay(0, prompt, output)
    skipping, steps, _ = _replay(2, prompt, output)
    # replay verifies against the same greedy output: both emit it all; skipping costs few tokens per step here
    assert sum(r.emitted for r in plain) == sum(r.emitted for r in skipping) == len(output) - 1
    assert all(s["drafted"] == BLOCK for s in plain_steps)
    assert len(skipping) <= 1.15 * len(plain)
    history = np.concatenate([prompt, output])
    done = 1
    proposer = FusedProposer(FusedConfig(k=K, draft_block=BLOCK, nmax=32, policy="earliest"),
                             ScriptedDrafter(history))
    for record, extra in zip(skipping, steps):
        if extra["drafted"] == 0:  # what a lookup-only fusion of this step proposes, clipped to the block
            view = history[:len(prompt) + done]
            lk = proposer.lookup.propose([view], [K])[0]
            f = fuse(np.zeros(BLOCK, dtype=np.int64), lk.tokens, lk.match_len, lk.valid, K, proposer.fusion,
                     draft_valid=0)
            assert list(record.proposed) == [int(x) for x in f.tokens[:extra["block"]]]
        done += record.emitted


@pytest.mark.parametrize("skip", [-1, 9])
def test_skip_out_of_range_is_refused(skip):
    with pytest.raises(ConfigError, match="skip must be 0"):
        FusedConfig(skip=skip)
    with pytest.raises(ConfigError, match="skip_on must be one of"):
        FusedConfig(skip=1, skip_on="always")

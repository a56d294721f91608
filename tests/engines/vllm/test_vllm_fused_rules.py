"""The batched device-tensor rules (`hqlab.engines.vllm.fused_rules`) against the references, decision for decision.

`hqlab.rules.fusion` and `hqlab.rules.schedule` define the rules; fused_rules is a second implementation for vLLM's
GPU step, allowed only because these tests hold it to the references:

- fusion: random batches under the shipped set, the articles' set, random configs and the score rule, with
  random agreement patterns, padding that imitates agreement past `valid`, valid from 0 to k and match lengths
  from 0 to nmax: every position's token and source, the block length and every flag;
- schedule: random multi-step sequences, state carried across steps (stale on and off, sticky 0..4, entry_steps
  1..3, fixed modes), reused slots and padded batches: block length and whole state at every step, plus
  `simulate` over whole sequences and HyperQwen's unanimous batch mode;
- recorded traces (data/results/<study>/<run>/steps.parquet): the block lengths the engine recorded are reproduced,
  and real take-flag / emitted sequences replayed under every schedule config give the reference's decisions;
- no synchronisation: the module's source has no host-read calls and branches only on the config and shapes,
  its outputs' shapes do not depend on values, it traces into one graph (torch.compile fullgraph), and on CUDA it
  runs under sync-debug "error" and replays from a captured CUDA graph.

Runs on the GPU when there is one, else on the CPU.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab.engines.vllm import fused_rules, fused_step
from hqlab.engines.vllm.fused_rules import (SOURCE_NONE, FusedTensors, ScheduleTensors, agree_count_tensors,
                                            fuse_tensors, qualify_tensors, schedule_step_tensors,
                                            step_unanimous_tensors, unanimous_block_len_tensors)
from hqlab.proposers.base import Source
from hqlab.rules.fusion import RULES, FusionConfig, fuse
from hqlab.rules.schedule import (ScheduleConfig, ScheduleState, qualify, simulate, step, step_unanimous,
                                  unanimous_block_len)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RESULTS = Path(__file__).resolve().parents[3] / "data" / "results"
PAD = -7  # a pad token no random token equals


def as_tensor(values, dtype) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values), dtype=dtype, device=DEVICE)


# Fusion --------------------------------------------------------------------------------------------------------


@dataclass
class FusionInputs:
    draft: np.ndarray  # [B, head_len] int64
    lookup: np.ndarray  # [B, k] int64, padding past valid
    valid: np.ndarray  # [B]
    match_len: np.ndarray  # [B]
    scores: np.ndarray | None  # [B] float64 for the score rule, None = valid

    @property
    def k(self) -> int:
        return self.lookup.shape[1]


def random_fusion_config(rng: np.random.Generator) -> FusionConfig:
    draft_block = int(rng.integers(1, 17))
    return FusionConfig(nstrong=int(rng.integers(0, 17)), nmin=int(rng.integers(0, 17)),
                        agree=int(rng.integers(0, draft_block + 1)), nmin_tail=int(rng.integers(0, 17)),
                        longmin=int(rng.integers(0, 17)), draft_block=draft_block, rule=str(rng.choice(RULES)),
                        nmin_alone=int(rng.choice([0, int(rng.integers(1, 17))])))


def random_fusion_inputs(rng: np.random.Generator, config: FusionConfig, batch: int, k: int,
                         nmax: int) -> FusionInputs:
    head_len = min(config.draft_block, k)
    vocab = int(rng.choice([2, 4, 50_000]))  # tiny vocabularies agree by accident, also after a mismatch
    draft = rng.integers(0, vocab, (batch, head_len))
    lookup = rng.integers(0, vocab, (batch, k))
    edges = np.array([0, 1, head_len - 1, head_len, config.draft_block, config.draft_block + 1, k - 1, k])
    valid = np.where(rng.random(batch) < 0.5, rng.integers(0, k + 1, batch), rng.choice(edges, batch)).clip(0, k)
    for i in range(batch):
        agreed = int(rng.integers(0, head_len + 1))  # the lookup repeats the drafter over a random prefix
        if rng.random() < 0.3:
            agreed = head_len
        lookup[i, :agreed] = draft[i, :agreed]
        pad = rng.choice(["drafter", "pad", "random"])  # what sits past valid must never matter
        if pad == "drafter":
            lookup[i, valid[i]:head_len] = draft[i, valid[i]:head_len]
        elif pad == "pad":
            lookup[i, valid[i]:] = -1
    match_edges = np.array([0, config.nstrong, config.nmin, config.nmin_tail, config.longmin, nmax])
    match_len = np.where(rng.random(batch) < 0.5, rng.integers(0, nmax + 1, batch),
                         rng.choice(match_edges, batch) + rng.integers(-1, 2, batch)).clip(0, None)
    scores = None
    if config.rule == "score" and rng.random() < 0.7:  # probabilities summed over the valid tokens
        scores = rng.random(batch) * valid
        boundary = rng.random(batch) < 0.3
        scores[boundary] = np.minimum(head_len, valid[boundary])
    return FusionInputs(draft.astype(np.int64), lookup.astype(np.int64), valid, match_len, scores)


def reference_fusion(x: FusionInputs, config: FusionConfig) -> dict[str, np.ndarray]:
    """`fuse` per request, laid out as fuse_tensors lays out its result."""
    batch, k = x.lookup.shape
    out = {"tokens": np.full((batch, k), PAD, dtype=np.int64),
           "sources": np.full((batch, k), SOURCE_NONE, dtype=np.int8),
           "n_proposed": np.zeros(batch, dtype=np.int32), "agree": np.zeros(batch, dtype=np.int32)}
    for name in ("take_flag", "head_taken", "tail_taken"):
        out[name] = np.zeros(batch, dtype=bool)
    for i in range(batch):
        score = None if x.scores is None else float(x.scores[i])
        f = fuse(x.draft[i], x.lookup[i], int(x.match_len[i]), int(x.valid[i]), k, config, score)
        n = f.tokens.shape[0]
        out["tokens"][i, :n], out["sources"][i, :n], out["n_proposed"][i] = f.tokens, f.sources, n
        out["agree"][i] = f.agree_count
        out["take_flag"][i], out["head_taken"][i], out["tail_taken"][i] = f.take_flag, f.head_taken, f.tail_taken
    return out


def tensor_fusion(x: FusionInputs, config: FusionConfig, out: FusedTensors | None = None,
                  valid_dtype: torch.dtype = torch.int32) -> dict[str, np.ndarray]:
    valid = as_tensor(x.valid, valid_dtype)
    scores = None if x.scores is None else as_tensor(x.scores, torch.float64)
    draft, lookup = as_tensor(x.draft, torch.int64), as_tensor(x.lookup, torch.int64)
    got = fuse_tensors(draft, lookup, valid, as_tensor(x.match_len, valid_dtype), config, scores, pad_token=PAD,
                       out=out)
    result = {name: value.cpu().numpy() for name, value in got._asdict().items()}
    result["agree"] = agree_count_tensors(draft, lookup, valid).cpu().numpy()
    return result


def assert_same_fusion(got: dict[str, np.ndarray], want: dict[str, np.ndarray], x: FusionInputs,
                       config: FusionConfig) -> None:
    for name, expected in want.items():
        rows = np.flatnonzero((got[name] != expected).reshape(len(expected), -1).any(axis=1))
        if rows.size:
            i = int(rows[0])
            pytest.fail(f"{name} differs from the reference for {config} at request {i}: draft {x.draft[i].tolist()}, "
                        f"lookup {x.lookup[i].tolist()}, valid {x.valid[i]}, match_len {x.match_len[i]}, "
                        f"score {None if x.scores is None else x.scores[i]}: got {got[name][i].tolist()}, "
                        f"reference {expected[i].tolist()}")


FUSION_FAMILIES = {
    "shipped": lambda rng: FusionConfig.shipped(),
    "articles": lambda rng: FusionConfig.articles(),
    "score": lambda rng: FusionConfig(rule="score"),
    "random": random_fusion_config,
    "alone": lambda rng: FusionConfig.shipped(nmin_alone=int(rng.integers(1, 8)), nmin_tail=int(rng.integers(0, 5))),
}


@pytest.mark.parametrize("family", FUSION_FAMILIES)
def test_fusion_matches_reference_on_random_batches(family):
    rng = np.random.default_rng(sorted(FUSION_FAMILIES).index(family))
    buffers = FusedTensors.allocate(32, 24, DEVICE)
    for trial in range(80):
        config = FUSION_FAMILIES[family](rng)
        k = int(rng.choice([15, int(rng.integers(1, 21))])) if family != "random" else int(rng.integers(1, 25))
        batch = int(rng.integers(1, 33))
        x = random_fusion_inputs(rng, config, batch, k, nmax=int(rng.choice([12, 16, 32])))
        out = FusedTensors.allocate(batch + 3, k, DEVICE) if trial % 3 == 0 else None
        if k == 24 and trial % 3 == 1:
            out = buffers
        got = tensor_fusion(x, config, out, valid_dtype=torch.int32 if trial % 2 else torch.int64)
        assert_same_fusion(got, reference_fusion(x, config), x, config)


fusion_configs = st.builds(
    lambda block, nstrong, nmin, agree, nmin_tail, longmin, rule, alone: FusionConfig(
        nstrong=nstrong, nmin=nmin, agree=min(agree, block), nmin_tail=nmin_tail, longmin=longmin,
        draft_block=block, rule=rule, nmin_alone=alone),
    st.integers(1, 9), st.integers(0, 10), st.integers(0, 10), st.integers(0, 9), st.integers(0, 10),
    st.integers(0, 10), st.sampled_from(RULES), st.integers(0, 6))


@settings(max_examples=150, deadline=None)
@given(fusion_configs, st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_fusion_matches_reference_hypothesis(config, k, seed):
    x = random_fusion_inputs(np.random.default_rng(seed), config, batch=4, k=k, nmax=10)
    assert_same_fusion(tensor_fusion(x, config), reference_fusion(x, config), x, config)


@pytest.mark.parametrize("family", FUSION_FAMILIES)
def test_fusion_with_a_partial_or_absent_drafter_matches_reference(family):
    """`draft_valid` (the fused proposer's `skip`: a step without the drafter, or a shorter head) row by row
    against the reference `fuse(..., draft_valid=...)`; the drafter's tokens past draft_valid are junk."""
    rng = np.random.default_rng(100 + sorted(FUSION_FAMILIES).index(family))
    for _ in range(60):
        config = FUSION_FAMILIES[family](rng)
        k = int(rng.integers(1, 21))
        batch = int(rng.integers(1, 17))
        x = random_fusion_inputs(rng, config, batch, k, nmax=16)
        head_len = min(config.draft_block, k)
        dv = np.where(rng.random(batch) < 0.5, 0, rng.integers(0, head_len + 1, batch)).astype(np.int32)
        want = {"tokens": np.full((batch, k), PAD, dtype=np.int64),
                "sources": np.full((batch, k), SOURCE_NONE, dtype=np.int8), "n_proposed": np.zeros(batch, np.int32),
                "take_flag": np.zeros(batch, bool), "head_taken": np.zeros(batch, bool),
                "tail_taken": np.zeros(batch, bool)}
        for i in range(batch):
            score = None if x.scores is None else float(x.scores[i])
            f = fuse(x.draft[i], x.lookup[i], int(x.match_len[i]), int(x.valid[i]), k, config, score,
                     draft_valid=int(dv[i]))
            n = f.tokens.shape[0]
            want["tokens"][i, :n], want["sources"][i, :n], want["n_proposed"][i] = f.tokens, f.sources, n
            want["take_flag"][i], want["head_taken"][i], want["tail_taken"][i] = f.take_flag, f.head_taken, f.tail_taken
        got = fuse_tensors(as_tensor(x.draft, torch.int64), as_tensor(x.lookup, torch.int64),
                           as_tensor(x.valid, torch.int32), as_tensor(x.match_len, torch.int32), config,
                           None if x.scores is None else as_tensor(x.scores, torch.float64), pad_token=PAD,
                           draft_valid=as_tensor(dv, torch.int32))
        assert_same_fusion({name: value.cpu().numpy() for name, value in got._asdict().items()}, want, x, config)


def test_fusion_examples_from_the_spec():
    """A few rows written out: the drafter head D, lookups agreeing on 0, 2 or all 7 head positions."""
    d = [10, 11, 12, 13, 14, 15, 16]
    tail = [20, 21, 22, 23, 24, 25, 26, 27]
    lookups = [[90, 91, 92, 93, 94, 95, 96] + tail, [10, 11, 92, 93, 94, 95, 96] + tail, d + tail, d + tail]
    x = FusionInputs(np.array([d] * 4), np.array(lookups), np.array([15, 15, 15, 4]), np.array([7, 6, 5, 8]), None)
    got = tensor_fusion(x, FusionConfig.articles())
    # match 7 < nstrong 8 without agreement: drafter only; match 6 with 2 agreeing: lookup everywhere;
    # match 5 with full agreement: drafter head (tagged D), lookup tail; valid 4: lookup head prefix, no tail
    assert got["sources"].tolist() == [[2] * 7 + [-1] * 8, [1] * 15, [2] * 7 + [1] * 8, [1] * 4 + [2] * 3 + [-1] * 8]
    assert got["tokens"][0].tolist() == d + [PAD] * 8 and got["tokens"][2].tolist() == d + tail
    assert got["n_proposed"].tolist() == [7, 15, 15, 7]
    assert got["take_flag"].tolist() == [False, True, False, False]
    assert_same_fusion(got, reference_fusion(x, FusionConfig.articles()), x, FusionConfig.articles())


def test_unproposed_positions_are_marked_apart_from_every_source():
    assert SOURCE_NONE not in {int(s) for s in Source}
    assert fused_rules.SOURCE_LOOKUP == Source.LOOKUP and fused_rules.SOURCE_DRAFT == Source.DRAFT


def test_fusion_rejects_a_drafter_head_of_the_wrong_width():
    lookup = torch.zeros(2, 15, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_tokens"):
        fuse_tensors(torch.zeros(2, 6, dtype=torch.int64), lookup, torch.zeros(2, dtype=torch.int32),
                     torch.zeros(2, dtype=torch.int32), FusionConfig())
    with pytest.raises(ValueError, match="out holds"):
        fuse_tensors(torch.zeros(2, 7, dtype=torch.int64), lookup, torch.zeros(2, dtype=torch.int32),
                     torch.zeros(2, dtype=torch.int32), FusionConfig(), out=FusedTensors.allocate(1, 15, "cpu"))


# Scheduling ----------------------------------------------------------------------------------------------------


def states_of(tensors: ScheduleTensors) -> list[ScheduleState]:
    return [ScheduleState(*row) for row in fields_of(tensors)]


def fields_of(tensors: ScheduleTensors) -> list[tuple]:
    """(run, hold, long, pending) per row: a cheap form to compare with `field_tuples` of reference states."""
    return list(zip(*(t.tolist() for t in (tensors.run, tensors.hold, tensors.long, tensors.pending))))


def field_tuples(states: list[ScheduleState]) -> list[tuple]:
    return [(s.run, s.hold, s.long, s.pending) for s in states]


def tensors_of(states: list[ScheduleState]) -> ScheduleTensors:
    return ScheduleTensors(as_tensor([s.run for s in states], torch.int32), as_tensor([s.hold for s in states],
                                                                                        torch.int32),
                           as_tensor([s.long for s in states], torch.bool),
                           as_tensor([s.pending for s in states], torch.bool))


def random_steps(rng: np.random.Generator, batch: int, steps: int, config: ScheduleConfig) -> tuple[np.ndarray, ...]:
    """[steps, batch] take flags and emitted counts with copy phases (long runs of saturated qualifying steps)
    between prose, and flags that drop out inside a copy: what entry, sticky exit and re-entry react to."""
    copying = rng.random(batch) < 0.5
    take = np.zeros((steps, batch), dtype=bool)
    emitted = np.zeros((steps, batch), dtype=np.int64)
    for t in range(steps):
        copying ^= rng.random(batch) < 0.15
        take[t] = np.where(copying, rng.random(batch) < 0.85, rng.random(batch) < 0.3)
        saturated = rng.choice([config.short + 1, config.long + 1], batch)
        other = rng.integers(0, config.long + 2, batch)
        emitted[t] = np.where(copying & (rng.random(batch) < 0.85), saturated, other)
        emitted[t, rng.random(batch) < 0.05] = 0
    return take, emitted


SCHEDULE_GRID = [ScheduleConfig(sticky=sticky, entry_steps=entry, stale=stale)
                 for stale, sticky, entry in itertools.product((0, 1), range(5), (1, 2, 3))]


def random_schedule_config(rng: np.random.Generator) -> ScheduleConfig:
    short = int(rng.integers(1, 9))
    return ScheduleConfig(short=short, long=int(rng.integers(short, 17)), sticky=int(rng.integers(0, 5)),
                          entry_steps=int(rng.integers(1, 4)), stale=int(rng.integers(0, 2)),
                          mode=str(rng.choice(["adaptive"] * 6 + ["short", "long"])))


def test_schedule_simulate_matches_reference_per_request():
    """Whole sequences per request: every request's block lengths are `simulate` of its own flags."""
    rng = np.random.default_rng(0)
    for config in SCHEDULE_GRID:
        take, emitted = random_steps(rng, batch=12, steps=60, config=config)
        state = ScheduleTensors.allocate(12, DEVICE)
        blocks = []
        for t in range(take.shape[0]):
            state, block_len = schedule_step_tensors(state, as_tensor(take[t], torch.bool),
                                                     as_tensor(emitted[t], torch.int32), config)
            blocks.append(block_len.tolist())
        for i in range(12):
            assert [b[i] for b in blocks] == simulate(zip(take[:, i].tolist(), emitted[:, i].tolist()), config), \
                f"request {i} under {config}"


def test_schedule_step_matches_reference_with_reused_slots_and_padding():
    """Step by step, the whole state: slots reset at random (a new request), rows outside the batch at random."""
    rng = np.random.default_rng(1)
    configs = SCHEDULE_GRID + [random_schedule_config(rng) for _ in range(30)]
    for config in configs:
        slots = int(rng.integers(1, 17))
        take, emitted = random_steps(rng, slots, 40, config)
        state, reference = ScheduleTensors.allocate(slots, DEVICE), [ScheduleState()] * slots
        for t in range(take.shape[0]):
            fresh = np.flatnonzero(rng.random(slots) < 0.05)
            if fresh.size:  # reused slots: by index on odd steps, by mask on even ones
                state.reset(fresh.tolist() if t % 2 else as_tensor(np.isin(np.arange(slots), fresh), torch.bool))
                for i in fresh:
                    reference[i] = ScheduleState()
            active = rng.random(slots) < 0.9
            new, block_len = schedule_step_tensors(state, as_tensor(take[t], torch.bool),
                                                   as_tensor(emitted[t], torch.int64), config,
                                                   as_tensor(active, torch.bool))
            want = []
            for i in range(slots):
                if active[i]:
                    reference[i], b = step(reference[i], bool(take[t, i]), int(emitted[t, i]), config)
                    want.append(b)
                else:
                    want.append(0)
            assert block_len.tolist() == want, f"step {t} under {config}"
            assert states_of(new) == reference, f"state after step {t} under {config}"
            assert block_len.dtype == torch.int32 and block_len.shape == (slots,)
            state.copy_(new)


def test_schedule_on_slot_indexed_state():
    """vLLM keeps state per request slot and hands each step the batch's slots in its own order."""
    rng = np.random.default_rng(2)
    config = ScheduleConfig(stale=1)
    slots = 10
    state, reference = ScheduleTensors.allocate(slots, DEVICE), [ScheduleState()] * slots
    for t in range(60):
        rows = rng.permutation(slots)[: int(rng.integers(1, slots + 1))]
        take = rng.random(rows.size) < 0.8
        emitted = rng.choice([0, 7, 8, 16], rows.size)
        new, block_len = schedule_step_tensors(state.select(as_tensor(rows, torch.int64)),
                                               as_tensor(take, torch.bool), as_tensor(emitted, torch.int32), config)
        state.assign(as_tensor(rows, torch.int64), new)
        for j, i in enumerate(rows):
            reference[i], b = step(reference[i], bool(take[j]), int(emitted[j]), config)
            assert block_len[j].item() == b
        assert states_of(state) == reference


def test_qualify_matches_reference():
    config = ScheduleConfig(short=5)
    flags, emitted = [False, True] * 9, [e for e in range(9) for _ in (0, 1)]
    got = qualify_tensors(as_tensor(flags, torch.bool), as_tensor(emitted, torch.int32), config).tolist()
    assert got == [qualify(f, e, config) for f, e in zip(flags, emitted)]


schedule_configs = st.builds(ScheduleConfig, short=st.integers(1, 4), long=st.integers(4, 9),
                             sticky=st.integers(0, 4), entry_steps=st.integers(1, 3), stale=st.integers(0, 1),
                             mode=st.sampled_from(["adaptive", "adaptive", "short", "long"]))
step_inputs = st.lists(st.tuples(st.booleans(), st.integers(0, 10)), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(schedule_configs, st.lists(step_inputs, min_size=1, max_size=4))
def test_schedule_matches_reference_hypothesis(config, sequences):
    steps = max(len(s) for s in sequences)
    padded = [s + [(False, 0)] * (steps - len(s)) for s in sequences]
    state = ScheduleTensors.allocate(len(padded), DEVICE)
    blocks = []
    for t in range(steps):
        state, block_len = schedule_step_tensors(state, as_tensor([s[t][0] for s in padded], torch.bool),
                                                 as_tensor([s[t][1] for s in padded], torch.int32), config)
        blocks.append(block_len.tolist())
    for i, s in enumerate(padded):
        assert [b[i] for b in blocks] == simulate(s, config)


def test_unanimous_matches_reference_with_changing_batches():
    """HyperQwen's batch mode: the batch grows and shrinks (sticky only while it is one request)."""
    rng = np.random.default_rng(3)
    for config in SCHEDULE_GRID + [random_schedule_config(rng) for _ in range(10)]:
        slots = 6
        take, emitted = random_steps(rng, slots, 50, config)
        take |= rng.random(take.shape) < 0.5  # unanimity needs every request to qualify: make it happen
        state, reference = ScheduleTensors.allocate(slots, DEVICE), [ScheduleState()] * slots
        seen_alone = seen_long = False
        for t in range(take.shape[0]):
            if t % 8 == 0:  # a batch composition holds for a while, often a single request
                size = int(rng.choice([1, 1, 2, int(rng.integers(1, slots + 1))]))
                active = np.isin(np.arange(slots), rng.choice(slots, size, replace=False))
            rows = np.flatnonzero(active)
            new, block_len = step_unanimous_tensors(state, as_tensor(take[t], torch.bool),
                                                    as_tensor(emitted[t], torch.int32), config,
                                                    as_tensor(active, torch.bool))
            new_states, batch_len = step_unanimous([reference[i] for i in rows], take[t, rows].tolist(),
                                                   emitted[t, rows].tolist(), config)
            for i, s in zip(rows, new_states):
                reference[i] = s
            assert block_len.tolist() == [batch_len if a else 0 for a in active], f"step {t} under {config}"
            assert states_of(new) == reference, f"state after step {t} under {config}"
            state = new
            seen_alone |= rows.size == 1 and any(s.hold > 0 for s in new_states)
            seen_long |= batch_len == config.long and rows.size > 1
        if config.sticky > 0 and config.mode == "adaptive":
            assert seen_alone, f"no sticky hold at batch size 1 was exercised under {config}"
        if config.mode == "adaptive" and config.entry_steps == 1:
            assert seen_long, f"no unanimous long block was exercised under {config}"


def test_unanimous_without_a_mask_is_the_whole_batch():
    config = ScheduleConfig(sticky=2)
    rng = np.random.default_rng(4)
    for slots in (1, 3):
        take, emitted = random_steps(rng, slots, 40, config)
        state, reference = ScheduleTensors.allocate(slots, DEVICE), [ScheduleState()] * slots
        for t in range(take.shape[0]):
            state, block_len = step_unanimous_tensors(state, as_tensor(take[t], torch.bool),
                                                      as_tensor(emitted[t], torch.int32), config)
            reference, batch_len = step_unanimous(reference, take[t].tolist(), emitted[t].tolist(), config)
            assert block_len.tolist() == [batch_len] * slots and states_of(state) == reference


def test_unanimous_block_len_matches_reference():
    config = ScheduleConfig(short=3, long=9)
    rng = np.random.default_rng(5)
    for _ in range(200):
        wanted = rng.choice([3, 9], int(rng.integers(1, 7)), p=[0.2, 0.8])
        active = rng.random(wanted.size) < 0.7
        got = unanimous_block_len_tensors(as_tensor(wanted, torch.int32), config, as_tensor(active, torch.bool))
        want = unanimous_block_len(wanted[active].tolist(), config) if active.any() else config.short
        assert got.item() == want and got.shape == ()
        assert unanimous_block_len_tensors(as_tensor(wanted, torch.int32), config).item() == \
            unanimous_block_len(wanted.tolist(), config)


# Recorded traces -----------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """One request's recorded steps: the scheduler's inputs at each step and the block length recorded there."""

    source: str  # file, config, request (and run, concurrency, load)
    config: str
    take: list[bool]
    emitted_last: list[int]
    block: list[int]
    step_batches: list[int]  # batch size per step (1 when not recorded)


SHORT, LONG, LONGMIN = 7, 15, 6  # the recorded fused runs: draft_block 7, k 15, the shipped fusion set


def recorded_traces() -> list[Trace]:
    """Per-request step sequences of the recorded runs whose take flags can be recovered exactly.

    - `fused:k=15` runs (the shipped fusion set): with nstrong = nmin = longmin = 6 and agree 0, a match of at
      least 6 takes head and tail, so the take flag is match_len >= 6 and valid > 7; `valid` is not recorded for
      short steps, so the flag is taken as match_len >= 6 and the recorded block lengths confirm it (see
      test_recorded_fused_blocks_are_reproduced).
    - lookup runs with k = 15: the take flag the shipped fusion set gives for the recorded lookup proposal,
      match_len >= 6 and more than 7 tokens supplied.
    emitted_last is the previous step's emitted count (0 at the first step), as the fused proposer reads it off
    the history's growth; the context lengths confirm it.
    """
    pq = pytest.importorskip("pyarrow.parquet")
    traces = []
    recorded = (p for p in RESULTS.glob("*/*/*.parquet") if p.name in ("steps.parquet", "batch_steps.parquet"))
    for path in sorted(recorded):
        table = pq.read_table(path)
        if "config" not in table.column_names:
            continue
        keys = [c for c in ("config", "request", "run", "concurrency", "load") if c in table.column_names]
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for row in table.select(keys + ["step", "context_len", "proposed", "match_len", "emitted", "block"]
                                + (["batch"] if "batch" in table.column_names else [])).to_pylist():
            config = row["config"]
            if config.startswith("fused:k=15,") or re.match(r"(gpu-)?lookup:.*\bk=15\b", config):
                groups[tuple(row[c] for c in keys)].append(row)
        for key, rows in groups.items():
            rows.sort(key=lambda r: r["step"])
            where = path.relative_to(RESULTS)
            assert [r["step"] for r in rows] == list(range(len(rows))), f"{where} {key}: steps missing"
            emitted_last = [0] + [r["emitted"] for r in rows[:-1]]
            assert emitted_last[1:] == [b["context_len"] - a["context_len"] for a, b in zip(rows, rows[1:])]
            fused = key[0].startswith("fused:")
            take = [r["match_len"] >= LONGMIN and (fused or len(r["proposed"]) > SHORT) for r in rows]
            traces.append(Trace(f"{where} {key}", key[0], take, emitted_last, [r["block"] for r in rows],
                                [r.get("batch") or 1 for r in rows]))
    return traces


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    found = recorded_traces()
    assert sum(len(t.take) for t in found) > 5000, "the recorded step files are missing or were cut down"
    return found


def fused_schedule(trace: Trace) -> ScheduleConfig:
    sticky = re.search(r"\bsticky=(\d+)", trace.config)
    return ScheduleConfig(short=SHORT, long=LONG, sticky=int(sticky.group(1)) if sticky else ScheduleConfig.sticky)


def replay_in_slots(traces: list[Trace], config: ScheduleConfig, slots: int) -> list[list[int]]:
    """Run every trace through the tensor scheduler, `slots` requests at a time; a slot whose request ended is
    reset and takes the next one, empty slots are padding. Checks every step's block lengths and states against
    the reference and returns the tensor block lengths per trace."""
    state = ScheduleTensors.allocate(slots, DEVICE)
    reference = [ScheduleState()] * slots
    queue = iter(range(len(traces)))
    current: list[int | None] = [None] * slots
    position = [0] * slots
    blocks: list[list[int]] = [[] for _ in traces]
    while True:
        fresh = []
        for s in range(slots):
            if current[s] is None or position[s] == len(traces[current[s]].take):
                current[s], position[s] = next(queue, None), 0
                if current[s] is not None:
                    fresh.append(s)
                    reference[s] = ScheduleState()
        if all(c is None for c in current):
            return blocks
        if fresh:
            state.reset(fresh)
        active = [c is not None for c in current]
        take = [c is not None and traces[c].take[position[s]] for s, c in enumerate(current)]
        emitted = [traces[c].emitted_last[position[s]] if c is not None else 0 for s, c in enumerate(current)]
        new, block_len = schedule_step_tensors(state, as_tensor(take, torch.bool), as_tensor(emitted, torch.int32),
                                               config, as_tensor(active, torch.bool))
        got = block_len.tolist()
        for s, c in enumerate(current):
            if c is None:
                assert got[s] == 0
                continue
            reference[s], want = step(reference[s], take[s], emitted[s], config)
            assert got[s] == want, f"{traces[c].source} step {position[s]} under {config}"
            blocks[c].append(got[s])
            position[s] += 1
        assert fields_of(new) == field_tuples(reference), f"states under {config}"
        state.copy_(new)  # in place, as a captured graph would keep its buffers


def test_recorded_fused_blocks_are_reproduced(traces):
    """The engine's recorded block lengths, per-request mode: the reference with the recovered take flags gives
    them (so the recovery is right), and the tensor scheduler gives them too, replaying requests in shared slots."""
    fused = [t for t in traces if t.config.startswith("fused:") and "unanimous" not in t.config]
    assert len(fused) >= 20
    for sticky in sorted({fused_schedule(t).sticky for t in fused}):
        group = [t for t in fused if fused_schedule(t).sticky == sticky]
        config = fused_schedule(group[0])
        for t in group:
            assert simulate(zip(t.take, t.emitted_last), config) == t.block, f"recovered flags of {t.source}"
        assert replay_in_slots(group, config, slots=4) == [t.block for t in group]
    assert any(LONG in t.block and SHORT in t.block for t in fused)


def test_recorded_unanimous_batches_are_reproduced(traces):
    """HyperQwen's batch mode as recorded: requests started together, so step i of each is one engine step; the
    batch shrinks as requests finish. The tensor scheduler, with the batch as a mask over request slots, gives
    the recorded block of every step."""
    unanimous = [t for t in traces if "batch_mode=unanimous" in t.config]
    files = sorted({t.source.split()[0] for t in unanimous})
    assert len(files) >= 2
    for name in files:
        group = [t for t in unanimous if t.source.startswith(name + " ")]
        config = fused_schedule(group[0])
        state, reference = ScheduleTensors.allocate(len(group), DEVICE), [ScheduleState()] * len(group)
        for i in range(max(len(t.take) for t in group)):
            active = [i < len(t.take) for t in group]
            rows = [j for j, a in enumerate(active) if a]
            assert all(group[j].step_batches[i] == len(rows) for j in rows), f"{name} step {i}: batch composition"
            take = [a and t.take[i] for a, t in zip(active, group)]
            emitted = [t.emitted_last[i] if a else 0 for a, t in zip(active, group)]
            new, block_len = step_unanimous_tensors(state, as_tensor(take, torch.bool),
                                                    as_tensor(emitted, torch.int32), config,
                                                    as_tensor(active, torch.bool))
            new_states, want = step_unanimous([reference[j] for j in rows], [take[j] for j in rows],
                                              [emitted[j] for j in rows], config)
            for j, s in zip(rows, new_states):
                reference[j] = s
            recorded = {group[j].block[i] for j in rows}
            assert recorded == {want}, f"{name} step {i}: the reference does not give the recorded block"
            assert block_len.tolist() == [want if a else 0 for a in active], f"{name} step {i}"
            assert states_of(new) == reference
            state = new


def test_recorded_sequences_under_every_schedule_config(traces):
    """Real take-flag / emitted sequences (fused and lookup runs, HF engine and vLLM), each replayed under every
    combination of stale, sticky 0..4 and entry_steps 1..3: the tensor scheduler's every decision is the
    reference's."""
    assert len(traces) >= 100
    long_seen = 0
    for config in SCHEDULE_GRID:
        blocks = replay_in_slots(traces, config, slots=64)
        long_seen += sum(b.count(LONG) for b in blocks)
    assert long_seen > 1000, "the recorded sequences hardly ever reach the long block: they test little"


# No synchronisation, static shapes -----------------------------------------------------------------------------

HOST_READS = {"item", "cpu", "tolist", "numpy", "nonzero", "masked_select", "unique", "unique_consecutive",
              "bincount", "argwhere", "repeat_interleave", "synchronize"}


@pytest.mark.parametrize("module", [fused_rules, fused_step], ids=["fused_rules", "fused_step"])
def test_module_source_has_no_host_reads(module):
    """By construction: no method that copies a device value to the host or sizes a result by values, and no
    Python branch, loop or conversion on a tensor (conditions only read the config and shapes). The same check for
    the rules and for the per-step driver that strings them together."""
    tree = ast.parse(inspect.getsource(module))
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not calls & HOST_READS
    builtins = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func,
                                                                                                      ast.Name)}
    assert not builtins & {"bool", "int", "float", "list", "any", "all", "sum"}
    for node in ast.walk(tree):  # every condition reads the config, a shape, a None / dtype check or `compile`
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):  # (FusedStep's constructor flag, a Python bool)
            text = ast.unparse(node.test)
            assert re.search(r"config\.|\.shape|is None|is not None|\.dtype|\.dim\(\)|isinstance|^compile$", text), text


def test_output_shapes_do_not_depend_on_values():
    rng = np.random.default_rng(6)
    config = FusionConfig.articles()
    for valid, match in ((0, 0), (15, 16), (3, 8)):
        x = random_fusion_inputs(rng, config, 5, 15, 16)
        x.valid[:], x.match_len[:] = valid, match
        got = fuse_tensors(as_tensor(x.draft, torch.int64), as_tensor(x.lookup, torch.int64),
                           as_tensor(x.valid, torch.int32), as_tensor(x.match_len, torch.int32), config)
        assert [tuple(t.shape) for t in got] == [(5, 15), (5, 15), (5,), (5,), (5,), (5,)]
        assert [t.dtype for t in got] == [torch.int64, torch.int8, torch.int32, torch.bool, torch.bool, torch.bool]
    state = ScheduleTensors.allocate(5, DEVICE)
    for take in (True, False):
        new, block_len = schedule_step_tensors(state, as_tensor([take] * 5, torch.bool), as_tensor([8] * 5,
                                                                                                     torch.int32),
                                               ScheduleConfig())
        assert block_len.shape == (5,) and all(t.shape == (5,) for t in (new.run, new.hold, new.long, new.pending))


def test_preallocated_outputs_are_written_in_place():
    out = FusedTensors.allocate(8, 15, DEVICE)
    rng = np.random.default_rng(7)
    x = random_fusion_inputs(rng, FusionConfig(), 5, 15, 12)
    got = fuse_tensors(as_tensor(x.draft, torch.int64), as_tensor(x.lookup, torch.int64),
                       as_tensor(x.valid, torch.int32), as_tensor(x.match_len, torch.int32), FusionConfig(), out=out)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out))


def test_traces_into_one_graph():
    """torch.compile(fullgraph=True) refuses a Python branch on a tensor value and a shape sized by one (it no
    longer refuses `.item()` itself: the source scan above and the CUDA sync-debug test catch host reads)."""
    config, schedule = FusionConfig.articles(), ScheduleConfig(stale=1)
    x = random_fusion_inputs(np.random.default_rng(8), config, 6, 15, 12)
    args = (as_tensor(x.draft, torch.int64), as_tensor(x.lookup, torch.int64), as_tensor(x.valid, torch.int32),
            as_tensor(x.match_len, torch.int32))
    torch._dynamo.reset()
    fuse_graph = torch.compile(lambda *a: fuse_tensors(*a, config), fullgraph=True, backend="eager")
    assert all(torch.equal(a, b) for a, b in zip(fuse_graph(*args), fuse_tensors(*args, config)))

    def both_steps(run, hold, long, pending, take, emitted, active):
        state = ScheduleTensors(run, hold, long, pending)
        new, block_len = schedule_step_tensors(state, take, emitted, schedule, active)
        batch, batch_len = step_unanimous_tensors(state, take, emitted, schedule, active)
        return new.run, new.hold, new.long, new.pending, block_len, batch.hold, batch_len

    state = tensors_of([ScheduleState(run=2, hold=1, long=True, pending=True), ScheduleState(), ScheduleState()])
    inputs = (state.run, state.hold, state.long, state.pending, as_tensor([True, False, True], torch.bool),
              as_tensor([8, 3, 16], torch.int32), as_tensor([True, True, False], torch.bool))
    step_graph = torch.compile(both_steps, fullgraph=True, backend="eager")
    assert all(torch.equal(a, b) for a, b in zip(step_graph(*inputs), both_steps(*inputs)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_no_sync_and_graph_replay():
    """On the GPU: no synchronising call (sync-debug mode raises on one), and a captured CUDA graph replays the
    decisions for fresh inputs copied into its buffers."""
    config, schedule = FusionConfig.shipped(), ScheduleConfig(stale=1)
    rng = np.random.default_rng(9)
    batch, k = 16, 15
    x = random_fusion_inputs(rng, config, batch, k, 12)
    draft, lookup = as_tensor(x.draft, torch.int64), as_tensor(x.lookup, torch.int64)
    valid, match = as_tensor(x.valid, torch.int32), as_tensor(x.match_len, torch.int32)
    emitted = as_tensor(rng.choice([0, 8, 16], batch), torch.int32)
    out = FusedTensors.allocate(batch, k, DEVICE)
    state = ScheduleTensors.allocate(batch, DEVICE)
    block_out = torch.zeros(batch, dtype=torch.int32, device=DEVICE)

    def decode_step():
        fused = fuse_tensors(draft, lookup, valid, match, config, pad_token=PAD, out=out)
        new, block_len = schedule_step_tensors(state, fused.take_flag, emitted, schedule)
        state.copy_(new)
        block_out.copy_(block_len)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_step()  # warm-up outside capture, also under sync-debug
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    reference_states = [ScheduleState()] * batch
    state.reset(torch.ones(batch, dtype=torch.bool, device=DEVICE))
    for t in range(12):
        x = random_fusion_inputs(rng, config, batch, k, 12)
        for dst, src in ((draft, x.draft), (lookup, x.lookup), (valid, x.valid), (match, x.match_len),
                         (emitted, rng.choice([0, 8, 16], batch))):
            dst.copy_(as_tensor(src, dst.dtype))
        graph.replay()
        want = reference_fusion(x, config)
        got = {name: value.cpu().numpy() for name, value in out._asdict().items()}
        got["agree"] = want["agree"]
        assert_same_fusion(got, want, x, config)
        blocks = []
        for i, e in enumerate(emitted.tolist()):
            reference_states[i], b = step(reference_states[i], bool(want["take_flag"][i]), e, schedule)
            blocks.append(b)
        assert block_out.tolist() == blocks and states_of(state) == reference_states, f"replay {t}"


def test_fixed_modes_leave_state_alone():
    state = tensors_of([ScheduleState(run=1, hold=2, long=True, pending=True), ScheduleState()])
    for mode, length in (("short", 7), ("long", 15)):
        config = replace(ScheduleConfig(stale=1), mode=mode)
        new, block_len = schedule_step_tensors(state, as_tensor([True, True], torch.bool),
                                               as_tensor([8, 8], torch.int32), config)
        assert block_len.tolist() == [length, length] and states_of(new) == states_of(state)

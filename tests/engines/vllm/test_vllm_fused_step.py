"""The per-step driver (`hqlab.engines.vllm.fused_step.FusedStep`) against `FusedProposer`, decision for decision.

`FusedProposer` (lookup + drafter -> fusion rule -> scheduler -> clip) is the reference; `FusedStep` makes the same
step on device tensors for a batch, with the scheduler state in request slots. Both are driven through the same
multi-step generations:

- histories are real text (the workload document, one id per word or punctuation mark); every request copies part
  of its prompt and writes new text, so copy phases reach the long block and prose stays short;
- the drafter is a real proposer (a second context lookup with other settings, its head filled to draft_block),
  deterministic from the history, so both sides see the same drafts;
- the "target" accepts proposed tokens while they equal the request's fixed continuation, so a step emits 1 to
  k + 1 tokens;
- requests join and finish at different steps, in shuffled batch order, sit in chunked prefill (rows that do not
  sample, num_sampled 0) before their first sampling step, and slots are reused (fresh resets a slot that an old
  request left in the long block);
- per step and row: the proposed tokens and sources, padding after them, block length, take flag, head and tail
  decisions, the fused length, and the slot's whole scheduler state; under both batch modes, stale 0 and 1, sticky
  and entry_steps variations, fixed schedules, the articles' fusion set and the score rule, at batch 1 and 4.

Plus: no host reads in the module's source (the AST check of test_vllm_fused_rules.py), outputs in preallocated
buffers, config errors, and on CUDA a captured graph that replays the same decisions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pytest
import torch

from hqlab.config import ConfigError, LookupConfig
from hqlab.engines.vllm.fused_rules import SOURCE_NONE, ScheduleTensors
from hqlab.engines.vllm.fused_step import FusedStep
from hqlab.proposers.base import Proposal, Source
from hqlab.proposers.fused import FusedConfig, FusedProposer
from hqlab.proposers.lookup import LookupProposer
from hqlab.rules.fusion import fuse
from hqlab.workloads import DOCUMENT

PAD = 999_999  # a token id no word of the document gets


def state_fields(state: ScheduleTensors) -> list[torch.Tensor]:
    """run, hold, long, pending: [slots] each."""
    return [state.run, state.hold, state.long, state.pending]


def document_tokens(limit: int = 9000) -> np.ndarray:
    """The workload document as ids: one per word, punctuation mark or line break, in order of first appearance."""
    words = re.findall(r"\w+|[^\w\s]|\n", DOCUMENT.read_text(encoding="utf-8"))[:limit]
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(w, len(ids)) for w in words], dtype=np.int64)


DOC = document_tokens()


class LookupDrafter:
    """A deterministic `Drafter`: a second context lookup (short matches, earliest occurrence) as the model drafter.

    It agrees with the fused proposer's own lookup in unique copied text and guesses differently in prose. Where
    it finds less than its width, the head is filled with the last token of the history (fusion needs a full
    head)."""

    def __init__(self, draft_block: int) -> None:
        self.k = draft_block
        self.lookup = LookupProposer(LookupConfig(nmin=1, nmax=3, k=draft_block, policy="earliest"))
        self.config = self.lookup.config

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        out = []
        for h, budget, p in zip(histories, budgets, self.lookup.propose(histories, budgets)):
            n = min(self.k, int(budget))
            if n <= 0:
                out.append(Proposal.empty())
                continue
            tokens = np.full(n, h[-1], dtype=np.int64)
            tokens[:p.valid] = p.tokens
            out.append(Proposal(tokens, np.full(n, Source.DRAFT, dtype=np.int8)))
        return out

    exact = propose  # every draft is exact


@dataclass
class Request:
    name: str
    prompt: np.ndarray
    continuation: np.ndarray  # what the target emits, token by token
    join: int  # the step it arrives at
    prefill: int  # calls before its first sampling step (chunked prefill: num_sampled 0)
    slot: int = -1
    history: list[int] = field(default_factory=list)
    pos: int = 0  # continuation tokens emitted so far
    emitted: int = 0  # tokens emitted at its last step
    done: bool = False


def make_requests(rng: np.random.Generator, count: int, spread: int, copy: tuple[int, int],
                  prose: tuple[int, int]) -> list[Request]:
    """Each continuation mixes prose (new document text) and a copy of a part of the prompt (`copy` and `prose`:
    their length ranges), in either order, so requests enter and leave the long block; even-numbered ones finish
    inside a copy and leave a dirty slot behind for the next request."""
    out = []
    for i in range(count):
        length = int(rng.integers(*copy))
        start = int(rng.integers(0, 40))
        p = start + length + int(rng.integers(0, 40))  # the copied part lies inside the prompt
        a = int(rng.integers(0, DOC.size - 3000))
        b = a + p + int(rng.integers(200, 1500))
        parts = (DOC[a + start:a + start + length], DOC[b:b + int(rng.integers(*prose))])
        out.append(Request(f"req{i}", DOC[a:a + p], np.concatenate(parts[::-1] if i % 2 == 0 else parts),
                           join=int(rng.integers(0, spread)) if i else 0, prefill=int(rng.integers(0, 4))))
    return out


@dataclass
class Stats:
    steps: int = 0
    blocks: set[int] = field(default_factory=set)
    emitted: set[int] = field(default_factory=set)
    idle_rows: int = 0
    dirty_reuses: int = 0  # fresh requests in a slot whose state was not the initial one
    long_shared: int = 0  # steps that verified the long block for more than one sampling request
    take_flags: set[bool] = field(default_factory=set)


def simulate(config: FusedConfig, *, max_num_reqs: int, requests: int, seed: int,
             copy: tuple[int, int] = (40, 90), prose: tuple[int, int] = (15, 45)) -> Stats:
    """Run the reference and the driver side by side over whole generations; fail at the first difference."""
    rng = np.random.default_rng(seed)
    reqs = make_requests(rng, requests, spread=40 * requests // max_num_reqs, copy=copy, prose=prose)
    drafter = LookupDrafter(config.draft_block)
    reference = FusedProposer(config, drafter=drafter)
    lookup = LookupProposer(config.lookup_config())  # the reference's own lookup, for the driver's inputs
    driver = FusedStep(config, max_num_reqs=max_num_reqs, pad_token=PAD, device="cpu")
    k, width = config.k, config.draft_block
    free, stats = list(range(max_num_reqs)), Stats()

    for t in range(2000):
        for r in reqs:  # admission: a free slot, picked at random so slots are reused in any order
            if r.slot < 0 and not r.done and r.join <= t and free:
                r.slot = free.pop(int(rng.integers(len(free))))
        batch = [r for r in reqs if r.slot >= 0]
        if not batch:
            if all(r.done for r in reqs):
                break
            continue
        batch = [batch[i] for i in rng.permutation(len(batch))]  # vLLM's row order is its own

        num_sampled, fresh = [], []
        for r in batch:
            if r.prefill > 0:  # a prompt chunk: nothing sampled, nothing to propose
                r.prefill -= 1
                num_sampled.append(0), fresh.append(False)
            elif not r.history:  # the last prompt chunk sampled the first token: the first sampling step
                r.history, r.pos = [*r.prompt, int(r.continuation[0])], 1
                # vLLM counts that 1 token; the reference counts 0 at a first call, and so must the driver,
                # whatever the count (one that would qualify on odd steps)
                num_sampled.append(1 if t % 2 else k + 1), fresh.append(True)
            else:
                num_sampled.append(r.emitted), fresh.append(False)
        sampling = [r for r, s in zip(batch, num_sampled) if s > 0]
        histories = [np.asarray(r.history, dtype=np.int64) for r in sampling]
        # a step where nobody samples has no reference call (its unanimous mode refuses an empty batch)
        proposals = reference.propose(histories, [k] * len(sampling), [r.name for r in sampling]) if sampling else []
        by_name = dict(zip([r.name for r in sampling], proposals))

        # the driver's inputs: the same lookup and drafter, junk wherever a row does not sample or past `valid`
        n = len(batch)
        lookup_tokens = rng.integers(0, 50, (n, k))
        lookup_valid, match_len = rng.integers(0, k + 1, n), rng.integers(0, 13, n)
        drafts = rng.integers(0, 50, (n, width))
        looked = dict(zip([r.name for r in sampling], lookup.propose(histories, [k] * len(sampling))))
        drafted = dict(zip([r.name for r in sampling], drafter.propose(histories, [width] * len(sampling))))
        for i, r in enumerate(batch):
            if r.name in looked:
                lk = looked[r.name]
                junk = t % 4  # what sits past valid must never matter
                lookup_tokens[i] = -1 if junk == 0 else PAD if junk == 1 else lookup_tokens[i]
                if junk == 3:  # imitates agreement with the drafter past valid
                    lookup_tokens[i, :width] = drafted[r.name].tokens
                lookup_tokens[i, :lk.valid] = lk.tokens
                lookup_valid[i], match_len[i], drafts[i] = lk.valid, lk.match_len, drafted[r.name].tokens
        slots = [r.slot for r in batch]
        before = [part.clone() for part in state_fields(driver.state)]
        out = driver(torch.tensor(slots, dtype=torch.int32 if t % 2 else torch.int64),
                     torch.tensor(num_sampled, dtype=torch.int32), torch.tensor(fresh),
                     torch.tensor(lookup_tokens, dtype=torch.int64), torch.tensor(lookup_valid, dtype=torch.int32),
                     torch.tensor(match_len, dtype=torch.int64 if t % 3 else torch.int32),
                     torch.tensor(drafts, dtype=torch.int64))

        assert out.shape == (n, k) and out.data_ptr() == driver.tokens.data_ptr()
        got = {name: getattr(driver, name)[:n].numpy() for name in
               ("tokens", "sources", "num_tokens", "block_len", "n_proposed", "take_flag", "head_taken",
                "tail_taken")}
        state = [part.numpy() for part in state_fields(driver.state)]
        for i, r in enumerate(batch):
            where = f"step {t}, row {i} ({r.name}, slot {r.slot}) under {config}"
            row = {name: value[i] for name, value in got.items()}
            if r.name not in by_name:
                stats.idle_rows += 1
                assert row["tokens"].tolist() == [PAD] * k and row["sources"].tolist() == [SOURCE_NONE] * k, where
                assert (row["num_tokens"], row["block_len"], row["n_proposed"]) == (0, 0, 0), where
                assert not (row["take_flag"] or row["head_taken"] or row["tail_taken"]), where
                assert [int(f[r.slot]) for f in state] == [int(f[r.slot]) for f in before], where
                continue
            p = by_name[r.name]
            m = p.valid
            assert row["num_tokens"] == m, where
            assert row["tokens"][:m].tolist() == p.tokens.tolist(), where
            assert row["sources"][:m].tolist() == p.sources.tolist(), where
            assert row["tokens"][m:].tolist() == [PAD] * (k - m), where
            assert row["sources"][m:].tolist() == [SOURCE_NONE] * (k - m), where
            assert row["block_len"] == p.extra["block"], where
            for flag in ("take_flag", "head_taken", "tail_taken"):
                assert bool(row[flag]) == p.extra[flag], f"{flag} at {where}"
            lk, dr = looked[r.name], drafted[r.name]
            f = fuse(dr.tokens, lk.tokens, lk.match_len, lk.valid, k, config.fusion_config())
            assert row["n_proposed"] == f.tokens.shape[0], where
            assert driver.draft_valid[i] == p.extra["drafted"], where
            s = reference.states[r.name][0]
            assert [int(x[r.slot]) for x in state] == [s.run, s.hold, int(s.long), int(s.pending)], where
            if fresh[i]:
                stats.dirty_reuses += [int(x[r.slot]) for x in before] != [0, 0, 0, 0]
            stats.blocks.add(int(row["block_len"]))
            stats.take_flags.add(bool(row["take_flag"]))

        for r in sampling:  # the target: accept while the proposal follows the continuation, then one more token
            tokens = by_name[r.name].tokens.tolist()
            rest = r.continuation[r.pos:].tolist()
            accepted = next((j for j, (a, b) in enumerate(zip(tokens, rest)) if a != b), min(len(tokens), len(rest)))
            r.emitted = min(accepted + 1, len(rest))
            r.history.extend(rest[:r.emitted])
            r.pos += r.emitted
            stats.emitted.add(r.emitted)
            if r.pos == r.continuation.size:  # finished: the slot is free for a later request
                r.done = True
                free.append(r.slot)
                r.slot = -1
        stats.steps += 1
        stats.long_shared += sum(by_name[r.name].extra["block"] == k for r in sampling) > 1
    assert all(r.done for r in reqs), "the simulation did not finish every request"
    return stats


# Length ranges of the copied and the prose part of each continuation. Unanimous batches verify the long block only
# while every request copies: mostly-copy continuations make that happen often enough to test.
MIXED = {"copy": (40, 90), "prose": (15, 45)}
MOSTLY_COPY = {"copy": (150, 300), "prose": (3, 10)}

# (names sort after the older cases: each case's seed is its place in sorted(CASES))
CASES = {
    "shipped": (FusedConfig(), MIXED),
    "stale": (FusedConfig(stale=1), MIXED),
    "sticky0-entry1": (FusedConfig(sticky=0, entry_steps=1), MIXED),
    "sticky1-entry3-stale": (FusedConfig(sticky=1, entry_steps=3, stale=1), MIXED),
    "sticky5": (FusedConfig(sticky=5), MIXED),
    "unanimous": (FusedConfig(batch_mode="unanimous"), MOSTLY_COPY),
    "unanimous-stale": (FusedConfig(batch_mode="unanimous", stale=1, entry_steps=1), MOSTLY_COPY),
    "unanimous-mixed": (FusedConfig(batch_mode="unanimous", sticky=1), MIXED),
    "articles": (FusedConfig(nstrong=8, agree=2), MIXED),
    "score": (FusedConfig(rule="score"), MIXED),
    "short": (FusedConfig(schedule="short"), MIXED),
    "long": (FusedConfig(schedule="long"), MIXED),
    "k10-block4": (FusedConfig(k=10, draft_block=4, nmax=8, sticky=2), MIXED),
}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_matches_fused_proposer_step_for_step(case, batch):
    config, workload = CASES[case]
    stats = simulate(config, max_num_reqs=batch, requests=3 if batch == 1 else 8,
                     seed=sorted(CASES).index(case) * 10 + batch, **workload)
    # the simulations reach what the comparisons are about (else they would test little)
    assert stats.idle_rows > 0 and stats.take_flags == {False, True}, stats
    longest = config.draft_block if config.schedule == "short" else config.k
    assert 1 in stats.emitted and max(stats.emitted) == longest + 1, stats.emitted
    if config.schedule == "adaptive":
        assert stats.blocks == {config.draft_block, config.k}, stats.blocks
        assert stats.dirty_reuses > 0, "no slot was reused after a request that left it in a non-initial state"
        if workload is MOSTLY_COPY or config.batch_mode == "per-request":
            assert batch == 1 or stats.long_shared > 0, "the long block never ran for several requests at once"
    else:
        assert stats.blocks == {longest}, stats.blocks


def test_budget_zero_rows_leave_every_slot_alone():
    """Rows that do not sample may be batch padding: slot -1, or a slot a sampling row of the same step uses."""
    config = FusedConfig(k=4, draft_block=2)
    driver = FusedStep(config, max_num_reqs=3, pad_token=PAD, device="cpu")
    driver.state.run[:] = torch.tensor([1, 2, 0], dtype=torch.int32)
    driver.state.long[:] = torch.tensor([False, True, False])
    lookup = torch.tensor([[5, 6, 7, 8]] * 3)
    out = driver(torch.tensor([1, -1, 1]), torch.tensor([0, 0, 3], dtype=torch.int32),
                 torch.tensor([False, False, False]), lookup, torch.tensor([4, 4, 4]), torch.tensor([9, 9, 9]),
                 torch.tensor([[5, 6]] * 3))
    assert out.tolist() == [[PAD] * 4, [PAD] * 4, [5, 6, 7, 8]]
    assert driver.block_len[:3].tolist() == [0, 0, 4]
    # slot 1 was long (hold 0): the sampling row qualified (take flag, 3 emitted = 1 + short), so it stays long
    assert driver.state.run.tolist() == [1, 3, 0] and driver.state.long.tolist() == [False, True, False]
    assert driver.state.hold.tolist() == [0, config.sticky, 0]


def test_fresh_resets_a_reused_slot():
    config = FusedConfig(k=4, draft_block=2, stale=1)
    driver = FusedStep(config, max_num_reqs=2, pad_token=PAD, device="cpu")
    for part in state_fields(driver.state):
        part.fill_(1)
    lookup = torch.tensor([[5, 6, 7, 8]] * 2)
    driver(torch.tensor([1, 0]), torch.tensor([5, 3], dtype=torch.int32), torch.tensor([True, False]), lookup,
           torch.tensor([4, 4]), torch.tensor([9, 9]), torch.tensor([[5, 6]] * 2))
    # slot 1: a new request; stale = 1 reads the fresh state's pending False, and keeps this step's flag, which
    # does not qualify: the emitted count of a first step is 0, whatever num_sampled says
    assert [int(part[1]) for part in state_fields(driver.state)] == [0, 0, 0, 0]
    assert driver.block_len[:2].tolist() == [2, 4]  # slot 0 kept its long block (pending True read)


def test_outputs_stay_in_preallocated_buffers():
    config = FusedConfig()
    driver = FusedStep(config, max_num_reqs=4, pad_token=PAD, device="cpu")
    buffers = {name: getattr(driver, name).data_ptr() for name in
               ("tokens", "sources", "num_tokens", "block_len", "n_proposed", "take_flag", "head_taken",
                "tail_taken")}
    state = [part.data_ptr() for part in state_fields(driver.state)]
    rng = np.random.default_rng(0)
    for n in (1, 4, 2):
        out = driver(torch.arange(n), torch.full((n,), 8, dtype=torch.int32), torch.zeros(n, dtype=torch.bool),
                     torch.tensor(rng.integers(0, 9, (n, config.k))), torch.full((n,), config.k),
                     torch.full((n,), 12), torch.tensor(rng.integers(0, 9, (n, config.draft_block))))
        assert out.shape == (n, config.k) and out.dtype == torch.int64
        assert {name: getattr(driver, name).data_ptr() for name in buffers} == buffers
        assert [part.data_ptr() for part in state_fields(driver.state)] == state


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="max_num_reqs must be >= 1"):
        FusedStep(FusedConfig(), max_num_reqs=0, pad_token=PAD, device="cpu")
    with pytest.raises(ConfigError, match="pad_token must be a token id >= 0"):
        FusedStep(FusedConfig(), max_num_reqs=4, pad_token=-1, device="cpu")
    with pytest.raises(ConfigError, match="skip=2 is the lab proposer's host-proven drafter skip"):
        FusedStep(FusedConfig(skip=2), max_num_reqs=4, pad_token=PAD, device="cpu")
    driver = FusedStep(FusedConfig(k=4, draft_block=2), max_num_reqs=2, pad_token=PAD, device="cpu")
    args = (torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.bool), torch.zeros(3, 4, dtype=torch.int64),
            torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_num_reqs"):
        driver(torch.arange(3), *args)
    with pytest.raises(ValueError, match="lookup_tokens"):
        driver(torch.arange(2), args[0][:2], args[1][:2], torch.zeros(2, 5, dtype=torch.int64), args[3][:2],
               args[4][:2], args[5][:2])


def test_the_compiled_rule_decides_as_the_eager_one():
    """`compile=True` (gpu-fused's `compile_rule`) runs the same operations through torch.compile: over random steps
    of changing batches every buffer and the slot state equal the eager driver's."""
    config = FusedConfig(k=8, draft_block=2, stale=1, sticky=2, nmin_tail=1)
    eager = FusedStep(config, max_num_reqs=4, pad_token=PAD, device="cpu")
    compiled = FusedStep(config, max_num_reqs=4, pad_token=PAD, device="cpu", compile=True)
    names = ("tokens", "sources", "num_tokens", "block_len", "n_proposed", "take_flag", "head_taken", "tail_taken",
             "draft_valid")
    rng = np.random.default_rng(5)
    started: set[int] = set()
    for t in range(40):
        n = int(rng.choice([3, 1, 4]))
        slots = rng.permutation(4)[:n]
        fresh = np.array([int(s) not in started for s in slots])
        started |= {int(s) for s in slots}
        sampled = np.where(rng.random(n) < 0.15, 0, rng.integers(1, config.k + 2, n))
        match_len = rng.choice([0, 1, 3, 6, 12], n)
        valid = np.where(match_len > 0, rng.integers(0, config.k + 1, n), 0)
        args = (torch.tensor(slots), torch.tensor(sampled, dtype=torch.int32), torch.tensor(fresh),
                torch.tensor(rng.integers(0, 4, (n, config.k))), torch.tensor(valid, dtype=torch.int32),
                torch.tensor(match_len, dtype=torch.int32), torch.tensor(rng.integers(0, 4, (n, config.draft_block))))
        want, got = eager(*args), compiled(*args)
        assert torch.equal(got, want), t
        for name in names:
            assert torch.equal(getattr(compiled, name)[:n], getattr(eager, name)[:n]), (t, name)
        for a, b in zip(state_fields(compiled.state), state_fields(eager.state)):
            assert torch.equal(a, b), t


# The host-read check of fused_step.py is test_vllm_fused_rules.py::test_module_source_has_no_host_reads.


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch_mode, compile", [("per-request", False), ("unanimous", False),
                                                 ("per-request", True)])
def test_cuda_graph_replays_the_eager_decisions(batch_mode, compile):
    """On the GPU, under sync-debug "error": the step, captured once, replays what the driver run eagerly on the
    CPU decides, step after step, with the slot state carried in the captured buffers (also compiled,
    gpu-fused's `compile_rule`)."""
    config = FusedConfig(stale=1, sticky=2, batch_mode=batch_mode)
    device = torch.device("cuda")
    eager = FusedStep(config, max_num_reqs=4, pad_token=PAD, device="cpu")
    graphed = FusedStep(config, max_num_reqs=4, pad_token=PAD, device=device, compile=compile)
    n, k, width = 4, config.k, config.draft_block
    inputs = [torch.zeros(n, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int32, device=device),
              torch.zeros(n, dtype=torch.bool, device=device), torch.zeros(n, k, dtype=torch.int64, device=device),
              torch.zeros(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device),
              torch.zeros(n, width, dtype=torch.int64, device=device)]
    if compile:
        graphed(*inputs)  # compiling may read values back; the compiled step itself must not
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graphed(*inputs)  # warm-up outside the capture, also under sync-debug
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for part in state_fields(graphed.state):
        part.zero_()

    rng = np.random.default_rng(11)
    blocks: set[int] = set()
    for t in range(60):
        copying = rng.random(n) < 0.7
        lookup = rng.integers(0, 5, (n, k))
        draft = np.where(copying[:, None], lookup[:, :width], rng.integers(0, 5, (n, width)))
        step_inputs = [rng.permutation(4)[:n], np.where(copying, rng.choice([8, 16], n), rng.integers(0, 17, n)),
                       rng.random(n) < 0.1, lookup, np.where(copying, k, rng.integers(0, k + 1, n)),
                       np.where(copying, 12, rng.integers(0, 13, n)), draft]
        for dst, src in zip(inputs, step_inputs):
            dst.copy_(torch.as_tensor(src, dtype=dst.dtype))
        graph.replay()
        want = eager(*(torch.as_tensor(src, dtype=dst.dtype) for dst, src in zip(inputs, step_inputs)))
        assert torch.equal(graphed.tokens[:n].cpu(), want), f"step {t}"
        for name in ("sources", "num_tokens", "block_len", "take_flag"):
            assert torch.equal(getattr(graphed, name)[:n].cpu(), getattr(eager, name)[:n]), f"{name} at step {t}"
        for a, b in zip(state_fields(graphed.state), state_fields(eager.state)):
            assert torch.equal(a.cpu(), b), f"state at step {t}"
        blocks.update(eager.block_len[:n].tolist())
    assert blocks == {0, config.draft_block, config.k}, blocks

"""`hqlab.bench.vllm.fused_replay_check`: a gpu-fused run's tokens/step against the lab's replay of the same fused
config over the same outputs. Here the "live" run is the lab's own fused proposer with the real 0.5B drafter run
step by step (not teacher-forced), so the check must find no difference; the same records under another config's
label (schedule=short, which never takes the long block) must show one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hqlab.bench.vllm import fused_replay_check
from hqlab.bench.vllm_runs import Run
from hqlab.config import ConfigError, resolve_spec
from hqlab.proposers.fused import FusedProposer
from hqlab.replay import replay
from hqlab.trace import Generation

DOC = Path(__file__).resolve().parents[2] / "data" / "documents" / "handbook.md"


@pytest.fixture(scope="module")
def model():
    """The 0.5B's tokenizer and its float32 greedy drafter on the CPU (loaded once for this file)."""
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.replay.teacher import load_drafter

    tokenizer = AutoTokenizer.from_pretrained(models.prepare("qwen2.5-coder-0.5b"))
    return tokenizer, load_drafter("qwen2.5-coder-0.5b", device="cpu", dtype="float32")


def copy_request(tokenizer, copied: int, tail: int) -> tuple[list[int], list[int]]:
    """A prompt holding a passage of the handbook, and an output that copies its first `copied` tokens, then
    continues with `tail` tokens of text the prompt does not hold."""
    text = DOC.read_text()
    passage = tokenizer(text[3000:3300]).input_ids
    prompt = tokenizer("Copy this:\n").input_ids + passage + tokenizer("\nCopy:\n").input_ids
    return prompt, passage[:copied] + tokenizer(text[7000:7300]).input_ids[:tail]


@pytest.mark.slow
def test_the_replay_check_finds_live_fused_runs_equal_and_a_mislabelled_one_not(model):
    tokenizer, drafter = model
    prompt, output = copy_request(tokenizer, 30, 12)

    def live(spec: str) -> Generation:
        config = resolve_spec(spec, {"fused": FusedProposer})[1]
        records = replay(prompt, output, FusedProposer(config, drafter=drafter), max_new_tokens=len(output),
                         request="copy-1")
        return Generation("copy-1", len(prompt), list(output), "length", 0.0, 1.0, 1.0, records)

    adaptive = live("fused:k=7,draft_block=3,nmax=32,policy=earliest")
    skipping = live("fused:k=7,draft_block=3,nmax=32,policy=earliest,skip=1,skip_on=head")
    runs = [Run("gpu-fused:k=7,draft_block=3,nmax=32,policy=earliest", "copy-1", "copy", 0, adaptive),
            Run("gpu-fused:k=7,draft_block=3,nmax=32,policy=earliest,schedule=short", "copy-1", "copy", 0, adaptive),
            Run("none", "copy-1", "copy", 0, adaptive),
            Run("gpu-fused:k=7,draft_block=3,nmax=32,policy=earliest,skip=1,skip_on=head", "copy-1", "copy", 0,
                skipping)]
    table = fused_replay_check(runs, [("copy-1", "copy", prompt)], drafter, max_new_tokens=len(output),
                               progress=False)
    by_config = {row["config"]: row for row in table.iter_rows(named=True)}
    assert set(by_config) == {runs[0].config, runs[1].config, runs[3].config}  # `none` is not a fused config
    assert by_config[runs[3].config]["difference"] == 0  # skipping replayed with its skip setting
    assert by_config[runs[3].config]["drafter_share"] < 1 == by_config[runs[0].config]["drafter_share"]
    assert by_config[runs[0].config]["difference"] == 0  # the same rule over the same outputs
    assert by_config[runs[0].config]["tokens_per_step"] > 2  # fusion helped: more than a token and a half a step
    # the adaptive run's records under the label of schedule=short: the check tells them apart
    assert by_config[runs[1].config]["difference"] > 0


class Flipping:
    """A drafter that drafts what `inner` drafts, but the trace's true token at `position` of its draft where
    `inner`'s is wrong there after a true prefix and a history of at least `start` tokens (as a GPU drafter whose
    bf16 argmax breaks near ties otherwise than the replay's float32 one), and logs the tokens it drafted after each
    history length."""

    name = "draft"

    def __init__(self, inner, seq: list[int], start: int, position: int = 0) -> None:
        self.inner, self.seq, self.start, self.position = inner, seq, start, position
        self.config, self.k = inner.config, inner.k
        self.blocks: dict[int, list[int]] = {}
        self.flipped = 0

    def propose(self, histories, budgets, keys=None):
        props = self.inner.propose(histories, budgets, keys)
        for h, p in zip(histories, props):
            n, i = len(h), self.position
            if len(p.tokens) == 0:
                continue
            if (i < len(p.tokens) and self.start <= n and n + i < len(self.seq)
                    and [int(t) for t in p.tokens[:i]] == self.seq[n:n + i] and int(p.tokens[i]) != self.seq[n + i]):
                p.tokens[i] = self.seq[n + i]
                self.flipped += 1
            self.blocks[n] = [int(t) for t in p.tokens]
        return props

    exact = propose


def replay_row(records, flipping: Flipping, label: str, prompt, output, drafter, tokens: str):
    """`fused_replay_check`'s row for a live run whose records carry the drafter's tokens: none, the head only
    (as run fn2's records did) or the whole block (`StepRecord.drafter_tokens`)."""
    for r in records:
        block = flipping.blocks.get(r.context_len + 1, [])
        r.drafter_tokens = {"none": [], "head": block[:1], "block": block}[tokens]
    run = Run(label, "copy-1", "copy", 0, Generation("copy-1", len(prompt), list(output), "length", 0.0, 1.0, 1.0,
                                                     records))
    return fused_replay_check([run], [("copy-1", "copy", prompt)], drafter, max_new_tokens=len(output),
                              progress=False).row(0, named=True)


@pytest.mark.slow
def test_the_replay_takes_the_runs_own_drafter_tokens_where_its_records_carry_them(model):
    """A live run whose drafter drafts another head than the replay's at some steps (`Flipping`): without its
    drafter tokens the replay's tokens/step differ; with them (`StepRecord.drafter_tokens`, as vLLM's records carry
    them) the replay agrees exactly and counts the tokens where its own drafter would have drafted another, with
    its margin there (its top logit over the forced token's)."""
    from hqlab.replay.teacher import TeacherForcedDrafter

    tokenizer, drafter = model
    prompt, output = copy_request(tokenizer, 20, 24)
    spec = "fused:k=7,draft_block=1,nmax=32,policy=earliest,schedule=long,nmin_tail=1"
    flipping = Flipping(drafter, prompt + output, len(prompt) + 20)
    config = resolve_spec(spec, {"fused": FusedProposer})[1]
    records = replay(prompt, output, FusedProposer(config, drafter=flipping), max_new_tokens=len(output),
                     request="copy-1")
    assert flipping.flipped >= 1
    label = "gpu-" + spec  # the same rules, labelled as vLLM's run would be
    plain = replay_row(records, flipping, label, prompt, output, drafter, "none")
    forced = replay_row(records, flipping, label, prompt, output, drafter, "block")
    assert plain["difference"] != 0 and plain["forced_drafts"] == 0 and plain["drafter_flips"] == 0
    assert forced["difference"] == 0 and forced["forced_drafts"] >= forced["drafter_flips"] >= 1
    assert forced["flip_margin_max"] > 0  # the replay's drafter preferred its own token there
    seq = prompt + output
    teacher = TeacherForcedDrafter(drafter, prompt, output, forced={len(prompt): [0]})
    assert teacher.propose([seq[:len(prompt) + 1]], [1])[0].tokens.tolist() == [0]
    assert [f[0] for f in teacher.flips] == [len(prompt)]
    with pytest.raises(ConfigError, match="prefixes the trace does not have"):
        TeacherForcedDrafter(drafter, prompt, output, forced={len(prompt) + len(output): [1]})


@pytest.mark.slow
def test_a_drafter_block_is_replayed_exactly_only_with_all_its_tokens(model):
    """A config drafting three tokens a step, whose live drafter drafts another second token than the replay's at
    some steps: with the head token alone (run fn2's records) the replay still differs, with the whole block it
    agrees exactly. A forced block is known whole, past its first token off the trace too."""
    from hqlab.replay.teacher import TeacherForcedDrafter

    tokenizer, drafter = model
    prompt, output = copy_request(tokenizer, 20, 24)
    spec = "fused:k=7,draft_block=3,nmax=32,policy=earliest"
    flipping = Flipping(drafter, prompt + output, len(prompt) + 20, position=1)
    config = resolve_spec(spec, {"fused": FusedProposer})[1]
    records = replay(prompt, output, FusedProposer(config, drafter=flipping), max_new_tokens=len(output),
                     request="copy-1")
    assert flipping.flipped >= 1
    label = "gpu-" + spec
    head = replay_row(records, flipping, label, prompt, output, drafter, "head")
    block = replay_row(records, flipping, label, prompt, output, drafter, "block")
    assert head["difference"] != 0 and head["drafter_flips"] == 0  # its heads are the replay drafter's own
    assert block["difference"] == 0 and block["drafter_flips"] >= 1
    seq = prompt + output
    wrong = (seq[len(prompt) + 1] + 1) % 1000
    teacher = TeacherForcedDrafter(drafter, prompt, output, forced={len(prompt): [seq[len(prompt) + 1], wrong, 7]})
    draft = teacher.propose([seq[:len(prompt) + 1]], [3])[0]
    assert draft.tokens.tolist() == [seq[len(prompt) + 1], wrong, 7] and draft.extra["known"] == 3

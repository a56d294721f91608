"""Batched decoding with per-request verify lengths, the model drafter and the fused proposer on the real 0.5B.

- The ragged KV cache scores a batch with holes exactly like each request alone (fp32).
- The drafter's incremental KV sync drafts what a fresh drafter would from the same history.
- Batched runs are token-identical to the batch-1 no-speculation reference: the fused proposer with one block for
  the whole batch (unanimous), and the soak test of SPEC §3: two rounds of 4 concurrent requests (copy, summary,
  code, qa) over one document with one fused proposer and the adaptive block per request; the copy request's block
  goes long while a neighbour's stays short in the same steps, and the copy text is identical across rounds and
  equal to the reference. (The engine's batched verify is the same whatever proposes, and the lookup proposer
  drafts each request of a batch from its own history alone, as at batch 1: a batched lookup run checked nothing
  these runs do not.)
- Replay reproduces a live run step by step, for the drafter alone and for the fused proposer with the most state
  (adaptive block, sticky exit: its drafter cache, lookup and block decisions all carry over between steps).
- Teacher-forced replay (one drafter pass over the trace) gives the same steps as drafting for real, for three
  fused rules, each on a copy or a summary request.

The drafter here is the 0.5B itself with its weights rounded to bf16, computed in fp32, drafting for the fp32
target: the same tokenizer, a different model (its drafts are rejected sometimes, as bf16 arithmetic's are), and
fast on any CPU (a CPU without bf16 arithmetic ran the bf16 drafter 2.3x slower: 179 s against 77 s for one round of
the soak). The 1.5B/0.5B pair runs in the benchmark.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hqlab.config import DecodeConfig
from hqlab.bench.lossless import NEAR_TIE_TOL, compare
from hqlab.proposers.draft import DraftConfig, DraftProposer
from hqlab.proposers.fused import FusedConfig, FusedProposer
from hqlab.replay import replay

pytestmark = pytest.mark.slow

DECODE = DecodeConfig(max_new_tokens=48)
TASKS = ["copy", "summary", "code", "qa"]


@pytest.fixture(scope="module")
def drafter_model():
    """The 0.5B with bf16-rounded weights in fp32 (a copy: load_drafter's fp32 model is shared, the teacher test
    below drafts with it unrounded)."""
    from hqlab import models

    model, _tokenizer, _info = models.load("qwen2.5-coder-0.5b", device="cpu", dtype="float32")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model.eval()


@pytest.fixture(scope="module")
def prompts(fp32_suite):
    return [fp32_suite.ids(t) for t in TASKS]


@pytest.fixture(scope="module")
def references(fp32_suite):
    """The batch-1 no-speculation outputs, shared with the lossless tests."""
    assert fp32_suite.decode == DECODE
    return [fp32_suite.reference(t) for t in TASKS]


def fused(drafter_model, **kw) -> FusedProposer:
    config = FusedConfig(dtype="float32", device="cpu", **kw)
    return FusedProposer(config, drafter=DraftProposer(config.draft_config(), model=drafter_model))


def assert_lossless(refs, gens, label):
    tol = NEAR_TIE_TOL["float32"]
    for ref, gen in zip(refs, gens):
        result = compare(ref.output_ids, ref.margins, gen.output_ids, tol)
        assert result.status == "identical", (label, gen.request, result)


def test_ragged_cache_matches_rows_alone(engine_05b_fp32, prompts):
    """Rows of different lengths, blocks of different lengths, rollbacks: logits equal each row run alone."""
    from hqlab.models.kv import RaggedCache

    eng = engine_05b_fp32
    kv = RaggedCache(eng.model, eng._cache_kw)
    rows = [p[:60 + 25 * i] for i, p in enumerate(prompts[:3])]
    for r in rows:
        kv.add(r)
    blocks = [[11, 12, 13, 14], [15], [16, 17]]
    with torch.inference_mode():
        got = kv.forward(blocks)
        kv.keep([2, 1, 0])  # rollback by different amounts, then one more step
        got2 = kv.forward([[21, 22], [23, 24, 25], [26]])
        for b, r in enumerate(rows):
            alone = eng.model(input_ids=torch.tensor([r + blocks[b]])).logits[0, -len(blocks[b]):]
            assert torch.allclose(got[b, : len(blocks[b])], alone, atol=2e-3), b
        kept = [blocks[0][:2], blocks[1][:1], []]
        for b, nxt in enumerate([[21, 22], [23, 24, 25], [26]]):
            alone = eng.model(input_ids=torch.tensor([rows[b] + kept[b] + nxt])).logits[0, -len(nxt):]
            assert torch.allclose(got2[b, : len(nxt)], alone, atol=2e-3), b


def test_drafter_cache_stays_in_step(drafter_model, prompts):
    """After accepted, partly accepted and rejected drafts, the incremental drafter proposes exactly what a
    fresh drafter proposes from the same history."""
    # 200 tokens of the prompt: the sync does not depend on length, and every fresh drafter prefills the history
    history = np.asarray(prompts[0][:200] + [151644], dtype=np.int64)
    live = DraftProposer(DraftConfig(k=5, device="cpu", dtype="float32"), model=drafter_model)
    rng = np.random.default_rng(0)
    for _ in range(4):
        draft = live.propose([history], [5], keys=["r"])[0].tokens
        fresh = DraftProposer(DraftConfig(k=5, device="cpu", dtype="float32"), model=drafter_model)
        assert fresh.propose([history], [5], keys=["r"])[0].tokens.tolist() == draft.tolist()
        accepted = int(rng.integers(0, 6))
        history = np.concatenate([history, draft[:accepted], [int(rng.integers(100, 1000))]])


def test_batched_runs_are_lossless_over_two_rounds(engine_05b_fp32, drafter_model, prompts, references):
    """The batch of four with the fused proposer: one block for the whole batch (unanimous), then the soak: two
    rounds with one per-request proposer (adaptive block, sticky 3). Every output equals its batch-1 reference (so
    the copy text is identical across rounds), and per-request lengths really happened."""
    eng = engine_05b_fp32
    gens = eng.generate_batch(prompts, fused(drafter_model, k=15, batch_mode="unanimous"), DECODE, requests=TASKS,
                              max_batch=4)
    assert_lossless(references, gens, "fused adaptive unanimous")
    assert max(r.batch for g in gens for r in g.records) == 4
    for step in range(min(len(g.records) for g in gens)):
        assert len({g.records[step].block for g in gens}) == 1

    proposer = fused(drafter_model, k=15, sticky=3)
    copies = []
    for round_ in range(2):
        names = [f"{t}-{round_}" for t in TASKS]
        gens = eng.generate_batch(prompts, proposer, DECODE, requests=names, max_batch=4)
        assert_lossless(references, gens, f"fused adaptive sticky 3, round {round_}")
        assert max(r.batch for g in gens for r in g.records) == 4
        blocks = {t: {r.block for r in g.records} for t, g in zip(TASKS, gens)}
        assert 15 in blocks["copy"], blocks  # the copy request went long...
        mixed = [r for r in gens[0].records if r.batch > 1]
        # ...while others in the same batch steps stayed short: per-request lengths really happened
        assert any(len({g.records[r.step].block for g in gens if r.step < len(g.records)}) > 1 for r in mixed)
        copies.append(gens[0].output_ids)
        # the verify had something to reject: some steps kept only part of what was proposed
        assert any(r.accepted < len(r.proposed) for g in gens for r in g.records)
    assert copies[1] == copies[0] == references[0].output_ids


def test_replay_equals_live(engine_05b_fp32, drafter_model, prompts):
    """The drafter alone and the fused proposer with the most state: replay reproduces the live run step by step."""
    eng = engine_05b_fp32
    makers = {
        "draft k=7": lambda: DraftProposer(DraftConfig(k=7, device="cpu", dtype="float32"), model=drafter_model),
        "fused k=15 sticky 3": lambda: fused(drafter_model, k=15, sticky=3),
    }
    for label, make in makers.items():
        gen = eng.generate(prompts[0], make(), DECODE, request="copy")
        rep = replay(prompts[0], gen.output_ids, make(), max_new_tokens=DECODE.max_new_tokens, request="copy")
        for key in ("proposed", "sources", "accepted", "block"):
            assert [getattr(r, key) for r in rep] == [getattr(r, key) for r in gen.records], (label, key)
        assert sum(r.accepted for r in gen.records) > 0, label  # it speculated: there was something to replay


def test_teacher_forced_replay_equals_real_drafter(engine_05b_fp32, prompts, references):
    """One drafter pass over the trace gives the same steps as drafting for real at every step."""
    from hqlab.proposers.draft import load_drafter
    from hqlab.replay.teacher import TeacherForcedDrafter

    model = load_drafter("qwen2.5-coder-0.5b", "cpu", "float32")
    # each rule on one request, the copy and the summary request taken in turn (as the lossless tests take their
    # configs): every rule and both kinds of request are compared
    for i, spec in enumerate([dict(k=15, sticky=3), dict(k=15, nstrong=8, agree=2), dict(k=7)]):
        config = FusedConfig(dtype="float32", device="cpu", **spec)
        ids, ref = prompts[i % 2], references[i % 2]
        real = replay(ids, ref.output_ids, FusedProposer(config, drafter=DraftProposer(
            config.draft_config(), model=model)), max_new_tokens=DECODE.max_new_tokens)
        teacher = TeacherForcedDrafter(DraftProposer(config.draft_config(), model=model), ids, ref.output_ids)
        forced = replay(ids, ref.output_ids, FusedProposer(config, drafter=teacher),
                        max_new_tokens=DECODE.max_new_tokens)
        for key in ("accepted", "block", "verify_len", "sources"):
            assert [getattr(r, key) for r in forced] == [getattr(r, key) for r in real], (spec, key)
        assert teacher.real_calls < len(forced)  # most steps needed no real draft

"""Where two greedy answers part, read by the real model teacher-forced (`hqlab.bench.divergence`): identical answers
need no pass, a flip to a token far below the argmax is a mismatch, the logits read off a shared pass are those of
a pass of its own, and the pairing of requests refuses what does not pair. The corpus runs' divergences.parquet
are the same call over their answers (`corpus_report.divergences`)."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from hqlab.bench import divergence as dv


def test_first_divergence_and_the_verdict_rule():
    assert dv.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert dv.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert dv.first_divergence([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter one's length
    assert dv.verdict(20.0, 19.6, 20.0) == "near-tie"
    assert dv.verdict(20.0, 19.0, 20.0) == "mismatch"  # the margin is past the tolerance
    assert dv.verdict(19.0, 18.9, 20.0) == "mismatch"  # close to each other, but both far below the argmax
    assert dv.verdict(20.0, 19.0, 20.0, tol=1.0) == "near-tie"


def test_contexts_that_are_prefixes_of_a_longer_one_share_its_pass():
    hosts = dv._hosts([(1, 2), (1, 2, 3, 4), (1, 2, 3), (1, 5)])
    assert hosts == {(1, 2, 3, 4): (1, 2, 3, 4), (1, 2, 3): (1, 2, 3, 4), (1, 2): (1, 2, 3, 4), (1, 5): (1, 5)}


def test_answer_pairs_join_one_to_one_on_the_same_prompts():
    a = pl.DataFrame({"request": ["r1", "r2"], "repeat": [0, 0], "prompt_ids": [[1, 2], [3]],
                      "output_ids": [[7, 8], [9]]})
    b = a.with_columns(pl.Series("output_ids", [[7, 6], [9]]), pl.lit("x").alias("config"))
    pairs = dv.answer_pairs(a, b, carry=["config"], compared_with="ref")
    assert pairs.columns == ["request", "repeat", "config", "compared_with", "prompt_ids", "a", "b"]
    assert pairs["b"].to_list() == [[7, 6], [9]] and pairs["compared_with"].to_list() == ["ref", "ref"]
    with pytest.raises(ValueError, match="one to one"):
        dv.answer_pairs(a, b.head(1))
    with pytest.raises(ValueError, match="different prompts"):
        dv.answer_pairs(a, b.with_columns(pl.Series("prompt_ids", [[1, 2], [4]])))


@pytest.mark.slow
def test_the_real_model_tells_identical_near_tie_and_mismatch(engine_05b_fp32):
    model = engine_05b_fp32.model
    prompt = engine_05b_fp32.tokenizer("def add(a, b):\n    return")["input_ids"]
    with torch.inference_mode():
        first = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        t1, low = int(first.argmax()), int(first.argmin())
        second = model(input_ids=torch.tensor([prompt + [t1]])).logits[0, -1].float()
    t2, low2 = int(second.argmax()), int(second.argmin())
    pairs = [(prompt, [t1, t2], [t1, t2]),      # the same answer
             (prompt, [t1, t2], [low, t2]),     # b flips at once to the least likely token
             (prompt, [t1, t2], [t1, low2]),    # ... one token later: read off the same pass as the next pair
             (prompt, [t1], [t1, t2])]          # a stopped where b went on
    identical, at_once, later, stopped = dv.divergences(model, pairs)
    assert identical == dv.Divergence("identical") and identical.lossless
    assert (at_once.verdict, at_once.position, at_once.token_a, at_once.argmax) == ("mismatch", 0, t1, t1)
    assert at_once.margin == pytest.approx(float(first[t1] - first[low]), abs=1e-3) and at_once.margin > 5
    assert (later.verdict, later.position, later.token_b) == ("mismatch", 1, low2) and not later.lossless
    assert later.logit_a == pytest.approx(float(second[t2]), abs=1e-3) and later.top_logit == later.logit_a
    assert (stopped.verdict, stopped.position, stopped.token_a, stopped.margin) == ("mismatch", 1, None, None)
    # the same flip is a near tie for a tolerance wider than its margin
    assert dv.divergences(model, pairs[1:2], tol=at_once.margin + 1)[0].verdict == "near-tie"
    table = dv.divergence_table(model, pl.DataFrame({"request": ["r", "s"], "prompt_ids": [prompt, prompt],
                                                     "a": [[t1, t2], [t1, t2]], "b": [[t1, t2], [low, t2]]}))
    assert table.columns == ["request", *dv.COLUMNS]
    assert table["verdict"].to_list() == ["identical", "mismatch"] and table["margin"][1] == pytest.approx(
        at_once.margin)

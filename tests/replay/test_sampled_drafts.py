"""`hqlab.replay.sampled_drafts.acceptance`: the acceptance of greedy and sampled drafts under sampling, checked
against the reference verifier (`hqlab.rules.verify.sample_verify`) run many times, and on the closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from hqlab.replay.sampled_drafts import COLUMNS, acceptance
from hqlab.rules.verify import sample_verify

TRIALS = 20_000


def test_closed_forms():
    target = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    cols = acceptance(target, target.clone(), 0.7)
    assert set(cols) == set(COLUMNS)
    np.testing.assert_allclose(cols["sampled_draft"], [1.0, 1.0])  # q = p: every sampled draft is accepted
    p = torch.softmax(target[0].double() / 0.7, -1)
    np.testing.assert_allclose(cols["greedy_draft"][0], float(p[0]))  # the argmax's own probability
    assert cols["argmax_agree"].tolist() == [True, True]
    # a drafter sure of a token the target gives 0.1: greedy 0.1, sampled sum(min) = 0.1 too; a flat drafter more
    cols = acceptance(torch.log(torch.tensor([[0.9, 0.1]])), torch.tensor([[-20.0, 20.0]]), 1.0)
    np.testing.assert_allclose(cols["greedy_draft"], [0.1], atol=1e-9)
    np.testing.assert_allclose(cols["sampled_draft"], [0.1], atol=1e-9)
    cols = acceptance(torch.log(torch.tensor([[0.9, 0.1]])), torch.tensor([[0.0, 0.0]]), 1.0)
    np.testing.assert_allclose(cols["sampled_draft"], [0.6], atol=1e-9)
    with pytest.raises(ValueError, match="temperature"):
        acceptance(target, target, 0.0)


@pytest.mark.parametrize("sampled", [False, True])
def test_the_reference_verifier_accepts_as_often_as_computed(sampled):
    """Draw the draft (the drafter's argmax, or a draw from q), verify it with sample_verify, count acceptances."""
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(1, 12, generator=g) * 2, torch.randn(1, 12, generator=g) * 2
    t = 0.7
    expect = float(acceptance(target, draft, t)["sampled_draft" if sampled else "greedy_draft"][0])
    p = torch.softmax(target.double() / t, -1).repeat(2, 1)
    q = torch.softmax(draft.double() / t, -1)
    accepted = 0
    for _ in range(TRIALS):
        x = int(torch.multinomial(q[0], 1, generator=g)) if sampled else int(q[0].argmax())
        verdict = sample_verify(np.array([x]), p, g, q=q, point_mass=np.array([not sampled]))
        accepted += verdict.accepted == 1
    assert binomtest(accepted, TRIALS, expect).pvalue > 1e-4, (accepted / TRIALS, expect)


def test_summary_and_projection():
    import polars as pl

    from hqlab.replay.sampled_drafts import projected_speedup, summary

    rows = pl.DataFrame({"dataset": ["prose"] * 4, "temperature": [0.7] * 4, "prompt": ["a", "a", "b", "b"],
                         "greedy_draft": [0.5, 0.7, 0.2, 0.2], "sampled_draft": [0.6, 0.8, 0.4, 0.4]})
    table = summary(rows)
    got = {d: r for d, r in zip(table["draft"], table.iter_rows(named=True))}
    assert got["greedy"]["acceptance"] == pytest.approx(0.4) and got["sampled"]["acceptance"] == pytest.approx(0.55)
    assert (got["greedy"]["lowest"], got["greedy"]["highest"], got["greedy"]["prompts"]) == (
        pytest.approx(0.2), pytest.approx(0.6), 2)
    assert projected_speedup(1.2, 2.0, 0.1) == pytest.approx(1.26)
    with pytest.raises(ValueError):
        projected_speedup(1.2, 0.0, 0.1)


def test_a_tempered_drafter_is_accepted_against_its_own_distribution():
    """A drafter whose logits are the target's times c, drawn at T x c, has the target's distribution exactly (always
    accepted); drawn at T it has not; the default is the request's T."""
    g = torch.Generator().manual_seed(3)
    target = torch.randn(5, 40, generator=g) * 3
    draft = target * 0.5  # a flatter copy: at T x 0.5 it is p exactly
    t = 0.7
    np.testing.assert_allclose(acceptance(target, draft, t, draft_temperature=t * 0.5)["sampled_draft"], 1.0,
                               atol=1e-12)
    at_t = acceptance(target, draft, t)["sampled_draft"]
    assert (at_t < 0.999).all()
    np.testing.assert_array_equal(acceptance(target, draft, t, draft_temperature=t)["sampled_draft"], at_t)
    # the greedy draft and the agreement do not depend on the drafter's temperature
    for col in ("greedy_draft", "argmax_agree", "target_top"):
        np.testing.assert_array_equal(acceptance(target, draft, t, draft_temperature=2.0)[col],
                                      acceptance(target, draft, t)[col])
    with pytest.raises(ValueError, match="draft_temperature"):
        acceptance(target, draft, t, draft_temperature=0.0)


def test_draft_temperature_summary():
    import polars as pl

    from hqlab.replay.sampled_drafts import draft_temperature_summary

    rows = pl.DataFrame({"dataset": ["prose"] * 4, "temperature": [0.7] * 4, "draft_scale": [1.0, 1.0, 0.8, 0.8],
                         "sampled_draft": [0.6, 0.8, 0.75, 0.75]})
    table = draft_temperature_summary(rows)
    assert table["draft_scale"].to_list() == [0.8, 1.0]
    np.testing.assert_allclose(table["acceptance"].to_list(), [0.75, 0.7])
    np.testing.assert_allclose(table["gain"].to_list(), [0.05, 0.0], atol=1e-12)
    with pytest.raises(ValueError, match="draft_scale 1.0"):
        draft_temperature_summary(rows.filter(pl.col("draft_scale") != 1.0))


def test_head_summary_and_projection():
    import polars as pl

    from hqlab.replay.sampled_drafts import head_summary, project_heads

    # head 1: greedy emits 1, 2 (a), 1, 1 (b) -> 5/4; drawn 2, 2 (a), 2, 1 (b) -> 7/4; ratio 1.4
    rows = pl.DataFrame({"head": [1] * 8, "draft": ["greedy"] * 4 + ["drawn"] * 4,
                         "prompt": ["a", "a", "b", "b"] * 2, "accepted": [0, 1, 0, 0, 1, 1, 1, 0]})
    table = head_summary(rows, resamples=500)
    r = table.row(0, named=True)
    assert (r["greedy"], r["drawn"], r["prompts"]) == (pytest.approx(1.25), pytest.approx(1.75), 2)
    assert r["ratio"] == pytest.approx(1.4)
    # resampling prompts: a alone gives 2 / 1.5 = 4/3, b alone 1.5 / 1 = 1.5; the range lies between
    assert 4 / 3 - 1e-9 <= r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"] <= 1.5 + 1e-9
    proj = project_heads(table, 1.2, {1: 1.0})
    assert proj["projected"][0] == pytest.approx(1.2 * 1.4)
    with pytest.raises(ValueError, match="heads \\[1\\]"):
        project_heads(table, 1.2, {2: 1.01})
    with pytest.raises(ValueError, match="both greedy and drawn"):
        head_summary(rows.filter(pl.col("draft") == "greedy"))
    with pytest.raises(ValueError, match="columns"):
        head_summary(rows.drop("prompt"))


def test_head_speeds_from_a_serving_run():
    import polars as pl

    from hqlab.replay.sampled_drafts import head_speeds

    fused = "gpu-fused:k=15,draft_block={},nmax=32"
    rows = pl.DataFrame({
        "run": ["s3"] * 6 + ["s4"],
        "config": ["none", fused.format(1), fused.format(2), fused.format(3), fused.format(1),
                   fused.format(2) + ",draft_sample=probabilistic", fused.format(2)],
        "dataset": ["prose"] * 7, "temperature": [0.7] * 7, "max_concurrency": [1] * 7,
        "output_throughput": [400.0, 400.0, 404.0, 396.0, 420.0, 999.0, 1.0]})
    # head 1: median of 400 and 420 = 410; the drawn row and the other run are not read
    assert head_speeds(rows, "s3") == pytest.approx({1: 1.0, 2: 404 / 410, 3: 396 / 410})
    with pytest.raises(ValueError, match="one-token head"):
        head_speeds(rows, "s4")
    # a config naming no draft_block has the default's (7), not a one-token head
    unnamed = rows.with_columns(pl.col("config").str.replace(",draft_block=3", ""))
    assert set(head_speeds(unnamed, "s3")) == {1, 2, 7}

"""Every claim committed beside a run (data/results/<study>/<run>/claims.json: what the docs say of the run, as data)
holds on that run's own tables, and fails once its value is moved past what the run measured, so no claim holds
whatever the data (`hqlab.bench.claims`). The checker's own rules are tested on small runs written here."""

from __future__ import annotations

import dataclasses
import json

import polars as pl
import pytest

from hqlab.bench import claims, results

MANIFEST = claims.manifest()
_RUNS: dict[tuple[str, str], claims.RunData] = {}


def run_data(study: str, run: str, root=None) -> claims.RunData:
    """One RunData a committed run, so that its tables and views are read once for all its claims."""
    if root is not None:
        return claims.RunData(study, run, root)
    return _RUNS.setdefault((study, run), claims.RunData(study, run))


def moved(claim: claims.Claim, found: list) -> claims.Claim:
    """The claim with its value moved just past what was found, so that it must fail where the check reads data."""
    values = [v for _, v in found]
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    op = claim.op
    if op in (">=", ">"):
        value = max(numbers) + 1
    elif op in ("<=", "<"):
        value = min(numbers) - 1
    elif op == "between":
        value = [max(numbers) + 1, max(numbers) + 2]
    elif op == "approx":
        value = max(numbers) + 10 * claim.tol + 1
    elif op == "in":
        value = []
    elif op == "!=":
        value = values[0]
    else:  # ==: a value no metric gives
        value = "no run measured this"
    return dataclasses.replace(claim, value=value)


@pytest.mark.parametrize("study, run, claim", MANIFEST,
                         ids=[f"{s}/{r}: {c.what[:60]}" for s, r, c in MANIFEST])
def test_committed_claim_holds_and_fails_when_moved(study, run, claim):
    data = run_data(study, run)
    verdict = claims.check(claim, data)
    assert verdict.held, verdict.describe()
    assert not claims.check(moved(claim, verdict.found), data).held, f"{claim.what}: holds whatever its value"


def test_the_manifest_covers_the_runs_the_docs_quote():
    covered = {(s, r) for s, r, _ in MANIFEST}
    assert {("serve", "s6"), ("corpus", "c3"), ("vllm_fused", "fn2"), ("vllm_gpu", "w2"), ("seed_scale", "v4d"),
            ("seed_scale", "s3a")} <= covered
    assert len(MANIFEST) >= 300


# --- the checker, on a run written here -----------------------------------------------------------------------------

@pytest.fixture()
def small(tmp_path):
    """A results folder with one run of a made-up study: rows (group, x) and a steps table."""
    rows = pl.DataFrame({"group": ["a", "a", "b"], "x": [1.0, 2.0, 5.0], "ok": [True, True, False],
                         "label": ["one", "two", "three"]})
    results.write_run("toy", "r1", card="cpu", root=tmp_path,
                      tables={"rows": rows, "steps": pl.DataFrame({"step": [0, 1, 2, 3]})})
    return tmp_path


def verdict(small, **entry):
    return claims.check(claims.Claim.of({"what": "a claim", **entry}, "here"), run_data("toy", "r1", small))


def test_a_claim_holds_where_its_metric_passes_its_op(small):
    assert verdict(small, metric="min(x)", op=">=", value=1).held
    assert verdict(small, metric="count(*)", op="==", value=4, view="steps").held
    assert verdict(small, metric="max(x)", op="between", value=[4, 6]).held
    assert verdict(small, metric="avg(x)", op="approx", value=2.667, tol=0.001).held
    assert verdict(small, metric="ARRAY_AGG(DISTINCT \"group\" ORDER BY \"group\")", op="==", value=["a", "b"]).held
    assert verdict(small, metric="max(label)", op="in", value=["two", "three"]).held
    assert verdict(small, metric="count(*)", op="==", value=0, filter="x > 10").held


def test_a_false_claim_fails_and_says_what_it_found(small):
    false = verdict(small, metric="min(x)", op=">=", value=2)
    assert not false.held and false.found == [({}, 1.0)]
    assert "FAILED: a claim -- min(x) >= 2; found 1" in false.describe()
    assert not verdict(small, metric="max(x)", op="between", value=[1, 4]).held
    assert not verdict(small, metric="max(label)", op="in", value=["one"]).held


def test_a_grouped_claim_must_hold_in_every_group_and_needs_one(small):
    per_group = verdict(small, metric="max(x)", op="<", value=3, by=["group"])
    assert not per_group.held and sorted(per_group.found, key=str) == [({"group": "a"}, 2.0), ({"group": "b"}, 5.0)]
    assert "[group=b] 5" in per_group.describe()
    assert verdict(small, metric="max(x)", op="<", value=6, by=["group"]).held
    assert not verdict(small, metric="max(x)", op="<", value=6, by=["group"], filter="x > 10").held  # no group


def test_a_metric_over_no_rows_is_null_and_fails_but_equal_to_null(small):
    assert not verdict(small, metric="min(x)", op=">=", value=0, filter="x > 10").held
    assert verdict(small, metric="min(x)", op="==", value=None, filter="x > 10").held
    assert claims.holds("==", float("nan"), None) and not claims.holds(">", float("nan"), 0)


def test_a_claim_that_cannot_be_evaluated_is_refused_by_name(small):
    with pytest.raises(claims.ClaimError, match="unknown field.*colour"):
        claims.Claim.of({"what": "w", "metric": "count(*)", "op": "==", "value": 1, "colour": "red"}, "here")
    with pytest.raises(claims.ClaimError, match="missing field.*op"):
        claims.Claim.of({"what": "w", "metric": "count(*)", "value": 1}, "here")
    with pytest.raises(claims.ClaimError, match="op '=~' is not one of"):
        claims.Claim.of({"what": "w", "metric": "count(*)", "op": "=~", "value": 1}, "here")
    with pytest.raises(claims.ClaimError, match=r"`between` takes \[low, high\]"):
        claims.Claim.of({"what": "w", "metric": "x", "op": "between", "value": 3}, "here")
    with pytest.raises(claims.ClaimError, match="no view and no table 'grid' of run toy/r1.*its files"):
        verdict(small, metric="count(*)", op="==", value=1, view="grid")
    with pytest.raises(claims.ClaimError, match="does not run on the view 'rows' \\(columns: group, x, ok, label"):
        verdict(small, metric="max(no_such_column)", op="==", value=1)
    with pytest.raises(claims.ClaimError, match="WHERE no_such_column > 1' does not run on the view 'rows'"):
        verdict(small, metric="count(*)", op="==", value=1, filter="no_such_column > 1")


def test_claims_are_read_from_beside_the_run_and_a_bad_file_names_itself(small):
    path = results.run_path("toy", "r1", small) / claims.CLAIMS
    path.write_text(json.dumps([{"what": "three rows", "metric": "count(*)", "op": "==", "value": 3}]))
    results.write_index(small)
    assert [(s, r, c.what) for s, r, c in claims.manifest(small)] == [("toy", "r1", "three rows")]
    assert [v.held for v in claims.check_run("toy", "r1", small)] == [True]
    path.write_text(json.dumps({"what": "not a list"}))
    with pytest.raises(claims.ClaimError, match="claims.json: a list of claims"):
        claims.claims_of("toy", "r1", small)

"""The step contract: the budget rule, the one record factory, and the metrics computed from records."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from hqlab.proposers import Proposal
from hqlab.trace import (Source, StepRecord, acceptance_histogram, budget, drafter_pass_shares,
                         per_position_acceptance, step_record, tokens_per_step)

HQLAB = Path(__file__).resolve().parents[1] / "hqlab"


def test_metrics_helpers():
    recs = [StepRecord("r", i, 0, 1 + len(p), p, [1] * len(p), 6, a, a + 1, 0.0, 0.0, 0.0)
            for i, (p, a) in enumerate([([1, 2, 3], 3), ([1, 2, 3], 1), ([], 0), ([4, 5], 0)])]
    assert tokens_per_step(recs) == pytest.approx((4 + 2 + 1 + 1) / 4)
    # drafts = 3 non-empty proposals; accepted > 0: 2 of 3; > 1: 1 of 3; > 2: 1 of 3
    assert per_position_acceptance(recs, 3).tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert acceptance_histogram(recs) == {0: 2, 1: 1, 3: 1}
    assert drafter_pass_shares(recs) == {}  # no drafter passes recorded (-1)
    counted = [step_record("r", i, context_len=9, accepted=0, emitted=1, drafter_passes=n, drafter_width=16 * (n > 0))
               for i, n in enumerate([0, 0, 1, 3, -1])]
    assert drafter_pass_shares(counted) == {0: 0.5, 1: 0.25, 3: 0.25}  # the unrecorded step is left out


def test_budget_leaves_room_for_the_targets_own_token():
    assert budget(10, 1) == 8 and budget(10, 9) == 0 and budget(10, 12) == 0
    assert isinstance(budget(np.int64(10), 3), int)
    assert budget(np.array([10, 10, 4]), np.array([1, 9, 4])).tolist() == [8, 0, 0]


def test_step_record_from_a_proposal_or_from_parts():
    proposal = Proposal(np.array([7, 8, 9], dtype=np.int64), np.array([1, 1, 2], dtype=np.int8), 5,
                        extra={"block": 7})
    r = step_record("req", 2, context_len=40, proposal=proposal, block=15, accepted=2, emitted=3, step_s=0.5,
                    propose_s=0.1, t_end=1.5, batch=4)
    assert r == StepRecord("req", 2, 40, 4, [7, 8, 9], [1, 1, 2], 5, 2, 3, 0.5, 0.1, 1.5, 7, 4)
    assert type(r.proposed[0]) is int and type(r.sources[0]) is int  # plain ints, not numpy's
    plain = step_record("req", 0, context_len=40, proposal=Proposal.empty(), block=15, accepted=0, emitted=1)
    assert (plain.verify_len, plain.block, plain.proposed) == (1, 15, [])  # no scheduler: the proposer's k
    fixed = step_record("req", 1, context_len=41, proposed=[-1, -1], sources=[Source.LOOKUP] * 2, verify_len=6,
                        accepted=0, emitted=1)
    assert fixed.verify_len == 6 and fixed.sources == [1, 1] and fixed.batch == 1


def test_step_records_are_made_in_one_function_only():
    """Every StepRecord of the library comes from `step_record` (engines, replays, the vLLM record builder)."""
    makers = []
    for path in HQLAB.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", "")) \
                            == "StepRecord":
                        makers.append(f"{path.relative_to(HQLAB)}:{fn.name}")
    assert makers == ["trace.py:step_record"]

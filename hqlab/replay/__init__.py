"""Replay: the same proposers and rules over recorded greedy outputs, exactly (SPEC §3).

Under greedy decoding the target's output does not depend on the proposer, so every step a proposer would take
live follows from the recorded output. `replay(...)` is the one entry: it returns the `StepRecord`s the engine
would have recorded, through the vectorised replay (`fast`) for the lookup and PLD proposers and step by step
(`step`) for every other proposer or when proposals are timed; both give the same records.

Modules: `traces` (the recorded outputs and their cache), `step`, `fast`, `teacher` (a model drafter's greedy
drafts teacher-forced from one pass over a trace), `costmodel` (measured step cost → predicted speed), `sweep`
(grids of configurations over traces, priced), `zoo` (other systems' proposers on the same traces), `scale`
(measured step costs of large targets joined with measured tokens per step: docs/seed-scale.md).
"""

from __future__ import annotations

from typing import Any, Sequence

from hqlab.replay.fast import fast_replay, supports
from hqlab.replay.step import step_replay
from hqlab.trace import StepRecord

PATHS = ("auto", "fast", "step")


def replay(prompt_ids: Sequence[int], output_ids: Sequence[int], proposer: Any, *, max_new_tokens: int,
           request: str = "0", time_proposals: bool = False, path: str = "auto") -> list[StepRecord]:
    """Step records that `proposer` would produce live, given the target's greedy `output_ids` generated with
    `max_new_tokens` (near the end it caps the proposal budget exactly as the engine does).

    `path` "auto" takes the vectorised replay where it applies (a lookup or PLD proposer, proposals not timed, an
    output within its limit) and the step-by-step replay otherwise; "fast" or "step" forces one. With
    `time_proposals` every proposal is timed (step by step), its seconds in `propose_s`.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} (got {path!r})")
    vectorised = path == "fast" or (path == "auto" and not time_proposals and supports(proposer)
                                    and len(output_ids) <= max_new_tokens)
    if vectorised:
        if time_proposals:
            raise ValueError("the vectorised replay does not time proposals; use path='step'")
        return fast_replay(prompt_ids, output_ids, proposer, max_new_tokens=max_new_tokens, request=request)
    return step_replay(prompt_ids, output_ids, proposer, max_new_tokens=max_new_tokens, request=request,
                       time_proposals=time_proposals)


__all__ = ["replay", "step_replay", "fast_replay", "supports", "PATHS"]

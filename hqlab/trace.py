"""The step contract (SPEC §3): who supplied a token (`Source`), how many tokens a step may propose (`budget`),
the one way a step record is made (`step_record`), and the metrics computed from records.

Both engines, both replays and the vLLM record builder make their `StepRecord`s with `step_record`, so a record
means the same thing wherever it comes from and every metric has one definition:

- tokens/step          = mean over verify steps of (accepted + 1): the bonus/correction token included.
- per-position accept  = for position i, the share of drafts (steps with a non-empty proposal) that accepted
                         more than i tokens (cumulative).
- acceptance histogram = number of steps per accepted count.
- decode tok/s         = (output tokens - 1) / (time of last token - time of first token).
- e2e tok/s            = output tokens / total time; TTFT = time of the first token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any, Sequence

import numpy as np


class Source(IntEnum):
    """Who supplied a token. TARGET marks tokens the target model chose itself (corrections and bonus tokens)."""

    TARGET = 0
    LOOKUP = 1
    DRAFT = 2
    CORPUS = 3  # a lookup match in a corpus of earlier requests (hqlab.rules.corpus), not the request's own history


def budget(max_new_tokens: Any, emitted: Any) -> Any:
    """Most tokens a verify step may propose after `emitted` output tokens of a request limited to `max_new_tokens`:
    the step always adds one token of the target's own (the correction or the bonus), so max_new_tokens - emitted
    - 1, never below 0. Integers or numpy arrays (the vectorised replay asks for every step at once)."""
    left = max_new_tokens - emitted - 1
    return np.maximum(left, 0) if isinstance(left, np.ndarray) else max(int(left), 0)


@dataclass
class StepRecord:
    request: str
    step: int  # 0-based verify step within the request (prefill is not a step)
    context_len: int  # tokens in the KV cache before this step
    verify_len: int  # positions the target scored: pending token + proposed tokens
    proposed: list[int]
    sources: list[int]
    match_len: int
    accepted: int  # proposed tokens kept (None-like -1 when an engine cannot tell)
    emitted: int  # tokens appended to the output by this step (accepted + 1, less if EOS/limit cut it)
    step_s: float  # wall time of the whole step
    propose_s: float  # part of step_s spent proposing
    t_end: float  # seconds since the request started, when this step's tokens were known
    block: int = 0  # verify block length the scheduler allowed (k budget)
    batch: int = 1  # requests verified together in this step
    # a drafter model's forward passes in this step's drafting (-1: not recorded, as for proposers without one) and
    # the positions its catch-up pass ran (0: none), for engines that choose per step how much of the drafter runs
    drafter_passes: int = -1
    drafter_width: int = 0
    # the drafter model's own tokens this step, head first, where it ran (empty: it did not run, or the engine does
    # not say): a replay can take them instead of its own drafter's, so that it checks the rules and not the
    # drafter's numerics
    drafter_tokens: list[int] = field(default_factory=list)


def step_record(request: str, step: int, *, context_len: int, accepted: int, emitted: int, proposal: Any = None,
                proposed: Sequence[int] = (), sources: Sequence[int] = (), match_len: int = 0,
                verify_len: int | None = None, block: int = 0, step_s: float = 0.0, propose_s: float = 0.0,
                t_end: float = 0.0, batch: int = 1, drafter_passes: int = -1, drafter_width: int = 0,
                drafter_tokens: Sequence[int] = ()) -> StepRecord:
    """The one way a `StepRecord` is made.

    `proposal` (a `hqlab.proposers.Proposal`) gives the proposed tokens, their sources, the match length and, when
    a scheduler chose one (`extra["block"]`), the block length; without it they come from `proposed`, `sources`,
    `match_len` and `block`. `verify_len` defaults to the positions a step scores: the pending token plus the
    proposal (an engine whose steps verify a fixed width says so). `accepted` counts proposed tokens kept,
    `emitted` the tokens the step appended (accepted + 1 unless an EOS or the length limit cut it).
    """
    if proposal is not None:
        proposed, sources, match_len = proposal.tokens, proposal.sources, proposal.match_len
        block = proposal.extra.get("block", block)
    proposed = [int(t) for t in proposed]
    return StepRecord(request=request, step=int(step), context_len=int(context_len),
                      verify_len=1 + len(proposed) if verify_len is None else int(verify_len), proposed=proposed,
                      sources=[int(s) for s in sources], match_len=int(match_len), accepted=int(accepted),
                      emitted=int(emitted), step_s=step_s, propose_s=propose_s, t_end=t_end, block=int(block),
                      batch=int(batch), drafter_passes=int(drafter_passes), drafter_width=int(drafter_width),
                      drafter_tokens=[int(t) for t in drafter_tokens])


@dataclass
class Generation:
    """One request's result from an engine."""

    request: str
    prompt_len: int
    output_ids: list[int]
    finish: str  # "eos" | "length"
    ttft_s: float
    total_s: float
    t_last: float
    records: list[StepRecord] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit at each emitted token (greedy)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def steps(self) -> int:
        return len(self.records)

    def tokens_per_step(self) -> float:
        return tokens_per_step(self.records)

    def decode_tok_s(self) -> float:
        span = self.t_last - self.ttft_s
        return (self.new_tokens - 1) / span if self.new_tokens > 1 and span > 0 else float("nan")

    def e2e_tok_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")


def step_schema() -> dict:
    import polars as pl  # engines do not need polars; only frames do

    return {
        "request": pl.String, "step": pl.Int32, "context_len": pl.Int32, "verify_len": pl.Int32,
        "proposed": pl.List(pl.Int64), "sources": pl.List(pl.Int8), "match_len": pl.Int32, "accepted": pl.Int32,
        "emitted": pl.Int32, "step_s": pl.Float64, "propose_s": pl.Float64, "t_end": pl.Float64, "block": pl.Int32,
        "batch": pl.Int32, "drafter_passes": pl.Int32, "drafter_width": pl.Int32,
        "drafter_tokens": pl.List(pl.Int64),
    }


def records_frame(records: list[StepRecord]):
    """Step records as a polars DataFrame (one row per verify step)."""
    import polars as pl

    return pl.DataFrame([asdict(r) for r in records], schema=step_schema())


def tokens_per_step(records: list[StepRecord]) -> float:
    """Mean tokens emitted per verify step counting accepted + 1 (the SPEC's 1 + accepted/drafts)."""
    if not records:
        return float("nan")
    return float(np.mean([r.accepted + 1 for r in records]))


def drafter_pass_shares(records: list[StepRecord]) -> dict[int, float]:
    """Share of the steps that recorded their drafter passes, by the number of passes ({} when none recorded):
    how often an engine that skips the drafter actually skipped it."""
    passes = [r.drafter_passes for r in records if r.drafter_passes >= 0]
    return {n: passes.count(n) / len(passes) for n in sorted(set(passes))}


def acceptance_curve(accepted: np.ndarray, width: int) -> np.ndarray:
    """acc[i] = share of drafts whose accepted count exceeds i (the one definition of per-position acceptance)."""
    accepted = np.asarray(accepted)
    if accepted.size == 0:
        return np.zeros(width)
    return np.array([(accepted > i).mean() for i in range(width)])


def per_position_acceptance(records: list[StepRecord], max_pos: int | None = None) -> np.ndarray:
    """acc[i] = share of drafts (steps with >= 1 proposed token) that accepted more than i tokens."""
    drafts = [r for r in records if r.proposed]
    width = max_pos or max((len(r.proposed) for r in drafts), default=0)
    return acceptance_curve(np.array([r.accepted for r in drafts]), width)


def acceptance_histogram(records: list[StepRecord]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in records:
        counts[r.accepted] = counts.get(r.accepted, 0) + 1
    return dict(sorted(counts.items()))

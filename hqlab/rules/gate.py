"""The speculation gate: whether a step verifies drafts at all, decided from the lookup's match state (#39).

The one reference implementation of the gate rule. The vLLM scheduler hook (`hqlab.engines.vllm.gate`) and the
replay (`hqlab.replay.gate`) both use the classes below; nothing else decides it.

Why a gate. Inside vLLM a speculative step verifies a fixed k + 1 positions per request, and at one request on a
small target such a step costs about 1.2-1.5x a plain one whatever k is (docs/serving.md). Where the lookup
is rarely accepted (sampled prose: 1.2 tokens a step) speculation then loses 10-15 %. Narrowing k does not help;
only a step with no drafts at all is as cheap as a plain one. The gate makes that choice per step.

The rule. A request is *open* when the last `min_match` tokens of its history occurred earlier in that history,
i.e. when the lookup's longest suffix match (SPEC §2.1, `hqlab.rules.lookup.suffix_match`) is at least
`min_match` tokens long. A step speculates (verifies the width the batch size gets) when at least one of its
requests is open, and verifies nothing otherwise (`batch_width`). A width is one per step because vLLM verifies
the same number of positions for every request of a step, and a uniform step keeps its full CUDA graph.

What the history is: the tokens the *scheduler* knows when it fixes the width. Under vLLM's asynchronous
scheduling it fixes the width of step n + 1 while step n runs, with outputs known through step n - 2, so the gate
reads a history three steps old (`GateConfig.behind`), and a request's first steps read its prompt alone; the
replay reproduces that lag, and the drafts themselves are still made from the full, current history on the GPU.
Reading the lookup's state on the host instead of the GPU's match costs no synchronisation: the host already holds
every token it has been sent.

The structure. `SuffixGate` keeps the set of `min_match`-grams of a growing sequence: each appended token costs one
tuple and one set lookup, so the hook's cost per step is a few microseconds per request, independent of context
length. `open` is exact: equal to `suffix_match(h, nmin=min_match, nmax=min_match, k=1).match_len > 0` on every
prefix (tests/rules/test_gate.py, on real traces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from hqlab.config import require

ASYNC_BEHIND = 3  # steps between the last output the scheduler knows and the step whose width it fixes (async)


@dataclass(frozen=True)
class GateConfig:
    """min_match: a request is open when its known history ends in a `min_match`-token run seen earlier in it
    (1 = any repeated token, so nearly always open on text; larger = only where a copy is likely).
    behind: how many steps old the history is when the width is fixed (3 under vLLM's asynchronous scheduling,
    1 with synchronous scheduling); used by the replay, the vLLM hook gets it by construction."""

    min_match: int
    behind: int = ASYNC_BEHIND

    def __post_init__(self) -> None:
        require(self.min_match >= 1, f"gate min_match must be >= 1 token (got {self.min_match}); "
                                     f"to speculate on every step leave the gate out")
        require(self.behind >= 1, f"gate behind must be >= 1 step (the width is fixed before the step's own "
                                  f"tokens exist; got {self.behind})")


class SuffixGate:
    """Whether a growing token sequence ends in a `min_match`-gram that occurred earlier in it."""

    __slots__ = ("min_match", "_seen", "_tail", "length", "open")

    def __init__(self, min_match: int) -> None:
        require(min_match >= 1, f"min_match must be >= 1 (got {min_match})")
        self.min_match = min_match
        self._seen: set[tuple[int, ...]] = set()
        self._tail: list[int] = []
        self.length = 0  # tokens seen so far
        self.open = False

    def extend(self, tokens: Iterable[int]) -> bool:
        """Append `tokens`; return `open` for the sequence so far."""
        n = self.min_match
        tail, seen = self._tail, self._seen
        for token in tokens:
            tail.append(int(token))
            if len(tail) > n:
                del tail[0]
            self.length += 1
            if len(tail) == n:
                gram = tuple(tail)
                self.open = gram in seen
                seen.add(gram)
        return self.open

    def catch_up(self, history: Sequence[int]) -> bool:
        """Append what `history` holds past the tokens already seen (the history only ever grows)."""
        if len(history) < self.length:
            raise ValueError(f"history shrank from {self.length} to {len(history)} tokens: a gate follows one "
                             f"growing sequence (start a new SuffixGate for a new one)")
        return self.extend(history[self.length:])


def batch_width(opens: Iterable[bool], width: int) -> int:
    """The step's verify width: `width` (what the batch size gets) when any request is open, else 0."""
    return width if any(opens) else 0

"""The proposer protocol: one narrow, batched method, and the proposal it returns.

A proposer looks at each request's token history (prompt + everything emitted so far) and guesses the next
tokens. It never knows which engine runs it: the transformers engine, the replay simulator and the vLLM adapter
all call the same `propose`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np

from hqlab.trace import Source  # who supplied a token: part of the step contract, one floor down


@dataclass
class Proposal:
    """Up to k proposed tokens for one request.

    tokens:    int64 [n] proposed tokens (n may be 0: nothing to propose this step).
    sources:   int8 [n] `Source` per position.
    match_len: length of the lookup match that produced the tokens (0 = none).
    q:         optional [n, vocab] proposal probabilities for sampled verification, per position; rows of
               positions with a deterministic source (lookup) are ignored: those are point masses.
    extra:     decisions worth recording, e.g. `block` (the block length a scheduler chose) or `take_flag`;
               `known` (see `known`) when only a prefix of the tokens is exact.
    """

    tokens: np.ndarray
    sources: np.ndarray
    match_len: int = 0
    q: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int8))

    @property
    def known(self) -> int | None:
        """How many leading tokens are exact, None meaning all of them. A drafter may return tokens it could not
        compute exactly (a teacher-forced draft in replay knows the tokens up to its first disagreement with the
        trace, `extra["known"]`); a rule that reads past them asks the drafter's `exact` for a real draft."""
        return self.extra.get("known")

    def point_mass(self) -> np.ndarray:
        """bool [n]: positions verified as point masses. Lookup positions are, unless the proposer says the token
        there is the drafter's draw whichever source won (`extra["drawn"]`, bool [n]: the fused proposer's
        `hqlab.rules.fusion.drafter_drawn`); drafter positions are too when the drafter did not sample (no q: its
        argmax is a deterministic guess)."""
        if self.q is None:
            return np.ones(self.valid, dtype=bool)
        drawn = self.extra.get("drawn")
        if drawn is not None:
            return ~np.asarray(drawn, dtype=bool)
        return self.sources != Source.DRAFT

    def truncated(self, n: int) -> "Proposal":
        """The first n positions (the engine clips proposals to the tokens still allowed)."""
        if n >= self.valid:
            return self
        q = None if self.q is None else self.q[:n]
        extra = dict(self.extra)
        if extra.get("drawn") is not None:
            extra["drawn"] = extra["drawn"][:n]
        return Proposal(self.tokens[:n], self.sources[:n], self.match_len, q, extra)


@runtime_checkable
class Proposer(Protocol):
    """Anything with a `k` (most tokens per step) and a batched `propose`.

    `keys` name the requests across calls (the engine passes its request names; None means the batch position).
    Stateless proposers ignore them. Stateful ones (a model drafter's KV cache, a block-length scheduler) keep
    state per key, and drop the state of keys absent from a call: the engine proposes for every active request
    at every step, so an absent key is a finished request.
    """

    name: ClassVar[str]
    k: int

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        """One proposal per history; proposal i has at most min(k, budgets[i]) tokens."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """A model drafter as the fused proposer uses it: `propose` may return drafts exact only up to
    `Proposal.known`; `exact` always drafts for real (for a live drafter both are the same call)."""

    k: int
    config: Any

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        ...

    def exact(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
              keys: Sequence[str] | None = None) -> list[Proposal]:
        ...

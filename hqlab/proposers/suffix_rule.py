"""`arctic-rule`: Arctic's suffix decoding reimplemented (`hqlab.rules.suffix_decoding`), needing no extension.

Same keys as `arctic-suffix` (the adapter over Arctic's own compiled cache): `k, depth, factor, offset, min_prob,
cached`. `cached` != 0 keeps finished requests' outputs in a global tree shared by later requests (-1: all of
them; N: the last N, oldest evicted first, as Arctic's `max_cached_requests`). A request is known by its key:
its first history is its prompt plus the first output token (the engine's first step comes after prefill), and a
key absent from a call is finished (the protocol's rule): its output enters the global tree then.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from hqlab.config import require
from hqlab.proposers.base import Proposal, Source
from hqlab.rules.suffix_decoding import SuffixDecodingConfig, speculate


@dataclass(frozen=True)
class ArcticRuleConfig(SuffixDecodingConfig):
    cached: int = 0  # finished requests' outputs kept in the global tree (0: none, -1: all)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.cached >= -1, f"cached must be >= -1 (got {self.cached})")


class ArcticRuleProposer:
    name: ClassVar[str] = "arctic-rule"
    Config = ArcticRuleConfig

    def __init__(self, config: ArcticRuleConfig | None = None) -> None:
        self.config = config or ArcticRuleConfig()
        self.k = self.config.k
        self._active: dict[str, tuple[int, np.ndarray]] = {}  # key -> (output start, last history)
        self._finished: deque[np.ndarray] = deque()

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        keys = [str(i) for i in range(len(histories))] if keys is None else [str(k) for k in keys]
        for gone in set(self._active) - set(keys):
            self._finish(gone)
        c = self.config
        out = []
        for key, history, budget in zip(keys, histories, budgets):
            h = np.asarray(history, dtype=np.int64)
            seen = self._active.get(key)
            if seen is None or h.size < seen[1].size or not np.array_equal(h[: seen[1].size], seen[1]):
                if seen is not None:  # not a continuation: a new request under an old key
                    self._finish(key)
                seen = (max(h.size - 1, 0), h)
            self._active[key] = (seen[0], h)
            if min(c.k, int(budget)) <= 0 or h.size < 2:
                out.append(Proposal.empty())
                continue
            earlier = list(self._finished) if c.cached != 0 else None
            draft = speculate(h, seen[0], earlier, budget, c)
            n = draft.tokens.size
            source = Source.CORPUS if draft.from_global else Source.LOOKUP
            out.append(Proposal(draft.tokens, np.full(n, source, dtype=np.int8), draft.match_len,
                                extra={"score": draft.score}))
        return out

    def _finish(self, key: str) -> None:
        start, h = self._active.pop(key)
        if self.config.cached != 0 and h.size > start:
            self._finished.append(h[start:].copy())
            while self.config.cached > 0 and len(self._finished) > self.config.cached:
                self._finished.popleft()

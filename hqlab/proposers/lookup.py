"""Context-lookup drafting (HyperQwen's LABD): propose what followed the last match of the current suffix.

The matching rule lives in `hqlab.rules.lookup`; this file only adapts it to the proposer protocol. Histories on
a CUDA device go through the Triton kernel (`hqlab_kernels`) in one launch for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from hqlab.config import ConfigError, LookupConfig
from hqlab.proposers.base import Proposal, Source
from hqlab.rules.lookup import suffix_match


class LookupProposer:
    name: ClassVar[str] = "lookup"
    Config = LookupConfig

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self.k = self.config.k

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int]) -> list[Proposal]:
        c = self.config
        out = []
        for history, budget in zip(histories, budgets):
            k = min(c.k, int(budget))
            if k <= 0:
                out.append(Proposal.empty())
                continue
            m = suffix_match(history, nmin=c.nmin, nmax=c.nmax, k=k, search=c.search, policy=c.policy, full=c.full)
            tokens = m.tokens.astype(np.int64, copy=False)
            out.append(Proposal(tokens, np.full(m.valid, Source.LOOKUP, dtype=np.int8), m.match_len))
        return out


@dataclass(frozen=True)
class PLDConfig:
    """Prompt-lookup decoding as in Spec-Bench / transformers: n-grams of length n down to 1, earliest occurrence,
    and (Spec-Bench) only candidates with a complete k-token continuation."""

    n: int = 3
    k: int = 10
    full: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"pld: n must be >= 1 (got {self.n})")
        if self.k < 1:
            raise ConfigError(f"pld: k must be >= 1 (got {self.k})")

    def as_lookup(self) -> LookupConfig:
        return LookupConfig(nmin=1, nmax=self.n, k=self.k, policy="earliest", full=self.full)


class PLDProposer(LookupProposer):
    name: ClassVar[str] = "pld"
    Config = PLDConfig  # type: ignore[assignment]

    def __init__(self, config: PLDConfig | None = None) -> None:
        self.pld_config = config or PLDConfig()
        super().__init__(self.pld_config.as_lookup())

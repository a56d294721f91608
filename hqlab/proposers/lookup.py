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

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        c = self.config
        if histories and _on_gpu(histories[0]):
            return self._propose_gpu(histories, budgets)
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


    def _propose_gpu(self, histories: Sequence, budgets: Sequence[int]) -> list[Proposal]:
        """All histories in one Triton launch (bit-identical to the reference rule), one copy back to the host."""
        import torch

        try:
            from hqlab_kernels.suffix_match import suffix_match_batch
        except ImportError as e:  # pragma: no cover - only without the kernels package installed
            raise RuntimeError(f"histories are on a GPU but the Triton kernels are unavailable: {e}") from None
        c = self.config
        lengths = torch.tensor([h.shape[0] for h in histories], dtype=torch.int64)
        offsets = torch.cumsum(lengths, 0) - lengths
        tokens = torch.cat([h.to(torch.int32) for h in histories])
        device = tokens.device
        proposals, match_len, valid = suffix_match_batch(
            tokens, offsets.to(device), lengths.to(device), nmin=c.nmin, nmax=c.nmax, k=c.k, search=c.search,
            full=c.full, policy=c.policy, max_len=int(lengths.max()))
        proposals, match_len, valid = proposals.cpu().numpy(), match_len.cpu().numpy(), valid.cpu().numpy()
        out = []
        for i, budget in enumerate(budgets):
            budget = int(budget)
            if budget <= 0:
                out.append(Proposal.empty())
            elif c.full and budget < c.k:
                # "full" makes the choice of match depend on k itself: near the end of a generation, where the
                # budget is below k, ask the reference with the smaller k (rare, and bit-identical by definition).
                out.extend(self.propose([histories[i].cpu().numpy()], [budget]))
            else:  # without "full" the match does not depend on k: a longer proposal clipped is the same
                n = min(int(valid[i]), budget)
                out.append(Proposal(proposals[i, :n].astype(np.int64), np.full(n, Source.LOOKUP, dtype=np.int8),
                                    int(match_len[i])))
        return out


def _on_gpu(history: object) -> bool:
    return getattr(history, "is_cuda", False)


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

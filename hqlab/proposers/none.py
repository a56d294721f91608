"""No speculation: every verify step checks one position (plain autoregressive decoding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from hqlab.proposers.base import Proposal


@dataclass(frozen=True)
class NoneConfig:
    pass


class NoProposer:
    name: ClassVar[str] = "none"
    Config = NoneConfig

    def __init__(self, config: NoneConfig | None = None) -> None:
        self.config = config or NoneConfig()
        self.k = 0

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        return [Proposal.empty() for _ in histories]

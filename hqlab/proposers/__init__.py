"""Proposer registry. A new proposer is one file implementing `Proposer` plus one line in REGISTRY."""

from __future__ import annotations

from hqlab.config import ConfigError, build_config, parse_spec
from hqlab.proposers.base import Proposal, Proposer, Source
from hqlab.proposers.baselines import ArcticSuffixProposer, VllmNgramProposer
from hqlab.proposers.draft import DraftProposer
from hqlab.proposers.fused import FusedProposer
from hqlab.proposers.lookup import LookupProposer, PLDProposer
from hqlab.proposers.none import NoProposer

REGISTRY: dict[str, type] = {
    "none": NoProposer,
    "lookup": LookupProposer,
    "pld": PLDProposer,
    "draft": DraftProposer,
    "fused": FusedProposer,
    "vllm-ngram": VllmNgramProposer,
    "arctic-suffix": ArcticSuffixProposer,
}


def make_proposer(spec: str) -> Proposer:
    """Build a proposer from `NAME[:key=value,...]`, e.g. `lookup:nmin=6,nmax=12,k=15`."""
    name, values = parse_spec(spec)
    if name not in REGISTRY:
        raise ConfigError(f"unknown proposer {name!r} in {spec!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    config = build_config(cls.Config, values, context=f"proposer {name!r}")
    return cls(config)


__all__ = ["REGISTRY", "make_proposer", "Proposal", "Proposer", "Source", "LookupProposer", "PLDProposer",
           "NoProposer", "DraftProposer", "FusedProposer"]

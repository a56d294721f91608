"""Proposer registry. A new proposer is one file implementing `Proposer` plus one line in REGISTRY."""

from __future__ import annotations

from hqlab.config import resolve_spec
from hqlab.proposers.base import Drafter, Proposal, Proposer, Source
from hqlab.proposers.baselines import ArcticSuffixProposer, VllmNgramProposer
from hqlab.proposers.draft import DraftProposer
from hqlab.proposers.fused import FusedProposer
from hqlab.proposers.lookup import LookupProposer, PLDProposer
from hqlab.proposers.none import NoProposer
from hqlab.proposers.suffix_rule import ArcticRuleProposer

REGISTRY: dict[str, type] = {
    "none": NoProposer,
    "lookup": LookupProposer,
    "pld": PLDProposer,
    "draft": DraftProposer,
    "fused": FusedProposer,
    "vllm-ngram": VllmNgramProposer,
    "arctic-suffix": ArcticSuffixProposer,
    "arctic-rule": ArcticRuleProposer,
}


def make_proposer(spec: str) -> Proposer:
    """Build a proposer from `NAME[:key=value,...]`, e.g. `lookup:nmin=6,nmax=12,k=15`."""
    name, config = resolve_spec(spec, REGISTRY)
    return REGISTRY[name](config)


__all__ = ["REGISTRY", "make_proposer", "Proposal", "Proposer", "Drafter", "Source", "LookupProposer", "PLDProposer",
           "NoProposer", "DraftProposer", "FusedProposer"]

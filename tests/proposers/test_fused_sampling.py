"""Sampled speculative decoding with fused proposals has exactly the target's distribution (SPEC §2.6).

The real `FusedProposer` (lookup, fusion rule, scheduler) proposes over a real history; its drafter is a sampling
Markov chain (a proposer like any other, with q), the target another chain, so the exact distribution of the first
three emitted tokens is computable. Each block mixes drafter positions (verified with q) and lookup positions
(point masses), depending on the drafter's samples through the tail rule. A chi-square test compares counts with
the exact distribution.

The check has teeth: with agree > 0 the head decision depends on the drafter's own samples; the positions it takes
through agreement hold the drafter's draw in either branch and must be checked against q
(`hqlab.rules.fusion.drafter_drawn`). The same check fails when they are checked as point masses by their LOOKUP
tag, and when a verifier checks lookup positions against q rows as if the drafter had proposed them. (Treating
drafter positions as point masses is NOT a bug: point-mass verification is exact for any token chosen without the
target's randomness, only less efficient.)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hqlab.bench.lossless import chi_square_pvalue
from hqlab.proposers.base import Proposal, Source
from hqlab.proposers.fused import FusedConfig, FusedProposer
from hqlab.rules.verify import sample_verify

V = 6
SAMPLES = 15_000
HISTORY = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2], dtype=np.int64)  # lookup proposes 3 4 5 0 ...


def chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(V, V, generator=g) * 1.2, dim=-1)
    drafter = torch.softmax(torch.randn(V, V, generator=g) * 1.2, dim=-1)
    # the drafter often agrees with the lookup continuation (3 after 2, 4 after 3), so every branch is exercised
    drafter[2] = 0.5 * drafter[2] + 0.5 * torch.nn.functional.one_hot(torch.tensor(3), V)
    drafter[3] = 0.5 * drafter[3] + 0.5 * torch.nn.functional.one_hot(torch.tensor(4), V)
    return target, drafter


class MarkovDrafter:
    """A sampling drafter over a Markov chain: proposes k tokens from the chain and returns their q rows."""

    name = "markov"

    def __init__(self, trans: torch.Tensor, k: int, generator: torch.Generator) -> None:
        self.trans, self.k, self.gen = trans, k, generator

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        out = []
        for h, b in zip(histories, budgets):
            n = min(self.k, int(b))
            tok, toks, rows = int(h[-1]), [], []
            for _ in range(n):
                rows.append(self.trans[tok])
                tok = int(torch.multinomial(self.trans[tok], 1, generator=self.gen))
                toks.append(tok)
            q = torch.stack(rows) if rows else None
            out.append(Proposal(np.array(toks, dtype=np.int64), np.full(n, Source.DRAFT, dtype=np.int8), 0, q))
        return out


def first_three(verify, config: FusedConfig, samples: int, seed: int, *, lookup_as_drafter: bool = False,
                by_source: bool = False):
    target, drafter_chain = chains(1)
    gen = torch.Generator().manual_seed(seed)
    proposer = FusedProposer(config, drafter=MarkovDrafter(drafter_chain, config.draft_block, gen))
    counts = np.zeros(V ** 3, dtype=np.int64)
    mixed = 0
    for i in range(samples):
        p = proposer.propose([HISTORY], [config.k], keys=[str(i)])[0]
        mixed += bool((p.sources == Source.LOOKUP).any() and (p.sources == Source.DRAFT).any())
        prev = [int(HISTORY[-1]), *p.tokens.tolist()]
        rows = torch.stack([target[t] for t in prev])
        # the broken variant verifies lookup positions with q rows (zero for the tail) like drafter positions
        point_mass = np.zeros(p.valid, bool) if lookup_as_drafter else p.point_mass()
        if by_source:  # the broken reading: every LOOKUP-tagged position a point mass, whatever the rule read
            point_mass = p.sources != Source.DRAFT
        emitted = list(verify(p.tokens, rows, gen, q=p.q, point_mass=point_mass).emitted)
        while len(emitted) < 3:
            emitted.append(int(torch.multinomial(target[emitted[-1]], 1, generator=gen)))
        a, b, c = emitted[:3]
        counts[(a * V + b) * V + c] += 1
    t0 = target[int(HISTORY[-1])]
    exact = (t0[:, None, None] * target[:, :, None] * target[None, :, :]).numpy().ravel()
    return chi_square_pvalue(counts, exact / exact.sum()), mixed / samples


# the head is never taken (match_len <= nmax = 12 < nstrong = nmin = 20); the tail (lookup, point masses) is
# appended only when the drafter agreed over the whole head: blocks mix drafter and lookup positions
TAIL_BY_AGREEMENT = dict(k=4, draft_block=2, nmax=12, nstrong=20, nmin=20, nmin_tail=2, longmin=2, schedule="long",
                         model="markov")


def test_fused_sampling_is_exact():
    pval, mixed = first_three(sample_verify, FusedConfig(**TAIL_BY_AGREEMENT), samples=SAMPLES, seed=5)
    assert mixed > 0.1, "the blocks must mix drafter and lookup positions"
    assert pval > 1e-3, pval


def test_fused_sampling_head_taken_is_exact():
    config = FusedConfig(k=4, draft_block=2, nmax=12, schedule="long", model="markov")  # shipped: head taken
    pval, _ = first_three(sample_verify, config, samples=SAMPLES, seed=6)
    assert pval > 1e-3, pval


def test_agreement_gated_head_is_exact():
    """agree = 1 with a sampling drafter: the head is taken through agreement whenever the drafter's first token is
    the lookup's (a match of 2 to 12, below nstrong; the next test shows those steps occur), and the output still
    follows the target."""
    config = FusedConfig(**{**TAIL_BY_AGREEMENT, "nmin": 2, "agree": 1})
    pval, _ = first_three(sample_verify, config, samples=SAMPLES, seed=5)
    assert pval > 1e-3, pval


def test_check_catches_agreement_gated_head_checked_by_source():
    """The same blocks with the agreed positions checked as point masses (their LOOKUP tag): the output is biased."""
    config = FusedConfig(**{**TAIL_BY_AGREEMENT, "nmin": 2, "agree": 1})
    pval, _ = first_three(sample_verify, config, samples=SAMPLES, seed=5, by_source=True)
    assert pval < 1e-6, pval


def test_check_catches_lookup_positions_verified_with_q():
    pval, _ = first_three(sample_verify, FusedConfig(**TAIL_BY_AGREEMENT), samples=SAMPLES, seed=5,
                          lookup_as_drafter=True)
    assert pval < 1e-6, pval

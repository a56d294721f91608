"""Sampled verification of a fused block is lossless only if every position checked against the drafter's q was
proposed from q whichever way the fusion rule went (`hqlab.rules.fusion.drafter_drawn`).

The case that breaks the naive reading (DRAFT positions against q, LOOKUP positions as point masses): a head taken
through the agreement branch. The drafter draws d ~ q; if d equals the lookup's token the head is "taken" and the
position is tagged LOOKUP, else it stays the drafter's. Either way the token is d, so the position must be checked
against q in both branches. Below, the fused rule and the reference verifier (`sample_verify`) run 20,000 times on
p = (.5, .5), q = (.9, .1), the lookup proposing token 0: the naive reading emits token 0 with probability .45, the
rule's reading with .5, as the target does.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import binomtest

from hqlab.proposers.base import Proposal
from hqlab.rules.fusion import SOURCE_DRAFT, SOURCE_LOOKUP, FusionConfig, drafter_drawn, fuse
from hqlab.rules.verify import sample_verify

P = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)  # the target at the drafted position and the next
Q = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
AGREEMENT = FusionConfig(nstrong=8, nmin=2, agree=1, nmin_tail=4, longmin=6, draft_block=1)
TRIALS = 20_000


def first_tokens(config: FusionConfig, match_len: int, naive: bool) -> int:
    """Times the first emitted token is 0 over TRIALS fused-and-verified steps."""
    g = torch.Generator().manual_seed(7)
    zeros = 0
    for _ in range(TRIALS):
        d = int(torch.multinomial(Q[0], 1, generator=g))
        f = fuse([d], [0], match_len, 1, 1, config)
        drawn = f.sources == SOURCE_DRAFT if naive else drafter_drawn(f, match_len, 1, config)
        verdict = sample_verify(f.tokens, P, g, q=Q, point_mass=~drawn)
        zeros += verdict.emitted[0] == 0
    return zeros


def test_a_head_taken_by_agreement_is_checked_against_q_and_the_output_follows_the_target():
    f = fuse([0], [0], 3, 1, 1, AGREEMENT)
    assert f.head_taken and f.sources.tolist() == [SOURCE_LOOKUP]  # taken through the agreement branch
    assert drafter_drawn(f, 3, 1, AGREEMENT).tolist() == [True]
    assert binomtest(first_tokens(AGREEMENT, 3, naive=False), TRIALS, 0.5).pvalue > 1e-4
    # the test has the power to see the bias it guards against
    naive = first_tokens(AGREEMENT, 3, naive=True)
    assert binomtest(naive, TRIALS, 0.5).pvalue < 1e-10 and abs(naive / TRIALS - 0.45) < 0.02


def test_a_head_taken_by_match_length_alone_stays_a_point_mass():
    """At a match of nstrong the lookup's token is proposed whatever the drafter drew: a point mass, and the output
    follows the target too."""
    f = fuse([0], [0], 8, 1, 1, AGREEMENT)
    assert drafter_drawn(f, 8, 1, AGREEMENT).tolist() == [False]
    assert binomtest(first_tokens(AGREEMENT, 8, naive=False), TRIALS, 0.5).pvalue > 1e-4
    shipped = FusionConfig.shipped(draft_block=1)  # agree = 0: the head rule never reads the draw
    f = fuse([1], [0], 6, 1, 1, shipped)
    assert drafter_drawn(f, 6, 1, shipped).tolist() == [False]


def test_only_the_agreed_positions_of_a_longer_head_are_the_drafters_draws():
    config = FusionConfig(nstrong=8, nmin=2, agree=2, nmin_tail=4, longmin=6, draft_block=4)
    f = fuse([5, 6, 9, 9], [5, 6, 7], 3, 3, 6, config)  # agrees on 2, the lookup supplies 3 of the 4 head tokens
    assert f.head_taken and f.tokens.tolist() == [5, 6, 7, 9]
    assert f.sources.tolist() == [SOURCE_LOOKUP] * 3 + [SOURCE_DRAFT]
    assert drafter_drawn(f, 3, 3, config).tolist() == [True, True, False, True]
    f = fuse([5, 8, 9, 9], [5, 6, 7], 3, 3, 6, config)  # disagrees at 1: the drafter's head, all drawn
    assert not f.head_taken and drafter_drawn(f, 3, 3, config).tolist() == [True] * 4


def test_a_proposal_verifies_the_drawn_positions_against_q_and_keeps_them_when_clipped():
    tokens = np.array([5, 6, 7, 9])
    sources = np.array([SOURCE_LOOKUP] * 3 + [SOURCE_DRAFT], dtype=np.int8)
    q = torch.full((4, 10), 0.1)
    drawn = np.array([True, True, False, True])
    proposal = Proposal(tokens, sources, 3, q, {"drawn": drawn})
    assert proposal.point_mass().tolist() == [False, False, True, False]
    assert proposal.truncated(2).point_mass().tolist() == [False, False]
    assert Proposal(tokens, sources, 3, q).point_mass().tolist() == [True, True, True, False]  # no word: by source

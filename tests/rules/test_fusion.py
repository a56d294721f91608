"""The fusion rule (SPEC §2.4) pinned by tables of inputs -> expected outputs written from the SPEC text.

Every row names the rule it pins. Shared inputs: the drafter head D (draft_block 7) and lookup proposals that
agree with it on a chosen number of leading positions, followed by tail tokens only the lookup can supply.
Expected sources are strings, one letter per position: L = lookup, D = drafter.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab.config import ConfigError
from hqlab.proposers.base import Source
from hqlab.rules.fusion import SOURCE_DRAFT, SOURCE_LOOKUP, FusionConfig, fuse, fuse_batch

D = [10, 11, 12, 13, 14, 15, 16]  # drafter head, draft_block = 7
TAIL = [20, 21, 22, 23, 24, 25, 26, 27]  # positions 7..14 of a k = 15 block
LA = D + TAIL  # lookup agrees with the drafter over the whole head
L0 = [90, 91, 92, 93, 94, 95, 96] + TAIL  # disagrees at position 0 (agree_count 0)
L1 = [10, 91, 92, 93, 94, 95, 96] + TAIL  # agree_count 1
L2 = [10, 11, 92, 93, 94, 95, 96] + TAIL  # agree_count 2

SHIPPED = FusionConfig.shipped()  # nstrong 6, nmin 6, agree 0, nmin_tail 4, longmin 6, draft_block 7
ARTICLES = FusionConfig.articles()  # nstrong 8, agree 2, rest as shipped

# (id, config, drafter head, lookup, match_len, valid, k,
#  expected tokens, expected sources, agree_count, head_taken, tail_taken, take_flag)
THRESHOLD_TABLE = [
    # --- head -------------------------------------------------------------------------------------------------
    # head: take the lookup if match_len >= nstrong (8 >= 8), even with no agreement at all
    ("head-via-nstrong", ARTICLES, D, L0, 8, 15, 15, L0, "L" * 15, 0, True, True, True),
    # head: or (match_len >= nmin and agree_count >= agree): 6 < nstrong 8, but 6 >= nmin and agree 2 >= 2
    ("head-via-nmin-agree", ARTICLES, D, L2, 6, 15, 15, L2, "L" * 15, 2, True, True, True),
    # head refused: 7 < nstrong 8 and agree_count 1 < agree 2; tail refused (no head, no full agreement)
    ("head-refused-agree-short", ARTICLES, D, L1, 7, 15, 15, D, "D" * 7, 1, False, False, False),
    # head refused: agree 2 is enough but match 5 < nmin 6 (the nmin branch needs both)
    ("head-refused-below-nmin", ARTICLES, D, L2, 5, 15, 15, D, "D" * 7, 2, False, False, False),
    # shipped head: nstrong 6 alone takes a 6-token match with no agreement
    ("shipped-head-via-nstrong", SHIPPED, D, L0, 6, 15, 15, L0, "L" * 15, 0, True, True, True),
    # --- agree capped by valid ----------------------------------------------------------------------------------
    # the lookup supplied only position 0 (agreeing): agree_count = 1, not more; 1 < 2 so the head is refused
    ("agree-capped-by-valid-refused", ARTICLES, D, LA, 6, 1, 15, D, "D" * 7, 1, False, False, False),
    # with valid 4 the first mismatch (position 2) decides: agree 2 -> head taken, only idx < 4 overwritten,
    # the tail is taken (head taken, 6 >= nmin_tail) but has nothing in it (valid 4 <= head)
    ("agree-capped-then-partial-head", ARTICLES, D, L2, 6, 4, 15,
     [10, 11, 92, 93, 14, 15, 16], "LLLLDDD", 2, True, True, False),
    # a lookup agreeing on all 3 tokens it supplied has agree_count 3, not 7: no full-head agreement, no tail
    ("agree-capped-no-full-agreement", SHIPPED, D, LA, 5, 3, 15, D, "D" * 7, 3, False, False, False),
    # --- tail ---------------------------------------------------------------------------------------------------
    # tail via full-head agreement without the head (5 < nmin 6 and < nstrong 6): head keeps drafter tags,
    # tail appended from the lookup; take flag false because 5 < longmin 6
    ("tail-via-full-agreement", SHIPPED, D, LA, 5, 15, 15, LA, "D" * 7 + "L" * 8, 7, False, True, False),
    # same with longmin 5: now the take flag is set (tail taken, valid 15 > 7, 5 >= 5)
    ("tail-via-full-agreement-take", FusionConfig.shipped(longmin=5), D, LA, 5, 15, 15,
     LA, "D" * 7 + "L" * 8, 7, False, True, True),
    # tail refused: full agreement but match 3 < nmin_tail 4
    ("tail-refused-below-nmin-tail", SHIPPED, D, LA, 3, 15, 15, D, "D" * 7, 7, False, False, False),
    # head taken (3 >= nstrong 2) yet tail refused (3 < nmin_tail 4): block is the lookup's head only
    ("head-taken-tail-refused", FusionConfig.shipped(nstrong=2), D, L0, 3, 15, 15,
     L0[:7], "L" * 7, 0, True, False, False),
    # --- only idx < valid overwritten ---------------------------------------------------------------------------
    # head taken with valid 4: positions 4..6 keep the drafter's tokens; no tail to add
    ("partial-head", SHIPPED, D, L0, 8, 4, 15, [90, 91, 92, 93, 14, 15, 16], "LLLLDDD", 0, True, True, False),
    # valid 10: the block ends at 10, tail positions 10..14 nobody supplied are not invented
    ("block-ends-at-valid", SHIPPED, D, L0, 8, 10, 15, L0[:10], "L" * 10, 0, True, True, True),
    # padding after valid is ignored
    ("padding-ignored", SHIPPED, D, L0[:10] + [-1] * 5, 8, 10, 15, L0[:10], "L" * 10, 0, True, True, True),
    # no match: nothing supplied, drafter block unchanged
    ("no-match", SHIPPED, D, [], 0, 0, 15, D, "D" * 7, 0, False, False, False),
    # all thresholds 0: rules say take, but valid 0 means nothing is overwritten
    ("zero-thresholds-nothing-supplied", FusionConfig(nstrong=0, nmin=0, nmin_tail=0, longmin=0), D, [], 0, 0, 15,
     D, "D" * 7, 0, True, True, False),
    # --- take flag: each of its three conditions ----------------------------------------------------------------
    # valid must exceed draft_block: valid 7 == draft_block -> false
    ("take-false-valid-equals-block", SHIPPED, D, L0, 8, 7, 15, L0[:7], "L" * 7, 0, True, True, False),
    # valid 8 > 7 -> true
    ("take-true-valid-one-past-block", SHIPPED, D, L0, 8, 8, 15, L0[:8], "L" * 8, 0, True, True, True),
    # match_len >= longmin: 8 < longmin 9 -> false although the tail was taken
    ("take-false-below-longmin", FusionConfig.shipped(longmin=9), D, L0, 8, 15, 15,
     L0, "L" * 15, 0, True, True, False),
    # tail taken is required: see head-refused-agree-short (tail refused -> take false)
    # --- short verify blocks: k <= draft_block has no tail ------------------------------------------------------
    ("k-equals-draft-block", SHIPPED, D, L0[:7], 8, 7, 7, L0[:7], "L" * 7, 0, True, True, False),
    ("k-below-draft-block", SHIPPED, D[:5], L0[:5], 8, 5, 5, L0[:5], "L" * 5, 0, True, True, False),
    # --- the two documented default sets disagree on the same input ---------------------------------------------
    # match 7, no agreement: shipped (nstrong 6) bets on the lookup, articles (nstrong 8, agree 2) keeps the drafter
    ("defaults-differ-shipped", SHIPPED, D, L0, 7, 15, 15, L0, "L" * 15, 0, True, True, True),
    ("defaults-differ-articles", ARTICLES, D, L0, 7, 15, 15, D, "D" * 7, 0, False, False, False),
    # match 6 with one agreeing token: shipped takes, articles wants 2 agreeing tokens
    ("defaults-differ-shipped-agree1", SHIPPED, D, L1, 6, 15, 15, L1, "L" * 15, 1, True, True, True),
    ("defaults-differ-articles-agree1", ARTICLES, D, L1, 6, 15, 15, D, "D" * 7, 1, False, False, False),
]


def _src(s: str) -> list[int]:
    return [int(Source.LOOKUP) if c == "L" else int(Source.DRAFT) for c in s]


@pytest.mark.parametrize(
    "cfg,draft,lookup,match_len,valid,k,tokens,sources,agree,head,tail,take",
    [row[1:] for row in THRESHOLD_TABLE],
    ids=[row[0] for row in THRESHOLD_TABLE],
)
def test_threshold_table(cfg, draft, lookup, match_len, valid, k, tokens, sources, agree, head, tail, take):
    f = fuse(draft, lookup, match_len, valid, k, cfg)
    assert f.tokens.tolist() == list(tokens)
    assert f.sources.tolist() == _src(sources)
    assert (f.agree_count, f.head_taken, f.tail_taken, f.take_flag) == (agree, head, tail, take)
    assert f.tokens.dtype == np.int64 and f.sources.dtype == np.int8


# Arctic's score rule: keep the lookup draft if score >= the drafter's draft length (7), else the drafter's.
# (id, lookup_score, lookup, match_len, valid, expected tokens, sources, head/tail taken, take_flag)
SCORE_TABLE = [
    # no score: hqlab falls back to valid (each supplied token = probability 1): 15 >= 7 keeps the lookup
    ("none-valid-15-keeps-lookup", None, L0, 8, 15, L0, "L" * 15, True, True),
    # 6 < 7: the drafter's draft
    ("none-valid-6-keeps-draft", None, L0, 8, 6, D, "D" * 7, False, False),
    # boundary: 7 >= 7 keeps the lookup (no tail, so no take flag: valid 7 is not > draft_block)
    ("none-valid-7-boundary", None, L0, 8, 7, L0[:7], "L" * 7, True, False),
    # explicit probabilities: 6.5 < 7 -> drafter, although 15 tokens were supplied
    ("score-6.5-keeps-draft", 6.5, L0, 8, 15, D, "D" * 7, False, False),
    ("score-7.0-keeps-lookup", 7.0, L0, 8, 15, L0, "L" * 15, True, True),
    # the score rule has no match thresholds: a 1-token match wins on score; take flag still needs longmin
    ("short-match-wins-on-score", None, L0, 1, 15, L0, "L" * 15, True, False),
]


@pytest.mark.parametrize(
    "score,lookup,match_len,valid,tokens,sources,taken,take",
    [row[1:] for row in SCORE_TABLE],
    ids=[row[0] for row in SCORE_TABLE],
)
def test_score_table(score, lookup, match_len, valid, tokens, sources, taken, take):
    cfg = FusionConfig(rule="score")
    f = fuse(D, lookup, match_len, valid, 15, cfg, lookup_score=score)
    assert f.tokens.tolist() == list(tokens)
    assert f.sources.tolist() == _src(sources)
    assert (f.head_taken, f.tail_taken, f.take_flag) == (taken, taken, take)


def test_score_and_threshold_rules_differ():
    # same input, 1-token match: the threshold rule keeps the drafter, the score rule the lookup
    assert fuse(D, L0, 1, 15, 15, SHIPPED).tokens.tolist() == D
    assert fuse(D, L0, 1, 15, 15, FusionConfig(rule="score")).tokens.tolist() == L0


def test_threshold_rule_ignores_lookup_score():
    assert fuse(D, L0, 1, 15, 15, SHIPPED, lookup_score=15.0).tokens.tolist() == D


def test_default_sets():
    assert (SHIPPED.nstrong, SHIPPED.nmin, SHIPPED.agree, SHIPPED.nmin_tail, SHIPPED.longmin,
            SHIPPED.draft_block) == (6, 6, 0, 4, 6, 7)
    assert SHIPPED == FusionConfig()
    assert (ARTICLES.nstrong, ARTICLES.agree) == (8, 2)
    assert FusionConfig.articles(nmin=5).nmin == 5 and FusionConfig.articles(nmin=5).nstrong == 8


def test_source_codes_match_proposal_sources():
    assert SOURCE_LOOKUP == Source.LOOKUP and SOURCE_DRAFT == Source.DRAFT


@pytest.mark.parametrize(
    "kwargs",
    [dict(nstrong=-1), dict(nmin=-1), dict(agree=-1), dict(nmin_tail=-1), dict(longmin=-1), dict(draft_block=0),
     dict(agree=8), dict(rule="vote"), dict(nmin_alone=-1)],
)
def test_config_rejects(kwargs):
    with pytest.raises(ConfigError):
        FusionConfig(**kwargs)


@pytest.mark.parametrize(
    "args",
    [
        (D[:6], L0, 8, 15, 15),  # head must have min(draft_block, k) = 7 tokens
        (D, L0, 8, 15, 0),  # k >= 1
        (D, L0, 8, 16, 15),  # valid <= k
        (D, L0[:5], 8, 6, 15),  # lookup must supply valid tokens
        (D, L0, -1, 15, 15),  # match_len >= 0
    ],
)
def test_fuse_rejects_inconsistent_inputs(args):
    with pytest.raises(ValueError):
        fuse(*args, SHIPPED)


@pytest.mark.parametrize("score", [-0.1, 15.5, float("nan")])
def test_score_out_of_range(score):
    with pytest.raises(ValueError):
        fuse(D, L0, 8, 15, 15, FusionConfig(rule="score"), lookup_score=score)


def test_batch_is_per_request():
    rows = [(D, L0, 7, 15), (D, LA, 5, 15), (D, [], 0, 0)]
    batch = fuse_batch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                       15, ARTICLES)
    for f, (d, lk, m, v) in zip(batch, rows):
        one = fuse(d, lk, m, v, 15, ARTICLES)
        assert f.tokens.tolist() == one.tokens.tolist() and f.sources.tolist() == one.sources.tolist()
        assert (f.agree_count, f.head_taken, f.tail_taken, f.take_flag) == (
            one.agree_count, one.head_taken, one.tail_taken, one.take_flag)
    with pytest.raises(ValueError):
        fuse_batch([D], [L0, L0], [8], [15], 15, SHIPPED)


# ---------------------------------------------------------------------------------------------------------------
# Properties over random inputs


@st.composite
def fusion_inputs(draw):
    draft_block = draw(st.integers(1, 9))
    k = draw(st.integers(1, 18))
    head_len = min(draft_block, k)
    draft = draw(st.lists(st.integers(0, 3), min_size=head_len, max_size=head_len))
    valid = draw(st.integers(0, k))
    lookup = draw(st.lists(st.integers(0, 3), min_size=valid, max_size=valid))
    match_len = draw(st.integers(0, 14))
    ints = st.integers(0, 10)
    cfg = FusionConfig(nstrong=draw(ints), nmin=draw(ints), agree=draw(st.integers(0, draft_block)),
                       nmin_tail=draw(ints), longmin=draw(ints), draft_block=draft_block)
    return draft, lookup, match_len, valid, k, cfg


@settings(max_examples=500, deadline=None)
@given(fusion_inputs())
def test_every_position_comes_from_its_source(inp):
    draft, lookup, match_len, valid, k, cfg = inp
    f = fuse(draft, lookup, match_len, valid, k, cfg)
    n = len(f.tokens)
    assert n in (f.head_len, max(f.head_len, valid)) and n <= k
    for i, (tok, src) in enumerate(zip(f.tokens.tolist(), f.sources.tolist())):
        if src == SOURCE_LOOKUP:  # only positions the lookup supplied
            assert i < valid and tok == lookup[i]
        else:
            assert src == SOURCE_DRAFT and i < f.head_len and tok == draft[i]
    if f.take_flag:
        assert f.tail_taken and valid > cfg.draft_block and match_len >= cfg.longmin
    assert 0 <= f.agree_count <= min(f.head_len, valid)


@settings(max_examples=300, deadline=None)
@given(fusion_inputs())
def test_articles_set_is_stricter_than_shipped(inp):
    # nstrong 8 / agree 2 only takes heads that 6 / 0 also takes (same nmin 6): the confirmation only removes bets
    draft, lookup, match_len, valid, k, cfg = inp
    arts = FusionConfig.articles(draft_block=cfg.draft_block) if cfg.draft_block >= 2 else None
    if arts is None:
        return
    ship = FusionConfig.shipped(draft_block=cfg.draft_block)
    a = fuse(draft, lookup, match_len, valid, k, arts)
    s = fuse(draft, lookup, match_len, valid, k, ship)
    assert not a.head_taken or s.head_taken
    assert not a.take_flag or s.take_flag


# ---------------------------------------------------------------------------------------------------------------
# A step that skipped the drafter (draft_valid): positions nobody supplied end the block

# (id, config, lookup, match_len, valid, draft_valid, expected tokens, sources, head_taken, tail_taken, take_flag)
SKIP_TABLE = [
    # no drafter, strong match: the lookup's whole block, as with the drafter (the head was the lookup's anyway)
    ("skip-strong-match-keeps-lookup", SHIPPED, L0, 8, 15, 0, L0, "L" * 15, True, True, True),
    # no drafter, no usable match: nothing to propose (a plain step)
    ("skip-no-match-proposes-nothing", SHIPPED, L0, 3, 15, 0, [], "", False, False, False),
    # no drafter, a taken head shorter than the head: the block ends after the lookup's tokens (no tail exists)
    ("skip-short-lookup-ends-block", SHIPPED, L0[:4], 8, 4, 0, L0[:4], "LLLL", True, True, False),
    # the drafter supplied 2 tokens, the head was not taken: its 2 tokens only
    ("partial-draft-untaken-head", SHIPPED, L0, 3, 15, 2, D[:2], "DD", False, False, False),
    # taken head over valid 3 with 5 drafter tokens: lookup 3, then the drafter's positions 3 and 4, then the end
    ("partial-draft-after-lookup-prefix", SHIPPED, L0[:3], 8, 3, 5, L0[:3] + D[3:5], "LLLDD", True, True, False),
    # the articles' set: without drafter tokens there is no agreement, so only nstrong can take the head
    ("skip-articles-needs-nstrong", ARTICLES, LA, 7, 15, 0, [], "", False, False, False),
    # the score rule keeps the drafter's supplied tokens when the lookup's score is below the head
    ("skip-score-rule-partial-draft", FusionConfig(rule="score"), L0, 8, 6, 3, D[:3], "DDD", False, False, False),
    # nmin_alone: without the drafter a match of 3 takes the head (nothing competes with it), and the tail follows
    ("alone-short-match-keeps-lookup", FusionConfig.shipped(nmin_alone=1, nmin_tail=1), L0, 3, 15, 0, L0, "L" * 15,
     True, True, False),
    # ... but not below nmin_alone
    ("alone-below-its-minimum", FusionConfig.shipped(nmin_alone=4), L0, 3, 15, 0, [], "", False, False, False),
    # ... and never where the drafter supplied a token: then the head rule weighs the two as always
    ("alone-not-with-a-drafter-token", FusionConfig.shipped(nmin_alone=1), L0, 3, 15, 1, D[:1], "D", False, False,
     False),
]


@pytest.mark.parametrize("cfg,lookup,match_len,valid,draft_valid,tokens,sources,head,tail,take",
                         [row[1:] for row in SKIP_TABLE], ids=[row[0] for row in SKIP_TABLE])
def test_skip_table(cfg, lookup, match_len, valid, draft_valid, tokens, sources, head, tail, take):
    padded = D[:draft_valid] + [0] * (7 - draft_valid)  # what a skipping engine passes: padding past draft_valid
    f = fuse(padded, lookup, match_len, valid, 15, cfg, draft_valid=draft_valid)
    assert f.tokens.tolist() == list(tokens)
    assert f.sources.tolist() == _src(sources)
    assert (f.head_taken, f.tail_taken, f.take_flag, f.draft_valid) == (head, tail, take, draft_valid)


def test_draft_valid_out_of_range_is_refused():
    for bad in (-1, 8):
        with pytest.raises(ValueError, match="draft_valid"):
            fuse(D, L0, 8, 15, 15, SHIPPED, draft_valid=bad)


@settings(max_examples=400, deadline=None)
@given(fusion_inputs(), st.integers(0, 9))
def test_a_full_draft_valid_changes_nothing_and_a_shorter_one_keeps_a_prefix_of_sources(inp, cut):
    draft, lookup, match_len, valid, k, cfg = inp
    full = fuse(draft, lookup, match_len, valid, k, cfg)
    same = fuse(draft, lookup, match_len, valid, k, cfg, draft_valid=len(draft))
    assert same.tokens.tolist() == full.tokens.tolist() and same.sources.tolist() == full.sources.tolist()
    dv = min(cut, len(draft))
    f = fuse(draft, lookup, match_len, valid, k, cfg, draft_valid=dv)
    for i, (tok, src) in enumerate(zip(f.tokens.tolist(), f.sources.tolist())):
        if src == SOURCE_LOOKUP:
            assert i < valid and tok == lookup[i]
        else:  # a drafter token only where the drafter supplied one
            assert i < dv and tok == draft[i]
    assert f.agree_count <= dv

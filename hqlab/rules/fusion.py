"""Fusion of the context lookup with the model drafter for one request: the one reference of SPEC §2.4.

The verify block has `k` proposed positions (k + 1 verified with the bonus token). The drafter fills only the
first `head_len = min(draft_block, k)` of them, the **head**; the remaining positions, the **tail**, are ones
nobody but the lookup can fill. Per request, with the lookup's `match_len` and `valid` (how many of its tokens
are real):

- `agree_count` = index of the first head position where drafter != lookup, capped by `valid` (positions the
  lookup did not supply never count as agreement). Only the first min(head_len, valid) positions are compared.
- head taken  iff match_len >= nstrong, or (match_len >= nmin and agree_count >= agree).
  Replacing the drafter is a bet; a shorter match needs the drafter's confirmation.
- tail taken  iff match_len >= nmin_tail and (head taken, or the drafter agreed over the whole head,
  i.e. agree_count == head_len). Tail positions are free: nobody else proposed them.
- only positions the lookup supplied (idx < valid) are overwritten.
- take_flag   = match_len >= longmin and valid > draft_block and tail taken ("has something for the tail"); it
  feeds the adaptive scheduler (`hqlab.rules.schedule`).

What the fused block contains, position by position (this is hqlab's precise reading of the rules above):

- head positions idx < head_len: the lookup token if the head was taken and idx < valid, else the drafter's.
  So a taken head with valid < head_len is lookup tokens followed by the drafter's remaining ones.
- tail positions head_len <= idx < k: the lookup token if the tail was taken and idx < valid. A tail position the
  lookup did not supply cannot be filled by anyone, so the block simply **ends** there: the fused block has
  `max(head_len, valid)` tokens when the tail was taken and `head_len` tokens otherwise (never more than k).
- sources: LOOKUP where a lookup token was written, DRAFT elsewhere. When the tail is taken only through full
  agreement (head not taken), the head keeps the drafter's tokens (equal to the lookup's) tagged DRAFT: the head
  was not taken, and for sampled verification those positions use the drafter's q.

Why the head is not truncated after a partial lookup head: the rule only overwrites supplied positions, and the
drafter positions after it are still valid proposals (verification decides every token). For sampled verification
a drafter token after a lookup prefix was drawn from the drafter's q given the drafter's own prefix; that q is the
distribution the token was drawn from, so rejection sampling with it stays exact.

The take flag can only be true when the lookup was asked for more than draft_block tokens: an engine running the
adaptive scheduler fuses with the long k every step and clips the block to the scheduled length afterwards
(clipping keeps a prefix, so it never changes the decisions above).

Arctic's score-based rule (`rule="score"`): keep the lookup (suffix) draft if its score >= the drafter's draft
length (head_len), else the drafter's draft. Arctic's score is the sum of the suffix tokens' probabilities; hqlab's
lookup has no probabilities, so the score is an input, and **hqlab's adaptation**: when it is None the score is
`valid`, i.e. every supplied token counts as probability 1 (so the lookup wins whenever it supplies at least a
full head). Under this rule nstrong, nmin, agree and nmin_tail are unused; the kept lookup draft is its `valid`
tokens, all LOOKUP (head and tail both count as taken); the take flag keeps the formula above.

A step without the drafter (`draft_valid`, the proposer's `skip` setting: a request copying in the long block
drafts nothing, HyperQwen's "skip the drafter where the lookup alone decides"): the drafter supplied only its first
`draft_valid` head tokens (0: none). Positions it did not supply are proposed by nobody, so, as with the tail, the
block ends at the first head position nobody filled: a taken head keeps its lookup tokens (and any drafter tokens
after them), an untaken head keeps the drafter's `draft_valid` tokens; `agree_count` counts only supplied drafter
positions, so without the drafter only the nstrong branch (or agree = 0) can take the head. With `draft_valid`
None (the default) the drafter supplied the whole head and nothing above changes.

`nmin_alone` (0 = off, the default): a step whose drafter supplied nothing (`draft_valid` = 0) also takes the head
at a match of at least `nmin_alone`. The head rule weighs the lookup against the drafter; with no drafter token
there is nothing to weigh it against, and an engine that verifies a fixed width (vLLM's asynchronous path) pays for
every position whether proposed or not, so a short match's tokens cost nothing there. hqlab's addition, not
HyperQwen's: with it a skipped step after a copy breaks still proposes what the lookup finds.

Source codes: `hqlab.trace.Source` (the step contract, a floor below the rules); `SOURCE_LOOKUP` and
`SOURCE_DRAFT` are its two codes as plain ints, for the int8 arrays here and the GPU twin's tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hqlab.config import require
from hqlab.trace import Source

SOURCE_LOOKUP = int(Source.LOOKUP)
SOURCE_DRAFT = int(Source.DRAFT)

RULES = ("threshold", "score")


@dataclass(frozen=True)
class FusionConfig:
    """Parameters of the fusion rule, SPEC §2.4. Defaults are the shipped set (`FusionConfig.shipped()`).

    nstrong:     a match this long takes the head on its own.
    nmin:        a match this long takes the head if the drafter agreed on the first `agree` positions.
    agree:       leading head positions where drafter and lookup must agree for the nmin branch.
    nmin_tail:   shortest match that may fill the tail.
    longmin:     shortest match for which the take flag can be set.
    draft_block: the drafter's width = head length (the short block of the scheduler).
    rule:        "threshold" (HyperQwen, the rules above) or "score" (Arctic, see the module docstring).
    nmin_alone:  0 = off; else a step without any drafter token takes the head at a match this long (threshold rule).
    """

    nstrong: int = 6
    nmin: int = 6
    agree: int = 0
    nmin_tail: int = 4
    longmin: int = 6
    draft_block: int = 7
    rule: str = "threshold"
    nmin_alone: int = 0

    def __post_init__(self) -> None:
        for name in ("nstrong", "nmin", "agree", "nmin_tail", "longmin", "nmin_alone"):
            value = getattr(self, name)
            require(value >= 0, f"{name} must be >= 0 (got {value}); it is a minimum match or agreement length")
        require(self.draft_block >= 1, f"draft_block must be >= 1 (got {self.draft_block}): the drafter's width")
        # agree_count never exceeds the head, so a larger agree would silently disable the nmin branch
        require(self.agree <= self.draft_block,
                 f"agree must be <= draft_block (got agree={self.agree}, draft_block={self.draft_block}); "
                 f"to disable the nmin branch set nmin above the lookup's nmax instead")
        require(self.rule in RULES, f"rule must be 'threshold' or 'score' (got {self.rule!r})")

    @classmethod
    def articles(cls, **overrides: Any) -> "FusionConfig":
        """The articles' defaults: nstrong 8, agree 2 (a shorter match must be confirmed by the drafter)."""
        return cls(**{"nstrong": 8, "agree": 2, **overrides})

    @classmethod
    def shipped(cls, **overrides: Any) -> "FusionConfig":
        """The defaults HyperQwen's code shipped with: nstrong 6, agree 0 (the dataclass defaults)."""
        return cls(**{"nstrong": 6, "agree": 0, **overrides})


@dataclass(frozen=True)
class Fused:
    """The fused proposal of one request and the decisions that produced it.

    tokens:      int64 [n], n = head_len, or max(head_len, valid) when the tail was taken (fewer when the drafter
                 supplied only part of the head: the block ends where nobody filled it).
    sources:     int8 [n], SOURCE_LOOKUP or SOURCE_DRAFT per position.
    head_len:    min(draft_block, k): positions the drafter filled.
    agree_count: leading head positions where drafter == lookup, capped by valid.
    head_taken:  the head rule's decision (positions idx < valid of the head hold lookup tokens).
    tail_taken:  the tail rule's decision (tail positions idx < valid were appended; there may be none).
    take_flag:   match_len >= longmin and valid > draft_block and tail_taken.
    draft_valid: head positions the drafter supplied (head_len unless the step skipped the drafter).
    """

    tokens: np.ndarray
    sources: np.ndarray
    head_len: int
    agree_count: int
    head_taken: bool
    tail_taken: bool
    take_flag: bool
    draft_valid: int

    @property
    def tail_len(self) -> int:
        """Tail positions actually filled (by the lookup)."""
        return max(0, int(self.tokens.shape[0]) - self.head_len)


def agree_count(draft_tokens: np.ndarray, lookup_tokens: np.ndarray, valid: int) -> int:
    """Index of the first position where drafter != lookup over min(len(draft), valid) positions."""
    n = min(int(draft_tokens.shape[0]), valid)
    mismatch = np.flatnonzero(draft_tokens[:n] != lookup_tokens[:n])
    return int(mismatch[0]) if mismatch.size else n


def fuse(
    draft_tokens: Sequence[int] | np.ndarray,
    lookup_tokens: Sequence[int] | np.ndarray,
    match_len: int,
    valid: int,
    k: int,
    config: FusionConfig,
    lookup_score: float | None = None,
    draft_valid: int | None = None,
) -> Fused:
    """Fuse one request's drafter head with its lookup proposal (see the module docstring for the rules).

    draft_tokens:  exactly head_len = min(config.draft_block, k) drafter tokens (entries from `draft_valid` on are
                   ignored, padding). To respect a token budget, fuse the full block and clip the result (a prefix)
                   afterwards.
    lookup_tokens: at least `valid` tokens; entries from `valid` on are ignored (padding).
    match_len:     the lookup's match length (0 = no match).
    valid:         how many lookup tokens are real, 0 <= valid <= k.
    k:             positions in the verify block (>= 1).
    lookup_score:  only read by rule="score"; None means `valid` (hqlab's adaptation).
    draft_valid:   how many head tokens the drafter supplied, 0 <= draft_valid <= head_len; None: all of them.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    head_len = min(config.draft_block, k)
    draft = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    lookup = np.asarray(lookup_tokens, dtype=np.int64).reshape(-1)
    if draft.shape[0] != head_len:
        raise ValueError(f"need exactly min(draft_block, k) = {head_len} drafter tokens, got {draft.shape[0]}")
    if not 0 <= valid <= k:
        raise ValueError(f"valid must be in [0, k={k}] (got {valid})")
    if lookup.shape[0] < valid:
        raise ValueError(f"lookup supplies {lookup.shape[0]} tokens but valid = {valid}")
    if match_len < 0:
        raise ValueError(f"match_len must be >= 0 (got {match_len})")
    supplied = head_len if draft_valid is None else int(draft_valid)
    if not 0 <= supplied <= head_len:
        raise ValueError(f"draft_valid must be in [0, head_len={head_len}] (got {draft_valid})")
    lookup = lookup[:valid]
    agreed = agree_count(draft[:supplied], lookup, valid)

    if config.rule == "score":
        score = float(valid) if lookup_score is None else float(lookup_score)
        if not (math.isfinite(score) and 0.0 <= score <= valid + 1e-6):
            raise ValueError(f"lookup_score must be a sum of {valid} probabilities, in [0, {valid}] (got {score})")
        keep_lookup = score >= head_len
        if keep_lookup:
            tokens = lookup.copy()
            sources = np.full(valid, SOURCE_LOOKUP, dtype=np.int8)
        else:
            tokens = draft[:supplied].copy()
            sources = np.full(supplied, SOURCE_DRAFT, dtype=np.int8)
        take = match_len >= config.longmin and valid > config.draft_block and keep_lookup
        return Fused(tokens, sources, head_len, agreed, keep_lookup, keep_lookup, bool(take), supplied)

    head_taken = match_len >= config.nstrong or (match_len >= config.nmin and agreed >= config.agree) or (
        config.nmin_alone > 0 and supplied == 0 and match_len >= config.nmin_alone)
    tail_taken = match_len >= config.nmin_tail and (head_taken or agreed == head_len)
    take = match_len >= config.longmin and valid > config.draft_block and tail_taken

    n = max(head_len, valid) if tail_taken else head_len
    # the head ends where nobody filled it: after the lookup's tokens (taken head) or the drafter's, whichever is
    # longer; a gap in the head means valid < head_len, so there is no tail after it either
    filled = max(min(head_len, valid), supplied) if head_taken else supplied
    if filled < head_len:
        n = filled
    tokens = np.empty(max(n, head_len), dtype=np.int64)
    sources = np.full(max(n, head_len), SOURCE_DRAFT, dtype=np.int8)
    tokens[:head_len] = draft
    if head_taken:
        m = min(head_len, valid)
        tokens[:m] = lookup[:m]
        sources[:m] = SOURCE_LOOKUP
    if n > head_len:  # tail taken and the lookup supplied tail positions
        tokens[head_len:] = lookup[head_len:n]
        sources[head_len:] = SOURCE_LOOKUP
    return Fused(tokens[:n], sources[:n], head_len, agreed, bool(head_taken), bool(tail_taken), bool(take), supplied)


def drafter_drawn(fused: Fused, match_len: int, valid: int, config: FusionConfig) -> np.ndarray:
    """bool [n]: the positions of a fused block whose token is the drafter's draw whichever way the head rule went,
    so that a sampling drafter's q is the distribution they were proposed from (sampled verification checks them
    against q; every other position is a point mass, exact for any token).

    DRAFT positions are; so are the first min(agree, valid) head positions of a head taken through the agreement
    branch (nmin <= match < nstrong, agree >= 1): there the lookup's token equals the drafter's, the head decision
    depends on those very draws, and had the draw disagreed the position would hold the draw anyway. Verifying them
    as point masses and the disagreeing draws against q would not be lossless: with p = (.5, .5), q = (.9, .1) and
    the lookup proposing token 0 the output is (.45, .55) (tests/rules/test_fusion_sampling.py). A head taken by
    match length alone (nstrong, agree = 0, nmin_alone) and the tail never depend on the position's own draw."""
    drawn = fused.sources == SOURCE_DRAFT
    by_agreement = (config.rule == "threshold" and fused.head_taken and config.agree > 0
                    and match_len < config.nstrong and match_len >= config.nmin
                    and fused.agree_count >= config.agree)
    if by_agreement:
        drawn = drawn.copy()
        drawn[:min(config.agree, valid, fused.head_len, drawn.shape[0])] = True
    return drawn


def fuse_batch(
    draft_tokens: Sequence[Sequence[int] | np.ndarray],
    lookup_tokens: Sequence[Sequence[int] | np.ndarray],
    match_lens: Sequence[int],
    valids: Sequence[int],
    k: int | Sequence[int],
    config: FusionConfig,
    lookup_scores: Sequence[float | None] | None = None,
) -> list[Fused]:
    """`fuse` per request; k may be one value or one per request. The single-request `fuse` is the rule."""
    n = len(draft_tokens)
    if not (len(lookup_tokens) == len(match_lens) == len(valids) == n):
        raise ValueError("draft_tokens, lookup_tokens, match_lens and valids need one entry per request")
    ks = [k] * n if isinstance(k, (int, np.integer)) else list(k)
    scores = [None] * n if lookup_scores is None else list(lookup_scores)
    if len(ks) != n or len(scores) != n:
        raise ValueError("k and lookup_scores, when given per request, need one entry per request")
    return [
        fuse(draft_tokens[i], lookup_tokens[i], int(match_lens[i]), int(valids[i]), int(ks[i]), config, scores[i])
        for i in range(n)
    ]


__all__ = ["FusionConfig", "Fused", "fuse", "fuse_batch", "agree_count", "drafter_drawn", "SOURCE_LOOKUP",
           "SOURCE_DRAFT", "RULES"]

"""Arctic's suffix decoding as a pure rule (SuffixDecoding, Oliaro et al.; Arctic Inference 0.3.0's
`SuffixDecodingCache.speculate`, `SuffixTree::speculate` and `SuffixTree::_speculate_path`, Apache-2.0),
reimplemented over occurrence counts instead of a suffix tree, so that hqlab's replay can run it without the
compiled extension (which `make arctic` builds into the vLLM environment only).

What Arctic does, and what `speculate` computes:

- Two trees: the request's own (its prompt, then its output as it grows: `start_request`, `add_active_response`)
  and a global one holding the outputs of earlier requests (up to `max_cached_requests`, evicted oldest first) and,
  because `add_active_response` extends both, the request's own output so far.
- A node's count is the number of suffixes that end at or pass through it, every suffix cut at `depth` tokens:
  the count of a string u is the number of its occurrences (|u| <= depth) in the tree's sequences. The context's
  own occurrence at the end of the request's history counts in the own tree.
- `speculate(context)`, context = the history's last `depth` tokens: for every match length m = 1 .. len(context)
  - 1 while the last m tokens occur in the tree, walk the most frequent continuation (`_speculate_path`): the
  probability starts at 1 and is multiplied by count(w x) / count(w) (in float32) at each token; the walk stops
  before a token whose probability falls below `min_prob`, after min(k, int(m × factor + offset + 1e-6)) tokens, or
  where the tree ends; the draft's score is the sum of its tokens' probabilities, and the best score over m wins,
  ties to the longer match (`>=`).
- The own tree's draft wins ties with the global tree's (`draft1.score >= draft2.score`).

Approximated: which of several equally frequent next tokens Arctic takes. Its tree keeps each node's children in
decreasing count and, among equal counts, in an order that depends on the order the counts grew; here among tokens
seen once the first seen wins, among more frequent ones the one seen last (`_tie`). Everything else above is
Arctic's. Path (not tree) speculation only, as vLLM uses it. Checked against Arctic's compiled cache on the
committed corpus and labd/chat traces (tests/replay/test_zoo.py, where Arctic is installed): 99 % of proposals
are identical at every output position; the others are ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hqlab.config import require


@dataclass(frozen=True)
class SuffixDecodingConfig:
    """k: most tokens per step; depth: the trees' depth (longest match plus continuation; vLLM's default 24);
    factor, offset: at most factor × match length + offset tokens; min_prob: stop below this probability."""

    k: int = 15
    depth: int = 24
    factor: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1

    def __post_init__(self) -> None:
        require(self.k >= 1, f"k must be >= 1 (got {self.k})")
        require(self.depth >= 2, f"depth must be >= 2 (got {self.depth})")
        require(self.factor >= 0 and self.offset >= 0, "factor and offset must be >= 0")
        require(0.0 <= self.min_prob <= 1.0, f"min_prob must be in [0, 1] (got {self.min_prob})")


@dataclass(frozen=True)
class SuffixDraft:
    tokens: np.ndarray
    score: float
    match_len: int
    from_global: bool = False


def _joined(seqs: Sequence[np.ndarray]) -> np.ndarray:
    """The sequences with a separator (-1, never a token) after each: no occurrence spans two of them."""
    parts = []
    for s in seqs:
        parts += [np.asarray(s, dtype=np.int64), np.full(1, -1, dtype=np.int64)]
    return np.concatenate(parts) if parts else np.full(1, -1, dtype=np.int64)


def _tie(tied: np.ndarray, tokens: np.ndarray, first: np.ndarray, top: int, nxt: np.ndarray,
         at: np.ndarray) -> int:
    """Which of several equally frequent next tokens: Arctic appends a new child at the end of its siblings (so among
    children seen once, the first one seen leads), and moves a child whose count grows ahead of the siblings it now
    ties with (so among more frequent ones, the one that reached the count last, i.e. occurred last, leads)."""
    if top == 1:
        return int(tied[np.argmin(first[tied])])
    last = np.array([at[nxt == tokens[i]].max() for i in tied])
    return int(tied[np.argmax(last)])


def _path(joined: np.ndarray, ends: np.ndarray, m: int, max_tokens: int,
          config: SuffixDecodingConfig) -> tuple[np.ndarray, float]:
    """`_speculate_path` from the occurrences ending at `ends` of a string of length m."""
    prob, score = np.float32(1.0), np.float32(0.0)
    out: list[int] = []
    cur, length = ends, m
    while len(out) < max_tokens and prob >= config.min_prob and length < config.depth:
        nxt = joined[cur + 1]
        keep = nxt >= 0  # occurrences at a sequence's end count in count(w) but have no next token
        if not keep.any():
            break
        tokens, first, counts = np.unique(nxt[keep], return_index=True, return_counts=True)
        top = counts.max()
        tied = np.flatnonzero(counts == top)
        pick = tied[0] if tied.size == 1 else _tie(tied, tokens, first, top, nxt[keep], cur[keep] + 1)
        prob = np.float32(prob * (np.float32(top) / np.float32(cur.size)))
        if prob < config.min_prob:
            break
        x = int(tokens[pick])
        out.append(x)
        score = np.float32(score + prob)
        cur = cur[keep][nxt[keep] == x] + 1
        length += 1
    return np.asarray(out, dtype=np.int64), float(score)


def tree_speculate(seqs: Sequence[np.ndarray], context: np.ndarray, max_spec: int,
                   config: SuffixDecodingConfig) -> SuffixDraft:
    """`SuffixTree::speculate` of a tree holding `seqs`, for `context` (at most `depth` tokens)."""
    context = np.asarray(context, dtype=np.int64)
    best = SuffixDraft(np.empty(0, dtype=np.int64), 0.0, 0)
    if context.size < 2 or max_spec <= 0:
        return best
    joined = _joined(seqs)
    ends = np.flatnonzero(joined == context[-1])  # occurrences of the context's last m tokens, by their end
    for m in range(1, context.size):
        if m > 1:
            ends = ends[ends - (m - 1) >= 0]
            ends = ends[joined[ends - (m - 1)] == context[-m]]
        if ends.size == 0:
            break
        max_tokens = max(min(max_spec, int(m * config.factor + config.offset + 1e-6)), 0)
        tokens, score = _path(joined, ends, m, max_tokens, config)
        if score >= best.score:
            best = SuffixDraft(tokens, score, m)
    return best


def speculate(history: np.ndarray, output_start: int, earlier: Sequence[np.ndarray] | None, budget: int,
              config: SuffixDecodingConfig) -> SuffixDraft:
    """`SuffixDecodingCache.speculate` for a request whose `history` is its prompt (the first `output_start`
    tokens) and its output so far; `earlier`: the outputs in the global tree (None: no global tree, Arctic's
    max_cached_requests = 0). At most min(k, budget) tokens."""
    h = np.asarray(history, dtype=np.int64)
    require(0 <= output_start <= h.size, f"output_start must lie in the history (got {output_start} of {h.size})")
    n = min(config.k, int(budget))
    context = h[-config.depth:]
    own = tree_speculate([h], context, n, config)
    if earlier is None:
        return own
    glob = tree_speculate([*earlier, h[output_start:]], context, n, config)
    if own.score >= glob.score:
        return own
    return SuffixDraft(glob.tokens, glob.score, glob.match_len, True)


__all__ = ["SuffixDecodingConfig", "SuffixDraft", "speculate", "tree_speculate"]

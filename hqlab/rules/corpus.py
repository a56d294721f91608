"""Lookup beyond one request: a bounded corpus of earlier documents searched with the suffix-match rule (#42).

The one reference implementation of the corpus rule. Every other implementation (the Triton kernel
`hqlab_kernels.corpus_match`, the vLLM speculator's corpus, the replay) is tested decision for decision against it.

Stable API (imported by the replay sweeps and the vLLM benchmark's exactness check):

    CorpusConfig(tokens, docs=1024, policy="own", prompts=False)   validated, frozen
    corpus = Corpus(config)
    seq = corpus.add(document_tokens)             -> the document's insertion number (0, 1, 2, ...), or -1 if empty
    corpus.match(history, nmin=, nmax=, k=, policy="recent"|"earliest") -> CorpusMatch
    choose(own: Match, corpus: Match, policy="own"|"longest")          -> (source, Match), source in SOURCES
    propose(history, corpus, nmin=, nmax=, k=, policy=, choice=)      -> (source, Match): own lookup + corpus + choose
    corpus.documents -> [(seq, tokens)] live, oldest first;  corpus.live_tokens;  corpus.inserted

The corpus (what it holds). Documents are token sequences added whole: a finished request's output, or with
`prompts` its prompt followed by its output (one document, so a match in the prompt may continue into the answer).
The corpus is bounded by `tokens` (the total tokens of the live documents) and by `docs` (how many documents).

Eviction: first in, first out, by whole documents. Adding a document evicts the oldest documents until both bounds
hold with it; a document longer than `tokens` keeps only its last `tokens` tokens (its head is its oldest part).
Why FIFO by age rather than LRU or by usefulness: (1) the reuse this corpus is for is recent (the previous turn's
answer, the template filled a moment ago), so age is the signal; (2) on the GPU the live documents then sit
contiguously in one ring buffer, so eviction is moving a head pointer, with no compaction and no per-hit
bookkeeping; (3) a hit-driven rule (LRU) would need each step's match read back to the host, a synchronisation the
GPU speculator never makes, and would make the corpus's content depend on timing a replay cannot see. Bounding
by tokens rather than documents alone is what bounds the memory and the per-step search cost (both linear in the
tokens); the document bound sizes the GPU's document table.

The match (SPEC §2.1 over the corpus). The live documents, concatenated oldest first, give every corpus token a
position c. A candidate is a position e inside a document d (d[0..L-1]) with d[e-i] == h[t-i] for i < n, where h is
the request's history (h[t] its last token) and n >= nmin; the match never crosses the document's start (e-i >= 0
in d) nor the history's start (t-i >= 0), and its length is capped at nmax like the own-history rule. What it
proposes is what followed in that document, d[e+1 .. e+k] clipped at the document's end, so e <= L-2 (a match at
a document's last token proposes nothing and is no candidate). Order: longest (capped) first, then the most recent
corpus position (policy "recent") or the earliest ("earliest") -- the packed score (min(n, nmax) << 32) | c of the
kernels, with c the position in the concatenation.

Which source wins (`choose`): policy "own" takes the request's own-history match whenever it has one and the
corpus's only when it has none; "longest" takes the longer (capped) match, ties to own history.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from hqlab.config import require
from hqlab.rules.lookup import NO_MATCH_END, Match, suffix_match

CHOICE_POLICIES = ("own", "longest")
TIE_POLICIES = ("recent", "earliest")
OWN, CORPUS, NONE = "own", "corpus", "none"
SOURCES = (OWN, CORPUS, NONE)


@dataclass(frozen=True)
class CorpusConfig:
    """A corpus of recent documents.

    tokens:  most tokens kept over all live documents (the memory and the per-step search cost are linear in it).
    docs:    most documents kept (bounds the host's table of live documents; the GPU ring needs none).
    policy:  which source wins when both match: "own" (own history first, the corpus only without an own match) or
             "longest" (the longer capped match; ties go to own history).
    prompts: also add each finished request's prompt (as one document, prompt then output); default outputs only.
    """

    tokens: int
    docs: int = 1024
    policy: str = "own"
    prompts: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.tokens, int) and self.tokens >= 1,
                f"corpus tokens must be an int >= 1 (got {self.tokens!r}); 0 means no corpus: leave it out")
        require(self.tokens < 2**31, f"corpus tokens must be < 2^31 (positions are 32-bit), got {self.tokens}")
        require(isinstance(self.docs, int) and self.docs >= 1, f"corpus docs must be an int >= 1 (got {self.docs!r})")
        require(self.policy in CHOICE_POLICIES,
                f"corpus policy must be one of {CHOICE_POLICIES} (got {self.policy!r})")
        require(isinstance(self.prompts, bool), f"corpus prompts must be a bool (got {self.prompts!r})")


@dataclass(frozen=True)
class CorpusMatch(Match):
    """A corpus match: `end` is the corpus position c of the match's last token (in the concatenation of the live
    documents at the time of the match), `doc` the insertion number of the document it lies in (-1: no match)."""

    doc: int = -1

    @staticmethod
    def none(dtype: np.dtype = np.dtype(np.int64)) -> "CorpusMatch":
        return CorpusMatch(NO_MATCH_END, 0, 0, np.empty(0, dtype=dtype), -1)


def _check_match_params(nmin: int, nmax: int, k: int, policy: str) -> None:
    require(1 <= nmin <= nmax, f"need 1 <= nmin <= nmax (got nmin={nmin}, nmax={nmax})")
    require(k >= 1, f"k must be >= 1 (got {k})")
    require(policy in TIE_POLICIES, f"policy must be one of {TIE_POLICIES} (got {policy!r})")


def match_document(doc: np.ndarray, history: np.ndarray, *, nmin: int, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Every candidate end e in one document and its capped match length: (ends, lengths), ends ascending.

    The module docstring's rule restricted to one document; `Corpus.match` orders candidates across documents."""
    d, h = np.asarray(doc), np.asarray(history)
    t = h.shape[0] - 1
    empty = np.empty(0, dtype=np.int64)
    # e needs room for nmin tokens in the document (e >= nmin-1), something after it (e <= L-2), and the history
    # needs nmin tokens (t >= nmin-1).
    lo, hi = nmin - 1, d.shape[0] - 2
    if t < nmin - 1 or hi < lo:
        return empty, empty
    ends = np.arange(lo, hi + 1, dtype=np.int64)
    ends = ends[d[ends] == h[t]]
    for i in range(1, nmin):
        if ends.size == 0:
            return empty, empty
        ends = ends[d[ends - i] == h[t - i]]
    lengths = np.full(ends.shape, nmin, dtype=np.int64)
    alive = np.ones(ends.shape, dtype=bool)
    for i in range(nmin, nmax):
        if t - i < 0:  # the match cannot run past the history's start
            break
        pos = ends - i
        ok = alive & (pos >= 0)  # nor past the document's start
        ok[ok] = d[pos[ok]] == h[t - i]
        alive = ok
        if not alive.any():
            break
        lengths += alive
    return ends, lengths


class Corpus:
    """The reference corpus: live documents oldest first, FIFO eviction of whole documents (module docstring)."""

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config
        self._docs: deque[tuple[int, np.ndarray]] = deque()
        self.live_tokens = 0
        self.inserted = 0  # documents ever added (the next insertion number)

    @property
    def documents(self) -> list[tuple[int, np.ndarray]]:
        """(insertion number, tokens) of every live document, oldest first."""
        return list(self._docs)

    def add(self, tokens: np.ndarray | list[int]) -> int:
        """Add one document (1-D integer tokens), evicting the oldest documents as the bounds require.

        Returns its insertion number; an empty document is not added, takes no number and returns -1."""
        doc = np.asarray(tokens, dtype=np.int64).copy()
        if doc.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {doc.shape}")
        if doc.shape[0] == 0:
            return -1
        cap = self.config.tokens
        if doc.shape[0] > cap:
            doc = doc[-cap:]
        while self._docs and (self.live_tokens + doc.shape[0] > cap or len(self._docs) + 1 > self.config.docs):
            _, old = self._docs.popleft()
            self.live_tokens -= old.shape[0]
        seq = self.inserted
        self._docs.append((seq, doc))
        self.live_tokens += doc.shape[0]
        self.inserted += 1
        return seq

    def match(self, history: np.ndarray, *, nmin: int, nmax: int, k: int, policy: str = "recent") -> CorpusMatch:
        """The best corpus match for `history` (1-D integer array) and what followed it (module docstring)."""
        _check_match_params(nmin, nmax, k, policy)
        h = np.asarray(history)
        if h.ndim != 1:
            raise ValueError(f"history must be 1-D, got shape {h.shape}")
        best: tuple[int, int] | None = None  # (length, corpus position), compared under the policy
        where: tuple[int, np.ndarray, int] | None = None  # (doc number, doc tokens, end in doc)
        base = 0
        for seq, doc in self._docs:
            ends, lengths = match_document(doc, h, nmin=nmin, nmax=nmax)
            if ends.size:
                n = int(lengths.max())
                tied = ends[lengths == n]
                e = int(tied.max() if policy == "recent" else tied.min())
                c = base + e
                better = best is None or n > best[0] or (n == best[0] and (c > best[1] if policy == "recent"
                                                                         else c < best[1]))
                if better:
                    best, where = (n, c), (seq, doc, e)
            base += doc.shape[0]
        if best is None or where is None:
            return CorpusMatch.none(h.dtype)
        seq, doc, e = where
        valid = min(k, doc.shape[0] - 1 - e)
        return CorpusMatch(best[1], best[0], valid, doc[e + 1 : e + 1 + valid].astype(h.dtype), seq)


def choose(own: Match, corpus: Match, policy: str = "own") -> tuple[str, Match]:
    """Which proposal a step drafts: (OWN | CORPUS | NONE, the winning match) under policy "own" or "longest"."""
    require(policy in CHOICE_POLICIES, f"policy must be one of {CHOICE_POLICIES} (got {policy!r})")
    if policy == "own":
        corpus_wins = own.match_len == 0 and corpus.match_len > 0
    else:
        corpus_wins = corpus.match_len > own.match_len
    if corpus_wins:
        return CORPUS, corpus
    if own.match_len > 0:
        return OWN, own
    return NONE, own


def propose(history: np.ndarray, corpus: Corpus, *, nmin: int, nmax: int, k: int, policy: str = "recent",
            search: int = 0, choice: str | None = None) -> tuple[str, Match]:
    """One step's draft with a corpus: the own-history lookup (`suffix_match`), the corpus match, `choose`.

    choice: the choice policy; None takes the corpus config's."""
    h = np.asarray(history)
    own = suffix_match(h, nmin=nmin, nmax=nmax, k=k, search=search, policy=policy)
    found = corpus.match(h, nmin=nmin, nmax=nmax, k=k, policy=policy)
    return choose(own, found, corpus.config.policy if choice is None else choice)


__all__ = ["CorpusConfig", "Corpus", "CorpusMatch", "choose", "propose", "match_document", "CHOICE_POLICIES",
           "TIE_POLICIES", "SOURCES", "OWN", "CORPUS", "NONE"]

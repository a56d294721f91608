"""The corpus rule against a literal transcription of its docstring (property tests + hand-checked cases)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab.config import ConfigError
from hqlab.rules.corpus import CORPUS, NONE, OWN, Corpus, CorpusConfig, choose, propose
from hqlab.rules.lookup import Match, suffix_match


def brute_force(docs, h, nmin, nmax, k, policy):
    """Try every (document, e), measure the match token by token, keep the best by (len, corpus position)."""
    t = len(h) - 1
    best = None  # (key, seq, doc, e, n, c)
    base = 0
    for seq, d in docs:
        d = list(d)
        for e in range(len(d)):
            if e + 1 >= len(d):  # nothing follows
                continue
            n = 0
            while n < nmax and e - n >= 0 and t - n >= 0 and d[e - n] == h[t - n]:
                n += 1
            if n < nmin:
                continue
            c = base + e
            key = (n, c) if policy == "recent" else (n, -c)
            if best is None or key > best[0]:
                best = (key, seq, d, e, n, c)
        base += len(d)
    if best is None:
        return (-1, 0, 0, [], -1)
    _, seq, d, e, n, c = best
    valid = min(k, len(d) - 1 - e)
    return (c, n, valid, d[e + 1 : e + 1 + valid], seq)


def run(corpus, h, **kw):
    m = corpus.match(np.asarray(h, dtype=np.int64), **kw)
    return (m.end, m.match_len, m.valid, m.tokens.tolist(), m.doc)


def fifo_reference(config, adds):
    """Eviction spelled out: keep the newest documents whose total fits, at most `docs` of them."""
    docs = []
    for seq, d in enumerate(a for a in adds if len(a)):
        d = list(d)[-config.tokens:]
        docs.append((seq, d))
        while sum(len(x) for _, x in docs) > config.tokens or len(docs) > config.docs:
            docs.pop(0)
    return docs


alphabet = st.sampled_from([2, 3, 8, 40])
documents = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=30), min_size=0, max_size=8)


@settings(max_examples=1500, deadline=None)
@given(
    adds=documents,
    h=st.lists(st.integers(0, 7), min_size=0, max_size=30),
    small=st.booleans(),
    cap=st.integers(1, 120),
    max_docs=st.integers(1, 9),
    nmin=st.integers(1, 5),
    extra=st.integers(0, 8),
    k=st.integers(1, 12),
    policy=st.sampled_from(["recent", "earliest"]),
)
def test_matches_brute_force(adds, h, small, cap, max_docs, nmin, extra, k, policy):
    if small:  # a small alphabet: many matches and ties across documents
        adds = [[x % 2 for x in d] for d in adds]
        h = [x % 2 for x in h]
    config = CorpusConfig(tokens=cap, docs=max_docs)
    corpus = Corpus(config)
    for d in adds:
        corpus.add(d)
    live = fifo_reference(config, adds)
    assert [(s, d.tolist()) for s, d in corpus.documents] == live
    assert corpus.live_tokens == sum(len(d) for _, d in live) <= cap
    kw = dict(nmin=nmin, nmax=nmin + extra, k=k, policy=policy)
    assert run(corpus, h, **kw) == brute_force(live, h, **kw)


def test_proposal_is_what_followed_and_clipped_at_the_document_end():
    corpus = Corpus(CorpusConfig(tokens=100))
    assert corpus.add([1, 2, 3, 4, 5, 6]) == 0
    assert corpus.add([9, 1, 2, 3, 7]) == 1
    # history ends in "1 2 3": both documents match 3 tokens; recent -> document 1 (corpus position 6 + 3 = 9)
    assert run(corpus, [5, 1, 2, 3], nmin=2, nmax=8, k=4) == (9, 3, 1, [7], 1)
    # earliest -> document 0 at e = 2, and its continuation 4 5 6 (clipped by k = 2 here)
    assert run(corpus, [5, 1, 2, 3], nmin=2, nmax=8, k=2, policy="earliest") == (2, 3, 2, [4, 5], 0)
    # a match at a document's last token proposes nothing: "3 7" ends document 1
    assert run(corpus, [3, 7], nmin=2, nmax=8, k=4)[1] == 0


def test_match_never_spans_two_documents_nor_runs_past_the_history():
    corpus = Corpus(CorpusConfig(tokens=100))
    corpus.add([1, 2])
    corpus.add([3, 4, 5])
    # "2 3 4" exists only across the boundary: the match is "3 4" (2 tokens, from the second document's start)
    assert run(corpus, [2, 3, 4], nmin=1, nmax=8, k=3) == (3, 2, 1, [5], 1)
    assert run(corpus, [2, 3, 4], nmin=3, nmax=8, k=3)[1] == 0
    # a one-token history matches one token at most, even where the document has more in common before it
    assert run(corpus, [4], nmin=1, nmax=8, k=3) == (3, 1, 1, [5], 1)
    assert run(corpus, [], nmin=1, nmax=8, k=3)[1] == 0


def test_fifo_eviction_of_whole_documents():
    corpus = Corpus(CorpusConfig(tokens=10, docs=3))
    for d in ([1] * 4, [2] * 4, [3] * 2):
        corpus.add(d)
    assert [s for s, _ in corpus.documents] == [0, 1, 2] and corpus.live_tokens == 10
    corpus.add([4] * 3)  # 13 > 10: the oldest document goes whole
    assert [s for s, _ in corpus.documents] == [1, 2, 3] and corpus.live_tokens == 9
    corpus.add([5])  # fits in tokens, but a fourth document exceeds docs=3
    assert [s for s, _ in corpus.documents] == [2, 3, 4]
    assert corpus.add([]) == -1 and corpus.inserted == 5  # empty: no number, nothing evicted
    assert corpus.add(list(range(25))) == 5  # longer than the corpus: its last 10 tokens, alone
    assert [(s, d.tolist()) for s, d in corpus.documents] == [(5, list(range(15, 25)))]


def test_choose_policies():
    own = Match(5, 3, 2, np.array([1, 2]))
    long_corpus = Match(8, 4, 1, np.array([9]))
    short_corpus = Match(8, 3, 1, np.array([9]))
    none = Match.none()
    assert choose(own, long_corpus, "own") == (OWN, own)
    assert choose(none, long_corpus, "own") == (CORPUS, long_corpus)
    assert choose(own, long_corpus, "longest") == (CORPUS, long_corpus)
    assert choose(own, short_corpus, "longest") == (OWN, own)  # ties go to own history
    assert choose(none, none, "longest")[0] == NONE and choose(none, none, "own")[0] == NONE
    with pytest.raises(ConfigError, match="policy"):
        choose(own, none, "corpus")


def test_propose_reuses_the_lookup_rule():
    corpus = Corpus(CorpusConfig(tokens=64, policy="longest"))
    corpus.add([7, 8, 9, 10, 11, 12])
    h = np.array([8, 9, 1, 7, 8, 9], dtype=np.int64)  # own: "8 9" (2 tokens); corpus: "7 8 9" (3)
    source, m = propose(h, corpus, nmin=1, nmax=8, k=3)
    assert source == CORPUS and m.tokens.tolist() == [10, 11, 12]
    source, m = propose(h, corpus, nmin=1, nmax=8, k=3, choice="own")
    own = suffix_match(h, nmin=1, nmax=8, k=3)
    assert source == OWN and (m.end, m.match_len, m.tokens.tolist()) == (own.end, own.match_len, own.tokens.tolist())


@pytest.mark.parametrize("kw, fix", [
    (dict(tokens=0), "tokens"), (dict(tokens=8, docs=0), "docs"), (dict(tokens=8, policy="corpus"), "policy"),
    (dict(tokens=2**31), "2\\^31"), (dict(tokens=8, prompts=1), "prompts"),
])
def test_config_errors_say_what_to_fix(kw, fix):
    with pytest.raises(ConfigError, match=fix):
        CorpusConfig(**kw)

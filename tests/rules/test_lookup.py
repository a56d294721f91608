"""The lookup rule against a brute-force transcription of SPEC §2.1 (property tests + hand-checked tables)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hqlab.rules.lookup import suffix_match


def brute_force(h, nmin, nmax, k, search=0, policy="recent", full=False):
    """Literal reading of the spec: try every e < t, measure the match, keep the best by (len, recency)."""
    t = len(h) - 1
    best = None  # (len, e)
    for e in range(t):
        if search > 0 and e < t - search:
            continue
        if full and t - e < k:
            continue
        n = 0
        while n < nmax and e - n >= 0 and h[e - n] == h[t - n]:
            n += 1
        if n < nmin:
            continue
        key = (n, e) if policy == "recent" else (n, -e)
        if best is None or key > best[0]:
            best = (key, e, n)
    if best is None:
        return (-1, 0, 0, [])
    _, e, n = best
    valid = min(k, t - e)
    return (e, n, valid, list(h[e + 1 : e + 1 + valid]))


def run(h, **kw):
    m = suffix_match(np.asarray(h, dtype=np.int64), **kw)
    return (m.end, m.match_len, m.valid, m.tokens.tolist())


histories = st.one_of(
    st.lists(st.integers(0, 3), min_size=0, max_size=80),  # small alphabet: many matches and ties
    st.lists(st.integers(0, 50), min_size=0, max_size=80),  # large alphabet: few matches
    # periodic histories with a random period and a noisy tail
    st.tuples(st.integers(1, 9), st.integers(0, 60), st.lists(st.integers(0, 5), max_size=5)).map(
        lambda a: [i % a[0] for i in range(a[1])] + a[2]
    ),
)


@settings(max_examples=1500, deadline=None)
@given(
    h=histories,
    nmin=st.integers(1, 8),
    extra=st.integers(0, 8),
    k=st.integers(1, 20),
    search=st.sampled_from([0, 0, 1, 5, 17]),
    policy=st.sampled_from(["recent", "earliest"]),
    full=st.booleans(),
)
def test_matches_brute_force(h, nmin, extra, k, search, policy, full):
    kw = dict(nmin=nmin, nmax=nmin + extra, k=k, search=search, policy=policy, full=full)
    assert run(h, **kw) == brute_force(h, **kw)


def test_periodic_history_matches_its_own_period():
    # "- a\n- b\n- " style repetition with period 3: the overlapping match at e = t - 3 wins (most recent).
    h = [7, 8, 9] * 6
    e, n, valid, toks = run(h, nmin=2, nmax=12, k=15)
    assert (e, n) == (len(h) - 1 - 3, 12)
    assert valid == 3 and toks == [7, 8, 9]  # clipped at t


def test_longest_beats_recent_and_cap_makes_ties():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13
    h = np.array([1, 2, 3, 4, 50, 9, 3, 4, 60, 1, 2, 3, 4], dtype=np.int64)
    # suffix ...1 2 3 4: e=3 matches 4 tokens, e=7 matches 2 tokens (3 4). Longest wins.
    assert run(h, nmin=2, nmax=8, k=3) == (3, 4, 3, [50, 9, 3])
    # With nmax=2 both are capped at 2: the tie goes to the most recent end (7) ...
    assert run(h, nmin=2, nmax=2, k=3) == (7, 2, 3, [60, 1, 2])
    # ... or the earliest under the earliest policy.
    assert run(h, nmin=2, nmax=2, k=3, policy="earliest") == (3, 2, 3, [50, 9, 3])


def test_short_histories_and_nmin_edges():
    assert run([], nmin=1, nmax=3, k=4) == (-1, 0, 0, [])
    assert run([5], nmin=1, nmax=3, k=4) == (-1, 0, 0, [])
    assert run([5, 5], nmin=1, nmax=3, k=4) == (0, 1, 1, [5])
    # history of length nmin + 1 can match only with the overlapping end t-1 when all tokens are equal
    assert run([5, 5, 5], nmin=2, nmax=3, k=4) == (1, 2, 1, [5])
    assert run([5, 6, 5], nmin=2, nmax=3, k=4) == (-1, 0, 0, [])
    # a match of exactly nmin is found; nmin + 1 is required -> not found
    h = [1, 2, 3, 9, 1, 2, 3]
    assert run(h, nmin=3, nmax=5, k=2) == (2, 3, 2, [9, 1])
    assert run(h, nmin=4, nmax=5, k=2)[1] == 0


def test_search_window_and_full_continuation():
    h = [1, 2, 3, 70, 71, 72, 0, 0, 0, 0, 1, 2, 3, 80, 1, 2, 3]
    assert run(h, nmin=3, nmax=3, k=3)[0] == 12  # most recent
    assert run(h, nmin=3, nmax=3, k=4, full=True)[0] == 12  # t - e = 4 >= k: complete continuation
    assert run(h, nmin=3, nmax=3, k=5, full=True)[0] == 2  # e=12 has only 4 tokens after it
    assert run(h, nmin=3, nmax=3, k=3, search=3)[1] == 0  # e=12 is 4 back: outside a 3-token window


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_long_history_dtype(dtype):
    rng = np.random.default_rng(0)
    h = rng.integers(0, 1000, 50_000).astype(dtype)
    h[-8:] = h[1000:1008]
    m = suffix_match(h, nmin=6, nmax=12, k=15)
    assert m.end == 1007 and m.match_len >= 8 and m.tokens.tolist() == h[1008:1023].tolist()

"""Suffix-match lookup: the one reference implementation of SPEC §2.1.

Given one request's token history h[0..t], find an earlier end position e < t such that the last n tokens
before and including e equal the last n tokens of the history (h[e-i] == h[t-i] for i < n), and propose what
followed: h[e+1 .. e+k], clipped at t. The match may overlap the suffix itself, so a period-p repetition matches
at e = t - p.

Order of candidates: longest match first (length capped at nmax, so all matches of nmax or more tie), then the
most recent end (policy "recent") or the earliest (policy "earliest"). This is the order of the packed score
(min(len, nmax) << 32) | e that the GPU kernels maximise.

Every other implementation (Triton kernels, the vLLM adapter) is tested for bit-identical results against
`suffix_match`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_MATCH_END = -1


@dataclass(frozen=True)
class Match:
    """Result of one lookup. `tokens` has `valid` entries; `match_len` 0 means no match."""

    end: int
    match_len: int
    valid: int
    tokens: np.ndarray

    @staticmethod
    def none(dtype: np.dtype = np.dtype(np.int64)) -> "Match":
        return Match(NO_MATCH_END, 0, 0, np.empty(0, dtype=dtype))


def suffix_match(
    history: np.ndarray,
    *,
    nmin: int,
    nmax: int,
    k: int,
    search: int = 0,
    policy: str = "recent",
    full: bool = False,
) -> Match:
    """Longest suffix match in `history` (1-D integer array), see the module docstring.

    search: if > 0, only ends e >= t - search are candidates (a window over the most recent history).
    full:   if True, only ends with a complete k-token continuation (t - e >= k) are candidates.
    """
    h = np.asarray(history)
    if h.ndim != 1:
        raise ValueError(f"history must be 1-D, got shape {h.shape}")
    t = h.shape[0] - 1
    # A candidate end e needs e >= nmin - 1 (room for nmin tokens) and e < t.
    lo = nmin - 1
    if search > 0:
        lo = max(lo, t - search)
    hi = t - k if full else t - 1  # inclusive
    if t < 1 or hi < lo:
        return Match.none(h.dtype)

    # Cheap reject: compare the last token first, then filter survivors one position at a time.
    ends = np.arange(lo, hi + 1, dtype=np.int64)
    ends = ends[h[ends] == h[t]]
    for i in range(1, nmin):
        if ends.size == 0:
            break
        ends = ends[h[ends - i] == h[t - i]]
    if ends.size == 0:
        return Match.none(h.dtype)

    lengths = extend_matches(h, ends, h, nmin=nmin, nmax=nmax)
    best = int(lengths.max())
    tied = ends[lengths == best]
    end = int(tied.max() if policy == "recent" else tied.min())
    valid = min(k, t - end)
    return Match(end, best, valid, h[end + 1 : end + 1 + valid].copy())


def extend_matches(haystack: np.ndarray, ends: np.ndarray, history: np.ndarray, *, nmin: int, nmax: int) -> np.ndarray:
    """Match lengths, capped at nmax, of candidate ends in `haystack` whose last nmin tokens already equal the
    history's last nmin: each is extended one position back at a time while haystack[end - i] equals
    history[t - i]. A match never runs past the start of either sequence (a negative separator in the haystack,
    which no token equals, stops it too). Shared by the lookup over the request's own history (haystack = history)
    and the corpus replay's vectorised search over the corpus."""
    t = history.shape[0] - 1
    lengths = np.full(ends.shape, nmin, dtype=np.int64)
    alive = np.ones(ends.shape, dtype=bool)
    for i in range(nmin, min(nmax, t + 1)):
        pos = ends - i
        ok = alive & (pos >= 0)
        ok[ok] = haystack[pos[ok]] == history[t - i]
        alive = ok
        if not alive.any():
            break
        lengths += alive
    return lengths

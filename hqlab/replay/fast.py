"""Fast exact replay of the lookup proposers (SPEC §2.1) over many recorded traces at once.

`hqlab.replay.step.step_replay` asks the proposer at every step, and the reference rule scans the whole history each
time. Here the same steps come out of a few vectorised passes over a batch of traces (concatenated):

1. **Index**: for a match length L, the positions whose L-gram ends there, grouped by a 64-bit polynomial hash
   (any window's hash comes from prefix sums in O(1)). Only groups holding an output position with an earlier
   member are kept. Indexes over all output positions are cached per L and shared by every configuration
   replayed over the batch.
2. **Match**: for every output position t (every step the engine might take), the longest L in [nmin, nmax]
   with a candidate end e inside the rule's bounds, and the policy's e in that group (most recent or earliest).
   The cap is tried first: positions inside a copy are decided by one index. The others climb from nmin, each
   length indexed only over the groups of the positions still matching (match existence is monotone in L: an
   L-match is also an (L-1)-match at the same end). A hash collision can add a false candidate but never hide
   a true one (equal L-grams hash equally), so the winner of every step taken is verified token by token, and
   wherever the check fails the reference rule decides and the walk is redone: the result is exact.
3. **Accept**: the proposal is h[e+1 .. e+n]; accepted = its common prefix with the target's next tokens, capped
   by the engine's budget rules (as in `replay`).
4. **Walk**: the step after t is t + emitted(t); the steps taken are the orbit of each trace's first step,
   collected by pointer doubling.

`replay_table` returns the steps as columns (what sweeps aggregate); `fast_replay` returns `StepRecord`s equal
to `step_replay`'s, field for field (tested on real traces and random histories).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hqlab.config import LookupConfig
from hqlab.proposers.lookup import LookupProposer, PLDProposer
from hqlab.replay.traces import Trace
from hqlab.rules.lookup import suffix_match
from hqlab.trace import Source, StepRecord, budget, step_record

_MIX = np.uint64(0xFF51AFD7ED558CCD)  # spreads small token ids over all 64 bits
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the polynomial hash (mod 2^64, hence invertible)
_SALT = np.uint64(0xC2B2AE3D27D4EB4F)  # per-trace offset


def lookup_config(proposer: Any) -> LookupConfig | None:
    """The `LookupConfig` that fully determines `proposer`'s proposals, or None when the fast path does not apply
    (only these exact classes: a subclass may override `propose`)."""
    if type(proposer) in (LookupProposer, PLDProposer):
        return proposer.config
    return None


def supports(proposer: Any) -> bool:
    return lookup_config(proposer) is not None


@dataclass
class _Level:
    """Index of one match length: positions sorted by (hash bits, position), so a group is a contiguous run."""

    keys: np.ndarray  # uint64 sorted: hash bits above `pbits`, the position below
    pos: np.ndarray  # int64 position of each key
    gstart: np.ndarray  # int64 index of the first member of each entry's group
    gend: np.ndarray  # int64 index one past the last member of each entry's group
    qidx: np.ndarray  # int64 per query: index of its entry, -1 if its L-gram is not indexed


class TraceIndex:
    """A batch of traces concatenated into one array, with the per-length indexes built on demand."""

    def __init__(self, traces: Sequence[Trace], *, share: bool = True) -> None:
        """share: keep every length's index over all output positions for later configurations (sweeps); when
        False, lengths only one configuration climbs through are indexed over its live positions alone."""
        self.share = share
        self.traces = list(traces)
        for i, tr in enumerate(self.traces):
            if tr.max_new_tokens < len(tr.output_ids):
                raise ValueError(f"trace {i} ({tr.prompt_id!r}): {len(tr.output_ids)} output tokens exceed "
                                 f"max_new_tokens={tr.max_new_tokens}")
        parts = [np.concatenate([np.asarray(tr.prompt_ids, dtype=np.int64), np.asarray(tr.output_ids, dtype=np.int64)])
                 for tr in self.traces]
        lens = np.array([p.size for p in parts], dtype=np.int64)
        self.seq = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        n = self.seq.size
        self.trace_start = (np.cumsum(lens) - lens).astype(np.int64)
        self.prompt_len = np.array([len(tr.prompt_ids) for tr in self.traces], dtype=np.int64)
        self.out_len = np.array([len(tr.output_ids) for tr in self.traces], dtype=np.int64)
        self.max_new = np.array([tr.max_new_tokens for tr in self.traces], dtype=np.int64)
        self.start_of = np.repeat(self.trace_start, lens)  # trace start of every position
        # Queries: one per possible step, after done = 1 .. T-1 emitted tokens, at t = P + done - 1.
        steps = np.maximum(self.out_len - 1, 0)
        self.q_trace = np.repeat(np.arange(len(self.traces)), steps)
        self.q_first = (np.cumsum(steps) - steps).astype(np.int64)
        self.q_done = np.arange(self.q_trace.size, dtype=np.int64) - self.q_first[self.q_trace] + 1
        self.q_pos = self.trace_start[self.q_trace] + self.prompt_len[self.q_trace] + self.q_done - 1
        self.q_of_pos = np.full(n, -1, dtype=np.int64)
        self.q_of_pos[self.q_pos] = np.arange(self.q_pos.size)
        self.is_query = self.q_of_pos >= 0
        self.pbits = max(1, int(n).bit_length())
        if self.pbits > 40:
            raise ValueError(f"a batch of {n} tokens is too large for one index; replay it in parts")
        # hash(a..b) = salt + sum_i x[a+i] B^i = salt + (S[b+1] - S[a]) * B^-a, with S the prefix sums of x[j] B^j.
        # Each trace salts its hashes: candidates only ever come from the same trace, and groups spanning
        # traces would keep everything indexed in a batch of similar requests.
        with np.errstate(over="ignore"):
            self._x = self.seq.astype(np.uint64) * _MIX + np.uint64(1)
            powers = np.full(n, _BASE, dtype=np.uint64)
            powers[:1] = 1
            powers = np.cumprod(powers, dtype=np.uint64)
            inverse = np.full(n, np.uint64(pow(int(_BASE), -1, 1 << 64)), dtype=np.uint64)
            inverse[:1] = 1
            self._inv_powers = np.cumprod(inverse, dtype=np.uint64)
            self._prefix = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(self._x * powers, dtype=np.uint64)])
            salt = (np.arange(len(self.traces), dtype=np.uint64) + np.uint64(1)) * _SALT
        self._salt = np.repeat(salt, lens)
        self._levels: dict[int, _Level] = {}

    @property
    def target_tokens(self) -> int:
        return int(self.out_len.sum())

    def window_hash(self, ends: np.ndarray, length: int) -> np.ndarray:
        """Hash of the `length` tokens ending at each position in `ends` (windows inside their trace)."""
        a = ends - (length - 1)
        with np.errstate(over="ignore"):
            return self._salt[ends] + (self._prefix[ends + 1] - self._prefix[a]) * self._inv_powers[a]

    def level(self, length: int) -> _Level:
        """The index of `length` over all output positions (cached). Built from the kept positions of the
        longest indexed length below it when there is one: an L-gram can only repeat where its shorter suffix
        does, and those positions were kept there because some output position shares that suffix."""
        if length not in self._levels:
            below = [n for n in self._levels if n < length]
            if below:
                pos = self._levels[max(below)].pos
                pos = pos[pos - (length - 1) >= self.start_of[pos]]
            else:
                pos = self._all_windows(length)
            self._levels[length] = self._index(length, pos, self.is_query)
        return self._levels[length]

    def _all_windows(self, length: int) -> np.ndarray:
        """Positions whose `length`-gram may repeat: inside its trace, with the hash of some output position's."""
        n = self.seq.size
        a = min(length - 1, n)
        with np.errstate(over="ignore"):  # window_hash of every position at once, with slices instead of gathers
            h = self._salt[a:] + (self._prefix[length:] - self._prefix[: n - a]) * self._inv_powers[: n - a]
        # entry p - a holds the window ending at p; windows reaching back before their trace's start are out
        valid = np.ones(n - a, dtype=bool)
        lens = np.diff(np.append(self.trace_start, n))
        heads = np.minimum(lens, a)
        heads_at = np.repeat(self.trace_start - np.cumsum(heads) + heads, heads) + np.arange(int(heads.sum()))
        heads_at -= a
        valid[heads_at[heads_at >= 0]] = False
        qe = self.q_pos[self.q_pos - self.start_of[self.q_pos] >= a] - a
        bits = max(12, (2 * max(qe.size, 1)).bit_length() + 2)
        table = np.zeros(1 << bits, dtype=bool)
        low = np.uint64((1 << bits) - 1)
        table[h[qe] & low] = True
        valid &= table[h & low]
        return np.flatnonzero(valid) + a

    def _index(self, length: int, pos: np.ndarray, relevant: np.ndarray) -> _Level:
        """Index `pos` (positions whose `length`-gram lies inside their trace) by hash, keeping the groups where a
        `relevant` position has an earlier member."""
        h = self.window_hash(pos, length)
        shift = np.uint64(self.pbits)
        keys = np.sort(((h >> shift) << shift) | pos.astype(np.uint64))  # np.sort is far faster than an argsort
        pos = (keys & np.uint64((1 << self.pbits) - 1)).astype(np.int64)
        first = _run_starts(keys >> shift)
        starts = np.flatnonzero(first)
        if starts.size:
            good = relevant[pos] & ~first
            keep = np.repeat(np.logical_or.reduceat(good, starts), np.diff(np.append(starts, pos.size)))
            keys, pos, first = keys[keep], pos[keep], first[keep]
        idx = np.arange(pos.size, dtype=np.int64)
        starts = np.flatnonzero(first)
        sizes = np.diff(np.append(starts, pos.size))
        gstart = np.repeat(starts, sizes)
        qidx = np.full(self.q_pos.size, -1, dtype=np.int64)
        q = self.q_of_pos[pos]
        isq = q >= 0
        qidx[q[isq]] = idx[isq]
        return _Level(keys=keys, pos=pos, gstart=gstart, gend=gstart + np.repeat(sizes, sizes), qidx=qidx)

    def next_level(self, lev: _Level, qi: np.ndarray, alive: np.ndarray, length: int) -> _Level:
        """An index of `length` that serves the queries `alive` (their entries `qi` in `lev`, an index of
        `length` - 1): the cached full index if there is one, else one over only their groups (an L-gram can only
        repeat where its (L-1)-gram did), unless those groups cover much of the batch (short n-grams), where the
        full index costs less and is kept for later configurations."""
        if self.share or length in self._levels:
            return self.level(length)
        groups = np.unique(lev.gstart[qi])
        sizes = lev.gend[groups] - groups
        if sizes.sum() * 4 > self.seq.size:
            return self.level(length)
        members = np.repeat(groups - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum()))
        pos = lev.pos[members]
        pos = pos[pos - (length - 1) >= self.start_of[pos]]
        relevant = np.zeros(self.seq.size, dtype=bool)
        relevant[self.q_pos[alive]] = True
        return self._index(length, pos, relevant)


def _run_starts(values: np.ndarray) -> np.ndarray:
    """True where a run of equal values starts."""
    first = np.empty(values.size, dtype=bool)
    if values.size:
        first[0] = True
        np.not_equal(values[1:], values[:-1], out=first[1:])
    return first


# ----------------------------------------------------------------------------------------------------------------
# one configuration over an indexed batch


@dataclass
class StepTable:
    """The replayed steps of a batch, one entry per verify step: traces in order, steps in order within each.

    `end` is the matched end inside the trace's history (-1 without a proposal); the proposed tokens are
    history[end + 1 : end + 1 + proposed].
    """

    index: TraceIndex
    config: LookupConfig
    trace: np.ndarray  # int64 trace number
    step: np.ndarray  # int64 step number within the trace
    context_len: np.ndarray  # int64 tokens in the KV cache before the step
    proposed: np.ndarray  # int64 number of proposed tokens
    match_len: np.ndarray  # int64
    accepted: np.ndarray  # int64
    emitted: np.ndarray  # int64
    end: np.ndarray  # int64
    fallbacks: int = 0  # positions where a hash collision sent the decision to the reference rule

    @property
    def verify_len(self) -> np.ndarray:
        return self.proposed + 1

    def __len__(self) -> int:
        return int(self.step.size)

    def records(self, trace: int) -> list[StepRecord]:
        """`StepRecord`s of one trace: field for field what `step_replay` returns (proposal times 0)."""
        tr = self.index.traces[trace]
        base = int(self.index.trace_start[trace])
        seq = self.index.seq
        out = []
        for i in np.flatnonzero(self.trace == trace).tolist():
            n, e = int(self.proposed[i]), int(self.end[i])
            out.append(step_record(
                tr.prompt_id, int(self.step[i]), context_len=int(self.context_len[i]),
                proposed=seq[base + e + 1 : base + e + 1 + n] if n else [], sources=[Source.LOOKUP] * n,
                match_len=int(self.match_len[i]), accepted=int(self.accepted[i]), emitted=int(self.emitted[i]),
                block=self.config.k))
        return out


def replay_table(traces: TraceIndex | Sequence[Trace], config: LookupConfig | Any) -> StepTable:
    """Replay one lookup configuration (a `LookupConfig`, or a lookup/PLD proposer) over every trace."""
    ix = traces if isinstance(traces, TraceIndex) else TraceIndex(traces, share=False)
    if not isinstance(config, LookupConfig):
        found = lookup_config(config)
        if found is None:
            raise TypeError(f"the fast replay covers the lookup and PLD proposers only, not {type(config).__name__}")
        config = found
    done, t = ix.q_done, ix.q_pos
    start = ix.trace_start[ix.q_trace]
    out_len = ix.out_len[ix.q_trace]
    kk = np.minimum(config.k, budget(ix.max_new[ix.q_trace], done))  # the engine asks for min(k, budget) tokens

    end, mlen = _match(ix, config, t, start, kk)
    n = np.where(mlen > 0, np.minimum(kk, t - end), 0)  # proposed tokens, clipped at the history's end
    m = np.minimum(n, out_len - done - 1)  # how many of them the recorded output can confirm
    accepted = _common_prefix(ix.seq, end + 1, t + 1, m)
    q = t.size
    roots = ix.q_first[ix.out_len > 1]
    checked = np.zeros(q, dtype=bool)
    fallbacks = 0
    while True:
        emitted = accepted + 1
        jump = np.append(np.arange(q, dtype=np.int64) + emitted, q)
        jump[:q][done + emitted >= out_len] = q  # the request is complete: the sink
        visited = _orbit(jump, roots, sink=q)
        # Verify the winners of the steps taken, token by token; where a hash collision fooled the index, the
        # reference rule decides, and the walk is redone from the corrected steps.
        todo = visited[(mlen[visited] > 0) & ~checked[visited]]
        checked[todo] = True
        bad = todo[_mismatch_within(ix.seq, end[todo], t[todo], mlen[todo])]
        if bad.size == 0:
            break
        fallbacks += int(bad.size)
        for qn in bad.tolist():
            s = int(start[qn])
            ref = suffix_match(ix.seq[s : t[qn] + 1], nmin=config.nmin, nmax=config.nmax, k=int(kk[qn]),
                               search=config.search, policy=config.policy, full=config.full)
            end[qn], mlen[qn] = (ref.end + s, ref.match_len) if ref.match_len else (-1, 0)
        checked[bad] = True  # the reference's answer needs no check
        n[bad] = np.where(mlen[bad] > 0, np.minimum(kk[bad], t[bad] - end[bad]), 0)
        m[bad] = np.minimum(n[bad], out_len[bad] - done[bad] - 1)
        accepted[bad] = _common_prefix(ix.seq, end[bad] + 1, t[bad] + 1, m[bad])
    trace = ix.q_trace[visited]
    return StepTable(index=ix, config=config, trace=trace, step=_rank_in_runs(trace),
                     context_len=(t - start)[visited], proposed=n[visited], match_len=mlen[visited],
                     accepted=accepted[visited], emitted=emitted[visited],
                     end=np.where(n > 0, end - start, -1)[visited], fallbacks=fallbacks)


def _match(ix: TraceIndex, c: LookupConfig, t: np.ndarray, start: np.ndarray,
           kk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Winning end (global position, -1 for none) and match length per query, as `suffix_match` decides
    wherever the hashes did not collide (the caller verifies the winners it uses)."""
    end = np.full(t.size, -1, dtype=np.int64)
    mlen = np.zeros(t.size, dtype=np.int64)
    alive = np.flatnonzero(kk > 0)
    ix.level(c.nmin)  # first: longer lengths are then indexed from its (smaller) set of positions
    ok, e, _ = _candidates(ix.level(c.nmax), c, c.nmax, alive, t, start, kk, ix.pbits)
    end[alive[ok]], mlen[alive[ok]] = e[ok], c.nmax
    alive = alive[~ok]
    if ix.share:
        _bisect_lengths(ix, c, alive, t, start, kk, end, mlen)
    else:
        _climb_lengths(ix, c, alive, t, start, kk, end, mlen)

    return end, mlen


def _mismatch_within(seq: np.ndarray, a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Per entry, whether seq[a - i] != seq[b - i] for some i < length."""
    bad = np.zeros(a.size, dtype=bool)
    live = np.arange(a.size)
    i = 0
    while live.size:
        bad[live] |= seq[a[live] - i] != seq[b[live] - i]
        i += 1
        live = live[length[live] > i]
    return bad


def _climb_lengths(ix: TraceIndex, c: LookupConfig, alive: np.ndarray, t: np.ndarray, start: np.ndarray,
                   kk: np.ndarray, end: np.ndarray, mlen: np.ndarray) -> None:
    """Longest match below the cap by climbing from nmin over positions that still match (narrowing indexes)."""
    lev = ix.level(c.nmin)
    for length in range(c.nmin, c.nmax):
        if alive.size == 0:
            return
        if length > c.nmin:
            lev = ix.next_level(lev, qi, alive, length)
        ok, e, qi = _candidates(lev, c, length, alive, t, start, kk, ix.pbits)
        alive, qi = alive[ok], qi[ok]
        end[alive], mlen[alive] = e[ok], length


def _bisect_lengths(ix: TraceIndex, c: LookupConfig, alive: np.ndarray, t: np.ndarray, start: np.ndarray,
                    kk: np.ndarray, end: np.ndarray, mlen: np.ndarray) -> None:
    """Longest match below the cap by bisection over the length, each position probing its own length, over the
    shared full indexes. Invariant: a candidate exists at `lo` (or lo = nmin - 1) and none at `hi`. Hashes give
    no false negatives, so "none" is certain; a false "exists" can only raise the result, which the winner's
    verification then catches."""
    lo = np.full(alive.size, c.nmin - 1, dtype=np.int64)
    hi = np.full(alive.size, c.nmax, dtype=np.int64)
    best = np.full(alive.size, -1, dtype=np.int64)
    while True:
        act = np.flatnonzero(hi - lo > 1)
        if act.size == 0:
            break
        mid = (lo[act] + hi[act]) // 2
        for length in np.unique(mid).tolist():
            sel = act[mid == length]
            ok, e, _ = _candidates(ix.level(length), c, length, alive[sel], t, start, kk, ix.pbits)
            lo[sel[ok]] = length
            best[sel[ok]] = e[ok]
            hi[sel[~ok]] = length
    found = lo >= c.nmin
    end[alive[found]], mlen[alive[found]] = best[found], lo[found]


def _candidates(lev: _Level, c: LookupConfig, length: int, queries: np.ndarray, t: np.ndarray, start: np.ndarray,
                kk: np.ndarray, pbits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each query: whether a candidate end of match length `length` lies inside the rule's bounds, the
    policy's end (by hash: verified later; meaningless where not found), and its entry in `lev`."""
    qi = lev.qidx[queries]
    indexed = qi >= 0
    qs = np.maximum(qi, 0)
    ta = t[queries]
    lo = start[queries] + length - 1  # room for the match inside the trace
    if c.search > 0:
        lo = np.maximum(lo, ta - c.search)
    hi = ta - kk[queries] if c.full else ta - 1
    if lev.pos.size == 0:
        return np.zeros(queries.size, dtype=bool), np.full(queries.size, -1, dtype=np.int64), qi
    j = _latest_at_most(lev, qs, hi) if c.policy == "recent" else _earliest_at_least(lev, qs, lo, pbits)
    e = lev.pos[np.maximum(j, 0)]
    ok = indexed & (j >= 0) & (e >= lo) & (e <= hi)
    return ok, e, qi


def _latest_at_most(lev: _Level, qi: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per query (entry qi), the entry of the latest earlier member of its group at a position <= hi, or -1.

    A group's members are sorted by position and the query is one of them, so walk back from the query: at most
    t - hi - 1 members lie between hi and t, and without `full` (hi = t - 1) the first step is the answer.
    """
    j = qi - 1
    j[j < lev.gstart[qi]] = -1
    todo = np.flatnonzero((j >= 0) & (lev.pos[np.maximum(j, 0)] > hi))
    while todo.size:
        j[todo] -= 1
        gone = j[todo] < lev.gstart[qi[todo]]
        j[todo[gone]] = -1
        todo = todo[~gone]
        todo = todo[lev.pos[j[todo]] > hi[todo]]
    return j


def _earliest_at_least(lev: _Level, qi: np.ndarray, lo: np.ndarray, pbits: int) -> np.ndarray:
    """Per query, the entry of the earliest earlier member of its group at a position >= lo, or -1.

    Usually the group's first member (groups are per trace); only where that lies before `lo` (a search window,
    or a hash collision with another trace) is the group searched.
    """
    j = lev.gstart[qi].copy()
    slow = np.flatnonzero(lev.pos[j] < lo)
    if slow.size:
        shift = np.uint64(pbits)
        group = (lev.keys[qi[slow]] >> shift) << shift
        j[slow] = np.searchsorted(lev.keys, group | lo[slow].astype(np.uint64), side="left")
    j[j >= qi] = -1
    return j


def _common_prefix(seq: np.ndarray, a: np.ndarray, b: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Per entry, the number of leading positions i < limit with seq[a + i] == seq[b + i]."""
    count = np.zeros(a.size, dtype=np.int64)
    live = np.flatnonzero(limit > 0)
    i = 0
    while live.size:
        live = live[seq[a[live] + i] == seq[b[live] + i]]
        count[live] += 1
        i += 1
        live = live[limit[live] > i]
    return count


def _orbit(jump: np.ndarray, roots: np.ndarray, *, sink: int) -> np.ndarray:
    """All nodes reached from `roots` by repeated `jump` (a forward pointer per node; `sink` ends a path), sorted.

    Pointer doubling: after round r the set holds the first 2^r nodes of every path, so the work is
    O(nodes × log(path length)) in vector operations instead of one Python step per node.
    """
    reached = roots[roots != sink]
    power = jump.copy()
    while True:
        ahead = power[reached]
        ahead = ahead[ahead != sink]
        if ahead.size == 0:
            return np.sort(reached)
        reached = np.concatenate([reached, ahead])
        power = power[power]


def _rank_in_runs(values: np.ndarray) -> np.ndarray:
    """0-based position of each entry within its run of equal values."""
    idx = np.arange(values.size, dtype=np.int64)
    return idx - np.maximum.accumulate(np.where(_run_starts(values), idx, 0)) if values.size else idx


def fast_replay(prompt_ids: Sequence[int], output_ids: Sequence[int], proposer: Any, *, max_new_tokens: int,
                request: str = "0") -> list[StepRecord]:
    """Drop-in for `step_replay` (without proposal timing) for the lookup and PLD proposers."""
    return replay_table([Trace.of(prompt_ids, output_ids, max_new_tokens, request)], proposer).records(0)

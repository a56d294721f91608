"""Replay with a corpus of earlier requests (#42): recorded traces in request order, each finished output (and with
`prompts` its prompt) entering the corpus of `hqlab.rules.corpus`, every step drafted by the own-history lookup or
the corpus as the choice policy says, then priced by the cost model. Arctic's suffix decoding is reimplemented
beside it (`ArcticRule`), so both run over the same traces and the same earlier outputs.

Under greedy decoding the output does not depend on the proposer, so what a corpus would have accepted at every
step follows from the recorded outputs alone, as in `hqlab.replay.step`; what the corpus holds follows from the
order requests finish. Requests in flight: with `inflight` = B, request i is admitted when request i - B finishes,
so its corpus holds the documents of requests 0 .. i - B (the corpus is frozen for the request's life: a request
finishing while it decodes is not seen by it; the GPU corpus would see it, so B > 1 is a lower bound there).
B = 1 is one request at a time. The workloads' requests are written in waves (every session's turn t, then turn
t + 1), so with B = the wave size every request sees exactly the earlier waves.

Documents are added through the reference rule (`Corpus.add`: FIFO eviction of whole documents bounded by tokens
and documents); each request's match runs over a snapshot of its live documents (`CorpusView`, one array with
separators, the reference's decisions: tested against `Corpus.match` at every step of the committed traces).

Spec strings (`parse`): `corpus:nmin=1,nmax=32,k=15,tie=earliest,tokens=16384,docs=1024,choice=own,prompts=false,
inflight=1` (tokens = 0: no corpus, the plain lookup) and `arctic:k=15,depth=24,factor=1.0,offset=0,min_prob=0.1,
tokens=16384,cached=-1,inflight=1` (tokens = 0: no global tree, Arctic's per-request tree alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.config import ConfigError, build_config, parse_spec, require
from hqlab.replay.costmodel import CostModel
from hqlab.replay.traces import Trace
from hqlab.rules.corpus import CHOICE_POLICIES, CORPUS, NONE, OWN, TIE_POLICIES, Corpus, CorpusConfig, CorpusMatch, choose
from hqlab.rules.lookup import suffix_match
from hqlab.rules.verify import greedy_verify
from hqlab.trace import Source, StepRecord, budget, step_record


# ----------------------------------------------------------------------------------------------------------------
# configurations


@dataclass(frozen=True)
class CorpusReplayConfig:
    """The lookup with a corpus of earlier requests (the vLLM knob `gpu-lookup:...,corpus=N` replayed).

    nmin, nmax, k: the suffix-match rule's (SPEC §2.1), the same for own history and corpus.
    tie:      among equally long matches, "earliest" (vLLM's choice) or "recent" (own history and corpus alike).
    tokens:   corpus size in tokens (0: no corpus, the plain lookup); docs: most documents kept.
    choice:   which source wins when both match: "own" or "longest" (`hqlab.rules.corpus.choose`).
    prompts:  each finished request adds its prompt and output as one document (default: the output alone).
    inflight: requests in flight (module docstring): request i sees the documents of requests 0 .. i - inflight.
    """

    nmin: int = 1
    nmax: int = 32
    k: int = 15
    tie: str = "earliest"
    tokens: int = 0
    docs: int = 1024
    choice: str = "own"
    prompts: bool = False
    inflight: int = 1

    def __post_init__(self) -> None:
        require(1 <= self.nmin <= self.nmax, f"need 1 <= nmin <= nmax (got nmin={self.nmin}, nmax={self.nmax})")
        require(self.k >= 1, f"k must be >= 1 (got {self.k})")
        require(self.tie in TIE_POLICIES, f"tie must be one of {TIE_POLICIES} (got {self.tie!r})")
        require(self.tokens >= 0, f"tokens must be >= 0, 0 meaning no corpus (got {self.tokens})")
        require(self.choice in CHOICE_POLICIES, f"choice must be one of {CHOICE_POLICIES} (got {self.choice!r})")
        require(self.inflight >= 1, f"inflight must be >= 1 (got {self.inflight})")
        self.corpus_config()  # the rule validates the rest (docs, sizes)

    def corpus_config(self) -> CorpusConfig | None:
        if self.tokens == 0:
            return None
        return CorpusConfig(tokens=self.tokens, docs=self.docs, policy=self.choice, prompts=self.prompts)

    def spec(self) -> str:
        return (f"corpus:nmin={self.nmin},nmax={self.nmax},k={self.k},tie={self.tie},tokens={self.tokens},"
                f"docs={self.docs},choice={self.choice},prompts={str(self.prompts).lower()},inflight={self.inflight}")


@dataclass(frozen=True)
class ArcticConfig:
    """Arctic's suffix decoding (`ArcticRule`), with its global tree bounded like the corpus.

    k: most tokens per step; depth: the trees' depth (the longest match plus continuation; vLLM's default 24);
    factor, offset: at most factor × match length + offset tokens; min_prob: the continuation stops where its
    estimated probability falls below this. tokens: the global tree holds the outputs of earlier requests, oldest
    evicted first, up to this many tokens (0: no global tree); cached: at most this many earlier outputs (Arctic's
    max_cached_requests; -1: no limit). inflight as in `CorpusReplayConfig`.
    """

    k: int = 15
    depth: int = 24
    factor: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1
    tokens: int = 0
    cached: int = -1
    inflight: int = 1

    def __post_init__(self) -> None:
        require(self.k >= 1, f"k must be >= 1 (got {self.k})")
        require(self.depth >= 2, f"depth must be >= 2 (got {self.depth})")
        require(self.factor >= 0 and self.offset >= 0, "factor and offset must be >= 0")
        require(0.0 <= self.min_prob <= 1.0, f"min_prob must be in [0, 1] (got {self.min_prob})")
        require(self.tokens >= 0, f"tokens must be >= 0, 0 meaning no global tree (got {self.tokens})")
        require(self.cached >= -1 and self.cached != 0,
                f"cached must be -1 (no limit) or >= 1 (got {self.cached}); tokens=0 turns the global tree off")
        require(self.inflight >= 1, f"inflight must be >= 1 (got {self.inflight})")

    def spec(self) -> str:
        return (f"arctic:k={self.k},depth={self.depth},factor={self.factor:g},offset={self.offset:g},"
                f"min_prob={self.min_prob:g},tokens={self.tokens},cached={self.cached},inflight={self.inflight}")


CONFIGS = {"corpus": CorpusReplayConfig, "arctic": ArcticConfig}


def parse(spec: str) -> CorpusReplayConfig | ArcticConfig:
    """A validated config from a spec string (module docstring); every error a ConfigError naming the spec."""
    name, values = parse_spec(spec)
    if name not in CONFIGS:
        raise ConfigError(f"unknown corpus replay {name!r} in {spec!r}; known: {', '.join(CONFIGS)}")
    return build_config(CONFIGS[name], values, context=f"{name} replay {spec!r}")


def grid(base: str, **axes: Sequence[Any]) -> list[str]:
    """Specs of every combination of `axes` over `base` (a spec), e.g. grid("corpus:nmin=1", tokens=[0, 4096])."""
    import itertools

    config = parse(base)
    keys = list(axes)
    out = []
    for values in itertools.product(*(axes[k] for k in keys)):
        try:
            out.append(replace(config, **dict(zip(keys, values))).spec())
        except ConfigError:  # an invalid combination (nmin > nmax) is skipped, as hqlab sweep does
            continue
    return out


# ----------------------------------------------------------------------------------------------------------------
# the corpus snapshot a request searches


class CorpusView:
    """The live documents of a `Corpus` at one moment, searched as `Corpus.match` does, in one pass.

    The documents are joined oldest first with a separator (-1, never a token) between them, so a match cannot
    cross a document's start, and a candidate whose next position is a separator (a document's last token)
    proposes nothing and is dropped, as the rule requires. Positions are converted back to the rule's corpus
    positions (the concatenation without separators)."""

    def __init__(self, corpus: Corpus) -> None:
        docs = corpus.documents
        self.numbers = np.array([seq for seq, _ in docs], dtype=np.int64)
        lens = np.array([d.shape[0] for _, d in docs], dtype=np.int64)
        self.live_tokens = int(lens.sum())
        parts = []
        for _, d in docs:
            parts += [d, np.array([-1], dtype=np.int64)]
        self.joined = np.concatenate(parts) if parts else np.full(1, -1, dtype=np.int64)
        self.starts = np.cumsum(lens + 1) - (lens + 1)  # each document's first position in `joined`

    def match(self, history: np.ndarray, *, nmin: int, nmax: int, k: int, policy: str = "recent") -> CorpusMatch:
        h = np.asarray(history)
        j = self.joined
        t = h.shape[0] - 1
        if t < nmin - 1 or self.live_tokens == 0:
            return CorpusMatch.none(h.dtype)
        ends = np.flatnonzero(j[:-1] == h[t])
        ends = ends[j[ends + 1] >= 0]  # something follows inside the document
        for i in range(1, nmin):
            ends = ends[ends - i >= 0]
            ends = ends[j[ends - i] == h[t - i]]
            if ends.size == 0:
                return CorpusMatch.none(h.dtype)
        if ends.size == 0:
            return CorpusMatch.none(h.dtype)
        lengths = np.full(ends.shape, nmin, dtype=np.int64)
        alive = np.ones(ends.shape, dtype=bool)
        for i in range(nmin, min(nmax, t + 1)):
            pos = ends - i
            ok = alive & (pos >= 0)
            ok[ok] = j[pos[ok]] == h[t - i]  # a separator never equals a token: no match crosses a document start
            alive = ok
            if not alive.any():
                break
            lengths += alive
        best = int(lengths.max())
        tied = ends[lengths == best]
        e = int(tied.max() if policy == "recent" else tied.min())
        d = int(np.searchsorted(self.starts, e, side="right") - 1)
        doc_end = int(self.starts[d + 1] - 1) if d + 1 < self.starts.size else j.shape[0] - 1  # the separator
        valid = min(k, doc_end - e - 1)
        c = e - d  # d separators lie before document d
        return CorpusMatch(c, best, valid, j[e + 1 : e + 1 + valid].astype(h.dtype), int(self.numbers[d]))


def document(trace: Trace, prompts: bool) -> np.ndarray:
    """What a finished request adds to the corpus: its output, or with `prompts` its prompt then its output."""
    out = np.asarray(trace.output_ids, dtype=np.int64)
    return np.concatenate([np.asarray(trace.prompt_ids, dtype=np.int64), out]) if prompts else out


# ----------------------------------------------------------------------------------------------------------------
# Arctic's rule


class ArcticRule:
    """Arctic Inference's suffix decoding (arctic-inference 0.3.0, `SuffixDecodingCache.speculate` and
    `SuffixTree::speculate` / `_speculate_path`, Apache-2.0), reimplemented over occurrence counts instead of a
    suffix tree, for one request:

    - two trees: the request's own (its prompt and its output so far) and a global one (the outputs of earlier
      requests, plus, as Arctic's `add_active_response` does, the request's own output so far);
    - a tree's count of a string u = the occurrences of u in its sequences (|u| <= depth: every suffix is cut at
      depth tokens); so the context's own occurrence at the end of the history counts in the own tree;
    - for every match length m = 1 .. len(context) - 1, context = the history's last `depth` tokens, while the
      last m tokens occur in the tree: follow the most frequent next token, the estimated probability multiplied by
      count(w x) / count(w) at each token, stopping before a token whose probability falls below `min_prob`, at
      min(k, int(m × factor + offset)) tokens, or where the tree ends (depth); score = sum of the probabilities;
      the best score wins, ties to the longer match;
    - the own tree's draft wins ties with the global tree's (`draft1.score >= draft2.score`).

    Not reproduced: which of several equally frequent next tokens Arctic takes. Its tree keeps siblings in
    decreasing count, and among equal counts in an order that depends on the order the counts grew; here the token
    that occurred first wins. The probabilities, scores, lengths and the choice of tree are Arctic's.
    """

    def __init__(self, config: ArcticConfig, earlier: Sequence[np.ndarray] = ()) -> None:
        self.config = config
        self.earlier = [np.asarray(d, dtype=np.int64) for d in earlier]

    def speculate(self, history: np.ndarray, output_start: int, budget_tokens: int) -> tuple[np.ndarray, int, bool]:
        """(draft tokens, match length, whether the global tree supplied it) for a request whose `history` is its
        prompt (the first `output_start` tokens) and its output so far."""
        c = self.config
        h = np.asarray(history, dtype=np.int64)
        n = min(c.k, int(budget_tokens))
        if n <= 0 or h.size < 2:
            return np.empty(0, dtype=np.int64), 0, False
        context = h[-c.depth:]
        own = self._best([h], context, n)
        glob = self._best([*self.earlier, h[output_start:]], context, n) if c.tokens else (0.0, np.empty(0, np.int64), 0)
        if own[0] >= glob[0]:
            return own[1], own[2], False
        return glob[1], glob[2], True

    def _best(self, seqs: Sequence[np.ndarray], context: np.ndarray, n: int) -> tuple[float, np.ndarray, int]:
        c = self.config
        joined = np.concatenate([x for s in seqs for x in (s, np.array([-1], dtype=np.int64))])
        best: tuple[float, np.ndarray, int] = (0.0, np.empty(0, dtype=np.int64), 0)
        ends = np.flatnonzero(joined == context[-1])  # occurrences of the last m context tokens, by end
        for m in range(1, context.size):
            if m > 1:
                ends = ends[ends - (m - 1) >= 0]
                ends = ends[joined[ends - (m - 1)] == context[-m]]
            if ends.size == 0:
                break
            max_tokens = max(min(n, int(m * c.factor + c.offset + 1e-6)), 0)
            tokens, score = self._path(joined, ends, m, max_tokens)
            if score >= best[0]:
                best = (score, tokens, m)
        return best

    def _path(self, joined: np.ndarray, ends: np.ndarray, m: int, max_tokens: int) -> tuple[np.ndarray, float]:
        """Arctic's `_speculate_path` from the occurrences ending at `ends` (a string of length m): the most
        frequent next token while the probability (float32, as Arctic computes it) stays >= min_prob."""
        c = self.config
        prob, score = np.float32(1.0), np.float32(0.0)
        out: list[int] = []
        cur, length = ends, m
        while len(out) < max_tokens and prob >= c.min_prob and length < c.depth:
            nxt = joined[cur + 1]
            keep = nxt >= 0  # occurrences at a sequence's end count in count(w) but have no next token
            if not keep.any():
                break
            tokens, first, counts = np.unique(nxt[keep], return_index=True, return_counts=True)
            top = counts.max()
            cands = np.flatnonzero(counts == top)
            pick = cands[np.argmin(first[cands])] if cands.size > 1 else cands[0]  # ties: first occurrence
            prob = np.float32(prob * (np.float32(top) / np.float32(cur.size)))
            if prob < c.min_prob:
                break
            x = int(tokens[pick])
            out.append(x)
            score = np.float32(score + prob)
            cur = cur[keep][nxt[keep] == x] + 1
            length += 1
        return np.asarray(out, dtype=np.int64), float(score)


# ----------------------------------------------------------------------------------------------------------------
# replay


def _request_steps(trace: Trace, propose: Any) -> list[StepRecord]:
    """The steps of one request (as `hqlab.replay.step.step_replay`), `propose(history, allowed)` giving
    (tokens, sources, match_len, source label)."""
    out = np.asarray(trace.output_ids, dtype=np.int64)
    if out.size == 0:
        return []
    history = np.concatenate([np.asarray(trace.prompt_ids, dtype=np.int64), out])
    prompt_len = len(trace.prompt_ids)
    done, records = 1, []
    while done < out.size:
        allowed = budget(trace.max_new_tokens, done)
        t0 = time.perf_counter()
        tokens, source, match_len = propose(history[: prompt_len + done], allowed)
        propose_s = time.perf_counter() - t0
        tokens = tokens[:allowed]
        m = min(tokens.size, out.size - done - 1)
        accepted = greedy_verify(tokens[:m], out[done : done + m + 1]).accepted
        records.append(step_record(trace.prompt_id, len(records), context_len=prompt_len + done - 1,
                                   proposed=tokens, sources=[source] * tokens.size, match_len=match_len,
                                   accepted=accepted, emitted=accepted + 1, step_s=propose_s, propose_s=propose_s))
        done += accepted + 1
    return records


def replay_corpus(traces: Sequence[Trace], config: CorpusReplayConfig | ArcticConfig | str, *,
                  progress: bool = False) -> list[list[StepRecord]]:
    """Every request's step records, requests in the order given (the order they are sent). A step drafted from
    the corpus (or Arctic's global tree) tags its tokens `Source.CORPUS`, one from own history `Source.LOOKUP`."""
    return [recs for recs, _ in _replay(traces, config, progress=progress)]


def _replay(traces: Sequence[Trace], config: CorpusReplayConfig | ArcticConfig | str, *,
            progress: bool = False) -> list[tuple[list[StepRecord], int]]:
    """(step records, live corpus tokens the request searched) per request."""
    config = parse(config) if isinstance(config, str) else config
    arctic = isinstance(config, ArcticConfig)
    if arctic:
        bound = CorpusConfig(tokens=config.tokens, docs=2**30 if config.cached < 0 else config.cached) \
            if config.tokens else None
    else:
        bound = config.corpus_config()
    corpus = Corpus(bound) if bound is not None else None
    prompts = False if arctic else config.prompts
    added = 0
    out = []
    for i, trace in enumerate(tqdm(traces, desc="corpus replay", disable=not progress)):
        if corpus is not None:
            while added <= i - config.inflight:  # requests finished before this one was admitted
                corpus.add(document(traces[added], prompts))
                added += 1
        live = corpus.live_tokens if corpus is not None else 0
        if arctic:
            rule = ArcticRule(config, [d for _, d in corpus.documents] if corpus is not None else ())
            start = len(trace.prompt_ids)

            def propose(h, allowed, rule=rule, start=start):
                tokens, mlen, glob = rule.speculate(h, start, allowed)
                return tokens, int(Source.CORPUS if glob else Source.LOOKUP), mlen
        else:
            view = CorpusView(corpus) if corpus is not None else None
            c = config

            def propose(h, allowed, view=view, c=c):
                kk = min(c.k, allowed)
                if kk <= 0:
                    return np.empty(0, dtype=np.int64), int(Source.LOOKUP), 0
                own = suffix_match(h, nmin=c.nmin, nmax=c.nmax, k=kk, policy=c.tie)
                if view is None:
                    return own.tokens, int(Source.LOOKUP), own.match_len
                found = view.match(h, nmin=c.nmin, nmax=c.nmax, k=kk, policy=c.tie)
                source, m = choose(own, found, c.choice)
                return m.tokens, int(Source.CORPUS if source == CORPUS else Source.LOOKUP), m.match_len
        out.append((_request_steps(trace, propose), live))
    return out


def rows(traces: Sequence[Trace], specs: Sequence[str], *, costs: dict[str, CostModel] | None = None,
         search_ms_per_1k: float = 0.0, progress: bool = True) -> pl.DataFrame:
    """One row per (spec, request): steps, tokens per step, how many steps and accepted tokens the corpus supplied,
    the corpus tokens it searched, and per cost model in `costs` ({label: model}) the predicted decode seconds with
    and without speculation. The search is priced `search_ms_per_1k` ms per step per 1,000 live corpus tokens
    (the corpus kernel's cost, added to every step of a request with a corpus; own-history lookup is priced 0,
    as in the rest of the GPU pricing)."""
    if search_ms_per_1k < 0:
        raise ConfigError(f"search_ms_per_1k must be >= 0 (got {search_ms_per_1k})")
    costs = costs or {}
    base = {label: np.array([m.baseline_seconds(len(t.prompt_ids), len(t.output_ids)) for t in traces])
            for label, m in costs.items()}
    out = []
    for spec in tqdm(list(specs), desc="corpus sweep", disable=not progress):
        config = parse(spec)
        for i, (trace, (recs, live)) in enumerate(zip(traces, _replay(traces, config))):
            from_corpus = [r for r in recs if r.sources and r.sources[0] == Source.CORPUS]
            row = {"spec": config.spec(), "rule": "arctic" if isinstance(config, ArcticConfig) else "corpus",
                   "tokens": config.tokens, "inflight": config.inflight,
                   "choice": getattr(config, "choice", "score"), "nmin": getattr(config, "nmin", 1),
                   "nmax": getattr(config, "nmax", getattr(config, "depth", 0)),
                   "prompts": getattr(config, "prompts", False),
                   "workload": trace.category, "request": trace.prompt_id, "new_tokens": len(trace.output_ids),
                   "steps": len(recs), "accepted": sum(r.accepted for r in recs),
                   "corpus_steps": len(from_corpus), "corpus_accepted": sum(r.accepted for r in from_corpus),
                   "corpus_live_tokens": live}
            for label, model in costs.items():
                row[f"pred_s_{label}"] = model.decode_seconds(recs, propose_ms=search_ms_per_1k * live / 1e3)
                row[f"base_s_{label}"] = float(base[label][i])
            out.append(row)
    return pl.DataFrame(out)


def step_models(frame: pl.DataFrame, *, model: str = "qwen2.5-0.5b", mode: str = "graph",
                batches: Sequence[int] = (1, 8)) -> dict[str, CostModel]:
    """{"b1": ..., "b8": ...}: step cost models fitted on measured verify steps (`benchmarks/step_cost_gpu.py`'s
    table: model shape, mode, batch, context_len, verify_len, step_ms) for each batch size. A request's step at
    batch b is priced at that batch's step (the batch verifies together; every request's ratio to its own
    no-speculation price is what the projection uses)."""
    need = {"model", "mode", "batch", "context_len", "verify_len", "step_ms"}
    missing = need - set(frame.columns)
    if missing:
        raise ConfigError(f"step cost table lacks column(s) {sorted(missing)}")
    out = {}
    for b in batches:
        rows = frame.filter((pl.col("model") == model) & (pl.col("mode") == mode) & (pl.col("batch") == b))
        if rows.height < 3 or rows["verify_len"].n_unique() < 2:
            raise ConfigError(f"no step costs for {model} ({mode}) at batch {b}: need several verify lengths")
        out[f"b{b}"] = CostModel.fit_points(rows["verify_len"].to_numpy(), rows["context_len"].to_numpy(),
                                            rows["step_ms"].to_numpy(), source=f"{model} {mode} batch {b}")
    return out


def summarize(frame: pl.DataFrame, *, by: Sequence[str] = ("workload", "spec")) -> pl.DataFrame:
    """Pooled per group: tokens per step (accepted + 1 per step, over all steps), the share of steps and of accepted
    tokens the corpus supplied, and per cost model the projected speedup (summed base / summed predicted time)."""
    labels = [c.removeprefix("pred_s_") for c in frame.columns if c.startswith("pred_s_")]
    first = [c for c in ("rule", "tokens", "inflight", "choice", "nmin", "nmax", "prompts") if c not in by]
    return (frame.group_by(list(by), maintain_order=True)
            .agg(*[pl.col(c).first() for c in first], pl.len().alias("requests"), pl.col("steps").sum(),
                 ((pl.col("accepted").sum() + pl.col("steps").sum()) / pl.col("steps").sum()).alias("tokens_per_step"),
                 (pl.col("corpus_steps").sum() / pl.col("steps").sum()).alias("corpus_step_share"),
                 (pl.col("corpus_accepted").sum() / pl.col("accepted").sum().clip(1)).alias("corpus_accepted_share"),
                 *[(pl.col(f"base_s_{x}").sum() / pl.col(f"pred_s_{x}").sum()).alias(f"speedup_{x}")
                   for x in labels]))


__all__ = ["CorpusReplayConfig", "ArcticConfig", "ArcticRule", "CorpusView", "parse", "grid", "document",
           "replay_corpus", "rows", "step_models", "summarize", "OWN", "CORPUS", "NONE"]

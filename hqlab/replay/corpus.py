"""Replay with a corpus of earlier requests (#42): recorded traces in request order, each finished output (and with
`prompts` its prompt) entering the corpus of `hqlab.rules.corpus`, every step drafted by the own-history lookup or
the corpus as the choice policy says, then priced by the cost model. Arctic's suffix decoding
(`hqlab.rules.suffix_decoding`, its rule reimplemented) runs beside it over the same traces and the same earlier
outputs, its global tree bounded and filled like the corpus.

Under greedy decoding the output does not depend on the proposer, so what a corpus would have accepted at every
step follows from the recorded outputs alone, as in `hqlab.replay.step`; what the corpus holds follows from the
order requests finish. Requests in flight, `inflight` = B, under one of two schedules:

- `admit` (default): request i is admitted when request i - B finishes, so its corpus holds the documents of
  requests 0 .. i - B, frozen for the request's life. A request finishing while it decodes is not seen by it, so at
  B > 1 this is a lower bound for a server's corpus. The workloads' requests are written in waves (every session's
  turn t, then turn t + 1), so with B = the wave size every request sees exactly the earlier waves.
- `lockstep`: B slots stepped together, as a continuously batched server steps them: every active request takes
  one verify step per iteration, a finished request's document enters the corpus at once (seen from the next
  iteration by the requests still decoding), and the next waiting request takes its slot (a session's next turn
  only once its previous turn has finished: its client sends it then). Prefill takes no iteration, and steps do
  not differ in duration: an idealised server, where `admit` is a pessimistic one.

B = 1 is one request at a time (both schedules are the same).

Documents are added through the reference rule (`Corpus.add`: FIFO eviction of whole documents bounded by tokens
and documents); each request's match runs over a snapshot of its live documents (`CorpusView`, one array with
separators, the reference's decisions: tested against `Corpus.match` at every step of the committed traces).

Spec strings (`parse`): `corpus:nmin=1,nmax=32,k=15,tie=earliest,tokens=16384,docs=1024,choice=own,prompts=false,
inflight=1,schedule=admit` (tokens = 0: no corpus, the plain lookup) and `arctic:k=15,depth=24,factor=1.0,offset=0,
min_prob=0.1,tokens=16384,cached=-1,inflight=1,schedule=admit` (tokens = 0: no global tree, Arctic's per-request
tree alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.config import ConfigError, require, resolve_spec
from hqlab.replay.costmodel import CostModel
from hqlab.replay.traces import Trace
from hqlab.rules.corpus import (CHOICE_POLICIES, CORPUS, NONE, OWN, TIE_POLICIES, Corpus, CorpusConfig, CorpusMatch,
                                choose)
from hqlab.rules import suffix_decoding
from hqlab.rules.lookup import extend_matches, suffix_match
from hqlab.rules.verify import greedy_verify
from hqlab.trace import Source, StepRecord, budget, step_record


# ----------------------------------------------------------------------------------------------------------------
# configurations

SCHEDULES = ("admit", "lockstep")


@dataclass(frozen=True)
class CorpusReplayConfig:
    """The lookup with a corpus of earlier requests (the vLLM knob `gpu-lookup:...,corpus=N` replayed).

    nmin, nmax, k: the suffix-match rule's (SPEC §2.1), the same for own history and corpus.
    tie:      among equally long matches, "earliest" (vLLM's choice) or "recent" (own history and corpus alike).
    tokens:   corpus size in tokens (0: no corpus, the plain lookup); docs: most documents kept.
    choice:   which source wins when both match: "own" or "longest" (`hqlab.rules.corpus.choose`).
    prompts:  each finished request adds its prompt and output as one document (default: the output alone).
    inflight: requests in flight; schedule: "admit" or "lockstep", when documents become visible (module
              docstring).
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
    schedule: str = "admit"

    def __post_init__(self) -> None:
        require(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES} (got {self.schedule!r})")
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
                f"docs={self.docs},choice={self.choice},prompts={str(self.prompts).lower()},inflight={self.inflight},"
                f"schedule={self.schedule}")


@dataclass(frozen=True)
class ArcticConfig:
    """Arctic's suffix decoding (`ArcticRule`), with its global tree bounded like the corpus.

    k: most tokens per step; depth: the trees' depth (the longest match plus continuation; vLLM's default 24);
    factor, offset: at most factor × match length + offset tokens; min_prob: the continuation stops where its
    estimated probability falls below this. tokens: the global tree holds the outputs of earlier requests, oldest
    evicted first, up to this many tokens (0: no global tree); cached: at most this many earlier outputs (Arctic's
    max_cached_requests; -1: no limit). inflight and schedule as in `CorpusReplayConfig`.
    """

    k: int = 15
    depth: int = 24
    factor: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1
    tokens: int = 0
    cached: int = -1
    inflight: int = 1
    schedule: str = "admit"

    def __post_init__(self) -> None:
        require(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES} (got {self.schedule!r})")
        require(self.k >= 1, f"k must be >= 1 (got {self.k})")
        require(self.depth >= 2, f"depth must be >= 2 (got {self.depth})")
        require(self.factor >= 0 and self.offset >= 0, "factor and offset must be >= 0")
        require(0.0 <= self.min_prob <= 1.0, f"min_prob must be in [0, 1] (got {self.min_prob})")
        require(self.tokens >= 0, f"tokens must be >= 0, 0 meaning no global tree (got {self.tokens})")
        require(self.cached >= -1 and self.cached != 0,
                f"cached must be -1 (no limit) or >= 1 (got {self.cached}); tokens=0 turns the global tree off")
        require(self.inflight >= 1, f"inflight must be >= 1 (got {self.inflight})")

    def rule(self) -> suffix_decoding.SuffixDecodingConfig:
        return suffix_decoding.SuffixDecodingConfig(k=self.k, depth=self.depth, factor=self.factor,
                                                    offset=self.offset, min_prob=self.min_prob)

    def spec(self) -> str:
        return (f"arctic:k={self.k},depth={self.depth},factor={self.factor:g},offset={self.offset:g},"
                f"min_prob={self.min_prob:g},tokens={self.tokens},cached={self.cached},inflight={self.inflight},"
                f"schedule={self.schedule}")


CONFIGS = {"corpus": CorpusReplayConfig, "arctic": ArcticConfig}


def parse(spec: str) -> CorpusReplayConfig | ArcticConfig:
    """A validated config from a spec string (module docstring); every error a ConfigError naming the spec."""
    return resolve_spec(spec, CONFIGS, unknown="unknown corpus replay {name!r} in {spec!r}; known: {known}",
                        context=f"corpus replay {spec!r}")[1]


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
        lengths = extend_matches(j, ends, h, nmin=nmin, nmax=nmax)  # a separator stops a match at a document start
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
# replay


def session_of(trace: Trace) -> str:
    """The session a request belongs to: its prompt id up to "/<turn>" (the corpus workloads' ids, `Request.id`),
    else the id itself (a request on its own)."""
    head, sep, tail = trace.prompt_id.rpartition("/")
    return head if sep and tail.isdigit() else trace.prompt_id


class _Request:
    """One request replayed step by step (as `hqlab.replay.step.step_replay`), its proposals asked of `propose`."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.out = np.asarray(trace.output_ids, dtype=np.int64)
        self.history = np.concatenate([np.asarray(trace.prompt_ids, dtype=np.int64), self.out])
        self.prompt_len = len(trace.prompt_ids)
        self.done = 1  # the first token comes from prefill, not from a verify step
        self.records: list[StepRecord] = []
        self.searched: list[int] = []  # live corpus tokens at each step
        self.admitted = self.left = -1  # lockstep: the iteration it took its first step in, and finished after

    @property
    def finished(self) -> bool:
        return self.done >= self.out.size

    def step(self, propose: Any, live_tokens: int) -> None:
        allowed = budget(self.trace.max_new_tokens, self.done)
        t0 = time.perf_counter()
        tokens, source, match_len = propose(self.history[: self.prompt_len + self.done], allowed, self.prompt_len)
        propose_s = time.perf_counter() - t0
        tokens = tokens[:allowed]
        m = min(tokens.size, self.out.size - self.done - 1)
        accepted = greedy_verify(tokens[:m], self.out[self.done : self.done + m + 1]).accepted
        self.records.append(step_record(
            self.trace.prompt_id, len(self.records), context_len=self.prompt_len + self.done - 1, proposed=tokens,
            sources=[source] * tokens.size, match_len=match_len, accepted=accepted, emitted=accepted + 1,
            step_s=propose_s, propose_s=propose_s))
        self.searched.append(live_tokens)
        self.done += accepted + 1


class _Drafter:
    """A configuration's proposals over the corpus as it stands (`refresh` after documents are added)."""

    def __init__(self, config: CorpusReplayConfig | ArcticConfig, corpus: Corpus | None) -> None:
        self.config, self.corpus = config, corpus
        self.refresh()

    def refresh(self) -> None:
        c = self.corpus
        self.live = c.live_tokens if c is not None else 0
        if isinstance(self.config, ArcticConfig):
            self.earlier = [d for _, d in c.documents] if c is not None else None
            self.rule = self.config.rule()
        else:
            self.view = CorpusView(c) if c is not None else None

    def __call__(self, h: np.ndarray, allowed: int, prompt_len: int) -> tuple[np.ndarray, int, int]:
        c = self.config
        if isinstance(c, ArcticConfig):
            draft = suffix_decoding.speculate(h, prompt_len, self.earlier, allowed, self.rule)
            return draft.tokens, int(Source.CORPUS if draft.from_global else Source.LOOKUP), draft.match_len
        kk = min(c.k, allowed)
        if kk <= 0:
            return np.empty(0, dtype=np.int64), int(Source.LOOKUP), 0
        own = suffix_match(h, nmin=c.nmin, nmax=c.nmax, k=kk, policy=c.tie)
        if self.view is None:
            return own.tokens, int(Source.LOOKUP), own.match_len
        found = self.view.match(h, nmin=c.nmin, nmax=c.nmax, k=kk, policy=c.tie)
        source, m = choose(own, found, c.choice)
        return m.tokens, int(Source.CORPUS if source == CORPUS else Source.LOOKUP), m.match_len


def replay_corpus(traces: Sequence[Trace], config: CorpusReplayConfig | ArcticConfig | str, *,
                  progress: bool = False) -> list[list[StepRecord]]:
    """Every request's step records, requests in the order given (the order they are sent). A step drafted from
    the corpus (or Arctic's global tree) tags its tokens `Source.CORPUS`, one from own history `Source.LOOKUP`."""
    return [r.records for r in _replay(traces, config, progress=progress)]


def replay_requests(traces: Sequence[Trace], config: CorpusReplayConfig | ArcticConfig | str, *,
                    progress: bool = False) -> list[_Request]:
    """The replayed requests themselves, in the order given: per request `records` (its step records), `searched`
    (live corpus tokens at each step) and, under `lockstep`, `admitted` (the iteration of its first step) and `left`
    (the iteration of its last): what a pricing of whole iterations needs (`hqlab.replay.corpus_vllm`)."""
    return _replay(traces, config, progress=progress)


def _replay(traces: Sequence[Trace], config: CorpusReplayConfig | ArcticConfig | str, *,
            progress: bool = False) -> list[_Request]:
    config = parse(config) if isinstance(config, str) else config
    if isinstance(config, ArcticConfig):
        bound = CorpusConfig(tokens=config.tokens, docs=2**30 if config.cached < 0 else config.cached) \
            if config.tokens else None
    else:
        bound = config.corpus_config()
    corpus = Corpus(bound) if bound is not None else None
    prompts = getattr(config, "prompts", False)
    drafter = _Drafter(config, corpus)
    requests = [_Request(t) for t in traces]
    bar = tqdm(total=len(requests), desc="corpus replay", disable=not progress)
    if config.schedule == "admit":
        added = 0
        for i, r in enumerate(requests):
            if corpus is not None and added <= i - config.inflight:
                while added <= i - config.inflight:  # requests finished before this one was admitted
                    corpus.add(document(traces[added], prompts))
                    added += 1
                drafter.refresh()
            while not r.finished:
                r.step(drafter, drafter.live)
            bar.update()
    else:  # lockstep: `inflight` slots, every active request takes one step per iteration, in arrival order
        session = [session_of(t) for t in traces]
        waiting, active = list(range(len(requests))), []
        iteration = 0
        while waiting or active:
            # admit in order, except a session's next turn, which its client sends once the previous one is answered
            busy = {session[i] for i in active}
            for i in list(waiting):
                if len(active) >= config.inflight:
                    break
                if session[i] not in busy:
                    active.append(i)
                    waiting.remove(i)
                    requests[i].admitted = iteration
                busy.add(session[i])  # also blocks this session's later turns behind a waiting one
            for i in active:
                if not requests[i].finished:
                    requests[i].step(drafter, drafter.live)
            done = [i for i in active if requests[i].finished]
            for i in done:
                requests[i].left = iteration
            iteration += 1
            if done:
                active = [i for i in active if i not in done]
                if corpus is not None:
                    for i in done:
                        corpus.add(document(traces[i], prompts))
                    drafter.refresh()
                bar.update(len(done))
    bar.close()
    return requests


def rows(traces: Sequence[Trace], specs: Sequence[str], *, costs: dict[str, CostModel] | None = None,
         search_ms_per_1k: float = 0.0, progress: bool = True) -> pl.DataFrame:
    """One row per (spec, request): steps, tokens per step, how many steps and accepted tokens the corpus supplied,
    the corpus tokens it searched (`corpus_live_tokens` a step on average, `searched_tokens` summed over its steps),
    its place in the order sent (`order`), the bound on documents (`docs`; Arctic's `cached`), and per cost model in
    `costs` ({label: model}) the predicted decode seconds with and without speculation. The search is priced
    `search_ms_per_1k` ms per step per 1,000 live corpus tokens (the corpus kernel's cost, added to every step of a
    request with a corpus; own-history lookup is priced 0, as in the rest of the GPU pricing)."""
    if search_ms_per_1k < 0:
        raise ConfigError(f"search_ms_per_1k must be >= 0 (got {search_ms_per_1k})")
    costs = costs or {}
    base = {label: np.array([m.baseline_seconds(len(t.prompt_ids), len(t.output_ids)) for t in traces])
            for label, m in costs.items()}
    out = []
    for spec in tqdm(list(specs), desc="corpus sweep", disable=not progress):
        config = parse(spec)
        for i, (trace, run) in enumerate(zip(traces, _replay(traces, config))):
            recs = run.records
            live = int(np.mean(run.searched)) if run.searched else 0
            from_corpus = [r for r in recs if r.sources and r.sources[0] == Source.CORPUS]
            row = {"spec": config.spec(), "rule": "arctic" if isinstance(config, ArcticConfig) else "corpus",
                   "tokens": config.tokens, "inflight": config.inflight, "schedule": config.schedule,
                   "choice": getattr(config, "choice", "score"), "nmin": getattr(config, "nmin", 1),
                   "nmax": getattr(config, "nmax", getattr(config, "depth", 0)),
                   "prompts": getattr(config, "prompts", False),
                   "workload": trace.category, "request": trace.prompt_id, "new_tokens": len(trace.output_ids),
                   "steps": len(recs), "accepted": sum(r.accepted for r in recs),
                   "corpus_steps": len(from_corpus), "corpus_accepted": sum(r.accepted for r in from_corpus),
                   "corpus_live_tokens": live, "order": i,
                   "docs": getattr(config, "docs", getattr(config, "cached", -1)),
                   "searched_tokens": int(sum(run.searched))}
            for label, model in costs.items():
                row[f"pred_s_{label}"] = model.decode_seconds(recs, propose_ms=0.0) + \
                    search_ms_per_1k * sum(run.searched) / 1e6
                row[f"base_s_{label}"] = float(base[label][i])
            out.append(row)
    return pl.DataFrame(out)


def step_models(frame: pl.DataFrame, *, model: str = "qwen2.5-0.5b", mode: str = "graph",
                batches: Sequence[int] = (1, 8)) -> dict[str, CostModel]:
    """{"b1": ..., "b8": ...}: step cost models fitted on measured verify steps
    (`experiments/verify_step_cost/step_cost_gpu.py`'s table: model shape, mode, batch, context_len, verify_len,
    step_ms) for each batch size. A request's step at batch b is priced at that batch's step (the batch verifies
    together; every request's ratio to its own no-speculation price is what the projection uses)."""
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
    first = [c for c in ("rule", "tokens", "inflight", "schedule", "choice", "nmin", "nmax", "prompts") if c not in by]
    return (frame.group_by(list(by), maintain_order=True)
            .agg(*[pl.col(c).first() for c in first], pl.len().alias("requests"), pl.col("steps").sum(),
                 ((pl.col("accepted").sum() + pl.col("steps").sum()) / pl.col("steps").sum()).alias("tokens_per_step"),
                 (pl.col("corpus_steps").sum() / pl.col("steps").sum()).alias("corpus_step_share"),
                 (pl.col("corpus_accepted").sum() / pl.col("accepted").sum().clip(1)).alias("corpus_accepted_share"),
                 *[(pl.col(f"base_s_{x}").sum() / pl.col(f"pred_s_{x}").sum()).alias(f"speedup_{x}")
                   for x in labels]))


__all__ = ["CorpusReplayConfig", "ArcticConfig", "CorpusView", "parse", "grid", "document",
           "replay_corpus", "replay_requests", "rows", "step_models", "summarize", "OWN", "CORPUS", "NONE"]

"""The exactness check of the vLLM corpus runs (benchmarks/vllm_corpus.py): replay the corpus rule over the recorded
requests and compare, step by step, the tokens vLLM emitted with what the rule predicts.

A benchmark point (one config, workload, load and repeat, its corpus emptied first) records for every request its
prompt and output ids, the insertion number its document got in the corpus (`corpus_seq`, -1: none), and per verify
step the history length the speculator drafted from, how many documents the corpus had received by then
(`corpus_docs`), the tokens it drafted and the tokens vLLM emitted. The replay rebuilds, for every step, the corpus
that step saw (the first `corpus_docs` documents in insertion order, each a request's output, or prompt and output,
from the recorded ids; FIFO eviction by `hqlab.rules.corpus.Corpus`), drafts with `hqlab.rules.corpus.propose`
(own history, corpus, `choose`), and predicts the step: the draft's longest prefix that the recorded output
continues with is accepted, plus the target's own token, within the output's end. Greedy decoding makes that the
whole of vLLM's step, so a step whose prediction differs is a real mismatch: of the drafts (`draft_equal` false: the
kernel or the corpus content differs from the rule) or of the verification.

Pure: numpy and the rules; no vLLM, no polars.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from hqlab.rules.corpus import Corpus, CorpusConfig, propose
from hqlab.rules.lookup import suffix_match
from hqlab.rules.verify import greedy_verify


@dataclass(frozen=True)
class Step:
    """One verify step of a request as vLLM ran it: the history length the drafter saw, the corpus's document count
    then, what the speculator drafted (None: not recorded) and how many tokens vLLM emitted."""

    context_len: int
    corpus_docs: int
    emitted: int
    drafted: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RequestRun:
    name: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    corpus_seq: int = -1  # its document's insertion number in the point's corpus (-1: it entered none)
    steps: tuple[Step, ...] = ()


@dataclass(frozen=True)
class StepCheck:
    request: str
    context_len: int
    emitted: int  # vLLM's
    predicted: int  # the replay's
    draft_equal: bool | None  # the speculator's draft equals the rule's (None: not recorded)
    source: str  # the rule's winner: own | corpus | none


@dataclass
class PointCheck:
    steps: list[StepCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what keeps the replay from being exact, besides steps

    @property
    def exact(self) -> bool:
        return not self.problems and all(s.emitted == s.predicted and s.draft_equal is not False for s in self.steps)

    def summary(self) -> dict[str, Any]:
        n = len(self.steps)
        same = sum(s.emitted == s.predicted for s in self.steps)
        drafts = [s.draft_equal for s in self.steps if s.draft_equal is not None]
        first = next((s for s in self.steps if s.emitted != s.predicted or s.draft_equal is False), None)
        return {"replay_steps": n, "replay_exact_steps": same, "replay_exact": self.exact,
                "replay_draft_steps": len(drafts), "replay_draft_equal": sum(drafts),
                "replay_corpus_steps": sum(s.source == "corpus" for s in self.steps),
                "replay_tokens_per_step": float(np.mean([s.predicted for s in self.steps])) if n else float("nan"),
                "vllm_tokens_per_step": float(np.mean([s.emitted for s in self.steps])) if n else float("nan"),
                "replay_first_mismatch": "" if first is None else
                f"{first.request}@{first.context_len}: vLLM {first.emitted}, replay {first.predicted}, "
                f"draft_equal {first.draft_equal}",
                "replay_problems": "; ".join(self.problems)}


def emitted_tokens(draft: Sequence[int], rest: Sequence[int]) -> int:
    """Tokens a greedy verify step emits when `rest` (non-empty) is what the target outputs from here on: the
    draft's accepted prefix (`hqlab.rules.verify.greedy_verify`, drafts clipped where the output ends) plus the
    target's own token."""
    m = min(len(draft), len(rest) - 1)
    return greedy_verify(np.asarray(draft[:m], dtype=np.int64), np.asarray(rest[: m + 1], dtype=np.int64)).accepted + 1


def corpus_document(run: RequestRun, prompts: bool) -> list[int]:
    return [*run.prompt_ids, *run.output_ids] if prompts else list(run.output_ids)


def check_point(requests: Sequence[RequestRun], *, nmin: int, nmax: int, k: int, policy: str = "earliest",
                search: int = 0, corpus: CorpusConfig | None = None) -> PointCheck:
    """Replay one point (see the module docstring). `corpus` None: the plain lookup (own history only)."""
    out = PointCheck()
    docs: dict[int, RequestRun] = {}
    for r in requests:
        if r.corpus_seq >= 0:
            if r.corpus_seq in docs:
                out.problems.append(f"insertion number {r.corpus_seq} given to {docs[r.corpus_seq].name} and {r.name}")
            docs[r.corpus_seq] = r
    order = [docs[s] for s in sorted(docs)]
    if [s for s in sorted(docs)] != list(range(len(docs))):
        out.problems.append(f"insertion numbers {sorted(docs)} are not 0..{len(docs) - 1}")
    snapshots: dict[int, Corpus] = {}

    def corpus_at(count: int) -> Corpus | None:
        if corpus is None:
            return None
        if count not in snapshots:
            built = Corpus(corpus)
            for r in order[:count]:
                built.add(corpus_document(r, corpus.prompts))
            if count > len(order):
                out.problems.append(f"a step saw {count} documents but only {len(order)} were recorded")
            snapshots[count] = built
        return snapshots[count]

    for r in requests:
        full = np.asarray([*r.prompt_ids, *r.output_ids], dtype=np.int64)
        p = len(r.prompt_ids)
        for s in r.steps:
            pos = s.context_len - p  # output tokens emitted before this step
            if not 0 < pos < len(r.output_ids):
                out.problems.append(f"{r.name}: a step at history length {s.context_len} lies outside prompt "
                                    f"{p} + output {len(r.output_ids)}")
                continue
            history = full[: s.context_len]
            found = corpus_at(s.corpus_docs)
            if found is None:
                m = suffix_match(history, nmin=nmin, nmax=nmax, k=k, search=search, policy=policy)
                source = "own" if m.match_len else "none"
            else:
                source, m = propose(history, found, nmin=nmin, nmax=nmax, k=k, policy=policy, search=search)
            draft = [int(t) for t in m.tokens]
            predicted = emitted_tokens(draft, r.output_ids[pos:])
            equal = None if s.drafted is None else list(s.drafted) == draft
            out.steps.append(StepCheck(r.name, s.context_len, s.emitted, predicted, equal, source))
    return out


__all__ = ["Step", "RequestRun", "StepCheck", "PointCheck", "check_point", "emitted_tokens", "corpus_document"]

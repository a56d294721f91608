"""The proposer zoo: hqlab's lookup variants, PLD, vLLM's n-gram proposer and Arctic's suffix tree (its compiled
cache, and its rule reimplemented in hqlab: `arctic-rule`), replayed on the same traces, with acceptance and
proposal latency per task class.

Every proposer goes through the step-by-step replay (`hqlab.replay`, timed), so each one is timed the same way: one
`propose` call per verify step, the call the engine would make, on the history the engine would have. Greedy
replay makes the acceptance exact; latency is measured on this machine (median of repeated replays per step).
"""

from __future__ import annotations

import statistics
from typing import Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.replay.traces import Trace

# label -> spec. k = 15 everywhere except PLD (Spec-Bench's k = 10); n-gram ranges as each system ships or as
# hqlab's suffix-length sweep chose.
ZOO: dict[str, str] = {
    "hqlab lookup, most recent (1-32)": "lookup:nmin=1,nmax=32,k=15",
    "hqlab lookup, earliest (1-32)": "lookup:nmin=1,nmax=32,k=15,policy=earliest",
    "hqlab lookup, HyperQwen (6-12)": "lookup:nmin=6,nmax=12,k=15",
    "PLD, Spec-Bench (n<=3, k=10)": "pld:n=3,k=10",
    "vLLM ngram (1-32)": "vllm-ngram:nmin=1,nmax=32,k=15",
    "vLLM ngram (5, its default n)": "vllm-ngram:nmin=5,nmax=5,k=15",
    "Arctic suffix tree": "arctic-suffix:k=15",
    "Arctic's rule, reimplemented": "arctic-rule:k=15",  # hqlab.rules.suffix_decoding: no extension needed
}


def available(zoo: dict[str, str] = ZOO) -> tuple[dict[str, str], dict[str, str]]:
    """(the entries whose libraries are installed, {label: why not} for the others)."""
    ok, missing = {}, {}
    for label, spec in zoo.items():
        try:
            make_proposer(spec)
        except ImportError as e:
            missing[label] = str(e)
        else:
            ok[label] = spec
    return ok, missing


def run_zoo(traces: Sequence[Trace], zoo: dict[str, str], *, repeats: int = 3, progress: bool = True) -> pl.DataFrame:
    """One row per (proposer, request, step): what was proposed and accepted, and the proposal's latency (median
    over `repeats` replays, each with a fresh proposer so stateful ones start from scratch)."""
    rows = []
    bar = tqdm(total=len(zoo) * len(traces) * repeats, desc="zoo", disable=not progress)
    for label, spec in zoo.items():
        runs: list[list] = []
        for _ in range(repeats):
            proposer = make_proposer(spec)
            runs.append([replay(t.prompt_ids, t.output_ids, proposer, max_new_tokens=t.max_new_tokens,
                                request=t.prompt_id, time_proposals=True) for t in traces])
            bar.update(len(traces))
        for i, t in enumerate(traces):
            first = runs[0][i]
            for rep in runs[1:]:  # greedy replay is deterministic: every repeat must take the same steps
                assert [r.accepted for r in rep[i]] == [r.accepted for r in first], (label, t.prompt_id)
            for j, r in enumerate(first):
                rows.append({"proposer": label, "spec": spec, "category": t.category, "prompt_id": t.prompt_id,
                             "step": j, "context_len": r.context_len, "proposed": len(r.proposed),
                             "accepted": r.accepted, "emitted": r.emitted,
                             "propose_ms": 1e3 * statistics.median(rep[i][j].propose_s for rep in runs)})
    bar.close()
    return pl.DataFrame(rows)


def summarize(steps: pl.DataFrame, *, group: Sequence[str] = ("proposer", "category")) -> pl.DataFrame:
    """Per group: tokens per step (Spec-Bench's "mean accepted tokens": accepted + the bonus token, pooled over
    steps), acceptance per draft, how often anything was proposed, and proposal latency (median, p90)."""
    return (steps.group_by(list(group), maintain_order=True)
            .agg(pl.len().alias("steps"),
                 ((pl.col("accepted") + 1).sum() / pl.len()).alias("tokens_per_step"),
                 pl.col("accepted").filter(pl.col("proposed") > 0).mean().alias("accepted_per_draft"),
                 (pl.col("proposed") > 0).mean().alias("draft_rate"),
                 pl.col("propose_ms").median().alias("propose_ms_median"),
                 pl.col("propose_ms").quantile(0.9).alias("propose_ms_p90")))


def overall(steps: pl.DataFrame) -> pl.DataFrame:
    """Per proposer over all task classes, with the geometric mean over classes of tokens per step (each class
    counts once, however many requests it has)."""
    per_class = summarize(steps)
    geo = per_class.group_by("proposer", maintain_order=True).agg(
        pl.col("tokens_per_step").log().mean().exp().alias("tokens_per_step_geomean"))
    return summarize(steps, group=("proposer",)).join(geo, on="proposer")


def agreement(steps: pl.DataFrame, a: str, b: str) -> float:
    """Share of steps where two proposers accepted the same number of tokens (1.0: same decisions throughout)."""
    x = steps.filter(pl.col("proposer") == a).select("prompt_id", "step", "accepted")
    y = steps.filter(pl.col("proposer") == b).select("prompt_id", "step", pl.col("accepted").alias("other"))
    both = x.join(y, on=["prompt_id", "step"], how="full", coalesce=True)
    return float(np.mean((both["accepted"] == both["other"]).fill_null(False).to_numpy())) if both.height else 1.0

"""The speculation gate (`hqlab.rules.gate`) replayed over recorded greedy outputs, and priced.

`replay_gated` walks one request step by step as vLLM runs it at one request under asynchronous scheduling: step 0
is the prefill (one token), and every later step either verifies the lookup's drafts (width k, drafts from the
whole current history, `hqlab.rules.lookup.suffix_match`) or is a plain step, as the gate decided from the history
known `behind` steps earlier (the prompt alone for the steps whose width was fixed before any output was known,
the request's first steps). Under greedy decoding the output does not depend on the drafts, so every step
follows from the recorded output exactly. Without a gate every step after the prefill verifies k positions, the
fixed-width behaviour of `gpu-lookup` in vLLM 0.26.

`price` turns the steps into a speed ratio against no speculation from two measured step costs: a plain step and a
speculative step (whose cost at one request hardly depends on the width on a small target; docs/serving.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from hqlab.config import LookupConfig, require
from hqlab.replay.traces import Trace
from hqlab.rules.gate import GateConfig, SuffixGate
from hqlab.rules.lookup import suffix_match


@dataclass(frozen=True)
class GatedSteps:
    """One request's steps: the verify width (0 = plain step), the drafts proposed and accepted, tokens emitted."""

    width: np.ndarray
    proposed: np.ndarray
    accepted: np.ndarray
    emitted: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.emitted.sum())


def replay_gated(trace: Trace, lookup: LookupConfig, gate: GateConfig | None) -> GatedSteps:
    """The steps of `trace` under the lookup `lookup` and the gate `gate` (None: speculate on every step)."""
    out = np.asarray(trace.output_ids, dtype=np.int64)
    history = np.concatenate([np.asarray(trace.prompt_ids, dtype=np.int64), out])
    prompt = len(trace.prompt_ids)
    require(len(out) >= 1, f"trace {trace.prompt_id!r} has no output to replay")
    state = SuffixGate(gate.min_match) if gate else None
    opens: list[bool] = []  # the gate after each step's output is known (index = step)
    width, proposed, accepted, emitted = [0], [0], [0], [1]  # step 0: the prefill emits the first token
    pos = 1
    if state is not None:
        state.extend(history[:prompt])
        prompt_open = state.open
        opens.append(state.extend(history[prompt:prompt + 1]))
    while pos < len(out):
        step = len(width)
        speculate = True
        if gate is not None:
            known = step - gate.behind  # the last step whose output the scheduler had when it fixed this width
            speculate = prompt_open if known < 0 else opens[known]  # before any output: the prompt's state
        w = min(lookup.k, len(out) - pos - 1) if speculate else 0
        drafts = np.empty(0, dtype=np.int64)
        if w > 0:
            m = suffix_match(history[:prompt + pos], nmin=lookup.nmin, nmax=lookup.nmax, k=w, search=lookup.search,
                             policy=lookup.policy, full=lookup.full)
            drafts = m.tokens
        truth = out[pos:pos + len(drafts)]
        agree = int(np.argmin(np.append(drafts == truth, False))) if len(drafts) else 0
        width.append(lookup.k if speculate else 0)
        proposed.append(len(drafts))
        accepted.append(agree)
        emitted.append(agree + 1)
        pos += agree + 1
        if state is not None:
            opens.append(state.extend(history[prompt + pos - agree - 1:prompt + pos]))
    return GatedSteps(*(np.asarray(v, dtype=np.int64) for v in (width, proposed, accepted, emitted)))


def sweep(traces: Sequence[Trace], lookup: LookupConfig, min_matches: Sequence[int | None], *,
          behind: int = 3, workload: str = "") -> pl.DataFrame:
    """One row per (request, gate): steps, speculative steps, tokens, drafts proposed and accepted. A `None` in
    `min_matches` is the ungated lookup (min_match 0 in the frame)."""
    rows = []
    for trace in traces:
        for g in min_matches:
            s = replay_gated(trace, lookup, GateConfig(g, behind=behind) if g else None)
            rows.append({"workload": workload or trace.category, "request": trace.prompt_id,
                         "min_match": int(g or 0), "behind": behind, "steps": len(s.width),
                         "spec_steps": int((s.width > 0).sum()), "tokens": s.tokens,
                         "proposed": int(s.proposed.sum()), "accepted": int(s.accepted.sum())})
    return pl.DataFrame(rows)


def price(frame: pl.DataFrame, *, plain_ms: float, spec_ms: float,
          by: Sequence[str] = ("workload", "min_match")) -> pl.DataFrame:
    """Speed against no speculation per group: tokens × plain_ms over the steps' time (plain steps at plain_ms,
    speculative ones at spec_ms), summed over the group's requests (a token-weighted ratio, as tok/s is)."""
    require(plain_ms > 0 and spec_ms > 0, f"step costs must be > 0 ms (got plain {plain_ms}, spec {spec_ms})")
    time = (pl.col("steps") - pl.col("spec_steps")) * plain_ms + pl.col("spec_steps") * spec_ms
    return (frame.group_by(list(by), maintain_order=True)
            .agg(tokens=pl.col("tokens").sum(), steps=pl.col("steps").sum(), spec_steps=pl.col("spec_steps").sum(),
                 time_ms=time.sum())
            .with_columns(tokens_per_step=pl.col("tokens") / pl.col("steps"),
                          spec_share=pl.col("spec_steps") / pl.col("steps"),
                          speedup=pl.col("tokens") * plain_ms / pl.col("time_ms")))


def by_cost_ratio(frame: pl.DataFrame, ratios: Sequence[float]) -> pl.DataFrame:
    """`price` at every ratio of a speculative step's cost to a plain one (a host's property: the speed-up depends on
    the two costs only through it), with `cost_ratio` and `vs_ungated`, each gate's speed-up over the ungated
    lookup's (min_match 0, which `frame` must hold) at the same ratio and workload."""
    require(bool((frame["min_match"] == 0).any()), "by_cost_ratio needs the ungated lookup (min_match 0) in the sweep")
    priced = pl.concat([price(frame, plain_ms=1.0, spec_ms=float(r)).with_columns(pl.lit(float(r)).alias("cost_ratio"))
                        for r in ratios])
    ungated = priced.filter(pl.col("min_match") == 0).select("workload", "cost_ratio",
                                                             pl.col("speedup").alias("ungated"))
    return (priced.join(ungated, on=["workload", "cost_ratio"])
            .with_columns((pl.col("speedup") / pl.col("ungated")).alias("vs_ungated")).drop("ungated"))

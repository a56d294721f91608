"""A served goodput controller checked against the reference rule, from the decisions it recorded
(`hqlab.engines.vllm.goodput_record`; the serve benchmark's `goodput_decisions.parquet`).

Two checks:
- `rerun_rule`, for every run, sampled outputs included: the rule (`hqlab.rules.goodput.GoodputController`, with
  the costs, widths and settings the record's header names) decides again at every recorded call, from the
  recorded cells, after the recorded outcomes the scheduler had processed by then, and must fix the recorded width.
  The record is also checked against itself: each request's recent-acceptance bucket is that of its last outcome
  processed before the call, and each outcome verified as many drafts as the width of the call it credits. The
  match bucket is read from tokens the record does not hold; the second check covers it where outputs are known.
- `replay_served`, where the first requests a server answered one at a time are known token for token (the serve
  benchmark's greedy texts open every server's life): the replay (`hqlab.replay.goodput.replay_engine`, one
  request at a time) over those requests predicts every call's cells and width and every outcome, and must equal
  the record's first calls.

Why both: the first checks the served controller decision for decision whatever the outputs (its features, its
calibration and its choice, given what it saw); the second checks what it saw (histories three steps old, the
outcome credited to the call whose width the step verified) against a model of vLLM's scheduler written apart
from the hook.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import polars as pl

from hqlab.config import ConfigError, require
from hqlab.engines.vllm.goodput_record import read_record
from hqlab.replay.traces import Trace
from hqlab.rules.goodput import Cell, GoodputConfig, GoodputController, StepCosts, bucket_of

COLUMNS = ["decision", "width", "request", "request_id", "tokens", "match", "accept", "confidence", "drafted",
           "accepted", "observed_before"]


def record_frame(path: str | Path) -> tuple[dict[str, Any], pl.DataFrame]:
    """(header, one row per (call, candidate request)) of a recorded file (`read_record`'s columns, the request's
    vLLM id beside its index, outcomes null where the request verified nothing)."""
    header, cols = read_record(path)
    ids = cols["request_ids"]
    frame = pl.DataFrame({c: cols[c] for c in COLUMNS if c != "request_id"}).with_columns(
        pl.Series("request_id", [ids[i] for i in cols["request"]], dtype=pl.String),
        *[pl.when(pl.col(c) >= 0).then(pl.col(c)).alias(c) for c in ("drafted", "accepted", "observed_before")])
    return {**header, "truncated": cols["truncated"]}, frame.select(COLUMNS)


def _controller(header: dict[str, Any]) -> tuple[GoodputController, GoodputConfig, StepCosts]:
    for key in ("widths", "costs", "config"):
        if key not in header:
            raise ConfigError(f"the decisions record's header lacks {key!r}: not written by the goodput hook")
    if header.get("online"):
        raise ConfigError("this record's controller measured its step costs online (goodput=online): its prices "
                          "moved during the run and the record holds the prior only, so the rule cannot decide again "
                          "from it; check a fixed-cost server's record (goodput=default or PATH.json)")
    config = GoodputConfig(**header["config"])
    costs = StepCosts.from_dict(header["costs"], where="the record's step costs")
    return GoodputController(config, tuple(header["widths"]), costs), config, costs


def _cells(frame: pl.DataFrame) -> list[Cell]:
    return list(zip(frame["match"].to_list(), frame["accept"].to_list(), frame["confidence"].to_list()))


@dataclass
class RuleCheck:
    """What `rerun_rule` found: calls and outcomes read, calls where the rule fixed another width (the first as
    (call, recorded, rule)), rows whose acceptance bucket is not their last outcome's, outcomes whose drafts are not
    the crediting call's width."""

    decisions: int = 0
    outcomes: int = 0
    width_mismatches: int = 0
    first_mismatch: tuple[int, int, int] | None = None
    accept_mismatches: int = 0
    drafted_mismatches: int = 0
    widths: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return self.decisions > 0 and not (self.width_mismatches or self.accept_mismatches or self.drafted_mismatches)


def rerun_rule(frame: pl.DataFrame, header: dict[str, Any]) -> RuleCheck:
    """The rule decides again at every recorded call of one server (`record_frame`'s rows, in call order) from the
    recorded cells, after the outcomes processed before it; see the module's docstring."""
    controller, config, _ = _controller(header)
    require(frame.height > 0, "the decisions record holds no call")
    frame = frame.with_row_index("row").sort("decision", "row")
    calls = frame["decision"].to_numpy()
    require(bool(np.all(np.diff(np.unique(calls)) == 1)) and calls[0] == 0,
            "the record's calls are not numbered 0, 1, 2, ... (a record of several servers? check one at a time)")
    done = frame.filter(pl.col("drafted").is_not_null()).sort("observed_before", "decision")
    out_cells, out_before = _cells(done), done["observed_before"].to_list()
    out_drafted, out_accepted = done["drafted"].to_list(), done["accepted"].to_list()
    out_request = done["request"].to_list()
    report = RuleCheck(outcomes=done.height,
                       drafted_mismatches=done.filter(pl.col("drafted") != pl.col("width")).height)
    starts = np.flatnonzero(np.r_[True, np.diff(calls) != 0])
    ends = np.r_[starts[1:], len(calls)]
    cells, widths = _cells(frame), frame["width"].to_list()
    requests, tokens = frame["request"].to_list(), frame["tokens"].to_list()
    last: dict[int, int | None] = {}
    held: dict[int, int] = {}
    o = 0
    for call, (a, b) in enumerate(zip(starts, ends)):
        while o < len(out_before) and out_before[o] <= call:
            controller.observe(out_cells[o], out_drafted[o], out_accepted[o])
            last[out_request[o]] = out_accepted[o]
            o += 1
        for i in range(a, b):
            r = requests[i]
            if tokens[i] < held.get(r, 0):  # vLLM rewound the request: the hook starts its features over
                last[r] = None
            held[r] = tokens[i]
            if bucket_of(last.get(r), config.accept_edges) != cells[i][1]:
                report.accept_mismatches += 1
        width = controller.decide(cells[a:b])
        report.widths[width] += 1
        if width != widths[a]:
            report.width_mismatches += 1
            report.first_mismatch = report.first_mismatch or (call, widths[a], width)
    report.decisions = len(starts)
    return report


@dataclass
class ReplayCheck:
    """What `replay_served` found: the calls and outcomes the replay predicts and how many of them the record's
    opening calls equal (the first that differs as (call, recorded, replayed))."""

    decisions: int
    equal_decisions: int
    outcomes: int
    equal_outcomes: bool
    first_mismatch: tuple[int, Any, Any] | None

    @property
    def ok(self) -> bool:
        return self.decisions > 0 and self.equal_decisions == self.decisions and self.equal_outcomes


def replay_served(frame: pl.DataFrame, header: dict[str, Any], traces: Sequence[Trace]) -> ReplayCheck:
    """The replay, one request at a time, over `traces`: the first requests the recorded server answered, in order,
    each alone (prompt and output token for token). Its calls and outcomes must be the record's first ones."""
    from hqlab.engines.vllm import gpu_lookup
    from hqlab.replay.goodput import Policy, replay_engine

    spec = str(header.get("spec", ""))
    if not spec.startswith(gpu_lookup.NAME):
        raise ConfigError(f"the replay predicts the lookup's acceptance; the record's server ran {spec!r}")
    _, config, costs = _controller(header)
    require(len(traces) >= 1, "name at least one request the server answered")
    first = frame.group_by("request").agg(pl.col("tokens").first(), pl.col("decision").min()).sort("decision")
    seen = first.head(len(traces))
    prompt = [len(t.prompt_ids) for t in traces]
    if seen.height < len(traces) or seen["request"].to_list() != list(range(len(traces))) \
            or seen["tokens"].to_list() != prompt:
        raise ConfigError(f"the record opens with requests of {seen['tokens'].to_list()} prompt tokens, the traces "
                          f"have {prompt}: give the requests the server answered first, in order")
    lookup = gpu_lookup.lookup_config(spec)
    replayed = replay_engine(traces, lookup, Policy.controller(tuple(header["widths"]), config), concurrency=1,
                             costs=costs)
    recorded = []
    for (call,), rows in frame.filter(pl.col("decision") < len(replayed.decisions)).group_by(
            "decision", maintain_order=True):
        recorded.append((call, dict(Counter(_cells(rows))), rows["width"][0], rows["request"].max()))
    equal, first_mismatch = 0, None
    for d, rec in zip(replayed.decisions, recorded):
        if rec[1:3] == (d.counts, d.width) and rec[3] < len(traces):
            equal += 1
        elif first_mismatch is None:
            first_mismatch = (d.index, rec[1:3], (d.counts, d.width))
    if len(recorded) < len(replayed.decisions) and first_mismatch is None:
        first_mismatch = (len(recorded), None, "the record ends first")
    done = frame.filter((pl.col("decision") < len(replayed.decisions)) & pl.col("drafted").is_not_null())
    got = sorted(zip(done["observed_before"].to_list(), _cells(done), done["drafted"].to_list(),
                     done["accepted"].to_list()))
    return ReplayCheck(len(replayed.decisions), equal, len(replayed.outcomes), got == sorted(replayed.outcomes),
                       first_mismatch)


def served_records(frame: pl.DataFrame) -> list[tuple[str, dict[str, Any], pl.DataFrame]]:
    """A serving run's `goodput_decisions.parquet` (`hqlab.bench.serve_servers.collect`) split per server: (its
    config label, the record's header, its rows in record order)."""
    import json

    for key in ("config", "header", "truncated"):
        require(key in frame.columns, f"no {key!r} column: not a serving run's goodput decisions")
    return [(config, {**json.loads(rows["header"][0]), "truncated": bool(rows["truncated"][0])}, rows.select(COLUMNS))
            for (config,), rows in frame.group_by("config", maintain_order=True)]


def check_run(frame: pl.DataFrame) -> pl.DataFrame:
    """`rerun_rule` on every server of a serving run's decisions: one row per server. A server that priced its steps
    online cannot be decided again from its record (`_controller`): its row has `same_widths` null and its widths'
    counts only."""
    rows = []
    for config, header, rows_ in served_records(frame):
        if header.get("online"):
            rows.append({"config": config, "decisions": rows_["decision"].n_unique(), "truncated": header["truncated"],
                         "same_widths": None})
            continue
        found = rerun_rule(rows_, header)
        rows.append({"config": config, "decisions": found.decisions, "outcomes": found.outcomes,
                     "width_mismatches": found.width_mismatches, "accept_mismatches": found.accept_mismatches,
                     "drafted_mismatches": found.drafted_mismatches, "truncated": header["truncated"],
                     "same_widths": found.ok})
    return pl.DataFrame(rows)


def greedy_traces(prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]], *,
                  max_new_tokens: int) -> list[Trace]:
    """The requests a server answered first, one at a time, as `replay_served` takes them: the serve benchmark's
    greedy chat prompts (through the model's chat template, as the server's tokens) and the token ids of the
    server's greedy row (`greedy.parquet`)."""
    require(len(prompt_ids) == len(output_ids), f"{len(prompt_ids)} prompts for {len(output_ids)} outputs")
    return [Trace.of(list(p), list(o), max_new_tokens, prompt_id=str(i), category="served greedy")
            for i, (p, o) in enumerate(zip(prompt_ids, output_ids))]


__all__ = ["served_records", "check_run", "greedy_traces", "record_frame", "rerun_rule", "RuleCheck", "replay_served", "ReplayCheck", "COLUMNS"]

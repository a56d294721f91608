"""A served goodput controller checked against the reference rule, from the decisions it recorded
(`hqlab.engines.vllm.goodput_record`; the serve benchmark's `goodput_decisions.parquet`).

Two checks:
- `rerun_rule`, for every run, sampled outputs included: the rule (`hqlab.rules.goodput.GoodputController`, with
  the costs, widths and settings the record's header names) decides again at every recorded call, from the
  recorded cells, after the recorded outcomes the scheduler had processed by then, and must fix the recorded width.
  The record is also checked against itself: each request's recent-acceptance bucket is that of its last outcome
  processed before the call, and each outcome verified as many drafts as the width of the call it credits. The
  match bucket is read from tokens the record does not hold; the second check covers it where outputs are known.
  A server that measured its step costs online (`goodput=online`) recorded every step it handed its costs and every
  call's prices (version 2 records): the costs start from the header's prior, take the recorded steps in their
  order, each before the first call made after it, and every call must also price each width at the recorded µs
  (`hqlab.rules.online_costs.micros`). The check reports the costs they end at (`RuleCheck.prices`: what the
  server learnt). A version 1 record of such a server holds the prior only and is refused.
- `replay_served`, where the first requests a server answered one at a time are known token for token (the serve
  benchmark's greedy texts open every server's life): the replay (`hqlab.replay.goodput.replay_engine`, one
  request at a time) over those requests predicts every call's cells and width and every outcome, and must equal
  the record's first calls.

Why both: the first checks the served controller decision for decision whatever the outputs (its features, its
calibration, its prices and its choice, given what it saw); the second checks what it saw (histories three steps
old, the outcome credited to the call whose width the step verified) against a model of vLLM's scheduler written
apart from the hook. The second prices with a fixed table and takes no online server.

`online_prices` is the reader's view of a record: per call, what it priced each width at and what it chose, and the
same by batch bucket; `served_widths` the same for every server of a serving run, with the priced cost of the wide
widths each chose and where its prices come from.
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
from hqlab.rules.goodput import Cell, CostModel, GoodputConfig, GoodputController, StepCosts, bucket_of
from hqlab.rules.online_costs import OnlineConfig, OnlineCosts, micros

COLUMNS = ["decision", "width", "request", "request_id", "tokens", "match", "accept", "confidence", "drafted",
           "accepted", "observed_before", "priced_us"]
TIMED_COLUMNS = ["step", "before", "batch", "width", "us", "decode_only"]


def record_frames(path: str | Path) -> tuple[dict[str, Any], pl.DataFrame, pl.DataFrame]:
    """(header, one row per (call, candidate request), one row per timed step) of a recorded file (`read_record`'s
    columns). Rows: the request's vLLM id beside its index, outcomes null where the request verified nothing,
    `priced_us` the call's µs per candidate width (the header's `widths` order; null where the call recorded none:
    costs not measured online). Timed steps (`TIMED_COLUMNS`): `step`, their order as the costs were handed them, and
    `before`, the calls decided by then. The header gains the file's `version` and whether it is `truncated`."""
    header, cols = read_record(path)
    ids = cols["request_ids"]
    priced = cols["priced"]
    if priced.shape[1]:
        listed = pl.Series("priced_us", priced).cast(pl.List(pl.Int64))
        listed = pl.select(pl.when(pl.lit(pl.Series(priced[:, 0] >= 0))).then(listed)).to_series().alias("priced_us")
    else:
        listed = pl.Series("priced_us", [None] * len(priced), dtype=pl.List(pl.Int64))
    frame = pl.DataFrame({c: cols[c] for c in COLUMNS if c not in ("request_id", "priced_us")}).with_columns(
        pl.Series("request_id", [ids[i] for i in cols["request"]], dtype=pl.String), listed,
        *[pl.when(pl.col(c) >= 0).then(pl.col(c)).alias(c) for c in ("drafted", "accepted", "observed_before")])
    steps = cols["timed"]
    timed = pl.DataFrame({"step": np.arange(len(steps["us"]), dtype=np.int64),
                          **{c: steps[c] for c in TIMED_COLUMNS[1:]}})
    return ({**header, "version": cols["version"], "truncated": cols["truncated"]}, frame.select(COLUMNS),
            timed.select(TIMED_COLUMNS))


def record_frame(path: str | Path) -> tuple[dict[str, Any], pl.DataFrame]:
    """`record_frames` without the timed steps: what a check of a fixed-cost server reads."""
    header, frame, _ = record_frames(path)
    return header, frame


def _controller(header: dict[str, Any]) -> tuple[GoodputController, GoodputConfig, CostModel]:
    """The controller a record's header describes, as it started: a fixed table, or online costs from their prior
    (version 2 records carry what moved them; version 1 records do not, and are refused)."""
    for key in ("widths", "costs", "config"):
        if key not in header:
            raise ConfigError(f"the decisions record's header lacks {key!r}: not written by the goodput hook")
    config = GoodputConfig(**header["config"])
    costs: CostModel = StepCosts.from_dict(header["costs"], where="the record's step costs")
    if header.get("online"):
        if header.get("version", 1) < 2:
            raise ConfigError("this record's controller measured its step costs online (goodput=online): its prices "
                              "moved during the run and this record (version 1) holds the prior only, so the rule "
                              "cannot decide again from it; version 2 records carry the timed steps and prices")
        costs = OnlineCosts(costs, OnlineConfig(**header.get("online_config", {})))
    return GoodputController(config, tuple(header["widths"]), costs), config, costs


def _cells(frame: pl.DataFrame) -> list[Cell]:
    return list(zip(frame["match"].to_list(), frame["accept"].to_list(), frame["confidence"].to_list()))


@dataclass
class RuleCheck:
    """What `rerun_rule` found: calls and outcomes read, calls where the rule fixed another width (the first as
    (call, recorded, rule)), rows whose acceptance bucket is not their last outcome's, outcomes whose drafts are not
    the crediting call's width. With costs measured online also: the timed steps fed, the calls whose recorded
    prices are not the re-priced ones (the first as (call, recorded µs, re-priced µs); a call that recorded none
    counts), and `prices`, the costs once every timed step is fed (`OnlineCosts.table`: what the server learnt),
    with their scales (g0, gx)."""

    decisions: int = 0
    outcomes: int = 0
    width_mismatches: int = 0
    first_mismatch: tuple[int, int, int] | None = None
    accept_mismatches: int = 0
    drafted_mismatches: int = 0
    widths: Counter = field(default_factory=Counter)
    online: bool = False
    timed: int = 0
    price_mismatches: int = 0
    first_price_mismatch: tuple[int, Any, list[int]] | None = None
    prices: StepCosts | None = None
    scales: tuple[float, float] | None = None

    @property
    def ok(self) -> bool:
        return self.decisions > 0 and not (self.width_mismatches or self.accept_mismatches or self.drafted_mismatches
                                           or self.price_mismatches)


def rerun_rule(frame: pl.DataFrame, header: dict[str, Any], timed: pl.DataFrame | None = None) -> RuleCheck:
    """The rule decides again at every recorded call of one server (`record_frame`'s rows, in call order) from the
    recorded cells, after the outcomes processed before it; see the module's docstring. A record of costs measured
    online needs its timed steps (`record_frames`' third frame): each is handed to the costs, in its order, before
    the first call made after it, and every call must price each width at the recorded µs."""
    controller, config, costs = _controller(header)
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
    online = isinstance(costs, OnlineCosts)
    steps: list[tuple[int, int, int, int, bool]] = []
    if online:
        if timed is None:
            raise ConfigError("this record's costs were measured online: give its timed steps (record_frames' third "
                              "frame, or the run's goodput_timed rows of this server)")
        t = timed.sort("step")
        steps = list(zip(t["before"].to_list(), t["batch"].to_list(), t["width"].to_list(), t["us"].to_list(),
                         t["decode_only"].to_list()))
        require(all(a[0] <= b[0] for a, b in zip(steps, steps[1:])),
                "the timed steps' calls decided before them go backwards: not one server's steps in order")
        report.online = True
    starts = np.flatnonzero(np.r_[True, np.diff(calls) != 0])
    ends = np.r_[starts[1:], len(calls)]
    cells, widths = _cells(frame), frame["width"].to_list()
    requests, tokens = frame["request"].to_list(), frame["tokens"].to_list()
    priced = frame["priced_us"].to_list() if online and "priced_us" in frame.columns else [None] * frame.height
    last: dict[int, int | None] = {}
    held: dict[int, int] = {}
    o = s = 0
    for call, (a, b) in enumerate(zip(starts, ends)):
        while o < len(out_before) and out_before[o] <= call:
            controller.observe(out_cells[o], out_drafted[o], out_accepted[o])
            last[out_request[o]] = out_accepted[o]
            o += 1
        while s < len(steps) and steps[s][0] <= call:
            costs.observe_us(*steps[s][1:])  # type: ignore[union-attr]
            s += 1
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
        if online:
            repriced = [micros(ms) for ms in controller.priced]
            if priced[a] != repriced:
                report.price_mismatches += 1
                report.first_price_mismatch = report.first_price_mismatch or (call, priced[a], repriced)
    report.decisions = len(starts)
    if online:
        for step in steps[s:]:  # timed after the last call: what the server learnt last
            costs.observe_us(*step[1:])  # type: ignore[union-attr]
        report.timed, report.prices, report.scales = len(steps), costs.table(), costs.scales()  # type: ignore
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
    if header.get("online"):
        raise ConfigError("the replay prices steps with a fixed table; this server measured its costs online, whose "
                          "prices follow its step times: check it with rerun_rule and its timed steps")
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
    config label, the record's header, its rows in record order). A run collected before records carried prices
    gets `priced_us` null."""
    import json

    for key in ("config", "header", "truncated"):
        require(key in frame.columns, f"no {key!r} column: not a serving run's goodput decisions")
    if "priced_us" not in frame.columns:
        frame = frame.with_columns(pl.lit(None, dtype=pl.List(pl.Int64)).alias("priced_us"))
    return [(config, {**json.loads(rows["header"][0]), "truncated": bool(rows["truncated"][0])}, rows.select(COLUMNS))
            for (config,), rows in frame.group_by("config", maintain_order=True)]


def check_run(frame: pl.DataFrame, timed: pl.DataFrame | None = None) -> pl.DataFrame:
    """`rerun_rule` on every server of a serving run's decisions (`goodput_decisions.parquet`), with the timed
    steps of the servers that measured their costs online (`goodput_timed.parquet`, `TIMED_COLUMNS` and `config`):
    one row per server. A server that cannot be decided again has `same_widths` null and `why` says why: costs
    measured online in a version 1 record (the prior only), or no timed steps given. `prices` is the costs an
    online server ended with (`StepCosts.to_dict`, JSON), `g0` and `gx` their scales."""
    import json

    rows = []
    for config, header, rows_ in served_records(frame):
        row: dict[str, Any] = {"config": config, "decisions": rows_["decision"].n_unique(), "outcomes": None,
                               "width_mismatches": None, "accept_mismatches": None, "drafted_mismatches": None,
                               "online": bool(header.get("online")), "timed": None, "price_mismatches": None,
                               "g0": None, "gx": None, "prices": None, "truncated": header["truncated"],
                               "same_widths": None, "why": None}
        steps = None
        if header.get("online"):
            if header.get("version", 1) < 2:
                rows.append({**row, "why": "priced online; a version 1 record holds the prior only"})
                continue
            if timed is None:
                rows.append({**row, "why": "priced online; no timed steps given"})
                continue
            steps = timed.filter(pl.col("config") == config)
        found = rerun_rule(rows_, header, steps)
        row.update(decisions=found.decisions, outcomes=found.outcomes, width_mismatches=found.width_mismatches,
                   accept_mismatches=found.accept_mismatches, drafted_mismatches=found.drafted_mismatches,
                   same_widths=found.ok)
        if found.online:
            assert found.prices is not None and found.scales is not None
            row.update(timed=found.timed, price_mismatches=found.price_mismatches, g0=found.scales[0],
                       gx=found.scales[1], prices=json.dumps(found.prices.to_dict()))
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)


def _bucket(batch: pl.Series) -> pl.Series:
    """`lo`, the power-of-two batch bucket (1, 2-3, 4-7, ...) of each batch size, by its lower bound."""
    return pl.Series("lo", [1 << (int(b).bit_length() - 1) for b in batch.to_list()], dtype=pl.Int64)


def online_prices(frame: pl.DataFrame, header: dict[str, Any]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """What a server's controller believed each step cost, for a reader (`record_frames`' rows and header).

    Per call: `decision`, `batch` (its candidate requests), `width` (the width it fixed), and `ms_<w>` per candidate
    width w, the ms it priced a step at (the recorded µs / 1000; for a fixed-cost server its table's, rounded alike).
    By batch bucket (powers of two: 1, 2-3, 4-7, ...): `batches` (its label), `lo`, `decisions`, per width
    `chose_<w>` (the share of calls fixing it) and `ms_<w>` (the mean priced ms), and `x_<w>`, the mean price of a
    step at w over a plain one: where the controller went wide, what it thought wide cost."""
    widths = [int(w) for w in header["widths"]]
    calls = frame.group_by("decision", maintain_order=True).agg(
        pl.len().alias("batch"), pl.col("width").first(), pl.col("priced_us").first()).sort("decision")
    if header.get("online"):
        if calls["priced_us"].null_count():
            raise ConfigError("this record's costs were measured online and some calls carry no prices (a version 1 "
                              "record holds the prior only)")
        priced = calls["priced_us"].to_list()
    else:
        table = StepCosts.from_dict(header["costs"], where="the record's step costs")
        priced = [[micros(table.at(b, w)) for w in widths] for b in calls["batch"].to_list()]
    require(all(len(p) == len(widths) for p in priced), f"the prices are not one per candidate width {widths}")
    per_call = calls.select("decision", pl.col("batch").cast(pl.Int64), "width").with_columns(
        *[pl.Series(f"ms_{w}", [p[j] / 1000 for p in priced], dtype=pl.Float64) for j, w in enumerate(widths)])
    by_batch = per_call.with_columns(_bucket(per_call["batch"])).group_by("lo").agg(
        pl.len().alias("decisions"),
        *[(pl.col("width") == w).mean().alias(f"chose_{w}") for w in widths],
        *[pl.col(f"ms_{w}").mean() for w in widths],
        *[(pl.col(f"ms_{w}") / pl.col(f"ms_{widths[0]}")).mean().alias(f"x_{w}") for w in widths[1:]],
    ).sort("lo").with_columns(
        pl.when(pl.col("lo") == 1).then(pl.lit("1"))
        .otherwise(pl.format("{}-{}", pl.col("lo"), 2 * pl.col("lo") - 1)).alias("batches"))
    return per_call, by_batch.select("batches", "lo", pl.exclude("batches", "lo"))


def served_widths(frame: pl.DataFrame) -> pl.DataFrame:
    """What each goodput server of a serving run chose and what it priced its wide steps at, by batch bucket, from
    the run's decisions (`goodput_decisions.parquet`): one row per (server, bucket of `online_prices`) with `config`,
    `prices`, `batches`, `lo`, `decisions`, `chose_<w>` per candidate width (the share of calls fixing it; null for a
    width the server did not have), `wide` (the share fixing a width above 0) and `priced_x`, the mean over the calls
    that went wide of the price of the width chosen over a plain step's (null where none did).

    `prices` says whence the prices: "fixed", the table the server decided with (its header's); "learnt", what a
    server measuring its costs online priced each call at (version 2 records); "prior only", such a server whose
    record (version 1) holds only the prior it started from. There `priced_x` is the prior's, not necessarily what
    it decided with: its prices moved with the steps it timed, which the record did not keep."""
    out = []
    for config, header, rows in served_records(frame):
        widths = [int(w) for w in header["widths"]]
        require(widths[0] == 0, f"{config}: the candidate widths {widths} do not start with a plain step (0)")
        source, priced_by = "fixed", header
        if header.get("online"):
            source = "learnt" if header.get("version", 1) >= 2 else "prior only"
            if source == "prior only":  # the one table such a record holds: price its calls as a fixed table would
                priced_by = {**header, "online": False}
        per_call, by_batch = online_prices(rows, priced_by)
        chosen = pl.coalesce(*[pl.when(pl.col("width") == w).then(pl.col(f"ms_{w}")) for w in widths[1:]])
        wide = (per_call.with_columns(_bucket(per_call["batch"]), (chosen / pl.col("ms_0")).alias("priced_x"))
                .group_by("lo").agg(pl.col("priced_x").mean()))
        out.append(by_batch.join(wide, on="lo", how="left").with_columns(
            pl.lit(config).alias("config"), pl.lit(source).alias("prices"), (1 - pl.col("chose_0")).alias("wide"))
            .select("config", "prices", "batches", "lo", "decisions", pl.col("^chose_.*$"), "wide", "priced_x"))
    require(bool(out), "the run's goodput decisions hold no server")
    return pl.concat(out, how="diagonal_relaxed")


def greedy_traces(prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]], *,
                  max_new_tokens: int) -> list[Trace]:
    """The requests a server answered first, one at a time, as `replay_served` takes them: the serve benchmark's
    greedy chat prompts (through the model's chat template, as the server's tokens) and the token ids of the
    server's greedy row (`greedy.parquet`)."""
    require(len(prompt_ids) == len(output_ids), f"{len(prompt_ids)} prompts for {len(output_ids)} outputs")
    return [Trace.of(list(p), list(o), max_new_tokens, prompt_id=str(i), category="served greedy")
            for i, (p, o) in enumerate(zip(prompt_ids, output_ids))]


__all__ = ["served_records", "served_widths", "check_run", "greedy_traces", "record_frame", "record_frames",
           "rerun_rule", "RuleCheck", "replay_served", "ReplayCheck", "online_prices", "COLUMNS", "TIMED_COLUMNS"]

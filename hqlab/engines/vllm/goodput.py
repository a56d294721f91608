"""The goodput controller inside vLLM's scheduler: each step verifies the width, among those with captured CUDA
graphs, that maximises expected emitted tokens per second (`hqlab.rules.goodput`, the rule;
`gpu-lookup:...,goodput=default` or `goodput=PATH.json`, the knob).

Where it acts. As the speculation gate does (`hqlab.engines.vllm.gate`): vLLM 0.26's scheduler looks up, at every
`schedule()`, the width the requests verify at their next step in `dynamic_sd_lookup` by the step's batch size.
`SchedulerGoodput.before_schedule` runs just before each `schedule()` and points `dynamic_sd_lookup` at a table that
gives every batch size the width the controller chose. The candidate widths are those of the spec's `batch_k`
schedule plus 0 (vLLM captured a full CUDA graph for each of them at every batch size it captures:
`batch_k.with_plain_steps`), so every step keeps its graph.

What it reads, all on the host:
- the requests the step will run: every running request, and the waiting ones it may admit (as many as there are
  free slots, first in queue order), each with its `all_token_ids` (prompt and the outputs the scheduler has
  processed: three steps old under asynchronous scheduling, `hqlab.rules.gate.ASYNC_BEHIND`), fed to one
  `RequestFeatures` per request;
- the outcome of each verify step, when vLLM's scheduler processes it (`observe`, called by the plugin before
  `update_from_output`): the drafts the step verified (`scheduled_spec_decode_tokens`) and the tokens it emitted,
  fed to the calibration with the cell the request had when that width was fixed. Which cells fixed a step's width
  travels with the step: `after_schedule` keys them by the scheduler output.
Nothing is read from the GPU; the replay (`hqlab.replay.goodput.replay_engine`) reproduces every decision, and
tests/engines/vllm/test_vllm_goodput.py drives vLLM's own scheduler to check it, step for step. A served engine
records its decisions where `HQLAB_GOODPUT_RECORD` names a file (`goodput_record`: each call's candidates, tokens,
cells and width, each outcome; with costs measured online each call's prices and each timed step too), which
`hqlab.replay.goodput_served` checks against the rule.

The drafts are unchanged, and a step verifies the first `width` of them. `gpu-lookup` drafts k positions every step
(with goodput its table forecast is off: any captured width may come at any batch size). `gpu-fused` (same knob)
skips its drafter on the steps that verify nothing and only those: the plugin hands it the width vLLM's scheduler
fixed for the step its drafts go to (`V2Speculator.next_width`), so a step at width 0 runs no drafter work, prompts
included, and the next drafting step catches up, as after `batch_k`'s width 0.

With `goodput=online` (or `online:PATH.json`) the prices are measured here: the hook reads the host's monotonic clock
as each `update_from_output` starts and hands the interval since the previous one, attributed to the step whose
output it processes, with that step's batch size, width and whether it ran prompt tokens, to the controller's
`OnlineCosts` (`hqlab.rules.online_costs`: which intervals count, and the model). The clock is the only thing read.
The record gets each interval as the costs kept it (integer µs) and each call's prices, so that the check feeds the
same intervals in the same order and must find the same prices and widths.

The rule takes a drafter-confidence feature (`GoodputConfig.confidence_edges`); this hook passes none
(docs/goodput.md's Limits says why).

Nothing here imports vLLM; the plugin (`plugin._patch_scheduler`) calls it.
"""

from __future__ import annotations

import os
import time
from itertools import islice
from typing import Any

from hqlab.config import require
from hqlab.engines.vllm import batch_k
from hqlab.engines.vllm.goodput_record import RECORD_ENV, DecisionLog
from hqlab.rules.goodput import Cell, CostModel, GoodputConfig, GoodputController, RequestFeatures, StepCosts
from hqlab.rules.online_costs import OnlineCosts, StepTimer, costs_for, micros

PENDING_LIMIT = 16  # scheduler outputs whose outcome is awaited; more means some were never processed (empty steps)


def check_knob(goodput: str, *, gate: int = 0) -> None:
    """A spec's `goodput=` value checked when its config is built (gpu-lookup's and gpu-fused's alike): exclusive
    with the gate, and a costs file that exists and parses."""
    if goodput:
        require(not gate, "gate and goodput both set each step's width: keep one (goodput generalises gate)")
        costs_for(goodput)  # a missing or malformed costs file fails here, with what to fix


def plain_steps(config: Any) -> bool:
    """Whether a speculator's config sets widths per step (the gate, goodput), so that vLLM must capture plain
    steps' graphs at every batch size (`batch_k.with_plain_steps`)."""
    return getattr(config, "gate", 0) > 0 or bool(getattr(config, "goodput", ""))


def speculator_table(vllm_config: Any, config: Any) -> list[int] | None:
    """A speculator's width forecast by batch size (`batch_k.next_k`), checked against vLLM's schedule; None with
    goodput, whose widths do not follow the batch size (the speculator then drafts unless vLLM's scheduler says the
    step is plain: `V2Speculator.next_width`)."""
    table = batch_k.table_for(vllm_config, config.batch_k, config.k, plain_steps=plain_steps(config))
    return None if config.goodput else table


def standalone_table(config: Any, max_num_reqs: int) -> list[int] | None:
    """`speculator_table` for a speculator built without vLLM's config (tests, micro-benchmarks)."""
    if getattr(config, "goodput", "") or not getattr(config, "batch_k", ""):
        return None
    return batch_k.dense(batch_k.parse(config.batch_k, config.k), max_num_reqs, config.k)


def captured(vllm_config: Any) -> tuple[int, ...]:
    """The widths vLLM captured full CUDA graphs for: those of its `num_speculative_tokens_per_batch_size` schedule
    (every width of it, at every batch size it captures, whatever max_num_seqs cuts from the width table), plus 0."""
    schedule = getattr(vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None) or []
    return tuple(sorted({int(entry[2]) for entry in schedule} | {0}))


def record_header(spec: str, widths: tuple[int, ...], costs: CostModel, config: GoodputConfig) -> dict[str, Any]:
    """What a decisions record says of the controller that wrote it: enough to decide again (`GoodputController`).
    With costs measured online the table is the prior, `online` says the prices moved during the run and
    `online_config` is the costs' `OnlineConfig` (the record's timed steps move them again)."""
    from dataclasses import asdict

    online = isinstance(costs, OnlineCosts)
    table: StepCosts = costs.prior if online else costs  # type: ignore[assignment]
    header = {"spec": spec, "widths": sorted(set(widths) | {0}), "costs": table.to_dict(), "config": asdict(config),
              "online": online}
    if online:
        header["online_config"] = asdict(costs.config)  # type: ignore[union-attr]
    return header


class SchedulerGoodput:
    """The controller for one vLLM scheduler: per-request features, the calibration, and the table it hands vLLM."""

    def __init__(self, config: GoodputConfig, costs: CostModel, table: list[int], widths: tuple[int, ...],
                 log: DecisionLog | None = None) -> None:
        self.config = config
        self.widths = tuple(sorted(set(widths) | {0}))
        self.controller = GoodputController(config, self.widths, costs)
        self.tables = {w: [w] * len(table) for w in self.widths}  # what vLLM looks up: one width at every batch size
        self.features: dict[str, RequestFeatures] = {}
        self.log = log  # the decisions record (goodput_record), when the server was asked for one
        self.decisions = 0  # schedule() calls that priced requests: the record's call index
        self._cells: dict[str, Cell] = {}  # cells of this call's candidates: they fix the next step's width
        self._last: tuple[int, dict[str, Cell]] = (-1, {})  # (call, cells) that fixed the next step's width
        # id(scheduler output) -> (it, call, cells, its timer ticket)
        self._pending: dict[int, tuple[Any, int, dict[str, Cell], tuple[int, int]]] = {}
        self.steps_by_width = {w: 0 for w in self.widths}  # plain counters: widths fixed so far
        self.timer, self.clock = StepTimer(), time.monotonic_ns  # online costs' clock (ns)
        self.online = isinstance(costs, OnlineCosts)  # the record then carries each call's prices

    @classmethod
    def from_spec(cls, name: str, table: list[int], vllm_config: Any) -> "SchedulerGoodput":
        """The hook of a `goodput=NAME` knob for vLLM's width table `table`: the default step costs, a StepCosts
        JSON file, or costs measured online from either (`costs_for`), default settings, the widths vLLM captured
        graphs for; its decisions recorded to the file `HQLAB_GOODPUT_RECORD` names, if set (`goodput_record`)."""
        config, costs, widths = GoodputConfig(), costs_for(name), captured(vllm_config)
        path = os.environ.get(RECORD_ENV)
        log = None
        if path:
            from hqlab.engines.vllm.speculator import proposer_spec

            log = DecisionLog(path, record_header(proposer_spec(vllm_config), widths, costs, config))
        return cls(config, costs, table, widths, log)

    def _state(self, request: Any) -> RequestFeatures:
        state = self.features.get(request.request_id)
        if state is None or len(request.all_token_ids) < state.ladder.length:  # new, or rewound by vLLM
            state = self.features[request.request_id] = RequestFeatures(self.config)
        return state

    def before_schedule(self, scheduler: Any) -> None:
        """Fix the width of the step after the one `schedule()` is about to make, from that step's requests."""
        running = list(scheduler.running)
        free = max(0, int(scheduler.max_num_running_reqs) - len(running))
        candidates = running + list(islice(scheduler.waiting, free))
        cells = {}
        for request in candidates:
            cells[request.request_id] = self._state(request).cell(self.config, request.all_token_ids)
        width = self.controller.decide(cells.values())
        scheduler.dynamic_sd_lookup = self.tables[width]
        self._cells = cells
        if cells:
            self.steps_by_width[width] += 1
            if self.log is not None:
                self.log.decision(self.decisions, width, [(r.request_id, self.features[r.request_id].ladder.length,
                                                           cells[r.request_id]) for r in candidates],
                                  [micros(ms) for ms in self.controller.priced] if self.online else None)
            self.decisions += 1

    def after_schedule(self, scheduler_output: Any) -> None:
        """The step just scheduled verifies the width fixed at the previous call that scheduled a step: keep that
        call's cells with it. A call that scheduled nothing fixed nothing (vLLM gives its width to no request)."""
        if scheduler_output.total_num_scheduled_tokens == 0:
            return
        if len(self._pending) >= PENDING_LIMIT:
            self._pending.pop(next(iter(self._pending)))
        self._pending[id(scheduler_output)] = (scheduler_output, *self._last, self.timer.scheduled())
        self._last = (self.decisions - 1 if self._cells else -1, self._cells)

    def observe(self, scheduler: Any, scheduler_output: Any, runner_output: Any) -> None:
        """A step's outcome, as vLLM's scheduler is about to process it: per verifying request, drafts verified and
        accepted. Requests already finished (scheduled once more before their finish was known) are skipped, as
        vLLM drops their tokens."""
        now = self.clock()
        entry = self._pending.pop(id(scheduler_output), None)
        if entry is None or entry[0] is not scheduler_output:
            self.timer.processed(None, now)
            return
        _, call, cells, ticket = entry
        step = timed(self.controller.costs, scheduler_output, self.timer.processed(ticket, now))
        if step is not None and self.log is not None:
            self.log.timed(self.decisions, *step)
        sampled = runner_output.sampled_token_ids
        index = runner_output.req_id_to_index
        seen = []
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            request = scheduler.requests.get(rid)
            at = index.get(rid)
            if not drafts or rid not in cells or request is None or request.is_finished() or at is None \
                    or not sampled or not sampled[at]:
                continue
            accepted = min(len(sampled[at]) - 1, len(drafts))
            self.controller.observe(cells[rid], len(drafts), accepted)
            state = self.features.get(rid)
            if state is not None:
                state.last_accepted = accepted
            seen.append((rid, len(drafts), accepted))
        if self.log is not None and seen:
            self.log.outcomes(call, self.decisions, seen)

    def forget(self, request_id: str) -> None:
        """vLLM frees the request: drop its features."""
        self.features.pop(request_id, None)


def timed(costs: CostModel, scheduler_output: Any, interval_ns: int | None) -> tuple[int, int, int, bool] | None:
    """Online costs: a step's attributed interval, with its batch size, the width its requests verified, and whether
    it ran only decode tokens (no prompt admitted or continued: each request runs 1 + its drafts). The step as the
    costs were handed it, (batch, width, µs, decode only), or None where nothing was handed."""
    if interval_ns is None or not isinstance(costs, OnlineCosts):
        return None
    tokens = scheduler_output.num_scheduled_tokens
    drafts = scheduler_output.scheduled_spec_decode_tokens
    decode_only = not scheduler_output.scheduled_new_reqs and all(
        n == 1 + len(drafts.get(rid, ())) for rid, n in tokens.items())
    step = (len(tokens), max((len(d) for d in drafts.values()), default=0), micros(interval_ns / 1e6), decode_only)
    costs.observe_us(*step)
    return step


__all__ = ["SchedulerGoodput", "timed", "captured", "record_header", "check_knob", "plain_steps", "speculator_table",
           "standalone_table", "PENDING_LIMIT"]

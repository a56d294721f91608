"""The goodput controller (`hqlab.rules.goodput`) replayed over recorded greedy outputs, one request or many
concurrent ones, and priced with the same step costs it decides with.

`replay_engine` plays vLLM 0.26's engine core with asynchronous scheduling over a set of requests: all of them queued
at the start, at most `concurrency` running (vLLM's max_num_seqs; a finished request's slot goes to the next in the
queue), and the engine core's batch queue of two (`EngineCore.step_with_batch_queue`: schedule step n + 1, then
process step n's output). Each `schedule()` call
- first lets the policy fix a width (the goodput controller reads every running request, and the waiting ones the
  step will admit, as the scheduler knows them: its history, its last verify outcome);
- schedules the step: a request admitted now runs its prefill (one token), every other verifies the width fixed at
  the previous call (vLLM's placeholders), and a request that finished in the step still in flight is scheduled
  once more, its output dropped;
- and the width fixed now goes to the next step, as vLLM looks it up by this step's batch size.
The drafts of a verify step are the lookup's over the request's whole history before the step (the GPU speculator
drafts at the end of the step before), so under greedy decoding every step follows from the recorded output exactly:
`lookup_acceptance` holds, for every output position, how many of the lookup's k drafts the output confirms, and a
width w accepts the first min(that, w) of them (the lookup's proposal at width w is the prefix of its proposal at k).
tests/engines/vllm/test_vllm_goodput.py drives vLLM's own AsyncScheduler and checks it fixes these widths.

`price` turns a run's steps into time with `StepCosts` (each step at its batch size and width; prefills are priced
as decode steps: their prompt's compute is the same in every config and is left out). `compare` prices the
controller against `none` (every step plain), every fixed width and a `batch_k` table on the same requests.
`step_costs_from_grid` builds `StepCosts` from the committed vLLM step-cost grid (`hqlab.replay.scale`'s format).

Costs measured online (`hqlab.rules.online_costs`): given the time each step took (`step_ms`: a sequence, one per
step in schedule order, or a function of the step; `timed` prices a `StepCosts` "truth" with deterministic noise),
the replay plays the engine core's clock, reading it where the vLLM hook does (as each step's output is processed),
so a controller whose costs are an `OnlineCosts` measures what a server would and decides as it would.
`compare_online` prices controllers that decide with a prior, with costs measured online from it, and with the
truth, all with the truth.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np
import polars as pl

from hqlab.config import ConfigError, LookupConfig, require
from hqlab.engines.vllm import batch_k
from hqlab.replay.traces import Trace
from hqlab.rules.goodput import Cell, CostModel, GoodputConfig, GoodputController, MatchLadder, StepCosts
from hqlab.rules.lookup import suffix_match
from hqlab.rules.online_costs import OnlineCosts, StepTimer

POLICIES = ("none", "fixed", "table", "goodput")
# what each step took, ms: one per step in schedule order, or f(step index, batch, width, prompts admitted)
StepMs = Union[Sequence[float], Callable[[int, int, int, int], float]]


def lookup_acceptance(trace: Trace, lookup: LookupConfig) -> np.ndarray:
    """For each output position p (p output tokens known, index 0 unused: the prefill), how many of the lookup's
    k drafts from that history the output confirms, capped so that the step stays inside the output."""
    out = np.asarray(trace.output_ids, dtype=np.int64)
    history = np.concatenate([np.asarray(trace.prompt_ids, dtype=np.int64), out])
    prompt = len(trace.prompt_ids)
    accepted = np.zeros(len(out), dtype=np.int64)
    for p in range(1, len(out)):
        room = min(lookup.k, len(out) - p - 1)
        if room <= 0:
            continue
        m = suffix_match(history[:prompt + p], nmin=lookup.nmin, nmax=lookup.nmax, k=room, search=lookup.search,
                         policy=lookup.policy, full=lookup.full)
        agree = m.tokens == out[p:p + len(m.tokens)]
        accepted[p] = int(np.argmin(np.append(agree, False)))
    return accepted


def ladder_buckets(trace: Trace, edges: Sequence[int]) -> np.ndarray:
    """The match ladder's bucket (`hqlab.rules.goodput.MatchLadder`) after the prompt and each output prefix: index n
    is the bucket of the prompt and the first n output tokens (what a request's features read when the scheduler has
    processed n of its tokens)."""
    ladder = MatchLadder(edges)
    out = np.zeros(len(trace.output_ids) + 1, dtype=np.int64)
    out[0] = ladder.extend(trace.prompt_ids)
    for n, token in enumerate(trace.output_ids, start=1):
        out[n] = ladder.extend((token,))
    return out


class TraceTables:
    """What the replay reads of each trace, computed once per trace and shared by every policy and load replayed
    over it: the lookup's acceptance at each output position (`lookup_acceptance`) and the ladder's buckets
    (`ladder_buckets`). Keyed by the trace object."""

    def __init__(self, lookup: LookupConfig) -> None:
        self.lookup = lookup
        self._accept: dict[int, tuple[Trace, np.ndarray]] = {}
        self._buckets: dict[tuple[int, tuple[int, ...]], tuple[Trace, np.ndarray]] = {}

    def acceptance(self, trace: Trace) -> np.ndarray:
        found = self._accept.get(id(trace))
        if found is None or found[0] is not trace:
            found = self._accept[id(trace)] = (trace, lookup_acceptance(trace, self.lookup))
        return found[1]

    def buckets(self, trace: Trace, edges: Sequence[int]) -> np.ndarray:
        key = (id(trace), tuple(edges))
        found = self._buckets.get(key)
        if found is None or found[0] is not trace:
            found = self._buckets[key] = (trace, ladder_buckets(trace, edges))
        return found[1]


@dataclass(frozen=True)
class Policy:
    """How the engine fixes each step's width: `none` (every step plain), `fixed` (`width` at every batch size),
    `table` (a `batch_k` value: the width by batch size) or `goodput` (the controller, choosing among `widths`)."""

    name: str
    width: int = 0
    table: str = ""
    widths: tuple[int, ...] = ()
    goodput: GoodputConfig | None = None

    def __post_init__(self) -> None:
        require(self.name in POLICIES, f"policy must be one of {POLICIES} (got {self.name!r})")
        require(self.width >= 0, f"a fixed width is >= 0 drafts (got {self.width})")
        require(self.name != "table" or bool(self.table), "a table policy needs a batch_k value, e.g. 1:15/4:7/0")
        require(self.name != "goodput" or (self.goodput is not None and 0 in self.widths),
                "a goodput policy needs its GoodputConfig and candidate widths including 0")

    @property
    def label(self) -> str:
        return {"none": "none", "fixed": f"fixed {self.width}", "table": f"batch_k={self.table}",
                "goodput": "goodput"}[self.name]

    @staticmethod
    def none() -> "Policy":
        return Policy("none")

    @staticmethod
    def fixed(width: int) -> "Policy":
        return Policy("fixed", width=width)

    @staticmethod
    def batch_table(value: str) -> "Policy":
        return Policy("table", table=value)

    @staticmethod
    def controller(widths: Sequence[int], config: GoodputConfig | None = None) -> "Policy":
        return Policy("goodput", widths=tuple(sorted(set(widths) | {0})), goodput=config or GoodputConfig())


def captured_widths(value: str, k: int) -> tuple[int, ...]:
    """The widths with captured CUDA graphs for a `batch_k` value ("" = k everywhere): its widths plus 0."""
    entries = batch_k.parse(value, k) if value else [(batch_k.MAX_BATCH, k)]
    return tuple(sorted({w for _, w in entries} | {0}))


@dataclass
class Decision:
    """One `schedule()` call of the controller (empty steps' calls included, as the hook runs at each): the cells of
    the requests it priced, and the width it fixed."""

    index: int
    counts: dict[Cell, int]
    width: int
    priced: tuple[float, ...] = ()  # ms per candidate width the decision priced its step at


@dataclass
class EngineRun:
    """A replayed engine run. Per step: its batch size, the width its verifying requests verified (0 for a step of
    prefills only), how many requests ran their prefill, the tokens it emitted, and the width fixed at its
    `schedule()` call for the next step. Per request: the width and emitted tokens of each of its steps whose output
    counted (its prefill first). `decisions` and `outcomes` ((index of the first decision that saw it, cell,
    drafted, accepted)) log the controller's inputs."""

    policy: Policy
    concurrency: int
    batch: list[int] = field(default_factory=list)
    width: list[int] = field(default_factory=list)
    prefills: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    fixed: list[int] = field(default_factory=list)
    request_widths: list[list[int]] = field(default_factory=list)
    request_emitted: list[list[int]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    outcomes: list[tuple[int, Cell, int, int]] = field(default_factory=list)
    costs: CostModel | None = None  # the controller's costs at the end (an OnlineCosts: what it measured)

    @property
    def tokens(self) -> int:
        return int(sum(self.emitted))


def _fixes(policy: Policy, table: list[int] | None, controller: GoodputController | None, cells: dict[int, Cell],
           batch: int) -> int:
    """The width a schedule call fixes for the next step: a table is looked up at the batch size of the step being
    scheduled, as vLLM does; the controller decides from the cells of every running request and those the step
    admits, as the scheduler hook reads them."""
    if policy.name == "none":
        return 0
    if policy.name == "fixed":
        return policy.width
    if policy.name == "table":
        assert table is not None
        return table[min(max(batch, 1), len(table) - 1)]
    assert controller is not None
    return controller.decide(cells.values()) if cells else 0


def replay_engine(traces: Sequence[Trace], lookup: LookupConfig, policy: Policy, *, concurrency: int,
                  costs: StepCosts | OnlineCosts | None = None, tables: TraceTables | None = None,
                  step_ms: StepMs | None = None) -> EngineRun:
    """The steps of `traces` (one request each, queued in order) served by vLLM's engine core under `policy`, at
    most `concurrency` at once. `costs` are the controller's step costs (needed for `goodput`; an `OnlineCosts`
    starts afresh from its prior and measures `step_ms`, what each step took); `tables` what the replay reads of
    each trace, when the caller keeps them across replays.

    The controller reads each request's history as the scheduler has it, `GoodputConfig.behind` steps old: 3 is
    vLLM's asynchronous scheduling; 2 and 1 let it read the output of the step in flight, and of the step being
    scheduled too (what no vLLM scheduler knows: the planted bug the vLLM test must catch)."""
    require(concurrency >= 1, f"concurrency must be >= 1 request (got {concurrency})")
    require(all(len(t.output_ids) >= 1 for t in traces), "every trace needs an output to replay")
    tables = tables if tables is not None else TraceTables(lookup)
    require(tables.lookup == lookup, "the trace tables were computed for another lookup config")
    widest = max(policy.width, max(policy.widths, default=0))
    require(widest <= lookup.k, f"width {widest} is wider than the lookup's k={lookup.k}")
    controller = None
    if policy.name == "goodput":
        require(costs is not None, "the goodput policy needs the step costs it decides with")
        assert policy.goodput is not None and costs is not None
        require(policy.goodput.behind <= 3, f"the replay models vLLM's asynchronous scheduling, 3 steps behind at "
                                            f"most (got behind={policy.goodput.behind})")
        if isinstance(costs, OnlineCosts):
            require(step_ms is not None, "costs measured online need the time each step took (step_ms)")
            costs = OnlineCosts(costs.prior, costs.config)
        controller = GoodputController(policy.goodput, policy.widths, costs)
    table = batch_k.dense(batch_k.parse(policy.table, lookup.k), concurrency, lookup.k) if policy.table else None
    loop = _EngineLoop(traces, tables, policy, concurrency, controller, table)
    if step_ms is not None:
        loop.clock = _Clock(step_ms)
    return loop.run()


class _Clock:
    """The engine core's monotonic clock (ns) as the vLLM hook reads it, as each step's output is processed: the
    GPU runs the steps back to back, so it has moved on by the step's time; and which intervals count
    (`StepTimer`)."""

    def __init__(self, step_ms: StepMs) -> None:
        self.step_ms, self.now_ns, self.timer = step_ms, 0, StepTimer()

    def processed(self, ticket: tuple[int, int], index: int, batch: int, width: int, prompts: int) -> float | None:
        ms = self.step_ms(index, batch, width, prompts) if callable(self.step_ms) else self.step_ms[index]
        self.now_ns += round(ms * 1e6)
        interval = self.timer.processed(ticket, self.now_ns)
        return None if interval is None else interval / 1e6


class _EngineLoop:
    """vLLM's engine core over the requests: schedule a step, then process the step before it (a queue of two)."""

    def __init__(self, traces: Sequence[Trace], tables: TraceTables, policy: Policy, concurrency: int,
                 controller: GoodputController | None, table: list[int] | None) -> None:
        self.policy, self.concurrency, self.controller, self.table = policy, concurrency, controller, table
        self.config = policy.goodput if controller is not None else None
        self.out = EngineRun(policy, concurrency, request_widths=[[] for _ in traces],
                             request_emitted=[[] for _ in traces])
        self.lengths = [len(t.output_ids) for t in traces]
        self.accept = [tables.acceptance(t) for t in traces]
        self.buckets = [tables.buckets(t, self.config.match_edges) for t in traces] if self.config else []
        self.last_accepted: list[int | None] = [None] * len(traces)  # drafts accepted, last verify step processed
        self.pos = [0] * len(traces)  # output tokens the scheduler has processed
        self.ahead = [0] * len(traces)  # output tokens once every step scheduled so far is processed
        self.waiting, self.running = deque(range(len(traces))), []
        # scheduled steps not yet processed: (step index, {request: (width (-1: prefill), emitted (0: dropped),
        # accepted)}, the cells that fixed its width)
        self.queue: deque = deque()
        self.next_width, self.last_cells = 0, {}
        self.clock: _Clock | None = None

    def run(self) -> EngineRun:
        while self.waiting or self.running or self.queue:
            if (self.waiting or self.running) and self.schedule() and len(self.queue) < 2:
                continue
            self.process(*self.queue.popleft())
        self.out.costs = self.controller.costs if self.controller is not None else None
        return self.out

    def outcome(self, r: int, w: int) -> tuple[int, int]:
        """(emitted, accepted) of request r's next scheduled step at width w (-1: its prefill); 0 emitted when the
        step is scheduled after the request's last token (vLLM drops its output)."""
        if self.ahead[r] >= self.lengths[r]:
            return 0, 0
        accepted = 0 if w < 0 else min(int(self.accept[r][self.ahead[r]]), w)
        self.ahead[r] += accepted + 1
        return accepted + 1, accepted

    def cells(self, requests: list[int], in_flight_done: list[int]) -> dict[int, Cell]:
        """The requests' cells from the history the controller reads: what the scheduler has processed (behind 3),
        also the step in flight's output (`in_flight_done`, behind 2), or the step just scheduled's too (behind 1)."""
        if self.config is None:
            return {}
        lag = self.config.behind
        known = self.pos if lag == 3 else in_flight_done if lag == 2 else self.ahead
        return {r: self.config.cell(int(self.buckets[r][min(known[r], self.lengths[r])]), self.last_accepted[r])
                for r in requests}

    def schedule(self) -> bool:
        """One `schedule()` call: the policy fixes the next width (the hook runs even when the step comes out
        empty), then the step is queued if it has tokens to compute; whether it was."""
        admitted = [self.waiting[i] for i in range(min(self.concurrency - len(self.running), len(self.waiting)))]
        # vLLM skips a running request whose step in flight is sure to complete it (one more token reaches
        # max_tokens); the request keeps its slot until that output is processed
        in_flight = self.queue[-1][1] if self.queue else {}
        decoding = [r for r in self.running if not (r in in_flight and self.pos[r] + 1 >= self.lengths[r])]
        in_flight_done = list(self.ahead)
        step = {r: (self.next_width, *self.outcome(r, self.next_width)) for r in decoding}
        step.update({r: (-1, *self.outcome(r, -1)) for r in admitted})
        cells = self.cells(self.running + admitted, in_flight_done)
        width = _fixes(self.policy, self.table, self.controller, cells, len(step))
        if self.controller is not None and cells:
            counts: dict[Cell, int] = {}
            for c in cells.values():
                counts[c] = counts.get(c, 0) + 1
            self.out.decisions.append(Decision(len(self.out.decisions), counts, width, self.controller.priced))
        if not step:  # vLLM runs (and fixes the next width by) only steps with tokens to compute
            return False
        for _ in admitted:
            self.waiting.popleft()
        self.running.extend(admitted)
        out = self.out
        out.batch.append(len(step))
        out.width.append(self.next_width if len(admitted) < len(step) else 0)
        out.prefills.append(len(admitted))
        out.emitted.append(0)
        out.fixed.append(width)
        ticket = self.clock.timer.scheduled() if self.clock is not None else (0, 0)
        self.queue.append((len(out.batch) - 1, step, self.last_cells, ticket))
        self.next_width, self.last_cells = width, cells
        return True

    def process(self, index: int, step: dict[int, tuple[int, int, int]], cells: dict[int, Cell],
                ticket: tuple[int, int]) -> None:
        """The scheduler processes a step's output: its time, tokens, the controller's outcomes, finished requests
        freed."""
        out = self.out
        if self.clock is not None:
            args = (out.batch[index], out.width[index], out.prefills[index])
            ms = self.clock.processed(ticket, index, *args)
            costs = self.controller.costs if self.controller is not None else None
            if ms is not None and isinstance(costs, OnlineCosts):
                costs.observe(args[0], args[1], ms, args[2] == 0)
        for r, (w, emitted, accepted) in step.items():
            if emitted == 0:
                continue
            if self.controller is not None and w > 0:
                self.controller.observe(cells[r], w, accepted)
                self.last_accepted[r] = accepted
                out.outcomes.append((len(out.decisions), cells[r], w, accepted))
            out.request_widths[r].append(max(w, 0))
            out.request_emitted[r].append(emitted)
            out.emitted[index] += emitted
            self.pos[r] += emitted
            if self.pos[r] >= self.lengths[r]:
                self.running.remove(r)


def price(run: EngineRun, costs: StepCosts) -> dict[str, float]:
    """A run's predicted time and speed: each step at its batch size and width."""
    time_ms = sum(costs.at(b, w) for b, w in zip(run.batch, run.width))
    extrapolated = sum(1 for b in run.batch if not costs.measured(b))
    return {"tokens": run.tokens, "steps": len(run.batch), "time_ms": time_ms,
            "tok_s": run.tokens / time_ms * 1e3, "tokens_per_step": run.tokens / len(run.batch),
            "mean_batch": float(np.mean(run.batch)), "spec_share": float(np.mean([w > 0 for w in run.width])),
            "extrapolated_share": extrapolated / len(run.batch)}


def requests_for(traces: Sequence[Trace], count: int) -> list[Trace]:
    """`count` requests cycling through `traces` in order (a load point of several waves from a small set)."""
    require(len(traces) >= 1 and count >= 1, "need at least one trace and one request")
    return [traces[i % len(traces)] for i in range(count)]


def compare(traces: Sequence[Trace], lookup: LookupConfig, costs: StepCosts, *, concurrency: int, batch_k_value: str,
            config: GoodputConfig | None = None, waves: int = 10, workload: str = "",
            tables: TraceTables | None = None) -> pl.DataFrame:
    """One row per policy (none, each captured width fixed, the `batch_k` table, the controller) on the same
    requests: at least `waves` × `concurrency` of them, cycling through `traces`. `speedup` is tok/s over none's,
    `vs_best_fixed` over the fastest fixed width's (none included)."""
    requests = requests_for(traces, max(len(traces), waves * concurrency))
    tables = tables if tables is not None else TraceTables(lookup)
    widths = captured_widths(batch_k_value, lookup.k)
    policies = [Policy.none()] + [Policy.fixed(w) for w in widths if w > 0] + \
        [Policy.batch_table(batch_k_value), Policy.controller(widths, config)]
    rows = []
    for policy in policies:
        run = replay_engine(requests, lookup, policy, concurrency=concurrency, costs=costs, tables=tables)
        rows.append({"workload": workload, "concurrency": concurrency, "requests": len(requests),
                     "policy": policy.label, **price(run, costs)})
    none = rows[0]["tok_s"]
    best = max(r["tok_s"] for r, p in zip(rows, policies) if p.name in ("none", "fixed"))
    for row in rows:  # in Python: a frame divides by a scalar through its reciprocal, and x / x would not be 1
        row["speedup"], row["vs_best_fixed"] = row["tok_s"] / none, row["tok_s"] / best
    return pl.DataFrame(rows)


_MASK = (1 << 64) - 1


def _unit(seed: int, index: int) -> float:
    """A deterministic number in [-1, 1) for step `index` (splitmix64 of the seed and the index)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) / 2 ** 63 - 1


def timed(truth: StepCosts, *, noise: float = 0.05, seed: int = 0,
          prompt_ms: float = 20.0) -> Callable[[int, int, int, int], float]:
    """What each step takes on a host whose decode steps cost `truth` (a `step_ms` for `replay_engine`): its batch
    and width's cost times 1 + `noise` u, u in [-1, 1) fixed by (seed, step index); each prompt a step admits adds
    `prompt_ms` (prompts are timed apart from decode steps, and must not leak into their prices)."""
    require(0 <= noise < 1, f"noise is a fraction of the step's cost in [0, 1) (got {noise})")

    def step_ms(index: int, batch: int, width: int, prompts: int) -> float:
        return truth.at(batch, width) * (1 + noise * _unit(seed, index)) + prompts * prompt_ms
    return step_ms


def compare_online(traces: Sequence[Trace], lookup: LookupConfig, prior: StepCosts, truth: StepCosts, *,
                   concurrency: int, batch_k_value: str, config: GoodputConfig | None = None, waves: int = 10,
                   workload: str = "", tables: TraceTables | None = None, noise: float = 0.05,
                   seed: int = 0) -> pl.DataFrame:
    """Costs measured online against a wrong prior: on the same requests, priced with `truth`, the controller
    deciding with `prior` ("goodput prior"), measuring its steps from `prior` on (`OnlineCosts`, the steps taking
    `timed(truth, noise=noise, seed=seed)`: "goodput online"), and deciding with `truth` ("goodput truth"), with
    `none` and each captured width fixed. `speedup` is tok/s over none's, `vs_truth` over the truth-priced
    controller's; the online row also holds its final plain and excess scales (g0, gx) and its probes."""
    requests = requests_for(traces, max(len(traces), waves * concurrency))
    tables = tables if tables is not None else TraceTables(lookup)
    widths = captured_widths(batch_k_value, lookup.k)
    controller = Policy.controller(widths, config)
    runs = [("none", Policy.none(), None, None)] + [(f"fixed {w}", Policy.fixed(w), None, None) for w in widths
                                                     if w > 0]
    runs += [("goodput prior", controller, prior, None),
             ("goodput online", controller, OnlineCosts(prior), timed(truth, noise=noise, seed=seed)),
             ("goodput truth", controller, truth, None)]
    rows = []
    for label, policy, costs, step_ms in runs:
        run = replay_engine(requests, lookup, policy, concurrency=concurrency, costs=costs, tables=tables,
                            step_ms=step_ms)
        g0, gx = run.costs.scales() if isinstance(run.costs, OnlineCosts) else (float("nan"), float("nan"))
        rows.append({"workload": workload, "concurrency": concurrency, "requests": len(requests), "policy": label,
                     **price(run, truth), "g0": g0, "gx": gx, "prior": prior.source, "truth": truth.source})
    none, best = rows[0]["tok_s"], rows[-1]["tok_s"]
    for row in rows:
        row["speedup"], row["vs_truth"] = row["tok_s"] / none, row["tok_s"] / best
    return pl.DataFrame(rows)


def dearer_widths(costs: StepCosts, factor: float) -> StepCosts:
    """What-if step costs: each width's excess over a plain step of the same batch multiplied by `factor` (1 returns
    `costs` itself). A served speculative step cost 1.22-1.59x a plain one at one request (docs/serving.md) where
    the step-cost grid has 1.15x: factors 2 and 4 span that range."""
    require(factor > 0, f"factor must be > 0 (got {factor})")
    if factor == 1:
        return costs
    ms = tuple(tuple(row[0] + factor * (x - row[0]) for x in row) for row in costs.ms)
    return StepCosts(costs.batches, costs.widths, ms, source=f"{costs.source}; width excess x{factor:g}")


def step_costs_from_grid(grid: pl.DataFrame, shape: str, *, config: str = "gpu-lookup", context: int = 1024,
                         quant: str = "bf16") -> StepCosts:
    """`StepCosts` from the vLLM step-cost grid (`hqlab.replay.scale.STEP_COST_SCHEMA`): the rows of one shape,
    config, quantisation and context, from the one run that measured the most batch sizes there (a table mixing runs
    would mix hosts and engine modes). The grid's verify width v is v - 1 drafts; the median step is taken, as the
    grid's runs without a mean have it."""
    rows = grid.filter((pl.col("shape") == shape) & (pl.col("config") == config) & (pl.col("quant") == quant)
                       & (pl.col("context") == context))
    if rows.is_empty():
        raise ConfigError(f"the step-cost grid has no {shape} {config} {quant} rows at context {context}")
    per_run = rows.group_by("run").agg(pl.col("batch").n_unique().alias("batches")).sort("batches", "run",
                                                                                           descending=[True, False])
    if per_run.height > 1 and per_run["batches"][0] == per_run["batches"][1]:
        raise ConfigError(f"runs {per_run['run'].to_list()[:2]} measured as many batch sizes of {shape} at context "
                          f"{context}: filter the grid to one run first")
    run = per_run["run"][0]
    rows = rows.filter(pl.col("run") == run).sort("batch", "width")
    batches = sorted(rows["batch"].unique().to_list())
    widths = sorted(rows["width"].unique().to_list())
    ms = []
    for b in batches:
        at = dict(rows.filter(pl.col("batch") == b).select("width", "step_ms").iter_rows())
        missing = [w for w in widths if w not in at]
        if missing:
            raise ConfigError(f"the step-cost grid's run {run!r} lacks widths {missing} of {shape} at batch {b}")
        ms.append(tuple(at[w] for w in widths))
    machine = rows["machine"][0].split(",")[0] if "machine" in rows.columns else ""
    return StepCosts(tuple(batches), tuple(w - 1 for w in widths), tuple(ms),
                     source=f"vLLM step-cost grid: {shape}, {config}, {quant}, context {context}, {machine}")


__all__ = ["lookup_acceptance", "ladder_buckets", "TraceTables", "Policy", "captured_widths", "Decision", "EngineRun",
           "replay_engine", "price", "requests_for", "compare", "compare_online", "timed", "dearer_widths",
           "step_costs_from_grid", "POLICIES", "StepMs"]

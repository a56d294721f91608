"""The goodput controller: each step's verify width chosen to maximise expected emitted tokens per second (#62).

The one reference implementation of the rule. The vLLM scheduler hook (`hqlab.engines.vllm.goodput`) and the replay
(`hqlab.replay.goodput`) both use the classes below; nothing else decides a width.

Why. vLLM verifies one width for every request of a step, and what a width costs depends on the batch: at one
request a wide step costs little more than a plain one, at 32 requests it processes 32 × (k + 1) positions. A fixed
table of widths per batch size (`batch_k`) cannot see what the requests of a step are doing: a copy at batch 8 wants
the widest step, eight requests of sampled prose want none. The gate (`hqlab.rules.gate`) chooses between the
table's width and none from the lookup's match alone; this rule generalises it to a choice among all widths with
captured CUDA graphs, priced.

The rule. Among the candidate widths W (those with captured graphs, 0 included), a step of batch B gets

    argmax over w in W of   sum over the step's requests r of E_r(w)   /   cost(B, w)

where E_r(w) = 1 + sum_{i=1..w} P_r(the first i drafts are accepted) is request r's expected emitted tokens at width
w and cost(B, w) the measured time of such a step (`StepCosts`). Ties go to the narrower width.

What a prediction reads: only what vLLM's scheduler knows when it fixes the width under asynchronous scheduling (the
history `behind` steps old, `hqlab.rules.gate.ASYNC_BEHIND`, as the gate reads it):
- the lookup's match length on that history, as a bucket: which of the lengths `match_edges` its suffix matches
  earlier in it (`MatchLadder`, exact against `hqlab.rules.lookup.suffix_match`);
- the request's recent acceptance: the drafts accepted in its last verify step the scheduler has seen (none yet is
  a bucket of its own);
- the drafter's confidence, for a speculator that has one (gpu-fused; bucketed by `confidence_edges`). The vLLM
  hook of gpu-lookup passes none.
The three buckets make a request's *cell*. Per cell and draft position i the rule keeps how often position i was
verified with the drafts before it accepted (`reached`) and how often it was then accepted (`hits`), from the
outcomes the scheduler has seen (`Calibration.observe`: drafted and accepted counts per request per step). The
conditional acceptance of position i is shrunk towards the pool of all cells, itself shrunk towards a prior:

    q_pool(i) = (hits_all(i) + w · prior(i)) / (reached_all(i) + w)
    q_cell(i) = (hits(i) + w · q_pool(i)) / (reached(i) + w)

with w = `prior_weight`, prior(1) = `prior_first`, prior(i > 1) = `prior_next`, and P_r(first i accepted) =
q(1) · ... · q(i). Counts are integers updated in the order the scheduler processes outputs, so the replay
reproduces every decision; a step's sum over requests is taken per cell in a fixed order, so it does not depend on
the order of the requests either.

A width of 0 is observed as nothing: a cell whose requests are never verified learns nothing more, and keeps what
it learnt. Requests of a step share its width, so a cell predicted low still learns whenever other requests make the
step wide. Two rules explore on top of the choice: after `explore_every` plain steps in a row the controller verifies
the best width other than 0 once, so that estimates that turned low on a few early outcomes can recover; and a step
with a request in a cell never verified verifies too (`explore_new_cells`), so that a rare cell (a long match: a
copy starting after prose) is not judged by the pool of all the others. Without either, with wide steps dear, the
replay of the 1.5B's prose and chat stopped speculating for good (tests/replay/test_goodput.py, docs/goodput.md).

The step costs are a fixed table (`StepCosts`) or measured by the server as it runs (`hqlab.rules.online_costs`,
`goodput=online`); a decision prices its step once (`GoodputController.priced`, what a record of it carries).

Pure, typed, deterministic; no vLLM import, no numpy in the decision path (the hook runs it every step).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

from hqlab.config import ConfigError, require
from hqlab.rules.gate import ASYNC_BEHIND

Cell = tuple[int, int, int]  # (match bucket, recent-acceptance bucket, confidence bucket)


# ----------------------------------------------------------------------------------------------------------------
# Step costs


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds per engine step by batch size and draft width (drafts verified per request; 0 = a plain step).

    `ms[i][j]` is a step of `batches[i]` requests at width `widths[j]`. Between measured points the cost is linear in
    the width and in the batch size. Past the largest measured batch it goes on along the line through the last two
    measured batches (each further request costs what one did between them); that is an assumption, and
    `measured(batch)` says where it applies. A width outside the measured ones is an error. `source` says where the
    numbers come from (card, engine, data file)."""

    batches: tuple[int, ...]
    widths: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", tuple(int(b) for b in self.batches))
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "ms", tuple(tuple(float(x) for x in row) for row in self.ms))
        require(len(self.batches) >= 1, "step costs need at least one measured batch size")
        require(all(b >= 1 for b in self.batches) and list(self.batches) == sorted(set(self.batches)),
                f"step cost batches must be >= 1 and strictly increasing (got {list(self.batches)})")
        require(len(self.widths) >= 1 and self.widths[0] == 0 and list(self.widths) == sorted(set(self.widths)),
                f"step cost widths must start at 0 (a plain step) and strictly increase (got {list(self.widths)})")
        require(len(self.ms) == len(self.batches) and all(len(row) == len(self.widths) for row in self.ms),
                f"step costs: ms must hold one row per batch ({len(self.batches)}) of one value per width "
                f"({len(self.widths)})")
        bad = [(b, w, x) for b, row in zip(self.batches, self.ms) for w, x in zip(self.widths, row)
               if not (math.isfinite(x) and x > 0)]
        require(not bad, f"step costs must be finite and > 0 ms (batch, width, ms: {bad[:3]})")

    def measured(self, batch: int) -> bool:
        """Whether `batch` lies within the measured batch sizes (else its cost is extrapolated)."""
        return self.batches[0] <= batch <= self.batches[-1]

    def wanted(self, widths: Sequence[int]) -> int | None:
        """A fixed table wants no width measured (`hqlab.rules.online_costs.OnlineCosts.wanted` does)."""
        return None

    def at(self, batch: int, width: int) -> float:
        """The cost (ms) of a step of `batch` requests verifying `width` drafts each."""
        require(batch >= 1, f"a step has at least one request (got batch {batch})")
        require(self.widths[0] <= width <= self.widths[-1],
                f"width {width} is outside the measured widths {self.widths[0]}-{self.widths[-1]}: measure it or "
                f"leave it out of the candidate widths")
        rows = [self._in_width(row, width) for row in self.ms]
        bs = self.batches
        if len(bs) == 1:
            return rows[0]
        i = min(max(bisect_right(bs, batch) - 1, 0), len(bs) - 2)  # the segment (extended at both ends)
        t = (batch - bs[i]) / (bs[i + 1] - bs[i])
        value = rows[i] + t * (rows[i + 1] - rows[i])
        require(value > 0, f"step costs extrapolated to batch {batch} at width {width} give {value:.3f} ms: measure "
                           f"that batch")
        return value

    def _in_width(self, row: tuple[float, ...], width: int) -> float:
        j = bisect_right(self.widths, width) - 1
        if self.widths[j] == width:
            return row[j]
        t = (width - self.widths[j]) / (self.widths[j + 1] - self.widths[j])
        return row[j] + t * (row[j + 1] - row[j])

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "batches": list(self.batches), "widths": list(self.widths),
                "ms": [list(row) for row in self.ms]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "step costs") -> "StepCosts":
        missing = [k for k in ("batches", "widths", "ms") if k not in data]
        if missing:
            raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}; write "
                              f'{{"batches": [1, 8], "widths": [0, 7, 15], "ms": [[...], [...]], "source": "..."}}')
        try:
            return cls(tuple(data["batches"]), tuple(data["widths"]), tuple(tuple(r) for r in data["ms"]),
                       str(data.get("source", "")))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: batches, widths and ms must be lists of numbers ({e})") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "StepCosts":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"step costs file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"step costs file {str(path)!r} is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"step costs file {str(path)!r} must hold one JSON object")
        return cls.from_dict(data, where=f"step costs file {str(path)!r}")

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


# The vLLM step of the 1.5B shape with the gpu-lookup speculator (vLLM 0.26, CUDA graphs, bf16, random weights, 1,024
# tokens of context), one run of the committed step-cost grid, H100: data/results/seed_scale/s2/grid.parquet, built by
# `hqlab.replay.goodput.step_costs_from_grid` (tests/replay/test_goodput.py checks these numbers against the file).
# The grid's verify width v is v - 1 drafts here. Batch sizes above 8 are extrapolated (`StepCosts.at`).
DEFAULT_STEP_COSTS = StepCosts(
    batches=(1, 8),
    widths=(0, 1, 3, 7, 15, 31),
    ms=((2.857122, 3.509241, 3.411225, 3.282485, 3.288268, 3.407151),
        (3.124783, 3.743504, 3.589987, 3.611136, 3.621087, 3.663369)),
    source="the committed step-cost grid, H100 (data/results/seed_scale/s2/grid.parquet): qwen2.5-1.5b, gpu-lookup, "
           "bf16, context 1024, vLLM 0.26.0")


def step_costs(name: str) -> StepCosts:
    """The step costs a spec names: "default" (`DEFAULT_STEP_COSTS`) or the path of a JSON file
    (`StepCosts.to_json`'s format)."""
    require(bool(name), 'name the step costs: "default" or a JSON file\'s path')
    if name == "default":
        return DEFAULT_STEP_COSTS
    if not name.endswith(".json"):
        raise ConfigError(f"goodput={name!r}: write goodput=default or goodput=PATH.json (a StepCosts JSON file), or "
                          f"goodput=online / online:PATH.json (costs the server measures, starting from those)")
    return StepCosts.from_json(name)


class Prices(Protocol):
    """What `choose_width` reads: ms per step by batch size and width."""

    def at(self, batch: int, width: int) -> float: ...


class CostModel(Prices, Protocol):
    """What the controller prices steps with: a fixed `StepCosts`, or costs measured by the server
    (`hqlab.rules.online_costs.OnlineCosts`), which may ask for a width to be measured (`wanted`)."""

    widths: tuple[int, ...]

    def wanted(self, widths: Sequence[int]) -> int | None: ...


# ----------------------------------------------------------------------------------------------------------------
# Features


class MatchLadder:
    """Which of the lengths `edges` a growing token sequence's suffix matches earlier in it: `bucket` = how many of
    them, i.e. the number of edges e with `suffix_match(h, nmin=1, nmax=max(edges), k=1).match_len >= e`.

    One set of seen e-grams per edge: each appended token costs one tuple and one set lookup per edge, independent of
    the context length (the gate's `SuffixGate`, for several lengths at once)."""

    __slots__ = ("edges", "_seen", "_tail", "length", "bucket")

    def __init__(self, edges: Sequence[int]) -> None:
        require(len(edges) >= 1 and all(e >= 1 for e in edges) and list(edges) == sorted(set(edges)),
                f"match edges must be >= 1 and strictly increasing (got {list(edges)})")
        self.edges = tuple(int(e) for e in edges)
        self._seen: list[set[tuple[int, ...]]] = [set() for _ in self.edges]
        self._tail: list[int] = []
        self.length = 0  # tokens seen so far
        self.bucket = 0

    def extend(self, tokens: Iterable[int]) -> int:
        """Append `tokens`; return `bucket` for the sequence so far."""
        edges, seen = self.edges, self._seen
        tail = self._tail
        longest = edges[-1]
        pairs = tuple(zip(edges, seen))
        bucket = self.bucket
        for token in tokens:
            tail.append(int(token))
            if len(tail) > longest:
                del tail[0]
            self.length += 1
            grams = tuple(tail)
            n = len(grams)
            bucket = 0
            for e, grams_seen in pairs:
                if e > n:
                    break
                gram = grams[n - e:]
                if gram in grams_seen:
                    bucket += 1  # matched at e implies matched at every shorter edge
                else:
                    grams_seen.add(gram)
        self.bucket = bucket
        return bucket

    def catch_up(self, history: Sequence[int]) -> int:
        """Append what `history` holds past the tokens already seen (the history only ever grows)."""
        if len(history) < self.length:
            raise ValueError(f"history shrank from {self.length} to {len(history)} tokens: a ladder follows one "
                             f"growing sequence (start a new MatchLadder for a new one)")
        return self.extend(history[self.length:])


def bucket_of(value: float | None, edges: Sequence[float]) -> int:
    """0 for no value; else 1 + how many of `edges` are <= value."""
    return 0 if value is None else 1 + bisect_right(edges, value)


@dataclass(frozen=True)
class GoodputConfig:
    """match_edges: lookup match lengths that split the match-length buckets (tokens; a suffix matching 8 but not 16
    earlier tokens is one bucket). accept_edges: drafts accepted in a request's last seen verify step, split the
    same way (no verify seen yet is a bucket of its own). confidence_edges: the drafter's confidence in [0, 1], for a
    speculator that reports one (empty: unused). prior_first, prior_next: the acceptance of the first draft, and of
    each later one given the drafts before it were accepted, before any outcome is seen: lookup drafts come in runs
    (in the 0.5B's corpus traces, replayed at k = 15: 0.20 for the first, 0.54 for the second given the first, then
    0.80-0.95). prior_weight: how many outcomes the prior (and, for a cell, the pool of all cells) weighs.
    explore_every: after this many plain steps in a row, a step verifies the best width other than 0 (0: never),
    because a plain step observes nothing and estimates that turned low early would otherwise stay low for good.
    explore_new_cells: a step that would be plain verifies the best other width while one of its requests is in a
    cell never verified yet (its estimate is the pool's, mostly other kinds of text: a copy starting among prose).
    behind: how many steps old the scheduler's history is (3 under vLLM's asynchronous
    scheduling); used by the replay, the vLLM hook gets it by construction."""

    match_edges: tuple[int, ...] = (2, 8, 32)
    accept_edges: tuple[int, ...] = (1, 2, 4, 8)
    confidence_edges: tuple[float, ...] = ()
    prior_first: float = 0.2
    prior_next: float = 0.8
    prior_weight: float = 16.0
    explore_every: int = 16
    explore_new_cells: bool = True
    behind: int = ASYNC_BEHIND

    def __post_init__(self) -> None:
        for name in ("match_edges", "accept_edges", "confidence_edges"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        require(len(self.match_edges) >= 1 and all(e >= 1 for e in self.match_edges)
                and list(self.match_edges) == sorted(set(self.match_edges)),
                f"match_edges must be match lengths >= 1, strictly increasing (got {list(self.match_edges)})")
        require(all(e >= 1 for e in self.accept_edges) and list(self.accept_edges) == sorted(set(self.accept_edges)),
                f"accept_edges must be draft counts >= 1, strictly increasing (got {list(self.accept_edges)})")
        require(all(0 < e < 1 for e in self.confidence_edges)
                and list(self.confidence_edges) == sorted(set(self.confidence_edges)),
                f"confidence_edges must lie in (0, 1), strictly increasing (got {list(self.confidence_edges)})")
        require(0 < self.prior_first < 1 and 0 < self.prior_next < 1,
                f"prior_first and prior_next are probabilities in (0, 1) (got {self.prior_first}, {self.prior_next})")
        require(self.prior_weight > 0, f"prior_weight must be > 0 outcomes (got {self.prior_weight})")
        require(self.explore_every >= 0, f"explore_every is a number of plain steps, 0 for never (got "
                                         f"{self.explore_every})")
        require(self.behind >= 1, f"behind must be >= 1 step (the width is fixed before the step's own tokens exist; "
                                  f"got {self.behind})")

    def cell(self, match_bucket: int, last_accepted: int | None, confidence: float | None = None) -> Cell:
        """A request's cell from its features (confidence ignored unless `confidence_edges` is set)."""
        conf = bucket_of(confidence, self.confidence_edges) if self.confidence_edges else 0
        return (match_bucket, bucket_of(last_accepted, self.accept_edges), conf)


class RequestFeatures:
    """What the controller knows of one request: its match ladder over the history the scheduler has, and the drafts
    accepted in its last verify step the scheduler has seen."""

    __slots__ = ("ladder", "last_accepted")

    def __init__(self, config: GoodputConfig) -> None:
        self.ladder = MatchLadder(config.match_edges)
        self.last_accepted: int | None = None

    def cell(self, config: GoodputConfig, history: Sequence[int], confidence: float | None = None) -> Cell:
        """Bring the ladder up to `history` (what the scheduler knows now); the request's cell."""
        return config.cell(self.ladder.catch_up(history), self.last_accepted, confidence)


# ----------------------------------------------------------------------------------------------------------------
# Calibration and the choice


class Calibration:
    """Per cell and draft position: `reached` (verified with every draft before it accepted) and `hits` (then
    accepted), pooled counts over all cells, and the expected emitted tokens they predict."""

    def __init__(self, config: GoodputConfig, max_width: int) -> None:
        require(max_width >= 0, f"max_width must be >= 0 (got {max_width})")
        self.config = config
        self.max_width = max_width
        self.reached: dict[Cell, list[int]] = {}
        self.hits: dict[Cell, list[int]] = {}
        self.pool_reached = [0] * (max_width + 1)  # index = position (1-based; 0 unused)
        self.pool_hits = [0] * (max_width + 1)
        self.observed = 0  # outcomes observed (verify steps of one request)
        self._expected: dict[Cell, tuple[float, ...]] = {}  # cache, cleared by every observation

    def observe(self, cell: Cell, drafted: int, accepted: int) -> None:
        """One request's verify step: `drafted` drafts verified (the step's width), `accepted` of them accepted."""
        require(0 <= accepted <= drafted, f"accepted must be in [0, drafted] (got {accepted} of {drafted})")
        if drafted == 0:
            return
        top = min(drafted, self.max_width)
        reached = self.reached.setdefault(cell, [0] * (self.max_width + 1))
        hits = self.hits.setdefault(cell, [0] * (self.max_width + 1))
        for i in range(1, min(top, accepted + 1) + 1):  # position i was verified with the i - 1 before it accepted
            reached[i] += 1
            self.pool_reached[i] += 1
        for i in range(1, min(top, accepted) + 1):
            hits[i] += 1
            self.pool_hits[i] += 1
        self.observed += 1
        self._expected.clear()

    def acceptance(self, cell: Cell) -> tuple[float, ...]:
        """q(i) for i = 1..max_width: position i's acceptance given the drafts before it were accepted."""
        w = self.config.prior_weight
        reached = self.reached.get(cell)
        hits = self.hits.get(cell)
        out = []
        for i in range(1, self.max_width + 1):
            prior = self.config.prior_first if i == 1 else self.config.prior_next
            pool = (self.pool_hits[i] + w * prior) / (self.pool_reached[i] + w)
            out.append(pool if reached is None else (hits[i] + w * pool) / (reached[i] + w))
        return tuple(out)

    def expected(self, cell: Cell) -> tuple[float, ...]:
        """E(w) for w = 0..max_width: 1 + the sum over i <= w of P(the first i drafts accepted)."""
        found = self._expected.get(cell)
        if found is None:
            total, run, values = 1.0, 1.0, [1.0]
            for q in self.acceptance(cell):
                run *= q
                total += run
                values.append(total)
            found = self._expected[cell] = tuple(values)
        return found


def choose_width(counts: Mapping[Cell, int], calibration: Calibration, widths: Sequence[int], costs: Prices,
                 batch: int | None = None) -> int:
    """The width among `widths` that maximises expected emitted tokens per ms for a step whose requests fall in the
    cells `counts` (cell -> requests), priced at `batch` requests (default: the requests counted). Ties go to the
    narrower width; no requests gives 0."""
    n = sum(counts.values()) if batch is None else batch
    if n <= 0 or not counts:
        return 0
    cells = sorted(counts)  # a fixed order: the sum does not depend on the order requests arrived in
    best, best_rate = 0, -1.0
    for w in sorted(widths):
        tokens = 0.0
        for cell in cells:
            tokens += counts[cell] * calibration.expected(cell)[w]
        rate = tokens / costs.at(n, w)
        if rate > best_rate:
            best, best_rate = w, rate
    return best


class _Priced:
    """One decision's prices by width (`GoodputController.priced`), as `choose_width` reads step costs."""

    __slots__ = ("ms",)

    def __init__(self, ms: dict[int, float]) -> None:
        self.ms = ms

    def at(self, batch: int, width: int) -> float:
        return self.ms[width]


@dataclass
class GoodputController:
    """The controller's online state for one engine: the calibration, the candidate widths and the step costs.
    `decide` fixes a step's width from its requests' cells; `observe` feeds back what a verify step did. `priced`
    holds the ms per candidate width the last decision priced its step at (what a record of the decision carries:
    with costs measured online, the table it used exists only then)."""

    config: GoodputConfig
    widths: tuple[int, ...]
    costs: CostModel
    calibration: Calibration = field(init=False)
    plain_run: int = field(init=False, default=0)  # steps in a row the controller fixed at 0
    explored: int = field(init=False, default=0)  # steps fixed wide by `explore_every`
    probed: int = field(init=False, default=0)  # steps fixed at a width whose cost is still unmeasured
    since_probe: int = field(init=False, default=0)
    priced: tuple[float, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.widths = tuple(sorted(set(int(w) for w in self.widths)))
        require(len(self.widths) >= 1 and self.widths[0] == 0,
                f"the candidate widths must include 0, a plain step (got {list(self.widths)})")
        require(self.widths[-1] <= self.costs.widths[-1],
                f"width {self.widths[-1]} is wider than the step costs measure ({self.costs.widths[-1]}): "
                f"measure it or narrow batch_k")
        self.calibration = Calibration(self.config, self.widths[-1])

    def decide(self, cells: Iterable[Cell]) -> int:
        """The width of a step whose requests fall in `cells` (one per request); 0 and no change of state for a
        step of no requests (vLLM calls its scheduler once more with nothing to run, to report finished requests)."""
        counts: dict[Cell, int] = {}
        for cell in cells:
            counts[cell] = counts.get(cell, 0) + 1
        if not counts:
            return 0
        batch = sum(counts.values())
        self.priced = tuple(self.costs.at(batch, w) for w in self.widths)
        costs = _Priced(dict(zip(self.widths, self.priced)))  # the same numbers, priced once
        width = choose_width(counts, self.calibration, self.widths, costs)
        if width > 0:
            self.plain_run = 0
        else:
            self.plain_run += 1
            every = self.config.explore_every
            unseen = self.config.explore_new_cells and any(c not in self.calibration.reached for c in counts)
            if (unseen or (every and self.plain_run >= every)) and len(self.widths) > 1:
                self.plain_run = 0
                self.explored += 1
                width = choose_width(counts, self.calibration, self.widths[1:], costs)
        probe = self._probe(width)
        if probe != width:
            self.plain_run = self.plain_run + 1 if probe == 0 else 0
        return probe

    def _probe(self, width: int) -> int:
        """Costs measured online: while a candidate width has no measurement, one decision in every `explore_every`
        verifies it, so that every width's cost is measured however the controller chooses (the plain step's above
        all: a controller that always verifies would never learn what verifying nothing saves)."""
        wanted = self.costs.wanted(self.widths)
        if wanted is None or not self.config.explore_every:
            return width
        self.since_probe += 1
        if wanted == width:
            self.since_probe = 0
        if self.since_probe < self.config.explore_every:
            return width
        self.since_probe = 0
        self.probed += 1
        return wanted

    def observe(self, cell: Cell, drafted: int, accepted: int) -> None:
        self.calibration.observe(cell, drafted, accepted)


__all__ = ["StepCosts", "DEFAULT_STEP_COSTS", "step_costs", "MatchLadder", "bucket_of", "GoodputConfig",
           "RequestFeatures", "Calibration", "choose_width", "GoodputController", "Cell", "CostModel", "ASYNC_BEHIND"]

"""Step costs measured by the server itself (#62): the goodput controller (`hqlab.rules.goodput`) starts from a prior
table of ms per step by batch size and width, and replaces it, cell by cell, with what its own steps take.

Why. A table measured elsewhere is wrong where it is served: a served step costs more than an in-process one with
random weights (a wide lookup step at one request 1.36x a plain one served, 1.15x in the committed grid), costs
differ by card and host, and above the largest measured batch the table is extrapolated. The server sees every step
it runs; this module turns those sightings into prices.

What is timed (`StepTimer`). Under asynchronous scheduling vLLM's engine core schedules step s before it processes
the output of step s - 1, so the GPU runs s right behind s - 1, and the interval between the two calls that process
their outputs (the scheduler's `update_from_output`, read on the host's monotonic clock as the call starts) is the
time the engine took for step s: its GPU time when the GPU is the bottleneck, the host's loop when the host is.
That interval is attributed to step s (its batch size and the width it verified) only when
- the previous processing call processed step s - 1 (the step scheduled just before s), and
- step s was scheduled before that call: the engine had s queued while s - 1 ran.
The first step after an idle gap (no requests: nothing was queued behind the last step) is scheduled after the last
call and is dropped, as is the first step of a run and every interval around a call that processed no tracked step.
A step that admits prompts or continues one (`decode_only` false) is timed but priced apart: its prompt tokens cost
far more than a decode step of its batch, and the controller prices decode steps; such steps are counted, not fitted.

The model (`OnlineCosts`). Intervals are kept as integer microseconds in cells (width, batch size): the last `window`
of each, whose median is the cell's value, and how many were ever seen. A width's cells count once it has been timed
`min_samples` times, at any batch sizes.
Writing p(b, w) for the prior, X(b, w) = p(b, w) - p(b, 0) for its excess over a plain step and K for
`prior_weight` (samples the prior weighs):
1. The prior's error, in two numbers. g0 = the counted plain cells' summed medians over the prior's (each weighted
   by its samples), gx = the counted wide cells' summed excess over the scaled plain step, g0 p(b, 0), over the
   prior's excess X (negative excess read as none); each shrunk towards 1 as (N r + K) / (N + K) with N its samples;
   1 where nothing was measured. The scaled prior is pi(b, w) = g0 p(b, 0) + gx X(b, w). So a width never measured
   keeps the prior's shape, its plain part scaled as the measured plain steps say, its excess as the measured wide
   steps' excess says: the error the served steps show (#62) is in the excess, and a controller that only ever
   verified wide still learns what a plain step saves.
2. Per width, cost linear in the batch size: the residuals e = median - pi of its counted cells, weighted by their
   samples, give a line a + s (b - centre) with a = N mean(e) / (N + K) (the offset shrunk towards the scaled prior
   until N outweighs K) and s their weighted slope ridged by K (a slope from batches close together stays near the
   prior's). A width's cost is pi(b, w) + a + s (b - centre), at least `floor` pi(b, w).
Noise: a cell is a median (one interval moves it by one rank), a width counts only once timed `min_samples` times,
and every fit is shrunk by K. The feedback loop (a width never chosen is never measured) is closed in the
controller: its exploration steps (a wide step after `explore_every` plain ones) are timed as any other step, and
while plain steps are timed fewer than `min_samples` times one decision in every `explore_every` is plain (`wanted`,
`GoodputController._probe`).

Integer counts and microseconds (`micros`, the one rounding), updated in processing order: the replay
(`hqlab.replay.goodput`) fed the same intervals reproduces every price and every decision, and so does the check of a
served record (`hqlab.replay.goodput_served.rerun_rule`) fed the intervals the hook recorded (`observe_us`). The
clock is read only by the engine-side hook (`hqlab.engines.vllm.goodput`); nothing here reads one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hqlab.config import require
from hqlab.rules.goodput import DEFAULT_STEP_COSTS, StepCosts, step_costs

ONLINE = "online"  # the knob's value: goodput=online (the default grid as prior) or goodput=online:PATH.json


def costs_for(name: str) -> "StepCosts | OnlineCosts":
    """The cost model a `goodput=` value names: "default" or "PATH.json" (a fixed table, `step_costs`), "online"
    (measured by the server, starting from the default table) or "online:PATH.json" (starting from that file; a
    fresh `OnlineCosts` per call)."""
    if name == ONLINE:
        return OnlineCosts(DEFAULT_STEP_COSTS)
    if name.startswith(ONLINE + ":"):
        return OnlineCosts(step_costs(name[len(ONLINE) + 1:]))
    return step_costs(name)


def micros(ms: float) -> int:
    """`ms` as the integer microseconds the model keeps (at least 1): a timed interval, as `observe` rounds it, and a
    priced step, as the decisions record carries it."""
    return max(1, round(ms * 1000))


@dataclass(frozen=True)
class OnlineConfig:
    """window: intervals kept per (width, batch) cell, the newest (its value is their median); min_samples: a width's
    cells count once it has been timed this many times, at any batch sizes; prior_weight: samples the prior weighs
    against a width's (and each scale's) measurements; floor: a cost never falls below this fraction of the scaled
    prior."""

    window: int = 32
    min_samples: int = 4
    prior_weight: float = 4.0
    floor: float = 0.25

    def __post_init__(self) -> None:
        require(self.window >= 1, f"window is a number of intervals kept per cell, >= 1 (got {self.window})")
        require(1 <= self.min_samples <= self.window,
                f"min_samples must lie in [1, window={self.window}] (got {self.min_samples})")
        require(self.prior_weight > 0, f"prior_weight must be > 0 samples (got {self.prior_weight})")
        require(0 < self.floor <= 1, f"floor is a fraction of the scaled prior in (0, 1] (got {self.floor})")


class StepTimer:
    """Which intervals between the engine's output-processing calls are a step's time (the module docstring's
    rule). `scheduled()` gives each step with tokens, as it is scheduled, its ticket (its number, the calls
    processed so far); `processed(ticket, now_ns)` is each processing call (None for an output of no tracked step)
    and returns the interval in ns attributed to that step, or None."""

    __slots__ = ("_steps", "_calls", "_last_step", "_last_ns")

    def __init__(self) -> None:
        self._steps = 0
        self._calls = 0
        self._last_step: int | None = None
        self._last_ns: int | None = None

    def scheduled(self) -> tuple[int, int]:
        ticket = (self._steps, self._calls)
        self._steps += 1
        return ticket

    def processed(self, ticket: tuple[int, int] | None, now_ns: int) -> int | None:
        interval = None
        if ticket is not None and self._last_ns is not None and self._last_step == ticket[0] - 1 \
                and ticket[1] < self._calls and now_ns > self._last_ns:
            interval = int(now_ns - self._last_ns)
        self._last_step = None if ticket is None else ticket[0]
        self._last_ns = int(now_ns)
        self._calls += 1
        return interval


@dataclass(frozen=True)
class _Fit:
    g0: float
    gx: float
    lines: dict[int, tuple[float, float, float]]  # width -> (offset, slope, centre batch)


class OnlineCosts:
    """Step costs that start as `prior` and follow the measured steps (the module docstring's rule). `at(batch,
    width)` as `StepCosts.at`; `observe` feeds one timed step; `wanted` names a candidate width still unmeasured;
    `table` snapshots the current prices as a `StepCosts` (to save and serve with `goodput=PATH.json`)."""

    def __init__(self, prior: StepCosts, config: OnlineConfig | None = None) -> None:
        self.prior = prior
        self.config = config or OnlineConfig()
        self.widths = prior.widths
        self.batches = prior.batches
        self.samples: dict[tuple[int, int], list[int]] = {}  # (width, batch) -> newest intervals (us), oldest first
        self.counts: dict[tuple[int, int], int] = {}  # (width, batch) -> intervals ever seen
        self._timed: dict[int, int] = {}  # width -> intervals ever seen, every batch
        self._medians: dict[tuple[int, int], int] = {}
        self._base: dict[tuple[int, int], tuple[float, float]] = {}  # (width, batch) -> (p(b, 0), X(b, w))
        self.prompt_steps = 0  # steps with prompt tokens: timed, not fitted
        self._fit: _Fit | None = None

    @property
    def source(self) -> str:
        return f"measured online, prior: {self.prior.source}"

    def observe(self, batch: int, width: int, ms: float, decode_only: bool) -> bool:
        """One timed step: `batch` requests verifying `width` drafts took `ms`. Whether it entered the fit (steps
        with prompt tokens do not)."""
        require(math.isfinite(ms) and ms > 0, f"a step's time must be finite and > 0 ms (got {ms})")
        return self.observe_us(batch, width, micros(ms), decode_only)

    def observe_us(self, batch: int, width: int, us: int, decode_only: bool) -> bool:
        """`observe` of a step whose time is already integer microseconds (`micros`): what a decisions record holds,
        fed back as the server fed it."""
        require(batch >= 1 and self.widths[0] <= width <= self.widths[-1] and us >= 1,
                f"a timed step has >= 1 request, a width the prior prices and >= 1 us (got batch {batch}, width "
                f"{width}, {us} us)")
        if not decode_only:
            self.prompt_steps += 1
            return False
        key = (width, batch)
        window = self.samples.setdefault(key, [])
        window.append(int(us))
        if len(window) > self.config.window:
            del window[0]
        self.counts[key] = self.counts.get(key, 0) + 1
        self._timed[width] = self._timed.get(width, 0) + 1
        self._medians[key] = sorted(window)[(len(window) - 1) // 2]
        if key not in self._base:
            plain = self.prior.at(batch, 0)
            self._base[key] = (plain, self.prior.at(batch, width) - plain)
        self._fit = None
        return True

    def timed(self, width: int) -> int:
        """Decode steps timed at `width`, every batch size."""
        return self._timed.get(width, 0)

    def counted(self) -> list[tuple[int, int, int, float]]:
        """(width, batch, samples, median ms) of every cell of the widths timed `min_samples` times, in a fixed
        order."""
        least = self.config.min_samples
        return [(w, b, n, self._medians[(w, b)] / 1000) for (w, b), n in sorted(self.counts.items())
                if self.timed(w) >= least]

    def wanted(self, widths: Sequence[int]) -> int | None:
        """0 while plain steps are among `widths` and timed fewer than `min_samples` times, else None. Only the
        plain step is asked for: a wide width never chosen is priced by the excess the measured ones show, and a
        controller that stays plain verifies a wide width every `explore_every` steps anyway."""
        return 0 if 0 in widths and self.timed(0) < self.config.min_samples else None

    def measured(self, batch: int) -> bool:
        return self.prior.measured(batch) or any(b == batch for _, b, _, _ in self.counted())

    def scales(self) -> tuple[float, float]:
        """(g0, gx): the plain part's and the excess's scale of the prior."""
        fit = self._fitted()
        return fit.g0, fit.gx

    def _fitted(self) -> _Fit:
        if self._fit is not None:
            return self._fit
        k = self.config.prior_weight
        cells = self.counted()
        plain = [(n, m, self._base[(w, b)]) for w, b, n, m in cells if w == 0]
        wide = [(n, m, self._base[(w, b)]) for w, b, n, m in cells if w > 0]
        g0 = 1.0
        if plain:
            samples = sum(n for n, _, _ in plain)
            ratio = sum(n * m for n, m, _ in plain) / sum(n * p for n, _, (p, _) in plain)
            g0 = (samples * ratio + k) / (samples + k)
        gx = 1.0
        excess = sum(n * x for n, _, (_, x) in wide)
        if wide and excess > 0:
            samples = sum(n for n, _, _ in wide)
            ratio = max(0.0, sum(n * (m - g0 * p) for n, m, (p, _) in wide) / excess)
            gx = (samples * ratio + k) / (samples + k)
        lines: dict[int, tuple[float, float, float]] = {}
        for width in sorted({w for w, _, _, _ in cells}):
            points = [(b, n, m - (g0 * p + gx * x)) for w, b, n, m in cells if w == width
                      for p, x in (self._base[(w, b)],)]
            samples = sum(n for _, n, _ in points)
            centre = sum(n * b for b, n, _ in points) / samples
            mean = sum(n * e for _, n, e in points) / samples
            spread = sum(n * (b - centre) ** 2 for b, n, _ in points)
            slope = sum(n * (b - centre) * (e - mean) for b, n, e in points) / (spread + k)
            lines[width] = (samples * mean / (samples + k), slope, centre)
        self._fit = _Fit(g0, gx, lines)
        return self._fit

    def at(self, batch: int, width: int) -> float:
        """The cost (ms) of a step of `batch` requests verifying `width` drafts each, as measured so far."""
        fit = self._fitted()
        plain = self.prior.at(batch, 0)
        scaled = fit.g0 * plain + fit.gx * (self.prior.at(batch, width) - plain)
        line = fit.lines.get(width)
        value = scaled if line is None else scaled + line[0] + line[1] * (batch - line[2])
        return max(value, self.config.floor * scaled, 1e-3)

    def table(self, batches: Sequence[int] | None = None, widths: Sequence[int] | None = None) -> StepCosts:
        """The current prices at `batches` (default: the prior's and every counted cell's) and `widths` (default:
        the prior's), as a fixed table."""
        batches = sorted(set(batches or (*self.prior.batches, *(b for _, b, _, _ in self.counted()))))
        widths = tuple(widths or self.widths)
        return StepCosts(tuple(batches), widths, tuple(tuple(self.at(b, w) for w in widths) for b in batches),
                         source=f"{self.source}; {sum(self.counts.values())} decode steps timed")


__all__ = ["ONLINE", "costs_for", "micros", "OnlineConfig", "StepTimer", "OnlineCosts"]

"""Decode speed of large targets projected from two measurements (docs/seed-scale.md, #41):

- the **verify step's cost** of Qwen2.5-shaped targets inside vLLM 0.26 with CUDA graphs, random weights, at verify
  widths, context lengths and batches of a grid (`benchmarks/vllm_step_cost.py`: the grid.parquet of
  data/results/seed_scale/<run>/), read here by piecewise-linear interpolation, in the width and in log(context);
- **tokens per step** measured on real outputs: the step records of committed vLLM runs on the real 0.5B and 1.5B
  (a run's steps.parquet), each step priced at the width it verified and the context it read.

A request's projected decode rate is its tokens ÷ the summed step costs of its steps; `none` is the same tokens at
one token a step, each step the width-1 step of the same shape. `gpu-fused` on a target of any shape is that
target's `gpu-lookup` step at the step's width plus the drafter's pass where the step ran one: the 1.5B's fused step
minus its lookup step at the same (width, context, batch) where the grid has it (`pass_ms`), else the pass's GPU
time in a profiled run (`profiled_pass_ms`, batch 1). With `drafter="scaled"` the pass is that of a drafter sized
to the target (`scaled_drafter_shape`). `validate` and `speedup_check` test the method where the truth is known.

Pure functions over polars frames; every bad input raises `ScaleError` saying what and where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import polars as pl

from hqlab.config import ConfigError, parse_spec

STEP_COST_SCHEMA: dict[str, type[pl.DataType]] = {
    "run": pl.String, "shape": pl.String, "target_params_b": pl.Float64, "layers": pl.Int64, "hidden": pl.Int64,
    "quant": pl.String, "config": pl.String, "width": pl.Int64, "context": pl.Int64, "batch": pl.Int64,
    "step_ms": pl.Float64, "step_ms_p10": pl.Float64, "step_ms_p90": pl.Float64, "steps": pl.Int64,
    "drafter": pl.String, "engine_start_s": pl.Float64, "machine": pl.String, "vllm_version": pl.String,
    "git_commit": pl.String}
# the configs the step-cost grid measures; "none" (optional, width 1): an engine without a speculator, which prices
# `none` where the grid has it (else the lookup's width-1 step, which still runs the speculator and vLLM's
# rejection sampler, which priced `none` 5-9 % slow on the first one-machine validation)
STEP_CONFIGS = ("gpu-lookup", "gpu-fused", "none")
KINDS = ("none", "gpu-lookup", "gpu-fused")  # the configs of a vLLM run this module can price
OUTSIDE_CONTEXT = ("error", "clamp")
DRAFTERS = ("measured", "scaled")
KEY = ("shape", "quant", "config", "width", "context", "batch")
TRACE_COLUMNS = ("request", "category", "config", "context_len", "verify_len", "emitted", "drafter_passes", "step_s",
                 "load", "run")
PROJECTION_COLUMNS = (
    "shape", "target_params_b", "quant", "config", "label", "category", "batch", "requests", "tokens", "steps",
    "tokens_per_step", "step_ms", "tok_s", "batch_tok_s", "none_tok_s", "speedup", "drafter", "drafter_shape",
    "clamped_share", "traces_run", "traces_model", "traces_commit", "step_costs_run", "step_costs_commit", "machine",
    "vllm_version")


class ScaleError(ConfigError):
    """A step-cost grid, a point outside it or a trace that cannot be priced; the message says which and why."""


def check_step_costs(costs: pl.DataFrame) -> pl.DataFrame:
    """`costs` as the step-cost grid, checked: every column of `STEP_COST_SCHEMA`, known configs, positive step
    costs and widths, at most one row per (shape, quant, config, width, context, batch) (a file holding several
    runs of one point must be cut to one first, e.g. `costs.filter(pl.col("run") == ...)`)."""
    missing = [c for c in STEP_COST_SCHEMA if c not in costs.columns]
    if missing:
        raise ScaleError(f"step costs: missing column(s) {', '.join(missing)}")
    if costs.is_empty():
        raise ScaleError("step costs: no rows")
    unknown = sorted(set(costs["config"].to_list()) - set(STEP_CONFIGS))
    if unknown:
        raise ScaleError(f"step costs: unknown config(s) {unknown} (known: {', '.join(STEP_CONFIGS)})")
    bad = costs.filter(~(pl.col("step_ms") > 0) | (pl.col("width") < 1) | (pl.col("context") < 1)
                       | (pl.col("batch") < 1))
    if not bad.is_empty():
        row = bad.row(0, named=True)
        raise ScaleError(f"step costs: {bad.height} row(s) with a non-positive step_ms, width, context or batch, "
                         f"e.g. {({k: row[k] for k in (*KEY, 'step_ms')})}")
    if costs.select(KEY).is_duplicated().any():
        runs = sorted(costs["run"].unique().to_list())
        raise ScaleError(f"step costs: a (shape, quant, config, width, context, batch) point appears more than once "
                         f"(runs {runs}): keep one run per point")
    return costs


def newest_points(costs: pl.DataFrame, runs: Sequence[str]) -> pl.DataFrame:
    """The rows of `runs` in `costs`, one per (shape, quant, config, width, context, batch): where several of the
    runs measured a point, the one named last keeps it (a later run re-measures points of an earlier one with more
    steps, or replaces points that were not model steps)."""
    if not runs:
        raise ScaleError("newest_points: name at least one run")
    if len(set(runs)) != len(runs):
        raise ScaleError(f"newest_points: a run is named twice in {list(runs)}")
    missing = [r for r in runs if costs.filter(pl.col("run") == r).is_empty()]
    if missing:
        have = sorted(costs["run"].unique().to_list()) if "run" in costs.columns else []
        raise ScaleError(f"newest_points: no rows of run(s) {missing} in the step costs (runs there: {have})")
    order = {r: i for i, r in enumerate(runs)}
    ranked = costs.filter(pl.col("run").is_in(list(runs))).with_columns(
        pl.col("run").replace_strict(order, return_dtype=pl.Int64).alias("_order"))
    return (ranked.sort("_order", maintain_order=True).unique(subset=list(KEY), keep="last", maintain_order=True)
            .drop("_order"))


def decode_costs(costs: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """The step costs to price decodes with, and which statistic they are: each point's mean step (`step_ms_mean`)
    where every row has one, else its median (`step_ms`; grids measured before the mean was kept). A decode's
    tok/s is its tokens over its summed step time, so the statistic that matches it is a mean: on a host that runs
    at two speeds a point's median is whichever speed held most of its steps, while a decode meets both in
    proportion (docs/seed-scale.md). Decided before any grid with means was measured (validation runs from v4 on)."""
    if "step_ms_mean" in costs.columns and costs["step_ms_mean"].is_not_null().all() \
            and bool((costs["step_ms_mean"] > 0).all()):
        return costs.with_columns(pl.col("step_ms_mean").alias("step_ms")), "mean"
    return costs, "median"


def _grid(costs: pl.DataFrame, shape: str, quant: str, config: str, batch: int) -> dict[int, tuple[np.ndarray,
                                                                                                   np.ndarray]]:
    """context -> (widths ascending, step ms) measured for one (shape, quant, config, batch)."""
    sub = costs.filter((pl.col("shape") == shape) & (pl.col("quant") == quant) & (pl.col("config") == config))
    if sub.is_empty():
        have = sorted({f"{s} {q} {c}" for s, q, c in costs.select("shape", "quant", "config").iter_rows()})
        raise ScaleError(f"step costs: nothing measured for {shape} {quant} {config} (measured: {have})")
    at = sub.filter(pl.col("batch") == batch)
    if at.is_empty():
        raise ScaleError(f"step costs: {shape} {quant} {config} was not measured at batch {batch} "
                         f"(batches: {sorted(sub['batch'].unique().to_list())}); batches are not interpolated")
    grid = {}
    for (context,), rows in at.sort("width").group_by(["context"], maintain_order=True):
        grid[int(context)] = (rows["width"].to_numpy().astype(float), rows["step_ms"].to_numpy().astype(float))
    return dict(sorted(grid.items()))


def step_ms(costs: pl.DataFrame, shape: str, config: str, width: int | Sequence[int] | np.ndarray,
            context: int | Sequence[int] | np.ndarray, batch: int, *, quant: str = "bf16") -> np.ndarray:
    """Step cost (ms) of `shape` running `config` at each (width, context) pair and `batch` requests, from the
    measured grid `costs` (`check_step_costs`): exact at grid points, linear in the width between measured widths
    and linear in log(context) between measured contexts. A width or context outside what was measured at the
    contexts it falls between, or a batch that was not measured, raises `ScaleError`."""
    check_step_costs(costs)
    widths = np.atleast_1d(np.asarray(width, dtype=float))
    contexts = np.atleast_1d(np.asarray(context, dtype=float))
    if widths.shape != contexts.shape:
        if widths.size == 1:
            widths = np.full(contexts.shape, widths[0])
        elif contexts.size == 1:
            contexts = np.full(widths.shape, contexts[0])
        else:
            raise ScaleError(f"width and context must have one shape or be scalars (got {widths.shape} and "
                             f"{contexts.shape})")
    grid = _grid(costs, shape, quant, config, batch)
    measured = np.array(list(grid), dtype=float)
    where = f"{shape} {quant} {config} at batch {batch}"
    outside = (contexts < measured[0]) | (contexts > measured[-1])
    if outside.any():
        raise ScaleError(f"{where}: context {contexts[outside][0]:g} is outside the measured contexts "
                         f"{measured[0]:g}-{measured[-1]:g}")
    if measured.size == 1:
        lower = np.zeros(contexts.shape, dtype=int)
        t = np.zeros(contexts.shape)
    else:
        lower = np.clip(np.searchsorted(measured, contexts, side="right") - 1, 0, measured.size - 2)
        logs = np.log(measured)
        t = (np.log(contexts) - logs[lower]) / (logs[lower + 1] - logs[lower])
    out = np.zeros(contexts.shape)
    for j, context_j in enumerate(measured):
        weight = np.where(lower == j, 1 - t, 0.0) + np.where(lower + 1 == j, t, 0.0)
        used = weight > 0
        if not used.any():
            continue
        ws, ms = grid[int(context_j)]
        off = used & ((widths < ws[0]) | (widths > ws[-1]))
        if off.any():
            raise ScaleError(f"{where}: width {widths[off][0]:g} is outside the widths measured at context "
                             f"{int(context_j)} ({ws[0]:g}-{ws[-1]:g})")
        out[used] += weight[used] * np.interp(widths[used], ws, ms)
    return out


def pass_ms(costs: pl.DataFrame, width: np.ndarray, context: np.ndarray, batch: int, *, fused_shape: str,
            drafter_shape: str | None = None, measured_drafter_shape: str | None = None,
            quant: str = "bf16") -> np.ndarray:
    """The drafter's pass (ms) at each (width, context): `fused_shape`'s gpu-fused step minus its gpu-lookup step at
    the same (width, context, batch). With `drafter_shape` (and the shape of the drafter that was measured,
    `measured_drafter_shape`), a drafter of another size: the measured pass plus the difference of the two shapes'
    gpu-lookup steps, i.e. the pass grows by what the larger forward adds to a step (`scaled_drafter_shape`)."""
    out = (step_ms(costs, fused_shape, "gpu-fused", width, context, batch, quant=quant)
           - step_ms(costs, fused_shape, "gpu-lookup", width, context, batch, quant=quant))
    if drafter_shape is not None and drafter_shape != measured_drafter_shape:
        if measured_drafter_shape is None:
            raise ScaleError("a scaled drafter needs the shape of the drafter that was measured")
        out = out + (step_ms(costs, drafter_shape, "gpu-lookup", width, context, batch, quant=quant)
                     - step_ms(costs, measured_drafter_shape, "gpu-lookup", width, context, batch, quant=quant))
    return out


def scaled_drafter_shape(costs: pl.DataFrame, target_params_b: float, *, ratio: float = 1 / 20,
                         quant: str = "bf16") -> str:
    """The measured gpu-lookup shape whose parameter count is nearest to `ratio` × the target's (ties: the
    smaller): with 1/20, the 0.5B for 7B and 14B targets and the 1.5B for 27B and 32B, as Qwen2.5's own pairs go
    (0.5B drafting for 7B is 1/15, 1.5B for 32B 1/21)."""
    if not 0 < ratio < 1:
        raise ScaleError(f"drafter ratio must be in (0, 1) (got {ratio})")
    shapes = (costs.filter((pl.col("config") == "gpu-lookup") & (pl.col("quant") == quant))
              .group_by("shape").agg(pl.col("target_params_b").first()).sort("target_params_b"))
    if shapes.is_empty():
        raise ScaleError(f"step costs: no {quant} gpu-lookup shapes to size a drafter from")
    want = ratio * target_params_b
    gaps = (shapes["target_params_b"] - want).abs().to_list()
    return shapes["shape"][int(np.argmin(gaps))]


def has_fused(costs: pl.DataFrame, shape: str, *, quant: str = "bf16") -> bool:
    """Whether the grid measured `shape`'s gpu-fused step (else a fused projection needs `profiled_pass_ms`)."""
    return not costs.filter((pl.col("shape") == shape) & (pl.col("quant") == quant)
                            & (pl.col("config") == "gpu-fused")).is_empty()


def config_kind(config: str) -> str:
    """`none`, `gpu-lookup` or `gpu-fused` for a run's config spec; any other raises `ScaleError`."""
    name = config if config == "none" else parse_spec(config)[0]
    if name not in KINDS:
        raise ScaleError(f"config {config!r}: only {', '.join(KINDS)} can be priced from the step-cost grid")
    return name


def config_label(config: str) -> str:
    """A short name: `gpu-lookup k=31`, `gpu-fused k=31 device skip`, `gpu-fused k=15 block 7`, `none`."""
    if config == "none":
        return "none"
    name, values = parse_spec(config)
    label = f"{name} k={values['k']}" if "k" in values else name
    if values.get("draft_block", "1") != "1":
        label += f" block {values['draft_block']}"
    if values.get("device_skip") == "true":
        label += " device skip"
    return label


@dataclass(frozen=True)
class Traces:
    """The batch-1 step records of one config in one committed vLLM run, with where they came from. Built by
    `traces`; checked here: the columns, one config, steps that verified at least one position."""

    steps: pl.DataFrame
    run: str
    config: str
    model: str
    commit: str

    def __post_init__(self) -> None:
        missing = [c for c in TRACE_COLUMNS if c not in self.steps.columns]
        if missing:
            raise ScaleError(f"run {self.run}: step records lack column(s) {', '.join(missing)}")
        if self.steps.is_empty():
            raise ScaleError(f"run {self.run}, {self.config}: no steps")
        if self.steps["config"].n_unique() != 1:
            raise ScaleError(f"run {self.run}: the steps of one config only")
        if (self.steps["verify_len"] < 1).any() or (self.steps["emitted"] < 1).any():
            raise ScaleError(f"run {self.run}, {self.config}: a step verified no position or emitted no token")
        config_kind(self.config)

    @property
    def kind(self) -> str:
        return config_kind(self.config)


def traces(steps: pl.DataFrame, results: pl.DataFrame, run: str, config: str) -> Traces:
    """The batch-1 (`load == "alone"`) steps of `config` in `run` (a vLLM run's `.steps.parquet` and its results
    parquet, which gives the model and the commit). A drafter that ran more than one pass in a step (a block
    longer than one) is refused: the grid measured one pass a step."""
    in_run = steps.filter(pl.col("run") == run)
    if in_run.is_empty():
        raise ScaleError(f"run {run!r}: no step records (runs: {sorted(steps['run'].unique().to_list())})")
    mine = in_run.filter((pl.col("config") == config) & (pl.col("load") == "alone"))
    if mine.is_empty():
        raise ScaleError(f"run {run!r}: no batch-1 steps of {config!r} "
                         f"(configs: {sorted(in_run['config'].unique().to_list())})")
    kind = config_kind(config)
    if kind == "gpu-fused" and (mine["drafter_passes"] > 1).any():
        raise ScaleError(f"run {run!r}, {config!r}: steps with {mine['drafter_passes'].max()} drafter passes; the "
                         f"step-cost grid measured one pass a step (draft_block=1)")
    rows = results.filter((pl.col("run") == run) & (pl.col("config") == config))
    if rows.is_empty():
        raise ScaleError(f"run {run!r}: no result rows for {config!r}")
    return Traces(mine.select(TRACE_COLUMNS), run, config, str(rows["model"][0]), str(rows["git_commit"][0]))


def _contexts(contexts: np.ndarray, floor: int, ceiling: int, outside_context: str, where: str) -> np.ndarray:
    if outside_context not in OUTSIDE_CONTEXT:
        raise ScaleError(f"outside_context must be one of {', '.join(OUTSIDE_CONTEXT)} (got {outside_context!r})")
    if outside_context == "clamp":
        return np.clip(contexts, floor, ceiling)
    if (contexts < floor).any() or (contexts > ceiling).any():
        raise ScaleError(f"{where}: steps read {contexts.min()}-{contexts.max()} tokens of context, outside the "
                         f"grid's {floor}-{ceiling}; outside_context='clamp' prices them at the nearest measured")
    return contexts


def profiled_pass_ms(phases: pl.DataFrame, run: str, *, skipped_below_ms: float = 0.25) -> dict[int, float]:
    """The drafter's pass (GPU ms) per verify width from a profiled gpu-fused run (`bench --profile`: the phases
    parquet's `propose (speculator)` spans): per single-pass gpu-fused config, the median over the steps that ran
    the pass, width = k + 1. A step whose drafting took under `skipped_below_ms` skipped the pass (device skip: the
    lookup alone takes ~0.03 ms) and is left out. Two configs of one width give their mean."""
    rows = phases.filter((pl.col("run") == run) & pl.col("config").str.starts_with("gpu-fused")
                         & (pl.col("phase") == "propose (speculator)") & (pl.col("gpu_ms") >= skipped_below_ms))
    if rows.is_empty():
        raise ScaleError(f"run {run!r}: no profiled drafter passes (runs: {sorted(phases['run'].unique().to_list())})")
    by_width: dict[int, list[float]] = {}
    for config, ms in rows.group_by("config").agg(pl.col("gpu_ms").median()).iter_rows():
        values = parse_spec(config)[1]
        if values.get("draft_block", "1") != "1":
            continue
        by_width.setdefault(int(values["k"]) + 1, []).append(float(ms))
    if not by_width:
        raise ScaleError(f"run {run!r}: no single-pass gpu-fused config was profiled")
    return {w: float(np.mean(v)) for w, v in sorted(by_width.items())}


def plain_config(costs: pl.DataFrame, shape: str, batch: int, *, quant: str = "bf16") -> str:
    """The grid config that prices a step without speculation on `shape` at `batch`: "none" where the grid measured
    an engine without a speculator there at every context its gpu-lookup was measured at, else "gpu-lookup" (its
    width-1 step)."""
    rows = costs.filter((pl.col("shape") == shape) & (pl.col("quant") == quant) & (pl.col("batch") == batch)
                        & (pl.col("width") == 1))
    plain = set(rows.filter(pl.col("config") == "none")["context"].to_list())
    lookup = set(rows.filter(pl.col("config") == "gpu-lookup")["context"].to_list())
    return "none" if plain and plain >= lookup else "gpu-lookup"


def price_requests(tr: Traces, costs: pl.DataFrame, shape: str, batch: int, *, quant: str = "bf16",
                   fused_shape: str | None = None, drafter_shape: str | None = None,
                   measured_drafter_shape: str | None = None, pass_quant: str = "bf16",
                   profiled_pass: Mapping[int, float] | None = None,
                   outside_context: str = "error") -> pl.DataFrame:
    """Per request of `tr`: tokens, steps, the projected decode time (ms) of its steps on `shape` at `batch` (and
    `recorded_ms`, what the steps took where they were recorded), the time of the same tokens without speculation
    (`none_ms`: one step without speculation a token, from the request's first context on, priced as
    `plain_config` says) and `clamped` (steps whose context was below the grid and priced at its smallest, with
    `outside_context="clamp"`). A gpu-fused step = the target's gpu-lookup step + the drafter's pass where the step
    ran one: from the grid (`pass_ms`; `fused_shape` is the shape the fused step was measured on, in `pass_quant`: a
    target in fp8 gets the drafter's pass as measured in bf16), or, where the grid has no fused step,
    `profiled_pass` (width -> GPU ms of the pass at batch 1, `profiled_pass_ms`), batch 1 only; a scaled drafter
    adds the difference of the two shapes' lookup steps from the grid either way."""
    check_step_costs(costs)
    grid = costs.filter((pl.col("shape") == shape) & (pl.col("quant") == quant) & (pl.col("config") == "gpu-lookup")
                        & (pl.col("batch") == batch))
    floor = int(grid["context"].min()) if not grid.is_empty() else 1
    ceiling = int(grid["context"].max()) if not grid.is_empty() else 1 << 30
    s = tr.steps.sort("request", "context_len")
    raw = s["context_len"].to_numpy()
    ctx = _contexts(raw, floor, ceiling, outside_context, f"run {tr.run}, {tr.config} on {shape} at batch {batch}")
    width = s["verify_len"].to_numpy()
    lookup_config = "gpu-lookup"
    plain = plain_config(costs, shape, batch, quant=quant)
    if tr.kind == "none":
        ms = step_ms(costs, shape, plain, np.ones_like(width), ctx, batch, quant=quant)
    else:
        ms = step_ms(costs, shape, lookup_config, width, ctx, batch, quant=quant)
    if tr.kind == "gpu-fused":
        passes = s["drafter_passes"].to_numpy()
        ran = passes > 0
        extra = np.zeros(ms.shape)
        if ran.any() and profiled_pass is not None:
            if batch != 1:
                raise ScaleError(f"a profiled pass is the pass at batch 1; {tr.config} at batch {batch} needs the "
                                 f"grid's fused step")
            missing = sorted(set(width[ran].tolist()) - set(profiled_pass))
            if missing:
                raise ScaleError(f"no profiled pass at width(s) {missing} (profiled: {sorted(profiled_pass)})")
            extra[ran] = [profiled_pass[int(w)] for w in width[ran]]
            if drafter_shape is not None and drafter_shape != measured_drafter_shape:
                if measured_drafter_shape is None:
                    raise ScaleError("a scaled drafter needs the shape of the drafter that was measured")
                extra[ran] += (step_ms(costs, drafter_shape, "gpu-lookup", width[ran], ctx[ran], batch,
                                       quant=pass_quant)
                               - step_ms(costs, measured_drafter_shape, "gpu-lookup", width[ran], ctx[ran], batch,
                                         quant=pass_quant))
        elif ran.any():
            if fused_shape is None:
                raise ScaleError("pricing gpu-fused needs fused_shape (the shape its fused step was measured on) or "
                                 "profiled_pass")
            extra[ran] = pass_ms(costs, width[ran], ctx[ran], batch, fused_shape=fused_shape,
                                 drafter_shape=drafter_shape, measured_drafter_shape=measured_drafter_shape,
                                 quant=pass_quant)
        ms = ms + extra
    priced = s.select("request", "category", "context_len", "emitted", "step_s").with_columns(
        pl.Series("ms", ms), pl.Series("clamped", (raw < floor) | (raw > ceiling)))
    per = (priced.group_by("request", "category", maintain_order=True)
           .agg(pl.col("emitted").sum().alias("tokens"), pl.len().alias("steps"), pl.col("ms").sum(),
                (1e3 * pl.col("step_s").sum()).alias("recorded_ms"),
                pl.col("context_len").min().alias("first_context"), pl.col("clamped").sum()))
    # none: the same tokens one at a time, the step at each context from the request's first on
    none_ms = []
    for first, tokens in per.select("first_context", "tokens").iter_rows():
        positions = first + np.arange(tokens)
        ctx_none = _contexts(positions, floor, ceiling, outside_context, f"run {tr.run}, none on {shape}")
        none_ms.append(float(step_ms(costs, shape, plain, 1, ctx_none, batch, quant=quant).sum()))
    return per.with_columns(pl.Series("none_ms", none_ms)).with_columns(
        (1e3 * pl.col("tokens") / pl.col("ms")).alias("tok_s"),
        (1e3 * pl.col("tokens") / pl.col("none_ms")).alias("none_tok_s"))


def validate(costs: pl.DataFrame, steps: pl.DataFrame, results: pl.DataFrame, run: str, shape: str, *,
             configs: Sequence[str] | None = None, fused_shape: str | None = None, quant: str = "bf16",
             profiled_pass: Mapping[int, float] | None = None, outside_context: str = "clamp",
             tolerance: float = 0.10, same_machine: bool = False) -> pl.DataFrame:
    """Predicted against measured decode tok/s per (config, class) of a vLLM run at batch 1, the step costs
    taken from the grid of the run's own model's shape: per request tokens ÷ the summed predicted step costs, the
    class median over its prompts, as the run's `decode_tok_s` is (the median over prompts of each prompt's median
    over repeats). `configs` default: every none, gpu-lookup and single-pass gpu-fused config of the run. Columns:
    run, shape, config, label, category, prompts, measured_tok_s, predicted_tok_s, ratio (predicted ÷ measured),
    within (|ratio - 1| ≤ tolerance), predicted_step_ms and recorded_step_ms (the class's mean step, predicted and as
    the step records of the run took it, one repeat: where a miss comes from), clamped_share. `same_machine`: the
    step costs must have been measured on the machine the run decoded on (the `machine` of every step-cost row
    equals the run's; a validation of the same host's decodes, benchmarks/seed_scale_validation.py), else
    `ScaleError`."""
    if not 0 < tolerance < 1:
        raise ScaleError(f"tolerance must be in (0, 1) (got {tolerance})")
    measured = results.filter((pl.col("run") == run) & (pl.col("concurrency") == 1))
    if measured.is_empty():
        raise ScaleError(f"run {run!r}: no batch-1 result rows")
    if same_machine:
        if "machine" not in measured.columns:
            raise ScaleError(f"run {run!r}: the results have no `machine` column to check the host against")
        theirs = set(measured["machine"].unique().to_list())
        ours = set(costs["machine"].unique().to_list())
        if len(theirs) != 1 or theirs != ours:
            raise ScaleError(f"run {run!r} decoded on {sorted(theirs)}, the step costs were measured on "
                             f"{sorted(ours)}: not the same machine")
    if configs is None:
        configs = [c for c in measured["config"].unique().sort().to_list() if priceable(steps, run, c)]
    rows = []
    for config in configs:
        tr = traces(steps, results, run, config)
        per = price_requests(tr, costs, shape, 1, quant=quant, fused_shape=fused_shape, profiled_pass=profiled_pass,
                             outside_context=outside_context)
        steps_sum = pl.col("steps").sum()
        pred = per.group_by("category").agg(pl.col("tok_s").median().alias("predicted_tok_s"),
                                           (pl.col("ms").sum() / steps_sum).alias("predicted_step_ms"),
                                           (pl.col("recorded_ms").sum() / steps_sum).alias("recorded_step_ms"),
                                           (pl.col("clamped").sum() / steps_sum).alias("clamped_share"))
        meas = (measured.filter(pl.col("config") == config).group_by("category")
                .agg(pl.col("decode_tok_s").median().alias("measured_tok_s"), pl.len().alias("prompts")))
        rows.append(meas.join(pred, on="category", how="inner").with_columns(
            pl.lit(run).alias("run"), pl.lit(shape).alias("shape"), pl.lit(config).alias("config"),
            pl.lit(config_label(config)).alias("label")))
    out = pl.concat(rows).with_columns((pl.col("predicted_tok_s") / pl.col("measured_tok_s")).alias("ratio"))
    return (out.with_columns(((pl.col("ratio") - 1).abs() <= tolerance).alias("within"))
            .select("run", "shape", "config", "label", "category", "prompts", "measured_tok_s", "predicted_tok_s",
                    "ratio", "within", "predicted_step_ms", "recorded_step_ms", "clamped_share")
            .sort("run", "config", "category"))


def priceable(steps: pl.DataFrame, run: str, config: str) -> bool:
    """Whether this module can price `config` of `run`: none, gpu-lookup, or gpu-fused with at most one drafter
    pass a step at batch 1."""
    try:
        kind = config_kind(config)
    except (ScaleError, ConfigError):
        return False
    if kind != "gpu-fused":
        return True
    mine = steps.filter((pl.col("run") == run) & (pl.col("config") == config) & (pl.col("load") == "alone"))
    return not mine.is_empty() and bool((mine["drafter_passes"] <= 1).all())


def validation_fraction(table: pl.DataFrame) -> float:
    """The share of (run, config, class) rows of `validate` whose prediction is within its tolerance."""
    if table.is_empty():
        raise ScaleError("no validation rows")
    return float(table["within"].mean())


def validate_runs(costs: pl.DataFrame, steps: pl.DataFrame, results: pl.DataFrame, runs: Mapping[str, str], *,
                  phases: pl.DataFrame | None = None, repeats: pl.DataFrame | None = None, tolerance: float = 0.10,
                  same_machine: bool = True, say: Callable[[str], None] = lambda _: None) -> pl.DataFrame:
    """`validate` over several decode runs (`runs`: run -> the grid shape of its model), every priceable config of
    each at batch 1: a gpu-fused config's drafter pass from the grid's fused step where the grid has one for that
    shape, else from the run's own profile (`phases`), else the config is left out. Steps outside the grid's
    contexts are an error first; where some are, the run is priced at the nearest measured context instead
    (`clamped_share` says how much). With `repeats`, `repeat_spread` is added. `say` hears each decision."""
    tables = []
    for run, shape in runs.items():
        batch1 = results.filter((pl.col("run") == run) & (pl.col("concurrency") == 1))
        configs = [c for c in batch1["config"].unique().sort().to_list() if priceable(steps, run, c)]
        profiled, fused_shape = None, None
        if any(config_kind(c) == "gpu-fused" for c in configs):
            if has_fused(costs, shape):
                fused_shape = shape
                say(f"{run}: the fused pass from the grid (fused step - lookup step)")
            elif phases is not None and not phases.filter(pl.col("run") == run).is_empty():
                profiled = profiled_pass_ms(phases, run)
                say(f"{run}: the fused pass from this run's own profile (GPU ms by width): {profiled}")
            else:
                left = [c for c in configs if config_kind(c) == "gpu-fused"]
                say(f"{run}: no fused step in the grid and no profile: not priced {left}")
                configs = [c for c in configs if c not in left]
        kwargs = dict(configs=configs, fused_shape=fused_shape, profiled_pass=profiled, same_machine=same_machine,
                      tolerance=tolerance)
        try:
            table = validate(costs, steps, results, run, shape, outside_context="error", **kwargs)
        except ScaleError as e:  # a step outside the measured contexts (a point the grid lost): say so
            say(f"{run}: {e}; priced at the nearest measured context instead (clamped_share)")
            table = validate(costs, steps, results, run, shape, outside_context="clamp", **kwargs)
        tables.append(table)
    if not tables:
        raise ScaleError("no runs to validate")
    table = pl.concat(tables)
    return repeat_spread(repeats, table) if repeats is not None else table


def repeat_spread(repeats: pl.DataFrame, table: pl.DataFrame) -> pl.DataFrame:
    """`validate`'s table with `repeat_spread`: per (run, config, class) the largest, over the class's prompts, of a
    prompt's fastest ÷ slowest decode tok/s across its repeats (`repeats`: a decode run's .repeats rows). A pair
    whose own repeats spread more than 1 + tolerance cannot be predicted within the tolerance by any model: the
    measurement is the limit there, not the prediction."""
    spread = (repeats.group_by("run", "config", "category", "prompt_id")
              .agg((pl.col("decode_tok_s").max() / pl.col("decode_tok_s").min()).alias("repeat_spread"))
              .group_by("run", "config", "category").agg(pl.col("repeat_spread").max()))
    return table.join(spread, on=["run", "config", "category"], how="left")


def speedup_check(table: pl.DataFrame, *, tolerance: float = 0.10) -> pl.DataFrame:
    """From a `validate` table: per (run, config, class) besides `none`, the speedup ÷ `none` measured and predicted
    (each config's tok/s ÷ `none`'s of the same run and class), their ratio and whether it is within `tolerance`.
    A projection quotes speedups: this is their check where the truth is known."""
    if not 0 < tolerance < 1:
        raise ScaleError(f"tolerance must be in (0, 1) (got {tolerance})")
    none = table.filter(pl.col("config") == "none").select(
        "run", "category", pl.col("measured_tok_s").alias("none_measured"),
        pl.col("predicted_tok_s").alias("none_predicted"))
    if none.is_empty():
        raise ScaleError("the validation table has no `none` rows to divide by")
    out = (table.filter(pl.col("config") != "none").join(none, on=["run", "category"], how="inner")
           .with_columns((pl.col("measured_tok_s") / pl.col("none_measured")).alias("measured_speedup"),
                         (pl.col("predicted_tok_s") / pl.col("none_predicted")).alias("predicted_speedup"))
           .with_columns((pl.col("predicted_speedup") / pl.col("measured_speedup")).alias("speedup_ratio")))
    return (out.with_columns(((pl.col("speedup_ratio") - 1).abs() <= tolerance).alias("speedup_within"))
            .select("run", "label", "category", "measured_speedup", "predicted_speedup", "speedup_ratio",
                    "speedup_within"))


def project(costs: pl.DataFrame, sources: Sequence[Traces], shapes: Sequence[str], batches: Sequence[int], *,
            quant: str = "bf16", pass_quant: str = "bf16", fused_shape: str | None = None,
            measured_drafter_shape: str | None = None,
            drafters: Sequence[str] = ("measured",), drafter_ratio: float = 1 / 20,
            profiled_pass: Mapping[int, float] | None = None, outside_context: str = "clamp") -> pl.DataFrame:
    """The projection table: per (shape, config of each source, class, batch, drafter rule) the tokens the source's
    requests emitted, their steps, projected decode tok/s = tokens ÷ summed step costs (pooled over the class's
    requests; per request at that batch, `batch_tok_s` = × batch) and speedup ÷ `none` on the same shape and batch,
    with provenance (`PROJECTION_COLUMNS`). `drafters`: "measured" (the drafter of the fused measurement, the 0.5B,
    on every target) and/or "scaled" (`scaled_drafter_shape` with `drafter_ratio`); they apply to gpu-fused
    sources only."""
    check_step_costs(costs)
    if not sources:
        raise ScaleError("project: no traces")
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or not drafters:
        raise ScaleError(f"drafters must be some of {', '.join(DRAFTERS)} (got {list(drafters)})")
    params = dict(costs.group_by("shape").agg(pl.col("target_params_b").first()).iter_rows())
    provenance = {"step_costs_run": ",".join(sorted(costs["run"].unique().to_list())),
                  "step_costs_commit": ",".join(sorted(costs["git_commit"].unique().to_list())),
                  "machine": ",".join(sorted(costs["machine"].unique().to_list())),
                  "vllm_version": ",".join(sorted(costs["vllm_version"].unique().to_list()))}
    frames = []
    for shape in shapes:
        if shape not in params:
            raise ScaleError(f"step costs: no shape {shape!r} (shapes: {sorted(params)})")
        for batch in batches:
            for tr in sources:
                rules = list(drafters) if tr.kind == "gpu-fused" else ["-"]
                for rule in rules:
                    dshape = (scaled_drafter_shape(costs, params[shape], ratio=drafter_ratio, quant=pass_quant)
                              if rule == "scaled" else measured_drafter_shape)
                    per = price_requests(tr, costs, shape, batch, quant=quant, fused_shape=fused_shape,
                                         drafter_shape=dshape if tr.kind == "gpu-fused" else None,
                                         measured_drafter_shape=measured_drafter_shape, pass_quant=pass_quant,
                                         profiled_pass=profiled_pass, outside_context=outside_context)
                    cls = per.group_by("category", maintain_order=True).agg(
                        pl.len().alias("requests"), pl.col("tokens").sum(), pl.col("steps").sum(),
                        pl.col("ms").sum(), pl.col("none_ms").sum(), pl.col("clamped").sum())
                    frames.append(cls.with_columns(
                        pl.lit(shape).alias("shape"), pl.lit(float(params[shape])).alias("target_params_b"),
                        pl.lit(quant).alias("quant"), pl.lit(tr.config).alias("config"),
                        pl.lit(config_label(tr.config)).alias("label"), pl.lit(batch).alias("batch"),
                        (pl.col("tokens") / pl.col("steps")).alias("tokens_per_step"),
                        (pl.col("ms") / pl.col("steps")).alias("step_ms"),
                        (1e3 * pl.col("tokens") / pl.col("ms")).alias("tok_s"),
                        (1e3 * batch * pl.col("tokens") / pl.col("ms")).alias("batch_tok_s"),
                        (1e3 * pl.col("tokens") / pl.col("none_ms")).alias("none_tok_s"),
                        (pl.col("none_ms") / pl.col("ms")).alias("speedup"),
                        pl.lit(rule).alias("drafter"),
                        pl.lit(dshape if tr.kind == "gpu-fused" else "").alias("drafter_shape"),
                        (pl.col("clamped") / pl.col("steps")).alias("clamped_share"),
                        pl.lit(tr.run).alias("traces_run"), pl.lit(tr.model).alias("traces_model"),
                        pl.lit(tr.commit).alias("traces_commit"),
                        *[pl.lit(v).alias(k) for k, v in provenance.items()]))
    return pl.concat(frames).with_columns(pl.col("batch").cast(pl.Int64)).select(PROJECTION_COLUMNS)


def checked_projection(table: pl.DataFrame) -> pl.DataFrame:
    """The projection table (`project`) as it may be kept: a table without every provenance column of
    `PROJECTION_COLUMNS`, or an empty one, is refused."""
    missing = [c for c in PROJECTION_COLUMNS if c not in table.columns]
    if missing:
        raise ScaleError(f"projection table: missing column(s) {', '.join(missing)}")
    if table.is_empty():
        raise ScaleError("projection table: no rows")
    return table

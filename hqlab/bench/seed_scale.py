"""The plan of the seed-scale validation on one machine (benchmarks/seed_scale_validation.py, #41, docs/seed-scale.md):
which grid points the validation prices (batch 1, each config's verify width, contexts that bracket every step of the
suite), and the items of one GPU call (each model's grid, then its decodes) with the seconds each is expected and
allowed to take. Pure, and standard library only: `run` plans on the GPU host, which has no polars."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from hqlab.bench import step_cost
from hqlab.config import parse_spec

SHAPE_OF = {"qwen2.5-coder-0.5b": "qwen2.5-0.5b", "qwen2.5-coder-1.5b": "qwen2.5-1.5b"}  # real model -> grid shape
SHORT = {"qwen2.5-coder-0.5b": "05b", "qwen2.5-coder-1.5b": "15b"}
LOOKUP_15 = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
LOOKUP_31 = "gpu-lookup:nmin=1,nmax=32,k=31,policy=earliest"
FUSED_15 = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
            "compile_rule=true,layers=triton,attention=triton")
FUSED_31_SKIP = ("gpu-fused:k=31,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
                 "compile_rule=true,device_skip=true,layers=triton,attention=triton")
# the configs of the committed decode runs it validates (`none` is always added), cut to fit one call;
# --config-05b/--config-15b replace them
DEFAULT_CONFIGS = {"qwen2.5-coder-0.5b": [LOOKUP_15, LOOKUP_31], "qwen2.5-coder-1.5b": [LOOKUP_31, FUSED_15]}
SUITE, DOC_TOKENS, MAX_NEW_TOKENS = "all", 2000, 256  # as the committed decode runs it validates
TOP_STEP = 512  # the grid's largest context: the longest step's, rounded up to this (`bracketing_contexts`)
GRID_STEPS = 48  # timed steps per grid point (at 12 the host-bound 0.5B's points spread 1.2-1.6x p10-p90)
GRID_STEP_S = 0.004  # seconds a grid step of the 0.5B/1.5B takes at most (2-4 ms), for the estimate of longer grids
PROMPT_TOKENS = (140, 2035)  # the suite's prompts at doc_tokens 2000 (chat-travel .. edit)
LIMIT, REPEATS = 9, 3
# Expected seconds (measured on an H200 and an H100): an engine of the grid starts in 60-106 s (one at a time);
# engines started together: three of the 0.5B ~75 s (four took 94 s), three of the 1.5B with a fused one ~110 s
# (five took 200 s, the fused ones last); a round of 9 prompts on 3 engines ~8 s (0.5B) and ~12 s (1.5B).
GRID_EST_S = {"gpu-lookup": 100.0, "gpu-fused": 120.0, "none": 80.0}
GRID_MIN_S = {"gpu-lookup": 70.0, "gpu-fused": 100.0, "none": 60.0}
DECODE_START_S = {"qwen2.5-coder-0.5b": 85.0, "qwen2.5-coder-1.5b": 130.0}  # process start to the first round
ROUND_S_PER_ENGINE_PROMPT = {"qwen2.5-coder-0.5b": 0.3, "qwen2.5-coder-1.5b": 0.45}
ESTIMATE_SLACK = 1.5  # an item may run this many times its estimate before it is cut, budget allowing
END_MARGIN_S = 10.0  # left at the end for the status file and the host's log


# ------------------------------------------------------------------------------------------------------------------
# What the validation prices (pure; hqlab.replay.scale.validate -> price_requests reads these points)


def config_kind(config: str) -> str:
    name = "none" if config == "none" else parse_spec(config)[0]
    if name not in ("none", "gpu-lookup", "gpu-fused"):
        raise ValueError(f"config {config!r}: the step-cost grid prices only none, gpu-lookup and gpu-fused")
    return name


def verify_width(config: str) -> int:
    """Positions a step of `config` verifies in vLLM: 1 for `none`, k + 1 for gpu-lookup and gpu-fused (vLLM verifies
    k drafts every step: the committed step records hold no other width). A spec without k= is refused."""
    if config_kind(config) == "none":
        return 1
    values = parse_spec(config)[1]
    if not values.get("k", "").isdigit() or int(values["k"]) < 1:
        raise ValueError(f"config {config!r}: no integer k >= 1, so its verify width is not known")
    return int(values["k"]) + 1


def single_pass(config: str) -> bool:
    return config_kind(config) == "gpu-fused" and parse_spec(config)[1].get("draft_block", "1") == "1"


def bracketing_contexts(low: int, high: int, top_step: int = TOP_STEP) -> tuple[int, ...]:
    """Powers of two from the largest at or below `low` up to `high`, then `high` rounded up to a multiple of
    `top_step`: every step reading low..high tokens lies between two measured contexts at most a factor of two apart
    (none clamped). The top is not the next power of two: a 4,096-token point ran in another regime (a width-32 step
    2.6-2.8x its 2,048 cost on both shapes), and interpolating towards it overpriced every step above 2,048."""
    if not 1 <= low <= high:
        raise ValueError(f"a context range needs 1 <= low <= high (got {low}, {high})")
    if top_step < 1:
        raise ValueError(f"top_step must be >= 1 (got {top_step})")
    c, out = 1 << (low.bit_length() - 1), []
    while c < high:
        out.append(c)
        c *= 2
    return tuple(out) + (-(-high // top_step) * top_step,)  # every power of two kept is below `high`


def step_contexts(configs: Sequence[str], prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
                  max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[int, int]:
    """The fewest and most tokens a decode step reads: the shortest prompt, and the longest + every new token +
    the widest verify."""
    return prompt_tokens[0], prompt_tokens[1] + max_new_tokens + max(verify_width(c) for c in ["none", *configs])


def grid_points(configs: Sequence[str], contexts: tuple[int, int], *, fused_grid: bool = False
                ) -> dict[str, dict[str, tuple[int, ...]]]:
    """The grid a batch-1 validation of `none` + `configs` prices, per grid config: gpu-lookup at width 1 (`none`)
    and each config's verify width; with `fused_grid`, gpu-fused at the single-pass fused configs' widths (pass =
    fused step - lookup step at the same point, `scale.pass_ms`). Contexts: `bracketing_contexts` of the range."""
    ctx = bracketing_contexts(*contexts)
    out = {"gpu-lookup": {"widths": tuple(sorted({1, *(verify_width(c) for c in configs)})), "contexts": ctx,
                          "batches": (1,)}}
    fused = sorted({verify_width(c) for c in configs if single_pass(c)})
    if fused_grid and fused:
        out["gpu-fused"] = {"widths": tuple(fused), "contexts": ctx, "batches": (1,)}
    return out


# ------------------------------------------------------------------------------------------------------------------
# The plan and the budget (pure)


@dataclass
class Item:
    kind: str  # "grid" or "decode"
    model: str
    name: str
    est_s: float
    min_s: float
    grid_config: str = ""  # grid: gpu-lookup or gpu-fused
    points: dict = field(default_factory=dict)  # grid: widths, contexts, batches
    configs: list = field(default_factory=list)  # decode: the configs besides none
    profile: bool = False  # decode: time the worker's phases once more (the fused pass, without a fused grid)
    status: str = "planned"
    seconds: float = 0.0
    why: str = ""


def decode_estimate(model: str, configs: Sequence[str], limit: int, repeats: int, profile: bool) -> float:
    engines = 1 + len(configs)
    per_round = ROUND_S_PER_ENGINE_PROMPT[model] * engines * limit
    return DECODE_START_S[model] + (repeats + (1 if profile else 0)) * per_round + 10.0


def grid_extra_s(n_points: int, steps: int, rounds: int) -> float:
    """Seconds a grid of `n_points` takes beyond GRID_EST_S when each point times `steps` in `rounds` passes (each
    pass pays step_cost.WARM_STEPS + 1 untimed steps) instead of GRID_STEPS in one."""
    per_point = steps + rounds * (step_cost.WARM_STEPS + 1) - (GRID_STEPS + step_cost.WARM_STEPS + 1)
    return max(0.0, n_points * per_point * GRID_STEP_S)


def make_plan(configs: dict[str, list[str]], *, limit: int = LIMIT, repeats: int = REPEATS,
              fused_grid: bool = False, none_grid: bool = False, grid_steps: int = GRID_STEPS,
              grid_rounds: int = 1) -> list[Item]:
    """(a) every model's grid items, then (b) every model's decodes, in the order of `configs`; with `none_grid`
    (c) every model's `none` grid, at the contexts of its lookup grid. `grid_steps` timed steps a grid point in
    `grid_rounds` passes over the grid's points lengthen each grid item's estimate (`grid_extra_s`)."""
    def extra(grid_config: str, model: str, points: dict) -> float:
        n = len(step_cost.points(grid_config, SHAPE_OF[model], **points))
        return grid_extra_s(n, grid_steps, grid_rounds)

    items: list[Item] = []
    for model, these in configs.items():
        for grid_config, points in grid_points(these, step_contexts(these), fused_grid=fused_grid).items():
            more = extra(grid_config, model, points)
            items.append(Item("grid", model, f"grid {SHAPE_OF[model]} {grid_config}", GRID_EST_S[grid_config] + more,
                              GRID_MIN_S[grid_config] + more, grid_config=grid_config, points=points))
    for model, these in configs.items():
        profile = any(single_pass(c) for c in these) and not fused_grid
        items.append(Item("decode", model, f"decode {model}", decode_estimate(model, these, limit, repeats, profile),
                          min(DECODE_START_S[model] + 15.0, decode_estimate(model, these, limit, 1, False)),
                          configs=list(these), profile=profile))
    if none_grid:
        for model, these in configs.items():
            points = {"widths": (1,), "contexts": bracketing_contexts(*step_contexts(these)), "batches": (1,)}
            more = extra("none", model, points)
            items.append(Item("grid", model, f"grid {SHAPE_OF[model]} none", GRID_EST_S["none"] + more,
                              GRID_MIN_S["none"] + more, grid_config="none", points=points))
    return items


def decide(items: Sequence[Item], i: int, left_s: float, grid_ok: dict[str, bool]) -> tuple[bool, float, str]:
    """Whether item `i` starts with `left_s` seconds of the budget left, and its time limit: what is left less the
    minimum of every later item that can still run (a decode only runs if its model's grid measured something), but
    never less than 1.5 x its own estimate while the budget holds that (the items run in order of priority: a
    later item that no longer fits is skipped, an earlier one is not starved). Returns (start, limit_s, why not)."""
    item = items[i]
    if item.kind == "decode" and not grid_ok.get(item.model, False):
        return False, 0.0, f"no grid rows for {SHAPE_OF[item.model]}: nothing to validate its decodes against"
    usable = left_s - END_MARGIN_S
    if usable < item.min_s:
        return False, 0.0, f"{usable:.0f} s usable, it needs at least {item.min_s:.0f} s"

    def can_run(x: Item) -> bool:  # a later item that may still start: a decode needs its model's lookup grid
        return x.status == "planned" and (x.kind == "grid" or grid_ok.get(x.model, False) or any(
            g.kind == "grid" and g.model == x.model and g.grid_config == "gpu-lookup" for g in items[i:]))

    reserve = sum(x.min_s for x in items[i + 1:] if can_run(x))
    return True, max(usable - reserve, min(usable, ESTIMATE_SLACK * item.est_s)), ""

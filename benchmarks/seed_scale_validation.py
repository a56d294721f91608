"""The seed-scale validation on one machine (#41, docs/seed-scale.md): in one GPU call, (a) the step-cost grid of
the 0.5B and 1.5B shapes at only the points the validation prices (benchmarks/vllm_step_cost.py, the engine core in
its own process), then (b) the decode runs it predicts (benchmarks/vllm_gpu.py bench, the LLM API as runs w2 and fn2
ran it), on the same machine right after; on the CPU, `finish` writes both and validates the grid against those
decodes, not against w2/fn2 (another card, another host).

Why one machine: the grid of run s2 came from an H100 host and w2/fn2 from an H200 host, and the served cost of a
speculative step differs 1.22-1.49x between two H100 hosts, so a miss could not be told from the host.

What runs, in order (`plan` prints it with each item's expected seconds):
  0. both models converted (hqlab.models; nothing when a call on the same warm machine already did it: ~160 s if
     not, run s2's log, which leaves too little for the 1.5B's decodes: `prepare` is that step alone);
  1. grid, per model's shape: gpu-lookup at batch 1, width 1 and each config's verify width (k + 1), contexts 128 to
     2,048 in powers of two and 2,560 (they bracket every step of the suite's prompts, 140-2,035 tokens + 256 new +
     the width, so no step is priced outside the grid; `bracketing_contexts`), 48 timed steps a point; with
     --fused-grid also the 1.5B's gpu-fused step at the fused configs' widths (about 100 s more; without it a fused
     config's drafter pass is the same decodes' profiled pass, --profile);
  2. decodes, per model: `none` and its configs, each on its own engine, all started together and interleaved
     prompt by prompt (--interleave --parallel-start), the suite's first --limit prompts (default 9: one each of
     copy, code, edit, quote, summary, qa and three chat prompts), --repeats rounds, one request at a time;
  3. with --none-grid, per model's shape an engine without a speculator at width 1 and the same contexts, which
     prices `none` (`scale.plain_config`; without it `none` is the lookup's width-1 step, which still runs the
     speculator and the rejection sampler: v1 priced `none` 5-9 % slow so). Last, so that a short budget cuts it
     first (~80 s a model).
Defaults (to fit ~520 s): the 0.5B with w2's gpu-lookup k = 15 and k = 31; the 1.5B with fn2's gpu-lookup k = 31
and gpu-fused k = 15 one pass (fn2's gpu-lookup k = 15 and gpu-fused k = 31 device skip left out: two more engines
at ~60-100 s each); 3 x 7 (config, class) pairs per model.

Budget: nothing starts with less than its minimum left; each item runs in a session of its own, killed (engine
processes included) when its share of the budget is spent; a decode keeps the rounds it finished (the bench saves
after each). A model whose grid has no rows gets no decodes. Every result goes to $OUT as soon as it exists:
seed_scale_<tag>.jsonl (grid rows), vllm_gpu_<tag>_05b/_15b.parquet + .json (raw decodes) and
validation_<tag>.json (the plan, what ran, was cut or skipped, and why): five to seven files with the log.

  GPU (through tools/gpu_host/vllm_host.py run):
      python3 benchmarks/seed_scale_validation.py run --tag v1 --commit $(git rev-parse --short HEAD) --budget-s 520
  CPU (here):
      python benchmarks/seed_scale_validation.py finish RETURNED_DIR
    -> data/results/seed_scale/<tag>/: grid.parquet (the grid rows), rows.parquet, steps.parquet, repeats.parquet,
    phases.parquet (the decodes, runs <tag>_05b and <tag>_15b), check.parquet (the validation table) and the
    returned files, printing the (config, class) pairs within +-10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

from benchmarks import vllm_step_cost as grid_bench  # noqa: E402  (after the path: a bare checkout)
from hqlab.config import parse_spec  # noqa: E402  (light: no polars or torch, which the GPU host may lack)
from hqlab.io import read_json  # noqa: E402  (standard library only)

SHAPE_OF = {"qwen2.5-coder-0.5b": "qwen2.5-0.5b", "qwen2.5-coder-1.5b": "qwen2.5-1.5b"}  # real model -> grid shape
SHORT = {"qwen2.5-coder-0.5b": "05b", "qwen2.5-coder-1.5b": "15b"}
LOOKUP_15 = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
LOOKUP_31 = "gpu-lookup:nmin=1,nmax=32,k=31,policy=earliest"
FUSED_15 = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
            "compile_rule=true,layers=triton,attention=triton")
FUSED_31_SKIP = ("gpu-fused:k=31,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
                 "compile_rule=true,device_skip=true,layers=triton,attention=triton")
# w2's and fn2's validated configs (`none` is always added), cut to fit one call; --config-05b/--config-15b replace
DEFAULT_CONFIGS = {"qwen2.5-coder-0.5b": [LOOKUP_15, LOOKUP_31], "qwen2.5-coder-1.5b": [LOOKUP_31, FUSED_15]}
SUITE, DOC_TOKENS, MAX_NEW_TOKENS = "all", 2000, 256  # as runs w2 and fn2
TOP_STEP = 512  # the grid's largest context: the longest step's, rounded up to this (`bracketing_contexts`)
GRID_STEPS = 48  # timed steps per grid point (v1 timed 12: the host-bound 0.5B's points spread 1.2-1.6x p10-p90)
GRID_STEP_S = 0.004  # seconds a grid step of the 0.5B/1.5B takes at most (2-4 ms), for the estimate of longer grids
PROMPT_TOKENS = (140, 2035)  # the suite's prompts at doc_tokens 2000 (runs w2, fn2: chat-travel .. edit)
LIMIT, REPEATS = 9, 3
# Expected seconds (H200 runs w2/fn2, H100 run s2): an engine of the grid starts in 60-106 s (s2, one at a time);
# engines started together: three of the 0.5B ~75 s (w2: four in 94 s), three of the 1.5B with a fused one ~110 s
# (fn2: five in 200 s, the fused ones last); a round of 9 prompts on 3 engines ~8 s (0.5B) and ~12 s (1.5B).
GRID_EST_S = {"gpu-lookup": 100.0, "gpu-fused": 120.0, "none": 80.0}
GRID_MIN_S = {"gpu-lookup": 70.0, "gpu-fused": 100.0, "none": 60.0}
DECODE_START_S = {"qwen2.5-coder-0.5b": 85.0, "qwen2.5-coder-1.5b": 130.0}  # process start to the first round
ROUND_S_PER_ENGINE_PROMPT = {"qwen2.5-coder-0.5b": 0.3, "qwen2.5-coder-1.5b": 0.45}
ESTIMATE_SLACK = 1.5  # an item may run this many times its estimate before it is cut, budget allowing
END_MARGIN_S = 10.0  # left at the end for the status file and the host's log


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------------------------
# What the validation prices (pure; hqlab.replay.scale.validate -> price_requests reads these points)


def config_kind(config: str) -> str:
    name = "none" if config == "none" else parse_spec(config)[0]
    if name not in ("none", "gpu-lookup", "gpu-fused"):
        raise ValueError(f"config {config!r}: the step-cost grid prices only none, gpu-lookup and gpu-fused")
    return name


def verify_width(config: str) -> int:
    """Positions a step of `config` verifies in vLLM: 1 for `none`, k + 1 for gpu-lookup and gpu-fused (vLLM verifies
    k drafts every step: the step records of w2 and fn2 hold no other width). A spec without k= is refused."""
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
    (none clamped). The top is not the next power of two: run v1's 4,096 point ran in another regime (a width-32 step
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
    pass pays WARM_STEPS + 1 untimed steps) instead of GRID_STEPS in one."""
    per_point = steps + rounds * (grid_bench.WARM_STEPS + 1) - (GRID_STEPS + grid_bench.WARM_STEPS + 1)
    return max(0.0, n_points * per_point * GRID_STEP_S)


def make_plan(configs: dict[str, list[str]], *, limit: int = LIMIT, repeats: int = REPEATS,
              fused_grid: bool = False, none_grid: bool = False, grid_steps: int = GRID_STEPS,
              grid_rounds: int = 1) -> list[Item]:
    """(a) every model's grid items, then (b) every model's decodes, in the order of `configs`; with `none_grid`
    (c) every model's `none` grid, at the contexts of its lookup grid. `grid_steps` timed steps a grid point in
    `grid_rounds` passes over the grid's points lengthen each grid item's estimate (`grid_extra_s`)."""
    def extra(grid_config: str, model: str, points: dict) -> float:
        n = len(grid_bench.points(grid_config, SHAPE_OF[model], **points))
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


# ------------------------------------------------------------------------------------------------------------------
# GPU: run


def bench_argv(item: Item, tag: str, limit: int, repeats: int) -> list[str]:
    argv = [sys.executable, str(ROOT / "benchmarks" / "vllm_gpu.py"), "bench", "--tag", f"{tag}_{SHORT[item.model]}",
            "--interleave", "--parallel-start", "--model", item.model, "--suite", SUITE, "--doc-tokens",
            str(DOC_TOKENS), "--max-new-tokens", str(MAX_NEW_TOKENS), "--limit", str(limit), "--repeats",
            str(repeats), "--concurrency", "0"]
    for config in item.configs:
        argv += ["--config", config]
    return argv + (["--profile"] if item.profile else [])


def grid_argv(item: Item, tag: str, commit: str, budget_s: float, work: Path, *, steps: int = GRID_STEPS,
              rounds: int = 1) -> list[str]:
    p = item.points
    return ["run", "--tag", tag, "--commit", commit, "--budget-s", f"{budget_s:.0f}", "--min-left-s",
            f"{min(item.min_s, budget_s):.0f}", "--only", f"{SHAPE_OF[item.model]}:bf16:{item.grid_config}",
            "--work", str(work), "--engine", "process", "--contexts", ",".join(map(str, p["contexts"])),
            "--batches", ",".join(map(str, p["batches"])), "--widths", ",".join(map(str, p["widths"])),
            "--steps", str(steps)] + (["--rounds", str(rounds)] if rounds > 1 else [])


def rows_of(rows_path: Path, shape: str, config: str) -> int:
    """Grid rows of (shape, config) in the rows file."""
    if not rows_path.exists():
        return 0
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    return sum(1 for r in rows if (r["shape"], r["config"]) == (shape, config))


def configs_from(args: argparse.Namespace) -> dict[str, list[str]]:
    configs = {"qwen2.5-coder-0.5b": args.config_05b or DEFAULT_CONFIGS["qwen2.5-coder-0.5b"],
               "qwen2.5-coder-1.5b": args.config_15b or DEFAULT_CONFIGS["qwen2.5-coder-1.5b"]}
    for these in configs.values():
        for c in these:
            verify_width(c)  # a config the grid cannot price is refused before anything starts
    return {m: c for m, c in configs.items() if m in args.model}


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "hqlab-seed-validation" / args.tag)
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; results into {out}")
    items = make_plan(configs_from(args), limit=args.limit, repeats=args.repeats, fused_grid=args.fused_grid,
                      none_grid=args.none_grid, grid_steps=args.grid_steps, grid_rounds=args.grid_rounds)
    status_path = out / f"validation_{args.tag}.json"
    status = {"tag": args.tag, "commit": args.commit, "budget_s": args.budget_s, "limit": args.limit,
              "repeats": args.repeats, "suite": SUITE, "doc_tokens": DOC_TOKENS, "max_new_tokens": MAX_NEW_TOKENS,
              "fused_grid": args.fused_grid, "none_grid": args.none_grid, "grid_steps": args.grid_steps,
              "grid_rounds": args.grid_rounds, "items": [], "prepare_s": None}

    def save() -> None:
        status["items"] = [asdict(x) for x in items]
        status["elapsed_s"] = round(time.monotonic() - start, 1)
        tmp = status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=1) + "\n")
        os.replace(tmp, status_path)

    for x in items:
        log(f"plan: {x.name}: ~{x.est_s:.0f} s (at least {x.min_s:.0f})")
    save()
    t = time.monotonic()  # the models, converted once per warm machine (the grid's tokenizer is the 1.5B's)
    models = sorted({grid_bench.TOKENIZER_FROM, *(x.model for x in items),
                     *([grid_bench.DRAFTER] if any(single_pass(c) for x in items for c in x.configs) else [])})
    code = f"from hqlab import models; [models.prepare(m) for m in {models!r}]"
    rc = grid_bench.run_bounded([sys.executable, "-c", code], max(30.0, args.budget_s - END_MARGIN_S), cwd=ROOT)
    status["prepare_s"] = round(time.monotonic() - t, 1)
    log(f"models {', '.join(models)} ready in {status['prepare_s']:.0f} s (exit {rc})")
    save()
    if rc != 0:
        return 1
    rows_path = work / f"seed_scale_{args.tag}.jsonl"
    grid_ok: dict[str, bool] = {}
    for i, item in enumerate(items):
        left = args.budget_s - (time.monotonic() - start)
        go, limit_s, why = decide(items, i, left, grid_ok)
        if not go:
            item.status, item.why = "skipped", why
            log(f"{item.name}: skipped ({why})")
            save()
            continue
        log(f"{item.name}: starting, {limit_s:.0f} s of {left:.0f} left")
        t = time.monotonic()
        if item.kind == "grid":
            grid_bench.main(grid_argv(item, args.tag, args.commit, limit_s, work, steps=args.grid_steps,
                                      rounds=args.grid_rounds))
            got = rows_of(rows_path, SHAPE_OF[item.model], item.grid_config)
            grid_ok[item.model] = grid_ok.get(item.model, False) or (item.grid_config == "gpu-lookup" and got > 0)
            want = len(grid_bench.points(item.grid_config, SHAPE_OF[item.model], **item.points))
            item.status = "done" if got else "failed"
            item.why = f"{got} of {want} points measured"
        else:
            rc = grid_bench.run_bounded(bench_argv(item, args.tag, args.limit, args.repeats), limit_s, cwd=ROOT)
            item.status = {0: "done", "timeout": "cut"}.get(rc, "failed")
            item.why = (f"exit {rc}" if rc != "timeout" else
                        f"stopped at its {limit_s:.0f} s: the rounds it finished are saved, a profile is not")
        item.seconds = round(time.monotonic() - t, 1)
        log(f"{item.name}: {item.status} in {item.seconds:.0f} s ({item.why})")
        save()
    log(f"done in {time.monotonic() - start:.0f} s of {args.budget_s:.0f}: "
        + ", ".join(f"{x.name} {x.status}" for x in items))
    return 0


def prepare(args: argparse.Namespace) -> int:
    """GPU: convert the models only (a call of its own before `run` on the same warm machine saves it ~160 s)."""
    from hqlab import models

    for name in (grid_bench.TOKENIZER_FROM, grid_bench.DRAFTER):
        t = time.monotonic()
        log(f"{name}: {models.prepare(name)} in {time.monotonic() - t:.0f} s")
    return 0


def show_plan(args: argparse.Namespace) -> int:
    items = make_plan(configs_from(args), limit=args.limit, repeats=args.repeats, fused_grid=args.fused_grid,
                      none_grid=args.none_grid, grid_steps=args.grid_steps, grid_rounds=args.grid_rounds)
    total = 0.0
    for x in items:
        total += x.est_s
        what = (f"{x.grid_config} widths {x.points['widths']} contexts {x.points['contexts']} batch 1"
                if x.kind == "grid" else f"none + {len(x.configs)} configs{', profiled' if x.profile else ''}")
        print(f"~{x.est_s:4.0f} s (min {x.min_s:3.0f})  {x.name}: {what}")
    print(f"~{total:.0f} s in all with the models converted (+~160 s to convert them on a fresh machine)")
    return 0


# ------------------------------------------------------------------------------------------------------------------
# CPU: finish


def finish(args: argparse.Namespace) -> int:
    """The returned dir of one validation call -> data/results/seed_scale/<tag>/: the grid (grid.parquet), the
    decodes of both models (rows, steps, repeats, phases: runs <tag>_05b and <tag>_15b), the validation table
    (check.parquet) and what the host returned as it came (hqlab.bench.results.write_run)."""
    import polars as pl

    from benchmarks import vllm_gpu
    from hqlab.replay import scale

    src = Path(args.returned)
    found = sorted(src.glob("validation_*.json"))
    if len(found) != 1:
        raise SystemExit(f"{src}: expected one validation_<tag>.json, found {[f.name for f in found]}")
    status = json.loads(found[0].read_text())
    tag, commit = status["tag"], args.commit or status["commit"]
    for x in status["items"]:
        print(f"GPU side: {x['name']}: {x['status']}{' in %.0f s' % x['seconds'] if x['seconds'] else ''}"
              f"{' (' + x['why'] + ')' if x['why'] else ''}")
    costs = grid_bench.grid_rows(src)[tag]
    runs, decodes, files = {}, [], {"validation.json": found[0]}
    for model, short in SHORT.items():
        raw = src / f"vllm_gpu_{tag}_{short}.parquet"
        if not raw.exists():
            print(f"{model}: no decodes returned ({raw.name})")
            continue
        meta = read_json(raw.with_suffix(".json"))
        if meta["machine"] not in set(costs["machine"]):
            raise SystemExit(f"{raw.name} decoded on {meta['machine']!r}, the grid rows of run {tag} were measured on "
                             f"{sorted(set(costs['machine']))}: not the same machine")
        runs[model] = f"{tag}_{short}"
        decodes.append(vllm_gpu.finish_tables([str(raw)], runs[model], commit=commit))
        meta_path = raw.with_suffix(".json")
        packed = meta_path.with_name(meta_path.name + ".gz")
        files |= {f"raw_{short}.parquet": raw,
                  **({f"raw_{short}.json": meta_path} if meta_path.exists() else {f"raw_{short}.json.gz": packed})}
    if not runs:
        raise SystemExit("no decodes to validate against")
    tables = {kind: pl.concat([d[kind] for d in decodes if kind in d], how="diagonal_relaxed")
              for kind in ("rows", "steps", "repeats", "phases", "profile_steps") if any(kind in d for d in decodes)}
    priced, statistic = scale.decode_costs(costs)
    print(f"grid run {tag}: decodes priced with each point's {statistic} step")
    table = scale.validate_runs(priced, tables["steps"], tables["rows"],
                                {run: SHAPE_OF[model] for model, run in runs.items()}, phases=tables.get("phases"),
                                repeats=tables.get("repeats"), say=print).with_columns(
        pl.lit(statistic).alias("cost_statistic"))
    runners = sorted({str(r).upper() for r in tables["rows"]["vllm_runner"].drop_nulls()})
    folder = grid_bench.finish_run(src, tag, args.results, tables=tables | {"check": table}, files=files,
                                   info={"commit": commit, "benchmark": "benchmarks/seed_scale_validation.py",
                                         "vllm_runner": runners or None})
    with pl.Config(tbl_rows=100, tbl_width_chars=200, fmt_str_lengths=40):
        print(table.select("run", "label", "category", "prompts", "measured_tok_s", "predicted_tok_s", "ratio",
                           "within", "predicted_step_ms", "recorded_step_ms", "clamped_share"))
    for run_name, part in table.group_by("run", maintain_order=True):
        print(f"run {run_name[0]}: within ±10 %: {int(part['within'].sum())} of {part.height} (config, class) pairs")
    print(f"all: within ±10 %: {int(table['within'].sum())} of {table.height} "
          f"({100 * scale.validation_fraction(table):.0f} %; the issue's mark is 80 %)")
    if "repeat_spread" in table.columns:
        steady = table.filter(pl.col("repeat_spread") <= 1.1)
        print(f"pairs whose every prompt repeated within 1.1x: {steady.height} of {table.height}, of them within "
              f"±10 %: {int(steady['within'].sum())}")
    if table.filter(pl.col("config") == "none").height:
        speedups = scale.speedup_check(table)
        print(f"speedup ÷ none within ±10 %: {int(speedups['speedup_within'].sum())} of {speedups.height}")
    print(f"grid, decodes and validation table of run {tag}: {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "GPU: the grid, then the decodes, within the budget"),
                        ("plan", "print what `run` would do and its expected seconds")):
        r = sub.add_parser(name, help=help_)
        r.add_argument("--tag", default="v1")
        r.add_argument("--commit", default="unknown")
        r.add_argument("--budget-s", type=float, default=520)
        r.add_argument("--work", default=None)
        r.add_argument("--limit", type=int, default=LIMIT, help="the suite's first N prompts")
        r.add_argument("--repeats", type=int, default=REPEATS)
        r.add_argument("--fused-grid", action="store_true",
                       help="also the 1.5B's gpu-fused step in the grid (~100 s more); without it the fused pass is "
                            "the decodes' profiled pass")
        r.add_argument("--none-grid", action="store_true",
                       help="last, an engine without a speculator per shape, which prices `none` (~80 s a model)")
        r.add_argument("--grid-steps", type=grid_bench.positive_int, default=GRID_STEPS,
                       help=f"timed steps a grid point (default {GRID_STEPS})")
        r.add_argument("--grid-rounds", type=grid_bench.positive_int, default=1,
                       help="time each grid point's steps in this many passes over the grid's points, spread over "
                            "the grid's time (default 1: one burst a point)")
        r.add_argument("--config-05b", action="append", default=None, help="the 0.5B's configs (repeatable)")
        r.add_argument("--config-15b", action="append", default=None, help="the 1.5B's configs (repeatable)")
        r.add_argument("--model", action="append", choices=sorted(SHAPE_OF), default=None,
                       help="only these models (default both)")
    sub.add_parser("prepare", help="GPU: convert the models only")
    f = sub.add_parser("finish", help="CPU: the returned dir -> grid rows, decodes, validation")
    f.add_argument("returned")
    f.add_argument("--commit", default=None, help="default: the commit the GPU side was given")
    f.add_argument("--results", default=None, help="the results folder (default data/results)")
    args = p.parse_args(argv)
    if getattr(args, "model", None) is None and args.cmd in ("run", "plan"):
        args.model = sorted(SHAPE_OF)
    if args.cmd in ("run", "plan") and args.grid_rounds > args.grid_steps:
        p.error(f"--grid-rounds {args.grid_rounds} is more than --grid-steps {args.grid_steps}: every round times at "
                f"least one step of each point")
    return {"run": run, "plan": show_plan, "prepare": prepare, "finish": finish}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

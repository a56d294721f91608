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

  GPU (through tools/gpu_host/vllm_host.py run; `python benchmarks/seed_scale_validation.py host run --tag v1 ...`
  prints the call with its commit):
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
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

from benchmarks import vllm_step_cost as grid_bench  # noqa: E402  (after the path: a bare checkout)
from hqlab.bench import runner  # noqa: E402  (standard library only: the host has no polars)
from hqlab.bench.runner import log  # noqa: E402
from hqlab.bench.seed_scale import (DEFAULT_CONFIGS, DOC_TOKENS, END_MARGIN_S, GRID_STEPS, LIMIT,  # noqa: E402
                                    MAX_NEW_TOKENS, REPEATS, SHAPE_OF, SHORT, SUITE, Item, decide, make_plan,
                                    single_pass, verify_width)
from hqlab.io import read_json  # noqa: E402  (standard library only)

SCRIPT = "benchmarks/seed_scale_validation.py"

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
    out = runner.out_dir()
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
        status["elapsed_s"] = round(args.budget.spent(), 1)
        runner.save_json(status_path, status, indent=1)

    for x in items:
        log(f"plan: {x.name}: ~{x.est_s:.0f} s (at least {x.min_s:.0f})")
    save()
    t = time.monotonic()  # the models, converted once per warm machine (the grid's tokenizer is the 1.5B's)
    models = sorted({grid_bench.TOKENIZER_FROM, *(x.model for x in items),
                     *([grid_bench.DRAFTER] if any(single_pass(c) for x in items for c in x.configs) else [])})
    code = f"from hqlab import models; [models.prepare(m) for m in {models!r}]"
    rc = runner.run_bounded([sys.executable, "-c", code], max(30.0, args.budget_s - END_MARGIN_S), cwd=ROOT)
    status["prepare_s"] = round(time.monotonic() - t, 1)
    log(f"models {', '.join(models)} ready in {status['prepare_s']:.0f} s (exit {rc})")
    save()
    if rc != 0:
        return 1
    rows_path = work / f"seed_scale_{args.tag}.jsonl"
    grid_ok: dict[str, bool] = {}
    for i, item in enumerate(items):
        left = args.budget.left()
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
            rc = runner.run_bounded(bench_argv(item, args.tag, args.limit, args.repeats), limit_s, cwd=ROOT)
            item.status = {0: "done", "timeout": "cut"}.get(rc, "failed")
            item.why = (f"exit {rc}" if rc != "timeout" else
                        f"stopped at its {limit_s:.0f} s: the rounds it finished are saved, a profile is not")
        item.seconds = round(time.monotonic() - t, 1)
        log(f"{item.name}: {item.status} in {item.seconds:.0f} s ({item.why})")
        save()
    log(f"done in {args.budget.spent():.0f} s of {args.budget_s:.0f}: "
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

    from hqlab.bench.vllm import finish_tables
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
        decodes.append(finish_tables([str(raw)], runs[model], commit=commit))
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
    folder = grid_bench.finish_run(src, tag, args.results, script=SCRIPT, tables=tables | {"check": table}, files=files,
                                   info={"commit": commit,
                                         "vllm_runner": runner.vllm_runners(tables["rows"]["vllm_runner"].to_list())})
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


def check_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    args.model = args.model or sorted(SHAPE_OF)
    if args.grid_rounds > args.grid_steps:
        parser.error(f"--grid-rounds {args.grid_rounds} is more than --grid-steps {args.grid_steps}: every round times "
                     f"at least one step of each point")
    try:
        configs_from(args)  # a config the grid cannot price is refused here, before anything starts
    except ValueError as e:
        parser.error(str(e))


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """What `run` does and `plan` prints."""
    parser.add_argument("--work", default=None)
    parser.add_argument("--limit", type=int, default=LIMIT, help="the suite's first N prompts")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--fused-grid", action="store_true",
                        help="also the 1.5B's gpu-fused step in the grid (~100 s more); without it the fused pass is "
                             "the decodes' profiled pass")
    parser.add_argument("--none-grid", action="store_true",
                        help="last, an engine without a speculator per shape, which prices `none` (~80 s a model)")
    parser.add_argument("--grid-steps", type=grid_bench.positive_int, default=GRID_STEPS,
                        help=f"timed steps a grid point (default {GRID_STEPS})")
    parser.add_argument("--grid-rounds", type=grid_bench.positive_int, default=1,
                        help="time each grid point's steps in this many passes over the grid's points, spread over "
                             "the grid's time (default 1: one burst a point)")
    parser.add_argument("--config-05b", action="append", default=None, help="the 0.5B's configs (repeatable)")
    parser.add_argument("--config-15b", action="append", default=None, help="the 1.5B's configs (repeatable)")
    parser.add_argument("--model", action="append", choices=sorted(SHAPE_OF), default=None,
                        help="only these models (default both)")


def show_plan_checked(args: argparse.Namespace) -> int:
    check_run(args, CLI.parsers["plan"])
    return show_plan(args)


CLI = runner.Benchmark(SCRIPT, __doc__)
add_plan_options(CLI.gpu("run", run, "GPU: the grid, then the decodes, within the budget", tag="v1", budget_s=520,
                         check=check_run))
cmd = CLI.command("plan", show_plan_checked, "print what `run` would do and its expected seconds", results=False)
cmd.add_argument("--tag", default="v1")
cmd.add_argument("--commit", default="unknown")
cmd.add_argument("--budget-s", type=float, default=520)
add_plan_options(cmd)
CLI.command("prepare", prepare, "GPU: convert the models only", results=False)
cmd = CLI.command("finish", finish, "CPU: the returned dir -> grid rows, decodes, validation", commit=True)
cmd.add_argument("returned")
main = CLI.main

if __name__ == "__main__":
    sys.exit(main())

"""Verify-step costs of Qwen2.5-shaped targets from 0.5B to 32B inside vLLM 0.26 (CUDA graphs, random weights), as a
function of the verify width, the context length and the batch: the measurement behind docs/seed-scale.md (#41).

No weights travel: vLLM builds each target from its config alone (`load_format="dummy"`), and timing does not
depend on the weights' values. Every step runs through hqlab's `gpu-lookup` speculator (or `gpu-fused` with the real
0.5B drafter), so a step is exactly what a served config runs: the speculator's drafting, vLLM's verify over
`width` positions a request, its rejection sampler and bookkeeping. Two devices make the width a free variable:
- one engine per shape captures a CUDA graph for every width at once: its `batch_k` table gives each width a batch
  size of its own (1:31/2:15/3:7/4:3/5:1/0, vLLM's dynamic speculative decoding), and before each point the
  benchmark sets vLLM's scheduler table and the speculator's to one width for every batch size. By default the
  engine core runs in its own process with asynchronous scheduling, as in the served and benchmarked engines
  (`--engine process`), and the benchmark sets the width through the plugin's engine-core utility
  (`plugin.set_width`); `--engine inprocess` runs it in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the
  method of run s2, whose per-call times price host-bound small steps slow (docs/seed-scale.md);
- the benchmark-only fault `reject_all_drafts` (hqlab.engines.vllm.fault) keeps one token a request a step, so all
  requests advance in lockstep whatever random weights make the lookup propose.
The requests of a point share one prompt of `context` random tokens, computed once (prefix caching): the KV cache
holds it once, and each request's attention still reads all of it, as distinct prompts of that length would.

  GPU (through tools/gpu_host/vllm_host.py run; results saved after every point, a later call with the same tag
  skips the (shape, config) pairs already done; `python benchmarks/vllm_step_cost.py host run --tag s1 ...` prints
  the call with its commit):
      python3 benchmarks/vllm_step_cost.py run --tag s1 --commit $(git rev-parse --short HEAD) --budget-s 560
    --contexts/--batches/--widths measure only those points (a validation's: benchmarks/seed_scale_validation.py runs
    this grid at the points it prices, then the decodes it predicts, on one machine); --temperature 0.7 prices sampling
    --base DIR takes the shapes' config and tokenizer from DIR (written here by `python benchmarks/vllm_step_cost.py
    base DIR` and carried with the call: the host then needs only vLLM, no converted model)
  CPU (here): python benchmarks/vllm_step_cost.py finish RETURNED_DIR   -> data/results/seed_scale/<tag>/grid.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

from hqlab.bench import runner  # noqa: E402  (standard library only: the host has no polars)
from hqlab.bench.runner import log  # noqa: E402

from hqlab.bench.step_cost import (BATCHES, CONTEXTS, DRAFTER, MEASURED_STEPS, SHAPES, TOKENIZER_FROM,  # noqa: E402
                                   WARM_STEPS, WIDTHS, grid_rows, measured_points, point_row, points, round_schedule)

SCRIPT = "benchmarks/vllm_step_cost.py"
K = 31
LADDER = "1:31/2:15/3:7/4:3/5:1/0"  # a batch size per width, so vLLM captures every width's graphs
FUSED_LADDER = "1:31/2:15/3:7/4:3/1"  # ends at width 1, as when gpu-fused without device_skip took no width 0
LOOKUP = f"gpu-lookup:nmin=1,nmax=32,k={K},policy=earliest,batch_k={LADDER}"
# the served fused config (docs/serving.md) without device_skip: with random weights the lookup matches the
# model's degenerate output, and device_skip would then skip the very drafter pass being measured
FUSED = (f"gpu-fused:k={K},draft_block=1,model={DRAFTER},nmax=32,policy=earliest,compile=true,schedule=long,"
         f"nmin_tail=1,compile_rule=true,layers=triton,attention=triton,batch_k={FUSED_LADDER}")
# (shape, quant, config) in the order they run: the validation shapes first, then the large ones
PLAN = [("qwen2.5-0.5b", "bf16", "gpu-lookup"), ("qwen2.5-1.5b", "bf16", "gpu-lookup"),
        ("qwen2.5-1.5b", "bf16", "gpu-fused"), ("qwen2.5-7b", "bf16", "gpu-lookup"),
        ("qwen2.5-27b", "bf16", "gpu-lookup"), ("qwen2.5-32b", "bf16", "gpu-lookup"),
        ("qwen2.5-14b", "bf16", "gpu-lookup"), ("qwen2.5-27b", "fp8", "gpu-lookup"),
        ("qwen2.5-0.5b", "bf16", "none"), ("qwen2.5-1.5b", "bf16", "none")]
MAX_MODEL_LEN = max(CONTEXTS) + 64
ENGINES = ("process", "inprocess")
ENGINE_HELP = ("process: the engine core in its own process with asynchronous scheduling, as served (default); "
               "inprocess: in the benchmark's process (run s2's method)")


def int_list(text: str) -> tuple[int, ...]:
    """"1,16,32" -> (1, 16, 32): the --contexts/--batches/--widths options (empty: the plan's own)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers (got {text!r})") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1 (got {text!r})")
    return values


def point_options(args: argparse.Namespace) -> dict:
    """The point-set options of `run`/`one` as `points`' keywords."""
    return {"contexts": args.contexts or None, "batches": args.batches or None, "widths": args.widths or None}


def max_model_len(args: argparse.Namespace) -> int:
    """The engine's context limit: the largest context measured + a point's steps (one token each) + the widest
    verify, rounded up to 64."""
    contexts = args.contexts or CONTEXTS
    need = max(contexts) + WARM_STEPS + measured_steps(args) + 1 + max(args.widths or WIDTHS)
    return -(-need // 64) * 64


def measured_steps(args: argparse.Namespace) -> int:
    return getattr(args, "steps", None) or MEASURED_STEPS


def measured_rounds(args: argparse.Namespace) -> int:
    return getattr(args, "rounds", None) or 1


def check_base(base: str) -> Path:
    """`--base`'s folder, refused (naming what is missing) unless it holds TOKENIZER_FROM's config and tokenizer."""
    folder = Path(base)
    if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
        raise SystemExit(f"--base {folder}: needs config.json and tokenizer.json of {TOKENIZER_FROM} "
                         f"(python benchmarks/vllm_step_cost.py base {folder} writes them)")
    return folder


def model_folder(shape_name: str, work: Path, max_len: int = MAX_MODEL_LEN, base: str | None = None) -> str:
    """A folder vLLM can build the shape from: the tokenizer's files and a config.json with the shape's values,
    taken from `base` (a folder holding TOKENIZER_FROM's config.json and tokenizer files) or else from the converted
    TOKENIZER_FROM, which needs its weights on the host."""
    from hqlab import models

    source = check_base(base) if base else Path(models.prepare(TOKENIZER_FROM))
    folder = work / "models" / shape_name
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(SHAPES[shape_name])
    config["max_position_embeddings"] = max(int(config.get("max_position_embeddings", 0)), max_len)
    config.pop("sliding_window", None)
    config.pop("layer_types", None)  # the base model's per-layer list: its length is the base's depth
    config["max_window_layers"] = SHAPES[shape_name]["num_hidden_layers"]
    config["use_sliding_window"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "generation_config", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return str(folder)


BASE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_base(args: argparse.Namespace) -> int:
    """CPU: the folder `--base` reads, from this machine's converted TOKENIZER_FROM (converted on first use), so a
    GPU host that has vLLM but no model can build every shape: carry it with the call."""
    from hqlab import models

    source = Path(models.prepare(args.source))
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in BASE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    log(f"{folder}: {', '.join(sorted(f.name for f in folder.iterdir()))} from {args.source}")
    return 0


def one(args: argparse.Namespace) -> int:
    """One (shape, quant, config): build the engine, measure every point, append rows."""
    if args.engine == "inprocess":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler and the worker live in this process
    import numpy as np
    from vllm import EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    from hqlab import models
    from hqlab.engines.vllm import plugin
    from hqlab.engines.vllm.serving import engine_configs
    from hqlab.provenance import machine_description, package_version

    work, rows_path = Path(args.work), Path(args.rows)
    config = args.config
    spec = {"gpu-lookup": LOOKUP, "gpu-fused": FUSED, "none": None}[config]
    if config == "gpu-fused":
        models.prepare(DRAFTER)
    chosen = points(config, args.shape, **point_options(args))
    if not [p for p in chosen if p not in measured_points(rows_path, args.shape, args.quant, config)]:
        log(f"{args.shape} {args.quant} {config}: every point measured already")
        return 0
    max_len = max_model_len(args)
    folder = model_folder(args.shape, work, max_len, base=args.base)
    # `none`: no speculator, so no fault either (every step emits the one token it verifies)
    speculative, extra = engine_configs(spec, planted_fault="reject_all_drafts") if spec else (None, {})
    capture = sorted({b * w for b in BATCHES for w in WIDTHS} | {1 << i for i in range(11)})
    plugin.check_vllm_version()
    plugin.register()
    t0 = time.perf_counter()
    # gpu-fused's drafter allocates its own cache after vLLM has taken its share: on an 80 GB card 0.88 left it none
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=folder, load_format="dummy", dtype="bfloat16", max_model_len=max_len, max_num_seqs=max(BATCHES),
        gpu_memory_utilization=0.88 if config == "gpu-lookup" else 0.75, enable_prefix_caching=True, seed=0,
        speculative_config=speculative,
        additional_config=extra, compilation_config={"cudagraph_capture_sizes": capture},
        max_num_batched_tokens=8192, **({"quantization": "fp8"} if args.quant == "fp8" else {})))
    start_s = time.perf_counter() - t0
    log(f"{args.shape} {args.quant} {config}: engine ready in {start_s:.0f} s")

    def set_width(width: int) -> None:  # verify `width` positions a request: width - 1 drafts
        if spec is None:  # `none` verifies one position a request, always
            return
        if args.engine == "inprocess":  # InprocClient -> EngineCore, in this process
            plugin.set_width(engine.engine_core.engine_core, width - 1)
        else:  # the engine core's own process, through vLLM's utility call
            engine.engine_core.call_utility(plugin.WIDTH_UTILITY, width - 1)

    machine, version = machine_description(vllm=True), package_version("vllm")
    counter = 0
    prompt_of: dict[int, list[int]] = {}

    def run(prompt: list[int], batch: int, max_tokens: int) -> list[float]:
        nonlocal counter
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        for _ in range(batch):
            counter += 1
            engine.add_request(f"r{counter}", TokensPrompt(prompt_token_ids=prompt), params)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    done = measured_points(rows_path, args.shape, args.quant, config)
    todo = [p for p in chosen if p not in done]
    if done:
        log(f"  {len(done)} points measured by an earlier call, {len(todo)} left")
    rounds = measured_rounds(args)
    schedule = round_schedule(todo, measured_steps(args), rounds)
    timed: dict[tuple[int, int, int], list[float]] = {point: [] for point in todo}
    failed: set[tuple[int, int, int]] = set()
    for r, point, steps in schedule:
        context, batch, width = point
        if point in failed:
            continue
        if context not in prompt_of:
            rng = np.random.default_rng(context)
            prompt_of[context] = rng.integers(1000, 150000, size=context).tolist()
            t = time.perf_counter()
            run(prompt_of[context], 1, 1)  # the prefill, kept by the prefix cache for every point of this context
            log(f"  context {context}: prefilled in {time.perf_counter() - t:.1f} s")
        set_width(width)
        try:
            times = run(prompt_of[context], batch, WARM_STEPS + steps + 1)
        except Exception as e:  # e.g. out of KV cache: the point is absent, the rest still runs
            log(f"  c={context} b={batch} w={width}: FAILED {type(e).__name__}: {e}")
            failed.add(point)
            continue
        timed[point] += times[WARM_STEPS:-1] or times
        if r + 1 < rounds:
            continue
        # the point's last round: its row, written at once (a call cut short keeps every finished point)
        row = point_row(args, config, width, context, batch, timed[point], start_s, machine, version, rounds=rounds)
        runner.append_jsonl(rows_path, row)
        log(f"  c={context} b={batch} w={width}: {row['step_ms']:.2f} ms "
            f"(mean {row['step_ms_mean']:.2f}, p10 {row['step_ms_p10']:.2f}, p90 {row['step_ms_p90']:.2f}, "
            f"{row['steps']} steps{f' in {rounds} rounds' if rounds > 1 else ''})")
    return 0


def point_argv(args: argparse.Namespace) -> list[str]:
    """The point-set options of `run`, passed on to each `one`."""
    return [f"--{name}={','.join(map(str, values))}" for name in ("contexts", "batches", "widths")
            if (values := getattr(args, name))] + ([f"--steps={args.steps}"] if getattr(args, "steps", None) else []) \
        + ([f"--rounds={args.rounds}"] if measured_rounds(args) > 1 else []) \
        + ([f"--base={args.base}"] if getattr(args, "base", None) else []) \
        + ([f"--temperature={args.temperature}"] if getattr(args, "temperature", 0) else [])


def run_all(args: argparse.Namespace) -> int:
    work = Path(args.work or Path(tempfile.gettempdir()) / "hqlab-step-cost" / args.tag)
    work.mkdir(parents=True, exist_ok=True)
    out = runner.out_dir(work / "out")
    rows = work / f"seed_scale_{args.tag}.jsonl"
    done_file = work / "done.txt"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    plan = [p for p in PLAN if not args.only or f"{p[0]}:{p[1]}:{p[2]}" in args.only or p[0] in args.only]
    for shape, quant, config in plan:
        key = f"{shape}:{quant}:{config}"
        if key in done:
            log(f"{key}: done in an earlier call, skipped")
            continue
        left = args.budget.left()
        if left < args.min_left_s:
            log(f"{key}: {left:.0f} s left of the budget, not started")
            break
        log(f"{key}: starting ({left:.0f} s left)")
        cmd = [sys.executable, __file__, "one", "--shape", shape, "--quant", quant, "--config", config,
               "--tag", args.tag, "--commit", args.commit, "--work", str(work), "--rows", str(rows),
               "--engine", args.engine, *point_argv(args)]
        rc = runner.run_bounded(cmd, max(30.0, left - 5))
        if rc == 0:
            with open(done_file, "a") as f:
                f.write(key + "\n")
        else:
            log(f"{key}: exited {rc}")
        runner.copy_out([rows], out)
    return 0


def finish(args: argparse.Namespace) -> int:
    for tag in grid_rows(args.returned):
        finish_run(args.returned, tag, args.results)
    return 0


def finish_run(returned: str | Path, tag: str, root: str | Path | None = None, *, script: str = SCRIPT,
               tables: dict | None = None, files: dict | None = None, info: dict | None = None) -> Path:
    """Run `tag`'s returned grid rows -> data/results/seed_scale/<tag>/grid.parquet, with its raw rows and log
    (hqlab.bench.results.write_run); a validation (`script`) adds what it measured beside the grid (`tables`,
    `files`, `info`). Step costs of two cards never mix in one run. Returns the run's folder."""
    from hqlab.bench import results

    src = Path(returned)
    grid = grid_rows(src)[tag]
    cards = sorted({results.card_of(m) for m in grid["machine"]})
    if len(cards) != 1:
        raise SystemExit(f"run {tag}'s rows under {src} come from {len(cards)} kinds of card ({cards}): step costs "
                         "of different cards never share a run")
    raw = {"grid.jsonl": src / f"seed_scale_{tag}.jsonl"} if (src / f"seed_scale_{tag}.jsonl").exists() else {}
    folder = runner.finish_run("seed_scale", tag, card=cards[0], script=script, tables={"grid": grid} | (tables or {}),
                               files=raw | (files or {}), logs=runner.returned_logs(src, tag), log_of="benchmarks/",
                               info={"commit": grid["git_commit"][0]} | (info or {}), root=root)
    print(f"{grid.height} grid rows of run {tag} -> {folder}")
    return folder


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def add_point_options(parser: argparse.ArgumentParser) -> None:
    for name, what in (("contexts", "contexts"), ("batches", "batches"), ("widths", "verify widths")):
        parser.add_argument(f"--{name}", type=int_list, default=(),
                            help=f"comma-separated {what} to measure instead of the plan's (e.g. a validation's)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"steps timed per point after {WARM_STEPS} warm-up steps (default {MEASURED_STEPS})")
    parser.add_argument("--base", default=None,
                        help=f"a folder with {TOKENIZER_FROM}'s config.json and tokenizer files: random-weight shapes "
                        "then need no model converted on the host (only vLLM)")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="time each point's steps in this many passes over all points (default 1: one burst a "
                        "point; each pass pays its own warm-up steps)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (0: greedy)")


CLI = runner.Benchmark(SCRIPT, __doc__)
cmd = CLI.gpu("run", run_all, "GPU host: every (shape, config) of the plan, one process each", budget_s=560,
              check=lambda args, parser: check_base(args.base) if args.base else None)  # before any engine starts
cmd.add_argument("--min-left-s", type=float, default=90, help="start no shape with less time left")
cmd.add_argument("--only", action="append", default=[], help="shape or shape:quant:config to run (default all)")
cmd.add_argument("--work", default=None)
cmd.add_argument("--engine", choices=ENGINES, default="process", help=ENGINE_HELP)
add_point_options(cmd)
cmd = CLI.gpu("one", one, "one (shape, quant, config) in this process (run starts these)")
cmd.add_argument("--shape", choices=sorted(SHAPES), required=True)
cmd.add_argument("--quant", choices=("bf16", "fp8"), default="bf16")
cmd.add_argument("--config", choices=("gpu-lookup", "gpu-fused", "none"), default="gpu-lookup")
cmd.add_argument("--work", required=True)
cmd.add_argument("--rows", required=True)
cmd.add_argument("--engine", choices=ENGINES, default="process", help=ENGINE_HELP)
add_point_options(cmd)
cmd = CLI.command("finish", finish, "CPU: the returned rows -> data/results/seed_scale/<tag>/grid.parquet")
cmd.add_argument("returned")
cmd = CLI.command("base", write_base, f"CPU: write the folder --base reads ({TOKENIZER_FROM}'s config and tokenizer)",
                  results=False)
cmd.add_argument("folder")
cmd.add_argument("--source", default=TOKENIZER_FROM,
                 help="the model whose files to copy (default %(default)s, what the committed grids were built "
                      "from; any Qwen2.5 of the same tokenizer builds the same shapes)")
main = CLI.main

if __name__ == "__main__":
    sys.exit(main())

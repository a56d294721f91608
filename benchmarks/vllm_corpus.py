"""The gpu-lookup corpus inside vLLM (#42): earlier requests' outputs as a GPU corpus, against the same lookup without
it and against no speculation, on the corpus workloads and prose, one request at a time and 8 in flight.

  GPU (an offline host, through tools/gpu_host/vllm_host.py run, which installs vLLM and the models first;
  `python benchmarks/vllm_corpus.py host bench --tag c1 [--plan ...]` prints the call with its commit):
      python3 tools/gpu_host/vllm_host.py run --log vllm_corpus_c1.log -- \\
          python3 benchmarks/vllm_corpus.py bench --tag c1 --commit COMMIT
    (on a CUDA machine with vLLM 0.26.0 and hqlab installed: python3 benchmarks/vllm_corpus.py bench --tag c1)
    writes $OUT/vllm_corpus_<tag>.parquet (one row per request of every point measured, rewritten after every
    point) and $OUT/vllm_corpus_<tag>.json (machine, versions, settings, the plan, what vLLM chose per engine);
    with --profile also $OUT/vllm_corpus_<tag>.phases.parquet (the worker's timed calls, `worker.StepTimer`).
  CPU (here):
      python benchmarks/vllm_corpus.py finish RETURNED/vllm_corpus_c1.parquet --run c1
    puts the run in place, data/results/corpus/<run>/ (hqlab.bench.results): rows.parquet (one row per point:
    decode tok/s, tokens/step, the ratios to the same lookup without the corpus and to `none`, greedy outputs
    against `none`, the replay's exactness), requests.parquet (one row per request: config, workload, load, repeat,
    request order, corpus insertion number, prompt and output ids, per-step history length, corpus documents,
    emitted and accepted counts), the raw .json and the call's log. Where a .phases.parquet lies beside the raw
    file, also phases.parquet and admissions.parquet (per point, the steps that admit a request against those
    that only decode: `hqlab.bench.engine_steps`).
  Plan only (CPU, no vLLM engine): python benchmarks/vllm_corpus.py bench --tag c1 --dry-run

What runs. Three engines of Qwen2.5-Coder-1.5B-Instruct (`hqlab.models.prepare("qwen2.5-coder-1.5b")`), one per
config, started together and alive at once (`hqlab.engines.vllm.startup`): `none`, BASE and BASE with the corpus
(CORPUS_KEYS). A point is (config, workload, load, repeat): the first --requests (REQUESTS: load 1 one at a time, load
8 kept in flight as a closed loop) requests of a workload in file order, each its messages with
the chat template applied, greedy, 256 new tokens; the corpus is emptied before each point, so every point starts
from nothing and its corpus holds only that point's earlier outputs. Points run repeat by repeat, workload by
workload, the three configs of a (workload, load) back to back with the first rotating, so the ratios compare runs
seconds apart. --budget-s bounds the whole call (engine starts included): a point starts only if the time its
(config, workload, load) took before (or the estimate) still fits, and the raw file is rewritten after each point.

Why these corpus keys: corpus_policy=longest (with nmin=1 the request's own history almost always holds a one-token
match, so under "own" the corpus would seldom be asked); corpus_prompts=1 (the agent's requests repeat earlier tool
results, which are in prompts). Replayed over the 0.5B's greedy traces (data/results/traces/0.5b_corpus_128/, first
10 requests one at a time), tokens/step without the corpus / longest / longest with prompts: multiturn 2.05 / 2.25 /
2.25, template 2.29 / 3.38 / 3.41, agent 2.46 / 2.46 / 3.04. 32,768 tokens hold every document of a point.

Measured per point: decode tok/s = output tokens after the first / the time after the first token, summed over the
requests (load 1); output tokens / wall time (load 8, a throughput). tokens/step = tokens vLLM emitted per verify
step. The per-step records of the speculator (history length, corpus documents seen, drafted tokens, source) go with
each request, and `finish` replays the corpus rule over them (`hqlab.bench.corpus_check`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host (hqlab is not importable before this)

from hqlab.bench import runner  # noqa: E402  (standard library only: the host has no polars)
from hqlab.bench.corpus_runs import Request, owner, plan_points, read_workload, request_counts  # noqa: E402
from hqlab.bench.runner import log  # noqa: E402

SCRIPT = "benchmarks/vllm_corpus.py"
BASE = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
CORPUS_KEYS = "corpus=32768,corpus_policy=longest,corpus_prompts=1"
CONFIGS = ("none", BASE, f"{BASE},{CORPUS_KEYS}")
WORKLOADS = ("data/workloads/corpus_multiturn.jsonl", "data/workloads/corpus_template.jsonl",
             "data/workloads/corpus_agent.jsonl", "data/workloads/prose.jsonl")
LOADS = (1, 8)
# Requests per point, in file order: LOAD=N for every workload, STEM:LOAD=N for one. The corpus workloads are written
# in waves of 8 (every session's turn t, then turn t + 1): 10 one at a time reach into the second wave, 16 with 8 in
# flight are two waves. Prose (no reuse to find, only the >= 0.97x check) gets fewer to keep the call in budget:
# with `none`'s speed everywhere the plan is an upper bound of ~370 s; at the speedups the lookup reached before
# (~1.6x at batch 1) it is ~300 s, and --budget-s cuts the tail of the last repeat if it runs longer.
REQUESTS = ("1=10", "8=16", "prose:1=6")
MODEL = "qwen2.5-coder-1.5b"
MAX_NEW_TOKENS = 256
# What the plan assumes before a point has run (H200, 1.5B): decode rates of `none` (speculation only speeds it up)
# and a start-up for the three engines built together.
EST_TOK_S = {1: 400.0, 8: 2000.0}
EST_START_S = 150.0


def estimate_s(n_requests: int, load: int) -> float:
    return n_requests * MAX_NEW_TOKENS / EST_TOK_S[load] + 0.05 * n_requests


def bench(args: argparse.Namespace) -> int:
    workloads = {}
    for path in args.workload or WORKLOADS:
        p = Path(path) if Path(path).is_absolute() else ROOT / path
        if not p.exists():
            raise SystemExit(f"{path}: no such workload (the corpus workloads come from the corpus-lab branch)")
        workloads[path] = read_workload(p)
    loads = tuple(args.load or LOADS)
    count = request_counts([*REQUESTS, *(args.requests or [])])
    configs = list(args.config or CONFIGS)
    if configs[0] != "none":
        configs = ["none", *[c for c in configs if c != "none"]]
    points = plan_points(list(workloads), configs, args.repeats, loads)

    def chosen(workload: str, load: int) -> list[Request]:
        n = count.get((Path(workload).stem, load), count.get((None, load)))
        if n is None:
            raise SystemExit(f"no request count for load {load}: add --requests {load}=N")
        return workloads[workload][:n]

    est = EST_START_S + sum(estimate_s(len(chosen(w, load)), load) for _, w, load, _ in points)
    log(f"plan: {len(configs)} engines ({', '.join(configs)}), {len(points)} points, repeats {args.repeats}, loads "
        f"{loads}; at most ~{est:.0f} s (`none`'s speed everywhere) (budget {args.budget_s:.0f} s)")
    for w, reqs in workloads.items():
        chars = [sum(len(c) for _, c in r.messages) for r in reqs]
        log(f"  {w}: {len(reqs)} requests in the file; load 1 runs {len(chosen(w, 1))}, load 8 runs "
            f"{len(chosen(w, 8))}; prompt chars {min(chars)}..{max(chars)}")
    if args.dry_run:
        for i, (r, w, load, config) in enumerate(points):
            log(f"  point {i}: repeat {r} {Path(w).stem} load {load} {config}")
        return 0
    return run_bench(args, workloads, configs, points, chosen)


def run_bench(args, workloads, configs, points, chosen) -> int:
    import vllm  # noqa: F401  (first: a missing wheel fails here, before the model converts)

    from hqlab import models, provenance
    from hqlab.config import ConfigError, DecodeConfig
    from hqlab.engines.vllm import startup
    from hqlab.engines.vllm.engine import VLLMEngine, VLLMOptions, records_from_workers, setting_for
    from hqlab.workloads import encode_chat

    machine = provenance.machine_description(vllm=True)  # before any CUDA call
    versions = {**provenance.versions(), "device": f"cuda ({machine.split(',')[0]})"}
    log(machine)
    folder = models.prepare(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = {}
    for w, reqs in workloads.items():
        for r in reqs:
            prompt_ids[(w, r.order)] = encode_chat(tokenizer, [{"role": a, "content": b} for a, b in r.messages])
    longest = max(len(v) for v in prompt_ids.values())
    max_model_len = max(4096, 1024 * -(-(longest + MAX_NEW_TOKENS + 64) // 1024))
    log(f"model {folder}; longest prompt {longest} tokens; max_model_len {max_model_len}")
    settings = [setting_for(c) for c in configs]
    options = VLLMOptions(model=folder, max_num_seqs=max(8, max(args.load or LOADS)), max_model_len=max_model_len,
                          gpu_memory_utilization=round(args.gpu_memory / len(settings), 3),
                          kv_cache_bytes=startup.PARALLEL_START_KV_BYTES,
                          max_cudagraph_capture_size=args.capture or 0,
                          **({"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode is not None else {}))
    decode = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS)
    out = runner.out_dir()
    raw_path, meta_path = out / f"vllm_corpus_{args.tag}.parquet", out / f"vllm_corpus_{args.tag}.json"
    phases_path = out / f"vllm_corpus_{args.tag}.phases.parquet"
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []  # with --profile: the worker's timed calls (`worker.StepTimer`), per point
    described: list[dict[str, Any]] = []
    meta = {"machine": machine, "versions": versions, "model": args.model, "max_new_tokens": MAX_NEW_TOKENS,
            "configs": configs, "repeats": args.repeats, "loads": list(args.load or LOADS), "commit": args.commit,
            "requests": [*REQUESTS, *(args.requests or [])], "budget_s": args.budget_s,
            "points_planned": len(points), "points_done": 0, "stopped": "", "failed": {}, "engines": described,
            "capture": args.capture or 0, "cudagraph_mode": options.cudagraph_mode, "profile": bool(args.profile)}

    def save() -> None:
        for path, table in ((raw_path, rows), (phases_path, phases)):
            if table:
                runner.save_table(path, table)
        runner.save_json(meta_path, meta)

    class RecordingEngine(VLLMEngine):
        """Keeps the speculator's raw step records (with the corpus's fields), which `generate` turns into
        StepRecords without them."""

        raw: list[dict[str, Any]]

        def take_adapter_records(self) -> list[dict[str, Any]]:
            got = super().take_adapter_records()
            self.__dict__.setdefault("raw", []).extend(got)
            return got

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engines: list[Any] = []
    try:
        try:
            startup.check_parallel_start_environment()
            startup.prepare_parallel_start(options, settings)
            engines = startup.start_engines_together(
                settings, lambda s: RecordingEngine(options, s, started_together=True))
        except (ConfigError, RuntimeError, OSError) as e:  # start them one after another instead
            log(f"starting the engines together failed ({type(e).__name__}: {e}); one after another")
            engines = [RecordingEngine(options, s) for s in settings]
        for engine in engines:
            described.append(engine.describe())
            first = next(iter(prompt_ids.values()))
            engine.generate(first, decode=DecodeConfig(max_new_tokens=32), request="warmup")
        log(f"engines ready at {args.budget.spent():.0f} s: " + "; ".join(
            f"{d['config']} runner {d['model_runner']} async {d['async_scheduling']}" for d in described))
        save()
        took: dict[tuple, float] = {}
        by_label = {e.setting.label: e for e in engines}
        for i, (repeat, workload, load, config) in enumerate(points):
            reqs = chosen(workload, load)
            expect = took.get((config, workload, load), estimate_s(len(reqs), load))
            if not args.budget.fits(expect):
                meta["stopped"] = f"budget: point {i} of {len(points)} would end past {args.budget_s:.0f} s"
                log(meta["stopped"])
                break
            if config in meta["failed"]:
                continue
            engine = by_label[config]
            t = time.time()
            try:
                got, timed = run_point(engine, reqs, [prompt_ids[(workload, r.order)] for r in reqs], load, decode,
                                       records_from_workers, profile=args.profile)
            except Exception as e:  # noqa: BLE001 - one config failing must not lose the others' points
                import traceback

                traceback.print_exc()
                meta["failed"][config] = f"point {i}: {type(e).__name__}: {e}"
                log(f"{config} FAILED at point {i} ({type(e).__name__}: {e}); its later points are skipped")
                save()
                continue
            took[(config, workload, load)] = time.time() - t
            for row in got:
                row.update(config=config, workload_file=workload, load=load, repeat=repeat, point=i)
            rows.extend(got)
            phases.extend({**call, "config": config, "workload_file": workload, "load": load, "repeat": repeat,
                           "point": i} for call in timed)
            meta["points_done"] = i + 1
            save()
            toks = sum(len(r["output_ids"]) for r in got)
            steps = sum(len(json.loads(r["steps"])) for r in got)
            log(f"point {i + 1}/{len(points)} repeat {repeat} {Path(workload).stem} load {load} {config}: "
                f"{took[(config, workload, load)]:.1f} s, {toks} tokens, {toks / max(steps, 1):.2f} tokens/step "
                f"(elapsed {args.budget.spent():.0f} s)")
    finally:
        for engine in engines:
            engine.close()
        save()
    return 1 if meta["failed"] else 0


def run_point(engine, reqs, prompts, load, decode, records_from_workers, *, profile: bool = False):
    """One point on one engine, its corpus emptied first: (one row per request, the worker's timed calls). With
    `profile` the worker times every call of the model runner's phases during the point (`worker.StepTimer`, with
    each step's scheduled tokens and admitted and finished requests); else the second list is empty."""
    vllm_engine = engine.engine
    vllm_engine.collective_rpc("hqlab_corpus_reset")
    if engine.setting.uses_adapter:
        engine.take_adapter_records()
    engine.raw = []
    records_from_workers(vllm_engine.collective_rpc("hqlab_take_corpus_log"))  # nothing from before the reset
    if profile and not vllm_engine.collective_rpc("hqlab_profile_start")[0]:
        raise RuntimeError("--profile: the worker has no model runner to time")
    t0 = time.perf_counter()
    if load == 1:
        gens, rids = [], []
        for r, ids in zip(reqs, prompts):
            gens.append(engine.generate(ids, decode=decode, request=r.name))
            rids.append(f"{r.name}-{engine._counter}")
    else:
        gens, _ = engine.generate_concurrent(prompts, decode, [r.name for r in reqs], in_flight=load)
        rids = [f"{r.name}-{engine._counter}-{i}" for i, r in enumerate(reqs)]
    wall = time.perf_counter() - t0
    timed = vllm_engine.collective_rpc("hqlab_profile_stop")[0] if profile else []
    corpus_log = records_from_workers(vllm_engine.collective_rpc("hqlab_take_corpus_log"))
    seq_of = {}
    for entry in corpus_log:
        rid = owner(str(entry["request"]), rids)
        if rid is not None:
            seq_of[rid] = entry
    raw: dict[tuple[str, int], dict] = {}
    for rec in getattr(engine, "raw", []):
        rid = owner(str(rec.get("request", "")), rids)
        if rid is not None and "context_len" in rec:
            raw[(rid, int(rec["context_len"]))] = rec
    rows = []
    for r, ids, g, rid in zip(reqs, prompts, gens, rids):
        steps = []
        for s in g.records:
            history = s.context_len + 1  # StepRecord.context_len is the history length - 1
            made = raw.get((rid, history), {})
            steps.append({"context_len": history, "emitted": s.emitted, "accepted": s.accepted,
                          "corpus_docs": int(made.get("corpus_docs", -1)),
                          "drafted": made.get("tokens") if made else None, "source": made.get("source", ""),
                          "match_len": int(made.get("match_len", -1)), "t_end": s.t_end})
        entry = seq_of.get(rid, {})
        rows.append({"workload": r.workload, "order": r.order, "session": r.session, "turn": r.turn,
                     "request": r.name, "vllm_request": rid, "prompt_ids": list(ids), "output_ids": list(g.output_ids),
                     "finish": g.finish, "ttft_s": g.ttft_s, "total_s": g.total_s, "t_last": g.t_last,
                     "corpus_seq": int(entry.get("seq", -1)), "corpus_doc_len": int(entry.get("length", -1)),
                     "corpus_output_len": int(entry.get("output_len", -1)), "point_wall_s": wall,
                     "steps": json.dumps(steps)})
    return rows, timed


def finish(args: argparse.Namespace) -> int:
    """One run's raw files -> data/results/corpus/<run>/ (hqlab.bench.results.write_run)."""
    from hqlab.bench import results
    from hqlab.bench.corpus_runs import returned_run

    tables, meta, files = returned_run(args.raw, args.run, commit=args.commit, model=MODEL)
    points = tables["rows"]
    machine = points["device"][0]
    card = args.card or (results.card_of(machine) if machine else None)
    if card is None:
        raise SystemExit(f"no machine named beside {args.raw[0]} (its .json): give --card")
    folder = runner.finish_run(
        "corpus", args.run, card=card, script=SCRIPT, tables=tables, files=files, root=args.results,
        logs={p for raw_path in args.raw for p in runner.returned_logs(Path(raw_path).parent, args.run)},
        info={"commit": points["git_commit"][0], "plan": runner.plan_path("corpus", args.run),
              "vllm_runner": runner.vllm_runners(e.get("model_runner") for e in meta.get("engines") or [])})
    summary(points)
    print(f"wrote run {args.run}: {points.height} points, {tables['requests'].height} requests -> {folder}")
    return 0


def summary(points: Any) -> None:
    """Medians over repeats: decode tok/s per config, the corpus's ratio to the lookup without it, exactness."""
    import polars as pl

    table = (points.group_by("workload", "load", "config")
             .agg(pl.col("decode_tok_s").median(), pl.col("tokens_per_step").median(),
                  pl.col("vs_no_corpus").median(), pl.col("vs_none").median(), pl.col("greedy_equal_none").all(),
                  pl.col("replay_exact").all() if "replay_exact" in points.columns else pl.lit(None))
             .sort("workload", "load", "config"))
    with pl.Config(tbl_rows=100, tbl_cols=20, fmt_str_lengths=60, tbl_width_chars=200):
        print(table)


def check_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    request_counts([*REQUESTS, *(args.requests or [])])  # a malformed --requests fails here, not on the host
    if args.repeats < 2 and not args.dry_run:
        log("note: fewer than 2 repeats")


CLI = runner.Benchmark(SCRIPT, __doc__)
cmd = CLI.gpu("bench", bench, "GPU: every point on three engines, raw rows into $OUT", budget_s=None,
              plan={"configs": "config", "workloads": "workload", "loads": "load", "requests": "requests",
                    "repeats": "repeats", "budget_s": "budget_s", "capture": "capture", "profile": "profile",
                    "cudagraph_mode": "cudagraph_mode"},
              lists=("configs", "workloads", "loads", "requests"), defaults={"repeats": 2, "budget_s": 330.0},
              check=check_bench)
cmd.add_argument("--model", default=MODEL)
cmd.add_argument("--config", action="append", default=None, help=f"a config (repeatable; default {CONFIGS})")
cmd.add_argument("--workload", action="append", default=None, help=f"a JSONL workload (default {WORKLOADS})")
cmd.add_argument("--load", action="append", type=int, default=None, help="requests in flight (default 1 and 8)")
cmd.add_argument("--repeats", type=int, default=None, help="repeats of every point (default 2)")
cmd.add_argument("--requests", action="append", default=None,
                 help=f"requests per point in file order, LOAD=N or WORKLOAD:LOAD=N (repeatable; defaults {REQUESTS})")
cmd.add_argument("--gpu-memory", type=float, default=0.85, help="GPU memory fraction shared by the engines")
cmd.add_argument("--capture", type=int, default=None,
                 help="CUDA graphs for steps of up to this many tokens, every engine (default: the served configs', "
                      "hqlab.engines.vllm.serving.capture_size: max(1024, requests x (k + 1)))")
cmd.add_argument("--cudagraph-mode", default=None, help="vLLM's CUDA-graph mode, every engine (default: "
                 "hqlab.engines.vllm.serving.CUDAGRAPH_MODE; '' for vLLM's own)")
cmd.add_argument("--profile", action="store_true", default=None,
                 help="time the worker's phases during every point (worker.StepTimer) into "
                      "$OUT/vllm_corpus_<tag>.phases.parquet")
cmd.add_argument("--dry-run", action="store_true", help="print the plan, start no engine (CPU)")
cmd = CLI.command("finish", finish, "CPU: raw rows -> results and per-request parquets, with the replay check",
                  commit=True)
cmd.add_argument("raw", nargs="+")
cmd.add_argument("--run", required=True, help="name of this run (the bench call's tag)")
cmd.add_argument("--card", default=None, help="the card, where no .json beside the raw file names the machine")
main = CLI.main

if __name__ == "__main__":
    raise SystemExit(main())

"""The gpu-lookup corpus inside vLLM (#42): earlier requests' outputs as a GPU corpus, against the same lookup without
it and against no speculation, on the corpus workloads and prose, one request at a time and 8 in flight.

  GPU (an offline host, through tools/gpu_host/vllm_host.py run, which installs vLLM and the models first):
      python3 tools/gpu_host/vllm_host.py run --log vllm_corpus_c1.log -- \\
          python3 benchmarks/vllm_corpus.py bench --tag c1
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

Why these corpus keys: corpus_policy=longest, since with nmin=1 the request's own history almost always holds a
one-token match, so under "own" the corpus would seldom be asked; "longest" lets it win where its match is longer.
corpus_prompts=1: the agent's requests repeat earlier requests' tool results, which are in prompts, not outputs. A
replay of the rule over the 0.5B's greedy traces of these workloads (data/results/traces_0.5b_corpus_128.parquet,
128 new tokens, the first 10 requests one at a time) gave tokens/step, without the corpus -> longest -> longest
with prompts: multiturn 2.05 -> 2.25 -> 2.25, template 2.29 -> 3.38 -> 3.41, agent 2.46 -> 2.46 -> 3.04. 32,768
tokens hold every document of a point (16 requests of at most ~1,000 prompt and 256 output tokens).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host (hqlab is not importable before this)

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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Request:
    workload: str
    order: int  # position in the workload file
    session: str
    turn: int
    messages: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:  # no '-': vLLM's request ids append '-<n>' to it
        return f"{self.workload}.{self.order:03d}".replace("-", "_")


def read_workload(path: Path) -> list[Request]:
    """Requests in file order, read by hqlab's readers: a request log ({"workload", "session", "turn", "messages"}
    lines: `hqlab.workloads.read_requests`) or a prompt file ({"id", "prompt"} or {"turns"} lines, as
    data/workloads/prose.jsonl: `read_jsonl`, each prompt a session of one turn)."""
    from hqlab.workloads import WorkloadError, read_jsonl, read_requests

    first = next((line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()), "{}")
    try:
        if "messages" in json.loads(first):
            return [Request(r.workload, i, r.session, r.turn, tuple((m["role"], m["content"]) for m in r.messages))
                    for i, r in enumerate(read_requests(path))]
        return [Request(path.stem, i, p.id, 0, tuple((m["role"], m["content"]) for m in p.messages))
                for i, p in enumerate(read_jsonl(path))]
    except WorkloadError as e:
        raise SystemExit(str(e)) from None


def plan_points(workloads: list[str], configs: list[str], repeats: int, loads: tuple[int, ...]) -> list[tuple]:
    """(repeat, workload, load, config) in the order they run: repeat by repeat, so a call cut short keeps whole
    repeats; a (workload, load)'s configs back to back, the first rotating."""
    points = []
    for r in range(repeats):
        for w, workload in enumerate(workloads):
            for load in loads:
                shift = (r + w + load) % len(configs)
                points += [(r, workload, load, configs[(shift + j) % len(configs)]) for j in range(len(configs))]
    return points


def request_counts(specs: list[str]) -> dict[tuple[str | None, int], int]:
    """`REQUESTS`-style entries -> {(workload stem or None, load): requests}; later entries win."""
    out: dict[tuple[str | None, int], int] = {}
    for item in specs:
        where, _, n = item.partition("=")
        stem, _, load = where.rpartition(":")
        try:
            out[(stem or None, int(load))] = int(n)
        except ValueError:
            raise SystemExit(f"--requests {item!r}: expected LOAD=N or WORKLOAD:LOAD=N (e.g. 8=16, prose:1=6)")
        if int(n) < 1:
            raise SystemExit(f"--requests {item!r}: N must be >= 1")
    return out


def estimate_s(n_requests: int, load: int) -> float:
    return n_requests * MAX_NEW_TOKENS / EST_TOK_S[load] + 0.05 * n_requests


def owner(internal: str, rids: list[str]) -> str | None:
    """The request id we gave vLLM that its internal id `internal` belongs to (vLLM may append '-<suffix>')."""
    for rid in rids:
        if internal == rid or internal.startswith(rid + "-"):
            return rid
    return None


def bench(args: argparse.Namespace) -> int:
    t_start = time.time()
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
    return run_bench(args, workloads, configs, points, chosen, t_start)


def run_bench(args, workloads, configs, points, chosen, t_start) -> int:
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
                          max_cudagraph_capture_size=args.capture or 0)
    decode = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    raw_path, meta_path = out / f"vllm_corpus_{args.tag}.parquet", out / f"vllm_corpus_{args.tag}.json"
    phases_path = out / f"vllm_corpus_{args.tag}.phases.parquet"
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []  # with --profile: the worker's timed calls (`worker.StepTimer`), per point
    described: list[dict[str, Any]] = []
    meta = {"machine": machine, "versions": versions, "model": args.model, "max_new_tokens": MAX_NEW_TOKENS,
            "configs": configs, "repeats": args.repeats, "loads": list(args.load or LOADS),
            "requests": [*REQUESTS, *(args.requests or [])], "budget_s": args.budget_s,
            "points_planned": len(points), "points_done": 0, "stopped": "", "failed": {}, "engines": described,
            "capture": args.capture or 0, "profile": bool(args.profile)}

    def save() -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for path, table in ((raw_path, rows), (phases_path, phases)):
            if table:
                pq.write_table(pa.Table.from_pylist(table), str(path) + ".tmp")
                os.replace(str(path) + ".tmp", path)
        meta_path.with_suffix(".tmp").write_text(json.dumps(meta) + "\n")
        os.replace(meta_path.with_suffix(".tmp"), meta_path)

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
        log(f"engines ready at {time.time() - t_start:.0f} s: " + "; ".join(
            f"{d['config']} runner {d['model_runner']} async {d['async_scheduling']}" for d in described))
        save()
        took: dict[tuple, float] = {}
        by_label = {e.setting.label: e for e in engines}
        for i, (repeat, workload, load, config) in enumerate(points):
            reqs = chosen(workload, load)
            expect = took.get((config, workload, load), estimate_s(len(reqs), load))
            if time.time() - t_start + expect > args.budget_s:
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
                f"(elapsed {time.time() - t_start:.0f} s)")
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


# ----------------------------------------------------------------------------------------------------------------
# finish (CPU)


def check_rows(rows: list[dict[str, Any]], config: str) -> dict[str, Any]:
    """The replay of one point's requests (`hqlab.bench.corpus_check`); empty for `none`."""
    from hqlab.bench.corpus_check import RequestRun, Step, check_point
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    if config == "none":
        return {}
    c = lookup_config(config)
    runs = []
    problems = []
    for row in sorted(rows, key=lambda x: x["order"]):
        steps = json.loads(row["steps"])
        if c.corpus and row["corpus_seq"] >= 0:
            want = len(row["output_ids"]) + (len(row["prompt_ids"]) if c.corpus_prompts else 0)
            if row["corpus_doc_len"] != want:
                problems.append(f"{row['request']}: its corpus document had {row['corpus_doc_len']} tokens, its "
                                f"recorded ids make {want}")
        runs.append(RequestRun(row["request"], tuple(row["prompt_ids"]), tuple(row["output_ids"]),
                               int(row["corpus_seq"]) if c.corpus else -1,
                               tuple(Step(s["context_len"], max(s["corpus_docs"], 0), s["emitted"],
                                          None if s["drafted"] is None else tuple(s["drafted"])) for s in steps)))
    result = check_point(runs, nmin=c.nmin, nmax=c.nmax, k=c.k, policy=c.policy, search=c.search,
                         corpus=c.corpus_config)
    result.problems += problems
    return result.summary()


def without_corpus(config: str, labels: set[str]) -> str | None:
    """The label among `labels` of `config` without its corpus keys (None: `config` has no corpus, or none ran)."""
    from hqlab.config import parse_spec

    name, values = parse_spec(config)
    if not any(k.startswith("corpus") for k in values):
        return None
    want = (name, {k: v for k, v in values.items() if not k.startswith("corpus")})
    return next((label for label in sorted(labels) if label != "none" and parse_spec(label) == want), None)


SLOW_STEP = 3.0  # a step interval this many times the point's median is a slow one (an admission, a stall)


def step_intervals(steps_per_request: list[list[dict[str, Any]]]) -> dict[str, float]:
    """The point's step intervals as its requests saw them (from each request's parsed steps: the time between its
    consecutive steps on the front end's clock): their median in ms, the share of intervals over SLOW_STEP x that
    median, and the share of the requests' decode time those slow intervals took. With many requests in flight the
    slow ones come about once per request admitted (docs/corpus.md, "Where the time goes with 8 in flight")."""
    import numpy as np

    gaps = np.concatenate([np.diff([s["t_end"] for s in steps]) for steps in steps_per_request] or [np.zeros(0)])
    if gaps.size == 0:
        return {"step_ms_median": float("nan"), "slow_step_share": float("nan"), "slow_time_share": float("nan")}
    median = float(np.median(gaps))
    slow = gaps > SLOW_STEP * median
    return {"step_ms_median": 1e3 * median, "slow_step_share": float(slow.mean()),
            "slow_time_share": float(gaps[slow].sum() / gaps.sum()) if gaps.sum() > 0 else float("nan")}


def point_rows(raw: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    """One result row per (config, workload, load, repeat)."""
    from collections import defaultdict

    points: dict[tuple, list[dict]] = defaultdict(list)
    for row in raw:
        points[(row["config"], row["workload"], row["load"], row["repeat"])].append(row)
    none_out = {(w, load, rep, row["order"]): row["output_ids"] for (c, w, load, rep), rs in points.items()
                if c == "none" for row in rs}
    out = []
    for (config, workload, load, repeat), rs in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                                        kv[0][3], kv[0][0])):
        tokens = sum(len(r["output_ids"]) for r in rs)
        per_request = [json.loads(r["steps"]) for r in rs]
        steps = [s for request_steps in per_request for s in request_steps]
        if load == 1:
            span = sum(max(r["t_last"] - r["ttft_s"], 0.0) for r in rs)
            rate = sum(max(len(r["output_ids"]) - 1, 0) for r in rs) / span if span > 0 else float("nan")
        else:
            rate = tokens / rs[0]["point_wall_s"]
        diverged = []
        for r in rs:
            ref = none_out.get((workload, load, repeat, r["order"]))
            if ref is not None and list(ref) != list(r["output_ids"]):
                first = next((i for i, (a, b) in enumerate(zip(ref, r["output_ids"])) if a != b),
                             min(len(ref), len(r["output_ids"])))
                diverged.append(f"{r['request']}@{first}")
        row = {"run": run, "config": config, "workload": workload, "load": load, "repeat": repeat,
               "requests": len(rs), "output_tokens": tokens, "wall_s": rs[0]["point_wall_s"], "decode_tok_s": rate,
               "tokens_per_step": sum(s["emitted"] for s in steps) / len(steps) if steps else float("nan"),
               "corpus_step_share": (sum(s["source"] == "corpus" for s in steps) / len(steps)) if steps else 0.0,
               "greedy_equal_none": not diverged, "diverged": ", ".join(diverged)}
        row.update(step_intervals(per_request))
        row.update(check_rows(rs, config))
        out.append(row)
    rate_of = {(r["config"], r["workload"], r["load"], r["repeat"]): r["decode_tok_s"] for r in out}
    labels = {r["config"] for r in out}
    for r in out:
        key = (r["workload"], r["load"], r["repeat"])
        base = without_corpus(r["config"], labels)
        r["vs_none"] = r["decode_tok_s"] / rate_of.get(("none", *key), float("nan"))
        r["vs_no_corpus"] = r["decode_tok_s"] / rate_of.get((base, *key), float("nan")) if base else float("nan")
    return out


def finish(args: argparse.Namespace) -> int:
    """One run's raw files -> data/results/corpus/<run>/ (hqlab.bench.results.write_run)."""
    import polars as pl
    import pyarrow.parquet as pq

    from hqlab import provenance
    from hqlab.bench import results

    raw: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    files: dict[str, Path] = {}
    for path in map(Path, args.raw):
        raw += pq.read_table(path).to_pylist()
        if path.with_suffix(".json").exists():
            meta = json.loads(path.with_suffix(".json").read_text())
            files["raw.json"] = path.with_suffix(".json")
    if not raw:
        raise SystemExit("no requests in the raw files")
    points = pl.DataFrame(point_rows(raw, args.run), infer_schema_length=None)
    versions = meta.get("versions", {})
    machine = str(versions.get("device", meta.get("machine", "")))
    points = points.with_columns(pl.lit(args.commit or provenance.git_commit()).alias("git_commit"),
                                 pl.lit(str(versions.get("vllm"))).alias("vllm"),
                                 pl.lit(machine).alias("device"),
                                 pl.lit(meta.get("model", MODEL)).alias("model"))
    engines = meta.get("engines") or []  # what vLLM chose per engine (model runner, scheduling, CUDA graphs)
    if engines:
        chosen = pl.DataFrame([{"config": e["config"], "vllm_runner": str(e.get("model_runner", "")).upper(),
                                "async_scheduling": e.get("async_scheduling"),
                                "cudagraph_mode": e.get("cudagraph_mode")} for e in engines])
        points = points.join(chosen, on="config", how="left")
    requests = pl.DataFrame([{**{k: v for k, v in r.items() if k != "steps"}, "run": args.run,
                              **_step_columns(json.loads(r["steps"]))} for r in raw], infer_schema_length=None)
    tables = {"rows": points, "requests": requests}
    timed = [p for p in (Path(raw_path).with_suffix(".phases.parquet") for raw_path in args.raw) if p.exists()]
    if timed:  # the profiled points' steps that admit a request against those that only decode
        phases = pl.concat([pl.read_parquet(p) for p in timed], how="diagonal_relaxed")
        tables |= {"phases": phases, "admissions": admissions_table(phases, args.run)}
    returned = {p for raw_path in args.raw for p in results.logs_of(Path(raw_path).parent, args.run)}
    logs, info = results.run_logs(returned, "benchmarks/vllm_corpus.py")
    card = args.card or (results.card_of(machine) if machine else None)
    if card is None:
        raise SystemExit(f"no machine named beside {args.raw[0]} (its .json): give --card")
    plan = ROOT / "benchmarks" / "plans" / f"corpus_{args.run}.json"
    info |= {"commit": args.commit or provenance.git_commit(), "benchmark": "benchmarks/vllm_corpus.py",
             "plan": str(plan.relative_to(ROOT)) if plan.exists() else None,
             "vllm_runner": sorted({str(e.get("model_runner") or "").upper() for e in engines} - {""}) or None}
    folder = results.write_run("corpus", args.run, card=card, tables=tables, files=files | logs, info=info,
                               root=args.results)
    summary(points)
    print(f"wrote run {args.run}: {points.height} points, {requests.height} requests -> {folder}")
    return 0


def admissions_table(phases: Any, run: str) -> Any:
    """A `--profile` run's timed calls -> one row per point: its steps that admit a request against those that only
    decode (`hqlab.bench.engine_steps.admissions`), tagged with the run."""
    import polars as pl

    from hqlab.bench.engine_steps import admissions, engine_steps

    return admissions(engine_steps(phases)).with_columns(pl.lit(run).alias("run"))


def _step_columns(steps: list[dict[str, Any]]) -> dict[str, list]:
    return {"step_context_len": [s["context_len"] for s in steps],
            "step_corpus_docs": [s["corpus_docs"] for s in steps],
            "step_emitted": [s["emitted"] for s in steps], "step_accepted": [s["accepted"] for s in steps],
            "step_source": [s["source"] for s in steps]}


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


PLAN_KEYS = {"configs": "config", "workloads": "workload", "loads": "load", "requests": "requests",
             "repeats": "repeats", "budget_s": "budget_s", "capture": "capture", "profile": "profile"}


def apply_plan(args: argparse.Namespace) -> None:
    """Fill the bench arguments the command line left unset from `--plan` (a JSON object: `configs` a list of
    specs or {label: spec}, `workloads`, `loads`, `requests` as the flags take them, `repeats`, `budget_s`,
    `capture`, `profile`; other keys, such as `why`, are notes), then the defaults (2 repeats, 330 s)."""
    plan: dict[str, Any] = {}
    if args.plan:
        path = Path(args.plan) if Path(args.plan).is_absolute() else ROOT / args.plan
        try:
            plan = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--plan {args.plan}: {e}") from None
        if not isinstance(plan, dict):
            raise SystemExit(f"--plan {args.plan}: expected a JSON object")
    for key, dest in PLAN_KEYS.items():
        if key not in plan or getattr(args, dest) is not None:
            continue
        value = plan[key]
        if key == "configs" and isinstance(value, dict):
            value = list(value.values())
        if key in ("configs", "workloads", "loads", "requests") and not isinstance(value, list):
            raise SystemExit(f"--plan {args.plan}: {key} must be a list")
        setattr(args, dest, value)
    if args.repeats is None:
        args.repeats = 2
    if args.budget_s is None:
        args.budget_s = 330.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="GPU: every point on three engines, raw rows into $OUT")
    b.add_argument("--tag", required=True)
    b.add_argument("--model", default=MODEL)
    b.add_argument("--config", action="append", default=None, help=f"a config (repeatable; default {CONFIGS})")
    b.add_argument("--workload", action="append", default=None, help=f"a JSONL workload (default {WORKLOADS})")
    b.add_argument("--load", action="append", type=int, default=None, help="requests in flight (default 1 and 8)")
    b.add_argument("--repeats", type=int, default=None, help="repeats of every point (default 2)")
    b.add_argument("--requests", action="append", default=None,
                   help=f"requests per point in file order, LOAD=N or WORKLOAD:LOAD=N (repeatable; defaults "
                        f"{REQUESTS})")
    b.add_argument("--budget-s", type=float, default=None,
                   help="the whole call's time, engine starts included: no point starts that would end past it "
                        "(default 330)")
    b.add_argument("--plan", default=None,
                   help="a JSON plan (benchmarks/plans/corpus_*.json): its configs, workloads, loads, requests, "
                        "repeats and budget_s fill in what the command line leaves out")
    b.add_argument("--gpu-memory", type=float, default=0.85, help="GPU memory fraction shared by the engines")
    b.add_argument("--capture", type=int, default=None,
                   help="CUDA graphs for steps of up to this many tokens, every engine (default: the served "
                        "configs', hqlab.engines.vllm.serving.capture_size: max(1024, requests x (k + 1)))")
    b.add_argument("--profile", action="store_true", default=None,
                   help="time the worker's phases during every point (worker.StepTimer) into "
                        "$OUT/vllm_corpus_<tag>.phases.parquet")
    b.add_argument("--dry-run", action="store_true", help="print the plan, start no engine (CPU)")
    f = sub.add_parser("finish", help="CPU: raw rows -> results and per-request parquets, with the replay check")
    f.add_argument("raw", nargs="+")
    f.add_argument("--run", required=True, help="name of this run (the bench call's tag)")
    f.add_argument("--results", default=None, help="the results folder (default data/results)")
    f.add_argument("--card", default=None, help="the card, where no .json beside the raw file names the machine")
    f.add_argument("--commit", default=None, help="the commit whose code ran on the host (default: this checkout's)")
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        apply_plan(args)
        if args.repeats < 2 and not args.dry_run:
            log("note: fewer than 2 repeats")
        return bench(args)
    return finish(args)


if __name__ == "__main__":
    raise SystemExit(main())

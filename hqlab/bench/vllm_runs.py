"""Benchmark runs on vLLM: one engine per config (`run_setting`, `run_configs`) or every config's engine alive at
once with the requests interleaved (`run_interleaved`), and the raw results (`Run`, `raw_table`, `runs_from_raw`).

This module runs on the GPU host, where only vLLM, torch and pyarrow are installed (no polars): it imports nothing
that needs more at load time (`hqlab.bench` loads its harness lazily for it), returns plain `Run`s holding
`hqlab.trace.Generation`s, and `raw_table` stores them as a pyarrow table. `hqlab.bench.vllm.frames_from_raw`
(polars, anywhere) turns them into the rows and step frames the benchmark harness writes.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

from hqlab.config import ConfigError, DecodeConfig
from hqlab.engines.vllm.engine import EngineSetting, VLLMEngine, VLLMOptions, settings_for
from hqlab.engines.vllm.startup import (PARALLEL_START_KV_BYTES, check_parallel_start_environment,
                                        prepare_parallel_start, start_engines_together)
from hqlab.trace import Generation, step_record


@dataclass
class Run:
    """One request's result: `repeat` -1 is the reference's margins pass (top-2 logprobs, not timed)."""

    config: str
    prompt_id: str
    category: str
    repeat: int
    generation: Generation
    concurrency: int = 1  # requests submitted together (1: one at a time)
    batch_wall_s: float = math.nan  # wall time of the whole concurrent batch this run was part of
    load: str = "alone"  # "alone", "burst" (all submitted at once) or "sustained" (`concurrency` kept in flight)
    # ms of a fixed piece of Python on the engine core's CPU around the request, kept for the runs that probed it
    # (the probe was removed: experiments/host_two_speeds); NaN for every run since
    host_unit_ms: float = math.nan


def check_prompts(options: VLLMOptions, prompts: Sequence[tuple[str, str, list[int]]], decode: DecodeConfig) -> None:
    for pid, _, ids in prompts:
        if len(ids) + decode.max_new_tokens > options.max_model_len:
            raise ConfigError(f"prompt {pid!r} has {len(ids)} tokens; with max_new_tokens={decode.max_new_tokens} "
                              f"that exceeds max_model_len={options.max_model_len}")


def _profiled(engine: "VLLMEngine", prompts: Sequence[tuple[str, str, list[int]]],
              decode: DecodeConfig) -> list[dict[str, Any]]:
    """Every prompt once more with the worker's phases timed: what an engine description keeps under "profile"."""
    out = []
    for pid, category, ids in prompts:
        timed = engine.profile(ids, decode, request=pid)
        out.append({"prompt_id": pid, "category": category, "phases": timed["phases"],
                    "steps": [asdict(r) for r in timed["generation"].records]})
    return out


def burst_group(prompts: Sequence[tuple[str, str, list[int]]], concurrency: int,
                burst: Sequence[str] = ()) -> list[tuple[str, str, list[int]]]:
    """The prompts submitted together: the first `concurrency`, or, with `burst`, one per name in order, a name being
    a prompt id or a category (its next prompt not taken yet). A burst of the suite's first prompts is all copy
    tasks; naming the categories mixes copy-heavy requests with prose, which is what per-request blocks are for."""
    if not burst:
        return list(prompts[:concurrency]) if concurrency > 1 else []
    if concurrency not in (0, len(burst)):
        raise ConfigError(f"a burst of {list(burst)} is {len(burst)} requests, not concurrency={concurrency}")
    taken: set[str] = set()
    group = []
    for name in burst:
        found = next((p for p in prompts if p[0] == name and p[0] not in taken), None) or \
            next((p for p in prompts if p[1] == name and p[0] not in taken), None)
        if found is None:
            raise ConfigError(f"burst: no prompt id or category {name!r} left in the suite (ids and categories: "
                              f"{sorted({p[0] for p in prompts} | {p[1] for p in prompts})})")
        taken.add(found[0])
        group.append(found)
    return group


def run_setting(options: VLLMOptions, setting: EngineSetting, prompts: Sequence[tuple[str, str, list[int]]],
                decode: DecodeConfig, *, repeats: int = 1, bar: Any = None,
                concurrency: int = 0, sustained: bool = False, profile: bool = False, burst: Sequence[str] = ()
                ) -> tuple[list[Run], dict[str, Any]]:
    """One engine: a warm-up request, then (for the `none` reference under greedy decoding) the margins pass, then
    `repeats` passes over every (prompt id, category, token ids). With `concurrency` > 1, then the first `concurrency`
    prompts (or those `burst` names, `burst_group`) submitted together, `repeats` times, and with `sustained` every
    prompt with `concurrency` requests kept
    in flight. `profile`: then every prompt once more with the worker's phases timed, kept in the description under
    "profile". Returns the runs and the engine's description."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1 (got {repeats})")
    if concurrency < 0 or concurrency > options.max_num_seqs:
        raise ConfigError(f"concurrency must be in [0, max_num_seqs={options.max_num_seqs}] (got {concurrency})")
    group = burst_group(prompts, concurrency, burst)  # checked before the engine starts
    runs: list[Run] = []
    engine = VLLMEngine(options, setting)
    try:
        description = engine.describe()
        if prompts:  # first requests pay for lazy compilation and allocator growth
            engine.generate(prompts[0][2], decode=DecodeConfig(max_new_tokens=32), request="warmup")
        if setting.label == "none" and decode.greedy:
            for pid, category, ids in prompts:
                runs.append(Run(setting.label, pid, category, -1, engine.generate(ids, decode=decode, request=pid,
                                                                                  margins=True)))
        # Repeats in passes over the suite, not back to back: a host-bound step's speed changes in episodes of
        # seconds (docs/vllm.md, "The host has two speeds"), so a prompt's repeats should meet different ones.
        for r in range(repeats):
            for pid, category, ids in prompts:
                if bar is not None:
                    bar.set_postfix_str(f"{setting.label} · {pid} · pass {r + 1}")
                runs.append(Run(setting.label, pid, category, r, engine.generate(ids, decode=decode, request=pid)))
                if bar is not None:
                    bar.update()
        for r in range(repeats if group else 0):
            gens, wall = engine.generate_concurrent([ids for _, _, ids in group], decode, [pid for pid, _, _ in group])
            runs += [Run(setting.label, pid, category, r, g, len(group), wall, "burst")
                     for (pid, category, _), g in zip(group, gens)]
        for r in range(repeats if group and sustained else 0):
            gens, wall = engine.generate_concurrent([ids for _, _, ids in prompts], decode,
                                                    [pid for pid, _, _ in prompts], in_flight=concurrency)
            runs += [Run(setting.label, pid, category, r, g, concurrency, wall, "sustained")
                     for (pid, category, _), g in zip(prompts, gens)]
        if profile:
            description["profile"] = _profiled(engine, prompts, decode)
    finally:
        engine.close()
    return runs, description


def interleaved_order(n_engines: int, n_items: int) -> list[tuple[int, int]]:
    """(item, engine) pairs of one interleaved round: every engine runs item 0, then every engine item 1, ...; the
    engine that goes first rotates from item to item, so no config always runs right after the same other one."""
    return [(i, (i + j) % n_engines) for i in range(n_items) for j in range(n_engines)]


def round_plan(repeats: int, *, burst: bool = False, sustained: bool = False) -> list[tuple[int, str]]:
    """(round, load) in the order an interleaved call runs them: each round runs the suite alone, then the burst,
    then the sustained load, before the next round starts. A call cut short by its time limit (the runs are saved
    after each) so keeps as many repeats of each load, not three alone and no burst."""
    loads = ["alone", *(["burst"] if burst else []), *(["sustained"] if sustained else [])]
    return [(r, load) for r in range(repeats) for load in loads]


def run_interleaved(options: VLLMOptions, settings: Sequence[EngineSetting],
                    prompts: Sequence[tuple[str, str, list[int]]], decode: DecodeConfig, *, repeats: int = 1,
                    concurrency: int = 0, sustained: bool = False, profile: bool = False,
                    saved: Callable[[list[Run], list[dict[str, Any]], str], None] | None = None,
                    burst: Sequence[str] = (), parallel_start: bool = False,
                    make_engine: Callable[..., Any] = VLLMEngine) -> tuple[list[Run], list[dict[str, Any]]]:
    """Every config on its own engine, all engines alive at once, the measurements interleaved request by request.

    Why: a decode step on a 0.5B model is host-bound, and the same engine's speed drifts by tens of percent over a
    few minutes on a shared host; one engine after another turns that drift into differences between configs.
    Here each round runs prompt 1 on every engine, then prompt 2 on every engine, ..., so the runs that a ratio
    compares are seconds apart. GPU memory is split between the engines (`options.gpu_memory_utilization` is the
    total). With `concurrency` > 1 each round then runs the first `concurrency` prompts as a burst on each engine in
    turn, and with `sustained` the whole suite with `concurrency` requests kept in flight (`round_plan`). `profile`:
    then every prompt once more per engine with the worker's phases timed (kept under "profile"). `saved(runs,
    descriptions, what)` is called after every round, so a call cut short keeps what it measured.

    `parallel_start`: the engines are built at the same time, each in a thread of its own (an engine takes ~100 s
    to start on the H200, most of it in its own processes), each with a KV cache of `options.kv_cache_bytes` or else
    `PARALLEL_START_KV_BYTES` (vLLM's memory profiling cannot tell engines starting together apart); then they warm
    up one at a time in the settings' order, as without it. If starting them together fails, the engines it started
    are closed, a warning says why, and they start one after another instead. `make_engine(options, setting,
    **kwargs)` builds an engine (tests pass a stand-in)."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1 (got {repeats})")
    if concurrency < 0 or concurrency > options.max_num_seqs:
        raise ConfigError(f"concurrency must be in [0, max_num_seqs={options.max_num_seqs}] (got {concurrency})")
    if sustained and concurrency < 2:
        raise ConfigError("sustained load needs concurrency >= 2 (requests kept in flight)")
    group = burst_group(prompts, concurrency, burst)  # checked before any engine starts
    share = round(options.gpu_memory_utilization / max(1, len(settings)), 3)
    if share < 0.05:
        raise ConfigError(f"{len(settings)} engines at once leave each {share:.3f} of the GPU's memory; raise "
                          f"gpu_memory_utilization or run fewer configs per call (each engine needs >= 0.05)")
    each = replace(options, gpu_memory_utilization=share)
    if parallel_start:
        check_parallel_start_environment()
        each = replace(each, kv_cache_bytes=options.kv_cache_bytes or PARALLEL_START_KV_BYTES)
        prepare_parallel_start(each, settings)
    engines: list[VLLMEngine] = []
    runs: list[Run] = []
    described: list[dict[str, Any]] = []

    def save(what: str) -> None:
        if saved is not None:
            saved(runs, described, what)

    def build_together(setting: EngineSetting) -> Any:
        return make_engine(each, setting, started_together=True)

    try:
        if parallel_start:  # on failure it closes what it started itself; after it, `finally` closes them all
            try:
                engines += start_engines_together(settings, build_together)
            except Exception as e:  # noqa: BLE001 - any failure: the call's time is better spent starting them in turn
                # A GPU call is minutes of a small budget: rather than end it, start the engines one after another,
                # as without parallel_start (vLLM sizing their caches again); a config that cannot start at all
                # then fails there.
                warnings.warn(f"starting the engines together failed ({type(e).__name__}: {e}); starting them one "
                              f"after another", RuntimeWarning, stacklevel=2)
                parallel_start = False
                each = replace(each, kv_cache_bytes=options.kv_cache_bytes)
        for i, setting in enumerate(settings):
            if not parallel_start:
                engines.append(make_engine(each, setting))
            engine = engines[i]
            described.append(engine.describe())
            if prompts:  # first requests pay for lazy compilation and allocator growth
                engine.generate(prompts[0][2], decode=DecodeConfig(max_new_tokens=32), request="warmup")
        for engine in engines:
            if engine.setting.label == "none" and decode.greedy:
                runs += [Run("none", pid, category, -1, engine.generate(ids, decode=decode, request=pid, margins=True))
                         for pid, category, ids in prompts]
        save("engines started")
        loads = {"burst": (group, 0), "sustained": (list(prompts), concurrency)}
        for r, load in round_plan(repeats, burst=bool(group), sustained=sustained):
            if load == "alone":
                for i, e in interleaved_order(len(engines), len(prompts)):
                    pid, category, ids = prompts[i]
                    runs.append(Run(engines[e].setting.label, pid, category, r,
                                    engines[e].generate(ids, decode=decode, request=pid)))
            else:
                together, in_flight = loads[load]
                for e in ((r + j) % len(engines) for j in range(len(engines))):  # who goes first rotates
                    gens, wall = engines[e].generate_concurrent([ids for _, _, ids in together], decode,
                                                                [pid for pid, _, _ in together], in_flight=in_flight)
                    runs += [Run(engines[e].setting.label, pid, category, r, g, concurrency, wall, load)
                             for (pid, category, _), g in zip(together, gens)]
            save(f"round {r + 1} of {repeats} {load}")
        if profile:
            for engine, description in zip(engines, described):
                description["profile"] = _profiled(engine, prompts, decode)
            save("profiled")
    finally:
        for engine in engines:
            engine.close()
    return runs, described


def run_configs(options: VLLMOptions, prompts: Sequence[tuple[str, str, list[int]]], specs: Sequence[str],
                decode: DecodeConfig, *, repeats: int = 1, progress: bool = True,
                concurrency: int = 0) -> tuple[list[Run], list[dict]]:
    """Every config (one engine at a time, `none` first) on every (prompt id, category, token ids); all specs and
    prompt lengths are checked before the first engine starts. Returns the runs and one description per engine."""
    from tqdm.auto import tqdm

    settings = settings_for(specs)
    check_prompts(options, prompts, decode)
    runs: list[Run] = []
    described = []
    bar = tqdm(total=len(settings) * len(prompts) * repeats, desc="vllm bench", disable=not progress)
    for setting in settings:
        more, description = run_setting(options, setting, prompts, decode, repeats=repeats, bar=bar,
                                        concurrency=concurrency)
        runs += more
        described.append(description)
    bar.close()
    return runs, described


RAW_COLUMNS = ("config", "prompt_id", "category", "repeat", "prompt_len", "output_ids", "margins", "finish",
               "ttft_s", "total_s", "t_last", "records")
# + concurrency, batch_wall_s, load (absent in older tables: 1, NaN, "alone"/"burst")


def raw_table(runs: Sequence[Run]):
    """The runs as a pyarrow table (records as JSON text): written on the GPU host, where polars may be absent."""
    import pyarrow as pa

    rows = [{"config": r.config, "prompt_id": r.prompt_id, "category": r.category, "repeat": r.repeat,
             "prompt_len": r.generation.prompt_len, "output_ids": r.generation.output_ids,
             "margins": [float(m) for m in r.generation.margins], "finish": r.generation.finish,
             "ttft_s": r.generation.ttft_s, "total_s": r.generation.total_s, "t_last": r.generation.t_last,
             "records": json.dumps([asdict(s) for s in r.generation.records]), "concurrency": r.concurrency,
             "batch_wall_s": r.batch_wall_s, "load": r.load, "host_unit_ms": r.host_unit_ms} for r in runs]
    schema = pa.schema([("config", pa.string()), ("prompt_id", pa.string()), ("category", pa.string()),
                        ("repeat", pa.int32()), ("prompt_len", pa.int32()), ("output_ids", pa.list_(pa.int64())),
                        ("margins", pa.list_(pa.float64())), ("finish", pa.string()), ("ttft_s", pa.float64()),
                        ("total_s", pa.float64()), ("t_last", pa.float64()), ("records", pa.string()),
                        ("concurrency", pa.int32()), ("batch_wall_s", pa.float64()), ("load", pa.string()),
                        ("host_unit_ms", pa.float64())])
    return pa.Table.from_pylist(rows, schema=schema)


def _current_record(saved: dict[str, Any]) -> dict[str, Any]:
    """A step record as a raw table saved it, in today's fields: records saved before the whole drafted block was kept
    carried only the drafter's head token (`drafter_token`, -1 where it did not run), now the first of
    `drafter_tokens`."""
    if "drafter_token" in saved:
        saved = dict(saved)
        head = int(saved.pop("drafter_token"))
        saved["drafter_tokens"] = [head] if head >= 0 else []
    return saved


def runs_from_raw(raw: Any) -> list[Run]:
    """Inverse of `raw_table` (a polars DataFrame or pyarrow table)."""
    rows = raw.to_dicts() if hasattr(raw, "to_dicts") else raw.to_pylist()
    missing = set(RAW_COLUMNS) - set(rows[0]) if rows else set()
    if missing:
        raise ConfigError(f"not a raw vLLM run table: missing columns {sorted(missing)}")
    runs = []
    for row in rows:
        records = [step_record(**_current_record(s)) for s in json.loads(row["records"])]
        gen = Generation(request=row["prompt_id"], prompt_len=row["prompt_len"], output_ids=list(row["output_ids"]),
                         finish=row["finish"], ttft_s=row["ttft_s"], total_s=row["total_s"], t_last=row["t_last"],
                         records=records, margins=list(row["margins"] or []))
        level = int(row.get("concurrency") or 1)
        runs.append(Run(row["config"], row["prompt_id"], row["category"], int(row["repeat"]), gen, level,
                        float(row.get("batch_wall_s") or math.nan),
                        row.get("load") or ("alone" if level <= 1 else "burst"),  # older tables: no load column
                        float(row["host_unit_ms"]) if row.get("host_unit_ms") is not None else math.nan))
    return runs


__all__ = ["Run", "check_prompts", "burst_group", "run_setting", "run_configs", "run_interleaved",
           "interleaved_order", "round_plan", "raw_table", "runs_from_raw", "RAW_COLUMNS"]

"""The benchmark harness on vLLM: a workload through one vLLM engine per config (`hqlab.bench.vllm_runs`), and the
raw runs a GPU host returns (`hqlab.bench.vllm_runs.raw_table`) turned into the results and step frames
`hqlab.bench` writes for every engine."""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import polars as pl

from hqlab.bench.harness import _append_steps, _lossless_columns, prompt_rows
from hqlab.bench.lossless import NEAR_TIE_TOL, compare
from hqlab.bench.vllm_runs import Run, run_configs
from hqlab.config import ConfigError, DecodeConfig
from hqlab.engines.vllm.engine import VLLMOptions, encode_prompts, settings_for
from hqlab.provenance import machine_description
from hqlab.trace import Generation
from hqlab.workloads import Prompt

# a fused config's drafter settings: the replay brings its own drafter (teacher-forced, on the CPU)
DRAFTER_KEYS = ("model", "dtype", "device", "temperature", "vocab")


def frames_from_raw(runs: Sequence[Run], decode: DecodeConfig, meta: dict[str, Any],
                    engines: Sequence[dict[str, Any]] = ()):
    """(results, steps) polars frames with the columns `hqlab.bench.run_bench` writes, one row per (config, prompt)
    and concurrency level (column `concurrency`: 1 for requests run alone).

    The reference is the `none` config's margins pass when there is one (greedy), else its first timed run; it
    checks every output, concurrent ones included. `step_efficiency` = decode tok/s / (tokens/step x none's decode
    tok/s): 1.0 when a speculative step costs what a plain step costs. Rows and steps carry `load` ("alone"; "burst": all
    submitted at once; "sustained": `concurrency` requests kept in flight over the whole suite), `batch_wall_s`
    (median over repeats of the whole batch's wall time) and `batch_tok_s` (all its tokens / that time). `engines` (the
    engines' `describe()`) adds what vLLM chose per config: model runner and async scheduling. Rows alone carry
    `host_unit_ms`, the median over repeats of how fast the engine core's CPU ran Python around each request (NaN
    unless the run pinned its threads).
    """
    tol = NEAR_TIE_TOL.get(str(meta.get("dtype", "bfloat16")), 0.01)
    base_meta = {"engine": "vllm", **meta, "max_new_tokens": decode.max_new_tokens}
    labels = list(dict.fromkeys(r.config for r in runs))
    if "none" not in labels:
        raise ConfigError("the runs hold no 'none' config: there is no reference to compare with")
    labels.remove("none")
    labels.insert(0, "none")
    alone = [r for r in runs if r.concurrency <= 1]
    rows, steps, references = [], [], {}
    for pid in dict.fromkeys(r.prompt_id for r in alone):
        mine = [r for r in alone if r.prompt_id == pid]
        timed = {label: [r.generation for r in mine if r.config == label and r.repeat >= 0] for label in labels}
        timed = {label: gens for label, gens in timed.items() if gens}
        margins_pass = [r.generation for r in mine if r.config == "none" and r.repeat < 0]
        reference = margins_pass[0] if margins_pass else timed["none"][0]
        references[pid] = reference
        prompt = Prompt(pid, mine[0].category, ())
        r, s = prompt_rows(prompt, reference.prompt_len, timed, reference, decode, tol, base_meta)
        speed = {label: [x.host_unit_ms for x in mine if x.config == label and x.repeat >= 0
                         and not math.isnan(x.host_unit_ms)] for label in timed}
        rows += [{**row, "concurrency": 1, "load": "alone",
                  "host_unit_ms": statistics.median(speed[row["config"]]) if speed.get(row["config"]) else math.nan}
                 for row in r]
        steps += [frame.with_columns(pl.lit(1).alias("concurrency"), pl.lit("alone").alias("load")) for frame in s]
    for (label, level, load), group in _groups(r for r in runs if r.concurrency > 1).items():
        walls = {}
        for r in group:
            walls.setdefault(r.repeat, r.batch_wall_s)
        wall = statistics.median(walls.values())
        first = [r for r in group if r.repeat == min(walls)]
        tokens = sum(r.generation.new_tokens for r in first)
        for r in first:
            g = r.generation
            ref = references.get(r.prompt_id)
            check = compare(ref.output_ids, ref.margins, g.output_ids, tol) if ref is not None and decode.greedy \
                else None
            rows.append({**base_meta, "config": label, "category": r.category, "prompt_id": r.prompt_id,
                         "prompt_tokens": g.prompt_len, "new_tokens": g.new_tokens, "finish": g.finish,
                         # emitted per step: vLLM's counters cannot be told apart per request in a batch
                         "steps": g.steps, "tokens_per_step": _emitted_per_step(g), "concurrency": level,
                         "load": load, "batch_wall_s": wall, "batch_tok_s": tokens / wall if wall > 0 else math.nan,
                         "repeats": len(walls), **_lossless_columns(check)})
            _append_steps(steps, g.records, label, r.category, concurrency=level, load=load)
    results = pl.DataFrame(rows, infer_schema_length=None)
    if "speedup_decode" in results.columns:
        results = results.with_columns((pl.col("speedup_decode") / pl.col("tokens_per_step")).alias("step_efficiency"))
    if engines:
        chosen = pl.DataFrame([{"config": e["config"], "vllm_runner": e["model_runner"],
                                "async_scheduling": e["async_scheduling"]} for e in engines])
        results = results.join(chosen.unique("config", keep="last"), on="config", how="left", maintain_order="left")
    return results, (pl.concat(steps, how="diagonal_relaxed") if steps else pl.DataFrame())


def repeat_rows(runs: Sequence[Run]) -> pl.DataFrame:
    """One row per timed request run alone: its own decode tok/s, TTFT and steps, with `repeat` (the round of an
    interleaved call: every config ran the prompt once per round, seconds apart). The results keep the median over
    repeats; this keeps the spread, and lets a ratio pair each config with another in the same round. A document
    request that decodes 256 tokens in 8-10 steps spends 20-40 ms decoding, where a hiccup of a few ms moves its
    rate by a tenth."""
    rows = [{"config": r.config, "prompt_id": r.prompt_id, "category": r.category, "repeat": r.repeat,
             "new_tokens": r.generation.new_tokens, "steps": r.generation.steps, "ttft_s": r.generation.ttft_s,
             "decode_s": r.generation.t_last - r.generation.ttft_s, "decode_tok_s": r.generation.decode_tok_s()}
            for r in runs if r.concurrency <= 1 and r.repeat >= 0]
    schema = {"config": pl.String, "prompt_id": pl.String, "category": pl.String, "repeat": pl.Int64,
              "new_tokens": pl.Int64, "steps": pl.Int64, "ttft_s": pl.Float64, "decode_s": pl.Float64,
              "decode_tok_s": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def _emitted_per_step(g: Generation) -> float:
    return sum(r.emitted for r in g.records) / len(g.records) if g.records else math.nan


def _groups(runs: Any) -> dict[tuple[str, int, str], list[Run]]:
    out: dict[tuple[str, int, str], list[Run]] = {}
    for r in runs:
        out.setdefault((r.config, r.concurrency, r.load), []).append(r)
    return out


def fused_replay_check(runs: Sequence[Run], prompts: Sequence[tuple[str, str, list[int]]], drafter: Any, *,
                       max_new_tokens: int, progress: bool = True) -> pl.DataFrame:
    """Each `gpu-fused` config of a vLLM run against the lab's replay of the same `fused` config over the same
    outputs: per (config, prompt), vLLM's tokens/step (its first timed repeat, alone) and the replay's, with
    teacher-forced drafts of `drafter` (`hqlab.replay.teacher`). `prompts` are the run's (id, category, token ids),
    encoded as the bench encoded them. The two agree step for step when the drafter's greedy tokens agree; a
    difference comes from the drafter's numerics (vLLM's GPU kernels in bf16 against the replay's), or from EOS.
    Where vLLM's step records carry its drafter's own tokens (`StepRecord.drafter_tokens`), the replay takes them
    (`replay_fused_grid(forced=...)`), so the two must agree exactly, and the rows count the tokens where the
    replay's drafter would have drafted another (`drafter_flips`) with its widest margin there. (Records that carry
    the head token only leave a config drafting more than one token a step compared past it with the replay's own
    drafter.)"""
    from dataclasses import fields

    from hqlab.engines.vllm.gpu_fused import NAME, recorded_rules
    from hqlab.proposers.fused import FusedConfig
    from hqlab.replay.teacher import replay_fused_grid
    from hqlab.replay.traces import Trace

    ids = {pid: (category, tokens) for pid, category, tokens in prompts}
    rows = []
    for config in dict.fromkeys(r.config for r in runs if r.config.startswith(NAME + ":")):
        c = recorded_rules(config)  # the spec as it ran, retired keys included
        # every rule setting of the lab's proposer (skip included); the drafter's own keys are the replay's
        keys = {f.name: getattr(c, f.name) for f in fields(FusedConfig) if f.name not in DRAFTER_KEYS}
        spec = "fused:" + ",".join(f"{k}={v}" for k, v in keys.items())
        alone = {r.prompt_id: r for r in runs if r.config == config and r.concurrency <= 1 and r.repeat == 0}
        missing = sorted(set(alone) - set(ids))
        if missing:
            raise ConfigError(f"fused_replay_check: prompts {missing} of {config!r} are not among the given prompts")
        traces = [Trace.of(ids[pid][1], list(r.generation.output_ids), max_new_tokens, pid, ids[pid][0])
                  for pid, r in alone.items()]
        forced = {pid: {rec.context_len: rec.drafter_tokens for rec in r.generation.records if rec.drafter_tokens}
                  for pid, r in alone.items()}
        replayed = replay_fused_grid(traces, drafter, [spec], progress=progress, forced=forced)
        live = pl.DataFrame([{"prompt_id": pid, "vllm_tokens_per_step": _emitted_per_step(r.generation),
                              "vllm_steps": len(r.generation.records)} for pid, r in alone.items()])
        rows.append(replayed.join(live, on="prompt_id").with_columns(pl.lit(config).alias("config")))
    if not rows:
        raise ConfigError("fused_replay_check: the run has no gpu-fused config")
    return pl.concat(rows, how="diagonal").with_columns(
        (pl.col("vllm_tokens_per_step") / pl.col("tokens_per_step") - 1).alias("difference"))


def bench_suite(model: str | None, suite: str, specs: Sequence[str], decode: DecodeConfig, *, doc_tokens: int,
                limit: int = 0, repeats: int = 1, dtype: str = "auto", progress: bool = True, concurrency: int = 0,
                tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
    """`hqlab bench --engine vllm`: a workload through every config (and, with `concurrency` > 1, its first
    `concurrency` prompts submitted together); returns bench's (results, steps) frames."""
    import torch
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.workloads import load_workload

    settings = settings_for(specs)  # every spec checked before the model is prepared
    if any(s.gpu for s in settings):
        from hqlab.engines.vllm.plugin import check_vllm_version

        check_vllm_version()
    VLLMOptions(model="checked", tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size)  # raises on bad sizes before the model is prepared
    if concurrency < 0:
        raise ConfigError(f"concurrency must be >= 0 (got {concurrency})")
    if pipeline_parallel_size > 1 and any(s.gpu for s in settings):
        raise ConfigError("hqlab's GPU speculators (gpu-lookup) do not support pipeline parallelism yet")
    if not torch.cuda.is_available():  # (does not initialise CUDA: vLLM may still fork its engine processes)
        raise ConfigError("the vllm engine needs a CUDA GPU (vLLM's published wheels are CUDA builds); on this "
                          "machine use --engine hf, or replay vLLM's n-gram rule with the vllm-ngram proposer")
    name = model or models.DEFAULT_MODEL
    folder = models.prepare(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = load_workload(suite, doc_tokens=doc_tokens, tokenizer=tokenizer)
    encoded = encode_prompts(tokenizer, prompts[: limit or None])
    options = VLLMOptions(model=folder, dtype=models.resolve_dtype(dtype), tensor_parallel_size=tensor_parallel_size,
                          pipeline_parallel_size=pipeline_parallel_size, max_num_seqs=max(8, concurrency))
    runs, described = run_configs(options, encoded, specs, decode, repeats=repeats, progress=progress,
                                  concurrency=concurrency)
    meta = {"machine": machine_description(vllm=True), "model": str(name), "dtype": options.dtype, "suite": suite,
            "doc_tokens": doc_tokens, "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size}
    return frames_from_raw(runs, decode, meta, described)


def finish_tables(raw: Sequence[str], run: str, *, reference: str | None = None, commit: str | None = None) -> dict:
    """The raw files a GPU host returned for one run of benchmarks/vllm_gpu.py (several calls' files, the `none`
    reference possibly from an earlier call's file) -> its tables: rows, steps, repeats and, where profiled, phases
    and profile_steps, each with `run`. The commit: `commit`, else the one the call recorded, else this checkout's."""
    from pathlib import Path

    from hqlab import provenance
    from hqlab.bench.runner import commit_of
    from hqlab.bench.vllm_runs import runs_from_raw
    from hqlab.io import read_json

    runs, metas = [], []
    source: dict[str, str] = {}
    for path in [*raw, *([reference] if reference else [])]:
        more = runs_from_raw(pl.read_parquet(path))
        meta = read_json(Path(path).with_suffix(".json"))
        if path == reference:  # only its `none` rows: the reference of a call run with --skip-reference
            more = [r for r in more if r.config == "none"]
            if not more:
                raise SystemExit(f"--reference {path}: it holds no `none` run")
            meta["engines"] = [e for e in meta["engines"] if e["config"] == "none"]
        for config in dict.fromkeys(r.config for r in more):
            if config in source:  # its repeats and batches would be pooled across calls (batch throughput doubled)
                raise SystemExit(f"config {config!r} is in both {source[config]} and {path}: one run holds each "
                                 f"config once; finish the calls as separate runs (--run, the later one with "
                                 f"--reference EARLIER if it skipped `none`), or run the later call with "
                                 f"--skip-reference")
            source[config] = str(path)
        runs += more
        metas.append(meta)
    keys = ("machine", "model", "dtype", "doc_tokens", "suite", "tensor_parallel_size", "pipeline_parallel_size")
    meta = {k: metas[0][k] for k in keys if k in metas[0]}
    decode = DecodeConfig(max_new_tokens=metas[0]["max_new_tokens"])
    engines = [e for m in metas for e in m["engines"]]
    results, steps = frames_from_raw(runs, decode, meta, engines)
    # Provenance: versions and device as the GPU host reported them; the commit is the one whose code ran there
    # (the host gets the working tree without its history).
    host = metas[0].get("versions") or {}
    results = results.with_columns(pl.lit(commit_of(commit, metas[0].get("commit"))).alias("git_commit"),
                                   *(pl.lit(host.get(c), dtype=pl.String).alias(c)
                                     for c in provenance.COLUMNS if c != "git_commit"))
    phases = [{"config": e["config"], "prompt_id": p["prompt_id"], "category": p["category"], **ph}
              for e in engines for p in e.get("profile", []) for ph in p["phases"]]
    profile_steps = [{"config": e["config"], "prompt_id": p["prompt_id"], "category": p["category"], **st}
                     for e in engines for p in e.get("profile", []) for st in p["steps"]]
    tables = {"rows": results, "steps": steps, "repeats": repeat_rows(runs), "phases": pl.DataFrame(phases),
              "profile_steps": pl.DataFrame(profile_steps).drop("proposed", "sources", strict=False)}
    return {kind: frame.with_columns(pl.lit(run).alias("run")) for kind, frame in tables.items() if frame.height}


def merge_replay(table: pl.DataFrame, existing: pl.DataFrame | None) -> pl.DataFrame:
    """A raw file's replay rows (`fused_replay_check`, with `run`) in place of the rows of the same run and configs
    in a run's replay table; its other runs and the run's other configs (a run's configs can come back in several
    raw files) stay."""
    if existing is None:
        return table
    if "run" not in existing.columns:
        raise SystemExit(f"the replay table has no `run` column, so its rows cannot be told apart from run "
                         f"{table['run'][0]!r}")
    configs = table["config"].unique().to_list()
    keep = existing.filter((pl.col("run") != table["run"][0]) | ~pl.col("config").is_in(configs))
    return pl.concat([keep, table], how="diagonal_relaxed")

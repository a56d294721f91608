"""Benchmarks: workloads × proposer configs × engine → one results row per (config, prompt) + step records.

Hygiene (SPEC §3): the engine's own no-speculation run is always first and is the reference every greedy output
is checked against; configs are interleaved per prompt so drift hits them alike; timings are medians over
repeats; the machine and the provenance (commit, library versions, device: `hqlab.provenance`) are written in
every row.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import polars as pl
from tqdm.auto import tqdm

from hqlab import provenance
from hqlab.bench.lossless import NEAR_TIE_TOL, compare
from hqlab.config import ConfigError, DecodeConfig, resolve_spec
from hqlab.io import write_atomic
from hqlab.proposers import REGISTRY, Proposer, make_proposer
from hqlab.trace import Generation, records_frame
from hqlab.workloads import Prompt, WorkloadError, load_workload, read_jsonl, suite_names


@dataclass(frozen=True)
class HFPLDConfig:
    """transformers' own prompt lookup (`prompt_lookup_num_tokens=k`), timed by hqlab's harness."""

    k: int = 10

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"hf-pld: k must be >= 1 (got {self.k})")


@dataclass(frozen=True)
class HFPlainConfig:
    """transformers' plain `generate` (a cross-check of the engine's own no-speculation loop)."""


EXTERNAL: dict[str, type] = {"hf-pld": HFPLDConfig, "hf": HFPlainConfig}


def known() -> dict[str, type]:
    """What a benchmark spec can name: every registered proposer (also those registered after import, e.g. in a
    notebook) and transformers' own baselines."""
    return {**REGISTRY, **EXTERNAL}


@dataclass(frozen=True)
class RunConfig:
    label: str
    proposer: Proposer | None = None  # hqlab engine with this proposer
    external: Any = None  # or one of the EXTERNAL configs

    @property
    def is_reference(self) -> bool:
        return self.label == "none"


def parse_configs(specs: Sequence[str | RunConfig]) -> list[RunConfig]:
    """Resolve every spec (once) and build its proposer before anything runs; `none` (the reference) is always
    first. Configs already built pass through."""
    configs: list[RunConfig] = [RunConfig("none", make_proposer("none"))]
    for spec in specs:
        label = spec.label if isinstance(spec, RunConfig) else spec.strip()
        if label == "none" or any(c.label == label for c in configs):
            continue
        if isinstance(spec, RunConfig):
            configs.append(spec)
            continue
        name, config = resolve_spec(label, known())
        configs.append(RunConfig(label, external=config) if name in EXTERNAL else
                       RunConfig(label, proposer=REGISTRY[name](config)))
    return configs


def check_workload(suite: str, doc_tokens: int | None = None) -> None:
    """Raise WorkloadError unless `suite` is a built-in suite or a valid JSONL workload file (read whole), and
    `doc_tokens` a valid document length. Needs no tokenizer and loads no model."""
    if suite in suite_names():
        if doc_tokens is not None and suite != "chat" and doc_tokens < 64:
            raise WorkloadError(f"doc_tokens must be >= 64 (got {doc_tokens})")
        return
    path = Path(suite)
    if path.is_dir():
        raise WorkloadError(f"workload {suite!r} is a folder; give a suite ({', '.join(suite_names())}) or a "
                            f"JSONL file")
    if not path.exists():
        load_workload(suite)  # raises: unknown suite and no such file
    read_jsonl(path)


def check_specs(specs: Sequence[str]) -> None:
    """Validate every proposer spec (its name, keys and values, a drafter's model name, dtype, device and
    vocabulary file) without building any proposer: nothing is loaded."""
    from hqlab import models

    for spec in specs:
        name, config = resolve_spec(spec, known())
        if name in EXTERNAL:
            continue
        try:
            if getattr(config, "model", ""):
                models.resolve(config.model)
            if getattr(config, "dtype", "auto") != "auto":
                models.resolve_dtype(config.dtype)
            if getattr(config, "device", "auto") != "auto":
                models.resolve_device(config.device)
        except models.ModelError as e:
            raise ConfigError(f"{spec!r}: {e}") from None
        if getattr(config, "vocab", ""):
            from hqlab.vocab.runtime import VocabError, load_draft_vocab

            try:
                load_draft_vocab(config.vocab)
            except VocabError as e:
                raise ConfigError(f"{spec!r}: {e}") from None


def run_meta(engine: Any, decode: DecodeConfig, meta: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The columns every result row of `engine` shares: engine, model, dtype, machine, the provenance columns
    (`hqlab.provenance.COLUMNS`: commit, torch/transformers/triton/vllm versions, device) and `meta`."""
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    return {"engine": engine.name, "model": getattr(engine.info, "name", "custom"), "dtype": dtype, **extra,
            "machine": provenance.machine_description(engine.device), **provenance.provenance(engine.device),
            "max_new_tokens": decode.max_new_tokens, **(meta or {})}


def with_provenance(results: pl.DataFrame, device: Any) -> pl.DataFrame:
    """`results` with every provenance column, as strings: the ones it lacks are those of this process on
    `device` (engines whose rows are built elsewhere, such as vLLM's, get theirs here)."""
    if results.is_empty():
        return results
    columns = provenance.provenance(device)
    missing = {c: v for c, v in columns.items() if c not in results.columns}
    return results.with_columns(*(pl.lit(v, dtype=pl.String).alias(c) for c, v in missing.items()),
                                *(pl.col(c).cast(pl.String) for c in columns if c in results.columns))


def _run_one(engine: Any, config: RunConfig, prompt_ids: list[int], decode: DecodeConfig, pid: str) -> Generation:
    if config.external is None:
        return engine.generate(prompt_ids, config.proposer, decode, request=pid)
    k = getattr(config.external, "k", None)
    return engine.generate_hf(prompt_ids, decode, request=pid, prompt_lookup_num_tokens=k)


def encode_prompts(engine: Any, prompts: Sequence[Prompt], max_new_tokens: int) -> list[list[int]]:
    """Tokenize every prompt and check it fits the model before any run starts (no half-done benchmark)."""
    encoded = []
    for p in prompts:
        ids = engine.encode_chat(list(p.messages))
        engine.check_fits(len(ids), max_new_tokens, f"prompt {p.id!r}")
        encoded.append(ids)
    return encoded


def _warm_up(engine: Any, ids: list[int], configs: Sequence[RunConfig]) -> None:
    """First calls pay for allocator growth and kernel selection at every verify shape, and drafters for theirs."""
    engine.generate(ids, None, DecodeConfig(max_new_tokens=16), request="warmup")
    engine.generate(ids, make_proposer("lookup:nmin=1,nmax=4,k=16"), DecodeConfig(max_new_tokens=32),
                    request="warmup")
    for config in configs:
        if config.proposer is not None and config.proposer.name not in ("none", "lookup", "pld"):
            engine.generate(ids, config.proposer, DecodeConfig(max_new_tokens=16), request="warmup")


def run_bench(engine: Any, prompts: Sequence[Prompt], specs: Sequence[str | RunConfig], decode: DecodeConfig, *,
              repeats: int = 1, warmup: bool = True, progress: bool = True,
              meta: dict[str, Any] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Run every config on every prompt; returns (results, steps)."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1 (got {repeats})")
    configs = parse_configs(specs)
    encoded = encode_prompts(engine, prompts, decode.max_new_tokens)
    base_meta = run_meta(engine, decode, meta)
    tol = NEAR_TIE_TOL.get(base_meta["dtype"], 0.01)

    if warmup and encoded:
        _warm_up(engine, encoded[0], configs)

    rows, steps = [], []
    bar = tqdm(total=len(prompts) * len(configs) * repeats, desc="bench", disable=not progress)
    for prompt, ids in zip(prompts, encoded):
        runs: dict[str, list[Generation]] = {c.label: [] for c in configs}
        for _ in range(repeats):
            for config in configs:
                bar.set_postfix_str(f"{prompt.id} · {config.label}")
                runs[config.label].append(_run_one(engine, config, ids, decode, prompt.id))
                bar.update()
        prompt_result, prompt_steps = prompt_rows(prompt, len(ids), runs, runs["none"][0], decode, tol, base_meta)
        rows += prompt_result
        steps += prompt_steps
    bar.close()
    results = with_provenance(pl.DataFrame(rows), engine.device)
    step_frame = pl.concat(steps, how="diagonal_relaxed") if steps else pl.DataFrame()
    return results, step_frame


def prompt_rows(prompt: Prompt, prompt_tokens: int, runs: dict[str, list[Generation]], reference: Generation,
                decode: DecodeConfig, tol: float,
                base_meta: dict[str, Any]) -> tuple[list[dict[str, Any]], list[pl.DataFrame]]:
    """One prompt's result rows (one per config in `runs`, which holds the `none` reference's timed runs) and step
    frames; greedy outputs are checked against `reference` (ids + margins). `repeats` counts each config's own timed
    runs (calls finished together can hold different counts). Shared by every engine's benchmark."""
    rows, steps = [], []
    ref_total = statistics.median(g.total_s for g in runs["none"])
    ref_decode = statistics.median(g.decode_tok_s() for g in runs["none"])
    for label, gens in runs.items():
        if decode.greedy:
            checks = [compare(reference.output_ids, reference.margins, g.output_ids, tol) for g in gens]
            worst = next((c for c in checks if c.status == "mismatch"),
                         next((c for c in checks if c.status == "near-tie"), checks[0]))
        else:
            worst = None
        g0 = gens[0]
        total = statistics.median(g.total_s for g in gens)
        decode_rate = statistics.median(g.decode_tok_s() for g in gens)
        n_steps = max(g0.steps, 1)
        rows.append({
            **base_meta, "config": label, "category": prompt.category, "prompt_id": prompt.id,
            "prompt_tokens": prompt_tokens, "new_tokens": g0.new_tokens, "finish": g0.finish, "steps": g0.steps,
            "tokens_per_step": g0.tokens_per_step(), "decode_tok_s": decode_rate,
            "e2e_tok_s": statistics.median(g.e2e_tok_s() for g in gens),
            "ttft_s": statistics.median(g.ttft_s for g in gens), "total_s": total,
            "propose_ms_per_step": 1e3 * sum(r.propose_s for r in g0.records) / n_steps,
            "verify_ms_per_step": 1e3 * sum(r.step_s - r.propose_s for r in g0.records) / n_steps,
            "speedup_e2e": ref_total / total, "speedup_decode": decode_rate / ref_decode,
            "repeats": len(gens), **_lossless_columns(worst),
        })
        _append_steps(steps, g0.records, label, prompt.category)
    return rows, steps


def _lossless_columns(check: Any) -> dict[str, Any]:
    """The lossless verdict of one output (`hqlab.bench.lossless.compare`), or nulls where none applies (sampling)."""
    return {"lossless": None if check is None else check.lossless,
            "divergence": None if check is None else check.status,
            "first_divergence": None if check is None else check.first_divergence,
            "divergence_margin": None if check is None else check.margin}


def _append_steps(steps: list, records: list, label: str, category: str, **columns: Any) -> None:
    """One run's step records as a frame, labelled with its config, category and any other `columns`."""
    frame = records_frame(records)
    if frame.height:
        steps.append(frame.with_columns(pl.lit(label).alias("config"), pl.lit(category).alias("category"),
                                        *(pl.lit(v).alias(k) for k, v in columns.items())))


def run_batch_bench(engine: Any, prompts: Sequence[Prompt], specs: Sequence[str | RunConfig], decode: DecodeConfig,
                    *,
                    batch: int, repeats: int = 1, references: dict[str, Generation] | None = None,
                    progress: bool = True, meta: dict[str, Any] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """All prompts decoded concurrently (`batch` at a time) per config: one row per (config, prompt).

    Batch-level columns: `batch_wall_s` (median over repeats of the whole batch's wall time) and `batch_tok_s`
    (all requests' tokens / that time), the serving-throughput view. Every greedy output is checked against the
    batch-1 no-speculation reference (`references` by prompt id, computed here when not given).
    """
    if batch < 1 or repeats < 1:
        raise ConfigError(f"batch and repeats must be >= 1 (got batch={batch}, repeats={repeats})")
    configs = parse_configs(specs)
    if any(c.external is not None for c in configs):
        raise ConfigError("batched runs take hqlab proposers only (transformers' generate runs one request)")
    encoded = encode_prompts(engine, prompts, decode.max_new_tokens)
    base_meta = run_meta(engine, decode, meta, batch=batch)
    tol = NEAR_TIE_TOL.get(base_meta["dtype"], 0.01)
    names = [p.id for p in prompts]
    if references is None:
        references = {p.id: engine.generate(ids, None, decode, request=p.id) for p, ids in zip(prompts, encoded)}
    rows, steps = [], []
    for config in tqdm(configs, desc=f"batch {batch}", disable=not progress):
        walls, first = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            gens = engine.generate_batch(encoded, config.proposer, decode, requests=names, max_batch=batch)
            walls.append(time.perf_counter() - t0)
            first = first or gens
        wall = statistics.median(walls)
        total_tokens = sum(g.new_tokens for g in first)
        for prompt, g in zip(prompts, first):
            ref = references[prompt.id]
            check = compare(ref.output_ids, ref.margins, g.output_ids, tol) if decode.greedy else None
            n_steps = max(g.steps, 1)
            rows.append({
                **base_meta, "config": config.label, "category": prompt.category, "prompt_id": prompt.id,
                "new_tokens": g.new_tokens, "steps": g.steps, "tokens_per_step": g.tokens_per_step(),
                "mean_block": sum(r.block for r in g.records) / n_steps,
                "long_share": sum(r.block >= max(config.proposer.k, 1) for r in g.records) / n_steps,
                "batch_wall_s": wall, "batch_tok_s": total_tokens / wall, "repeats": repeats,
                **_lossless_columns(check),
            })
            _append_steps(steps, g.records, config.label, prompt.category)
    results = with_provenance(pl.DataFrame(rows), engine.device)
    return results, (pl.concat(steps, how="diagonal_relaxed") if steps else pl.DataFrame())


def part_path(out: str | Path, part: str = "steps") -> Path:
    """Where a results file's companion frame goes: `<stem>.<part>.parquet` beside `<stem>.parquet` (the step
    records: `<stem>.steps.parquet`)."""
    out = Path(out)
    return out.with_name(f"{out.stem}.{part}.parquet")


def write_results(out: str | Path, results: pl.DataFrame, steps: pl.DataFrame | None = None,
                  **parts: pl.DataFrame) -> list[Path]:
    """Write a benchmark's results to `out`, its step records beside it (`part_path(out)`) and any other frames
    (`part_path(out, name)`), each atomically; companion frames without rows are not written. The results go
    last, so whoever finds them finds their steps. Returns the paths written."""
    written = []
    for part, frame in ({"steps": steps} | parts).items():
        if frame is not None and frame.height:
            written.append(write_atomic(part_path(out, part), lambda tmp, f=frame: f.write_parquet(tmp)))
    return [write_atomic(out, lambda tmp: results.write_parquet(tmp)), *written]


__all__ = ["run_bench", "run_batch_bench", "write_results", "part_path", "parse_configs",
           "check_specs", "check_workload", "prompt_rows", "run_meta", "with_provenance", "encode_prompts", "EXTERNAL",
           "known", "RunConfig", "HFPLDConfig", "HFPlainConfig"]

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
import torch
from tqdm.auto import tqdm

from hqlab.config import ConfigError, DecodeConfig, build_config, parse_spec
from hqlab import provenance
from hqlab.lossless import NEAR_TIE_TOL, compare
from hqlab.proposers import REGISTRY, Proposer, make_proposer
from hqlab.trace import Generation, acceptance_curve, records_frame
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


@dataclass(frozen=True)
class RunConfig:
    label: str
    proposer: Proposer | None = None  # hqlab engine with this proposer
    external: Any = None  # or one of the EXTERNAL configs

    @property
    def is_reference(self) -> bool:
        return self.label == "none"


def parse_configs(specs: Sequence[str]) -> list[RunConfig]:
    """Validate every spec before anything runs; `none` (the reference) is always first."""
    configs: list[RunConfig] = [RunConfig("none", make_proposer("none"))]
    for spec in specs:
        name, values = parse_spec(spec)
        label = spec.strip()
        if label == "none" or any(c.label == label for c in configs):
            continue
        if name in EXTERNAL:
            configs.append(RunConfig(label, external=build_config(EXTERNAL[name], values, context=name)))
        elif name in REGISTRY:
            configs.append(RunConfig(label, proposer=make_proposer(spec)))
        else:
            known = sorted([*REGISTRY, *EXTERNAL])
            raise ConfigError(f"unknown proposer {name!r} in {spec!r}; known: {', '.join(known)}")
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
    from hqlab.sweep import spec_config

    for spec in specs:
        name, values = parse_spec(spec)
        if name in EXTERNAL:
            build_config(EXTERNAL[name], values, context=name)
            continue
        if name not in REGISTRY:
            known = sorted([*REGISTRY, *EXTERNAL])
            raise ConfigError(f"unknown proposer {name!r} in {spec!r}; known: {', '.join(known)}")
        config = spec_config(spec)
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
            from hqlab.vocab import VocabError, load_draft_vocab

            try:
                load_draft_vocab(config.vocab)
            except VocabError as e:
                raise ConfigError(f"{spec!r}: {e}") from None


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU {provenance.cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_meta(engine: Any, decode: DecodeConfig, meta: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The columns every result row of `engine` shares: engine, model, dtype, machine, the provenance columns
    (`hqlab.provenance.COLUMNS`: commit, torch/transformers/triton/vllm versions, device) and `meta`."""
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    return {"engine": "hf", "model": getattr(engine.info, "name", "custom"), "dtype": dtype, **extra,
            "machine": machine_description(engine.device), **provenance.provenance(engine.device),
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


def run_bench(engine: Any, prompts: Sequence[Prompt], specs: Sequence[str], decode: DecodeConfig, *,
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
        prompt_result, prompt_steps = prompt_rows(prompt, len(ids), runs, runs["none"][0], decode, tol, base_meta,
                                                  repeats)
        rows += prompt_result
        steps += prompt_steps
    bar.close()
    results = with_provenance(pl.DataFrame(rows), engine.device)
    step_frame = pl.concat(steps, how="diagonal_relaxed") if steps else pl.DataFrame()
    return results, step_frame


def prompt_rows(prompt: Prompt, prompt_tokens: int, runs: dict[str, list[Generation]], reference: Generation,
                decode: DecodeConfig, tol: float, base_meta: dict[str, Any],
                repeats: int) -> tuple[list[dict[str, Any]], list[pl.DataFrame]]:
    """One prompt's result rows (one per config in `runs`, which holds the `none` reference's timed runs) and step
    frames; greedy outputs are checked against `reference` (ids + margins). Shared by every engine's benchmark."""
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
            "repeats": repeats, **_lossless_columns(worst),
        })
        _append_steps(steps, g0.records, label, prompt.category)
    return rows, steps


def _lossless_columns(check: Any) -> dict[str, Any]:
    """The lossless verdict of one output (`hqlab.lossless.compare`), or nulls where none applies (sampling)."""
    return {"lossless": None if check is None else check.lossless,
            "divergence": None if check is None else check.status,
            "first_divergence": None if check is None else check.first_divergence,
            "divergence_margin": None if check is None else check.margin}


def _append_steps(steps: list, records: list, label: str, category: str) -> None:
    frame = records_frame(records)
    if frame.height:
        steps.append(frame.with_columns(pl.lit(label).alias("config"), pl.lit(category).alias("category")))


def run_batch_bench(engine: Any, prompts: Sequence[Prompt], specs: Sequence[str], decode: DecodeConfig, *,
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


def summarize(results: pl.DataFrame) -> pl.DataFrame:
    """Per (category, config): medians over prompts of tokens/step, decode tok/s and speedup; lossless count."""
    return (results.group_by(["category", "config"], maintain_order=True)
            .agg(pl.len().alias("prompts"),
                 pl.col("tokens_per_step").median().round(2),
                 pl.col("decode_tok_s").median().round(2),
                 pl.col("speedup_e2e").median().round(2),
                 pl.col("propose_ms_per_step").median().round(3),
                 pl.col("verify_ms_per_step").median().round(1),
                 (pl.col("divergence") == "identical").sum().alias("identical"),
                 (pl.col("divergence") == "near-tie").sum().alias("near_ties"),
                 (pl.col("divergence") == "mismatch").sum().alias("mismatches")))


def acceptance_by_position(steps: pl.DataFrame) -> pl.DataFrame:
    """Per (category, config, position): share of drafts that accepted more than `position` tokens."""
    out = []
    for (category, config), group in steps.group_by(["category", "config"], maintain_order=True):
        drafts = group.filter(pl.col("proposed").list.len() > 0)
        if drafts.height == 0:
            continue
        curve = acceptance_curve(drafts["accepted"].to_numpy(), int(drafts["proposed"].list.len().max()))
        out.extend({"category": category, "config": config, "position": i + 1, "acceptance": float(a)}
                   for i, a in enumerate(curve))
    # typed even when no config drafted (a plot of it then says so instead of failing on unknown columns)
    return pl.DataFrame(out, schema={"category": pl.String, "config": pl.String, "position": pl.Int64,
                                     "acceptance": pl.Float64})


# The core benchmark's figures by kind: `core_figures` writes the first three, the notebook the rest.
CORE_FIGURE_KINDS = ("speedup", "tokens_per_step", "step_time", "decode_tok_s", "acceptance_by_position",
                     "acceptance_hist")


def core_figure_names(tag: str, kinds: Sequence[str] = CORE_FIGURE_KINDS) -> list[str]:
    """Figures the core benchmark notebook writes for a results tag (all kinds by default)."""
    return [f"core_{tag}_{kind}.svg" for kind in kinds]


def fusion_figure_names(tag: str) -> dict[str, str]:
    """Figures the fusion benchmark notebook writes for a results tag, by kind."""
    return {kind: f"fusion_{tag}_{kind}.svg" for kind in ("tps", "speedup", "time", "batch")}


def core_figures(results: pl.DataFrame, tag: str, fig_dir: Path) -> list[Path]:
    """The core benchmark's three figures: wall-time speedup, tokens/step, and where a step's time goes."""
    from hqlab import plots

    per_cat = results.group_by(["category", "config"], maintain_order=True).agg(
        pl.col("speedup_e2e").median(), pl.col("tokens_per_step").median(),
        pl.col("propose_ms_per_step").median().alias("propose"),
        pl.col("verify_ms_per_step").median().alias("verify"))
    paths = [fig_dir / name for name in core_figure_names(tag, ("speedup", "tokens_per_step", "step_time"))]
    plots.save(plots.grouped_bars(per_cat, "category", "speedup_e2e", "config", rule_at=1.0,
                                  y_title="wall-time speedup over no speculation"), paths[0])
    plots.save(plots.grouped_bars(per_cat, "category", "tokens_per_step", "config", rule_at=1.0,
                                  y_title="tokens per verify step"), paths[1])
    plots.save(plots.stacked_time(per_cat.select("category", "config", "propose", "verify"), "config",
                                  ["propose", "verify"], facet="category"), paths[2])
    return paths


__all__ = ["run_bench", "run_batch_bench", "summarize", "parse_configs", "acceptance_by_position", "core_figures"]

"""Suites through an engine, and the project's benchmarks as library calls (the drivers in `benchmarks/` and the
notebooks call these): the core benchmark, the fusion benchmark, and the draft vocabulary's acceptance study."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import polars as pl

from hqlab.bench.harness import parse_configs, run_batch_bench, run_bench, with_provenance
from hqlab.config import DecodeConfig
from hqlab.workloads import load_workload


def run_suites(engine: Any, suites: Mapping[str, int], specs: Sequence[str], *, model: str | None = None,
               decode: DecodeConfig = DecodeConfig(), doc_tokens: int = 1500, limit: int = 0, repeats: int = 1,
               device: str = "auto", dtype: str = "auto", concurrency: int = 0, tensor_parallel_size: int = 1,
               pipeline_parallel_size: int = 1, progress: bool = True) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Every config on every suite (`suites`: suite name -> max_new_tokens, the other decoding settings from
    `decode`), the first `limit` prompts of each (0: all); returns the results and steps of all suites together.

    `engine`: "hf" (the transformers engine, loaded here from `model`, `device` and `dtype` after the proposers,
    so a drafter loads first), an engine already loaded, or "vllm" (one vLLM engine per config on a CUDA GPU,
    `hqlab.bench.vllm.bench_suite`; `concurrency`, `tensor_parallel_size` and `pipeline_parallel_size` apply
    there).
    """
    frames, step_frames = [], []
    for_suite = {suite: dataclasses.replace(decode, max_new_tokens=n) for suite, n in suites.items()}
    if engine == "vllm":
        from hqlab.bench.vllm import bench_suite

        for suite, suite_decode in for_suite.items():
            results, steps = bench_suite(model, suite, specs, suite_decode, doc_tokens=doc_tokens, limit=limit,
                                         repeats=repeats, dtype=dtype, progress=progress, concurrency=concurrency,
                                         tensor_parallel_size=tensor_parallel_size,
                                         pipeline_parallel_size=pipeline_parallel_size)
            frames.append(with_provenance(results, "cuda"))
            step_frames.append(steps)
    else:
        configs = parse_configs(specs)  # builds the proposers (a drafter loads here) before the target
        if engine == "hf":
            from hqlab.engines.hf import HFEngine

            engine = HFEngine.load(model, device=device, dtype=dtype)
        for suite, suite_decode in for_suite.items():
            prompts = load_workload(suite, doc_tokens=doc_tokens, tokenizer=engine.tokenizer)[: limit or None]
            results, steps = run_bench(engine, prompts, configs, suite_decode, repeats=repeats, progress=progress,
                                       meta={"suite": suite, "doc_tokens": doc_tokens})
            frames.append(results)
            step_frames.append(steps)
    return pl.concat(frames, how="diagonal_relaxed"), pl.concat(step_frames, how="diagonal_relaxed")


# ----------------------------------------------------------------------------------------------------------------
# The fusion benchmark: lookup, model drafter, fusion and the adaptive long block, live


def fusion_configs(drafter: str, dtype: str, device: str) -> tuple[list[str], list[str]]:
    """The fusion benchmark's configs: (one request at a time, four requests at once). The drafter runs in the
    target's dtype on its device."""
    d = f"model={drafter},dtype={dtype},device={device}"
    single = [f"draft:k=7,{d}", "lookup:nmin=6,nmax=12,k=7", "lookup:nmin=6,nmax=12,k=15", f"fused:k=7,{d}",
              f"fused:k=15,sticky=0,{d}", f"fused:k=15,sticky=3,{d}"]
    batched = [f"fused:k=15,sticky=3,{d}", f"fused:k=15,sticky=3,batch_mode=unanimous,{d}"]
    return single, batched


BATCH_TASKS = ("copy", "summary", "code", "qa")  # the soak composition of SPEC §3


def fusion_benchmark(tag: str, root: str | Path | None = None, *, target: str = "qwen2.5-coder-1.5b",
                     drafter: str = "qwen2.5-coder-0.5b", device: str = "auto", dtype: str = "auto",
                     doc_tokens: int = 1500, new_tokens: int = 160, repeats: int = 1, batch: int = 4,
                     single: bool = True, batched: bool = True, progress: bool = True) -> dict[str, pl.DataFrame]:
    """The labd suite through the target with the fusion configs (`fusion_configs`), greedy, every output checked
    against the engine's own no-speculation output; then `BATCH_TASKS` decoded concurrently at `batch`, each
    checked against its batch-1 reference. Writes the run `fusion/<tag>` of the results folder `root` (default
    data/results; `hqlab.bench.results`): rows and steps, batch and batch_steps; returns the rows and the batch's
    rows by table name."""
    from hqlab import provenance
    from hqlab.bench import results as committed
    from hqlab.engines.hf import HFEngine

    engine = HFEngine.load(target, device=device, dtype=dtype)
    run_dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    single_specs, batch_specs = fusion_configs(drafter, run_dtype, engine.device.type)
    prompts = load_workload("labd", doc_tokens=doc_tokens, tokenizer=engine.tokenizer)
    decode = DecodeConfig(max_new_tokens=new_tokens)
    meta = {"suite": "labd", "doc_tokens": doc_tokens, "drafter": drafter}
    frames: dict[str, pl.DataFrame] = {}
    tables: dict[str, pl.DataFrame] = {}
    if single:
        results, steps = run_bench(engine, prompts, single_specs, decode, repeats=repeats, progress=progress,
                                   meta=meta)
        tables = {"rows": results, "steps": steps}
        frames["rows"] = results
    if batched:
        by_id = {p.id: p for p in prompts}
        results, steps = run_batch_bench(engine, [by_id[t] for t in BATCH_TASKS], batch_specs, decode, batch=batch,
                                         repeats=repeats, progress=progress, meta=meta)
        tables |= {"batch": results, "batch_steps": steps}
        frames["batch"] = results
    committed.write_run("fusion", tag, card=committed.card_of(results["machine"][0]), tables=tables, root=root,
                        info={"commit": provenance.git_commit(), "benchmark": "hqlab.bench.suites.fusion_benchmark"})
    return frames


# ----------------------------------------------------------------------------------------------------------------
# The draft vocabulary's acceptance study


def vocab_acceptance(target: str, drafter: str, corpus: str | Path, sizes: Sequence[int], *, k: int = 7,
                     prompts: int = 6, live_prompts: int = 1, max_new_tokens: int = 64, device: str = "auto",
                     dtype: str = "auto", vocab_model: str | None = None,
                     progress: bool = True) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A drafter cut to the top-N list of `corpus` (N in `sizes`; 0 = the full vocabulary, no list) drafting k
    tokens for `target`, on the first `prompts` prompts the corpus holds out (their answers were not counted).

    Returns (replayed, live): every prompt replayed (exact under greedy decoding; with `output_coverage`, the
    share of the output the list contains), and the first `live_prompts` run live through the engine (tok/s,
    drafter and verify time, the lossless check). Both have a column `n` (the list size) instead of the spec.
    The lists are counted with the tokenizer of `vocab_model` (default: the target's)."""
    import tempfile

    import numpy as np

    from hqlab import vocab
    from hqlab.engines.hf import HFEngine
    from hqlab.replay import sweep
    from hqlab.replay.traces import cached_traces
    from hqlab.vocab import selfgen

    from hqlab.provenance import machine_description

    _, tokenizer, vocab_size = vocab.model_files(vocab_model or target)
    counts = vocab.count_corpus([corpus], tokenizer, vocab_size, progress=False)
    order = vocab.rank(counts.counted, vocab.special_token_ids(tokenizer))
    held_ids = vocab.heldout_prompt_ids(corpus)[:prompts]
    chosen = [p for p in selfgen.load_prompts() if p.id in held_ids]
    lists_dir = Path(tempfile.mkdtemp(prefix="draft-vocab-"))
    specs = {}
    for n in sizes:
        if n:
            path = vocab.write_id_list(lists_dir / f"ids-{n}.json", vocab.top_n(order, n))
            specs[f"draft:model={drafter},k={k},vocab={path}"] = n
        else:
            specs[f"draft:model={drafter},k={k}"] = vocab_size
    if progress:
        print(f"lists from {corpus}; {len(chosen)} held-out prompts: {[p.id for p in chosen]}")

    engine = HFEngine.load(target, device=device, dtype=dtype)
    decode = DecodeConfig(max_new_tokens=max_new_tokens)
    if progress:
        print(machine_description(engine.device))
    live, _ = run_bench(engine, chosen[:live_prompts], list(specs), decode, progress=progress)
    live = live.with_columns(pl.col("config").replace_strict(specs, default=0).alias("n")).drop("config")
    traces = cached_traces(target, chosen, max_new_tokens, dtype=dtype, device=device, engine=engine,
                           progress=progress).traces
    replayed = sweep.sweep(traces, list(specs), progress=progress).with_columns(
        pl.col("config").replace_strict(specs).alias("n"))
    # coverage of each held-out output by each list: the ceiling the list puts on the drafter
    outputs = {t.prompt_id: np.asarray(t.output_ids) for t in traces}
    coverage = [dict(config=spec, prompt_id=pid, output_coverage=float(np.isin(out, vocab.top_n(order, n)).mean())
                     if n < vocab_size else 1.0) for spec, n in specs.items() for pid, out in outputs.items()]
    replayed = replayed.join(pl.DataFrame(coverage), on=["config", "prompt_id"]).drop("config")
    return replayed, live

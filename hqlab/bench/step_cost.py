"""The verify-step cost grid measured inside vLLM (benchmarks/vllm_step_cost.py, docs/seed-scale.md): the Qwen2.5
shapes, the points a grid measures and the order it times them in, the row a point writes, and the rows a GPU call
returns read back. Standard library only at import (polars inside `grid_rows`): the GPU host has no polars."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence

# Qwen2.5 shapes (the published configs' values); "qwen2.5-27b" is a dense Qwen2.5-style shape of the seeds'
# 27B class (Qwen2.5 has none): the 32B's width and depth with a narrower MLP, 27.2B parameters.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "tie_word_embeddings")
SHAPES = {name: dict(zip(SHAPE_KEYS, values)) for name, values in {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-27b": (5120, 22016, 64, 40, 8, 152064, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
}.items()}
TOKENIZER_FROM = "qwen2.5-coder-1.5b"  # its tokenizer files and base config (same tokenizer family)
DRAFTER = "qwen2.5-coder-0.5b"
WIDTHS = (1, 2, 4, 8, 16, 32)
CONTEXTS = (1024, 8192, 32768)
BATCHES = (1, 8, 32)
MEASURED_STEPS = 12  # steps timed per point, after WARM_STEPS
WARM_STEPS = 3


def params_b(shape: dict) -> float:
    """Parameters in billions of a Qwen2 config (embeddings counted once when tied)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head
    layer = h * h + 2 * h * kv + (h + 2 * kv) + h * h + 3 * h * i + 2 * h  # q,k,v (+bias), o, mlp, norms
    embed = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return (n * layer + embed + h) / 1e9


# The validation shapes (0.5B, 1.5B) only need the points of the committed runs they are checked against:
# one request at a time, prompts of a few hundred to about 2,500 tokens (docs/seed-scale.md).
VALIDATION_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
VALIDATION_CONTEXTS = (1024, 8192)
VALIDATION_BATCHES = (1, 8)


def points(config: str, shape: str = "", *, contexts: Sequence[int] | None = None,
           batches: Sequence[int] | None = None, widths: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """(context, batch, width) measured for a config, in the order they run (contexts outermost: one prefill each).
    gpu-fused's drafter keeps a cache of its own and prefills each request's prompt itself (no prefix caching):
    its 32k context runs at batch 1 only. `contexts`, `batches`, `widths` replace the plan's (a validation measures
    only the points it prices: benchmarks/seed_scale_validation.py); gpu-fused never measures width 1."""
    small = shape in VALIDATION_SHAPES
    default_contexts, default_batches = (VALIDATION_CONTEXTS, VALIDATION_BATCHES) if small else (CONTEXTS, BATCHES)
    contexts = tuple(sorted(set(contexts))) if contexts else default_contexts
    batches = tuple(sorted(set(batches))) if batches else default_batches
    widths = tuple(sorted(set(widths))) if widths else WIDTHS
    if config == "none":  # an engine without a speculator: one token a request a step
        widths = (1,)
    widths = widths if config in ("gpu-lookup", "none") else tuple(w for w in widths if w > 1)
    return [(c, b, w) for c in contexts for b in batches for w in widths
            if config != "gpu-fused" or c < 32768 or b == 1]


def round_schedule(points: Sequence[tuple[int, int, int]], steps: int, rounds: int) -> list[tuple[int, tuple, int]]:
    """The order a call measures its points in: `rounds` passes over all of them, each timing a share of the `steps` a
    point gets (the first `steps % rounds` passes one step more), as (round, point, steps). With one round, each point's
    steps in one burst (as the first validations timed them). Several rounds spread a point's steps over the whole call,
    so that a host whose speed changes in episodes of seconds (docs/vllm.md) is met in the same mix of states by every
    point, as by decodes that last minutes."""
    if rounds < 1 or steps < rounds:
        raise ValueError(f"rounds must be in [1, steps={steps}] so that every round times a step (got {rounds})")
    share = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    return [(r, point, share[r]) for r in range(rounds) for point in points]


def measured_points(rows_path: Path, shape: str, quant: str, config: str) -> set[tuple[int, int, int]]:
    """(context, batch, width) already in the rows file for this (shape, quant, config): a later call skips them."""
    if not rows_path.exists():
        return set()
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    return {(r["context"], r["batch"], r["width"]) for r in rows
            if (r["shape"], r["quant"], r["config"]) == (shape, quant, config)}


def point_row(args: Any, config: str, width: int, context: int, batch: int, step_s: Sequence[float],
              start_s: float, machine: str, version: str, *, rounds: int = 1) -> dict:
    """One measured point as a rows-file line: the median, p10 and p90 of its timed steps (seconds) in ms, their mean
    (`step_ms_mean`: the timed wall time over the steps, which outputs arriving in bursts cannot bias: a committed
    grid's batch-8 width-32 points at 8k had a p10 below a single request's step, calls that returned without a forward
    pass), and the rounds they were timed in. `args`: the `one` command's (tag, shape, quant, engine, commit and the
    requests' temperature: above 0 vLLM's rejection sampler draws, which a greedy grid does not price)."""
    shape = SHAPES[args.shape]
    ms = sorted(1e3 * s for s in step_s)
    return {"run": args.tag, "shape": args.shape, "target_params_b": round(params_b(shape), 3),
            "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"], "quant": args.quant,
            "config": config, "width": width, "context": context, "batch": batch,
            "step_ms": statistics.median(ms), "step_ms_mean": sum(ms) / len(ms),
            "step_ms_p10": ms[int(0.1 * (len(ms) - 1))],
            "step_ms_p90": ms[int(round(0.9 * (len(ms) - 1)))], "steps": len(ms), "rounds": rounds,
            "drafter": DRAFTER if config == "gpu-fused" else "", "engine_start_s": round(start_s, 1),
            "engine": args.engine, "temperature": float(getattr(args, "temperature", 0.0) or 0.0), "machine": machine, "vllm_version": version, "git_commit": args.commit}


def grid_rows(returned: str | Path) -> dict:
    """The returned grid rows of every seed_scale_*.jsonl under `returned`, one frame per run (tag), in the order
    readers expect; rows from before the `engine` column were measured in-process, those without `temperature` greedily."""
    import polars as pl

    src = Path(returned)
    rows = [json.loads(line) for f in sorted(src.glob("seed_scale_*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]
    if not rows:
        raise SystemExit(f"no seed_scale_*.jsonl rows under {src}")
    frame = pl.DataFrame(rows)
    if "engine" not in frame.columns:
        frame = frame.with_columns(pl.lit("inprocess").alias("engine"))
    frame = frame.sort("run", "target_params_b", "quant", "config", "context", "batch", "width")
    return {tag: frame.filter(pl.col("run") == tag) for tag in frame["run"].unique(maintain_order=True)}

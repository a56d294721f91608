"""Parameter sweeps over recorded greedy traces: exact acceptance by replay, speed from the measured cost model.

1. `record_traces`: run the target once per prompt without speculation (cached on disk by content: model,
   prompt tokens, decoding settings), keeping its output.
2. `sweep`: replay every proposer spec over every trace (exact for greedy decoding, see `hqlab.replay`).
3. `predict`: price each replayed step with a `CostModel` and compare with the no-speculation run's price.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.config import ConfigError, DecodeConfig
from hqlab.costmodel import CostModel
from hqlab.io import write_atomic
from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.trace import tokens_per_step
from hqlab.workloads import Prompt

TRACE_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"


@dataclass(frozen=True)
class Trace:
    prompt_id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    max_new_tokens: int


def _trace_key(model: str, prompt_ids: Sequence[int], decode: DecodeConfig) -> str:
    blob = json.dumps([model, list(prompt_ids), decode.max_new_tokens, decode.temperature, decode.seed])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def record_traces(engine: Any, prompts: Sequence[Prompt], decode: DecodeConfig, *, cache_dir: Path | None = TRACE_DIR,
                  progress: bool = True) -> list[Trace]:
    """Greedy no-speculation outputs for `prompts`, from the on-disk cache when the same run was done before."""
    if not decode.greedy:
        raise ConfigError("traces for replay must be greedy (temperature 0): sampled outputs are not reproducible")
    info = getattr(engine, "info", None)
    model_key = f"{getattr(info, 'name', 'custom')}:{getattr(info, 'sha256', None)}:{getattr(info, 'dtype', '')}"
    traces = []
    for prompt in tqdm(prompts, desc="traces", disable=not progress):
        ids = engine.encode_chat(list(prompt.messages))
        engine.check_fits(len(ids), decode.max_new_tokens, f"prompt {prompt.id!r}")
        path = cache_dir / f"{_trace_key(model_key, ids, decode)}.json" if cache_dir else None
        if path is not None and path.exists():
            output = json.loads(path.read_text())["output_ids"]
        else:
            output = engine.generate(ids, None, decode, request=prompt.id).output_ids
            if path is not None:
                record = {"model": model_key, "prompt_id": prompt.id, "max_new_tokens": decode.max_new_tokens,
                          "output_ids": output}
                write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record)))
        traces.append(Trace(prompt.id, prompt.category, ids, output, decode.max_new_tokens))
    return traces


def grid(name: str, **axes: Iterable[Any]) -> list[str]:
    """Specs for the cartesian product of `axes`, skipping combinations the config rejects (e.g. nmin > nmax)."""
    specs = []
    keys = list(axes)
    for values in itertools.product(*(list(axes[k]) for k in keys)):
        spec = f"{name}:" + ",".join(f"{k}={v}" for k, v in zip(keys, values))
        try:
            make_proposer(spec)
        except ConfigError:
            continue
        specs.append(spec)
    return specs


def sweep(traces: Sequence[Trace], specs: Sequence[str], *, cost: CostModel | None = None,
          progress: bool = True, time_proposals: bool = True) -> pl.DataFrame:
    """One row per (spec, trace): replayed tokens/step, steps, proposal time, and (with `cost`) predicted speed.

    The no-speculation price of each trace is the cost model's sum over its one-token steps, so
    `speedup_pred` compares like with like.
    """
    rows = []
    for spec in tqdm(list(specs), desc="sweep", disable=not progress):
        proposer = make_proposer(spec)
        params = dict(kv.split("=") for kv in spec.partition(":")[2].split(",") if kv)
        for tr in traces:
            records = replay(tr.prompt_ids, tr.output_ids, proposer, max_new_tokens=tr.max_new_tokens,
                             request=tr.prompt_id, time_proposals=time_proposals)
            row: dict[str, Any] = {
                "config": spec, **{f"p_{k}": v for k, v in params.items()}, "category": tr.category,
                "prompt_id": tr.prompt_id, "new_tokens": len(tr.output_ids), "steps": len(records),
                "tokens_per_step": tokens_per_step(records),
                "accepted": sum(r.accepted for r in records),
                "propose_ms_per_step": 1e3 * float(np.mean([r.propose_s for r in records])) if records else 0.0,
            }
            if cost is not None:
                spec_s = cost.decode_seconds(records)
                base_s = sum(cost.step_ms(1, len(tr.prompt_ids) + i) / 1e3 for i in range(len(tr.output_ids) - 1))
                row.update(pred_decode_s=spec_s, pred_base_s=base_s, speedup_pred=base_s / spec_s if spec_s else 1.0)
            rows.append(row)
    return pl.DataFrame(rows)


def by_category(frame: pl.DataFrame) -> pl.DataFrame:
    """Pool prompts per (config, category): tokens/step = tokens emitted by verify steps / steps (the first
    token of each request comes from prefill), predicted speedup = summed prices."""
    params = [c for c in frame.columns if c.startswith("p_")]
    aggs = [(pl.col("new_tokens") - 1).sum().alias("step_tokens"), pl.col("steps").sum(),
            pl.col("propose_ms_per_step").median(), *[pl.col(c).first() for c in params]]
    if "pred_decode_s" in frame.columns:
        aggs += [pl.col("pred_decode_s").sum(), pl.col("pred_base_s").sum()]
    out = frame.group_by(["config", "category"], maintain_order=True).agg(aggs)
    out = out.with_columns((pl.col("step_tokens") / pl.col("steps")).alias("tokens_per_step"))
    if "pred_decode_s" in out.columns:
        out = out.with_columns((pl.col("pred_base_s") / pl.col("pred_decode_s")).alias("speedup_pred"))
    return out


def best_overall(frame: pl.DataFrame) -> pl.DataFrame:
    """Configs ranked by the geometric mean over task classes of the predicted speedup (then the worst class):
    one standalone default that is good everywhere rather than best on one class."""
    table = by_category(frame)
    return (table.group_by("config").agg(pl.col("speedup_pred").log().mean().exp().alias("geomean_speedup"),
                                         pl.col("speedup_pred").min().alias("worst_class"),
                                         pl.col("tokens_per_step").mean().alias("mean_tokens_per_step"))
            .sort(["geomean_speedup", "worst_class"], descending=True))

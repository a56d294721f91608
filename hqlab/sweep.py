"""Parameter sweeps over recorded greedy traces: exact acceptance by replay, speed from the measured cost model.

1. `record_traces`: run the target once per prompt without speculation (cached on disk by content: model,
   prompt tokens, decoding settings), keeping its output. `cached_traces` reads the cache with the tokenizer
   alone (no model load).
2. `sweep`: replay every proposer spec over every trace (exact for greedy decoding, see `hqlab.replay`). The
   lookup and PLD proposers take the vectorised path of `hqlab.fastreplay` (the same steps, far faster); any
   other proposer (fused, drafter, ...) is replayed step by step with the engine's own code.
3. Price each replayed step with a `CostModel` (and the proposer's measured cost) and compare with the
   no-speculation run's price.

Grids: `parse_grid("lookup:nmin=1|2|6,nmax=8|12,k=15")` expands `|`-separated values of any keys a proposer's
config accepts (lookup, fusion and scheduler keys of a fused proposer alike).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.config import ConfigError, DecodeConfig
from hqlab import fastreplay
from hqlab.config import parse_spec
from hqlab.costmodel import CostModel, ProposalCost
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


def model_key(name: str, sha256: str | None, dtype: str) -> str:
    """What identifies the target in a trace's cache key."""
    return f"{name}:{sha256}:{dtype}"


def record_traces(engine: Any, prompts: Sequence[Prompt], decode: DecodeConfig, *, cache_dir: Path | None = TRACE_DIR,
                  progress: bool = True) -> list[Trace]:
    """Greedy no-speculation outputs for `prompts`, from the on-disk cache when the same run was done before."""
    if not decode.greedy:
        raise ConfigError("traces for replay must be greedy (temperature 0): sampled outputs are not reproducible")
    info = getattr(engine, "info", None)
    key = model_key(getattr(info, "name", "custom"), getattr(info, "sha256", None), getattr(info, "dtype", ""))
    traces = []
    for prompt in tqdm(prompts, desc="traces", disable=not progress):
        ids = engine.encode_chat(list(prompt.messages))
        engine.check_fits(len(ids), decode.max_new_tokens, f"prompt {prompt.id!r}")
        path = cache_dir / f"{_trace_key(key, ids, decode)}.json" if cache_dir else None
        if path is not None and path.exists():
            output = json.loads(path.read_text())["output_ids"]
        else:
            output = engine.generate(ids, None, decode, request=prompt.id).output_ids
            if path is not None:
                record = {"model": key, "prompt_id": prompt.id, "max_new_tokens": decode.max_new_tokens,
                          "output_ids": output}
                write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record)))
        traces.append(Trace(prompt.id, prompt.category, ids, output, decode.max_new_tokens))
    return traces


class TracesMissing(ConfigError):
    """Some prompts have no cached trace for this model and decoding settings."""


def cached_traces(model: str, prompts: Sequence[Prompt], decode: DecodeConfig, *, tokenizer: Any = None,
                  dtype: str = "bfloat16", cache_dir: Path = TRACE_DIR) -> list[Trace]:
    """The cached traces of `prompts` without loading the model (only its tokenizer): the same keys as
    `record_traces`. Raises `TracesMissing` naming the prompts that were never recorded."""
    from hqlab import models

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(models.prepare(model))
    sha = models.offline_entry(model).sha256 if model in models.offline_names() else None
    key = model_key(model, sha, models.resolve_dtype(dtype))
    traces, missing = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        path = cache_dir / f"{_trace_key(key, ids, decode)}.json"
        if not path.exists():
            missing.append(prompt.id)
            continue
        traces.append(Trace(prompt.id, prompt.category, ids, json.loads(path.read_text())["output_ids"],
                            decode.max_new_tokens))
    if missing:
        raise TracesMissing(f"no cached trace of {model} ({dtype}, max_new_tokens={decode.max_new_tokens}) for "
                            f"prompt(s) {', '.join(missing)}; record them first (hqlab sweep records missing traces)")
    return traces


def save_traces(traces: Sequence[Trace], path: str | Path, *, model: str = "") -> Path:
    """Write a trace set to parquet (one row per request), atomically: results computed from traces should
    ship with the traces themselves (the cache under data/traces is not part of the repository)."""
    frame = pl.DataFrame({"prompt_id": [t.prompt_id for t in traces], "category": [t.category for t in traces],
                          "prompt_ids": [list(t.prompt_ids) for t in traces],
                          "output_ids": [list(t.output_ids) for t in traces],
                          "max_new_tokens": [t.max_new_tokens for t in traces], "model": [model] * len(traces)},
                         schema_overrides={"prompt_ids": pl.List(pl.Int64), "output_ids": pl.List(pl.Int64)})
    return write_atomic(path, lambda tmp: frame.write_parquet(tmp))


def load_traces(path: str | Path) -> list[Trace]:
    """Read a trace set written by `save_traces`; a missing column or an output longer than its limit is an
    error naming the file."""
    path = Path(path)
    frame = pl.read_parquet(path)
    need = {"prompt_id", "category", "prompt_ids", "output_ids", "max_new_tokens"}
    if not need <= set(frame.columns):
        raise ConfigError(f"{path}: not a trace set (missing column(s) {', '.join(sorted(need - set(frame.columns)))})")
    traces = []
    for i, row in enumerate(frame.iter_rows(named=True)):
        if len(row["output_ids"]) > row["max_new_tokens"]:
            raise ConfigError(f"{path}: row {i} ({row['prompt_id']!r}) has more output tokens than max_new_tokens")
        traces.append(Trace(row["prompt_id"], row["category"], row["prompt_ids"], row["output_ids"],
                            row["max_new_tokens"]))
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


def parse_grid(text: str) -> list[str]:
    """Expand `NAME:key=v1|v2|...,key2=...` into specs (cartesian product; combinations the proposer's config
    rejects, such as nmin > nmax, are skipped). A grid that yields nothing valid is an error."""
    name, values = parse_spec(text)
    axes = {k: [x.strip() for x in v.split("|")] for k, v in values.items()}
    for k, vals in axes.items():
        if any(not x for x in vals):
            raise ConfigError(f"grid {text!r}: key {k!r} has an empty value in {values[k]!r}")
    if not axes:
        make_proposer(name)
        return [name]
    specs = grid(name, **axes)
    if not specs:
        # say why: build the first combination and let its error speak
        make_proposer(f"{name}:" + ",".join(f"{k}={v[0]}" for k, v in axes.items()))
        raise ConfigError(f"grid {text!r} has no valid combination")
    return specs


def measure_proposal_cost(proposer: Any, traces: Sequence[Trace], *, samples: int = 48, repeats: int = 3,
                          seed: int = 0) -> ProposalCost:
    """Time `proposer.propose` at `samples` positions drawn across the traces (median of `repeats` calls each)
    and fit proposal ms against history length."""
    rng = np.random.default_rng(seed)
    pool = [(i, d) for i, tr in enumerate(traces) for d in range(1, len(tr.output_ids))]
    if not pool:
        return ProposalCost()
    picks = [pool[j] for j in rng.choice(len(pool), size=min(samples, len(pool)), replace=False)]
    lens, ms = [], []
    histories = {}
    for i, done in picks:
        tr = traces[i]
        if i not in histories:
            histories[i] = np.asarray([*tr.prompt_ids, *tr.output_ids], dtype=np.int64)
        view = histories[i][: len(tr.prompt_ids) + done]
        budget = max(tr.max_new_tokens - done - 1, 0)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proposer.propose([view], [budget], keys=[f"cost-{i}"])
            times.append(time.perf_counter() - t0)
        lens.append(view.size)
        ms.append(1e3 * float(np.median(times)))
    return ProposalCost.fit(lens, ms)


def _spec_params(spec: str) -> dict[str, str]:
    return parse_spec(spec)[1]


def sweep(traces: Sequence[Trace], specs: Sequence[str], *, cost: CostModel | None = None,
          progress: bool = True, time_proposals: bool = True, fast: bool = True,
          proposal_samples: int = 48) -> pl.DataFrame:
    """One row per (spec, trace): replayed tokens/step, steps, proposal time, and (with `cost`) predicted speed.

    Proposal time: for the vectorised replay, the proposer is timed at `proposal_samples` positions and a linear
    model of history length prices every step; the step-by-step replay times every call. `cost.proposal`, when
    set, overrides both. The no-speculation price of each trace is the cost model's sum over its one-token steps,
    so `speedup_pred` compares like with like.
    """
    rows: list[dict[str, Any]] = []
    frames: list[pl.DataFrame] = []
    index = None
    base_s = None
    if cost is not None:  # the no-speculation price of each trace does not depend on the configuration
        base_s = np.array([cost.baseline_seconds(len(tr.prompt_ids), len(tr.output_ids)) for tr in traces])
    for spec in tqdm(list(specs), desc="sweep", disable=not progress):
        proposer = make_proposer(spec)
        params = _spec_params(spec)
        base = {"config": spec, **{f"p_{k}": v for k, v in params.items()}}
        if fast and fastreplay.supports(proposer):
            if index is None:
                index = fastreplay.TraceIndex([fastreplay.TraceInput(tr.prompt_ids, tr.output_ids, tr.max_new_tokens,
                                                                     tr.prompt_id) for tr in traces])
            proposal = cost.proposal if cost is not None and cost.proposal is not None else (
                measure_proposal_cost(proposer, traces, samples=proposal_samples) if time_proposals else None)
            frames.append(_fast_rows(index, proposer, traces, base, cost, proposal, base_s))
            continue
        for i, tr in enumerate(traces):
            records = replay(tr.prompt_ids, tr.output_ids, proposer, max_new_tokens=tr.max_new_tokens,
                             request=tr.prompt_id, time_proposals=time_proposals)
            row: dict[str, Any] = {
                **base, "category": tr.category, "prompt_id": tr.prompt_id, "new_tokens": len(tr.output_ids),
                "steps": len(records), "tokens_per_step": tokens_per_step(records),
                "accepted": sum(r.accepted for r in records),
                "propose_ms_per_step": 1e3 * float(np.mean([r.propose_s for r in records])) if records else 0.0,
                "replay": "step",
            }
            if cost is not None:
                spec_s = cost.decode_seconds(records)
                row.update(pred_decode_s=spec_s, pred_base_s=float(base_s[i]),
                           speedup_pred=float(base_s[i]) / spec_s if spec_s else 1.0)
            rows.append(row)
    if rows:
        frames.append(pl.DataFrame(rows))
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


def _fast_rows(index: fastreplay.TraceIndex, proposer: Any, traces: Sequence[Trace], base: dict[str, Any],
               cost: CostModel | None, proposal: ProposalCost | None, base_s: np.ndarray | None) -> pl.DataFrame:
    """The sweep's rows for one configuration from the vectorised replay, aggregated per trace without a
    Python loop over steps or traces."""
    table = fastreplay.replay_table(index, proposer)
    n = len(traces)
    steps = np.bincount(table.trace, minlength=n)
    accepted = np.bincount(table.trace, weights=table.accepted, minlength=n)
    prop_ms = proposal.ms(table.context_len + 1) if proposal is not None else np.zeros(len(table))
    prop_sum = np.bincount(table.trace, weights=prop_ms, minlength=n)
    safe = np.maximum(steps, 1)
    cols: dict[str, Any] = {
        **{k: [v] * n for k, v in base.items()}, "category": [t.category for t in traces],
        "prompt_id": [t.prompt_id for t in traces], "new_tokens": index.out_len, "steps": steps,
        "tokens_per_step": np.where(steps > 0, (accepted + steps) / safe, np.nan), "accepted": accepted.astype(np.int64),
        "propose_ms_per_step": np.where(steps > 0, prop_sum / safe, 0.0), "replay": ["fast"] * n}
    if cost is not None:
        step_s = np.bincount(table.trace, weights=np.asarray(cost.step_ms(table.verify_len, table.context_len)),
                             minlength=n) / 1e3
        spec_s = step_s + prop_sum / 1e3
        cols.update(pred_decode_s=spec_s, pred_base_s=base_s,
                    speedup_pred=np.where(spec_s > 0, base_s / np.where(spec_s > 0, spec_s, 1.0), 1.0))
    return pl.DataFrame(cols)


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


# ----------------------------------------------------------------------------------------------------------------
# `hqlab sweep`


def add_cli_arguments(p: Any) -> None:
    p.add_argument("--model", default=None, help="offline short name, local path or hub id (default: the 0.5B)")
    p.add_argument("--suite", default="all", help="labd, chat, all, a task name, or a JSONL file")
    p.add_argument("--grid", action="append", default=[], metavar="GRID",
                   help="NAME:key=v1|v2,key2=...: every combination, repeatable; e.g. lookup:nmin=1|2|6,nmax=8|12")
    p.add_argument("--proposer", action="append", default=[], metavar="SPEC", help="single specs, repeatable")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--doc-tokens", type=int, default=1500, help="document length for the labd tasks")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--cost", type=Path, default=None,
                   help="step-cost grid (.parquet with context_len, verify_len, step_ms) to predict speed from")
    p.add_argument("--measure-cost", action="store_true",
                   help="measure the step-cost grid on this machine first (loads the model)")
    p.add_argument("--cached-only", action="store_true", help="fail instead of recording missing traces")
    p.add_argument("--traces", type=Path, default=None,
                   help="a saved trace set (.parquet from save_traces) instead of --suite/--model's cached traces")
    p.add_argument("--out", required=True, type=Path, help="results .parquet, one row per (config, prompt)")


def cli(args: Any) -> int:
    """`hqlab sweep`: validate everything, get traces (cache first), replay the grid, write parquet."""
    from hqlab import models
    from hqlab.workloads import load_workload

    if args.out.suffix != ".parquet":
        raise ConfigError(f"--out must end in .parquet (got {str(args.out)!r})")
    if args.cost is not None and args.measure_cost:
        raise ConfigError("give --cost or --measure-cost, not both")
    if args.cost is not None and not args.cost.exists():
        raise ConfigError(f"--cost {str(args.cost)!r}: no such file")
    specs = [s for g in args.grid for s in parse_grid(g)] + [s for s in args.proposer if make_proposer(s)]
    specs = list(dict.fromkeys(specs))
    if not specs:
        raise ConfigError("nothing to sweep: give --grid and/or --proposer")
    model = args.model or models.DEFAULT_MODEL
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    cost = CostModel.fit(pl.read_parquet(args.cost)) if args.cost is not None else None
    if args.traces is not None and not args.traces.exists():
        raise ConfigError(f"--traces {str(args.traces)!r}: no such file")

    engine = None
    if args.traces is not None:
        traces = load_traces(args.traces)
        traces = traces[: args.limit] if args.limit else traces
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(models.prepare(model))
        prompts = load_workload(args.suite, doc_tokens=args.doc_tokens, tokenizer=tokenizer)
        prompts = prompts[: args.limit] if args.limit else prompts
        try:
            traces = cached_traces(model, prompts, decode, tokenizer=tokenizer, dtype=args.dtype)
        except TracesMissing as e:
            if args.cached_only:
                raise
            print(f"{e}; recording them now")
            traces = None
    if traces is None or args.measure_cost:
        from hqlab.engines.hf import HFEngine

        engine = HFEngine.load(model, device=args.device, dtype=args.dtype)
    if traces is None:
        traces = record_traces(engine, prompts, decode)
    if args.measure_cost:
        from hqlab.costmodel import measure_step_times

        longest = max(len(t.prompt_ids) + len(t.output_ids) for t in traces)
        contexts = sorted({128, 512, *range(1024, longest + 1024, 1024)})
        cost = CostModel.fit(measure_step_times(engine, contexts, [1, 2, 4, 8, 12, 16]))
        print(cost.describe())
    print(f"{len(specs)} configurations × {len(traces)} traces ({sum(len(t.output_ids) for t in traces)} tokens)")
    t0 = time.perf_counter()
    frame = sweep(traces, specs, cost=cost)
    print(f"replayed in {time.perf_counter() - t0:.1f}s")
    write_atomic(args.out, lambda tmp: frame.write_parquet(tmp))
    table = by_category(frame)
    cols = ["config", "category", "tokens_per_step", *(["speedup_pred"] if cost is not None else [])]
    with pl.Config(tbl_rows=40, tbl_width_chars=160, fmt_str_lengths=60):
        print(table.sort("tokens_per_step", descending=True).select(cols).head(40))
    print(f"wrote {args.out}")
    return 0

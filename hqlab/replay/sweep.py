"""Parameter sweeps over recorded greedy traces: exact acceptance by replay, speed from the measured cost model.

1. Traces: the target's greedy no-speculation output per prompt, cached on disk by content (model and checkpoint
   hash, dtype, device, prompt tokens, decoding settings; `TraceOrigin.key`) with the provenance of the run that
   recorded it. `cached_traces(model, suite, max_new_tokens, dtype=..., device=...)` is the one way in for
   notebooks and commands: it loads only the tokenizer when everything is cached and the model only to record
   what is missing; `record_traces(engine, prompts, decode)` does the same with an engine already loaded.
2. `sweep`: replay every proposer spec over every trace (exact for greedy decoding, see `hqlab.replay`). The
   lookup and PLD proposers take the vectorised path of `hqlab.fastreplay` (the same steps, far faster); any
   other proposer (fused, drafter, ...) is replayed step by step with the engine's own code.
3. Price each replayed step with a `CostModel` (and the proposer's measured cost) and compare with the
   no-speculation run's price.

Grids: `parse_grid("lookup:nmin=1|2|6,nmax=8|12,k=15")` expands `|`-separated values of any keys a proposer's
config accepts (lookup, fusion and scheduler keys of a fused proposer alike). The command is `hqlab sweep`
(`hqlab/cli.py`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.config import ConfigError, DecodeConfig
from hqlab import fastreplay, provenance
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
    provenance: dict[str, Any] | None = field(default=None, compare=False)  # who recorded it (hqlab.provenance)


@dataclass(frozen=True)
class TraceOrigin:
    """What produced a trace's output, and so what its cache key holds besides the prompt and decoding
    settings: the model (resolved name and checkpoint hash), the dtype and the device (`provenance.device_name`:
    bf16 near-ties break differently on CPU and CUDA, so their greedy outputs may differ)."""

    model: str
    sha256: str | None
    dtype: str
    device: str

    @classmethod
    def resolve(cls, model: str, *, dtype: str = "auto", device: str = "auto") -> "TraceOrigin":
        """The origin of traces `HFEngine.load(model, device=device, dtype=dtype)` would record, without loading
        anything (a user's .gguf file is hashed)."""
        from hqlab import models

        source, name = models.resolve(model)
        sha = None
        if source == "offline":
            sha = models.offline_entry(name).sha256
        elif source == "path" and Path(name).is_file():
            sha = models.sha256_file(name)
        return cls(name, sha, models.resolve_dtype(dtype), provenance.device_name(models.resolve_device(device)))

    @classmethod
    def of_engine(cls, engine: Any) -> "TraceOrigin":
        from hqlab import models

        info = getattr(engine, "info", None)
        name = getattr(info, "name", "custom")
        try:
            name = models.resolve(name)[1]
        except models.ModelError:
            pass
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        return cls(name, getattr(info, "sha256", None), dtype, provenance.device_name(engine.device))

    def key(self, prompt_ids: Sequence[int], decode: DecodeConfig) -> str:
        """The cache key of one trace: this origin, the prompt's tokens and the decoding settings."""
        blob = json.dumps([self.model, self.sha256, self.dtype, self.device, list(map(int, prompt_ids)),
                           decode.max_new_tokens, decode.temperature, decode.seed])
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def describe(self) -> str:
        return f"{self.model} ({self.dtype}, {self.device})"


def _encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids exactly as the engine encodes them (its own method, given only the tokenizer)."""
    from types import SimpleNamespace

    from hqlab.engines.hf import HFEngine

    return HFEngine.encode_chat(SimpleNamespace(tokenizer=tokenizer), list(prompt.messages))


def _read_cached(path: Path) -> dict[str, Any] | None:
    """A cached trace record, or None where there is none (or an unreadable one, which is recorded afresh)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("output_ids"), list) else None


def _record(engine: Any, origin: TraceOrigin, prompt: Prompt, ids: list[int], decode: DecodeConfig,
            path: Path | None) -> Trace:
    """Decode one prompt without speculation and cache the output with its origin and provenance."""
    output = engine.generate(ids, None, decode, request=prompt.id).output_ids
    prov = provenance.provenance(engine.device)
    if path is not None:
        record = {"model": origin.model, "sha256": origin.sha256, "dtype": origin.dtype, "device": origin.device,
                  "prompt_id": prompt.id, "max_new_tokens": decode.max_new_tokens, "provenance": prov,
                  "output_ids": output}
        write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record)))
    return Trace(prompt.id, prompt.category, ids, output, decode.max_new_tokens, prov)


def _check_greedy(decode: DecodeConfig) -> None:
    if not decode.greedy:
        raise ConfigError("traces for replay must be greedy (temperature 0): sampled outputs are not reproducible")


def record_traces(engine: Any, prompts: Sequence[Prompt], decode: DecodeConfig, *, cache_dir: Path | None = TRACE_DIR,
                  progress: bool = True) -> list[Trace]:
    """Greedy no-speculation outputs of `engine` for `prompts`, from the on-disk cache when the same run (same
    model, dtype, device, prompt and settings) was done before. `cached_traces` is the same cache for callers
    that have not loaded the model (it loads it only if something is missing)."""
    _check_greedy(decode)
    origin = TraceOrigin.of_engine(engine)
    traces = []
    for prompt in tqdm(prompts, desc="traces", disable=not progress):
        ids = engine.encode_chat(list(prompt.messages))
        engine.check_fits(len(ids), decode.max_new_tokens, f"prompt {prompt.id!r}")
        path = cache_dir / f"{origin.key(ids, decode)}.json" if cache_dir else None
        record = _read_cached(path) if path is not None else None
        if record is not None:
            traces.append(Trace(prompt.id, prompt.category, ids, record["output_ids"], decode.max_new_tokens,
                                record.get("provenance")))
        else:
            traces.append(_record(engine, origin, prompt, ids, decode, path))
    return traces


class TracesMissing(ConfigError):
    """Some prompts have no cached trace for this model and decoding settings."""


@dataclass
class TraceSet:
    """Traces of a workload (`cached_traces`): the traces, their prompts, the tokenizer that encoded them, where
    they come from, how many this call recorded (0: all from the cache) and the engine, if one was loaded."""

    traces: list[Trace]
    prompts: list[Prompt]
    tokenizer: Any
    origin: TraceOrigin
    recorded: int
    engine: Any = None


def cached_traces(model: str | None, suite: str | Sequence[Prompt], max_new_tokens: int, *, dtype: str = "auto",
                  device: str = "auto", doc_tokens: int | None = 1500, limit: int = 0, engine: Any = None,
                  record: bool = True, cache_dir: Path = TRACE_DIR, progress: bool = True) -> TraceSet:
    """The greedy no-speculation traces of `model` on `suite` (a suite name, a JSONL file or a list of prompts;
    the first `limit` if > 0), one per prompt, through the on-disk trace cache shared by every notebook and
    command: a trace set is recorded once per model, prompt, length, dtype and device.

    Only the tokenizer is loaded when every trace is cached. Missing traces are recorded with `engine` when one
    is given (it must be `model` on `device` in `dtype`), else by loading the model; with `record=False` they
    raise `TracesMissing` naming the prompts."""
    from hqlab import models
    from hqlab.workloads import load_workload

    decode = DecodeConfig(max_new_tokens=max_new_tokens)
    _check_greedy(decode)
    if limit < 0:
        raise ConfigError(f"limit must be >= 0, 0 meaning all prompts (got {limit})")
    model = model or models.DEFAULT_MODEL
    origin = TraceOrigin.resolve(model, dtype=dtype, device=device)
    if engine is not None and TraceOrigin.of_engine(engine) != origin:
        raise ConfigError(f"the engine given is {TraceOrigin.of_engine(engine).describe()}, "
                          f"not the requested {origin.describe()}")
    if engine is not None:
        tokenizer = engine.tokenizer
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(models.prepare(model))
    if isinstance(suite, str):
        prompts = load_workload(suite, doc_tokens=doc_tokens, tokenizer=tokenizer)
    else:
        prompts = list(suite)
    prompts = prompts[:limit] if limit else prompts
    encoded = [_encode(tokenizer, p) for p in prompts]
    found: dict[int, Trace] = {}
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        rec = _read_cached(cache_dir / f"{origin.key(ids, decode)}.json")
        if rec is not None:
            found[i] = Trace(prompt.id, prompt.category, ids, rec["output_ids"], max_new_tokens,
                             rec.get("provenance"))
    missing = [i for i in range(len(prompts)) if i not in found]
    if missing and not record:
        raise TracesMissing(f"no cached trace of {origin.describe()}, max_new_tokens={max_new_tokens} for "
                            f"prompt(s) {', '.join(prompts[i].id for i in missing)}; record them first "
                            f"(hqlab sweep records missing traces)")
    if missing:
        if engine is None:
            from hqlab.engines.hf import HFEngine

            print(f"recording {len(missing)} of {len(prompts)} traces of {origin.describe()}", flush=True)
            engine = HFEngine.load(model, device=device, dtype=dtype)
        for i in missing:  # every prompt checked before the first is decoded
            engine.check_fits(len(encoded[i]), max_new_tokens, f"prompt {prompts[i].id!r}")
        for i in tqdm(missing, desc="traces", disable=not progress):
            found[i] = _record(engine, origin, prompts[i], encoded[i], decode,
                               cache_dir / f"{origin.key(encoded[i], decode)}.json")
    return TraceSet([found[i] for i in range(len(prompts))], prompts, tokenizer, origin, len(missing), engine)


def save_traces(traces: Sequence[Trace], path: str | Path, *, model: str = "") -> Path:
    """Write a trace set to parquet (one row per request), atomically: results computed from traces should
    ship with the traces themselves (the cache under data/traces is not part of the repository). Each row
    carries the provenance its trace was recorded with (`provenance_*` columns, null where unknown)."""
    frame = pl.DataFrame({"prompt_id": [t.prompt_id for t in traces], "category": [t.category for t in traces],
                          "prompt_ids": [list(t.prompt_ids) for t in traces],
                          "output_ids": [list(t.output_ids) for t in traces],
                          "max_new_tokens": [t.max_new_tokens for t in traces], "model": [model] * len(traces),
                          **{f"provenance_{c}": [(t.provenance or {}).get(c) for t in traces]
                             for c in provenance.COLUMNS}},
                         schema_overrides={"prompt_ids": pl.List(pl.Int64), "output_ids": pl.List(pl.Int64),
                                           **{f"provenance_{c}": pl.String for c in provenance.COLUMNS}})
    return write_atomic(path, lambda tmp: frame.write_parquet(tmp))


def load_traces(path: str | Path) -> list[Trace]:
    """Read a trace set written by `save_traces`; an unreadable file, a missing column or an output longer than
    its limit is an error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such trace set file")
    try:
        frame = pl.read_parquet(path)
    except Exception as e:  # polars raises several kinds for a file that is not parquet
        raise ConfigError(f"{path}: not a readable parquet trace set ({type(e).__name__})") from None
    need = {"prompt_id", "category", "prompt_ids", "output_ids", "max_new_tokens"}
    if not need <= set(frame.columns):
        raise ConfigError(f"{path}: not a trace set (missing column(s) {', '.join(sorted(need - set(frame.columns)))})")
    prov_cols = [c for c in provenance.COLUMNS if f"provenance_{c}" in frame.columns]
    traces = []
    for i, row in enumerate(frame.iter_rows(named=True)):
        if len(row["output_ids"]) > row["max_new_tokens"]:
            raise ConfigError(f"{path}: row {i} ({row['prompt_id']!r}) has more output tokens than max_new_tokens")
        prov = {c: row[f"provenance_{c}"] for c in prov_cols} or None
        traces.append(Trace(row["prompt_id"], row["category"], row["prompt_ids"], row["output_ids"],
                            row["max_new_tokens"], prov))
    return traces


def traces_provenance(traces: Sequence[Trace]) -> dict[str, str | None]:
    """Provenance columns for results replayed from `traces`: this process's commit and versions, and the
    device the traces were recorded on ("unknown" when they do not say, or say different things)."""
    devices = {(t.provenance or {}).get("device") for t in traces}
    device = devices.pop() if len(devices) == 1 else None
    return {**provenance.provenance("cpu"), "device": device or "unknown"}


def spec_config(spec: str) -> Any:
    """The validated config dataclass of a registered proposer's spec, without building the proposer (so a
    drafter's model is not loaded): raises ConfigError naming what is wrong."""
    from hqlab.config import build_config
    from hqlab.proposers import REGISTRY

    name, values = parse_spec(spec)
    if name not in REGISTRY:
        raise ConfigError(f"unknown proposer {name!r} in {spec!r}; known: {', '.join(sorted(REGISTRY))}")
    return build_config(REGISTRY[name].Config, values, context=f"proposer {name!r}")


def grid(name: str, **axes: Iterable[Any]) -> list[str]:
    """Specs for the cartesian product of `axes`, skipping combinations the config rejects (e.g. nmin > nmax)."""
    specs = []
    keys = list(axes)
    for values in itertools.product(*(list(axes[k]) for k in keys)):
        spec = f"{name}:" + ",".join(f"{k}={v}" for k, v in zip(keys, values))
        try:
            spec_config(spec)
        except ConfigError:
            continue
        specs.append(spec)
    return specs


def parse_grid(text: str) -> list[str]:
    """Expand `NAME:key=v1|v2|...,key2=...` into specs (cartesian product; combinations the proposer's config
    rejects, such as nmin > nmax, are skipped). Every value must be valid for its key on its own (`nmin=x` is
    an error, not a skipped value) and take part in at least one valid combination; otherwise the error names
    the value and why it fails."""
    import dataclasses
    import typing

    from hqlab.config import _coerce
    from hqlab.proposers import REGISTRY

    name, values = parse_spec(text)
    if name not in REGISTRY:
        raise ConfigError(f"grid {text!r}: unknown proposer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name].Config
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"grid {text!r}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    axes = {k: [x.strip() for x in v.split("|")] for k, v in values.items()}
    for k, vals in axes.items():
        if any(not x for x in vals):
            raise ConfigError(f"grid {text!r}: key {k!r} has an empty value in {values[k]!r}")
        for x in vals:
            try:
                _coerce(x, hints[k], f"{name}: {k}")
            except ConfigError as e:
                raise ConfigError(f"grid {text!r}: {e}") from None
    if not axes:
        spec_config(name)
        return [name]
    specs = grid(name, **axes)
    used = {k: set() for k in axes}
    for spec in specs:
        for k, v in parse_spec(spec)[1].items():
            used[k].add(v)
    for k, vals in axes.items():
        for x in vals:
            if x in used[k]:
                continue
            # say why: build the first combination with this value and let its error speak
            first = {key: (x if key == k else v[0]) for key, v in axes.items()}
            try:
                spec_config(f"{name}:" + ",".join(f"{key}={v}" for key, v in first.items()))
            except ConfigError as e:
                raise ConfigError(f"grid {text!r}: {k}={x} is in no valid combination ({e})") from None
            raise ConfigError(f"grid {text!r}: {k}={x} is in no valid combination")
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

"""Traces: the target's greedy no-speculation output per prompt, what every replay runs over.

A `Trace` holds one request: its prompt's token ids, the output and the max_new_tokens it ran with (plus the
prompt's id and category, and who recorded it). Traces are cached on disk by content (model and checkpoint hash,
dtype, device, prompt tokens, decoding settings; `TraceOrigin.key`) with the provenance of the run that recorded
them. `cached_traces(model, suite, max_new_tokens, dtype=..., device=...)` is the one way in for notebooks and
commands: it loads only the tokenizer when everything is cached and the model only to record what is missing;
`record_traces(engine, prompts, decode)` does the same with an engine already loaded. `save_traces` and
`load_traces` keep a trace set in one parquet file, to ship with results computed from it.

Shipped trace sets (`cached_traces(..., shipped=[file])`): the repository carries traces its notebooks replay
(data/results/traces/<set>/traces.parquet), so a first `make figures` need not spend most of an hour decoding the 1.5B
target on a CPU. A shipped trace stands in for a missing cached one only where it is what this machine would record:
same model, checkpoint, dtype, prompt tokens and max_new_tokens, recorded on the same device (`device_name`) with the
same torch and transformers versions (greedy near-ties break differently elsewhere, and a notebook that checks replay
against live runs would fail). A trace without that provenance is never taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import polars as pl
from tqdm.auto import tqdm

from hqlab import provenance
from hqlab.config import ConfigError, DecodeConfig
from hqlab.io import REPO, read_table, sha256_bytes, sha256_file, write_atomic
from hqlab.workloads import Prompt, encode_chat


TRACE_DIR = REPO / "data" / "traces"


@dataclass(frozen=True)
class Trace:
    """One recorded request: the prompt's id, category and token ids, the target's greedy output, and the
    max_new_tokens it ran with (near the end of the output it caps the proposal budget)."""

    prompt_id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    max_new_tokens: int
    provenance: dict[str, Any] | None = field(default=None, compare=False)  # who recorded it (hqlab.provenance)

    @classmethod
    def of(cls, prompt_ids: Sequence[int], output_ids: Sequence[int], max_new_tokens: int, prompt_id: str = "0",
           category: str = "") -> "Trace":
        """A trace from token ids alone (a request outside any workload)."""
        return cls(prompt_id, category, prompt_ids, output_ids, max_new_tokens)


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
            sha = sha256_file(name, f"sha256 {Path(name).name}")
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
        return sha256_bytes(blob.encode())[:24]

    def describe(self) -> str:
        return f"{self.model} ({self.dtype}, {self.device})"


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
        ids = encode_chat(engine.tokenizer, prompt.messages)
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
    they come from, how many this call recorded (0: none), the engine, if one was loaded, and how many came from
    a shipped trace set."""

    traces: list[Trace]
    prompts: list[Prompt]
    tokenizer: Any
    origin: TraceOrigin
    recorded: int
    engine: Any = None
    shipped: int = 0  # how many came from a shipped trace set (each keeps the provenance of its recording)


def cached_traces(model: str | None, suite: str | Sequence[Prompt], max_new_tokens: int, *, dtype: str = "auto",
                  device: str = "auto", doc_tokens: int | None = 1500, limit: int = 0, engine: Any = None,
                  record: bool = True, cache_dir: Path = TRACE_DIR, progress: bool = True,
                  shipped: str | Path | Sequence[str | Path] = ()) -> TraceSet:
    """The greedy no-speculation traces of `model` on `suite` (a suite name, a JSONL file or a list of prompts;
    the first `limit` if > 0), one per prompt, through the on-disk trace cache shared by every notebook and
    command: a trace set is recorded once per model, prompt, length, dtype and device.

    Only the tokenizer is loaded when every trace is cached. Missing traces are recorded with `engine` when one
    is given (it must be `model` on `device` in `dtype`), else by loading the model; with `record=False` they
    raise `TracesMissing` naming the prompts. `shipped`: trace set files (`save_traces`) consulted before
    recording, for traces this machine would record (`shipped_traces`: same model, checkpoint, dtype, prompt
    tokens, max_new_tokens, device and torch/transformers); a file that does not exist is an error, one without
    a matching trace adds nothing."""
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
    encoded = [encode_chat(tokenizer, p.messages) for p in prompts]
    found: dict[int, Trace] = {}
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        rec = _read_cached(cache_dir / f"{origin.key(ids, decode)}.json")
        if rec is not None:
            found[i] = Trace(prompt.id, prompt.category, ids, rec["output_ids"], max_new_tokens,
                             rec.get("provenance"))
    missing = [i for i in range(len(prompts)) if i not in found]
    from_files = shipped_traces(shipped, origin, max_new_tokens) if missing and shipped else {}
    taken = [i for i in missing if tuple(encoded[i]) in from_files]
    for i in taken:
        trace = from_files[tuple(encoded[i])]
        found[i] = Trace(prompts[i].id, prompts[i].category, encoded[i], trace.output_ids, max_new_tokens,
                         trace.provenance)
    missing = [i for i in missing if i not in found]
    if taken:  # shipped traces were recorded on this device (`shipped_traces` checks it)
        print(f"{len(taken)} of {len(prompts)} traces of {origin.describe()} from shipped trace sets (recorded on "
              f"{origin.device}); pass no shipped files to record them on this machine", flush=True)
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
    return TraceSet([found[i] for i in range(len(prompts))], prompts, tokenizer, origin, len(missing), engine,
                    len(taken))


def shipped_model(origin: TraceOrigin) -> str:
    """The `model` column `save_traces` is given for a shipped set: name, checkpoint hash and dtype."""
    return f"{origin.model}:{origin.sha256}:{origin.dtype}"


def shipped_traces(paths: str | Path | Sequence[str | Path], origin: TraceOrigin,
                   max_new_tokens: int) -> dict[tuple[int, ...], Trace]:
    """The traces of shipped trace set files that `origin` with `max_new_tokens` would record on this machine, by
    prompt tokens: rows of the same model, checkpoint and dtype (the file's `model` column, `shipped_model`), the
    same max_new_tokens, and recorded on `origin.device` with this process's torch and transformers. A missing
    file is an error naming it; other rows are skipped."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    want = shipped_model(origin)
    here = provenance.versions()
    same_machine = {"device": origin.device, "torch": here.get("torch"), "transformers": here.get("transformers")}
    out: dict[tuple[int, ...], Trace] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"shipped trace set {str(path)!r} does not exist (pass no shipped files to record "
                              f"the traces instead)")
        traces = load_traces(path)  # validates the file
        names = pl.read_parquet(path, columns=["model"])["model"].to_list() \
            if "model" in pl.read_parquet_schema(path) else [""] * len(traces)  # no model column: matches nothing
        for trace, model in zip(traces, names):
            recorded = trace.provenance or {}
            if model == want and trace.max_new_tokens == max_new_tokens and \
                    all(recorded.get(key) == value for key, value in same_machine.items()):
                out.setdefault(tuple(int(t) for t in trace.prompt_ids), trace)
    return out


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
    frame = read_table(path, {"prompt_id", "category", "prompt_ids", "output_ids", "max_new_tokens"}, str(path),
                       ConfigError, "trace set")
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

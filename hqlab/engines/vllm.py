"""vLLM engine: hqlab workloads on `vllm`'s engine, with hqlab's metrics.

Configurations (the `--proposer` specs of `hqlab bench`, one vLLM engine each):

- `none`: no speculation, vLLM's defaults otherwise; the reference every greedy output is checked against.
- `vllm-ngram:nmin=..,nmax=..,k=..`: vLLM's own n-gram proposer (`method="ngram"`, prompt_lookup_min/max,
  num_speculative_tokens) — the same rule hqlab's `vllm-ngram` proposer replays.
- `arctic-suffix:k=..,depth=..,factor=..,min_prob=..,cached=..`: vLLM's suffix decoding (`method="suffix"`, needs
  arctic-inference) with the settings of hqlab's `arctic-suffix` proposer.
- any other hqlab proposer spec (`lookup:...`, `pld:...`): hqlab's own code inside vLLM through the
  `custom_class` adapter (`hqlab.engines.vllm_proposer`).

Measurements: requests run one at a time (batch size 1, as `hqlab bench`). Each engine step's output is timed as it
arrives, and vLLM's speculative-decoding counters for that step (drafts, draft tokens, accepted tokens, per
position; read through a stat logger) become the step's `StepRecord`. For hqlab proposers the adapter also reports
the drafted token ids, match length and proposal time; vLLM's own proposers report only how many tokens they
drafted, so their `proposed` ids are -1 and their proposal time is unknown (NaN). The no-speculation reference is
run once more with top-2 logprobs: the logit margins that tell a near-tie flip from a real mismatch.

The GPU side needs only vLLM, torch and pyarrow: `run_configs` returns plain `Generation`s and `raw_table` stores
them; `frames_from_raw` (polars, anywhere) turns them into the rows and step frames `hqlab.bench` writes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from hqlab.config import ConfigError, DecodeConfig, build_config, parse_spec
from hqlab.engines import vllm_proposer
from hqlab.proposers import REGISTRY, make_proposer
from hqlab.proposers.base import Source
from hqlab.trace import Generation, StepRecord

NATIVE = {"vllm-ngram": "ngram", "arctic-suffix": "suffix"}  # hqlab proposer name -> vLLM's own method
UNKNOWN_TOKEN = -1  # a drafted position whose token id vLLM does not report


@dataclass(frozen=True)
class VLLMOptions:
    """How every engine of a benchmark is built (the same for all configs, so they differ only in speculation)."""

    model: str  # a folder vLLM can load (hqlab.models.prepare gives one for offline names and .gguf files)
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    max_num_seqs: int = 8  # requests run one at a time: small batch limits keep engine start-up short
    max_cudagraph_capture_size: int = 32  # CUDA graphs up to this many tokens per step (k + 1 <= 32 is covered)
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False
    enable_prefix_caching: bool = False  # off: every repeat pays its prefill, as in hqlab's own engine
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 64:
            raise ConfigError(f"max_model_len must be >= 64 (got {self.max_model_len})")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_cudagraph_capture_size < 1:
            raise ConfigError(f"max_cudagraph_capture_size must be >= 1 (got {self.max_cudagraph_capture_size})")
        if not 0.05 <= self.gpu_memory_utilization <= 0.95:
            raise ConfigError(f"gpu_memory_utilization must be in [0.05, 0.95] (got {self.gpu_memory_utilization})")


@dataclass(frozen=True)
class EngineSetting:
    """What one config changes in the engine: vLLM's speculative config, plus the adapter's extras."""

    label: str
    speculative_config: dict[str, Any] | None
    additional_config: dict[str, Any] = field(default_factory=dict)
    worker_extension_cls: str | None = None
    k: int = 0  # most tokens drafted per step

    @property
    def uses_adapter(self) -> bool:
        return self.worker_extension_cls is not None


def setting_for(spec: str) -> EngineSetting:
    """The engine setting of one spec; every error is raised here, before any engine starts."""
    label = spec.strip()
    name, values = parse_spec(label)
    if name == "none":
        if values:
            raise ConfigError(f"'none' takes no keys (got {label!r})")
        return EngineSetting(label, None)
    if name not in REGISTRY:
        raise ConfigError(f"unknown proposer {name!r} in {label!r}; the vllm engine runs none, "
                          f"{', '.join(sorted(NATIVE))} (vLLM's own) or any of {', '.join(sorted(REGISTRY))}")
    config = build_config(REGISTRY[name].Config, values, context=f"proposer {name!r}")
    if name == "vllm-ngram":
        return EngineSetting(label, {"method": "ngram", "num_speculative_tokens": config.k,
                                     "prompt_lookup_min": config.nmin, "prompt_lookup_max": config.nmax}, k=config.k)
    if name == "arctic-suffix":
        if config.offset != 0 or config.cached < 0:
            raise ConfigError(f"{label!r}: vLLM's suffix decoding has no offset and needs cached >= 0")
        return EngineSetting(label, {"method": "suffix", "num_speculative_tokens": config.k,
                                     "suffix_decoding_max_tree_depth": config.depth,
                                     "suffix_decoding_max_spec_factor": config.factor,
                                     "suffix_decoding_min_token_prob": config.min_prob,
                                     "suffix_decoding_max_cached_requests": config.cached}, k=config.k)
    k = make_proposer(label).k  # builds it once here, so a bad spec fails before vLLM starts
    if k < 1:
        raise ConfigError(f"{label!r} proposes nothing (k=0); use 'none' for no speculation")
    return EngineSetting(label, vllm_proposer.speculative_config(label, k),
                         {vllm_proposer.SPEC_KEY: label, vllm_proposer.RECORD_KEY: True},
                         vllm_proposer.EXTENSION_PATH, k=k)


def settings_for(specs: Sequence[str]) -> list[EngineSetting]:
    """`none` first (the reference), then each spec once, in order."""
    settings = [setting_for("none")]
    for spec in specs:
        if spec.strip() not in {s.label for s in settings}:
            settings.append(setting_for(spec))
    return settings


# ----------------------------------------------------------------------------------------------------------------
# Step records from what vLLM reports


@dataclass(frozen=True)
class StepEvent:
    """One engine step that emitted tokens for the request, as the engine loop saw it."""

    t: float  # seconds since the request was added
    tokens: int  # output tokens this step delivered
    drafted: int  # draft tokens vLLM verified this step (its spec-decode counters)
    accepted: int


def step_records(request: str, prompt_len: int, events: Sequence[StepEvent], *, k: int,
                 adapter: Sequence[dict[str, Any]] = ()) -> tuple[float, list[StepRecord]]:
    """(time to first token, one StepRecord per verify step); the first event is the prefill.

    `adapter` holds the adapter's records (one per draft it made, keyed by the history length it saw), which add
    the drafted token ids, the match length and the proposal time; without them ids are unknown (-1) and the
    proposal time NaN.
    """
    if not events:
        return math.nan, []
    by_context = {int(r["context_len"]): r for r in adapter}
    emitted = events[0].tokens
    prev = events[0].t
    records = []
    for j, e in enumerate(events[1:]):
        history = prompt_len + emitted  # prompt + every token emitted so far: what the proposer saw
        drafted = e.drafted
        made = by_context.get(history)
        if made is not None:
            proposed = [int(t) for t in made["tokens"][:drafted]]
            sources = [int(s) for s in made["sources"][:drafted]]
            match_len, propose_s = int(made["match_len"]), float(made["propose_s"])
        else:
            proposed = [UNKNOWN_TOKEN] * drafted
            sources = [int(Source.LOOKUP)] * drafted
            match_len, propose_s = 0, (0.0 if k == 0 else math.nan)
        records.append(StepRecord(
            request=request, step=j, context_len=history - 1, verify_len=1 + drafted, proposed=proposed,
            sources=sources, match_len=match_len, accepted=min(e.accepted, max(e.tokens - 1, 0)), emitted=e.tokens,
            step_s=e.t - prev, propose_s=propose_s, t_end=e.t, block=k, batch=1))
        emitted += e.tokens
        prev = e.t
    return events[0].t, records


# ----------------------------------------------------------------------------------------------------------------
# The engine


class _StepStats:
    """A vLLM stat logger that keeps each step's spec-decode counters (None when nothing was drafted)."""

    def __init__(self, sink: list) -> None:
        self.sink = sink

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        self.sink.append(None if spec is None else (int(spec.num_drafts), int(spec.num_draft_tokens),
                                                    int(spec.num_accepted_tokens)))

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def _stat_logger_factory(sink: list) -> Callable[..., Any]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepStats(_StepStats, StatLoggerBase):  # vLLM checks the base class
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            _StepStats.__init__(self, sink)

    return StepStats


class VLLMEngine:
    """One vLLM engine (one speculative setting) running requests one at a time."""

    def __init__(self, options: VLLMOptions, setting: EngineSetting) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.options, self.setting = options, setting
        self._stats: list = []
        args = EngineArgs(model=options.model, dtype=options.dtype, max_model_len=options.max_model_len,
                          max_num_seqs=options.max_num_seqs, gpu_memory_utilization=options.gpu_memory_utilization,
                          enforce_eager=options.enforce_eager, enable_prefix_caching=options.enable_prefix_caching,
                          seed=options.seed, speculative_config=setting.speculative_config,
                          compilation_config={"max_cudagraph_capture_size": options.max_cudagraph_capture_size},
                          additional_config=dict(setting.additional_config),
                          worker_extension_cls=setting.worker_extension_cls or "", disable_log_stats=False)
        self.engine = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._stats)])
        self._counter = 0

    def describe(self) -> dict[str, Any]:
        """What vLLM chose for this engine (recorded next to the numbers)."""
        import vllm

        c = self.engine.vllm_config
        return {"vllm": vllm.__version__, "config": self.setting.label,
                "model_runner": "v2" if getattr(c, "use_v2_model_runner", False) else "v1",
                "async_scheduling": bool(c.scheduler_config.async_scheduling),
                "cudagraph_mode": str(getattr(c.compilation_config, "cudagraph_mode", "")),
                "speculative": None if c.speculative_config is None else str(c.speculative_config)}

    def generate(self, prompt_ids: Sequence[int], decode: DecodeConfig, request: str = "0",
                 margins: bool = False) -> Generation:
        """One request alone; `margins` also asks vLLM for top-2 logprobs (the reference's near-tie margins)."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input  # what vLLM's renderer makes of a token prompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=decode.temperature, top_p=decode.top_p, top_k=decode.top_k if decode.top_k > 0 else 0,
            seed=None if decode.greedy else decode.seed, max_tokens=decode.max_new_tokens,
            logprobs=2 if margins else None, output_kind=RequestOutputKind.DELTA, detokenize=False)
        self._counter += 1
        rid = f"{request}-{self._counter}"
        if self.setting.uses_adapter:
            self.take_adapter_records()  # nothing left over from earlier requests
        events: list[StepEvent] = []
        output_ids: list[int] = []
        margin_values: list[float] = []
        finish = "length"
        t0 = time.perf_counter()
        self.engine.add_request(rid, tokens_input([int(t) for t in prompt_ids]), params)
        while self.engine.has_unfinished_requests():
            before = len(self._stats)
            outs = self.engine.step()
            t = time.perf_counter() - t0
            new = [s for s in self._stats[before:] if s is not None]
            got = 0
            for out in outs:
                completion = out.outputs[0]
                got += len(completion.token_ids)
                output_ids += list(completion.token_ids)
                if margins and completion.logprobs:
                    margin_values += [_margin(position) for position in completion.logprobs]
                if out.finished:
                    finish = "eos" if completion.finish_reason == "stop" else "length"
            if got:
                events.append(StepEvent(t, got, sum(s[1] for s in new), sum(s[2] for s in new)))
        total = time.perf_counter() - t0
        adapter = self.take_adapter_records() if self.setting.uses_adapter else []
        ttft, records = step_records(request, len(prompt_ids), events, k=self.setting.k, adapter=adapter)
        t_last = records[-1].t_end if records else ttft
        return Generation(request=request, prompt_len=len(prompt_ids), output_ids=output_ids, finish=finish,
                          ttft_s=ttft, total_s=total, t_last=t_last, records=records, margins=margin_values)

    def take_adapter_records(self) -> list[dict[str, Any]]:
        per_worker = self.engine.collective_rpc("hqlab_take_records")
        return [r for worker in per_worker for r in worker]

    def close(self) -> None:
        core = getattr(self.engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.engine


def _margin(position: dict) -> float:
    """Top-1 minus top-2 logprob at one position (= the logit margin: both share the softmax normaliser)."""
    ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
    return float(ranked[0].logprob - ranked[1].logprob) if len(ranked) > 1 else math.inf


# ----------------------------------------------------------------------------------------------------------------
# Running a suite, and the raw results


@dataclass
class Run:
    """One request's result: `repeat` -1 is the reference's margins pass (top-2 logprobs, not timed)."""

    config: str
    prompt_id: str
    category: str
    repeat: int
    generation: Generation


def check_prompts(options: VLLMOptions, prompts: Sequence[tuple[str, str, list[int]]], decode: DecodeConfig) -> None:
    for pid, _, ids in prompts:
        if len(ids) + decode.max_new_tokens > options.max_model_len:
            raise ConfigError(f"prompt {pid!r} has {len(ids)} tokens; with max_new_tokens={decode.max_new_tokens} "
                              f"that exceeds max_model_len={options.max_model_len}")


def run_setting(options: VLLMOptions, setting: EngineSetting, prompts: Sequence[tuple[str, str, list[int]]],
                decode: DecodeConfig, *, repeats: int = 1, bar: Any = None) -> tuple[list[Run], dict[str, Any]]:
    """One engine: a warm-up request, then every (prompt id, category, token ids) `repeats` times; for the `none`
    reference under greedy decoding also the margins pass. Returns the runs and the engine's description."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1 (got {repeats})")
    runs: list[Run] = []
    engine = VLLMEngine(options, setting)
    try:
        description = engine.describe()
        if prompts:  # first requests pay for lazy compilation and allocator growth
            engine.generate(prompts[0][2], DecodeConfig(max_new_tokens=32), request="warmup")
        for pid, category, ids in prompts:
            if setting.label == "none" and decode.greedy:
                runs.append(Run(setting.label, pid, category, -1, engine.generate(ids, decode, pid, margins=True)))
            for r in range(repeats):
                if bar is not None:
                    bar.set_postfix_str(f"{setting.label} · {pid}")
                runs.append(Run(setting.label, pid, category, r, engine.generate(ids, decode, request=pid)))
                if bar is not None:
                    bar.update()
    finally:
        engine.close()
    return runs, description


def run_configs(options: VLLMOptions, prompts: Sequence[tuple[str, str, list[int]]], specs: Sequence[str],
                decode: DecodeConfig, *, repeats: int = 1, progress: bool = True) -> tuple[list[Run], list[dict]]:
    """Every config (one engine at a time, `none` first) on every (prompt id, category, token ids); all specs and
    prompt lengths are checked before the first engine starts. Returns the runs and one description per engine."""
    from tqdm.auto import tqdm

    settings = settings_for(specs)
    check_prompts(options, prompts, decode)
    runs: list[Run] = []
    described = []
    bar = tqdm(total=len(settings) * len(prompts) * repeats, desc="vllm bench", disable=not progress)
    for setting in settings:
        more, description = run_setting(options, setting, prompts, decode, repeats=repeats, bar=bar)
        runs += more
        described.append(description)
    bar.close()
    return runs, described


RAW_COLUMNS = ("config", "prompt_id", "category", "repeat", "prompt_len", "output_ids", "margins", "finish",
               "ttft_s", "total_s", "t_last", "records")


def raw_table(runs: Sequence[Run]):
    """The runs as a pyarrow table (records as JSON text): written on the GPU host, where polars may be absent."""
    import pyarrow as pa

    rows = [{"config": r.config, "prompt_id": r.prompt_id, "category": r.category, "repeat": r.repeat,
             "prompt_len": r.generation.prompt_len, "output_ids": r.generation.output_ids,
             "margins": [float(m) for m in r.generation.margins], "finish": r.generation.finish,
             "ttft_s": r.generation.ttft_s, "total_s": r.generation.total_s, "t_last": r.generation.t_last,
             "records": json.dumps([asdict(s) for s in r.generation.records])} for r in runs]
    schema = pa.schema([("config", pa.string()), ("prompt_id", pa.string()), ("category", pa.string()),
                        ("repeat", pa.int32()), ("prompt_len", pa.int32()), ("output_ids", pa.list_(pa.int64())),
                        ("margins", pa.list_(pa.float64())), ("finish", pa.string()), ("ttft_s", pa.float64()),
                        ("total_s", pa.float64()), ("t_last", pa.float64()), ("records", pa.string())])
    return pa.Table.from_pylist(rows, schema=schema)


def runs_from_raw(raw: Any) -> list[Run]:
    """Inverse of `raw_table` (a polars DataFrame or pyarrow table)."""
    rows = raw.to_dicts() if hasattr(raw, "to_dicts") else raw.to_pylist()
    missing = set(RAW_COLUMNS) - set(rows[0]) if rows else set()
    if missing:
        raise ConfigError(f"not a raw vLLM run table: missing columns {sorted(missing)}")
    runs = []
    for row in rows:
        records = [StepRecord(**s) for s in json.loads(row["records"])]
        gen = Generation(request=row["prompt_id"], prompt_len=row["prompt_len"], output_ids=list(row["output_ids"]),
                         finish=row["finish"], ttft_s=row["ttft_s"], total_s=row["total_s"], t_last=row["t_last"],
                         records=records, margins=list(row["margins"] or []))
        runs.append(Run(row["config"], row["prompt_id"], row["category"], int(row["repeat"]), gen))
    return runs


def frames_from_raw(runs: Sequence[Run], decode: DecodeConfig, meta: dict[str, Any],
                    engines: Sequence[dict[str, Any]] = ()):
    """(results, steps) polars frames with the columns `hqlab.bench.run_bench` writes, one row per (config, prompt).

    The reference is the `none` config's margins pass when there is one (greedy), else its first timed run.
    `engines` (the engines' `describe()`) adds what vLLM chose per config: model runner and async scheduling.
    """
    import polars as pl

    from hqlab.bench import prompt_rows
    from hqlab.lossless import NEAR_TIE_TOL
    from hqlab.workloads import Prompt

    tol = NEAR_TIE_TOL.get(str(meta.get("dtype", "bfloat16")), 0.01)
    base_meta = {"engine": "vllm", **meta, "max_new_tokens": decode.max_new_tokens}
    labels = list(dict.fromkeys(r.config for r in runs))
    if "none" not in labels:
        raise ConfigError("the runs hold no 'none' config: there is no reference to compare with")
    labels.remove("none")
    labels.insert(0, "none")
    rows, steps = [], []
    for pid in dict.fromkeys(r.prompt_id for r in runs):
        mine = [r for r in runs if r.prompt_id == pid]
        timed = {label: [r.generation for r in mine if r.config == label and r.repeat >= 0] for label in labels}
        timed = {label: gens for label, gens in timed.items() if gens}
        margins_pass = [r.generation for r in mine if r.config == "none" and r.repeat < 0]
        reference = margins_pass[0] if margins_pass else timed["none"][0]
        prompt = Prompt(pid, mine[0].category, ())
        repeats = max(len(g) for g in timed.values())
        r, s = prompt_rows(prompt, reference.prompt_len, timed, reference, decode, tol, base_meta, repeats)
        rows += r
        steps += s
    results = pl.DataFrame(rows)
    if engines:
        chosen = pl.DataFrame([{"config": e["config"], "vllm_runner": e["model_runner"],
                                "async_scheduling": e["async_scheduling"]} for e in engines])
        results = results.join(chosen.unique("config", keep="last"), on="config", how="left", maintain_order="left")
    return results, (pl.concat(steps, how="diagonal_relaxed") if steps else pl.DataFrame())


def encode_prompts(tokenizer: Any, prompts: Sequence[Any]) -> list[tuple[str, str, list[int]]]:
    """(id, category, token ids) per workload prompt, encoded exactly as the transformers engine encodes them."""
    from hqlab.engines.hf import HFEngine

    holder = type("TokenizerOnly", (), {"tokenizer": tokenizer})()  # encode_chat needs only the tokenizer
    return [(p.id, p.category, HFEngine.encode_chat(holder, list(p.messages))) for p in prompts]


def machine_description() -> str:
    """GPU name (from nvidia-smi: asking CUDA here would make vLLM spawn rather than fork), torch and vLLM."""
    import shutil
    import subprocess

    import torch
    import vllm

    smi = shutil.which("nvidia-smi")
    gpu = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines() if smi else []
    return f"{gpu[0] if gpu else 'unknown GPU'}, torch {torch.__version__}, vllm {vllm.__version__}"


def bench_suite(model: str | None, suite: str, specs: Sequence[str], decode: DecodeConfig, *, doc_tokens: int,
                limit: int = 0, repeats: int = 1, dtype: str = "auto", progress: bool = True):
    """`hqlab bench --engine vllm`: a workload through every config; returns bench's (results, steps) frames."""
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.workloads import load_workload

    import torch

    settings_for(specs)  # every spec checked before the model is prepared
    if not torch.cuda.is_available():  # (does not initialise CUDA: vLLM may still fork its engine processes)
        raise ConfigError("the vllm engine needs a CUDA GPU (vLLM's published wheels are CUDA builds); on this "
                          "machine use --engine hf, or replay vLLM's n-gram rule with the vllm-ngram proposer")
    name = model or models.DEFAULT_MODEL
    folder = models.prepare(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = load_workload(suite, doc_tokens=doc_tokens, tokenizer=tokenizer)
    encoded = encode_prompts(tokenizer, prompts[: limit or None])
    options = VLLMOptions(model=folder, dtype=models.resolve_dtype(dtype))
    runs, _ = run_configs(options, encoded, specs, decode, repeats=repeats, progress=progress)
    meta = {"machine": machine_description(), "model": str(name), "dtype": options.dtype, "suite": suite,
            "doc_tokens": doc_tokens}
    return frames_from_raw(runs, decode, meta)


__all__ = ["VLLMOptions", "EngineSetting", "setting_for", "settings_for", "StepEvent", "step_records", "VLLMEngine",
           "Run", "check_prompts", "run_setting", "run_configs", "encode_prompts", "machine_description",
           "bench_suite", "raw_table", "runs_from_raw", "frames_from_raw", "NATIVE"]

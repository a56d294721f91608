"""vLLM engine: hqlab workloads on `vllm`'s engine, with hqlab's metrics.

Configurations (the `--proposer` specs of `hqlab bench`, one vLLM engine each):

- `none`: no speculation, vLLM's defaults otherwise; the reference every greedy output is checked against.
- `vllm-ngram:nmin=..,nmax=..,k=..`: vLLM's own n-gram proposer (`method="ngram"`, prompt_lookup_min/max,
  num_speculative_tokens) — the same rule hqlab's `vllm-ngram` proposer replays.
- `arctic-suffix:k=..,depth=..,factor=..,min_prob=..,cached=..`: vLLM's suffix decoding (`method="suffix"`, needs
  arctic-inference) with the settings of hqlab's `arctic-suffix` proposer.
- `vllm-ngram-gpu:nmin=..,nmax=..,k=..`: vLLM's GPU n-gram proposer (`method="ngram_gpu"`, V1 runner, async).
- `vllm-draft:model=..,k=..`: vLLM's own independent draft model (`method="draft_model"`), the drafter made a folder
  by `hqlab.models.prepare` when the engine starts. vLLM's own methods are translated by
  `hqlab.engines.vllm.serving.native_speculative_config`, which the server path uses too.
- `gpu-lookup:nmin=..,nmax=..,k=..,policy=..`: hqlab's lookup inside vLLM's GPU step (model runner V2, async
  scheduling), through hqlab's vLLM plugin (`hqlab.engines.vllm.gpu_lookup`, `hqlab.engines.vllm.plugin`).
- any other hqlab proposer spec (`lookup:...`, `pld:...`): hqlab's own code inside vLLM through the
  `custom_class` adapter on the host (`hqlab.engines.vllm.adapter`).

Measurements: requests run one at a time (batch size 1, as `hqlab bench`), or `concurrency` at once. Each engine step's
output is timed as it arrives, and vLLM's speculative-decoding counters for that step (drafts, draft tokens,
accepted tokens, per position; read through a stat logger) become the step's `StepRecord`. For hqlab proposers the
adapter (or the GPU speculator) also reports the drafted token ids, match length and proposal time, and for the GPU
speculator its own records replace vLLM's counters (which lag a step under asynchronous scheduling): the tokens a
step emitted give its accepted count. vLLM's own proposers report only how many tokens they drafted, so their
`proposed` ids are -1 and their proposal time is unknown (NaN). The no-speculation reference is
run once more with top-2 logprobs: the logit margins that tell a near-tie flip from a real mismatch.

An engine returns plain `Generation`s and needs only vLLM and torch. Running a suite of configs on these engines, and
the raw tables a GPU host returns, is `hqlab.bench.vllm_runs`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hqlab.config import ConfigError, DecodeConfig, parse_spec, resolve_spec
from hqlab.engines.vllm import adapter as vllm_proposer
from hqlab.engines.vllm import gpu_fused, gpu_lookup
from hqlab.engines.vllm.serving import CUDAGRAPH_MODE, NATIVE, full_graphs, native_speculative_config
from hqlab.engines.vllm.worker import EXTENSION_PATH
from hqlab.proposers import REGISTRY
from hqlab.trace import Generation, Source, StepRecord, step_record
from hqlab.workloads import encode_chat

UNKNOWN_TOKEN = -1  # a drafted position whose token id vLLM does not report


# vLLM 0.26's CUDAGraphMode names (vllm.config.compilation.CUDAGraphMode)
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass(frozen=True)
class VLLMOptions:
    """How every engine of a benchmark is built (the same for all configs, so they differ only in speculation)."""

    model: str  # a folder vLLM can load (hqlab.models.prepare gives one for offline names and .gguf files)
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    max_num_seqs: int = 8  # requests run one at a time: small batch limits keep engine start-up short
    # CUDA graphs up to this many tokens per step; 0: serving.capture_size, room for an admitted prompt beside
    # max_num_seqs requests verifying k + 1 each, the same as a served config
    max_cudagraph_capture_size: int = 0
    # vLLM's CUDA-graph mode; default the served configs' (serving.CUDAGRAPH_MODE, FULL: every step replayed whole,
    # one graph per size, so a step that admits a prompt costs about a decode step); "": vLLM's default
    # (FULL_AND_PIECEWISE: full graphs for uniform decode steps, piecewise ones for steps that admit a prompt, whose
    # attention then runs eagerly). vLLM 0.26's runner V2 captures FULL graphs with the dummy batch's query length,
    # so steps that admit a prompt came out wrong: FULL here also sets HQLAB_FULL_GRAPH_QUERY_FIX=1 for the engine's
    # processes, and the plugin then captures them with the worst case (`full_graph_fix`), as V1's runner does. An
    # engine with a drafter model (vLLM's own, gpu-fused) runs vLLM's default instead of FULL (`serving.full_graphs`).
    cudagraph_mode: str = CUDAGRAPH_MODE
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False
    enable_prefix_caching: bool = False  # off: every repeat pays its prefill, as in hqlab's own engine
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # KV cache per engine, in bytes; 0: vLLM sizes it from gpu_memory_utilization after profiling the memory the
    # model takes. Set, vLLM skips that profiling, which engines starting at the same time would corrupt (each counts
    # the others' allocations as its own): `hqlab.bench.vllm_runs.run_interleaved(parallel_start=True)` sets it
    kv_cache_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 64:
            raise ConfigError(f"max_model_len must be >= 64 (got {self.max_model_len})")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1 (got "
                              f"{self.tensor_parallel_size}, {self.pipeline_parallel_size})")
        if self.max_cudagraph_capture_size < 0:
            raise ConfigError(f"max_cudagraph_capture_size must be >= 0, 0 meaning automatic "
                              f"(got {self.max_cudagraph_capture_size})")
        if self.cudagraph_mode and self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ConfigError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)} or empty for vLLM's "
                              f"default (got {self.cudagraph_mode!r})")
        if not 0.05 <= self.gpu_memory_utilization <= 0.95:
            raise ConfigError(f"gpu_memory_utilization must be in [0.05, 0.95] (got {self.gpu_memory_utilization})")
        if self.kv_cache_bytes < 0:
            raise ConfigError(f"kv_cache_bytes must be >= 0, 0 meaning vLLM sizes the KV cache from "
                              f"gpu_memory_utilization (got {self.kv_cache_bytes})")

    def capture_size(self, k: int) -> int:
        """Largest step (in tokens) captured in a CUDA graph for a config drafting up to k tokens."""
        from hqlab.engines.vllm.serving import capture_size

        return self.max_cudagraph_capture_size or capture_size(self.max_num_seqs, k)


@dataclass(frozen=True)
class EngineSetting:
    """What one config changes in the engine: vLLM's speculative config, plus the adapter's extras."""

    label: str
    speculative_config: dict[str, Any] | None
    additional_config: dict[str, Any] = field(default_factory=dict)
    worker_extension_cls: str | None = None
    k: int = 0  # most tokens drafted per step
    fixed_width: bool = False  # every step verifies k draft positions (the GPU speculator under async scheduling)
    draft_model: str = ""  # vLLM's draft_model method: the drafter's name, made a folder when the engine starts

    @property
    def uses_adapter(self) -> bool:
        """hqlab code drafts inside vLLM and keeps step records (the custom_class adapter or a GPU speculator)."""
        return self.worker_extension_cls is not None

    @property
    def gpu(self) -> bool:
        return gpu_lookup.is_gpu_lookup(self.speculative_config) or gpu_fused.is_gpu_fused(self.speculative_config)


def setting_for(spec: str) -> EngineSetting:
    """The engine setting of one spec; every error is raised here, before any engine starts."""
    label = spec.strip()
    name, values = parse_spec(label)
    if name == "none":
        if values:
            raise ConfigError(f"'none' takes no keys (got {label!r})")
        return EngineSetting(label, None)
    if name == gpu_lookup.NAME:
        config = gpu_lookup.lookup_config(label)
        return EngineSetting(label, gpu_lookup.speculative_config(label),
                             {gpu_lookup.SPEC_KEY: label, gpu_lookup.RECORD_KEY: True},
                             EXTENSION_PATH, k=config.k, fixed_width=True)
    if name == gpu_fused.NAME:
        config = gpu_fused.fused_config(label)
        return EngineSetting(label, gpu_fused.speculative_config(label),
                             {gpu_lookup.SPEC_KEY: label, gpu_lookup.RECORD_KEY: True},
                             EXTENSION_PATH, k=config.k, fixed_width=True)
    if name in NATIVE:  # vLLM's own method, translated as the server path translates it
        speculative, drafter = native_speculative_config(label)
        return EngineSetting(label, speculative, k=int(speculative["num_speculative_tokens"]), draft_model=drafter)
    unknown = (f"unknown proposer {{name!r}} in {{spec!r}}; the vllm engine runs none, {gpu_lookup.NAME}, "
               f"{gpu_fused.NAME} "
               f"(hqlab on vLLM's GPU step), {', '.join(sorted(NATIVE))} (vLLM's own) or any of "
               f"{', '.join(sorted(REGISTRY))} (through the custom_class adapter)")
    name, config = resolve_spec(label, REGISTRY, unknown=unknown)
    k = REGISTRY[name](config).k  # builds it once here, so a bad spec fails before vLLM starts
    if k < 1:
        raise ConfigError(f"{label!r} proposes nothing (k=0); use 'none' for no speculation")
    return EngineSetting(label, vllm_proposer.speculative_config(label, k),
                         {vllm_proposer.SPEC_KEY: label, vllm_proposer.RECORD_KEY: True},
                         EXTENSION_PATH, k=k)


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
                 adapter: Sequence[dict[str, Any]] = (), fixed_width: bool = False) -> tuple[float, list[StepRecord]]:
    """(time to first token, one StepRecord per verify step); the first event is the prefill.

    `adapter` holds the adapter's records (one per draft it made, keyed by the history length it saw), which add
    the drafted token ids, the match length and the proposal time; without them ids are unknown (-1) and the
    proposal time NaN. `fixed_width`: every step verified k draft positions (the GPU speculator), whatever the
    lookup filled; the records' tokens are what it drafted, and the tokens a step emitted give what it accepted.
    """
    if not events:
        return math.nan, []
    by_context = {int(r["context_len"]): r for r in adapter}
    emitted = events[0].tokens
    prev = events[0].t
    records = []
    for j, e in enumerate(events[1:]):
        history = prompt_len + emitted  # prompt + every token emitted so far: what the proposer saw
        made = by_context.get(history)
        drafted = (len(made["tokens"]) if made is not None else 0) if fixed_width else e.drafted
        accepted = e.tokens - 1 if fixed_width else min(e.accepted, max(e.tokens - 1, 0))
        if made is not None:
            proposed = [int(t) for t in made["tokens"][:drafted]]
            sources = [int(s) for s in made["sources"][:drafted]]
            match_len, propose_s = int(made["match_len"]), float(made["propose_s"])
            batch = int(made.get("batch", 1))
            passes, width = int(made.get("drafter_passes", -1)), int(made.get("drafter_width", 0))
            drafter_tokens = [int(t) for t in made.get("drafter_tokens", ())]
        else:
            proposed = [UNKNOWN_TOKEN] * drafted
            sources = [int(Source.LOOKUP)] * drafted
            match_len, propose_s, batch = 0, (0.0 if k == 0 else math.nan), 1
            passes, width, drafter_tokens = -1, 0, []
        records.append(step_record(
            request, j, context_len=history - 1, verify_len=1 + (k if fixed_width else drafted), proposed=proposed,
            sources=sources, match_len=match_len, accepted=max(accepted, 0), emitted=e.tokens, step_s=e.t - prev,
            propose_s=propose_s, t_end=e.t, block=k, batch=batch, drafter_passes=passes, drafter_width=width,
            drafter_tokens=drafter_tokens))
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


_PROMETHEUS_LOCK = threading.Lock()  # engines built in threads of one process (hqlab.engines.vllm.startup)
CACHE_INFO_METRIC = "vllm:cache_config_info"  # the metric vLLM's Prometheus logger registers once the engine is up


def serial_prometheus_logger() -> type:
    """vLLM's Prometheus stat logger, its registrations taking turns: for engines built in threads of one process.

    Every vLLM engine registers its metrics in prometheus_client's process-wide registry: its PrometheusStatLogger
    first unregisters every `vllm:` metric, then registers its own (vllm/v1/metrics/loggers.py:459), and
    `log_engine_initialized` registers `vllm:cache_config_info` (loggers.py:1076-1093), both in the front end, in
    the thread that builds the engine (vllm/v1/engine/llm_engine.py:113-121). Engines built one after another take
    turns; engines finishing their start in threads at the same moment interleave these steps, and a name
    registered twice raises ValueError ("Duplicated timeseries"). Here each step holds a lock, and the info metric
    replaces one another engine left. Given as a custom stat logger it replaces vLLM's default Prometheus logger
    (StatLoggerManager adds that one only when no custom logger is a PrometheusStatLogger, loggers.py:1351-1373),
    so each engine keeps exactly one, and hqlab reads none of their metrics."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class SerialPrometheusStatLogger(PrometheusStatLogger):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with _PROMETHEUS_LOCK:
                super().__init__(*args, **kwargs)

        def log_engine_initialized(self) -> None:
            with _PROMETHEUS_LOCK:
                # the registry's own bookkeeping, as vLLM's unregister_vllm_metrics reads it
                for collector in list(REGISTRY._collector_to_names):
                    if getattr(collector, "_name", None) == CACHE_INFO_METRIC:
                        REGISTRY.unregister(collector)
                super().log_engine_initialized()

    return SerialPrometheusStatLogger


def engine_args(options: VLLMOptions, setting: EngineSetting) -> Any:
    """vLLM's EngineArgs for one config's engine (nothing is loaded: vLLM resolves them when the engine is built)."""
    from vllm import EngineArgs

    speculative = setting.speculative_config
    if setting.draft_model:  # a registry name or a .gguf becomes a folder vLLM can load (once, cached)
        from hqlab import models

        speculative = {**speculative, "model": models.prepare(setting.draft_model)}
    return EngineArgs(model=options.model, dtype=options.dtype, max_model_len=options.max_model_len,
                      max_num_seqs=options.max_num_seqs, gpu_memory_utilization=options.gpu_memory_utilization,
                      enforce_eager=options.enforce_eager, enable_prefix_caching=options.enable_prefix_caching,
                      seed=options.seed, speculative_config=speculative,
                      tensor_parallel_size=options.tensor_parallel_size,
                      pipeline_parallel_size=options.pipeline_parallel_size,
                      compilation_config={"max_cudagraph_capture_size": options.capture_size(setting.k),
                                          **({"cudagraph_mode": mode} if (mode := cudagraph_mode(options, setting))
                                             else {})},
                      additional_config=dict(setting.additional_config),
                      # every engine gets hqlab's worker extension: step records and the phase timer
                      worker_extension_cls=setting.worker_extension_cls or EXTENSION_PATH,
                      disable_log_stats=False,
                      # only when set: vLLM's default (None) sizes the cache by profiling the memory, as before
                      **({"kv_cache_memory_bytes": options.kv_cache_bytes} if options.kv_cache_bytes else {}))


def cudagraph_mode(options: VLLMOptions, setting: EngineSetting) -> str:
    """The CUDA-graph mode of one config's engine: the options', but vLLM's default ("") where they ask for FULL
    and the engine drafts with a drafter model, vLLM's own or gpu-fused's (`serving.full_graphs`)."""
    return "" if options.cudagraph_mode == "FULL" and not full_graphs(setting.label) else options.cudagraph_mode


def _ask_full_graph_fix() -> None:
    """FULL graphs need the plugin's capture fix (`full_graph_fix`): in the environment the engine core and its
    workers inherit, and in this process (where vLLM runs the engine core in-process)."""
    from hqlab.engines.vllm import full_graph_fix

    os.environ[full_graph_fix.ENV_VAR] = "1"
    full_graph_fix.apply()


class VLLMEngine:
    """One vLLM engine (one speculative setting) running requests one at a time (an `hqlab.engines.Engine`)."""

    name = "vllm"

    def __init__(self, options: VLLMOptions, setting: EngineSetting, *, started_together: bool = False) -> None:
        """`started_together`: other engines are being built in other threads of this process at the same time
        (`start_engines_together`), so vLLM's Prometheus registrations must take turns."""
        from vllm.v1.engine.llm_engine import LLMEngine

        if setting.gpu:
            from hqlab.engines.vllm import plugin

            if options.pipeline_parallel_size > 1:
                raise ConfigError(f"{setting.label!r}: hqlab's GPU speculators do not support pipeline parallelism "
                                  "yet (pipeline_parallel_size must be 1; tensor parallelism is fine)")

            plugin.check_vllm_version()
            plugin.register()  # this process; vLLM's own processes load it through the entry point (or fork)
        if cudagraph_mode(options, setting) == "FULL":
            _ask_full_graph_fix()
        self.options, self.setting = options, setting
        self._stats: list = []
        stat_loggers = [_stat_logger_factory(self._stats), *([serial_prometheus_logger()] if started_together else [])]
        self.engine = LLMEngine.from_engine_args(engine_args(options, setting), stat_loggers=stat_loggers)
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

    def generate(self, prompt_ids: Sequence[int], proposer: Any = None, decode: DecodeConfig = DecodeConfig(),
                 request: str = "0", margins: bool = False) -> Generation:
        """One request alone, with this engine's speculative setting (`proposer`: None or that setting's spec; vLLM
        builds its speculator with the engine); `margins` also asks vLLM for top-2 logprobs (the reference's
        near-tie margins)."""
        if proposer is not None and str(proposer).strip() != self.setting.label:
            raise ConfigError(f"this vLLM engine runs {self.setting.label!r}, not {proposer!r}: a vLLM engine is "
                              f"built for one speculative setting")
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
        ttft, records = step_records(request, len(prompt_ids), events, k=self.setting.k, adapter=adapter,
                                     fixed_width=self.setting.fixed_width)
        t_last = records[-1].t_end if records else ttft
        return Generation(request=request, prompt_len=len(prompt_ids), output_ids=output_ids, finish=finish,
                          ttft_s=ttft, total_s=total, t_last=t_last, records=records, margins=margin_values)

    def generate_concurrent(self, prompts: Sequence[Sequence[int]], decode: DecodeConfig,
                            requests: Sequence[str], in_flight: int = 0) -> tuple[list[Generation], float]:
        """Many requests; (generations in the order given, wall s from the first submission to the last token).

        `in_flight` 0 submits every prompt at once (a burst: vLLM batches them as its scheduler sees fit, and the
        slowest request sets the wall time). `in_flight` n keeps n requests running: the first n are submitted
        together and each time one finishes the next prompt is submitted in the same engine step (a closed loop,
        as a server with n clients sees it). Each request's steps are timed from its own submission; a record's
        `batch` is how many requests drafted in that step (GPU speculator and adapter)."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        if in_flight < 0:
            raise ConfigError(f"in_flight must be >= 0, 0 meaning all at once (got {in_flight})")
        params = SamplingParams(
            temperature=decode.temperature, top_p=decode.top_p, top_k=decode.top_k if decode.top_k > 0 else 0,
            seed=None if decode.greedy else decode.seed, max_tokens=decode.max_new_tokens,
            output_kind=RequestOutputKind.DELTA, detokenize=False)
        if self.setting.uses_adapter:
            self.take_adapter_records()
        self._counter += 1
        rids = {f"{name}-{self._counter}-{i}": name for i, name in enumerate(requests)}
        queue = list(zip(rids, prompts))
        events: dict[str, list[StepEvent]] = {rid: [] for rid in rids}
        outputs: dict[str, list[int]] = {rid: [] for rid in rids}
        finish = {rid: "length" for rid in rids}
        added: dict[str, float] = {}
        t0 = time.perf_counter()

        def submit(count: int) -> None:
            for _ in range(min(count, len(queue))):
                rid, ids = queue.pop(0)
                added[rid] = time.perf_counter()
                self.engine.add_request(rid, tokens_input([int(t) for t in ids]), params)

        submit(in_flight or len(queue))
        while self.engine.has_unfinished_requests() or queue:
            before = len(self._stats)
            outs = self.engine.step()
            now = time.perf_counter()
            new = [s for s in self._stats[before:] if s is not None]
            emitting = [o for o in outs if o.outputs and len(o.outputs[0].token_ids)]
            done = 0
            for out in outs:
                completion = out.outputs[0]
                if completion.token_ids:
                    # vLLM's counters are per step, not per request: share them out only when one request ran
                    share = new if len(emitting) == 1 else []
                    events[out.request_id].append(StepEvent(now - added[out.request_id], len(completion.token_ids),
                                                            sum(s[1] for s in share), sum(s[2] for s in share)))
                    outputs[out.request_id] += list(completion.token_ids)
                if out.finished:
                    done += 1
                    finish[out.request_id] = "eos" if completion.finish_reason == "stop" else "length"
            submit(done if in_flight else 0)
        wall = time.perf_counter() - t0
        return self._generations(rids, prompts, events, outputs, finish, wall), wall

    def _generations(self, rids: dict[str, str], prompts: Sequence[Sequence[int]],
                     events: dict[str, list[StepEvent]], outputs: dict[str, list[int]], finish: dict[str, str],
                     wall: float) -> list[Generation]:
        """`generate_concurrent`'s generations, in the order given, each with its own step records."""
        adapter = self.take_adapter_records() if self.setting.uses_adapter else []
        gens = []
        for rid, ids in zip(rids, prompts):
            mine = [r for r in adapter if str(r.get("request", "")).startswith(f"{rid}-") or r.get("request") == rid]
            ttft, records = step_records(rids[rid], len(ids), events[rid], k=self.setting.k,
                                         adapter=mine if self.setting.gpu else adapter if len(rids) == 1 else (),
                                         fixed_width=self.setting.fixed_width)
            t_last = records[-1].t_end if records else ttft
            gens.append(Generation(request=rids[rid], prompt_len=len(ids), output_ids=outputs[rid],
                                   finish=finish[rid], ttft_s=ttft, total_s=events[rid][-1].t if events[rid] else wall,
                                   t_last=t_last, records=records))
        return gens

    def profile(self, prompt_ids: Sequence[int], decode: DecodeConfig, request: str = "profile") -> dict[str, Any]:
        """One request with the worker's phases timed (`worker.StepTimer`): the generation (its step records carry
        the front end's per-step times) and the worker's per-call phase timings. Needs the worker extension."""
        if not self.engine.collective_rpc("hqlab_profile_start")[0]:
            raise RuntimeError("the worker has no model runner to time")
        try:
            generation = self.generate(prompt_ids, decode=decode, request=request)
        finally:
            phases = self.engine.collective_rpc("hqlab_profile_stop")[0]
        return {"generation": generation, "phases": phases}

    def take_adapter_records(self) -> list[dict[str, Any]]:
        """The step records hqlab's code kept inside vLLM since the last call, from the first worker only: with
        tensor parallelism every rank drafts the same tokens, so one rank's records are the records."""
        return records_from_workers(self.engine.collective_rpc("hqlab_take_records"))

    def close(self) -> None:
        core = getattr(self.engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.engine


def records_from_workers(per_worker: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One rank's records from `collective_rpc`'s per-worker answers. With tensor parallelism every rank runs the
    same speculator on the same histories and drafts the same tokens, so the first rank's records are the records
    (taking every rank's would count each step once per GPU). Pipeline stages other than the last draft nothing."""
    drafted = [list(worker) for worker in per_worker if worker]
    return drafted[0] if drafted else []


def _margin(position: dict) -> float:
    """Top-1 minus top-2 logprob at one position (= the logit margin: both share the softmax normaliser)."""
    ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
    return float(ranked[0].logprob - ranked[1].logprob) if len(ranked) > 1 else math.inf


def encode_prompts(tokenizer: Any, prompts: Sequence[Any]) -> list[tuple[str, str, list[int]]]:
    """(id, category, token ids) per workload prompt, encoded as every engine encodes them
    (`hqlab.workloads.encode_chat`)."""
    return [(p.id, p.category, encode_chat(tokenizer, p.messages)) for p in prompts]


__all__ = ["VLLMOptions", "EngineSetting", "setting_for", "settings_for", "StepEvent", "step_records", "VLLMEngine",
           "encode_prompts", "records_from_workers", "engine_args", "NATIVE", "UNKNOWN_TOKEN"]

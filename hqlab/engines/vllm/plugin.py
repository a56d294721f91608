"""The vLLM plugin that puts hqlab's speculators inside vLLM's GPU step. Built for vLLM 0.26.0 only.

vLLM loads every `vllm.general_plugins` entry point in each of its processes (front end, engine core, workers);
hqlab's (pyproject.toml) is `register` below. vLLM 0.26 has no registry for new speculative methods: its V2 model
runner dispatches only EAGLE/MTP/DFlash/DSpark (`init_speculator`), its config sends every other method to the V1
runner with synchronous scheduling (`VllmConfig._get_v2_model_runner_unsupported_features` and the async-scheduling
whitelist in `VllmConfig.__post_init__`). The plugin changes exactly those three decisions, and only for configs
that ask for an hqlab GPU speculator (`gpu_lookup.is_gpu_lookup`, `gpu_fused.is_gpu_fused`); every other config is left to vLLM:

1. the V2 feature check no longer lists our `custom_class` speculator as unsupported;
2. asynchronous scheduling stays on for it (as vLLM does for EAGLE: placeholders for the k draft positions are
   reserved by the scheduler, the drafts are filled in on the GPU), unless the user turned it off;
3. `init_speculator` builds `GpuLookupSpeculator` (or `gpu_fused.GpuFusedSpeculator`), which is bound to the
   runner's request state when vLLM loads the model (the fused one also loads its draft model then).

For the step-cost benchmark it adds one utility method to vLLM's engine core, `hqlab_set_width` (`set_width`),
which fixes the verify width of every later step, and one that reads the costs `goodput=online` measured,
`hqlab_goodput_costs` (`goodput_costs`); nothing calls them unless a client asks.

For a `gpu-lookup` with the speculation gate (`gate=G`) the scheduler sets each step's verify width from the
lookup's match state before it schedules (`hqlab.engines.vllm.gate`, patched in `_patch_scheduler`); for a
`gpu-lookup` or `gpu-fused` with the goodput controller (`goodput=default`) from expected tokens per ms, learning
from each step's outcome (`hqlab.engines.vllm.goodput`).

For a `gpu-lookup` with a corpus (`corpus=N`) it also carries finished requests to the speculator
(`_patch_scheduler`): vLLM's scheduler notes each freed request's prompt and output ids and attaches them to
its next scheduler output, and the runner's `finish_requests` hands them (with the requests admitted that step) to
the speculator. Only the scheduler knows a finished request's exact output; the worker's token rows may hold tokens
past the stop. Configs without a corpus or a gate are untouched (the wrappers return at once).

For both speculators the runner's `finish_requests` also tells the speculator which request slots it frees, finished,
aborted or preempted (`_patch_finish_requests`, `V2Speculator.release`), so that per-request state on the host lives
exactly as long as vLLM's own (tests/engines/vllm/test_vllm_lifecycle.py), and hands it the width the scheduler fixed
for the step its drafts go to (`V2Speculator.scheduled_width`: the scheduler output's `num_spec_tokens_to_schedule`,
which vLLM's V2 runner itself does not read).

With HQLAB_FULL_GRAPH_QUERY_FIX=1 in the environment (set by `VLLMOptions(cudagraph_mode="FULL")`) it also makes
model runner V2 capture its FULL-mode graphs with the worst-case query length (`full_graph_fix`: vLLM 0.26 keeps the
dummy batch's, and steps that admit a prompt came out wrong); without it nothing of that is patched, and a config of
hqlab's speculators asking for FULL is refused (`check_full_graphs`).

Nothing of vLLM is forked or copied. On any other vLLM version `register` patches nothing and says so, and a
config that asks for the speculator fails with a clear error (`check_vllm_version`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from hqlab.config import ConfigError

VLLM_VERSION = "0.26.0"  # the version whose internals the patches below were written against
_PATCHED = "_hqlab_patched"
log = logging.getLogger("hqlab.vllm")
SERVER_LOG = logging.getLogger("vllm.hqlab")  # under vLLM's logger: its handler writes what the server's log keeps
ASYNC_ON = "hqlab: asynchronous scheduling enabled for its speculator"  # `hqlab.bench.serve.server_log_facts` reads it


def check_vllm_version(version: str | None = None) -> None:
    """Raise ConfigError unless vLLM is the version the plugin was built for."""
    if version is None:
        import vllm

        version = vllm.__version__
    if version != VLLM_VERSION:
        raise ConfigError(f"hqlab's GPU speculators are built for vLLM {VLLM_VERSION} and refuse vLLM {version}: "
                          f"install vllm=={VLLM_VERSION} (pip install 'hqlab[vllm]'), or use the custom_class "
                          f"adapter (lookup:...), which works with vLLM 0.25 to 0.33")


def register() -> None:
    """vLLM's plugin entry point: idempotent, cheap (imports only vLLM's config and spec-decode modules, and the V2
    runner's default model state where the FULL-graph fix is asked for)."""
    import vllm

    try:
        check_vllm_version(vllm.__version__)
    except ConfigError as e:
        log.warning("hqlab vLLM plugin inactive: %s", e)
        return
    _patch_config()
    _patch_init_speculator()
    _patch_scheduler()
    _add_width_utility()
    from hqlab.engines.vllm import full_graph_fix

    if full_graph_fix.apply():  # only where the environment asks for it
        log.info("hqlab: FULL cudagraphs captured with max_query_len = num_tokens (%s)", full_graph_fix.ENV_VAR)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    wrapped = make(original)
    setattr(wrapped, _PATCHED, True)
    wrapped.__wrapped__ = original
    wrapped.__name__ = getattr(original, "__name__", name)
    setattr(owner, name, wrapped)


def _ours(vllm_config: Any) -> bool:
    from hqlab.engines.vllm.gpu_fused import is_gpu_fused
    from hqlab.engines.vllm.gpu_lookup import is_gpu_lookup

    spec = getattr(vllm_config, "speculative_config", None)
    return is_gpu_lookup(spec) or is_gpu_fused(spec)


def check_full_graphs(mode: Any) -> None:
    """Refuse `cudagraph_mode` FULL for hqlab's speculators unless the capture fix is asked for
    (`full_graph_fix`): without it vLLM 0.26's runner V2 computes admitted prompts of over 128 tokens wrong, and
    nothing else says so (answers start with an all-NaN row's token, speculative engines die on an out-of-vocabulary
    id). `mode`: the config's as asked (a CUDAGraphMode, its name, or None)."""
    from hqlab.engines.vllm import full_graph_fix

    if getattr(mode, "name", mode) == "FULL" and not full_graph_fix.enabled():
        raise ConfigError(f"cudagraph_mode FULL with hqlab's speculators needs {full_graph_fix.ENV_VAR}=1 in the "
                          f"server's environment (hqlab serve-command prints it): without it vLLM 0.26's model runner "
                          f"V2 captures FULL graphs with a dummy query length and computes admitted prompts wrong")


def _patch_config() -> None:
    from vllm.config import VllmConfig

    def features(original: Callable) -> Callable:
        def unsupported(self: Any) -> list[str]:
            found = original(self)
            if _ours(self):
                found = [f for f in found if f != "speculative method 'custom_class'"]
            return found
        return unsupported

    def post_init(original: Callable) -> Callable:
        def __post_init__(self: Any) -> None:
            if not _ours(self):
                return original(self)
            check_full_graphs(self.compilation_config.cudagraph_mode)  # as asked: vLLM may change it below
            asked = self.scheduler_config.async_scheduling  # None (vLLM decides), True or False (the user's)
            if asked:  # vLLM would refuse it for custom_class: let it decide, then turn it on below
                self.scheduler_config.async_scheduling = None
            original(self)
            if asked is not False and not self.scheduler_config.async_scheduling:
                # What vLLM does for EAGLE-style speculators, whose drafts also stay on the GPU.
                self.scheduler_config.async_scheduling = True
                self.parallel_config.disable_nccl_for_dp_synchronization = True
                if self.model_config is not None:
                    self.model_config.disable_cascade_attn = True  # not compatible with async spec decoding
                # on vLLM's own logger, so that a server's log says it (vLLM's line above it says "disabled")
                SERVER_LOG.info(ASYNC_ON)
        return __post_init__

    _wrap(VllmConfig, "_get_v2_model_runner_unsupported_features", features)
    _wrap(VllmConfig, "__post_init__", post_init)


def _patch_init_speculator() -> None:
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    def make(original: Callable) -> Callable:
        def init_speculator(vllm_config: Any, device: Any) -> Any:
            if not _ours(vllm_config):
                return original(vllm_config, device)
            from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator, is_gpu_fused
            from hqlab.engines.vllm.gpu_lookup import GpuLookupSpeculator

            _patch_runner_binding()
            _patch_finish_requests()
            if is_gpu_fused(vllm_config.speculative_config):
                speculator = GpuFusedSpeculator(vllm_config, device)
            else:
                speculator = GpuLookupSpeculator(vllm_config, device)
            from hqlab.engines.vllm import fault

            planted = fault.fault_of(vllm_config)
            if planted is not None:  # a test server that must fail the sampling test
                fault.install(planted, speculator.pad)
            return speculator
        return init_speculator

    _wrap(spec_decode, "init_speculator", make)
    runner = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner is not None:  # imported before the plugin: it holds its own reference
        runner.init_speculator = spec_decode.init_speculator


def _patch_runner_binding() -> None:
    """Give our speculator the runner's request state when vLLM loads the model (after the state exists)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator
    from hqlab.engines.vllm.gpu_lookup import GpuLookupSpeculator

    def make(original: Callable) -> Callable:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            speculator = getattr(self, "speculator", None)
            if isinstance(speculator, (GpuLookupSpeculator, GpuFusedSpeculator)):
                if getattr(self, "use_pp", False):
                    raise ConfigError("hqlab's GPU speculators do not support pipeline parallelism yet "
                                      "(pipeline_parallel_size must be 1)")
                speculator.bind(self.req_states.all_token_ids.gpu, self.req_states.total_len.gpu)
            result = original(self, *args, **kwargs)
            if isinstance(speculator, GpuFusedSpeculator):
                speculator.load_drafter()  # after the target, before vLLM profiles memory and sizes its KV cache
                if speculator.draws:  # draft_sample=probabilistic draws at each request's temperature
                    speculator.bind_sampling(self.sampler.sampling_states.temperature.gpu)
            return result
        return load_model

    _wrap(GPUModelRunner, "load_model", make)


CORPUS_DOCS = "hqlab_corpus_docs"  # the scheduler output's attribute carrying finished requests to the worker


def _corpus_prompts(vllm_config: Any) -> bool | None:
    """None unless the config is a gpu-lookup with a corpus; else whether the corpus keeps prompts."""
    from hqlab.engines.vllm.gpu_lookup import is_gpu_lookup, lookup_config
    from hqlab.engines.vllm.speculator import proposer_spec

    if not is_gpu_lookup(getattr(vllm_config, "speculative_config", None)):
        return None
    config = lookup_config(proposer_spec(vllm_config))
    return config.corpus_prompts if config.corpus else None


def _wants_corpus(scheduler: Any) -> bool:
    """Whether this scheduler's config is a gpu-lookup with a corpus (read once per scheduler)."""
    found = scheduler.__dict__.get("_hqlab_corpus")
    if found is None:
        found = scheduler.__dict__["_hqlab_corpus"] = _corpus_prompts(scheduler.vllm_config) is not None
    return found


def _note_freed(scheduler: Any, request: Any) -> None:
    """The scheduler frees a finished (or aborted) request: keep its prompt and output ids for the worker. Copies:
    the request's lists are vLLM's."""
    if _wants_corpus(scheduler):
        scheduler.__dict__.setdefault("_hqlab_freed", []).append(
            (request.request_id, list(request.prompt_token_ids or ()), list(request.output_token_ids)))


def _attach_freed(scheduler: Any, scheduler_output: Any) -> None:
    """The requests freed since the last schedule travel to the worker with this step's scheduler output."""
    if _wants_corpus(scheduler):
        setattr(scheduler_output, CORPUS_DOCS, scheduler.__dict__.pop("_hqlab_freed", []))


def _width_knobs(vllm_config: Any) -> tuple[int, str]:
    """(gate, goodput) of the config's spec: a gpu-lookup's, a gpu-fused's (which has no gate), else (0, "")."""
    from hqlab.engines.vllm.gpu_fused import fused_config, is_gpu_fused
    from hqlab.engines.vllm.gpu_lookup import is_gpu_lookup, lookup_config
    from hqlab.engines.vllm.speculator import proposer_spec

    spec = getattr(vllm_config, "speculative_config", None)
    if is_gpu_lookup(spec):
        lookup = lookup_config(proposer_spec(vllm_config))
        return lookup.gate, lookup.goodput
    if is_gpu_fused(spec):
        return 0, fused_config(proposer_spec(vllm_config)).goodput
    return 0, ""


def _gate(scheduler: Any) -> Any:
    """This scheduler's width hook: the speculation gate (`gate.SchedulerGate`) for a gpu-lookup with `gate=G`,
    the goodput controller (`goodput.SchedulerGoodput`) for a gpu-lookup or gpu-fused with `goodput=...`, else None
    (read once per scheduler)."""
    if "_hqlab_gate" not in scheduler.__dict__:
        found = None
        config = scheduler.vllm_config
        gate, goodput = _width_knobs(config)
        if gate or goodput:
            table = getattr(scheduler, "dynamic_sd_lookup", None)
            if table is None:
                raise ConfigError("gate and goodput need vLLM's num_speculative_tokens_per_batch_size schedule "
                                  "(with a width-0 range): build the speculative config with the speculator "
                                  "module's speculative_config(spec) (gpu_lookup's or gpu_fused's)")
            if goodput:
                from hqlab.engines.vllm.goodput import SchedulerGoodput

                found = SchedulerGoodput.from_spec(goodput, table, config)
            else:
                from hqlab.engines.vllm.gate import SchedulerGate

                found = SchedulerGate(gate, table)
        scheduler.__dict__["_hqlab_gate"] = found
    return scheduler.__dict__["_hqlab_gate"]


def _deliver(runner: Any, scheduler_output: Any) -> None:
    """In the worker, after vLLM's `finish_requests` and before the step drafts: the finished requests' ids and the
    step's new requests to the speculator (`GpuLookupSpeculator.corpus_step`)."""
    speculator = getattr(runner, "speculator", None)
    if getattr(speculator, "corpus", None) is not None:
        speculator.corpus_step(getattr(scheduler_output, CORPUS_DOCS, ()),
                               [r.req_id for r in scheduler_output.scheduled_new_reqs])


def _patch_scheduler() -> None:
    """Scheduler (in every process that may schedule): the gate or the goodput controller sets the width table
    before each `schedule()` (and the controller sees each step's outcome before `update_from_output`); `_note_freed`
    when it frees a request (and the hook forgets it), `_attach_freed` to each scheduler output (the runner's half is
    `_patch_finish_requests`, patched in the worker with the binding)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def free(original: Callable) -> Callable:
        def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            _note_freed(self, request)
            gate = _gate(self)
            if gate is not None:
                gate.forget(request.request_id)
            return original(self, request, *args, **kwargs)
        return _free_request

    def schedule(original: Callable) -> Callable:
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            gate = _gate(self)
            if gate is not None:
                gate.before_schedule(self)
            out = original(self, *args, **kwargs)
            if gate is not None:
                gate.after_schedule(out)
            _attach_freed(self, out)
            return out
        return schedule

    def update(original: Callable) -> Callable:
        def update_from_output(self: Any, scheduler_output: Any, runner_output: Any, *args: Any, **kwargs: Any) -> Any:
            gate = _gate(self)
            if gate is not None:  # before vLLM frees the requests that finish in this output
                gate.observe(self, scheduler_output, runner_output)
            return original(self, scheduler_output, runner_output, *args, **kwargs)
        return update_from_output

    _wrap(Scheduler, "_free_request", free)
    _wrap(Scheduler, "schedule", schedule)
    _wrap(Scheduler, "update_from_output", update)


def _freed_slots(runner: Any, scheduler_output: Any) -> list[tuple[str, int]]:
    """The (request id, slot) pairs the runner's `finish_requests` is about to free: the step's finished (aborted
    included) and preempted requests that hold a slot, read before vLLM frees them (a freed slot goes to the next
    request admitted)."""
    freed = scheduler_output.finished_req_ids
    if scheduler_output.preempted_req_ids:
        freed = freed | scheduler_output.preempted_req_ids
    slots = runner.req_states.req_id_to_index
    return [(rid, slots[rid]) for rid in freed if rid in slots]


def _patch_finish_requests() -> None:
    """Runner: around `finish_requests` (model runner V2's first act of a step, run for real steps only), tell the
    speculator the width of the step its drafts go to and which slots vLLM frees (`V2Speculator.release`), then
    `_deliver` the corpus's documents."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from hqlab.engines.vllm.speculator import V2Speculator

    def finish(original: Callable) -> Callable:
        def finish_requests(self: Any, scheduler_output: Any) -> Any:
            speculator = getattr(self, "speculator", None)
            ours = isinstance(speculator, V2Speculator)
            freed = _freed_slots(self, scheduler_output) if ours else []
            if ours:  # fixed by the scheduler when it made this step, for the step after it (vLLM's async placeholders)
                speculator.scheduled_width = int(scheduler_output.num_spec_tokens_to_schedule)
            result = original(self, scheduler_output)
            if freed:
                speculator.release(freed)
            _deliver(self, scheduler_output)
            return result
        return finish_requests

    _wrap(GPUModelRunner, "finish_requests", finish)


WIDTH_UTILITY = "hqlab_set_width"  # the engine core's utility method the step-cost benchmark calls


def set_width(core: Any, width: int) -> int:
    """Benchmark only (benchmarks/vllm_step_cost.py), run in the engine core's process: make every later step verify
    `width` drafts a request, in vLLM's scheduler table and in the speculator's copy (which skips its drafting at 0).
    Returns the number of workers set. A client reaches it with `engine_core.call_utility(WIDTH_UTILITY, width)`,
    so the engine keeps its own process and asynchronous scheduling, as a served engine does."""
    from hqlab.engines.vllm import batch_k

    scheduler = core.scheduler
    if _gate(scheduler) is not None:
        raise ConfigError("a forced width and the speculation gate (or goodput) both set the scheduler's width "
                          "table: drop gate (or goodput)")
    table = scheduler.dynamic_sd_lookup
    if table is None:
        raise ConfigError("vLLM built no per-batch-size width table (no batch_k in the spec): the width cannot be set")
    k = int(scheduler.num_spec_tokens)
    batch_k.force_width(table, width, k)
    return len(core.model_executor.collective_rpc(_set_worker_width, args=(width, k)))


def _set_worker_width(worker: Any, width: int, k: int) -> int:
    from hqlab.engines.vllm import batch_k

    table = worker.model_runner.speculator.k_table
    batch_k.force_width(table, width, k)
    return len(table)


COSTS_UTILITY = "hqlab_goodput_costs"  # the engine core's utility method that reads goodput=online's prices


def goodput_costs(core: Any) -> dict[str, Any] | None:
    """Run in the engine core's process: the step costs a `goodput=online` controller has measured so far, as a
    StepCosts dict (`OnlineCosts.table`, servable with goodput=PATH.json) with its scales and timed steps; None
    without online costs. A client reaches it with `engine_core.call_utility(COSTS_UTILITY)`."""
    from hqlab.rules.online_costs import OnlineCosts

    hook = _gate(core.scheduler)
    costs = getattr(getattr(hook, "controller", None), "costs", None)
    if not isinstance(costs, OnlineCosts):
        return None
    g0, gx = costs.scales()
    return {**costs.table().to_dict(), "g0": g0, "gx": gx, "counts": {f"{w}x{b}": n for (w, b), n in
                                                                     sorted(costs.counts.items())},
            "prompt_steps": costs.prompt_steps}


def _add_width_utility() -> None:
    """Give vLLM's engine core the benchmarks' utility methods (added methods; nothing of vLLM changes)."""
    from vllm.v1.engine.core import EngineCore

    for name, method in ((WIDTH_UTILITY, set_width), (COSTS_UTILITY, goodput_costs)):
        if not hasattr(EngineCore, name):
            setattr(EngineCore, name, method)


__all__ = ["register", "check_vllm_version", "check_full_graphs", "VLLM_VERSION"]

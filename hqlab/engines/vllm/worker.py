"""What hqlab adds to vLLM's worker: `HqlabWorkerExtension`, mixed into the worker through vLLM's
`worker_extension_cls` (pass `EXTENSION_PATH`), through which the engine collects the step records hqlab's code kept
inside vLLM (`llm.collective_rpc("hqlab_take_records")`) and times the model runner's phases (`StepTimer`,
`hqlab_profile_start` / `hqlab_profile_stop`), and empties or reads the gpu-lookup corpus (`hqlab_corpus_reset`,
`hqlab_take_corpus_log`); the reset empties vLLM's own `suffix` method's global tree too.
"""

from __future__ import annotations

import time
from typing import Any

from hqlab.engines.vllm.adapter import HqlabProposer
from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator
from hqlab.engines.vllm.gpu_lookup import GpuLookupSpeculator
from hqlab.engines.vllm.suffix_reset import reset_suffix_cache

EXTENSION_PATH = "hqlab.engines.vllm.worker.HqlabWorkerExtension"  # vLLM imports it by this name in the worker


STEP_FACTS = ("tokens", "requests", "new_requests", "finished_requests")


def step_facts(scheduler_output: Any) -> dict[str, int]:
    """What vLLM's scheduler gave a step, read from the `SchedulerOutput` that `execute_model` receives: tokens
    scheduled, requests, requests new this step (their prefill runs in it) and requests finished since the last
    step. Every key is -1 for a call that took no scheduler output (`sample_tokens`, `propose`), so the timer's rows
    share one schema."""
    if not hasattr(scheduler_output, "total_num_scheduled_tokens"):
        return dict.fromkeys(STEP_FACTS, -1)
    return {"tokens": int(scheduler_output.total_num_scheduled_tokens),
            "requests": len(scheduler_output.num_scheduled_tokens),
            "new_requests": len(scheduler_output.scheduled_new_reqs),
            "finished_requests": len(scheduler_output.finished_req_ids)}


class StepTimer:
    """Where a step's time goes inside vLLM's worker: host time and GPU span of the model runner's
    `execute_model` (inputs + forward), within it the forward's CUDA-graph replay (`run_fullgraph` for uniform decode
    steps, `run_pw_graph` for mixed ones; a step too large for every graph runs its forward eagerly and has no such
    call), `sample_tokens` (sampling, bookkeeping and, on V2, the speculator), within it `sample` (the logits and the
    sampler, or the rejection sampler where the step verifies drafts), and the proposer's `propose`, per call, with
    what the scheduler gave the step (`step_facts`: its tokens, requests and the requests it admitted or finished).
    GPU spans come from CUDA events (no synchronisation while decoding), read once, in `stop`; on a runner without
    CUDA the rows carry host times and no spans (None). Installed on one runner instance (instance attributes
    shadow its methods), removed by `stop`."""

    # (method, the runner's attribute that holds it; None: the runner's own). The corpus's `corpus_step` runs inside
    # `execute_model` (vLLM's `finish_requests`), so its time is part of that phase's too.
    PHASES = (("execute_model", None), ("run_fullgraph", "cudagraph_manager"), ("run_pw_graph", "cudagraph_manager"),
              ("sample_tokens", None), ("sample", None), ("propose", "drafter"), ("propose", "speculator"),
              ("corpus_step", "speculator"))

    def __init__(self, runner: Any) -> None:
        self.runner, self.calls, self.installed = runner, [], []
        for name, holder in self.PHASES:
            owner = runner if holder is None else getattr(runner, holder, None)
            if owner is not None and hasattr(owner, name):
                self._wrap(owner, name, name if holder is None else f"{name} ({holder})")

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        import torch

        original = getattr(owner, name)
        cuda = torch.cuda.is_available()

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = end = None
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            t1 = time.perf_counter()
            if cuda:
                end.record()
            facts = step_facts(args[0] if args else kwargs.get("scheduler_output"))
            self.calls.append((phase, t0, t1, start, end, facts))
            return out

        setattr(owner, name, timed)
        self.installed.append((owner, name))

    def stop(self) -> list[dict[str, Any]]:
        import torch

        for owner, name in self.installed:
            delattr(owner, name)  # the class's method shows through again
        self.installed = []
        if not self.calls:
            return []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        base_t, base_ev = self.calls[0][1], self.calls[0][3]

        def span(a: Any, b: Any) -> float | None:  # None, not NaN: the rows travel as JSON from a server
            return a.elapsed_time(b) if a is not None and b is not None else None

        return [{"phase": phase, "host_start_ms": 1e3 * (t0 - base_t), "host_ms": 1e3 * (t1 - t0),
                 "gpu_start_ms": span(base_ev, start), "gpu_ms": span(start, end), **facts}
                for phase, t0, t1, start, end, facts in self.calls]


class HqlabWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): lets the engine collect the step records hqlab's code
    kept inside vLLM — the adapter's (V1 runner: `model_runner.drafter`) or the GPU speculator's (V2 runner:
    `model_runner.speculator`)."""

    def hqlab_take_records(self) -> list[dict[str, Any]]:
        runner = getattr(self, "model_runner", None)
        for found in (getattr(runner, "drafter", None), getattr(runner, "speculator", None)):
            if isinstance(found, (HqlabProposer, GpuLookupSpeculator, GpuFusedSpeculator)):
                return found.take_records()
        return []

    def _hqlab_corpus_speculator(self) -> Any:
        speculator = getattr(getattr(self, "model_runner", None), "speculator", None)
        return speculator if getattr(speculator, "corpus", None) is not None else None

    def hqlab_corpus_reset(self) -> bool:
        """Empty what drafts across requests (a benchmark point starts from nothing): the gpu-lookup corpus, or the
        global tree of vLLM's `suffix` method; False where the server keeps neither."""
        speculator = self._hqlab_corpus_speculator()
        if speculator is not None:
            speculator.reset_corpus()
            return True
        return reset_suffix_cache(getattr(getattr(self, "model_runner", None), "drafter", None))

    def hqlab_take_corpus_log(self) -> list[dict[str, Any]]:
        """The documents that entered the gpu-lookup corpus since the last call, in order (empty without one)."""
        speculator = self._hqlab_corpus_speculator()
        return speculator.take_corpus_log() if speculator is not None else []

    def hqlab_profile_start(self) -> bool:
        """Start timing the model runner's phases (see StepTimer); False if this worker has no model runner."""
        runner = getattr(self, "model_runner", None)
        if runner is None:
            return False
        self._hqlab_timer = StepTimer(runner)
        return True

    def hqlab_profile_stop(self) -> list[dict[str, Any]]:
        timer = getattr(self, "_hqlab_timer", None)
        self._hqlab_timer = None
        return timer.stop() if timer is not None else []


__all__ = ["HqlabWorkerExtension", "StepTimer", "EXTENSION_PATH", "step_facts"]

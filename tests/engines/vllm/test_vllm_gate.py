"""The speculation gate on vLLM's own asynchronous scheduler, on the CPU: with the plugin installed, the widths
vLLM's scheduler fixes step after step are the replay's (`hqlab.replay.gate`), lag included.

The scheduler is vLLM 0.26's `AsyncScheduler` built from a real config of the 0.5B (model runner V2, asynchronous
scheduling, the plugin's patches). What a GPU would run in between (the worker) is played by the lookup rule and
the recorded greedy output: the worker verifies the drafts the rule proposes from the history before the step
(as `GpuLookupSpeculator` does on the GPU) and emits the accepted tokens and the target's next one. The engine
core's order is vLLM's batch queue (`EngineCore.step_with_batch_queue`): schedule step n + 1, then process step
n's output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm)")

from hqlab.config import ConfigError, LookupConfig  # noqa: E402
from hqlab.engines.vllm import batch_k, gpu_lookup, plugin  # noqa: E402
from hqlab.engines.vllm.cpu_scheduler import cpu_async_scheduler, drive  # noqa: E402
from hqlab.replay.gate import replay_gated  # noqa: E402
from hqlab.replay.traces import load_traces  # noqa: E402
from hqlab.rules.gate import GateConfig  # noqa: E402
from hqlab.rules.lookup import suffix_match  # noqa: E402

RESULTS = Path(__file__).resolve().parents[3] / "data" / "results"
LOOKUP = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"


def scheduler_for(spec: str, max_len: int, max_num_seqs: int = 8):
    return cpu_async_scheduler(spec, max_len=max_len, max_num_seqs=max_num_seqs)


def served_widths(spec: str, trace, lookup: LookupConfig) -> tuple[list[int], list[int]]:
    """Serve one request through vLLM's scheduler: the verify width of each of its steps and the tokens each
    emitted, until its output is complete."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    prompt, out = list(trace.prompt_ids), list(trace.output_ids)
    scheduler = scheduler_for(spec, len(prompt) + len(out) + 64)
    scheduler.add_request(Request(request_id="r", prompt_token_ids=prompt, pooling_params=None,
                                  sampling_params=SamplingParams(max_tokens=len(out), temperature=0,
                                                                 ignore_eos=True)))
    widths, emitted, pos = [], [], 0

    def run(step) -> ModelRunnerOutput:  # the worker
        nonlocal pos
        if "r" not in step.num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        width = len(step.scheduled_spec_decode_tokens.get("r", ()))
        if pos >= len(out):  # scheduled before the scheduler saw the request finish: vLLM drops these tokens
            tokens = [out[-1]]
        elif pos == 0:  # the prefill
            tokens = [out[0]]
        else:
            drafts = suffix_match(np.asarray(prompt + out[:pos]), nmin=lookup.nmin, nmax=lookup.nmax, k=width,
                                  policy=lookup.policy).tokens if width else np.empty(0, dtype=np.int64)
            agree = 0
            while agree < len(drafts) and pos + agree < len(out) and drafts[agree] == out[pos + agree]:
                agree += 1
            tokens = out[pos:pos + agree + 1]
        if pos < len(out):
            widths.append(width)
            emitted.append(len(tokens))
            pos += len(tokens)
        return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[tokens])

    drive(scheduler, run)
    assert pos == len(out)
    return widths, emitted


@pytest.fixture(scope="module")
def traces():
    picked = {t.category: t for t in load_traces(RESULTS / "traces" / "0.5b_all_128" / "traces.parquet")}
    prose = [t for t in load_traces(RESULTS / "traces" / "0.5b_corpus_128" / "traces.parquet") if t.category == "prose"]
    return [picked["chat"], picked["copy"], picked["qa"], prose[0], prose[1]]


@pytest.mark.parametrize("gate", [0, 2, 4])
def test_vllms_scheduler_fixes_the_widths_the_replay_predicts(traces, gate):
    spec = LOOKUP + (f",gate={gate}" if gate else "")
    lookup = gpu_lookup.lookup_config(spec)
    closed = 0
    for trace in traces:
        widths, emitted = served_widths(spec, trace, lookup)
        replayed = replay_gated(trace, lookup, GateConfig(gate) if gate else None)
        assert [w > 0 for w in widths] == list(replayed.width > 0), trace.prompt_id
        assert emitted == list(replayed.emitted), trace.prompt_id
        closed += int((replayed.width[1:] == 0).sum())
    assert (closed > 0) == (gate > 0)  # the gate closes some steps on these traces; without it none is closed


def test_the_gate_gets_plain_step_graphs_and_keeps_the_load_schedule():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    gated = gpu_lookup.speculative_config(LOOKUP + ",gate=2")
    assert gated["num_speculative_tokens_per_batch_size"] == \
        gpu_lookup.speculative_config(LOOKUP)["num_speculative_tokens_per_batch_size"]  # already reaches 0
    bare = gpu_lookup.speculative_config("gpu-lookup:nmin=1,nmax=32,k=15,gate=2")
    schedule = bare["num_speculative_tokens_per_batch_size"]
    assert schedule == [[1, batch_k.MAX_BATCH - 1, 15], [batch_k.MAX_BATCH, batch_k.MAX_BATCH, 0]]
    assert build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=256, vllm_num_speculative_tokens=15) \
        == [0] + [15] * 256  # the width-0 range is for the CUDA graphs only: no batch size reaches it
    assert "num_speculative_tokens_per_batch_size" not in gpu_lookup.speculative_config(
        "gpu-lookup:nmin=1,nmax=32,k=15")


def test_a_bad_gate_says_what_to_fix():
    with pytest.raises(ConfigError, match="gate is the match length"):
        gpu_lookup.lookup_config(LOOKUP + ",gate=-1")
    with pytest.raises(ConfigError, match="gate"):
        gpu_lookup.lookup_config("gpu-fused:k=15,gate=2")


def test_waiting_requests_count_with_their_prompts_only_up_to_the_free_slots():
    """A request's first steps are fixed before any of its output exists: its prompt decides them, if the step may
    admit it. With two slots and three waiting requests, only the first two in the queue count."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    distinct, repeated = list(range(100, 140)), list(range(100, 140)) + [100]  # gate=1: closed, open
    for prompts, width in [([distinct, distinct, repeated], 0), ([distinct, repeated, distinct], 7)]:  # 7: batch_k
        scheduler = scheduler_for(LOOKUP + ",gate=1", 256, max_num_seqs=2)
        for i, prompt in enumerate(prompts):
            scheduler.add_request(request(str(i), prompt))
        step = scheduler.schedule()
        assert sorted(step.num_scheduled_tokens) == ["0", "1"]
        assert step.num_spec_tokens_to_schedule == width
        gate = plugin._gate(scheduler)
        assert (gate.open_steps, gate.closed_steps) == ((1, 0) if width else (0, 1))


def test_the_step_cost_benchmarks_width_reaches_the_scheduler_and_the_speculator():
    """`plugin.set_width` (the engine-core utility `hqlab_set_width`) on vLLM's own scheduler and a GPU lookup
    speculator built on the CPU: every batch size verifies the forced width, and the speculator's table agrees (it
    skips drafting at 0). The executor's part is vLLM's `collective_rpc`, which calls the function on each worker."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    spec = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/2:7/3:3/0"
    scheduler = scheduler_for(spec, 256)
    assert getattr(EngineCore, plugin.WIDTH_UTILITY) is plugin.set_width  # what call_utility finds by name
    speculator = gpu_lookup.GpuLookupSpeculator.standalone(gpu_lookup.lookup_config(spec), max_num_reqs=8,
                                                           max_model_len=256, pad=0, device="cpu")
    worker = SimpleNamespace(model_runner=SimpleNamespace(speculator=speculator))
    executor = SimpleNamespace(collective_rpc=lambda fn, args=(): [fn(worker, *args)])
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    assert scheduler.dynamic_sd_lookup[1:5] == [15, 7, 3, 0]
    for width in (3, 0, 15):
        assert plugin.set_width(core, width) == 1
        assert set(scheduler.dynamic_sd_lookup[1:]) == {width} and set(speculator.k_table[1:]) == {width}
    with pytest.raises(ConfigError, match="forced width must be in"):
        plugin.set_width(core, 16)
    gated = scheduler_for(spec + ",gate=1", 256)
    with pytest.raises(ConfigError, match="drop gate"):
        plugin.set_width(SimpleNamespace(scheduler=gated, model_executor=executor), 3)

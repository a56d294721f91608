"""Requests that end early, are preempted or share a prompt, through vLLM's own scheduler, for each hqlab speculator,
on the CPU (issue #60's CPU half).

vLLM 0.26's `AsyncScheduler`, built from a real config with the plugin's patches and a KV cache of a few blocks (so
that it preempts running requests and recomputes them later), serves a mix of requests through the engine core's
loop with a batch queue of two: prompts that quote a passage the answer copies, continuations, repeats of an
earlier request,
`max_tokens` 1 and 2, n = 4 (vLLM's own fan-out into child requests), a stop token, clients that disconnect
mid-stream, abort while queued or while preempted. The worker's half is model runner V2's request bookkeeping on
CPU tensors (`CpuRunner`: vLLM's own `RequestState` and `finish_requests`, the plugin's wrappers, vLLM's
`InputBatch`) around the real speculator classes; the model is a target whose outputs are known, verifying each
step's drafts as a greedy target does.

What is checked, for `gpu-lookup` (with and without prefix caching), its corpus, its gate and goodput hooks, and
`gpu-fused` (every-step drafting in prompt chunks, the served shape: one drafter token, device skip, width-0 steps;
with goodput, and with widths that flip 15 -> 0 -> 7 -> 15 at one batch size):
- every step's drafts are the pure reference's on the history vLLM holds at that step: `hqlab.rules.lookup`,
  `hqlab.rules.corpus` over the corpus its log rebuilds, `FusedProposer` with a drafter that reads each history
  whole into an empty cache; so a request preempted and prefilled again drafts what an uninterrupted one drafts at
  the same history (the fused block's scheduler restarts there, as for a new request: vLLM admits both alike);
- per-request host state lives exactly as long as vLLM's own: the gate's and goodput's dictionaries, the corpus's
  admitted set, the fused drafter's prompt notes; the corpus gets each freed request once, with the tokens its
  client received;
- every client that was not cut off received the target's tokens (cut at the stop token), aborted ones a prefix;
- the run did what it is meant to: preemptions, resumed requests drafting, aborts mid-stream, queued and preempted,
  reused slots, n = 4, max_tokens 1 and 2 (no check may pass on a run that never met the case);
- each check fails on a planted state bug (monkeypatched into the real classes);
- hundreds of short requests with random aborts leave the host dictionaries and the device tables at their size
  before the run.
The server-side suite (vllm serve on a GPU, clients that disconnect, every sampling option) is hqlab/bench/faults.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import tempfile
import time
from collections import deque
from copy import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm)")

from hqlab import models  # noqa: E402
from hqlab.engines.vllm import gpu_fused, gpu_lookup, plugin  # noqa: E402
from hqlab.engines.vllm.drafter_prompts import PromptReader  # noqa: E402
from hqlab.engines.vllm.gate import SchedulerGate  # noqa: E402
from hqlab.engines.vllm.goodput import PENDING_LIMIT, SchedulerGoodput, speculator_table  # noqa: E402
from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator, fused_config  # noqa: E402
from hqlab.engines.vllm.gpu_lookup import GpuLookupSpeculator  # noqa: E402
from hqlab.rules.corpus import Corpus, propose as corpus_propose  # noqa: E402
from hqlab.rules.gate import SuffixGate  # noqa: E402
from hqlab.rules.goodput import StepCosts  # noqa: E402
from hqlab.rules.lookup import suffix_match  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
BLOCK = 16  # tokens per KV block
SLOTS, LEN, K = 4, 256, 4  # max_num_seqs, max_model_len, draft positions
LOOKUP = "gpu-lookup:nmin=1,nmax=16,k=4,policy=earliest"
FUSED_PAD = 63  # the tiny drafter's vocabulary is 64: the fused runs use token ids below 60 and this pad
# the runner's tensors are CPU tensors, which the lookup kernel reads only in Triton's interpreter (tests/conftest.py
# turns it on where there is no GPU); on a GPU host the server suite (hqlab/bench/faults.py) is the test
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="the lookup kernel reads the CPU runner's tensors "
                                 "only in Triton's interpreter, which runs where there is no GPU")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the drafter's small products are slower threaded on a CPU shared with other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- vLLM's model runner V2, its request side, on the CPU -------------------------------------------------------


class StagedRows:
    """`vllm.v1.worker.gpu.buffer_utils.StagedWriteTensor` over a CPU tensor: writes staged on the host and applied
    in order by `apply_write` (vLLM applies them with a Triton kernel that reads UVA memory, which needs a GPU)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.gpu = tensor
        self._writes: list[tuple[int, int | None, Any]] = []

    def stage_write(self, index: int, start: int, x: Any) -> None:
        if len(x):
            self._writes.append((index, start, list(x)))

    def stage_write_elem(self, index: int, x: int) -> None:
        self._writes.append((index, None, x))

    def apply_write(self) -> None:
        for index, start, x in self._writes:
            if start is None:
                self.gpu[index] = x
            else:
                self.gpu[index, start:start + len(x)] = torch.tensor(x, dtype=self.gpu.dtype)
        self._writes = []


class HostMirrored:
    """`vllm.v1.worker.gpu.buffer_utils.UvaBackedTensor`: the host array is the truth, `gpu` its copy for the
    device, refreshed by `copy_to_uva`."""

    def __init__(self, size: int) -> None:
        self.cpu = torch.zeros(size, dtype=torch.int32)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu.clone()

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        self.gpu = self.cpu.clone()
        return self.gpu


def cpu_request_state(slots: int, max_len: int, k: int) -> Any:
    """vLLM 0.26's own `RequestState` (the V2 runner's per-slot bookkeeping: `add_request`, `remove_request`,
    `apply_staged_writes`, its free-slot list) over CPU buffers in place of its UVA ones. The history rows start as
    noise, as a reused slot's row holds an earlier request's tokens."""
    from vllm.v1.worker.gpu.states import RequestState

    state = RequestState.__new__(RequestState)
    state.max_num_reqs, state.max_model_len, state.num_speculative_steps = slots, max_len, k
    state.req_id_to_index, state.index_to_req_id, state.free_indices = {}, {}, list(range(slots))
    noise = np.random.default_rng(0).integers(0, 50, (slots, max_len), dtype=np.int32)
    state.all_token_ids = StagedRows(torch.from_numpy(noise))
    state.prompt_len, state.prefill_len = HostMirrored(slots), HostMirrored(slots)
    state.total_len = StagedRows(torch.zeros(slots, dtype=torch.int32))
    state.num_computed_tokens = StagedRows(torch.zeros(slots, dtype=torch.int32))
    state.num_computed_prefill_tokens = np.zeros(slots, dtype=np.int32)
    state.num_computed_tokens_np = np.zeros(slots, dtype=np.int32)
    state.max_seq_len = np.zeros(slots, dtype=np.int32)
    state.last_sampled_tokens = torch.zeros(slots, 1, dtype=torch.int64)
    state.draft_tokens = torch.zeros(slots, k, dtype=torch.int64)
    state.next_prefill_tokens = torch.zeros(slots, dtype=torch.int32)
    return state


class CpuRunner:
    """The request side of vLLM 0.26's model runner V2 (`GPUModelRunner`) step for step on the CPU: its own
    `finish_requests` (with the plugin's wrapper) and `RequestState`, and its `add_requests`, `update_requests`,
    `prepare_inputs` and `post_update` for what a speculator reads. The model is a target whose outputs are known
    (`targets`: request id -> its tokens in order): a decode step verifies the drafts of the request's step before
    (the longest agreeing prefix, then the target's own token), as a greedy target does.

    `on_step(runner, batch, num_sampled, drafts)` sees each step after the speculator drafted."""

    def __init__(self, speculator: Any, targets: dict[str, list[int]], on_step: Callable[..., None] | None = None,
                 *, slots: int = SLOTS, max_len: int = LEN, k: int = K) -> None:
        self.speculator, self.targets, self.on_step, self.max_len = speculator, targets, on_step, max_len
        self.req_states = cpu_request_state(slots, max_len, k)
        self.decode_query_len = k + 1
        speculator.bind(self.req_states.all_token_ids.gpu, self.req_states.total_len.gpu)  # as the plugin binds it
        self.admitted: list[tuple[str, int, int, int]] = []  # (request, slot, prompt length, tokens to prefill)
        self.verified: list[set[int]] = []  # per step that ran: the widths its decoding requests verified

    def _remove_request(self, req_id: str) -> bool:
        """GPUModelRunner._remove_request, for the request state (the model's other states are not built here)."""
        return self.req_states.remove_request(req_id) is not None

    def history(self, slot: int) -> list[int]:
        return self.req_states.all_token_ids.gpu[slot, :int(self.req_states.total_len.gpu[slot])].tolist()

    def execute(self, out: Any) -> Any:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        GPUModelRunner.finish_requests(self, out)  # vLLM's own, wrapped by the plugin
        self._add_requests(out)
        self._update_requests(out)
        if out.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self._prepare(out)
        self.verified.append({len(v) for v in out.scheduled_spec_decode_tokens.values()})
        sampled = self._sample(batch, out)
        num_sampled = torch.tensor([len(t) for t in sampled], dtype=torch.int32)
        self._post_update(batch, sampled)
        drafts = self.speculator.propose(batch, num_sampled=num_sampled)
        self.req_states.draft_tokens[batch.idx_mapping.long()] = drafts
        if self.on_step is not None:
            self.on_step(self, batch, num_sampled, drafts)
        return ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=sampled,
                                 req_id_to_index={r: i for i, r in enumerate(batch.req_ids)})

    def _add_requests(self, out: Any) -> None:
        """GPUModelRunner.add_requests: a new or resumed request (the scheduler sends both to the V2 runner as new,
        with the tokens to prefill) takes a free slot, its row the tokens to prefill."""
        states = self.req_states
        for new in out.scheduled_new_reqs:
            self._remove_request(new.req_id)  # vLLM's: a streaming-input request is re-added whole
            states.add_request(req_id=new.req_id, prompt_len=len(new.prompt_token_ids),
                               all_token_ids=new.prefill_token_ids, num_computed_tokens=new.num_computed_tokens,
                               max_tokens=new.sampling_params.max_tokens)
            self.admitted.append((new.req_id, states.req_id_to_index[new.req_id], len(new.prompt_token_ids),
                                  len(new.prefill_token_ids)))
        if out.scheduled_new_reqs:
            states.apply_staged_writes()

    def _update_requests(self, out: Any) -> None:
        """GPUModelRunner.update_requests: the scheduler's computed counts, and the prefill progress from them."""
        states, cached = self.req_states, out.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            states.num_computed_tokens_np[states.req_id_to_index[req_id]] = computed
        np.minimum(states.num_computed_tokens_np, states.prefill_len.np, out=states.num_computed_prefill_tokens)

    def _prepare(self, out: Any) -> Any:
        """GPUModelRunner.prepare_inputs: the fields a speculator reads, in vLLM's own InputBatch."""
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        states = self.req_states
        req_ids = sort_batch_req_ids(out.num_scheduled_tokens, self.decode_query_len)
        scheduled = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        idx = np.array([states.req_id_to_index[r] for r in req_ids], dtype=np.int32)
        prefill_len, computed_prefill = states.prefill_len.np[idx], states.num_computed_prefill_tokens[idx]
        tokens = int(scheduled.sum())
        dummy = InputBatch.make_dummy(len(req_ids), tokens, InputBuffers(states.max_num_reqs, tokens, "cpu"))
        return dataclasses.replace(dummy, req_ids=req_ids, idx_mapping=torch.from_numpy(idx.copy()),
                                   idx_mapping_np=idx, num_scheduled_tokens=scheduled, prefill_len_np=prefill_len,
                                   num_computed_tokens_np=states.num_computed_tokens_np[idx],
                                   num_computed_prefill_tokens_np=computed_prefill,
                                   is_prefilling_np=computed_prefill < prefill_len)

    def _sample(self, batch: Any, out: Any) -> list[list[int]]:
        """The target's tokens per row: none for a prompt chunk that does not end the prefill, its next token after
        one that does, and for a decode step the verified drafts' agreeing prefix and one token more."""
        states, sampled = self.req_states, []
        for i, rid in enumerate(batch.req_ids):
            slot, target = int(batch.idx_mapping_np[i]), self.targets[rid]
            done = int(states.total_len.gpu[slot]) - int(states.prompt_len.np[slot])  # output tokens in the row
            if batch.is_prefilling_np[i]:
                ends = batch.num_computed_prefill_tokens_np[i] + batch.num_scheduled_tokens[i] >= \
                    batch.prefill_len_np[i]
                sampled.append(target[done:done + 1] if ends else [])
                continue
            width = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            drafts = states.draft_tokens[slot, :width].tolist()
            agree = 0
            while agree < width and drafts[agree] == target[done + agree]:
                agree += 1
            sampled.append(target[done:done + agree + 1])
        return sampled

    def _post_update(self, batch: Any, sampled: list[list[int]]) -> None:
        """vLLM's `post_update` kernel: the sampled tokens appended to the slot's row, its length grown."""
        states = self.req_states
        for i, tokens in enumerate(sampled):
            slot, total = int(batch.idx_mapping_np[i]), int(states.total_len.gpu[int(batch.idx_mapping_np[i])])
            assert total + len(tokens) <= self.max_len, "vLLM ran a request past max_model_len"
            if tokens:
                states.all_token_ids.gpu[slot, total:total + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
                states.total_len.gpu[slot] = total + len(tokens)
                states.last_sampled_tokens[slot, 0] = tokens[-1]


# --- vLLM's scheduler and the engine core's loop ------------------------------------------------------------------


def scheduler_for(spec: str, *, num_blocks: int, prefix_caching: bool, budget: int, slots: int = SLOTS,
                  record: bool = False) -> Any:
    """vLLM 0.26's AsyncScheduler for `spec` with the plugin's patches, from a real config of the 0.5B (the scheduler
    reads its shape only), over a KV cache of `num_blocks` blocks: few, so that vLLM preempts. On a machine without
    a GPU vLLM's config picks the V1 runner (it turns Triton off there); the scheduler reads that choice once, and
    here takes the V2 runner's, the runner hqlab's speculators run on."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    plugin.register()
    plugin._patch_finish_requests()  # what the plugin's init_speculator installs in the worker
    module = gpu_fused if spec.startswith("gpu-fused") else gpu_lookup
    config = VllmConfig(
        model_config=ModelConfig(model=str(models.prepare("qwen2.5-coder-0.5b")), dtype="float32", max_model_len=LEN),
        scheduler_config=SchedulerConfig(max_num_seqs=slots, max_model_len=LEN, max_num_batched_tokens=budget,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        speculative_config=SpeculativeConfig(**module.speculative_config(spec)), device_config=DeviceConfig("cpu"),
        additional_config={module.SPEC_KEY: spec, **({module.RECORD_KEY: True} if record else {})})
    assert config.scheduler_config.async_scheduling  # the plugin's, as vLLM does for EAGLE
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    scheduler = AsyncScheduler(vllm_config=config, kv_cache_config=kv, log_stats=False, block_size=BLOCK,
                               structured_output_manager=StructuredOutputManager(config))
    scheduler.use_v2_model_runner = True
    return scheduler


@dataclass
class Planned:
    """A client request: its prompt, the target's tokens for each of its n samples (`targets`, longer than
    `max_tokens`: the worker may run a step past a stop before the scheduler sees it), when it arrives (engine loop
    iteration), an optional stop token, and what its client does (`abort`): ("tokens", j) disconnects after j
    streamed tokens, ("queued", 0) aborts before the request is first scheduled."""

    rid: str
    prompt: list[int]
    targets: list[list[int]]
    max_tokens: int
    arrive: int = 0
    stop: int | None = None
    abort: tuple[str, int] | None = None

    def children(self) -> list[str]:
        """The engine core's request ids: vLLM's parallel sampling names sample i of request r "i_r"."""
        return [self.rid] if len(self.targets) == 1 else [f"{i}_{self.rid}" for i in range(len(self.targets))]

    def expected(self, index: int) -> list[int]:
        """What sample `index` streams if nobody cuts it off: max_tokens tokens, to the stop token included."""
        out = self.targets[index][:self.max_tokens]
        return out[:out.index(self.stop) + 1] if self.stop in out else out


@dataclass
class Served:
    """What a run did: per engine request the streamed tokens and how it ended (vLLM's finish reason, or "abort"),
    the preemptions in order, the requests aborted while waiting, and the requests vLLM freed, in order."""

    streams: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    aborted_waiting: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)


def engine_requests(plan: Planned, block_hasher: Any) -> list[Any]:
    """The engine core's requests for a client request, built as its LLMEngine and EngineCore build them, n > 1
    fanned out by vLLM's own `ParentRequest`."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.request import Request

    n = len(plan.targets)
    params = SamplingParams(n=n, max_tokens=plan.max_tokens, temperature=0.0 if n == 1 else 1.0, seed=7,
                            ignore_eos=True, stop_token_ids=[plan.stop] if plan.stop is not None else None)
    core = EngineCoreRequest(request_id=plan.rid, prompt_token_ids=list(plan.prompt), mm_features=None,
                             sampling_params=params, pooling_params=None, arrival_time=time.time(), lora_request=None,
                             cache_salt=None, data_parallel_rank=None, external_req_id=plan.rid)
    if n == 1:
        return [Request.from_engine_core_request(core, block_hasher)]
    parent, children = ParentRequest(core), []
    for i in range(n):
        child = core if i == n - 1 else copy(core)
        child.request_id, child.sampling_params = parent.get_child_info(i)
        children.append(Request.from_engine_core_request(child, block_hasher))
    return children


def block_hasher_for(scheduler: Any) -> Any:
    """The engine core's request block hasher under prefix caching (None without)."""
    if not scheduler.vllm_config.cache_config.enable_prefix_caching:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(scheduler.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


MAX_ITERATIONS = 20000  # a run that has not ended by then hangs: it fails, it is not cut short


def serve(scheduler: Any, runner: CpuRunner, plans: list[Planned], after_update: Callable[[Any], None] | None = None,
          served: Served | None = None, abort_preempted: int = 3) -> Served:
    """The engine core's loop with a batch queue of two (`EngineCore.step_with_batch_queue`, how vLLM runs
    asynchronous scheduling): schedule step n + 1 and run it, then process step n's output. Clients arrive and
    abort between iterations (`EngineCore.abort_requests`): as planned, and the client of every `abort_preempted`-th
    request vLLM preempts while it waits to be resumed."""
    hasher, served, queue = block_hasher_for(scheduler), served or Served(), deque()
    pending = sorted(plans, key=lambda p: p.arrive)
    original_free = type(scheduler)._free_request

    def free(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:  # the requests vLLM frees, in order
        served.freed.append(request.request_id)
        return original_free(self, request, *args, **kwargs)

    scheduler._free_request = free.__get__(scheduler)
    for iteration in range(MAX_ITERATIONS):
        while pending and pending[0].arrive <= iteration:
            for request in engine_requests(pending.pop(0), hasher):
                scheduler.add_request(request)
                served.streams[request.request_id] = []
        _client_aborts(scheduler, plans, served, abort_preempted)
        if not (pending or scheduler.has_requests() or queue):
            return served
        if scheduler.has_requests():
            out = scheduler.schedule()
            served.preempted += sorted(out.preempted_req_ids)
            queue.appendleft((out, runner.execute(out)))
            if len(queue) < 2 and scheduler.has_requests():
                continue
        if queue:
            out, result = queue.pop()
            for outputs in scheduler.update_from_output(out, result).values():
                for o in outputs.outputs:
                    served.streams[o.request_id] += o.new_token_ids
                    if o.finish_reason is not None:
                        served.finished[o.request_id] = str(o.finish_reason)
            if after_update is not None:
                after_update(scheduler)
    raise AssertionError(f"the engine loop ran {MAX_ITERATIONS} iterations and its requests had not ended: a hang")


def _client_aborts(scheduler: Any, plans: list[Planned], served: Served, abort_preempted: int) -> None:
    """Clients that go away (`Planned.abort`, and every `abort_preempted`-th preemption's while the request waits);
    an abort ends all of a request's samples, as vLLM's front end aborts a parent's children."""
    from vllm.v1.request import RequestStatus

    for plan in plans:
        ids = [r for r in plan.children() if r in scheduler.requests and r not in served.finished]
        if not ids:
            continue
        waiting = {scheduler.requests[r].status for r in ids} == {RequestStatus.WAITING}
        chosen = set(served.preempted[abort_preempted - 1::abort_preempted])
        preempted = [r for r in ids if scheduler.requests[r].status == RequestStatus.PREEMPTED and r in chosen]
        streamed = max(len(served.streams[r]) for r in ids)
        if plan.abort == ("queued", 0) and waiting or preempted:
            served.aborted_waiting += ids
        elif plan.abort is None or plan.abort[0] != "tokens" or streamed < plan.abort[1]:
            continue
        scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        served.finished.update({r: "abort" for r in ids})


def flush(scheduler: Any, runner: CpuRunner) -> None:
    """One more step at rest, as the next request's first step would be: requests freed after the last step leave
    vLLM's runner (and the speculator's state) with the next scheduler output, which also carries their documents to
    the corpus."""
    assert not scheduler.has_requests()
    runner.execute(scheduler.schedule())


# --- the requests -----------------------------------------------------------------------------------------------


def text_tokens(vocab: int) -> np.ndarray:
    """Real text as token ids, one per word of the benchmark's handbook (natural repetition; a fixed document, so
    the runs stay the same), folded into `vocab`."""
    ids: dict[str, int] = {}
    words = re.findall(r"\w+|[^\w\s]", (REPO / "data" / "documents" / "handbook.md").read_text())
    return np.array([ids.setdefault(w, len(ids)) % vocab for w in words], dtype=np.int64)


def mixed_plans(count: int, vocab: int, *, seed: int = 0, spacing: int = 3, prompt: tuple[int, int] = (12, 64),
                out: tuple[int, int] = (4, 28), stop: int | None = None) -> list[Planned]:
    """`count` requests over the text: prompts that quote a passage and start it again, the answer copying on
    (long accepted drafts from the first step, long fused blocks), continuations, repeats of an earlier request
    (the corpus's case), n = 4, max_tokens 1 and 2, a stop token on every fourth (where `stop` is given); every
    fifth client disconnects mid-stream, a few abort while queued."""
    rng, text, plans = np.random.default_rng(seed), text_tokens(vocab), []
    for i in range(count):
        start, p_len = int(rng.integers(0, len(text) - 600)), int(rng.integers(*prompt))
        max_tokens = 1 if i % 7 == 2 else 2 if i % 7 == 4 else int(rng.integers(*out))
        span = max_tokens + 3 * (K + 1)  # the target runs on: vLLM may run a step or two past the end it sees later
        prompt_ids, kind = text[start:start + p_len].tolist(), i % 6
        if kind in (0, 2):  # the prompt quotes a passage and starts it again; the answer copies on (long blocks)
            passage = prompt_ids[int(rng.integers(0, p_len // 2)):]
            prompt_ids, max_tokens = prompt_ids + passage[:6], max(max_tokens, out[1])
            span = max_tokens + 3 * (K + 1)
            targets = [(passage[6:] + passage * (span // len(passage) + 1))[:span]]
        elif kind == 3 and plans:  # an earlier request again: same prompt, same answer
            earlier = plans[int(rng.integers(0, len(plans)))]
            prompt_ids, targets = earlier.prompt, [(earlier.targets[0] * span)[:span]]
        elif kind == 5:  # parallel sampling: four different answers
            targets = [text[start + p_len + 60 * j:start + p_len + 60 * j + span].tolist() for j in range(4)]
        else:
            targets = [text[start + p_len:start + p_len + span].tolist()]
        abort = ("tokens", int(rng.integers(1, 10))) if i % 5 == 1 else ("queued", 0) if i % 11 == 7 else None
        plans.append(Planned(f"q{i}", prompt_ids, targets, max_tokens, arrive=spacing * i, abort=abort,
                             stop=stop if i % 4 == 0 else None))
    return plans


def targets_of(plans: list[Planned]) -> dict[str, list[int]]:
    return {rid: target for p in plans for rid, target in zip(p.children(), p.targets)}


def check_streams(plans: list[Planned], served: Served) -> None:
    """Every sample that ran to its end streamed the target's tokens (cut at the stop token); every aborted one a
    prefix of them; none was left unfinished."""
    for plan in plans:
        for i, rid in enumerate(plan.children()):
            assert rid in served.finished, f"{rid} never finished: left hanging"
            got, want = served.streams[rid], plan.expected(i)
            if served.finished[rid] == "abort":
                assert got == want[:len(got)], f"{rid}: aborted after tokens that are not the target's"
            else:
                assert got == want, f"{rid} streamed {got}, not the target's {want}"


def check_cases_met(plans: list[Planned], served: Served, runner: CpuRunner) -> None:
    """The run met every case it is meant to test: preemptions and the preempted requests prefilled again, aborts
    mid-stream, while queued and after a preemption, slots reused, n = 4 and max_tokens 1 and 2 served."""
    resumed = [a for a in runner.admitted if a[3] > a[2]]  # admitted with output tokens to prefill again
    assert served.preempted and resumed, "vLLM preempted nothing: the KV cache is too large for this run"
    aborts = {p.abort[0] for p in plans if p.abort and any(served.finished[r] == "abort" for r in p.children())}
    assert aborts == {"tokens", "queued"}, f"aborts met: {aborts}"
    assert set(served.aborted_waiting) & set(served.preempted), "no client went away while its request was preempted"
    holders: dict[int, set[str]] = {}
    for rid, slot, _, _ in runner.admitted:
        holders.setdefault(slot, set()).add(rid)
    assert max(len(h) for h in holders.values()) > 1, "no slot was reused"
    done = {p.max_tokens for p in plans if all(served.finished[r] == "length" for r in p.children())}
    assert {1, 2} <= done and any(len(p.targets) == 4 and served.finished[p.children()[0]] != "abort" for p in plans)


def live_requests(runner: CpuRunner) -> set[str]:
    """The requests that hold a slot of vLLM's runner now."""
    return set(runner.req_states.req_id_to_index)


# --- gpu-lookup, its corpus, its gate and goodput hooks ---------------------------------------------------------


class LookupCheck:
    """At every step the lookup drafted in: each row's history is its request's own tokens (vLLM prefilled a
    resumed request's again, into whatever slot it got) and its drafts are the rule's on that history
    (`hqlab.rules.lookup.suffix_match`; with the corpus, `hqlab.rules.corpus.propose` over the corpus rebuilt from
    the speculator's log, with the documents that had entered when the step drafted, each document the request's
    prompt and the tokens its client received), `pad` after them."""

    def __init__(self, speculator: GpuLookupSpeculator, plans: list[Planned], served: Served) -> None:
        self.speculator, self.config, self.served = speculator, speculator.config, served
        self.prompts = {rid: p.prompt for p in plans for rid in p.children()}
        self.truth = {rid: p.prompt + t for p in plans for rid, t in zip(p.children(), p.targets)}
        self.skipped, self.rows, self.resumed_rows, self.corpus_rows = speculator.skipped_steps, 0, 0, 0
        self.log: list[dict[str, Any]] = []  # the corpus's insertions, in order

    def __call__(self, runner: CpuRunner, batch: Any, num_sampled: torch.Tensor, drafts: torch.Tensor) -> None:
        if self.speculator.corpus is not None:
            self.log += self.speculator.take_corpus_log()
        if self.speculator.skipped_steps != self.skipped:  # batch_k's width 0: nothing drafted this step
            self.skipped = self.speculator.skipped_steps
            return
        records = {r["request"]: r for r in self.speculator.take_records()}
        resumed = {a[0] for a in runner.admitted if a[3] > a[2]}
        for i, rid in enumerate(batch.req_ids):
            history = runner.history(int(batch.idx_mapping_np[i]))
            assert history == self.truth[rid][:len(history)], f"{rid}: vLLM's row is not the request's tokens"
            want = self.reference(np.asarray(history, dtype=np.int64), records.get(rid))
            got = drafts[i].tolist()
            assert got == want.tokens.tolist() + [self.speculator.pad] * (self.config.k - want.valid), \
                f"{rid} at {len(history)} tokens: drafts {got} differ from the rule's {want.tokens.tolist()}"
            self.rows += 1
            self.resumed_rows += rid in resumed
            self.corpus_rows += records.get(rid, {}).get("source") == "corpus"

    def document(self, rid: str) -> list[int]:
        output = self.served.streams[rid]
        return self.prompts[rid] + output if self.config.corpus_prompts else output

    def reference(self, history: np.ndarray, record: dict[str, Any] | None) -> Any:
        c = self.config
        if self.speculator.corpus is None:
            return suffix_match(history, nmin=c.nmin, nmax=c.nmax, k=c.k, policy=c.policy)
        corpus = Corpus(c.corpus_config)
        for doc in self.log[:record["corpus_docs"]]:
            assert corpus.add(self.document(doc["request"])) == doc["seq"]
        return corpus_propose(history, corpus, nmin=c.nmin, nmax=c.nmax, k=c.k, policy=c.policy)[1]


def lookup_run(spec: str, plans: list[Planned], *, prefix_caching: bool, num_blocks: int = 12, budget: int = 48,
               after_update: Callable[[Any], None] | None = None) -> tuple[Any, CpuRunner, LookupCheck, Served]:
    """Serve `plans` through vLLM's scheduler with `spec`'s lookup checked at every step."""
    scheduler = scheduler_for(spec, num_blocks=num_blocks, prefix_caching=prefix_caching, budget=budget,
                              record="corpus=" in spec)
    speculator, served = GpuLookupSpeculator(scheduler.vllm_config, "cpu"), Served()
    check = LookupCheck(speculator, plans, served)
    runner = CpuRunner(speculator, targets_of(plans), check)
    serve(scheduler, runner, plans, after_update=after_update, served=served)
    return scheduler, runner, check, served


class HookCheck:
    """After every output vLLM's scheduler processed: the gate's or goodput's per-request dictionary holds only
    requests vLLM still has (running, waiting or preempted), the gate's state of each is the gate rule's over the
    history it has read (a preempted request keeps its history, so its state stays good), and goodput's outcomes
    awaited stay within their bound."""

    def __init__(self) -> None:
        self.checks = 0

    def __call__(self, scheduler: Any) -> None:
        hook = plugin._gate(scheduler)
        kept = hook.states if isinstance(hook, SchedulerGate) else hook.features
        stray = set(kept) - set(scheduler.requests)
        assert not stray, f"the scheduler's hook keeps state for requests vLLM freed: {sorted(stray)}"
        if isinstance(hook, SchedulerGate):
            for rid, state in kept.items():
                fresh = SuffixGate(hook.min_match)
                fresh.catch_up(scheduler.requests[rid].all_token_ids[:state.length])
                assert (fresh.length, fresh.open) == (state.length, state.open), f"{rid}: the gate's state is stale"
        else:
            assert len(hook._pending) <= PENDING_LIMIT
        self.checks += 1


def hook_state(scheduler: Any) -> dict[str, int]:
    """The sizes of the scheduler hook's per-request and per-step state."""
    hook = plugin._gate(scheduler)
    if isinstance(hook, SchedulerGate):
        return {"gate states": len(hook.states)}
    return {"goodput features": len(hook.features), "goodput pending": len(hook._pending)}


VOCAB = 150000  # the lookup runs' token ids: the handbook's words
STOP = int(np.bincount(text_tokens(VOCAB)).argmax())  # the commonest word: it occurs in many targets


LOOKUP_CASES = {"lookup": (LOOKUP, True), "gate": (f"{LOOKUP},batch_k=3:4/0,gate=1", True),
                "goodput": (f"{LOOKUP},batch_k=2:4/3:2/0,goodput=default", False)}  # spec, prefix caching


def lookup_case(name: str) -> None:
    """The lookup's drafts are the rule's at every step, a request prefilled again after its preemption included,
    in whatever slot; the gate's and goodput's dictionaries hold only requests vLLM still has, and are empty once
    the last freed request has left; every client that was not cut off got the target's tokens."""
    spec, prefix_caching = LOOKUP_CASES[name]
    plans = mixed_plans(30, VOCAB, stop=STOP)
    hooks = HookCheck() if name != "lookup" else None
    scheduler, runner, check, served = lookup_run(spec, plans, prefix_caching=prefix_caching, after_update=hooks)
    check_streams(plans, served)
    check_cases_met(plans, served, runner)
    assert check.rows > 50 and check.resumed_rows > 0  # resumed requests drafted after their prefill again
    flush(scheduler, runner)
    assert not live_requests(runner) and not scheduler.requests
    if hooks is not None:
        hooks(scheduler)
        assert hooks.checks > 50 and set(hook_state(scheduler).values()) == {0}


@INTERPRETED
@pytest.mark.parametrize("name", LOOKUP_CASES)
def test_the_lookup_drafts_the_rule_through_aborts_preemption_and_reused_slots(name):
    lookup_case(name)


CORPUS = f"{LOOKUP},corpus=3000,corpus_policy=longest,corpus_prompts=1"


def check_corpus(check: LookupCheck, served: Served, runner: CpuRunner) -> None:
    """The corpus got each request vLLM admitted and freed (finished, stopped, aborted mid-stream, aborted while
    preempted) exactly once, in the order vLLM freed them, as the prompt and the tokens its client received; a
    request aborted before it was admitted, never; and it keeps no request once all are freed."""
    admitted = {a[0] for a in runner.admitted}
    entered = [d["request"] for d in check.log]
    assert entered == [r for r in served.freed if r in admitted], "the corpus's insertions are not vLLM's frees"
    for d in check.log:
        assert (d["prompt_len"], d["output_len"]) == (len(check.prompts[d["request"]]),
                                                      len(served.streams[d["request"]])), d
    assert not check.speculator.corpus_seen, f"the corpus keeps admitted requests: {check.speculator.corpus_seen}"
    preempted, stopped = set(served.preempted), {r for r, why in served.finished.items() if why == "stop"}
    assert preempted & set(entered) and stopped & set(entered) and set(served.aborted_waiting) - set(entered)


def corpus_case() -> None:
    plans = mixed_plans(30, VOCAB, stop=STOP, seed=1)
    scheduler, runner, check, served = lookup_run(CORPUS, plans, prefix_caching=False)
    flush(scheduler, runner)
    check.log += check.speculator.take_corpus_log()
    check_streams(plans, served)
    check_cases_met(plans, served, runner)
    check_corpus(check, served, runner)
    assert check.corpus_rows > 0  # drafts came from earlier requests' documents


@INTERPRETED
def test_the_corpus_gets_each_freed_request_once_with_what_its_client_received():
    corpus_case()


# --- gpu-fused ------------------------------------------------------------------------------------------------


def tiny_drafter(slots: int, max_len: int) -> Any:
    """A 2-layer random-weight Qwen2 with a vocabulary of 64, seeded: the same weights every call."""
    from hqlab.engines.vllm.drafter import StaticQwen2

    hidden, inter, vocab = 128, 192, 64
    config = {"hidden_size": hidden, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
              "intermediate_size": inter, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, rows in (("self_attn.q_proj", hidden), ("self_attn.k_proj", 64), ("self_attn.v_proj", 64)):
            w[p + name + ".weight"] = torch.randn(rows, hidden, generator=g) * 0.1
            w[p + name + ".bias"] = torch.randn(rows, generator=g) * 0.1
        for name, shape in (("self_attn.o_proj", (hidden, hidden)), ("mlp.gate_proj", (inter, hidden)),
                            ("mlp.up_proj", (inter, hidden)), ("mlp.down_proj", (hidden, inter))):
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.1
        w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return StaticQwen2(config, w, slots=slots, max_len=max_len, dtype=torch.float32, attention="sdpa")


class FreshDrafter:
    """The reference drafter (`hqlab.proposers.base.Drafter`): the same weights, each history read whole into an
    empty cache row, then the head drafted greedily. The speculator's drafter builds its cache in pieces (prompt
    chunks, catch-up passes, lazily after skipped steps), across preemptions and reused slots: its head must be
    this one."""

    def __init__(self, k: int, max_len: int) -> None:
        self.k, self.config, self.model = k, None, tiny_drafter(1, max_len)

    def propose(self, histories: Any, budgets: Any, keys: Any = None) -> list[Any]:
        from hqlab.proposers.base import Proposal
        from hqlab.rules.fusion import SOURCE_DRAFT

        out, slot, zero = [], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        for history, budget in zip(histories, budgets):
            tokens, n = [], len(history)
            if budget > 0:
                token = self.model.extend(slot, torch.as_tensor(history, dtype=torch.int64)[None], zero,
                                          torch.tensor([n - 1]), n)
                tokens.append(int(token))
                for j in range(1, budget):
                    token = self.model.extend(slot, token[:, None], torch.tensor([n + j - 1]), zero, n + j)
                    tokens.append(int(token))
            out.append(Proposal(np.array(tokens, dtype=np.int64), np.full(len(tokens), SOURCE_DRAFT, dtype=np.int8)))
        return out

    exact = propose


class FusedCheck:
    """At every step the fused speculator drafted in, each sampling row's block is `FusedProposer`'s with
    `FreshDrafter` on the history vLLM holds, `pad` after it, and a row that does not sample proposes only `pad`.
    The reference keeps each request's scheduler state as the speculator keeps it per slot: from the request's
    first drafting step after vLLM admitted it (new, or preempted and prefilled again) to its free, with the step's
    emitted count vLLM's `num_sampled` (`fused_step`'s input). At every step the prompt reader's notes name only
    requests that hold the slot they are noted for."""

    def __init__(self, speculator: GpuFusedSpeculator) -> None:
        from hqlab.proposers.fused import FusedConfig, FusedProposer

        self.speculator, c = speculator, speculator.config
        rules = {f: getattr(c, f) for f in FusedConfig.__dataclass_fields__}
        drafter = FreshDrafter(c.draft_block, speculator.cache_len + c.draft_block)
        self.reference = FusedProposer(FusedConfig(**{**rules, "dtype": "float32", "device": "cpu"}), drafter)
        self.states: dict[str, Any] = {}  # request -> its scheduler state, as the speculator's slot holds it
        self.seen_admitted, self.drafting, self.rows, self.resumed_rows = 0, speculator.drafting_steps, 0, 0
        self.widths: list[tuple[int | None, bool]] = []  # per step: the width handed over for the next, drafted

    def __call__(self, runner: CpuRunner, batch: Any, num_sampled: torch.Tensor, drafts: torch.Tensor) -> None:
        for rid, *_ in runner.admitted[self.seen_admitted:]:
            self.states.pop(rid, None)  # (re)admitted: its scheduler state starts again
        self.seen_admitted = len(runner.admitted)
        check_prompt_notes(self.speculator.prompts, runner)
        self.widths.append((self.speculator.scheduled_width, self.speculator.drafting_steps != self.drafting))
        if self.speculator.drafting_steps == self.drafting:  # the next step's width is 0: nothing drafted this step
            return
        self.drafting = self.speculator.drafting_steps
        rows = [i for i in range(len(batch.req_ids)) if int(num_sampled[i]) > 0]
        keys = [batch.req_ids[i] for i in rows]
        histories = [np.asarray(runner.history(int(batch.idx_mapping_np[i])), dtype=np.int64) for i in rows]
        self.reference.states = {key: (self.states[key], len(h) - int(num_sampled[i]))
                                 for key, h, i in zip(keys, histories, rows) if key in self.states}
        want = self.reference.propose(histories, [self.speculator.k] * len(rows), keys=keys)
        self.states.update({key: self.reference.states[key][0] for key in keys})
        resumed, pad, k = {a[0] for a in runner.admitted if a[3] > a[2]}, FUSED_PAD, self.speculator.k
        for j, i in enumerate(rows):
            got, block = drafts[i].tolist(), want[j].tokens.tolist()
            assert got == block + [pad] * (k - len(block)), \
                f"{keys[j]} at {len(histories[j])} tokens: block {got} differs from the reference's {block}"
            self.rows += 1
            self.resumed_rows += keys[j] in resumed
        for i in set(range(len(batch.req_ids))) - set(rows):
            assert drafts[i].tolist() == [pad] * k, f"{batch.req_ids[i]} proposes without sampling"


def check_prompt_notes(reader: PromptReader, runner: CpuRunner) -> None:
    """The drafter's prompt notes hold live requests only, each for the slot vLLM gave it."""
    slots = runner.req_states.req_id_to_index
    stray = {r for r in reader.read_upto if r not in slots}
    stray |= {r for s, r in reader.owner.items() if slots.get(r) != s}
    stray |= {r for s, (r, _, _) in reader.unread.items() if slots.get(r) != s}
    assert not stray, f"the drafter's prompt notes outlive their requests: {sorted(stray)}"


FUSED_EVERY_STEP = "gpu-fused:k=4,draft_block=2,nmax=16,policy=earliest,entry_steps=1"
FUSED_SERVED = ("gpu-fused:k=4,draft_block=1,nmax=16,policy=earliest,schedule=long,nmin_tail=1,device_skip=true,"
                "batch_k=3:4/0")


def fused_speculator(spec: str, scheduler: Any, slots: int = SLOTS) -> GpuFusedSpeculator:
    """`spec`'s fused speculator over the tiny drafter in float32, its width table the scheduler's (the drafter's
    vocabulary differs from the 0.5B's, so it is built without the config that would refuse it)."""
    config = fused_config(spec)
    speculator = GpuFusedSpeculator.standalone(config, max_num_reqs=slots, max_model_len=LEN, pad=FUSED_PAD,
                                               device="cpu", dtype=torch.float32)
    assert speculator.k_table == speculator_table(scheduler.vllm_config, config)
    speculator.attach_drafter(tiny_drafter(slots, speculator.cache_len))
    return speculator


def fused_run(spec: str, plans: list[Planned], *, prefix_caching: bool, budget: int,
              num_blocks: int = 12) -> tuple[Any, CpuRunner, FusedCheck, Served]:
    """Serve `plans` through vLLM's scheduler with `spec`'s fused speculator (the lookup kernel in Triton's
    interpreter) checked at every step."""
    scheduler = scheduler_for(spec, num_blocks=num_blocks, prefix_caching=prefix_caching, budget=budget)
    speculator = fused_speculator(spec, scheduler)
    check = FusedCheck(speculator)
    runner = CpuRunner(speculator, targets_of(plans), check)
    return scheduler, runner, check, serve(scheduler, runner, plans)


# wide steps dear: priced so, the controller gives these requests each of the widths 0, 2 and 4 (the knob's JSON form)
STEEP = StepCosts((1, 4), (0, 2, 4), ((3.0, 4.2, 5.6), (3.3, 5.2, 7.2)), source="a test's: wide steps dear")
FUSED_GOODPUT = ("gpu-fused:k=4,draft_block=1,nmax=16,policy=earliest,schedule=long,nmin_tail=1,device_skip=true,"
                 "batch_k=2:4/3:2/0,goodput={costs}")
FUSED_CASES = {"every-step-chunked-prompts": (FUSED_EVERY_STEP, False, 16, 12),  # spec, prefix caching, tokens a
               "served-shape-prefix-cache": (FUSED_SERVED, True, 24, 10),  # step, KV blocks (shared prompts use fewer)
               "served-shape-goodput": (FUSED_GOODPUT, True, 24, 10)}


def check_widths_followed(runner: CpuRunner, check: FusedCheck) -> list[int]:
    """The plugin handed the speculator, at every step, the width vLLM's scheduler fixed for the step after it: that
    step's decoding requests verified at most that width (fewer only where a request nears its end), and the
    speculator drafted exactly where it is not 0. Returns the widths, step by step."""
    widths = [w for w, _ in check.widths]
    assert None not in widths, "a step ran without the scheduler's width"
    assert [drafted for _, drafted in check.widths] == [w > 0 for w in widths], \
        "the speculator drafted where the next step verifies nothing, or skipped where it verifies drafts"
    assert all(max(after, default=0) <= w for w, after in zip(widths, runner.verified[1:]))
    exact = {w for w, after in zip(widths, runner.verified[1:]) if after == {w}}
    assert exact == set(widths) - {0}, f"widths {sorted(set(widths))}, verified exactly: {sorted(exact)}"
    return widths


def fused_case(name: str) -> None:
    """The fused blocks are the reference's at every step (the drafter's cache rebuilt from a preempted request's
    prefill again, a reused slot's cache overwritten, children of n = 4 reading the whole prompt though vLLM's prefix
    cache computed it once), and the prompt reader forgets every request vLLM frees. With goodput: the controller's
    widths, 0 included, reach the speculator step by step, and it drafts where they are not 0."""
    spec, prefix_caching, budget, blocks = FUSED_CASES[name]
    plans = mixed_plans(24, 60, stop=7, prompt=(10, 60), out=(4, 24))
    with tempfile.TemporaryDirectory() as folder:
        spec = spec.format(costs=STEEP.to_json(Path(folder) / "steep.json"))
        scheduler, runner, check, served = fused_run(spec, plans, prefix_caching=prefix_caching, budget=budget,
                                                     num_blocks=blocks)
    check_streams(plans, served)
    check_cases_met(plans, served, runner)
    assert check.rows > 50 and check.resumed_rows > 0
    widths = check_widths_followed(runner, check)
    if "goodput" in spec:
        hook = plugin._gate(scheduler)
        assert isinstance(hook, SchedulerGoodput) and hook.widths == (0, 2, 4)
        assert set(widths) == {0, 2, 4}, f"the controller fixed only the widths {sorted(set(widths))}"
    flush(scheduler, runner)
    reader = check.speculator.prompts
    assert (reader.owner, reader.read_upto, reader.unread) == ({}, {}, {})


@INTERPRETED
@pytest.mark.parametrize("name", FUSED_CASES)
def test_the_fused_speculator_drafts_the_reference_through_aborts_preemption_and_reused_slots(name):
    fused_case(name)


FLIPS = (15, 0, 7, 15)  # the widths forced on successive steps, over and over
# batch_k's table gives three requests width 0: a speculator that forecast the width from the batch size would
# never draft here
FUSED_FLIPS = ("gpu-fused:k=15,draft_block=1,nmax=16,policy=earliest,schedule=long,nmin_tail=1,device_skip=true,"
               "batch_k=1:15/2:7/0")


def flipping_plans() -> list[Planned]:
    """Three requests that run side by side to the end: one copies a passage of its prompt (long blocks, the lookup
    decides), two continue the text (the drafter's head decides)."""
    text, plans = text_tokens(60), []
    for i, start in enumerate((100, 900, 1700)):
        prompt = text[start:start + 40].tolist()
        target = (prompt[10:] * 4)[:90] if i == 0 else text[start + 40:start + 130].tolist()
        plans.append(Planned(f"f{i}", prompt, [target], 60))
    # and one arriving on each step of a flip cycle: one of them is admitted by a step at width 0, its prompt read
    # by the drafter only at the next step that drafts
    for i, start in enumerate((2500, 3300, 4100, 4900)):
        plans.append(Planned(f"late{i}", text[start:start + 30].tolist(), [text[start + 30:start + 60].tolist()],
                             12, arrive=40 + 13 * i))
    return plans


@INTERPRETED
def test_the_fused_speculator_follows_widths_that_flip_at_one_batch_size():
    """vLLM's scheduler verifies 15, 0, 7, 15, ... on successive steps while three requests run (the widths the
    goodput controller may choose, forced here in vLLM's own width table, as the controller's hook sets it): the
    speculator drafts exactly at the steps whose next step verifies drafts, its blocks are the reference's there
    (the drafter caught up with what it missed at width 0, prompts included), each step that needed the drafter
    leaves it at every sampling row's full history, and the prompt notes track vLLM's requests throughout."""
    plans = flipping_plans()
    scheduler = scheduler_for(FUSED_FLIPS, num_blocks=64, prefix_caching=False, budget=256)
    speculator = fused_speculator(FUSED_FLIPS, scheduler)
    check = FusedCheck(speculator)
    table, script, schedule = scheduler.dynamic_sd_lookup, itertools.cycle(FLIPS), scheduler.schedule
    assert table[3] == 0

    def scripted() -> Any:
        table[:] = [next(script)] * len(table)  # the width of the step after this one, at every batch size
        return schedule()

    caught_up, after_plain, batches, deferred = [], [], [], []

    def on_step(runner: CpuRunner, batch: Any, num_sampled: torch.Tensor, drafts: torch.Tensor) -> None:
        drafted_before = check.drafting
        check(runner, batch, num_sampled, drafts)
        batches.append(len(batch.req_ids))
        if check.drafting == drafted_before:  # prompts vLLM prefilled at width 0 wait in the notes
            deferred.extend(r for s, (r, _, _) in speculator.prompts.unread.items() if r.startswith("late"))
        if check.drafting == drafted_before or not int(speculator.flags.need):
            return
        slots = [int(batch.idx_mapping_np[i]) for i in range(len(batch.req_ids)) if int(num_sampled[i]) > 0]
        caught_up.append(all(int(speculator.dlen[s]) == int(runner.req_states.total_len.gpu[s]) for s in slots))
        after_plain.append(len(check.widths) > 1 and check.widths[-2][0] == 0 and len(batch.req_ids) == 3)

    scheduler.schedule = scripted
    runner = CpuRunner(speculator, targets_of(plans), on_step, k=15)
    served = serve(scheduler, runner, plans)
    check_streams(plans, served)
    widths = check_widths_followed(runner, check)
    assert all(caught_up) and sum(after_plain) >= 3, (caught_up, after_plain)
    assert deferred, "no prompt was prefilled by vLLM at a step whose next verifies nothing"
    # the flips met at one batch size: 15 -> 0 -> 7 -> 15, the drafts verified at each width
    at_three = {(widths[n], widths[n + 1]) for n in range(len(widths) - 1) if batches[n] == batches[n + 1] == 3}
    assert {(15, 0), (0, 7), (7, 15)} <= at_three
    assert check.rows > 20 and speculator.off_steps >= 5
    flush(scheduler, runner)
    assert (speculator.prompts.owner, speculator.prompts.read_upto, speculator.prompts.unread) == ({}, {}, {})


# --- each check fails on a planted state bug ----------------------------------------------------------------------


def plant_stale_slot_map(monkeypatch: Any) -> None:
    """The lookup copies the batch's slots to the device only when the batch's size changes: after a request
    finishes and another takes its place (or the batch reorders), it drafts from another request's row."""

    def lookup(self: Any, rows: torch.Tensor, n: int) -> torch.Tensor:
        if self.__dict__.get("_copied_for") != n:
            self.rows[:n].copy_(rows)
            self._copied_for = n
        self._draft(n)
        return self.draft_tokens[:n]

    monkeypatch.setattr(GpuLookupSpeculator, "lookup", lookup)


def plant_unrewound_history(monkeypatch: Any) -> None:
    """The lookup keeps each slot's longest history length: a slot vLLM gives to a shorter request is read past that
    request's end, into its previous request's tokens."""
    draft = GpuLookupSpeculator._draft

    def draft_longest(self: Any, m: int) -> None:
        real = self.state.total_len
        longest = self.__dict__.setdefault("_longest", real.clone())
        torch.maximum(longest, real, out=longest)
        self.state.total_len = longest
        try:
            draft(self, m)
        finally:
            self.state.total_len = real

    monkeypatch.setattr(GpuLookupSpeculator, "_draft", draft_longest)


def plant_preemption_as_free(monkeypatch: Any) -> None:
    """The scheduler notes a preempted request as freed: its partial output enters the corpus, and again when it
    ends."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempt = Scheduler._preempt_request

    def preempt_noting(self: Any, request: Any, timestamp: float) -> None:
        plugin._note_freed(self, request)
        preempt(self, request, timestamp)

    monkeypatch.setattr(Scheduler, "_preempt_request", preempt_noting)


def plant_admitted_kept(monkeypatch: Any) -> None:
    """The corpus forgets no admitted request: its admitted set grows with every request served."""
    corpus_step = GpuLookupSpeculator.corpus_step

    def corpus_step_keeping(self: Any, finished: Any, admitted: Any) -> None:
        corpus_step(self, finished, admitted)
        self.corpus_seen.update(rid for rid, _, _ in finished)

    monkeypatch.setattr(GpuLookupSpeculator, "corpus_step", corpus_step_keeping)


def plant_gate_kept_on_abort(monkeypatch: Any) -> None:
    """The gate forgets requests that finish but not those a client aborts (vLLM's `finish_requests`)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    finish = Scheduler.finish_requests

    def finish_keeping_gates(self: Any, *args: Any, **kwargs: Any) -> Any:
        forget = SchedulerGate.forget
        SchedulerGate.forget = lambda gate, request_id: None
        try:
            return finish(self, *args, **kwargs)
        finally:
            SchedulerGate.forget = forget

    monkeypatch.setattr(Scheduler, "finish_requests", finish_keeping_gates)


def plant_goodput_kept(monkeypatch: Any) -> None:
    """The goodput controller never forgets a request's features."""
    monkeypatch.setattr(SchedulerGoodput, "forget", lambda self, request_id: None)


def plant_unrewound_drafter_cache(monkeypatch: Any) -> None:
    """Reading a prompt never lowers the slot's drafter length (`dlen`): a slot vLLM gives to a shorter request, or
    to a preempted one prefilled again, keeps the previous request's length, and the drafter's next pass reads
    nothing of the new history."""
    read = PromptReader.read

    def read_keeping_length(self: Any, req_id: str, slot: int, end: int, *, done: bool) -> None:
        before = int(self.dlen[slot])
        read(self, req_id, slot, end, done=done)
        self.dlen[slot] = max(before, end)

    monkeypatch.setattr(PromptReader, "read", read_keeping_length)


def plant_schedule_state_kept(monkeypatch: Any) -> None:
    """The fused step never marks a request's first step: a new request inherits its slot's scheduler state."""
    copy_batch = GpuFusedSpeculator._copy_batch

    def copy_batch_never_fresh(self: Any, n: int, slots: Any, slots_np: Any, num_sampled: Any, fresh: Any) -> None:
        copy_batch(self, n, slots, slots_np, num_sampled, np.zeros_like(fresh))

    monkeypatch.setattr(GpuFusedSpeculator, "_copy_batch", copy_batch_never_fresh)


def plant_corpus_log_kept(monkeypatch: Any) -> None:
    """The corpus logs every insertion whether or not anyone takes the log (the code before the log went with the
    step records): in a server it grows by one entry a request."""
    corpus_step = GpuLookupSpeculator.corpus_step

    def corpus_step_logging(self: Any, finished: Any, admitted: Any) -> None:
        recorder, self.recorder = self.recorder, self.recorder or "a reader of the log"
        try:
            corpus_step(self, finished, admitted)
        finally:
            self.recorder = recorder

    monkeypatch.setattr(GpuLookupSpeculator, "corpus_step", corpus_step_logging)


def plant_notes_kept(monkeypatch: Any) -> None:
    """The prompt reader is never told which slots vLLM frees (the code before `release`)."""
    monkeypatch.setattr(PromptReader, "release", lambda self, freed: None)


def plant_width_by_batch_size(monkeypatch: Any) -> None:
    """The speculator forecasts the next step's width from its batch size (`batch_k`'s table), as before goodput:
    with widths chosen per step it drafts where nothing is verified and verifies stale drafts."""
    from hqlab.engines.vllm import batch_k
    from hqlab.engines.vllm.speculator import V2Speculator

    monkeypatch.setattr(V2Speculator, "next_width", lambda self, n: batch_k.next_k(self.k_table, n, self.k))


def plant_missed_tokens_dropped(monkeypatch: Any) -> None:
    """At a step that verifies nothing the drafter is marked as having read every sampling row's history: it never
    reads the tokens it missed."""
    step = GpuFusedSpeculator.step

    def skip_missed(self: Any, req_ids: list[str], slots: torch.Tensor, slots_np: np.ndarray, *args: Any) -> Any:
        if self.next_width(len(req_ids)) == 0 and self.state is not None:
            self.dlen[torch.as_tensor(slots_np, dtype=torch.int64)] = self.state[1][slots.long()].long()
        return step(self, req_ids, slots, slots_np, *args)

    monkeypatch.setattr(GpuFusedSpeculator, "step", skip_missed)


PLANTED = {  # the bug -> (how to plant it, the case that must catch it, what its failure says)
    "width-by-batch-size": (plant_width_by_batch_size,
                            test_the_fused_speculator_follows_widths_that_flip_at_one_batch_size, "skipped where"),
    "missed-tokens-dropped": (plant_missed_tokens_dropped,
                              test_the_fused_speculator_follows_widths_that_flip_at_one_batch_size,
                              "differs from the reference"),
    "stale-slot-map": (plant_stale_slot_map, lambda: lookup_case("lookup"), "differ from the rule"),
    "unrewound-history": (plant_unrewound_history, lambda: lookup_case("lookup"), "differ from the rule"),
    # the corpus then holds a document no client received: the drafts or the insertions show it, whichever first
    "preemption-as-free": (plant_preemption_as_free, corpus_case, "differ from the rule|not vLLM's frees"),
    "corpus-admitted-kept": (plant_admitted_kept, corpus_case, "keeps admitted requests"),
    "gate-kept-on-abort": (plant_gate_kept_on_abort, lambda: lookup_case("gate"), "requests vLLM freed"),
    "goodput-kept": (plant_goodput_kept, lambda: lookup_case("goodput"), "requests vLLM freed"),
    "unrewound-drafter-cache": (plant_unrewound_drafter_cache, lambda: fused_case("every-step-chunked-prompts"),
                                "differs from the reference"),
    "schedule-state-kept": (plant_schedule_state_kept, lambda: fused_case("every-step-chunked-prompts"),
                            "differs from the reference"),
    "prompt-notes-kept": (plant_notes_kept, lambda: fused_case("served-shape-prefix-cache"),
                          "outlive their requests"),
    "corpus-log-kept": (plant_corpus_log_kept, lambda: bounded_case("lookup-corpus-gate"),
                        "state the run left behind.*corpus log"),
    "prompt-notes-kept-under-load": (plant_notes_kept, lambda: bounded_case("fused"), "outlive their requests"),
    "goodput-kept-under-load": (plant_goodput_kept, lambda: bounded_case("lookup-goodput"), "requests vLLM freed"),
}


@INTERPRETED
@pytest.mark.parametrize("bug", PLANTED)
def test_each_check_fails_on_a_planted_state_bug(bug, monkeypatch):
    plant, case, failure = PLANTED[bug]
    plant(monkeypatch)
    with pytest.raises(AssertionError, match=failure):
        case()


# --- bounded state ------------------------------------------------------------------------------------------------


def many_short_plans(count: int, vocab: int, seed: int = 3) -> list[Planned]:
    """`count` short requests (prompts of 6 to 24 tokens, 1 to 10 new ones) in bursts of 16 every 40 iterations (the
    load swings from 8 running and more waiting, where vLLM preempts, to one request); a quarter of their clients
    disconnect at a random point, one in twenty before its request is scheduled; one in ten asks for n = 4, one in
    eight repeats an earlier request."""
    rng, text, plans = np.random.default_rng(seed), text_tokens(vocab), []
    for i in range(count):
        start, p_len, max_tokens = int(rng.integers(0, len(text) - 400)), int(rng.integers(6, 25)), \
            int(rng.integers(1, 11))
        span = max_tokens + 3 * (K + 1)
        prompt, n = text[start:start + p_len].tolist(), 4 if rng.random() < 0.1 else 1
        targets = [text[start + p_len + 40 * j:start + p_len + 40 * j + span].tolist() for j in range(n)]
        if plans and rng.random() < 0.125:
            earlier = plans[int(rng.integers(0, len(plans)))]
            prompt, targets = earlier.prompt, [(earlier.targets[0] * span)[:span]]
        u = rng.random()
        abort = ("tokens", int(rng.integers(1, max_tokens + 1))) if u < 0.25 else ("queued", 0) if u < 0.3 else None
        plans.append(Planned(f"s{i}", prompt, targets, max_tokens, arrive=40 * (i // 16), abort=abort))
    return plans


def host_state(scheduler: Any, runner: CpuRunner, speculator: Any) -> dict[str, int]:
    """The sizes of every per-request record on the host: vLLM's own (its scheduler's requests, its runner's held
    slots and free-slot list), the plugin's (documents on their way to the worker, the gate's or goodput's
    dictionaries), the speculator's (the corpus's admitted set and log, the drafter's prompt notes)."""
    sizes = {"vLLM scheduler requests": len(scheduler.requests),
             "vLLM runner slots held": len(runner.req_states.req_id_to_index),
             "vLLM runner free slots": len(runner.req_states.free_indices),
             "freed documents on their way": len(scheduler.__dict__.get("_hqlab_freed", ()))}
    if plugin._gate(scheduler) is not None:
        sizes.update(hook_state(scheduler))
    if getattr(speculator, "corpus", None) is not None:
        sizes.update({"corpus admitted": len(speculator.corpus_seen), "corpus log": len(speculator.corpus_log)})
    if isinstance(speculator, GpuFusedSpeculator):
        reader = speculator.prompts
        sizes.update({"prompt owners": len(reader.owner), "prompts part-read": len(reader.read_upto),
                      "prompt chunks unread": len(reader.unread)})
    return sizes


def device_bytes(speculator: Any) -> dict[str, int]:
    """Bytes of every tensor the speculator holds (its own and its parts', each storage once): its slot tables, step
    buffers, the corpus ring, the drafter's cache."""
    seen, sizes = set(), {}
    parts = [("", speculator)] + [(f"{name}.", part) for name, part in vars(speculator).items()
                                  if hasattr(part, "__dict__") and not isinstance(part, (torch.Tensor, type))]
    for prefix, owner in parts:
        for name, value in vars(owner).items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                sizes[prefix + name] = value.untyped_storage().nbytes()
    return sizes


BOUNDED = {"lookup-corpus-gate": (f"{LOOKUP},batch_k=2:4/0,corpus=400,corpus_docs=8,gate=1", VOCAB),
           "lookup-goodput": (f"{LOOKUP},batch_k=2:4/3:2/0,goodput=default", VOCAB),
           "fused": (FUSED_SERVED, 60)}


def bounded_case(name: str) -> None:
    """240 short requests through 8 slots and a KV cache that preempts, with random aborts: every host record is
    back at its size before the run once the last freed request has left (one more step, as the next request's),
    no device tensor grew, the corpus stayed within its bounds, and per-request state never outlived its request
    during the run."""
    spec, vocab = BOUNDED[name]
    slots, plans = 8, many_short_plans(240, vocab)
    scheduler = scheduler_for(spec, num_blocks=10, prefix_caching=True, budget=64, slots=slots)
    speculator = fused_speculator(spec, scheduler, slots) if name == "fused" else \
        GpuLookupSpeculator(scheduler.vllm_config, "cpu")
    notes = (lambda runner, *_: check_prompt_notes(speculator.prompts, runner)) if name == "fused" else None
    runner = CpuRunner(speculator, targets_of(plans), notes, slots=slots)
    before = host_state(scheduler, runner, speculator), device_bytes(speculator)
    hooks = HookCheck() if plugin._gate(scheduler) is not None else None
    served = serve(scheduler, runner, plans, after_update=hooks)
    flush(scheduler, runner)
    after = host_state(scheduler, runner, speculator), device_bytes(speculator)
    grown = {k: (v, after[i][k]) for i, part in enumerate(before) for k, v in part.items() if after[i].get(k) != v}
    assert after == before, f"state the run left behind (before, after): {grown}"
    check_streams(plans, served)
    aborted = sum(why == "abort" for why in served.finished.values())
    assert len(served.finished) > 300 and aborted > 60 and len(served.preempted) > 10, \
        (len(served.finished), aborted, len(served.preempted))
    if getattr(speculator, "corpus", None) is not None:
        assert speculator.corpus.inserted > 150 and len(speculator.corpus.docs) <= 8 and speculator.corpus.live <= 400


@INTERPRETED
@pytest.mark.parametrize("name", BOUNDED)
def test_hundreds_of_short_requests_leave_host_and_device_state_as_they_found_it(name):
    bounded_case(name)

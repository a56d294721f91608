"""HyperQwen's fused drafter inside vLLM's own GPU step: the lookup and a same-tokenizer draft model, fused per position
(SPEC §2.4) and verified in blocks whose length the adaptive scheduler picks per request (SPEC §2.5).

It runs where `gpu_lookup.GpuLookupSpeculator` runs (vLLM 0.26's model runner V2, asynchronous scheduling, after
sampling, on GPU tensors) and is installed the same way; its settings are `gpu_fused_config.GpuFusedConfig`. `step`
is one drafting step for the batch:

1. prefill: prompt chunks vLLM prefilled are fed to the drafter (`drafter_prompts`; host-known bounds);
2. lookup: the suffix-match kernel proposes up to k tokens per request from vLLM's histories on the device;
3. drafter if needed: unless the lookup decides every sampling row's block (`device_skip`), the drafter reads the
   tokens each request emitted since it last ran and yields its head (`drafter_flags`: decided on the device);
4. fuse: `fused_step.FusedStep` fuses both, advances each request's scheduler state and clips each block to its
   length, the pad token after it (the target rejects it, so a short block verifies exactly that);
5. record: the blocks and decisions stay on the GPU until `take_records` (`fused_records`).

Steps 2-5 have static shapes and read nothing back: they replay from one CUDA graph per (batch size, attention
bucket), the drafter behind conditional nodes (`conditional`), so a step without it meets one IF node. A step whose
drafts the next verifies none of (width 0, by `batch_k` or `goodput`: `next_width`) runs none of this, prefill
included: the drafter reads what it missed at the next step that drafts, as after steps the lookup decided.

The drafter (`drafter.StaticQwen2`) keeps its own KV cache, one row per request slot, outside vLLM's paged cache (V2
has no plain draft-model path; docs/vllm-internals.md): layers x slots x (max_model_len + 8 (k + 1) + draft_block)
positions, allocated when vLLM loads the target.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import torch

from hqlab.config import ConfigError
from hqlab.engines.vllm import drafter_flags
from hqlab.engines.vllm.draft_sampling import DraftDistributions
from hqlab.engines.vllm.drafter_flags import WIDE_STEPS, DrafterFlags
from hqlab.engines.vllm.drafter_prompts import PromptReader
from hqlab.engines.vllm.fused_records import FusedRecorder, record_meta
from hqlab.engines.vllm.goodput import speculator_table, standalone_table
from hqlab.engines.vllm.gpu_fused_config import (CLASS_PATH, NAME, PREFILL_CHUNK, RETIRED, GpuFusedConfig,
                                                 fused_config, is_gpu_fused, recorded_rules, speculative_config)
from hqlab.engines.vllm.speculator import (RECORD_KEY, SPEC_KEY, V2Speculator, bind_histories, gpu_spec, pad_token,
                                           recording)

GRAPH_MAX_BATCH = 16  # batch sizes above this draft eagerly
RECORD_CAPACITY = 4096


def attention_buckets(max_len: int, smallest: int = 512) -> list[int]:
    """Attention lengths with a captured graph: powers of two from `smallest`, then max_len itself."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


class GpuFusedSpeculator(V2Speculator):
    """vLLM V2 speculator: the lookup and a draft model fused per position, block length per request.

    Same contract with vLLM's runner as `GpuLookupSpeculator`: `propose(...)` returns [num_reqs, k] int64 drafts on
    the device; `draft_logits` is None unless draft_sample=probabilistic; `init_cudagraph_manager` and `capture` are
    called by the runner; the plugin calls `bind` and `load_drafter` when vLLM loads the target.
    """

    def __init__(self, vllm_config: Any, device: torch.device | str | None = None) -> None:
        self.spec, self.config = gpu_spec(vllm_config, device, CLASS_PATH, fused_config)
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        dtype = getattr(vllm_config.model_config, "dtype", torch.bfloat16)
        self._setup(max_num_reqs=int(vllm_config.scheduler_config.max_num_seqs),
                    max_model_len=int(vllm_config.model_config.max_model_len), pad=pad_token(vllm_config),
                    device=device, dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16,
                    record=recording(vllm_config))
        self.k_table = speculator_table(vllm_config, self.config)

    @classmethod
    def standalone(cls, config: GpuFusedConfig, *, max_num_reqs: int, max_model_len: int, pad: int,
                   device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                   record: bool = False) -> "GpuFusedSpeculator":
        """The same speculator without a vLLM config (tests drive `bind`, `attach_drafter` and `step` directly)."""
        self = cls.__new__(cls)
        self.spec, self.config, self.vocab = f"{NAME}:...", config, None
        self._setup(max_num_reqs=max_num_reqs, max_model_len=max_model_len, pad=pad, device=device, dtype=dtype,
                    record=record)
        self.k_table = standalone_table(config, max_num_reqs)
        return self

    def _setup(self, *, max_num_reqs: int, max_model_len: int, pad: int, device: torch.device | str,
               dtype: torch.dtype, record: bool) -> None:
        from hqlab_kernels.suffix_match import SuffixMatcher

        from hqlab.engines.vllm.fused_step import FusedStep

        c, dev = self.config, torch.device(device)
        self.k, self.block, self.device, self.dtype, self.pad = c.k, c.draft_block, dev, dtype, pad
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.narrow_width = c.k + 1  # a step emits at most k + 1 tokens: what the drafter reads after a step it ran
        self.wide_width = self.narrow_width * WIDE_STEPS  # what one pass reads after steps without the drafter
        # a pass writes up to wide_width - 1 positions past a history, and the head's further passes block - 1 more
        self.cache_len = max_model_len + self.wide_width + self.block
        lk = c.lookup_config()
        self.matcher = SuffixMatcher(max_num_reqs, c.k, nmin=lk.nmin, nmax=lk.nmax, search=lk.search, full=lk.full,
                                     policy=lk.policy, max_len=max_model_len, device=dev)
        self.step_rule = FusedStep(c, max_num_reqs=max_num_reqs, pad_token=pad, device=dev, compile=c.compile_rule)
        self._setup_buffers(max_num_reqs, dev)
        self.prompts = PromptReader(chunk=c.prefill_chunk, graph_bound=c.prefill_graph, cache_len=self.cache_len,
                                    dlen=self.dlen, index=self.index)
        self.flags = DrafterFlags(dev)
        # the flags' arithmetic and the record's columns are a dozen tiny kernels a step; with compile_rule a few
        rules = (drafter_flags.at_start, drafter_flags.after_loop_pass, drafter_flags.before_last_pass, record_meta)
        self._at_start, self._after_loop_pass, self._before_last_pass, self._record_meta = (
            torch.compile(f, dynamic=None) if c.compile_rule else f for f in rules)
        self.draws = DraftDistributions(max_num_reqs, c.k, dev, compile=c.compile_rule) \
            if c.draft_sample == "probabilistic" else None
        self.recorder = FusedRecorder(RECORD_CAPACITY, max_num_reqs, c.k, dev, self.block) if record else None
        self.drafter: Any = None
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None  # vLLM's (all_token_ids, total_len)
        self.row_offsets: torch.Tensor | None = None
        self.buckets = attention_buckets(self.cache_len)
        self.use_graphs, self.graphs = False, {}  # (batch size, attention bucket) -> the drafting step's graph
        self.nested_nodes = True  # the drafter's nodes inside one IF node (side by side where a driver refuses)
        self._body_pool: Any = None  # the conditional bodies' memory pool (made at capture)
        self._warming = False  # a warm-up runs every conditional body once, as the capture records them
        self.drafting_steps = self.off_steps = 0  # plain counters: steps drafted, steps at width 0
        self.draft_logits: torch.Tensor | None = None  # what vLLM's V2 runner reads, with the next two
        self.supports_mm_inputs = False
        self.model = torch.nn.Module()

    def _setup_buffers(self, max_num_reqs: int, dev: torch.device) -> None:
        """The step's device buffers (rows in batch order unless said) and what the host knows they hold."""
        self.slots = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)
        self.num_sampled = torch.zeros(max_num_reqs, dtype=torch.int32, device=dev)
        self.fresh = torch.zeros(max_num_reqs, dtype=torch.bool, device=dev)  # the request's first step
        # pinned host buffers for `fresh`, a ring: the host prepares up to three steps ahead, so a buffer must not be
        # rewritten before its copy ran
        self._fresh_host = [torch.zeros(max_num_reqs, dtype=torch.bool, pin_memory=dev.type == "cuda")
                            for _ in range(4)]
        self._fresh_ring_index = 0
        # what the host knows the device buffers hold, so that a decode step whose batch did not change launches no
        # copy for them (each CUDA call is host time on the step's critical path): the slots last copied (None:
        # unknown), and how many leading rows of `fresh` are known False
        self._slots_host: np.ndarray | None = None
        self._fresh_known_false = max_num_reqs
        self.dlen = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)  # drafter positions written, per slot
        self.drafts = torch.zeros(max_num_reqs, self.block, dtype=torch.int64, device=dev)
        self.out = torch.full((max_num_reqs, self.k), self.pad, dtype=torch.int64, device=dev)
        self.wide_positions = torch.arange(self.wide_width, dtype=torch.int64, device=dev)
        self.zeros = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)
        # slot and position indices as device views: a tensor built from a host list would wait for the GPU's queue
        self.index = torch.arange(max(max_num_reqs, self.max_model_len), dtype=torch.int64, device=dev)

    def bind(self, all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
        """Attach vLLM's histories ([slots, max_model_len] int32) and their lengths ([slots] int32)."""
        state, self.row_offsets = bind_histories(all_token_ids, total_len, self.max_num_reqs, self.device)
        self.state = (state.all_token_ids, state.total_len)
        self.prompts.all_token_ids = state.all_token_ids

    def load_drafter(self, folder: str | None = None) -> None:
        """Load the draft model (default: the config's `model`, through hqlab's model cache), its drafting passes in
        Triton kernels."""
        from hqlab import models
        from hqlab.engines.vllm.drafter import StaticQwen2

        folder = folder or models.prepare(self.config.model)
        self.attach_drafter(StaticQwen2.load(folder, slots=self.max_num_reqs, max_len=self.cache_len,
                                             device=self.device, dtype=self.dtype, compile=self.config.compile,
                                             layers="triton", attention="triton"))

    def attach_drafter(self, drafter: Any) -> None:
        """Draft with `drafter`, a `StaticQwen2` of max_num_reqs slots and cache_len positions (`load_drafter`'s, or
        in the tests one on the torch reference paths)."""
        if self.vocab is not None and drafter.vocab != self.vocab:
            raise ConfigError(f"{NAME}: the drafter {self.config.model!r} has a vocabulary of {drafter.vocab} rows and "
                              f"the target {self.vocab}; the drafter must share the target's tokenizer")
        self.drafter = self.prompts.drafter = drafter
        if self.draws is not None:
            self.draft_logits = self.draws.allocate(drafter.vocab)
        # FlashAttention and the Triton attention read each row only up to its own length, whatever the bound: one
        # graph per batch size. The masked path attends over the whole bound, so it keeps a ladder of lengths.
        whole = drafter.flash is not None or drafter.attention_kernel is not None
        self.buckets = [self.cache_len] if whole else attention_buckets(self.cache_len)

    def bind_sampling(self, temperature: torch.Tensor) -> None:
        """Attach vLLM's per-slot temperatures ([max_num_reqs] float32, 0 = greedy) for draft_sample=probabilistic."""
        if self.draws is not None:
            self.draws.temperature = temperature

    @property
    def ready(self) -> bool:
        awaiting_temperatures = self.draws is not None and self.draws.temperature is None
        return self.state is not None and self.drafter is not None and not awaiting_temperatures

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        self.use_graphs = getattr(cudagraph_mode, "name", "NONE") != "NONE"

    def capture(self) -> None:
        """One CUDA graph per (batch size, attention bucket) for the drafting step, and one for the prompt pass
        (`prefill_graph`); a part whose capture fails runs eagerly, with a warning."""
        if not (self.use_graphs and self.ready and self.device.type == "cuda"):
            return
        for nested in (True, False) if self.nested_nodes else (False,):
            self.nested_nodes = nested
            try:
                self._capture_steps()
                break
            except RuntimeError as e:  # a driver without nested conditional nodes: then the nodes side by side
                self.graphs.clear()
                what, then = ("the drafter's nodes inside one IF node", "capturing them side by side") if nested \
                    else ("the drafting step", "it runs eagerly")
                warnings.warn(f"{NAME}: capturing {what} failed ({e}); {then}", RuntimeWarning, stacklevel=2)
        if self.config.prefill_graph:
            self.prompts.capture(self.device)
        self._slots_host, self._fresh_known_false = None, self.max_num_reqs  # capturing wrote `slots`, `fresh`
        if self.recorder is not None:
            self.recorder.restart()

    def _capture_steps(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        self._body_pool = torch.cuda.graph_pool_handle()  # the bodies' memory, alive as long as the graphs
        current = torch.cuda.current_stream(self.device)
        for m in range(1, min(self.max_num_reqs, GRAPH_MAX_BATCH) + 1):
            self.slots[:m] = torch.arange(m, device=self.device)
            self.num_sampled.zero_()  # inactive rows: no state changes while capturing
            self.fresh.zero_()
            for bucket in self.buckets:
                stream = torch.cuda.Stream(self.device)  # the warm-up, every conditional body run once
                stream.wait_stream(current)
                self._warming = True
                try:
                    with torch.cuda.stream(stream):
                        self._drafting_step(m, bucket)
                finally:
                    self._warming = False
                current.wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # a conditional body is captured on a side stream while this capture is open, which "global" forbids
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._drafting_step(m, bucket)
                self.graphs[(m, bucket)] = graph

    def draft(self, input_batch: Any, num_sampled: Any, dummy_run: bool) -> torch.Tensor:
        n = int(input_batch.num_reqs)
        if dummy_run or not self.ready or num_sampled is None:
            return self.out[:n]
        b = input_batch
        return self.step(b.req_ids[:n], b.idx_mapping[:n], b.idx_mapping_np[:n], num_sampled[:n],
                         b.is_prefilling_np[:n], b.num_computed_prefill_tokens_np[:n], b.num_scheduled_tokens[:n],
                         b.prefill_len_np[:n], b.num_computed_tokens_np[:n])

    def step(self, req_ids: list[str], slots: torch.Tensor, slots_np: np.ndarray, num_sampled: torch.Tensor,
             prefilling: np.ndarray, computed_prefill: np.ndarray, scheduled: np.ndarray, prefill_len: np.ndarray,
             computed: np.ndarray) -> torch.Tensor:
        """One drafting step for the batch: the host arrays are vLLM's input-batch mirrors, `slots` and `num_sampled`
        device tensors. Returns [n, k] drafts (a view of a persistent buffer)."""
        assert self.ready, "bind() vLLM's request state and load_drafter() first"
        start = time.perf_counter()
        n = len(req_ids)
        self.prompts.note(req_ids, slots_np, prefilling, computed_prefill + scheduled, prefill_len)
        if self.next_width(n) == 0:  # the next step verifies nothing: no drafting at all
            self.off_steps += 1
            return self.out[:n]
        first = self.prompts.take(req_ids, slots_np)  # prefill
        self._copy_batch(n, slots, slots_np, num_sampled, first)
        # the longest history this step can reach (vLLM's host mirrors are upper bounds), plus what the passes add
        longest = int(max(prefill_len.max(initial=0), (computed + scheduled).max(initial=0))) + 1
        bucket = next((b for b in self.buckets if b >= longest + self.wide_width + self.block), self.buckets[-1])
        graph = self.graphs.get((n, bucket))
        if graph is not None:
            graph.replay()
        else:
            self._drafting_step(n, bucket)  # lookup -> drafter if needed -> fuse -> record
        self.drafting_steps += 1
        if self.recorder is not None:
            self.recorder.note(list(req_ids), time.perf_counter() - start)
        return self.out[:n]

    def _copy_batch(self, n: int, slots: torch.Tensor, slots_np: np.ndarray, num_sampled: torch.Tensor,
                    fresh: np.ndarray) -> None:
        """The batch's slots, emitted counts and first steps into the step's device buffers, copying the slots and
        the first-step marks only where they differ from what the buffers hold."""
        if self._slots_host is None or not np.array_equal(self._slots_host, slots_np):
            self.slots[:n].copy_(slots)
            self._slots_host = np.array(slots_np, copy=True)
        self.num_sampled[:n].copy_(num_sampled)
        hit = np.flatnonzero(fresh)
        if hit.size or n > self._fresh_known_false:  # else rows [0, n) of `fresh` are False already
            self._fresh_ring_index = (self._fresh_ring_index + 1) % len(self._fresh_host)
            host = self._fresh_host[self._fresh_ring_index]
            host[:n] = torch.from_numpy(fresh)
            self.fresh[:n].copy_(host[:n], non_blocking=True)
            self._fresh_known_false = int(hit[0]) if hit.size else max(n, self._fresh_known_false)

    def _drafting_step(self, m: int, attn_len: int) -> None:
        """Rows [0, m) of the step buffers -> `out[:m]`: lookup -> drafter if needed -> fuse -> record. Static
        shapes, no host reads: the captured graphs' body."""
        assert self.state is not None and self.row_offsets is not None
        all_ids, total_len = self.state
        slots, num_sampled = self.slots[:m], self.num_sampled[:m]
        lengths = torch.where(num_sampled > 0, total_len[slots], 0).to(torch.int32)
        proposals, match_len, valid = self.matcher(all_ids.view(-1), self.row_offsets[slots], lengths)
        self._drafter_if_needed(m, attn_len, match_len, valid)
        lookup = proposals.masked_fill(proposals < 0, self.pad)
        rule = self.step_rule
        self.out[:m] = rule(slots, num_sampled, self.fresh[:m], lookup, valid, match_len, self.drafts[:m])
        if self.draws is not None:
            self.draws.point_masses(slots, num_sampled > 0, rule.sources[:m], self.out[:m], self.block)
        if self.recorder is not None:
            meta = self._record_meta(lengths, match_len, valid, rule.block_len[:m], rule.num_tokens[:m],
                                     rule.take_flag[:m], rule.head_taken[:m], rule.tail_taken[:m],
                                     rule.draft_valid[:m], self.flags.ran_width.expand(m),
                                     self.flags.ran_passes.expand(m))
            self.recorder.write(meta, self.out[:m], rule.sources[:m], self.drafts[:m, :self.block])

    def _drafter_if_needed(self, m: int, attn_len: int, match_len: torch.Tensor, valid: torch.Tensor) -> None:
        """The drafter behind conditional nodes its flags set on the device (`drafter_flags`): nothing where the step
        does not need its token; else a loop of wide passes while a row lags more than one feeds, the narrow or the
        wide last pass, and the head's further passes. One IF node holds it all (`nested_nodes`)."""
        from hqlab.engines.vllm import conditional

        assert self.state is not None
        flags, nodes = self.flags, {"pool": self._body_pool, "always": self._warming}
        lag_of = (self.state[1], self.dlen, self.slots[:m], self.num_sampled[:m])  # what each row's lag is read from
        flags.buffer.copy_(self._at_start(*lag_of, match_len, valid, self.config.nstrong, self.config.device_skip,
                                          self.wide_width))

        def loop_pass() -> None:
            self._read_missed(m, attn_len)
            flags.buffer.copy_(self._after_loop_pass(flags.buffer, *lag_of, self.wide_width))

        def drafter() -> None:
            conditional.run_while(flags.loop, loop_pass, **nodes)
            flags.buffer.copy_(self._before_last_pass(flags.buffer, *lag_of, self.narrow_width, self.wide_width,
                                                      self.block))
            conditional.run_if(flags.narrow, lambda: self._last_pass(m, attn_len, self.narrow_width), **nodes)
            conditional.run_if(flags.wide, lambda: self._last_pass(m, attn_len, self.wide_width), **nodes)
            self._head_passes(m, attn_len)

        if self.nested_nodes:
            conditional.run_if(flags.need, drafter, **nodes)
        else:
            drafter()

    def _missed(self, m: int, width: int, *, keep_last: bool) -> tuple[torch.Tensor, ...]:
        """Per row of [0, m): (slot, the next `width` history tokens from where its drafter stopped, that position,
        how many of them to read: those it missed, at most `width`, all but the last with `keep_last`)."""
        assert self.state is not None
        all_ids, total_len = self.state
        slots, sampled = self.slots[:m], self.num_sampled[:m] > 0
        dlen = self.dlen[slots]
        missed = torch.where(sampled, total_len[slots].long() - dlen, 0)
        count = (missed - 1 if keep_last else missed).clamp(0, width)
        positions = (dlen[:, None] + self.wide_positions[:width]).clamp(max=self.max_model_len - 1)
        return slots, all_ids[slots[:, None], positions].long(), dlen, count

    def _read_missed(self, m: int, attn_len: int) -> None:
        """A pass of the catch-up loop: each lagging row reads all but the last of the tokens it missed (a wide
        pass's worth at most), so that the step's last pass still has one to read; it drafts nothing."""
        slots, tokens, dlen, count = self._missed(m, self.wide_width, keep_last=True)
        self.drafter.extend(slots, tokens, dlen, (count - 1).clamp(min=0), attn_len)
        self.dlen[slots] = dlen + count

    def _last_pass(self, m: int, attn_len: int, width: int) -> None:
        """The step's last catch-up pass, `width` positions: each sampling row reads the rest of what it missed, and
        the drafter gives its first head token (`drafts[:, 0]`)."""
        assert self.state is not None
        slots, tokens, dlen, count = self._missed(m, width, keep_last=False)
        sampled = self.num_sampled[:m] > 0
        self.drafts[:m, 0] = self._head_token(slots, sampled, tokens, dlen, (count - 1).clamp(min=0), attn_len, 0)
        self.dlen[slots] = torch.where(sampled, self.state[1][slots].long(), dlen)

    def _head_passes(self, m: int, attn_len: int) -> None:
        """The head's further tokens (draft_block > 1), one drafter pass each, from the history's end."""
        assert self.state is not None
        slots, sampled = self.slots[:m], self.num_sampled[:m] > 0
        total = self.state[1][slots].long()
        token = self.drafts[:m, 0].contiguous()
        for j in range(1, self.block):
            token = self._head_token(slots, sampled, token[:, None], total + (j - 1), self.zeros[:m], attn_len, j)
            self.drafts[:m, j] = token

    def _head_token(self, slots: torch.Tensor, sampled: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
                    last: torch.Tensor, attn_len: int, position: int) -> torch.Tensor:
        """A drafter pass (`StaticQwen2.extend`'s arguments) giving each row's head token at `position`: the argmax,
        or with draft_sample=probabilistic a draw at the request's temperature (`DraftDistributions.draw`)."""
        if self.draws is None:
            return self.drafter.extend(slots, tokens, start, last, attn_len)
        return self.draws.draw(self.drafter.logits(slots, tokens, start, last, attn_len), slots, sampled, position)

    def take_records(self) -> list[dict[str, Any]]:
        return self.recorder.take() if self.recorder is not None else []

    def release(self, freed: list[tuple[str, int]]) -> None:
        self.prompts.release(freed)  # the slots' device state is rewritten at their next request's prompt


__all__ = ["GpuFusedSpeculator", "GpuFusedConfig", "FusedRecorder", "fused_config", "recorded_rules", "NAME",
           "speculative_config", "is_gpu_fused", "attention_buckets", "CLASS_PATH", "SPEC_KEY", "RECORD_KEY", "RETIRED",
           "PREFILL_CHUNK"]

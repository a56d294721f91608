"""HyperQwen's fused drafter inside vLLM's own GPU step: lookup + a same-tokenizer draft model, fused per position
(SPEC §2.4) and verified in blocks whose length the adaptive scheduler picks per request (SPEC §2.5).

It runs where `gpu_lookup.GpuLookupSpeculator` runs (vLLM 0.26's model runner V2, asynchronous scheduling, after
sampling, on GPU tensors) and is installed the same way (`custom_class` + the hqlab plugin). Per step and request:

1. prompt tokens the drafter has not seen yet (a prompt chunk that vLLM just prefilled) are fed to it eagerly; the
   host knows these from vLLM's input batch (`is_prefilling_np`, `num_computed_prefill_tokens_np`,
   `num_scheduled_tokens`), so no device value is read;
2. one catch-up pass feeds every request the tokens it emitted this step (accepted drafts + the bonus token, at most
   k + 1, read from vLLM's history `req_states.all_token_ids` on the device) and yields the drafter's first token;
   `draft_block - 1` single-token passes yield the rest of its head;
3. the suffix-match kernel proposes up to k tokens from the same histories;
4. `fused_step.FusedStep` fuses both, advances each request's scheduler state (kept on the device, indexed by vLLM's
   request slot) and clips each request's block to its length; positions after it carry the pad token, which the
   target rejects, so a short step verifies exactly its short block.

Steps 2-4 have static shapes and read nothing back, so they replay from one CUDA graph per (batch size, attention
length bucket). The width vLLM verifies is fixed at k (its asynchronous scheduler reserves the positions before the
drafts exist); a request's block length is applied by padding, decided on the GPU in the same step (stale = 0 is
possible, stale = 1 stays a setting).

Skipping the drafter (`skip=L`, HyperQwen's rule: no drafter on a step whose request's step L earlier met
`skip_on`) is decided on the GPU by `FusedStep`, decision for decision with the lab's `fused` proposer. What saves
the time is the host's choice of graph, which can only use marks it already has: after each step the marks are
copied to pinned host memory without waiting; at a later step the host takes the newest copy that has arrived and
runs a drafter-free graph only if it proves that every request in the batch skips. Otherwise it runs the whole
drafting step, whose result is the same (a skipping request's drafts are ignored by the fusion rule), so a late copy
costs time, never a different decision. Drafter-free steps run the lookup and the rule only ("lookup"), and after
SKIP_RUN of them in a row a request's drafter catches up on what it missed in one wider pass ("catch_up"). Under
asynchronous scheduling the host is about a step ahead, so L >= 2 is what lets it know in time.

With `device_skip` the drafting step decides on the device itself, inside its graph: one IF node holds everything
the drafter runs, so a step where the lookup alone decides every row's block meets that node and nothing of the
drafter. A drafter that skipped steps reads what it missed at the next step that needs its token (`catch_up=lazy`),
in a loop of wide passes behind a WHILE node while it lags more than one pass feeds, then one narrow or wide pass;
a request that copies to its end never runs the drafter after its first steps.

The drafter (`drafter.StaticQwen2`) keeps its own KV cache, one row per request slot, outside vLLM's paged cache:
vLLM 0.26's V2 runner has no plain draft-model path, and a cache of its own needs no attention metadata, block-table
lookahead or scheduler change (docs/vllm-internals.md discusses the in-cache alternative). Its size is layers x
slots x (max_model_len + k + draft_block) positions, allocated when vLLM loads the target.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hqlab.config import ConfigError, resolve_spec
from hqlab.engines.vllm import batch_k, draft_sampling
from hqlab.engines.vllm.speculator import (RECORD_KEY, SPEC_KEY, RecordRing, V2Speculator, bind_histories,
                                           custom_class_config, gpu_spec, is_custom_class, pad_token, recording,
                                           refuse_retired)
from hqlab.proposers.fused import FusedConfig

NAME = "gpu-fused"
CLASS_PATH = "hqlab.engines.vllm.gpu_fused.GpuFusedSpeculator"
# prompt tokens fed to the drafter per eager call by default (`prefill_chunk`: bounds its activation memory; each call
# pays the host cost of 24 eager layers, which shows in the first token's time)
PREFILL_CHUNK = 1024
# prompt positions per replay of the captured prefill pass (`prefill_graph`): the most rows the drafter's Triton
# layers take (drafter.TRITON_MAX_ROWS), so with layers=triton a pass is 24 x 4 Triton kernels around
# FlashAttention, replayed with no host work per layer
PREFILL_ROWS = 64
GRAPH_MAX_BATCH = 16  # batch sizes above this draft eagerly
RECORD_CAPACITY = 4096
# With `skip`, at most this many drafter-free steps in a row per request before a catch-up pass: a catch-up pass
# after drafter-free steps feeds up to (SKIP_RUN + 1) * (k + 1) tokens, so its width, not a host read, bounds how far
# the drafter lags. Steps where no row is behind keep the narrow pass (k + 1 positions).
SKIP_RUN = 7
SNAPSHOTS = 4  # pinned host copies of the skip marks in flight (the host runs up to three steps ahead)
# how the drafter's head token is drawn under sampling: its argmax, verified as a point mass, or a draw from its own
# distribution at the request's temperature, verified against it (`draft_sampling`)
DRAFT_SAMPLES = ("greedy", "probabilistic")
KINDS = ("full", "catch_up", "lookup")  # what a drafting step runs of the drafter: all passes, the catch-up, none
CATCH_UPS = ("lazy", "bounded")  # device_skip: when a drafter that skipped steps catches up (GpuFusedConfig)


@dataclass(frozen=True)
class GpuFusedConfig(FusedConfig):
    """`FusedConfig` (k = long block, draft_block = drafter head = short block, lookup, fusion and scheduler keys) plus
    graphs: capture the drafting step in CUDA graphs when vLLM captures its own; compile: torch.compile the drafter
    layers' elementwise work (fewer kernels per pass; compiles on the first steps); compile_rule: torch.compile the
    fusion and schedule rule (`FusedStep`: ~100 small operations a step into a few kernels); prefill_chunk: prompt
    tokens the drafter reads per eager call (vLLM prefills up to max_num_batched_tokens, 2,048 by default, per step:
    one call per vLLM chunk at 2048); prefill_graph: a prompt with at most this many tokens still unread is fed to the
    drafter in passes of PREFILL_ROWS positions replayed from one captured CUDA graph (the last pass padded past the
    prompt's end with whatever the history row holds there; the drafter's next pass feeds from the prompt's end and
    overwrites it), not in eager calls (0: always eager; run p1 on an H100: 1.4 ms a pass against 12-36 ms for an
    eager prompt, docs/serving.md); device_skip: the drafting step itself skips the drafter's pass where the lookup
    alone decides every sampling row's block (a match of at least nstrong with a token to propose: with one drafter
    token a step and the threshold rule the block is then the lookup's whatever the drafter says), decided on the
    device behind CUDA graph conditional nodes (`conditional.run_if`), with no host proof and no lag; decision for
    decision the config without it (docs/vllm-internals.md, the device-decided skip); catch_up (with device_skip):
    when a drafter that skipped steps reads what it missed, "lazy" (only at a step that needs its token, in as many
    wide passes as its lag takes, a loop behind a WHILE node: a copy that never needs the drafter never runs it) or
    "bounded" (a wide pass once it lags SKIP_RUN steps, needed or not: run fm1's code); layers: how the drafter runs
    its layers ("torch", or "triton": four Triton kernels per layer in its drafting passes, `layers=triton`);
    attention: the drafter's attention ("auto": vLLM's FlashAttention; "triton": one Triton kernel a layer in the
    drafting passes, `attention=triton`; "sdpa"); draft_sample: under sampling, "greedy" proposes the drafter's argmax
    as a point mass, "probabilistic" draws its token from its own distribution at the request's temperature and hands
    vLLM's rejection sampler that distribution (`draft_sampling`: accepted with 1 - TV(p, q) instead of p(argmax q);
    greedy requests are unchanged)."""

    graphs: bool = True
    compile: bool = False
    compile_rule: bool = False
    prefill_chunk: int = PREFILL_CHUNK
    prefill_graph: int = 0
    device_skip: bool = False
    catch_up: str = "lazy"
    layers: str = "torch"
    attention: str = "auto"
    batch_k: str = ""
    draft_sample: str = "greedy"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_k:
            widths = batch_k.parse(self.batch_k, self.k)
            # a load that verifies nothing skips the whole drafting step; only the lazy catch-up reads what the
            # drafter missed meanwhile, however long (the narrow pass would feed k + 1 of it and lose the rest)
            if any(w == 0 for _, w in widths) and not (self.device_skip and self.catch_up == "lazy"):
                raise ConfigError(f"{NAME}: batch_k={self.batch_k!r} turns drafting off at some loads, which needs "
                                  f"device_skip=true with catch_up=lazy (the drafter then catches up when drafting "
                                  f"resumes); add them or give every batch size a width >= 1")
        if self.device_skip:
            # the skip is exact only where the drafter's tokens cannot change the block: one head token, taken from
            # the lookup at a strong match under the threshold rule, and no other skip rule beside it
            if self.draft_block != 1:
                raise ConfigError(f"{NAME}: device_skip needs draft_block=1 (one drafter token a step, which a strong "
                                  f"match replaces); got draft_block={self.draft_block}")
            if self.rule != "threshold":
                raise ConfigError(f"{NAME}: device_skip needs the threshold fusion rule (rule=threshold); got "
                                  f"rule={self.rule}")
            if self.skip:
                raise ConfigError(f"{NAME}: device_skip decides the skip on the device at the step itself; drop "
                                  f"skip={self.skip} (the host-proven skip) or device_skip")
        if self.catch_up not in CATCH_UPS:
            raise ConfigError(f"{NAME}: catch_up must be one of {', '.join(CATCH_UPS)} (got {self.catch_up!r})")
        if self.prefill_chunk < 1:
            raise ConfigError(f"{NAME}: prefill_chunk must be >= 1 prompt token per drafter call "
                              f"(got {self.prefill_chunk})")
        if self.prefill_graph < 0:
            raise ConfigError(f"{NAME}: prefill_graph is the longest unread prompt fed through the captured prefill "
                              f"pass, >= 0 (0: always eager; got {self.prefill_graph})")
        from hqlab.engines.vllm.drafter import ATTENTION, LAYERS

        if self.layers not in LAYERS:
            raise ConfigError(f"{NAME}: layers must be one of {', '.join(LAYERS)} (got {self.layers!r})")
        if self.attention not in ATTENTION:
            raise ConfigError(f"{NAME}: attention must be one of {', '.join(ATTENTION)} (got {self.attention!r})")
        if self.temperature != 0:
            raise ConfigError(f"{NAME}: the drafter drafts greedily inside vLLM (temperature=0); got "
                              f"temperature={self.temperature}")
        if self.vocab:
            raise ConfigError(f"{NAME}: a reduced draft vocabulary is not supported inside vLLM yet (got "
                              f"vocab={self.vocab!r})")
        if self.draft_sample not in DRAFT_SAMPLES:
            raise ConfigError(f"{NAME}: draft_sample must be one of {', '.join(DRAFT_SAMPLES)} (got "
                              f"{self.draft_sample!r})")
        if self.draft_sample == "probabilistic":
            # q may stand for a position only if whether the drafter's token is proposed there does not depend on
            # that token (draft_sampling's module docstring): a head decision by match length alone
            if self.rule != "threshold" or self.agree != 0:
                raise ConfigError(f"{NAME}: draft_sample=probabilistic needs rule=threshold and agree=0, where the "
                                  f"fusion rule's choice of a position's source never depends on the drafter's "
                                  f"sampled token (got rule={self.rule}, agree={self.agree})")


# Keys measured as no gain and removed (run fc: the 7-pass drafting step replayed from its graph; fk2: the one-pass
# step's kernels); a spec naming one fails with where to read why.
RETIRED = {
    "splits": "FlashAttention's key-length split: splits=1 equal at 512 tokens of history, up to +46 % at 3,900 "
              "(runs fc, fk2)",
    "plan_once": "one FA3 scheduling call per pass instead of one a layer: ~1 % of a pass, within the spread (run "
                 "fc), -21 us of a 1.49 ms step (fk2), and nothing in the drafting passes with attention=triton, "
                 "which the served config uses",
    "compile_mode": "torch.compile's max-autotune-no-cudagraphs: +32 % to +111 % a drafting step (run fc)",
}


def fused_config(spec: str) -> GpuFusedConfig:
    """The settings of a `gpu-fused:...` spec, validated (a retired key is an error that says so)."""
    refuse_retired(spec, RETIRED, NAME)
    unknown = f"{{spec!r}} is not a {NAME} spec (expected '{NAME}:k=15,draft_block=7,model=..,nmax=..')"
    return resolve_spec(spec, {NAME: GpuFusedConfig}, unknown=unknown, context=f"proposer {NAME!r}")[1]


def speculative_config(spec: str) -> dict[str, Any]:
    """vLLM's `speculative_config` for a `gpu-fused` spec (`speculator.custom_class_config`)."""
    config = fused_config(spec)
    return custom_class_config(CLASS_PATH, config.k, config.batch_k)


def is_gpu_fused(speculative_config: Any) -> bool:
    """True for a vLLM SpeculativeConfig (or dict) that asks for this speculator."""
    return is_custom_class(speculative_config, CLASS_PATH)


def attention_buckets(max_len: int, smallest: int = 512) -> list[int]:
    """Attention lengths with a captured graph: powers of two from `smallest`, then max_len itself."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


# `device_skip`'s per-step flags, one int32 buffer: run the drafter at all (an IF node), loop wide passes first (a
# WHILE node), the last pass narrow or wide (IF nodes), and what ran: that pass's width (0: none) and the passes
FLAGS = ("need", "loop", "narrow", "wide", "ran_width", "ran_passes")


def _lags(total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor, num_sampled: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens its request emitted that its drafter has not read (0 for a row that does not sample)."""
    return torch.where(num_sampled > 0, total_len[slots].long() - dlen[slots], 0)


def device_flags(total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor, num_sampled: torch.Tensor,
                 match_len: torch.Tensor, valid: torch.Tensor, nstrong: int, q: int, width: int,
                 lazy: bool) -> torch.Tensor:
    """`FLAGS` at the start of a `device_skip` step: the drafter runs unless every sampling row's block is the
    lookup's whatever the drafter says (a match of at least nstrong with a token to propose). "bounded" (not
    `lazy`): a row skips only while the wide pass can still catch it up after one more step (lag + q <= width), so
    no loop is ever needed; "lazy": no such bound, and a step that needs the drafter loops wide passes while a row
    lags more than one wide pass feeds."""
    lag = _lags(total_len, dlen, slots, num_sampled)
    decided = (match_len >= nstrong) & (valid >= 1)
    if not lazy:
        decided = decided & (lag + q <= width)
    need = ~((num_sampled <= 0) | decided).all()
    loop = need & (lag.max() > width)
    zero = torch.zeros_like(need)
    return torch.stack([need, loop, zero, zero, zero, zero]).to(torch.int32)


def advanced_flags(flags: torch.Tensor, total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor,
                   num_sampled: torch.Tensor, width: int) -> torch.Tensor:
    """`FLAGS` after one wide pass of the loop: loop again while a row still lags more than a wide pass feeds."""
    loop = (_lags(total_len, dlen, slots, num_sampled).max() > width).to(torch.int32)
    return torch.stack([flags[0], loop, flags[2], flags[3], flags[4], flags[5] + 1])


def final_flags(flags: torch.Tensor, total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor,
                num_sampled: torch.Tensor, q: int, width: int) -> torch.Tensor:
    """`FLAGS` for the step's last pass, after the loop: narrow (q positions) if every row lags at most q, else
    wide; it runs only where the step needs the drafter."""
    need = flags[0]
    narrow = need * (_lags(total_len, dlen, slots, num_sampled).max() <= q).to(torch.int32)
    wide = need - narrow
    return torch.stack([need, flags[1], narrow, wide, narrow * q + wide * width, flags[5] + need])


def record_meta(*columns: torch.Tensor) -> torch.Tensor:
    """A step's `FusedRecorder.FIELDS` columns as one [m, fields] int32 tensor (compiled: one kernel, not ten)."""
    return torch.stack([c.to(torch.int32) for c in columns], 1)


class FusedRecorder(RecordRing):
    """Per-step fused blocks and their decisions, kept on the GPU and read back in one copy by `take`; the host adds
    each step's kind of drafting run (`KINDS`), with the drafter passes it ran and its catch-up pass's width. The
    drafter's own tokens (`draft_block` a step, head first) are kept beside the fused block, for the replay."""

    FIELDS = ("context_len", "match_len", "valid", "block", "proposed", "take_flag", "head_taken", "tail_taken",
              "draft_valid", "ran_width", "ran_passes")

    def __init__(self, capacity: int, max_reqs: int, k: int, device: torch.device, draft_block: int = 1) -> None:
        super().__init__(capacity, device)
        self.draft_block = draft_block
        self.meta = torch.zeros(capacity, max_reqs, len(self.FIELDS), dtype=torch.int32, device=device)
        self.tokens = torch.zeros(capacity, max_reqs, k, dtype=torch.int64, device=device)
        self.sources = torch.zeros(capacity, max_reqs, k, dtype=torch.int8, device=device)
        self.drafts = torch.zeros(capacity, max_reqs, draft_block, dtype=torch.int64, device=device)
        self.kinds: list[tuple[str, int, int]] = []  # per noted step, beside RecordRing.steps: (kind, passes, width)

    def note(self, req_ids: list[str], host_s: float, kind: str = "full", passes: int = 0, width: int = 0) -> None:
        super().note(req_ids, host_s)
        self.kinds.append((kind, int(passes), int(width)))

    def restart(self) -> None:
        super().restart()
        self.kinds = []

    def write(self, meta: torch.Tensor, tokens: torch.Tensor, sources: torch.Tensor, drafts: torch.Tensor) -> None:
        m = meta.shape[0]
        slot = self.next_slot()
        self.meta[slot, :m] = meta.to(torch.int32)[None]
        self.tokens[slot, :m] = tokens[None]
        self.sources[slot, :m] = sources.to(torch.int8)[None]
        self.drafts[slot, :m] = drafts[None]

    def take(self) -> list[dict[str, Any]]:
        """Every step since the last call, one dict per (step, request); clears them."""
        steps, kinds, self.kinds = self.drain(), self.kinds, []
        if not steps:
            return []
        meta, tokens, sources = self.meta.cpu().numpy(), self.tokens.cpu().numpy(), self.sources.cpu().numpy()
        drafts = self.drafts.cpu().numpy()
        out = []
        for (slot, req_ids, host_s), (kind, passes, width) in zip(steps, kinds):
            for i, rid in enumerate(req_ids):
                row = dict(zip(self.FIELDS, (int(x) for x in meta[slot, i])))
                if kind == "device":  # the device chose: its last catch-up pass's width (0: none) and the passes
                    passes, width = row["ran_passes"], row["ran_width"]
                n = row["proposed"]  # the block's real tokens; pad follows up to k
                # the tokens the drafter drafted this step, one a pass up to its head (a device-skip step's loop
                # passes draft nothing; its last pass drafts the one token of draft_block=1); none where it did not
                # run (the buffer's are stale)
                drafted = min(max(passes, 0), self.draft_block)
                out.append({"request": rid, "row": i, "context_len": row["context_len"],
                            "match_len": row["match_len"], "tokens": [int(t) for t in tokens[slot, i, :n]],
                            "sources": [int(s) for s in sources[slot, i, :n]], "propose_s": host_s,
                            "batch": len(req_ids), "block": row["block"], "take_flag": bool(row["take_flag"]),
                            "head_taken": bool(row["head_taken"]), "tail_taken": bool(row["tail_taken"]),
                            "lookup_valid": row["valid"], "draft_valid": row["draft_valid"], "drafter": kind,
                            "drafter_passes": passes, "drafter_width": width,
                            "drafter_tokens": [int(t) for t in drafts[slot, i, :drafted]]})
        return out


class GpuFusedSpeculator(V2Speculator):
    """vLLM V2 speculator: the lookup and a draft model fused per position, block length per request.

    Same contract with vLLM's runner as `GpuLookupSpeculator`: `propose(...)` returns [num_reqs, k] int64 drafts on
    the device; `draft_logits` is None (greedy drafts are point masses); `init_cudagraph_manager` and `capture` are
    called by the runner; the plugin calls `bind` and `load_drafter` when vLLM loads the target.
    """

    def __init__(self, vllm_config: Any, device: torch.device | str | None = None) -> None:
        self.spec, self.config = gpu_spec(vllm_config, device, CLASS_PATH, fused_config)
        pad = pad_token(vllm_config)
        dtype = getattr(vllm_config.model_config, "dtype", torch.bfloat16)
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        self._setup(max_num_reqs=int(vllm_config.scheduler_config.max_num_seqs),
                    max_model_len=int(vllm_config.model_config.max_model_len), pad=pad, device=device,
                    dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16,
                    record=recording(vllm_config))
        self.k_table = batch_k.table_for(vllm_config, self.config.batch_k, self.config.k)

    @classmethod
    def standalone(cls, config: GpuFusedConfig, *, max_num_reqs: int, max_model_len: int, pad: int,
                   device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                   record: bool = False) -> "GpuFusedSpeculator":
        """The same speculator without a vLLM config (tests drive `bind`, `load_drafter` and `step` directly)."""
        self = cls.__new__(cls)
        self.spec, self.config, self.vocab = f"{NAME}:...", config, None
        self._setup(max_num_reqs=max_num_reqs, max_model_len=max_model_len, pad=pad, device=device, dtype=dtype,
                    record=record)
        self.k_table = batch_k.dense(batch_k.parse(config.batch_k, config.k), max_num_reqs, config.k) \
            if config.batch_k else None
        return self

    def _setup(self, *, max_num_reqs: int, max_model_len: int, pad: int, device: torch.device | str,
               dtype: torch.dtype, record: bool) -> None:
        from hqlab_kernels.suffix_match import SuffixMatcher

        from hqlab.engines.vllm.fused_step import FusedStep

        c = self.config
        self.k, self.block = c.k, c.draft_block
        self.q = c.k + 1  # a step emits at most k + 1 tokens: the catch-up pass's width
        # with `skip` or `device_skip`, the wide catch-up pass after drafter-free steps: SKIP_RUN steps' tokens and
        # this step's
        self.width = self.q * (SKIP_RUN + 1 if c.skip or c.device_skip else 1)
        self.device, self.dtype, self.pad = torch.device(device), dtype, pad
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        # Catch-up writes up to width - 1 positions past a history and the head passes block - 1 more.
        self.cache_len = max_model_len + self.width + self.block
        lk = c.lookup_config()
        self.matcher = SuffixMatcher(max_num_reqs, c.k, nmin=lk.nmin, nmax=lk.nmax, search=lk.search, full=lk.full,
                                     policy=lk.policy, max_len=max_model_len, device=self.device)
        self.step_rule = FusedStep(c, max_num_reqs=max_num_reqs, pad_token=pad, device=self.device,
                                   compile=c.compile_rule)
        dev = self.device
        self.slots = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)
        self.num_sampled = torch.zeros(max_num_reqs, dtype=torch.int32, device=dev)
        self.fresh = torch.zeros(max_num_reqs, dtype=torch.bool, device=dev)
        pin = dev.type == "cuda"
        # A ring of pinned buffers for the host-known `fresh` mask: under asynchronous scheduling the host prepares
        # up to three steps ahead, so a buffer must not be rewritten before its copy ran.
        self._fresh_host = [torch.zeros(max_num_reqs, dtype=torch.bool, pin_memory=pin) for _ in range(4)]
        self._fresh_turn = 0
        # What the host knows the device buffers hold, so that a decode step whose batch did not change launches no
        # copy for them (each CUDA call is host time on the step's critical path, docs/vllm.md): the slots last
        # copied to `slots` (None: unknown) and how many leading rows of `fresh` are known to be False.
        self._slots_host: np.ndarray | None = None
        self._fresh_clear = max_num_reqs
        self.dlen = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)  # drafter KV written per slot
        self.drafts = torch.zeros(max_num_reqs, self.block, dtype=torch.int64, device=dev)
        self.out = torch.full((max_num_reqs, c.k), pad, dtype=torch.int64, device=dev)
        self.arange_w = torch.arange(self.width, dtype=torch.int64, device=dev)
        self.zeros = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)
        # slot and position indices as device views: a tensor built from a host list would wait for the GPU's queue
        self.index = torch.arange(max(max_num_reqs, max_model_len), dtype=torch.int64, device=dev)
        self.prefilled: dict[str, int] = {}  # request id -> prompt tokens the drafter has seen (mid-prefill only)
        # prefill_graph: the captured prompt pass's inputs (a cache row, its first position, PREFILL_ROWS tokens) and
        # its graph (None until `capture`, or where capture failed: the same pass then runs eagerly)
        self._prefill_slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self._prefill_start = torch.zeros(1, dtype=torch.int64, device=dev)
        self._prefill_tokens = torch.zeros(1, PREFILL_ROWS, dtype=torch.int64, device=dev)
        self.prefill_graph: Any = None
        self.owner: dict[int, str] = {}  # slot -> the request whose tokens the drafter's cache row holds
        self.drafter: Any = None
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None  # vLLM's (all_token_ids, total_len)
        self.row_offsets: torch.Tensor | None = None
        self.recorder = FusedRecorder(RECORD_CAPACITY, max_num_reqs, c.k, dev, self.block) if record else None
        self.buckets = attention_buckets(self.cache_len)
        self.use_graphs = False
        self.graphs: dict[tuple[int, int, str, int], Any] = {}
        # (kind, catch-up width) of each graph: with `skip` a whole step narrow or wide (after drafter-free steps),
        # the catch-up pass alone (always wide) and no drafter pass
        self.variants = [("full", self.q), ("full", self.width), ("catch_up", self.width), ("lookup", 0)] \
            if c.skip else [("full", self.q)]
        self.steps_by_kind = dict.fromkeys(KINDS, 0)  # plain counters: drafting steps per kind of graph run
        if c.device_skip:
            self.steps_by_kind = {"device": 0}  # one kind of step: the device chooses what of the drafter runs
        self.steps_by_kind["off"] = 0  # steps whose drafting `batch_k` turned off (the next step verifies nothing)
        self._fresh_slots: set[int] = set()  # slots whose first sampling step fell in such a step
        self._deferred: dict[int, tuple[str, int, bool]] = {}  # slot -> (request, prompt end, done): unread prompts
        # with `device_skip`: what this step runs of the drafter (int32 flags the conditional nodes read, and what
        # ran, `FLAGS`), the conditional bodies' memory pool (made at capture), and whether a warm-up is running (it
        # runs every body once, as the capture will record them)
        self._flags = torch.zeros(len(FLAGS), dtype=torch.int32, device=dev)
        # the flags' arithmetic is a dozen tiny kernels on every step; with compile_rule one or two
        self._flag_rules = tuple(torch.compile(f, dynamic=None) if c.compile_rule else f
                                 for f in (device_flags, advanced_flags, final_flags))
        self._record_meta = torch.compile(record_meta, dynamic=None) if c.compile_rule else record_meta
        self._nest = True  # the drafter's loop and passes inside one IF node (else three nodes side by side)
        self._body_pool: Any = None
        self._warming = False
        self._step = 0  # drafting steps so far (the host's clock for the skip marks' copies)
        # host-side skip bookkeeping: per slot the step at which its current request sampled first (marks copied
        # before it belong to an earlier request) and the drafter-free steps it has had since its last catch-up
        self._since = np.zeros(max_num_reqs, dtype=np.int64)
        self._behind = np.zeros(max_num_reqs, dtype=np.int64)
        self._count = np.zeros(max_num_reqs, dtype=np.int64)  # per slot: the steps at which its row could sample
        # the copies of the marks, a ring (`_turn`: the newest); each with the host counts at its step, and numpy views
        # of its pinned buffers made once
        self._snapshots: list[dict[str, Any]] = []
        self._turn = 0
        if c.skip:
            lag = self.step_rule._marks.shape[1]
            self._marks_now = (self.step_rule._marks[:max_num_reqs], self.step_rule._marked[:max_num_reqs])
            # the marks and their counts packed in one buffer by the drafting step itself, so one copy brings both
            self._packed = torch.zeros(max_num_reqs, lag + 1, dtype=torch.int32, device=dev)
            for _ in range(SNAPSHOTS):
                packed = torch.zeros(max_num_reqs, lag + 1, dtype=torch.int32, pin_memory=pin)
                view = packed.numpy()
                self._snapshots.append({"packed": packed, "marks_np": view[:, :lag], "marked_np": view[:, lag],
                                        "count": np.zeros(max_num_reqs, np.int64),
                                        "event": torch.cuda.Event() if pin else None, "step": -1})
        # draft_sample=probabilistic: the seeds and the step counter of the draft's own noise, and vLLM's per-slot
        # temperatures (`bind_sampling`); the draft logits are allocated with the drafter (`load_drafter`: its
        # vocabulary)
        self.draws = c.draft_sample == "probabilistic"  # head tokens drawn from the drafter (not `sampled` rows)
        self.temperature: torch.Tensor | None = None
        seeds = np.random.default_rng().integers(0, 2 ** 62, size=max_num_reqs + 1, dtype=np.int64)
        self._seeds = torch.from_numpy(seeds).to(dev)
        self._draw_step = torch.zeros(1, dtype=torch.int64, device=dev)
        self._draft_logits: torch.Tensor | None = None
        self._point_tokens: torch.Tensor | None = None
        self._sample = torch.compile(draft_sampling.sample, dynamic=None) if c.compile_rule else draft_sampling.sample
        # What vLLM's V2 runner reads from a speculator.
        self.draft_logits = None
        self.supports_mm_inputs = False
        self.model = torch.nn.Module()

    # binding to vLLM -------------------------------------------------------------------------------------------

    def bind(self, all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
        """Attach vLLM's histories ([slots, max_model_len] int32) and their lengths ([slots] int32)."""
        state, self.row_offsets = bind_histories(all_token_ids, total_len, self.max_num_reqs, self.device)
        self.state = (state.all_token_ids, state.total_len)

    def load_drafter(self, folder: str | None = None) -> None:
        """Load the draft model (default: the config's `model`, through hqlab's model cache)."""
        from hqlab import models
        from hqlab.engines.vllm.drafter import StaticQwen2

        folder = folder or models.prepare(self.config.model)
        c = self.config
        drafter = StaticQwen2.load(folder, slots=self.max_num_reqs, max_len=self.cache_len, device=self.device,
                                   dtype=self.dtype, compile=c.compile, layers=c.layers, attention=c.attention)
        if self.vocab is not None and drafter.vocab != self.vocab:
            raise ConfigError(f"{NAME}: the drafter {self.config.model!r} has a vocabulary of {drafter.vocab} rows and "
                              f"the target {self.vocab}; the drafter must share the target's tokenizer")
        self.drafter = drafter
        if self.draws:
            self._allocate_draft_logits(drafter.vocab)
        # FlashAttention reads each row only up to its own length, whatever the bound: one graph per batch size.
        # The masked path attends over the whole bound, so it keeps a ladder of lengths.
        # The Triton attention too (attention=triton); its prompt chunks then run in FlashAttention or sdpa.
        whole = drafter.flash is not None or drafter.attention_kernel is not None
        self.buckets = [self.cache_len] if whole else attention_buckets(self.cache_len)

    def _allocate_draft_logits(self, vocab: int) -> None:
        """`draft_logits` for vLLM's rejection sampler, [max_num_reqs, k, vocab] float32 (a view: one scratch row
        past the slots takes the writes of rows that do not sample), every position a point mass at token 0 until a
        step writes it; `_point_tokens` remembers each point mass's token so that a step moves it with two writes."""
        k, dev = self.k, self.device
        self._vocab_index = torch.arange(vocab, dtype=torch.int64, device=dev)
        self._draft_logits = torch.full((self.max_num_reqs + 1, k, vocab), float("-inf"), dtype=torch.float32,
                                        device=dev)
        self._draft_logits[:, :, 0] = 0.0
        self._point_tokens = torch.zeros(self.max_num_reqs + 1, k, dtype=torch.int64, device=dev)
        self._positions = torch.arange(k, dtype=torch.int64, device=dev)
        # The values `_point_masses` writes, as device tensors: `x[index] = 0.0` on a CUDA tensor makes a CPU scalar
        # and copies it over, which CUDA graph capture refuses (the drafting step then ran eagerly)
        self._logit_off = torch.full((), float("-inf"), dtype=torch.float32, device=dev)
        self._logit_on = torch.zeros((), dtype=torch.float32, device=dev)
        self.draft_logits = self._draft_logits[:self.max_num_reqs]

    def bind_sampling(self, temperature: torch.Tensor) -> None:
        """Attach vLLM's per-slot temperatures ([max_num_reqs] float32, 0 = greedy): read by draft_sample=
        probabilistic."""
        self.temperature = temperature

    # vLLM's speculator interface -------------------------------------------------------------------------------

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        self.use_graphs = getattr(cudagraph_mode, "name", "NONE") != "NONE"

    def capture(self) -> None:
        """One CUDA graph per (batch size, attention bucket, kind, catch-up width): the catch-up pass, the head passes,
        the lookup and the fusion/schedule rule, launched as one graph per step (with `skip` also the drafter-free kinds
        and the wide catch-up)."""
        if not (self.use_graphs and self.config.graphs and self.ready and self.device.type == "cuda"):
            return
        try:
            self._capture_all()
        except RuntimeError as e:
            self.graphs.clear()
            if not (self.config.device_skip and self._nest):
                warnings.warn(f"{NAME}: capturing the drafting step failed ({e}); it runs eagerly", RuntimeWarning,
                              stacklevel=2)
            else:  # a driver without nested conditional nodes: the same step with its nodes side by side
                warnings.warn(f"{NAME}: capturing the drafter's nodes inside one IF node failed ({e}); capturing "
                              f"them side by side", RuntimeWarning, stacklevel=2)
                self._nest = False
                try:
                    self._capture_all()
                except RuntimeError as e2:
                    self.graphs.clear()
                    warnings.warn(f"{NAME}: capturing the drafting step failed ({e2}); it runs eagerly",
                                  RuntimeWarning, stacklevel=2)
        if self.config.prefill_graph:
            try:
                self._capture_prefill()
            except RuntimeError as e:
                self.prefill_graph = None
                warnings.warn(f"{NAME}: capturing the drafter's prompt pass failed ({e}); prompts are read eagerly",
                              RuntimeWarning, stacklevel=2)
        self._slots_host, self._fresh_clear = None, self.max_num_reqs  # capturing wrote `slots`, zeroed `fresh`
        if self.recorder is not None:
            self.recorder.restart()

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        if self.config.device_skip:
            self._body_pool = torch.cuda.graph_pool_handle()  # the bodies' memory, alive as long as the graphs
        # a conditional body is captured on a side stream while the step's capture is open, which "global" mode forbids
        mode = "thread_local" if self.config.device_skip else "global"
        for m in range(1, min(self.max_num_reqs, GRAPH_MAX_BATCH) + 1):
            self.slots[:m] = torch.arange(m, device=self.device)
            self.num_sampled.zero_()  # inactive rows: no state changes while capturing
            self.fresh.zero_()
            for bucket in self.buckets:
                for kind, width in self.variants:
                    stream = torch.cuda.Stream(self.device)
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    self._warming = True
                    try:
                        with torch.cuda.stream(stream):
                            self._draft(m, bucket, kind, width)
                    finally:
                        self._warming = False
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                        self._draft(m, bucket, kind, width)
                    self.graphs[(m, bucket, kind, width)] = graph

    def _prefill_pass(self) -> None:
        """PREFILL_ROWS prompt positions from `_prefill_start` of cache row `_prefill_slot` (static shapes: the body of
        the captured prompt pass; attention over the whole row, which FlashAttention and the masked path both bound
        by each query's own position)."""
        self.drafter.hidden_states(self._prefill_slot, self._prefill_tokens, self._prefill_start,
                                   attn_len=self.cache_len)

    def _capture_prefill(self) -> None:
        # a warm-up on a side stream first (Triton's and torch.compile's first calls), then the capture; both write
        # positions [0, PREFILL_ROWS) of slot 0 before any request owns it
        self._prefill_slot.zero_()
        self._prefill_start.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._prefill_pass()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"):
            self._prefill_pass()
        self.prefill_graph = graph

    @property
    def ready(self) -> bool:
        return self.state is not None and self.drafter is not None and (not self.draws or
                                                                         self.temperature is not None)

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
        """One drafting step for the batch: host arrays are vLLM's input-batch mirrors, `slots` and `num_sampled`
        device tensors. Returns [n, k] drafts (a view of a persistent buffer)."""
        assert self.ready, "bind() vLLM's request state and load_drafter() first"
        start = time.perf_counter()
        n = len(req_ids)
        fresh = np.zeros(n, dtype=bool)
        off = batch_k.next_k(self.k_table, n, self.config.k) == 0
        if not off and self._deferred:
            self._prefill_deferred(req_ids, slots_np, prefilling)
        for i in np.flatnonzero(prefilling):
            end = int(computed_prefill[i]) + int(scheduled[i])
            fresh[i] = end >= int(prefill_len[i])  # the prompt is done: this step sampled the request's first token
            if off:  # read when drafting resumes, if it resumes while the request runs (`_prefill_deferred`)
                self._deferred[int(slots_np[i])] = (req_ids[i], end, bool(fresh[i]))
            else:
                self._prefill(req_ids[i], int(slots_np[i]), end, done=bool(fresh[i]))
        if off:
            # The next step verifies nothing at this load (`batch_k`): nothing to draft, and no prompt read (an
            # eager drafter prefill inside a loaded server's steps delays every request). The tokens emitted
            # meanwhile are read by the lazy catch-up when drafting resumes, and a request's first step (its
            # scheduler state's reset) is remembered for that step.
            self._fresh_slots.update(int(s) for s in slots_np[fresh])
            self.steps_by_kind["off"] += 1
            return self.out[:n]
        if self._fresh_slots:
            fresh |= np.isin(slots_np, list(self._fresh_slots)) & ~(prefilling & ~fresh)
            self._fresh_slots.clear()
        if self._slots_host is None or not np.array_equal(self._slots_host, slots_np):
            self.slots[:n].copy_(slots)
            self._slots_host = np.array(slots_np, copy=True)
        self.num_sampled[:n].copy_(num_sampled)
        hit = np.flatnonzero(fresh)
        if hit.size or n > self._fresh_clear:  # else rows [0, n) of `fresh` are False already
            self._fresh_turn = (self._fresh_turn + 1) % len(self._fresh_host)
            host = self._fresh_host[self._fresh_turn]
            host[:n] = torch.from_numpy(fresh)
            self.fresh[:n].copy_(host[:n], non_blocking=True)
            self._fresh_clear = int(hit[0]) if hit.size else max(n, self._fresh_clear)
        # The longest history this step can reach (vLLM's host mirrors are upper bounds), plus what the passes add.
        reach = int(max(prefill_len.max(initial=0), (computed + scheduled).max(initial=0))) + 1
        bucket = next((x for x in self.buckets if x >= reach + self.width + self.block), self.buckets[-1])
        # the slots of the rows that may sample this step (a prompt's inner chunk does not), and of fresh rows
        rows = slots_np[~(prefilling & ~fresh)].astype(np.int64)
        started = slots_np[fresh].astype(np.int64)
        kind = "device" if self.config.device_skip else self._choose_kind(rows, started)
        # the narrow catch-up unless a row missed drafter-free steps (the host counts them, `_behind`)
        behind = bool(self.config.skip) and bool(self._behind[rows].any())
        width = 0 if kind == "lookup" else self.width if kind == "catch_up" or behind else self.q
        graph = self.graphs.get((n, bucket, "full" if kind == "device" else kind, width))
        if graph is not None:
            graph.replay()
        else:
            self._draft(n, bucket, kind, width)
        self._after_step(rows, started, kind)
        if self.recorder is not None:
            self.recorder.note(list(req_ids), time.perf_counter() - start, kind, self.passes(kind), width)
        return self.out[:n]

    def _prefill_deferred(self, req_ids: list[str], slots_np: np.ndarray, prefilling: np.ndarray) -> None:
        """Drafting resumes: read the prompts that arrived while it was off (`batch_k`), for the requests still in
        their slots; a slot another request took since is forgotten (that request has its own entry or prefill)."""
        here = {int(s): (rid, bool(p)) for rid, s, p in zip(req_ids, slots_np, prefilling)}
        for slot, (rid, end, done) in list(self._deferred.items()):
            now = here.get(slot)
            if now is None:
                continue  # not in this step's batch: keep it for a step that has it
            del self._deferred[slot]
            if now[0] != rid or now[1]:  # another request, or this one still prefilling (its chunk reads it all)
                continue
            self._prefill(rid, slot, end, done=done)

    def _choose_kind(self, rows: np.ndarray, started: np.ndarray) -> str:
        """The drafting step's kind: "full" unless the newest skip marks on the host prove that every row that may
        sample (slots `rows`) skips the drafter (then "lookup", or "catch_up" once a row has had SKIP_RUN
        drafter-free steps). `started`: the slots of rows that sampled their first token this step.

        At step t the device skips a row when the oldest of its L marks is set and all L are real (`FusedStep`).
        Marks copied after step s < t hold the row's last L marks up to step s; the device adds one at every step the
        row samples, so at step t the oldest is the copy's c-th, where c counts the steps after s at which the row
        sampled, and the real ones number `marked` + c. The host counts the steps at which a row could sample
        (`_count`); a row that could sample does (a decode row samples at least its bonus token, a prompt's last
        chunk its first token), so that count is c: the host decides exactly as the device, one copy late.
        (The rule before, which run `fe` ran, required the copy's first t-s marks all set: true whatever c is, but
        stricter than the device right after a copy breaks and resumes.)"""
        if not self.config.skip:
            return "full"
        snap = self._newest_snapshot()
        if snap is None or started.size or (self._since[rows] > snap["step"]).any():
            return "full"
        c = self._count[rows] - snap["count"][rows]  # the steps after the copy at which each row sampled
        lag = snap["marks_np"].shape[1]
        if (c >= lag).any():
            return "full"
        if not ((snap["marked_np"][rows] + c >= self.config.skip).all() and snap["marks_np"][rows, c].all()):
            return "full"
        return "catch_up" if (self._behind[rows] >= SKIP_RUN).any() else "lookup"

    def _newest_snapshot(self) -> dict[str, Any] | None:
        """The newest copy of the skip marks that has reached the host (None: none yet); never waits."""
        n = len(self._snapshots)
        for i in range(n):
            snap = self._snapshots[(self._turn - i) % n]
            if snap["step"] < 0:
                return None
            if snap["event"] is None or snap["event"].query():
                return snap
        return None

    def passes(self, kind: str) -> int:
        """Drafter forward passes a step of this kind runs: the catch-up pass and the head's further tokens."""
        return {"full": self.block, "catch_up": 1, "lookup": 0, "device": -1}[kind]  # -1: the records say

    def _after_step(self, rows: np.ndarray, started: np.ndarray, kind: str) -> None:
        """Host bookkeeping after a drafting step was launched (`rows`, `started`: as for `_choose_kind`); with
        `skip`, copy its marks to the host."""
        self.steps_by_kind[kind] += 1
        if self.config.skip:
            self._since[started] = self._step
            self._count[rows] += 1
            if kind == "lookup":
                self._behind[rows] += 1
            else:
                self._behind[rows] = 0
            self._turn = (self._turn + 1) % len(self._snapshots)
            snap = self._snapshots[self._turn]  # the oldest copy: its turn to be rewritten
            snap["packed"].copy_(self._packed, non_blocking=True)
            if snap["event"] is not None:
                snap["event"].record()
            snap["count"][:] = self._count
            snap["step"] = self._step
        self._step += 1

    def _prefill(self, req_id: str, slot: int, end: int, *, done: bool) -> None:
        """Feed the drafter the prompt tokens [seen, end) of one request (eager, host-known bounds); `done`: this
        chunk ends the prompt, so nothing needs remembering."""
        assert self.state is not None
        # The drafter continues a prompt only if its cache row still holds this request's earlier chunks; a new
        # request starts from 0 (whatever vLLM's prefix cache skipped), and so does one preempted and resumed
        # after another request used its slot.
        seen = self.prefilled.pop(req_id, 0)
        if self.owner.get(slot) != req_id:
            seen = 0
        self.owner[slot] = req_id
        tokens = self.state[0][slot]
        passes = -(-(end - seen) // PREFILL_ROWS)
        if 0 < end - seen <= self.config.prefill_graph and seen + passes * PREFILL_ROWS <= min(self.cache_len,
                                                                                            tokens.shape[0]):
            # passes of PREFILL_ROWS from the captured graph, the last one padded (`prefill_graph`); `fill_` is a
            # kernel with a scalar argument, not a copy from the host
            self._prefill_slot.fill_(slot)
            for a in range(seen, end, PREFILL_ROWS):
                self._prefill_tokens[0].copy_(tokens[a:a + PREFILL_ROWS])
                self._prefill_start.fill_(a)
                if self.prefill_graph is not None:
                    self.prefill_graph.replay()
                else:
                    self._prefill_pass()
        else:
            slot_t = self.index[slot:slot + 1]
            chunk = self.config.prefill_chunk
            for a in range(seen, end, chunk):
                e = min(end, a + chunk)
                self.drafter.hidden_states(slot_t, tokens[a:e].long()[None], self.index[a:a + 1], attn_len=e)
        self.dlen[slot:slot + 1].fill_(end)  # a kernel with a scalar argument: `dlen[slot] = end` copies from the host
        if not done:
            self.prefilled[req_id] = end

    def _draft(self, m: int, attn_len: int, kind: str = "full", width: int = 0) -> None:
        """Rows [0, m) of the step buffers -> `out[:m]`. Static shapes, no host reads: the captured graphs' body.
        `kind` "catch_up" runs only the catch-up pass, "lookup" no drafter pass (the host chose them because every
        row skips the drafter: the fusion rule ignores `drafts`). `width`: the catch-up pass's positions (default
        k + 1), at least the tokens each row emitted since its drafter last ran."""
        assert self.state is not None and self.row_offsets is not None
        all_ids, total_len = self.state
        slots, ns = self.slots[:m], self.num_sampled[:m]
        total = total_len[slots].long()
        sampled = ns > 0
        lengths = torch.where(sampled, total, 0).to(torch.int32)
        # the lookup first (it reads only vLLM's histories): with device_skip its match decides, on the device,
        # whether the drafter's pass runs at all
        proposals, match_len, valid = self.matcher(all_ids.view(-1), self.row_offsets[slots], lengths)
        if self.config.device_skip:
            self._device_pass(m, attn_len, match_len, valid)
        elif kind != "lookup":
            cur = self._catch_up(m, attn_len, width or self.q)
            for j in range(1, self.block if kind == "full" else 1):  # the head: one token per pass
                cur = self._head_token(slots, sampled, cur[:, None], total + (j - 1), self.zeros[:m], attn_len, j)
                self.drafts[:m, j] = cur
        lookup = proposals.masked_fill(proposals < 0, self.pad)
        self.out[:m] = self.step_rule(slots, ns, self.fresh[:m], lookup, valid, match_len, self.drafts[:m])
        if self.draws:
            self._point_masses(m, self.step_rule.sources[:m], self.out[:m])
        if self.config.skip:  # the skip marks for the host's copy (`_after_step`), in one buffer
            marks, marked = self._marks_now
            torch.cat((marks.to(torch.int32), marked[:, None]), dim=1, out=self._packed)
        if self.recorder is not None:
            r = self.step_rule
            # the last catch-up pass's width this step (0: no drafter pass) and the passes, as the device chose
            # them (`FLAGS`) or as the host did (the passes then come from the kind, `take`)
            if self.config.device_skip:
                ran = [self._flags[4].expand(m), self._flags[5].expand(m)]
            else:
                ran = [torch.full_like(lengths, 0 if kind == "lookup" else width or self.q), torch.zeros_like(lengths)]
            meta = self._record_meta(lengths, match_len, valid, r.block_len[:m], r.num_tokens[:m], r.take_flag[:m],
                                     r.head_taken[:m], r.tail_taken[:m], r.draft_valid[:m], *ran)
            self.recorder.write(meta, self.out[:m], r.sources[:m], self.drafts[:m, :self.block])

    def _catch_up(self, m: int, attn_len: int, width: int, final: bool = True) -> torch.Tensor:
        """A catch-up pass for rows [0, m): feeds each sampling row the tokens emitted since the drafter last saw
        its request (at most `width`), at their positions, and gives the drafter's next token (`drafts[:, 0]`).
        `final=False` (a pass of `device_skip`'s lazy loop): feeds all but the last of them (at most `width`), so
        that the step's last pass still has a token to read for every row that lags, and drafts nothing."""
        assert self.state is not None
        all_ids, total_len = self.state
        slots, sampled = self.slots[:m], self.num_sampled[:m] > 0
        total, dlen = total_len[slots].long(), self.dlen[slots]
        lag = torch.where(sampled, total - dlen, 0)
        count = (lag if final else lag - 1).clamp(0, width)
        pos = (dlen[:, None] + self.arange_w[:width]).clamp(max=self.max_model_len - 1)
        tokens = all_ids[slots[:, None], pos].long()
        last = (count - 1).clamp(min=0)
        if not final:
            first = self.drafter.extend(slots, tokens, dlen, last, attn_len)
            self.dlen[slots] = dlen + count
            return first
        first = self._head_token(slots, sampled, tokens, dlen, last, attn_len, 0)
        self.dlen[slots] = torch.where(sampled, total, dlen)
        self.drafts[:m, 0] = first
        return first

    def _head_token(self, slots: torch.Tensor, sampled: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
                    last: torch.Tensor, attn_len: int, position: int) -> torch.Tensor:
        """A drafter pass (`StaticQwen2.extend`'s arguments) giving each row's head token at `position`: the argmax,
        or with draft_sample=probabilistic a draw from the drafter's distribution at the request's temperature
        (`draft_sampling.sample`, fresh noise at every call), that distribution going to the position's row of the
        draft logits (rows that do not sample, `sampled` False, write the scratch row). A head position whose token
        is not the drafter's is made a point mass again after the fusion rule (`_point_masses`)."""
        if not self.draws:
            return self.drafter.extend(slots, tokens, start, last, attn_len)
        assert self.temperature is not None and self._draft_logits is not None
        logits = self.drafter.logits(slots, tokens, start, last, attn_len)
        self._draw_step.add_(1)
        token, processed = self._sample(logits, self.temperature[slots], self._seeds[slots], self._draw_step,
                                        self._vocab_index)
        index = torch.where(sampled, slots, self.max_num_reqs)
        self._draft_logits[index, position] = processed
        return token

    def _point_masses(self, m: int, sources: torch.Tensor, tokens: torch.Tensor) -> None:
        """draft_sample=probabilistic, after the fusion rule: every position of rows [0, m) whose token is not the
        drafter's (the lookup's, or the pad after the block) becomes a point mass at its token. A head position
        (< draft_block) keeps the drafter's distribution where its source is DRAFT, else is rewritten whole; a tail
        position is never the drafter's: its old point mass moves (two scattered writes a row). Under the settings
        this mode accepts (agree=0, rule=threshold) "source DRAFT" is the reference's `fusion.drafter_drawn`
        (tests/rules/test_fusion_sampling.py); the sources come from `fused_rules`, tested against the reference."""
        from hqlab.rules.fusion import SOURCE_DRAFT

        assert self._draft_logits is not None and self._point_tokens is not None
        slots, sampled = self.slots[:m], self.num_sampled[:m] > 0
        index = torch.where(sampled, slots, self.max_num_reqs)
        logits, head = self._draft_logits, min(self.block, self.k)
        if head < self.k:
            rows, cols = index[:, None], self._positions[None, head:]
            logits[rows, cols, self._point_tokens[index, head:]] = self._logit_off
            logits[rows, cols, tokens[:, head:]] = self._logit_on
            self._point_tokens[index, head:] = tokens[:, head:]
        for j in range(head):
            drafted = (sources[:, j] == SOURCE_DRAFT)[:, None]
            point = draft_sampling.point_mass_logits(tokens[:, j], logits.shape[-1])
            logits[index, j] = torch.where(drafted, logits[index, j], point)

    def _device_pass(self, m: int, attn_len: int, match_len: torch.Tensor, valid: torch.Tensor) -> None:
        """`device_skip`: the drafter's pass runs unless every sampling row's block is the lookup's whatever the
        drafter says (a match of at least nstrong, with a token to propose), and then as the narrow catch-up (k + 1
        positions) or, for a row whose drafter missed earlier steps, the wide one; with `catch_up=lazy` first a loop
        of wide passes while a row lags more than one wide pass feeds (a drafter that skipped a long copy), with
        `catch_up=bounded` never (a row skips only while one wide pass can catch it up). All of it sits behind
        conditional nodes, one IF node around it all (a drafter-free step meets that node alone): no host read, no
        host proof."""
        from hqlab.engines.vllm import conditional

        assert self.state is not None
        _, total_len = self.state
        c, flags, pool, warm = self.config, self._flags, self._body_pool, self._warming
        first, advanced, final = self._flag_rules
        slots, ns = self.slots[:m], self.num_sampled[:m]
        flags.copy_(first(total_len, self.dlen, slots, ns, match_len, valid, c.nstrong, self.q, self.width,
                          c.catch_up == "lazy"))

        def advance() -> None:
            self._catch_up(m, attn_len, self.width, final=False)
            flags.copy_(advanced(flags, total_len, self.dlen, slots, ns, self.width))

        def drafter() -> None:
            conditional.run_while(flags[1:2], advance, pool=pool, always=warm)
            flags.copy_(final(flags, total_len, self.dlen, slots, ns, self.q, self.width))
            for i, width in ((2, self.q), (3, self.width)):
                conditional.run_if(flags[i:i + 1], lambda w=width: self._catch_up(m, attn_len, w), pool=pool,
                                   always=warm)

        if self._nest:
            conditional.run_if(flags[0:1], drafter, pool=pool, always=warm)
        else:
            drafter()

    def take_records(self) -> list[dict[str, Any]]:
        return self.recorder.take() if self.recorder is not None else []


__all__ = ["GpuFusedSpeculator", "GpuFusedConfig", "FusedRecorder", "fused_config", "speculative_config",
           "is_gpu_fused", "attention_buckets", "NAME", "CLASS_PATH", "SPEC_KEY", "RECORD_KEY", "RETIRED"]

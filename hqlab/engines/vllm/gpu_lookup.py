"""hqlab's lookup inside vLLM's own GPU decode step (model runner V2, asynchronous scheduling, CUDA graphs).

vLLM's `custom_class` hook runs a proposer on the host between steps, and asking for it moves vLLM to its V1 model
runner with synchronous scheduling: every step then pays a host round trip, drafted or not. This speculator runs
where vLLM's own EAGLE/MTP speculators run instead: after sampling, inside the worker's step, on GPU tensors.

- The histories are vLLM's: `req_states.all_token_ids` (one row of prompt + output per request slot) and
  `req_states.total_len`, already updated with this step's tokens when `propose` is called.
- The match is the Triton suffix-match kernel (`hqlab_kernels.suffix_match.SuffixMatcher`), bit-identical to
  `hqlab.rules.lookup.suffix_match` (tests/kernels/test_suffix_match.py), one launch for the batch, no allocation.
- The drafts stay on the GPU: vLLM's runner copies them into its draft buffer and verifies them next step. Nothing
  here reads a device value on the host, so the step adds no synchronisation.
- The drafting step (gathers, the kernel, the pad fill, the record ring) is captured in one CUDA graph per batch
  size when vLLM captures its own (`capture`), so a step costs the host one copy and one graph launch.
- With `corpus=N` the step also searches a corpus of earlier requests' outputs (N tokens at most, FIFO of whole
  documents: `hqlab.rules.corpus`) kept on the GPU (`hqlab_kernels.corpus_match.CorpusRing`), in one more launch
  for the batch, and `corpus_policy` picks between the request's own match and the corpus's (`choose`). Finished
  requests reach the corpus through the plugin (`plugin._patch_scheduler`): vLLM's scheduler knows each
  finished request's exact output, the worker does not (its token rows may run past a stop by the tokens of the
  step that found it), so the scheduler hands the finished (prompt, output) ids to the worker with the next step's
  scheduler output and the worker adds them before that step drafts. With recording on, each step's record says
  how many documents had entered the corpus when it drafted, and `take_corpus_log` the order they entered in, so a
  replay rebuilds the corpus each step saw exactly.

vLLM 0.26's V2 runner verifies the same number of draft positions (`num_speculative_tokens`) for every request on
every step: its scheduler reserves them before the drafts exist (asynchronous scheduling). Positions the lookup
did not fill carry `pad`, a token id the target practically never emits (the last row of Qwen's padded
vocabulary), so they are rejected; greedy and sampled outputs stay exact whatever the pad is, since the target
decides every token.

The plugin (`hqlab.engines.vllm.plugin`) makes vLLM build this class for
`speculative_config={"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": k}` with the lookup
spec in `additional_config["hqlab_proposer"]`. Nothing here imports vLLM, so the drafting path runs (and is tested)
on any torch device, the Triton interpreter included.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hqlab.config import ConfigError, LookupConfig, require, resolve_spec
from hqlab.engines.vllm import batch_k
from hqlab.engines.vllm.goodput import check_knob, plain_steps, speculator_table, standalone_table
from hqlab.rules.corpus import CHOICE_POLICIES, CorpusConfig
from hqlab.engines.vllm.speculator import (PAD_KEY, RECORD_KEY, SPEC_KEY, RecordRing, RequestState, Retired,
                                           V2Speculator, bind_histories, custom_class_config, gpu_spec,
                                           is_custom_class, pad_token, recording, refuse_retired)
from hqlab.trace import Source

NAME = "gpu-lookup"  # the config name in `hqlab bench --engine vllm`
CLASS_PATH = "hqlab.engines.vllm.gpu_lookup.GpuLookupSpeculator"
RECORD_CAPACITY = 4096  # steps kept between two `take_records` calls


@dataclass(frozen=True)
class GpuLookupConfig(LookupConfig):
    """The lookup's settings plus graphs: capture the drafting step in CUDA graphs when vLLM captures its own (false:
    launch it eagerly every step, to measure what the graphs save). Every step verifies k draft positions per request
    (vLLM's scheduler reserves them before the drafts exist), or with batch_k as many as the step's batch size gets,
    e.g. "1:15/4:7/0" (`batch_k.py`: vLLM's scheduler narrows the verify as the load grows, and the speculator skips
    its drafting where the width is 0)."""

    graphs: bool = True
    batch_k: str = ""
    # The corpus of earlier requests (`hqlab.rules.corpus`): corpus = most tokens kept (0: no corpus), corpus_docs =
    # most documents, corpus_policy = own | longest (which match wins), corpus_prompts = also keep prompts.
    corpus: int = 0
    corpus_docs: int = 1024
    corpus_policy: str = "own"
    corpus_prompts: bool = False
    # The speculation gate (`hqlab.rules.gate`): a step verifies drafts only when some request's history, as the
    # scheduler knows it, ends in `gate` tokens seen earlier in it; 0 = speculate on every step.
    gate: int = 0
    # The goodput controller (`hqlab.rules.goodput`): each step verifies the captured width (batch_k's widths and 0)
    # with the most expected tokens per ms, priced by step costs: "default" or a StepCosts JSON file, or "online" /
    # "online:PATH.json" (measured by the server from that prior on, `hqlab.rules.online_costs`); "" = off.
    goodput: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_k:
            batch_k.parse(self.batch_k, self.k)
        require(self.gate >= 0, f"gate is the match length (tokens) a step needs to speculate, 0 for no gate "
                                f"(got {self.gate})")
        check_knob(self.goodput, gate=self.gate)
        require(self.corpus >= 0, f"corpus is the most tokens the corpus keeps, 0 for none (got {self.corpus})")
        require(self.corpus_policy in CHOICE_POLICIES,
                f"corpus_policy must be one of {CHOICE_POLICIES} (got {self.corpus_policy!r})")
        if self.corpus:
            self.corpus_config  # validates the corpus's own bounds
            require(not self.full, "full=true is not implemented for the corpus (the corpus rule proposes what "
                                   "follows a match up to the document's end): drop full or corpus")
        elif (self.corpus_docs, self.corpus_policy, self.corpus_prompts) != (1024, "own", False):
            raise ConfigError("corpus_docs, corpus_policy and corpus_prompts set a corpus: add corpus=N (its size in "
                              "tokens) or drop them")

    @property
    def corpus_config(self) -> CorpusConfig | None:
        """The corpus rule's settings, None without a corpus. The own-history window `search` does not apply to
        the corpus (its documents are whole earlier requests)."""
        if not self.corpus:
            return None
        return CorpusConfig(tokens=self.corpus, docs=self.corpus_docs, policy=self.corpus_policy,
                            prompts=self.corpus_prompts)

# Keys measured as no gain and removed, with the vLLM scheduler patches they needed; a spec naming one fails with why.
_STALE = ("a request's width read a step late through the step's output ran every class slower than the fixed "
          "width: chat at 0.63x none against 1.21x, 0.53x the throughput with eight requests")
_FIXED = "every request verifies the same width (k, or batch_k's width for the step's batch size)"
RETIRED = {"width": Retired(_STALE, f"drop it: {_FIXED}"),
           "min_valid": Retired(f"the threshold of width=stale, which {_STALE}", f"drop it: {_FIXED}")}


def lookup_config(spec: str) -> GpuLookupConfig:
    """The settings of a `gpu-lookup:...` (or `lookup:...`) spec, validated (a retired key is an error that says
    so)."""
    spec = refuse_retired(spec, RETIRED, NAME)
    unknown = f"{{spec!r}} is not a {NAME} spec (expected '{NAME}:nmin=..,nmax=..,k=..,policy=..')"
    return resolve_spec(spec, {NAME: GpuLookupConfig, "lookup": GpuLookupConfig}, unknown=unknown,
                        context=f"proposer {NAME!r}")[1]


def speculative_config(spec: str) -> dict[str, Any]:
    """vLLM's `speculative_config` for a `gpu-lookup` spec (`speculator.custom_class_config`)."""
    config = lookup_config(spec)  # steps that verify nothing (gate, goodput) need their CUDA graphs
    return custom_class_config(CLASS_PATH, config.k, config.batch_k, plain_steps=plain_steps(config))


def is_gpu_lookup(speculative_config: Any) -> bool:
    """True for a vLLM SpeculativeConfig (or dict) that asks for this speculator."""
    return is_custom_class(speculative_config, CLASS_PATH)


class StepRecorder(RecordRing):
    """The lookup's per-step drafts: context length, match length, valid count and tokens per request."""

    def __init__(self, capacity: int, max_reqs: int, k: int, device: torch.device | str) -> None:
        super().__init__(capacity, device)
        self.meta = torch.zeros(self.capacity, max_reqs, 3, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(self.capacity, max_reqs, k, dtype=torch.int32, device=device)

    def write(self, lengths: torch.Tensor, match_len: torch.Tensor, valid: torch.Tensor,
              proposals: torch.Tensor) -> None:
        m = lengths.shape[0]
        slot = self.next_slot()
        self.meta[slot, :m] = torch.stack((lengths.to(torch.int32), match_len, valid), 1)[None]
        self.tokens[slot, :m] = proposals[None]

    def take(self) -> list[dict[str, Any]]:
        """Every step since the last call, one dict per (step, request); clears them."""
        steps = self.drain()
        if not steps:
            return []
        meta, tokens = self.meta.cpu().numpy(), self.tokens.cpu().numpy()  # one sync, outside the decode loop
        out = []
        for slot, req_ids, host_s in steps:
            for i, rid in enumerate(req_ids):
                length, match_len, valid = (int(x) for x in meta[slot, i])
                out.append({"request": rid, "row": i, "context_len": length, "match_len": match_len,
                            "tokens": [int(t) for t in tokens[slot, i, :valid]],
                            "sources": [int(Source.LOOKUP)] * valid, "propose_s": host_s, "batch": len(req_ids)})
        return out


class CorpusStepRecorder(StepRecorder):
    """The lookup's records plus the corpus's part: own and corpus match lengths, whether the corpus won, and how
    many documents had entered the corpus when the step drafted (a host count, noted with the step)."""

    def __init__(self, capacity: int, max_reqs: int, k: int, device: torch.device | str) -> None:
        super().__init__(capacity, max_reqs, k, device)
        self.corpus_meta = torch.zeros(self.capacity, max_reqs, 3, dtype=torch.int32, device=device)
        self.docs_seen: list[int] = []  # per noted step, parallel to `steps`

    def write_corpus(self, lengths: torch.Tensor, match_len: torch.Tensor, valid: torch.Tensor,
                     proposals: torch.Tensor, own_len: torch.Tensor, corpus_len: torch.Tensor,
                     from_corpus: torch.Tensor) -> None:
        m = lengths.shape[0]
        slot = self.counter.remainder(self.capacity)  # the slot `write` is about to take
        self.corpus_meta[slot, :m] = torch.stack((own_len, corpus_len, from_corpus.to(torch.int32)), 1)[None]
        self.write(lengths, match_len, valid, proposals)

    def note_corpus(self, req_ids: list[str], host_s: float, docs: int) -> None:
        self.note(req_ids, host_s)
        self.docs_seen.append(docs)

    def restart(self) -> None:
        super().restart()
        self.docs_seen = []

    def take(self) -> list[dict[str, Any]]:
        docs, self.docs_seen = self.docs_seen, []
        steps = list(self.steps)
        out = super().take()
        if not out:
            return out
        extra = self.corpus_meta.cpu().numpy()
        at = 0
        for (slot, req_ids, _), seen in zip(steps, docs):
            for i in range(len(req_ids)):
                own_len, corpus_len, from_corpus = (int(x) for x in extra[slot, i])
                out[at].update({"own_match_len": own_len, "corpus_match_len": corpus_len,
                                "source": "corpus" if from_corpus else ("own" if own_len else "none"),
                                "corpus_docs": seen})
                if from_corpus:  # the step's tokens came from an earlier request's document
                    out[at]["sources"] = [int(Source.CORPUS)] * len(out[at]["tokens"])
                at += 1
        return out


class GpuLookupSpeculator(V2Speculator):
    """vLLM V2 speculator: the suffix-match lookup over vLLM's GPU histories, k drafts per request per step.

    vLLM's V2 runner calls `propose(input_batch, ..., dummy_run=...)` after sampling and expects [num_reqs, k]
    int64 draft tokens on the device. It also reads `draft_logits` (None: drafts are point masses, so the rejection
    sampler needs no draft distribution), `supports_mm_inputs`, `model` (for its communication-buffer hook), and
    calls `init_cudagraph_manager` and `capture` (the lookup has no model to capture).
    """

    def __init__(self, vllm_config: Any, device: torch.device | str | None = None) -> None:
        self.spec, self.config = gpu_spec(vllm_config, device, CLASS_PATH, lookup_config)
        self.k = self.config.k
        self.device = torch.device(device)
        self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.pad = pad_token(vllm_config)
        self._setup(record=recording(vllm_config))
        self.k_table = speculator_table(vllm_config, self.config)  # None with goodput: always draft

    @classmethod
    def standalone(cls, config: LookupConfig, *, max_num_reqs: int, max_model_len: int, pad: int,
                   device: torch.device | str, record: bool = False) -> "GpuLookupSpeculator":
        """The same speculator without a vLLM config (tests and micro-benchmarks drive `lookup` directly)."""
        self = cls.__new__(cls)
        self.spec, self.config, self.k = f"{NAME}:...", config, config.k
        self.device, self.max_num_reqs, self.max_model_len, self.pad = torch.device(device), max_num_reqs, \
            max_model_len, pad
        self._setup(record=record)
        self.k_table = standalone_table(config, max_num_reqs)
        return self

    def _setup(self, *, record: bool) -> None:
        from hqlab_kernels.suffix_match import SuffixMatcher

        c = self.config
        # The variant is planned for the longest possible history, so no step reads a length back to the host.
        self.matcher = SuffixMatcher(self.max_num_reqs, self.k, nmin=c.nmin, nmax=c.nmax, search=c.search,
                                     full=c.full, policy=c.policy, max_len=self.max_model_len, device=self.device)
        self.draft_tokens = torch.zeros(self.max_num_reqs, self.k, dtype=torch.int64, device=self.device)
        self.rows = torch.full((self.max_num_reqs,), -1, dtype=torch.int32, device=self.device)  # slots to draft for
        self.row_offsets: torch.Tensor | None = None
        self.state: RequestState | None = None
        self._setup_corpus()
        recorder = CorpusStepRecorder if self.corpus is not None else StepRecorder
        self.recorder = recorder(RECORD_CAPACITY, self.max_num_reqs, self.k, self.device) if record else None
        self.skipped_steps = 0  # steps whose drafting `batch_k` skipped (a plain counter)
        self.use_graphs = False  # vLLM's cudagraph mode, from init_cudagraph_manager
        self.graphs: dict[int, Any] = {}  # batch size -> captured drafting step (`capture`)
        # What vLLM's V2 runner reads from a speculator.
        self.draft_logits = None
        self.supports_mm_inputs = False
        self.model = torch.nn.Module()  # no weights; vLLM prepares communication buffers for `speculator.model`

    def _setup_corpus(self) -> None:
        self.corpus_config = getattr(self.config, "corpus_config", None)
        self.corpus = self.corpus_matcher = None
        self.corpus_log: list[dict[str, Any]] = []  # documents in the order they entered, since take_corpus_log
        self.corpus_seen: set[str] = set()  # requests admitted since the corpus was last reset
        if self.corpus_config is None:
            return
        from hqlab_kernels.corpus_match import CorpusMatcher, CorpusRing

        c = self.config
        self.corpus = CorpusRing(self.corpus_config.tokens, self.corpus_config.docs, self.device)
        self.corpus_matcher = CorpusMatcher(self.max_num_reqs, self.k, nmin=c.nmin, nmax=c.nmax, policy=c.policy,
                                            capacity=self.corpus_config.tokens, device=self.device)

    # The corpus ---------------------------------------------------------------------------------------------------

    def corpus_step(self, finished: Any, admitted: Any) -> None:
        """Between steps (before the step drafts): add the documents of requests that finished, `finished` =
        [(request id, prompt ids, output ids)] in the order vLLM's scheduler freed them, then note the requests
        admitted this step. Only requests admitted since the last `reset_corpus` enter the corpus, so a reset is
        exact even when a finished request's ids were still on their way from the scheduler."""
        if self.corpus is None:
            return
        for rid, prompt, output in finished:
            if rid not in self.corpus_seen:
                continue
            self.corpus_seen.discard(rid)
            doc = list(prompt) + list(output) if self.corpus_config.prompts else list(output)
            seq = self.corpus.add(doc)
            if seq >= 0 and self.recorder is not None:  # the log goes with the step records; a server keeps neither
                self.corpus_log.append({"seq": seq, "request": rid, "prompt_len": len(prompt),
                                        "output_len": len(output), "length": len(doc)})
        self.corpus_seen.update(admitted)

    def reset_corpus(self) -> None:
        """Empty the corpus (a benchmark point starts from nothing) and forget admitted requests and the log."""
        if self.corpus is None:
            return
        self.corpus.clear()
        self.corpus_seen = set()
        self.corpus_log = []

    def take_corpus_log(self) -> list[dict[str, Any]]:
        """The documents that entered the corpus since the last call, in order: insertion number, request id, prompt
        and output lengths, document length. Kept with recording on only (`hqlab_record`, as the step records): in a
        server nothing takes it, and it would grow by one entry a request."""
        log, self.corpus_log = self.corpus_log, []
        return log

    def bind(self, all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
        """Attach vLLM's histories ([slots, max_model_len] int32, contiguous) and their lengths ([slots] int32)."""
        self.state, self.row_offsets = bind_histories(all_token_ids, total_len, self.max_num_reqs, self.device)

    # vLLM's speculator interface -------------------------------------------------------------------------------

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        """Capture the drafting step in CUDA graphs unless vLLM runs eagerly (cudagraph mode NONE)."""
        self.use_graphs = getattr(cudagraph_mode, "name", "NONE") != "NONE"

    def capture(self) -> None:
        """One CUDA graph per batch size up to max_num_seqs: a step then costs one copy and one graph launch
        instead of about ten kernel launches from Python. Called by vLLM after it captured the target."""
        if not (self.use_graphs and self.config.graphs and self.state is not None and self.device.type == "cuda"):
            return
        pool = torch.cuda.graph_pool_handle()
        try:
            for m in range(1, self.max_num_reqs + 1):
                self.rows.fill_(-1)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm up off the capture (Triton compiles, allocator settles)
                    self._draft(m)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._draft(m)
                self.graphs[m] = graph
        except RuntimeError as e:  # a capture this torch/driver refuses: same drafts, launched eagerly
            self.graphs.clear()
            warnings.warn(f"gpu-lookup: capturing the drafting step in a CUDA graph failed ({e}); drafting runs "
                          "eagerly (same drafts, more launches per step)", RuntimeWarning, stacklevel=2)
        if self.recorder is not None:
            self.recorder.restart()

    def draft(self, input_batch: Any, num_sampled: Any, dummy_run: bool) -> torch.Tensor:
        n = int(input_batch.num_reqs)
        if dummy_run or self.state is None:  # warm-up and profiling runs: vLLM only needs the shape
            return self.draft_tokens[:n]
        if batch_k.next_k(self.k_table, n, self.k) == 0:  # the next step verifies nothing at this load: no drafting
            self.skipped_steps += 1
            return self.draft_tokens[:n]
        start = time.perf_counter()
        drafts = self.lookup(input_batch.idx_mapping, n)
        if self.recorder is not None:
            if self.corpus is not None:
                self.recorder.note_corpus(input_batch.req_ids, time.perf_counter() - start, self.corpus.inserted)
            else:
                self.recorder.note(input_batch.req_ids, time.perf_counter() - start)
        return drafts

    # The drafting step itself --------------------------------------------------------------------------------

    def lookup(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Drafts [n, k] int64 for the request slots `rows` ([n] int32/int64 on the device), on the device.

        Entries past each request's `valid` hold `pad`. No host synchronisation; through a captured graph when
        there is one for n. With recording on, the caller notes the step (`recorder.note`)."""
        assert self.state is not None and self.row_offsets is not None, "bind() vLLM's request state first"
        self.rows[:n].copy_(rows)
        graph = self.graphs.get(n)
        if graph is not None:
            graph.replay()
        else:
            self._draft(n)
        return self.draft_tokens[:n]

    def _draft(self, m: int) -> None:
        """The first m slots of `rows` (-1: none) -> `draft_tokens[:m]` (+ the record ring). Static shapes, no
        host reads: the body of the captured graphs."""
        assert self.state is not None and self.row_offsets is not None
        rows = self.rows[:m]
        slot = rows.clamp(min=0)
        lengths = torch.where(rows >= 0, self.state.total_len[slot], 0)
        offsets = self.row_offsets[slot]
        tokens = self.state.all_token_ids.view(-1)
        proposals, match_len, valid = self.matcher(tokens, offsets, lengths)
        if self.corpus is not None:
            own_len = match_len
            c_props, c_len, c_valid, _ = self.corpus_matcher(tokens, offsets, lengths, self.corpus)
            # `hqlab.rules.corpus.choose`: "own" takes the corpus only without an own match, "longest" the longer
            # capped match (ties to own history).
            if self.corpus_config.policy == "own":
                from_corpus = (own_len == 0) & (c_len > 0)
            else:
                from_corpus = c_len > own_len
            proposals = torch.where(from_corpus[:, None], c_props, proposals)
            match_len = torch.where(from_corpus, c_len, own_len)
            valid = torch.where(from_corpus, c_valid, valid)
        drafts = self.draft_tokens[:m]
        drafts.copy_(proposals)
        drafts.masked_fill_(proposals < 0, self.pad)
        if self.recorder is not None:
            if self.corpus is not None:
                self.recorder.write_corpus(lengths, match_len, valid, proposals, own_len, c_len, from_corpus)
            else:
                self.recorder.write(lengths, match_len, valid, proposals)

    def take_records(self) -> list[dict[str, Any]]:
        """The per-step drafts since the last call (empty when recording is off)."""
        return self.recorder.take() if self.recorder is not None else []


__all__ = ["GpuLookupSpeculator", "GpuLookupConfig", "StepRecorder", "CorpusStepRecorder", "RecordRing",
           "lookup_config", "RETIRED",
           "speculative_config", "is_gpu_lookup", "is_custom_class", "pad_token", "bind_histories", "NAME",
           "CLASS_PATH", "SPEC_KEY", "RECORD_KEY", "PAD_KEY"]


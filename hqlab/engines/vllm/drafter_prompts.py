"""How `gpu_fused`'s drafter reads the prompts: eagerly, at the first drafting step after vLLM prefilled a chunk.

vLLM prefills a prompt in chunks; the host knows each chunk's bounds from its input batch, so nothing is read back.
The drafter reads a request's prompt tokens it has not read at the next step that drafts (`take`): at once where
that step drafts, later where the next step's width is 0 (`batch_k`, `goodput`: it verifies nothing, and an eager
drafter prefill inside a loaded server's steps would delay every request), so a request on width-0 steps costs the
drafter nothing until drafting resumes while it runs. A request's first sampled token is remembered the same way:
the step that reads the end of its prompt is the request's first step for the fusion rule (its scheduler state is
reset there).

A prompt is read in eager calls of `prefill_chunk` tokens, or, when at most `prefill_graph` tokens are unread, in
passes of PREFILL_ROWS positions replayed from one captured CUDA graph (the last pass padded past the prompt's end
with whatever the history row holds there; the drafter's next pass feeds from the prompt's end and overwrites it).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

# prompt positions per replay of the captured prompt pass: the most rows the drafter's Triton layers take
# (drafter.TRITON_MAX_ROWS), so a pass is 4 Triton kernels a layer around FlashAttention, with no host work per layer
PREFILL_ROWS = 64


class PromptReader:
    """The drafter's reading of prompts for one speculator (see the module docstring): `dlen` is the speculator's
    count of drafter positions written per slot, `index` its slot and position indices (a device tensor); the
    speculator sets `drafter` and `all_token_ids` (vLLM's histories) when it has them."""

    def __init__(self, *, chunk: int, graph_bound: int, cache_len: int, dlen: torch.Tensor,
                 index: torch.Tensor) -> None:
        self.chunk, self.graph_bound, self.cache_len, self.dlen, self.index = chunk, graph_bound, cache_len, dlen, index
        self.drafter: Any = None
        self.all_token_ids: torch.Tensor | None = None
        self.owner: dict[int, str] = {}  # slot -> the request whose tokens the drafter's cache row holds
        self.read_upto: dict[str, int] = {}  # request -> prompt tokens read, while its prompt is unfinished
        self.unread: dict[int, tuple[str, int, bool]] = {}  # slot -> (request, prompt end, the end is the prompt's)
        # the captured prompt pass's inputs (a cache row, its first position, PREFILL_ROWS tokens) and its graph
        # (None until `capture`, or where capture failed: the same pass then runs eagerly)
        self.slot = torch.zeros(1, dtype=torch.int64, device=dlen.device)
        self.start = torch.zeros(1, dtype=torch.int64, device=dlen.device)
        self.tokens = torch.zeros(1, PREFILL_ROWS, dtype=torch.int64, device=dlen.device)
        self.graph: Any = None

    def note(self, req_ids: list[str], slots_np: np.ndarray, prefilling: np.ndarray, ends: np.ndarray,
             prompt_lens: np.ndarray) -> None:
        """The prompt chunks vLLM prefilled this step: rows `prefilling`, their prompts computed up to `ends`."""
        for i in np.flatnonzero(prefilling):
            end = int(ends[i])
            self.unread[int(slots_np[i])] = (req_ids[i], end, end >= int(prompt_lens[i]))

    def take(self, req_ids: list[str], slots_np: np.ndarray) -> np.ndarray:
        """Read the noted prompt tokens of this batch's requests; returns which rows this makes the request's first
        step (its prompt's end read). A slot another request took since is forgotten (that request has its own
        note); a request not in this batch keeps its note for a step that has it."""
        first = np.zeros(len(req_ids), dtype=bool)
        for i, (rid, slot) in enumerate(zip(req_ids, slots_np)):
            noted = self.unread.pop(int(slot), None)
            if noted is not None and noted[0] == rid:
                self.read(rid, int(slot), noted[1], done=noted[2])
                first[i] = noted[2]
        return first

    def release(self, freed: list[tuple[str, int]]) -> None:
        """vLLM's runner freed these (request, slot) pairs (finished, aborted or preempted): forget what the notes and
        the drafter's rows hold for them, so that nothing outlives a request that is gone (a request aborted or ended
        at max_tokens before its prompt was read would keep its `read_upto` for ever) and a slot's next request, or
        this one resumed, reads its prompt from the start."""
        for req_id, slot in freed:
            self.read_upto.pop(req_id, None)
            if self.owner.get(slot) == req_id:
                del self.owner[slot]
            if self.unread.get(slot, ("",))[0] == req_id:
                del self.unread[slot]

    def read(self, req_id: str, slot: int, end: int, *, done: bool) -> None:
        """Feed the drafter the prompt tokens [read so far, end) of one request (host-known bounds); `done`: this
        chunk ends the prompt, so nothing needs remembering."""
        # The drafter continues a prompt only if its cache row still holds this request's earlier chunks; a new
        # request starts from 0 (whatever vLLM's prefix cache skipped), and so does one preempted and resumed
        # after another request used its slot.
        seen = self.read_upto.pop(req_id, 0)
        if self.owner.get(slot) != req_id:
            seen = 0
        self.owner[slot] = req_id
        assert self.all_token_ids is not None
        tokens = self.all_token_ids[slot]
        passes = -(-(end - seen) // PREFILL_ROWS)
        if 0 < end - seen <= self.graph_bound and seen + passes * PREFILL_ROWS <= min(self.cache_len,
                                                                                      tokens.shape[0]):
            self.slot.fill_(slot)  # `fill_` is a kernel with a scalar argument, not a copy from the host
            for a in range(seen, end, PREFILL_ROWS):
                self.tokens[0].copy_(tokens[a:a + PREFILL_ROWS])
                self.start.fill_(a)
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.pass_()
        else:
            slot_t = self.index[slot:slot + 1]
            for a in range(seen, end, self.chunk):
                e = min(end, a + self.chunk)
                self.drafter.hidden_states(slot_t, tokens[a:e].long()[None], self.index[a:a + 1], attn_len=e)
        self.dlen[slot:slot + 1].fill_(end)  # a kernel with a scalar argument: `dlen[slot] = end` copies from the host
        if not done:
            self.read_upto[req_id] = end

    def pass_(self) -> None:
        """PREFILL_ROWS prompt positions from `start` of cache row `slot` (static shapes: the captured pass's body;
        attention over the whole row, which FlashAttention and the masked path both bound by each query's own
        position)."""
        self.drafter.hidden_states(self.slot, self.tokens, self.start, attn_len=self.cache_len)

    def capture(self, device: torch.device) -> None:
        """Capture the prompt pass (where that fails, prompts are read eagerly, with a warning)."""
        try:
            self._capture(device)
        except RuntimeError as e:
            self.graph = None
            warnings.warn(f"capturing the drafter's prompt pass failed ({e}); prompts are read eagerly",
                          RuntimeWarning, stacklevel=3)

    def _capture(self, device: torch.device) -> None:
        """A warm-up on a side stream first (Triton's and torch.compile's first calls), then the capture; both write
        positions [0, PREFILL_ROWS) of slot 0 before any request owns it."""
        self.slot.zero_()
        self.start.zero_()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.pass_()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"):
            self.pass_()
        self.graph = graph


__all__ = ["PromptReader", "PREFILL_ROWS"]

"""One fused drafting step for a whole batch on device tensors: fuse -> schedule -> clip -> pad.

`hqlab.proposers.fused.FusedProposer` is the reference: per request and step it fuses the lookup's proposal (up to
k tokens) with the drafter's head (draft_block tokens), lets the scheduler pick this step's block length (short =
draft_block, long = k) from the take flag and what the request emitted at its last step, and proposes the fused
block clipped to that length. `FusedStep` is the per-step driver a vLLM speculator calls once per step with the
batch's lookup and drafter outputs already on the device; the rules themselves are `hqlab.engines.vllm.fused_rules`
(tested decision for decision against `hqlab.rules`), this module only strings them together:

- scheduler state lives in device tensors indexed by the request's slot (vLLM's `input_batch.idx_mapping`: stable
  for a request's life, reused after it finishes), so requests can join, leave and come in any batch order;
- a request's first sampling step (`fresh`) resets its slot's state, since a reused slot holds an old request's;
- rows that do not sample this step (`num_sampled == 0`: a prompt still being prefilled, or padding of a captured
  batch size) propose nothing and leave every slot's state alone, like rows outside `active` in
  `schedule_step_tensors`; they read and write a scratch row instead of their slot, so their slot may be anything
  (a duplicate, or -1 for padding);
- no host read of a device value and no shape that depends on one, and every output goes to a buffer allocated in
  `__init__`, so `__call__` can be captured in a CUDA graph and replayed.

The reference reads the emitted count off the history (its growth since the request's last call, 0 at the first
call); here the caller passes vLLM's `num_sampled` (accepted drafts + 1) and `fresh`, and the driver uses
`where(fresh, 0, num_sampled)`, which is the same number. Inside the caller's contract (sampling rows' slots
distinct and in range, `lookup_valid` in [0, k], counts >= 0; none of it can be checked without reading values
back) every block, source and decision equals the reference's: tests/engines/vllm/test_vllm_fused_step.py runs
both side by side.
"""

from __future__ import annotations

import torch

from hqlab.config import require
from hqlab.engines.vllm.fused_rules import (SOURCE_NONE, FusedTensors, ScheduleTensors, fuse_tensors,
                                            schedule_step_tensors, step_unanimous_tensors)
from hqlab.proposers.fused import FusedConfig


class FusedStep:
    """One fused drafting step for a batch, on device tensors: fuse -> schedule -> clip -> pad.

    After a call with n rows, the first n rows of these buffers describe the step (row i = the call's row i):

    tokens:     [max_num_reqs, k] int64, the proposal (also the return value): the fused block clipped to the
                block length, `pad_token` after it.
    sources:    [max_num_reqs, k] int8, SOURCE_LOOKUP / SOURCE_DRAFT per proposed position, SOURCE_NONE after.
    num_tokens: [max_num_reqs] int32, proposed positions = min(block_len, n_proposed) (the reference's
                `len(Proposal.tokens)`).
    block_len:  [max_num_reqs] int32, the scheduler's block length (`extra["block"]`); 0 for a row that does not
                sample.
    n_proposed: [max_num_reqs] int32, the fused block's length before clipping (`len(Fused.tokens)`).
    take_flag, head_taken, tail_taken: [max_num_reqs] bool, the fusion decisions (False for a row that does not
                sample).
    draft_valid: [max_num_reqs] int32, head positions the drafter supplied this step (the reference's
                `extra["drafted"]`): draft_block, 0 for a row that does not sample.

    `state` is the scheduler state per request slot ([max_num_reqs] each, `ScheduleTensors`, views).
    """

    def __init__(self, config: FusedConfig, *, max_num_reqs: int, pad_token: int,
                 device: torch.device | str, compile: bool = False) -> None:
        require(max_num_reqs >= 1, f"fused step: max_num_reqs must be >= 1 (got {max_num_reqs}); it is the number "
                                   f"of request slots")
        require(pad_token >= 0, f"fused step: pad_token must be a token id >= 0 (got {pad_token})")
        # the lab proposer's `skip` spares the drafter on steps chosen from earlier steps' marks; inside vLLM the
        # device decides at the step itself (gpu_fused_config.RETIRED["skip"]), so this twin has no skip marks
        require(config.skip == 0, f"fused step: skip={config.skip} is the lab proposer's host-proven drafter skip, "
                                  f"which the vLLM step does not run (use gpu-fused's device_skip)")
        self.config = config
        self.k = config.k
        self.max_num_reqs = max_num_reqs
        self.pad_token = pad_token
        self.fusion = config.fusion_config()
        self.schedule = config.schedule_config()
        # one row past the slots: the scratch row that rows which do not sample read and write
        self._state = ScheduleTensors.allocate(max_num_reqs + 1, device)
        whole = self._state
        self.state = ScheduleTensors(whole.run[:max_num_reqs], whole.hold[:max_num_reqs], whole.long[:max_num_reqs],
                                     whole.pending[:max_num_reqs])
        fused = FusedTensors.allocate(max_num_reqs, config.k, device)
        fused.tokens.fill_(pad_token)
        self._fused = fused
        self.tokens, self.sources, self.n_proposed = fused.tokens, fused.sources, fused.n_proposed
        self.take_flag, self.head_taken, self.tail_taken = fused.take_flag, fused.head_taken, fused.tail_taken
        self.block_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self._positions = torch.arange(config.k, device=device)
        self.draft_valid = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # `compile`: the rule is ~100 small tensor operations a step, each its own kernel inside a captured graph;
        # torch.compile fuses them into a few (one graph, no break). The same operations, so the same decisions
        # (test_vllm_fused_step.py compares both).
        self._run = torch.compile(self._step, dynamic=None) if compile else self._step

    def __call__(self, slots: torch.Tensor, num_sampled: torch.Tensor, fresh: torch.Tensor,
                 lookup_tokens: torch.Tensor, lookup_valid: torch.Tensor, match_len: torch.Tensor,
                 draft_tokens: torch.Tensor) -> torch.Tensor:
        """Propose for n requests; returns `tokens[:n]` (a view of the preallocated buffer).

        slots:         [n] int32/int64, each sampling row's request slot in [0, max_num_reqs), distinct; any
                       value for a row that does not sample.
        num_sampled:   [n] int, tokens the row emitted at the step that just ran (accepted + 1); 0 = not sampling.
        fresh:         [n] bool, the row's first sampling step: its slot's state is reset first.
        lookup_tokens: [n, k] int64, entries from each row's lookup_valid on are padding (any value).
        lookup_valid:  [n] int, real lookup tokens per row, in [0, k].
        match_len:     [n] int, the lookup's match length (0 = no match).
        draft_tokens:  [n, draft_block] int64, the drafter's head.
        """
        n = slots.shape[0]
        if slots.shape[0] > self.max_num_reqs:
            raise ValueError(f"fused step: {n} rows but only max_num_reqs = {self.max_num_reqs} slots")
        if tuple(lookup_tokens.shape) != (n, self.k):
            raise ValueError(f"fused step: lookup_tokens must be [n, k] = [{n}, {self.k}], "
                             f"got {tuple(lookup_tokens.shape)}")
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"fused step: slots must be int32 or int64, got {slots.dtype}")
        return self._run(slots, num_sampled, fresh, lookup_tokens, lookup_valid, match_len, draft_tokens)

    def _step(self, slots: torch.Tensor, num_sampled: torch.Tensor, fresh: torch.Tensor, lookup_tokens: torch.Tensor,
              lookup_valid: torch.Tensor, match_len: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """The step itself, on checked inputs (`__call__`); with `compile`, run through torch.compile."""
        n = slots.shape[0]
        active = num_sampled > 0
        # the reference's emitted count is the history's growth since the last call, 0 at a request's first one
        emitted = torch.where(fresh, 0, num_sampled)
        # rows that do not sample go to the scratch row: their slot may be padding (-1) or shared with a real row
        index = torch.where(active, slots.to(torch.int64), self.max_num_reqs)
        fused = fuse_tensors(draft_tokens, lookup_tokens, lookup_valid, match_len, self.fusion,
                             pad_token=self.pad_token, out=self._fused)
        before = self._state.select(index)
        before = ScheduleTensors(before.run.masked_fill(fresh, 0), before.hold.masked_fill(fresh, 0),
                                 before.long.masked_fill(fresh, False), before.pending.masked_fill(fresh, False))
        if self.config.batch_mode == "unanimous":
            after, block_len = step_unanimous_tensors(before, fused.take_flag, emitted, self.schedule, active)
        else:
            after, block_len = schedule_step_tensors(before, fused.take_flag, emitted, self.schedule, active)
        self._state.assign(index, after)
        head_len = min(self.config.draft_block, self.k)
        self.draft_valid[:n].copy_(torch.full_like(num_sampled, head_len, dtype=torch.int32).masked_fill(~active, 0))

        # clip: a prefix of the fused block (fuse_tensors already padded past n_proposed); block_len 0 clears a row
        # that does not sample
        cut = self._positions >= block_len[:, None]
        fused.tokens.masked_fill_(cut, self.pad_token)
        fused.sources.masked_fill_(cut, SOURCE_NONE)
        idle = ~active
        fused.n_proposed.masked_fill_(idle, 0)
        for flag in (fused.take_flag, fused.head_taken, fused.tail_taken):
            flag.masked_fill_(idle, False)
        self.block_len[:n].copy_(block_len)
        torch.minimum(block_len, fused.n_proposed, out=self.num_tokens[:n])
        return fused.tokens


__all__ = ["FusedStep"]

"""The fusion rule and the block-length scheduler on device tensors, for a whole batch at once.

A second implementation of `hqlab.rules.fusion` (SPEC §2.4) and `hqlab.rules.schedule` (SPEC §2.5), for a fused
speculator that runs inside vLLM's GPU step like `hqlab.engines.vllm.gpu_lookup`. The references decide for one
request at a time in Python and stay the definition of the rules (their docstrings say why each rule is what it
is); this module makes the same decisions for every request of a batch with torch operations on any device:

- no Python loop over requests and no host read of a device value (no `.item()`, `.cpu()`, `.tolist()`, no
  `if tensor:`), so a step adds no synchronisation;
- every shape follows from the input shapes and the config, never from values, so the work can be captured in a
  CUDA graph;
- outputs can go to preallocated buffers (`out=`, `ScheduleTensors.allocate`), so a captured graph writes to the
  same memory on every replay.

Reading nothing back also means inputs cannot be validated the way the references validate them (they raise on
`valid` outside [0, k], a negative match length or emitted count, a score outside [0, valid], an empty unanimous
batch). Those are the caller's contract here. Inside it, every decision equals the reference's, position for
position and step for step: tests/engines/vllm/test_vllm_fused_rules.py checks this on random inputs and on
recorded traces.

Layout of a fused block: `tokens` and `sources` are [B, k]. The first `n_proposed` positions of a row hold exactly
the reference's `Fused.tokens` and `Fused.sources`; the positions after them were proposed by nobody and hold
`pad_token` and `SOURCE_NONE`, so they can be told apart from drafter and lookup positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from hqlab.rules.fusion import SOURCE_DRAFT, SOURCE_LOOKUP, FusionConfig
from hqlab.rules.schedule import ScheduleConfig

SOURCE_NONE = -1  # a position nobody proposed; distinct from every hqlab.trace.Source value


# Fusion ------------------------------------------------------------------------------------------------------


class FusedTensors(NamedTuple):
    """The fused proposals of a batch and the decisions that produced them (`hqlab.rules.fusion.Fused`, batched).

    tokens:     [B, k] int64; positions from n_proposed on hold the pad token.
    sources:    [B, k] int8; SOURCE_LOOKUP, SOURCE_DRAFT, or SOURCE_NONE from n_proposed on.
    n_proposed: [B] int32, the length of the reference's fused block.
    take_flag:  [B] bool, match_len >= longmin and valid > draft_block and tail_taken.
    head_taken: [B] bool, the head rule's decision.
    tail_taken: [B] bool, the tail rule's decision.
    """

    tokens: torch.Tensor
    sources: torch.Tensor
    n_proposed: torch.Tensor
    take_flag: torch.Tensor
    head_taken: torch.Tensor
    tail_taken: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, k: int, device: torch.device | str) -> "FusedTensors":
        """Output buffers for up to `max_batch` requests, to pass as `fuse_tensors(..., out=)`."""
        flags = [torch.zeros(max_batch, dtype=torch.bool, device=device) for _ in range(3)]
        return cls(torch.zeros(max_batch, k, dtype=torch.int64, device=device),
                   torch.full((max_batch, k), SOURCE_NONE, dtype=torch.int8, device=device),
                   torch.zeros(max_batch, dtype=torch.int32, device=device), *flags)

    def rows(self, n: int) -> "FusedTensors":
        """The first n rows (views)."""
        return FusedTensors(*(t[:n] for t in self))


def agree_count_tensors(draft_tokens: torch.Tensor, lookup_tokens: torch.Tensor,
                        lookup_valid: torch.Tensor) -> torch.Tensor:
    """[B] int32: leading positions where drafter == lookup, over min(draft width, valid) positions.

    `hqlab.rules.fusion.agree_count` per row. Lookup entries from `valid` on are padding and never agree, even
    when they happen to equal the drafter's token.
    """
    width = draft_tokens.shape[1]
    positions = torch.arange(width, device=draft_tokens.device)
    same = (draft_tokens == lookup_tokens[:, :width]) & (positions < lookup_valid[:, None])
    # a position counts only if no mismatch came before it (or at it)
    return ((~same).cumsum(dim=1) == 0).sum(dim=1, dtype=torch.int32)


def _check_fuse_inputs(draft_tokens: torch.Tensor, lookup_tokens: torch.Tensor, lookup_valid: torch.Tensor,
                       match_len: torch.Tensor, config: FusionConfig, out: FusedTensors | None) -> None:
    """`fuse_tensors`' shape checks (shapes are host-known: no device value is read)."""
    batch, k = lookup_tokens.shape
    head_len = min(config.draft_block, k)
    if draft_tokens.dim() != 2 or tuple(draft_tokens.shape) != (batch, head_len):
        raise ValueError(f"draft_tokens must be [B, min(draft_block, k)] = [{batch}, {head_len}], "
                         f"got {tuple(draft_tokens.shape)}")
    if tuple(lookup_valid.shape) != (batch,) or tuple(match_len.shape) != (batch,):
        raise ValueError(f"lookup_valid and match_len must be [B] = [{batch}], got {tuple(lookup_valid.shape)} "
                         f"and {tuple(match_len.shape)}")
    if config.rule not in ("threshold", "score"):  # FusionConfig refuses others; a new rule must be added here
        raise NotImplementedError(f"fuse_tensors implements the 'threshold' and 'score' rules, not {config.rule!r}")
    if out is not None and (out.tokens.shape[0] < batch or out.tokens.shape[1] != k):
        raise ValueError(f"out holds [{out.tokens.shape[0]}, {out.tokens.shape[1]}] blocks, need at least "
                         f"[{batch}, {k}]")


def _decide(config: FusionConfig, match_len: torch.Tensor, valid: torch.Tensor, agreed: torch.Tensor,
            dv: torch.Tensor, head_len: int, supplied: torch.Tensor, in_head: torch.Tensor,
            lookup_score: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """`fuse_tensors`' decisions per row: (head taken, tail taken, the fused block's length, [B, k] the positions
    holding a lookup token before the block is cut)."""
    if config.rule == "threshold":
        head_taken = (match_len >= config.nstrong) | ((match_len >= config.nmin) & (agreed >= config.agree))
        if config.nmin_alone > 0:  # a step without any drafter token
            head_taken = head_taken | ((dv == 0) & (match_len >= config.nmin_alone))
        tail_taken = (match_len >= config.nmin_tail) & (head_taken | (agreed == head_len))
        n_proposed = torch.where(tail_taken, valid.clamp(min=head_len), head_len)
        # the head ends where nobody filled it (after the lookup's or the drafter's tokens, whichever is longer)
        filled = torch.where(head_taken, torch.maximum(valid.clamp(max=head_len), dv), dv)
        n_proposed = torch.where(filled < head_len, filled, n_proposed)
        lookup_at = supplied & torch.where(in_head, head_taken[:, None], tail_taken[:, None])
    else:  # Arctic's score rule: the lookup's whole draft or the drafter's, nothing mixed
        score = valid if lookup_score is None else lookup_score
        keep_lookup = score >= head_len
        head_taken = tail_taken = keep_lookup
        n_proposed = torch.where(keep_lookup, valid, dv)
        lookup_at = supplied & keep_lookup[:, None]
    return head_taken, tail_taken, n_proposed, lookup_at


def fuse_tensors(
    draft_tokens: torch.Tensor,
    lookup_tokens: torch.Tensor,
    lookup_valid: torch.Tensor,
    match_len: torch.Tensor,
    config: FusionConfig,
    lookup_score: torch.Tensor | None = None,
    *,
    pad_token: int = -1,
    out: FusedTensors | None = None,
    draft_valid: torch.Tensor | None = None,
) -> FusedTensors:
    """`hqlab.rules.fusion.fuse` for every request of a batch.

    draft_tokens:  [B, min(draft_block, k)] int64, the drafter's head.
    lookup_tokens: [B, k] int64, entries from each row's valid on are padding; k is the long block.
    lookup_valid:  [B] int, real lookup tokens per row, 0 <= valid <= k.
    match_len:     [B] int, the lookup's match length (0 = no match), >= 0.
    lookup_score:  [B] float, only read by rule="score"; None means `valid` (as in the reference).
    pad_token:     token id written where nobody proposed.
    out:           buffers from `FusedTensors.allocate` with at least B rows and k columns; the result is then
                   views of their first B rows.
    draft_valid:   [B] int, head positions the drafter supplied per row (0 = a step that skipped the drafter);
                   None: the whole head, as in the reference.
    """
    _check_fuse_inputs(draft_tokens, lookup_tokens, lookup_valid, match_len, config, out)
    batch, k = lookup_tokens.shape
    head_len = min(config.draft_block, k)
    valid = lookup_valid
    positions = torch.arange(k, device=lookup_tokens.device)
    in_head = positions < head_len  # [k]
    supplied = positions < valid[:, None]  # [B, k]: only these positions may hold a lookup token
    agreed = agree_count_tensors(draft_tokens, lookup_tokens, valid)
    dv = torch.full_like(valid, head_len) if draft_valid is None else draft_valid.to(valid.dtype)
    agreed = torch.minimum(agreed, dv)  # only positions the drafter supplied can agree

    head_taken, tail_taken, n_proposed, lookup_at = _decide(config, match_len, valid, agreed, dv, head_len,
                                                            supplied, in_head, lookup_score)
    take_flag = (match_len >= config.longmin) & (valid > config.draft_block) & tail_taken

    proposed = positions < n_proposed[:, None]
    lookup_at = lookup_at & proposed
    draft_at = proposed & in_head & ~lookup_at & (positions < dv[:, None])
    draft_wide = torch.nn.functional.pad(draft_tokens, (0, k - head_len), value=pad_token)
    tokens = torch.where(lookup_at, lookup_tokens, torch.where(draft_at, draft_wide, pad_token))
    sources = torch.full((batch, k), SOURCE_NONE, dtype=torch.int8, device=lookup_tokens.device)
    sources.masked_fill_(draft_at, SOURCE_DRAFT).masked_fill_(lookup_at, SOURCE_LOOKUP)

    result = FusedTensors(tokens, sources, n_proposed.to(torch.int32), take_flag, head_taken, tail_taken)
    if out is None:
        return result
    target = out.rows(batch)
    for dst, src in zip(target, result):
        dst.copy_(src)
    return target


# Scheduling --------------------------------------------------------------------------------------------------


Rows = torch.Tensor | Sequence[int]


@dataclass
class ScheduleTensors:
    """`hqlab.rules.schedule.ScheduleState` for a batch: one entry per request (or per request slot).

    run:     [B] int32, consecutive qualifying flags read by the decisions so far.
    hold:    [B] int32, the sticky counter (meaningful while long; 0 when short).
    long:    [B] bool, whether the last decision was the long block.
    pending: [B] bool, stale = 1 only: the flag computed at the last step, which the next step reads.
    """

    run: torch.Tensor
    hold: torch.Tensor
    long: torch.Tensor
    pending: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, device: torch.device | str) -> "ScheduleTensors":
        """`max_batch` fresh states (the state before a request's first step) on `device`."""
        return cls(torch.zeros(max_batch, dtype=torch.int32, device=device),
                   torch.zeros(max_batch, dtype=torch.int32, device=device),
                   torch.zeros(max_batch, dtype=torch.bool, device=device),
                   torch.zeros(max_batch, dtype=torch.bool, device=device))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return self.run, self.hold, self.long, self.pending

    def reset(self, rows: Rows) -> None:
        """Back to the fresh state for the given slots (a reused slot holds a new request): a [B] bool mask or
        indices. Indices given as a Python sequence are copied to the device first; that happens when requests are
        admitted, outside the decode step, and a device tensor avoids it."""
        if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
            for field in self._fields():
                field.masked_fill_(rows, 0)
            return
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.run.device)
        for field in self._fields():
            field.index_fill_(0, index, 0)

    def select(self, rows: torch.Tensor) -> "ScheduleTensors":
        """The states of the slots `rows` ([n] int64 on the device), as a batch in that order (a copy)."""
        return ScheduleTensors(*(field.index_select(0, rows) for field in self._fields()))

    def assign(self, rows: torch.Tensor, state: "ScheduleTensors") -> None:
        """Write a batch's states back to the slots `rows` (distinct slots)."""
        for field, value in zip(self._fields(), state._fields()):
            field.index_copy_(0, rows, value)

    def copy_(self, state: "ScheduleTensors") -> None:
        """Overwrite every entry in place (keeps the buffers a captured graph reads)."""
        for field, value in zip(self._fields(), state._fields()):
            field.copy_(value)


def qualify_tensors(take_flag: torch.Tensor, emitted_last: torch.Tensor, config: ScheduleConfig) -> torch.Tensor:
    """[B] bool: take_flag and the previous step emitted at least short + 1 tokens (`hqlab.rules.schedule.qualify`)."""
    return take_flag & (emitted_last >= 1 + config.short)


def _advance(state: ScheduleTensors, take_flag: torch.Tensor, emitted_last: torch.Tensor, config: ScheduleConfig,
             sticky: int | torch.Tensor) -> tuple[ScheduleTensors, torch.Tensor]:
    """The adaptive machine of `hqlab.rules.schedule.step` for every row; `sticky` may be a 0-d device tensor."""
    q_now = qualify_tensors(take_flag, emitted_last, config)
    if config.stale:  # decide on the flag computed one step earlier, keep this one for the next step
        q, pending = state.pending, q_now
    else:
        q, pending = q_now, torch.zeros_like(state.pending)
    run = torch.where(q, state.run + 1, 0)

    confirmed = state.long & q  # stay long, full grace window again
    held = state.long & ~q & (state.hold > 0)  # sticky hold, independent of qualify
    left = state.long & ~q & (state.hold == 0)  # window spent: short, and re-entry needs fresh qualifying steps
    entered = ~state.long & (run >= config.entry_steps)

    long = confirmed | held | entered
    hold = torch.where(confirmed | entered, sticky, torch.where(held, state.hold - 1, 0)).to(torch.int32)
    run = torch.where(left, 0, run).to(torch.int32)
    block_len = torch.where(long, config.long, config.short).to(torch.int32)
    return ScheduleTensors(run, hold, long, pending), block_len


def _keep_inactive(old: ScheduleTensors, new: ScheduleTensors, block_len: torch.Tensor,
                   active: torch.Tensor | None) -> tuple[ScheduleTensors, torch.Tensor]:
    """Rows outside the batch (padding of a captured batch size) keep their state and verify nothing (0)."""
    if active is None:
        return new, block_len
    kept = ScheduleTensors(*(torch.where(active, n, o) for n, o in zip(new._fields(), old._fields())))
    return kept, torch.where(active, block_len, 0)


def schedule_step_tensors(
    state: ScheduleTensors,
    take_flag: torch.Tensor,
    emitted_last: torch.Tensor,
    config: ScheduleConfig,
    active: torch.Tensor | None = None,
) -> tuple[ScheduleTensors, torch.Tensor]:
    """`hqlab.rules.schedule.step` for every request of a batch, each on its own (per-request block lengths).

    state:        the batch's states, [B] each (see `ScheduleTensors.select` for slot-indexed state).
    take_flag:    [B] bool, this step's take flags (from `fuse_tensors` with the long k).
    emitted_last: [B] int, tokens each request emitted in its previous step (0 before its first), >= 0.
    active:       optional [B] bool; rows outside it keep their state and get block length 0.
    Returns the new states (new tensors; `state` is not modified) and the block lengths, [B] int32.
    """
    if config.mode != "adaptive":  # fixed block for comparison: the state does not move
        fixed = config.short if config.mode == "short" else config.long
        block_len = torch.full(take_flag.shape, fixed, dtype=torch.int32, device=take_flag.device)
        return _keep_inactive(state, state, block_len, active)
    new, block_len = _advance(state, take_flag, emitted_last, config, config.sticky)
    return _keep_inactive(state, new, block_len, active)


def unanimous_block_len_tensors(block_len: torch.Tensor, config: ScheduleConfig,
                                active: torch.Tensor | None = None) -> torch.Tensor:
    """0-d int32: `long` if every active request wants it, else `short` (`unanimous_block_len`).

    With no active request (the reference raises) the answer is `short`.
    """
    wants_long = block_len == config.long
    if active is None:
        everyone = wants_long.all() & (block_len.numel() > 0)
    else:
        everyone = (wants_long | ~active).all() & active.any()
    return torch.where(everyone, config.long, config.short).to(torch.int32)


def step_unanimous_tensors(state: ScheduleTensors, take_flag: torch.Tensor, emitted_last: torch.Tensor,
                           config: ScheduleConfig,
                           active: torch.Tensor | None = None) -> tuple[ScheduleTensors, torch.Tensor]:
    """`hqlab.rules.schedule.step_unanimous`: HyperQwen's batch mode, one block length for the whole batch.

    Each request runs its own machine, with sticky only when the batch is one request (counted on the device from
    `active`, so a padded captured batch counts its real requests). Returns the new states and [B] int32 block
    lengths: the batch's length for active rows, 0 for the others.
    """
    if config.mode != "adaptive":
        return schedule_step_tensors(state, take_flag, emitted_last, config, active)
    in_batch = torch.ones_like(take_flag) if active is None else active
    alone = in_batch.sum() == 1
    sticky = torch.where(alone, config.sticky, 0).to(torch.int32)  # 0-d: no host read of the batch size
    new, wanted = _advance(state, take_flag, emitted_last, config, sticky)
    batch_len = unanimous_block_len_tensors(wanted, config, in_batch)
    return _keep_inactive(state, new, batch_len.expand_as(wanted), in_batch)


__all__ = ["FusedTensors", "ScheduleTensors", "SOURCE_NONE", "agree_count_tensors", "fuse_tensors",
           "qualify_tensors", "schedule_step_tensors", "step_unanimous_tensors", "unanimous_block_len_tensors"]

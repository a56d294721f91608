"""What of the drafter one fused drafting step runs, decided on the device: the flags its conditional nodes read.

`gpu_fused`'s drafter keeps its own KV cache and reads a request's tokens only at a step that needs its token. A step
does not need it where the lookup alone decides every sampling row's block (`device_skip`: with one drafter token a
step and the threshold rule, a match of at least nstrong with a token to propose makes the block the lookup's
whatever the drafter says), nor where the next step verifies nothing (width 0, `batch_k`'s or goodput's: the host
knows it before the step and launches none of it). Either way the drafter falls behind; the next step that needs it
first reads what it missed, in a loop of wide passes while a row lags more than one wide pass feeds, then one narrow
(k + 1 positions) or wide pass that also yields its token.

The flags sit in one int32 device buffer, so that the step's CUDA graph branches on them without a host read
(`conditional.run_if`, `run_while`); `DrafterFlags` names its entries. The three functions compute all of them at
the step's three decision points (before the loop, after each loop pass, before the last pass); they are plain
tensor arithmetic, compiled with the fusion rule under `compile_rule`, and tested against their definition in plain
Python (tests/engines/vllm/test_vllm_gpu_fused.py).
"""

from __future__ import annotations

import torch

# the entries of the flags buffer, in order: what runs (an IF node around the drafter, a WHILE node for the loop, IF
# nodes for the last pass) and what ran (the last pass's width, 0 for none, and the passes, for the step records)
NAMES = ("need", "loop", "narrow", "wide", "ran_width", "ran_passes")
NEED, LOOP, NARROW, WIDE, RAN_WIDTH, RAN_PASSES = range(len(NAMES))
WIDE_STEPS = 8  # a wide pass feeds this many steps' tokens at most: 8 x (k + 1) positions


class DrafterFlags:
    """One step's flags: `buffer`, [len(NAMES)] int32 on the device, and a one-element view of it per name (what a
    conditional node takes)."""

    def __init__(self, device: torch.device) -> None:
        self.buffer = torch.zeros(len(NAMES), dtype=torch.int32, device=device)
        self.need, self.loop, self.narrow, self.wide, self.ran_width, self.ran_passes = (
            self.buffer[i:i + 1] for i in range(len(NAMES)))


def lags(total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor, num_sampled: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens its request emitted that its drafter has not read (0 for a row that does not sample)."""
    return torch.where(num_sampled > 0, total_len[slots].long() - dlen[slots], 0)


def _pack(need: torch.Tensor, loop: torch.Tensor, narrow: torch.Tensor, wide: torch.Tensor, ran_width: torch.Tensor,
          ran_passes: torch.Tensor) -> torch.Tensor:
    return torch.stack([need, loop, narrow, wide, ran_width, ran_passes]).to(torch.int32)


def at_start(total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor, num_sampled: torch.Tensor,
             match_len: torch.Tensor, valid: torch.Tensor, nstrong: int, lookup_decides: bool,
             wide_width: int) -> torch.Tensor:
    """The flags before the drafter: it is needed unless no row samples or, with `lookup_decides` (`device_skip`),
    every sampling row's block is the lookup's whatever the drafter says (a match of at least nstrong with a token
    to propose); where needed, loop wide passes first while a row lags more than one wide pass feeds."""
    lag = lags(total_len, dlen, slots, num_sampled)
    decided = (match_len >= nstrong) & (valid >= 1) if lookup_decides else torch.zeros_like(num_sampled > 0)
    need = ~((num_sampled <= 0) | decided).all()
    loop = need & (lag.max() > wide_width)
    zero = torch.zeros_like(need)
    return _pack(need, loop, zero, zero, zero, zero)


def after_loop_pass(flags: torch.Tensor, total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor,
                    num_sampled: torch.Tensor, wide_width: int) -> torch.Tensor:
    """The flags after one wide pass of the loop: loop again while a row still lags more than a wide pass feeds."""
    loop = (lags(total_len, dlen, slots, num_sampled).max() > wide_width).to(torch.int32)
    return _pack(flags[NEED], loop, flags[NARROW], flags[WIDE], flags[RAN_WIDTH], flags[RAN_PASSES] + 1)


def before_last_pass(flags: torch.Tensor, total_len: torch.Tensor, dlen: torch.Tensor, slots: torch.Tensor,
                     num_sampled: torch.Tensor, narrow_width: int, wide_width: int, head_passes: int) -> torch.Tensor:
    """The flags for the step's last pass, after the loop: narrow if every row lags at most `narrow_width`, else
    wide, and only where the step needs the drafter; that pass and the head's further `head_passes - 1` passes
    count as run."""
    need = flags[NEED]
    narrow = need * (lags(total_len, dlen, slots, num_sampled).max() <= narrow_width).to(torch.int32)
    wide = need - narrow
    return _pack(need, flags[LOOP], narrow, wide, narrow * narrow_width + wide * wide_width,
                 flags[RAN_PASSES] + need * head_passes)


__all__ = ["NAMES", "NEED", "LOOP", "NARROW", "WIDE", "RAN_WIDTH", "RAN_PASSES", "WIDE_STEPS", "DrafterFlags", "lags",
           "at_start", "after_loop_pass", "before_last_pass"]

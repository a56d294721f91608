"""Adaptive long verify block with two-step entry and sticky exit: the one reference of SPEC §2.5.

One state machine per request, written as a pure function. The engine calls `step` once per request per verify
step, before verifying, with the request's take flag for this step (from `hqlab.rules.fusion.fuse`, computed with
the long k so the tail is visible) and the number of tokens it emitted in its previous step (accepted + 1; 0
before the first step). `step` returns the new state and the block length to verify now: `short` (the drafter's
width, draft_block) or `long` (k, e.g. 15, so 16 verified).

Rules (mode "adaptive"), with q the qualify flag the decision reads:

- qualify = take_flag and emitted_last_step >= 1 + short: the lookup has something for the tail and the previous
  step was saturated (every short-block position accepted).
- entry: from the short block, go long at the step where the `entry_steps` (default 2) most recent flags read all
  qualified. One saturated step happens in ordinary prose; two in a row is a copy. So flags T, T give blocks
  short, long: the second qualifying step already verifies the long block.
- sticky exit: on entry a counter is set to `sticky` (default 3). While long:
    * q true: stay long and **refresh the counter to `sticky`** (hqlab's interpretation, see below);
    * q false and counter > 0: stay long and decrement the counter; this hold does not look at qualify at all
      (SPEC: "Gating the hold on 'still saturated' removed the whole effect");
    * q false and counter == 0: leave the long block (this step is short); the counter and the run of
      qualifying flags reset, so re-entry needs `entry_steps` fresh qualifying steps.
  Net effect: once entered, the block stays long until `sticky + 1` consecutive non-qualifying steps; the
  (sticky + 1)-th is the first short one. sticky = 0 leaves at the first non-qualifying step.
- staleness (`stale` = 1): the decision at step t reads the flag computed at step t - 1 (HyperQwen copies the flag
  device -> host asynchronously and reads it a step late). The state carries the computed-but-unread flag in
  `pending`; the first step reads False. Every decision is the stale = 0 decision shifted one step later.

Interpretation of the counter while qualify stays true. SPEC §2.5 says "on entry a counter is set to `sticky`;
while it is > 0 the long block is kept even if qualify drops, decrementing each step; it resets when the long block
is left", and motivates it with "Flags drop out for reasons unrelated to the copy ending (an unmatched line, a late
flag)" measured on a 25k-token copy. Read literally (set only at entry, decremented every step), the counter would
be spent after the first `sticky` steps of a copy and a drop in the middle of a long copy would exit at once,
which is not what the measurement is about. hqlab therefore treats every qualifying step in the long block as
confirming the copy: the counter is back at `sticky`, and it only counts down over non-qualifying steps.

Modes "short" and "long" are fixed blocks for comparison: `step` returns that length and the state unchanged.

HyperQwen's batch mode is `step_unanimous`: every request runs its own machine, with sticky only at batch size 1
(sticky is forced to 0 otherwise), and the whole batch verifies the long block only if every request wants it.
With sticky 0 a request wants long exactly when its last `entry_steps` flags qualified, so this equals one
batch-wide machine fed with the conjunction of the flags.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from hqlab.config import require

MODES = ("short", "long", "adaptive")


@dataclass(frozen=True)
class ScheduleConfig:
    """Block-length scheduling, SPEC §2.5.

    mode:        "adaptive" (the state machine), or "short" / "long" for a fixed block.
    short:       block length when not copying (= the drafter's draft_block).
    long:        block length while a copy is in progress (= the lookup's k).
    sticky:      non-qualifying steps the long block survives before it is left (0 = leave at once).
    entry_steps: consecutive qualifying steps needed to enter the long block.
    stale:       0 = read the qualify flag of this step, 1 = read the previous step's (HyperQwen).
    """

    mode: str = "adaptive"
    short: int = 7
    long: int = 15
    sticky: int = 3
    entry_steps: int = 2
    stale: int = 0

    def __post_init__(self) -> None:
        require(self.short >= 1, f"short must be >= 1 (got {self.short})")
        require(self.long >= self.short, f"long must be >= short (got short={self.short}, long={self.long})")
        require(self.sticky >= 0, f"sticky must be >= 0, 0 meaning no hold (got {self.sticky})")
        require(self.entry_steps >= 1, f"entry_steps must be >= 1 (got {self.entry_steps})")
        require(self.stale in (0, 1), f"stale must be 0 (read the flag now) or 1 (one step late), got {self.stale}")
        require(self.mode in MODES, f"mode must be one of {', '.join(MODES)} (got {self.mode!r})")


@dataclass(frozen=True)
class ScheduleState:
    """One request's scheduler state; `ScheduleState()` is the state before its first step.

    run:     consecutive qualifying flags read by the decisions so far (0 after a non-qualifying one).
    hold:    the sticky counter (meaningful while long; 0 when short).
    long:    whether the last decision was the long block.
    pending: stale = 1 only: the flag computed at the last step, which the next step reads.
    """

    run: int = 0
    hold: int = 0
    long: bool = False
    pending: bool = False

    def __post_init__(self) -> None:
        if self.run < 0 or self.hold < 0:
            raise ValueError(f"run and hold must be >= 0 (got run={self.run}, hold={self.hold})")


def qualify(take_flag: bool, emitted_last_step: int, config: ScheduleConfig) -> bool:
    """take_flag and the previous step emitted at least short + 1 tokens (saturated)."""
    if emitted_last_step < 0:
        raise ValueError(f"emitted_last_step must be >= 0 (got {emitted_last_step})")
    return bool(take_flag) and emitted_last_step >= 1 + config.short


def step(
    state: ScheduleState, take_flag: bool, emitted_last_step: int, config: ScheduleConfig
) -> tuple[ScheduleState, int]:
    """Advance one request by one verify step; returns (new state, block length to verify now)."""
    q_now = qualify(take_flag, emitted_last_step, config)
    if config.mode == "short":
        return state, config.short
    if config.mode == "long":
        return state, config.long

    if config.stale:
        q, pending = state.pending, q_now
    else:
        q, pending = q_now, False
    run = state.run + 1 if q else 0

    if state.long:
        if q:  # the copy is confirmed: stay, with a full grace window for the next drop
            long, hold = True, config.sticky
        elif state.hold > 0:  # sticky hold, independent of qualify
            long, hold = True, state.hold - 1
        else:  # window spent: leave; re-entry needs entry_steps fresh qualifying steps
            long, hold, run = False, 0, 0
    elif run >= config.entry_steps:
        long, hold = True, config.sticky
    else:
        long, hold = False, 0

    new = ScheduleState(run=run, hold=hold, long=long, pending=pending)
    return new, config.long if long else config.short


def simulate(
    steps: Iterable[tuple[bool, int]], config: ScheduleConfig, state: ScheduleState | None = None
) -> list[int]:
    """Block lengths for a sequence of (take_flag, emitted_last_step), starting from `state` (default fresh)."""
    s = ScheduleState() if state is None else state
    out: list[int] = []
    for take_flag, emitted in steps:
        s, block = step(s, take_flag, emitted, config)
        out.append(block)
    return out


def unanimous_block_len(block_lens: Sequence[int], config: ScheduleConfig) -> int:
    """HyperQwen's batch reduction: the long block only if every request wants it (and there is one)."""
    if len(block_lens) == 0:
        raise ValueError("unanimous_block_len needs at least one request")
    return config.long if all(b == config.long for b in block_lens) else config.short


def step_unanimous(
    states: Sequence[ScheduleState],
    take_flags: Sequence[bool],
    emitted_last_steps: Sequence[int],
    config: ScheduleConfig,
) -> tuple[list[ScheduleState], int]:
    """HyperQwen's batch mode: per-request machines (sticky only at batch size 1), one unanimous block length.

    Returns each request's new state and the block length the whole batch verifies.
    """
    n = len(states)
    if n == 0 or len(take_flags) != n or len(emitted_last_steps) != n:
        raise ValueError("step_unanimous needs one state, take flag and emitted count per request (at least one)")
    cfg = config if n == 1 else replace(config, sticky=0)
    new_states: list[ScheduleState] = []
    wanted: list[int] = []
    for s, t, e in zip(states, take_flags, emitted_last_steps):
        ns, b = step(s, t, e, cfg)
        new_states.append(ns)
        wanted.append(b)
    return new_states, unanimous_block_len(wanted, config)


__all__ = ["ScheduleConfig", "ScheduleState", "qualify", "step", "simulate", "unanimous_block_len",
           "step_unanimous", "MODES"]

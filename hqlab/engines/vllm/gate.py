"""The speculation gate inside vLLM's scheduler: each step verifies the lookup's drafts only when the lookup has
something worth verifying (`hqlab.rules.gate`, the rule; `gpu-lookup:...,gate=G`, the knob).

Where it acts. vLLM 0.26's scheduler fixes, at every `schedule()`, how many draft positions the requests will
verify at their next step (`num_spec_tokens_to_schedule`, looked up by batch size in `dynamic_sd_lookup` when a
`num_speculative_tokens_per_batch_size` schedule is set; asynchronous scheduling turns it into the placeholders the
next step verifies). `SchedulerGate.before_schedule` runs just before each `schedule()` and points
`dynamic_sd_lookup` at the speculator's own table when the gate is open, or at a table of zeros when it is closed.
Everything else is vLLM's: a width of 0 is the same plain step `batch_k` gives under load, with the full CUDA
graph vLLM captured for it (the spec's schedule always has a width-0 range: `batch_k.with_plain_steps`).

What it reads. Each running request's `all_token_ids` (prompt and the outputs the scheduler has processed), fed
to one `SuffixGate` per request, and the prompts of the waiting requests that the step may admit (as many as there
are free slots, first in queue order): a request's first steps are fixed before any of its output is known, so
its prompt decides them. A request's gate is dropped when vLLM frees it. Nothing is read from the GPU.
The host's view is three steps old under asynchronous scheduling (`hqlab.rules.gate.ASYNC_BEHIND`): the replay
(`hqlab.replay.gate`) reproduces that lag, and tests/engines/vllm/test_vllm_gate.py drives vLLM's own scheduler
to check the widths it fixes against the replay's, step for step.

The drafts are unchanged: the GPU speculator drafts every step from the full current history, and a step the gate
closed verifies none of them. Counters (`open_steps`, `closed_steps`) are plain integers on the gate.

Nothing here imports vLLM; the plugin (`plugin._patch_scheduler`) calls it.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from hqlab.rules.gate import SuffixGate, batch_width


class SchedulerGate:
    """The gate for one vLLM scheduler: per-request suffix gates and the two tables it switches between."""

    def __init__(self, min_match: int, table: list[int]) -> None:
        self.min_match = min_match
        self.table = list(table)  # the width per batch size vLLM would use (its dynamic_sd_lookup)
        self.zeros = [0] * len(self.table)
        self.states: dict[str, SuffixGate] = {}
        self.open_steps = 0
        self.closed_steps = 0

    def is_open(self, running: list[Any]) -> bool:
        """Bring each running request's gate up to date with its history; whether any is open."""
        opens = []
        for request in running:
            state = self.states.get(request.request_id)
            if state is None:
                state = self.states[request.request_id] = SuffixGate(self.min_match)
            history = request.all_token_ids
            if len(history) < state.length:  # vLLM rewound it (preemption with a reset): start over
                state = self.states[request.request_id] = SuffixGate(self.min_match)
            opens.append(state.catch_up(history))
        return batch_width(opens, 1) > 0

    def before_schedule(self, scheduler: Any) -> None:
        """Set the scheduler's width table for the `schedule()` about to run: open when a running request, or a
        waiting one this step may admit, is open."""
        running = list(scheduler.running)
        free = max(0, int(scheduler.max_num_running_reqs) - len(running))
        if self.is_open(running + list(islice(scheduler.waiting, free))):
            scheduler.dynamic_sd_lookup = self.table
            self.open_steps += 1
        else:
            scheduler.dynamic_sd_lookup = self.zeros
            self.closed_steps += 1

    def after_schedule(self, scheduler_output: Any) -> None:
        """Nothing: the gate keeps no state per step (the goodput hook, `goodput.SchedulerGoodput`, does)."""

    def observe(self, scheduler: Any, scheduler_output: Any, runner_output: Any) -> None:
        """Nothing: the gate learns nothing from outcomes (the goodput hook does)."""

    def forget(self, request_id: str) -> None:
        """vLLM frees the request: drop its gate."""
        self.states.pop(request_id, None)

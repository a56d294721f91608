"""How many draft positions a step verifies, by how many requests it runs: `batch_k=4:15/16:3/0`.

Speculation pays at batch 1, where a decode step is bound by fixed costs and a wide verify is nearly free, and stops
paying as the batch grows: every request of a step verifies the same k + 1 positions (vLLM 0.26's scheduler reserves
them before the drafts exist), so at 32 requests a k = 15 step processes 512 positions for ~1.2 accepted tokens a
request on prose. vLLM 0.26 has the mechanism to narrow the width with the load: `num_speculative_tokens_per_batch_size`
(its "dynamic speculative decoding"), a list of (first batch size, last batch size, k) that its scheduler looks up at
every step, with a full CUDA graph captured for each width on the V2 runner. This module is hqlab's face of it:

    batch_k=4:15/16:3/0   -> up to 4 requests verify 15 drafts, 5-16 requests 3, more than 16 none

Each `B:K` entry covers the batch sizes up to B; the last entry has no bound and covers the rest. K = 0 turns
speculation off for that load: the step is a plain decode step, and hqlab's speculators skip their drafting work too
(`next_k` tells them what the scheduler will look up). The table is vLLM's own (`vllm_schedule` builds its list);
`dense` mirrors vLLM's `build_dynamic_sd_schedule_lookup`, tested equal to it. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from hqlab.config import ConfigError

KEY = "batch_k"  # the spec key of gpu-lookup and gpu-fused
MAX_BATCH = 1 << 16  # the open-ended last range ends here (vLLM clips it to max_num_seqs)


def parse(value: str, k: int) -> list[tuple[int, int]]:
    """`"4:15/16:3/0"` -> [(4, 15), (16, 3), (MAX_BATCH, 0)]: (largest batch size, k) per range, validated against
    the speculator's k (no range may verify more than k positions, since vLLM sizes its buffers for k)."""
    where = f"{KEY}={value!r}"
    if not value:
        raise ConfigError(f"{where}: empty; write e.g. {KEY}=4:15/16:3/0 (up to 4 requests k=15, up to 16 k=3, "
                          f"then 0)")
    out: list[tuple[int, int]] = []
    items = value.split("/")
    for i, item in enumerate(items):
        last = i == len(items) - 1
        bound, sep, width = item.partition(":")
        if not sep:
            if not last:
                raise ConfigError(f"{where}: {item!r} needs a batch bound (B:K); only the last entry may be a bare K")
            bound, width = str(MAX_BATCH), bound
        try:
            b, w = int(bound), int(width)
        except ValueError:
            raise ConfigError(f"{where}: {item!r} is not B:K with integers") from None
        if b < 1:
            raise ConfigError(f"{where}: batch bound {b} must be >= 1")
        if not 0 <= w <= k:
            raise ConfigError(f"{where}: width {w} must be in [0, k={k}] (vLLM reserves k draft positions at most)")
        if out and b <= out[-1][0]:
            raise ConfigError(f"{where}: batch bounds must increase ({out[-1][0]} then {b})")
        out.append((b, w))
    return out


def vllm_schedule(entries: list[tuple[int, int]]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: inclusive (first, last, k) ranges starting at batch 1."""
    out, first = [], 1
    for bound, width in entries:
        out.append([first, bound, width])
        first = bound + 1
    return out


def dense(entries: list[tuple[int, int]], max_batch: int, k: int) -> list[int]:
    """The width per batch size, index = batch size (index 0 unused), as vLLM's scheduler looks it up."""
    table = [0] * (max_batch + 1)
    for b in range(1, max_batch + 1):  # past the last bound the last width carries on, as in vLLM
        table[b] = min(k, next((w for bound, w in entries if b <= bound), entries[-1][1]))
    return table


def next_k(table: list[int] | None, batch: int, k: int) -> int:
    """The width the scheduler will give a step of `batch` requests (k without a schedule). A speculator asks this
    with its current batch: the next step's batch is known only to the scheduler, so this is a forecast that is
    wrong only when requests arrive or finish; a wrong forecast costs drafts verified or drafts unused, never
    output (the target decides every token)."""
    if table is None or batch <= 0:
        return k
    return table[min(batch, len(table) - 1)]


def with_plain_steps(entries: list[tuple[int, int]] | None, k: int) -> list[tuple[int, int]]:
    """`entries` (None: k at every load) with a width-0 range, so that vLLM captures full CUDA graphs for plain
    steps too: the speculation gate (`hqlab.rules.gate`) makes some steps verify nothing at any batch size, and the
    V2 runner captures a uniform-decode graph only for the widths its schedule names. A schedule that already
    reaches 0 is returned as is; otherwise the open-ended last range stops one short of MAX_BATCH and a range of
    width 0 takes MAX_BATCH alone, a batch size vLLM never runs (it clips the table to max_num_seqs)."""
    entries = list(entries) if entries else [(MAX_BATCH, k)]
    if any(w == 0 for _, w in entries):
        return entries
    if entries[-1][0] == MAX_BATCH:
        entries[-1] = (MAX_BATCH - 1, entries[-1][1])
    return entries + [(MAX_BATCH, 0)]


def with_schedule(speculative: dict[str, Any], value: str, k: int, *, plain_steps: bool = False) -> dict[str, Any]:
    """`speculative` plus vLLM's `num_speculative_tokens_per_batch_size` for a `batch_k` value ("" = none), with a
    width-0 range when `plain_steps` (the gate's steps that verify nothing: `with_plain_steps`)."""
    entries = parse(value, k) if value else None
    if plain_steps:
        entries = with_plain_steps(entries, k)
    if entries:
        speculative["num_speculative_tokens_per_batch_size"] = vllm_schedule(entries)
    return speculative


def table_for(vllm_config: Any, value: str, k: int, *, plain_steps: bool = False) -> list[int] | None:
    """The width per batch size vLLM's scheduler will use (None: always k), checked against the spec's `batch_k`:
    a speculator that skips its drafting where the spec says 0 while vLLM still verifies k would waste every
    such step, so the two must agree (gpu_lookup's and gpu_fused's `speculative_config(spec)` make them agree)."""
    spec_config = vllm_config.speculative_config
    theirs = getattr(spec_config, "num_speculative_tokens_per_batch_size", None)
    ours = with_schedule({}, value, k, plain_steps=plain_steps).get("num_speculative_tokens_per_batch_size")
    if ours is not None and [list(map(int, r)) for r in (theirs or [])] != ours:
        raise ConfigError(f"batch_k={value!r} asks vLLM for num_speculative_tokens_per_batch_size={ours}, but vLLM "
                          f"has {theirs}: build the speculative config with speculative_config(spec)")
    if not theirs:
        return None
    entries = [(int(last), int(width)) for _, last, width in sorted(theirs)]
    return dense(entries, int(vllm_config.scheduler_config.max_num_seqs), k)


def force_width(table: list[int], width: int, k: int) -> None:
    """Benchmark only: make every batch size of a width table (vLLM's scheduler's `dynamic_sd_lookup`, or a
    speculator's `k_table`) verify `width` drafts, in place (both sides hold the list they were built with)."""
    if not 0 <= width <= k:
        raise ConfigError(f"a forced width must be in [0, k={k}] (got {width})")
    table[:] = [width] * len(table)

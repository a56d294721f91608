"""Teacher-forced drafting for replay: a model drafter's greedy drafts from ONE forward pass over a trace.

Under greedy decoding the drafter's first token from a history is its argmax after that history, and every later
draft token is the argmax after the history plus the earlier draft tokens. Over a recorded trace the true
continuation is known, so one forward pass of the drafter over prompt + output gives its argmax after every true
prefix: the draft from position t equals those argmaxes for as long as they agree with the trace, and the first
one that disagrees is exact too. Acceptance needs nothing more (nothing after a wrong token is ever accepted).

`forced` (from an engine's step records, `StepRecord.drafter_tokens`) gives, for the steps another run of the same
drafter drafted (vLLM's, in bf16 on a GPU), the tokens it drafted there, head first: a draft from such a step is
those tokens, all of them known (also past a disagreement with the trace, which this drafter could not know), so
the replay checks the rules against that run's own drafter. `flips` lists where the two drafters disagree after a
true prefix, with this drafter's margin (its top logit minus its logit of the forced token: small where the argmax
is a near tie).

Positions after that first disagreement are unknown; they are returned as UNKNOWN (-1) with
`extra["known"]` = the number of exact tokens. A rule that needs them (fusion compares drafter and lookup over
the head) asks `exact()` for a real draft: `FusedProposer` does so only when its decision could change, and
counts how often (`extra["draft_mode"]` is "teacher" or "real"). Greedy drafters only.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import numpy as np
import torch

from hqlab.config import ConfigError
from hqlab.proposers.base import Proposal
from hqlab.proposers.draft import DraftProposer
from hqlab.trace import Source

UNKNOWN = -1


class TeacherForcedDrafter:
    """A `hqlab.proposers.Drafter` over one trace: drafts exact up to `Proposal.known`, `exact` for the rest."""

    name: ClassVar[str] = "draft"

    def __init__(self, drafter: DraftProposer, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 chunk: int = 512, forced: Mapping[int, Sequence[int]] | None = None) -> None:
        if drafter.config.temperature > 0:
            raise ConfigError("teacher forcing reproduces greedy drafts only (drafter temperature must be 0)")
        self.drafter, self.config, self.k = drafter, drafter.config, drafter.k
        self.seq = np.asarray([*prompt_ids, *output_ids], dtype=np.int64)
        # the history length - 1 a step drafted from -> the tokens it drafted, head first
        self.forced = {int(t): [int(x) for x in block] for t, block in (forced or {}).items()}
        bad = [t for t in self.forced if not 0 <= t < len(self.seq)]
        if bad:
            raise ConfigError(f"forced drafter tokens after prefixes the trace does not have (positions {bad[:5]}; "
                              f"the trace has {len(self.seq)} tokens)")
        if self.forced and drafter.draft_to_target is not None:
            raise ConfigError("forced drafter tokens need the drafter's full vocabulary (no draft vocabulary)")
        self.flips: list[tuple[int, int, int, float]] = []  # (position, this drafter's token, forced, margin)
        self.guess = self._argmax_after_every_prefix(chunk)
        self.real_calls = 0

    @torch.inference_mode()
    def _argmax_after_every_prefix(self, chunk: int) -> np.ndarray:
        """guess[t] = the drafter's argmax after seq[: t + 1], in chunks over one growing KV cache."""
        from transformers import DynamicCache

        d = self.drafter
        cache = DynamicCache(config=d.model.config)
        compare = self._forced_after_true_prefixes()
        out = []
        for start in range(0, len(self.seq), chunk):
            ids = torch.tensor([self.seq[start : start + chunk].tolist()], device=d.device)
            hidden = d.body(input_ids=ids, use_cache=True, **{d._cache_kw: cache}).last_hidden_state[0]
            logits = torch.nn.functional.linear(hidden, d.head_weight)
            idx = logits.argmax(dim=-1)
            part = (d.draft_to_target[idx] if d.draft_to_target is not None else idx).cpu().numpy()
            for t in (t for t in compare if start <= t < start + len(part)):
                mine, row = int(part[t - start]), logits[t - start].float()
                for token in sorted(compare[t] - {mine}):
                    self.flips.append((t, mine, token, float(row[mine] - row[token])))
            out.append(part)
        return np.concatenate(out)

    def _forced_after_true_prefixes(self) -> dict[int, set[int]]:
        """Position t -> the forced tokens drafted after the true prefix seq[: t + 1] (a block's tokens up to and
        including its first that leaves the trace; later ones followed the other drafter's own tokens)."""
        compare: dict[int, set[int]] = {}
        for t, block in self.forced.items():
            for i, token in enumerate(block):
                compare.setdefault(t + i, set()).add(token)
                if t + i + 1 >= len(self.seq) or token != int(self.seq[t + i + 1]):
                    break
        return compare

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        out = []
        for h, budget in zip(histories, budgets):
            t = len(h)
            if t > len(self.seq) or int(h[-1]) != int(self.seq[t - 1]):
                raise ValueError("teacher forcing only replays prefixes of its own trace")
            n = max(0, min(self.k, int(budget)))
            tokens = np.full(n, UNKNOWN, dtype=np.int64)
            block = self.forced.get(t - 1, ())  # the other run's own tokens from this history, if it drafted here
            known, off = 0, False
            for i in range(n):
                if i < len(block):
                    g = block[i]
                elif off:
                    break  # past a disagreement nothing of this drafter's can be known
                else:
                    g = int(self.guess[t - 1 + i])
                tokens[i] = g
                known += 1
                off = off or t + i >= len(self.seq) or g != int(self.seq[t + i])
            out.append(Proposal(tokens, np.full(n, Source.DRAFT, dtype=np.int8), 0, None,
                                {"known": known, "draft_mode": "teacher"}))
        return out

    def exact(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
              keys: Sequence[str] | None = None) -> list[Proposal]:
        """Real drafts from the drafter model (for the rare decisions that read past the known part)."""
        self.real_calls += len(histories)
        props = self.drafter.propose(histories, budgets, keys)
        for p in props:
            p.extra.update({"known": p.valid, "draft_mode": "real"})
        return props


def replay_fused_grid(traces: Sequence, drafter: DraftProposer, specs: Sequence[str], *,
                      progress: bool = True, forced: Mapping[str, Mapping[int, Sequence[int]]] | None = None):
    """Replay every `fused:...` spec over every trace with teacher-forced drafts (one drafter pass per trace).

    Returns one row per (config, prompt): tokens/step, mean verified positions per step (the verify cost proxy),
    share of steps on the long block, share of steps whose head came from the lookup, share of steps that ran the
    drafter (below 1 only with `skip`), and how many drafts had to be computed for real. `traces` are
    `hqlab.replay.traces.Trace`s of the target's greedy outputs. `forced`: per prompt id, the drafter tokens another
    run drafted at given steps (`TeacherForcedDrafter`); the rows then count those steps (`forced_drafts`), the
    tokens this drafter would have drafted otherwise (`drafter_flips`) and the widest margin among those."""
    import polars as pl
    from tqdm.auto import tqdm

    from hqlab.config import resolve_spec
    from hqlab.proposers.fused import FusedProposer
    from hqlab.replay import replay
    from hqlab.trace import tokens_per_step

    configs = [(spec, resolve_spec(spec, {"fused": FusedProposer}, context="fused",
                                   unknown="replay_fused_grid takes fused:... specs, got {spec!r}")[1])
               for spec in specs]
    rows = []
    bar = tqdm(total=len(traces) * len(configs), desc="fused replay", disable=not progress)
    for trace in traces:
        mine = (forced or {}).get(trace.prompt_id, {})
        teacher = TeacherForcedDrafter(drafter, trace.prompt_ids, trace.output_ids, forced=mine)
        for spec, config in configs:
            before = teacher.real_calls
            proposer = FusedProposer(config, drafter=teacher)
            records = replay(trace.prompt_ids, trace.output_ids, proposer, max_new_tokens=trace.max_new_tokens,
                             request=trace.prompt_id)
            n = max(len(records), 1)
            rows.append({
                "config": spec, "prompt_id": trace.prompt_id, "category": trace.category, "steps": len(records),
                "tokens_per_step": tokens_per_step(records),
                "verify_positions": sum(r.verify_len for r in records) / n,
                "long_share": sum(r.block == config.k and config.k > config.draft_block for r in records) / n,
                "lookup_head_share": sum(bool(r.sources) and r.sources[0] == Source.LOOKUP for r in records) / n,
                "drafter_share": proposer.drafted_steps / max(proposer.drafted_steps + proposer.skipped_steps, 1),
                "real_drafts": teacher.real_calls - before,
                "forced_drafts": len(mine), "drafter_flips": len(teacher.flips),
                "flip_margin_max": max((f[3] for f in teacher.flips), default=None),
            })
            bar.update()
    bar.close()
    return pl.DataFrame(rows)


def load_drafter(drafter: str, *, device: str = "auto", dtype: str = "auto") -> DraftProposer:
    """A greedy drafter on the device and in the dtype a target loaded with the same `device` and `dtype` gets
    (so the replay notebooks need not load the target when its traces are cached)."""
    import torch

    from hqlab import models
    from hqlab.proposers.draft import DraftConfig

    dev = torch.device(models.resolve_device(device)).type
    return DraftProposer(DraftConfig(model=drafter, dtype=models.resolve_dtype(dtype), device=dev))


def load_target_and_drafter(target: str, drafter: str, *, device: str = "auto", dtype: str = "auto"):
    """The target engine and a greedy drafter on the target's device and dtype (the replay notebooks' pair)."""
    from hqlab.engines.hf import HFEngine
    from hqlab.proposers.draft import DraftConfig

    engine = HFEngine.load(target, device=device, dtype=dtype)
    dt = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    return engine, DraftProposer(DraftConfig(model=drafter, dtype=dt, device=engine.device.type))

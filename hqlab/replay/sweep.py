"""Parameter sweeps over recorded greedy traces: exact acceptance by replay, speed from the measured cost model.

1. Traces (`hqlab.replay.traces`): the target's greedy no-speculation output per prompt, from the trace cache.
2. `sweep`: replay every proposer spec over every trace (exact for greedy decoding, see `hqlab.replay`). The
   lookup and PLD proposers take the vectorised path of `hqlab.replay.fast` over all traces at once (the same
   steps, far faster); any other proposer (fused, drafter, ...) is replayed step by step with the engine's own
   code.
3. Price each replayed step with a `CostModel` (and the proposer's measured cost) and compare with the
   no-speculation run's price.

Grids: `parse_grid("lookup:nmin=1|2|6,nmax=8|12,k=15")` expands `|`-separated values of any keys a proposer's
config accepts (lookup, fusion and scheduler keys of a fused proposer alike). The command is `hqlab sweep`.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterable, Sequence

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from hqlab.config import ConfigError, parse_spec, resolve_spec
from hqlab.proposers import REGISTRY, make_proposer
from hqlab.replay import fast as vectorised
from hqlab.replay.costmodel import CostModel, ProposalCost
from hqlab.replay.step import step_replay
from hqlab.replay.traces import Trace
from hqlab.trace import budget, tokens_per_step


def grid(name: str, **axes: Iterable[Any]) -> list[str]:
    """Specs for the cartesian product of `axes`, skipping combinations the config rejects (e.g. nmin > nmax)."""
    specs = []
    keys = list(axes)
    for values in itertools.product(*(list(axes[k]) for k in keys)):
        spec = f"{name}:" + ",".join(f"{k}={v}" for k, v in zip(keys, values))
        try:
            resolve_spec(spec, REGISTRY)
        except ConfigError:
            continue
        specs.append(spec)
    return specs


def parse_grid(text: str) -> list[str]:
    """Expand `NAME:key=v1|v2|...,key2=...` into specs (cartesian product; combinations the proposer's config
    rejects, such as nmin > nmax, are skipped). Every value must be valid for its key on its own (`nmin=x` is
    an error, not a skipped value) and take part in at least one valid combination; otherwise the error names
    the value and why it fails."""
    import dataclasses
    import typing

    from hqlab.config import _coerce

    name, values = parse_spec(text)
    if name not in REGISTRY:
        raise ConfigError(f"grid {text!r}: unknown proposer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name].Config
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"grid {text!r}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    axes = {k: [x.strip() for x in v.split("|")] for k, v in values.items()}
    for k, vals in axes.items():
        if any(not x for x in vals):
            raise ConfigError(f"grid {text!r}: key {k!r} has an empty value in {values[k]!r}")
        for x in vals:
            try:
                _coerce(x, hints[k], f"{name}: {k}")
            except ConfigError as e:
                raise ConfigError(f"grid {text!r}: {e}") from None
    if not axes:
        resolve_spec(name, REGISTRY)
        return [name]
    specs = grid(name, **axes)
    used = {k: set() for k in axes}
    for spec in specs:
        for k, v in parse_spec(spec)[1].items():
            used[k].add(v)
    for k, vals in axes.items():
        for x in vals:
            if x in used[k]:
                continue
            # say why: build the first combination with this value and let its error speak
            first = {key: (x if key == k else v[0]) for key, v in axes.items()}
            try:
                resolve_spec(f"{name}:" + ",".join(f"{key}={v}" for key, v in first.items()), REGISTRY)
            except ConfigError as e:
                raise ConfigError(f"grid {text!r}: {k}={x} is in no valid combination ({e})") from None
            raise ConfigError(f"grid {text!r}: {k}={x} is in no valid combination")
    return specs


def measure_proposal_cost(proposer: Any, traces: Sequence[Trace], *, samples: int = 48, repeats: int = 3,
                          seed: int = 0) -> ProposalCost:
    """Time `proposer.propose` at `samples` positions drawn across the traces (median of `repeats` calls each)
    and fit proposal ms against history length."""
    rng = np.random.default_rng(seed)
    pool = [(i, d) for i, tr in enumerate(traces) for d in range(1, len(tr.output_ids))]
    if not pool:
        return ProposalCost()
    picks = [pool[j] for j in rng.choice(len(pool), size=min(samples, len(pool)), replace=False)]
    lens, ms = [], []
    histories = {}
    for i, done in picks:
        tr = traces[i]
        if i not in histories:
            histories[i] = np.asarray([*tr.prompt_ids, *tr.output_ids], dtype=np.int64)
        view = histories[i][: len(tr.prompt_ids) + done]
        allowed = budget(tr.max_new_tokens, done)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proposer.propose([view], [allowed], keys=[f"cost-{i}"])
            times.append(time.perf_counter() - t0)
        lens.append(view.size)
        ms.append(1e3 * float(np.median(times)))
    return ProposalCost.fit(lens, ms)


def _spec_params(spec: str) -> dict[str, str]:
    return parse_spec(spec)[1]


def sweep(traces: Sequence[Trace], specs: Sequence[str], *, cost: CostModel | None = None,
          progress: bool = True, time_proposals: bool = True, fast: bool = True,
          proposal_samples: int = 48) -> pl.DataFrame:
    """One row per (spec, trace): replayed tokens/step, steps, proposal time, and (with `cost`) predicted speed.

    Proposal time: for the vectorised replay, the proposer is timed at `proposal_samples` positions and a linear
    model of history length prices every step; the step-by-step replay times every call. `cost.proposal`, when
    set, overrides both. The no-speculation price of each trace is the cost model's sum over its one-token steps,
    so `speedup_pred` compares like with like.
    """
    rows: list[dict[str, Any]] = []
    frames: list[pl.DataFrame] = []
    index = None
    base_s = None
    if cost is not None:  # the no-speculation price of each trace does not depend on the configuration
        base_s = np.array([cost.baseline_seconds(len(tr.prompt_ids), len(tr.output_ids)) for tr in traces])
    for spec in tqdm(list(specs), desc="sweep", disable=not progress):
        proposer = make_proposer(spec)
        params = _spec_params(spec)
        base = {"config": spec, **{f"p_{k}": v for k, v in params.items()}}
        if fast and vectorised.supports(proposer):
            if index is None:
                index = vectorised.TraceIndex(traces)
            proposal = cost.proposal if cost is not None and cost.proposal is not None else (
                measure_proposal_cost(proposer, traces, samples=proposal_samples) if time_proposals else None)
            frames.append(_fast_rows(index, proposer, traces, base, cost, proposal, base_s))
            continue
        for i, tr in enumerate(traces):
            records = step_replay(tr.prompt_ids, tr.output_ids, proposer, max_new_tokens=tr.max_new_tokens,
                                  request=tr.prompt_id, time_proposals=time_proposals)
            row: dict[str, Any] = {
                **base, "category": tr.category, "prompt_id": tr.prompt_id, "new_tokens": len(tr.output_ids),
                "steps": len(records), "tokens_per_step": tokens_per_step(records),
                "accepted": sum(r.accepted for r in records),
                "propose_ms_per_step": 1e3 * float(np.mean([r.propose_s for r in records])) if records else 0.0,
                "replay": "step",
            }
            if cost is not None:
                spec_s = cost.decode_seconds(records)
                row.update(pred_decode_s=spec_s, pred_base_s=float(base_s[i]),
                           speedup_pred=float(base_s[i]) / spec_s if spec_s else 1.0)
            rows.append(row)
    if rows:
        frames.append(pl.DataFrame(rows))
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


def _fast_rows(index: vectorised.TraceIndex, proposer: Any, traces: Sequence[Trace], base: dict[str, Any],
               cost: CostModel | None, proposal: ProposalCost | None, base_s: np.ndarray | None) -> pl.DataFrame:
    """The sweep's rows for one configuration from the vectorised replay, aggregated per trace without a
    Python loop over steps or traces."""
    table = vectorised.replay_table(index, proposer)
    n = len(traces)
    steps = np.bincount(table.trace, minlength=n)
    accepted = np.bincount(table.trace, weights=table.accepted, minlength=n)
    prop_ms = proposal.ms(table.context_len + 1) if proposal is not None else np.zeros(len(table))
    prop_sum = np.bincount(table.trace, weights=prop_ms, minlength=n)
    safe = np.maximum(steps, 1)
    cols: dict[str, Any] = {
        **{k: [v] * n for k, v in base.items()}, "category": [t.category for t in traces],
        "prompt_id": [t.prompt_id for t in traces], "new_tokens": index.out_len, "steps": steps,
        "tokens_per_step": np.where(steps > 0, (accepted + steps) / safe, np.nan), "accepted": accepted.astype(np.int64),
        "propose_ms_per_step": np.where(steps > 0, prop_sum / safe, 0.0), "replay": ["fast"] * n}
    if cost is not None:
        step_s = np.bincount(table.trace, weights=np.asarray(cost.step_ms(table.verify_len, table.context_len)),
                             minlength=n) / 1e3
        spec_s = step_s + prop_sum / 1e3
        cols.update(pred_decode_s=spec_s, pred_base_s=base_s,
                    speedup_pred=np.where(spec_s > 0, base_s / np.where(spec_s > 0, spec_s, 1.0), 1.0))
    return pl.DataFrame(cols)


def rows_of(frame: pl.DataFrame, specs: Sequence[str]) -> pl.DataFrame:
    """The rows of a sweep (`sweep`) for `specs`, each labelled with the spec as given: a spec matches the grid
    point whose proposer has the same configuration, however either is written (`lookup:nmin=6,nmax=12,k=15` is
    the grid's `lookup:nmin=6,nmax=12,k=15,policy=recent`). A spec the grid does not contain is an error naming
    it, so a live run is never compared with a neighbouring configuration."""
    def point(spec: str) -> tuple[str, str]:  # the validated config, whatever the spelling; nothing is built
        name, config = resolve_spec(spec, REGISTRY)
        return name, repr(config)

    points: dict[tuple[str, str], str] = {}
    for config in frame["config"].unique(maintain_order=True).to_list():
        points.setdefault(point(config), config)
    parts = []
    for spec in dict.fromkeys(specs):
        config = points.get(point(spec))
        if config is None:
            raise ConfigError(f"{spec!r} is not a point of this sweep ({frame['config'].n_unique()} configurations); "
                              f"add it to the grid")
        parts.append(frame.filter(pl.col("config") == config).with_columns(pl.lit(spec).alias("config")))
    return pl.concat(parts) if parts else frame.clear()


def by_category(frame: pl.DataFrame) -> pl.DataFrame:
    """Pool prompts per (config, category): tokens/step = tokens emitted by verify steps / steps (the first
    token of each request comes from prefill), predicted speedup = summed prices."""
    params = [c for c in frame.columns if c.startswith("p_")]
    aggs = [(pl.col("new_tokens") - 1).sum().alias("step_tokens"), pl.col("steps").sum(),
            pl.col("propose_ms_per_step").median(), *[pl.col(c).first() for c in params]]
    if "pred_decode_s" in frame.columns:
        aggs += [pl.col("pred_decode_s").sum(), pl.col("pred_base_s").sum()]
    out = frame.group_by(["config", "category"], maintain_order=True).agg(aggs)
    out = out.with_columns((pl.col("step_tokens") / pl.col("steps")).alias("tokens_per_step"))
    if "pred_decode_s" in out.columns:
        out = out.with_columns((pl.col("pred_base_s") / pl.col("pred_decode_s")).alias("speedup_pred"))
    return out


def best_overall(frame: pl.DataFrame) -> pl.DataFrame:
    """Configs ranked by the geometric mean over task classes of the predicted speedup (then the worst class):
    one standalone default that is good everywhere rather than best on one class."""
    table = by_category(frame)
    return (table.group_by("config").agg(pl.col("speedup_pred").log().mean().exp().alias("geomean_speedup"),
                                         pl.col("speedup_pred").min().alias("worst_class"),
                                         pl.col("tokens_per_step").mean().alias("mean_tokens_per_step"))
            .sort(["geomean_speedup", "worst_class"], descending=True))

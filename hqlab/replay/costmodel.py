"""A measured cost model of the verify step and the proposer: predicted decode time and tok/s of a replayed run.

Replay gives exact acceptance; speed needs the price of each step. The price of one engine step is modelled as

    step_ms(v, c) = a + s·[v > 1] + b·(v - 1) + c·(ctx/1000) + d·(v - 1)·(ctx/1000)

for v verified positions on a KV cache of ctx tokens: a fixed cost (weights, launches, Python), a jump where
decoding one token becomes verifying several (another attention kernel; large on a GPU), a cost per extra
position (matrix rows, the vocabulary-wide argmax of every row), attention over the cache, and attention of each
extra position over the cache. The jump term is only fitted when the data has verify lengths to tell it apart
from the slope. The fit is robust (Huber weights), so a few steps slowed by another process do not bend it, and
it extrapolates along straight lines instead of clamping to the nearest measured cell.

The proposer's own time is a second, linear model of the history length (`ProposalCost`), fitted from timed
`propose` calls. A replayed run's predicted decode time = sum over its steps of step price + proposal price.

Inside vLLM on a GPU a small model's step is host-bound, and the host runs at different speeds from one request to
the next (1.4-2.4x on the lent H200). A fixed price per step cannot follow that. Measured runs carry their own gauge
of the host's speed: the speculator's host time per step (`propose_s`). The speculator's host time in a request
(its median) tracks the request's median step time at r = 0.88-0.99 in every gpu-lookup run. With `host_ms` the
model prices a step as

    step_ms(v, host) = a + h·host + b·(v - 1)

(+ the jump when the data can tell it apart), without the context terms: on a host-bound step the context's price is
within the noise (fitted -0.04 to +0.14 ms per 1k tokens), and where long prompts met a slow host it would absorb the
host's level instead (data/results/vllm_gpu/m/). h comes out at 39-44 in each run with two widths or more (the robust
fit, no context term): vLLM's host work per step is ~40 times the speculator's.

Measure the step the way the engine runs it (`measure_step_times`: the engine's forward, its greedy verdict and
its cache crop), in shuffled rounds so that a slow spell of a shared machine spreads over all cells instead of
looking like a property of one context length.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from hqlab.trace import StepRecord

TERMS = ("fixed", "verify_jump", "per_position", "per_1k_context", "per_position_1k_context", "per_host_ms")


def measure_step_times(engine: Any, context_lens: Sequence[int], verify_lens: Sequence[int], *,
                       repeats: int = 5, progress: bool = True, seed: int = 0) -> pl.DataFrame:
    """Median ms of one engine verify step for each (context_len, verify_len), timed the way the engine steps
    (batch 1): `RaggedCache.forward` over the pending token + v - 1 proposed tokens, the engine's greedy verdict
    on every row, and `RaggedCache.keep` (the KV rollback); the cache is then rolled back to its context.

    `repeats` rounds visit every cell once each, in a new random order per round, after one warm-up round.
    """
    from hqlab.config import DecodeConfig
    from hqlab.models.kv import RaggedCache
    from hqlab.proposers.base import Proposal
    from hqlab.trace import Source

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = min(int(engine.model.config.vocab_size), 150_000)
    greedy = DecodeConfig()
    caches = {}
    with torch.inference_mode():
        for ctx in sorted(set(context_lens)):
            caches[ctx] = RaggedCache(engine.model, engine._cache_kw)
            caches[ctx].add(torch.randint(0, vocab, (ctx,), generator=gen).tolist())
    cells = [(c, v) for c in sorted(set(context_lens)) for v in sorted(set(verify_lens))]
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    bar = tqdm(total=len(cells) * (repeats + 1), desc="step cost", disable=not progress)
    with torch.inference_mode():
        for rnd in range(repeats + 1):
            order = cells[:]
            rng.shuffle(order)
            for ctx, v in order:
                kv = caches[ctx]
                tokens = torch.randint(0, vocab, (v,), generator=gen).tolist()
                proposal = Proposal(np.asarray(tokens[1:], dtype=np.int64), np.full(v - 1, Source.LOOKUP, dtype=np.int8))
                t0 = time.perf_counter()
                logits = kv.forward([tokens])
                verdict, _ = engine._choose(logits[0, :v], proposal, greedy, None)
                kv.keep([1 + verdict.accepted])
                elapsed = time.perf_counter() - t0
                kv.truncate_rows({0: ctx})
                if rnd > 0:  # the first round warms up every shape
                    samples[(ctx, v)].append(elapsed)
                bar.update()
    bar.close()
    return pl.DataFrame([{"context_len": c, "verify_len": v, "step_ms": 1e3 * statistics.median(s),
                          "spread_ms": 1e3 * (max(s) - min(s)), "samples": len(s)} for (c, v), s in samples.items()])


def _design(verify_len: np.ndarray, context_len: np.ndarray, terms: Sequence[str],
            host_ms: np.ndarray | None = None) -> np.ndarray:
    v = np.asarray(verify_len, dtype=np.float64)
    c = np.asarray(context_len, dtype=np.float64) / 1000.0
    cols = {"fixed": np.ones_like(v), "verify_jump": (v > 1).astype(np.float64), "per_position": v - 1,
            "per_1k_context": c, "per_position_1k_context": (v - 1) * c,
            "per_host_ms": np.zeros_like(v) if host_ms is None else np.asarray(host_ms, dtype=np.float64)}
    return np.stack([cols[t] for t in terms], axis=1)


def robust_lstsq(x: np.ndarray, y: np.ndarray, *, iterations: int = 30, huber: float = 1.345) -> np.ndarray:
    """Least squares with Huber weights (iteratively reweighted): residuals beyond ~1.3 robust standard deviations
    count linearly, so outliers (a step slowed by another process) pull little."""
    w = np.ones_like(y)
    beta = np.linalg.lstsq(x, y, rcond=None)[0]
    for _ in range(iterations):
        r = y - x @ beta
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        if scale <= 1e-12:
            break
        w = np.minimum(1.0, huber * scale / np.maximum(np.abs(r), 1e-12))
        sw = np.sqrt(w)
        new = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)[0]
        if np.allclose(new, beta, rtol=1e-9, atol=1e-12):
            break
        beta = new
    return beta


@dataclass(frozen=True)
class ProposalCost:
    """Proposal time per step, linear in the history length: ms = fixed + per_1k * len/1000."""

    fixed_ms: float = 0.0
    per_1k_ms: float = 0.0

    @classmethod
    def fit(cls, history_len: Sequence[int] | np.ndarray, propose_ms: Sequence[float] | np.ndarray) -> "ProposalCost":
        x = np.asarray(history_len, dtype=np.float64) / 1000.0
        y = np.asarray(propose_ms, dtype=np.float64)
        if y.size == 0:
            raise ValueError("no proposal timings to fit")
        if np.ptp(x) == 0:
            return cls(float(np.median(y)), 0.0)
        a, b = robust_lstsq(np.stack([np.ones_like(x), x], 1), y)
        return cls(float(a), float(b))

    def ms(self, history_len: int | np.ndarray) -> np.ndarray | float:
        return self.fixed_ms + self.per_1k_ms * np.asarray(history_len, dtype=np.float64) / 1000.0


@dataclass(frozen=True)
class CostModel:
    """Price of one engine step, `step_ms(v, ctx)` (see the module docstring), plus an optional proposal model."""

    coef: dict[str, float]
    proposal: ProposalCost | None = None
    source: str = ""  # what it was fitted on
    residual_ms: float = float("nan")  # robust spread of the fit's residuals
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def fit(cls, frame: pl.DataFrame) -> "CostModel":
        """Fit a measured grid (context_len, verify_len, step_ms), e.g. from `measure_step_times`. The grid must
        be complete (every context × verify length), so that no cell is a guess."""
        contexts = frame["context_len"].unique()
        lens = frame["verify_len"].unique()
        if frame.select("context_len", "verify_len").unique().height != len(contexts) * len(lens):
            raise ValueError("the step-time grid must be complete (every context × verify length)")
        return cls.fit_points(frame["verify_len"].to_numpy(), frame["context_len"].to_numpy(),
                              frame["step_ms"].to_numpy(), source="grid")

    @classmethod
    def fit_steps(cls, steps: pl.DataFrame, *, host_ms: np.ndarray | None = None) -> "CostModel":
        """Fit engine step records (`hqlab.trace.records_frame`): the step's time less its proposal time.
        `host_ms`: each step's host level (see `fit_points`), e.g. from `host_levels`."""
        y = 1e3 * (steps["step_s"] - steps["propose_s"]).to_numpy()
        return cls.fit_points(steps["verify_len"].to_numpy(), steps["context_len"].to_numpy(), y, source="steps",
                              host_ms=host_ms)

    @classmethod
    def fit_points(cls, verify_len: np.ndarray, context_len: np.ndarray, step_ms: np.ndarray, *,
                   source: str = "", host_ms: np.ndarray | None = None) -> "CostModel":
        """Fit step prices (module docstring). `host_ms`: a measure of the host's speed at each step (ms of a fixed
        piece of host work; e.g. the speculator's median host time in the step's request): the model then prices
        the host's level instead of the context (`per_host_ms`), and predicting needs it too."""
        v = np.asarray(verify_len)
        c = np.asarray(context_len)
        terms = ["fixed"]
        if host_ms is not None:
            host_ms = np.asarray(host_ms, dtype=np.float64)
            if host_ms.shape != v.shape or not np.isfinite(host_ms).all() or (host_ms <= 0).any():
                raise ValueError("host_ms must hold one positive, finite host level per step")
            terms.append("per_host_ms")
        elif np.unique(c).size > 1:
            terms.append("per_1k_context")
        longer = np.unique(v[v > 1])
        if np.unique(v).size > 1:  # a slope needs two verify lengths; the jump, two beyond one and one itself
            terms.append("per_position")
            if host_ms is None and np.unique(c[v > 1]).size > 1:
                terms.append("per_position_1k_context")
            if longer.size >= 2 and (v == 1).any():
                terms.append("verify_jump")
        x = _design(v, c, terms, host_ms)
        beta = robust_lstsq(x, np.asarray(step_ms, dtype=np.float64))
        r = np.asarray(step_ms) - x @ beta
        coef = {t: 0.0 for t in TERMS} | {t: float(b) for t, b in zip(terms, beta)}
        return cls(coef, source=source, residual_ms=1.4826 * float(np.median(np.abs(r - np.median(r)))))

    def with_proposal(self, proposal: ProposalCost | None) -> "CostModel":
        return CostModel(self.coef, proposal, self.source, self.residual_ms, dict(self.extra))

    def step_ms(self, verify_len: int | np.ndarray, context_len: int | np.ndarray,
                host_ms: float | np.ndarray | None = None) -> float | np.ndarray:
        """Predicted ms of steps verifying `verify_len` positions on `context_len` tokens; a model fitted with the
        host's level (`per_host_ms`) needs that level (`host_ms`) too."""
        if self.coef.get("per_host_ms", 0.0) and host_ms is None:
            raise ValueError("this model prices the host's speed (fitted with host_ms): pass host_ms")
        v, c = np.atleast_1d(verify_len), np.atleast_1d(context_len)
        host = None if host_ms is None else np.broadcast_to(np.asarray(host_ms, dtype=np.float64), v.shape)
        out = _design(v, c, TERMS, host) @ np.array([self.coef.get(t, 0.0) for t in TERMS])
        return float(out[0]) if np.ndim(verify_len) == 0 and np.ndim(context_len) == 0 else out

    def propose_ms(self, history_len: int | np.ndarray) -> float | np.ndarray:
        return 0.0 if self.proposal is None else self.proposal.ms(history_len)

    def decode_seconds(self, records: Sequence[StepRecord], propose_ms: float | None = None) -> float:
        """Predicted decode time of a run: step prices plus proposal time. Proposal time is `propose_ms` per step
        if given, else the fitted `ProposalCost` if there is one, else what each record measured."""
        if not records:
            return 0.0
        v = np.array([r.verify_len for r in records])
        c = np.array([r.context_len for r in records])
        total = float(np.sum(self.step_ms(v, c))) / 1e3
        if propose_ms is not None:
            total += len(records) * propose_ms / 1e3
        elif self.proposal is not None and any(r.proposed or r.block for r in records):
            total += float(np.sum(self.proposal.ms(c + 1))) / 1e3
        else:
            total += sum(r.propose_s for r in records)
        return total

    def decode_tok_s(self, records: Sequence[StepRecord], propose_ms: float | None = None) -> float:
        """Predicted decode rate, (tokens after the first) / predicted decode time, as the engine reports it."""
        tokens = sum(r.emitted for r in records)
        seconds = self.decode_seconds(records, propose_ms)
        return tokens / seconds if seconds > 0 else float("nan")

    def baseline_seconds(self, prompt_len: int, new_tokens: int) -> float:
        """Predicted decode time without speculation: one single-position step per token after the first."""
        ctx = prompt_len + np.arange(max(new_tokens - 1, 0))
        return float(np.sum(self.step_ms(np.ones_like(ctx), ctx))) / 1e3

    def describe(self) -> str:
        c = self.coef
        text = (f"step ≈ {c['fixed']:.2f} ms + {c['verify_jump']:.2f} ms if v > 1 + {c['per_position']:.3f} ms/position"
                f" + {c['per_1k_context']:.2f} ms per 1k context + {c['per_position_1k_context']:.3f} ms per position"
                f" per 1k context" + (f" + {c['per_host_ms']:.1f} × host ms" if c.get("per_host_ms") else "")
                + f" (robust residual {self.residual_ms:.2f} ms)")
        if self.proposal is not None:
            text += f"; proposal ≈ {self.proposal.fixed_ms:.3f} + {self.proposal.per_1k_ms:.3f} ms per 1k history"
        return text


def host_levels(steps: pl.DataFrame, *, by: str = "config") -> pl.Series:
    """Each step's host level in ms: the median of the speculator's host time (`propose_s`) over the steps of its
    (config, request). A request's level tracks its step time (r = 0.88-0.99 in every gpu-lookup run on the H200)."""
    missing = steps.group_by(by).agg((pl.col("propose_s") > 0).all().alias("timed")).filter(~pl.col("timed"))
    if missing.height:
        raise ValueError(f"no speculator host time on every step of {sorted(missing[by].to_list())}: their host "
                         f"level is not measured (a config without a speculator, such as none, has none)")
    return (1e3 * steps.select(pl.col("propose_s").median().over([by, "request"])).to_series()).alias("host_ms")


def holdout_predictions(steps: pl.DataFrame, *, by: str = "config", reference: str = "none",
                        host_level: bool = False) -> pl.DataFrame:
    """Check the model form on live engine runs without judging it on data it saw: for each configuration,
    fit the step model on the *other* configurations' steps, and the proposal model on this configuration's
    proposal timings (the proposer's own cost, which a sweep measures by timing it), then predict this
    configuration's decode time for every request. One row per (config, request): measured and predicted decode
    seconds, and the same-prompt reference run's, so speedups can be compared as well.

    host_level: price each step by its request's host level (`host_levels`, the model's `per_host_ms`), measured
    in the predicted run as its proposal timings are; the reference config (no speculator, no level) is left out."""
    rows = []
    if host_level:
        steps = steps.filter(pl.col(by) != reference)
        steps = steps.with_columns(host_levels(steps, by=by))
    configs = steps[by].unique(maintain_order=True).to_list()
    for config in configs:
        train = steps.filter(pl.col(by) != config)
        test = steps.filter(pl.col(by) == config)
        if train.is_empty():
            raise ValueError(f"no configuration but {config!r} to fit the step model on")
        model = CostModel.fit_steps(train, host_ms=train["host_ms"].to_numpy() if host_level else None)
        drafts = test.filter(pl.col("verify_len") > 1)
        if config != reference and drafts.height:
            model = model.with_proposal(ProposalCost.fit(test["context_len"].to_numpy() + 1,
                                                         1e3 * test["propose_s"].to_numpy()))
        for (request,), run in test.group_by(["request"], maintain_order=True):
            host = run["host_ms"].to_numpy() if host_level else None
            pred = float(np.sum(model.step_ms(run["verify_len"].to_numpy(), run["context_len"].to_numpy(),
                                              host))) / 1e3
            pred += float(np.sum(model.propose_ms(run["context_len"].to_numpy() + 1))) / 1e3 if model.proposal \
                else float(run["propose_s"].sum())
            rows.append({by: config, "request": request, "category": run["category"][0], "steps": run.height,
                         "tokens": int(run["emitted"].sum()), "measured_s": float(run["step_s"].sum()),
                         "predicted_s": pred})
    out = pl.DataFrame(rows)
    ref = out.filter(pl.col(by) == reference).select("request", pl.col("measured_s").alias("reference_measured_s"),
                                                     pl.col("predicted_s").alias("reference_predicted_s"))
    return out.join(ref, on="request", how="left").with_columns(
        (pl.col("tokens") / pl.col("measured_s")).alias("measured_tok_s"),
        (pl.col("tokens") / pl.col("predicted_s")).alias("predicted_tok_s"),
        (pl.col("measured_s") / pl.col("predicted_s") - 1).alias("tok_s_error"))


def suite_errors(pred: pl.DataFrame, *, by: str = "config", suites: dict[str, list[str]] | None = None) -> pl.DataFrame:
    """Pool `holdout_predictions` rows per (config, suite): tok/s = tokens / summed seconds, measured vs predicted.
    `suites` maps a suite name to its categories (default: chat, and every other category as labd)."""
    suites = suites or {"chat": ["chat"]}
    named = {c: s for s, cats in suites.items() for c in cats}
    frame = pred.with_columns(pl.col("category").replace_strict(named, default="labd").alias("suite"))
    return (frame.group_by([by, "suite"], maintain_order=True)
            .agg(pl.len().alias("requests"), pl.col("tokens").sum(), pl.col("measured_s").sum(),
                 pl.col("predicted_s").sum())
            .with_columns((pl.col("tokens") / pl.col("measured_s")).alias("measured_tok_s"),
                          (pl.col("tokens") / pl.col("predicted_s")).alias("predicted_tok_s"))
            .with_columns((pl.col("predicted_tok_s") / pl.col("measured_tok_s") - 1).alias("tok_s_error")))

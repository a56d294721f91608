"""A measured cost model of the verify step: time(verify_len, context_len) on this machine and engine.

Replay gives exact acceptance; speed needs the price of each step. We time the target's forward pass over
`verify_len` positions on top of a KV cache of `context_len` tokens (the same call the engine makes), take
medians, and interpolate linearly in both directions. A replayed run's predicted decode time is the sum over its
steps of the step price plus the proposer's own time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from hqlab.trace import StepRecord


def measure_step_times(engine: Any, context_lens: Sequence[int], verify_lens: Sequence[int], *,
                       repeats: int = 5, progress: bool = True, seed: int = 0) -> pl.DataFrame:
    """Median forward time (ms) for each (context_len, verify_len), cache cropped back after every call."""
    from hqlab.engines.hf import _crop_to, _new_cache

    gen = torch.Generator().manual_seed(seed)
    vocab = int(engine.model.config.vocab_size)
    rows = []
    combos = [(c, v) for c in sorted(context_lens) for v in sorted(verify_lens)]
    bar = tqdm(total=len(combos), desc="step cost", disable=not progress)
    with torch.inference_mode():
        for ctx in sorted(context_lens):
            cache = _new_cache(engine.model)
            prefix = torch.randint(0, min(vocab, 150_000), (1, ctx), generator=gen).to(engine.device)
            engine._forward(prefix, cache, logits_to_keep=1)
            for v in sorted(verify_lens):
                ids = torch.randint(0, min(vocab, 150_000), (1, v), generator=gen).to(engine.device)
                times = []
                for _ in range(repeats + 1):  # the first call warms up this shape
                    t0 = time.perf_counter()
                    logits = engine._forward(ids, cache)
                    logits[-1, 0].item()  # include the device sync the engine pays for reading the verdict
                    times.append(time.perf_counter() - t0)
                    _crop_to(cache, ctx)
                rows.append({"context_len": ctx, "verify_len": v, "step_ms": 1e3 * statistics.median(times[1:])})
                bar.update()
    bar.close()
    return pl.DataFrame(rows)


@dataclass
class CostModel:
    """Bilinear interpolation over a measured (context_len × verify_len) grid of step times."""

    contexts: np.ndarray
    verify_lens: np.ndarray
    ms: np.ndarray  # [len(contexts), len(verify_lens)]

    @classmethod
    def fit(cls, frame: pl.DataFrame) -> "CostModel":
        contexts = np.array(sorted(frame["context_len"].unique()))
        lens = np.array(sorted(frame["verify_len"].unique()))
        grid = frame.pivot(on="verify_len", index="context_len", values="step_ms").sort("context_len")
        ms = grid.select([str(v) for v in lens]).to_numpy()
        if np.isnan(ms).any():
            raise ValueError("the step-time grid must be complete (every context × verify length)")
        return cls(contexts, lens, ms)

    def step_ms(self, verify_len: int, context_len: int) -> float:
        by_len = np.array([np.interp(context_len, self.contexts, self.ms[:, j]) for j in range(len(self.verify_lens))])
        return float(np.interp(verify_len, self.verify_lens, by_len))

    def decode_seconds(self, records: Sequence[StepRecord], propose_ms: float | None = None) -> float:
        """Predicted decode time of a run: step prices plus proposal time (measured per step, or given)."""
        total = 0.0
        for r in records:
            total += self.step_ms(r.verify_len, r.context_len) / 1e3
            total += (propose_ms / 1e3) if propose_ms is not None else r.propose_s
        return total

    def decode_tok_s(self, records: Sequence[StepRecord], propose_ms: float | None = None) -> float:
        """Predicted decode rate, (tokens after the first) / predicted decode time, as the engine reports it."""
        tokens = sum(r.emitted for r in records)
        seconds = self.decode_seconds(records, propose_ms)
        return tokens / seconds if seconds > 0 else float("nan")

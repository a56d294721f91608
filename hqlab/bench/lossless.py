"""Is a speculative output identical to the engine's own no-speculation output? And if not, was it a near tie?

Greedy outputs may legitimately differ at numerical near-ties: a different verify shape rounds differently, and
when the top two logits are within rounding of each other either token is "the argmax". Such flips are reported
with the logit margin of the first divergent token (taken from the reference run), never hidden; a divergence
at a clear margin is a real bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Largest top-1/top-2 logit gap that rounding can plausibly flip, per compute dtype. bf16 keeps 8 bits of
# mantissa: logits around 16-32 are spaced 0.125 apart, and a reordered reduction can move them by a few steps.
NEAR_TIE_TOL = {"bfloat16": 0.5, "float16": 0.1, "float32": 0.01}


@dataclass(frozen=True)
class Comparison:
    status: str  # "identical" | "near-tie" | "mismatch"
    first_divergence: int | None = None
    margin: float | None = None

    @property
    def lossless(self) -> bool:
        return self.status != "mismatch"


def compare(reference: Sequence[int], reference_margins: Sequence[float], output: Sequence[int],
            tol: float) -> Comparison:
    n = min(len(reference), len(output))
    for i in range(n):
        if reference[i] != output[i]:
            margin = float(reference_margins[i]) if i < len(reference_margins) else float("nan")
            return Comparison("near-tie" if margin <= tol else "mismatch", i, margin)
    if len(reference) != len(output):
        # same prefix, different length: one stopped early (EOS) where the other did not -> a real difference
        return Comparison("mismatch", n, None)
    return Comparison("identical")


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution, P(X >= stat) for X ~ chi2(dof): the regularized upper
    incomplete gamma function Q(dof/2, stat/2), computed by torch (`torch.special.gammaincc`) in float64."""
    import torch

    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1 (got {dof})")
    if stat <= 0:
        return 1.0
    q = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                torch.tensor(stat / 2.0, dtype=torch.float64))
    return float(q)


def chi_square_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom for sampled `counts` against exact `probs`; categories
    with an expectation below 5 are pooled into one (dropped if the pool itself expects fewer than 5)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    expected = np.asarray(probs, dtype=np.float64) * n
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp_ = np.append(expected[keep], expected[~keep].sum())
    if exp_[-1] < 5:
        obs, exp_ = obs[:-1], exp_[:-1]
    return float(((obs - exp_) ** 2 / exp_).sum()), len(obs) - 1


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit of sampled `counts` to exact `probs` (categories with an expectation
    below 5 are pooled): the statistical check that sampled speculative decoding keeps the target's distribution."""
    stat, dof = chi_square_statistic(counts, probs)
    if dof < 1:
        raise ValueError("chi-square test needs at least two categories expecting >= 5 samples each")
    return chi2_sf(stat, dof)

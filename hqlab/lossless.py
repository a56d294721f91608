"""Is a speculative output identical to the engine's own no-speculation output? And if not, was it a near tie?

Greedy outputs may legitimately differ at numerical near-ties: a different verify shape rounds differently, and
when the top two logits are within rounding of each other either token is "the argmax". Such flips are reported
with the logit margin of the first divergent token (taken from the reference run), never hidden; a divergence
at a clear margin is a real bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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

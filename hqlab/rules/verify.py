"""Lossless verification of a proposal against the target's scores, SPEC §2.6.

The target scores the pending token plus n proposed tokens in one forward pass, giving n + 1 rows of logits.
Row i is the target's distribution for the token *after* proposed position i - 1, i.e. for proposed position i.

Greedy: the target's argmax decides every token; proposals are accepted while they equal it, then the target's
own token at the first disagreement (or the bonus token after a fully accepted proposal) is emitted.

Sampling: speculative rejection sampling. A proposed token x drawn from q is accepted with probability
min(1, p(x) / q(x)); on rejection a token is drawn from the residual max(p - q, 0), normalised. Deterministic
sources (lookup) propose with a point mass, q = onehot(x): accept with probability p(x), and on rejection the
residual is p with x removed. Each acceptance decision draws its own fresh uniform number: reusing a random
number that also chose a token correlates the two and biases the output (a real, released bug).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Verdict:
    """accepted: how many proposed tokens were kept; emitted: accepted tokens + one target token."""

    accepted: int
    emitted: list[int]


def greedy_verify(proposed: np.ndarray, target_argmax: list[int] | np.ndarray) -> Verdict:
    """Accept the longest prefix of `proposed` that equals the target's argmax tokens (len n + 1)."""
    n = len(proposed)
    target = np.asarray(target_argmax)
    if target.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target tokens for {n} proposed, got {target.shape[0]}")
    mismatch = np.flatnonzero(np.asarray(proposed) != target[:n])
    accepted = int(mismatch[0]) if mismatch.size else n
    return Verdict(accepted, [int(x) for x in target[: accepted + 1]])


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution per row of `logits` [m, V] after temperature, top-k and top-p (float32).

    Plain sampling and speculative sampling both draw from exactly these rows, so this is the one definition.
    """
    if temperature <= 0:
        raise ValueError("target_probs is for sampling; use greedy_verify for temperature 0")
    x = logits.float() / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs_sorted = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (torch.cumsum(probs_sorted, dim=-1) - probs_sorted) >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_verify(
    proposed: np.ndarray,
    p: torch.Tensor,
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
    point_mass: np.ndarray | None = None,
) -> Verdict:
    """Rejection-sample `proposed` (n tokens) against target rows `p` [n + 1, V].

    q:          [n, V] proposal distributions (drafter positions), or None.
    point_mass: bool [n], True where the proposal is deterministic (lookup). Defaults to all True when q is None
                and all False otherwise.
    """
    n = len(proposed)
    if p.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target rows for {n} proposed tokens, got {p.shape[0]}")
    if point_mass is None:
        point_mass = np.full(n, q is None)
    if q is None and not bool(np.all(point_mass)):
        raise ValueError("drafter positions need their proposal distribution q")
    emitted: list[int] = []
    for i in range(n):
        x = int(proposed[i])
        px = float(p[i, x])
        if point_mass[i]:
            accept_prob = px
        else:
            qx = float(q[i, x])
            accept_prob = 1.0 if qx <= px else px / qx
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < accept_prob:
            emitted.append(x)
            continue
        if point_mass[i]:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p[i] - q[i].to(p.dtype), min=0.0)
        total = float(residual.sum())
        # total == 0 only if p == q (then rejection has probability 0); guard against rounding anyway
        emitted.append(_draw(residual / total if total > 0 else p[i], generator))
        return Verdict(i, emitted)
    emitted.append(_draw(p[n], generator))
    return Verdict(n, emitted)

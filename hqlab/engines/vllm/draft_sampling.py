"""Sampled drafts for `gpu-fused` (`draft_sample=probabilistic`): the drafter's token drawn from its own distribution
at the request's temperature, and the distributions vLLM's rejection sampler reads for every draft position.

Why: under sampling a greedy draft token x is verified as a point mass, accepted with probability p(x). A token drawn
from the drafter's q and verified with q is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q), which is
never lower in expectation when q is close to p (Leviathan et al., 2023). vLLM 0.26's V2 rejection sampler does
that test whenever a speculator exposes `draft_logits` ([max_num_reqs, k, V] float32, indexed by the request's slot
and the draft position; its log-softmax is q). Every position must then carry the distribution its token was
really drawn from:

- a position whose token is the drafter's (source DRAFT): the drafter's logits at the request's temperature, and the
  token drawn from them here (Gumbel-max: argmax(logits / T + G), G standard Gumbel);
- every other position (lookup tokens, the pad after the block): a point mass, logit 0 at its token and -inf
  elsewhere, which the rejection sampler treats exactly as its one-hot path (accept with p(x), residual p without x).

Exactness needs the drafter's token to be independent of the target's randomness: the Gumbel noise here comes from a
counter-based hash of (the slot's own seed, a step counter, the vocabulary index), never from vLLM's per-request
streams. It is plain integer arithmetic on tensors, so it runs the same on the CPU and the GPU, inside CUDA graphs
(the counter is a device tensor the step advances), and draws fresh noise at every replay. Which positions carry q
must not depend on the token drawn there; `gpu_fused.GpuFusedConfig` therefore allows this mode only where the
fusion rule's head decision ignores the drafter's token (draft_block=1, agree=0, rule=threshold).

Greedy requests (temperature 0) get the drafter's argmax as before; the rejection sampler ignores their draft logits.
"""

from __future__ import annotations

import torch

# splitmix64's constants (Steele et al., 2014), as signed int64 (torch has no uint64 arithmetic)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_STEP = 0x2545F4914F6CDD1D
_LOW31 = (1 << 31) - 1
_LOW37 = (1 << 37) - 1
_LOW53 = (1 << 53) - 1


def _shr(x: torch.Tensor, n: int, keep: int) -> torch.Tensor:
    """Logical right shift of int64 by n (torch's >> is arithmetic): keep the low 64 - n bits."""
    return (x >> n) & keep


def uniforms(seeds: torch.Tensor, step: torch.Tensor, vocab_index: torch.Tensor) -> torch.Tensor:
    """[m, V] float64 uniforms in (0, 1): splitmix64's finaliser over seed + step * C + vocabulary index * golden.

    seeds: [m] int64, one per row (a request slot's seed); step: [m] or [1] int64, a counter that differs at every
    drafting step; vocab_index: [V] int64 (0..V-1). 53 random bits per draw."""
    x = seeds[:, None] + step.reshape(-1, 1) * _STEP + vocab_index[None, :] * _GOLDEN
    x = (x ^ _shr(x, 30, (1 << 34) - 1)) * _MIX1
    x = (x ^ _shr(x, 27, _LOW37)) * _MIX2
    x = x ^ _shr(x, 31, (1 << 33) - 1)
    bits = _shr(x, 11, _LOW53)
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor,
           vocab_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax(logits / T); T = 0 rows take the argmax.

    Returns (tokens [m] int64, processed [m, V] float32 = logits / T, the logits of the distribution drawn from; raw
    logits for a greedy row). No host read; static shapes."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    processed = logits.to(torch.float32) / t[:, None]
    gumbel = -torch.log(-torch.log(uniforms(seeds, step, vocab_index)))
    drawn = (processed.to(torch.float64) + gumbel).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn), processed


def point_mass_logits(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[m, V] float32: 0 at each row's token, -inf elsewhere (q = one-hot)."""
    out = torch.full((tokens.shape[0], vocab), float("-inf"), dtype=torch.float32, device=tokens.device)
    return out.scatter_(1, tokens.reshape(-1, 1), 0.0)


__all__ = ["uniforms", "sample", "point_mass_logits"]

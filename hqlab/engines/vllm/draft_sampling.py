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
must not depend on the token drawn there; `gpu_fused_config.GpuFusedConfig` therefore allows this mode only where the
fusion rule's head decision ignores the drafter's token (draft_block=1, agree=0, rule=threshold).

Greedy requests (temperature 0) get the drafter's argmax as before; the rejection sampler ignores their draft logits.
"""

from __future__ import annotations

import numpy as np
import torch

from hqlab.rules.fusion import SOURCE_DRAFT

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


class DraftDistributions:
    """The drawn head's state inside `gpu_fused`, per request slot: the seeds and the step counter of the draft's own
    noise, vLLM's temperatures (`temperature`, bound by the plugin) and the draft logits vLLM's rejection sampler
    reads (`allocate`: [max_num_reqs + 1, k, vocab] float32, one scratch row past the slots taking the writes of
    rows that do not sample; every position a point mass at token 0 until a step writes it)."""

    def __init__(self, max_num_reqs: int, k: int, device: torch.device, *, compile: bool = False) -> None:
        self.max_num_reqs, self.k, self.device = max_num_reqs, k, device
        seeds = np.random.default_rng().integers(0, 2 ** 62, size=max_num_reqs + 1, dtype=np.int64)
        self.seeds = torch.from_numpy(seeds).to(device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.temperature: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self._sample = torch.compile(sample, dynamic=None) if compile else sample

    def allocate(self, vocab: int) -> torch.Tensor:
        """The draft logits for a drafter of `vocab` rows; returns the view vLLM reads ([max_num_reqs, k, vocab])."""
        k, dev = self.k, self.device
        self.vocab_index = torch.arange(vocab, dtype=torch.int64, device=dev)
        self.logits = torch.full((self.max_num_reqs + 1, k, vocab), float("-inf"), dtype=torch.float32, device=dev)
        self.logits[:, :, 0] = 0.0
        self.point_tokens = torch.zeros(self.max_num_reqs + 1, k, dtype=torch.int64, device=dev)  # each mass's token
        self.positions = torch.arange(k, dtype=torch.int64, device=dev)
        # the values `point_masses` writes, as device tensors: `x[index] = 0.0` on a CUDA tensor copies a CPU scalar
        # over, which CUDA graph capture refuses
        self.minus_inf = torch.full((), float("-inf"), dtype=torch.float32, device=dev)
        self.zero = torch.zeros((), dtype=torch.float32, device=dev)
        return self.logits[:self.max_num_reqs]

    def draw(self, logits: torch.Tensor, slots: torch.Tensor, sampled: torch.Tensor, position: int) -> torch.Tensor:
        """Each row's head token at `position`, drawn from the drafter's `logits` at its request's temperature
        (fresh noise at every call); that distribution goes to the position's row of the draft logits (rows that do
        not sample write the scratch row)."""
        assert self.temperature is not None and self.logits is not None
        self.step.add_(1)
        token, processed = self._sample(logits, self.temperature[slots], self.seeds[slots], self.step,
                                        self.vocab_index)
        self.logits[torch.where(sampled, slots, self.max_num_reqs), position] = processed
        return token

    def point_masses(self, slots: torch.Tensor, sampled: torch.Tensor, sources: torch.Tensor, tokens: torch.Tensor,
                     head: int) -> None:
        """After the fusion rule: every position whose token is not the drafter's (the lookup's, or the pad after the
        block) becomes a point mass at its token. A head position (< `head`) keeps the drafter's distribution where
        its source is DRAFT, else is rewritten whole; a tail position is never the drafter's: its old point mass
        moves (two scattered writes a row). Under the settings this mode accepts (agree=0, rule=threshold) "source
        DRAFT" is the reference's `fusion.drafter_drawn` (tests/rules/test_fusion_sampling.py); the sources come from
        `fused_rules`, tested against the reference."""
        assert self.logits is not None
        index = torch.where(sampled, slots, self.max_num_reqs)
        logits, head = self.logits, min(head, self.k)
        if head < self.k:
            rows, cols = index[:, None], self.positions[None, head:]
            logits[rows, cols, self.point_tokens[index, head:]] = self.minus_inf
            logits[rows, cols, tokens[:, head:]] = self.zero
            self.point_tokens[index, head:] = tokens[:, head:]
        for j in range(head):
            drafted = (sources[:, j] == SOURCE_DRAFT)[:, None]
            point = point_mass_logits(tokens[:, j], logits.shape[-1])
            logits[index, j] = torch.where(drafted, logits[index, j], point)


__all__ = ["uniforms", "sample", "point_mass_logits", "DraftDistributions"]

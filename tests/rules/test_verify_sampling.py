"""Sampled speculative decoding must have exactly the target's output distribution (SPEC §2.6).

Two levels: (1) exact distributions of a tiny synthetic Markov "model" with both point-mass (lookup) and drafter
proposals, compared by a chi-square test over many samples; (2) real target distributions from the 0.5B model
on a real prompt. Each test also shows that the same check FAILS for deliberately broken verifiers, so the check
has teeth.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hqlab.bench.lossless import chi_square_pvalue
from hqlab.rules.verify import Verdict, sample_verify, target_probs

V = 6


# ---------------------------------------------------------------------------------------------------------------
# Deliberately broken verifiers (the checks below must catch them)


def broken_shared_uniform(proposed, p, generator, q=None, point_mass=None) -> Verdict:
    """The acceptance draw reuses the random number that also picks the replacement token (inverse CDF)."""
    n = len(proposed)
    out = []
    for i in range(n):
        x = int(proposed[i])
        u = float(torch.rand((), generator=generator))
        if u < float(p[i, x]):
            out.append(x)
            continue
        residual = p[i].clone()
        residual[x] = 0
        cdf = torch.cumsum(residual / residual.sum(), 0)
        out.append(int(torch.searchsorted(cdf, torch.tensor(u)).clamp(max=len(cdf) - 1)))
        return Verdict(i, out)
    out.append(int(torch.multinomial(p[n], 1, generator=generator)))
    return Verdict(n, out)


def broken_resample_from_p(proposed, p, generator, q=None, point_mass=None) -> Verdict:
    """On rejection, draws the replacement from p instead of the residual (a classic bug)."""
    n = len(proposed)
    out = []
    for i in range(n):
        x = int(proposed[i])
        if float(torch.rand((), generator=generator)) < float(p[i, x]):
            out.append(x)
            continue
        out.append(int(torch.multinomial(p[i], 1, generator=generator)))
        return Verdict(i, out)
    out.append(int(torch.multinomial(p[n], 1, generator=generator)))
    return Verdict(n, out)


# ---------------------------------------------------------------------------------------------------------------
# (1) tiny synthetic model: a Markov chain over V tokens, so exact joint distributions are computable


def markov(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 1.5
    return torch.softmax(logits, dim=-1)


def speculative_pairs(verify, trans: torch.Tensor, drafter: torch.Tensor | None, samples: int, seed: int):
    """Sample the first two emitted tokens after token 0. The proposal is either a fixed lookup guess
    (point mass, [1, 2]) or two tokens sampled from a drafter chain; the target verifies them."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(samples):
        if drafter is None:
            proposed = np.array([1, 2])
            q, pm = None, None
        else:
            a = int(torch.multinomial(drafter[0], 1, generator=gen))
            b = int(torch.multinomial(drafter[a], 1, generator=gen))
            proposed = np.array([a, b])
            q = torch.stack([drafter[0], drafter[a]])
            pm = np.array([False, False])
        p = torch.stack([trans[0], trans[int(proposed[0])], trans[int(proposed[1])]])
        verdict = verify(proposed, p, gen, q=q, point_mass=pm)
        first = verdict.emitted[0]
        if len(verdict.emitted) >= 2:
            second = verdict.emitted[1]
        else:  # rejected at position 0: the next token would come from a fresh step with context `first`
            second = int(torch.multinomial(trans[first], 1, generator=gen))
        counts[first, second] += 1
    return counts


@pytest.mark.parametrize("source", ["lookup", "drafter"])
def test_exact_distribution_tiny_model(source):
    trans = markov(1)
    drafter = None if source == "lookup" else markov(2)
    exact = (trans[0][:, None] * trans).numpy().ravel()  # P(x1, x2) under plain sampling
    counts = speculative_pairs(sample_verify, trans, drafter, samples=20_000, seed=3)
    assert chi_square_pvalue(counts.ravel(), exact) > 1e-3


@pytest.mark.parametrize("broken", [broken_shared_uniform, broken_resample_from_p])
def test_check_catches_broken_verifier_tiny_model(broken):
    trans = markov(1)
    exact = (trans[0][:, None] * trans).numpy().ravel()
    counts = speculative_pairs(broken, trans, None, samples=20_000, seed=3)
    assert chi_square_pvalue(counts.ravel(), exact) < 1e-6


def test_mixed_point_mass_and_drafter_rows():
    """A fused proposal: position 0 from the drafter (q), position 1 from lookup (point mass)."""
    trans, drafter = markov(4), markov(5)
    gen = torch.Generator().manual_seed(0)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(20_000):
        a = int(torch.multinomial(drafter[0], 1, generator=gen))
        proposed = np.array([a, 3])
        q = torch.stack([drafter[0], torch.zeros(V)])  # row 1 is ignored: a point mass
        p = torch.stack([trans[0], trans[a], trans[3]])
        v = sample_verify(proposed, p, gen, q=q, point_mass=np.array([False, True]))
        second = v.emitted[1] if len(v.emitted) > 1 else int(torch.multinomial(trans[v.emitted[0]], 1, generator=gen))
        counts[v.emitted[0], second] += 1
    exact = (trans[0][:, None] * trans).numpy().ravel()
    assert chi_square_pvalue(counts.ravel(), exact) > 1e-3


def test_target_probs_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = target_probs(logits, 1.0, top_k=2)
    assert torch.allclose(p[0, 2:], torch.zeros(2)) and abs(float(p.sum()) - 1) < 1e-6
    p = target_probs(logits, 1.0, top_p=0.5)  # the top token alone has ~64% mass
    assert float(p[0, 0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        target_probs(logits, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# (2) the real model: target distributions of a real prompt, first tokens sampled many times


@pytest.mark.slow
def test_real_model_first_tokens(engine_05b):
    eng = engine_05b
    prompt = eng.encode_chat([{"role": "user", "content": "Write one short sentence about the sea."}])
    with torch.inference_mode():
        # the proposal a lookup would make is deterministic: score prompt + [a guess] once, like a verify step
        ids = torch.tensor([prompt], device=eng.device)
        full = eng.model(input_ids=ids).logits[0, -1:].float()
        guess = int(torch.argsort(full[0], descending=True)[1])  # second-best token: rejected often
        ids2 = torch.tensor([prompt + [guess]], device=eng.device)
        logits = eng.model(input_ids=ids2).logits[0, -2:].float()
    p = target_probs(logits, temperature=1.0, top_k=8)
    exact = p[0].numpy()
    for verify, should_pass in [(sample_verify, True), (broken_shared_uniform, False), (broken_resample_from_p, False)]:
        gen = torch.Generator().manual_seed(11)
        counts = np.zeros(p.shape[1], dtype=np.int64)
        for _ in range(6000):
            counts[verify(np.array([guess]), p, gen).emitted[0]] += 1
        support = np.flatnonzero(exact > 0)
        pval = chi_square_pvalue(counts[support], exact[support] / exact[support].sum())
        assert (pval > 1e-3) if should_pass else (pval < 1e-6), (verify.__name__, pval)

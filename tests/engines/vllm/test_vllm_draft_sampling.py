"""`gpu-fused` with `draft_sample=probabilistic`: the drafter's token drawn from its own distribution at the request's
temperature, and the draft logits vLLM's rejection sampler reads (hqlab.engines.vllm.draft_sampling).

On the CPU: the draws follow softmax(logits / T) (a chi-square test), greedy rows take the argmax; through the
speculator (tiny random drafter, the suffix-match kernel in Triton's interpreter), every draft position carries the
distribution its token came from: the drafter's logits / T where the fused block holds the drafter's token, a point
mass elsewhere; at temperature 0 every block equals the greedy config's, and at 0.7 the drafter's tokens change. The
end-to-end check (outputs through `vllm serve` follow `none`'s distribution) is the GPU sampling test of
benchmarks/vllm_serve.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs its CPU-side packages)")

from scipy.stats import chisquare  # noqa: E402

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import draft_sampling  # noqa: E402
from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator, fused_config  # noqa: E402
from hqlab.rules.fusion import SOURCE_DRAFT  # noqa: E402


def _fused_tests():
    """The fused tests' driver and tiny drafter (test modules are not importable by name under
    --import-mode=importlib)."""
    import importlib.util
    import sys
    from pathlib import Path

    where = importlib.util.spec_from_file_location("_fused_tests", Path(__file__).with_name("test_vllm_gpu_fused.py"))
    module = sys.modules.get("_fused_tests")
    if module is None:
        module = sys.modules.setdefault("_fused_tests", importlib.util.module_from_spec(where))
        where.loader.exec_module(module)
    return module


_fused = _fused_tests()
INTERPRETER_ONLY, drive, copy_and_prose, tiny_qwen2 = (_fused.INTERPRETER_ONLY, _fused.drive,
                                                       _fused.copy_and_prose, _fused.tiny_qwen2)

BASE = "gpu-fused:k=7,draft_block=1,nmax=8,schedule=long,nmin_tail=1,device_skip=true"


def test_draws_follow_the_tempered_distribution_and_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 2
    temperature = torch.tensor([0.7, 1.0, 0.0])
    seeds = torch.tensor([11, 12, 13])
    index = torch.arange(40)
    draws = 6000
    counts = np.zeros((3, 40))
    for step in range(draws):
        tokens, processed = draft_sampling.sample(logits, temperature, seeds, torch.tensor([step]), index)
        counts[np.arange(3), tokens.numpy()] += 1
    assert torch.equal(processed[:2], logits[:2] / temperature[:2, None])
    assert torch.equal(processed[2], logits[2])  # a greedy row's logits as they are
    for row in range(2):
        p = torch.softmax(logits[row].double() / float(temperature[row]), -1).numpy()
        keep = p * draws >= 5  # the chi-square approximation's usual condition; the rest pooled
        observed = np.append(counts[row, keep], counts[row, ~keep].sum())
        expected = np.append(p[keep], p[~keep].sum())
        expected = expected / expected.sum() * observed.sum()
        assert chisquare(observed, expected).pvalue > 1e-3, row
    assert counts[2, int(logits[2].argmax())] == draws


def test_the_noise_is_fresh_at_every_step_and_differs_between_seeds():
    index = torch.arange(1000)
    a = draft_sampling.uniforms(torch.tensor([5]), torch.tensor([1]), index)
    assert torch.equal(a, draft_sampling.uniforms(torch.tensor([5]), torch.tensor([1]), index))  # a pure function
    for other in (draft_sampling.uniforms(torch.tensor([5]), torch.tensor([2]), index),
                  draft_sampling.uniforms(torch.tensor([6]), torch.tensor([1]), index)):
        assert abs(float(np.corrcoef(a[0].numpy(), other[0].numpy())[0, 1])) < 0.1
    assert 0 < float(a.min()) and float(a.max()) < 1


@pytest.mark.parametrize("spec", ["gpu-fused:k=7,draft_block=2,rule=score,draft_sample=probabilistic",
                                  "gpu-fused:k=7,draft_block=1,agree=1,draft_sample=probabilistic",
                                  "gpu-fused:k=7,draft_block=1,draft_sample=sometimes"])
def test_settings_where_q_would_not_be_the_proposal_are_refused(spec):
    with pytest.raises(ConfigError, match="draft_sample"):
        fused_config(spec)


def run(spec_text: str, temperature: float | None, device: str = "cpu",
        graphs: bool = False) -> tuple[list, list, GpuFusedSpeculator]:
    """copy_and_prose through a speculator (prose in slot 0, copy in slot 1); per step the drafts and, with
    draft_sample=probabilistic, a copy of the draft logits and sources of the step's rows (read after the step: with
    `graphs` the step is replayed from its captured graph)."""
    from types import SimpleNamespace

    config = fused_config(spec_text)
    spec = GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=480, pad=63, device=device,
                                         dtype=torch.float32)
    ids = torch.zeros(2, 480, dtype=torch.int32, device=device)
    total = torch.zeros(2, dtype=torch.int32, device=device)
    spec.bind(ids, total)
    spec.attach_drafter(tiny_qwen2(2, spec.cache_len, device=device))
    if spec.draws:
        spec.bind_sampling(torch.full((2,), float(temperature), device=device))
    if graphs:
        spec.init_cudagraph_manager(SimpleNamespace(name="FULL"))
        spec.capture()
        assert spec.graphs, "capturing the drafting step failed"
    seen = []
    original = spec.step

    def watched(req_ids, *args):
        out = original(req_ids, *args)
        m = len(req_ids)
        if spec.draws:
            seen.append(tuple(x.to("cpu", copy=True) for x in (spec.slots[:m], out[:m], spec.step_rule.sources[:m],
                                                                spec.draft_logits[spec.slots[:m]],
                                                                spec.num_sampled[:m])))
        return out
    spec.step = watched
    steps = drive(spec, copy_and_prose(), {"copy": 1, "prose": 0}, ids, total, config.k)
    return steps, seen, spec


def check_distributions(seen: list, head: int = 1) -> None:
    """Every position of every sampling row: the drafter's whole distribution where the block holds its token (only
    head positions, < `head`, can), else a point mass at the proposed token (or the pad); both kinds occur."""
    drafted = points = 0
    for slots, out, sources, logits, num_sampled in seen:
        for row in range(out.shape[0]):
            if num_sampled[row] <= 0:
                continue
            finite = torch.isfinite(logits[row])
            for j in range(out.shape[1]):
                if int(sources[row, j]) == SOURCE_DRAFT:
                    assert j < head
                    drafted += 1
                    assert bool(finite[j].all())  # the drafter's whole distribution at T = 0.7
                else:
                    points += 1
                    assert finite[j].nonzero().flatten().tolist() == [int(out[row, j])]
                    assert float(logits[row, j, out[row, j]]) == 0.0
    assert drafted > 10 and points > 10  # both kinds of position ran (prose drafts, the copy takes the lookup's)


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_at_temperature_zero_every_block_is_the_greedy_configs():
    greedy, _, _ = run(BASE, None)
    sampled, _, _ = run(BASE + ",draft_sample=probabilistic", 0.0)
    assert sampled == greedy


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_every_draft_position_carries_the_distribution_its_token_came_from():
    greedy, _, _ = run(BASE, None)
    steps, seen, _ = run(BASE + ",draft_sample=probabilistic", 0.7)
    check_distributions(seen)
    assert steps != greedy  # sampling changed some of the drafter's tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_a_head_of_two_draws_both_tokens_and_carries_both_distributions():
    """draft_block=2 (no device_skip): the second head token is drawn from the drafter's distribution after its first
    draw; at T = 0 the blocks are the greedy config's."""
    spec = "gpu-fused:k=7,draft_block=2,nmax=8,schedule=long,nmin_tail=1"
    greedy, _, _ = run(spec, None)
    zero, _, _ = run(spec + ",draft_sample=probabilistic", 0.0)
    assert zero == greedy
    steps, seen, _ = run(spec + ",draft_sample=probabilistic", 0.7)
    check_distributions(seen, head=2)
    assert any(int(s[2][r, 1]) == SOURCE_DRAFT for s in seen for r in range(s[2].shape[0]))
    assert steps != greedy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("spec, head", [
    (BASE, 1),  # device_skip's conditional nodes around the drafter, the draw and its step counter inside them
    ("gpu-fused:k=7,draft_block=3,nmax=8,schedule=long,nmin_tail=1,compile_rule=true", 3),  # plan s5's three-token
])                                                                                          # head, compiled rule
def test_in_cuda_graphs_greedy_rows_are_unchanged_and_sampled_rows_carry_their_distributions(spec, head):
    """The same two checks with the drafting step replayed from its captured graphs. The capture must succeed: a
    failed one falls back to eager drafting (a warning), which passes the checks but is not what vLLM runs."""
    greedy, _, _ = run(spec, None, "cuda", graphs=True)
    zero, _, _ = run(spec + ",draft_sample=probabilistic", 0.0, "cuda", graphs=True)
    assert zero == greedy
    steps, seen, _ = run(spec + ",draft_sample=probabilistic", 0.7, "cuda", graphs=True)
    check_distributions(seen, head=head)
    assert steps != greedy
    # fresh noise at every replay: the drafted tokens of prose (slot 0) are not one step's draw repeated
    again, _, _ = run(spec + ",draft_sample=probabilistic", 0.7, "cuda", graphs=True)
    assert again != steps


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_the_drafted_distribution_is_the_drafters_own_at_the_temperature():
    """Position 0's logits are the drafter's next-token logits / T for the history it read: recomputed from a fresh
    drafter fed the same tokens."""
    steps, seen, spec = run(BASE + ",draft_sample=probabilistic", 0.7)
    slots, out, sources, logits, num_sampled = seen[0]
    row = slots.tolist().index(0)  # slot 0 holds prose; at its first step the drafter read its prompt and first token
    assert int(sources[row, 0]) == SOURCE_DRAFT
    reqs = copy_and_prose()
    prompt, target = reqs["prose"]
    fresh = tiny_qwen2(1, spec.cache_len)
    tokens = torch.tensor([prompt + target[:1]])
    expect = fresh.logits(torch.zeros(1, dtype=torch.int64), tokens, torch.zeros(1, dtype=torch.int64),
                          torch.tensor([tokens.shape[1] - 1]), attn_len=spec.cache_len)[0] / 0.7
    torch.testing.assert_close(logits[row, 0], expect.float(), rtol=1e-4, atol=1e-4)

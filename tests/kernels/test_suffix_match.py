"""Triton suffix-match kernels against the reference `hqlab.rules.lookup.suffix_match`, bit for bit.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before the kernel module is
imported), with small blocks so that multi-block scans and split programs are exercised on short histories.
With CUDA the same file runs natively with more and longer cases, plus a 1M-token history, a batch whose
concatenated tokens exceed 2^31 bytes, and a CUDA-graph replay.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit definition

from hqlab.rules.lookup import suffix_match  # noqa: E402
from kernel_module import kernel_module  # noqa: E402


sm = kernel_module("suffix_match")
DEVICE = "cuda" if CUDA else "cpu"

# Interpreter: ~0.5 ms per program and ~60 µs per loop iteration, so short histories and few programs.
N_BATCHES = 240 if CUDA else 48
BATCH = 32 if CUDA else 16
MAX_LEN = 20_000 if CUDA else 1_000
BLOCKS = (1024, 128) if CUDA else (128, 256, 1024)  # few block sizes on the GPU: each compiles
SPLITS = (1, 2, 3, 5, 64, 256) if CUDA else (1, 2, 3, 5, 8)
WIDE = 64 if CUDA else 8  # programs per request of the widest split tested by hand


# ----------------------------------------------------------------------------------------------------------------
# Random histories and batches
# ----------------------------------------------------------------------------------------------------------------


def random_history(rng: np.random.Generator, max_len: int, nmin: int) -> np.ndarray:
    kind = rng.choice(["large", "small", "periodic", "planted", "tiny", "int32_range"],
                      p=[0.2, 0.25, 0.2, 0.2, 0.1, 0.05])
    n = int(rng.integers(0, max_len + 1))
    if kind == "large":
        return rng.integers(0, int(rng.choice([50, 1000, 150_000])), n)
    if kind == "small":  # many matches and ties
        return rng.integers(0, int(rng.integers(1, 5)), n)
    if kind == "periodic":  # overlap with the suffix: matches at e = t - period
        period = int(rng.integers(1, 10))
        unit = rng.integers(0, 20, period)
        return np.concatenate([np.resize(unit, n), rng.integers(0, 6, int(rng.integers(0, 6)))])
    if kind == "planted":  # a copy of an earlier span at the end: long matches, nmax caps, ties
        h = rng.integers(0, 1000, max(n, 2))
        span = int(rng.integers(1, 25))
        src = int(rng.integers(0, len(h)))
        return np.concatenate([h, h[src : src + span]])
    if kind == "tiny":  # around the shortest history that can match (nmin + 1 tokens)
        return rng.integers(0, 2, int(rng.integers(0, nmin + 3)))
    # token values at the ends of the int32 range: the kernels compare values, they never assume a vocabulary
    return rng.choice(np.array([-(2**31), -1, 0, 2**31 - 1]), n)


def random_params(rng: np.random.Generator) -> dict:
    nmin = int(rng.integers(1, 9))
    return dict(
        nmin=nmin,
        nmax=nmin + int(rng.choice([0, 0, 1, 3, 6, 8, 20])),
        k=int(rng.choice([1, 2, 5, 7, 15, 16, 20, 32])),
        search=int(rng.choice([0, 0, 0, 0, 0, 0, 1, 5, 17, 200])),
        policy=str(rng.choice(["recent", "earliest"])),
        full=bool(rng.random() < 0.25),
    )


def pack_ragged(histories: list[np.ndarray], rng: np.random.Generator | None = None, device: str = DEVICE):
    """Concatenate histories in shuffled order with random filler between them, so a kernel that reads past a
    history's bounds sees tokens that change its answer."""
    order = list(range(len(histories))) if rng is None else list(rng.permutation(len(histories)))
    pieces, offsets, at = [], [0] * len(histories), 0
    for i in order:
        gap = 0 if rng is None else int(rng.integers(0, 5))
        pieces.append(np.full(gap, 3, dtype=np.int64) if rng is None else rng.integers(0, 4, gap))
        at += gap
        offsets[i] = at
        pieces.append(np.asarray(histories[i], dtype=np.int64))
        at += len(histories[i])
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    tokens = torch.from_numpy(flat.astype(np.int32)).to(device)
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64, device=device)
    return tokens, torch.tensor(offsets, dtype=torch.int64, device=device), lengths


def expected(histories, params):
    return [suffix_match(np.asarray(h, dtype=np.int32), **params) for h in histories]


def assert_same(histories, params, result, label=""):
    proposals, match_len, valid = (x.cpu().numpy() for x in result)
    assert proposals.shape == (len(histories), params["k"])
    for i, (h, ref) in enumerate(zip(histories, expected(histories, params))):
        got = (int(match_len[i]), int(valid[i]), proposals[i, : valid[i]].tolist())
        want = (ref.match_len, ref.valid, ref.tokens.tolist())
        assert got == want, f"{label} request {i} (len {len(h)}, {params}): kernel {got} != reference {want}"
        assert (proposals[i, valid[i] :] == sm.PAD_TOKEN).all(), f"{label} request {i}: entries past valid"


def run_kernel(histories, params, variant, rng=None, **launch):
    tokens, offsets, lengths = pack_ragged(histories, rng)
    return sm.suffix_match_batch(tokens, offsets, lengths, variant=variant, **params, **launch)


# ----------------------------------------------------------------------------------------------------------------
# Randomized equality: N_BATCHES × BATCH requests per variant
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["single", "split", "fused"])
@pytest.mark.parametrize("seed", range(N_BATCHES))
def test_random_batches_match_reference(seed, variant):
    rng = np.random.default_rng([seed, ["single", "split", "fused"].index(variant)])
    params = random_params(rng)
    histories = [random_history(rng, MAX_LEN, params["nmin"]) for _ in range(BATCH)]
    block = int(rng.choice(BLOCKS))
    splits = None if variant == "single" else int(rng.choice(SPLITS))
    result = run_kernel(histories, params, variant, rng, block=block, splits=splits)
    assert_same(histories, params, result, f"{variant} block={block} splits={splits}")


@pytest.mark.parametrize("policy", ["recent", "earliest"])
def test_auto_variant_and_batch_of_mixed_lengths(policy):
    rng = np.random.default_rng(7)
    lengths = [0, 1, 2, 3, 7, 100, 2_000, 30_000 if CUDA else 6_000, 5, 0]
    histories = [rng.integers(0, 3, n) for n in lengths]
    params = dict(nmin=3, nmax=12, k=15, policy=policy)
    for max_len in (None, 10, 1_000_000 if CUDA else 20_000):  # steers the plan only, never the result
        assert_same(histories, params, run_kernel(histories, params, "auto", rng, max_len=max_len), f"{max_len}")


# ----------------------------------------------------------------------------------------------------------------
# Hand-made edges
# ----------------------------------------------------------------------------------------------------------------

VARIANTS = [("single", {}), ("split", {"splits": 3, "block": 16}), ("split", {"splits": WIDE}),
            ("fused", {"splits": 3, "block": 16}), ("fused", {"splits": WIDE})]


@pytest.mark.parametrize("variant,launch", VARIANTS)
def test_ties_caps_and_overlap(variant, launch):
    h = np.array([1, 2, 3, 4, 50, 9, 3, 4, 60, 1, 2, 3, 4])
    periodic = np.array([7, 8, 9] * 6)
    same = np.array([5] * 40)  # every end matches: the cap makes all ties
    for params in [dict(nmin=2, nmax=8, k=3), dict(nmin=2, nmax=2, k=3), dict(nmin=2, nmax=2, k=3, policy="earliest"),
                   dict(nmin=2, nmax=12, k=15), dict(nmin=1, nmax=1, k=1), dict(nmin=4, nmax=40, k=4, full=True),
                   dict(nmin=3, nmax=5, k=2, search=3), dict(nmin=1, nmax=64, k=20, policy="earliest")]:
        histories = [h, periodic, same]
        assert_same(histories, params, run_kernel(histories, params, variant, **launch), variant)


@pytest.mark.parametrize("variant,launch", VARIANTS)
def test_short_and_empty_histories(variant, launch):
    histories = [[], [5], [5, 5], [5, 5, 5], [5, 6, 5], [1, 2, 3, 9, 1, 2, 3], [4] * 7]
    for nmin in range(1, 8):
        params = dict(nmin=nmin, nmax=nmin + 2, k=4)
        assert_same(histories, params, run_kernel(histories, params, variant, **launch), f"nmin={nmin}")


@pytest.mark.parametrize("variant", ["single", "split", "fused"])
def test_empty_batch(variant):
    tokens, offsets, lengths = pack_ragged([])
    p, n, v = sm.suffix_match_batch(tokens, offsets, lengths, nmin=2, nmax=4, k=3, variant=variant)
    assert p.shape == (0, 3) and n.shape == (0,) and v.shape == (0,)


@pytest.mark.parametrize("variant", ["single", "split", "fused"])
def test_long_history_30k(variant):
    rng = np.random.default_rng(30)
    h = rng.integers(0, 1000, 30_000)
    h[-8:] = h[1000:1008]
    small = rng.integers(0, 2, 30_000)
    histories = [h, small]
    params = dict(nmin=6, nmax=12, k=15)
    assert_same(histories, params, run_kernel(histories, params, variant), variant)


def test_int32_lengths_and_shared_storage():
    # Two requests may point into the same storage (a shared prompt); lengths may be int32.
    rng = np.random.default_rng(3)
    base = rng.integers(0, 3, 500)
    tokens = torch.from_numpy(base.astype(np.int32)).to(DEVICE)
    offsets = torch.tensor([0, 0, 100, 499], dtype=torch.int64, device=DEVICE)
    lengths = torch.tensor([500, 300, 400, 1], dtype=torch.int32, device=DEVICE)
    histories = [base[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
    params = dict(nmin=2, nmax=9, k=6)
    for variant in ("single", "split", "fused"):
        result = sm.suffix_match_batch(tokens, offsets, lengths, variant=variant, **params)
        assert_same(histories, params, result, variant)


@pytest.mark.parametrize("variant", ["single", "split", "fused"])
def test_matcher_reuse_resets_scratch_and_writes_every_output(variant):
    rng = np.random.default_rng(11)
    params = dict(nmin=2, nmax=6, k=5)
    matcher = sm.SuffixMatcher(8, k=5, nmin=2, nmax=6, variant=variant, max_len=3_000, device=DEVICE)
    for step in range(3):
        histories = [rng.integers(0, 4, int(rng.integers(0, 600))) for _ in range(int(rng.integers(1, 9)))]
        # poison the outputs: every entry must be written by the call
        matcher.proposals.fill_(-77), matcher.match_len.fill_(-77), matcher.valid.fill_(-77)
        result = matcher(*pack_ragged(histories, rng))
        assert_same(histories, params, result, f"step {step}")
        assert int(matcher.scratch.abs().sum()) == 0 and int(matcher.arrivals.abs().sum()) == 0


def test_invalid_options_raise():
    tokens, offsets, lengths = pack_ragged([[1, 2, 1, 2]])
    good = dict(nmin=1, nmax=2, k=2)
    for bad in [dict(policy="latest"), dict(nmin=0), dict(nmin=3, nmax=2), dict(k=0), dict(search=-1),
                dict(variant="fast")]:
        with pytest.raises(ValueError):
            sm.suffix_match_batch(tokens, offsets, lengths, **{**good, **bad})
    with pytest.raises(ValueError):
        sm.SuffixMatcher(1, 2, block=100, device=DEVICE)
    with pytest.raises(TypeError):
        sm.suffix_match_batch(tokens.long(), offsets, lengths, **good)
    with pytest.raises(TypeError):
        sm.suffix_match_batch(tokens, offsets.int(), lengths, **good)
    with pytest.raises(ValueError):
        sm.SuffixMatcher(1, 2, device=DEVICE)(*pack_ragged([[1], [2]]))  # batch beyond max_batch


# ----------------------------------------------------------------------------------------------------------------
# The torch-vectorized baseline used by the benchmark gives the same answers
# ----------------------------------------------------------------------------------------------------------------


def pad(histories, device=DEVICE):
    width = max([len(h) for h in histories] + [1])
    padded = np.zeros((len(histories), width), dtype=np.int32)
    for i, h in enumerate(histories):
        padded[i, : len(h)] = h
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64, device=device)
    return torch.from_numpy(padded).to(device), lengths


@pytest.mark.parametrize("seed", range(20))
def test_torch_baseline_matches_reference(seed):
    rng = np.random.default_rng([seed, 99])
    params = random_params(rng)
    histories = [random_history(rng, 800, params["nmin"]) for _ in range(12)]
    histories = [np.clip(h, 0, None) for h in histories]  # the baseline assumes non-negative token ids
    assert_same(histories, params, sm.suffix_match_torch(*pad(histories), **params), "torch")


# ----------------------------------------------------------------------------------------------------------------
# GPU only: 1M tokens, offsets past 2^31 bytes, CUDA graphs
# ----------------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("variant", ["single", "split", "fused"])
def test_million_token_history(variant):
    rng = np.random.default_rng(1)
    big = rng.integers(0, 50_000, 1_200_000)
    big[-10:] = big[17:27]  # the only long match is at the very start
    late = rng.integers(0, 50_000, 1_100_000)
    late[-9:] = late[-500_009:-500_000]
    histories = [big, late, rng.integers(0, 2, 1_000_000)]
    for params in [dict(nmin=6, nmax=12, k=15), dict(nmin=3, nmax=8, k=7, policy="earliest")]:
        assert_same(histories, params, run_kernel(histories, params, variant), variant)


@needs_cuda
@pytest.mark.parametrize("variant", ["single", "split", "fused"])
def test_offsets_beyond_2_31_bytes(variant):
    # 600M int32 tokens = 2.4 GB: the last histories start past 2^31 bytes and past 2^31 / 4 elements.
    rng = np.random.default_rng(5)
    total = 600_000_000
    tokens = torch.randint(0, 30_000, (total,), dtype=torch.int32, device="cuda")
    histories = [rng.integers(0, 30_000, 50_000), rng.integers(0, 3, 4_000), rng.integers(0, 30_000, 9_000)]
    histories[0][-7:] = histories[0][100:107]
    histories[2][-12:] = histories[2][8_000:8_012]
    starts = [total - 200_000, 2**29 + 3, total - 9_000]  # 2**29 int32 = 2^31 bytes
    for h, s in zip(histories, starts):
        tokens[s : s + len(h)] = torch.from_numpy(h.astype(np.int32)).cuda()
    offsets = torch.tensor(starts, dtype=torch.int64, device="cuda")
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64, device="cuda")
    params = dict(nmin=4, nmax=12, k=15)
    result = sm.suffix_match_batch(tokens, offsets, lengths, variant=variant, **params)
    assert_same(histories, params, result, variant)
    del tokens
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("variant", ["single", "split", "fused"])
def test_cuda_graph_replay_equals_eager(variant):
    rng = np.random.default_rng(21)
    capacity, max_batch, params = 400_000, 16, dict(nmin=3, nmax=12, k=15)
    tokens = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(max_batch, dtype=torch.int64, device="cuda")
    lengths = torch.zeros(max_batch, dtype=torch.int64, device="cuda")
    matcher = sm.SuffixMatcher(max_batch, variant=variant, max_len=20_000, device="cuda", **params)
    eager = sm.SuffixMatcher(max_batch, variant=variant, max_len=20_000, device="cuda", **params)

    def refill(step):
        histories = [random_history(rng, 20_000, 3) for _ in range(max_batch)]
        t, o, n = pack_ragged(histories, rng)
        tokens[: len(t)] = t
        offsets.copy_(o), lengths.copy_(n)
        return histories

    refill(0)
    matcher(tokens, offsets, lengths)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = matcher(tokens, offsets, lengths)
    for step in range(1, 6):
        histories = refill(step)
        graph.replay()
        want = eager(tokens, offsets, lengths)
        torch.cuda.synchronize()
        for got, ref in zip(captured, want):
            assert torch.equal(got, ref), f"step {step}"
        assert_same(histories, params, captured, f"graph step {step}")

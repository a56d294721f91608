"""The GPU corpus (`hqlab_kernels.corpus_match`) against the reference rule `hqlab.rules.corpus`, decision for decision:
the same live documents after every add (FIFO eviction, wrap-around in the ring), and for every request the same
match length, corpus position, valid count and proposal.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before the kernel module is imported)
with small rings and blocks, so wrap-around, multi-block scans and split programs happen on short inputs. Inputs:
random token streams (small alphabets: many ties) and real text (the words of the repository's prose workload and
docs as token ids: natural repetition, long matches across documents).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit definition

from hqlab.rules.corpus import Corpus, CorpusConfig  # noqa: E402
from kernel_module import kernel_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


cm = kernel_module("corpus_match")
DEVICE = "cuda" if CUDA else "cpu"
N_SEEDS = 120 if CUDA else 24
SCALE = 20 if CUDA else 1  # ring sizes and document lengths grow with it on the GPU


def real_words() -> np.ndarray:
    """The words of the prose workload and two docs pages as token ids (first-seen order), in reading order."""
    text = []
    for line in (ROOT / "data" / "workloads" / "prose.jsonl").read_text().splitlines():
        text.append(json.dumps(json.loads(line)))
    for page in ("README.md", "docs/vllm.md"):
        text.append((ROOT / page).read_text())
    words = re.findall(r"\w+|[^\w\s]", "\n".join(text))
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(w, len(ids)) for w in words], dtype=np.int64)


WORDS = real_words()


def random_doc(rng: np.random.Generator, kind: str, max_len: int) -> np.ndarray:
    n = int(rng.integers(0, max_len + 1))
    if kind == "words":
        start = int(rng.integers(0, len(WORDS) - n))
        return WORDS[start : start + n]
    if kind == "small":
        return rng.integers(0, int(rng.integers(1, 4)), n)
    return rng.integers(0, 50, n)


def random_history(rng: np.random.Generator, kind: str, docs: list[np.ndarray], max_len: int, nmin: int):
    """A history that often ends in a piece of a document (long matches, ties between copies), sometimes not."""
    h = random_doc(rng, kind, max_len)
    live = [d for d in docs if len(d)]
    if live and rng.random() < 0.7:
        d = live[int(rng.integers(0, len(live)))]
        a = int(rng.integers(0, len(d)))
        b = int(rng.integers(a, len(d) + 1))
        h = np.concatenate([h, d[a:b]])
    if rng.random() < 0.1:
        h = h[: int(rng.integers(0, nmin + 2))]  # around the shortest history that can match
    return h


def pack(histories):
    """Ragged batch with filler between histories, so reading past a history's bounds changes the answer."""
    pieces, offsets, at = [], [], 0
    for h in histories:
        pieces += [np.full(3, 7, dtype=np.int64), np.asarray(h, dtype=np.int64)]
        offsets.append(at + 3)
        at += 3 + len(h)
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return (torch.from_numpy(flat.astype(np.int32)).to(DEVICE), torch.tensor(offsets, dtype=torch.int64, device=DEVICE),
            torch.tensor([len(h) for h in histories], dtype=torch.int64, device=DEVICE))


def same_documents(ring, corpus, label):
    got = [(s, d.tolist()) for s, d in ring.documents()]
    want = [(s, d.tolist()) for s, d in corpus.documents]
    assert got == want, f"{label}: live documents differ"
    assert ring.live == corpus.live_tokens and ring.inserted == corpus.inserted
    assert ring.state.tolist() == [ring.head, ring.live]


def same_matches(matcher, ring, corpus, histories, params, label):
    proposals, match_len, valid, end = (x.cpu().numpy() for x in matcher(*pack(histories), ring))
    for i, h in enumerate(histories):
        ref = corpus.match(np.asarray(h, dtype=np.int64), **params)
        got = (int(match_len[i]), int(end[i]), int(valid[i]), proposals[i, : valid[i]].tolist())
        want = (ref.match_len, ref.end, ref.valid, ref.tokens.tolist())
        assert got == want, f"{label} request {i} (len {len(h)}, {params}): kernel {got} != reference {want}"
        assert (proposals[i, valid[i]:] == cm.PAD_TOKEN).all(), f"{label} request {i}: entries past valid"


@pytest.mark.parametrize("kind", ["words", "small", "large"])
@pytest.mark.parametrize("seed", range(N_SEEDS))
def test_random_corpora_match_reference(seed, kind):
    rng = np.random.default_rng([seed, ["words", "small", "large"].index(kind)])
    capacity = int(rng.choice([1, 7, 40, 150, 400])) * SCALE
    config = CorpusConfig(tokens=capacity, docs=int(rng.choice([1, 3, 8, 1000])))
    nmin = int(rng.integers(1, 6))
    params = dict(nmin=nmin, nmax=nmin + int(rng.choice([0, 1, 4, 12, 30])), k=int(rng.choice([1, 3, 15, 20])),
                  policy=str(rng.choice(["recent", "earliest"])))
    block = int(rng.choice([16, 32, 64]))
    splits = int(rng.choice([1, 2, 5]))
    ring = cm.CorpusRing(capacity, config.docs, DEVICE)
    corpus = Corpus(config)
    matcher = cm.CorpusMatcher(8, params["k"], nmin=nmin, nmax=params["nmax"], policy=params["policy"],
                               capacity=capacity, device=DEVICE, block=block, splits=splits)
    added: list[np.ndarray] = []
    for step in range(4):  # documents arrive between lookups, so eviction and wrap-around happen mid-stream
        for _ in range(int(rng.integers(0, 4))):
            d = random_doc(rng, kind, max(2, capacity // 3 if rng.random() < 0.8 else capacity + 5))
            assert ring.add(d) == corpus.add(d)
            added.append(d)
        same_documents(ring, corpus, f"step {step}")
        histories = [random_history(rng, kind, [d for _, d in corpus.documents], 30 * SCALE, nmin)
                     for _ in range(int(rng.integers(1, 9)))]
        same_matches(matcher, ring, corpus, histories, params, f"step {step} block={block} splits={splits}")
        assert int(matcher.scratch.abs().sum()) == 0 and int(matcher.arrivals.abs().sum()) == 0


def test_boundaries_clipping_and_ties_by_hand():
    ring = cm.CorpusRing(12, 10, DEVICE)
    corpus = Corpus(CorpusConfig(tokens=12, docs=10))
    for d in ([1, 2, 3, 4, 5], [9, 1, 2, 3, 7], [2, 3, 4]):  # 13 tokens > 12: the first goes, the third wraps
        ring.add(d), corpus.add(d)
    same_documents(ring, corpus, "wrapped")
    assert ring.head == 5 and ring.write == 1  # the third document runs over the ring's end
    histories = [[5, 1, 2, 3], [1, 2, 3, 4], [2, 3, 7], [4], [], [8, 8]]
    matcher = cm.CorpusMatcher(len(histories), 4, nmin=1, nmax=8, capacity=12, device=DEVICE, block=16, splits=2)
    for policy in ("recent", "earliest"):
        matcher.policy = policy
        same_matches(matcher, ring, corpus, histories, dict(nmin=1, nmax=8, k=4, policy=policy), policy)


def test_clear_starts_over_on_the_same_tensors():
    """What the speculator's reset does between benchmark points: a cleared ring behaves as a new one, and a graph
    captured before the clear (it holds the tensors) sees the new documents."""
    ring = cm.CorpusRing(10, 4, DEVICE)
    for d in ([1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 2, 7]):
        ring.add(d)
    tensors = (ring.tokens, ring.doc_off, ring.doc_rem, ring.state)
    ring.clear()
    assert ring.live == 0 and ring.inserted == 0 and ring.state.tolist() == [0, 0] and ring.documents() == []
    corpus = Corpus(CorpusConfig(tokens=10, docs=4))
    for d in ([1, 2, 9, 9], [3, 1, 2, 5, 5, 5]):
        assert ring.add(d) == corpus.add(d)
    assert all(a is b for a, b in zip((ring.tokens, ring.doc_off, ring.doc_rem, ring.state), tensors))
    same_documents(ring, corpus, "after clear")
    matcher = cm.CorpusMatcher(2, 3, nmin=1, nmax=4, capacity=10, device=DEVICE, block=16)
    same_matches(matcher, ring, corpus, [[0, 1, 2], [7, 3]], dict(nmin=1, nmax=4, k=3, policy="recent"), "clear")


def test_empty_corpus_and_empty_batch():
    ring = cm.CorpusRing(16, 4, DEVICE)
    matcher = cm.CorpusMatcher(2, 3, nmin=1, nmax=4, capacity=16, device=DEVICE, block=16)
    p, n, v, e = matcher(*pack([[1, 2, 1], []]), ring)
    assert n.tolist() == [0, 0] and v.tolist() == [0, 0] and e.tolist() == [-1, -1] and (p == -1).all()
    p, n, v, e = matcher(*pack([]), ring)
    assert p.shape == (0, 3)
    assert ring.add([]) == -1 and ring.inserted == 0


def test_invalid_options_raise():
    with pytest.raises(ValueError):
        cm.CorpusRing(0, 4, DEVICE)
    with pytest.raises(ValueError):
        cm.CorpusRing(8, 0, DEVICE)
    for bad in [dict(policy="latest"), dict(nmin=0), dict(nmin=3, nmax=2), dict(k=0), dict(block=100)]:
        kw = {**dict(nmin=1, nmax=2, k=2), **bad}
        with pytest.raises(ValueError):
            cm.CorpusMatcher(1, kw.pop("k"), device=DEVICE, **kw)


needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_graph_sees_documents_added_after_capture():
    rng = np.random.default_rng(4)
    config = CorpusConfig(tokens=50_000, docs=64)
    ring, corpus = cm.CorpusRing(config.tokens, config.docs, "cuda"), Corpus(config)
    params = dict(nmin=2, nmax=16, k=15, policy="earliest")
    matcher = cm.CorpusMatcher(8, 15, nmin=2, nmax=16, policy="earliest", capacity=config.tokens, device="cuda")
    histories = [WORDS[i * 300 : i * 300 + 400] for i in range(8)]
    tokens, offsets, lengths = pack(histories)
    matcher(tokens, offsets, lengths, ring)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matcher(tokens, offsets, lengths, ring)
    for step in range(6):
        for _ in range(12):
            start = int(rng.integers(0, len(WORDS) - 3000))
            d = WORDS[start : start + int(rng.integers(1, 3000))]
            ring.add(d), corpus.add(d)
        graph.replay()
        proposals, match_len, valid, end = (x.cpu().numpy() for x in (matcher.proposals, matcher.match_len,
                                                                      matcher.valid, matcher.end))
        for i, h in enumerate(histories):
            ref = corpus.match(h, **params)
            assert (int(match_len[i]), int(end[i]), proposals[i, : valid[i]].tolist()) == \
                (ref.match_len, ref.end, ref.tokens.tolist()), f"step {step} request {i}"

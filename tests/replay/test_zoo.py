"""The baseline adapters reproduce their own libraries on real traces, and the zoo's bookkeeping is right.

vLLM and Arctic Inference are optional extras: their tests are skipped where they are not installed."""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results
from hqlab.proposers import make_proposer
from hqlab.replay import replay, zoo
from hqlab.replay.traces import load_traces

(TRACES,) = results.trace_files(["0.5b_all_128"])
has_vllm = importlib.util.find_spec("vllm") is not None
has_arctic = importlib.util.find_spec("arctic_inference") is not None


@pytest.fixture(scope="module")
def traces():
    return load_traces(TRACES)


@pytest.mark.skipif(not has_vllm, reason="vLLM (optional extra) is not installed")
def test_vllm_adapter_equals_vllms_own_search_and_hqlab_earliest(traces):
    """At every step of every real trace the adapter proposes what vLLM's own search function returns for that
    context, and that is hqlab's lookup with the earliest-occurrence policy (the SPEC's claim, checked)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_search

    for nmin, nmax, k in [(1, 32, 15), (5, 5, 15), (2, 4, 7)]:
        adapter = make_proposer(f"vllm-ngram:nmin={nmin},nmax={nmax},k={k}")
        hqlab = make_proposer(f"lookup:nmin={nmin},nmax={nmax},k={k},policy=earliest")
        for t in traces:
            got = replay(t.prompt_ids, t.output_ids, adapter, max_new_tokens=t.max_new_tokens, request=t.prompt_id)
            history = np.asarray([*t.prompt_ids, *t.output_ids], dtype=np.int32)
            for r in got:
                budget = t.max_new_tokens - (r.context_len - len(t.prompt_ids) + 1) - 1
                native = vllm_search(history[: r.context_len + 1], nmin, nmax, 32768, k)[:max(budget, 0)]
                assert r.proposed == native.tolist(), (t.prompt_id, r.step)
            ref = replay(t.prompt_ids, t.output_ids, hqlab, max_new_tokens=t.max_new_tokens, request=t.prompt_id)
            assert [r.proposed for r in got] == [r.proposed for r in ref], t.prompt_id
    # a batch call proposes per row as single calls do (vLLM's batched path, several requests at once)
    histories = [np.asarray([*t.prompt_ids, *t.output_ids[:40]]) for t in traces]
    batched = adapter.propose(histories, [k] * len(histories))
    assert [p.tokens.tolist() for p in batched] == [adapter.propose([h], [k])[0].tokens.tolist() for h in histories]


def _arctic_simulator():
    """Arctic's own simulator function. Its module imports pandas for dataset handling (and annotations) only;
    the function we call does not use it, so a placeholder stands in when pandas is absent."""
    if importlib.util.find_spec("pandas") is None and "pandas" not in sys.modules:
        sys.modules["pandas"] = types.ModuleType("pandas")
        sys.modules["pandas"].DataFrame = object
        try:
            from arctic_inference.suffix_decoding import simulator
        finally:
            del sys.modules["pandas"]
    else:
        from arctic_inference.suffix_decoding import simulator
    return simulator.suffix_decode


@pytest.mark.skipif(not has_arctic, reason="Arctic Inference (optional extra) is not installed")
def test_arctic_adapter_equals_arctics_own_simulator(traces):
    """Replaying the adapter takes the steps Arctic's simulator takes on the same prompt and output: the same
    number of speculated and accepted tokens at every step (the simulator does not stop one token early for the
    bonus token, so its last step may accept one more)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    suffix_decode = _arctic_simulator()
    for k, depth, min_prob in [(15, 24, 0.1), (8, 64, 0.0)]:
        for t in traces:
            adapter = make_proposer(f"arctic-suffix:k={k},depth={depth},min_prob={min_prob}")
            # no budget cut: the simulator has no max_new_tokens
            ours = replay(t.prompt_ids, t.output_ids, adapter, max_new_tokens=len(t.output_ids) + k + 1,
                          request=t.prompt_id)
            cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=0)
            # the engine's first step comes after prefill: the first output token is part of the context
            theirs = suffix_decode(cache, 0, np.asarray([*t.prompt_ids, t.output_ids[0]], dtype=np.int32),
                                   np.asarray(t.output_ids[1:], dtype=np.int32), k, 1.0, min_prob, False, True)
            assert len(ours) == len(theirs), t.prompt_id
            assert [len(r.proposed) for r in ours] == [s["num_spec_toks"] for s in theirs], t.prompt_id
            assert [r.accepted for r in ours[:-1]] == [s["num_accept_toks"] for s in theirs[:-1]], t.prompt_id
            assert theirs[-1]["num_accept_toks"] - ours[-1].accepted in (0, 1)


@pytest.mark.skipif(not has_arctic, reason="Arctic Inference (optional extra) is not installed")
def test_arctic_adapter_restarts_and_drops_requests():
    adapter = make_proposer("arctic-suffix:k=4,min_prob=0")
    h = np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    first = adapter.propose([h], [4], keys=["a"])[0].tokens.tolist()
    assert first == [3, 4, 1, 2]
    # another request under the same key with a history that does not extend the last one: a fresh tree (with
    # the old one, the context 9 8 would match nothing); a 2-token match allows factor 1.0 x 2 = 2 tokens
    other = adapter.propose([np.array([9, 8, 7, 9, 8])], [4], keys=["a"])[0].tokens.tolist()
    assert other == [7, 9]
    adapter.propose([h], [4], keys=["b"])  # "a" absent from this call: finished, its tree dropped
    assert set(adapter.cache.active_requests) == {"b"}


def test_zoo_summary_and_agreement():
    steps = pl.DataFrame({"proposer": ["x"] * 4 + ["y"] * 4, "category": ["c", "c", "d", "d"] * 2,
                          "prompt_id": ["p", "p", "q", "q"] * 2, "step": [0, 1, 0, 1] * 2,
                          "proposed": [3, 0, 5, 5, 3, 0, 5, 5], "accepted": [2, 0, 5, 1, 2, 0, 4, 1],
                          "propose_ms": [0.1, 0.2, 0.3, 0.4] * 2})
    table = zoo.summarize(steps).filter(pl.col("proposer") == "x")
    c = table.filter(pl.col("category") == "c").row(0, named=True)
    assert c["tokens_per_step"] == pytest.approx((3 + 1) / 2) and c["accepted_per_draft"] == pytest.approx(2)
    assert c["draft_rate"] == pytest.approx(0.5)
    assert zoo.agreement(steps, "x", "y") == pytest.approx(3 / 4)
    geo = zoo.overall(steps).filter(pl.col("proposer") == "x")["tokens_per_step_geomean"][0]
    assert geo == pytest.approx(np.sqrt(2.0 * 4.0))


def test_missing_extras_are_reported_not_raised(monkeypatch):
    import hqlab.proposers.baselines as baselines

    real = baselines._extra

    def no_vllm(module, what, how):
        if module.startswith("vllm"):
            raise ImportError(f"{what} needs an optional extra that is not installed; {how}")
        return real(module, what, how)

    monkeypatch.setattr(baselines, "_extra", no_vllm)
    ok, missing = zoo.available({"vllm": "vllm-ngram", "lookup": "lookup"})
    assert list(ok) == ["lookup"] and "optional extra" in missing["vllm"]


@pytest.mark.skipif(not has_arctic, reason="Arctic Inference (optional extra) is not installed")
@pytest.mark.parametrize("cached, share", [(0, 0.985), (-1, 0.975)])
def test_arctic_rule_proposes_as_arctics_own_cache(cached, share):
    """hqlab's reimplementation of Arctic's rule (`arctic-rule`, hqlab.rules.suffix_decoding) against Arctic's
    compiled cache (`arctic-suffix`), asked at every output position of the committed corpus-workload traces: the
    same proposal nearly always (they differ where equally frequent continuations tie), the same tokens per step."""
    traces = load_traces(results.trace_files(["0.5b_corpus_128"])[0])
    compiled = make_proposer(f"arctic-suffix:k=15,cached={cached}")
    rule = make_proposer(f"arctic-rule:k=15,cached={cached}")
    same = total = 0
    for t in traces:
        h = np.asarray(t.prompt_ids + t.output_ids)
        for done in range(1, len(t.output_ids)):
            view, left = h[: len(t.prompt_ids) + done], t.max_new_tokens - done - 1
            a = compiled.propose([view], [left], keys=[t.prompt_id])[0]
            b = rule.propose([view], [left], keys=[t.prompt_id])[0]
            same += list(a.tokens) == list(b.tokens) and a.match_len == b.match_len
            total += 1
    assert total > 5000 and same / total >= share
    steps = zoo.run_zoo(traces, {"compiled": f"arctic-suffix:k=15,cached={cached}",
                                 "rule": f"arctic-rule:k=15,cached={cached}"}, repeats=1, progress=False)
    tps = dict(zoo.summarize(steps, group=("proposer",)).select("proposer", "tokens_per_step").iter_rows())
    assert tps["rule"] == pytest.approx(tps["compiled"], rel=0.005)

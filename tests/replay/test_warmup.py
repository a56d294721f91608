"""The corpus's warm-up and bound (hqlab.replay.warmup) on the committed traces of the corpus workloads and the
committed outputs of a vLLM batch-job point: bins pool exactly the replayed steps, the first request has no corpus
to draw from, a bound no stream reaches is the unbounded corpus, the search is priced for the corpus only, the knee
is the smallest bound near the best, and the replay reproduces vLLM's tokens a step on the served outputs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results
from hqlab.config import ConfigError
from hqlab.replay import corpus as rc
from hqlab.replay import corpus_vllm as cv
from hqlab.replay import warmup as wu
from hqlab.replay.traces import load_traces

SERVED = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=32768,corpus_policy=longest,corpus_prompts=1"


@pytest.fixture(scope="module")
def template():
    (path,) = results.trace_files(["0.5b_corpus_128"])
    return [t for t in load_traces(path) if t.category == "template"]


@pytest.fixture(scope="module")
def costs():
    return rc.step_models(results.load("step_cost", "h200"), model="qwen2.5-0.5b")


@pytest.fixture(scope="module")
def rows(template, costs):
    settings = [("lookup", wu.served(SERVED, tokens=0)), ("corpus", wu.served(SERVED))]
    return wu.replay_rows({"template": template}, settings, loads=(1,), costs={"template": costs})


def test_served_reads_the_gpu_spec():
    config = wu.served(SERVED, tokens=4096)
    assert (config.nmin, config.nmax, config.k, config.tie, config.tokens, config.choice, config.prompts) == \
        (1, 32, 15, "earliest", 4096, "longest", True)
    assert cv.gpu_spec(wu.served(SERVED)) == SERVED


def test_bins_start_at_their_edges():
    order = pl.Series("order", [0, 1, 2, 3, 4, 7, 8, 127, 128, 500])
    got = pl.select(wu.bin_of(pl.lit(order))).to_series().to_list()
    assert got == [0, 1, 2, 2, 4, 4, 8, 64, 128, 128]
    with pytest.raises(ConfigError):
        wu.bin_of(pl.col("order"), edges=(1, 2))


def test_a_bin_pools_the_replayed_steps_of_its_requests(template, rows):
    curve = wu.warmup(rows)
    requests = rc.replay_requests(template, wu.served(SERVED))
    for lo, hi in ((0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, len(template))):
        steps = [s for r in requests[lo:hi] for s in r.records]
        want = sum(s.accepted + 1 for s in steps) / len(steps)
        got = curve.filter((pl.col("label") == "corpus") & (pl.col("bin") == lo))
        assert got["requests"].item() == hi - lo
        assert got["tokens_per_step"].item() == pytest.approx(want, rel=1e-12)
        assert got["earlier"].item() == pytest.approx((lo + hi - 1) / 2)


def test_the_first_request_has_no_corpus_and_the_later_ones_gain(rows):
    curve = wu.warmup(rows).filter(pl.col("label") == "corpus")
    first = curve.filter(pl.col("bin") == 0)
    assert first["tokens_per_step_vs_lookup"].item() == 1.0
    assert first["speedup_vs_lookup"].item() == pytest.approx(1.0)
    # the template's records share their JSON structure: every later bin drafts more than the lookup alone
    assert curve.filter(pl.col("bin") > 0)["tokens_per_step_vs_lookup"].min() > 1.3


def test_a_bound_no_stream_reaches_is_the_unbounded_corpus(template):
    total = sum(len(t.prompt_ids) + len(t.output_ids) for t in template)
    settings = [("corpus", c) for c in wu.bounds(wu.served(SERVED), tokens=[total, 2 * total, 1024], docs=[4, 1024])]
    got = wu.by_bound(wu.replay_rows({"template": template}, settings))
    at = dict(zip(zip(got["tokens"], got["docs"]), got["tokens_per_step"]))
    assert at[(total, 1024)] == at[(2 * total, 1024)] == at[(-1, 1024)]
    assert at[(1024, 1024)] != at[(total, 1024)]  # a small bound evicts what later requests would draft from
    assert at[(-1, 4)] != at[(total, 1024)]


def test_the_search_is_priced_for_the_corpus_only(template, costs):
    settings = [("corpus", wu.served(SERVED)), ("arctic", replace(wu.VLLM_SUFFIX, cached=4))]
    got = wu.replay_rows({"t": template[:6]}, settings, costs={"t": costs})
    free, paid = wu.priced(got), wu.priced(got, search_ms_per_1k=0.5)
    extra = (paid["seconds"] - free["seconds"]).to_numpy()
    corpus = (got["rule"] == "corpus").to_numpy()
    assert np.allclose(extra[corpus], got.filter(pl.col("rule") == "corpus")["searched_tokens"].to_numpy() * 0.5 / 1e6)
    assert got.filter(pl.col("rule") == "corpus")["searched_tokens"].sum() > 0
    assert np.all(extra[~corpus] == 0)
    assert got.filter(pl.col("rule") == "arctic")["docs"].unique().to_list() == [4]


def test_the_knee_is_the_smallest_bound_near_the_best():
    bounded = pl.DataFrame({"stream": ["s"] * 5, "label": ["c"] * 5, "inflight": [1] * 5,
                            "tokens": [1024, 4096, 16384, 65536, -1], "docs": [1024] * 5,
                            "tokens_per_step": [3.0, 3.3, 3.39, 3.40, 3.40]})
    assert wu.knee(bounded)["knee"].item() == 16384
    assert wu.knee(bounded, within=0.05)["knee"].item() == 4096
    assert wu.knee(bounded, within=0.0)["knee"].item() == 65536
    assert wu.knee(bounded)["largest"].item() == 65536  # the unbounded row is no token bound


def test_the_replay_reproduces_vllm_on_the_served_batch_job():
    point = results.load("corpus", "c4c", "requests").filter(
        (pl.col("workload") == "batch") & (pl.col("load") == 8) & (pl.col("repeat") == 0))
    stream = cv.point_traces(point, workload="batch", load=8, config=SERVED)
    replayed = wu.replay_rows({"batch": stream}, [("hqlab corpus", wu.served(SERVED))], loads=(8,))
    measured = wu.measured_rows(point, stream="batch", label_of={SERVED: "measured"})
    assert measured.height == replayed.height == 153
    both = wu.warmup(replayed, measured=measured, edges=(0, 8, 64))
    pooled = both.group_by("label").agg((pl.col("tokens_per_step") * pl.col("steps")).sum() / pl.col("steps").sum())
    got = dict(pooled.iter_rows())
    assert got["hqlab corpus"] == pytest.approx(got["measured"], rel=0.005)
    per_bin = both.pivot(on="label", index="bin", values="tokens_per_step").sort("bin")
    assert per_bin["hqlab corpus"].to_list() == pytest.approx(per_bin["measured"].to_list(), rel=0.01)
    assert per_bin["measured"][0] < per_bin["measured"][1]  # the first wave has no outputs in its corpus


def test_vllm_suffix_is_vllms_default():
    speculative = pytest.importorskip("vllm.config.speculative")
    fields = speculative.SpeculativeConfig.__dataclass_fields__
    assert wu.VLLM_SUFFIX.depth == fields["suffix_decoding_max_tree_depth"].default
    assert wu.VLLM_SUFFIX.cached == fields["suffix_decoding_max_cached_requests"].default
    assert wu.VLLM_SUFFIX.factor == fields["suffix_decoding_max_spec_factor"].default
    assert wu.VLLM_SUFFIX.min_prob == fields["suffix_decoding_min_token_prob"].default
    assert wu.VLLM_SUFFIX.k == wu.VLLM_SUFFIX.depth  # vLLM sets num_speculative_tokens to the depth

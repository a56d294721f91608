"""Reading the vLLM corpus runs (`hqlab.bench.corpus_report`): the reader's own rules on small frames, and what holds
of every committed corpus run (data/results/corpus/<run>/, benchmarks/vllm_corpus.py finish). What each run
measured is stated in its claims.json (tests/bench/test_run_claims.py). No vLLM, no GPU."""

from __future__ import annotations

import json

import polars as pl
import pytest

from hqlab import plots
from hqlab.bench import corpus_report as cr
from hqlab.bench import results

BASE = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
CORPUS = f"{BASE},corpus=32768,corpus_policy=longest,corpus_prompts=1"


@pytest.mark.parametrize("run", results.runs("corpus"))
def test_a_committed_runs_points_count_the_requests_recorded_for_them(run):
    points, requests = results.load("corpus", run), results.load("corpus", run, "requests")
    per_point = requests.group_by("config", "workload", "load", "repeat").len()
    joined = per_point.join(points.select("config", "workload", "load", "repeat", "requests"),
                            on=["config", "workload", "load", "repeat"])
    assert joined.height == points.height and joined.filter(pl.col("len") != pl.col("requests")).is_empty()


@pytest.mark.parametrize("run", results.runs("corpus"))
def test_a_committed_runs_speedups_are_medians_of_its_points_ratios(run):
    """Every corpus point's own ratio lies inside the range `speedups` reports for its (workload, load), over the
    repeats the point had."""
    points = results.load("corpus", run)
    corpus_points = points.filter(pl.col("config").str.contains("corpus="))
    if not corpus_points.height:  # only where its corpus engines died, which the run's record names
        failed = json.loads(results.read_text("corpus", run, "raw.json")).get("failed", {})
        assert any("corpus=" in config for config in failed), f"{run}: no corpus points and no failed corpus engine"
        return
    got = {(r["config"], r["workload"], r["load"]): r for r in cr.speedups(points).iter_rows(named=True)}
    for row in corpus_points.iter_rows(named=True):
        s = got[(row["config"], row["workload"], row["load"])]
        assert s["vs_no_corpus_lo"] - 1e-12 <= row["vs_no_corpus"] <= s["vs_no_corpus_hi"] + 1e-12


# the reader on small frames


def _point(config, workload, load, repeat, tok_s, tps=1.0, exact=True):
    return {"run": "t", "config": config, "workload": workload, "load": load, "repeat": repeat,
            "decode_tok_s": tok_s, "tokens_per_step": tps, "corpus_step_share": 0.0,
            "replay_exact": None if config == "none" else exact}


def test_speedups_take_each_ratio_inside_its_repeat():
    base, corpus = "gpu-lookup:k=4", "gpu-lookup:k=4,corpus=64"
    rows = [_point("none", "template", 1, 0, 100.0), _point(base, "template", 1, 0, 200.0, 2.0),
            _point(corpus, "template", 1, 0, 300.0, 3.0),
            _point("none", "template", 1, 1, 50.0), _point(base, "template", 1, 1, 100.0, 2.0),
            _point(corpus, "template", 1, 1, 120.0, 3.0, exact=False),
            _point("none", "agent", 8, 0, 10.0), _point(base, "agent", 8, 0, 20.0), _point(corpus, "agent", 8, 0, 19.0),
            _point("none", "batch", 8, 0, 10.0), _point(base, "batch", 8, 0, 20.0), _point(corpus, "batch", 8, 0, 25.0)]
    out = {(r["workload"], r["load"]): r for r in cr.speedups(pl.DataFrame(rows)).iter_rows(named=True)}
    assert out[("batch", 8)]["bar"] == 1.3 and out[("batch", 8)]["vs_no_corpus"] == pytest.approx(1.25)  # the template's
    t = out[("template", 1)]
    assert t["config"] == corpus and t["base_config"] == base and t["repeats"] == 2
    assert (t["vs_no_corpus_lo"], t["vs_no_corpus_hi"]) == pytest.approx((1.2, 1.5))
    assert t["vs_no_corpus"] == pytest.approx(1.35)  # the median of 1.5 and 1.2, not 210 / 150 = 1.4
    assert t["vs_none"] == pytest.approx((3.0 + 2.4) / 2)
    assert not t["replay_exact"]  # one repeat's replay missed
    assert t["bar"] == 1.3 and t["meets"]
    a = out[("agent", 8)]
    assert a["vs_no_corpus"] == pytest.approx(0.95) and a["bar"] is None and a["meets"] is None and a["replay_exact"]


def test_without_corpus_finds_the_same_keys_in_any_order():
    labels = ["none", "gpu-lookup:k=15,nmin=1", "gpu-lookup:nmin=2,k=15"]
    assert cr.without_corpus("gpu-lookup:nmin=1,corpus=8,k=15,corpus_prompts=1", labels) == "gpu-lookup:k=15,nmin=1"
    assert cr.without_corpus("gpu-lookup:nmin=3,k=15,corpus=8", labels) is None
    assert cr.without_corpus("gpu-lookup:nmin=1,k=15", labels) is None and cr.without_corpus("none", labels) is None


def test_greedy_differences_compare_within_a_repeat_and_none_with_its_first_repeat():
    def req(config, repeat, order, ids):
        return {"run": "t", "config": config, "workload": "w", "load": 8, "repeat": repeat, "order": order,
                "output_ids": ids}

    rows = [req("none", 0, 0, [1, 2]), req("none", 0, 1, [3, 4]), req("none", 1, 0, [1, 2]), req("none", 1, 1, [3, 5]),
            req("s", 0, 0, [1, 2]), req("s", 0, 1, [3, 4]), req("s", 1, 0, [1, 2]), req("s", 1, 1, [3, 5])]
    out = {(r["config"], r["against"]): (r["requests"], r["differ"])
           for r in cr.greedy_differences(pl.DataFrame(rows)).iter_rows(named=True)}
    # `s` equals `none` of its own repeat everywhere, though repeat 1 differs from repeat 0
    assert out == {("s", "none"): (4, 0), ("none", "none, first repeat"): (2, 1)}


def test_ranges_chart_draws_each_rule_once_per_panel():
    frame = pl.DataFrame({"workload": ["a", "a", "b"], "panel": ["1", "8", "1"], "source": ["m", "m", "r"],
                          "y": [1.2, 1.1, 1.0], "lo": [1.1, 1.0, 1.0], "hi": [1.3, 1.2, 1.0]})
    spec = plots.ranges(frame, "workload", "y", "lo", "hi", "source", facet="panel",
                        rules={"1.3x": 1.3, "0.97x": 0.97}).to_dict()
    layers = spec["spec"]["layer"]
    assert [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in layers] == \
           ["rule", "point", "rule", "text", "rule", "text"]
    assert all(layer.get("transform") for layer in layers[2:])  # aggregated to one row: not one line per data row
    scale = layers[0]["encoding"]["y"]["scale"]
    assert scale["domain"][0] < 0.97 and scale["zero"] is False  # the rules inside the axis, which does not start at 0


def test_waves_split_at_the_load_and_pair_each_corpus_config_with_its_base():
    """Two requests at 2 in flight, then two more: the first two are the first wave; tokens per step pool the steps
    of all repeats, the stream rate is decoded tokens over decode time per repeat."""
    def rows(config, emitted, spans):
        return [{"run": "t", "config": config, "workload": "w", "load": 2, "repeat": 0, "order": i,
                 "step_emitted": e, "output_ids": list(range(sum(e))), "ttft_s": 0.0, "t_last": span}
                for i, (e, span) in enumerate(zip(emitted, spans))]
    base = rows(BASE, [[1, 1], [2], [1, 1, 1], [3]], [1.0, 1.0, 2.0, 2.0])
    corpus = rows(CORPUS, [[1, 1], [2], [3], [3]], [1.0, 1.0, 1.0, 0.5])
    got = {r["wave"]: r for r in cr.waves(pl.DataFrame(base + corpus)).iter_rows(named=True)}
    assert set(got) == {"first", "later"} and got["first"]["base_config"] == BASE
    assert got["first"]["tokens_per_step_ratio"] == pytest.approx(1.0) and got["first"]["stream"] == pytest.approx(1.0)
    assert got["later"]["base_tokens_per_step"] == pytest.approx(6 / 4)
    assert got["later"]["tokens_per_step"] == pytest.approx(3.0)
    assert got["later"]["stream"] == pytest.approx((4 / 1.5) / (4 / 4.0))


def test_label_names_a_corpus_config_in_a_few_words():
    assert cr.label(BASE) == "k=15"
    assert cr.label(CORPUS) == "k=15, corpus 32768 longest, prompts"
    assert cr.label("gpu-lookup:k=7,corpus=1024") == "k=7, corpus 1024 own, outputs only"
